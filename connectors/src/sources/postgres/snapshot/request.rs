//! A backfill asked of a running daemon.
//!
//! `refract backfill` cannot read an exported snapshot into the stream of a daemon that runs
//! the pipeline: only the daemon knows where its stream is. So it asks the daemon to:
//! 1. it writes the request (`backfill-request.json` in the pipeline's state directory: an id,
//!    the tables, whether to start over) and a non-transactional logical message with prefix
//!    [`request_prefix`] carrying the id, which wakes the daemon wherever its stream is;
//! 2. the daemon takes the request (a message whose id matches the file, or the file alone when
//!    it starts): it plans the backfill in `backfill.json` under the request's id, removes the
//!    request file and reads the tables from an exported snapshot into its stream at the
//!    snapshot's consistent point, as a backfill without a daemon does (see [`super::copy`]);
//! 3. the backfill's notes (`backfill-copy.json`, every 10,000 rows) show its progress; once its
//!    rows are durable, `backfill.json` says complete (or names the error that stopped it).
//!
//! A daemon killed during the backfill resumes it when it starts again, from the last durable
//! key. A stale message (read again after a restart, or meant for a request since withdrawn)
//! finds no matching request file and is ignored.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::copy::CopyKind;
use super::{State, load, persist, read_json};
use crate::SourceError;
use crate::sources::postgres::source::io;

/// The backfill's progress file (`backfill.json`).
fn progress_path(state_dir: &Path) -> PathBuf {
    super::super::source::PostgresSource::backfill_progress_path(state_dir)
}

/// Prefix of the request messages for slot `slot`.
pub fn request_prefix(slot: &str) -> String {
    format!("refract.backfill:{slot}")
}

/// A backfill asked of the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackfillRequest {
    /// Unique per request.
    pub id: String,
    /// `schema.table` names, as the publication has them; empty: every table.
    pub tables: Vec<String>,
    /// Start over instead of resuming an interrupted backfill of the same tables.
    pub restart: bool,
}

impl BackfillRequest {
    /// A new request with a fresh id.
    pub fn new(tables: Vec<String>, restart: bool) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Self {
            id: format!("{nanos:x}-{}", std::process::id()),
            tables,
            restart,
        }
    }

    fn path(state_dir: &Path) -> PathBuf {
        state_dir.join("backfill-request.json")
    }

    /// The request waiting in the state directory, if any.
    pub fn pending(state_dir: &Path) -> Result<Option<Self>, SourceError> {
        read_json(
            &Self::path(state_dir),
            "delete it and run `refract backfill` again",
        )
    }

    /// A request the daemon took and did not finish (it was stopped or killed): resumed from
    /// its progress when the daemon starts again.
    pub fn interrupted(state_dir: &Path) -> Option<Self> {
        let path = progress_path(state_dir);
        let state = load(&path).ok().flatten()?;
        if state.complete || state.error.is_some() {
            return None;
        }
        Some(Self {
            id: state.request?,
            tables: state.scope,
            restart: false,
        })
    }

    /// Removes the request file (taken by the daemon, or withdrawn).
    pub fn withdraw(state_dir: &Path) -> Result<(), SourceError> {
        match std::fs::remove_file(Self::path(state_dir)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(SourceError::Io {
                message: "cannot remove the backfill request".into(),
                source: Some(e),
            }),
        }
    }

    /// Records in `backfill.json` that the daemon could not read this request.
    pub fn fail(&self, state_dir: &Path, error: &str) -> Result<(), SourceError> {
        let path = progress_path(state_dir);
        let mut state = load(&path).ok().flatten().unwrap_or_default();
        state.request = Some(self.id.clone());
        state.error = Some(error.to_owned());
        persist(&path, &state)?;
        Self::withdraw(state_dir)
    }
}

/// Where a backfill stands, as `refract backfill` follows it.
#[derive(Debug, Clone, Default)]
pub struct BackfillStatus {
    /// The request the daemon took, if the backfill was asked of one.
    pub request: Option<String>,
    /// The tables asked for (empty: all).
    pub scope: Vec<String>,
    /// Every row read and durable.
    pub complete: bool,
    /// Why the daemon could not read it.
    pub error: Option<String>,
    /// Rows read per table (durable or not), with whether the table was left out and why.
    pub tables: Vec<(String, u64, Option<String>)>,
    /// Estimated rows of all the tables.
    pub total: u64,
}

