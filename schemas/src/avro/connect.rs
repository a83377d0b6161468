//! Kafka Connect JSON (JsonConverter's `schema` and `payload`) to Avro, as Debezium's
//! AvroConverter (Confluent's `AvroData`) writes it.
//!
//! - `struct` → `record` (named after the Connect name, else `ConnectDefault`, numbered from the
//!   second on), each later use of a name a reference to its first definition;
//! - `optional` → `["null", T]` with `"default": null`;
//! - `int8`/`int16`/`int32` → `int` (with `connect.type`), `int64` → `long`, `float32` → `float`,
//!   `float64` → `double`, `array` → `array`, `map` with string keys → `map`;
//! - Connect `Decimal` → `bytes` with the `decimal` logical type, its scale and precision
//!   (`connect.decimal.precision`, else 64 as AvroData's default);
//! - Connect `Date`, `Time`, `Timestamp` → `date`, `time-millis`, `timestamp-millis`;
//! - every other named type (`io.debezium.time.*`, `io.debezium.data.Json`, …) keeps its
//!   primitive, its name in `connect.name` and its parameters in `connect.parameters`.

use std::collections::HashSet;

use apache_avro::Schema;
use apache_avro::types::Value as AvroValue;
use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::json::{CONNECT_NAME, CONNECT_PARAMETERS, parse_schema};

/// AvroData's precision for a Decimal whose Connect schema gives none.
const DEFAULT_DECIMAL_PRECISION: u64 = 64;

/// The record name AvroData gives a struct without a Connect name.
const DEFAULT_RECORD_NAME: &str = "io.confluent.connect.avro.ConnectDefault";

/// Nesting depth beyond which a Connect schema is refused (see the JSON side's limit).
const MAX_DEPTH: usize = 64;

/// Converts a JsonConverter record's `schema` and `payload` halves into an Avro schema and value,
/// as Debezium's AvroConverter would write the same Connect data (see the module doc for the
/// mapping). The schema is parsed with [`parse_schema`], so it decodes with its Connect names.
pub fn connect_to_avro(
    schema_json: &Value,
    payload: &Value,
) -> Result<(Schema, AvroValue), String> {
    let mut ctx = Context::default();
    let avro_json = ctx.schema(schema_json, 0)?;
    let schema = parse_schema(&avro_json.to_string())?;
    let value = value(schema_json, payload, "payload", 0)?;
    Ok((schema, value))
}

#[derive(Default)]
struct Context {
    defined: HashSet<String>,
    unnamed: usize,
}

impl Context {
    fn schema(&mut self, c: &Value, depth: usize) -> Result<Value, String> {
        let inner = self.required(c, depth)?;
        Ok(if optional(c) {
            json!(["null", inner])
        } else {
            inner
        })
    }

    /// The Avro type of a Connect schema, ignoring `optional`.
    fn required(&mut self, c: &Value, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err(format!(
                "Connect schema nests deeper than {MAX_DEPTH} levels"
            ));
        }
        let ty = c.get("type").and_then(Value::as_str).unwrap_or("");
        let name = c.get("name").and_then(Value::as_str);
        let params = c.get("parameters");
        let mut out = Map::new();
        let primitive = match (ty, name) {
            ("struct", _) => return self.record(c, name, depth),
            ("bytes", Some("org.apache.kafka.connect.data.Decimal")) => {
                let scale = param_u64(params, "scale")
                    .ok_or("Decimal without an integer `parameters.scale`")?;
                let precision = param_u64(params, "connect.decimal.precision")
                    .unwrap_or(DEFAULT_DECIMAL_PRECISION)
                    .max(scale.max(1));
                out.insert("logicalType".into(), json!("decimal"));
                out.insert("precision".into(), json!(precision));
                out.insert("scale".into(), json!(scale));
                "bytes"
            }
            ("int32", Some("org.apache.kafka.connect.data.Date")) => {
                out.insert("logicalType".into(), json!("date"));
                "int"
            }
            ("int32", Some("org.apache.kafka.connect.data.Time")) => {
                out.insert("logicalType".into(), json!("time-millis"));
                "int"
            }
            ("int64", Some("org.apache.kafka.connect.data.Timestamp")) => {
                out.insert("logicalType".into(), json!("timestamp-millis"));
                "long"
            }
            ("int8" | "int16", _) => {
                out.insert("connect.type".into(), json!(ty));
                "int"
            }
            ("int32", _) => "int",
            ("int64", _) => "long",
            ("float32", _) => "float",
            ("float64", _) => "double",
            ("boolean" | "string" | "bytes", _) => ty,
            ("array", _) => {
                let items = c.get("items").ok_or("array schema without `items`")?;
                out.insert("items".into(), self.schema(items, depth + 1)?);
                "array"
            }
            ("map", _) => {
                let keys = c
                    .get("keys")
                    .and_then(|k| k.get("type"))
                    .and_then(Value::as_str);
                if keys != Some("string") {
                    return Err("maps with non-string keys have no Avro form here".into());
                }
                let values = c.get("values").ok_or("map schema without `values`")?;
                out.insert("values".into(), self.schema(values, depth + 1)?);
                "map"
            }
            _ => return Err(format!("Connect type `{ty}` has no Avro form")),
        };
        out.insert("type".into(), json!(primitive));
        if let Some(name) = name {
            out.insert(CONNECT_NAME.into(), json!(name));
        }
        if let Some(p) = params {
            out.insert(CONNECT_PARAMETERS.into(), p.clone());
        }
        Ok(Value::Object(out))
    }

    fn record(&mut self, c: &Value, name: Option<&str>, depth: usize) -> Result<Value, String> {
        let full = match name {
            Some(n) => avro_name(n),
            None => {
                self.unnamed += 1;
                match self.unnamed {
                    1 => DEFAULT_RECORD_NAME.to_owned(),
                    n => format!("{DEFAULT_RECORD_NAME}{n}"),
                }
            }
        };
        if !self.defined.insert(full.clone()) {
            return Ok(json!(full));
        }
        let mut fields = Vec::new();
        for f in c
            .get("fields")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let fname = f
                .get("field")
                .and_then(Value::as_str)
                .ok_or("a struct field without a `field` name")?;
            let mut field = Map::new();
            field.insert("name".into(), json!(fname));
            field.insert("type".into(), self.schema(f, depth + 1)?);
            if optional(f) {
                field.insert("default".into(), Value::Null);
            }
            fields.push(Value::Object(field));
        }
        let mut out = Map::new();
        out.insert("type".into(), json!("record"));
        out.insert("name".into(), json!(full));
        out.insert("fields".into(), Value::Array(fields));
        if let Some(n) = name {
            out.insert(CONNECT_NAME.into(), json!(n));
        }
        Ok(Value::Object(out))
    }
}

