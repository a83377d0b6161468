//! Durability before acknowledgement, on `file://`, shown with `strace -f -y -e
//! trace=fsync,fdatasync` (scripts/test installs strace):
//! - documents the `object_json` sink writes are `fsync`ed (file and directory) before the
//!   checkpoint that passes them is committed;
//! - so are the Parquet sink's change-log files and the directories created for them, and
//!   `current/` after a compaction;
//! - the tiers' cold files: the late file before the checkpoint that passes it, and every file an
//!   aging run exports before the run drops the warm partition it came from.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::parquet::{envelope, file_pipeline, order};
use common::tiers_aging::{DAY, HOUR, TierDb, instant, shipped_pipeline};
use common::*;
use serde_json::json;

/// Documents the run writes: several batches of `pipeline()`'s 500 events.
const DOCUMENTS: u64 = 1200;

/// The `fsync`/`fdatasync` lines of a trace, each with the path `-y` printed for its descriptor.
fn synced_paths(trace: &str) -> Vec<String> {
    trace.lines().filter_map(synced_path).collect()
}

/// The path a `fsync`/`fdatasync` line syncs.
fn synced_path(line: &str) -> Option<String> {
    if !line.contains("fsync(") && !line.contains("fdatasync(") {
        return None;
    }
    let start = line.find('<')? + 1;
    let end = start + line[start..].find('>')?;
    Some(line[start..end].to_owned())
}

/// The lines of a trace in order: the path of a sync, or the line itself for other calls.
fn trace_events(trace: &str) -> Vec<String> {
    trace
        .lines()
        .map(|l| synced_path(l).unwrap_or_else(|| l.to_owned()))
        .collect()
}

/// Runs `command` under strace, tracing the syscalls `trace` names (`-e trace=…`, strings up to
/// 200 bytes); returns its output and the trace.
fn traced(command: &Command, trace: &str) -> (Output, String) {
    let strace_runs = Command::new("strace").arg("-V").output();
    assert!(
        strace_runs.is_ok_and(|o| o.status.success()),
        "strace is needed (scripts/test installs it)"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("trace.txt");
    let mut strace = Command::new("strace");
    strace
        .args(["-f", "-y", "-s", "200", "-e"])
        .arg(format!("trace={trace}"))
        .arg("-o")
        .arg(&file)
        .arg(command.get_program())
        .args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => strace.env(key, value),
            None => strace.env_remove(key),
        };
    }
    let out = output(&mut strace);
    (out, std::fs::read_to_string(&file).unwrap())
}

/// Where `path` is first synced in `synced`, failing the test when it never is.
fn first_sync(synced: &[String], path: &Path) -> usize {
    synced
        .iter()
        .position(|p| Path::new(p) == path)
        .unwrap_or_else(|| {
            let near: Vec<&String> = synced
                .iter()
                .filter(|p| path.parent().is_some_and(|d| Path::new(p).starts_with(d)))
                .collect();
            panic!(
                "{} is never synced (of {} syncs, these are beside it: {near:?})",
                path.display(),
                synced.len()
            )
        })
}

/// Where the checkpoint store is last synced.
fn last_checkpoint(synced: &[String]) -> usize {
    synced
        .iter()
        .rposition(|p| p.ends_with("checkpoint.redb"))
        .expect("the checkpoint store is synced")
}

/// Every file named `*.parquet` under `dir`.
fn parquet_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(parquet_files(&path));
        } else if path.extension().is_some_and(|e| e == "parquet") {
            found.push(path);
        }
    }
    found
}

/// `file` and each directory from it up to `root` are synced before `before` in `synced`.
fn assert_synced_with_directories(synced: &[String], file: &Path, root: &Path, before: usize) {
    for path in file.ancestors().take_while(|a| a.starts_with(root)) {
        let at = first_sync(synced, path);
        assert!(
            at < before,
            "{} is synced only after the step that needs it durable",
            path.display()
        );
    }
}

