//! The three tier queries (`refract tiers latest | online | range`) against SQL over the source
//! table, after the shipped `pipelines/device-tiers.toml` filled the tiers from the real local
//! PostgreSQL (a database of this test's own) into Redis, PostgreSQL and Parquet files.
//!
//! A few hundred devices beat over 36 days with random gaps (hourly, faster in the last hours;
//! some fall quiet hours before the clock, some more than 31 days before it). The pipeline
//! runs twice on a fixed clock: first at 11:00 over the heartbeats already past the warm
//! window then (straight to cold, as late files) and those of the two hours before 11:00 (hot
//! and warm), then at 12:00 over all the others (warm, hot for the last two hours, cold for
//! the hour that crossed the warm window meanwhile). Then, at 12:00:
//!
//! - `latest -n 10` of 50 random devices equals `ORDER BY ts DESC LIMIT 10` of the source
//!   table, each row tagged with the tier its age puts it in; also with Redis unreachable
//!   (answered from warm and cold, with a warning);
//! - `online` per region for 10 windows equals `count(DISTINCT device_id) WHERE ts > clock -
//!   window` (no heartbeat is in the future of the clock), and a window past the hot one is
//!   refused;
//! - `range` over windows crossing the hot/warm and the warm/cold boundaries, and with bounds
//!   on heartbeat times, equals the source rows in `[from, to)`, one per time.
//!
//! Values are compared exactly (`real` as `f32`).

mod common;
#[path = "tiers_query/support.rs"]
mod support;

use std::collections::BTreeMap;

use common::Rng;
use serde_json::Value;
use support::*;

/// The query clock: 2026-02-05T12:00:00Z.
const CLOCK: i64 = 1_770_292_800_000_000;
const CLOCK_TEXT: &str = "2026-02-05T12:00:00Z";
/// The first run's clock, an hour earlier.
const FIRST_CLOCK: i64 = CLOCK - HOUR;
const FIRST_CLOCK_TEXT: &str = "2026-02-05T11:00:00Z";
const HOT: i64 = 2 * HOUR;
const WARM: i64 = 30 * DAY;

/// A heartbeat as the source table holds it.
#[derive(Debug, Clone, PartialEq)]
struct Expected {
    device: String,
    micros: i64,
    /// `ts` rendered by PostgreSQL: `YYYY-MM-DDTHH:MI:SS.USZ`.
    ts: String,
    region: String,
    battery: Option<f32>,
    signal: Option<i32>,
    lat: Option<f64>,
    lon: Option<f64>,
}

/// The source rows of `device` matching `condition` (on `ts`), in `order`.
fn source_rows(
    pg: &mut postgres::Client,
    device: &str,
    condition: &str,
    order: &str,
) -> Vec<Expected> {
    pg.query(
        &format!(
            "SELECT device_id, (extract(epoch FROM ts) * 1000000)::bigint,
                    to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),
                    region, battery, signal, lat, lon
             FROM device_heartbeats WHERE device_id = $1 AND {condition} {order}"
        ),
        &[&device],
    )
    .unwrap()
    .iter()
    .map(|r| Expected {
        device: r.get(0),
        micros: r.get(1),
        ts: r.get(2),
        region: r.get(3),
        battery: r.get(4),
        signal: r.get(5),
        lat: r.get(6),
        lon: r.get(7),
    })
    .collect()
}

/// The tier a heartbeat is in at the query clock: hot within two hours (when a query reads
/// hot first), cold at 30 days and older, warm between.
fn tier_at_clock(micros: i64, hot_first: bool) -> &'static str {
    if hot_first && micros > CLOCK - HOT {
        "hot"
    } else if micros <= CLOCK - WARM {
        "cold"
    } else {
        "warm"
    }
}