fn optional(c: &Value) -> bool {
    c.get("optional").and_then(Value::as_bool).unwrap_or(false)
}

fn param_u64(params: Option<&Value>, key: &str) -> Option<u64> {
    match params?.get(key)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// A Connect name as an Avro full name: each dot-separated part made a valid Avro name.
fn avro_name(name: &str) -> String {
    name.split('.')
        .map(|part| {
            let mut s: String = part
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
                s.insert(0, '_');
            }
            s
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The Avro value of a Connect payload value of schema `c`.
fn value(c: &Value, v: &Value, at: &str, depth: usize) -> Result<AvroValue, String> {
    if depth > MAX_DEPTH {
        return Err(format!("payload nests deeper than {MAX_DEPTH} levels"));
    }
    if optional(c) {
        return Ok(match v {
            Value::Null => AvroValue::Union(0, Box::new(AvroValue::Null)),
            v => AvroValue::Union(1, Box::new(required_value(c, v, at, depth)?)),
        });
    }
    required_value(c, v, at, depth)
}

fn required_value(c: &Value, v: &Value, at: &str, depth: usize) -> Result<AvroValue, String> {
    let ty = c.get("type").and_then(Value::as_str).unwrap_or("");
    let name = c.get("name").and_then(Value::as_str).unwrap_or("");
    let wrong = || format!("`{at}`: {v} is not a valid `{ty}`");
    let int = || v.as_i64().ok_or_else(wrong);
    let int32 = || int().and_then(|n| i32::try_from(n).map_err(|_| wrong()));
    Ok(match ty {
        "struct" => {
            let mut fields = Vec::new();
            for f in c
                .get("fields")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let fname = f.get("field").and_then(Value::as_str).unwrap_or_default();
                let fv = v.get(fname).unwrap_or(&Value::Null);
                let path = format!("{at}.{fname}");
                fields.push((fname.to_owned(), value(f, fv, &path, depth + 1)?));
            }
            AvroValue::Record(fields)
        }
        "bytes" => {
            let s = v.as_str().ok_or_else(wrong)?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| format!("`{at}`: not base64: {e}"))?;
            if name == "org.apache.kafka.connect.data.Decimal" {
                AvroValue::Decimal(bytes.into())
            } else {
                AvroValue::Bytes(bytes)
            }
        }
        "int32" if name == "org.apache.kafka.connect.data.Date" => AvroValue::Date(int32()?),
        "int32" if name == "org.apache.kafka.connect.data.Time" => AvroValue::TimeMillis(int32()?),
        "int64" if name == "org.apache.kafka.connect.data.Timestamp" => {
            AvroValue::TimestampMillis(int()?)
        }
        "int8" | "int16" | "int32" => AvroValue::Int(int32()?),
        "int64" => AvroValue::Long(int()?),
        "float32" => AvroValue::Float(v.as_f64().ok_or_else(wrong)? as f32),
        "float64" => AvroValue::Double(v.as_f64().ok_or_else(wrong)?),
        "boolean" => AvroValue::Boolean(v.as_bool().ok_or_else(wrong)?),
        "string" => AvroValue::String(v.as_str().ok_or_else(wrong)?.to_owned()),
        "array" => {
            let items = c.get("items").unwrap_or(&Value::Null);
            let list = v.as_array().ok_or_else(wrong)?;
            let converted = list
                .iter()
                .enumerate()
                .map(|(i, x)| value(items, x, &format!("{at}[{i}]"), depth + 1))
                .collect::<Result<_, _>>()?;
            AvroValue::Array(converted)
        }
        "map" => {
            let values = c.get("values").unwrap_or(&Value::Null);
            let obj = v.as_object().ok_or_else(wrong)?;
            let converted = obj
                .iter()
                .map(|(k, x)| {
                    Ok((
                        k.clone(),
                        value(values, x, &format!("{at}.{k}"), depth + 1)?,
                    ))
                })
                .collect::<Result<_, String>>()?;
            AvroValue::Map(converted)
        }
        _ => return Err(format!("`{at}`: Connect type `{ty}` has no Avro form")),
    })
}
