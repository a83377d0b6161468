//! Helpers of the cache-invalidation tests: a Redis server or a three-master Redis Cluster each
//! test owns (so it can be stopped and MONITORed without meeting other tests), a MONITOR
//! recorder, a products table and its pipeline file.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::pg;

/// A `redis-server` this test started on a free port; killed when dropped.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    persistent: bool,
    /// A node of a Redis Cluster (`cluster-enabled yes`, its state in `nodes.conf` of `dir`).
    cluster: bool,
}

impl RedisServer {
    /// Starts a server. `persistent` keeps every write in an append-only file synced on each
    /// write, so keys survive a kill and restart (the "Redis down" test needs the keys that
    /// were due for deletion still there when it comes back).
    pub fn start(persistent: bool) -> Self {
        Self::start_node(persistent, false)
    }

    /// Starts a server, a cluster node when `cluster` (not in a cluster yet: see
    /// [`RedisCluster`]).
    fn start_node(persistent: bool, cluster: bool) -> Self {
        let port = free_port();
        let mut server = RedisServer {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
            persistent,
            cluster,
        };
        server.start_again();
        server
    }

    /// (Re)starts the server process on the same port and directory.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let aof = if self.persistent { "yes" } else { "no" };
        let cluster: &[&str] = if self.cluster {
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
            ]
        } else {
            &[]
        };
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", aof, "--appendfsync", "always"])
            .args(cluster)
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts (is Redis installed?)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = self.client().get_connection() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the server (SIGKILL: clients see their connections drop, nothing is answered).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    pub fn connection(&self) -> redis::Connection {
        self.client().get_connection().unwrap()
    }

    /// Sets `key` to `"cached"` for every key, as a reader filling the cache would.
    pub fn fill(&self, keys: impl IntoIterator<Item = String>) {
        let mut conn = self.connection();
        for key in keys {
            redis::cmd("SET")
                .arg(key)
                .arg("cached")
                .exec(&mut conn)
                .unwrap();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of three masters (no replicas) this test started on free loopback ports;
/// killed when dropped.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes, joins them with `redis-cli --cluster create` and waits until every
    /// node says `cluster_state:ok`. `persistent` as for [`RedisServer::start`].
    pub fn start(persistent: bool) -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_node(persistent, true))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(out.status.success(), "redis-cli --cluster create: {out:?}");
        let cluster = RedisCluster { nodes };
        cluster.wait_ok();
        cluster
    }

    /// Waits until every node reports `cluster_state:ok` and knows all three.
    fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let ok = |n: &RedisServer| {
            let Ok(mut c) = n.client().get_connection() else {
                return false;
            };
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut c)
                .unwrap_or_default();
            info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
        };
        while !self.nodes.iter().all(ok) {
            assert!(Instant::now() < deadline, "the Redis Cluster did not form");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills every node (SIGKILL).
    pub fn kill(&mut self) {
        self.nodes.iter_mut().for_each(RedisServer::kill);
    }

    /// Restarts every node on its port and directory (its `nodes.conf` rejoins it to the
    /// others) and waits until the cluster is ok again.
    pub fn start_again(&mut self) {
        self.nodes.iter_mut().for_each(RedisServer::start_again);
        self.wait_ok();
    }
}

/// What the cache tests run against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Flavor {
    /// One `redis-server`.
    Single,
    /// A three-master Redis Cluster, the sink with `cluster = true`.
    Cluster,
}

impl Flavor {
    /// `name` made unique to the flavor: table and slot names of tests that run in parallel.
    pub fn name(self, name: &str) -> String {
        match self {
            Flavor::Single => name.to_owned(),
            Flavor::Cluster => format!("{name}_cl"),
        }
    }
}

/// A Redis a test owns: one server, or a cluster.
pub enum TestRedis {
    Single(RedisServer),
    Cluster(RedisCluster),
}

impl TestRedis {
    pub fn start(flavor: Flavor, persistent: bool) -> Self {
        match flavor {
            Flavor::Single => TestRedis::Single(RedisServer::start(persistent)),
            Flavor::Cluster => TestRedis::Cluster(RedisCluster::start(persistent)),
        }
    }

