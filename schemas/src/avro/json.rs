//! From Avro to what JsonConverter writes: Avro values to the JSON of a `payload`
//! ([`to_json`]), Avro schemas to the Connect schema of a `schema` ([`connect_schema`]), and the
//! schema parser that keeps Debezium's `connect.name` where apache-avro can see it
//! ([`parse_schema`]).

use std::collections::{BTreeMap, HashMap};

use apache_avro::Schema;
use apache_avro::schema::{Name, RecordField, RecordSchema};
use apache_avro::types::Value as AvroValue;
use base64::Engine as _;
use serde_json::{Map, Value, json};

/// The attribute AvroConverter names a Connect type in (`io.debezium.time.Date`, …).
pub(crate) const CONNECT_NAME: &str = "connect.name";

/// The attribute AvroConverter keeps a Connect type's parameters in (a Decimal's `scale`).
pub(crate) const CONNECT_PARAMETERS: &str = "connect.parameters";

/// Nesting depth beyond which a schema is refused: Debezium's envelopes nest three or four
/// records deep; a deeper schema is hostile or broken, and recursion must stay bounded.
const MAX_SCHEMA_DEPTH: usize = 64;

/// Parses an Avro schema as a schema registry returns it, keeping Debezium's Connect type names.
///
/// apache-avro drops the attributes of primitive types (`{"type":"long","connect.name":…}`
/// becomes a bare `long`), so before parsing, each record field whose type (or the non-null
/// branch of its `["null", T]` union) carries `connect.name` / `connect.parameters` gets a copy
/// of them on the field itself, where apache-avro keeps them as custom attributes. The binary
/// encoding is unchanged.
pub fn parse_schema(text: &str) -> Result<Schema, String> {
    let mut json: Value =
        serde_json::from_str(text).map_err(|e| format!("schema is not JSON: {e}"))?;
    lift_connect_names(&mut json, 0)?;
    Schema::parse(&json).map_err(|e| format!("invalid Avro schema: {e}"))
}

