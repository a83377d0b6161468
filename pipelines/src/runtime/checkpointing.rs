//! From batches to checkpoints: the processor dispatches each batch to its targets (after saving
//! the projection state the batch taught), tracks the batches in flight, and advances the
//! checkpoint past the leading batches every target acknowledged; the checkpointer task commits
//! it and tells the source which positions are durable.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use refract_connectors::dead_letter::{DeadLetter, Stage};
use refract_connectors::{RejectedOp, SinkBatch, SinkError};
use refract_projections::state::StateError;
use refract_schemas::config::OnError;
use refract_schemas::{Checkpoint, Offset, Position};
use tokio::sync::watch;

use super::RunError;
use super::delivery::{Ack, Job};
use super::processor::Processor;
use crate::checkpoint::{CheckpointError, CheckpointStore};

/// How much of a rejected key an error message shows (keys a sink rejects can be very long).
const SHOWN_KEY_CHARS: usize = 80;

/// A batch ready for its targets, held until its keyed state is durable.
pub(super) struct HeldBatch {
    seq: u64,
    /// What it adds to the checkpoint.
    end: BTreeMap<Arc<str>, Offset>,
    jobs: Vec<(usize, Job)>,
    oldest_commit_ms: Option<i64>,
}

/// The keyed state commit in flight, and the batch it holds back.
pub(super) struct Committing {
    pub(super) task: tokio::task::JoinHandle<Result<(), StateError>>,
    held: HeldBatch,
}

/// A dispatched batch waiting for its acknowledgements.
struct Dispatched {
    seq: u64,
    end: BTreeMap<Arc<str>, Offset>,
    pending: usize,
    /// The commit time of its oldest change (see `Batch::oldest_commit_ms`).
    oldest_commit_ms: Option<i64>,
}

/// The batches in flight, oldest first, and the checkpoint the acknowledged ones make.
pub(super) struct InFlight {
    batches: VecDeque<Dispatched>,
    next_seq: u64,
    /// The end of the newest batch that every target acknowledged, and of all batches before it.
    committed: Checkpoint,
    /// To the checkpointer.
    cp_tx: watch::Sender<Checkpoint>,
}

impl InFlight {
    /// Nothing in flight; the checkpoint is `resumed`.
    pub(super) fn new(resumed: Checkpoint, cp_tx: watch::Sender<Checkpoint>) -> Self {
        Self {
            batches: VecDeque::new(),
            next_seq: 0,
            committed: resumed,
            cp_tx,
        }
    }

    /// Whether every dispatched batch was acknowledged.
    pub(super) fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Numbers the next batch (strictly increasing, from 1).
    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Records batch `seq`, ending at `end`, as sent to `pending` targets.
    fn dispatched(
        &mut self,
        seq: u64,
        end: BTreeMap<Arc<str>, Offset>,
        pending: usize,
        oldest_commit_ms: Option<i64>,
    ) {
        self.batches.push_back(Dispatched {
            seq,
            end,
            pending,
            oldest_commit_ms,
        });
    }

    /// The commit time of the oldest change in flight (not yet durable in every target).
    pub(super) fn oldest_commit_ms(&self) -> Option<i64> {
        self.batches.iter().find_map(|b| b.oldest_commit_ms)
    }

    /// Batch `seq`, still in flight, waits for one more acknowledgement (a sink's rejected
    /// operations sent to the dead-letter store).
    fn add_pending(&mut self, seq: u64) {
        if let Some(entry) = self.batches.iter_mut().find(|f| f.seq == seq) {
            entry.pending += 1;
        }
    }

    /// One target acknowledged batch `seq`.
    fn acknowledged(&mut self, seq: u64) {
        let entry = self
            .batches
            .iter_mut()
            .find(|f| f.seq == seq)
            .expect("ack for a dispatched batch");
        entry.pending -= 1;
        self.complete_ready();
    }

    /// Advances the checkpoint past every leading batch that all its targets acknowledged.
    fn complete_ready(&mut self) {
        let mut advanced = false;
        while self.batches.front().is_some_and(|f| f.pending == 0) {
            let done = self.batches.pop_front().expect("front exists");
            for (partition, offset) in done.end {
                self.committed.insert(partition.to_string(), offset);
            }
            advanced = true;
        }
        if advanced {
            let _ = self.cp_tx.send(self.committed.clone());
        }
    }
}

