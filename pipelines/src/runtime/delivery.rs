//! Delivery tasks: one per sink (and one for the dead-letter store). Each applies its batches in
//! order, retries retryable failures with exponential backoff and jitter while the checkpoint
//! waits, and acknowledges each batch once it is durable.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use refract_connectors::dead_letter::{DeadLetter, DeadLetterStore};
use refract_connectors::{BuiltSink, SinkBatch, SinkError, WriteReport};
use refract_schemas::Checkpoint;
use tokio::sync::{mpsc, watch};

use super::journal::Level;
use super::metrics::SinkMetrics;
use super::status::Health;
use std::sync::Arc;

/// First retry delay: long enough not to hammer a target that just failed.
const RETRY_MIN_DELAY: Duration = Duration::from_millis(100);
/// Retry delay ceiling: a target back from an outage is noticed within this time (jitter adds
/// up to as much again).
const RETRY_MAX_DELAY: Duration = Duration::from_secs(5);

/// The name the dead-letter store goes by among the targets (`/health`, metrics' `sink` label).
pub(crate) const DEAD_LETTER_TARGET: &str = "dead_letter";

/// Work for a delivery task.
pub(crate) enum Job {
    /// Write operations for a sink.
    Ops(SinkBatch),
    /// Bad input for the dead-letter store.
    Letters { seq: u64, letters: Vec<DeadLetter> },
    /// Make everything written durable now (the pipeline drains).
    Flush,
}

/// A delivery task's report to the runtime.
pub(crate) enum Ack {
    /// Batch `seq` is durable in target `target`.
    Done {
        target: usize,
        seq: u64,
        report: WriteReport,
    },
    /// The target failed permanently, or gave up retrying because of shutdown.
    Failed { error: SinkError, shutdown: bool },
    /// The sink closed and has something to tell in the run's summary.
    Notice(String),
}

/// Where a delivery task writes.
pub(crate) enum Target {
    /// A configured sink.
    Sink(BuiltSink),
    /// The dead-letter store.
    DeadLetters(DeadLetterStore),
}

impl Target {
    pub(crate) fn name(&self) -> String {
        match self {
            Target::Sink(s) => s.name.clone(),
            Target::DeadLetters(_) => DEAD_LETTER_TARGET.to_owned(),
        }
    }

    async fn open(&mut self, resume: &Checkpoint) -> Result<(), SinkError> {
        match self {
            Target::Sink(s) => s.sink.open(resume).await,
            Target::DeadLetters(_) => Ok(()),
        }
    }

    fn unhealthy_after(&self) -> Duration {
        match self {
            Target::Sink(s) => s.unhealthy_after,
            Target::DeadLetters(_) => refract_connectors::DEFAULT_UNHEALTHY_AFTER,
        }
    }

    async fn deliver(&mut self, job: &Job) -> Result<WriteReport, SinkError> {
        match (self, job) {
            (Target::Sink(s), Job::Ops(batch)) => s.sink.write(batch).await,
            (Target::Sink(s), Job::Flush) => s.sink.flush().await.map(|()| WriteReport::default()),
            (Target::DeadLetters(_), Job::Flush) => Ok(WriteReport::default()),
            (Target::DeadLetters(store), Job::Letters { letters, .. }) => {
                store.write(letters, crate::runtime::now_ms()).await?;
                Ok(WriteReport::default())
            }
            (target, Job::Ops(_) | Job::Letters { .. }) => Err(SinkError::Permanent {
                sink: target.name(),
                message: "was handed a job of another kind of target: a bug in the runtime".into(),
                source: None,
            }),
        }
    }
}

