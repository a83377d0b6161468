//! The showcase migration (`orders` -> `orders_v2`) both ways, the traps of `verify`'s
//! canonical values, and the switch of direction at the cut-over.

use refract_schemas::config::{
    ColumnShape, MigrationFile, MigrationProjectionConfig, TableShape, parse_file,
};
use serde_json::json;

use super::value::{ColumnType, canonical, char_limit, shift_decimal};
use super::*;
use crate::test_support::event;

const FILE: &str = r#"
[migration]
name = "orders_v2"
url = "postgres://localhost/db"
source = "orders"
target = "orders_v2"

[columns.region]
[columns.order_id]
[columns.status]
[columns.created_at]
[columns.user_id]
transform = "extract"
pattern = '^U(\d+)$'
reverse = "U{}"
[columns.total_cents]
from = "total_amount"
transform = "scale"
factor = 100
"#;

fn shape(table: &str, key: &[&str], columns: &[(&str, &str)]) -> TableShape {
    TableShape {
        table: table.into(),
        key: key.iter().map(|k| k.to_string()).collect(),
        columns: columns
            .iter()
            .map(|(n, t)| ColumnShape {
                name: n.to_string(),
                type_name: t.to_string(),
                not_null: true,
            })
            .collect(),
    }
}

fn config() -> MigrationProjectionConfig {
    let file: MigrationFile = parse_file("m.toml", FILE, &|_| None, |f: &mut MigrationFile| {
        f.validate()
    })
    .unwrap()
    .config;
    MigrationProjectionConfig {
        migration: file,
        source_shape: shape(
            "orders",
            &["order_id"],
            &[
                ("order_id", "text"),
                ("user_id", "text"),
                ("region", "text"),
                ("status", "text"),
                ("total_amount", "numeric(12,2)"),
                ("created_at", "timestamp with time zone"),
            ],
        ),
        target_shape: shape(
            "orders_v2",
            &["region", "user_id", "order_id"],
            &[
                ("region", "text"),
                ("user_id", "bigint"),
                ("order_id", "text"),
                ("status", "text"),
                ("total_cents", "bigint"),
                ("created_at", "timestamp with time zone"),
            ],
        ),
        sinks: vec!["target".into()],
    }
}

fn order(id: &str, user: &str, amount: &str) -> serde_json::Value {
    json!({"order_id": id, "user_id": user, "region": "EU", "status": "paid",
           "total_amount": amount, "created_at": "2024-01-02T03:04:05Z"})
}

fn project(p: &mut MigrationProjection, line: serde_json::Value) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut e = event(line.clone());
    e.position.offset = Offset(line["source"]["lsn"].as_u64().unwrap(), 0);
    p.project(&e, 0, &mut out).map_err(|e| e.to_string())?;
    Ok(out
        .iter()
        .map(|op| match op {
            WriteOp::Migrate(m) => match &m.action {
                MigrationAction::Upsert { table, row, .. } => {
                    format!("U {table} {}", serde_json::to_string(row).unwrap())
                }
                MigrationAction::Delete { table, key } => {
                    format!("D {table} {}", serde_json::to_string(key).unwrap())
                }
                MigrationAction::Switch { read_from } => format!("S {read_from}"),
            },
            other => panic!("{other:?}"),
        })
        .collect())
}

fn envelope(
    table: &str,
    op: &str,
    before: serde_json::Value,
    after: serde_json::Value,
    lsn: u64,
) -> serde_json::Value {
    json!({"op": op, "before": before, "after": after,
           "source": {"schema": "public", "table": table, "lsn": lsn}})
}

#[test]
fn the_showcase_transform_goes_both_ways() {
    let c = config();
    let t = Transform::new(&c.migration, &c.source_shape, &c.target_shape).unwrap();
    let row: Row = serde_json::from_value(order("ORD-1", "U123", "12.34")).unwrap();
    let v2 = t.forward(&row).unwrap();
    assert_eq!(v2.get("user_id"), Some(&json!(123)));
    assert_eq!(v2.get("total_cents"), Some(&json!(1234)));
    assert_eq!(v2.get("order_id"), Some(&json!("ORD-1")));
    let back = t.reverse(&v2).unwrap();
    assert_eq!(back.get("user_id"), Some(&json!("U123")));
    assert_eq!(back.get("total_amount"), Some(&json!("12.34")));
    assert_eq!(&**t.identity(), ["order_id".to_string()]);
}

#[test]
fn values_the_transform_cannot_convert_are_refused_with_the_column() {
    let c = config();
    let t = Transform::new(&c.migration, &c.source_shape, &c.target_shape).unwrap();
    for (user, amount, column) in [
        ("X9", "1.00", "user_id"),
        ("U99999999999999999999", "1.00", "user_id"),
        ("U1", "1.005", "total_amount"),
    ] {
        let row: Row = serde_json::from_value(order("ORD-1", user, amount)).unwrap();
        let err = t.forward(&row).unwrap_err();
        assert_eq!(err.column, column, "{user} {amount}: {err}");
    }
}

