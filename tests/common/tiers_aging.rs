//! Helpers of the aging tests (`tests/tiers_aging.rs`): a database of the test's own with the showcase heartbeat table,
//! the shipped `pipelines/device-tiers.toml` run against it (its own slot, warm table, Redis key
//! prefix, cold directory and state directory), and DuckDB as the independent reader of the
//! cold Parquet files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::pg;

/// The shipped pipeline file.
pub fn shipped_pipeline() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("device-tiers.toml")
}

/// The warm table the tests name (`WARM_TABLE`).
pub const WARM: &str = "hb_warm";

/// An hour and a day in microseconds.
pub const HOUR: i64 = 3_600_000_000;
pub const DAY: i64 = 24 * HOUR;

/// `micros` as an RFC 3339 instant (for `REFRACT_CLOCK`).
pub fn instant(micros: i64) -> String {
    // Civil-from-days (Howard Hinnant's algorithm): no date crate in the tests.
    let secs = micros.div_euclid(1_000_000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// A database, replication slot, Redis prefix and directory of one test, removed at the end
/// (also when the test fails).
pub struct TierDb {
    /// The database's name.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// The test's directory (cold tier under `cold/`, state under `state/`).
    pub dir: tempfile::TempDir,
}

impl TierDb {
    /// Creates database `name` (dropping an earlier run's) with the showcase heartbeat table.
    pub fn new(name: &str) -> Self {
        let db = TierDb {
            name: name.to_owned(),
            url: format!("{}/{name}", server_url()),
            dir: tempfile::tempdir().unwrap(),
        };
        db.remove();
        pg::psql(&format!("CREATE DATABASE {name}"));
        db.sql(
            "CREATE TABLE device_heartbeats (device_id text NOT NULL, ts timestamptz NOT NULL, \
             region text NOT NULL, battery real, signal int, lat double precision, \
             lon double precision, PRIMARY KEY (device_id, ts))",
        );
        db
    }

    /// The replication slot of the test's pipeline.
    pub fn slot(&self) -> String {
        format!("refract_{}", self.name)
    }

    /// The Redis key prefix of the test's hot tier.
    pub fn prefix(&self) -> String {
        format!("t_{}", self.name)
    }

    /// The cold tier's directory.
    pub fn cold(&self) -> PathBuf {
        self.dir.path().join("cold").join("heartbeats")
    }

    /// A client of the test's database.
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, postgres::NoTls).expect("PostgreSQL answers")
    }

    /// Runs SQL on the test's database through psql; returns its unaligned output.
    pub fn sql(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .args([&self.url, "-X", "-v", "ON_ERROR_STOP=1", "-Atqc", sql])
            .output()
            .expect("psql runs");
        assert!(
            out.status.success(),
            "psql failed on {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `refract ARGS` on the shipped pipeline with the test's environment and clock; `pg_url`
    /// overrides the source URL (to name a session with `application_name`).
    pub fn refract(&self, clock: i64, pg_url: Option<&str>) -> Command {
        let mut cmd = super::refract();
        cmd.env("PG_URL", pg_url.unwrap_or(&self.url))
            .env_remove("TARGET_PG_URL")
            .env("REDIS_URL", redis_url())
            .env("REFRACT_SLOT", self.slot())
            .env("WARM_TABLE", WARM)
            .env("HOT_PREFIX", self.prefix())
            .env(
                "OBJECT_STORE_URL",
                format!("file://{}", self.dir.path().join("cold").display()),
            )
            .env("STATE_DIR", self.dir.path().join("state"))
            .env("REFRACT_CLOCK", instant(clock));
        cmd
    }

    /// `refract run PIPELINE --until-caught-up` at `clock`, asserting success.
    pub fn catch_up(&self, pipeline: &Path, clock: i64) {
        let child = self
            .refract(clock, None)
            .arg("run")
            .arg(pipeline)
            .arg("--until-caught-up")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the refract binary starts");
        let out = pg::wait_guarded(child, "refract run --until-caught-up");
        assert!(
            out.status.success(),
            "catch-up failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `refract tiers PIPELINE age` at `clock` to its end; its output.
    pub fn age(&self, pipeline: &Path, clock: i64) -> Output {
        let child = self
            .refract(clock, None)
            .args(["tiers"])
            .arg(pipeline)
            .arg("age")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the refract binary starts");
        pg::wait_guarded(child, "refract tiers age")
    }

    /// Like [`TierDb::age`], asserting success; returns its summary line.
    pub fn age_ok(&self, pipeline: &Path, clock: i64) -> String {
        let out = self.age(pipeline, clock);
        assert!(
            out.status.success(),
            "aging failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Rows of a DuckDB query over every cold file (`{cold}` in `sql` stands for
    /// `read_parquet(…/*/*/*.parquet, filename = true)`), as JSON arrays.
    pub fn duckdb(&self, sql: &str) -> Vec<Value> {
        let files = format!(
            "read_parquet('{}/*/*/*.parquet', hive_partitioning = false, filename = true)",
            self.cold().display()
        );
        if !self.cold().exists() {
            return Vec::new();
        }
        duckdb(&sql.replace("{cold}", &files))
    }

    /// Per `(device, day number)`: how many heartbeats the source, the warm tier and the cold
    /// tier (read by DuckDB) hold.
    pub fn counts(&self) -> BTreeMap<(String, i64), [i64; 3]> {
        let mut out: BTreeMap<(String, i64), [i64; 3]> = BTreeMap::new();
        for (i, table) in ["device_heartbeats", WARM].iter().enumerate() {
            let text = self.sql(&format!(
                "SELECT device_id, floor(extract(epoch FROM ts) / 86400)::bigint, count(*) \
                 FROM {table} GROUP BY 1, 2"
            ));
            for line in text.lines().filter(|l| !l.is_empty()) {
                let f: Vec<&str> = line.split('|').collect();
                out.entry((f[0].to_owned(), f[1].parse().unwrap()))
                    .or_default()[i] = f[2].parse().unwrap();
            }
        }
        for row in self.duckdb(
            "SELECT device_id, epoch_us(ts) // 86400000000, count(*) FROM {cold} GROUP BY 1, 2",
        ) {
            out.entry((
                row[0].as_str().unwrap().to_owned(),
                row[1].as_i64().unwrap(),
            ))
            .or_default()[2] = row[2].as_i64().unwrap();
        }
        out
    }

    /// `(device, ts)` pairs the cold tier holds more than once (DuckDB).
    pub fn cold_duplicates(&self) -> Vec<Value> {
        self.duckdb(
            "SELECT device_id, epoch_us(ts), count(*) FROM {cold} GROUP BY 1, 2 HAVING count(*) > 1 LIMIT 10",
        )
    }

    /// Cold rows whose file is not in their device's and day's directory, or whose
    /// `device_hash` is not `md5(device_id)[0..4]` (DuckDB's md5).
    pub fn misplaced_cold_rows(&self) -> i64 {
        self.duckdb(
            "SELECT count(*) FROM {cold} WHERE \
             regexp_extract(filename, 'device_id=([^/]+)/', 1) <> device_id \
             OR regexp_extract(filename, 'date=([0-9]+)/', 1) <> strftime(make_timestamp(epoch_us(ts)), '%Y%m%d') \
             OR device_hash <> left(md5(device_id), 4)",
        )[0][0]
            .as_i64()
            .unwrap()
    }

    /// Tables left by aging runs (`{warm}_p…_aging{run}`).
    pub fn leftover_aging_tables(&self) -> String {
        self.sql(&format!(
            "SELECT string_agg(relname, ',') FROM pg_class WHERE relkind IN ('r', 'p') \
             AND relname LIKE '{WARM}\\_p%\\_aging%'"
        ))
    }

    /// The aging runs as `(run, day, state, rows, files)`.
    pub fn runs(&self) -> Vec<(i64, String, String, i64, i64)> {
        self.sql(&format!(
            "SELECT run, day, state, coalesce(rows, -1), coalesce(files, -1) FROM {WARM}_aging ORDER BY run"
        ))
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split('|').collect();
            (
                f[0].parse().unwrap(),
                f[1].to_owned(),
                f[2].to_owned(),
                f[3].parse().unwrap(),
                f[4].parse().unwrap(),
            )
        })
        .collect()
    }

    /// The test's Redis keys.
    pub fn redis_keys(&self) -> Vec<String> {
        let mut conn = redis_connection();
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix()))
            .query(&mut conn)
            .unwrap();
        keys.sort();
        keys
    }

    fn remove(&self) {
        let name = &self.name;
        let slot = self.slot();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = Command::new("psql")
                .args([&pg::url(), "-X", "-v", "ON_ERROR_STOP=1", "-Atq", "-c"])
                .arg(format!(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                       WHERE slot_name = '{slot}' AND active_pid IS NOT NULL;
                     SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                       WHERE slot_name = '{slot}';"
                ))
                // DROP DATABASE cannot share a transaction with the statements above.
                .args([
                    "-c",
                    &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                ])
                .output()
                .expect("psql runs");
            if out.status.success() {
                break;
            }
            if Instant::now() > deadline {
                eprintln!(
                    "WARNING: could not remove database {name} and slot {slot}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                break;
            }
            // A killed walsender still holds the slot for a moment.
            std::thread::sleep(Duration::from_millis(250));
        }
        if let Ok(mut conn) = redis::Client::open(redis_url()).and_then(|c| c.get_connection()) {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{}:*", self.prefix()))
                .query(&mut conn)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys).query(&mut conn);
            }
        }
    }
}

