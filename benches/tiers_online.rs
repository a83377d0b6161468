//! Latency of the online-devices query (benches/tiers_ingest.sh): `TierReader::online`, the
//! library call `refract tiers … online` makes, called in-process ITERATIONS times (default
//! 20,000) on one reader (its connection kept, as a service answering queries would), next to
//! the same `ZCOUNT` sent raw on a connection of its own, interleaved call by call so both see
//! the same machine load. Regions are the pipeline's region sets (found with `SCAN`), windows
//! cycle over 1, 5, 15, 60 and 120 minutes; both must give the same counts.
//!
//! Prints p50, p99 and the mean of both in microseconds and `query / raw ZCOUNT = ratio`.
//!
//! Usage: tiers-online PIPELINE [ITERATIONS]

use std::time::Instant;

use refract_connectors::tiers::hot;
use refract_connectors::tiers::query::TierReader;

/// Calls of each kind before timing starts (connections made, caches warm).
const WARM_UP: usize = 500;
/// The windows asked for, in minutes.
const WINDOWS: &[u64] = &[1, 5, 15, 60, 120];

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: tiers-online PIPELINE [ITERATIONS]")?;
    let iterations: usize = args
        .next()
        .map(|s| s.parse().map_err(|e| format!("ITERATIONS: {e}")))
        .transpose()?
        .unwrap_or(20_000);
    let loaded = refract::families::load(path.as_ref()).map_err(|e| e.to_string())?;
    let layout = refract::tiers::layout(&loaded, None)?;
    let clock = refract::runtime::pipeline_clock(&loaded.config).now_ms() * 1_000;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut reader = TierReader::new(&layout).map_err(|e| e.to_string())?;
        let client =
            redis::Client::open(layout.stores.hot.url.expose()).map_err(|e| e.to_string())?;
        let mut raw = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        let mut regions: Vec<String> = redis::cmd("KEYS")
            .arg(hot::region_pattern(&layout))
            .query_async::<Vec<String>>(&mut raw)
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .filter_map(|k| hot::region_of_key(&layout, k).map(str::to_owned))
            .collect();
        regions.sort();
        if regions.is_empty() {
            return Err("no region set in the hot tier: run the ingest first".into());
        }
        let (mut query, mut zcount) = (Vec::new(), Vec::new());
        let mut devices = 0;
        for i in 0..WARM_UP + iterations {
            let region = &regions[i % regions.len()];
            let minutes = WINDOWS[(i / regions.len()) % WINDOWS.len()];
            let start = Instant::now();
            let a = reader
                .online(clock, region, minutes)
                .await
                .map_err(|e| e.to_string())?;
            let mid = Instant::now();
            let b: u64 = redis::cmd("ZCOUNT")
                .arg(hot::region_key(&layout, region))
                .arg(format!("({}", clock - minutes as i64 * 60_000_000))
                .arg("+inf")
                .query_async(&mut raw)
                .await
                .map_err(|e| e.to_string())?;
            let end = Instant::now();
            if a != b {
                return Err(format!("{region} {minutes} min: query {a}, raw ZCOUNT {b}"));
            }
            if minutes == 120 {
                devices = devices.max(a);
            }
            if i >= WARM_UP {
                query.push((mid - start).as_secs_f64() * 1e6);
                zcount.push((end - mid).as_secs_f64() * 1e6);
            }
        }
        let (q, z) = (stats(&mut query), stats(&mut zcount));
        println!(
            "online query latency over {iterations} calls ({} regions, up to {devices} devices \
             online in one; windows {WINDOWS:?} min), in-process, one connection each:",
            regions.len()
        );
        println!(
            "  p50: query {:.1} us / raw ZCOUNT {:.1} us = {:.2}x",
            q.0,
            z.0,
            q.0 / z.0
        );
        println!(
            "  p99: query {:.1} us / raw ZCOUNT {:.1} us = {:.2}x",
            q.1,
            z.1,
            q.1 / z.1
        );
        println!(
            "  mean: query {:.1} us / raw ZCOUNT {:.1} us = {:.2}x",
            q.2,
            z.2,
            q.2 / z.2
        );
        Ok(())
    })
}

/// (p50, p99, mean) of `samples`.
fn stats(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    (at(0.5), at(0.99), mean)
}