/// Differences between the printed lines and the source rows (empty when equal).
fn compare(what: &str, got: &[String], want: &[Expected], hot_first: bool) -> Vec<String> {
    let mut problems = Vec::new();
    if got.len() != want.len() {
        problems.push(format!(
            "{what}: {} rows, the source has {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (raw, w)) in got.iter().zip(want).enumerate() {
        let g = parse_line(raw);
        let same = text(&g, "device_id").as_deref() == Some(w.device.as_str())
            && text(&g, "ts").as_deref() == Some(w.ts.as_str())
            && text(&g, "region").as_deref() == Some(w.region.as_str())
            && number::<f32>(&g, "battery") == w.battery
            && number::<i32>(&g, "signal") == w.signal
            && number::<f64>(&g, "lat") == w.lat
            && number::<f64>(&g, "lon") == w.lon
            && g.len() == 8;
        if !same {
            problems.push(format!("{what}: row {i} is {raw}, the source has {w:?}"));
        }
        let tier = tier_at_clock(w.micros, hot_first);
        if text(&g, "tier").as_deref() != Some(tier) {
            problems.push(format!(
                "{what}: row {i} ({}) is not tagged {tier}: {raw}",
                w.ts
            ));
        }
    }
    problems
}

/// `micros` as RFC 3339, rendered by PostgreSQL.
fn rfc3339(pg: &mut postgres::Client, micros: i64) -> String {
    pg.query_one(
        "SELECT to_char((timestamptz 'epoch' + $1::bigint * interval '1 microsecond') AT TIME ZONE 'UTC',
                        'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
        &[&micros],
    )
    .unwrap()
    .get(0)
}

/// Fills the tiers in two runs (see the module doc); returns the devices.
fn fill(scratch: &Scratch, dir: &std::path::Path) -> Vec<(String, Habit)> {
    let devices = devices(device_count(), 23);
    let beats = heartbeats(&devices, CLOCK, 2323);
    load_stage(&scratch.name, dir, &beats);
    // First run at 11:00: what is past the warm window then, and the hot hours before 11:00.
    let first = format!(
        "micros < {} OR (micros >= {} AND micros < {FIRST_CLOCK})",
        FIRST_CLOCK - WARM,
        FIRST_CLOCK - HOT
    );
    let n1 = insert_staged(&scratch.name, &first);
    let summary = catch_up(&pipeline_env(scratch, dir, FIRST_CLOCK_TEXT), dir);
    assert_eq!(summary["dead_letters"], 0, "first run: {summary}");
    // Second run at 12:00, streamed: every other heartbeat.
    let n2 = insert_staged(&scratch.name, &format!("NOT ({first})"));
    let summary = catch_up(&pipeline_env(scratch, dir, CLOCK_TEXT), dir);
    assert_eq!(summary["dead_letters"], 0, "second run: {summary}");
    assert_eq!(n1 + n2, beats.len() as u64);
    eprintln!(
        "{} devices, {} heartbeats ({n1} in the first run, {n2} in the second)",
        devices.len(),
        beats.len()
    );
    devices
}

#[test]
fn queries_answer_what_the_source_table_holds() {
    let scratch = Scratch::new("refract_tiers_query");
    let dir = tempfile::tempdir().unwrap();
    let devices = fill(&scratch, dir.path());
    let env = pipeline_env(&scratch, dir.path(), CLOCK_TEXT);
    let mut pg = postgres::Client::connect(&scratch.url(), postgres::NoTls).unwrap();
    let mut rng = Rng::new(7);
    let mut problems = Vec::new();
    problems.extend(check_latest(&env, &mut pg, &devices, &mut rng));
    problems.extend(check_online(&env, &mut pg));
    problems.extend(check_range(&env, &mut pg, &devices, &mut rng));
    assert!(
        problems.is_empty(),
        "{} differences, e.g.:\n{}",
        problems.len(),
        problems[..problems.len().min(12)].join("\n")
    );
}

/// `latest -n 10` of 50 devices, and of five with Redis unreachable.
fn check_latest(
    env: &[(String, String)],
    pg: &mut postgres::Client,
    devices: &[(String, Habit)],
    rng: &mut Rng,
) -> Vec<String> {
    // The archived and quiet ones (up to 20: their answers need cold, or cross the hot
    // window's edge), and random others.
    let mut picked: Vec<&str> = devices
        .iter()
        .filter(|(_, h)| *h != Habit::Regular)
        .map(|(id, _)| id.as_str())
        .take(20)
        .collect();
    while picked.len() < 50 {
        picked.push(&devices[rng.below(devices.len() as u64) as usize].0);
    }
    let mut problems = Vec::new();
    let mut by_tier: BTreeMap<String, usize> = BTreeMap::new();
    for device in &picked {
        let want = source_rows(pg, device, "true", "ORDER BY ts DESC LIMIT 10");
        let (ok, got, stderr) = tiers(env, &["latest", "--device", device, "-n", "10"]);
        assert!(ok, "latest --device {device} failed: {stderr}");
        for w in &want {
            *by_tier
                .entry(tier_at_clock(w.micros, true).to_owned())
                .or_default() += 1;
        }
        problems.extend(compare(&format!("latest {device}"), &got, &want, true));
    }
    eprintln!("latest: 50 devices, expected rows by tier {by_tier:?}");
    assert!(
        ["hot", "warm", "cold"]
            .iter()
            .all(|t| by_tier.contains_key(*t)),
        "the devices picked do not exercise every tier: {by_tier:?}"
    );
    // Redis unreachable: warm and cold answer, with a warning.
    let down: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| match k.as_str() {
            "REDIS_URL" => (k.clone(), "redis://127.0.0.1:1".to_owned()),
            _ => (k.clone(), v.clone()),
        })
        .collect();
    for device in picked.iter().take(5) {
        let want = source_rows(pg, device, "true", "ORDER BY ts DESC LIMIT 10");
        let (ok, got, stderr) = tiers(&down, &["latest", "--device", device, "-n", "10"]);
        assert!(
            ok,
            "latest --device {device} with Redis down failed: {stderr}"
        );
        assert!(
            stderr.contains("warning: hot tier unavailable"),
            "no warning with Redis down: {stderr}"
        );
        problems.extend(compare(
            &format!("latest {device} (Redis down)"),
            &got,
            &want,
            false,
        ));
    }
    problems
}

/// `online` for every region and 10 windows; a window past the hot one is refused.
fn check_online(env: &[(String, String)], pg: &mut postgres::Client) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen = Vec::new();
    for region in REGIONS {
        for minutes in [1i64, 2, 5, 10, 17, 30, 45, 60, 90, 120] {
            let want: i64 = pg
                .query_one(
                    "SELECT count(DISTINCT device_id) FROM device_heartbeats
                     WHERE region = $1 AND ts > timestamptz 'epoch' + $2::bigint * interval '1 microsecond'",
                    &[region, &(CLOCK - minutes * MINUTE)],
                )
                .unwrap()
                .get(0);
            let (ok, got, stderr) = tiers(
                env,
                &[
                    "online",
                    "--region",
                    region,
                    "--minutes",
                    &minutes.to_string(),
                ],
            );
            assert!(
                ok,
                "online --region {region} --minutes {minutes} failed: {stderr}"
            );
            let expected = serde_json::json!({"region": region, "minutes": minutes,
                "online": want, "at": "2026-02-05T12:00:00.000000Z"});
            let got: Vec<Value> = got
                .iter()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if got != [expected.clone()] {
                problems.push(format!(
                    "online {region} {minutes} min: {got:?}, expected {expected}"
                ));
            }
            seen.push(want);
        }
    }
    eprintln!("online: counts {seen:?}");
    assert!(
        seen.iter().collect::<std::collections::BTreeSet<_>>().len() > 10,
        "counts barely vary"
    );
    let (ok, got, stderr) = tiers(env, &["online", "--region", "EU", "--minutes", "121"]);
    assert!(
        !ok && got.is_empty(),
        "a window past the hot one answered: {got:?}"
    );
    assert!(stderr.contains("hot window"), "unclear refusal: {stderr}");
    problems
}

