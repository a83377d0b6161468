use std::collections::BTreeMap;

use refract_schemas::config::{CacheInvalidationProjectionConfig, CacheTableConfig};
use serde_json::json;

use super::*;
use crate::test_support::event;

fn projection(version_column: Option<&str>) -> CacheInvalidationProjection {
    CacheInvalidationProjection::new(&CacheInvalidationProjectionConfig {
        tables: BTreeMap::from([(
            "public.products".to_string(),
            CacheTableConfig {
                keys: vec![
                    "product:{id}:v3".into(),
                    "product:sku:{sku}:v3".into(),
                    "[t:{tenant_id}:]list:{id}".into(),
                ],
                version_column: version_column.map(str::to_owned),
            },
        )]),
        sinks: vec!["cache".into()],
    })
}

/// The keys invalidated (`key@version`), and the error if any.
fn run(
    p: &mut CacheInvalidationProjection,
    line: serde_json::Value,
) -> (Vec<String>, Option<String>) {
    let mut out = Vec::new();
    let result = p.project(&event(line), 0, &mut out);
    let keys = out
        .iter()
        .map(|op| match op {
            WriteOp::Invalidate(i) => match i.version {
                Some(v) => format!("{}@{v}", i.key),
                None => i.key.clone(),
            },
            other => panic!("only invalidations, got {other:?}"),
        })
        .collect();
    (keys, result.err().map(|e| e.to_string()))
}

#[test]
fn table() {
    let src = json!({"schema": "public", "table": "products"});
    let row = |sku: &str, tenant: serde_json::Value| json!({"id": 7, "sku": sku, "tenant_id": tenant, "name": "n"});
    let cases: Vec<(&str, serde_json::Value, Vec<&str>, Option<&str>)> = vec![
        (
            "create: the new row's keys",
            json!({"after": row("A", json!("acme")), "op": "c", "source": src}),
            vec!["product:7:v3", "product:sku:A:v3", "t:acme:list:7"],
            None,
        ),
        (
            "update, sku unchanged: each key once",
            json!({"before": row("A", json!("acme")), "after": row("A", json!("acme")), "op": "u", "source": src}),
            vec!["product:7:v3", "product:sku:A:v3", "t:acme:list:7"],
            None,
        ),
        (
            "sku change: id key, new sku key and old sku key",
            json!({"before": row("A", json!(null)), "after": row("B", json!(null)), "op": "u", "source": src}),
            vec![
                "product:7:v3",
                "product:sku:B:v3",
                "list:7",
                "product:sku:A:v3",
            ],
            None,
        ),
        (
            "tenant moved: the optional segment of both rows",
            json!({"before": row("A", json!("acme")), "after": row("A", json!("zeta")), "op": "u", "source": src}),
            vec![
                "product:7:v3",
                "product:sku:A:v3",
                "t:zeta:list:7",
                "t:acme:list:7",
            ],
            None,
        ),
        (
            "delete: the old row's keys",
            json!({"before": row("A", json!(null)), "after": null, "op": "d", "source": src}),
            vec!["product:7:v3", "product:sku:A:v3", "list:7"],
            None,
        ),
        (
            "snapshot read invalidates like a create",
            json!({"after": row("A", json!(null)), "op": "r", "source": src}),
            vec!["product:7:v3", "product:sku:A:v3", "list:7"],
            None,
        ),
        (
            "update without an old row: new keys go, the rest is reported",
            json!({"after": row("B", json!(null)), "op": "u", "source": src}),
            vec!["product:7:v3", "product:sku:B:v3", "list:7"],
            Some("REPLICA IDENTITY FULL"),
        ),
        (
            "old row limited to the key: new keys go, old sku key unknown",
            json!({"before": {"id": 7}, "after": row("B", json!(null)), "op": "u", "source": src}),
            vec!["product:7:v3", "product:sku:B:v3", "list:7"],
            Some("`product:sku:{sku}:v3` needs `sku`"),
        ),
        (
            "delete with a key-only old row: the id key goes, the rest is reported",
            json!({"before": {"id": 7}, "after": null, "op": "d", "source": src}),
            vec!["product:7:v3"],
            Some("needs `sku`"),
        ),
        (
            "truncate cannot be listed",
            json!({"op": "t", "source": src}),
            vec![],
            Some("truncated"),
        ),
        (
            "null sku: that key cannot be built",
            json!({"after": {"id": 7, "sku": null, "tenant_id": null}, "op": "c", "source": src}),
            vec!["product:7:v3", "list:7"],
            None,
        ),
    ];
    let mut p = projection(None);
    for (name, line, want, error) in cases {
        let (got, err) = run(&mut p, line);
        assert_eq!(got, want, "{name}");
        match (err, error) {
            (None, None) => {}
            (Some(e), Some(words)) => assert!(e.contains(words), "{name}: {e}"),
            (e, w) => panic!("{name}: error {e:?}, expected {w:?}"),
        }
    }
}

#[test]
fn versions_come_from_the_version_column() {
    let src = json!({"schema": "public", "table": "products"});
    let mut p = projection(Some("updated_at"));
    let (keys, err) = run(
        &mut p,
        json!({"after": {"id": 1, "sku": "A", "tenant_id": null, "updated_at": "2026-12-02T10:00:00.000001Z"}, "op": "c", "source": src}),
    );
    assert_eq!(err, None);
    assert_eq!(keys[0], "product:1:v3@1796205600000001");
    let (keys, _) = run(
        &mut p,
        json!({"before": {"id": 1, "sku": "A", "tenant_id": null, "updated_at": 5}, "after": null, "op": "d", "source": src}),
    );
    assert_eq!(keys[0], format!("product:1:v3@{DELETED_VERSION}"));
    let (keys, err) = run(
        &mut p,
        json!({"after": {"id": 1, "sku": "A", "tenant_id": null, "updated_at": {"x": 1}}, "op": "c", "source": src}),
    );
    assert!(err.unwrap().contains("neither an integer nor a timestamp"));
    assert_eq!(
        keys,
        vec!["product:1:v3", "product:sku:A:v3", "list:1"],
        "without a version the keys are still invalidated, plainly"
    );
}

#[test]
fn reads_only_its_tables_and_names_the_old_columns_it_needs() {
    let p = projection(None);
    let products = TableId::new("public", "products");
    assert!(p.reads(&products));
    assert!(!p.reads(&TableId::new("public", "orders")));
    assert_eq!(
        p.before_image_columns(&products),
        vec!["id", "sku", "tenant_id"]
    );
    assert!(
        p.before_image_columns(&TableId::new("public", "orders"))
            .is_empty()
    );
}
