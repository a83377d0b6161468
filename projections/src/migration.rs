//! `kind = "migration"`: the dual write of a shadow-write migration (seed 003 §5.2).
//!
//! Before the cut-over, every change of the source table becomes the same change of the target
//! table, through the declared transform; changes of the target table are the dual write's own
//! echo and are ignored. The cut-over is itself a change in the stream: `refract migrate
//! cutover` sets `requested_read_from` in the migration's control-table row, and where that
//! change sits in the stream, every earlier change of the source has been projected, so the
//! projection emits a [`MigrationAction::Switch`] there and from then on works the other way:
//! changes of the target go back to the source through the reverse transform, and changes of the
//! source are ignored. A rollback is the same switch back.
//!
//! The switches are the projection's state (their positions, which only ever grow), so that a
//! replay after a crash projects each change in the direction that held at its position.

pub mod transform;
pub mod value;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use refract_schemas::config::MigrationProjectionConfig;
use refract_schemas::write::migration::{MigrationAction, MigrationOp};
use refract_schemas::{ChangeEvent, Offset, Op, Row, TableId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use transform::{ColumnRule, ConvertError, RuleKind, Transform};

use crate::{OpFamily, Projection, ProjectionError, WriteOp};

/// The control-table column `refract migrate cutover` and `rollback` set: the table reads
/// should move to. The other columns are the sink's and the commands'.
pub const REQUESTED_COLUMN: &str = "requested_read_from";

/// One change of direction, at the position of the control-table change that asked for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Switch {
    at: Offset,
    /// Whether changes after `at` go from the target back to the source.
    reverse: bool,
}

/// The dual write.
pub struct MigrationProjection {
    transform: Result<Transform, String>,
    config: MigrationProjectionConfig,
    source: Arc<str>,
    target: Arc<str>,
    switches: Vec<Switch>,
    changed: bool,
}

impl MigrationProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Migration];

    /// The projection of `config`; a transform that does not compile makes every event fail
    /// with the reason (`refract migrate` checks it before it starts anything).
    pub fn new(config: &MigrationProjectionConfig) -> Self {
        let transform = Transform::new(
            &config.migration,
            &config.source_shape,
            &config.target_shape,
        )
        .map_err(|problems| {
            problems
                .into_iter()
                .map(|(path, message)| format!("`{path}` {message}"))
                .collect::<Vec<_>>()
                .join("; ")
        });
        Self {
            transform,
            source: config.migration.migration.source.as_str().into(),
            target: config.migration.migration.target.as_str().into(),
            config: config.clone(),
            switches: Vec::new(),
            changed: false,
        }
    }

    /// Whether changes at `at` go from the target back to the source.
    fn reverse_at(&self, at: Offset) -> bool {
        self.switches
            .iter()
            .rev()
            .find(|s| s.at < at)
            .is_some_and(|s| s.reverse)
    }

    fn control(&mut self, event: &ChangeEvent, out: &mut Vec<WriteOp>) {
        let Some(after) = &event.after else {
            return;
        };
        let ours = after.get("name").and_then(Value::as_str)
            == Some(&self.config.migration.migration.name);
        let Some(requested) = after.get(REQUESTED_COLUMN).and_then(Value::as_str) else {
            return;
        };
        if !ours {
            return;
        }
        let at = event.position.offset;
        let want_reverse = *requested == *self.target;
        if want_reverse == self.reverse_at(at) {
            return;
        }
        if self.switches.last().is_none_or(|s| s.at < at) {
            self.switches.push(Switch {
                at,
                reverse: want_reverse,
            });
            self.changed = true;
        }
        let read_from = if want_reverse {
            &self.target
        } else {
            &self.source
        };
        out.push(WriteOp::Migrate(MigrationOp {
            action: MigrationAction::Switch {
                read_from: read_from.clone(),
            },
            position: event.position.clone(),
        }));
    }

    /// The writes of a change of the table rows are read from: into the other table.
    fn apply(
        &self,
        event: &ChangeEvent,
        reverse: bool,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let transform = self
            .transform
            .as_ref()
            .map_err(|e| ProjectionError::Invalid(e.clone()))?;
        let (written, from_key, key_of, row_of, identity): (
            &Arc<str>,
            &[String],
            KeyFn,
            RowFn,
            &Arc<[String]>,
        ) = if reverse {
            (
                &self.source,
                transform.identity(),
                Transform::reverse_key,
                Transform::reverse,
                transform.source_key(),
            )
        } else {
            (
                &self.target,
                transform.source_key(),
                Transform::forward_key,
                Transform::forward,
                transform.identity(),
            )
        };
        let bad = |row: &Row, e: ConvertError| {
            ProjectionError::Invalid(format!(
                "`{}` row {}: {e}; not written",
                event.table,
                key_text(row, from_key)
            ))
        };
        let push = |out: &mut Vec<WriteOp>, action| {
            out.push(WriteOp::Migrate(MigrationOp {
                action,
                position: event.position.clone(),
            }))
        };
        match event.op {
            Op::Create | Op::Read | Op::Update => {
                let after = event.after.as_deref().ok_or_else(|| {
                    ProjectionError::Invalid(format!("`{}` change without a new row", event.table))
                })?;
                if let Some(before) = event.before.as_deref()
                    && key_changed(before, after, from_key)
                {
                    let key = key_of(transform, before).map_err(|e| bad(before, e))?;
                    push(
                        out,
                        MigrationAction::Delete {
                            table: written.clone(),
                            key,
                        },
                    );
                }
                let row = row_of(transform, after).map_err(|e| bad(after, e))?;
                push(
                    out,
                    MigrationAction::Upsert {
                        table: written.clone(),
                        identity: identity.clone(),
                        row,
                    },
                );
            }
            Op::Delete => {
                let old = event
                    .before
                    .as_deref()
                    .or(event.key.as_deref())
                    .ok_or_else(|| {
                        ProjectionError::Invalid(format!(
                            "`{}` delete without its key",
                            event.table
                        ))
                    })?;
                let key = key_of(transform, old).map_err(|e| bad(old, e))?;
                push(
                    out,
                    MigrationAction::Delete {
                        table: written.clone(),
                        key,
                    },
                );
            }
            Op::Truncate => {
                return Err(ProjectionError::Invalid(format!(
                    "`{}` was truncated: a migration does not carry a truncate to `{written}`; truncate it by hand if that is meant",
                    event.table
                )));
            }
        }
        Ok(())
    }
}

