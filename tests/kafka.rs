//! The Kafka source end to end: the same changes read from a change-log file, from topics as
//! Debezium JSON and from topics as Debezium Avro (through a schema registry speaking the real
//! REST API) give equal read models, value for value; bad input on a topic is dead-lettered with
//! its topic, partition and offset while the good records after it are applied.

mod common;

use std::path::Path;

use std::collections::BTreeMap;

use common::kafka::{self, Message};
use common::registry::TestRegistry;
use common::{read_output, refract};
use refract_schemas::avro::{connect_to_avro, encode_confluent};
use serde_json::{Value, json};

const PARTITIONS: i32 = 6;

/// The Kafka Connect schema of `public.prices`' rows: every logical type the issue names.
fn value_schema(field: &str) -> Value {
    json!({
        "field": field, "type": "struct", "optional": true, "name": "db.public.prices.Value",
        "fields": [
            {"field": "id", "type": "int32", "optional": false},
            {"field": "amount", "type": "bytes", "optional": true,
             "name": "org.apache.kafka.connect.data.Decimal", "version": 1,
             "parameters": {"scale": "2", "connect.decimal.precision": "12"}},
            {"field": "at", "type": "int64", "optional": true, "name": "io.debezium.time.MicroTimestamp", "version": 1},
            {"field": "zoned", "type": "string", "optional": true, "name": "io.debezium.time.ZonedTimestamp", "version": 1},
            {"field": "day", "type": "int32", "optional": true, "name": "io.debezium.time.Date", "version": 1},
            {"field": "attrs", "type": "string", "optional": true, "name": "io.debezium.data.Json", "version": 1},
            {"field": "name", "type": "string", "optional": true}
        ]
    })
}

fn envelope_schema() -> Value {
    json!({
        "type": "struct", "optional": false, "name": "db.public.prices.Envelope",
        "fields": [
            value_schema("before"),
            value_schema("after"),
            {"field": "source", "type": "struct", "optional": false, "name": "io.debezium.connector.postgresql.Source",
             "fields": [
                {"field": "connector", "type": "string", "optional": false},
                {"field": "db", "type": "string", "optional": false},
                {"field": "schema", "type": "string", "optional": false},
                {"field": "table", "type": "string", "optional": false},
                {"field": "ts_ms", "type": "int64", "optional": false},
                {"field": "txId", "type": "int64", "optional": true},
                {"field": "lsn", "type": "int64", "optional": true}
             ]},
            {"field": "op", "type": "string", "optional": false},
            {"field": "ts_ms", "type": "int64", "optional": true}
        ]
    })
}

fn key_schema() -> Value {
    json!({"type": "struct", "optional": false, "name": "db.public.prices.Key",
           "fields": [{"field": "id", "type": "int32", "optional": false}]})
}

/// Kafka Connect's Decimal: the unscaled value, two's complement, big-endian, base64.
fn decimal(unscaled: i64) -> String {
    use base64::Engine as _;
    let bytes = unscaled.to_be_bytes();
    // The shortest two's-complement form, as Connect writes it.
    let mut start = 0;
    while start < 7 {
        let (b, next) = (bytes[start], bytes[start + 1]);
        if (b == 0 && next & 0x80 == 0) || (b == 0xff && next & 0x80 != 0) {
            start += 1;
        } else {
            break;
        }
    }
    base64::engine::general_purpose::STANDARD.encode(&bytes[start..])
}

/// A row of `public.prices` for id `id` at version `v`: negative decimals, microsecond and zoned
/// timestamps, dates, JSON.
fn row(id: i64, v: i64) -> Value {
    let unscaled = if id % 3 == 0 {
        -(id * 100_007 + v)
    } else {
        id * 1_000 + v
    };
    json!({
        "id": id,
        "amount": decimal(unscaled),
        "at": 1_700_000_000_123_456_i64 + id * 1_000_001 + v,
        "zoned": format!("2026-03-0{}T10:15:30.{:06}+05:30", 1 + id % 9, v),
        "day": 19_000 + id + v,
        "attrs": json!({"v": v, "tags": ["a", id.to_string()], "nested": {"x": id}}).to_string(),
        "name": if v % 4 == 3 { Value::Null } else { json!(format!("item {id} v{v}")) }
    })
}

