//! The stale-set race of cache-aside, measured: a reader misses, reads the row from PostgreSQL,
//! the row changes and refract invalidates the key, and only then the reader caches what it
//! read. 10,000 such interleavings per strategy, through the real pipeline (PostgreSQL ->
//! `cache_invalidation` -> Redis):
//! - no guard (`UNLINK` once): the stale value stays until its TTL;
//! - a second delete `second_delete_ms` later: catches readers slower than that no more;
//! - tombstones plus the versioned SET of `deploy/redis/versioned-set.lua`: refused.
//!
//! Readers are modelled as setting their value a random time after refract's first delete of
//! their key (its time taken from Redis' MONITOR): 90% within 50 ms, 9% within 50-400 ms, 1%
//! within 400-1,500 ms (a GC pause, a slow network).
//!
//! The races run against one `redis-server` and against a three-master Redis Cluster.

mod common;

use std::time::{Duration, Instant};

use common::cache::*;
use common::pg::{Cleanup, catch_up};
use common::{Rng, Running, in_ci, refract};

/// The application's versioned fill (the recipe `docs/sinks/redis.md` documents under "Stale sets").
const VERSIONED_SET: &str = include_str!("../deploy/redis/versioned-set.lua");
/// Keys per wave: one multi-row UPDATE, one wait for the slot, then the readers' sets.
const WAVE: i64 = 1_000;
/// The delay of the second delete under test.
const SECOND_DELETE_MS: u64 = 500;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Guard {
    None,
    SecondDelete,
    VersionedSet,
}

/// A reader's delay after the first delete.
fn reader_delay(rng: &mut Rng) -> Duration {
    let ms = match rng.below(100) {
        0 => 400 + rng.below(1_100),
        1..=9 => 50 + rng.below(350),
        _ => rng.below(50),
    };
    Duration::from_millis(ms)
}

/// Runs `interleavings` races with `guard` on the products of `t`; returns (stale keys left,
/// fresh fills refused).
fn race(flavor: Flavor, t: &str, guard: Guard, interleavings: i64) -> (usize, usize) {
    let name = format!("{t}_{guard:?}").to_lowercase();
    let _cleanup = Cleanup::new(&name, &[]);
    let redis = TestRedis::start(flavor, false);
    let mut cache = redis.connection();
    let dir = tempfile::tempdir().unwrap();
    let (sink_extra, table_extra) = match guard {
        Guard::None => (String::new(), ""),
        Guard::SecondDelete => (format!("second_delete_ms = {SECOND_DELETE_MS}"), ""),
        Guard::VersionedSet => (
            "command = \"tombstone\"\ntombstone_ttl_ms = 60000".to_owned(),
            "version_column = \"updated_at\"",
        ),
    };
    let sink_extra = redis.sink_extra(&sink_extra);
    let pipeline = cache_pipeline(dir.path(), t, &redis.url(), &sink_extra, table_extra);
    // Each guard has its own pipeline (slot) over the shared table.
    let text = std::fs::read_to_string(&pipeline).unwrap().replacen(
        &format!("name = \"{t}\""),
        &format!("name = \"{name}\""),
        1,
    );
    std::fs::write(&pipeline, text).unwrap();
    catch_up(&pipeline);
    let _daemon = Running::spawn(
        refract()
            .arg("run")
            .arg(&pipeline)
            .stderr(std::process::Stdio::null()),
    );
    let monitor = Monitor::start(&redis);
    let script = redis::Script::new(VERSIONED_SET);
    let mut pg = pg_client();
    let mut rng = Rng::new(99);
    let (mut stale, mut refused) = (0usize, 0usize);
    for first in (1..=interleavings).step_by(WAVE as usize) {
        let last = (first + WAVE - 1).min(interleavings);
        // 1. Every reader misses and reads the row (value and version) from PostgreSQL.
        let rows = pg
            .query(
                &format!(
                    "SELECT id, price_cents, (extract(epoch FROM updated_at) * 1000000)::bigint
                     FROM {t} WHERE id BETWEEN $1 AND $2 ORDER BY id"
                ),
                &[&first, &last],
            )
            .unwrap();
        for row in &rows {
            let key = format!("{t}:{}", row.get::<_, i64>(0));
            let v: Option<String> = redis::cmd("GET").arg(&key).query(&mut *cache).unwrap();
            assert_eq!(v, None, "{key} starts as a miss");
        }
        // 2. The writer changes the rows and commits.
        let mark = monitor.seen.lock().unwrap().len();
        pg.execute(
            &format!(
                "UPDATE {t} SET price_cents = price_cents + 1, updated_at = clock_timestamp()
                 WHERE id BETWEEN $1 AND $2"
            ),
            &[&first, &last],
        )
        .unwrap();
        // 3. refract deletes the keys (or writes tombstones): when, Redis' MONITOR says.
        let deleted = deletes(&monitor, &mark, &rows, t);
        // 4. Each reader caches the old row it read, some time after the delete of its key.
        let mut sets: Vec<(f64, String, i64, i64)> = rows
            .iter()
            .map(|r| {
                let key = format!("{t}:{}", r.get::<_, i64>(0));
                let due = deleted[&key] + reader_delay(&mut rng).as_secs_f64();
                (due, key, r.get::<_, i64>(1), r.get::<_, i64>(2))
            })
            .collect();
        sets.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (due, key, price, version) in &sets {
            let wait = due - now();
            if wait > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(wait));
            }
            let value = format!("price={price}");
            match guard {
                Guard::VersionedSet => {
                    let _: i64 = script
                        .key(key)
                        .arg(*version)
                        .arg(&value)
                        .arg(300_000)
                        .invoke(&mut *cache)
                        .unwrap();
                }
                _ => redis::cmd("SET")
                    .arg(key)
                    .arg(&value)
                    .arg("PX")
                    .arg(300_000)
                    .exec(&mut *cache)
                    .unwrap(),
            }
        }
        // 5. After the second delete had its chance, count what is left of the old rows.
        std::thread::sleep(Duration::from_millis(SECOND_DELETE_MS + 300));
        for (_, key, price, _) in &sets {
            let v: Option<String> = redis::cmd("GET").arg(key).query(&mut *cache).unwrap();
            if v.is_some_and(|v| v.ends_with(&format!("price={price}"))) {
                stale += 1;
            }
        }
        // 6. A fresh reader (new row, new version) can still fill the cache.
        if guard == Guard::VersionedSet {
            let fresh = pg
                .query(
                    &format!(
                        "SELECT id, price_cents, (extract(epoch FROM updated_at) * 1000000)::bigint
                         FROM {t} WHERE id BETWEEN $1 AND $2 ORDER BY id LIMIT 20"
                    ),
                    &[&first, &last],
                )
                .unwrap();
            for r in fresh {
                let ok: i64 = script
                    .key(format!("{t}:{}", r.get::<_, i64>(0)))
                    .arg(r.get::<_, i64>(2))
                    .arg(format!("price={}", r.get::<_, i64>(1)))
                    .arg(300_000)
                    .invoke(&mut *cache)
                    .unwrap();
                refused += usize::from(ok == 0);
            }
        }
    }
    (stale, refused)
}

