//! Transactions through the PostgreSQL source, against the real local PostgreSQL (`PG_URL`,
//! default `postgres://postgres@127.0.0.1:5432/refract`, in logical mode: `scripts/test` prepares
//! it): interleaved sessions committing in the reverse order of their start, DDL between DML
//! inside one transaction, a huge rolled-back transaction, and the memory of a huge committed one.
//! Each test works on its own `tx_*` tables, slot and publication, and drops them at the end.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::pg::{Cleanup, Session, catch_up, changes, psql, run_with_peak_rss, table_rows};
use common::*;
use serde_json::{Value, json};

/// A pipeline named `name` (so slot and publication are `refract_{name}`) reading `tables` from
/// PostgreSQL (with `source_extra` lines in `[source]`), with the given projections and sinks.
fn pipeline_file(
    dir: &Path,
    name: &str,
    tables: &[&str],
    source_extra: &str,
    batch: &str,
    rest: &str,
) -> PathBuf {
    let tables: Vec<String> = tables.iter().map(|t| format!("\"public.{t}\"")).collect();
    let text = format!(
        r#"[pipeline]
name = "{name}"
state_dir = "{state}"

[pipeline.batch]
{batch}

[source]
kind = "postgres"
url = "{url}"
tables = [{tables}]
{source_extra}

{rest}
"#,
        state = dir.join("state").display(),
        url = common::pg::url(),
        tables = tables.join(", "),
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A pipeline replicating `table` into object-JSON documents under `out`.
fn documents_pipeline(dir: &Path, table: &str, out: &Path) -> PathBuf {
    pipeline_file(
        dir,
        table,
        &[table],
        "",
        "max_events = 300\nmax_delay_ms = 50",
        &format!(
            r#"[projections.replica]
kind = "replica"
sinks = ["docs"]

[sinks.docs]
kind = "object_json"
url = "file://{}"
"#,
            out.display()
        ),
    )
}

fn create_table(table: &str) {
    psql(&format!(
        "CREATE TABLE public.{table} (id int PRIMARY KEY, name text NOT NULL, qty int, note text)"
    ));
}

fn doc(out: &Path, table: &str, id: i64) -> Option<Value> {
    read_output(out).remove(&(table.to_owned(), id.to_string()))
}

/// Two sessions whose statements interleave on the same rows and whose commits come in the
/// reverse order of their start (and of their transaction ids): the read model must apply whole
/// transactions in commit order, never show the open one, and equal the table at the end.
#[test]
fn interleaved_sessions_reach_the_read_model_in_commit_order() {
    let name = "tx_order";
    let _cleanup = Cleanup::new(name, &[name]);
    create_table(name);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = documents_pipeline(dir.path(), name, &out);
    catch_up(&pipeline); // creates the slot: changes from now on are streamed
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'initial ' || g, g, NULL FROM generate_series(1, 9) g"
    ));

    // Round 1, same rows, lock waits: B starts first (smaller xid, earlier first change), A then
    // writes rows 1, 7 and 30; B writes the same rows, waits for A's locks, and commits after A.
    let mut a = Session::open("A");
    let mut b = Session::open("B");
    let b_xid: i64 = b
        .run(&format!(
            "BEGIN; UPDATE {name} SET name = 'B first write' WHERE id = 9; SELECT txid_current();"
        ))
        .trim()
        .parse()
        .unwrap();
    let a_xid: i64 = a
        .run(&format!(
            "BEGIN;
             UPDATE {name} SET name = 'A', qty = 100 WHERE id = 1;
             UPDATE {name} SET qty = 700, note = 'A' WHERE id = 7;
             INSERT INTO {name} VALUES (30, 'A', 30, 'A');
             SELECT txid_current();"
        ))
        .trim()
        .parse()
        .unwrap();
    assert!(b_xid < a_xid, "B started first: xid {b_xid} < {a_xid}");
    b.send(&format!(
        "UPDATE {name} SET name = 'B', note = 'B' WHERE id = 1;
         DELETE FROM {name} WHERE id = 7;
         INSERT INTO {name} VALUES (30, 'B', 31, 'B')
           ON CONFLICT (id) DO UPDATE SET name = excluded.name, note = excluded.note;
         UPDATE {name} SET qty = qty + 1 WHERE id = 2;"
    ));
    b.wait_until_blocked_on_lock();
    a.run("COMMIT;");
    b.wait(); // B's statements went through on A's committed rows; B is still open

    // A committed, B open: the read model is the committed table, B's writes are not in it.
    catch_up(&pipeline);
    assert_read_model(&table_rows(name), &out, "A committed, B still open");
    assert_eq!(doc(&out, name, 1).unwrap()["name"], "A");
    assert_eq!(doc(&out, name, 7).unwrap()["qty"], 700);
    assert_eq!(doc(&out, name, 9).unwrap()["name"], "initial 9");

    b.run("COMMIT;");
    let summary = catch_up(&pipeline);
    eprintln!(
        "round 1: B (xid {b_xid}) started first, A (xid {a_xid}) committed first; changes read after B's commit: {:?}",
        changes(&summary)
    );
    let expected = table_rows(name);
    // The scenario happened as designed (B's writes landed on top of A's committed rows) ...
    assert_eq!(
        expected[&(name.to_owned(), "1".to_owned())],
        json!({"id": 1, "name": "B", "qty": 100, "note": "B"})
    );
    assert!(!expected.contains_key(&(name.to_owned(), "7".to_owned())));
    assert_eq!(
        expected[&(name.to_owned(), "30".to_owned())],
        json!({"id": 30, "name": "B", "qty": 30, "note": "B"})
    );
    // ... and the read model holds exactly the last committed values (applying the transactions
    // in xid or first-change order would leave row 1 = A, row 7 present, row 30 = A).
    assert_read_model(&expected, &out, "after A then B committed");
    assert_eq!(
        doc(&out, name, 1).unwrap(),
        json!({"id": 1, "name": "B", "qty": 100, "note": "B"}),
        "key 1 holds the last committed value"
    );

    // Round 2, no lock waits: A starts first and writes row 4; B then writes rows 5 and 40 and
    // commits; A then writes on top of B's committed rows 5 and 40 and commits last.
    let a_xid: i64 = a
        .run(&format!(
            "BEGIN; UPDATE {name} SET name = 'A round 2' WHERE id = 4; SELECT txid_current();"
        ))
        .trim()
        .parse()
        .unwrap();
    let b_xid: i64 = b
        .run(&format!(
            "BEGIN;
             UPDATE {name} SET name = 'B round 2' WHERE id = 5;
             INSERT INTO {name} VALUES (40, 'B round 2', 40, NULL);
             SELECT txid_current();"
        ))
        .trim()
        .parse()
        .unwrap();
    assert!(a_xid < b_xid, "A started first: xid {a_xid} < {b_xid}");
    b.run("COMMIT;");
    a.run(&format!(
        "UPDATE {name} SET name = name || ', then A' WHERE id = 5;
         DELETE FROM {name} WHERE id = 40;
         COMMIT;"
    ));
    // A third transaction after both.
    psql(&format!(
        "UPDATE {name} SET qty = qty * 10 WHERE id IN (4, 5)"
    ));
    let summary = catch_up(&pipeline);
    eprintln!(
        "round 2: A (xid {a_xid}) started first, B (xid {b_xid}) committed first; changes: {:?}",
        changes(&summary)
    );
    let expected = table_rows(name);
    assert_eq!(
        expected[&(name.to_owned(), "5".to_owned())]["name"],
        "B round 2, then A"
    );
    assert!(!expected.contains_key(&(name.to_owned(), "40".to_owned())));
    assert_read_model(&expected, &out, "after B then A committed");
    assert_eq!(
        doc(&out, name, 5).unwrap()["name"],
        "B round 2, then A",
        "row 5 holds the last committed value"
    );
    eprintln!("{} documents equal the table row for row", expected.len());
}

