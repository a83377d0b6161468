//! The PostgreSQL source against the real local PostgreSQL (`PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/refract`, in logical mode: `scripts/test` prepares it).
//! Each test works on its own table, slot and publication.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::pg::{drop_slot, psql, url as pg_url};
use common::pg_table::*;
use common::*;
use serde_json::Value;

/// A fresh table `name`, a pipeline replicating it into `{dir}/out`, and a first run that creates
/// the slot (changes from then on are streamed). Returns (dir, out, pipeline).
fn setup(name: &str) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    fresh_table(name);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file(dir.path(), name, &out);
    catch_up(&pipeline);
    (dir, out, pipeline)
}

fn pipeline_file(dir: &Path, name: &str, out: &Path) -> std::path::PathBuf {
    pipeline_file_with(dir, name, out, "")
}

/// `pipeline_file` with extra lines in `[source]`.
fn pipeline_file_with(
    dir: &Path,
    name: &str,
    out: &Path,
    source_extra: &str,
) -> std::path::PathBuf {
    let sink = common::pg::object_json_sink("docs", out);
    common::pg::replica_pipeline(dir, name, &pg_url(), source_extra, &["docs"], &sink)
}

fn catch_up(pipeline: &Path) {
    let run = output(refract().arg("run").arg(pipeline).arg("--until-caught-up"));
    assert!(
        run.status.success(),
        "catch-up failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn replicates_inserts_updates_deletes_and_transactions() {
    let name = "pg_basic";
    let (_dir, out, pipeline) = setup(name);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'item ' || g, g % 7, g * 1.25, NULL FROM generate_series(1, 500) g;
         UPDATE {name} SET qty = qty + 100, note = 'it''s \"quoted\"' WHERE id % 3 = 0;
         DELETE FROM {name} WHERE id % 5 = 0;
         BEGIN; UPDATE {name} SET price = 12345678901.99 WHERE id = 1; DELETE FROM {name} WHERE id = 2; COMMIT;
         BEGIN; DELETE FROM {name} WHERE id = 3; ROLLBACK;
         UPDATE {name} SET id = 100004 WHERE id = 4;
         BEGIN; UPDATE {name} SET id = 100006, name = 'moved' WHERE id = 6; UPDATE {name} SET id = 6 WHERE id = 7; COMMIT;"
    ));
    catch_up(&pipeline);
    assert_read_model(&table_state(name), &out, "after catch-up");
    assert_eq!(
        read_output(&out)[&(name.to_owned(), "1".to_owned())]["price"],
        "12345678901.99",
        "numeric keeps every digit"
    );
    // The run confirms its final checkpoint to the slot before it exits (else the slot lags
    // and retains WAL until the next run).
    let before_last = psql("SELECT pg_current_wal_lsn()");
    psql(&format!("UPDATE {name} SET qty = 0 WHERE id = 1"));
    catch_up(&pipeline);
    assert_eq!(
        psql(&format!(
            "SELECT confirmed_flush_lsn > '{before_last}'::pg_lsn FROM pg_replication_slots WHERE slot_name = 'refract_{name}'"
        )),
        "t",
        "the slot was confirmed past the last transaction"
    );
    assert_read_model(&table_state(name), &out, "after the last update");

    drop_slot(name);
}

