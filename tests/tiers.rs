//! The tiers read model end to end: every heartbeat lands in the tiers its age puts it in, once,
//! whatever order, lateness or repetition it arrives in; a fleet replayed over five weeks of
//! event time leaves warm + cold equal to the source and hot equal to its last two hours.

mod common;

use std::collections::{BTreeMap, BTreeSet};

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

#[allow(dead_code)]
fn per_day(rows: &BTreeSet<String>) -> BTreeMap<(String, i64), usize> {
    per_device_day(rows)
}
