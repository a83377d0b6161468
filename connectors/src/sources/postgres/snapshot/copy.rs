//! The fast path of snapshots and backfills: an exported snapshot read with COPY.
//!
//! **Initial snapshot.** When refract creates the slot itself it asks the replication session
//! to export the snapshot the slot starts from (`CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT`),
//! imports it into a REPEATABLE READ transaction and reads every published table with COPY, in
//! primary-key order, before the first streamed change: rows exactly as of the slot's start, no
//! locks, no WAL written.
//!
//! **Backfill without a daemon.** `refract backfill` runs the pipeline itself; it creates a
//! *temporary* slot exporting its snapshot, imports it, and drops the slot (its session ends).
//! The snapshot holds every transaction that committed before the temporary slot's consistent
//! point `C` and none after, so its rows go into the pipeline's own stream exactly there: after
//! every transaction whose commit LSN is below `C`, before the first at or after it. A row
//! changed or deleted during the backfill therefore ends as the source has it, as with chunks,
//! but read at COPY speed.
//!
//! **Backfill beside a daemon.** The same, read by the daemon into its own stream when
//! `refract backfill` asks it to (see [`super::request`]).
//!
//! Either way the rows take positions `(C - 1, (table + 1) << 40 | row)`, below every change
//! committed after `C`. Every 10,000 rows the key reached is noted (no fsync needed: an older
//! note only re-reads more). If the process dies before the rows are durable, the next start
//! turns the notes and the durable checkpoint into chunk progress (`snapshot.json` or
//! `backfill.json`): the rest of an initial snapshot is read in chunks (the parent module),
//! which are consistent with the stream at any time; a backfill resumes with a new exported
//! snapshot after the last durable key.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{ChunkProgress, State, TableState, persist, published_tables, table_shape};
use crate::SourceError;
use crate::pg_sql::quote_ident;
use crate::sources::postgres::source::{self, io};

/// Rows between two notes of the key reached.
const COPY_MARK_ROWS: u64 = 10_000;
/// Row numbers below this in a copy position; the table index is above.
const COPY_TABLE_SHIFT: u32 = 40;

/// What an exported snapshot is read for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// The initial snapshot, read before the stream.
    Snapshot,
    /// A backfill run without a daemon, read into the stream at its consistent point.
    Backfill,
}

impl CopyKind {
    const ALL: [CopyKind; 2] = [CopyKind::Snapshot, CopyKind::Backfill];

    /// Where the fast path notes what it handed out.
    pub fn notes_path(self, state_dir: &Path) -> PathBuf {
        state_dir.join(match self {
            CopyKind::Snapshot => "snapshot-copy.json",
            CopyKind::Backfill => "backfill-copy.json",
        })
    }

    /// The chunk progress an interrupted read turns into.
    fn progress_path(self, state_dir: &Path) -> PathBuf {
        state_dir.join(match self {
            CopyKind::Snapshot => "snapshot.json",
            CopyKind::Backfill => "backfill.json",
        })
    }

