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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, client::ReplicationEvent};
use refract_schemas::config::{PostgresSourceConfig, SecretUrl, SnapshotMode};
use refract_schemas::debezium::DecodeError;
use refract_schemas::event::{SourceInfo, TxBoundary, TxInfo, TxStatus};
use refract_schemas::{
    ChangeEvent, Checkpoint, Columns, Offset, Op, Position, Record, Row, TableId,
};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};

use super::inspect::error_text;
use super::metrics::SlotMetrics;
use super::pgoutput::{self, Datum, Message, OldKind, Relation, Tuple};
use super::privileges;
use super::snapshot::{self, ChunkMessage, ChunkProgress, Chunker, CopySnapshot};
use super::values::text_to_json;
use crate::pg_connect::{PgEndpoint, TLS_REFUSED};
use crate::pg_sql;
use crate::{ReadMode, Source, SourceContext, SourceError, SourceHealth, SourceItem};
use events::RowShape;
use liveness::Liveness;

mod control;
mod events;
mod liveness;
mod reader;

/// The connector name in every event's source block.
const CONNECTOR: &str = "postgresql";
/// Changes per chunk handed to the runtime: a huge transaction flows in pieces (memory stays
/// bounded); small transactions go at most [`COMMIT_HAND_OVER_DELAY`] after they commit. Small
/// enough that the runtime reads a snapshot's events while they are still in a cache (2048
/// measured slightly more CPU).
const CHUNK_EVENTS: usize = 512;
/// How long a committed transaction may wait in the chunk for the transactions after it. One
/// chunk per transaction cost a channel hand-over and about two thread switches per one-row
/// transaction of a backlog: a third of the time to apply 30,000 of them to two document read
/// models (benches/documents_stream.sh: 2.31/2.33 s, 1.54/1.69 s with this delay). A
/// millisecond lets a backlog fill its chunks and delays a trickle by no more than that.
const COMMIT_HAND_OVER_DELAY: Duration = Duration::from_millis(1);
/// Chunks buffered ahead of the runtime.
const CHANNEL_CHUNKS: usize = 4;
/// How often standby status updates go to the server: often enough that the slot follows the
/// durable position closely, and that a run that ends confirms its last position quickly (it
/// waits for the next update: a one-off backfill of 1M rows spent a tenth of its time there at
/// 250 ms). At most twenty 34-byte messages a second cost the server nothing.
const STATUS_INTERVAL: Duration = Duration::from_millis(50);
/// Prefix of the logical message that marks "caught up" for `--until-caught-up`.
const CAUGHT_UP_PREFIX: &str = "refract.caught_up";
/// How often the slot's retained WAL and lag are measured: the status page samples its lag plot
/// every 5 s, and one catalog query every 10 s costs the server nothing.
const SLOT_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// How long a run that ends waits for the slot to show its final confirmed position.
const FINAL_CONFIRM_WAIT: Duration = Duration::from_secs(5);
/// How often the end of a run looks whether the slot shows its final position: a query on an
/// idle connection, cheap beside the status interval it waits for.
const FINAL_CONFIRM_POLL: Duration = Duration::from_millis(10);
/// Longest wait between two reconnection attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(30);
/// Longest wait for an ordinary connection to open: a server that does not answer (a black
/// hole) is tried again rather than waited for.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive on ordinary connections: probes after this much silence, so a peer that is gone
/// is noticed by the kernel even on an idle connection (and idle-connection timeouts of
/// firewalls and NAT are not reached).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// Time between unanswered keepalive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes before the kernel drops the connection: a dead peer is noticed within a
/// minute of silence.
const KEEPALIVE_RETRIES: u32 = 3;
/// Longest time sent data may stay unacknowledged before the kernel drops the connection
/// (`TCP_USER_TIMEOUT`): keepalive probes do not go out while data waits, this bound does.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for a catalog look-up on the control connection while decoding (a relation's
/// key, a TOAST re-read): a look-up that hangs ends the stream, which is reopened.
const CATALOG_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// Set at start without a checkpoint: the slot's confirmed position (see
    /// [`Source::resumes_unnamed`]).
    resumes_unnamed: Checkpoint,
    /// Chunks received from the reader.
    received: u64,
    /// The number of the chunk that ends a snapshot or backfill read (see [`Reader::ends_at`]).
    ends_at: Arc<AtomicU64>,
    /// What `/health` says of the stream and the control connection.
    health: SourceHealth,
}

