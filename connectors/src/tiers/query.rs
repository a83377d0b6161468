//! The three queries of the tiers (seed 003 §4.2), as library calls: `refract tiers latest |
//! online | range` print what they return, and the benchmarks call them in-process.
//!
//! - [`TierReader::latest`]: a device's newest heartbeats. The hot set answers first (the
//!   device's members scored within the hot window on the pipeline clock); what it lacks comes
//!   from warm (`ORDER BY ts DESC LIMIT`, below the oldest hot time), and from cold when warm
//!   has too few or holds times past the warm window (a partition not aged yet, beside which a
//!   late heartbeat may have gone to cold). With Redis down, warm and cold answer alone and
//!   the answer carries a warning.
//! - [`TierReader::online`]: devices of a region whose newest heartbeat is within the last
//!   minutes, one `ZCOUNT` of the region's set; a window past the hot one is refused (the set
//!   keeps only the hot window).
//! - [`TierReader::range`]: a device's heartbeats in `[from, to)` from every tier, one per time.
//!
//! The hot key of a device holds its region: the reader finds it in the region sets
//! (`ZSCORE` of the device in every `{prefix}:*:online`, found by `SCAN`), not in the warm
//! table. A device has a hot set exactly when it is in a region set (the sink writes both,
//! trimmed to the same window), the highest score names the region its newest heartbeats are
//! filed under, and a device found in none is answered from warm without reading its set: so
//! a device with enough hot heartbeats is answered by Redis alone, with PostgreSQL slow or
//! down. The cost is a `SCAN` of the keyspace per query (milliseconds at ten thousand devices;
//! a registry of regions kept by the sink would make it one read).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path;
use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;
use refract_schemas::config::{TierColumnType, TierLayout};
use refract_schemas::write::tiers::{Heartbeat, Tier, device_hash};

use super::warm::{self, real_value, timestamp_text};
use super::{TierError, cold, hot};

/// How long connecting to Redis may take: a query that can answer from warm should not wait
/// long for a hot tier that is down.
const HOT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a Redis reply may take before the hot tier counts as down.
const HOT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys per `SCAN` step looking for the region sets.
const SCAN_COUNT: usize = 1_000;
/// A day in microseconds (the cold tier's directories are days, UTC).
const DAY_MICROS: i64 = 24 * warm::HOUR_MICROS;

/// A heartbeat and the tier it was read from.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// The tier that answered.
    pub tier: Tier,
    /// The heartbeat.
    pub heartbeat: Heartbeat,
}

/// Heartbeats, with what could not be read (the hot tier down: answered without it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Answer {
    /// The heartbeats, in the query's order.
    pub rows: Vec<Found>,
    /// Why a tier was left out, for stderr.
    pub warnings: Vec<String>,
}

/// A query that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The query's arguments are out of bounds.
    #[error("{0}")]
    Invalid(String),
    /// A tier failed.
    #[error(transparent)]
    Tier(#[from] TierError),
}

/// Reads a layout's tiers; connects to each tier when a query first needs it and keeps the
/// connection for the next query.
pub struct TierReader {
    layout: TierLayout,
    redis: redis::Client,
    hot: Option<MultiplexedConnection>,
    warm: Option<tokio_postgres::Client>,
    store: Arc<dyn ObjectStore>,
    root: Path,
}

impl TierReader {
    /// A reader of `layout`'s tiers (nothing is connected yet).
    pub fn new(layout: &TierLayout) -> Result<Self, TierError> {
        let (store, root) = super::open_cold(layout)?;
        Ok(Self {
            layout: layout.clone(),
            redis: super::hot_client(layout)?,
            hot: None,
            warm: None,
            store,
            root,
        })
    }

    /// The layout read.
    pub fn layout(&self) -> &TierLayout {
        &self.layout
    }

