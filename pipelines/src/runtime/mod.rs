//! The runtime: wires a source, projections and sinks, batches, tracks what is durable, and owns
//! the checkpoint.
//!
//! ```text
//! source ──chunks──▶ processor ──batch N──▶ sink task 1 ──ack──┐
//!  (bounded)         (decode errors,  ├──▶ sink task 2 ──ack──┤
//!                     projections)    └──▶ dead letters ─ack──┤
//!                         ▲                                    │
//!                         └────────── acks (in order) ◀────────┘
//!                                       │ checkpoint = end of the newest batch that every
//!                                       ▼ target acknowledged, and of all batches before it
//!                                 checkpointer (redb, fsync) ──▶ source (durable positions)
//! ```
//!
//! Backpressure: every queue is bounded (source chunks, `queue_depth` batches per sink), so a slow
//! sink pauses the source. Order per key: one processor, and each sink applies its batches in
//! order. A batch is not cut inside a source transaction unless it grows past
//! [`TRANSACTION_BATCH_FACTOR`] times the limits (memory stays bounded). Shutdown (SIGINT/SIGTERM)
//! stops the source, drains, flushes, checkpoints and returns normally.

mod delivery;
pub mod keyed_state;
mod status;
mod summary;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refract_connectors::dead_letter::{DeadLetter, DeadLetterStore, Stage};
use refract_connectors::{
    BackfillScope, ReadMode, SinkBatch, SinkError, SourceContext, SourceError, SourceItem, registry,
};
use refract_projections::{Projection, ProjectionError, WriteOp};
use refract_schemas::config::{LoadedPipeline, OnError, PipelineFile, SinkConfig, mask_url};
use refract_schemas::event::TxStatus;
use refract_schemas::{Checkpoint, Offset, Position, Record};
use tokio::sync::{mpsc, watch};

use crate::checkpoint::{self, CheckpointError, CheckpointStore};
use delivery::{Ack, Job, Target};
use keyed_state::KeyedState;
pub use summary::RunSummary;