/// What a delivery task attempts.
#[derive(Clone, Copy)]
enum Attempt<'a> {
    Open(&'a Checkpoint),
    Deliver(&'a Job),
}

/// Where a delivery task reports its target's health and counts its work: made once per task.
struct Reporter {
    name: String,
    metrics: SinkMetrics,
    health: Arc<Health>,
}

/// Runs `attempt` until it succeeds, fails permanently, or shutdown is requested while waiting.
async fn retrying(
    target: &mut Target,
    attempt: Attempt<'_>,
    shutdown: &mut watch::Receiver<bool>,
    reporter: &Reporter,
) -> Result<WriteReport, (SinkError, bool)> {
    let Reporter {
        name,
        metrics,
        health,
    } = reporter;
    let healthy = &metrics.healthy;
    let what = match attempt {
        Attempt::Open(_) => "open",
        Attempt::Deliver(_) => "write",
    };
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(RETRY_MIN_DELAY)
        .with_max_delay(RETRY_MAX_DELAY)
        .with_jitter()
        .without_max_times()
        .build();
    let mut failures = 0u64;
    let first_failure = std::time::Instant::now();
    let unhealthy_after = target.unhealthy_after();
    let mut unhealthy = false;
    loop {
        let result = match attempt {
            Attempt::Open(resume) => target.open(resume).await.map(|()| WriteReport::default()),
            Attempt::Deliver(job) => target.deliver(job).await,
        };
        match result {
            Ok(v) => {
                if failures > 0 {
                    tracing::info!(sink = %name, failures, waited_ms = first_failure.elapsed().as_millis() as u64, "{what} succeeded after retrying");
                }
                if unhealthy || failures == 0 {
                    healthy.set(1.0);
                }
                if unhealthy {
                    health.set(&name, None);
                }
                return Ok(v);
            }
            Err(e) if e.is_retryable() => {
                failures += 1;
                if !unhealthy && first_failure.elapsed() >= unhealthy_after {
                    unhealthy = true;
                    healthy.set(0.0);
                    health.set(
                        &name,
                        Some(format!(
                            "a batch has waited {} ms: {e}",
                            first_failure.elapsed().as_millis()
                        )),
                    );
                    tracing::error!(sink = %name, waited_ms = first_failure.elapsed().as_millis() as u64, error = %e, "pipeline unhealthy: a batch has waited longer than the sink's bound; still retrying, the checkpoint holds");
                }
                let delay = backoff.next().unwrap_or(RETRY_MAX_DELAY);
                metrics.retries.increment(1);
                health.journal.note(
                    Level::Warning,
                    name,
                    &format!("{what} failed, retrying: {e}"),
                );
                tracing::warn!(sink = %name, attempt = failures, retry_in_ms = delay.as_millis() as u64, error = %e, "{what} failed, retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return Err((e, true)),
                }
            }
            Err(e) => return Err((e, false)),
        }
    }
}

/// The delivery loop of one target.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    index: usize,
    mut target: Target,
    resume: Checkpoint,
    mut jobs: mpsc::Receiver<Job>,
    acks: mpsc::UnboundedSender<Ack>,
    mut shutdown: watch::Receiver<bool>,
    health: Arc<Health>,
) {
    let name = target.name();
    let reporter = Reporter {
        metrics: SinkMetrics::new(&name),
        name: name.clone(),
        health,
    };
    let fail = |error, shutdown| Ack::Failed { error, shutdown };
    let open = retrying(
        &mut target,
        Attempt::Open(&resume),
        &mut shutdown,
        &reporter,
    );
    if let Err((error, stop)) = open.await {
        let _ = acks.send(fail(error, stop));
        return;
    }
    reporter.health.opened(&name);
    // Batches a buffering sink has written but not yet made durable, with their reports and
    // sizes.
    let mut deferred: VecDeque<Deferred> = VecDeque::new();
    let mut open = true;
    while open || !deferred.is_empty() {
        let deadline = match &target {
            Target::Sink(s) => s.sink.buffered().and_then(|b| b.flush_deadline),
            Target::DeadLetters(_) => None,
        };
        let job = tokio::select! {
            job = jobs.recv(), if open => match job {
                Some(job) => job,
                // The pipeline is done: what is buffered must become durable now.
                None => {
                    open = false;
                    Job::Flush
                }
            },
            () = sleep_until(deadline) => Job::Flush,
        };
        reporter.metrics.queue_depth.set(jobs.len() as f64);
        let seq = match &job {
            Job::Ops(b) => Some((b.seq, b.ops.len() as u64)),
            Job::Letters { seq, letters } => Some((*seq, letters.len() as u64)),
            Job::Flush => None,
        };
        let started = Instant::now();
        match retrying(
            &mut target,
            Attempt::Deliver(&job),
            &mut shutdown,
            &reporter,
        )
        .await
        {
            Ok(report) => {
                if let Some((seq, events)) = seq {
                    reporter
                        .metrics
                        .write_seconds
                        .record(started.elapsed().as_secs_f64());
                    deferred.push_back((seq, report, events));
                }
                let durable = match &target {
                    Target::Sink(s) => s.sink.buffered().map(|b| b.durable_through),
                    Target::DeadLetters(_) => None,
                };
                if !acknowledge(&mut deferred, durable, index, &acks, &reporter.metrics) {
                    return;
                }
            }
            Err((error, stop)) => {
                let _ = acks.send(fail(error, stop));
                return;
            }
        }
        if !open && !deferred.is_empty() {
            let _ = acks.send(fail(
                SinkError::Permanent {
                    sink: name.clone(),
                    message: "the sink did not make its last batches durable when flushed".into(),
                    source: None,
                },
                false,
            ));
            return;
        }
    }
    if let Target::Sink(s) = &mut target {
        match s.sink.close().await {
            Ok(Some(notice)) => {
                let _ = acks.send(Ack::Notice(format!("sink `{name}`: {notice}")));
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(sink = %name, error = %e, "closing the sink failed"),
        }
    }
}

/// A batch written but not yet acknowledged: its sequence number, report and size in events.
type Deferred = (u64, WriteReport, u64);

/// Acknowledges the leading `deferred` batches that are durable (all of them, unless the sink
/// buffers: those up to its `durable_through`), counting them; false once the runtime stopped
/// listening.
fn acknowledge(
    deferred: &mut VecDeque<Deferred>,
    durable_through: Option<u64>,
    target: usize,
    acks: &mpsc::UnboundedSender<Ack>,
    metrics: &SinkMetrics,
) -> bool {
    while let Some((seq, report, events)) = deferred.pop_front() {
        if durable_through.is_some_and(|through| seq > through) {
            deferred.push_front((seq, report, events));
            break;
        }
        metrics.events.increment(events);
        metrics.batches.increment(1);
        if acks
            .send(Ack::Done {
                target,
                seq,
                report,
            })
            .is_err()
        {
            return false;
        }
    }
    true
}

async fn sleep_until(deadline: Option<std::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}
