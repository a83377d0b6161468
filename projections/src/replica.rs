//! `kind = "replica"`: the current state of each row, one document per primary key.
//!
//! Creates, updates and snapshot reads upsert the after image; deletes delete; truncates empty the
//! collection. An update that changes the key (when the before image carries it) deletes the old
//! document and upserts the new one. The key is the record's own key when the source provides one
//! (a Kafka key), else the configured key columns of the table.

use std::collections::HashMap;
use std::sync::Arc;

use refract_schemas::config::ReplicaProjectionConfig;
use refract_schemas::{ChangeEvent, Op, Row, TableId};
use serde_json::Value;

use crate::{DocumentOp, OpFamily, Projection, ProjectionError, WriteOp};

/// The replica projection.
pub struct ReplicaProjection {
    config: ReplicaProjectionConfig,
    /// What the configuration says about each table seen, worked out once.
    tables: HashMap<TableId, Arc<TableRule>>,
    /// The last table seen: consecutive events of one table skip the hash lookup.
    last: Option<Last>,
}

/// Write operations that share one copy of their collection name, at most: the operations
/// are dropped on another thread while this one makes the next ones, and one reference count
/// written by both would bounce between them on every operation.
const COLLECTION_SHARES: u32 = 1024;

/// The last table seen, its rule, and the copy of its collection name being handed out.
struct Last {
    table: TableId,
    rule: Arc<TableRule>,
    collection: Arc<str>,
    /// Operations given `collection` so far.
    shares: u32,
}

/// The configuration as it applies to one table.
struct TableRule {
    collection: Arc<str>,
    key_columns: Vec<String>,
}

impl ReplicaProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Documents];

    /// Builds the projection from its configuration.
    pub fn new(config: ReplicaProjectionConfig) -> Self {
        Self {
            config,
            tables: HashMap::new(),
            last: None,
        }
    }

    /// The last table seen, made `table`'s.
    fn last(&mut self, table: &TableId) -> &mut Last {
        let same = |t: &TableId| {
            Arc::ptr_eq(&t.name, &table.name) && Arc::ptr_eq(&t.schema, &table.schema)
        };
        match &mut self.last {
            Some(last) if same(&last.table) => {}
            // The same table under other copies of its names: those are kept, so that the
            // next events compare by pointer again.
            Some(last) if last.table == *table => last.table = table.clone(),
            _ => {
                let rule = self.rule(table);
                self.last = Some(Last {
                    table: table.clone(),
                    collection: rule.collection.clone(),
                    rule,
                    shares: 0,
                });
            }
        }
        self.last.as_mut().expect("set above")
    }

    fn rule(&mut self, table: &TableId) -> Arc<TableRule> {
        let config = &self.config;
        let rule = self
            .tables
            .entry(table.clone())
            .or_insert_with(|| {
                let key_columns = config
                    .key_columns
                    .iter()
                    .find(|(pattern, _)| table.matches(pattern))
                    .map_or(&config.default_key, |(_, cols)| cols)
                    .clone();
                let collection = config
                    .collection
                    .replace("{table}", &table.name)
                    .replace("{schema}", &table.schema)
                    .into();
                Arc::new(TableRule {
                    collection,
                    key_columns,
                })
            })
            .clone();
        rule
    }

    /// The document key of `row`: the record key if any, else the key columns.
    fn key(rule: &TableRule, event: &ChangeEvent, row: &Row) -> Result<String, ProjectionError> {
        // One key column of the row (a snapshot read of a table with a one-column primary key,
        // the usual case): its value directly, without collecting the values first.
        if let (None, Some([column])) = (&event.key, event.key_columns.as_deref()) {
            return match row.get(column.as_str()) {
                Some(v) if !v.is_null() => Ok(render_key(std::iter::once(v))),
                _ => Err(ProjectionError::MissingKey {
                    table: event.table.to_string(),
                    column: column.clone(),
                }),
            };
        }
        Ok(render_key(
            key_values(event, row, &rule.key_columns)?.into_iter(),
        ))
    }
}