impl Drop for TierDb {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The PostgreSQL server's URL without a database.
fn server_url() -> String {
    let url = pg::url();
    match url.rfind('/') {
        Some(i) if i > "postgres://".len() => url[..i].to_owned(),
        _ => url,
    }
}

/// The Redis of the hot tier (`REDIS_URL`, by default the local one).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A connection to that Redis.
pub fn redis_connection() -> redis::Connection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_connection()
        .expect("Redis answers")
}

/// Runs `sql` in DuckDB (Python), returning the rows as JSON arrays.
pub fn duckdb(sql: &str) -> Vec<Value> {
    let script = "import duckdb, json, sys\n\
                  c = duckdb.connect()\n\
                  c.execute(\"SET TimeZone = 'UTC'\")\n\
                  print(json.dumps(c.sql(sys.argv[1]).fetchall(), default=str))";
    let out = Command::new("python3")
        .args(["-c", script, sql])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "DuckDB failed on {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("DuckDB's rows as JSON")
}

/// Waits until `condition` holds, failing after the hang guard.
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + pg::hang_guard();
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A sample of devices' rows in the source, and in warm and cold together (cold read by
/// DuckDB), as `(device, ts, region, battery, signal, lat, lon)` in device and time order.
pub type SampleRow = (
    String,
    i64,
    String,
    Option<f32>,
    Option<i64>,
    Option<u64>,
    Option<u64>,
);

