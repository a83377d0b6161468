//! The status endpoint of a running pipeline (`[pipeline] metrics_addr`): Prometheus metrics at
//! `/metrics`, and health at `/health` for load balancers and Kubernetes probes: `200` while
//! every sink delivers, `503` naming the sinks whose batches have waited longer than their bound
//! (see [`refract_connectors::BuiltSink::unhealthy_after`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::Serialize;

/// Health of each sink, written by the delivery tasks.
#[derive(Debug, Default)]
pub(crate) struct Health {
    sinks: Mutex<BTreeMap<String, SinkHealth>>,
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
        let mut sinks = self.sinks.lock().unwrap_or_else(|e| e.into_inner());
        sinks.insert(
            sink.to_owned(),
            SinkHealth {
                healthy: problem.is_none(),
                problem,
            },
        );
    }

    fn report(&self) -> (bool, BTreeMap<String, SinkHealth>) {
        let sinks = self.sinks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (sinks.values().all(|s| s.healthy), sinks)
    }
}

/// Serves `/metrics` and `/health` at `addr` (validated) for the rest of the process. A second
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
            get(|State((m, _)): State<(PrometheusHandle, Arc<Health>)>| async move { m.render() }),
        )
        .route("/health", get(health_route))
        .with_state((metrics, health));
    tracing::info!(%addr, "serving Prometheus metrics at /metrics and health at /health");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the status endpoint stopped");
        }
    });
}

async fn health_route(
    State((_, health)): State<(PrometheusHandle, Arc<Health>)>,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let (healthy, sinks) = health.report();
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": if healthy { "ok" } else { "unhealthy" },
        "sinks": sinks,
    });
    (status, axum::Json(body))
}
