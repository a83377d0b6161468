//! `kind = "parquet"`: flat rows as Parquet on object storage, a change log per table and a
//! current state rebuilt from it.
//!
//! ```text
//! {url}/{table}/changes/date=YYYY-MM-DD/{first}-{last}-{partition}.parquet   every change
//! {url}/{table}/current/part-0.parquet                                           one row per live key
//! ```
//!
//! **Change log.** Each row carries `_op` (`u`, `d`, `t`), `_position` and `_commit_ts`, then the
//! table's columns. Rows are buffered per table and commit date in an in-memory Parquet writer
//! (zstd, `row_group_rows` per row group); a file is published when it reaches `roll_rows` or
//! `roll_bytes` (checked between batches, so a file always holds whole batches), when it is
//! `roll_ms` old, or when the pipeline drains; and while the open files together hold more than
//! `buffer_bytes`, those written to least recently are published early. Publishing is one PUT
//! (a multipart upload past [`MULTIPART_THRESHOLD`], aborted on failure): the local backend
//! writes `name#N` and renames it into place, object stores expose an object only once
//! complete, so a reader never sees a partial file. The source is acknowledged only for batches whose files are all published.
//!
//! **Replays.** Files are named by the position range they hold (and a hash of the source
//! partition). At open, files past the checkpoint the run resumes from are deleted, and a file
//! that straddles it is cut back to the checkpoint: the replay writes those rows again, once.
//!
//! **Schema drift.** A file holds one schema version; a batch bringing a newer version (a new
//! column) starts a new file. Readers see new columns as nullable columns of the newer files.
//!
//! **Current state.** [`compact`] rebuilds `current/` from the change log.

mod compact;
mod encode;
mod merge;
#[cfg(test)]
mod multipart_tests;
mod survivors;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use refract_schemas::config::ParquetSinkConfig;
use refract_schemas::write::flat::{FlatOp, FlatSchema};
use refract_schemas::write::{OpFamily, RowChange};
use refract_schemas::{Checkpoint, Offset};

pub use compact::{CompactReport, compact};
use encode::{FileWriter, Row};

use crate::sinks::object_json::{open_store, remove_local_staging_files};
use crate::{Buffered, Intake, Sink, SinkBatch, SinkError, WriteReport};

/// Files larger than this are uploaded in parts (S3 caps a single PUT at 5 GiB, and parts
/// resume better on flaky links).
pub const MULTIPART_THRESHOLD: usize = 64 * 1024 * 1024;
/// Size of each part of a multipart upload.
const PART_SIZE: usize = 16 * 1024 * 1024;

/// A change-log file being written.
struct OpenFile {
    schema: Arc<FlatSchema>,
    arrow: arrow_schema::SchemaRef,
    writer: FileWriter,
    partition: Arc<str>,
    first: Offset,
    last: Offset,
    rows: usize,
    /// The first batch with rows in this file.
    first_seq: u64,
    /// The newest batch with rows in this file.
    last_seq: u64,
    opened: Instant,
}

impl OpenFile {
    /// The memory it holds: the encoded bytes so far and the buffered row group.
    fn held_bytes(&self) -> u64 {
        (self.writer.bytes_written() + self.writer.memory_size()) as u64
    }
}

/// A finished file waiting to be published.
struct Ready {
    path: Path,
    bytes: bytes::Bytes,
    first_seq: u64,
}

/// What the Parquet sink accepts: rows of flat tables.
type Accepted<'a> = &'a RowChange;

/// The Parquet sink.
pub struct ParquetSink {
    name: String,
    config: ParquetSinkConfig,
    store: Option<Arc<dyn ObjectStore>>,
    root: Path,
    resume: Checkpoint,
    /// Open files by (table, commit day).
    open: BTreeMap<(Arc<str>, i64), OpenFile>,
    ready: Vec<Ready>,
    /// The newest batch buffered (a retried write of it is not buffered twice), and its report.
    last_seq: u64,
    last_report: WriteReport,
    last_compaction: Instant,
    metrics: ParquetSinkMetrics,
}

