//! The cold tier: Parquet files on object storage, by device and day (UTC); zstd from
//! [`COMPRESS_FROM_ROWS`] rows, uncompressed below.
//!
//! ```text
//! {url}/device_id={device}/date={yyyyMMdd}/aged-{run}.parquet   a warm day exported by aging run `run`
//! {url}/device_id={device}/date={yyyyMMdd}/late.parquet         heartbeats already cold on arrival
//! ```
//!
//! Hive-style directory names, so DuckDB (`read_parquet('…/*/*/*.parquet',
//! hive_partitioning = true)`) and Athena prune by device and day from the path alone. Columns:
//! `device_id`, `ts` (timestamp, microseconds, UTC), `region`, `device_hash`, then the
//! measurement columns with their declared types; rows ordered by time.
//!
//! A heartbeat is in at most one file of its device and day: the late file is rewritten with
//! each batch that reaches it (merged by time, the newest write winning), leaving out times an
//! aged file holds, and an aging run leaves out times the other files hold. Both writers hold
//! the same PostgreSQL advisory lock meanwhile (see `super::COLD_LOCK`), so they never race.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Float32Builder, Float64Builder, Int32Builder, Int64Builder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int32Type, Int64Type, TimestampMicrosecondType,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use refract_schemas::config::{TierColumn, TierColumnType};
use refract_schemas::write::tiers::Heartbeat;
use serde_json::Value;

use super::warm::{real_value, utc};

/// The name of the file of heartbeats that were cold on arrival.
pub const LATE_FILE: &str = "late.parquet";

/// The file an aging run writes for one device and day.
pub fn aged_file(run: i64) -> String {
    format!("aged-{run:012}.parquet")
}

/// The day (UTC) of `micros`, as `yyyyMMdd`.
pub fn day_of(micros: i64) -> String {
    utc(micros).format("%Y%m%d").to_string()
}

/// The directory of one device's day.
pub fn day_dir(root: &Path, device: &str, day: &str) -> Path {
    root.clone()
        .join(format!("device_id={device}"))
        .join(format!("date={day}"))
}

/// The directory of one device's days.
pub fn device_dir(root: &Path, device: &str) -> Path {
    root.clone().join(format!("device_id={device}"))
}

/// The Arrow schema of the cold files.
pub fn schema(columns: &[TierColumn]) -> SchemaRef {
    let mut fields = vec![
        Field::new("device_id", DataType::Utf8, false),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
        Field::new("region", DataType::Utf8, false),
        Field::new("device_hash", DataType::Utf8, false),
    ];
    for c in columns {
        let ty = match c.kind {
            TierColumnType::Text => DataType::Utf8,
            TierColumnType::Int => DataType::Int32,
            TierColumnType::Bigint => DataType::Int64,
            TierColumnType::Real => DataType::Float32,
            TierColumnType::Double => DataType::Float64,
            TierColumnType::Boolean => DataType::Boolean,
        };
        fields.push(Field::new(&c.name, ty, true));
    }
    Arc::new(Schema::new(fields))
}

/// Rows from which a cold file is zstd-compressed. A file of a few rows (late heartbeats of a
/// device-day trickling in) is mostly footer and metadata: compressing its column chunks saves
/// a few bytes and costs a compressor per column chunk, paid again at every rewrite of the
/// late file. Readers (DuckDB, Athena, pyarrow) read either, chunk by chunk.
pub const COMPRESS_FROM_ROWS: usize = 64;

/// `rows` as one Parquet file: zstd from [`COMPRESS_FROM_ROWS`] rows, uncompressed below.
pub fn encode(columns: &[TierColumn], rows: &[&Heartbeat]) -> Result<Bytes, String> {
    let schema = schema(columns);
    let strings = |f: &dyn Fn(&Heartbeat) -> &str| -> ArrayRef {
        let mut b = StringBuilder::new();
        for h in rows {
            b.append_value(f(h));
        }
        Arc::new(b.finish())
    };
    let mut arrays = vec![
        strings(&|h| &h.device_id),
        {
            let mut b = TimestampMicrosecondBuilder::new().with_timezone("UTC");
            for h in rows {
                b.append_value(h.ts_micros);
            }
            Arc::new(b.finish()) as ArrayRef
        },
        strings(&|h| &h.region),
        strings(&|h| &h.device_hash),
    ];
    for (i, c) in columns.iter().enumerate() {
        let values = rows.iter().map(|h| h.values.get(i).unwrap_or(&Value::Null));
        arrays.push(column_array(c.kind, values));
    }
    let batch = RecordBatch::try_new(schema.clone(), arrays).map_err(|e| e.to_string())?;
    let compression = if rows.len() < COMPRESS_FROM_ROWS {
        Compression::UNCOMPRESSED
    } else {
        Compression::ZSTD(ZstdLevel::default())
    };
    let props = WriterProperties::builder()
        .set_compression(compression)
        .build();
    let mut out = Vec::new();
    let mut writer =
        ArrowWriter::try_new(&mut out, schema, Some(props)).map_err(|e| e.to_string())?;
    writer.write(&batch).map_err(|e| e.to_string())?;
    writer.close().map_err(|e| e.to_string())?;
    Ok(Bytes::from(out))
}

