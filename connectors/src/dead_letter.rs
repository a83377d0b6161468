//! The dead-letter store: bad input, with its position and the reason, so nothing is skipped
//! silently.
//!
//! Each entry is one NDJSON line:
//! `{"position":{"partition":"file:log.jsonl","offset":[1234,0]},"stage":"decode","reason":"…",
//!   "table":null,"raw":"…the input line…","recorded_at_ms":…}` (`raw_base64` instead of `raw`
//! when the input is not UTF-8).
//!
//! Two backends: a local file (appended, then `fsync`ed before the runtime checkpoints past the
//! entries, its directory synced when the file is created; entries a crash left unacknowledged
//! are recognised on restart and not written twice, and a line torn by a crash is cut off), or an
//! object-store prefix (one object per batch that had bad input, named by its position range; on
//! `file://` the object and its directory are `fsync`ed before the write returns).

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use refract_schemas::{Checkpoint, Offset, Position};
use serde::{Deserialize, Serialize};

use crate::SinkError;
use crate::sinks::local_files::{LocalStore, SyncSet, create_dir_all_durably, sync_path};
use crate::sinks::object_json::open_store_unsynced;

/// Where in the pipeline the input was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The record could not be decoded.
    Decode,
    /// A projection rejected the event (no key, bad value).
    Projection,
    /// No projection reads the event's table.
    Routing,
    /// A sink cannot hold the operation the event produced (the rest of its batch was applied).
    Sink,
}

/// One rejected input.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Where the input sits in its source.
    pub position: Position,
    /// Which stage rejected it.
    pub stage: Stage,
    /// Why, in a sentence.
    pub reason: String,
    /// The table, when the input decoded far enough to name it (stage `sink`: the sink's
    /// collection or table).
    pub table: Option<String>,
    /// The sink that rejected it (stage `sink`).
    pub sink: Option<String>,
    /// The raw input (stage `sink`: the rejected operation's key).
    pub raw: Bytes,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    position: EntryPosition,
    stage: Stage,
    reason: String,
    table: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sink: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    raw: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    raw_base64: Option<String>,
    recorded_at_ms: i64,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Hash)]
struct EntryPosition {
    partition: String,
    offset: (u64, u64),
}

fn encode(letter: &DeadLetter, now_ms: i64) -> Vec<u8> {
    let (raw, raw_base64) = match std::str::from_utf8(&letter.raw) {
        Ok(s) => (Some(s.to_owned()), None),
        Err(_) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(&letter.raw)),
        ),
    };
    let entry = Entry {
        position: EntryPosition {
            partition: letter.position.partition.to_string(),
            offset: (letter.position.offset.0, letter.position.offset.1),
        },
        stage: letter.stage,
        reason: letter.reason.clone(),
        table: letter.table.clone(),
        sink: letter.sink.clone(),
        raw,
        raw_base64,
        recorded_at_ms: now_ms,
    };
    let mut line = serde_json::to_vec(&entry).expect("an entry serializes");
    line.push(b'\n');
    line
}

/// The dead-letter store of a pipeline.
pub enum DeadLetterStore {
    /// A local NDJSON file.
    File {
        /// Its path.
        path: PathBuf,
        /// The open file, positioned at its end.
        file: File,
        /// Positions past the checkpoint recorded before a restart (not to be written twice).
        recorded: HashSet<(String, (u64, u64))>,
    },
    /// NDJSON objects under an object-store prefix.
    Object {
        /// The URL as configured (for messages).
        url: String,
        /// The store.
        store: Arc<dyn ObjectStore>,
        /// The prefix inside the store.
        root: ObjectPath,
        /// On `file://`: what makes the objects durable.
        local: Option<LocalStore>,
    },
}

fn failed(message: String, e: impl std::error::Error + Send + Sync + 'static) -> SinkError {
    SinkError::Transient {
        sink: "dead_letter".into(),
        message,
        source: Some(Box::new(e)),
    }
}

