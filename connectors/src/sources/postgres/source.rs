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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pgwire_replication::{
    Lsn, ReplicationClient, ReplicationConfig, TlsConfig, client::ReplicationEvent,
};
use refract_schemas::config::PostgresSourceConfig;
use refract_schemas::debezium::DecodeError;
use refract_schemas::event::{SourceInfo, TxBoundary, TxInfo, TxStatus};
use refract_schemas::{ChangeEvent, Checkpoint, Offset, Op, Position, Record, Row, TableId};
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use super::pgoutput::{self, Datum, Message, OldKind, Relation, Tuple};
use super::values::text_to_json;
use crate::{ReadMode, Source, SourceError, SourceItem};

/// Changes per chunk handed to the runtime: a huge transaction flows in pieces (memory stays
/// bounded); small transactions go as soon as they commit.
const CHUNK_EVENTS: usize = 2_048;
/// Chunks buffered ahead of the runtime.
const CHANNEL_CHUNKS: usize = 4;
/// How often standby status updates go to the server: often enough that the slot follows the
/// durable position closely.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);
/// Prefix of the logical message that marks "caught up" for `--until-caught-up`.
const CAUGHT_UP_PREFIX: &str = "refract.caught_up";

/// The PostgreSQL source.
pub struct PostgresSource {
    config: PostgresSourceConfig,
    slot: String,
    publication: String,
    partition: Arc<str>,
    rx: Option<mpsc::Receiver<Result<Vec<SourceItem>, SourceError>>>,
    stop: Arc<watch::Sender<bool>>,
}

impl PostgresSource {
    /// A source for pipeline `pipeline` (which names the default slot and publication).
    pub fn new(config: PostgresSourceConfig, pipeline: &str) -> Self {
        let slot = config.slot_name(pipeline);
        let publication = config.publication_name(pipeline);
        let partition = format!("pg:{slot}").into();
        Self {
            config,
            slot,
            publication,
            partition,
            rx: None,
            stop: Arc::new(watch::channel(false).0),
        }
    }
}

