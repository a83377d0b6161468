//! What the tier-query test works with: a database of its own holding the showcase
//! `device_heartbeats` table, the heartbeats it fills it with, the shipped
//! `pipelines/device-tiers.toml` run on a fixed clock, and the rows as the source table holds
//! them (the independent model).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::pg::{psql, url as pg_url, wait_guarded};
use crate::common::{Rng, in_ci, refract};

/// A microsecond.
pub const MICRO: i64 = 1;
/// An hour in microseconds.
pub const HOUR: i64 = 3_600_000_000 * MICRO;
/// A day in microseconds.
pub const DAY: i64 = 24 * HOUR;
/// A minute in microseconds.
pub const MINUTE: i64 = 60_000_000 * MICRO;
/// The regions devices are spread over.
pub const REGIONS: &[&str] = &["EU", "US", "CN_SHANGHAI", "AP_SOUTH"];
/// How far back the heartbeats go: past the warm window (30 days) by six days.
pub const SPAN: i64 = 36 * DAY;
/// The last hours, where devices beat faster (the hot window is two of them).
pub const RECENT: i64 = 6 * HOUR;

/// The database, slot and Redis prefix of this test, removed before it runs and when it ends
/// (also when it fails): a leftover slot retains WAL.
pub struct Scratch {
    pub name: String,
}

impl Scratch {
    pub fn new(name: &str) -> Self {
        let scratch = Scratch {
            name: name.to_owned(),
        };
        scratch.remove();
        psql(&format!("CREATE DATABASE {name}"));
        scratch
    }

    /// `postgres://…/{name}`: the server of `PG_URL`, this test's database.
    pub fn url(&self) -> String {
        database_url(&self.name)
    }

    /// The slot name (also the Redis key prefix).
    pub fn slot(&self) -> String {
        format!("refract_{}", self.name)
    }

    fn remove(&self) {
        let name = &self.name;
        let exists = psql(&format!(
            "SELECT count(*) FROM pg_database WHERE datname = '{name}'"
        ));
        if exists == "1" {
            // A logical slot is dropped from its own database, and blocks dropping it.
            let out = Command::new("psql")
                .args([&self.url(), "-X", "-Atqc"])
                .arg(format!(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                       WHERE database = '{name}' AND active_pid IS NOT NULL;
                     SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                       WHERE database = '{name}';"
                ))
                .output()
                .expect("psql runs");
            if !out.status.success() {
                eprintln!(
                    "WARNING: slots of {name}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            psql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
        }
        delete_keys(&format!("{}:*", self.slot()));
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.remove();
    }
}

/// `PG_URL` with its database replaced by `db`.
pub fn database_url(db: &str) -> String {
    let url = pg_url();
    let (base, _) = url.split_once('?').unwrap_or((&url, ""));
    let (server, _) = base.rsplit_once('/').expect("PG_URL names a database");
    format!("{server}/{db}")
}

/// The local Redis of the tests (`REDIS_URL`).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Deletes every key matching `pattern` in the tests' Redis.
pub fn delete_keys(pattern: &str) {
    let mut conn = redis::Client::open(redis_url())
        .and_then(|c| c.get_connection())
        .expect("the local Redis answers");
    let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(&mut conn).unwrap();
    for chunk in keys.chunks(1000) {
        redis::cmd("DEL").arg(chunk).exec(&mut conn).unwrap();
    }
}

/// One generated heartbeat.
pub struct Beat {
    pub device: String,
    pub micros: i64,
    pub region: &'static str,
    pub battery: Option<f32>,
    pub signal: Option<i32>,
    pub lat: f64,
    pub lon: f64,
}

/// How a device behaved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Habit {
    /// Beats to the end, every `period` minutes in the recent hours.
    Regular,
    /// Fell silent minutes to days before the clock.
    Quiet,
    /// Fell silent more than 31 days before the clock: only the cold tier has it.
    Archived,
}

/// The devices: `(id, habit)`.
pub fn devices(count: usize, seed: u64) -> Vec<(String, Habit)> {
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|i| {
            let habit = match rng.below(100) {
                0..3 => Habit::Archived,
                3..12 => Habit::Quiet,
                _ => Habit::Regular,
            };
            (format!("dev-{i:04}"), habit)
        })
        .collect()
}

/// Heartbeats of `devices` over `[clock - SPAN, clock)`: hourly (jittered to the microsecond)
/// with one hour in 12 missing, then every 1, 4, 15 or 40 minutes (per device) in the last
/// `RECENT` hours with one slot in 10 missing; quiet and archived devices stop early.
pub fn heartbeats(devices: &[(String, Habit)], clock: i64, seed: u64) -> Vec<Beat> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for (i, (device, habit)) in devices.iter().enumerate() {
        let silent_from = match habit {
            Habit::Regular => clock,
            // Half of them within the last hours, so the hot set has heartbeats from before
            // the window that no later write trimmed.
            Habit::Quiet => {
                let within = if rng.below(2) == 0 {
                    6 * HOUR
                } else {
                    72 * HOUR
                };
                clock - MINUTE - rng.below(within as u64) as i64
            }
            Habit::Archived => clock - 31 * DAY - rng.below(4 * 24) as i64 * HOUR,
        };
        let period = [1, 4, 15, 40][rng.below(4) as usize] * MINUTE;
        let region = REGIONS[i % REGIONS.len()];
        let mut slots = Vec::new();
        let mut t = clock - SPAN;
        while t < clock - RECENT {
            if rng.below(12) != 0 {
                slots.push(t + rng.below(HOUR as u64) as i64);
            }
            t += HOUR;
        }
        while t < clock {
            if rng.below(10) != 0 {
                slots.push(t + rng.below(period as u64) as i64);
            }
            t += period;
        }
        for micros in slots.into_iter().filter(|&m| m < silent_from) {
            out.push(Beat {
                device: device.clone(),
                micros,
                region,
                battery: (rng.below(20) != 0).then(|| rng.below(1_000_000) as f32 / 7.0),
                signal: (rng.below(20) != 0).then(|| -(30 + rng.below(90) as i32)),
                lat: -60.0 + rng.below(1 << 52) as f64 / (1u64 << 52) as f64 * 120.0,
                lon: -180.0 + rng.below(1 << 52) as f64 / (1u64 << 52) as f64 * 360.0,
            });
        }
    }
    out
}

