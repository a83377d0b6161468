//! The Avro path against the JSON path: one change written by JsonConverter (decoded by
//! [`DebeziumDecoder`]) and by AvroConverter ([`connect_to_avro`] + [`encode_confluent`], decoded
//! by [`AvroDecoder`]) must give equal records.

use base64::Engine as _;
use num_bigint::BigInt;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::debezium::DebeziumDecoder;
use crate::event::Offset;

fn pos() -> Position {
    Position {
        partition: "orders/0".into(),
        offset: Offset(42, 0),
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Kafka Connect's Decimal payload: base64 of the unscaled value's two's-complement bytes.
fn decimal(unscaled: i128) -> Value {
    json!(b64(&BigInt::from(unscaled).to_signed_bytes_be()))
}

fn columns() -> Value {
    json!([
        {"field": "id", "type": "int32", "optional": false},
        {"field": "amount", "type": "bytes", "optional": true, "name": "org.apache.kafka.connect.data.Decimal",
         "version": 1, "parameters": {"scale": "2", "connect.decimal.precision": "12"}},
        {"field": "vsd", "type": "struct", "optional": true, "name": "io.debezium.data.VariableScaleDecimal",
         "version": 1, "fields": [
            {"field": "scale", "type": "int32", "optional": false},
            {"field": "value", "type": "bytes", "optional": false}]},
        {"field": "created_at", "type": "int64", "optional": false, "name": "io.debezium.time.MicroTimestamp", "version": 1},
        {"field": "updated_at", "type": "string", "optional": true, "name": "io.debezium.time.ZonedTimestamp", "version": 1},
        {"field": "day", "type": "int32", "optional": true, "name": "io.debezium.time.Date", "version": 1},
        {"field": "at_ms", "type": "int64", "optional": true, "name": "io.debezium.time.Timestamp", "version": 1},
        {"field": "nano", "type": "int64", "optional": true, "name": "io.debezium.time.NanoTimestamp", "version": 1},
        {"field": "t", "type": "int64", "optional": true, "name": "io.debezium.time.MicroTime", "version": 1},
        {"field": "born", "type": "int32", "optional": true, "name": "org.apache.kafka.connect.data.Date", "version": 1},
        {"field": "seen", "type": "int64", "optional": true, "name": "org.apache.kafka.connect.data.Timestamp", "version": 1},
        {"field": "doc", "type": "string", "optional": true, "name": "io.debezium.data.Json", "version": 1},
        {"field": "note", "type": "string", "optional": true},
        {"field": "flag", "type": "boolean", "optional": true},
        {"field": "ratio", "type": "float64", "optional": true},
        {"field": "score", "type": "float32", "optional": true},
        {"field": "small", "type": "int16", "optional": true},
        {"field": "raw", "type": "bytes", "optional": true},
        {"field": "tags", "type": "array", "optional": true, "items": {"type": "string", "optional": false}}
    ])
}

fn envelope_schema() -> Value {
    let row = |field: &str| {
        json!({"field": field, "type": "struct", "optional": true,
               "name": "dbserver1.public.orders.Value", "fields": columns()})
    };
    json!({"type": "struct", "optional": false, "name": "dbserver1.public.orders.Envelope", "fields": [
        row("before"),
        row("after"),
        {"field": "source", "type": "struct", "optional": false, "name": "io.debezium.connector.postgresql.Source", "fields": [
            {"field": "version", "type": "string", "optional": false},
            {"field": "connector", "type": "string", "optional": false},
            {"field": "name", "type": "string", "optional": false},
            {"field": "ts_ms", "type": "int64", "optional": false},
            {"field": "snapshot", "type": "string", "optional": true, "name": "io.debezium.data.Enum",
             "version": 1, "parameters": {"allowed": "true,last,false,incremental"}},
            {"field": "db", "type": "string", "optional": false},
            {"field": "sequence", "type": "string", "optional": true},
            {"field": "schema", "type": "string", "optional": false},
            {"field": "table", "type": "string", "optional": false},
            {"field": "txId", "type": "int64", "optional": true},
            {"field": "lsn", "type": "int64", "optional": true},
            {"field": "xmin", "type": "int64", "optional": true}]},
        {"field": "op", "type": "string", "optional": false},
        {"field": "ts_ms", "type": "int64", "optional": true},
        {"field": "transaction", "type": "struct", "optional": true, "name": "event.block", "fields": [
            {"field": "id", "type": "string", "optional": false},
            {"field": "total_order", "type": "int64", "optional": false},
            {"field": "data_collection_order", "type": "int64", "optional": false}]}
    ]})
}

fn key_schema() -> Value {
    json!({"type": "struct", "optional": false, "name": "dbserver1.public.orders.Key",
           "fields": [{"field": "id", "type": "int32", "optional": false}]})
}

fn full_row(id: i32) -> Value {
    json!({
        "id": id, "amount": decimal(-123_450), "vsd": {"scale": 3, "value": decimal(-7)},
        "created_at": 1_700_000_000_123_456i64, "updated_at": "2026-09-22T10:31:00.5+02:00",
        "day": -3, "at_ms": 1_700_000_000_123i64, "nano": 1_700_000_000_123_456_789i64,
        "t": 3_600_000_001i64, "born": 19000, "seen": -1, "doc": "{\"a\":[1,2.5,null],\"b\":{\"c\":\"d\"}}",
        "note": "héllo", "flag": true, "ratio": 0.1, "score": 0.1, "small": -7, "raw": b64(&[0, 255, 7]),
        "tags": ["x", "y"]
    })
}

fn null_row(id: i32) -> Value {
    json!({"id": id, "amount": null, "vsd": null, "created_at": -1, "updated_at": null, "day": null,
           "at_ms": null, "nano": null, "t": null, "born": null, "seen": null, "doc": null, "note": null,
           "flag": null, "ratio": null, "score": null, "small": null, "raw": null, "tags": null})
}

fn payload(op: &str, before: Value, after: Value) -> Value {
    json!({
        "before": before, "after": after, "op": op, "ts_ms": 1_700_000_000_999i64,
        "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "dbserver1",
                   "ts_ms": 1_700_000_000_000i64, "snapshot": "false", "db": "shop", "sequence": "[null,\"1\"]",
                   "schema": "public", "table": "orders", "txId": 555, "lsn": 24_023_128, "xmin": null},
        "transaction": {"id": "555:24023128", "total_order": 2, "data_collection_order": 1}
    })
}

/// The record the JSON path gives for `{"key":…,"value":…}` as JsonConverter writes it.
fn via_json(key: Option<&Value>, value: &Value) -> Result<Record, DecodeError> {
    let mut line = json!({"value": {"schema": envelope_schema(), "payload": value}});
    if let Some(k) = key {
        line["key"] = json!({"schema": key_schema(), "payload": k});
    }
    DebeziumDecoder::new().decode(line.to_string().as_bytes(), pos())
}

/// Frames `payload` of Connect schema `schema` as AvroConverter would, with schema id `id`.
fn frame(id: u32, schema: &Value, payload: &Value) -> (Schema, Vec<u8>) {
    let (avro_schema, avro_value) = connect_to_avro(schema, payload).unwrap();
    let bytes = encode_confluent(id, &avro_schema, avro_value).unwrap();
    (avro_schema, bytes)
}

/// The record the Avro path gives for the same key and value.
fn via_avro(decoder: &mut AvroDecoder, key: Option<&Value>, value: &Value) -> Record {
    let (vschema, vbytes) = frame(7, &envelope_schema(), value);
    let key = key.map(|k| frame(8, &key_schema(), k));
    let (vid, vbody) = confluent_frame(&vbytes).unwrap();
    assert_eq!(vid, 7);
    let key = key.as_ref().map(|(s, b)| {
        (
            confluent_frame(b).unwrap().0,
            s,
            confluent_frame(b).unwrap().1,
        )
    });
    decoder
        .decode(
            key,
            Some((vid, &vschema, vbody)),
            || TableId::new("x", "y"),
            pos(),
        )
        .unwrap()
}

#[test]
fn avro_and_json_give_equal_records() {
    let cases = [
        ("create", payload("c", Value::Null, full_row(1))),
        ("update", payload("u", null_row(1), full_row(1))),
        ("delete", payload("d", full_row(1), Value::Null)),
        (
            "snapshot read of nulls",
            payload("r", Value::Null, null_row(2)),
        ),
    ];
    let mut decoder = AvroDecoder::new();
    for (name, value) in cases {
        let key = json!({"id": 1});
        let want = via_json(Some(&key), &value).unwrap();
        let got = via_avro(&mut decoder, Some(&key), &value);
        assert_eq!(got, want, "{name}");
        let Record::Change(e) = &got else {
            panic!("{name}: not a change")
        };
        assert_eq!(e.key.as_deref().unwrap()["id"], 1, "{name}");
    }
    // The conversions themselves, once, so equality is not of two wrong values.
    let Record::Change(e) = via_avro(&mut decoder, None, &payload("c", Value::Null, full_row(3)))
    else {
        panic!()
    };
    let after = e.after.as_deref().unwrap();
    for (col, want) in [
        ("amount", json!("-1234.50")),
        ("vsd", json!("-0.007")),
        ("created_at", json!("2023-11-14T22:13:20.123456")),
        ("updated_at", json!("2026-09-22T10:31:00.5+02:00")),
        ("day", json!("1969-12-29")),
        ("at_ms", json!("2023-11-14T22:13:20.123000")),
        ("nano", json!("2023-11-14T22:13:20.123456")),
        ("t", json!("01:00:00.000001")),
        ("born", json!("2022-01-08")),
        ("seen", json!("1969-12-31T23:59:59.999000")),
        ("doc", json!({"a": [1, 2.5, null], "b": {"c": "d"}})),
        ("score", json!(0.1)),
    ] {
        assert_eq!(after[col], want, "{col}");
    }
    assert_eq!(e.table, TableId::new("public", "orders"));
    assert_eq!(
        (e.source.lsn, e.source.tx_id),
        (Some(24_023_128), Some(555))
    );
    assert_eq!(e.transaction.unwrap().total_order, Some(2));
}

#[test]
fn avro_logical_types_without_connect_names() {
    // A schema written by hand (not by Debezium): Avro's own logical types only.
    let text = r#"{"type":"record","name":"Envelope","fields":[
        {"name":"after","type":["null",{"type":"record","name":"Value","fields":[
            {"name":"p","type":{"type":"bytes","logicalType":"decimal","precision":6,"scale":3}},
            {"name":"us","type":{"type":"long","logicalType":"timestamp-micros"}},
            {"name":"ms","type":{"type":"long","logicalType":"timestamp-millis"}},
            {"name":"d","type":{"type":"int","logicalType":"date"}},
            {"name":"tm","type":{"type":"long","logicalType":"time-micros"}}]}],"default":null},
        {"name":"op","type":"string"},
        {"name":"source","type":{"type":"record","name":"Source","fields":[{"name":"table","type":"string"}]}}]}"#;
    let schema = parse_schema(text).unwrap();
    let value = AvroValue::Record(vec![
        (
            "after".into(),
            AvroValue::Union(
                1,
                Box::new(AvroValue::Record(vec![
                    ("p".into(), AvroValue::Decimal(vec![0xfbu8].into())),
                    (
                        "us".into(),
                        AvroValue::TimestampMicros(1_700_000_000_123_456),
                    ),
                    ("ms".into(), AvroValue::TimestampMillis(1_700_000_000_123)),
                    ("d".into(), AvroValue::Date(19000)),
                    ("tm".into(), AvroValue::TimeMicros(3_600_000_001)),
                ])),
            ),
        ),
        ("op".into(), AvroValue::String("c".into())),
        (
            "source".into(),
            AvroValue::Record(vec![("table".into(), AvroValue::String("t".into()))]),
        ),
    ]);
    let bytes = encode_confluent(1, &schema, value).unwrap();
    let (id, body) = confluent_frame(&bytes).unwrap();
    let record = AvroDecoder::new()
        .decode(None, Some((id, &schema, body)), || unreachable!(), pos())
        .unwrap();
    let Record::Change(e) = record else { panic!() };
    let after = e.after.as_deref().unwrap();
    assert_eq!(after["p"], "-0.005");
    assert_eq!(after["us"], "2023-11-14T22:13:20.123456");
    assert_eq!(after["ms"], "2023-11-14T22:13:20.123000");
    assert_eq!(after["d"], "2022-01-08");
    assert_eq!(after["tm"], "01:00:00.000001");
}

