//! Unit tests of the Parquet sink on a local directory: rolling, acknowledgements, replays cut
//! back to the checkpoint, schema versions, compaction.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use refract_schemas::config::ParquetSinkConfig;
use refract_schemas::write::WriteOp;
use refract_schemas::write::flat::{
    FlatChange, FlatColumn, FlatOp, FlatSchema, FlatType, FlatValue,
};
use refract_schemas::{Checkpoint, Offset, Position};

use super::survivors::PARTITION_ROWS;
use super::*;

fn config(dir: &std::path::Path) -> ParquetSinkConfig {
    ParquetSinkConfig {
        url: format!("file://{}", dir.display()).into(),
        zstd_level: 3,
        row_group_rows: 1_000,
        roll_rows: 1_000_000,
        roll_bytes: 1 << 30,
        roll_ms: 3_600_000,
        buffer_bytes: 1 << 30,
        compact_interval_ms: 0,
        change_retention_days: 0,
    }
}

fn schema(table: &str, version: u32, extra: bool, group: bool) -> Arc<FlatSchema> {
    let mut columns = vec![
        FlatColumn {
            name: "id".into(),
            ty: FlatType::String,
        },
        FlatColumn {
            name: "n".into(),
            ty: FlatType::Int64,
        },
    ];
    if extra {
        columns.push(FlatColumn {
            name: "extra".into(),
            ty: FlatType::String,
        });
    }
    Arc::new(FlatSchema {
        table: table.into(),
        version,
        columns,
        key: if group { vec![0, 1] } else { vec![0] },
        group: if group { vec![0] } else { vec![] },
    })
}

fn op(schema: &Arc<FlatSchema>, kind: FlatOp, id: &str, n: i64, at: u64) -> WriteOp {
    let mut values = vec![FlatValue::Str(id.into()), FlatValue::Int(n)];
    if schema.columns.len() > 2 {
        values.push(FlatValue::Str(format!("x{n}")));
    }
    WriteOp::Row(RowChange {
        change: FlatChange {
            schema: schema.clone(),
            op: kind,
            values,
            commit_ts_ms: Some(1_790_000_000_000),
        },
        position: Position {
            partition: "slot".into(),
            offset: Offset(at, 0),
        },
    })
}

fn batch(seq: u64, ops: Vec<WriteOp>) -> SinkBatch {
    SinkBatch { seq, ops }
}

/// Relative paths of the `.parquet` files under `dir`.
fn files(dir: &std::path::Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                found.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    found.sort();
    found
}

