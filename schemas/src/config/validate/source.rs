//! The rules of the `[source]` section, one function per kind of source.

use super::{mask_url, range};
use crate::config::{FileSourceConfig, PostgresSourceConfig, SourceConfig};

/// Checks the source against its kind's rules.
pub(super) fn validate(problem: &mut impl FnMut(&str, String), source: &SourceConfig) {
    match source {
        SourceConfig::File(f) => file(problem, f),
        SourceConfig::Postgres(pg) => postgres(problem, pg),
    }
}

/// `kind = "file"`: a path, a poll interval and a number of decoding threads within bounds.
fn file(problem: &mut impl FnMut(&str, String), f: &FileSourceConfig) {
    if f.path.is_empty() {
        problem("source.path", "must not be empty".into());
    }
    range(
        problem,
        "source.poll_interval_ms",
        f.poll_interval_ms,
        10,
        60_000,
    );
    range(
        problem,
        "source.decode_threads",
        f.decode_threads as u64,
        0,
        64,
    );
}

/// `kind = "postgres"`: a postgres:// URL, slot and publication names PostgreSQL accepts, tables
/// written `schema.table`, and a snapshot chunk size within bounds.
fn postgres(problem: &mut impl FnMut(&str, String), pg: &PostgresSourceConfig) {
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
