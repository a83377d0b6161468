//! Sources and sinks: every byte refract reads or writes goes through this crate.
//!
//! [`registry`] is the one place that turns configuration into connectors: grep it to see every
//! source and sink kind, and the families of write operations each sink accepts ([`intake`]).

pub mod dead_letter;
pub mod health;
pub mod intake;
pub mod migration;
pub mod pg_connect;
pub mod pg_sql;
mod privileges;
pub mod registry;
pub mod schema_registry;
pub mod sinks;
pub mod sources;
pub mod tiers;
mod tls_refusal;

use async_trait::async_trait;
use refract_schemas::debezium::DecodeError;
use refract_schemas::write::WriteOp;
use refract_schemas::{Checkpoint, Record};
use tokio::sync::watch;

pub use health::{SourceHealth, SourceReport, SourceState};
pub use intake::Intake;

/// A batch of write operations for one sink, in source order.
#[derive(Debug, Default)]
pub struct SinkBatch {
    /// Sequence number of the runtime batch this belongs to (strictly increasing).
    pub seq: u64,
    /// The operations, in the order the source emitted the changes that produced them. Each
    /// belongs to a family the sink accepts: `refract validate` refuses any other route.
    pub ops: Vec<WriteOp>,
}

/// What a sink did with a batch.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WriteReport {
    /// Documents written or replaced.
    pub upserted: u64,
    /// Documents deleted.
    pub deleted: u64,
    /// Operations made redundant by a later operation on the same key in the same batch.
    pub coalesced: u64,
    /// Operations the target cannot hold, not applied (see the delivery contract on [`Sink`]).
    /// The runtime dead-letters them or stops, as `on_error` says.
    #[serde(skip)]
    pub rejected: Vec<RejectedOp>,
}

/// One operation a sink could not apply because of its value (a key too long for an object
/// name, a row the target refuses with a data error), while the rest of its batch was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedOp {
    /// Position of the change that produced the operation.
    pub position: refract_schemas::Position,
    /// The collection or table the operation was for.
    pub table: String,
    /// The document or row key.
    pub key: String,
    /// Why the target cannot hold it, in the sink's words.
    pub reason: String,
}

/// A sink applies write operations to one read model.
///
/// **Delivery contract.** The runtime hands batches to [`Sink::write`] one at a time, in source
/// order, and relies on these rules:
/// - *At-least-once, idempotent.* After a crash the runtime replays every change past the last
///   checkpoint, so a sink sees operations it already applied. Applying an operation twice must
///   leave the same state as applying it once (upserts keyed by document key, deletes of absent
///   documents succeed, file names derived from positions).
/// - *Order per key.* Two operations on the same key are applied in batch order. Operations on
///   different keys may be applied in any order or concurrently.
/// - *Durable on return.* When `write` returns `Ok`, the batch's effects survive a crash of this
///   process; only then may the runtime checkpoint past it. A sink that buffers must not return
///   before its buffer is durable.
/// - *Classified errors.* A [`SinkError`] that [`is_retryable`](SinkError::is_retryable) makes the
///   runtime retry the same batch with backoff while the checkpoint stays put; any other error
///   stops the pipeline loudly. A sink never skips an operation silently to make progress.
/// - *Per-operation rejection.* An operation whose value the target can never hold (retrying
///   cannot help: a key past the store's name limit, a row refused with a data error) is not an
///   error of the batch: the sink applies the rest of the batch and lists that operation in
///   [`WriteReport::rejected`] with its reason. The runtime records it in the dead-letter store
///   (stage `sink`) before checkpointing past the batch, or stops without checkpointing past it
///   when `on_error = "stop"`. Rejecting an operation on a key must leave the key as the
///   operations before it in the batch left it (a replay rejects it again, idempotently).
/// - *Only what it accepts.* A sink kind declares the families of operations it applies (its
///   [`Intake`] type); the runtime hands it nothing else, because `refract validate` refuses a
///   route from a projection that emits other families.
///
/// **Buffering sinks** (Parquet files that hold many batches) may return from `write` before a
/// batch is durable, if they say so through [`Sink::buffered`]: the runtime then holds the
/// checkpoint until the sink reports the batch durable, calls [`Sink::flush`] at the sink's
/// flush deadline and when the pipeline drains, and tells the sink at [`Sink::open`] where the
/// run resumes, so it can drop what it published past that point.
#[async_trait]
pub trait Sink: Send {
    /// Connects and prepares the target (creating what is missing), knowing the checkpoint the
    /// run resumes from. Called before writes; retried by the runtime on retryable errors.
    async fn open(&mut self, resume: &Checkpoint) -> Result<(), SinkError>;

