//! Compaction: `{table}/current/part-0.parquet` rebuilt from the change log.
//!
//! The previous current state (which records the newest position merged into it) is merged with
//! every change-log row past that position: per key, the row with the highest `_position` wins
//! and a delete removes the key; in an exploded table (`refract.group` metadata) the newest
//! position of a group brings all of the group's rows; a truncate removes every older row.
//! Columns added over time are unified (null where a file lacked them). The new state is
//! published with one atomic PUT, so readers see the old or the new state, never a mix.
//! Change-log files older than `change_retention_days` that are merged are deleted.
//!
//! Memory: the table's current state and its new changes are held in memory while merging.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, StringArray, new_null_array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use refract_schemas::Offset;
use refract_schemas::config::{ParquetSinkConfig, mask_url};

use super::encode::{self, META_GROUP, META_KEY, META_MERGED_THROUGH, OP, POSITION};
use super::{classify, put};
use crate::SinkError;

/// Rows per record batch when reading.
const READ_BATCH_ROWS: usize = 64 * 1024;

/// What a compaction did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CompactReport {
    /// Tables whose current state was rebuilt.
    pub tables: u64,
    /// Rows in the current states written.
    pub rows: u64,
    /// Change-log files read.
    pub files_read: u64,
    /// Change-log files deleted by retention.
    pub files_deleted: u64,
}

/// A change-log file, from its path.
#[derive(Debug, Clone)]
pub(crate) struct ChangeFile {
    pub path: Path,
    pub dir: Path,
    pub table: String,
    /// `YYYY-MM-DD`.
    pub date: String,
    pub first: Offset,
    pub last: Offset,
    pub partition: String,
}

fn parse_offset(text: &str) -> Option<Offset> {
    let (a, b) = text.split_once('.')?;
    Some(Offset(a.parse().ok()?, b.parse().ok()?))
}

/// Parses `{table}/changes/date=D/{first}-{last}-{hash}.parquet` below `root`.
fn parse_change_file(root: &Path, path: &Path) -> Option<ChangeFile> {
    let parts: Vec<_> = path
        .prefix_match(root)?
        .map(|p| p.as_ref().to_owned())
        .collect();
    let [table, changes, date, name] = parts.as_slice() else {
        return None;
    };
    let date = date.strip_prefix("date=")?;
    let stem = name.strip_suffix(".parquet")?;
    let mut fields = stem.split('-');
    let (first, last, partition) = (fields.next()?, fields.next()?, fields.next()?);
    if changes != "changes" || fields.next().is_some() {
        return None;
    }
    Some(ChangeFile {
        dir: root
            .clone()
            .join(table.as_str())
            .join("changes")
            .join(format!("date={date}").as_str()),
        path: path.clone(),
        table: table.clone(),
        date: date.to_owned(),
        first: parse_offset(first)?,
        last: parse_offset(last)?,
        partition: partition.to_owned(),
    })
}

/// The change-log files under `root` (of one table, or all), in position order.
pub(crate) async fn list_change_files(
    store: &dyn ObjectStore,
    root: &Path,
    table: Option<&str>,
) -> object_store::Result<Vec<ChangeFile>> {
    let prefix = match table {
        Some(t) => root.clone().join(t).join("changes"),
        None => root.clone(),
    };
    let objects: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
    let mut files: Vec<ChangeFile> = objects
        .iter()
        .filter_map(|o| parse_change_file(root, &o.location))
        .collect();
    files.sort_by(|a, b| (a.first, a.last).cmp(&(b.first, b.last)));
    Ok(files)
}

/// Reads a whole Parquet object: its record batches and its Arrow schema.
async fn read(
    store: &dyn ObjectStore,
    path: &Path,
) -> Result<(SchemaRef, Vec<RecordBatch>), String> {
    let bytes = store
        .get(path)
        .await
        .map_err(|e| e.to_string())?
        .bytes()
        .await
        .map_err(|e| e.to_string())?;
    decode(path, bytes)
}

