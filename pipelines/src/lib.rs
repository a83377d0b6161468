//! The refract runtime (wiring, batching, checkpoints, backpressure, shutdown) and the commands
//! of the `refract` binary.

pub mod checkpoint;
pub mod plan;
pub mod runtime;
