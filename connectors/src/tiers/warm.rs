//! The warm tier in PostgreSQL: one table range-partitioned by the hour.
//!
//! ```text
//! {table} (device_id text, ts timestamptz, region text, device_hash text, <columns>,
//!          PRIMARY KEY (device_id, ts)) PARTITION BY RANGE (ts)
//! {table}_pYYYYMMDDHH  PARTITION OF {table} FOR VALUES FROM ('YYYY-MM-DD HH:00Z') TO (+1 hour)
//! {table}_aging        the aging job's runs (see `super::aging`)
//! ```
//!
//! Partitions are created ahead of the pipeline clock and for every hour a batch reaches. A
//! batch is applied in one transaction: the last operation per `(device_id, ts)` wins, deletes
//! as one `DELETE … USING unnest(…)`, puts as one `INSERT … SELECT FROM unnest(…) ON CONFLICT
//! DO UPDATE`, so a replayed batch leaves the same rows.

use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use refract_schemas::config::{TierColumnType, TierLayout};
use refract_schemas::write::tiers::Heartbeat;
use serde_json::Value;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient};

/// An hour in microseconds.
pub const HOUR_MICROS: i64 = 3_600_000_000;

/// A quoted identifier.
pub fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

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
    format!("{}.{}", quote(schema), quote(table))
}

/// The aging job's table of runs, quoted and qualified.
pub fn aging_table(layout: &TierLayout) -> String {
    let (schema, table) = schema_and_table(layout);
    format!("{}.{}", quote(schema), quote(&format!("{table}_aging")))
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

/// The statements that create the warm table and the aging table when missing.
pub fn create_statements(layout: &TierLayout) -> Vec<String> {
    let (schema, _) = schema_and_table(layout);
    let columns: String = layout
        .heartbeats
        .columns
        .iter()
        .map(|c| format!(", {} {}", quote(&c.name), c.kind.sql()))
        .collect();
    let mut statements = Vec::new();
    if schema != "public" {
        statements.push(format!("CREATE SCHEMA IF NOT EXISTS {}", quote(schema)));
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

/// Creates the partitions of `hours` (hour starts) that are missing.
pub async fn ensure_partitions(
    client: &impl GenericClient,
    layout: &TierLayout,
    hours: &BTreeSet<i64>,
) -> Result<(), tokio_postgres::Error> {
    let (schema, _) = schema_and_table(layout);
    for &hour in hours {
        let statement = format!(
            "CREATE TABLE IF NOT EXISTS {}.{} PARTITION OF {} FOR VALUES FROM ('{}') TO ('{}')",
            quote(schema),
            quote(&partition_name(layout, hour)),
            table(layout),
            timestamp_text(hour),
            timestamp_text(hour + HOUR_MICROS)
        );
        tolerate_race(client.batch_execute(&statement).await)?;
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

/// Applies `rows` (the batch's final states) inside `client`'s transaction.
pub async fn apply(
    client: &impl GenericClient,
    layout: &TierLayout,
    rows: &Final<'_>,
) -> Result<(), tokio_postgres::Error> {
    let (deletes, puts): (Vec<_>, Vec<_>) = rows.iter().partition(|(_, v)| v.is_none());
    if !deletes.is_empty() {
        let devices: Vec<&str> = deletes.iter().map(|((d, _), _)| *d).collect();
        let times: Vec<String> = deletes
            .iter()
            .map(|((_, t), _)| timestamp_text(*t))
            .collect();
        client
            .execute(
                &format!(
                    "DELETE FROM {} w USING unnest($1::text[], $2::text[]) AS k(device_id, ts) \
                     WHERE w.device_id = k.device_id AND w.ts = k.ts::timestamptz",
                    table(layout)
                ),
                &[&devices, &times],
            )
            .await?;
    }
    let puts: Vec<&Heartbeat> = puts.iter().filter_map(|(_, v)| **v).collect();
    if !puts.is_empty() {
        upsert(client, layout, &puts).await?;
    }
    Ok(())
}

/// Inserts or replaces `rows` (no `(device_id, ts)` twice).
pub async fn upsert(
    client: &impl GenericClient,
    layout: &TierLayout,
    rows: &[&Heartbeat],
) -> Result<u64, tokio_postgres::Error> {
    let columns = &layout.heartbeats.columns;
    let devices: Vec<&str> = rows.iter().map(|h| h.device_id.as_str()).collect();
    let times: Vec<String> = rows.iter().map(|h| timestamp_text(h.ts_micros)).collect();
    let regions: Vec<&str> = rows.iter().map(|h| h.region.as_str()).collect();
    let hashes: Vec<&str> = rows.iter().map(|h| h.device_hash.as_str()).collect();
    let mut params: Vec<Box<dyn ToSql + Sync + Send>> = vec![
        Box::new(devices),
        Box::new(times),
        Box::new(regions),
        Box::new(hashes),
    ];
    for (i, c) in columns.iter().enumerate() {
        let values = rows.iter().map(|h| h.values.get(i).unwrap_or(&Value::Null));
        params.push(typed_array(c.kind, values));
    }
    let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
    let casts: String = columns
        .iter()
        .enumerate()
        .map(|(i, c)| format!(", ${}::{}[]", i + 5, c.kind.sql()))
        .collect();
    let sets: String = names
        .iter()
        .map(|n| format!(", {n} = EXCLUDED.{n}"))
        .collect();
    let statement = format!(
        "INSERT INTO {} (device_id, ts, region, device_hash{}) \
         SELECT d, t::timestamptz, r, h{} FROM unnest($1::text[], $2::text[], $3::text[], \
         $4::text[]{casts}) AS u(d, t, r, h{}) \
         ON CONFLICT (device_id, ts) DO UPDATE SET region = EXCLUDED.region, \
         device_hash = EXCLUDED.device_hash{sets}",
        table(layout),
        names.iter().map(|n| format!(", {n}")).collect::<String>(),
        (0..columns.len())
            .map(|i| format!(", c{i}"))
            .collect::<String>(),
        (0..columns.len())
            .map(|i| format!(", c{i}"))
            .collect::<String>(),
    );
    let refs: Vec<&(dyn ToSql + Sync)> = params
        .iter()
        .map(|p| p.as_ref() as &(dyn ToSql + Sync))
        .collect();
    client.execute(&statement, &refs).await
}

/// One column's values as a PostgreSQL array parameter of its type (values were checked
/// against the type by the projection; anything else is null).
fn typed_array<'a>(
    kind: TierColumnType,
    values: impl Iterator<Item = &'a Value>,
) -> Box<dyn ToSql + Sync + Send> {
    match kind {
        TierColumnType::Text => Box::new(
            values
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Vec<Option<String>>>(),
        ),
        TierColumnType::Int => Box::new(
            values
                .map(|v| v.as_i64().and_then(|i| i32::try_from(i).ok()))
                .collect::<Vec<Option<i32>>>(),
        ),
        TierColumnType::Bigint => Box::new(values.map(Value::as_i64).collect::<Vec<Option<i64>>>()),
        TierColumnType::Real => Box::new(
            values
                .map(|v| v.as_f64().map(|f| f as f32))
                .collect::<Vec<Option<f32>>>(),
        ),
        TierColumnType::Double => Box::new(values.map(Value::as_f64).collect::<Vec<Option<f64>>>()),
        TierColumnType::Boolean => {
            Box::new(values.map(Value::as_bool).collect::<Vec<Option<bool>>>())
        }
    }
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
        .map(|c| format!(", {}", quote(&c.name)))
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
