//! Sink sections (`[sinks.NAME]`): where write operations are applied, with each sink's
//! defaults and the reasons for them.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{DEFAULT_OBJECT_CONCURRENCY, MigrationSinkConfig, Secret, SecretUrl, TiersSinkConfig};

/// A sink: where write operations are applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SinkConfig {
    /// One JSON object per document at `{url}/{collection}/{key}.json`.
    ObjectJson(ObjectJsonSinkConfig),
    /// Redis: deletes invalidated cache keys (and stores documents as JSON strings).
    Redis(RedisSinkConfig),
    /// Parquet change logs and current-state tables on object storage (flat rows only).
    Parquet(ParquetSinkConfig),
    /// PostgreSQL tables of JSONB documents, one per collection.
    Postgres(PostgresSinkConfig),
    /// Kafka topics: change events as Debezium envelopes, one topic per table, and documents
    /// keyed for compacted topics.
    Kafka(KafkaSinkConfig),
    /// Hot (Redis), warm (PostgreSQL hourly partitions) and cold (Parquet) tiers of heartbeats.
    Tiers(TiersSinkConfig),
    /// The two tables of a shadow-write migration: internal, `refract migrate start` writes it
    /// (not in the JSON Schema of pipeline files).
    #[schemars(skip)]
    Migration(MigrationSinkConfig),
    /// Discards everything (benchmarks, dry runs).
    Null(NullSinkConfig),
}

impl SinkConfig {
    /// The `kind` the pipeline file gives.
    pub fn kind(&self) -> &'static str {
        match self {
            SinkConfig::ObjectJson(_) => "object_json",
            SinkConfig::Redis(_) => "redis",
            SinkConfig::Parquet(_) => "parquet",
            SinkConfig::Postgres(_) => "postgres",
            SinkConfig::Kafka(_) => "kafka",
            SinkConfig::Tiers(_) => "tiers",
            SinkConfig::Migration(_) => "migration",
            SinkConfig::Null(_) => "null",
        }
    }
}

/// `kind = "object_json"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ObjectJsonSinkConfig {
    /// Object-store URL: `file:///abs/dir`, `s3://bucket/prefix`, `gs://…`, `az://…`, `memory:///`.
    /// Cloud credentials come from the usual environment variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    pub url: SecretUrl,
    /// Object writes in flight at once, 1 to 1,024.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Pretty-print the documents.
    #[serde(default)]
    pub pretty: bool,
}

fn default_concurrency() -> usize {
    DEFAULT_OBJECT_CONCURRENCY
}

/// How a Redis sink removes an invalidated key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RedisDeleteCommand {
    /// `UNLINK`: the key disappears at once, its memory is freed in the background.
    #[default]
    Unlink,
    /// `DEL`: frees the memory inline (servers older than 4.0, or when memory must drop now).
    Del,
    /// Replace the value with a short-lived tombstone that carries the row's version: the
    /// application's versioned SET (a Lua script, see `docs/sinks/redis.md`, "Stale sets")
    /// refuses values older than it.
    Tombstone,
}

/// `kind = "redis"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisSinkConfig {
    /// `redis://host:port/db`, or `rediss://` for TLS. User and password may be in the URL or in
    /// `username` / `password`.
    pub url: SecretUrl,
    /// ACL user name (`${REDIS_USERNAME}`); overrides the URL's.
    #[serde(default)]
    pub username: Option<String>,
    /// Password (`${REDIS_PASSWORD}`); overrides the URL's. Never logged or shown by `plan`.
    #[serde(default)]
    pub password: Option<Secret>,
    /// PEM file of the certificate authority that signed the server's certificate, for a
    /// `rediss://` server with a private CA (default: the public web roots).
    #[serde(default)]
    pub tls_ca_file: Option<String>,
    /// How invalidated keys are removed.
    #[serde(default)]
    pub command: RedisDeleteCommand,
    /// The URL is one node of a Redis Cluster: the sink discovers the others, groups each
    /// batch's keys by hash slot (one pipeline and multi-key delete per slot) and follows
    /// `MOVED`/`ASK` redirections.
    #[serde(default)]
    pub cluster: bool,
    /// Commands sent before reading their replies, 1 to 10,000 (on a cluster: per pipeline, one
    /// pipeline per hash slot).
    #[serde(default = "default_pipeline_depth")]
    pub pipeline_depth: usize,
    /// Keys per `UNLINK`/`DEL` command, 1 to 1,000: consecutive deletes of a batch share one
    /// command, which costs Redis far less than one command per key. Set 1 behind a proxy that
    /// cannot split them; with `cluster = true` each command holds keys of one slot only.
    #[serde(default = "default_keys_per_command")]
    pub keys_per_command: usize,
    /// Delete every invalidated key a second time this many milliseconds after the first
    /// delete (0 = never), against a reader that caches a stale value it read just before the
    /// change; 1 to 600,000 otherwise.
    #[serde(default)]
    pub second_delete_ms: u64,
    /// Life of a tombstone (`command = "tombstone"`), in milliseconds: at least as long as a
    /// reader may take between reading the primary store and setting the cache.
    #[serde(default = "default_tombstone_ttl_ms")]
    pub tombstone_ttl_ms: u64,
    /// A batch that has waited this long for Redis (retrying) makes the pipeline report itself
    /// unhealthy (log and `refract_sink_healthy` metric) until it is delivered; it keeps waiting.
    #[serde(default = "default_unhealthy_after_ms")]
    pub unhealthy_after_ms: u64,
    /// Where to write the commands instead when Redis does not answer at start: for demos and
    /// dry runs only (the keys are not deleted). Unset: wait for Redis.
    #[serde(default)]
    pub fallback_file: Option<String>,
}

