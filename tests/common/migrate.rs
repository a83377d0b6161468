//! Helpers of the migration tests: a database with the showcase `orders` table (and an empty
//! `orders_v2`), the shipped migration file run against it, an application that writes to the
//! table the control row says, and the independent SQL comparison of the two tables.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::db::TestDb;
use super::{Rng, Running, pg, refract};

/// The showcase tables, as shipped beside the migration file.
const SHOWCASE: &str = include_str!("../../pipelines/orders-v2.sql");

/// The shipped migration file.
pub fn shipped_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../pipelines/orders-v2.migration.toml")
}

/// `orders` transformed as the shipped file says, next to `orders_v2`: the rows of one not in
/// the other, both ways (SQL only: independent of refract's transform).
pub const FORWARD_DIFF: &str = "SELECT count(*) FROM ( \
    (SELECT region, substring(user_id from 2)::bigint, order_id, status, \
            (total_amount * 100)::bigint, created_at FROM orders \
     EXCEPT ALL SELECT region, user_id, order_id, status, total_cents, created_at FROM orders_v2) \
    UNION ALL \
    (SELECT region, user_id, order_id, status, total_cents, created_at FROM orders_v2 \
     EXCEPT ALL SELECT region, substring(user_id from 2)::bigint, order_id, status, \
            (total_amount * 100)::bigint, created_at FROM orders)) d";

/// A migration of a test database's `orders` into `orders_v2` with the shipped file.
pub struct Migration {
    pub db: TestDb,
    pub state: tempfile::TempDir,
    pub slot: String,
    /// The migration file.
    pub file: PathBuf,
    /// The migration's name (its control row).
    pub name: String,
}

impl Migration {
    /// A database `name` with `rows` orders (`ORD-0000001`…, users `U…`, amounts with cents).
    pub fn create(name: &str, rows: u64) -> Self {
        let slot = format!("refract_{name}");
        let db = TestDb::create(name, &[&slot], SHOWCASE);
        db.psql(&format!(
            "INSERT INTO orders SELECT 'ORD-' || lpad(g::text, 7, '0'), 'U' || (g % 5000), \
               (ARRAY['US','EU','APAC'])[1 + g % 3], (ARRAY['pending','paid','shipped'])[1 + g % 3], \
               (g % 100000) / 100.0, timestamptz '2024-01-01' + g * interval '1 minute' \
             FROM generate_series(1, {rows}) g; ANALYZE orders;"
        ));
        Self {
            db,
            state: tempfile::tempdir().unwrap(),
            slot,
            file: shipped_file(),
            name: "orders_v2".into(),
        }
    }

    /// A database `name` made by `schema`, and migration file `toml` (whose `[migration]`
    /// table takes `url`, `slot` and `state_dir` from the environment as the shipped one does)
    /// for migration `migration`.
    pub fn with_file(name: &str, schema: &str, migration: &str, toml: &str) -> Self {
        let slot = format!("refract_{name}");
        let db = TestDb::create(name, &[&slot], schema);
        let state = tempfile::tempdir().unwrap();
        let file = state.path().join("migration.toml");
        std::fs::write(&file, toml).unwrap();
        Self {
            db,
            state,
            slot,
            file,
            name: migration.into(),
        }
    }

    /// `refract migrate FILE phase args…` against this database.
    pub fn command(&self, phase: &str, args: &[&str]) -> Command {
        let mut cmd = refract();
        cmd.args(["migrate"])
            .arg(&self.file)
            .arg(phase)
            .args(args)
            .env("PG_URL", self.db.url())
            .env("REFRACT_SLOT", &self.slot)
            .env("STATE_DIR", self.state.path());
        cmd
    }

    /// Runs a phase to its end.
    pub fn run(&self, phase: &str, args: &[&str]) -> Output {
        self.command(phase, args).output().expect("refract runs")
    }

