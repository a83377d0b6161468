//! Every metric the Kafka source emits, in one place: its name, its labels, what it measures.
//! The runtime's Prometheus recorder (`/metrics` of the status server) exports them.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`CONSUMER_LAG`] | gauge | `topic`, `partition` |
//! | [`REBALANCES`] | counter | `change` (`assign`, `revoke`) |
//! | [`COMMIT_FAILURES`] | counter | |

use rdkafka::statistics::Statistics;

/// Records in a partition this member owns that the group has not committed yet: those not yet
/// durable in every sink, plus those not yet read. From librdkafka's statistics, every
/// [`STATISTICS_INTERVAL_MS`].
pub const CONSUMER_LAG: &str = "refract_kafka_consumer_lag";
/// Partitions assigned to or revoked from this member.
pub const REBALANCES: &str = "refract_kafka_rebalances_total";
/// Offset commits that failed (they are made again with the next checkpoint).
pub const COMMIT_FAILURES: &str = "refract_kafka_commit_failures_total";

/// How often librdkafka reports its statistics: lag is a dashboard figure, seconds are fine, and
/// each report is a JSON document of every partition to parse.
pub(super) const STATISTICS_INTERVAL_MS: &str = "5000";

/// Sets [`CONSUMER_LAG`] of every partition the statistics report a lag for.
pub(super) fn record_statistics(statistics: &Statistics) {
    for (topic, t) in &statistics.topics {
        for (partition, p) in &t.partitions {
            // -1 is librdkafka's internal "unassigned" partition; a negative lag is unknown.
            if *partition < 0 || p.consumer_lag < 0 {
                continue;
            }
            ::metrics::gauge!(CONSUMER_LAG, "topic" => topic.clone(), "partition" => partition.to_string())
                .set(p.consumer_lag as f64);
        }
    }
}

/// Counts a rebalance of `partitions` partitions.
pub(super) fn rebalance(change: &'static str, partitions: usize) {
    ::metrics::counter!(REBALANCES, "change" => change).increment(partitions as u64);
}

/// Counts a failed commit.
pub(super) fn commit_failed() {
    ::metrics::counter!(COMMIT_FAILURES).increment(1);
}