fn lift_connect_names(schema: &mut Value, depth: usize) -> Result<(), String> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(format!(
            "schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        ));
    }
    match schema {
        Value::Array(branches) => {
            for b in branches {
                lift_connect_names(b, depth + 1)?;
            }
        }
        Value::Object(obj) => {
            for key in ["items", "values"] {
                if let Some(inner) = obj.get_mut(key) {
                    lift_connect_names(inner, depth + 1)?;
                }
            }
            let Some(Value::Array(fields)) = obj.get_mut("fields") else {
                return Ok(());
            };
            for field in fields {
                let Some(field) = field.as_object_mut() else {
                    continue;
                };
                if let Some(ty) = field.get_mut("type") {
                    lift_connect_names(ty, depth + 1)?;
                }
                let attrs = field
                    .get("type")
                    .and_then(non_null_branch)
                    .map(|ty| [CONNECT_NAME, CONNECT_PARAMETERS].map(|k| (k, ty.get(k).cloned())));
                for (k, v) in attrs.into_iter().flatten() {
                    if let (Some(v), false) = (v, field.contains_key(k)) {
                        field.insert(k.to_owned(), v);
                    }
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// A type, or the one non-null branch of a union.
fn non_null_branch(ty: &Value) -> Option<&Value> {
    match ty {
        Value::Array(branches) => {
            let mut rest = branches.iter().filter(|b| b.as_str() != Some("null"));
            match (rest.next(), rest.next()) {
                (Some(only), None) => Some(only),
                _ => None,
            }
        }
        other => Some(other),
    }
}

/// The JSON JsonConverter writes for an Avro value: bytes, fixed and decimals as base64 (a
/// Decimal's unscaled two's-complement bytes), dates, times and timestamps as their numbers,
/// unions as their branch's value, records and maps as objects, enums as their symbol. A float
/// is written by its shortest decimal form (as Java's `Float.toString` does), non-finite
/// numbers as `null` (JSON has no NaN).
pub fn to_json(value: AvroValue) -> Value {
    let b64 = |b: &[u8]| Value::String(base64::engine::general_purpose::STANDARD.encode(b));
    match value {
        AvroValue::Null => Value::Null,
        AvroValue::Boolean(b) => Value::Bool(b),
        AvroValue::Int(n) | AvroValue::Date(n) | AvroValue::TimeMillis(n) => Value::from(n),
        AvroValue::Long(n)
        | AvroValue::TimeMicros(n)
        | AvroValue::TimestampMillis(n)
        | AvroValue::TimestampMicros(n)
        | AvroValue::TimestampNanos(n)
        | AvroValue::LocalTimestampMillis(n)
        | AvroValue::LocalTimestampMicros(n)
        | AvroValue::LocalTimestampNanos(n) => Value::from(n),
        AvroValue::Float(f) => f.to_string().parse::<f64>().map_or(Value::Null, float),
        AvroValue::Double(f) => float(f),
        AvroValue::Bytes(b) | AvroValue::Fixed(_, b) => b64(&b),
        AvroValue::String(s) | AvroValue::Enum(_, s) => Value::String(s),
        AvroValue::Union(_, inner) => to_json(*inner),
        AvroValue::Array(items) => Value::Array(items.into_iter().map(to_json).collect()),
        AvroValue::Map(entries) => {
            Value::Object(entries.into_iter().map(|(k, v)| (k, to_json(v))).collect())
        }
        AvroValue::Record(fields) => {
            Value::Object(fields.into_iter().map(|(k, v)| (k, to_json(v))).collect())
        }
        AvroValue::Decimal(d) => Vec::<u8>::try_from(&d).map_or(Value::Null, |b| b64(&b)),
        AvroValue::BigDecimal(d) => Value::String(d.to_string()),
        AvroValue::Uuid(u) => Value::String(u.to_string()),
        AvroValue::Duration(d) => b64(&<[u8; 12]>::from(d)),
    }
}

fn float(f: f64) -> Value {
    serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
}

/// The Connect schema JsonConverter would write for data of this Avro schema, as far as
/// [`crate::debezium::logical`] reads it: `type` (`struct` for records), `field`, `optional`,
/// `fields`, and the logical type's `name` and `parameters`. The Connect name is the field's
/// `connect.name` (see [`parse_schema`]) or a record's own; failing that, Avro logical types map
/// as AvroConverter maps them (`decimal` → Connect Decimal with its scale, `date` → Date,
/// `time-millis` → Time, `timestamp-millis` → Timestamp) and, where Connect has no type,
/// to Debezium's (`time-micros` → MicroTime, `timestamp-micros` → MicroTimestamp,
/// `timestamp-nanos` → NanoTimestamp).
pub fn connect_schema(schema: &Schema) -> Result<Value, String> {
    let resolved = apache_avro::schema::ResolvedSchema::try_from(schema)
        .map_err(|e| format!("unresolvable schema: {e}"))?;
    let names: HashMap<Name, &Schema> = resolved
        .get_names()
        .iter()
        .map(|(n, s)| (n.clone(), *s))
        .collect();
    let empty = BTreeMap::new();
    to_connect(schema, &empty, &names, 0)
}

fn to_connect(
    schema: &Schema,
    attrs: &BTreeMap<String, Value>,
    names: &HashMap<Name, &Schema>,
    depth: usize,
) -> Result<Value, String> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(format!(
            "schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
        ));
    }
    let (schema, optional) = unwrap_optional(schema, names)?;
    let mut out = Map::new();
    out.insert("optional".into(), Value::Bool(optional));
    let mut name = attrs
        .get(CONNECT_NAME)
        .and_then(Value::as_str)
        .map(str::to_owned);
    if let Some(p) = attrs.get(CONNECT_PARAMETERS) {
        out.insert("parameters".into(), p.clone());
    }
    let (ty, implied) = match schema {
        Schema::Record(r) => {
            out.insert("fields".into(), Value::Array(fields(r, names, depth)?));
            let own = r.attributes.get(CONNECT_NAME).and_then(Value::as_str);
            (
                "struct",
                Some(own.map_or_else(|| r.name.fullname(None), str::to_owned)),
            )
        }
        Schema::Decimal(d) => {
            let params = out.entry("parameters").or_insert_with(|| json!({}));
            if let Value::Object(p) = params {
                p.insert("scale".into(), Value::String(d.scale.to_string()));
            }
            (
                "bytes",
                Some("org.apache.kafka.connect.data.Decimal".to_owned()),
            )
        }
        Schema::Date => (
            "int32",
            Some("org.apache.kafka.connect.data.Date".to_owned()),
        ),
        Schema::TimeMillis => (
            "int32",
            Some("org.apache.kafka.connect.data.Time".to_owned()),
        ),
        Schema::TimeMicros => ("int64", Some("io.debezium.time.MicroTime".to_owned())),
        Schema::TimestampMillis | Schema::LocalTimestampMillis => (
            "int64",
            Some("org.apache.kafka.connect.data.Timestamp".to_owned()),
        ),
        Schema::TimestampMicros | Schema::LocalTimestampMicros => {
            ("int64", Some("io.debezium.time.MicroTimestamp".to_owned()))
        }
        Schema::TimestampNanos | Schema::LocalTimestampNanos => {
            ("int64", Some("io.debezium.time.NanoTimestamp".to_owned()))
        }
        Schema::Array(a) => {
            out.insert(
                "items".into(),
                to_connect(&a.items, &BTreeMap::new(), names, depth + 1)?,
            );
            ("array", None)
        }
        Schema::Map(m) => {
            out.insert(
                "values".into(),
                to_connect(&m.types, &BTreeMap::new(), names, depth + 1)?,
            );
            ("map", None)
        }
        Schema::Boolean => ("boolean", None),
        Schema::Int => ("int32", None),
        Schema::Long => ("int64", None),
        Schema::Float => ("float32", None),
        Schema::Double => ("float64", None),
        Schema::Bytes | Schema::Fixed(_) | Schema::Duration(_) => ("bytes", None),
        _ => ("string", None),
    };
    // A Decimal's encoding is decided by the Avro schema, whatever the attribute says.
    if matches!(schema, Schema::Decimal(_)) || name.is_none() {
        name = implied;
    }
    out.insert("type".into(), Value::String(ty.to_owned()));
    if let Some(name) = name {
        out.insert("name".into(), Value::String(name));
    }
    Ok(Value::Object(out))
}

fn fields(
    record: &RecordSchema,
    names: &HashMap<Name, &Schema>,
    depth: usize,
) -> Result<Vec<Value>, String> {
    record
        .fields
        .iter()
        .map(|f: &RecordField| {
            let mut c = to_connect(&f.schema, &f.custom_attributes, names, depth + 1)?;
            if let Value::Object(obj) = &mut c {
                obj.insert("field".into(), Value::String(f.name.clone()));
            }
            Ok(c)
        })
        .collect()
}

/// The schema itself, or the non-null branch of a `["null", T]` union (then optional); named
/// references are followed.
fn unwrap_optional<'a>(
    schema: &'a Schema,
    names: &HashMap<Name, &'a Schema>,
) -> Result<(&'a Schema, bool), String> {
    let deref = |s: &'a Schema| match s {
        Schema::Ref { name } => names
            .get(name)
            .copied()
            .ok_or_else(|| format!("unknown named type `{}`", name.fullname(None))),
        other => Ok(other),
    };
    if let Schema::Union(u) = schema {
        let variants = u.variants();
        let optional = variants.iter().any(|v| matches!(v, Schema::Null));
        let mut rest = variants.iter().filter(|v| !matches!(v, Schema::Null));
        return match (rest.next(), rest.next()) {
            (Some(only), None) => Ok((deref(only)?, optional)),
            // A general union has no Connect type the logical conversions know: its values
            // pass through as their branch's JSON.
            _ => Ok((schema, optional)),
        };
    }
    Ok((deref(schema)?, false))
}
