//! A Kafka-protocol broker for end-to-end tests (librdkafka's in-process mock cluster, reached by
//! the `refract` processes over loopback), a producer of keyed messages and a reader of a group's
//! committed offsets.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};
use rdkafka::topic_partition_list::TopicPartitionList;

/// The mock cluster: 3 brokers, as the issue asks.
pub type Cluster = MockCluster<'static, DefaultProducerContext>;

/// Starts a cluster of three brokers holding `topics` of `partitions` partitions each.
pub fn cluster(topics: &[&str], partitions: i32) -> Cluster {
    let cluster = MockCluster::new(3).expect("mock Kafka cluster starts");
    for t in topics {
        cluster
            .create_topic(t, partitions, 3)
            .expect("topic created");
    }
    cluster
}

/// A message: key and value bytes, either of which may be null (a tombstone has no value).
pub type Message = (Option<Vec<u8>>, Option<Vec<u8>>);

/// Produces `messages` to `topic` in order (Kafka's default partitioner puts one key in one
/// partition) and waits until every one is acknowledged.
pub fn produce(brokers: &str, topic: &str, messages: &[Message]) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .create()
        .expect("producer");
    for (key, value) in messages {
        let mut record = BaseRecord::<[u8], [u8]>::to(topic);
        if let Some(k) = key {
            record = record.key(k.as_slice());
        }
        if let Some(v) = value {
            record = record.payload(v.as_slice());
        }
        let mut record = record;
        loop {
            match producer.send(record) {
                Ok(()) => break,
                // The local queue is full: serve delivery reports and try again.
                Err((_, r)) => {
                    producer.poll(Duration::from_millis(10));
                    record = r;
                }
            }
        }
    }
    producer
        .flush(Duration::from_secs(60))
        .expect("every message acknowledged");
}

/// The offsets `group` committed for `topic`'s partitions, by partition.
pub fn committed(brokers: &str, group: &str, topic: &str, partitions: i32) -> BTreeMap<i32, i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets")
        .elements()
        .iter()
        .filter_map(|e| Some((e.partition(), e.offset().to_raw().filter(|o| *o >= 0)?)))
        .collect()
}
