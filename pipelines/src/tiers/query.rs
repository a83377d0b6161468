//! The tier queries, printing JSON lines. (Being built: see issue 23.)

use refract_schemas::clock::Clock;
use refract_schemas::config::TierLayout;

/// The latest `count` heartbeats of `device`, newest first.
pub async fn latest(
    _layout: &TierLayout,
    _clock: &Clock,
    _device: &str,
    _count: usize,
) -> Result<(), String> {
    Err("queries are not built yet".into())
}

/// The devices of `region` online in the last `minutes`.
pub async fn online(
    _layout: &TierLayout,
    _clock: &Clock,
    _region: &str,
    _minutes: u64,
) -> Result<(), String> {
    Err("queries are not built yet".into())
}

/// `device`'s heartbeats in `[from, to)` across the tiers.
pub async fn range(
    _layout: &TierLayout,
    _device: &str,
    _from: &str,
    _to: &str,
) -> Result<(), String> {
    Err("queries are not built yet".into())
}
