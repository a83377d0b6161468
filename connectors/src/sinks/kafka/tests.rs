//! The Kafka sink against rdkafka's in-process mock cluster (real Kafka protocol on loopback):
//! what a consumer reads back, per-key partitioning and order, tombstones, and a batch that
//! fails while the brokers are down and goes through once they are back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::{Message as _, Offset as KafkaOffset, TopicPartitionList};
use refract_schemas::debezium::DebeziumDecoder;
use refract_schemas::debezium::encode::key_row;
use refract_schemas::event::{SourceInfo, TxInfo};
use refract_schemas::write::{DocumentOp, WriteOp};
use refract_schemas::{ChangeEvent, Offset, Op, Position, Record, Row, TableId};
use serde_json::{Value, json};

use super::*;

const BROKERS: i32 = 3;
const PARTITIONS: i32 = 6;
const TABLE_TOPIC: &str = "shop.public.authors";
const DOCS_TOPIC: &str = "shop.books";
/// Short enough that the broker-down test fails fast, long enough for a loaded machine.
const DELIVERY_TIMEOUT_MS: u64 = 3_000;
/// How long a test waits for what it expects before failing.
const DEADLINE: Duration = Duration::from_secs(30);

fn cluster() -> MockCluster<'static, DefaultProducerContext> {
    let cluster = MockCluster::new(BROKERS).expect("a mock cluster");
    for topic in [TABLE_TOPIC, DOCS_TOPIC] {
        cluster.create_topic(topic, PARTITIONS, BROKERS).unwrap();
    }
    cluster
}

fn sink(brokers: &str) -> KafkaSink {
    KafkaSink::new(
        "k",
        KafkaSinkConfig {
            brokers: brokers.to_owned(),
            topic_prefix: "shop".into(),
            documents_topic: "{topic_prefix}.{collection}".into(),
            compression: KafkaCompression::Lz4,
            delivery_timeout_ms: DELIVERY_TIMEOUT_MS,
            properties: BTreeMap::new(),
        },
    )
}

fn row(v: Value) -> Arc<Row> {
    Arc::new(serde_json::from_value(v).unwrap())
}

/// A change of `public.authors` at source offset `n`.
fn change(n: u64, op: Op, before: Option<Value>, after: Option<Value>) -> ChangeEvent {
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
            ts_ms: Some(1_700_000_000_000 + n as i64),
            tx_id: Some(n as i64),
            lsn: Some(1000 + n),
            kafka: None,
        },
        transaction: Some(TxInfo {
            id: format!("{n}:{}", 1000 + n),
            total_order: Some(1),
            data_collection_order: Some(1),
        }),
        position: position(n),
    }
}

fn position(n: u64) -> Position {
    Position {
        partition: "slot".into(),
        offset: Offset(n, 0),
    }
}

/// Creates of ids 1..=8, updates of ids 1..=4, then a delete of id 3.
fn changes() -> Vec<ChangeEvent> {
    let mut events = Vec::new();
    for id in 1..=8 {
        let n = events.len() as u64;
        events.push(change(
            n,
            Op::Create,
            None,
            Some(json!({"id": id, "name": format!("a{id}")})),
        ));
    }
    for id in 1..=4 {
        let n = events.len() as u64;
        let (old, new) = (
            json!({"id": id, "name": format!("a{id}")}),
            json!({"id": id, "name": format!("b{id}")}),
        );
        events.push(change(n, Op::Update, Some(old), Some(new)));
    }
    let n = events.len() as u64;
    events.push(change(n, Op::Delete, Some(json!({"id": 3})), None));
    events
}

fn batch(seq: u64, ops: Vec<WriteOp>) -> SinkBatch {
    SinkBatch { seq, ops }
}

fn relayed(events: &[ChangeEvent]) -> Vec<WriteOp> {
    events
        .iter()
        .map(|e| WriteOp::Change(Arc::new(e.clone())))
        .collect()
}

/// One message read back: partition, key, value.
#[derive(Debug, Clone)]
struct Read {
    partition: i32,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
}

