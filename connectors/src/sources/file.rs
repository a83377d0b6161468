//! `kind = "file"`: a change log of Debezium envelopes, one JSON object per line.
//!
//! One partition, named after the configured path. A line's position is the byte offset just past
//! its newline, so a checkpoint is exactly where to resume. A reader thread reads chunks that end
//! at a line boundary and hands them, numbered, to `decode_threads` decode workers in turn; the
//! source puts the decoded chunks back in order. Bounded queues between the stages are the
//! backpressure. Chunks the runtime is done with go back to the worker that decoded them, to be
//! freed there (see [`Source::recycle`]). In follow mode the reader waits at end of file for
//! more lines; a line without its newline is only taken as complete at the end of an
//! `--until-caught-up` run.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use refract_schemas::config::FileSourceConfig;
use refract_schemas::debezium::DebeziumDecoder;
use refract_schemas::{Checkpoint, Offset, Position};
use tokio::sync::{mpsc, watch};

use crate::{ReadMode, Source, SourceError, SourceItem};

/// Bytes read per chunk: big enough that per-chunk overhead (a queue hand-off, a wake-up) is
/// negligible, small enough that a chunk's decoded events stay a few MiB.
const CHUNK_BYTES: usize = 1024 * 1024;
/// Decoded chunks buffered ahead of the runtime.
const CHANNEL_CHUNKS: usize = 4;

/// A decoded chunk (or the error that ends reading), numbered in file order, with the worker
/// that decoded it ([`NO_WORKER`] for the reader's error).
type Tagged = (u64, usize, Result<Vec<SourceItem>, SourceError>);

const NO_WORKER: usize = usize::MAX;

/// The file source.
pub struct FileSource {
    config: FileSourceConfig,
    partition: Arc<str>,
    stop: Arc<AtomicBool>,
    done_bytes: Arc<AtomicU64>,
    total_bytes: Arc<AtomicU64>,
    rx: Option<mpsc::Receiver<Tagged>>,
    /// Chunks decoded ahead of their turn, with their worker.
    early: BTreeMap<u64, (usize, Result<Vec<SourceItem>, SourceError>)>,
    next_seq: u64,
    /// Per worker: where chunks it decoded go back to be freed.
    recyclers: Vec<std::sync::mpsc::Sender<Vec<SourceItem>>>,
    /// The worker of the chunk returned last.
    last_worker: usize,
    /// Chunks given back and freed by the workers.
    freed: Arc<AtomicU64>,
}

impl FileSource {
    /// A file source reading `config.path`.
    pub fn new(config: FileSourceConfig) -> Self {
        let partition: Arc<str> = format!("file:{}", config.path).into();
        Self {
            config,
            partition,
            stop: Arc::default(),
            done_bytes: Arc::default(),
            total_bytes: Arc::default(),
            rx: None,
            early: BTreeMap::new(),
            next_seq: 0,
            recyclers: Vec::new(),
            last_worker: NO_WORKER,
            freed: Arc::default(),
        }
    }
}

#[async_trait]
impl Source for FileSource {
    fn resumes_unnamed(&self) -> Checkpoint {
        // Without a checkpoint the file is read from its first byte.
        Checkpoint::from([(self.partition.to_string(), Offset(0, 0))])
    }