/// `range` over windows that cross the hot/warm and warm/cold boundaries, and bounded by
/// heartbeat times (inclusive `from`, exclusive `to`).
fn check_range(
    env: &[(String, String)],
    pg: &mut postgres::Client,
    devices: &[(String, Habit)],
    rng: &mut Rng,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut windows = 0;
    for _ in 0..12 {
        let device = &devices[rng.below(devices.len() as u64) as usize].0;
        let jitter = |rng: &mut Rng, span: i64| rng.below(span as u64) as i64;
        let mut ranges = vec![
            // Both boundaries: from the cold days to the clock.
            (CLOCK - WARM - DAY - jitter(rng, 5 * DAY), CLOCK + MINUTE),
            // Across warm/cold only.
            (
                CLOCK - WARM - jitter(rng, 6 * HOUR),
                CLOCK - WARM + jitter(rng, 6 * HOUR) + 1,
            ),
            // Across hot/warm only.
            (
                CLOCK - HOT - jitter(rng, 4 * HOUR),
                CLOCK - HOT + jitter(rng, HOUR) + 1,
            ),
            // Everything.
            (CLOCK - SPAN - DAY, CLOCK + DAY),
        ];
        // Bounds on heartbeat times: `from` is one (kept), `to` another (left out).
        let times: Vec<i64> = pg
            .query(
                "SELECT (extract(epoch FROM ts) * 1000000)::bigint FROM device_heartbeats
                 WHERE device_id = $1 ORDER BY ts",
                &[device],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        if times.len() > 2 {
            let a = rng.below(times.len() as u64 - 1) as usize;
            let b = a + 1 + rng.below((times.len() - a - 1) as u64) as usize;
            ranges.push((times[a], times[b]));
        }
        for (from, to) in ranges {
            let (from_text, to_text) = (rfc3339(pg, from), rfc3339(pg, to));
            let want = source_rows(
                pg,
                device,
                &format!(
                    "ts >= timestamptz 'epoch' + {from} * interval '1 microsecond' \
                     AND ts < timestamptz 'epoch' + {to} * interval '1 microsecond'"
                ),
                "ORDER BY ts",
            );
            let (ok, got, stderr) = tiers(
                env,
                &[
                    "range", "--device", device, "--from", &from_text, "--to", &to_text,
                ],
            );
            assert!(
                ok,
                "range {device} [{from_text}, {to_text}) failed: {stderr}"
            );
            problems.extend(compare(
                &format!("range {device} [{from_text}, {to_text})"),
                &got,
                &want,
                false,
            ));
            windows += 1;
        }
    }
    eprintln!("range: {windows} windows of 12 devices");
    problems
}