/// Creates the showcase table and a staging table `hb_stage` holding `beats` (times as
/// microseconds, so they reach the table exactly).
pub fn load_stage(db: &str, dir: &Path, beats: &[Beat]) {
    let showcase = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/showcase/device_heartbeats.sql")
        .canonicalize()
        .expect("the showcase schema device_heartbeats.sql");
    let csv = dir.join("stage.csv");
    let mut text = String::with_capacity(beats.len() * 100);
    let opt = |v: Option<String>| v.unwrap_or_default();
    for b in beats {
        text.push_str(&format!(
            "{},{},{},{},{},{},{}\n",
            b.device,
            b.micros,
            b.region,
            opt(b.battery.map(|f| f.to_string())),
            opt(b.signal.map(|s| s.to_string())),
            b.lat,
            b.lon
        ));
    }
    std::fs::write(&csv, text).unwrap();
    let status = Command::new("psql")
        .args([&database_url(db), "-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .arg("-f")
        .arg(&showcase)
        .arg("-c")
        .arg(
            "CREATE TABLE hb_stage (device_id text, micros bigint, region text, battery real, \
             signal int, lat double precision, lon double precision)",
        )
        .arg("-c")
        .arg(format!(
            "\\copy hb_stage FROM '{}' (FORMAT csv)",
            csv.display()
        ))
        .status()
        .expect("psql runs");
    assert!(status.success(), "loading the heartbeats failed");
}

/// Moves the staged heartbeats matching `condition` (SQL on `micros`) into the source table,
/// in one transaction, in key order.
pub fn insert_staged(db: &str, condition: &str) -> u64 {
    let mut client = postgres::Client::connect(&database_url(db), postgres::NoTls).unwrap();
    client
        .execute(
            &format!(
                "INSERT INTO device_heartbeats (device_id, ts, region, battery, signal, lat, lon)
                 SELECT device_id, timestamptz 'epoch' + micros * interval '1 microsecond',
                        region, battery, signal, lat, lon
                 FROM hb_stage WHERE {condition} ORDER BY device_id, micros"
            ),
            &[],
        )
        .unwrap()
}

/// The environment of the shipped pipeline for this test at pipeline clock `clock` (RFC 3339).
pub fn pipeline_env(scratch: &Scratch, dir: &Path, clock: &str) -> Vec<(String, String)> {
    [
        ("PG_URL", scratch.url()),
        ("REFRACT_SLOT", scratch.slot()),
        ("WARM_TABLE", "heartbeats_warm".into()),
        (
            "OBJECT_STORE_URL",
            format!("file://{}", dir.join("objects").display()),
        ),
        ("STATE_DIR", dir.join("state").display().to_string()),
        ("REFRACT_CLOCK", clock.into()),
        ("HOT_PREFIX", scratch.slot()),
        ("REDIS_URL", redis_url()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The shipped pipeline file.
pub fn shipped_pipeline() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("device-tiers.toml")
}

/// `refract run device-tiers.toml --until-caught-up` in `env`; returns its summary.
pub fn catch_up(env: &[(String, String)], dir: &Path) -> serde_json::Value {
    let summary = dir.join("summary.json");
    let _ = std::fs::remove_file(&summary);
    let child = refract()
        .arg("run")
        .arg(shipped_pipeline())
        .arg("--until-caught-up")
        .arg("--summary-json")
        .arg(&summary)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the refract binary starts");
    let run = wait_guarded(child, "refract run --until-caught-up");
    assert!(
        run.status.success(),
        "catch-up failed ({}): {}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap()
}

/// `refract tiers device-tiers.toml ARGS…` in `env`: (exit success, stdout lines, stderr).
pub fn tiers(env: &[(String, String)], args: &[&str]) -> (bool, Vec<String>, String) {
    let out = refract()
        .arg("tiers")
        .arg(shipped_pipeline())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("the refract binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    (
        out.status.success(),
        stdout.lines().map(str::to_owned).collect(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A printed JSON object, each field as its JSON text (numbers are then parsed with Rust's
/// correctly rounded `parse`: serde_json's default float parsing may miss the last bit).
pub type Line = std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>;

/// Parses a printed line.
pub fn parse_line(line: &str) -> Line {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}"))
}

/// A string field (`None` when missing or not a string).
pub fn text(line: &Line, field: &str) -> Option<String> {
    serde_json::from_str(line.get(field)?.get()).ok()
}

/// A number field, parsed from its text (`None` when missing or null).
pub fn number<T: std::str::FromStr>(line: &Line, field: &str) -> Option<T> {
    line.get(field)?.get().parse().ok()
}

/// How many devices the test uses: a few hundred, 80 with `CI=true`.
pub fn device_count() -> usize {
    if in_ci() { 80 } else { 300 }
}
