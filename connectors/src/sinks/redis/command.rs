//! What write operations come to in Redis, and how they are written for `redis-cli`.

use std::borrow::Cow;
use std::fmt::Write as _;

use refract_projections::WriteOp;

/// What one operation comes to in Redis.
pub(super) enum Command<'a> {
    /// Delete the key (`UNLINK` or `DEL`).
    Delete(Cow<'a, str>),
    /// Store a document as JSON.
    Set(Cow<'a, str>, String),
    /// Replace the key by a tombstone of this version (unless a newer one is there).
    Tombstone(Cow<'a, str>, i64),
    /// Delete every key matching this `SCAN` pattern.
    Truncate(String),
}

/// The Redis key an operation addresses: invalidations carry absolute keys, documents live at
/// `{collection}:{key}`.
pub(super) fn redis_key(op: &WriteOp) -> Option<Cow<'_, str>> {
    match op {
        WriteOp::Invalidate { key, .. } => Some(Cow::Borrowed(key)),
        WriteOp::Upsert {
            collection, key, ..
        }
        | WriteOp::Delete {
            collection, key, ..
        } => Some(Cow::Owned(format!("{collection}:{key}"))),
        WriteOp::Truncate { .. } | WriteOp::Flat { .. } => None,
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
