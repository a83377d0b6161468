//! The fast path of record keys: most Debezium keys are one integer column (`{"id":42}`), read
//! here without building a JSON map, into a row that shares its column names with the keys
//! before it. Anything else (more columns, strings, a wrapped key, white space inside a name,
//! escapes) is left to the general path, which gives the same row.

use serde_json::Value;

use crate::event::{Columns, Row};

/// Keys that share one [`Columns`] before it is copied: rows are dropped on another thread, and
/// one reference count written by both would bounce between them (as [`crate::row`] does for
/// the rows it deserializes).
const SHARED_KEYS: u32 = 4096;

/// Digits of the longest integer read here: any 18 digits fit in an `i64`; longer ones take
/// the general path.
const MAX_DIGITS: usize = 18;

/// The column names of the simple key read last.
#[derive(Default)]
pub(crate) struct SimpleKeys {
    columns: Columns,
    uses: u32,
}

impl SimpleKeys {
    /// The row of `bytes` when they are a JSON object of one integer column; `None` (take the
    /// general path) otherwise.
    pub(crate) fn row(&mut self, bytes: &[u8]) -> Option<Row> {
        let (name, value) = one_integer_column(bytes)?;
        if self.columns.names().first().map(String::as_str) != Some(name)
            || self.uses >= SHARED_KEYS
        {
            self.columns = std::iter::once(name.to_owned()).collect();
            self.uses = 0;
        }
        self.uses += 1;
        Some(Row::from_columns(self.columns.clone(), vec![value]))
    }
}

/// `{"name":123}`, with optional white space around the tokens: the name and the number as
/// serde_json reads it (a non-negative one as an unsigned integer).
fn one_integer_column(bytes: &[u8]) -> Option<(&str, Value)> {
    let mut r = Reader { bytes, at: 0 };
    r.expect(b'{')?;
    r.expect(b'"')?;
    let start = r.at;
    // A name without escapes: the bytes up to the next quote.
    let len = bytes[start..].iter().position(|b| *b == b'"')?;
    let name = &bytes[start..start + len];
    if name.iter().any(|b| *b == b'\\' || *b < 0x20) {
        return None;
    }
    let name = std::str::from_utf8(name).ok()?;
    r.at = start + len + 1;
    r.expect(b':')?;
    r.skip_space();
    let value = r.integer()?;
    r.expect(b'}')?;
    r.skip_space();
    (r.at == bytes.len()).then_some((name, value))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn skip_space(&mut self) {
        while self
            .bytes
            .get(self.at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.at += 1;
        }
    }

    /// Skips white space, then the byte `b`.
    fn expect(&mut self, b: u8) -> Option<()> {
        self.skip_space();
        (self.bytes.get(self.at) == Some(&b)).then(|| self.at += 1)
    }

    /// An integer as JSON writes it: an optional minus, no leading zero, no fraction or
    /// exponent (those take the general path).
    fn integer(&mut self) -> Option<Value> {
        let negative = self.bytes.get(self.at) == Some(&b'-');
        if negative {
            self.at += 1;
        }
        let digits = self.bytes[self.at..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let text = &self.bytes[self.at..self.at + digits];
        if digits == 0 || digits > MAX_DIGITS || (digits > 1 && text[0] == b'0') {
            return None;
        }
        if matches!(self.bytes.get(self.at + digits), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        self.at += digits;
        let n = text.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
        Some(match negative {
            true if n != 0 => Value::from(-n),
            // `-0` is read by serde_json as the float -0.0: the general path.
            true => return None,
            false => Value::from(n as u64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The general path's row of `text`.
    fn general(text: &str) -> Row {
        let map: serde_json::Map<String, Value> = serde_json::from_str(text).unwrap();
        map.into()
    }

    #[test]
    fn a_simple_key_gives_the_general_paths_row() {
        let mut keys = SimpleKeys::default();
        for text in [
            r#"{"id":42}"#,
            r#"{"id":0}"#,
            r#"{"id":-7}"#,
            r#" { "id" : 123456789012345678 } "#,
            "{\"order_id\":\n9}\n",
            r#"{"id":-123456789012345678}"#,
            r#"{"":1}"#,
        ] {
            let row = keys.row(text.as_bytes()).expect(text);
            assert_eq!(row, general(text), "{text}");
            assert_eq!(
                serde_json::to_string(&row).unwrap(),
                serde_json::to_string(&general(text)).unwrap()
            );
        }
    }

    #[test]
    fn other_keys_take_the_general_path() {
        let mut keys = SimpleKeys::default();
        for text in [
            r#"{"id":"42"}"#,
            r#"{"id":1.5}"#,
            r#"{"id":1e3}"#,
            r#"{"id":-0}"#,
            r#"{"id":01}"#,
            r#"{"id":1234567890123456789}"#,
            r#"{"id":1,"b":2}"#,
            r#"{"i\"d":1}"#,
            r#"{"i\u0064":1}"#,
            r#"{"id":null}"#,
            r#"{"id":1}x"#,
            r#"{"id":1"#,
            r#"{"schema":{},"payload":{"id":1}}"#,
            "null",
            "[1]",
            "",
        ] {
            assert!(keys.row(text.as_bytes()).is_none(), "{text}");
        }
    }

    #[test]
    fn keys_of_another_name_get_their_own_columns() {
        let mut keys = SimpleKeys::default();
        let a = keys.row(br#"{"id":1}"#).unwrap();
        let b = keys.row(br#"{"sku":2}"#).unwrap();
        assert_eq!(a, general(r#"{"id":1}"#));
        assert_eq!(b, general(r#"{"sku":2}"#));
    }
}