#[test]
fn sigkill_under_a_writer_loses_nothing_and_state_loss_resumes_from_the_slot() {
    let name = "pg_crash";
    let (dir, out, pipeline) = setup(name);

    // A writer commits inserts, updates and deletes (one transaction of 200,000 inserts among
    // them; 100,000 in CI).
    let bulk = size(100_000, 200_000);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rng = Rng::new(5);
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let id = rng.below(3000);
                let sql = match round % 10 {
                    0 if round == 30 => format!(
                        "INSERT INTO {name} SELECT g, 'bulk ' || g, 1, 1.00, repeat('x', 100) FROM generate_series(100000, 100000 + {bulk} - 1) g ON CONFLICT (id) DO NOTHING"
                    ),
                    0..=5 => format!(
                        "INSERT INTO {name} VALUES ({id}, 'n{round}', {q}, {p}.{c:02}, NULL) ON CONFLICT (id) DO UPDATE SET name = excluded.name, qty = excluded.qty",
                        q = rng.below(50),
                        p = rng.below(1000),
                        c = rng.below(100)
                    ),
                    6..=7 => format!(
                        "UPDATE {name} SET qty = coalesce(qty, 0) + 1, note = 'r{round}' WHERE id % 97 = {}",
                        id % 97
                    ),
                    _ => format!(
                        "DELETE FROM {name} WHERE id = {id} OR id = {}",
                        100000 + rng.below(bulk)
                    ),
                };
                psql(&sql);
            }
            round
        })
    };

    let mut rng = Rng::new(3);
    let mut kills = 0;
    while kills < 20 {
        if run_and_kill(&pipeline, Duration::from_millis(300 + rng.below(900))) {
            kills += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    catch_up(&pipeline);
    let expected = table_state(name);
    assert_read_model(&expected, &out, &format!("after {kills} kills"));
    assert!(
        expected.len() as u64 > bulk * 9 / 10,
        "the bulk transaction of {bulk} rows is in ({} rows)",
        expected.len()
    );

    // Restart with the checkpoint store deleted: the slot's confirmed position is the resume point.
    std::fs::remove_dir_all(dir.path().join("state")).unwrap();
    psql(&format!(
        "UPDATE {name} SET name = 'after state loss' WHERE id % 11 = 0; DELETE FROM {name} WHERE id % 13 = 0"
    ));
    catch_up(&pipeline);
    assert_read_model(&table_state(name), &out, "after deleting the state");
    eprintln!(
        "{kills} SIGKILLs during {rounds} writer transactions; {} rows equal",
        expected.len()
    );
    drop_slot(name);
}

#[test]
fn a_huge_transaction_killed_halfway_resumes_inside_it() {
    let name = "pg_bulk";
    let (_dir, out, pipeline) = setup(name);
    // 200k changes of one transaction share its commit LSN; only the sequence tells them apart.
    // 200k rows here; 100k in CI (CI=true) to keep the suite short.
    let rows = if std::env::var_os("CI").is_some() {
        100_000
    } else {
        200_000
    };
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'bulk ' || g, g % 10, g / 100.0, NULL FROM generate_series(1, {rows}) g"
    ));
    let count = || std::fs::read_dir(out.join(name)).map_or(0, |d| d.count());
    let started = std::time::Instant::now();
    let mut kills = 0;
    let mut checkpoint_inside = false;
    for threshold in [rows / 10, rows * 3 / 10, rows * 11 / 20, rows * 4 / 5] {
        let mut daemon = quiet_daemon(&pipeline);
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while count() < threshold && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let child = daemon.child();
        if child.try_wait().unwrap().is_none() && count() < rows {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
        // The checkpoint may hold a position inside the transaction: `pg:slot@LSN.SEQ`.
        let plan = String::from_utf8_lossy(&output(refract().arg("plan").arg(&pipeline)).stdout)
            .into_owned();
        let seq = plan
            .split("@")
            .nth(1)
            .and_then(|p| p.split(['.', ')']).nth(1))
            .unwrap_or("");
        checkpoint_inside |= seq.parse::<u64>().is_ok_and(|n| n > 0);
        eprintln!(
            "{:?} threshold {threshold}: {} documents, checkpoint sequence {seq:?}",
            started.elapsed(),
            count()
        );
    }
    assert!(
        kills >= 3,
        "only {kills} kills landed inside the transaction"
    );
    assert!(
        checkpoint_inside,
        "no checkpoint inside the transaction was seen"
    );
    eprintln!("{:?} catching up", started.elapsed());
    catch_up(&pipeline);
    assert_read_model(
        &table_state(name),
        &out,
        "after resuming inside the transaction",
    );
    drop_slot(name);
}