/// Keeps the rows of `batch` at or before `through` (by `_position`); `None` if none.
fn rows_through(
    batch: &RecordBatch,
    through: &str,
    after: bool,
) -> Result<Option<RecordBatch>, String> {
    let positions = string_column(batch, POSITION)?;
    let keep: BooleanArray = positions
        .iter()
        .map(|p| Some(p.is_some_and(|p| (p <= through) != after)))
        .collect();
    if keep.true_count() == 0 {
        return Ok(None);
    }
    arrow_select::filter::filter_record_batch(batch, &keep)
        .map(Some)
        .map_err(|e| e.to_string())
}

fn string_column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a StringArray, String> {
    batch
        .column_by_name(name)
        .and_then(|c| c.as_any().downcast_ref::<StringArray>())
        .ok_or_else(|| format!("no text column `{name}`"))
}

/// The rows of `file` at or before `checkpoint`, as a new file: `(last position kept, bytes)`,
/// or `None` when no row is that old.
pub(crate) async fn cut_back(
    store: &dyn ObjectStore,
    file: &ChangeFile,
    checkpoint: Offset,
) -> Result<Option<(Offset, bytes::Bytes)>, String> {
    let (schema, batches) = read(store, &file.path).await?;
    let through = checkpoint.sortable();
    let mut kept = Vec::new();
    let mut last = None;
    for batch in &batches {
        if let Some(b) = rows_through(batch, &through, false)? {
            let positions = string_column(&b, POSITION)?;
            last = last.max(positions.iter().flatten().max().map(str::to_owned));
            kept.push(b);
        }
    }
    let Some(last) = last.and_then(|l| parse_offset(&l)) else {
        return Ok(None);
    };
    let bytes = write_file(
        &schema,
        &kept,
        encode::properties(
            refract_schemas::config::DEFAULT_ZSTD_LEVEL,
            refract_schemas::config::DEFAULT_ROW_GROUP_ROWS,
        ),
    )?;
    Ok(Some((last, bytes)))
}

fn write_file(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    properties: parquet::file::properties::WriterProperties,
) -> Result<bytes::Bytes, String> {
    let mut writer = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(properties))
        .map_err(|e| e.to_string())?;
    for b in batches {
        writer.write(b).map_err(|e| e.to_string())?;
    }
    writer
        .into_inner()
        .map(bytes::Bytes::from)
        .map_err(|e| e.to_string())
}

/// Rebuilds `current/` of every table under the sink's URL (tables in parallel).
pub async fn compact(sink: &str, config: &ParquetSinkConfig) -> Result<CompactReport, SinkError> {
    let (store, root) = crate::sinks::object_json::open_store(&config.url).map_err(|message| {
        SinkError::Permanent {
            sink: sink.to_owned(),
            message: format!("cannot open `{}`: {message}", mask_url(&config.url)),
            source: None,
        }
    })?;
    let files = list_change_files(&*store, &root, None)
        .await
        .map_err(|e| classify(sink, "cannot list the change log".into(), e))?;
    let mut by_table: BTreeMap<String, Vec<ChangeFile>> = BTreeMap::new();
    for f in files {
        by_table.entry(f.table.clone()).or_default().push(f);
    }
    let tables = by_table.into_iter().map(|(table, files)| {
        let (store, root) = (store.clone(), root.clone());
        async move {
            compact_table(store, &root, &table, &files, config)
                .await
                .map_err(|message| SinkError::Transient {
                    sink: sink.to_owned(),
                    message: format!("cannot compact `{table}`: {message}"),
                    source: None,
                })
        }
    });
    let mut report = CompactReport::default();
    for r in futures::future::try_join_all(tables).await? {
        report.tables += r.tables;
        report.rows += r.rows;
        report.files_read += r.files_read;
        report.files_deleted += r.files_deleted;
    }
    Ok(report)
}

/// Decodes a whole Parquet file: its Arrow schema and record batches.
fn decode(path: &Path, bytes: bytes::Bytes) -> Result<(SchemaRef, Vec<RecordBatch>), String> {
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(bytes).map_err(|e| format!("{path}: {e}"))?;
    let schema = builder.schema().clone();
    let reader = builder
        .with_batch_size(READ_BATCH_ROWS)
        .build()
        .map_err(|e| format!("{path}: {e}"))?;
    let batches = reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path}: {e}"))?;
    Ok((schema, batches))
}

