//! Debezium change events as Debezium's AvroConverter writes them to Kafka: Confluent framing,
//! Avro bodies, Kafka Connect logical types.
//!
//! A Kafka record's key and value are each framed as Confluent's serializers frame them
//! ([`confluent_frame`]): one magic byte `0`, the schema id as 4 big-endian bytes, then the Avro
//! binary body written with that schema. The schemas come from a schema registry (the client is
//! in `refract-connectors`); this module does no IO.
//!
//! [`AvroDecoder`] turns a key and value into the same [`Record`] the JSON codec
//! ([`crate::debezium::DebeziumDecoder`]) builds from the same change written by JsonConverter
//! with `schemas.enable=true`: each Avro body is read into the JSON value JsonConverter would have
//! written as its `payload`, each Avro schema into the Connect schema JsonConverter would have
//! written as its `schema`, and from there the JSON codec's own envelope reader and logical-type
//! conversions ([`crate::debezium::logical`]) run, so the two formats cannot drift apart.
//! Where a schema allows it (every type but `uuid` and big-decimal), a body is read straight
//! into the envelope, in one pass, without the JSON in between ([`direct`]); its tests hold it
//! to the JSON path value for value.
//!
//! Debezium names its Connect types (`io.debezium.time.MicroTimestamp`, …) in the `connect.name`
//! attribute of the Avro type. apache-avro drops the attributes of primitive types when it parses
//! a schema, so schemas must be parsed with [`parse_schema`], which copies each field type's
//! `connect.name` and `connect.parameters` onto the field (where apache-avro keeps them). Avro's
//! own logical types (`decimal`, `date`, `time-*`, `timestamp-*`) are understood without it.
//!
//! [`connect_to_avro`] goes the other way, as the AvroConverter does: a JsonConverter record's
//! `schema` and `payload` halves into an Avro schema and value, which [`encode_confluent`] frames.

mod connect;
mod direct;
mod json;

use std::collections::HashMap;
use std::sync::Arc;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::reader::single_object::GenericSingleObjectReader;
use apache_avro::types::Value as AvroValue;
use apache_avro::writer::datum::GenericDatumWriter;
use serde::Deserialize;
use serde_json::Value;

use crate::debezium::logical::{EnvelopeSchema, RowSchema};
use crate::debezium::{DecodeError, Envelope, Interner, build, json_reason};
use crate::event::{ChangeEvent, Op, Position, Record, Row, SourceInfo, TableId};

pub use connect::connect_to_avro;
pub use json::{connect_schema, parse_schema, to_json};

/// The first byte of every Confluent-framed message (the wire format's version).
pub const CONFLUENT_MAGIC: u8 = 0;

/// Length of the Confluent frame header: magic byte and 4-byte schema id.
pub const CONFLUENT_HEADER_LEN: usize = 5;

/// How many compiled schemas (keys and values, by id) a decoder keeps: a topic's schemas change
/// with its tables' versions only, so a few hundred cover every realistic deployment; past that
/// the cache starts over (a guard against unbounded growth).
const SCHEMA_CACHE_CAPACITY: usize = 1024;

/// Splits a Confluent-framed message into its schema id and Avro body.
///
/// Fails, saying why, when the message is shorter than the 5-byte header or its first byte is
/// not the magic byte `0` (a message written without a schema registry, or by another
/// serializer).
pub fn confluent_frame(bytes: &[u8]) -> Result<(u32, &[u8]), String> {
    if bytes.len() < CONFLUENT_HEADER_LEN {
        return Err(format!(
            "message of {} bytes is shorter than the {CONFLUENT_HEADER_LEN}-byte Confluent header \
             (magic byte and schema id)",
            bytes.len()
        ));
    }
    if bytes[0] != CONFLUENT_MAGIC {
        return Err(format!(
            "first byte is {:#04x}, not the Confluent magic byte 0x00: the message was not written \
             by a schema-registry Avro serializer",
            bytes[0]
        ));
    }
    let id = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    Ok((id, &bytes[CONFLUENT_HEADER_LEN..]))
}

