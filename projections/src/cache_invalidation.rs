//! `kind = "cache_invalidation"`: the cache keys a committed change makes stale.
//!
//! Cache-aside (seed 004): the application reads the cache, falls back to the primary store on a
//! miss and fills the cache; after a write commits, every key built from the old row and from
//! the new row must go. For each change this projection renders every key template of the table
//! from the before image and from the after image and emits one [`WriteOp::Invalidate`] per
//! distinct key: a sku change yields the id key, the old sku key and the new sku key.
//!
//! The old row is only as complete as the source sends it (a PostgreSQL table needs `REPLICA
//! IDENTITY FULL` for non-key columns). When a template needs a column the old row does not carry,
//! the keys that can be built are still invalidated and the event is reported as an error (the
//! runtime dead-letters it with the reason) instead of silently leaving the old key behind.
//! `refract plan` and [`Projection::before_image_columns`] say so before the pipeline runs.

use std::collections::HashMap;
use std::sync::Arc;

use refract_schemas::config::{CacheInvalidationProjectionConfig, CacheTableConfig};
use refract_schemas::template::{KeyTemplate, RenderError};
use refract_schemas::{ChangeEvent, Op, Row, TableId};
use serde_json::Value;

use crate::{Invalidation, OpFamily, Projection, ProjectionError, WriteOp};

pub use refract_schemas::write::DELETED_VERSION;

/// The cache-invalidation projection.
pub struct CacheInvalidationProjection {
    /// Table pattern and its rule, in the order of the pipeline file.
    rules: Vec<(String, Arc<TableRule>)>,
    /// Rules resolved per table seen.
    resolved: HashMap<TableId, Option<Arc<TableRule>>>,
}

/// The key templates of one table.
struct TableRule {
    templates: Vec<KeyTemplate>,
    version_column: Option<String>,
}

impl CacheInvalidationProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Invalidations];

    /// Builds the projection; the configuration has been validated (templates parse).
    pub fn new(config: &CacheInvalidationProjectionConfig) -> Self {
        let rules = config
            .tables
            .iter()
            .map(|(pattern, table)| (pattern.clone(), Arc::new(TableRule::new(table))))
            .collect();
        Self {
            rules,
            resolved: HashMap::new(),
        }
    }

    fn rule(&mut self, table: &TableId) -> Option<Arc<TableRule>> {
        if let Some(rule) = self.resolved.get(table) {
            return rule.clone();
        }
        let rule = self
            .rules
            .iter()
            .find(|(pattern, _)| table.matches(pattern))
            .map(|(_, r)| r.clone());
        self.resolved.insert(table.clone(), rule.clone());
        rule
    }
}

impl TableRule {
    fn new(config: &CacheTableConfig) -> Self {
        Self {
            templates: config
                .keys
                .iter()
                .map(|k| KeyTemplate::parse(k).expect("validated key template"))
                .collect(),
            version_column: config.version_column.clone(),
        }
    }

    /// The row's version as an integer: numbers as they are, timestamps as microseconds since
    /// the epoch, integer strings parsed.
    fn version(&self, row: &Row) -> Result<Option<i64>, ProjectionError> {
        let Some(column) = &self.version_column else {
            return Ok(None);
        };
        let bad = |v: &Value| {
            ProjectionError::Invalid(format!(
                "version column `{column}` holds {v}, which is neither an integer nor a timestamp"
            ))
        };
        match row.get(column) {
            None | Some(Value::Null) => Err(ProjectionError::Invalid(format!(
                "version column `{column}` is missing or null in the new row"
            ))),
            Some(v @ Value::Number(n)) => n.as_i64().map(Some).ok_or_else(|| bad(v)),
            Some(v @ Value::String(s)) => s
                .parse::<i64>()
                .ok()
                .or_else(|| {
                    chrono::DateTime::parse_from_rfc3339(s)
                        .ok()
                        .map(|t| t.timestamp_micros())
                })
                .map(Some)
                .ok_or_else(|| bad(v)),
            Some(v) => Err(bad(v)),
        }
    }
}