fn column_array<'a>(kind: TierColumnType, values: impl Iterator<Item = &'a Value>) -> ArrayRef {
    match kind {
        TierColumnType::Text => {
            let mut b = StringBuilder::new();
            values.for_each(|v| b.append_option(v.as_str()));
            Arc::new(b.finish())
        }
        TierColumnType::Int => {
            let mut b = Int32Builder::new();
            values.for_each(|v| b.append_option(v.as_i64().and_then(|i| i32::try_from(i).ok())));
            Arc::new(b.finish())
        }
        TierColumnType::Bigint => {
            let mut b = Int64Builder::new();
            values.for_each(|v| b.append_option(v.as_i64()));
            Arc::new(b.finish())
        }
        TierColumnType::Real => {
            let mut b = Float32Builder::new();
            values.for_each(|v| b.append_option(v.as_f64().map(|f| f as f32)));
            Arc::new(b.finish())
        }
        TierColumnType::Double => {
            let mut b = Float64Builder::new();
            values.for_each(|v| b.append_option(v.as_f64()));
            Arc::new(b.finish())
        }
        TierColumnType::Boolean => {
            let mut b = BooleanBuilder::new();
            values.for_each(|v| b.append_option(v.as_bool()));
            Arc::new(b.finish())
        }
    }
}

/// The heartbeats of one cold file.
pub fn decode(columns: &[TierColumn], bytes: Bytes) -> Result<Vec<Heartbeat>, String> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
        .and_then(|b| b.build())
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| e.to_string())?;
        let text = |name: &str| -> Result<arrow_array::StringArray, String> {
            batch
                .column_by_name(name)
                .and_then(|a| a.as_string_opt::<i32>().cloned())
                .ok_or_else(|| format!("no text column `{name}`"))
        };
        let devices = text("device_id")?;
        let regions = text("region")?;
        let hashes = text("device_hash")?;
        let ts = batch
            .column_by_name("ts")
            .and_then(|a| a.as_primitive_opt::<TimestampMicrosecondType>().cloned())
            .ok_or("no timestamp column `ts`")?;
        let measures: Vec<ArrayRef> = columns
            .iter()
            .map(|c| {
                batch
                    .column_by_name(&c.name)
                    .cloned()
                    .ok_or_else(|| format!("no column `{}`", c.name))
            })
            .collect::<Result<_, _>>()?;
        for row in 0..batch.num_rows() {
            out.push(Heartbeat {
                device_id: devices.value(row).to_owned(),
                ts_micros: ts.value(row),
                region: regions.value(row).to_owned(),
                device_hash: hashes.value(row).to_owned(),
                values: columns
                    .iter()
                    .zip(&measures)
                    .map(|(c, a)| cell(c.kind, a, row))
                    .collect(),
            });
        }
    }
    Ok(out)
}

fn cell(kind: TierColumnType, array: &ArrayRef, row: usize) -> Value {
    if array.is_null(row) {
        return Value::Null;
    }
    match kind {
        TierColumnType::Text => Value::from(array.as_string::<i32>().value(row)),
        TierColumnType::Int => Value::from(array.as_primitive::<Int32Type>().value(row)),
        TierColumnType::Bigint => Value::from(array.as_primitive::<Int64Type>().value(row)),
        TierColumnType::Real => real_value(array.as_primitive::<Float32Type>().value(row)),
        TierColumnType::Double => Value::from(array.as_primitive::<Float64Type>().value(row)),
        TierColumnType::Boolean => Value::from(array.as_boolean().value(row)),
    }
}

/// The files of one device's day, by name.
pub async fn day_files(
    store: &dyn ObjectStore,
    dir: &Path,
) -> object_store::Result<BTreeMap<String, Path>> {
    let listed: Vec<_> = store.list(Some(dir)).try_collect().await?;
    Ok(listed
        .into_iter()
        .filter_map(|m| {
            let name = m.location.filename()?.to_owned();
            name.ends_with(".parquet").then_some((name, m.location))
        })
        .collect())
}

/// Reads one cold file.
pub async fn read_file(
    store: &dyn ObjectStore,
    columns: &[TierColumn],
    path: &Path,
) -> Result<Vec<Heartbeat>, ColdError> {
    let bytes = store.get(path).await?.bytes().await?;
    decode(columns, bytes).map_err(|e| ColdError::Corrupt(path.to_string(), e))
}

