//! How JSON values become the values of flat rows (the row types live in
//! [`refract_schemas::write::flat`]).

use std::sync::Arc;

use refract_schemas::Position;
use refract_schemas::write::{RowChange, WriteOp};
use serde_json::Value;

pub use refract_schemas::write::flat::{
    FlatChange, FlatColumn, FlatOp, FlatSchema, FlatType, FlatValue,
};

/// Converts `value` to a column of declared type `ty` (explicit casts).
pub(crate) fn cast(value: &Value, ty: FlatType) -> Result<FlatValue, String> {
    let kind = kind(value);
    let fail = || Err(format!("{kind} {} cannot be cast to {ty:?}", short(value)));
    Ok(match (ty, value) {
        (_, Value::Null) => FlatValue::Null,
        (FlatType::Json, v) => FlatValue::Str(v.to_string()),
        (FlatType::String, Value::String(s)) => FlatValue::Str(s.clone()),
        (FlatType::String, Value::Number(n)) => FlatValue::Str(n.to_string()),
        (FlatType::String, Value::Bool(b)) => FlatValue::Str(b.to_string()),
        (FlatType::Int64, Value::Number(n)) => match n.as_i64() {
            Some(i) => FlatValue::Int(i),
            None => return fail(),
        },
        (FlatType::Int64, Value::String(s)) => match s.trim().parse() {
            Ok(i) => FlatValue::Int(i),
            Err(_) => return fail(),
        },
        (FlatType::Float64, Value::Number(n)) => FlatValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        (FlatType::Float64, Value::String(s)) => match s.trim().parse() {
            Ok(f) => FlatValue::Float(f),
            Err(_) => return fail(),
        },
        (FlatType::Bool, Value::Bool(b)) => FlatValue::Bool(*b),
        (FlatType::Bool, Value::String(s)) => match s.as_str() {
            "true" | "t" => FlatValue::Bool(true),
            "false" | "f" => FlatValue::Bool(false),
            _ => return fail(),
        },
        (FlatType::Timestamp, Value::String(s)) => match parse_timestamp(s) {
            Some(us) => FlatValue::Micros(us),
            None => return fail(),
        },
        // Integers are milliseconds since the epoch (Debezium's io.debezium.time.Timestamp).
        (FlatType::Timestamp, Value::Number(n)) => match n.as_i64() {
            Some(ms) => FlatValue::Micros(ms.saturating_mul(1000)),
            None => return fail(),
        },
        (FlatType::Date, Value::String(s)) => match parse_date(s) {
            Some(days) => FlatValue::Days(days),
            None => return fail(),
        },
        (FlatType::Date, Value::Number(n)) => {
            match n.as_i64().and_then(|d| i32::try_from(d).ok()) {
                Some(days) => FlatValue::Days(days),
                None => return fail(),
            }
        }
        _ => return fail(),
    })
}

/// Converts a scalar `value` to the type it implies (for columns whose type is learned):
/// integers, floats, booleans, ISO-8601 date-times as timestamps, other strings as text.
/// Objects and arrays have no flat type: `Err` names their kind.
pub(crate) fn infer(value: &Value) -> Result<FlatValue, &'static str> {
    Ok(match value {
        Value::Null => FlatValue::Null,
        Value::Bool(b) => FlatValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => FlatValue::Int(i),
            None => FlatValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => match looks_like_timestamp(s)
            .then(|| parse_timestamp(s))
            .flatten()
        {
            Some(us) => FlatValue::Micros(us),
            None => FlatValue::Str(s.clone()),
        },
        Value::Array(_) => return Err("an array"),
        Value::Object(_) => return Err("an object"),
    })
}

/// Fits an inferred value to a column whose type is already known: `Ok` with the value to
/// store, or `Err` for a type conflict. Integers widen into float columns; text that reads as a
/// timestamp stays text in a text column.
pub(crate) fn fit(value: FlatValue, original: &Value, ty: FlatType) -> Result<FlatValue, ()> {
    match (ty, value) {
        (_, FlatValue::Null) => Ok(FlatValue::Null),
        (FlatType::Unknown, v) => Ok(v),
        (FlatType::Float64, FlatValue::Int(i)) => Ok(FlatValue::Float(i as f64)),
        (FlatType::String, FlatValue::Micros(_)) => match original {
            Value::String(s) => Ok(FlatValue::Str(s.clone())),
            _ => Err(()),
        },
        (ty, v) if v.flat_type() == ty => Ok(v),
        _ => Err(()),
    }
}

/// The JSON kind of a value, for messages.
pub(crate) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A value shortened for messages.
pub(crate) fn short(value: &Value) -> String {
    let text = value.to_string();
    if text.len() <= 40 {
        text
    } else {
        let cut: String = text.chars().take(40).collect();
        format!("{cut}…")
    }
}

/// Quick check before parsing: `YYYY-MM-DD` then `T` or a space.
fn looks_like_timestamp(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 19
        && b[4] == b'-'
        && b[7] == b'-'
        && (b[10] == b'T' || b[10] == b' ')
        && b[..4].iter().all(u8::is_ascii_digit)
}

/// ISO-8601 / RFC 3339 date-times to microseconds since the epoch; a date-time without an
/// offset is taken as UTC (PostgreSQL `timestamp` values).
pub(crate) fn parse_timestamp(s: &str) -> Option<i64> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Some(t.timestamp_micros());
    }
    for format in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f"] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(s, format) {
            return Some(t.and_utc().timestamp_micros());
        }
    }
    for format in ["%Y-%m-%d %H:%M:%S%.f%#z", "%Y-%m-%dT%H:%M:%S%.f%#z"] {
        if let Ok(t) = chrono::DateTime::parse_from_str(s, format) {
            return Some(t.timestamp_micros());
        }
    }
    None
}

/// `YYYY-MM-DD` to days since the epoch.
fn parse_date(s: &str) -> Option<i32> {
    let date = chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d").ok()?;
    let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1)?;
    i32::try_from(date.signed_duration_since(epoch).num_days()).ok()
}

/// A change with its position, as the sinks receive it.
pub(crate) fn change(
    schema: &Arc<FlatSchema>,
    op: FlatOp,
    values: Vec<FlatValue>,
    commit_ts_ms: Option<i64>,
    position: &Position,
) -> WriteOp {
    WriteOp::Row(RowChange {
        change: FlatChange {
            schema: schema.clone(),
            op,
            values,
            commit_ts_ms,
        },
        position: position.clone(),
    })
}