/// (id, n) of every row of a Parquet file.
fn rows(path: &std::path::Path) -> Vec<(String, i64)> {
    let bytes = bytes::Bytes::from(std::fs::read(path).unwrap());
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)
        .unwrap()
        .build()
        .unwrap();
    let mut out = Vec::new();
    for b in reader {
        let b = b.unwrap();
        let ids = b.column_by_name("id").unwrap().as_string::<i32>().clone();
        let ns = b
            .column_by_name("n")
            .unwrap()
            .as_primitive::<Int64Type>()
            .clone();
        for i in 0..b.num_rows() {
            out.push((ids.value(i).to_owned(), ns.value(i)));
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn batches_are_acknowledged_once_their_file_is_published() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = ParquetSink::new(
        "pq",
        ParquetSinkConfig {
            roll_rows: 3,
            ..config(dir.path())
        },
    );
    sink.open(&Checkpoint::new()).await.unwrap();
    let s = schema("t", 1, false, false);
    sink.write(&batch(
        1,
        vec![
            op(&s, FlatOp::Upsert, "a", 1, 10),
            op(&s, FlatOp::Upsert, "b", 1, 20),
        ],
    ))
    .await
    .unwrap();
    assert_eq!(
        sink.buffered().map(|b| b.durable_through),
        Some(0),
        "buffered, not published"
    );
    assert!(files(dir.path()).is_empty());
    // A retried write of the same batch is not buffered twice.
    sink.write(&batch(
        1,
        vec![
            op(&s, FlatOp::Upsert, "a", 1, 10),
            op(&s, FlatOp::Upsert, "b", 1, 20),
        ],
    ))
    .await
    .unwrap();
    sink.write(&batch(
        2,
        vec![
            op(&s, FlatOp::Upsert, "c", 1, 30),
            op(&s, FlatOp::Delete, "a", 0, 40),
        ],
    ))
    .await
    .unwrap();
    assert_eq!(
        sink.buffered().map(|b| b.durable_through),
        Some(2),
        "4 rows reached roll_rows = 3"
    );
    let published = files(dir.path());
    assert_eq!(published.len(), 1, "{published:?}");
    assert!(
        published[0].starts_with("t/changes/date=2026-09-21/"),
        "{published:?}"
    );
    assert_eq!(rows(&dir.path().join(&published[0])).len(), 4);
    sink.write(&batch(3, vec![op(&s, FlatOp::Upsert, "d", 1, 50)]))
        .await
        .unwrap();
    assert_eq!(sink.buffered().map(|b| b.durable_through), Some(2));
    assert!(
        sink.buffered().and_then(|b| b.flush_deadline).is_some(),
        "an open file has a deadline"
    );
    sink.flush().await.unwrap();
    assert_eq!(sink.buffered().map(|b| b.durable_through), Some(3));
    assert_eq!(files(dir.path()).len(), 2);
}

#[tokio::test]
async fn a_newer_schema_starts_a_new_file_and_older_rows_get_its_columns() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = ParquetSink::new("pq", config(dir.path()));
    sink.open(&Checkpoint::new()).await.unwrap();
    let (v1, v2) = (schema("t", 1, false, false), schema("t", 2, true, false));
    sink.write(&batch(1, vec![op(&v1, FlatOp::Upsert, "a", 1, 10)]))
        .await
        .unwrap();
    sink.write(&batch(
        2,
        vec![
            op(&v1, FlatOp::Upsert, "b", 1, 20),
            op(&v2, FlatOp::Upsert, "c", 1, 30),
        ],
    ))
    .await
    .unwrap();
    assert_eq!(
        sink.buffered().map(|b| b.durable_through),
        Some(1),
        "the v1 file was published before the v2 batch"
    );
    sink.close().await.unwrap();
    let published = files(dir.path());
    assert_eq!(published.len(), 2, "{published:?}");
    let bytes = bytes::Bytes::from(std::fs::read(dir.path().join(&published[1])).unwrap());
    let builder =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap();
    assert!(builder.schema().field_with_name("extra").is_ok());
    assert_eq!(builder.schema().metadata()["refract.schema_version"], "2");
}

#[tokio::test]
async fn a_restart_drops_what_was_published_past_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let s = schema("t", 1, false, false);
    let mut sink = ParquetSink::new("pq", config(dir.path()));
    sink.open(&Checkpoint::new()).await.unwrap();
    sink.write(&batch(
        1,
        vec![
            op(&s, FlatOp::Upsert, "a", 1, 10),
            op(&s, FlatOp::Upsert, "b", 1, 20),
        ],
    ))
    .await
    .unwrap();
    sink.write(&batch(
        2,
        vec![
            op(&s, FlatOp::Upsert, "c", 1, 30),
            op(&s, FlatOp::Upsert, "d", 1, 40),
        ],
    ))
    .await
    .unwrap();
    sink.flush().await.unwrap();
    sink.write(&batch(3, vec![op(&s, FlatOp::Upsert, "e", 1, 50)]))
        .await
        .unwrap();
    sink.flush().await.unwrap();
    assert_eq!(files(dir.path()).len(), 2);

    // The checkpoint only reached position 20: the file 10-40 is cut back to 10-20, the file
    // 50-50 goes; the replay writes 30.. again.
    let mut restarted = ParquetSink::new("pq", config(dir.path()));
    restarted
        .open(&Checkpoint::from([("slot".to_owned(), Offset(20, 0))]))
        .await
        .unwrap();
    let left = files(dir.path());
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        left[0].contains("00000000000000000010.00000000000000000000-00000000000000000020."),
        "{left:?}"
    );
    assert_eq!(
        rows(&dir.path().join(&left[0])),
        [("a".to_owned(), 1), ("b".to_owned(), 1)]
    );

    // A checkpoint of another source partition touches nothing.
    let mut other = ParquetSink::new("pq", config(dir.path()));
    other
        .open(&Checkpoint::from([("elsewhere".to_owned(), Offset(0, 0))]))
        .await
        .unwrap();
    assert_eq!(files(dir.path()), left);
}

