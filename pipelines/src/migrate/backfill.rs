//! `refract migrate FILE backfill`: the rows that existed before the dual write, copied in key
//! chunks (see [`refract_connectors::migration::backfill`]), with a progress bar on a terminal
//! and the rate and time left in the log.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use refract_connectors::migration::MigrationError;
use refract_connectors::migration::backfill::{self, BackfillPlan, BackfillProgress, Rejected};

use super::{MigrateError, Migration};
use crate::runtime::rows_bar;

/// How often the rate and time left are logged.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// How long the backfill waits for the dual write's slot to be created (the daemon was just
/// started); a slot waits for the transactions running at its creation to end.
const SLOT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the slot is looked at while waiting for it.
const SLOT_POLL: Duration = Duration::from_millis(200);

/// Waits until the dual write's slot exists and has its consistent point (a slot still being
/// created has no `confirmed_flush_lsn`): a change committed after that point is in the
/// stream, one before it is in the table the backfill reads. Copying before it would miss the
/// changes committed in between.
async fn wait_for_slot(m: &Migration) -> Result<(), MigrationError> {
    let slot = m.file.slot();
    let deadline = Instant::now() + SLOT_READY_TIMEOUT;
    let mut told = false;
    loop {
        let ready = m
            .client
            .query_opt(
                "SELECT confirmed_flush_lsn IS NOT NULL FROM pg_replication_slots \
                 WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map_err(refract_connectors::migration::db(
                "cannot read the replication slots",
            ))?
            .map(|r| r.get::<_, bool>(0));
        if ready == Some(true) {
            return Ok(());
        }
        if !told {
            told = true;
            eprintln!(
                "waiting for the dual write's slot `{slot}` (is `refract migrate FILE start` running?)"
            );
        }
        if Instant::now() >= deadline {
            return Err(MigrationError::Refused(match ready {
                None => format!(
                    "the dual write's slot `{slot}` does not exist: run `refract migrate {} start` \
                     first, so that no change made during the copy is missed",
                    m.path.display()
                ),
                Some(_) => format!(
                    "the dual write's slot `{slot}` is still being created after {}s (a long \
                     transaction holds it up): try again once it is ready",
                    SLOT_READY_TIMEOUT.as_secs()
                ),
            }));
        }
        tokio::time::sleep(SLOT_POLL).await;
    }
}

/// Runs `backfill`.
pub async fn run(m: Migration, restart: bool) -> Result<ExitCode, MigrateError> {
    wait_for_slot(&m).await?;
    let bar = std::io::stderr().is_terminal().then(|| rows_bar(0));
    let rejects_path = m.state_path().join("rejected.ndjson");
    std::fs::create_dir_all(m.state_path()).map_err(|e| {
        MigrationError::Refused(format!("cannot create {}: {e}", m.state_path().display()))
    })?;
    let mut rejects = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&rejects_path)
        .map_err(|e| {
            MigrationError::Refused(format!("cannot open {}: {e}", rejects_path.display()))
        })?;
    let started = Instant::now();
    let mut logged = Instant::now();
    let mut first: Option<u64> = None;
    let on_progress = |p: BackfillProgress| {
        let first = *first.get_or_insert(p.copied);
        if let Some(bar) = &bar {
            bar.set_length(p.total.max(p.copied));
            bar.set_position(p.copied);
        }
        if logged.elapsed() >= LOG_EVERY {
            logged = Instant::now();
            let rate = (p.copied - first) as f64 / started.elapsed().as_secs_f64().max(1e-3);
            let left = p.total.saturating_sub(p.copied) as f64 / rate.max(1.0);
            tracing::info!(
                copied = p.copied,
                total = p.total,
                rejected = p.rejected,
                rows_per_s = rate as u64,
                eta_s = left as u64,
                "backfill"
            );
        }
    };
    let on_reject = |r: &Rejected| {
        tracing::warn!(key = %r.key, reason = %r.reason, "row not copied: the transform cannot convert it");
        let line = serde_json::json!({"key": r.key, "reason": r.reason, "phase": "backfill"});
        let _ = writeln!(rejects, "{line}");
    };
    let plan = BackfillPlan {
        transform: &m.transform,
        source: &m.source,
        target: &m.target,
        control: &m.control,
        batch_rows: m.file.migration.batch_rows,
        max_rows_per_second: m.file.migration.max_rows_per_second,
    };
    // When refract converts, a second connection reads the next chunk while the first writes
    // (see `backfill::run`).
    let second = refract_connectors::migration::connect(m.file.migration.url.expose()).await?;
    let done = backfill::run([&m.client, &second], &plan, restart, on_progress, on_reject).await;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let (done, by) = done?;
    m.record().await?;
    println!(
        "backfill of `{}` into `{}` done: {} rows copied{}, {} not convertible{} in {:.1}s",
        m.file.migration.source,
        m.file.migration.target,
        done.copied,
        by.map(|by| format!(" ({by})")).unwrap_or_default(),
        done.rejected,
        if done.rejected > 0 {
            format!(" (listed in {})", rejects_path.display())
        } else {
            String::new()
        },
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