/// DDL between DML inside one transaction: each document has exactly the columns of the row at
/// its last change (no `c` before the ADD, no `note` after the DROP), with the values of then.
#[test]
fn ddl_inside_a_transaction_gives_each_document_the_columns_of_its_event() {
    let name = "tx_ddl";
    let _cleanup = Cleanup::new(name, &[name]);
    create_table(name);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = documents_pipeline(dir.path(), name, &out);
    catch_up(&pipeline);

    psql(&format!(
        "BEGIN;
         INSERT INTO {name} SELECT g, 'before add ' || g, g, 'note ' || g FROM generate_series(1, 5) g;
         ALTER TABLE {name} ADD COLUMN c int DEFAULT 7;
         INSERT INTO {name} (id, name, qty, note) VALUES (6, 'after add 6', 6, 'note 6'), (7, 'after add 7', 7, 'note 7');
         INSERT INTO {name} (id, name, qty, note, c) VALUES (8, 'after add 8', 8, 'note 8', 80);
         UPDATE {name} SET qty = 20 WHERE id = 2;
         UPDATE {name} SET c = 70 WHERE id = 7;
         ALTER TABLE {name} DROP COLUMN note;
         INSERT INTO {name} (id, name, qty, c) VALUES (9, 'after drop 9', 9, 9);
         INSERT INTO {name} (id, name, qty) VALUES (10, 'after drop 10', 10);
         UPDATE {name} SET name = 'updated after drop' WHERE id IN (3, 6);
         DELETE FROM {name} WHERE id = 5;
         COMMIT;"
    ));
    // A later transaction on a row last written before the ADD.
    psql(&format!("UPDATE {name} SET qty = qty + 1 WHERE id = 1"));
    let summary = catch_up(&pipeline);
    eprintln!("changes read: {:?}", changes(&summary));

    let table = table_rows(name);
    let key = |id: i64| (name.to_owned(), id.to_string());
    let mut expected = BTreeMap::new();
    // Last change before the ADD: the columns of then, no `c`.
    expected.insert(
        key(4),
        json!({"id": 4, "name": "before add 4", "qty": 4, "note": "note 4"}),
    );
    // Last change between ADD and DROP: `note` and `c`.
    expected.insert(
        key(2),
        json!({"id": 2, "name": "before add 2", "qty": 20, "note": "note 2", "c": 7}),
    );
    expected.insert(
        key(7),
        json!({"id": 7, "name": "after add 7", "qty": 7, "note": "note 7", "c": 70}),
    );
    expected.insert(
        key(8),
        json!({"id": 8, "name": "after add 8", "qty": 8, "note": "note 8", "c": 80}),
    );
    // Last change after the DROP: exactly the table's row (`c`, no `note`).
    for id in [1, 3, 6, 9, 10] {
        expected.insert(key(id), table[&key(id)].clone());
    }
    assert_eq!(
        expected.keys().collect::<BTreeSet<_>>(),
        table.keys().collect::<BTreeSet<_>>(),
        "the expectation covers every row of the table (5 is deleted)"
    );

    let actual = read_output(&out);
    let columns = |v: &Value| -> Vec<String> {
        let mut c: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        c.sort();
        c
    };
    for (k, want) in &expected {
        let got = actual
            .get(k)
            .unwrap_or_else(|| panic!("document {} is missing", k.1));
        eprintln!("id {:>2}: {:?}", k.1, columns(got));
        assert_eq!(
            columns(got),
            columns(want),
            "columns of document {}: {got}",
            k.1
        );
    }
    assert_read_model(&expected, &out, "after the transaction with DDL");
    assert_eq!(
        actual.len(),
        9,
        "9 documents, row 5 deleted inside the transaction"
    );
}

