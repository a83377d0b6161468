//! Projections: pure, synchronous transformations from change events to write operations.
//!
//! A projection sees one [`ChangeEvent`] at a time (plus whatever state is handed to it and the
//! current time) and appends [`WriteOp`]s for the sinks. No IO, no async runtime, no clients, no
//! clock: everything a projection does can be replayed and tested from a file of events.

pub mod cache_invalidation;
pub mod document;
pub mod flatten;
pub mod migration;
pub mod relay;
pub mod replica;
pub mod state;
pub mod tiers;

use refract_schemas::config::ProjectionConfig;
use refract_schemas::{ChangeEvent, Position, TableId};

pub use refract_schemas::write::{DocumentOp, Invalidation, OpFamily, RowChange, WriteOp};

/// Why a projection could not handle an event; the runtime dead-letters the event or stops.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProjectionError {
    /// The event has no record key and lacks (or has null) key columns.
    #[error("table `{table}`: no key: column `{column}` is missing or null in the row")]
    MissingKey {
        /// The event's table.
        table: String,
        /// The first key column that was missing.
        column: String,
    },
    /// Any other reason the event cannot be projected.
    #[error("{0}")]
    Invalid(String),
    /// The projection's state store failed (disk, corruption): the runtime stops the pipeline
    /// instead of dead-lettering the event, which is not at fault.
    #[error("projection state: {0}")]
    State(String),
}

impl From<state::StateError> for ProjectionError {
    fn from(e: state::StateError) -> Self {
        ProjectionError::State(e.0)
    }
}

/// A pure transformation from change events to write operations.
pub trait Projection: Send {
    /// Whether events of `table` concern this projection.
    fn reads(&self, table: &TableId) -> bool;

    /// The columns of `table` this projection needs from the before image (the old row) of
    /// updates and deletes, beyond the record key: e.g. the columns a cache-invalidation
    /// projection renders into the keys it deletes. Empty when the key is enough.
    ///
    /// A PostgreSQL source sends the old row only as its replica identity allows (`DEFAULT`: the
    /// primary key, and on updates only when the key changes; `USING INDEX`: that index's
    /// columns; `FULL`: every column), so `refract plan` warns for each table whose replica
    /// identity does not provide these columns.
    fn before_image_columns(&self, table: &TableId) -> Vec<String>;

    /// Appends the write operations `event` implies to `out`. `now_ms` is the wall-clock time the
    /// runtime handed in (milliseconds since the epoch), for time-based projections.
    ///
    /// On an error the runtime dead-letters (or stops at) the event, and still applies what was
    /// appended before it: a projection that can derive part of the operations (the cache keys
    /// of the new row, not those of an old row it was not sent) appends them and then reports
    /// the rest.
    fn project(
        &mut self,
        event: &ChangeEvent,
        now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError>;

    /// State the projection learned from the events so far that must survive a restart (a
    /// flatten projection's column types), serialized; `None` when nothing changed since the
    /// last call. The runtime persists it before the batch holding the events that taught it
    /// is written anywhere, so the state is never older than the checkpoint. It may be newer
    /// (a crash before the checkpoint): state must therefore only ever grow, so that replayed
    /// events project the same way.
    fn take_state(&mut self) -> Option<Vec<u8>> {
        None
    }

    /// Restores state returned by [`Projection::take_state`] in an earlier run, before the
    /// first event.
    fn restore_state(&mut self, _state: &[u8]) -> Result<(), String> {
        Ok(())
    }

    /// Whether the projection keeps keyed state in a store the runtime hands it
    /// ([`Projection::attach_store`]).
    fn wants_store(&self) -> bool {
        false
    }

    /// Hands the projection its store before the first event (only when
    /// [`Projection::wants_store`]). The store is the projection's alone; the runtime rolls it
    /// back to the last checkpoint after a crash, so it is never ahead of the read models.
    fn attach_store(&mut self, _store: Box<dyn state::StateStore>) {}

    /// The end of a source transaction: effects buffered while projecting its events (documents
    /// it touched) are appended now, once per transaction, with `position` (the transaction's
    /// end). The runtime calls it after each transaction END marker, and after each event that
    /// belongs to no marked transaction.
    ///
    /// **Bounded, in chunks.** One call appends at most `limit` operations (at least one when
    /// anything is buffered) and returns [`Emission::More`] while effects remain buffered; the
    /// runtime then calls again with the same `position` until [`Emission::Done`], and may cut
    /// the batch between two calls, so one transaction reaching a million documents never holds
    /// them all. Each call removes from the state what it emitted (a document projection's dirty
    /// marks) in the same batch as the operations it appended. Crash safety rests on the
    /// runtime: a batch cut between two calls does not advance the checkpoint, and its state
    /// writes are undone at restart unless the batch that ends the emission is durable, so a
    /// crash in the middle replays the transaction and emits every effect again (sink writes are
    /// idempotent). A projection must therefore only emit what its state still buffers, never
    /// remember in memory what an earlier call of the same emission did.
    fn end_transaction(
        &mut self,
        _position: &Position,
        _limit: usize,
        _out: &mut Vec<WriteOp>,
    ) -> Result<Emission, ProjectionError> {
        Ok(Emission::Done)
    }
}

/// What [`Projection::end_transaction`] left buffered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emission {
    /// Nothing: the transaction's effects are all emitted.
    Done,
    /// Effects remain buffered: call again with the same position.
    More,
}

