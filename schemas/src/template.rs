//! Key templates: strings with `{column}` placeholders rendered from a row image, as cache keys
//! are written in pipeline files (`product:{id}:v3`, `product:sku:{sku}:v3`).
//!
//! Syntax:
//! - `{column}`: the column's value as text (strings as they are, numbers and booleans as JSON
//!   writes them). A null or absent column means the key cannot be built from that row image.
//! - `[ ... ]`: an optional segment (`[tenant:{tenant_id}:]product:{id}:v3`): rendered when
//!   every column inside it has a value, left out when one is null. A column absent from the row
//!   image still means the key cannot be built: absent is "unknown", null is "none".
//! - `{{`, `}}`, `[[`, `]]`: literal braces and brackets.

use serde_json::Value;

use crate::Row;

/// A parsed key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTemplate {
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Column(String),
    Optional(Vec<Part>),
}

/// Why a key could not be rendered from a row image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenderError {
    /// The row image does not carry the column (e.g. an old row limited by the replica identity).
    Absent(String),
    /// The column is null outside an optional segment.
    Null(String),
}

impl KeyTemplate {
    /// Parses `text`; the error says what is wrong and where.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut chars = text.char_indices().peekable();
        let mut stack: Vec<Vec<Part>> = vec![Vec::new()];
        let mut literal = String::new();
        let flush = |literal: &mut String, parts: &mut Vec<Part>| {
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(literal)));
            }
        };
        while let Some((at, c)) = chars.next() {
            match c {
                '{' | '}' | '[' | ']' if chars.peek().map(|&(_, n)| n) == Some(c) => {
                    chars.next();
                    literal.push(c);
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some((_, '}')) => break,
                            Some((_, ch)) if !matches!(ch, '{' | '[' | ']') => name.push(ch),
                            _ => return Err(format!("`{text}`: `{{` at byte {at} is not closed")),
                        }
                    }
                    if name.trim().is_empty() {
                        return Err(format!("`{text}`: empty column name at byte {at}"));
                    }
                    let parts = stack.last_mut().expect("never empty");
                    flush(&mut literal, parts);
                    parts.push(Part::Column(name.trim().to_owned()));
                }
                '}' => return Err(format!("`{text}`: unmatched `}}` at byte {at}")),
                '[' => {
                    if stack.len() > 1 {
                        return Err(format!(
                            "`{text}`: optional segments do not nest (byte {at})"
                        ));
                    }
                    flush(&mut literal, stack.last_mut().expect("never empty"));
                    stack.push(Vec::new());
                }
                ']' => {
                    if stack.len() == 1 {
                        return Err(format!("`{text}`: unmatched `]` at byte {at}"));
                    }
                    let mut inner = stack.pop().expect("checked");
                    flush(&mut literal, &mut inner);
                    if !inner.iter().any(|p| matches!(p, Part::Column(_))) {
                        return Err(format!(
                            "`{text}`: the optional segment ending at byte {at} names no column"
                        ));
                    }
                    stack
                        .last_mut()
                        .expect("never empty")
                        .push(Part::Optional(inner));
                }
                c => literal.push(c),
            }
        }
        if stack.len() > 1 {
            return Err(format!("`{text}`: `[` is not closed"));
        }
        let mut parts = stack.pop().expect("never empty");
        flush(&mut literal, &mut parts);
        if !parts.iter().any(|p| !matches!(p, Part::Literal(_))) {
            return Err(format!(
                "`{text}`: names no column (every row would share one key)"
            ));
        }
        Ok(Self {
            text: text.to_owned(),
            parts,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Every column the template reads, in order of appearance.
    pub fn columns(&self) -> Vec<&str> {
        fn walk<'a>(parts: &'a [Part], out: &mut Vec<&'a str>) {
            for p in parts {
                match p {
                    Part::Column(c) if !out.contains(&c.as_str()) => out.push(c),
                    Part::Optional(inner) => walk(inner, out),
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.parts, &mut out);
        out
    }

    /// Renders the key from `row`.
    pub fn render(&self, row: &Row) -> Result<String, RenderError> {
        let mut out = String::with_capacity(self.text.len() + 16);
        for part in &self.parts {
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Column(c) => push_value(&mut out, c, row)?,
                Part::Optional(inner) => {
                    let mark = out.len();
                    for p in inner {
                        let done = match p {
                            Part::Literal(l) => {
                                out.push_str(l);
                                Ok(())
                            }
                            Part::Column(c) => push_value(&mut out, c, row),
                            Part::Optional(_) => unreachable!("segments do not nest"),
                        };
                        match done {
                            Ok(()) => {}
                            Err(RenderError::Null(_)) => {
                                out.truncate(mark);
                                break;
                            }
                            Err(absent) => return Err(absent),
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

fn push_value(out: &mut String, column: &str, row: &Row) -> Result<(), RenderError> {
    match row.get(column) {
        None => Err(RenderError::Absent(column.to_owned())),
        Some(Value::Null) => Err(RenderError::Null(column.to_owned())),
        Some(Value::String(s)) => {
            out.push_str(s);
            Ok(())
        }
        Some(other) => {
            use std::fmt::Write;
            let _ = write!(out, "{other}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn row(v: Value) -> Row {
        v.as_object().unwrap().clone().into()
    }

    #[test]
    fn renders_columns_optional_segments_and_escapes() {
        let t = KeyTemplate::parse("[t:{tenant_id}:]product:{id}:v3").unwrap();
        assert_eq!(t.columns(), vec!["tenant_id", "id"]);
        let full = row(json!({"id": 7, "tenant_id": "acme"}));
        assert_eq!(t.render(&full).unwrap(), "t:acme:product:7:v3");
        let no_tenant = row(json!({"id": 7, "tenant_id": null}));
        assert_eq!(t.render(&no_tenant).unwrap(), "product:7:v3");
        let unknown = row(json!({"id": 7}));
        assert_eq!(
            t.render(&unknown),
            Err(RenderError::Absent("tenant_id".into()))
        );
        let t = KeyTemplate::parse("{{x}}:[[{sku}]]").unwrap();
        assert_eq!(t.render(&row(json!({"sku": "A-1"}))).unwrap(), "{x}:[A-1]");
        assert_eq!(
            t.render(&row(json!({"sku": null}))),
            Err(RenderError::Null("sku".into()))
        );
    }

    #[test]
    fn rejects_malformed_templates() {
        for bad in [
            "product:{id",
            "product:id}",
            "product:{}",
            "[x:{a}",
            "x]",
            "[[a]]",
            "plain",
            "[a:[{b}]]x",
            "[lit]{id}",
        ] {
            assert!(KeyTemplate::parse(bad).is_err(), "{bad} must be rejected");
        }
    }
}
