//! The replication connection's read deadline (`read_timeout_ms`): a connection that carries
//! nothing at all for that long is considered dead and reopened, so one cut without a reset (a
//! network black hole, a half-open TCP connection) does not stall the pipeline for good.
//!
//! PostgreSQL cannot be relied on to keep an idle stream talking: its walsender sends a
//! keepalive only when the client has not replied for half of `wal_sender_timeout`, and refract
//! replies every 50 ms. So once the stream has been quiet for half the deadline, the reader
//! writes a heartbeat logical message on its control connection (ignored when it comes back):
//! an idle but healthy stream then carries it well before the deadline.
//!
//! The reader checks the deadline at ticks a quarter of it apart (no timer per event), counting
//! the events it received: a connection is declared dead between one and one and a quarter
//! deadlines after its last event. Time the reader spends on something else (waiting for the
//! runtime, reading a snapshot) is not quiet time: it says so with [`Liveness::busy_until`].

use std::time::{Duration, Instant};

/// Prefix of the heartbeat logical message written on an idle stream.
pub(super) const HEARTBEAT_PREFIX: &str = "refract.heartbeat";
/// Ticks per read deadline: the deadline is noticed at most this fraction late.
const TICKS_PER_DEADLINE: u32 = 4;
/// Longest wait for a control-connection check (slot check, heartbeat): long beside a query on
/// an idle catalog, short enough that a black-holed control connection is noticed quickly and
/// does not hold the stream's reading up for long.
const MAX_CONTROL_TIMEOUT: Duration = Duration::from_secs(10);

/// What a tick found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Events arrived since the last tick.
    Heard,
    /// Quiet for less than half the deadline.
    Alive,
    /// Quiet for half the deadline: time for a heartbeat.
    Quiet,
    /// Quiet for the whole deadline, this long: the connection is dead.
    Dead(Duration),
}

/// The read deadline's bookkeeping for one connection.
#[derive(Debug)]
pub(super) struct Liveness {
    read_timeout: Duration,
    /// The event count at the last tick.
    heard: u64,
    /// Since when nothing has arrived (or the reader last stopped being busy).
    quiet_since: Instant,
}

impl Liveness {
    /// A connection opened at `now`, with `heard` events counted so far.
    pub(super) fn new(read_timeout: Duration, heard: u64, now: Instant) -> Self {
        Self {
            read_timeout,
            heard,
            quiet_since: now,
        }
    }

    /// How often [`Liveness::tick`] is to be called.
    pub(super) fn tick_period(read_timeout: Duration) -> Duration {
        read_timeout / TICKS_PER_DEADLINE
    }

    /// The bound on a control-connection check: a tick period, at most
    /// [`MAX_CONTROL_TIMEOUT`], so a check that hangs delays the deadline by little.
    pub(super) fn control_timeout(read_timeout: Duration) -> Duration {
        Self::tick_period(read_timeout).min(MAX_CONTROL_TIMEOUT)
    }

    /// The reader was busy with something else until `now`: that was not quiet time.
    pub(super) fn busy_until(&mut self, now: Instant) {
        self.quiet_since = self.quiet_since.max(now);
    }

    /// A tick at `now`, `heard` events counted so far.
    pub(super) fn tick(&mut self, heard: u64, now: Instant) -> Verdict {
        if heard != self.heard {
            self.heard = heard;
            self.quiet_since = self.quiet_since.max(now);
            return Verdict::Heard;
        }
        let quiet = now.saturating_duration_since(self.quiet_since);
        if quiet >= self.read_timeout {
            Verdict::Dead(quiet)
        } else if quiet >= self.read_timeout / 2 {
            Verdict::Quiet
        } else {
            Verdict::Alive
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_dead_after_a_deadline_without_events() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut l = Liveness::new(Duration::from_millis(1000), 0, start);
        assert_eq!(l.tick(0, at(250)), Verdict::Alive);
        assert_eq!(l.tick(3, at(500)), Verdict::Heard, "events arrived");
        assert_eq!(l.tick(3, at(750)), Verdict::Alive);
        assert_eq!(l.tick(3, at(1000)), Verdict::Quiet, "half the deadline");
        assert_eq!(l.tick(3, at(1250)), Verdict::Quiet);
        assert_eq!(
            l.tick(3, at(1500)),
            Verdict::Dead(Duration::from_millis(1000))
        );
    }

    #[test]
    fn busy_time_is_not_quiet_time() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut l = Liveness::new(Duration::from_millis(1000), 0, start);
        // Waiting for the runtime for five deadlines, then a tick at once.
        l.busy_until(at(5000));
        assert_eq!(l.tick(0, at(5001)), Verdict::Alive);
        assert_eq!(l.tick(0, at(5600)), Verdict::Quiet);
        assert!(matches!(l.tick(0, at(6000)), Verdict::Dead(_)));
    }

    #[test]
    fn checks_are_bounded_by_a_tick() {
        let t = Liveness::control_timeout(Duration::from_millis(5000));
        assert_eq!(t, Duration::from_millis(1250));
        assert_eq!(
            Liveness::control_timeout(Duration::from_secs(3600)),
            MAX_CONTROL_TIMEOUT
        );
    }
}
