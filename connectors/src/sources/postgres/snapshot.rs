//! Snapshots and backfills: the rows that already exist, re-read into the stream.
//!
//! Each published table is read in primary-key order, a chunk of rows at a time. A chunk is one
//! short statement that share-locks its rows (`FOR SHARE`) and writes them into the WAL as one
//! transactional logical message (`pg_logical_emit_message(true, …)`). The message therefore
//! reaches the replication stream exactly at its commit, in commit order with every other
//! change:
//! - a transaction that changed or deleted one of the rows committed before the chunk locked it
//!   (the lock waits for it and reads its result), so its change comes earlier in the stream
//!   and the chunk carries the newer value (or no row at all for a deleted one);
//! - a transaction that changes one of the rows after the chunk waits for the chunk's commit,
//!   so its change comes later in the stream and wins.
//!
//! No row comes back after its delete and no old value overwrites a newer one, while the daemon
//! streams (chunks finish an initial snapshot that was interrupted; backfills read an exported
//! snapshot, see [`CopySnapshot`] and [`BackfillRequest`]). There is no long transaction: each
//! chunk holds its locks for one statement, and gives way to the applications' writers when
//! they lock rows in another order ([`share_lock`](super::share_lock)): it never makes one of
//! their transactions a deadlock victim. Progress (the last key of the last committed chunk per table) is kept in a small
//! JSON file in the pipeline's state directory, replaced atomically after every chunk, so an
//! interrupted snapshot resumes at its last chunk; a chunk emitted twice is harmless (its rows
//! are upserts at its position in the stream).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::inspect::error_text;
use super::share_lock::{self, Patience};
use super::source::io;
use crate::SourceError;
use crate::pg_sql::{qualified, quote_ident};

mod copy;
mod request;
pub use copy::{
    CopyKind, CopyPlan, CopySnapshot, CopyTable, PlannedTable, create_slot_exporting,
    export_for_backfill, parse_copy_line, resume_after_copy, resume_copy_kind,
};
pub use request::{Asked, BackfillRequest, BackfillStatus, request_prefix};

/// Prefix of the chunk messages of slot `slot` (other slots' chunks are ignored).
pub fn message_prefix(slot: &str) -> String {
    format!("refract.rows:{slot}")
}

/// One chunk as written into the WAL.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChunkMessage {
    /// `schema.table`.
    #[serde(rename = "t")]
    pub table: String,
    /// Primary-key column names, in key order.
    #[serde(rename = "k")]
    pub key: Vec<String>,
    /// Column names.
    #[serde(rename = "c")]
    pub columns: Vec<String>,
    /// Column type OIDs.
    #[serde(rename = "o")]
    pub types: Vec<u32>,
    /// Rows: one text value (or null) per column, as PostgreSQL prints them.
    #[serde(rename = "r")]
    pub rows: Vec<Vec<Option<String>>>,
}

/// Progress of a running snapshot or backfill, shared with whoever reports it.
#[derive(Debug, Default)]
pub struct ChunkProgress {
    /// Rows read so far (including those of an interrupted earlier run).
    pub rows: AtomicU64,
    /// Estimated rows in all the tables.
    pub total: AtomicU64,
}

/// The progress file.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// The tables asked for (empty: all).
    scope: Vec<String>,
    /// Whether `tables` has been filled in.
    planned: bool,
    tables: Vec<TableState>,
    complete: bool,
    /// The `refract backfill` request a running daemon read this backfill for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request: Option<String>,
    /// Why the daemon could not read the requested backfill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct TableState {
    /// `schema.table`.
    table: String,
    /// Estimated rows.
    estimate: u64,
    /// The key of the last row of the last committed chunk, as text.
    after: Option<Vec<String>>,
    rows: u64,
    done: bool,
    /// Why the table was not read (no primary key).
    skipped: Option<String>,
}

/// A table's shape as the chunks need it.
struct TableShape {
    quoted: String,
    /// (name, SQL type) of the primary-key columns.
    key: Vec<(String, String)>,
    columns: Vec<(String, u32)>,
}

