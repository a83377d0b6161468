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
//! No row comes back after its delete and no old value overwrites a newer one, whether the
//! chunks are read by the daemon itself (initial snapshot) or by a separate `refract backfill`
//! while the daemon streams. There is no long transaction: each chunk holds its locks for one
//! statement. Progress (the last key of the last committed chunk per table) is kept in a small
//! JSON file in the pipeline's state directory, replaced atomically after every chunk, so an
//! interrupted snapshot resumes at its last chunk; a chunk emitted twice is harmless (its rows
//! are upserts at its position in the stream).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::source::{io, quote_ident};
use crate::SourceError;

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
    /// The WAL position of the last chunk message, if any was written by this run.
    pub last_lsn: Option<String>,
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
            .batch_execute("SET lock_timeout = '10s'; SET DateStyle = 'ISO'")
            .await
            .map_err(io("cannot configure the snapshot session"))?;
        let scope = resolve_scope(&client, publication, scope).await?;
        let scope = scope.as_slice();
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

    /// The shared progress counters.
    pub fn progress(&self) -> Arc<ChunkProgress> {
        self.progress.clone()
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
        let row = self
            .client
            .query_one(
                "SELECT reltuples::int8 FROM pg_class WHERE oid = $1::text::regclass",
                &[&quoted],
            )
            .await
            .map_err(io(format!("cannot estimate the rows of {quoted}")))?;
        let estimate: i64 = row.get(0);
        if estimate >= 0 {
            return Ok(estimate as u64);
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
                self.read_table(index, &mut report).await?;
            }
            report.tables.push((table, self.state.tables[index].rows));
        }
        self.state.complete = true;
        persist(&self.path, &self.state)?;
        Ok(report)
    }

    async fn read_table(
        &mut self,
        index: usize,
        report: &mut ChunkReport,
    ) -> Result<(), SourceError> {
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
            let mut attempt = 0u32;
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
                        if attempt < 30
                            && e.code()
                                == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
                    {
                        attempt += 1;
                        tracing::warn!(%table, attempt, "rows of the chunk are locked by another transaction: retrying");
                        tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt.min(10))))
                            .await;
                    }
                    Err(e) => {
                        return Err(SourceError::Io {
                            message: format!("cannot read a chunk of `{table}`: {e}"),
                            source: None,
                        });
                    }
                }
            };
            let count: i64 = row.get(0);
            let last: Option<String> = row.get(1);
            let lsn: Option<String> = row.get(2);
            let t = &mut self.state.tables[index];
            t.rows += count as u64;
            if let Some(last) = last {
                t.after = Some(serde_json::from_str(&last).map_err(|e| {
                    SourceError::Inconsistent(format!("unexpected chunk key `{last}`: {e}"))
                })?);
            }
            t.done = (count as u64) < u64::from(self.chunk_rows);
            if lsn.is_some() {
                report.last_lsn = lsn;
            }
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
    let quoted = format!("{}.{}", quote_ident(schema), quote_ident(name));
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

/// `schema.table` of every table of the publication, sorted.
async fn published_tables(
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
async fn resolve_scope(
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
/// last key (a JSON array of text) and the message's LSN.
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
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            SourceError::Inconsistent(format!(
                "snapshot progress file {} is unreadable ({e}); delete it to start the snapshot over",
                path.display()
            ))
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

/// A backfill run by `refract backfill` while a daemon streams the pipeline: reads the chunks
/// into the WAL; the daemon applies them. Returns the chunker to [`Chunker::run`] (with its
/// progress counters) once prepared.
pub async fn standalone_backfill(
    config: &refract_schemas::config::PostgresSourceConfig,
    context: &crate::SourceContext,
) -> Result<Chunker, SourceError> {
    let scope = context.backfill.clone().unwrap_or_default();
    Chunker::prepare(
        &config.url,
        &config.publication_name(&context.pipeline),
        &config.slot_name(&context.pipeline),
        config.chunk_rows,
        super::source::PostgresSource::backfill_progress_path(&context.state_dir),
        &scope.tables,
        scope.restart,
    )
    .await
}

/// How far the slot of a running pipeline has confirmed past the WAL position `lsn`: `Ok(true)`
/// once its `confirmed_flush_lsn` is at or beyond it (every chunk before is durable in the read
/// models).
pub async fn slot_confirmed_past(url: &str, slot: &str, lsn: &str) -> Result<bool, SourceError> {
    let client = super::source::connect(url).await?;
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot, &lsn],
        )
        .await
        .map_err(io("cannot read the slot's confirmed position"))?;
    match row {
        Some(row) => Ok(row.get::<_, Option<bool>>(0).unwrap_or(false)),
        None => Err(SourceError::Inconsistent(format!(
            "replication slot `{slot}` does not exist"
        ))),
    }
}

