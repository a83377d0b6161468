//! Crash safety: SIGKILL `refract run` at random moments while it follows a growing change log of
//! 100k events, restart it each time, and compare the final read model with the expected state
//! computed independently from the log: nothing missing, nothing stale, nothing that should be gone.

mod common;

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use common::*;

/// At least this many kills must hit a running process.
const KILLS: usize = 24;
/// Events in the change log.
const EVENTS: usize = 100_000;

#[test]
fn sigkill_at_random_moments_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let out = dir.path().join("out");
    let lines = change_log(EVENTS, 42);
    let pipeline = pipeline(dir.path(), &log, &out, "");
    std::fs::write(&log, b"").unwrap();

    let mut rng = Rng::new(7);
    let slice = lines.len().div_ceil(KILLS);
    let mut kills = 0;
    let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    for (i, part) in lines.chunks(slice).enumerate() {
        // Append this slice, leaving its last line half-written for a moment: the source must
        // wait for the newline rather than read half a line.
        let mut text = part.join("\n");
        text.push('\n');
        let cut = text.len() - 1 - rng.below(20) as usize;
        file.write_all(&text.as_bytes()[..cut]).unwrap();
        file.flush().unwrap();

        let mut daemon = Running::spawn(
            refract()
                .arg("run")
                .arg(&pipeline)
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
        );
        let child = daemon.child();
        std::thread::sleep(Duration::from_millis(20 + rng.below(400)));
        file.write_all(&text.as_bytes()[cut..]).unwrap();
        file.flush().unwrap();
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        match child.try_wait().unwrap() {
            None => {
                child.kill().unwrap(); // SIGKILL
                kills += 1;
            }
            Some(status) => {
                let mut err = String::new();
                std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                panic!("the daemon exited by itself in round {i} ({status}): {err}");
            }
        }
        child.wait().unwrap();
    }
    assert!(kills >= 20, "only {kills} kills hit a running process");

    // Catch up once more, then compare with the expected state.
    let done = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
    assert!(
        done.status.success(),
        "final run failed: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let expected = expected_state(&lines);
    assert_read_model(&expected, &out, &format!("after {kills} kills"));
    assert!(
        expected.len() > 1000,
        "the check covers a real read model ({} docs)",
        expected.len()
    );
    eprintln!(
        "{kills} SIGKILLs, {} events, {} documents equal to the expected state",
        lines.len(),
        expected.len()
    );
}

#[test]
fn sigterm_drains_checkpoints_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let out = dir.path().join("out");
    let lines = change_log(20_000, 9);
    write_lines(&log, &lines);
    let pipeline = pipeline(dir.path(), &log, &out, "");
    let summary = dir.path().join("summary.json");

    let mut daemon = Running::spawn(
        refract()
            .arg("run")
            .arg(&pipeline)
            .arg("--summary-json")
            .arg(&summary)
            .stdout(Stdio::piped()),
    );
    // Wait (bounded) until the daemon has caught up and is idle, following the file.
    let expected = expected_state(&lines);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !diff(&expected, &read_output_live(&out)).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon did not catch up within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    daemon.terminate();
    let result = daemon.wait_with_output();
    assert!(
        result.status.success(),
        "SIGTERM must exit 0, got {}",
        result.status
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
    assert_eq!(summary["stopped_by_signal"], true);
    // Drained: everything read was acknowledged, so the checkpoint is at the end of the log
    // (the daemon had caught up and was waiting for more).
    let log_len = std::fs::metadata(&log).unwrap().len();
    let checkpoint = summary["checkpoint"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()[0]
        .as_u64()
        .unwrap();
    assert_eq!(checkpoint, log_len);
    assert!(diff(&expected, &read_output(&out)).is_empty());
}

#[test]
fn a_sink_that_is_down_holds_the_checkpoint_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let out = dir.path().join("out");
    let lines = change_log(3_000, 11);
    write_lines(&log, &lines);
    let pipeline = pipeline(dir.path(), &log, &out, "");
    // The sink cannot create `out/items/`: a file is in the way. Every write to it fails.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("items"), b"not a directory").unwrap();
    let first_item_end: u64 = {
        let i = lines
            .iter()
            .position(|l| l.contains(r#""table":"items""#))
            .unwrap();
        lines[..=i].iter().map(|l| l.len() as u64 + 1).sum()
    };

    let mut daemon = Running::spawn(
        refract()
            .env("RUST_LOG", "warn")
            .arg("run")
            .arg(&pipeline)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    std::thread::sleep(Duration::from_millis(2500));
    daemon.terminate();
    let result = daemon.wait_with_output();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("failed, retrying"),
        "the sink is retried while down: {stderr}"
    );
    assert!(
        !result.status.success(),
        "stopping with undelivered changes is reported: {stderr}"
    );
    assert!(stderr.contains("undelivered changes"), "{stderr}");

    // The checkpoint did not pass the first change the sink could not write.
    let plan = output(refract().arg("plan").arg(&pipeline));
    let plan = String::from_utf8_lossy(&plan.stdout);
    let line = plan.lines().find(|l| l.contains("checkpoint:")).unwrap();
    if let Some(at) = line.split('@').nth(1) {
        let offset: u64 = at
            .trim_end_matches("))")
            .trim_end_matches(')')
            .parse()
            .unwrap();
        assert!(
            offset < first_item_end,
            "checkpoint {offset} passed the first undelivered change at {first_item_end}: {line}"
        );
    }

    // The sink comes back: everything arrives.
    std::fs::remove_file(out.join("items")).unwrap();
    let done = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert_read_model(&expected_state(&lines), &out, "after the sink came back");
}
