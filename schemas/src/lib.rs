//! refract's shared vocabulary: the change-event model, the Debezium JSON and Avro codecs and the
//! pipeline-file configuration (types, loading with located errors, validation, JSON Schema)
//! the key templates cache keys are written in, the field paths flat tables are declared with, and
//! the write operations projections hand to sinks.
//!
//! Nothing here does IO beyond reading a pipeline file; sources, projections and sinks all speak
//! these types.

pub mod avro;
pub mod clock;
pub mod config;
pub mod debezium;
pub mod event;
pub mod field_path;
pub mod row;
pub mod template;
pub mod write;

pub use event::{ChangeEvent, Checkpoint, Columns, Offset, Op, Position, Record, Row, TableId};