/// What a finished snapshot or backfill did.
#[derive(Debug, Clone, Default)]
pub struct ChunkReport {
    /// Rows read, per table.
    pub tables: Vec<(String, u64)>,
    /// Tables not read, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// Reads tables in chunks into the WAL (see the module documentation).
pub struct Chunker {
    client: tokio_postgres::Client,
    publication: String,
    prefix: String,
    chunk_rows: u32,
    path: PathBuf,
    state: State,
    progress: Arc<ChunkProgress>,
}

/// Writes the snapshot progress file marking a snapshot as due, before the slot exists: if the
/// process dies between creating the slot and reading the tables, the next start still reads them.
pub fn mark_snapshot_due(path: &Path) -> Result<(), SourceError> {
    persist(path, &State::default())
}

/// Whether the progress file at `path` holds an unfinished snapshot or backfill.
pub fn unfinished(path: &Path) -> bool {
    load(path).is_ok_and(|s| s.is_some_and(|s| !s.complete))
}

impl Chunker {
    /// Connects and loads (or starts) the progress kept at `path`. `scope` limits the tables
    /// (`schema.table` or `table`); `restart` forgets an unfinished earlier run.
    pub async fn prepare(
        url: &str,
        publication: &str,
        slot: &str,
        chunk_rows: u32,
        path: PathBuf,
        scope: &[String],
        restart: bool,
    ) -> Result<Self, SourceError> {
        let client = super::source::connect(url).await?;
        client
            .batch_execute(&format!(
                "{}; SET DateStyle = 'ISO'",
                share_lock::set_lock_timeout(false)
            ))
            .await
            .map_err(io("cannot configure the snapshot session"))?;
        let scope = resolve_scope(&client, publication, scope).await?;
        let scope = scope.as_slice();
        super::privileges::check_chunked_reads(&client, publication, scope).await?;
        let mut state = match load(&path)? {
            Some(s) if !s.complete && !restart && s.scope == scope => {
                if s.planned {
                    tracing::info!(path = %path.display(), "resuming an interrupted snapshot/backfill");
                }
                s
            }
            Some(s) if !s.complete && !restart => {
                tracing::warn!(
                    earlier = ?s.scope,
                    now = ?scope,
                    "an unfinished backfill of other tables is replaced by this one"
                );
                State::default()
            }
            _ => State::default(),
        };
        state.scope = scope.to_vec();
        let mut chunker = Self {
            client,
            publication: publication.to_owned(),
            prefix: message_prefix(slot),
            chunk_rows,
            path,
            state,
            progress: Arc::new(ChunkProgress::default()),
        };
        if !chunker.state.planned {
            chunker.plan().await?;
        }
        let done: u64 = chunker.state.tables.iter().map(|t| t.rows).sum();
        let total: u64 = chunker
            .state
            .tables
            .iter()
            .map(|t| t.estimate.max(t.rows))
            .sum();
        chunker.progress.rows.store(done, Ordering::Relaxed);
        chunker.progress.total.store(total, Ordering::Relaxed);
        Ok(chunker)
    }

    /// Marks the backfill as read for `refract backfill` request `id` (which follows it by
    /// that id) and records it.
    pub fn for_request(mut self, id: &str) -> Result<Self, SourceError> {
        self.state.request = Some(id.to_owned());
        self.state.error = None;
        persist(&self.path, &self.state)?;
        Ok(self)
    }

    /// The shared progress counters.
    pub fn progress(&self) -> Arc<ChunkProgress> {
        self.progress.clone()
    }

    /// The planned tables with what an earlier run read of them, and the scope, for reading
    /// the rest another way (the backfill's fast path) instead of in chunks.
    pub fn into_plan(self) -> (Vec<PlannedTable>, Vec<String>) {
        let tables = self
            .state
            .tables
            .into_iter()
            .map(|t| PlannedTable {
                table: t.table,
                after: t.after,
                rows: t.rows,
                estimate: t.estimate,
                done: t.done,
                skipped: t.skipped,
            })
            .collect();
        (tables, self.state.scope)
    }