/// Every metric the Parquet sink emits, made once per sink.
struct ParquetSinkMetrics {
    /// `refract_parquet_files_published_total{sink}`: change-log files made durable.
    published: metrics::Counter,
    /// `refract_parquet_rows_written_total{sink}`: rows in the change-log files published.
    rows_written: metrics::Counter,
}

impl ParquetSinkMetrics {
    fn new(sink: &str) -> Self {
        Self {
            published: metrics::counter!("refract_parquet_files_published_total", "sink" => sink.to_owned()),
            rows_written: metrics::counter!("refract_parquet_rows_written_total", "sink" => sink.to_owned()),
        }
    }
}

impl ParquetSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A sink named `name`; nothing is connected before [`Sink::open`].
    pub fn new(name: &str, config: ParquetSinkConfig) -> Self {
        Self {
            metrics: ParquetSinkMetrics::new(name),
            name: name.to_owned(),
            config,
            store: None,
            root: Path::default(),
            resume: Checkpoint::new(),
            open: BTreeMap::new(),
            ready: Vec::new(),
            last_seq: 0,
            last_report: WriteReport::default(),
            last_compaction: Instant::now(),
        }
    }

    fn error(
        &self,
        permanent: bool,
        message: String,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> SinkError {
        let sink = self.name.clone();
        if permanent {
            SinkError::Permanent {
                sink,
                message,
                source,
            }
        } else {
            SinkError::Transient {
                sink,
                message,
                source,
            }
        }
    }

    fn store(&self) -> Result<Arc<dyn ObjectStore>, SinkError> {
        self.store
            .clone()
            .ok_or_else(|| SinkError::not_open(&self.name))
    }

    /// Buffers the rows of `batch` into the open files.
    fn buffer(&mut self, batch: &SinkBatch, report: &mut WriteReport) -> Result<(), SinkError> {
        // Rows per (table, day), in batch order, and the newest schema of each table.
        let mut groups: BTreeMap<(Arc<str>, i64), (Arc<FlatSchema>, Arc<str>, Vec<Row<'_>>)> =
            BTreeMap::new();
        for RowChange { change, position } in batch.intake::<Accepted>(&self.name)? {
            match change.op {
                FlatOp::Upsert => report.upserted += 1,
                FlatOp::Delete | FlatOp::Truncate => report.deleted += 1,
            }
            let day = change
                .commit_ts_ms
                .unwrap_or_else(|| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as i64)
                })
                .div_euclid(86_400_000);
            let group = groups
                .entry((change.schema.table.clone(), day))
                .or_insert_with(|| {
                    (
                        change.schema.clone(),
                        position.partition.clone(),
                        Vec::new(),
                    )
                });
            if change.schema.version > group.0.version {
                group.0 = change.schema.clone();
            }
            group.2.push(Row {
                change,
                position: position.offset,
            });
        }
        for ((table, day), (schema, partition, rows)) in groups {
            let key = (table, day);
            if self
                .open
                .get(&key)
                .is_some_and(|f| f.schema.version != schema.version)
            {
                let file = self.open.remove(&key).expect("checked");
                self.finish(&key, file)?;
            }
            if !self.open.contains_key(&key) {
                let arrow = encode::change_schema(&schema);
                let properties =
                    encode::properties(self.config.zstd_level, self.config.row_group_rows);
                let writer = encode::writer(&arrow, properties).map_err(|e| {
                    self.error(
                        true,
                        "cannot start a Parquet file".into(),
                        Some(Box::new(e)),
                    )
                })?;
                self.open.insert(
                    key.clone(),
                    OpenFile {
                        schema: schema.clone(),
                        arrow,
                        writer,
                        partition,
                        first: rows[0].position,
                        last: rows[0].position,
                        rows: 0,
                        first_seq: batch.seq,
                        last_seq: batch.seq,
                        opened: Instant::now(),
                    },
                );
            }
            let file = self.open.get_mut(&key).expect("opened above");
            let record_batch =
                encode::record_batch(&file.schema, &file.arrow, &rows).map_err(|e| {
                    SinkError::Permanent {
                        sink: self.name.clone(),
                        message: format!("cannot encode rows of `{}`", key.0),
                        source: Some(Box::new(e)),
                    }
                })?;
            file.writer
                .write(&record_batch)
                .map_err(|e| SinkError::Permanent {
                    sink: self.name.clone(),
                    message: format!("cannot encode rows of `{}`", key.0),
                    source: Some(Box::new(e)),
                })?;
            file.rows += rows.len();
            file.last_seq = batch.seq;
            file.first = file
                .first
                .min(rows.iter().map(|r| r.position).min().expect("non-empty"));
            file.last = file
                .last
                .max(rows.iter().map(|r| r.position).max().expect("non-empty"));
            self.metrics.rows_written.increment(rows.len() as u64);
        }
        Ok(())
    }

    /// Closes `file` into bytes waiting to be published.
    fn finish(&mut self, key: &(Arc<str>, i64), file: OpenFile) -> Result<(), SinkError> {
        let bytes = file.writer.into_inner().map_err(|e| {
            self.error(
                true,
                format!("cannot finish a Parquet file of `{}`", key.0),
                Some(Box::new(e)),
            )
        })?;
        let path = change_file(
            &self.root,
            &key.0,
            key.1,
            file.first,
            file.last,
            &file.partition,
        );
        self.ready.push(Ready {
            path,
            bytes: bytes.into(),
            first_seq: file.first_seq,
        });
        Ok(())
    }

    /// Finishes the open files that reached a size limit (or all of them), then, while the open
    /// files together hold more than `buffer_bytes`, those written to least recently (the
    /// largest first among equals): in a replay, the days already passed.
    fn roll(&mut self, all: bool) -> Result<(), SinkError> {
        let due: Vec<(Arc<str>, i64)> = self
            .open
            .iter()
            .filter(|(_, f)| {
                all || f.rows >= self.config.roll_rows
                    || (f.writer.bytes_written() + f.writer.in_progress_size()) as u64
                        >= self.config.roll_bytes
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            let file = self.open.remove(&key).expect("listed");
            self.finish(&key, file)?;
        }
        let mut held: Vec<(u64, u64, (Arc<str>, i64))> = self
            .open
            .iter()
            .map(|(k, f)| (f.last_seq, f.held_bytes(), k.clone()))
            .collect();
        let mut total: u64 = held.iter().map(|(_, bytes, _)| bytes).sum();
        if total > self.config.buffer_bytes {
            held.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            for (_, bytes, key) in held {
                if total <= self.config.buffer_bytes {
                    break;
                }
                let file = self.open.remove(&key).expect("listed");
                tracing::debug!(
                    sink = %self.name,
                    table = %key.0,
                    rows = file.rows,
                    bytes,
                    "open files hold more than buffer_bytes: publishing one early"
                );
                self.finish(&key, file)?;
                total -= bytes;
            }
        }
        Ok(())
    }

    /// Publishes finished files; those published stay published if a later one fails.
    async fn publish(&mut self) -> Result<(), SinkError> {
        while let Some(ready) = self.ready.first() {
            let store = self.store()?;
            put(&*store, &ready.path, ready.bytes.clone())
                .await
                .map_err(|e| classify(&self.name, format!("cannot publish {}", ready.path), e))?;
            tracing::debug!(sink = %self.name, path = %ready.path, bytes = ready.bytes.len(), "published a change-log file");
            self.metrics.published.increment(1);
            self.ready.remove(0);
        }
        Ok(())
    }

    /// Rebuilds `current/` of every table when the interval has passed.
    async fn compact_if_due(&mut self) -> Result<(), SinkError> {
        let interval = self.config.compact_interval_ms;
        if interval == 0 || self.last_compaction.elapsed() < Duration::from_millis(interval) {
            return Ok(());
        }
        self.last_compaction = Instant::now();
        // A compaction that fails is reported and tried again at the next interval; it never
        // holds up the change log (and so the source).
        match compact(&self.name, &self.config).await {
            Ok(report) => {
                tracing::info!(sink = %self.name, tables = report.tables, rows = report.rows, "compacted current state")
            }
            // A store that is down (retryable) is a warning, as the change log's retries are;
            // what retrying cannot fix is an error.
            Err(e) if e.is_retryable() => {
                tracing::warn!(sink = %self.name, error = %e, "compaction failed; retrying at the next interval")
            }
            Err(e) => {
                tracing::error!(sink = %self.name, error = %e, "compaction failed; retrying at the next interval")
            }
        }
        Ok(())
    }
}

