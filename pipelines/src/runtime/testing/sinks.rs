//! The in-memory sink, which records every batch it applies, and the fault-injecting wrapper,
//! which follows a script shared with the test (fail transiently, stall until released, fail
//! permanently, buffer until told).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use refract_connectors::{Buffered, Sink, SinkBatch, SinkError, WriteReport};
use refract_projections::WriteOp;
use refract_schemas::Checkpoint;
use tokio::sync::Semaphore;

/// A batch a sink applied.
#[derive(Debug, Clone)]
pub(crate) struct Applied {
    /// The runtime's batch number.
    pub(crate) seq: u64,
    /// Its operations, in order.
    pub(crate) ops: Vec<WriteOp>,
}

/// A sink that records every batch it applies, durable when `write` returns.
pub(crate) struct MemorySink {
    applied: Arc<Mutex<Vec<Applied>>>,
}

impl MemorySink {
    /// A sink, and the batches it applies for the test to read.
    pub(crate) fn new() -> (Self, Arc<Mutex<Vec<Applied>>>) {
        let applied = Arc::new(Mutex::new(Vec::new()));
        let sink = Self {
            applied: applied.clone(),
        };
        (sink, applied)
    }
}

#[async_trait]
impl Sink for MemorySink {
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        self.applied.lock().unwrap().push(Applied {
            seq: batch.seq,
            ops: batch.ops.clone(),
        });
        Ok(WriteReport::default())
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        Ok(None)
    }
}

/// What a write of one batch meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Fails with a retryable error this many more times.
    Transient(u32),
    /// Waits until the test calls [`Faults::release`].
    Stall,
    /// Fails with a permanent error.
    Permanent,
}

/// The fault script a [`FaultySink`] follows, shared with the test.
pub(crate) struct Faults {
    state: Mutex<FaultState>,
    /// Permits for stalled writes.
    release: Semaphore,
}

/// What the faulty sink was told to do and what it did.
#[derive(Debug, Default)]
pub(crate) struct FaultState {
    /// Per batch `seq`, the fault its writes meet.
    plan: BTreeMap<u64, Fault>,
    /// Per batch `seq`, when each write attempt started (virtual time).
    pub(crate) attempts: BTreeMap<u64, Vec<tokio::time::Instant>>,
    /// The batch whose write waits for [`Faults::release`].
    pub(crate) stalled: Option<u64>,
    /// The newest batch written to the inner sink.
    pub(crate) written: u64,
    /// Whether the sink buffers (reports `durable_through` behind what it wrote).
    buffering: bool,
    /// While buffering, whether a flush leaves the buffer as it is (until
    /// [`Faults::report_durable`]).
    hold: bool,
    /// While buffering, how long after a flush the sink wants the next one.
    flush_every: Option<Duration>,
    /// When the sink wants its next flush.
    next_flush: Option<std::time::Instant>,
    /// While buffering, the newest batch reported durable.
    pub(crate) durable_through: u64,
    /// Flushes the runtime asked for.
    pub(crate) flushes: u32,
}

impl Faults {
    /// A script without faults.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
            release: Semaphore::new(0),
        })
    }

    /// What the sink was told and did so far.
    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.state.lock().unwrap()
    }

    /// Writes of batch `seq` meet `fault`.
    pub(crate) fn plan(&self, seq: u64, fault: Fault) {
        self.state().plan.insert(seq, fault);
    }

    /// Lets one stalled write go on.
    pub(crate) fn release(&self) {
        self.release.add_permits(1);
    }

    /// From now on the sink buffers: `durable_through` stays behind what it wrote until a flush
    /// (unless `hold`: then until [`Faults::report_durable`]); with `flush_every`, the sink asks
    /// for a flush that long after the last one.
    pub(crate) fn buffer(&self, hold: bool, flush_every: Option<Duration>) {
        let mut state = self.state();
        state.buffering = true;
        state.hold = hold;
        state.flush_every = flush_every;
        state.next_flush = flush_every.map(after);
    }

    /// The buffered batches through `seq` become durable (reported at the next flush or write).
    pub(crate) fn report_durable(&self, seq: u64) {
        let mut state = self.state();
        state.durable_through = state.durable_through.max(seq.min(state.written));
    }
}

/// `delay` from now on tokio's clock (virtual when paused), as a `std` instant.
fn after(delay: Duration) -> std::time::Instant {
    (tokio::time::Instant::now() + delay).into_std()
}

/// A sink wrapper that meets the faults its script plans.
pub(crate) struct FaultySink {
    name: String,
    inner: Box<dyn Sink>,
    faults: Arc<Faults>,
}

impl FaultySink {
    /// `inner` under the name `name`, faulty as `faults` says.
    pub(crate) fn new(name: &str, inner: impl Sink + 'static, faults: Arc<Faults>) -> Self {
        Self {
            name: name.to_owned(),
            inner: Box::new(inner),
            faults,
        }
    }

    fn error(&self, permanent: bool, seq: u64) -> SinkError {
        let (sink, source) = (self.name.clone(), None);
        if permanent {
            let message = format!("injected permanent failure of batch {seq}");
            SinkError::Permanent {
                sink,
                message,
                source,
            }
        } else {
            let message = format!("injected transient failure of batch {seq}");
            SinkError::Transient {
                sink,
                message,
                source,
            }
        }
    }
}

#[async_trait]
impl Sink for FaultySink {
    async fn open(&mut self, resume: &Checkpoint) -> Result<(), SinkError> {
        self.inner.open(resume).await
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let seq = batch.seq;
        let fault = {
            let mut state = self.faults.state();
            let now = tokio::time::Instant::now();
            state.attempts.entry(seq).or_default().push(now);
            match state.plan.get_mut(&seq) {
                Some(Fault::Transient(0)) | None => None,
                Some(Fault::Transient(n)) => {
                    *n -= 1;
                    Some(Fault::Transient(*n))
                }
                Some(Fault::Stall) => {
                    state.stalled = Some(seq);
                    state.plan.remove(&seq)
                }
                Some(Fault::Permanent) => Some(Fault::Permanent),
            }
        };
        match fault {
            Some(Fault::Transient(_)) => return Err(self.error(false, seq)),
            Some(Fault::Permanent) => return Err(self.error(true, seq)),
            Some(Fault::Stall) => {
                let permit = self.faults.release.acquire().await;
                permit.expect("the semaphore stays open").forget();
                self.faults.state().stalled = None;
            }
            None => {}
        }
        let report = self.inner.write(batch).await?;
        self.faults.state().written = seq;
        Ok(report)
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        self.inner.close().await
    }

    fn buffered(&self) -> Option<Buffered> {
        let state = self.faults.state();
        (state.buffering || state.next_flush.is_some()).then(|| Buffered {
            durable_through: if state.buffering {
                state.durable_through
            } else {
                state.written
            },
            flush_deadline: state.next_flush,
        })
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.inner.flush().await?;
        let mut state = self.faults.state();
        state.flushes += 1;
        if state.buffering && !state.hold {
            state.durable_through = state.written;
        }
        state.next_flush = state.flush_every.map(after);
        Ok(())
    }
}
