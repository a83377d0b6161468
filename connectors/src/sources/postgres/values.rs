//! PostgreSQL text-format values to JSON, by type OID (the mapping the PostgreSQL source uses).
//!
//! | type | JSON |
//! |---|---|
//! | int2, int4, int8, oid | number |
//! | numeric | string, every digit kept (`"12.50"`, `"NaN"`) |
//! | float4, float8 | number; `NaN`/`Infinity`/`-Infinity` as strings |
//! | bool | true / false |
//! | text, varchar, bpchar, name, uuid, enums and other types | string |
//! | timestamp | `"YYYY-MM-DDTHH:MM:SS[.ffffff]"` |
//! | timestamptz | RFC 3339 in UTC (`"…Z"`) |
//! | date, time, timetz, interval | PostgreSQL's text (ISO dates with `DateStyle=ISO`) |
//! | json, jsonb | the parsed JSON value |
//! | bytea | `"\\x…"` hex as PostgreSQL prints it |
//! | one-dimensional arrays of the above | arrays |

use std::borrow::Cow;
use std::sync::LazyLock;

use chrono::format::{Item, Parsed, StrftimeItems};
use serde_json::{Number, Value};

/// Type OIDs with a dedicated conversion (`pg_type.oid`, stable across versions).
pub mod oid {
    pub const BOOL: u32 = 16;
    pub const BYTEA: u32 = 17;
    pub const NAME: u32 = 19;
    pub const INT8: u32 = 20;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const TEXT: u32 = 25;
    pub const OID: u32 = 26;
    pub const JSON: u32 = 114;
    pub const FLOAT4: u32 = 700;
    pub const FLOAT8: u32 = 701;
    pub const BPCHAR: u32 = 1042;
    pub const VARCHAR: u32 = 1043;
    pub const DATE: u32 = 1082;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
    pub const NUMERIC: u32 = 1700;
    pub const UUID: u32 = 2950;
    pub const JSONB: u32 = 3802;
    pub const BOOL_ARRAY: u32 = 1000;
    pub const INT2_ARRAY: u32 = 1005;
    pub const INT4_ARRAY: u32 = 1007;
    pub const TEXT_ARRAY: u32 = 1009;
    pub const VARCHAR_ARRAY: u32 = 1015;
    pub const INT8_ARRAY: u32 = 1016;
    pub const FLOAT4_ARRAY: u32 = 1021;
    pub const FLOAT8_ARRAY: u32 = 1022;
    pub const NUMERIC_ARRAY: u32 = 1231;
    pub const UUID_ARRAY: u32 = 2951;
    pub const JSONB_ARRAY: u32 = 3807;
}

/// The timestamp formats, parsed once: chrono parses a format string again on every call that
/// takes one as text, and that parse was the source's largest cost on tables with timestamps
/// (every value of every row goes through here).
struct Formats {
    /// PostgreSQL's text of a `timestamp`: `2026-09-22 10:31:00.5`.
    pg_timestamp: Vec<Item<'static>>,
    /// PostgreSQL's text of a `timestamptz`, its offset padded to `+02:00`.
    pg_timestamptz: Vec<Item<'static>>,
    /// What a `timestamp` becomes: `2026-09-22T10:31:00.500`.
    iso: Vec<Item<'static>>,
    /// What a `timestamptz` becomes, in UTC: `2026-09-22T08:31:00.500Z`.
    iso_utc: Vec<Item<'static>>,
}

fn formats() -> &'static Formats {
    static FORMATS: LazyLock<Formats> = LazyLock::new(|| Formats {
        pg_timestamp: StrftimeItems::new("%Y-%m-%d %H:%M:%S%.f").collect(),
        pg_timestamptz: StrftimeItems::new("%Y-%m-%d %H:%M:%S%.f%:z").collect(),
        iso: StrftimeItems::new("%Y-%m-%dT%H:%M:%S%.f").collect(),
        iso_utc: StrftimeItems::new("%Y-%m-%dT%H:%M:%S%.fZ").collect(),
    });
    &FORMATS
}

