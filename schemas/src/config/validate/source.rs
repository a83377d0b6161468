//! The rules of the `[source]` section, one function per kind of source.

use super::{postgres_url, range};
use crate::config::{
    FileSourceConfig, KAFKA_SOURCE_RESERVED, KafkaFormat, KafkaSourceConfig, PipelineFile,
    PostgresSourceConfig, ProjectionConfig, SourceConfig,
};

/// Checks the source against its kind's rules.
pub(super) fn validate(problem: &mut impl FnMut(&str, String), source: &SourceConfig) {
    match source {
        SourceConfig::File(f) => file(problem, f),
        SourceConfig::Postgres(pg) => postgres(problem, pg),
        SourceConfig::Kafka(k) => kafka(problem, k),
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
    postgres_url(problem, "source.url", pg.url.expose());
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
    if !(1_000..=3_600_000).contains(&pg.read_timeout_ms) {
        problem(
            "source.read_timeout_ms",
            format!("{} is outside 1,000 to 3,600,000", pg.read_timeout_ms),
        );
    }
    if !(100..=86_400_000).contains(&pg.unhealthy_after_ms) {
        problem(
            "source.unhealthy_after_ms",
            format!("{} is outside 100 to 86,400,000", pg.unhealthy_after_ms),
        );
    }
}

/// `kind = "kafka"`: brokers and topics given, a group name Kafka accepts, a registry for Avro,
/// and no pass-through setting that would undo what the source's guarantees rest on.
fn kafka(problem: &mut impl FnMut(&str, String), k: &KafkaSourceConfig) {
    if k.brokers.trim().is_empty() {
        problem(
            "source.brokers",
            "must name at least one `host:port`".into(),
        );
    }
    if k.topics.is_empty() {
        problem("source.topics", "must name at least one topic".into());
    }
    for (i, t) in k.topics.iter().enumerate() {
        if t.is_empty() || (!t.starts_with('^') && t.contains([' ', ',', '/'])) {
            problem(
                &format!("source.topics[{i}]"),
                format!("`{t}` is not a topic name (or a regular expression starting with `^`)"),
            );
        }
    }
    if let Some(g) = &k.group_id {
        if g.is_empty() || g.len() > 249 {
            problem("source.group_id", "must be 1 to 249 characters".into());
        }
    }
    match (&k.format, &k.schema_registry) {
        (KafkaFormat::DebeziumAvro, None) => problem(
            "source.schema_registry",
            "`format = \"debezium_avro\"` needs a schema registry (`url`, and `fallback_dir` for offline schemas)".into(),
        ),
        (_, Some(r)) if !(r.url.starts_with("http://") || r.url.starts_with("https://")) => {
            problem(
                "source.schema_registry.url",
                format!("`{}` is not an http(s):// URL", r.url.masked()),
            )
        }
        _ => {}
    }
    for name in k.properties.keys() {
        if KAFKA_SOURCE_RESERVED.contains(&name.as_str()) {
            problem(
                &format!("source.properties.\"{name}\""),
                "is set by refract (offsets are committed only for what every sink made durable); use the source's own fields".into(),
            );
        }
    }
}

/// A document projection over a Kafka source is refused: its state joins rows of several
/// tables, which arrive on different topics and partitions. Partitions move between the
/// members of a consumer group, so no process would hold all the rows a document is built
/// from, and positions of different partitions are not ordered, so the sinks' position guard
/// could not tell an older document from a newer one.
pub(super) fn kafka_projections(problem: &mut impl FnMut(&str, String), file: &PipelineFile) {
    if !matches!(file.source, SourceConfig::Kafka(_)) {
        return;
    }
    for (name, projection) in &file.projections {
        if matches!(projection, ProjectionConfig::Document(_)) {
            problem(
                &format!("projections.{name}"),
                "a `document` projection cannot read a Kafka source: it joins rows of several topics, \
                 whose partitions are shared out between processes and whose positions are not ordered \
                 across partitions; read the primary store directly (`kind = \"postgres\"`)"
                    .into(),
            );
        }
    }
}
