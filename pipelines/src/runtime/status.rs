//! The status endpoint of a running pipeline (`[pipeline] metrics_addr`): Prometheus metrics at
//! `/metrics`, a status page at `/` (self-contained HTML that polls `/status.json`), and for
//! load balancers and Kubernetes probes:
//! - `/health` (liveness): `200` while the source streams and every sink delivers, `503` naming
//!   the source whose stream has been reconnecting or whose checks have been failing longer than
//!   its bound (see [`refract_connectors::Source::health`]), and the sinks whose batches have
//!   waited longer than theirs (see [`refract_connectors::BuiltSink::unhealthy_after`]);
//! - `/ready` (readiness): `200` once the source has started streaming and every sink is open,
//!   `503` naming what is still starting before that.
//!
//! The page's figures come from the recorder that `/metrics` renders, read back through
//! [`super::history::Series`], and its health from the same [`Health`] as `/health`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Html;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use refract_connectors::sources::postgres::metrics::{SLOT_LAG_BYTES, SLOT_RETAINED_WAL_BYTES};
use refract_connectors::{SourceHealth, SourceReport};
use serde::Serialize;

use super::history::{self, HISTORY_SAMPLES, History, SAMPLE_INTERVAL, Sample, Series};
use super::journal::{Journal, Level};
use super::metrics as m;

/// The status page: one file, its CSS and script inline (it must work in a closed network).
const STATUS_PAGE: &str = include_str!("status_page.html");

/// The metrics whose current values the status page shows as figures (each exactly as
/// `/metrics` renders it at the same moment).
const PAGE_FIGURES: &[&str] = &[
    m::RECORDS_READ,
    m::DEAD_LETTERS,
    m::SINK_EVENTS,
    m::SINK_BATCHES,
    m::SINK_RETRIES,
    m::SINK_QUEUE_DEPTH,
    m::SOURCE_LAG_SECONDS,
    m::CHECKPOINT_OFFSET,
    SLOT_LAG_BYTES,
    SLOT_RETAINED_WAL_BYTES,
];

/// No change read and not yet durable (see [`Health::pending_since`]).
const NOTHING_PENDING: i64 = i64::MIN;

/// Health of the source and of each sink, and what is still starting: written by the run's
/// wiring and its delivery tasks, read by the endpoint.
#[derive(Debug)]
pub(crate) struct Health {
    sinks: Mutex<BTreeMap<String, SinkHealth>>,
    /// The source's health, once it has started.
    source: Mutex<Option<SourceHealth>>,
    /// The targets (sinks, dead-letter store) not open yet; `None` before they are wired.
    unopened: Mutex<Option<BTreeSet<String>>>,
    /// Recent warnings, errors and dead letters, for the status page.
    pub(crate) journal: Journal,
    /// Commit time (ms since the epoch) of the oldest change read but not yet durable in every
    /// sink, or [`NOTHING_PENDING`].
    oldest_pending_ms: AtomicI64,
    /// Whether the source was unhealthy when last looked at (its changes are journaled).
    source_unhealthy: AtomicBool,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            sinks: Mutex::default(),
            source: Mutex::default(),
            unopened: Mutex::default(),
            journal: Journal::default(),
            oldest_pending_ms: AtomicI64::new(NOTHING_PENDING),
            source_unhealthy: AtomicBool::new(false),
        }
    }
}

/// What `/health` says of one sink.
#[derive(Debug, Clone, Serialize)]
struct SinkHealth {
    healthy: bool,
    /// Why not, while unhealthy: how long the batch has waited and the last error.
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
}

impl Health {
    /// Records that `sink` delivers (`problem` none) or has waited too long (`problem` says why).
    pub(crate) fn set(&self, sink: &str, problem: Option<String>) {
        match &problem {
            Some(problem) => self.journal.note(Level::Error, sink, problem),
            None => self.journal.note(Level::Info, sink, "delivering again"),
        }
        let mut sinks = lock(&self.sinks);
        sinks.insert(
            sink.to_owned(),
            SinkHealth {
                healthy: problem.is_none(),
                problem,
            },
        );
    }

