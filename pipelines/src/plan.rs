//! `refract plan`: what a pipeline will read, keep and write, with secrets masked.
//!
//! For a PostgreSQL source, [`check_source`] asks the database (through the connectors crate)
//! about the slot, the publication and the published tables; [`render`] shows them next to the
//! file's plan and ends with warnings about what would go wrong: tables PostgreSQL would refuse
//! to update once published, replica identities that do not send what a projection needs from
//! the old row, an invalidated slot.

use std::fmt::Write as _;
use std::time::Duration;

use refract_connectors::sources::postgres::{
    Inspection, PgAdmin, ReplicaIdentity, TableInfo, snapshot,
};
use refract_projections::Projection;
use refract_schemas::TableId;
use refract_schemas::config::{
    LoadedPipeline, OnError, PipelineFile, PostgresSourceConfig, ProjectionConfig, SinkConfig,
    SnapshotMode, SourceConfig, mask_url,
};

use crate::checkpoint::{CheckpointError, CheckpointStore};
use crate::runtime::{default_dead_letter_path, state_path};

/// How long `plan` waits for the database before showing the plan without it.
const CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// What the source's own store says, when it can be asked.
#[derive(Debug)]
pub enum SourceCheck {
    /// Nothing to ask (file source).
    NotApplicable,
    /// The database could not be asked; why.
    Unreachable(String),
    /// What the PostgreSQL source's database says.
    Postgres(Box<Inspection>),
}

/// Asks the source's store about the pipeline (PostgreSQL: slot, publication, tables).
pub async fn check_source(loaded: &LoadedPipeline) -> SourceCheck {
    let SourceConfig::Postgres(pg) = &loaded.config.source else {
        return SourceCheck::NotApplicable;
    };
    let inspect = async {
        let admin = PgAdmin::connect(&pg.url).await?;
        admin.inspect(pg, &loaded.config.pipeline.name).await
    };
    match tokio::time::timeout(CHECK_TIMEOUT, inspect).await {
        Ok(Ok(inspection)) => SourceCheck::Postgres(Box::new(inspection)),
        Ok(Err(e)) => SourceCheck::Unreachable(e.to_string()),
        Err(_) => {
            SourceCheck::Unreachable(format!("no answer within {} s", CHECK_TIMEOUT.as_secs()))
        }
    }
}

