//! Sinks: where write operations are applied. One file per kind; see [`crate::registry`].

pub(crate) mod documents;
pub mod kafka;
pub mod local_files;
pub mod migration;
pub mod null;
pub mod object_json;
pub mod parquet;
pub mod postgres;
pub mod redis;
pub mod tiers;
