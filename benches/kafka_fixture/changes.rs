//! The topics' content: changes of the showcase `products` table
//! (../shared/showcase/products.sql), one copy of the table per tenant schema `t{k}` and so one
//! topic `{prefix}.t{k}.products` per tenant, as Debezium's PostgreSQL connector writes them,
//! keyed by `id`: 70% creates, 25% updates (full old and new rows: the table has REPLICA IDENTITY FULL),
//! 5% deletes, each delete followed by its tombstone, as Debezium does by default. Deterministic
//! for a given N. Two encodings of the same changes: JsonConverter without schemas (a bare
//! envelope of 400-600 bytes) and AvroConverter (Confluent-framed, schemas in a registry).

use apache_avro::Schema;
use apache_avro::schema::ResolvedSchema;
use apache_avro::types::Value as AvroValue;
use refract_schemas::avro::{connect_to_avro, encode_confluent};
use serde_json::{Value, json};

/// The Debezium server name (`topic.prefix`) in the envelopes' `source.name`.
const SERVER: &str = "dbserver1";

/// A message: key and value bytes; a tombstone has no value.
pub type Message = (Vec<u8>, Option<Vec<u8>>);

/// Counts of what [`changes`] generated.
#[derive(Default, Debug, Clone, Copy)]
pub struct Counts {
    pub creates: u64,
    pub updates: u64,
    pub deletes: u64,
    pub tombstones: u64,
}

impl Counts {
    pub fn add(&mut self, other: Counts) {
        self.creates += other.creates;
        self.updates += other.updates;
        self.deletes += other.deletes;
        self.tombstones += other.tombstones;
    }

    pub fn messages(&self) -> u64 {
        self.creates + self.updates + self.deletes + self.tombstones
    }
}

/// One change: its key (`{"id": …}`) and Debezium envelope payload; `None` for a tombstone.
pub struct Change {
    pub key: Value,
    pub value: Option<Value>,
}

/// Calls `each` with `n` messages' worth of changes of `{schema}.products` (a delete and its
/// tombstone are two).
pub fn changes(n: u64, schema: &str, mut each: impl FnMut(Change)) -> Counts {
    let mut next = xorshift(0x5851_F42D_4C95_7F2Du64 ^ n ^ schema.len() as u64);
    let mut counts = Counts::default();
    let mut created = 0u64;
    let mut i = 0u64;
    while counts.messages() < n {
        let r = next();
        let kind = if created == 0 { 0 } else { r % 100 };
        // A delete needs room for its tombstone.
        let kind = if kind >= 95 && counts.messages() + 2 > n {
            0
        } else {
            kind
        };
        let (op, id, before, after) = if kind < 70 {
            created += 1;
            counts.creates += 1;
            ("c", created, Value::Null, row(created, r, i))
        } else {
            let id = 1 + (r >> 8) % created;
            if kind < 95 {
                counts.updates += 1;
                ("u", id, row(id, r >> 3, i), row(id, r, i))
            } else {
                counts.deletes += 1;
                ("d", id, row(id, r >> 3, i), Value::Null)
            }
        };
        each(Change {
            key: json!({ "id": id }),
            value: Some(envelope(schema, op, before, after, i)),
        });
        if op == "d" {
            counts.tombstones += 1;
            each(Change {
                key: json!({ "id": id }),
                value: None,
            });
        }
        i += 1;
    }
    counts
}

/// A `products` row: tenant, sku, name, price and a microsecond `updated_at` (Debezium's
/// ZonedTimestamp string for `timestamptz`).
fn row(id: u64, r: u64, i: u64) -> Value {
    let colours = ["red", "blue", "green", "black", "white", "graphite", "sand"];
    let things = [
        "kettle",
        "lamp",
        "backpack",
        "notebook",
        "mug",
        "headphones",
    ];
    let ts = 1_000_000 + i;
    json!({
        "id": id,
        "tenant_id": format!("t{}", id % 100),
        "sku": format!("SKU-{id:08}"),
        "name": format!("{} {} {id}", colours[(r % 7) as usize], things[(r / 7 % 6) as usize]),
        "price_cents": 1000 + (r >> 16) % 9000,
        "updated_at": format!("2026-09-{:02}T{:02}:{:02}:{:02}.{:06}Z",
            1 + ts / 86_400 % 28, ts / 3600 % 24, ts / 60 % 60, ts % 60, (r >> 20) % 1_000_000),
    })
}

/// The envelope Debezium 2.x's PostgreSQL connector writes for change `i` of `{schema}.products`.
fn envelope(schema: &str, op: &str, before: Value, after: Value, i: u64) -> Value {
    let lsn = 24_023_928 + i * 312;
    let ts = 1_788_000_000_000u64 + i / 8;
    json!({
        "before": before,
        "after": after,
        "source": {
            "version": "2.7.3.Final", "connector": "postgresql", "name": SERVER,
            "ts_ms": ts, "snapshot": "false", "db": "shop",
            "sequence": format!("[\"{}\",\"{lsn}\"]", lsn - 312),
            "schema": schema, "table": "products", "txId": 1000 + i, "lsn": lsn, "xmin": null
        },
        "op": op,
        "ts_ms": ts + 3,
        "transaction": null
    })
}