/// Renders the plan of a loaded pipeline, with what [`check_source`] found.
pub fn render(loaded: &LoadedPipeline, check: &SourceCheck) -> String {
    let c = &loaded.config;
    let show = |path: &str, value: &str| -> String {
        if loaded.secret_paths.contains(path) {
            "*** (secret)".to_owned()
        } else {
            mask_url(value)
        }
    };
    let mut out = String::new();
    let state = state_path(c);
    let _ = writeln!(
        out,
        "pipeline `{}` ({})",
        c.pipeline.name,
        loaded.file.display()
    );
    let stored = CheckpointStore::open_existing(&state)
        .and_then(|store| store.map(|s| s.load()).transpose());
    let checkpoint = match stored {
        Ok(None) => "none yet (starts at the beginning)".to_owned(),
        Ok(Some(cp)) if cp.is_empty() => "none yet (starts at the beginning)".to_owned(),
        Ok(Some(cp)) => cp
            .iter()
            .map(|(p, o)| format!("{p}@{o}"))
            .collect::<Vec<_>>()
            .join(", "),
        Err(CheckpointError::InUse(_)) => "held by a running refract process".to_owned(),
        Err(e) => format!("unreadable: {e}"),
    };
    let _ = writeln!(
        out,
        "  state       {} (checkpoint: {checkpoint})",
        state.display()
    );
    let dead_letters = match (&c.pipeline.dead_letter.url, &c.pipeline.dead_letter.path) {
        (Some(url), _) => show("pipeline.dead_letter.url", url),
        (None, Some(path)) => show("pipeline.dead_letter.path", path),
        (None, None) => default_dead_letter_path(c).display().to_string(),
    };
    let policy = match c.pipeline.on_error {
        OnError::DeadLetter => format!("bad input goes to {dead_letters}"),
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
    match &c.source {
        SourceConfig::File(f) => {
            let size = std::fs::metadata(&f.path).map_or_else(
                |e| format!("not readable now: {e}"),
                |m| format!("{} bytes", m.len()),
            );
            let _ = writeln!(
                out,
                "reads  file {} ({size}), Debezium JSON envelopes, one per line",
                show("source.path", &f.path)
            );
        }
        SourceConfig::Postgres(pg) => {
            let _ = writeln!(
                out,
                "reads  PostgreSQL {} through slot `{}` and publication `{}` ({}; created when missing: {})",
                show("source.url", &pg.url),
                pg.slot_name(&c.pipeline.name),
                pg.publication_name(&c.pipeline.name),
                if pg.tables.is_empty() {
                    "all tables".to_owned()
                } else {
                    pg.tables.join(", ")
                },
                pg.create
            );
            match check {
                SourceCheck::Postgres(inspection) => render_postgres(&mut out, pg, inspection),
                SourceCheck::Unreachable(why) => {
                    let _ = writeln!(
                        out,
                        "  database    could not connect to check the slot, publication and tables ({why}); \
                         the plan is from the file alone"
                    );
                }
                SourceCheck::NotApplicable => {}
            }
            render_backfill(&mut out, &state_path(c));
        }
    }
    for (name, p) in &c.projections {
        match p {
            ProjectionConfig::Replica(r) => {
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
            ProjectionConfig::CacheInvalidation(ci) => {
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
            ProjectionConfig::Document(d) => {
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
            ProjectionConfig::Flatten(f) => {
                for t in &f.outputs {
                    let from = t
                        .explode
                        .as_ref()
                        .map_or(String::new(), |e| format!(", one row per element of {e}"));
                    let unmapped = match &t.unmapped {
                        None => "unmapped fields dropped".to_owned(),
                        Some(u) => format!("unmapped fields under {} kept ({:?})", u.under, u.mode)
                            .to_lowercase(),
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
        }
    }
    for (name, s) in &c.sinks {
        match s {
            SinkConfig::ObjectJson(o) => {
                let _ = writeln!(
                    out,
                    "writes `{name}` (object_json): {}/{{collection}}/{{key}}.json, {} writes in flight",
                    show(&format!("sinks.{name}.url"), &o.url),
                    o.concurrency
                );
            }
            SinkConfig::Redis(r) => {
                let how = match r.command {
                    refract_schemas::config::RedisDeleteCommand::Unlink => "UNLINK".to_owned(),
                    refract_schemas::config::RedisDeleteCommand::Del => "DEL".to_owned(),
                    refract_schemas::config::RedisDeleteCommand::Tombstone => {
                        format!("tombstones living {} ms", r.tombstone_ttl_ms)
                    }
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
                    "writes `{name}` (redis): {} by {how}{second}, {} commands per round trip{auth}; unhealthy after {} ms of failures",
                    show(&format!("sinks.{name}.url"), &r.url),
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
            SinkConfig::Parquet(p) => {
                let compaction = if p.compact_interval_ms > 0 {
                    format!("every {} s", p.compact_interval_ms / 1000)
                } else {
                    "by `refract compact` and at the end of --until-caught-up".to_owned()
                };
                let _ = writeln!(
                    out,
                    "writes `{name}` (parquet): {}/{{table}}/changes/date=…/*.parquet (zstd {}, files of up to {} rows or {} MiB or {} s, \
                     open files up to {} MiB in memory); {{table}}/current/ compacted {compaction}",
                    show(&format!("sinks.{name}.url"), &p.url),
                    p.zstd_level,
                    p.roll_rows,
                    p.roll_bytes >> 20,
                    p.roll_ms / 1000,
                    p.buffer_bytes >> 20
                );
            }
            SinkConfig::Postgres(p) => {
                let _ = writeln!(
                    out,
                    "writes `{name}` (postgres): {} table {}.{} (id, doc jsonb, source_position; created when missing), \
                     one transaction per batch, {} documents per upsert, guarded by source position",
                    show(&format!("sinks.{name}.url"), &p.url),
                    p.schema,
                    p.table,
                    p.rows_per_statement
                );
            }
            SinkConfig::Null(_) => {
                let _ = writeln!(out, "writes `{name}` (null): discards everything");
            }
        }
    }
    if !loaded.from_env.is_empty() {
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
    if let (SourceCheck::Postgres(inspection), SourceConfig::Postgres(pg)) = (check, &c.source) {
        let projections: Vec<(String, Box<dyn Projection>)> = c
            .projections
            .iter()
            .map(|(name, p)| (name.clone(), refract_projections::build(p)))
            .collect();
        let file = loaded.file.display().to_string();
        for finding in findings(&file, c, pg, inspection, &projections) {
            let _ = writeln!(out, "{finding}");
        }
    }
    out
}

/// The pipeline's last `refract backfill`, as its state records it: under way (rows read of the
/// estimate), complete, or failed; nothing when none was ever asked for.
fn render_backfill(out: &mut String, state: &std::path::Path) {
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
fn render_postgres(out: &mut String, pg: &PostgresSourceConfig, i: &Inspection) {
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

/// A warning or a note of `plan`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Whether something will go wrong (warning) or is worth knowing (note).
    pub warning: bool,
    /// What and what to do.
    pub text: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let level = if self.warning { "warning" } else { "note" };
        write!(f, "{level}: {}", self.text)
    }
}

/// What would go wrong, or is worth knowing, with a PostgreSQL source as the database is now.
/// `file` is the pipeline file (for the commands it suggests); `projections` are the pipeline's
/// projections by name (each declares what it needs from the old row of a change through
/// [`Projection::before_image_columns`]).
pub fn findings(
    file: &str,
    config: &PipelineFile,
    pg: &PostgresSourceConfig,
    i: &Inspection,
    projections: &[(String, Box<dyn Projection>)],
) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut warn = |text: String| {
        out.push(Finding {
            warning: true,
            text,
        })
    };
    let s = &i.server;
    if s.wal_level != "logical" {
        warn(format!(
            "wal_level is `{}`: logical replication needs `wal_level = logical` \
             (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)",
            s.wal_level
        ));
    }
    if !s.can_replicate {
        warn(format!(
            "role `{}` has neither REPLICATION nor superuser: `refract run` cannot stream \
             (ALTER ROLE {} REPLICATION)",
            s.user, s.user
        ));
    }
    match &i.slot {
        None if !pg.create => warn(format!(
            "slot `{}` does not exist and `create = false`: `refract run` will fail; create it \
             (SELECT pg_create_logical_replication_slot('{}', 'pgoutput')) or set `create = true`",
            i.slot_name, i.slot_name
        )),
        None => {}
        Some(slot) if !slot.in_this_database => warn(format!(
            "slot `{}` is not a logical slot of database `{}`: refract cannot use it \
             (choose another `slot` name)",
            i.slot_name, s.database
        )),
        Some(slot) => {
            if slot.is_lost() {
                warn(format!(
                    "slot `{}` was invalidated (wal_status = lost): PostgreSQL removed WAL the slot \
                     still needed, so changes were lost and `refract run` stops. To recover: \
                     `refract drop {} --yes` (drops the slot, the publication if refract may have \
                     created it, and the pipeline's state), then `refract run` creates a new slot and \
                     re-reads every table (initial snapshot; with `snapshot = \"never\"`, run \
                     `refract backfill`). To keep it from happening again, keep the pipeline running \
                     or raise max_slot_wal_keep_size (now {})",
                    i.slot_name,
                    file,
                    s.max_slot_wal_keep_size.as_deref().unwrap_or("unknown")
                ));
            } else if let Some(bytes) = slot
                .retained_wal_bytes
                .filter(|b| b.unsigned_abs() > pg.max_retained_wal_mb.saturating_mul(1 << 20))
            {
                warn(format!(
                    "slot `{}` retains {} of WAL, more than `max_retained_wal_mb` ({} MiB): the \
                     server keeps it until the slot confirms it. Run the pipeline to catch up, or \
                     `refract drop {file} --yes` if it is abandoned",
                    i.slot_name,
                    pretty_bytes(bytes),
                    pg.max_retained_wal_mb
                ));
            }
            if slot.wal_status.as_deref() == Some("unreserved") {
                warn(format!(
                    "slot `{}` has wal_status = unreserved: it retains more WAL than \
                     max_slot_wal_keep_size and will be invalidated at the next checkpoint unless \
                     its consumer catches up",
                    i.slot_name
                ));
            }
            if slot.plugin.as_deref() != Some("pgoutput") {
                warn(format!(
                    "slot `{}` uses output plugin `{}`: refract needs pgoutput",
                    i.slot_name,
                    slot.plugin.as_deref().unwrap_or("none")
                ));
            }
        }
    }
    match &i.publication {
        None if !pg.create => warn(format!(
            "publication `{}` does not exist and `create = false`: `refract run` will fail",
            i.publication_name
        )),
        Some(_) => {
            if let Some(from_file) = &i.file_tables {
                let published: Vec<String> = i.tables.iter().map(TableInfo::qualified).collect();
                let only_published: Vec<&str> = published
                    .iter()
                    .filter(|t| !from_file.contains(t))
                    .map(String::as_str)
                    .collect();
                let only_in_file: Vec<&str> = from_file
                    .iter()
                    .filter(|t| !published.contains(t))
                    .map(String::as_str)
                    .collect();
                if !only_published.is_empty() || !only_in_file.is_empty() {
                    let mut text = format!(
                        "publication `{}` exists and covers other tables than `tables` in the file \
                         (which applies only when refract creates the publication)",
                        i.publication_name
                    );
                    if !only_published.is_empty() {
                        let _ = write!(
                            text,
                            "; published, not in the file: {}",
                            some(&only_published)
                        );
                    }
                    if !only_in_file.is_empty() {
                        let _ = write!(
                            text,
                            "; in the file, not published: {}",
                            some(&only_in_file)
                        );
                    }
                    text.push_str(": ALTER PUBLICATION to change what is read");
                    out.push(Finding {
                        warning: false,
                        text,
                    });
                }
            }
        }
        None => {}
    }
    for u in &i.unmatched {
        let fatal = u.reason != "the schema has no tables (yet)";
        out.push(Finding {
            warning: fatal,
            text: format!(
                "`tables` entry `{}`: {}{}",
                u.pattern,
                u.reason,
                if fatal {
                    "; creating the publication will fail"
                } else {
                    ""
                }
            ),
        });
    }
    if i.tables.is_empty() {
        out.push(Finding {
            warning: true,
            text: "the publication covers no table: there is nothing to read".into(),
        });
    }
    // Whether PostgreSQL refuses UPDATE/DELETE on published tables without a replica identity.
    let rejects = i
        .publication
        .as_ref()
        .is_none_or(|p| p.publishes_updates_or_deletes());
    for t in &i.tables {
        table_findings(config, t, rejects, projections, &mut out);
    }
    out
}

fn table_findings(
    config: &PipelineFile,
    t: &TableInfo,
    rejects: bool,
    projections: &[(String, Box<dyn Projection>)],
    out: &mut Vec<Finding>,
) {
    let name = t.qualified();
    let id = TableId::new(&t.schema, &t.name);
    let readers: Vec<&(String, Box<dyn Projection>)> =
        projections.iter().filter(|(_, p)| p.reads(&id)).collect();
    let warning = |text: String| Finding {
        warning: true,
        text,
    };
    if readers.is_empty() {
        out.push(warning(format!(
            "`{name}` is published but no projection reads it: its changes {}",
            match config.pipeline.on_error {
                OnError::DeadLetter => "go to the dead-letter store",
                OnError::Stop => "stop the pipeline",
            }
        )));
    }
    // (a) No replica identity: PostgreSQL refuses UPDATE and DELETE once the table is published.
    let no_identity = match t.replica_identity {
        ReplicaIdentity::Default => t.primary_key.is_empty(),
        ReplicaIdentity::Nothing => true,
        ReplicaIdentity::Index => t.identity_index.is_none(),
        ReplicaIdentity::Full => false,
    };
    if no_identity {
        let what = if t.replica_identity == ReplicaIdentity::Nothing {
            "has REPLICA IDENTITY NOTHING".to_owned()
        } else {
            "has no primary key and REPLICA IDENTITY DEFAULT".to_owned()
        };
        let rejected = if rejects {
            "once it is in the publication PostgreSQL rejects its UPDATE and DELETE \
             (\"does not have a replica identity and publishes updates\")"
        } else {
            "its UPDATE and DELETE carry no old row"
        };
        let key = if t.primary_key.is_empty() {
            ", and refract has no key for its documents"
        } else {
            ""
        };
        out.push(warning(format!(
            "`{name}` {what}: {rejected}{key}. Add a primary key, or set \
             REPLICA IDENTITY USING INDEX (a unique index on NOT NULL columns) or FULL"
        )));
    } else if t.primary_key.is_empty() {
        // FULL (or an index) without a primary key: the source sends no key under FULL.
        for (pname, config) in readers_config(config, &readers) {
            // Under USING INDEX the source keys documents by the index's columns.
            if t.replica_identity != ReplicaIdentity::Full {
                continue;
            }
            let ProjectionConfig::Replica(r) = config else {
                continue;
            };
            let key = r
                .key_columns
                .iter()
                .find(|(pattern, _)| id.matches(pattern))
                .map_or(&r.default_key, |(_, cols)| cols);
            let missing: Vec<&String> = key.iter().filter(|k| !t.columns.contains(k)).collect();
            if missing.is_empty() {
                out.push(Finding {
                    warning: false,
                    text: format!(
                        "`{name}` has no primary key: projection `{pname}` keys its documents by \
                         ({}), which must be unique and never null",
                        key.join(", ")
                    ),
                });
            } else {
                out.push(warning(format!(
                    "`{name}` has no primary key and projection `{pname}` keys it by ({}), which \
                     the table does not have: refract has no key for its documents and \
                     dead-letters its changes. Add a primary key or set `key_columns`",
                    key.join(", ")
                )));
            }
        }
    }
    if t.primary_key.is_empty() {
        out.push(Finding {
            warning: false,
            text: format!(
                "`{name}` has no primary key: the initial snapshot and `refract backfill` leave it \
                 out (they read tables in key order); only its changes are streamed"
            ),
        });
    }
    // (b) What projections need from the old row, against what the replica identity sends.
    if let Some(sent) = t.identity_columns() {
        let described = match t.replica_identity {
            ReplicaIdentity::Default if !t.primary_key.is_empty() => format!(
                "REPLICA IDENTITY DEFAULT sends only the key ({}) in the old row, of deletes and of \
                 updates that change the key",
                sent.join(", ")
            ),
            ReplicaIdentity::Index => format!(
                "REPLICA IDENTITY USING INDEX sends only ({}) in the old row",
                sent.join(", ")
            ),
            _ => "no old row is sent".to_owned(),
        };
        for (pname, p) in &readers {
            let missing: Vec<String> = p
                .before_image_columns(&id)
                .into_iter()
                .filter(|c| !sent.contains(c))
                .collect();
            if !missing.is_empty() {
                out.push(warning(format!(
                    "projection `{pname}` needs ({}) from the old row of `{name}`, but {described}: \
                     ALTER TABLE {name} REPLICA IDENTITY FULL",
                    missing.join(", ")
                )));
            }
        }
        // Unchanged TOAST values are not sent either.
        if !t.toastable.is_empty() && !readers.is_empty() && !no_identity {
            out.push(Finding {
                warning: false,
                text: format!(
                    "`{name}` has REPLICA IDENTITY {}: an UPDATE that leaves a TOASTed (large, \
                     out-of-line) value of ({}) unchanged does not carry it, so refract re-reads \
                     it by key (one query per such update); with REPLICA IDENTITY FULL the old \
                     row carries it",
                    match t.replica_identity {
                        ReplicaIdentity::Index => "USING INDEX".to_owned(),
                        other => other.as_str().to_uppercase(),
                    },
                    t.toastable.join(", ")
                ),
            });
        }
    }
}

/// The configurations of the projections in `readers`, by name.
fn readers_config<'a>(
    config: &'a PipelineFile,
    readers: &[&(String, Box<dyn Projection>)],
) -> Vec<(&'a str, &'a ProjectionConfig)> {
    config
        .projections
        .iter()
        .filter(|(name, _)| readers.iter().any(|(n, _)| n == *name))
        .map(|(name, p)| (name.as_str(), p))
        .collect()
}

/// The first few of `items`, and how many more.
fn some(items: &[&str]) -> String {
    const SHOWN: usize = 10;
    let mut text = items[..items.len().min(SHOWN)].join(", ");
    if items.len() > SHOWN {
        let _ = write!(text, " and {} more", items.len() - SHOWN);
    }
    text
}

/// `1536` → `1.5 KiB`.
pub fn pretty_bytes(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes.abs() < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests;