/// Deletes change-log files past the resumed checkpoint and cuts back a file that
/// straddles it: the replay writes their rows again.
async fn trim_after_checkpoint(
    name: &str,
    store: Arc<dyn ObjectStore>,
    root: &Path,
    resume: &Checkpoint,
) -> Result<(), SinkError> {
    let partitions: Vec<(String, Offset)> = resume
        .iter()
        .map(|(p, o)| (partition_hash(p), *o))
        .collect();
    if partitions.is_empty() {
        return Ok(());
    }
    let files = compact::list_change_files(&*store, root, None)
        .await
        .map_err(|e| classify(name, "cannot list the change log".into(), e))?;
    for file in files {
        let Some((_, checkpoint)) = partitions.iter().find(|(h, _)| *h == file.partition) else {
            continue;
        };
        if file.last <= *checkpoint {
            continue;
        }
        if file.first > *checkpoint {
            tracing::info!(sink = %name, path = %file.path, "deleting a change-log file past the checkpoint; the replay rewrites it");
        } else {
            let kept = compact::cut_back(&*store, &file, *checkpoint)
                .await
                .map_err(|e| SinkError::Transient {
                    sink: name.to_owned(),
                    message: format!("cannot cut back {}: {e}", file.path),
                    source: None,
                })?;
            if let Some((last, bytes)) = kept {
                let path = change_file_in(&file.dir, file.first, last, &file.partition);
                put(&*store, &path, bytes)
                    .await
                    .map_err(|e| classify(name, format!("cannot publish {path}"), e))?;
                tracing::info!(sink = %name, from = %file.path, to = %path, "cut a change-log file back to the checkpoint");
            }
        }
        match store.delete(&file.path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(classify(name, format!("cannot delete {}", file.path), e)),
        }
    }
    Ok(())
}

