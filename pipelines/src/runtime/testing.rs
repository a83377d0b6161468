//! The runtime's test harness: a pipeline file from text, an in-memory source that hands out a
//! scripted list of items and records the durable checkpoints it is told, an in-memory sink that
//! records every batch it applies, and a sink wrapper that injects faults on a script the test
//! shares (fail transiently, stall until released, fail permanently, buffer until told).
//!
//! Tests run on tokio's paused clock (`start_paused`): time moves only when every task waits,
//! straight to the next timer, so retry backoff costs no wall time and waiting for a condition
//! ([`Running::wait_until`]) has a deadline in virtual time.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use refract_connectors::{
    ReadMode, Sink, SinkBatch, SinkError, Source, SourceError, SourceItem, WriteReport,
};
use refract_projections::WriteOp;
use refract_schemas::config::{PipelineFile, load_str};
use refract_schemas::debezium::DecodeError;
use refract_schemas::event::{SourceInfo, TxBoundary, TxStatus};
use refract_schemas::{ChangeEvent, Checkpoint, Offset, Op, Position, Record, Row, TableId};
use serde_json::json;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use super::wiring::projection_parts;
use super::{Parts, RunError, RunOptions, RunSummary, Startup, run_parts};

/// The partition of the in-memory source.
pub(super) const PARTITION: &str = "memory";
/// The table the test pipeline's projection reads.
pub(super) const TABLE: &str = "items";
/// How long [`Running::wait_until`] waits (virtual time: a deadline only a stuck run reaches).
const WAIT_LIMIT: Duration = Duration::from_secs(120);
/// How often [`Running::wait_until`] looks (virtual time).
const POLL: Duration = Duration::from_millis(1);

/// The settings of a test pipeline that tests vary.
pub(super) struct Settings {
    /// `[pipeline.batch] max_events`.
    pub(super) max_events: usize,
    /// `[pipeline] on_error`.
    pub(super) on_error: &'static str,
    /// `[pipeline] queue_depth`.
    pub(super) queue_depth: usize,
    /// The sinks the projection writes to (all `kind = "null"` in the file; the test hands in
    /// its own under these names).
    pub(super) sinks: &'static [&'static str],
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_events: 2,
            on_error: "dead_letter",
            queue_depth: 4,
            sinks: &["a"],
        }
    }
}

/// A pipeline file parsed from text, with its state directory (removed when dropped).
pub(super) struct Pipeline {
    pub(super) config: PipelineFile,
    _dir: tempfile::TempDir,
}

impl Pipeline {
    /// A replica of `public.items` into the settings' sinks; batches wait up to a minute for
    /// more events (the tests' batches are cut by their size).
    pub(super) fn new(settings: Settings) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let sinks: Vec<String> = settings.sinks.iter().map(|s| format!("{s:?}")).collect();
        let mut text = format!(
            r#"
[pipeline]
name = "memory"
state_dir = {dir:?}
on_error = {on_error:?}
queue_depth = {queue_depth}

[pipeline.batch]
max_events = {max_events}
max_delay_ms = 60000

[source]
kind = "file"
path = "unused.jsonl"

[projections.replica]
kind = "replica"
tables = ["public.{TABLE}"]
sinks = [{sinks}]
"#,
            dir = dir.path().display().to_string(),
            on_error = settings.on_error,
            queue_depth = settings.queue_depth,
            max_events = settings.max_events,
            sinks = sinks.join(", "),
        );
        for sink in settings.sinks {
            text.push_str(&format!("\n[sinks.{sink}]\nkind = \"null\"\n"));
        }
        let config = load_str("memory.toml", &text, &|_| None)
            .unwrap_or_else(|e| panic!("the test pipeline must load: {e}"))
            .config;
        Self { config, _dir: dir }
    }

    /// The checkpoint committed in the state directory (after a run).
    pub(super) fn committed(&self) -> Checkpoint {
        let path = super::state_path(&self.config).join(crate::checkpoint::FILE);
        crate::checkpoint::CheckpointStore::open(&path)
            .and_then(|store| store.load())
            .expect("the checkpoint store opens")
    }

    /// The dead letters recorded in the default file, as JSON.
    pub(super) fn dead_letters(&self) -> Vec<serde_json::Value> {
        let path = super::default_dead_letter_path(&self.config);
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a dead letter is JSON"))
            .collect()
    }

    /// Starts a run of this pipeline with `source` and `sinks` in memory (and the file's
    /// projections).
    pub(super) fn start(
        &self,
        source: MemorySource,
        sinks: Vec<(&str, Box<dyn Sink>)>,
        mode: ReadMode,
    ) -> Running {
        let config = self.config.clone();
        let parts = Parts {
            source: Box::new(source),
            sinks: sinks
                .into_iter()
                .map(|(name, sink)| (name.to_owned(), sink))
                .collect(),
            projections: projection_parts(&config),
        };
        let options = RunOptions {
            mode,
            backfill: None,
            progress_bar: false,
        };
        let (shutdown, shutdown_rx) = watch::channel(false);
        let handle = tokio::spawn(async move {
            let startup = Startup::open(&config).await?;
            run_parts(&config, startup, parts, options, shutdown_rx).await
        });
        Running { shutdown, handle }
    }
}