/// Reads `topic` from the start of every partition until `count` messages are in, in partition
/// order (each partition's messages in offset order).
fn read(brokers: &str, topic: &str, count: usize) -> Vec<Read> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "refract-test")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut assignment = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        assignment
            .add_partition_offset(topic, p, KafkaOffset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < count {
        assert!(
            start.elapsed() < DEADLINE,
            "read {} of {count} messages: {out:?}",
            out.len()
        );
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m.unwrap();
            out.push(Read {
                partition: m.partition(),
                key: m.key().map(<[u8]>::to_vec),
                value: m.payload().map(<[u8]>::to_vec),
            });
        }
    }
    out.sort_by_key(|r| r.partition); // stable: offset order kept within a partition
    out
}

/// Decodes a message as the Kafka source would: its key and its Debezium envelope.
fn decode(r: &Read) -> ChangeEvent {
    let key: Value = serde_json::from_slice(r.key.as_deref().unwrap()).unwrap();
    let value: Value = serde_json::from_slice(r.value.as_deref().unwrap()).unwrap();
    let record = json!({"key": key, "value": value}).to_string();
    match DebeziumDecoder::new().decode(record.as_bytes(), position(0)) {
        Ok(Record::Change(e)) => e,
        other => panic!("{other:?}"),
    }
}

/// `e` as it reads back: its key as an image of its own, at the test's decode position.
fn as_read_back(e: &ChangeEvent) -> ChangeEvent {
    let mut e = e.clone();
    e.key = key_row(&e).map(|k| Arc::new(k.unwrap()));
    e.key_columns = None;
    e.position = position(0);
    e
}

/// Checks what `read` holds against the `events` relayed (each once, in order per key).
fn check_relayed(read: &[Read], events: &[ChangeEvent]) {
    let mut partition_of: HashMap<Vec<u8>, i32> = HashMap::new();
    let mut per_key: HashMap<Vec<u8>, Vec<ChangeEvent>> = HashMap::new();
    for (i, r) in read.iter().enumerate() {
        let key = r.key.clone().expect("every message has a key");
        let first = *partition_of.entry(key.clone()).or_insert(r.partition);
        assert_eq!(
            first,
            r.partition,
            "key {:?} in two partitions",
            String::from_utf8_lossy(&key)
        );
        if r.value.is_none() {
            let before = &read[i - 1];
            assert_eq!(before.key, r.key, "a tombstone right after its delete");
            assert_eq!(
                decode(before).op,
                Op::Delete,
                "a tombstone right after its delete"
            );
            continue;
        }
        per_key.entry(key).or_default().push(decode(r));
    }
    let tombstones = read.iter().filter(|r| r.value.is_none()).count();
    let deletes = events.iter().filter(|e| e.op == Op::Delete).count();
    assert_eq!(tombstones, deletes);
    let mut expected: HashMap<Vec<u8>, Vec<ChangeEvent>> = HashMap::new();
    for e in events {
        let key = serde_json::to_vec(&key_row(e).unwrap().unwrap()).unwrap();
        expected.entry(key).or_default().push(as_read_back(e));
    }
    assert_eq!(per_key, expected);
    let partitions: std::collections::BTreeSet<i32> = partition_of.values().copied().collect();
    assert!(
        partitions.len() > 1,
        "8 keys spread over partitions: {partitions:?}"
    );
}

#[tokio::test]
async fn relayed_changes_read_back_as_the_same_events_one_partition_per_key() {
    let cluster = cluster();
    let brokers = cluster.bootstrap_servers();
    let mut sink = sink(&brokers);
    sink.open(&Checkpoint::new()).await.unwrap();
    let events = changes();
    let report = sink.write(&batch(1, relayed(&events[..6]))).await.unwrap();
    assert_eq!(report.upserted, 6);
    let report = sink.write(&batch(2, relayed(&events[6..]))).await.unwrap();
    assert_eq!((report.upserted, report.deleted), (7, 1));
    sink.close().await.unwrap();
    let read = read(&brokers, TABLE_TOPIC, events.len() + 1);
    check_relayed(&read, &events);
}

