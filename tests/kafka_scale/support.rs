//! Helpers of the Kafka scale tests: a deterministic generator of keyed Debezium change events
//! with an independent model of the read model, a background producer, the consumer group's
//! committed offsets and the topic's end offsets, the pipeline file, and the PostgreSQL target
//! table with a trigger that records any key going back to an older version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::topic_partition_list::TopicPartitionList;
use serde_json::{Value, json};

use crate::common::Rng;
use crate::common::pg::psql;

/// Partitions of the test topic: more than members, so the group spreads them.
pub const PARTITIONS: i32 = 6;
/// Timeout of one metadata request of the test (committed offsets, watermarks).
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// Messages produced between two flushes: the producer's pace is set per slice.
const SLICE: usize = 1_000;

/// One message: the record key and the value (`None`: a tombstone).
#[derive(Clone)]
pub struct Message {
    pub key: String,
    pub value: Option<String>,
}

/// Keyed Debezium change events over `keys` keys of `public.items`: creates, updates (the
/// row's `v` grows by one with every change of its key), deletes followed by a tombstone, and
/// re-creates. Generation can continue where it stopped.
pub struct Changes {
    rng: Rng,
    keys: u64,
    /// The version of each key's last change (kept across deletes, so a re-create is newer).
    version: BTreeMap<u64, u64>,
    /// The live rows: the model of the read model.
    live: BTreeMap<u64, Value>,
}

impl Changes {
    pub fn new(keys: u64, seed: u64) -> Self {
        Changes {
            rng: Rng::new(seed),
            keys,
            version: BTreeMap::new(),
            live: BTreeMap::new(),
        }
    }

    /// The next `n` change events (tombstones come on top).
    pub fn next(&mut self, n: usize) -> Vec<Message> {
        let mut out = Vec::with_capacity(n + n / 10);
        for _ in 0..n {
            let id = self.rng.below(self.keys);
            let v = self.version.get(&id).copied().unwrap_or(0) + 1;
            self.version.insert(id, v);
            let key = json!({ "id": id }).to_string();
            let before = self.live.get(&id).cloned();
            let source = json!({"connector": "postgresql", "schema": "public", "table": "items",
                                "ts_ms": 1_790_000_000_000u64 + v});
            let delete = before.is_some() && self.rng.below(100) < 8;
            if delete {
                self.live.remove(&id);
                let value = json!({"before": before, "after": null, "op": "d", "source": source});
                out.push(Message {
                    key: key.clone(),
                    value: Some(value.to_string()),
                });
                // Debezium's tombstone after a delete, for log compaction.
                out.push(Message { key, value: None });
                continue;
            }
            let after = json!({"id": id, "v": v, "name": format!("item {id} v{v}"),
                               "qty": self.rng.below(1_000)});
            let op = if before.is_some() { "u" } else { "c" };
            self.live.insert(id, after.clone());
            let value = json!({"before": before, "after": after, "op": op, "source": source});
            out.push(Message {
                key,
                value: Some(value.to_string()),
            });
        }
        out
    }

    /// The read model the events so far must leave: document id → document.
    pub fn model(&self) -> BTreeMap<String, Value> {
        self.live
            .iter()
            .map(|(id, doc)| (id.to_string(), doc.clone()))
            .collect()
    }
}

/// Messages produced in the background; `produced` counts those the cluster acknowledged.
pub struct Producing {
    pub produced: Arc<AtomicUsize>,
    pub total: usize,
    thread: JoinHandle<()>,
}

