//! Decoder of PostgreSQL's `pgoutput` logical-replication messages (protocol versions 1 and 2),
//! written from the "Logical Replication Message Formats" chapter of the PostgreSQL manual.
//!
//! Input is the payload of one XLogData message; output is a [`Message`]. Decoding never panics
//! and never reads past the input: every malformed message is a [`PgOutputError`] naming the
//! byte offset and what was expected (the fuzz test below feeds it arbitrary bytes).
//!
//! Version 2 adds streamed in-progress transactions (`S`, `E`, `c`, `A`); inside a stream the
//! data messages carry the transaction id, which the caller signals with `in_stream`.

use bytes::Bytes;

/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
pub const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// A decoding failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput message at byte {offset}: {reason}")]
pub struct PgOutputError {
    /// Byte offset in the message where decoding failed.
    pub offset: usize,
    /// What was expected.
    pub reason: String,
}

/// One column of a relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Part of the replica identity (key).
    pub key: bool,
    /// Column name.
    pub name: String,
    /// Type OID.
    pub type_oid: u32,
    /// Type modifier (e.g. numeric precision and scale).
    pub type_modifier: i32,
}

/// A `Relation` message: the shape of a table, sent before its first change and after DDL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Relation OID.
    pub id: u32,
    /// Schema name.
    pub namespace: String,
    /// Table name.
    pub name: String,
    /// Replica identity setting: `d` default, `n` nothing, `f` full, `i` index.
    pub replica_identity: u8,
    /// Columns in table order.
    pub columns: Vec<Column>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Datum {
    /// SQL NULL.
    Null,
    /// An unchanged TOASTed value that was not sent: the previous value still holds.
    UnchangedToast,
    /// A value in text format.
    Text(Bytes),
    /// A value in binary format.
    Binary(Bytes),
}

/// A tuple: one datum per column of the relation.
pub type Tuple = Vec<Datum>;

/// Which old image an update or delete carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldKind {
    /// `K`: only the replica-identity (key) columns; the others are null.
    Key,
    /// `O`: the whole old row (REPLICA IDENTITY FULL).
    Full,
}

/// A decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A transaction begins.
    Begin {
        /// LSN of the commit record.
        final_lsn: u64,
        /// Commit time, microseconds since the Unix epoch.
        commit_time_us: i64,
        /// Transaction id.
        xid: u32,
    },
    /// A transaction committed.
    Commit {
        /// LSN of the commit record.
        commit_lsn: u64,
        /// LSN just past the commit record.
        end_lsn: u64,
        /// Commit time, microseconds since the Unix epoch.
        commit_time_us: i64,
    },
    /// The origin of the transaction (replication from another node).
    Origin {
        /// LSN of the commit on the origin server.
        lsn: u64,
        /// Origin name.
        name: String,
    },
    /// The shape of a table.
    Relation(Relation),
    /// A data type (for custom types).
    Type {
        /// Type OID.
        id: u32,
        /// Schema name.
        namespace: String,
        /// Type name.
        name: String,
    },
    /// A row was inserted.
    Insert {
        /// Relation OID.
        relation: u32,
        /// The new row.
        new: Tuple,
    },
    /// A row was updated.
    Update {
        /// Relation OID.
        relation: u32,
        /// The old key or row, when the replica identity provides it.
        old: Option<(OldKind, Tuple)>,
        /// The new row.
        new: Tuple,
    },
    /// A row was deleted.
    Delete {
        /// Relation OID.
        relation: u32,
        /// The old key or row.
        old: (OldKind, Tuple),
    },
    /// Tables were truncated.
    Truncate {
        /// `CASCADE` (bit 1) and `RESTART IDENTITY` (bit 2).
        options: u8,
        /// Relation OIDs.
        relations: Vec<u32>,
    },
    /// A logical decoding message (`pg_logical_emit_message`).
    LogicalMessage {
        /// Whether it was transactional.
        transactional: bool,
        /// Its LSN.
        lsn: u64,
        /// Prefix.
        prefix: String,
        /// Content.
        content: Bytes,
    },
    /// A chunk of an in-progress transaction starts (v2).
    StreamStart {
        /// Transaction id.
        xid: u32,
        /// Whether this is the transaction's first chunk.
        first_segment: bool,
    },
    /// The current chunk of an in-progress transaction ends (v2).
    StreamStop,
    /// A streamed transaction committed (v2).
    StreamCommit {
        /// Transaction id.
        xid: u32,
        /// LSN of the commit record.
        commit_lsn: u64,
        /// LSN just past the commit record.
        end_lsn: u64,
        /// Commit time, microseconds since the Unix epoch.
        commit_time_us: i64,
    },
    /// A streamed (sub)transaction aborted (v2).
    StreamAbort {
        /// Top-level transaction id.
        xid: u32,
        /// The aborted subtransaction (equal to `xid` for the whole transaction).
        subxid: u32,
    },
}