/// A huge transaction that rolls back (while a small one commits in its middle, and a committed
/// transaction rolls back to a savepoint) leaves no trace: the read model holds exactly the
/// committed rows and the run read no change of the rolled-back work.
#[test]
fn a_rolled_back_huge_transaction_leaves_no_trace() {
    let name = "tx_rollback";
    let _cleanup = Cleanup::new(name, &[name]);
    create_table(name);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = documents_pipeline(dir.path(), name, &out);
    catch_up(&pipeline);

    let rows: u64 = if in_ci() { 200_000 } else { 1_000_000 };
    eprintln!(
        "rolled-back transaction: {rows} inserts ({})",
        if in_ci() {
            "CI size, CI=true"
        } else {
            "full size"
        }
    );
    let half = rows / 2;
    let mut big = Session::open("big");
    big.run(&format!(
        "BEGIN; INSERT INTO {name} SELECT 100000000 + g, 'rolled back ' || g, g, repeat('x', 40) FROM generate_series(1, {half}) g;"
    ));
    // A small transaction commits while the big one is open; it rolls back a savepoint of its own.
    psql(&format!(
        "BEGIN;
         INSERT INTO {name} VALUES (1, 'kept 1', 1, NULL), (2, 'kept 2', 2, NULL), (3, 'kept 3', 3, 'n');
         SAVEPOINT s;
         INSERT INTO {name} SELECT g, 'savepoint ' || g, g, NULL FROM generate_series(100, 1099) g;
         UPDATE {name} SET name = 'savepoint' WHERE id = 1;
         ROLLBACK TO SAVEPOINT s;
         UPDATE {name} SET qty = 20 WHERE id = 2;
         COMMIT;"
    ));
    big.run(&format!(
        "INSERT INTO {name} SELECT 100000000 + g, 'rolled back ' || g, g, repeat('x', 40) FROM generate_series({half} + 1, {rows}) g;
         UPDATE {name} SET name = 'rolled back' WHERE id = 3;
         ROLLBACK;"
    ));
    drop(big);

    let summary = catch_up(&pipeline);
    eprintln!(
        "summary: records {}, changes {:?}, transactions {}",
        summary["records"],
        changes(&summary),
        summary["transactions"]
    );
    let expected = table_rows(name);
    assert_eq!(expected.len(), 3, "the table holds the 3 committed rows");
    assert_read_model(&expected, &out, "after the rolled-back transaction");
    assert_eq!(
        changes(&summary),
        BTreeMap::from([("c".to_owned(), 3), ("u".to_owned(), 1)]),
        "the run read the committed transaction's 3 inserts and 1 update, nothing else"
    );
    // Besides the 4 changes the run read only the BEGIN and END of the committed transaction
    // (transactions with nothing for this slot, such as other pipelines' snapshot chunks, leave
    // no trace): no record, change or dead letter came from the rolled-back work.
    assert_eq!(summary["dead_letters"], 0, "{summary}");
    assert_eq!(summary["transactions"], 1, "{summary}");
    assert_eq!(summary["records"], 6, "{summary}");
}