impl DeadLetterStore {
    /// Opens the local file store at `path`, repairing a torn last line and remembering which
    /// positions past `checkpoint` it already holds.
    pub fn open_file(path: PathBuf, checkpoint: &Checkpoint) -> Result<Self, SinkError> {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = dir {
            create_dir_all_durably(dir)
                .map_err(|e| failed(format!("cannot create {}", dir.display()), e))?;
        }
        let created = !path.exists();
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| {
                failed(
                    format!("cannot open dead-letter file {}", path.display()),
                    e,
                )
            })?;
        if created {
            // The new file's entry in its directory must survive a crash like its lines.
            let dir = dir.unwrap_or(std::path::Path::new("."));
            sync_path(dir).map_err(|e| failed(format!("cannot sync {}", dir.display()), e))?;
        }
        let mut recorded = HashSet::new();
        let mut good_len = 0u64;
        let mut reader = BufReader::new(&file);
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|e| failed("cannot read the dead-letter file".into(), e))?;
            if n == 0 || line.last() != Some(&b'\n') {
                break;
            }
            good_len += n as u64;
            if let Ok(entry) = serde_json::from_slice::<Entry>(&line) {
                let acknowledged = checkpoint.get(&entry.position.partition).map_or(0, |o| o.0);
                if Offset(entry.position.offset.0, entry.position.offset.1)
                    > Offset(acknowledged, u64::MAX)
                {
                    recorded.insert((entry.position.partition, entry.position.offset));
                }
            }
        }
        let len = file
            .seek(SeekFrom::End(0))
            .map_err(|e| failed("cannot seek the dead-letter file".into(), e))?;
        if len > good_len {
            tracing::warn!(path = %path.display(), bytes = len - good_len, "cutting a torn last dead-letter line");
            file.set_len(good_len)
                .map_err(|e| failed("cannot repair the dead-letter file".into(), e))?;
        }
        Ok(DeadLetterStore::File {
            path,
            file,
            recorded,
        })
    }

    /// Opens an object-store prefix.
    pub fn open_url(url: &str) -> Result<Self, SinkError> {
        let (store, root) = open_store_unsynced(url).map_err(|message| SinkError::Permanent {
            sink: "dead_letter".into(),
            message: format!(
                "cannot open `{}`: {message}",
                refract_schemas::config::mask_url(url)
            ),
            source: None,
        })?;
        let local = LocalStore::for_url(url, &root)
            .transpose()
            .map_err(|e| failed(format!("cannot map {root} to a directory"), e))?;
        Ok(DeadLetterStore::Object {
            url: url.to_owned(),
            store,
            root,
            local,
        })
    }

    /// Where entries go, for summaries and logs.
    pub fn location(&self) -> String {
        match self {
            DeadLetterStore::File { path, .. } => path.display().to_string(),
            DeadLetterStore::Object { url, .. } => refract_schemas::config::mask_url(url),
        }
    }

    /// Records `letters` durably.
    pub async fn write(&mut self, letters: &[DeadLetter], now_ms: i64) -> Result<(), SinkError> {
        if letters.is_empty() {
            return Ok(());
        }
        match self {
            DeadLetterStore::File {
                path,
                file,
                recorded,
            } => append(path, file, recorded, letters, now_ms),
            DeadLetterStore::Object {
                store, root, local, ..
            } => {
                let path = object_name(root, letters);
                let body: Vec<u8> = letters.iter().flat_map(|l| encode(l, now_ms)).collect();
                store
                    .put(&path, PutPayload::from(body))
                    .await
                    .map_err(|e| failed(format!("cannot write {path}"), e))?;
                match local {
                    Some(local) => sync_object(local, &path).await,
                    None => Ok(()),
                }
            }
        }
    }
}

