//! `kind = "relay"`: every change of its tables, unchanged, as one change-event operation.
//!
//! Creates, updates, deletes, snapshot reads and truncates all pass; nothing is derived, so the
//! projection keeps no state and needs no columns beyond what the source sends. With a Kafka
//! sink this makes refract a Debezium replacement: one topic per table, Debezium envelopes.

use std::sync::Arc;

use refract_schemas::config::RelayProjectionConfig;
use refract_schemas::{ChangeEvent, TableId};

use crate::{OpFamily, Projection, ProjectionError, WriteOp};

/// The relay projection.
pub struct RelayProjection {
    tables: Vec<String>,
}

impl RelayProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Changes];

    /// Builds the projection from its configuration.
    pub fn new(config: &RelayProjectionConfig) -> Self {
        Self {
            tables: config.tables.clone(),
        }
    }
}

impl Projection for RelayProjection {
    fn reads(&self, table: &TableId) -> bool {
        self.tables.is_empty() || self.tables.iter().any(|t| table.matches(t))
    }

    /// Nothing: the event goes out with whatever before image the source sent.
    fn before_image_columns(&self, _table: &TableId) -> Vec<String> {
        Vec::new()
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        _now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        out.push(WriteOp::Change(Arc::new(event.clone())));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::test_support::event;

    fn relay(tables: &[&str]) -> RelayProjection {
        RelayProjection::new(&RelayProjectionConfig {
            tables: tables.iter().map(|t| (*t).to_owned()).collect(),
            sinks: vec!["k".into()],
        })
    }

    #[test]
    fn every_op_is_relayed_unchanged() {
        let src = json!({"schema": "public", "table": "authors", "lsn": 7, "txId": 3});
        let cases = [
            (
                "create",
                json!({"after": {"id": 1}, "op": "c", "source": src}),
            ),
            (
                "snapshot read",
                json!({"after": {"id": 1}, "op": "r", "source": src}),
            ),
            (
                "update",
                json!({"before": {"id": 1}, "after": {"id": 2}, "op": "u", "source": src}),
            ),
            (
                "delete",
                json!({"before": {"id": 1}, "op": "d", "source": src}),
            ),
            ("truncate", json!({"op": "t", "source": src})),
            (
                "record key",
                json!({"key": {"k": 1}, "value": {"after": {"id": 1}, "op": "c", "source": src}}),
            ),
        ];
        let mut p = relay(&[]);
        for (name, line) in cases {
            let e = event(line);
            let mut out = Vec::new();
            p.project(&e, 0, &mut out).unwrap();
            assert_eq!(out, vec![WriteOp::Change(Arc::new(e.clone()))], "{name}");
            assert_eq!(out[0].family(), OpFamily::Changes, "{name}");
            assert_eq!(out[0].position(), &e.position, "{name}");
        }
    }

    #[test]
    fn tables_select_what_is_relayed() {
        let cases: [(&[&str], &str, &str, bool); 6] = [
            (&[], "public", "authors", true),
            (&["authors"], "public", "authors", true),
            (&["authors"], "other", "authors", true),
            (&["public.authors"], "other", "authors", false),
            (
                &["public.books", "public.authors"],
                "public",
                "authors",
                true,
            ),
            (&["books"], "public", "authors", false),
        ];
        for (tables, schema, name, want) in cases {
            let got = relay(tables).reads(&TableId::new(schema, name));
            assert_eq!(got, want, "{tables:?} reads {schema}.{name}");
        }
    }
}
