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
//! The chunk's rows are converted by PostgreSQL in the same statement that reads them when the
//! transform can be written in SQL ([`InDatabase`]), by refract otherwise; the locking and the
//! argument above are the same either way.
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
use super::in_database::InDatabase;
use super::rows::{Reader, Writer};
use super::{MigrationError, db};
use crate::pg_sql::quote_ident;
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

/// Where a backfill's rows were converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvertedBy {
    /// By PostgreSQL, in the statement that reads them ([`InDatabase`]).
    Database,
    /// By refract, the transform not being written in SQL (the reason is logged).
    Refract,
}

impl std::fmt::Display for ConvertedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConvertedBy::Database => "converted by PostgreSQL",
            ConvertedBy::Refract => "converted by refract",
        })
    }
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
/// When the transform can be written in SQL ([`InDatabase`]), PostgreSQL converts and copies
/// each chunk itself ([`in_database`]), and only the rows it is not sure of come to refract;
/// otherwise every row is read, converted here and written back ([`through_refract`]).
pub async fn run(
    clients: [&Client; 2],
    plan: &BackfillPlan<'_>,
    restart: bool,
    progress: impl FnMut(BackfillProgress),
    rejected: impl FnMut(&Rejected),
) -> Result<(BackfillProgress, Option<ConvertedBy>), MigrationError> {
    let Some((state, after)) = begin(clients[0], plan, restart).await? else {
        let state = resume_state(clients[0], plan).await?;
        let mut progress = progress;
        progress(state);
        return Ok((state, None));
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
    let chunks = Chunks {
        reader: &reader,
        writer: &writer,
        plan,
        throttle: Throttle::new(plan.max_rows_per_second, state.copied),
    };
    let copy = InDatabase::compile(plan.transform, plan.source, plan.target).and_then(|sql| {
        CopySql::new(&chunks, &sql).ok_or_else(|| "a target column has no transform".to_owned())
    });
    let (state, by) = match copy {
        Ok(sql) => {
            tracing::info!("the backfill's rows are converted and copied by PostgreSQL");
            let state =
                in_database(clients[0], &chunks, &sql, state, after, progress, rejected).await?;
            (state, ConvertedBy::Database)
        }
        Err(why) => {
            tracing::info!(%why, "the backfill's rows are converted by refract: the transform is not written in SQL");
            let state = through_refract(clients, &chunks, state, after, progress, rejected).await?;
            (state, ConvertedBy::Refract)
        }
    };
    plan.control
        .update(
            clients[0],
            "phase = $2, backfill_done_at = now()",
            &[&Phase::Backfilled.name()],
        )
        .await?;
    Ok((state, Some(by)))
}

/// What every chunk of one backfill shares.
struct Chunks<'a> {
    reader: &'a Reader,
    writer: &'a Writer,
    plan: &'a BackfillPlan<'a>,
    throttle: Throttle,
}

/// `max_rows_per_second`, kept between chunks: the pause comes between a commit and the next
/// read, so that no row stays share-locked (applications' writes to it waiting) while the
/// backfill sleeps.
struct Throttle {
    rate: Option<u32>,
    started: Instant,
    copied_before: u64,
}

impl Throttle {
    fn new(rate: Option<u32>, copied_before: u64) -> Self {
        Self {
            rate,
            started: Instant::now(),
            copied_before,
        }
    }

