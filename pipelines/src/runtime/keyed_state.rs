//! Keyed projection state on disk (`state.redb`), always rolled back to the checkpoint.
//!
//! Projections that keep keyed state (a document projection's mirrored rows, indexes and dirty
//! marks) read and write it through [`StateStore`] handles. Writes of the batch being built go
//! to an in-memory overlay; when the batch is dispatched the overlay is written in one fsynced
//! redb transaction together with an *undo record* per key (its value before the batch) and the
//! checkpoint the batch ends at. The sinks only see a batch after its state is durable, so the
//! state on disk is never older than the checkpoint; it may be newer (a crash before the batch
//! was acknowledged), and then [`KeyedState::open`] applies the undo records of every batch the
//! checkpoint does not cover, newest first: the state is exactly the state at the checkpoint,
//! and replaying from there projects every event as the first time. Undo records are deleted
//! once the checkpoint covering their batch is durable.
//!
//! A commit runs beside the next batch ([`KeyedState::begin_commit`], [`Commit::run`]): the
//! batch's overlay becomes the *committing* overlay, which reads still see until the commit is
//! done, while the projections fill a new pending overlay. One commit at a time. The runtime
//! dispatches a batch to its sinks only once its commit is done.
//!
//! Memory holds the overlays of the batch being built and of the one being committed, and
//! redb's page cache (bounded by [`CACHE_BYTES`]); the rest is on disk.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use redb::{Database, ReadOnlyTable, ReadableDatabase, ReadableTable, TableDefinition};
use refract_projections::state::{StateError, StateStore};
use refract_schemas::{Checkpoint, Offset};

/// key → value, every projection's keys behind its name and a zero byte.
const ENTRIES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
/// (batch, n) → the value a key had before the batch: key length (u32 LE), key, then a tag
/// byte (0: absent, 1: present) and the value.
const UNDO: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("undo");
/// batch → the checkpoint entries the batch ends at (JSON `{partition: [major, minor]}`).
const BATCHES: TableDefinition<u64, &[u8]> = TableDefinition::new("batches");

/// redb's page cache: enough for the hot part of the indexes, independent of the state's size.
/// It is a large share of the process's memory: at 64 MiB the peak RSS of the million-document
/// transactions of `benches/documents_bulk.sh` (400,000 books) was 80–90 MiB higher than at
/// 16 MiB, at the same rate. Pages it does not hold are read from the operating system's page
/// cache.
pub const CACHE_BYTES: usize = 16 << 20;

/// Prefixes [`Inner::empty_below`] remembers: a projection scans a few prefixes often (its dirty
/// marks), and many only once (a document's children).
const EMPTY_PREFIXES: usize = 8;

/// The keyed state of one pipeline (shared by the processor and the projections' handles).
#[derive(Clone)]
pub struct KeyedState {
    inner: Arc<Mutex<Inner>>,
}

/// Writes not yet committed, in key order: `None` removes the key.
type Overlay = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

struct Inner {
    db: Arc<Database>,
    path: PathBuf,
    /// The committed entries (`None` before the first commit creates the table).
    committed: Option<ReadOnlyTable<&'static [u8], &'static [u8]>>,
    /// Writes of the batch being built.
    pending: Overlay,
    /// Prefixes under which the committed entries hold no key, as scans found since the last
    /// [`Inner::refresh`] (at most [`EMPTY_PREFIXES`]). A document projection scans its dirty
    /// marks at the end of every transaction, and the committed entries hardly ever hold one:
    /// the seek into redb that said so was a tenth of the processor's samples
    /// (benches/documents_stream.sh).
    empty_below: Vec<Vec<u8>>,
    /// Writes of the batch being committed, until its commit is done.
    committing: Option<Arc<Overlay>>,
    next_batch: u64,
    /// Whether commits keep undo records (not for a scratch store).
    undo: bool,
    /// Committed batches whose undo records are kept until the checkpoint covers them.
    undoable: VecDeque<(u64, Vec<(String, Offset)>)>,
}