impl BackfillStatus {
    /// Reads the backfill's progress (`backfill.json`) and, while it is read from a snapshot,
    /// its notes. `None` when no backfill was ever planned.
    pub fn read(state_dir: &Path) -> Result<Option<Self>, SourceError> {
        let path = progress_path(state_dir);
        let Some(state): Option<State> = load(&path)? else {
            return Ok(None);
        };
        let mut status = BackfillStatus {
            request: state.request.clone(),
            scope: state.scope.clone(),
            complete: state.complete,
            error: state.error.clone(),
            tables: state
                .tables
                .iter()
                .map(|t| (t.table.clone(), t.rows, t.skipped.clone()))
                .collect(),
            total: state.tables.iter().map(|t| t.estimate.max(t.rows)).sum(),
        };
        // Rows handed out since the notes were written (a note torn while being replaced is
        // skipped: the next look reads it).
        if let Some(read) = super::copy::rows_noted(&CopyKind::Backfill.notes_path(state_dir))
            .filter(|n| n.request == state.request)
        {
            for (table, rows) in read.tables {
                if let Some(t) = status.tables.iter_mut().find(|t| t.0 == table) {
                    t.1 = t.1.max(rows);
                }
            }
        }
        Ok(Some(status))
    }

    /// Rows read so far in all the tables.
    pub fn rows(&self) -> u64 {
        self.tables.iter().map(|t| t.1).sum()
    }

    /// Whether this is the state of request `id` still under way.
    pub fn running(&self, id: &str) -> bool {
        self.request.as_deref() == Some(id) && !self.complete && self.error.is_none()
    }
}

/// `refract backfill`'s side: a backfill asked of the daemon running the pipeline.
pub struct Asked {
    client: tokio_postgres::Client,
    slot: String,
    /// The request followed.
    pub request: BackfillRequest,
    /// Whether it was asked earlier (this process only follows it).
    pub earlier: bool,
}

impl Asked {
    /// Asks the daemon of slot `slot` (state in `state_dir`) to backfill `tables` (`schema.table`
    /// or `table`; empty: all): leaves the request in the state directory and wakes the daemon
    /// with a message in the WAL. A backfill of the same tables asked earlier and not finished
    /// is followed instead; one of other tables is an error.
    pub async fn send(
        url: &str,
        publication: &str,
        slot: &str,
        state_dir: &Path,
        tables: &[String],
        restart: bool,
    ) -> Result<Self, SourceError> {
        let client = super::super::source::connect(url).await?;
        let scope = super::resolve_scope(&client, publication, tables).await?;
        let earlier = match BackfillRequest::pending(state_dir)? {
            Some(r) => Some(r),
            None => BackfillRequest::interrupted(state_dir),
        };
        let (request, earlier) = match earlier {
            Some(r) if r.tables == scope && !restart => (r, true),
            Some(r) => {
                return Err(SourceError::Inconsistent(format!(
                    "the running daemon has an unfinished backfill of {} (request {}): wait until it is done, \
                     or stop the daemon and run `refract backfill` without it",
                    if r.tables.is_empty() {
                        "every table".to_owned()
                    } else {
                        r.tables.join(", ")
                    },
                    r.id
                )));
            }
            None => {
                let r = BackfillRequest::new(scope, restart);
                persist(&BackfillRequest::path(state_dir), &r)?;
                super::super::source::emit_message(&client, &request_prefix(slot), &r.id).await?;
                (r, false)
            }
        };
        Ok(Self {
            client,
            slot: slot.to_owned(),
            request,
            earlier,
        })
    }

    /// Whether a process streams from the pipeline's slot now.
    pub async fn slot_active(&self) -> Result<bool, SourceError> {
        let row = self
            .client
            .query_opt(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .map_err(io("cannot read pg_replication_slots"))?;
        Ok(row.is_some_and(|r| r.get::<_, bool>(0)))
    }
}