#[test]
fn connect_names_survive_parsing_only_through_parse_schema() {
    let (schema, _) =
        connect_to_avro(&envelope_schema(), &payload("c", Value::Null, full_row(1))).unwrap();
    let connect = connect_schema(&schema).unwrap();
    let after = &connect["fields"][1];
    let created = after["fields"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["field"] == "created_at")
        .unwrap();
    assert_eq!(created["name"], "io.debezium.time.MicroTimestamp");
    // The schema text as a registry stores it (type-level attributes) parses to the same.
    let reparsed = parse_schema(&schema.canonical_form()).unwrap();
    assert!(connect_schema(&reparsed).is_ok());
    let debezium_text = r#"{"type":"record","name":"V","fields":[
        {"name":"c","type":["null",{"type":"long","connect.version":1,"connect.name":"io.debezium.time.MicroTimestamp"}],"default":null}]}"#;
    let lifted = connect_schema(&parse_schema(debezium_text).unwrap()).unwrap();
    assert_eq!(
        lifted["fields"][0]["name"],
        "io.debezium.time.MicroTimestamp"
    );
    assert_eq!(lifted["fields"][0]["optional"], true);
    let plain = connect_schema(&Schema::parse_str(debezium_text).unwrap()).unwrap();
    assert_eq!(plain["fields"][0].get("name"), None, "apache-avro drops it");
}

