//! A source's health, as the status endpoint reports it (`/health`): whether its stream is
//! connected or has been reconnecting (since when, and the last error), and whether the checks
//! it runs beside the stream (a PostgreSQL slot's retained WAL, say) fail.
//!
//! The source records what happens to its connections in a [`SourceHealth`]; the status
//! endpoint reads a [`SourceReport`] from it. A trouble makes the source unhealthy only once it
//! has lasted the source's bound (`unhealthy_after_ms`): a reconnection that succeeds at once, a
//! check that fails once, are logged but do not page anyone.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A source's health, shared by the source (which records) and the status endpoint (which
/// reads). Clones share one state.
#[derive(Debug, Clone)]
pub struct SourceHealth {
    /// The source's name in reports (`pg:{slot}`).
    name: Arc<str>,
    /// How long a trouble may last before the source is reported unhealthy.
    unhealthy_after: Duration,
    troubles: Arc<Mutex<Troubles>>,
}

/// What is wrong with a source now, each since when.
#[derive(Debug, Clone, Default)]
struct Troubles {
    /// The stream is down and being reconnected.
    stream: Option<Trouble>,
    /// The checks beside the stream fail.
    checks: Option<Trouble>,
}

/// A trouble that began at `since` and last failed with `error`.
#[derive(Debug, Clone)]
struct Trouble {
    since: Instant,
    error: String,
}

/// The state of a source as `/health` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceState {
    /// Streaming, checks passing.
    Connected,
    /// The stream is down and being reconnected.
    Reconnecting,
    /// The stream runs, but the checks beside it fail.
    ChecksFailing,
}

/// What `/health` says of the source at one instant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SourceReport {
    /// The source's name (`pg:{slot}`).
    pub name: String,
    /// Whether no trouble has lasted longer than the source's bound.
    pub healthy: bool,
    /// The worst trouble (a stream down before failing checks), or connected.
    pub state: SourceState,
    /// For how long the source has been in `state` (milliseconds), unless connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub for_ms: Option<u64>,
    /// Every trouble with its last error, unless connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

impl Default for SourceHealth {
    /// A source that never reports a trouble (the default of [`crate::Source::health`]).
    fn default() -> Self {
        Self::new("source", crate::DEFAULT_UNHEALTHY_AFTER)
    }
}

impl SourceHealth {
    /// A connected source named `name`, unhealthy once a trouble lasts `unhealthy_after`.
    pub fn new(name: &str, unhealthy_after: Duration) -> Self {
        Self {
            name: Arc::from(name),
            unhealthy_after,
            troubles: Arc::default(),
        }
    }

    /// The stream delivers again (ends a reconnection).
    pub fn connected(&self) {
        self.update(|t| t.stream = None);
    }

    /// The stream is down and being reconnected, the last attempt failing with `error`.
    pub fn reconnecting(&self, error: &str) {
        self.update(|t| begin_or_go_on(&mut t.stream, error));
    }

    /// A check beside the stream failed with `error`.
    pub fn check_failed(&self, error: &str) {
        self.update(|t| begin_or_go_on(&mut t.checks, error));
    }

    /// A check beside the stream passed (ends a run of failures).
    pub fn check_passed(&self) {
        self.update(|t| t.checks = None);
    }

    /// The report at this instant.
    pub fn report(&self) -> SourceReport {
        self.report_at(Instant::now())
    }

    /// The report at `now`.
    pub fn report_at(&self, now: Instant) -> SourceReport {
        let troubles = self.lock().clone();
        let lasted = |t: &Trouble| now.saturating_duration_since(t.since);
        let (state, worst) = match (&troubles.stream, &troubles.checks) {
            (Some(s), _) => (SourceState::Reconnecting, Some(s)),
            (None, Some(c)) => (SourceState::ChecksFailing, Some(c)),
            (None, None) => (SourceState::Connected, None),
        };
        let healthy = [&troubles.stream, &troubles.checks]
            .into_iter()
            .flatten()
            .all(|t| lasted(t) < self.unhealthy_after);
        let mut problems = Vec::new();
        if let Some(s) = &troubles.stream {
            problems.push(describe("the stream has been reconnecting", s, lasted(s)));
        }
        if let Some(c) = &troubles.checks {
            problems.push(describe("its checks have been failing", c, lasted(c)));
        }
        SourceReport {
            name: self.name.to_string(),
            healthy,
            state,
            for_ms: worst.map(|t| millis(lasted(t))),
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
        }
    }

    fn update(&self, change: impl FnOnce(&mut Troubles)) {
        change(&mut self.lock());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Troubles> {
        // A panic while holding the lock leaves plain data behind: still readable.
        self.troubles.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Starts a trouble now, or keeps its start and notes the newer error.
fn begin_or_go_on(trouble: &mut Option<Trouble>, error: &str) {
    match trouble {
        Some(t) => error.clone_into(&mut t.error),
        None => {
            *trouble = Some(Trouble {
                since: Instant::now(),
                error: error.to_owned(),
            });
        }
    }
}

fn describe(what: &str, trouble: &Trouble, lasted: Duration) -> String {
    format!("{what} for {} ms: {}", millis(lasted), trouble.error)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trouble_is_unhealthy_only_once_it_lasts_the_bound() {
        let health = SourceHealth::new("pg:s", Duration::from_secs(30));
        let now = Instant::now();
        assert_eq!(health.report_at(now).state, SourceState::Connected);
        assert!(health.report_at(now).healthy);

        health.reconnecting("connection refused");
        health.reconnecting("timed out");
        let early = health.report_at(Instant::now());
        assert_eq!(early.state, SourceState::Reconnecting);
        assert!(early.healthy, "{early:?}");
        let late = health.report_at(Instant::now() + Duration::from_secs(31));
        assert!(!late.healthy);
        let problem = late.problem.unwrap_or_default();
        assert!(
            problem.contains("reconnecting") && problem.contains("timed out"),
            "{problem}"
        );

        health.connected();
        let back = health.report_at(Instant::now() + Duration::from_secs(31));
        assert!(back.healthy && back.problem.is_none(), "{back:?}");
    }

    #[test]
    fn failing_checks_are_reported_after_a_stream_down() {
        let health = SourceHealth::new("pg:s", Duration::from_millis(0));
        health.check_failed("timed out after 2000 ms");
        let report = health.report();
        assert_eq!(report.state, SourceState::ChecksFailing);
        assert!(!report.healthy);
        health.reconnecting("nothing received");
        let report = health.report();
        assert_eq!(report.state, SourceState::Reconnecting);
        let problem = report.problem.unwrap_or_default();
        assert!(problem.contains("checks") && problem.contains("nothing received"));
        health.check_passed();
        health.connected();
        assert!(health.report().healthy);
    }
}