#[test]
fn unchanged_toast_values_are_kept_with_either_replica_identity() {
    let name = "pg_toast";
    let (dir, out, pipeline) = setup(name);
    // 8 KB of random text does not compress: PostgreSQL stores it out of line (TOAST).
    psql(&format!(
        "ALTER TABLE {name} ALTER COLUMN note SET STORAGE EXTERNAL;
         INSERT INTO {name} VALUES (1, 'full', 1, 1.00, (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 256)));
         INSERT INTO {name} VALUES (2, 'default', 1, 1.00, (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 256)));"
    ));
    catch_up(&pipeline);
    // REPLICA IDENTITY FULL: the old row carries the value; the read model keeps the text.
    psql(&format!(
        "ALTER TABLE {name} REPLICA IDENTITY FULL; UPDATE {name} SET qty = 2 WHERE id = 1;"
    ));
    catch_up(&pipeline);
    let doc = &read_output(&out)[&(name.to_owned(), "1".to_owned())];
    assert_eq!(doc["qty"], 2);
    assert_eq!(
        doc["note"].as_str().map(str::len),
        Some(8192),
        "the TOASTed text survived the update"
    );
    // DEFAULT identity: the value is not sent; refract re-reads it by key. A second update in
    // the same transaction changes the text: the read model ends with the newest one.
    psql(&format!(
        "ALTER TABLE {name} REPLICA IDENTITY DEFAULT; UPDATE {name} SET qty = 3 WHERE id = 2;"
    ));
    catch_up(&pipeline);
    let doc = &read_output(&out)[&(name.to_owned(), "2".to_owned())];
    assert_eq!(doc["qty"], 3);
    assert_eq!(
        doc["note"].as_str().map(str::len),
        Some(8192),
        "the read model still holds the text"
    );
    psql(&format!(
        "BEGIN; UPDATE {name} SET qty = 4 WHERE id = 2; UPDATE {name} SET note = 'short' WHERE id = 1; COMMIT;"
    ));
    catch_up(&pipeline);
    assert_read_model(&table_state(name), &out, "after TOAST updates");
    let dead =
        std::fs::read_to_string(dir.path().join(format!("state/{name}/dead-letters.ndjson")))
            .unwrap_or_default();
    assert!(dead.trim().is_empty(), "nothing was dead-lettered: {dead}");
    drop_slot(name);
}

/// Rows in CI (`CI=true`) and in a full local run.
fn size(ci: u64, full: u64) -> u64 {
    if in_ci() {
        ci
    } else {
        std::env::var("REFRACT_TEST_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(full)
    }
}

/// After a backfill under [`update_delete_load`]: catches up, and the read model equals the table.
fn assert_backfilled_under_load(
    name: &str,
    rows: u64,
    pipeline: &Path,
    out: &Path,
    how: &str,
    took: Duration,
    load_running: bool,
) {
    catch_up(pipeline);
    let expected = table_state(name);
    assert!(
        (expected.len() as u64) < rows,
        "the load deleted rows ({} of {rows} left)",
        expected.len()
    );
    assert_read_model(&expected, out, "after the backfill under load");
    eprintln!(
        "backfill {how} of {rows} rows took {:.1}s with 500 updates/deletes per second running (load still running at its end: {load_running}); {} rows equal",
        took.as_secs_f64(),
        expected.len()
    );
}

#[test]
fn the_initial_snapshot_reads_existing_rows_and_resumes_after_sigkill() {
    let name = "pg_snapshot";
    fresh_table(name);
    let rows = size(40_000, 100_000);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'row ' || g, g % 13, g * 0.25, CASE WHEN g % 4 = 0 THEN NULL ELSE 'n' || g END \
         FROM generate_series(1, {rows}) g"
    ));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file_with(dir.path(), name, &out, "chunk_rows = 1000");
    let state = dir.path().join(format!("state/{name}"));
    let snapshot_rows = || -> Option<u64> {
        let text = std::fs::read_to_string(state.join("snapshot.json")).ok()?;
        let v: Value = serde_json::from_str(&text).unwrap();
        v["tables"]
            .as_array()
            .map(|t| t.iter().map(|t| t["rows"].as_u64().unwrap()).sum())
    };
    let spawn = || quiet_daemon(&pipeline);
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };

    // 1. The first run creates the slot and reads the exported snapshot with COPY; it is killed
    //    once more than 10,000 rows (the first note of the key reached) are in the read model.
    let mut daemon = spawn();
    wait_for("12,000 documents", &|| {
        std::fs::read_dir(out.join(name)).map_or(0, |d| d.count()) >= 12_000
    });
    daemon.child().kill().unwrap();
    daemon.child().wait().unwrap();
    assert!(
        state.join("snapshot-copy.json").exists(),
        "killed inside the COPY phase"
    );
    psql(&format!(
        "UPDATE {name} SET name = 'changed' WHERE id % 1000 = 1;
         DELETE FROM {name} WHERE id % 997 = 1;
         INSERT INTO {name} VALUES ({id}, 'new', 1, 1.00, NULL);",
        id = rows + 1
    ));

    // 2. Restarts resume after the last noted key that was durable, in chunks, not from zero;
    //    killed again at random moments, with writes in between.
    let mut rng = Rng::new(11);
    let mut kills = 1;
    let mut progress = Vec::new();
    for round in 0..5u64 {
        let mut daemon = spawn();
        psql(&format!(
            "UPDATE {name} SET name = 'changed {round}' WHERE id % 1000 = {round};
             DELETE FROM {name} WHERE id % 997 = {round};
             INSERT INTO {name} VALUES ({id}, 'new', 1, 1.00, NULL) ON CONFLICT (id) DO NOTHING;",
            id = rows + 2 + round
        ));
        std::thread::sleep(Duration::from_millis(300 + rng.below(700)));
        let child = daemon.child();
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
        progress.push(snapshot_rows().unwrap_or(0));
    }
    assert!(
        progress[0] >= 10_000,
        "the chunked rest started after the first noted key, not from zero: {progress:?}"
    );
    assert!(
        progress.windows(2).all(|w| w[0] <= w[1]),
        "snapshot progress never goes back: {progress:?}"
    );
    catch_up(&pipeline);
    let expected = table_state(name);
    assert_read_model(
        &expected,
        &out,
        &format!("after the snapshot and {kills} kills"),
    );
    let done: Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("snapshot.json")).unwrap())
            .unwrap();
    assert_eq!(done["complete"], true);
    assert!(!state.join("snapshot-copy.json").exists());
    eprintln!(
        "snapshot of {rows} rows, {kills} SIGKILLs (the first inside COPY), chunk progress after each restart: {progress:?}; {} rows equal",
        expected.len()
    );
    drop_slot(name);
}

