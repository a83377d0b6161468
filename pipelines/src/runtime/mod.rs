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
//! [`TRANSACTION_BATCH_FACTOR`] times the limits (memory stays bounded). What projections emit
//! at a transaction's end (documents it reached, counted as events) is bounded by the limits
//! themselves, unstretched: it comes in chunks, and a batch cut between two chunks adds nothing to the checkpoint while its
//! keyed state is undone at restart until the emission's last batch is durable, so a crash in
//! the middle replays the whole transaction. Shutdown (SIGINT/SIGTERM) stops the source, drains,
//! flushes, checkpoints and returns normally.
//!
//! Where things are: `wiring` (the steps of a run, in order), `processor` (reading, projecting,
//! bad input), `batch` (batch assembly and the rules that cut a batch), `checkpointing`
//! (dispatch, batches in flight, the checkpointer), `delivery` (one task per target: retries,
//! acknowledgements, buffering sinks), `keyed_state`, `status`, `summary`, `progress`. The
//! contract above is unit-tested in `tests` with the in-memory source and sinks of `testing`.

mod batch;
mod checkpointing;
mod delivery;
mod history;
mod journal;
pub mod keyed_state;
mod metrics;
mod processor;
mod progress;
mod status;
mod summary;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
mod wiring;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use refract_connectors::dead_letter::Stage;
use refract_connectors::{BackfillScope, ReadMode, SinkError, SourceError};
use refract_schemas::Position;
use refract_schemas::config::{LoadedPipeline, PipelineFile, SinkConfig};
use tokio::sync::watch;

use crate::checkpoint::CheckpointError;
pub use batch::TRANSACTION_BATCH_FACTOR;
use delivery::Target;
use processor::Processor;
pub use progress::rows_bar;
pub use summary::RunSummary;
pub use wiring::pipeline_clock;
pub(crate) use wiring::{Parts, Startup};
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
    /// A sink rejected an operation with `on_error = "stop"`: the checkpoint stays before the
    /// batch that holds it.
    #[error(
        "sink `{sink}` cannot hold the operation at {} (`{}`, key `{}`): {}; \
             the checkpoint stays before its batch, so a rerun meets it again. Fix the data or the target, \
             or set `on_error = \"dead_letter\"` to record it and go on",
        .op.position, .op.table, .op.key, .op.reason
    )]
    Rejected {
        /// The sink.
        sink: String,
        /// The operation (its key shortened when long), boxed: errors stay small.
        op: Box<refract_connectors::RejectedOp>,
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
    refract_schemas::clock::wall_ms()
}

/// The directory holding a pipeline's checkpoint and state.
pub fn state_path(config: &PipelineFile) -> PathBuf {
    PathBuf::from(&config.pipeline.state_dir).join(&config.pipeline.name)
}

/// Where the pipeline's dead letters go when the file does not say.
pub fn default_dead_letter_path(config: &PipelineFile) -> PathBuf {
    state_path(config).join("dead-letters.ndjson")
}

/// Runs a pipeline until the source ends (`--until-caught-up`), `shutdown` turns true, or an
/// error stops it.
pub async fn run(
    loaded: &LoadedPipeline,
    options: RunOptions,
    shutdown: watch::Receiver<bool>,
) -> Result<RunSummary, RunError> {
    let config = &loaded.config;
    let startup = Startup::open(config).await?;
    let parts = Parts::build(config, &options);
    // The tiers' aging passes run beside the pipeline, and end with it.
    let (end_aging, aging_ended) = watch::channel(false);
    let aging = crate::tiers::age::spawn_schedule(config, &aging_ended, &shutdown);
    let result = run_parts(config, startup, parts, options, shutdown).await;
    end_aging.send_replace(true);
    for task in aging {
        let _ = task.await;
    }
    result
}

/// Runs a pipeline with parts already built ([`run`] builds them from the file; the runtime's
/// tests hand in sources and sinks in memory). Everything else (batch limits, queue depth,
/// `on_error`, dead letters, state directory) comes from `config`.
pub(crate) async fn run_parts(
    config: &PipelineFile,
    startup: Startup,
    parts: Parts,
    options: RunOptions,
    shutdown: watch::Receiver<bool>,
) -> Result<RunSummary, RunError> {
    let Startup {
        started,
        state,
        store,
        health,
    } = startup;
    let Parts {
        mut source,
        sinks,
        projections,
    } = parts;
    let resumed = wiring::load_checkpoint(&store)?;

    // Targets: the sinks in name order, then the dead-letter store.
    let dead_letters = wiring::open_dead_letters(config, &resumed)?;
    let dead_letter_location = dead_letters.location();
    let sink_names: Vec<String> = sinks.iter().map(|s| s.name.clone()).collect();
    let mut targets: Vec<Target> = sinks.into_iter().map(Target::Sink).collect();
    targets.push(Target::DeadLetters(dead_letters));

    let store = Arc::new(store);
    let (routes, keyed) =
        wiring::prepare_projections(projections, &sink_names, &store, &state, &resumed)?;
    let stop_tasks = wiring::spawn_stop_relay(shutdown.clone());
    // The checkpointer commits the newest acknowledged checkpoint, coalescing bursts.
    let (cp_tx, cp_rx) = watch::channel(resumed.clone());
    let (durable_tx, durable_rx) = watch::channel(resumed.clone());
    let checkpointer = tokio::spawn(checkpointing::checkpointer(
        store.clone(),
        resumed.clone(),
        cp_rx,
        durable_tx,
    ));
    let durable = durable_rx.clone();
    let sink_resume =
        wiring::start_source(&mut *source, &resumed, options.mode, durable_rx, &health).await?;
    let delivery = wiring::spawn_delivery(
        targets,
        config.pipeline.queue_depth,
        &sink_resume,
        &stop_tasks,
        &health,
    );

    let inputs = wiring::ProcessorInputs {
        store: store.clone(),
        routes,
        keyed,
        job_txs: delivery.job_txs,
        ack_rx: delivery.ack_rx,
        cp_tx,
        durable,
        sink_names,
        dead_letter_location,
        resumed,
        health,
    };
    let mut processor = wiring::new_processor(config, &options, inputs);
    let outcome = processor.run(&mut *source, shutdown).await;

    // Drain: the delivery tasks finish what they were sent and end, then the last checkpoint
    // is committed.
    let Processor {
        mut summary,
        job_txs,
        inflight,
        ack_rx,
        ..
    } = processor;
    if outcome.is_err() {
        stop_tasks.send_replace(true);
    }
    drop(job_txs);
    drop(inflight);
    wiring::collect_notices(delivery.tasks, ack_rx, &mut summary).await;
    let final_checkpoint = checkpointer.await.expect("checkpointer task")?;
    if outcome.is_ok() {
        source.finish().await;
    }
    summary.checkpoint = final_checkpoint;
    summary.elapsed = started.elapsed();
    summary.finish();
    wiring::conclude(config, summary, outcome).await
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
