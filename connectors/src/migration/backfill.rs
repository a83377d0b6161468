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
//! The read gives way to the applications' writers ([`share_lock`]): an application that locks
//! rows in another order is never made a deadlock victim by the backfill.
//!
//! So once the dual write has passed the end of the backfill, the target holds every row the
//! source holds. The control row's `backfill_after` is the resume point: a killed backfill
//! starts again after the last committed chunk, and a chunk written twice is harmless.

use std::time::{Duration, Instant};

use refract_projections::migration::{Transform, key_text};
use refract_schemas::Row;
use serde_json::Value;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use super::catalog::Table;
use super::control::{Control, Phase};
use super::rows::{Reader, Writer};
use super::{MigrationError, db};
use crate::sources::postgres::share_lock::{self, Patience};

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
///
/// Two connections take turns: while one writes chunk k and commits it, the other reads chunk
/// k+1 (its own transaction, its rows share-locked), so reading and converting overlap with
/// writing. The resume point still only moves forward, chunk by chunk: chunk k+1 is written
/// after chunk k committed. A kill loses at most the chunk being read, which nothing recorded.
pub async fn run(
    clients: [&Client; 2],
    plan: &BackfillPlan<'_>,
    restart: bool,
    mut progress: impl FnMut(BackfillProgress),
    mut rejected: impl FnMut(&Rejected),
) -> Result<BackfillProgress, MigrationError> {
    let Some((mut state, mut after)) = begin(clients[0], plan, restart).await? else {
        let state = resume_state(clients[0], plan).await?;
        progress(state);
        return Ok(state);
    };
    for client in clients {
        // A chunk's commit need not wait for its WAL flush: a server crash can lose only whole
        // chunks, each with the resume point it recorded in the same transaction (and the
        // stream never reads WAL that was not flushed), so the next run copies them again.
        client
            .batch_execute("SET synchronous_commit = off")
            .await
            .map_err(db("cannot set up the backfill's connections"))?;
    }
    let reader = Reader::new(plan.source, plan.transform.source_key());
    let writer = Writer::new(plan.target, plan.transform.identity());
    let statements = [
        Statements::prepare(clients[0], &reader, &writer, plan.control).await?,
        Statements::prepare(clients[1], &reader, &writer, plan.control).await?,
    ];
    let chunk_of = |turn: usize| Turn {
        client: clients[turn],
        statements: &statements[turn],
        reader: &reader,
        writer: &writer,
        plan,
    };
    let started = Instant::now();
    let copied_before = state.copied;
    let mut turn = 0;
    let mut chunk = read_chunk(&chunk_of(turn), after.as_deref()).await?;
    while let Some(current) = chunk {
        for r in &current.rejected {
            rejected(r);
        }
        after = Some(current.last_key.clone());
        let (reading, writing) = (chunk_of(1 - turn), chunk_of(turn));
        let next = read_chunk(&reading, after.as_deref());
        let write = write_chunk(&writing, &current);
        let Some(rate) = plan.max_rows_per_second else {
            let (next, written) = tokio::join!(next, write);
            if let Err(e) = written {
                // The next chunk's transaction is open on the other connection: end it too.
                let _ = clients[1 - turn].batch_execute("ROLLBACK").await;
                return Err(e);
            }
            chunk = next?;
            turn = 1 - turn;
            state.copied += current.rows.len() as u64;
            state.rejected += current.rejected.len() as u64;
            progress(state);
            continue;
        };
        // Throttled: the pause comes between a commit and the next read, so that no row
        // stays share-locked (applications' writes to it waiting) while the backfill sleeps.
        write.await?;
        state.copied += current.rows.len() as u64;
        state.rejected += current.rejected.len() as u64;
        progress(state);
        let due = Duration::from_secs_f64((state.copied - copied_before) as f64 / f64::from(rate));
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        chunk = next.await?;
        turn = 1 - turn;
    }
    plan.control
        .update(
            clients[0],
            "phase = $2, backfill_done_at = now()",
            &[&Phase::Backfilled.name()],
        )
        .await?;
    Ok(state)
}

/// Checks that the backfill may run and marks it started; the counts so far and the resume
/// point, or `None` when the backfill is done already.
async fn begin(
    client: &Client,
    plan: &BackfillPlan<'_>,
    restart: bool,
) -> Result<Option<(BackfillProgress, Option<Vec<Value>>)>, MigrationError> {
    let row = plan.control.require(client).await?;
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
                client,
                "backfill_after = NULL, rows_copied = 0, rows_rejected = 0, backfill_done_at = NULL",
                &[],
            )
            .await?;
    }
    let row = plan.control.require(client).await?;
    if !row.get("backfill_done_at").is_none_or(Value::is_null) {
        return Ok(None);
    }
    let state = resume_state(client, plan).await?;
    let after = row.get("backfill_after").and_then(Value::as_array).cloned();
    plan.control
        .update(
            client,
            "phase = $2, backfill_started_at = coalesce(backfill_started_at, now())",
            &[&Phase::Backfilling.name()],
        )
        .await?;
    Ok(Some((state, after)))
}

/// The counts the control row holds, and the source's estimated size.
async fn resume_state(
    client: &Client,
    plan: &BackfillPlan<'_>,
) -> Result<BackfillProgress, MigrationError> {
    let row = plan.control.require(client).await?;
    let count = |name: &str| row.get(name).and_then(Value::as_u64).unwrap_or(0);
    Ok(BackfillProgress {
        copied: count("rows_copied"),
        rejected: count("rows_rejected"),
        total: estimate(client, plan.source).await?,
    })
}

