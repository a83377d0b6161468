//! The direct path gives what the general path gives (apache-avro's value tree, then
//! `to_json`), value for value, on bodies apache-avro wrote.

use apache_avro::types::Value as AvroValue;
use proptest::prelude::*;
use serde_json::Value;

use super::Plan;
use crate::avro::{encode_confluent, parse_schema, read_body, to_json};

/// Every type the plan reads, a named type used again by reference, a recursive list, and
/// namespaces.
const SCHEMA: &str = r#"{
  "type": "record", "name": "Row", "namespace": "shop.v1",
  "fields": [
    {"name": "b", "type": "boolean"},
    {"name": "i", "type": "int"},
    {"name": "l", "type": "long"},
    {"name": "f", "type": "float"},
    {"name": "d", "type": "double"},
    {"name": "bytes", "type": "bytes"},
    {"name": "s", "type": "string"},
    {"name": "fx", "type": {"type": "fixed", "name": "Four", "size": 4}},
    {"name": "fx2", "type": "Four"},
    {"name": "dec", "type": {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 2}},
    {"name": "decf", "type": {"type": "fixed", "name": "D5", "size": 5, "logicalType": "decimal", "precision": 10, "scale": 3}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    {"name": "e", "type": {"type": "enum", "name": "Colour", "namespace": "paint", "symbols": ["RED", "GREEN"]}},
    {"name": "e2", "type": ["null", "paint.Colour"]},
    {"name": "opt", "type": ["null", "string"]},
    {"name": "num", "type": ["null", "long", "double"]},
    {"name": "arr", "type": {"type": "array", "items": ["null", "int"]}},
    {"name": "map", "type": {"type": "map", "values": "string"}},
    {"name": "list", "type": ["null", {"type": "record", "name": "Node", "fields": [
        {"name": "v", "type": "int"}, {"name": "next", "type": ["null", "Node"]}]}]}
  ]
}"#;

/// The generated parts of a [`SCHEMA`] value that nest: the `num` branch, `arr`, `map` and
/// the values of `list`.
type Nested = (u8, Vec<Option<i32>>, Vec<(String, String)>, Vec<i32>);

/// A value of [`SCHEMA`] from the generated parts.
fn row(
    (b, i, l, f, d): (bool, i32, i64, f32, f64),
    (bytes, s, fx): (Vec<u8>, String, [u8; 4]),
    (dec, decf, e, opt): (Vec<u8>, [u8; 5], u32, Option<String>),
    (num, arr, map, list): Nested,
) -> AvroValue {
    let colour = |e: u32| AvroValue::Enum(e % 2, ["RED", "GREEN"][(e % 2) as usize].into());
    let mut node = AvroValue::Union(0, Box::new(AvroValue::Null));
    for v in list.iter().rev() {
        node = AvroValue::Union(
            1,
            Box::new(AvroValue::Record(vec![
                ("v".into(), AvroValue::Int(*v)),
                ("next".into(), node),
            ])),
        );
    }
    let num = match num % 3 {
        0 => AvroValue::Union(0, Box::new(AvroValue::Null)),
        1 => AvroValue::Union(1, Box::new(AvroValue::Long(l))),
        _ => AvroValue::Union(2, Box::new(AvroValue::Double(d))),
    };
    AvroValue::Record(vec![
        ("b".into(), AvroValue::Boolean(b)),
        ("i".into(), AvroValue::Int(i)),
        ("l".into(), AvroValue::Long(l)),
        ("f".into(), AvroValue::Float(f)),
        ("d".into(), AvroValue::Double(d)),
        ("bytes".into(), AvroValue::Bytes(bytes)),
        ("s".into(), AvroValue::String(s)),
        ("fx".into(), AvroValue::Fixed(4, fx.to_vec())),
        (
            "fx2".into(),
            AvroValue::Fixed(4, fx.iter().rev().copied().collect()),
        ),
        ("dec".into(), AvroValue::Decimal(dec.into())),
        ("decf".into(), AvroValue::Decimal(decf.to_vec().into())),
        ("day".into(), AvroValue::Date(i)),
        ("ts".into(), AvroValue::TimestampMicros(l)),
        ("e".into(), colour(e)),
        (
            "e2".into(),
            if e % 3 == 0 {
                AvroValue::Union(0, Box::new(AvroValue::Null))
            } else {
                AvroValue::Union(1, Box::new(colour(e / 3)))
            },
        ),
        (
            "opt".into(),
            match opt {
                None => AvroValue::Union(0, Box::new(AvroValue::Null)),
                Some(s) => AvroValue::Union(1, Box::new(AvroValue::String(s))),
            },
        ),
        ("num".into(), num),
        (
            "arr".into(),
            AvroValue::Array(
                arr.into_iter()
                    .map(|v| match v {
                        None => AvroValue::Union(0, Box::new(AvroValue::Null)),
                        Some(n) => AvroValue::Union(1, Box::new(AvroValue::Int(n))),
                    })
                    .collect(),
            ),
        ),
        (
            "map".into(),
            AvroValue::Map(
                map.into_iter()
                    .map(|(k, v)| (k, AvroValue::String(v)))
                    .collect(),
            ),
        ),
        ("list".into(), node),
    ])
}