/// One transaction updating millions of rows: refract's peak RSS stays under 300 MiB, and every
/// update is delivered (the bulk table goes to the null sink; a small table updated at the start
/// and at the end of the same transaction goes to documents compared with the table).
#[test]
fn a_transaction_of_millions_of_updates_stays_under_300_mib() {
    const LIMIT_MIB: u64 = 300;
    let name = "tx_big";
    let check = "tx_big_check";
    let _cleanup = Cleanup::new(name, &[name, check]);
    let rows: u64 = if in_ci() { 500_000 } else { 2_000_000 };
    create_table(name);
    create_table(check);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'item ' || g, g % 100, 'note ' || g FROM generate_series(1, {rows}) g;
         INSERT INTO {check} SELECT g, 'check ' || g, g, NULL FROM generate_series(1, 100) g;"
    ));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let pipeline = pipeline_file(
        dir.path(),
        name,
        &[name, check],
        // The rows exist before the slot: only the update transaction is streamed, no snapshot.
        r#"snapshot = "never""#,
        "",
        &format!(
            r#"[projections.bulk]
kind = "replica"
tables = ["{name}"]
sinks = ["null"]

[projections.check]
kind = "replica"
tables = ["{check}"]
sinks = ["docs"]

[sinks.null]
kind = "null"

[sinks.docs]
kind = "object_json"
url = "file://{}"
"#,
            out.display()
        ),
    );
    let first = catch_up(&pipeline); // creates the slot
    assert!(
        changes(&first).is_empty(),
        "no snapshot was asked for: {first}"
    );

    psql(&format!(
        "BEGIN;
         UPDATE {check} SET qty = qty + 1000 WHERE id <= 50;
         UPDATE {name} SET qty = qty + 1;
         UPDATE {check} SET name = 'after the bulk' WHERE id > 25;
         COMMIT;"
    ));
    let summary_path = dir.path().join("big-summary.json");
    let args: Vec<&OsStr> = vec![
        OsStr::new("run"),
        pipeline.as_os_str(),
        OsStr::new("--until-caught-up"),
        OsStr::new("--summary-json"),
        summary_path.as_os_str(),
    ];
    let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let started = std::time::Instant::now();
    let (run, peak_kib, how) = run_with_peak_rss(
        Path::new(env!("CARGO_BIN_EXE_refract")),
        &args,
        &[("RUST_LOG", &log)],
    );
    assert!(
        run.status.success(),
        "the run failed ({}): {}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let peak_mib = peak_kib as f64 / 1024.0;
    eprintln!(
        "peak RSS: {peak_mib:.1} MiB (limit {LIMIT_MIB} MiB) for one transaction of {rows} updates ({}; measured with {how}; run took {:.1?})",
        if in_ci() {
            "CI size, CI=true"
        } else {
            "full size"
        },
        started.elapsed()
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(&summary_path).unwrap()).unwrap();
    eprintln!(
        "summary: records {}, changes {:?}, transactions {}, sinks {}",
        summary["records"],
        changes(&summary),
        summary["transactions"],
        summary["sinks"]
    );
    assert_eq!(
        changes(&summary),
        BTreeMap::from([("u".to_owned(), rows + 50 + 75)]),
        "every update of the transaction was read"
    );
    assert_eq!(
        summary["sinks"]["null"]["upserted"], rows,
        "every bulk row reached the null sink"
    );
    assert_read_model(
        &table_rows(check),
        &out,
        "the small table updated around the bulk",
    );
    assert_eq!(
        doc(&out, check, 30).unwrap(),
        json!({"id": 30, "name": "after the bulk", "qty": 1030, "note": null})
    );
    assert!(
        peak_mib < LIMIT_MIB as f64,
        "peak RSS {peak_mib:.1} MiB is over {LIMIT_MIB} MiB for one transaction of {rows} updates"
    );
}
