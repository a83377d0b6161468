//! Helpers shared by the end-to-end tests: the binary, pipeline files, a deterministic change-log
//! generator, an independent model of the expected read model, and a reader of the output.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

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

/// A running `refract` process that is killed (SIGKILL) if the test ends before it does, so a
/// failing test never leaves a daemon holding the test runner's output open.
pub struct Running(Option<std::process::Child>);

impl Running {
    pub fn spawn(cmd: &mut Command) -> Self {
        Running(Some(cmd.spawn().expect("the refract binary starts")))
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
