//! Kafka Connect / Debezium logical types, as declared by the `schema` half of a wrapped record.
//!
//! Conversions (the JSON value refract's read models see):
//! - `org.apache.kafka.connect.data.Decimal` (base64 two's-complement big-endian unscaled value,
//!   `parameters.scale`) and `io.debezium.data.VariableScaleDecimal` → a decimal **string**
//!   (`"1234.50"`), never a float, so no precision is lost;
//! - `io.debezium.time.Timestamp` / `MicroTimestamp` / `NanoTimestamp` (epoch ms/µs/ns, no zone)
//!   and `org.apache.kafka.connect.data.Timestamp` → `"YYYY-MM-DDTHH:MM:SS.ffffff"`;
//! - `io.debezium.time.Date` / `org.apache.kafka.connect.data.Date` (days since epoch) → `"YYYY-MM-DD"`;
//! - `io.debezium.time.Time` / `MicroTime` / `NanoTime` → `"HH:MM:SS.ffffff"`;
//! - `io.debezium.time.ZonedTimestamp` → the ISO-8601 string, checked;
//! - `io.debezium.data.Json` → the parsed JSON value.
//!
//! Columns whose schema names no logical type pass through unchanged.

use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveTime};
use num_bigint::BigInt;
use serde_json::Value;

use crate::event::Row;

/// Largest decimal scale accepted: PostgreSQL's numeric allows 16383 digits after the point,
/// anything beyond is a corrupt schema rather than data.
const MAX_DECIMAL_SCALE: u64 = 16_383;

/// The compiled schemas of an envelope's `before` and `after` images.
#[derive(Debug)]
pub struct EnvelopeSchema {
    /// Converter of the `before` image, if the schema describes one.
    pub before: Option<RowSchema>,
    /// Converter of the `after` image, if the schema describes one.
    pub after: Option<RowSchema>,
}

impl EnvelopeSchema {
    /// Compiles the envelope schema (`{"type":"struct","fields":[{"field":"before",…},…]}`).
    pub fn compile(schema: &Value) -> Result<Self, String> {
        let fields = schema
            .get("fields")
            .and_then(Value::as_array)
            .ok_or("`schema` has no `fields` array")?;
        let image = |name: &str| -> Result<Option<RowSchema>, String> {
            match fields
                .iter()
                .find(|f| f.get("field").and_then(Value::as_str) == Some(name))
            {
                Some(f) => RowSchema::compile(f)
                    .map(Some)
                    .map_err(|e| format!("schema of `{name}`: {e}")),
                None => Ok(None),
            }
        };
        Ok(Self {
            before: image("before")?,
            after: image("after")?,
        })
    }
}

/// The logical-type conversions of one struct's columns.
#[derive(Debug, Default)]
pub struct RowSchema {
    columns: Vec<(String, Logical)>,
}

#[derive(Debug)]
enum Logical {
    Decimal { scale: u32 },
    VariableScaleDecimal,
    EpochMillis,
    EpochMicros,
    EpochNanos,
    Date,
    TimeMillis,
    TimeMicros,
    TimeNanos,
    Zoned,
    Json,
    Struct(RowSchema),
}

impl RowSchema {
    /// Compiles the `fields` of a struct schema; only columns with a logical type are kept.
    pub fn compile(schema: &Value) -> Result<Self, String> {
        let mut columns = Vec::new();
        let Some(fields) = schema.get("fields").and_then(Value::as_array) else {
            return Ok(Self::default());
        };
        for field in fields {
            let Some(col) = field.get("field").and_then(Value::as_str) else {
                return Err("a field without a `field` name".into());
            };
            if let Some(logical) =
                Logical::compile(field).map_err(|e| format!("column `{col}`: {e}"))?
            {
                columns.push((col.to_owned(), logical));
            }
        }
        Ok(Self { columns })
    }

    /// Converts the logical-typed columns of `row` (a row, or a struct's fields) in place.
    pub fn convert(&self, row: &mut impl Fields) -> Result<(), String> {
        for (col, logical) in &self.columns {
            if let Some(v) = row.field_mut(col.as_str()) {
                if !v.is_null() {
                    logical
                        .convert(v)
                        .map_err(|e| format!("column `{col}`: {e}"))?;
                }
            }
        }
        Ok(())
    }
}

/// What logical values are converted in: a row's columns or a struct's fields.
pub trait Fields {
    /// The value named `name`, to change.
    fn field_mut(&mut self, name: &str) -> Option<&mut Value>;
}

impl Fields for Row {
    fn field_mut(&mut self, name: &str) -> Option<&mut Value> {
        self.get_mut(name)
    }
}

