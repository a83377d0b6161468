//! `kind = "object_json"`: one JSON object per document at `{url}/{collection}/{key}.json`.
//!
//! Works on every backend of the `object_store` crate (`file://`, `s3://`, `gs://`, `az://`,
//! `memory://`). Each document is written with a single PUT, which every backend publishes
//! atomically: the local backend writes a temporary `name#N` file and renames it into place, cloud
//! stores only expose an object once its upload completed. So a reader never sees half a
//! document, even if refract is killed mid-write. Staging files a kill left behind on a local
//! directory are removed at open.
//!
//! **Durability.** On `file://`, `write` returns only once the batch's documents are on disk: the
//! files written are `fsync`ed concurrently, then each directory whose entries changed once (see
//! [`crate::sinks::local_files`]). Cloud stores acknowledge a PUT once it is durable.
//!
//! Within a batch, only the last operation per key is applied (earlier ones would be overwritten
//! anyway), concurrently up to `concurrency` requests. Truncates split the batch so that ordering
//! around them is kept.

use std::sync::Arc;

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt, stream};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use refract_schemas::Checkpoint;
use refract_schemas::config::ObjectJsonSinkConfig;
use refract_schemas::write::{DocumentOp, OpFamily};
use url::Url;

use crate::sinks::documents::{Keyed, segments};
use crate::sinks::local_files::{LocalStore, SyncSet, SyncedLocalStore};
use crate::{Intake, RejectedOp, Sink, SinkBatch, SinkError, WriteReport};

/// Longest object name: the limit of common local file systems (ext4, xfs), and well within
/// what S3, GCS and Azure accept.
const MAX_OBJECT_NAME_BYTES: usize = 255;

/// What the object-store JSON sink accepts: documents.
type Accepted<'a> = &'a DocumentOp;

/// The object-store JSON sink.
pub struct ObjectJsonSink {
    name: String,
    config: ObjectJsonSinkConfig,
    store: Option<Arc<dyn ObjectStore>>,
    root: Path,
    /// On `file://`: what makes written files durable.
    local: Option<LocalStore>,
}

/// What applying one document operation did.
enum Applied {
    /// The object at this path was written.
    Upserted(Path),
    /// The object at this path was deleted (or was absent).
    Deleted(Path),
    /// The store cannot hold the operation's object.
    Rejected(RejectedOp),
}

