//! The cold side of an aging run: export the detached partitions' rows by device to
//! `aged-{run}.parquet`, then read every file of those device-days back and check them.
//!
//! Both steps hold the cold lock (the one the sink's late writer holds), read the detached rows
//! [`DEVICES_PER_READ`] devices at a time, and work on [`COLD_CONCURRENCY`] device-days at once.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use refract_schemas::config::{TierColumn, TierLayout};
use refract_schemas::write::tiers::Heartbeat;
use tokio_postgres::Client;

use super::run::Run;
use super::warm_error;
use crate::tiers::{TierError, cold, cold_lock_sql, warm};

/// Devices whose rows of the day are read from PostgreSQL at once: bounds memory to that many
/// device-days (2,880 rows each at one heartbeat per 30 s) and keeps a day to a few queries.
const DEVICES_PER_READ: usize = 256;
/// Device-days written or read back at once: object stores answer each request in
/// milliseconds, so some must be in flight together (the sink's late writer uses as many).
const COLD_CONCURRENCY: usize = 16;

/// The cold tier: its store and root.
pub(super) type Cold = (Arc<dyn ObjectStore>, Path);

/// Writes the run's aged files; returns the heartbeats and files written.
pub(super) async fn export(
    client: &Client,
    layout: &TierLayout,
    cold: &Cold,
    run: &Run,
) -> Result<(u64, u64), TierError> {
    let day = cold::day_of(run.day);
    let columns = &layout.heartbeats.columns;
    locked(client, layout, async {
        let mut totals = (0, 0);
        for rows in DeviceChunks::new(client, layout, run).await? {
            let rows = rows.read(client, layout).await?;
            // Futures made before they are streamed: a closure in the stream would make the
            // task's future not `Send` (rust-lang/rust#102211).
            let writes: Vec<_> = by_device(&rows)
                .into_iter()
                .map(|device| write_device(cold, columns, &day, run.id, device))
                .collect();
            let written: Vec<(u64, u64)> = futures::stream::iter(writes)
                .buffer_unordered(COLD_CONCURRENCY)
                .try_collect()
                .await?;
            for (r, f) in written {
                totals = (totals.0 + r, totals.1 + f);
            }
        }
        Ok(totals)
    })
    .await
}

/// Writes one device's rows of the day to the run's file, leaving out times that another file
/// of the device-day holds (the late file, or an earlier run's). The run's own file is not
/// "another" one: a resumed run rewrites it whole. Returns the rows and files written.
async fn write_device(
    (store, root): &Cold,
    columns: &[TierColumn],
    day: &str,
    run: i64,
    rows: &[Heartbeat],
) -> Result<(u64, u64), TierError> {
    let dir = cold::day_dir(root, &rows[0].device_id, day);
    let held = DayFiles::read(store.as_ref(), columns, &dir, run).await?;
    let keep: Vec<&Heartbeat> = rows
        .iter()
        .filter(|h| !held.others.contains(&h.ts_micros))
        .collect();
    let path = dir.clone().join(cold::aged_file(run));
    if keep.is_empty() {
        if held.own.is_some() {
            store.delete(&path).await.map_err(cold::ColdError::from)?;
        }
        return Ok((0, 0));
    }
    let bytes =
        cold::encode(columns, &keep).map_err(|e| cold::ColdError::Corrupt(path.to_string(), e))?;
    crate::sinks::parquet::put(store.as_ref(), &path, bytes)
        .await
        .map_err(cold::ColdError::from)?;
    Ok((keep.len() as u64, 1))
}

/// Reads every file of the run's device-days back and checks, per device, that the cold times
/// cover every detached row, and that the run's file holds only detached rows, each once, none
/// of them also in another file of the day. The first device that fails stops the run with
/// [`TierError::Mismatch`]: its detached tables stay.
pub(super) async fn verify(
    client: &Client,
    layout: &TierLayout,
    cold: &Cold,
    run: &Run,
) -> Result<(), TierError> {
    let day = cold::day_of(run.day);
    let columns = &layout.heartbeats.columns;
    locked(client, layout, async {
        for rows in DeviceChunks::new(client, layout, run).await? {
            let rows = rows.read(client, layout).await?;
            let checks: Vec<_> = by_device(&rows)
                .into_iter()
                .map(|device| verify_device(cold, columns, &day, run, device))
                .collect();
            futures::stream::iter(checks)
                .buffer_unordered(COLD_CONCURRENCY)
                .try_collect::<Vec<()>>()
                .await?;
        }
        Ok(())
    })
    .await
}

