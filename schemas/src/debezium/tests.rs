use serde_json::json;

use super::*;

fn pos(n: u64) -> Position {
    Position {
        partition: "test".into(),
        offset: crate::event::Offset(n, 0),
    }
}

fn decode(line: &str) -> Result<Record, DecodeError> {
    DebeziumDecoder::new().decode(line.as_bytes(), pos(7))
}

fn change(line: &str) -> ChangeEvent {
    match decode(line).unwrap() {
        Record::Change(e) => e,
        other => panic!("expected a change, got {other:?}"),
    }
}

#[test]
fn bare_envelope() {
    let e = change(
        r#"{"before":null,"after":{"id":"a1","first_name":"Thomas"},"op":"c",
            "source":{"connector":"postgresql","db":"shop","schema":"public","table":"authors",
                      "lsn":24023128,"txId":555,"ts_ms":1700000000000},
            "transaction":{"id":"555:24023128","total_order":1,"data_collection_order":1},"ts_ms":1700000000001}"#,
    );
    assert_eq!(e.op, Op::Create);
    assert_eq!(e.table, TableId::new("public", "authors"));
    assert_eq!(e.after.as_deref().unwrap()["first_name"], "Thomas");
    assert_eq!(e.source.lsn, Some(24023128));
    assert_eq!(e.source.tx_id, Some(555));
    assert_eq!(e.source.ts_ms, Some(1700000000000));
    assert_eq!(e.transaction.as_ref().unwrap().total_order, Some(1));
    assert_eq!(e.position, pos(7));
}

#[test]
fn wrapped_envelope_converts_logical_types() {
    let line = json!({
        "schema": {"type": "struct", "fields": [
            {"field": "before", "type": "struct", "optional": true, "fields": []},
            {"field": "after", "type": "struct", "optional": true, "fields": [
                {"field": "id", "type": "string"},
                {"field": "total_amount", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
                 "parameters": {"scale": "2", "connect.decimal.precision": "12"}},
                {"field": "created_at", "type": "int64", "name": "io.debezium.time.MicroTimestamp"},
                {"field": "updated_at", "type": "string", "name": "io.debezium.time.ZonedTimestamp"},
                {"field": "day", "type": "int32", "name": "io.debezium.time.Date"},
                {"field": "at_ms", "type": "int64", "name": "io.debezium.time.Timestamp"},
                {"field": "doc", "type": "string", "name": "io.debezium.data.Json"}
            ]}
        ]},
        "payload": {"before": null, "op": "r", "source": {"schema": "public", "table": "orders"},
            "after": {"id": "o1", "total_amount": "MDk=", "created_at": 1_700_000_000_123_456i64,
                      "updated_at": "2026-09-22T10:31:00Z", "day": 19000, "at_ms": 1_700_000_000_123i64,
                      "doc": "{\"a\":[1,2]}"}}
    });
    let e = change(&line.to_string());
    let after = e.after.as_deref().unwrap();
    assert_eq!(after["total_amount"], "123.45");
    assert_eq!(after["created_at"], "2023-11-14T22:13:20.123456");
    assert_eq!(after["updated_at"], "2026-09-22T10:31:00Z");
    assert_eq!(after["day"], "2022-01-08");
    assert_eq!(after["at_ms"], "2023-11-14T22:13:20.123000");
    assert_eq!(after["doc"], json!({"a": [1, 2]}));
    assert_eq!(e.op, Op::Read);
}