/// Both paths on one body; the body without its frame.
fn both(schema: &apache_avro::Schema, value: AvroValue) -> (Value, Value, Vec<u8>) {
    let framed = encode_confluent(1, schema, value).expect("a value of the schema");
    let body = framed[5..].to_vec();
    let general = to_json(read_body(schema, &body).expect("the general path reads it"));
    let plan = Plan::new(schema).expect("a plan for every type of the schema");
    let direct: Value = plan.read(&body).expect("the direct path reads it");
    (general, direct, body)
}

fn float() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<f32>(),
        Just(0.1f32),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(-0.0f32),
        Just(f32::MIN_POSITIVE),
    ]
}

fn double() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<f64>(),
        Just(f64::NAN),
        Just(f64::NEG_INFINITY),
        Just(1e300)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn the_direct_path_reads_what_the_general_path_reads(
        scalars in (any::<bool>(), any::<i32>(), any::<i64>(), float(), double()),
        texts in (proptest::collection::vec(any::<u8>(), 0..8), ".{0,12}", any::<[u8; 4]>()),
        more in (
            proptest::collection::vec(any::<u8>(), 1..10),
            any::<[u8; 5]>(),
            any::<u32>(),
            proptest::option::of(".{0,6}"),
        ),
        nested in (
            any::<u8>(),
            proptest::collection::vec(proptest::option::of(any::<i32>()), 0..5),
            proptest::collection::vec((".{0,4}", ".{0,4}"), 0..4),
            proptest::collection::vec(any::<i32>(), 0..4),
        ),
    ) {
        let schema = parse_schema(SCHEMA).unwrap();
        let (general, direct, _) = both(&schema, row(scalars, texts, more, nested));
        prop_assert_eq!(general, direct);
    }
}

/// Edge values by hand: the extremes of each integer, a float whose shortest text differs from
/// its double, an empty decimal (null on the general path), and an array written in a block of
/// a negative count (followed by its size in bytes), as other writers may.
#[test]
fn edges_and_blocks_with_a_negative_count() {
    let schema = parse_schema(SCHEMA).unwrap();
    let value = row(
        (true, i32::MIN, i64::MAX, 0.1, -0.0),
        (vec![], "é\u{0}\"".into(), [0, 1, 2, 255]),
        (vec![0xFF], [0xFF; 5], 4, Some(String::new())),
        (
            2,
            vec![Some(i32::MAX), None],
            vec![("k".into(), "v".into())],
            vec![1, 2, 3],
        ),
    );
    let (general, direct, _) = both(&schema, value);
    assert_eq!(general, direct);
    assert_eq!(direct["f"], serde_json::json!(0.1));
    assert_eq!(direct["list"]["next"]["next"]["v"], 3);

    // An empty decimal (apache-avro writes none, another writer may): null on both paths.
    let schema = parse_schema(
        r#"{"type": "record", "name": "D", "fields": [{"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 4, "scale": 2}}]}"#,
    )
    .unwrap();
    let general = to_json(read_body(&schema, &[0]).unwrap());
    let direct: Value = Plan::new(&schema).unwrap().read(&[0]).unwrap();
    assert_eq!(general, serde_json::json!({"d": null}));
    assert_eq!(general, direct);

    // A one-field record holding an array of longs: [1, 2] as one block of count -2 (zigzag 3)
    // and size 2, then the end.
    let schema = parse_schema(
        r#"{"type": "record", "name": "A", "fields": [{"name": "a", "type": {"type": "array", "items": "long"}}]}"#,
    )
    .unwrap();
    let body = [3u8, 4, 2, 4, 0];
    let general = to_json(read_body(&schema, &body).unwrap());
    let direct: Value = Plan::new(&schema).unwrap().read(&body).unwrap();
    assert_eq!(general, serde_json::json!({"a": [1, 2]}));
    assert_eq!(general, direct);
}

/// A body cut short, one with bytes left over, and a union branch that does not exist are
/// errors that say the body is corrupt.
#[test]
fn corrupt_bodies_are_errors() {
    let schema = parse_schema(SCHEMA).unwrap();
    let value = row(
        (true, 1, 2, 3.0, 4.0),
        (vec![1], "s".into(), [0; 4]),
        (vec![1], [0; 5], 0, None),
        (0, vec![], vec![], vec![]),
    );
    let (_, _, body) = both(&schema, value);
    let plan = Plan::new(&schema).unwrap();
    for cut in [1, body.len() / 2, body.len() - 1] {
        let err = plan.read::<Value>(&body[..cut]).unwrap_err();
        assert!(err.starts_with("corrupt Avro body: "), "{err}");
    }
    let mut longer = body.clone();
    longer.push(0);
    let err = plan.read::<Value>(&longer).unwrap_err();
    assert!(err.contains("1 bytes left over"), "{err}");

    let union = parse_schema(r#"["null", "long"]"#).unwrap();
    let err = Plan::new(&union).unwrap().read::<Value>(&[4]).unwrap_err();
    assert_eq!(err, "corrupt Avro body: union branch 2 of 2");
}

/// Types the general path reads in its own way get no plan.
#[test]
fn uuids_get_no_plan() {
    let schema = parse_schema(r#"{"type": "string", "logicalType": "uuid"}"#).unwrap();
    assert!(Plan::new(&schema).is_none());
}
