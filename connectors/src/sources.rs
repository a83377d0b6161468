//! Sources: where change records come from. One file per kind; see [`crate::registry`].

pub mod file;
pub mod kafka;
pub mod postgres;
