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
//! - [`WriteOp::Invalidate`]: `UNLINK key…` (or `DEL`; consecutive deletes share a command,
//!   `keys_per_command` keys each), or with `command = "tombstone"` a Lua
//!   script that sets `refract-tombstone:{version}` with a TTL unless a newer tombstone is there.
//!   With `second_delete_ms`, every invalidated key is deleted again after that delay (after the
//!   first delete is durable), against a reader that writes back a value it read before the
//!   change. The second delete is best effort across a crash (the checkpoint does not wait for
//!   it; a crash replays only what was not checkpointed).
//! - [`WriteOp::Upsert`] / [`WriteOp::Delete`]: `SET {collection}:{key} <json>` / delete it.
//! - [`WriteOp::Truncate`]: `SCAN MATCH {collection}:*` and delete what it finds.
//!
//! `fallback_file` (demos): when Redis does not answer at start, the commands are written to that
//! file instead, one `redis-cli` line each, and the run's summary says so.

mod command;
mod connection;

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write as _;
use std::time::Duration;

use async_trait::async_trait;
use redis::{IntoConnectionInfo, RedisError};
use refract_projections::WriteOp;
use refract_schemas::config::{RedisDeleteCommand, RedisSinkConfig, mask_url};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{Sink, SinkBatch, SinkError, WriteReport};
use command::{Command, glob_escape, quote, redis_key};
use connection::{Connector, error, second_deletes, truncate};

/// Batches of second deletes waiting for their delay; a full queue slows the first deletes down.
const SECOND_DELETE_QUEUE: usize = 1024;
/// How long shutdown waits past `second_delete_ms` for the last second deletes.
const SECOND_DELETE_GRACE: Duration = Duration::from_secs(5);

/// Prefix of a tombstone value; the application's versioned SET recognizes it (see the README).
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

/// The Redis sink.
pub struct RedisSink {
    name: String,
    config: RedisSinkConfig,
    target: Option<Target>,
    second: Option<SecondDeletes>,
    keys_metric: metrics::Counter,
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
    /// A Redis sink named `name` (not yet connected).
    pub fn new(name: &str, config: RedisSinkConfig) -> Self {
        let keys_metric =
            metrics::counter!("refract_redis_keys_invalidated_total", "sink" => name.to_owned());
        Self {
            name: name.to_owned(),
            config,
            target: None,
            second: None,
            keys_metric,
        }
    }

    fn error(&self, what: &str, e: RedisError) -> SinkError {
        error(&self.name, &self.config.url, what, e)
    }