    /// The newest `n` heartbeats of `device`, newest first, at pipeline clock `clock`
    /// (microseconds).
    pub async fn latest(
        &mut self,
        clock: i64,
        device: &str,
        n: usize,
    ) -> Result<Answer, QueryError> {
        let mut answer = Answer::default();
        if n == 0 {
            return Ok(answer);
        }
        let floor = self.hot_floor(clock);
        match self.hot_rows(device, floor, None, Some(n)).await {
            Ok(rows) => answer.rows = tagged(Tier::Hot, rows.into_iter().rev()),
            Err(e) => answer.warnings.push(self.hot_down(e)),
        }
        // Everything in the hot window is in the hot set: warm and cold add what is older.
        let below = answer.rows.last().map(|f| f.heartbeat.ts_micros);
        if answer.rows.len() < n {
            let warm = self
                .warm_latest(device, below, n - answer.rows.len())
                .await?;
            answer.rows.extend(tagged(Tier::Warm, warm));
        }
        let oldest = answer.rows.last().map(|f| f.heartbeat.ts_micros);
        let past_warm = clock.saturating_sub(self.layout.warm_micros);
        if answer.rows.len() < n || oldest.is_some_and(|t| t < past_warm) {
            let cold = self.cold_latest(device, below, n).await?;
            let mut merged = by_time(std::mem::take(&mut answer.rows));
            for h in cold {
                merged.entry(h.ts_micros).or_insert(Found {
                    tier: Tier::Cold,
                    heartbeat: h,
                });
            }
            answer.rows = merged.into_values().rev().take(n).collect();
        }
        Ok(answer)
    }

    /// How many devices of `region` sent a heartbeat in the last `minutes` before pipeline
    /// clock `clock` (microseconds): those whose newest heartbeat is later than
    /// `clock - minutes`.
    pub async fn online(
        &mut self,
        clock: i64,
        region: &str,
        minutes: u64,
    ) -> Result<u64, QueryError> {
        let window = self.online_window(minutes)?;
        let key = hot::region_key(&self.layout, region);
        let result = async {
            let mut conn = self.hot().await?;
            redis::cmd("ZCOUNT")
                .arg(&key)
                .arg(format!("({}", clock.saturating_sub(window)))
                .arg("+inf")
                .query_async::<u64>(&mut conn)
                .await
        }
        .await;
        result.map_err(|e| {
            self.hot = None;
            QueryError::Tier(TierError::Hot(
                format!(
                    "cannot count `{key}` ({})",
                    self.layout.stores.hot.url.masked()
                ),
                e,
            ))
        })
    }

    /// The window of an `online` query in microseconds; refused past the hot window, which is
    /// all the region sets remember.
    pub fn online_window(&self, minutes: u64) -> Result<i64, QueryError> {
        let hot = self.layout.hot_micros;
        let window = i64::try_from(minutes)
            .ok()
            .and_then(|m| m.checked_mul(60_000_000))
            .filter(|w| (1..=hot).contains(w));
        window.ok_or_else(|| {
            QueryError::Invalid(format!(
                "--minutes {minutes}: the window must be between 1 minute and the hot window \
                 ({} = {} minutes): the hot tier only knows which devices were seen within it",
                self.layout.heartbeats.hot,
                hot / 60_000_000
            ))
        })
    }

    /// `device`'s heartbeats in `[from, to)` (microseconds) from every tier, in time order, one
    /// per time: warm's where warm has it, else cold's, else hot's (see [`prefer`]). The hot
    /// tier is read within its window on pipeline clock `clock`.
    pub async fn range(
        &mut self,
        clock: i64,
        device: &str,
        from: i64,
        to: i64,
    ) -> Result<Answer, QueryError> {
        if from >= to {
            return Err(QueryError::Invalid(format!(
                "the range is empty: --from {} is not before --to {}",
                timestamp_text(from),
                timestamp_text(to)
            )));
        }
        let mut answer = Answer::default();
        let mut merged: BTreeMap<i64, Found> = BTreeMap::new();
        let floor = self.hot_floor(clock).max(from - 1);
        if to > floor + 1 {
            match self.hot_rows(device, floor, Some(to), None).await {
                Ok(rows) => keep(&mut merged, Tier::Hot, rows),
                Err(e) => answer.warnings.push(self.hot_down(e)),
            }
        }
        let cold = self.cold_range(device, from, to).await?;
        keep(&mut merged, Tier::Cold, cold);
        let warm = self.warm_range(device, from, to).await?;
        keep(&mut merged, Tier::Warm, warm);
        answer.rows = merged.into_values().collect();
        Ok(answer)
    }

