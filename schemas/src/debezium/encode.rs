//! Debezium JSON encoder: a [`ChangeEvent`] as Debezium's JsonConverter writes it with
//! `schemas.enable=false` (the bare payload, no `schema` half), and its record key.
//!
//! The value is the envelope `{"before":…,"after":…,"source":{…},"transaction":{…}|null,
//! "op":"c","ts_ms":…}`; `source` holds what the event knows of Debezium's PostgreSQL source
//! block (`connector`, `db`, `schema`, `table`, `txId`, `lsn`, `ts_ms`) plus `topic`,
//! `partition`, `offset` for an event read from Kafka. The key is a JSON object of the key
//! columns (`{"id":7}`), as Debezium keys a table with a primary key. [`super::DebeziumDecoder`]
//! reads both back into the same event (a `{"key":…,"value":…}` record carries the key).

use serde::Serialize;
use serde::ser::SerializeMap;

use crate::event::{ChangeEvent, Op, Row, TxInfo};

/// The envelope of `event`, as JSON bytes appended to `out`. `processed_ms` is Debezium's
/// top-level `ts_ms`: when the event was relayed (milliseconds since the epoch).
pub fn encode_value(event: &ChangeEvent, processed_ms: i64, out: &mut Vec<u8>) {
    let envelope = Envelope {
        event,
        processed_ms,
    };
    // Serializing maps of JSON values into a Vec cannot fail.
    let _ = serde_json::to_writer(out, &envelope);
}

/// The record key of `event` as a JSON object of its key columns: the key image when the event
/// has one, else the key columns of its row image (`before` for a delete, `after` otherwise).
/// `None` when the event names no key (a table without a primary key, a truncate);
/// `Some(Err(column))` when the row lacks a key column or holds null in it.
pub fn encode_key(event: &ChangeEvent) -> Option<Result<Vec<u8>, String>> {
    if event.op == Op::Truncate {
        return None;
    }
    let row = key_row(event)?;
    Some(row.map(|row| serde_json::to_vec(&row).unwrap_or_default()))
}

/// The key columns and their values (see [`encode_key`]).
pub fn key_row(event: &ChangeEvent) -> Option<Result<Row, String>> {
    if let Some(key) = event.key.as_deref().filter(|k| !k.is_empty()) {
        return Some(Ok(key.clone()));
    }
    let image = match event.op {
        Op::Delete => event.before.as_deref(),
        _ => event.after.as_deref(),
    }?;
    let columns = event.key_columns.as_deref().filter(|c| !c.is_empty())?;
    let mut row = Row::new();
    for column in columns {
        match image.get(column) {
            Some(v) if !v.is_null() => {
                row.insert(column.clone(), v.clone());
            }
            _ => return Some(Err(column.clone())),
        }
    }
    Some(Ok(row))
}

/// Serializes the envelope without building an intermediate JSON tree.
struct Envelope<'a> {
    event: &'a ChangeEvent,
    processed_ms: i64,
}

impl Serialize for Envelope<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let e = self.event;
        let mut map = s.serialize_map(Some(6))?;
        map.serialize_entry("before", &e.before.as_deref())?;
        map.serialize_entry("after", &e.after.as_deref())?;
        map.serialize_entry("source", &Source(e))?;
        map.serialize_entry("transaction", &e.transaction.as_ref().map(Transaction))?;
        map.serialize_entry("op", e.op.code())?;
        map.serialize_entry("ts_ms", &self.processed_ms)?;
        map.end()
    }
}

/// Debezium's `source` block.
struct Source<'a>(&'a ChangeEvent);

impl Serialize for Source<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let e = self.0;
        let info = &e.source;
        let mut map = s.serialize_map(None)?;
        if let Some(connector) = &info.connector {
            map.serialize_entry("connector", &**connector)?;
        }
        if let Some(ts_ms) = info.ts_ms {
            map.serialize_entry("ts_ms", &ts_ms)?;
        }
        if let Some(db) = &info.db {
            map.serialize_entry("db", &**db)?;
        }
        map.serialize_entry("schema", &*e.table.schema)?;
        map.serialize_entry("table", &*e.table.name)?;
        if let Some(tx_id) = info.tx_id {
            map.serialize_entry("txId", &tx_id)?;
        }
        if let Some(lsn) = info.lsn {
            map.serialize_entry("lsn", &lsn)?;
        }
        if let Some(kafka) = &info.kafka {
            map.serialize_entry("topic", &kafka.topic)?;
            map.serialize_entry("partition", &kafka.partition)?;
            map.serialize_entry("offset", &kafka.offset)?;
        }
        map.end()
    }
}

/// Debezium's per-event `transaction` block.
struct Transaction<'a>(&'a TxInfo);

impl Serialize for Transaction<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let tx = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("id", &tx.id)?;
        map.serialize_entry("total_order", &tx.total_order)?;
        map.serialize_entry("data_collection_order", &tx.data_collection_order)?;
        map.end()
    }
}

#[cfg(test)]
mod tests;