impl Processor {
    /// Sends the current batch to its targets.
    pub(super) async fn dispatch(&mut self) -> Result<(), RunError> {
        // Changes outside marked transactions (a snapshot, a Kafka topic without transaction
        // metadata) take effect at the batch's end, together.
        if !self.in_transaction {
            if let Some(position) = self.last_position.take() {
                self.end_transaction(&position).await?;
            }
        }
        self.send_batch(None).await
    }

    /// Sends the current batch to its targets. `emitting`: the batch is cut in the middle of
    /// the emission of a transaction ending at that position (`Processor::end_transaction`),
    /// while state still holds some of its effects (dirty marks). Such a batch must not move
    /// the checkpoint: a restart from there would find the transaction's end behind it and
    /// never emit the rest. So it adds nothing to the checkpoint; its keyed state is tagged
    /// with its end and `emitting` (undone at restart until the checkpoint covers the whole
    /// transaction), and its end is carried into the next batch, which the emission's last
    /// chunk ends. A crash in between rolls the state back to the checkpoint before the
    /// transaction, whose replay emits everything again.
    pub(super) async fn send_batch(&mut self, emitting: Option<&Position>) -> Result<(), RunError> {
        if self.batch.is_empty() {
            self.batch.started = None;
            return Ok(());
        }
        let next = self.batch.successor();
        let mut batch = std::mem::replace(&mut self.batch, next);
        // What the keyed state's undo records are tagged with, and what the batch adds to the
        // checkpoint.
        let (state_end, end) = match emitting {
            None => (batch.end.clone(), std::mem::take(&mut batch.end)),
            Some(position) => {
                let mut state_end = batch.end.clone();
                let offset = state_end
                    .entry(position.partition.clone())
                    .or_insert(position.offset);
                *offset = (*offset).max(position.offset);
                self.batch.end = std::mem::take(&mut batch.end);
                self.batch.started = batch.started;
                (state_end, BTreeMap::new())
            }
        };
        self.save_state().await?;
        let seq = self.inflight.next_seq();
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
        let held = HeldBatch {
            seq,
            end,
            jobs,
            oldest_commit_ms: batch.oldest_commit_ms,
        };
        match self.keyed.clone() {
            None => self.deliver(held).await,
            Some(keyed) => {
                // The batch before this one goes out once its state is durable; this one's
                // state is written while the next batch is built.
                self.settle_commit().await?;
                let end = state_end.iter().map(|(p, o)| (p.to_string(), *o)).collect();
                let durable = self.durable.borrow().clone();
                let commit = keyed.begin_commit(end, &durable)?;
                self.committing = Some(Committing {
                    task: tokio::task::spawn_blocking(move || commit.run()),
                    held,
                });
                Ok(())
            }
        }
    }

    /// Waits for the keyed state commit in flight, if any, then dispatches the batch it holds.
    pub(super) async fn settle_commit(&mut self) -> Result<(), RunError> {
        if let Some(committing) = self.committing.as_mut() {
            let result = (&mut committing.task).await.expect("state commit task");
            self.commit_done(result).await?;
        }
        Ok(())
    }

    /// The keyed state commit in flight ended with `result`: dispatches the batch it held.
    pub(super) async fn commit_done(
        &mut self,
        result: Result<(), StateError>,
    ) -> Result<(), RunError> {
        let committing = self.committing.take().expect("a commit was in flight");
        result?;
        self.deliver(committing.held).await
    }

    /// Sends a batch whose state is durable to its targets.
    async fn deliver(&mut self, held: HeldBatch) -> Result<(), RunError> {
        let HeldBatch {
            seq,
            end,
            jobs,
            oldest_commit_ms,
        } = held;
        self.inflight
            .dispatched(seq, end, jobs.len(), oldest_commit_ms);
        for (target, job) in jobs {
            let queue = &self.job_txs[target];
            if queue.send(job).await.is_err() {
                // The target's task ended: its failure is waiting in the ack channel.
                return Err(self.first_failure().await);
            }
            self.metrics.queue_depth[target].set((queue.max_capacity() - queue.capacity()) as f64);
        }
        self.inflight.complete_ready();
        self.publish_pending();
        Ok(())
    }

    /// Tells the status endpoint the commit time of the oldest change read and not yet
    /// durable everywhere (the source lag).
    pub(super) fn publish_pending(&self) {
        let oldest = self
            .inflight
            .oldest_commit_ms()
            .or(self.batch.oldest_commit_ms);
        self.health.pending_since(oldest);
    }

