//! A document projection's configuration, compiled: the tables it mirrors with the roles each
//! plays, and how a document is assembled from their rows.

use std::cmp::Ordering;

use refract_schemas::Row;
use refract_schemas::config::{DocumentFieldConfig, DocumentProjectionConfig};
use refract_schemas::template::KeyTemplate;
use serde_json::Value;

use crate::replica::render_key;

/// The prefix of a link-row column in an embed's fields and `order_by`.
pub(super) const THROUGH: &str = "through.";

/// Everything the projection knows of its configuration.
pub(super) struct Shape {
    /// Every table read, numbered by position (the number is part of the store keys).
    pub(super) tables: Vec<Table>,
    /// The root table's number.
    pub(super) root: u8,
    /// Fields copied from the root row.
    pub(super) fields: Vec<Field>,
    /// Arrays of child rows.
    pub(super) embeds: Vec<Embed>,
    /// Arrays of one-field objects from the root row.
    pub(super) objects: Vec<(String, Vec<Field>)>,
}

/// A table the projection mirrors.
pub(super) struct Table {
    /// The table as configured (`table` or `schema.table`).
    pub(super) pattern: String,
    /// The key columns: a row's id.
    pub(super) key: Vec<String>,
    /// The columns mirrored: every column any role reads.
    pub(super) columns: Vec<String>,
    /// Indexed columns (value to row ids), numbered by position.
    pub(super) indexes: Vec<String>,
    /// What the table's rows are to the documents.
    pub(super) roles: Vec<Role>,
}

/// One part a table plays, with the columns whose change matters to it.
pub(super) struct Role {
    /// The part.
    pub(super) kind: RoleKind,
    /// The columns that, when they change, change the documents the row reaches.
    pub(super) columns: Vec<String>,
}

/// The part a table plays in the documents.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum RoleKind {
    /// Its rows are the documents.
    Root,
    /// Its rows are the children of embed `.0`.
    Child(usize),
    /// Its rows pair roots with children of embed `.0`.
    Link(usize),
}

/// An array of child rows.
pub(super) struct Embed {
    /// The document field.
    pub(super) name: String,
    /// The child table's number.
    pub(super) child: u8,
    /// How children are found from a root.
    pub(super) via: Via,
    /// Sort columns (of the combined row: child columns, `through.` link columns) and whether
    /// each is descending; then the child key ascending.
    pub(super) order: Vec<(String, bool)>,
    /// The child key columns (the tie-break).
    pub(super) child_key: Vec<String>,
    /// Most children listed.
    pub(super) limit: Option<usize>,
    /// List the children's ids instead of objects.
    pub(super) ids: bool,
    /// Fields of each object.
    pub(super) fields: Vec<Field>,
    /// A document field counting the children.
    pub(super) count: Option<String>,
    /// Link columns copied into the combined row as `through.column`.
    pub(super) link_columns: Vec<String>,
}

/// How an embed's children are found.
pub(super) enum Via {
    /// Through the link table `table`: its column `parent` holds the root key, `child` the
    /// child key; both are indexed (`by_parent`, `by_child`).
    Link {
        table: u8,
        parent: String,
        child: String,
        by_parent: u8,
        by_child: u8,
    },
    /// The child column `column` (index `index` of the child table) holds the root key.
    ForeignKey { column: String, index: u8 },
}

/// One field of a document or object.
pub(super) struct Field {
    /// Its name.
    pub(super) name: String,
    /// Where its value comes from.
    pub(super) source: Source,
}

/// Where a field's value comes from.
pub(super) enum Source {
    /// A column, JSON type kept.
    Column(String),
    /// Text rendered from columns.
    Template(KeyTemplate),
}

impl Source {
    fn new(from: &str) -> Self {
        if from.contains('{') {
            if let Ok(t) = KeyTemplate::parse(from) {
                return Source::Template(t);
            }
        }
        // Validation rejects malformed templates; unvalidated ones read as a column name.
        Source::Column(from.to_owned())
    }

    /// The columns it reads.
    fn columns(&self) -> Vec<&str> {
        match self {
            Source::Column(c) => vec![c.as_str()],
            Source::Template(t) => t.columns(),
        }
    }

    /// Its value in `row`: null when absent (a template: when a column is null or absent).
    pub(super) fn value(&self, row: &Row) -> Value {
        match self {
            Source::Column(c) => row.get(c).cloned().unwrap_or(Value::Null),
            Source::Template(t) => t.render(row).map_or(Value::Null, Value::String),
        }
    }
}

fn fields(config: &[DocumentFieldConfig]) -> Vec<Field> {
    config
        .iter()
        .map(|f| Field {
            name: f.name.clone(),
            source: Source::new(&f.from),
        })
        .collect()
}

fn add(columns: &mut Vec<String>, column: &str) {
    if !columns.iter().any(|c| c == column) {
        columns.push(column.to_owned());
    }
}

