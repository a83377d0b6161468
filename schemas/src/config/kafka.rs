//! `kind = "kafka"` source: Debezium change events read from Kafka topics by a consumer group.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Secret, SecretUrl};

/// `kind = "kafka"`: Debezium change events from Kafka topics, read by a consumer group whose
/// members share the topics' partitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSourceConfig {
    /// Bootstrap servers, `host:port[,host:port…]` (`${KAFKA_BROKERS:-127.0.0.1:9092}` in
    /// shipped files).
    pub brokers: String,
    /// Topics to read: names, or regular expressions starting with `^`
    /// (`^dbserver1\\.inventory\\..*`), as Kafka consumers subscribe to them.
    pub topics: Vec<String>,
    /// Consumer group; default `refract_{pipeline name}`. Every `refract run` of the pipeline
    /// joins it, and the group's members share the partitions.
    #[serde(default)]
    pub group_id: Option<String>,
    /// How the records are encoded.
    #[serde(default)]
    pub format: KafkaFormat,
    /// The schema registry of `format = "debezium_avro"`.
    #[serde(default)]
    pub schema_registry: Option<SchemaRegistryConfig>,
    /// Where a partition the group has no committed offset for starts: `earliest` (default)
    /// reads what the topic holds, `latest` only what arrives from now on.
    #[serde(default)]
    pub start: KafkaStart,
    /// Further librdkafka consumer settings, passed through (`"security.protocol" = "SASL_SSL"`,
    /// `"sasl.mechanism"`, `"sasl.username"`, `"sasl.password" = "${KAFKA_PASSWORD}"`,
    /// `"ssl.ca.location"`). Settings refract relies on for its guarantees (offset commits,
    /// isolation, the group) cannot be overridden here.
    #[serde(default)]
    pub properties: BTreeMap<String, Secret>,
}

/// The encoding of a Kafka source's records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KafkaFormat {
    /// Debezium's JsonConverter, with or without schemas: every shape the file source reads.
    #[default]
    DebeziumJson,
    /// Debezium's AvroConverter: Confluent framing (magic byte, schema id) and a schema registry.
    DebeziumAvro,
}

/// Where a partition without a committed offset starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KafkaStart {
    /// At the oldest record the topic holds.
    #[default]
    Earliest,
    /// At the next record produced.
    Latest,
}

/// A Confluent-compatible schema registry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SchemaRegistryConfig {
    /// Base URL (`${SCHEMA_REGISTRY_URL:-http://127.0.0.1:8081}` in shipped files).
    pub url: SecretUrl,
    /// Basic-auth user, when the registry asks for one.
    #[serde(default)]
    pub username: Option<String>,
    /// Basic-auth password (`${SCHEMA_REGISTRY_PASSWORD}`); never printed.
    #[serde(default)]
    pub password: Option<Secret>,
    /// Directory of `{schema id}.avsc` files used when the registry cannot be reached.
    #[serde(default)]
    pub fallback_dir: Option<String>,
}

/// librdkafka settings the Kafka source sets itself, because its guarantees depend on them.
pub const KAFKA_SOURCE_RESERVED: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "isolation.level",
    "auto.offset.reset",
];

impl KafkaSourceConfig {
    /// The consumer group, defaulting to `refract_{pipeline}`.
    pub fn group(&self, pipeline: &str) -> String {
        self.group_id
            .clone()
            .unwrap_or_else(|| format!("refract_{pipeline}"))
    }
}