    /// Scores above this are in the hot window at `clock` (the sink trims what is not).
    fn hot_floor(&self, clock: i64) -> i64 {
        clock.saturating_sub(self.layout.hot_micros)
    }

    /// The hot tier failed: forget the connection and say what the answer lacks.
    fn hot_down(&mut self, e: redis::RedisError) -> String {
        self.hot = None;
        format!(
            "hot tier unavailable ({}): answering from warm and cold: {e}",
            self.layout.stores.hot.url.masked()
        )
    }

    async fn hot(&mut self) -> Result<MultiplexedConnection, redis::RedisError> {
        if let Some(conn) = &self.hot {
            return Ok(conn.clone());
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(HOT_CONNECT_TIMEOUT))
            .set_response_timeout(Some(HOT_RESPONSE_TIMEOUT));
        let conn = self
            .redis
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        self.hot = Some(conn.clone());
        Ok(conn)
    }

    async fn warm(&mut self) -> Result<&tokio_postgres::Client, TierError> {
        if self.warm.as_ref().is_none_or(|c| c.is_closed()) {
            self.warm = Some(super::connect_warm(&self.layout).await?);
        }
        self.warm
            .as_ref()
            .ok_or_else(|| TierError::Config("no warm connection".into()))
    }

    /// The region `device`'s newest heartbeats are filed under in the hot tier: the region set
    /// holding it with the highest score; `None` when no region set holds it.
    async fn hot_region(&mut self, device: &str) -> Result<Option<String>, redis::RedisError> {
        let mut conn = self.hot().await?;
        let mut regions = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(hot::region_pattern(&self.layout))
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await?;
            regions.extend(
                keys.iter()
                    .filter_map(|k| hot::region_of_key(&self.layout, k).map(str::to_owned)),
            );
            if next == 0 {
                break;
            }
            cursor = next;
        }
        if regions.is_empty() {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        for region in &regions {
            pipe.cmd("ZSCORE")
                .arg(hot::region_key(&self.layout, region))
                .arg(device);
        }
        let scores: Vec<Option<f64>> = pipe.query_async(&mut conn).await?;
        Ok(regions
            .into_iter()
            .zip(scores)
            .filter_map(|(r, s)| s.map(|s| (s, r)))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, r)| r))
    }

    /// `device`'s hot heartbeats scored above `floor` and below `to`, oldest first; with
    /// `newest`, only that many of the newest.
    async fn hot_rows(
        &mut self,
        device: &str,
        floor: i64,
        to: Option<i64>,
        newest: Option<usize>,
    ) -> Result<Vec<Heartbeat>, redis::RedisError> {
        let Some(region) = self.hot_region(device).await? else {
            return Ok(Vec::new());
        };
        let hash = device_hash(device);
        let key = hot::device_key(&self.layout, &region, &hash, device);
        let max = to.map_or_else(|| "+inf".to_owned(), |t| format!("({t}"));
        let mut cmd = redis::cmd("ZREVRANGEBYSCORE");
        cmd.arg(&key).arg(max).arg(format!("({floor}"));
        if let Some(n) = newest {
            cmd.arg("LIMIT").arg(0).arg(n);
        }
        let mut conn = self.hot().await?;
        let members: Vec<String> = cmd.query_async(&mut conn).await?;
        let columns = &self.layout.heartbeats.columns;
        let mut rows: Vec<Heartbeat> = members
            .iter()
            .filter_map(|m| hot::parse_member(columns, device, &region, &hash, m))
            .map(|h| normalized(&self.layout, h))
            .collect();
        rows.reverse();
        Ok(rows)
    }

    /// `device`'s newest `n` warm heartbeats older than `below`, newest first.
    async fn warm_latest(
        &mut self,
        device: &str,
        below: Option<i64>,
        n: usize,
    ) -> Result<Vec<Heartbeat>, TierError> {
        let layout = self.layout.clone();
        let bound = below.map_or_else(|| "infinity".to_owned(), timestamp_text);
        let limit = i64::try_from(n).unwrap_or(i64::MAX);
        let relation = format!(
            "(SELECT * FROM {} WHERE device_id = $1 AND ts < $2::text::timestamptz \
             ORDER BY ts DESC LIMIT $3) AS newest",
            warm::table(&layout)
        );
        let client = self.warm().await?;
        let mut rows = warm::select(
            client,
            &layout,
            &relation,
            "true",
            &[&device, &bound, &limit],
        )
        .await
        .map_err(|e| TierError::Warm(format!("cannot read `{device}`"), e))?;
        rows.reverse();
        Ok(rows)
    }

    /// `device`'s warm heartbeats in `[from, to)`, oldest first.
    async fn warm_range(
        &mut self,
        device: &str,
        from: i64,
        to: i64,
    ) -> Result<Vec<Heartbeat>, TierError> {
        let layout = self.layout.clone();
        let (from, to) = (timestamp_text(from), timestamp_text(to));
        let client = self.warm().await?;
        warm::select(
            client,
            &layout,
            &warm::table(&layout),
            "device_id = $1 AND ts >= $2::text::timestamptz AND ts < $3::text::timestamptz",
            &[&device, &from, &to],
        )
        .await
        .map_err(|e| TierError::Warm(format!("cannot read `{device}`"), e))
    }

    /// The days (start of day, microseconds, UTC) `device` has cold files for, in order.
    async fn cold_days(&self, device: &str) -> Result<Vec<i64>, TierError> {
        let dir = cold::device_dir(&self.root, device);
        let listed = match self.store.list_with_delimiter(Some(&dir)).await {
            Ok(l) => l,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(TierError::Cold(e.into())),
        };
        let mut days: Vec<i64> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename()?.strip_prefix("date=").and_then(day_start))
            .collect();
        days.sort_unstable();
        Ok(days)
    }

    /// Every cold heartbeat of `device` on the day starting at `day`.
    async fn cold_day(&self, device: &str, day: i64) -> Result<Vec<Heartbeat>, TierError> {
        let dir = cold::day_dir(&self.root, device, &cold::day_of(day));
        let files: Vec<_> = self
            .store
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e: object_store::Error| TierError::Cold(e.into()))?;
        let columns = &self.layout.heartbeats.columns;
        let mut rows = Vec::new();
        for meta in files.iter().filter(|m| {
            m.location
                .filename()
                .is_some_and(|f| f.ends_with(".parquet"))
        }) {
            rows.extend(cold::read_file(self.store.as_ref(), columns, &meta.location).await?);
        }
        Ok(rows)
    }

    /// `device`'s cold heartbeats in `[from, to)`, oldest first, one per time.
    async fn cold_range(
        &mut self,
        device: &str,
        from: i64,
        to: i64,
    ) -> Result<Vec<Heartbeat>, TierError> {
        let mut rows = BTreeMap::new();
        for day in self.cold_days(device).await? {
            if day + DAY_MICROS <= from || day >= to {
                continue;
            }
            for h in self.cold_day(device, day).await? {
                if (from..to).contains(&h.ts_micros) {
                    rows.insert(h.ts_micros, h);
                }
            }
        }
        Ok(rows.into_values().collect())
    }

    /// At least the newest `n` cold heartbeats of `device` older than `below` (whole days,
    /// newest day first, until `n` are read), in any order.
    async fn cold_latest(
        &mut self,
        device: &str,
        below: Option<i64>,
        n: usize,
    ) -> Result<Vec<Heartbeat>, TierError> {
        let below = below.unwrap_or(i64::MAX);
        let mut rows = Vec::new();
        for day in self.cold_days(device).await?.into_iter().rev() {
            if rows.len() >= n {
                break;
            }
            if day >= below {
                continue;
            }
            let held = self.cold_day(device, day).await?;
            rows.extend(held.into_iter().filter(|h| h.ts_micros < below));
        }
        Ok(rows)
    }
}

