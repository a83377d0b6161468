//! What a sink kind accepts: the type its write path reads operations as.
//!
//! Each sink module names its intake (`type Accepted<'a> = &'a DocumentOp;`) and declares
//! `ACCEPTS`, the families of that intake; [`crate::registry::accepts`] hands the declarations to
//! `refract validate`, which refuses a route from a projection that emits anything else. The
//! sink reads its batch with [`SinkBatch::intake`], so its write path matches only on what it
//! applies.

use refract_schemas::ChangeEvent;
use refract_schemas::write::migration::MigrationOp;
use refract_schemas::write::tiers::TierWrite;
use refract_schemas::write::{DocumentOp, Invalidation, OpFamily, RowChange, WriteOp};

use crate::{SinkBatch, SinkError};

/// A view of write operations that takes some families and not others.
pub trait Intake<'a>: Sized {
    /// The families this intake takes.
    const FAMILIES: &'static [OpFamily];

    /// `op` as this intake reads it; `None` for a family it does not take.
    fn take(op: &'a WriteOp) -> Option<Self>;
}

/// Documents only.
impl<'a> Intake<'a> for &'a DocumentOp {
    const FAMILIES: &'static [OpFamily] = &[OpFamily::Documents];

    fn take(op: &'a WriteOp) -> Option<Self> {
        match op {
            WriteOp::Document(op) => Some(op),
            _ => None,
        }
    }
}

/// Rows of flat tables only.
impl<'a> Intake<'a> for &'a RowChange {
    const FAMILIES: &'static [OpFamily] = &[OpFamily::Rows];

    fn take(op: &'a WriteOp) -> Option<Self> {
        match op {
            WriteOp::Row(op) => Some(op),
            _ => None,
        }
    }
}

/// Tier writes only.
impl<'a> Intake<'a> for &'a TierWrite {
    const FAMILIES: &'static [OpFamily] = &[OpFamily::Tiers];

    fn take(op: &'a WriteOp) -> Option<Self> {
        match op {
            WriteOp::Tier(op) => Some(op),
            _ => None,
        }
    }
}

/// Migration rows only.
impl<'a> Intake<'a> for &'a MigrationOp {
    const FAMILIES: &'static [OpFamily] = &[OpFamily::Migration];

    fn take(op: &'a WriteOp) -> Option<Self> {
        match op {
            WriteOp::Migrate(op) => Some(op),
            _ => None,
        }
    }
}

/// Every family (a sink that discards what it is given).
impl<'a> Intake<'a> for &'a WriteOp {
    const FAMILIES: &'static [OpFamily] = OpFamily::ALL;

    fn take(op: &'a WriteOp) -> Option<Self> {
        Some(op)
    }
}

/// Documents and cache invalidations (a cache that holds documents and invalidates keys).
#[derive(Debug, Clone, Copy)]
pub enum CacheOp<'a> {
    /// A document to store or remove.
    Document(&'a DocumentOp),
    /// A key to make stale.
    Invalidate(&'a Invalidation),
}

impl<'a> Intake<'a> for CacheOp<'a> {
    const FAMILIES: &'static [OpFamily] = &[OpFamily::Documents, OpFamily::Invalidations];

    fn take(op: &'a WriteOp) -> Option<Self> {
        match op {
            WriteOp::Document(op) => Some(CacheOp::Document(op)),
            WriteOp::Invalidate(op) => Some(CacheOp::Invalidate(op)),
            WriteOp::Row(_) | WriteOp::Change(_) | WriteOp::Tier(_) | WriteOp::Migrate(_) => None,
        }
    }
}

/// Change events and documents (a log of messages per key, such as Kafka topics).
#[derive(Debug, Clone, Copy)]
pub enum TopicOp<'a> {
    /// A change event to relay.
    Change(&'a ChangeEvent),
    /// A document to store or remove.
    Document(&'a DocumentOp),
}

impl<'a> Intake<'a> for TopicOp<'a> {
    const FAMILIES: &'static [OpFamily] = &[OpFamily::Documents, OpFamily::Changes];

    fn take(op: &'a WriteOp) -> Option<Self> {
        match op {
            WriteOp::Change(event) => Some(TopicOp::Change(event)),
            WriteOp::Document(op) => Some(TopicOp::Document(op)),
            WriteOp::Invalidate(_) | WriteOp::Row(_) | WriteOp::Tier(_) | WriteOp::Migrate(_) => {
                None
            }
        }
    }
}

impl SinkBatch {
    /// The batch's operations as intake `T` reads them, in batch order.
    ///
    /// An operation of a family `T` does not take is a permanent error naming the sink and the
    /// family: `refract validate` refuses every route that could bring one, so it means a bug,
    /// and the delivery contract forbids skipping it.
    pub fn intake<'a, T: Intake<'a>>(&'a self, sink: &str) -> Result<Vec<T>, SinkError> {
        self.ops
            .iter()
            .map(|op| {
                T::take(op).ok_or_else(|| SinkError::Permanent {
                    sink: sink.to_owned(),
                    message: format!(
                        "was handed {} but accepts only {}; `refract validate` refuses such a \
                         route, so this is a bug",
                        op.family().name(),
                        OpFamily::sentence(T::FAMILIES)
                    ),
                    source: None,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use refract_schemas::{Offset, Position};

    use super::*;

    fn position() -> Position {
        Position {
            partition: "p".into(),
            offset: Offset(1, 0),
        }
    }

    fn invalidation() -> WriteOp {
        WriteOp::Invalidate(Invalidation {
            key: "k".into(),
            version: None,
            position: position(),
        })
    }

    #[test]
    fn an_accepted_batch_is_read_in_order() {
        let truncate = WriteOp::Document(DocumentOp::Truncate {
            collection: "c".into(),
            position: position(),
        });
        let batch = SinkBatch {
            seq: 1,
            ops: vec![invalidation(), truncate],
        };
        let ops = batch.intake::<CacheOp>("cache").unwrap();
        assert!(matches!(
            ops[..],
            [CacheOp::Invalidate(_), CacheOp::Document(_)]
        ));
    }

    #[test]
    fn a_family_the_intake_does_not_take_is_a_permanent_error_naming_the_sink() {
        let batch = SinkBatch {
            seq: 1,
            ops: vec![invalidation()],
        };
        let error = batch.intake::<&DocumentOp>("docs").unwrap_err();
        assert!(!error.is_retryable());
        assert_eq!(
            error.to_string(),
            "sink `docs`: was handed cache invalidations but accepts only documents; \
             `refract validate` refuses such a route, so this is a bug"
        );
    }
}
