//! [`Row`]: one row image, column name to JSON value, with its column names shared.
//!
//! A source hands out millions of rows of one table, all with the same columns. A map with its
//! own copy of every name cost a node and one allocation per name for each row, freed again on
//! another thread: over a third of a snapshot's CPU time. A row here is the table's
//! [`Columns`] (sorted names, shared by reference) and one vector of values in that order.
//!
//! It behaves as the sorted map it replaces (`serde_json::Map` without `preserve_order`): names
//! are unique, iteration is in name order, it serializes as a JSON object in that order, and a
//! name given twice keeps the last value. Changing the names of a row (insert, remove) copies
//! them first when they are shared.

use std::fmt;
use std::sync::Arc;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

/// Column names, sorted and unique, shared by the rows that have them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Columns(Arc<Vec<String>>);

impl Columns {
    /// The names, sorted.
    pub fn names(&self) -> &[String] {
        &self.0
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A copy not shared with the rows made so far (rows are often dropped on another thread,
    /// and one reference count written by both would bounce between them).
    pub fn renewed(&self) -> Self {
        Self(Arc::new(self.0.to_vec()))
    }

    /// Where `name` is, or would go.
    fn find(&self, name: &str) -> Result<usize, usize> {
        // A table's few columns: compared by length first, the bytes only of names as long
        // (cheaper than the ordered comparisons of a search, which every lookup of a key
        // column pays).
        if self.0.len() <= 16 {
            if let Some(i) = self
                .0
                .iter()
                .position(|n| n.len() == name.len() && n.as_bytes() == name.as_bytes())
            {
                return Ok(i);
            }
        }
        self.0.binary_search_by(|n| n.as_str().cmp(name))
    }
}

impl FromIterator<String> for Columns {
    /// The names sorted, each once.
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Self {
        let mut names: Vec<String> = iter.into_iter().collect();
        names.sort_unstable();
        names.dedup();
        Self(Arc::new(names))
    }
}

impl fmt::Debug for Columns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.iter()).finish()
    }
}

/// One row image: column name to JSON value (logical types already converted).
#[derive(Clone, Default)]
pub struct Row {
    columns: Columns,
    values: Vec<Value>,
}

impl Row {
    /// An empty row.
    pub fn new() -> Self {
        Self::default()
    }

    /// The row with `values` for `columns`, in the columns' (sorted) order.
    ///
    /// # Panics
    /// When there are not as many values as columns.
    pub fn from_columns(columns: Columns, values: Vec<Value>) -> Self {
        assert_eq!(columns.len(), values.len(), "one value per column");
        Self { columns, values }
    }

    /// The row's column names.
    pub fn columns(&self) -> &Columns {
        &self.columns
    }

    /// How many columns.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether it has no column.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The value of column `name`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.columns.find(name).ok().map(|i| &self.values[i])
    }

    /// The value of column `name`, to change.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Value> {
        self.columns.find(name).ok().map(|i| &mut self.values[i])
    }

    /// Whether it has column `name`.
    pub fn contains_key(&self, name: &str) -> bool {
        self.columns.find(name).is_ok()
    }

    /// Sets column `name`; returns the value it replaced.
    pub fn insert(&mut self, name: String, value: Value) -> Option<Value> {
        match self.columns.find(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.values[i], value)),
            Err(i) => {
                Arc::make_mut(&mut self.columns.0).insert(i, name);
                self.values.insert(i, value);
                None
            }
        }
    }

    /// Removes column `name`; returns its value.
    pub fn remove(&mut self, name: &str) -> Option<Value> {
        let i = self.columns.find(name).ok()?;
        Arc::make_mut(&mut self.columns.0).remove(i);
        Some(self.values.remove(i))
    }

    /// Keeps the columns `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&String, &mut Value) -> bool) {
        let keeps: Vec<bool> = self
            .columns
            .0
            .iter()
            .zip(self.values.iter_mut())
            .map(|(n, v)| keep(n, v))
            .collect();
        if keeps.iter().all(|k| *k) {
            return;
        }
        let mut flags = keeps.iter();
        Arc::make_mut(&mut self.columns.0).retain(|_| *flags.next().unwrap_or(&true));
        let mut flags = keeps.iter();
        self.values.retain(|_| *flags.next().unwrap_or(&true));
    }

    /// Columns and values, in name order.
    pub fn iter(&self) -> Iter<'_> {
        self.columns.0.iter().zip(self.values.iter())
    }

    /// Columns and values to change, in name order.
    pub fn iter_mut(&mut self) -> IterMut<'_> {
        self.columns.0.iter().zip(self.values.iter_mut())
    }

    /// The column names, in order.
    pub fn keys(&self) -> std::slice::Iter<'_, String> {
        self.columns.0.iter()
    }

    /// The values, in name order.
    pub fn values(&self) -> std::slice::Iter<'_, Value> {
        self.values.iter()
    }

    /// The values to change, in name order.
    pub fn values_mut(&mut self) -> std::slice::IterMut<'_, Value> {
        self.values.iter_mut()
    }

    /// The row from name-value pairs: sorted, the last value of a name given twice kept.
    fn from_pairs(mut pairs: Vec<(String, Value)>) -> Self {
        if !pairs.is_sorted_by(|a, b| a.0 < b.0) {
            // Stable: equal names stay in the order given, and the last one is kept below.
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
            let mut deduped: Vec<(String, Value)> = Vec::with_capacity(pairs.len());
            for pair in pairs {
                match deduped.last_mut() {
                    Some(last) if last.0 == pair.0 => *last = pair,
                    _ => deduped.push(pair),
                }
            }
            pairs = deduped;
        }
        let (names, values) = pairs.into_iter().unzip();
        Self {
            columns: Columns(Arc::new(names)),
            values,
        }
    }
}