async fn compact_table(
    store: Arc<dyn ObjectStore>,
    root: &Path,
    table: &str,
    files: &[ChangeFile],
    config: &ParquetSinkConfig,
) -> Result<CompactReport, String> {
    let mut report = CompactReport::default();
    let current = root
        .clone()
        .join(table)
        .join("current")
        .join("part-0.parquet");
    let previous = match store.get(&current).await {
        Ok(r) => Some(r.bytes().await.map_err(|e| e.to_string())?),
        Err(object_store::Error::NotFound { .. }) => None,
        Err(e) => return Err(e.to_string()),
    };
    // What the previous state merged is known from its footer: read it before fetching the log.
    let merged_through = match &previous {
        Some(bytes) => ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
            .map_err(|e| format!("{current}: {e}"))?
            .schema()
            .metadata()
            .get(META_MERGED_THROUGH)
            .cloned()
            .unwrap_or_default(),
        None => String::new(),
    };
    let mut fetched = Vec::new();
    for file in files {
        if !merged_through.is_empty() && file.last.sortable() <= merged_through {
            continue;
        }
        let bytes = store
            .get(&file.path)
            .await
            .map_err(|e| e.to_string())?
            .bytes()
            .await
            .map_err(|e| e.to_string())?;
        fetched.push((file.path.clone(), bytes));
    }
    if fetched.is_empty() && previous.is_some() {
        report.files_deleted = retain(&*store, files, config, &merged_through).await?;
        return Ok(report);
    }
    report.files_read = fetched.len() as u64;
    let (current_path, level, rows_per_group) =
        (current.clone(), config.zstd_level, config.row_group_rows);
    let merged = tokio::task::spawn_blocking(move || {
        merge(
            previous.map(|b| (current_path, b)),
            fetched,
            &merged_through,
            level,
            rows_per_group,
        )
    })
    .await
    .map_err(|e| format!("the merge task failed: {e}"))??;
    put(&*store, &current, merged.bytes)
        .await
        .map_err(|e| e.to_string())?;
    if config.url.starts_with("file://") {
        // Like the change log: synced, so that a power loss cannot leave a torn current state.
        let local = std::path::Path::new("/").join(current.as_ref());
        tokio::task::spawn_blocking(move || super::sync_file_and_dir(&local))
            .await
            .map_err(|e| format!("the sync task failed: {e}"))?
            .map_err(|e| format!("cannot sync {current}: {e}"))?;
    }

    report.tables = 1;
    report.rows = merged.rows as u64;
    tracing::debug!(table, rows = merged.rows, "current state rebuilt");
    report.files_deleted = retain(&*store, files, config, &merged.through).await?;
    Ok(report)
}

/// Deletes the change-log files older than `change_retention_days` (by date partition) that
/// the current state has merged (`merged_through`); returns how many.
async fn retain(
    store: &dyn ObjectStore,
    files: &[ChangeFile],
    config: &ParquetSinkConfig,
    merged_through: &str,
) -> Result<u64, String> {
    if config.change_retention_days == 0 || merged_through.is_empty() {
        return Ok(0);
    }
    let cutoff = chrono::Utc::now().date_naive()
        - chrono::Days::new(u64::from(config.change_retention_days));
    let cutoff = cutoff.format("%Y-%m-%d").to_string();
    let mut deleted = 0;
    for file in files {
        if file.date < cutoff && file.last.sortable().as_str() <= merged_through {
            match store.delete(&file.path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
                Err(e) => return Err(e.to_string()),
            }
        }
    }
    Ok(deleted)
}

/// A merged current state.
struct Merged {
    bytes: bytes::Bytes,
    rows: usize,
    /// The newest position merged.
    through: String,
}

