use proptest::prelude::*;

use super::*;

/// Test-only encoder: writes messages exactly as the protocol documentation lays them out.
fn encode(m: &Message, in_stream: bool) -> Vec<u8> {
    fn tuple(out: &mut Vec<u8>, t: &Tuple) {
        out.extend((t.len() as u16).to_be_bytes());
        for d in t {
            match d {
                Datum::Null => out.push(b'n'),
                Datum::UnchangedToast => out.push(b'u'),
                Datum::Text(b) | Datum::Binary(b) => {
                    out.push(if matches!(d, Datum::Text(_)) {
                        b't'
                    } else {
                        b'b'
                    });
                    out.extend((b.len() as u32).to_be_bytes());
                    out.extend(b.iter());
                }
            }
        }
    }
    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend(s.as_bytes());
        out.push(0);
    }
    let ts = |us: i64| ((us - PG_EPOCH_OFFSET_MICROS) as u64).to_be_bytes();
    let xid = |out: &mut Vec<u8>| {
        if in_stream {
            out.extend(777u32.to_be_bytes());
        }
    };
    let mut out = Vec::new();
    match m {
        Message::Begin {
            final_lsn,
            commit_time_us,
            xid,
        } => {
            out.push(b'B');
            out.extend(final_lsn.to_be_bytes());
            out.extend(ts(*commit_time_us));
            out.extend(xid.to_be_bytes());
        }
        Message::Commit {
            commit_lsn,
            end_lsn,
            commit_time_us,
        } => {
            out.push(b'C');
            out.push(0);
            out.extend(commit_lsn.to_be_bytes());
            out.extend(end_lsn.to_be_bytes());
            out.extend(ts(*commit_time_us));
        }
        Message::Origin { lsn, name } => {
            out.push(b'O');
            out.extend(lsn.to_be_bytes());
            cstr(&mut out, name);
        }
        Message::Relation(r) => {
            out.push(b'R');
            xid(&mut out);
            out.extend(r.id.to_be_bytes());
            cstr(&mut out, &r.namespace);
            cstr(&mut out, &r.name);
            out.push(r.replica_identity);
            out.extend((r.columns.len() as u16).to_be_bytes());
            for c in &r.columns {
                out.push(u8::from(c.key));
                cstr(&mut out, &c.name);
                out.extend(c.type_oid.to_be_bytes());
                out.extend(c.type_modifier.to_be_bytes());
            }
        }
        Message::Type {
            id,
            namespace,
            name,
        } => {
            out.push(b'Y');
            xid(&mut out);
            out.extend(id.to_be_bytes());
            cstr(&mut out, namespace);
            cstr(&mut out, name);
        }
        Message::Insert { relation, new } => {
            out.push(b'I');
            xid(&mut out);
            out.extend(relation.to_be_bytes());
            out.push(b'N');
            tuple(&mut out, new);
        }
        Message::Update { relation, old, new } => {
            out.push(b'U');
            xid(&mut out);
            out.extend(relation.to_be_bytes());
            if let Some((kind, t)) = old {
                out.push(if *kind == OldKind::Key { b'K' } else { b'O' });
                tuple(&mut out, t);
            }
            out.push(b'N');
            tuple(&mut out, new);
        }
        Message::Delete {
            relation,
            old: (kind, t),
        } => {
            out.push(b'D');
            xid(&mut out);
            out.extend(relation.to_be_bytes());
            out.push(if *kind == OldKind::Key { b'K' } else { b'O' });
            tuple(&mut out, t);
        }
        Message::Truncate { options, relations } => {
            out.push(b'T');
            xid(&mut out);
            out.extend((relations.len() as u32).to_be_bytes());
            out.push(*options);
            for r in relations {
                out.extend(r.to_be_bytes());
            }
        }
        Message::LogicalMessage {
            transactional,
            lsn,
            prefix,
            content,
        } => {
            out.push(b'M');
            xid(&mut out);
            out.push(u8::from(*transactional));
            out.extend(lsn.to_be_bytes());
            cstr(&mut out, prefix);
            out.extend((content.len() as u32).to_be_bytes());
            out.extend(content.iter());
        }
        Message::StreamStart { xid, first_segment } => {
            out.push(b'S');
            out.extend(xid.to_be_bytes());
            out.push(u8::from(*first_segment));
        }
        Message::StreamStop => out.push(b'E'),
        Message::StreamCommit {
            xid,
            commit_lsn,
            end_lsn,
            commit_time_us,
        } => {
            out.push(b'c');
            out.extend(xid.to_be_bytes());
            out.push(0);
            out.extend(commit_lsn.to_be_bytes());
            out.extend(end_lsn.to_be_bytes());
            out.extend(ts(*commit_time_us));
        }
        Message::StreamAbort { xid, subxid } => {
            out.push(b'A');
            out.extend(xid.to_be_bytes());
            out.extend(subxid.to_be_bytes());
        }
    }
    out
}

