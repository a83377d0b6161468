//! The backfill: rows that existed before the dual write started, copied into the target in
//! primary-key chunks.
//!
//! A chunk is one short transaction that reads the next rows of the source in key order with
//! `FOR SHARE`, writes their transforms into the target (an upsert by identity), and records
//! its last key and counts in the control row. It races with nothing:
//! - a change to one of the rows that committed before the chunk locked it is read by the chunk
//!   (the lock waits for it), and comes earlier in the stream, so the dual write writes the
//!   same value again or an older one that a later change in the stream (or this very value,
//!   re-applied) overrides before the dual write passes the chunk's position;
//! - a change after the lock waits for the chunk's commit, so the dual write applies it after
//!   the chunk's rows are in place;
//! - a row inserted after the chunk passed its key is the dual write's alone.
//!
//! So once the dual write has passed the end of the backfill, the target holds every row the
//! source holds. The control row's `backfill_after` is the resume point: a killed backfill
//! starts again after the last committed chunk, and a chunk written twice is harmless.

use std::time::{Duration, Instant};

use refract_projections::migration::{Transform, key_text};
use refract_schemas::Row;
use serde_json::Value;
use tokio_postgres::Client;

use super::catalog::Table;
use super::control::{Control, Phase};
use super::rows::{Reader, Writer};
use super::{MigrationError, db};

/// What a backfill copies, and how fast.
pub struct BackfillPlan<'a> {
    /// The migration's transform.
    pub transform: &'a Transform,
    /// The source table.
    pub source: &'a Table,
    /// The target table.
    pub target: &'a Table,
    /// The control row.
    pub control: &'a Control,
    /// Rows per chunk.
    pub batch_rows: u32,
    /// At most this many rows per second, when set.
    pub max_rows_per_second: Option<u32>,
}

/// Progress of a backfill, after each chunk.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackfillProgress {
    /// Rows copied so far (by this run and the interrupted runs before it).
    pub copied: u64,
    /// Rows the transform could not convert, so far.
    pub rejected: u64,
    /// The source's estimated row count.
    pub total: u64,
}

/// A row the transform could not convert: not copied.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// `(key=value, ...)` of the source row.
    pub key: String,
    /// Why.
    pub reason: String,
}

/// Copies the rows after the control row's resume point; `restart` starts from the first key
/// again. `progress` is called after each chunk, `rejected` for each row not converted.
pub async fn run(
    client: &mut Client,
    plan: &BackfillPlan<'_>,
    restart: bool,
    mut progress: impl FnMut(BackfillProgress),
    mut rejected: impl FnMut(&Rejected),
) -> Result<BackfillProgress, MigrationError> {
    let row = plan.control.require(&*client).await?;
    let text = |name: &str| {
        row.get(name)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    if text("read_from") != text("source_table")
        || text("requested_read_from") != text("source_table")
    {
        return Err(MigrationError::Refused(format!(
            "reads go to `{}` already: the backfill runs before the cut-over (roll back first)",
            text("read_from")
        )));
    }
    if restart {
        plan.control
            .update(
                &*client,
                "backfill_after = NULL, rows_copied = 0, rows_rejected = 0, backfill_done_at = NULL",
                &[],
            )
            .await?;
    }
    let row = plan.control.require(&*client).await?;
    let count = |name: &str| row.get(name).and_then(Value::as_u64).unwrap_or(0);
    let mut state = BackfillProgress {
        copied: count("rows_copied"),
        rejected: count("rows_rejected"),
        total: estimate(client, plan.source).await?,
    };
    if !row.get("backfill_done_at").is_none_or(Value::is_null) {
        progress(state);
        return Ok(state);
    }
    let mut after: Option<Vec<Value>> =
        row.get("backfill_after").and_then(Value::as_array).cloned();
    plan.control
        .update(
            &*client,
            "phase = $2, backfill_started_at = coalesce(backfill_started_at, now())",
            &[&Phase::Backfilling.name()],
        )
        .await?;
    let reader = Reader::new(plan.source, plan.transform.source_key());
    let writer = Writer::new(plan.target, plan.transform.identity());
    let started = Instant::now();
    let copied_before = state.copied;
    loop {
        let tx = client
            .transaction()
            .await
            .map_err(db("cannot begin a backfill chunk"))?;
        let rows = reader
            .read(
                &tx,
                after.as_deref(),
                None,
                Some(plan.batch_rows.into()),
                true,
            )
            .await?;
        let Some(last) = rows.last() else {
            tx.rollback().await.map_err(db("cannot end the backfill"))?;
            break;
        };
        let last_key = reader.key_of(last);
        let mut converted: Vec<Row> = Vec::with_capacity(rows.len());
        let mut refused = 0u64;
        for row in &rows {
            match plan.transform.forward(row) {
                Ok(r) => converted.push(r),
                Err(e) => {
                    refused += 1;
                    rejected(&Rejected {
                        key: key_text(row, reader.key()),
                        reason: e.to_string(),
                    });
                }
            }
        }
        let refs: Vec<&Row> = converted.iter().collect();
        writer.upsert(&tx, &refs).await?;
        let after_json = Value::Array(last_key.clone());
        plan.control
            .update(
                &tx,
                "backfill_after = $2, rows_copied = rows_copied + $3, \
                 rows_rejected = rows_rejected + $4",
                &[&after_json, &(converted.len() as i64), &(refused as i64)],
            )
            .await?;
        tx.commit()
            .await
            .map_err(db("cannot commit a backfill chunk"))?;
        state.copied += converted.len() as u64;
        state.rejected += refused;
        after = Some(last_key);
        progress(state);
        if let Some(rate) = plan.max_rows_per_second {
            let due =
                Duration::from_secs_f64((state.copied - copied_before) as f64 / f64::from(rate));
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    plan.control
        .update(
            &*client,
            "phase = $2, backfill_done_at = now()",
            &[&Phase::Backfilled.name()],
        )
        .await?;
    Ok(state)
}

/// The planner's estimate of the rows of `table` (exact count when it has none yet).
pub(super) async fn estimate(client: &Client, table: &Table) -> Result<u64, MigrationError> {
    let row = client
        .query_one(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass($1)",
            &[&table.quoted],
        )
        .await
        .map_err(db("cannot estimate the rows to copy"))?;
    let estimate: i64 = row.get(0);
    if estimate > 0 {
        return Ok(estimate as u64);
    }
    let row = client
        .query_one(&format!("SELECT count(*) FROM {}", table.quoted), &[])
        .await
        .map_err(db("cannot count the rows to copy"))?;
    Ok(row.get::<_, i64>(0) as u64)
}