/// How far past the batch limits a batch may grow to avoid splitting a source transaction.
pub const TRANSACTION_BATCH_FACTOR: usize = 4;
/// How often a long run logs its progress.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// Why a run ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The source failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// A sink failed permanently.
    #[error(transparent)]
    Sink(SinkError),
    /// Shutdown was requested while a sink was still failing: the checkpoint stayed before the
    /// undelivered changes, which the next run replays.
    #[error(
        "stopped on request while a sink was failing ({0}); the checkpoint stays before the undelivered changes, \
             which the next run replays"
    )]
    Interrupted(SinkError),
    /// The checkpoint store failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Bad input with `on_error = "stop"`: everything before it is durable and checkpointed.
    #[error(
        "bad input at {position} ({stage:?}): {reason}; everything before it was written and checkpointed. \
             Fix the input, or set `on_error = \"dead_letter\"` to record it and go on"
    )]
    BadInput {
        /// Where the input is.
        position: Position,
        /// Which stage rejected it.
        stage: Stage,
        /// Why.
        reason: String,
    },
    /// A projection's saved state could not be restored.
    #[error(
        "projection `{projection}`: {reason}; delete the pipeline's state directory to start over"
    )]
    ProjectionState {
        /// The projection.
        projection: String,
        /// Why.
        reason: String,
    },
    /// The projections' keyed state store failed.
    #[error(
        "projection state: {0}; the pipeline stops (its state on disk stays consistent with the checkpoint)"
    )]
    KeyedState(#[from] refract_projections::state::StateError),
    /// The state directory could not be prepared.
    #[error("state directory {path}: {source}")]
    State {
        /// The directory.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

/// Options of one run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Follow the source, or stop once caught up.
    pub mode: ReadMode,
    /// Re-read existing rows into the read models (`refract backfill`).
    pub backfill: Option<BackfillScope>,
    /// Draw a progress bar on a terminal when the source reports its size.
    pub progress_bar: bool,
}

/// The wall clock in milliseconds since the epoch (handed to projections, stamped on dead letters).
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The directory holding a pipeline's checkpoint and state.
pub fn state_path(config: &PipelineFile) -> PathBuf {
    PathBuf::from(&config.pipeline.state_dir).join(&config.pipeline.name)
}

/// Where the pipeline's dead letters go when the file does not say.
pub fn default_dead_letter_path(config: &PipelineFile) -> PathBuf {
    state_path(config).join("dead-letters.ndjson")
}

/// The batch being assembled.
struct Batch {
    ops: Vec<Vec<WriteOp>>,
    letters: Vec<DeadLetter>,
    end: BTreeMap<Arc<str>, Offset>,
    events: usize,
    bytes: usize,
    started: Option<Instant>,
}

impl Batch {
    fn new(sinks: usize) -> Self {
        Self {
            ops: vec![Vec::new(); sinks],
            letters: Vec::new(),
            end: BTreeMap::new(),
            events: 0,
            bytes: 0,
            started: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.end.is_empty()
    }
}

/// A dispatched batch waiting for its acknowledgements.
struct InFlight {
    seq: u64,
    end: BTreeMap<Arc<str>, Offset>,
    pending: usize,
}

/// One projection and the indexes of the sinks it writes to.
struct Route {
    name: String,
    projection: Box<dyn Projection>,
    sinks: Vec<usize>,
}

/// Runs a pipeline until the source ends (`--until-caught-up`), `shutdown` turns true, or an
/// error stops it.
pub async fn run(
    loaded: &LoadedPipeline,
    options: RunOptions,
    shutdown: watch::Receiver<bool>,
) -> Result<RunSummary, RunError> {
    let config = &loaded.config;
    let started = Instant::now();
    let state = state_path(config);
    std::fs::create_dir_all(&state).map_err(|source| RunError::State {
        path: state.clone(),
        source,
    })?;
    let store = CheckpointStore::open(&state.join(checkpoint::FILE))?;
    let health = Arc::new(status::Health::default());
    if let Some(addr) = &config.pipeline.metrics_addr {
        status::serve(addr, &config.pipeline.name, health.clone()).await;
    }
    let resumed = store.load()?;
    if !resumed.is_empty() {
        tracing::info!(checkpoint = ?resumed, "resuming after the checkpoint");
    }

    // Targets: the sinks in name order, then the dead-letter store.
    let sink_names: Vec<String> = config.sinks.keys().cloned().collect();
    let dead_letters = match &config.pipeline.dead_letter.url {
        Some(url) => DeadLetterStore::open_url(url),
        None => {
            let path = config
                .pipeline
                .dead_letter
                .path
                .as_ref()
                .map_or_else(|| default_dead_letter_path(config), PathBuf::from);
            DeadLetterStore::open_file(path, &resumed)
        }
    }
    .map_err(RunError::Sink)?;
    let dead_letter_location = dead_letters.location();
    let mut targets: Vec<Target> = config
        .sinks
        .iter()
        .map(|(name, c)| Target::Sink(registry::build_sink(name, c)))
        .collect();
    targets.push(Target::DeadLetters(dead_letters));
    let dead_letter_target = targets.len() - 1;

    let store = Arc::new(store);
    let mut routes: Vec<Route> = config
        .projections
        .iter()
        .map(|(name, c)| Route {
            name: name.clone(),
            projection: refract_projections::build(c),
            sinks: c
                .sinks()
                .iter()
                .map(|s| {
                    sink_names
                        .iter()
                        .position(|n| n == s)
                        .expect("validated sink name")
                })
                .collect(),
        })
        .collect();
    for route in &mut routes {
        if let Some(state) = store.load_state(&route.name)? {
            route
                .projection
                .restore_state(&state)
                .map_err(|reason| RunError::ProjectionState {
                    projection: route.name.clone(),
                    reason,
                })?;
        }
    }
    // Keyed state (a document projection's rows and indexes), rolled back to the checkpoint.
    let keyed = if routes.iter().any(|r| r.projection.wants_store()) {
        let path = state.join("state.redb");
        let (keyed, recovery) = KeyedState::open(&path, &resumed)?;
        if recovery.batches_undone > 0 {
            tracing::info!(
                batches = recovery.batches_undone,
                keys = recovery.keys_restored,
                "projection state rolled back to the checkpoint"
            );
        }
        for route in routes.iter_mut().filter(|r| r.projection.wants_store()) {
            route.projection.attach_store(keyed.handle(&route.name));
        }
        Some(keyed)
    } else {
        None
    };

    // Delivery tasks give up retrying when asked to stop, or when the run fails elsewhere.
    let stop_tasks = Arc::new(watch::channel(false).0);
    {
        let (stop_tasks, mut shutdown) = (stop_tasks.clone(), shutdown.clone());
        tokio::spawn(async move {
            if shutdown.wait_for(|s| *s).await.is_ok() {
                stop_tasks.send_replace(true);
            }
        });
    }
    // The checkpointer commits the newest acknowledged checkpoint, coalescing bursts.
    let (cp_tx, cp_rx) = watch::channel(resumed.clone());
    let (durable_tx, durable_rx) = watch::channel(resumed.clone());
    let checkpointer = tokio::spawn(checkpointer(store.clone(), cp_rx, durable_tx));

    let context = SourceContext {
        pipeline: config.pipeline.name.clone(),
        state_dir: state_path(config),
        backfill: options.backfill.clone(),
    };
    let mut source = registry::build_source(&config.source, context);
    let durable = durable_rx.clone();
    source.start(&resumed, options.mode, durable_rx).await?;
    // Sinks that publish ahead of the checkpoint (Parquet files) drop what the replay rewrites,
    // also in partitions the checkpoint does not name yet: a first run killed before its first
    // checkpoint left files that the source now hands out again.
    let mut sink_resume = resumed.clone();
    for (partition, offset) in source.resumes_unnamed() {
        sink_resume.entry(partition).or_insert(offset);
    }

    let (ack_tx, ack_rx) = mpsc::unbounded_channel();
    let mut job_txs = Vec::with_capacity(targets.len());
    let mut tasks = Vec::with_capacity(targets.len());
    for (index, target) in targets.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel(config.pipeline.queue_depth);
        job_txs.push(tx);
        let name = match &target {
            Target::Sink(s) => s.name.clone(),
            Target::DeadLetters(_) => "dead_letter".to_owned(),
        };
        let task = tokio::spawn(delivery::run(
            index,
            target,
            sink_resume.clone(),
            rx,
            ack_tx.clone(),
            stop_tasks.subscribe(),
            health.clone(),
        ));
        // A task that panics (a bug in a sink or a library it uses) fails the run loudly
        // instead of leaving the processor waiting for its acknowledgements.
        let acks = ack_tx.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = task.await {
                if e.is_panic() {
                    let panic = e.into_panic();
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".to_owned());
                    let _ = acks.send(Ack::Failed {
                        error: SinkError::Permanent {
                            sink: name,
                            message: format!("the sink's task panicked: {what}"),
                            source: None,
                        },
                        shutdown: false,
                    });
                }
            }
        }));
    }
    drop(ack_tx);

    let mut processor = Processor {
        store: store.clone(),
        on_error: config.pipeline.on_error,
        max_events: config.pipeline.batch.max_events,
        max_bytes: config.pipeline.batch.max_bytes as usize,
        max_delay: Duration::from_millis(config.pipeline.batch.max_delay_ms),
        routes,
        batch: Batch::new(sink_names.len()),
        job_txs,
        dead_letter_target,
        ack_rx,
        inflight: VecDeque::new(),
        next_seq: 0,
        committed: resumed.clone(),
        cp_tx,
        in_transaction: false,
        keyed,
        durable,
        last_position: None,
        scratch: Vec::new(),
        summary: RunSummary::new(sink_names, dead_letter_location, resumed),
        draw_bar: options.progress_bar,
        bar: None,
        records_metric: metrics::counter!("refract_records_read_total"),
        dead_letters_metric: metrics::counter!("refract_dead_letters_total"),
    };
    for (name, sink) in &config.sinks {
        let location = match sink {
            SinkConfig::ObjectJson(o) => mask_url(&o.url),
            SinkConfig::Redis(r) => mask_url(&r.url),
            SinkConfig::Parquet(p) => mask_url(&p.url),
            SinkConfig::Postgres(p) => format!("{} ({}.{})", mask_url(&p.url), p.schema, p.table),
            SinkConfig::Null(_) => "discarded".to_owned(),
        };
        processor
            .summary
            .sink_locations
            .insert(name.clone(), location);
    }
    let outcome = processor.run(&mut *source, shutdown).await;
    let Processor {
        mut summary,
        job_txs,
        cp_tx,
        mut ack_rx,
        ..
    } = processor;
    if outcome.is_err() {
        stop_tasks.send_replace(true);
    }
    drop(job_txs);
    drop(cp_tx);
    for task in tasks {
        let _ = task.await;
    }
    while let Ok(ack) = ack_rx.try_recv() {
        if let Ack::Notice(notice) = ack {
            tracing::warn!("{notice}");
            summary.notices.push(notice);
        }
    }
    let final_checkpoint = checkpointer.await.expect("checkpointer task")?;
    if outcome.is_ok() {
        source.finish().await;
    }
    summary.checkpoint = final_checkpoint;
    summary.elapsed = started.elapsed();
    summary.finish();
    match outcome {
        Ok(stopped_by_signal) => {
            summary.stopped_by_signal = stopped_by_signal;
            // The source ended (caught up, or a file read to its end): current-state tables
            // are rebuilt so that they hold everything this run wrote.
            if !stopped_by_signal {
                for (sink, report) in compact(config).await.map_err(RunError::Sink)? {
                    summary.compacted.push(format!(
                        "sink `{sink}`: current state of {} table(s) rebuilt ({} rows, {} change file(s) merged)",
                        report.tables, report.rows, report.files_read
                    ));
                }
            }
            Ok(summary)
        }
        Err(e) => {
            tracing::error!(checkpoint = ?summary.checkpoint, "pipeline stopped: {e}");
            Err(e)
        }
    }
}

