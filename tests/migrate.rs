//! `refract migrate` end to end on the showcase tables (`orders` -> `orders_v2`, shipped file
//! `pipelines/orders-v2.migration.toml`), while an application keeps writing about 300
//! inserts, updates and deletes per second to the table the control row names:
//!
//! - the dual write starts; the backfill is SIGKILLed 10 times and resumed; the dual write is
//!   SIGKILLed during the backfill and restarted;
//! - `verify` exits 0 while the writer runs, and after a catch-up an independent SQL comparison
//!   of the transformed rows finds no difference;
//! - the cut-over is SIGKILLed while it waits and the dual write (stopped) is restarted; the
//!   application moves to `orders_v2` and keeps writing; the reverse replication is SIGKILLed
//!   and restarted; `orders` then holds every write (SQL comparison);
//! - the rollback, SIGKILLed while it waits, moves the application back; the dual write runs
//!   forward again; the end state verifies and compares equal in SQL;
//! - `finalize` refuses while the dual write runs, then drops the slot.
//!
//! 1,000,000 orders by default, 100,000 in CI (`CI=true`), or `REFRACT_MIGRATE_ROWS`.

mod common;

use std::process::Stdio;

use common::migrate::{Migration, Writer, kill9};
use common::{Running, in_ci};

/// Writes per second of the application, as the issue asks.
const WRITES_PER_SECOND: u64 = 300;
/// SIGKILLs of the backfill, as the issue asks ("at least 10").
const BACKFILL_KILLS: usize = 10;

