//! `kind = "postgres"`: committed changes from a logical replication slot (pgoutput, protocol 1).
//!
//! One partition per slot, `pg:{slot}`. Positions are (commit LSN, sequence in the transaction):
//! the BEGIN marker is `(lsn, 0)`, the n-th change `(lsn, n)`, the COMMIT marker `(lsn, MAX)`.
//! A checkpoint at `(lsn, MAX)` resumes after that transaction; one inside a transaction (a huge
//! transaction cut into several batches) restarts it at `lsn` and skips the changes already
//! durable. The slot is confirmed only up to the durable checkpoint, so its
//! `confirmed_flush_lsn` never passes a change a sink has not made durable; while nothing is in
//! flight, it follows the server's WAL position so unrelated traffic does not pile WAL up.
//!
//! `--until-caught-up` writes a non-transactional logical message at start and stops when the
//! stream reaches it: every transaction committed before the start has then been read.
//!
//! Rows that exist before the slot (initial snapshot) or that a `refract backfill` re-reads
//! arrive as chunk messages in the stream (see [`super::snapshot`]) and become `r` (read) events
//! at their commit position. A lost replication connection is re-established with backoff and
//! the stream resumes right after the last change handed out.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pgwire_replication::{
    Lsn, ReplicationClient, ReplicationConfig, TlsConfig, client::ReplicationEvent,
};
use refract_schemas::config::{PostgresSourceConfig, SnapshotMode};
use refract_schemas::debezium::DecodeError;
use refract_schemas::event::{SourceInfo, TxBoundary, TxInfo, TxStatus};
use refract_schemas::{ChangeEvent, Checkpoint, Offset, Op, Position, Record, Row, TableId};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};

use super::pgoutput::{self, Datum, Message, OldKind, Relation, Tuple};
use super::snapshot::{self, ChunkMessage, ChunkProgress, Chunker, CopySnapshot};
use super::values::text_to_json;
use crate::{ReadMode, Source, SourceContext, SourceError, SourceItem};

/// Changes per chunk handed to the runtime: a huge transaction flows in pieces (memory stays
/// bounded); small transactions go as soon as they commit.
const CHUNK_EVENTS: usize = 2_048;
/// Chunks buffered ahead of the runtime.
const CHANNEL_CHUNKS: usize = 4;
/// How often standby status updates go to the server: often enough that the slot follows the
/// durable position closely, and that a run that ends confirms its last position quickly (a
/// few small messages a second cost the server nothing).
const STATUS_INTERVAL: Duration = Duration::from_millis(250);
/// Prefix of the logical message that marks "caught up" for `--until-caught-up`.
const CAUGHT_UP_PREFIX: &str = "refract.caught_up";
/// How often the slot's retained WAL is checked.
const SLOT_CHECK_INTERVAL: Duration = Duration::from_secs(30);
/// How long a run that ends waits for the slot to show its final confirmed position.
const FINAL_CONFIRM_WAIT: Duration = Duration::from_secs(5);
/// Longest wait between two reconnection attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(30);

/// The PostgreSQL source.
pub struct PostgresSource {
    config: PostgresSourceConfig,
    context: SourceContext,
    slot: String,
    publication: String,
    partition: Arc<str>,
    rx: Option<mpsc::Receiver<Result<Vec<SourceItem>, SourceError>>>,
    stop: Arc<watch::Sender<bool>>,
    /// Progress of a snapshot or backfill this run reads.
    chunks: Option<Arc<ChunkProgress>>,
    /// The task reading the stream (awaited by `finish`).
    reader: Option<tokio::task::JoinHandle<()>>,
}

impl PostgresSource {
    /// A source for the pipeline of `context` (whose name gives the default slot and publication).
    pub fn new(config: PostgresSourceConfig, context: SourceContext) -> Self {
        let slot = config.slot_name(&context.pipeline);
        let publication = config.publication_name(&context.pipeline);
        let partition = format!("pg:{slot}").into();
        Self {
            config,
            context,
            slot,
            publication,
            partition,
            rx: None,
            stop: Arc::new(watch::channel(false).0),
            chunks: None,
            reader: None,
        }
    }

    /// Where the initial snapshot keeps its progress.
    pub fn snapshot_progress_path(state_dir: &std::path::Path) -> PathBuf {
        state_dir.join("snapshot.json")
    }

    /// Where `refract backfill` keeps its progress.
    pub fn backfill_progress_path(state_dir: &std::path::Path) -> PathBuf {
        state_dir.join("backfill.json")
    }
}

pub(crate) fn io(message: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> SourceError {
    let message = message.into();
    move |e| SourceError::Io {
        message: format!("{message}: {e}"),
        source: None,
    }
}

pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// An ordinary (non-replication) connection, its connection task spawned.
pub(crate) async fn connect(url: &str) -> Result<tokio_postgres::Client, SourceError> {
    let pg: tokio_postgres::Config = url.parse().map_err(|e| SourceError::Io {
        message: format!("invalid PostgreSQL URL: {e}"),
        source: None,
    })?;
    let (client, connection) = pg
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(io("cannot connect to PostgreSQL"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "control connection ended");
        }
    });
    Ok(client)
}

