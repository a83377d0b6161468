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
mod secret;
mod tiers;
mod validate;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
pub use secret::{REDACTED, Secret, SecretUrl};
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

/// A projection: change events in, write operations out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ProjectionConfig {
    /// The current state of each row, one document per primary key.
    Replica(ReplicaProjectionConfig),
    /// Cache keys to delete after each committed change, built from the old and the new row.
    CacheInvalidation(CacheInvalidationProjectionConfig),
    /// Rows of one table (relational columns and nested JSON) reshaped into flat analytical
    /// tables: paths to columns, arrays exploded into child tables.
    Flatten(FlattenProjectionConfig),
    /// Denormalized documents: one per row of a root table, with copied columns and arrays of
    /// embedded rows of other tables (one-to-many or through a link table), kept current as any
    /// of those tables changes.
    Document(DocumentProjectionConfig),
    /// Every change of its tables relayed as it is, as change events (to a Kafka sink: refract
    /// as a Debezium replacement).
    Relay(RelayProjectionConfig),
    /// Heartbeats routed by age into hot, warm and cold tiers (a `tiers` sink).
    Tiers(TiersProjectionConfig),
    /// The dual write of a shadow-write migration: internal, `refract migrate start` writes it
    /// (not in the JSON Schema of pipeline files).
    #[schemars(skip)]
    Migration(MigrationProjectionConfig),
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

impl ProjectionConfig {
    /// The `kind` the pipeline file gives.
    pub fn kind(&self) -> &'static str {
        match self {
            ProjectionConfig::Replica(_) => "replica",
            ProjectionConfig::CacheInvalidation(_) => "cache_invalidation",
            ProjectionConfig::Flatten(_) => "flatten",
            ProjectionConfig::Document(_) => "document",
            ProjectionConfig::Relay(_) => "relay",
            ProjectionConfig::Tiers(_) => "tiers",
            ProjectionConfig::Migration(_) => "migration",
        }
    }

    /// The sinks this projection writes to.
    pub fn sinks(&self) -> &[String] {
        match self {
            ProjectionConfig::Replica(c) => &c.sinks,
            ProjectionConfig::CacheInvalidation(c) => &c.sinks,
            ProjectionConfig::Flatten(c) => &c.sinks,
            ProjectionConfig::Document(c) => &c.sinks,
            ProjectionConfig::Relay(c) => &c.sinks,
            ProjectionConfig::Tiers(c) => &c.sinks,
            ProjectionConfig::Migration(c) => &c.sinks,
        }
    }
}

/// `kind = "replica"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplicaProjectionConfig {
    /// Tables to replicate (`table` or `schema.table`); empty means every table.
    #[serde(default)]
    pub tables: Vec<String>,
    /// Key columns per table (`"public.book_authors" = ["book_id", "author_id"]`), used when the
    /// record carries no key of its own.
    #[serde(default)]
    pub key_columns: BTreeMap<String, Vec<String>>,
    /// Key columns of tables not listed in `key_columns`.
    #[serde(default = "default_key")]
    pub default_key: Vec<String>,
    /// Name of the collection a table's documents go to; `{table}` and `{schema}` are replaced.
    #[serde(default = "default_collection")]
    pub collection: String,
    /// Sinks the documents are written to.
    pub sinks: Vec<String>,
}

fn default_key() -> Vec<String> {
    vec!["id".into()]
}
fn default_collection() -> String {
    "{table}".into()
}

/// `kind = "relay"`: creates, updates, deletes, snapshot reads and truncates of its tables, one
/// change event each, unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RelayProjectionConfig {
    /// Tables to relay (`table` or `schema.table`); empty means every table.
    #[serde(default)]
    pub tables: Vec<String>,
    /// Sinks the change events go to (`kafka`, or `null` for dry runs).
    pub sinks: Vec<String>,
}

/// `kind = "cache_invalidation"`: per table, key templates rendered from the before image and the
/// after image of every change; the union of the keys is invalidated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CacheInvalidationProjectionConfig {
    /// Per table (`table` or `schema.table`), the keys its rows are cached under.
    pub tables: BTreeMap<String, CacheTableConfig>,
    /// Sinks the invalidations go to (`redis`, or `null` for dry runs).
    pub sinks: Vec<String>,
}

/// The cache keys of one table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CacheTableConfig {
    /// Key templates: `{column}` is replaced by the column's value, `[...]` is an optional
    /// segment left out when a column in it is null (`[t:{tenant_id}:]product:{id}:v3`).
    pub keys: Vec<String>,
    /// A column that grows with every change of a row (a version number, or an `updated_at`
    /// timestamp), carried with each invalidation so a `tombstone` sink can refuse older values.
    #[serde(default)]
    pub version_column: Option<String>,
}

