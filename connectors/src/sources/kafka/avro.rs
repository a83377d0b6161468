//! `format = "debezium_avro"`: Confluent-framed Avro keys and values, their schemas from the
//! registry (cached by id; the registry's own fallback files when it cannot be reached).
//!
//! Runs on the consumer thread: a schema not yet cached is fetched by blocking on the registry
//! client. An unknown schema id or an unusable schema makes the message bad input; a registry
//! that cannot be reached (nor stood in for by a fallback file) is retried until it answers or
//! the pipeline stops, since every later message needs it too.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use apache_avro::Schema;
use refract_schemas::avro::{AvroDecoder, confluent_frame};
use refract_schemas::config::KafkaSourceConfig;
use refract_schemas::debezium::DecodeError;
use refract_schemas::{Record, Row};

use super::decode::{Message, ValueDecoder, table_of_topic};
use crate::SourceError;
use crate::schema_registry::{RegistryError, SchemaRegistry};

/// Wait between two rounds of attempts while the registry cannot be reached (each round
/// already retries with backoff inside the client).
const REGISTRY_RETRY: Duration = Duration::from_secs(2);

/// Debezium Avro values and keys.
pub(super) struct AvroValues {
    registry: SchemaRegistry,
    schemas: HashMap<u32, Arc<Schema>>,
    avro: AvroDecoder,
    handle: tokio::runtime::Handle,
    stop: Arc<AtomicBool>,
}

/// The Avro value decoder of a source.
pub(super) fn avro_values(
    config: &KafkaSourceConfig,
    handle: tokio::runtime::Handle,
    stop: Arc<AtomicBool>,
) -> Result<Box<dyn ValueDecoder>, SourceError> {
    let Some(r) = &config.schema_registry else {
        return Err(SourceError::Inconsistent(
            "`format = \"debezium_avro\"` needs a `schema_registry`".into(),
        ));
    };
    let registry = SchemaRegistry::new(
        &r.url,
        r.username.clone(),
        r.password.clone(),
        r.fallback_dir.as_ref().map(PathBuf::from),
    )
    .map_err(|e| SourceError::Inconsistent(e.to_string()))?;
    Ok(Box::new(AvroValues {
        registry,
        schemas: HashMap::new(),
        avro: AvroDecoder::new(),
        handle,
        stop,
    }))
}

impl AvroValues {
    /// The writer schema of a framed key or value, and its body.
    fn framed<'b>(
        &mut self,
        message: &Message<'_>,
        what: &str,
        bytes: &'b [u8],
    ) -> Result<(u32, Arc<Schema>, &'b [u8]), DecodeError> {
        let fail = |reason: String| DecodeError {
            position: message.position(),
            reason: format!("{what}: {reason}"),
        };
        let (id, body) = confluent_frame(bytes).map_err(fail)?;
        let schema = self.schema(id).map_err(|e| fail(e.to_string()))?;
        Ok((id, schema, body))
    }

    /// The schema `id`, from the cache or the registry; retried while the registry cannot be
    /// reached, unless the pipeline stops.
    fn schema(&mut self, id: u32) -> Result<Arc<Schema>, RegistryError> {
        if let Some(s) = self.schemas.get(&id) {
            return Ok(s.clone());
        }
        loop {
            match self.handle.block_on(self.registry.schema(id)) {
                Ok(schema) => {
                    self.schemas.insert(id, schema.clone());
                    return Ok(schema);
                }
                Err(
                    e @ (RegistryError::UnknownSchema(_) | RegistryError::InvalidSchema { .. }),
                ) => {
                    return Err(e);
                }
                Err(e) if self.stop.load(Ordering::Relaxed) => return Err(e),
                Err(e) => {
                    tracing::error!(error = %e, schema_id = id, "schema registry unavailable; retrying");
                    std::thread::sleep(REGISTRY_RETRY);
                }
            }
        }
    }
}

impl ValueDecoder for AvroValues {
    fn decode(&mut self, message: &Message<'_>) -> Result<Record, DecodeError> {
        let key = match message.key {
            Some(k) => Some(self.framed(message, "record key", k)?),
            None => None,
        };
        let value = self.framed(message, "value", message.value.unwrap_or_default())?;
        self.avro.decode(
            key.as_ref().map(|(id, s, b)| (*id, &**s, *b)),
            Some((value.0, &*value.1, value.2)),
            || table_of_topic(message.topic),
            message.position(),
        )
    }

    fn key(&mut self, message: &Message<'_>, key: &[u8]) -> Result<Option<Row>, DecodeError> {
        let (id, schema, body) = self.framed(message, "record key", key)?;
        let record = self.avro.decode(
            Some((id, &*schema, body)),
            None,
            || table_of_topic(message.topic),
            message.position(),
        )?;
        Ok(match record {
            Record::Change(event) => event.key.map(Arc::unwrap_or_clone),
            _ => None,
        })
    }
}