#[test]
fn tombstones_and_transaction_markers() {
    let (kschema, kbytes) = frame(3, &key_schema(), &json!({"id": 9}));
    let (kid, kbody) = confluent_frame(&kbytes).unwrap();
    let record = AvroDecoder::new()
        .decode(
            Some((kid, &kschema, kbody)),
            None,
            || TableId::new("public", "orders"),
            pos(),
        )
        .unwrap();
    let Record::Change(e) = record else { panic!() };
    assert_eq!(
        (e.op, e.table.clone()),
        (Op::Delete, TableId::new("public", "orders"))
    );
    assert_eq!(e.key.as_deref().unwrap()["id"], 9);
    assert!(e.before.is_none() && e.after.is_none());
    let none = AvroDecoder::new().decode(None, None, || unreachable!(), pos());
    assert_eq!(none.unwrap(), Record::Tombstone(pos()));

    let marker_schema = json!({"type": "struct", "name": "io.debezium.connector.common.TransactionMetadataValue",
        "optional": false, "fields": [
            {"field": "status", "type": "string", "optional": false},
            {"field": "id", "type": "string", "optional": false},
            {"field": "event_count", "type": "int64", "optional": true},
            {"field": "ts_ms", "type": "int64", "optional": false}]});
    let marker = json!({"status": "END", "id": "571", "event_count": 2, "ts_ms": 5});
    let (schema, bytes) = frame(4, &marker_schema, &marker);
    let got = AvroDecoder::new()
        .decode(
            None,
            Some((4, &schema, &bytes[5..])),
            || unreachable!(),
            pos(),
        )
        .unwrap();
    let line = json!({"schema": marker_schema, "payload": marker}).to_string();
    let want = DebeziumDecoder::new()
        .decode(line.as_bytes(), pos())
        .unwrap();
    assert_eq!(got, want);
}