#[tokio::test]
async fn documents_become_messages_and_tombstones_and_a_truncate_is_refused() {
    let cluster = cluster();
    let brokers = cluster.bootstrap_servers();
    let mut sink = sink(&brokers);
    sink.open(&Checkpoint::new()).await.unwrap();
    let doc = |key: &str, title: &str| {
        WriteOp::Document(DocumentOp::Upsert {
            collection: "books".into(),
            key: key.into(),
            doc: row(json!({"title": title})),
            position: position(1),
        })
    };
    let delete = WriteOp::Document(DocumentOp::Delete {
        collection: "books".into(),
        key: "b1".into(),
        position: position(2),
    });
    let ops = vec![doc("b1", "One"), doc("b2", "Two"), delete];
    sink.write(&batch(1, ops)).await.unwrap();
    let truncate = WriteOp::Document(DocumentOp::Truncate {
        collection: "books".into(),
        position: position(3),
    });
    let error = sink.write(&batch(2, vec![truncate])).await.unwrap_err();
    assert!(!error.is_retryable());
    assert!(
        error.to_string().contains("cannot empty a compacted topic"),
        "{error}"
    );
    sink.close().await.unwrap();

    let read = read(&brokers, DOCS_TOPIC, 3);
    let mut by_key: BTreeMap<String, Vec<Option<Value>>> = BTreeMap::new();
    for r in &read {
        let key = String::from_utf8(r.key.clone().unwrap()).unwrap();
        let value = r
            .value
            .as_deref()
            .map(|v| serde_json::from_slice(v).unwrap());
        by_key.entry(key).or_default().push(value);
    }
    assert_eq!(
        by_key,
        BTreeMap::from([
            ("b1".into(), vec![Some(json!({"title": "One"})), None]),
            ("b2".into(), vec![Some(json!({"title": "Two"}))]),
        ])
    );
}

#[tokio::test]
async fn brokers_down_fail_the_batch_retryably_and_the_retry_loses_nothing() {
    let cluster = cluster();
    let brokers = cluster.bootstrap_servers();
    let mut sink = sink(&brokers);
    sink.open(&Checkpoint::new()).await.unwrap();
    let events = changes();
    sink.write(&batch(1, relayed(&events[..4]))).await.unwrap();

    for broker in 1..=BROKERS {
        cluster.broker_down(broker).unwrap();
    }
    let down = batch(2, relayed(&events[4..]));
    let start = Instant::now();
    let error = sink.write(&down).await.unwrap_err();
    let took = start.elapsed();
    eprintln!("the batch failed after {took:?}: {error}");
    assert!(error.is_retryable(), "{error}");
    assert!(
        took < Duration::from_millis(DELIVERY_TIMEOUT_MS) + Duration::from_secs(3),
        "failed after {took:?}: {error}"
    );

    for broker in 1..=BROKERS {
        cluster.broker_up(broker).unwrap();
    }
    // The runtime retries with backoff while the brokers come back; so does the test, to a
    // deadline.
    let start = Instant::now();
    loop {
        match sink.write(&down).await {
            Ok(_) => break,
            Err(e) if e.is_retryable() && start.elapsed() < DEADLINE => {}
            Err(e) => panic!("the retry failed: {e}"),
        }
    }
    sink.close().await.unwrap();

    // Messages the brokers took before they went down may be there twice (at-least-once):
    // read everything there is and keep the last copy of each (source position, kind).
    let expected_min = events.len() + 1;
    let read = read_all(&brokers, TABLE_TOPIC, expected_min);
    let mut seen = std::collections::BTreeSet::new();
    for r in &read {
        match &r.value {
            Some(_) => {
                seen.insert(decode(r).source.lsn);
            }
            None => {
                seen.insert(None);
            }
        }
    }
    let mut want: std::collections::BTreeSet<Option<u64>> =
        events.iter().map(|e| e.source.lsn).collect();
    want.insert(None);
    assert_eq!(seen, want, "every change and the tombstone were delivered");
}

/// Reads every message `topic` holds (at least `count`).
fn read_all(brokers: &str, topic: &str, count: usize) -> Vec<Read> {
    let total = read_count(brokers, topic);
    assert!(
        total >= count,
        "the topic holds {total} messages, fewer than {count}"
    );
    read(brokers, topic, total)
}

/// How many messages `topic` holds, from its watermarks.
fn read_count(brokers: &str, topic: &str) -> usize {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    (0..PARTITIONS)
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            (high - low) as usize
        })
        .sum()
}
