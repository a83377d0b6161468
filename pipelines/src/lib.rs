//! The refract runtime (wiring, batching, checkpoints, backpressure, shutdown) and the commands
//! of the `refract` binary.

pub mod backfill;
pub mod checkpoint;
pub mod drop;
pub mod families;
pub mod plan;
pub mod runtime;
pub mod tiers;
pub mod verify;
