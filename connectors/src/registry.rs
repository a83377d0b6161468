//! The one place that turns configuration into connectors. Every source and sink kind refract
//! knows is in these two `match`es.

use refract_schemas::config::{SinkConfig, SourceConfig};

use crate::sinks::null::NullSink;
use crate::sinks::object_json::ObjectJsonSink;
use crate::sinks::parquet::ParquetSink;
use crate::sinks::postgres::PostgresSink;
use crate::sinks::redis::RedisSink;
use crate::sources::file::FileSource;
use crate::sources::postgres::source::PostgresSource;
use crate::{Sink, Source, SourceContext};

/// Builds the configured source (not yet started).
pub fn build_source(config: &SourceConfig, context: SourceContext) -> Box<dyn Source> {
    match config {
        SourceConfig::File(c) => Box::new(FileSource::new(c.clone())),
        SourceConfig::Postgres(c) => Box::new(PostgresSource::new(c.clone(), context)),
    }
}

/// Builds the sink `name` (not yet opened).
pub fn build_sink(name: &str, config: &SinkConfig) -> Box<dyn Sink> {
    match config {
        SinkConfig::ObjectJson(c) => Box::new(ObjectJsonSink::new(name, c.clone())),
        SinkConfig::Redis(c) => Box::new(RedisSink::new(name, c.clone())),
        SinkConfig::Parquet(c) => Box::new(ParquetSink::new(name, c.clone())),
        SinkConfig::Postgres(c) => Box::new(PostgresSink::new(name, c.clone())),
        SinkConfig::Null(_) => Box::new(NullSink::new(name)),
    }
}