    /// Sleeps until `copied` rows are due at the rate.
    async fn pause(&self, copied: u64) {
        let Some(rate) = self.rate else { return };
        let due = Duration::from_secs_f64(
            copied.saturating_sub(self.copied_before) as f64 / f64::from(rate),
        );
        if let Some(wait) = due.checked_sub(self.started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// The backfill with PostgreSQL converting: each chunk is one statement ([`CopySql`]) that
/// share-locks the next rows, writes the conversions it is sure of and returns the rest (and
/// the last key); refract converts those with
/// [`Transform::forward`](refract_projections::migration::Transform::forward), writes or
/// rejects them, and records the chunk in the same transaction. The statement's writes wait
/// for locks as briefly as its read: a chunk that meets rows the dual write holds gives way
/// and is tried again, as one that meets an application's.
async fn in_database(
    client: &Client,
    chunks: &Chunks<'_>,
    sql: &CopySql,
    mut state: BackfillProgress,
    mut after: Option<Vec<Value>>,
    mut progress: impl FnMut(BackfillProgress),
    mut rejected: impl FnMut(&Rejected),
) -> Result<BackfillProgress, MigrationError> {
    let statements = Statements::prepare(client, chunks, &sql.reads, sql.again.as_ref()).await?;
    let turn = Turn {
        client,
        statements: &statements,
        chunks,
    };
    while let Some(chunk) = copy_chunk(&turn, after.as_deref()).await? {
        for r in &chunk.rejected {
            rejected(r);
        }
        write_chunk(&turn, &chunk).await?;
        after = Some(chunk.last_key);
        state.copied += chunk.copied;
        state.rejected += chunk.rejected.len() as u64;
        progress(state);
        chunks.throttle.pause(state.copied).await;
    }
    Ok(state)
}

/// The backfill with refract converting every row.
///
/// Two connections take turns: while one writes chunk k and commits it, the other reads chunk
/// k+1 (its own transaction, its rows share-locked), so reading and converting overlap with
/// writing. The resume point still only moves forward, chunk by chunk: chunk k+1 is written
/// after chunk k committed. A kill loses at most the chunk being read, which nothing recorded.
async fn through_refract(
    clients: [&Client; 2],
    chunks: &Chunks<'_>,
    mut state: BackfillProgress,
    mut after: Option<Vec<Value>>,
    mut progress: impl FnMut(BackfillProgress),
    mut rejected: impl FnMut(&Rejected),
) -> Result<BackfillProgress, MigrationError> {
    let reads = [
        chunks.reader.statement(false, false, true, true),
        chunks.reader.statement(true, false, true, true),
    ];
    let statements = [
        Statements::prepare(clients[0], chunks, &reads, None).await?,
        Statements::prepare(clients[1], chunks, &reads, None).await?,
    ];
    let turn_of = |turn: usize| Turn {
        client: clients[turn],
        statements: &statements[turn],
        chunks,
    };
    let mut turn = 0;
    let mut chunk = read_chunk(&turn_of(turn), after.as_deref()).await?;
    while let Some(current) = chunk {
        for r in &current.rejected {
            rejected(r);
        }
        after = Some(current.last_key.clone());
        let (reading, writing) = (turn_of(1 - turn), turn_of(turn));
        let next = read_chunk(&reading, after.as_deref());
        let write = write_chunk(&writing, &current);
        if chunks.throttle.rate.is_none() {
            let (next, written) = tokio::join!(next, write);
            if let Err(e) = written {
                // The next chunk's transaction is open on the other connection: end it too.
                let _ = clients[1 - turn].batch_execute("ROLLBACK").await;
                return Err(e);
            }
            chunk = next?;
        } else {
            // Throttled: the next read waits for the commit and the pause ([`Throttle`]).
            write.await?;
            state.copied += current.copied;
            state.rejected += current.rejected.len() as u64;
            progress(state);
            chunks.throttle.pause(state.copied).await;
            chunk = next.await?;
            turn = 1 - turn;
            continue;
        }
        turn = 1 - turn;
        state.copied += current.copied;
        state.rejected += current.rejected.len() as u64;
        progress(state);
    }
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
    /// Rows refract converted, still to write.
    rows: Vec<Row>,
    rejected: Vec<Rejected>,
    last_key: Vec<Value>,
    /// Rows the chunk copies: `rows`, and those PostgreSQL wrote itself.
    copied: u64,
}

/// What records a chunk's resume point and counts in the control row.
const RECORD_CHUNK: &str = "backfill_after = $2, rows_copied = rows_copied + $3, \
                            rows_rejected = rows_rejected + $4";

/// The statements a chunk runs, prepared once per connection: parsed and planned once for
/// the whole backfill instead of once per chunk (and a round trip less each).
struct Statements {
    /// Begins a chunk's transaction, its lock waits short ([`share_lock`]).
    begin: String,
    /// The chunk's share-locked read (or in-database copy) of the first rows (no resume
    /// point), and of the rows after a key.
    read: [Statement; 2],
    /// The in-database copy that upserts every row ([`CopySql`]'s `again`).
    again: Option<[Statement; 2]>,
    upsert: Statement,
    record: Statement,
}

impl Statements {
    /// The statements on `client`, the chunk's read being `reads` (first, after a key), and
    /// `again` its in-database copy upserting every row.
    async fn prepare(
        client: &Client,
        chunks: &Chunks<'_>,
        reads: &[String; 2],
        again: Option<&[String; 2]>,
    ) -> Result<Self, MigrationError> {
        let prepare = |sql: &[String; 2]| {
            let what = format!("cannot read `{}`", chunks.plan.source.shape.table);
            let sql = sql.clone();
            async move {
                Ok::<_, MigrationError>([
                    client.prepare(&sql[0]).await.map_err(db(what.clone()))?,
                    client.prepare(&sql[1]).await.map_err(db(what))?,
                ])
            }
        };
        Ok(Self {
            begin: format!("BEGIN; {}", share_lock::set_lock_timeout(true)),
            read: prepare(reads).await?,
            again: match again {
                Some(again) => Some(prepare(again).await?),
                None => None,
            },
            upsert: chunks.writer.prepare_upsert(client).await?,
            record: chunks
                .plan
                .control
                .prepare_update(client, RECORD_CHUNK)
                .await?,
        })
    }
}

/// Of a pair of statements (first rows, rows after a key), the one for `after`.
fn for_rows<'a>(pair: &'a [Statement; 2], after: Option<&[Value]>) -> &'a Statement {
    &pair[usize::from(after.is_some())]
}

/// The in-database copy of a chunk ([`in_database`]) as SQL: the share-locked read of the
/// source rows (with whether the database is sure of each conversion), the write of those it
/// is sure of, and what comes back: the last row, then each row it is not sure of, as
/// [`Reader::decode`] reads them, followed by `sure`, `last` and the number of rows read.
///
/// The write is a plain `INSERT` when the target holds no row in the chunk's key range (an
/// index probe), an upsert otherwise: an upsert costs PostgreSQL about half as much again per
/// row (a speculative insertion), and the range is empty unless the dual write got there first.
/// A row the dual write inserts in the range after the probe makes the `INSERT` fail on the
/// identity index; the chunk is then copied again with `again`, which upserts every row. So
/// the probe decides the cost, never the result. It is only made where the identity sorts as
/// the source key does (same kinds of types, same collations); elsewhere every chunk upserts.
struct CopySql {
    /// The chunk's copy, of the first rows and of the rows after a key.
    reads: [String; 2],
    /// The copy that upserts every row, when `reads` may insert.
    again: Option<[String; 2]>,
}

/// The copy's own output columns, named so that no source column is taken for them.
const SURE: &str = "\"refract sure\"";
const LAST: &str = "\"refract last\"";

impl CopySql {
    /// The copy for these tables; `None` when `sql` lacks a column of `writer`.
    fn new(chunks: &Chunks<'_>, sql: &InDatabase) -> Option<Self> {
        let (reader, writer) = (chunks.reader, chunks.writer);
        let values = sql.values_of(writer.columns())?;
        let key_last: Vec<String> = reader
            .key()
            .iter()
            .map(|k| format!("{} DESC", quote_ident(k)))
            .collect();
        let key_last = key_last.join(", ");
        let sure_rows = format!("SELECT {values} FROM src WHERE {SURE}");
        let statement = |after: bool, writes: &str| {
            let locked = reader.statement_selecting(
                &format!("*, {} AS {SURE}", sql.sure()),
                after,
                false,
                true,
                true,
            );
            format!(
                "WITH src AS ({locked}), {writes} \
                 SELECT {list}, r.{SURE}, r.{LAST}, (SELECT count(*) FROM src) FROM ( \
                   (SELECT *, true AS {LAST} FROM src ORDER BY {key_last} LIMIT 1) \
                   UNION ALL (SELECT *, false FROM src WHERE NOT {SURE})) AS r",
                list = reader.select_list("r."),
            )
        };
        let upsert = format!("copied AS ({})", writer.upsert_selecting(&sure_rows));
        let upserts = [statement(false, &upsert), statement(true, &upsert)];
        let (source, target) = (chunks.plan.source, chunks.plan.target);
        let same_collations = reader
            .key()
            .iter()
            .zip(writer.identity())
            .all(|(k, i)| source.collation(k) == target.collation(i));
        if chunks.plan.transform.key_order_changes().is_some() || !same_collations {
            return Some(Self {
                reads: upserts,
                again: None,
            });
        }
        let identity: Vec<(String, &str)> = writer
            .identity()
            .iter()
            .map(|c| (quote_ident(c), target.cast_type(c)))
            .collect();
        let names: Vec<&str> = identity.iter().map(|(n, _)| n.as_str()).collect();
        let names = names.join(", ");
        let last: Vec<String> = reader
            .key()
            .iter()
            .zip(&identity)
            .map(|(k, (_, t))| format!("{}::{t}", quote_ident(k)))
            .collect();
        let through = format!(
            "({names}) <= (SELECT {} FROM src ORDER BY {key_last} LIMIT 1)",
            last.join(", ")
        );
        let probe = |after: bool| {
            let range = if after {
                // The resume point is the read's parameters $1, $2, ….
                let params: Vec<String> = identity
                    .iter()
                    .enumerate()
                    .map(|(i, (_, t))| format!("${}::text::{t}", i + 1))
                    .collect();
                format!("({names}) > ({}) AND {through}", params.join(", "))
            } else {
                through.clone()
            };
            format!(
                "present AS (SELECT EXISTS (SELECT 1 FROM {} WHERE {range}) AS found), \
                 fresh AS ({}), copied AS ({})",
                target.quoted,
                writer
                    .insert_selecting(&format!("{sure_rows} AND NOT (SELECT found FROM present)")),
                writer.upsert_selecting(&format!("{sure_rows} AND (SELECT found FROM present)")),
            )
        };
        Some(Self {
            reads: [
                statement(false, &probe(false)),
                statement(true, &probe(true)),
            ],
            again: Some(upserts),
        })
    }
}

/// One connection, with what a chunk needs on it.
struct Turn<'a> {
    client: &'a Client,
    statements: &'a Statements,
    chunks: &'a Chunks<'a>,
}