/// A run in progress.
pub(super) struct Running {
    shutdown: watch::Sender<bool>,
    handle: JoinHandle<Result<RunSummary, RunError>>,
}

impl Running {
    /// Waits until `condition` holds; fails the test if the run ends first or the deadline
    /// passes.
    pub(super) async fn wait_until(&self, what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
        while !condition() {
            assert!(!self.handle.is_finished(), "the run ended before {what}");
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting until {what}"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Asks the run to stop (SIGINT/SIGTERM).
    pub(super) fn stop(&self) {
        self.shutdown.send_replace(true);
    }

    /// The run's result; fails the test if it does not end by the deadline.
    pub(super) async fn finish(self) -> Result<RunSummary, RunError> {
        tokio::time::timeout(WAIT_LIMIT, self.handle)
            .await
            .expect("the run ends before the deadline")
            .expect("the run does not panic")
    }
}

/// Lets virtual time pass: every task runs until it waits on something a second does not
/// bring. Before asserting that something did *not* happen (the checkpoint did not move).
pub(super) async fn let_time_pass() {
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// One scripted source item, as a test writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Step {
    /// Row `id` of `items` now holds `value`.
    Put(i64, i64),
    /// Row `id` of `items` is deleted.
    Delete(i64),
    /// A source transaction begins.
    Begin,
    /// The source transaction ends.
    End,
    /// Input that does not decode.
    Garbage,
    /// A change of a table no projection reads.
    Unread,
    /// A change of `items` without its key column.
    Keyless,
}

impl Step {
    /// Whether the runtime must set it aside as bad input.
    pub(super) fn is_bad(self) -> bool {
        matches!(self, Step::Garbage | Step::Unread | Step::Keyless)
    }
}

/// The position of the item at `offset`.
pub(super) fn position(offset: u64) -> Position {
    Position {
        partition: PARTITION.into(),
        offset: Offset(offset, 0),
    }
}

/// The checkpoint that covers the in-memory source through `offset` (empty for 0).
pub(super) fn through(offset: u64) -> Checkpoint {
    if offset == 0 {
        return Checkpoint::new();
    }
    Checkpoint::from([(PARTITION.to_owned(), Offset(offset, 0))])
}

/// The offset a checkpoint covers the in-memory source through (0 for none).
pub(super) fn covered(checkpoint: &Checkpoint) -> u64 {
    checkpoint.get(PARTITION).map_or(0, |o| o.0)
}

/// The source items of `steps`, the item of step `i` at offset `i + 1`.
pub(super) fn items(steps: &[Step]) -> Vec<SourceItem> {
    let mut tx = 0;
    steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let position = position(i as u64 + 1);
            let raw = format!("{step:?} at {}", i + 1);
            let change = |table: &str, op, row: Option<Row>| {
                let row = row.map(Arc::new);
                let (before, after) = match op {
                    Op::Delete => (row, None),
                    _ => (None, row),
                };
                Ok(Record::Change(ChangeEvent {
                    table: TableId::new("public", table),
                    op,
                    key: None,
                    key_columns: None,
                    before,
                    after,
                    source: SourceInfo::default(),
                    transaction: None,
                    position: position.clone(),
                }))
            };
            let mut marker = |status| {
                tx += u64::from(status == TxStatus::Begin);
                Ok(Record::Transaction(TxBoundary {
                    status,
                    id: tx.to_string(),
                    event_count: None,
                    ts_ms: None,
                    position: position.clone(),
                }))
            };
            let record = match *step {
                Step::Put(id, value) => change(TABLE, Op::Update, Some(row(id, value))),
                Step::Delete(id) => change(TABLE, Op::Delete, Some(row(id, 0))),
                Step::Begin => marker(TxStatus::Begin),
                Step::End => marker(TxStatus::End),
                Step::Garbage => Err(DecodeError {
                    position: position.clone(),
                    reason: format!("scripted garbage at {}", i + 1),
                }),
                Step::Unread => change("other", Op::Update, Some(row(1, 1))),
                Step::Keyless => change(
                    TABLE,
                    Op::Update,
                    Some(Row::from_iter([("v".to_owned(), json!(1))])),
                ),
            };
            SourceItem {
                record,
                raw: raw.into_bytes().into(),
            }
        })
        .collect()
}

