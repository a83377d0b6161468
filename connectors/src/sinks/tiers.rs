//! `kind = "tiers"`: heartbeats into the hot (Redis), warm (PostgreSQL) and cold (Parquet) tiers
//! a `tiers` projection routed them to. The layouts are in [`crate::tiers`].
//!
//! A batch is applied to the three stores at once: warm (one transaction), cold (late heartbeats
//! merged into their device's day under the cold lock, taken on a connection of its own) and hot
//! (pipelined). The stores are independent, so the batch takes the longest of the three, not
//! their sum. Every step is idempotent, so a failure anywhere fails the batch, which the runtime
//! retries whole: a Redis outage or a PostgreSQL restart delays the tiers and loses nothing.
//! Batches follow one another, so a heartbeat's writes keep their order in every tier.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use futures::{StreamExt, TryFutureExt, TryStreamExt};
use object_store::ObjectStore;
use object_store::path::Path;
use refract_schemas::Checkpoint;
use refract_schemas::config::TierLayout;
use refract_schemas::write::OpFamily;
use refract_schemas::write::tiers::{Heartbeat, Tier, TierAction, TierWrite};

use crate::sinks::local_files::{LocalStore, SyncSet};
use crate::sinks::object_json::open_store_unsynced;
use crate::sinks::postgres::classify;
use crate::sinks::redis::connection::{Connector, error as redis_error};
use crate::tiers::{cold, hot, warm};
use crate::{Intake, Sink, SinkBatch, SinkError, WriteReport};

/// What the tiers sink accepts: tier writes.
type Accepted<'a> = &'a TierWrite;

/// Hot-tier commands per pipelined round trip: large enough to hide the round trip, small
/// enough that one request stays under a few MiB.
const HOT_COMMANDS_PER_PIPELINE: usize = 10_000;
/// Device-days of late heartbeats rewritten at once: object stores answer each request in
/// milliseconds, so some must be in flight together.
const COLD_CONCURRENCY: usize = 16;
/// SQLSTATE of an insert into a range no partition covers (an aging run detached it meanwhile).
const NO_PARTITION: &str = "23514";
/// Batches written with the upsert straight away after one whose COPY met rows already stored:
/// a replay after a crash re-sends several batches in a row, and each failed COPY is work
/// thrown away; after these the sink tries COPY again.
const UPSERT_BATCHES_AFTER_FALLBACK: u32 = 8;

/// The tiers sink.
pub struct TiersSink {
    name: String,
    layout: Option<TierLayout>,
    redis: Option<Connector>,
    warm: Option<tokio_postgres::Client>,
    cold: Option<ColdTier>,
    /// Hours whose warm partition is known to exist.
    partitions: BTreeSet<i64>,
    /// Batches still to write with the upsert rather than COPY (see
    /// [`UPSERT_BATCHES_AFTER_FALLBACK`]).
    upserts_left: u32,
}

