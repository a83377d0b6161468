//! Aging of the IoT tiers end to end (issue 23), on the shipped `pipelines/device-tiers.toml`
//! against the real PostgreSQL and Redis, each test in a database of its own:
//!
//! - 36 days of heartbeats of a few hundred devices come through refract into warm, then
//!   `refract tiers age` is SIGKILLed at random moments (some aimed at each step of a run),
//!   then run to its end: warm + cold hold exactly the source rows (per device and day, and row
//!   for row for a sample read back by DuckDB), nothing is in cold twice, no detached table is
//!   left, every run is dropped, and the hot tier holds exactly the last two hours;
//! - a heartbeat both in a warm partition and in the late file ends in cold once;
//! - a heartbeat written to an hour whose partition a run has just detached (a daemon whose
//!   clock is behind the pass's) lands in a fresh partition and is aged by a later run;
//! - the daemon ages on its schedule and stops with the run.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::tiers_aging::{
    DAY, HOUR, TierDb, WARM, assert_hot_holds_the_window, assert_runs_over,
    assert_tiers_hold_the_source, instant, shipped_pipeline, wait_until,
};
use common::{Rng, Running, in_ci, pg};

/// 2026-01-01T00:00:00Z, where every test's heartbeats start.
const T0: i64 = 1_767_225_600_000_000;
/// The shipped file's windows.
const HOT: i64 = 2 * HOUR;
const WARM_WINDOW: i64 = 30 * DAY;
/// The `application_name` of the aging process's session, to follow it in `pg_stat_activity`.
const AGING_APP: &str = "refract_age";

/// Inserts `devices` devices' heartbeats every `interval_s` seconds for `days` days from T0
/// (each device offset by a few seconds, some batteries null).
fn insert_heartbeats(db: &TierDb, devices: i64, interval_s: i64, days: i64) {
    let per_day = 86_400 / interval_s;
    db.sql(&format!(
        "INSERT INTO device_heartbeats \
         SELECT 'dev-' || lpad(d::text, 4, '0'), \
                '{t0}'::timestamptz + k * interval '{interval_s} seconds' \
                    + ((d * 7) % {interval_s}) * interval '1 second', \
                (ARRAY['EU', 'US', 'CN_SHANGHAI'])[1 + d % 3], \
                CASE WHEN (d + k) % 17 = 0 THEN NULL ELSE ((d * 31 + k) % 1000) / 1000.0 END, \
                -40 - (d + k) % 60, 45.0 + d / 1000.0 + k / 1e6, 5.0 - d / 1000.0 \
         FROM generate_series(1, {devices}) d, generate_series(0, {last}) k",
        t0 = instant(T0),
        last = per_day * days - 1
    ));
}

/// The session of the aging process, if it has one: `(state, query)`.
fn aging_backend(pg: &mut postgres::Client) -> Option<(String, String)> {
    pg.query_opt(
        "SELECT coalesce(state, ''), left(query, 60) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1 ORDER BY backend_start DESC LIMIT 1",
        &[&AGING_APP],
    )
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
}

/// The newest run and its state.
fn newest_run(pg: &mut postgres::Client) -> Option<(i64, String)> {
    pg.query_opt(
        &format!("SELECT run, state FROM {WARM}_aging ORDER BY run DESC LIMIT 1"),
        &[],
    )
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
}

/// The state of the oldest unfinished run.
fn unfinished_state(pg: &mut postgres::Client) -> Option<String> {
    pg.query_opt(
        &format!("SELECT state FROM {WARM}_aging WHERE state <> 'dropped' ORDER BY run LIMIT 1"),
        &[],
    )
    .unwrap()
    .map(|r| r.get(0))
}

