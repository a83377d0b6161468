//! What a batch comes to in Kafka: one message (or a message and its tombstone) per operation,
//! with the topic, key and value each gets. Pure: the sink sends what this returns, in order.
//!
//! - a change event: to `{topic_prefix}.{schema}.{table}`, key = the key columns as a JSON
//!   object, value = the Debezium envelope; a delete is followed by a tombstone (same key, null
//!   value) so compaction can drop the key, as Debezium does; an update that moves the key
//!   (the before image carries the old key) becomes a delete of the old key, its tombstone, and
//!   a create of the new one, again as Debezium does; a truncate is an `op = "t"` envelope
//!   without a key.
//! - a document upsert: to `documents_topic`, key = the document key, value = the document;
//!   a delete: a tombstone; a truncate: refused (a producer cannot empty a compacted topic).

use std::collections::HashMap;
use std::sync::Arc;

use refract_schemas::debezium::encode::{encode_key, encode_value, key_row};
use refract_schemas::write::DocumentOp;
use refract_schemas::{ChangeEvent, Op, TableId};

use crate::intake::TopicOp;

/// One Kafka message.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Message {
    /// The topic.
    pub topic: Arc<str>,
    /// The key; `None` for a keyless table's events and truncates.
    pub key: Option<Vec<u8>>,
    /// The value; `None` for a tombstone.
    pub value: Option<Vec<u8>>,
}

/// Why an operation has no Kafka message: the batch fails permanently with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Unsendable(pub String);

/// Topic names, worked out once per table and collection.
pub(super) struct Topics {
    prefix: String,
    documents: String,
    tables: HashMap<TableId, Arc<str>>,
    collections: HashMap<Arc<str>, Arc<str>>,
}

impl Topics {
    /// Names topics after `prefix` and the `documents` template.
    pub fn new(prefix: &str, documents: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            documents: documents.replace("{topic_prefix}", prefix),
            tables: HashMap::new(),
            collections: HashMap::new(),
        }
    }

    /// `{prefix}.{schema}.{table}` (`{prefix}.{table}` without a schema), with characters Kafka
    /// refuses in topic names replaced by `_`, as Debezium does.
    pub fn table(&mut self, table: &TableId) -> Arc<str> {
        if let Some(t) = self.tables.get(table) {
            return t.clone();
        }
        let name = if table.schema.is_empty() {
            format!("{}.{}", self.prefix, table.name)
        } else {
            format!("{}.{}.{}", self.prefix, table.schema, table.name)
        };
        let topic: Arc<str> = sanitize(&name).into();
        self.tables.insert(table.clone(), topic.clone());
        topic
    }

    /// The documents topic of `collection`.
    pub fn collection(&mut self, collection: &Arc<str>) -> Arc<str> {
        if let Some(t) = self.collections.get(collection) {
            return t.clone();
        }
        let topic: Arc<str> = sanitize(&self.documents.replace("{collection}", collection)).into();
        self.collections.insert(collection.clone(), topic.clone());
        topic
    }
}

