//! Golden tests: `tests/golden/<projection>/input.jsonl` (Debezium envelopes) must project to
//! `expected.jsonl` (one write operation per line). After an intended change, rewrite the
//! expectations with `REFRACT_UPDATE_GOLDEN=1 cargo test -p refract-projections --test golden`
//! and review the diff.

use std::collections::BTreeMap;
use std::path::Path;

use refract_projections::{
    DocumentOp, Invalidation, Projection, RowChange, WriteOp, replica::ReplicaProjection,
};
use refract_schemas::config::ReplicaProjectionConfig;
use refract_schemas::debezium::DebeziumDecoder;
use refract_schemas::{Offset, Position, Record};
use serde_json::json;

fn run_golden(name: &str, projection: &mut dyn Projection) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(name);
    let input = std::fs::read_to_string(dir.join("input.jsonl")).unwrap();
    let mut decoder = DebeziumDecoder::new();
    let mut rendered = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let position = Position {
            partition: "golden".into(),
            offset: Offset(i as u64 + 1, 0),
        };
        let record = decoder.decode(line.as_bytes(), position);
        let Ok(Record::Change(event)) = record else {
            rendered.push(json!({"line": i + 1, "not_a_change": format!("{record:?}").chars().take(60).collect::<String>()}).to_string());
            continue;
        };
        let mut ops = Vec::new();
        if let Err(e) = projection.project(&event, 0, &mut ops) {
            rendered.push(json!({"line": i + 1, "error": e.to_string()}).to_string());
        }
        for op in ops {
            rendered.push(
                match op {
                    WriteOp::Document(DocumentOp::Upsert {
                        collection,
                        key,
                        doc,
                        ..
                    }) => json!({"line": i + 1, "upsert": *collection, "key": key, "doc": *doc}),
                    WriteOp::Document(DocumentOp::Delete {
                        collection, key, ..
                    }) => json!({"line": i + 1, "delete": *collection, "key": key}),
                    WriteOp::Document(DocumentOp::Truncate { collection, .. }) => {
                        json!({"line": i + 1, "truncate": *collection})
                    }
                    WriteOp::Invalidate(Invalidation { key, version, .. }) => {
                        json!({"line": i + 1, "invalidate": key, "version": version})
                    }
                    WriteOp::Row(RowChange { change, .. }) => {
                        json!({"line": i + 1, "flat": *change.schema.table, "op": change.op.code()})
                    }
                    WriteOp::Change(event) => {
                        json!({"line": i + 1, "change": event.table.to_string(), "op": event.op.code()})
                    }
                    WriteOp::Tier(w) => {
                        json!({"line": i + 1, "tier": w.tier.name(), "device": w.heartbeat.device_id, "ts": w.heartbeat.ts_micros, "put": w.action == refract_schemas::write::tiers::TierAction::Put})
                    }
                    WriteOp::Migrate(m) => json!({"line": i + 1, "migrate": format!("{:?}", m.action)}),
                }
                .to_string(),
            );
        }
    }
    let mut actual = rendered.join("\n");
    actual.push('\n');
    let expected_path = dir.join("expected.jsonl");
    if std::env::var_os("REFRACT_UPDATE_GOLDEN").is_some() {
        std::fs::write(&expected_path, &actual).unwrap();
    }
    let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
    for (n, (a, e)) in actual.lines().zip(expected.lines()).enumerate() {
        assert_eq!(a, e, "{name}: output line {} differs", n + 1);
    }
    assert_eq!(
        actual.lines().count(),
        expected.lines().count(),
        "{name}: number of operations"
    );
}

#[test]
fn replica() {
    let mut projection = ReplicaProjection::new(ReplicaProjectionConfig {
        tables: vec![],
        key_columns: BTreeMap::from([
            (
                "book_authors".to_string(),
                vec!["book_id".to_string(), "author_id".to_string()],
            ),
            (
                "device_heartbeats".to_string(),
                vec!["device_id".to_string(), "ts".to_string()],
            ),
            ("orders".to_string(), vec!["order_id".to_string()]),
        ]),
        default_key: vec!["id".into()],
        collection: "{table}".into(),
        sinks: vec!["s".into()],
    });
    run_golden("replica", &mut projection);
}