/// Text longer than a `character varying(n)` or `character(n)` column is refused, both ways:
/// PostgreSQL would cut it where it is cast, and refuse it where it is assigned. Characters
/// are counted, not bytes.
#[test]
fn text_longer_than_its_column_is_refused_not_cut() {
    let mut c = config();
    let narrow = |shape: &mut TableShape, name: &str, type_name: &str| {
        let column = shape.columns.iter_mut().find(|c| c.name == name).unwrap();
        column.type_name = type_name.into();
    };
    narrow(&mut c.target_shape, "status", "character varying(6)");
    narrow(&mut c.source_shape, "region", "character(2)");
    let t = Transform::new(&c.migration, &c.source_shape, &c.target_shape).unwrap();
    let row = |status: &str, region: &str| -> Row {
        let mut value = order("ORD-1", "U1", "1.00");
        value["status"] = json!(status);
        value["region"] = json!(region);
        serde_json::from_value(value).unwrap()
    };
    // Six characters of two bytes each fit; a seventh does not.
    let v2 = t.forward(&row("éééééé", "eu")).unwrap();
    assert_eq!(v2.get("status"), Some(&json!("éééééé")));
    let err = t.forward(&row("shipped", "eu")).unwrap_err();
    assert_eq!(err.column, "status", "{err}");
    assert!(
        err.reason
            .contains("`shipped` is longer than 6 characters: it would be cut (into `status`)"),
        "{err}"
    );
    // The reverse is held to the source's `character(2)`.
    let mut back = v2.clone();
    back.insert("region".into(), json!("eu-west"));
    let err = t.reverse(&back).unwrap_err();
    assert_eq!(err.column, "region", "{err}");
    assert!(err.reason.contains("longer than 2 characters"), "{err}");
    assert_eq!(char_limit("character varying(20)[]"), None);
    assert_eq!(char_limit("character varying"), None);
    assert_eq!(char_limit("character(1)"), Some(1));
}

#[test]
fn a_file_that_does_not_fit_the_tables_names_each_problem() {
    let mut c = config();
    c.migration.columns.remove("status");
    c.migration.columns.get_mut("region").unwrap().from = Some("zone".into());
    let problems = Transform::new(&c.migration, &c.source_shape, &c.target_shape).unwrap_err();
    let text = format!("{problems:?}");
    assert!(text.contains("no transform for column `status`"), "{text}");
    assert!(text.contains("columns.region.from"), "{text}");
}