/// What [`KeyedState::open`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Batches past the checkpoint whose state writes were undone.
    pub batches_undone: u64,
    /// Keys restored.
    pub keys_restored: u64,
}

fn fail(path: &Path, e: impl std::fmt::Display) -> StateError {
    StateError(format!("state store {}: {e}", path.display()))
}

fn covered(end: &[(String, Offset)], checkpoint: &Checkpoint) -> bool {
    end.iter()
        .all(|(p, o)| checkpoint.get(p).is_some_and(|c| c >= o))
}

impl KeyedState {
    /// Opens (creating if missing) the store at `path` and rolls it back to `checkpoint`.
    pub fn open(path: &Path, checkpoint: &Checkpoint) -> Result<(Self, Recovery), StateError> {
        Self::create(path, checkpoint, true)
    }

    /// A store for one computation that no crash has to be undone in (`refract verify`): its
    /// commits keep no undo records.
    pub fn scratch(path: &Path) -> Result<Self, StateError> {
        Ok(Self::create(path, &Checkpoint::new(), false)?.0)
    }

    fn create(
        path: &Path,
        checkpoint: &Checkpoint,
        undo: bool,
    ) -> Result<(Self, Recovery), StateError> {
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create(path)
            .map_err(|e| fail(path, e))?;
        let mut inner = Inner {
            db: Arc::new(db),
            path: path.to_owned(),
            committed: None,
            pending: BTreeMap::new(),
            empty_below: Vec::new(),
            committing: None,
            next_batch: 1,
            undo,
            undoable: VecDeque::new(),
        };
        let recovery = inner.recover(checkpoint)?;
        inner.refresh()?;
        Ok((
            Self {
                inner: Arc::new(Mutex::new(inner)),
            },
            recovery,
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock already failed the run.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A handle for projection `name`: its keys live apart from every other projection's.
    pub fn handle(&self, name: &str) -> Box<dyn StateStore> {
        let mut prefix = name.as_bytes().to_vec();
        prefix.push(0);
        Box::new(Handle {
            state: self.clone(),
            prefix,
        })
    }

    /// Makes the current batch's writes durable with their undo records, as the batch ending at
    /// `end`; drops the undo records of batches `durable` covers. Blocking (call off the async
    /// threads).
    pub fn commit(
        &self,
        end: Vec<(String, Offset)>,
        durable: &Checkpoint,
    ) -> Result<(), StateError> {
        self.begin_commit(end, durable)?.run()
    }

    /// Begins [`KeyedState::commit`]: the current batch's writes stay readable, and the next
    /// batch's go to a new overlay, while [`Commit::run`] writes them (off the async threads).
    /// Fails while another commit is running.
    pub fn begin_commit(
        &self,
        end: Vec<(String, Offset)>,
        durable: &Checkpoint,
    ) -> Result<Commit, StateError> {
        let mut inner = self.lock();
        if inner.committing.is_some() {
            return Err(inner.fail("a commit began while the one before it was running"));
        }
        let prunable = inner
            .undoable
            .iter()
            .take_while(|(_, end)| covered(end, durable))
            .count();
        let prune: Vec<u64> = inner.undoable.drain(..prunable).map(|(id, _)| id).collect();
        let writes = Arc::new(std::mem::take(&mut inner.pending));
        let mut batch = None;
        if !writes.is_empty() {
            inner.committing = Some(writes.clone());
            if inner.undo {
                let id = inner.next_batch;
                inner.next_batch += 1;
                let record: BTreeMap<&str, (u64, u64)> =
                    end.iter().map(|(p, o)| (p.as_str(), (o.0, o.1))).collect();
                batch = Some((
                    id,
                    serde_json::to_vec(&record).expect("positions serialize"),
                ));
                inner.undoable.push_back((id, end));
            }
        }
        Ok(Commit {
            state: self.clone(),
            db: inner.db.clone(),
            path: inner.path.clone(),
            writes,
            batch,
            prune,
        })
    }
}

/// A commit begun by [`KeyedState::begin_commit`], to [`Commit::run`].
pub struct Commit {
    state: KeyedState,
    db: Arc<Database>,
    path: PathBuf,
    /// The batch's writes (also the committing overlay reads see).
    writes: Arc<Overlay>,
    /// The batch's id and its checkpoint record, when its undo records are kept.
    batch: Option<(u64, Vec<u8>)>,
    /// Batches whose undo records the durable checkpoint made useless.
    prune: Vec<u64>,
}

impl Commit {
    /// Writes the batch in one fsynced redb transaction (its undo records too), then lets
    /// reads see the committed entries. Blocking. A failure fails the run: the batch's writes
    /// are gone from the overlays, and no batch may be dispatched past it.
    pub fn run(self) -> Result<(), StateError> {
        if self.writes.is_empty() && self.prune.is_empty() {
            // Nothing was made the committing overlay, and the committed view stays current.
            return Ok(());
        }
        let written = self.write();
        // The committed entries and the end of the committing overlay, in one step for reads.
        let mut inner = self.state.lock();
        inner.committing = None;
        written?;
        inner.refresh()
    }

    fn write(&self) -> Result<(), StateError> {
        let fail = |e: &dyn std::fmt::Display| fail(&self.path, e);
        let txn = self.db.begin_write().map_err(|e| fail(&e))?;
        {
            let mut entries = txn.open_table(ENTRIES).map_err(|e| fail(&e))?;
            let mut undo = txn.open_table(UNDO).map_err(|e| fail(&e))?;
            let mut batches = txn.open_table(BATCHES).map_err(|e| fail(&e))?;
            for &id in &self.prune {
                batches.remove(id).map_err(|e| fail(&e))?;
                undo.retain_in((id, 0)..(id + 1, 0), |_, _| false)
                    .map_err(|e| fail(&e))?;
            }
            if let Some((id, record)) = &self.batch {
                batches
                    .insert(*id, record.as_slice())
                    .map_err(|e| fail(&e))?;
            }
            let mut buffer = Vec::new();
            for (n, (key, value)) in self.writes.iter().enumerate() {
                let old = match value {
                    Some(v) => entries.insert(key.as_slice(), v.as_slice()),
                    None => entries.remove(key.as_slice()),
                }
                .map_err(|e| fail(&e))?;
                if let Some((id, _)) = &self.batch {
                    encode_undo(&mut buffer, key, old.as_ref().map(|o| o.value()));
                    undo.insert((*id, n as u64), buffer.as_slice())
                        .map_err(|e| fail(&e))?;
                }
            }
        }
        txn.commit().map_err(|e| fail(&e))
    }
}

impl Inner {
    fn fail(&self, e: impl std::fmt::Display) -> StateError {
        fail(&self.path, e)
    }

    /// Undoes every batch the checkpoint does not cover, newest first, and forgets all undo
    /// records.
    fn recover(&mut self, checkpoint: &Checkpoint) -> Result<Recovery, StateError> {
        let txn = self.db.begin_write().map_err(|e| self.fail(e))?;
        let mut recovery = Recovery::default();
        {
            let mut batches = txn.open_table(BATCHES).map_err(|e| self.fail(e))?;
            let mut undo = txn.open_table(UNDO).map_err(|e| self.fail(e))?;
            let mut entries = txn.open_table(ENTRIES).map_err(|e| self.fail(e))?;
            let mut ids = Vec::new();
            for item in batches.iter().map_err(|e| self.fail(e))? {
                let (id, end) = item.map_err(|e| self.fail(e))?;
                let end: BTreeMap<String, (u64, u64)> = serde_json::from_slice(end.value())
                    .map_err(|e| self.fail(format!("unreadable batch record: {e}")))?;
                let end: Vec<(String, Offset)> = end
                    .into_iter()
                    .map(|(p, (a, b))| (p, Offset(a, b)))
                    .collect();
                ids.push((id.value(), covered(&end, checkpoint)));
            }
            for &(id, is_covered) in ids.iter().rev() {
                if is_covered {
                    continue;
                }
                recovery.batches_undone += 1;
                let mut records = Vec::new();
                for item in undo.range((id, 0)..(id + 1, 0)).map_err(|e| self.fail(e))? {
                    let (_, record) = item.map_err(|e| self.fail(e))?;
                    records.push(record.value().to_vec());
                }
                for record in records.iter().rev() {
                    let (key, old) =
                        decode_undo(record).ok_or_else(|| self.fail("bad undo record"))?;
                    match old {
                        Some(value) => entries.insert(key, value),
                        None => entries.remove(key),
                    }
                    .map_err(|e| self.fail(e))?;
                    recovery.keys_restored += 1;
                }
            }
            batches.retain(|_, _| false).map_err(|e| self.fail(e))?;
            undo.retain(|_, _| false).map_err(|e| self.fail(e))?;
        }
        txn.commit().map_err(|e| self.fail(e))?;
        Ok(recovery)
    }

    /// A fresh read view of the committed entries.
    fn refresh(&mut self) -> Result<(), StateError> {
        let txn = self.db.begin_read().map_err(|e| self.fail(e))?;
        self.committed = match txn.open_table(ENTRIES) {
            Ok(t) => Some(t),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(self.fail(e)),
        };
        self.empty_below.clear();
        Ok(())
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        if let Some(v) = self.committing.as_ref().and_then(|c| c.get(key)) {
            return Ok(v.clone());
        }
        Ok(self.stored(key)?.map(|v| v.value().to_vec()))
    }

    /// The committed value of `key`; not looked up under a prefix a scan found empty.
    fn stored(
        &self,
        key: &[u8],
    ) -> Result<Option<redb::AccessGuard<'static, &'static [u8]>>, StateError> {
        match &self.committed {
            Some(t) if !self.known_empty(key) => t.get(key).map_err(|e| self.fail(e)),
            _ => Ok(None),
        }
    }

    /// Whether the committed entries hold nothing under `prefix`, as a scan found since the
    /// last commit.
    fn known_empty(&self, prefix: &[u8]) -> bool {
        self.empty_below.iter().any(|p| prefix.starts_with(p))
    }

    /// Removes `key` in the pending overlay. A key that only the pending overlay holds (the
    /// committing overlay and the committed entries do not) is forgotten rather than marked
    /// removed: a document projection sets and clears dirty marks within one batch, once per
    /// transaction, and every later scan of their prefix in the batch walked past the
    /// removal marks of all the earlier ones (quadratic in the batch's transactions; a third
    /// of the processor's samples in benches/documents_stream.sh).
    fn remove(&mut self, key: Vec<u8>) -> Result<(), StateError> {
        if matches!(self.pending.get(&key), Some(Some(_))) && !self.held_below(&key)? {
            self.pending.remove(&key);
        } else {
            self.pending.insert(key, None);
        }
        Ok(())
    }

    /// Whether the committing overlay or, where it says nothing of `key`, the committed entries
    /// hold `key`.
    fn held_below(&self, key: &[u8]) -> Result<bool, StateError> {
        if let Some(v) = self.committing.as_ref().and_then(|c| c.get(key)) {
            return Ok(v.is_some());
        }
        Ok(self.stored(key)?.is_some())
    }

    /// Visits committed, committing and pending entries under `prefix` in key order, pending
    /// ones winning over committing ones, and both over committed ones.
    fn scan(
        &mut self,
        prefix: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StateError> {
        let empty = Overlay::new();
        let committing = self.committing.as_deref().unwrap_or(&empty);
        let mut overlay = Merged {
            over: under_prefix(&self.pending, prefix).peekable(),
            under: under_prefix(committing, prefix).peekable(),
        }
        .peekable();
        let known_empty = self.known_empty(prefix);
        let mut committed = match &self.committed {
            Some(t) if !known_empty => Some(
                t.range::<&[u8]>(prefix..)
                    .map_err(|e| fail(&self.path, e))?,
            ),
            _ => None,
        };
        let mut next_committed = || -> Result<Option<(Vec<u8>, Vec<u8>)>, StateError> {
            let Some(range) = committed.as_mut() else {
                return Ok(None);
            };
            match range.next() {
                Some(item) => {
                    let (k, v) = item.map_err(|e| fail(&self.path, e))?;
                    let k = k.value();
                    if k.starts_with(prefix) {
                        Ok(Some((k.to_vec(), v.value().to_vec())))
                    } else {
                        Ok(None)
                    }
                }
                None => Ok(None),
            }
        };
        let mut stored = next_committed()?;
        if stored.is_none() && !known_empty && self.committed.is_some() {
            if self.empty_below.len() == EMPTY_PREFIXES {
                self.empty_below.remove(0);
            }
            self.empty_below.push(prefix.to_vec());
        }
        loop {
            let take_overlay = match (overlay.peek(), &stored) {
                (None, None) => return Ok(()),
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some((pk, _)), Some((sk, _))) => pk.as_slice() <= sk.as_slice(),
            };
            if take_overlay {
                let (k, v) = overlay.next().expect("peeked");
                if stored.as_ref().is_some_and(|(sk, _)| sk == k) {
                    // The overlay's write replaces the committed value.
                    stored = next_committed()?;
                }
                if let Some(v) = v
                    && !visit(k, v)
                {
                    return Ok(());
                }
            } else {
                let (k, v) = stored.take().expect("checked");
                if !visit(&k, &v) {
                    return Ok(());
                }
                stored = next_committed()?;
            }
        }
    }
}

/// The entries of `overlay` under `prefix`, in key order.
fn under_prefix<'a>(
    overlay: &'a Overlay,
    prefix: &'a [u8],
) -> impl Iterator<Item = Entry<'a>> + 'a {
    overlay
        .range::<[u8], _>((Bound::Included(prefix), Bound::Unbounded))
        .take_while(move |(k, _)| k.starts_with(prefix))
}

/// An overlay's entry: a key and its value (`None`: removed).
type Entry<'a> = (&'a Vec<u8>, &'a Option<Vec<u8>>);

/// Two overlays' entries in key order, `over`'s winning on a key both have.
struct Merged<O: Iterator, U: Iterator> {
    over: std::iter::Peekable<O>,
    under: std::iter::Peekable<U>,
}

impl<'a, O, U> Iterator for Merged<O, U>
where
    O: Iterator<Item = Entry<'a>>,
    U: Iterator<Item = Entry<'a>>,
{
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        match (self.over.peek(), self.under.peek()) {
            (Some((o, _)), Some((u, _))) if o == u => {
                self.under.next();
                self.over.next()
            }
            (Some((o, _)), Some((u, _))) if u < o => self.under.next(),
            (Some(_), _) => self.over.next(),
            (None, _) => self.under.next(),
        }
    }
}

fn encode_undo(out: &mut Vec<u8>, key: &[u8], old: Option<&[u8]>) {
    out.clear();
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    match old {
        Some(v) => {
            out.push(1);
            out.extend_from_slice(v);
        }
        None => out.push(0),
    }
}

fn decode_undo(record: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let len = u32::from_le_bytes(record.get(..4)?.try_into().ok()?) as usize;
    let key = record.get(4..4 + len)?;
    match record.get(4 + len)? {
        0 => Some((key, None)),
        1 => Some((key, Some(&record[5 + len..]))),
        _ => None,
    }
}

/// One projection's view of the keyed state.
struct Handle {
    state: KeyedState,
    prefix: Vec<u8>,
}

impl Handle {
    fn key(&self, key: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + key.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(key);
        k
    }
}

impl StateStore for Handle {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        let key = self.key(key);
        self.state.lock().get(&key)
    }

    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), StateError> {
        let key = self.key(key);
        self.state.lock().pending.insert(key, Some(value.to_vec()));
        Ok(())
    }

    fn remove(&mut self, key: &[u8]) -> Result<(), StateError> {
        let key = self.key(key);
        self.state.lock().remove(key)
    }

    fn scan_prefix(
        &mut self,
        prefix: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StateError> {
        let full = self.key(prefix);
        let skip = self.prefix.len();
        self.state
            .lock()
            .scan(&full, &mut |k, v| visit(&k[skip..], v))
    }
}

#[cfg(test)]
mod tests;