/// `text` parsed by `items` (what `parse_from_str` does with a format string).
fn parse(text: &str, items: &[Item<'static>]) -> Option<Parsed> {
    let mut parsed = Parsed::new();
    chrono::format::parse(&mut parsed, text, items.iter()).ok()?;
    Some(parsed)
}

/// Converts one text-format value of type `type_oid`; the error says why it does not parse.
pub fn text_to_json(type_oid: u32, text: &str) -> Result<Value, String> {
    let bad = |what: &str| format!("`{text}` is not a valid {what}");
    Ok(match type_oid {
        oid::INT2 | oid::INT4 | oid::INT8 | oid::OID => {
            Value::Number(text.parse::<i64>().map_err(|_| bad("integer"))?.into())
        }
        oid::NUMERIC => {
            let valid = text == "NaN"
                || text == "Infinity"
                || text == "-Infinity"
                // Bytes, not chars: every accepted character is ASCII, and no byte of a
                // multi-byte character is.
                || (text.bytes().any(|c| c.is_ascii_digit())
                    && text.trim_start_matches(['-', '+']).bytes().all(|c| {
                        c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'-' | b'+')
                    }));
            if !valid {
                return Err(bad("numeric"));
            }
            Value::String(text.to_owned())
        }
        oid::FLOAT4 | oid::FLOAT8 => match text {
            "NaN" | "Infinity" | "-Infinity" => Value::String(text.to_owned()),
            _ => Number::from_f64(text.parse::<f64>().map_err(|_| bad("float"))?)
                .map_or(Value::String(text.to_owned()), Value::Number),
        },
        oid::BOOL => match text {
            "t" => Value::Bool(true),
            "f" => Value::Bool(false),
            _ => return Err(bad("boolean")),
        },
        oid::JSON | oid::JSONB => {
            serde_json::from_str(text).map_err(|e| format!("invalid JSON value: {e}"))?
        }
        oid::TIMESTAMP => {
            let t = parse(text, &formats().pg_timestamp)
                .and_then(|p| p.to_naive_datetime_with_offset(0).ok())
                .ok_or_else(|| bad("timestamp"))?;
            Value::String(t.format_with_items(formats().iso.iter()).to_string())
        }
        oid::TIMESTAMPTZ => {
            // PostgreSQL prints `2026-09-22 10:31:00.5+02` (offset hours, maybe minutes).
            let normalized = match text.rfind(['+', '-']) {
                Some(i) if i > 10 && text.len() - i == 3 => Cow::Owned(format!("{text}:00")),
                _ => Cow::Borrowed(text),
            };
            let t = parse(&normalized, &formats().pg_timestamptz)
                .and_then(|p| p.to_datetime().ok())
                .ok_or_else(|| bad("timestamptz"))?;
            Value::String(
                t.with_timezone(&chrono::Utc)
                    .format_with_items(formats().iso_utc.iter())
                    .to_string(),
            )
        }
        oid::BOOL_ARRAY => array(text, oid::BOOL)?,
        oid::INT2_ARRAY => array(text, oid::INT2)?,
        oid::INT4_ARRAY => array(text, oid::INT4)?,
        oid::INT8_ARRAY => array(text, oid::INT8)?,
        oid::TEXT_ARRAY | oid::VARCHAR_ARRAY => array(text, oid::TEXT)?,
        oid::FLOAT4_ARRAY | oid::FLOAT8_ARRAY => array(text, oid::FLOAT8)?,
        oid::NUMERIC_ARRAY => array(text, oid::NUMERIC)?,
        oid::UUID_ARRAY => array(text, oid::UUID)?,
        oid::JSONB_ARRAY => array(text, oid::JSONB)?,
        // text, varchar, bpchar, name, uuid, date, time, bytea (hex), enums, and every other type:
        // PostgreSQL's own text form.
        _ => Value::String(text.to_owned()),
    })
}