#[test]
fn the_initial_snapshot_is_consistent_with_writes_during_it() {
    let name = "pg_snapshot_live";
    let rows = size(20_000, 50_000);
    filled_table(name, rows);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file(dir.path(), name, &out);
    // Updates and deletes run while the first run creates the slot and reads the snapshot.
    let mut load = update_delete_load(name, rows, 200, 8);
    std::thread::sleep(Duration::from_millis(500));
    let mut daemon = quiet_daemon(&pipeline);
    assert!(load.child().wait().unwrap().success(), "pgbench failed");
    daemon.terminate();
    assert!(daemon.child().wait().unwrap().success());
    catch_up(&pipeline);
    let expected = table_state(name);
    assert!((expected.len() as u64) < rows, "the load deleted rows");
    assert_read_model(&expected, &out, "after a snapshot under load");
    drop_slot(name);
}

#[test]
fn backfill_while_the_daemon_streams_under_update_and_delete_load() {
    let name = "pg_backfill";
    let rows = size(40_000, 1_000_000);
    filled_table(name, rows);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // No initial snapshot: the read model starts empty and only the backfill fills it.
    let pipeline = pipeline_file_with(
        dir.path(),
        name,
        &out,
        "snapshot = \"never\"\nchunk_rows = 2000",
    );
    catch_up(&pipeline);
    assert!(read_output(&out).is_empty(), "nothing before the backfill");

    let log = dir.path().join("daemon.log");
    let mut daemon = logged_daemon(&pipeline, &log);
    // 250 transactions/s of one update and one delete each: 500 changes/s, for longer than the
    // backfill takes (it is stopped when the backfill is done).
    let seconds = (10 + rows / 2_000) as u32;
    let load = update_delete_load(name, rows, 250, seconds);
    std::thread::sleep(Duration::from_secs(2));
    let started = std::time::Instant::now();
    let backfill = output(refract().arg("backfill").arg(&pipeline));
    assert!(
        backfill.status.success(),
        "backfill failed: {}",
        String::from_utf8_lossy(&backfill.stderr)
    );
    let stdout = String::from_utf8_lossy(&backfill.stdout);
    assert!(stdout.contains("applied by the running daemon"), "{stdout}");
    let load_running = stop_load(load);
    daemon.terminate();
    assert!(daemon.child().wait().unwrap().success());
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("backfill read from its exported snapshot"),
        "the daemon read the rows from an exported snapshot: {log}"
    );
    assert_backfilled_under_load(
        name,
        rows,
        &pipeline,
        &out,
        "beside the daemon",
        started.elapsed(),
        load_running,
    );
    drop_slot(name);
}

