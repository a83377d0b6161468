//! The change-event model every source produces and every projection consumes.
//!
//! It follows Debezium's envelope (`before`, `after`, `op`, `source`, `transaction`) but is
//! independent of any wire format: the Debezium JSON codec in [`crate::debezium`] is one way to
//! build it, the PostgreSQL source another. Every event carries the [`Position`] its source
//! assigned, which is what checkpoints are made of.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::row::{Columns, Row};

/// The kind of change, Debezium's `op` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// `c`: a row was inserted.
    Create,
    /// `u`: a row was updated.
    Update,
    /// `d`: a row was deleted.
    Delete,
    /// `r`: a row read by a snapshot.
    Read,
    /// `t`: the table was truncated.
    Truncate,
}

impl Op {
    /// Parses Debezium's one-letter code.
    pub fn from_code(code: &str) -> Option<Self> {
        Some(match code {
            "c" => Op::Create,
            "u" => Op::Update,
            "d" => Op::Delete,
            "r" => Op::Read,
            "t" => Op::Truncate,
            _ => return None,
        })
    }

    /// Debezium's one-letter code.
    pub fn code(self) -> &'static str {
        match self {
            Op::Create => "c",
            Op::Update => "u",
            Op::Delete => "d",
            Op::Read => "r",
            Op::Truncate => "t",
        }
    }
}

/// A position inside one source partition: two unsigned integers compared lexicographically.
///
/// PostgreSQL: (commit LSN, sequence within the transaction). Kafka: (offset, 0). File: (byte
/// offset of the line's end, 0). Positions are totally ordered within their partition only.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Offset(pub u64, pub u64);

impl Offset {
    /// Appends the offset as `{major:020}.{minor:020}`: text whose order is the offsets' order,
    /// for targets that store positions as text (Parquet `_position`, PostgreSQL
    /// `source_position`) and file names. Written without the formatter: it runs once per row.
    pub fn write_sortable(self, out: &mut String) {
        fn padded(out: &mut String, mut n: u64) {
            let mut digits = [b'0'; 20];
            for d in digits.iter_mut().rev() {
                *d = b'0' + (n % 10) as u8;
                n /= 10;
            }
            out.push_str(std::str::from_utf8(&digits).expect("ASCII digits"));
        }
        padded(out, self.0);
        out.push('.');
        padded(out, self.1);
    }

    /// [`Offset::write_sortable`] into a new string.
    pub fn sortable(self) -> String {
        let mut text = String::with_capacity(41);
        self.write_sortable(&mut text);
        text
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.1 == 0 {
            write!(f, "{}", self.0)
        } else if self.1 == u64::MAX {
            write!(f, "{}.end", self.0)
        } else {
            write!(f, "{}.{}", self.0, self.1)
        }
    }
}

/// Where an event sits in its source: partition name plus an [`Offset`] within it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Position {
    /// The source partition: a file path, `topic/partition`, or a replication slot name.
    pub partition: Arc<str>,
    /// The ordered offset within the partition.
    pub offset: Offset,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.partition, self.offset)
    }
}

/// A checkpoint: per source partition, the highest offset whose effects every sink made durable.
pub type Checkpoint = BTreeMap<String, Offset>;

/// A schema-qualified table name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TableId {
    /// The schema (PostgreSQL) or database (MySQL); empty when the source does not say.
    pub schema: Arc<str>,
    /// The table name.
    pub name: Arc<str>,
}

impl TableId {
    /// Builds a table id from its parts.
    pub fn new(schema: &str, name: &str) -> Self {
        Self {
            schema: schema.into(),
            name: name.into(),
        }
    }

    /// Matches a pattern as written in pipeline files: `table` or `schema.table`.
    pub fn matches(&self, pattern: &str) -> bool {
        match pattern.split_once('.') {
            Some((schema, name)) => *self.schema == *schema && *self.name == *name,
            None => *self.name == *pattern,
        }
    }
}

impl fmt::Display for TableId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.schema.is_empty() {
            write!(f, "{}", self.name)
        } else {
            write!(f, "{}.{}", self.schema, self.name)
        }
    }
}

