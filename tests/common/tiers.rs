//! Helpers of the tiers tests: a database of the test's own holding the showcase heartbeat
//! table, the environment the shipped `pipelines/device-tiers.toml` reads, and an independent
//! reader of each tier (psql for warm, DuckDB for cold, the Redis client for hot).
//!
//! Rows are compared as canonical lines `device|ts_micros|region|battery|signal|lat|lon`
//! (null as empty), each value printed the way PostgreSQL, DuckDB and Rust all print it (a
//! `real` as its shortest decimal).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

/// A database of the test's own with `device_heartbeats`; dropped (with its slot) at the end.
pub struct TierDb {
    pub name: String,
}

impl TierDb {
    /// Creates the database afresh (an earlier run's is dropped) with the showcase table.
    pub fn create(name: &str) -> Self {
        let db = TierDb {
            name: name.to_owned(),
        };
        db.drop_all();
        super::pg::psql(&format!("CREATE DATABASE {name}"));
        let schema = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/showcase/device_heartbeats.sql"
        ))
        .unwrap_or_else(|_| SHOWCASE_TABLE.to_owned());
        db.psql(&schema);
        db
    }

    fn drop_all(&self) {
        super::pg::psql(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{}'",
            self.slot()
        ));
        super::pg::psql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }

    pub fn url(&self) -> String {
        let base = super::pg::url();
        let root = base.rsplit_once('/').map_or(base.as_str(), |(r, _)| r);
        format!("{root}/{}", self.name)
    }

    /// The replication slot the shipped pipeline uses for this database.
    pub fn slot(&self) -> String {
        format!("refract_{}", self.name)
    }

    /// Runs SQL in this database; psql's unaligned output.
    pub fn psql(&self, sql: &str) -> String {
        psql_at(&self.url(), sql).unwrap_or_else(|e| panic!("psql failed on {sql}: {e}"))
    }

    /// The source table's rows.
    pub fn source_rows(&self) -> BTreeSet<String> {
        rows_at(
            &self.url(),
            &format!("SELECT {CANONICAL} FROM device_heartbeats"),
        )
    }

    /// The warm tier's rows (table `table` in this database).
    pub fn warm_rows(&self, table: &str) -> BTreeSet<String> {
        warm_rows_at(&self.url(), table)
    }
}

/// Runs SQL at `url`; psql's unaligned output, or its error.
pub fn psql_at(url: &str, sql: &str) -> Result<String, String> {
    let out = Command::new("psql")
        .args([url, "-X", "-v", "ON_ERROR_STOP=1", "-Atqc", sql])
        .output()
        .expect("psql runs");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Canonical lines of the rows `select` returns at `url` (its columns in canonical order).
fn rows_at(url: &str, select: &str) -> BTreeSet<String> {
    psql_at(
        url,
        &format!("COPY ({select}) TO STDOUT WITH (FORMAT csv, DELIMITER '|')"),
    )
    .unwrap_or_else(|e| panic!("reading {select}: {e}"))
    .lines()
    .map(canonical)
    .collect()
}

/// The warm tier's rows (table `table` of the database at `url`).
pub fn warm_rows_at(url: &str, table: &str) -> BTreeSet<String> {
    rows_at(url, &format!("SELECT {CANONICAL} FROM {table}"))
}

impl Drop for TierDb {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.drop_all();
        }
    }
}

/// The table of `../shared/showcase/device_heartbeats.sql`, when the file is not beside the clone.
const SHOWCASE_TABLE: &str = "CREATE TABLE device_heartbeats (device_id text NOT NULL, \
    ts timestamptz NOT NULL, region text NOT NULL, battery real, signal int, \
    lat double precision, lon double precision, PRIMARY KEY (device_id, ts))";

/// The canonical columns in SQL.
const CANONICAL: &str = "device_id, (extract(epoch FROM ts) * 1000000)::bigint, region, battery, \
    signal, lat, lon";

/// Everything the shipped pipeline reads from the environment, pointed at the test's own
/// database, Redis key prefix, directory and clock.
pub struct Env {
    pub db_url: String,
    pub slot: String,
    pub prefix: String,
    pub dir: PathBuf,
    pub redis_url: String,
    pub warm_table: String,
}

impl Env {
    pub fn new(db: &TierDb, dir: &Path, redis_url: &str) -> Self {
        Self::at(&db.url(), &db.name, dir, redis_url)
    }

    /// The environment of a test named `name` whose database is at `db_url`.
    pub fn at(db_url: &str, name: &str, dir: &Path, redis_url: &str) -> Self {
        Env {
            db_url: db_url.to_owned(),
            slot: format!("refract_{name}"),
            prefix: format!("hb_{name}"),
            dir: dir.to_owned(),
            redis_url: redis_url.to_owned(),
            warm_table: "heartbeats_warm".into(),
        }
    }

    pub fn cold_dir(&self) -> PathBuf {
        self.dir.join("out").join("heartbeats")
    }