    /// How logs name it.
    pub fn label(self) -> &'static str {
        match self {
            CopyKind::Snapshot => "initial snapshot",
            CopyKind::Backfill => "backfill",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct CopyState {
    /// The positions' LSN.
    lsn: u64,
    /// The tables asked for (a backfill's `--table`s; empty: all).
    #[serde(default)]
    scope: Vec<String>,
    tables: Vec<CopyTableState>,
    /// The `refract backfill` request a running daemon reads this for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request: Option<String>,
    /// The sequence of the END that frames the rows as one transaction, once it is handed out
    /// (noted just before): until it is durable the read is not complete, though every row may
    /// be (see [`resume_copy_kind`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    frame_end: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct CopyTableState {
    table: String,
    /// (position sequence, key as text) every `COPY_MARK_ROWS` rows.
    marks: Vec<(u64, Vec<String>)>,
    /// The sequence of the table's last row, once all were handed out.
    end: Option<u64>,
    skipped: Option<String>,
    /// Where the read started (after this key), for a backfill resumed by this read.
    #[serde(default)]
    after: Option<Vec<String>>,
    /// Rows read before this read started.
    #[serde(default)]
    base_rows: u64,
    /// Read completely before this read started.
    #[serde(default)]
    done: bool,
    /// Estimated rows, kept for the chunk progress an interrupted read turns into (its
    /// progress bar's total).
    #[serde(default)]
    estimate: u64,
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

/// A table a backfill asks the fast path for, as its chunk progress has it.
#[derive(Debug, Clone)]
pub struct PlannedTable {
    /// `schema.table`.
    pub table: String,
    /// Resume after this key (text per key column).
    pub after: Option<Vec<String>>,
    /// Rows read by an earlier, interrupted run.
    pub rows: u64,
    /// Estimated rows of the table (0: not known yet).
    pub estimate: u64,
    /// Nothing left to read.
    pub done: bool,
    /// Left out, with the reason.
    pub skipped: Option<String>,
}

/// What to read from an exported snapshot.
pub struct CopyPlan<'a> {
    /// The pipeline's publication.
    pub publication: &'a str,
    /// The pipeline's state directory (notes).
    pub state_dir: &'a Path,
    /// The tables, as a backfill's chunk progress planned them; every published table when
    /// `None`.
    pub tables: Option<Vec<PlannedTable>>,
    /// The tables asked for (kept with the notes, so a resumed backfill is recognized).
    pub scope: Vec<String>,
    /// Counters the read updates.
    pub progress: Arc<ChunkProgress>,
    /// The `refract backfill` request a running daemon reads it for (kept through a restart).
    pub request: Option<String>,
}

/// An exported snapshot being read with COPY (see above).
pub struct CopySnapshot {
    client: tokio_postgres::Client,
    /// What it is read for.
    pub kind: CopyKind,
    /// The tables to read (those without a primary key are left out, with a warning).
    pub tables: Vec<CopyTable>,
    /// The LSN of the rows' positions (the consistent point minus one).
    pub lsn: u64,
    /// Rows handed out (with those of an earlier run) and the estimated total.
    pub progress: Arc<ChunkProgress>,
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

    /// Notes that the END framing the rows goes out at sequence `seq` (before it does).
    pub fn frame_end(&mut self, seq: u64) -> Result<(), SourceError> {
        self.state.frame_end = Some(seq);
        write_quick(&self.path, &self.state)
    }

    /// Whether a row sequence is a note point.
    pub fn is_mark(row: u64) -> bool {
        row.is_multiple_of(COPY_MARK_ROWS)
    }
}

/// Creates slot `slot` (temporary or not) on the gated replication session `replication`,
/// exporting its snapshot, and imports the snapshot on a new connection (before the session
/// runs anything else, which would end the export). Returns the connection, inside the
/// snapshot's transaction, and the slot's consistent point.
async fn export_and_import(
    replication: &mut pgwire_replication::ReplicationClient,
    url: &str,
    slot: &str,
    temporary: bool,
) -> Result<(tokio_postgres::Client, u64), SourceError> {
    let rows = replication
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {}{} LOGICAL pgoutput EXPORT_SNAPSHOT",
            quote_ident(slot),
            if temporary { " TEMPORARY" } else { "" }
        ))
        .await
        .map_err(|e| SourceError::Io {
            message: format!("cannot create replication slot `{slot}`: {e}"),
            source: None,
        })?;
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
    let consistent = source::parse_lsn(&consistent)?;
    tracing::info!(%slot, temporary, snapshot = %snapshot, consistent_point = consistent, "created replication slot with an exported snapshot");
    let client = source::connect(url).await?;
    client
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{}'; \
             SET LOCAL DateStyle = 'ISO'",
            snapshot.replace('\'', "''")
        ))
        .await
        .map_err(io("cannot import the slot's snapshot"))?;
    Ok((client, consistent))
}

