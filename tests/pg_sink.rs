//! The PostgreSQL JSONB sink: SIGKILL `refract run` at random moments while it writes documents
//! into PostgreSQL, and compare the tables with the state computed independently from the change
//! log; then replay old changes over newer documents, which must stay, and an old upsert over
//! its delete, which must not bring the document back.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use common::pg::psql;
use common::*;
use serde_json::Value;

const SCHEMA: &str = "refract_sink_test";

fn pipeline_file(dir: &Path, log: &Path, state: &str) -> std::path::PathBuf {
    let text = format!(
        r#"[pipeline]
name = "pg_sink"
state_dir = "{state}"
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
sinks = ["pg"]
[sinks.pg]
kind = "postgres"
url = "{url}"
schema = "{SCHEMA}"
rows_per_statement = 100
"#,
        state = dir.join(state).display(),
        log = log.display(),
        url = common::pg::url(),
    );
    let path = dir.join(format!("{state}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Every document of the read-model tables, keyed like [`expected_state`].
fn tables() -> BTreeMap<(String, String), Value> {
    let mut docs = BTreeMap::new();
    for collection in ["items", "links", "sessions"] {
        let exists = psql(&format!(
            "SELECT to_regclass('{SCHEMA}.{collection}') IS NOT NULL"
        ));
        if exists != "t" {
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

fn assert_equal(expected: &BTreeMap<(String, String), Value>, context: &str) {
    let actual = tables();
    let missing: Vec<_> = expected
        .keys()
        .filter(|k| !actual.contains_key(*k))
        .take(5)
        .collect();
    let extra: Vec<_> = actual
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .take(5)
        .collect();
    let differing: Vec<_> = expected
        .iter()
        .filter(|(k, v)| actual.get(*k).is_some_and(|a| a != *v))
        .take(3)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty() && differing.is_empty(),
        "{context}: {} expected, {} in PostgreSQL; missing {missing:?}, extra {extra:?}, differing {differing:?}",
        expected.len(),
        actual.len()
    );
}

#[test]
fn sigkill_while_writing_loses_nothing_and_old_changes_never_overwrite_newer_documents() {
    psql(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let lines = change_log(if in_ci() { 30_000 } else { 100_000 }, 17);
    let pipeline = pipeline_file(dir.path(), &log, "state");
    std::fs::write(&log, b"").unwrap();

    let mut rng = Rng::new(9);
    let slice = lines.len().div_ceil(22);
    let mut kills = 0;
    let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    for part in lines.chunks(slice) {
        let mut text = part.join("\n");
        text.push('\n');
        file.write_all(text.as_bytes()).unwrap();
        file.flush().unwrap();
        if run_and_kill(&pipeline, Duration::from_millis(100 + rng.below(500))) {
            kills += 1;
        }
    }
    assert!(kills >= 20, "only {kills} kills hit a running process");
    let done = output(refract().arg("run").arg(&pipeline).arg("--until-caught-up"));
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let expected = expected_state(&lines);
    assert!(expected.len() > 1000, "{} documents", expected.len());
    assert_equal(&expected, &format!("after {kills} kills"));

    // The first half of the log replayed by a pipeline with no checkpoint (the same file and
    // positions): documents written later keep their newer version.
    let half = lines.len() / 2;
    let old_log = dir.path().join("old").join("changes.jsonl");
    std::fs::create_dir_all(old_log.parent().unwrap()).unwrap();
    write_lines(&old_log, &lines[..half]);
    std::fs::rename(&log, dir.path().join("full.jsonl")).unwrap();
    std::fs::rename(&old_log, &log).unwrap();
    let replay = pipeline_file(dir.path(), &log, "replay");
    let done = output(refract().arg("run").arg(&replay).arg("--until-caught-up"));
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let at_half = expected_state(&lines[..half]);
    let actual = tables();
    let mut kept_newer = 0;
    for (key, doc) in &expected {
        if at_half.get(key).is_some_and(|old| old != doc) {
            assert_eq!(
                actual.get(key),
                Some(doc),
                "{key:?} went back to an older version"
            );
            kept_newer += 1;
        }
    }
    assert!(
        kept_newer > 100,
        "the replay met {kept_newer} newer documents"
    );
    eprintln!(
        "{kills} SIGKILLs; {} documents equal; a replay of old changes left {kept_newer} newer documents alone",
        expected.len()
    );
    psql(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"));
}

#[test]
fn a_writer_with_rights_on_existing_tables_only_writes_without_creating() {
    let schema = "refract_sink_rights";
    psql(&format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; DROP ROLE IF EXISTS refract_sink_writer;
         CREATE ROLE refract_sink_writer LOGIN;
         CREATE SCHEMA {schema};
         CREATE TABLE {schema}.items (id text PRIMARY KEY, doc jsonb NOT NULL,
             source_position text COLLATE \"C\" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE {schema}.refract_tombstones (target text COLLATE \"C\" NOT NULL,
             id text NOT NULL, position text COLLATE \"C\" NOT NULL,
             deleted_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, id));
         GRANT USAGE ON SCHEMA {schema} TO refract_sink_writer;
         GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.items, {schema}.refract_tombstones
             TO refract_sink_writer;"
    ));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let lines: Vec<String> = change_log(2_000, 3)
        .into_iter()
        .filter(|l| l.contains("\"table\":\"items\""))
        .collect();
    write_lines(&log, &lines);
    let url =
        common::pg::url().replacen("postgres://postgres@", "postgres://refract_sink_writer@", 1);
    let text = format!(
        "[pipeline]\nname = \"rights\"\nstate_dir = \"{}\"\n[source]\nkind = \"file\"\npath = \"{}\"\nfollow = false\n\
         [projections.replica]\nkind = \"replica\"\nsinks = [\"pg\"]\n\
         [sinks.pg]\nkind = \"postgres\"\nurl = \"{url}\"\nschema = \"{schema}\"\n",
        dir.path().join("state").display(),
        log.display()
    );
    let pipeline = dir.path().join("p.toml");
    std::fs::write(&pipeline, text).unwrap();
    let run = output(refract().arg("run").arg(&pipeline));
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    let count = psql(&format!("SELECT count(*) FROM {schema}.items"));
    psql(&format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; DROP ROLE IF EXISTS refract_sink_writer;"
    ));
    assert!(run.status.success(), "{stderr}");
    let expected = expected_state(&lines).len();
    assert_eq!(count, expected.to_string(), "{stderr}");
}

/// A one-sink pipeline reading `log` once into `schema`, its state in `dir/state`.
fn once_pipeline(dir: &Path, log: &Path, schema: &str, state: &str) -> std::path::PathBuf {
    let text = format!(
        "[pipeline]\nname = \"tombstones\"\nstate_dir = \"{}\"\n[source]\nkind = \"file\"\npath = \"{}\"\nfollow = false\n\
         [projections.replica]\nkind = \"replica\"\nsinks = [\"pg\"]\n\
         [sinks.pg]\nkind = \"postgres\"\nurl = \"{}\"\nschema = \"{schema}\"\n",
        dir.join(state).display(),
        log.display(),
        common::pg::url(),
    );
    let pipeline = dir.join(format!("{state}.toml"));
    std::fs::write(&pipeline, text).unwrap();
    pipeline
}

fn run_once(pipeline: &Path) {
    let run = output(refract().arg("run").arg(pipeline));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn an_older_upsert_replayed_after_a_delete_does_not_bring_the_document_back() {
    let schema = "refract_sink_tombstones";
    psql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let dir = tempfile::tempdir().unwrap();
    let src = serde_json::json!({"connector": "postgresql", "schema": "public", "table": "items", "ts_ms": 1_790_000_000_000u64});
    let row = serde_json::json!({"id": 7, "name": "item 7", "qty": 1});
    let upsert = serde_json::json!({"before": null, "after": row, "op": "c", "source": src});
    let delete = serde_json::json!({"before": row, "after": null, "op": "d", "source": src});
    let log = dir.path().join("changes.jsonl");
    write_lines(&log, &[upsert.to_string(), delete.to_string()]);
    run_once(&once_pipeline(dir.path(), &log, schema, "state"));
    let count = || psql(&format!("SELECT count(*) FROM {schema}.items"));
    assert_eq!(count(), "0", "the delete applied");

    // The upsert alone, at its own position, replayed by a run with no checkpoint (as after a
    // crash before the checkpoint moved past it).
    write_lines(&log, &[upsert.to_string()]);
    run_once(&once_pipeline(dir.path(), &log, schema, "replay"));
    let after_replay = count();
    let tombstones = psql(&format!(
        "SELECT string_agg(target || '/' || id, ',') FROM {schema}.refract_tombstones"
    ));
    psql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    assert_eq!(after_replay, "0", "the deleted document came back");
    assert_eq!(tombstones, "items/7");
}

/// Several processes open sinks on one new schema at the same moment (the members of a
/// scaled-out pipeline starting together): each creates the schema, the tombstones table and
/// the read-model table if missing, and none fails because another created them first.
#[test]
fn sinks_opening_together_on_a_new_schema_all_create_it_without_failing() {
    let schema = "refract_sink_together";
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let lines: Vec<String> = change_log(200, 5)
        .into_iter()
        .filter(|l| l.contains("\"table\":\"items\""))
        .collect();
    write_lines(&log, &lines);
    let pipelines: Vec<_> = (0..6)
        .map(|i| once_pipeline(dir.path(), &log, schema, &format!("member{i}")))
        .collect();
    for round in 0..3 {
        psql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
        let runs: Vec<_> = pipelines
            .iter()
            .map(|p| {
                let _ = std::fs::remove_dir_all(p.with_extension(""));
                let mut cmd = refract();
                cmd.arg("run").arg(p);
                std::thread::spawn(move || output(&mut cmd))
            })
            .collect();
        for run in runs {
            let run = run.join().unwrap();
            assert!(
                run.status.success(),
                "round {round}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
        }
    }
    let count = psql(&format!("SELECT count(*) FROM {schema}.items"));
    psql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    assert_eq!(count, expected_state(&lines).len().to_string());
}
