//! The in-memory source: scripted items in chunks, and a log of the durable checkpoints it is
//! told.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use refract_connectors::{ReadMode, Source, SourceError, SourceItem};
use refract_schemas::Checkpoint;
use tokio::sync::watch;

/// What the in-memory source shares with the test.
#[derive(Debug, Default)]
pub(crate) struct SourceLog {
    /// The checkpoint the run started the source from.
    pub(crate) started_from: Option<Checkpoint>,
    /// Every durable checkpoint the source was told, in order.
    pub(crate) durable: Vec<Checkpoint>,
    /// Whether every scripted item was handed out.
    pub(crate) exhausted: bool,
}

impl SourceLog {
    /// The last durable checkpoint the source was told.
    pub(crate) fn last_durable(&self) -> Checkpoint {
        self.durable.last().cloned().unwrap_or_default()
    }
}

/// A source handing out scripted items in chunks; in [`ReadMode::Follow`] it waits for more
/// after the last one until stopped.
pub(crate) struct MemorySource {
    chunks: VecDeque<Vec<SourceItem>>,
    mode: ReadMode,
    stopped: bool,
    log: Arc<Mutex<SourceLog>>,
}

impl MemorySource {
    /// `items` in chunks of `chunk` items; the log the test reads.
    pub(crate) fn new(items: Vec<SourceItem>, chunk: usize) -> (Self, Arc<Mutex<SourceLog>>) {
        let mut chunks = VecDeque::new();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            chunks.push_back(items.by_ref().take(chunk).collect());
        }
        let log = Arc::new(Mutex::new(SourceLog::default()));
        let source = Self {
            chunks,
            mode: ReadMode::UntilCaughtUp,
            stopped: false,
            log: log.clone(),
        };
        (source, log)
    }
}

#[async_trait]
impl Source for MemorySource {
    async fn start(
        &mut self,
        checkpoint: &Checkpoint,
        mode: ReadMode,
        mut durable: watch::Receiver<Checkpoint>,
    ) -> Result<(), SourceError> {
        self.mode = mode;
        self.log.lock().unwrap().started_from = Some(checkpoint.clone());
        let log = self.log.clone();
        tokio::spawn(async move {
            loop {
                let checkpoint = durable.borrow_and_update().clone();
                log.lock().unwrap().durable.push(checkpoint);
                if durable.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(())
    }

    async fn next_chunk(&mut self) -> Result<Option<Vec<SourceItem>>, SourceError> {
        if let Some(chunk) = self.chunks.pop_front() {
            self.log.lock().unwrap().exhausted = self.chunks.is_empty();
            return Ok(Some(chunk));
        }
        if self.stopped || self.mode == ReadMode::UntilCaughtUp {
            return Ok(None);
        }
        std::future::pending().await
    }

    fn stop(&mut self) {
        self.stopped = true;
    }
}
