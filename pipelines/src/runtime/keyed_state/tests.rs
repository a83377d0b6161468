use redb::ReadableTableMetadata;

use super::*;

/// A new store in a directory of its own (kept while the directory lives).
fn fresh() -> (tempfile::TempDir, KeyedState) {
    let dir = tempfile::tempdir().unwrap();
    let (state, _) = KeyedState::open(&dir.path().join("s.redb"), &Checkpoint::new()).unwrap();
    (dir, state)
}

fn cp(offset: u64) -> Checkpoint {
    Checkpoint::from([("p".to_string(), Offset(offset, 0))])
}

fn end(offset: u64) -> Vec<(String, Offset)> {
    vec![("p".to_string(), Offset(offset, 0))]
}

fn all(store: &mut Box<dyn StateStore>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    store
        .scan_prefix(b"", &mut |k, v| {
            out.push((
                String::from_utf8(k.to_vec()).unwrap(),
                String::from_utf8(v.to_vec()).unwrap(),
            ));
            true
        })
        .unwrap();
    out
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn scanned(store: &mut Box<dyn StateStore>, prefix: &[u8]) -> Vec<String> {
    let mut seen = Vec::new();
    store
        .scan_prefix(prefix, &mut |k, v| {
            seen.push(format!(
                "{}={}",
                String::from_utf8_lossy(k),
                String::from_utf8_lossy(v)
            ));
            true
        })
        .unwrap();
    seen
}

#[test]
fn a_restart_undoes_every_batch_past_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    {
        let (state, recovery) = KeyedState::open(&path, &Checkpoint::new()).unwrap();
        assert_eq!(recovery, Recovery::default());
        let mut s = state.handle("doc");
        s.put(b"a", b"1").unwrap();
        s.put(b"b", b"1").unwrap();
        state.commit(end(1), &Checkpoint::new()).unwrap();
        // Batch 2: a changed, b removed, c added; batch 3: a changed again.
        s.put(b"a", b"2").unwrap();
        s.remove(b"b").unwrap();
        s.put(b"c", b"2").unwrap();
        state.commit(end(2), &cp(1)).unwrap();
        s.put(b"a", b"3").unwrap();
        state.commit(end(3), &cp(1)).unwrap();
        assert_eq!(all(&mut s), pairs(&[("a", "3"), ("c", "2")]));
        // Written but never committed: lost with the process.
        s.put(b"z", b"9").unwrap();
    }
    // The checkpoint says batch 1 is the last one the sinks made durable.
    let (state, recovery) = KeyedState::open(&path, &cp(1)).unwrap();
    assert_eq!(
        recovery,
        Recovery {
            batches_undone: 2,
            keys_restored: 4
        }
    );
    let mut s = state.handle("doc");
    assert_eq!(all(&mut s), pairs(&[("a", "1"), ("b", "1")]));
    // The undo records are gone with the recovery: state and checkpoint agree from here on.
    drop((s, state));
    let (state, recovery) = KeyedState::open(&path, &Checkpoint::new()).unwrap();
    assert_eq!(recovery, Recovery::default());
    assert_eq!(
        all(&mut state.handle("doc")),
        pairs(&[("a", "1"), ("b", "1")])
    );
}

#[test]
fn covered_batches_are_kept_and_their_undo_records_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    {
        let (state, _) = KeyedState::open(&path, &Checkpoint::new()).unwrap();
        let mut s = state.handle("doc");
        s.put(b"a", b"1").unwrap();
        state.commit(end(1), &Checkpoint::new()).unwrap();
        s.put(b"a", b"2").unwrap();
        // Batch 1 is durable now: its undo record goes in this commit.
        state.commit(end(2), &cp(1)).unwrap();
        let inner = state.lock();
        assert_eq!(inner.undoable.len(), 1);
        let txn = inner.db.begin_read().unwrap();
        assert_eq!(txn.open_table(UNDO).unwrap().len().unwrap(), 1);
        assert_eq!(txn.open_table(BATCHES).unwrap().len().unwrap(), 1);
    }
    let (state, recovery) = KeyedState::open(&path, &cp(2)).unwrap();
    assert_eq!(recovery.batches_undone, 0);
    assert_eq!(
        state.handle("doc").get(b"a").unwrap().as_deref(),
        Some(&b"2"[..])
    );
}

