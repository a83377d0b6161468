//! The PostgreSQL source against the real local PostgreSQL (`PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/refract`, in logical mode: `scripts/test` prepares it).
//! Each test works on its own table, slot and publication.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use serde_json::Value;

fn pg_url() -> String {
    std::env::var("PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/refract".into())
}

/// Runs SQL through psql, failing the test on error; returns psql's unaligned output.
fn psql(sql: &str) -> String {
    let out = Command::new("psql")
        .args([&pg_url(), "-v", "ON_ERROR_STOP=1", "-Atqc", sql])
        .output()
        .expect("psql runs");
    assert!(
        out.status.success(),
        "psql failed on {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A fresh table `name` (id, name, qty, price numeric, note text), with its slot and publication
/// removed from earlier runs.
fn fresh_table(name: &str) {
    psql(&format!(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_{name}';
         DROP PUBLICATION IF EXISTS refract_{name};
         DROP TABLE IF EXISTS public.{name};
         CREATE TABLE public.{name} (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(20,2), note text);"
    ));
}

/// Drops the test's slot and publication, so no WAL is retained for it after the test.
fn drop_slot(name: &str) {
    psql(&format!(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_{name}';
         DROP PUBLICATION IF EXISTS refract_{name};"
    ));
}

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
    let text = format!(
        r#"[pipeline]
name = "{name}"
state_dir = "{state}"

[pipeline.batch]
max_events = 300
max_delay_ms = 50

[source]
kind = "postgres"
url = "{url}"
tables = ["public.{name}"]

[projections.replica]
kind = "replica"
sinks = ["docs"]

[sinks.docs]
kind = "object_json"
url = "file://{out}"
"#,
        state = dir.join("state").display(),
        url = pg_url(),
        out = out.display()
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The table as the read model must hold it: key → document.
fn table_state(name: &str) -> BTreeMap<(String, String), Value> {
    let json = psql(&format!(
        "SELECT coalesce(json_agg(json_build_object('id', id, 'name', name, 'qty', qty, 'price', price::text, 'note', note)), '[]') FROM public.{name}"
    ));
    let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
    rows.into_iter()
        .map(|r| ((name.to_owned(), r["id"].to_string()), r))
        .collect()
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
         BEGIN; DELETE FROM {name} WHERE id = 3; ROLLBACK;"
    ));
    catch_up(&pipeline);
    assert_read_model(&table_state(name), &out, "after catch-up");
    assert_eq!(
        read_output(&out)[&(name.to_owned(), "1".to_owned())]["price"],
        "12345678901.99",
        "numeric keeps every digit"
    );

    drop_slot(name);
}

#[test]
fn sigkill_under_a_writer_loses_nothing_and_state_loss_resumes_from_the_slot() {
    let name = "pg_crash";
    let (dir, out, pipeline) = setup(name);

    // A writer commits inserts, updates and deletes (one big insert transaction among them).
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
                        "INSERT INTO {name} SELECT g, 'bulk ' || g, 1, 1.00, repeat('x', 100) FROM generate_series(100000, 150000) g ON CONFLICT (id) DO NOTHING"
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
                        100000 + rng.below(50000)
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
        let mut daemon = Running::spawn(
            refract()
                .arg("run")
                .arg(&pipeline)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        std::thread::sleep(Duration::from_millis(300 + rng.below(900)));
        let child = daemon.child();
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    catch_up(&pipeline);
    let expected = table_state(name);
    assert_read_model(&expected, &out, &format!("after {kills} kills"));
    assert!(
        expected.len() > 40_000,
        "the bulk transaction is in ({} rows)",
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
        let mut daemon = Running::spawn(
            refract()
                .arg("run")
                .arg(&pipeline)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
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
fn unchanged_toast_values_are_kept_or_refused_loudly_never_erased() {
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
    // DEFAULT identity: the value is not sent; the update is dead-lettered, the text never erased.
    psql(&format!(
        "ALTER TABLE {name} REPLICA IDENTITY DEFAULT; UPDATE {name} SET qty = 3 WHERE id = 2;"
    ));
    catch_up(&pipeline);
    let doc = &read_output(&out)[&(name.to_owned(), "2".to_owned())];
    assert_eq!(
        doc["note"].as_str().map(str::len),
        Some(8192),
        "the read model still holds the text"
    );
    let dead =
        std::fs::read_to_string(dir.path().join(format!("state/{name}/dead-letters.ndjson")))
            .unwrap();
    assert!(
        dead.contains("unchanged TOASTed value") && dead.contains("REPLICA IDENTITY FULL"),
        "{dead}"
    );
    drop_slot(name);
}
