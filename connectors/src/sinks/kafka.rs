//! `kind = "kafka"`: change events as Debezium envelopes on one topic per table, and documents
//! keyed for compacted topics (see [`messages`] for what each operation becomes).
//!
//! The producer is idempotent (`enable.idempotence=true`, `acks=all`): a message is durable once
//! every in-sync replica has it, and librdkafka's own retries neither duplicate nor reorder it.
//! The messages of a batch are handed to the producer in batch order; the default partitioner
//! sends one key to one partition, so the messages of a key stay in order. `write` returns once
//! every delivery report of the batch is in: only then may the runtime checkpoint past it.
//!
//! A failed delivery fails the batch, classified ([`errors`]): retryable for brokers down,
//! timeouts and elections (the runtime sends the whole batch again, so a consumer may see a
//! message twice, never miss one or see a key's messages end out of order), permanent for
//! authentication, authorization, an oversized message or a missing topic. After a failure the
//! producer is replaced, so no state of the failed one (an idempotence epoch, a fatal error)
//! carries over. Topics are created by the brokers (`auto.create.topics.enable`); the sink
//! creates none.

mod errors;
mod messages;

use std::collections::VecDeque;
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use refract_schemas::Checkpoint;
use refract_schemas::config::{KafkaCompression, KafkaSinkConfig};
use refract_schemas::write::OpFamily;

use crate::intake::TopicOp;
use crate::{Intake, Sink, SinkBatch, SinkError, WriteReport};
use errors::sink_error;
use messages::{Message, Topics, messages};

/// The longest wait between reconnection attempts to a broker, at most: librdkafka's default
/// (10 s) lets a message wait that long past its delivery timeout while brokers are down,
/// because the wait between attempts is where timeouts are noticed.
const MAX_RECONNECT_BACKOFF_MS: u64 = 10_000;

/// What the Kafka sink accepts: change events and documents.
type Accepted<'a> = TopicOp<'a>;

/// The Kafka sink.
pub struct KafkaSink {
    name: String,
    config: KafkaSinkConfig,
    producer: Option<FutureProducer>,
    topics: Topics,
    metrics: KafkaSinkMetrics,
}

/// Every metric the Kafka sink emits, made once per sink.
struct KafkaSinkMetrics {
    /// `refract_kafka_messages_total{sink}`: messages delivered (tombstones included).
    messages: metrics::Counter,
    /// `refract_kafka_bytes_total{sink}`: key and value bytes of the delivered messages.
    bytes: metrics::Counter,
    /// `refract_kafka_delivery_errors_total{sink}`: messages whose delivery failed (each is
    /// sent again with its batch).
    delivery_errors: metrics::Counter,
}

impl KafkaSinkMetrics {
    fn new(sink: &str) -> Self {
        let counter = |name: &'static str| metrics::counter!(name, "sink" => sink.to_owned());
        Self {
            messages: counter("refract_kafka_messages_total"),
            bytes: counter("refract_kafka_bytes_total"),
            delivery_errors: counter("refract_kafka_delivery_errors_total"),
        }
    }
}

/// The outcome of handing a batch's messages to the producer.
#[derive(Default)]
struct Deliveries {
    delivered: u64,
    bytes: u64,
    failed: u64,
    /// The first failure, kept to classify the batch's error.
    first_error: Option<KafkaError>,
}

impl Deliveries {
    fn fail(&mut self, error: KafkaError) {
        self.failed += 1;
        self.first_error.get_or_insert(error);
    }

    /// Records the delivery report of a message of `size` bytes.
    fn report(
        &mut self,
        size: u64,
        result: Result<
            rdkafka::producer::future_producer::OwnedDeliveryResult,
            futures::channel::oneshot::Canceled,
        >,
    ) {
        match result {
            Ok(Ok(_)) => {
                self.delivered += 1;
                self.bytes += size;
            }
            Ok(Err((error, _))) => self.fail(error),
            // The producer went away with the message: it may not be delivered.
            Err(_) => self.fail(KafkaError::Canceled),
        }
    }
}

