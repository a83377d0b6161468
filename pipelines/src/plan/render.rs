//! The text of `refract plan`, one section after another: the pipeline (state, error policy,
//! batches), the source (and, for PostgreSQL, what its database says and the last backfill), each
//! projection, each sink, the environment variables used, then the findings.

use std::fmt::Write as _;
use std::path::Path;

use refract_connectors::sources::postgres::{Inspection, ReplicaIdentity, snapshot};
use refract_schemas::config::{
    CacheInvalidationProjectionConfig, DocumentProjectionConfig, FileSourceConfig,
    FlattenProjectionConfig, LoadedPipeline, ObjectJsonSinkConfig, OnError, ParquetSinkConfig,
    PostgresSinkConfig, PostgresSourceConfig, ProjectionConfig, RedisDeleteCommand,
    RedisSinkConfig, ReplicaProjectionConfig, SinkConfig, SnapshotMode, SourceConfig, mask_url,
};

mod kafka;
mod tiers;

use super::{SourceCheck, findings, pretty_bytes};
use crate::checkpoint::{CheckpointError, CheckpointStore};
use crate::runtime::{default_dead_letter_path, state_path};

/// Renders the plan of a loaded pipeline, with what [`super::check_source`] found.
pub fn render(loaded: &LoadedPipeline, check: &SourceCheck) -> String {
    let c = &loaded.config;
    let mut out = String::new();
    let state = state_path(c);
    render_pipeline(&mut out, loaded, &state);
    render_source(&mut out, loaded, check, &state);
    for (name, p) in &c.projections {
        render_projection(&mut out, name, p);
    }
    for (name, s) in &c.sinks {
        render_sink(&mut out, loaded, name, s);
    }
    render_environment(&mut out, loaded);
    render_findings(&mut out, loaded, check);
    out
}

/// A configured value as the plan shows it: `*** (secret)` when it came from a secret-named
/// variable, otherwise with any password in it masked.
fn shown(loaded: &LoadedPipeline, path: &str, value: &str) -> String {
    if loaded.secret_paths.contains(path) {
        "*** (secret)".to_owned()
    } else {
        mask_url(value)
    }
}

/// The pipeline's name and file, its state and checkpoint, what bad input does, and batching.
fn render_pipeline(out: &mut String, loaded: &LoadedPipeline, state: &Path) {
    let c = &loaded.config;
    let _ = writeln!(
        out,
        "pipeline `{}` ({})",
        c.pipeline.name,
        loaded.file.display()
    );
    let _ = writeln!(
        out,
        "  state       {} (checkpoint: {})",
        state.display(),
        checkpoint_summary(state)
    );
    let policy = match c.pipeline.on_error {
        OnError::DeadLetter => format!("bad input goes to {}", dead_letters(loaded)),
        OnError::Stop => "bad input stops the pipeline".to_owned(),
    };
    let _ = writeln!(out, "  on_error    {policy}");
    let b = &c.pipeline.batch;
    let _ = writeln!(
        out,
        "  batches     up to {} events / {} KiB / {} ms; {} batches queued per sink",
        b.max_events,
        b.max_bytes / 1024,
        b.max_delay_ms,
        c.pipeline.queue_depth
    );
    if c.pipeline.clock.trim() != "wall" {
        let _ = writeln!(
            out,
            "  clock       {} (ages of time-based projections are measured on it, not the system clock)",
            c.pipeline.clock
        );
    }
}

/// The checkpoint stored under `state`: the position per partition, none yet, held by a running
/// process, or why it cannot be read.
fn checkpoint_summary(state: &Path) -> String {
    let stored =
        CheckpointStore::open_existing(state).and_then(|store| store.map(|s| s.load()).transpose());
    match stored {
        Ok(None) => "none yet (starts at the beginning)".to_owned(),
        Ok(Some(cp)) if cp.is_empty() => "none yet (starts at the beginning)".to_owned(),
        Ok(Some(cp)) => cp
            .iter()
            .map(|(p, o)| format!("{p}@{o}"))
            .collect::<Vec<_>>()
            .join(", "),
        Err(CheckpointError::InUse(_)) => "held by a running refract process".to_owned(),
        Err(e) => format!("unreadable: {e}"),
    }
}

/// Where dead letters go: the configured URL or path, or the default under the state.
fn dead_letters(loaded: &LoadedPipeline) -> String {
    let c = &loaded.config;
    match (&c.pipeline.dead_letter.url, &c.pipeline.dead_letter.path) {
        (Some(url), _) => shown(loaded, "pipeline.dead_letter.url", url.expose()),
        (None, Some(path)) => shown(loaded, "pipeline.dead_letter.path", path),
        (None, None) => default_dead_letter_path(c).display().to_string(),
    }
}