/// Parses a one-dimensional PostgreSQL array literal (`{1,2,NULL}`, `{"a b","c\"d"}`).
fn array(text: &str, element_oid: u32) -> Result<Value, String> {
    let inner = text
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .ok_or_else(|| format!("`{text}` is not an array literal"))?;
    let mut items = Vec::new();
    if inner.is_empty() {
        return Ok(Value::Array(items));
    }
    let mut chars = inner.chars().peekable();
    loop {
        let (element, quoted) = if chars.peek() == Some(&'"') {
            chars.next();
            let mut s = String::new();
            loop {
                match chars.next() {
                    Some('\\') => {
                        s.push(chars.next().ok_or("array literal ends inside an escape")?)
                    }
                    Some('"') => break,
                    Some(c) => s.push(c),
                    None => return Err("unterminated quoted array element".into()),
                }
            }
            (s, true)
        } else {
            let mut s = String::new();
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                if c == '{' {
                    return Err("multi-dimensional arrays are not supported".into());
                }
                s.push(c);
                chars.next();
            }
            (s, false)
        };
        items.push(if !quoted && element == "NULL" {
            Value::Null
        } else {
            text_to_json(element_oid, &element)?
        });
        match chars.next() {
            Some(',') => continue,
            None => break,
            Some(c) => return Err(format!("unexpected `{c}` in array literal")),
        }
    }
    Ok(Value::Array(items))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn table() {
        let cases: &[(u32, &str, Result<Value, &str>)] = &[
            (
                oid::INT8,
                "9223372036854775807",
                Ok(json!(9223372036854775807i64)),
            ),
            (oid::INT4, "-42", Ok(json!(-42))),
            (oid::INT4, "4x", Err("integer")),
            (
                oid::NUMERIC,
                "12345678901234567890.123456789",
                Ok(json!("12345678901234567890.123456789")),
            ),
            (oid::NUMERIC, "NaN", Ok(json!("NaN"))),
            (oid::NUMERIC, "abc", Err("numeric")),
            (oid::FLOAT8, "1.5", Ok(json!(1.5))),
            (oid::FLOAT4, "-Infinity", Ok(json!("-Infinity"))),
            (oid::BOOL, "t", Ok(json!(true))),
            (oid::BOOL, "yes", Err("boolean")),
            (oid::JSONB, r#"{"a": [1, 2]}"#, Ok(json!({"a": [1, 2]}))),
            (
                oid::TIMESTAMP,
                "2026-09-22 10:31:00.123456",
                Ok(json!("2026-09-22T10:31:00.123456")),
            ),
            (
                oid::TIMESTAMP,
                "2026-09-22 10:31:00",
                Ok(json!("2026-09-22T10:31:00")),
            ),
            (
                oid::TIMESTAMPTZ,
                "2026-09-22 10:31:00+02",
                Ok(json!("2026-09-22T08:31:00Z")),
            ),
            (
                oid::TIMESTAMPTZ,
                "2026-09-22 10:31:00.5-05:30",
                Ok(json!("2026-09-22T16:01:00.500Z")),
            ),
            (
                oid::UUID,
                "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
                Ok(json!("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")),
            ),
            (oid::TEXT, "it's \"quoted\"", Ok(json!("it's \"quoted\""))),
            (oid::BYTEA, "\\x0001ff", Ok(json!("\\x0001ff"))),
            (oid::DATE, "2026-09-22", Ok(json!("2026-09-22"))),
            (90_001, "happy", Ok(json!("happy"))), // an enum
            (oid::INT4_ARRAY, "{1,2,NULL}", Ok(json!([1, 2, null]))),
            (
                oid::TEXT_ARRAY,
                r#"{"a b","c\"d",NULL,"NULL",plain}"#,
                Ok(json!(["a b", "c\"d", null, "NULL", "plain"])),
            ),
            (oid::TEXT_ARRAY, "{}", Ok(json!([]))),
            (oid::INT4_ARRAY, "{{1,2},{3,4}}", Err("multi-dimensional")),
            (oid::TEXT_ARRAY, r#"{"open}"#, Err("unterminated")),
            (oid::TEXT_ARRAY, r#"{"open"#, Err("not an array literal")),
        ];
        for (oid, text, want) in cases {
            let got = text_to_json(*oid, text);
            match (got, want) {
                (Ok(g), Ok(w)) => assert_eq!(&g, w, "{oid} {text}"),
                (Err(e), Err(words)) => assert!(e.contains(words), "{oid} {text}: {e}"),
                (g, w) => panic!("{oid} {text}: got {g:?}, want {w:?}"),
            }
        }
    }
}
