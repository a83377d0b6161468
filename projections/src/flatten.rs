//! `kind = "flatten"`: rows of one table, relational columns and nested JSON alike, reshaped
//! into flat analytical tables.
//!
//! Each output table declares its columns as [field paths](refract_schemas::field_path) into the
//! row; `explode` makes one row per element of an array (`order_items` from `doc.items`), with
//! the parent's key and a line number; `count` counts an array's elements. Unmapped fields under
//! a path are flattened into columns named by their path, or kept as one JSON text column.
//!
//! **Schema drift.** Column types are declared, or learned from the first non-null value. A
//! new field becomes a new nullable column and the table's schema version grows by one; the
//! learned schema is state the runtime persists ([`Projection::take_state`]), so a restart keeps
//! the same columns and types. A value that does not fit its column (a number that became an
//! object) fails the event: none of its rows are written, and it goes to the dead-letter store
//! with the reason.
//!
//! **Deletes.** A source delete deletes the row's key in each table (`on_delete = "keep"` keeps
//! them, for a table fed from many documents such as customers). In an exploded table every
//! change of the parent replaces the parent's group of rows: all rows of one change carry its
//! position, and a delete (or an empty array) leaves the group empty.

mod schema;
#[cfg(test)]
mod tests;
mod unmapped;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use refract_schemas::config::{
    FlatOnDelete, FlattenProjectionConfig, UnmappedConfig, UnmappedMode,
};
use refract_schemas::field_path::{FieldPath, Step};
use refract_schemas::{ChangeEvent, Op, Row, TableId};
use serde_json::{Map, Value};

pub use schema::{FlatChange, FlatColumn, FlatOp, FlatSchema, FlatType, FlatValue};
use schema::{cast, change, fit, infer, kind, short};
use unmapped::collect;

use crate::{OpFamily, Projection, ProjectionError, WriteOp};

/// The flatten projection.
pub struct FlattenProjection {
    table: String,
    outputs: Vec<Output>,
    max_columns: usize,
    /// Row columns whose string values hold JSON documents that paths go into.
    json_columns: BTreeSet<String>,
    nodes: Nodes,
    /// Whether the learned schemas changed since [`Projection::take_state`] last returned them.
    dirty: bool,
}

/// FNV-1a for the short strings (field paths, column names) looked up for every field of every
/// document: several times faster than SipHash on them. The sets it keys are bounded by the
/// pipeline file and `max_columns`, so flooding them with colliding names gains nothing.
#[derive(Default, Clone, Copy)]
struct Fnv(u64);

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut hash = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = hash;
    }
}

type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<Fnv>>;
type FastSet<K> = HashSet<K, std::hash::BuildHasherDefault<Fnv>>;

/// A path with the node its field prefix resolves to (see [`Image`]).
struct Compiled {
    path: FieldPath,
    /// The node of the path's longest prefix without `[]`.
    node: usize,
    /// Where the steps after that prefix start.
    rest: usize,
}

/// The field prefixes paths share, as a tree: each node is a column (no parent) or a field of
/// its parent. An event resolves each node once, however many paths go through it.
#[derive(Default)]
struct Nodes {
    nodes: Vec<(Option<usize>, String)>,
    index: HashMap<(Option<usize>, String), usize>,
}

impl Nodes {
    fn compile(&mut self, path: FieldPath) -> Compiled {
        let mut node = self.intern(None, &path.column);
        let mut rest = 0;
        for step in &path.steps {
            match step {
                Step::Field(f) => {
                    node = self.intern(Some(node), f);
                    rest += 1;
                }
                Step::Each => break,
            }
        }
        Compiled { path, node, rest }
    }

    fn intern(&mut self, parent: Option<usize>, name: &str) -> usize {
        if let Some(&i) = self.index.get(&(parent, name.to_owned())) {
            return i;
        }
        self.nodes.push((parent, name.to_owned()));
        self.index
            .insert((parent, name.to_owned()), self.nodes.len() - 1);
        self.nodes.len() - 1
    }
}