/// The topic Debezium writes `{schema}.products` to, under the topic prefix `prefix`.
pub fn topic(prefix: &str, schema: &str) -> String {
    format!("{prefix}.{schema}.products")
}

/// JsonConverter with `schemas.enable=false`: key and value as bare JSON.
pub fn json_message(change: &Change) -> Message {
    (
        serde_json::to_vec(&change.key).expect("JSON"),
        change
            .value
            .as_ref()
            .map(|v| serde_json::to_vec(v).expect("JSON")),
    )
}

/// AvroConverter: the key and value schemas (with their registry ids) and the encoder.
pub struct AvroEncoding {
    key: Encoder,
    value: Encoder,
}

/// A registry id, its schema (leaked once: the resolved names borrow it for the fixture's life)
/// and the schema's named types.
type Encoder = (u32, &'static Schema, ResolvedSchema<'static>);

impl AvroEncoding {
    /// The schemas of `{schema}.products`' topic under the topic prefix `prefix`, ids `first_id`
    /// (key) and `first_id + 1` (value); `register` is given each id and schema text.
    pub fn new(
        prefix: &str,
        schema: &str,
        first_id: u32,
        mut register: impl FnMut(u32, String),
    ) -> Self {
        let mut make = |id: u32, connect: Value, sample: Value| {
            let (schema, _) = connect_to_avro(&connect, &sample).expect("Connect schema to Avro");
            register(id, serde_json::to_string(&schema).expect("schema text"));
            let schema: &'static Schema = Box::leak(Box::new(schema));
            let names = ResolvedSchema::try_from(schema).expect("schema names");
            (id, schema, names)
        };
        let sample = envelope(schema, "c", Value::Null, row(1, 1, 0), 0);
        let name = format!("{prefix}.{schema}.products");
        Self {
            key: make(first_id, key_schema(&name), json!({"id": 1})),
            value: make(first_id + 1, envelope_schema(&name), sample),
        }
    }

    /// The Confluent-framed key and value of a change.
    pub fn message(&self, change: &Change) -> Message {
        let encode = |(id, schema, names): &Encoder, v: &Value| {
            let value = AvroValue::try_from(v.clone())
                .and_then(|a| a.resolve_with_names(schema, names.get_names()))
                .expect("value fits its schema");
            encode_confluent(*id, schema, value).expect("encoded")
        };
        (
            encode(&self.key, &change.key),
            change.value.as_ref().map(|v| encode(&self.value, v)),
        )
    }
}

fn key_schema(name: &str) -> Value {
    json!({"type": "struct", "optional": false, "name": format!("{name}.Key"),
           "fields": [{"field": "id", "type": "int64", "optional": false}]})
}

/// The Kafka Connect schema of the envelope, as JsonConverter with schemas would write it.
fn envelope_schema(name: &str) -> Value {
    let row = |field: &str| {
        json!({"field": field, "type": "struct", "optional": true,
               "name": format!("{name}.Value"), "fields": [
            {"field": "id", "type": "int64", "optional": false},
            {"field": "tenant_id", "type": "string", "optional": false},
            {"field": "sku", "type": "string", "optional": false},
            {"field": "name", "type": "string", "optional": false},
            {"field": "price_cents", "type": "int64", "optional": false},
            {"field": "updated_at", "type": "string", "optional": false,
             "name": "io.debezium.time.ZonedTimestamp", "version": 1}
        ]})
    };
    let field = |name: &str, ty: &str, optional: bool| json!({"field": name, "type": ty, "optional": optional});
    json!({"type": "struct", "optional": false, "name": format!("{name}.Envelope"),
    "fields": [
        row("before"),
        row("after"),
        {"field": "source", "type": "struct", "optional": false,
         "name": "io.debezium.connector.postgresql.Source", "fields": [
            field("version", "string", false), field("connector", "string", false),
            field("name", "string", false), field("ts_ms", "int64", false),
            field("snapshot", "string", true), field("db", "string", false),
            field("sequence", "string", true), field("schema", "string", false),
            field("table", "string", false), field("txId", "int64", true),
            field("lsn", "int64", true), field("xmin", "int64", true)
        ]},
        field("op", "string", false),
        field("ts_ms", "int64", true),
        {"field": "transaction", "type": "struct", "optional": true,
         "name": "event.block", "fields": [
            field("id", "string", false), field("total_order", "int64", false),
            field("data_collection_order", "int64", false)
        ]}
    ]})
}

/// A xorshift64 generator: deterministic, fast, good enough to vary the rows.
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
