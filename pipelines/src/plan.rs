//! `refract plan`: what a pipeline will read, keep and write, with secrets masked.

use std::fmt::Write as _;

use refract_schemas::config::{
    LoadedPipeline, OnError, ProjectionConfig, SinkConfig, SourceConfig, mask_url,
};

use crate::checkpoint::{CheckpointError, CheckpointStore};
use crate::runtime::{default_dead_letter_path, state_path};

/// Renders the plan of a loaded pipeline.
pub fn render(loaded: &LoadedPipeline) -> String {
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
    let db = state.join("checkpoint.redb");
    let checkpoint = if !db.exists() {
        "none yet (starts at the beginning)".to_owned()
    } else {
        match CheckpointStore::open(&db).and_then(|store| store.load()) {
            Ok(cp) if cp.is_empty() => "none yet (starts at the beginning)".to_owned(),
            Ok(cp) => cp
                .iter()
                .map(|(p, o)| format!("{p}@{o}"))
                .collect::<Vec<_>>()
                .join(", "),
            Err(CheckpointError::InUse(_)) => "held by a running refract process".to_owned(),
            Err(e) => format!("unreadable: {e}"),
        }
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
    out
}
