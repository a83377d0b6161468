//! One aging pass: warm days past the warm window go to cold, the hot tier is trimmed to its
//! window (seed 003 §4.2). `refract tiers age` runs one pass; a running pipeline runs one every
//! `aging_interval_ms`.
//!
//! A pass ages whole UTC days, oldest first: a day is ready when its last hour has passed the
//! warm window (`day + 24 h <= clock - warm`). A day whose later hours are still inside the
//! window waits, so that every heartbeat of it that arrives later is already older than the
//! window and goes to the day's late file, not to a partition aged again; one device-day is one
//! aged file (the exception: a heartbeat a pipeline with a clock behind the pass's routes to warm
//! after its day was detached lands in a partition made afresh, which a later pass ages into a
//! second file of the day). The warm tier therefore holds up to one day more than the window.
//!
//! Each day is one run, recorded in `{table}_aging` step by step, so that a kill at any point
//! is finished by the next pass with nothing lost and nothing in cold twice:
//!
//! ```text
//! detaching  run row inserted; one transaction: LOCK the warm table, DETACH every partition
//!            of the day, RENAME each to {partition}_aging{run}, state = exporting
//! exporting  under the cold lock: per device, the detached rows whose times no other file of
//!            the device-day holds, written to aged-{run}.parquet; state = exported
//! exported   under the cold lock: every file read back; per device, the cold times cover
//!            every detached row and the run's file shares none with another file; then one
//!            transaction: DROP the detached tables, state = dropped
//! ```
//!
//! A pass first finishes the runs it finds unfinished (a `detaching` run's transaction either
//! committed or left everything attached: the day is detached again), then starts new ones.
//! Passes take turns on an advisory lock, so the daemon's schedule and `refract tiers age`
//! never run one concurrently.

mod export;
mod hot_trim;
mod run;

use refract_schemas::config::TierLayout;

use super::{TierError, warm};

/// A day in microseconds.
pub const DAY_MICROS: i64 = 24 * warm::HOUR_MICROS;

/// What one aging pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AgingReport {
    /// Runs an earlier pass left unfinished (killed, or failed) that this pass finished.
    pub runs_resumed: u64,
    /// Days whose warm partitions went to cold and were dropped.
    pub days_aged: u64,
    /// Warm partitions dropped.
    pub partitions_dropped: u64,
    /// Heartbeats written to aged files.
    pub rows_exported: u64,
    /// Aged files written.
    pub files_written: u64,
    /// Hot device sets that lost their heartbeats past the hot window and kept newer ones.
    pub hot_trimmed: u64,
    /// Hot device sets emptied (and so removed) because their device fell silent, each also
    /// removed from its region set.
    pub hot_deleted: u64,
}

impl AgingReport {
    /// One line for people.
    pub fn summary(&self) -> String {
        format!(
            "aged {} day(s): {} warm partition(s) dropped, {} heartbeat(s) in {} cold file(s){}; \
             hot tier: {} device set(s) trimmed, {} removed",
            self.days_aged,
            self.partitions_dropped,
            self.rows_exported,
            self.files_written,
            if self.runs_resumed > 0 {
                format!(" ({} unfinished run(s) resumed)", self.runs_resumed)
            } else {
                String::new()
            },
            self.hot_trimmed,
            self.hot_deleted
        )
    }
}

/// Runs one aging pass at pipeline clock `clock_micros`: finishes unfinished runs, ages every
/// ready day of the warm tier, then trims the hot tier. Stops at the first failure (a
/// [`TierError::Mismatch`] leaves the day's detached tables in place); the next pass resumes.
pub async fn age(layout: &TierLayout, clock_micros: i64) -> Result<AgingReport, TierError> {
    let mut client = super::connect_warm(layout).await?;
    warm::create(&client, layout)
        .await
        .map_err(warm_error("cannot create the warm tables"))?;
    client
        .batch_execute(&pass_lock_sql(layout))
        .await
        .map_err(warm_error("cannot take the aging lock"))?;
    let cold = super::open_cold(layout)?;
    let cutoff = clock_micros.saturating_sub(layout.warm_micros);
    let mut report = AgingReport::default();
    loop {
        let next = match run::unfinished(&client, layout).await? {
            Some(run) => {
                tracing::info!(run = run.id, day = %run.day_text(), state = run.state.name(), "resuming an unfinished aging run");
                report.runs_resumed += 1;
                Some(run)
            }
            None => run::start(&client, layout, cutoff).await?,
        };
        let Some(next) = next else { break };
        run::finish(&mut client, layout, &cold, next, &mut report).await?;
    }
    // Ends the session, which releases the aging lock.
    drop(client);
    hot_trim::trim(layout, clock_micros, &mut report).await?;
    Ok(report)
}

/// The session lock that makes aging passes of one warm table take turns.
fn pass_lock_sql(layout: &TierLayout) -> String {
    format!(
        "SELECT pg_advisory_lock(hashtext('refract.tiers.aging:' || {}))",
        super::quote_literal(&layout.stores.warm.table)
    )
}

/// Wraps a warm-tier error with what was being done.
fn warm_error(what: &'static str) -> impl Fn(tokio_postgres::Error) -> TierError {
    move |e| TierError::Warm(what.to_owned(), e)
}

/// The first day (start, microseconds) of the hour starting at `hour`.
fn day_start(hour: i64) -> i64 {
    hour.div_euclid(DAY_MICROS) * DAY_MICROS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_start_at_midnight_utc() {
        let h = 1_767_312_000_000_000; // 2026-01-02T00:00:00Z
        assert_eq!(day_start(h), h);
        assert_eq!(day_start(h + 23 * warm::HOUR_MICROS), h);
        assert_eq!(day_start(h - 1), h - DAY_MICROS);
    }

    #[test]
    fn the_summary_names_every_figure() {
        let report = AgingReport {
            runs_resumed: 1,
            days_aged: 2,
            partitions_dropped: 48,
            rows_exported: 1000,
            files_written: 20,
            hot_trimmed: 3,
            hot_deleted: 4,
        };
        assert_eq!(
            report.summary(),
            "aged 2 day(s): 48 warm partition(s) dropped, 1000 heartbeat(s) in 20 cold file(s) \
             (1 unfinished run(s) resumed); hot tier: 3 device set(s) trimmed, 4 removed"
        );
    }
}
