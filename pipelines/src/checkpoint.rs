//! The checkpoint store: per source partition, the highest position every sink made durable.
//!
//! Backed by redb, an embedded ACID key-value store in pure Rust: each commit is one fsynced
//! transaction, a crash at any instant leaves either the old or the new checkpoint, and its file
//! lock stops two processes from running the same pipeline state. Projection state (what a
//! projection learned, such as a flatten projection's column types) lives in the same database.

use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use refract_schemas::{Checkpoint, Offset};

/// The store's file in a pipeline's state directory.
pub const FILE: &str = "checkpoint.redb";

/// partition name → (offset major, offset minor).
const CHECKPOINTS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("checkpoints");
/// projection name → its serialized state (`Projection::take_state`).
const PROJECTION_STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("projection_state");

/// Failure of the checkpoint store.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Another process holds the state directory.
    #[error("the state at {0} is in use by another refract process")]
    InUse(PathBuf),
    /// The embedded database failed.
    #[error("checkpoint store {path}: {source}")]
    Store {
        /// The database file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: redb::Error,
    },
}

/// The checkpoint store of one pipeline.
pub struct CheckpointStore {
    db: Database,
    path: PathBuf,
}

impl CheckpointStore {
    /// Opens (creating if missing) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => CheckpointError::InUse(path.to_owned()),
            other => CheckpointError::Store {
                path: path.to_owned(),
                source: other.into(),
            },
        })?;
        Ok(Self {
            db,
            path: path.to_owned(),
        })
    }

    /// Opens the store in the state directory `state` if there is one (`None` when no run has
    /// made it yet): a one-off command holds it, so that no run starts on the state meanwhile.
    pub fn open_existing(state: &Path) -> Result<Option<Self>, CheckpointError> {
        let db = state.join(FILE);
        if !db.exists() {
            return Ok(None);
        }
        Self::open(&db).map(Some)
    }

    fn fail(&self, e: impl Into<redb::Error>) -> CheckpointError {
        CheckpointError::Store {
            path: self.path.clone(),
            source: e.into(),
        }
    }

    /// The last committed checkpoint (empty for a new pipeline).
    pub fn load(&self) -> Result<Checkpoint, CheckpointError> {
        let txn = self.db.begin_read().map_err(|e| self.fail(e))?;
        let table = match txn.open_table(CHECKPOINTS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Checkpoint::new()),
            Err(e) => return Err(self.fail(e)),
        };
        let mut checkpoint = Checkpoint::new();
        for entry in table.iter().map_err(|e| self.fail(e))? {
            let (k, v) = entry.map_err(|e| self.fail(e))?;
            let (major, minor) = v.value();
            checkpoint.insert(k.value().to_owned(), Offset(major, minor));
        }
        Ok(checkpoint)
    }

    /// Durably records `checkpoint` (one fsynced transaction).
    pub fn commit(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        let txn = self.db.begin_write().map_err(|e| self.fail(e))?;
        {
            let mut table = txn.open_table(CHECKPOINTS).map_err(|e| self.fail(e))?;
            for (partition, offset) in checkpoint {
                table
                    .insert(partition.as_str(), (offset.0, offset.1))
                    .map_err(|e| self.fail(e))?;
            }
        }
        txn.commit().map_err(|e| self.fail(e))
    }
}

impl CheckpointStore {
    /// The state saved for projection `name`, if any.
    pub fn load_state(&self, name: &str) -> Result<Option<Vec<u8>>, CheckpointError> {
        let txn = self.db.begin_read().map_err(|e| self.fail(e))?;
        let table = match txn.open_table(PROJECTION_STATE) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(self.fail(e)),
        };
        Ok(table
            .get(name)
            .map_err(|e| self.fail(e))?
            .map(|v| v.value().to_vec()))
    }

    /// Durably records the state of projection `name` (one fsynced transaction).
    pub fn save_state(&self, name: &str, state: &[u8]) -> Result<(), CheckpointError> {
        let txn = self.db.begin_write().map_err(|e| self.fail(e))?;
        {
            let mut table = txn.open_table(PROJECTION_STATE).map_err(|e| self.fail(e))?;
            table.insert(name, state).map_err(|e| self.fail(e))?;
        }
        txn.commit().map_err(|e| self.fail(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_survive_reopening_and_the_lock_is_exclusive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.redb");
        let store = CheckpointStore::open(&path).unwrap();
        assert!(store.load().unwrap().is_empty());
        let cp = Checkpoint::from([
            ("file:a".to_string(), Offset(42, 0)),
            ("slot".to_string(), Offset(7, 3)),
        ]);
        store.commit(&cp).unwrap();
        assert!(matches!(
            CheckpointStore::open(&path),
            Err(CheckpointError::InUse(_))
        ));
        assert_eq!(store.load_state("p").unwrap(), None);
        store.save_state("p", b"learned").unwrap();
        drop(store);
        let store = CheckpointStore::open(&path).unwrap();
        assert_eq!(store.load().unwrap(), cp);
        assert_eq!(
            store.load_state("p").unwrap().as_deref(),
            Some(&b"learned"[..])
        );
    }
}
