//! Compaction: `{table}/current/part-0.parquet` rebuilt from the change log.
//!
//! The previous current state (which records the newest position merged into it) is merged with
//! every change-log row past that position: per key, the row with the highest `_position` wins
//! and a delete removes the key; in an exploded table (`refract.group` metadata) the newest
//! position of a group brings all of the group's rows; a truncate removes every older row.
//! Columns added over time are unified (null where a file lacked them). The new state is
//! published with one atomic PUT (a multipart upload past
//! [`MULTIPART_THRESHOLD`](super::MULTIPART_THRESHOLD), which the store exposes only once
//! complete), so readers see the old or the new state, never a mix.
//! Change-log files older than `change_retention_days` that are merged are deleted.
//!
//! **Two compactions at once** (the daemon's, and `refract compact` run from another host on
//! the same store): the one that would publish second publishes only if the current state is
//! still the one it merged from; when another compaction published meanwhile, it leaves that
//! newer state in place and deletes nothing. Without the condition, the slower one put back an
//! older state, and when the faster one's retention had deleted change files the older state
//! lacked, their rows were gone from `current/` for good. (On one host, `refract compact`
//! refuses to run beside the pipeline's daemon.) Where the store cannot put on a condition, the
//! check and the PUT are two requests: see [`publish`].
//!
//! Memory does not grow with the table: every input is spooled to a local working directory
//! (`$TMPDIR/refract-compact-*`, removed when done) a part at a time, the merge reads and
//! writes local files (see [`merge`](super::merge)), and a new state past one PUT goes up in
//! parts read from its file. The working directory needs room for the inputs (as stored), the
//! new state and the spill files (57 bytes a row).

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::{Array, BooleanArray, RecordBatch, StringArray};
use arrow_schema::SchemaRef;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use refract_schemas::Offset;
use refract_schemas::config::ParquetSinkConfig;

use super::encode::{self, META_MERGED_THROUGH, POSITION};
use super::{classify, put, put_file};
use crate::SinkError;

/// Rows per record batch when reading.
pub(super) const READ_BATCH_ROWS: usize = 64 * 1024;

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
    /// Row groups copied into the current states as they were (inputs whose rows all survive),
    /// without decoding or encoding them again.
    pub row_groups_copied: u64,
    /// Tables whose current state another compaction published while this one merged: its
    /// newer state was left in place.
    pub superseded: u64,
    /// Key-hash partitions the survivors were chosen in, one at a time (summed over tables).
    pub partitions: u64,
    /// The most survivor records one table's compaction held in memory at once (the largest
    /// over tables).
    pub peak_records: u64,
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

