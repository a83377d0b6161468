//! `kind = "document"`: denormalized documents, one per row of a root table, with columns
//! copied from the root row and arrays of rows of other tables (one-to-many through a foreign
//! key, or many-to-many through a link table), kept current as any of those rows changes.
//!
//! **State.** The projection keeps, in the [`StateStore`] the runtime attaches, a mirror of every
//! row it has seen of each table it reads (only the columns it uses), index entries that answer
//! "which children does this root have" and "which roots list this child" by prefix scans, and
//! the dirty marks of the documents the current transaction changed (key layout: [`keys`]). It
//! never relies on before images: a delete carrying only the key, or an update that moves a
//! child to another root, is compared with the mirrored row. Nothing that grows with the data is
//! held in memory between events; building one document holds its children.
//!
//! **Fan-out.** Each change marks the documents it reaches (a rename of an author marks every
//! book listing it); a change of columns the projection does not use marks nothing.
//! [`Projection::end_transaction`] rebuilds each marked document from the mirror and emits it
//! once per transaction: an upsert, or a delete when the root row is gone. It does so in chunks
//! of the size the runtime asks for, removing each document's mark as it emits it, so a
//! transaction reaching a million documents never holds them at once; a crash in the middle
//! rolls the marks back with the state. Embedded children are
//! listed only when their row (and link row) exist; a child that arrives later marks the roots
//! linking to it. A truncate of the root table empties the collection at once (the documents
//! re-created later in the transaction follow it); a truncate of another table removes its
//! mirrored rows and marks every document they reached.
//!
//! **Without a store** (the runtime did not call [`Projection::attach_store`]) every event fails
//! with [`ProjectionError::State`]: the projection never falls back to unbounded memory.
//!
//! **Configuration changes.** The store remembers the configuration it was built for; a changed
//! document shape (tables, keys, fields, embeds) fails the first event: the state must be dropped
//! and the tables snapshotted again.

mod build;
mod keys;
mod mirror;
mod shape;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_model;

use std::sync::Arc;

use refract_schemas::config::DocumentProjectionConfig;
use refract_schemas::{ChangeEvent, Op, Position, TableId};

use crate::state::StateStore;
use crate::{DocumentOp, Emission, OpFamily, Projection, ProjectionError, WriteOp};
use shape::{Shape, document_key};

/// The document projection.
pub struct DocumentProjection {
    shape: Shape,
    collection: Arc<str>,
    /// What the state is built for: the configuration without its sinks and collection.
    fingerprint: Vec<u8>,
    store: Option<Box<dyn StateStore>>,
    /// Whether the store's fingerprint was checked.
    checked: bool,
}

impl DocumentProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Documents];

    /// Builds the projection from its configuration (validated). The collection defaults to the
    /// projection's name when loaded from a pipeline file; a configuration built in code without
    /// one uses the root table's name.
    pub fn new(config: &DocumentProjectionConfig) -> Self {
        let collection = config.collection.clone().unwrap_or_else(|| {
            let table = &config.table;
            table.rsplit('.').next().unwrap_or(table).to_owned()
        });
        let fingerprint = serde_json::to_vec(&(
            &config.table,
            &config.key,
            &config.fields,
            &config.embeds,
            &config.objects,
        ))
        .expect("a configuration serializes");
        Self {
            shape: Shape::new(config),
            collection: collection.into(),
            fingerprint,
            store: None,
            checked: false,
        }
    }

    /// The store, checked against the configuration on first use.
    fn store(&mut self) -> Result<&mut dyn StateStore, ProjectionError> {
        let store = self.store.as_deref_mut().ok_or_else(|| {
            ProjectionError::State(
                "the document projection has no state store: the runtime must attach one \
                 (attach_store) before the first event"
                    .into(),
            )
        })?;
        if !self.checked {
            match store.get(keys::SHAPE)? {
                None => store.put(keys::SHAPE, &self.fingerprint)?,
                Some(f) if f == self.fingerprint => {}
                Some(_) => {
                    return Err(ProjectionError::State(
                        "the document projection's configuration changed since its state was \
                         built: drop the projection's state and snapshot its tables again"
                            .into(),
                    ));
                }
            }
            self.checked = true;
        }
        Ok(store)
    }
}

impl Projection for DocumentProjection {
    /// The root table, every embedded table and every link table.
    fn reads(&self, table: &TableId) -> bool {
        self.shape.tables.iter().any(|t| table.matches(&t.pattern))
    }

    /// Nothing: old rows come from the mirror, so the key is enough.
    fn before_image_columns(&self, _table: &TableId) -> Vec<String> {
        Vec::new()
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        _now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let collection = self.collection.clone();
        self.store()?;
        let store = self.store.as_deref_mut().expect("checked above");
        let shape = &self.shape;
        for (t, table) in shape.tables.iter().enumerate() {
            if !event.table.matches(&table.pattern) {
                continue;
            }
            let t = u8::try_from(t).expect("validation bounds the number of tables");
            if event.op == Op::Truncate && t == shape.root {
                out.push(WriteOp::Document(DocumentOp::Truncate {
                    collection: collection.clone(),
                    position: event.position.clone(),
                }));
            }
            mirror::apply(store, shape, t, event)?;
        }
        Ok(())
    }

    fn wants_store(&self) -> bool {
        true
    }

    fn attach_store(&mut self, store: Box<dyn StateStore>) {
        self.store = Some(store);
        self.checked = false;
    }

    /// Rebuilds up to `limit` documents marked dirty, in key order, and clears their marks.
    fn end_transaction(
        &mut self,
        position: &Position,
        limit: usize,
        out: &mut Vec<WriteOp>,
    ) -> Result<Emission, ProjectionError> {
        self.store()?;
        let store = self.store.as_deref_mut().expect("checked above");
        let (shape, collection) = (&self.shape, &self.collection);
        let more = mirror::drain_some(store, &[keys::DIRTY], limit, &mut |store, mark| {
            let id = keys::components(&mark[1..])?;
            let key = document_key(&id);
            out.push(WriteOp::Document(
                match build::document(store, shape, &id)? {
                    Some(doc) => DocumentOp::Upsert {
                        collection: collection.clone(),
                        key,
                        doc: Arc::new(doc),
                        position: position.clone(),
                    },
                    None => DocumentOp::Delete {
                        collection: collection.clone(),
                        key,
                        position: position.clone(),
                    },
                },
            ));
            Ok(store.remove(mark)?)
        })?;
        Ok(if more { Emission::More } else { Emission::Done })
    }
}
