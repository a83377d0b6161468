//! The warm tier in PostgreSQL: one table range-partitioned by the hour.
//!
//! ```text
//! {table} (device_id text, ts timestamptz, region text, device_hash text, <columns>,
//!          PRIMARY KEY (device_id, ts)) PARTITION BY RANGE (ts)
//! {table}_pYYYYMMDDHH  PARTITION OF {table} FOR VALUES FROM ('YYYY-MM-DD HH:00Z') TO (+1 hour)
//! {table}_aging        the aging job's runs (see `super::aging`)
//! ```
//!
//! Partitions are created ahead of the pipeline clock and for every hour a batch reaches,
//! [`PARTITIONS_PER_ROUND_TRIP`] at a time. A batch is applied in one transaction: the last
//! operation per `(device_id, ts)` wins, deletes as one `DELETE … USING unnest(…)`, puts as one
//! binary `COPY`; when a put is already stored (a replay after a crash re-sends rows) the COPY
//! fails on the primary key, that transaction is rolled back and the batch is applied again
//! with one `INSERT … SELECT FROM unnest(…) ON CONFLICT DO UPDATE` instead, so a replayed batch
//! leaves the same rows. Times travel in binary (`timestamptz`), never as text to parse.

use std::collections::{BTreeSet, HashMap};
use std::error::Error as StdError;

use bytes::{BufMut, BytesMut};
use chrono::{DateTime, Utc};
use refract_schemas::config::{TierColumnType, TierLayout};
use refract_schemas::write::tiers::Heartbeat;
use serde_json::Value;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use tokio_postgres::{Client, GenericClient, Transaction};

use crate::pg_sql::{qualified, quote_ident};

/// An hour in microseconds.
pub const HOUR_MICROS: i64 = 3_600_000_000;

/// The warm table's schema and name.
pub fn schema_and_table(layout: &TierLayout) -> (&str, &str) {
    layout
        .stores
        .warm
        .table
        .split_once('.')
        .unwrap_or(("public", &layout.stores.warm.table))
}

/// The warm table, quoted and qualified.
pub fn table(layout: &TierLayout) -> String {
    let (schema, table) = schema_and_table(layout);
    qualified(schema, table)
}

/// The aging job's table of runs, quoted and qualified.
pub fn aging_table(layout: &TierLayout) -> String {
    let (schema, table) = schema_and_table(layout);
    qualified(schema, &format!("{table}_aging"))
}

/// The start of the hour holding `micros`.
pub fn hour_of(micros: i64) -> i64 {
    micros.div_euclid(HOUR_MICROS) * HOUR_MICROS
}

/// The name (unquoted, without schema) of the partition of the hour starting at `hour`.
pub fn partition_name(layout: &TierLayout, hour: i64) -> String {
    let (_, table) = schema_and_table(layout);
    format!("{table}_p{}", utc(hour).format("%Y%m%d%H"))
}

/// The hour a partition name stands for, `None` for any other table.
pub fn partition_hour(layout: &TierLayout, name: &str) -> Option<i64> {
    let (_, table) = schema_and_table(layout);
    let digits = name.strip_prefix(table)?.strip_prefix("_p")?;
    if digits.len() != 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let t = chrono::NaiveDateTime::parse_from_str(&format!("{digits}0000"), "%Y%m%d%H%M%S").ok()?;
    Some(t.and_utc().timestamp_micros())
}

/// Microseconds since the epoch as a UTC time.
pub fn utc(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros).unwrap_or_default()
}

/// Microseconds as a `timestamptz` literal PostgreSQL reads exactly.
pub fn timestamp_text(micros: i64) -> String {
    utc(micros).format("%Y-%m-%d %H:%M:%S%.6f+00").to_string()
}

/// PostgreSQL's epoch, 2000-01-01T00:00:00Z, in microseconds since the Unix epoch: binary
/// `timestamptz` values count from it.
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// Microseconds since the Unix epoch as a binary `timestamptz` parameter (or array element):
/// eight bytes, where the text form costs a format here and a parse in PostgreSQL per value.
#[derive(Debug, Clone, Copy)]
pub struct PgTime(pub i64);

impl ToSql for PgTime {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        let since_2000 = self
            .0
            .checked_sub(PG_EPOCH_MICROS)
            .ok_or("timestamp out of range")?;
        out.put_i64(since_2000);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TIMESTAMPTZ
    }

    to_sql_checked!();
}

/// One measurement as a parameter of its column's type: a value the projection did not type as
/// the column's (which it checked) is null.
#[derive(Debug, Clone, Copy)]
struct Measure<'a>(TierColumnType, &'a Value);

