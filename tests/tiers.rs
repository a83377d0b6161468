//! The tiers read model end to end: every heartbeat lands in the tiers its age puts it in, once,
//! whatever order, lateness or repetition it arrives in; a fleet replayed over five weeks of
//! event time leaves warm + cold equal to the source and hot equal to its last two hours.

mod common;

use std::collections::BTreeSet;

use common::Rng;
use common::tiers::{
    Beat, DAY, Env, HOT, HOUR, TierDb, WARM, cold_rows, envelope, file_pipeline, model,
    per_device_day, rfc3339,
};

/// The clock of the arrivals test: 2026-02-05T00:00:00Z.
const CLOCK: i64 = 1_770_249_600_000_000;

#[test]
fn late_out_of_order_and_duplicate_heartbeats_land_in_their_tier_once() {
    let db = TierDb::create("tiers_arrivals");
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(&db, dir.path(), "redis://127.0.0.1:6379");
    let beat = |device: &str, region: &str, ago: i64, battery: f32| Beat {
        device: device.into(),
        region: region.into(),
        ts: CLOCK - ago,
        battery: Some(battery),
        signal: -70,
    };
    let minute = 60_000_000;
    let now_ish = beat("d1", "EU", 10 * minute, 0.5);
    let late = beat("d1", "EU", 40 * DAY, 0.1);
    let events = vec![
        ("c", now_ish.clone()),
        // Out of order: older heartbeats after a newer one, in every tier.
        ("c", beat("d1", "EU", HOUR, 0.25)),
        ("c", beat("d1", "EU", 5 * HOUR, 0.75)),
        ("c", late.clone()),
        // Duplicates: the same heartbeat again, and again with a corrected value (last wins).
        ("c", now_ish.clone()),
        ("c", late.clone()),
        ("u", beat("d1", "EU", 5 * HOUR, 0.3)),
        ("u", beat("d1", "EU", HOUR, 0.35)),
        ("c", beat("d1", "EU", 40 * DAY - 1_000_000, 0.2)),
        ("c", beat("d1", "EU", 45 * DAY, 0.9)),
        // Exactly on the boundaries: 2 h old is warm only, 30 days old is cold.
        ("c", beat("d2", "CN_SHANGHAI", HOT, 0.6)),
        ("c", beat("d2", "CN_SHANGHAI", WARM, 0.6)),
        ("c", beat("d2", "CN_SHANGHAI", 20 * DAY, 0.4)),
        ("c", beat("d2", "CN_SHANGHAI", minute, 0.4)),
        ("d", beat("d2", "CN_SHANGHAI", 20 * DAY, 0.4)),
        // From a device whose clock runs ahead: counts as now.
        ("c", beat("d3", "EU", -minute, 1.0)),
    ];
    let log = dir.path().join("heartbeats.jsonl");
    let lines: Vec<String> = events
        .iter()
        .map(|(op, b)| match *op {
            "d" => envelope("d", Some(b), None),
            "u" => envelope("u", Some(b), Some(b)),
            op => envelope(op, None, Some(b)),
        })
        .collect();
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();
    // Batches of two events: what arrives in different batches must merge across them.
    let pipeline = file_pipeline(dir.path(), &log, 2, false);
    let [hot, warm, cold] = model(&events, CLOCK);
    // Twice: the second run, with its state gone, replays every event (at-least-once).
    for run in ["first run", "replay"] {
        let out = common::output(env.refract(&rfc3339(CLOCK)).args(["run"]).arg(&pipeline));
        assert!(
            out.status.success(),
            "{run}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::remove_dir_all(dir.path().join("state")).unwrap();
        let hot_now: BTreeSet<String> = env.hot_rows().into_values().flatten().collect();
        assert_eq!(hot_now, hot, "{run}: hot tier");
        assert_eq!(db.warm_rows(&env.warm_table), warm, "{run}: warm tier");
        let (cold_now, doubled) = cold_rows(&env.cold_dir());
        assert_eq!(cold_now, cold, "{run}: cold tier");
        assert_eq!(doubled, 0, "{run}: a heartbeat is in cold twice");
    }
    clear_hot(&env);
}

/// A replay of heartbeats the warm tier already holds (what a kill before the checkpoint leaves:
/// the state is gone, the stores are not) makes the sink's binary COPY meet stored rows: that
/// attempt is rolled back, the batch is upserted instead, and later batches of new rows are
/// copied again. Batches mix stored and new rows, and some stored rows come back changed:
/// afterwards every tier holds exactly what the events say, each row once.
#[test]
fn a_replay_of_stored_heartbeats_falls_back_from_copy_to_the_upsert() {
    let db = TierDb::create("tiers_replay");
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(&db, dir.path(), "redis://127.0.0.1:6379");
    clear_hot(&env);
    let mut rng = Rng::new(7);
    let mut seen = BTreeSet::new();
    let mut events: Vec<(&str, Beat)> = Vec::new();
    while events.len() < 3_000 {
        let device = rng.below(300);
        // Every tier: ages up to 32 days.
        let ts = CLOCK - (rng.below(32 * 86_400) as i64) * 1_000_000;
        if seen.insert((device, ts)) {
            events.push((
                "c",
                Beat {
                    device: format!("dev-{device:05}"),
                    region: ["EU", "US_EAST"][(device % 2) as usize].into(),
                    ts,
                    battery: Some(rng.below(1_000) as f32 / 1_000.0),
                    signal: -(rng.below(100) as i32),
                },
            ));
        }
    }
    // The first run sees every 7th heartbeat of the first half; the replay sees them all, and
    // then a changed value for some of those the first run stored.
    let first: Vec<(&str, Beat)> = events[..1_500].iter().step_by(7).cloned().collect();
    let changed: Vec<(&str, Beat)> = first
        .iter()
        .step_by(5)
        .map(|(_, b)| {
            let mut b = b.clone();
            b.battery = Some(2.5);
            ("u", b)
        })
        .collect();
    events.extend(changed);
    let write_log = |events: &[(&str, Beat)]| {
        let log = dir.path().join("heartbeats.jsonl");
        let lines: Vec<String> = events
            .iter()
            .map(|(op, b)| match *op {
                "u" => envelope("u", Some(b), Some(b)),
                op => envelope(op, None, Some(b)),
            })
            .collect();
        std::fs::write(&log, lines.join("\n") + "\n").unwrap();
        file_pipeline(dir.path(), &log, 100, false)
    };
    let mut logs = Vec::new();
    for (run, part) in [("first run", &first), ("replay", &events)] {
        let pipeline = write_log(part);
        let out = common::output(
            env.refract(&rfc3339(CLOCK))
                .env("RUST_LOG", "warn,refract_connectors::sinks::tiers=debug")
                .args(["run"])
                .arg(&pipeline),
        );
        let stderr = without_colours(&String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{run}: {stderr}");
        std::fs::remove_dir_all(dir.path().join("state")).unwrap();
        logs.push(stderr);
    }
    assert!(
        !logs[0].contains("warm=FellBack") && logs[0].contains("warm=Copied"),
        "the first run copies into an empty table: {}",
        logs[0]
    );
    assert!(
        logs[1].contains("warm=FellBack") && logs[1].contains("warm=Copied"),
        "the replay falls back to the upsert, then copies new rows again: {}",
        logs[1]
    );
    let [hot, warm, cold] = model(&events, CLOCK);
    assert_eq!(db.warm_rows(&env.warm_table), warm, "warm tier");
    let stored: usize = db
        .psql(&format!("SELECT count(*) FROM {}", env.warm_table))
        .trim()
        .parse()
        .unwrap();
    assert_eq!(stored, warm.len(), "warm rows, each once");
    let hot_now: BTreeSet<String> = env.hot_rows().into_values().flatten().collect();
    assert_eq!(hot_now, hot, "hot tier");
    let (cold_now, doubled) = cold_rows(&env.cold_dir());
    assert_eq!(cold_now, cold, "cold tier");
    assert_eq!(doubled, 0, "a heartbeat is in cold twice");
    clear_hot(&env);
}

/// `log` without its terminal colour codes (`ESC [ … m`).
fn without_colours(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// Removes the test's keys from the shared Redis.
fn clear_hot(env: &Env) {
    let mut conn = redis::Client::open(env.redis_url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", env.prefix))
        .query(&mut conn)
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL").arg(keys).query(&mut conn).unwrap();
    }
}

/// The start of the replayed history: 2026-01-01T00:00:00Z.
const HISTORY_START: i64 = 1_767_225_600_000_000;

/// Inserts every device's heartbeats of `[from, to)` into the source (one per `interval`
/// seconds, each device at its own offset within the interval).
fn insert_history(db: &TierDb, devices: u32, from: i64, to: i64, interval: u32) {
    db.psql(&format!(
        "INSERT INTO device_heartbeats
         SELECT 'dev-' || lpad(d::text, 5, '0'),
                t + make_interval(secs => (d * 37) % {interval}),
                (ARRAY['EU', 'CN_SHANGHAI', 'US_EAST'])[1 + d % 3],
                round((random() * 100)::numeric) / 100,
                -(d % 100),
                52 + d / 1000.0,
                13 + d / 1000.0
         FROM generate_series(0, {devices} - 1) d,
              generate_series(timestamptz '{from}', timestamptz '{to}' - interval '1 microsecond',
                              make_interval(secs => {interval})) t",
        from = rfc3339(from),
        to = rfc3339(to),
    ));
}

/// A fleet replayed over 36 days of event time, three days at a time, on a clock that jumps to
/// the end of each step: each step's heartbeats go hot and warm as they arrive, and each
/// aging pass moves the days past 30 days to cold. Late heartbeats (older than 30 days on
/// arrival) and repeated ones (updates in place) come in the last steps. Afterwards warm + cold
/// hold exactly the source's rows, each once, and hot exactly its last two hours.
#[test]
fn a_fleet_replayed_over_five_weeks_fills_every_tier_exactly() {
    let (devices, interval) = if common::in_ci() {
        (100, 7_200)
    } else {
        (1_000, 3_600)
    };
    let db = TierDb::create("tiers_fleet");
    let dir = tempfile::tempdir().unwrap();
    let env = Env::new(&db, dir.path(), "redis://127.0.0.1:6379");
    clear_hot(&env);
    let step = 3 * DAY;
    let end = HISTORY_START + 36 * DAY;
    let mut clock = HISTORY_START;
    while clock < end {
        insert_history(&db, devices, clock, clock + step, interval);
        clock += step;
        if clock == end {
            // Late: heartbeats of the first days, already older than 30 days, arriving now; and
            // repeats of heartbeats in every tier (an update that changes nothing).
            insert_history(
                &db,
                devices / 10,
                HISTORY_START + DAY / 2 + 1,
                HISTORY_START + DAY,
                1_800,
            );
            db.psql(&format!(
                "UPDATE device_heartbeats SET battery = battery WHERE device_id LIKE '%7' \
                 AND ts >= timestamptz '{}'",
                rfc3339(HISTORY_START + DAY)
            ));
        }
        let at = rfc3339(clock);
        let run = common::output(
            env.refract(&at)
                .args(["run", "--until-caught-up"])
                .arg(Env::pipeline_path()),
        );
        assert!(
            run.status.success(),
            "run at {at}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let age = common::output(
            env.refract(&at)
                .args(["tiers"])
                .arg(Env::pipeline_path())
                .arg("age"),
        );
        assert!(
            age.status.success(),
            "aging at {at}: {}",
            String::from_utf8_lossy(&age.stderr)
        );
    }

    let source = db.source_rows();
    let warm = db.warm_rows(&env.warm_table);
    let (cold, doubled) = cold_rows(&env.cold_dir());
    assert_eq!(doubled, 0, "heartbeats in cold twice");
    let both: Vec<&String> = warm.intersection(&cold).take(5).collect();
    assert!(both.is_empty(), "heartbeats in warm and in cold: {both:?}");
    assert!(!cold.is_empty() && !warm.is_empty(), "both tiers are used");
    let held: BTreeSet<String> = warm.union(&cold).cloned().collect();
    assert_eq!(
        per_device_day(&held),
        per_device_day(&source),
        "warm + cold per device and day"
    );
    assert_eq!(held.len(), source.len(), "warm + cold rows");
    assert!(held == source, "warm + cold hold exactly the source's rows");
    let window_start = end - WARM;
    let old_warm = warm
        .iter()
        .filter(|r| r.split('|').nth(1).unwrap().parse::<i64>().unwrap() < window_start)
        .count();
    assert_eq!(
        old_warm, 0,
        "warm rows older than the window (every day before it was aged)"
    );
    let hot: BTreeSet<String> = source
        .iter()
        .filter(|r| r.split('|').nth(1).unwrap().parse::<i64>().unwrap() > end - HOT)
        .cloned()
        .collect();
    let hot_now: BTreeSet<String> = env.hot_rows().into_values().flatten().collect();
    assert_eq!(hot_now, hot, "hot holds exactly the last two hours");
    clear_hot(&env);
}
