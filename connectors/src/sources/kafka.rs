//! `kind = "kafka"`: Debezium change events read from Kafka topics by a consumer group.
//!
//! **Positions.** Each topic partition is a source partition named `{topic}/{partition}`; a
//! record's offset is its position. Offsets are never committed automatically: the group's
//! committed offset of a partition is set only from the runtime's durable checkpoint (every
//! sink made the record durable), so a crash, a rebalance or a broker outage never moves the
//! group past what the read models hold. On start and after every rebalance a partition resumes
//! from the group's committed offset.
//!
//! **Rebalances.** When partitions are revoked (a member joins, leaves or dies), the consumer
//! thread stops reading, hands what it read to the runtime, waits until the runtime reports
//! every record of the revoked partitions durable, commits them, and only then lets the group
//! give the partitions to another member. Records of one key therefore never reach two members
//! at once. If the sinks cannot make them durable within [`DRAIN_TIMEOUT`], the partitions are
//! released uncommitted and the next owner reads them again (at least once; the sinks' position
//! guard keeps the older write from winning).
//!
//! **Threads.** One thread polls the consumer and copies the messages into chunks; decoding
//! threads decode them, each partition's in the order read, send them to the runtime, and free
//! them once the runtime hands them back ([`decoding`]).
//! Both hand-offs are bounded channels (backpressure: a full channel stops the decoding, then
//! the polling, and librdkafka's own fetch queue is bounded). The rebalance callbacks run on
//! the polling thread; a revoke waits for what was handed to the decoding thread too.

mod avro;
mod consumer;
mod decode;
mod decoding;
pub mod metrics;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use refract_schemas::Checkpoint;
use refract_schemas::config::KafkaSourceConfig;
use tokio::sync::{mpsc, oneshot, watch};

use crate::{ReadMode, Source, SourceContext, SourceError, SourceItem};

use avro::avro_values;

/// Messages per chunk handed to the runtime: enough to amortize a channel hand-off, few enough
/// that a chunk of large values stays a few MiB.
const CHUNK_MESSAGES: usize = 2_048;
/// Chunks buffered between the consumer thread and the runtime.
const CHANNEL_CHUNKS: usize = 4;
/// How long one poll waits for a message before the thread looks at its other duties (commits,
/// stop requests, a partial chunk to hand over).
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long a rebalance waits for the revoked partitions' records to become durable before it
/// releases them uncommitted: well under the group's default `max.poll.interval.ms` (5 min),
/// long enough for a sink to ride out a short outage.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The Kafka source.
pub struct KafkaSource {
    config: KafkaSourceConfig,
    context: SourceContext,
    rx: Option<mpsc::Receiver<decoding::Chunk>>,
    /// Where each decoding thread takes its chunks back.
    recyclers: Vec<decoding::Recycler>,
    /// The decoding thread of the chunk handed out last.
    last_thread: usize,
    stop: Arc<AtomicBool>,
    progress: Arc<consumer::Progress>,
    /// Tells the consumer thread the run's last checkpoint is written: commit it and leave.
    finish: Option<oneshot::Sender<()>>,
    done: Option<oneshot::Receiver<()>>,
}

impl KafkaSource {
    /// A Kafka source for the pipeline `context.pipeline`.
    pub fn new(config: KafkaSourceConfig, context: SourceContext) -> Self {
        Self {
            config,
            context,
            rx: None,
            recyclers: Vec::new(),
            last_thread: 0,
            stop: Arc::default(),
            progress: Arc::default(),
            finish: None,
            done: None,
        }
    }
}

#[async_trait]
impl Source for KafkaSource {
    async fn start(
        &mut self,
        _checkpoint: &Checkpoint,
        mode: ReadMode,
        durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError> {
        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        let (finish_tx, finish_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let (thread, recyclers) = consumer::ConsumerThread::open(consumer::Setup {
            config: &self.config,
            pipeline: &self.context.pipeline,
            mode,
            tx,
            durable,
            stop: self.stop.clone(),
            handle: tokio::runtime::Handle::current(),
            progress: self.progress.clone(),
        })
        .await?;
        std::thread::Builder::new()
            .name("kafka-source".into())
            .spawn(move || {
                thread.run(finish_rx);
                let _ = done_tx.send(());
            })
            .map_err(|e| SourceError::Io {
                message: "cannot start the Kafka consumer thread".into(),
                source: Some(e),
            })?;
        self.rx = Some(rx);
        self.recyclers = recyclers;
        self.finish = Some(finish_tx);
        self.done = Some(done_rx);
        Ok(())
    }

    async fn next_chunk(&mut self) -> Result<Option<Vec<SourceItem>>, SourceError> {
        let Some(rx) = self.rx.as_mut() else {
            return Ok(None);
        };
        match rx.recv().await {
            Some(chunk) => {
                let decoded = chunk?;
                self.last_thread = decoded.thread;
                Ok(Some(decoded.items))
            }
            None => Ok(None),
        }
    }

    fn recycle(&mut self, items: Vec<SourceItem>) {
        // If the thread has ended (the stream is over), the send fails and the chunk is freed
        // here.
        if let Some(thread) = self.recyclers.get(self.last_thread) {
            let _ = thread.send(items);
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Records handed out of those the owned partitions held when they were assigned
    /// (`--until-caught-up` only).
    fn progress(&self) -> Option<(u64, u64)> {
        let total = self.progress.total.load(Ordering::Relaxed);
        (total > 0).then(|| (self.progress.done.load(Ordering::Relaxed).min(total), total))
    }

    async fn finish(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(finish) = self.finish.take() {
            let _ = finish.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        // The consumer thread leaves the group on its own once `finish` is gone.
        self.stop.store(true, Ordering::Relaxed);
    }
}