impl Fields for serde_json::Map<String, Value> {
    fn field_mut(&mut self, name: &str) -> Option<&mut Value> {
        self.get_mut(name)
    }
}

impl Logical {
    fn compile(field: &Value) -> Result<Option<Self>, String> {
        let name = field.get("name").and_then(Value::as_str).unwrap_or("");
        Ok(Some(match name {
            "org.apache.kafka.connect.data.Decimal" => {
                let raw = field.get("parameters").and_then(|p| p.get("scale"));
                let scale = match raw {
                    Some(Value::String(s)) => s.parse::<u64>().ok(),
                    Some(Value::Number(n)) => n.as_u64(),
                    _ => None,
                };
                match scale {
                    Some(s) if s <= MAX_DECIMAL_SCALE => Logical::Decimal { scale: s as u32 },
                    _ => {
                        let shown = raw.map_or_else(|| "missing".to_owned(), Value::to_string);
                        return Err(format!(
                            "Decimal scale {shown} is not an integer between 0 and {MAX_DECIMAL_SCALE}"
                        ));
                    }
                }
            }
            "io.debezium.data.VariableScaleDecimal" => Logical::VariableScaleDecimal,
            "io.debezium.time.Timestamp" | "org.apache.kafka.connect.data.Timestamp" => {
                Logical::EpochMillis
            }
            "io.debezium.time.MicroTimestamp" => Logical::EpochMicros,
            "io.debezium.time.NanoTimestamp" => Logical::EpochNanos,
            "io.debezium.time.Date" | "org.apache.kafka.connect.data.Date" => Logical::Date,
            "io.debezium.time.Time" | "org.apache.kafka.connect.data.Time" => Logical::TimeMillis,
            "io.debezium.time.MicroTime" => Logical::TimeMicros,
            "io.debezium.time.NanoTime" => Logical::TimeNanos,
            "io.debezium.time.ZonedTimestamp" => Logical::Zoned,
            "io.debezium.data.Json" => Logical::Json,
            _ if field.get("type").and_then(Value::as_str) == Some("struct") => {
                let inner = RowSchema::compile(field)?;
                if inner.columns.is_empty() {
                    return Ok(None);
                }
                Logical::Struct(inner)
            }
            _ => return Ok(None),
        }))
    }

    fn convert(&self, v: &mut Value) -> Result<(), String> {
        let converted = match self {
            Logical::Decimal { scale } => {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("Decimal value {v} is not a base64 string"))?;
                Value::String(decimal_from_base64(s, *scale)?)
            }
            Logical::VariableScaleDecimal => {
                let scale = v
                    .get("scale")
                    .and_then(Value::as_u64)
                    .filter(|s| *s <= MAX_DECIMAL_SCALE);
                let bytes = v.get("value").and_then(Value::as_str);
                match (scale, bytes) {
                    (Some(scale), Some(b)) => Value::String(decimal_from_base64(b, scale as u32)?),
                    _ => {
                        return Err(format!(
                            "VariableScaleDecimal {v} lacks a valid `scale` or `value`"
                        ));
                    }
                }
            }
            Logical::EpochMillis => timestamp(v, 1_000_000)?,
            Logical::EpochMicros => timestamp(v, 1_000)?,
            Logical::EpochNanos => timestamp(v, 1)?,
            Logical::Date => {
                let days = v
                    .as_i64()
                    .ok_or_else(|| format!("Date value {v} is not an integer"))?;
                let date = NaiveDate::from_ymd_opt(1970, 1, 1)
                    .and_then(|d| d.checked_add_signed(chrono::Duration::days(days)))
                    .ok_or_else(|| format!("Date value {days} is out of range"))?;
                Value::String(date.format("%Y-%m-%d").to_string())
            }
            Logical::TimeMillis => time_of_day(v, 1_000_000)?,
            Logical::TimeMicros => time_of_day(v, 1_000)?,
            Logical::TimeNanos => time_of_day(v, 1)?,
            Logical::Zoned => {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("ZonedTimestamp value {v} is not a string"))?;
                DateTime::parse_from_rfc3339(s)
                    .map_err(|e| format!("ZonedTimestamp `{s}` is not ISO-8601: {e}"))?;
                return Ok(());
            }
            Logical::Json => {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("Json value {v} is not a string"))?;
                serde_json::from_str(s).map_err(|e| format!("Json value is not valid JSON: {e}"))?
            }
            Logical::Struct(inner) => {
                let Value::Object(row) = v else {
                    return Err(format!("struct value {v} is not an object"));
                };
                return inner.convert(row);
            }
        };
        *v = converted;
        Ok(())
    }
}

