//! Encoding round trips: what [`super::encode_value`] and [`super::encode_key`] write, the
//! decoder reads back as the same event.

use std::sync::Arc;

use serde_json::{Value, json};

use super::*;
use crate::debezium::DebeziumDecoder;
use crate::event::{KafkaCoordinates, Offset, Position, Record, SourceInfo, TableId};

fn row(v: Value) -> Arc<Row> {
    Arc::new(serde_json::from_value(v).unwrap())
}

fn position() -> Position {
    Position {
        partition: "slot".into(),
        offset: Offset(42, 3),
    }
}

fn event(op: Op, before: Option<Value>, after: Option<Value>) -> ChangeEvent {
    ChangeEvent {
        table: TableId::new("public", "authors"),
        op,
        key: None,
        key_columns: Some(Arc::from(vec!["id".to_owned()])),
        before: before.map(row),
        after: after.map(row),
        source: SourceInfo {
            connector: Some("postgresql".into()),
            db: Some("shop".into()),
            ts_ms: Some(1_700_000_000_000),
            tx_id: Some(555),
            lsn: Some(24_023_128),
            kafka: None,
        },
        transaction: Some(TxInfo {
            id: "555:24023128".into(),
            total_order: Some(2),
            data_collection_order: Some(1),
        }),
        position: position(),
    }
}

/// Encodes `e` as a `{"key":…,"value":…}` record and decodes it.
fn round_trip(e: &ChangeEvent) -> ChangeEvent {
    let mut value = Vec::new();
    encode_value(e, 1_700_000_000_500, &mut value);
    let key: Value = match encode_key(e) {
        Some(k) => serde_json::from_slice(&k.unwrap()).unwrap(),
        None => Value::Null,
    };
    let value: Value = serde_json::from_slice(&value).unwrap();
    let record = json!({"key": key, "value": value}).to_string();
    match DebeziumDecoder::new().decode(record.as_bytes(), position()) {
        Ok(Record::Change(e)) => e,
        other => panic!("{other:?}"),
    }
}

/// `e` as the decoder gives it back: the key as an image of its own.
fn expected(e: &ChangeEvent) -> ChangeEvent {
    let mut e = e.clone();
    e.key = match key_row(&e) {
        Some(Ok(k)) if e.op != Op::Truncate => Some(Arc::new(k)),
        _ => None,
    };
    e.key_columns = None;
    e
}

#[test]
fn every_op_round_trips() {
    let a1 = json!({"id": 1, "name": "Ann", "tags": ["x"], "price": "1.50"});
    let a2 = json!({"id": 1, "name": "Bob", "tags": null, "price": "2.00"});
    let cases: Vec<(&str, ChangeEvent)> = vec![
        ("create", event(Op::Create, None, Some(a1.clone()))),
        ("read", event(Op::Read, None, Some(a1.clone()))),
        (
            "update",
            event(Op::Update, Some(a1.clone()), Some(a2.clone())),
        ),
        ("update without before", event(Op::Update, None, Some(a2))),
        ("delete", event(Op::Delete, Some(json!({"id": 1})), None)),
        ("truncate", event(Op::Truncate, None, None)),
        ("no transaction", {
            let mut e = event(Op::Create, None, Some(a1.clone()));
            e.transaction = None;
            e
        }),
        ("record key", {
            let mut e = event(Op::Create, None, Some(a1.clone()));
            e.key = Some(row(json!({"isbn": "x-1"})));
            e.key_columns = None;
            e
        }),
        ("composite key", {
            let mut e = event(Op::Create, None, Some(json!({"a": 1, "b": "z", "n": 0})));
            e.key_columns = Some(Arc::from(vec!["a".to_owned(), "b".to_owned()]));
            e
        }),
        ("read from kafka, sparse source", {
            let mut e = event(Op::Create, None, Some(a1.clone()));
            e.source = SourceInfo {
                kafka: Some(KafkaCoordinates {
                    topic: "t".into(),
                    partition: 3,
                    offset: 99,
                }),
                ts_ms: Some(5),
                ..SourceInfo::default()
            };
            e
        }),
        ("keyless table", {
            let mut e = event(Op::Create, None, Some(a1));
            e.key_columns = None;
            e
        }),
    ];
    for (name, e) in cases {
        assert_eq!(round_trip(&e), expected(&e), "{name}");
    }
}

#[test]
fn the_envelope_has_debeziums_layout() {
    let mut out = Vec::new();
    let e = event(Op::Delete, Some(json!({"id": 7})), None);
    encode_value(&e, 9, &mut out);
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v,
        json!({
            "before": {"id": 7}, "after": null, "op": "d", "ts_ms": 9,
            "source": {"connector": "postgresql", "db": "shop", "schema": "public",
                       "table": "authors", "txId": 555, "lsn": 24023128,
                       "ts_ms": 1700000000000i64},
            "transaction": {"id": "555:24023128", "total_order": 2, "data_collection_order": 1}
        })
    );
    assert_eq!(encode_key(&e).unwrap().unwrap(), br#"{"id":7}"#);
}

#[test]
fn a_key_column_missing_or_null_is_named() {
    let e = event(Op::Create, None, Some(json!({"id": null})));
    assert_eq!(encode_key(&e), Some(Err("id".to_owned())));
    let e = event(Op::Delete, Some(json!({"name": "x"})), None);
    assert_eq!(encode_key(&e), Some(Err("id".to_owned())));
    assert_eq!(encode_key(&event(Op::Truncate, None, None)), None);
}