#[test]
fn scans_merge_pending_writes_over_committed_ones_per_projection() {
    let (_dir, state) = fresh();
    let mut a = state.handle("a");
    let mut b = state.handle("b");
    for k in ["k1", "k2", "k4", "x"] {
        a.put(k.as_bytes(), b"old").unwrap();
    }
    b.put(b"k3", b"other projection").unwrap();
    state.commit(end(1), &Checkpoint::new()).unwrap();
    a.put(b"k2", b"new").unwrap();
    a.remove(b"k4").unwrap();
    a.put(b"k3", b"added").unwrap();
    a.put(b"k5", b"added").unwrap();
    assert_eq!(
        scanned(&mut a, b"k"),
        ["k1=old", "k2=new", "k3=added", "k5=added"]
    );
    // Stopping early stops.
    let mut count = 0;
    a.scan_prefix(b"k", &mut |_, _| {
        count += 1;
        count < 2
    })
    .unwrap();
    assert_eq!(count, 2);
    assert_eq!(a.get(b"k4").unwrap(), None);
    assert_eq!(b.get(b"k2").unwrap(), None);
    assert_eq!(all(&mut b), pairs(&[("k3", "other projection")]));
}

#[test]
fn a_batch_being_committed_stays_readable_under_the_next_ones_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    {
        let (state, _) = KeyedState::open(&path, &Checkpoint::new()).unwrap();
        let mut a = state.handle("a");
        for k in ["k1", "k2", "k3", "k4"] {
            a.put(k.as_bytes(), b"committed").unwrap();
        }
        state.commit(end(1), &Checkpoint::new()).unwrap();
        // Batch 2, begun but not yet written: a reader sees it over the committed entries.
        a.put(b"k2", b"committing").unwrap();
        a.remove(b"k3").unwrap();
        a.put(b"k5", b"committing").unwrap();
        a.put(b"k6", b"committing").unwrap();
        let commit = state.begin_commit(end(2), &cp(1)).unwrap();
        // Batch 3 writes over both.
        a.put(b"k1", b"pending").unwrap();
        a.remove(b"k5").unwrap();
        a.put(b"k3", b"pending").unwrap();
        let expected = [
            "k1=pending",
            "k2=committing",
            "k3=pending",
            "k4=committed",
            "k6=committing",
        ];
        assert_eq!(scanned(&mut a, b"k"), expected);
        assert_eq!(a.get(b"k5").unwrap(), None);
        assert_eq!(a.get(b"k2").unwrap().as_deref(), Some(&b"committing"[..]));
        // One commit at a time.
        assert!(state.begin_commit(end(3), &cp(1)).is_err());
        commit.run().unwrap();
        // Written: the same entries, now from the committed table.
        assert_eq!(scanned(&mut a, b"k"), expected);
        state.commit(end(3), &cp(1)).unwrap();
        assert_eq!(scanned(&mut a, b"k"), expected);
    }
    // Batches 2 and 3 were not covered by a checkpoint: undone, newest first.
    let (state, recovery) = KeyedState::open(&path, &cp(1)).unwrap();
    assert_eq!(recovery.batches_undone, 2);
    let mut a = state.handle("a");
    assert_eq!(
        scanned(&mut a, b""),
        [
            "k1=committed",
            "k2=committed",
            "k3=committed",
            "k4=committed"
        ]
    );
}

#[test]
fn a_key_put_and_removed_in_one_batch_is_forgotten_unless_a_value_lies_below() {
    let (_dir, state) = fresh();
    let mut a = state.handle("a");
    // Only the pending overlay held it: nothing is left to walk past.
    a.put(b"mark", b"").unwrap();
    a.remove(b"mark").unwrap();
    assert!(state.lock().pending.is_empty());
    // Committed below: the removal must be kept, and committed.
    a.put(b"c", b"1").unwrap();
    state.commit(end(1), &Checkpoint::new()).unwrap();
    a.put(b"c", b"2").unwrap();
    a.remove(b"c").unwrap();
    // Held by the batch being committed: the removal must be kept too.
    a.put(b"m", b"1").unwrap();
    let commit = state.begin_commit(end(2), &cp(1)).unwrap();
    a.put(b"m", b"2").unwrap();
    a.remove(b"m").unwrap();
    assert_eq!(a.get(b"c").unwrap(), None);
    assert_eq!(a.get(b"m").unwrap(), None);
    commit.run().unwrap();
    state.commit(end(3), &cp(2)).unwrap();
    assert_eq!(all(&mut a), pairs(&[]));
}

#[test]
fn a_prefix_found_empty_is_scanned_again_once_a_commit_wrote_under_it() {
    let (_dir, state) = fresh();
    let mut a = state.handle("a");
    a.put(b"other", b"1").unwrap();
    state.commit(end(1), &Checkpoint::new()).unwrap();
    assert!(scanned(&mut a, b"d").is_empty());
    a.put(b"d1", b"x").unwrap();
    assert_eq!(scanned(&mut a, b"d"), ["d1=x"]);
    state.commit(end(2), &cp(1)).unwrap();
    assert_eq!(scanned(&mut a, b"d"), ["d1=x"]);
    // A point read under the prefix found empty before the commit, too.
    assert_eq!(a.get(b"d1").unwrap().as_deref(), Some(&b"x"[..]));
    // Written while a commit runs, read from the committing overlay, then from the table.
    a.put(b"d2", b"y").unwrap();
    let commit = state.begin_commit(end(3), &cp(2)).unwrap();
    assert_eq!(scanned(&mut a, b"d"), ["d1=x", "d2=y"]);
    commit.run().unwrap();
    assert_eq!(scanned(&mut a, b"d"), ["d1=x", "d2=y"]);
}

