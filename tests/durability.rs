//! Durability before acknowledgement: documents the `object_json` sink writes on `file://` are
//! `fsync`ed (file and directory) before the checkpoint that passes them is committed. Shown
//! with `strace -f -y -e trace=fsync,fdatasync` (scripts/test installs strace).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::json;

/// Documents the run writes: several batches of `pipeline()`'s 500 events.
const DOCUMENTS: u64 = 1200;

/// The `fsync`/`fdatasync` lines of a trace, each with the path `-y` printed for its descriptor.
fn synced_paths(trace: &str) -> Vec<String> {
    trace
        .lines()
        .filter(|l| l.contains("fsync(") || l.contains("fdatasync("))
        .filter_map(|l| {
            let start = l.find('<')? + 1;
            let end = start + l[start..].find('>')?;
            Some(l[start..end].to_owned())
        })
        .collect()
}

#[test]
fn documents_and_their_directory_are_synced_before_the_checkpoint_passes_them() {
    let strace_runs = Command::new("strace").arg("-V").output();
    assert!(
        strace_runs.is_ok_and(|o| o.status.success()),
        "strace is needed (scripts/test installs it)"
    );
    let dir = tempfile::tempdir().unwrap();
    let (log, out) = (dir.path().join("changes.jsonl"), dir.path().join("out"));
    let lines: Vec<String> = (0..DOCUMENTS)
        .map(|id| {
            json!({"before": null, "after": {"id": id, "name": format!("item {id}")}, "op": "c",
                   "source": {"schema": "public", "table": "items"}})
            .to_string()
        })
        .collect();
    write_lines(&log, &lines);
    let pipeline = pipeline(dir.path(), &log, &out, "");
    let trace_file = dir.path().join("trace.txt");
    let run = output(
        Command::new("strace")
            .args(["-f", "-y", "-e", "trace=fsync,fdatasync", "-o"])
            .arg(&trace_file)
            .arg(env!("CARGO_BIN_EXE_refract"))
            .args(["run", "--until-caught-up"])
            .arg(&pipeline)
            .env("RUST_LOG", "warn"),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_read_model(&expected_state(&lines), &out, "all documents");

    let synced = synced_paths(&std::fs::read_to_string(&trace_file).unwrap());
    let index_of = |path: &Path| synced.iter().position(|p| Path::new(p) == path);
    let last_checkpoint = synced
        .iter()
        .rposition(|p| p.ends_with("checkpoint.redb"))
        .expect("the checkpoint store is synced");
    let collection = out.join("items");
    let dir_synced = index_of(&collection).expect("the collection's directory is synced");
    assert!(dir_synced < last_checkpoint);
    for id in 0..DOCUMENTS {
        let file = collection.join(format!("{id}.json"));
        let at = index_of(&file).unwrap_or_else(|| panic!("{} is never synced", file.display()));
        assert!(
            at < last_checkpoint,
            "{} is synced after the checkpoint that passes it",
            file.display()
        );
    }
}