    async fn connect(&self) -> Result<Connector, SinkError> {
        // rustls needs one process-wide crypto provider, and the dependency graph enables two
        // (ring and aws-lc-rs), so it cannot pick one by itself: take ring. A provider another
        // component installed first is kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config_error = |e: RedisError| SinkError::Permanent {
            sink: self.name.clone(),
            message: format!("invalid Redis URL {}: {e}", mask_url(&self.config.url)),
            source: Some(Box::new(e)),
        };
        let info = self
            .config
            .url
            .as_str()
            .into_connection_info()
            .map_err(config_error)?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &self.config.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &self.config.password {
            settings = settings.set_password(password);
        }
        let info = info.set_redis_settings(settings);
        let client = match &self.config.tls_ca_file {
            None => redis::Client::open(info).map_err(config_error)?,
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| SinkError::Permanent {
                    sink: self.name.clone(),
                    message: format!("cannot read tls_ca_file {path}: {e}"),
                    source: Some(Box::new(e)),
                })?;
                let certificates = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                };
                redis::Client::build_with_tls(info, certificates).map_err(config_error)?
            }
        };
        let mut connector = Connector { client, conn: None };
        connector
            .get()
            .await
            .map_err(|e| self.error("cannot connect to Redis", e))?;
        Ok(connector)
    }

    /// The command that removes an invalidated key.
    fn delete_command(&self) -> &'static str {
        match self.config.command {
            RedisDeleteCommand::Del => "DEL",
            RedisDeleteCommand::Unlink | RedisDeleteCommand::Tombstone => "UNLINK",
        }
    }

    /// What `ops` come to in Redis: the last operation per key wins.
    fn commands<'a>(&self, ops: &'a [WriteOp], report: &mut WriteReport) -> Vec<Command<'a>> {
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
                if let WriteOp::Truncate { collection, .. } = op {
                    report.deleted += 1;
                    out.push(Command::Truncate(glob_escape(collection) + ":*"));
                }
                continue;
            };
            if last.get(&**key) != Some(&i) {
                report.coalesced += 1;
                continue;
            }
            out.push(match op {
                WriteOp::Upsert { doc, .. } => {
                    report.upserted += 1;
                    let json = serde_json::to_string(&**doc).expect("a JSON map serializes");
                    Command::Set(key.clone(), json)
                }
                WriteOp::Invalidate {
                    version: Some(version),
                    ..
                } if self.config.command == RedisDeleteCommand::Tombstone => {
                    report.deleted += 1;
                    Command::Tombstone(key.clone(), *version)
                }
                WriteOp::Invalidate { .. } | WriteOp::Delete { .. } => {
                    report.deleted += 1;
                    Command::Delete(key.clone())
                }
                WriteOp::Truncate { .. } | WriteOp::Flat { .. } => {
                    unreachable!("truncates have no key; flat rows are refused above")
                }
            });
        }
        out
    }

    /// The Redis command of `c` (not a truncate).
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
            Command::Truncate(_) => unreachable!("truncates run on their own"),
        }
    }

    /// The `redis-cli` line of `c`, for the fallback file.
    fn cli_line(&self, c: &Command<'_>) -> String {
        match c {
            Command::Delete(key) => format!("{} {}", quote(self.delete_command()), quote(key)),
            Command::Set(key, json) => format!("\"SET\" {} {}", quote(key), quote(json)),
            Command::Tombstone(key, version) => format!(
                "\"SET\" {} {} \"PX\" \"{}\"",
                quote(key),
                quote(&format!("{TOMBSTONE_PREFIX}{version}")),
                self.config.tombstone_ttl_ms
            ),
            Command::Truncate(pattern) => format!("# delete every key matching {}", quote(pattern)),
        }
    }

    async fn send(&mut self, commands: &[Command<'_>]) -> Result<(), SinkError> {
        let depth = self.config.pipeline_depth;
        let delete = self.delete_command();
        let fail = |e: std::io::Error| SinkError::Permanent {
            sink: self.name.clone(),
            message: format!("cannot write the fallback file: {e}"),
            source: Some(Box::new(e)),
        };
        if let Some(Target::File { .. }) = &self.target {
            let lines: Vec<String> = commands.iter().map(|c| self.cli_line(c)).collect();
            let Some(Target::File { file, commands, .. }) = &mut self.target else {
                unreachable!("checked above")
            };
            for line in lines {
                writeln!(file, "{line}").map_err(fail)?;
                *commands += 1;
            }
            return file.flush().map_err(fail);
        }
        let mut rest = commands;
        while !rest.is_empty() {
            let Some(Target::Redis(connector)) = &mut self.target else {
                unreachable!("write after open")
            };
            // A truncate runs alone, between the pipelines before and after it.
            if let Command::Truncate(pattern) = &rest[0] {
                let result = truncate(connector, pattern, delete).await;
                result.map_err(|e| error(&self.name, &self.config.url, "truncate failed", e))?;
                rest = &rest[1..];
                continue;
            }
            // Up to `depth` commands, consecutive deletes sharing one command.
            let mut pipe = redis::Pipeline::with_capacity(depth.min(rest.len()));
            let (mut n, mut commands) = (0, 0);
            while n < rest.len() && commands < depth {
                match &rest[n] {
                    Command::Truncate(_) => break,
                    Command::Delete(_) => {
                        let mut cmd = redis::cmd(delete);
                        let mut keys = 0;
                        while let Some(Command::Delete(key)) = rest.get(n) {
                            if keys == self.config.keys_per_command {
                                break;
                            }
                            cmd.arg(&**key);
                            keys += 1;
                            n += 1;
                        }
                        pipe.add_command(cmd).ignore();
                    }
                    c => {
                        pipe.add_command(self.redis_command(c)).ignore();
                        n += 1;
                    }
                }
                commands += 1;
            }
            let Some(Target::Redis(connector)) = &mut self.target else {
                unreachable!("write after open")
            };
            connector
                .run(&pipe)
                .await
                .map_err(|e| error(&self.name, &self.config.url, "pipeline failed", e))?;
            rest = &rest[n..];
        }
        Ok(())
    }
}

#[async_trait]
impl Sink for RedisSink {
    fn name(&self) -> &str {
        &self.name
    }

    async fn open(&mut self) -> Result<(), SinkError> {
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
            ));
            self.second = Some(SecondDeletes { queue, task });
        }
        tracing::info!(sink = %self.name, url = %mask_url(&self.config.url), command = ?self.config.command, "connected to Redis");
        self.target = Some(Target::Redis(connector));
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        if batch
            .ops
            .iter()
            .any(|op| matches!(op, WriteOp::Flat { .. }))
        {
            return Err(SinkError::Permanent {
                sink: self.name.clone(),
                message: "cannot hold flat rows: write them to a `parquet` sink".into(),
                source: None,
            });
        }
        let mut report = WriteReport::default();
        let commands = self.commands(&batch.ops, &mut report);
        self.send(&commands).await?;
        let invalidated = batch
            .ops
            .iter()
            .filter(|op| matches!(op, WriteOp::Invalidate { .. }))
            .count();
        self.keys_metric.increment(invalidated as u64);
        if let (Some(second), true) = (&self.second, invalidated > 0) {
            let due = Instant::now() + Duration::from_millis(self.config.second_delete_ms);
            let mut keys: Vec<String> = batch
                .ops
                .iter()
                .filter_map(|op| match op {
                    WriteOp::Invalidate { key, .. } => Some(key.clone()),
                    _ => None,
                })
                .collect();
            keys.sort_unstable();
            keys.dedup();
            // The task only ends when the queue closes, which happens in `close`.
            let _ = second.queue.send((due, keys)).await;
        }
        Ok(report)
    }

    async fn close(&mut self) -> Result<(), SinkError> {
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
        if let Some(Target::File { file, .. }) = &mut self.target {
            let _ = file.flush();
        }
        Ok(())
    }

    fn notice(&self) -> Option<String> {
        match &self.target {
            Some(Target::File { path, commands, .. }) => Some(format!(
                "Redis at {} did not answer: {commands} commands were written to {path} instead, \
                 and no key was deleted",
                mask_url(&self.config.url)
            )),
            _ => None,
        }
    }

    fn unhealthy_after(&self) -> Duration {
        Duration::from_millis(self.config.unhealthy_after_ms)
    }
}

#[cfg(test)]
mod tests;
