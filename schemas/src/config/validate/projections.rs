//! The rules of each projection: the sinks it names, its kind's own rules (`replica` and
//! `cache_invalidation` here, `document` and `flatten` in their own files), then its routes to
//! those sinks.

use std::collections::BTreeMap;

use super::{document, flatten};
use crate::config::{
    CacheInvalidationProjectionConfig, PipelineFile, ProjectionConfig, RedisDeleteCommand,
    RedisSinkConfig, ReplicaProjectionConfig, SinkConfig,
};
use crate::template::KeyTemplate;

/// Checks that there is a projection, then each projection in the order of its name.
pub(super) fn validate(problem: &mut impl FnMut(&str, String), file: &PipelineFile) {
    if file.projections.is_empty() {
        problem(
            "projections",
            "a pipeline needs at least one projection".into(),
        );
    }
    for (name, projection) in &file.projections {
        let base = format!("projections.{name}");
        sink_names(problem, &base, projection, &file.sinks);
        match projection {
            ProjectionConfig::Replica(r) => replica(problem, &base, r),
            ProjectionConfig::Document(d) => document::validate(problem, &base, d),
            ProjectionConfig::Flatten(f) => flatten::validate(problem, &base, f),
            ProjectionConfig::CacheInvalidation(c) => cache_invalidation(problem, &base, c),
            ProjectionConfig::Relay(r) => table_patterns(problem, &base, &r.tables),
            ProjectionConfig::Tiers(t) => super::tiers::projection(problem, &base, t),
            ProjectionConfig::Migration(m) => {
                for (path, message) in m.migration.validate() {
                    problem(&format!("{base}.migration.{path}"), message);
                }
            }
        }
        routes(problem, projection, &base, &file.sinks);
    }
}

/// `projections.NAME.sinks`: at least one, each a declared sink.
fn sink_names(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    projection: &ProjectionConfig,
    sinks: &BTreeMap<String, SinkConfig>,
) {
    if projection.sinks().is_empty() {
        problem(
            &format!("{base}.sinks"),
            "must name at least one sink".into(),
        );
    }
    for (i, sink) in projection.sinks().iter().enumerate() {
        if !sinks.contains_key(sink) {
            let known: Vec<&str> = sinks.keys().map(String::as_str).collect();
            problem(
                &format!("{base}.sinks[{i}]"),
                format!("no sink named `{sink}` (sinks: {})", known.join(", ")),
            );
        }
    }
}

/// `kind = "replica"`: a default key, a key for each table listed, a collection usable as a path.
fn replica(problem: &mut impl FnMut(&str, String), base: &str, r: &ReplicaProjectionConfig) {
    if r.default_key.is_empty() {
        problem(
            &format!("{base}.default_key"),
            "must name at least one column".into(),
        );
    }
    for (table, cols) in &r.key_columns {
        if cols.is_empty() {
            problem(
                &format!("{base}.key_columns.{table}"),
                "must name at least one column".into(),
            );
        }
    }
    if r.collection.is_empty() || r.collection.contains('/') {
        problem(
            &format!("{base}.collection"),
            format!("`{}` must be non-empty and contain no `/`", r.collection),
        );
    }
}

/// `kind = "relay"`: each table pattern is `table` or `schema.table`.
fn table_patterns(problem: &mut impl FnMut(&str, String), base: &str, tables: &[String]) {
    for (i, table) in tables.iter().enumerate() {
        let parts: Vec<&str> = table.split('.').collect();
        if parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
            problem(
                &format!("{base}.tables[{i}]"),
                format!("`{table}` must be `table` or `schema.table`"),
            );
        }
    }
}

/// `kind = "cache_invalidation"`: at least one table, each with key templates that parse.
fn cache_invalidation(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    c: &CacheInvalidationProjectionConfig,
) {
    if c.tables.is_empty() {
        problem(
            &format!("{base}.tables"),
            "must name at least one table and its keys".into(),
        );
    }
    for (table, t) in &c.tables {
        let at = format!("{base}.tables.{table}");
        if t.keys.is_empty() {
            problem(&format!("{at}.keys"), "must list at least one key".into());
        }
        for (i, key) in t.keys.iter().enumerate() {
            if let Err(e) = KeyTemplate::parse(key) {
                problem(&format!("{at}.keys[{i}]"), e);
            }
        }
        if t.version_column.as_deref() == Some("") {
            problem(&format!("{at}.version_column"), "must not be empty".into());
        }
    }
}

/// Each route from the projection to a declared sink, in the order of its `sinks`: what the
/// sink's settings ask of the projection. Whether the sink's kind can take what the projection
/// writes is checked from the kinds' declarations ([`super::routes`]).
fn routes(
    problem: &mut impl FnMut(&str, String),
    projection: &ProjectionConfig,
    base: &str,
    sinks: &BTreeMap<String, SinkConfig>,
) {
    for sink_name in projection.sinks() {
        let Some(sink) = sinks.get(sink_name) else {
            continue;
        };
        if let (ProjectionConfig::CacheInvalidation(c), SinkConfig::Redis(r)) = (projection, sink) {
            tombstones_need_versions(problem, base, c, sink_name, r);
        }
    }
}

/// A `redis` sink that writes tombstones stores the row's version with each: every table the
/// `cache_invalidation` projection invalidates must name its version column (the first table
/// without one is reported).
fn tombstones_need_versions(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    c: &CacheInvalidationProjectionConfig,
    sink_name: &str,
    r: &RedisSinkConfig,
) {
    if r.command == RedisDeleteCommand::Tombstone {
        if let Some((table, _)) = c.tables.iter().find(|(_, t)| t.version_column.is_none()) {
            problem(
                &format!("{base}.tables.{table}.version_column"),
                format!(
                    "sink `{sink_name}` writes tombstones, which need the row's version: \
                     name a version column"
                ),
            );
        }
    }
}
