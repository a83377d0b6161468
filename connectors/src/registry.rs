//! The one place that turns configuration into connectors. Every source and sink kind refract
//! knows is in these `match`es.

use std::time::Duration;

use refract_schemas::config::{PipelineFile, SinkConfig, SourceConfig};
use refract_schemas::write::OpFamily;

use crate::sinks::kafka::KafkaSink;
use crate::sinks::migration::MigrationSink;
use crate::sinks::null::NullSink;
use crate::sinks::object_json::ObjectJsonSink;
use crate::sinks::parquet::ParquetSink;
use crate::sinks::postgres::PostgresSink;
use crate::sinks::redis::RedisSink;
use crate::sinks::tiers::TiersSink;
use crate::sources::file::FileSource;
use crate::sources::kafka::KafkaSource;
use crate::sources::postgres::source::PostgresSource;
use crate::{BuiltSink, DEFAULT_UNHEALTHY_AFTER, Source, SourceContext};

/// Builds the configured source (not yet started).
pub fn build_source(config: &SourceConfig, context: SourceContext) -> Box<dyn Source> {
    match config {
        SourceConfig::File(c) => Box::new(FileSource::new(c.clone())),
        SourceConfig::Postgres(c) => Box::new(PostgresSource::new(c.clone(), context)),
        SourceConfig::Kafka(c) => Box::new(KafkaSource::new(c.clone(), context)),
    }
}

/// Builds the sink `name` of `file` (not yet opened).
pub fn build_sink(file: &PipelineFile, name: &str, config: &SinkConfig) -> BuiltSink {
    let (sink, unhealthy_after): (Box<dyn crate::Sink>, _) = match config {
        SinkConfig::ObjectJson(c) => (
            Box::new(ObjectJsonSink::new(name, c.clone())),
            DEFAULT_UNHEALTHY_AFTER,
        ),
        SinkConfig::Redis(c) => (
            Box::new(RedisSink::new(name, c.clone())),
            Duration::from_millis(c.unhealthy_after_ms),
        ),
        SinkConfig::Parquet(c) => (
            Box::new(ParquetSink::new(name, c.clone())),
            DEFAULT_UNHEALTHY_AFTER,
        ),
        SinkConfig::Postgres(c) => (
            Box::new(PostgresSink::new(name, c.clone())),
            DEFAULT_UNHEALTHY_AFTER,
        ),
        SinkConfig::Kafka(c) => (
            Box::new(KafkaSink::new(name, c.clone())),
            DEFAULT_UNHEALTHY_AFTER,
        ),
        SinkConfig::Tiers(_) => (
            Box::new(TiersSink::new(name, file.tier_layout(name))),
            DEFAULT_UNHEALTHY_AFTER,
        ),
        SinkConfig::Migration(c) => (
            Box::new(MigrationSink::new(name, c.clone())),
            DEFAULT_UNHEALTHY_AFTER,
        ),
        SinkConfig::Null(_) => (Box::new(NullSink::new(name)), DEFAULT_UNHEALTHY_AFTER),
    };
    BuiltSink {
        name: name.to_owned(),
        sink,
        unhealthy_after,
    }
}

/// The families of write operations a sink of this kind accepts, as each sink declares them:
/// `refract validate` refuses a route from a projection that emits anything else.
pub fn accepts(config: &SinkConfig) -> &'static [OpFamily] {
    match config {
        SinkConfig::ObjectJson(_) => ObjectJsonSink::ACCEPTS,
        SinkConfig::Redis(_) => RedisSink::ACCEPTS,
        SinkConfig::Parquet(_) => ParquetSink::ACCEPTS,
        SinkConfig::Postgres(_) => PostgresSink::ACCEPTS,
        SinkConfig::Kafka(_) => KafkaSink::ACCEPTS,
        SinkConfig::Tiers(_) => TiersSink::ACCEPTS,
        SinkConfig::Migration(_) => MigrationSink::ACCEPTS,
        SinkConfig::Null(_) => NullSink::ACCEPTS,
    }
}
