//! Pipeline files: the typed configuration, its loading and its validation.
//!
//! A pipeline file is TOML with one `[pipeline]` section, one `[source]`, any number of
//! `[projections.NAME]` and `[sinks.NAME]`. String values may reference the environment with
//! `${VAR}` / `${VAR:-default}` ([`interpolate`]). Loading ([`load`]) reports every error with the
//! file, line and field path; [`PipelineFile::validate`] holds every semantic rule in one place.
//! The JSON Schema in `schemas/pipeline.schema.json` is generated from these types
//! ([`json_schema`]) and checked by a test.
//!
//! Relative paths in a pipeline file are relative to the working directory of the process (like
//! the environment contract's `./state` and `./out`).

pub mod interpolate;
mod kafka;
mod load;
mod migration;
pub mod pg_tls;
mod projections;
mod secret;
mod sinks;
mod tiers;
mod validate;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use sinks::default_unhealthy_after_ms;

pub use kafka::{
    KAFKA_SOURCE_RESERVED, KafkaFormat, KafkaSourceConfig, KafkaStart, SchemaRegistryConfig,
};
pub use load::{
    ConfigError, ConfigErrors, LoadedPipeline, Parsed, load, load_str, parse_file, read_file,
};
pub use migration::{
    ColumnShape, ColumnSpec, DEFAULT_CONTROL_TABLE, DEFAULT_MIGRATION_BATCH_ROWS, MigrationFile,
    MigrationProjectionConfig, MigrationSection, MigrationSinkConfig, TableShape, TransformKind,
    is_migration_text,
};
pub use projections::{
    CacheInvalidationProjectionConfig, CacheTableConfig, DEFAULT_MAX_COLUMNS, DocumentEmbedConfig,
    DocumentFieldConfig, DocumentLinkConfig, DocumentObjectsConfig, DocumentProjectionConfig,
    FlatColumnConfig, FlatColumnType, FlatOnDelete, FlatOutputConfig, FlattenProjectionConfig,
    ProjectionConfig, RelayProjectionConfig, ReplicaProjectionConfig, UnmappedConfig, UnmappedMode,
};
pub use secret::{REDACTED, Secret, SecretUrl};
pub use sinks::{
    DEFAULT_BUFFER_BYTES, DEFAULT_COMPACT_INTERVAL_MS, DEFAULT_KAFKA_DELIVERY_TIMEOUT_MS,
    DEFAULT_REDIS_KEYS_PER_COMMAND, DEFAULT_REDIS_PIPELINE_DEPTH, DEFAULT_ROLL_BYTES,
    DEFAULT_ROLL_MS, DEFAULT_ROLL_ROWS, DEFAULT_ROW_GROUP_ROWS, DEFAULT_ROWS_PER_STATEMENT,
    DEFAULT_TOMBSTONE_RETENTION_MS, DEFAULT_ZSTD_LEVEL, KafkaCompression, KafkaSinkConfig,
    NullSinkConfig, ObjectJsonSinkConfig, POSTGRES_TOMBSTONES_TABLE, ParquetSinkConfig,
    PostgresSinkConfig, RedisDeleteCommand, RedisSinkConfig, SinkConfig,
};
pub use tiers::{
    ColdTierConfig, DEFAULT_AGING_INTERVAL_MS, DEFAULT_PARTITIONS_AHEAD, HotTierConfig, TierColumn,
    TierColumnType, TierLayout, TiersProjectionConfig, TiersSinkConfig, WarmTierConfig,
    parse_window, window_micros,
};
pub use validate::routes::Families;
pub use validate::{is_secret_property, mask_url};

/// Default events per batch: large enough to amortize a sink round trip, small enough that a
/// batch of wide rows stays within a few MiB.
pub const DEFAULT_BATCH_MAX_EVENTS: usize = 5_000;
/// Default bytes (of raw input) per batch: bounds memory whatever the event size.
pub const DEFAULT_BATCH_MAX_BYTES: u64 = 8 * 1024 * 1024;
/// Default wait before a partial batch is flushed: keeps read-model lag under a second when idle.
pub const DEFAULT_BATCH_MAX_DELAY_MS: u64 = 200;
/// Default batches queued per sink before the source is paused (backpressure).
pub const DEFAULT_QUEUE_DEPTH: usize = 4;
/// Default poll interval of the file source at end of file: a human-scale tail latency that
/// costs nothing when idle.
pub const DEFAULT_FILE_POLL_MS: u64 = 250;
/// Default concurrent object writes: object stores answer each PUT in milliseconds, so tens of
/// requests in flight are needed to reach thousands of objects per second.
pub const DEFAULT_OBJECT_CONCURRENCY: usize = 32;

