//! Faults of the PostgreSQL side that the source must ride out, each compared with the table
//! afterwards (an independent SQL read) rather than assumed:
//! - the server restarts (`pg_ctl restart -m fast`, every connection closed) twice under a
//!   pgbench load: the daemon reconnects by itself and its read model equals the table;
//! - one of two sinks stalls 20 s (10 s in CI) behind a lock while the table keeps changing: the
//!   slot is never confirmed past the first change the stalled sink has not written, and both
//!   read models equal the table once the lock goes;
//! - the one published table is idle while an unpublished one is busy: the slot still advances
//!   to the server's WAL position, so it retains nothing for the busy table.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::db::psql_at;
use common::pg::{Session, hang_guard, pgbench};
use common::tiers::PrivatePostgres;
use common::*;
use serde_json::Value;

/// Rows of the tables these tests write (id, name, qty).
const ROWS: u64 = 2_000;

/// Creates `name` (id, name, qty) with `ROWS` rows at `url`, dropping an earlier one and its
/// slot and publication.
fn create_table(url: &str, name: &str) {
    sql(url, &format!(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_{name}';
         DROP PUBLICATION IF EXISTS refract_{name};
         DROP TABLE IF EXISTS public.{name};
         CREATE TABLE public.{name} (id int PRIMARY KEY, name text NOT NULL, qty int);
         INSERT INTO public.{name} SELECT g, 'row ' || g, g FROM generate_series(1, {ROWS}) g;"
    ));
}

fn sql(url: &str, statement: &str) -> String {
    psql_at(url, statement).unwrap_or_else(|e| panic!("psql failed on {statement}: {e}"))
}

/// The table as the documents of the replica projection hold it.
fn table_state(url: &str, name: &str) -> BTreeMap<(String, String), Value> {
    let json = sql(
        url,
        &format!(
            "SELECT coalesce(json_agg(json_build_object('id', id, 'name', name, 'qty', qty)), '[]') FROM public.{name}"
        ),
    );
    let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
    rows.into_iter()
        .map(|r| ((name.to_owned(), r["id"].to_string()), r))
        .collect()
}

/// A pipeline reading `name` at `url` into documents under `out`, and `extra_sinks` (TOML of
/// further `[sinks.*]` tables, named in `also`) from the same projection.
fn pipeline(
    dir: &Path,
    url: &str,
    name: &str,
    out: &Path,
    also: &[&str],
    extra_sinks: &str,
) -> PathBuf {
    let sinks: Vec<&str> = std::iter::once("docs")
        .chain(also.iter().copied())
        .collect();
    let toml = common::pg::object_json_sink("docs", out) + extra_sinks;
    common::pg::replica_pipeline(dir, name, url, "", &sinks, &toml)
}

/// The daemon, its log in `log`.
fn daemon(pipeline: &Path, log: &Path) -> Running {
    Running::spawn(
        refract()
            .env("RUST_LOG", "info")
            .arg("run")
            .arg(pipeline)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap()),
    )
}