/// A bounds-checked reader over one message.
struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, reason: impl Into<String>) -> Result<T, PgOutputError> {
        Err(PgOutputError {
            offset: self.pos,
            reason: reason.into(),
        })
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], PgOutputError> {
        let buf: &'a [u8] = self.buf.as_ref();
        match self.pos.checked_add(n).filter(|end| *end <= buf.len()) {
            Some(end) => {
                let s = &buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => self.fail(format!(
                "{what}: needs {n} bytes, {} left",
                buf.len() - self.pos
            )),
        }
    }

    fn u8(&mut self, what: &str) -> Result<u8, PgOutputError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, PgOutputError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, PgOutputError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes(b.try_into().expect("4 bytes")))
    }
    fn i32(&mut self, what: &str) -> Result<i32, PgOutputError> {
        Ok(self.u32(what)? as i32)
    }
    fn u64(&mut self, what: &str) -> Result<u64, PgOutputError> {
        let b = self.take(8, what)?;
        Ok(u64::from_be_bytes(b.try_into().expect("8 bytes")))
    }
    /// A PostgreSQL timestamp (µs since 2000-01-01) as µs since the Unix epoch.
    fn timestamp(&mut self, what: &str) -> Result<i64, PgOutputError> {
        let pg = self.u64(what)? as i64;
        Ok(pg.saturating_add(PG_EPOCH_OFFSET_MICROS))
    }
    fn cstring(&mut self, what: &str) -> Result<String, PgOutputError> {
        let rest = &self.buf[self.pos..];
        let Some(nul) = rest.iter().position(|&b| b == 0) else {
            return self.fail(format!("{what}: string without its NUL terminator"));
        };
        let s = match std::str::from_utf8(&rest[..nul]) {
            Ok(s) => s.to_owned(),
            Err(_) => return self.fail(format!("{what}: not UTF-8")),
        };
        self.pos += nul + 1;
        Ok(s)
    }

    fn tuple(&mut self) -> Result<Tuple, PgOutputError> {
        let n = self.u16("tuple column count")? as usize;
        // Each column takes at least one byte: a count beyond the input is malformed, and checking
        // it first keeps a hostile count from reserving memory.
        if n > self.buf.len() - self.pos {
            return self.fail(format!(
                "tuple claims {n} columns, more than the bytes left"
            ));
        }
        let mut tuple = Vec::with_capacity(n);
        for _ in 0..n {
            let datum = match self.u8("column kind")? {
                b'n' => Datum::Null,
                b'u' => Datum::UnchangedToast,
                kind @ (b't' | b'b') => {
                    let len = self.u32("column length")? as usize;
                    let start = self.pos;
                    self.take(len, "column value")?;
                    let value = self.buf.slice(start..start + len);
                    if kind == b't' {
                        Datum::Text(value)
                    } else {
                        Datum::Binary(value)
                    }
                }
                other => return self.fail(format!("unknown column kind {:?}", other as char)),
            };
            tuple.push(datum);
        }
        Ok(tuple)
    }

    fn done(&self) -> Result<(), PgOutputError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            self.fail(format!("{} trailing bytes", self.buf.len() - self.pos))
        }
    }
}

