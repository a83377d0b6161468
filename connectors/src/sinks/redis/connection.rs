//! The connection to Redis: connected on demand, dropped when it fails (so the next attempt
//! reconnects), failures classified for the retry policy, and the background tasks that use it
//! (truncates, second deletes).

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, RetryMethod};
use refract_schemas::config::mask_url;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::SinkError;

/// How long connecting may take before the attempt counts as failed (and is retried).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a pipeline may wait for its replies: a Redis that hangs fails the batch, which is
/// retried, instead of stalling the pipeline silently.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Retry delay of a failing second delete.
const SECOND_DELETE_RETRY: Duration = Duration::from_millis(200);
/// Keys per `SCAN` step of a truncate.
const SCAN_COUNT: usize = 1000;

/// Connects to Redis on demand and forgets a connection that failed.
#[derive(Clone)]
pub(crate) struct Connector {
    pub(crate) client: redis::Client,
    pub(crate) conn: Option<MultiplexedConnection>,
}

impl Connector {
    /// The current connection, or a new one.
    pub(crate) async fn get(&mut self) -> Result<MultiplexedConnection, RedisError> {
        if let Some(conn) = &self.conn {
            return Ok(conn.clone());
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        self.conn = Some(conn.clone());
        Ok(conn)
    }

    /// Runs `pipe`; a failure drops the connection so the next attempt reconnects.
    pub(crate) async fn run(&mut self, pipe: &redis::Pipeline) -> Result<(), RedisError> {
        let mut conn = self.get().await?;
        let result = pipe.query_async::<()>(&mut conn).await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }
}

/// Deletes every key matching `pattern`, `SCAN` step by step.
pub(super) async fn truncate(
    connector: &mut Connector,
    pattern: &str,
    delete: &'static str,
) -> Result<(), RedisError> {
    let mut conn = connector.get().await?;
    let mut cursor: u64 = 0;
    let result = async {
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                redis::cmd(delete)
                    .arg(&keys)
                    .query_async::<()>(&mut conn)
                    .await?;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }
    .await;
    if result.is_err() {
        connector.conn = None;
    }
    result
}

/// A Redis failure as a sink error: transient unless retrying cannot help (a bad command, wrong
/// credentials).
pub(crate) fn error(sink: &str, url: &str, what: &str, e: RedisError) -> SinkError {
    let message = format!("{what} ({}): {e}", mask_url(url));
    // A certificate the client refuses cannot be fixed by retrying. The connector reports it
    // as an IO error carrying only rustls' message, so the message is what there is to match.
    let refused_tls = e.is_io_error() && e.to_string().contains("invalid peer certificate");
    let permanent = matches!(e.retry_method(), RetryMethod::NoRetry)
        || e.kind() == ErrorKind::AuthenticationFailed
        || refused_tls;
    if permanent {
        SinkError::Permanent {
            sink: sink.to_owned(),
            message,
            source: Some(Box::new(e)),
        }
    } else {
        SinkError::Transient {
            sink: sink.to_owned(),
            message,
            source: Some(Box::new(e)),
        }
    }
}

/// Runs the second deletes as they fall due, retrying each until Redis takes it; stops when the
/// queue closes and is empty.
pub(super) async fn second_deletes(
    sink: String,
    command: &'static str,
    depth: usize,
    mut connector: Connector,
    mut queue: mpsc::Receiver<(Instant, Vec<String>)>,
    counter: metrics::Counter,
) {
    while let Some((due, keys)) = queue.recv().await {
        tokio::time::sleep_until(due).await;
        for chunk in keys.chunks(depth) {
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.cmd(command).arg(key).ignore();
            }
            let mut failures = 0u32;
            while let Err(e) = connector.run(&pipe).await {
                failures += 1;
                if failures == 1 || failures % 50 == 0 {
                    tracing::warn!(sink = %sink, error = %e, failures, "second delete failed, retrying");
                }
                tokio::time::sleep(SECOND_DELETE_RETRY).await;
            }
            counter.increment(chunk.len() as u64);
        }
    }
}