/// Writes `value` with `schema` as a Confluent-framed message: magic byte, `id` big-endian, Avro
/// binary body. Fails when the value does not match the schema.
pub fn encode_confluent(id: u32, schema: &Schema, value: AvroValue) -> Result<Vec<u8>, String> {
    let writer = GenericDatumWriter::builder(schema)
        .build()
        .map_err(|e| format!("schema cannot be written with: {e}"))?;
    let mut out = Vec::with_capacity(64);
    out.push(CONFLUENT_MAGIC);
    out.extend_from_slice(&id.to_be_bytes());
    writer
        .write_value(&mut out, value)
        .map_err(|e| format!("value does not match the schema: {e}"))?;
    Ok(out)
}

/// Reads one Avro binary body written with `schema`; the whole body must be consumed.
pub fn read_body(schema: &Schema, body: &[u8]) -> Result<AvroValue, String> {
    let reader = GenericDatumReader::builder(schema)
        .build()
        .map_err(|e| format!("schema cannot be read with: {e}"))?;
    let mut rest = body;
    let value = reader
        .read_value(&mut rest)
        .map_err(|e| format!("corrupt Avro body: {e}"))?;
    whole_body(rest, body)?;
    Ok(value)
}

/// Fails when a value read from `body` left `rest` of it unread.
fn whole_body(rest: &[u8], body: &[u8]) -> Result<(), String> {
    if !rest.is_empty() {
        return Err(format!(
            "corrupt Avro body: {} bytes left over after the value (of {})",
            rest.len(),
            body.len()
        ));
    }
    Ok(())
}

/// A writer schema made ready to read bodies with: [`read_body`] resolves the schema's named
/// types (a Debezium envelope's row, source and transaction records) again for every body.
struct BodyReader(GenericSingleObjectReader);

impl BodyReader {
    fn new(schema: &Schema) -> Result<Self, String> {
        // apache-avro keeps a schema resolved once only in its single-object reader; an empty
        // header makes it read bare bodies, as Confluent framing leaves them.
        GenericSingleObjectReader::builder()
            .schema(schema.clone())
            .header(Vec::new())
            .build()
            .map(Self)
            .map_err(|e| format!("schema cannot be read with: {e}"))
    }

    /// As [`read_body`].
    fn read(&self, body: &[u8]) -> Result<AvroValue, String> {
        let mut rest = body;
        let value = self
            .0
            .read_value(&mut rest)
            .map_err(|e| format!("corrupt Avro body: {e}"))?;
        whole_body(rest, body)?;
        Ok(value)
    }
}

/// What a decoder keeps of one schema id: its readers and its logical-type converter.
struct Compiled<C> {
    /// The general path: apache-avro's value tree, then JSON.
    reader: BodyReader,
    /// The direct path, for every schema it can read (see [`direct`]).
    plan: Option<direct::Plan>,
    converter: C,
}

impl<C> Compiled<C> {
    fn new(schema: &Schema, converter: C) -> Result<Self, String> {
        Ok(Self {
            reader: BodyReader::new(schema)?,
            plan: direct::Plan::new(schema),
            converter,
        })
    }

    /// A body as the JSON value JsonConverter would have written.
    fn json(&self, body: &[u8]) -> Result<Value, String> {
        match &self.plan {
            Some(plan) => plan.read(body),
            None => Ok(to_json(self.reader.read(body)?)),
        }
    }
}

/// A reusable decoder of Debezium Avro records; it caches, by schema id, the readers and the
/// logical-type converters compiled from each key and value schema.
#[derive(Default)]
pub struct AvroDecoder {
    values: HashMap<u32, Arc<Compiled<EnvelopeSchema>>>,
    keys: HashMap<u32, Arc<Compiled<RowSchema>>>,
    names: Interner,
}