// --- The initial snapshot's fast path: an exported snapshot read with COPY ---------------------
//
// When refract creates the slot itself it asks the replication session to export the snapshot the
// slot starts from (`CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT`), imports it into a REPEATABLE
// READ transaction and reads every published table with COPY, in primary-key order, before the
// first streamed change: rows exactly as of the slot's start, no locks, no WAL written. The rows
// take positions `(consistent point - 1, (table + 1) << 40 | row)`, below every streamed change.
// Every 10,000 rows the key reached is noted (no fsync needed: an older note only re-reads more).
// If the process dies before the rows are durable, the next start turns the notes and the
// durable checkpoint into chunk progress, and the rest is read in chunks (above), which are
// consistent with the stream at any time.

/// Rows between two notes of the key reached.
const COPY_MARK_ROWS: u64 = 10_000;
/// Row numbers below this in a copy position; the table index is above.
const COPY_TABLE_SHIFT: u32 = 40;

/// Where the fast path notes what it handed out.
pub fn copy_progress_path(state_dir: &Path) -> PathBuf {
    state_dir.join("snapshot-copy.json")
}

#[derive(Debug, Serialize, Deserialize)]
struct CopyState {
    /// The positions' LSN.
    lsn: u64,
    tables: Vec<CopyTableState>,
}

#[derive(Debug, Serialize, Deserialize)]
struct CopyTableState {
    table: String,
    /// (position sequence, key as text) every `COPY_MARK_ROWS` rows.
    marks: Vec<(u64, Vec<String>)>,
    /// The sequence of the table's last row, once all were handed out.
    end: Option<u64>,
    skipped: Option<String>,
}

/// A table as the fast path reads it.
#[derive(Debug, Clone)]
pub struct CopyTable {
    /// `schema.table`.
    pub table: String,
    /// Primary-key column names.
    pub key: Vec<String>,
    /// Column names and type OIDs.
    pub columns: Vec<(String, u32)>,
    /// Positions of the key columns among `columns`.
    pub key_index: Vec<usize>,
    sql: String,
}

/// An exported snapshot being read with COPY (see above).
pub struct CopySnapshot {
    client: tokio_postgres::Client,
    /// The tables to read (those without a primary key are left out, with a warning).
    pub tables: Vec<CopyTable>,
    /// The LSN of the rows' positions.
    pub lsn: u64,
    path: PathBuf,
    state: CopyState,
}

impl CopySnapshot {
    /// The position sequence of row `row` (1-based) of table `index`.
    pub fn seq(index: usize, row: u64) -> u64 {
        ((index as u64 + 1) << COPY_TABLE_SHIFT) | row
    }

    /// Starts the COPY of table `index`.
    pub async fn copy_out(
        &self,
        index: usize,
    ) -> Result<tokio_postgres::CopyOutStream, SourceError> {
        let t = &self.tables[index];
        self.client
            .copy_out(t.sql.as_str())
            .await
            .map_err(io(format!("cannot read `{}` (COPY)", t.table)))
    }

    /// Notes that the rows of table `index` up to sequence `seq` end at `key`.
    pub fn mark(&mut self, index: usize, seq: u64, key: Vec<String>) -> Result<(), SourceError> {
        let table = &self.tables[index].table;
        if let Some(t) = self.state.tables.iter_mut().find(|t| &t.table == table) {
            t.marks.push((seq, key));
        }
        write_quick(&self.path, &self.state)
    }

    /// Notes that table `index` ended at sequence `seq`.
    pub fn end(&mut self, index: usize, seq: u64) -> Result<(), SourceError> {
        let table = &self.tables[index].table;
        if let Some(t) = self.state.tables.iter_mut().find(|t| &t.table == table) {
            t.end = Some(seq);
        }
        write_quick(&self.path, &self.state)
    }

    /// Whether a row sequence is a note point.
    pub fn is_mark(row: u64) -> bool {
        row.is_multiple_of(COPY_MARK_ROWS)
    }
}

