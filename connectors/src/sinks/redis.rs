//! `kind = "redis"`: applies cache invalidations (and documents) to Redis.
//!
//! Each batch holds only committed source transactions (sources emit nothing of a transaction
//! before its commit, and nothing of a rolled-back one), so every command here runs strictly
//! after the commit it stems from. Per batch, the last operation per key wins; the commands go
//! out pipelined, `pipeline_depth` at a time, on one connection. A failure drops the connection
//! and returns a transient error: the runtime retries the whole batch with backoff and jitter
//! (each retry connects afresh, so a Redis back from an outage or a failover is used at the next
//! attempt) while the checkpoint (and the replication slot) stays before it, so no delete is
//! ever skipped; deletes are idempotent, so a retried batch is safe.
//!
//! - an invalidation: `UNLINK key…` (or `DEL`; consecutive deletes share a command,
//!   `keys_per_command` keys each), or with `command = "tombstone"` a Lua
//!   script that sets `refract-tombstone:{version}` with a TTL unless a newer tombstone is there.
//!   With `second_delete_ms`, every invalidated key is deleted again after that delay (after the
//!   first delete is durable), against a reader that writes back a value it read before the
//!   change. The second delete is best effort across a crash (the checkpoint does not wait for
//!   it; a crash replays only what was not checkpointed).
//! - a document upsert / delete: `SET {collection}:{key} <json>` / delete it.
//! - a document truncate: `SCAN MATCH {collection}:*` and delete what it finds.
//!
//! `cluster = true`: the URL is one node of a Redis Cluster. The client discovers the others and
//! follows `MOVED`/`ASK`; each batch's commands are grouped by the hash slot of their key (a
//! pipeline, and a multi-key delete, per slot; the slots' pipelines run concurrently), since
//! Redis refuses a command or a pipeline whose keys span slots (`CROSSSLOT`). Keys of different
//! slots have no order between them within a batch, which the delivery contract allows (order
//! is per key); a truncate `SCAN`s every master.
//!
//! `fallback_file` (demos): when Redis does not answer at start, the commands are written to that
//! file instead, one `redis-cli` line each, and the run's summary says so.

mod command;
pub(crate) mod connection;

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write as _;
use std::time::Duration;

use async_trait::async_trait;
use redis::{IntoConnectionInfo, RedisError};
use refract_schemas::Checkpoint;
use refract_schemas::config::{RedisDeleteCommand, RedisSinkConfig};
use refract_schemas::write::{DocumentOp, Invalidation, OpFamily};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::intake::CacheOp;
use crate::{Intake, Sink, SinkBatch, SinkError, WriteReport};
use command::{Command, Step, glob_escape, quote, redis_key};
use connection::{Connector, by_slot, cluster_client, error, second_deletes, truncate};

/// Batches of second deletes waiting for their delay; a full queue slows the first deletes down.
const SECOND_DELETE_QUEUE: usize = 1024;
/// How long shutdown waits past `second_delete_ms` for the last second deletes.
const SECOND_DELETE_GRACE: Duration = Duration::from_secs(5);

/// Prefix of a tombstone value; the application's versioned SET recognizes it (see `docs/sinks/redis.md`, "Stale sets").
pub const TOMBSTONE_PREFIX: &str = "refract-tombstone:";

/// Sets a tombstone `refract-tombstone:{ARGV[1]}` with a TTL of `ARGV[2]` milliseconds, unless
/// the key holds a newer tombstone.
const TOMBSTONE_SCRIPT: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then
  local v = string.match(cur, '^refract%-tombstone:(%-?%d+)$')
  if v and tonumber(v) > tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], 'refract-tombstone:' .. ARGV[1], 'PX', ARGV[2])
return 1
";

/// What the Redis sink accepts: documents and cache invalidations.
type Accepted<'a> = CacheOp<'a>;