fn rows() -> u64 {
    std::env::var("REFRACT_MIGRATE_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if in_ci() { 100_000 } else { 1_000_000 })
}

fn stdout(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs the backfill, SIGKILLing it `kills` times once it has copied one more chunk (calling
/// `after_kill` with the number of kills so far), then lets it finish.
fn backfill_with_kills(m: &Migration, kills: usize, mut after_kill: impl FnMut(usize)) {
    let copied = || -> u64 { m.control("rows_copied").map_or(0, |v| v.parse().unwrap()) };
    let mut done = 0;
    while done < kills {
        let before = copied();
        let mut run = Running::spawn(
            m.command("backfill", &[])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit()),
        );
        m.wait_for("a backfill chunk", || {
            copied() > before || matches!(run.child().try_wait(), Ok(Some(_)))
        });
        if let Ok(Some(status)) = run.child().try_wait() {
            panic!(
                "the backfill ended ({status}) after {done} kills: too few rows for {kills} kills?"
            );
        }
        kill9(&mut run);
        done += 1;
        after_kill(done);
    }
    let out = m.run("backfill", &[]);
    assert!(out.status.success(), "backfill: {}", stdout(&out));
    assert_eq!(m.control("phase").as_deref(), Some("backfilled"));
}

#[test]
fn a_migration_under_a_live_writer_survives_kills_in_every_phase() {
    let n = rows();
    let m = Migration::create("refract_mig_e2e", n);
    let mut daemon = m.start();
    let writer = Writer::start(&m.db.url(), n, WRITES_PER_SECOND, 1);

    // Backfill with kills; the dual write is killed in the middle of it and restarted.
    backfill_with_kills(&m, BACKFILL_KILLS, |kills| {
        if kills == BACKFILL_KILLS / 2 {
            kill9(&mut daemon);
            daemon = m.start();
        }
    });
    assert_eq!(m.control("rows_rejected").as_deref(), Some("0"));

    // Verify while the application writes.
    let out = m.run("verify", &[]);
    assert!(
        out.status.success(),
        "verify under the writer: {}",
        stdout(&out)
    );

    // The independent comparison, once the dual write has caught up.
    let (committed, _) = writer.stop();
    assert!(committed > 0, "the writer wrote nothing");
    m.catch_up("orders", "orders_v2", "forward");
    assert_eq!(
        m.sql_differences(),
        0,
        "orders_v2 differs from the transformed orders"
    );

    // Until the cut-over the target's changes are not published (the dual write would skip
    // them): the backfill's writes are not decoded.
    assert_eq!(m.published(), "orders,refract_migrations");

    // Cut-over, killed while it waits (the dual write is stopped meanwhile).
    let writer = Writer::start(&m.db.url(), n, WRITES_PER_SECOND, 2);
    kill9(&mut daemon);
    let mut cutover = Running::spawn(
        m.command("cutover", &["--timeout", "600"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    m.wait_for("the cut-over request", || {
        m.control("requested_read_from").as_deref() == Some("orders_v2")
    });
    kill9(&mut cutover);
    let mut daemon = m.start();
    m.wait_for("the switch", || {
        m.control("read_from").as_deref() == Some("orders_v2")
    });
    assert_eq!(m.published(), "orders,orders_v2,refract_migrations");
    let out = m.run("cutover", &[]);
    assert!(out.status.success(), "cutover again: {}", stdout(&out));
    assert!(stdout(&out).contains("already"), "{}", stdout(&out));

    // The application writes to orders_v2 now; the reverse replication is killed once.
    let before = writer.committed.load(std::sync::atomic::Ordering::Relaxed);
    m.wait_for("writes to orders_v2", || {
        writer.committed.load(std::sync::atomic::Ordering::Relaxed) > before + 300
    });
    kill9(&mut daemon);
    let mut daemon = m.start();
    let before = writer.committed.load(std::sync::atomic::Ordering::Relaxed);
    m.wait_for("more writes to orders_v2", || {
        writer.committed.load(std::sync::atomic::Ordering::Relaxed) > before + 300
    });
    let written_to_v2 =
        m.db.psql("SELECT count(*) FROM orders_v2 WHERE order_id LIKE 'W2-%'");
    assert_ne!(
        written_to_v2, "0",
        "the application did not write to orders_v2"
    );
    let (_, refused) = writer.stop();
    m.catch_up("orders_v2", "orders", "reverse");
    assert_eq!(
        m.sql_differences(),
        0,
        "orders does not hold every write made to orders_v2 ({refused} writes refused during the switch)"
    );

    // Rollback while the application writes, killed while it waits (the dual write is stopped
    // meanwhile); the application moves back to orders.
    let writer = Writer::start(&m.db.url(), n, WRITES_PER_SECOND, 3);
    kill9(&mut daemon);
    let mut rollback = Running::spawn(
        m.command("rollback", &["--timeout", "600"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    m.wait_for("the rollback request", || {
        m.control("requested_read_from").as_deref() == Some("orders")
    });
    kill9(&mut rollback);
    let mut daemon = m.start();
    m.wait_for("the switch back", || {
        m.control("read_from").as_deref() == Some("orders")
    });
    let out = m.run("rollback", &[]);
    assert!(out.status.success(), "rollback again: {}", stdout(&out));
    let before = writer.committed.load(std::sync::atomic::Ordering::Relaxed);
    m.wait_for("writes after the rollback", || {
        writer.committed.load(std::sync::atomic::Ordering::Relaxed) > before + 300
    });
    writer.stop();
    m.catch_up("orders", "orders_v2", "rolled-back");
    assert_eq!(m.sql_differences(), 0, "after the rollback");
    let out = m.run("verify", &[]);
    assert!(
        out.status.success(),
        "verify after the rollback: {}",
        stdout(&out)
    );

    // Finalize refuses while the dual write runs, then stops the replication.
    let out = m.run("finalize", &[]);
    assert!(
        !out.status.success(),
        "finalize while running: {}",
        stdout(&out)
    );
    daemon.terminate();
    daemon.wait_with_output();
    let out = m.run("finalize", &[]);
    assert!(out.status.success(), "finalize: {}", stdout(&out));
    let slots = m.db.psql(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
        m.slot
    ));
    assert_eq!(slots, "0", "finalize left the slot");
    let status = m.run("status", &["--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["control"]["phase"], "finalized");
}

/// The backfill reads `orders` in share-locked chunks while an application locks rows in another
/// order: the backfill gives way, the application's transaction commits (it is never the
/// deadlock victim), and after a catch-up the two tables compare equal in SQL.
#[test]
fn the_backfill_gives_way_to_an_application_locking_rows_in_another_order() {
    let m = Migration::create("migrate_gives_way", 1000);
    let mut daemon = m.start();
    let mut backfill = m.command("backfill", &[]);
    backfill.env("RUST_LOG", "warn");
    let run = common::pg::applications_lock_against_a_reader(
        &m.db.url(),
        "orders",
        "order_id",
        "status = 'cancelled'",
        ["'ORD-0000002'", "'ORD-0000500'", "'ORD-0000700'"],
        backfill,
    );
    let log = stdout(&run);
    assert!(run.status.success(), "backfill: {log}");
    assert!(
        log.contains("giving way"),
        "the backfill never gave way: {log}"
    );
    m.catch_up("orders", "orders_v2", "gives-way");
    assert_eq!(m.sql_differences(), 0, "orders and orders_v2 differ");
    kill9(&mut daemon);
}

/// A chunk the target refuses (a constraint the transform does not satisfy) stops the backfill
/// loudly, and nothing of it stays: its write, its resume point and its counts go out with its
/// `COMMIT` in one round trip, and the aborted transaction makes that `COMMIT` a rollback. The
/// chunks before it stay; once the constraint is gone, the backfill resumes after them.
/// (Seen failing with `write_chunk` ignoring the write's and the record's errors: the backfill
/// then reported success with the refused chunk missing.)
#[test]
fn a_chunk_the_target_refuses_stops_the_backfill_and_is_not_recorded() {
    let m = Migration::create("migrate_refused_chunk", 3500);
    m.db.psql("ALTER TABLE orders_v2 ADD CONSTRAINT refuse_one CHECK (order_id <> 'ORD-0001500')");
    let mut daemon = m.start();
    let out = m.run("backfill", &[]);
    let log = stdout(&out);
    assert!(!out.status.success(), "the backfill succeeded: {log}");
    assert!(
        log.contains("refuse_one"),
        "the refusal is not named: {log}"
    );
    // The shipped file copies chunks of 1,000 rows: the first one only is in.
    assert_eq!(m.control("rows_copied").as_deref(), Some("1000"));
    assert_eq!(
        m.control("backfill_after").as_deref(),
        Some(r#"["ORD-0001000"]"#)
    );
    assert_eq!(m.db.psql("SELECT count(*) FROM orders_v2"), "1000");
    m.db.psql("ALTER TABLE orders_v2 DROP CONSTRAINT refuse_one");
    let out = m.run("backfill", &[]);
    assert!(out.status.success(), "backfill: {}", stdout(&out));
    assert_eq!(m.control("rows_copied").as_deref(), Some("3500"));
    assert_eq!(m.sql_differences(), 0, "orders and orders_v2 differ");
    kill9(&mut daemon);
}
