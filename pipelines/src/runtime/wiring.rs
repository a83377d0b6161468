//! The steps of a run, in the order [`super::run_parts`] takes them: open the state directory
//! and the checkpoint, build the parts, wire the projections, the checkpointer, the source and
//! one delivery task per target to the processor, and at the end collect what the tasks left
//! and write the summary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use refract_connectors::dead_letter::DeadLetterStore;
use refract_connectors::{
    BuiltSink, ReadMode, SinkError, Source, SourceContext, SourceError, registry,
};
use refract_projections::Projection;
use refract_schemas::Checkpoint;
use refract_schemas::config::{PipelineFile, SinkConfig};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::batch::{Batch, BatchLimits};
use super::checkpointing::InFlight;
use super::delivery::{self, Ack, Job, Target};
use super::keyed_state::KeyedState;
use super::metrics::ProcessorMetrics;
use super::processor::{Processor, Route};
use super::{RunError, RunOptions, RunSummary, compact, default_dead_letter_path, state_path};
use crate::checkpoint::{self, CheckpointStore};
use crate::runtime::status;

/// What a run opens before its connectors are built: the state directory with its checkpoint
/// store, and the status endpoint (first, so that the metrics handles the connectors make when
/// built are recorded).
pub(crate) struct Startup {
    /// When the run started.
    pub(super) started: Instant,
    /// The pipeline's state directory.
    pub(super) state: PathBuf,
    /// Its checkpoint store.
    pub(super) store: CheckpointStore,
    /// Health of the source and the sinks, served at `/health` and `/ready`.
    pub(super) health: Arc<status::Health>,
}

impl Startup {
    /// Creates the state directory, opens the checkpoint store and serves the status endpoint
    /// (`metrics_addr`).
    pub(crate) async fn open(config: &PipelineFile) -> Result<Self, RunError> {
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
        Ok(Self {
            started,
            state,
            store,
            health,
        })
    }
}

/// The connectors and projections of a run, built (not started): from the pipeline file by
/// [`Parts::build`], or in memory by the runtime's tests.
pub(crate) struct Parts {
    /// The source.
    pub(crate) source: Box<dyn Source>,
    /// The sinks, in the order of the file's `[sinks]` (by name).
    pub(crate) sinks: Vec<BuiltSink>,
    /// The projections.
    pub(crate) projections: Vec<ProjectionPart>,
}

/// A projection with its name and the names of the sinks it writes to.
pub(crate) struct ProjectionPart {
    /// Its name in the pipeline file.
    pub(crate) name: String,
    /// The projection.
    pub(crate) projection: Box<dyn Projection>,
    /// The sinks it writes to.
    pub(crate) sinks: Vec<String>,
}

impl Parts {
    /// Builds the source, sinks and projections the pipeline file configures (through the
    /// connectors' registry).
    pub(crate) fn build(config: &PipelineFile, options: &RunOptions) -> Self {
        let context = SourceContext {
            pipeline: config.pipeline.name.clone(),
            state_dir: state_path(config),
            backfill: options.backfill.clone(),
        };
        Self {
            source: registry::build_source(&config.source, context),
            sinks: config
                .sinks
                .iter()
                .map(|(name, c)| registry::build_sink(config, name, c))
                .collect(),
            projections: projection_parts(config),
        }
    }
}

/// Builds the projections the pipeline file configures.
pub(crate) fn projection_parts(config: &PipelineFile) -> Vec<ProjectionPart> {
    config
        .projections
        .iter()
        .map(|(name, c)| ProjectionPart {
            name: name.clone(),
            projection: refract_projections::build(c),
            sinks: c.sinks().to_vec(),
        })
        .collect()
}

/// Loads the checkpoint the run resumes from.
pub(super) fn load_checkpoint(store: &CheckpointStore) -> Result<Checkpoint, RunError> {
    let resumed = store.load()?;
    if !resumed.is_empty() {
        tracing::info!(checkpoint = ?resumed, "resuming after the checkpoint");
    }
    Ok(resumed)
}