/// The Redis sink.
pub struct RedisSink {
    name: String,
    config: RedisSinkConfig,
    target: Option<Target>,
    second: Option<SecondDeletes>,
    metrics: RedisSinkMetrics,
}

/// Every metric the Redis sink emits, made once per sink.
struct RedisSinkMetrics {
    /// `refract_redis_keys_invalidated_total{sink}`: keys deleted (or tombstoned) for cache
    /// invalidations, counted once per operation (second deletes are not counted again).
    keys_invalidated: metrics::Counter,
    /// `refract_redis_second_deletes_total{sink}`: keys deleted again `second_delete_ms` after
    /// their first delete.
    second_deletes: metrics::Counter,
}

impl RedisSinkMetrics {
    fn new(sink: &str) -> Self {
        Self {
            keys_invalidated: metrics::counter!(
                "refract_redis_keys_invalidated_total",
                "sink" => sink.to_owned()
            ),
            second_deletes: metrics::counter!(
                "refract_redis_second_deletes_total",
                "sink" => sink.to_owned()
            ),
        }
    }
}

/// Where commands go.
enum Target {
    /// The server, and the connection to it while it works.
    Redis(Connector),
    /// Redis did not answer at start and `fallback_file` is set.
    File {
        path: String,
        file: std::io::BufWriter<std::fs::File>,
        commands: u64,
    },
}

/// The delayed second deletes: a queue of (due time, keys) and the task that runs them.
struct SecondDeletes {
    queue: mpsc::Sender<(Instant, Vec<String>)>,
    task: JoinHandle<()>,
}

