//! The warnings and notes of `refract plan` about a PostgreSQL source, one check after another:
//! the server, the slot, the publication, the file's `tables`, then each published table (who
//! reads it, its replica identity and key, what projections need from the old row, TOAST).

use std::fmt::Write as _;

use refract_connectors::sources::postgres::{
    Inspection, ReplicaIdentity, ServerInfo, SlotState, TableInfo,
};
use refract_projections::Projection;
use refract_schemas::TableId;
use refract_schemas::config::{OnError, PipelineFile, PostgresSourceConfig, ProjectionConfig};

use super::pretty_bytes;

/// A warning or a note of `plan`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Whether something will go wrong (warning) or is worth knowing (note).
    pub warning: bool,
    /// What and what to do.
    pub text: String,
}

impl Finding {
    /// Something that will go wrong.
    fn warn(text: String) -> Self {
        Self {
            warning: true,
            text,
        }
    }

    /// Something worth knowing.
    fn note(text: String) -> Self {
        Self {
            warning: false,
            text,
        }
    }
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
    server_findings(&i.server, &mut out);
    slot_findings(file, pg, i, &mut out);
    publication_findings(pg, i, &mut out);
    coverage_findings(i, &mut out);
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

/// The server: logical WAL, and a role that may replicate.
fn server_findings(s: &ServerInfo, out: &mut Vec<Finding>) {
    if s.wal_level != "logical" {
        out.push(Finding::warn(format!(
            "wal_level is `{}`: logical replication needs `wal_level = logical` \
             (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)",
            s.wal_level
        )));
    }
    if !s.can_replicate {
        out.push(Finding::warn(format!(
            "role `{}` has neither REPLICATION nor superuser: `refract run` cannot stream \
             (ALTER ROLE {} REPLICATION)",
            s.user, s.user
        )));
    }
}

/// The slot: missing with `create = false`, another database's, or the state of an existing one.
fn slot_findings(file: &str, pg: &PostgresSourceConfig, i: &Inspection, out: &mut Vec<Finding>) {
    match &i.slot {
        None if !pg.create => out.push(Finding::warn(format!(
            "slot `{}` does not exist and `create = false`: `refract run` will fail; create it \
             (SELECT pg_create_logical_replication_slot('{}', 'pgoutput')) or set `create = true`",
            i.slot_name, i.slot_name
        ))),
        None => {}
        Some(slot) if !slot.in_this_database => out.push(Finding::warn(format!(
            "slot `{}` is not a logical slot of database `{}`: refract cannot use it \
             (choose another `slot` name)",
            i.slot_name, i.server.database
        ))),
        Some(slot) => existing_slot_findings(file, pg, i, slot, out),
    }
}

/// A slot of this database: invalidated or retaining too much WAL, about to be invalidated, or
/// with another output plugin than pgoutput.
fn existing_slot_findings(
    file: &str,
    pg: &PostgresSourceConfig,
    i: &Inspection,
    slot: &SlotState,
    out: &mut Vec<Finding>,
) {
    if slot.is_lost() {
        out.push(Finding::warn(format!(
            "slot `{}` was invalidated (wal_status = lost): PostgreSQL removed WAL the slot \
             still needed, so changes were lost and `refract run` stops. To recover: \
             `refract drop {} --yes` (drops the slot, the publication if refract may have \
             created it, and the pipeline's state), then `refract run` creates a new slot and \
             re-reads every table (initial snapshot; with `snapshot = \"never\"`, run \
             `refract backfill`). To keep it from happening again, keep the pipeline running \
             or raise max_slot_wal_keep_size (now {})",
            i.slot_name,
            file,
            i.server
                .max_slot_wal_keep_size
                .as_deref()
                .unwrap_or("unknown")
        )));
    } else if let Some(bytes) = slot
        .retained_wal_bytes
        .filter(|b| b.unsigned_abs() > pg.max_retained_wal_mb.saturating_mul(1 << 20))
    {
        out.push(Finding::warn(format!(
            "slot `{}` retains {} of WAL, more than `max_retained_wal_mb` ({} MiB): the \
             server keeps it until the slot confirms it. Run the pipeline to catch up, or \
             `refract drop {file} --yes` if it is abandoned",
            i.slot_name,
            pretty_bytes(bytes),
            pg.max_retained_wal_mb
        )));
    }
    if slot.wal_status.as_deref() == Some("unreserved") {
        out.push(Finding::warn(format!(
            "slot `{}` has wal_status = unreserved: it retains more WAL than \
             max_slot_wal_keep_size and will be invalidated at the next checkpoint unless \
             its consumer catches up",
            i.slot_name
        )));
    }
    if slot.plugin.as_deref() != Some("pgoutput") {
        out.push(Finding::warn(format!(
            "slot `{}` uses output plugin `{}`: refract needs pgoutput",
            i.slot_name,
            slot.plugin.as_deref().unwrap_or("none")
        )));
    }
}

/// The publication: missing with `create = false`, or existing over other tables than the
/// file's `tables`.
fn publication_findings(pg: &PostgresSourceConfig, i: &Inspection, out: &mut Vec<Finding>) {
    match &i.publication {
        None if !pg.create => out.push(Finding::warn(format!(
            "publication `{}` does not exist and `create = false`: `refract run` will fail",
            i.publication_name
        ))),
        Some(_) => {
            if let Some(from_file) = &i.file_tables {
                out.extend(publication_mismatch(i, from_file));
            }
        }
        None => {}
    }
}

/// A note when the existing publication and the file's `tables` (`from_file`) disagree.
fn publication_mismatch(i: &Inspection, from_file: &[String]) -> Option<Finding> {
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
    if only_published.is_empty() && only_in_file.is_empty() {
        return None;
    }
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
    Some(Finding::note(text))
}

/// The file's `tables` entries that match nothing, and a publication that covers no table.
fn coverage_findings(i: &Inspection, out: &mut Vec<Finding>) {
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
        out.push(Finding::warn(
            "the publication covers no table: there is nothing to read".into(),
        ));
    }
}

