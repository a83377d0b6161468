//! Projection sections (`[projections.NAME]`): what each `kind` reads and how it shapes its
//! output. The rules across sections (sinks named, families accepted) are in `validate`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{MigrationProjectionConfig, TiersProjectionConfig};

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