#[tokio::test]
async fn compaction_keeps_the_newest_row_per_key_and_the_newest_group() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let mut sink = ParquetSink::new("pq", cfg.clone());
    sink.open(&Checkpoint::new()).await.unwrap();
    let (t, g) = (schema("t", 1, false, false), schema("g", 1, false, true));
    sink.write(&batch(
        1,
        vec![
            op(&t, FlatOp::Upsert, "a", 1, 10),
            op(&t, FlatOp::Upsert, "b", 1, 11),
            op(&g, FlatOp::Upsert, "p", 1, 12),
            op(&g, FlatOp::Upsert, "p", 2, 12),
            op(&g, FlatOp::Upsert, "q", 1, 13),
        ],
    ))
    .await
    .unwrap();
    sink.flush().await.unwrap();
    let report = compact("pq", &cfg).await.unwrap();
    assert_eq!(report.tables, 2);
    sink.write(&batch(
        2,
        vec![
            op(&t, FlatOp::Upsert, "a", 2, 20),
            op(&t, FlatOp::Delete, "b", 0, 21),
            op(&g, FlatOp::Upsert, "p", 1, 22),
            op(&g, FlatOp::Delete, "q", 0, 23),
        ],
    ))
    .await
    .unwrap();
    sink.flush().await.unwrap();
    // The same change log replayed into a second file (a crash before the checkpoint) changes nothing.
    sink.write(&batch(3, vec![op(&g, FlatOp::Upsert, "p", 1, 22)]))
        .await
        .unwrap();
    sink.flush().await.unwrap();
    compact("pq", &cfg).await.unwrap();
    assert_eq!(
        rows(&dir.path().join("t/current/part-0.parquet")),
        [("a".to_owned(), 2)]
    );
    assert_eq!(
        rows(&dir.path().join("g/current/part-0.parquet")),
        [("p".to_owned(), 1)]
    );
    // From scratch (no current state), the same result.
    std::fs::remove_dir_all(dir.path().join("t/current")).unwrap();
    compact("pq", &cfg).await.unwrap();
    assert_eq!(
        rows(&dir.path().join("t/current/part-0.parquet")),
        [("a".to_owned(), 2)]
    );
}

/// An open sink in `dir` that keeps change files for 30 days, and its config.
async fn sink_with_retention(dir: &std::path::Path) -> (ParquetSinkConfig, ParquetSink) {
    let cfg = ParquetSinkConfig {
        change_retention_days: 30,
        ..config(dir)
    };
    let mut sink = ParquetSink::new("pq", cfg.clone());
    sink.open(&Checkpoint::new()).await.unwrap();
    (cfg, sink)
}

/// An upsert of `id` (n = 1) at `pos`, committed `days_ago` days ago.
fn upsert_days_ago(s: &Arc<FlatSchema>, id: &str, pos: u64, days_ago: i64) -> WriteOp {
    let mut op = op(s, FlatOp::Upsert, id, 1, pos);
    if let WriteOp::Row(RowChange { change, .. }) = &mut op {
        change.commit_ts_ms = Some(chrono::Utc::now().timestamp_millis() - days_ago * 86_400_000);
    }
    op
}

