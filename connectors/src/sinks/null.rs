//! `kind = "null"`: accepts and discards every operation (benchmarks, dry runs).

use async_trait::async_trait;
use refract_projections::WriteOp;

use crate::{Sink, SinkBatch, SinkError, WriteReport};

/// The null sink.
pub struct NullSink {
    name: String,
}

impl NullSink {
    /// A null sink named `name`.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
        }
    }
}

#[async_trait]
impl Sink for NullSink {
    fn name(&self) -> &str {
        &self.name
    }

    async fn open(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let mut report = WriteReport::default();
        for op in &batch.ops {
            match op {
                WriteOp::Upsert { .. } => report.upserted += 1,
                WriteOp::Flat { change, .. } => match change.op {
                    refract_projections::flatten::FlatOp::Upsert => report.upserted += 1,
                    _ => report.deleted += 1,
                },
                WriteOp::Delete { .. } | WriteOp::Truncate { .. } | WriteOp::Invalidate { .. } => {
                    report.deleted += 1
                }
            }
        }
        Ok(report)
    }

    async fn close(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}
