//! The status endpoint of a running pipeline (`[pipeline] metrics_addr`): Prometheus metrics at
//! `/metrics`, and for load balancers and Kubernetes probes:
//! - `/health` (liveness): `200` while the source streams and every sink delivers, `503` naming
//!   the source whose stream has been reconnecting or whose checks have been failing longer than
//!   its bound (see [`refract_connectors::Source::health`]), and the sinks whose batches have
//!   waited longer than theirs (see [`refract_connectors::BuiltSink::unhealthy_after`]);
//! - `/ready` (readiness): `200` once the source has started streaming and every sink is open,
//!   `503` naming what is still starting before that.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use refract_connectors::{SourceHealth, SourceReport};
use serde::Serialize;

/// Health of the source and of each sink, and what is still starting: written by the run's
/// wiring and its delivery tasks, read by the endpoint.
#[derive(Debug, Default)]
pub(crate) struct Health {
    sinks: Mutex<BTreeMap<String, SinkHealth>>,
    /// The source's health, once it has started.
    source: Mutex<Option<SourceHealth>>,
    /// The targets (sinks, dead-letter store) not open yet; `None` before they are wired.
    unopened: Mutex<Option<BTreeSet<String>>>,
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

    /// Sets the source's health gauge from its report now (once the source has started).
    fn export_source_gauge(&self) {
        if let Some(report) = lock(&self.source).as_ref().map(SourceHealth::report) {
            super::metrics::source_healthy(&report.name).set(if report.healthy {
                1.0
            } else {
                0.0
            });
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
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves `/metrics`, `/health` and `/ready` at `addr` (validated) for the rest of the process. A second
/// install in one process (tests) or an address in use is logged, not fatal: the endpoint is
/// advisory, the pipeline runs without it.
pub(crate) async fn serve(addr: &str, pipeline: &str, health: Arc<Health>) {
    let Ok(addr) = addr.parse::<std::net::SocketAddr>() else {
        return;
    };
    let metrics = match PrometheusBuilder::new()
        .add_global_label("pipeline", pipeline)
        .install_recorder()
    {
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
    let app = Router::new()
        .route(
            "/metrics",
            get(
                |State((m, health)): State<(PrometheusHandle, Arc<Health>)>| async move {
                    health.export_source_gauge();
                    m.render()
                },
            ),
        )
        .route("/health", get(health_route))
        .route("/ready", get(ready_route))
        .with_state((metrics, health));
    tracing::info!(%addr, "serving Prometheus metrics at /metrics, health at /health and readiness at /ready");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the status endpoint stopped");
        }
    });
}

async fn health_route(
    State((_, health)): State<(PrometheusHandle, Arc<Health>)>,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let (healthy, source, sinks) = health.report();
    let body = serde_json::json!({
        "status": if healthy { "ok" } else { "unhealthy" },
        "source": source,
        "sinks": sinks,
    });
    (code(healthy), axum::Json(body))
}

async fn ready_route(
    State((_, health)): State<(PrometheusHandle, Arc<Health>)>,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let starting = health.starting();
    let ready = starting.is_empty();
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "starting" },
        "starting": starting,
    });
    (code(ready), axum::Json(body))
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