/// A chunk read and converted, its transaction still open on the connection that read it.
struct Chunk {
    rows: Vec<Row>,
    rejected: Vec<Rejected>,
    last_key: Vec<Value>,
}

/// What records a chunk's resume point and counts in the control row.
const RECORD_CHUNK: &str = "backfill_after = $2, rows_copied = rows_copied + $3, \
                            rows_rejected = rows_rejected + $4";

/// The statements a chunk runs, prepared once per connection: parsed and planned once for
/// the whole backfill instead of once per chunk (and a round trip less each).
struct Statements {
    /// Begins a chunk's transaction, its lock waits short ([`share_lock`]).
    begin: String,
    /// The first chunk (no resume point).
    read_first: Statement,
    /// A chunk after a key.
    read_after: Statement,
    upsert: Statement,
    record: Statement,
}

impl Statements {
    async fn prepare(
        client: &Client,
        reader: &Reader,
        writer: &Writer,
        control: &Control,
    ) -> Result<Self, MigrationError> {
        Ok(Self {
            begin: format!("BEGIN; {}", share_lock::set_lock_timeout(true)),
            read_first: reader.prepare_read(client, false, true).await?,
            read_after: reader.prepare_read(client, true, true).await?,
            upsert: writer.prepare_upsert(client).await?,
            record: control.prepare_update(client, RECORD_CHUNK).await?,
        })
    }
}

/// One of the two connections, with what a chunk needs on it.
struct Turn<'a> {
    client: &'a Client,
    statements: &'a Statements,
    reader: &'a Reader,
    writer: &'a Writer,
    plan: &'a BackfillPlan<'a>,
}

/// The chunk's share-locked read, in a transaction begun for it, its lock waits relaxed again
/// afterwards for the writes. The three statements go out together (one round trip, not
/// three): a statement after a failed one fails too, and the read's error is the one returned.
async fn locked_read(turn: &Turn<'_>, after: Option<&[Value]>) -> Result<Vec<Row>, MigrationError> {
    let statement = match after {
        Some(_) => &turn.statements.read_after,
        None => &turn.statements.read_first,
    };
    let limit = i64::from(turn.plan.batch_rows);
    // `futures::join!` first polls the futures in the order written, and each sends its
    // statement at its first poll: the connection gets them in this order.
    let (begun, rows, relaxed) = futures::join!(
        turn.client.batch_execute(&turn.statements.begin),
        turn.reader
            .read_with(turn.client, statement, after, None, Some(limit)),
        // The chunk's writes wait for locks as long as the session says.
        turn.client
            .batch_execute("SET LOCAL lock_timeout = DEFAULT"),
    );
    begun.map_err(db("cannot begin a backfill chunk"))?;
    let rows = rows?;
    relaxed.map_err(db("cannot read a backfill chunk"))?;
    Ok(rows)
}

/// Begins a transaction on the turn's connection and reads the next chunk after `after`,
/// share-locked; `None` (and no transaction) when no row is left. The read gives way to the
/// applications' writers ([`share_lock`]): rolled back and tried again when its rows stay
/// locked.
async fn read_chunk(
    turn: &Turn<'_>,
    after: Option<&[Value]>,
) -> Result<Option<Chunk>, MigrationError> {
    let mut patience = Patience::default();
    let rows = loop {
        match locked_read(turn, after).await {
            Ok(rows) => break rows,
            Err(e) if e.gave_way() => {
                turn.client
                    .batch_execute("ROLLBACK")
                    .await
                    .map_err(db("cannot roll back a backfill chunk"))?;
                if !patience.pause("a backfill chunk").await {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    };
    let Some(last) = rows.last() else {
        turn.client
            .batch_execute("ROLLBACK")
            .await
            .map_err(db("cannot end the backfill"))?;
        return Ok(None);
    };
    let reader = turn.reader;
    let last_key = reader.key_of(last);
    let mut converted = Vec::with_capacity(rows.len());
    let mut rejected = Vec::new();
    for row in &rows {
        match turn.plan.transform.forward(row) {
            Ok(r) => converted.push(r),
            Err(e) => rejected.push(Rejected {
                key: key_text(row, reader.key()),
                reason: e.to_string(),
            }),
        }
    }
    Ok(Some(Chunk {
        rows: converted,
        rejected,
        last_key,
    }))
}

/// Writes `chunk` and its resume point in the transaction [`read_chunk`] began on the turn's
/// connection, and commits. The three statements go out together (one round trip): when the
/// write or the record fails, the transaction is aborted, the `COMMIT` after it rolls back,
/// and the first failure is the one returned, so nothing of a failed chunk stays.
async fn write_chunk(turn: &Turn<'_>, chunk: &Chunk) -> Result<(), MigrationError> {
    let refs: Vec<&Row> = chunk.rows.iter().collect();
    let after_json = Value::Array(chunk.last_key.clone());
    let (copied, rejected) = (chunk.rows.len() as i64, chunk.rejected.len() as i64);
    let record: [&(dyn ToSql + Sync); 3] = [&after_json, &copied, &rejected];
    // In this order on the connection (see `locked_read`).
    let (written, recorded, committed) = futures::join!(
        turn.writer
            .upsert_with(turn.client, &turn.statements.upsert, &refs),
        turn.plan
            .control
            .update_with(turn.client, &turn.statements.record, &record),
        turn.client.batch_execute("COMMIT"),
    );
    written?;
    recorded?;
    committed.map_err(db("cannot commit a backfill chunk"))
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