/// The values that identify the row of `event`: the record key's (in its own order) when the
/// source provides one (a Kafka key, a table's primary key), else the `columns` of `row`, which
/// must all be non-null.
pub(crate) fn key_values<'a>(
    event: &'a ChangeEvent,
    row: &'a Row,
    columns: &[String],
) -> Result<Vec<&'a Value>, ProjectionError> {
    match event.key_values(row) {
        Some(Ok(values)) => return Ok(values),
        Some(Err(column)) => {
            return Err(ProjectionError::MissingKey {
                table: event.table.to_string(),
                column: column.to_owned(),
            });
        }
        None => {}
    }
    let mut values = Vec::with_capacity(columns.len());
    for column in columns {
        match row.get(column.as_str()) {
            Some(v) if !v.is_null() => values.push(v),
            _ => {
                return Err(ProjectionError::MissingKey {
                    table: event.table.to_string(),
                    column: column.clone(),
                });
            }
        }
    }
    Ok(values)
}

/// Renders key values as one string: each value as text (strings unquoted), joined by `,`, with
/// `%` and `,` percent-escaped in composite keys so distinct keys never collide.
pub fn render_key<'a>(mut values: impl ExactSizeIterator<Item = &'a Value>) -> String {
    let composite = values.len() > 1;
    if !composite {
        // One value (the usual primary key): its text directly, without an intermediate string.
        return match values.next() {
            Some(Value::String(s)) => s.clone(),
            // An integer (the usual key) written without the formatter: it runs once per row.
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => integer_text(n),
            // A number's own text is what the JSON rendering of the value prints.
            Some(Value::Number(n)) => n.to_string(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
    }
    let mut out = String::new();
    for (i, v) in values.enumerate() {
        if i > 0 {
            out.push(',');
        }
        let text = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if composite {
            out.push_str(&text.replace('%', "%25").replace(',', "%2C"));
        } else {
            out.push_str(&text);
        }
    }
    out
}

/// The decimal text of an integer JSON number, as its JSON rendering prints it.
fn integer_text(n: &serde_json::Number) -> String {
    let mut buffer = itoa::Buffer::new();
    match (n.as_u64(), n.as_i64()) {
        (Some(u), _) => buffer.format(u).to_owned(),
        (None, Some(i)) => buffer.format(i).to_owned(),
        (None, None) => n.to_string(),
    }
}

impl Projection for ReplicaProjection {
    fn reads(&self, table: &TableId) -> bool {
        self.config.tables.is_empty() || self.config.tables.iter().any(|t| table.matches(t))
    }

    /// Nothing beyond the key: a delete needs only the key of the document to remove, and a key
    /// change is seen when the old row carries the key (which every replica identity but
    /// NOTHING sends when the key changes).
    fn before_image_columns(&self, _table: &TableId) -> Vec<String> {
        Vec::new()
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        _now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let last = self.last(&event.table);
        if last.shares == COLLECTION_SHARES {
            last.collection = Arc::from(&*last.collection);
            last.shares = 0;
        }
        last.shares += 1;
        let collection = last.collection.clone();
        let rule = &*last.rule;
        let position = event.position.clone();
        match event.op {
            Op::Create | Op::Read | Op::Update => {
                let after = event
                    .after
                    .as_ref()
                    .ok_or_else(|| ProjectionError::Invalid("no after image".into()))?;
                let key = Self::key(rule, event, after)?;
                if event.op == Op::Update && event.key.is_none() && event.key_columns.is_none() {
                    if let Some(before) = event.before.as_deref() {
                        // A before image without the key columns (replica identity DEFAULT
                        // sends only changed keys) cannot have moved the key.
                        if let Ok(old) = Self::key(rule, event, before) {
                            if old != key {
                                out.push(WriteOp::Document(DocumentOp::Delete {
                                    collection: collection.clone(),
                                    key: old,
                                    position: position.clone(),
                                }));
                            }
                        }
                    }
                }
                out.push(WriteOp::Document(DocumentOp::Upsert {
                    collection,
                    key,
                    doc: after.clone(),
                    position,
                }));
            }
            Op::Delete => {
                let before = event
                    .before
                    .as_deref()
                    .ok_or_else(|| ProjectionError::Invalid("no before image".into()))?;
                let key = Self::key(rule, event, before)?;
                out.push(WriteOp::Document(DocumentOp::Delete {
                    collection,
                    key,
                    position,
                }));
            }
            Op::Truncate => out.push(WriteOp::Document(DocumentOp::Truncate {
                collection,
                position,
            })),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;
    use crate::test_support::event;

    fn projection() -> ReplicaProjection {
        ReplicaProjection::new(ReplicaProjectionConfig {
            tables: vec![],
            key_columns: BTreeMap::from([(
                "book_authors".to_string(),
                vec!["book_id".to_string(), "author_id".to_string()],
            )]),
            default_key: vec!["id".into()],
            collection: "{schema}_{table}".into(),
            sinks: vec!["s".into()],
        })
    }

    /// Renders ops compactly: `U coll/key`, `D coll/key`, `T coll`.
    fn ops(
        p: &mut ReplicaProjection,
        line: serde_json::Value,
    ) -> Result<Vec<String>, ProjectionError> {
        let mut out = Vec::new();
        p.project(&event(line), 0, &mut out)?;
        Ok(out
            .iter()
            .map(|op| match op {
                WriteOp::Document(DocumentOp::Upsert {
                    collection, key, ..
                }) => format!("U {collection}/{key}"),
                WriteOp::Document(DocumentOp::Delete {
                    collection, key, ..
                }) => format!("D {collection}/{key}"),
                WriteOp::Document(DocumentOp::Truncate { collection, .. }) => {
                    format!("T {collection}")
                }
                WriteOp::Invalidate(i) => format!("I {}", i.key),
                WriteOp::Row(r) => format!("F {}", r.change.schema.table),
                WriteOp::Change(e) => format!("C {}", e.table),
                WriteOp::Tier(w) => format!("H {}", w.heartbeat.device_id),
                WriteOp::Migrate(m) => format!("M {:?}", m.action),
            })
            .collect())
    }

    #[test]
    fn table() {
        let src = json!({"schema": "public", "table": "authors"});
        let link = json!({"schema": "public", "table": "book_authors"});
        let cases: Vec<(&str, serde_json::Value, Result<Vec<&str>, &str>)> = vec![
            (
                "create",
                json!({"after": {"id": "a1"}, "op": "c", "source": src}),
                Ok(vec!["U public_authors/a1"]),
            ),
            (
                "snapshot",
                json!({"after": {"id": 7}, "op": "r", "source": src}),
                Ok(vec!["U public_authors/7"]),
            ),
            (
                "update",
                json!({"before": {"id": "a1"}, "after": {"id": "a1"}, "op": "u", "source": src}),
                Ok(vec!["U public_authors/a1"]),
            ),
            (
                "key change",
                json!({"before": {"id": "a1"}, "after": {"id": "a2"}, "op": "u", "source": src}),
                Ok(vec!["D public_authors/a1", "U public_authors/a2"]),
            ),
            (
                "delete",
                json!({"before": {"id": "a1"}, "after": null, "op": "d", "source": src}),
                Ok(vec!["D public_authors/a1"]),
            ),
            (
                "truncate",
                json!({"op": "t", "source": src}),
                Ok(vec!["T public_authors"]),
            ),
            (
                "composite key escaped",
                json!({"after": {"book_id": "b,1", "author_id": "a%1"}, "op": "c", "source": link}),
                Ok(vec!["U public_book_authors/b%2C1,a%251"]),
            ),
            (
                "record key wins",
                json!({"key": {"isbn": "x"}, "value": {"after": {"id": "a1"}, "op": "c", "source": src}}),
                Ok(vec!["U public_authors/x"]),
            ),
            (
                "missing key",
                json!({"after": {"name": "n"}, "op": "c", "source": src}),
                Err("column `id` is missing"),
            ),
            (
                "null key",
                json!({"after": {"id": null}, "op": "c", "source": src}),
                Err("column `id` is missing"),
            ),
            (
                "missing composite part",
                json!({"after": {"book_id": "b1"}, "op": "c", "source": link}),
                Err("column `author_id`"),
            ),
        ];
        let mut p = projection();
        for (name, line, want) in cases {
            let got = ops(&mut p, line);
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{name}"),
                (Err(e), Err(words)) => assert!(e.to_string().contains(words), "{name}: {e}"),
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn single_keys_render_as_their_json_text() {
        for v in [
            json!(7),
            json!(-7),
            json!(0),
            json!(10),
            json!(1_000_000),
            json!(i64::MIN),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(1.5),
            json!(1e300),
            json!(true),
            json!(null),
        ] {
            assert_eq!(render_key([&v].into_iter()), v.to_string(), "{v}");
        }
        assert_eq!(render_key([&json!("a,b%")].into_iter()), "a,b%");
        assert_eq!(
            render_key([&json!(1), &json!("a,b")].into_iter()),
            "1,a%2Cb"
        );
    }

    #[test]
    fn table_filter() {
        let mut config = projection().config;
        config.tables = vec!["public.books".into()];
        let p = ReplicaProjection::new(config);
        assert!(p.reads(&TableId::new("public", "books")));
        assert!(!p.reads(&TableId::new("public", "authors")));
        assert!(!p.reads(&TableId::new("other", "books")));
    }
}