#[test]
fn key_value_records_and_tombstones() {
    let e = change(
        r#"{"key":{"id":42},"value":{"before":{"id":42},"after":null,"op":"d","source":{"schema":"public","table":"products"}}}"#,
    );
    assert_eq!(e.key.as_deref().unwrap()["id"], 42);
    assert_eq!(e.op, Op::Delete);
    assert_eq!(
        decode(r#"{"key":{"id":42},"value":null}"#).unwrap(),
        Record::Tombstone(pos(7))
    );
}

#[test]
fn transaction_markers() {
    let begin = decode(
        r#"{"status":"BEGIN","id":"571","event_count":null,"data_collections":null,"ts_ms":1}"#,
    )
    .unwrap();
    let Record::Transaction(b) = begin else {
        panic!()
    };
    assert_eq!((b.status, b.id.as_str()), (TxStatus::Begin, "571"));
    let end =
        decode(r#"{"status":"END","id":"571","event_count":2,"data_collections":[]}"#).unwrap();
    let Record::Transaction(e) = end else {
        panic!()
    };
    assert_eq!((e.status, e.event_count), (TxStatus::End, Some(2)));
}

#[test]
fn bad_input_names_position_and_reason() {
    let cases = [
        (
            "truncated",
            r#"{"before":null,"after":{"id":1},"op":"c","sour"#,
            "truncated JSON",
        ),
        ("not json", "hello world", "invalid JSON"),
        (
            "unknown op",
            r#"{"after":{"id":1},"op":"x","source":{"table":"t"}}"#,
            "unknown op `x`",
        ),
        (
            "no source",
            r#"{"after":{"id":1},"op":"c"}"#,
            "missing `source` block",
        ),
        (
            "no table",
            r#"{"after":{"id":1},"op":"c","source":{}}"#,
            "missing `source.table`",
        ),
        (
            "create without after",
            r#"{"before":null,"after":null,"op":"c","source":{"table":"t"}}"#,
            "without an `after`",
        ),
        ("neither", r#"{"hello":1}"#, "missing `op`"),
        ("array", "[1,2]", "unexpected record shape"),
        (
            "bad scale",
            r#"{"schema":{"type":"struct","fields":[{"field":"after","type":"struct","fields":[{"field":"p","type":"bytes","name":"org.apache.kafka.connect.data.Decimal","parameters":{"scale":"two"}}]}]},"payload":{"after":{"p":"MDk="},"op":"c","source":{"table":"t"}}}"#,
            "Decimal scale \"two\"",
        ),
        (
            "bad base64",
            r#"{"schema":{"type":"struct","fields":[{"field":"after","type":"struct","fields":[{"field":"p","type":"bytes","name":"org.apache.kafka.connect.data.Decimal","parameters":{"scale":"2"}}]}]},"payload":{"after":{"p":"!!"},"op":"c","source":{"table":"t"}}}"#,
            "not base64",
        ),
    ];
    for (name, line, want) in cases {
        let err = decode(line).expect_err(name);
        assert_eq!(err.position, pos(7), "{name}");
        assert!(err.reason.contains(want), "{name}: {}", err.reason);
    }
}

#[test]
fn schema_cache_serves_repeated_schemas() {
    let mut d = DebeziumDecoder::new();
    let line = |amount: &str| {
        format!(
            r#"{{"schema":{{"type":"struct","fields":[{{"field":"after","type":"struct","fields":[{{"field":"p","type":"bytes","name":"org.apache.kafka.connect.data.Decimal","parameters":{{"scale":"1"}}}}]}}]}},"payload":{{"after":{{"p":"{amount}"}},"op":"c","source":{{"table":"t"}}}}}}"#
        )
    };
    for (b64, want) in [("MDk=", "1234.5"), ("AQ==", "0.1")] {
        let Record::Change(e) = d.decode(line(b64).as_bytes(), pos(1)).unwrap() else {
            panic!()
        };
        assert_eq!(e.after.as_deref().unwrap()["p"], want);
    }
    assert_eq!(d.schemas.len(), 1);
}

proptest::proptest! {
    /// One decoder reads envelopes one after another (simd-json's tape and scratch buffer are
    /// reused, strings unescaped in place): each after image holds exactly the text written,
    /// whatever it escapes and however long it is next to the record before.
    #[test]
    fn envelopes_read_in_turn_keep_every_string_as_written(
        names in proptest::collection::vec(proptest::prelude::any::<String>(), 1..12),
        pad in proptest::collection::vec("[a-z\"\\\\\n\u{e9}]{0,80}", 1..12),
    ) {
        let mut decoder = DebeziumDecoder::new();
        for (i, name) in names.iter().enumerate() {
            let note = &pad[i % pad.len()];
            let line = json!({
                "before": null,
                "after": {"id": i, "name": name, "note": note},
                "op": "c",
                "source": {"schema": "public", "table": "t\"ab\\le"},
            })
            .to_string();
            let Ok(Record::Change(e)) = decoder.decode(line.as_bytes(), pos(i as u64)) else {
                panic!("not decoded: {line}");
            };
            let after = e.after.as_deref().expect("an after image");
            proptest::prop_assert_eq!(&after["name"], &json!(name));
            proptest::prop_assert_eq!(&after["note"], &json!(note));
            proptest::prop_assert_eq!(&after["id"], &json!(i));
            proptest::prop_assert_eq!(&*e.table.name, "t\"ab\\le");
        }
    }
}