pub fn sample_row(v: &Value) -> SampleRow {
    (
        v[0].as_str().unwrap().to_owned(),
        v[1].as_i64().unwrap(),
        v[2].as_str().unwrap().to_owned(),
        v[3].as_f64().map(|f| f as f32),
        v[4].as_i64(),
        v[5].as_f64().map(f64::to_bits),
        v[6].as_f64().map(f64::to_bits),
    )
}

pub fn pg_rows(db: &TierDb, table: &str, devices: &[String]) -> Vec<SampleRow> {
    let list: Vec<String> = devices.iter().map(|d| format!("'{d}'")).collect();
    let json = db.sql(&format!(
        "SELECT coalesce(json_agg(json_build_array(device_id, \
         (extract(epoch FROM ts) * 1000000)::bigint, region, battery, signal, lat, lon) \
         ORDER BY device_id, ts), '[]') FROM {table} WHERE device_id IN ({})",
        list.join(", ")
    ));
    let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
    rows.iter().map(sample_row).collect()
}

pub fn cold_rows(db: &TierDb, devices: &[String]) -> Vec<SampleRow> {
    let list: Vec<String> = devices.iter().map(|d| format!("'{d}'")).collect();
    db.duckdb(&format!(
        "SELECT device_id, epoch_us(ts), region, battery, signal, lat, lon FROM {{cold}} \
         WHERE device_id IN ({}) ORDER BY 1, 2",
        list.join(", ")
    ))
    .iter()
    .map(sample_row)
    .collect()
}

