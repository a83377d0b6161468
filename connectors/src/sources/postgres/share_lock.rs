//! Share-locked reads that yield to the applications' writers.
//!
//! The snapshot and backfill chunks of the source ([`super::snapshot`]) and the migration
//! backfill read rows `FOR SHARE`, locking them in key order, while the applications lock
//! their rows in any order: a chunk and an application's transaction can each wait for the
//! other. PostgreSQL breaks such a cycle by cancelling the transaction whose wait first lasts
//! `deadlock_timeout` (1 s by default), and that may be the application's: refract, a reader,
//! would make a write of the engine of record fail.
//!
//! So a chunk waits for a lock at most [`LOCK_WAIT_DIVISOR`]-th of the server's
//! `deadlock_timeout`: in a cycle it gives up (SQLSTATE 55P03) before the application's
//! deadlock check runs, its statement rolls back, its locks go, and the application goes on.
//! The chunk is then read again after a short pause ([`Patience`]), for as long as
//! [`LOCK_PATIENCE`]; a chunk that is cancelled as the deadlock victim (40P01) is read again
//! the same way.

use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;

/// A chunk's lock wait is at most `deadlock_timeout / LOCK_WAIT_DIVISOR`. Five leaves the
/// application's wait four fifths of its `deadlock_timeout` of margin before its own deadlock
/// check could find the chunk in a cycle.
pub const LOCK_WAIT_DIVISOR: u32 = 5;

/// How long a chunk keeps retrying rows that stay locked before the job stops with an error
/// (an application transaction holding a row lock for ten minutes is one to look at).
pub const LOCK_PATIENCE: Duration = Duration::from_secs(600);

/// The longest pause between two tries, so a chunk comes back soon after the lock is gone.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// SQL that sets `lock_timeout` to the chunk's share of the server's `deadlock_timeout` (at
/// least 10 ms), for the session, or only for the current transaction when `local`.
pub fn set_lock_timeout(local: bool) -> String {
    format!(
        "SELECT set_config('lock_timeout', greatest(10, (extract(epoch FROM \
         current_setting('deadlock_timeout')::interval) * 1000 / {LOCK_WAIT_DIVISOR})::int)::text \
         || 'ms', {local})"
    )
}

/// Whether `error` is a chunk giving way to a lock: its lock wait timed out, or it was the
/// victim of a deadlock. Either way its statement (or transaction) rolled back and the chunk
/// may be read again.
pub fn gave_way(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(c) if *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::T_R_DEADLOCK_DETECTED
    )
}

/// Retries of one chunk that gave way: a growing pause (20 ms more each time, at most
/// [`MAX_PAUSE`]) until [`LOCK_PATIENCE`] has passed.
#[derive(Debug)]
pub struct Patience {
    started: Instant,
    attempts: u32,
}

impl Default for Patience {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            attempts: 0,
        }
    }
}

impl Patience {
    /// Pauses before the next try and returns true, or returns false once the patience is
    /// spent. The first try that gives way, and every 50th, is logged with `what`.
    pub async fn pause(&mut self, what: &str) -> bool {
        if self.started.elapsed() >= LOCK_PATIENCE {
            return false;
        }
        self.attempts += 1;
        if self.attempts == 1 || self.attempts % 50 == 0 {
            tracing::warn!(
                attempts = self.attempts,
                waited_s = self.started.elapsed().as_secs(),
                "{what}: rows are locked by another transaction; giving way and trying again"
            );
        }
        tokio::time::sleep((Duration::from_millis(20) * self.attempts).min(MAX_PAUSE)).await;
        true
    }

    /// How many times the chunk gave way so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}
