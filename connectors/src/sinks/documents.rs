//! What document sinks share: a batch of document operations cut at its truncates, the last
//! operation per key winning within each piece.

use std::collections::HashMap;
use std::sync::Arc;

use refract_schemas::write::DocumentOp;
use refract_schemas::{Position, Row};

/// The part of a batch between two truncates.
pub(crate) struct Segment<'a> {
    /// The operation that won for each key of the segment, in batch order.
    pub(crate) winners: Vec<Keyed<'a>>,
    /// Operations made redundant by a later one on the same key.
    pub(crate) coalesced: u64,
    /// The truncate that ends the segment (applied after its winners), if any.
    pub(crate) truncate: Option<Truncate<'a>>,
}

/// A keyed document operation.
#[derive(Clone, Copy)]
pub(crate) enum Keyed<'a> {
    /// Create or replace the document.
    Upsert {
        collection: &'a Arc<str>,
        key: &'a str,
        doc: &'a Arc<Row>,
        position: &'a Position,
    },
    /// Remove the document.
    Delete {
        collection: &'a Arc<str>,
        key: &'a str,
        position: &'a Position,
    },
}

impl<'a> Keyed<'a> {
    /// The document's collection.
    pub(crate) fn collection(&self) -> &'a Arc<str> {
        match *self {
            Keyed::Upsert { collection, .. } | Keyed::Delete { collection, .. } => collection,
        }
    }

    /// The document's key.
    pub(crate) fn key(&self) -> &'a str {
        match *self {
            Keyed::Upsert { key, .. } | Keyed::Delete { key, .. } => key,
        }
    }

    /// Position of the change that produced the operation.
    pub(crate) fn position(&self) -> &'a Position {
        match *self {
            Keyed::Upsert { position, .. } | Keyed::Delete { position, .. } => position,
        }
    }
}

/// A truncate of a collection.
#[derive(Clone, Copy)]
pub(crate) struct Truncate<'a> {
    /// The collection to empty.
    pub(crate) collection: &'a Arc<str>,
    /// Where the truncate happened: documents written after it stay.
    pub(crate) position: &'a Position,
}

/// `ops` cut after each truncate; in each segment, the last operation per (collection, key).
pub(crate) fn segments<'a>(ops: &[&'a DocumentOp]) -> Vec<Segment<'a>> {
    let mut out = Vec::new();
    let mut body: Vec<Keyed<'a>> = Vec::new();
    for op in ops {
        match op {
            DocumentOp::Upsert {
                collection,
                key,
                doc,
                position,
            } => body.push(Keyed::Upsert {
                collection,
                key,
                doc,
                position,
            }),
            DocumentOp::Delete {
                collection,
                key,
                position,
            } => body.push(Keyed::Delete {
                collection,
                key,
                position,
            }),
            DocumentOp::Truncate {
                collection,
                position,
            } => out.push(segment(
                std::mem::take(&mut body),
                Some(Truncate {
                    collection,
                    position,
                }),
            )),
        }
    }
    if !body.is_empty() {
        out.push(segment(body, None));
    }
    out
}

/// The segment of `body`: the last operation per key wins, batch order kept.
fn segment<'a>(body: Vec<Keyed<'a>>, truncate: Option<Truncate<'a>>) -> Segment<'a> {
    let mut last: HashMap<(&str, &str), usize> = HashMap::with_capacity(body.len());
    for (i, op) in body.iter().enumerate() {
        last.insert((op.collection(), op.key()), i);
    }
    let coalesced = (body.len() - last.len()) as u64;
    let winners = body
        .into_iter()
        .enumerate()
        .filter(|(i, op)| last.get(&(&**op.collection(), op.key())) == Some(i))
        .map(|(_, op)| op)
        .collect();
    Segment {
        winners,
        coalesced,
        truncate,
    }
}

#[cfg(test)]
mod tests {
    use refract_schemas::Offset;

    use super::*;

    fn at(n: u64) -> Position {
        Position {
            partition: "p".into(),
            offset: Offset(n, 0),
        }
    }

    fn upsert(key: &str, n: u64) -> DocumentOp {
        DocumentOp::Upsert {
            collection: "c".into(),
            key: key.into(),
            doc: Arc::new(Row::new()),
            position: at(n),
        }
    }

    fn delete(key: &str, n: u64) -> DocumentOp {
        DocumentOp::Delete {
            collection: "c".into(),
            key: key.into(),
            position: at(n),
        }
    }

    /// `U key@n`, `D key@n`, then `T@n` for the truncate.
    fn render(segments: &[Segment<'_>]) -> Vec<String> {
        segments
            .iter()
            .map(|s| {
                let mut parts: Vec<String> = s
                    .winners
                    .iter()
                    .map(|op| match op {
                        Keyed::Upsert { key, position, .. } => {
                            format!("U {key}@{}", position.offset.0)
                        }
                        Keyed::Delete { key, position, .. } => {
                            format!("D {key}@{}", position.offset.0)
                        }
                    })
                    .collect();
                if let Some(t) = s.truncate {
                    parts.push(format!("T@{}", t.position.offset.0));
                }
                format!("{} (coalesced {})", parts.join(" "), s.coalesced)
            })
            .collect()
    }

    #[test]
    fn the_last_operation_per_key_wins_within_each_segment() {
        let truncate = DocumentOp::Truncate {
            collection: "c".into(),
            position: at(4),
        };
        let ops = [
            upsert("a", 1),
            upsert("b", 2),
            delete("a", 3),
            truncate,
            upsert("a", 5),
            upsert("a", 6),
        ];
        let refs: Vec<&DocumentOp> = ops.iter().collect();
        assert_eq!(
            render(&segments(&refs)),
            ["U b@2 D a@3 T@4 (coalesced 1)", "U a@6 (coalesced 1)"]
        );
    }

    #[test]
    fn keys_of_different_collections_do_not_coalesce() {
        let other = DocumentOp::Upsert {
            collection: "d".into(),
            key: "a".into(),
            doc: Arc::new(Row::new()),
            position: at(2),
        };
        let ops = [upsert("a", 1), other];
        let refs: Vec<&DocumentOp> = ops.iter().collect();
        assert_eq!(render(&segments(&refs)), ["U a@1 U a@2 (coalesced 0)"]);
    }
}