/// Default Redis pipeline depth: hundreds of commands per round trip reach most of Redis'
/// single-connection throughput while each reply buffer stays small.
pub const DEFAULT_REDIS_PIPELINE_DEPTH: usize = 512;

/// Default keys per delete command: a hundred keys amortize Redis' per-command cost while one
/// command stays a few KiB.
pub const DEFAULT_REDIS_KEYS_PER_COMMAND: usize = 100;

fn default_keys_per_command() -> usize {
    DEFAULT_REDIS_KEYS_PER_COMMAND
}

fn default_pipeline_depth() -> usize {
    DEFAULT_REDIS_PIPELINE_DEPTH
}

fn default_tombstone_ttl_ms() -> u64 {
    60_000
}

pub(super) fn default_unhealthy_after_ms() -> u64 {
    30_000
}

/// `kind = "parquet"`: per table, a change log `{table}/changes/date=YYYY-MM-DD/*.parquet` and a
/// current state `{table}/current/` rebuilt from it by compaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ParquetSinkConfig {
    /// Object-store URL: `file:///abs/dir`, `s3://bucket/prefix`, `gs://…`, `az://…`. Cloud
    /// credentials come from the usual environment variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    pub url: SecretUrl,
    /// zstd level, 1 to 22.
    #[serde(default = "default_zstd_level")]
    pub zstd_level: i32,
    /// Rows per row group, 1,000 to 10,000,000.
    #[serde(default = "default_row_group_rows")]
    pub row_group_rows: usize,
    /// A change-log file is published once it holds this many rows (at the end of the batch
    /// that reaches it), 1 to 100,000,000.
    #[serde(default = "default_roll_rows")]
    pub roll_rows: usize,
    /// … or this many bytes of encoded data, 1 MiB to 4 GiB.
    #[serde(default = "default_roll_bytes")]
    pub roll_bytes: u64,
    /// … or when it has been open this long, in milliseconds (100 to 3,600,000). The source is
    /// acknowledged only for published files, so this bounds the replay after a crash.
    #[serde(default = "default_roll_ms")]
    pub roll_ms: u64,
    /// The open change-log files together hold at most about this many bytes in memory (their
    /// encoded data and buffered row groups), 16 MiB to 64 GiB: past it, those written to
    /// least recently are published early. Files are open per table and commit day, so a
    /// replay of many days would otherwise keep everything read within `roll_ms` in memory.
    #[serde(default = "default_buffer_bytes")]
    pub buffer_bytes: u64,
    /// How often the daemon rebuilds `current/` from the change log, in milliseconds (0 =
    /// only at the end of `run --until-caught-up` and with `refract compact`).
    #[serde(default = "default_compact_interval_ms")]
    pub compact_interval_ms: u64,
    /// Change-log files older than this many days (by their date partition) are deleted by
    /// compaction once merged into `current/` (0 = keep forever).
    #[serde(default)]
    pub change_retention_days: u32,
}

/// Default zstd level: zstd's own default, most of the ratio at a fraction of the CPU of high levels.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;
/// Default rows per row group: large enough for efficient column scans, small enough to keep
/// the writer's buffered row group to tens of MiB.
pub const DEFAULT_ROW_GROUP_ROWS: usize = 128 * 1024;
/// Default rows per change-log file: files of tens of MiB, which engines read efficiently.
pub const DEFAULT_ROLL_ROWS: usize = 1_000_000;
/// Default bytes per change-log file: the size analytical engines prefer (128 MiB).
pub const DEFAULT_ROLL_BYTES: u64 = 128 * 1024 * 1024;
/// Default longest a change-log file stays open: a minute of replay at most after a crash, and
/// fresh data for readers within a minute.
pub const DEFAULT_ROLL_MS: u64 = 60_000;
/// Default memory bound of the open change-log files: room for three tables' files of the
/// default `roll_bytes` on one day, so only replays spread over many days roll early.
pub const DEFAULT_BUFFER_BYTES: u64 = 512 * 1024 * 1024;
/// Default compaction interval of the daemon: `current/` is at most five minutes behind.
pub const DEFAULT_COMPACT_INTERVAL_MS: u64 = 300_000;

