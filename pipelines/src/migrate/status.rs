//! `refract migrate FILE status`: the control row, the dual write's lag behind the server, and
//! what could not be converted.

use std::process::ExitCode;

use refract_connectors::migration::db;
use serde_json::{Value, json};

use super::{MigrateError, Migration};
use crate::checkpoint::{CheckpointError, CheckpointStore};

/// Lines of a newline-delimited file (0 when it does not exist).
fn lines(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

/// Runs `status`.
pub async fn run(m: Migration, as_json: bool) -> Result<ExitCode, MigrateError> {
    let Some(row) = m.control.read(&m.client).await? else {
        if as_json {
            println!("{}", json!({"name": m.file.migration.name, "phase": null}));
        } else {
            println!(
                "migration `{}`: not started (`refract migrate {} start`)",
                m.file.migration.name,
                m.path.display()
            );
        }
        return Ok(ExitCode::SUCCESS);
    };
    let lag = m
        .client
        .query_opt(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, active \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&m.file.slot()],
        )
        .await
        .map_err(db("cannot read the slot"))?;
    let running = matches!(
        CheckpointStore::open_existing(&m.state_path()),
        Err(CheckpointError::InUse(_))
    );
    let dead_letters = lines(&m.state_path().join("dead-letters.ndjson"));
    let rejected_file = lines(&m.state_path().join("rejected.ndjson"));
    let status = json!({
        "control": row,
        "slot": m.file.slot(),
        "slot_lag_bytes": lag.as_ref().map(|r| r.get::<_, Option<i64>>(0)),
        "slot_active": lag.as_ref().map(|r| r.get::<_, bool>(1)),
        "dual_write_running": running,
        "dead_letters": dead_letters,
        "backfill_rejected_listed": rejected_file,
    });
    if as_json {
        println!("{}", serde_json::to_string_pretty(&status).expect("JSON"));
        return Ok(ExitCode::SUCCESS);
    }
    let get = |name: &str| match row.get(name) {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    println!(
        "migration `{}`: `{}` -> `{}`",
        get("name"),
        get("source_table"),
        get("target_table")
    );
    println!("  phase:           {}", get("phase"));
    println!(
        "  read_from:       {} (requested: {})",
        get("read_from"),
        get("requested_read_from")
    );
    println!(
        "  dual write:      {}; slot `{}` {} bytes behind the server; applied up to {} at {}",
        if running { "running" } else { "not running" },
        m.file.slot(),
        status["slot_lag_bytes"],
        get("applied_position"),
        get("applied_at")
    );
    println!(
        "  backfill:        {} rows copied, {} not convertible; started {}, done {}",
        get("rows_copied"),
        get("rows_rejected"),
        get("backfill_started_at"),
        get("backfill_done_at")
    );
    println!(
        "  last verify:     {} (equal: {}) {}",
        get("verified_at"),
        get("verify_equal"),
        get("verify_summary")
    );
    println!(
        "  switched:        {} at position {}",
        get("switched_at"),
        get("switch_position")
    );
    println!(
        "  dead letters:    {dead_letters} (changes the transform could not convert, in {})",
        m.state_path().join("dead-letters.ndjson").display()
    );
    Ok(ExitCode::SUCCESS)
}
