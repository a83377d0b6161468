//! A client of a Confluent-compatible schema registry: the Avro schemas Confluent-framed Kafka
//! messages name by id, and the registration of new ones.
//!
//! - [`SchemaRegistry::schema`]: `GET /schemas/ids/{id}`. A schema id never changes meaning, so
//!   every schema fetched is kept for the life of the client. While the registry does not answer
//!   (connection refused, timeout, 5xx, 408, 429) the fetch is retried with a doubling backoff,
//!   a warning logged each time; once the attempts are spent, `{fallback_dir}/{id}.avsc` is used
//!   when it exists, else the fetch fails with [`RegistryError::Unavailable`], which is
//!   retryable. An id the registry does not know (404 with error code 40403) is bad input:
//!   [`RegistryError::UnknownSchema`].
//! - [`SchemaRegistry::register`]: `POST /subjects/{subject}/versions`, retried the same way.
//!
//! Credentials come as a user name and password (basic auth) or inside the URL; the password is
//! never logged nor put in an error (URLs are shown masked).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apache_avro::Schema;
use refract_schemas::avro::parse_schema;
use refract_schemas::config::{Secret, SecretUrl};
use serde_json::{Value, json};

/// Attempts at reaching the registry before falling back: with the backoff below, about 15 s of
/// outage (a registry restart) is ridden out before the caller hears of it.
const DEFAULT_ATTEMPTS: u32 = 6;

/// The first wait between attempts; doubled after each failure.
const DEFAULT_FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// How long one request may take: the registry answers from memory, so a slow answer means it is
/// overloaded or unreachable.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The registry's content type for requests and answers.
const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// The registry's error code for "schema not found".
const SCHEMA_NOT_FOUND: i64 = 40403;

/// What went wrong talking to the schema registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry does not know this schema id: the message naming it is bad input.
    #[error("the schema registry has no schema with id {0}")]
    UnknownSchema(u32),
    /// The registry did not answer after every attempt, and no fallback file stood in.
    #[error("the schema registry at {url} is unavailable after {attempts} attempts: {reason}")]
    Unavailable {
        /// The registry's URL, masked.
        url: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last failure.
        reason: String,
    },
    /// The registry refused the request (bad credentials, an incompatible or invalid schema, a
    /// wrong URL).
    #[error("the schema registry at {url} refused the request with status {status}: {message}")]
    Rejected {
        /// The registry's URL, masked.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The registry's `error_code`, when it gave one.
        error_code: Option<i64>,
        /// The registry's message, or the body.
        message: String,
    },
    /// A schema (from the registry or a fallback file) is not a valid Avro schema.
    #[error("schema {id} from {origin} is not usable: {reason}")]
    InvalidSchema {
        /// The schema id.
        id: u32,
        /// Where it came from (the masked registry URL or the fallback file).
        origin: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The client cannot be built (an invalid URL).
    #[error("invalid schema registry configuration: {0}")]
    Config(String),
}

impl RegistryError {
    /// Whether trying again later may succeed: only while the registry is unavailable.
    pub fn is_retryable(&self) -> bool {
        matches!(self, RegistryError::Unavailable { .. })
    }
}

/// A schema registry client; cheap to share behind an `Arc`, safe to call concurrently.
pub struct SchemaRegistry {
    /// The base URL, credentials removed.
    base: url::Url,
    /// The URL as logs and errors show it.
    shown: String,
    auth: Option<(String, Option<Secret>)>,
    fallback_dir: Option<PathBuf>,
    client: reqwest::Client,
    cache: Mutex<HashMap<u32, Arc<Schema>>>,
    attempts: u32,
    first_backoff: Duration,
}

/// The outcome of one request.
enum Answer {
    /// A 2xx answer's body.
    Ok(Value),
    /// Worth trying again: no answer, 5xx, 408, 429.
    Transient(String),
    /// A refusal.
    Refused {
        status: u16,
        error_code: Option<i64>,
        message: String,
    },
}