impl RedisSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A Redis sink named `name` (not yet connected).
    pub fn new(name: &str, config: RedisSinkConfig) -> Self {
        Self {
            name: name.to_owned(),
            config,
            target: None,
            second: None,
            metrics: RedisSinkMetrics::new(name),
        }
    }

    fn error(&self, what: &str, e: RedisError) -> SinkError {
        error(&self.name, self.config.url.expose(), what, e)
    }

    async fn connect(&self) -> Result<Connector, SinkError> {
        // rustls needs one process-wide crypto provider, and the dependency graph enables two
        // (ring and aws-lc-rs), so it cannot pick one by itself: take ring. A provider another
        // component installed first is kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config_error = |e: RedisError| SinkError::Permanent {
            sink: self.name.clone(),
            message: format!("invalid Redis URL {}: {e}", self.config.url.masked()),
            source: Some(Box::new(e)),
        };
        let info = self
            .config
            .url
            .expose()
            .into_connection_info()
            .map_err(config_error)?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &self.config.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &self.config.password {
            settings = settings.set_password(password.expose());
        }
        let info = info.set_redis_settings(settings);
        let certificates = match &self.config.tls_ca_file {
            None => None,
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| SinkError::Permanent {
                    sink: self.name.clone(),
                    message: format!("cannot read tls_ca_file {path}: {e}"),
                    source: Some(Box::new(e)),
                })?;
                Some(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                })
            }
        };
        let client = match (self.config.cluster, certificates) {
            (true, certificates) => cluster_client(info, certificates).map_err(config_error)?,
            (false, None) => {
                connection::Client::Single(redis::Client::open(info).map_err(config_error)?)
            }
            (false, Some(certificates)) => connection::Client::Single(
                redis::Client::build_with_tls(info, certificates).map_err(config_error)?,
            ),
        };
        let mut connector = Connector { client, conn: None };
        connector.get().await.map_err(|e| self.connect_error(e))?;
        Ok(connector)
    }

    /// A failed connection; a server TLS refused is named with the cause (permanent).
    fn connect_error(&self, e: RedisError) -> SinkError {
        let Some(refusal) = crate::tls_refusal::find(&e) else {
            return self.error("cannot connect to Redis", e);
        };
        let trusted = match &self.config.tls_ca_file {
            Some(path) => format!("the CA in tls_ca_file={path}"),
            None => "any of the well-known roots (no tls_ca_file)".to_owned(),
        };
        let cause = crate::tls_refusal::describe(refusal, &trusted);
        SinkError::Permanent {
            sink: self.name.clone(),
            message: format!(
                "cannot connect to Redis ({}): TLS: {cause}",
                self.config.url.masked()
            ),
            source: Some(Box::new(e)),
        }
    }

    /// The command that removes an invalidated key.
    fn delete_command(&self) -> &'static str {
        match self.config.command {
            RedisDeleteCommand::Del => "DEL",
            RedisDeleteCommand::Unlink | RedisDeleteCommand::Tombstone => "UNLINK",
        }
    }

    /// What `ops` come to in Redis: the last operation per key wins.
    fn steps<'a>(&self, ops: &[CacheOp<'a>], report: &mut WriteReport) -> Vec<Step<'a>> {
        let keys: Vec<Option<Cow<'a, str>>> = ops.iter().map(redis_key).collect();
        let mut last: HashMap<&str, usize> = HashMap::with_capacity(ops.len());
        for (i, key) in keys.iter().enumerate() {
            if let Some(key) = key {
                last.insert(key, i);
            }
        }
        let mut out = Vec::with_capacity(last.len());
        for (i, (op, key)) in ops.iter().zip(&keys).enumerate() {
            let Some(key) = key else {
                if let CacheOp::Document(DocumentOp::Truncate { collection, .. }) = op {
                    report.deleted += 1;
                    out.push(Step::Truncate(glob_escape(collection) + ":*"));
                }
                continue;
            };
            if last.get(&**key) != Some(&i) {
                report.coalesced += 1;
                continue;
            }
            let command = match *op {
                CacheOp::Document(DocumentOp::Upsert { doc, .. }) => {
                    report.upserted += 1;
                    let json = serde_json::to_string(&**doc).expect("a JSON map serializes");
                    Command::Set(key.clone(), json)
                }
                CacheOp::Invalidate(Invalidation {
                    version: Some(version),
                    ..
                }) if self.config.command == RedisDeleteCommand::Tombstone => {
                    report.deleted += 1;
                    Command::Tombstone(key.clone(), *version)
                }
                CacheOp::Invalidate(_) | CacheOp::Document(_) => {
                    report.deleted += 1;
                    Command::Delete(key.clone())
                }
            };
            out.push(Step::Run(command));
        }
        out
    }

    /// The Redis command of `c`.
    fn redis_command(&self, c: &Command<'_>) -> redis::Cmd {
        match c {
            Command::Delete(key) => {
                let mut cmd = redis::cmd(self.delete_command());
                cmd.arg(&**key);
                cmd
            }
            Command::Set(key, json) => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&**key).arg(json);
                cmd
            }
            Command::Tombstone(key, version) => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(TOMBSTONE_SCRIPT)
                    .arg(1)
                    .arg(&**key)
                    .arg(*version)
                    .arg(self.config.tombstone_ttl_ms);
                cmd
            }
        }
    }

    /// The `redis-cli` line of `step`, for the fallback file.
    fn cli_line(&self, step: &Step<'_>) -> String {
        match step {
            Step::Run(Command::Delete(key)) => {
                format!("{} {}", quote(self.delete_command()), quote(key))
            }
            Step::Run(Command::Set(key, json)) => {
                format!("\"SET\" {} {}", quote(key), quote(json))
            }
            Step::Run(Command::Tombstone(key, version)) => format!(
                "\"SET\" {} {} \"PX\" \"{}\"",
                quote(key),
                quote(&format!("{TOMBSTONE_PREFIX}{version}")),
                self.config.tombstone_ttl_ms
            ),
            Step::Truncate(pattern) => format!("# delete every key matching {}", quote(pattern)),
        }
    }

    /// Sends `steps` where the sink writes: Redis, or the fallback file. The target is taken
    /// out while it is used and put back after; the runtime awaits every write to its end, and
    /// were one dropped halfway, the next write would fail loudly (not opened), never send
    /// elsewhere.
    async fn send(&mut self, steps: &[Step<'_>]) -> Result<(), SinkError> {
        match self.target.take() {
            Some(Target::File {
                path,
                mut file,
                mut commands,
            }) => {
                let result = self.write_file(&mut file, &mut commands, steps);
                self.target = Some(Target::File {
                    path,
                    file,
                    commands,
                });
                result
            }
            Some(Target::Redis(mut connector)) => {
                let result = self.send_redis(&mut connector, steps).await;
                self.target = Some(Target::Redis(connector));
                result
            }
            None => Err(SinkError::not_open(&self.name)),
        }
    }

    /// Appends the `redis-cli` lines of `steps` to the fallback file.
    fn write_file(
        &self,
        file: &mut std::io::BufWriter<std::fs::File>,
        commands: &mut u64,
        steps: &[Step<'_>],
    ) -> Result<(), SinkError> {
        let fail = |e: std::io::Error| SinkError::Permanent {
            sink: self.name.clone(),
            message: format!("cannot write the fallback file: {e}"),
            source: Some(Box::new(e)),
        };
        for step in steps {
            writeln!(file, "{}", self.cli_line(step)).map_err(fail)?;
            *commands += 1;
        }
        file.flush().map_err(fail)
    }

    /// Runs `steps` on Redis: truncates alone, everything else pipelined `pipeline_depth`
    /// commands at a time, consecutive deletes sharing one command.
    async fn send_redis(
        &self,
        connector: &mut Connector,
        steps: &[Step<'_>],
    ) -> Result<(), SinkError> {
        let delete = self.delete_command();
        let mut rest = steps;
        while let Some(first) = rest.first() {
            if let Step::Truncate(pattern) = first {
                let result = truncate(connector, pattern, delete).await;
                result.map_err(|e| self.error("truncate failed", e))?;
                rest = &rest[1..];
                continue;
            }
            if connector.is_cluster() {
                let n = rest
                    .iter()
                    .position(|s| matches!(s, Step::Truncate(_)))
                    .unwrap_or(rest.len());
                let pipes = self.slot_pipelines(&rest[..n]);
                let result = connector.run_all(&pipes).await;
                result.map_err(|e| self.error("pipelines failed", e))?;
                rest = &rest[n..];
                continue;
            }
            let refs: Vec<&Step<'_>> = rest.iter().collect();
            let (pipe, n) = self.pipeline(&refs);
            connector
                .run(&pipe)
                .await
                .map_err(|e| self.error("pipeline failed", e))?;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// The pipelines of `steps` (no truncate among them) on a cluster: the steps grouped by the
    /// hash slot of their key, each group in pipelines of its own.
    fn slot_pipelines(&self, steps: &[Step<'_>]) -> Vec<redis::Pipeline> {
        let refs: Vec<&Step<'_>> = steps.iter().collect();
        let mut pipes = Vec::new();
        for group in by_slot(refs, |s| s.key()) {
            let mut rest = &group[..];
            while !rest.is_empty() {
                let (pipe, n) = self.pipeline(rest);
                pipes.push(pipe);
                rest = &rest[n..];
            }
        }
        pipes
    }

    /// The pipeline of the commands that open `steps`: up to `pipeline_depth` commands, up to
    /// the next truncate, consecutive deletes sharing one command (`keys_per_command` keys
    /// each); with the number of steps it holds.
    fn pipeline(&self, steps: &[&Step<'_>]) -> (redis::Pipeline, usize) {
        let depth = self.config.pipeline_depth;
        let mut pipe = redis::Pipeline::with_capacity(depth.min(steps.len()));
        let (mut n, mut commands) = (0, 0);
        while let (Some(Step::Run(command)), true) = (steps.get(n).copied(), commands < depth) {
            if let Command::Delete(_) = command {
                let mut cmd = redis::cmd(self.delete_command());
                let mut keys = 0;
                while let Some(Step::Run(Command::Delete(key))) = steps.get(n).copied() {
                    if keys == self.config.keys_per_command {
                        break;
                    }
                    cmd.arg(&**key);
                    keys += 1;
                    n += 1;
                }
                pipe.add_command(cmd).ignore();
            } else {
                pipe.add_command(self.redis_command(command)).ignore();
                n += 1;
            }
            commands += 1;
        }
        (pipe, n)
    }
}

#[async_trait]
impl Sink for RedisSink {
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        let connector = match self.connect().await {
            Ok(connector) => connector,
            Err(e) => {
                let Some(path) = self.config.fallback_file.clone() else {
                    return Err(e);
                };
                tracing::warn!(sink = %self.name, error = %e, file = %path, "Redis does not answer: writing the commands to the fallback file instead (nothing is deleted)");
                let parent = std::path::Path::new(&path).parent();
                let file = parent
                    .map_or(Ok(()), std::fs::create_dir_all)
                    .and_then(|()| std::fs::File::create(&path))
                    .map_err(|io| SinkError::Permanent {
                    sink: self.name.clone(),
                    message: format!("Redis does not answer ({e}) and the fallback file {path} cannot be created: {io}"),
                    source: Some(Box::new(io)),
                })?;
                self.target = Some(Target::File {
                    path,
                    file: std::io::BufWriter::new(file),
                    commands: 0,
                });
                return Ok(());
            }
        };
        if self.config.second_delete_ms > 0 {
            let (queue, rx) = mpsc::channel(SECOND_DELETE_QUEUE);
            let task = tokio::spawn(second_deletes(
                self.name.clone(),
                self.delete_command(),
                self.config.pipeline_depth,
                connector.clone(),
                rx,
                self.metrics.second_deletes.clone(),
            ));
            self.second = Some(SecondDeletes { queue, task });
        }
        tracing::info!(sink = %self.name, url = %self.config.url.masked(), command = ?self.config.command, "connected to Redis");
        self.target = Some(Target::Redis(connector));
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let ops = batch.intake::<Accepted>(&self.name)?;
        let mut report = WriteReport::default();
        let steps = self.steps(&ops, &mut report);
        self.send(&steps).await?;
        let invalidated: Vec<&str> = ops
            .iter()
            .filter_map(|op| match op {
                CacheOp::Invalidate(i) => Some(i.key.as_str()),
                CacheOp::Document(_) => None,
            })
            .collect();
        self.metrics
            .keys_invalidated
            .increment(invalidated.len() as u64);
        if let (Some(second), false) = (&self.second, invalidated.is_empty()) {
            let due = Instant::now() + Duration::from_millis(self.config.second_delete_ms);
            let mut keys: Vec<String> = invalidated.into_iter().map(str::to_owned).collect();
            keys.sort_unstable();
            keys.dedup();
            // The task only ends when the queue closes, which happens in `close`.
            let _ = second.queue.send((due, keys)).await;
        }
        Ok(report)
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        if let Some(SecondDeletes { queue, mut task }) = self.second.take() {
            drop(queue);
            // Pending second deletes are due within `second_delete_ms`: wait for them, but not
            // forever when Redis stopped answering (shutdown must not hang on a best effort).
            let wait = Duration::from_millis(self.config.second_delete_ms) + SECOND_DELETE_GRACE;
            if tokio::time::timeout(wait, &mut task).await.is_err() {
                task.abort();
                tracing::warn!(sink = %self.name, "Redis does not answer: second deletes still pending at shutdown were dropped");
            }
        }
        match &mut self.target {
            Some(Target::File {
                path,
                file,
                commands,
            }) => {
                let _ = file.flush();
                Ok(Some(format!(
                    "Redis at {} did not answer: {commands} commands were written to {path} \
                     instead, and no key was deleted",
                    self.config.url.masked()
                )))
            }
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests;
