//! The decoding threads: the consumer thread copies each message it polls into a [`RawChunk`]
//! and hands full chunks here, where they are decoded, in the order handed, and sent on to the
//! runtime. Polling and decoding so run on several cores at once (decoding was about half of
//! the consumer thread's time, and then the one busy thread, benches/kafka_consume.sh).
//!
//! Each partition is decoded on one thread, which decodes its chunks one after the other: the
//! order of a partition's messages, and so of each key, is the order the consumer read them
//! in, and the decoder's per-partition state (a tombstone that just follows its delete) sees
//! them in that order. Partitions decoded on different threads reach the runtime in no order
//! with each other, as partitions have none in Kafka. Both hand-offs are bounded channels, so
//! a slow runtime stops the decoding, which stops the polling.
//!
//! The runtime hands each chunk back once it is done with it ([`crate::Source::recycle`]), and
//! the thread that decoded it frees it: memory freed by the thread that allocated it is cheap to
//! free and is reused for the next chunk. (Freed on the runtime's thread, the chunks took about
//! 4% of a benchmark run's samples there, benches/kafka_consume.sh.)

use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender, channel, sync_channel};

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;

use super::decode::{Message, MessageDecoder};
use crate::{SourceError, SourceItem};

/// Chunks of raw messages waiting for the decoding thread: one being decoded while the
/// consumer fills the next is all the overlap there is to gain; more would only hold memory.
const RAW_CHUNKS: usize = 2;

/// Most decoding threads: past a few, the single consumer thread copying the messages out is
/// the limit.
const MAX_THREADS: usize = 4;

/// How many decoding threads a source starts: one per core, at least one, at most
/// [`MAX_THREADS`].
pub(super) fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, MAX_THREADS))
}

/// What the consumer thread hands to the decoding thread: messages, or the error that ends the
/// run.
pub(super) type RawBatch = Result<RawChunk, SourceError>;

/// A chunk of decoded messages, or the error that ends the run, as the runtime receives them.
pub(super) type Chunk = Result<Decoded, SourceError>;

/// Decoded messages and the thread that decoded them, to which they go back once the runtime is
/// done with them.
pub(super) struct Decoded {
    pub thread: usize,
    pub items: Vec<SourceItem>,
}

/// Where the runtime hands a decoding thread's chunks back.
pub(super) type Recycler = Sender<Vec<SourceItem>>;

/// Messages copied out of librdkafka's buffers: every key and value back to back in one
/// buffer (one allocation per chunk, not one per message); each decoded message keeps a shared
/// slice of it as its raw bytes for the dead-letter store.
#[derive(Default)]
pub(super) struct RawChunk {
    bytes: BytesMut,
    /// The topics and partition names of the messages, each once.
    partitions: Vec<(Arc<str>, Arc<str>)>,
    messages: Vec<RawMessage>,
}

/// One message of a [`RawChunk`]: where its key and value are in the chunk's buffer.
struct RawMessage {
    /// Index into [`RawChunk::partitions`].
    partition: usize,
    offset: i64,
    key: Option<Range<usize>>,
    value: Option<Range<usize>>,
}

impl RawChunk {
    /// An empty chunk with room for `bytes` bytes of keys and values.
    pub(super) fn with_capacity(bytes: usize) -> Self {
        Self {
            bytes: BytesMut::with_capacity(bytes),
            ..Self::default()
        }
    }

    /// Messages in the chunk.
    pub(super) fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether the chunk has no message.
    pub(super) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Bytes of keys and values in the chunk.
    pub(super) fn bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Copies one message into the chunk; `topic` and `partition` are the interned names of
    /// its topic and source partition.
    pub(super) fn push(
        &mut self,
        topic: &Arc<str>,
        partition: &Arc<str>,
        offset: i64,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
    ) {
        let index = match self
            .partitions
            .iter()
            .rposition(|(_, p)| Arc::ptr_eq(p, partition))
        {
            Some(i) => i,
            None => {
                self.partitions.push((topic.clone(), partition.clone()));
                self.partitions.len() - 1
            }
        };
        let key = key.map(|k| self.append(k));
        let value = value.map(|v| self.append(v));
        self.messages.push(RawMessage {
            partition: index,
            offset,
            key,
            value,
        });
    }

    fn append(&mut self, bytes: &[u8]) -> Range<usize> {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        start..self.bytes.len()
    }

    /// Decodes every message, in order, into `items`.
    pub(super) fn decode(self, decoder: &mut MessageDecoder, items: &mut Vec<SourceItem>) {
        let bytes: Bytes = self.bytes.freeze();
        let partitions = self.partitions;
        items.extend(self.messages.into_iter().map(|m| {
            let (topic, partition) = &partitions[m.partition];
            // The bytes kept for the dead-letter store: the value, or the key of a
            // tombstone.
            let raw = m.value.clone().or_else(|| m.key.clone()).unwrap_or(0..0);
            decoder.decode(&Message {
                topic,
                partition,
                offset: m.offset,
                key: m.key.map(|r| &bytes[r]),
                value: m.value.map(|r| &bytes[r]),
                raw: bytes.slice(raw),
            })
        }));
    }
}

/// A decoding thread's inputs: the raw chunks to decode, and the decoded ones handed back.
pub(super) struct Inputs {
    pub raw: SyncSender<RawBatch>,
    pub recycler: Recycler,
}

/// Starts decoding thread number `thread`: it decodes the chunks sent to `raw` and sends them
/// on to `out`, and frees the chunks sent to `recycler`. It ends once every sender of raw
/// chunks is dropped and the chunks sent are passed on, or once `out`'s receiver is gone.
pub(super) fn spawn(
    thread: usize,
    mut decoder: MessageDecoder,
    out: mpsc::Sender<Chunk>,
) -> Result<Inputs, SourceError> {
    let (raw, rx) = sync_channel(RAW_CHUNKS);
    let (recycler, recycled) = channel();
    std::thread::Builder::new()
        .name("kafka-decode".into())
        .spawn(move || run(thread, &rx, &recycled, &mut decoder, &out))
        .map_err(|e| SourceError::Io {
            message: "cannot start the Kafka decoding thread".into(),
            source: Some(e),
        })?;
    Ok(Inputs { raw, recycler })
}

fn run(
    thread: usize,
    rx: &Receiver<RawBatch>,
    recycled: &Receiver<Vec<SourceItem>>,
    decoder: &mut MessageDecoder,
    out: &mpsc::Sender<Chunk>,
) {
    // A handed-back chunk's vector, emptied, holds the next chunk's items.
    let mut spare: Vec<SourceItem> = Vec::new();
    loop {
        let batch = rx.recv_timeout(crate::sources::IDLE_FREE);
        crate::sources::free_recycled(recycled, &mut spare);
        let batch = match batch {
            Ok(batch) => batch,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let chunk = batch.map(|raw| {
            let mut items = std::mem::take(&mut spare);
            raw.decode(decoder, &mut items);
            Decoded { thread, items }
        });
        if out.blocking_send(chunk).is_err() {
            return;
        }
    }
}
