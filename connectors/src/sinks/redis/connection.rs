//! The connection to Redis (one server, or a Redis Cluster): connected on demand, dropped when
//! it fails (so the next attempt reconnects), failures classified for the retry policy, and the
//! background tasks that use it (truncates, second deletes).
//!
//! On a cluster, a pipeline or a multi-key command must address one hash slot: callers group
//! their keys with [`by_slot`]; the cluster client routes each to the slot's master and follows
//! `MOVED`/`ASK` redirections.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt as _;
use futures::future::BoxFuture;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, RedisError, RetryMethod, Value};
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
/// Pipelines in flight at once on a cluster (each addresses one slot): enough to keep every
/// master busy, few enough that one batch does not flood the client's queues.
const CLUSTER_PIPELINES_IN_FLIGHT: usize = 64;

/// A client of one Redis server or of a Redis Cluster.
#[derive(Clone)]
pub(crate) enum Client {
    /// One server (or a proxy in front of several).
    Single(redis::Client),
    /// A Redis Cluster, known by one or more of its nodes.
    Cluster(redis::cluster::ClusterClient),
}

/// A live connection, multiplexed: clones share it.
#[derive(Clone)]
pub(crate) enum Conn {
    /// To one server.
    Single(MultiplexedConnection),
    /// To every master of a cluster, commands routed by slot.
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Connects to Redis on demand and forgets a connection that failed.
#[derive(Clone)]
pub(crate) struct Connector {
    pub(crate) client: Client,
    pub(crate) conn: Option<Conn>,
}

impl Connector {
    /// A connector to one server, not yet connected.
    pub(crate) fn single(client: redis::Client) -> Self {
        Self {
            client: Client::Single(client),
            conn: None,
        }
    }

    /// Whether the connector talks to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.client, Client::Cluster(_))
    }

    /// The current connection, or a new one.
    pub(crate) async fn get(&mut self) -> Result<Conn, RedisError> {
        if let Some(conn) = &self.conn {
            return Ok(conn.clone());
        }
        let conn = match &self.client {
            Client::Single(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(RESPONSE_TIMEOUT));
                Conn::Single(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                )
            }
            Client::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
        };
        self.conn = Some(conn.clone());
        Ok(conn)
    }

    /// Runs `pipe` (on a cluster, its commands must address one slot); a failure drops the
    /// connection so the next attempt reconnects.
    pub(crate) async fn run(&mut self, pipe: &redis::Pipeline) -> Result<(), RedisError> {
        let mut conn = self.get().await?;
        let result = pipe.query_async::<()>(&mut conn).await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    /// Runs `pipes`, each addressing one slot, several at a time; the first failure drops the
    /// connection and is returned once the pipelines in flight have ended.
    pub(crate) async fn run_all(&mut self, pipes: &[redis::Pipeline]) -> Result<(), RedisError> {
        let conn = self.get().await?;
        // Boxed with their type spelled out, so that the future stays `Send` for the sink.
        let sends: Vec<BoxFuture<'_, Result<(), RedisError>>> = pipes
            .iter()
            .map(|pipe| {
                let mut conn = conn.clone();
                Box::pin(async move { pipe.query_async::<()>(&mut conn).await })
                    as BoxFuture<'_, Result<(), RedisError>>
            })
            .collect();
        let results: Vec<Result<(), RedisError>> = futures::stream::iter(sends)
            .buffer_unordered(CLUSTER_PIPELINES_IN_FLIGHT)
            .collect()
            .await;
        let result = results.into_iter().collect::<Result<(), RedisError>>();
        if result.is_err() {
            self.conn = None;
        }
        result
    }
}

/// A cluster client starting from the node `info` (its user, password and TLS apply to every
/// node), with the same timeouts as a single connection.
pub(crate) fn cluster_client(
    info: redis::ConnectionInfo,
    certificates: Option<redis::TlsCertificates>,
) -> Result<Client, RedisError> {
    let mut builder = redis::cluster::ClusterClientBuilder::new(vec![info])
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(RESPONSE_TIMEOUT);
    if let Some(certificates) = certificates {
        builder = builder.certs(certificates);
    }
    Ok(Client::Cluster(builder.build()?))
}

/// `items` grouped by the hash slot of their key (hash tags `{…}` as Redis Cluster reads
/// them), the order of the items kept within each group, groups in order of first appearance.
pub(crate) fn by_slot<T>(items: Vec<T>, key: impl Fn(&T) -> &str) -> Vec<Vec<T>> {
    let mut index: HashMap<Slot, usize> = HashMap::new();
    let mut groups: Vec<Vec<T>> = Vec::new();
    for item in items {
        let slot = Slot::for_key(key(&item));
        let i = *index.entry(slot).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[i].push(item);
    }
    groups
}

/// Deletes every key matching `pattern`, `SCAN` step by step (on a cluster, on every master).
pub(super) async fn truncate(
    connector: &mut Connector,
    pattern: &str,
    delete: &'static str,
) -> Result<(), RedisError> {
    let mut conn = connector.get().await?;
    let result = async {
        let nodes = match &mut conn {
            Conn::Single(_) => vec![None],
            Conn::Cluster(c) => masters(c).await?.into_iter().map(Some).collect(),
        };
        for node in nodes {
            scan_delete(&mut conn, node, pattern, delete).await?;
        }
        Ok(())
    }
    .await;
    if result.is_err() {
        connector.conn = None;
    }
    result
}

/// `SCAN`s one node (`None`: the single server) for `pattern`, deleting what it finds slot by
/// slot.
async fn scan_delete(
    conn: &mut Conn,
    node: Option<(String, u16)>,
    pattern: &str,
    delete: &'static str,
) -> Result<(), RedisError> {
    let mut cursor: u64 = 0;
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let reply = match (&mut *conn, &node) {
            (Conn::Cluster(c), Some((host, port))) => {
                let node = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                c.route_command(cmd, RoutingInfo::SingleNode(node)).await?
            }
            (conn, _) => cmd.query_async(conn).await?,
        };
        let (next, keys): (u64, Vec<String>) = redis::from_redis_value(reply)?;
        for group in by_slot(keys, |k| k.as_str()) {
            redis::cmd(delete)
                .arg(&group)
                .query_async::<()>(&mut *conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The `(host, port)` of every master of the cluster that serves slots, from `CLUSTER NODES`.
async fn masters(conn: &mut ClusterConnection) -> Result<Vec<(String, u16)>, RedisError> {
    let text: String = redis::from_redis_value(
        conn.route_command(
            redis::cmd("CLUSTER").arg("NODES").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
        )
        .await?,
    )?;
    Ok(parse_masters(&text))
}

/// The masters serving slots in `CLUSTER NODES` output: `id host:port@cport[,name] flags
/// master-id ping pong epoch link slot…`.
pub(crate) fn parse_masters(text: &str) -> Vec<(String, u16)> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            let serving = flags.split(',').any(|f| f == "master")
                && !flags.split(',').any(|f| f == "fail" || f == "noaddr")
                && fields.len() > 8;
            if !serving {
                return None;
            }
            let address = fields[1].split(['@', ',']).next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect()
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
        let groups = if connector.is_cluster() {
            by_slot(keys, |k| k.as_str())
        } else {
            vec![keys]
        };
        for chunk in groups.iter().flat_map(|g| g.chunks(depth)) {
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