/// What the pipeline reads.
fn render_source(out: &mut String, loaded: &LoadedPipeline, check: &SourceCheck, state: &Path) {
    match &loaded.config.source {
        SourceConfig::File(f) => render_file_source(out, loaded, f),
        SourceConfig::Postgres(pg) => render_postgres_source(out, loaded, pg, check, state),
        SourceConfig::Kafka(k) => kafka::render_kafka_source(out, loaded, k),
    }
}

/// A file source: its path and current size.
fn render_file_source(out: &mut String, loaded: &LoadedPipeline, f: &FileSourceConfig) {
    let size = std::fs::metadata(&f.path).map_or_else(
        |e| format!("not readable now: {e}"),
        |m| format!("{} bytes", m.len()),
    );
    let _ = writeln!(
        out,
        "reads  file {} ({size}), Debezium JSON envelopes, one per line",
        shown(loaded, "source.path", &f.path)
    );
}

/// A PostgreSQL source: the file's side, then the database's (or why it could not be asked),
/// then the last backfill.
fn render_postgres_source(
    out: &mut String,
    loaded: &LoadedPipeline,
    pg: &PostgresSourceConfig,
    check: &SourceCheck,
    state: &Path,
) {
    let name = &loaded.config.pipeline.name;
    let _ = writeln!(
        out,
        "reads  PostgreSQL {} through slot `{}` and publication `{}` ({}; created when missing: {})",
        shown(loaded, "source.url", pg.url.expose()),
        pg.slot_name(name),
        pg.publication_name(name),
        if pg.tables.is_empty() {
            "all tables".to_owned()
        } else {
            pg.tables.join(", ")
        },
        pg.create
    );
    match check {
        SourceCheck::Postgres(inspection) => render_database(out, pg, inspection),
        SourceCheck::Unreachable(why) => {
            let _ = writeln!(
                out,
                "  database    could not connect to check the slot, publication and tables ({why}); \
                 the plan is from the file alone"
            );
        }
        SourceCheck::NotApplicable => {}
    }
    render_backfill(out, state);
}

/// The pipeline's last `refract backfill`, as its state records it: under way (rows read of the
/// estimate), complete, or failed; nothing when none was ever asked for.
fn render_backfill(out: &mut String, state: &Path) {
    let status = match snapshot::BackfillStatus::read(state) {
        Ok(Some(status)) => status,
        Ok(None) => return,
        Err(e) => {
            let _ = writeln!(out, "  backfill    its progress cannot be read: {e}");
            return;
        }
    };
    let scope = if status.scope.is_empty() {
        "every table".to_owned()
    } else {
        status.scope.join(", ")
    };
    let request = status
        .request
        .as_deref()
        .map_or(String::new(), |id| format!(", request {id}"));
    let progress = if let Some(error) = &status.error {
        format!("failed: {error}")
    } else if status.complete {
        format!("complete, {} rows", status.rows())
    } else {
        format!(
            "under way: {} of about {} rows read (`refract backfill` with the same tables resumes or follows it)",
            status.rows(),
            status.total.max(status.rows())
        )
    };
    let _ = writeln!(out, "  backfill    of {scope}{request}: {progress}");
    for (table, _, skipped) in &status.tables {
        if let Some(why) = skipped {
            let _ = writeln!(out, "              `{table}` left out: {why}");
        }
    }
}

/// The database's side of a PostgreSQL source: server, slot, publication, tables.
fn render_database(out: &mut String, pg: &PostgresSourceConfig, i: &Inspection) {
    render_server(out, i);
    render_slot(out, pg, i);
    render_publication(out, pg, i);
    render_tables(out, i);
}

/// The server's version, WAL level, role and database.
fn render_server(out: &mut String, i: &Inspection) {
    let s = &i.server;
    let _ = writeln!(
        out,
        "  server      PostgreSQL {}, wal_level {}, role `{}`{}, database `{}`",
        s.version,
        s.wal_level,
        s.user,
        if s.can_replicate {
            " (may replicate)"
        } else {
            " (no REPLICATION)"
        },
        s.database
    );
}