/// The one place that turns projection configuration into projections: every kind is in this
/// `match`.
pub fn build(config: &ProjectionConfig) -> Box<dyn Projection> {
    match config {
        ProjectionConfig::Replica(c) => Box::new(replica::ReplicaProjection::new(c.clone())),
        ProjectionConfig::CacheInvalidation(c) => {
            Box::new(cache_invalidation::CacheInvalidationProjection::new(c))
        }
        ProjectionConfig::Flatten(c) => Box::new(flatten::FlattenProjection::new(c)),
        ProjectionConfig::Document(c) => Box::new(document::DocumentProjection::new(c)),
        ProjectionConfig::Relay(c) => Box::new(relay::RelayProjection::new(c)),
        ProjectionConfig::Tiers(c) => Box::new(tiers::TiersProjection::new(c)),
        ProjectionConfig::Migration(c) => Box::new(migration::MigrationProjection::new(c)),
    }
}

/// The families of write operations a projection of this kind emits, as each kind declares
/// them: `refract validate` refuses a route to a sink that does not accept all of them.
pub fn emits(config: &ProjectionConfig) -> &'static [OpFamily] {
    match config {
        ProjectionConfig::Replica(_) => replica::ReplicaProjection::EMITS,
        ProjectionConfig::CacheInvalidation(_) => {
            cache_invalidation::CacheInvalidationProjection::EMITS
        }
        ProjectionConfig::Flatten(_) => flatten::FlattenProjection::EMITS,
        ProjectionConfig::Document(_) => document::DocumentProjection::EMITS,
        ProjectionConfig::Relay(_) => relay::RelayProjection::EMITS,
        ProjectionConfig::Tiers(_) => tiers::TiersProjection::EMITS,
        ProjectionConfig::Migration(_) => migration::MigrationProjection::EMITS,
    }
}

/// What the projections' unit tests share.
#[cfg(test)]
pub(crate) mod test_support {
    use refract_schemas::debezium::DebeziumDecoder;
    use refract_schemas::{ChangeEvent, Offset, Position, Record};

    use crate::{Emission, Projection, ProjectionError, WriteOp};

    /// Ends a transaction as the runtime does: calls [`Projection::end_transaction`] with
    /// `limit` until it is done, checking each call's bound; returns the number of calls.
    pub(crate) fn end_all(
        p: &mut dyn Projection,
        position: &Position,
        limit: usize,
        out: &mut Vec<WriteOp>,
    ) -> Result<usize, ProjectionError> {
        let mut calls = 0;
        loop {
            let before = out.len();
            let emission = p.end_transaction(position, limit, out)?;
            calls += 1;
            assert!(out.len() - before <= limit.max(1), "at most {limit} a call");
            if emission == Emission::Done {
                return Ok(calls);
            }
            assert!(
                out.len() > before,
                "a call that leaves more emits something"
            );
        }
    }

    /// The change event of one Debezium envelope.
    pub(crate) fn event(line: serde_json::Value) -> ChangeEvent {
        let pos = Position {
            partition: "p".into(),
            offset: Offset(1, 0),
        };
        match DebeziumDecoder::new()
            .decode(line.to_string().as_bytes(), pos)
            .unwrap()
        {
            Record::Change(e) => e,
            r => panic!("{r:?}"),
        }
    }
}
