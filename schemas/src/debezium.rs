//! Debezium JSON codec: decodes one record as Debezium's JsonConverter writes it, and encodes
//! change events the same way ([`encode`]).
//!
//! Accepted shapes, one JSON object per record:
//! - the bare envelope (`schemas.enable=false`): `{"before":…,"after":…,"op":"u","source":{…}}`;
//! - the wrapped envelope (`schemas.enable=true`): `{"schema":{…},"payload":{…envelope…}}`, whose
//!   schema's logical types are honoured (see [`logical`]);
//! - a key/value record as tools like kcat dump topics: `{"key":…,"value":…}`, where each side may
//!   itself be wrapped; a `null` value is a tombstone;
//! - Debezium's transaction metadata: `{"status":"BEGIN"|"END","id":"…","event_count":…}`.
//!
//! Every failure is a [`DecodeError`] carrying the record's position and a readable reason, so the
//! runtime can dead-letter it.

pub mod encode;
mod key;
pub mod logical;

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::event::{
    ChangeEvent, KafkaCoordinates, Op, Position, Record, Row, SourceInfo, TableId, TxBoundary,
    TxInfo, TxStatus,
};
use crate::row::Text;
use logical::EnvelopeSchema;

/// How many distinct envelope schemas a decoder remembers; wrapped records repeat a handful of
/// schemas (one per table and version), so a small cache avoids re-reading them on every line.
const SCHEMA_CACHE_CAPACITY: usize = 256;

/// A record that could not be decoded: where it was and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("cannot decode record at {position}: {reason}")]
pub struct DecodeError {
    /// The position of the undecodable record.
    pub position: Position,
    /// Why it could not be decoded, in a sentence.
    pub reason: String,
}

/// A reusable decoder; it caches the envelope schemas of wrapped records.
#[derive(Default)]
pub struct DebeziumDecoder {
    schemas: HashMap<Box<str>, Arc<EnvelopeSchema>>,
    names: Interner,
    /// simd-json parses in place: each record is copied here first, followed by the padding
    /// its vector loads read past the end (so simd-json does not copy it once more).
    scratch: Vec<u8>,
    buffers: Option<simd_json::Buffers>,
    /// simd-json's tape of the record parsed last, emptied: its allocation serves the next one.
    tape: Option<simd_json::Tape<'static>>,
    keys: key::SimpleKeys,
}

/// Shares the strings every event of a table repeats (schema, table, connector, db), so an event
/// costs no allocation for them.
#[derive(Default)]
pub(crate) struct Interner {
    strings: HashMap<Box<str>, Arc<str>>,
    tables: HashMap<(Arc<str>, Arc<str>), TableId>,
    /// The last table returned: consecutive events of one table skip the hashing.
    last_table: Option<TableId>,
    /// The names looked up last.
    recent: Vec<Arc<str>>,
}

/// Names kept in [`Interner::recent`].
const RECENT_NAMES: usize = 4;

/// Distinct names kept by an interner before it starts over (a guard against unbounded growth
/// from hostile input).
const INTERNER_CAPACITY: usize = 4096;

impl Interner {
    pub(crate) fn string(&mut self, s: &str) -> Arc<str> {
        // A few names (connector, database, schema) repeat on every event: a short scan of the
        // recent ones is cheaper than hashing.
        if let Some(a) = self.recent.iter().find(|a| ***a == *s) {
            return a.clone();
        }
        if let Some(a) = self.strings.get(s) {
            let a = a.clone();
            self.remember(&a);
            return a;
        }
        if self.strings.len() >= INTERNER_CAPACITY {
            self.strings.clear();
            self.tables.clear();
            self.recent.clear();
            self.last_table = None;
        }
        let a: Arc<str> = s.into();
        self.strings.insert(s.into(), a.clone());
        self.remember(&a);
        a
    }

    fn remember(&mut self, a: &Arc<str>) {
        if self.recent.len() == RECENT_NAMES {
            self.recent.remove(0);
        }
        self.recent.push(a.clone());
    }