    /// Records that the source has started, with its health handle.
    pub(crate) fn source_started(&self, source: SourceHealth) {
        *lock(&self.source) = Some(source);
    }

    /// Records the targets the run opens (their delivery tasks report each open).
    pub(crate) fn expect_open(&self, targets: impl IntoIterator<Item = String>) {
        *lock(&self.unopened) = Some(targets.into_iter().collect());
    }

    /// Records that `target` is open.
    pub(crate) fn opened(&self, target: &str) {
        if let Some(unopened) = lock(&self.unopened).as_mut() {
            unopened.remove(target);
        }
    }

    /// Whether everything is healthy, the source's report (once started) and the sinks'.
    fn report(&self) -> (bool, Option<SourceReport>, BTreeMap<String, SinkHealth>) {
        let sinks = lock(&self.sinks).clone();
        let source = lock(&self.source).as_ref().map(SourceHealth::report);
        let healthy =
            sinks.values().all(|s| s.healthy) && source.as_ref().is_none_or(|s| s.healthy);
        (healthy, source, sinks)
    }

    /// Records the commit time (ms since the epoch) of the oldest change read but not yet
    /// durable in every sink, `None` when everything read is durable.
    pub(crate) fn pending_since(&self, commit_ms: Option<i64>) {
        self.oldest_pending_ms
            .store(commit_ms.unwrap_or(NOTHING_PENDING), Ordering::Relaxed);
    }

    /// Sets the gauges computed at read time (the source's health, the source lag) and journals
    /// a change of the source's health: called before each rendering of the recorder.
    fn export_gauges(&self) {
        let oldest = self.oldest_pending_ms.load(Ordering::Relaxed);
        let lag_ms = if oldest == NOTHING_PENDING {
            0
        } else {
            (super::now_ms() - oldest).max(0)
        };
        m::source_lag_seconds().set(lag_ms as f64 / 1000.0);
        let Some(report) = lock(&self.source).as_ref().map(SourceHealth::report) else {
            return;
        };
        m::source_healthy(&report.name).set(if report.healthy { 1.0 } else { 0.0 });
        let was_unhealthy = self
            .source_unhealthy
            .swap(!report.healthy, Ordering::Relaxed);
        match (was_unhealthy, report.healthy) {
            (false, false) => {
                let problem = report.problem.as_deref().unwrap_or("unhealthy");
                self.journal.note(Level::Error, "source", problem);
            }
            (true, true) => self.journal.note(Level::Info, "source", "streaming again"),
            _ => {}
        }
    }

    /// What the run still waits for before it is ready: the source, targets not open yet.
    fn starting(&self) -> Vec<String> {
        let mut waiting = Vec::new();
        if lock(&self.source).is_none() {
            waiting.push("source".to_owned());
        }
        match lock(&self.unopened).as_ref() {
            None => waiting.push("sinks".to_owned()),
            Some(unopened) => waiting.extend(unopened.iter().cloned()),
        }
        waiting
    }
}

/// Locks `m`; a panic while holding the lock leaves plain data behind, still readable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the endpoint's routes read.
#[derive(Clone)]
struct Status {
    metrics: PrometheusHandle,
    health: Arc<Health>,
    history: Arc<History>,
    pipeline: Arc<str>,
}

impl Status {
    /// The recorder rendered now, with the read-time gauges set first.
    fn render(&self) -> String {
        self.health.export_gauges();
        self.metrics.render()
    }
}

