//! The initial snapshot's fast path: an exported snapshot read with COPY.
//!
//! When refract creates the slot itself it asks the replication session to export the snapshot the
//! slot starts from (`CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT`), imports it into a REPEATABLE
//! READ transaction and reads every published table with COPY, in primary-key order, before the
//! first streamed change: rows exactly as of the slot's start, no locks, no WAL written. The rows
//! take positions `(consistent point - 1, (table + 1) << 40 | row)`, below every streamed change.
//! Every 10,000 rows the key reached is noted (no fsync needed: an older note only re-reads more).
//! If the process dies before the rows are durable, the next start turns the notes and the
//! durable checkpoint into chunk progress, and the rest is read in chunks (the parent module), which are
//! consistent with the stream at any time.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{State, TableState, persist, published_tables, table_shape};
use crate::SourceError;
use crate::sources::postgres::source::{self, io, quote_ident};

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
    let consistent = source::parse_lsn(&consistent)?;
    tracing::info!(%slot, snapshot = %snapshot, "created replication slot with an exported snapshot");

    let client = source::connect(url).await?;
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
    out.clear();
    // The usual case: one UTF-8 check for the whole line instead of one per field (fields are
    // cut at tabs, which are ASCII, so each field of a valid line is valid).
    if let Ok(text) = std::str::from_utf8(line) {
        let mut start = 0;
        let mut escaped = false;
        // One pass finds the tabs and notes the backslashes of each field.
        for (i, &b) in line.iter().enumerate() {
            if b == b'\\' {
                escaped = true;
            } else if b == b'\t' {
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
    fn copy_positions_sort_by_table_then_row() {
        assert!(CopySnapshot::seq(0, 5) < CopySnapshot::seq(1, 1));
        assert!(CopySnapshot::seq(0, 0) < CopySnapshot::seq(0, 1));
    }
}