/// Decodes Kafka Connect's Decimal: base64 of the two's-complement big-endian unscaled integer.
pub fn decimal_from_base64(b64: &str, scale: u32) -> Result<String, String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("Decimal value `{b64}` is not base64: {e}"))?;
    if bytes.is_empty() {
        return Err("Decimal value is empty".into());
    }
    Ok(scale_decimal(
        &BigInt::from_signed_bytes_be(&bytes).to_string(),
        scale,
    ))
}

/// Places the decimal point `scale` digits from the right of an integer's decimal digits.
fn scale_decimal(unscaled: &str, scale: u32) -> String {
    let (sign, digits) = match unscaled.strip_prefix('-') {
        Some(d) => ("-", d),
        None => ("", unscaled),
    };
    let scale = scale as usize;
    if scale == 0 {
        return format!("{sign}{digits}");
    }
    let padded = if digits.len() <= scale {
        format!("{}{digits}", "0".repeat(scale + 1 - digits.len()))
    } else {
        digits.to_owned()
    };
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{sign}{int}.{frac}")
}

fn timestamp(v: &Value, nanos_per_unit: i64) -> Result<Value, String> {
    let n = v
        .as_i64()
        .ok_or_else(|| format!("timestamp value {v} is not an integer"))?;
    let secs = n.div_euclid(1_000_000_000 / nanos_per_unit);
    let sub = n.rem_euclid(1_000_000_000 / nanos_per_unit) * nanos_per_unit;
    let dt = DateTime::from_timestamp(secs, sub as u32)
        .ok_or_else(|| format!("timestamp {n} is out of range"))?;
    Ok(Value::String(
        dt.naive_utc().format("%Y-%m-%dT%H:%M:%S%.6f").to_string(),
    ))
}

fn time_of_day(v: &Value, nanos_per_unit: i64) -> Result<Value, String> {
    let n = v
        .as_i64()
        .ok_or_else(|| format!("time value {v} is not an integer"))?;
    let nanos = n
        .checked_mul(nanos_per_unit)
        .ok_or_else(|| format!("time {n} is out of range"))?;
    let t = NaiveTime::from_num_seconds_from_midnight_opt(
        (nanos / 1_000_000_000) as u32,
        (nanos % 1_000_000_000) as u32,
    )
    .filter(|_| nanos >= 0)
    .ok_or_else(|| format!("time {n} is not within a day"))?;
    Ok(Value::String(t.format("%H:%M:%S%.6f").to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_keep_every_digit() {
        // (unscaled bytes, scale, expected)
        let cases: &[(&[u8], u32, &str)] = &[
            (&[0x30, 0x39], 2, "123.45"),  // 12345
            (&[0xcf, 0xc7], 2, "-123.45"), // -12345
            (&[0x05], 2, "0.05"),
            (&[0xfb], 3, "-0.005"),
            (&[0x00], 0, "0"),
            (&[0x01, 0x00], 0, "256"),
            (
                &[0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                4,
                "236118324143482260.6847",
            ),
        ];
        for (bytes, scale, want) in cases {
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            assert_eq!(
                decimal_from_base64(&b64, *scale).unwrap(),
                *want,
                "bytes {bytes:?} scale {scale}"
            );
        }
    }

    #[test]
    fn time_types_render_iso() {
        assert_eq!(
            timestamp(&Value::from(1_700_000_000_123_456i64), 1_000).unwrap(),
            "2023-11-14T22:13:20.123456"
        );
        assert_eq!(
            timestamp(&Value::from(-1i64), 1_000).unwrap(),
            "1969-12-31T23:59:59.999999"
        );
        assert_eq!(
            timestamp(&Value::from(1_700_000_000_123i64), 1_000_000).unwrap(),
            "2023-11-14T22:13:20.123000"
        );
        assert_eq!(
            time_of_day(&Value::from(3_600_000_001i64), 1_000).unwrap(),
            "01:00:00.000001"
        );
        assert!(time_of_day(&Value::from(-5i64), 1_000).is_err());
    }

    #[test]
    fn bad_scales_are_rejected_with_the_reason() {
        for params in [
            r#"{"scale":"x"}"#,
            r#"{"scale":"-2"}"#,
            r#"{}"#,
            r#"{"scale":"99999"}"#,
        ] {
            let field: Value = serde_json::from_str(&format!(
                r#"{{"type":"bytes","name":"org.apache.kafka.connect.data.Decimal","parameters":{params},"field":"p"}}"#
            ))
            .unwrap();
            let err = Logical::compile(&field).unwrap_err();
            assert!(err.contains("Decimal scale"), "{params}: {err}");
        }
    }
}
