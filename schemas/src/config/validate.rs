//! Every semantic rule of pipeline files, in one place. Each problem names the field path and the
//! broken rule; the loader turns the path into a line.

use std::collections::BTreeSet;

use super::{
    FlattenProjectionConfig, PipelineFile, ProjectionConfig, RedisDeleteCommand, SinkConfig,
    SourceConfig,
};
use crate::field_path::{FieldPath, Step};
use crate::template::KeyTemplate;

mod document;

/// Object-store URL schemes refract can write to.
const OBJECT_STORE_SCHEMES: &[&str] = &[
    "file", "memory", "s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https",
];

impl PipelineFile {
    /// Checks the rules serde cannot express; returns `(field path, problem)` pairs.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        let mut problem = |path: &str, message: String| problems.push((path.to_owned(), message));
        let p = &self.pipeline;

        if p.name.is_empty()
            || !p
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            problem(
                "pipeline.name",
                format!("`{}` must be non-empty letters, digits, `-` or `_`", p.name),
            );
        }
        if p.state_dir.is_empty() {
            problem("pipeline.state_dir", "must not be empty".into());
        }
        range(
            &mut problem,
            "pipeline.batch.max_events",
            p.batch.max_events as u64,
            1,
            1_000_000,
        );
        range(
            &mut problem,
            "pipeline.batch.max_bytes",
            p.batch.max_bytes,
            1024,
            1 << 30,
        );
        range(
            &mut problem,
            "pipeline.batch.max_delay_ms",
            p.batch.max_delay_ms,
            0,
            60_000,
        );
        range(
            &mut problem,
            "pipeline.queue_depth",
            p.queue_depth as u64,
            1,
            64,
        );
        if let Some(addr) = &p.metrics_addr {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                problem(
                    "pipeline.metrics_addr",
                    format!("`{addr}` is not an IP address and port (like `127.0.0.1:9464`)"),
                );
            }
        }
        match (&p.dead_letter.path, &p.dead_letter.url) {
            (Some(_), Some(_)) => problem(
                "pipeline.dead_letter",
                "set `path` or `url`, not both".into(),
            ),
            (_, Some(url)) => object_store_url(&mut problem, "pipeline.dead_letter.url", url),
            (Some(path), None) if path.is_empty() => {
                problem("pipeline.dead_letter.path", "must not be empty".into())
            }
            _ => {}
        }

        match &self.source {
            SourceConfig::File(f) => {
                if f.path.is_empty() {
                    problem("source.path", "must not be empty".into());
                }
                range(
                    &mut problem,
                    "source.poll_interval_ms",
                    f.poll_interval_ms,
                    10,
                    60_000,
                );
                range(
                    &mut problem,
                    "source.decode_threads",
                    f.decode_threads as u64,
                    0,
                    64,
                );
            }
            SourceConfig::Postgres(pg) => {
                if !(pg.url.starts_with("postgres://") || pg.url.starts_with("postgresql://")) {
                    problem(
                        "source.url",
                        format!("`{}` is not a postgres:// URL", mask_url(&pg.url)),
                    );
                }
                for (field, name) in [
                    ("source.slot", &pg.slot),
                    ("source.publication", &pg.publication),
                ] {
                    if let Some(n) = name {
                        if n.is_empty()
                            || n.len() > 63
                            || !n
                                .chars()
                                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                        {
                            problem(
                                field,
                                format!("`{n}` must be 1 to 63 lower-case letters, digits or `_`"),
                            );
                        }
                    }
                }
                for (i, t) in pg.tables.iter().enumerate() {
                    if t.split('.').count() != 2 || t.contains(['"', ';', ' ']) {
                        problem(
                            &format!("source.tables[{i}]"),
                            format!("`{t}` must be written `schema.table` or `schema.*`"),
                        );
                    }
                }
                if !(100..=100_000).contains(&pg.chunk_rows) {
                    problem(
                        "source.chunk_rows",
                        format!("{} is outside 100 to 100,000", pg.chunk_rows),
                    );
                }
            }
        }

        if self.projections.is_empty() {
            problem(
                "projections",
                "a pipeline needs at least one projection".into(),
            );
        }
        for (name, projection) in &self.projections {
            let base = format!("projections.{name}");
            if projection.sinks().is_empty() {
                problem(
                    &format!("{base}.sinks"),
                    "must name at least one sink".into(),
                );
            }
            for (i, sink) in projection.sinks().iter().enumerate() {
                if !self.sinks.contains_key(sink) {
                    let known: Vec<&str> = self.sinks.keys().map(String::as_str).collect();
                    problem(
                        &format!("{base}.sinks[{i}]"),
                        format!("no sink named `{sink}` (sinks: {})", known.join(", ")),
                    );
                }
            }
            match projection {
                ProjectionConfig::Replica(r) => {
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
                ProjectionConfig::Document(d) => document::validate(&mut problem, &base, d),
                ProjectionConfig::Flatten(f) => {
                    flatten(&mut problem, &base, f);
                    for (i, sink) in f.sinks.iter().enumerate() {
                        if let Some(s) = self.sinks.get(sink) {
                            if !matches!(s, SinkConfig::Parquet(_) | SinkConfig::Null(_)) {
                                problem(
                                    &format!("{base}.sinks[{i}]"),
                                    format!(
                                        "sink `{sink}` cannot hold flat rows (use a `parquet` or `null` sink)"
                                    ),
                                );
                            }
                        }
                    }
                }
                ProjectionConfig::CacheInvalidation(c) => {
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
                    for (i, sink) in c.sinks.iter().enumerate() {
                        match self.sinks.get(sink) {
                            Some(SinkConfig::Redis(r)) => {
                                if r.command == RedisDeleteCommand::Tombstone {
                                    if let Some((table, _)) =
                                        c.tables.iter().find(|(_, t)| t.version_column.is_none())
                                    {
                                        problem(
                                            &format!("{base}.tables.{table}.version_column"),
                                            format!(
                                                "sink `{sink}` writes tombstones, which need the row's version: \
                                                 name a version column"
                                            ),
                                        );
                                    }
                                }
                            }
                            Some(SinkConfig::Null(_)) | None => {}
                            Some(_) => problem(
                                &format!("{base}.sinks[{i}]"),
                                format!(
                                    "sink `{sink}` cannot apply cache invalidations (use a `redis` or `null` sink)"
                                ),
                            ),
                        }
                    }
                }
            }
        }

        for (name, sink) in &self.sinks {
            let base = format!("sinks.{name}");
            if !self.projections.values().any(|p| p.sinks().contains(name)) {
                problem(
                    &base,
                    format!("sink `{name}` is not written by any projection"),
                );
            }
            match sink {
                SinkConfig::ObjectJson(s) => {
                    object_store_url(&mut problem, &format!("{base}.url"), &s.url);
                    range(
                        &mut problem,
                        &format!("{base}.concurrency"),
                        s.concurrency as u64,
                        1,
                        1024,
                    );
                }
                SinkConfig::Redis(r) => {
                    if !(r.url.starts_with("redis://")
                        || r.url.starts_with("rediss://")
                        || r.url.starts_with("redis+unix://")
                        || r.url.starts_with("unix://"))
                    {
                        problem(
                            &format!("{base}.url"),
                            format!(
                                "`{}` is not a redis://, rediss:// or unix:// URL",
                                mask_url(&r.url)
                            ),
                        );
                    }
                    range(
                        &mut problem,
                        &format!("{base}.pipeline_depth"),
                        r.pipeline_depth as u64,
                        1,
                        10_000,
                    );
                    range(
                        &mut problem,
                        &format!("{base}.keys_per_command"),
                        r.keys_per_command as u64,
                        1,
                        1_000,
                    );
                    range(
                        &mut problem,
                        &format!("{base}.second_delete_ms"),
                        r.second_delete_ms,
                        0,
                        600_000,
                    );
                    range(
                        &mut problem,
                        &format!("{base}.tombstone_ttl_ms"),
                        r.tombstone_ttl_ms,
                        1,
                        86_400_000,
                    );
                    range(
                        &mut problem,
                        &format!("{base}.unhealthy_after_ms"),
                        r.unhealthy_after_ms,
                        100,
                        86_400_000,
                    );
                    if r.tls_ca_file.is_some() && !r.url.starts_with("rediss://") {
                        problem(
                            &format!("{base}.tls_ca_file"),
                            "only applies to a rediss:// (TLS) URL".into(),
                        );
                    }
                    if r.command == RedisDeleteCommand::Tombstone && r.second_delete_ms > 0 {
                        problem(
                            &format!("{base}.second_delete_ms"),
                            "a second delete would remove the tombstone: use one or the other"
                                .into(),
                        );
                    }
                    if r.fallback_file.as_deref() == Some("") {
                        problem(&format!("{base}.fallback_file"), "must not be empty".into());
                    }
                }
                SinkConfig::Parquet(s) => {
                    object_store_url(&mut problem, &format!("{base}.url"), &s.url);
                    let limits: [(&str, u64, u64, u64); 7] = [
                        ("zstd_level", s.zstd_level.max(0) as u64, 1, 22),
                        ("row_group_rows", s.row_group_rows as u64, 1_000, 10_000_000),
                        ("roll_rows", s.roll_rows as u64, 1, 100_000_000),
                        ("roll_bytes", s.roll_bytes, 1 << 20, 4 << 30),
                        ("roll_ms", s.roll_ms, 100, 3_600_000),
                        ("buffer_bytes", s.buffer_bytes, 16 << 20, 64 << 30),
                        (
                            "change_retention_days",
                            u64::from(s.change_retention_days),
                            0,
                            36_500,
                        ),
                    ];
                    for (field, value, min, max) in limits {
                        range(&mut problem, &format!("{base}.{field}"), value, min, max);
                    }
                    if s.compact_interval_ms != 0 {
                        range(
                            &mut problem,
                            &format!("{base}.compact_interval_ms"),
                            s.compact_interval_ms,
                            1_000,
                            86_400_000,
                        );
                    }
                    for (projection, p) in &self.projections {
                        if p.sinks().contains(name) && !matches!(p, ProjectionConfig::Flatten(_)) {
                            problem(
                                &base,
                                format!(
                                    "projection `{projection}` writes documents, which a `parquet` sink cannot hold: \
                                     feed it from a `flatten` projection"
                                ),
                            );
                        }
                    }
                }
                SinkConfig::Postgres(s) => {
                    if !(s.url.starts_with("postgres://") || s.url.starts_with("postgresql://")) {
                        problem(
                            &format!("{base}.url"),
                            format!("`{}` is not a postgres:// URL", mask_url(&s.url)),
                        );
                    }
                    let ident = |v: &str| {
                        !v.is_empty()
                            && v.len() <= 63
                            && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    };
                    if !ident(&s.schema) {
                        problem(
                            &format!("{base}.schema"),
                            format!("`{}` must be 1 to 63 letters, digits or `_`", s.schema),
                        );
                    }
                    if !ident(&s.table.replace("{collection}", "c")) {
                        problem(
                            &format!("{base}.table"),
                            format!(
                                "`{}` must be letters, digits, `_` and `{{collection}}`",
                                s.table
                            ),
                        );
                    }
                    range(
                        &mut problem,
                        &format!("{base}.rows_per_statement"),
                        s.rows_per_statement as u64,
                        1,
                        100_000,
                    );
                    for (projection, p) in &self.projections {
                        if p.sinks().contains(name)
                            && !matches!(
                                p,
                                ProjectionConfig::Replica(_) | ProjectionConfig::Document(_)
                            )
                        {
                            problem(
                                &base,
                                format!(
                                    "projection `{projection}` does not write documents, which is all a `postgres` sink holds"
                                ),
                            );
                        }
                    }
                }
                SinkConfig::Null(_) => {}
            }
        }
        problems
    }
}

