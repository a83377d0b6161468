//! Table-driven tests of the flatten projection, on the shipped orders-analytics pipeline.

use refract_schemas::config::{FlattenProjectionConfig, ProjectionConfig, load_str};
use serde_json::{Value, json};

use super::*;
use crate::RowChange;
use crate::test_support::event;

/// The projection of the shipped `pipelines/orders-analytics.toml`.
fn shipped() -> FlattenProjectionConfig {
    let text = include_str!("../../../pipelines/orders-analytics.toml");
    let pwd = |v: &str| (v == "PWD").then(|| "/tmp".to_owned());
    let loaded =
        load_str("orders-analytics.toml", text, &pwd, None).expect("the shipped file loads");
    match &loaded.config.projections["orders_flat"] {
        ProjectionConfig::Flatten(f) => f.clone(),
        other => panic!("{other:?}"),
    }
}

fn doc(items: usize, extra: Value) -> Value {
    let mut doc = json!({
        "status": "paid", "created_at": "2026-09-22T10:31:00Z", "total_cents": 12900,
        "customer": {"id": "c42", "name": "Thomas Andersen",
                     "contactDetails": [{"email": "thomas@andersen.com"}, {"phone": "+1 555 555-5555", "extension": 5555}],
                     "billingAddress": {"city": "Seattle", "state": "WA"}},
        "shipping": {"method": "ground", "status": "pending", "address": {"city": "Portland", "zip": "97201"}},
        "items": (0..items).map(|i| json!({"sku": format!("sku-{i}"), "qty": i + 1, "unit_price_cents": 4500})).collect::<Vec<_>>(),
    });
    if let (Value::Object(d), Value::Object(e)) = (&mut doc, extra) {
        d.extend(e);
    }
    doc
}

fn envelope(op: &str, before: Option<Value>, after: Option<Value>) -> Value {
    json!({"before": before, "after": after, "op": op,
           "source": {"schema": "public", "table": "customer_orders", "ts_ms": 1_790_000_000_000u64}})
}

fn row(id: &str, doc: Value) -> Value {
    json!({"id": id, "doc": doc, "updated_at": "2026-09-22T10:31:00Z"})
}

/// `table op key-or-values` lines for each operation, and the error if any.
fn run(p: &mut FlattenProjection, line: Value) -> (Vec<String>, Option<String>) {
    let mut out = Vec::new();
    let result = p.project(&event(line), 0, &mut out);
    let lines = out
        .iter()
        .map(|op| match op {
            WriteOp::Row(RowChange { change, .. }) => {
                let cells: Vec<String> = change
                    .schema
                    .columns
                    .iter()
                    .zip(&change.values)
                    .filter(|(_, v)| **v != FlatValue::Null)
                    .map(|(c, v)| match v {
                        FlatValue::Str(s) => format!("{}={s}", c.name),
                        FlatValue::Int(i) => format!("{}={i}", c.name),
                        FlatValue::Micros(us) => format!("{}=@{us}", c.name),
                        other => format!("{}={other:?}", c.name),
                    })
                    .collect();
                format!(
                    "{} {} {}",
                    change.schema.table,
                    change.op.code(),
                    cells.join(" ")
                )
            }
            other => panic!("only flat rows, got {other:?}"),
        })
        .collect();
    (lines, result.err().map(|e| e.to_string()))
}

/// Rows of `table` in the output lines.
fn of<'a>(lines: &'a [String], table: &str) -> Vec<&'a str> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix(table).and_then(|r| r.strip_prefix(' ')))
        .collect()
}