/// Merges `rows` into the late file of their device and day (all of one device and day; the
/// last of a time wins), leaving out times an aged file of that day already holds.
pub async fn write_late(
    store: &dyn ObjectStore,
    root: &Path,
    columns: &[TierColumn],
    rows: &[&Heartbeat],
) -> Result<usize, ColdError> {
    let Some(first) = rows.first() else {
        return Ok(0);
    };
    let dir = day_dir(root, &first.device_id, &day_of(first.ts_micros));
    let files = day_files(store, &dir).await?;
    let mut merged: BTreeMap<i64, Heartbeat> = BTreeMap::new();
    let mut aged = std::collections::HashSet::new();
    for (name, path) in &files {
        let held = read_file(store, columns, path).await?;
        if name == LATE_FILE {
            merged.extend(held.into_iter().map(|h| (h.ts_micros, h)));
        } else {
            aged.extend(held.into_iter().map(|h| h.ts_micros));
        }
    }
    for h in rows {
        if !aged.contains(&h.ts_micros) {
            merged.insert(h.ts_micros, (*h).clone());
        }
    }
    if merged.is_empty() {
        return Ok(0);
    }
    let refs: Vec<&Heartbeat> = merged.values().collect();
    let bytes = encode(columns, &refs).map_err(|e| ColdError::Corrupt(dir.to_string(), e))?;
    crate::sinks::parquet::put(store, &dir.clone().join(LATE_FILE), bytes).await?;
    Ok(refs.len())
}

/// A cold-tier failure.
#[derive(Debug, thiserror::Error)]
pub enum ColdError {
    /// The object store failed.
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    /// A file is not a cold file of this layout.
    #[error("{0}: not a readable cold file: {1}")]
    Corrupt(String, String),
}

#[cfg(test)]
mod tests {
    use refract_schemas::config::TierColumnType;
    use serde_json::json;

    use super::*;

    fn columns() -> Vec<TierColumn> {
        [
            ("battery", TierColumnType::Real),
            ("signal", TierColumnType::Int),
            ("lat", TierColumnType::Double),
            ("note", TierColumnType::Text),
            ("n", TierColumnType::Bigint),
            ("ok", TierColumnType::Boolean),
        ]
        .into_iter()
        .map(|(n, k)| TierColumn {
            name: n.into(),
            kind: k,
        })
        .collect()
    }

    fn hb(device: &str, ts: i64, battery: Value) -> Heartbeat {
        Heartbeat {
            device_id: device.into(),
            region: "EU".into(),
            device_hash: "abcd".into(),
            ts_micros: ts,
            values: vec![
                battery,
                json!(-70),
                json!(52.123456789),
                json!("x"),
                json!(1i64 << 40),
                json!(true),
            ],
        }
    }

    #[test]
    fn files_round_trip_every_type() {
        let rows = [hb("d1", 1, json!(0.1)), hb("d1", 2, Value::Null)];
        let refs: Vec<&Heartbeat> = rows.iter().collect();
        let bytes = encode(&columns(), &refs).unwrap();
        assert_eq!(decode(&columns(), bytes).unwrap(), rows);
    }

    #[tokio::test]
    async fn late_files_merge_and_skip_what_aging_holds() {
        let store = object_store::memory::InMemory::new();
        let root = Path::from("cold");
        let day = 1_770_249_600_000_000;
        // An aged file holds the time `day`.
        let aged = [hb("d1", day, json!(0.5))];
        let dir = day_dir(&root, "d1", &day_of(day));
        let bytes = encode(&columns(), &aged.iter().collect::<Vec<_>>()).unwrap();
        store
            .put(&dir.clone().join(aged_file(7)), bytes.into())
            .await
            .unwrap();
        let first = [hb("d1", day, json!(0.1)), hb("d1", day + 1, json!(0.2))];
        let n = write_late(&store, &root, &columns(), &first.iter().collect::<Vec<_>>())
            .await
            .unwrap();
        assert_eq!(n, 1, "the aged time is left out");
        // Replayed, and a newer value for day + 1, and a new time.
        let second = [hb("d1", day + 1, json!(0.3)), hb("d1", day + 2, json!(0.4))];
        write_late(
            &store,
            &root,
            &columns(),
            &second.iter().collect::<Vec<_>>(),
        )
        .await
        .unwrap();
        let late = read_file(&store, &columns(), &dir.clone().join(LATE_FILE))
            .await
            .unwrap();
        assert_eq!(late, vec![second[0].clone(), second[1].clone()]);
        assert_eq!(day_files(&store, &dir).await.unwrap().len(), 2);
    }
}
