//! Every metric the runtime itself emits, declared in one place. Each connector declares its own
//! the same way: `RedisSinkMetrics` (`connectors/src/sinks/redis.rs`), `ParquetSinkMetrics`
//! (`connectors/src/sinks/parquet.rs`), the PostgreSQL source's `metrics` module.
//!
//! The runtime's delivery loop sees every sink's batches, so what is common to all sinks
//! (events and batches written, write latency, retries, queue depth) is counted here once, not
//! in each connector. The status page (`/` of `metrics_addr`) reads these same series back from
//! the recorder (see `super::history`).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`RECORDS_READ`] | counter | |
//! | [`DEAD_LETTERS`] | counter | `stage` |
//! | [`SINK_HEALTHY`] | gauge | `sink` |
//! | [`SOURCE_HEALTHY`] | gauge | `source` |
//! | [`SINK_EVENTS`] | counter | `sink` |
//! | [`SINK_BATCHES`] | counter | `sink` |
//! | [`SINK_WRITE_SECONDS`] | histogram | `sink` |
//! | [`SINK_RETRIES`] | counter | `sink` |
//! | [`SINK_QUEUE_DEPTH`] | gauge | `sink` |
//! | [`SOURCE_LAG_SECONDS`] | gauge | |
//! | [`CHECKPOINT_OFFSET`] | gauge | `partition` |

use refract_connectors::dead_letter::Stage;

/// `refract_records_read_total`: records the source handed to the runtime (changes, transaction
/// markers and undecodable input alike).
pub(crate) const RECORDS_READ: &str = "refract_records_read_total";
/// `refract_dead_letters_total{stage}`: inputs sent to the dead-letter store, by the stage that
/// rejected them (`decode`, `routing`, `projection`, `sink`).
pub(crate) const DEAD_LETTERS: &str = "refract_dead_letters_total";
/// `refract_sink_healthy{sink}`: 1 while the sink's writes succeed, 0 once a batch has kept
/// failing past the sink's `unhealthy_after`.
const SINK_HEALTHY: &str = "refract_sink_healthy";
/// `refract_source_healthy{source}`: 1 while no trouble of the source (its stream reconnecting,
/// its control checks failing) has lasted the source's `unhealthy_after_ms`, else 0 (what
/// `/health` says of it). Set at each scrape of `/metrics`, so it is never older than the scrape.
const SOURCE_HEALTHY: &str = "refract_source_healthy";
/// `refract_sink_events_written_total{sink}`: write operations (dead letters, for the
/// dead-letter store `dead_letter`) in the batches the sink acknowledged durable.
pub(crate) const SINK_EVENTS: &str = "refract_sink_events_written_total";
/// `refract_sink_batches_written_total{sink}`: batches the sink acknowledged durable.
pub(crate) const SINK_BATCHES: &str = "refract_sink_batches_written_total";
/// `refract_sink_batch_write_seconds{sink}`: from a batch's first write attempt to its
/// success, retries included (what the checkpoint waited for that sink).
pub(crate) const SINK_WRITE_SECONDS: &str = "refract_sink_batch_write_seconds";
/// `refract_sink_retries_total{sink}`: failed attempts (open, write, flush) that were retried.
pub(crate) const SINK_RETRIES: &str = "refract_sink_retries_total";
/// `refract_sink_queue_depth{sink}`: batches waiting in the sink's queue (at most
/// `queue_depth`; at the bound the source pauses).
pub(crate) const SINK_QUEUE_DEPTH: &str = "refract_sink_queue_depth";
/// `refract_source_lag_seconds`: age (from its source commit time) of the oldest change read
/// but not yet durable in every sink; 0 when everything read is durable. Set at each scrape.
pub(crate) const SOURCE_LAG_SECONDS: &str = "refract_source_lag_seconds";
/// `refract_checkpoint_offset{partition}`: the durable checkpoint's offset in each source
/// partition (PostgreSQL: the commit LSN as a number; Kafka: the record offset). Exact up to
/// 2^53, far beyond any LSN or offset a server reaches.
pub(crate) const CHECKPOINT_OFFSET: &str = "refract_checkpoint_offset";

/// Bucket bounds of [`SINK_WRITE_SECONDS`] (seconds): from a pipelined Redis batch (~1 ms) to a
/// batch held by retries through an outage (minutes).
pub(crate) const WRITE_SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The processor's metrics, made once per run.
pub(crate) struct ProcessorMetrics {
    /// See [`RECORDS_READ`].
    pub(crate) records_read: metrics::Counter,
    /// [`SINK_QUEUE_DEPTH`] of each target, in target order (sinks, then the dead-letter store).
    pub(crate) queue_depth: Vec<metrics::Gauge>,
}

impl ProcessorMetrics {
    /// The handles for a run whose targets are `targets`, in order.
    pub(crate) fn new(targets: &[String]) -> Self {
        Self {
            records_read: metrics::counter!(RECORDS_READ),
            queue_depth: targets.iter().map(|t| sink_queue_depth(t)).collect(),
        }
    }
}

/// [`DEAD_LETTERS`] of `stage`.
pub(crate) fn dead_letters(stage: Stage) -> metrics::Counter {
    metrics::counter!(DEAD_LETTERS, "stage" => stage_name(stage))
}

/// The label value of `stage` (as the dead-letter store writes it).
pub(crate) fn stage_name(stage: Stage) -> &'static str {
    match stage {
        Stage::Decode => "decode",
        Stage::Projection => "projection",
        Stage::Routing => "routing",
        Stage::Sink => "sink",
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

/// [`SINK_QUEUE_DEPTH`] of `sink`.
pub(crate) fn sink_queue_depth(sink: &str) -> metrics::Gauge {
    metrics::gauge!(SINK_QUEUE_DEPTH, "sink" => sink.to_owned())
}

/// [`SOURCE_LAG_SECONDS`].
pub(crate) fn source_lag_seconds() -> metrics::Gauge {
    metrics::gauge!(SOURCE_LAG_SECONDS)
}

/// [`CHECKPOINT_OFFSET`] of `partition`.
pub(crate) fn checkpoint_offset(partition: &str) -> metrics::Gauge {
    metrics::gauge!(CHECKPOINT_OFFSET, "partition" => partition.to_owned())
}

/// What one delivery task counts for its target, made once per task.
pub(crate) struct SinkMetrics {
    /// See [`SINK_EVENTS`].
    pub(crate) events: metrics::Counter,
    /// See [`SINK_BATCHES`].
    pub(crate) batches: metrics::Counter,
    /// See [`SINK_WRITE_SECONDS`].
    pub(crate) write_seconds: metrics::Histogram,
    /// See [`SINK_RETRIES`].
    pub(crate) retries: metrics::Counter,
    /// See [`SINK_QUEUE_DEPTH`].
    pub(crate) queue_depth: metrics::Gauge,
    /// See [`SINK_HEALTHY`].
    pub(crate) healthy: metrics::Gauge,
}

impl SinkMetrics {
    /// The handles of target `sink`. The counters are registered at once, so `/metrics` and
    /// the status page show a sink at 0 before its first batch.
    pub(crate) fn new(sink: &str) -> Self {
        Self {
            events: metrics::counter!(SINK_EVENTS, "sink" => sink.to_owned()),
            batches: metrics::counter!(SINK_BATCHES, "sink" => sink.to_owned()),
            write_seconds: metrics::histogram!(SINK_WRITE_SECONDS, "sink" => sink.to_owned()),
            retries: metrics::counter!(SINK_RETRIES, "sink" => sink.to_owned()),
            queue_depth: sink_queue_depth(sink),
            healthy: sink_healthy(sink),
        }
    }
}