/// `rows` tagged with `tier`.
fn tagged(tier: Tier, rows: impl IntoIterator<Item = Heartbeat>) -> Vec<Found> {
    rows.into_iter()
        .map(|heartbeat| Found { tier, heartbeat })
        .collect()
}

/// Found rows by time.
fn by_time(rows: Vec<Found>) -> BTreeMap<i64, Found> {
    rows.into_iter()
        .map(|f| (f.heartbeat.ts_micros, f))
        .collect()
}

/// Which tier's row a merged answer keeps when several hold a time: warm, then cold, then hot.
///
/// Warm is the record: the sink writes each batch there in one transaction, with the typed
/// columns cold holds too, while hot is a trimmed copy (JSON text) written beside it and left a
/// batch ahead or behind while a failed batch waits for its retry. Warm and cold hold the same
/// time only while an aging run exports a partition before dropping it, and then hold the same
/// row. Hot and cold never overlap unless a clock jumped back.
pub fn prefer(tier: Tier) -> u8 {
    match tier {
        Tier::Warm => 2,
        Tier::Cold => 1,
        Tier::Hot => 0,
    }
}

/// Adds `rows` of `tier` to `merged`, replacing a time's row only with a preferred tier's.
fn keep(merged: &mut BTreeMap<i64, Found>, tier: Tier, rows: Vec<Heartbeat>) {
    for heartbeat in rows {
        let ts = heartbeat.ts_micros;
        match merged.get(&ts) {
            Some(f) if prefer(f.tier) >= prefer(tier) => {}
            _ => {
                merged.insert(ts, Found { tier, heartbeat });
            }
        }
    }
}