    /// Applies a batch durably (see the trait documentation).
    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError>;

    /// For a buffering sink, how far its batches are durable and when it wants [`Sink::flush`]
    /// called; `None` (the default) when every batch is durable once `write` returns.
    fn buffered(&self) -> Option<Buffered> {
        None
    }

    /// Makes everything written so far durable (a buffering sink publishes its files).
    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    /// Flushes and releases resources at shutdown; returns what the run's summary must tell
    /// the user (a sink that wrote somewhere else than configured, say).
    async fn close(&mut self) -> Result<Option<String>, SinkError>;
}

/// The state of a buffering sink's buffer (see [`Sink::buffered`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffered {
    /// The newest batch `seq` whose effects (and those of every batch before it) are durable.
    pub durable_through: u64,
    /// When the sink wants [`Sink::flush`] called although no batch arrives.
    pub flush_deadline: Option<std::time::Instant>,
}

/// A sink as the registry builds it: the sink and what the runtime needs to know about it.
pub struct BuiltSink {
    /// The sink's name in the pipeline file.
    pub name: String,
    /// The sink, not yet opened.
    pub sink: Box<dyn Sink>,
    /// How long a batch may keep failing (and being retried) before the pipeline reports itself
    /// unhealthy; it goes on retrying.
    pub unhealthy_after: std::time::Duration,
}

/// Default bound on how long a batch may wait for a failing sink before the pipeline reports
/// itself unhealthy: longer than a typical failover, short enough to page someone.
pub const DEFAULT_UNHEALTHY_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// A sink failure, classified for the retry policy.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The target is unreachable or failed in a way that may pass (network, 5xx, timeouts).
    #[error("sink `{sink}`: {message}")]
    Transient {
        /// The sink's name.
        sink: String,
        /// What failed.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A failure that retrying cannot fix (bad configuration, permissions, invalid data).
    #[error("sink `{sink}`: {message}")]
    Permanent {
        /// The sink's name.
        sink: String,
        /// What failed.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl SinkError {
    /// Whether the runtime should retry the batch.
    pub fn is_retryable(&self) -> bool {
        matches!(self, SinkError::Transient { .. })
    }

    /// A write before the sink was opened: a bug in the runtime, reported rather than panicking.
    pub fn not_open(sink: &str) -> Self {
        SinkError::Permanent {
            sink: sink.to_owned(),
            message: "written to before it was opened".into(),
            source: None,
        }
    }
}

/// One item read by a source: a decoded record or the reason it could not be decoded, with the
/// raw input kept for the dead-letter store.
#[derive(Debug)]
pub struct SourceItem {
    /// The decoded record, or why decoding failed.
    pub record: Result<Record, DecodeError>,
    /// The raw input (one line, one Kafka value).
    pub raw: bytes::Bytes,
}

/// How far a source reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMode {
    /// Keep following the source for new changes (daemon).
    Follow,
    /// Stop once the end of the source as of now is reached (`--until-caught-up`).
    UntilCaughtUp,
}

