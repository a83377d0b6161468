//! Column values of a migration: their types, exact conversions between them, and the canonical
//! text that `verify` compares.
//!
//! Values are JSON as the PostgreSQL source hands them out (integers as numbers, `numeric` as
//! strings with every digit, `timestamptz` as RFC 3339 in UTC, `json`/`jsonb` parsed). A
//! conversion never rounds: a value that does not fit its target exactly is an error naming why.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Number, Value};

/// A column type as the transforms see it, from PostgreSQL's `format_type` text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnType {
    /// `smallint`, `integer`, `bigint`: the largest value.
    Integer {
        /// The largest value the type holds (its smallest is `-max - 1`).
        max: i64,
    },
    /// `numeric`, with the digits after the point it keeps when declared.
    Numeric {
        /// `numeric(p, s)`: `s`.
        scale: Option<u32>,
    },
    /// `real`, `double precision`.
    Float,
    /// `boolean`.
    Bool,
    /// `text`, `varchar`, `char`, `uuid` and every type without a rule of its own (compared as
    /// PostgreSQL prints them).
    Text,
    /// `timestamp with time zone`: an instant.
    Timestamptz,
    /// `json`, `jsonb`.
    Json,
}

impl ColumnType {
    /// The type `format_type` calls `name` (`numeric(12,2)`, `bigint`, `character varying(20)`).
    pub fn from_pg(name: &str) -> Self {
        let base = name.split('(').next().unwrap_or(name).trim();
        match base {
            "smallint" | "int2" => ColumnType::Integer {
                max: i16::MAX.into(),
            },
            "integer" | "int" | "int4" => ColumnType::Integer {
                max: i32::MAX.into(),
            },
            "bigint" | "int8" => ColumnType::Integer { max: i64::MAX },
            "numeric" | "decimal" => ColumnType::Numeric {
                scale: name
                    .split_once(',')
                    .and_then(|(_, s)| s.trim_end_matches(')').trim().parse().ok()),
            },
            "real" | "double precision" | "float4" | "float8" => ColumnType::Float,
            "boolean" | "bool" => ColumnType::Bool,
            "timestamp with time zone" | "timestamptz" => ColumnType::Timestamptz,
            "json" | "jsonb" => ColumnType::Json,
            _ => ColumnType::Text,
        }
    }
}

/// The length limit, in characters, of a column of type `name` as `format_type` prints it:
/// `n` for `character varying(n)` and `character(n)`, `None` for every other type (arrays
/// included).
pub fn char_limit(name: &str) -> Option<usize> {
    let inner = name
        .strip_prefix("character varying(")
        .or_else(|| name.strip_prefix("character("))?;
    inner.strip_suffix(')')?.parse().ok()
}

/// `value`, unless it is text longer than `limit` characters. PostgreSQL would refuse it on
/// assignment, or cut it where it is cast (or where only spaces are over): never a value the
/// migration writes.
pub fn within(value: Value, limit: Option<usize>) -> Result<Value, String> {
    match (&value, limit) {
        (Value::String(s), Some(n)) if s.chars().count() > n => Err(format!(
            "`{s}` is longer than {n} characters: it would be cut"
        )),
        _ => Ok(value),
    }
}

/// `value` (of a column of type `from`) as a value of a column of type `to`, exactly.
pub fn cast(value: &Value, from: ColumnType, to: ColumnType) -> Result<Value, String> {
    if value.is_null() {
        return Ok(Value::Null);
    }
    if from == to {
        return Ok(value.clone());
    }
    match to {
        ColumnType::Integer { max } => {
            let n = match value {
                Value::Number(n) => n
                    .as_i64()
                    .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
                    .ok_or_else(|| format!("{n} is not an integer"))?,
                Value::String(s) => integer(s)?,
                other => return Err(format!("{other} is not an integer")),
            };
            if n > max || n < -max - 1 {
                return Err(format!("{n} is out of range for the column"));
            }
            Ok(Value::Number(n.into()))
        }
        ColumnType::Numeric { scale } => {
            let text = match value {
                Value::Number(n) => n.to_string(),
                Value::String(s) => s.clone(),
                other => return Err(format!("{other} is not a number")),
            };
            let normal = decimal(&text)?;
            if let Some(scale) = scale {
                let digits = normal.split_once('.').map_or(0, |(_, f)| f.len());
                if digits > scale as usize {
                    return Err(format!(
                        "{text} has more than {scale} digits after the point: it would be rounded"
                    ));
                }
            }
            Ok(Value::String(text))
        }
        ColumnType::Float => {
            let f = match value {
                Value::Number(n) => n.as_f64(),
                Value::String(s) => s.trim().parse::<f64>().ok(),
                _ => None,
            };
            f.and_then(Number::from_f64)
                .map(Value::Number)
                .ok_or_else(|| format!("{value} is not a finite number"))
        }
        ColumnType::Bool => match value {
            Value::Bool(b) => Ok(Value::Bool(*b)),
            Value::String(s) => match s.to_ascii_lowercase().as_str() {
                "t" | "true" | "yes" | "on" | "1" => Ok(Value::Bool(true)),
                "f" | "false" | "no" | "off" | "0" => Ok(Value::Bool(false)),
                _ => Err(format!("`{s}` is not a boolean")),
            },
            other => Err(format!("{other} is not a boolean")),
        },
        ColumnType::Text => Ok(Value::String(match value {
            Value::String(s) => s.clone(),
            Value::Bool(b) => b.to_string(),
            other => other.to_string(),
        })),
        ColumnType::Timestamptz => match value {
            Value::String(s) => instant(s)
                .map(|t| Value::String(t.to_rfc3339_opts(SecondsFormat::AutoSi, true)))
                .ok_or_else(|| format!("`{s}` is not a timestamp with a time zone")),
            other => Err(format!("{other} is not a timestamp")),
        },
        ColumnType::Json => match value {
            Value::String(s) if from == ColumnType::Text => {
                serde_json::from_str(s).map_err(|e| format!("`{s}` is not JSON: {e}"))
            }
            other => Ok(other.clone()),
        },
    }
}

