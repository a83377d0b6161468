//! Writes of a shadow-write migration: rows of one PostgreSQL table applied to the other through
//! the declared transform, and the switch of the table applications read from.

use std::sync::Arc;

use crate::{Position, Row};

/// One write of a migration's dual write (or of its reverse replication after the cut-over).
#[derive(Clone, Debug, PartialEq)]
pub struct MigrationOp {
    /// What to do.
    pub action: MigrationAction,
    /// Position of the source change that produced it.
    pub position: Position,
}

/// What a [`MigrationOp`] does.
#[derive(Clone, Debug, PartialEq)]
pub enum MigrationAction {
    /// Insert `row` into `table`, or replace the row with the same `identity` values.
    Upsert {
        /// The table written (the target before the cut-over, the source after it).
        table: Arc<str>,
        /// The columns that identify a row in `table` (the source's primary key, mapped).
        identity: Arc<[String]>,
        /// Every column of the written row.
        row: Row,
    },
    /// Delete the row of `table` whose `identity` columns hold `key`'s values.
    Delete {
        /// The table written.
        table: Arc<str>,
        /// The identity columns and their values.
        key: Row,
    },
    /// Reads (and writes) move to `read_from`: every change before this one has been applied.
    Switch {
        /// The table applications read from now.
        read_from: Arc<str>,
    },
}
