//! Shadow-write migrations: the database side of `refract migrate` (seed 003 §5.2).
//!
//! - [`catalog`]: the two tables as the catalog describes them, and the identity index;
//! - [`rows`]: reading rows in key order and writing them (batched upserts and deletes);
//! - [`control`]: the control table, one row per migration, that applications and operators
//!   read (`phase`, `read_from`, positions, timestamps);
//! - [`backfill`]: existing rows copied in key-order chunks, race-free with the dual write,
//!   converted by PostgreSQL itself where [`in_database`] can write the transform in SQL;
//! - [`verify`]: counts and per-chunk checksums, then a row-by-row diff.
//!
//! The dual write itself is the `migration` sink ([`crate::sinks::migration`]) behind a
//! PostgreSQL source and the `migration` projection.

pub mod backfill;
pub mod catalog;
pub mod control;
pub mod in_database;
pub mod rows;
pub mod verify;

use crate::pg_connect::{PgConnectError, PgEndpoint};
use crate::sources::postgres::inspect::error_text;
use crate::sources::postgres::share_lock;

/// What failed in a migration step.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The database refused or failed a statement.
    #[error("{what}: {message}")]
    Database {
        /// What was being done.
        what: String,
        /// PostgreSQL's message.
        message: String,
        /// Whether trying again may succeed (connection lost, serialization failure).
        transient: bool,
        /// Whether the statement gave way to another transaction's lock (see
        /// [`share_lock`](crate::sources::postgres::share_lock)): it rolled back and may be
        /// run again at once.
        gave_way: bool,
        /// Whether a unique index refused a row.
        unique_violation: bool,
    },
    /// The migration cannot go on as asked (a phase out of order, a table that does not fit).
    #[error("{0}")]
    Refused(String),
}

impl MigrationError {
    /// Whether the statement gave way to another transaction's lock.
    pub fn gave_way(&self) -> bool {
        matches!(self, MigrationError::Database { gave_way: true, .. })
    }

    /// Whether a unique index refused a row.
    pub fn is_unique_violation(&self) -> bool {
        matches!(
            self,
            MigrationError::Database {
                unique_violation: true,
                ..
            }
        )
    }

    /// Whether trying again may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            MigrationError::Database {
                transient: true,
                ..
            }
        )
    }
}

/// A database error while doing `what`.
pub fn db(what: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> MigrationError {
    let what = what.into();
    move |e| {
        let transient = match e.code() {
            None => true,
            Some(code) => matches!(&code.code()[..2], "08" | "40" | "53" | "57" | "58"),
        };
        MigrationError::Database {
            what,
            message: error_text(&e),
            transient,
            gave_way: share_lock::gave_way(&e),
            unique_violation: e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION),
        }
    }
}

/// An ordinary connection to the migration's database, its connection task spawned.
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, MigrationError> {
    let endpoint = PgEndpoint::parse(url).map_err(|e| MigrationError::Refused(e.to_string()))?;
    let client = endpoint.connect("migration").await.map_err(|e| match e {
        PgConnectError::Connect(e) => db("cannot connect to PostgreSQL")(e),
        refused @ PgConnectError::Tls(_) => {
            MigrationError::Refused(format!("cannot connect to PostgreSQL: {refused}"))
        }
    })?;
    // The notices of `IF EXISTS` and the like are not news to an operator; the setting lets
    // this session write a table the write guard closes to applications (see `control`).
    client
        .batch_execute(&format!(
            "SET client_min_messages = warning; SET {} = on",
            control::WRITER_SETTING
        ))
        .await
        .map_err(db("cannot set up the connection"))?;
    Ok(client)
}
