//! Field paths: where a flat column's value sits in a row.
//!
//! `doc.shipping.address.city` names the column `doc`, then the fields `shipping`, `address` and
//! `city` inside its JSON value. A field followed by `[]` is an array whose elements the rest of
//! the path goes into: `doc.customer.contactDetails[].email`. Field names are the text between
//! dots; they cannot themselves contain `.`, `[` or `]`.

use std::fmt;

/// One step below the column.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// A field of an object.
    Field(String),
    /// Every element of an array.
    Each,
}

/// A parsed path.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FieldPath {
    /// The row's column.
    pub column: String,
    /// The steps inside the column's value.
    pub steps: Vec<Step>,
}

impl FieldPath {
    /// Parses `column.field[].field…`.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("a path must not be empty".into());
        }
        let mut column = None;
        let mut steps = Vec::new();
        for segment in text.split('.') {
            let (name, each) = match segment.strip_suffix("[]") {
                Some(name) => (name, true),
                None => (segment, false),
            };
            if name.is_empty() || name.contains(['[', ']']) {
                return Err(format!(
                    "`{text}`: `{segment}` is not a field name (optionally followed by `[]`)"
                ));
            }
            match column {
                None => column = Some(name.to_owned()),
                Some(_) => steps.push(Step::Field(name.to_owned())),
            }
            if each {
                steps.push(Step::Each);
            }
        }
        Ok(Self {
            column: column.expect("split yields at least one segment"),
            steps,
        })
    }

    /// Whether `self` starts with every step of `prefix` (same column).
    pub fn starts_with(&self, prefix: &FieldPath) -> bool {
        self.column == prefix.column
            && self.steps.len() >= prefix.steps.len()
            && self.steps[..prefix.steps.len()] == prefix.steps[..]
    }

    /// Whether the path goes into array elements anywhere.
    pub fn has_each(&self) -> bool {
        self.steps.contains(&Step::Each)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.column)?;
        for step in &self.steps {
            match step {
                Step::Field(name) => write!(f, ".{name}")?,
                Step::Each => f.write_str("[]")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_paths() {
        for (text, column, steps) in [
            ("id", "id", vec![]),
            (
                "doc.customer.id",
                "doc",
                vec![Step::Field("customer".into()), Step::Field("id".into())],
            ),
            (
                "doc.contact[].email",
                "doc",
                vec![
                    Step::Field("contact".into()),
                    Step::Each,
                    Step::Field("email".into()),
                ],
            ),
            ("tags[]", "tags", vec![Step::Each]),
        ] {
            let path = FieldPath::parse(text).unwrap();
            assert_eq!(path.column, column, "{text}");
            assert_eq!(path.steps, steps, "{text}");
            assert_eq!(path.to_string(), text);
        }
    }

    #[test]
    fn rejects_malformed_paths() {
        for text in ["", ".a", "a..b", "a.[]", "a[0]", "a.b]", "a[][]"] {
            assert!(FieldPath::parse(text).is_err(), "{text}");
        }
    }

    #[test]
    fn prefixes() {
        let items = FieldPath::parse("doc.items").unwrap();
        assert!(
            FieldPath::parse("doc.items[].sku")
                .unwrap()
                .starts_with(&items)
        );
        assert!(!FieldPath::parse("doc.item").unwrap().starts_with(&items));
        assert!(!FieldPath::parse("other.items").unwrap().starts_with(&items));
    }
}