impl Producing {
    /// Produces `messages` to `topic` from a thread, in slices of [`SLICE`] with `pause`
    /// between them (the pace of the stream), in order: an idempotent producer keeps the order
    /// of each key through broker outages and retries.
    pub fn start(brokers: &str, topic: &str, messages: Vec<Message>, pause: Duration) -> Self {
        let produced = Arc::new(AtomicUsize::new(0));
        let total = messages.len();
        let counter = produced.clone();
        let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
        let thread = std::thread::spawn(move || {
            let producer: BaseProducer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("enable.idempotence", "true")
                .set("linger.ms", "5")
                .create()
                .expect("producer");
            for slice in messages.chunks(SLICE) {
                for m in slice {
                    let mut record = BaseRecord::<str, str>::to(&topic).key(m.key.as_str());
                    if let Some(v) = &m.value {
                        record = record.payload(v.as_str());
                    }
                    let mut record = Some(record);
                    while let Some(r) = record.take() {
                        if let Err((e, r)) = producer.send(r) {
                            // The local queue is full: serve deliveries, then try again.
                            assert!(
                                matches!(
                                    e.rdkafka_error_code(),
                                    Some(rdkafka::error::RDKafkaErrorCode::QueueFull)
                                ),
                                "produce failed: {e}"
                            );
                            producer.poll(Duration::from_millis(10));
                            record = Some(r);
                        }
                    }
                }
                producer
                    .flush(Duration::from_secs(120))
                    .expect("every message acknowledged");
                counter.fetch_add(slice.len(), Ordering::SeqCst);
                std::thread::sleep(pause);
            }
        });
        Producing {
            produced,
            total,
            thread,
        }
    }

    /// How many messages the cluster has acknowledged so far.
    pub fn produced(&self) -> usize {
        self.produced.load(Ordering::SeqCst)
    }

    /// Waits until every message is acknowledged.
    pub fn join(self) {
        self.thread.join().expect("the producer thread succeeds");
    }
}

/// Offsets per partition: `(committed, end)` as read by a client outside the group.
pub struct Offsets {
    consumer: BaseConsumer,
    topic: String,
}

impl Offsets {
    /// A client of `group` that joins nothing: it only reads the group's committed offsets.
    pub fn new(brokers: &str, group: &str, topic: &str) -> Self {
        let consumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        Offsets {
            consumer,
            topic: topic.to_owned(),
        }
    }

    /// The group's committed offset per partition (0 where it has none).
    pub fn committed(&self) -> Vec<i64> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(&self.topic, p);
        }
        let committed = self
            .consumer
            .committed_offsets(tpl, METADATA_TIMEOUT)
            .expect("committed offsets");
        (0..PARTITIONS)
            .map(|p| {
                committed
                    .find_partition(&self.topic, p)
                    .and_then(|e| e.offset().to_raw())
                    .filter(|o| *o >= 0)
                    .unwrap_or(0)
            })
            .collect()
    }

    /// The end (high watermark) of each partition.
    pub fn ends(&self) -> Vec<i64> {
        (0..PARTITIONS)
            .map(|p| {
                self.consumer
                    .fetch_watermarks(&self.topic, p, METADATA_TIMEOUT)
                    .expect("watermarks")
                    .1
            })
            .collect()
    }
}

