//! `refract tiers age`: one aging pass ([`refract_connectors::tiers::aging`]), and the passes a
//! running pipeline makes on its schedule ([`spawn_schedule`]).
//!
//! The schedule's first pass comes one `aging_interval_ms` after the run starts, not at once: a
//! starting daemon first catches up with its source (aging can wait minutes, a partition is an
//! hour), and a `--until-caught-up` run shorter than an interval (a catch-up job, a test) ages
//! nothing behind its caller's back. `refract tiers age` is the pass on demand.

use std::time::Duration;

use refract_connectors::tiers::aging;
use refract_schemas::clock::Clock;
use refract_schemas::config::{PipelineFile, TierLayout};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Runs one aging pass and prints what it did: one line on stdout; a line per day on stderr
/// (logged at info as the pass goes).
pub async fn run(layout: &TierLayout, clock: &Clock) -> Result<(), String> {
    let report = aging::age(layout, clock.now_ms().saturating_mul(1_000))
        .await
        .map_err(|e| e.to_string())?;
    println!("{}", report.summary());
    Ok(())
}

/// Starts one background task per tiers sink of `config` with `aging_interval_ms > 0`, each
/// running an aging pass every interval on the pipeline's clock until `stop` or `shutdown`
/// turns true. A failed pass is logged and the next one resumes it; a pass under way when the
/// run stops is abandoned like a killed one, and the next pass (or run) finishes it.
pub fn spawn_schedule(
    config: &PipelineFile,
    stop: &watch::Receiver<bool>,
    shutdown: &watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    config
        .tier_layouts()
        .into_iter()
        .filter(|l| l.stores.aging_interval_ms > 0)
        .map(|layout| {
            let clock = crate::runtime::pipeline_clock(config);
            tokio::spawn(schedule(layout, clock, stop.clone(), shutdown.clone()))
        })
        .collect()
}

/// The passes of one tiers sink, every `aging_interval_ms`, until `stop` or `shutdown`.
async fn schedule(
    layout: TierLayout,
    clock: Clock,
    mut stop: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let interval = Duration::from_millis(layout.stores.aging_interval_ms);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let pass = async {
            ticks.tick().await;
            aging::age(&layout, clock.now_ms().saturating_mul(1_000)).await
        };
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = requested(&mut shutdown) => return,
            result = pass => match result {
                Ok(report) => tracing::info!(sink = %layout.sink, days = report.days_aged, partitions = report.partitions_dropped, rows = report.rows_exported, files = report.files_written, hot_trimmed = report.hot_trimmed, hot_deleted = report.hot_deleted, resumed = report.runs_resumed, "aging pass done"),
                Err(e) => tracing::warn!(sink = %layout.sink, error = %e, "aging pass failed; the next pass resumes it"),
            },
        }
    }
}

/// Resolves once shutdown is requested (never, when nobody can request it any more).
async fn requested(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}