/// [`Row::iter`].
pub type Iter<'a> = std::iter::Zip<std::slice::Iter<'a, String>, std::slice::Iter<'a, Value>>;
/// [`Row::iter_mut`].
pub type IterMut<'a> = std::iter::Zip<std::slice::Iter<'a, String>, std::slice::IterMut<'a, Value>>;

impl PartialEq for Row {
    fn eq(&self, other: &Self) -> bool {
        (Arc::ptr_eq(&self.columns.0, &other.columns.0) || self.columns == other.columns)
            && self.values == other.values
    }
}

impl fmt::Debug for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl std::ops::Index<&str> for Row {
    type Output = Value;

    /// # Panics
    /// When the row has no column `name` (as a map does).
    fn index(&self, name: &str) -> &Value {
        self.get(name)
            .unwrap_or_else(|| panic!("the row has no column `{name}`"))
    }
}

impl FromIterator<(String, Value)> for Row {
    fn from_iter<I: IntoIterator<Item = (String, Value)>>(iter: I) -> Self {
        Self::from_pairs(iter.into_iter().collect())
    }
}

impl Extend<(String, Value)> for Row {
    fn extend<I: IntoIterator<Item = (String, Value)>>(&mut self, iter: I) {
        for (name, value) in iter {
            self.insert(name, value);
        }
    }
}

impl<'a> IntoIterator for &'a Row {
    type Item = (&'a String, &'a Value);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl IntoIterator for Row {
    type Item = (String, Value);
    type IntoIter = std::iter::Zip<std::vec::IntoIter<String>, std::vec::IntoIter<Value>>;

    fn into_iter(self) -> Self::IntoIter {
        let names = Arc::try_unwrap(self.columns.0).unwrap_or_else(|shared| (*shared).clone());
        names.into_iter().zip(self.values)
    }
}

impl From<Map<String, Value>> for Row {
    /// The map's entries, already sorted and unique.
    fn from(map: Map<String, Value>) -> Self {
        let (names, values) = map.into_iter().unzip();
        Self {
            columns: Columns(Arc::new(names)),
            values,
        }
    }
}

impl From<Row> for Map<String, Value> {
    fn from(row: Row) -> Self {
        row.into_iter().collect()
    }
}

impl From<Row> for Value {
    fn from(row: Row) -> Self {
        Value::Object(row.into())
    }
}

impl Serialize for Row {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.len()))?;
        for (name, value) in self.iter() {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Row {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RowVisitor;
        impl<'de> Visitor<'de> for RowVisitor {
            type Value = Row;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object (a row)")
            }

            fn visit_map<A: MapAccess<'de>>(self, access: A) -> Result<Row, A::Error> {
                SHAPES.with(|shapes| match shapes.try_borrow_mut() {
                    Ok(mut shapes) => shapes.read(access),
                    // Not reached (a value is never read as a row), but a nested read must not
                    // panic: it reads the general way, without the thread's shapes.
                    Err(_) => {
                        let (names, values) = read_fields(access, Vec::new(), Vec::new())?;
                        let pairs = names.into_iter().map(|n| n.0.into_owned()).zip(values);
                        Ok(Row::from_pairs(pairs.collect()))
                    }
                })
            }
        }
        deserializer.deserialize_map(RowVisitor)
    }
}

