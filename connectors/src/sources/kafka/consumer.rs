//! The consumer thread: polls the group's consumer, hands chunks of raw messages to the
//! decoding thread ([`super::decoding`]), commits what the runtime reports durable, and drains
//! revoked partitions in the rebalance callback (see the module documentation of [`super`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use rdkafka::topic_partition_list::{Offset as KafkaOffset, TopicPartitionList};
use refract_schemas::Checkpoint;
use refract_schemas::config::{KafkaFormat, KafkaSourceConfig, KafkaStart};
use tokio::sync::{mpsc, oneshot, watch};

use super::decode::{JsonValues, MessageDecoder};
use super::decoding::{self, Chunk, RawBatch, RawChunk, Recycler};
use super::metrics;
use super::{CHUNK_MESSAGES, DRAIN_TIMEOUT, POLL_INTERVAL};
use crate::{ReadMode, SourceError};

/// Timeout of the metadata requests made in callbacks (watermarks, committed offsets).
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// What the consumer thread is built from.
pub(super) struct Setup<'a> {
    pub config: &'a KafkaSourceConfig,
    pub pipeline: &'a str,
    pub mode: ReadMode,
    pub tx: mpsc::Sender<Chunk>,
    pub durable: watch::Receiver<Checkpoint>,
    pub stop: Arc<AtomicBool>,
    pub handle: tokio::runtime::Handle,
    pub progress: Arc<Progress>,
}

/// A partition this member owns, and what it handed to the runtime since it got it.
struct Owned {
    topic: String,
    partition: i32,
    /// First and last offset handed out since the assignment.
    handed: Option<(i64, i64)>,
    /// The offset committed last (the next offset to read).
    committed: Option<i64>,
    /// `--until-caught-up`: the end of the partition when it was assigned.
    end: Option<i64>,
}

/// State shared by the polling loop and the rebalance callbacks (both on the consumer thread;
/// the mutex only satisfies the context's `Sync` bound).
struct Tracker {
    /// The decoding threads' inputs, one per thread (see [`decoding`]); empty once the stream
    /// has ended.
    tx: Vec<SyncSender<RawBatch>>,
    /// The messages read and not yet handed over, one chunk per decoding thread.
    pending: Vec<RawChunk>,
    /// The first and last offset of each partition among `pending`.
    pending_range: HashMap<Arc<str>, (i64, i64)>,
    owned: HashMap<Arc<str>, Owned>,
}

/// The consumer's context: the rebalance callbacks.
pub(super) struct Context {
    tracker: Mutex<Tracker>,
    durable: Mutex<watch::Receiver<Checkpoint>>,
    handle: tokio::runtime::Handle,
    /// Set once the run's last checkpoint is written: nothing more will become durable.
    closing: AtomicBool,
    until_caught_up: bool,
    /// `--until-caught-up`: records handed out, and to read, in the owned partitions.
    progress: Arc<Progress>,
}

/// Progress of an `--until-caught-up` run, read by [`super::KafkaSource::progress`].
#[derive(Default)]
pub(super) struct Progress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

impl ClientContext for Context {
    fn stats(&self, statistics: rdkafka::statistics::Statistics) {
        metrics::record_statistics(&statistics);
    }
}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let names: Vec<Arc<str>> = tpl
                .elements()
                .iter()
                .map(|e| partition_name(e.topic(), e.partition()))
                .collect();
            self.drain(consumer, &names);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => self.assigned(consumer, tpl),
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "kafka rebalance failed"),
        }
    }
}