impl PostgresSource {
    /// A source for the pipeline of `context` (whose name gives the default slot and publication).
    pub fn new(config: PostgresSourceConfig, context: SourceContext) -> Self {
        let slot = config.slot_name(&context.pipeline);
        let publication = config.publication_name(&context.pipeline);
        let partition: Arc<str> = format!("pg:{slot}").into();
        let health =
            SourceHealth::new(&partition, Duration::from_millis(config.unhealthy_after_ms));
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
            resumes_unnamed: Checkpoint::new(),
            received: 0,
            ends_at: Arc::new(AtomicU64::new(0)),
            health,
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
        message: format!("{message}: {}", error_text(&e)),
        source: None,
    }
}

/// An ordinary (non-replication) connection, its connection task spawned: opened within
/// [`CONNECT_TIMEOUT`], with TCP keepalive and `TCP_USER_TIMEOUT` so that a peer gone silent is
/// noticed by the kernel (the URL's `connect_timeout`, `tcp_user_timeout`, `keepalives_interval`
/// and `keepalives_retries` win).
pub(crate) async fn connect(url: &str) -> Result<tokio_postgres::Client, SourceError> {
    let mut endpoint = endpoint(url)?;
    let pg = &mut endpoint.config;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(CONNECT_TIMEOUT);
    }
    if pg.get_tcp_user_timeout().is_none() {
        pg.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    pg.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
    if pg.get_keepalives_interval().is_none() {
        pg.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if pg.get_keepalives_retries().is_none() {
        pg.keepalives_retries(KEEPALIVE_RETRIES);
    }
    // The connect timeout bounds the TCP handshake only: the whole opening is bounded too.
    tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect("source"))
        .await
        .map_err(|_| SourceError::Io {
            message: format!(
                "cannot connect to PostgreSQL: no answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            ),
            source: None,
        })?
        .map_err(|e| SourceError::Io {
            message: format!("cannot connect to PostgreSQL: {e}"),
            source: None,
        })
}

/// The source's server, as its URL names it.
fn endpoint(url: &str) -> Result<PgEndpoint, SourceError> {
    PgEndpoint::parse(url).map_err(|e| SourceError::Io {
        message: e.to_string(),
        source: None,
    })
}

#[async_trait]
impl Source for PostgresSource {
    fn resumes_unnamed(&self) -> Checkpoint {
        self.resumes_unnamed.clone()
    }

    async fn start(
        &mut self,
        checkpoint: &Checkpoint,
        mode: ReadMode,
        durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError> {
        let pg = endpoint(self.config.url.expose())?;
        let client = connect(self.config.url.expose()).await?;
        let resume = checkpoint.get(&*self.partition).copied();
        let snapshot_path = PostgresSource::snapshot_progress_path(&self.context.state_dir);
        self.ensure_publication(&client).await?;
        let export_snapshot = self.prepare_slot(&client, resume, &snapshot_path).await?;
        let mut chunker = self
            .prepare_chunker(resume, export_snapshot, snapshot_path)
            .await?;
        let cfg = replication_config(&pg, &self.slot, &self.publication);
        let Opened {
            replication,
            copy,
            caught_up,
            marker,
        } = self
            .open_stream(&client, &cfg, mode, export_snapshot, &mut chunker, resume)
            .await?;
        if let Some(copy) = &copy {
            self.chunks = Some(copy.progress.clone());
        }

        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        if let Some(chunker) = chunker {
            self.chunks = Some(chunker.progress());
            self.spawn_chunker(chunker, marker, tx.clone());
        }
        // A new reader counts its chunks from 1 again.
        self.received = 0;
        self.ends_at = Arc::new(AtomicU64::new(0));
        let reader = Reader {
            catalog: client,
            url: self.config.url.clone(),
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            chunk_rows: self.config.chunk_rows,
            takes_requests: mode == ReadMode::Follow && self.context.backfill.is_none(),
            request_prefix: snapshot::request_prefix(&self.slot),
            replication_config: cfg,
            partition: self.partition.clone(),
            db: pg.config.get_dbname().map(Arc::from),
            connector: Arc::from(CONNECTOR),
            flushes: 0,
            ends_at: self.ends_at.clone(),
            rows_prefix: snapshot::message_prefix(&self.slot),
            max_retained_wal: self.config.max_retained_wal_mb.saturating_mul(1 << 20),
            metrics: SlotMetrics::new(&self.slot),
            relations: HashMap::new(),
            tx: None,
            chunk: Vec::new(),
            skip_through: resume_point(resume).1,
            caught_up,
            last_commit: resume.map(|o| o.0),
            hand_over_at: None,
            last_sent: None,
            resumed_from: resume,
            copy,
            copy_ends: Vec::new(),
            state_dir: self.context.state_dir.clone(),
            health: self.health.clone(),
            read_timeout: Duration::from_millis(self.config.read_timeout_ms),
            heard: 0,
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
            Some(Ok(items)) => {
                self.received += 1;
                Ok(Some(items))
            }
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

    fn ends_batch(&self) -> bool {
        self.received == self.ends_at.load(Ordering::Acquire)
    }

    fn health(&self) -> SourceHealth {
        self.health.clone()
    }

    fn progress(&self) -> Option<(u64, u64)> {
        let p = self.chunks.as_ref()?;
        let done = p.rows.load(Ordering::Relaxed);
        Some((done, p.total.load(Ordering::Relaxed).max(done)))
    }
}

/// The steps of [`Source::start`], in the order it takes them.
impl PostgresSource {
    /// Creates the publication when it does not exist (and `create` allows it).
    async fn ensure_publication(&self, client: &tokio_postgres::Client) -> Result<(), SourceError> {
        let exists = pg_sql::publication_exists(client, &self.publication)
            .await
            .map_err(io("cannot read pg_publication"))?;
        if !exists && !self.config.create {
            return Err(SourceError::Inconsistent(format!(
                "publication `{}` does not exist (and `create = false`)",
                self.publication
            )));
        }
        let needs = privileges::Needs {
            publication: &self.publication,
            create_for: (!exists).then_some(self.config.tables.as_slice()),
        };
        privileges::check_source(client, &needs).await?;
        if exists {
            return Ok(());
        }
        pg_sql::create_publication(client, &self.publication, &self.config.tables)
            .await
            .map_err(io(format!(
                "cannot create publication `{}`",
                self.publication
            )))?;
        let target = pg_sql::publication_target(&self.config.tables);
        tracing::info!(publication = %self.publication, %target, "created publication");
        Ok(())
    }

    /// Checks the slot against the checkpoint `resume`: refuses a slot that is gone or lost,
    /// notes where a slot resumes without a checkpoint, creates a missing slot (and `create`
    /// allows it). Returns whether the slot is still to be created, exporting the snapshot of an
    /// initial snapshot (marked due in `snapshot_path`).
    async fn prepare_slot(
        &mut self,
        client: &tokio_postgres::Client,
        resume: Option<Offset>,
        snapshot_path: &std::path::Path,
    ) -> Result<bool, SourceError> {
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
                // Without a checkpoint the stream resumes at the slot's confirmed position: a
                // transaction committed at or after it comes again, one before it does not.
                let confirmed: Option<String> = row.get(0);
                if let (None, Some(confirmed)) = (resume, confirmed) {
                    let confirmed = parse_lsn(&confirmed)?;
                    if confirmed > 0 {
                        self.resumes_unnamed = Checkpoint::from([(
                            self.partition.to_string(),
                            Offset(confirmed - 1, u64::MAX),
                        )]);
                    }
                }
            }
            None if self.config.create && self.config.snapshot == SnapshotMode::Initial => {
                // Recorded before the slot exists: a crash right after creating it must not
                // leave the existing rows unread. The slot itself is created later, on the
                // replication session, exporting the snapshot the tables are read in.
                snapshot::mark_snapshot_due(snapshot_path)?;
                return Ok(true);
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
        Ok(false)
    }

    /// Rows to read into the stream in chunks: a backfill asked for, or an initial snapshot
    /// that is due (and not read from an exported snapshot).
    async fn prepare_chunker(
        &self,
        resume: Option<Offset>,
        export_snapshot: bool,
        snapshot_path: PathBuf,
    ) -> Result<Option<Chunker>, SourceError> {
        snapshot::resume_after_copy(&self.context.state_dir, resume)?;
        let chunk_job = if export_snapshot {
            None
        } else if let Some(scope) = &self.context.backfill {
            let path = PostgresSource::backfill_progress_path(&self.context.state_dir);
            Some((path, scope.tables.as_slice(), scope.restart))
        } else if snapshot::unfinished(&snapshot_path) {
            Some((snapshot_path, &[][..], false))
        } else {
            None
        };
        let Some((path, tables, restart)) = chunk_job else {
            return Ok(None);
        };
        let chunker = Chunker::prepare(
            self.config.url.expose(),
            &self.publication,
            &self.slot,
            self.config.chunk_rows,
            path,
            tables,
            restart,
        )
        .await?;
        Ok(Some(chunker))
    }

    /// Opens the replication stream: creating the slot exporting the initial snapshot's
    /// snapshot, exporting the snapshot of a backfill run by this process (taken out of
    /// `chunker`), or resuming at the checkpoint `resume`; and plans when `--until-caught-up`
    /// stops.
    async fn open_stream(
        &self,
        client: &tokio_postgres::Client,
        cfg: &ReplicationConfig,
        mode: ReadMode,
        export_snapshot: bool,
        chunker: &mut Option<Chunker>,
        resume: Option<Offset>,
    ) -> Result<Opened, SourceError> {
        // A backfill run by this process reads an exported snapshot (the fast path) into the
        // stream; its chunk progress only says where to start.
        let backfill_plan = if self.context.backfill.is_some() {
            chunker.take()
        } else {
            None
        };
        // The caught-up marker, written after the slot exists so the stream is sure to reach
        // it; after the last chunk when rows are being read, after the backfill's snapshot
        // exists when it is read.
        let mut caught_up = CaughtUp::Never;
        let mut marker_tx = None;
        if mode == ReadMode::UntilCaughtUp && !export_snapshot && backfill_plan.is_none() {
            if chunker.is_some() {
                let (tx, rx) = oneshot::channel();
                caught_up = CaughtUp::Pending(rx);
                marker_tx = Some(tx);
            } else {
                caught_up = CaughtUp::At(emit_caught_up_marker(client).await?);
            }
        }
        if export_snapshot {
            let (replication, copy) = snapshot::create_slot_exporting(
                cfg,
                self.config.url.expose(),
                &self.slot,
                &self.publication,
                &self.context.state_dir,
            )
            .await?;
            if mode == ReadMode::UntilCaughtUp {
                caught_up = CaughtUp::At(emit_caught_up_marker(client).await?);
            }
            return Ok(Opened {
                replication,
                copy: Some(copy),
                caught_up,
                marker: marker_tx,
            });
        }
        let copy = match backfill_plan {
            Some(plan) => {
                let copy = self.export_backfill(cfg, plan).await?;
                // After the snapshot's consistent point: the stream reaches the point where
                // the rows go before it reaches the marker.
                if mode == ReadMode::UntilCaughtUp {
                    caught_up = CaughtUp::At(emit_caught_up_marker(client).await?);
                }
                Some(copy)
            }
            None => None,
        };
        let (start_lsn, _) = resume_point(resume);
        let replication = start_replication(cfg, start_lsn, resume, &self.slot).await?;
        Ok(Opened {
            replication,
            copy,
            caught_up,
            marker: marker_tx,
        })
    }

    /// Exports the snapshot a backfill run by this process reads, planned by `plan`.
    async fn export_backfill(
        &self,
        cfg: &ReplicationConfig,
        plan: Chunker,
    ) -> Result<CopySnapshot, SourceError> {
        let progress = plan.progress();
        let (tables, scope) = plan.into_plan();
        snapshot::export_for_backfill(
            cfg,
            self.config.url.expose(),
            &self.slot,
            snapshot::CopyPlan {
                publication: &self.publication,
                state_dir: &self.context.state_dir,
                tables: Some(tables),
                scope,
                progress,
                request: None,
            },
        )
        .await
    }

    /// Reads the rows of `chunker` into the stream on a task of its own, then writes the
    /// caught-up marker when `marker` waits for it. Its failure goes to the stream (`errors`).
    fn spawn_chunker(
        &self,
        chunker: Chunker,
        marker: Option<oneshot::Sender<u64>>,
        errors: Chunks,
    ) {
        let url = self.config.url.clone();
        let mut stop = self.stop.subscribe();
        tokio::spawn(async move {
            let work = async {
                let report = chunker.run().await?;
                for (table, rows) in &report.tables {
                    tracing::info!(%table, rows, "rows read into the stream");
                }
                if let Some(marker) = marker {
                    let client = connect(url.expose()).await?;
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
}

/// The replication session's settings, from the source's URL.
fn replication_config(endpoint: &PgEndpoint, slot: &str, publication: &str) -> ReplicationConfig {
    let pg = &endpoint.config;
    let host = pg
        .get_hosts()
        .first()
        .map_or_else(|| "127.0.0.1".to_owned(), host_string);
    let tls = endpoint.replication_tls(&host);
    ReplicationConfig::new(
        host,
        pg.get_user().unwrap_or("postgres"),
        pg.get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default(),
        pg.get_dbname().unwrap_or("postgres"),
        slot.to_owned(),
        publication.to_owned(),
    )
    .with_port(pg.get_ports().first().copied().unwrap_or(5432))
    .with_tls(tls)
    .with_status_interval(STATUS_INTERVAL)
    .with_wakeup_interval(STATUS_INTERVAL)
    .with_application_name(pg.get_application_name().unwrap_or("refract"))
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
    emit_message(client, CAUGHT_UP_PREFIX, "").await
}

/// Writes a non-transactional logical message and flushes the WAL through it, so the stream
/// carries it at once: a walsender sends only flushed WAL, and a message alone waits for the WAL
/// writer (up to `wal_writer_delay`, 200 ms by default; PostgreSQL 17's `flush` argument does
/// the same). A transaction given an id commits with a flush. Returns the message's LSN.
pub(crate) async fn emit_message(
    client: &tokio_postgres::Client,
    prefix: &str,
    content: &str,
) -> Result<u64, SourceError> {
    let failed = io(format!(
        "cannot write a logical message `{prefix}` (pg_logical_emit_message)"
    ));
    let lsn = async {
        client.batch_execute("BEGIN").await?;
        let row = client
            .query_one(
                "SELECT pg_logical_emit_message(false, $1, $2)::text, txid_current()",
                &[&prefix, &content],
            )
            .await?;
        client.batch_execute("COMMIT").await?;
        Ok(row.get::<_, String>(0))
    }
    .await;
    match lsn {
        Ok(lsn) => parse_lsn(&lsn),
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(failed(e))
        }
    }
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
                || message.contains(TLS_REFUSED)
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
    /// How its rows are built.
    rows: RowShape,
    /// The value of [`Reader::flushes`] when `rows` was last renewed.
    renewed: u64,
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
    url: SecretUrl,
    slot: String,
    publication: String,
    /// Rows per chunk of a backfill resumed in chunks.
    chunk_rows: u32,
    /// Whether this run reads the backfills `refract backfill` asks of it (a daemon does; a
    /// run until caught up or a backfill's own run does not).
    takes_requests: bool,
    /// Prefix of this slot's backfill request messages.
    request_prefix: String,
    replication_config: ReplicationConfig,
    partition: Arc<str>,
    db: Option<Arc<str>>,
    /// The connector name every event carries (`postgresql`), shared rather than allocated per
    /// event.
    connector: Arc<str>,
    /// Chunks handed out so far: a relation's row names are renewed once per chunk (see
    /// [`RowShape::renew`]).
    flushes: u64,
    /// The number (counting from 1, as [`Self::flushes`] does) of the chunk that ends the last
    /// snapshot or backfill read: someone waits for those rows (`refract backfill`), so the
    /// runtime writes them without waiting for more events to fill its batch.
    ends_at: Arc<AtomicU64>,
    /// Prefix of this slot's snapshot/backfill chunk messages.
    rows_prefix: String,
    /// Retained WAL (bytes) above which a warning is logged.
    max_retained_wal: u64,
    /// The slot's metrics.
    metrics: SlotMetrics,
    relations: HashMap<u32, RelationInfo>,
    tx: Option<OpenTx>,
    chunk: Vec<SourceItem>,
    /// Changes at or before this position are durable already (a transaction cut by a crash),
    /// or were handed out before the connection was lost.
    skip_through: Option<Offset>,
    caught_up: CaughtUp,
    /// The commit LSN of the last transaction read (handed out with its chunk, at most
    /// [`COMMIT_HAND_OVER_DELAY`] later): what comes after it in the stream is positioned after it.
    last_commit: Option<u64>,
    /// When the committed transactions waiting in the chunk are handed out at the latest.
    hand_over_at: Option<tokio::time::Instant>,
    /// The position of the last item handed out.
    last_sent: Option<Offset>,
    /// The checkpoint the run started from.
    resumed_from: Option<Offset>,
    /// An exported snapshot to read: before the stream (initial snapshot), or where the stream
    /// reaches its consistent point (a backfill's fast path).
    copy: Option<CopySnapshot>,
    /// The position of the last row of each read handed out, until that is durable.
    copy_ends: Vec<(Offset, snapshot::CopyKind)>,
    /// The pipeline's state directory (snapshot progress).
    state_dir: PathBuf,
    /// Where the stream's and the control connection's troubles are recorded for `/health`.
    health: SourceHealth,
    /// The replication connection's read deadline (see [`liveness`]).
    read_timeout: Duration,
    /// Events received from the replication connection (see [`Liveness`]).
    heard: u64,
}

type Chunks = mpsc::Sender<Result<Vec<SourceItem>, SourceError>>;

/// A replication stream opened by [`PostgresSource::open_stream`].
struct Opened {
    replication: ReplicationClient,
    /// An exported snapshot to read (see [`Reader::copy`]).
    copy: Option<CopySnapshot>,
    /// When `--until-caught-up` stops.
    caught_up: CaughtUp,
    /// Set when the caught-up marker is to be written after the chunks are read.
    marker: Option<oneshot::Sender<u64>>,
}

/// Why the stream ended.
enum Ended {
    /// Stopped, caught up or closed by the server on purpose: done.
    Done,
    /// The connection failed: reconnect.
    Lost(String),
}