    async fn plan(&mut self) -> Result<(), SourceError> {
        let published = published_tables(&self.client, &self.publication).await?;
        let mut tables = Vec::new();
        for table in published {
            if !(self.state.scope.is_empty() || self.state.scope.contains(&table)) {
                continue;
            }
            let shape = self.shape(&table).await?;
            let estimate = self.estimate(&shape.quoted).await?;
            let skipped = shape.key.is_empty().then(|| {
                "no primary key: it cannot be read in key order (add one, or leave it out of the publication)".to_owned()
            });
            if let Some(reason) = &skipped {
                tracing::warn!(%table, reason, "table left out of the snapshot");
            }
            tables.push(TableState {
                table,
                estimate,
                after: None,
                rows: 0,
                done: skipped.is_some(),
                skipped,
            });
        }
        self.state.tables = tables;
        self.state.planned = true;
        persist(&self.path, &self.state)
    }

    async fn shape(&self, table: &str) -> Result<TableShape, SourceError> {
        table_shape(&self.client, &self.publication, table).await
    }

    async fn estimate(&self, quoted: &str) -> Result<u64, SourceError> {
        if let Some(estimate) = planner_estimate(&self.client, quoted).await? {
            return Ok(estimate);
        }
        // Never analyzed: count.
        let row = self
            .client
            .query_one(&format!("SELECT count(*) FROM {quoted}"), &[])
            .await
            .map_err(io(format!("cannot count the rows of {quoted}")))?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    /// Reads every planned table to its end. Returns what was read.
    pub async fn run(mut self) -> Result<ChunkReport, SourceError> {
        let mut report = ChunkReport::default();
        for index in 0..self.state.tables.len() {
            let table = self.state.tables[index].table.clone();
            if let Some(reason) = &self.state.tables[index].skipped {
                report.skipped.push((table, reason.clone()));
                continue;
            }
            if !self.state.tables[index].done {
                self.read_table(index).await?;
            }
            report.tables.push((table, self.state.tables[index].rows));
        }
        self.state.complete = true;
        persist(&self.path, &self.state)?;
        Ok(report)
    }

    async fn read_table(&mut self, index: usize) -> Result<(), SourceError> {
        let table = self.state.tables[index].table.clone();
        let shape = self.shape(&table).await?;
        if shape.key.is_empty() {
            return Err(SourceError::Inconsistent(format!(
                "table `{table}` lost its primary key during the snapshot"
            )));
        }
        let header = {
            let mut h = serde_json::to_string(&ChunkMessage {
                table: table.clone(),
                key: shape.key.iter().map(|(c, _)| c.clone()).collect(),
                columns: shape.columns.iter().map(|(c, _)| c.clone()).collect(),
                types: shape.columns.iter().map(|(_, o)| *o).collect(),
                rows: Vec::new(),
            })
            .expect("a chunk header serializes");
            // `…,"r":[]}` becomes `…,"r":` and the rows follow in the statement.
            h.truncate(h.len() - "[]}".len());
            h
        };
        let first = chunk_sql(&shape, self.chunk_rows, true);
        let next = chunk_sql(&shape, self.chunk_rows, false);
        tracing::info!(%table, "reading the table in chunks of {} rows", self.chunk_rows);
        loop {
            let after = self.state.tables[index].after.clone();
            let mut patience = Patience::default();
            let row = loop {
                let result = match &after {
                    None => {
                        self.client
                            .query_one(&first, &[&self.prefix, &header])
                            .await
                    }
                    Some(key) => {
                        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                            vec![&self.prefix, &header];
                        for k in key {
                            params.push(k);
                        }
                        self.client.query_one(&next, &params).await
                    }
                };
                match result {
                    Ok(row) => break row,
                    Err(e)
                        if share_lock::gave_way(&e)
                            && patience.pause(&format!("a chunk of `{table}`")).await => {}
                    Err(e) => {
                        return Err(SourceError::Io {
                            message: format!(
                                "cannot read a chunk of `{table}` (it gave way to locks {} times): {}",
                                patience.attempts(),
                                error_text(&e)
                            ),
                            source: None,
                        });
                    }
                }
            };
            let count: i64 = row.get(0);
            let last: Option<String> = row.get(1);
            let t = &mut self.state.tables[index];
            t.rows += count as u64;
            if let Some(last) = last {
                t.after = Some(serde_json::from_str(&last).map_err(|e| {
                    SourceError::Inconsistent(format!("unexpected chunk key `{last}`: {e}"))
                })?);
            }
            t.done = (count as u64) < u64::from(self.chunk_rows);
            persist(&self.path, &self.state)?;
            self.progress
                .rows
                .fetch_add(count as u64, Ordering::Relaxed);
            if self.state.tables[index].done {
                tracing::info!(%table, rows = self.state.tables[index].rows, "table read");
                return Ok(());
            }
        }
    }
}

/// A published table's columns and primary key.
async fn table_shape(
    client: &tokio_postgres::Client,
    publication: &str,
    table: &str,
) -> Result<TableShape, SourceError> {
    let (schema, name) = table.split_once('.').unwrap_or(("public", table));
    let quoted = qualified(schema, name);
    // The published columns (a publication may list columns), generated ones excluded as
    // pgoutput leaves them out.
    let columns = client
        .query(
            "SELECT a.attname::text, a.atttypid, (i.indisprimary IS TRUE), \
                    format_type(a.atttypid, a.atttypmod), array_position(i.indkey, a.attnum) \
             FROM pg_attribute a \
             LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary AND a.attnum = ANY(i.indkey) \
             JOIN pg_publication_tables p ON p.pubname = $2 AND p.schemaname = $3 AND p.tablename = $4 \
             WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped \
               AND a.attgenerated = '' AND a.attname = ANY(p.attnames) \
             ORDER BY a.attnum",
            &[&quoted.as_str(), &publication, &schema, &name],
        )
        .await
        .map_err(io(format!("cannot read the columns of `{table}`")))?;
    let mut key: Vec<(i32, String, String)> = Vec::new();
    let mut out = Vec::new();
    for row in &columns {
        let column: String = row.get(0);
        let oid: u32 = row.get(1);
        if row.get::<_, bool>(2) {
            key.push((row.get(4), column.clone(), row.get(3)));
        }
        out.push((column, oid));
    }
    key.sort();
    Ok(TableShape {
        quoted,
        key: key.into_iter().map(|(_, c, t)| (c, t)).collect(),
        columns: out,
    })
}

/// The planner's estimate of the rows of table `quoted` (quoted `schema.table`); `None` when
/// it was never analyzed.
pub(crate) async fn planner_estimate(
    client: &tokio_postgres::Client,
    quoted: &str,
) -> Result<Option<u64>, SourceError> {
    let row = client
        .query_one(
            "SELECT reltuples::int8 FROM pg_class WHERE oid = $1::text::regclass",
            &[&quoted],
        )
        .await
        .map_err(io(format!("cannot estimate the rows of {quoted}")))?;
    let estimate: i64 = row.get(0);
    Ok((estimate >= 0).then_some(estimate as u64))
}

/// `schema.table` of every table of the publication, sorted.
pub(crate) async fn published_tables(
    client: &tokio_postgres::Client,
    publication: &str,
) -> Result<Vec<String>, SourceError> {
    let rows = client
        .query(
            "SELECT schemaname::text || '.' || tablename::text FROM pg_publication_tables \
             WHERE pubname = $1 ORDER BY 1",
            &[&publication],
        )
        .await
        .map_err(io("cannot list the publication's tables"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The asked-for tables (`schema.table` or `table`) as `schema.table` names of the publication,
/// sorted; an error names a table the publication does not have.
pub async fn resolve_scope(
    client: &tokio_postgres::Client,
    publication: &str,
    wanted: &[String],
) -> Result<Vec<String>, SourceError> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let published = published_tables(client, publication).await?;
    let mut out = Vec::new();
    for w in wanted {
        let found: Vec<&String> = published
            .iter()
            .filter(|p| *p == w || p.split_once('.').is_some_and(|(_, t)| t == w))
            .collect();
        match found.as_slice() {
            [one] => out.push((*one).clone()),
            [] => {
                return Err(SourceError::Inconsistent(format!(
                    "table `{w}` is not in publication `{publication}` (it has: {})",
                    published.join(", ")
                )));
            }
            _ => {
                return Err(SourceError::Inconsistent(format!(
                    "table `{w}` is ambiguous in publication `{publication}`: write it as schema.table"
                )));
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The statement reading one chunk (after the key in parameters `$3…`, unless `first`) and
/// writing it as a logical message with prefix `$1` and header `$2`. Returns the rows read, the
/// last key (a JSON array of text) and the message's LSN (unused: it makes the statement write
/// the message).
fn chunk_sql(shape: &TableShape, limit: u32, first: bool) -> String {
    let keys: Vec<String> = shape.key.iter().map(|(c, _)| quote_ident(c)).collect();
    let aliases: Vec<String> = (0..keys.len()).map(|i| format!("__refract_k{i}")).collect();
    let select_keys: Vec<String> = keys
        .iter()
        .zip(&aliases)
        .map(|(k, a)| format!("{k} AS {a}"))
        .collect();
    let row = format!(
        "to_json(ARRAY[{}]::text[])",
        shape
            .columns
            .iter()
            .map(|(c, _)| format!("{}::text", quote_ident(c)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let filter = if first {
        String::new()
    } else {
        let params: Vec<String> = shape
            .key
            .iter()
            .enumerate()
            .map(|(i, (_, ty))| format!("${}::text::{ty}", i + 3))
            .collect();
        format!("WHERE ({}) > ({})", keys.join(", "), params.join(", "))
    };
    let last_key = format!(
        "to_json(ARRAY[{}]::text[])",
        aliases
            .iter()
            .map(|a| format!("{a}::text"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let descending: Vec<String> = aliases.iter().map(|a| format!("{a} DESC")).collect();
    format!(
        "WITH chunk AS MATERIALIZED (\
            SELECT {select_keys}, {row} AS __refract_row FROM {table} {filter} \
            ORDER BY {order} LIMIT {limit} FOR SHARE), \
         last AS (SELECT {last_key} AS k FROM chunk ORDER BY {descending} LIMIT 1) \
         SELECT (SELECT count(*) FROM chunk), (SELECT k::text FROM last), \
            CASE WHEN EXISTS (SELECT 1 FROM chunk) THEN pg_logical_emit_message(true, $1::text, \
                $2::text || (SELECT json_agg(__refract_row)::text FROM chunk) || '}}')::text END",
        select_keys = select_keys.join(", "),
        table = shape.quoted,
        order = keys.join(", "),
        descending = descending.join(", "),
    )
}

fn load(path: &Path) -> Result<Option<State>, SourceError> {
    read_json(path, "delete it to start the snapshot or backfill over")
}

/// Reads a JSON file of the state directory; `None` when there is none. `remedy` ends the error
/// for a file that does not parse.
fn read_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    remedy: &str,
) -> Result<Option<T>, SourceError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            SourceError::Inconsistent(format!("{} is unreadable ({e}); {remedy}", path.display()))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SourceError::Io {
            message: format!("cannot read {}", path.display()),
            source: Some(e),
        }),
    }
}

/// Replaces the progress file atomically and durably.
fn persist<T: Serialize>(path: &Path, state: &T) -> Result<(), SourceError> {
    let fail = |e: std::io::Error| SourceError::Io {
        message: format!("cannot write {}", path.display()),
        source: Some(e),
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(fail)?;
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(state).expect("the progress state serializes");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp).map_err(fail)?;
        f.write_all(&bytes).map_err(fail)?;
        f.sync_all().map_err(fail)?;
    }
    std::fs::rename(&tmp, path).map_err(fail)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(fail)
}