/// Where a declared column's value comes from.
enum Source {
    /// A path; `element` when it goes into the exploded array's element (steps after it).
    Path { path: Compiled, element: bool },
    /// The length of an array.
    Count(Compiled),
    /// The element's 1-based position.
    LineNo,
}

struct ColumnRule {
    source: Source,
    declared: Option<FlatType>,
}

struct Unmapped {
    under: Compiled,
    mode: UnmappedMode,
    separator: String,
    /// Dotted paths (from the row) that are left out: excluded, mapped by a column, exploded.
    skip: FastSet<String>,
    /// The column of `mode = "json"`.
    column: usize,
}

/// One output table and what was learned of its schema.
struct Output {
    rules: Vec<ColumnRule>,
    explode: Option<Compiled>,
    on_delete: FlatOnDelete,
    unmapped: Option<Unmapped>,
    schema: Arc<FlatSchema>,
    index: FastMap<String, usize>,
    /// Unmapped paths seen holding objects (flattened into columns below them).
    object_paths: BTreeSet<String>,
    /// The dotted path each unmapped column was made from: two fields that would flatten to one
    /// name (`a.b` and `a_b`) are a conflict, not a shared column.
    origins: BTreeMap<String, String>,
    /// Unmapped paths that passed every check before, and where they go: found here, a field
    /// skips naming and conflict checks. Objects are forgotten whenever columns are added (a
    /// new column can conflict with an object's name).
    resolved: FastMap<String, Resolved>,
}

/// Where an unmapped path goes.
enum Resolved {
    /// Into this column.
    Column(usize),
    /// It is an object, whose fields are named below this name.
    Object(String),
}

/// Learned state of one output, as persisted.
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedOutput {
    version: u32,
    columns: Vec<FlatColumn>,
    object_paths: BTreeSet<String>,
    #[serde(default)]
    origins: BTreeMap<String, String>,
}

/// The rows one event makes in one output, and what they teach the schema.
#[derive(Default)]
struct Staged {
    rows: Vec<(schema::FlatOp, Vec<(usize, FlatValue)>)>,
    /// Columns whose type is learned by this event.
    learned: Vec<(usize, FlatType)>,
    /// Columns this event adds (indexes continue after the schema's).
    added: Vec<FlatColumn>,
    added_objects: Vec<String>,
    /// Unmapped columns this event names for the first time, with their dotted paths.
    added_origins: Vec<(String, String)>,
    /// Unmapped paths this event resolved.
    resolved: Vec<(String, Resolved)>,
}

impl Staged {
    fn type_of(&self, output: &Output, column: usize) -> FlatType {
        if let Some((_, t)) = self.learned.iter().find(|(c, _)| *c == column) {
            return *t;
        }
        match output.schema.columns.get(column) {
            Some(c) => c.ty,
            None => self.added[column - output.schema.columns.len()].ty,
        }
    }

    /// Checks `value` (inferred from `original`) against the column, learning its type.
    fn put(
        &mut self,
        output: &Output,
        column: usize,
        value: FlatValue,
        original: &Value,
    ) -> Result<FlatValue, String> {
        let ty = self.type_of(output, column);
        let fitted = fit(value, original, ty).map_err(|()| {
            format!(
                "type conflict in table `{}`: column `{}` is {ty:?}, the value is {} {}",
                output.schema.table,
                self.name(output, column),
                kind(original),
                short(original)
            )
        })?;
        if ty == FlatType::Unknown && fitted != FlatValue::Null {
            let learned = fitted.flat_type();
            if column < output.schema.columns.len() {
                self.learned.push((column, learned));
            } else {
                self.added[column - output.schema.columns.len()].ty = learned;
            }
        }
        Ok(fitted)
    }

