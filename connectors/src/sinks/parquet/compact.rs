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
    let through = encode::position_text(checkpoint);
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

/// Rebuilds `current/` of every table under the sink's URL.
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
    let mut report = CompactReport::default();
    for (table, files) in by_table {
        compact_table(&*store, &root, &table, &files, config, &mut report)
            .await
            .map_err(|message| SinkError::Transient {
                sink: sink.to_owned(),
                message: format!("cannot compact `{table}`: {message}"),
                source: None,
            })?;
    }
    Ok(report)
}

/// One winning row: its position and where it is.
struct Winner {
    position: String,
    delete: bool,
    rows: Vec<(usize, usize)>,
}

async fn compact_table(
    store: &dyn ObjectStore,
    root: &Path,
    table: &str,
    files: &[ChangeFile],
    config: &ParquetSinkConfig,
    report: &mut CompactReport,
) -> Result<(), String> {
    let current = root
        .clone()
        .join(table)
        .join("current")
        .join("part-0.parquet");
    let mut batches: Vec<RecordBatch> = Vec::new();
    let mut merged_through = String::new();
    let mut metadata: HashMap<String, String> = HashMap::new();
    match read(store, &current).await {
        Ok((schema, previous)) => {
            merged_through = schema
                .metadata()
                .get(META_MERGED_THROUGH)
                .cloned()
                .unwrap_or_default();
            metadata = schema.metadata().clone();
            batches.extend(previous);
        }
        Err(e) if e.contains("not found") || e.contains("NotFound") => {}
        Err(e) => return Err(e),
    }
    let previous_batches = batches.len();
    let mut newest = merged_through.clone();
    for file in files {
        if !merged_through.is_empty() && encode::position_text(file.last) <= merged_through {
            continue;
        }
        let (schema, read_batches) = read(store, &file.path).await?;
        report.files_read += 1;
        metadata.extend(
            schema
                .metadata()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        for b in read_batches {
            let b = if merged_through.is_empty() {
                Some(b)
            } else {
                rows_through(&b, &merged_through, true)?
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
    if batches.len() == previous_batches && previous_batches > 0 {
        return Ok(());
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
                Some(_) => {}
                None => fields.push(f.as_ref().clone()),
            }
        }
    }
    // Winners per key (or group).
    let by = if group.is_empty() { &key } else { &group };
    let mut winners: HashMap<String, Winner> = HashMap::new();
    let mut truncated = String::new();
    for (bi, b) in batches.iter().enumerate() {
        let positions = string_column(b, POSITION)?;
        let ops = if bi < previous_batches {
            None
        } else {
            Some(string_column(b, OP)?)
        };
        let key_columns: Vec<Option<&ArrayRef>> = by.iter().map(|k| b.column_by_name(k)).collect();
        for r in 0..b.num_rows() {
            let position = positions.value(r);
            let op = ops.map_or("u", |o| o.value(r));
            if op == "t" {
                if *position > *truncated {
                    truncated = position.to_owned();
                }
                continue;
            }
            let k = row_key(&key_columns, r);
            let delete = op == "d";
            match winners.get_mut(&k) {
                Some(w) if *w.position > *position => {}
                Some(w) if *w.position == *position => {
                    if !delete {
                        w.rows.push((bi, r));
                    }
                }
                _ => {
                    winners.insert(
                        k,
                        Winner {
                            position: position.to_owned(),
                            delete,
                            rows: if delete { Vec::new() } else { vec![(bi, r)] },
                        },
                    );
                }
            }
        }
    }
    let mut picked: Vec<(usize, usize)> = Vec::new();
    let mut winners: Vec<Winner> = winners
        .into_values()
        .filter(|w| !w.delete && *w.position > *truncated)
        .collect();
    winners.sort_by(|a, b| a.position.cmp(&b.position));
    for w in winners {
        if group.is_empty() {
            picked.push(w.rows[0]);
        } else {
            // Several copies of one change (a replayed file): each row of the group once.
            let mut seen = std::collections::HashSet::new();
            for (bi, r) in w.rows {
                let cols: Vec<Option<&ArrayRef>> =
                    key.iter().map(|k| batches[bi].column_by_name(k)).collect();
                if seen.insert(row_key(&cols, r)) {
                    picked.push((bi, r));
                }
            }
        }
    }
    // Unify every batch to the final columns, then gather the winners.
    let mut out_metadata: HashMap<String, String> =
        HashMap::from([(META_KEY.to_owned(), key.join(","))]);
    if !group.is_empty() {
        out_metadata.insert(META_GROUP.to_owned(), group.join(","));
    }
    out_metadata.insert(META_MERGED_THROUGH.to_owned(), newest);
    if let Some(v) = metadata.get(encode::META_SCHEMA_VERSION) {
        out_metadata.insert(encode::META_SCHEMA_VERSION.to_owned(), v.clone());
    }
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
    for chunk in picked.chunks(config.row_group_rows.max(1)) {
        out.push(
            arrow_select::interleave::interleave_record_batch(&refs, chunk)
                .map_err(|e| e.to_string())?,
        );
    }
    let rows: usize = out.iter().map(RecordBatch::num_rows).sum();
    let bytes = write_file(
        &schema,
        &out,
        encode::properties(config.zstd_level, config.row_group_rows),
    )?;
    put(store, &current, bytes)
        .await
        .map_err(|e| e.to_string())?;
    report.tables += 1;
    report.rows += rows as u64;
    tracing::debug!(table, rows, "current state rebuilt");
    if config.change_retention_days > 0 {
        let cutoff = chrono::Utc::now().date_naive()
            - chrono::Days::new(u64::from(config.change_retention_days));
        let cutoff = cutoff.format("%Y-%m-%d").to_string();
        let merged = schema
            .metadata()
            .get(META_MERGED_THROUGH)
            .cloned()
            .unwrap_or_default();
        for file in files {
            if file.date < cutoff && encode::position_text(file.last) <= merged {
                match store.delete(&file.path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => report.files_deleted += 1,
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
    }
    Ok(())
}

/// The text of a row's key, for grouping (values joined by a unit separator).
fn row_key(columns: &[Option<&ArrayRef>], row: usize) -> String {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Date32Type, Float64Type, Int64Type, TimestampMicrosecondType};
    let mut key = String::new();
    for (i, column) in columns.iter().enumerate() {
        if i > 0 {
            key.push('\u{1f}');
        }
        let Some(c) = column else { continue };
        if c.is_null(row) {
            key.push('\u{0}');
            continue;
        }
        match c.data_type() {
            DataType::Utf8 => key.push_str(c.as_string::<i32>().value(row)),
            DataType::Int64 => key.push_str(&c.as_primitive::<Int64Type>().value(row).to_string()),
            DataType::Float64 => {
                key.push_str(&c.as_primitive::<Float64Type>().value(row).to_string())
            }
            DataType::Boolean => key.push_str(if c.as_boolean().value(row) { "t" } else { "f" }),
            DataType::Date32 => {
                key.push_str(&c.as_primitive::<Date32Type>().value(row).to_string())
            }
            DataType::Timestamp(..) => key.push_str(
                &c.as_primitive::<TimestampMicrosecondType>()
                    .value(row)
                    .to_string(),
            ),
            _ => key.push('?'),
        }
    }
    key
}