/// The path of a change-log file.
fn change_file(
    root: &Path,
    table: &str,
    day: i64,
    first: Offset,
    last: Offset,
    partition: &str,
) -> Path {
    let date = chrono::DateTime::from_timestamp(day * 86_400, 0).map_or_else(
        || "unknown".to_owned(),
        |d| d.format("%Y-%m-%d").to_string(),
    );
    let dir = root
        .clone()
        .join(table)
        .join("changes")
        .join(format!("date={date}").as_str());
    change_file_in(&dir, first, last, &partition_hash(partition))
}

fn change_file_in(dir: &Path, first: Offset, last: Offset, partition_hash: &str) -> Path {
    dir.clone().join(
        format!(
            "{}-{}-{partition_hash}.parquet",
            first.sortable(),
            last.sortable()
        )
        .as_str(),
    )
}

/// Eight hex digits naming a source partition in file names (FNV-1a).
pub(crate) fn partition_hash(partition: &str) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for b in partition.bytes() {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    format!("{hash:08x}")
}

/// Writes `bytes` at `path` so that it appears whole or not at all.
pub(crate) async fn put(
    store: &dyn ObjectStore,
    path: &Path,
    bytes: bytes::Bytes,
) -> object_store::Result<()> {
    if bytes.len() <= MULTIPART_THRESHOLD {
        store.put(path, PutPayload::from(bytes)).await?;
        return Ok(());
    }
    let upload = store.put_multipart(path).await?;
    upload_parts(upload, path, parts_of(bytes)).await
}

/// `bytes` in parts of [`PART_SIZE`].
fn parts_of(
    bytes: bytes::Bytes,
) -> impl futures::Stream<Item = object_store::Result<bytes::Bytes>> {
    let parts = (0..bytes.len())
        .step_by(PART_SIZE)
        .map(move |start| Ok(bytes.slice(start..(start + PART_SIZE).min(bytes.len()))));
    futures::stream::iter(parts)
}