/// A hot member's measurements as warm and cold hold them: a `real` is rounded to `f32` (the
/// member keeps the number as the source wrote it).
fn normalized(layout: &TierLayout, mut h: Heartbeat) -> Heartbeat {
    for (c, v) in layout.heartbeats.columns.iter().zip(h.values.iter_mut()) {
        if let (TierColumnType::Real, Some(f)) = (c.kind, v.as_f64()) {
            *v = real_value(f as f32);
        }
    }
    h
}

/// Microseconds since the epoch as RFC 3339 with six decimals, UTC (`…T12:00:00.000000Z`).
pub fn rfc3339_micros(micros: i64) -> String {
    warm::utc(micros)
        .format("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}

/// An RFC 3339 instant in microseconds since the epoch.
pub fn parse_instant(text: &str) -> Result<i64, String> {
    chrono::DateTime::parse_from_rfc3339(text.trim())
        .map(|t| t.timestamp_micros())
        .map_err(|e| format!("`{text}` is not an RFC 3339 instant ({e})"))
}

/// The start (microseconds, UTC) of the day `yyyyMMdd`.
fn day_start(day: &str) -> Option<i64> {
    if day.len() != 8 || !day.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let date = chrono::NaiveDate::parse_from_str(day, "%Y%m%d").ok()?;
    Some(date.and_hms_opt(0, 0, 0)?.and_utc().timestamp_micros())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn hb(ts: i64, battery: f64) -> Heartbeat {
        Heartbeat {
            device_id: "d".into(),
            region: "EU".into(),
            device_hash: device_hash("d"),
            ts_micros: ts,
            values: vec![json!(battery)],
        }
    }

    #[test]
    fn merged_rows_prefer_warm_then_cold_then_hot() {
        let mut merged = BTreeMap::new();
        keep(
            &mut merged,
            Tier::Hot,
            vec![hb(1, 0.1), hb(2, 0.2), hb(3, 0.3)],
        );
        keep(&mut merged, Tier::Cold, vec![hb(2, 0.5), hb(4, 0.4)]);
        keep(&mut merged, Tier::Warm, vec![hb(2, 0.6), hb(3, 0.7)]);
        keep(&mut merged, Tier::Hot, vec![hb(3, 0.9), hb(4, 0.9)]);
        let got: Vec<(i64, Tier, f64)> = merged
            .values()
            .map(|f| {
                let b = f.heartbeat.values[0].as_f64().unwrap();
                (f.heartbeat.ts_micros, f.tier, b)
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (1, Tier::Hot, 0.1),
                (2, Tier::Warm, 0.6),
                (3, Tier::Warm, 0.7),
                (4, Tier::Cold, 0.4)
            ]
        );
    }

    #[test]
    fn days_parse() {
        assert_eq!(day_start("19700102"), Some(DAY_MICROS));
        assert_eq!(day_start("1970013"), None);
        assert_eq!(cold::day_of(day_start("20260205").unwrap()), "20260205");
    }
}