    fn name<'a>(&'a self, output: &'a Output, column: usize) -> &'a str {
        match output.schema.columns.get(column) {
            Some(c) => &c.name,
            None => &self.added[column - output.schema.columns.len()].name,
        }
    }
}

/// The JSON documents a row's string columns hold (Debezium sends `jsonb` as text), parsed once.
fn parse_documents(row: &Row, json_columns: &BTreeSet<String>) -> Vec<(String, Value)> {
    let mut parsed = Vec::new();
    for column in json_columns {
        if let Some(Value::String(text)) = row.get(column.as_str()) {
            if let Ok(value) = serde_json::from_str::<Value>(text) {
                if value.is_object() || value.is_array() {
                    parsed.push((column.clone(), value));
                }
            }
        }
    }
    parsed
}

/// A row image with every path node resolved once.
struct Image<'a> {
    values: Vec<Option<&'a Value>>,
}

impl<'a> Image<'a> {
    fn new(row: &'a Row, parsed: &'a [(String, Value)], nodes: &Nodes) -> Self {
        let mut values: Vec<Option<&'a Value>> = Vec::with_capacity(nodes.nodes.len());
        for (parent, name) in &nodes.nodes {
            let value = match parent {
                None => match parsed.iter().find(|(n, _)| n == name) {
                    Some((_, v)) => Some(v),
                    None => row.get(name.as_str()),
                },
                Some(p) => values[*p].and_then(|v| field(v.as_object()?, name)),
            };
            values.push(value);
        }
        Self { values }
    }

    /// The first non-null value at `path`.
    fn first(&self, path: &Compiled) -> Option<&'a Value> {
        first(self.values[path.node]?, &path.path.steps[path.rest..])
    }
}

/// The field `name` of `object`. A document's objects have few fields: comparing lengths
/// first, and the bytes only of names as long, is cheaper than the ordered comparisons of the
/// map's search (which took a tenth of the projection's time).
fn field<'v>(object: &'v Map<String, Value>, name: &str) -> Option<&'v Value> {
    if object.len() > 16 {
        return object.get(name);
    }
    object
        .iter()
        .find(|(k, _)| k.len() == name.len() && k.as_bytes() == name.as_bytes())
        .map(|(_, v)| v)
}

/// The first non-null value at `steps` below `value` (`[]` tries each element in turn).
fn first<'v>(value: &'v Value, steps: &[Step]) -> Option<&'v Value> {
    match steps.split_first() {
        None => Some(value),
        Some((Step::Field(f), rest)) => first(field(value.as_object()?, f)?, rest),
        Some((Step::Each, rest)) => value
            .as_array()?
            .iter()
            .find_map(|e| first(e, rest).filter(|v| !v.is_null())),
    }
}

/// The dotted form of a path up to its first `[]`: the subtree a column takes from the row.
fn field_prefix(path: &FieldPath) -> String {
    let mut text = path.column.clone();
    for step in &path.steps {
        match step {
            Step::Field(f) => {
                text.push('.');
                text.push_str(f);
            }
            Step::Each => break,
        }
    }
    text
}

