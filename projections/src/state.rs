//! Keyed state a projection keeps between events, in a store the runtime owns.
//!
//! Projections stay pure: they read and write the [`StateStore`] they are handed and never open
//! files themselves. The runtime implements the store on disk, makes its writes durable with the
//! checkpoint and rolls it back to the checkpoint after a crash, so the state always matches
//! the position the pipeline resumes from. [`MemoryStore`] is the in-memory implementation, for
//! tests and runs without a state directory.

use std::collections::BTreeMap;
use std::ops::Bound;

/// Why the state store failed (disk, corruption): the pipeline stops.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StateError(pub String);

/// An ordered key-value store of bytes, private to one projection.
pub trait StateStore: Send {
    /// The value of `key`, if any.
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StateError>;
    /// Sets `key` to `value`.
    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), StateError>;
    /// Removes `key` (absent keys are fine).
    fn remove(&mut self, key: &[u8]) -> Result<(), StateError>;
    /// Entries whose key starts with `prefix`, in key order; `visit` returns false to stop early.
    fn scan_prefix(
        &mut self,
        prefix: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StateError>;
}

/// A [`StateStore`] in memory: nothing survives the process.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    entries: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the store holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The number of entries whose key starts with `prefix`.
    pub fn count_prefix(&self, prefix: &[u8]) -> usize {
        self.entries
            .range::<[u8], _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .count()
    }
}

impl StateStore for MemoryStore {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StateError> {
        Ok(self.entries.get(key).cloned())
    }

    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), StateError> {
        self.entries.insert(key.to_vec(), value.to_vec());
        Ok(())
    }

    fn remove(&mut self, key: &[u8]) -> Result<(), StateError> {
        self.entries.remove(key);
        Ok(())
    }

    fn scan_prefix(
        &mut self,
        prefix: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StateError> {
        for (k, v) in self
            .entries
            .range::<[u8], _>((Bound::Included(prefix), Bound::Unbounded))
        {
            if !k.starts_with(prefix) || !visit(k, v) {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_a_prefix_in_order_and_stops_when_asked() {
        let mut store = MemoryStore::new();
        for key in ["b2", "a", "b1", "b", "c", "b3"] {
            store.put(key.as_bytes(), b"v").unwrap();
        }
        let mut seen = Vec::new();
        store
            .scan_prefix(b"b", &mut |k, _| {
                seen.push(String::from_utf8(k.to_vec()).unwrap());
                true
            })
            .unwrap();
        assert_eq!(seen, ["b", "b1", "b2", "b3"]);
        seen.clear();
        store
            .scan_prefix(b"b", &mut |k, _| {
                seen.push(String::from_utf8(k.to_vec()).unwrap());
                seen.len() < 2
            })
            .unwrap();
        assert_eq!(seen, ["b", "b1"]);
        assert_eq!(store.count_prefix(b"b"), 4);
        store.remove(b"b1").unwrap();
        assert_eq!(store.get(b"b1").unwrap(), None);
        assert_eq!(store.get(b"b2").unwrap(), Some(b"v".to_vec()));
        assert_eq!(store.len(), 5);
    }
}