#[test]
fn bad_frames_and_bodies_are_errors_with_reasons() {
    assert!(
        confluent_frame(&[0, 0, 0])
            .unwrap_err()
            .contains("shorter than")
    );
    assert!(
        confluent_frame(b"{\"a\":1}")
            .unwrap_err()
            .contains("magic byte")
    );
    assert_eq!(
        confluent_frame(&[0, 0, 0, 1, 2, 9]).unwrap(),
        (258, &[9u8][..])
    );

    let value = payload("c", Value::Null, full_row(1));
    let (schema, bytes) = frame(7, &envelope_schema(), &value);
    let body = &bytes[5..];
    let decode = |body: &[u8]| {
        AvroDecoder::new().decode(None, Some((7, &schema, body)), || unreachable!(), pos())
    };
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "truncated",
            body[..body.len() - 3].to_vec(),
            "corrupt Avro body",
        ),
        ("trailing bytes", [body, &[1, 2]].concat(), "left over"),
        (
            "bad union index",
            [&[0x7f][..], &body[1..]].concat(),
            "corrupt Avro body",
        ),
        ("empty", Vec::new(), "corrupt Avro body"),
    ];
    for (name, body, want) in cases {
        let err = decode(&body).expect_err(name);
        assert_eq!(err.position, pos(), "{name}");
        assert!(err.reason.contains(want), "{name}: {}", err.reason);
    }
    // A well-formed body of the wrong shape: a key record read as an envelope.
    let (kschema, kbytes) = frame(3, &key_schema(), &json!({"id": 9}));
    let err = AvroDecoder::new()
        .decode(
            None,
            Some((3, &kschema, &kbytes[5..])),
            || unreachable!(),
            pos(),
        )
        .unwrap_err();
    assert!(err.reason.contains("missing `op`"), "{}", err.reason);
    // A value that does not match its schema is refused on the way in.
    assert!(encode_confluent(1, &schema, AvroValue::Int(3)).is_err());
}