pub(super) fn string_column<'a>(
    batch: &'a RecordBatch,
    name: &str,
) -> Result<&'a StringArray, String> {
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
    let (store, root) =
        crate::sinks::object_json::open_store(config.url.expose()).map_err(|message| {
            SinkError::Permanent {
                sink: sink.to_owned(),
                message: format!("cannot open `{}`: {message}", config.url.masked()),
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
            compact_table(
                store,
                &root,
                &table,
                &files,
                config,
                super::survivors::PARTITION_ROWS,
                std::future::ready(()),
            )
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
        report.row_groups_copied += r.row_groups_copied;
        report.superseded += r.superseded;
        report.partitions += r.partitions;
        report.peak_records = report.peak_records.max(r.peak_records);
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

/// Rebuilds `current/` of `table` from `files`, choosing survivors about `partition_rows`
/// records at a time; `before_publish` runs once the new state is merged, before it is checked
/// and published (tests publish another state there).
pub(super) async fn compact_table(
    store: Arc<dyn ObjectStore>,
    root: &Path,
    table: &str,
    files: &[ChangeFile],
    config: &ParquetSinkConfig,
    partition_rows: usize,
    before_publish: impl std::future::Future<Output = ()>,
) -> Result<CompactReport, String> {
    let mut report = CompactReport::default();
    let current = root
        .clone()
        .join(table)
        .join("current")
        .join("part-0.parquet");
    // Inputs, spill files and the new state, removed when dropped.
    let work = tempfile::Builder::new()
        .prefix("refract-compact-")
        .tempdir()
        .map_err(|e| format!("cannot create a working directory for compaction: {e}"))?;
    // The state merged from, and which version of the object it was.
    let (previous, merged_from) = match store.get(&current).await {
        Ok(r) => {
            let meta = r.meta.clone();
            (
                Some(spool(r, &work.path().join("previous")).await?),
                Some(meta),
            )
        }
        Err(object_store::Error::NotFound { .. }) => (None, None),
        Err(e) => return Err(e.to_string()),
    };
    // What the previous state merged is known from its footer: read it before fetching the log.
    let merged_through = match &previous {
        Some(file) => {
            let file = file.try_clone().map_err(|e| format!("{current}: {e}"))?;
            ParquetRecordBatchReaderBuilder::try_new(file)
                .map_err(|e| format!("{current}: {e}"))?
                .schema()
                .metadata()
                .get(META_MERGED_THROUGH)
                .cloned()
                .unwrap_or_default()
        }
        None => String::new(),
    };
    let mut fetched = Vec::new();
    for file in files {
        if !merged_through.is_empty() && file.last.sortable() <= merged_through {
            continue;
        }
        let got = store.get(&file.path).await.map_err(|e| e.to_string())?;
        let local = work.path().join(format!("change-{}", fetched.len()));
        fetched.push((file.path.clone(), spool(got, &local).await?));
    }
    if fetched.is_empty() && previous.is_some() {
        report.files_deleted = retain(&*store, files, config, &merged_through).await?;
        return Ok(report);
    }
    report.files_read = fetched.len() as u64;
    let (current_path, level, rows_per_group) =
        (current.clone(), config.zstd_level, config.row_group_rows);
    let dir = work.path().to_owned();
    let merged = tokio::task::spawn_blocking(move || {
        let workspace = super::merge::Workspace {
            dir: &dir,
            partition_rows,
        };
        super::merge::merge(
            previous.map(|f| (current_path, f)),
            fetched,
            &merged_through,
            level,
            rows_per_group,
            &workspace,
        )
    })
    .await
    .map_err(|e| format!("the merge task failed: {e}"))??;
    before_publish.await;
    if !publish(&*store, &current, &merged, merged_from.as_ref()).await? {
        tracing::warn!(
            table,
            "another compaction published the current state while this one merged: its newer \
             state is kept, and this one's result dropped"
        );
        report.superseded = 1;
        return Ok(report);
    }
    drop(work);
    // On `file://` the store synced the new state before the PUT returned (`open_store`).
    report.tables = 1;
    report.rows = merged.rows as u64;
    report.row_groups_copied = merged.copied as u64;
    report.partitions = merged.partitions as u64;
    report.peak_records = merged.peak_records as u64;
    tracing::debug!(
        table,
        rows = merged.rows,
        copied = merged.copied,
        partitions = merged.partitions,
        "current state rebuilt"
    );
    report.files_deleted = retain(&*store, files, config, &merged.through).await?;
    Ok(report)
}

/// Writes an object being fetched to the local file `to` (a part at a time, never whole in
/// memory); returns the file, open for reading.
async fn spool(
    got: object_store::GetResult,
    to: &std::path::Path,
) -> Result<std::fs::File, String> {
    use tokio::io::AsyncWriteExt;
    let failed = |e: std::io::Error| format!("cannot write {}: {e}", to.display());
    let mut file = tokio::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(to)
        .await
        .map_err(failed)?;
    let mut parts = got.into_stream();
    while let Some(part) = parts.try_next().await.map_err(|e| e.to_string())? {
        file.write_all(&part).await.map_err(failed)?;
    }
    file.flush().await.map_err(failed)?;
    Ok(file.into_std().await)
}

/// Publishes the merged state as the current state unless another compaction published since
/// it was read as `merged_from` (`None`: there was none); returns whether it did.
///
/// Where the store can put on a condition (Azure, GCS, S3 with `AWS_CONDITIONAL_PUT=etag`; the
/// local backend for a first state), the PUT itself carries it. Otherwise (the local backend
/// over an existing state, S3 without the option, and states past one PUT, which go up in parts
/// from the local file) the object's metadata is compared just before an unconditional upload:
/// a publish between the two is not seen.
async fn publish(
    store: &dyn ObjectStore,
    current: &Path,
    merged: &super::merge::Merged,
    merged_from: Option<&object_store::ObjectMeta>,
) -> Result<bool, String> {
    use object_store::{PutMode, PutOptions, UpdateVersion};
    let failed = |e: std::io::Error| format!("cannot read {}: {e}", merged.file.display());
    if merged.size <= super::MULTIPART_THRESHOLD as u64 {
        let bytes = bytes::Bytes::from(tokio::fs::read(&merged.file).await.map_err(failed)?);
        let mode = match merged_from {
            Some(m) => PutMode::Update(UpdateVersion {
                e_tag: m.e_tag.clone(),
                version: m.version.clone(),
            }),
            None => PutMode::Create,
        };
        let options = PutOptions::from(mode);
        match store.put_opts(current, bytes.clone().into(), options).await {
            Ok(_) => return Ok(true),
            Err(
                object_store::Error::Precondition { .. }
                | object_store::Error::AlreadyExists { .. },
            ) => return Ok(false),
            Err(object_store::Error::NotImplemented { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
        if overtaken(store, current, merged_from).await? {
            return Ok(false);
        }
        put(store, current, bytes)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(true);
    }
    if overtaken(store, current, merged_from).await? {
        return Ok(false);
    }
    put_file(store, current, &merged.file)
        .await
        .map_err(|e| e.to_string())?;
    Ok(true)
}

/// Whether the object at `current` is no longer the one merged from (`merged_from`, `None` when
/// there was none): another compaction published since. A state deleted meanwhile is not newer.
async fn overtaken(
    store: &dyn ObjectStore,
    current: &Path,
    merged_from: Option<&object_store::ObjectMeta>,
) -> Result<bool, String> {
    let now = match store.head(current).await {
        Ok(meta) => meta,
        Err(object_store::Error::NotFound { .. }) => return Ok(false),
        Err(e) => return Err(e.to_string()),
    };
    Ok(merged_from.is_none_or(|then| {
        (&then.e_tag, &then.version, then.last_modified, then.size)
            != (&now.e_tag, &now.version, now.last_modified, now.size)
    }))
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
