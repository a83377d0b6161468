//! What a run did: printed at the end of `refract run`, and written as JSON on request.

use std::collections::BTreeMap;
use std::time::Duration;

use refract_connectors::WriteReport;
use refract_schemas::{Checkpoint, Op};
use serde::Serialize;

/// Counters of one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Records read from the source (changes, transaction markers, tombstones, bad input).
    pub records: u64,
    /// Change events per op code (`c`, `u`, `d`, `r`, `t`).
    pub changes: BTreeMap<&'static str, u64>,
    /// Source transactions that ended (END markers seen).
    pub transactions: u64,
    /// Kafka tombstones passed over.
    pub tombstones: u64,
    /// Records sent to the dead-letter store.
    pub dead_letters: u64,
    /// Where dead letters went.
    pub dead_letter_location: String,
    /// Per sink: documents upserted, deleted, and operations coalesced away.
    pub sinks: BTreeMap<String, WriteReport>,
    /// Per sink: where it writes (secrets masked).
    pub sink_locations: BTreeMap<String, String>,
    /// The checkpoint the run started from.
    pub resumed_from: Checkpoint,
    /// The checkpoint committed at the end.
    pub checkpoint: Checkpoint,
    /// Wall time of the run.
    #[serde(serialize_with = "seconds")]
    pub elapsed: Duration,
    /// Whether SIGINT/SIGTERM ended the run.
    pub stopped_by_signal: bool,
    /// What sinks had to tell at the end (a fallback they used, say).
    pub notices: Vec<String>,
    /// Current-state tables rebuilt at the end of the run, per Parquet sink.
    pub compacted: Vec<String>,
    #[serde(skip)]
    sink_names: Vec<String>,
    /// Per-op counters on the hot path, folded into `changes` by [`RunSummary::finish`].
    #[serde(skip)]
    op_counts: [u64; 5],
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl RunSummary {
    pub(crate) fn new(
        sink_names: Vec<String>,
        dead_letter_location: String,
        resumed_from: Checkpoint,
    ) -> Self {
        Self {
            records: 0,
            changes: BTreeMap::new(),
            transactions: 0,
            tombstones: 0,
            dead_letters: 0,
            dead_letter_location,
            sinks: sink_names
                .iter()
                .map(|n| (n.clone(), WriteReport::default()))
                .collect(),
            sink_locations: BTreeMap::new(),
            checkpoint: resumed_from.clone(),
            resumed_from,
            elapsed: Duration::ZERO,
            stopped_by_signal: false,
            notices: Vec::new(),
            compacted: Vec::new(),
            sink_names,
            op_counts: [0; 5],
        }
    }

    pub(crate) fn count_op(&mut self, op: Op) {
        self.op_counts[op as usize] += 1;
    }

    /// Folds the hot-path counters into the reported fields.
    pub(crate) fn finish(&mut self) {
        for op in [Op::Create, Op::Update, Op::Delete, Op::Read, Op::Truncate] {
            let n = self.op_counts[op as usize];
            if n > 0 {
                self.changes.insert(op.code(), n);
            }
        }
    }

    /// The name of sink `sink` (its index among the run's sinks).
    pub(crate) fn sink_name(&self, sink: usize) -> &str {
        self.sink_names.get(sink).map_or("?", String::as_str)
    }

    pub(crate) fn add_report(&mut self, sink: usize, report: WriteReport) {
        let total = self.sinks.entry(self.sink_names[sink].clone()).or_default();
        total.upserted += report.upserted;
        total.deleted += report.deleted;
        total.coalesced += report.coalesced;
    }

    /// Logs progress; `rate` is (units of the source's progress per second, seconds left).
    pub(crate) fn log_progress(
        &self,
        progress: Option<(u64, u64)>,
        rate: Option<(f64, Option<f64>)>,
    ) {
        let percent = progress
            .filter(|(_, total)| *total > 0)
            .map(|(done, total)| (done as f64 * 100.0 / total as f64).min(100.0));
        let per_s = rate.map(|(r, _)| r.round() as u64);
        let eta_s = rate.and_then(|(_, eta)| eta).map(|e| e.round() as u64);
        tracing::info!(
            records = self.records,
            dead_letters = self.dead_letters,
            percent_read = ?percent.map(|p| (p * 10.0).round() / 10.0),
            read_per_s = ?per_s,
            eta_s = ?eta_s,
            "progress"
        );
    }

    /// The human-readable summary.
    pub fn render(&self) -> String {
        let secs = self.elapsed.as_secs_f64();
        let rate = if secs > 0.0 {
            self.records as f64 / secs
        } else {
            0.0
        };
        let mut out = String::new();
        let changes: Vec<String> = self
            .changes
            .iter()
            .map(|(op, n)| format!("{op}={n}"))
            .collect();
        out.push_str(&format!(
            "records read   {} in {:.2}s ({:.0}/s); changes {}; transactions {}\n",
            self.records,
            secs,
            rate,
            if changes.is_empty() {
                "none".into()
            } else {
                changes.join(" ")
            },
            self.transactions
        ));
        for (name, r) in &self.sinks {
            let at = self
                .sink_locations
                .get(name)
                .map_or(String::new(), |l| format!(" -> {l}"));
            out.push_str(&format!(
                "sink {name:<10} {} upserted, {} deleted, {} coalesced{at}\n",
                r.upserted, r.deleted, r.coalesced
            ));
        }
        out.push_str(&format!(
            "dead letters   {} (in {})\n",
            self.dead_letters, self.dead_letter_location
        ));
        if !self.resumed_from.is_empty() {
            let from: Vec<String> = self
                .resumed_from
                .iter()
                .map(|(p, o)| format!("{p}@{o}"))
                .collect();
            out.push_str(&format!(
                "resumed from   {} (delete the state directory to start over)\n",
                from.join(", ")
            ));
        }
        let cp: Vec<String> = self
            .checkpoint
            .iter()
            .map(|(p, o)| format!("{p}@{o}"))
            .collect();
        out.push_str(&format!(
            "checkpoint     {}\n",
            if cp.is_empty() {
                "none".into()
            } else {
                cp.join(", ")
            }
        ));
        for line in &self.compacted {
            out.push_str(&format!("compacted      {line}\n"));
        }
        for notice in &self.notices {
            out.push_str(&format!("NOTE           {notice}\n"));
        }
        if self.stopped_by_signal {
            out.push_str(
                "stopped by signal after draining; the next run resumes at the checkpoint\n",
            );
        }
        out
    }
}