    /// Saves what the projections learned from the batch, before any of the batch is written:
    /// their state is then never older than the checkpoint (see `Projection::take_state`). The
    /// keyed state is committed apart, with the undo records that roll it back to the
    /// checkpoint ([`Processor::send_batch`]).
    async fn save_state(&mut self) -> Result<(), RunError> {
        for route in &mut self.routes {
            if let Some(state) = route.projection.take_state() {
                let store = self.store.clone();
                let name = route.name.clone();
                tokio::task::spawn_blocking(move || store.save_state(&name, &state))
                    .await
                    .expect("state save task")?;
            }
        }
        Ok(())
    }

    /// Handles a delivery task's report.
    pub(super) async fn on_ack(&mut self, ack: Ack) -> Result<(), RunError> {
        match ack {
            Ack::Done {
                target,
                seq,
                mut report,
            } => {
                if target != self.dead_letter_target {
                    let rejected = std::mem::take(&mut report.rejected);
                    if !rejected.is_empty() {
                        self.on_rejected(target, seq, rejected).await?;
                    }
                    self.summary.add_report(target, report);
                }
                self.inflight.acknowledged(seq);
                self.publish_pending();
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

    /// Waits until every dispatched batch is acknowledged (buffering sinks are told to flush),
    /// the one waiting for its state commit dispatched first.
    pub(super) async fn drain(&mut self) -> Result<(), RunError> {
        self.settle_commit().await?;
        if !self.inflight.is_empty() {
            for tx in &self.job_txs {
                if tx.send(Job::Flush).await.is_err() {
                    return Err(self.first_failure().await);
                }
            }
        }
        while !self.inflight.is_empty() {
            match self.ack_rx.recv().await {
                Some(ack) => self.on_ack(ack).await?,
                None => break,
            }
        }
        Ok(())
    }

    /// Operations sink `target` rejected in batch `seq`: to the dead-letter store, the batch's
    /// checkpoint waiting for them too, or the error that stops the run (`on_error`), the
    /// checkpoint staying before the batch.
    async fn on_rejected(
        &mut self,
        target: usize,
        seq: u64,
        rejected: Vec<RejectedOp>,
    ) -> Result<(), RunError> {
        let sink = self.summary.sink_name(target).to_owned();
        if let (OnError::Stop, Some(op)) = (self.on_error, rejected.first()) {
            let mut op = Box::new(op.clone());
            op.key = op.key.chars().take(SHOWN_KEY_CHARS).collect();
            return Err(RunError::Rejected { sink, op });
        }
        let letters: Vec<DeadLetter> = rejected
            .into_iter()
            .map(|op| {
                tracing::warn!(sink = %sink, position = %op.position, table = %op.table, reason = %op.reason, "dead-lettering an operation the sink rejected");
                self.health.journal.dead_letter(
                    Stage::Sink,
                    op.position.to_string(),
                    &format!("sink `{sink}`: {}", op.reason),
                );
                DeadLetter {
                    position: op.position,
                    stage: Stage::Sink,
                    reason: op.reason,
                    table: Some(op.table),
                    sink: Some(sink.clone()),
                    raw: op.key.into(),
                }
            })
            .collect();
        self.summary.dead_letters += letters.len() as u64;
        super::metrics::dead_letters(Stage::Sink).increment(letters.len() as u64);
        self.inflight.add_pending(seq);
        let job = Job::Letters { seq, letters };
        if self.job_txs[self.dead_letter_target]
            .send(job)
            .await
            .is_err()
        {
            // The dead-letter task ended: its failure is waiting in the ack channel.
            return Err(Box::pin(self.first_failure()).await);
        }
        Ok(())
    }

    /// The failure a delivery task reported before it ended.
    async fn first_failure(&mut self) -> RunError {
        while let Some(ack) = self.ack_rx.recv().await {
            if let Err(e) = Box::pin(self.on_ack(ack)).await {
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

/// Commits checkpoints as they arrive, after `committed` (the one the run resumed from); returns
/// the last one committed.
///
/// It starts from `committed`, not from the channel's value when the task first runs: a
/// checkpoint sent before then is committed too.
pub(super) async fn checkpointer(
    store: Arc<CheckpointStore>,
    committed: Checkpoint,
    mut rx: watch::Receiver<Checkpoint>,
    durable: watch::Sender<Checkpoint>,
) -> Result<Checkpoint, CheckpointError> {
    let mut last = committed;
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
            for (partition, offset) in &next {
                super::metrics::checkpoint_offset(partition).set(offset.0 as f64);
            }
            last = next.clone();
            let _ = durable.send(next);
        }
        if closed {
            return Ok(last);
        }
    }
}