/// Runs `attempt` (a chunk's first statements, in a transaction it begins) until it does not
/// give way to the applications' writers ([`share_lock`]): rolled back and tried again while
/// its rows stay locked, as patient as [`Patience`].
async fn giving_way<T, F>(
    client: &Client,
    mut attempt: impl FnMut() -> F,
) -> Result<T, MigrationError>
where
    F: std::future::Future<Output = Result<T, MigrationError>>,
{
    let mut patience = Patience::default();
    loop {
        match attempt().await {
            Err(e) if e.gave_way() => {
                client
                    .batch_execute("ROLLBACK")
                    .await
                    .map_err(db("cannot roll back a backfill chunk"))?;
                if !patience.pause("a backfill chunk").await {
                    return Err(e);
                }
            }
            done => return done,
        }
    }
}

/// Begins a chunk's transaction and runs its read, `statement` with the resume point `after`
/// and the chunk's size, its lock waits relaxed again afterwards for the writes. The three
/// statements go out together (one round trip, not three): a statement after a failed one
/// fails too, and the read's error is the one returned.
async fn locked_read(
    turn: &Turn<'_>,
    statements: &[Statement; 2],
    after: Option<&[Value]>,
) -> Result<Vec<tokio_postgres::Row>, MigrationError> {
    let chunks = turn.chunks;
    let limit = i64::from(chunks.plan.batch_rows);
    // `futures::join!` first polls the futures in the order written, and each sends its
    // statement at its first poll: the connection gets them in this order.
    let (begun, rows, relaxed) = futures::join!(
        turn.client.batch_execute(&turn.statements.begin),
        chunks.reader.query_with(
            turn.client,
            for_rows(statements, after),
            after,
            None,
            Some(limit)
        ),
        // The chunk's writes wait for locks as long as the session says.
        turn.client
            .batch_execute("SET LOCAL lock_timeout = DEFAULT"),
    );
    begun.map_err(db("cannot begin a backfill chunk"))?;
    let rows = rows?;
    relaxed.map_err(db("cannot read a backfill chunk"))?;
    Ok(rows)
}

