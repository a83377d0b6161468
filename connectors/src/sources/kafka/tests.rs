//! The Kafka source against librdkafka's in-process mock cluster (the real Kafka protocol on
//! loopback): partitions, positions, offset commits that follow the durable checkpoint,
//! tombstones and bad input.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::topic_partition_list::TopicPartitionList;
use refract_schemas::config::{KafkaFormat, KafkaSourceConfig, KafkaStart};
use refract_schemas::{Checkpoint, Offset, Op, Record};
use tokio::sync::watch;

use super::KafkaSource;
use crate::{ReadMode, Source, SourceContext, SourceItem};

const TOPIC: &str = "dbserver.public.products";
const PARTITIONS: i32 = 6;

fn cluster() -> MockCluster<'static, rdkafka::producer::DefaultProducerContext> {
    let cluster = MockCluster::new(3).expect("mock cluster");
    cluster
        .create_topic(TOPIC, PARTITIONS, 3)
        .expect("topic created");
    cluster
}

fn envelope(id: u64, name: &str) -> String {
    format!(
        r#"{{"before":null,"after":{{"id":{id},"name":"{name}"}},"op":"c","source":{{"schema":"public","table":"products","ts_ms":1}}}}"#
    )
}

fn delete(id: u64) -> String {
    format!(
        r#"{{"before":{{"id":{id}}},"after":null,"op":"d","source":{{"schema":"public","table":"products"}}}}"#
    )
}

/// Produces `(key, value)` messages, keyed so one key always lands in one partition.
fn produce(brokers: &str, messages: &[(String, Option<String>)]) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("producer");
    for (key, value) in messages {
        let mut record = BaseRecord::<str, str>::to(TOPIC).key(key.as_str());
        if let Some(v) = value {
            record = record.payload(v.as_str());
        }
        producer.send(record).map_err(|(e, _)| e).expect("queued");
    }
    producer.flush(Duration::from_secs(10)).expect("flushed");
}

fn config(brokers: &str, group: &str) -> KafkaSourceConfig {
    KafkaSourceConfig {
        brokers: brokers.into(),
        topics: vec![TOPIC.into()],
        group_id: Some(group.into()),
        format: KafkaFormat::DebeziumJson,
        schema_registry: None,
        start: KafkaStart::Earliest,
        properties: BTreeMap::new(),
    }
}

/// Reads until the source is caught up; returns the items and keeps the source for `finish`.
async fn read_all(
    brokers: &str,
    group: &str,
    durable: watch::Receiver<Checkpoint>,
) -> (KafkaSource, Vec<SourceItem>) {
    let mut source = KafkaSource::new(config(brokers, group), SourceContext::default());
    source
        .start(&Checkpoint::new(), ReadMode::UntilCaughtUp, durable)
        .await
        .expect("started");
    let mut items = Vec::new();
    let read = async {
        while let Some(chunk) = source.next_chunk().await.expect("chunk") {
            items.extend(chunk);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("caught up within a minute");
    (source, items)
}

/// The group's committed offsets, as a member that joins nothing sees them.
fn committed(brokers: &str, group: &str) -> BTreeMap<String, i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(TOPIC, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    committed
        .elements()
        .iter()
        .filter_map(|e| Some((format!("{TOPIC}/{}", e.partition()), e.offset().to_raw()?)))
        .filter(|(_, o)| *o >= 0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_partition_is_read_in_order_and_only_durable_offsets_are_committed() {
    let cluster = cluster();
    let brokers = cluster.bootstrap_servers();
    let messages: Vec<_> = (0..600)
        .map(|i| {
            (
                format!(r#"{{"id":{}}}"#, i % 50),
                Some(envelope(i % 50, &format!("v{i}"))),
            )
        })
        .collect();
    produce(&brokers, &messages);

    let (durable_tx, durable_rx) = watch::channel(Checkpoint::new());
    let (mut source, items) = read_all(&brokers, "g1", durable_rx).await;
    assert_eq!(items.len(), 600);
    let mut home: BTreeMap<u64, String> = BTreeMap::new();
    let mut newest: BTreeMap<String, Offset> = BTreeMap::new();
    for item in &items {
        let Ok(Record::Change(e)) = &item.record else {
            panic!("not a change: {:?}", item.record);
        };
        let partition = e.position.partition.to_string();
        let key = e.key.as_ref().expect("the record key is the event's key");
        let id = key["id"].as_u64().expect("id");
        // A key lives in one partition, and a partition is read in offset order.
        let first = home.entry(id).or_insert_with(|| partition.clone());
        assert_eq!(*first, partition, "key {id} stays in one partition");
        if let Some(o) = newest.get(&partition) {
            assert!(e.position.offset > *o, "offsets go forward in {partition}");
        }
        newest.insert(partition, e.position.offset);
    }
    assert_eq!(
        newest.len(),
        PARTITIONS as usize,
        "every partition was read"
    );
    assert!(
        committed(&brokers, "g1").is_empty(),
        "nothing committed before it is durable"
    );

    // Two partitions durable up to their middle, the others not at all.
    let mut durable = Checkpoint::new();
    for (partition, end) in newest.iter().take(2) {
        durable.insert(partition.clone(), Offset(end.0 / 2, 0));
    }
    durable_tx.send(durable.clone()).expect("runtime alive");
    source.finish().await;
    let expected: BTreeMap<String, i64> = durable
        .iter()
        .map(|(p, o)| (p.clone(), o.0 as i64 + 1))
        .collect();
    assert_eq!(committed(&brokers, "g1"), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tombstone_after_its_delete_is_acknowledged_and_a_lone_one_deletes_its_key() {
    let cluster = cluster();
    let brokers = cluster.bootstrap_servers();
    let key = |id: u64| format!(r#"{{"id":{id}}}"#);
    produce(
        &brokers,
        &[
            (key(1), Some(envelope(1, "a"))),
            (key(1), Some(delete(1))),
            (key(1), None),
            // Compaction took the delete of key 2 away: only its tombstone is left.
            (key(2), None),
            ("not json".into(), Some("not a debezium record".into())),
        ],
    );
    let (_tx, rx) = watch::channel(Checkpoint::new());
    let (mut source, items) = read_all(&brokers, "g2", rx).await;
    source.finish().await;
    let records: Vec<_> = items.iter().map(|i| &i.record).collect();
    let ops: Vec<String> = records
        .iter()
        .map(|r| match r {
            Ok(Record::Change(e)) => format!("{}:{}", e.op.code(), e.key.as_ref().unwrap()["id"]),
            Ok(Record::Tombstone(_)) => "tombstone".into(),
            Ok(other) => format!("{other:?}"),
            Err(e) => format!("error:{}", e.position),
        })
        .collect();
    assert!(
        ops.windows(3).any(|w| w == ["c:1", "d:1", "tombstone"]),
        "delete then its tombstone: {ops:?}"
    );
    let lone = records
        .iter()
        .find_map(|r| match r {
            Ok(Record::Change(e)) if e.op == Op::Delete && e.key.as_ref().unwrap()["id"] == 2 => {
                Some(e)
            }
            _ => None,
        })
        .expect("the lone tombstone deletes key 2");
    assert_eq!(lone.table.to_string(), "public.products");
    assert!(lone.before.is_some(), "the key is the before image");
    let bad = items
        .iter()
        .find(|i| i.record.is_err())
        .expect("the bad record is reported");
    let error = bad.record.as_ref().unwrap_err();
    assert!(
        error.position.partition.starts_with(&format!("{TOPIC}/")),
        "{error}"
    );
    assert_eq!(&bad.raw[..], b"not a debezium record");
}