#[test]
fn each_change_becomes_the_rows_it_implies() {
    let t = "2026-09-22T10:31:00Z";
    let us = 1_790_073_060_000_000i64;
    let cases: Vec<(&str, Value, Vec<(&str, Vec<String>)>)> = vec![
        (
            "create: an order, its customer, its items",
            envelope("c", None, Some(row("o1", doc(2, json!({}))))),
            vec![
                ("orders", vec![format!(
                    "u order_id=o1 customer_id=c42 status=paid total_cents=12900 created_at=@{us} shipping_method=ground \
                     shipping_status=pending shipping_city=Portland item_count=2 updated_at=@{us} shipping_address_zip=97201"
                )]),
                ("customers", vec![
                    "u customer_id=c42 name=Thomas Andersen email=thomas@andersen.com phone=+1 555 555-5555 billing_city=Seattle billing_state=WA".into(),
                ]),
                ("order_items", vec![
                    "u order_id=o1 line_no=1 sku=sku-0 qty=1 unit_price_cents=4500".into(),
                    "u order_id=o1 line_no=2 sku=sku-1 qty=2 unit_price_cents=4500".into(),
                ]),
            ],
        ),
        (
            "update to fewer items: the group's new rows only",
            envelope("u", None, Some(row("o1", doc(1, json!({}))))),
            vec![("order_items", vec!["u order_id=o1 line_no=1 sku=sku-0 qty=1 unit_price_cents=4500".into()])],
        ),
        (
            "update to no items: the group is emptied",
            envelope("u", None, Some(row("o1", doc(0, json!({}))))),
            vec![("order_items", vec!["d order_id=o1".into()])],
        ),
        (
            "delete with the key only (replica identity default): orders and items go, the customer stays",
            envelope("d", Some(json!({"id": "o1"})), None),
            vec![("orders", vec!["d order_id=o1".into()]), ("customers", vec![]), ("order_items", vec!["d order_id=o1".into()])],
        ),
        (
            "a key change deletes the old key first",
            envelope("u", Some(json!({"id": "o1"})), Some(row("o9", doc(1, json!({}))))),
            vec![("order_items", vec!["d order_id=o1".into(), "u order_id=o9 line_no=1 sku=sku-0 qty=1 unit_price_cents=4500".into()])],
        ),
        (
            "truncate: every table the source deletes from",
            envelope("t", None, None),
            vec![("orders", vec!["t ".into()]), ("customers", vec![]), ("order_items", vec!["t ".into()])],
        ),
        (
            "a document held as a JSON string (Debezium's io.debezium.data.Json) is read the same",
            envelope("r", None, Some(json!({"id": "o2", "doc": doc(1, json!({})).to_string(), "updated_at": t}))),
            vec![("order_items", vec!["u order_id=o2 line_no=1 sku=sku-0 qty=1 unit_price_cents=4500".into()])],
        ),
        (
            "an explicit cast: a numeric string into an int64 column",
            envelope("c", None, Some(row("o3", doc(0, json!({"total_cents": "77"}))))),
            vec![("order_items", vec!["d order_id=o3".into()])],
        ),
    ];
    let mut p = FlattenProjection::new(&shipped());
    for (name, line, expected) in cases {
        let (lines, error) = run(&mut p, line);
        assert_eq!(error, None, "{name}");
        for (table, rows) in expected {
            let got = of(&lines, table);
            assert_eq!(got, rows, "{name}: table {table}\n{lines:#?}");
        }
    }
    let (lines, _) = run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row("o3", doc(0, json!({"total_cents": "77"})))),
        ),
    );
    assert!(
        of(&lines, "orders")[0].contains("total_cents=77"),
        "{lines:?}"
    );
}

#[test]
fn schema_drift_adds_columns_and_type_conflicts_fail_the_whole_event() {
    let mut p = FlattenProjection::new(&shipped());
    let orders = |p: &FlattenProjection| p.schemas()[0].clone();
    run(
        &mut p,
        envelope("c", None, Some(row("o1", doc(1, json!({"priority": 1}))))),
    );
    let v1 = orders(&p);
    assert!(
        v1.columns
            .iter()
            .any(|c| c.name == "priority" && c.ty == FlatType::Int64)
    );

    // A new field: a new column, a new version.
    let (lines, error) = run(
        &mut p,
        envelope("c", None, Some(row("o2", doc(1, json!({"coupon": "X"}))))),
    );
    assert_eq!(error, None);
    let v2 = orders(&p);
    assert_eq!(v2.version, v1.version + 1);
    assert_eq!(v2.columns.last().unwrap().name, "coupon");
    assert!(of(&lines, "orders")[0].ends_with("coupon=X"), "{lines:?}");

    // A number that became an object: nothing of the event is written, nothing learned.
    let (lines, error) = run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row(
                "o3",
                doc(1, json!({"priority": {"level": "high"}, "other": 1})),
            )),
        ),
    );
    assert_eq!(lines, Vec::<String>::new());
    let error = error.expect("a type conflict");
    assert!(
        error.contains("type conflict") && error.contains("priority"),
        "{error}"
    );
    assert_eq!(orders(&p), v2, "the failed event taught nothing");

    // A field that was an object and became a number: nothing emitted, nothing learned.
    let (lines, error) = run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row("o4", doc(1, json!({"shipping": {"address": 5}})))),
        ),
    );
    assert!(error.expect("a type conflict").contains("shipping.address"));
    assert_eq!(lines, Vec::<String>::new());
    assert_eq!(orders(&p), v2);

    // A declared type that a value cannot take.
    let (_, error) = run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row("o5", doc(1, json!({"created_at": "yesterday"})))),
        ),
    );
    assert!(error.expect("a cast error").contains("created_at"));

    // A missing key.
    let (_, error) = run(
        &mut p,
        envelope("c", None, Some(json!({"doc": doc(1, json!({}))}))),
    );
    assert!(error.expect("no key").contains("order_id"));
}