fn text(s: &str) -> Datum {
    Datum::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn samples() -> Vec<Message> {
    vec![
        Message::Begin {
            final_lsn: 0x16B3748,
            commit_time_us: 1_790_000_000_123_456,
            xid: 731,
        },
        Message::Commit {
            commit_lsn: 0x16B3748,
            end_lsn: 0x16B3778,
            commit_time_us: 1_790_000_000_123_456,
        },
        Message::Origin {
            lsn: 99,
            name: "node_a".into(),
        },
        Message::Relation(Relation {
            id: 16385,
            namespace: "public".into(),
            name: "products".into(),
            replica_identity: b'f',
            columns: vec![
                Column {
                    key: true,
                    name: "id".into(),
                    type_oid: 20,
                    type_modifier: -1,
                },
                Column {
                    key: false,
                    name: "price".into(),
                    type_oid: 1700,
                    type_modifier: (12 << 16 | 2) + 4,
                },
            ],
        }),
        Message::Type {
            id: 90001,
            namespace: "public".into(),
            name: "mood".into(),
        },
        Message::Insert {
            relation: 16385,
            new: vec![text("42"), Datum::Null],
        },
        Message::Update {
            relation: 16385,
            old: None,
            new: vec![text("42"), Datum::UnchangedToast],
        },
        Message::Update {
            relation: 16385,
            old: Some((OldKind::Key, vec![text("41"), Datum::Null])),
            new: vec![text("42"), text("1.50")],
        },
        Message::Update {
            relation: 16385,
            old: Some((OldKind::Full, vec![text("42"), text("1.00")])),
            new: vec![text("42"), text("1.50")],
        },
        Message::Delete {
            relation: 16385,
            old: (
                OldKind::Full,
                vec![text("42"), Datum::Binary(Bytes::from_static(&[0, 1, 2]))],
            ),
        },
        Message::Truncate {
            options: 3,
            relations: vec![16385, 16390],
        },
        Message::LogicalMessage {
            transactional: true,
            lsn: 5,
            prefix: "refract".into(),
            content: Bytes::from_static(b"watermark"),
        },
        Message::StreamStart {
            xid: 777,
            first_segment: true,
        },
        Message::StreamStop,
        Message::StreamCommit {
            xid: 777,
            commit_lsn: 10,
            end_lsn: 20,
            commit_time_us: 1_790_000_000_000_000,
        },
        Message::StreamAbort {
            xid: 777,
            subxid: 778,
        },
    ]
}

#[test]
fn every_message_kind_round_trips() {
    for in_stream in [false, true] {
        for m in samples() {
            let bytes = Bytes::from(encode(&m, in_stream));
            assert_eq!(
                decode(&bytes, in_stream).as_ref(),
                Ok(&m),
                "{m:?} (in stream: {in_stream})"
            );
        }
    }
}

#[test]
fn every_cut_short_message_is_an_error_with_its_offset() {
    for m in samples() {
        let full = encode(&m, false);
        for cut in 0..full.len() {
            let err = decode(&Bytes::copy_from_slice(&full[..cut]), false)
                .expect_err("a cut message must not decode");
            assert!(err.offset <= cut, "{m:?} cut at {cut}: {err}");
        }
        let mut longer = full.clone();
        longer.push(0);
        assert!(
            decode(&Bytes::from(longer), false)
                .unwrap_err()
                .reason
                .contains("trailing")
        );
    }
}

/// Inputs that once broke the decoder (or were built to): kept so they never do again.
#[test]
fn regressions() {
    let cases: &[&[u8]] = &[
        b"",
        b"Z",
        // A tuple claiming 65535 columns in a 12-byte message.
        &[
            b'I', 0, 0, 0x40, 1, b'N', 0xff, 0xff, b't', 0xff, 0xff, 0xff,
        ],
        // A column length of 4 GiB.
        &[
            b'I', 0, 0, 0x40, 1, b'N', 0, 1, b't', 0xff, 0xff, 0xff, 0xff, b'x',
        ],
        // A truncate of 2^32-1 relations.
        &[b'T', 0xff, 0xff, 0xff, 0xff, 0],
        // A relation name without its NUL.
        &[b'R', 0, 0, 0x40, 1, b'p', b'u', b'b'],
        // Invalid UTF-8 in a name.
        &[b'Y', 0, 0, 0, 1, 0xff, 0xfe, 0, b'x', 0],
    ];
    for case in cases {
        assert!(
            decode(&Bytes::copy_from_slice(case), false).is_err(),
            "{case:?}"
        );
    }
}

fn datum() -> impl Strategy<Value = Datum> {
    prop_oneof![
        Just(Datum::Null),
        Just(Datum::UnchangedToast),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| Datum::Text(Bytes::from(b))),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| Datum::Binary(Bytes::from(b))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// The fuzz test: arbitrary bytes, and arbitrary bytes after each valid message type byte,
    /// never panic and never read out of bounds.
    #[test]
    fn arbitrary_bytes_never_panic(tag in prop::sample::select(b"BCORYIUDTMSEcAxZ".to_vec()), body in proptest::collection::vec(any::<u8>(), 0..200), in_stream in any::<bool>()) {
        let mut bytes = vec![tag];
        bytes.extend(body);
        let _ = decode(&Bytes::from(bytes), in_stream);
    }

    #[test]
    fn arbitrary_tuples_round_trip(
        old in proptest::option::of(proptest::collection::vec(datum(), 0..12)),
        new in proptest::collection::vec(datum(), 0..12),
        relation in any::<u32>(),
    ) {
        let m = Message::Update { relation, old: old.map(|t| (OldKind::Full, t)), new };
        let bytes = Bytes::from(encode(&m, false));
        prop_assert_eq!(decode(&bytes, false), Ok(m));
    }
}