/// Waits until the documents under `out` equal `name` at `url` (the daemon keeps running);
/// fails after the hang guard naming the differences and the daemon's log.
fn wait_until_equal(url: &str, name: &str, out: &Path, log: &Path, context: &str) {
    let deadline = Instant::now() + hang_guard();
    loop {
        let expected = table_state(url, name);
        if diff(&expected, &read_output_live(out)).is_empty() {
            return;
        }
        if Instant::now() > deadline {
            let problems = diff(&expected, &read_output_live(out));
            panic!(
                "{context}: {} differences, e.g. {:?}; daemon log:\n{}",
                problems.len(),
                &problems[..problems.len().min(5)],
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// pgbench updating, deleting and re-inserting rows of `name` at `url` for `seconds`.
fn pgbench_load(url: &str, name: &str, seconds: u32) -> Running {
    let script = std::env::temp_dir().join(format!("refract_{name}_faults.sql"));
    std::fs::write(
        &script,
        format!(
            "\\set u random(1, {ROWS})\n\\set d random(1, {ROWS})\n\
             UPDATE {name} SET qty = qty + 1, name = 'load ' || :u WHERE id = :u;\n\
             DELETE FROM {name} WHERE id = :d;\n\
             INSERT INTO {name} VALUES (:u, 'back ' || :u, 0) ON CONFLICT (id) DO NOTHING;\n"
        ),
    )
    .unwrap();
    Running::adopt(
        Command::new(pgbench())
            .args([
                "-n",
                "-c",
                "2",
                "-R",
                "300",
                "-T",
                &seconds.to_string(),
                "-f",
            ])
            .arg(&script)
            .arg(url)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pgbench starts"),
    )
}

fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.trim().split_once('/').expect("an LSN");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

fn confirmed_flush(url: &str, name: &str) -> u64 {
    let text = sql(
        url,
        &format!(
            "SELECT coalesce(confirmed_flush_lsn, '0/0')::text FROM pg_replication_slots WHERE slot_name = 'refract_{name}'"
        ),
    );
    if text.is_empty() { 0 } else { lsn(&text) }
}

#[test]
fn postgresql_restarts_under_pgbench_load_lose_nothing() {
    let pg = PrivatePostgres::start_logical();
    let url = pg.url();
    let name = "pg_restarts";
    create_table(&url, name);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let log = dir.path().join("daemon.log");
    let file = pipeline(dir.path(), &url, name, &out, &[], "");
    let _daemon = daemon(&file, &log);
    wait_until_equal(&url, name, &out, &log, "the initial snapshot");
    let seconds = if in_ci() { 6 } else { 15 };
    for restart in 1..=2 {
        // Each pgbench ends when the restart closes its connections; a new one follows.
        let mut load = pgbench_load(&url, name, seconds);
        let before = read_output_live(&out);
        let deadline = Instant::now() + hang_guard();
        while read_output_live(&out) == before {
            assert!(
                Instant::now() < deadline,
                "the load never reached the read model"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        pg.restart();
        load.child().wait().unwrap();
        println!("restart {restart} done under load");
    }
    let mut last = pgbench_load(&url, name, 3);
    last.child().wait().unwrap();
    wait_until_equal(&url, name, &out, &log, "after two restarts under load");
    let log_text = std::fs::read_to_string(&log).unwrap();
    assert!(
        log_text.contains("reconnect") || log_text.contains("connection"),
        "the daemon said nothing about the lost connection: {log_text}"
    );
}

#[test]
fn a_stalled_sink_holds_the_slot_while_the_table_keeps_changing() {
    let url = common::pg::url();
    let name = "pg_stalled_sink";
    let schema = "refract_stalled";
    create_table(&url, name);
    sql(&url, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let _cleanup = common::pg::Cleanup {
        name: name.into(),
        tables: vec![name.into()],
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let log = dir.path().join("daemon.log");
    let pg_sink =
        format!("\n[sinks.pg]\nkind = \"postgres\"\nurl = \"{url}\"\nschema = \"{schema}\"\n");
    let file = pipeline(dir.path(), &url, name, &out, &["pg"], &pg_sink);
    let _daemon = daemon(&file, &log);
    wait_until_equal(&url, name, &out, &log, "the initial snapshot");
    let sink_rows = || sql(&url, &format!("SELECT count(*) FROM {schema}.{name}"));
    let deadline = Instant::now() + hang_guard();
    while sink_rows() != ROWS.to_string() {
        assert!(
            Instant::now() < deadline,
            "the PostgreSQL sink never got the snapshot"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The stall: a session holds the sink's table locked.
    let mut lock = Session::open("stalled_sink_lock");
    lock.run(&format!(
        "BEGIN; LOCK TABLE {schema}.{name} IN ACCESS EXCLUSIVE MODE;"
    ));
    // The first change the stalled sink cannot write: the slot must stay at or before it.
    let first = sql(
        &url,
        &format!(
            "BEGIN; UPDATE {name} SET qty = -1 WHERE id = 1; SELECT pg_current_wal_insert_lsn(); COMMIT;"
        ),
    );
    let first = lsn(&first);
    let stall = Duration::from_secs(if in_ci() { 10 } else { 20 });
    let stop = Arc::new(AtomicBool::new(false));
    let max_confirmed = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, max, url) = (stop.clone(), max_confirmed.clone(), url.clone());
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                max.fetch_max(confirmed_flush(&url, name), Ordering::Relaxed);
                samples += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            samples
        })
    };
    let mut load = pgbench_load(&url, name, stall.as_secs() as u32);
    load.child().wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().unwrap();
    let max = max_confirmed.load(Ordering::Relaxed);
    assert!(
        max <= first,
        "while the sink was stalled the slot was confirmed to {max:X}, past {first:X}, before the \
         first change the sink had not written ({samples} samples)"
    );
    lock.run("COMMIT;");
    wait_until_equal(&url, name, &out, &log, "the fast sink after the stall");
    let deadline = Instant::now() + hang_guard();
    loop {
        let json = sql(
            &url,
            &format!("SELECT coalesce(json_agg(doc), '[]') FROM {schema}.{name}"),
        );
        let docs: Vec<Value> = serde_json::from_str(&json).unwrap();
        let got: BTreeMap<(String, String), Value> = docs
            .into_iter()
            .map(|d| ((name.to_owned(), d["id"].to_string()), d))
            .collect();
        let problems = diff(&table_state(&url, name), &got);
        if problems.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stalled sink after the stall: {} differences, e.g. {:?}",
            problems.len(),
            &problems[..problems.len().min(5)]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = confirmed_flush(&url, name);
    assert!(after > first, "the slot moved on once the sink wrote again");
    println!(
        "stalled {stall:?}: slot confirmed at most {max:X} while stalled ({samples} samples), first \
         unwritten change at {first:X}, {after:X} after"
    );
}

#[test]
fn an_idle_published_table_beside_a_busy_unpublished_one_still_advances_the_slot() {
    let url = common::pg::url();
    let name = "pg_idle_published";
    let busy = "pg_busy_unpublished";
    create_table(&url, name);
    sql(
        &url,
        &format!(
            "DROP TABLE IF EXISTS {busy}; CREATE TABLE {busy} (id int PRIMARY KEY, payload text)"
        ),
    );
    let _cleanup = common::pg::Cleanup {
        name: name.into(),
        tables: vec![name.into(), busy.into()],
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let log = dir.path().join("daemon.log");
    let file = pipeline(dir.path(), &url, name, &out, &[], "");
    let _daemon = daemon(&file, &log);
    wait_until_equal(&url, name, &out, &log, "the initial snapshot");
    // About 50 MB of WAL in the unpublished table, none in the published one.
    for round in 0..10 {
        sql(
            &url,
            &format!(
                "INSERT INTO {busy} SELECT g, repeat('x', 500) FROM generate_series({from}, {to}) g \
             ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
                from = round * 10_000,
                to = round * 10_000 + 9_999
            ),
        );
    }
    let target = lsn(&sql(&url, "SELECT pg_current_wal_lsn()"));
    let deadline = Instant::now() + hang_guard();
    let mut confirmed = confirmed_flush(&url, name);
    while confirmed < target {
        assert!(
            Instant::now() < deadline,
            "the slot stayed at {confirmed:X} while the server's WAL went to {target:X}: it retains \
             the busy unpublished table's WAL; daemon log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
        confirmed = confirmed_flush(&url, name);
    }
    assert_read_model(&table_state(&url, name), &out, "the idle table");
    println!("slot confirmed to {confirmed:X}, past the busy table's WAL at {target:X}");
}