/// When refract first deleted (or tombstoned) each key of `rows`, in Redis' clock, from the
/// commands MONITOR saw after index `mark`; waits until every key has been.
fn deletes(
    monitor: &Monitor,
    mark: &usize,
    rows: &[postgres::Row],
    t: &str,
) -> std::collections::HashMap<String, f64> {
    let wanted: std::collections::HashSet<String> = rows
        .iter()
        .map(|r| format!("{t}:{}", r.get::<_, i64>(0)))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut found = std::collections::HashMap::new();
        for s in monitor.seen.lock().unwrap()[*mark..].iter() {
            let by_refract = s.args.first().is_some_and(|c| {
                c.eq_ignore_ascii_case("UNLINK") || c.eq_ignore_ascii_case("EVAL")
            });
            if !by_refract {
                continue;
            }
            for a in &s.args[1..] {
                if wanted.contains(a) {
                    found.entry(a.clone()).or_insert(s.at);
                }
            }
        }
        if found.len() == wanted.len() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "refract deleted {} of {} keys within 60 s",
            found.len(),
            wanted.len()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn stale_sets_left_by_each_guard() {
    stale_sets(Flavor::Single);
}

#[test]
fn on_a_cluster_stale_sets_left_by_each_guard() {
    stale_sets(Flavor::Cluster);
}

fn stale_sets(flavor: Flavor) {
    let t = &flavor.name("cache_race");
    // The must-show size is 10,000 interleavings; CI runs the same three races on 3,000.
    let interleavings: i64 = if in_ci() { 3_000 } else { 10_000 };
    let _cleanup = Cleanup::new(t, &[t]);
    fresh_products(t, interleavings as u32);
    let mut results = Vec::new();
    for guard in [Guard::None, Guard::SecondDelete, Guard::VersionedSet] {
        let (stale, refused) = race(flavor, t, guard, interleavings);
        results.push((guard, stale, refused));
    }
    for (guard, stale, refused) in &results {
        println!(
            "race ({flavor:?}): {interleavings} reader-miss / writer-update / reader-set interleavings, guard \
             {guard:?}: {stale} stale keys left ({:.2}%){}",
            *stale as f64 * 100.0 / interleavings as f64,
            if *guard == Guard::VersionedSet {
                format!(", {refused} fresh fills refused")
            } else {
                String::new()
            }
        );
    }
    let [(_, none, _), (_, second, _), (_, versioned, refused)] = results[..] else {
        unreachable!()
    };
    assert!(
        none as i64 >= interleavings * 95 / 100,
        "without a guard nearly every late set leaves a stale value: {none}"
    );
    assert!(
        second * 10 < none,
        "the second delete removes the sets that came within {SECOND_DELETE_MS} ms: {second} of {none}"
    );
    assert_eq!(versioned, 0, "tombstones refuse every older value");
    assert_eq!(refused, 0, "tombstones let a fresh value in");
}
