//! The rules of each sink: some projection writes to it, its kind's own settings (one function
//! per kind), then whether its kind can hold what each of its projections writes.

use std::collections::BTreeMap;

use super::{object_store_url, postgres_url, range};
use crate::config::{
    KafkaSinkConfig, ObjectJsonSinkConfig, POSTGRES_TOMBSTONES_TABLE, ParquetSinkConfig,
    PipelineFile, PostgresSinkConfig, ProjectionConfig, RedisDeleteCommand, RedisSinkConfig,
    SinkConfig,
};

/// Checks each sink in the order of its name.
pub(super) fn validate(problem: &mut impl FnMut(&str, String), file: &PipelineFile) {
    for (name, sink) in &file.sinks {
        let base = format!("sinks.{name}");
        written(problem, &base, name, &file.projections);
        match sink {
            SinkConfig::ObjectJson(s) => object_json(problem, &base, s),
            SinkConfig::Redis(r) => redis(problem, &base, r),
            SinkConfig::Parquet(s) => parquet(problem, &base, s),
            SinkConfig::Postgres(s) => {
                postgres(problem, &base, s);
                tombstones_apart(problem, &base, name, s, &file.projections);
            }
            SinkConfig::Kafka(k) => kafka(problem, &base, k),
            SinkConfig::Tiers(t) => super::tiers::sink(problem, &base, name, t, file),
            SinkConfig::Migration(_) => {}
            SinkConfig::Null(_) => {}
        }
    }
}

/// A sink no projection names is a mistake.
fn written(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    name: &str,
    projections: &BTreeMap<String, ProjectionConfig>,
) {
    if !projections
        .values()
        .any(|p| p.sinks().iter().any(|s| s == name))
    {
        problem(
            base,
            format!("sink `{name}` is not written by any projection"),
        );
    }
}

/// `kind = "object_json"`: an object-store URL and a bounded number of writes in flight.
fn object_json(problem: &mut impl FnMut(&str, String), base: &str, s: &ObjectJsonSinkConfig) {
    object_store_url(problem, &format!("{base}.url"), &s.url);
    range(
        problem,
        &format!("{base}.concurrency"),
        s.concurrency as u64,
        1,
        1024,
    );
}

/// `kind = "redis"`: a Redis URL, bounded batching and timings, TLS options only with TLS, and
/// one way of guarding against stale writes (tombstones or a second delete).
fn redis(problem: &mut impl FnMut(&str, String), base: &str, r: &RedisSinkConfig) {
    if !(r.url.starts_with("redis://")
        || r.url.starts_with("rediss://")
        || r.url.starts_with("redis+unix://")
        || r.url.starts_with("unix://"))
    {
        problem(
            &format!("{base}.url"),
            format!(
                "`{}` is not a redis://, rediss:// or unix:// URL",
                r.url.masked()
            ),
        );
    }
    range(
        problem,
        &format!("{base}.pipeline_depth"),
        r.pipeline_depth as u64,
        1,
        10_000,
    );
    range(
        problem,
        &format!("{base}.keys_per_command"),
        r.keys_per_command as u64,
        1,
        1_000,
    );
    range(
        problem,
        &format!("{base}.second_delete_ms"),
        r.second_delete_ms,
        0,
        600_000,
    );
    range(
        problem,
        &format!("{base}.tombstone_ttl_ms"),
        r.tombstone_ttl_ms,
        1,
        86_400_000,
    );
    range(
        problem,
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
            "a second delete would remove the tombstone: use one or the other".into(),
        );
    }
    if r.cluster && (r.url.starts_with("unix://") || r.url.starts_with("redis+unix://")) {
        problem(
            &format!("{base}.cluster"),
            "a Redis Cluster is reached over TCP: give one node's redis:// or rediss:// URL".into(),
        );
    }
    if r.fallback_file.as_deref() == Some("") {
        problem(&format!("{base}.fallback_file"), "must not be empty".into());
    }
}