fn default_zstd_level() -> i32 {
    DEFAULT_ZSTD_LEVEL
}
fn default_row_group_rows() -> usize {
    DEFAULT_ROW_GROUP_ROWS
}
fn default_roll_rows() -> usize {
    DEFAULT_ROLL_ROWS
}
fn default_roll_bytes() -> u64 {
    DEFAULT_ROLL_BYTES
}
fn default_roll_ms() -> u64 {
    DEFAULT_ROLL_MS
}
fn default_buffer_bytes() -> u64 {
    DEFAULT_BUFFER_BYTES
}
fn default_compact_interval_ms() -> u64 {
    DEFAULT_COMPACT_INTERVAL_MS
}

/// `kind = "postgres"`: documents as rows `(id text PRIMARY KEY, doc jsonb NOT NULL,
/// source_position text, updated_at timestamptz)` of `{schema}.{table}`, one table per
/// collection, created when missing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PostgresSinkConfig {
    /// Connection URL (`${TARGET_PG_URL:-${PG_URL:-postgres://…}}` in shipped files).
    pub url: SecretUrl,
    /// Schema of the read-model tables (created when missing).
    #[serde(default = "default_read_model_schema")]
    pub schema: String,
    /// Table name of a collection; `{collection}` is replaced.
    #[serde(default = "default_read_model_table")]
    pub table: String,
    /// Documents per upsert statement, 1 to 100,000.
    #[serde(default = "default_rows_per_statement")]
    pub rows_per_statement: usize,
    /// How long, in milliseconds, a delete's tombstone is kept at least (1,000 to 3,153,600,000,000):
    /// it is pruned at open once it is also older than the sink's checkpoint.
    #[serde(default = "default_tombstone_retention_ms")]
    pub tombstone_retention_ms: u64,
}

/// Table of the PostgreSQL sink's tombstones, in the sink's schema: `(target, id, position,
/// deleted_at)`, the position that deleted each document, so that an older upsert replayed after
/// the delete cannot bring the document back. No read-model table may be named so.
pub const POSTGRES_TOMBSTONES_TABLE: &str = "refract_tombstones";

/// Default tombstone retention: 7 days, longer than any replay a crash or an outage causes
/// (a pipeline's checkpoint lagging a week behind has bigger problems than a resurrected row).
pub const DEFAULT_TOMBSTONE_RETENTION_MS: u64 = 7 * 24 * 3_600_000;

fn default_tombstone_retention_ms() -> u64 {
    DEFAULT_TOMBSTONE_RETENTION_MS
}

fn default_read_model_schema() -> String {
    "read_models".into()
}

fn default_read_model_table() -> String {
    "{collection}".into()
}

/// Default documents per upsert statement: a few MiB of JSONB per round trip, past which larger
/// statements gain little.
pub const DEFAULT_ROWS_PER_STATEMENT: usize = 1_000;

fn default_rows_per_statement() -> usize {
    DEFAULT_ROWS_PER_STATEMENT
}

/// `kind = "kafka"`: change events to `{topic_prefix}.{schema}.{table}` (Debezium's topic
/// names), keyed by their key columns, valued by Debezium JSON envelopes; documents to
/// `documents_topic`, keyed by document key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// Bootstrap servers, `host:port` separated by commas (`${KAFKA_BROKERS:-127.0.0.1:9092}` in
    /// shipped files).
    pub brokers: String,
    /// First part of every topic name (Debezium's `topic.prefix`): letters, digits, `.`, `_`, `-`.
    pub topic_prefix: String,
    /// Topic of a collection's documents; `{topic_prefix}` and `{collection}` are replaced.
    #[serde(default = "default_documents_topic")]
    pub documents_topic: String,
    /// Compression of message batches.
    #[serde(default)]
    pub compression: KafkaCompression,
    /// A batch's messages must all be acknowledged within this many milliseconds (1,000 to
    /// 3,600,000), else the batch fails and is retried.
    #[serde(default = "default_delivery_timeout_ms")]
    pub delivery_timeout_ms: u64,
    /// Further librdkafka producer settings, passed through (`"security.protocol" = "SASL_SSL"`,
    /// `"sasl.password" = "${KAFKA_PASSWORD}"`); secret ones are masked by `plan`. Those the sink
    /// sets itself (idempotence, acks, timeouts, compression, brokers) are refused.
    #[serde(default)]
    pub properties: BTreeMap<String, Secret>,
}

/// Compression of Kafka message batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KafkaCompression {
    /// LZ4: cheap to compress and decompress, and JSON shrinks severalfold.
    #[default]
    Lz4,
    /// No compression.
    None,
}

fn default_documents_topic() -> String {
    "{topic_prefix}.{collection}".into()
}

/// Default delivery timeout: librdkafka's own two minutes is long for a batch the runtime waits
/// on; thirty seconds rides out a leader election and reports a dead cluster soon.
pub const DEFAULT_KAFKA_DELIVERY_TIMEOUT_MS: u64 = 30_000;

fn default_delivery_timeout_ms() -> u64 {
    DEFAULT_KAFKA_DELIVERY_TIMEOUT_MS
}

/// `kind = "null"`: no settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NullSinkConfig {}