fn row(id: i64, value: i64) -> Row {
    Row::from_iter([("id".to_owned(), json!(id)), ("v".to_owned(), json!(value))])
}

/// What a key went through: `Some(value)` for each write, `None` for each delete, in order.
pub(super) type History = BTreeMap<String, Vec<Option<i64>>>;

/// The independent model: what each key of `items` goes through when `steps` are applied.
pub(super) fn expected(steps: &[Step]) -> History {
    let mut history = History::new();
    for step in steps {
        match *step {
            Step::Put(id, value) => history.entry(id.to_string()).or_default().push(Some(value)),
            Step::Delete(id) => history.entry(id.to_string()).or_default().push(None),
            _ => {}
        }
    }
    history
}

/// What each key went through in a sink, from the batches it applied in order.
pub(super) fn history(batches: &[Applied]) -> History {
    let mut history = History::new();
    for op in batches.iter().flat_map(|b| &b.ops) {
        match op {
            WriteOp::Upsert { key, doc, .. } => history
                .entry(key.clone())
                .or_default()
                .push(doc.get("v").and_then(|v| v.as_i64())),
            WriteOp::Delete { key, .. } => history.entry(key.clone()).or_default().push(None),
            other => panic!("a replica writes no {other:?}"),
        }
    }
    history
}

/// The source offsets of the operations of a batch.
pub(super) fn offsets(batch: &Applied) -> Vec<u64> {
    batch
        .ops
        .iter()
        .map(|op| match op {
            WriteOp::Upsert { position, .. } | WriteOp::Delete { position, .. } => {
                position.offset.0
            }
            other => panic!("a replica writes no {other:?}"),
        })
        .collect()
}

/// What the in-memory source shares with the test.
#[derive(Debug, Default)]
pub(super) struct SourceLog {
    /// The checkpoint the run started the source from.
    pub(super) started_from: Option<Checkpoint>,
    /// Every durable checkpoint the source was told, in order.
    pub(super) durable: Vec<Checkpoint>,
    /// Whether every scripted item was handed out.
    pub(super) exhausted: bool,
}

impl SourceLog {
    /// The last durable checkpoint the source was told.
    pub(super) fn last_durable(&self) -> Checkpoint {
        self.durable.last().cloned().unwrap_or_default()
    }
}

/// A source handing out scripted items in chunks; in [`ReadMode::Follow`] it waits for more
/// after the last one until stopped.
pub(super) struct MemorySource {
    chunks: VecDeque<Vec<SourceItem>>,
    mode: ReadMode,
    stopped: bool,
    log: Arc<Mutex<SourceLog>>,
}

impl MemorySource {
    /// `items` in chunks of `chunk` items; the log the test reads.
    pub(super) fn new(items: Vec<SourceItem>, chunk: usize) -> (Self, Arc<Mutex<SourceLog>>) {
        let mut chunks = VecDeque::new();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            chunks.push_back(items.by_ref().take(chunk).collect());
        }
        let log = Arc::new(Mutex::new(SourceLog::default()));
        let source = Self {
            chunks,
            mode: ReadMode::UntilCaughtUp,
            stopped: false,
            log: log.clone(),
        };
        (source, log)
    }
}