    async fn start(
        &mut self,
        checkpoint: &Checkpoint,
        mode: ReadMode,
        _durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError> {
        let path = PathBuf::from(&self.config.path);
        let mut file = File::open(&path).map_err(|e| SourceError::Io {
            message: format!("cannot open change log `{}`: {e}", path.display()),
            source: Some(e),
        })?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let start = checkpoint.get(&*self.partition).map_or(0, |o| o.0);
        if start > len {
            return Err(SourceError::Inconsistent(format!(
                "change log `{}` has {len} bytes but the checkpoint is at byte {start}: the file was \
                 replaced or truncated; delete the pipeline's state directory to start over",
                path.display()
            )));
        }
        file.seek(SeekFrom::Start(start))
            .map_err(|e| SourceError::Io {
                message: "seek failed".into(),
                source: Some(e),
            })?;
        self.done_bytes.store(start, Ordering::Relaxed);
        self.total_bytes.store(len, Ordering::Relaxed);

        let threads = match self.config.decode_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        // Chunks are of one size, so handing them out in turn keeps the workers equally busy;
        // each worker waits on its own queue, and so can free what comes back while idle.
        let mut job_txs = Vec::with_capacity(threads);
        self.recyclers.clear();
        for i in 0..threads {
            let (job_tx, jobs) = std::sync::mpsc::sync_channel::<Job>(1);
            job_txs.push(job_tx);
            let (recycle_tx, recycled) = std::sync::mpsc::channel();
            self.recyclers.push(recycle_tx);
            let worker = Worker {
                id: i,
                partition: self.partition.clone(),
                jobs,
                recycled,
                freed: self.freed.clone(),
                results: tx.clone(),
                stop: self.stop.clone(),
            };
            std::thread::Builder::new()
                .name(format!("file-decode-{i}"))
                .spawn(move || worker.run())
                .map_err(|e| SourceError::Io {
                    message: "cannot start decode threads".into(),
                    source: Some(e),
                })?;
        }
        let reader = Reader {
            file,
            path,
            offset: start,
            seq: 0,
            poll: Duration::from_millis(self.config.poll_interval_ms),
            mode: if self.config.follow {
                mode
            } else {
                ReadMode::UntilCaughtUp
            },
            stop: self.stop.clone(),
            done_bytes: self.done_bytes.clone(),
            total_bytes: self.total_bytes.clone(),
        };
        std::thread::Builder::new()
            .name("file-source".into())
            .spawn(move || reader.run(job_txs, tx))
            .map_err(|e| SourceError::Io {
                message: "cannot start the reader thread".into(),
                source: Some(e),
            })?;
        self.rx = Some(rx);
        Ok(())
    }

    async fn next_chunk(&mut self) -> Result<Option<Vec<SourceItem>>, SourceError> {
        let Some(rx) = self.rx.as_mut() else {
            return Ok(None);
        };
        loop {
            if let Some((worker, chunk)) = self.early.remove(&self.next_seq) {
                self.next_seq += 1;
                self.last_worker = worker;
                match chunk {
                    Ok(items) if items.is_empty() => continue,
                    Ok(items) => return Ok(Some(items)),
                    Err(e) => return Err(e),
                }
            }
            match rx.recv().await {
                Some((seq, worker, chunk)) => {
                    self.early.insert(seq, (worker, chunk));
                }
                None if self.early.is_empty() => return Ok(None),
                None => {
                    return Err(SourceError::Inconsistent(format!(
                        "chunk {} of the change log was never decoded (a decode thread died)",
                        self.next_seq
                    )));
                }
            }
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    fn progress(&self) -> Option<(u64, u64)> {
        Some((
            self.done_bytes.load(Ordering::Relaxed),
            self.total_bytes.load(Ordering::Relaxed),
        ))
    }

    fn recycle(&mut self, items: Vec<SourceItem>) {
        // If the worker has ended (the file is read), the send fails and the chunk is freed here.
        if let Some(worker) = self.recyclers.get(self.last_worker) {
            let _ = worker.send(items);
        }
    }
}

/// A chunk of whole lines for a decode worker.
struct Job {
    seq: u64,
    /// File offset of the chunk's first byte.
    base: u64,
    chunk: Bytes,
}

/// A decode worker: decodes whole chunks with its own decoder (and schema cache), and frees the
/// chunks the runtime is done with.
struct Worker {
    id: usize,
    partition: Arc<str>,
    jobs: std::sync::mpsc::Receiver<Job>,
    recycled: std::sync::mpsc::Receiver<Vec<SourceItem>>,
    freed: Arc<AtomicU64>,
    results: mpsc::Sender<Tagged>,
    stop: Arc<AtomicBool>,
}

impl Worker {
    fn run(self) {
        use std::sync::mpsc::RecvTimeoutError;
        let mut decoder = DebeziumDecoder::new();
        // A returned chunk's vector, emptied, holds the next chunk's items.
        let mut spare: Vec<SourceItem> = Vec::new();
        loop {
            let job = self.jobs.recv_timeout(super::IDLE_FREE);
            let freed = super::free_recycled(&self.recycled, &mut spare);
            self.freed.fetch_add(freed, Ordering::Relaxed);
            let job = match job {
                Ok(job) => job,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            let mut items = std::mem::take(&mut spare);
            decode_chunk(
                &mut decoder,
                &self.partition,
                &job.chunk,
                job.base,
                &mut items,
            );
            if self
                .results
                .blocking_send((job.seq, self.id, Ok(items)))
                .is_err()
            {
                // The runtime went away: stop reading.
                self.stop.store(true, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// Decodes every line of `chunk` into `out`; blank lines are skipped.
fn decode_chunk(
    decoder: &mut DebeziumDecoder,
    partition: &Arc<str>,
    chunk: &Bytes,
    base: u64,
    out: &mut Vec<SourceItem>,
) {
    out.reserve(chunk.len() / 256 + 1);
    let mut start = 0;
    while start < chunk.len() {
        let end = memchr::memchr(b'\n', &chunk[start..]).map_or(chunk.len(), |i| start + i + 1);
        let line_start = start;
        start = end;
        let text = trim_line(&chunk[line_start..end]);
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let position = Position {
            partition: partition.clone(),
            offset: Offset(base + end as u64, 0),
        };
        let record = decoder.decode(text, position);
        out.push(SourceItem {
            record,
            raw: chunk.slice(line_start..line_start + text.len()),
        });
    }
}

/// The reader thread's state.
struct Reader {
    file: File,
    path: PathBuf,
    /// Byte offset of the first byte not yet handed out.
    offset: u64,
    /// Number of the next chunk.
    seq: u64,
    poll: Duration,
    mode: ReadMode,
    stop: Arc<AtomicBool>,
    done_bytes: Arc<AtomicU64>,
    total_bytes: Arc<AtomicU64>,
}

impl Reader {
    fn run(mut self, jobs: Vec<std::sync::mpsc::SyncSender<Job>>, results: mpsc::Sender<Tagged>) {
        if let Err(e) = self.read_loop(&jobs) {
            // Numbered after every chunk handed out, so it surfaces after them, in order.
            let _ = results.blocking_send((self.seq, NO_WORKER, Err(e)));
        }
    }

    fn read_loop(&mut self, jobs: &[std::sync::mpsc::SyncSender<Job>]) -> Result<(), SourceError> {
        let mut pending = BytesMut::with_capacity(CHUNK_BYTES * 2);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            let before = pending.len();
            pending.resize(before + CHUNK_BYTES, 0);
            let n = self
                .file
                .read(&mut pending[before..])
                .map_err(|e| SourceError::Io {
                    message: format!("cannot read `{}`: {e}", self.path.display()),
                    source: Some(e),
                })?;
            pending.truncate(before + n);
            if n == 0 {
                let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                self.total_bytes.store(len, Ordering::Relaxed);
                if len < self.offset + pending.len() as u64 {
                    return Err(SourceError::Inconsistent(format!(
                        "change log `{}` shrank to {len} bytes below the read position {}: it was truncated or replaced",
                        self.path.display(),
                        self.offset
                    )));
                }
                match self.mode {
                    ReadMode::UntilCaughtUp => {
                        // The last line may lack its newline: it is complete now or never.
                        if !pending.is_empty() {
                            let tail = pending.split().freeze();
                            self.hand_out(tail, jobs);
                        }
                        return Ok(());
                    }
                    ReadMode::Follow => {
                        std::thread::sleep(self.poll);
                        continue;
                    }
                }
            }
            // Hand out every complete line; keep the partial last line for the next read.
            if let Some(last_nl) = memchr::memrchr(b'\n', &pending) {
                let complete = pending.split_to(last_nl + 1).freeze();
                self.hand_out(complete, jobs);
            }
        }
    }

    /// Queues a chunk of whole lines for the next worker in turn (waiting while it is busy).
    fn hand_out(&mut self, chunk: Bytes, jobs: &[std::sync::mpsc::SyncSender<Job>]) {
        let len = chunk.len() as u64;
        let job = Job {
            seq: self.seq,
            base: self.offset,
            chunk,
        };
        if jobs[(self.seq % jobs.len() as u64) as usize]
            .send(job)
            .is_err()
        {
            self.stop.store(true, Ordering::Relaxed);
            return;
        }
        self.seq += 1;
        self.offset += len;
        self.done_bytes.store(self.offset, Ordering::Relaxed);
    }
}

/// The line without its trailing `\n` / `\r\n`.
fn trim_line(raw: &[u8]) -> &[u8] {
    let mut end = raw.len();
    while end > 0 && (raw[end - 1] == b'\n' || raw[end - 1] == b'\r') {
        end -= 1;
    }
    &raw[..end]
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use refract_schemas::Record;

    use super::*;

    fn source(path: &std::path::Path) -> FileSource {
        FileSource::new(FileSourceConfig {
            path: path.display().to_string(),
            follow: true,
            poll_interval_ms: 10,
            decode_threads: 2,
        })
    }

    async fn read_all(src: &mut FileSource, checkpoint: &Checkpoint) -> Vec<SourceItem> {
        let (_tx, rx) = watch::channel(Checkpoint::new());
        src.start(checkpoint, ReadMode::UntilCaughtUp, rx)
            .await
            .unwrap();
        let mut all = Vec::new();
        while let Some(chunk) = src.next_chunk().await.unwrap() {
            all.extend(chunk);
        }
        all
    }

    /// A source following a log of one line, started.
    async fn following_one_line(dir: &std::path::Path) -> (FileSource, std::path::PathBuf) {
        let path = dir.join("log.jsonl");
        std::fs::write(&path, format!("{}\n", line(1))).unwrap();
        let mut src = source(&path);
        let (_tx, rx) = watch::channel(Checkpoint::new());
        src.start(&Checkpoint::new(), ReadMode::Follow, rx)
            .await
            .unwrap();
        (src, path)
    }

    /// The `id` of the row a `line` makes.
    fn id(item: &SourceItem) -> i64 {
        match item.record.as_ref().unwrap() {
            Record::Change(e) => e.after.as_ref().unwrap()["id"].as_i64().unwrap(),
            r => panic!("{r:?}"),
        }
    }

    fn line(id: usize) -> String {
        format!(r#"{{"after":{{"id":{id}}},"op":"c","source":{{"table":"t"}}}}"#)
    }

    #[tokio::test]
    async fn reads_in_order_and_resumes_after_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        let mut f = File::create(&path).unwrap();
        // ~3 MiB: several chunks, decoded by two workers and put back in order.
        for i in 0..50_000 {
            writeln!(f, "{}", line(i)).unwrap();
            if i % 1000 == 0 {
                writeln!(f).unwrap(); // blank lines are skipped
            }
        }
        write!(f, "{}", line(50_000)).unwrap(); // no trailing newline
        drop(f);

        let items = read_all(&mut source(&path), &Checkpoint::new()).await;
        assert_eq!(items.len(), 50_001);
        let ids: Vec<i64> = items.iter().map(id).collect();
        assert!(
            ids.iter().enumerate().all(|(i, id)| i as i64 == *id),
            "order kept"
        );
        let file_len = std::fs::metadata(&path).unwrap().len();
        assert_eq!(
            items
                .last()
                .unwrap()
                .record
                .as_ref()
                .unwrap()
                .position()
                .offset,
            Offset(file_len, 0)
        );

        // Resume after item 29999: exactly the rest comes back.
        let cut = items[29_999].record.as_ref().unwrap().position().clone();
        let checkpoint = Checkpoint::from([(cut.partition.to_string(), cut.offset)]);
        let rest = read_all(&mut source(&path), &checkpoint).await;
        assert_eq!(rest.len(), 20_001);
        assert_eq!(rest[0].raw, line(30_000).as_bytes());
    }

    #[tokio::test]
    async fn chunks_given_back_are_freed_by_their_worker_and_never_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        let mut f = File::create(&path).unwrap();
        // ~15 MiB: many more chunks than the queues between reader, workers and runtime hold.
        for i in 0..300_000 {
            writeln!(f, "{}", line(i)).unwrap();
        }
        drop(f);
        let mut src = source(&path);
        let (_tx, rx) = watch::channel(Checkpoint::new());
        src.start(&Checkpoint::new(), ReadMode::UntilCaughtUp, rx)
            .await
            .unwrap();
        let (mut ids, mut chunks) = (Vec::new(), 0);
        while let Some(chunk) = src.next_chunk().await.unwrap() {
            ids.extend(chunk.iter().map(id));
            chunks += 1;
            // The worker empties it and decodes a later chunk into it.
            src.recycle(chunk);
        }
        assert!(chunks > 10, "many chunks, so vectors are reused: {chunks}");
        assert_eq!(ids, (0..300_000).collect::<Vec<i64>>());
    }

    #[tokio::test]
    async fn an_idle_worker_frees_what_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let (mut src, _) = following_one_line(dir.path()).await;
        let chunk = src.next_chunk().await.unwrap().unwrap();
        assert_eq!(src.freed.load(Ordering::Relaxed), 0);
        src.recycle(chunk);
        // No more lines come: the workers wait, and free the chunk while they do.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while src.freed.load(Ordering::Relaxed) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the chunk given back was never freed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        src.stop();
    }

    #[tokio::test]
    async fn a_shorter_file_than_the_checkpoint_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        std::fs::write(&path, format!("{}\n", line(1))).unwrap();
        let checkpoint =
            Checkpoint::from([(format!("file:{}", path.display()), Offset(10_000, 0))]);
        let (_tx, rx) = watch::channel(Checkpoint::new());
        let err = source(&path)
            .start(&checkpoint, ReadMode::UntilCaughtUp, rx)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("replaced or truncated"), "{err}");
    }

    #[tokio::test]
    async fn follow_mode_sees_appended_lines_and_waits_for_partial_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (mut src, path) = following_one_line(dir.path()).await;
        assert_eq!(src.next_chunk().await.unwrap().unwrap().len(), 1);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let second = line(2);
        let (head, tail) = second.split_at(10);
        write!(f, "{head}").unwrap();
        f.flush().unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        writeln!(f, "{tail}").unwrap();
        let chunk = src.next_chunk().await.unwrap().unwrap();
        assert_eq!(chunk.len(), 1);
        assert!(
            chunk[0].record.is_ok(),
            "a line written in two parts is read whole"
        );
        src.stop();
        assert!(src.next_chunk().await.unwrap().is_none());
    }
}