impl Context {
    fn tracker(&self) -> MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands over what was read, waits (up to [`DRAIN_TIMEOUT`]) until the runtime reports it
    /// durable, commits it, and forgets the partitions.
    fn drain(&self, consumer: &BaseConsumer<Self>, names: &[Arc<str>]) {
        self.hand_over();
        let targets: Vec<(Arc<str>, i64)> = {
            let tracker = self.tracker();
            names
                .iter()
                .filter_map(|n| Some((n.clone(), tracker.owned.get(n)?.handed?.1)))
                .collect()
        };
        if !self.closing.load(Ordering::Relaxed) && !targets.is_empty() {
            let durable = self.wait_durable(&targets);
            if !durable {
                tracing::warn!(
                    partitions = ?names,
                    "revoked partitions released before the sinks made them durable; the next owner reads them again"
                );
            }
        }
        let checkpoint = self.durable().borrow().clone();
        self.commit(consumer, &checkpoint, Some(names), CommitMode::Sync);
        let mut tracker = self.tracker();
        for n in names {
            tracker.owned.remove(n);
        }
        metrics::rebalance("revoke", names.len());
        tracing::info!(partitions = ?names, "kafka partitions released");
    }

    fn durable(&self) -> MutexGuard<'_, watch::Receiver<Checkpoint>> {
        self.durable.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the durable checkpoint reaches every target; false on timeout, or when the
    /// run ended before.
    fn wait_durable(&self, targets: &[(Arc<str>, i64)]) -> bool {
        let mut rx = self.durable().clone();
        let reached = |cp: &Checkpoint| {
            targets
                .iter()
                .all(|(n, last)| cp.get(&**n).is_some_and(|o| o.0 as i64 >= *last))
        };
        self.handle.block_on(async {
            tokio::time::timeout(DRAIN_TIMEOUT, async {
                loop {
                    if reached(&rx.borrow_and_update()) {
                        return true;
                    }
                    if rx.changed().await.is_err() {
                        return false;
                    }
                }
            })
            .await
            .unwrap_or(false)
        })
    }

    /// Commits, for the owned partitions (of `only`, when given), the offset after the durable
    /// checkpoint's, when it covers something handed out since the assignment and is new.
    fn commit(
        &self,
        consumer: &BaseConsumer<Self>,
        checkpoint: &Checkpoint,
        only: Option<&[Arc<str>]>,
        mode: CommitMode,
    ) {
        let mut tpl = TopicPartitionList::new();
        let mut tracker = self.tracker();
        for (name, owned) in tracker.owned.iter_mut() {
            if only.is_some_and(|o| !o.contains(name)) {
                continue;
            }
            let (Some((first, _)), Some(done)) = (owned.handed, checkpoint.get(&**name)) else {
                continue;
            };
            let next = done.0 as i64 + 1;
            // A checkpoint entry older than this assignment is another ownership's: committing
            // it would move the group back.
            if next <= first || owned.committed.is_some_and(|c| c >= next) {
                continue;
            }
            if tpl
                .add_partition_offset(&owned.topic, owned.partition, KafkaOffset::Offset(next))
                .is_ok()
            {
                owned.committed = Some(next);
            }
        }
        drop(tracker);
        if tpl.count() == 0 {
            return;
        }
        if let Err(e) = consumer.commit(&tpl, mode) {
            // The offsets are committed again with the next checkpoint; until then a restart
            // reads a little more again.
            tracing::warn!(error = %e, "kafka offset commit failed");
            metrics::commit_failed();
            let mut tracker = self.tracker();
            for e in tpl.elements() {
                if let Some(o) = tracker
                    .owned
                    .get_mut(&*partition_name(e.topic(), e.partition()))
                {
                    o.committed = None;
                }
            }
        }
    }