/// Creates slot `slot` on a gated replication session, exporting its snapshot, imports the
/// snapshot on a new connection and lists the tables to read; then starts the stream (which is
/// read after the tables). `cfg` is the stream's configuration.
pub async fn create_slot_exporting(
    cfg: &pgwire_replication::ReplicationConfig,
    url: &str,
    slot: &str,
    publication: &str,
    state_dir: &Path,
) -> Result<(pgwire_replication::ReplicationClient, CopySnapshot), SourceError> {
    let fail = |what: &str, e: pgwire_replication::PgWireError| SourceError::Io {
        message: format!("{what}: {e}"),
        source: None,
    };
    let mut replication = pgwire_replication::ReplicationClient::connect_gated(cfg.clone())
        .await
        .map_err(|e| fail("cannot open a replication session", e))?;
    let rows = replication
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput EXPORT_SNAPSHOT",
            quote_ident(slot)
        ))
        .await
        .map_err(|e| fail(&format!("cannot create replication slot `{slot}`"), e))?;
    let text = |i: usize| -> Option<String> {
        rows.first()
            .and_then(|r| r.get(i).cloned().flatten())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    };
    let (Some(consistent), Some(snapshot)) = (text(1), text(2)) else {
        return Err(SourceError::Inconsistent(
            "CREATE_REPLICATION_SLOT returned no consistent point or snapshot".into(),
        ));
    };
    let consistent = super::source::parse_lsn(&consistent)?;
    tracing::info!(%slot, snapshot = %snapshot, "created replication slot with an exported snapshot");

    let client = super::source::connect(url).await?;
    client
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{}'; \
             SET LOCAL DateStyle = 'ISO'",
            snapshot.replace('\'', "''")
        ))
        .await
        .map_err(io("cannot import the slot's snapshot"))?;
    let mut tables = Vec::new();
    let mut state = CopyState {
        lsn: consistent.saturating_sub(1),
        tables: Vec::new(),
    };
    for table in published_tables(&client, publication).await? {
        let shape = table_shape(&client, publication, &table).await?;
        if shape.key.is_empty() {
            let reason = "no primary key: it cannot be read in key order (add one, or leave it out of the publication)";
            tracing::warn!(%table, reason, "table left out of the snapshot");
            state.tables.push(CopyTableState {
                table,
                marks: Vec::new(),
                end: None,
                skipped: Some(reason.into()),
            });
            continue;
        }
        let key: Vec<String> = shape.key.iter().map(|(c, _)| c.clone()).collect();
        let key_index = key
            .iter()
            .map(|k| shape.columns.iter().position(|(c, _)| c == k).unwrap_or(0))
            .collect();
        let sql = format!(
            "COPY (SELECT {} FROM {} ORDER BY {}) TO STDOUT",
            shape
                .columns
                .iter()
                .map(|(c, _)| quote_ident(c))
                .collect::<Vec<_>>()
                .join(", "),
            shape.quoted,
            key.iter()
                .map(|k| quote_ident(k))
                .collect::<Vec<_>>()
                .join(", ")
        );
        state.tables.push(CopyTableState {
            table: table.clone(),
            marks: Vec::new(),
            end: None,
            skipped: None,
        });
        tables.push(CopyTable {
            table,
            key,
            columns: shape.columns,
            key_index,
            sql,
        });
    }
    let path = copy_progress_path(state_dir);
    persist(&path, &state)?;
    replication
        .start()
        .await
        .map_err(|e| fail("cannot start replication", e))?;
    Ok((
        replication,
        CopySnapshot {
            client,
            tables,
            lsn: state.lsn,
            path,
            state,
        },
    ))
}

/// After a restart: turns what an interrupted fast-path snapshot noted, and the durable
/// checkpoint `durable` of the stream, into chunk progress (`snapshot.json`), so the chunked
/// reader finishes what was not durable. Nothing to do without notes.
pub fn resume_after_copy(
    state_dir: &Path,
    durable: Option<refract_schemas::Offset>,
) -> Result<(), SourceError> {
    let copy_path = copy_progress_path(state_dir);
    let copy: CopyState = match std::fs::read(&copy_path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(c) => c,
            Err(e) => {
                // A note torn by a power loss: read every table again in chunks.
                tracing::warn!(error = %e, "snapshot notes unreadable: the snapshot is read again in chunks");
                let _ = std::fs::remove_file(&copy_path);
                return persist(&state_dir.join("snapshot.json"), &State::default());
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(SourceError::Io {
                message: format!("cannot read {}", copy_path.display()),
                source: Some(e),
            });
        }
    };
    let mut state = State {
        scope: Vec::new(),
        planned: true,
        tables: Vec::new(),
        complete: false,
    };
    match durable {
        // The stream went past the snapshot: every row of it is durable.
        Some(refract_schemas::Offset(lsn, _)) if lsn > copy.lsn => state.complete = true,
        _ => {
            let durable_seq = match durable {
                Some(refract_schemas::Offset(lsn, seq)) if lsn == copy.lsn => seq,
                _ => 0,
            };
            let mut index = 0usize;
            for t in copy.tables {
                if let Some(reason) = t.skipped {
                    state.tables.push(TableState {
                        table: t.table,
                        estimate: 0,
                        after: None,
                        rows: 0,
                        done: true,
                        skipped: Some(reason),
                    });
                    continue;
                }
                let first = CopySnapshot::seq(index, 0);
                // All rows handed out and durable (or there were none).
                let done = t.end.is_some_and(|end| end == first || durable_seq >= end);
                let mark = t
                    .marks
                    .iter()
                    .rev()
                    .find(|(seq, _)| *seq <= durable_seq && *seq > first);
                state.tables.push(TableState {
                    table: t.table,
                    estimate: 0,
                    after: if done {
                        None
                    } else {
                        mark.map(|(_, k)| k.clone())
                    },
                    rows: mark.map_or(0, |(seq, _)| seq - first),
                    done,
                    skipped: None,
                });
                index += 1;
            }
            state.complete = state.tables.iter().all(|t| t.done);
            if !state.complete {
                tracing::info!("the snapshot was interrupted: reading the rest in chunks");
            }
        }
    }
    persist(&state_dir.join("snapshot.json"), &state)?;
    std::fs::remove_file(&copy_path).map_err(|e| SourceError::Io {
        message: format!("cannot remove {}", copy_path.display()),
        source: Some(e),
    })
}