    /// `refract ARGS` on the shipped pipeline at clock `clock` (an RFC 3339 instant, optionally
    /// followed by ` xSPEED`).
    pub fn refract(&self, clock: &str) -> Command {
        let mut cmd = super::refract();
        cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .env("PG_URL", &self.db_url)
            .env("TARGET_PG_URL", &self.db_url)
            .env("REFRACT_SLOT", &self.slot)
            .env("WARM_TABLE", &self.warm_table)
            .env("HOT_PREFIX", &self.prefix)
            .env("REDIS_URL", &self.redis_url)
            .env("STATE_DIR", self.dir.join("state"))
            .env(
                "OBJECT_STORE_URL",
                format!("file://{}", self.dir.join("out").display()),
            )
            .env("REFRACT_CLOCK", clock);
        cmd
    }

    /// The shipped pipeline file.
    pub fn pipeline_path() -> PathBuf {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../pipelines/device-tiers.toml"
        ))
    }

    /// The hot tier: per device set key, its members as canonical lines.
    pub fn hot_rows(&self) -> BTreeMap<String, BTreeSet<String>> {
        hot_rows(&self.redis_url, &self.prefix)
    }
}

/// Every device set under `prefix` (`{prefix}:{region}:{hash}:{device}`), its members as
/// canonical lines.
pub fn hot_rows(redis_url: &str, prefix: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut conn = redis::Client::open(redis_url)
        .unwrap()
        .get_connection()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(&mut conn)
        .unwrap();
    let mut out = BTreeMap::new();
    for key in keys.into_iter().filter(|k| !k.ends_with(":online")) {
        let parts: Vec<&str> = key.splitn(4, ':').collect();
        let (region, device) = (parts[1], parts[3]);
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .query(&mut conn)
            .unwrap();
        let lines = members
            .iter()
            .map(|m| {
                let v: serde_json::Value = serde_json::from_str(m).unwrap();
                let cell = |name: &str| match &v[name] {
                    serde_json::Value::Null => String::new(),
                    other => other.to_string(),
                };
                canonical(&format!(
                    "{device}|{}|{region}|{}|{}|{}|{}",
                    v["ts"],
                    cell("battery"),
                    cell("signal"),
                    cell("lat"),
                    cell("lon")
                ))
            })
            .collect();
        out.insert(key, lines);
    }
    out
}

/// The cold tier under `dir` read with DuckDB: canonical lines, with how many times each
/// `(device, ts)` is there (more than once is a duplicate).
pub fn cold_rows(dir: &Path) -> (BTreeSet<String>, usize) {
    if !dir.exists() {
        return (BTreeSet::new(), 0);
    }
    let script = format!(
        r#"
import duckdb
duckdb.sql("SET enable_progress_bar = false")
rows = duckdb.sql("""
  SELECT device_id, epoch_us(ts), region, battery::VARCHAR, signal::VARCHAR, lat::VARCHAR,
         lon::VARCHAR, count(*) OVER (PARTITION BY device_id, ts) AS n
  FROM read_parquet('{dir}/*/*/*.parquet', hive_partitioning = true)
""").fetchall()
for r in rows:
    print('|'.join('' if v is None else str(v) for v in r))
"#,
        dir = dir.display()
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "DuckDB failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = BTreeSet::new();
    let mut doubled = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let (row, n) = line
            .rsplit_once('|')
            .unwrap_or_else(|| panic!("not a row from DuckDB: {line}"));
        if n != "1" {
            doubled += 1;
        }
        lines.insert(canonical(row));
    }
    (lines, doubled)
}