/// One change as Debezium writes it: key and value as Connect JSON with schemas.
struct Change {
    key: Value,
    /// `None` for the tombstone that follows a delete.
    value: Option<Value>,
}

fn changes() -> Vec<Change> {
    let mut out = Vec::new();
    let key = |id: i64| json!({"schema": key_schema(), "payload": {"id": id}});
    let change = |op: &str, before: Value, after: Value, n: i64| {
        json!({"schema": envelope_schema(), "payload": {
            "before": before, "after": after, "op": op, "ts_ms": 1_700_000_000_000_i64 + n,
            "source": {"connector": "postgresql", "db": "shop", "schema": "public",
                       "table": "prices", "ts_ms": 1_700_000_000_000_i64 + n, "txId": 500 + n, "lsn": 1_000 + n}
        }})
    };
    let mut n = 0;
    for v in 0..4 {
        for id in 1..=60 {
            n += 1;
            let (op, before) = if v == 0 {
                ("c", Value::Null)
            } else {
                ("u", row(id, v - 1))
            };
            out.push(Change {
                key: key(id),
                value: Some(change(op, before, row(id, v), n)),
            });
        }
    }
    for id in (1..=60).filter(|id| id % 7 == 0) {
        n += 1;
        out.push(Change {
            key: key(id),
            value: Some(change("d", row(id, 3), Value::Null, n)),
        });
        out.push(Change {
            key: key(id),
            value: None,
        });
    }
    out
}

/// The change log the file source reads: one wrapped envelope per line; a tombstone is the
/// key/value shape with a null value, as kcat dumps it.
fn change_log(changes: &[Change]) -> String {
    let mut text = String::new();
    for c in changes {
        let line = match &c.value {
            Some(v) => v.clone(),
            None => json!({"key": c.key, "value": null}),
        };
        text.push_str(&line.to_string());
        text.push('\n');
    }
    text
}

fn json_messages(changes: &[Change]) -> Vec<Message> {
    changes
        .iter()
        .map(|c| {
            (
                Some(c.key.to_string().into_bytes()),
                c.value.as_ref().map(|v| v.to_string().into_bytes()),
            )
        })
        .collect()
}

