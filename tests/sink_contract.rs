//! Per-operation rejection in the sink contract: a value a sink cannot hold (a document key too
//! long for an object name, a row PostgreSQL refuses with a data error) goes to the dead letters
//! with the sink's reason while the rest of its batch lands; with `on_error = "stop"` the run
//! stops loudly (exit 3) and never checkpoints past it.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::pg::psql;
use common::*;
use serde_json::{Value, json};

/// The PostgreSQL sink's schema, this test's own.
const SCHEMA: &str = "refract_sink_contract";

/// A pipeline reading `log` into object-JSON documents under `out` (sink `docs`) and, when
/// `with_pg`, into PostgreSQL (sink `pg`); `extra` goes into `[pipeline]`.
fn pipeline_file(dir: &Path, log: &Path, out: &Path, with_pg: bool, extra: &str) -> PathBuf {
    let (sinks, pg) = if with_pg {
        (
            r#"["docs", "pg"]"#,
            format!(
                "[sinks.pg]\nkind = \"postgres\"\nurl = \"{}\"\nschema = \"{SCHEMA}\"\nrows_per_statement = 100\n",
                common::pg::url()
            ),
        )
    } else {
        (r#"["docs"]"#, String::new())
    };
    let text = format!(
        r#"[pipeline]
name = "sink_contract"
state_dir = "{state}"
{extra}
[pipeline.batch]
max_events = 500
max_delay_ms = 50
[source]
kind = "file"
path = "{log}"
poll_interval_ms = 20
[projections.replica]
kind = "replica"
tables = ["items", "links", "sessions"]
key_columns = {{ links = ["a", "b"] }}
sinks = {sinks}
[sinks.docs]
kind = "object_json"
url = "file://{out}"
{pg}"#,
        state = dir.join("state").display(),
        log = log.display(),
        out = out.display(),
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn item(id: Value, name: &str) -> String {
    json!({"before": null, "after": {"id": id, "name": name, "qty": 1}, "op": "c",
           "source": {"schema": "public", "table": "items"}})
    .to_string()
}

/// A change log with, in the middle of a batch, an item whose key is too long for a file name
/// and an item whose name holds `\u0000` (which `jsonb` cannot store); returns the lines and
/// the indexes of those two.
fn log_with_unholdable_values(long_key: &str) -> (Vec<String>, usize, usize) {
    let mut lines = change_log(3000, 25);
    let long = 1210;
    let nul = 1230;
    lines.insert(long, item(json!(long_key), "a key longer than a file name"));
    lines.insert(nul, item(json!(999_999), "nul \u{0} inside"));
    (lines, long, nul)
}

/// Byte offset just past line `index` (the position refract assigns to it).
fn end_offset(lines: &[String], index: usize) -> u64 {
    lines[..=index].iter().map(|l| l.len() as u64 + 1).sum()
}

/// Every document of the PostgreSQL sink's tables, keyed like [`expected_state`].
fn pg_tables() -> BTreeMap<(String, String), Value> {
    let mut docs = BTreeMap::new();
    for collection in ["items", "links", "sessions"] {
        if psql(&format!(
            "SELECT to_regclass('{SCHEMA}.{collection}') IS NOT NULL"
        )) != "t"
        {
            continue;
        }
        let json = psql(&format!(
            "SELECT coalesce(json_agg(json_build_array(id, doc)), '[]') FROM {SCHEMA}.{collection}"
        ));
        let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
        for r in rows {
            docs.insert(
                (collection.to_owned(), r[0].as_str().unwrap().to_owned()),
                r[1].clone(),
            );
        }
    }
    docs
}

fn dead_letters(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The one dead letter of `sink`.
fn letter_of<'a>(letters: &'a [Value], sink: &str) -> &'a Value {
    let of: Vec<&Value> = letters.iter().filter(|l| l["sink"] == sink).collect();
    assert_eq!(of.len(), 1, "one letter from sink {sink}: {letters:#?}");
    of[0]
}

#[test]
fn rejected_operations_are_dead_lettered_and_the_rest_of_their_batch_lands() {
    psql(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"));
    let dir = tempfile::tempdir().unwrap();
    let (log, out, dead) = (
        dir.path().join("changes.jsonl"),
        dir.path().join("out"),
        dir.path().join("dead.ndjson"),
    );
    let long_key = "k".repeat(300);
    let (lines, long, nul) = log_with_unholdable_values(&long_key);
    write_lines(&log, &lines);
    let extra = format!("dead_letter = {{ path = \"{}\" }}", dead.display());
    let pipeline = pipeline_file(dir.path(), &log, &out, true, &extra);

    let run = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("dead letters   2"), "{stdout}");

    let letters = dead_letters(&dead);
    assert_eq!(letters.len(), 2, "{letters:#?}");
    let docs = letter_of(&letters, "docs");
    assert_eq!(docs["stage"], "sink");
    assert_eq!(docs["table"], "items");
    assert_eq!(docs["raw"], long_key.as_str(), "the key is kept");
    assert_eq!(docs["position"]["offset"][0], end_offset(&lines, long));
    let reason = docs["reason"].as_str().unwrap();
    assert!(reason.contains("longer than 255 bytes"), "{reason}");
    let pg = letter_of(&letters, "pg");
    assert_eq!(
        (&pg["stage"], &pg["raw"]),
        (&json!("sink"), &json!("999999"))
    );
    assert_eq!(pg["position"]["offset"][0], end_offset(&lines, nul));
    let reason = pg["reason"].as_str().unwrap();
    assert!(
        reason.contains("SQLSTATE 22"),
        "PostgreSQL's reason: {reason}"
    );

    // Everything else, in the same batches, landed in both read models.
    let expected = expected_state(&lines);
    let mut without_long = expected.clone();
    without_long.remove(&("items".to_owned(), long_key.clone()));
    assert_read_model(&without_long, &out, "object_json without the long key");
    let mut without_nul = expected;
    without_nul.remove(&("items".to_owned(), "999999".to_owned()));
    assert!(pg_tables() == without_nul, "PostgreSQL without the NUL row");

    // A rerun from scratch (state deleted) records nothing twice.
    std::fs::remove_dir_all(dir.path().join("state")).unwrap();
    let again = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
    assert!(again.status.success());
    assert_eq!(dead_letters(&dead).len(), 2);
    psql(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"));
}

#[test]
fn on_error_stop_stops_at_a_rejected_operation_and_never_skips_it() {
    let dir = tempfile::tempdir().unwrap();
    let (log, out) = (dir.path().join("changes.jsonl"), dir.path().join("out"));
    let long_key = "k".repeat(300);
    let (lines, long, _) = log_with_unholdable_values(&long_key);
    write_lines(&log, &lines);
    let pipeline = pipeline_file(dir.path(), &log, &out, false, "on_error = \"stop\"");
    let at = format!("file:{}@{}", log.display(), end_offset(&lines, long));
    for attempt in 0..2 {
        let run = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(3), "attempt {attempt}: {stderr}");
        assert!(
            stderr.contains(&format!("sink `docs` cannot hold the operation at {at}")),
            "attempt {attempt}: {stderr}"
        );
        assert!(stderr.contains("longer than 255 bytes"), "{stderr}");
    }
}