/// A pipeline file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineFile {
    /// Settings of the pipeline as a whole.
    pub pipeline: PipelineSection,
    /// Where change events come from.
    pub source: SourceConfig,
    /// Transformations from change events to write operations, by name.
    #[serde(default)]
    pub projections: BTreeMap<String, ProjectionConfig>,
    /// Where write operations go, by name.
    #[serde(default)]
    pub sinks: BTreeMap<String, SinkConfig>,
}

/// The `[pipeline]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineSection {
    /// Name of the pipeline: names its checkpoint and state under `state_dir`. Letters, digits,
    /// `-` and `_`.
    pub name: String,
    /// Directory for checkpoints and projection state (`${STATE_DIR:-./state}` in shipped files).
    #[serde(default = "default_state_dir")]
    pub state_dir: String,
    /// What to do with bad input (undecodable event, unknown table, value a sink cannot hold):
    /// `dead_letter` (default) records it and goes on, `stop` stops the pipeline with an error.
    #[serde(default)]
    pub on_error: OnError,
    /// How events are grouped into batches.
    #[serde(default)]
    pub batch: BatchConfig,
    /// Where bad input is recorded.
    #[serde(default)]
    pub dead_letter: DeadLetterConfig,
    /// Batches queued per sink before the source is paused (backpressure), 1 to 64.
    #[serde(default = "default_queue_depth")]
    pub queue_depth: usize,
    /// Serve Prometheus metrics over HTTP at this address (`127.0.0.1:9464`), with a status
    /// page, health and readiness, while the pipeline runs; none when unset.
    #[serde(default)]
    pub metrics_addr: Option<String>,
    /// The clock time-based projections (tiers) and the aging job measure age against: `wall`
    /// (default), a fixed RFC 3339 instant, or `INSTANT xSPEED` for an accelerated clock
    /// starting at that instant (see [`crate::clock::ClockSpec`]).
    #[serde(default = "default_clock")]
    pub clock: String,
}

fn default_clock() -> String {
    "wall".into()
}

fn default_state_dir() -> String {
    "./state".into()
}

fn default_queue_depth() -> usize {
    DEFAULT_QUEUE_DEPTH
}

/// Bad-input policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Record the input, its position and the reason in the dead-letter store; go on.
    #[default]
    DeadLetter,
    /// Make everything before the bad input durable, then stop with a non-zero exit.
    Stop,
}

/// Batching limits; a batch is cut at whichever comes first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Most events per batch, 1 to 1,000,000.
    #[serde(default = "default_max_events")]
    pub max_events: usize,
    /// Most bytes of raw input per batch, 1 KiB to 1 GiB.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    /// Longest a partial batch waits for more events, in milliseconds (0 to 60,000).
    #[serde(default = "default_max_delay_ms")]
    pub max_delay_ms: u64,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_events: DEFAULT_BATCH_MAX_EVENTS,
            max_bytes: DEFAULT_BATCH_MAX_BYTES,
            max_delay_ms: DEFAULT_BATCH_MAX_DELAY_MS,
        }
    }
}

fn default_max_events() -> usize {
    DEFAULT_BATCH_MAX_EVENTS
}
fn default_max_bytes() -> u64 {
    DEFAULT_BATCH_MAX_BYTES
}
fn default_max_delay_ms() -> u64 {
    DEFAULT_BATCH_MAX_DELAY_MS
}

/// The dead-letter store: a local NDJSON file (`path`) or NDJSON objects under an object-store
/// URL (`url`). Default: `{state_dir}/{name}/dead-letters.ndjson`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// Local NDJSON file, appended to and synced before the checkpoint passes its entries.
    #[serde(default)]
    pub path: Option<String>,
    /// Object-store prefix (`file:///…`, `s3://…`, `gs://…`, `az://…`): one NDJSON object per batch
    /// that had bad input, named by its position range.
    #[serde(default)]
    pub url: Option<SecretUrl>,
}

/// The source of change events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceConfig {
    /// A file of Debezium envelopes, one JSON object per line.
    File(FileSourceConfig),
    /// PostgreSQL logical replication (pgoutput).
    Postgres(PostgresSourceConfig),
    /// Debezium change events from Kafka topics, read by a consumer group.
    Kafka(KafkaSourceConfig),
}