/// A pipeline reading `topic` with group `group` into `{schema}.items`; its state directory
/// comes from `STATE_DIR`, so every process gets its own.
pub fn pipeline_file(dir: &Path, brokers: &str, topic: &str, group: &str, schema: &str) -> PathBuf {
    let text = format!(
        r#"[pipeline]
name = "kafka_scale"
state_dir = "${{STATE_DIR}}"
on_error = "stop"
[pipeline.batch]
max_events = 1000
max_delay_ms = 50
[source]
kind = "kafka"
brokers = "{brokers}"
topics = ["{topic}"]
group_id = "{group}"
[source.properties]
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
[projections.replica]
kind = "replica"
tables = ["items"]
sinks = ["pg"]
[sinks.pg]
kind = "postgres"
url = "{url}"
schema = "{schema}"
rows_per_statement = 500
"#,
        url = crate::common::pg::url(),
    );
    let path = dir.join("kafka.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Creates `{schema}.items` as the sink creates it, with a trigger that records into
/// `{schema}.regressions` every update to a lower `doc->>'v'`, and into
/// `{schema}.resurrections` every insert of a key whose highest version seen (kept in
/// `{schema}.max_v`) is higher; then checks that the trigger records what it must.
pub fn create_watched_table(schema: &str) {
    psql(&format!(
        r#"DROP SCHEMA IF EXISTS {schema} CASCADE;
        CREATE SCHEMA {schema};
        CREATE TABLE {schema}.items (id text PRIMARY KEY, doc jsonb NOT NULL,
            source_position text COLLATE "C" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
        CREATE TABLE {schema}.regressions (id text, old_v bigint, new_v bigint,
            old_position text, new_position text, at timestamptz DEFAULT clock_timestamp());
        CREATE TABLE {schema}.resurrections (id text, max_v bigint, new_v bigint,
            new_position text, at timestamptz DEFAULT clock_timestamp());
        CREATE TABLE {schema}.max_v (id text PRIMARY KEY, v bigint NOT NULL);
        CREATE FUNCTION {schema}.watch() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            nv bigint := (NEW.doc->>'v')::bigint;
        BEGIN
            IF TG_OP = 'UPDATE' AND nv < (OLD.doc->>'v')::bigint THEN
                INSERT INTO {schema}.regressions (id, old_v, new_v, old_position, new_position)
                VALUES (NEW.id, (OLD.doc->>'v')::bigint, nv, OLD.source_position, NEW.source_position);
            END IF;
            IF TG_OP = 'INSERT' THEN
                INSERT INTO {schema}.resurrections (id, max_v, new_v, new_position)
                SELECT NEW.id, m.v, nv, NEW.source_position FROM {schema}.max_v m
                WHERE m.id = NEW.id AND m.v > nv;
            END IF;
            INSERT INTO {schema}.max_v VALUES (NEW.id, nv)
            ON CONFLICT (id) DO UPDATE SET v = greatest({schema}.max_v.v, EXCLUDED.v);
            RETURN NEW;
        END $$;
        CREATE TRIGGER watch AFTER INSERT OR UPDATE ON {schema}.items
            FOR EACH ROW EXECUTE FUNCTION {schema}.watch();"#
    ));
    // The check can fail: an update to an older version and a re-insert of one are recorded.
    let seen = psql(&format!(
        r#"INSERT INTO {schema}.items (id, doc, source_position) VALUES ('probe', '{{"v": 5}}', 'a');
        UPDATE {schema}.items SET doc = '{{"v": 3}}' WHERE id = 'probe';
        DELETE FROM {schema}.items WHERE id = 'probe';
        INSERT INTO {schema}.items (id, doc, source_position) VALUES ('probe', '{{"v": 4}}', 'a');
        SELECT (SELECT count(*) FROM {schema}.regressions) || ',' || (SELECT count(*) FROM {schema}.resurrections);"#
    ));
    assert_eq!(seen, "1,1", "the watch trigger records regressions");
    psql(&format!(
        "DELETE FROM {schema}.items; TRUNCATE {schema}.regressions, {schema}.resurrections, {schema}.max_v;"
    ));
}

/// The documents of `{schema}.items`: id → document.
pub fn documents(schema: &str) -> BTreeMap<String, Value> {
    let json = psql(&format!(
        "SELECT coalesce(json_object_agg(id, doc), '{{}}') FROM {schema}.items"
    ));
    let map: serde_json::Map<String, Value> = serde_json::from_str(&json).unwrap();
    map.into_iter().collect()
}

/// How `actual` differs from `expected`, the first few differences named.
pub fn differences(expected: &BTreeMap<String, Value>, actual: &BTreeMap<String, Value>) -> String {
    let missing = expected.keys().filter(|k| !actual.contains_key(*k)).count();
    let extra: Vec<_> = actual
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .collect();
    let differing: Vec<_> = expected
        .iter()
        .filter(|(k, v)| actual.get(*k).is_some_and(|a| a != *v))
        .collect();
    format!(
        "{} expected, {} present: {missing} missing, {} extra (e.g. {:?}), {} differing (e.g. {:?})",
        expected.len(),
        actual.len(),
        extra.len(),
        extra.iter().take(3).collect::<Vec<_>>(),
        differing.len(),
        differing.iter().take(2).collect::<Vec<_>>(),
    )
}

/// Waits until `done` holds, polling; fails with `what()` after `limit`.
pub fn wait_for(limit: Duration, mut done: impl FnMut() -> bool, what: impl Fn() -> String) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "not within {limit:?}: {}",
            what()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