    /// Records a new assignment; for `--until-caught-up`, where each partition ends now.
    fn assigned(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        let committed = if self.until_caught_up {
            consumer
                .committed_offsets(tpl.clone(), METADATA_TIMEOUT)
                .ok()
        } else {
            None
        };
        let mut owned = Vec::new();
        for e in tpl.elements() {
            let mut end = None;
            if self.until_caught_up {
                let (low, high) = consumer
                    .fetch_watermarks(e.topic(), e.partition(), METADATA_TIMEOUT)
                    .unwrap_or((0, i64::MAX));
                // Without a committed offset (a negative sentinel) reading starts at the low
                // watermark (`earliest`) or at the end (`latest`).
                let start = committed
                    .as_ref()
                    .and_then(|c| c.find_partition(e.topic(), e.partition()))
                    .and_then(|p| p.offset().to_raw())
                    .filter(|o| *o >= 0)
                    .unwrap_or(low);
                end = Some(if start >= high { -1 } else { high });
                self.progress
                    .total
                    .fetch_add(high.saturating_sub(start).max(0) as u64, Ordering::Relaxed);
            }
            owned.push((
                partition_name(e.topic(), e.partition()),
                Owned {
                    topic: e.topic().to_owned(),
                    partition: e.partition(),
                    handed: None,
                    committed: None,
                    end,
                },
            ));
        }
        tracing::info!(partitions = ?owned.iter().map(|(n, _)| n).collect::<Vec<_>>(), "kafka partitions assigned");
        metrics::rebalance("assign", owned.len());
        self.tracker().owned.extend(owned);
    }

    /// Sends the messages read so far to the decoding thread, and so to the runtime (blocking
    /// while its queue is full).
    fn hand_over(&self) {
        let (chunks, ranges, tx) = {
            let mut tracker = self.tracker();
            if tracker.pending.iter().all(RawChunk::is_empty) {
                return;
            }
            let chunks: Vec<RawChunk> = tracker
                .pending
                .iter_mut()
                .map(|pending| {
                    // The next chunk is likely as large as this one.
                    let capacity = pending.bytes();
                    std::mem::replace(pending, RawChunk::with_capacity(capacity))
                })
                .collect();
            let read: usize = chunks.iter().map(RawChunk::len).sum();
            self.progress.done.fetch_add(read as u64, Ordering::Relaxed);
            let ranges = std::mem::take(&mut tracker.pending_range);
            (chunks, ranges, tracker.tx.clone())
        };
        if tx.is_empty() {
            return;
        }
        for (chunk, tx) in chunks.into_iter().zip(&tx) {
            if !chunk.is_empty() && tx.send(Ok(chunk)).is_err() {
                return;
            }
        }
        let mut tracker = self.tracker();
        for (name, (first, last)) in ranges {
            if let Some(owned) = tracker.owned.get_mut(&name) {
                let first = owned.handed.map_or(first, |(f, _)| f);
                owned.handed = Some((first, last));
            }
        }
    }
}

/// The source partition of a topic partition.
pub(super) fn partition_name(topic: &str, partition: i32) -> Arc<str> {
    format!("{topic}/{partition}").into()
}

/// A source partition's name and the decoding thread it is decoded on.
type PartitionName = (Arc<str>, usize);

/// A topic's name, and its partitions' names by number.
type TopicNames = (Arc<str>, HashMap<i32, PartitionName>);

/// The topic names and [`partition_name`]s of the messages read, each made once, and the
/// decoding thread of each partition: given in turn as partitions are first read, and kept.
struct Names {
    /// By topic.
    topics: HashMap<Box<str>, TopicNames>,
    /// The partition looked up last: consecutive messages are mostly of one partition (a
    /// fetched batch), which then costs no hashing.
    last: Option<(Arc<str>, i32, PartitionName)>,
    threads: usize,
    /// Partitions seen.
    seen: usize,
}

impl Names {
    fn new(threads: usize) -> Self {
        Self {
            topics: HashMap::new(),
            last: None,
            threads,
            seen: 0,
        }
    }

    /// The topic's name, the source partition's name and its decoding thread.
    fn get(&mut self, topic: &str, partition: i32) -> (Arc<str>, Arc<str>, usize) {
        if let Some((t, p, (n, thread))) = &self.last
            && *p == partition
            && **t == *topic
        {
            return (t.clone(), n.clone(), *thread);
        }
        if !self.topics.contains_key(topic) {
            self.topics
                .insert(topic.into(), (topic.into(), HashMap::new()));
        }
        let (t, partitions) = self
            .topics
            .get_mut(topic)
            .expect("the topic was just inserted");
        let (n, thread) = partitions
            .entry(partition)
            .or_insert_with(|| {
                self.seen += 1;
                (partition_name(topic, partition), self.seen % self.threads)
            })
            .clone();
        let t = t.clone();
        self.last = Some((t.clone(), partition, (n.clone(), thread)));
        (t, n, thread)
    }
}