    /// Starts the dual write in the background.
    pub fn start(&self) -> Running {
        let running = Running::spawn(
            self.command("start", &[])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit()),
        );
        self.wait_for("the control row", || self.control("phase").is_some());
        self.wait_for("the slot's consistent point", || {
            self.db.psql(&format!(
                "SELECT count(*) FROM pg_replication_slots \
                 WHERE slot_name = '{}' AND confirmed_flush_lsn IS NOT NULL",
                self.slot
            )) == "1"
        });
        running
    }

    /// A column of the migration's control row (`None` before `start` made it).
    pub fn control(&self, column: &str) -> Option<String> {
        super::db::psql_at(
            &self.db.url(),
            &format!(
                "SELECT {column}::text FROM refract_migrations WHERE name = '{}'",
                self.name
            ),
        )
        .ok()
        .filter(|s| !s.is_empty())
    }

    /// Waits until `done` holds (a guard against hangs, not a timing assertion).
    pub fn wait_for(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + pg::hang_guard();
        while !done() {
            assert!(Instant::now() < deadline, "waited too long for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Commits a sentinel row into `table` and waits until the dual write has carried it to
    /// `other`: then every change committed before it has been applied too.
    pub fn catch_up(&self, table: &str, other: &str, label: &str) {
        let id = format!("ZZ-SENTINEL-{label}");
        if table == "orders" {
            self.db.psql(&format!(
                "INSERT INTO orders VALUES ('{id}', 'U1', 'EU', 'pending', 1.00, now())"
            ));
        } else {
            self.db.psql(&format!(
                "INSERT INTO orders_v2 VALUES ('EU', 1, '{id}', 'pending', 100, now())"
            ));
        }
        self.wait_for(&format!("sentinel {id} in {other}"), || {
            self.db.psql(&format!(
                "SELECT count(*) FROM {other} WHERE order_id = '{id}'"
            )) == "1"
        });
    }

    /// Runs `insert` and waits until the dual write has carried its row into `other` (found by
    /// `condition`): then every change committed before it has been applied too.
    pub fn catch_up_with(&self, insert: &str, other: &str, condition: &str) {
        self.db.psql(insert);
        self.wait_for(&format!("{condition} in {other}"), || {
            self.db
                .psql(&format!("SELECT count(*) FROM {other} WHERE {condition}"))
                == "1"
        });
    }

    /// The tables the dual write's publication covers, sorted and joined with commas.
    pub fn published(&self) -> String {
        self.db.psql(&format!(
            "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables \
             WHERE pubname = '{}'",
            self.slot
        ))
    }

    /// Rows of `orders` and `orders_v2` that do not match through the transform (SQL).
    pub fn sql_differences(&self) -> u64 {
        self.db.psql(FORWARD_DIFF).parse().unwrap()
    }
}

/// An application writing about `rate` inserts, updates and deletes per second to the table
/// the control row's `read_from` names, as an application that follows the migration does; a
/// write the guard refuses during a switch is simply not committed.
pub struct Writer {
    stop: Arc<AtomicBool>,
    pub committed: Arc<AtomicU64>,
    pub refused: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    pub fn start(url: &str, existing: u64, rate: u64, seed: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let (s, c, r) = (stop.clone(), committed.clone(), refused.clone());
        let url = url.to_owned();
        let thread = std::thread::spawn(move || {
            let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
            let mut rng = Rng::new(seed);
            let tick = Duration::from_millis(50);
            let per_tick = (rate / 20).max(1);
            let mut next_new = 0u64;
            while !s.load(Ordering::Relaxed) {
                let started = Instant::now();
                for _ in 0..per_tick {
                    let sql = write_statement(&mut rng, existing, seed, &mut next_new);
                    match client.batch_execute(&sql) {
                        Ok(()) => c.fetch_add(1, Ordering::Relaxed),
                        Err(_) => r.fetch_add(1, Ordering::Relaxed),
                    };
                }
                // Pacing, not synchronisation: the writer keeps its rate.
                if let Some(rest) = tick.checked_sub(started.elapsed()) {
                    std::thread::sleep(rest);
                }
            }
        });
        Self {
            stop,
            committed,
            refused,
            thread: Some(thread),
        }
    }

    /// Stops and joins the writer; returns (committed, refused).
    pub fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the writer thread ends");
        }
        (
            self.committed.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One write, as a `DO` block that picks the table from the control row.
fn write_statement(rng: &mut Rng, existing: u64, seed: u64, next_new: &mut u64) -> String {
    let id = format!("ORD-{:07}", 1 + rng.below(existing));
    let user = rng.below(100_000);
    let cents = rng.below(1_000_000);
    let region = ["US", "EU", "APAC"][rng.below(3) as usize];
    let status = ["paid", "shipped", "delivered", "cancelled"][rng.below(4) as usize];
    let (to_orders, to_v2) = match rng.below(10) {
        0..=3 => {
            *next_new += 1;
            let new_id = format!("W{seed}-{next_new:07}");
            (
                format!(
                    "INSERT INTO orders VALUES ('{new_id}', 'U{user}', '{region}', 'pending', \
                     {cents} / 100.0, now()) ON CONFLICT DO NOTHING"
                ),
                format!(
                    "INSERT INTO orders_v2 VALUES ('{region}', {user}, '{new_id}', 'pending', \
                     {cents}, now()) ON CONFLICT DO NOTHING"
                ),
            )
        }
        4..=7 => (
            format!(
                "UPDATE orders SET status = '{status}', total_amount = {cents} / 100.0, \
                 region = '{region}', user_id = 'U{user}' WHERE order_id = '{id}'"
            ),
            format!(
                "UPDATE orders_v2 SET status = '{status}', total_cents = {cents}, \
                 region = '{region}', user_id = {user} WHERE order_id = '{id}'"
            ),
        ),
        _ => (
            format!("DELETE FROM orders WHERE order_id = '{id}'"),
            format!("DELETE FROM orders_v2 WHERE order_id = '{id}'"),
        ),
    };
    format!(
        "DO $w$ BEGIN IF (SELECT read_from FROM refract_migrations WHERE name = 'orders_v2') \
         = 'orders_v2' THEN {to_v2}; ELSE {to_orders}; END IF; END $w$"
    )
}

/// SIGKILLs a process.
pub fn kill9(running: &mut Running) {
    let _ = running.child().kill();
    let _ = running.child().wait();
}
