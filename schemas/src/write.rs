//! Write operations: the vocabulary between projections and sinks.
//!
//! A projection emits [`WriteOp`]s; a sink applies them. Operations come in families, one per
//! thing a sink does with them ([`OpFamily`]): documents to store, cache entries to invalidate,
//! rows of columnar tables. Each projection kind declares the families it emits and each sink
//! kind the families it accepts; `refract validate` refuses a route from a projection to a sink
//! that cannot take everything the projection emits, so no sink is handed an operation it
//! cannot apply.
//!
//! A new family (tier writes, say) adds an [`OpFamily`] variant, a
//! [`WriteOp`] variant carrying its own operation type, and the declarations of the projections
//! that emit it and the sinks that accept it.

pub mod flat;
pub mod migration;
pub mod tiers;

use std::sync::Arc;

use crate::{ChangeEvent, Position, Row};
use flat::FlatChange;
use migration::MigrationOp;
use tiers::TierWrite;

/// What a sink does with a group of operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpFamily {
    /// Documents stored by key in collections: [`DocumentOp`].
    Documents,
    /// Cache entries made stale after a commit: [`Invalidation`].
    Invalidations,
    /// Row changes of flat columnar tables: [`RowChange`].
    Rows,
    /// Change events relayed as they are (to a Kafka topic per table): [`WriteOp::Change`].
    Changes,
    /// Heartbeats routed to the hot, warm and cold tiers: [`TierWrite`].
    Tiers,
    /// Rows moved between the two tables of a shadow-write migration: [`MigrationOp`].
    Migration,
}

impl OpFamily {
    /// Every family, in declaration order.
    pub const ALL: &'static [OpFamily] = &[
        OpFamily::Documents,
        OpFamily::Invalidations,
        OpFamily::Rows,
        OpFamily::Changes,
        OpFamily::Tiers,
        OpFamily::Migration,
    ];

    /// The family's name in messages ("documents").
    pub fn name(self) -> &'static str {
        match self {
            OpFamily::Documents => "documents",
            OpFamily::Invalidations => "cache invalidations",
            OpFamily::Rows => "flat table rows",
            OpFamily::Changes => "change events",
            OpFamily::Tiers => "tier writes",
            OpFamily::Migration => "migration rows",
        }
    }

    /// `families` in a sentence: "documents and cache invalidations".
    pub fn sentence(families: &[OpFamily]) -> String {
        let names: Vec<&str> = families.iter().map(|f| f.name()).collect();
        match names.split_last() {
            None => "nothing".to_owned(),
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        }
    }
}

/// One operation on a read model, produced by a projection and applied by a sink.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteOp {
    /// A document to store or remove.
    Document(DocumentOp),
    /// A cache entry to make stale.
    Invalidate(Invalidation),
    /// A row change of a flat table.
    Row(RowChange),
    /// A change event relayed as it is (shared: the sink encodes it, nothing changes it).
    Change(Arc<ChangeEvent>),
    /// A heartbeat for one tier.
    Tier(TierWrite),
    /// A row of a shadow-write migration.
    Migrate(MigrationOp),
}

impl WriteOp {
    /// The family the operation belongs to.
    pub fn family(&self) -> OpFamily {
        match self {
            WriteOp::Document(_) => OpFamily::Documents,
            WriteOp::Invalidate(_) => OpFamily::Invalidations,
            WriteOp::Row(_) => OpFamily::Rows,
            WriteOp::Change(_) => OpFamily::Changes,
            WriteOp::Tier(_) => OpFamily::Tiers,
            WriteOp::Migrate(_) => OpFamily::Migration,
        }
    }

    /// Position of the source change that produced the operation.
    pub fn position(&self) -> &Position {
        match self {
            WriteOp::Document(op) => op.position(),
            WriteOp::Invalidate(op) => &op.position,
            WriteOp::Row(op) => &op.position,
            WriteOp::Change(event) => &event.position,
            WriteOp::Tier(op) => &op.position,
            WriteOp::Migrate(op) => &op.position,
        }
    }
}

/// An operation on the documents of a collection.
#[derive(Clone, Debug, PartialEq)]
pub enum DocumentOp {
    /// Create or replace the document `key` of `collection`.
    Upsert {
        /// Collection (table, directory, key prefix) the document belongs to.
        collection: Arc<str>,
        /// The document's key, unique within the collection.
        key: String,
        /// The document.
        doc: Arc<Row>,
        /// Position of the change that produced it (sinks use it to guard against replays).
        position: Position,
    },
    /// Remove the document `key` of `collection` (absent documents are fine: deletes are
    /// idempotent).
    Delete {
        /// Collection of the document.
        collection: Arc<str>,
        /// Key of the document.
        key: String,
        /// Position of the change that produced it.
        position: Position,
    },
    /// Remove every document of `collection`.
    Truncate {
        /// The collection to empty.
        collection: Arc<str>,
        /// Position of the change that produced it.
        position: Position,
    },
}

impl DocumentOp {
    /// Position of the change that produced the operation.
    pub fn position(&self) -> &Position {
        match self {
            DocumentOp::Upsert { position, .. }
            | DocumentOp::Delete { position, .. }
            | DocumentOp::Truncate { position, .. } => position,
        }
    }
}

/// Make the cache entry `key` (an absolute key, no collection) stale: delete it, or replace it
/// with a tombstone carrying `version`. Emitted only for committed changes.
#[derive(Clone, Debug, PartialEq)]
pub struct Invalidation {
    /// The cache key.
    pub key: String,
    /// The row version the change produced ([`DELETED_VERSION`] for a deleted row); cached
    /// values older than it are stale. `None` without a version column.
    pub version: Option<i64>,
    /// Position of the change that produced it.
    pub position: Position,
}

/// The version an invalidation carries for a deleted row: newer than every real version, so a
/// tombstone for a delete is never overtaken.
pub const DELETED_VERSION: i64 = i64::MAX;

/// A row change of a flat analytical table (from a `flatten` projection).
#[derive(Clone, Debug, PartialEq)]
pub struct RowChange {
    /// The change, with the table's schema.
    pub change: FlatChange,
    /// Position of the source change that produced it.
    pub position: Position,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_read_as_sentences() {
        assert_eq!(OpFamily::sentence(&[]), "nothing");
        assert_eq!(OpFamily::sentence(&[OpFamily::Rows]), "flat table rows");
        assert_eq!(
            OpFamily::sentence(OpFamily::ALL),
            "documents, cache invalidations, flat table rows, change events, tier writes and migration rows"
        );
    }
}