type KeyFn = fn(&Transform, &Row) -> Result<Row, ConvertError>;
type RowFn = fn(&Transform, &Row) -> Result<Row, ConvertError>;

/// Whether `before` and `after` hold different values in the key columns `before` has.
fn key_changed(before: &Row, after: &Row, key: &[String]) -> bool {
    key.iter()
        .any(|k| before.get(k).is_some_and(|old| Some(old) != after.get(k)))
}

/// `(k1=v1, k2=v2)` of a row's key columns, for reports.
pub fn key_text(row: &Row, key: &[String]) -> String {
    let parts: Vec<String> = key
        .iter()
        .map(|k| format!("{k}={}", row.get(k).unwrap_or(&Value::Null)))
        .collect();
    format!("({})", parts.join(", "))
}

impl Projection for MigrationProjection {
    fn reads(&self, table: &TableId) -> bool {
        let m = &self.config.migration.migration;
        table.matches(&m.source) || table.matches(&m.target) || table.matches(&m.control_table)
    }

    fn before_image_columns(&self, _table: &TableId) -> Vec<String> {
        Vec::new()
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        _now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let m = &self.config.migration.migration;
        if event.table.matches(&m.control_table) {
            self.control(event, out);
            return Ok(());
        }
        let reverse = self.reverse_at(event.position.offset);
        if event.table.matches(&m.source) && !reverse {
            self.apply(event, false, out)
        } else if event.table.matches(&m.target) && reverse {
            self.apply(event, true, out)
        } else {
            // The other table's changes are the dual write's own echo (or, after a switch, late
            // writes to the table applications no longer use).
            Ok(())
        }
    }

    fn take_state(&mut self) -> Option<Vec<u8>> {
        std::mem::take(&mut self.changed)
            .then(|| serde_json::to_vec(&self.switches).expect("switches serialize"))
    }

    fn restore_state(&mut self, state: &[u8]) -> Result<(), String> {
        self.switches = serde_json::from_slice(state).map_err(|e| e.to_string())?;
        Ok(())
    }
}