/// `kind = "parquet"`: an object-store URL, and compression, file sizes, buffering, compaction
/// and retention within bounds (a compaction interval of 0 turns compaction off).
fn parquet(problem: &mut impl FnMut(&str, String), base: &str, s: &ParquetSinkConfig) {
    object_store_url(problem, &format!("{base}.url"), &s.url);
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
        range(problem, &format!("{base}.{field}"), value, min, max);
    }
    if s.compact_interval_ms != 0 {
        range(
            problem,
            &format!("{base}.compact_interval_ms"),
            s.compact_interval_ms,
            1_000,
            86_400_000,
        );
    }
}

/// `kind = "postgres"`: a postgres:// URL, schema and table names usable unquoted, and a bounded
/// number of rows per statement.
fn postgres(problem: &mut impl FnMut(&str, String), base: &str, s: &PostgresSinkConfig) {
    postgres_url(problem, &format!("{base}.url"), s.url.expose());
    let ident = |v: &str| {
        !v.is_empty() && v.len() <= 63 && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
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
        problem,
        &format!("{base}.rows_per_statement"),
        s.rows_per_statement as u64,
        1,
        100_000,
    );
    range(
        problem,
        &format!("{base}.tombstone_retention_ms"),
        s.tombstone_retention_ms,
        1_000,
        MAX_TOMBSTONE_RETENTION_MS,
    );
}

/// Longest tombstone retention: 100 years, past which the interval arithmetic means nothing.
const MAX_TOMBSTONE_RETENTION_MS: u64 = 100 * 365 * 86_400_000;

/// `kind = "postgres"`: no read-model table may be the sink's tombstones table, whether the
/// `table` field names it or a collection written to the sink makes it (collections known only
/// at run time, a replica's `{table}`, are refused by the sink itself).
fn tombstones_apart(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    name: &str,
    s: &PostgresSinkConfig,
    projections: &BTreeMap<String, ProjectionConfig>,
) {
    let collections: Vec<&str> = if s.table.contains("{collection}") {
        projections
            .values()
            .filter(|p| p.sinks().iter().any(|sink| sink == name))
            .filter_map(|p| match p {
                ProjectionConfig::Document(d) => d.collection.as_deref(),
                ProjectionConfig::Replica(r) if !r.collection.contains('{') => Some(&r.collection),
                _ => None,
            })
            .collect()
    } else {
        vec![""]
    };
    if let Some(c) = collections
        .into_iter()
        .find(|c| s.table.replace("{collection}", c) == POSTGRES_TOMBSTONES_TABLE)
    {
        let by = if c.is_empty() {
            String::new()
        } else {
            format!(" for collection `{c}`")
        };
        problem(
            &format!("{base}.table"),
            format!(
                "`{}`{by} is `{POSTGRES_TOMBSTONES_TABLE}`, the table where the sink keeps its \
                 tombstones: choose another table name or collection",
                s.table
            ),
        );
    }
}

/// librdkafka settings the Kafka sink sets itself: its delivery contract (idempotent, every
/// replica acknowledges, a bounded wait) rests on them, or a field of its own says them.
const KAFKA_OWN_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "max.in.flight",
    "max.in.flight.requests.per.connection",
    "delivery.timeout.ms",
    "message.timeout.ms",
    "compression.type",
    "compression.codec",
    "transactional.id",
];

