//! What write operations come to in Redis, and how they are written for `redis-cli`.

use std::borrow::Cow;
use std::fmt::Write as _;

use refract_schemas::write::DocumentOp;

use crate::intake::CacheOp;

/// What one batch comes to in Redis, step by step.
pub(super) enum Step<'a> {
    /// A command that goes out pipelined with its neighbours.
    Run(Command<'a>),
    /// Delete every key matching this `SCAN` pattern: runs alone, between the pipelines before
    /// and after it.
    Truncate(String),
}

impl Step<'_> {
    /// The key the step addresses (a truncate: its pattern).
    pub(super) fn key(&self) -> &str {
        match self {
            Step::Run(Command::Delete(key) | Command::Set(key, _) | Command::Tombstone(key, _)) => {
                key
            }
            Step::Truncate(pattern) => pattern,
        }
    }
}

/// What one keyed operation comes to in Redis.
pub(super) enum Command<'a> {
    /// Delete the key (`UNLINK` or `DEL`).
    Delete(Cow<'a, str>),
    /// Store a document as JSON.
    Set(Cow<'a, str>, String),
    /// Replace the key by a tombstone of this version (unless a newer one is there).
    Tombstone(Cow<'a, str>, i64),
}

/// The Redis key an operation addresses: invalidations carry absolute keys, documents live at
/// `{collection}:{key}`; a truncate addresses a whole collection (`None`).
pub(super) fn redis_key<'a>(op: &CacheOp<'a>) -> Option<Cow<'a, str>> {
    match *op {
        CacheOp::Invalidate(i) => Some(Cow::Borrowed(&i.key)),
        CacheOp::Document(
            DocumentOp::Upsert {
                collection, key, ..
            }
            | DocumentOp::Delete {
                collection, key, ..
            },
        ) => Some(Cow::Owned(format!("{collection}:{key}"))),
        CacheOp::Document(DocumentOp::Truncate { .. }) => None,
    }
}

/// Escapes `SCAN MATCH` glob characters.
pub(super) fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `s` double-quoted for `redis-cli`, with escapes.
pub(super) fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