    /// The servers: the one, or every node.
    fn servers(&self) -> &[RedisServer] {
        match self {
            TestRedis::Single(s) => std::slice::from_ref(s),
            TestRedis::Cluster(c) => &c.nodes,
        }
    }

    /// The sink's URL: the server's, or one node's.
    pub fn url(&self) -> String {
        self.servers()[0].url()
    }

    /// The sink's settings for this Redis, followed by `extra`.
    pub fn sink_extra(&self, extra: &str) -> String {
        match self {
            TestRedis::Single(_) => extra.to_owned(),
            TestRedis::Cluster(_) => format!("cluster = true\n{extra}"),
        }
    }

    /// A synchronous connection (on a cluster, routing each command by its key).
    pub fn connection(&self) -> Box<dyn redis::ConnectionLike + Send> {
        match self {
            TestRedis::Single(s) => Box::new(s.connection()),
            TestRedis::Cluster(c) => {
                let urls: Vec<String> = c.nodes.iter().map(RedisServer::url).collect();
                let client = redis::cluster::ClusterClient::new(urls).unwrap();
                Box::new(client.get_connection().unwrap())
            }
        }
    }

    /// A way to make more connections from another thread.
    pub fn connector(&self) -> impl Fn() -> Box<dyn redis::ConnectionLike + Send> + Send + 'static {
        let urls: Vec<String> = self.servers().iter().map(RedisServer::url).collect();
        let cluster = matches!(self, TestRedis::Cluster(_));
        move || -> Box<dyn redis::ConnectionLike + Send> {
            if cluster {
                let client = redis::cluster::ClusterClient::new(urls.clone()).unwrap();
                Box::new(client.get_connection().unwrap())
            } else {
                Box::new(
                    redis::Client::open(urls[0].as_str())
                        .unwrap()
                        .get_connection()
                        .unwrap(),
                )
            }
        }
    }

    /// Sets `key` to `"cached"` for every key, as a reader filling the cache would.
    pub fn fill(&self, keys: impl IntoIterator<Item = String>) {
        let mut conn = self.connection();
        for key in keys {
            redis::cmd("SET")
                .arg(key)
                .arg("cached")
                .exec(&mut *conn)
                .unwrap();
        }
    }

    /// Kills the server or every node.
    pub fn kill(&mut self) {
        match self {
            TestRedis::Single(s) => s.kill(),
            TestRedis::Cluster(c) => c.kill(),
        }
    }

    /// Restarts what [`TestRedis::kill`] killed, waiting until it serves.
    pub fn start_again(&mut self) {
        match self {
            TestRedis::Single(s) => s.start_again(),
            TestRedis::Cluster(c) => c.start_again(),
        }
    }
}

/// One command Redis executed, as MONITOR reports it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Server time, seconds since the epoch.
    pub at: f64,
    /// The command and its arguments.
    pub args: Vec<String>,
}

/// Records every command a server executes (MONITOR) from a background thread, until the
/// server goes away.
pub struct Monitor {
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Monitor {
    /// Records what `redis` executes: the server, or every node of the cluster.
    pub fn start(redis: &TestRedis) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        for server in redis.servers() {
            Self::record(server, seen.clone());
        }
        Monitor { seen }
    }

    /// MONITORs `server` into `seen`, in order of execution.
    fn record(server: &RedisServer, seen: Arc<Mutex<Vec<Seen>>>) {
        let mut conn = server.connection();
        redis::cmd("MONITOR").exec(&mut conn).unwrap();
        std::thread::spawn(move || {
            while let Ok(value) = conn.recv_response() {
                let line: String = match redis::from_redis_value(value) {
                    Ok(l) => l,
                    Err(_) => continue,
                };
                if let Some(s) = parse_monitor_line(&line) {
                    seen.lock().unwrap().push(s);
                }
            }
        });
    }