impl ObjectJsonSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A sink named `name`; nothing is connected before [`Sink::open`].
    pub fn new(name: &str, config: ObjectJsonSinkConfig) -> Self {
        Self {
            name: name.to_owned(),
            config,
            store: None,
            root: Path::default(),
            local: None,
        }
    }

    /// Writes or deletes the object of one document.
    async fn apply(
        &self,
        store: Arc<dyn ObjectStore>,
        op: Keyed<'_>,
    ) -> Result<Applied, SinkError> {
        let path = self.object_path(op.collection(), op.key());
        match op {
            Keyed::Upsert { doc, .. } => {
                if let Some(reason) = key_too_long(op.key()) {
                    return Ok(Applied::Rejected(rejection(op, reason)));
                }
                let bytes = if self.config.pretty {
                    serde_json::to_vec_pretty(&**doc)
                } else {
                    serde_json::to_vec(&**doc)
                }
                .expect("a JSON map serializes");
                match store.put(&path, PutPayload::from(bytes)).await {
                    Ok(_) => Ok(Applied::Upserted(path)),
                    Err(e) if name_too_long(&e) => Ok(Applied::Rejected(rejection(
                        op,
                        format!("the store refuses the object name {path} as too long: {e}"),
                    ))),
                    Err(e) => Err(self.transient(format!("cannot write {path}"), e)),
                }
            }
            // No object can exist under a name the store refuses: nothing to delete.
            Keyed::Delete { .. } if key_too_long(op.key()).is_some() => Ok(Applied::Deleted(path)),
            Keyed::Delete { .. } => match store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(Applied::Deleted(path)),
                Err(e) if name_too_long(&e) => Ok(Applied::Deleted(path)),
                Err(e) => Err(self.transient(format!("cannot delete {path}"), e)),
            },
        }
    }

    /// Applies `winners` (one operation per key) concurrently, up to `concurrency` at a time.
    async fn apply_all(
        &self,
        store: &Arc<dyn ObjectStore>,
        winners: Vec<Keyed<'_>>,
    ) -> Vec<Result<Applied, SinkError>> {
        // Collected first: a lazy `map` inside this `Send` future trips the compiler's
        // higher-ranked lifetime check.
        let writes: Vec<_> = winners
            .into_iter()
            .map(|op| self.apply(store.clone(), op))
            .collect();
        stream::iter(writes)
            .buffer_unordered(self.config.concurrency)
            .collect()
            .await
    }

    /// Counts what one operation did, and notes on `file://` what must be synced for it.
    fn record(
        &self,
        applied: Applied,
        report: &mut WriteReport,
        sync: &mut SyncSet,
    ) -> Result<(), SinkError> {
        let (path, written) = match applied {
            Applied::Upserted(path) => {
                report.upserted += 1;
                (path, true)
            }
            Applied::Deleted(path) => {
                report.deleted += 1;
                (path, false)
            }
            Applied::Rejected(op) => {
                tracing::warn!(sink = %self.name, position = %op.position, reason = %op.reason, "rejecting a document the store cannot hold");
                report.rejected.push(op);
                return Ok(());
            }
        };
        let Some(local) = &self.local else {
            return Ok(());
        };
        let file = local
            .file(&path)
            .map_err(|e| self.transient(format!("cannot map {path} to a file"), e))?;
        match (written, file.parent()) {
            (true, _) => sync.written(file),
            (false, Some(dir)) => sync.changed_dir(dir.to_path_buf()),
            (false, None) => {}
        }
        Ok(())
    }

    /// Deletes every document of `collection` (a truncate); returns how many there were.
    async fn empty(
        &self,
        store: &Arc<dyn ObjectStore>,
        collection: &str,
        sync: &mut SyncSet,
    ) -> Result<u64, SinkError> {
        let prefix = self.root.clone().join(collection);
        let listed = store.list(Some(&prefix)).map_ok(|m| m.location).boxed();
        let deleted: Vec<Path> = store
            .delete_stream(listed)
            .try_collect()
            .await
            .map_err(|e| self.transient(format!("cannot empty {prefix}"), e))?;
        if let Some(local) = &self.local {
            let dir = local
                .file(&prefix)
                .map_err(|e| self.transient(format!("cannot map {prefix} to a file"), e))?;
            sync.changed_dir(dir);
        }
        Ok(deleted.len() as u64)
    }

    /// On `file://`: makes what the batch wrote durable before `write` returns.
    async fn make_durable(&mut self, sync: SyncSet) -> Result<(), SinkError> {
        let Some(local) = &mut self.local else {
            return Ok(());
        };
        local.sync(sync).await.map_err(|e| SinkError::Transient {
            sink: self.name.clone(),
            message: format!("cannot make the batch durable: {e}"),
            source: Some(Box::new(e)),
        })
    }

    fn object_path(&self, collection: &str, key: &str) -> Path {
        self.root
            .clone()
            .join(collection)
            .join(format!("{key}.json").as_str())
    }

    fn transient(&self, message: String, e: object_store::Error) -> SinkError {
        classify(&self.name, message, e)
    }
}

/// Why `key` can never be an object name (most file systems stop at 255 bytes per name), if it
/// cannot.
fn key_too_long(key: &str) -> Option<String> {
    let name = format!("{key}.json");
    let encoded = object_store::path::PathPart::from(name.as_str());
    if encoded.as_ref().len() <= MAX_OBJECT_NAME_BYTES {
        return None;
    }
    let shown: String = key.chars().take(60).collect();
    Some(format!(
        "document key `{shown}…` makes an object name longer than {MAX_OBJECT_NAME_BYTES} bytes; \
         check the table's key columns"
    ))
}