impl FlattenProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Rows];

    /// Builds the projection from its (validated) configuration.
    pub fn new(config: &FlattenProjectionConfig) -> Self {
        let mut json_columns = BTreeSet::new();
        let mut nodes = Nodes::default();
        let parse = |text: &str| FieldPath::parse(text).expect("validated path");
        let mut outputs = Vec::with_capacity(config.outputs.len());
        for out in &config.outputs {
            let explode = out.explode.as_deref().map(parse);
            let element = explode.as_ref().map(|e| {
                let mut p = e.clone();
                p.steps.push(Step::Each);
                p
            });
            let mut skip: FastSet<String> = FastSet::default();
            let mut rules = Vec::with_capacity(out.columns.len());
            let mut columns = Vec::with_capacity(out.columns.len() + 1);
            for col in &out.columns {
                let source = if let Some(p) = &col.path {
                    let path = parse(p);
                    skip.insert(field_prefix(&path));
                    let element = element.as_ref().is_some_and(|e| path.starts_with(e));
                    Source::Path {
                        path: nodes.compile(path),
                        element,
                    }
                } else if let Some(p) = &col.count {
                    let path = parse(p);
                    skip.insert(field_prefix(&path));
                    Source::Count(nodes.compile(path))
                } else {
                    Source::LineNo
                };
                let declared = match (&source, col.column_type) {
                    (_, Some(t)) => Some(t.into()),
                    (Source::Count(_) | Source::LineNo, None) => Some(FlatType::Int64),
                    _ => None,
                };
                if let Source::Path { path, .. } | Source::Count(path) = &source {
                    if !path.path.steps.is_empty() {
                        json_columns.insert(path.path.column.clone());
                    }
                }
                columns.push(FlatColumn {
                    name: col.name.clone(),
                    ty: declared.unwrap_or(FlatType::Unknown),
                });
                rules.push(ColumnRule { source, declared });
            }
            if let Some(e) = &explode {
                skip.insert(field_prefix(e));
                if !e.steps.is_empty() {
                    json_columns.insert(e.column.clone());
                }
            }
            let explode = explode.map(|e| nodes.compile(e));
            let unmapped = out.unmapped.as_ref().map(|u: &UnmappedConfig| {
                let under = nodes.compile(parse(&u.under));
                json_columns.insert(under.path.column.clone());
                skip.extend(u.exclude.iter().map(|e| field_prefix(&parse(e))));
                let column = columns.len();
                if u.mode == UnmappedMode::Json {
                    columns.push(FlatColumn {
                        name: u.column.clone(),
                        ty: FlatType::Json,
                    });
                }
                Unmapped {
                    under,
                    mode: u.mode,
                    separator: u.separator.clone(),
                    skip: skip.clone(),
                    column,
                }
            });
            let position = |name: &str| {
                out.columns
                    .iter()
                    .position(|c| c.name == name)
                    .expect("validated key column")
            };
            let key: Vec<usize> = out.key.iter().map(|k| position(k)).collect();
            let group = if explode.is_some() {
                key.iter()
                    .copied()
                    .filter(|&k| match &rules[k].source {
                        Source::Path { element, .. } => !element,
                        Source::Count(_) => true,
                        Source::LineNo => false,
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let index = columns
                .iter()
                .enumerate()
                .map(|(i, c)| (c.name.clone(), i))
                .collect();
            outputs.push(Output {
                rules,
                explode,
                on_delete: out.on_delete,
                unmapped,
                schema: Arc::new(FlatSchema {
                    table: out.name.as_str().into(),
                    version: 1,
                    columns,
                    key,
                    group,
                }),
                index,
                object_paths: BTreeSet::new(),
                origins: BTreeMap::new(),
                resolved: FastMap::default(),
            });
        }
        Self {
            table: config.table.clone(),
            outputs,
            max_columns: config.max_columns,
            json_columns,
            nodes,
            dirty: false,
        }
    }

    /// The schemas as learned so far, one per output table.
    pub fn schemas(&self) -> Vec<Arc<FlatSchema>> {
        self.outputs.iter().map(|o| o.schema.clone()).collect()
    }

    /// Stages the rows `image` makes in `output` (an upsert, or the rows of a group).
    fn stage_upsert(&self, output: &Output, image: &Image<'_>) -> Result<Staged, String> {
        let mut staged = Staged::default();
        match &output.explode {
            None => {
                let row = self.stage_row(output, image, None, &mut staged)?;
                staged.rows.push((FlatOp::Upsert, row));
            }
            Some(explode) => {
                let elements = image
                    .first(explode)
                    .and_then(Value::as_array)
                    .filter(|a| !a.is_empty());
                match elements {
                    Some(elements) => {
                        for (i, element) in elements.iter().enumerate() {
                            let row =
                                self.stage_row(output, image, Some((i, element)), &mut staged)?;
                            staged.rows.push((FlatOp::Upsert, row));
                        }
                    }
                    None => {
                        let row = stage_key(output, image, &output.schema.group, &mut staged)?;
                        staged.rows.push((FlatOp::Delete, row));
                    }
                }
            }
        }
        Ok(staged)
    }

    fn stage_row(
        &self,
        output: &Output,
        image: &Image<'_>,
        element: Option<(usize, &Value)>,
        staged: &mut Staged,
    ) -> Result<Vec<(usize, FlatValue)>, String> {
        let mut row = Vec::with_capacity(output.schema.columns.len());
        for (i, rule) in output.rules.iter().enumerate() {
            let value = match &rule.source {
                Source::LineNo => FlatValue::Int(element.map_or(0, |(line, _)| line as i64 + 1)),
                Source::Count(path) => match image.first(path).and_then(Value::as_array) {
                    Some(a) => FlatValue::Int(a.len() as i64),
                    None => FlatValue::Null,
                },
                Source::Path { path, element: e } => {
                    let found = match (e, element) {
                        (true, Some((_, el))) => {
                            let depth = output
                                .explode
                                .as_ref()
                                .map_or(0, |x| x.path.steps.len() + 1);
                            first(el, &path.path.steps[depth..])
                        }
                        _ => image.first(path),
                    };
                    let original = found.unwrap_or(&Value::Null);
                    self.value(output, i, rule, original, staged).map_err(|e| {
                        format!(
                            "column `{}` ({}): {e}",
                            output.schema.columns[i].name, path.path
                        )
                    })?
                }
            };
            row.push((i, value));
        }
        for &k in &output.schema.key {
            if row[k].1 == FlatValue::Null {
                return Err(format!(
                    "table `{}`: key column `{}` is missing or null",
                    output.schema.table, output.schema.columns[k].name
                ));
            }
        }
        if let Some(u) = &output.unmapped {
            if let Some(Value::Object(fields)) = image.first(&u.under) {
                match u.mode {
                    UnmappedMode::Flatten => {
                        let mut dotted = u.under.path.to_string();
                        let mut name = String::new();
                        self.walk(output, u, fields, &mut dotted, &mut name, &mut row, staged)?;
                    }
                    UnmappedMode::Json => {
                        let mut kept = Map::new();
                        let mut dotted = u.under.path.to_string();
                        collect(u, fields, &mut dotted, "", &mut kept);
                        if !kept.is_empty() {
                            row.push((u.column, FlatValue::Str(Value::Object(kept).to_string())));
                        }
                    }
                }
            }
        }
        Ok(row)
    }

    /// The value of a declared column: cast to its declared type, or fitted to the learned one.
    fn value(
        &self,
        output: &Output,
        column: usize,
        rule: &ColumnRule,
        original: &Value,
        staged: &mut Staged,
    ) -> Result<FlatValue, String> {
        match rule.declared {
            Some(ty) => cast(original, ty),
            None => {
                let inferred = infer(original).map_err(|what| {
                    format!(
                        "the value is {what} {}: map its fields, or set type = \"json\"",
                        short(original)
                    )
                })?;
                staged.put(output, column, inferred, original)
            }
        }
    }

    fn column_index(&self, output: &Output, name: &str, staged: &Staged) -> Option<usize> {
        output.index.get(name).copied().or_else(|| {
            staged
                .added
                .iter()
                .position(|c| c.name == name)
                .map(|i| output.schema.columns.len() + i)
        })
    }

    /// Applies what `staged` learned to `output` and appends its changes.
    fn commit(
        output: &mut Output,
        staged: Staged,
        event: &ChangeEvent,
        out: &mut Vec<WriteOp>,
    ) -> bool {
        let added = !staged.added.is_empty();
        let changed = !staged.learned.is_empty() || added;
        if changed {
            let mut schema = (*output.schema).clone();
            for (column, ty) in staged.learned {
                schema.columns[column].ty = ty;
            }
            for column in staged.added {
                output
                    .index
                    .insert(column.name.clone(), schema.columns.len());
                schema.columns.push(column);
            }
            schema.version += 1;
            output.schema = Arc::new(schema);
        }
        if added {
            // An added column may take an object's name: objects are checked again.
            output
                .resolved
                .retain(|_, r| matches!(r, Resolved::Column(_)));
        }
        output.resolved.extend(
            staged
                .resolved
                .into_iter()
                .filter(|(_, r)| !added || matches!(r, Resolved::Column(_))),
        );
        output.object_paths.extend(staged.added_objects);
        output.origins.extend(staged.added_origins);
        let width = output.schema.columns.len();
        for (op, cells) in staged.rows {
            let mut values = vec![FlatValue::Null; width];
            for (i, v) in cells {
                values[i] = v;
            }
            out.push(change(
                &output.schema,
                op,
                values,
                event.source.ts_ms,
                &event.position,
            ));
        }
        changed
    }
}

/// Stages the key (or group) columns of a row being deleted, from an old image.
fn stage_key(
    output: &Output,
    image: &Image<'_>,
    columns: &[usize],
    staged: &mut Staged,
) -> Result<Vec<(usize, FlatValue)>, String> {
    let mut row = Vec::with_capacity(columns.len());
    for &k in columns {
        let name = &output.schema.columns[k].name;
        let (value, original) = match &output.rules[k].source {
            Source::Path {
                path,
                element: false,
            } => {
                let original = image.first(path).unwrap_or(&Value::Null);
                let value = match output.rules[k].declared {
                    Some(ty) => cast(original, ty).map_err(|e| format!("column `{name}`: {e}"))?,
                    None => staged.put(
                        output,
                        k,
                        infer(original).map_err(|w| format!("column `{name}` is {w}"))?,
                        original,
                    )?,
                };
                (value, original)
            }
            _ => (FlatValue::Null, &Value::Null),
        };
        if value == FlatValue::Null {
            return Err(format!(
                "cannot tell which rows of `{}` to delete: key column `{name}` is not in the old row \
                 ({} given); give the table REPLICA IDENTITY FULL, or set on_delete = \"keep\"",
                output.schema.table,
                kind(original)
            ));
        }
        row.push((k, value));
    }
    Ok(row)
}

impl Projection for FlattenProjection {
    fn reads(&self, table: &TableId) -> bool {
        table.matches(&self.table)
    }

    fn before_image_columns(&self, table: &TableId) -> Vec<String> {
        if !self.reads(table) {
            return Vec::new();
        }
        let mut columns = BTreeSet::new();
        for output in &self.outputs {
            if output.on_delete == FlatOnDelete::Keep {
                continue;
            }
            let keys = if output.explode.is_some() {
                &output.schema.group
            } else {
                &output.schema.key
            };
            for &k in keys {
                if let Source::Path { path, .. } = &output.rules[k].source {
                    columns.insert(path.path.column.clone());
                }
            }
        }
        columns.into_iter().collect()
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        _now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let deleting = |o: &Output| o.on_delete == FlatOnDelete::Delete;
        let mut staged: Vec<Staged> = Vec::with_capacity(self.outputs.len());
        match event.op {
            Op::Truncate => {
                for output in self.outputs.iter().filter(|o| deleting(o)) {
                    let values = vec![FlatValue::Null; output.schema.columns.len()];
                    out.push(change(
                        &output.schema,
                        FlatOp::Truncate,
                        values,
                        event.source.ts_ms,
                        &event.position,
                    ));
                }
                return Ok(());
            }
            Op::Delete => {
                let row = event.before.as_deref().or(event.key.as_deref());
                let Some(row) = row else {
                    return Err(ProjectionError::Invalid(
                        "a delete without the old row or key".into(),
                    ));
                };
                let parsed = parse_documents(row, &self.json_columns);
                let image = Image::new(row, &parsed, &self.nodes);
                for output in &self.outputs {
                    let mut s = Staged::default();
                    if deleting(output) {
                        let columns = if output.explode.is_some() {
                            &output.schema.group
                        } else {
                            &output.schema.key
                        };
                        let key = stage_key(output, &image, columns, &mut s)
                            .map_err(ProjectionError::Invalid)?;
                        s.rows.push((FlatOp::Delete, key));
                    }
                    staged.push(s);
                }
            }
            Op::Create | Op::Read | Op::Update => {
                let Some(after) = event.after.as_deref() else {
                    return Err(ProjectionError::Invalid(
                        "a change without the new row".into(),
                    ));
                };
                let parsed = parse_documents(after, &self.json_columns);
                let image = Image::new(after, &parsed, &self.nodes);
                let old = event
                    .before
                    .as_deref()
                    .map(|b| (b, parse_documents(b, &self.json_columns)));
                let old = old
                    .as_ref()
                    .map(|(b, parsed)| Image::new(b, parsed, &self.nodes));
                for output in &self.outputs {
                    let mut s = self
                        .stage_upsert(output, &image)
                        .map_err(ProjectionError::Invalid)?;
                    // A key that changed: the old key's rows go (when the old row tells it).
                    if let (Some(old), true) = (&old, deleting(output)) {
                        let columns = if output.explode.is_some() {
                            &output.schema.group
                        } else {
                            &output.schema.key
                        };
                        let mut probe = Staged::default();
                        if let (Ok(before), Ok(after)) = (
                            stage_key(output, old, columns, &mut probe),
                            stage_key(output, &image, columns, &mut probe),
                        ) {
                            if before != after {
                                s.rows.insert(0, (FlatOp::Delete, before));
                            }
                        }
                    }
                    staged.push(s);
                }
            }
        }
        for (output, s) in self.outputs.iter_mut().zip(staged) {
            self.dirty |= Self::commit(output, s, event, out);
        }
        Ok(())
    }

    fn take_state(&mut self) -> Option<Vec<u8>> {
        if !std::mem::take(&mut self.dirty) {
            return None;
        }
        let saved: std::collections::BTreeMap<&str, SavedOutput> = self
            .outputs
            .iter()
            .map(|o| {
                (
                    &*o.schema.table,
                    SavedOutput {
                        version: o.schema.version,
                        columns: o.schema.columns.clone(),
                        object_paths: o.object_paths.clone(),
                        origins: o.origins.clone(),
                    },
                )
            })
            .collect();
        Some(serde_json::to_vec(&saved).expect("schemas serialize"))
    }

    fn restore_state(&mut self, state: &[u8]) -> Result<(), String> {
        let mut saved: std::collections::BTreeMap<String, SavedOutput> =
            serde_json::from_slice(state).map_err(|e| format!("unreadable flatten state: {e}"))?;
        for output in &mut self.outputs {
            let Some(s) = saved.remove(&*output.schema.table) else {
                continue;
            };
            let mut schema = (*output.schema).clone();
            // Declared columns keep the pipeline file's order and declared types; what was
            // learned of the others (types, added columns) comes back.
            for column in &mut schema.columns {
                if column.ty == FlatType::Unknown {
                    if let Some(old) = s.columns.iter().find(|c| c.name == column.name) {
                        column.ty = old.ty;
                    }
                }
            }
            for old in &s.columns {
                if !schema.columns.iter().any(|c| c.name == old.name) {
                    schema.columns.push(old.clone());
                }
            }
            schema.version = if schema.columns == s.columns {
                s.version
            } else {
                s.version + 1
            };
            output.index = schema
                .columns
                .iter()
                .enumerate()
                .map(|(i, c)| (c.name.clone(), i))
                .collect();
            output.object_paths = s.object_paths;
            output.origins = s.origins;
            output.resolved.clear();
            output.schema = Arc::new(schema);
        }
        Ok(())
    }
}