/// What a source is started for, besides its configuration.
#[derive(Debug, Clone, Default)]
pub struct SourceContext {
    /// The pipeline's name (names default slots, publications, consumer groups).
    pub pipeline: String,
    /// The pipeline's state directory, for a source's own progress files (snapshots).
    pub state_dir: std::path::PathBuf,
    /// Re-read existing rows into the read models (`refract backfill`), where the source can.
    pub backfill: Option<BackfillScope>,
}

/// Which tables a backfill re-reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackfillScope {
    /// `schema.table` or `table` names; empty means every table the source reads.
    pub tables: Vec<String>,
    /// Start over even if an earlier backfill of the same scope was interrupted.
    pub restart: bool,
}

/// A source of change records.
///
/// Sources deliver items in position order per partition, resume strictly after the checkpoint
/// they are started with, and learn which positions are durable in every sink through the
/// `durable` channel (a PostgreSQL source confirms them to the slot, a Kafka source commits them).
#[async_trait]
pub trait Source: Send {
    /// Starts reading after `checkpoint`.
    async fn start(
        &mut self,
        checkpoint: &Checkpoint,
        mode: ReadMode,
        durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError>;

    /// Once started: where the source resumes each partition the checkpoint does not name
    /// (a file read again from its start, a replication slot from its confirmed position), as
    /// the offset just before the first change it will hand out again. Sinks that published
    /// past the checkpoint (Parquet files named by position) drop what the replay rewrites;
    /// without it, a run killed before its first checkpoint would leave them twice.
    fn resumes_unnamed(&self) -> Checkpoint {
        Checkpoint::new()
    }

    /// The next items in source order, `None` once caught up (in [`ReadMode::UntilCaughtUp`]) or
    /// stopped. Must be cancel-safe: the runtime polls it inside `select!` and drops the future
    /// when another branch wins, which must lose nothing.
    async fn next_chunk(&mut self) -> Result<Option<Vec<SourceItem>>, SourceError>;

    /// Asks the source to stop: items already read are still returned, then `None`.
    fn stop(&mut self);

    /// Called once after the run's final checkpoint, before the process exits: a source that
    /// confirms positions upstream (a replication slot, a consumer group) sends the last one.
    async fn finish(&mut self) {}

    /// Whether the chunk `next_chunk` returned last ends a unit of work someone waits for (a
    /// backfill read into a running daemon's stream): the runtime then writes its batch at once
    /// instead of waiting for more events to fill it.
    fn ends_batch(&self) -> bool {
        false
    }

    /// Progress as (bytes or events done, total), when the source knows its size.
    fn progress(&self) -> Option<(u64, u64)> {
        None
    }

    /// The source's health: a handle the runtime takes once [`Source::start`] returned and reads
    /// for `/health` while the run lasts. A source that recovers from failures by itself instead
    /// of returning them (a stream it reconnects, checks it runs beside the stream) must record
    /// them in it, with [`SourceHealth::reconnecting`] and [`SourceHealth::check_failed`], and
    /// the recovery with [`SourceHealth::connected`] and [`SourceHealth::check_passed`]:
    /// otherwise `/health` says 200 while no change arrives. The default never reports a
    /// trouble, right for sources whose every failure ends [`Source::next_chunk`] with an error.
    fn health(&self) -> SourceHealth {
        SourceHealth::default()
    }

    /// Takes back the last chunk `next_chunk` returned, once the runtime is done with it. A
    /// source that decodes on threads of its own frees the chunk there: the thread that
    /// allocated it frees it fastest, and its memory is reused for the next chunk.
    fn recycle(&mut self, items: Vec<SourceItem>) {
        drop(items);
    }
}

/// A source failure.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Reading failed.
    #[error("source: {message}")]
    Io {
        /// What failed.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The checkpoint does not fit the source (file replaced, slot lost): resuming would lose or
    /// repeat data, so refract refuses.
    #[error("source: {0}")]
    Inconsistent(String),
}

#[cfg(test)]
mod test_support;