impl Projection for CacheInvalidationProjection {
    fn reads(&self, table: &TableId) -> bool {
        self.rules.iter().any(|(pattern, _)| table.matches(pattern))
    }

    /// Every column any key template of the table reads: an update that changes one of them
    /// makes the key built from its old value stale, and only the old row knows that value.
    fn before_image_columns(&self, table: &TableId) -> Vec<String> {
        let mut columns: Vec<String> = Vec::new();
        for (_, rule) in self.rules.iter().filter(|(p, _)| table.matches(p)).take(1) {
            for t in &rule.templates {
                for c in t.columns() {
                    if !columns.iter().any(|x| x == c) {
                        columns.push(c.to_owned());
                    }
                }
            }
        }
        columns
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        _now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let Some(rule) = self.rule(&event.table) else {
            return Ok(());
        };
        // Without a usable version the keys are still deleted (plainly: a tombstone needs a
        // version), and the event is reported afterwards.
        let mut version_problem = None;
        let version = match (event.op, event.after.as_deref()) {
            (Op::Delete, _) if rule.version_column.is_some() => Some(DELETED_VERSION),
            (Op::Truncate, _) => {
                return Err(ProjectionError::Invalid(format!(
                    "table `{}` was truncated: its cache keys cannot be listed from the change \
                     feed; flush the cache (or the keys of this table) by hand",
                    event.table
                )));
            }
            (_, Some(after)) => rule.version(after).unwrap_or_else(|e| {
                version_problem = Some(e);
                None
            }),
            (_, None) => None,
        };
        if event.op == Op::Delete && event.before.is_none() {
            return Err(ProjectionError::Invalid(
                "a delete without its old row: the cache keys to delete are unknown".into(),
            ));
        }
        let first = out.len();
        let push = |key: String, out: &mut Vec<WriteOp>| {
            if !out[first..]
                .iter()
                .any(|op| matches!(op, WriteOp::Invalidate(i) if i.key == key))
            {
                out.push(WriteOp::Invalidate(Invalidation {
                    key,
                    version,
                    position: event.position.clone(),
                }));
            }
        };
        let mut unknown: Vec<String> = Vec::new();
        // The new row, then the old one. Without an old row, an update under a replica identity
        // that sent none kept its key columns: only the templates that read nothing but key
        // columns are known to render the same old key.
        if let Some(after) = event.after.as_deref() {
            for t in &rule.templates {
                if let Ok(key) = t.render(after) {
                    push(key, out);
                }
            }
        }
        let old = event.before.as_deref().or(match event.op {
            Op::Update => None,
            _ => event.after.as_deref(),
        });
        for t in &rule.templates {
            match (old, event.op) {
                (Some(before), _) => match t.render(before) {
                    Ok(key) => push(key, out),
                    Err(RenderError::Absent(column)) => unknown.push(format!(
                        "`{}` needs `{column}`, which the old row does not carry",
                        t.as_str()
                    )),
                    Err(RenderError::Null(_)) => {}
                },
                (None, Op::Update) => {
                    let only_key = t.columns().iter().all(|c| event.is_key_column(c));
                    if !only_key {
                        unknown.push(format!(
                            "`{}` reads non-key columns and the update carries no old row",
                            t.as_str()
                        ));
                    }
                }
                (None, _) => {}
            }
        }
        if out.len() == first && event.op != Op::Delete && event.after.is_some() {
            let needed: Vec<&str> = rule.templates.iter().map(|t| t.as_str()).collect();
            return Err(ProjectionError::Invalid(format!(
                "no key could be built from the new row (templates {}): a key column is null",
                needed.join(", ")
            )));
        }
        if let Some(problem) = version_problem {
            return Err(problem);
        }
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(ProjectionError::Invalid(format!(
                "old cache keys unknown: {}; the keys of the new row were invalidated. Set \
                 REPLICA IDENTITY FULL on `{}` so old values reach refract",
                unknown.join("; "),
                event.table
            )))
        }
    }
}

#[cfg(test)]
mod tests;