/// One published table: whether a projection reads it, its replica identity and key, what the
/// projections reading it need from the old row. `rejects`: whether PostgreSQL refuses UPDATE
/// and DELETE on it without a replica identity.
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
    if readers.is_empty() {
        out.push(Finding::warn(format!(
            "`{name}` is published but no projection reads it: its changes {}",
            match config.pipeline.on_error {
                OnError::DeadLetter => "go to the dead-letter store",
                OnError::Stop => "stop the pipeline",
            }
        )));
    }
    let no_identity = has_no_identity(t);
    if no_identity {
        out.push(no_identity_warning(t, rejects));
    } else if t.primary_key.is_empty() {
        keyless_replica_findings(config, t, &readers, out);
    }
    if t.primary_key.is_empty() {
        out.push(Finding::note(format!(
            "`{name}` has no primary key: the initial snapshot and `refract backfill` leave it \
             out (they read tables in key order); only its changes are streamed"
        )));
    }
    if let Some(sent) = t.identity_columns() {
        old_row_findings(t, sent, &readers, out);
        // Unchanged TOAST values are not sent either.
        if !t.toastable.is_empty() && !readers.is_empty() && !no_identity {
            out.push(toast_note(t));
        }
    }
}

/// (a) Whether the table has no replica identity: PostgreSQL refuses UPDATE and DELETE once the
/// table is published.
fn has_no_identity(t: &TableInfo) -> bool {
    match t.replica_identity {
        ReplicaIdentity::Default => t.primary_key.is_empty(),
        ReplicaIdentity::Nothing => true,
        ReplicaIdentity::Index => t.identity_index.is_none(),
        ReplicaIdentity::Full => false,
    }
}

/// The warning about a table without a replica identity, and what to do.
fn no_identity_warning(t: &TableInfo, rejects: bool) -> Finding {
    let name = t.qualified();
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
    Finding::warn(format!(
        "`{name}` {what}: {rejected}{key}. Add a primary key, or set \
         REPLICA IDENTITY USING INDEX (a unique index on NOT NULL columns) or FULL"
    ))
}

/// A table with a replica identity but no primary key: under FULL the source sends no key, so
/// each replica projection reading it keys its documents by its configured columns, which the
/// table must have. (Under USING INDEX the source keys documents by the index's columns.)
fn keyless_replica_findings(
    config: &PipelineFile,
    t: &TableInfo,
    readers: &[&(String, Box<dyn Projection>)],
    out: &mut Vec<Finding>,
) {
    if t.replica_identity != ReplicaIdentity::Full {
        return;
    }
    let name = t.qualified();
    let id = TableId::new(&t.schema, &t.name);
    for (pname, config) in readers_config(config, readers) {
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
            out.push(Finding::note(format!(
                "`{name}` has no primary key: projection `{pname}` keys its documents by \
                 ({}), which must be unique and never null",
                key.join(", ")
            )));
        } else {
            out.push(Finding::warn(format!(
                "`{name}` has no primary key and projection `{pname}` keys it by ({}), which \
                 the table does not have: refract has no key for its documents and \
                 dead-letters its changes. Add a primary key or set `key_columns`",
                key.join(", ")
            )));
        }
    }
}

/// (b) What the projections reading the table need from the old row, against what its replica
/// identity sends (`sent`).
fn old_row_findings(
    t: &TableInfo,
    sent: &[String],
    readers: &[&(String, Box<dyn Projection>)],
    out: &mut Vec<Finding>,
) {
    let name = t.qualified();
    let id = TableId::new(&t.schema, &t.name);
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
    for (pname, p) in readers {
        let missing: Vec<String> = p
            .before_image_columns(&id)
            .into_iter()
            .filter(|c| !sent.contains(c))
            .collect();
        if !missing.is_empty() {
            out.push(Finding::warn(format!(
                "projection `{pname}` needs ({}) from the old row of `{name}`, but {described}: \
                 ALTER TABLE {name} REPLICA IDENTITY FULL",
                missing.join(", ")
            )));
        }
    }
}

/// The note that an UPDATE leaving a TOASTed value unchanged does not carry it.
fn toast_note(t: &TableInfo) -> Finding {
    Finding::note(format!(
        "`{}` has REPLICA IDENTITY {}: an UPDATE that leaves a TOASTed (large, \
         out-of-line) value of ({}) unchanged does not carry it, so refract re-reads \
         it by key (one query per such update); with REPLICA IDENTITY FULL the old \
         row carries it",
        t.qualified(),
        match t.replica_identity {
            ReplicaIdentity::Index => "USING INDEX".to_owned(),
            other => other.as_str().to_uppercase(),
        },
        t.toastable.join(", ")
    ))
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