/// Rebuilds the current-state tables of every Parquet sink from their change logs
/// (`refract compact`, and the end of a run whose source ended).
pub async fn compact(
    config: &PipelineFile,
) -> Result<Vec<(String, refract_connectors::sinks::parquet::CompactReport)>, SinkError> {
    let mut reports = Vec::new();
    for (name, sink) in &config.sinks {
        if let SinkConfig::Parquet(p) = sink {
            let report = refract_connectors::sinks::parquet::compact(name, p).await?;
            tracing::info!(sink = %name, tables = report.tables, rows = report.rows, files_read = report.files_read, files_deleted = report.files_deleted, row_groups_copied = report.row_groups_copied, superseded = report.superseded, "current state rebuilt");
            reports.push((name.clone(), report));
        }
    }
    Ok(reports)
}

/// Commits checkpoints as they arrive; returns the last one committed.
async fn checkpointer(
    store: Arc<CheckpointStore>,
    mut rx: watch::Receiver<Checkpoint>,
    durable: watch::Sender<Checkpoint>,
) -> Result<Checkpoint, CheckpointError> {
    let mut last = rx.borrow().clone();
    loop {
        let closed = rx.changed().await.is_err();
        let next = rx.borrow_and_update().clone();
        if next != last {
            let s = store.clone();
            let cp = next.clone();
            tokio::task::spawn_blocking(move || s.commit(&cp))
                .await
                .expect("checkpoint commit task")?;
            tracing::debug!(checkpoint = ?next, "checkpoint committed");
            last = next.clone();
            let _ = durable.send(next);
        }
        if closed {
            return Ok(last);
        }
    }
}