#[tokio::test]
async fn retention_deletes_merged_change_files_older_than_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, mut sink) = sink_with_retention(dir.path()).await;
    let s = schema("t", 1, false, false);
    let at = |id: &str, pos: u64, days_ago: i64| upsert_days_ago(&s, id, pos, days_ago);
    sink.write(&batch(1, vec![at("old", 10, 40), at("new", 20, 1)]))
        .await
        .unwrap();
    sink.flush().await.unwrap();
    assert_eq!(files(dir.path()).len(), 2, "one file per commit day");
    let report = compact("pq", &cfg).await.unwrap();
    assert_eq!(report.files_deleted, 1);
    let left = files(dir.path());
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.iter().any(|f| f.starts_with("t/current/")), "{left:?}");
    // The deleted file's rows live on in the current state.
    assert_eq!(rows(&dir.path().join("t/current/part-0.parquet")).len(), 2);
}

/// A replay of 60 days, one day per batch: without a memory bound, every day's file stays open
/// (and in memory) until `roll_ms`.
#[tokio::test]
async fn open_files_over_buffer_bytes_are_published_oldest_first_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let budget: u64 = 4 << 20;
    let mut sink = ParquetSink::new(
        "pq",
        ParquetSinkConfig {
            buffer_bytes: budget,
            ..config(dir.path())
        },
    );
    sink.open(&Checkpoint::new()).await.unwrap();
    let s = schema("t", 1, false, false);
    let (days, per_day) = (60u64, 50u64);
    let mut most_held = 0;
    for day in 0..days {
        let commit_ts_ms = 1_780_000_000_000 + day as i64 * 86_400_000;
        let ops = (0..per_day)
            .map(|i| {
                let pos = 1 + day * per_day + i;
                let mut op = op(&s, FlatOp::Upsert, &format!("k{pos}"), pos as i64, pos);
                if let WriteOp::Row(RowChange { change, .. }) = &mut op {
                    change.commit_ts_ms = Some(commit_ts_ms);
                }
                op
            })
            .collect();
        sink.write(&batch(day + 1, ops)).await.unwrap();
        let held: u64 = sink.open.values().map(OpenFile::held_bytes).sum();
        most_held = most_held.max(held);
        assert!(
            held <= budget,
            "day {day}: {} open files hold {held} bytes, more than buffer_bytes = {budget}",
            sink.open.len()
        );
        assert!(
            sink.open
                .contains_key(&(Arc::from("t"), commit_ts_ms.div_euclid(86_400_000))),
            "day {day}: the day being written stays open"
        );
    }
    let early = files(dir.path()).len();
    assert!(early > 0, "no file was published before the end");
    // What was published early is acknowledged: the oldest unpublished batch is past day 0.
    assert!(sink.buffered().map(|b| b.durable_through).unwrap() > 0);
    sink.close().await.unwrap();
    let published = files(dir.path());
    assert_eq!(
        published.len() as u64,
        days,
        "one file per day, none split: {published:?}"
    );
    let mut all: Vec<(String, i64)> = published
        .iter()
        .flat_map(|f| rows(&dir.path().join(f)))
        .collect();
    all.sort();
    let mut want: Vec<(String, i64)> = (1..=days * per_day)
        .map(|pos| (format!("k{pos}"), pos as i64))
        .collect();
    want.sort();
    assert_eq!(
        all, want,
        "every row once ({early} files published early, at most {most_held} bytes held)"
    );
}

