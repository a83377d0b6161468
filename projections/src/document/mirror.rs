//! The mirror: every row the projection has seen of the tables it reads (only the columns it
//! uses), their index entries, and the dirty marks of the documents a change reaches.
//!
//! A change is compared with the mirrored row, not with the event's before image: a delete that
//! carries only the key, or an update that moves a child to another root, still finds the
//! documents the old row was part of.

use refract_schemas::{ChangeEvent, Op, Row};
use serde_json::Value;

use super::keys;
use super::shape::{RoleKind, Shape, Via, text};
use crate::ProjectionError;
use crate::replica::key_values;
use crate::state::{StateError, StateStore};

/// Rows removed per pass of a truncate, and dirty documents rebuilt per pass: bounds what is
/// held in memory between two scans of the store.
const CHUNK: usize = 512;

/// What a drain does with each key it hands out (it must remove the key).
type EachKey<'a> = dyn FnMut(&mut dyn StateStore, &[u8]) -> Result<(), ProjectionError> + 'a;

/// Hands every key under `prefix` to `each`, [`CHUNK`] keys per scan of the store. `each` must
/// remove the key it is given (or the scans never end).
pub(super) fn drain_prefix(
    store: &mut dyn StateStore,
    prefix: &[u8],
    each: &mut EachKey<'_>,
) -> Result<(), ProjectionError> {
    drain_some(store, prefix, usize::MAX, each).map(drop)
}

/// Hands the first `limit` keys (at least one) under `prefix` to `each`, which must remove the
/// key it is given, [`CHUNK`] keys per scan of the store; returns whether keys remain.
pub(super) fn drain_some(
    store: &mut dyn StateStore,
    prefix: &[u8],
    limit: usize,
    each: &mut EachKey<'_>,
) -> Result<bool, ProjectionError> {
    let mut left = limit.max(1);
    loop {
        let take = left.min(CHUNK);
        let mut keys = Vec::with_capacity(take);
        let mut more = false;
        store.scan_prefix(prefix, &mut |k, _| {
            if keys.len() == take {
                more = true;
                return false;
            }
            keys.push(k.to_vec());
            true
        })?;
        left -= keys.len();
        for key in keys {
            each(store, &key)?;
        }
        if !more || left == 0 {
            return Ok(more);
        }
    }
}

/// A row's id: its key values as text.
pub(super) type Id = Vec<String>;

/// The mirrored row `id` of table `t`.
pub(super) fn load(
    store: &mut dyn StateStore,
    t: u8,
    id: &[String],
) -> Result<Option<Row>, StateError> {
    match store.get(&keys::mirror(t, id))? {
        None => Ok(None),
        Some(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            StateError(format!(
                "document projection: a mirrored row does not decode: {e}"
            ))
        }),
    }
}

/// The ids of the rows of `t` whose indexed column `index` holds `value`.
pub(super) fn indexed(
    store: &mut dyn StateStore,
    t: u8,
    index: u8,
    value: &str,
) -> Result<IdList, StateError> {
    let prefix = keys::index_prefix(t, index, value);
    let mut list = IdList::default();
    store.scan_prefix(&prefix, &mut |k, _| {
        list.bytes.extend_from_slice(&k[prefix.len()..]);
        list.ends.push(list.bytes.len());
        true
    })?;
    Ok(list)
}

/// Ids read from an index, kept encoded in one buffer and decoded one at a time: a root with a
/// million children costs the bytes of their keys (about 20 each), not a million `Vec<String>`s
/// (about 200 bytes each).
#[derive(Debug, Default)]
pub(super) struct IdList {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl IdList {
    /// The ids, in index order.
    pub(super) fn iter(&self) -> impl Iterator<Item = Result<Id, StateError>> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .map(|(start, &end)| keys::components(&self.bytes[start..end]))
    }
}

/// The id of `row` in table `t`: the record key, else the key columns.
fn id(shape: &Shape, t: u8, event: &ChangeEvent, row: &Row) -> Result<Id, ProjectionError> {
    let key = &shape.tables[usize::from(t)].key;
    Ok(key_values(event, row, key)?.into_iter().map(text).collect())
}

/// Applies a create, snapshot read, update or delete of a row of table `t`.
pub(super) fn apply(
    store: &mut dyn StateStore,
    shape: &Shape,
    t: u8,
    event: &ChangeEvent,
) -> Result<(), ProjectionError> {
    match event.op {
        Op::Create | Op::Read | Op::Update => {
            let after = event
                .after
                .as_deref()
                .ok_or_else(|| ProjectionError::Invalid("no after image".into()))?;
            let new = id(shape, t, event, after)?;
            // A before image that carries the key says where the row was; one without it (the
            // key did not change) or none at all: it was where it is.
            let old = match event.before.as_deref() {
                Some(before) if event.op == Op::Update => {
                    id(shape, t, event, before).unwrap_or_else(|_| new.clone())
                }
                _ => new.clone(),
            };
            change(store, shape, t, &old, Some((&new, after)), true)
        }
        Op::Delete => {
            let empty = Row::new();
            let before = event.before.as_deref().unwrap_or(&empty);
            let old = id(shape, t, event, before)?;
            change(store, shape, t, &old, None, true)
        }
        Op::Truncate => truncate(store, shape, t),
    }
}