#[test]
fn documents_and_their_directory_are_synced_before_the_checkpoint_passes_them() {
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
    let (run, trace) = traced(
        refract()
            .args(["run", "--until-caught-up"])
            .arg(&pipeline)
            .env("RUST_LOG", "warn"),
        "fsync,fdatasync",
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_read_model(&expected_state(&lines), &out, "all documents");

    let synced = synced_paths(&trace);
    let last_checkpoint = last_checkpoint(&synced);
    let collection = out.join("items");
    assert!(first_sync(&synced, &collection) < last_checkpoint);
    for id in 0..DOCUMENTS {
        let file = collection.join(format!("{id}.json"));
        assert!(
            first_sync(&synced, &file) < last_checkpoint,
            "{} is synced after the checkpoint that passes it",
            file.display()
        );
    }
}

/// The Parquet change log's files and the directories made for them
/// (`{table}/changes/date=…`), and `current/`, which the run compacts when it ends.
#[test]
fn parquet_change_files_their_new_directories_and_the_current_state_are_synced() {
    let dir = tempfile::tempdir().unwrap();
    let (log, out) = (dir.path().join("changes.jsonl"), dir.path().join("out"));
    let lines: Vec<String> = (0..60u64)
        .map(|i| {
            let id = format!("o{i}");
            let doc = order(&id, (i % 4) as u32, (i % 3 + 1) as usize, json!({}));
            envelope("c", &id, None, Some(doc), 10 * (i + 1))
        })
        .collect();
    write_lines(&log, &lines);
    let pipeline = file_pipeline(dir.path(), &log, &out, 20, "roll_rows = 1", false);
    let (run, trace) = traced(
        refract().arg("run").arg(&pipeline).env("RUST_LOG", "warn"),
        "fsync,fdatasync",
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let synced = synced_paths(&trace);
    let checkpoint = last_checkpoint(&synced);
    let changes: Vec<PathBuf> = parquet_files(&out)
        .into_iter()
        .filter(|f| f.components().any(|c| c.as_os_str() == "changes"))
        .collect();
    assert!(changes.len() >= 3, "a file per batch: {changes:?}");
    for file in &changes {
        assert_synced_with_directories(&synced, file, &out, checkpoint);
    }

    // A run compacts when it ends: `current/` is synced too.
    for table in ["orders", "customers", "order_items"] {
        let current = out.join(table).join("current/part-0.parquet");
        assert_synced_with_directories(&synced, &current, &out, synced.len());
    }
}

/// The cold tier on `file://`: the late file (heartbeats already cold on arrival) is synced
/// before the checkpoint that passes it, and every file an aging run exports, with its
/// directories, before the run's `DROP TABLE` of the warm partitions it exported.
#[test]
fn cold_files_are_synced_before_the_checkpoint_and_before_aging_drops_their_partition() {
    let db = TierDb::new("durable_cold");
    let pipeline = shipped_pipeline();
    let t0 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z
    db.sql(&format!(
        "INSERT INTO device_heartbeats \
         SELECT 'dev-' || d, '{}'::timestamptz + k * interval '1 hour', 'EU', 0.5, -50, 45.0, 5.0 \
         FROM generate_series(1, 3) d, generate_series(0, 47) k",
        instant(t0)
    ));
    db.catch_up(&pipeline, t0 + DAY);
    // Changed 40 days on: older than the warm window, so these go to the late files.
    db.sql(&format!(
        "UPDATE device_heartbeats SET battery = 0.25 WHERE ts < '{}'",
        instant(t0 + 3 * HOUR)
    ));
    let clock = t0 + 40 * DAY;
    let mut run = db.refract(clock, None);
    run.args(["run", "--until-caught-up"]).arg(&pipeline);
    let (out, trace) = traced(&run, "fsync,fdatasync");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let synced = synced_paths(&trace);
    let cold = db.cold();
    let late = parquet_files(&cold);
    assert_eq!(late.len(), 3, "a late file per device: {late:?}");
    for file in &late {
        assert_synced_with_directories(&synced, file, &cold, last_checkpoint(&synced));
    }

    // The DROP is read from the traced `sendto`: in plain text, so without TLS (the default
    // `sslmode=prefer` would encrypt it).
    let plain = format!("{}?sslmode=disable", db.url);
    let mut age = db.refract(clock, Some(&plain));
    age.arg("tiers").arg(&pipeline).arg("age");
    let (out, trace) = traced(&age, "fsync,fdatasync,sendto,write,writev");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events = trace_events(&trace);
    let aged: Vec<PathBuf> = parquet_files(&cold)
        .into_iter()
        .filter(|f| {
            f.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("aged-")
        })
        .collect();
    assert_eq!(aged.len(), 6, "two days of three devices: {aged:?}");
    for file in &aged {
        // A run ages one day: the partitions of that day are dropped after its files are synced.
        let day = file
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()["date=".len()..]
            .to_owned();
        let drop = events
            .iter()
            .position(|e| e.contains("DROP TABLE") && e.contains(&format!("_p{day}")))
            .unwrap_or_else(|| panic!("no aging run drops the partitions of {day}"));
        assert_synced_with_directories(&events, file, &cold, drop);
    }
}