#[tokio::test]
async fn a_truncate_removes_every_older_row_from_the_current_state() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let mut sink = ParquetSink::new("pq", cfg.clone());
    sink.open(&Checkpoint::new()).await.unwrap();
    let (t, g) = (schema("t", 1, false, false), schema("g", 1, false, true));
    let truncate = |s: &Arc<FlatSchema>, at: u64| {
        WriteOp::Row(RowChange {
            change: FlatChange {
                schema: s.clone(),
                op: FlatOp::Truncate,
                values: vec![FlatValue::Null; s.columns.len()],
                commit_ts_ms: Some(1_790_000_000_000),
            },
            position: Position {
                partition: "slot".into(),
                offset: Offset(at, 0),
            },
        })
    };
    sink.write(&batch(
        1,
        vec![
            op(&t, FlatOp::Upsert, "a", 1, 10),
            op(&g, FlatOp::Upsert, "p", 1, 11),
            truncate(&t, 20),
            truncate(&g, 20),
            op(&t, FlatOp::Upsert, "b", 1, 30),
        ],
    ))
    .await
    .unwrap();
    sink.flush().await.unwrap();
    compact("pq", &cfg).await.unwrap();
    assert_eq!(
        rows(&dir.path().join("t/current/part-0.parquet")),
        [("b".to_owned(), 1)]
    );
    assert!(rows(&dir.path().join("g/current/part-0.parquet")).is_empty());
}

/// A change to table `t`: (kind, id, n).
type Change = (FlatOp, String, i64);

/// A batch of `changes` to table `t` at positions from `seq * 10,000`, applied to
/// `expected` as well; ids starting with `x` are written with a newer schema (an added column).
fn changes(seq: u64, expected: &mut BTreeMap<String, i64>, changes: Vec<Change>) -> SinkBatch {
    let drift = changes.iter().any(|(_, id, _)| id.starts_with('x'));
    let schema = schema("t", if drift { 2 } else { 1 }, drift, false);
    let ops = changes
        .into_iter()
        .enumerate()
        .map(|(i, (kind, id, n))| {
            match kind {
                FlatOp::Upsert => expected.insert(id.clone(), n),
                _ => expected.remove(&id),
            };
            op(&schema, kind, &id, n, seq * 10_000 + i as u64)
        })
        .collect();
    batch(seq, ops)
}

#[tokio::test]
async fn compaction_copies_inputs_whose_rows_all_survive_and_gathers_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path()); // 1,000 rows per row group
    let mut sink = ParquetSink::new("pq", cfg.clone());
    sink.open(&Checkpoint::new()).await.unwrap();
    let current = dir.path().join("t/current/part-0.parquet");
    let key = |i: usize| format!("k{i:04}");
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let sorted = |e: &BTreeMap<String, i64>| -> Vec<(String, i64)> {
        e.iter().map(|(k, v)| (k.clone(), *v)).collect()
    };
    // (what the step shows, its changes, rows after it, row groups copied)
    let steps: Vec<(&str, Vec<Change>, u64, u64)> = vec![
        (
            "an append-only load: its one file's three row groups are copied",
            (0..2_500).map(|i| (FlatOp::Upsert, key(i), 1)).collect(),
            2_500,
            3,
        ),
        (
            "new keys only: the previous state and the new file are both copied",
            (2_500..2_510)
                .map(|i| (FlatOp::Upsert, key(i), 1))
                .collect(),
            2_510,
            4,
        ),
        (
            "an update and a delete: neither input survives whole, both are gathered",
            vec![(FlatOp::Upsert, key(1), 7), (FlatOp::Delete, key(2), 0)],
            2_509,
            0,
        ),
        (
            "a new column: the previous state lacks it (gathered, null there), the new file \
             has exactly the new columns (copied)",
            vec![(FlatOp::Upsert, "x1".to_owned(), 5)],
            2_510,
            1,
        ),
    ];
    for (seq, (step, list, rows_after, copied)) in steps.into_iter().enumerate() {
        sink.write(&changes(seq as u64 + 1, &mut expected, list))
            .await
            .unwrap();
        sink.flush().await.unwrap();
        let report = compact("pq", &cfg).await.unwrap();
        assert_eq!(
            (report.rows, report.row_groups_copied),
            (rows_after, copied),
            "{step}"
        );
        assert_eq!(rows(&current), sorted(&expected), "{step}");
    }
    use parquet::file::reader::FileReader;
    let file =
        parquet::file::reader::SerializedFileReader::new(std::fs::File::open(&current).unwrap())
            .unwrap();
    let groups: Vec<i64> = file
        .metadata()
        .row_groups()
        .iter()
        .map(|g| g.num_rows())
        .collect();
    assert_eq!(
        groups,
        [1_000, 1_000, 509, 1],
        "gathered rows in full row groups, then the copy"
    );
}