/// Whether the store refused a name as too long (`ENAMETOOLONG` on a local file system).
fn name_too_long(e: &object_store::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::InvalidFilename
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// `op`, rejected for `reason`.
fn rejection(op: Keyed<'_>, reason: String) -> RejectedOp {
    RejectedOp {
        position: op.position().clone(),
        table: op.collection().to_string(),
        key: op.key().to_owned(),
        reason,
    }
}

/// Object-store errors that retrying cannot fix; everything else (network, throttling, server
/// errors, local IO hiccups) is retried.
pub(crate) fn classify(sink: &str, message: String, e: object_store::Error) -> SinkError {
    use object_store::Error as E;
    let permanent = matches!(
        e,
        E::PermissionDenied { .. }
            | E::Unauthenticated { .. }
            | E::InvalidPath { .. }
            | E::NotSupported { .. }
            | E::NotImplemented { .. }
            | E::UnknownConfigurationKey { .. }
    );
    // The cause goes into the message: it is what the log line shows.
    let message = format!("{message}: {e}");
    let source = Some(Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
    if permanent {
        SinkError::Permanent {
            sink: sink.to_owned(),
            message,
            source,
        }
    } else {
        SinkError::Transient {
            sink: sink.to_owned(),
            message,
            source,
        }
    }
}

/// Builds an object store from a URL, taking cloud credentials from the environment. On
/// `file://` every write is durable when it returns (see
/// [`SyncedLocalStore`](crate::sinks::local_files::SyncedLocalStore)); cloud stores are durable
/// when a PUT returns.
pub fn open_store(url: &str) -> Result<(Arc<dyn ObjectStore>, Path), String> {
    let (store, root) = open_store_unsynced(url)?;
    if !url.starts_with("file://") {
        return Ok((store, root));
    }
    let synced = SyncedLocalStore::new(&root).map_err(|e| e.to_string())?;
    Ok((Arc::new(synced), root))
}

/// [`open_store`] without syncing on `file://`: for writers that sync what they wrote together
/// ([`SyncSet`]), many small files at a time.
pub(crate) fn open_store_unsynced(url: &str) -> Result<(Arc<dyn ObjectStore>, Path), String> {
    let parsed = Url::parse(url).map_err(|e| format!("invalid URL: {e}"))?;
    // Builders accept lower-case config keys (`aws_access_key_id`, `azure_storage_account_name`, ...).
    let options = std::env::vars().filter_map(|(k, v)| {
        let lower = k.to_ascii_lowercase();
        (lower.starts_with("aws_") || lower.starts_with("google_") || lower.starts_with("azure_"))
            .then_some((lower, v))
    });
    let (store, root) =
        object_store::parse_url_opts(&parsed, options).map_err(|e| e.to_string())?;
    Ok((Arc::from(store), root))
}

/// Removes `*.json#N` and `*.parquet#N` staging files under a local directory (left by a kill
/// mid-write).
pub(crate) fn remove_local_staging_files(dir: &std::path::Path) -> std::io::Result<usize> {
    let mut removed = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            removed += remove_local_staging_files(&path)?;
        } else if let Some((stem, suffix)) = entry.file_name().to_string_lossy().rsplit_once('#') {
            if (stem.ends_with(".json") || stem.ends_with(".parquet"))
                && !suffix.is_empty()
                && suffix.chars().all(|c| c.is_ascii_digit())
            {
                std::fs::remove_file(&path)?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}

#[async_trait]
impl Sink for ObjectJsonSink {
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        let (store, root) = open_store_unsynced(self.config.url.expose()).map_err(|message| {
            SinkError::Permanent {
                sink: self.name.clone(),
                message: format!("cannot open `{}`: {message}", self.config.url.masked()),
                source: None,
            }
        })?;
        if let Some(dir) = self.config.url.strip_scheme("file") {
            let removed = remove_local_staging_files(std::path::Path::new(dir)).map_err(|e| {
                SinkError::Transient {
                    sink: self.name.clone(),
                    message: format!("cannot clean staging files under {dir}"),
                    source: Some(Box::new(e)),
                }
            })?;
            if removed > 0 {
                tracing::info!(sink = %self.name, removed, "removed staging files of interrupted writes");
            }
        }
        self.local = LocalStore::for_url(self.config.url.expose(), &root)
            .transpose()
            .map_err(|e| self.transient(format!("cannot map {root} to a directory"), e))?;
        if let Some(local) = &self.local {
            local.create_root().map_err(|e| SinkError::Transient {
                sink: self.name.clone(),
                message: format!("cannot create {root}: {e}"),
                source: Some(Box::new(e)),
            })?;
        }
        self.store = Some(store);
        self.root = root;
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let store = self
            .store
            .clone()
            .ok_or_else(|| SinkError::not_open(&self.name))?;
        let ops = batch.intake::<Accepted>(&self.name)?;
        let mut report = WriteReport::default();
        let mut sync = SyncSet::default();
        for segment in segments(&ops) {
            report.coalesced += segment.coalesced;
            for applied in self.apply_all(&store, segment.winners).await {
                self.record(applied?, &mut report, &mut sync)?;
            }
            if let Some(truncate) = segment.truncate {
                report.deleted += self.empty(&store, truncate.collection, &mut sync).await?;
            }
        }
        self.make_durable(sync).await?;
        Ok(report)
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        self.store = None;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use refract_schemas::write::WriteOp;
    use refract_schemas::{Offset, Position, Row};
    use serde_json::json;

    use super::*;

    fn pos() -> Position {
        Position {
            partition: "p".into(),
            offset: Offset(1, 0),
        }
    }
    fn up(c: &str, k: &str, v: i64) -> WriteOp {
        let Ok(serde_json::Value::Object(doc)) =
            serde_json::from_value::<serde_json::Value>(json!({"id": k, "v": v}))
        else {
            panic!()
        };
        WriteOp::Document(DocumentOp::Upsert {
            collection: c.into(),
            key: k.into(),
            doc: Arc::new(Row::from(doc)),
            position: pos(),
        })
    }
    fn del(c: &str, k: &str) -> WriteOp {
        WriteOp::Document(DocumentOp::Delete {
            collection: c.into(),
            key: k.into(),
            position: pos(),
        })
    }

    fn read(dir: &std::path::Path, c: &str, k: &str) -> Option<serde_json::Value> {
        std::fs::read(dir.join(c).join(format!("{k}.json")))
            .ok()
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    #[tokio::test]
    async fn applies_last_op_per_key_and_truncates_in_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("books")).unwrap();
        std::fs::write(dir.path().join("books/x.json#3"), b"{\"half").unwrap();
        let url = format!("file://{}", dir.path().display());
        let mut sink = ObjectJsonSink::new(
            "t",
            ObjectJsonSinkConfig {
                url: url.into(),
                concurrency: 4,
                pretty: false,
            },
        );
        sink.open(&Checkpoint::new()).await.unwrap();
        assert!(
            !dir.path().join("books/x.json#3").exists(),
            "staging leftovers are removed"
        );

        let ops = vec![
            up("books", "b1", 1),
            up("books", "b2", 1),
            up("books", "b1", 2),
            del("books", "b2"),
            del("books", "never-existed"),
            up("authors", "a1", 1),
            WriteOp::Document(DocumentOp::Truncate {
                collection: "authors".into(),
                position: pos(),
            }),
            up("authors", "a2", 1),
        ];
        let report = sink.write(&SinkBatch { seq: 1, ops }).await.unwrap();
        assert_eq!(
            read(dir.path(), "books", "b1"),
            Some(json!({"id": "b1", "v": 2}))
        );
        assert_eq!(read(dir.path(), "books", "b2"), None);
        assert_eq!(
            read(dir.path(), "authors", "a1"),
            None,
            "truncate removed a1"
        );
        assert_eq!(
            read(dir.path(), "authors", "a2"),
            Some(json!({"id": "a2", "v": 1}))
        );
        assert_eq!(report.coalesced, 2);

        // Replaying the batch is harmless (idempotent).
        let again = vec![up("books", "b1", 2), del("books", "b2")];
        sink.write(&SinkBatch { seq: 2, ops: again }).await.unwrap();
        assert_eq!(
            read(dir.path(), "books", "b1"),
            Some(json!({"id": "b1", "v": 2}))
        );
    }

    #[tokio::test]
    async fn a_key_too_long_for_an_object_name_is_rejected_and_the_rest_written() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        let mut sink = ObjectJsonSink::new(
            "t",
            ObjectJsonSinkConfig {
                url: url.into(),
                concurrency: 4,
                pretty: false,
            },
        );
        sink.open(&Checkpoint::new()).await.unwrap();
        let long = "k".repeat(300);
        let report = sink
            .write(&SinkBatch {
                seq: 1,
                ops: vec![
                    up("books", &long, 1),
                    up("books", "b1", 1),
                    del("books", &"j".repeat(300)),
                ],
            })
            .await
            .unwrap();
        assert_eq!(report.rejected.len(), 1, "{report:?}");
        let rejected = &report.rejected[0];
        assert_eq!(
            (rejected.table.as_str(), rejected.key.as_str()),
            ("books", long.as_str())
        );
        assert!(
            rejected.reason.contains("longer than 255 bytes"),
            "{rejected:?}"
        );
        assert_eq!(
            read(dir.path(), "books", "b1"),
            Some(json!({"id": "b1", "v": 1}))
        );
    }

    #[tokio::test]
    async fn an_unwritable_directory_is_an_error_not_a_skip() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("books");
        std::fs::write(&blocker, b"a file where a directory must go").unwrap();
        let url = format!("file://{}", dir.path().display());
        let mut sink = ObjectJsonSink::new(
            "t",
            ObjectJsonSinkConfig {
                url: url.into(),
                concurrency: 4,
                pretty: false,
            },
        );
        sink.open(&Checkpoint::new()).await.unwrap();
        let err = sink
            .write(&SinkBatch {
                seq: 1,
                ops: vec![up("books", "b1", 1)],
            })
            .await
            .unwrap_err();
        assert!(err.to_string().contains("cannot write"), "{err}");
    }
}