/// `kind = "flatten"`: each change of `table` becomes rows of flat output tables.
///
/// A path names a column of the source row, then fields inside it when it holds JSON (a `jsonb`
/// column, or a string holding a JSON document): `doc.shipping.address.city`. `[]` after a field
/// goes into each element of an array: `doc.customer.contactDetails[].email` is the first
/// non-null `email` among the elements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FlattenProjectionConfig {
    /// The source table (`table` or `schema.table`).
    pub table: String,
    /// The flat tables built from each row.
    pub outputs: Vec<FlatOutputConfig>,
    /// Most columns one output table may have (1 to 10,000); a document that would add more
    /// goes to the dead-letter store with the reason.
    #[serde(default = "default_max_columns")]
    pub max_columns: usize,
    /// Sinks the rows go to (`parquet`, or `null` for dry runs).
    pub sinks: Vec<String>,
}

/// Default ceiling on the columns of one output table: the limit seed 002 cites for analytical
/// stores (Cosmos DB analytical store, Synapse), beyond which queries and engines fail.
pub const DEFAULT_MAX_COLUMNS: usize = 1_000;

fn default_max_columns() -> usize {
    DEFAULT_MAX_COLUMNS
}

/// One flat output table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FlatOutputConfig {
    /// Name of the table (a directory under the sink's URL).
    pub name: String,
    /// Columns that identify a row: `current/` holds one row per key.
    pub key: Vec<String>,
    /// An array path (`doc.items`): one row per element. Columns then address the element as
    /// `doc.items[].sku`; the key must include a column taken from outside the array (the
    /// parent's key), and a new version of the parent replaces all its rows.
    #[serde(default)]
    pub explode: Option<String>,
    /// The columns, in order.
    pub columns: Vec<FlatColumnConfig>,
    /// What a delete of the source row does here: `delete` its rows (default), or `keep` them
    /// (a table fed from many documents, such as customers named by their orders).
    #[serde(default)]
    pub on_delete: FlatOnDelete,
    /// Fields under a path that no column maps: dropped when unset; with `mode = "flatten"`
    /// each becomes a column named by its path, with `mode = "json"` they are kept together as
    /// one JSON text column. New fields then appear as new nullable columns (schema drift).
    #[serde(default)]
    pub unmapped: Option<UnmappedConfig>,
}

/// One column of a flat table: exactly one of `path`, `count` or `line_no`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FlatColumnConfig {
    /// Column name.
    pub name: String,
    /// Where the value comes from.
    #[serde(default)]
    pub path: Option<String>,
    /// The number of elements of this array path (null when absent).
    #[serde(default)]
    pub count: Option<String>,
    /// The 1-based position of the element in an exploded table.
    #[serde(default)]
    pub line_no: bool,
    /// The column's type; values are cast to it (`"42"` to 42, an ISO-8601 string to a
    /// timestamp). Unset: learned from the first non-null value, after which a value of
    /// another kind is a type conflict (dead-lettered).
    #[serde(default, rename = "type")]
    pub column_type: Option<FlatColumnType>,
}

/// Types of flat columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FlatColumnType {
    /// UTF-8 text.
    String,
    /// 64-bit signed integer.
    Int64,
    /// 64-bit float.
    Float64,
    /// Boolean.
    Bool,
    /// Microseconds since the epoch, UTC (ISO-8601 strings, or integers as milliseconds).
    Timestamp,
    /// A calendar date (`YYYY-MM-DD`).
    Date,
    /// Any JSON value, kept as its JSON text.
    Json,
}

/// What a source delete does to a flat table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FlatOnDelete {
    /// Delete the rows the source row produced.
    #[default]
    Delete,
    /// Keep them.
    Keep,
}

/// Unmapped fields of a flat table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UnmappedConfig {
    /// The object whose unmapped fields are kept (`doc`).
    pub under: String,
    /// `flatten` (default): one column per field, named by its path below `under` joined with
    /// `separator`; arrays are kept as JSON text. `json`: one JSON text column, `column`.
    #[serde(default)]
    pub mode: UnmappedMode,
    /// Joins path segments into column names (`shipping_address_zip`).
    #[serde(default = "default_separator")]
    pub separator: String,
    /// Paths left out (subtrees another table takes, such as `doc.items`).
    #[serde(default)]
    pub exclude: Vec<String>,
    /// The column of `mode = "json"`.
    #[serde(default = "default_unmapped_column")]
    pub column: String,
}

fn default_separator() -> String {
    "_".into()
}

fn default_unmapped_column() -> String {
    "extra".into()
}

/// How unmapped fields are kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UnmappedMode {
    /// One column per field.
    #[default]
    Flatten,
    /// One JSON text column holding them all.
    Json,
}

