//! The tiers under outages: Redis killed for a while and the warm tier's PostgreSQL restarted
//! while heartbeats stream in. The batch that fails is retried whole (every tier write is
//! idempotent), so afterwards each tier holds exactly what the events say.
//!
//! Both servers belong to the test (a `redis-server` and a PostgreSQL cluster of its own), so
//! the faults touch nothing else.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::time::{Duration, Instant};

use common::cache::RedisServer;
use common::tiers::{
    Beat, Env, PrivatePostgres, cold_rows, envelope, file_pipeline, hot_rows, model, psql_at,
    rfc3339, warm_rows_at,
};
use common::{Rng, Running};

/// 2026-02-05T00:00:00Z: the pipeline's clock, fixed.
const CLOCK: i64 = 1_770_249_600_000_000;
/// How long Redis stays down.
const REDIS_OUTAGE: Duration = Duration::from_secs(3);

/// `n` heartbeats of `devices` devices at random ages up to 40 days (every tier), each
/// `(device, ts)` once.
fn fleet(n: usize, devices: u64, seed: u64) -> Vec<(&'static str, Beat)> {
    let mut rng = Rng::new(seed);
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let device = rng.below(devices);
        let age = (rng.below(40 * 86_400) as i64) * 1_000_000;
        if !seen.insert((device, age)) {
            continue;
        }
        out.push((
            "c",
            Beat {
                device: format!("dev-{device:05}"),
                region: ["EU", "CN_SHANGHAI", "US_EAST"][(device % 3) as usize].into(),
                ts: CLOCK - age,
                battery: Some((rng.below(1000) as f32) / 1000.0),
                signal: -(rng.below(100) as i32),
            },
        ));
    }
    out
}

/// Appends events to the log the daemon follows.
fn append(log: &std::path::Path, events: &[(&str, Beat)]) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    for (_, beat) in events {
        writeln!(file, "{}", envelope("c", None, Some(beat))).unwrap();
    }
    file.sync_all().unwrap();
}

/// The warm tier's row count, `None` while PostgreSQL does not answer.
fn warm_count(url: &str) -> Option<usize> {
    psql_at(url, "SELECT count(*) FROM heartbeats_warm")
        .ok()
        .and_then(|s| s.parse().ok())
}

/// Waits until the warm tier holds `want` rows.
fn wait_for_warm(url: &str, want: usize, what: &str) {
    let deadline = Instant::now() + common::pg::hang_guard();
    while warm_count(url) != Some(want) {
        assert!(
            Instant::now() < deadline,
            "{what}: the warm tier holds {:?} rows, not {want}",
            warm_count(url)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn redis_down_and_postgres_restarted_during_ingest_lose_nothing() {
    let n = if common::in_ci() { 6_000 } else { 30_000 };
    let events = fleet(n, 500, 23);
    let [hot, warm, cold] = model(&events, CLOCK);
    let mut redis = RedisServer::start(true);
    let pg = PrivatePostgres::start();
    let dir = tempfile::tempdir().unwrap();
    let env = Env::at(&pg.url(), "tiers_outage", dir.path(), &redis.url());
    let log = dir.path().join("heartbeats.jsonl");
    let pipeline = file_pipeline(dir.path(), &log, 500, true);
    let thirds: Vec<&[(&str, Beat)]> = events.chunks(n.div_ceil(3)).collect();
    append(&log, thirds[0]);
    let mut daemon = Running::spawn(
        env.refract(&rfc3339(CLOCK))
            .arg("run")
            .arg(&pipeline)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped()),
    );
    let warm_in = |part: &[(&str, Beat)]| model(part, CLOCK)[1].len();
    wait_for_warm(&pg.url(), warm_in(thirds[0]), "before the outages");

    // Redis down while the second third arrives: hot writes fail, batches are retried.
    redis.kill();
    append(&log, thirds[1]);
    std::thread::sleep(REDIS_OUTAGE);
    redis.start_again();
    wait_for_warm(
        &pg.url(),
        warm_in(&events[..thirds[0].len() + thirds[1].len()]),
        "after Redis came back",
    );

    // PostgreSQL restarted while the last third arrives.
    append(&log, thirds[2]);
    pg.restart();
    wait_for_warm(&pg.url(), warm.len(), "after PostgreSQL restarted");

    daemon.terminate();
    let out = daemon.wait_with_output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the daemon drains and exits 0: {stderr}"
    );
    let hot_now: BTreeSet<String> = hot_rows(&redis.url(), &env.prefix)
        .into_values()
        .flatten()
        .collect();
    assert_eq!(hot_now, hot, "hot tier after the outages");
    assert_eq!(warm_rows_at(&pg.url(), &env.warm_table), warm, "warm tier");
    let (cold_now, doubled) = cold_rows(&env.cold_dir());
    assert_eq!(cold_now.len(), cold.len(), "cold tier row count");
    assert_eq!(cold_now, cold, "cold tier");
    assert_eq!(doubled, 0, "a heartbeat is in cold twice");
    assert!(
        stderr.contains("hot tier") && stderr.contains("warm tier"),
        "both outages were seen and retried: {stderr}"
    );
}