/// The shipped book documents' projection, on a store handle.
fn book_docs(state: &KeyedState) -> Box<dyn refract_projections::Projection> {
    let text = include_str!("../../../authors-books.toml");
    let loaded = refract_schemas::config::load_str("authors-books.toml", text, &|_| None, None)
        .expect("the shipped pipeline loads");
    let mut projection = refract_projections::build(&loaded.config.projections["book_docs"]);
    assert!(projection.wants_store());
    projection.attach_store(state.handle("book_docs"));
    projection
}

/// Projects one source transaction of (table, op, row) changes at `lsn`; returns the documents
/// it emits as `key -> document`.
fn transaction(
    projection: &mut dyn refract_projections::Projection,
    lsn: u64,
    changes: &[(&str, &str, serde_json::Value)],
) -> Vec<(String, serde_json::Value)> {
    let mut ops = Vec::new();
    for (n, (table, op, row)) in changes.iter().enumerate() {
        let envelope = serde_json::json!({
            "before": if *op == "d" { row.clone() } else { serde_json::Value::Null },
            "after": if *op == "d" { serde_json::Value::Null } else { row.clone() },
            "op": op, "source": {"schema": "public", "table": table}});
        let position = refract_schemas::Position {
            partition: "p".into(),
            offset: Offset(lsn, n as u64 + 1),
        };
        let refract_schemas::Record::Change(event) =
            refract_schemas::debezium::DebeziumDecoder::new()
                .decode(envelope.to_string().as_bytes(), position)
                .unwrap()
        else {
            panic!("a change")
        };
        projection.project(&event, 0, &mut ops).unwrap();
    }
    let end = refract_schemas::Position {
        partition: "p".into(),
        offset: Offset(lsn, u64::MAX),
    };
    while projection
        .end_transaction(&end, usize::MAX, &mut ops)
        .unwrap()
        == refract_projections::Emission::More
    {}
    ops.into_iter()
        .map(|op| match op {
            refract_projections::WriteOp::Document(refract_projections::DocumentOp::Upsert {
                key,
                doc,
                ..
            }) => (key, serde_json::Value::from((*doc).clone())),
            other => panic!("{other:?}"),
        })
        .collect()
}

#[test]
fn a_transaction_written_to_the_state_but_never_checkpointed_leaves_no_trace() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let author = |first: &str| serde_json::json!({"id": "a1", "first_name": first, "last_name": "Andersen", "thumbnail_url": null});
    {
        let (state, _) = KeyedState::open(&path, &Checkpoint::new()).unwrap();
        let mut books = book_docs(&state);
        let docs = transaction(
            &mut *books,
            1,
            &[
                ("authors", "c", author("Thomas")),
                (
                    "books",
                    "c",
                    serde_json::json!({"id": "b1", "name": "Cosmos 101"}),
                ),
                (
                    "book_authors",
                    "c",
                    serde_json::json!({"book_id": "b1", "author_id": "a1", "position": 0}),
                ),
            ],
        );
        assert_eq!(docs[0].1["authors"][0]["name"], "Thomas Andersen");
        state.commit(end(1), &Checkpoint::new()).unwrap();
        // The rename is projected and its state made durable, but the process dies before the
        // sinks acknowledge it: the checkpoint stays at 1 and the source sends something else
        // next (the rename's transaction was rolled back, or is replayed).
        let docs = transaction(&mut *books, 2, &[("authors", "u", author("Renamed"))]);
        assert_eq!(docs[0].1["authors"][0]["name"], "Renamed Andersen");
        state.commit(end(2), &cp(1)).unwrap();
    }
    let (state, recovery) = KeyedState::open(&path, &cp(1)).unwrap();
    assert_eq!(recovery.batches_undone, 1);
    let mut books = book_docs(&state);
    let docs = transaction(
        &mut *books,
        3,
        &[(
            "books",
            "u",
            serde_json::json!({"id": "b1", "name": "Cosmos 102"}),
        )],
    );
    assert_eq!(
        docs,
        vec![(
            "b1".to_owned(),
            serde_json::json!({"id": "b1", "name": "Cosmos 102",
                "authors": [{"id": "a1", "name": "Thomas Andersen", "thumbnailUrl": null}]})
        )]
    );
}