/// Writes the local file `local` at `path` so that it appears whole or not at all, in parts read
/// one at a time (never whole in memory) past [`MULTIPART_THRESHOLD`].
pub(crate) async fn put_file(
    store: &dyn ObjectStore,
    path: &Path,
    local: &std::path::Path,
) -> object_store::Result<()> {
    use tokio::io::AsyncReadExt;
    let generic = |e: std::io::Error| object_store::Error::Generic {
        store: "local file",
        source: Box::new(e),
    };
    let file = tokio::fs::File::open(local).await.map_err(generic)?;
    if file.metadata().await.map_err(generic)?.len() <= MULTIPART_THRESHOLD as u64 {
        let bytes = tokio::fs::read(local).await.map_err(generic)?;
        return put(store, path, bytes.into()).await;
    }
    let upload = store.put_multipart(path).await?;
    let parts = futures::stream::try_unfold(file, move |mut file| async move {
        let mut part = Vec::with_capacity(PART_SIZE);
        (&mut file)
            .take(PART_SIZE as u64)
            .read_to_end(&mut part)
            .await
            .map_err(generic)?;
        Ok((!part.is_empty()).then(|| (bytes::Bytes::from(part), file)))
    });
    upload_parts(upload, path, parts).await
}

/// Uploads `parts` and completes `upload`; aborts it if a part or the completion fails.
async fn upload_parts(
    mut upload: Box<dyn object_store::MultipartUpload>,
    path: &Path,
    parts: impl futures::Stream<Item = object_store::Result<bytes::Bytes>>,
) -> object_store::Result<()> {
    use futures::StreamExt;
    let mut parts = std::pin::pin!(parts);
    let mut result = Ok(());
    while let Some(part) = parts.next().await {
        result = match part {
            Ok(part) => upload.put_part(PutPayload::from(part)).await,
            Err(e) => Err(e),
        };
        if result.is_err() {
            break;
        }
    }
    if result.is_ok() {
        result = upload.complete().await.map(|_| ());
    }
    if let Err(e) = result {
        // An abandoned upload keeps its parts (and is billed) until aborted.
        if let Err(abort) = upload.abort().await {
            tracing::warn!(path = %path, error = %abort, "cannot abort a failed multipart upload");
        }
        return Err(e);
    }
    Ok(())
}

/// Object-store errors that retrying cannot fix are permanent.
fn classify(sink: &str, message: String, e: object_store::Error) -> SinkError {
    crate::sinks::object_json::classify(sink, message, e)
}

#[async_trait]
impl Sink for ParquetSink {
    async fn open(&mut self, resume: &Checkpoint) -> Result<(), SinkError> {
        self.resume = resume.clone();
        let (store, root) = open_store(self.config.url.expose()).map_err(|message| {
            self.error(
                true,
                format!("cannot open `{}`: {message}", self.config.url.masked()),
                None,
            )
        })?;
        if let Some(dir) = self.config.url.strip_scheme("file") {
            let removed = remove_local_staging_files(std::path::Path::new(dir)).map_err(|e| {
                self.error(
                    false,
                    format!("cannot clean staging files under {dir}"),
                    Some(Box::new(e)),
                )
            })?;
            if removed > 0 {
                tracing::info!(sink = %self.name, removed, "removed staging files of interrupted writes");
            }
        }
        self.store = Some(store);
        self.root = root;
        trim_after_checkpoint(&self.name, self.store()?, &self.root, &self.resume).await
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        // A retried batch (its files failed to publish) is not buffered twice; its report is
        // the one counted when it was.
        if batch.seq > self.last_seq {
            let mut report = WriteReport::default();
            self.buffer(batch, &mut report)?;
            self.last_seq = batch.seq;
            self.last_report = report;
            self.roll(false)?;
        }
        self.publish().await?;
        Ok(self.last_report.clone())
    }

    fn buffered(&self) -> Option<Buffered> {
        let pending = self.open.values().map(|f| f.first_seq);
        let first = pending.chain(self.ready.iter().map(|r| r.first_seq)).min();
        let roll = Duration::from_millis(self.config.roll_ms);
        let files = self.open.values().map(|f| f.opened + roll).min();
        let compaction = (self.config.compact_interval_ms > 0)
            .then(|| self.last_compaction + Duration::from_millis(self.config.compact_interval_ms));
        Some(Buffered {
            durable_through: first.map_or(self.last_seq, |first| first - 1),
            flush_deadline: match (files, compaction) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        })
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.roll(true)?;
        self.publish().await?;
        self.compact_if_due().await
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        self.roll(true)?;
        self.publish().await.map(|()| None)
    }
}
