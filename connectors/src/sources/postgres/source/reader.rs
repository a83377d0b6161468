//! The stream's life: reading the replication stream, reconnecting with backoff (and when the
//! stream stays silent past its read deadline), checking the slot and keeping an idle stream
//! talking on the control connection, confirming the final position.

use super::*;

impl Reader {
    pub(super) async fn run(
        mut self,
        mut replication: ReplicationClient,
        out: Chunks,
        mut durable: watch::Receiver<Checkpoint>,
        mut stop: watch::Receiver<bool>,
    ) {
        // The initial snapshot goes before the stream; a backfill's where the stream reaches it.
        if self
            .copy
            .as_ref()
            .is_some_and(|c| c.kind == snapshot::CopyKind::Snapshot)
        {
            match self.read_pending_copy(&out, &stop).await {
                Ok(true) => {}
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
        // A backfill asked of the daemon before it started, or interrupted by its stop.
        if self.takes_requests {
            let request = match snapshot::BackfillRequest::pending(&self.state_dir) {
                Ok(Some(request)) => Some(request),
                Ok(None) => snapshot::BackfillRequest::interrupted(&self.state_dir),
                Err(e) => {
                    tracing::warn!(error = %e, "backfill request ignored");
                    None
                }
            };
            if let Some(request) = request {
                self.take_backfill(request).await;
            }
        }
        let mut failures = 0u32;
        let result = loop {
            let started = Instant::now();
            let ended = self
                .stream(&mut replication, &out, &mut durable, &mut stop)
                .await;
            match &ended {
                Ok(Ended::Done) => {}
                // A connection that is gone (or silent) owes no goodbye.
                Ok(Ended::Lost(_)) => replication.abort(),
                Err(_) => replication.stop(),
            }
            let mut reason = match ended {
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
            self.health.reconnecting(&reason);
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
                    Err(e) => {
                        reason = e.to_string();
                        self.health.reconnecting(&reason);
                    }
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

    /// Reads the exported snapshot waiting to be read, if any. Returns false when stopped on
    /// request (the next start resumes).
    async fn read_pending_copy(
        &mut self,
        out: &Chunks,
        stop: &watch::Receiver<bool>,
    ) -> Result<bool, SourceError> {
        let Some(copy) = self.copy.take() else {
            return Ok(true);
        };
        let (lsn, kind) = (copy.lsn, copy.kind);
        self.flush(out).await?;
        if !self.read_copy(copy, out, stop).await? {
            return Ok(false);
        }
        match self.copy_end_after(lsn) {
            // Complete once the last row is durable (see the durable branch).
            Some(last) => self.copy_ends.push((last, kind)),
            // No rows: complete now.
            None => snapshot::resume_copy_kind(kind, &self.state_dir, Some(Offset(lsn + 1, 0)))?,
        }
        Ok(true)
    }

    /// Takes a backfill `refract backfill` asked for: plans it under the request's id and
    /// exports a snapshot whose rows go into the stream where it reaches the snapshot's
    /// consistent point (see [`snapshot::BackfillRequest`]). A failure is recorded for the
    /// asking process; the stream goes on.
    async fn take_backfill(&mut self, request: snapshot::BackfillRequest) {
        let busy = self.copy.is_some()
            || self
                .copy_ends
                .iter()
                .any(|(_, kind)| *kind == snapshot::CopyKind::Backfill);
        if busy {
            tracing::info!(request = %request.id, "a backfill is under way: the request is taken once its rows are durable");
            return;
        }
        tracing::info!(request = %request.id, tables = ?request.tables, "backfill requested: reading it from an exported snapshot");
        let path = PostgresSource::backfill_progress_path(&self.state_dir);
        let taken = async {
            let chunker = Chunker::prepare(
                self.url.expose(),
                &self.publication,
                &self.slot,
                self.chunk_rows,
                path,
                &request.tables,
                request.restart,
            )
            .await?
            .for_request(&request.id)?;
            snapshot::BackfillRequest::withdraw(&self.state_dir)?;
            let progress = chunker.progress();
            let (tables, scope) = chunker.into_plan();
            let copy = snapshot::export_for_backfill(
                &self.replication_config,
                self.url.expose(),
                &self.slot,
                snapshot::CopyPlan {
                    publication: &self.publication,
                    state_dir: &self.state_dir,
                    tables: Some(tables),
                    scope,
                    progress,
                    request: Some(request.id.clone()),
                },
            )
            .await?;
            // A message past the consistent point, so an idle stream reaches it at once.
            self.bounded(async {
                emit_message(&self.catalog, &self.request_prefix, "")
                    .await
                    .map_err(|e| e.to_string())
            })
            .await
            .map_err(|message| SourceError::Io {
                message,
                source: None,
            })?;
            Ok::<_, SourceError>(copy)
        }
        .await;
        match taken {
            Ok(copy) => self.copy = Some(copy),
            Err(e) => {
                tracing::error!(request = %request.id, error = %e, "cannot read the requested backfill");
                if let Err(e) = request.fail(&self.state_dir, &e.to_string()) {
                    tracing::error!(error = %e, "cannot record the backfill's failure");
                }
            }
        }
    }

    /// A request message: takes the request it names if that is the one waiting.
    async fn requested(&mut self, id: &[u8]) {
        if !self.takes_requests || id.is_empty() {
            return;
        }
        match snapshot::BackfillRequest::pending(&self.state_dir) {
            Ok(Some(request)) if request.id.as_bytes() == id => self.take_backfill(request).await,
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "backfill request ignored"),
        }
    }

    /// The position of the last row the copy at `lsn` handed out, if any did.
    fn copy_end_after(&self, lsn: u64) -> Option<Offset> {
        self.last_sent.filter(|o| o.0 == lsn)
    }

    /// Whether the stream has reached the point where a backfill's snapshot rows go: `at` is the
    /// commit LSN of the next transaction, or a position the stream has passed with no
    /// transaction open.
    fn backfill_due(&self, at: u64) -> bool {
        self.copy
            .as_ref()
            .is_some_and(|c| c.kind == snapshot::CopyKind::Backfill && at > c.lsn)
    }

    /// Waits (a bounded time) for the runtime's final checkpoint to cover everything handed
    /// out, reports it to the server and waits until the slot shows it, so a run that ends does
    /// not leave the slot behind its checkpoint (retaining WAL until the next run).
    pub(super) async fn confirm_final(
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
            let target_text = Lsn::from_u64(target).to_string();
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
                [&self.slot, &target_text];
            let confirmed = self.catalog.query_opt(
                "SELECT (confirmed_flush_lsn >= $2::text::pg_lsn) FROM pg_replication_slots WHERE slot_name = $1",
                &params,
            );
            match tokio::time::timeout_at(deadline, confirmed).await {
                Ok(Ok(Some(row))) if row.get::<_, Option<bool>>(0) == Some(true) => return,
                Ok(Ok(Some(_))) => tokio::time::sleep(FINAL_CONFIRM_POLL).await,
                _ => return,
            }
        }
    }

    /// A new control connection and replication stream, resuming after the last item handed
    /// out (or the checkpoint, when nothing was).
    pub(super) async fn reconnect(&mut self) -> Result<ReplicationClient, SourceError> {
        self.catalog = connect(self.url.expose()).await?;
        self.tx = None;
        self.chunk.clear();
        self.hand_over_at = None;
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

    /// Reads the stream until it ends: hands out its changes in chunks, confirms to the slot
    /// what the runtime reports durable, checks the slot now and then.
    pub(super) async fn stream(
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
        let mut liveness = Liveness::new(self.read_timeout, self.heard, Instant::now());
        let mut deadline = tokio::time::interval(Liveness::tick_period(self.read_timeout));
        deadline.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
                    if let Some(durable_at) = durable_at {
                        in_flight_free = self.durable_advanced(replication, durable_at).await?;
                    }
                    // Taking a backfill may have kept the stream unread a while.
                    liveness.busy_until(Instant::now());
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
                _ = deadline.tick() => {
                    match self.deadline_tick(&mut liveness).await {
                        Some(ended) => return Ok(ended),
                        None => continue,
                    }
                }
                () = async {
                    match self.hand_over_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.flush(out).await?;
                    continue;
                }
                event = replication.recv() => event,
            };
            let event = match event {
                Ok(event) => event,
                Err(e) => return Ok(Ended::Lost(e.to_string())),
            };
            self.heard = self.heard.wrapping_add(1);
            let Some(event) = event else {
                self.flush(out).await?;
                return Ok(Ended::Done);
            };
            if self.reaches_backfill(&event) {
                if !self.read_pending_copy(out, stop).await? {
                    return Ok(Ended::Done);
                }
                in_flight_free = false;
            }
            // Row changes, nearly every event of a backlog, are handled here, without an async
            // step when they need no catalog look-up: going through `event` (or any async step)
            // builds a future per change, which callgrind counted at 1-2% of a drain's
            // instructions. A failed catalog look-up ends the stream (the control connection is
            // gone too).
            let ended = match event {
                ReplicationEvent::XLogData { data, .. } if self.data_now(&data) => None,
                ReplicationEvent::XLogData { data, .. } => self.data_looked_up(data).await,
                event => {
                    self.event(event, replication, out, &mut in_flight_free)
                        .await?
                }
            };
            if let Some(ended) = ended {
                return Ok(ended);
            }
            if self.chunk.len() >= CHUNK_EVENTS {
                self.flush(out).await?;
            }
        }
    }

    /// The runtime reports `durable_at` durable: confirms it to the slot, completes the reads
    /// whose every row is durable (taking a backfill request that waited for one). Returns
    /// whether nothing handed out is in flight any more.
    async fn durable_advanced(
        &mut self,
        replication: &ReplicationClient,
        durable_at: Offset,
    ) -> Result<bool, SourceError> {
        let Offset(lsn, seq) = durable_at;
        replication.update_applied_lsn(Lsn::from_u64(if seq == u64::MAX { lsn + 1 } else { lsn }));
        let unsent = !self.chunk.is_empty();
        let mut in_flight_free =
            nothing_in_flight(durable_at, self.tx.is_some(), unsent, self.last_sent);
        self.resumed_from = Some(durable_at);
        // Reads whose every row is durable are complete.
        let mut backfilled = false;
        for (end, kind) in &self.copy_ends {
            if durable_at >= *end {
                snapshot::resume_copy_kind(*kind, &self.state_dir, Some(durable_at))?;
                backfilled |= *kind == snapshot::CopyKind::Backfill;
                // The read's last row was the last thing handed out: with it durable, nothing
                // is in flight, so an idle stream lets the slot follow the server (or the slot
                // would stay at the snapshot until the next change of a published table).
                in_flight_free |= Some(*end) == self.last_sent
                    && self.tx.is_none()
                    && !unsent
                    && self.copy.is_none();
            }
        }
        self.copy_ends.retain(|(end, _)| durable_at < *end);
        // A request that came while that backfill was under way.
        if backfilled && self.takes_requests {
            if let Ok(Some(request)) = snapshot::BackfillRequest::pending(&self.state_dir) {
                self.take_backfill(request).await;
            }
        }
        Ok(in_flight_free)
    }

    /// Whether `event` is where the rows of a backfill's snapshot go. The snapshot holds every
    /// transaction committed before its consistent point and none after: its rows go before the
    /// first transaction at or past it.
    fn reaches_backfill(&self, event: &ReplicationEvent) -> bool {
        let reached = match event {
            ReplicationEvent::Begin { final_lsn, .. } => Some(final_lsn.as_u64()),
            ReplicationEvent::Message { lsn, .. } if self.tx.is_none() => Some(lsn.as_u64()),
            ReplicationEvent::KeepAlive { wal_end, .. } if self.tx.is_none() => {
                Some(wal_end.as_u64())
            }
            _ => None,
        };
        reached.is_some_and(|at| self.backfill_due(at))
    }

    /// Handles one event of the stream; returns why the stream ends when it does.
    async fn event(
        &mut self,
        event: ReplicationEvent,
        replication: &ReplicationClient,
        out: &Chunks,
        in_flight_free: &mut bool,
    ) -> Result<Option<Ended>, SourceError> {
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
                    was_free: *in_flight_free,
                });
                *in_flight_free = false;
            }
            ReplicationEvent::XLogData { data, .. } => return Ok(self.data_looked_up(data).await),
            ReplicationEvent::Commit { .. } => self.commit(in_flight_free)?,
            ReplicationEvent::Message {
                prefix,
                lsn,
                transactional,
                content,
            } => {
                if transactional && prefix == self.rows_prefix && self.tx.is_some() {
                    self.rows(&content);
                } else if !transactional && prefix == self.request_prefix && self.tx.is_none() {
                    self.requested(&content).await;
                } else if prefix == CAUGHT_UP_PREFIX
                    && matches!(self.caught_up, CaughtUp::At(at) if lsn.as_u64() >= at)
                    && self.tx.is_none()
                {
                    tracing::info!(lsn = %lsn, "caught up with the slot");
                    self.flush(out).await?;
                    return Ok(Some(Ended::Done));
                }
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Nothing in flight and everything handed out is durable: let the slot
                // follow the server, so WAL of unrelated traffic is not retained for us.
                if *in_flight_free && self.tx.is_none() && self.chunk.is_empty() {
                    replication.update_applied_lsn(wal_end);
                }
            }
            ReplicationEvent::StoppedAt { .. } => {
                self.flush(out).await?;
                return Ok(Some(Ended::Done));
            }
        }
        Ok(None)
    }

    /// A COMMIT: ends the transaction with its COMMIT marker, handed out within
    /// `COMMIT_HAND_OVER_DELAY`, or forgets it when nothing of it was for this pipeline.
    fn commit(&mut self, in_flight_free: &mut bool) -> Result<(), SourceError> {
        let Some(tx) = self.tx.take() else {
            return Err(SourceError::Inconsistent(
                "COMMIT without BEGIN in the replication stream".into(),
            ));
        };
        if tx.seq == 0 {
            *in_flight_free = tx.was_free;
        } else {
            self.marker(TxStatus::End, Offset(tx.lsn, u64::MAX), &tx);
            self.last_commit = Some(tx.lsn);
            // Handed out with the transactions committed in the next moment, if any (see
            // `COMMIT_HAND_OVER_DELAY`).
            self.hand_over_at
                .get_or_insert_with(|| tokio::time::Instant::now() + COMMIT_HAND_OVER_DELAY);
        }
        Ok(())
    }

    /// Measures the slot's retained WAL and lag; warns when it holds back more WAL than allowed;
    /// stops when it was invalidated.
    pub(super) async fn check_slot(&mut self) -> Result<(), SourceError> {
        let query = self.bounded(async {
            self.catalog
                .query_opt(
                    "SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8, \
                            coalesce(wal_status, ''), \
                            coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8 \
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .map_err(|e| error_text(&e))
        });
        let row = match query.await {
            Ok(row) => row,
            Err(e) => {
                self.control_failed("cannot check the slot", &e).await;
                return Ok(());
            }
        };
        self.health.check_passed();
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
        self.metrics.retained_wal(retained);
        self.metrics.lag(row.get::<_, i64>(2).max(0) as u64);
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

    /// [`Self::flush`], marking the chunk as the end of a snapshot or backfill read (see
    /// [`Self::ends_at`]); marked before it is sent, so the runtime sees the mark with it.
    pub(super) async fn flush_ending(&mut self, out: &Chunks) -> Result<(), SourceError> {
        if !self.chunk.is_empty() {
            self.ends_at.store(self.flushes + 1, Ordering::Release);
        }
        self.flush(out).await
    }

    pub(super) async fn flush(&mut self, out: &Chunks) -> Result<(), SourceError> {
        self.hand_over_at = None;
        if self.chunk.is_empty() {
            return Ok(());
        }
        // The next chunk starts with room for as many items as this one (a snapshot's chunks
        // are all full): no regrowing of a vector of large items.
        let capacity = self.chunk.len().min(CHUNK_EVENTS);
        let chunk = std::mem::replace(&mut self.chunk, Vec::with_capacity(capacity));
        self.last_sent = chunk.last().map(|item| match &item.record {
            Ok(record) => record.position().offset,
            Err(e) => e.position.offset,
        });
        out.send(Ok(chunk))
            .await
            .map_err(|_| SourceError::Inconsistent("the runtime stopped reading".into()))?;
        self.flushes += 1;
        // The next chunk's events share new copies of the names every event carries: the
        // runtime drops this chunk's references on another thread while this one makes the
        // next chunk's, and one reference count written by both would bounce between them.
        self.partition = Arc::from(&*self.partition);
        self.connector = Arc::from(&*self.connector);
        self.db = self.db.as_deref().map(Arc::from);
        Ok(())
    }
}

/// Whether nothing handed out is still in flight once `durable` is: a transaction's end is
/// durable, none is open, nothing read waits to be handed out (`unsent`: committed
/// transactions wait up to `COMMIT_HAND_OVER_DELAY`), and nothing was handed out after it
/// (`last_sent`). The rows of a snapshot read into the stream come after the last commit: that
/// commit being durable is not enough, or the slot would confirm the transactions after them
/// before the rows are durable (and a crash would then lose those transactions).
fn nothing_in_flight(
    durable: Offset,
    tx_open: bool,
    unsent: bool,
    last_sent: Option<Offset>,
) -> bool {
    durable.1 == u64::MAX && !tx_open && !unsent && last_sent.is_none_or(|sent| durable >= sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_is_free_only_when_everything_handed_out_is_durable() {
        let end = |lsn| Offset(lsn, u64::MAX);
        // Streaming: the last transaction handed out is durable.
        assert!(nothing_in_flight(end(100), false, false, Some(end(100))));
        assert!(nothing_in_flight(end(100), false, false, None));
        // An earlier one only, or one still open.
        assert!(!nothing_in_flight(end(90), false, false, Some(end(100))));
        assert!(!nothing_in_flight(end(100), true, false, Some(end(100))));
        // Inside a huge transaction cut into batches.
        assert!(!nothing_in_flight(
            Offset(100, 7),
            false,
            false,
            Some(Offset(100, 7))
        ));
        // A backfill's rows at (C - 1, …) handed out after the transaction at 100: its end being
        // durable leaves the rows in flight; so does the rows' own progress.
        let last_row = Offset(199, snapshot::CopySnapshot::seq(0, 5_000));
        assert!(!nothing_in_flight(end(100), false, false, Some(last_row)));
        assert!(!nothing_in_flight(last_row, false, false, Some(last_row)));
        // The first transaction after the rows, durable: free again.
        assert!(nothing_in_flight(end(250), false, false, Some(end(250))));
        // Transactions committed after it, read and not yet handed out: in flight.
        assert!(!nothing_in_flight(end(250), false, true, Some(end(250))));
    }
}
