//! Bad input: each kind lands in the dead-letter store with its position and reason and the run
//! goes on; with `on_error = "stop"` the run stops loudly at the first one, after making
//! everything before it durable, and never skips it on a rerun.

mod common;

use common::*;
use serde_json::{Value, json};

/// Good lines around one bad line of each kind; returns (lines, [(bad line index, reason words)]).
fn log_with_bad_input() -> (Vec<String>, Vec<(usize, &'static str, &'static str)>) {
    let src = json!({"schema": "public", "table": "items"});
    let good = |id: u64, v: u64| {
        json!({"before": null, "after": {"id": id, "v": v}, "op": "c", "source": src}).to_string()
    };
    let decimal_bad_scale = json!({
        "schema": {"type": "struct", "fields": [{"field": "after", "type": "struct", "fields": [
            {"field": "id", "type": "int64"},
            {"field": "price", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal", "parameters": {"scale": "-3"}}]}]},
        "payload": {"before": null, "after": {"id": 77, "price": "AQ=="}, "op": "c", "source": src}
    })
    .to_string();
    let truncated = good(2, 2);
    let mut lines = vec![good(1, 1)];
    let mut bad = Vec::new();
    let mut push_bad =
        |lines: &mut Vec<String>, line: String, stage: &'static str, words: &'static str| {
            bad.push((lines.len(), stage, words));
            lines.push(line);
        };
    push_bad(
        &mut lines,
        truncated[..truncated.len() / 2].to_owned(),
        "decode",
        "truncated JSON",
    );
    lines.push(good(3, 3));
    push_bad(
        &mut lines,
        "this is not JSON".to_owned(),
        "decode",
        "invalid JSON",
    );
    push_bad(
        &mut lines,
        json!({"after": {"id": 4}, "op": "x", "source": src}).to_string(),
        "decode",
        "unknown op `x`",
    );
    push_bad(
        &mut lines,
        json!({"after": {"name": "no id"}, "op": "c", "source": src}).to_string(),
        "projection",
        "column `id` is missing",
    );
    push_bad(
        &mut lines,
        decimal_bad_scale,
        "decode",
        "Decimal scale \"-3\"",
    );
    push_bad(
        &mut lines,
        json!({"after": {"id": 9}, "op": "c", "source": {"table": "nobody_reads_me"}}).to_string(),
        "routing",
        "no projection reads table",
    );
    // Plenty of good input after the bad lines: none of it may be lost.
    for i in 0..2000 {
        lines.push(good(100 + i % 700, i));
    }
    (lines, bad)
}

/// Byte offset just past line `index` (the position refract assigns to it).
fn end_offset(lines: &[String], index: usize) -> u64 {
    lines[..=index].iter().map(|l| l.len() as u64 + 1).sum()
}

#[test]
fn bad_input_is_dead_lettered_with_position_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let out = dir.path().join("out");
    let dead = dir.path().join("dead.ndjson");
    let (lines, bad) = log_with_bad_input();
    write_lines(&log, &lines);
    let pipeline = pipeline(
        dir.path(),
        &log,
        &out,
        &format!("dead_letter = {{ path = \"{}\" }}", dead.display()),
    );

    let run = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains(&format!("dead letters   {}", bad.len())),
        "{stdout}"
    );

    let entries: Vec<Value> = std::fs::read_to_string(&dead)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(entries.len(), bad.len(), "{entries:#?}");
    for ((index, stage, words), entry) in bad.iter().zip(&entries) {
        assert_eq!(
            entry["position"]["offset"][0].as_u64(),
            Some(end_offset(&lines, *index)),
            "{entry}"
        );
        assert_eq!(
            entry["position"]["partition"],
            format!("file:{}", log.display())
        );
        assert_eq!(entry["stage"], *stage, "{entry}");
        assert!(
            entry["reason"].as_str().unwrap().contains(words),
            "want {words:?} in {entry}"
        );
        assert_eq!(entry["raw"], lines[*index], "the raw input is kept");
    }

    // Everything good, before and after the bad lines, is in the read model.
    let good: Vec<String> = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| !bad.iter().any(|b| b.0 == *i))
        .map(|(_, l)| l.clone())
        .collect();
    assert_read_model(
        &expected_state(&good),
        &out,
        "good input around the bad lines",
    );

    // A rerun reads nothing new; a full replay (state deleted, as after a crash before any
    // checkpoint) finds the entries already recorded and does not write them twice.
    for delete_state in [false, true] {
        if delete_state {
            std::fs::remove_dir_all(dir.path().join("state")).unwrap();
        }
        let again = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
        assert!(again.status.success());
        assert_eq!(
            std::fs::read_to_string(&dead).unwrap().lines().count(),
            bad.len(),
            "replay after state deletion: {delete_state}"
        );
    }
}

#[test]
fn on_error_stop_stops_loudly_and_never_skips() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let out = dir.path().join("out");
    let (lines, bad) = log_with_bad_input();
    write_lines(&log, &lines);
    let pipeline = pipeline(dir.path(), &log, &out, "on_error = \"stop\"");
    let first_bad = end_offset(&lines, bad[0].0);

    for attempt in 0..2 {
        let run = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(3), "attempt {attempt}: {stderr}");
        assert!(
            stderr.contains(&format!("bad input at file:{}@{first_bad}", log.display())),
            "{stderr}"
        );
        assert!(stderr.contains("truncated JSON"), "{stderr}");
        // What came before the bad line is written; nothing after it.
        let docs = read_output(&out);
        assert_eq!(
            docs.keys().map(|(_, k)| k.as_str()).collect::<Vec<_>>(),
            vec!["1"],
            "attempt {attempt}"
        );
    }
}
