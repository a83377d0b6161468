//! `kind = "tiers"`: heartbeats routed by age into a hot, a warm and a cold tier (seed 003 §4.2).
//!
//! The projection says what a heartbeat is (table, device, time and region columns, the typed
//! measurement columns) and the windows; the sink says where each tier lives. [`TierLayout`]
//! joins the two: the sink, the aging job and the queries all work from it.

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{PipelineFile, ProjectionConfig, SecretUrl, SinkConfig};

/// `kind = "tiers"` projection: each heartbeat of `table` goes to the tiers its age puts it in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TiersProjectionConfig {
    /// The heartbeat table (`table` or `schema.table`), or the topic's table.
    pub table: String,
    /// The device column (text): the key of the hot tier and the first key column of the warm
    /// tier.
    #[serde(default = "default_device")]
    pub device: String,
    /// The event-time column (`timestamptz`, an RFC 3339 string, or microseconds since the
    /// epoch): what the age of a heartbeat is measured from.
    #[serde(default = "default_time")]
    pub time: String,
    /// The region column (text): with `md5(device)[0..4]` the shard key `{region, device_hash}`.
    #[serde(default = "default_region")]
    pub region: String,
    /// The measurement columns kept in every tier, with their types.
    pub columns: Vec<TierColumn>,
    /// Heartbeats younger than this are also in the hot tier (`2h`; humantime syntax).
    #[serde(default = "default_hot")]
    pub hot: String,
    /// Heartbeats younger than this are in the warm tier; older ones are cold (`30d`).
    #[serde(default = "default_warm")]
    pub warm: String,
    /// The `tiers` sink the heartbeats go to (exactly one).
    pub sinks: Vec<String>,
}

fn default_device() -> String {
    "device_id".into()
}
fn default_time() -> String {
    "ts".into()
}
fn default_region() -> String {
    "region".into()
}
fn default_hot() -> String {
    "2h".into()
}
fn default_warm() -> String {
    "30d".into()
}

/// One measurement column of a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TierColumn {
    /// The column's name in the source row (and in every tier).
    pub name: String,
    /// Its type in the warm table and in the cold Parquet files.
    #[serde(rename = "type")]
    pub kind: TierColumnType,
}

/// The types a measurement column may have: what PostgreSQL and Parquet both hold exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TierColumnType {
    /// `text` / UTF-8 string.
    Text,
    /// `integer` / INT32.
    Int,
    /// `bigint` / INT64.
    Bigint,
    /// `real` / FLOAT.
    Real,
    /// `double precision` / DOUBLE.
    Double,
    /// `boolean` / BOOLEAN.
    Boolean,
}

impl TierColumnType {
    /// The PostgreSQL type of the warm table's column.
    pub fn sql(self) -> &'static str {
        match self {
            TierColumnType::Text => "text",
            TierColumnType::Int => "integer",
            TierColumnType::Bigint => "bigint",
            TierColumnType::Real => "real",
            TierColumnType::Double => "double precision",
            TierColumnType::Boolean => "boolean",
        }
    }
}

/// `kind = "tiers"` sink: where the hot, warm and cold tiers live.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TiersSinkConfig {
    /// The hot tier (Redis).
    pub hot: HotTierConfig,
    /// The warm tier (PostgreSQL, hourly partitions).
    pub warm: WarmTierConfig,
    /// The cold tier (Parquet on object storage).
    pub cold: ColdTierConfig,
    /// How often a running pipeline ages the tiers (exports warm partitions past the window to
    /// cold, trims the hot tier), in milliseconds; 0 never (then `refract tiers age` does it).
    #[serde(default = "default_aging_interval_ms")]
    pub aging_interval_ms: u64,
}

/// Default aging interval: a partition is an hour, so a few minutes of delay past the window
/// costs nothing, and each pass has little to do.
pub const DEFAULT_AGING_INTERVAL_MS: u64 = 5 * 60 * 1000;

