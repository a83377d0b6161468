//! `refract backfill`: re-reads existing rows into a pipeline's read models.
//!
//! When no daemon runs the pipeline, the backfill runs it itself until every chunk is applied
//! (`run --until-caught-up` with the chunks read into its stream). When a daemon runs it (its
//! state is locked), the backfill only reads the chunks into the WAL and waits until the daemon's
//! slot has confirmed past the last one. Either way the chunks reach the read models in commit
//! order with the live changes, so a row changed or deleted during the backfill ends as the
//! source has it.

use std::time::{Duration, Instant};

use refract_connectors::sources::postgres::snapshot;
use refract_connectors::{BackfillScope, ReadMode, SourceContext, SourceError};
use refract_schemas::config::{LoadedPipeline, SourceConfig};
use tokio::sync::watch;

use crate::checkpoint::{CheckpointError, CheckpointStore};
use crate::runtime::{self, RunError, RunOptions, RunSummary, state_path};

/// What a backfill did.
pub enum Outcome {
    /// This process applied the chunks itself.
    Ran(Box<RunSummary>),
    /// A running daemon applied them.
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
    let daemon_running = match CheckpointStore::open(&state.join("checkpoint.redb")) {
        Ok(store) => {
            drop(store);
            false
        }
        Err(CheckpointError::InUse(_)) => true,
        Err(e) => return Err(e.into()),
    };
    if !daemon_running {
        tracing::info!("no refract process runs this pipeline: applying the backfill in this one");
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

    tracing::info!(
        "a refract process runs this pipeline: it applies the chunks this backfill reads"
    );
    let started = Instant::now();
    let context = SourceContext {
        pipeline: config.pipeline.name.clone(),
        state_dir: state,
        backfill: Some(scope),
    };
    let chunker = snapshot::standalone_backfill(pg, &context).await?;
    let progress = chunker.progress();
    let bar = runtime::rows_bar(progress.total.load(std::sync::atomic::Ordering::Relaxed));
    let mut task = tokio::spawn(chunker.run());
    let mut ticker = tokio::time::interval(Duration::from_millis(200));
    let report = loop {
        tokio::select! {
            result = &mut task => break result.expect("the backfill task")?,
            _ = ticker.tick() => {
                use std::sync::atomic::Ordering::Relaxed;
                bar.set_length(progress.total.load(Relaxed).max(progress.rows.load(Relaxed)));
                bar.set_position(progress.rows.load(Relaxed));
            }
        }
    };
    bar.finish_and_clear();
    if let Some(lsn) = &report.last_lsn {
        let slot = pg.slot_name(&config.pipeline.name);
        tracing::info!(%slot, %lsn, "rows read; waiting until the daemon has applied them");
        if !snapshot::wait_until_confirmed(&pg.url, &slot, lsn, shutdown).await? {
            return Err(RunError::Source(SourceError::Inconsistent(format!(
                "interrupted while waiting for the daemon to apply the backfill (slot `{slot}` has not confirmed {lsn} yet); \
                 every chunk is in the WAL and the daemon will still apply it"
            ))));
        }
    }
    Ok(Outcome::ThroughDaemon {
        tables: report.tables,
        skipped: report.skipped,
        elapsed: started.elapsed(),
    })
}
