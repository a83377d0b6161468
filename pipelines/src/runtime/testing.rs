//! The runtime's test harness: a pipeline file from text, an in-memory source that hands out a
//! scripted list of items and records the durable checkpoints it is told, an in-memory sink that
//! records every batch it applies, and a sink wrapper that injects faults on a script the test
//! shares (fail transiently, stall until released, fail permanently, buffer until told).
//!
//! Tests run on tokio's paused clock (`start_paused`): time moves only when every task waits,
//! straight to the next timer, so retry backoff costs no wall time and waiting for a condition
//! ([`Running::wait_until`]) has a deadline in virtual time.

mod script;
mod sinks;
mod source;

use std::time::Duration;

use refract_connectors::{BuiltSink, DEFAULT_UNHEALTHY_AFTER, ReadMode, Sink};
use refract_schemas::Checkpoint;
use refract_schemas::config::{PipelineFile, load_str};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::wiring::projection_parts;
use super::{Parts, RunError, RunOptions, RunSummary, Startup, run_parts};
pub(super) use script::{Step, covered, expected, history, items, offsets, through};
pub(super) use sinks::{Applied, Fault, Faults, FaultySink, MemorySink};
pub(super) use source::MemorySource;

/// The partition of the in-memory source.
pub(super) const PARTITION: &str = "memory";
/// The table the test pipeline's projection reads.
pub(super) const TABLE: &str = "items";
/// How long [`Running::wait_until`] waits (virtual time: a deadline only a stuck run reaches).
const WAIT_LIMIT: Duration = Duration::from_secs(120);
/// How often [`Running::wait_until`] looks (virtual time).
const POLL: Duration = Duration::from_millis(1);

/// The settings of a test pipeline that tests vary.
pub(super) struct Settings {
    /// `[pipeline.batch] max_events`.
    pub(super) max_events: usize,
    /// `[pipeline] on_error`.
    pub(super) on_error: &'static str,
    /// `[pipeline] queue_depth`.
    pub(super) queue_depth: usize,
    /// The sinks the projection writes to (all `kind = "null"` in the file; the test hands in
    /// its own under these names).
    pub(super) sinks: &'static [&'static str],
    /// A document projection (`{"id", "v"}` per row of `items`, emitted at each transaction's
    /// end, its state in the keyed state store) instead of the replica.
    pub(super) documents: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_events: 2,
            on_error: "dead_letter",
            queue_depth: 4,
            sinks: &["a"],
            documents: false,
        }
    }
}

/// A pipeline file parsed from text, with its state directory (removed when dropped).
pub(super) struct Pipeline {
    pub(super) config: PipelineFile,
    _dir: tempfile::TempDir,
}

impl Pipeline {
    /// A replica (or documents) of `public.items` into the settings' sinks; batches wait up to a
    /// minute for more events (the tests' batches are cut by their size).
    pub(super) fn new(settings: Settings) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let sinks: Vec<String> = settings.sinks.iter().map(|s| format!("{s:?}")).collect();
        let mut text = format!(
            r#"
[pipeline]
name = "memory"
state_dir = {dir:?}
on_error = {on_error:?}
queue_depth = {queue_depth}

[pipeline.batch]
max_events = {max_events}
max_delay_ms = 60000

[source]
kind = "file"
path = "unused.jsonl"

[projections.replica]
{projection}
sinks = [{sinks}]
"#,
            dir = dir.path().display().to_string(),
            on_error = settings.on_error,
            queue_depth = settings.queue_depth,
            max_events = settings.max_events,
            sinks = sinks.join(", "),
            projection = if settings.documents {
                format!(
                    "kind = \"document\"\ntable = \"public.{TABLE}\"\n\
                     fields = [{{ name = \"id\", from = \"id\" }}, {{ name = \"v\", from = \"v\" }}]"
                )
            } else {
                format!("kind = \"replica\"\ntables = [\"public.{TABLE}\"]")
            },
        );
        for sink in settings.sinks {
            text.push_str(&format!("\n[sinks.{sink}]\nkind = \"null\"\n"));
        }
        let config = load_str(
            "memory.toml",
            &text,
            &|_| None,
            Some(&crate::families::Registries),
        )
        .unwrap_or_else(|e| panic!("the test pipeline must load: {e}"))
        .config;
        Self { config, _dir: dir }
    }

    /// The checkpoint committed in the state directory (after a run).
    pub(super) fn committed(&self) -> Checkpoint {
        let path = super::state_path(&self.config).join(crate::checkpoint::FILE);
        crate::checkpoint::CheckpointStore::open(&path)
            .and_then(|store| store.load())
            .expect("the checkpoint store opens")
    }

    /// The dead letters recorded in the default file, as JSON.
    pub(super) fn dead_letters(&self) -> Vec<serde_json::Value> {
        let path = super::default_dead_letter_path(&self.config);
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a dead letter is JSON"))
            .collect()
    }

    /// Starts a run of this pipeline with `source` and `sinks` in memory (and the file's
    /// projections).
    pub(super) fn start(
        &self,
        source: MemorySource,
        sinks: Vec<(&str, Box<dyn Sink>)>,
        mode: ReadMode,
    ) -> Running {
        let config = self.config.clone();
        let parts = Parts {
            source: Box::new(source),
            sinks: sinks
                .into_iter()
                .map(|(name, sink)| BuiltSink {
                    name: name.to_owned(),
                    sink,
                    unhealthy_after: DEFAULT_UNHEALTHY_AFTER,
                })
                .collect(),
            projections: projection_parts(&config),
        };
        let options = RunOptions {
            mode,
            backfill: None,
            progress_bar: false,
        };
        let (shutdown, shutdown_rx) = watch::channel(false);
        let handle = tokio::spawn(async move {
            let startup = Startup::open(&config).await?;
            run_parts(&config, startup, parts, options, shutdown_rx).await
        });
        Running { shutdown, handle }
    }
}

/// A run in progress.
pub(super) struct Running {
    shutdown: watch::Sender<bool>,
    handle: JoinHandle<Result<RunSummary, RunError>>,
}

impl Running {
    /// Waits until `condition` holds; fails the test if the run ends first or the deadline
    /// passes.
    pub(super) async fn wait_until(&self, what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
        while !condition() {
            assert!(!self.handle.is_finished(), "the run ended before {what}");
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting until {what}"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Asks the run to stop (SIGINT/SIGTERM).
    pub(super) fn stop(&self) {
        self.shutdown.send_replace(true);
    }

    /// The run's result; fails the test if it does not end by the deadline.
    pub(super) async fn finish(self) -> Result<RunSummary, RunError> {
        tokio::time::timeout(WAIT_LIMIT, self.handle)
            .await
            .expect("the run ends before the deadline")
            .expect("the run does not panic")
    }
}

/// Lets virtual time pass: every task runs until it waits on something a second does not
/// bring. Before asserting that something did *not* happen (the checkpoint did not move).
pub(super) async fn let_time_pass() {
    tokio::time::sleep(Duration::from_secs(1)).await;
}