fn range(problem: &mut impl FnMut(&str, String), path: &str, value: u64, min: u64, max: u64) {
    if value < min || value > max {
        problem(
            path,
            format!("must be between {min} and {max}, found {value}"),
        );
    }
}

fn object_store_url(problem: &mut impl FnMut(&str, String), path: &str, url: &str) {
    let Some((scheme, rest)) = url.split_once("://") else {
        problem(
            path,
            format!(
                "`{}` is not a URL (expected `file:///abs/dir`, `s3://bucket/prefix`, ...)",
                mask_url(url)
            ),
        );
        return;
    };
    if !OBJECT_STORE_SCHEMES.contains(&scheme) {
        problem(
            path,
            format!(
                "unsupported scheme `{scheme}` (supported: {})",
                OBJECT_STORE_SCHEMES.join(", ")
            ),
        );
    } else if scheme == "file" && !rest.starts_with('/') {
        problem(
            path,
            format!(
                "`{}` must be an absolute file URL (`file:///abs/dir`)",
                mask_url(url)
            ),
        );
    }
}

/// Hides the password of a URL's user-info (`scheme://user:secret@host` → `scheme://user:***@host`).
pub fn mask_url(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else {
        return value.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return value.to_owned();
    };
    let userinfo = &authority[..at];
    let masked = match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        // A lone user name is not a secret, except where the scheme puts a token there.
        None if scheme.starts_with("postgres") || scheme.starts_with("mysql") => {
            return value.to_owned();
        }
        None => "***".to_owned(),
    };
    format!("{scheme}://{masked}{}", &rest[at..])
}