/// A pipeline reading `source` (a TOML `[source]` body) into object-JSON documents under `out`.
fn pipeline(dir: &Path, name: &str, source: &str, out: &Path) -> std::path::PathBuf {
    let text = format!(
        "[pipeline]\nname = \"{name}\"\nstate_dir = \"{state}\"\n\n[pipeline.batch]\nmax_delay_ms = 20\n\n\
         [source]\n{source}\n\n[projections.replica]\nkind = \"replica\"\nsinks = [\"docs\"]\n\n\
         [sinks.docs]\nkind = \"object_json\"\nurl = \"file://{out}\"\n",
        state = dir.join(format!("state-{name}")).display(),
        out = out.display(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs the pipeline until it has caught up with its source; returns its summary on stdout.
fn catch_up(pipeline: &Path) -> Value {
    let out = refract()
        .args(["run", "--until-caught-up"])
        .arg(pipeline)
        .output()
        .expect("refract runs");
    assert!(
        out.status.success(),
        "refract run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

fn kafka_source(brokers: &str, topic: &str, group: &str, extra: &str) -> String {
    format!(
        "kind = \"kafka\"\nbrokers = \"{brokers}\"\ntopics = [\"{topic}\"]\ngroup_id = \"{group}\"\n{extra}"
    )
}

/// The read model the file source builds from the changes written as a change log.
fn file_read_model(dir: &Path, changes: &[Change]) -> BTreeMap<(String, String), Value> {
    let log = dir.join("changes.jsonl");
    std::fs::write(&log, change_log(changes)).unwrap();
    let from_file = dir.join("from-file");
    catch_up(&pipeline(
        dir,
        "file",
        &format!(
            "kind = \"file\"\npath = \"{}\"\nfollow = false",
            log.display()
        ),
        &from_file,
    ));
    read_output(&from_file)
}

#[test]
fn json_topics_give_the_file_sources_read_model_value_for_value() {
    let dir = tempfile::tempdir().unwrap();
    let changes = changes();
    let expected = file_read_model(dir.path(), &changes);
    assert_eq!(expected.len(), 60 - 8, "live prices from the file");
    let some = &expected[&("prices".to_string(), "3".to_string())];
    assert_eq!(
        some["amount"],
        json!("-3000.24"),
        "a negative decimal, exact: {some}"
    );

    let topic = "db.public.prices";
    let cluster = kafka::cluster(&[topic], PARTITIONS);
    let brokers = cluster.bootstrap_servers();
    kafka::produce(&brokers, topic, &json_messages(&changes));
    let from_json = dir.path().join("from-json");
    catch_up(&pipeline(
        dir.path(),
        "json",
        &kafka_source(&brokers, topic, "json-equal", ""),
        &from_json,
    ));
    assert_eq!(
        read_output(&from_json),
        expected,
        "Debezium JSON from Kafka"
    );
    let committed: i64 = kafka::committed(&brokers, "json-equal", topic, PARTITIONS)
        .values()
        .sum();
    assert_eq!(
        committed as usize,
        changes.len(),
        "every offset committed once durable"
    );
}

/// The changes as Debezium's AvroConverter writes them: Confluent-framed Avro key and value,
/// their schemas registered in `registry`. Returns the messages and the value schema's id.
fn avro_messages(changes: &[Change], registry: &TestRegistry) -> (Vec<Message>, u32) {
    let mut ids: BTreeMap<String, u32> = BTreeMap::new();
    let mut encode = |connect: &Value| {
        let (schema, value) = connect_to_avro(&connect["schema"], &connect["payload"]).unwrap();
        let text = serde_json::to_string(&schema).unwrap();
        let id = *ids
            .entry(text.clone())
            .or_insert_with(|| registry.insert(&text));
        (encode_confluent(id, &schema, value).unwrap(), id)
    };
    let mut value_id = 0;
    let messages = changes
        .iter()
        .map(|c| {
            let key = encode(&c.key).0;
            let value = c.value.as_ref().map(|v| {
                let (bytes, id) = encode(v);
                value_id = id;
                bytes
            });
            (Some(key), value)
        })
        .collect();
    (messages, value_id)
}

fn avro_source(brokers: &str, topic: &str, group: &str, registry: &TestRegistry) -> String {
    kafka_source(
        brokers,
        topic,
        group,
        &format!(
            "format = \"debezium_avro\"\nschema_registry = {{ url = \"{}\" }}",
            registry.url
        ),
    )
}

#[test]
fn avro_topics_give_the_file_sources_read_model_value_for_value() {
    let dir = tempfile::tempdir().unwrap();
    let changes = changes();
    let expected = file_read_model(dir.path(), &changes);

    let topic = "db.public.prices";
    let cluster = kafka::cluster(&[topic], PARTITIONS);
    let brokers = cluster.bootstrap_servers();
    let registry = TestRegistry::start();
    kafka::produce(&brokers, topic, &avro_messages(&changes, &registry).0);
    let from_avro = dir.path().join("from-avro");
    catch_up(&pipeline(
        dir.path(),
        "avro",
        &avro_source(&brokers, topic, "avro-equal", &registry),
        &from_avro,
    ));
    assert_eq!(
        read_output(&from_avro),
        expected,
        "Debezium Avro from Kafka"
    );
}

#[test]
fn bad_avro_records_are_dead_lettered_and_the_rest_applied() {
    let dir = tempfile::tempdir().unwrap();
    let topic = "db.public.prices";
    let cluster = kafka::cluster(&[topic], 1);
    let brokers = cluster.bootstrap_servers();
    let registry = TestRegistry::start();
    let all = changes();
    let (good, value_id) = avro_messages(&all[..10], &registry);
    let key = good[0].0.clone();
    let mut unknown = vec![0u8];
    unknown.extend_from_slice(&9_999u32.to_be_bytes());
    unknown.extend_from_slice(b"\x02\x04");
    let mut corrupt = vec![0u8];
    corrupt.extend_from_slice(&value_id.to_be_bytes());
    corrupt.extend_from_slice(&[0xff; 7]);
    let mut messages = good[..5].to_vec();
    messages.push((key.clone(), Some(b"{\"not\":\"avro\"}".to_vec())));
    messages.push((key.clone(), Some(unknown)));
    messages.push((key, Some(corrupt)));
    messages.extend_from_slice(&good[5..]);
    kafka::produce(&brokers, topic, &messages);
    let out = dir.path().join("out");
    let pipeline = pipeline(
        dir.path(),
        "badavro",
        &avro_source(&brokers, topic, "bad-avro", &registry),
        &out,
    );
    catch_up(&pipeline);
    assert_eq!(
        read_output(&out).len(),
        10,
        "the good records around the bad ones are applied"
    );
    let letters = dead_letters(&dir.path().join("state-badavro/badavro/dead-letters.ndjson"));
    assert_eq!(letters.len(), 3, "{letters:?}");
    let reasons: Vec<&str> = letters
        .iter()
        .map(|l| l["reason"].as_str().unwrap_or(""))
        .collect();
    assert!(
        reasons[1].contains("9999"),
        "the unknown schema id is named: {reasons:?}"
    );
    for (letter, offset) in letters.iter().zip([5, 6, 7]) {
        assert_eq!(
            letter["position"]["partition"],
            json!(format!("{topic}/0")),
            "{letter}"
        );
        assert_eq!(letter["position"]["offset"], json!([offset, 0]), "{letter}");
    }
}

#[test]
fn bad_records_are_dead_lettered_with_their_coordinates_and_the_rest_applied() {
    let dir = tempfile::tempdir().unwrap();
    let topic = "db.public.prices";
    let cluster = kafka::cluster(&[topic], 1);
    let brokers = cluster.bootstrap_servers();
    let all = changes();
    let good = json_messages(&all[..10]);
    let mut messages = good[..5].to_vec();
    messages.push((
        Some(b"{\"id\":999}".to_vec()),
        Some(b"{\"hello\":\"not debezium\"}".to_vec()),
    ));
    messages.push((
        Some(b"{\"id\":998}".to_vec()),
        Some(b"\x00\x00\x00\x00\x07garbage".to_vec()),
    ));
    messages.extend_from_slice(&good[5..]);
    kafka::produce(&brokers, topic, &messages);
    let out = dir.path().join("out");
    let pipeline = pipeline(
        dir.path(),
        "bad",
        &kafka_source(&brokers, topic, "bad-input", ""),
        &out,
    );
    catch_up(&pipeline);
    assert_eq!(
        read_output(&out).len(),
        10,
        "the good records around the bad ones are applied"
    );
    let letters = dead_letters(&dir.path().join("state-bad/bad/dead-letters.ndjson"));
    assert_eq!(letters.len(), 2, "{letters:?}");
    for (letter, offset) in letters.iter().zip([5, 6]) {
        // The topic, the partition and the offset of the bad record.
        assert_eq!(
            letter["position"]["partition"],
            json!(format!("{topic}/0")),
            "{letter}"
        );
        assert_eq!(letter["position"]["offset"], json!([offset, 0]), "{letter}");
        assert!(
            !letter["reason"].as_str().unwrap_or("").is_empty(),
            "{letter}"
        );
    }
}

/// The entries of a dead-letter file.
fn dead_letters(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a dead letter is JSON"))
        .collect()
}

#[test]
fn plan_masks_kafka_secrets_and_explains_the_scale_out() {
    let dir = tempfile::tempdir().unwrap();
    let source = kafka_source(
        "broker:9092",
        "db.public.prices",
        "planned",
        "format = \"debezium_avro\"\n\
         schema_registry = { url = \"http://reg:8081\", username = \"u\", password = \"hunter2\" }\n\
         properties = { \"security.protocol\" = \"SASL_SSL\", \"sasl.password\" = \"hunter3\" }",
    );
    let path = pipeline(dir.path(), "planned", &source, &dir.path().join("out"));
    let out = refract()
        .arg("plan")
        .arg(&path)
        .output()
        .expect("refract runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        !text.contains("hunter2") && !text.contains("hunter3"),
        "{text}"
    );
    assert!(text.contains("security.protocol = SASL_SSL"), "{text}");
    assert!(text.contains("consumer group `planned`"), "{text}");
    assert!(text.contains("scale-out"), "{text}");
}
