//! Assembling one document from the mirror.

use std::borrow::Cow;
use std::cmp::Ordering;

use refract_schemas::Row;
use serde_json::{Map, Value};

use super::mirror::{Id, indexed, load};
use super::shape::{Embed, Shape, THROUGH, Via, compare, document_key, text};
use crate::state::{StateError, StateStore};

/// Children kept before sorting and cutting to `limit`, beyond `limit` itself: bounds the
/// memory a root with many children takes when only the first few are listed.
const LIMIT_SLACK: usize = 256;

/// The document of root `id`; none when the root row does not exist.
pub(super) fn document(
    store: &mut dyn StateStore,
    shape: &Shape,
    id: &[String],
) -> Result<Option<Row>, StateError> {
    let Some(row) = load(store, shape.root, id)? else {
        return Ok(None);
    };
    let mut doc = Map::new();
    for f in &shape.fields {
        doc.insert(f.name.clone(), f.source.value(&row));
    }
    for e in &shape.embeds {
        // Embeds join on a one-column root key: the id's one part.
        let (items, count) = children(store, e, &id[0])?;
        doc.insert(e.name.clone(), Value::Array(items));
        if let Some(name) = &e.count {
            doc.insert(name.clone(), Value::from(count));
        }
    }
    for (name, items) in &shape.objects {
        let objects = items
            .iter()
            .filter_map(|f| {
                let v = f.source.value(&row);
                (!v.is_null()).then(|| Value::Object(Map::from_iter([(f.name.clone(), v)])))
            })
            .collect();
        doc.insert(name.clone(), Value::Array(objects));
    }
    Ok(Some(doc.into()))
}

/// One listed child while the children are gathered: what it sorts by and what it lists, not
/// its whole row, so that a root with a million children stays small (about 60 bytes each for
/// `ids = true` without `order_by` on a text key, 100 with).
struct Kept {
    sort: Sort,
    /// The child's document key: what `ids = true` lists, and the last tie-break.
    key: Box<str>,
    /// The listed fields, unless `ids = true`.
    fields: Option<Box<Map<String, Value>>>,
}

/// What a child sorts by: the `order_by` values, then the child key's.
enum Sort {
    /// No `order_by`, and the child key is one column holding the document key's text: the
    /// values would repeat `key`, so they are not kept (a `Value` and a string less for each
    /// of a million children).
    Key,
    Values(Box<[Value]>),
}

impl Kept {
    fn new(e: &Embed, id: &[String], row: &Row) -> Self {
        let key = document_key(id);
        let repeats_key = e.order.is_empty()
            && matches!(e.child_key.as_slice(),
                [column] if matches!(row.get(column), Some(Value::String(s)) if *s == key));
        let sort = if repeats_key {
            Sort::Key
        } else {
            Sort::Values(
                e.order
                    .iter()
                    .map(|(column, _)| column)
                    .chain(&e.child_key)
                    .map(|column| row.get(column).cloned().unwrap_or(Value::Null))
                    .collect(),
            )
        };
        let fields = (!e.ids).then(|| {
            Box::new(
                e.fields
                    .iter()
                    .map(|f| (f.name.clone(), f.source.value(row)))
                    .collect(),
            )
        });
        Self {
            sort,
            key: key.into_boxed_str(),
            fields,
        }
    }

    /// The values it sorts by.
    fn sort_values(&self) -> Cow<'_, [Value]> {
        match &self.sort {
            Sort::Key => Cow::Owned(vec![Value::String(self.key.to_string())]),
            Sort::Values(values) => Cow::Borrowed(values),
        }
    }

    fn item(self) -> Value {
        match self.fields {
            Some(fields) => Value::Object(*fields),
            None => Value::String(self.key.into_string()),
        }
    }
}

/// The listed children of the root whose key is `root` (after `limit`), and how many there
/// are (before it). Only children whose row exists (and, through a link table, whose link row
/// exists) are listed.
fn children(
    store: &mut dyn StateStore,
    e: &Embed,
    root: &str,
) -> Result<(Vec<Value>, usize), StateError> {
    let mut found: Vec<Kept> = Vec::new();
    let mut count = 0;
    let mut keep = |found: &mut Vec<Kept>, id: Id, row: Row| {
        count += 1;
        found.push(Kept::new(e, &id, &row));
        if let Some(limit) = e.limit
            && found.len() >= limit + LIMIT_SLACK
        {
            found.sort_by(|a, b| order(e, a, b));
            found.truncate(limit);
        }
    };
    match &e.via {
        Via::ForeignKey { index, .. } => {
            for id in indexed(store, e.child, *index, root)?.iter() {
                let id = id?;
                if let Some(row) = load(store, e.child, &id)? {
                    keep(&mut found, id, row);
                }
            }
        }
        Via::Link {
            table,
            child,
            by_parent,
            ..
        } => {
            for link_id in indexed(store, *table, *by_parent, root)?.iter() {
                let Some(link) = load(store, *table, &link_id?)? else {
                    continue;
                };
                let Some(child_key) = link.get(child).filter(|v| !v.is_null()) else {
                    continue;
                };
                let id = vec![text(child_key)];
                let Some(mut row) = load(store, e.child, &id)? else {
                    continue;
                };
                for c in &e.link_columns {
                    let v = link.get(c).cloned().unwrap_or(Value::Null);
                    row.insert(format!("{THROUGH}{c}"), v);
                }
                keep(&mut found, id, row);
            }
        }
    }
    found.sort_by(|a, b| order(e, a, b));
    if let Some(limit) = e.limit {
        found.truncate(limit);
    }
    Ok((found.into_iter().map(Kept::item).collect(), count))
}

/// `order_by`, then the child key ascending, then the child's document key. (A tie on the
/// child key is a tie on the id, which is made of the same values.)
fn order(e: &Embed, a: &Kept, b: &Kept) -> Ordering {
    if let (Sort::Key, Sort::Key) = (&a.sort, &b.sort) {
        // Both sort by their key's text alone, as `compare` orders two strings.
        return a.key.cmp(&b.key);
    }
    let (a_sort, b_sort) = (a.sort_values(), b.sort_values());
    let descending = e
        .order
        .iter()
        .map(|(_, d)| *d)
        .chain(std::iter::repeat(false));
    for ((x, y), descending) in a_sort.iter().zip(b_sort.iter()).zip(descending) {
        let o = compare(Some(x), Some(y));
        let o = if descending { o.reverse() } else { o };
        if o != Ordering::Equal {
            return o;
        }
    }
    a.key.cmp(&b.key)
}