impl TiersSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A sink named `name` for `layout` (`None` when no valid tiers projection writes to it,
    /// which `refract validate` refuses); nothing is connected before [`Sink::open`].
    pub fn new(name: &str, layout: Option<TierLayout>) -> Self {
        Self {
            name: name.to_owned(),
            layout,
            redis: None,
            warm: None,
            cold: None,
            partitions: BTreeSet::new(),
            upserts_left: 0,
        }
    }

    fn permanent(&self, message: String) -> SinkError {
        permanent(&self.name, message)
    }

    fn layout(&self) -> Result<&TierLayout, SinkError> {
        self.layout
            .as_ref()
            .ok_or_else(|| self.permanent("no valid `tiers` projection writes to this sink".into()))
    }

    /// A warm-tier failure; a transient one drops the connection.
    fn warm_error(&mut self, what: &str, e: tokio_postgres::Error) -> SinkError {
        let error = classify(&self.name, format!("warm tier: {what}"), e);
        if error.is_retryable() {
            self.warm = None;
            self.partitions.clear();
        }
        error
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        let layout = self.layout()?.clone();
        if self.redis.is_none() {
            let client =
                crate::tiers::hot_client(&layout).map_err(|e| self.permanent(e.to_string()))?;
            self.redis = Some(Connector::single(client));
        }
        if self.cold.is_none() {
            self.cold = Some(ColdTier::open(&self.name, &layout)?);
        }
        if self.warm.as_ref().is_none_or(|c| c.is_closed()) {
            self.partitions.clear();
            let client = match crate::tiers::connect_warm(&layout).await {
                Ok(c) => c,
                Err(crate::tiers::TierError::Warm(what, e)) => {
                    return Err(self.warm_error(&what, e));
                }
                Err(e) => return Err(self.permanent(e.to_string())),
            };
            if let Err(e) = warm::create(&client, &layout).await {
                return Err(self.warm_error("cannot create the warm table", e));
            }
            match warm::partitions(&client, &layout).await {
                Ok(held) => self
                    .partitions
                    .extend(held.into_iter().map(|(_, hour)| hour)),
                Err(e) => return Err(self.warm_error("cannot list the warm partitions", e)),
            }
            self.warm = Some(client);
        }
        Ok(())
    }

    /// Applies the batch's warm writes in one transaction (see [`warm::apply`]: COPY, or the
    /// upsert when rows are already stored), creating the partitions they and the next
    /// `partitions_ahead` hours need.
    async fn write_warm(&mut self, ops: &[&TierWrite]) -> Result<warm::Applied, SinkError> {
        let layout = self.layout()?.clone();
        let mut last: warm::Final = Default::default();
        let mut hours = BTreeSet::new();
        for op in ops.iter().filter(|op| op.tier == Tier::Warm) {
            let h = &op.heartbeat;
            let put = op.action == TierAction::Put;
            last.insert((h.device_id.as_str(), h.ts_micros), put.then_some(&**h));
            if put {
                hours.insert(warm::hour_of(h.ts_micros));
            }
        }
        if let Some(clock) = ops.iter().map(|op| op.clock_micros).max() {
            let now = warm::hour_of(clock);
            hours.extend(
                (0..=i64::from(layout.stores.warm.partitions_ahead))
                    .map(|i| now + i * warm::HOUR_MICROS),
            );
        }
        if last.is_empty() && hours.is_subset(&self.partitions) {
            return Ok(warm::Applied::Upserted);
        }
        for attempt in 0..2 {
            let missing: BTreeSet<i64> = hours.difference(&self.partitions).copied().collect();
            let copy = self.upserts_left == 0;
            let client = self
                .warm
                .as_mut()
                .ok_or_else(|| SinkError::not_open("tiers"))?;
            let result = async {
                warm::ensure_partitions(client, &layout, &missing).await?;
                warm::apply(client, &layout, &last, copy).await
            }
            .await;
            match result {
                Ok(applied) => {
                    self.partitions.extend(missing);
                    self.upserts_left = match applied {
                        warm::Applied::FellBack => UPSERT_BATCHES_AFTER_FALLBACK,
                        warm::Applied::Copied => 0,
                        warm::Applied::Upserted => self.upserts_left.saturating_sub(1),
                    };
                    return Ok(applied);
                }
                // An aging run detached a partition this sink thought was there: make it again.
                Err(e) if attempt == 0 && e.code().is_some_and(|c| c.code() == NO_PARTITION) => {
                    self.partitions.clear();
                }
                Err(e) => return Err(self.warm_error("cannot write heartbeats", e)),
            }
        }
        Err(self.permanent("warm tier: a partition kept disappearing".into()))
    }
}

/// The cold tier: its object store and root, and the connection that holds the cold lock while
/// a batch writes (its own, so that cold is written while the warm transaction runs).
struct ColdTier {
    store: Arc<dyn ObjectStore>,
    root: Path,
    /// On `file://`, what makes a batch's files durable together: a batch of late heartbeats
    /// writes a file per device and day, often thousands, and syncing each as it is written
    /// (with its new directories) took most of the batch's time.
    local: Option<LocalStore>,
    lock: Option<tokio_postgres::Client>,
}