/// The slot: missing (and what `refract run` does about it), another database's, or its state.
fn render_slot(out: &mut String, pg: &PostgresSourceConfig, i: &Inspection) {
    match &i.slot {
        None if pg.create => {
            let _ = writeln!(
                out,
                "  slot        `{}` does not exist: `refract run` creates it (pgoutput), then {}",
                i.slot_name,
                match pg.snapshot {
                    SnapshotMode::Initial => "reads the existing rows (snapshot = \"initial\")",
                    SnapshotMode::Never => "streams changes only (snapshot = \"never\")",
                }
            );
        }
        None => {
            let _ = writeln!(
                out,
                "  slot        `{}` does not exist (and `create = false`)",
                i.slot_name
            );
        }
        Some(slot) if !slot.in_this_database => {
            let _ = writeln!(
                out,
                "  slot        `{}` exists but is a {} slot of {}",
                i.slot_name,
                slot.slot_type,
                slot.database
                    .as_deref()
                    .map_or("no database".to_owned(), |d| format!("database `{d}`"))
            );
        }
        Some(slot) => {
            let mut line = format!("  slot        `{}` exists", i.slot_name);
            if slot.active {
                let _ = write!(
                    line,
                    ", active (server process {})",
                    slot.active_pid.map_or("?".to_owned(), |p| p.to_string())
                );
            } else {
                line.push_str(", not active");
            }
            let _ = write!(
                line,
                ", wal_status {}, confirmed_flush_lsn {}",
                slot.wal_status.as_deref().unwrap_or("unknown"),
                slot.confirmed_flush_lsn.as_deref().unwrap_or("none")
            );
            if let Some(bytes) = slot.retained_wal_bytes {
                let _ = write!(line, ", retains {} of WAL", pretty_bytes(bytes));
            }
            if let Some(safe) = slot.safe_wal_size {
                let _ = write!(
                    line,
                    " ({} more before it may be invalidated)",
                    pretty_bytes(safe.max(0))
                );
            }
            let _ = writeln!(out, "{line}");
        }
    }
}