/// Removes every mirrored row of `t`, marking the documents they reached; a truncate of the root
/// table marks nothing (the collection is emptied) and drops the pending marks.
fn truncate(store: &mut dyn StateStore, shape: &Shape, t: u8) -> Result<(), ProjectionError> {
    let root = t == shape.root;
    let prefix = keys::mirror_prefix(t);
    drain_prefix(store, &prefix, &mut |store, key| {
        let id = keys::components(&key[prefix.len()..])?;
        change(store, shape, t, &id, None, !root)
    })?;
    if root {
        drain_prefix(store, &[keys::DIRTY], &mut |store, mark| {
            Ok(store.remove(mark)?)
        })?;
    }
    Ok(())
}

/// Replaces the mirrored row `old` of table `t` with `new` (none: removes it), keeps the index
/// entries and marks the documents the old and the new row reach, for every role whose columns
/// differ. `mark_root`: a change of a root row marks its own document.
fn change(
    store: &mut dyn StateStore,
    shape: &Shape,
    t: u8,
    old_id: &[String],
    new: Option<(&Id, &Row)>,
    mark_root: bool,
) -> Result<(), ProjectionError> {
    let table = &shape.tables[usize::from(t)];
    let old = load(store, t, old_id)?;
    let same_id = new.is_some_and(|(id, _)| id.as_slice() == old_id);
    let new = new.map(|(id, after)| {
        let mut row = Row::new();
        for c in &table.columns {
            // A column the new image lacks (left out by the source) keeps its mirrored value.
            let value = after
                .get(c)
                .or_else(|| same_id.then(|| old.as_ref()?.get(c)).flatten());
            if let Some(v) = value {
                row.insert(c.clone(), v.clone());
            }
        }
        (id, row)
    });
    if same_id && old.as_ref() == new.as_ref().map(|(_, row)| row) {
        return Ok(());
    }
    let changed: Vec<RoleKind> = table
        .roles
        .iter()
        .filter(|role| match (&old, &new) {
            (Some(old), Some((_, new))) if same_id => {
                role.columns.iter().any(|c| old.get(c) != new.get(c))
            }
            _ => true,
        })
        .map(|role| role.kind)
        .collect();
    match &old {
        Some(row) => {
            for &role in &changed {
                mark(store, shape, role, old_id, row, mark_root)?;
            }
        }
        // A delete of a root row never seen: its document may exist all the same.
        None if new.is_none() && mark_root && changed.contains(&RoleKind::Root) => {
            set_dirty(store, old_id)?;
        }
        None => {}
    }
    for (i, column) in table.indexes.iter().enumerate() {
        let i = u8::try_from(i).expect("validation bounds the number of indexes");
        let before = old.as_ref().and_then(|r| indexed_text(r, column));
        let after = new.as_ref().and_then(|(_, r)| indexed_text(r, column));
        if same_id && before == after {
            continue;
        }
        if let Some(v) = before {
            store.remove(&keys::index(t, i, &v, old_id))?;
        }
        if let (Some(v), Some((id, _))) = (after, &new) {
            store.put(&keys::index(t, i, &v, id), &[])?;
        }
    }
    match &new {
        Some((id, row)) => {
            if !same_id && old.is_some() {
                store.remove(&keys::mirror(t, old_id))?;
            }
            let bytes = serde_json::to_vec(row).expect("a JSON object serializes");
            store.put(&keys::mirror(t, id), &bytes)?;
            for &role in &changed {
                mark(store, shape, role, id, row, mark_root)?;
            }
        }
        None if old.is_some() => store.remove(&keys::mirror(t, old_id))?,
        None => {}
    }
    Ok(())
}

/// The text of an indexed column's value; none when null or absent (nothing joins on null).
fn indexed_text(row: &Row, column: &str) -> Option<String> {
    row.get(column).filter(|v| !v.is_null()).map(text)
}

/// Marks the documents row `id` (in `role`) is part of.
fn mark(
    store: &mut dyn StateStore,
    shape: &Shape,
    role: RoleKind,
    id: &[String],
    row: &Row,
    mark_root: bool,
) -> Result<(), ProjectionError> {
    match role {
        RoleKind::Root if mark_root => set_dirty(store, id)?,
        RoleKind::Root => {}
        RoleKind::Link(e) => {
            let Via::Link { parent, .. } = &shape.embeds[e].via else {
                unreachable!("a link role belongs to an embed with a link table")
            };
            mark_root_key(store, shape, row.get(parent))?;
        }
        RoleKind::Child(e) => match &shape.embeds[e].via {
            Via::ForeignKey { column, .. } => mark_root_key(store, shape, row.get(column))?,
            Via::Link {
                table,
                parent,
                by_child,
                ..
            } => {
                // The child key is one column: its text is the id's one part.
                for link in indexed(store, *table, *by_child, &id[0])?.iter() {
                    if let Some(link) = load(store, *table, &link?)? {
                        mark_root_key(store, shape, link.get(parent))?;
                    }
                }
            }
        },
    }
    Ok(())
}

/// Marks the document of the root whose (one-column) key is `value`, if that root exists: a
/// child or link of a root not seen yet reaches it when the root arrives.
fn mark_root_key(
    store: &mut dyn StateStore,
    shape: &Shape,
    value: Option<&Value>,
) -> Result<(), StateError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let id = vec![text(value)];
    if store.get(&keys::mirror(shape.root, &id))?.is_some() {
        set_dirty(store, &id)?;
    }
    Ok(())
}

fn set_dirty(store: &mut dyn StateStore, id: &[String]) -> Result<(), StateError> {
    let key = keys::dirty(id);
    if store.get(&key)?.is_none() {
        store.put(&key, &[])?;
    }
    Ok(())
}