#[async_trait]
impl Source for PostgresSource {
    async fn start(
        &mut self,
        checkpoint: &Checkpoint,
        mode: ReadMode,
        durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError> {
        let pg: tokio_postgres::Config = self.config.url.parse().map_err(|e| SourceError::Io {
            message: format!("invalid PostgreSQL URL: {e}"),
            source: None,
        })?;
        let client = connect(&self.config.url).await?;
        let resume = checkpoint.get(&*self.partition).copied();
        let snapshot_path = PostgresSource::snapshot_progress_path(&self.context.state_dir);
        let mut export_snapshot = false;

        // Publication.
        let exists = client
            .query_opt(
                "SELECT 1 FROM pg_publication WHERE pubname = $1",
                &[&self.publication],
            )
            .await
            .map_err(io("cannot read pg_publication"))?
            .is_some();
        if !exists {
            if !self.config.create {
                return Err(SourceError::Inconsistent(format!(
                    "publication `{}` does not exist (and `create = false`)",
                    self.publication
                )));
            }
            let target = if self.config.tables.is_empty() {
                "ALL TABLES".to_owned()
            } else {
                let parts: Vec<String> = self
                    .config
                    .tables
                    .iter()
                    .map(|t| match t.split_once('.') {
                        Some((schema, "*")) => format!("TABLES IN SCHEMA {}", quote_ident(schema)),
                        Some((schema, table)) => {
                            format!("TABLE {}.{}", quote_ident(schema), quote_ident(table))
                        }
                        None => format!("TABLE {}", quote_ident(t)),
                    })
                    .collect();
                parts.join(", ")
            };
            client
                .batch_execute(&format!(
                    "CREATE PUBLICATION {} FOR {target}",
                    quote_ident(&self.publication)
                ))
                .await
                .map_err(io(format!(
                    "cannot create publication `{}`",
                    self.publication
                )))?;
            tracing::info!(publication = %self.publication, %target, "created publication");
        }

        // Slot.
        let slot_row = client
            .query_opt(
                "SELECT confirmed_flush_lsn::text, coalesce(wal_status, '') FROM pg_replication_slots \
                 WHERE slot_name = $1 AND database = current_database()",
                &[&self.slot],
            )
            .await
            .map_err(io("cannot read pg_replication_slots"))?;
        match slot_row {
            None if resume.is_some() => {
                return Err(SourceError::Inconsistent(format!(
                    "replication slot `{}` is gone but the checkpoint says this pipeline read from it: changes \
                     since then are lost. Run `refract drop` on the pipeline (or delete its state directory) to start \
                     over with a new slot and a fresh snapshot",
                    self.slot
                )));
            }
            Some(row) => {
                let wal_status: String = row.get(1);
                if wal_status == "lost" {
                    return Err(slot_lost(&self.slot));
                }
            }
            None if self.config.create && self.config.snapshot == SnapshotMode::Initial => {
                // Recorded before the slot exists: a crash right after creating it must not
                // leave the existing rows unread. The slot itself is created below, on the
                // replication session, exporting the snapshot the tables are read in.
                snapshot::mark_snapshot_due(&snapshot_path)?;
                export_snapshot = true;
            }
            None if self.config.create => {
                client
                    .execute(
                        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                        &[&self.slot],
                    )
                    .await
                    .map_err(io(format!(
                        "cannot create replication slot `{}`",
                        self.slot
                    )))?;
                tracing::info!(slot = %self.slot, "created replication slot");
            }
            None => {
                return Err(SourceError::Inconsistent(format!(
                    "replication slot `{}` does not exist (and `create = false`)",
                    self.slot
                )));
            }
        }

        // Where to resume.
        let (start_lsn, skip_through) = resume_point(resume);

        // Rows to read into the stream: a backfill asked for, or an initial snapshot that is due.
        snapshot::resume_after_copy(&self.context.state_dir, resume)?;
        let chunker = if export_snapshot {
            None
        } else if let Some(scope) = &self.context.backfill {
            Some(
                Chunker::prepare(
                    &self.config.url,
                    &self.publication,
                    &self.slot,
                    self.config.chunk_rows,
                    PostgresSource::backfill_progress_path(&self.context.state_dir),
                    &scope.tables,
                    scope.restart,
                )
                .await?,
            )
        } else if snapshot::unfinished(&snapshot_path) {
            Some(
                Chunker::prepare(
                    &self.config.url,
                    &self.publication,
                    &self.slot,
                    self.config.chunk_rows,
                    snapshot_path,
                    &[],
                    false,
                )
                .await?,
            )
        } else {
            None
        };

        // The caught-up marker, written after the slot exists so the stream is sure to reach it;
        // after the last chunk when rows are being read.
        let mut caught_up = CaughtUp::Never;
        let mut marker_tx = None;
        if mode == ReadMode::UntilCaughtUp && !export_snapshot {
            if chunker.is_some() {
                let (tx, rx) = oneshot::channel();
                caught_up = CaughtUp::Pending(rx);
                marker_tx = Some(tx);
            } else {
                caught_up = CaughtUp::At(emit_caught_up_marker(&client).await?);
            }
        }

        let cfg = ReplicationConfig::new(
            pg.get_hosts()
                .first()
                .map_or_else(|| "127.0.0.1".to_owned(), host_string),
            pg.get_user().unwrap_or("postgres"),
            pg.get_password()
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .unwrap_or_default(),
            pg.get_dbname().unwrap_or("postgres"),
            self.slot.clone(),
            self.publication.clone(),
        )
        .with_port(pg.get_ports().first().copied().unwrap_or(5432))
        .with_tls(TlsConfig::disabled())
        .with_status_interval(STATUS_INTERVAL)
        .with_wakeup_interval(STATUS_INTERVAL)
        .with_application_name("refract");
        let (replication, copy) = if export_snapshot {
            let (replication, copy) = snapshot::create_slot_exporting(
                &cfg,
                &self.config.url,
                &self.slot,
                &self.publication,
                &self.context.state_dir,
            )
            .await?;
            if mode == ReadMode::UntilCaughtUp {
                caught_up = CaughtUp::At(emit_caught_up_marker(&client).await?);
            }
            (replication, Some(copy))
        } else {
            (
                start_replication(&cfg, start_lsn, resume, &self.slot).await?,
                None,
            )
        };

        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        if let Some(chunker) = chunker {
            self.chunks = Some(chunker.progress());
            let errors = tx.clone();
            let url = self.config.url.clone();
            let mut stop = self.stop.subscribe();
            tokio::spawn(async move {
                let work = async {
                    let report = chunker.run().await?;
                    for (table, rows) in &report.tables {
                        tracing::info!(%table, rows, "rows read into the stream");
                    }
                    if let Some(marker) = marker_tx {
                        let client = connect(&url).await?;
                        let _ = marker.send(emit_caught_up_marker(&client).await?);
                    }
                    Ok::<_, SourceError>(())
                };
                // A stop abandons the chunk being read (its progress is kept per chunk; a chunk
                // committed but not yet recorded is read again, harmlessly).
                let result = tokio::select! {
                    result = work => result,
                    _ = stop.wait_for(|s| *s) => Ok(()),
                };
                if let Err(e) = result {
                    let _ = errors.send(Err(e)).await;
                }
            });
        }
        let reader = Reader {
            catalog: client,
            url: self.config.url.clone(),
            slot: self.slot.clone(),
            replication_config: cfg,
            partition: self.partition.clone(),
            db: pg.get_dbname().map(Arc::from),
            rows_prefix: snapshot::message_prefix(&self.slot),
            max_retained_wal: self.config.max_retained_wal_mb.saturating_mul(1 << 20),
            relations: HashMap::new(),
            tx: None,
            chunk: Vec::new(),
            skip_through,
            caught_up,
            last_commit: resume.map(|o| o.0),
            last_sent: None,
            resumed_from: resume,
            copy,
            copy_end: None,
            state_dir: self.context.state_dir.clone(),
        };
        let stop = self.stop.subscribe();
        self.reader = Some(tokio::spawn(reader.run(replication, tx, durable, stop)));
        self.rx = Some(rx);
        Ok(())
    }

    async fn next_chunk(&mut self) -> Result<Option<Vec<SourceItem>>, SourceError> {
        let Some(rx) = self.rx.as_mut() else {
            return Ok(None);
        };
        match rx.recv().await {
            Some(Ok(items)) => Ok(Some(items)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    fn stop(&mut self) {
        self.stop.send_replace(true);
    }

    async fn finish(&mut self) {
        // The reader confirms the final checkpoint to the slot, then ends.
        if let Some(reader) = self.reader.take() {
            if tokio::time::timeout(FINAL_CONFIRM_WAIT + Duration::from_secs(1), reader)
                .await
                .is_err()
            {
                tracing::warn!(slot = %self.slot, "the final position was not confirmed to the slot in time; the next run confirms it");
            }
        }
    }

    fn progress(&self) -> Option<(u64, u64)> {
        let p = self.chunks.as_ref()?;
        let done = p.rows.load(Ordering::Relaxed);
        Some((done, p.total.load(Ordering::Relaxed).max(done)))
    }
}

/// Where the stream starts for a checkpoint: (LSN to ask for, changes to skip up to).
fn resume_point(resume: Option<Offset>) -> (Lsn, Option<Offset>) {
    match resume {
        None => (Lsn::ZERO, None),
        Some(Offset(lsn, u64::MAX)) => (Lsn::from_u64(lsn + 1), None),
        Some(o @ Offset(lsn, _)) => (Lsn::from_u64(lsn), Some(o)),
    }
}

/// Opens the replication stream at `start`, confirming no more than `durable`.
async fn start_replication(
    cfg: &ReplicationConfig,
    start: Lsn,
    durable: Option<Offset>,
    slot: &str,
) -> Result<ReplicationClient, SourceError> {
    let mut cfg = cfg.clone().with_start_lsn(start);
    if let Some(Offset(lsn, seq)) = durable {
        // Confirm no more than what is durable until the runtime says otherwise.
        cfg = cfg.with_ack_lsn(Lsn::from_u64(if seq == u64::MAX { lsn + 1 } else { lsn }));
    }
    ReplicationClient::connect(cfg)
        .await
        .map_err(|e| SourceError::Io {
            message: format!("cannot start replication from slot `{slot}`: {e}"),
            source: None,
        })
}

/// Writes the caught-up marker; returns its LSN.
async fn emit_caught_up_marker(client: &tokio_postgres::Client) -> Result<u64, SourceError> {
    let row = client
        .query_one(
            "SELECT pg_logical_emit_message(false, $1, '')::text",
            &[&CAUGHT_UP_PREFIX],
        )
        .await
        .map_err(io(
            "cannot write the caught-up marker (pg_logical_emit_message)",
        ))?;
    let lsn: String = row.get(0);
    parse_lsn(&lsn)
}

fn slot_lost(slot: &str) -> SourceError {
    SourceError::Inconsistent(format!(
        "replication slot `{slot}` was invalidated (wal_status = lost): the server removed WAL it still \
         needed, so changes were lost. Refusing to resume. Run `refract drop` on the pipeline (drops the \
         slot and the state), then `refract run` again: it creates a new slot and re-reads every table \
         (initial snapshot)"
    ))
}

/// The wait before reconnection attempt `n` (1-based): exponential from 250 ms, with jitter.
fn reconnect_delay(n: u32) -> Duration {
    let base = Duration::from_millis(250).saturating_mul(1 << n.min(8).saturating_sub(1));
    let base = base.min(MAX_RECONNECT_DELAY);
    // Jitter from the clock's sub-second part: enough to spread several pipelines apart.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    base.mul_f64(0.75 + f64::from(nanos % 1000) / 2000.0)
}

/// Errors that reconnecting cannot fix.
fn is_permanent(e: &SourceError) -> bool {
    match e {
        SourceError::Inconsistent(_) => true,
        SourceError::Io { message, .. } => {
            message.contains("authentication")
                || message.contains("does not exist")
                || message.contains("can no longer get changes")
                || message.contains("invalidated")
        }
    }
}

/// When `--until-caught-up` stops.
enum CaughtUp {
    /// Following: never.
    Never,
    /// At the marker with this LSN.
    At(u64),
    /// At a marker written once the snapshot or backfill has been read.
    Pending(oneshot::Receiver<u64>),
}

fn host_string(host: &tokio_postgres::config::Host) -> String {
    match host {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
    }
}

pub(crate) fn parse_lsn(text: &str) -> Result<u64, SourceError> {
    let (hi, lo) = text
        .split_once('/')
        .ok_or_else(|| SourceError::Inconsistent(format!("`{text}` is not an LSN")))?;
    let part = |s: &str| {
        u64::from_str_radix(s, 16)
            .map_err(|_| SourceError::Inconsistent(format!("`{text}` is not an LSN")))
    };
    Ok(part(hi)? << 32 | part(lo)?)
}

/// A relation as the source needs it.
struct RelationInfo {
    table: TableId,
    shape: Relation,
    /// The document key: the primary key, else the replica-identity columns.
    key_columns: Vec<String>,
    /// SQL types of the key columns (for re-reading a row by key).
    key_types: Vec<String>,
}

/// The transaction being read.
struct OpenTx {
    lsn: u64,
    xid: u32,
    /// Items handed out of it so far; its BEGIN marker goes out with the first.
    seq: u64,
    commit_ms: i64,
    /// Whether everything was durable before it began (restored if it turns out empty).
    was_free: bool,
}

/// The task that reads the replication stream.
struct Reader {
    /// The control connection, for catalog look-ups (primary keys, TOAST re-reads, the slot).
    catalog: tokio_postgres::Client,
    url: String,
    slot: String,
    replication_config: ReplicationConfig,
    partition: Arc<str>,
    db: Option<Arc<str>>,
    /// Prefix of this slot's snapshot/backfill chunk messages.
    rows_prefix: String,
    /// Retained WAL (bytes) above which a warning is logged.
    max_retained_wal: u64,
    relations: HashMap<u32, RelationInfo>,
    tx: Option<OpenTx>,
    chunk: Vec<SourceItem>,
    /// Changes at or before this position are durable already (a transaction cut by a crash),
    /// or were handed out before the connection was lost.
    skip_through: Option<Offset>,
    caught_up: CaughtUp,
    /// The commit LSN of the last transaction handed out.
    last_commit: Option<u64>,
    /// The position of the last item handed out.
    last_sent: Option<Offset>,
    /// The checkpoint the run started from.
    resumed_from: Option<Offset>,
    /// An exported snapshot to read before the stream (the initial snapshot's fast path).
    copy: Option<CopySnapshot>,
    /// The position of its last row, until that is durable.
    copy_end: Option<Offset>,
    /// The pipeline's state directory (snapshot progress).
    state_dir: PathBuf,
}

type Chunks = mpsc::Sender<Result<Vec<SourceItem>, SourceError>>;

/// Why the stream ended.
enum Ended {
    /// Stopped, caught up or closed by the server on purpose: done.
    Done,
    /// The connection failed: reconnect.
    Lost(String),
}

impl Reader {
    async fn run(
        mut self,
        mut replication: ReplicationClient,
        out: Chunks,
        mut durable: watch::Receiver<Checkpoint>,
        mut stop: watch::Receiver<bool>,
    ) {
        if let Some(copy) = self.copy.take() {
            let lsn = copy.lsn;
            match self.read_copy(copy, &out, &stop).await {
                Ok(true) => match self.last_sent {
                    // Complete once the last row is durable (see the durable branch).
                    Some(last) => self.copy_end = Some(last),
                    None => {
                        if let Err(e) =
                            snapshot::resume_after_copy(&self.state_dir, Some(Offset(lsn + 1, 0)))
                        {
                            let _ = out.send(Err(e)).await;
                            return;
                        }
                    }
                },
                Ok(false) => {
                    replication.stop();
                    return;
                }
                Err(e) => {
                    replication.stop();
                    let _ = out.send(Err(e)).await;
                    return;
                }
            }
        }
        let mut failures = 0u32;
        let result = loop {
            let started = Instant::now();
            let ended = self
                .stream(&mut replication, &out, &mut durable, &mut stop)
                .await;
            if !matches!(ended, Ok(Ended::Done)) {
                replication.stop();
            }
            let reason = match ended {
                Ok(Ended::Done) => {
                    // Let the runtime finish (it writes the final checkpoint), then confirm
                    // that checkpoint to the slot before the stream closes.
                    drop(out);
                    self.confirm_final(&replication, &mut durable).await;
                    replication.stop();
                    return;
                }
                Err(e) => break Err(e),
                Ok(Ended::Lost(reason)) => reason,
            };
            // Reconnect with exponential backoff (reset after a connection that lasted), and
            // resume right after the last change handed out: the server resends from the
            // slot's confirmed position, which is never past it.
            if started.elapsed() > MAX_RECONNECT_DELAY {
                failures = 0;
            }
            let next = loop {
                failures += 1;
                let delay = reconnect_delay(failures);
                tracing::warn!(
                    slot = %self.slot,
                    error = %reason,
                    attempt = failures,
                    retry_in_ms = delay.as_millis() as u64,
                    "replication connection lost: reconnecting"
                );
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = stop.wait_for(|s| *s) => break None,
                }
                match self.reconnect().await {
                    Ok(r) => break Some(r),
                    Err(e) if is_permanent(&e) => {
                        let _ = out.send(Err(e)).await;
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "reconnection failed"),
                }
            };
            match next {
                Some(r) => {
                    tracing::info!(slot = %self.slot, "replication connection re-established");
                    replication = r;
                }
                None => break Ok(()),
            }
        };
        if let Err(e) = result {
            let _ = out.send(Err(e)).await;
        }
    }

    /// Waits (a bounded time) for the runtime's final checkpoint to cover everything handed
    /// out, reports it to the server and waits until the slot shows it, so a run that ends does
    /// not leave the slot behind its checkpoint (retaining WAL until the next run).
    async fn confirm_final(
        &self,
        replication: &ReplicationClient,
        durable: &mut watch::Receiver<Checkpoint>,
    ) {
        let Some(last) = self.last_sent else {
            return;
        };
        let deadline = tokio::time::Instant::now() + FINAL_CONFIRM_WAIT;
        let reached = loop {
            let at = durable.borrow_and_update().get(&*self.partition).copied();
            if let Some(at) = at.filter(|a| *a >= last) {
                break at;
            }
            match tokio::time::timeout_at(deadline, durable.changed()).await {
                Ok(Ok(())) => continue,
                // The checkpointer ended: its last value is final.
                Ok(Err(_)) => match durable.borrow().get(&*self.partition).copied() {
                    Some(at) if at >= last => break at,
                    _ => return,
                },
                Err(_) => return,
            }
        };
        let Offset(lsn, seq) = reached;
        let target = if seq == u64::MAX { lsn + 1 } else { lsn };
        replication.update_applied_lsn(Lsn::from_u64(target));
        // The worker sends it at its next status tick (at most `STATUS_INTERVAL`).
        while tokio::time::Instant::now() < deadline {
            let confirmed = self
                .catalog
                .query_opt(
                    "SELECT (confirmed_flush_lsn >= $2::text::pg_lsn) FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot, &Lsn::from_u64(target).to_string()],
                )
                .await;
            match confirmed {
                Ok(Some(row)) if row.get::<_, Option<bool>>(0) == Some(true) => return,
                Ok(Some(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                _ => return,
            }
        }
    }

    /// A new control connection and replication stream, resuming after the last item handed
    /// out (or the checkpoint, when nothing was).
    async fn reconnect(&mut self) -> Result<ReplicationClient, SourceError> {
        self.catalog = connect(&self.url).await?;
        self.tx = None;
        self.chunk.clear();
        let from = self.last_sent.or(self.resumed_from);
        let (start, skip) = resume_point(from);
        self.skip_through = skip;
        start_replication(
            &self.replication_config,
            start,
            self.resumed_from,
            &self.slot,
        )
        .await
    }

    async fn stream(
        &mut self,
        replication: &mut ReplicationClient,
        out: &Chunks,
        durable: &mut watch::Receiver<Checkpoint>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Ended, SourceError> {
        // Whether everything handed out is durable, so the slot may follow the server. Not when
        // resuming inside a transaction: its rest is still to come.
        let mut in_flight_free = self.skip_through.is_none() && self.last_sent.is_none();
        let mut slot_check = tokio::time::interval(SLOT_CHECK_INTERVAL);
        loop {
            let event = tokio::select! {
                () = async { let _ = stop.wait_for(|s| *s).await; } => {
                    // Hand out the changes read so far; the rest is read again next time.
                    self.flush(out).await?;
                    return Ok(Ended::Done);
                }
                changed = durable.changed() => {
                    if changed.is_err() {
                        return Ok(Ended::Done);
                    }
                    let durable_at = durable.borrow_and_update().get(&*self.partition).copied();
                    if let Some(Offset(lsn, seq)) = durable_at {
                        replication.update_applied_lsn(Lsn::from_u64(if seq == u64::MAX { lsn + 1 } else { lsn }));
                        in_flight_free = seq == u64::MAX && Some(lsn) == self.last_commit && self.tx.is_none();
                        self.resumed_from = Some(Offset(lsn, seq));
                        if self.copy_end.is_some_and(|end| Offset(lsn, seq) >= end) {
                            // Every row of the initial snapshot is durable.
                            snapshot::resume_after_copy(&self.state_dir, Some(Offset(lsn, seq)))?;
                            self.copy_end = None;
                        }
                    }
                    continue;
                }
                at = async {
                    match &mut self.caught_up {
                        CaughtUp::Pending(rx) => rx.await.ok(),
                        _ => std::future::pending().await,
                    }
                } => {
                    self.caught_up = at.map_or(CaughtUp::Never, CaughtUp::At);
                    continue;
                }
                _ = slot_check.tick() => {
                    self.check_slot().await?;
                    continue;
                }
                event = replication.recv() => event,
            };
            let event = match event {
                Ok(event) => event,
                Err(e) => return Ok(Ended::Lost(e.to_string())),
            };
            let Some(event) = event else {
                self.flush(out).await?;
                return Ok(Ended::Done);
            };
            match event {
                ReplicationEvent::Begin {
                    final_lsn,
                    xid,
                    commit_time_micros,
                } => {
                    let lsn = final_lsn.as_u64();
                    let commit_ms = (commit_time_micros + pgoutput::PG_EPOCH_OFFSET_MICROS) / 1000;
                    // Its BEGIN marker is handed out with its first item: a transaction with
                    // nothing for this pipeline (only other pipelines' snapshot chunks, say)
                    // leaves no trace.
                    self.tx = Some(OpenTx {
                        lsn,
                        xid,
                        seq: 0,
                        commit_ms,
                        was_free: in_flight_free,
                    });
                    in_flight_free = false;
                }
                ReplicationEvent::XLogData { data, .. } => {
                    if let Err(e) = self.data(data).await {
                        // A catalog look-up failed: the control connection is gone too.
                        return Ok(Ended::Lost(e.to_string()));
                    }
                }
                ReplicationEvent::Commit { .. } => {
                    let Some(tx) = self.tx.take() else {
                        return Err(SourceError::Inconsistent(
                            "COMMIT without BEGIN in the replication stream".into(),
                        ));
                    };
                    if tx.seq == 0 {
                        in_flight_free = tx.was_free;
                    } else {
                        self.marker(TxStatus::End, Offset(tx.lsn, u64::MAX), &tx);
                        self.last_commit = Some(tx.lsn);
                        self.flush(out).await?;
                    }
                }
                ReplicationEvent::Message {
                    prefix,
                    lsn,
                    transactional,
                    content,
                } => {
                    if transactional && prefix == self.rows_prefix && self.tx.is_some() {
                        self.rows(&content);
                    } else if prefix == CAUGHT_UP_PREFIX
                        && matches!(self.caught_up, CaughtUp::At(at) if lsn.as_u64() >= at)
                        && self.tx.is_none()
                    {
                        tracing::info!(lsn = %lsn, "caught up with the slot");
                        self.flush(out).await?;
                        return Ok(Ended::Done);
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    // Nothing in flight and everything handed out is durable: let the slot
                    // follow the server, so WAL of unrelated traffic is not retained for us.
                    if in_flight_free && self.tx.is_none() && self.chunk.is_empty() {
                        replication.update_applied_lsn(wal_end);
                    }
                }
                ReplicationEvent::StoppedAt { .. } => {
                    self.flush(out).await?;
                    return Ok(Ended::Done);
                }
            }
            if self.chunk.len() >= CHUNK_EVENTS {
                self.flush(out).await?;
            }
        }
    }

    /// Warns when the slot holds back more WAL than allowed; stops when it was invalidated.
    async fn check_slot(&self) -> Result<(), SourceError> {
        let row = match self
            .catalog
            .query_opt(
                "SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8, \
                        coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
        {
            Ok(row) => row,
            Err(e) => {
                tracing::debug!(error = %e, "cannot check the slot");
                return Ok(());
            }
        };
        let Some(row) = row else {
            return Err(SourceError::Inconsistent(format!(
                "replication slot `{}` was dropped while the pipeline ran",
                self.slot
            )));
        };
        let retained = row.get::<_, i64>(0).max(0) as u64;
        let status: String = row.get(1);
        if status == "lost" {
            return Err(slot_lost(&self.slot));
        }
        metrics::gauge!("refract_slot_retained_wal_bytes", "slot" => self.slot.clone())
            .set(retained as f64);
        if retained > self.max_retained_wal {
            tracing::warn!(
                slot = %self.slot,
                retained_wal_mib = retained >> 20,
                limit_mib = self.max_retained_wal >> 20,
                wal_status = %status,
                "the slot retains more WAL than `max_retained_wal_mb`: a sink may be stalled; \
                 the server's disk fills until it catches up (or max_slot_wal_keep_size invalidates the slot)"
            );
        }
        Ok(())
    }

    /// Reads the exported snapshot's tables with COPY, handing every row out as a read event
    /// before the stream. Returns false when stopped on request (the next start resumes).
    async fn read_copy(
        &mut self,
        mut copy: CopySnapshot,
        out: &Chunks,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SourceError> {
        use futures::StreamExt as _;
        let started = Instant::now();
        let mut total = 0u64;
        for index in 0..copy.tables.len() {
            let t = copy.tables[index].clone();
            let table = match t.table.split_once('.') {
                Some((schema, name)) => TableId::new(schema, name),
                None => TableId::new("public", &t.table),
            };
            let names: Vec<String> = t.columns.iter().map(|(c, _)| c.clone()).collect();
            let types: Vec<u32> = t.columns.iter().map(|(_, o)| *o).collect();
            let stream = copy.copy_out(index).await?;
            futures::pin_mut!(stream);
            let mut pending: Vec<u8> = Vec::new();
            let mut row = 0u64;
            loop {
                let data = match stream.next().await {
                    Some(data) => {
                        data.map_err(io(format!("reading `{}` (COPY) failed", t.table)))?
                    }
                    None => break,
                };
                pending.extend_from_slice(&data);
                let mut start = 0;
                while let Some(n) = memchr::memchr(b'\n', &pending[start..]) {
                    let line = &pending[start..start + n];
                    start += n + 1;
                    row += 1;
                    let seq = CopySnapshot::seq(index, row);
                    let position = Position {
                        partition: self.partition.clone(),
                        offset: Offset(copy.lsn, seq),
                    };
                    let mut fields = Vec::with_capacity(names.len());
                    if let Err(e) = snapshot::parse_copy_line(line, &mut fields) {
                        self.push_error(
                            position,
                            format!("`{table}` snapshot row: {e}"),
                            Bytes::copy_from_slice(line),
                        );
                        continue;
                    }
                    if CopySnapshot::is_mark(row) {
                        let key = t
                            .key_index
                            .iter()
                            .map(|i| {
                                fields
                                    .get(*i)
                                    .and_then(|f| f.as_deref())
                                    .unwrap_or_default()
                                    .to_owned()
                            })
                            .collect();
                        copy.mark(index, seq, key)?;
                    }
                    self.push_read(&table, &t.key, &names, &types, &fields, position, None);
                }
                pending.drain(..start);
                if self.chunk.len() >= CHUNK_EVENTS {
                    self.flush(out).await?;
                }
                if *stop.borrow() {
                    self.flush(out).await?;
                    return Ok(false);
                }
            }
            self.flush(out).await?;
            copy.end(index, CopySnapshot::seq(index, row))?;
            total += row;
            tracing::info!(table = %t.table, rows = row, "table read from the slot's snapshot");
        }
        tracing::info!(
            rows = total,
            secs = started.elapsed().as_secs_f64(),
            "initial snapshot read; streaming from the slot"
        );
        Ok(true)
    }

    /// Hands out one row read from a table (snapshot or backfill) as a read event.
    #[allow(clippy::too_many_arguments)]
    fn push_read<S: AsRef<str> + serde::Serialize>(
        &mut self,
        table: &TableId,
        key_names: &[String],
        columns: &[String],
        types: &[u32],
        values: &[Option<S>],
        position: Position,
        tx: Option<(i64, u32, u64)>,
    ) {
        if !self.keep(position.offset) {
            return;
        }
        if values.len() != columns.len() {
            let raw = Bytes::from(serde_json::to_vec(values).unwrap_or_default());
            return self.push_error(
                position,
                format!(
                    "`{table}` snapshot row has {} values for {} columns",
                    values.len(),
                    columns.len()
                ),
                raw,
            );
        }
        // Collected into a vector first: building the map from it at once is cheaper than
        // inserting column by column.
        let mut pairs = Vec::with_capacity(columns.len());
        for ((column, oid), value) in columns.iter().zip(types).zip(values) {
            let v = match value {
                None => Value::Null,
                Some(text) => match text_to_json(*oid, text.as_ref()) {
                    Ok(v) => v,
                    Err(e) => {
                        let raw = Bytes::from(serde_json::to_vec(values).unwrap_or_default());
                        return self.push_error(
                            position,
                            format!("`{table}` column `{column}`: {e}"),
                            raw,
                        );
                    }
                },
            };
            pairs.push((column.clone(), v));
        }
        let after: Row = pairs.into_iter().collect();
        let key: Row = key_names
            .iter()
            .filter_map(|c| after.get(c).map(|v| (c.clone(), v.clone())))
            .collect();
        let seq = position.offset.1;
        self.chunk.push(SourceItem {
            record: Ok(Record::Change(ChangeEvent {
                table: table.clone(),
                op: Op::Read,
                key: (!key.is_empty()).then(|| Arc::new(key)),
                before: None,
                after: Some(Arc::new(after)),
                source: SourceInfo {
                    connector: Some("postgresql".into()),
                    db: self.db.clone(),
                    ts_ms: tx.map(|t| t.0),
                    tx_id: tx.map(|t| i64::from(t.1)),
                    lsn: tx.map(|t| t.2),
                    kafka: None,
                },
                transaction: tx.map(|t| TxInfo {
                    id: t.1.to_string(),
                    total_order: Some(seq),
                    data_collection_order: None,
                }),
                position,
            })),
            raw: Bytes::new(),
        });
    }

    /// A snapshot/backfill chunk: its rows become read events at their positions.
    fn rows(&mut self, content: &Bytes) {
        let message: ChunkMessage = match serde_json::from_slice(content) {
            Ok(m) => m,
            Err(e) => {
                let position = self.next_position();
                return self.push_error(
                    position,
                    format!("unreadable snapshot chunk: {e}"),
                    content.clone(),
                );
            }
        };
        let table = match message.table.split_once('.') {
            Some((schema, name)) => TableId::new(schema, name),
            None => TableId::new("public", &message.table),
        };
        let Some((commit_ms, xid, lsn)) = self.tx.as_ref().map(|t| (t.commit_ms, t.xid, t.lsn))
        else {
            return;
        };
        let tx = Some((commit_ms, xid, lsn));
        for values in &message.rows {
            let position = self.next_position();
            self.push_read(
                &table,
                &message.key,
                &message.columns,
                &message.types,
                values,
                position,
                tx,
            );
        }
    }

    async fn flush(&mut self, out: &Chunks) -> Result<(), SourceError> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::take(&mut self.chunk);
        self.last_sent = chunk.last().map(|item| match &item.record {
            Ok(record) => record.position().offset,
            Err(e) => e.position.offset,
        });
        out.send(Ok(chunk))
            .await
            .map_err(|_| SourceError::Inconsistent("the runtime stopped reading".into()))
    }

    fn keep(&self, position: Offset) -> bool {
        self.skip_through.is_none_or(|s| position > s)
    }

    fn marker(&mut self, status: TxStatus, offset: Offset, tx: &OpenTx) {
        if !self.keep(offset) {
            return;
        }
        let boundary = TxBoundary {
            status,
            id: tx.xid.to_string(),
            event_count: (status == TxStatus::End).then_some(tx.seq),
            ts_ms: Some(tx.commit_ms),
            position: Position {
                partition: self.partition.clone(),
                offset,
            },
        };
        self.chunk.push(SourceItem {
            record: Ok(Record::Transaction(boundary)),
            raw: Bytes::new(),
        });
    }

    /// The primary-key columns of a relation and their SQL types, from the catalog (under
    /// REPLICA IDENTITY FULL pgoutput marks every column as identity, so the flags do not tell
    /// the key).
    async fn primary_key(&self, relation: u32) -> Result<Vec<(String, String)>, SourceError> {
        let rows = self
            .catalog
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_index i \
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                 WHERE i.indrelid = $1 AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
                &[&relation],
            )
            .await
            .map_err(io(format!("cannot read the primary key of relation {relation}")))?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Fills the unchanged TOASTed values of `new` (which PostgreSQL did not send, and no full
    /// old row holds) by re-reading them from the table by key. The value read is the row's
    /// current one, which the rest of the stream leads to anyway; a row gone since is deleted
    /// or re-keyed by a later change in the stream, so its columns are left null until then.
    async fn refetch_toasted(&self, relation: u32, new: &mut Tuple) -> Result<(), SourceError> {
        let Some(info) = self.relations.get(&relation) else {
            return Ok(());
        };
        let missing: Vec<usize> = new
            .iter()
            .enumerate()
            .filter(|(_, d)| matches!(d, Datum::UnchangedToast))
            .map(|(i, _)| i)
            .collect();
        let mut key_values: Vec<String> = Vec::new();
        for column in &info.key_columns {
            let index = info.shape.columns.iter().position(|c| &c.name == column);
            match index.and_then(|i| new.get(i)) {
                Some(Datum::Text(bytes)) => {
                    key_values.push(String::from_utf8_lossy(bytes).into_owned())
                }
                // No usable key: leave the values unsent (the change is then dead-lettered).
                _ => return Ok(()),
            }
        }
        if key_values.is_empty() || info.key_types.len() != key_values.len() {
            return Ok(());
        }
        let columns: Vec<String> = missing
            .iter()
            .map(|i| format!("{}::text", quote_ident(&info.shape.columns[*i].name)))
            .collect();
        let keys: Vec<String> = info.key_columns.iter().map(|c| quote_ident(c)).collect();
        let params: Vec<String> = info
            .key_types
            .iter()
            .enumerate()
            .map(|(i, t)| format!("${}::text::{t}", i + 1))
            .collect();
        let sql = format!(
            "SELECT {} FROM {}.{} WHERE ({}) = ({})",
            columns.join(", "),
            quote_ident(&info.shape.namespace),
            quote_ident(&info.shape.name),
            keys.join(", "),
            params.join(", ")
        );
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = key_values
            .iter()
            .map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        let row = self
            .catalog
            .query_opt(&sql, &params)
            .await
            .map_err(io(format!(
                "cannot re-read unchanged TOASTed values of `{}`",
                info.table
            )))?;
        for (n, i) in missing.iter().enumerate() {
            new[*i] = match row.as_ref().map(|r| r.get::<_, Option<String>>(n)) {
                Some(Some(text)) => Datum::Text(Bytes::from(text)),
                _ => Datum::Null,
            };
        }
        if row.is_none() {
            tracing::debug!(table = %info.table, "row gone before its unchanged TOASTed values could be re-read");
        }
        Ok(())
    }

    /// Handles one pgoutput data message.
    async fn data(&mut self, data: Bytes) -> Result<(), SourceError> {
        let message = match pgoutput::decode(&data, false) {
            Ok(m) => m,
            Err(e) => {
                let position = self.next_position();
                self.push_error(position, e.to_string(), data);
                return Ok(());
            }
        };
        match message {
            Message::Relation(shape) => {
                let table = TableId::new(&shape.namespace, &shape.name);
                let mut key = self.primary_key(shape.id).await?;
                if key.is_empty() && shape.replica_identity != b'f' {
                    for c in shape.columns.iter().filter(|c| c.key) {
                        let row = self
                            .catalog
                            .query_one(
                                "SELECT format_type($1, $2)",
                                &[&c.type_oid, &c.type_modifier],
                            )
                            .await
                            .map_err(io("cannot read a column type"))?;
                        key.push((c.name.clone(), row.get(0)));
                    }
                }
                let (key_columns, key_types) = key.into_iter().unzip();
                self.relations.insert(
                    shape.id,
                    RelationInfo {
                        table,
                        shape,
                        key_columns,
                        key_types,
                    },
                );
            }
            Message::Insert { relation, new } => {
                self.change(relation, Op::Create, None, Some(new), &data)
            }
            Message::Update {
                relation,
                old,
                mut new,
            } => {
                let full_old = old.as_ref().is_some_and(|(k, _)| *k == OldKind::Full);
                if !full_old && new.iter().any(|d| matches!(d, Datum::UnchangedToast)) {
                    self.refetch_toasted(relation, &mut new).await?;
                }
                self.change(relation, Op::Update, old, Some(new), &data)
            }
            Message::Delete { relation, old } => {
                self.change(relation, Op::Delete, Some(old), None, &data)
            }
            Message::Truncate { relations, .. } => {
                for relation in relations {
                    self.change(relation, Op::Truncate, None, None, &data);
                }
            }
            // Types are sent as text; origins and nested begin/commit are handled elsewhere.
            _ => {}
        }
        Ok(())
    }

    fn next_position(&mut self) -> Position {
        if let Some(tx) = self.tx.as_ref().filter(|t| t.seq == 0) {
            let begin = OpenTx {
                lsn: tx.lsn,
                xid: tx.xid,
                seq: 0,
                commit_ms: tx.commit_ms,
                was_free: tx.was_free,
            };
            self.marker(TxStatus::Begin, Offset(begin.lsn, 0), &begin);
        }
        let offset = match self.tx.as_mut() {
            Some(tx) => {
                tx.seq += 1;
                Offset(tx.lsn, tx.seq)
            }
            None => Offset(self.last_commit.unwrap_or(0), 0),
        };
        Position {
            partition: self.partition.clone(),
            offset,
        }
    }

    fn push_error(&mut self, position: Position, reason: String, raw: Bytes) {
        if self.keep(position.offset) {
            self.chunk.push(SourceItem {
                record: Err(DecodeError { position, reason }),
                raw,
            });
        }
    }

    fn change(
        &mut self,
        relation: u32,
        op: Op,
        old: Option<(OldKind, Tuple)>,
        new: Option<Tuple>,
        raw: &Bytes,
    ) {
        // Positions are numbered the same way on every read of the transaction, whatever is
        // skipped, so a resume inside it skips exactly what was durable.
        let position = self.next_position();
        let Some(info) = self.relations.get(&relation) else {
            self.push_error(
                position,
                format!("change for relation {relation} before its Relation message"),
                raw.clone(),
            );
            return;
        };
        let before = match &old {
            Some((_, t)) => match row(&info.shape, t, None) {
                Ok(r) => Some(r),
                Err(e) => {
                    return self.push_error(
                        position,
                        format!("`{}` old row: {e}", info.table),
                        raw.clone(),
                    );
                }
            },
            None => None,
        };
        let after = match &new {
            // An unchanged TOASTed column takes its value from a full old row when there is one.
            Some(t) => match row(
                &info.shape,
                t,
                old.as_ref()
                    .filter(|(k, _)| *k == OldKind::Full)
                    .map(|(_, t)| t),
            ) {
                Ok(r) => Some(r),
                Err(e) => {
                    return self.push_error(
                        position,
                        format!("`{}` new row: {e}", info.table),
                        raw.clone(),
                    );
                }
            },
            None => None,
        };
        // Key columns in key order; a table without any key gets none (the projection then
        // uses its configured key columns, or dead-letters the change).
        let key_of = |r: &Row| -> Row {
            info.key_columns
                .iter()
                .filter_map(|c| r.get(c).map(|v| (c.clone(), v.clone())))
                .collect()
        };
        let key: Option<Row> = after.as_ref().or(before.as_ref()).map(key_of);
        // An update that changes the key is a delete of the old key and a create of the new
        // one, as Debezium emits it (the old row carries the old key whenever it changed).
        if op == Op::Update {
            if let (Some(old_row), Some(new_key)) = (&before, &key) {
                let old_key = key_of(old_row);
                if old_key.len() == info.key_columns.len()
                    && !old_key.is_empty()
                    && old_key != *new_key
                {
                    let before = before.clone();
                    let table = info.table.clone();
                    let second = self.next_position();
                    if self.keep(position.offset) {
                        self.push_change(
                            table.clone(),
                            Op::Delete,
                            Some(old_key),
                            before,
                            None,
                            position,
                        );
                    }
                    if self.keep(second.offset) {
                        self.push_change(table, Op::Create, key, None, after, second);
                    }
                    return;
                }
            }
        }
        if self.keep(position.offset) {
            let table = info.table.clone();
            self.push_change(table, op, key, before, after, position);
        }
    }

    fn push_change(
        &mut self,
        table: TableId,
        op: Op,
        key: Option<Row>,
        before: Option<Row>,
        after: Option<Row>,
        position: Position,
    ) {
        let tx = self.tx.as_ref();
        let event = ChangeEvent {
            table,
            op,
            key: key.filter(|k| !k.is_empty()).map(Arc::new),
            before: before.map(Arc::new),
            after: after.map(Arc::new),
            source: SourceInfo {
                connector: Some("postgresql".into()),
                db: self.db.clone(),
                ts_ms: tx.map(|t| t.commit_ms),
                tx_id: tx.map(|t| i64::from(t.xid)),
                lsn: tx.map(|t| t.lsn),
                kafka: None,
            },
            transaction: tx.map(|t| TxInfo {
                id: t.xid.to_string(),
                total_order: Some(t.seq),
                data_collection_order: None,
            }),
            position,
        };
        self.chunk.push(SourceItem {
            record: Ok(Record::Change(event)),
            raw: Bytes::new(),
        });
    }
}

/// Builds a row from a tuple; unchanged TOAST values come from `full_old` when given, and are
/// an error otherwise (the value was not sent).
fn row(shape: &Relation, tuple: &Tuple, full_old: Option<&Tuple>) -> Result<Row, String> {
    if tuple.len() != shape.columns.len() {
        return Err(format!(
            "{} values for {} columns",
            tuple.len(),
            shape.columns.len()
        ));
    }
    let mut out = Row::new();
    for (i, (column, datum)) in shape.columns.iter().zip(tuple).enumerate() {
        let value = match datum {
            Datum::Null => Value::Null,
            Datum::Text(bytes) => {
                let text = std::str::from_utf8(bytes)
                    .map_err(|_| format!("column `{}` is not UTF-8", column.name))?;
                text_to_json(column.type_oid, text)
                    .map_err(|e| format!("column `{}`: {e}", column.name))?
            }
            Datum::Binary(_) => {
                return Err(format!("column `{}` arrived in binary format", column.name));
            }
            Datum::UnchangedToast => match full_old.and_then(|t| t.get(i)) {
                Some(Datum::Text(bytes)) => {
                    let text = std::str::from_utf8(bytes)
                        .map_err(|_| format!("column `{}` is not UTF-8", column.name))?;
                    text_to_json(column.type_oid, text)
                        .map_err(|e| format!("column `{}`: {e}", column.name))?
                }
                // Leaving the column out would erase it from the read model: refuse loudly.
                _ => {
                    return Err(format!(
                        "column `{}` is an unchanged TOASTed value that PostgreSQL did not send; \
                         set REPLICA IDENTITY FULL on the table (merging with the last known value is not built yet)",
                        column.name
                    ));
                }
            },
        };
        out.insert(column.name.clone(), value);
    }
    Ok(out)
}