/// The publication: what it publishes, or what `refract run` would create, and how many tables.
fn render_publication(out: &mut String, pg: &PostgresSourceConfig, i: &Inspection) {
    let covered = match i.tables.len() {
        1 => "1 table".to_owned(),
        n => format!("{n} tables"),
    };
    match &i.publication {
        Some(p) => {
            let _ = writeln!(
                out,
                "  publication `{}` exists{}, publishes {}: {covered}",
                i.publication_name,
                if p.all_tables {
                    " (FOR ALL TABLES)"
                } else {
                    ""
                },
                p.publishes.join(", ")
            );
        }
        None => {
            let target = if pg.tables.is_empty() {
                "ALL TABLES".to_owned()
            } else {
                pg.tables
                    .iter()
                    .map(|t| match t.split_once('.') {
                        Some((schema, "*")) => format!("TABLES IN SCHEMA {schema}"),
                        _ => format!("TABLE {t}"),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(
                out,
                "  publication `{}` does not exist: {} FOR {target}: {covered} now",
                i.publication_name,
                if pg.create {
                    "`refract run` creates it"
                } else {
                    "`create = false`, so nobody creates it"
                }
            );
        }
    }
}

/// One line per published table: its replica identity and primary key, names aligned.
fn render_tables(out: &mut String, i: &Inspection) {
    let width = i
        .tables
        .iter()
        .map(|t| t.qualified().len())
        .max()
        .unwrap_or(0);
    for t in &i.tables {
        let identity = match (&t.replica_identity, &t.identity_index) {
            (ReplicaIdentity::Index, Some((index, columns))) => {
                format!("index {index} ({})", columns.join(", "))
            }
            (identity, _) => identity.as_str().to_owned(),
        };
        let key = if t.primary_key.is_empty() {
            "no primary key".to_owned()
        } else {
            format!("primary key ({})", t.primary_key.join(", "))
        };
        let _ = writeln!(
            out,
            "    {:width$}  replica identity {identity}, {key}",
            t.qualified()
        );
    }
}

/// What one projection reads and makes.
fn render_projection(out: &mut String, name: &str, p: &ProjectionConfig) {
    match p {
        ProjectionConfig::Replica(r) => render_replica(out, name, r),
        ProjectionConfig::CacheInvalidation(ci) => render_cache_invalidation(out, name, ci),
        ProjectionConfig::Document(d) => render_document(out, name, d),
        ProjectionConfig::Flatten(f) => render_flatten(out, name, f),
        ProjectionConfig::Relay(r) => kafka::render_relay(out, name, r),
        ProjectionConfig::Tiers(t) => tiers::render_tiers(out, name, t),
        ProjectionConfig::Migration(m) => {
            let _ = writeln!(
                out,
                "projection `{name}` (migration): changes of `{}` into `{}` through the transform, and back after a cut-over",
                m.migration.migration.source, m.migration.migration.target
            );
        }
    }
}

/// A replica projection: its tables, keys and collection.
fn render_replica(out: &mut String, name: &str, r: &ReplicaProjectionConfig) {
    let tables = if r.tables.is_empty() {
        "every table".to_owned()
    } else {
        r.tables.join(", ")
    };
    let mut keys = format!("key {}", r.default_key.join(", "));
    for (t, cols) in &r.key_columns {
        let _ = write!(keys, "; {t}: {}", cols.join(", "));
    }
    let _ = writeln!(
        out,
        "projects `{name}` (replica): {tables} -> current row per key ({keys}) into collection `{}` -> sinks {}",
        r.collection,
        r.sinks.join(", ")
    );
}

/// A cache invalidation projection: one line per table, with its key templates.
fn render_cache_invalidation(out: &mut String, name: &str, ci: &CacheInvalidationProjectionConfig) {
    for (table, t) in &ci.tables {
        let version = t
            .version_column
            .as_ref()
            .map_or(String::new(), |v| format!(", version from `{v}`"));
        let _ = writeln!(
            out,
            "projects `{name}` (cache_invalidation): {table} -> after each commit, keys {} of the old and the new row{version} -> sinks {}",
            t.keys.join(", "),
            ci.sinks.join(", ")
        );
    }
}

/// A document projection: its root table, fields, embeds and objects.
fn render_document(out: &mut String, name: &str, d: &DocumentProjectionConfig) {
    let mut parts = vec![format!("{} fields", d.fields.len())];
    for e in &d.embeds {
        let via = match (&e.through, &e.foreign_key) {
            (Some(link), _) => format!("through {}", link.table),
            (None, Some(fk)) => format!("by {fk}"),
            (None, None) => String::new(),
        };
        let limit = e.limit.map_or(String::new(), |l| format!(", first {l}"));
        parts.push(format!("`{}`: {} {via}{limit}", e.name, e.table));
    }
    for o in &d.objects {
        parts.push(format!("`{}`: {} objects", o.name, o.items.len()));
    }
    let _ = writeln!(
        out,
        "projects `{name}` (document): {} -> one document per row (key {}; {}), rebuilt when any row of it changes, into collection `{}` -> sinks {}",
        d.table,
        d.key.join(", "),
        parts.join("; "),
        d.collection.as_deref().unwrap_or(name),
        d.sinks.join(", ")
    );
}

/// A flatten projection: one line per output table.
fn render_flatten(out: &mut String, name: &str, f: &FlattenProjectionConfig) {
    for t in &f.outputs {
        let from = t
            .explode
            .as_ref()
            .map_or(String::new(), |e| format!(", one row per element of {e}"));
        let unmapped = match &t.unmapped {
            None => "unmapped fields dropped".to_owned(),
            Some(u) => {
                format!("unmapped fields under {} kept ({:?})", u.under, u.mode).to_lowercase()
            }
        };
        let _ = writeln!(
            out,
            "projects `{name}` (flatten): {} -> table `{}` ({} columns, key {}{from}; {unmapped}) -> sinks {}",
            f.table,
            t.name,
            t.columns.len(),
            t.key.join(", "),
            f.sinks.join(", ")
        );
    }
}

/// Where one sink writes, and how.
fn render_sink(out: &mut String, loaded: &LoadedPipeline, name: &str, s: &SinkConfig) {
    match s {
        SinkConfig::ObjectJson(o) => render_object_json_sink(out, loaded, name, o),
        SinkConfig::Redis(r) => render_redis_sink(out, loaded, name, r),
        SinkConfig::Parquet(p) => render_parquet_sink(out, loaded, name, p),
        SinkConfig::Postgres(p) => render_postgres_sink(out, loaded, name, p),
        SinkConfig::Kafka(k) => kafka::render_kafka_sink(out, loaded, name, k),
        SinkConfig::Tiers(t) => tiers::render_tiers_sink(out, loaded, name, t),
        SinkConfig::Migration(m) => {
            let _ = writeln!(
                out,
                "writes `{name}` (migration): both tables of `{}` and its control row in `{}`",
                m.url.masked(),
                m.control_table
            );
        }
        SinkConfig::Null(_) => {
            let _ = writeln!(out, "writes `{name}` (null): discards everything");
        }
    }
}

/// An object_json sink: the object paths and the writes in flight.
fn render_object_json_sink(
    out: &mut String,
    loaded: &LoadedPipeline,
    name: &str,
    o: &ObjectJsonSinkConfig,
) {
    let _ = writeln!(
        out,
        "writes `{name}` (object_json): {}/{{collection}}/{{key}}.json, {} writes in flight",
        shown(loaded, &format!("sinks.{name}.url"), o.url.expose()),
        o.concurrency
    );
}

/// A redis sink: how keys are deleted, pipelining, authentication, health and fallback.
fn render_redis_sink(out: &mut String, loaded: &LoadedPipeline, name: &str, r: &RedisSinkConfig) {
    let how = match r.command {
        RedisDeleteCommand::Unlink => "UNLINK".to_owned(),
        RedisDeleteCommand::Del => "DEL".to_owned(),
        RedisDeleteCommand::Tombstone => format!("tombstones living {} ms", r.tombstone_ttl_ms),
    };
    let second = if r.second_delete_ms > 0 {
        format!(", again after {} ms", r.second_delete_ms)
    } else {
        String::new()
    };
    let auth = match (&r.username, &r.password) {
        (Some(u), Some(_)) => format!(", as `{u}` with a password"),
        (None, Some(_)) => ", with a password".to_owned(),
        (Some(u), None) => format!(", as `{u}`"),
        (None, None) => String::new(),
    };
    let _ = writeln!(
        out,
        "writes `{name}` (redis{}): {} by {how}{second}, {} commands per round trip{auth}; unhealthy after {} ms of failures",
        if r.cluster {
            " cluster, keys grouped by hash slot"
        } else {
            ""
        },
        shown(loaded, &format!("sinks.{name}.url"), r.url.expose()),
        r.pipeline_depth,
        r.unhealthy_after_ms
    );
    if let Some(f) = &r.fallback_file {
        let _ = writeln!(
            out,
            "             if Redis does not answer at start: commands go to {f} instead (demo mode)"
        );
    }
}

/// A parquet sink: file layout, compression, rolling, memory and compaction.
fn render_parquet_sink(
    out: &mut String,
    loaded: &LoadedPipeline,
    name: &str,
    p: &ParquetSinkConfig,
) {
    let compaction = if p.compact_interval_ms > 0 {
        format!("every {} s", p.compact_interval_ms / 1000)
    } else {
        "by `refract compact` and at the end of --until-caught-up".to_owned()
    };
    let _ = writeln!(
        out,
        "writes `{name}` (parquet): {}/{{table}}/changes/date=…/*.parquet (zstd {}, files of up to {} rows or {} MiB or {} s, \
         open files up to {} MiB in memory); {{table}}/current/ compacted {compaction}",
        shown(loaded, &format!("sinks.{name}.url"), p.url.expose()),
        p.zstd_level,
        p.roll_rows,
        p.roll_bytes >> 20,
        p.roll_ms / 1000,
        p.buffer_bytes >> 20
    );
}

/// A postgres sink: the read model table and how it is written.
fn render_postgres_sink(
    out: &mut String,
    loaded: &LoadedPipeline,
    name: &str,
    p: &PostgresSinkConfig,
) {
    let _ = writeln!(
        out,
        "writes `{name}` (postgres): {} table {}.{} (id, doc jsonb, source_position; created when missing), \
         one transaction per batch, {} documents per upsert, guarded by source position and by \
         tombstones in {}.refract_tombstones (kept at least {} ms)",
        shown(loaded, &format!("sinks.{name}.url"), p.url.expose()),
        p.schema,
        p.table,
        p.rows_per_statement,
        p.schema,
        p.tombstone_retention_ms
    );
}

/// The environment variables the file used, when it used any.
fn render_environment(out: &mut String, loaded: &LoadedPipeline) {
    if loaded.from_env.is_empty() {
        return;
    }
    let vars: std::collections::BTreeSet<&str> = loaded
        .from_env
        .values()
        .flatten()
        .map(String::as_str)
        .collect();
    let _ = writeln!(
        out,
        "environment  {}",
        vars.into_iter().collect::<Vec<_>>().join(", ")
    );
}

/// The warnings and notes about a PostgreSQL source, when its database was asked.
fn render_findings(out: &mut String, loaded: &LoadedPipeline, check: &SourceCheck) {
    let c = &loaded.config;
    let (SourceCheck::Postgres(inspection), SourceConfig::Postgres(pg)) = (check, &c.source) else {
        return;
    };
    let projections: Vec<(String, Box<dyn refract_projections::Projection>)> = c
        .projections
        .iter()
        .map(|(name, p)| (name.clone(), refract_projections::build(p)))
        .collect();
    let file = loaded.file.display().to_string();
    for finding in findings(&file, c, pg, inspection, &projections) {
        let _ = writeln!(out, "{finding}");
    }
}