/// `kind = "postgres"`: reads committed changes from a logical replication slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PostgresSourceConfig {
    /// Connection URL (`postgres://user:password@host:port/db`); the role needs the REPLICATION
    /// attribute, and CREATE on the database to create the publication.
    pub url: SecretUrl,
    /// Replication slot name; default `refract_{pipeline name}`.
    #[serde(default)]
    pub slot: Option<String>,
    /// Publication name; default `refract_{pipeline name}`.
    #[serde(default)]
    pub publication: Option<String>,
    /// Tables of a publication refract creates: `schema.table`, or `schema.*` for every table of
    /// a schema; empty means every table of the database (`FOR ALL TABLES`). Creating a
    /// publication for a schema or all tables needs a superuser. Ignored when the publication
    /// exists.
    #[serde(default)]
    pub tables: Vec<String>,
    /// Create the slot and publication when missing (needs the privileges above).
    #[serde(default = "default_true")]
    pub create: bool,
    /// The rows that exist when refract creates the slot: `initial` reads every published table
    /// into the read models (chunked, consistent with the stream, resumed after a crash);
    /// `never` streams only changes from then on.
    #[serde(default)]
    pub snapshot: SnapshotMode,
    /// Rows per chunk when an interrupted initial snapshot is finished in chunks (100 to
    /// 100,000). Each chunk is one short transaction that share-locks its rows.
    #[serde(default = "default_chunk_rows")]
    pub chunk_rows: u32,
    /// Log a warning when the slot holds back more WAL than this, in MiB (the server keeps WAL
    /// until every slot has confirmed it).
    #[serde(default = "default_max_retained_wal_mb")]
    pub max_retained_wal_mb: u64,
    /// The replication connection is considered dead when nothing at all arrives on it for this
    /// long, in milliseconds (1,000 to 3,600,000), and is reopened from the last position handed
    /// out: a connection cut without a reset (a network black hole, a silent failover) is
    /// noticed. An idle stream is kept talking by a heartbeat message refract writes at half
    /// this deadline.
    #[serde(default = "default_read_timeout_ms")]
    pub read_timeout_ms: u64,
    /// The source reports itself unhealthy at `/health` once its replication stream has been
    /// reconnecting, or its control connection's checks (retained WAL, lost slot, heartbeat)
    /// have been failing, for this long, in milliseconds (100 to 86,400,000). It keeps trying.
    #[serde(default = "default_unhealthy_after_ms")]
    pub unhealthy_after_ms: u64,
}

/// What the PostgreSQL source reads of the rows that exist when its slot is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    /// Read every published table once, then stream.
    #[default]
    Initial,
    /// Stream changes only.
    Never,
}

fn default_chunk_rows() -> u32 {
    5_000
}

fn default_max_retained_wal_mb() -> u64 {
    1_024
}

/// Default read deadline of a replication connection: long beside the heartbeat written at its
/// half on an idle stream, short enough that a dead connection is replaced within a minute.
pub const DEFAULT_PG_READ_TIMEOUT_MS: u64 = 60_000;

fn default_read_timeout_ms() -> u64 {
    DEFAULT_PG_READ_TIMEOUT_MS
}

fn default_true() -> bool {
    true
}

/// `kind = "file"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSourceConfig {
    /// Path of the change log.
    pub path: String,
    /// Keep following the file as it grows (daemon). `false` stops at its end, like
    /// `--until-caught-up` (the demo does this).
    #[serde(default = "default_follow")]
    pub follow: bool,
    /// How often to look for new lines at end of file, in milliseconds (10 to 60,000).
    #[serde(default = "default_poll_ms")]
    pub poll_interval_ms: u64,
    /// Threads decoding lines in parallel (1 to 64); 0 means one per available core.
    #[serde(default)]
    pub decode_threads: usize,
}

fn default_follow() -> bool {
    true
}

fn default_poll_ms() -> u64 {
    DEFAULT_FILE_POLL_MS
}

impl PostgresSourceConfig {
    /// The slot name, defaulting to `refract_{pipeline}`.
    pub fn slot_name(&self, pipeline: &str) -> String {
        self.slot
            .clone()
            .unwrap_or_else(|| default_pg_name(pipeline))
    }

    /// The publication name, defaulting to `refract_{pipeline}`.
    pub fn publication_name(&self, pipeline: &str) -> String {
        self.publication
            .clone()
            .unwrap_or_else(|| default_pg_name(pipeline))
    }
}

fn default_pg_name(pipeline: &str) -> String {
    let name: String = pipeline
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("refract_{name}")
}

/// The JSON Schema of pipeline files, as committed in `schemas/pipeline.schema.json`.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(PipelineFile);
    let mut text = serde_json::to_string_pretty(&schema).expect("a JSON Schema serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests;