    pub(crate) fn table(&mut self, schema: &str, name: &str) -> TableId {
        if let Some(t) = &self.last_table {
            if *t.schema == *schema && *t.name == *name {
                return t.clone();
            }
        }
        let key = (self.string(schema), self.string(name));
        if let Some(t) = self.tables.get(&key) {
            let t = t.clone();
            self.last_table = Some(t.clone());
            return t;
        }
        let t = TableId {
            schema: key.0.clone(),
            name: key.1.clone(),
        };
        self.tables.insert(key, t.clone());
        self.last_table = Some(t.clone());
        t
    }
}

/// The outer JSON object of the wrapped and key/value shapes (the slower, general path).
#[derive(Deserialize)]
struct RawRecord<'a> {
    #[serde(borrow, default)]
    schema: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    payload: Option<Option<&'a RawValue>>,
    #[serde(borrow, default)]
    key: Option<&'a RawValue>,
    #[serde(borrow, default, deserialize_with = "present")]
    value: Option<Option<&'a RawValue>>,
    #[serde(borrow, flatten)]
    envelope: Envelope<'a>,
}

/// The envelope fields (and transaction-marker fields); absent fields stay `None`. The bare
/// shape is parsed straight into this flat struct by simd-json; the `wrapped` flags tell when a
/// record needs the general path instead.
#[derive(Deserialize, Default)]
pub(crate) struct Envelope<'a> {
    #[serde(default)]
    before: Option<Row>,
    #[serde(default)]
    after: Option<Row>,
    #[serde(borrow, default)]
    op: Option<Text<'a>>,
    #[serde(borrow, default)]
    source: Option<RawSource<'a>>,
    #[serde(default)]
    transaction: Option<RawTx>,
    // Transaction metadata records.
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    event_count: Option<u64>,
    #[serde(default)]
    ts_ms: Option<i64>,
    // Present only in the wrapped and key/value shapes.
    #[serde(default, rename = "schema", deserialize_with = "present_any")]
    has_schema: bool,
    #[serde(default, rename = "payload", deserialize_with = "present_any")]
    has_payload: bool,
    #[serde(default, rename = "key", deserialize_with = "present_any")]
    has_key: bool,
    #[serde(default, rename = "value", deserialize_with = "present_any")]
    has_value: bool,
}

impl Envelope<'_> {
    fn is_bare(&self) -> bool {
        !(self.has_schema || self.has_payload || self.has_key || self.has_value)
    }
}

fn present_any<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    serde::de::IgnoredAny::deserialize(d)?;
    Ok(true)
}

#[derive(Deserialize, Default)]
struct RawSource<'a> {
    #[serde(borrow, default)]
    connector: Option<Text<'a>>,
    #[serde(borrow, default)]
    db: Option<Text<'a>>,
    #[serde(borrow, default)]
    schema: Option<Text<'a>>,
    #[serde(borrow, default)]
    table: Option<Text<'a>>,
    #[serde(default)]
    lsn: Option<u64>,
    #[serde(default, rename = "txId")]
    tx_id: Option<i64>,
    #[serde(default)]
    ts_ms: Option<i64>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    partition: Option<i32>,
    #[serde(default)]
    offset: Option<i64>,
}

#[derive(Deserialize)]
struct RawTx {
    id: Value,
    #[serde(default)]
    total_order: Option<u64>,
    #[serde(default)]
    data_collection_order: Option<u64>,
}

/// Distinguishes a field that is present but `null` (`Some(None)`) from one that is absent.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Some(Option::deserialize(d)?))
}