impl ToSql for Measure<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        let v = self.1;
        match self.0 {
            TierColumnType::Text => v.as_str().to_sql(ty, out),
            TierColumnType::Int => v
                .as_i64()
                .and_then(|i| i32::try_from(i).ok())
                .to_sql(ty, out),
            TierColumnType::Bigint => v.as_i64().to_sql(ty, out),
            TierColumnType::Real => v.as_f64().map(|f| f as f32).to_sql(ty, out),
            TierColumnType::Double => v.as_f64().to_sql(ty, out),
            TierColumnType::Boolean => v.as_bool().to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        [
            Type::TEXT,
            Type::INT4,
            Type::INT8,
            Type::FLOAT4,
            Type::FLOAT8,
            Type::BOOL,
        ]
        .contains(ty)
    }

    to_sql_checked!();
}

/// The PostgreSQL type of a measurement column (what [`TierColumnType::sql`] names).
fn pg_type(kind: TierColumnType) -> Type {
    match kind {
        TierColumnType::Text => Type::TEXT,
        TierColumnType::Int => Type::INT4,
        TierColumnType::Bigint => Type::INT8,
        TierColumnType::Real => Type::FLOAT4,
        TierColumnType::Double => Type::FLOAT8,
        TierColumnType::Boolean => Type::BOOL,
    }
}

/// The statements that create the warm table and the aging table when missing.
pub fn create_statements(layout: &TierLayout) -> Vec<String> {
    let (schema, _) = schema_and_table(layout);
    let columns: String = layout
        .heartbeats
        .columns
        .iter()
        .map(|c| format!(", {} {}", quote_ident(&c.name), c.kind.sql()))
        .collect();
    let mut statements = Vec::new();
    if schema != "public" {
        statements.push(format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_ident(schema)
        ));
    }
    statements.extend([
        format!(
            "CREATE TABLE IF NOT EXISTS {} (device_id text NOT NULL, ts timestamptz NOT NULL, \
             region text NOT NULL, device_hash text NOT NULL{columns}, \
             PRIMARY KEY (device_id, ts)) PARTITION BY RANGE (ts)",
            table(layout)
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {} (run bigserial PRIMARY KEY, day date NOT NULL, \
             partitions text[] NOT NULL, state text NOT NULL, rows bigint, files bigint, \
             started_at timestamptz NOT NULL DEFAULT now(), finished_at timestamptz)",
            aging_table(layout)
        ),
    ]);
    statements
}

/// Creates the warm table and the aging table when missing.
pub async fn create(client: &Client, layout: &TierLayout) -> Result<(), tokio_postgres::Error> {
    for statement in create_statements(layout) {
        tolerate_race(client.batch_execute(&statement).await)?;
    }
    Ok(())
}

/// Two processes creating the same object: the loser's "already exists" is success.
fn tolerate_race(result: Result<(), tokio_postgres::Error>) -> Result<(), tokio_postgres::Error> {
    match result {
        Err(e)
            if e.code()
                .is_some_and(|c| matches!(c.code(), "42P07" | "23505" | "42710" | "42P06")) =>
        {
            Ok(())
        }
        other => other,
    }
}

/// Partitions created per round trip: each `CREATE TABLE` on its own would cost a round trip
/// and a commit (a WAL flush); a month of hours is 720 of them. Sixteen statements share one
/// implicit transaction, and a failed group (another writer raced on one of them) is redone
/// one statement at a time.
pub const PARTITIONS_PER_ROUND_TRIP: usize = 16;

/// Creates the partitions of `hours` (hour starts) that are missing.
pub async fn ensure_partitions(
    client: &impl GenericClient,
    layout: &TierLayout,
    hours: &BTreeSet<i64>,
) -> Result<(), tokio_postgres::Error> {
    let (schema, _) = schema_and_table(layout);
    let statements: Vec<String> = hours
        .iter()
        .map(|&hour| {
            format!(
                "CREATE TABLE IF NOT EXISTS {}.{} PARTITION OF {} FOR VALUES FROM ('{}') TO ('{}')",
                quote_ident(schema),
                quote_ident(&partition_name(layout, hour)),
                table(layout),
                timestamp_text(hour),
                timestamp_text(hour + HOUR_MICROS)
            )
        })
        .collect();
    for group in statements.chunks(PARTITIONS_PER_ROUND_TRIP) {
        if group.len() > 1 && client.batch_execute(&group.join(";\n")).await.is_ok() {
            continue;
        }
        for statement in group {
            tolerate_race(client.batch_execute(statement).await)?;
        }
    }
    Ok(())
}

