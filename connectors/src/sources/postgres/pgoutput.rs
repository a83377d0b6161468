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
    let message = match tag {
        b'B' => r.begin()?,
        b'C' => r.commit()?,
        b'O' => r.origin()?,
        b'R' => r.streamed(in_stream)?.relation()?,
        b'Y' => r.streamed(in_stream)?.data_type()?,
        b'I' => r.streamed(in_stream)?.insert()?,
        b'U' => r.streamed(in_stream)?.update()?,
        b'D' => r.streamed(in_stream)?.delete()?,
        b'T' => r.streamed(in_stream)?.truncate()?,
        b'M' => r.streamed(in_stream)?.logical_message()?,
        b'S' => r.stream_start()?,
        b'E' => Message::StreamStop,
        b'c' => r.stream_commit()?,
        b'A' => r.stream_abort()?,
        other => return r.fail(format!("unknown message type {:?}", other as char)),
    };
    r.done()?;
    Ok(message)
}

/// The body of each message kind, read after its type byte.
impl Reader<'_> {
    /// Skips the transaction id that data messages carry inside a streamed transaction (v2).
    fn streamed(&mut self, in_stream: bool) -> Result<&mut Self, PgOutputError> {
        if in_stream {
            self.u32("streamed transaction id")?;
        }
        Ok(self)
    }

    /// `B`: a transaction begins.
    fn begin(&mut self) -> Result<Message, PgOutputError> {
        Ok(Message::Begin {
            final_lsn: self.u64("final LSN")?,
            commit_time_us: self.timestamp("commit time")?,
            xid: self.u32("xid")?,
        })
    }

    /// `C`: a transaction committed.
    fn commit(&mut self) -> Result<Message, PgOutputError> {
        self.u8("commit flags")?;
        Ok(Message::Commit {
            commit_lsn: self.u64("commit LSN")?,
            end_lsn: self.u64("end LSN")?,
            commit_time_us: self.timestamp("commit time")?,
        })
    }

    /// `O`: the transaction's origin.
    fn origin(&mut self) -> Result<Message, PgOutputError> {
        Ok(Message::Origin {
            lsn: self.u64("origin LSN")?,
            name: self.cstring("origin name")?,
        })
    }

    /// `R`: a table's shape and columns.
    fn relation(&mut self) -> Result<Message, PgOutputError> {
        let id = self.u32("relation id")?;
        let namespace = self.cstring("namespace")?;
        let name = self.cstring("relation name")?;
        let replica_identity = self.u8("replica identity")?;
        let n = self.u16("column count")? as usize;
        if n > self.buf.len() {
            return self.fail(format!("relation claims {n} columns"));
        }
        let mut columns = Vec::with_capacity(n);
        for _ in 0..n {
            let flags = self.u8("column flags")?;
            columns.push(Column {
                key: flags & 1 == 1,
                name: self.cstring("column name")?,
                type_oid: self.u32("column type")?,
                type_modifier: self.i32("column type modifier")?,
            });
        }
        Ok(Message::Relation(Relation {
            id,
            namespace,
            name,
            replica_identity,
            columns,
        }))
    }

    /// `Y`: a data type.
    fn data_type(&mut self) -> Result<Message, PgOutputError> {
        Ok(Message::Type {
            id: self.u32("type id")?,
            namespace: self.cstring("type namespace")?,
            name: self.cstring("type name")?,
        })
    }

    /// `I`: an inserted row.
    fn insert(&mut self) -> Result<Message, PgOutputError> {
        let relation = self.u32("relation id")?;
        match self.u8("insert tuple marker")? {
            b'N' => Ok(Message::Insert {
                relation,
                new: self.tuple()?,
            }),
            other => self.fail(format!("insert expects 'N', found {:?}", other as char)),
        }
    }

    /// `U`: an updated row, with its old key or row when the replica identity gives it.
    fn update(&mut self) -> Result<Message, PgOutputError> {
        let relation = self.u32("relation id")?;
        let (old, marker) = match self.u8("update tuple marker")? {
            b'K' => (
                Some((OldKind::Key, self.tuple()?)),
                self.u8("update new-tuple marker")?,
            ),
            b'O' => (
                Some((OldKind::Full, self.tuple()?)),
                self.u8("update new-tuple marker")?,
            ),
            other => (None, other),
        };
        if marker != b'N' {
            return self.fail(format!("update expects 'N', found {:?}", marker as char));
        }
        Ok(Message::Update {
            relation,
            old,
            new: self.tuple()?,
        })
    }

    /// `D`: a deleted row's old key or row.
    fn delete(&mut self) -> Result<Message, PgOutputError> {
        let relation = self.u32("relation id")?;
        let kind = match self.u8("delete tuple marker")? {
            b'K' => OldKind::Key,
            b'O' => OldKind::Full,
            other => {
                return self.fail(format!(
                    "delete expects 'K' or 'O', found {:?}",
                    other as char
                ));
            }
        };
        Ok(Message::Delete {
            relation,
            old: (kind, self.tuple()?),
        })
    }

    /// `T`: truncated tables.
    fn truncate(&mut self) -> Result<Message, PgOutputError> {
        let n = self.u32("relation count")? as usize;
        let options = self.u8("truncate options")?;
        if n > self.buf.len() / 4 {
            return self.fail(format!("truncate claims {n} relations"));
        }
        let relations = (0..n)
            .map(|_| self.u32("relation id"))
            .collect::<Result<_, _>>()?;
        Ok(Message::Truncate { options, relations })
    }

    /// `M`: a logical decoding message.
    fn logical_message(&mut self) -> Result<Message, PgOutputError> {
        let transactional = self.u8("message flags")? & 1 == 1;
        let lsn = self.u64("message LSN")?;
        let prefix = self.cstring("message prefix")?;
        let len = self.u32("message length")? as usize;
        let start = self.pos;
        self.take(len, "message content")?;
        Ok(Message::LogicalMessage {
            transactional,
            lsn,
            prefix,
            content: self.buf.slice(start..start + len),
        })
    }

    /// `S`: a chunk of an in-progress transaction starts (v2).
    fn stream_start(&mut self) -> Result<Message, PgOutputError> {
        Ok(Message::StreamStart {
            xid: self.u32("xid")?,
            first_segment: self.u8("first segment")? == 1,
        })
    }

    /// `c`: a streamed transaction committed (v2).
    fn stream_commit(&mut self) -> Result<Message, PgOutputError> {
        let xid = self.u32("xid")?;
        self.u8("commit flags")?;
        Ok(Message::StreamCommit {
            xid,
            commit_lsn: self.u64("commit LSN")?,
            end_lsn: self.u64("end LSN")?,
            commit_time_us: self.timestamp("commit time")?,
        })
    }

    /// `A`: a streamed (sub)transaction aborted (v2).
    fn stream_abort(&mut self) -> Result<Message, PgOutputError> {
        Ok(Message::StreamAbort {
            xid: self.u32("xid")?,
            subxid: self.u32("subxid")?,
        })
    }
}

#[cfg(test)]
mod tests;