/// The processor: turns source items into batches and batches into acknowledged checkpoints.
struct Processor {
    /// Where projection state is saved (the checkpoint store).
    store: Arc<CheckpointStore>,
    on_error: OnError,
    max_events: usize,
    max_bytes: usize,
    max_delay: Duration,
    routes: Vec<Route>,
    batch: Batch,
    job_txs: Vec<mpsc::Sender<Job>>,
    dead_letter_target: usize,
    ack_rx: mpsc::UnboundedReceiver<Ack>,
    inflight: VecDeque<InFlight>,
    next_seq: u64,
    committed: Checkpoint,
    cp_tx: watch::Sender<Checkpoint>,
    in_transaction: bool,
    /// The projections' keyed state, made durable with each batch.
    keyed: Option<KeyedState>,
    /// The durable checkpoint (undo records of the keyed state before it are dropped).
    durable: watch::Receiver<Checkpoint>,
    /// The position of the last change outside a marked transaction, whose effects are due at
    /// the batch's end.
    last_position: Option<Position>,
    scratch: Vec<WriteOp>,
    summary: RunSummary,
    /// Whether to draw a progress bar.
    draw_bar: bool,
    /// `refract_records_read_total` (a no-op without `metrics_addr`).
    records_metric: metrics::Counter,
    /// `refract_dead_letters_total`.
    dead_letters_metric: metrics::Counter,
    /// A terminal progress bar, when asked for and the source knows its size.
    bar: Option<Progress>,
}