#[tokio::test]
async fn a_compaction_overtaken_by_another_keeps_the_newer_state_and_deletes_nothing() {
    // The local backend cannot replace an object on a condition: the state is compared just
    // before the PUT.
    let dir = tempfile::tempdir().unwrap();
    let (cfg, mut sink) = sink_with_retention(dir.path()).await;
    let s = schema("t", 1, false, false);
    // Change files of one commit day long past retention, so that a compaction that merged
    // them deletes them.
    let old = |id: &str, pos: u64| upsert_days_ago(&s, id, pos, 40);
    sink.write(&batch(1, vec![old("a", 10)])).await.unwrap();
    sink.flush().await.unwrap();
    let first = compact("pq", &cfg).await.unwrap();
    assert_eq!((first.rows, first.files_deleted), (1, 1), "{first:?}");
    sink.write(&batch(2, vec![old("b", 20)])).await.unwrap();
    sink.flush().await.unwrap();
    let (store, root) = open_store(cfg.url.expose()).unwrap();
    let slow_files = compact::list_change_files(&*store, &root, Some("t"))
        .await
        .unwrap();
    // While the slow compaction merges `b` into the state, another one merges `b` and `c`,
    // publishes, and deletes both change files by retention.
    let overtaking = async {
        sink.write(&batch(3, vec![old("c", 30)])).await.unwrap();
        sink.flush().await.unwrap();
        let fast = compact("pq", &cfg).await.unwrap();
        assert_eq!((fast.rows, fast.files_deleted), (3, 2), "{fast:?}");
    };
    let slow = compact::compact_table(
        store,
        &root,
        "t",
        &slow_files,
        &cfg,
        PARTITION_ROWS,
        overtaking,
    )
    .await
    .unwrap();
    assert_eq!((slow.superseded, slow.files_deleted), (1, 0), "{slow:?}");
    // `c` lives only in the current state now: the slow compaction's older state would have
    // lost it for good.
    let current = dir.path().join("t/current/part-0.parquet");
    let abc = ["a", "b", "c"].map(|id| (id.to_owned(), 1));
    assert_eq!(rows(&current), abc);
    assert_eq!(files(dir.path()), ["t/current/part-0.parquet"]);

    // A compaction nobody overtakes publishes as before, over the state it merged from.
    sink.write(&batch(4, vec![op(&s, FlatOp::Upsert, "d", 1, 40)]))
        .await
        .unwrap();
    sink.flush().await.unwrap();
    let report = compact("pq", &cfg).await.unwrap();
    assert_eq!((report.superseded, report.rows), (0, 4), "{report:?}");
    assert_eq!(rows(&current).len(), 4);
}

/// A copy of every object under `root` of `from` in a new in-memory store, which puts on a
/// condition as Azure and GCS do.
async fn in_memory_copy(from: &dyn ObjectStore, root: &Path) -> Arc<dyn ObjectStore> {
    use futures::TryStreamExt;
    let memory = Arc::new(object_store::memory::InMemory::new());
    let objects: Vec<_> = from.list(Some(root)).try_collect().await.unwrap();
    for o in objects {
        let bytes = from.get(&o.location).await.unwrap().bytes().await.unwrap();
        memory.put(&o.location, bytes.into()).await.unwrap();
    }
    memory
}

/// The current state of `t` below `root`.
fn current_of_t(root: &Path) -> Path {
    root.clone()
        .join("t")
        .join("current")
        .join("part-0.parquet")
}