impl AvroDecoder {
    /// A decoder with empty caches.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes one Kafka record: its key and value, each as `(schema id, writer schema, body)`
    /// where the body is the bytes after the 5-byte Confluent frame and the schema was parsed
    /// with [`parse_schema`] (the schema registry client does). A schema id must always name
    /// the same schema: compiled converters are cached by id.
    ///
    /// - A value (a Debezium envelope, or a transaction marker) gives what
    ///   [`crate::debezium::DebeziumDecoder::decode`] gives for the same record written by
    ///   JsonConverter with `schemas.enable=true`; a key record sets [`ChangeEvent::key`].
    /// - A tombstone (no value, a key) gives a [`Record::Change`] with [`Op::Delete`], the key,
    ///   no images, no source details, and the table `table_for_tombstone` names (typically from
    ///   the topic); without a key either it gives [`Record::Tombstone`].
    ///
    /// Every failure (corrupt body, a value that is not an envelope, an invalid logical value) is
    /// a [`DecodeError`] at `position` with a readable reason.
    pub fn decode(
        &mut self,
        key: Option<(u32, &Schema, &[u8])>,
        value: Option<(u32, &Schema, &[u8])>,
        table_for_tombstone: impl FnOnce() -> TableId,
        position: Position,
    ) -> Result<Record, DecodeError> {
        let fail = |reason: String| DecodeError {
            position: position.clone(),
            reason,
        };
        let key = match key {
            Some((id, schema, body)) => self.key(id, schema, body).map_err(fail)?,
            None => None,
        };
        let Some((id, schema, body)) = value else {
            let Some(key) = key else {
                return Ok(Record::Tombstone(position));
            };
            return Ok(Record::Change(ChangeEvent {
                table: table_for_tombstone(),
                op: Op::Delete,
                key: Some(Arc::new(key)),
                key_columns: None,
                before: None,
                after: None,
                source: SourceInfo::default(),
                transaction: None,
                position,
            }));
        };
        let mut record = self.value(id, schema, body, &position).map_err(fail)?;
        if let (Record::Change(event), Some(key)) = (&mut record, key) {
            event.key = Some(Arc::new(key));
        }
        Ok(record)
    }

    fn key(&mut self, id: u32, schema: &Schema, body: &[u8]) -> Result<Option<Row>, String> {
        let compiled = match self.keys.get(&id) {
            Some(c) => c.clone(),
            None => {
                let connect = connect_schema(schema).map_err(|e| format!("key schema: {e}"))?;
                let converter =
                    RowSchema::compile(&connect).map_err(|e| format!("key schema: {e}"))?;
                let compiled =
                    Arc::new(Compiled::new(schema, converter).map_err(|e| format!("key: {e}"))?);
                self.make_room();
                self.keys.insert(id, compiled.clone());
                compiled
            }
        };
        let mut row = match &compiled.plan {
            Some(plan) if plan.is_record() => plan.read(body).map_err(|e| format!("key: {e}"))?,
            _ => {
                let json = compiled.json(body).map_err(|e| format!("key: {e}"))?;
                // A key that is not a record (Debezium's are) gives no key image, as a
                // JsonConverter key with a schema does in the JSON codec.
                let Value::Object(map) = json else {
                    return Ok(None);
                };
                Row::from(map)
            }
        };
        compiled
            .converter
            .convert(&mut row)
            .map_err(|e| format!("key: {e}"))?;
        Ok(Some(row))
    }

    fn value(
        &mut self,
        id: u32,
        schema: &Schema,
        body: &[u8],
        position: &Position,
    ) -> Result<Record, String> {
        let compiled = match self.values.get(&id) {
            Some(c) => c.clone(),
            None => {
                let connect = connect_schema(schema).map_err(|e| format!("value schema: {e}"))?;
                let converter = EnvelopeSchema::compile(&connect)?;
                let compiled = Arc::new(Compiled::new(schema, converter)?);
                self.make_room();
                self.values.insert(id, compiled.clone());
                compiled
            }
        };
        let envelope: Envelope<'_> = match &compiled.plan {
            Some(plan) => plan.read(body)?,
            None => {
                let payload = to_json(compiled.reader.read(body)?);
                Envelope::deserialize(payload).map_err(|e| json_reason(&e))?
            }
        };
        build(
            envelope,
            Some(&compiled.converter),
            position,
            &mut self.names,
        )
    }

    fn make_room(&mut self) {
        if self.keys.len() + self.values.len() >= SCHEMA_CACHE_CAPACITY {
            self.keys.clear();
            self.values.clear();
        }
    }
}

#[cfg(test)]
mod tests;