fn default_aging_interval_ms() -> u64 {
    DEFAULT_AGING_INTERVAL_MS
}

/// The hot tier: per device a sorted set `{prefix}:{region}:{device_hash}:{device}` scored by
/// event time (microseconds), per region a sorted set `{prefix}:{region}:online` of devices
/// scored by their last heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HotTierConfig {
    /// `redis://host:port/db` (`${REDIS_URL:-redis://127.0.0.1:6379}` in shipped files).
    pub url: SecretUrl,
    /// First part of every key.
    #[serde(default = "default_hot_prefix")]
    pub key_prefix: String,
}

fn default_hot_prefix() -> String {
    "hb".into()
}

/// The warm tier: a table range-partitioned by the hour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WarmTierConfig {
    /// `postgres://…` (`${TARGET_PG_URL:-…}` in shipped files).
    pub url: SecretUrl,
    /// The partitioned table (`schema.table` or `table`); created when missing, with its
    /// partitions named `{table}_pYYYYMMDDHH`.
    #[serde(default = "default_warm_table")]
    pub table: String,
    /// Hourly partitions created ahead of the pipeline's clock, 1 to 168.
    #[serde(default = "default_partitions_ahead")]
    pub partitions_ahead: u32,
}

fn default_warm_table() -> String {
    "heartbeats_warm".into()
}

/// Default partitions made ahead: two hours, so a writer never waits for DDL on the hour.
pub const DEFAULT_PARTITIONS_AHEAD: u32 = 2;

fn default_partitions_ahead() -> u32 {
    DEFAULT_PARTITIONS_AHEAD
}

/// The cold tier: zstd Parquet at `{url}/device_id={device}/date={yyyyMMdd}/….parquet`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ColdTierConfig {
    /// Object-store URL (`file:///abs/dir`, `s3://bucket/prefix`, …).
    pub url: SecretUrl,
}

/// A duration in the pipeline file's syntax (`90s`, `15m`, `2h`, `30d`).
pub fn parse_window(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| format!("`{text}` is not a duration: {e}"))
}

/// One tiers projection and its sink, resolved: what the sink, the aging job and the queries
/// work from.
#[derive(Debug, Clone, PartialEq)]
pub struct TierLayout {
    /// The projection's name.
    pub projection: String,
    /// The sink's name.
    pub sink: String,
    /// The projection's settings.
    pub heartbeats: TiersProjectionConfig,
    /// The sink's settings.
    pub stores: TiersSinkConfig,
    /// The hot window, in microseconds.
    pub hot_micros: i64,
    /// The warm window, in microseconds.
    pub warm_micros: i64,
}

impl PipelineFile {
    /// The tier layout of the tiers sink `sink` (the tiers projection that writes to it), `None`
    /// when `sink` is no tiers sink or no valid tiers projection writes to it.
    pub fn tier_layout(&self, sink: &str) -> Option<TierLayout> {
        let SinkConfig::Tiers(stores) = self.sinks.get(sink)? else {
            return None;
        };
        self.projections.iter().find_map(|(name, p)| match p {
            ProjectionConfig::Tiers(t) if t.sinks.iter().any(|s| s == sink) => Some(TierLayout {
                projection: name.clone(),
                sink: sink.to_owned(),
                heartbeats: t.clone(),
                stores: stores.clone(),
                hot_micros: window_micros(&t.hot)?,
                warm_micros: window_micros(&t.warm)?,
            }),
            _ => None,
        })
    }

    /// Every tier layout of the file, in sink name order.
    pub fn tier_layouts(&self) -> Vec<TierLayout> {
        self.sinks
            .keys()
            .filter_map(|s| self.tier_layout(s))
            .collect()
    }
}

/// A window in microseconds, `None` when it does not parse (or does not fit).
pub fn window_micros(text: &str) -> Option<i64> {
    parse_window(text)
        .ok()
        .and_then(|d| i64::try_from(d.as_micros()).ok())
}