/// The thread that owns the consumer.
pub(super) struct ConsumerThread {
    consumer: BaseConsumer<Context>,
    mode: ReadMode,
    stop: Arc<AtomicBool>,
    names: Names,
}

impl ConsumerThread {
    /// Creates the consumer and joins the group; starts the decoding threads, and returns where
    /// each takes its decoded chunks back.
    pub(super) async fn open(setup: Setup<'_>) -> Result<(Self, Vec<Recycler>), SourceError> {
        let config = setup.config;
        let threads = decoding::threads();
        let mut tx = Vec::with_capacity(threads);
        let mut recyclers = Vec::with_capacity(threads);
        for thread in 0..threads {
            let decoder = match config.format {
                KafkaFormat::DebeziumJson => MessageDecoder::new(Box::new(JsonValues::default())),
                KafkaFormat::DebeziumAvro => MessageDecoder::new(super::avro_values(
                    config,
                    setup.handle.clone(),
                    setup.stop.clone(),
                )?),
            };
            let inputs = decoding::spawn(thread, decoder, setup.tx.clone())?;
            tx.push(inputs.raw);
            recyclers.push(inputs.recycler);
        }
        let context = Context {
            tracker: Mutex::new(Tracker {
                tx,
                pending: (0..threads).map(|_| RawChunk::default()).collect(),
                pending_range: HashMap::new(),
                owned: HashMap::new(),
            }),
            durable: Mutex::new(setup.durable),
            handle: setup.handle,
            closing: AtomicBool::new(false),
            until_caught_up: setup.mode == ReadMode::UntilCaughtUp,
            progress: setup.progress,
        };
        let consumer: BaseConsumer<Context> = client_config(config, setup.pipeline)
            .create_with_context(context)
            .map_err(|e| io(format!("cannot create the Kafka consumer: {e}")))?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| io(format!("cannot subscribe to {topics:?}: {e}")))?;
        let thread = Self {
            consumer,
            mode: setup.mode,
            stop: setup.stop,
            names: Names::new(threads),
        };
        Ok((thread, recyclers))
    }

    /// Reads until stopped (or caught up), then waits for the run's last checkpoint, commits it
    /// and leaves the group.
    pub(super) fn run(mut self, finish: oneshot::Receiver<()>) {
        let mut durable = self.context().durable().clone();
        let outcome = self.read(&mut durable);
        let context = self.context();
        context.hand_over();
        if let Err(e) = outcome
            && let Some(tx) = context.tracker().tx.first().cloned()
        {
            let _ = tx.send(Err(e));
        }
        // The decoding threads pass on what they were handed and end; the runtime sees the end
        // of the stream, drains and writes its last checkpoint.
        context.tracker().tx.clear();
        let _ = finish.blocking_recv();
        context.closing.store(true, Ordering::Relaxed);
        let checkpoint = durable.borrow().clone();
        context.commit(&self.consumer, &checkpoint, None, CommitMode::Sync);
        self.consumer.unsubscribe();
        // Dropping the consumer leaves the group (the revoke callback commits nothing new).
    }

    fn context(&self) -> &Context {
        self.consumer.context()
    }

    /// The polling loop.
    fn read(&mut self, durable: &mut watch::Receiver<Checkpoint>) -> Result<(), SourceError> {
        while !self.stop.load(Ordering::Relaxed) {
            if durable.has_changed().unwrap_or(false) {
                let checkpoint = durable.borrow_and_update().clone();
                self.context()
                    .commit(&self.consumer, &checkpoint, None, CommitMode::Async);
            }
            match self.consumer.poll(POLL_INTERVAL) {
                Some(Ok(message)) => {
                    let (topic, name, thread) =
                        self.names.get(message.topic(), message.partition());
                    let offset = message.offset();
                    let full = {
                        let mut tracker = self.context().tracker();
                        tracker.pending[thread].push(
                            &topic,
                            &name,
                            offset,
                            message.key(),
                            message.payload(),
                        );
                        tracker
                            .pending_range
                            .entry(name)
                            .and_modify(|r| r.1 = offset)
                            .or_insert((offset, offset));
                        tracker.pending[thread].len() >= CHUNK_MESSAGES
                    };
                    if full {
                        self.context().hand_over();
                    }
                }
                Some(Err(e)) => consumer_error(e)?,
                None => {
                    self.context().hand_over();
                    if self.mode == ReadMode::UntilCaughtUp && self.caught_up() {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    /// Every owned partition was read to where it ended when it was assigned.
    fn caught_up(&self) -> bool {
        let tracker = self.context().tracker();
        !tracker.owned.is_empty()
            && tracker.owned.values().all(|o| match (o.end, o.handed) {
                (Some(end), _) if end < 0 => true,
                (Some(end), Some((_, last))) => last + 1 >= end,
                _ => false,
            })
    }
}

/// A consumer error: transient ones (a broker down, a partition without leader) are logged and
/// librdkafka retries; authorization and fatal errors end the run.
fn consumer_error(e: KafkaError) -> Result<(), SourceError> {
    let code = e.rdkafka_error_code();
    match code {
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::GroupAuthorizationFailed
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::Fatal,
        ) => Err(io(format!("Kafka consumer: {e}"))),
        _ => {
            tracing::warn!(error = %e, "kafka consumer error (retrying)");
            Ok(())
        }
    }
}

fn io(message: String) -> SourceError {
    SourceError::Io {
        message,
        source: None,
    }
}

/// librdkafka's `fetch.queue.backoff.ms` unless `properties` sets it: how long a partition's
/// fetching pauses once the local fetch queue is full. librdkafka's default (1,000 ms) leaves a
/// consumer that decodes slower than it fetches idle most of each second once its queue has
/// filled (benches/kafka_consume.sh, 1M Debezium JSON events: 124k events/s at the default,
/// 360k at 10 ms); the queue stays bounded by librdkafka's `queued.max.messages.kbytes`.
const FETCH_QUEUE_BACKOFF_MS: &str = "10";

/// The consumer's settings: refract's defaults, the pass-through properties, then the ones
/// refract's guarantees rest on (`validate` refuses them in `properties`).
fn client_config(config: &KafkaSourceConfig, pipeline: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
        .set("statistics.interval.ms", metrics::STATISTICS_INTERVAL_MS);
    for (k, v) in &config.properties {
        c.set(k, v.expose());
    }
    c.set("bootstrap.servers", &config.brokers)
        .set("group.id", config.group(pipeline))
        .set("client.id", format!("refract-{pipeline}"))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        .set(
            "auto.offset.reset",
            match config.start {
                KafkaStart::Earliest => "earliest",
                KafkaStart::Latest => "latest",
            },
        );
    c
}

#[cfg(test)]
mod config_tests {
    use std::collections::BTreeMap;

    use refract_schemas::config::{KafkaFormat, KafkaSourceConfig, KafkaStart};

    use super::{FETCH_QUEUE_BACKOFF_MS, client_config};

    fn config(properties: &[(&str, &str)]) -> KafkaSourceConfig {
        KafkaSourceConfig {
            brokers: "127.0.0.1:9092".into(),
            topics: vec!["t".into()],
            group_id: None,
            format: KafkaFormat::DebeziumJson,
            schema_registry: None,
            start: KafkaStart::Earliest,
            properties: properties
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string().into()))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn the_fetch_queue_backoff_is_short_unless_the_pipeline_sets_it() {
        let default = client_config(&config(&[]), "p");
        assert_eq!(
            default.get("fetch.queue.backoff.ms"),
            Some(FETCH_QUEUE_BACKOFF_MS)
        );
        let set = client_config(&config(&[("fetch.queue.backoff.ms", "250")]), "p");
        assert_eq!(set.get("fetch.queue.backoff.ms"), Some("250"));
    }
}