/// The value as text (what `extract` matches and `reverse` fills in).
pub fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// An integer written as decimal text, exactly (`"12"`, `"12.00"`; not `"12.5"`).
fn integer(text: &str) -> Result<i64, String> {
    let normal = decimal(text)?;
    if normal.contains('.') {
        return Err(format!("{text} is not a whole number"));
    }
    normal
        .parse()
        .map_err(|_| format!("{text} is out of range for a bigint"))
}

/// `text` as a normalized decimal: no `+`, no leading zeros, no trailing zeros after the point,
/// no point without digits after it, `0` for every zero.
pub fn decimal(text: &str) -> Result<String, String> {
    let t = text.trim();
    let (negative, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let valid = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (int.is_empty() && frac.is_empty()) || !valid(int) || !valid(frac) {
        return Err(format!("`{text}` is not a decimal number"));
    }
    let int = int.trim_start_matches('0');
    let frac = frac.trim_end_matches('0');
    let mut out = String::with_capacity(digits.len() + 2);
    if int.is_empty() && frac.is_empty() {
        return Ok("0".into());
    }
    if negative {
        out.push('-');
    }
    out.push_str(if int.is_empty() { "0" } else { int });
    if !frac.is_empty() {
        out.push('.');
        out.push_str(frac);
    }
    Ok(out)
}

/// The decimal `text` times 10^`digits` (a negative `digits` divides), exactly, normalized.
pub fn shift_decimal(text: &str, digits: i32) -> Result<String, String> {
    let normal = decimal(text)?;
    let (negative, body) = match normal.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, normal.as_str()),
    };
    let (int, frac) = body.split_once('.').unwrap_or((body, ""));
    let mut all = format!("{int}{frac}");
    let mut point = int.len() as i64 + i64::from(digits);
    if point < 0 {
        all = format!("{}{all}", "0".repeat((-point) as usize));
        point = 0;
    }
    let point = point as usize;
    if point > all.len() {
        all.push_str(&"0".repeat(point - all.len()));
    }
    let shifted = format!(
        "{}{}.{}",
        if negative { "-" } else { "" },
        &all[..point],
        &all[point..]
    );
    decimal(&shifted)
}

/// An RFC 3339 instant, or PostgreSQL's own text of one (`2024-01-01 10:00:00+02`).
fn instant(text: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Some(t.with_timezone(&Utc));
    }
    let padded = match text.rfind(['+', '-']) {
        Some(i) if i > 10 && text.len() - i == 3 => format!("{text}:00"),
        _ => text.to_owned(),
    };
    DateTime::parse_from_str(&padded, "%Y-%m-%d %H:%M:%S%.f%:z")
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// The text `verify` compares for a value of a column of type `ty`: equal values written
/// differently (`1.0` and `1`, one instant in two time zones, JSON objects with their keys in
/// another order) give the same text; different values give different texts.
pub fn canonical(value: &Value, ty: ColumnType) -> String {
    match (value, ty) {
        (Value::Null, _) => "\\N".into(),
        (_, ColumnType::Integer { .. } | ColumnType::Numeric { .. }) => {
            let text = match value {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            decimal(&text).unwrap_or(text)
        }
        (Value::Number(n), ColumnType::Float) => n.as_f64().map_or(n.to_string(), float_text),
        (Value::String(s), ColumnType::Timestamptz) => instant(s)
            .map(|t| t.to_rfc3339_opts(SecondsFormat::Micros, true))
            .unwrap_or_else(|| s.clone()),
        (_, ColumnType::Json) => {
            let mut out = String::new();
            canonical_json(value, &mut out);
            out
        }
        (Value::String(s), _) => s.clone(),
        (other, _) => other.to_string(),
    }
}

fn float_text(f: f64) -> String {
    if f == 0.0 { "0".into() } else { f.to_string() }
}

/// JSON with object keys sorted and numbers normalized, at every depth.
fn canonical_json(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                canonical_json(&map[key], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        Value::Number(n) => {
            let text = n.to_string();
            match decimal(&text) {
                Ok(d) => out.push_str(&d),
                Err(_) => out.push_str(&n.as_f64().map_or(text, float_text)),
            }
        }
        other => out.push_str(&other.to_string()),
    }
}