/// `refract run` on `pipeline`, its JSON log at info level in `log`.
fn logged_daemon(pipeline: &Path, log: &Path) -> Running {
    Running::spawn(
        refract()
            .env("RUST_LOG", "info")
            .args(["--log-format", "json", "run"])
            .arg(pipeline)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap()),
    )
}

/// Waits until the backfill being read in `dir`'s state has noted a key it reached.
fn wait_for_backfill_notes(dir: &Path, name: &str) {
    let notes = dir.join(format!("state/{name}/backfill-copy.json"));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&notes).is_ok_and(|t| t.contains("\"marks\":[[")) {
        assert!(
            std::time::Instant::now() < deadline,
            "the backfill made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_backfill_asked_of_the_daemon_survives_sigkills_of_the_daemon() {
    let name = "pg_backfill_kill";
    let rows = size(60_000, 300_000);
    filled_table(name, rows);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file_with(dir.path(), name, &out, "snapshot = \"never\"");
    catch_up(&pipeline);
    let backfill_state = dir.path().join(format!("state/{name}/backfill.json"));
    // Longer than either half takes on a loaded machine; stopped when each half is done.
    let load_seconds = 900;
    let load = update_delete_load(name, rows, 250, load_seconds);

    // 1. The daemon is killed halfway and started again: it resumes the backfill, and the
    //    `refract backfill` following it sees it through.
    let mut daemon = logged_daemon(&pipeline, &dir.path().join("daemon-1.log"));
    std::thread::sleep(Duration::from_secs(2));
    let asker = Running::spawn(
        refract()
            .arg("backfill")
            .arg(&pipeline)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    wait_for_backfill_notes(dir.path(), name);
    daemon.child().kill().unwrap();
    daemon.child().wait().unwrap();
    let noted = std::fs::read_to_string(&backfill_state).unwrap();
    assert!(
        noted.contains("\"complete\": false"),
        "killed halfway: {noted}"
    );
    let log = dir.path().join("daemon-2.log");
    let mut daemon = logged_daemon(&pipeline, &log);
    let asked = asker.wait_with_output();
    let stdout = String::from_utf8_lossy(&asked.stdout);
    assert!(
        asked.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&asked.stderr)
    );
    assert!(stdout.contains("applied by the running daemon"), "{stdout}");
    assert!(stop_load(load), "the load ran throughout");
    daemon.terminate();
    assert!(daemon.child().wait().unwrap().success());
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("resuming an interrupted"),
        "the restarted daemon resumed: {log}"
    );
    catch_up(&pipeline);
    assert_read_model(
        &table_state(name),
        &out,
        "after the daemon resumed the backfill",
    );

    // 2. The daemon is killed and stays down: `refract backfill` finishes the rest itself.
    let load = update_delete_load(name, rows, 250, load_seconds);
    let mut daemon = logged_daemon(&pipeline, &dir.path().join("daemon-3.log"));
    std::thread::sleep(Duration::from_secs(2));
    let started = std::time::Instant::now();
    let asker = Running::spawn(
        refract()
            .arg("backfill")
            .arg(&pipeline)
            .arg("--restart")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    wait_for_backfill_notes(dir.path(), name);
    daemon.child().kill().unwrap();
    daemon.child().wait().unwrap();
    let asked = asker.wait_with_output();
    let stderr = String::from_utf8_lossy(&asked.stderr);
    assert!(asked.status.success(), "{stderr}");
    assert!(
        stderr.contains("applying the rest of the backfill in this one"),
        "{stderr}"
    );
    let load_running = stop_load(load);
    assert!(load_running, "the load ran throughout");
    assert_backfilled_under_load(
        name,
        rows,
        &pipeline,
        &out,
        "finished by `refract backfill` after the daemon was killed",
        started.elapsed(),
        load_running,
    );
    drop_slot(name);
}

#[test]
fn backfill_without_a_daemon_under_update_and_delete_load() {
    // No daemon: `refract backfill` runs the pipeline itself and reads the rows from an exported
    // snapshot (COPY) into its stream at the snapshot's consistent point.
    let name = "pg_backfill_copy";
    let rows = size(40_000, 1_000_000);
    filled_table(name, rows);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file_with(dir.path(), name, &out, "snapshot = \"never\"");
    catch_up(&pipeline);
    assert!(read_output(&out).is_empty(), "nothing before the backfill");
    // Changes before the backfill, still to be streamed when it starts: the snapshot holds
    // their results, the stream applies them first.
    psql(&format!(
        "UPDATE {name} SET note = 'before' WHERE id % 1000 = 0; DELETE FROM {name} WHERE id % 1000 = 1"
    ));
    let seconds = (10 + rows / 20_000) as u32;
    let load = update_delete_load(name, rows, 250, seconds);
    std::thread::sleep(Duration::from_secs(2));
    let started = std::time::Instant::now();
    let backfill = output(
        refract()
            .env("RUST_LOG", "info")
            .args(["--log-format", "json", "backfill"])
            .arg(&pipeline),
    );
    let log = String::from_utf8_lossy(&backfill.stderr);
    assert!(backfill.status.success(), "backfill failed: {log}");
    assert!(
        log.contains("backfill read from its exported snapshot"),
        "the fast path ran: {log}"
    );
    let elapsed = started.elapsed();
    let load_running = stop_load(load);
    assert_backfilled_under_load(
        name,
        rows,
        &pipeline,
        &out,
        "from an exported snapshot",
        elapsed,
        load_running,
    );
    drop_slot(name);
}

/// The chunks that finish an interrupted initial snapshot hold rows in key order while an
/// application locks rows in another order: a chunk gives way, the application's transaction
/// commits (it is never the deadlock victim), the snapshot finishes and the read model equals
/// the table.
#[test]
fn a_snapshot_chunk_gives_way_to_an_application_locking_rows_in_another_order() {
    let name = "pg_gives_way";
    fresh_table(name);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'row ' || g, g, g, NULL FROM generate_series(1, 40000) g"
    ));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // One chunk reads everything after the resume point (at most the 12,000th row, below).
    let pipeline = pipeline_file_with(dir.path(), name, &out, "chunk_rows = 40000");
    let mut daemon = quiet_daemon(&pipeline);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while std::fs::read_dir(out.join(name)).map_or(0, |d| d.count()) < 12_000 {
        assert!(std::time::Instant::now() < deadline, "no 12,000 documents");
        std::thread::sleep(Duration::from_millis(5));
    }
    daemon.child().kill().unwrap();
    daemon.child().wait().unwrap();
    assert!(
        dir.path()
            .join(format!("state/{name}/snapshot-copy.json"))
            .exists(),
        "killed inside the COPY phase"
    );
    // The restart finishes the snapshot in chunks, while the applications hold their locks.
    let mut resume = refract();
    resume
        .env("RUST_LOG", "warn")
        .arg("run")
        .arg(&pipeline)
        .arg("--until-caught-up");
    let run = common::pg::applications_lock_against_a_reader(
        &pg_url(),
        name,
        "id",
        "name = 'locked by an application'",
        ["39000", "39500", "39900"],
        resume,
    );
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "the resumed snapshot failed: {log}");
    assert!(
        log.contains("giving way"),
        "the chunk never gave way: {log}"
    );
    catch_up(&pipeline);
    assert_read_model(&table_state(name), &out, "after the snapshot");
    drop_slot(name);
}