/// (id, n) of the current state of `t` in `store`.
async fn current_rows(store: &dyn ObjectStore, root: &Path) -> Vec<(String, i64)> {
    let bytes = store
        .get(&current_of_t(root))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), bytes).unwrap();
    rows(file.path())
}

#[tokio::test]
async fn where_the_store_puts_on_a_condition_the_overtaken_compaction_publishes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let mut sink = ParquetSink::new("pq", cfg.clone());
    sink.open(&Checkpoint::new()).await.unwrap();
    let s = schema("t", 1, false, false);
    let (local, root) = open_store(cfg.url.expose()).unwrap();
    // The change log after each of three batches, as in-memory stores.
    let mut logs = Vec::new();
    for (seq, id) in [(1, "a"), (2, "b"), (3, "c")] {
        let at = 10 * seq;
        sink.write(&batch(seq, vec![op(&s, FlatOp::Upsert, id, 1, at)]))
            .await
            .unwrap();
        sink.flush().await.unwrap();
        logs.push(in_memory_copy(&*local, &root).await);
    }
    // Compactions below run on the in-memory stores (nothing to sync to a local disk).
    let cfg = ParquetSinkConfig {
        url: "memory:///".into(),
        ..cfg
    };
    let files = |store: Arc<dyn ObjectStore>| {
        let root = root.clone();
        async move {
            compact::list_change_files(&*store, &root, Some("t"))
                .await
                .unwrap()
        }
    };
    let compact_now = |store: Arc<dyn ObjectStore>, files: Vec<compact::ChangeFile>| {
        let (root, cfg) = (root.clone(), cfg.clone());
        async move {
            compact::compact_table(
                store,
                &root,
                "t",
                &files,
                &cfg,
                PARTITION_ROWS,
                std::future::ready(()),
            )
            .await
            .unwrap()
        }
    };

    // No state yet: the slow one merges `a`, the fast one publishes `a` and `b` first.
    let store = logs[1].clone();
    let (slow_files, all) = (files(logs[0].clone()).await, files(store.clone()).await);
    let overtaking = async {
        assert_eq!(compact_now(store.clone(), all.clone()).await.superseded, 0);
    };
    let slow = compact::compact_table(
        store.clone(),
        &root,
        "t",
        &slow_files,
        &cfg,
        PARTITION_ROWS,
        overtaking,
    )
    .await;
    assert_eq!(slow.unwrap().superseded, 1);
    assert_eq!(
        current_rows(&*store, &root).await,
        [("a".to_owned(), 1), ("b".to_owned(), 1)]
    );

    // Over that state: both merge `c`, and the fast one publishes first.
    let newest = logs[2].clone();
    let state = current_of_t(&root);
    let bytes = store.get(&state).await.unwrap().bytes().await.unwrap();
    newest.put(&state, bytes.into()).await.unwrap();
    let all = files(newest.clone()).await;
    let overtaking = async {
        assert_eq!(compact_now(newest.clone(), all.clone()).await.superseded, 0);
    };
    let slow = compact::compact_table(
        newest.clone(),
        &root,
        "t",
        &all,
        &cfg,
        PARTITION_ROWS,
        overtaking,
    );
    assert_eq!(slow.await.unwrap().superseded, 1);
    assert_eq!(current_rows(&*newest, &root).await.len(), 3);
}

/// Compacts `table` choosing survivors about `partition_rows` records at a time.
async fn compact_in_partitions(
    cfg: &ParquetSinkConfig,
    table: &str,
    partition_rows: usize,
) -> CompactReport {
    let (store, root) = open_store(cfg.url.expose()).unwrap();
    let files = compact::list_change_files(&*store, &root, Some(table))
        .await
        .unwrap();
    let done = std::future::ready(());
    compact::compact_table(store, &root, table, &files, cfg, partition_rows, done)
        .await
        .unwrap()
}