impl ColdTier {
    fn open(sink: &str, layout: &TierLayout) -> Result<Self, SinkError> {
        let url = &layout.stores.cold.url;
        let refused =
            |what: String| permanent(sink, format!("cold tier `{}`: {what}", url.masked()));
        let (store, root) = open_store_unsynced(url.expose()).map_err(refused)?;
        let local = LocalStore::for_url(url.expose(), &root)
            .transpose()
            .map_err(|e| refused(e.to_string()))?;
        if let Some(local) = &local {
            local.create_root().map_err(|e| SinkError::Transient {
                sink: sink.to_owned(),
                message: format!("cold tier: cannot create {root}"),
                source: Some(Box::new(e)),
            })?;
        }
        Ok(Self {
            store,
            root,
            local,
            lock: None,
        })
    }

    /// Merges the batch's cold heartbeats into the late files of their devices' days, under the
    /// cold lock that aging takes too.
    async fn write(
        &mut self,
        sink: &str,
        layout: &TierLayout,
        ops: &[&TierWrite],
    ) -> Result<(), SinkError> {
        let mut days: BTreeMap<(&str, String), Vec<&Heartbeat>> = BTreeMap::new();
        for op in ops
            .iter()
            .filter(|op| op.tier == Tier::Cold && op.action == TierAction::Put)
        {
            let h = &*op.heartbeat;
            days.entry((h.device_id.as_str(), cold::day_of(h.ts_micros)))
                .or_default()
                .push(h);
        }
        if days.is_empty() {
            return Ok(());
        }
        let client = self.lock_client(sink, layout).await?;
        let locked = client
            .batch_execute(&crate::tiers::cold_lock_sql(layout, true))
            .await;
        self.give_back(sink, "cannot take the cold lock", client, locked)?;
        let written = self.write_days(layout, &days).await;
        // A connection lost while the files were written released the lock under them: the
        // batch fails and is written again under a new one.
        let Some(client) = self.lock.take().filter(|c| !c.is_closed()) else {
            return Err(SinkError::Transient {
                sink: sink.to_owned(),
                message: "cold tier: the cold lock's connection was lost while writing".into(),
                source: None,
            });
        };
        let unlocked = client
            .batch_execute(&crate::tiers::cold_lock_sql(layout, false))
            .await;
        let unlocked = self.give_back(sink, "cannot release the cold lock", client, unlocked);
        match written {
            Err(cold::ColdError::Store(e)) => Err(crate::sinks::object_json::classify(
                sink,
                "cold tier: cannot write late heartbeats".into(),
                e,
            )),
            Err(e @ cold::ColdError::Corrupt(..)) => {
                Err(permanent(sink, format!("cold tier: {e}")))
            }
            Ok(_) => unlocked,
        }
    }

    /// Merges each day's heartbeats into its late file, then (on `file://`) makes the files
    /// written durable together.
    async fn write_days(
        &mut self,
        layout: &TierLayout,
        days: &BTreeMap<(&str, String), Vec<&Heartbeat>>,
    ) -> Result<(), cold::ColdError> {
        let (store, root) = (self.store.as_ref(), &self.root);
        let columns = &layout.heartbeats.columns;
        let writes: Vec<_> = days
            .iter()
            .map(|((device, day), rows)| {
                let path = cold::day_dir(root, device, day).join(cold::LATE_FILE);
                cold::write_late(store, root, columns, rows)
                    .map_ok(move |merged| (merged > 0).then_some(path))
            })
            .collect();
        let written: Vec<Option<Path>> = futures::stream::iter(writes)
            .buffer_unordered(COLD_CONCURRENCY)
            .try_collect()
            .await?;
        let Some(local) = &mut self.local else {
            return Ok(());
        };
        let mut set = SyncSet::default();
        for path in written.iter().flatten() {
            set.written(local.file(path)?);
        }
        local.sync(set).await.map_err(|e| {
            cold::ColdError::Store(object_store::Error::Generic {
                store: "LocalFileSystem",
                source: Box::new(e),
            })
        })
    }

    /// The cold lock's connection, taken out to be used and given back with
    /// [`Self::give_back`]; opened when first needed and again after it failed.
    async fn lock_client(
        &mut self,
        sink: &str,
        layout: &TierLayout,
    ) -> Result<tokio_postgres::Client, SinkError> {
        if let Some(client) = self.lock.take().filter(|c| !c.is_closed()) {
            return Ok(client);
        }
        crate::tiers::connect_warm(layout)
            .await
            .map_err(|e| match e {
                crate::tiers::TierError::Warm(what, e) => {
                    classify(sink, format!("cold tier: cold lock: {what}"), e)
                }
                e => permanent(sink, e.to_string()),
            })
    }