/// Plans the COPY of `tables` (every published table when `None`) inside the imported snapshot
/// and writes the first notes.
async fn plan_copy(
    client: tokio_postgres::Client,
    kind: CopyKind,
    consistent: u64,
    plan: CopyPlan<'_>,
) -> Result<CopySnapshot, SourceError> {
    let CopyPlan {
        publication,
        state_dir,
        tables,
        scope,
        progress,
        request,
    } = plan;
    let planned = match tables {
        Some(t) => t,
        None => published_tables(&client, publication)
            .await?
            .into_iter()
            .map(|table| PlannedTable {
                table,
                after: None,
                rows: 0,
                estimate: 0,
                done: false,
                skipped: None,
            })
            .collect(),
    };
    let mut copy_tables = Vec::new();
    let mut state = CopyState {
        lsn: consistent.saturating_sub(1),
        scope,
        tables: Vec::new(),
        request,
        frame_end: None,
    };
    for mut plan in planned {
        let note = |skipped: Option<String>, estimate: u64| CopyTableState {
            table: plan.table.clone(),
            marks: Vec::new(),
            end: None,
            skipped,
            after: plan.after.clone(),
            base_rows: plan.rows,
            done: plan.done,
            estimate,
        };
        if plan.skipped.is_some() || plan.done {
            state.tables.push(note(plan.skipped.clone(), plan.estimate));
            continue;
        }
        let shape = table_shape(&client, publication, &plan.table).await?;
        if shape.key.is_empty() {
            let reason = "no primary key: it cannot be read in key order (add one, or leave it out of the publication)";
            tracing::warn!(table = %plan.table, reason, "table left out of the {}", kind.label());
            state.tables.push(note(Some(reason.into()), plan.estimate));
            continue;
        }
        let key: Vec<String> = shape.key.iter().map(|(c, _)| c.clone()).collect();
        let key_index = key
            .iter()
            .map(|k| shape.columns.iter().position(|(c, _)| c == k).unwrap_or(0))
            .collect();
        let quoted_key: Vec<String> = key.iter().map(|k| quote_ident(k)).collect();
        // COPY takes no parameters: the resume key goes in as typed literals.
        let filter = match &plan.after {
            Some(after) => format!(
                " WHERE ({}) > ({})",
                quoted_key.join(", "),
                after
                    .iter()
                    .zip(&shape.key)
                    .map(|(v, (_, ty))| format!("'{}'::{ty}", v.replace('\'', "''")))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => String::new(),
        };
        let sql = format!(
            "COPY (SELECT {} FROM {}{filter} ORDER BY {}) TO STDOUT",
            shape
                .columns
                .iter()
                .map(|(c, _)| quote_ident(c))
                .collect::<Vec<_>>()
                .join(", "),
            shape.quoted,
            quoted_key.join(", ")
        );
        if kind == CopyKind::Snapshot {
            // A backfill's chunk progress has its estimates already.
            plan.estimate = super::planner_estimate(&client, &shape.quoted)
                .await?
                .unwrap_or(0);
            progress
                .total
                .fetch_add(plan.estimate, std::sync::atomic::Ordering::Relaxed);
        }
        state.tables.push(note(None, plan.estimate));
        copy_tables.push(CopyTable {
            table: plan.table,
            key,
            columns: shape.columns,
            key_index,
            sql,
        });
    }
    let path = kind.notes_path(state_dir);
    persist(&path, &state)?;
    Ok(CopySnapshot {
        client,
        kind,
        tables: copy_tables,
        lsn: state.lsn,
        progress,
        path,
        state,
    })
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
    let (client, consistent) = export_and_import(&mut replication, url, slot, false).await?;
    let copy = plan_copy(
        client,
        CopyKind::Snapshot,
        consistent,
        CopyPlan {
            publication,
            state_dir,
            tables: None,
            scope: Vec::new(),
            progress: Arc::new(ChunkProgress::default()),
            request: None,
        },
    )
    .await?;
    replication
        .start()
        .await
        .map_err(|e| fail("cannot start replication", e))?;
    Ok((replication, copy))
}

/// The fast path of a backfill run without a daemon: a temporary slot `{slot}_backfill`
/// exports a snapshot, which is imported for reading the planned tables with COPY; the slot
/// goes away with its session. The rows belong at the returned snapshot's `lsn + 1` in the
/// pipeline's stream (see the module documentation).
pub async fn export_for_backfill(
    cfg: &pgwire_replication::ReplicationConfig,
    url: &str,
    slot: &str,
    plan: CopyPlan<'_>,
) -> Result<CopySnapshot, SourceError> {
    let mut replication = pgwire_replication::ReplicationClient::connect_gated(cfg.clone())
        .await
        .map_err(|e| SourceError::Io {
            message: format!("cannot open a replication session for the backfill: {e}"),
            source: None,
        })?;
    // Slot names have at most 63 bytes; the pipeline's own slot name may already be long.
    let mut temporary: String = slot.chars().take(63 - "_backfill".len()).collect();
    temporary.push_str("_backfill");
    let imported = export_and_import(&mut replication, url, &temporary, true).await;
    // The snapshot is imported (or failed): the temporary slot is no longer needed.
    replication.stop();
    let (client, consistent) = imported?;
    plan_copy(client, CopyKind::Backfill, consistent, plan).await
}

/// After a restart (and once a read's rows are durable): turns what an interrupted fast-path
/// read noted, and the durable checkpoint `durable` of the stream, into chunk progress
/// (`snapshot.json` or `backfill.json`), so the chunked reader, or a new backfill, finishes what
/// was not durable. Nothing to do without notes.
pub fn resume_after_copy(
    state_dir: &Path,
    durable: Option<refract_schemas::Offset>,
) -> Result<(), SourceError> {
    for kind in CopyKind::ALL {
        resume_copy_kind(kind, state_dir, durable)?;
    }
    Ok(())
}

/// [`resume_after_copy`] for the read of one kind only (the other may still be under way).
pub fn resume_copy_kind(
    kind: CopyKind,
    state_dir: &Path,
    durable: Option<refract_schemas::Offset>,
) -> Result<(), SourceError> {
    let copy_path = kind.notes_path(state_dir);
    let progress_path = kind.progress_path(state_dir);
    let copy: CopyState = match std::fs::read(&copy_path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(c) => c,
            Err(e) => {
                // A note torn by a power loss: read every table again.
                tracing::warn!(error = %e, "{} notes unreadable: every table is read again", kind.label());
                let _ = std::fs::remove_file(&copy_path);
                return persist(&progress_path, &State::default());
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
        scope: copy.scope,
        planned: true,
        tables: Vec::new(),
        complete: false,
        request: copy.request,
        error: None,
    };
    // The stream went past the rows: every one of them is durable.
    let all_durable = matches!(durable, Some(refract_schemas::Offset(lsn, _)) if lsn > copy.lsn);
    let durable_seq = match durable {
        Some(refract_schemas::Offset(lsn, seq)) if lsn == copy.lsn => seq,
        _ => 0,
    };
    // The END framing the rows went out and is not durable (killed while the documents of the
    // load were written): the table read last is read again from its last durable note, in
    // chunks whose own transactions end, so what the rows left marked is written.
    let open_frame = !all_durable && copy.frame_end.is_some_and(|end| durable_seq < end);
    let read_last = copy
        .tables
        .iter()
        .rposition(|t| t.skipped.is_none() && !t.done);
    let mut index = 0usize;
    for (position, t) in copy.tables.into_iter().enumerate() {
        if t.skipped.is_some() || t.done {
            state.tables.push(TableState {
                table: t.table,
                estimate: t.estimate,
                after: None,
                rows: t.base_rows,
                done: true,
                skipped: t.skipped,
            });
            continue;
        }
        let first = CopySnapshot::seq(index, 0);
        index += 1;
        // All rows handed out and durable (or there were none).
        let done = (all_durable || t.end.is_some_and(|end| end == first || durable_seq >= end))
            && !(open_frame && read_last == Some(position));
        let mark = t
            .marks
            .iter()
            .rev()
            .find(|(seq, _)| *seq <= durable_seq && *seq > first);
        state.tables.push(TableState {
            table: t.table,
            estimate: t.estimate,
            after: if done {
                None
            } else {
                mark.map(|(_, k)| k.clone()).or(t.after)
            },
            rows: t.base_rows
                + match (done, t.end) {
                    (true, Some(end)) => end - first,
                    _ => mark.map_or(0, |(seq, _)| seq - first),
                },
            done,
            skipped: None,
        });
    }
    state.complete = state.tables.iter().all(|t| t.done);
    if !state.complete {
        tracing::info!(
            "the {} was interrupted: the rest is read from the last durable key",
            kind.label()
        );
    }
    persist(&progress_path, &state)?;
    std::fs::remove_file(&copy_path).map_err(|e| SourceError::Io {
        message: format!("cannot remove {}", copy_path.display()),
        source: Some(e),
    })
}

/// What the notes of a read under way say: rows handed out per table (the row reached at the
/// last note, or at a table's end).
pub(super) struct NotedRows {
    pub request: Option<String>,
    pub tables: Vec<(String, u64)>,
}

/// Reads the notes at `path`; `None` when there are none or they cannot be read now.
pub(super) fn rows_noted(path: &Path) -> Option<NotedRows> {
    let copy: CopyState = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    let mut index = 0usize;
    let mut tables = Vec::new();
    for t in copy.tables {
        if t.skipped.is_some() || t.done {
            continue;
        }
        let first = CopySnapshot::seq(index, 0);
        index += 1;
        let reached = t
            .end
            .or(t.marks.last().map(|(seq, _)| *seq))
            .unwrap_or(first);
        tables.push((t.table, t.base_rows + (reached - first)));
    }
    Some(NotedRows {
        request: copy.request,
        tables,
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
    out.clear();
    // The usual case: one UTF-8 check for the whole line instead of one per field (fields are
    // cut at tabs, which are ASCII, so each field of a valid line is valid).
    if let Ok(text) = std::str::from_utf8(line) {
        let mut start = 0;
        let mut escaped = false;
        // One pass finds the tabs and notes the backslashes of each field (searched for
        // together, many bytes at a time).
        for i in memchr::memchr2_iter(b'\t', b'\\', line) {
            if line[i] == b'\\' {
                escaped = true;
            } else {
                out.push(copy_field(text, start, i, escaped)?);
                start = i + 1;
                escaped = false;
            }
        }
        out.push(copy_field(text, start, line.len(), escaped)?);
        return Ok(());
    }
    // Not valid as a whole: field by field (an escape may still complete a character).
    let utf8 = |b: &'a [u8]| std::str::from_utf8(b).map_err(|_| "a value is not UTF-8".to_owned());
    for field in line.split(|b| *b == b'\t') {
        if field == b"\\N" {
            out.push(None);
        } else if !field.contains(&b'\\') {
            out.push(Some(Cow::Borrowed(utf8(field)?)));
        } else {
            out.push(Some(Cow::Owned(unescape(field)?)));
        }
    }
    Ok(())
}

/// Field `start..end` of a valid UTF-8 line (cut at tabs, so on character boundaries); `escaped`
/// when it holds a backslash.
fn copy_field(
    text: &str,
    start: usize,
    end: usize,
    escaped: bool,
) -> Result<Option<std::borrow::Cow<'_, str>>, String> {
    let field = text.get(start..end).unwrap_or_default();
    Ok(if !escaped {
        Some(std::borrow::Cow::Borrowed(field))
    } else if field == "\\N" {
        None
    } else {
        Some(std::borrow::Cow::Owned(unescape(field.as_bytes())?))
    })
}

/// Undoes the backslash escapes of one COPY text field.
fn unescape(field: &[u8]) -> Result<String, String> {
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
    String::from_utf8(bytes).map_err(|_| "a value is not UTF-8".to_owned())
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
        // Not UTF-8 as sent, but the escape completes the character (`\251` is 0xA9).
        let mut out = Vec::new();
        parse_copy_line(b"a\t\xc3\\251", &mut out).unwrap();
        let fields: Vec<Option<&str>> = out.iter().map(|f| f.as_deref()).collect();
        assert_eq!(fields, vec![Some("a"), Some("\u{e9}")]);
    }

    #[test]
    fn an_interrupted_read_resumes_after_the_last_durable_mark_with_its_estimate() {
        let dir = tempfile::tempdir().unwrap();
        let lsn = 1000;
        let table = |name: &str, marks: Vec<(u64, Vec<String>)>| CopyTableState {
            table: name.to_owned(),
            marks,
            end: None,
            skipped: None,
            after: None,
            base_rows: 0,
            done: false,
            estimate: 50_000,
        };
        let first = CopySnapshot::seq(0, 0);
        let notes = CopyState {
            lsn,
            scope: vec![],
            tables: vec![
                table(
                    "public.a",
                    vec![
                        (first + 10_000, vec!["10000".into()]),
                        (first + 20_000, vec!["20000".into()]),
                    ],
                ),
                table("public.b", vec![]),
            ],
            request: Some("r1".into()),
            frame_end: None,
        };
        let kind = CopyKind::Backfill;
        persist(&kind.notes_path(dir.path()), &notes).unwrap();
        // Durable up to a row between the two marks.
        let durable = refract_schemas::Offset(lsn, first + 15_000);
        resume_copy_kind(kind, dir.path(), Some(durable)).unwrap();
        let state: State = super::super::load(&kind.progress_path(dir.path()))
            .unwrap()
            .unwrap();
        assert!(!state.complete);
        assert_eq!(state.request.as_deref(), Some("r1"));
        let a = &state.tables[0];
        assert_eq!(
            (a.rows, a.after.as_deref(), a.done),
            (10_000, Some(&["10000".to_owned()][..]), false)
        );
        // The estimate survives, so the resumed progress bar has its total.
        assert_eq!((a.estimate, state.tables[1].estimate), (50_000, 50_000));
        assert_eq!(
            (state.tables[1].rows, state.tables[1].after.as_ref()),
            (0, None)
        );
    }

    #[test]
    fn rows_durable_without_the_end_that_frames_them_read_the_last_table_again() {
        let dir = tempfile::tempdir().unwrap();
        let lsn = 7_000;
        let table =
            |name: &str, rows: u64, marks: Vec<(u64, Vec<String>)>, index: usize| CopyTableState {
                table: name.into(),
                marks,
                end: Some(CopySnapshot::seq(index, rows)),
                skipped: None,
                after: None,
                base_rows: 0,
                done: false,
                estimate: rows,
            };
        let b = CopySnapshot::seq(1, 0);
        let notes = |frame_end| CopyState {
            lsn,
            scope: vec![],
            tables: vec![
                table("public.a", 5, vec![], 0),
                table(
                    "public.b",
                    25_000,
                    vec![(b + 10_000, vec!["k10000".into()])],
                    1,
                ),
            ],
            request: None,
            frame_end,
        };
        let kind = CopyKind::Snapshot;
        let last_row = refract_schemas::Offset(lsn, b + 25_000);
        let frame_end = CopySnapshot::seq(1, 25_001);
        let resumed = |notes: &CopyState, durable| {
            persist(&kind.notes_path(dir.path()), notes).unwrap();
            resume_copy_kind(kind, dir.path(), Some(durable)).unwrap();
            let state: State = super::super::load(&kind.progress_path(dir.path()))
                .unwrap()
                .unwrap();
            let t = |i: usize| {
                let t = &state.tables[i];
                (t.done, t.rows, t.after.clone())
            };
            (state.complete, t(0), t(1))
        };
        // Every row durable, the END that frames them not: the last table again from its note.
        let after = Some(vec!["k10000".to_owned()]);
        assert_eq!(
            resumed(&notes(Some(frame_end)), last_row),
            (false, (true, 5, None), (false, 10_000, after))
        );
        // With the END durable, or without an END (an older read), complete.
        let end = refract_schemas::Offset(lsn, frame_end);
        assert_eq!(
            resumed(&notes(Some(frame_end)), end),
            (true, (true, 5, None), (true, 25_000, None))
        );
        assert_eq!(
            resumed(&notes(None), last_row),
            (true, (true, 5, None), (true, 25_000, None))
        );
    }

    #[test]
    fn copy_positions_sort_by_table_then_row() {
        assert!(CopySnapshot::seq(0, 5) < CopySnapshot::seq(1, 1));
        assert!(CopySnapshot::seq(0, 0) < CopySnapshot::seq(0, 1));
    }
}
