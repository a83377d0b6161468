//! An object store on `file://` whose writes are durable when they return.
//!
//! Sinks that write few, large files (the Parquet change log and its compacted current state,
//! the tiers' cold files, written by the sink and by aging) open their store through
//! [`open_store`](crate::sinks::object_json::open_store), which wraps the local backend in
//! [`SyncedLocalStore`]: every PUT, completed multipart upload, copy and rename is followed by
//! an `fsync` of the file, of its directory (the rename that published it), and, the first time a
//! directory is seen, of its ancestors up to the store's root (a directory the write created is
//! an entry of its parent). A delete syncs the directory it removed an entry from. So a
//! checkpoint, a dropped warm partition or a deleted change file is never durable before the
//! file that replaced it.
//!
//! Sinks that write many small files in one batch (`object_json`, the dead letters) sync them
//! together with a [`SyncSet`](super::SyncSet) instead, concurrently and once per directory, and
//! open the plain store.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result, UploadPart,
};

use super::{sync_files, sync_path};

/// Most directories remembered as durable: the cold tier makes a directory per device and day,
/// and a fleet of millions must not grow the set without end. Forgetting them costs only
/// syncing some ancestors again.
const KNOWN_DIRECTORIES_MAX: usize = 100_000;

/// The local backend, with every write synced before it returns.
#[derive(Debug)]
pub(crate) struct SyncedLocalStore {
    inner: Arc<LocalFileSystem>,
    durability: Arc<Directories>,
}

/// The directories of one store known durable in this process.
#[derive(Debug)]
struct Directories {
    /// The store's root: ancestors above it are not ours to sync.
    root: PathBuf,
    known: Mutex<HashSet<PathBuf>>,
}

impl Directories {
    /// The directories to sync after `file` was written: its own, and the first time a
    /// directory is seen, its ancestors below the root.
    fn after_write(&self, file: &FsPath) -> Vec<PathBuf> {
        let Some(dir) = file.parent() else {
            return Vec::new();
        };
        let mut dirs = vec![dir.to_path_buf()];
        let mut known = self.known.lock().expect("the set of known directories");
        if known.len() >= KNOWN_DIRECTORIES_MAX {
            known.clear();
        }
        if known.insert(dir.to_path_buf()) {
            dirs.extend(
                dir.ancestors()
                    .skip(1)
                    .take_while(|a| a.starts_with(&self.root))
                    .map(FsPath::to_path_buf),
            );
        }
        dirs
    }

    /// Syncs `file`'s data, then the directories [`Self::after_write`] names.
    async fn sync_written(&self, file: PathBuf) -> Result<()> {
        let dirs = self.after_write(&file);
        sync_files(vec![file]).await.map_err(sync_error)?;
        sync_files(dirs).await.map_err(sync_error)
    }
}

fn sync_error(e: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: "LocalFileSystem",
        source: Box::new(e),
    }
}

impl SyncedLocalStore {
    /// The local backend rooted at the file system's root (as `parse_url` builds it), whose
    /// files under `root` (an object path) are synced.
    pub(crate) fn new(root: &Path) -> Result<Self> {
        let inner = LocalFileSystem::new();
        let root = inner.path_to_filesystem(root)?;
        Ok(Self {
            inner: Arc::new(inner),
            durability: Arc::new(Directories {
                root,
                known: Mutex::new(HashSet::new()),
            }),
        })
    }

    fn file(&self, location: &Path) -> Result<PathBuf> {
        self.inner.path_to_filesystem(location)
    }
}

impl fmt::Display for SyncedLocalStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Synced({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for SyncedLocalStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let result = self.inner.put_opts(location, payload, opts).await?;
        self.durability.sync_written(self.file(location)?).await?;
        Ok(result)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        let upload = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(SyncedUpload {
            upload,
            file: self.file(location)?,
            durability: Arc::clone(&self.durability),
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    /// Deletes, then syncs each directory an entry left (a failed sync fails the location).
    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let inner = Arc::clone(&self.inner);
        self.inner
            .delete_stream(locations)
            .and_then(move |location| {
                let dir = inner
                    .path_to_filesystem(&location)
                    .map(|f| f.parent().map(FsPath::to_path_buf));
                async move {
                    if let Some(dir) = dir? {
                        tokio::task::spawn_blocking(move || sync_path(&dir))
                            .await
                            .map_err(|e| sync_error(std::io::Error::other(e)))?
                            .map_err(sync_error)?;
                    }
                    Ok(location)
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await?;
        self.durability.sync_written(self.file(to)?).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.inner.rename_opts(from, to, options).await?;
        self.durability.sync_written(self.file(to)?).await?;
        if let Some(dir) = self.file(from)?.parent() {
            sync_files(vec![dir.to_path_buf()])
                .await
                .map_err(sync_error)?;
        }
        Ok(())
    }
}

/// A multipart upload to a local file, synced when it completes (the local backend renames its
/// staging file into place then).
#[derive(Debug)]
struct SyncedUpload {
    upload: Box<dyn MultipartUpload>,
    file: PathBuf,
    durability: Arc<Directories>,
}

#[async_trait]
impl MultipartUpload for SyncedUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.upload.put_part(data)
    }

    async fn complete(&mut self) -> Result<PutResult> {
        let result = self.upload.complete().await?;
        self.durability.sync_written(self.file.clone()).await?;
        Ok(result)
    }

    async fn abort(&mut self) -> Result<()> {
        self.upload.abort().await
    }
}

#[cfg(test)]
mod tests {
    use object_store::ObjectStoreExt;

    use super::*;

    #[tokio::test]
    async fn a_write_syncs_the_new_directories_up_to_the_root_once() {
        let dir = tempfile::tempdir().unwrap();
        let root = Path::from_filesystem_path(dir.path()).unwrap();
        let store = SyncedLocalStore::new(&root).unwrap();
        let nested = dir.path().join("t/changes/date=2026-12-06");
        let first = store.durability.after_write(&nested.join("a.parquet"));
        assert_eq!(
            first,
            vec![
                nested.clone(),
                dir.path().join("t/changes"),
                dir.path().join("t"),
                dir.path().to_path_buf()
            ]
        );
        assert_eq!(
            store.durability.after_write(&nested.join("b.parquet")),
            vec![nested.clone()],
            "a known directory syncs only itself"
        );
        let path = root.clone().join("t").join("x.parquet");
        store
            .put(&path, PutPayload::from_static(b"x"))
            .await
            .unwrap();
        let mut upload = store.put_multipart(&root.clone().join("y")).await.unwrap();
        upload
            .put_part(PutPayload::from_static(b"y"))
            .await
            .unwrap();
        upload.complete().await.unwrap();
        store.delete(&path).await.unwrap();
        assert_eq!(std::fs::read(dir.path().join("y")).unwrap(), b"y");
        assert!(!dir.path().join("t/x.parquet").exists());
    }
}
