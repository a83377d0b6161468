//! The plan's lines for a `kafka` source (with how it scales out), a `relay` projection and a
//! `kafka` sink; pass-through client properties with their secret values masked.

use std::fmt::Write as _;

use refract_schemas::config::{
    KafkaCompression, KafkaFormat, KafkaSinkConfig, KafkaSourceConfig, LoadedPipeline,
    RelayProjectionConfig, is_secret_property,
};

use super::shown;

/// A relay projection: the tables whose changes it relays.
pub(super) fn render_relay(out: &mut String, name: &str, r: &RelayProjectionConfig) {
    let tables = if r.tables.is_empty() {
        "every table".to_owned()
    } else {
        r.tables.join(", ")
    };
    let _ = writeln!(
        out,
        "projects `{name}` (relay): {tables} -> every change as it is -> sinks {}",
        r.sinks.join(", ")
    );
}

/// A kafka sink: brokers, topics, compression, delivery timeout, and the pass-through
/// properties (secret ones as `***`).
pub(super) fn render_kafka_sink(
    out: &mut String,
    loaded: &LoadedPipeline,
    name: &str,
    k: &KafkaSinkConfig,
) {
    let compression = match k.compression {
        KafkaCompression::Lz4 => "lz4",
        KafkaCompression::None => "uncompressed",
    };
    let documents = k.documents_topic.replace("{topic_prefix}", &k.topic_prefix);
    let _ = writeln!(
        out,
        "writes `{name}` (kafka): {} topics {}.{{schema}}.{{table}} (Debezium JSON, tombstones after deletes), \
         documents to {documents}; idempotent, acks=all, {compression}, delivered within {} ms",
        shown(loaded, &format!("sinks.{name}.brokers"), &k.brokers),
        k.topic_prefix,
        k.delivery_timeout_ms
    );
    for (key, value) in &k.properties {
        let path = format!("sinks.{name}.properties.{key}");
        let value = if is_secret_property(key) {
            "***".to_owned()
        } else {
            shown(loaded, &path, value.expose())
        };
        let _ = writeln!(out, "             {key} = {value}");
    }
}

#[cfg(test)]
mod tests {
    use refract_schemas::config::load_str;

    use super::*;

    #[test]
    fn secret_properties_are_masked() {
        let text = r#"
[pipeline]
name = "k"
[source]
kind = "file"
path = "/tmp/x.jsonl"
[projections.r]
kind = "relay"
sinks = ["k"]
[sinks.k]
kind = "kafka"
brokers = "b:9092"
topic_prefix = "shop"
properties = { "security.protocol" = "SASL_SSL", "sasl.username" = "refract", "sasl.password" = "hunter2", "ssl.key.password" = "swordfish", "sasl.jaas.config" = "x password=y", "ssl.ca.location" = "/ca.pem", "client.rack" = "${RACK}" }
"#;
        let env = |v: &str| (v == "RACK").then(|| "r1-secretish".to_owned());
        let loaded = load_str("k.toml", text, &env, None).unwrap();
        let mut out = String::new();
        let refract_schemas::config::SinkConfig::Kafka(k) = &loaded.config.sinks["k"] else {
            panic!("a kafka sink");
        };
        render_kafka_sink(&mut out, &loaded, "k", k);
        for secret in ["hunter2", "swordfish", "password=y"] {
            assert!(!out.contains(secret), "{secret} shown in:\n{out}");
        }
        for shown in [
            "SASL_SSL",
            "sasl.username = refract",
            "/ca.pem",
            "r1-secretish",
            "shop.{schema}.{table}",
        ] {
            assert!(out.contains(shown), "{shown} missing from:\n{out}");
        }
    }
}

/// A Kafka source: brokers, topics, group and format, the pass-through settings (secrets
/// masked), and how the pipeline scales out over the group.
pub(super) fn render_kafka_source(
    out: &mut String,
    loaded: &LoadedPipeline,
    k: &KafkaSourceConfig,
) {
    let group = k.group(&loaded.config.pipeline.name);
    let format = match (k.format, &k.schema_registry) {
        (KafkaFormat::DebeziumJson, _) => "Debezium JSON".to_owned(),
        (KafkaFormat::DebeziumAvro, Some(r)) => format!(
            "Debezium Avro, schemas from {}{}",
            shown(loaded, "source.schema_registry.url", r.url.expose()),
            r.fallback_dir
                .as_deref()
                .map(|d| format!(" (offline: {d}/{{id}}.avsc)"))
                .unwrap_or_default()
        ),
        (KafkaFormat::DebeziumAvro, None) => "Debezium Avro".to_owned(),
    };
    let _ = writeln!(
        out,
        "reads  Kafka {} topics {}, {format}, as consumer group `{group}`; offsets committed only \
         for what every sink made durable",
        shown(loaded, "source.brokers", &k.brokers),
        k.topics.join(", "),
    );
    for (name, value) in &k.properties {
        let value = if is_secret_property(name) {
            "*** (secret)".to_owned()
        } else {
            shown(loaded, &format!("source.properties.{name}"), value.expose())
        };
        let _ = writeln!(out, "  setting     {name} = {value}");
    }
    let _ = writeln!(
        out,
        "  scale-out   every `refract run` of this file joins `{group}` and the members share the \
         partitions; one key stays in one partition, so its changes reach one member, in order. \
         Projections keep no state across rows here (a `document` projection, which joins \
         topics, is refused over Kafka), so members can be added or lost at any time: a lost \
         member's partitions resume at the group's committed offsets on the others"
    );
}