/// A string being deserialized (a field name, a short envelope field): borrowed from the input
/// when the deserializer can lend it, owned only when it cannot. (`Option<Cow<str>>` fields do
/// not borrow: serde's own `Cow` impl always copies, which cost five allocations per Debezium
/// envelope.)
pub(crate) struct Text<'a>(pub(crate) std::borrow::Cow<'a, str>);

impl std::ops::Deref for Text<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for TextVisitor<'a> {
            type Value = Text<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(v.into()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(v.to_owned().into()))
            }
            fn visit_string<E>(self, v: String) -> Result<Text<'a>, E> {
                Ok(Text(v.into()))
            }
        }
        deserializer.deserialize_str(TextVisitor(std::marker::PhantomData))
    }
}

/// Rows that share one [`Columns`] before a decoding thread makes a new copy: few enough that
/// one reference count is not written by two threads for long (see [`Columns::renewed`]).
const SHARED_ROWS: u32 = 4096;

/// Shapes a thread keeps: the rows of a record alternate with its key's (an Avro key is a row
/// too), and a topic may hold a few tables; one shape would be rebuilt at every turn.
const SHAPES_KEPT: usize = 4;

thread_local! {
    /// The field names of the rows this thread deserialized last.
    static SHAPES: std::cell::RefCell<Shapes> = std::cell::RefCell::default();
}

/// The last [`SHAPES_KEPT`] shapes, one replaced in turn by a shape not among them.
#[derive(Default)]
struct Shapes {
    kept: Vec<Shape>,
    next: usize,
}

/// Reads the remaining fields of a map onto `names` and `values`.
fn read_fields<'de, A: MapAccess<'de>>(
    mut access: A,
    mut names: Vec<Text<'de>>,
    mut values: Vec<Value>,
) -> Result<(Vec<Text<'de>>, Vec<Value>), A::Error> {
    let more = access.size_hint().unwrap_or(0).min(1024);
    names.reserve(more);
    values.reserve(more);
    while let Some((name, value)) = access.next_entry::<Text<'de>, Value>()? {
        names.push(name);
        values.push(value);
    }
    Ok((names, values))
}

impl Shapes {
    /// Reads a row. While its field names follow a kept shape, each value goes straight to its
    /// column: no vector of names, no second vector of values (a decoding thread reads millions
    /// of rows of a few shapes). Where the names part from the shape, another kept shape with
    /// the same names so far takes over (rows of two tables whose first column is `id`); a
    /// row that follows none is read the general way from there.
    fn read<'de, A: MapAccess<'de>>(&mut self, mut access: A) -> Result<Row, A::Error> {
        let Some(first) = access.next_key::<Text<'de>>()? else {
            return Ok(self.row(Vec::new(), Vec::new()));
        };
        let Some(mut i) = self.kept.iter().position(|s| s.continues(0, &first)) else {
            let value = access.next_value()?;
            let (names, values) = read_fields(access, vec![first], vec![value])?;
            return Ok(self.row(names, values));
        };
        let mut values = vec![Value::Null; self.kept[i].given.len()];
        values[self.kept[i].slot[0]] = access.next_value()?;
        let mut read = 1;
        let mut off = None;
        while let Some(name) = access.next_key::<Text<'de>>()? {
            if !self.kept[i].continues(read, &name) {
                let so_far = &self.kept[i].given[..read];
                let other = self
                    .kept
                    .iter()
                    .position(|s| s.given.get(..read) == Some(so_far) && s.continues(read, &name));
                let Some(j) = other else {
                    off = Some(name);
                    break;
                };
                values = self.kept[i].moved(&self.kept[j], read, values);
                i = j;
            }
            values[self.kept[i].slot[read]] = access.next_value()?;
            read += 1;
        }
        let shape = &mut self.kept[i];
        if off.is_none() && read == shape.given.len() {
            shape.rows += 1;
            return Ok(Row {
                columns: shape.columns.clone(),
                values,
            });
        }
        // Off every shape: the fields read so far, in the order given, then the rest.
        let mut names: Vec<Text<'de>> = shape.given[..read]
            .iter()
            .map(|g| Text(g.clone().into()))
            .collect();
        let mut given: Vec<Value> = shape.slot[..read]
            .iter()
            .map(|&c| std::mem::take(&mut values[c]))
            .collect();
        if let Some(name) = off {
            names.push(name);
            given.push(access.next_value()?);
        }
        let (names, values) = read_fields(access, names, given)?;
        Ok(self.row(names, values))
    }

    fn row(&mut self, names: Vec<Text<'_>>, values: Vec<Value>) -> Row {
        let found = self.kept.iter().position(|s| s.gives(&names));
        let i = match found {
            Some(i) => i,
            None if self.kept.len() < SHAPES_KEPT => {
                self.kept.push(Shape::default());
                self.kept.len() - 1
            }
            None => {
                self.next = (self.next + 1) % SHAPES_KEPT;
                self.next
            }
        };
        self.kept[i].row(found.is_some(), names, values)
    }
}