/// Merges the previous current state with the change-log files past it (CPU work: decoding,
/// hashing keys, gathering rows, encoding).
fn merge(
    previous: Option<(Path, bytes::Bytes)>,
    changes: Vec<(Path, bytes::Bytes)>,
    merged_through: &str,
    zstd_level: i32,
    row_group_rows: usize,
) -> Result<Merged, String> {
    let mut batches: Vec<RecordBatch> = Vec::new();
    let mut metadata: HashMap<String, String> = HashMap::new();
    if let Some((path, bytes)) = previous {
        let (schema, read) = decode(&path, bytes)?;
        metadata = schema.metadata().clone();
        batches.extend(read);
    }
    let previous_batches = batches.len();
    let mut newest = merged_through.to_owned();
    for (path, bytes) in changes {
        let (schema, read) = decode(&path, bytes)?;
        metadata.extend(
            schema
                .metadata()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        for b in read {
            let b = if merged_through.is_empty() {
                Some(b)
            } else {
                rows_through(&b, merged_through, true)?
            };
            if let Some(b) = b {
                if let Some(max) = string_column(&b, POSITION)?.iter().flatten().max() {
                    if *max > *newest {
                        newest = max.to_owned();
                    }
                }
                batches.push(b);
            }
        }
    }
    let names = |key: &str| -> Vec<String> {
        metadata
            .get(key)
            .map(|k| {
                k.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let key = names(META_KEY);
    let group = names(META_GROUP);
    if key.is_empty() {
        return Err("the change log does not say which columns are the key".into());
    }
    // The unified columns: every data column ever written, with its (non-null) type.
    let mut fields: Vec<Field> = Vec::new();
    for b in &batches {
        for f in b.schema().fields() {
            if f.name() == OP {
                continue;
            }
            match fields.iter_mut().find(|x| x.name() == f.name()) {
                Some(x) if *x.data_type() == DataType::Null => *x = f.as_ref().clone(),
                Some(x) if *f.data_type() != DataType::Null && x.data_type() != f.data_type() => {
                    // A declared type changed in the pipeline file, or types were learned anew
                    // after the state was deleted: merging would silently null one of them.
                    return Err(format!(
                        "column `{}` is {} in some change-log files and {} in others; \
                         rewrite or remove the older files (or the current state) before compacting",
                        f.name(),
                        x.data_type(),
                        f.data_type()
                    ));
                }
                Some(_) => {}
                None => fields.push(f.as_ref().clone()),
            }
        }
    }
    let positions: Vec<&StringArray> = batches
        .iter()
        .map(|b| string_column(b, POSITION))
        .collect::<Result<_, _>>()?;
    let ops: Vec<Option<&StringArray>> = batches
        .iter()
        .enumerate()
        .map(|(bi, b)| {
            if bi < previous_batches {
                Ok(None)
            } else {
                string_column(b, OP).map(Some)
            }
        })
        .collect::<Result<_, _>>()?;
    let columns_of = |names: &[String]| -> Vec<Vec<Option<ArrayRef>>> {
        batches
            .iter()
            .map(|b| names.iter().map(|k| b.column_by_name(k).cloned()).collect())
            .collect()
    };
    // Winners per key (or, in an exploded table, per group): the row with the newest position.
    let by = columns_of(if group.is_empty() { &key } else { &group });
    let numbers: Vec<Vec<u128>> = positions
        .iter()
        .map(|p| p.iter().map(|t| t.map_or(0, position_number)).collect())
        .collect();
    let mut winners: PrehashedMap<(u32, u32)> = PrehashedMap::default();
    let mut truncated = 0u128;
    for bi in 0..batches.len() {
        let op = ops[bi];
        for r in 0..batches[bi].num_rows() {
            let position = numbers[bi][r];
            if op.is_some_and(|o| o.value(r) == "t") {
                truncated = truncated.max(position);
                continue;
            }
            let k = row_hash(&by[bi], r);
            match winners.get_mut(&k) {
                Some((wb, wr)) => {
                    if numbers[*wb as usize][*wr as usize] < position {
                        (*wb, *wr) = (bi as u32, r as u32);
                    }
                }
                None => {
                    winners.insert(k, (bi as u32, r as u32));
                }
            }
        }
    }
    let is_upsert = |bi: usize, r: usize| ops[bi].is_none_or(|o| o.value(r) == "u");
    let mut picked: Vec<(usize, usize)> = Vec::new();
    if group.is_empty() {
        picked.extend(
            winners
                .into_values()
                .map(|(b, r)| (b as usize, r as usize))
                .filter(|&(b, r)| is_upsert(b, r) && numbers[b][r] > truncated),
        );
        picked.sort_unstable();
    } else {
        // Every upsert row of a group at the group's newest position, each key once (a
        // replayed file may hold the same change twice).
        let full = columns_of(&key);
        let mut seen: PrehashedMap<()> = PrehashedMap::default();
        for bi in 0..batches.len() {
            for r in 0..batches[bi].num_rows() {
                if !is_upsert(bi, r) {
                    continue;
                }
                let position = numbers[bi][r];
                let Some(&(wb, wr)) = winners.get(&row_hash(&by[bi], r)) else {
                    continue;
                };
                let winning = numbers[wb as usize][wr as usize];
                if position == winning
                    && position > truncated
                    && is_upsert(wb as usize, wr as usize)
                    && seen.insert(row_hash(&full[bi], r), ()).is_none()
                {
                    picked.push((bi, r));
                }
            }
        }
    }
    let mut out_metadata: HashMap<String, String> =
        HashMap::from([(META_KEY.to_owned(), key.join(","))]);
    if !group.is_empty() {
        out_metadata.insert(META_GROUP.to_owned(), group.join(","));
    }
    out_metadata.insert(META_MERGED_THROUGH.to_owned(), newest.clone());
    if let Some(v) = metadata.get(encode::META_SCHEMA_VERSION) {
        out_metadata.insert(encode::META_SCHEMA_VERSION.to_owned(), v.clone());
    }
    // Unify every batch to the final columns, then gather the winners.
    let schema: SchemaRef = Arc::new(Schema::new_with_metadata(fields.clone(), out_metadata));
    let unified: Vec<RecordBatch> = batches
        .iter()
        .map(|b| {
            let columns: Vec<ArrayRef> = fields
                .iter()
                .map(|f| match b.column_by_name(f.name()) {
                    Some(c) if c.data_type() == f.data_type() => c.clone(),
                    _ => new_null_array(f.data_type(), b.num_rows()),
                })
                .collect();
            RecordBatch::try_new(schema.clone(), columns).map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let refs: Vec<&RecordBatch> = unified.iter().collect();
    let mut out = Vec::new();
    for chunk in picked.chunks(row_group_rows.max(1)) {
        out.push(
            arrow_select::interleave::interleave_record_batch(&refs, chunk)
                .map_err(|e| e.to_string())?,
        );
    }
    let rows = picked.len();
    let bytes = write_file(
        &schema,
        &out,
        encode::properties(zstd_level, row_group_rows),
    )?;
    Ok(Merged {
        bytes,
        rows,
        through: newest,
    })
}

/// A 128-bit FNV-1a hash of a row's values in `columns`: keys are compared by hash, and a
/// collision among billions of keys is negligible (the data is not adversarial).
fn row_hash(columns: &[Option<ArrayRef>], row: usize) -> u128 {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Date32Type, Float64Type, Int64Type, TimestampMicrosecondType};
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013B;
    let mut hash: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    let mut feed = |bytes: &[u8], tag: u8| {
        for &b in std::iter::once(&tag).chain(bytes) {
            hash ^= u128::from(b);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    for column in columns {
        let Some(c) = column else {
            feed(&[], 0);
            continue;
        };
        if c.is_null(row) {
            feed(&[], 1);
            continue;
        }
        match c.data_type() {
            DataType::Utf8 => feed(c.as_string::<i32>().value(row).as_bytes(), 2),
            DataType::Int64 => feed(&c.as_primitive::<Int64Type>().value(row).to_le_bytes(), 3),
            DataType::Float64 => feed(&c.as_primitive::<Float64Type>().value(row).to_le_bytes(), 4),
            DataType::Boolean => feed(&[u8::from(c.as_boolean().value(row))], 5),
            DataType::Date32 => feed(&c.as_primitive::<Date32Type>().value(row).to_le_bytes(), 6),
            DataType::Timestamp(..) => feed(
                &c.as_primitive::<TimestampMicrosecondType>()
                    .value(row)
                    .to_le_bytes(),
                7,
            ),
            _ => feed(&[], 8),
        }
    }
    hash
}

/// Hashes `u128` keys that are hashes already: their low bits are the hash.
#[derive(Default)]
struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

type PrehashedMap<V> = HashMap<u128, V, std::hash::BuildHasherDefault<Prehashed>>;

/// A `_position` text (`{major:020}.{minor:020}`) as one number that sorts the same.
fn position_number(text: &str) -> u128 {
    let (major, minor) = text.split_once('.').unwrap_or((text, "0"));
    (u128::from(major.parse::<u64>().unwrap_or(0)) << 64)
        | u128::from(minor.parse::<u64>().unwrap_or(0))
}
