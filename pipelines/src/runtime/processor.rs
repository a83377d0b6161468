//! The processor: the one task that reads the source, decodes and projects each item into the
//! batch being assembled, sets bad input aside (dead letters, or a stop), and dispatches batches
//! when they are full, due, or the source ends a unit of work. One processor keeps the order per
//! key; dispatching and acknowledgements are in [`super::checkpointing`].

use std::sync::Arc;
use std::time::Instant;

use refract_connectors::dead_letter::{DeadLetter, Stage};
use refract_connectors::{Source, SourceItem};
use refract_projections::{Emission, Projection, ProjectionError, WriteOp};
use refract_schemas::config::OnError;
use refract_schemas::event::TxStatus;
use refract_schemas::{ChangeEvent, Checkpoint, Offset, Position, Record};
use tokio::sync::{mpsc, watch};

use super::batch::{Batch, BatchLimits, route_ops};
use super::checkpointing::{Committing, InFlight};
use super::delivery::{Ack, Job};
use super::keyed_state::KeyedState;
use super::metrics::ProcessorMetrics;
use super::progress::Progress;
use super::status::Health;
use super::{PROGRESS_INTERVAL, RunError, RunSummary};
use crate::checkpoint::CheckpointStore;

/// One projection and the indexes of the sinks it writes to.
pub(super) struct Route {
    /// The projection's name in the pipeline file.
    pub(super) name: String,
    /// The projection.
    pub(super) projection: Box<dyn Projection>,
    /// Indexes of its sinks among the run's sinks.
    pub(super) sinks: Vec<usize>,
}

/// The processor: turns source items into batches and batches into acknowledged checkpoints.
pub(super) struct Processor {
    /// Where projection state is saved (the checkpoint store).
    pub(super) store: Arc<CheckpointStore>,
    pub(super) on_error: OnError,
    pub(super) limits: BatchLimits,
    pub(super) routes: Vec<Route>,
    pub(super) batch: Batch,
    /// To the delivery tasks: the sinks in order, then the dead-letter store.
    pub(super) job_txs: Vec<mpsc::Sender<Job>>,
    pub(super) dead_letter_target: usize,
    pub(super) ack_rx: mpsc::UnboundedReceiver<Ack>,
    /// Dispatched batches and the checkpoint they make.
    pub(super) inflight: InFlight,
    pub(super) in_transaction: bool,
    /// The projections' keyed state, made durable with each batch.
    pub(super) keyed: Option<KeyedState>,
    /// The keyed state commit running beside the batch being built, and the batch it holds.
    pub(super) committing: Option<Committing>,
    /// The durable checkpoint (undo records of the keyed state before it are dropped).
    pub(super) durable: watch::Receiver<Checkpoint>,
    /// The position of the last change outside a marked transaction, whose effects are due at
    /// the batch's end.
    pub(super) last_position: Option<Position>,
    pub(super) scratch: Vec<WriteOp>,
    pub(super) summary: RunSummary,
    /// Whether to draw a progress bar.
    pub(super) draw_bar: bool,
    /// The processor's metrics (no-ops without `metrics_addr`).
    pub(super) metrics: ProcessorMetrics,
    /// A terminal progress bar, when asked for and the source knows its size.
    pub(super) bar: Option<Progress>,
    /// The pipeline's clock, handed to projections as `now` (`[pipeline] clock`).
    pub(super) clock: refract_schemas::clock::Clock,
    /// Health and recent troubles, for the status endpoint (dead letters, source lag).
    pub(super) health: Arc<Health>,
}

