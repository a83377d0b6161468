//! Every metric the runtime itself emits, declared in one place. Each connector declares its own
//! the same way: `RedisSinkMetrics` (`connectors/src/sinks/redis.rs`), `ParquetSinkMetrics`
//! (`connectors/src/sinks/parquet.rs`), the PostgreSQL source's `metrics` module.

/// `refract_records_read_total`: records the source handed to the runtime (changes, transaction
/// markers and undecodable input alike).
const RECORDS_READ: &str = "refract_records_read_total";
/// `refract_dead_letters_total`: inputs sent to the dead-letter store, at every stage.
const DEAD_LETTERS: &str = "refract_dead_letters_total";
/// `refract_sink_healthy{sink}`: 1 while the sink's writes succeed, 0 once a batch has kept
/// failing past the sink's `unhealthy_after`.
const SINK_HEALTHY: &str = "refract_sink_healthy";
/// `refract_source_healthy{source}`: 1 while no trouble of the source (its stream reconnecting,
/// its control checks failing) has lasted the source's `unhealthy_after_ms`, else 0 (what
/// `/health` says of it). Set at each scrape of `/metrics`, so it is never older than the scrape.
const SOURCE_HEALTHY: &str = "refract_source_healthy";

/// The processor's metrics, made once per run.
pub(crate) struct ProcessorMetrics {
    /// See [`RECORDS_READ`].
    pub(crate) records_read: metrics::Counter,
    /// See [`DEAD_LETTERS`].
    pub(crate) dead_letters: metrics::Counter,
}

impl ProcessorMetrics {
    pub(crate) fn new() -> Self {
        Self {
            records_read: metrics::counter!(RECORDS_READ),
            dead_letters: metrics::counter!(DEAD_LETTERS),
        }
    }
}

/// The health gauge of the sink `sink` (see [`SINK_HEALTHY`]).
pub(crate) fn sink_healthy(sink: &str) -> metrics::Gauge {
    metrics::gauge!(SINK_HEALTHY, "sink" => sink.to_owned())
}

/// The health gauge of the source named `source` (see [`SOURCE_HEALTHY`]).
pub(crate) fn source_healthy(source: &str) -> metrics::Gauge {
    metrics::gauge!(SOURCE_HEALTHY, "source" => source.to_owned())
}