/// The partitions of the warm table that exist, as `(name, hour)` in hour order.
pub async fn partitions(
    client: &impl GenericClient,
    layout: &TierLayout,
) -> Result<Vec<(String, i64)>, tokio_postgres::Error> {
    let (schema, table) = schema_and_table(layout);
    let rows = client
        .query(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace \
             WHERE n.nspname = $1 AND p.relname = $2",
            &[&schema, &table],
        )
        .await?;
    let mut out: Vec<(String, i64)> = rows
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            partition_hour(layout, &name).map(|h| (name, h))
        })
        .collect();
    out.sort_by_key(|(_, h)| *h);
    Ok(out)
}

/// The final state per `(device_id, ts)` of a batch's warm writes: `Some` to store, `None` to
/// delete.
pub type Final<'a> = HashMap<(&'a str, i64), Option<&'a Heartbeat>>;

/// SQLSTATE of a unique violation: a COPY met a row already stored.
const UNIQUE_VIOLATION: &str = "23505";

/// How a batch reached the warm table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Its puts were copied in (none was stored before).
    Copied,
    /// COPY met a put already stored: rolled back, then upserted.
    FellBack,
    /// Upserted without trying COPY (not asked for, or nothing to put).
    Upserted,
}

/// Applies `rows` (a batch's final states) in one transaction of its own, committed before this
/// returns. With `copy`, the puts are first sent with binary COPY (the fast path, for rows
/// never seen); if one is already stored, that transaction is rolled back and the batch is
/// applied again with the idempotent upsert. Either way the table ends with the same rows.
pub async fn apply(
    client: &mut Client,
    layout: &TierLayout,
    rows: &Final<'_>,
    copy: bool,
) -> Result<Applied, tokio_postgres::Error> {
    if rows.is_empty() {
        return Ok(Applied::Upserted);
    }
    let (deletes, puts): (Vec<_>, Vec<_>) = rows.iter().partition(|(_, v)| v.is_none());
    let deletes: Vec<(&str, i64)> = deletes.iter().map(|(k, _)| **k).collect();
    let puts: Vec<&Heartbeat> = puts.iter().filter_map(|(_, v)| **v).collect();
    let mut applied = Applied::Upserted;
    if copy && !puts.is_empty() {
        let tx = client.transaction().await?;
        delete(&tx, layout, &deletes).await?;
        match copy_in(&tx, layout, &puts).await {
            Ok(_) => {
                tx.commit().await?;
                return Ok(Applied::Copied);
            }
            Err(e) if e.code().is_some_and(|c| c.code() == UNIQUE_VIOLATION) => {
                tx.rollback().await?;
                applied = Applied::FellBack;
            }
            Err(e) => return Err(e),
        }
    }
    let tx = client.transaction().await?;
    delete(&tx, layout, &deletes).await?;
    if !puts.is_empty() {
        upsert(&tx, layout, &puts).await?;
    }
    tx.commit().await?;
    Ok(applied)
}

/// Deletes the heartbeats `keys` name, if stored.
async fn delete(
    client: &impl GenericClient,
    layout: &TierLayout,
    keys: &[(&str, i64)],
) -> Result<(), tokio_postgres::Error> {
    if keys.is_empty() {
        return Ok(());
    }
    let devices: Vec<&str> = keys.iter().map(|(d, _)| *d).collect();
    let times: Vec<PgTime> = keys.iter().map(|(_, t)| PgTime(*t)).collect();
    client
        .execute(
            &format!(
                "DELETE FROM {} w USING unnest($1::text[], $2::timestamptz[]) AS k(device_id, ts) \
                 WHERE w.device_id = k.device_id AND w.ts = k.ts",
                table(layout)
            ),
            &[&devices, &times],
        )
        .await?;
    Ok(())
}

/// Inserts `rows` (no `(device_id, ts)` twice) with one binary COPY; fails with a unique
/// violation (SQLSTATE 23505) when one of them is already stored, which aborts the transaction.
pub async fn copy_in(
    tx: &Transaction<'_>,
    layout: &TierLayout,
    rows: &[&Heartbeat],
) -> Result<u64, tokio_postgres::Error> {
    let columns = &layout.heartbeats.columns;
    let mut types = vec![Type::TEXT, Type::TIMESTAMPTZ, Type::TEXT, Type::TEXT];
    types.extend(columns.iter().map(|c| pg_type(c.kind)));
    let names: String = columns
        .iter()
        .map(|c| format!(", {}", quote_ident(&c.name)))
        .collect();
    let sink = tx
        .copy_in(&format!(
            "COPY {} (device_id, ts, region, device_hash{names}) FROM STDIN (FORMAT binary)",
            table(layout)
        ))
        .await?;
    let mut writer = std::pin::pin!(BinaryCopyInWriter::new(sink, &types));
    for h in rows {
        let ts = PgTime(h.ts_micros);
        let measures: Vec<Measure> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Measure(c.kind, h.values.get(i).unwrap_or(&Value::Null)))
            .collect();
        let mut cells: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(types.len());
        cells.extend([
            &h.device_id as &(dyn ToSql + Sync),
            &ts,
            &h.region,
            &h.device_hash,
        ]);
        cells.extend(measures.iter().map(|m| m as &(dyn ToSql + Sync)));
        writer.as_mut().write(&cells).await?;
    }
    writer.finish().await
}