#[test]
fn the_column_ceiling_is_a_clear_error() {
    let mut config = shipped();
    config.max_columns = 12;
    let mut p = FlattenProjection::new(&config);
    let (_, error) = run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row("o1", doc(1, json!({"a": 1, "b": 2, "c": 3})))),
        ),
    );
    let error = error.expect("over the ceiling");
    assert!(error.contains("more than max_columns = 12"), "{error}");
}

#[test]
fn learned_schemas_survive_a_restart() {
    let mut p = FlattenProjection::new(&shipped());
    assert_eq!(p.take_state(), None, "nothing learned yet");
    run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row("o1", doc(1, json!({"coupon": "X", "priority": 2})))),
        ),
    );
    let state = p.take_state().expect("learned columns");
    assert_eq!(p.take_state(), None, "handed out once");
    let mut restarted = FlattenProjection::new(&shipped());
    restarted.restore_state(&state).unwrap();
    assert_eq!(restarted.schemas(), p.schemas());
    // After the restart a conflicting value is still a conflict.
    let (_, error) = run(
        &mut restarted,
        envelope(
            "c",
            None,
            Some(row("o2", doc(1, json!({"priority": "high"})))),
        ),
    );
    assert!(error.expect("a conflict").contains("priority"));
    assert!(restarted.restore_state(b"not json").is_err());
}

#[test]
fn unmapped_fields_never_take_a_declared_column_or_share_one() {
    let mut p = FlattenProjection::new(&shipped());
    // A new `doc.order_id` must not overwrite the key: it becomes `doc_order_id`.
    let (lines, error) = run(
        &mut p,
        envelope(
            "c",
            None,
            Some(row("o1", doc(1, json!({"order_id": "other"})))),
        ),
    );
    assert_eq!(error, None);
    let orders = of(&lines, "orders");
    assert!(orders[0].starts_with("u order_id=o1 "), "{orders:?}");
    assert!(orders[0].contains("doc_order_id=other"), "{orders:?}");
    // `x.y` and `x_y` would both be column `x_y`.
    let (_, error) = run(
        &mut p,
        envelope("c", None, Some(row("o2", doc(1, json!({"x": {"y": 1}}))))),
    );
    assert_eq!(error, None);
    let (lines, error) = run(
        &mut p,
        envelope("c", None, Some(row("o3", doc(1, json!({"x_y": 2}))))),
    );
    assert_eq!(lines, Vec::<String>::new());
    let error = error.expect("two fields, one column");
    assert!(
        error.contains("`doc.x.y` and `doc.x_y` both flatten to column `x_y`"),
        "{error}"
    );
}

#[test]
fn an_object_whose_name_a_later_column_takes_is_checked_again() {
    let mut p = FlattenProjection::new(&shipped());
    // The object `doc.m_n` is named `m_n` (its field becomes column `m_n_z`) ...
    let (_, error) = run(
        &mut p,
        envelope("c", None, Some(row("o1", doc(1, json!({"m_n": {"z": 1}}))))),
    );
    assert_eq!(error, None);
    // ... then `doc.m.n` takes column `m_n` ...
    let (_, error) = run(
        &mut p,
        envelope("c", None, Some(row("o2", doc(1, json!({"m": {"n": 5}}))))),
    );
    assert_eq!(error, None);
    // ... so the object, seen again, now conflicts with it (however often it was seen before).
    let (lines, error) = run(
        &mut p,
        envelope("c", None, Some(row("o3", doc(1, json!({"m_n": {"z": 2}}))))),
    );
    assert_eq!(lines, Vec::<String>::new());
    let error = error.expect("the object's name is a column now");
    assert!(
        error.contains("`doc.m.n` and `doc.m_n` both flatten to column `m_n`"),
        "{error}"
    );
}
