//! Scripts of source items as tests write them (`Step`), the items they become, and the
//! independent model of what each key goes through, to compare with what a sink applied.

use std::collections::BTreeMap;
use std::sync::Arc;

use refract_connectors::SourceItem;
use refract_projections::{DocumentOp, WriteOp};
use refract_schemas::debezium::DecodeError;
use refract_schemas::event::{SourceInfo, TxBoundary, TxStatus};
use refract_schemas::{ChangeEvent, Checkpoint, Offset, Op, Position, Record, Row, TableId};
use serde_json::json;

use super::sinks::Applied;
use super::{PARTITION, TABLE};

/// One scripted source item, as a test writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Step {
    /// Row `id` of `items` now holds `value`.
    Put(i64, i64),
    /// Row `id` of `items` is deleted.
    Delete(i64),
    /// A source transaction begins.
    Begin,
    /// The source transaction ends.
    End,
    /// Input that does not decode.
    Garbage,
    /// A change of a table no projection reads.
    Unread,
    /// A change of `items` without its key column.
    Keyless,
}

impl Step {
    /// Whether the runtime must set it aside as bad input.
    pub(crate) fn is_bad(self) -> bool {
        matches!(self, Step::Garbage | Step::Unread | Step::Keyless)
    }
}

/// The position of the item at `offset`.
pub(crate) fn position(offset: u64) -> Position {
    Position {
        partition: PARTITION.into(),
        offset: Offset(offset, 0),
    }
}

/// The checkpoint that covers the in-memory source through `offset` (empty for 0).
pub(crate) fn through(offset: u64) -> Checkpoint {
    if offset == 0 {
        return Checkpoint::new();
    }
    Checkpoint::from([(PARTITION.to_owned(), Offset(offset, 0))])
}

/// The offset a checkpoint covers the in-memory source through (0 for none).
pub(crate) fn covered(checkpoint: &Checkpoint) -> u64 {
    checkpoint.get(PARTITION).map_or(0, |o| o.0)
}

/// The source items of `steps`, the item of step `i` at offset `i + 1`.
pub(crate) fn items(steps: &[Step]) -> Vec<SourceItem> {
    let mut tx = 0;
    steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let position = position(i as u64 + 1);
            let raw = format!("{step:?} at {}", i + 1);
            let change = |table: &str, op, row: Option<Row>| {
                let row = row.map(Arc::new);
                let (before, after) = match op {
                    Op::Delete => (row, None),
                    _ => (None, row),
                };
                Ok(Record::Change(ChangeEvent {
                    table: TableId::new("public", table),
                    op,
                    key: None,
                    key_columns: None,
                    before,
                    after,
                    source: SourceInfo::default(),
                    transaction: None,
                    position: position.clone(),
                }))
            };
            let mut marker = |status| {
                tx += u64::from(status == TxStatus::Begin);
                Ok(Record::Transaction(TxBoundary {
                    status,
                    id: tx.to_string(),
                    event_count: None,
                    ts_ms: None,
                    position: position.clone(),
                }))
            };
            let record = match *step {
                Step::Put(id, value) => change(TABLE, Op::Update, Some(row(id, value))),
                Step::Delete(id) => change(TABLE, Op::Delete, Some(row(id, 0))),
                Step::Begin => marker(TxStatus::Begin),
                Step::End => marker(TxStatus::End),
                Step::Garbage => Err(DecodeError {
                    position: position.clone(),
                    reason: format!("scripted garbage at {}", i + 1),
                }),
                Step::Unread => change("other", Op::Update, Some(row(1, 1))),
                Step::Keyless => change(
                    TABLE,
                    Op::Update,
                    Some(Row::from_iter([("v".to_owned(), json!(1))])),
                ),
            };
            SourceItem {
                record,
                raw: raw.into_bytes().into(),
            }
        })
        .collect()
}

fn row(id: i64, value: i64) -> Row {
    Row::from_iter([("id".to_owned(), json!(id)), ("v".to_owned(), json!(value))])
}

/// What a key went through: `Some(value)` for each write, `None` for each delete, in order.
pub(crate) type History = BTreeMap<String, Vec<Option<i64>>>;

/// The independent model: what each key of `items` goes through when `steps` are applied.
pub(crate) fn expected(steps: &[Step]) -> History {
    let mut history = History::new();
    for step in steps {
        match *step {
            Step::Put(id, value) => history.entry(id.to_string()).or_default().push(Some(value)),
            Step::Delete(id) => history.entry(id.to_string()).or_default().push(None),
            _ => {}
        }
    }
    history
}

/// What each key went through in a sink, from the batches it applied in order.
pub(crate) fn history(batches: &[Applied]) -> History {
    let mut history = History::new();
    for op in batches.iter().flat_map(|b| &b.ops) {
        match op {
            WriteOp::Document(DocumentOp::Upsert { key, doc, .. }) => history
                .entry(key.clone())
                .or_default()
                .push(doc.get("v").and_then(|v| v.as_i64())),
            WriteOp::Document(DocumentOp::Delete { key, .. }) => {
                history.entry(key.clone()).or_default().push(None)
            }
            other => panic!("a replica writes no {other:?}"),
        }
    }
    history
}

/// The source offsets of the operations of a batch.
pub(crate) fn offsets(batch: &Applied) -> Vec<u64> {
    batch.ops.iter().map(|op| op.position().offset.0).collect()
}