impl SchemaRegistry {
    /// A client of the registry at `url`, with basic auth when `username` is given (credentials
    /// inside the URL are used when none are), falling back to `{fallback_dir}/{id}.avsc` files.
    pub fn new(
        url: &SecretUrl,
        username: Option<String>,
        password: Option<Secret>,
        fallback_dir: Option<PathBuf>,
    ) -> Result<Self, RegistryError> {
        let shown = url.masked();
        let mut base = url::Url::parse(url.expose())
            .map_err(|e| RegistryError::Config(format!("`{shown}` is not a URL: {e}")))?;
        let in_url = (!base.username().is_empty()).then(|| {
            let decode = |s: &str| percent_decode(s).unwrap_or_else(|| s.to_owned());
            (
                decode(base.username()),
                base.password().map(|p| Secret::from(decode(p))),
            )
        });
        let _ = base.set_username("");
        let _ = base.set_password(None);
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        // rustls needs one process-wide crypto provider (see the Redis sink); take ring unless
        // another component installed one first.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| RegistryError::Config(format!("HTTP client: {}", e.without_url())))?;
        Ok(Self {
            base,
            shown,
            auth: username.map(|u| (u, password)).or(in_url),
            fallback_dir,
            client,
            cache: Mutex::new(HashMap::new()),
            attempts: DEFAULT_ATTEMPTS,
            first_backoff: DEFAULT_FIRST_BACKOFF,
        })
    }

    /// The same client with another retry policy: `attempts` requests (at least one), the first
    /// wait `first_backoff`, doubled after each failure up to 8 s.
    pub fn with_retry(mut self, attempts: u32, first_backoff: Duration) -> Self {
        self.attempts = attempts.max(1);
        self.first_backoff = first_backoff;
        self
    }

    /// The schema with id `id`, from the cache, the registry or the fallback file (see the
    /// module doc), parsed with [`parse_schema`] so Debezium's Connect type names are kept.
    pub async fn schema(&self, id: u32) -> Result<Arc<Schema>, RegistryError> {
        if let Some(s) = self.cached(id) {
            return Ok(s);
        }
        let url = self.url(&["schemas", "ids", &id.to_string()]);
        let request = || self.with_auth(self.client.get(url.clone()));
        let text = match self.call(request, &format!("schema {id}")).await {
            Ok(body) => schema_text(&body).map_err(|reason| self.invalid(id, reason))?,
            Err(RegistryError::Rejected {
                status: 404,
                error_code: Some(SCHEMA_NOT_FOUND),
                ..
            }) => return Err(RegistryError::UnknownSchema(id)),
            Err(e @ RegistryError::Unavailable { .. }) => return self.fallback(id, e).await,
            Err(e) => return Err(e),
        };
        let schema = Arc::new(parse_schema(&text).map_err(|reason| self.invalid(id, reason))?);
        Ok(self.remember(id, schema))
    }

    /// Registers `schema` under `subject` (a new version, or the existing one when the subject
    /// already has it) and returns its id.
    pub async fn register(&self, subject: &str, schema: &Schema) -> Result<u32, RegistryError> {
        let text = serde_json::to_string(schema)
            .map_err(|e| RegistryError::Config(format!("schema cannot be written: {e}")))?;
        let body = json!({ "schema": text }).to_string();
        let url = self.url(&["subjects", subject, "versions"]);
        let request = || {
            self.with_auth(self.client.post(url.clone()))
                .header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE)
                .body(body.clone())
        };
        let answer = self
            .call(request, &format!("registering subject `{subject}`"))
            .await?;
        answer
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| RegistryError::Rejected {
                url: self.shown.clone(),
                status: 200,
                error_code: None,
                message: format!("the answer has no schema `id`: {answer}"),
            })
    }

    fn cached(&self, id: u32) -> Option<Arc<Schema>> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.get(&id).cloned()
    }

    fn remember(&self, id: u32, schema: Arc<Schema>) -> Arc<Schema> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.entry(id).or_insert(schema).clone()
    }

    fn url(&self, segments: &[&str]) -> url::Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    fn with_auth(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let request = request.header(reqwest::header::ACCEPT, CONTENT_TYPE);
        match &self.auth {
            Some((user, password)) => {
                request.basic_auth(user, password.as_ref().map(Secret::expose))
            }
            None => request,
        }
    }

    fn invalid(&self, id: u32, reason: String) -> RegistryError {
        RegistryError::InvalidSchema {
            id,
            origin: self.shown.clone(),
            reason,
        }
    }

    /// Sends the request `make` builds until it gets an answer that is not transient, or the
    /// attempts are spent.
    async fn call(
        &self,
        make: impl Fn() -> reqwest::RequestBuilder,
        what: &str,
    ) -> Result<Value, RegistryError> {
        let mut backoff = self.first_backoff;
        let mut attempt = 1;
        loop {
            let reason = match send(make()).await {
                Answer::Ok(body) => return Ok(body),
                Answer::Refused {
                    status,
                    error_code,
                    message,
                } => {
                    return Err(RegistryError::Rejected {
                        url: self.shown.clone(),
                        status,
                        error_code,
                        message,
                    });
                }
                Answer::Transient(reason) => reason,
            };
            if attempt >= self.attempts {
                return Err(RegistryError::Unavailable {
                    url: self.shown.clone(),
                    attempts: attempt,
                    reason,
                });
            }
            tracing::warn!(registry = %self.shown, attempt, of = self.attempts, error = %reason,
                retry_in_ms = backoff.as_millis() as u64, "schema registry unavailable ({what}), retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            attempt += 1;
        }
    }

    /// The fallback file of schema `id` when the registry is unavailable, else `unavailable`.
    async fn fallback(
        &self,
        id: u32,
        unavailable: RegistryError,
    ) -> Result<Arc<Schema>, RegistryError> {
        let Some(dir) = &self.fallback_dir else {
            return Err(unavailable);
        };
        let path = dir.join(format!("{id}.avsc"));
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(unavailable),
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot read the fallback schema file");
                return Err(unavailable);
            }
        };
        let schema = parse_schema(&text).map_err(|reason| RegistryError::InvalidSchema {
            id,
            origin: path.display().to_string(),
            reason,
        })?;
        tracing::warn!(registry = %self.shown, schema_id = id, file = %path.display(),
            "schema registry unavailable: using the fallback schema file");
        Ok(self.remember(id, Arc::new(schema)))
    }
}