/// Inserts or replaces `rows` (no `(device_id, ts)` twice).
pub async fn upsert(
    client: &impl GenericClient,
    layout: &TierLayout,
    rows: &[&Heartbeat],
) -> Result<u64, tokio_postgres::Error> {
    let columns = &layout.heartbeats.columns;
    let devices: Vec<&str> = rows.iter().map(|h| h.device_id.as_str()).collect();
    let times: Vec<PgTime> = rows.iter().map(|h| PgTime(h.ts_micros)).collect();
    let regions: Vec<&str> = rows.iter().map(|h| h.region.as_str()).collect();
    let hashes: Vec<&str> = rows.iter().map(|h| h.device_hash.as_str()).collect();
    let measures: Vec<Vec<Measure>> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            rows.iter()
                .map(|h| Measure(c.kind, h.values.get(i).unwrap_or(&Value::Null)))
                .collect()
        })
        .collect();
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&devices, &times, &regions, &hashes];
    params.extend(measures.iter().map(|m| m as &(dyn ToSql + Sync)));
    let names: Vec<String> = columns.iter().map(|c| quote_ident(&c.name)).collect();
    let casts: String = columns
        .iter()
        .enumerate()
        .map(|(i, c)| format!(", ${}::{}[]", i + 5, c.kind.sql()))
        .collect();
    let sets: String = names
        .iter()
        .map(|n| format!(", {n} = EXCLUDED.{n}"))
        .collect();
    let aliases: String = (0..columns.len()).map(|i| format!(", c{i}")).collect();
    let statement = format!(
        "INSERT INTO {} (device_id, ts, region, device_hash{}) \
         SELECT d, t, r, h{aliases} FROM unnest($1::text[], $2::timestamptz[], $3::text[], \
         $4::text[]{casts}) AS u(d, t, r, h{aliases}) \
         ON CONFLICT (device_id, ts) DO UPDATE SET region = EXCLUDED.region, \
         device_hash = EXCLUDED.device_hash{sets}",
        table(layout),
        names.iter().map(|n| format!(", {n}")).collect::<String>(),
    );
    client.execute(&statement, &params).await
}

/// The heartbeats of `relation` (a partition, or the warm table) matching `condition` (SQL on
/// `device_id` and `ts`, with `params`), ordered by device and time.
pub async fn select(
    client: &impl GenericClient,
    layout: &TierLayout,
    relation: &str,
    condition: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Heartbeat>, tokio_postgres::Error> {
    let columns = &layout.heartbeats.columns;
    let list: String = columns
        .iter()
        .map(|c| format!(", {}", quote_ident(&c.name)))
        .collect();
    let rows = client
        .query(
            &format!(
                "SELECT device_id, (extract(epoch FROM ts) * 1000000)::bigint, region, \
                 device_hash{list} FROM {relation} WHERE {condition} ORDER BY device_id, ts"
            ),
            params,
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Heartbeat {
            device_id: r.get(0),
            ts_micros: r.get(1),
            region: r.get(2),
            device_hash: r.get(3),
            values: columns
                .iter()
                .enumerate()
                .map(|(i, c)| column_value(r, i + 4, c.kind))
                .collect(),
        })
        .collect())
}

/// A measurement read back as the JSON value the projection would have handed over.
fn column_value(row: &tokio_postgres::Row, i: usize, kind: TierColumnType) -> Value {
    match kind {
        TierColumnType::Text => row.get::<_, Option<String>>(i).map(Value::from),
        TierColumnType::Int => row.get::<_, Option<i32>>(i).map(Value::from),
        TierColumnType::Bigint => row.get::<_, Option<i64>>(i).map(Value::from),
        TierColumnType::Real => row.get::<_, Option<f32>>(i).map(real_value),
        TierColumnType::Double => row.get::<_, Option<f64>>(i).map(Value::from),
        TierColumnType::Boolean => row.get::<_, Option<bool>>(i).map(Value::from),
    }
    .unwrap_or(Value::Null)
}

/// A `real` as the JSON number it was written from: the shortest decimal that reads back as the
/// same `f32` (`0.1`, not `0.10000000149011612`).
pub fn real_value(f: f32) -> Value {
    f.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}