fn arb_row() -> impl Strategy<Value = Value> {
    (
        any::<i32>(),
        proptest::option::of(any::<i64>()),
        proptest::option::of((0u32..12, any::<i64>())),
        -4_000_000_000_000_000i64..4_000_000_000_000_000,
        proptest::option::of(-100_000i32..100_000),
        proptest::option::of(0i64..86_400_000_000),
        proptest::option::of("[a-zé ]{0,8}"),
        // Floats with short decimal forms: serde_json (without `float_roundtrip`) may read a
        // 17-digit double one ulp off, so the JSON path is not a reliable oracle for those.
        proptest::option::of(any::<i32>().prop_map(|n| f64::from(n) / 8.0)),
    )
        .prop_map(|(id, amount, vsd, created, day, t, note, ratio)| {
            let mut row = null_row(id);
            row["amount"] = amount.map_or(Value::Null, |a| decimal(a.into()));
            row["vsd"] = vsd.map_or(
                Value::Null,
                |(s, v)| json!({"scale": s, "value": decimal(v.into())}),
            );
            row["created_at"] = json!(created);
            row["day"] = json!(day);
            row["t"] = json!(t);
            row["note"] = json!(note);
            row["ratio"] = json!(ratio);
            row["doc"] = note.map_or(Value::Null, |n| json!(json!({"n": n}).to_string()));
            row
        })
}

proptest! {
    #[test]
    fn random_rows_decode_alike(before in proptest::option::of(arb_row()), after in arb_row()) {
        let value = payload("u", before.unwrap_or(Value::Null), after);
        let key = json!({"id": 5});
        let want = via_json(Some(&key), &value).unwrap();
        let got = via_avro(&mut AvroDecoder::new(), Some(&key), &value);
        prop_assert_eq!(got, want);
    }
}