/// Replaces a file atomically without waiting for the disk (notes that may be lost).
fn write_quick<T: Serialize>(path: &Path, value: &T) -> Result<(), SourceError> {
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec(value).expect("notes serialize");
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| SourceError::Io {
            message: format!("cannot write {}", path.display()),
            source: Some(e),
        })
}

/// Splits one line of COPY's text format into fields (`\N` is null; backslash escapes undone),
/// borrowing the line where a field has no escapes.
pub fn parse_copy_line<'a>(
    line: &'a [u8],
    out: &mut Vec<Option<std::borrow::Cow<'a, str>>>,
) -> Result<(), String> {
    use std::borrow::Cow;
    let utf8 = |b: &'a [u8]| std::str::from_utf8(b).map_err(|_| "a value is not UTF-8".to_owned());
    out.clear();
    for field in line.split(|b| *b == b'\t') {
        if field == b"\\N" {
            out.push(None);
            continue;
        }
        if !field.contains(&b'\\') {
            out.push(Some(Cow::Borrowed(utf8(field)?)));
            continue;
        }
        let mut bytes = Vec::with_capacity(field.len());
        let mut i = 0;
        while i < field.len() {
            let b = field[i];
            if b != b'\\' || i + 1 == field.len() {
                bytes.push(b);
                i += 1;
                continue;
            }
            let next = field[i + 1];
            i += 2;
            match next {
                b'b' => bytes.push(8),
                b'f' => bytes.push(12),
                b'n' => bytes.push(b'\n'),
                b'r' => bytes.push(b'\r'),
                b't' => bytes.push(b'\t'),
                b'v' => bytes.push(11),
                b'0'..=b'7' => {
                    let mut value = u32::from(next - b'0');
                    let mut digits = 1;
                    while digits < 3 && i < field.len() && (b'0'..=b'7').contains(&field[i]) {
                        value = value * 8 + u32::from(field[i] - b'0');
                        i += 1;
                        digits += 1;
                    }
                    bytes.push(value as u8);
                }
                b'x' => {
                    let mut value = 0u32;
                    let mut digits = 0;
                    while digits < 2 && i < field.len() && field[i].is_ascii_hexdigit() {
                        value = value * 16 + (field[i] as char).to_digit(16).unwrap_or(0);
                        i += 1;
                        digits += 1;
                    }
                    bytes.push(value as u8);
                }
                other => bytes.push(other),
            }
        }
        out.push(Some(Cow::Owned(
            String::from_utf8(bytes).map_err(|_| "a value is not UTF-8".to_owned())?,
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_lines_split_and_unescape() {
        let mut out = Vec::new();
        parse_copy_line(b"1\t\\N\ta\\tb\\nc\\\\d\t\\101\\x42", &mut out).unwrap();
        let fields: Vec<Option<&str>> = out.iter().map(|f| f.as_deref()).collect();
        assert_eq!(
            fields,
            vec![Some("1"), None, Some("a\tb\nc\\d"), Some("AB")]
        );
        let mut out = Vec::new();
        parse_copy_line(b"", &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].as_deref(), Some(""));
        let mut out = Vec::new();
        assert!(parse_copy_line(b"\xff", &mut out).is_err());
    }

    #[test]
    fn copy_positions_sort_by_table_then_row() {
        assert!(CopySnapshot::seq(0, 5) < CopySnapshot::seq(1, 1));
        assert!(CopySnapshot::seq(0, 0) < CopySnapshot::seq(0, 1));
    }
}