#[test]
fn backfill_without_a_daemon_resumes_and_re_reads_only_the_named_table() {
    let name = "pg_backfill_solo";
    fresh_table(name);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'row ' || g, g, g, NULL FROM generate_series(1, 60000) g"
    ));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file_with(
        dir.path(),
        name,
        &out,
        "snapshot = \"never\"\nchunk_rows = 500",
    );
    catch_up(&pipeline);
    assert!(read_output(&out).is_empty());
    let other_name = format!("{name}_other");
    let (_other_dir, _, other_pipeline) = setup(&other_name);
    // Kill the first backfill halfway (once it noted a key it reached); the second resumes it.
    let mut first = Running::spawn(
        refract()
            .arg("backfill")
            .arg(&pipeline)
            .arg("--table")
            .arg(name)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    wait_for_backfill_notes(dir.path(), name);
    let killed = first.child().try_wait().unwrap().is_none();
    first.child().kill().ok();
    first.child().wait().unwrap();
    let second = output(
        refract()
            .env("RUST_LOG", "info")
            .args(["--log-format", "json", "backfill"])
            .arg(&pipeline)
            .arg("--table")
            .arg(format!("public.{name}")),
    );
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let log = String::from_utf8_lossy(&second.stderr);
    if killed {
        assert!(log.contains("resuming an interrupted"), "{log}");
    }
    assert_read_model(&table_state(name), &out, "after the backfill");
    // Another pipeline's slot received the chunks too (logical messages reach every slot); they
    // leave no trace in its run.
    let summary = dir.path().join("other.json");
    let other = output(
        refract()
            .arg("run")
            .arg(&other_pipeline)
            .arg("--until-caught-up")
            .arg("--summary-json")
            .arg(&summary),
    );
    assert!(other.status.success());
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(summary["records"], 0, "{summary}");
    assert_eq!(summary["transactions"], 0, "{summary}");
    drop_slot(&other_name);
    // A table outside the publication is refused by name.
    let wrong = output(
        refract()
            .arg("backfill")
            .arg(&pipeline)
            .arg("--table")
            .arg("nope"),
    );
    assert_eq!(wrong.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("`nope` is not in publication"));
    drop_slot(name);
}