/// A canonical line with its numbers printed one way (`1.0` and `1` are the same value, and
/// PostgreSQL, DuckDB and JSON print them differently).
pub fn canonical(line: &str) -> String {
    line.split('|')
        .enumerate()
        .map(|(i, v)| match v.parse::<f64>() {
            Ok(f) if i >= 3 => f.to_string(),
            _ => v.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// Per `(device, day)` counts of canonical lines (`day` = UTC day of the time).
pub fn per_device_day(rows: &BTreeSet<String>) -> BTreeMap<(String, i64), usize> {
    let mut out = BTreeMap::new();
    for row in rows {
        let mut parts = row.split('|');
        let device = parts.next().unwrap().to_owned();
        let ts: i64 = parts.next().unwrap().parse().unwrap();
        *out.entry((device, ts.div_euclid(86_400_000_000)))
            .or_default() += 1;
    }
    out
}

pub const HOUR: i64 = 3_600_000_000;
pub const DAY: i64 = 24 * HOUR;
pub const HOT: i64 = 2 * HOUR;
pub const WARM: i64 = 30 * DAY;

pub fn rfc3339(micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(micros)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The shipped pipeline with a file source reading `log` in place of PostgreSQL, in batches of
/// at most `max_events`; `follow` keeps reading as the file grows (a daemon).
pub fn file_pipeline(dir: &Path, log: &Path, max_events: usize, follow: bool) -> PathBuf {
    let shipped = std::fs::read_to_string(Env::pipeline_path()).unwrap();
    let start = shipped.find("[source]").unwrap();
    let end = shipped.find("[projections.").unwrap();
    let source = format!(
        "[pipeline.batch]\nmax_events = {max_events}\n\n[source]\nkind = \"file\"\npath = \"{}\"\nfollow = {follow}\npoll_interval_ms = 20\n\n",
        log.display()
    );
    let text = format!("{}{source}{}", &shipped[..start], &shipped[end..]);
    let path = dir.join("tiers-file.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// One heartbeat row.
#[derive(Clone)]
pub struct Beat {
    pub device: String,
    pub region: String,
    pub ts: i64,
    pub battery: Option<f32>,
    pub signal: i32,
}

impl Beat {
    pub fn json(&self) -> Value {
        // A real as PostgreSQL sends it: its shortest decimal.
        let battery: Option<f64> = self.battery.map(|b| b.to_string().parse().unwrap());
        json!({"device_id": self.device, "ts": rfc3339(self.ts), "region": self.region,
               "battery": battery, "signal": self.signal, "lat": 52.5, "lon": 13.25})
    }

    pub fn line(&self) -> String {
        let battery = self.battery.map(|b| b.to_string()).unwrap_or_default();
        canonical(&format!(
            "{}|{}|{}|{battery}|{}|52.5|13.25",
            self.device, self.ts, self.region, self.signal
        ))
    }
}

pub fn envelope(op: &str, before: Option<&Beat>, after: Option<&Beat>) -> String {
    json!({"before": before.map(Beat::json), "after": after.map(Beat::json), "op": op,
           "source": {"schema": "public", "table": "device_heartbeats"}})
    .to_string()
}

/// What each tier must hold after `events` at `clock`, computed from the events alone: the
/// last write of each `(device, ts)` wins, and the age at the clock says where it belongs.
pub fn model(events: &[(&str, Beat)], clock: i64) -> [BTreeSet<String>; 3] {
    let mut last: BTreeMap<(String, i64), Option<Beat>> = BTreeMap::new();
    for (op, beat) in events {
        last.insert(
            (beat.device.clone(), beat.ts),
            (*op != "d").then(|| beat.clone()),
        );
    }
    let mut tiers: [BTreeSet<String>; 3] = Default::default();
    for beat in last.into_values().flatten() {
        let age = (clock - beat.ts).max(0);
        if age < HOT {
            tiers[0].insert(beat.line());
        }
        if age < WARM {
            tiers[1].insert(beat.line());
        } else {
            tiers[2].insert(beat.line());
        }
    }
    tiers
}

/// A PostgreSQL server of the test's own (initdb in a temporary directory, run as the
/// `postgres` user on a free port), so that restarting it disturbs no other test.
pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
    /// Server settings beyond the port and address (`-c name=value …`).
    settings: String,
}

impl PrivatePostgres {
    const BIN: &'static str = "/usr/lib/postgresql/15/bin";

    pub fn start() -> Self {
        Self::start_with("")
    }

    /// A server in logical-replication mode, for a PostgreSQL source of its own.
    pub fn start_logical() -> Self {
        Self::start_with("-c wal_level=logical")
    }

    fn start_with(settings: &str) -> Self {
        let port = super::cache::free_port();
        let dir = std::env::temp_dir().join(format!("refract-pg-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        as_postgres(
            &["chown", "-R", "postgres", &dir.display().to_string()],
            true,
        );
        let data = dir.join("data").display().to_string();
        let initdb = format!("{}/initdb", Self::BIN);
        as_postgres(
            &[&initdb, "-D", &data, "--auth=trust", "--username=postgres"],
            false,
        );
        let pg = PrivatePostgres {
            port,
            dir,
            settings: settings.to_owned(),
        };
        pg.pg_ctl(&["start", "-w"]);
        pg
    }

    fn pg_ctl(&self, args: &[&str]) {
        let data = self.dir.join("data").display().to_string();
        let log = self.dir.join("log").display().to_string();
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 {}",
            self.port,
            self.dir.display(),
            self.settings
        );
        let program = format!("{}/pg_ctl", Self::BIN);
        let mut all = vec![program.as_str(), "-D", &data, "-l", &log, "-o", &options];
        all.extend(args);
        as_postgres(&all, false);
    }

    /// Restarts the server (`pg_ctl restart -m fast`: every connection is closed).
    pub fn restart(&self) {
        self.pg_ctl(&["restart", "-w", "-m", "fast"]);
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.pg_ctl(&["stop", "-m", "immediate"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs a command as the `postgres` user (root runs the tests; initdb refuses root), or as is
/// when `as_root`.
fn as_postgres(args: &[&str], as_root: bool) {
    let mut cmd = if as_root || !is_root() {
        let mut c = Command::new(args[0]);
        c.args(&args[1..]);
        c
    } else {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).args(args);
        c
    };
    let out = cmd.output().expect("the command runs");
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}