/// `kind = "document"`: one document per row of `table`, rebuilt whenever a row it is made of
/// changes (the root row, an embedded row, a link row).
///
/// ```toml
/// [projections.book_docs]
/// kind = "document"
/// table = "public.books"
/// fields = [{ name = "id", from = "id" }, { name = "name", from = "name" }]
///
/// [[projections.book_docs.embeds]]
/// name = "authors"
/// table = "public.authors"
/// through = { table = "public.book_authors", parent = "book_id", child = "author_id" }
/// order_by = ["through.position", "id"]
/// fields = [{ name = "name", from = "{first_name} {last_name}" }]
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentProjectionConfig {
    /// The root table (`table` or `schema.table`): one document per row.
    pub table: String,
    /// The root table's primary key columns. The document's key is their values as text (a
    /// string as it is, a number or boolean as its JSON text), joined with `:` when there are
    /// several (`%` and `:` inside a value written `%25` and `%3A`). An embed needs a single
    /// column.
    #[serde(default = "default_key")]
    pub key: Vec<String>,
    /// The collection the documents go to; default: the projection's name.
    #[serde(default)]
    pub collection: Option<String>,
    /// Sinks the documents are written to.
    pub sinks: Vec<String>,
    /// Fields copied from the root row, in order.
    #[serde(default)]
    pub fields: Vec<DocumentFieldConfig>,
    /// Arrays of rows of other tables that belong to the root row.
    #[serde(default)]
    pub embeds: Vec<DocumentEmbedConfig>,
    /// Arrays of one-field objects made from the root row's non-null columns.
    #[serde(default)]
    pub objects: Vec<DocumentObjectsConfig>,
}

/// One field of a document (or of an embedded object).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentFieldConfig {
    /// The field's name in the document.
    pub name: String,
    /// A column (its value as it is, JSON type kept, null when null or absent), or a template
    /// with `{column}` placeholders rendered as text (`"{first_name} {last_name}"`; null when a
    /// column outside a `[...]` optional segment is null). In an embed with `through`,
    /// `through.column` reads the link row.
    pub from: String,
}

/// An array of rows of another table embedded in each document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentEmbedConfig {
    /// The document field holding the array.
    pub name: String,
    /// The embedded (child) table.
    pub table: String,
    /// The child table's primary key columns (a single column with `through`).
    #[serde(default = "default_key")]
    pub key: Vec<String>,
    /// Many-to-many: the link table whose rows pair a root row with a child row. Exactly one of
    /// `through` and `foreign_key`.
    #[serde(default)]
    pub through: Option<DocumentLinkConfig>,
    /// One-to-many: the child column holding the root row's key.
    #[serde(default)]
    pub foreign_key: Option<String>,
    /// Sort order of the array: child columns, `through.column` for a column of the link row,
    /// `-` in front for descending (nulls sort last ascending, first descending). Ties, and an
    /// empty list, sort by the child key ascending.
    #[serde(default)]
    pub order_by: Vec<String>,
    /// Most elements kept (the first ones in `order_by` order); unset: all.
    #[serde(default)]
    pub limit: Option<usize>,
    /// The array holds the children's keys as text instead of objects.
    #[serde(default)]
    pub ids: bool,
    /// Fields of each embedded object (not with `ids = true`).
    #[serde(default)]
    pub fields: Vec<DocumentFieldConfig>,
    /// A document field holding the number of embedded children (before `limit`).
    #[serde(default)]
    pub count: Option<String>,
}

/// The link table of a many-to-many embed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentLinkConfig {
    /// The link table (`table` or `schema.table`).
    pub table: String,
    /// The link column holding the root row's key.
    pub parent: String,
    /// The link column holding the child row's key.
    pub child: String,
    /// The link table's primary key columns; default `[parent, child]`.
    #[serde(default)]
    pub key: Option<Vec<String>>,
}

impl DocumentLinkConfig {
    /// The link table's key columns: `key`, or `[parent, child]`.
    pub fn key_columns(&self) -> Vec<String> {
        self.key
            .clone()
            .unwrap_or_else(|| vec![self.parent.clone(), self.child.clone()])
    }
}

/// An array of one-field objects built from columns of the root row: each item whose value is
/// not null becomes `{"name": value}`, in the declared order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentObjectsConfig {
    /// The document field holding the array.
    pub name: String,
    /// The candidate objects, in order.
    pub items: Vec<DocumentFieldConfig>,
}

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

fn default_unhealthy_after_ms() -> u64 {
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

/// The JSON Schema of pipeline files, as committed in `schemas/pipeline.schema.json`.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(PipelineFile);
    let mut text = serde_json::to_string_pretty(&schema).expect("a JSON Schema serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests;