impl DebeziumDecoder {
    /// A decoder with an empty schema cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes one record (one line of a change log, or one Kafka value).
    pub fn decode(&mut self, bytes: &[u8], position: Position) -> Result<Record, DecodeError> {
        let fail = |reason: String| DecodeError {
            position: position.clone(),
            reason,
        };
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            let reason = match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
                Err(e) => json_reason(&e),
                Ok(_) => "unexpected record shape: expected a JSON object".to_owned(),
            };
            return Err(fail(reason));
        }
        // Fast path: the bare envelope, parsed by simd-json. Anything else, including every
        // error, takes the general serde_json path, which also words the errors.
        let Self {
            scratch,
            buffers,
            tape: spare,
            names,
            ..
        } = self;
        scratch.clear();
        scratch.extend_from_slice(bytes);
        scratch.resize(bytes.len() + simd_json::INPUT_PADDING, b' ');
        let buffers = buffers.get_or_insert_with(|| simd_json::Buffers::new(bytes.len()));
        let mut tape = spare.take().unwrap_or_else(simd_json::Tape::null).reset();
        let built = match simd_json::fill_tape_padded(scratch, bytes.len(), buffers, &mut tape) {
            Ok(()) => {
                let mut de = simd_json::Deserializer::from_tape(tape);
                let built = match Envelope::deserialize(&mut de) {
                    Ok(envelope) if envelope.is_bare() => {
                        Some(build(envelope, None, &position, names))
                    }
                    _ => None,
                };
                *spare = Some(de.into_tape().reset());
                built
            }
            Err(_) => None,
        };
        if let Some(built) = built {
            return built.map_err(fail);
        }
        let raw: RawRecord<'_> =
            serde_json::from_slice(bytes).map_err(|e| fail(json_reason(&e)))?;
        self.decode_record(raw, &position).map_err(fail)
    }

    fn decode_record(&mut self, raw: RawRecord<'_>, position: &Position) -> Result<Record, String> {
        // Key/value record: decode the key (if any) and the value separately.
        if let Some(value) = raw.value {
            let key = match raw.key {
                Some(k) => self.decode_key(k)?,
                None => None,
            };
            let Some(value) = value else {
                return Ok(Record::Tombstone(position.clone()));
            };
            let inner: RawRecord<'_> = parse_borrowed(value.get(), "`value`")?;
            let mut record = self.decode_record(inner, position)?;
            if let (Record::Change(event), Some(key)) = (&mut record, key) {
                event.key = Some(Arc::new(key));
            }
            return Ok(record);
        }
        // Wrapped envelope.
        if let Some(payload) = raw.payload {
            let Some(payload) = payload else {
                return Ok(Record::Tombstone(position.clone()));
            };
            let schema = match raw.schema {
                Some(s) => Some(self.schema(s)?),
                None => None,
            };
            let envelope: Envelope<'_> = parse_borrowed(payload.get(), "`payload`")?;
            return build(envelope, schema.as_deref(), position, &mut self.names);
        }
        build(raw.envelope, None, position, &mut self.names)
    }

    /// Decodes a record key (a Kafka message key): a JSON object of the key columns, bare or
    /// wrapped with its schema (whose logical types are honoured); `None` for a JSON `null`.
    pub fn decode_key_bytes(&mut self, bytes: &[u8]) -> Result<Option<Row>, String> {
        if let Some(row) = self.keys.row(bytes) {
            return Ok(Some(row));
        }
        let raw: &RawValue = serde_json::from_slice(bytes).map_err(|e| json_reason(&e))?;
        self.decode_key(raw)
    }

    fn decode_key(&mut self, key: &RawValue) -> Result<Option<Row>, String> {
        let value: Value = parse(key.get(), "`key`")?;
        let Value::Object(mut obj) = value else {
            return match value {
                Value::Null => Ok(None),
                _ => Err("`key` is not a JSON object".into()),
            };
        };
        // A wrapped key: {"schema":…,"payload":{…}}.
        if obj.len() == 2 && obj.contains_key("schema") && obj.contains_key("payload") {
            let schema = obj.remove("schema").unwrap_or(Value::Null);
            let payload = obj.remove("payload").unwrap_or(Value::Null);
            let Value::Object(row) = payload else {
                return Ok(None);
            };
            let mut row = Row::from(row);
            let converter =
                logical::RowSchema::compile(&schema).map_err(|e| format!("key schema: {e}"))?;
            converter
                .convert(&mut row)
                .map_err(|e| format!("key: {e}"))?;
            return Ok(Some(row));
        }
        Ok(Some(obj.into()))
    }

    fn schema(&mut self, raw: &RawValue) -> Result<Arc<EnvelopeSchema>, String> {
        if let Some(s) = self.schemas.get(raw.get()) {
            return Ok(s.clone());
        }
        let value: Value = parse(raw.get(), "`schema`")?;
        let compiled = Arc::new(EnvelopeSchema::compile(&value)?);
        if self.schemas.len() >= SCHEMA_CACHE_CAPACITY {
            self.schemas.clear();
        }
        self.schemas.insert(raw.get().into(), compiled.clone());
        Ok(compiled)
    }
}

