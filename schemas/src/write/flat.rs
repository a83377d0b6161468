//! Rows of flat (columnar) tables: their column types, values and schemas. A `flatten`
//! projection makes them; a columnar sink (Parquet) writes them.

use std::sync::Arc;

use crate::config::FlatColumnType;

/// The type of a flat column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlatType {
    /// No non-null value seen yet: the column is written as a null column until one is.
    Unknown,
    /// Boolean.
    Bool,
    /// 64-bit signed integer.
    Int64,
    /// 64-bit float.
    Float64,
    /// UTF-8 text.
    String,
    /// Microseconds since the epoch, UTC.
    Timestamp,
    /// Days since the epoch.
    Date,
    /// JSON text (arrays and objects kept whole).
    Json,
}

impl From<FlatColumnType> for FlatType {
    fn from(t: FlatColumnType) -> Self {
        match t {
            FlatColumnType::String => FlatType::String,
            FlatColumnType::Int64 => FlatType::Int64,
            FlatColumnType::Float64 => FlatType::Float64,
            FlatColumnType::Bool => FlatType::Bool,
            FlatColumnType::Timestamp => FlatType::Timestamp,
            FlatColumnType::Date => FlatType::Date,
            FlatColumnType::Json => FlatType::Json,
        }
    }
}

/// One value of a flat row.
#[derive(Clone, Debug, PartialEq)]
pub enum FlatValue {
    /// No value.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// Text (also JSON text of `Json` columns).
    Str(String),
    /// Microseconds since the epoch, UTC.
    Micros(i64),
    /// Days since the epoch.
    Days(i32),
}

impl FlatValue {
    /// The column type this value belongs to (`Unknown` for null).
    pub fn flat_type(&self) -> FlatType {
        match self {
            FlatValue::Null => FlatType::Unknown,
            FlatValue::Bool(_) => FlatType::Bool,
            FlatValue::Int(_) => FlatType::Int64,
            FlatValue::Float(_) => FlatType::Float64,
            FlatValue::Str(_) => FlatType::String,
            FlatValue::Micros(_) => FlatType::Timestamp,
            FlatValue::Days(_) => FlatType::Date,
        }
    }
}

/// A column of a flat table.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FlatColumn {
    /// Column name.
    pub name: String,
    /// Column type.
    #[serde(rename = "type")]
    pub ty: FlatType,
}

/// The schema of a flat table at one version. Versions grow by one each time a column is added
/// or a column's type is first learned; files record the version they were written with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatSchema {
    /// The table's name.
    pub table: Arc<str>,
    /// The schema version (1 for the first).
    pub version: u32,
    /// The columns, in order.
    pub columns: Vec<FlatColumn>,
    /// Indexes of the key columns: `current/` keeps one row per key.
    pub key: Vec<usize>,
    /// For an exploded table, indexes of the parent's key columns: every change of the parent
    /// replaces all rows of its group. Empty otherwise.
    pub group: Vec<usize>,
}

/// What a flat change does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlatOp {
    /// Insert or replace the row with this key (in an exploded table: a row of the group's new
    /// set of rows, all at the same position).
    Upsert,
    /// Delete the row with this key (in an exploded table: the group has no rows any more).
    /// Only the key (or group) columns are set.
    Delete,
    /// Delete every row older than this change. No column is set.
    Truncate,
}

impl FlatOp {
    /// The one-letter code written in the `_op` column.
    pub fn code(self) -> &'static str {
        match self {
            FlatOp::Upsert => "u",
            FlatOp::Delete => "d",
            FlatOp::Truncate => "t",
        }
    }
}

/// One row change of a flat table.
#[derive(Clone, Debug, PartialEq)]
pub struct FlatChange {
    /// The table's schema when the row was made; `values` follows its columns.
    pub schema: Arc<FlatSchema>,
    /// What happens.
    pub op: FlatOp,
    /// One value per column of `schema`.
    pub values: Vec<FlatValue>,
    /// Commit time of the source change, in milliseconds since the epoch.
    pub commit_ts_ms: Option<i64>,
}