/// When a kill is sent.
#[derive(Clone, Copy, Debug)]
enum Aim {
    /// After a random delay from the start.
    Moment,
    /// A few random milliseconds after a run newer than the one at start enters this state.
    State(&'static str),
    /// As soon as the aging session runs a statement starting with this.
    Statement(&'static str),
}

/// Waits for `aim` (or the process's end), then SIGKILLs the process; returns whether the
/// kill landed on a running process and the statement its session was running.
fn aim_and_kill(
    pg: &mut postgres::Client,
    aging: &mut Running,
    aim: Aim,
    rng: &mut Rng,
) -> (bool, String) {
    let start = newest_run(pg);
    let deadline = Instant::now() + pg::hang_guard();
    let running = |aging: &mut Running| aging.child().try_wait().unwrap().is_none();
    match aim {
        Aim::Moment => std::thread::sleep(Duration::from_millis(20 + rng.below(700))),
        Aim::State(state) => {
            while running(aging) && Instant::now() < deadline {
                let now = newest_run(pg);
                if now != start && now.as_ref().is_some_and(|(_, s)| s == state) {
                    std::thread::sleep(Duration::from_millis(rng.below(30)));
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Aim::Statement(prefix) => {
            while running(aging) && Instant::now() < deadline {
                if aging_backend(pg).is_some_and(|(s, q)| s == "active" && q.starts_with(prefix)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    let statement = aging_backend(pg).map(|(_, q)| q).unwrap_or_default();
    let landed = running(aging);
    if landed {
        aging.child().kill().unwrap();
    }
    aging.child().wait().unwrap();
    (landed, statement)
}

/// The step a kill hit, from the unfinished run's state (read once the killed session ended)
/// and the statement the session was running.
fn step_hit(state: Option<&str>, statement: &str, landed: bool) -> &'static str {
    match state {
        _ if !landed => "none (the pass had ended)",
        Some("detaching") => "detach",
        Some("exporting") => "export",
        Some("exported") if statement.starts_with("DROP TABLE") => "drop",
        Some("exported") => "verify",
        Some(_) => "unknown",
        None if statement.contains("pg_advisory_lock(hashtext('refract.tiers.aging") => {
            "start (waiting for the aging lock)"
        }
        None => "between runs (picking a day, or trimming the hot tier)",
    }
}

/// Starts `refract tiers age` at `clock` `kills` times, each SIGKILLed at a moment drawn from
/// the aims in turn; returns how many kills hit each step.
fn kill_passes(
    db: &TierDb,
    pipeline: &std::path::Path,
    clock: i64,
    kills: usize,
    rng: &mut Rng,
) -> BTreeMap<&'static str, usize> {
    let mut pg = db.client();
    let aims = [
        Aim::Moment,
        Aim::State("detaching"),
        Aim::State("exporting"),
        Aim::State("exported"),
        Aim::Statement("DROP TABLE"),
    ];
    let age_url = format!("{}?application_name={AGING_APP}", db.url);
    let mut hits: BTreeMap<&str, usize> = BTreeMap::new();
    for i in 0..kills {
        let aim = aims[i % aims.len()];
        let mut aging = Running::spawn(
            db.refract(clock, Some(&age_url))
                .arg("tiers")
                .arg(pipeline)
                .arg("age")
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        let (landed, statement) = aim_and_kill(&mut pg, &mut aging, aim, rng);
        wait_until("the killed pass's session ended", || {
            aging_backend(&mut pg).is_none()
        });
        let state = unfinished_state(&mut pg);
        let step = step_hit(state.as_deref(), &statement, landed);
        let dropped = db.runs().iter().filter(|r| r.2 == "dropped").count();
        println!("kill {i} ({aim:?}): hit {step}; {dropped} run(s) dropped so far");
        *hits.entry(step).or_default() += 1;
    }
    hits
}

#[test]
fn sigkilled_aging_passes_lose_nothing_and_copy_nothing_twice() {
    let (devices, interval_s, kills) = if in_ci() {
        (100, 3600, 10)
    } else {
        (300, 900, 20)
    };
    let days = 36;
    let db = TierDb::new("aging_kill");
    let pipeline = shipped_pipeline();
    insert_heartbeats(&db, devices, interval_s, days);
    // A few devices still beat in the two hours before the aging clock (the hot tier's window).
    let clock = T0 + 2 * WARM_WINDOW;
    db.sql(&format!(
        "INSERT INTO device_heartbeats SELECT 'dev-' || lpad(d::text, 4, '0'), \
         '{}'::timestamptz + j * interval '15 minutes' + d * interval '1 second', \
         (ARRAY['EU', 'US', 'CN_SHANGHAI'])[1 + d % 3], 0.5, -60, 45.0, 5.0 \
         FROM generate_series(1, 10) d, generate_series(0, 11) j",
        instant(clock - 3 * HOUR)
    ));
    // Through refract: a clock 29 days after the first heartbeat puts every one in warm (the
    // later ones, "in the future", also in hot).
    let started = Instant::now();
    db.catch_up(&pipeline, T0 + 29 * DAY);
    let warm_rows: i64 = db
        .sql(&format!("SELECT count(*) FROM {WARM}"))
        .parse()
        .unwrap();
    let source_rows: i64 = db
        .sql("SELECT count(*) FROM device_heartbeats")
        .parse()
        .unwrap();
    assert_eq!(
        warm_rows, source_rows,
        "every heartbeat in warm before aging"
    );
    println!(
        "{source_rows} heartbeats of {devices} devices over {days} days in warm in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let mut rng = Rng::new(23);
    let hits = kill_passes(&db, &pipeline, clock, kills, &mut rng);
    println!("kills per step: {hits:?}");
    let inside: usize = ["detach", "export", "verify", "drop"]
        .iter()
        .filter_map(|s| hits.get(s))
        .sum();
    assert!(inside > 0, "no kill landed inside a run: {hits:?}");

    let summary = db.age_ok(&pipeline, clock);
    println!("final pass: {summary}");
    assert_eq!(
        db.age_ok(&pipeline, clock).split(';').next().unwrap(),
        "aged 0 day(s): 0 warm partition(s) dropped, 0 heartbeat(s) in 0 cold file(s)",
        "a second pass has nothing left"
    );
    let runs = assert_runs_over(&db);
    let days_aged: BTreeSet<&String> = runs.iter().map(|r| &r.1).collect();
    assert_eq!(days_aged.len(), 30, "30 days aged: {days_aged:?}");
    let sample: Vec<String> = [1, 2 + rng.below(devices as u64 - 1) as i64, devices]
        .iter()
        .map(|d| format!("dev-{d:04}"))
        .collect();
    assert_tiers_hold_the_source(&db, clock - WARM_WINDOW, &sample);
    assert_hot_holds_the_window(&db, clock, HOT);
}

#[test]
fn a_heartbeat_in_warm_and_in_the_late_file_ends_in_cold_once() {
    let db = TierDb::new("aging_dup");
    let pipeline = shipped_pipeline();
    insert_heartbeats(&db, 3, 3600, 2);
    db.catch_up(&pipeline, T0 + DAY);
    // The same heartbeat again, 40 days later: older than the warm window, so the projection
    // routes it to cold (the late file) while its first version is still in a warm partition.
    let (device, ts) = ("dev-0001", T0 + 3 * HOUR + 7_000_000);
    db.sql(&format!(
        "UPDATE device_heartbeats SET battery = 0.5 WHERE device_id = '{device}' AND ts = '{}'",
        instant(ts)
    ));
    let clock = T0 + 40 * DAY;
    db.catch_up(&pipeline, clock);
    let late = db
        .cold()
        .join(format!("device_id={device}/date=20260101/late.parquet"));
    assert!(late.exists(), "the late file holds the heartbeat");
    let in_warm = db.sql(&format!(
        "SELECT battery FROM {WARM} WHERE device_id = '{device}' AND ts = '{}'",
        instant(ts)
    ));
    assert_ne!(in_warm, "", "the warm partition holds it too");

    println!("{}", db.age_ok(&pipeline, clock));
    assert_runs_over(&db);
    assert_tiers_hold_the_source(&db, clock - WARM_WINDOW, &[device.to_owned()]);
    let held = db.duckdb(&format!(
        "SELECT battery, filename FROM {{cold}} WHERE device_id = '{device}' AND epoch_us(ts) = {ts}"
    ));
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        held[0][0].as_f64(),
        Some(0.5),
        "the newer version, from the late file"
    );
    assert!(held[0][1].as_str().unwrap().ends_with("/late.parquet"));
}

/// Takes the cold lock in a session of the test, then starts `refract tiers age` at `clock`
/// and waits until its first run has detached its day and waits for that lock; returns the
/// pass and the session holding the lock.
fn start_a_pass_held_at_the_cold_lock(
    db: &TierDb,
    pipeline: &std::path::Path,
    clock: i64,
) -> (std::process::Child, postgres::Client) {
    let mut holder = db.client();
    holder
        .batch_execute(&format!(
            "SELECT pg_advisory_lock(hashtext('refract.tiers.cold:' || '{WARM}'))"
        ))
        .unwrap();
    let age_url = format!("{}?application_name={AGING_APP}", db.url);
    let aging = db
        .refract(clock, Some(&age_url))
        .arg("tiers")
        .arg(pipeline)
        .arg("age")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pg = db.client();
    wait_until(
        "the pass detached day 1 and waits for the cold lock",
        || {
            newest_run(&mut pg) == Some((1, "exporting".into()))
                && pg
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                     AND application_name = $1 AND wait_event_type = 'Lock'",
                        &[&AGING_APP],
                    )
                    .unwrap()
                    .get::<_, i64>(0)
                    == 1
        },
    );
    (aging, holder)
}

#[test]
fn a_heartbeat_written_to_a_detached_hour_is_aged_by_a_later_run() {
    let db = TierDb::new("aging_late");
    let pipeline = shipped_pipeline();
    insert_heartbeats(&db, 2, 3600, 2);
    // A daemon whose clock is a day after the first heartbeats: every one goes to warm, and its
    // sink remembers the partitions it wrote to.
    let log = std::fs::File::create(db.dir.path().join("daemon.log")).unwrap();
    let mut daemon = Running::spawn(
        db.refract(T0 + DAY, None)
            .arg("run")
            .arg(&pipeline)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log),
    );
    let mut pg = db.client();
    wait_until("the daemon wrote every heartbeat to warm", || {
        pg.query_one(&format!("SELECT count(*) FROM {WARM}"), &[])
            .is_ok_and(|r| r.get::<_, i64>(0) == 96)
    });

    let clock = T0 + 32 * DAY;
    let (aging, mut holder) = start_a_pass_held_at_the_cold_lock(&db, &pipeline, clock);
    // A heartbeat for an hour of day 1 whose partition is now detached.
    let (device, ts) = ("dev-0001", T0 + 5 * HOUR + 30 * 60_000_000);
    db.sql(&format!(
        "INSERT INTO device_heartbeats VALUES ('{device}', '{}', 'US', 0.75, -70, 45.5, 5.5)",
        instant(ts)
    ));
    wait_until("the daemon wrote it to a fresh partition", || {
        db.sql(&format!(
            "SELECT count(*) FROM {WARM} WHERE device_id = '{device}' AND ts = '{}'",
            instant(ts)
        )) == "1"
    });
    let detached = db.sql(&format!(
        "SELECT count(*) FROM pg_class WHERE relname = '{WARM}_p2026010105_aging1'"
    ));
    assert_eq!(
        detached, "1",
        "the detached partition is still there, renamed"
    );
    holder
        .batch_execute(&format!(
            "SELECT pg_advisory_unlock(hashtext('refract.tiers.cold:' || '{WARM}'))"
        ))
        .unwrap();
    let out = pg::wait_guarded(aging, "refract tiers age");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", String::from_utf8_lossy(&out.stdout).trim());

    let runs = assert_runs_over(&db);
    let shapes: Vec<(i64, &str, i64, i64)> =
        runs.iter().map(|r| (r.0, r.1.as_str(), r.3, r.4)).collect();
    assert_eq!(
        shapes,
        [
            (1, "2026-01-01", 48, 2),
            (2, "2026-01-01", 1, 1),
            (3, "2026-01-02", 48, 2)
        ],
        "day 1 aged by run 1, its late hour by run 2"
    );
    let second = db.duckdb(
        "SELECT device_id, epoch_us(ts) FROM {cold} WHERE filename LIKE '%/aged-000000000002.parquet'",
    );
    assert_eq!(second, vec![serde_json::json!([device, ts])]);
    assert_tiers_hold_the_source(&db, clock - WARM_WINDOW, &[device.to_owned()]);
    daemon.terminate();
    let status = daemon.child().wait().unwrap();
    assert!(
        status.success(),
        "the daemon went on after the partition vanished: {status}"
    );
}

#[test]
fn the_daemon_ages_on_its_schedule_and_stops_with_the_run() {
    let db = TierDb::new("aging_daemon");
    let shipped = shipped_pipeline();
    insert_heartbeats(&db, 4, 3600, 2);
    db.catch_up(&shipped, T0 + DAY);
    let text = std::fs::read_to_string(&shipped).unwrap();
    let scheduled = text.replacen(
        "[sinks.tiers]\nkind = \"tiers\"\n",
        "[sinks.tiers]\nkind = \"tiers\"\naging_interval_ms = 1000\n",
        1,
    );
    assert_ne!(scheduled, text);
    let pipeline = db.dir.path().join("scheduled.toml");
    std::fs::write(&pipeline, scheduled).unwrap();

    let log_path = db.dir.path().join("daemon.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let clock = T0 + 32 * DAY;
    let mut daemon = Running::spawn(
        db.refract(clock, None)
            .arg("run")
            .arg(&pipeline)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log),
    );
    wait_until("the daemon's aging pass ended", || {
        std::fs::read_to_string(&log_path).is_ok_and(|l| l.contains("aging pass done"))
    });
    daemon.terminate();
    let status = daemon.child().wait().unwrap();
    assert!(
        status.success(),
        "the run stops with its aging task: {status}"
    );
    let runs = assert_runs_over(&db);
    assert_eq!(runs.len(), 2, "both days aged by the daemon: {runs:?}");
    assert_tiers_hold_the_source(&db, clock - WARM_WINDOW, &["dev-0002".to_owned()]);
}
