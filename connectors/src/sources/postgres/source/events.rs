//! Turning what the stream and the snapshot carry into items for the runtime: pgoutput
//! messages, snapshot rows read with COPY, snapshot/backfill chunk messages.

use std::borrow::Cow;

use super::*;
use crate::pg_sql::{qualified, quote_ident};

impl Reader {
    /// Reads the exported snapshot's tables with COPY, handing every row out as a read event
    /// (before the stream, or where the stream reached the snapshot). Returns false when stopped on request (the next start resumes).
    pub(super) async fn read_copy(
        &mut self,
        mut copy: CopySnapshot,
        out: &Chunks,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SourceError> {
        use futures::StreamExt as _;
        let started = Instant::now();
        let mut total = 0u64;
        // Whether the BEGIN that frames the rows was handed out (before the first row).
        let mut framed = false;
        for index in 0..copy.tables.len() {
            let t = copy.tables[index].clone();
            let mut table = match t.table.split_once('.') {
                Some((schema, name)) => TableId::new(schema, name),
                None => TableId::new("public", &t.table),
            };
            let names: Vec<String> = t.columns.iter().map(|(c, _)| c.clone()).collect();
            let types: Vec<u32> = t.columns.iter().map(|(_, o)| *o).collect();
            let mut shape = RowShape::new(&names, &types, &t.key);
            let stream = copy.copy_out(index).await?;
            futures::pin_mut!(stream);
            // Bytes of a line that a message left unfinished (PostgreSQL sends one row per
            // message, so this stays empty and lines are parsed where they arrive).
            let mut pending: Vec<u8> = Vec::new();
            // The fields' vector, kept between messages (emptied, so it borrows nothing).
            let mut spare: Vec<Option<Cow<'static, str>>> = Vec::with_capacity(names.len());
            let mut row = 0u64;
            let mut counted = 0u64;
            loop {
                let data = match stream.next().await {
                    Some(Ok(data)) => data,
                    Some(Err(e)) => {
                        return Err(io(format!("reading `{}` (COPY) failed", t.table))(e));
                    }
                    None => break,
                };
                let carried = !pending.is_empty();
                if carried {
                    pending.extend_from_slice(&data);
                }
                let buffer: &[u8] = if carried { &pending } else { &data };
                let mut fields = recycle(std::mem::take(&mut spare));
                let mut start = 0;
                while let Some(n) = memchr::memchr(b'\n', &buffer[start..]) {
                    let line = &buffer[start..start + n];
                    start += n + 1;
                    row += 1;
                    let seq = CopySnapshot::seq(index, row);
                    if !framed {
                        // Just before the first row (`seq - 1` is no row's position).
                        self.copy_marker(TxStatus::Begin, Offset(copy.lsn, seq - 1), 0);
                        framed = true;
                    }
                    let position = Position {
                        partition: self.partition.clone(),
                        offset: Offset(copy.lsn, seq),
                    };
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
                    self.push_read(&table, &shape, &names, &fields, position, None);
                }
                spare = recycle(fields);
                if carried {
                    pending.drain(..start);
                } else {
                    pending.extend_from_slice(&data[start..]);
                }
                // A message holds one row: progress and a stop request are looked at once per
                // chunk of rows, not per message.
                if self.chunk.len() >= CHUNK_EVENTS || row - counted >= CHUNK_EVENTS as u64 {
                    copy.progress
                        .rows
                        .fetch_add(row - counted, Ordering::Relaxed);
                    counted = row;
                    if self.chunk.len() >= CHUNK_EVENTS {
                        self.flush(out).await?;
                        // New copies for the next chunk, as `flush` makes of the other names.
                        table = TableId::new(&table.schema, &table.name);
                        shape.renew();
                    }
                    if *stop.borrow() {
                        self.flush(out).await?;
                        return Ok(false);
                    }
                }
            }
            copy.progress
                .rows
                .fetch_add(row - counted, Ordering::Relaxed);
            if index + 1 == copy.tables.len() {
                if framed {
                    // Past the last row; the rows of every later change come after it. Noted
                    // first: a restart that finds it not durable reads the last table's tail
                    // again, whose chunks end the marks' transaction.
                    let end = Offset(copy.lsn, CopySnapshot::seq(index, row + 1));
                    copy.frame_end(end.1)?;
                    self.copy_marker(TxStatus::End, end, total + row);
                }
                self.flush_ending(out).await?;
            } else {
                self.flush(out).await?;
            }
            copy.end(index, CopySnapshot::seq(index, row))?;
            total += row;
            tracing::info!(table = %t.table, rows = row, "table read from the exported snapshot");
        }
        tracing::info!(
            rows = total,
            secs = started.elapsed().as_secs_f64(),
            "{} read from its exported snapshot; streaming from the slot",
            copy.kind.label()
        );
        Ok(true)
    }

    /// A BEGIN or END framing the rows of an exported snapshot: they are one consistent unit,
    /// as a transaction is, so a projection that emits per transaction (documents) builds each
    /// document once, at the end of the load, instead of after every batch that reached it. A
    /// read stopped or killed before its END is durable is finished in chunks at the next start
    /// (the last table at least: [`snapshot::resume_copy_kind`]), and those end what it marked.
    fn copy_marker(&mut self, status: TxStatus, offset: Offset, rows: u64) {
        self.push_boundary(status, offset, format!("snapshot@{}", offset.0), rows, None);
    }

    /// Hands out one row read from a table (snapshot or backfill) as a read event; `shape`
    /// describes `columns`.
    pub(super) fn push_read<S: AsRef<str> + serde::Serialize>(
        &mut self,
        table: &TableId,
        shape: &RowShape,
        columns: &[String],
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
        // Converted in column order: the first bad column is the one reported.
        let converted = shape.build(|i| match &values[i] {
            None => Ok(Value::Null),
            Some(text) => text_to_json(shape.types[i], text.as_ref())
                .map_err(|e| format!("column `{}`: {e}", columns[i])),
        });
        let after = match converted {
            Ok(row) => row,
            Err(e) => {
                let raw = Bytes::from(serde_json::to_vec(values).unwrap_or_default());
                return self.push_error(position, format!("`{table}` {e}"), raw);
            }
        };
        let seq = position.offset.1;
        self.chunk.push(SourceItem {
            record: Ok(Record::Change(ChangeEvent {
                table: table.clone(),
                op: Op::Read,
                key: None,
                key_columns: shape.key_columns.clone(),
                before: None,
                after: Some(Arc::new(after)),
                source: SourceInfo {
                    connector: Some(self.connector.clone()),
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
    pub(super) fn rows(&mut self, content: &Bytes) {
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
        let shape = RowShape::new(&message.columns, &message.types, &message.key);
        for values in &message.rows {
            let position = self.next_position();
            self.push_read(&table, &shape, &message.columns, values, position, tx);
        }
    }

    pub(super) fn keep(&self, position: Offset) -> bool {
        self.skip_through.is_none_or(|s| position > s)
    }

    pub(super) fn marker(&mut self, status: TxStatus, offset: Offset, tx: &OpenTx) {
        let (id, events, commit_ms) = (tx.xid.to_string(), tx.seq, tx.commit_ms);
        self.push_boundary(status, offset, id, events, Some(commit_ms));
    }

    /// Hands out a BEGIN or END at `offset` (an END counts `events`), unless it is skipped.
    fn push_boundary(
        &mut self,
        status: TxStatus,
        offset: Offset,
        id: String,
        events: u64,
        ts_ms: Option<i64>,
    ) {
        if !self.keep(offset) {
            return;
        }
        let boundary = TxBoundary {
            status,
            id,
            event_count: (status == TxStatus::End).then_some(events),
            ts_ms,
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
    pub(super) async fn primary_key(
        &self,
        relation: u32,
    ) -> Result<Vec<(String, String)>, SourceError> {
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
    pub(super) async fn refetch_toasted(
        &self,
        relation: u32,
        new: &mut Tuple,
    ) -> Result<(), SourceError> {
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
            "SELECT {} FROM {} WHERE ({}) = ({})",
            columns.join(", "),
            qualified(&info.shape.namespace, &info.shape.name),
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

    /// Handles a data message that needs no catalog look-up (an insert, a delete, an update
    /// without unchanged TOASTed values) at once, with no async step: nearly every message of a
    /// backlog, and an async step per message costs the stream about 1% of its instructions
    /// (callgrind). `false` for any other message, which [`Self::data`] handles.
    pub(super) fn data_now(&mut self, data: &Bytes) -> bool {
        let Ok(message) = pgoutput::decode(data, false) else {
            return false;
        };
        match message {
            Message::Insert { relation, new } => {
                self.change(relation, Op::Create, None, Some(new), data)
            }
            Message::Update { relation, old, new } if !needs_refetch(&old, &new) => {
                self.change(relation, Op::Update, old, Some(new), data)
            }
            Message::Delete { relation, old } => {
                self.change(relation, Op::Delete, Some(old), None, data)
            }
            _ => return false,
        }
        true
    }

    /// Handles one pgoutput data message.
    pub(super) async fn data(&mut self, data: Bytes) -> Result<(), SourceError> {
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
                let (key_columns, key_types): (Vec<String>, _) = key.into_iter().unzip();
                let names: Vec<String> = shape.columns.iter().map(|c| c.name.clone()).collect();
                let types: Vec<u32> = shape.columns.iter().map(|c| c.type_oid).collect();
                let rows = RowShape::new(&names, &types, &key_columns);
                self.relations.insert(
                    shape.id,
                    RelationInfo {
                        table,
                        shape,
                        rows,
                        renewed: self.flushes,
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
                if needs_refetch(&old, &new) {
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

    pub(super) fn next_position(&mut self) -> Position {
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

    pub(super) fn push_error(&mut self, position: Position, reason: String, raw: Bytes) {
        if self.keep(position.offset) {
            self.chunk.push(SourceItem {
                record: Err(DecodeError { position, reason }),
                raw,
            });
        }
    }

    pub(super) fn change(
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
        let flushes = self.flushes;
        if let Some(info) = self.relations.get_mut(&relation)
            && info.renewed != flushes
        {
            info.rows.renew();
            info.renewed = flushes;
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
            Some((_, t)) => match row(info, t, None) {
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
                info,
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

    pub(super) fn push_change(
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
            key_columns: None,
            before: before.map(Arc::new),
            after: after.map(Arc::new),
            source: SourceInfo {
                connector: Some(self.connector.clone()),
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

/// Builds a row of `info`'s relation from a tuple; unchanged TOAST values come from `full_old`
/// when given, and are an error otherwise (the value was not sent).
fn row(info: &RelationInfo, tuple: &Tuple, full_old: Option<&Tuple>) -> Result<Row, String> {
    let shape = &info.shape;
    if tuple.len() != shape.columns.len() {
        return Err(format!(
            "{} values for {} columns",
            tuple.len(),
            shape.columns.len()
        ));
    }
    let text = |column: &pgoutput::Column, bytes: &[u8]| -> Result<Value, String> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| format!("column `{}` is not UTF-8", column.name))?;
        text_to_json(column.type_oid, text).map_err(|e| format!("column `{}`: {e}", column.name))
    };
    info.rows.build(|i| {
        let column = &shape.columns[i];
        match &tuple[i] {
            Datum::Null => Ok(Value::Null),
            Datum::Text(bytes) => text(column, bytes),
            Datum::Binary(_) => Err(format!("column `{}` arrived in binary format", column.name)),
            Datum::UnchangedToast => match full_old.and_then(|t| t.get(i)) {
                Some(Datum::Text(bytes)) => text(column, bytes),
                // Leaving the column out would erase it from the read model: refuse loudly.
                _ => Err(format!(
                    "column `{}` is an unchanged TOASTed value that PostgreSQL did not send; \
                     set REPLICA IDENTITY FULL on the table (merging with the last known value is not built yet)",
                    column.name
                )),
            },
        }
    })
}

/// How the rows of one column list are built: every row shares the column names (sorted, as a
/// [`Row`] keeps them) and takes its values in that order.
pub(super) struct RowShape {
    /// Type OIDs of the columns converted (as many as both the names and types given).
    types: Vec<u32>,
    /// The names, sorted, each once.
    columns: Columns,
    /// For each column converted, where its value goes among `columns` (`None` for a name given
    /// again later: the last of equal names is kept, as building a map from the pairs does).
    slots: Vec<Option<usize>>,
    /// For each of `columns`, the column its value comes from; `None` when a name is given twice.
    sorted: Option<Vec<usize>>,
    /// The key columns found among the columns, sorted (as a key image would iterate them);
    /// `None` without any. Every event of the shape shares them: `after` holds their values.
    key_columns: Option<Arc<[String]>>,
}

impl RowShape {
    /// The shape of rows with `columns` of `types` (extra names or types are ignored, as
    /// zipping them does) and key columns `key`.
    pub(super) fn new(columns: &[String], types: &[u32], key: &[String]) -> Self {
        let count = columns.len().min(types.len());
        let mut index: std::collections::BTreeMap<&str, usize> = Default::default();
        for (i, column) in columns[..count].iter().enumerate() {
            index.insert(column, i);
        }
        let names: Columns = index.keys().map(|c| (*c).to_owned()).collect();
        let mut slots = vec![None; count];
        for (j, &i) in index.values().enumerate() {
            slots[i] = Some(j);
        }
        let sorted = (index.len() == count).then(|| index.values().copied().collect());
        let key_columns: std::collections::BTreeSet<&String> = key
            .iter()
            .filter(|c| index.contains_key(c.as_str()))
            .collect();
        let key_columns =
            (!key_columns.is_empty()).then(|| key_columns.into_iter().cloned().collect());
        Self {
            types: types[..count].to_vec(),
            columns: names,
            slots,
            sorted,
            key_columns,
        }
    }

    /// New copies of the shared names: the events of the previous chunk are dropped on another
    /// thread, and one reference count written by both would bounce between them.
    pub(super) fn renew(&mut self) {
        self.key_columns = self.key_columns.as_deref().map(Arc::from);
        self.columns = self.columns.renewed();
    }

    /// The row of the values `value` gives for each column converted (as [`Self::types`]),
    /// asked for in column order; the first error ends it.
    pub(super) fn build(
        &self,
        mut value: impl FnMut(usize) -> Result<Value, String>,
    ) -> Result<Row, String> {
        // Every column in its own place (the usual case): the values made in the row's order,
        // straight into their vector. After an error, the column order below finds the first bad
        // column.
        if let Some(sorted) = &self.sorted {
            // Sized once: collecting results would start small and grow the vector per row.
            let mut values = Vec::with_capacity(sorted.len());
            for &i in sorted {
                match value(i) {
                    Ok(v) => values.push(v),
                    Err(_) => break,
                }
            }
            if values.len() == sorted.len() {
                return Ok(Row::from_columns(self.columns.clone(), values));
            }
        }
        let mut values = vec![Value::Null; self.columns.len()];
        for (i, slot) in self.slots.iter().enumerate() {
            let v = value(i)?;
            if let Some(j) = slot {
                values[*j] = v;
            }
        }
        Ok(Row::from_columns(self.columns.clone(), values))
    }
}

/// An emptied vector of fields, its allocation kept for fields of another lifetime.
#[inline(always)]
fn recycle<'b>(mut fields: Vec<Option<Cow<'_, str>>>) -> Vec<Option<Cow<'b, str>>> {
    fields.clear();
    // Same size and alignment: collected in place, without allocating.
    fields.into_iter().map(|_| None).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row and key as built before [`RowShape`]: pairs collected into a map (the last of
    /// equal names wins), the key taken from the row.
    fn by_pairs(columns: &[String], types: &[u32], key: &[String], values: &[Value]) -> (Row, Row) {
        let row: Row = columns
            .iter()
            .zip(types)
            .zip(values)
            .map(|((c, _), v)| (c.clone(), v.clone()))
            .collect();
        let key = key
            .iter()
            .filter_map(|c| row.get(c).map(|v| (c.clone(), v.clone())))
            .collect();
        (row, key)
    }

    #[test]
    fn shaped_rows_match_rows_built_from_pairs() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cases: Vec<(Vec<String>, Vec<u32>, Vec<String>)> = vec![
            (
                names(&["id", "name", "qty"]),
                vec![23, 25, 23],
                names(&["id"]),
            ),
            (
                names(&["z", "a", "m", "b"]),
                vec![25; 4],
                names(&["m", "a"]),
            ),
            // Equal names: the last one's value.
            (names(&["a", "b", "a"]), vec![25; 3], names(&["a"])),
            // Fewer types than names: the extra columns are left out.
            (names(&["a", "b", "c"]), vec![25; 2], names(&["c", "a"])),
            // No key, a key column that is not a column, a repeated key column.
            (names(&["a", "b"]), vec![25; 2], names(&[])),
            (names(&["a", "b"]), vec![25; 2], names(&["x", "b", "b"])),
        ];
        for (columns, types, key) in cases {
            let values: Vec<Value> = (0..columns.len()).map(|i| Value::from(i as u64)).collect();
            let shape = RowShape::new(&columns, &types, &key);
            let row = shape.build(|i| Ok(values[i].clone())).unwrap();
            let (want_row, want_key) = by_pairs(&columns, &types, &key, &values);
            assert_eq!(row, want_row, "{columns:?} {types:?}");
            // The key an event of this shape names is the key that was built from the pairs.
            let event = ChangeEvent {
                table: TableId::new("public", "t"),
                op: Op::Read,
                key: None,
                key_columns: shape.key_columns.clone(),
                before: None,
                after: Some(Arc::new(row.clone())),
                source: SourceInfo::default(),
                transaction: None,
                position: Position {
                    partition: "p".into(),
                    offset: Offset(1, 1),
                },
            };
            let named: Vec<&Value> = event
                .key_values(&row)
                .map(|k| k.expect("key columns present"))
                .unwrap_or_default();
            assert_eq!(
                named,
                want_key.values().collect::<Vec<_>>(),
                "{columns:?} {key:?}"
            );
            assert!(want_key.keys().all(|k| event.is_key_column(k)));
        }
    }

    #[test]
    fn the_first_bad_column_in_column_order_is_reported() {
        let names = ["z", "m", "a"].map(String::from);
        let shape = RowShape::new(&names, &[25; 3], &[]);
        let failing = |bad: &[usize]| {
            shape.build(|i| {
                if bad.contains(&i) {
                    Err(format!("column `{}`", names[i]))
                } else {
                    Ok(Value::from(i))
                }
            })
        };
        assert_eq!(failing(&[0, 2]), Err("column `z`".into()));
        assert_eq!(failing(&[1, 2]), Err("column `m`".into()));
        let row = failing(&[]).unwrap();
        assert_eq!(row.keys().collect::<Vec<_>>(), ["a", "m", "z"]);
        assert_eq!(row["z"], Value::from(0));
    }

    #[test]
    fn recycled_fields_keep_their_room() {
        let line = String::from("a");
        let mut fields: Vec<Option<Cow<'_, str>>> = Vec::with_capacity(8);
        fields.push(Some(Cow::Borrowed(&line)));
        let fields: Vec<Option<Cow<'static, str>>> = recycle(fields);
        assert!(fields.is_empty());
        assert!(fields.capacity() >= 8);
    }
}

/// Whether an update's new row has unchanged TOASTed values its old row does not hold, which
/// must be read again from the table.
fn needs_refetch(old: &Option<(OldKind, pgoutput::Tuple)>, new: &[Datum]) -> bool {
    let full_old = old.as_ref().is_some_and(|(k, _)| *k == OldKind::Full);
    !full_old && new.iter().any(|d| matches!(d, Datum::UnchangedToast))
}