impl KafkaSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A Kafka sink named `name` (not yet connected).
    pub fn new(name: &str, config: KafkaSinkConfig) -> Self {
        Self {
            name: name.to_owned(),
            topics: Topics::new(&config.topic_prefix, &config.documents_topic),
            config,
            producer: None,
            metrics: KafkaSinkMetrics::new(name),
        }
    }

    /// The producer's settings: the pass-through `properties` first, then what the delivery
    /// contract rests on (validation refuses properties that would override these).
    fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (key, value) in &self.config.properties {
            c.set(key, value.expose());
        }
        let compression = match self.config.compression {
            KafkaCompression::Lz4 => "lz4",
            KafkaCompression::None => "none",
        };
        if !self
            .config
            .properties
            .contains_key("reconnect.backoff.max.ms")
        {
            // A third of the delivery timeout: a batch fails soon after its timeout.
            let backoff =
                (self.config.delivery_timeout_ms / 3).clamp(100, MAX_RECONNECT_BACKOFF_MS);
            c.set("reconnect.backoff.max.ms", backoff.to_string());
        }
        c.set("bootstrap.servers", &self.config.brokers)
            .set("client.id", format!("refract-{}", self.name))
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("compression.type", compression)
            .set(
                "delivery.timeout.ms",
                self.config.delivery_timeout_ms.to_string(),
            );
        c
    }

    /// The producer, made afresh after a failure.
    fn producer(&mut self) -> Result<FutureProducer, SinkError> {
        if let Some(p) = &self.producer {
            return Ok(p.clone());
        }
        let producer: FutureProducer = self
            .client_config()
            .create()
            .map_err(|e| sink_error(&self.name, "cannot create the Kafka producer", e))?;
        self.producer = Some(producer.clone());
        Ok(producer)
    }

    /// Drops the producer on a blocking thread (dropping waits for librdkafka's threads).
    fn discard_producer(&mut self) {
        if let Some(p) = self.producer.take() {
            tokio::task::spawn_blocking(move || drop(p));
        }
    }

    /// Hands `messages` to `producer` in order and waits for every delivery report.
    async fn deliver(producer: &FutureProducer, messages: &[Message]) -> Deliveries {
        let mut done = Deliveries::default();
        let mut pending: VecDeque<(u64, DeliveryFuture)> = VecDeque::new();
        for m in messages {
            let size =
                (m.key.as_ref().map_or(0, Vec::len) + m.value.as_ref().map_or(0, Vec::len)) as u64;
            loop {
                let mut record = FutureRecord::<[u8], [u8]>::to(&m.topic);
                if let Some(key) = &m.key {
                    record = record.key(key.as_slice());
                }
                if let Some(value) = &m.value {
                    record = record.payload(value.as_slice());
                }
                match producer.send_result(record) {
                    Ok(delivery) => {
                        pending.push_back((size, delivery));
                        break;
                    }
                    // The producer's queue is full: wait for the oldest delivery to make room.
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                        if !pending.is_empty() =>
                    {
                        if let Some((size, delivery)) = pending.pop_front() {
                            done.report(size, delivery.await);
                        }
                    }
                    Err((error, _)) => {
                        done.fail(error);
                        break;
                    }
                }
            }
            if done.first_error.is_some() {
                // Later messages must not overtake the failed one: stop handing them over.
                break;
            }
        }
        for (size, delivery) in pending {
            done.report(size, delivery.await);
        }
        done
    }
}

#[async_trait]
impl Sink for KafkaSink {
    /// Creates the producer and asks the brokers for the cluster's metadata, so unreachable
    /// brokers (retryable) and refused credentials (permanent) show before the first batch.
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        let producer = self.producer()?;
        let timeout = Duration::from_millis(self.config.delivery_timeout_ms);
        let metadata = tokio::task::spawn_blocking(move || {
            producer.client().fetch_metadata(None, timeout).map(|_| ())
        })
        .await;
        let result = match metadata {
            Ok(result) => {
                result.map_err(|e| sink_error(&self.name, "cannot reach the Kafka brokers", e))
            }
            Err(e) => Err(SinkError::Transient {
                sink: self.name.clone(),
                message: format!("metadata request did not finish: {e}"),
                source: None,
            }),
        };
        if result.is_err() {
            self.discard_producer();
        }
        result
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let ops = batch.intake::<Accepted>(&self.name)?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let messages =
            messages(&mut self.topics, &ops, now_ms).map_err(|e| SinkError::Permanent {
                sink: self.name.clone(),
                message: e.0,
                source: None,
            })?;
        let producer = self.producer()?;
        let done = Self::deliver(&producer, &messages).await;
        self.metrics.messages.increment(done.delivered);
        self.metrics.bytes.increment(done.bytes);
        self.metrics.delivery_errors.increment(done.failed);
        if let Some(error) = done.first_error {
            drop(producer);
            self.discard_producer();
            let what = format!(
                "{} of {} messages were not delivered",
                messages.len() as u64 - done.delivered,
                messages.len()
            );
            return Err(sink_error(&self.name, &what, error));
        }
        let mut report = WriteReport::default();
        for m in &messages {
            if m.value.is_some() {
                report.upserted += 1;
            } else {
                report.deleted += 1;
            }
        }
        Ok(report)
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        if let Some(p) = self.producer.take() {
            // Every batch waited for its deliveries; flushing only drains what a cancelled
            // write left behind.
            let timeout = Duration::from_millis(self.config.delivery_timeout_ms);
            let _ = tokio::task::spawn_blocking(move || {
                let _ = p.flush(timeout);
                drop(p);
            })
            .await;
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests;