    /// The commands named `name` (upper case) seen so far, with their keys.
    pub fn commands(&self, name: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.args.first().is_some_and(|c| c.eq_ignore_ascii_case(name)))
            .cloned()
            .collect()
    }

    /// Waits until a `name` command on `key` has been seen; returns when it was executed.
    pub fn wait_for(&self, name: &str, key: &str, timeout: Duration) -> f64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self
                .commands(name)
                .into_iter()
                .find(|s| s.args.iter().skip(1).any(|k| k == key))
            {
                return s.at;
            }
            assert!(
                Instant::now() < deadline,
                "no {name} {key} within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Parses `1733150000.123456 [0 127.0.0.1:5555] "UNLINK" "key"`.
fn parse_monitor_line(line: &str) -> Option<Seen> {
    let (at, rest) = line.split_once(' ')?;
    let at: f64 = at.parse().ok()?;
    let rest = &rest[rest.find(']')? + 1..];
    let mut args = Vec::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut arg = String::new();
        while let Some(c) = chars.next() {
            match c {
                '"' => break,
                '\\' => {
                    if let Some(n) = chars.next() {
                        arg.push(n);
                    }
                }
                c => arg.push(c),
            }
        }
        args.push(arg);
    }
    Some(Seen { at, args })
}

/// The wall clock in seconds since the epoch (the same clock Redis stamps MONITOR lines with).
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A fresh products table shaped like the showcase's (`../shared/showcase/products.sql`) with
/// `rows` products `p{id}` (sku `sku-{id}`), REPLICA IDENTITY FULL.
pub fn fresh_products(table: &str, rows: u32) {
    pg::drop_slot(table);
    pg::psql(&format!(
        "DROP TABLE IF EXISTS public.{table};
         CREATE TABLE public.{table} (
             id bigint PRIMARY KEY, tenant_id text NOT NULL, sku text NOT NULL UNIQUE,
             name text NOT NULL, price_cents bigint NOT NULL,
             updated_at timestamptz NOT NULL DEFAULT clock_timestamp());
         ALTER TABLE public.{table} REPLICA IDENTITY FULL;
         INSERT INTO public.{table} (id, tenant_id, sku, name, price_cents)
           SELECT g, 't' || (g % 3), 'sku-' || g, 'product ' || g, 100 + g FROM generate_series(1, {rows}) g;"
    ));
}

/// A pipeline file `{dir}/cache.toml` streaming `table` into the cache at `redis_url`, keys
/// `{table}:{id}` and `{table}:sku:{sku}`; `sink_extra` and `table_extra` are added to the
/// sink's and the table's sections.
pub fn cache_pipeline(
    dir: &Path,
    table: &str,
    redis_url: &str,
    sink_extra: &str,
    table_extra: &str,
) -> PathBuf {
    let text = format!(
        r#"[pipeline]
name = "{table}"
state_dir = "{state}"

[pipeline.batch]
max_events = 500
max_delay_ms = 20

[source]
kind = "postgres"
url = "{url}"
tables = ["public.{table}"]
snapshot = "never"

[projections.cache]
kind = "cache_invalidation"
sinks = ["redis"]

[projections.cache.tables."public.{table}"]
keys = ["{table}:{{id}}", "{table}:sku:{{sku}}"]
{table_extra}

[sinks.redis]
kind = "redis"
url = "{redis_url}"
{sink_extra}
"#,
        state = dir.join("state").display(),
        url = pg::url(),
    );
    let path = dir.join("cache.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A synchronous PostgreSQL client on the test database.
pub fn pg_client() -> postgres::Client {
    postgres::Client::connect(&pg::url(), postgres::NoTls).expect("PostgreSQL answers")
}

/// The slot's `confirmed_flush_lsn` as a number.
pub fn confirmed_flush(pg: &mut postgres::Client, slot: &str) -> u64 {
    let row = pg
        .query_one(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .unwrap();
    row.get::<_, i64>(0) as u64
}

/// Formats an LSN like PostgreSQL (`16/B374D848`).
pub fn lsn(v: u64) -> String {
    format!("{:X}/{:X}", v >> 32, v & 0xFFFF_FFFF)
}

/// `GET path` from the HTTP server at `addr`: (status code, body); `None` while nothing
/// answers there.
pub fn try_http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    Some((status, body))
}

/// [`try_http_get`] from a server that must be answering.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    try_http_get(addr, path).unwrap_or_else(|| panic!("nothing answers at {addr}"))
}

/// A port nothing listens on (yet) on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free port on 127.0.0.1 as `127.0.0.1:PORT`.
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}
