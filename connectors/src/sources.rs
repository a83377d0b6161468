//! Sources: where change records come from. One file per kind; see [`crate::registry`].

pub mod file;
pub mod kafka;
pub mod postgres;

use std::sync::mpsc::Receiver;

use crate::SourceItem;

/// How long an idle decoding thread waits for work before it frees the chunks handed back to
/// it ([`crate::Source::recycle`]).
pub(crate) const IDLE_FREE: std::time::Duration = std::time::Duration::from_millis(100);

/// Frees the chunks the runtime handed back to a decoding thread (the thread that allocated
/// them frees them fastest), keeping the largest emptied vector in `spare` for the next chunk;
/// returns how many were freed.
pub(crate) fn free_recycled(
    recycled: &Receiver<Vec<SourceItem>>,
    spare: &mut Vec<SourceItem>,
) -> u64 {
    let mut freed = 0;
    for mut old in recycled.try_iter() {
        old.clear();
        freed += 1;
        if old.capacity() > spare.capacity() {
            *spare = old;
        }
    }
    freed
}