#[tokio::test]
async fn compaction_holds_one_partition_of_survivor_records_at_a_time() {
    // Partitions of about this many records: the tables below have thousands of rows.
    const SMALL: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let mut sink = ParquetSink::new("pq", cfg.clone());
    sink.open(&Checkpoint::new()).await.unwrap();
    let (t, g) = (schema("t", 1, false, false), schema("g", 1, false, true));
    let mut at = 0u64;
    let mut next = || {
        at += 1;
        at
    };
    let (mut t_model, mut g_model) = (BTreeMap::new(), BTreeMap::new());
    let key = |i: usize| format!("k{i:04}");
    let parent = |i: usize| format!("p{i:03}");

    // Rows a truncate removes, 2,000 keys of `t` and 300 groups of three rows of `g`.
    let mut ops: Vec<WriteOp> = (0..100)
        .map(|i| op(&t, FlatOp::Upsert, &format!("old{i}"), 1, next()))
        .collect();
    ops.push(WriteOp::Row(RowChange {
        change: FlatChange {
            schema: t.clone(),
            op: FlatOp::Truncate,
            values: vec![FlatValue::Null; 2],
            commit_ts_ms: Some(1_790_000_000_000),
        },
        position: Position {
            partition: "slot".into(),
            offset: Offset(next(), 0),
        },
    }));
    for i in 0..2_000 {
        ops.push(op(&t, FlatOp::Upsert, &key(i), 1, next()));
        t_model.insert(key(i), 1);
    }
    for i in 0..300 {
        let position = next();
        ops.extend((1..=3).map(|n| op(&g, FlatOp::Upsert, &parent(i), n, position)));
        g_model.insert(parent(i), vec![1, 2, 3]);
    }
    sink.write(&batch(1, ops)).await.unwrap();
    sink.flush().await.unwrap();
    for table in ["t", "g"] {
        compact_in_partitions(&cfg, table, SMALL).await;
    }

    // Updates and deletes over the previous state; a group replaced by two rows.
    let mut ops = Vec::new();
    for i in (0..2_000).step_by(3) {
        ops.push(op(&t, FlatOp::Upsert, &key(i), 2, next()));
        t_model.insert(key(i), 2);
    }
    for i in (0..2_000).step_by(7) {
        ops.push(op(&t, FlatOp::Delete, &key(i), 0, next()));
        t_model.remove(&key(i));
    }
    let mut regrouped = Vec::new();
    for i in (0..300).step_by(5) {
        let position = next();
        regrouped.extend([7, 8].map(|n| op(&g, FlatOp::Upsert, &parent(i), n, position)));
        g_model.insert(parent(i), vec![7, 8]);
    }
    ops.extend(regrouped.iter().cloned());
    for i in (0..300).step_by(11) {
        ops.push(op(&g, FlatOp::Delete, &parent(i), 0, next()));
        g_model.remove(&parent(i));
    }
    sink.write(&batch(2, ops)).await.unwrap();
    sink.flush().await.unwrap();
    // The regrouping replayed into another file (a crash before the checkpoint) changes nothing.
    sink.write(&batch(3, regrouped)).await.unwrap();
    sink.flush().await.unwrap();

    let t_rows: Vec<(String, i64)> = t_model.into_iter().collect();
    let g_rows: Vec<(String, i64)> = g_model
        .into_iter()
        .flat_map(|(p, ns)| ns.into_iter().map(move |n| (p.clone(), n)))
        .collect();
    for (table, expected) in [("t", t_rows), ("g", g_rows)] {
        let report = compact_in_partitions(&cfg, table, SMALL).await;
        let current = dir.path().join(table).join("current/part-0.parquet");
        assert_eq!(rows(&current), expected, "{table}");
        assert!(report.partitions > 1, "{table}: {report:?}");
        assert!(
            report.peak_records <= 2 * SMALL as u64,
            "{table}: survivors chosen among {} records at once, for partitions of {SMALL}",
            report.peak_records
        );
    }
}