/// Ends the transaction of a chunk that found no row left (or failed).
async fn end(turn: &Turn<'_>) -> Result<(), MigrationError> {
    turn.client
        .batch_execute("ROLLBACK")
        .await
        .map_err(db("cannot end the backfill"))
}

/// `rows` converted with the transform: those it converts, and those it rejects with why.
fn convert<'r>(
    chunks: &Chunks<'_>,
    rows: impl IntoIterator<Item = &'r Row>,
) -> (Vec<Row>, Vec<Rejected>) {
    let mut converted = Vec::new();
    let mut rejected = Vec::new();
    for row in rows {
        match chunks.plan.transform.forward(row) {
            Ok(r) => converted.push(r),
            Err(e) => rejected.push(Rejected {
                key: key_text(row, chunks.reader.key()),
                reason: e.to_string(),
            }),
        }
    }
    (converted, rejected)
}

/// Begins a transaction on the turn's connection and reads the next chunk after `after`,
/// share-locked, converted by refract; `None` (and no transaction) when no row is left.
async fn read_chunk(
    turn: &Turn<'_>,
    after: Option<&[Value]>,
) -> Result<Option<Chunk>, MigrationError> {
    let read = &turn.statements.read;
    let rows = giving_way(turn.client, || locked_read(turn, read, after)).await?;
    let rows = turn.chunks.reader.decode(&rows)?;
    let Some(last) = rows.last() else {
        end(turn).await?;
        return Ok(None);
    };
    let last_key = turn.chunks.reader.key_of(last);
    let (converted, rejected) = convert(turn.chunks, &rows);
    Ok(Some(Chunk {
        copied: converted.len() as u64,
        rows: converted,
        rejected,
        last_key,
    }))
}