/// Decodes one pgoutput message. `in_stream`: between `StreamStart` and `StreamStop` of protocol
/// v2, where data messages carry a transaction id (which is skipped here: the stream says it).
pub fn decode(buf: &Bytes, in_stream: bool) -> Result<Message, PgOutputError> {
    let mut r = Reader { buf, pos: 0 };
    let tag = r.u8("message type")?;
    let streamed_xid = |r: &mut Reader<'_>| -> Result<(), PgOutputError> {
        if in_stream {
            r.u32("streamed transaction id")?;
        }
        Ok(())
    };
    let message = match tag {
        b'B' => Message::Begin {
            final_lsn: r.u64("final LSN")?,
            commit_time_us: r.timestamp("commit time")?,
            xid: r.u32("xid")?,
        },
        b'C' => {
            r.u8("commit flags")?;
            Message::Commit {
                commit_lsn: r.u64("commit LSN")?,
                end_lsn: r.u64("end LSN")?,
                commit_time_us: r.timestamp("commit time")?,
            }
        }
        b'O' => Message::Origin {
            lsn: r.u64("origin LSN")?,
            name: r.cstring("origin name")?,
        },
        b'R' => {
            streamed_xid(&mut r)?;
            let id = r.u32("relation id")?;
            let namespace = r.cstring("namespace")?;
            let name = r.cstring("relation name")?;
            let replica_identity = r.u8("replica identity")?;
            let n = r.u16("column count")? as usize;
            if n > buf.len() {
                return r.fail(format!("relation claims {n} columns"));
            }
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                let flags = r.u8("column flags")?;
                columns.push(Column {
                    key: flags & 1 == 1,
                    name: r.cstring("column name")?,
                    type_oid: r.u32("column type")?,
                    type_modifier: r.i32("column type modifier")?,
                });
            }
            Message::Relation(Relation {
                id,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => {
            streamed_xid(&mut r)?;
            Message::Type {
                id: r.u32("type id")?,
                namespace: r.cstring("type namespace")?,
                name: r.cstring("type name")?,
            }
        }
        b'I' => {
            streamed_xid(&mut r)?;
            let relation = r.u32("relation id")?;
            match r.u8("insert tuple marker")? {
                b'N' => Message::Insert {
                    relation,
                    new: r.tuple()?,
                },
                other => return r.fail(format!("insert expects 'N', found {:?}", other as char)),
            }
        }
        b'U' => {
            streamed_xid(&mut r)?;
            let relation = r.u32("relation id")?;
            let (old, marker) = match r.u8("update tuple marker")? {
                b'K' => (
                    Some((OldKind::Key, r.tuple()?)),
                    r.u8("update new-tuple marker")?,
                ),
                b'O' => (
                    Some((OldKind::Full, r.tuple()?)),
                    r.u8("update new-tuple marker")?,
                ),
                other => (None, other),
            };
            if marker != b'N' {
                return r.fail(format!("update expects 'N', found {:?}", marker as char));
            }
            Message::Update {
                relation,
                old,
                new: r.tuple()?,
            }
        }
        b'D' => {
            streamed_xid(&mut r)?;
            let relation = r.u32("relation id")?;
            let kind = match r.u8("delete tuple marker")? {
                b'K' => OldKind::Key,
                b'O' => OldKind::Full,
                other => {
                    return r.fail(format!(
                        "delete expects 'K' or 'O', found {:?}",
                        other as char
                    ));
                }
            };
            Message::Delete {
                relation,
                old: (kind, r.tuple()?),
            }
        }
        b'T' => {
            streamed_xid(&mut r)?;
            let n = r.u32("relation count")? as usize;
            let options = r.u8("truncate options")?;
            if n > buf.len() / 4 {
                return r.fail(format!("truncate claims {n} relations"));
            }
            let relations = (0..n)
                .map(|_| r.u32("relation id"))
                .collect::<Result<_, _>>()?;
            Message::Truncate { options, relations }
        }
        b'M' => {
            streamed_xid(&mut r)?;
            let transactional = r.u8("message flags")? & 1 == 1;
            let lsn = r.u64("message LSN")?;
            let prefix = r.cstring("message prefix")?;
            let len = r.u32("message length")? as usize;
            let start = r.pos;
            r.take(len, "message content")?;
            Message::LogicalMessage {
                transactional,
                lsn,
                prefix,
                content: buf.slice(start..start + len),
            }
        }
        b'S' => Message::StreamStart {
            xid: r.u32("xid")?,
            first_segment: r.u8("first segment")? == 1,
        },
        b'E' => Message::StreamStop,
        b'c' => {
            let xid = r.u32("xid")?;
            r.u8("commit flags")?;
            Message::StreamCommit {
                xid,
                commit_lsn: r.u64("commit LSN")?,
                end_lsn: r.u64("end LSN")?,
                commit_time_us: r.timestamp("commit time")?,
            }
        }
        b'A' => Message::StreamAbort {
            xid: r.u32("xid")?,
            subxid: r.u32("subxid")?,
        },
        other => return r.fail(format!("unknown message type {:?}", other as char)),
    };
    r.done()?;
    Ok(message)
}

#[cfg(test)]
mod tests;