/// Asserts warm + cold hold exactly the source's heartbeats: per device and day, cold only
/// before `aged_before` and warm only after, and row for row for `sample`.
pub fn assert_tiers_hold_the_source(db: &TierDb, aged_before: i64, sample: &[String]) -> usize {
    let boundary = aged_before.div_euclid(DAY);
    let mut wrong = Vec::new();
    let mut rows = 0;
    for ((device, day), [source, warm, cold]) in db.counts() {
        rows += source;
        let expected = if day < boundary {
            [source, 0, source]
        } else {
            [source, source, 0]
        };
        if [source, warm, cold] != expected {
            wrong.push(format!(
                "{device} day {day}: source {source}, warm {warm}, cold {cold}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} device-days differ, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    assert!(rows > 0);
    let source = pg_rows(db, "device_heartbeats", sample);
    let mut tiers = pg_rows(db, WARM, sample);
    tiers.extend(cold_rows(db, sample));
    tiers.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    assert_eq!(source.len(), tiers.len(), "sample rows");
    for (s, t) in source.iter().zip(&tiers) {
        assert_eq!(s, t, "row of the sample");
    }
    println!(
        "compared: {rows} heartbeats per device and day (source = warm + cold), {} row for row \
         for devices {sample:?}",
        source.len()
    );
    rows as usize
}

/// Asserts the hot tier holds exactly the source heartbeats younger than the hot window `hot`
/// at `clock`: each device's set, and each region's set of devices scored by their newest.
pub fn assert_hot_holds_the_window(db: &TierDb, clock: i64, hot: i64) {
    let prefix = db.prefix();
    let mut expected: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    let mut regions: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
    let text = db.sql(&format!(
        "SELECT device_id, region, left(md5(device_id), 4), (extract(epoch FROM ts) * 1000000)::bigint \
         FROM device_heartbeats WHERE ts > '{}'::timestamptz",
        instant(clock - hot)
    ));
    for line in text.lines().filter(|l| !l.is_empty()) {
        let f: Vec<&str> = line.split('|').collect();
        let ts: i64 = f[3].parse().unwrap();
        let key = format!("{prefix}:{}:{}:{}", f[1], f[2], f[0]);
        expected.entry(key).or_default().insert(ts);
        let newest = regions
            .entry(format!("{prefix}:{}:online", f[1]))
            .or_default()
            .entry(f[0].to_owned())
            .or_insert(ts);
        *newest = (*newest).max(ts);
    }
    let mut conn = redis_connection();
    let keys = db.redis_keys();
    let wanted: BTreeSet<&String> = expected.keys().chain(regions.keys()).collect();
    let present: BTreeSet<&String> = keys.iter().collect();
    assert_eq!(present, wanted, "hot keys");
    for (key, times) in &expected {
        let held: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut conn)
            .unwrap();
        let held: BTreeSet<i64> = held.iter().map(|(_, s)| *s as i64).collect();
        assert_eq!(&held, times, "{key}");
    }
    for (key, devices) in &regions {
        let held: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(&mut conn)
            .unwrap();
        let held: BTreeMap<String, i64> = held.into_iter().map(|(d, s)| (d, s as i64)).collect();
        assert_eq!(&held, devices, "{key}");
    }
    println!(
        "hot: {} device set(s) and {} region set(s), exactly the last two hours",
        expected.len(),
        regions.len()
    );
}

/// Asserts every run is over, and no detached table and no duplicate in cold is left.
pub fn assert_runs_over(db: &TierDb) -> Vec<(i64, String, String, i64, i64)> {
    let runs = db.runs();
    let open: Vec<_> = runs.iter().filter(|r| r.2 != "dropped").collect();
    assert!(open.is_empty(), "unfinished runs: {open:?}");
    assert_eq!(db.leftover_aging_tables(), "", "detached tables left");
    assert_eq!(
        db.cold_duplicates(),
        Vec::<Value>::new(),
        "(device, ts) in cold twice"
    );
    assert_eq!(
        db.misplaced_cold_rows(),
        0,
        "cold rows outside their device's day"
    );
    runs
}