/// Checks one device-day (see [`verify`]).
async fn verify_device(
    (store, root): &Cold,
    columns: &[TierColumn],
    day: &str,
    run: &Run,
    rows: &[Heartbeat],
) -> Result<(), TierError> {
    let device = &rows[0].device_id;
    let dir = cold::day_dir(root, device, day);
    let held = DayFiles::read(store.as_ref(), columns, &dir, run.id).await?;
    let warm: HashSet<i64> = rows.iter().map(|h| h.ts_micros).collect();
    let own: Vec<i64> = held.own.unwrap_or_default();
    let own_set: HashSet<i64> = own.iter().copied().collect();
    let missing = warm
        .iter()
        .filter(|t| !own_set.contains(t) && !held.others.contains(t))
        .count();
    let twice = own_set.iter().filter(|t| held.others.contains(t)).count();
    let stray = own_set.iter().filter(|t| !warm.contains(t)).count();
    let repeated = own.len() - own_set.len();
    if missing + twice + stray + repeated == 0 {
        return Ok(());
    }
    Err(TierError::Mismatch(format!(
        "aging run {} (device `{device}`, day {}): the warm tier holds {} heartbeat(s), the run's \
         file {} and the day's other files {}; {missing} warm heartbeat(s) in no cold file, \
         {twice} time(s) in the run's file and another, {stray} in the run's file not from \
         warm, {repeated} twice in the run's file. The detached tables stay; nothing was dropped",
        run.id,
        run.day_text(),
        rows.len(),
        own.len(),
        held.others.len()
    )))
}

/// The times the files of one device-day hold.
struct DayFiles {
    /// The run's own file's times, in file order (`None` when it has none).
    own: Option<Vec<i64>>,
    /// The times of the day's other files.
    others: HashSet<i64>,
}

impl DayFiles {
    async fn read(
        store: &dyn ObjectStore,
        columns: &[TierColumn],
        dir: &Path,
        run: i64,
    ) -> Result<Self, TierError> {
        let own_name = cold::aged_file(run);
        let files = cold::day_files(store, dir)
            .await
            .map_err(cold::ColdError::from)?;
        let mut out = DayFiles {
            own: None,
            others: HashSet::new(),
        };
        for (name, path) in &files {
            let times = cold::read_file(store, columns, path)
                .await?
                .into_iter()
                .map(|h| h.ts_micros);
            if *name == own_name {
                out.own = Some(times.collect());
            } else {
                out.others.extend(times);
            }
        }
        Ok(out)
    }
}

/// Runs `work` holding the cold lock on `client`'s session, and releases it after.
async fn locked<T>(
    client: &Client,
    layout: &TierLayout,
    work: impl Future<Output = Result<T, TierError>>,
) -> Result<T, TierError> {
    client
        .batch_execute(&cold_lock_sql(layout, true))
        .await
        .map_err(warm_error("cannot take the cold lock"))?;
    let result = work.await;
    let unlocked = client
        .batch_execute(&cold_lock_sql(layout, false))
        .await
        .map_err(warm_error("cannot release the cold lock"));
    let value = result?;
    unlocked?;
    Ok(value)
}

/// The devices of a run's detached tables, in chunks of [`DEVICES_PER_READ`].
struct DeviceChunks {
    relation: String,
    devices: Vec<String>,
}

impl DeviceChunks {
    /// Lists the devices of `run`'s detached tables.
    async fn new(client: &Client, layout: &TierLayout, run: &Run) -> Result<Self, TierError> {
        let tables = run.detached(layout);
        if tables.is_empty() {
            return Ok(DeviceChunks {
                relation: String::new(),
                devices: Vec::new(),
            });
        }
        let union: Vec<String> = tables
            .iter()
            .map(|t| format!("SELECT * FROM {t}"))
            .collect();
        let relation = format!("({}) AS aged", union.join(" UNION ALL "));
        let devices = client
            .query(
                &format!("SELECT DISTINCT device_id FROM {relation} ORDER BY 1"),
                &[],
            )
            .await
            .map_err(warm_error("cannot read the detached partitions"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        Ok(DeviceChunks { relation, devices })
    }
}

impl IntoIterator for DeviceChunks {
    type Item = DeviceChunk;
    type IntoIter = std::vec::IntoIter<DeviceChunk>;

    fn into_iter(self) -> Self::IntoIter {
        self.devices
            .chunks(DEVICES_PER_READ)
            .map(|c| DeviceChunk {
                relation: self.relation.clone(),
                devices: c.to_vec(),
            })
            .collect::<Vec<_>>()
            .into_iter()
    }
}

/// Some devices of a run's detached tables.
struct DeviceChunk {
    relation: String,
    devices: Vec<String>,
}

impl DeviceChunk {
    /// Their rows, ordered by device and time.
    async fn read(
        &self,
        client: &Client,
        layout: &TierLayout,
    ) -> Result<Vec<Heartbeat>, TierError> {
        warm::select(
            client,
            layout,
            &self.relation,
            "device_id = ANY($1)",
            &[&self.devices],
        )
        .await
        .map_err(warm_error("cannot read the detached partitions"))
    }
}

/// `rows` (ordered by device) cut into one slice per device.
fn by_device(rows: &[Heartbeat]) -> Vec<&[Heartbeat]> {
    rows.chunk_by(|a, b| a.device_id == b.device_id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(device: &str, ts: i64) -> Heartbeat {
        Heartbeat {
            device_id: device.into(),
            region: "EU".into(),
            device_hash: "abcd".into(),
            ts_micros: ts,
            values: Vec::new(),
        }
    }

    #[test]
    fn rows_are_cut_by_device() {
        let rows = [hb("a", 1), hb("a", 2), hb("b", 1), hb("c", 5), hb("c", 6)];
        let cut: Vec<usize> = by_device(&rows).iter().map(|d| d.len()).collect();
        assert_eq!(cut, [2, 1, 2]);
        assert!(by_device(&[]).is_empty());
    }
}