/// Opens the dead-letter store the file names (by default a file in the state directory).
pub(super) fn open_dead_letters(
    config: &PipelineFile,
    resumed: &Checkpoint,
) -> Result<DeadLetterStore, RunError> {
    match &config.pipeline.dead_letter.url {
        Some(url) => DeadLetterStore::open_url(url.expose()),
        None => {
            let path = config
                .pipeline
                .dead_letter
                .path
                .as_ref()
                .map_or_else(|| default_dead_letter_path(config), PathBuf::from);
            DeadLetterStore::open_file(path, resumed)
        }
    }
    .map_err(RunError::Sink)
}

/// Routes each projection to its sinks, restores the state it saved, and opens the keyed state
/// (rolled back to the checkpoint) when a projection keeps some.
pub(super) fn prepare_projections(
    projections: Vec<ProjectionPart>,
    sink_names: &[String],
    store: &CheckpointStore,
    state: &std::path::Path,
    resumed: &Checkpoint,
) -> Result<(Vec<Route>, Option<KeyedState>), RunError> {
    let mut routes: Vec<Route> = projections
        .into_iter()
        .map(|part| Route {
            name: part.name,
            projection: part.projection,
            sinks: part
                .sinks
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
        let (keyed, recovery) = KeyedState::open(&path, resumed)?;
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
    Ok((routes, keyed))
}

/// The signal that tells delivery tasks to give up retrying: set when shutdown is requested,
/// or when the run fails elsewhere.
pub(super) fn spawn_stop_relay(shutdown: watch::Receiver<bool>) -> Arc<watch::Sender<bool>> {
    let stop_tasks = Arc::new(watch::channel(false).0);
    let (relay, mut shutdown) = (stop_tasks.clone(), shutdown);
    tokio::spawn(async move {
        if shutdown.wait_for(|s| *s).await.is_ok() {
            relay.send_replace(true);
        }
    });
    stop_tasks
}

/// Starts the source after `resumed`; returns the checkpoint the sinks resume from.
///
/// Sinks that publish ahead of the checkpoint (Parquet files) drop what the replay rewrites,
/// also in partitions the checkpoint does not name yet: a first run killed before its first
/// checkpoint left files that the source now hands out again.
pub(super) async fn start_source(
    source: &mut dyn Source,
    resumed: &Checkpoint,
    mode: ReadMode,
    durable: watch::Receiver<Checkpoint>,
    health: &status::Health,
) -> Result<Checkpoint, SourceError> {
    source.start(resumed, mode, durable).await?;
    health.source_started(source.health());
    let mut sink_resume = resumed.clone();
    for (partition, offset) in source.resumes_unnamed() {
        sink_resume.entry(partition).or_insert(offset);
    }
    Ok(sink_resume)
}

/// The delivery tasks, wired: the processor's job senders (one per target), the channel their
/// acknowledgements arrive on, and the tasks to await at the end.
pub(super) struct Delivery {
    pub(super) job_txs: Vec<mpsc::Sender<Job>>,
    pub(super) ack_rx: mpsc::UnboundedReceiver<Ack>,
    pub(super) tasks: Vec<JoinHandle<()>>,
}

/// Spawns one delivery task per target, each fed by a queue of `queue_depth` batches.
pub(super) fn spawn_delivery(
    targets: Vec<Target>,
    queue_depth: usize,
    sink_resume: &Checkpoint,
    stop_tasks: &watch::Sender<bool>,
    health: &Arc<status::Health>,
) -> Delivery {
    let (ack_tx, ack_rx) = mpsc::unbounded_channel();
    let mut job_txs = Vec::with_capacity(targets.len());
    let mut tasks = Vec::with_capacity(targets.len());
    health.expect_open(targets.iter().map(delivery::Target::name));
    for (index, target) in targets.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel(queue_depth);
        job_txs.push(tx);
        let name = target.name();
        let task = tokio::spawn(delivery::run(
            index,
            target,
            sink_resume.clone(),
            rx,
            ack_tx.clone(),
            stop_tasks.subscribe(),
            health.clone(),
        ));
        tasks.push(watch_for_panic(task, name, ack_tx.clone()));
    }
    Delivery {
        job_txs,
        ack_rx,
        tasks,
    }
}

/// A task that panics (a bug in a sink or a library it uses) fails the run loudly instead of
/// leaving the processor waiting for its acknowledgements.
fn watch_for_panic(
    task: JoinHandle<()>,
    name: String,
    acks: mpsc::UnboundedSender<Ack>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
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
    })
}