/// A progress bar of rows on stderr (drawn only on a terminal): rows, rows/s, ETA.
pub fn rows_bar(total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {human_pos}/{human_len} rows  {per_sec}  ETA {eta}  {msg}",
        )
        .expect("a valid progress template"),
    );
    bar
}

/// Progress of a source that knows its size: a bar on a terminal, rate and ETA in the log.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    first: u64,
}

impl Progress {
    fn new(draw: bool, done: u64, total: u64) -> Self {
        let bar = draw.then(|| {
            let bar = rows_bar(total);
            bar.set_position(done);
            bar
        });
        Self {
            bar,
            started: Instant::now(),
            first: done,
        }
    }

    fn update(&self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
        }
    }

    /// Rows per second and seconds left, for the log.
    fn rate(&self, done: u64, total: u64) -> (f64, Option<f64>) {
        let secs = self.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            done.saturating_sub(self.first) as f64 / secs
        } else {
            0.0
        };
        let eta = (rate > 0.0).then(|| total.saturating_sub(done) as f64 / rate);
        (rate, eta)
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Processor {
    /// Returns whether the run ended because of a shutdown request.
    async fn run(
        &mut self,
        source: &mut dyn refract_connectors::Source,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<bool, RunError> {
        let mut stopping = false;
        let mut last_progress = Instant::now();
        loop {
            let deadline = self
                .batch
                .started
                .map(|s| tokio::time::Instant::from_std(s + self.max_delay));
            tokio::select! {
                biased;
                ack = self.ack_rx.recv() => match ack {
                    Some(ack) => self.on_ack(ack)?,
                    None => unreachable!("the processor holds the job senders"),
                },
                _ = shutdown.wait_for(|s| *s), if !stopping => {
                    tracing::info!("shutdown requested: draining and checkpointing");
                    stopping = true;
                    source.stop();
                }
                _ = sleep_until(deadline) => self.dispatch().await?,
                chunk = source.next_chunk() => match chunk? {
                    Some(mut items) => {
                        let now = crate::runtime::now_ms();
                        // Items are handled in place (not moved out one by one: they are
                        // large), and the chunk goes back to the source to be freed.
                        for item in &mut items {
                            if let Err(e) = self.process(item, now) {
                                // What came before bad input is written; after a state
                                // failure nothing more is (the batch is replayed).
                                if !matches!(e, RunError::ProjectionState { .. } | RunError::KeyedState(_)) {
                                    self.dispatch().await?;
                                }
                                self.drain().await?;
                                return Err(e);
                            }
                            if self.batch_full() {
                                self.dispatch().await?;
                            }
                        }
                        if source.ends_batch() {
                            self.dispatch().await?;
                        }
                        source.recycle(items);
                    }
                    None => break,
                },
            }
            if let Some((done, total)) = source.progress() {
                self.bar
                    .get_or_insert_with(|| Progress::new(self.draw_bar, done, total))
                    .update(done, total);
            }
            if last_progress.elapsed() >= PROGRESS_INTERVAL {
                last_progress = Instant::now();
                let progress = source.progress();
                let rate = match (&self.bar, progress) {
                    (Some(bar), Some((done, total))) => Some(bar.rate(done, total)),
                    _ => None,
                };
                self.summary.log_progress(progress, rate);
            }
        }
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        self.dispatch().await?;
        self.drain().await?;
        Ok(stopping)
    }

    fn batch_full(&self) -> bool {
        let b = &self.batch;
        let over = |factor: usize| {
            b.events >= self.max_events * factor || b.bytes >= self.max_bytes * factor
        };
        if self.in_transaction {
            over(TRANSACTION_BATCH_FACTOR)
        } else {
            over(1)
        }
    }

    /// Handles one source item: projects it, or records it as bad input (taking its raw bytes
    /// and reason).
    fn process(&mut self, item: &mut SourceItem, now: i64) -> Result<(), RunError> {
        let SourceItem { record, raw } = item;
        self.summary.records += 1;
        self.records_metric.increment(1);
        if self.batch.started.is_none() {
            self.batch.started = Some(Instant::now());
        }
        self.batch.events += 1;
        self.batch.bytes += raw.len();
        let position = match record {
            Err(e) => {
                self.reject(DeadLetter {
                    position: e.position.clone(),
                    stage: Stage::Decode,
                    reason: std::mem::take(&mut e.reason),
                    table: None,
                    raw: std::mem::take(raw),
                })?;
                &e.position
            }
            Ok(Record::Tombstone(p)) => {
                self.summary.tombstones += 1;
                &*p
            }
            Ok(Record::Transaction(t)) => {
                self.summary.transactions += u64::from(t.status == TxStatus::End);
                self.in_transaction = t.status == TxStatus::Begin;
                if t.status == TxStatus::End {
                    self.end_transaction(&t.position)?;
                }
                &t.position
            }
            Ok(Record::Change(event)) => {
                self.summary.count_op(event.op);
                let mut read = false;
                let mut rejection = None;
                for route in &mut self.routes {
                    if !route.projection.reads(&event.table) {
                        continue;
                    }
                    read = true;
                    self.scratch.clear();
                    // Operations appended before an error are applied too: the projection
                    // did what it could, and the event goes to the dead letters for the rest.
                    let result = route.projection.project(event, now, &mut self.scratch);
                    route_ops(&mut self.batch.ops, &route.sinks, &mut self.scratch);
                    if let Err(ProjectionError::State(reason)) = &result {
                        return Err(RunError::ProjectionState {
                            projection: route.name.clone(),
                            reason: reason.clone(),
                        });
                    }
                    if let Err(e) = result {
                        rejection = Some((
                            Stage::Projection,
                            format!("projection `{}`: {e}", route.name),
                        ));
                    }
                }
                if !read {
                    rejection = Some((
                        Stage::Routing,
                        format!("no projection reads table `{}`", event.table),
                    ));
                }
                if self.keyed.is_some() && !self.in_transaction {
                    self.last_position = Some(event.position.clone());
                }
                if let Some((stage, reason)) = rejection {
                    let table = Some(event.table.to_string());
                    self.reject(DeadLetter {
                        position: event.position.clone(),
                        stage,
                        reason,
                        table,
                        raw: std::mem::take(raw),
                    })?;
                }
                &event.position
            }
        };
        match self.batch.end.get_mut(&position.partition) {
            Some(end) => *end = position.offset,
            None => {
                self.batch
                    .end
                    .insert(position.partition.clone(), position.offset);
            }
        }
        Ok(())
    }

    /// The end of a source transaction at `position`: projections emit what they buffered
    /// (documents the transaction touched).
    fn end_transaction(&mut self, position: &Position) -> Result<(), RunError> {
        if self.keyed.is_none() {
            return Ok(());
        }
        for route in &mut self.routes {
            self.scratch.clear();
            let result = route
                .projection
                .end_transaction(position, &mut self.scratch);
            route_ops(&mut self.batch.ops, &route.sinks, &mut self.scratch);
            result.map_err(|e| RunError::ProjectionState {
                projection: route.name.clone(),
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }

    fn reject(&mut self, letter: DeadLetter) -> Result<(), RunError> {
        match self.on_error {
            OnError::DeadLetter => {
                tracing::warn!(position = %letter.position, stage = ?letter.stage, reason = %letter.reason, "dead-lettering bad input");
                self.summary.dead_letters += 1;
                self.dead_letters_metric.increment(1);
                self.batch.letters.push(letter);
                Ok(())
            }
            OnError::Stop => {
                // The bad record itself is not part of the batch: its position is not checkpointed.
                self.batch.events -= 1;
                Err(RunError::BadInput {
                    position: letter.position,
                    stage: letter.stage,
                    reason: letter.reason,
                })
            }
        }
    }

    /// Sends the current batch to its targets.
    async fn dispatch(&mut self) -> Result<(), RunError> {
        // Changes outside marked transactions (a snapshot, a Kafka topic without transaction
        // metadata) take effect at the batch's end, together.
        if !self.in_transaction {
            if let Some(position) = self.last_position.take() {
                self.end_transaction(&position)?;
            }
        }
        if self.batch.is_empty() {
            self.batch.started = None;
            return Ok(());
        }
        // The next batch starts with room for as many operations per sink as this one had: a
        // steady flow (a snapshot) does not regrow vectors of operations batch after batch.
        let next = Batch {
            ops: self
                .batch
                .ops
                .iter()
                .map(|ops| Vec::with_capacity(ops.len()))
                .collect(),
            ..Batch::new(0)
        };
        let batch = std::mem::replace(&mut self.batch, next);
        // State the projections learned from this batch is saved before any of the batch is
        // written: it is then never older than the checkpoint (see `Projection::take_state`).
        for route in &mut self.routes {
            if let Some(state) = route.projection.take_state() {
                let store = self.store.clone();
                let name = route.name.clone();
                tokio::task::spawn_blocking(move || store.save_state(&name, &state))
                    .await
                    .expect("state save task")?;
            }
        }
        // So is the keyed state, with the undo records that roll it back to the checkpoint.
        if let Some(keyed) = &self.keyed {
            let keyed = keyed.clone();
            let end = batch.end.iter().map(|(p, o)| (p.to_string(), *o)).collect();
            let durable = self.durable.borrow().clone();
            tokio::task::spawn_blocking(move || keyed.commit(end, &durable))
                .await
                .expect("state commit task")?;
        }
        self.next_seq += 1;
        let seq = self.next_seq;
        let mut jobs: Vec<(usize, Job)> = Vec::new();
        for (target, ops) in batch.ops.into_iter().enumerate() {
            if !ops.is_empty() {
                jobs.push((target, Job::Ops(SinkBatch { seq, ops })));
            }
        }
        if !batch.letters.is_empty() {
            jobs.push((
                self.dead_letter_target,
                Job::Letters {
                    seq,
                    letters: batch.letters,
                },
            ));
        }
        self.inflight.push_back(InFlight {
            seq,
            end: batch.end,
            pending: jobs.len(),
        });
        for (target, job) in jobs {
            if self.job_txs[target].send(job).await.is_err() {
                // The target's task ended: its failure is waiting in the ack channel.
                return Err(self.first_failure().await);
            }
        }
        self.complete_ready();
        Ok(())
    }

    fn on_ack(&mut self, ack: Ack) -> Result<(), RunError> {
        match ack {
            Ack::Done {
                target,
                seq,
                report,
            } => {
                if target != self.dead_letter_target {
                    self.summary.add_report(target, report);
                }
                let entry = self
                    .inflight
                    .iter_mut()
                    .find(|f| f.seq == seq)
                    .expect("ack for a dispatched batch");
                entry.pending -= 1;
                self.complete_ready();
                Ok(())
            }
            Ack::Failed {
                error,
                shutdown: true,
            } => Err(RunError::Interrupted(error)),
            Ack::Failed { error, .. } => Err(RunError::Sink(error)),
            Ack::Notice(notice) => {
                self.summary.notices.push(notice);
                Ok(())
            }
        }
    }

    /// Advances the checkpoint past every leading batch that all its targets acknowledged.
    fn complete_ready(&mut self) {
        let mut advanced = false;
        while self.inflight.front().is_some_and(|f| f.pending == 0) {
            let done = self.inflight.pop_front().expect("front exists");
            for (partition, offset) in done.end {
                self.committed.insert(partition.to_string(), offset);
            }
            advanced = true;
        }
        if advanced {
            let _ = self.cp_tx.send(self.committed.clone());
        }
    }

    /// Waits until every dispatched batch is acknowledged (buffering sinks are told to flush).
    async fn drain(&mut self) -> Result<(), RunError> {
        if !self.inflight.is_empty() {
            for tx in &self.job_txs {
                if tx.send(Job::Flush).await.is_err() {
                    return Err(self.first_failure().await);
                }
            }
        }
        while !self.inflight.is_empty() {
            match self.ack_rx.recv().await {
                Some(ack) => self.on_ack(ack)?,
                None => break,
            }
        }
        Ok(())
    }

    async fn first_failure(&mut self) -> RunError {
        while let Some(ack) = self.ack_rx.recv().await {
            if let Err(e) = self.on_ack(ack) {
                return e;
            }
        }
        RunError::Sink(SinkError::Permanent {
            sink: "?".into(),
            message: "a sink task ended unexpectedly".into(),
            source: None,
        })
    }
}

/// Moves a projection's operations into the batch of each sink it writes to.
fn route_ops(batch: &mut [Vec<WriteOp>], sinks: &[usize], ops: &mut Vec<WriteOp>) {
    for (i, &sink) in sinks.iter().enumerate() {
        if i + 1 == sinks.len() {
            batch[sink].append(ops);
        } else {
            batch[sink].extend(ops.iter().cloned());
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
