//! The status page's history: a ring of samples taken every [`SAMPLE_INTERVAL`] for the last
//! hour from the same recorder that `/metrics` renders, so a plotted point and a scrape taken at
//! the same moment agree.
//!
//! A sample is read from the recorder's Prometheus rendering ([`Series::parse`]) rather than from
//! counters of its own: there is then one source of truth, and the page cannot drift from what
//! Prometheus scrapes.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use refract_connectors::sources::postgres::metrics::SLOT_LAG_BYTES;
use serde::Serialize;

use super::metrics::{SINK_EVENTS, SOURCE_LAG_SECONDS};
use super::status::lock;

/// How often a sample is taken: fine enough to see a burst, coarse enough that an hour is a few
/// hundred points to draw.
pub(crate) const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);
/// How many samples are kept: one hour at [`SAMPLE_INTERVAL`].
pub(crate) const HISTORY_SAMPLES: usize = 720;

/// One series of a Prometheus text rendering.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct SeriesValue {
    /// The series as `/metrics` writes it: `name{label="value",...}` (or `name`).
    pub(crate) series: String,
    /// The metric's name.
    pub(crate) name: String,
    /// Its labels, in the rendering's order.
    pub(crate) labels: BTreeMap<String, String>,
    /// Its value.
    pub(crate) value: f64,
}

/// The series of one rendering of the recorder.
#[derive(Debug, Default)]
pub(crate) struct Series(Vec<SeriesValue>);

impl Series {
    /// Reads the Prometheus text exposition format the exporter writes: comment lines are
    /// skipped, each other line is `series value`. Lines that do not parse are skipped (the
    /// page shows less, it never fails).
    pub(crate) fn parse(text: &str) -> Self {
        Self(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(parse_line)
                .collect(),
        )
    }

    /// The series of the metrics named in `names`.
    pub(crate) fn of(&self, names: &[&str]) -> Vec<SeriesValue> {
        self.0
            .iter()
            .filter(|s| names.contains(&s.name.as_str()))
            .cloned()
            .collect()
    }

    /// The values of metric `name` by the value of its label `label`.
    fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| Some((s.labels.get(label)?.clone(), s.value)))
            .collect()
    }

    /// The sum of metric `name` over its series; `None` when it has none.
    fn sum(&self, name: &str) -> Option<f64> {
        let mut values = self.0.iter().filter(|s| s.name == name).peekable();
        values.peek()?;
        Some(values.map(|s| s.value).sum())
    }
}

/// One line `name{labels} value` (the exporter writes no timestamps).
fn parse_line(line: &str) -> Option<SeriesValue> {
    let (series, value) = line.trim().rsplit_once(' ')?;
    let value = value.parse::<f64>().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)?),
        None => (series, BTreeMap::new()),
    };
    Some(SeriesValue {
        series: series.to_owned(),
        name: name.to_owned(),
        labels,
        value,
    })
}

/// `a="x",b="y"` with the format's escapes (`\\`, `\"`, `\n`) in values.
fn parse_labels(text: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(name.to_owned(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(labels)
}

/// What the page plots at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Sample {
    /// When (milliseconds since the epoch).
    pub(crate) at_ms: i64,
    /// `refract_source_lag_seconds`, when recorded.
    pub(crate) lag_seconds: Option<f64>,
    /// `refract_slot_lag_bytes` summed over slots, once the source has measured it.
    pub(crate) lag_bytes: Option<f64>,
    /// `refract_sink_events_written_total` by sink (the page draws its rate).
    pub(crate) events: BTreeMap<String, f64>,
}

impl Sample {
    /// The sample of `series`, taken at `at_ms`.
    pub(crate) fn of(at_ms: i64, series: &Series) -> Self {
        Self {
            at_ms,
            lag_seconds: series.sum(SOURCE_LAG_SECONDS),
            lag_bytes: series.sum(SLOT_LAG_BYTES),
            events: series.by_label(SINK_EVENTS, "sink"),
        }
    }
}

/// The ring of the last [`HISTORY_SAMPLES`] samples, oldest first.
#[derive(Debug)]
pub(crate) struct History {
    samples: Mutex<VecDeque<Sample>>,
    capacity: usize,
}

impl History {
    /// An empty ring of `capacity` samples.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            samples: Mutex::new(VecDeque::with_capacity(capacity)),
            capacity,
        }
    }

    /// Adds `sample`, dropping the oldest once full.
    pub(crate) fn push(&self, sample: Sample) {
        let mut samples = lock(&self.samples);
        if samples.len() == self.capacity {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// The samples, oldest first.
    pub(crate) fn samples(&self) -> Vec<Sample> {
        lock(&self.samples).iter().cloned().collect()
    }
}

/// Takes a sample from `read` (a rendering of the recorder) every [`SAMPLE_INTERVAL`], for the
/// rest of the process.
pub(crate) fn spawn_sampler(history: Arc<History>, read: impl Fn() -> Series + Send + 'static) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            history.push(Sample::of(super::now_ms(), &read()));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_exporter_prometheus::PrometheusBuilder;

    fn sample(at_ms: i64) -> Sample {
        Sample {
            at_ms,
            lag_seconds: Some(0.0),
            lag_bytes: None,
            events: BTreeMap::new(),
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_samples_oldest_first() {
        let history = History::new(HISTORY_SAMPLES);
        for at in 0..HISTORY_SAMPLES as i64 + 10 {
            history.push(sample(at));
        }
        let kept: Vec<i64> = history.samples().iter().map(|s| s.at_ms).collect();
        assert_eq!(kept.len(), HISTORY_SAMPLES);
        assert_eq!(kept[0], 10, "the ten oldest were dropped");
        assert!(kept.windows(2).all(|w| w[1] == w[0] + 1), "in order");
        assert_eq!(*kept.last().unwrap(), HISTORY_SAMPLES as i64 + 9);
    }

    #[test]
    fn a_sample_reads_the_values_the_recorder_renders() {
        let recorder = PrometheusBuilder::new()
            .add_global_label("pipeline", "shop \"eu\"")
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!(SINK_EVENTS, "sink" => "cache").increment(1234);
            metrics::counter!(SINK_EVENTS, "sink" => "docs").increment(7);
            metrics::gauge!(SOURCE_LAG_SECONDS).set(2.5);
            metrics::gauge!(SLOT_LAG_BYTES, "slot" => "a").set(100.0);
            metrics::gauge!(SLOT_LAG_BYTES, "slot" => "b").set(28.0);
        });
        let text = handle.render();
        let series = Series::parse(&text);
        let s = Sample::of(42, &series);
        assert_eq!(s.events["cache"], 1234.0);
        assert_eq!(s.events["docs"], 7.0);
        assert_eq!(s.lag_seconds, Some(2.5));
        assert_eq!(s.lag_bytes, Some(128.0));
        // Every series keeps the text `/metrics` shows, escapes included.
        for v in series.of(&[SINK_EVENTS]) {
            assert!(
                text.lines()
                    .any(|l| l == format!("{} {}", v.series, v.value)),
                "{} in {text}",
                v.series
            );
            assert_eq!(v.labels["pipeline"], "shop \"eu\"");
        }
    }
}
