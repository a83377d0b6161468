//! `format = "debezium_avro"`: Confluent-framed Avro values and keys, schemas from the registry.

use refract_schemas::config::KafkaSourceConfig;

use super::decode::ValueDecoder;
use crate::SourceError;

/// The Avro value decoder of a source.
pub(super) fn avro_values(
    _config: &KafkaSourceConfig,
) -> Result<Box<dyn ValueDecoder>, SourceError> {
    Err(SourceError::Inconsistent("TODO avro".into()))
}
