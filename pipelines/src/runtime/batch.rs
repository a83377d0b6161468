//! Batch assembly: the batch being filled (operations per sink, dead letters, where it ends in
//! each partition) and the rules that cut it (event and byte limits, stretched inside a source
//! transaction up to [`TRANSACTION_BATCH_FACTOR`] times, and the longest wait). Operations a
//! projection emits at a transaction's end (documents) count as events, and are not stretched:
//! a transaction reaching a million documents leaves in batches of at most `max_events` events
//! and documents ([`BatchLimits::emission_room`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refract_connectors::dead_letter::DeadLetter;
use refract_projections::WriteOp;
use refract_schemas::Offset;
use refract_schemas::config::PipelineFile;

/// How far past the batch limits a batch may grow to avoid splitting a source transaction.
pub const TRANSACTION_BATCH_FACTOR: usize = 4;

/// The batch being assembled.
pub(super) struct Batch {
    /// Write operations per sink, in source order.
    pub(super) ops: Vec<Vec<WriteOp>>,
    /// Bad input for the dead-letter store.
    pub(super) letters: Vec<DeadLetter>,
    /// Per partition, the offset of the batch's last item.
    pub(super) end: BTreeMap<Arc<str>, Offset>,
    /// Items read into the batch.
    pub(super) events: usize,
    /// Operations projections emitted into it at a transaction's end (before routing to sinks).
    pub(super) emitted: usize,
    /// Raw bytes of the items read into the batch.
    pub(super) bytes: usize,
    /// When its first item arrived.
    pub(super) started: Option<Instant>,
    /// The source commit time (ms since the epoch) of its first change that has one (the
    /// source lag is measured from it).
    pub(super) oldest_commit_ms: Option<i64>,
}

impl Batch {
    /// An empty batch for `sinks` sinks.
    pub(super) fn new(sinks: usize) -> Self {
        Self {
            ops: vec![Vec::new(); sinks],
            letters: Vec::new(),
            end: BTreeMap::new(),
            events: 0,
            emitted: 0,
            bytes: 0,
            started: None,
            oldest_commit_ms: None,
        }
    }

    /// Whether no item was read into it and nothing was emitted into it.
    pub(super) fn is_empty(&self) -> bool {
        self.end.is_empty() && self.ops.iter().all(Vec::is_empty)
    }

    /// The next batch, with room for as many operations per sink as this one had: a steady
    /// flow (a snapshot) does not regrow vectors of operations batch after batch.
    pub(super) fn successor(&self) -> Self {
        Self {
            ops: self
                .ops
                .iter()
                .map(|ops| Vec::with_capacity(ops.len()))
                .collect(),
            ..Batch::new(0)
        }
    }
}

/// Where a batch is cut (`[pipeline.batch]`).
pub(super) struct BatchLimits {
    /// Most events per batch.
    pub(super) max_events: usize,
    /// Most raw bytes per batch.
    pub(super) max_bytes: usize,
    /// Longest a partial batch waits for more events.
    pub(super) max_delay: Duration,
}

impl BatchLimits {
    /// The limits the pipeline file sets.
    pub(super) fn new(config: &PipelineFile) -> Self {
        Self {
            max_events: config.pipeline.batch.max_events,
            max_bytes: config.pipeline.batch.max_bytes as usize,
            max_delay: Duration::from_millis(config.pipeline.batch.max_delay_ms),
        }
    }

    /// Whether `batch` must be dispatched now: it reached the limits, or inside a source
    /// transaction [`TRANSACTION_BATCH_FACTOR`] times the limits (memory stays bounded).
    pub(super) fn is_full(&self, batch: &Batch, in_transaction: bool) -> bool {
        let over = |factor: usize| {
            batch.events + batch.emitted >= self.max_events * factor
                || batch.bytes >= self.max_bytes * factor
        };
        if in_transaction {
            over(TRANSACTION_BATCH_FACTOR)
        } else {
            over(1)
        }
    }

    /// How many more operations a transaction's end may emit into `batch` before it must be
    /// cut: the event limit, less what the batch already holds (events read and operations
    /// emitted); none once its bytes reach the byte limit.
    ///
    /// Not stretched by [`TRANSACTION_BATCH_FACTOR`]: a batch cut inside an emission does not
    /// split what a sink applies atomically any more than a batch of four times the size
    /// would, and the emitted documents are what fills memory. With `queue_depth` batches
    /// queued, one being applied and one being filled, the stretched limit kept about 120,000
    /// rebuilt documents in flight: 265 → 181 MiB peak RSS for a rename reaching 500,000 books,
    /// 299 → 136 MiB for a bulk UPDATE of 1,000,000, at slightly higher rates
    /// (`benches/documents_bulk.sh`, `BOOKS=1000000`).
    pub(super) fn emission_room(&self, batch: &Batch) -> usize {
        if batch.bytes >= self.max_bytes {
            return 0;
        }
        self.max_events.saturating_sub(batch.events + batch.emitted)
    }

    /// When `batch` is due although not full.
    pub(super) fn deadline(&self, batch: &Batch) -> Option<tokio::time::Instant> {
        batch
            .started
            .map(|s| tokio::time::Instant::from_std(s + self.max_delay))
    }
}

/// Moves a projection's operations into the batch of each sink it writes to.
pub(super) fn route_ops(batch: &mut [Vec<WriteOp>], sinks: &[usize], ops: &mut Vec<WriteOp>) {
    for (i, &sink) in sinks.iter().enumerate() {
        if i + 1 == sinks.len() {
            batch[sink].append(ops);
        } else {
            batch[sink].extend(ops.iter().cloned());
        }
    }
}