impl Processor {
    /// Runs until the source ends or stops; returns whether the run ended because of a
    /// shutdown request.
    pub(super) async fn run(
        &mut self,
        source: &mut dyn Source,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<bool, RunError> {
        self.emit_left_marks().await?;
        let mut stopping = false;
        let mut last_progress = Instant::now();
        loop {
            let deadline = self.limits.deadline(&self.batch);
            tokio::select! {
                biased;
                ack = self.ack_rx.recv() => match ack {
                    Some(ack) => self.on_ack(ack).await?,
                    None => unreachable!("the processor holds the job senders"),
                },
                // The borrowed value is dropped at once: the run's future stays `Send`.
                _ = async { shutdown.wait_for(|s| *s).await.map(drop) }, if !stopping => {
                    tracing::info!("shutdown requested: draining and checkpointing");
                    stopping = true;
                    source.stop();
                }
                // A batch goes out as soon as its state is durable, not with the next one.
                result = async { (&mut self.committing.as_mut().expect("checked").task).await },
                    if self.committing.is_some() =>
                {
                    self.commit_done(result.expect("state commit task")).await?;
                }
                _ = sleep_until(deadline) => self.dispatch().await?,
                chunk = source.next_chunk() => match chunk? {
                    Some(items) => self.handle_chunk(source, items).await?,
                    None => break,
                },
            }
            self.report_progress(source, &mut last_progress);
        }
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        self.dispatch().await?;
        self.drain().await?;
        Ok(stopping)
    }

    /// Reads a chunk into batches, dispatching each that fills; gives the chunk back to the
    /// source. Bad input that stops the run is returned once what came before it is durable.
    async fn handle_chunk(
        &mut self,
        source: &mut dyn Source,
        mut items: Vec<SourceItem>,
    ) -> Result<(), RunError> {
        let now = self.clock.now_ms();
        // Items are handled in place (not moved out one by one: they are large), and the
        // chunk goes back to the source to be freed.
        for item in &mut items {
            // A transaction's end emits what it buffered before its END marker is in the batch:
            // a batch cut inside the emission never carries the END's position.
            if let Some(end) = transaction_end(item) {
                if let Err(e) = self.end_transaction(&end).await {
                    if matches!(
                        e,
                        RunError::ProjectionState { .. } | RunError::KeyedState(_)
                    ) {
                        self.drain().await?;
                    }
                    return Err(e);
                }
            }
            if let Err(e) = self.process(item, now) {
                // What came before bad input is written; after a state failure nothing more
                // is (the batch is replayed).
                if !matches!(
                    e,
                    RunError::ProjectionState { .. } | RunError::KeyedState(_)
                ) {
                    self.dispatch().await?;
                }
                self.drain().await?;
                return Err(e);
            }
            if self.limits.is_full(&self.batch, self.in_transaction) {
                self.dispatch().await?;
            }
        }
        if source.ends_batch() {
            self.dispatch().await?;
        }
        source.recycle(items);
        Ok(())
    }

    /// Updates the progress bar, and logs progress every [`PROGRESS_INTERVAL`].
    fn report_progress(&mut self, source: &dyn Source, last_progress: &mut Instant) {
        if let Some((done, total)) = source.progress() {
            self.bar
                .get_or_insert_with(|| Progress::new(self.draw_bar, done, total))
                .update(done, total);
        }
        if last_progress.elapsed() >= PROGRESS_INTERVAL {
            *last_progress = Instant::now();
            let progress = source.progress();
            let rate = match (&self.bar, progress) {
                (Some(bar), Some((done, total))) => Some(bar.rate(done, total)),
                _ => None,
            };
            self.summary.log_progress(progress, rate);
        }
    }

    /// Handles one source item: projects it, or records it as bad input (taking its raw bytes
    /// and reason).
    fn process(&mut self, item: &mut SourceItem, now: i64) -> Result<(), RunError> {
        let SourceItem { record, raw } = item;
        self.summary.records += 1;
        self.metrics.records_read.increment(1);
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
                    sink: None,
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
                &t.position
            }
            Ok(Record::Change(event)) => {
                self.summary.count_op(event.op);
                if self.batch.oldest_commit_ms.is_none() && event.source.ts_ms.is_some() {
                    self.batch.oldest_commit_ms = event.source.ts_ms;
                    self.publish_pending();
                }
                if let Some((stage, reason)) = self.project(event, now)? {
                    let table = Some(event.table.to_string());
                    self.reject(DeadLetter {
                        position: event.position.clone(),
                        stage,
                        reason,
                        table,
                        sink: None,
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

    /// Hands a change to every projection that reads its table, routing their operations into
    /// the batch; returns why the change is bad input, if it is (no projection reads it, or
    /// one rejected it).
    fn project(
        &mut self,
        event: &ChangeEvent,
        now: i64,
    ) -> Result<Option<(Stage, String)>, RunError> {
        let mut read = false;
        let mut rejection = None;
        for route in &mut self.routes {
            if !route.projection.reads(&event.table) {
                continue;
            }
            read = true;
            self.scratch.clear();
            // Operations appended before an error are applied too: the projection did what it
            // could, and the event goes to the dead letters for the rest.
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
        Ok(rejection)
    }

    /// The end of a source transaction at `position`: projections emit what they buffered
    /// (documents the transaction touched), in chunks that fill the batch up to
    /// [`BatchLimits::emission_room`] (the batch limits, not stretched); a full batch is cut between two chunks as part of the
    /// emission ([`Processor::send_batch`]), so memory stays bounded however many documents the
    /// transaction reaches. Returns how many operations the projections emitted.
    pub(super) async fn end_transaction(&mut self, position: &Position) -> Result<usize, RunError> {
        let mut emitted = 0;
        if self.keyed.is_none() {
            return Ok(emitted);
        }
        for r in 0..self.routes.len() {
            loop {
                let room = self.limits.emission_room(&self.batch);
                if room == 0 {
                    self.send_batch(Some(position)).await?;
                    continue;
                }
                let route = &mut self.routes[r];
                self.scratch.clear();
                let result = route
                    .projection
                    .end_transaction(position, room, &mut self.scratch);
                self.batch.emitted += self.scratch.len();
                emitted += self.scratch.len();
                route_ops(&mut self.batch.ops, &route.sinks, &mut self.scratch);
                let emission = result.map_err(|e| RunError::ProjectionState {
                    projection: route.name.clone(),
                    reason: e.to_string(),
                })?;
                if emission == Emission::Done {
                    break;
                }
            }
        }
        Ok(emitted)
    }

    /// Emits, before anything is read, what the projections' state still marks from a
    /// transaction the checkpoint ends inside, for a source that will not hand out that
    /// transaction's end again. The PostgreSQL source reads again the last table of a snapshot
    /// whose framing END was not durable (its chunks end the marks' transaction); this is the
    /// net under what that misses (an empty last table), so documents never wait for the next
    /// change. A transaction the stream replays is emitted at its first batch's end anyway, so
    /// this only comes first. The emission is tagged just past the checkpoint
    /// ([`Processor::send_batch`] with an emitting position): a crash before it is durable
    /// undoes it and the next start emits again. Only for a checkpoint of one partition (a
    /// position past one partition says nothing of another's).
    async fn emit_left_marks(&mut self) -> Result<(), RunError> {
        if self.keyed.is_none() {
            return Ok(());
        }
        let position = {
            let durable = self.durable.borrow();
            let mut partitions = durable.iter();
            match (partitions.next(), partitions.next()) {
                (Some((partition, offset)), None) => Position {
                    partition: partition.as_str().into(),
                    offset: just_after(*offset),
                },
                _ => return Ok(()),
            }
        };
        let emitted = self.end_transaction(&position).await?;
        if emitted > 0 {
            tracing::info!(position = %position, documents = emitted, "documents an interrupted transaction marked, written before reading on");
        }
        self.send_batch(Some(&position)).await
    }

    /// Bad input: into the batch's dead letters, or the error that stops the run
    /// (`on_error`).
    fn reject(&mut self, letter: DeadLetter) -> Result<(), RunError> {
        match self.on_error {
            OnError::DeadLetter => {
                tracing::warn!(position = %letter.position, stage = ?letter.stage, reason = %letter.reason, "dead-lettering bad input");
                self.summary.dead_letters += 1;
                super::metrics::dead_letters(letter.stage).increment(1);
                self.health.journal.dead_letter(
                    letter.stage,
                    letter.position.to_string(),
                    &letter.reason,
                );
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
}

/// The position of `item` when it is a transaction's END marker.
fn transaction_end(item: &SourceItem) -> Option<Position> {
    match &item.record {
        Ok(Record::Transaction(t)) if t.status == TxStatus::End => Some(t.position.clone()),
        _ => None,
    }
}

/// The least offset after `offset`: the next sequence number in its unit, or the next unit's
/// first after a transaction's end (which takes the greatest sequence number).
fn just_after(offset: Offset) -> Offset {
    match offset.1.checked_add(1) {
        Some(seq) => Offset(offset.0, seq),
        None => Offset(offset.0.saturating_add(1), 0),
    }
}

/// Waits until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
