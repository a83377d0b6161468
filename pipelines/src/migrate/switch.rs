//! `cutover`, `rollback` and `finalize`: where reads (and writes) go.
//!
//! A switch is asked for in the control row (`requested_read_from`), a change the dual write
//! reads at its place in the stream: when it gets there, every change committed before the
//! request has been applied, and it flips `read_from` (notifying listeners) in the same
//! transaction. The command waits for that flip; a request the dual write does not reach in
//! time (it is not running) is withdrawn, and the command fails saying so.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use refract_connectors::migration::MigrationError;
use refract_connectors::migration::control::Phase;
use refract_connectors::sources::postgres::inspect::PgAdmin;
use serde_json::Value;

use super::{MigrateError, Migration};
use crate::checkpoint::{CheckpointError, CheckpointStore};

/// How often the control row is read while waiting for a switch.
const POLL: Duration = Duration::from_millis(100);

fn text<'a>(row: &'a Value, name: &str) -> &'a str {
    row.get(name).and_then(Value::as_str).unwrap_or_default()
}

/// Asks for reads to move to `to` and waits until the dual write has moved them.
async fn switch(
    m: &mut Migration,
    to: &str,
    asking: Phase,
    timeout: Duration,
) -> Result<bool, MigrateError> {
    let row = m.control.require(&m.client).await?;
    let from = text(&row, "read_from").to_owned();
    let publication = m.file.publication();
    m.control
        .request_switch(&mut m.client, &publication, &from, to, asking)
        .await?;
    let asked = Instant::now();
    eprintln!(
        "waiting for the dual write to apply every change committed before now, then move reads to `{to}`"
    );
    loop {
        let row = m.control.require(&m.client).await?;
        if text(&row, "read_from") == to {
            m.record().await?;
            println!(
                "reads and writes go to `{to}` (switched at position {}, after {:.1}s); listeners on channel `refract_migration` were notified",
                text(&row, "switch_position"),
                asked.elapsed().as_secs_f64()
            );
            return Ok(true);
        }
        if asked.elapsed() >= timeout {
            let back = if from == m.file.migration.source {
                Phase::Backfilled
            } else {
                Phase::CutOver
            };
            m.control
                .request_switch(&mut m.client, &publication, to, &from, back)
                .await?;
            eprintln!(
                "error: the dual write did not reach the request within {}s (is `refract migrate {} start` running?); the request is withdrawn and reads stay on `{from}`",
                timeout.as_secs(),
                m.path.display()
            );
            return Ok(false);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `cutover`.
pub async fn cutover(
    mut m: Migration,
    timeout: u64,
    force: bool,
) -> Result<ExitCode, MigrateError> {
    let row = m.control.require(&m.client).await?;
    let target = m.file.migration.target.clone();
    if text(&row, "read_from") == target {
        println!("reads already go to `{target}`");
        return Ok(ExitCode::SUCCESS);
    }
    if text(&row, "phase") == Phase::Finalized.name() {
        return Err(MigrationError::Refused("the migration is finalized".into()).into());
    }
    if row.get("backfill_done_at").is_none_or(Value::is_null) {
        return Err(MigrationError::Refused(format!(
            "the backfill has not finished: run `refract migrate {} backfill` first",
            m.path.display()
        ))
        .into());
    }
    match row.get("verify_equal").and_then(Value::as_bool) {
        Some(false) if !force => {
            return Err(MigrationError::Refused(
                "the last verification found differences: fix them and verify again, or cut over with --force".into(),
            )
            .into());
        }
        None => {
            eprintln!("warning: the tables were never verified (`refract migrate FILE verify`)")
        }
        _ => {}
    }
    let done = switch(
        &mut m,
        &target,
        Phase::CuttingOver,
        Duration::from_secs(timeout),
    )
    .await?;
    Ok(if done {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `rollback`.
pub async fn rollback(mut m: Migration, timeout: u64) -> Result<ExitCode, MigrateError> {
    let row = m.control.require(&m.client).await?;
    let source = m.file.migration.source.clone();
    if text(&row, "phase") == Phase::Finalized.name() {
        return Err(MigrationError::Refused(
            "the migration is finalized: there is no replication left to roll back with".into(),
        )
        .into());
    }
    if text(&row, "read_from") == source && text(&row, "requested_read_from") == source {
        println!("reads already go to `{source}`");
        return Ok(ExitCode::SUCCESS);
    }
    let done = switch(
        &mut m,
        &source,
        Phase::RollingBack,
        Duration::from_secs(timeout),
    )
    .await?;
    Ok(if done {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `finalize`.
pub async fn finalize(m: Migration, drop_old_table: bool) -> Result<ExitCode, MigrateError> {
    let row = m.control.require(&m.client).await?;
    let read_from = text(&row, "read_from").to_owned();
    if text(&row, "requested_read_from") != read_from {
        return Err(MigrationError::Refused(format!(
            "a switch to `{}` is under way: let it finish (or time out) first",
            text(&row, "requested_read_from")
        ))
        .into());
    }
    let old = if read_from == m.file.migration.target {
        m.file.migration.source.clone()
    } else {
        m.file.migration.target.clone()
    };
    if drop_old_table && read_from != m.file.migration.target {
        return Err(MigrationError::Refused(format!(
            "reads go to `{read_from}`: dropping `{old}` after no cut-over would throw the migration away; leave out --drop-old-table (or cut over first)"
        ))
        .into());
    }
    // The dual write holds its state while it runs.
    match CheckpointStore::open_existing(&m.state_path()) {
        Err(CheckpointError::InUse(_)) => {
            return Err(MigrationError::Refused(format!(
                "the dual write is running (its state {} is in use): stop it (SIGTERM) first",
                m.state_path().display()
            ))
            .into());
        }
        Ok(held) => drop(held),
        Err(e) => tracing::warn!("finalizing without the dual write's state: {e}"),
    }
    let admin = PgAdmin::connect(m.file.migration.url.expose())
        .await
        .map_err(|e| MigrationError::Refused(e.to_string()))?;
    let slot = m.file.slot();
    let dropped_slot = admin
        .drop_slot(&slot)
        .await
        .map_err(|e| MigrationError::Refused(e.to_string()))?;
    let publication = m.file.publication();
    let dropped_publication = admin
        .drop_publication(&publication)
        .await
        .map_err(|e| MigrationError::Refused(e.to_string()))?;
    m.control.set_phase(&m.client, Phase::Finalized).await?;
    for table in [&m.file.migration.source, &m.file.migration.target] {
        m.control.open_writes(&m.client, table).await?;
    }
    println!(
        "migration `{}` finalized: reads and writes stay on `{read_from}`; slot `{slot}` {}, publication `{publication}` {}",
        m.file.migration.name,
        if dropped_slot {
            "dropped"
        } else {
            "was already gone"
        },
        if dropped_publication {
            "dropped"
        } else {
            "was already gone"
        },
    );
    if drop_old_table {
        m.client
            .batch_execute(&format!(
                "DROP TABLE {}",
                refract_connectors::pg_sql::quote_table(&old)
            ))
            .await
            .map_err(refract_connectors::migration::db(format!(
                "cannot drop `{old}`"
            )))?;
        println!("table `{old}` dropped");
    } else {
        println!("table `{old}` kept (drop it with --drop-old-table, or by hand)");
    }
    m.record().await?;
    Ok(ExitCode::SUCCESS)
}