#[test]
fn a_lost_replication_connection_is_re_established_without_loss() {
    let name = "pg_reconnect";
    let (_dir, out, pipeline) = setup(name);
    let mut daemon = Running::spawn(
        refract()
            .env("RUST_LOG", "info")
            .arg("run")
            .arg(&pipeline)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let slot = format!("refract_{name}");
    let mut terminated = 0;
    for round in 0..40u64 {
        psql(&format!(
            "INSERT INTO {name} SELECT g, 'r{round}', {round}, 1.00, NULL FROM generate_series({a}, {b}) g;
             UPDATE {name} SET qty = qty + 1 WHERE id % 7 = {m};
             DELETE FROM {name} WHERE id % 11 = {m};",
            a = round * 500,
            b = round * 500 + 499,
            m = round % 7
        ));
        if round % 8 == 4 {
            // Kill the walsender (and with it the stream) as an outage would.
            let killed = psql(&format!(
                "SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE slot_name = '{slot}' AND active_pid IS NOT NULL"
            ));
            terminated += killed.parse::<u32>().unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            daemon.child().try_wait().unwrap().is_none(),
            "the daemon keeps running through lost connections"
        );
    }
    assert!(terminated >= 3, "the stream was cut {terminated} times");
    // The daemon itself catches up: wait until the read model equals the table.
    let expected = table_state(name);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while read_output_live(&out) != expected && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
    }
    daemon.terminate();
    let output = daemon.wait_with_output();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert!(
        log.contains("reconnecting") && log.contains("re-established"),
        "{log}"
    );
    assert_read_model(
        &expected,
        &out,
        &format!("after {terminated} lost connections"),
    );
    drop_slot(name);
}

#[test]
fn retained_wal_over_the_limit_is_warned_and_exported_as_a_metric() {
    let name = "pg_walwarn";
    let (dir, out, _) = setup(name);
    let port = common::cache::free_port();
    let pipeline = pipeline_file_with(dir.path(), name, &out, "max_retained_wal_mb = 0");
    let text = std::fs::read_to_string(&pipeline).unwrap().replacen(
        "[pipeline.batch]",
        &format!("metrics_addr = \"127.0.0.1:{port}\"\n\n[pipeline.batch]"),
        1,
    );
    std::fs::write(&pipeline, text).unwrap();
    // WAL the slot has not confirmed yet.
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'r', 1, 1.00, NULL FROM generate_series(1, 2000) g"
    ));
    let mut daemon = Running::spawn(
        refract()
            .arg("run")
            .arg(&pipeline)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let scrape = || {
        common::cache::try_http_get(&format!("127.0.0.1:{port}"), "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut metrics = scrape();
    while !(metrics.contains("refract_slot_retained_wal_bytes")
        && metrics.contains("refract_records_read_total"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no metrics: {metrics}"
        );
        std::thread::sleep(Duration::from_millis(200));
        metrics = scrape();
    }
    daemon.terminate();
    let output = daemon.wait_with_output();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert!(
        log.contains("retains more WAL than `max_retained_wal_mb`")
            && log.contains(&format!("refract_{name}")),
        "{log}"
    );
    let line = metrics
        .lines()
        .find(|l| l.starts_with("refract_slot_retained_wal_bytes"))
        .unwrap();
    assert!(line.contains(&format!("slot=\"refract_{name}\"")), "{line}");
    assert!(line.contains(&format!("pipeline=\"{name}\"")), "{line}");
    drop_slot(name);
}
