//! Tier writes: heartbeats routed by age to the hot, warm or cold tier (a `tiers` projection to
//! a `tiers` sink).

use std::sync::Arc;

use md5::{Digest, Md5};
use serde_json::Value;

use crate::Position;

/// One of the three tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// The last hours, per device, newest first (Redis sorted sets).
    Hot,
    /// The last weeks, in hourly partitions (PostgreSQL).
    Warm,
    /// Everything older, in Parquet files by device and day (object storage).
    Cold,
}

impl Tier {
    /// The tier's name in messages and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Hot => "hot",
            Tier::Warm => "warm",
            Tier::Cold => "cold",
        }
    }
}

/// One heartbeat, its columns checked against the projection's declared types.
#[derive(Clone, Debug, PartialEq)]
pub struct Heartbeat {
    /// The device.
    pub device_id: String,
    /// The device's region.
    pub region: String,
    /// The first four hex digits of `md5(device_id)`: with the region, the shard key.
    pub device_hash: String,
    /// Event time, microseconds since the epoch (UTC).
    pub ts_micros: i64,
    /// The measurement columns, in the projection's `columns` order; each null or of the
    /// column's declared type (a string, an integer, a number or a boolean).
    pub values: Vec<Value>,
}

/// What a tier write does.
#[derive(Clone, Debug, PartialEq)]
pub enum TierAction {
    /// Store the heartbeat (replacing one of the same device and time).
    Put,
    /// Remove the heartbeat of this device and time (its `values` are empty).
    Delete,
}

/// A heartbeat written to (or removed from) one tier.
#[derive(Clone, Debug, PartialEq)]
pub struct TierWrite {
    /// The tier.
    pub tier: Tier,
    /// Store or remove.
    pub action: TierAction,
    /// The heartbeat (shared by the writes of one change to several tiers).
    pub heartbeat: Arc<Heartbeat>,
    /// The pipeline's clock when the change was projected, microseconds since the epoch: the
    /// hot tier trims what is older than its window from it.
    pub clock_micros: i64,
    /// Position of the change that produced it.
    pub position: Position,
}

/// The first four hex digits of `md5(device_id)`: with the region the shard key of a heartbeat,
/// and part of its hot-tier key. The projection computes it when writing; the queries compute
/// it again to find a device's hot set.
pub fn device_hash(device_id: &str) -> String {
    let digest = Md5::digest(device_id.as_bytes());
    format!("{:02x}{:02x}", digest[0], digest[1])
}
