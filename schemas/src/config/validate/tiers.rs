//! The rules of `kind = "tiers"`: the projection's columns and windows, the sink's three stores,
//! and one projection per sink (the aging job and the queries read the layout they make).

use std::collections::BTreeSet;

use super::{object_store_url, postgres_url, range};
use crate::config::{
    PipelineFile, ProjectionConfig, TiersProjectionConfig, TiersSinkConfig, parse_window,
};

/// Longest warm table name: PostgreSQL names stop at 63 bytes, and partitions append
/// `_pYYYYMMDDHH` (12) and, while aging, `_aging` and a run number.
const MAX_WARM_TABLE_NAME: usize = 40;

/// Whether `name` is a plain SQL identifier (no quoting needed).
fn ident(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// `kind = "tiers"` projection: windows that parse with hot shorter than warm, plain column
/// names, no column twice, one sink.
pub(super) fn projection(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    t: &TiersProjectionConfig,
) {
    if t.table.is_empty() {
        problem(
            &format!("{base}.table"),
            "must name the heartbeat table".into(),
        );
    }
    let hot = window(problem, &format!("{base}.hot"), &t.hot);
    let warm = window(problem, &format!("{base}.warm"), &t.warm);
    if let (Some(hot), Some(warm)) = (hot, warm) {
        if hot.as_secs() < 60 {
            problem(
                &format!("{base}.hot"),
                format!("`{}` must be at least 1m", t.hot),
            );
        }
        if warm < hot + std::time::Duration::from_secs(3_600) {
            problem(
                &format!("{base}.warm"),
                format!(
                    "`{}` must be at least an hour longer than `hot` (`{}`): the warm tier is \
                     kept in hourly partitions",
                    t.warm, t.hot
                ),
            );
        }
    }
    let mut seen = BTreeSet::new();
    for (field, name) in [
        ("device", &t.device),
        ("time", &t.time),
        ("region", &t.region),
    ] {
        if !ident(name) {
            problem(
                &format!("{base}.{field}"),
                format!("`{name}` must be lower-case letters, digits and `_`"),
            );
        }
        seen.insert(name.as_str());
    }
    if t.columns.is_empty() {
        problem(
            &format!("{base}.columns"),
            "must declare at least one measurement column".into(),
        );
    }
    for (i, c) in t.columns.iter().enumerate() {
        let path = format!("{base}.columns[{i}].name");
        if !ident(&c.name) {
            problem(
                &path,
                format!("`{}` must be lower-case letters, digits and `_`", c.name),
            );
        }
        if !seen.insert(c.name.as_str()) {
            problem(&path, format!("`{}` is declared twice", c.name));
        }
    }
    if t.sinks.len() != 1 {
        problem(
            &format!("{base}.sinks"),
            "must name exactly one sink (of kind `tiers`)".into(),
        );
    }
}

fn window(
    problem: &mut impl FnMut(&str, String),
    path: &str,
    text: &str,
) -> Option<std::time::Duration> {
    parse_window(text).map_err(|e| problem(path, e)).ok()
}

/// `kind = "tiers"` sink: a Redis URL, a PostgreSQL URL and table, an object-store URL, bounded
/// partitions ahead, and exactly one tiers projection writing to it.
pub(super) fn sink(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    name: &str,
    s: &TiersSinkConfig,
    file: &PipelineFile,
) {
    let redis = ["redis://", "rediss://", "unix://", "redis+unix://"];
    if !redis.iter().any(|p| s.hot.url.starts_with(p)) {
        problem(
            &format!("{base}.hot.url"),
            format!(
                "`{}` is not a redis:// or rediss:// URL",
                s.hot.url.masked()
            ),
        );
    }
    if s.hot.key_prefix.is_empty() || s.hot.key_prefix.contains(char::is_whitespace) {
        problem(
            &format!("{base}.hot.key_prefix"),
            format!("`{}` must be non-empty without spaces", s.hot.key_prefix),
        );
    }
    postgres_url(problem, &format!("{base}.warm.url"), s.warm.url.expose());
    let (schema, table) = s
        .warm
        .table
        .split_once('.')
        .unwrap_or(("public", &s.warm.table));
    if !ident(schema) || !ident(table) || table.len() > MAX_WARM_TABLE_NAME {
        problem(
            &format!("{base}.warm.table"),
            format!(
                "`{}` must be `table` or `schema.table` of lower-case letters, digits and `_`, \
                 the table at most {MAX_WARM_TABLE_NAME} long (its partitions add a suffix)",
                s.warm.table
            ),
        );
    }
    range(
        problem,
        &format!("{base}.warm.partitions_ahead"),
        u64::from(s.warm.partitions_ahead),
        1,
        168,
    );
    object_store_url(problem, &format!("{base}.cold.url"), &s.cold.url);
    if s.aging_interval_ms != 0 {
        range(
            problem,
            &format!("{base}.aging_interval_ms"),
            s.aging_interval_ms,
            1_000,
            86_400_000,
        );
    }
    let writers: Vec<&String> = file
        .projections
        .iter()
        .filter(|(_, p)| p.sinks().iter().any(|s| s == name))
        .map(|(n, _)| n)
        .collect();
    let tiers = file
        .projections
        .iter()
        .filter(|(n, p)| writers.contains(n) && matches!(p, ProjectionConfig::Tiers(_)))
        .count();
    if !writers.is_empty() && (tiers != 1 || writers.len() != 1) {
        problem(
            base,
            format!(
                "sink `{name}` must be written by exactly one projection of kind `tiers` (it is \
                 written by {})",
                writers
                    .iter()
                    .map(|w| format!("`{w}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
}