#[test]
fn changes_go_forward_until_the_switch_and_back_after_it() {
    let mut p = MigrationProjection::new(&config());
    let insert = envelope("orders", "c", json!(null), order("ORD-1", "U7", "1.50"), 10);
    assert_eq!(
        project(&mut p, insert).unwrap(),
        [
            r#"U orders_v2 {"created_at":"2024-01-02T03:04:05Z","order_id":"ORD-1","region":"EU","status":"paid","total_cents":150,"user_id":7}"#
        ]
    );
    // The echo of the dual write is ignored.
    let echo = envelope(
        "orders_v2",
        "c",
        json!(null),
        json!({"order_id": "ORD-1", "user_id": 7, "region": "EU", "status": "paid", "total_cents": 150, "created_at": "2024-01-02T03:04:05Z"}),
        11,
    );
    assert!(project(&mut p, echo.clone()).unwrap().is_empty());
    // Another migration's row, and our row without a request, change nothing.
    let other = envelope(
        "refract_migrations",
        "u",
        json!(null),
        json!({"name": "other", "requested_read_from": "orders_v2"}),
        12,
    );
    assert!(project(&mut p, other).unwrap().is_empty());
    let cutover = envelope(
        "refract_migrations",
        "u",
        json!(null),
        json!({"name": "orders_v2", "requested_read_from": "orders_v2"}),
        20,
    );
    assert_eq!(project(&mut p, cutover.clone()).unwrap(), ["S orders_v2"]);
    // Asked again: nothing more.
    let again = envelope(
        "refract_migrations",
        "u",
        json!(null),
        json!({"name": "orders_v2", "requested_read_from": "orders_v2"}),
        21,
    );
    assert!(project(&mut p, again).unwrap().is_empty());
    // After the switch: orders is ignored, orders_v2 goes back through the reverse.
    let late = envelope("orders", "u", json!(null), order("ORD-1", "U7", "9.99"), 30);
    assert!(project(&mut p, late).unwrap().is_empty());
    let v2_update = envelope(
        "orders_v2",
        "u",
        json!(null),
        json!({"order_id": "ORD-1", "user_id": 7, "region": "US", "status": "shipped", "total_cents": 151, "created_at": "2024-01-02T03:04:05Z"}),
        31,
    );
    assert_eq!(
        project(&mut p, v2_update).unwrap(),
        [
            r#"U orders {"created_at":"2024-01-02T03:04:05Z","order_id":"ORD-1","region":"US","status":"shipped","total_amount":"1.51","user_id":"U7"}"#
        ]
    );
    let v2_delete = envelope(
        "orders_v2",
        "d",
        json!({"region": "US", "user_id": 7, "order_id": "ORD-1"}),
        json!(null),
        32,
    );
    assert_eq!(
        project(&mut p, v2_delete).unwrap(),
        [r#"D orders {"order_id":"ORD-1"}"#]
    );

    // A replay after a crash (state restored, events from before the switch again) projects
    // each change in the direction of its own position.
    let state = p.take_state().expect("the switch is state");
    let mut replayed = MigrationProjection::new(&config());
    replayed.restore_state(&state).unwrap();
    assert!(project(&mut replayed, echo).unwrap().is_empty());
    assert_eq!(project(&mut replayed, cutover).unwrap(), ["S orders_v2"]);
    let rollback = envelope(
        "refract_migrations",
        "u",
        json!(null),
        json!({"name": "orders_v2", "requested_read_from": "orders"}),
        40,
    );
    assert_eq!(project(&mut replayed, rollback).unwrap(), ["S orders"]);
    let forward_again = envelope("orders", "d", json!({"order_id": "ORD-1"}), json!(null), 41);
    assert_eq!(
        project(&mut replayed, forward_again).unwrap(),
        [r#"D orders_v2 {"order_id":"ORD-1"}"#]
    );
}

#[test]
fn a_changed_source_key_deletes_the_old_target_row() {
    let mut p = MigrationProjection::new(&config());
    let update = envelope(
        "orders",
        "u",
        json!({"order_id": "ORD-1"}),
        order("ORD-2", "U7", "1.00"),
        10,
    );
    let out = project(&mut p, update).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(out[0], r#"D orders_v2 {"order_id":"ORD-1"}"#);
}

#[test]
fn an_unconvertible_change_is_reported_with_its_key_and_writes_nothing() {
    let mut p = MigrationProjection::new(&config());
    let bad = envelope(
        "orders",
        "c",
        json!(null),
        order("ORD-9", "guest", "1.00"),
        10,
    );
    let err = project(&mut p, bad).unwrap_err();
    assert!(
        err.contains("order_id=\"ORD-9\"") && err.contains("user_id"),
        "{err}"
    );
}

#[test]
fn equal_values_written_differently_have_one_canonical_text() {
    let numeric = ColumnType::Numeric { scale: None };
    assert_eq!(
        canonical(&json!("1.0"), numeric),
        canonical(&json!("1"), numeric)
    );
    assert_eq!(
        canonical(&json!("-0.00"), numeric),
        canonical(&json!(0), numeric)
    );
    assert_ne!(
        canonical(&json!("1.01"), numeric),
        canonical(&json!("1.1"), numeric)
    );
    let ts = ColumnType::Timestamptz;
    assert_eq!(
        canonical(&json!("2024-01-01T12:00:00+02:00"), ts),
        canonical(&json!("2024-01-01T10:00:00Z"), ts)
    );
    assert_eq!(
        canonical(&json!("2024-01-01 12:00:00+02"), ts),
        canonical(&json!("2024-01-01T10:00:00.000000Z"), ts)
    );
    assert_ne!(
        canonical(&json!("2024-01-01T12:00:00+02:00"), ts),
        canonical(&json!("2024-01-01T12:00:00Z"), ts)
    );
    let j = ColumnType::Json;
    assert_eq!(
        canonical(&json!({"b": [1.0, {"y": 1, "x": 2}], "a": null}), j),
        canonical(&json!({"a": null, "b": [1, {"x": 2, "y": 1}]}), j)
    );
    assert_ne!(
        canonical(&json!({"a": 1}), j),
        canonical(&json!({"a": "1"}), j)
    );
    assert_ne!(
        canonical(&json!(null), ColumnType::Text),
        canonical(&json!("\\N "), ColumnType::Text)
    );
}

#[test]
fn decimals_shift_exactly() {
    for (text, digits, want) in [
        ("12.34", 2, "1234"),
        ("12.345", 2, "1234.5"),
        ("-0.01", 2, "-1"),
        ("1234", -2, "12.34"),
        ("5", -3, "0.005"),
        ("0.00", 2, "0"),
    ] {
        assert_eq!(
            shift_decimal(text, digits).unwrap(),
            want,
            "{text} {digits}"
        );
    }
    assert!(shift_decimal("1e5", 2).is_err());
}