/// Debezium's `source` block: where the change came from, as the source itself describes it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// Connector name (`postgresql`, `mysql`, ...).
    pub connector: Option<Arc<str>>,
    /// Database name.
    pub db: Option<Arc<str>>,
    /// Commit (or event) time in milliseconds since the epoch.
    pub ts_ms: Option<i64>,
    /// Source transaction id, when the source has one.
    pub tx_id: Option<i64>,
    /// PostgreSQL LSN of the change, when given.
    pub lsn: Option<u64>,
    /// Kafka coordinates when the event was read from a topic.
    pub kafka: Option<KafkaCoordinates>,
}

/// Topic, partition and offset of a record read from Kafka.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KafkaCoordinates {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
}

/// Debezium's per-event `transaction` block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TxInfo {
    /// Transaction id (Debezium writes `"txId:lsn"` for PostgreSQL).
    pub id: String,
    /// Order of the event among all events of the transaction (1-based).
    pub total_order: Option<u64>,
    /// Order of the event among the transaction's events on the same table (1-based).
    pub data_collection_order: Option<u64>,
}

/// One row change.
#[derive(Clone, Debug, PartialEq)]
pub struct ChangeEvent {
    /// The table the row belongs to.
    pub table: TableId,
    /// What happened.
    pub op: Op,
    /// The record key (Kafka key / primary key columns) when the source provides one as an
    /// image of its own.
    pub key: Option<Arc<Row>>,
    /// The names of the key columns, sorted (the order a key image iterates in), when the key is
    /// not given as an image but is those columns of the row image: a row read by a snapshot,
    /// whose `after` holds them all. Shared by the events of a table, so reading millions of
    /// rows does not build a key map for each. At most one of `key` and `key_columns` is set.
    pub key_columns: Option<Arc<[String]>>,
    /// The row before the change (updates with enough replica identity, deletes).
    pub before: Option<Arc<Row>>,
    /// The row after the change (creates, updates, snapshot reads).
    pub after: Option<Arc<Row>>,
    /// The source's own description of the change.
    pub source: SourceInfo,
    /// The transaction the event belongs to, when known.
    pub transaction: Option<TxInfo>,
    /// Where the event sits in its source partition.
    pub position: Position,
}

impl ChangeEvent {
    /// The values of the record key in `row` (an image of this event), in key-column-name order:
    /// the key image's own values when there is one, else the [`ChangeEvent::key_columns`] of
    /// `row`. `None` when the event names no key; `Some(Err(column))` when `row` lacks a key
    /// column or holds null in it.
    pub fn key_values<'a>(&'a self, row: &'a Row) -> Option<Result<Vec<&'a Value>, &'a str>> {
        if let Some(key) = self.key.as_deref().filter(|k| !k.is_empty()) {
            return Some(Ok(key.values().collect()));
        }
        let columns = self.key_columns.as_deref().filter(|c| !c.is_empty())?;
        Some(
            columns
                .iter()
                .map(|c| match row.get(c.as_str()) {
                    Some(v) if !v.is_null() => Ok(v),
                    _ => Err(c.as_str()),
                })
                .collect(),
        )
    }

    /// Whether `column` is a key column, as far as the event tells.
    pub fn is_key_column(&self, column: &str) -> bool {
        self.key.as_deref().is_some_and(|k| k.contains_key(column))
            || self
                .key_columns
                .as_deref()
                .is_some_and(|c| c.iter().any(|k| k == column))
    }
}

/// BEGIN or END of a source transaction (Debezium's transaction metadata).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TxStatus {
    /// The transaction starts.
    Begin,
    /// The transaction ended (committed); `event_count` events belong to it.
    End,
}

/// A transaction boundary marker.
#[derive(Clone, Debug, PartialEq)]
pub struct TxBoundary {
    /// BEGIN or END.
    pub status: TxStatus,
    /// Transaction id.
    pub id: String,
    /// Number of data events in the transaction (END only).
    pub event_count: Option<u64>,
    /// Commit time in milliseconds since the epoch, when given.
    pub ts_ms: Option<i64>,
    /// Where the marker sits in its source partition.
    pub position: Position,
}

/// What a decoder yields for one input record.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// A row change.
    Change(ChangeEvent),
    /// A transaction boundary.
    Transaction(TxBoundary),
    /// A Kafka tombstone (null value) that follows a delete for log compaction: carries nothing
    /// a read model needs, but its position still has to be acknowledged.
    Tombstone(Position),
}

impl Record {
    /// The record's position in its source partition.
    pub fn position(&self) -> &Position {
        match self {
            Record::Change(e) => &e.position,
            Record::Transaction(t) => &t.position,
            Record::Tombstone(p) => p,
        }
    }
}