/// Begins a transaction on the turn's connection and copies the next chunk after `after` in
/// the database ([`CopySql`], again with its upserts when its insert met a row of the dual
/// write); the rows it was not sure of are converted by refract, still to write. `None` (and
/// no transaction) when no row is left.
async fn copy_chunk(
    turn: &Turn<'_>,
    after: Option<&[Value]>,
) -> Result<Option<Chunk>, MigrationError> {
    let read = &turn.statements.read;
    let raw = match (
        giving_way(turn.client, || locked_read(turn, read, after)).await,
        &turn.statements.again,
    ) {
        // The dual write inserted a row of the chunk after the probe: upsert them all.
        (Err(e), Some(again)) if e.is_unique_violation() => {
            tracing::info!(
                after = ?after,
                "a chunk met a row the dual write inserted after its probe: copied again with upserts"
            );
            end(turn).await?;
            giving_way(turn.client, || locked_read(turn, again, after)).await?
        }
        (raw, _) => raw?,
    };
    let reader = turn.chunks.reader;
    let rows = reader.decode(&raw)?;
    let columns = reader.width();
    let (mut last_key, mut read, mut unsure) = (None, 0, Vec::new());
    for (row, r) in raw.iter().zip(&rows) {
        let (sure, last): (bool, bool) = (row.get(columns), row.get(columns + 1));
        read = row.get::<_, i64>(columns + 2) as u64;
        if last {
            last_key = Some(reader.key_of(r));
        } else if !sure {
            unsure.push(r);
        }
    }
    let Some(last_key) = last_key else {
        end(turn).await?;
        return Ok(None);
    };
    let (converted, rejected) = convert(turn.chunks, unsure);
    Ok(Some(Chunk {
        copied: read - rejected.len() as u64,
        rows: converted,
        rejected,
        last_key,
    }))
}

/// Writes `chunk` and its resume point in the transaction the read began on the turn's
/// connection, and commits. The three statements go out together (one round trip): when the
/// write or the record fails, the transaction is aborted, the `COMMIT` after it rolls back,
/// and the first failure is the one returned, so nothing of a failed chunk stays.
async fn write_chunk(turn: &Turn<'_>, chunk: &Chunk) -> Result<(), MigrationError> {
    let refs: Vec<&Row> = chunk.rows.iter().collect();
    let after_json = Value::Array(chunk.last_key.clone());
    let (copied, rejected) = (chunk.copied as i64, chunk.rejected.len() as i64);
    let record: [&(dyn ToSql + Sync); 3] = [&after_json, &copied, &rejected];
    let chunks = turn.chunks;
    // In this order on the connection (see `locked_read`).
    let (written, recorded, committed) = futures::join!(
        chunks
            .writer
            .upsert_with(turn.client, &turn.statements.upsert, &refs),
        chunks
            .plan
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