impl Shape {
    /// Compiles a configuration (validated: see `refract_schemas::config`).
    pub(super) fn new(config: &DocumentProjectionConfig) -> Self {
        let mut shape = Shape {
            tables: Vec::new(),
            root: 0,
            fields: fields(&config.fields),
            embeds: Vec::new(),
            objects: config
                .objects
                .iter()
                .map(|o| (o.name.clone(), fields(&o.items)))
                .collect(),
        };
        shape.root = shape.table(&config.table, &config.key);
        let mut root_columns = config.key.clone();
        for f in shape
            .fields
            .iter()
            .chain(shape.objects.iter().flat_map(|o| &o.1))
        {
            for c in f.source.columns() {
                add(&mut root_columns, c);
            }
        }
        shape.role(shape.root, RoleKind::Root, root_columns);
        for (e, config) in config.embeds.iter().enumerate() {
            let child = shape.table(&config.table, &config.key);
            let embed_fields = if config.ids {
                Vec::new()
            } else {
                fields(&config.fields)
            };
            let order: Vec<(String, bool)> = config
                .order_by
                .iter()
                .map(|o| match o.strip_prefix('-') {
                    Some(c) => (c.to_owned(), true),
                    None => (o.clone(), false),
                })
                .collect();
            // Columns read by fields and order: the child's, and the link's (`through.`).
            let mut child_columns = config.key.clone();
            let mut link_columns = Vec::new();
            let read = embed_fields
                .iter()
                .flat_map(|f| f.source.columns())
                .chain(order.iter().map(|(c, _)| c.as_str()));
            for c in read {
                match c.strip_prefix(THROUGH) {
                    Some(l) => add(&mut link_columns, l),
                    None => add(&mut child_columns, c),
                }
            }
            let via = match (&config.through, &config.foreign_key) {
                (Some(link), _) => {
                    let table = shape.table(&link.table, &link.key_columns());
                    let by_parent = shape.index(table, &link.parent);
                    let by_child = shape.index(table, &link.child);
                    let mut columns = vec![link.parent.clone(), link.child.clone()];
                    for c in &link_columns {
                        add(&mut columns, c);
                    }
                    shape.role(table, RoleKind::Link(e), columns);
                    Via::Link {
                        table,
                        parent: link.parent.clone(),
                        child: link.child.clone(),
                        by_parent,
                        by_child,
                    }
                }
                (None, fk) => {
                    let column = fk.clone().unwrap_or_default();
                    add(&mut child_columns, &column);
                    let index = shape.index(child, &column);
                    Via::ForeignKey { column, index }
                }
            };
            shape.role(child, RoleKind::Child(e), child_columns);
            shape.embeds.push(Embed {
                name: config.name.clone(),
                child,
                via,
                order,
                child_key: config.key.clone(),
                limit: config.limit,
                ids: config.ids,
                fields: embed_fields,
                count: config.count.clone(),
                link_columns,
            });
        }
        shape
    }

    /// The number of table `pattern`, added when new (its key is the first one named).
    fn table(&mut self, pattern: &str, key: &[String]) -> u8 {
        let t = match self.tables.iter().position(|t| t.pattern == pattern) {
            Some(t) => t,
            None => {
                self.tables.push(Table {
                    pattern: pattern.to_owned(),
                    key: key.to_vec(),
                    columns: key.to_vec(),
                    indexes: Vec::new(),
                    roles: Vec::new(),
                });
                self.tables.len() - 1
            }
        };
        u8::try_from(t).expect("validation bounds the number of tables")
    }

    /// The number of the index of `column` in table `t`, added when new.
    fn index(&mut self, t: u8, column: &str) -> u8 {
        let indexes = &mut self.tables[usize::from(t)].indexes;
        let i = indexes.iter().position(|c| c == column).unwrap_or_else(|| {
            indexes.push(column.to_owned());
            indexes.len() - 1
        });
        u8::try_from(i).expect("validation bounds the number of indexes")
    }

    fn role(&mut self, t: u8, kind: RoleKind, columns: Vec<String>) {
        let table = &mut self.tables[usize::from(t)];
        for c in &columns {
            add(&mut table.columns, c);
        }
        table.roles.push(Role { kind, columns });
    }
}

/// A value's text in keys and joins: a string as it is, anything else as its JSON text.
pub(super) fn text(value: &Value) -> String {
    render_key([value].into_iter())
}

/// The document key of a root id: its single part, or the parts joined with `:` (`%` and `:`
/// inside a part written `%25` and `%3A`).
pub(super) fn document_key(id: &[String]) -> String {
    match id {
        [one] => one.clone(),
        parts => parts
            .iter()
            .map(|p| p.replace('%', "%25").replace(':', "%3A"))
            .collect::<Vec<_>>()
            .join(":"),
    }
}

/// Orders column values the way PostgreSQL's `ORDER BY` does for one type: numbers by value,
/// strings by their bytes, `false` before `true`; null (or absent) after everything. Values of
/// different JSON types order by type (booleans, numbers, strings, arrays, objects).
pub(super) fn compare(a: Option<&Value>, b: Option<&Value>) -> Ordering {
    fn rank(v: Option<&Value>) -> u8 {
        match v {
            Some(Value::Bool(_)) => 0,
            Some(Value::Number(_)) => 1,
            Some(Value::String(_)) => 2,
            Some(Value::Array(_)) => 3,
            Some(Value::Object(_)) => 4,
            Some(Value::Null) | None => 5,
        }
    }
    match (a, b) {
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (Some(Value::Number(x)), Some(Value::Number(y))) => {
            match (x.as_i64(), y.as_i64(), x.as_u64(), y.as_u64()) {
                (Some(x), Some(y), _, _) => x.cmp(&y),
                (_, _, Some(x), Some(y)) => x.cmp(&y),
                _ => {
                    let (x, y) = (x.as_f64().unwrap_or(0.0), y.as_f64().unwrap_or(0.0));
                    x.total_cmp(&y)
                }
            }
        }
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(x @ (Value::Array(_) | Value::Object(_))), Some(y))
            if rank(Some(x)) == rank(Some(y)) =>
        {
            x.to_string().cmp(&y.to_string())
        }
        _ => rank(a).cmp(&rank(b)),
    }
}