/// Serves `/metrics`, `/health`, `/ready`, the status page `/` and its data `/status.json` at
/// `addr` (validated) for the rest of the process, and samples the page's history. A second
/// install in one process (tests) or an address in use is logged, not fatal: the endpoint is
/// advisory, the pipeline runs without it.
pub(crate) async fn serve(addr: &str, pipeline: &str, health: Arc<Health>) {
    let Ok(addr) = addr.parse::<std::net::SocketAddr>() else {
        return;
    };
    let builder = PrometheusBuilder::new()
        .add_global_label("pipeline", pipeline)
        .set_buckets_for_metric(
            Matcher::Full(m::SINK_WRITE_SECONDS.to_owned()),
            m::WRITE_SECONDS_BUCKETS,
        );
    let metrics = match builder.and_then(PrometheusBuilder::install_recorder) {
        Ok(handle) => handle,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "cannot record metrics");
            return;
        }
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "cannot serve metrics and health");
            return;
        }
    };
    let status = Status {
        metrics,
        health,
        history: Arc::new(History::new(HISTORY_SAMPLES)),
        pipeline: pipeline.into(),
    };
    let sampled = status.clone();
    history::spawn_sampler(status.history.clone(), move || {
        Series::parse(&sampled.render())
    });
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(status): State<Status>| async move { status.render() }),
        )
        .route("/health", get(health_route))
        .route("/ready", get(ready_route))
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .route("/status.json", get(status_route))
        .with_state(status);
    tracing::info!(%addr, "serving Prometheus metrics at /metrics, the status page at /, health at /health and readiness at /ready");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the status endpoint stopped");
        }
    });
}

async fn health_route(State(status): State<Status>) -> (StatusCode, axum::Json<serde_json::Value>) {
    let (healthy, source, sinks) = status.health.report();
    let body = serde_json::json!({
        "status": if healthy { "ok" } else { "unhealthy" },
        "source": source,
        "sinks": sinks,
    });
    (code(healthy), axum::Json(body))
}

async fn ready_route(State(status): State<Status>) -> (StatusCode, axum::Json<serde_json::Value>) {
    let starting = status.health.starting();
    let ready = starting.is_empty();
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "starting" },
        "starting": starting,
    });
    (code(ready), axum::Json(body))
}

/// The status page's data: health (as `/health`), the figures and a sample rendered from the
/// recorder now (as `/metrics` would show them), the history, and the recent troubles.
async fn status_route(State(status): State<Status>) -> axum::Json<serde_json::Value> {
    let series = Series::parse(&status.render());
    let now_ms = super::now_ms();
    let (healthy, source, sinks) = status.health.report();
    let mut history = status.history.samples();
    history.push(Sample::of(now_ms, &series));
    axum::Json(serde_json::json!({
        "pipeline": &*status.pipeline,
        "now_ms": now_ms,
        "sample_interval_ms": SAMPLE_INTERVAL.as_millis() as u64,
        "healthy": healthy,
        "starting": status.health.starting(),
        "source": source,
        "sinks": sinks,
        "figures": series.of(PAGE_FIGURES),
        "history": history,
        "errors": status.health.journal.errors(),
        "dead_letters": status.health.journal.letters(),
    }))
}

fn code(ok: bool) -> StatusCode {
    if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ready_once_the_source_started_and_every_target_is_open() {
        let health = Health::default();
        assert_eq!(health.starting(), ["source", "sinks"]);
        health.expect_open(["docs".to_owned(), "dead_letter".to_owned()]);
        health.source_started(SourceHealth::default());
        health.opened("dead_letter");
        assert_eq!(health.starting(), ["docs"]);
        health.opened("docs");
        assert!(health.starting().is_empty());
    }

    #[test]
    fn a_source_past_its_bound_makes_the_pipeline_unhealthy() {
        let health = Health::default();
        assert!(health.report().0, "healthy before the source starts");
        let source = SourceHealth::new("pg:slot", Duration::ZERO);
        health.source_started(source.clone());
        assert!(health.report().0);
        source.reconnecting("nothing received");
        let (healthy, report, _) = health.report();
        assert!(!healthy);
        assert_eq!(report.map(|r| r.name), Some("pg:slot".to_owned()));
    }
}