/// Whether `name` is a topic name Kafka accepts: 1 to 249 letters, digits, `.`, `_`, `-`.
pub(crate) fn kafka_topic_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 249
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// `kind = "kafka"`: brokers as `host:port` pairs, usable topic names, a bounded delivery
/// timeout, and no pass-through property that overrides what the sink sets itself.
fn kafka(problem: &mut impl FnMut(&str, String), base: &str, k: &KafkaSinkConfig) {
    let broker_ok = |b: &str| {
        b.rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
    };
    if k.brokers.trim().is_empty() || !k.brokers.split(',').map(str::trim).all(broker_ok) {
        problem(
            &format!("{base}.brokers"),
            format!(
                "`{}` must be `host:port` pairs separated by commas",
                k.brokers
            ),
        );
    }
    if !kafka_topic_name(&k.topic_prefix) {
        problem(
            &format!("{base}.topic_prefix"),
            format!(
                "`{}` must be 1 to 249 letters, digits, `.`, `_` or `-`",
                k.topic_prefix
            ),
        );
    }
    let documents = k
        .documents_topic
        .replace("{topic_prefix}", "p")
        .replace("{collection}", "c");
    if !kafka_topic_name(&documents) {
        problem(
            &format!("{base}.documents_topic"),
            format!(
                "`{}` must be letters, digits, `.`, `_`, `-`, `{{topic_prefix}}` and `{{collection}}`",
                k.documents_topic
            ),
        );
    }
    range(
        problem,
        &format!("{base}.delivery_timeout_ms"),
        k.delivery_timeout_ms,
        1_000,
        3_600_000,
    );
    for name in k.properties.keys() {
        if KAFKA_OWN_PROPERTIES.contains(&name.as_str()) {
            problem(
                &format!("{base}.properties.{name}"),
                format!("`{name}` is set by the sink itself (see docs/sinks/kafka.md)"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::load_str;

    const KAFKA: &str = r#"
[pipeline]
name = "k"
[source]
kind = "file"
path = "changes.jsonl"
[projections.changes]
kind = "relay"
tables = ["public.authors", "books"]
sinks = ["kafka"]
[sinks.kafka]
kind = "kafka"
brokers = "b1:9092, b2:9092"
topic_prefix = "shop"
properties = { "security.protocol" = "SASL_SSL" }
"#;

    /// `(path, message, line)` of each error for `text`.
    fn problems(text: &str) -> Vec<(String, String, usize)> {
        match load_str("k.toml", text, &|_| None, None) {
            Ok(_) => Vec::new(),
            Err(errors) => errors
                .0
                .into_iter()
                .map(|e| (e.path.clone(), e.message.clone(), e.line))
                .collect(),
        }
    }

    #[test]
    fn each_kafka_rule_names_its_field() {
        assert_eq!(problems(KAFKA), Vec::new());
        let cases = [
            (
                "brokers = \"b1:9092, b2:9092\"",
                "brokers = \"b1\"",
                "sinks.kafka.brokers",
                "`host:port` pairs",
                13,
            ),
            (
                "topic_prefix = \"shop\"",
                "topic_prefix = \"sh op\"",
                "sinks.kafka.topic_prefix",
                "letters, digits",
                14,
            ),
            (
                "topic_prefix = \"shop\"",
                "topic_prefix = \"shop\"\ndocuments_topic = \"{table}\"",
                "sinks.kafka.documents_topic",
                "`{topic_prefix}` and `{collection}`",
                15,
            ),
            (
                "topic_prefix = \"shop\"",
                "topic_prefix = \"shop\"\ndelivery_timeout_ms = 999",
                "sinks.kafka.delivery_timeout_ms",
                "between 1000 and 3600000",
                15,
            ),
            (
                "\"security.protocol\" = \"SASL_SSL\"",
                "\"enable.idempotence\" = \"false\"",
                "sinks.kafka.properties.enable.idempotence",
                "set by the sink itself",
                15,
            ),
            (
                "\"public.authors\", \"books\"",
                "\"a.b.c\"",
                "projections.changes.tables[0]",
                "`schema.table`",
                9,
            ),
        ];
        for (from, to, path, words, line) in cases {
            let found = problems(&KAFKA.replacen(from, to, 1));
            assert_eq!(found.len(), 1, "{to}: {found:?}");
            let (p, message, l) = &found[0];
            assert_eq!(p, path, "{message}");
            assert!(message.contains(words), "{to}: {message}");
            assert_eq!(*l, line, "{to}: {message}");
        }
    }
}
