//! Trims the hot tier to its window: writes trim the sets they touch, but a device that fell
//! silent is touched by no write, and an accelerated pipeline clock outruns the keys' time to
//! live (which runs on the wall clock).
//!
//! For every region set (`SCAN` of `{prefix}:*:online`), each device's set loses its heartbeats
//! at or before `clock - hot` (`ZREMRANGEBYSCORE … -inf cutoff`): a device whose last heartbeat
//! is that old loses them all, which removes its key; then the region set loses those devices
//! the same way. Removing by score, not by name, never removes a heartbeat or a device that a
//! concurrent write made newer meanwhile.

use redis::aio::MultiplexedConnection;
use refract_schemas::config::TierLayout;
use refract_schemas::write::tiers::device_hash;

use super::AgingReport;
use crate::tiers::{TierError, hot};

/// Keys per `SCAN` step.
const SCAN_COUNT: usize = 1_000;
/// Region-set members read per `ZRANGE`: a page of a region with a million devices stays
/// around a megabyte.
const MEMBERS_PER_PAGE: isize = 10_000;
/// Device sets trimmed per pipelined round trip (as the sink's hot writes).
const DEVICES_PER_PIPELINE: usize = 2_000;

/// Trims every device set and region set of the layout's hot tier at clock `clock`.
pub(super) async fn trim(
    layout: &TierLayout,
    clock: i64,
    report: &mut AgingReport,
) -> Result<(), TierError> {
    let client = crate::tiers::hot_client(layout)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| TierError::Hot("cannot connect".into(), e))?;
    let cutoff = clock.saturating_sub(layout.hot_micros);
    for key in region_keys(&mut conn, layout).await? {
        let Some(region) = hot::region_of_key(layout, &key) else {
            continue;
        };
        let devices = members(&mut conn, &key).await?;
        for chunk in devices.chunks(DEVICES_PER_PIPELINE) {
            let mut pipe = redis::pipe();
            for (device, _) in chunk {
                pipe.cmd("ZREMRANGEBYSCORE")
                    .arg(hot::device_key(
                        layout,
                        region,
                        &device_hash(device),
                        device,
                    ))
                    .arg("-inf")
                    .arg(cutoff);
            }
            let removed: Vec<i64> = pipe
                .query_async(&mut conn)
                .await
                .map_err(|e| TierError::Hot("cannot trim device sets".into(), e))?;
            for ((_, last), removed) in chunk.iter().zip(removed) {
                if *last <= cutoff as f64 {
                    report.hot_deleted += 1;
                } else if removed > 0 {
                    report.hot_trimmed += 1;
                }
            }
        }
        redis::cmd("ZREMRANGEBYSCORE")
            .arg(&key)
            .arg("-inf")
            .arg(cutoff)
            .query_async::<i64>(&mut conn)
            .await
            .map_err(|e| TierError::Hot(format!("cannot trim `{key}`"), e))?;
    }
    Ok(())
}

/// The keys of every region set.
async fn region_keys(
    conn: &mut MultiplexedConnection,
    layout: &TierLayout,
) -> Result<Vec<String>, TierError> {
    let pattern = hot::region_pattern(layout);
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(conn)
            .await
            .map_err(|e| TierError::Hot("cannot list the region sets".into(), e))?;
        keys.extend(found);
        if next == 0 {
            keys.sort();
            keys.dedup();
            return Ok(keys);
        }
        cursor = next;
    }
}

/// A region set's devices with their last heartbeat's time, read page by page (a device that
/// moves meanwhile may be read twice or not at all: the next pass or its own writes trim it).
async fn members(
    conn: &mut MultiplexedConnection,
    key: &str,
) -> Result<Vec<(String, f64)>, TierError> {
    let mut out = Vec::new();
    let mut start: isize = 0;
    loop {
        let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(key)
            .arg(start)
            .arg(start + MEMBERS_PER_PAGE - 1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await
            .map_err(|e| TierError::Hot(format!("cannot read `{key}`"), e))?;
        let full = page.len() as isize == MEMBERS_PER_PAGE;
        out.extend(page);
        if !full {
            return Ok(out);
        }
        start += MEMBERS_PER_PAGE;
    }
}