/// Field names in the order a document gives them, the row's [`Columns`] they make, and where
/// each column's value is among the fields: consecutive rows of one table (a change log, a
/// topic) give the same names in the same order, and share one `Columns` instead of allocating
/// their names again.
#[derive(Default)]
struct Shape {
    given: Vec<String>,
    columns: Columns,
    /// For each column, the index of its field in `given`.
    order: Vec<usize>,
    /// For each field in `given`, the index of its column (the inverse of `order`).
    slot: Vec<usize>,
    rows: u32,
}

impl Shape {
    /// Whether field number `read` named `name` follows this shape (and its columns may still
    /// be shared).
    fn continues(&self, read: usize, name: &str) -> bool {
        self.rows < SHARED_ROWS && self.given.get(read).is_some_and(|g| g == name)
    }

    /// `values`, placed in this shape's columns, placed in `other`'s instead; both shapes give
    /// the same first `read` fields, the only ones read.
    fn moved(&self, other: &Shape, read: usize, mut values: Vec<Value>) -> Vec<Value> {
        let mut moved = vec![Value::Null; other.given.len()];
        for field in 0..read {
            moved[other.slot[field]] = std::mem::take(&mut values[self.slot[field]]);
        }
        moved
    }

    /// Whether a row of these field names, in this order, has this shape.
    fn gives(&self, names: &[Text<'_>]) -> bool {
        names.len() == self.given.len() && names.iter().zip(&self.given).all(|(a, b)| a.0 == **b)
    }

    /// The row of `values` named `names`; `same`: they are this shape's names (checked by
    /// the caller, once).
    fn row(&mut self, same: bool, names: Vec<Text<'_>>, mut values: Vec<Value>) -> Row {
        if same && self.rows < SHARED_ROWS {
            self.rows += 1;
            let values = self
                .order
                .iter()
                .map(|&i| std::mem::take(&mut values[i]))
                .collect();
            return Row {
                columns: self.columns.clone(),
                values,
            };
        }
        let given: Vec<String> = names.into_iter().map(|n| n.0.into_owned()).collect();
        let row = Row::from_pairs(given.iter().cloned().zip(values).collect());
        // Only names given once each have one field per column.
        if row.columns.len() == given.len() {
            self.order = row
                .columns
                .names()
                .iter()
                .map(|c| given.iter().position(|g| g == c).expect("a given name"))
                .collect();
            self.slot = vec![0; given.len()];
            for (column, &field) in self.order.iter().enumerate() {
                self.slot[field] = column;
            }
            self.columns = row.columns.clone();
            self.given = given;
            self.rows = 1;
        }
        row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The map a row stands in for, built from the same pairs.
    fn both(pairs: &[(&str, i64)]) -> (Row, Map<String, Value>) {
        let owned = || {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
        };
        (owned().collect(), owned().collect())
    }

    fn same(row: &Row, map: &Map<String, Value>) {
        assert_eq!(row.len(), map.len());
        assert!(row.iter().eq(map.iter()), "{row:?} != {map:?}");
        assert_eq!(
            serde_json::to_string(row).unwrap(),
            serde_json::to_string(map).unwrap()
        );
        for k in map.keys() {
            assert_eq!(row.get(k), map.get(k));
        }
    }

    /// Rows of two shapes in turn (an Avro record's rows and its key's) each share their
    /// shape's columns. (Seen failing when a thread kept one shape: every row made its own.)
    #[test]
    fn rows_of_shapes_in_turn_share_their_columns() {
        let row = |text: &str| -> Row { serde_json::from_str(text).unwrap() };
        let first = row(r#"{"id": 1, "name": "a"}"#);
        let key = row(r#"{"id": 1}"#);
        let second = row(r#"{"id": 2, "name": "b"}"#);
        let key_again = row(r#"{"id": 2}"#);
        assert!(Arc::ptr_eq(&first.columns.0, &second.columns.0));
        assert!(Arc::ptr_eq(&key.columns.0, &key_again.columns.0));
        assert_eq!(second.get("name"), Some(&Value::from("b")));
        assert_eq!(key_again.keys().collect::<Vec<_>>(), ["id"]);
    }

    #[test]
    fn a_row_behaves_as_the_sorted_map() {
        let cases: &[&[(&str, i64)]] = &[
            &[],
            &[("b", 1), ("a", 2), ("c", 3)],
            // A name given twice: the last value.
            &[("a", 1), ("b", 2), ("a", 3)],
            &[("x", 1), ("x", 2), ("x", 3), ("", 4)],
        ];
        for pairs in cases {
            let (mut row, mut map) = both(pairs);
            same(&row, &map);
            assert_eq!(row.get("missing"), None);
            assert_eq!(
                row,
                serde_json::from_value(Value::Object(map.clone())).unwrap()
            );
            // Deserialized from text with a name given twice, as serde_json's map does.
            let text = format!(
                "{{{}}}",
                pairs
                    .iter()
                    .map(|(k, v)| format!("\"{k}\":{v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let parsed: Row = serde_json::from_str(&text).unwrap();
            let parsed_map: Map<String, Value> = serde_json::from_str(&text).unwrap();
            same(&parsed, &parsed_map);

            // Changes on a row whose columns another row shares leave that one alone.
            let sharing = row.clone();
            assert_eq!(
                row.insert("m".into(), 9.into()),
                map.insert("m".into(), 9.into())
            );
            assert_eq!(
                row.insert("m".into(), 8.into()),
                map.insert("m".into(), 8.into())
            );
            assert_eq!(row.remove("b"), map.remove("b"));
            assert_eq!(row.remove("b"), None);
            row.retain(|k, _| k != "c");
            map.retain(|k, _| k != "c");
            same(&row, &map);
            assert!(!sharing.contains_key("m"));
            assert_eq!(Map::from(row.clone()), map);
            assert_eq!(Row::from(map.clone()), row);
        }
    }

    #[test]
    fn rows_of_shared_columns() {
        let columns: Columns = ["b", "a", "b"].iter().map(|s| s.to_string()).collect();
        assert_eq!(columns.names(), ["a", "b"]);
        let row = Row::from_columns(columns.clone(), vec![1.into(), 2.into()]);
        assert_eq!(row["a"], Value::from(1));
        assert_eq!(row["b"], Value::from(2));
        let other = Row::from_columns(columns.renewed(), vec![1.into(), 2.into()]);
        assert_eq!(row, other);
    }

    #[test]
    fn rows_deserialized_one_after_another_share_their_names() {
        let parse = |text: &str| -> Row { serde_json::from_str(text).unwrap() };
        let rows: Vec<Row> = (0..3)
            .map(|i| parse(&format!(r#"{{"id":{i},"doc":{{"a":{i}}},"at":"t{i}"}}"#)))
            .collect();
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(row.columns.names(), ["at", "doc", "id"]);
            assert_eq!(row["id"], Value::from(i));
            assert_eq!(row["doc"]["a"], Value::from(i));
            assert_eq!(row["at"], Value::from(format!("t{i}")));
            assert!(Arc::ptr_eq(&row.columns.0, &rows[0].columns.0), "row {i}");
        }
        // Other orders and repeated names still map each value to its column.
        let reordered = parse(r#"{"at":"x","id":7,"doc":null}"#);
        assert_eq!(
            (&reordered["id"], &reordered["at"]),
            (&Value::from(7), &Value::from("x"))
        );
        let twice = parse(r#"{"id":1,"id":2,"at":"y"}"#);
        assert_eq!(twice.columns.names(), ["at", "id"]);
        assert_eq!(twice["id"], Value::from(2));
        assert_eq!(parse(r#"{"id":1,"id":2,"at":"y"}"#)["id"], Value::from(2));
        // After a while a new copy of the names is made.
        let first = parse(r#"{"id":0,"doc":0,"at":0}"#);
        let later = (0..SHARED_ROWS)
            .map(|i| parse(&format!(r#"{{"id":{i},"doc":0,"at":0}}"#)))
            .last()
            .unwrap();
        assert_eq!(later["id"], Value::from(SHARED_ROWS - 1));
        assert!(!Arc::ptr_eq(&first.columns.0, &later.columns.0));
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    /// A change made to a row and to the map it stands in for.
    #[derive(Debug, Clone)]
    enum Change {
        Insert(String, i64),
        Remove(String),
        RetainNot(String),
        Share,
    }

    fn name() -> impl Strategy<Value = String> {
        // Few names, so that inserts replace and removes hit.
        "[a-e]{0,2}"
    }

    fn change() -> impl Strategy<Value = Change> {
        prop_oneof![
            (name(), any::<i64>()).prop_map(|(k, v)| Change::Insert(k, v)),
            name().prop_map(Change::Remove),
            name().prop_map(Change::RetainNot),
            Just(Change::Share),
        ]
    }

    proptest! {
        /// Objects read one after another, their fields in any order, some missing, added or
        /// repeated (few names, so that shapes are learnt and then left at any field): each row
        /// is the map serde_json reads from the same text.
        #[test]
        fn rows_read_in_turn_are_the_maps_of_their_texts(
            objects in proptest::collection::vec(
                proptest::collection::vec(("[a-c]", any::<i64>()), 0..5),
                1..40,
            ),
        ) {
            for fields in objects {
                let fields: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                let text = format!("{{{}}}", fields.join(","));
                let row: Row = serde_json::from_str(&text).unwrap();
                let map: Map<String, Value> = serde_json::from_str(&text).unwrap();
                prop_assert!(row.iter().eq(map.iter()), "{} read as {:?}", text, row);
            }
        }

        /// Any pairs and any changes: the row reads, iterates, serializes and compares as the
        /// sorted map built and changed the same way; rows sharing its columns are not changed.
        #[test]
        fn a_row_is_the_sorted_map(
            pairs in proptest::collection::vec((name(), any::<i64>()), 0..12),
            changes in proptest::collection::vec(change(), 0..24),
        ) {
            let mut row: Row = pairs.iter().map(|(k, v)| (k.clone(), Value::from(*v))).collect();
            let mut map: Map<String, Value> =
                pairs.iter().map(|(k, v)| (k.clone(), Value::from(*v))).collect();
            let mut shared: Vec<(Row, Map<String, Value>)> = Vec::new();
            for change in changes {
                match change {
                    Change::Insert(k, v) => {
                        prop_assert_eq!(row.insert(k.clone(), v.into()), map.insert(k, v.into()));
                    }
                    Change::Remove(k) => prop_assert_eq!(row.remove(&k), map.remove(&k)),
                    Change::RetainNot(k) => {
                        row.retain(|n, _| *n != k);
                        map.retain(|n, _| *n != k);
                    }
                    Change::Share => shared.push((row.clone(), map.clone())),
                }
                prop_assert!(row.iter().eq(map.iter()));
            }
            prop_assert_eq!(row.len(), map.len());
            for k in ["", "a", "ab", "e", "zz"] {
                prop_assert_eq!(row.get(k), map.get(k));
                prop_assert_eq!(row.contains_key(k), map.contains_key(k));
            }
            prop_assert_eq!(serde_json::to_string(&row).unwrap(), serde_json::to_string(&map).unwrap());
            let back: Row = serde_json::from_str(&serde_json::to_string(&map).unwrap()).unwrap();
            prop_assert_eq!(&back, &row);
            prop_assert_eq!(Map::from(row.clone()), map.clone());
            for (r, m) in shared {
                prop_assert!(r.iter().eq(m.iter()));
            }
        }
    }
}