fn io(message: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> SourceError {
    let message = message.into();
    move |e| SourceError::Io {
        message: format!("{message}: {e}"),
        source: None,
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
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
        let (client, connection) = pg
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(io("cannot connect to PostgreSQL"))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "control connection ended");
            }
        });

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
            Some(row) => {
                let wal_status: String = row.get(1);
                if wal_status == "lost" {
                    return Err(SourceError::Inconsistent(format!(
                        "replication slot `{}` was invalidated (wal_status = lost): changes were lost. Drop the slot \
                         (SELECT pg_drop_replication_slot('{}')), delete the pipeline's state directory and re-snapshot",
                        self.slot, self.slot
                    )));
                }
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
        let resume = checkpoint.get(&*self.partition).copied();
        let (start_lsn, skip_through) = match resume {
            None => (Lsn::ZERO, None),
            Some(Offset(lsn, u64::MAX)) => (Lsn::from_u64(lsn + 1), None),
            Some(o @ Offset(lsn, _)) => (Lsn::from_u64(lsn), Some(o)),
        };

        // The caught-up marker, written after the slot exists so the stream is sure to reach it.
        let caught_up_at = match mode {
            ReadMode::Follow => None,
            ReadMode::UntilCaughtUp => {
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
                Some(parse_lsn(&lsn)?)
            }
        };

        let mut cfg = ReplicationConfig::new(
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
        .with_start_lsn(start_lsn)
        .with_status_interval(STATUS_INTERVAL)
        .with_wakeup_interval(STATUS_INTERVAL)
        .with_application_name("refract");
        if let Some(Offset(lsn, _)) = resume {
            // Confirm no more than what is durable until the runtime says otherwise.
            cfg = cfg.with_ack_lsn(Lsn::from_u64(lsn));
        }
        let replication = ReplicationClient::connect(cfg)
            .await
            .map_err(|e| SourceError::Io {
                message: format!("cannot start replication from slot `{}`: {e}", self.slot),
                source: None,
            })?;

        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        let reader = Reader {
            catalog: client,
            partition: self.partition.clone(),
            db: pg.get_dbname().map(Arc::from),
            relations: HashMap::new(),
            tx: None,
            chunk: Vec::new(),
            skip_through,
            caught_up_at,
            last_commit: resume.map(|o| o.0),
        };
        let stop = self.stop.subscribe();
        tokio::spawn(reader.run(replication, tx, durable, stop));
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
}

fn host_string(host: &tokio_postgres::config::Host) -> String {
    match host {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
    }
}

fn parse_lsn(text: &str) -> Result<u64, SourceError> {
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
}

/// The transaction being read.
struct OpenTx {
    lsn: u64,
    xid: u32,
    seq: u64,
    commit_ms: i64,
}

/// The task that reads the replication stream.
struct Reader {
    /// The control connection, for catalog look-ups (primary keys).
    catalog: tokio_postgres::Client,
    partition: Arc<str>,
    db: Option<Arc<str>>,
    relations: HashMap<u32, RelationInfo>,
    tx: Option<OpenTx>,
    chunk: Vec<SourceItem>,
    /// Changes at or before this position are durable already (a transaction cut by a crash).
    skip_through: Option<Offset>,
    /// The LSN of the caught-up marker (`--until-caught-up`).
    caught_up_at: Option<u64>,
    /// The commit LSN of the last transaction handed out.
    last_commit: Option<u64>,
}

type Chunks = mpsc::Sender<Result<Vec<SourceItem>, SourceError>>;

impl Reader {
    async fn run(
        mut self,
        mut replication: ReplicationClient,
        out: Chunks,
        mut durable: watch::Receiver<Checkpoint>,
        mut stop: watch::Receiver<bool>,
    ) {
        let result = self
            .stream(&mut replication, &out, &mut durable, &mut stop)
            .await;
        replication.stop();
        if let Err(e) = result {
            let _ = out.send(Err(e)).await;
        }
    }

    async fn stream(
        &mut self,
        replication: &mut ReplicationClient,
        out: &Chunks,
        durable: &mut watch::Receiver<Checkpoint>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(), SourceError> {
        // Whether everything handed out is durable, so the slot may follow the server. Not when
        // resuming inside a transaction: its rest is still to come.
        let mut in_flight_free = self.skip_through.is_none();
        loop {
            let event = tokio::select! {
                () = async { let _ = stop.wait_for(|s| *s).await; } => {
                    // Hand out the changes read so far; the rest is read again next time.
                    return self.flush(out).await;
                }
                changed = durable.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    let durable_at = durable.borrow_and_update().get(&*self.partition).copied();
                    if let Some(Offset(lsn, seq)) = durable_at {
                        replication.update_applied_lsn(Lsn::from_u64(if seq == u64::MAX { lsn + 1 } else { lsn }));
                        in_flight_free = seq == u64::MAX && Some(lsn) == self.last_commit && self.tx.is_none();
                    }
                    continue;
                }
                event = replication.recv() => event,
            };
            let event = event.map_err(|e| SourceError::Io {
                message: format!("replication stream failed: {e}"),
                source: None,
            })?;
            let Some(event) = event else {
                return self.flush(out).await;
            };
            match event {
                ReplicationEvent::Begin {
                    final_lsn,
                    xid,
                    commit_time_micros,
                } => {
                    let lsn = final_lsn.as_u64();
                    let commit_ms = (commit_time_micros + pgoutput::PG_EPOCH_OFFSET_MICROS) / 1000;
                    let tx = OpenTx {
                        lsn,
                        xid,
                        seq: 0,
                        commit_ms,
                    };
                    self.marker(TxStatus::Begin, Offset(lsn, 0), &tx);
                    self.tx = Some(tx);
                    in_flight_free = false;
                }
                ReplicationEvent::XLogData { data, .. } => self.data(data).await?,
                ReplicationEvent::Commit { .. } => {
                    let Some(tx) = self.tx.take() else {
                        return Err(SourceError::Inconsistent(
                            "COMMIT without BEGIN in the replication stream".into(),
                        ));
                    };
                    self.marker(TxStatus::End, Offset(tx.lsn, u64::MAX), &tx);
                    self.last_commit = Some(tx.lsn);
                    self.flush(out).await?;
                }
                ReplicationEvent::Message { prefix, lsn, .. } => {
                    if prefix == CAUGHT_UP_PREFIX
                        && self.caught_up_at.is_some_and(|at| lsn.as_u64() >= at)
                        && self.tx.is_none()
                    {
                        tracing::info!(lsn = %lsn, "caught up with the slot");
                        return self.flush(out).await;
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    // Nothing in flight and everything handed out is durable: let the slot
                    // follow the server, so WAL of unrelated traffic is not retained for us.
                    if in_flight_free && self.tx.is_none() && self.chunk.is_empty() {
                        replication.update_applied_lsn(wal_end);
                    }
                }
                ReplicationEvent::StoppedAt { .. } => return self.flush(out).await,
            }
            if self.chunk.len() >= CHUNK_EVENTS {
                self.flush(out).await?;
            }
        }
    }

    async fn flush(&mut self, out: &Chunks) -> Result<(), SourceError> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::take(&mut self.chunk);
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

    /// The primary-key columns of a relation, from the catalog (under REPLICA IDENTITY FULL
    /// pgoutput marks every column as identity, so the flags do not tell the key).
    async fn primary_key(&self, relation: u32) -> Result<Vec<String>, SourceError> {
        let rows = self
            .catalog
            .query(
                "SELECT a.attname::text FROM pg_index i \
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                 WHERE i.indrelid = $1 AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
                &[&relation],
            )
            .await
            .map_err(io(format!("cannot read the primary key of relation {relation}")))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
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
                let mut key_columns = self.primary_key(shape.id).await?;
                if key_columns.is_empty() && shape.replica_identity != b'f' {
                    key_columns = shape
                        .columns
                        .iter()
                        .filter(|c| c.key)
                        .map(|c| c.name.clone())
                        .collect();
                }
                self.relations.insert(
                    shape.id,
                    RelationInfo {
                        table,
                        shape,
                        key_columns,
                    },
                );
            }
            Message::Insert { relation, new } => {
                self.change(relation, Op::Create, None, Some(new), &data)
            }
            Message::Update { relation, old, new } => {
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
        let position = self.next_position();
        if !self.keep(position.offset) {
            return;
        }
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
        let key_source = after.as_ref().or(before.as_ref());
        // Key columns in key order; a table without any key gets none (the projection then
        // uses its configured key columns, or dead-letters the change).
        let key: Option<Row> = key_source.map(|r| {
            info.key_columns
                .iter()
                .filter_map(|c| r.get(c).map(|v| (c.clone(), v.clone())))
                .collect()
        });
        let tx = self.tx.as_ref();
        let event = ChangeEvent {
            table: info.table.clone(),
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