/// Replaces every character Kafka refuses in a topic name with `_`.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The messages of `ops`, in order; `processed_ms` is the envelopes' `ts_ms`.
pub(super) fn messages(
    topics: &mut Topics,
    ops: &[TopicOp<'_>],
    processed_ms: i64,
) -> Result<Vec<Message>, Unsendable> {
    let mut out = Vec::with_capacity(ops.len() + ops.len() / 8);
    for op in ops {
        match op {
            TopicOp::Change(event) => change(topics, event, processed_ms, &mut out)?,
            TopicOp::Document(op) => document(topics, op, &mut out)?,
        }
    }
    Ok(out)
}

/// The messages of one change event.
fn change(
    topics: &mut Topics,
    event: &ChangeEvent,
    processed_ms: i64,
    out: &mut Vec<Message>,
) -> Result<(), Unsendable> {
    if let Some((delete, create)) = key_move(event) {
        change(topics, &delete, processed_ms, out)?;
        return change(topics, &create, processed_ms, out);
    }
    let topic = topics.table(&event.table);
    let key = match encode_key(event) {
        None => None,
        Some(Ok(key)) => Some(key),
        Some(Err(column)) => {
            return Err(Unsendable(format!(
                "table `{}`: key column `{column}` is missing or null in the row, so the \
                 change has no Kafka key",
                event.table
            )));
        }
    };
    let mut value = Vec::with_capacity(256);
    encode_value(event, processed_ms, &mut value);
    let tombstone = (event.op == Op::Delete)
        .then(|| key.clone())
        .flatten()
        .map(|key| Message {
            topic: topic.clone(),
            key: Some(key),
            value: None,
        });
    out.push(Message {
        topic,
        key,
        value: Some(value),
    });
    out.extend(tombstone);
    Ok(())
}

/// An update whose before image carries a different key than its after image: the delete of
/// the old key and the create of the new one it stands for. Only for key columns of the row
/// (a record key image names the new key only).
fn key_move(event: &ChangeEvent) -> Option<(ChangeEvent, ChangeEvent)> {
    if event.op != Op::Update || event.key.is_some() {
        return None;
    }
    let mut delete = event.clone();
    delete.op = Op::Delete;
    delete.after = None;
    let old = key_row(&delete)?.ok()?;
    let new = key_row(event)?.ok()?;
    if old == new {
        return None;
    }
    let mut create = event.clone();
    create.op = Op::Create;
    create.before = None;
    Some((delete, create))
}

/// The message of one document operation.
fn document(
    topics: &mut Topics,
    op: &DocumentOp,
    out: &mut Vec<Message>,
) -> Result<(), Unsendable> {
    match op {
        DocumentOp::Upsert {
            collection,
            key,
            doc,
            ..
        } => out.push(Message {
            topic: topics.collection(collection),
            key: Some(key.as_bytes().to_vec()),
            value: Some(serde_json::to_vec(&**doc).unwrap_or_default()),
        }),
        DocumentOp::Delete {
            collection, key, ..
        } => out.push(Message {
            topic: topics.collection(collection),
            key: Some(key.as_bytes().to_vec()),
            value: None,
        }),
        DocumentOp::Truncate { collection, .. } => {
            return Err(Unsendable(format!(
                "cannot truncate collection `{collection}` (topic `{}`): a producer cannot empty \
                 a compacted topic; delete and recreate the topic, then backfill (see \
                 docs/sinks/kafka.md)",
                topics.collection(collection)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use refract_schemas::debezium::DebeziumDecoder;
    use refract_schemas::{Offset, Position, Record, Row};
    use serde_json::{Value, json};

    use super::*;

    fn position() -> Position {
        Position {
            partition: "p".into(),
            offset: Offset(1, 0),
        }
    }

    fn event(op: Op, before: Option<Value>, after: Option<Value>) -> ChangeEvent {
        let row = |v: Value| Arc::new(serde_json::from_value::<Row>(v).unwrap());
        ChangeEvent {
            table: TableId::new("public", "order items"),
            op,
            key: None,
            key_columns: Some(Arc::from(vec!["id".to_owned()])),
            before: before.map(row),
            after: after.map(row),
            source: Default::default(),
            transaction: None,
            position: position(),
        }
    }

    /// Renders each message as `topic key op|tombstone`.
    fn render(ops: &[TopicOp<'_>]) -> Result<Vec<String>, Unsendable> {
        let mut topics = Topics::new("shop", "{topic_prefix}.docs.{collection}");
        let out = messages(&mut topics, ops, 0)?;
        Ok(out
            .iter()
            .map(|m| {
                let key = m
                    .key
                    .as_deref()
                    .map_or("-".into(), |k| String::from_utf8_lossy(k).into_owned());
                let what = match &m.value {
                    None => "tombstone".to_owned(),
                    Some(v) => match serde_json::from_slice::<Value>(v).unwrap().get("op") {
                        Some(op) => op.as_str().unwrap().to_owned(),
                        None => "doc".to_owned(),
                    },
                };
                format!("{} {key} {what}", m.topic)
            })
            .collect())
    }

    #[test]
    fn each_operation_becomes_its_messages() {
        let t = "shop.public.order_items";
        let create = event(Op::Create, None, Some(json!({"id": 1})));
        let update = event(
            Op::Update,
            Some(json!({"id": 1})),
            Some(json!({"id": 1, "n": 2})),
        );
        let moved = event(Op::Update, Some(json!({"id": 1})), Some(json!({"id": 2})));
        let partial_before = event(Op::Update, Some(json!({"n": 1})), Some(json!({"id": 2})));
        let delete = event(Op::Delete, Some(json!({"id": 1})), None);
        let truncate = event(Op::Truncate, None, None);
        let keyless = {
            let mut e = event(Op::Delete, Some(json!({"id": 1})), None);
            e.key_columns = None;
            e
        };
        let upsert = DocumentOp::Upsert {
            collection: "books".into(),
            key: "b1".into(),
            doc: Arc::new(serde_json::from_value(json!({"title": "T"})).unwrap()),
            position: position(),
        };
        let doc_delete = DocumentOp::Delete {
            collection: "books".into(),
            key: "b1".into(),
            position: position(),
        };
        let cases: Vec<(&str, Vec<TopicOp<'_>>, Vec<String>)> = vec![
            (
                "create",
                vec![TopicOp::Change(&create)],
                vec![format!(r#"{t} {{"id":1}} c"#)],
            ),
            (
                "update",
                vec![TopicOp::Change(&update)],
                vec![format!(r#"{t} {{"id":1}} u"#)],
            ),
            (
                "key move",
                vec![TopicOp::Change(&moved)],
                vec![
                    format!(r#"{t} {{"id":1}} d"#),
                    format!(r#"{t} {{"id":1}} tombstone"#),
                    format!(r#"{t} {{"id":2}} c"#),
                ],
            ),
            (
                "before image without the key",
                vec![TopicOp::Change(&partial_before)],
                vec![format!(r#"{t} {{"id":2}} u"#)],
            ),
            (
                "delete and its tombstone",
                vec![TopicOp::Change(&delete)],
                vec![
                    format!(r#"{t} {{"id":1}} d"#),
                    format!(r#"{t} {{"id":1}} tombstone"#),
                ],
            ),
            (
                "truncate",
                vec![TopicOp::Change(&truncate)],
                vec![format!("{t} - t")],
            ),
            (
                "keyless delete",
                vec![TopicOp::Change(&keyless)],
                vec![format!("{t} - d")],
            ),
            (
                "documents",
                vec![TopicOp::Document(&upsert), TopicOp::Document(&doc_delete)],
                vec![
                    "shop.docs.books b1 doc".into(),
                    "shop.docs.books b1 tombstone".into(),
                ],
            ),
        ];
        for (name, ops, want) in cases {
            assert_eq!(render(&ops).unwrap(), want, "{name}");
        }
    }

    #[test]
    fn a_moved_key_reads_back_as_delete_then_create() {
        let moved = event(Op::Update, Some(json!({"id": 1})), Some(json!({"id": 2})));
        let mut topics = Topics::new("shop", "{collection}");
        let out = messages(&mut topics, &[TopicOp::Change(&moved)], 0).unwrap();
        let decode = |m: &Message| match DebeziumDecoder::new()
            .decode(m.value.as_deref().unwrap(), position())
            .unwrap()
        {
            Record::Change(e) => e,
            r => panic!("{r:?}"),
        };
        let (delete, create) = (decode(&out[0]), decode(&out[2]));
        assert_eq!(
            (delete.op, delete.before, delete.after),
            (Op::Delete, moved.before.clone(), None)
        );
        assert_eq!(
            (create.op, create.before, create.after),
            (Op::Create, None, moved.after)
        );
    }

    #[test]
    fn refused_operations_say_why() {
        let truncate = DocumentOp::Truncate {
            collection: "books".into(),
            position: position(),
        };
        let error = render(&[TopicOp::Document(&truncate)]).unwrap_err();
        assert!(
            error.0.contains("cannot empty a compacted topic"),
            "{error:?}"
        );
        let nokey = event(Op::Create, None, Some(json!({"id": null})));
        let error = render(&[TopicOp::Change(&nokey)]).unwrap_err();
        assert!(error.0.contains("key column `id`"), "{error:?}");
    }
}