fn parse<T: DeserializeOwned>(text: &str, what: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|e| format!("{what}: {}", json_reason(&e)))
}

fn parse_borrowed<'a, T: Deserialize<'a>>(text: &'a str, what: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|e| format!("{what}: {}", json_reason(&e)))
}

/// Turns a serde_json error into a sentence that says whether the record was cut short.
pub(crate) fn json_reason(e: &serde_json::Error) -> String {
    if e.is_eof() {
        format!("truncated JSON (input ends early): {e}")
    } else if e.is_syntax() {
        format!("invalid JSON: {e}")
    } else {
        format!("unexpected record shape: {e}")
    }
}

/// Builds a [`Record`] from envelope fields, converting logical types when a schema is known.
pub(crate) fn build(
    env: Envelope<'_>,
    schema: Option<&EnvelopeSchema>,
    position: &Position,
    names: &mut Interner,
) -> Result<Record, String> {
    let Some(op_code) = env.op else {
        return transaction_marker(env.status, env.id, env.event_count, env.ts_ms, position);
    };
    let op_code: &str = &op_code;
    let op = Op::from_code(op_code)
        .ok_or_else(|| format!("unknown op `{op_code}` (expected one of c, u, d, r, t)"))?;
    let source = env.source.ok_or("missing `source` block")?;
    let Some(table) = source.table.as_deref() else {
        return Err("missing `source.table`".into());
    };
    let schema_name = source
        .schema
        .as_deref()
        .or(source.db.as_deref())
        .unwrap_or_default();
    let table = names.table(schema_name, table);

    let mut before = env.before;
    let mut after = env.after;
    if let Some(schema) = schema {
        if let (Some(row), Some(conv)) = (before.as_mut(), schema.before.as_ref()) {
            conv.convert(row).map_err(|e| format!("`before`: {e}"))?;
        }
        if let (Some(row), Some(conv)) = (after.as_mut(), schema.after.as_ref()) {
            conv.convert(row).map_err(|e| format!("`after`: {e}"))?;
        }
    }
    match op {
        Op::Create | Op::Read | Op::Update if after.is_none() => {
            return Err(format!("op `{op_code}` without an `after` image"));
        }
        Op::Delete if before.is_none() => {
            return Err("op `d` without a `before` image".into());
        }
        _ => {}
    }
    let transaction = match env.transaction {
        Some(tx) => Some(TxInfo {
            id: id_string(tx.id).ok_or("`transaction.id` is not a string or number")?,
            total_order: tx.total_order,
            data_collection_order: tx.data_collection_order,
        }),
        None => None,
    };
    let kafka = match (source.topic.clone(), source.partition, source.offset) {
        (Some(topic), Some(partition), Some(offset)) => Some(KafkaCoordinates {
            topic,
            partition,
            offset,
        }),
        _ => None,
    };
    Ok(Record::Change(ChangeEvent {
        table,
        op,
        key: None,
        key_columns: None,
        before: before.map(Arc::new),
        after: after.map(Arc::new),
        source: SourceInfo {
            connector: source.connector.map(|c| names.string(&c)),
            db: source.db.map(|d| names.string(&d)),
            ts_ms: source.ts_ms.or(env.ts_ms),
            tx_id: source.tx_id,
            lsn: source.lsn,
            kafka,
        },
        transaction,
        position: position.clone(),
    }))
}

fn transaction_marker(
    status: Option<String>,
    id: Option<Value>,
    event_count: Option<u64>,
    ts_ms: Option<i64>,
    position: &Position,
) -> Result<Record, String> {
    let status = match status.as_deref() {
        Some("BEGIN") => TxStatus::Begin,
        Some("END") => TxStatus::End,
        Some(other) => {
            return Err(format!(
                "unknown transaction status `{other}` (expected BEGIN or END)"
            ));
        }
        None => return Err("missing `op` (not a change event nor a transaction marker)".into()),
    };
    let id = id
        .and_then(id_string)
        .ok_or("transaction marker without a string `id`")?;
    Ok(Record::Transaction(TxBoundary {
        status,
        id,
        event_count,
        ts_ms,
        position: position.clone(),
    }))
}

fn id_string(v: Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