/// What the processor is handed besides the configuration.
pub(super) struct ProcessorInputs {
    pub(super) store: Arc<CheckpointStore>,
    pub(super) routes: Vec<Route>,
    pub(super) keyed: Option<KeyedState>,
    pub(super) job_txs: Vec<mpsc::Sender<Job>>,
    pub(super) ack_rx: mpsc::UnboundedReceiver<Ack>,
    pub(super) cp_tx: watch::Sender<Checkpoint>,
    pub(super) durable: watch::Receiver<Checkpoint>,
    pub(super) sink_names: Vec<String>,
    pub(super) dead_letter_location: String,
    pub(super) resumed: Checkpoint,
    pub(super) health: Arc<status::Health>,
}

/// The processor of a run, its summary naming where each sink writes.
pub(super) fn new_processor(
    config: &PipelineFile,
    options: &RunOptions,
    inputs: ProcessorInputs,
) -> Processor {
    let ProcessorInputs {
        store,
        routes,
        keyed,
        job_txs,
        ack_rx,
        cp_tx,
        durable,
        sink_names,
        dead_letter_location,
        resumed,
        health,
    } = inputs;
    let mut targets = sink_names.clone();
    targets.push(delivery::DEAD_LETTER_TARGET.to_owned());
    let mut processor = Processor {
        store,
        on_error: config.pipeline.on_error,
        limits: BatchLimits::new(config),
        routes,
        batch: Batch::new(sink_names.len()),
        dead_letter_target: job_txs.len() - 1,
        job_txs,
        ack_rx,
        inflight: InFlight::new(resumed.clone(), cp_tx),
        in_transaction: false,
        keyed,
        committing: None,
        durable,
        last_position: None,
        scratch: Vec::new(),
        summary: RunSummary::new(sink_names, dead_letter_location, resumed),
        draw_bar: options.progress_bar,
        bar: None,
        metrics: ProcessorMetrics::new(&targets),
        clock: pipeline_clock(config),
        health,
    };
    for (name, sink) in &config.sinks {
        let location = match sink {
            SinkConfig::ObjectJson(o) => o.url.masked(),
            SinkConfig::Redis(r) => r.url.masked(),
            SinkConfig::Parquet(p) => p.url.masked(),
            SinkConfig::Postgres(p) => format!("{} ({}.{})", p.url.masked(), p.schema, p.table),
            SinkConfig::Kafka(k) => format!("Kafka {} (topics {}.*)", k.brokers, k.topic_prefix),
            SinkConfig::Tiers(t) => format!(
                "hot {}, warm {} ({}), cold {}",
                t.hot.url.masked(),
                t.warm.url.masked(),
                t.warm.table,
                t.cold.url.masked()
            ),
            SinkConfig::Migration(m) => {
                format!("{} (migration `{}`)", m.url.masked(), m.migration)
            }
            SinkConfig::Null(_) => "discarded".to_owned(),
        };
        processor
            .summary
            .sink_locations
            .insert(name.clone(), location);
    }
    processor
}

/// The pipeline's clock (`[pipeline] clock`, which `refract validate` checked), started now.
pub fn pipeline_clock(config: &PipelineFile) -> refract_schemas::clock::Clock {
    refract_schemas::clock::ClockSpec::parse(&config.pipeline.clock)
        .unwrap_or(refract_schemas::clock::ClockSpec::Wall)
        .start()
}

/// Waits for the delivery tasks to end, and adds the notices sinks left on closing to the
/// summary.
pub(super) async fn collect_notices(
    tasks: Vec<JoinHandle<()>>,
    mut ack_rx: mpsc::UnboundedReceiver<Ack>,
    summary: &mut RunSummary,
) {
    for task in tasks {
        let _ = task.await;
    }
    while let Ok(ack) = ack_rx.try_recv() {
        if let Ack::Notice(notice) = ack {
            tracing::warn!("{notice}");
            summary.notices.push(notice);
        }
    }
}

/// The run's result: its summary, with the current-state tables rebuilt when the source ended
/// (not stopped by a signal), or the error that stopped it.
pub(super) async fn conclude(
    config: &PipelineFile,
    mut summary: RunSummary,
    outcome: Result<bool, RunError>,
) -> Result<RunSummary, RunError> {
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
