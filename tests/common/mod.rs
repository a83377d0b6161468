//! Helpers shared by the end-to-end tests: the binary, pipeline files, a deterministic change-log
//! generator, an independent model of the expected read model, and a reader of the output.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

pub mod cache;
pub mod db;
pub mod documents;
pub mod kafka;
pub mod migrate;
pub mod parquet;
pub mod pg_table;
pub mod pg_tls;
pub mod png;
pub mod proxy;
pub mod registry;
pub mod tiers;
pub mod tiers_aging;

/// Whether the suite runs in CI (`CI=true`), where the big data sizes shrink.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The `refract` binary under test, with a quiet log level unless RUST_LOG says otherwise.
pub fn refract() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_refract"));
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "warn");
    }
    cmd
}

/// Runs a command and returns its output, printing stderr on failure for diagnosis.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("the refract binary runs")
}

/// Writes a pipeline reading `log` into object-JSON documents under `out`, with `extra` TOML
/// lines appended to the `[pipeline]` section.
pub fn pipeline(dir: &Path, log: &Path, out: &Path, pipeline_extra: &str) -> PathBuf {
    let text = format!(
        r#"[pipeline]
name = "e2e"
state_dir = "{state}"
{pipeline_extra}

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
sinks = ["docs"]

[sinks.docs]
kind = "object_json"
url = "file://{out}"
"#,
        state = dir.join("state").display(),
        log = log.display(),
        out = out.display(),
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A tiny deterministic generator (SplitMix64): tests must not depend on a crate's RNG stream.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Generates `n` change-log lines over three tables: `items` (key `id`, creates, updates,
/// deletes), `links` (composite key `a`,`b`) and `sessions` (truncated now and then), with
/// transaction markers around some groups.
pub fn change_log(n: usize, seed: u64) -> Vec<String> {
    let mut rng = Rng::new(seed);
    let mut lines = Vec::with_capacity(n);
    let mut live: BTreeMap<u64, Value> = BTreeMap::new();
    let mut tx = 0;
    while lines.len() < n {
        let roll = rng.below(100);
        let src = |table: &str| json!({"connector": "postgresql", "schema": "public", "table": table, "ts_ms": 1_790_000_000_000u64});
        if roll < 60 {
            let id = rng.below(5000);
            let after = json!({"id": id, "name": format!("item {id} v{}", rng.below(1_000_000)), "qty": rng.below(100)});
            let (op, before) = match live.get(&id) {
                Some(b) => ("u", b.clone()),
                None => ("c", Value::Null),
            };
            live.insert(id, after.clone());
            lines.push(
                json!({"before": before, "after": after, "op": op, "source": src("items")})
                    .to_string(),
            );
        } else if roll < 75 {
            if let Some((&id, before)) = live
                .iter()
                .nth(rng.below(live.len().max(1) as u64) as usize)
            {
                let before = before.clone();
                live.remove(&id);
                lines.push(
                    json!({"before": before, "after": null, "op": "d", "source": src("items")})
                        .to_string(),
                );
            }
        } else if roll < 90 {
            tx += 1;
            lines.push(
                json!({"status": "BEGIN", "id": tx.to_string(), "event_count": null}).to_string(),
            );
            let a = rng.below(300);
            for _ in 0..3 {
                let b = rng.below(300);
                let op = if rng.below(4) == 0 { "d" } else { "c" };
                let row = json!({"a": a, "b": b, "w": rng.below(10)});
                let (before, after) = if op == "d" {
                    (row, Value::Null)
                } else {
                    (Value::Null, row)
                };
                lines.push(
                    json!({"before": before, "after": after, "op": op, "source": src("links"),
                                  "transaction": {"id": tx.to_string(), "total_order": 1}})
                    .to_string(),
                );
            }
            lines
                .push(json!({"status": "END", "id": tx.to_string(), "event_count": 3}).to_string());
        } else if roll < 99 {
            let s = rng.below(200);
            lines.push(json!({"before": null, "after": {"id": format!("s{s}"), "seen": rng.below(1000)}, "op": "c", "source": src("sessions")}).to_string());
        } else {
            lines.push(json!({"op": "t", "source": src("sessions")}).to_string());
        }
    }
    lines.truncate(n);
    lines
}

/// The read model the change log must produce, computed without any refract code:
/// `(collection, file stem)` → document.
pub fn expected_state(lines: &[String]) -> BTreeMap<(String, String), Value> {
    let mut state = BTreeMap::new();
    for line in lines {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let Some(op) = v.get("op").and_then(Value::as_str) else {
            continue;
        };
        let Some(table) = v["source"]["table"].as_str() else {
            continue;
        };
        let key_of = |row: &Value| -> Option<String> {
            let text = |x: &Value| match x {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            match table {
                "links" => Some(format!("{},{}", text(row.get("a")?), text(row.get("b")?))),
                _ => row.get("id").filter(|x| !x.is_null()).map(text),
            }
        };
        match op {
            "c" | "u" | "r" => {
                if let Some(k) = key_of(&v["after"]) {
                    state.insert((table.to_owned(), k), v["after"].clone());
                }
            }
            "d" => {
                if let Some(k) = key_of(&v["before"]) {
                    state.remove(&(table.to_owned(), k));
                }
            }
            "t" => state.retain(|(t, _), _| t != table),
            _ => {}
        }
    }
    state
}

/// Reads every `{collection}/{key}.json` under `out`; fails on any other file (staging leftovers,
/// half-written objects).
pub fn read_output(out: &Path) -> BTreeMap<(String, String), Value> {
    read_documents(out, true)
}

/// Like [`read_output`], for a directory a running daemon is writing to: staging files and
/// objects that vanish while listed are passed over.
pub fn read_output_live(out: &Path) -> BTreeMap<(String, String), Value> {
    read_documents(out, false)
}

fn read_documents(out: &Path, strict: bool) -> BTreeMap<(String, String), Value> {
    let mut docs = BTreeMap::new();
    let Ok(collections) = std::fs::read_dir(out) else {
        return docs;
    };
    for collection in collections {
        let collection = collection.unwrap();
        if !collection.file_type().unwrap().is_dir() {
            continue;
        }
        let name = collection.file_name().to_string_lossy().into_owned();
        for file in std::fs::read_dir(collection.path()).unwrap() {
            let file = file.unwrap();
            // Not a collection of documents (the demo's Parquet tables under out/analytics).
            if file.file_type().unwrap().is_dir() {
                continue;
            }
            let fname = file.file_name().to_string_lossy().into_owned();
            if !strict && !fname.ends_with(".json") {
                continue;
            }
            let stem = fname
                .strip_suffix(".json")
                .unwrap_or_else(|| panic!("unexpected file {name}/{fname}"));
            let bytes = match std::fs::read(file.path()) {
                Ok(b) => b,
                Err(_) if !strict => continue,
                Err(e) => panic!("cannot read {name}/{fname}: {e}"),
            };
            let doc: Value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("{name}/{fname} is not whole JSON: {e}"));
            docs.insert((name.clone(), stem.to_owned()), doc);
        }
    }
    docs
}

/// Runs `refract run PIPELINE` (output discarded) for `lifetime`, then SIGKILLs it if it still
/// runs; returns whether the kill landed on a running process.
pub fn run_and_kill(pipeline: &Path, lifetime: std::time::Duration) -> bool {
    run_and_kill_with(
        refract()
            .arg("run")
            .arg(pipeline)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
        lifetime,
    )
}

/// Starts `command` (a `refract` command with its output set up by the caller) and SIGKILLs it
/// after `lifetime` unless it ended; returns whether the kill landed.
pub fn run_and_kill_with(command: &mut Command, lifetime: std::time::Duration) -> bool {
    let mut daemon = Running::spawn(command);
    std::thread::sleep(lifetime);
    let child = daemon.child();
    let landed = child.try_wait().unwrap().is_none();
    if landed {
        child.kill().unwrap();
    }
    child.wait().unwrap();
    landed
}

/// Compares two read models and describes the first differences.
pub fn diff(
    expected: &BTreeMap<(String, String), Value>,
    actual: &BTreeMap<(String, String), Value>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in expected {
        match actual.get(k) {
            None => out.push(format!("missing {}/{}", k.0, k.1)),
            Some(a) if a != v => out.push(format!("stale {}/{}: {a} != {v}", k.0, k.1)),
            _ => {}
        }
    }
    for k in actual.keys() {
        if !expected.contains_key(k) {
            out.push(format!("should be gone: {}/{}", k.0, k.1));
        }
    }
    out
}

/// `refract run PIPELINE` as a daemon with its output discarded.
pub fn quiet_daemon(pipeline: &std::path::Path) -> Running {
    Running::spawn(
        refract()
            .arg("run")
            .arg(pipeline)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    )
}

/// A running `refract` process that is killed (SIGKILL) if the test ends before it does, so a
/// failing test never leaves a daemon holding the test runner's output open.
pub struct Running(Option<std::process::Child>);

impl Running {
    pub fn spawn(cmd: &mut Command) -> Self {
        Running(Some(cmd.spawn().expect("the refract binary starts")))
    }
    /// Owns a process started elsewhere (killed if the test ends first).
    pub fn adopt(child: std::process::Child) -> Self {
        Running(Some(child))
    }
    /// Gives the process up (no longer killed on drop).
    pub fn into_child(mut self) -> std::process::Child {
        self.0.take().expect("the process is still owned")
    }
    pub fn child(&mut self) -> &mut std::process::Child {
        self.0.as_mut().expect("the process is still owned")
    }
    /// Sends SIGTERM.
    pub fn terminate(&mut self) {
        let pid = self.child().id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
    }
    /// Waits for the process to end by itself, collecting its piped output.
    pub fn wait_with_output(mut self) -> Output {
        self.0
            .take()
            .expect("the process is still owned")
            .wait_with_output()
            .unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Asserts that the documents under `out` are exactly `expected`, naming the first differences.
pub fn assert_read_model(expected: &BTreeMap<(String, String), Value>, out: &Path, context: &str) {
    let problems = diff(expected, &read_output(out));
    assert!(
        problems.is_empty(),
        "{context}: {} differences, e.g. {:?}",
        problems.len(),
        &problems[..problems.len().min(5)]
    );
}

/// Writes lines to a file, each followed by a newline.
pub fn write_lines(path: &Path, lines: &[String]) {
    let mut text = lines.join("\n");
    text.push('\n');
    std::fs::write(path, text).unwrap();
}

/// PostgreSQL helpers for the tests of the PostgreSQL source (`PG_URL`, default
/// `postgres://postgres@127.0.0.1:5432/refract`, in logical mode).
pub mod pg {
    use std::collections::BTreeMap;
    use std::io::{BufRead, BufReader, Write};
    use std::path::Path;
    use std::process::{Child, ChildStdin, Command, Output, Stdio};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use serde_json::Value;

    /// How long a psql session, a catch-up run or a wait on the server may take before the test
    /// fails instead of hanging (a guard against hangs, not an assertion on speed): 300 s, or
    /// `REFRACT_TEST_HANG_GUARD_SECS`.
    pub fn hang_guard() -> Duration {
        Duration::from_secs(
            std::env::var("REFRACT_TEST_HANG_GUARD_SECS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(300),
        )
    }

    /// pgbench from the PostgreSQL installation (not always on PATH).
    pub fn pgbench() -> std::path::PathBuf {
        if let Ok(out) = Command::new("sh")
            .args([
                "-c",
                "command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench | sort -V | tail -1",
            ])
            .output()
        {
            let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if !path.is_empty() {
                return path.into();
            }
        }
        panic!("pgbench not found");
    }

    pub fn url() -> String {
        std::env::var("PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/refract".into())
    }

    /// A pipeline file in `dir` replicating table `public.{name}` from the PostgreSQL source at
    /// `source_url` (`source_extra`: further lines of `[source]`) through one replica
    /// projection into the sinks `sink_names`, whose `[sinks.NAME]` tables `sinks_toml` holds.
    /// Small batches (300 events, 50 ms), so that a test of a few thousand rows crosses many.
    pub fn replica_pipeline(
        dir: &Path,
        name: &str,
        source_url: &str,
        source_extra: &str,
        sink_names: &[&str],
        sinks_toml: &str,
    ) -> std::path::PathBuf {
        let sinks: Vec<String> = sink_names.iter().map(|s| format!("\"{s}\"")).collect();
        let text = format!(
            r#"[pipeline]
name = "{name}"
state_dir = "{state}"

[pipeline.batch]
max_events = 300
max_delay_ms = 50

[source]
kind = "postgres"
url = "{source_url}"
tables = ["public.{name}"]
{source_extra}

[projections.replica]
kind = "replica"
sinks = [{sinks}]

{sinks_toml}
"#,
            state = dir.join("state").display(),
            sinks = sinks.join(", "),
        );
        let path = dir.join("pipeline.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The `[sinks.NAME]` table of an `object_json` sink writing under directory `out`.
    pub fn object_json_sink(sink: &str, out: &Path) -> String {
        format!(
            "[sinks.{sink}]\nkind = \"object_json\"\nurl = \"file://{}\"\n",
            out.display()
        )
    }

    /// Runs SQL through psql, failing the test on error; returns psql's unaligned output.
    pub fn psql(sql: &str) -> String {
        let out = Command::new("psql")
            .args([&url(), "-X", "-v", "ON_ERROR_STOP=1", "-Atqc", sql])
            .output()
            .expect("psql runs");
        assert!(
            out.status.success(),
            "psql failed on {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Drops slot `refract_{name}` and publication `refract_{name}` now (an earlier run's, or
    /// this test's at its end: a leftover slot retains WAL).
    pub fn drop_slot(name: &str) {
        psql(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_{name}';
             DROP PUBLICATION IF EXISTS refract_{name};"
        ));
    }

    /// Keeps the WAL from now on until the test's `Cleanup` drops it, with a physical slot
    /// `refract_{name}_pin` reserving it at once. A test that reads its transactions back from
    /// the WAL (pg_walinspect) needs it: once the pipeline's own slot has confirmed them, a
    /// checkpoint may remove their segments, and on a busy cluster (CI runs tests side by side)
    /// one does before the test reads them.
    pub fn pin_wal(name: &str) {
        psql(&format!(
            "SELECT pg_create_physical_replication_slot('refract_{name}_pin', true)"
        ));
    }

    /// Drops slot `refract_{name}` and publication `refract_{name}` (and the listed tables, and
    /// the slot of [`pin_wal`]) when dropped itself, also when the test fails: a leftover slot
    /// retains WAL. Declare it before any process or session that uses them, so it is dropped
    /// after them.
    pub struct Cleanup {
        pub name: String,
        pub tables: Vec<String>,
    }

    impl Cleanup {
        /// Removes what an earlier run may have left, and cleans up again at the end.
        pub fn new(name: &str, tables: &[&str]) -> Self {
            let cleanup = Cleanup {
                name: name.to_owned(),
                tables: tables.iter().map(|t| (*t).to_owned()).collect(),
            };
            cleanup.run().expect("cleaning up an earlier run");
            cleanup
        }

        fn run(&self) -> Result<(), String> {
            let name = &self.name;
            let mut sql = format!(
                "SET lock_timeout = '20s';
                 SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                   WHERE slot_name = 'refract_{name}' AND active_pid IS NOT NULL;
                 SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                   WHERE slot_name IN ('refract_{name}', 'refract_{name}_pin');
                 DROP PUBLICATION IF EXISTS refract_{name};"
            );
            for table in &self.tables {
                sql.push_str(&format!("DROP TABLE IF EXISTS public.{table};"));
            }
            let out = Command::new("psql")
                .args([&url(), "-X", "-v", "ON_ERROR_STOP=1", "-Atqc", &sql])
                .output()
                .map_err(|e| e.to_string())?;
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        }
    }

    impl Drop for Cleanup {
        fn drop(&mut self) {
            // An active slot cannot be dropped: retry briefly while a killed walsender ends.
            let mut result = self.run();
            for _ in 0..20 {
                if result.is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(250));
                result = self.run();
            }
            match result {
                Ok(()) => eprintln!("dropped slot and publication refract_{}", self.name),
                Err(e) => eprintln!(
                    "WARNING: could not drop slot/publication refract_{}: {e}",
                    self.name
                ),
            }
        }
    }

    /// Every row of `table` as `row_to_json` renders it, keyed like the read model
    /// (`(table, id)`). Only for tables whose columns map the same way in refract (integers,
    /// text; not `numeric`, which refract keeps as exact strings).
    pub fn table_rows(table: &str) -> BTreeMap<(String, String), Value> {
        let json = psql(&format!(
            "SELECT coalesce(json_agg(row_to_json(t) ORDER BY id), '[]') FROM public.{table} t"
        ));
        let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
        rows.into_iter()
            .map(|r| ((table.to_owned(), r["id"].to_string()), r))
            .collect()
    }

    /// `refract run PIPELINE --until-caught-up --summary-json …`, asserting success; returns the
    /// run's summary. A run still going after [`hang_guard`] (waiting on a lock the test itself
    /// holds, say) is killed and fails the test with what the server's sessions were doing.
    pub fn catch_up(pipeline: &Path) -> Value {
        let summary = pipeline.with_file_name(format!(
            "summary-{}.json",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let child = super::refract()
            .arg("run")
            .arg(pipeline)
            .arg("--until-caught-up")
            .arg("--summary-json")
            .arg(&summary)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the refract binary starts");
        let run = wait_guarded(child, "refract run --until-caught-up");
        assert!(
            run.status.success(),
            "catch-up failed ({}): {}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        );
        let text = std::fs::read_to_string(&summary).expect("the run wrote its summary");
        serde_json::from_str(&text).expect("the summary is JSON")
    }

    /// Waits for `child` (stdout and stderr piped) to end; after [`hang_guard`] kills it and
    /// fails, naming what every session of the database was doing.
    pub fn wait_guarded(mut child: Child, what: &str) -> Output {
        let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = pipe.read_to_end(&mut v);
                v
            })
        };
        let stdout = drain(Box::new(child.stdout.take().unwrap()));
        let stderr = drain(Box::new(child.stderr.take().unwrap()));
        let deadline = Instant::now() + hang_guard();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let sessions = psql(
                    "SELECT string_agg(format('%s %s %s %s: %s', pid, application_name, state, wait_event_type, left(query, 200)), E'\\n')
                     FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
                );
                let _ = child.kill();
                let _ = child.wait();
                let stderr = stderr.join().unwrap();
                panic!(
                    "{what} still running after {:?}, killed. Its stderr: {}\nSessions:\n{sessions}",
                    hang_guard(),
                    String::from_utf8_lossy(&stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Output {
            status,
            stdout: stdout.join().unwrap(),
            stderr: stderr.join().unwrap(),
        }
    }

    /// The `changes` counters of a run summary (`{"c": n, "u": n, …}`), as a map.
    pub fn changes(summary: &Value) -> BTreeMap<String, u64> {
        summary["changes"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A long-lived psql session fed through stdin, so a test controls how the statements of
    /// several sessions interleave. `run` waits until psql has executed what it was sent;
    /// `send` does not (for a statement that blocks on a lock), `wait` catches up with it.
    pub struct Session {
        pub label: String,
        child: Child,
        stdin: ChildStdin,
        lines: mpsc::Receiver<String>,
        marks: u64,
        /// The server process serving this session.
        pub pid: i32,
    }

    impl Session {
        pub fn open(label: &str) -> Self {
            Self::open_at(&url(), label)
        }

        /// A session on the database at `url`.
        pub fn open_at(url: &str, label: &str) -> Self {
            let mut child = Command::new("psql")
                .args([url, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
                .env("PGAPPNAME", format!("refract_test_{label}"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("psql starts");
            let stdin = child.stdin.take().unwrap();
            let stdout = child.stdout.take().unwrap();
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            let mut session = Session {
                label: label.to_owned(),
                child,
                stdin,
                lines,
                marks: 0,
                pid: 0,
            };
            let out = session.run("SELECT pg_backend_pid();");
            session.pid = out.trim().parse().expect("a backend pid");
            session
        }

        /// Sends SQL without waiting for it to finish.
        pub fn send(&mut self, sql: &str) {
            self.marks += 1;
            let text = format!("{sql}\n\\echo __refract_mark_{}\n", self.marks);
            self.stdin
                .write_all(text.as_bytes())
                .and_then(|()| self.stdin.flush())
                .unwrap_or_else(|e| panic!("session {}: psql is gone: {e}", self.label));
        }

        /// Waits until everything sent so far has been executed; returns its output.
        pub fn wait(&mut self) -> String {
            let mark = format!("__refract_mark_{}", self.marks);
            let mut out = String::new();
            loop {
                match self.lines.recv_timeout(hang_guard()) {
                    Ok(line) if line == mark => return out,
                    Ok(line) => {
                        out.push_str(&line);
                        out.push('\n');
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => panic!(
                        "session {}: psql ended (an SQL error? see stderr above); output so far: {out}",
                        self.label
                    ),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        panic!(
                            "session {}: no answer within {:?}",
                            self.label,
                            hang_guard()
                        )
                    }
                }
            }
        }

        /// Sends SQL and waits until psql executed it; returns its output.
        pub fn run(&mut self, sql: &str) -> String {
            self.send(sql);
            self.wait()
        }

        /// Waits until this session's server process waits for a lock (a statement sent with
        /// `send` blocked behind another session's row lock).
        pub fn wait_until_blocked_on_lock(&self) {
            let deadline = Instant::now() + hang_guard();
            loop {
                let state = psql(&format!(
                    "SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = {}",
                    self.pid
                ));
                if state == "Lock" {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "session {} never blocked on a lock (wait_event_type {state:?})",
                    self.label
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Runs `reader`, a command that reads `table` in key order in share-locked chunks, while
    /// two application transactions lock rows of it in another order, and returns its output.
    /// `low < mid < high` are key literals of rows in the reader's first chunk, `set` the
    /// assignment the applications make.
    ///
    /// B locks `mid` and A `high`; the reader, holding `low`, waits for `mid`; A asks for `low`
    /// and waits for the reader; B commits; the reader goes on to `high` and waits for A. That
    /// is a deadlock in which A waited first, so PostgreSQL cancels A, unless the reader gives
    /// way before A's deadlock check. A failed statement of A ends its psql and this panics.
    pub fn applications_lock_against_a_reader(
        url: &str,
        table: &str,
        key: &str,
        set: &str,
        [low, mid, high]: [&str; 3],
        mut reader: Command,
    ) -> Output {
        let update = |k: &str| format!("UPDATE {table} SET {set} WHERE {key} = {k};");
        let mut b = Session::open_at(url, "give_way_b");
        let database = b.run("SELECT current_database();").trim().to_owned();
        b.run(&format!("BEGIN; {}", update(mid)));
        let mut a = Session::open_at(url, "give_way_a");
        a.run(&format!("BEGIN; {}", update(high)));
        let child = reader
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the reader starts");
        let reader = std::thread::spawn(move || wait_guarded(child, "the share-locking reader"));
        let waiting = |pid: &str| {
            psql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND {pid}"
            )) != "0"
        };
        let the_reader = format!(
            "datname = '{database}' AND pid NOT IN ({}, {}) AND query ILIKE '%FOR SHARE%' \
             AND query LIKE '%{table}%'",
            a.pid, b.pid
        );
        let deadline = Instant::now() + hang_guard();
        while !waiting(&the_reader) {
            assert!(
                Instant::now() < deadline,
                "the reader never waited for B's row"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        a.send(&update(low));
        // Aims the scenario: A queues behind the reader before B lets the reader go on. A
        // reader that gives way may have let A through already, so this waits a second at most.
        let aim = Instant::now() + Duration::from_secs(1);
        while Instant::now() < aim && !waiting(&format!("pid = {}", a.pid)) {
            std::thread::sleep(Duration::from_millis(5));
        }
        b.run("COMMIT;");
        a.wait();
        a.run("COMMIT;");
        reader.join().expect("the reader's thread")
    }

    impl Drop for Session {
        fn drop(&mut self) {
            // Ends psql (its open transaction, if any, is rolled back by the server).
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Runs `program args…` to its end and returns its output and peak resident set size in
    /// KiB, with how it was measured: `/usr/bin/time -f %M` (the kernel's ru_maxrss) when
    /// present, else by polling `/proc/PID/status` VmHWM (a high-water mark, read until the
    /// process ends).
    pub fn run_with_peak_rss(
        program: &Path,
        args: &[&std::ffi::OsStr],
        envs: &[(&str, &str)],
    ) -> (Output, u64, &'static str) {
        if Path::new("/usr/bin/time").exists() {
            let file = tempfile_path("rss");
            let mut cmd = Command::new("/usr/bin/time");
            cmd.arg("-f").arg("%M").arg("-o").arg(&file).arg(program);
            cmd.args(args);
            for (k, v) in envs {
                cmd.env(k, v);
            }
            let out = cmd.output().expect("/usr/bin/time runs");
            let kib = std::fs::read_to_string(&file)
                .ok()
                .and_then(|t| t.lines().last().and_then(|l| l.trim().parse().ok()))
                .unwrap_or_else(|| {
                    panic!(
                        "no peak RSS from /usr/bin/time ({}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    )
                });
            let _ = std::fs::remove_file(&file);
            return (out, kib, "/usr/bin/time -f %M");
        }
        let mut cmd = Command::new(program);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("the program starts");
        let status_file = format!("/proc/{}/status", child.id());
        let mut peak = 0u64;
        // Drain the pipes in threads so the child never blocks on a full pipe.
        let mut stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let out_thread = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stdout, &mut v);
            v
        });
        let err_thread = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stderr, &mut v);
            v
        });
        let status = loop {
            if let Ok(text) = std::fs::read_to_string(&status_file) {
                if let Some(kib) = text
                    .lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                {
                    peak = peak.max(kib);
                }
            }
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let out = Output {
            status,
            stdout: out_thread.join().unwrap(),
            stderr: err_thread.join().unwrap(),
        };
        (out, peak, "polling /proc/PID/status VmHWM")
    }

    fn tempfile_path(what: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!(
            "refract-test-{what}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ))
    }
}