#[cfg(test)]
mod tests;

/// The rules of a `flatten` projection.
fn flatten(problem: &mut impl FnMut(&str, String), base: &str, f: &FlattenProjectionConfig) {
    if f.table.is_empty() {
        problem(
            &format!("{base}.table"),
            "must name the source table".into(),
        );
    }
    if f.outputs.is_empty() {
        problem(
            &format!("{base}.outputs"),
            "must declare at least one table".into(),
        );
    }
    range(
        &mut *problem,
        &format!("{base}.max_columns"),
        f.max_columns as u64,
        1,
        10_000,
    );
    let mut names = BTreeSet::new();
    let parse = |problem: &mut dyn FnMut(&str, String), at: &str, text: &str| match FieldPath::parse(
        text,
    ) {
        Ok(p) => Some(p),
        Err(e) => {
            problem(at, e);
            None
        }
    };
    for (t, out) in f.outputs.iter().enumerate() {
        let at = format!("{base}.outputs[{t}]");
        if out.name.is_empty() || out.name.contains(['/', '\\']) || out.name.starts_with(['.', '_'])
        {
            problem(
                &format!("{at}.name"),
                format!(
                    "`{}` must be non-empty, contain no `/` and not start with `.` or `_`",
                    out.name
                ),
            );
        } else if !names.insert(out.name.as_str()) {
            problem(
                &format!("{at}.name"),
                format!("table `{}` is declared twice", out.name),
            );
        }
        let explode = out.explode.as_deref().and_then(|e| {
            let path = parse(&mut *problem, &format!("{at}.explode"), e)?;
            if path.has_each() {
                problem(
                    &format!("{at}.explode"),
                    format!("`{e}` must name one array, without `[]`"),
                );
                return None;
            }
            Some(path)
        });
        let element = explode.as_ref().map(|p| {
            let mut element = p.clone();
            element.steps.push(Step::Each);
            element
        });
        if out.columns.is_empty() {
            problem(
                &format!("{at}.columns"),
                "must declare at least one column".into(),
            );
        }
        if out.columns.len() > f.max_columns {
            problem(
                &format!("{at}.columns"),
                format!(
                    "{} columns exceed max_columns = {}",
                    out.columns.len(),
                    f.max_columns
                ),
            );
        }
        let mut columns = BTreeSet::new();
        let mut parent_key = false;
        for (c, col) in out.columns.iter().enumerate() {
            let cat = format!("{at}.columns[{c}]");
            if col.name.is_empty() || col.name.starts_with('_') {
                problem(
                    &format!("{cat}.name"),
                    format!(
                        "`{}` must be non-empty and not start with `_` (refract's own columns do)",
                        col.name
                    ),
                );
            } else if !columns.insert(col.name.as_str()) {
                problem(
                    &format!("{cat}.name"),
                    format!("column `{}` is declared twice", col.name),
                );
            }
            let sources = usize::from(col.path.is_some())
                + usize::from(col.count.is_some())
                + usize::from(col.line_no);
            if sources != 1 {
                problem(
                    &cat,
                    "must have exactly one of `path`, `count` or `line_no = true`".into(),
                );
            }
            if col.line_no && explode.is_none() {
                problem(
                    &format!("{cat}.line_no"),
                    "only applies to a table with `explode`".into(),
                );
            }
            let mut outside = col.count.is_some();
            if let Some(text) = &col.path {
                if let Some(path) = parse(&mut *problem, &format!("{cat}.path"), text) {
                    outside = element.as_ref().is_none_or(|e| !path.starts_with(e));
                }
            }
            if let Some(text) = &col.count {
                parse(&mut *problem, &format!("{cat}.count"), text);
            }
            if outside && out.key.contains(&col.name) {
                parent_key = true;
            }
        }
        if out.key.is_empty() {
            problem(&format!("{at}.key"), "must name at least one column".into());
        }
        for (k, key) in out.key.iter().enumerate() {
            if !columns.contains(key.as_str()) {
                problem(
                    &format!("{at}.key[{k}]"),
                    format!("`{key}` is not one of the table's columns"),
                );
            }
        }
        if explode.is_some() && !parent_key {
            problem(
                &format!("{at}.key"),
                "an exploded table's key must include a column taken from outside the array (the parent's key)".into(),
            );
        }
        if let Some(u) = &out.unmapped {
            parse(&mut *problem, &format!("{at}.unmapped.under"), &u.under);
            for (e, text) in u.exclude.iter().enumerate() {
                parse(&mut *problem, &format!("{at}.unmapped.exclude[{e}]"), text);
            }
            if u.separator.is_empty() {
                problem(
                    &format!("{at}.unmapped.separator"),
                    "must not be empty".into(),
                );
            }
            if u.column.is_empty() {
                problem(&format!("{at}.unmapped.column"), "must not be empty".into());
            } else if u.mode == super::UnmappedMode::Json && columns.contains(u.column.as_str()) {
                problem(
                    &format!("{at}.unmapped.column"),
                    format!("`{}` is already a declared column", u.column),
                );
            }
        }
    }
}
