//! A schema registry for tests, speaking Confluent's REST API for the endpoints refract uses:
//! `GET /schemas/ids/{id}` and `POST /subjects/{subject}/versions`. It serves on a free loopback
//! port from a thread of its own, counts the requests it gets, can be switched "down" (every
//! request answered 503, as a registry that lost its Kafka store does) and can require basic auth.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// The registry's content type.
const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

#[derive(Default)]
struct Registry {
    /// Schema texts; the id of each is its index plus one.
    schemas: Mutex<Vec<String>>,
    down: AtomicBool,
    requests: AtomicUsize,
    /// The `Authorization` header required, when auth is on.
    authorization: Option<String>,
}

/// A running test registry; stopped when dropped.
pub struct TestRegistry {
    /// `http://127.0.0.1:{port}`.
    pub url: String,
    state: Arc<Registry>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TestRegistry {
    /// A registry open to anyone.
    pub fn start() -> Self {
        Self::serve(Registry::default())
    }

    /// A registry that answers 401 unless the request carries these basic-auth credentials.
    pub fn start_with_auth(user: &str, password: &str) -> Self {
        Self::serve(Registry {
            authorization: Some(format!(
                "Basic {}",
                base64(format!("{user}:{password}").as_bytes())
            )),
            ..Registry::default()
        })
    }

    fn serve(registry: Registry) -> Self {
        let state = Arc::new(registry);
        let app = Router::new()
            .route("/schemas/ids/{id}", get(schema_by_id))
            .route("/subjects/{subject}/versions", post(register))
            .with_state(state.clone());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        TestRegistry {
            url,
            state,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// Makes every request answer 503 (`true`) or be served again (`false`).
    pub fn set_down(&self, down: bool) {
        self.state.down.store(down, Ordering::SeqCst);
    }

    /// How many requests arrived so far (answered or refused).
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Stores a schema text directly and returns its id.
    pub fn insert(&self, schema: &str) -> u32 {
        let mut schemas = self.state.schemas.lock().unwrap();
        schemas.push(schema.to_owned());
        schemas.len() as u32
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(status: StatusCode, body: Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        body.to_string(),
    )
        .into_response()
}

fn error(status: StatusCode, code: u32, message: &str) -> Response {
    answer(status, json!({"error_code": code, "message": message}))
}

/// Counts the request and answers for the registry when it is down or the caller not let in.
fn gate(state: &Registry, headers: &HeaderMap) -> Option<Response> {
    state.requests.fetch_add(1, Ordering::SeqCst);
    if state.down.load(Ordering::SeqCst) {
        return Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            50003,
            "Error while forwarding the request to the leader",
        ));
    }
    if let Some(want) = &state.authorization {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if given != Some(want.as_str()) {
            return Some(error(StatusCode::UNAUTHORIZED, 401, "Unauthorized"));
        }
    }
    None
}

async fn schema_by_id(
    State(state): State<Arc<Registry>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&state, &headers) {
        return refused;
    }
    let schemas = state.schemas.lock().unwrap();
    let found = id
        .parse::<usize>()
        .ok()
        .and_then(|i| i.checked_sub(1))
        .and_then(|i| schemas.get(i));
    match found {
        Some(text) => answer(StatusCode::OK, json!({ "schema": text })),
        None => error(StatusCode::NOT_FOUND, 40403, "Schema not found"),
    }
}

async fn register(
    State(state): State<Arc<Registry>>,
    Path(_subject): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = gate(&state, &headers) {
        return refused;
    }
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.contains("json"));
    if !json_body {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            415,
            "Unsupported Media Type",
        );
    }
    let text = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("schema").and_then(Value::as_str).map(str::to_owned));
    let Some(text) = text.filter(|t| refract_schemas::avro::parse_schema(t).is_ok()) else {
        return error(StatusCode::UNPROCESSABLE_ENTITY, 42201, "Invalid schema");
    };
    let mut schemas = state.schemas.lock().unwrap();
    let id = match schemas.iter().position(|s| *s == text) {
        Some(i) => i + 1,
        None => {
            schemas.push(text);
            schemas.len()
        }
    };
    answer(StatusCode::OK, json!({ "id": id }))
}

/// Standard base64 with padding (for the expected basic-auth header).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
