//! `refract backfill`: re-reads existing rows into a pipeline's read models.
//!
//! The rows come from an exported snapshot read with COPY, and go into the pipeline's stream at
//! the snapshot's consistent point: after every change the snapshot holds, before every change
//! it does not, so a row changed or deleted during the backfill ends as the source has it.
//! - When no daemon runs the pipeline, the backfill runs it itself (`run --until-caught-up` with
//!   the rows read into its stream).
//! - When a daemon runs it (its state is locked), only the daemon can put rows into its stream:
//!   the backfill asks it to (see `snapshot::BackfillRequest`) and follows the daemon's notes
//!   until the rows are durable, with a progress bar. If the daemon stops first, the backfill
//!   finishes the rest itself.

use std::time::{Duration, Instant};

use refract_connectors::sources::postgres::snapshot;
use refract_connectors::{BackfillScope, ReadMode, SourceError};
use refract_schemas::config::{LoadedPipeline, SourceConfig};
use tokio::sync::watch;

use crate::checkpoint::{self, CheckpointError, CheckpointStore};
use crate::runtime::{self, RunError, RunOptions, RunSummary, state_path};

/// What a backfill did.
pub enum Outcome {
    /// This process read the rows into its own run.
    Ran(Box<RunSummary>),
    /// The running daemon read them, as this process asked.
    ThroughDaemon {
        /// Rows read, per table.
        tables: Vec<(String, u64)>,
        /// Tables left out, with the reason.
        skipped: Vec<(String, String)>,
        /// Wall time.
        elapsed: Duration,
    },
}

/// Runs a backfill of `scope` for the pipeline.
pub async fn run(
    loaded: &LoadedPipeline,
    scope: BackfillScope,
    shutdown: watch::Receiver<bool>,
) -> Result<Outcome, RunError> {
    let config = &loaded.config;
    let SourceConfig::Postgres(pg) = &config.source else {
        return Err(RunError::Source(SourceError::Inconsistent(
            "`refract backfill` needs a `kind = \"postgres\"` source (a file or Kafka source replays its log instead)"
                .into(),
        )));
    };
    let state = state_path(config);
    std::fs::create_dir_all(&state).map_err(|source| RunError::State {
        path: state.clone(),
        source,
    })?;
    let daemon_running = match CheckpointStore::open(&state.join(checkpoint::FILE)) {
        Ok(store) => {
            drop(store);
            false
        }
        Err(CheckpointError::InUse(_)) => true,
        Err(e) => return Err(e.into()),
    };
    if !daemon_running {
        tracing::info!("no refract process runs this pipeline: applying the backfill in this one");
        // A request left for a daemon that has not taken it: this run does the work instead.
        snapshot::BackfillRequest::withdraw(&state)?;
        let summary = runtime::run(
            loaded,
            RunOptions {
                mode: ReadMode::UntilCaughtUp,
                backfill: Some(scope),
                progress_bar: true,
            },
            shutdown,
        )
        .await?;
        return Ok(Outcome::Ran(Box::new(summary)));
    }

    match through_daemon(loaded, pg, &scope, &state, shutdown.clone()).await? {
        Followed::Done(outcome) => Ok(outcome),
        Followed::DaemonGone { taken } => {
            tracing::warn!(
                "the refract process running this pipeline stopped: applying the rest of the backfill in this one"
            );
            let summary = runtime::run(
                loaded,
                RunOptions {
                    mode: ReadMode::UntilCaughtUp,
                    backfill: Some(BackfillScope {
                        tables: scope.tables,
                        // What the daemon read of it is kept.
                        restart: scope.restart && !taken,
                    }),
                    progress_bar: true,
                },
                shutdown,
            )
            .await?;
            Ok(Outcome::Ran(Box::new(summary)))
        }
    }
}

/// How long the slot may show no reader before the backfill looks whether the daemon is gone
/// (a daemon reconnecting leaves it inactive for a moment).
const DAEMON_GONE_AFTER: Duration = Duration::from_secs(5);

/// How following the daemon ended.
enum Followed {
    /// The rows are durable.
    Done(Outcome),
    /// The daemon stopped first (the caller goes on without it); `taken` when it had started
    /// reading the request.
    DaemonGone { taken: bool },
}

/// Asks the daemon to read the backfill and follows it until its rows are durable.
async fn through_daemon(
    loaded: &LoadedPipeline,
    pg: &refract_schemas::config::PostgresSourceConfig,
    scope: &BackfillScope,
    state: &std::path::Path,
    mut shutdown: watch::Receiver<bool>,
) -> Result<Followed, RunError> {
    let name = &loaded.config.pipeline.name;
    let started = Instant::now();
    let asked = snapshot::Asked::send(
        pg.url.expose(),
        &pg.publication_name(name),
        &pg.slot_name(name),
        state,
        &scope.tables,
        scope.restart,
    )
    .await?;
    let id = asked.request.id.clone();
    if asked.earlier {
        tracing::info!(request = %id, "the running daemon has this backfill under way already: following it");
    } else {
        tracing::info!(request = %id, "a refract process runs this pipeline: asked it to read the backfill");
    }
    let bar = runtime::rows_bar(0);
    // The daemon's notes are small files: looking at them often costs nothing and ends the
    // wait soon after the rows are durable.
    let mut ticker = tokio::time::interval(Duration::from_millis(20));
    let mut inactive_since: Option<Instant> = None;
    let mut last_liveness = Instant::now();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.wait_for(|s| *s) => {
                bar.abandon();
                return Err(RunError::Source(SourceError::Inconsistent(format!(
                    "interrupted while following the backfill (request {id}): the daemon goes on with it; \
                     `refract backfill` with the same tables follows it again"
                ))));
            }
        }
        let status = snapshot::BackfillStatus::read(state)?;
        if let Some(status) = status.filter(|s| s.request.as_deref() == Some(id.as_str())) {
            if let Some(error) = &status.error {
                bar.abandon();
                return Err(RunError::Source(SourceError::Inconsistent(format!(
                    "the daemon could not read the backfill: {error}"
                ))));
            }
            bar.set_length(status.total.max(status.rows()));
            bar.set_position(status.rows());
            if status.complete {
                bar.finish_and_clear();
                return Ok(Followed::Done(Outcome::ThroughDaemon {
                    tables: status
                        .tables
                        .iter()
                        .filter(|t| t.2.is_none())
                        .map(|t| (t.0.clone(), t.1))
                        .collect(),
                    skipped: status
                        .tables
                        .iter()
                        .filter_map(|t| Some((t.0.clone(), t.2.clone()?)))
                        .collect(),
                    elapsed: started.elapsed(),
                }));
            }
        }
        // Once a second: is the daemon still there?
        if last_liveness.elapsed() < Duration::from_secs(1) {
            continue;
        }
        last_liveness = Instant::now();
        if asked.slot_active().await? {
            inactive_since = None;
            continue;
        }
        let since = *inactive_since.get_or_insert_with(Instant::now);
        if since.elapsed() < DAEMON_GONE_AFTER {
            continue;
        }
        match CheckpointStore::open(&state.join(checkpoint::FILE)) {
            Ok(store) => {
                drop(store);
                bar.abandon();
                // Not taken yet: withdrawn, so a later daemon does not read it too.
                let taken = !snapshot::BackfillRequest::pending(state)?.is_some_and(|r| r.id == id);
                if !taken {
                    snapshot::BackfillRequest::withdraw(state)?;
                }
                return Ok(Followed::DaemonGone { taken });
            }
            Err(CheckpointError::InUse(_)) => inactive_since = None,
            Err(e) => return Err(e.into()),
        }
    }
}
