//! `kind = "null"`: accepts and discards every operation (benchmarks, dry runs).

use async_trait::async_trait;
use refract_schemas::Checkpoint;
use refract_schemas::write::flat::FlatOp;
use refract_schemas::write::migration::MigrationAction;
use refract_schemas::write::tiers::TierAction;
use refract_schemas::write::{DocumentOp, OpFamily, WriteOp};

use crate::{Intake, Sink, SinkBatch, SinkError, WriteReport};

/// What the null sink accepts: everything.
type Accepted<'a> = &'a WriteOp;

/// The null sink.
pub struct NullSink {
    name: String,
}

impl NullSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A null sink named `name`.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
        }
    }
}

#[async_trait]
impl Sink for NullSink {
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        Ok(())
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let mut report = WriteReport::default();
        for op in batch.intake::<Accepted>(&self.name)? {
            let upsert = match op {
                WriteOp::Document(op) => matches!(op, DocumentOp::Upsert { .. }),
                WriteOp::Row(row) => row.change.op == FlatOp::Upsert,
                WriteOp::Change(event) => event.op != refract_schemas::Op::Delete,
                WriteOp::Tier(w) => w.action == TierAction::Put,
                WriteOp::Migrate(m) => !matches!(m.action, MigrationAction::Delete { .. }),
                WriteOp::Invalidate(_) => false,
            };
            if upsert {
                report.upserted += 1;
            } else {
                report.deleted += 1;
            }
        }
        Ok(report)
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        Ok(None)
    }
}
