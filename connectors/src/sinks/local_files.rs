//! Durability of files written on a local file system (`file://` URLs).
//!
//! The `object_store` crate's local backend writes a staging file and renames it into place, but
//! never calls `fsync`: after a power loss or an OS crash, a document behind a durable checkpoint
//! could be lost and never replayed. A sink that must be durable when `write` returns collects
//! what it wrote in a [`SyncSet`] and syncs it: every file's data, concurrently on a bounded
//! number of blocking tasks, then each distinct directory whose entries changed once (the rename
//! that published a file, the unlink that deleted one), and, the first time a directory is seen,
//! its ancestors up to the store's root (a directory created by the write is an entry of its
//! parent).
//!
//! Writers of few, large files need none of that bookkeeping: the store
//! [`open_store`](crate::sinks::object_json::open_store) gives them on `file://` syncs each write
//! before it returns ([`SyncedLocalStore`]).

use std::collections::{BTreeSet, HashSet};
use std::io;
use std::path::{Path, PathBuf};

use futures::{StreamExt, TryStreamExt, stream};
use object_store::path::Path as ObjectPath;

mod synced;
pub(crate) use synced::SyncedLocalStore;

/// Most files synced at once: enough to keep a disk's queue full, few enough not to crowd tokio's
/// blocking pool (other sinks' blocking work shares it).
const SYNC_CONCURRENCY: usize = 32;

/// Files and directories to make durable together.
#[derive(Debug, Default)]
pub(crate) struct SyncSet {
    files: Vec<PathBuf>,
    dirs: BTreeSet<PathBuf>,
}

impl SyncSet {
    /// A file written (or replaced by a rename): its data and its directory entry.
    pub(crate) fn written(&mut self, file: PathBuf) {
        if let Some(dir) = file.parent() {
            self.dirs.insert(dir.to_path_buf());
        }
        self.files.push(file);
    }

    /// A file removed, or a directory whose entries changed: the directory's entries.
    pub(crate) fn changed_dir(&mut self, dir: PathBuf) {
        self.dirs.insert(dir);
    }

    /// Whether there is nothing to sync.
    pub(crate) fn is_empty(&self) -> bool {
        self.files.is_empty() && self.dirs.is_empty()
    }
}

/// The files of a `file://` object store, and what makes them durable.
#[derive(Debug)]
pub struct LocalStore {
    /// Maps object paths to file-system paths as the store does.
    files: object_store::local::LocalFileSystem,
    durability: LocalDurability,
}

impl LocalStore {
    /// For a `file://` URL, the store's files under `root` (the URL's path as an object path);
    /// `None` for other URLs, whose stores are durable when a PUT returns.
    pub(crate) fn for_url(
        url: &str,
        root: &ObjectPath,
    ) -> Option<Result<Self, object_store::Error>> {
        if !url.starts_with("file://") {
            return None;
        }
        let files = object_store::local::LocalFileSystem::new();
        Some(files.path_to_filesystem(root).map(|dir| Self {
            files,
            durability: LocalDurability::new(dir),
        }))
    }

    /// Creates the store's root directory durably if it is missing (see
    /// [`create_dir_all_durably`]).
    pub(crate) fn create_root(&self) -> io::Result<()> {
        create_dir_all_durably(&self.durability.root)
    }

    /// The file behind an object path.
    pub(crate) fn file(&self, path: &ObjectPath) -> Result<PathBuf, object_store::Error> {
        self.files.path_to_filesystem(path)
    }

    /// Makes `set` durable (see [`LocalDurability::sync`]).
    pub(crate) async fn sync(&mut self, set: SyncSet) -> io::Result<()> {
        self.durability.sync(set).await
    }
}

/// Directories known durable in this process, under one root.
#[derive(Debug)]
pub(crate) struct LocalDurability {
    root: PathBuf,
    known: HashSet<PathBuf>,
}

impl LocalDurability {
    /// Files under `root` (the store's directory, which is expected to exist durably).
    pub(crate) fn new(root: PathBuf) -> Self {
        Self {
            root,
            known: HashSet::new(),
        }
    }

    /// Makes `set` durable: file data first, then every directory once. Returns once every
    /// `fsync` succeeded.
    pub(crate) async fn sync(&mut self, set: SyncSet) -> io::Result<()> {
        if set.is_empty() {
            return Ok(());
        }
        sync_files(set.files).await?;
        let mut dirs = set.dirs;
        for dir in dirs.clone() {
            if self.known.insert(dir.clone()) {
                // First sight of this directory: it (or a parent) may have been created by this
                // write, which is an entry of its parent.
                dirs.extend(
                    dir.ancestors()
                        .skip(1)
                        .take_while(|a| a.starts_with(&self.root))
                        .map(Path::to_path_buf),
                );
            }
        }
        sync_files(dirs.into_iter().collect()).await
    }
}

/// `fsync`s each of `paths` (files or directories), [`SYNC_CONCURRENCY`] at a time. A path that
/// no longer exists (deleted by a later write of the same batch) has nothing left to sync.
pub(crate) async fn sync_files(paths: Vec<PathBuf>) -> io::Result<()> {
    stream::iter(paths)
        .map(|path| async move {
            tokio::task::spawn_blocking(move || sync_path(&path))
                .await
                .map_err(io::Error::other)?
        })
        .buffer_unordered(SYNC_CONCURRENCY)
        .try_collect::<()>()
        .await
}

/// `fsync`s one file or directory (`fdatasync` for a file: its data and size, which is what a
/// reader needs).
pub(crate) fn sync_path(path: &Path) -> io::Result<()> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if file.metadata()?.is_dir() {
        file.sync_all()
    } else {
        file.sync_data()
    }
    .map_err(|e| io::Error::new(e.kind(), format!("cannot fsync {}: {e}", path.display())))
}

/// Creates `dir` and its missing parents, and syncs the parent of each directory it created, so
/// that the new directories survive a crash.
pub(crate) fn create_dir_all_durably(dir: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.exists()).collect();
    std::fs::create_dir_all(dir)?;
    for created in missing.iter().rev() {
        if let Some(parent) = created.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_path(parent)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn syncs_files_new_directories_and_passes_over_vanished_files() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a/b");
        std::fs::create_dir_all(&nested).unwrap();
        std::fs::write(nested.join("x.json"), b"{}").unwrap();
        let mut durability = LocalDurability::new(dir.path().to_path_buf());
        let mut set = SyncSet::default();
        set.written(nested.join("x.json"));
        set.written(nested.join("gone.json"));
        set.changed_dir(dir.path().join("a"));
        durability.sync(set).await.unwrap();
        assert!(durability.known.contains(&nested));
        assert!(!durability.known.contains(dir.path().parent().unwrap()));
    }
}