/// Sends one request and sorts its outcome.
async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => return Answer::Transient(e.without_url().to_string()),
    };
    let status = response.status();
    let body = match response.bytes().await {
        Ok(b) => b,
        Err(e) => return Answer::Transient(e.without_url().to_string()),
    };
    let json: Option<Value> = serde_json::from_slice(&body).ok();
    if status.is_success() {
        return match json {
            Some(v) => Answer::Ok(v),
            None => Answer::Refused {
                status: status.as_u16(),
                error_code: None,
                message: "the answer is not JSON".into(),
            },
        };
    }
    let message = json
        .as_ref()
        .and_then(|v| v.get("message"))
        .and_then(Value::as_str)
        .map_or_else(
            || String::from_utf8_lossy(&body).into_owned(),
            str::to_owned,
        );
    if status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429 {
        return Answer::Transient(format!("status {}: {message}", status.as_u16()));
    }
    Answer::Refused {
        status: status.as_u16(),
        error_code: json
            .as_ref()
            .and_then(|v| v.get("error_code"))
            .and_then(Value::as_i64),
        message,
    }
}

/// The Avro schema text of a `GET /schemas/ids/{id}` answer.
fn schema_text(body: &Value) -> Result<String, String> {
    match body.get("schemaType").and_then(Value::as_str) {
        None | Some("AVRO") => {}
        Some(other) => return Err(format!("it is a {other} schema, not Avro")),
    }
    body.get("schema")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| "the answer has no `schema` string".into())
}

/// Decodes `%XX` escapes (credentials inside a URL); `None` when the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials_and_keep_their_path() {
        let r = SchemaRegistry::new(
            &"https://bob:s%40cret@reg.example/prefix".into(),
            None,
            None,
            None,
        )
        .unwrap();
        assert_eq!(r.auth, Some(("bob".to_owned(), Some("s@cret".into()))));
        assert_eq!(
            r.url(&["schemas", "ids", "7"]).as_str(),
            "https://reg.example/prefix/schemas/ids/7"
        );
        assert!(!r.shown.contains("cret"), "{}", r.shown);
        let r = SchemaRegistry::new(
            &"http://reg:8081/".into(),
            Some("u".into()),
            Some("p".into()),
            None,
        )
        .unwrap();
        assert_eq!(
            r.url(&["subjects", "a/b", "versions"]).as_str(),
            "http://reg:8081/subjects/a%2Fb/versions"
        );
        assert!(SchemaRegistry::new(&"not a url".into(), None, None, None).is_err());
    }

    #[test]
    fn only_unavailability_is_retryable() {
        let unavailable = RegistryError::Unavailable {
            url: "u".into(),
            attempts: 1,
            reason: "r".into(),
        };
        assert!(unavailable.is_retryable());
        assert!(!RegistryError::UnknownSchema(3).is_retryable());
        assert!(schema_text(&json!({"schemaType": "PROTOBUF", "schema": "x"})).is_err());
        assert_eq!(schema_text(&json!({"schema": "x"})).unwrap(), "x");
    }
}