    /// Keeps the lock's connection after a statement on it, unless the statement failed in a
    /// way that calls for a new connection (dropping this one releases the lock).
    fn give_back(
        &mut self,
        sink: &str,
        what: &str,
        client: tokio_postgres::Client,
        result: Result<(), tokio_postgres::Error>,
    ) -> Result<(), SinkError> {
        match result {
            Ok(()) => {
                self.lock = Some(client);
                Ok(())
            }
            Err(e) => {
                let error = classify(sink, format!("cold tier: {what}"), e);
                if !error.is_retryable() {
                    self.lock = Some(client);
                }
                Err(error)
            }
        }
    }
}

/// A failure of sink `sink` that retrying cannot fix.
fn permanent(sink: &str, message: String) -> SinkError {
    SinkError::Permanent {
        sink: sink.to_owned(),
        message,
        source: None,
    }
}

/// Sends hot-tier `commands`, pipelined.
async fn send_hot(
    connector: &mut Connector,
    name: &str,
    layout: &TierLayout,
    commands: &[redis::Cmd],
) -> Result<(), SinkError> {
    for chunk in commands.chunks(HOT_COMMANDS_PER_PIPELINE) {
        let mut pipe = redis::pipe();
        for command in chunk {
            pipe.add_command(command.clone()).ignore();
        }
        connector.run(&pipe).await.map_err(|e| {
            redis_error(
                name,
                layout.stores.hot.url.expose(),
                "hot tier: cannot write",
                e,
            )
        })?;
    }
    Ok(())
}

#[async_trait]
impl Sink for TiersSink {
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        self.connect().await?;
        let connector = self
            .redis
            .as_mut()
            .ok_or_else(|| SinkError::not_open("tiers"))?;
        if let Err(e) = connector.get().await {
            let url = self.layout()?.stores.hot.url.clone();
            return Err(redis_error(
                &self.name,
                url.expose(),
                "hot tier: cannot connect",
                e,
            ));
        }
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let ops = batch.intake::<Accepted>(&self.name)?;
        self.connect().await?;
        let layout = self.layout()?.clone();
        let name = self.name.clone();
        let hot_ops: Vec<&TierWrite> = ops
            .iter()
            .copied()
            .filter(|op| op.tier == Tier::Hot)
            .collect();
        let commands = hot::batch_commands(&layout, &hot_ops);
        let mut redis = self
            .redis
            .take()
            .ok_or_else(|| SinkError::not_open("tiers"))?;
        let Some(mut cold) = self.cold.take() else {
            self.redis = Some(redis);
            return Err(SinkError::not_open("tiers"));
        };
        let started = Instant::now();
        // The three stores are written at once: each write is idempotent, and the batch fails
        // (and is retried whole) if any fails.
        let (warm, cold_written, hot) = tokio::join!(
            async {
                let applied = self.write_warm(&ops).await?;
                Ok::<_, SinkError>((applied, started.elapsed().as_millis()))
            },
            async {
                cold.write(&name, &layout, &ops).await?;
                Ok::<_, SinkError>(started.elapsed().as_millis())
            },
            async {
                send_hot(&mut redis, &name, &layout, &commands).await?;
                Ok::<_, SinkError>(started.elapsed().as_millis())
            },
        );
        self.redis = Some(redis);
        self.cold = Some(cold);
        let (warm, warm_ms) = warm?;
        let cold_ms = cold_written?;
        let hot_ms = hot?;
        tracing::debug!(sink = %self.name, ops = ops.len(), ?warm, warm_ms, cold_ms, hot_ms, "tiers batch written");
        let deleted = ops
            .iter()
            .filter(|op| op.action == TierAction::Delete)
            .count() as u64;
        Ok(WriteReport {
            upserted: ops.len() as u64 - deleted,
            deleted,
            ..WriteReport::default()
        })
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        self.redis = None;
        self.warm = None;
        if let Some(cold) = &mut self.cold {
            cold.lock = None;
        }
        Ok(None)
    }
}
