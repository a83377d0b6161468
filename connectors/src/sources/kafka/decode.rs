//! One Kafka message to one [`SourceItem`]: the record key becomes the event's key, a tombstone
//! (null value) that does not just follow the delete of its key is a delete of that key.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use refract_schemas::debezium::{DebeziumDecoder, DecodeError};
use refract_schemas::event::SourceInfo;
use refract_schemas::{ChangeEvent, Offset, Op, Position, Record, Row, TableId};

use crate::SourceItem;

/// The table a tombstone deletes from, read from its topic's name the way Debezium names
/// topics (`{prefix}.{schema}.{table}`): the last two dot-separated parts, or the whole name
/// as the table when it has no dot.
pub(crate) fn table_of_topic(topic: &str) -> TableId {
    let mut parts = topic.rsplitn(3, '.');
    match (parts.next(), parts.next()) {
        (Some(table), Some(schema)) => TableId::new(schema, table),
        _ => TableId::new("", topic),
    }
}

/// A message as the consumer hands it over.
pub(crate) struct Message<'a> {
    pub topic: &'a str,
    pub partition: &'a Arc<str>,
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    /// The bytes kept for the dead-letter store: the value, or the key of a tombstone.
    pub raw: Bytes,
}

impl Message<'_> {
    pub(crate) fn position(&self) -> Position {
        Position {
            partition: self.partition.clone(),
            offset: Offset(self.offset.max(0) as u64, 0),
        }
    }
}

/// What turns a message's value (and key) into a record.
pub(crate) trait ValueDecoder: Send {
    /// Decodes a non-null value, and the key when there is one.
    fn decode(&mut self, message: &Message<'_>) -> Result<Record, DecodeError>;

    /// Decodes a key alone (the key of a tombstone).
    fn key(&mut self, message: &Message<'_>, key: &[u8]) -> Result<Option<Row>, DecodeError>;
}

/// Debezium's JsonConverter, with or without schemas.
#[derive(Default)]
pub(crate) struct JsonValues {
    json: DebeziumDecoder,
}

impl ValueDecoder for JsonValues {
    fn decode(&mut self, message: &Message<'_>) -> Result<Record, DecodeError> {
        let value = message.value.unwrap_or_default();
        let mut record = self.json.decode(value, message.position())?;
        if let (Record::Change(event), Some(key)) = (&mut record, message.key) {
            if event.key.is_none() {
                event.key = self.key(message, key)?.map(Arc::new);
            }
        }
        Ok(record)
    }

    fn key(&mut self, message: &Message<'_>, key: &[u8]) -> Result<Option<Row>, DecodeError> {
        self.json
            .decode_key_bytes(key)
            .map_err(|reason| DecodeError {
                position: message.position(),
                reason: format!("record key: {reason}"),
            })
    }
}

/// Decodes messages, telling a tombstone that only follows a delete (Debezium writes both, for
/// log compaction) from one that deletes a key by itself (the delete was compacted away, or
/// the producer writes only tombstones).
pub(crate) struct MessageDecoder {
    values: Box<dyn ValueDecoder>,
    /// Per partition, the key of the delete read last, if the message read last was one.
    last_delete: HashMap<Arc<str>, Vec<u8>>,
}

impl MessageDecoder {
    pub(crate) fn new(values: Box<dyn ValueDecoder>) -> Self {
        Self {
            values,
            last_delete: HashMap::new(),
        }
    }

    pub(crate) fn decode(&mut self, message: &Message<'_>) -> SourceItem {
        let follows_delete = self.last_delete.remove(message.partition);
        let record = match message.value {
            Some(_) => self.values.decode(message),
            None => self.tombstone(message, follows_delete),
        };
        if let (Ok(Record::Change(e)), Some(key)) = (&record, message.key) {
            if e.op == Op::Delete {
                self.last_delete
                    .insert(message.partition.clone(), key.to_vec());
            }
        }
        SourceItem {
            record,
            raw: message.raw.clone(),
        }
    }

    fn tombstone(
        &mut self,
        message: &Message<'_>,
        follows_delete: Option<Vec<u8>>,
    ) -> Result<Record, DecodeError> {
        let Some(key_bytes) = message.key else {
            return Err(DecodeError {
                position: message.position(),
                reason: "a tombstone (null value) without a key: nothing to delete".into(),
            });
        };
        if follows_delete.as_deref() == Some(key_bytes) {
            return Ok(Record::Tombstone(message.position()));
        }
        let Some(key) = self.values.key(message, key_bytes)? else {
            return Err(DecodeError {
                position: message.position(),
                reason: "a tombstone whose key is null: nothing to delete".into(),
            });
        };
        let key = Arc::new(key);
        Ok(Record::Change(ChangeEvent {
            table: table_of_topic(message.topic),
            op: Op::Delete,
            key: Some(key.clone()),
            key_columns: None,
            // The key is all a tombstone says of the row, as a delete under the default
            // replica identity says only the key columns.
            before: Some(key),
            after: None,
            source: SourceInfo::default(),
            transaction: None,
            position: message.position(),
        }))
    }
}