#[async_trait]
impl Source for MemorySource {
    async fn start(
        &mut self,
        checkpoint: &Checkpoint,
        mode: ReadMode,
        mut durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError> {
        self.mode = mode;
        self.log.lock().unwrap().started_from = Some(checkpoint.clone());
        let log = self.log.clone();
        tokio::spawn(async move {
            loop {
                let checkpoint = durable.borrow_and_update().clone();
                log.lock().unwrap().durable.push(checkpoint);
                if durable.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(())
    }

    async fn next_chunk(&mut self) -> Result<Option<Vec<SourceItem>>, SourceError> {
        if let Some(chunk) = self.chunks.pop_front() {
            self.log.lock().unwrap().exhausted = self.chunks.is_empty();
            return Ok(Some(chunk));
        }
        if self.stopped || self.mode == ReadMode::UntilCaughtUp {
            return Ok(None);
        }
        std::future::pending().await
    }

    fn stop(&mut self) {
        self.stopped = true;
    }
}

/// A batch a sink applied.
#[derive(Debug, Clone)]
pub(super) struct Applied {
    /// The runtime's batch number.
    pub(super) seq: u64,
    /// Its operations, in order.
    pub(super) ops: Vec<WriteOp>,
}

/// A sink that records every batch it applies, durable when `write` returns.
pub(super) struct MemorySink {
    name: String,
    applied: Arc<Mutex<Vec<Applied>>>,
}

impl MemorySink {
    /// The sink `name`, and the batches it applies for the test to read.
    pub(super) fn new(name: &str) -> (Self, Arc<Mutex<Vec<Applied>>>) {
        let applied = Arc::new(Mutex::new(Vec::new()));
        let sink = Self {
            name: name.to_owned(),
            applied: applied.clone(),
        };
        (sink, applied)
    }
}

#[async_trait]
impl Sink for MemorySink {
    fn name(&self) -> &str {
        &self.name
    }

    async fn open(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        self.applied.lock().unwrap().push(Applied {
            seq: batch.seq,
            ops: batch.ops.clone(),
        });
        Ok(WriteReport::default())
    }

    async fn close(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// What a write of one batch meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// Fails with a retryable error this many more times.
    Transient(u32),
    /// Waits until the test calls [`Faults::release`].
    Stall,
    /// Fails with a permanent error.
    Permanent,
}

/// The fault script a [`FaultySink`] follows, shared with the test.
pub(super) struct Faults {
    state: Mutex<FaultState>,
    /// Permits for stalled writes.
    release: Semaphore,
}

/// What the faulty sink was told to do and what it did.
#[derive(Debug, Default)]
pub(super) struct FaultState {
    /// Per batch `seq`, the fault its writes meet.
    plan: BTreeMap<u64, Fault>,
    /// Per batch `seq`, when each write attempt started (virtual time).
    pub(super) attempts: BTreeMap<u64, Vec<tokio::time::Instant>>,
    /// The batch whose write waits for [`Faults::release`].
    pub(super) stalled: Option<u64>,
    /// The newest batch written to the inner sink.
    pub(super) written: u64,
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
    pub(super) durable_through: u64,
    /// Flushes the runtime asked for.
    pub(super) flushes: u32,
}

impl Faults {
    /// A script without faults.
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
            release: Semaphore::new(0),
        })
    }

    /// What the sink was told and did so far.
    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.state.lock().unwrap()
    }

    /// Writes of batch `seq` meet `fault`.
    pub(super) fn plan(&self, seq: u64, fault: Fault) {
        self.state().plan.insert(seq, fault);
    }

    /// Lets one stalled write go on.
    pub(super) fn release(&self) {
        self.release.add_permits(1);
    }

    /// From now on the sink buffers: `durable_through` stays behind what it wrote until a flush
    /// (unless `hold`: then until [`Faults::report_durable`]); with `flush_every`, the sink asks
    /// for a flush that long after the last one.
    pub(super) fn buffer(&self, hold: bool, flush_every: Option<Duration>) {
        let mut state = self.state();
        state.buffering = true;
        state.hold = hold;
        state.flush_every = flush_every;
        state.next_flush = flush_every.map(after);
    }

    /// The buffered batches through `seq` become durable (reported at the next flush or write).
    pub(super) fn report_durable(&self, seq: u64) {
        let mut state = self.state();
        state.durable_through = state.durable_through.max(seq.min(state.written));
    }
}

/// `delay` from now on tokio's clock (virtual when paused), as a `std` instant.
fn after(delay: Duration) -> std::time::Instant {
    (tokio::time::Instant::now() + delay).into_std()
}

/// A sink wrapper that meets the faults its script plans.
pub(super) struct FaultySink {
    inner: Box<dyn Sink>,
    faults: Arc<Faults>,
}

impl FaultySink {
    /// `inner`, faulty as `faults` says.
    pub(super) fn new(inner: impl Sink + 'static, faults: Arc<Faults>) -> Self {
        Self {
            inner: Box::new(inner),
            faults,
        }
    }

    fn error(&self, permanent: bool, seq: u64) -> SinkError {
        let (sink, source) = (self.inner.name().to_owned(), None);
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
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
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

    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }

    fn durable_through(&self) -> Option<u64> {
        let state = self.faults.state();
        state.buffering.then_some(state.durable_through)
    }

    fn flush_deadline(&self) -> Option<std::time::Instant> {
        self.faults.state().next_flush
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