/// Appends `letters` to the local file and syncs it; entries recorded before a crash are skipped
/// once (the runtime never hands the same letter twice within a run, so the set only shrinks).
fn append(
    path: &std::path::Path,
    file: &mut File,
    recorded: &mut HashSet<(String, (u64, u64))>,
    letters: &[DeadLetter],
    now_ms: i64,
) -> Result<(), SinkError> {
    let mut buf = Vec::new();
    for letter in letters {
        let key = (
            letter.position.partition.to_string(),
            (letter.position.offset.0, letter.position.offset.1),
        );
        if !recorded.remove(&key) {
            buf.extend(encode(letter, now_ms));
        }
    }
    if buf.is_empty() {
        return Ok(());
    }
    let before = file
        .metadata()
        .map_err(|e| failed(format!("cannot stat {}", path.display()), e))?
        .len();
    let appended = file.write_all(&buf).and_then(|()| file.sync_data());
    if let Err(e) = appended {
        // Undo a partial append so that the retry does not record entries twice.
        let _ = file.set_len(before);
        return Err(failed(format!("cannot append to {}", path.display()), e));
    }
    Ok(())
}

/// The object of a batch's `letters`: `{partition}/{first}-{last}.ndjson` by position range, with
/// `-{sink}` before the extension for a sink's rejections (two sinks may reject the same
/// positions).
fn object_name(root: &ObjectPath, letters: &[DeadLetter]) -> ObjectPath {
    let safe = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    let first = &letters[0].position;
    let last = &letters[letters.len() - 1].position;
    let sink = letters[0]
        .sink
        .as_deref()
        .map(|s| format!("-{}", safe(s)))
        .unwrap_or_default();
    let name = format!("{}-{}{sink}.ndjson", first.offset, last.offset);
    root.clone()
        .join(safe(&first.partition).as_str())
        .join(name.as_str())
}

/// Makes the object at `path` of a `file://` store durable.
async fn sync_object(local: &mut LocalStore, path: &ObjectPath) -> Result<(), SinkError> {
    let mut set = SyncSet::default();
    set.written(
        local
            .file(path)
            .map_err(|e| failed(format!("cannot map {path} to a file"), e))?,
    );
    local
        .sync(set)
        .await
        .map_err(|e| failed(format!("cannot sync {path}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(offset: u64) -> DeadLetter {
        DeadLetter {
            position: Position {
                partition: "file:x".into(),
                offset: Offset(offset, 0),
            },
            stage: Stage::Decode,
            reason: "invalid JSON".into(),
            table: None,
            sink: None,
            raw: Bytes::from_static(b"{oops"),
        }
    }

    #[tokio::test]
    async fn an_object_store_prefix_gets_one_object_per_batch() {
        let dir = tempfile::tempdir().unwrap();
        let mut store =
            DeadLetterStore::open_url(&format!("file://{}", dir.path().display())).unwrap();
        store.write(&[letter(10), letter(20)], 1).await.unwrap();
        let object = dir.path().join("file_x/10-20.ndjson");
        let got = lines(&object);
        assert_eq!(got.len(), 2);
        assert_eq!(got[1]["position"]["offset"][0], 20);
    }

    fn lines(path: &std::path::Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[tokio::test]
    async fn replays_are_not_recorded_twice_and_torn_lines_are_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dl/dead-letters.ndjson");
        let mut store = DeadLetterStore::open_file(path.clone(), &Checkpoint::new()).unwrap();
        store.write(&[letter(10), letter(20)], 1).await.unwrap();
        drop(store);
        // A crash mid-append leaves half a line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"position\":{\"parti").unwrap();
        drop(f);

        // Restart with a checkpoint at 10: entry 20 is past it and already recorded.
        let checkpoint = Checkpoint::from([("file:x".to_string(), Offset(10, 0))]);
        let mut store = DeadLetterStore::open_file(path.clone(), &checkpoint).unwrap();
        store.write(&[letter(20), letter(30)], 2).await.unwrap();
        let got = lines(&path);
        let offsets: Vec<u64> = got
            .iter()
            .map(|l| l["position"]["offset"][0].as_u64().unwrap())
            .collect();
        assert_eq!(offsets, vec![10, 20, 30]);
        assert_eq!(got[0]["raw"], "{oops");
        assert_eq!(got[0]["reason"], "invalid JSON");
    }
}
