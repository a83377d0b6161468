//! Secrets never leak (issue 26): every command runs at `RUST_LOG=trace` with sentinel passwords
//! in every URL and credential of its files and environment, successful runs and failing ones
//! (a wrong password, a service that does not answer, a bad configuration), and the sentinels
//! appear nowhere: not on stdout or stderr, not in the dead letters, the state files, the
//! outputs, nor in `plan`.
//!
//! Each command's output is also checked for the work it did (rows verified, an error that
//! names the failure, trace lines written), so that a run which printed nothing, and so leaked
//! nothing, cannot pass for a clean one.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::cache::{RedisServer, free_port};
use common::migrate::Migration;
use common::{documents, pg, refract};

/// The password every URL and credential carries.
const SENTINEL: &str = "Sn7sentinelQ4pw";
/// The wrong password of the failing runs: it must not leak either.
const WRONG: &str = "Wr0ngsentinelK8pw";
/// How long a failing run may take to show its failure before the test gives up on it.
const FAILURE_DEADLINE: Duration = Duration::from_secs(120);

/// What the commands wrote where a person or a program could read it later.
#[derive(Default)]
struct Evidence {
    /// (what, the bytes written).
    seen: Vec<(String, Vec<u8>)>,
}

impl Evidence {
    /// Runs `cmd` at trace level to its end and keeps its stdout and stderr.
    fn run(&mut self, what: &str, cmd: &mut Command) -> Output {
        let out = cmd
            .env("RUST_LOG", "trace")
            .env("NO_COLOR", "1")
            .output()
            .expect("refract runs");
        self.keep(what, &out);
        out
    }

    /// Runs `cmd` at trace level until its stderr shows `needle` (the failure it is expected
    /// to report, or retry on), then stops it and keeps what it wrote.
    fn run_until(&mut self, what: &str, cmd: &mut Command, needle: &str) {
        let mut child = cmd
            .env("RUST_LOG", "trace")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("refract starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).split(b'\n') {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let started = Instant::now();
        let mut written = Vec::new();
        let mut found = false;
        while !found && started.elapsed() < FAILURE_DEADLINE {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    found = String::from_utf8_lossy(&line).contains(needle);
                    written.extend_from_slice(&line);
                    written.push(b'\n');
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = child.kill();
        let out = child.wait_with_output().expect("refract ends");
        let _ = reader.join();
        written.extend(rx.try_iter().flatten());
        self.seen.push((format!("{what}: stdout"), out.stdout));
        self.seen.push((format!("{what}: stderr"), written.clone()));
        assert!(
            found,
            "{what}: `{needle}` never appeared on stderr within {FAILURE_DEADLINE:?}: {}",
            tail(&written)
        );
    }

    fn keep(&mut self, what: &str, out: &Output) {
        self.seen
            .push((format!("{what}: stdout"), out.stdout.clone()));
        self.seen
            .push((format!("{what}: stderr"), out.stderr.clone()));
    }

    /// Every file under `dir` (state, dead letters, outputs), pipeline files excepted: they hold
    /// the sentinels on purpose.
    fn files(&mut self, dir: &Path) {
        for entry in walk(dir) {
            if entry.extension().is_some_and(|e| e == "toml") {
                continue;
            }
            let bytes = std::fs::read(&entry).unwrap();
            self.seen.push((entry.display().to_string(), bytes));
        }
    }

    /// Fails naming every place a sentinel was found, with the line it is on.
    fn assert_clean(&self) {
        let mut leaks = Vec::new();
        for (what, bytes) in &self.seen {
            let text = String::from_utf8_lossy(bytes);
            for line in text.lines() {
                if line.contains(SENTINEL) || line.contains(WRONG) {
                    leaks.push(format!("{what}: {}", clip(line)));
                }
            }
        }
        assert!(
            leaks.is_empty(),
            "{} lines show a sentinel password:\n{}",
            leaks.len(),
            leaks.join("\n")
        );
        let bytes: usize = self.seen.iter().map(|(_, b)| b.len()).sum();
        eprintln!(
            "checked {} outputs and files, {bytes} bytes",
            self.seen.len()
        );
    }
}

/// A run that wrote no debug or trace line shows little, so would leak little: it must not
/// pass for a clean one.
fn assert_traced(what: &str, out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(" TRACE ") || stderr.contains(" DEBUG "),
        "{what}: no debug or trace line written: {}",
        tail(&out.stderr)
    );
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

fn clip(line: &str) -> String {
    line.chars().take(400).collect()
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// `url` with `password` in its user-info (`postgres://user@…` → `postgres://user:pw@…`).
fn with_password(url: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    match rest.split_once('@') {
        Some((user, host)) => format!("{scheme}://{user}:{password}@{host}"),
        None => format!("{scheme}://:{password}@{rest}"),
    }
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    free_port()
}

fn shipped(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(name)
}

#[test]
fn sentinel_passwords_appear_in_no_output_state_dead_letter_or_plan() {
    let mut evidence = Evidence::default();
    let redis = RedisServer::start(false);
    let set = Command::new("redis-cli")
        .args([
            "-p",
            &redis.port.to_string(),
            "CONFIG",
            "SET",
            "requirepass",
            SENTINEL,
        ])
        .output()
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    let redis_url = with_password(&redis.url(), SENTINEL);

    documents_from_postgres(&mut evidence, &redis_url);
    demo_files_into_redis_parquet_and_dead_letters(&mut evidence, &redis.url());
    tiers(&mut evidence, &redis_url);
    migration(&mut evidence);
    kafka_and_bad_config(&mut evidence);
    evidence.assert_clean();
}

/// The shipped document pipeline from PostgreSQL into PostgreSQL: validate, plan, run,
/// backfill, verify, drop; then a run against a PostgreSQL that does not answer.
fn documents_from_postgres(evidence: &mut Evidence, _redis_url: &str) {
    let schema = "secrets_docs";
    let dir = tempfile::tempdir().unwrap();
    documents::fresh_schema(schema);
    pg::psql(&format!(
        "INSERT INTO {schema}.authors (id, first_name, last_name) VALUES ('a1', 'Ada', 'L'), ('a2', 'Bo', 'K');
         INSERT INTO {schema}.books (id, name) VALUES ('b1', 'One'), ('b2', 'Two');
         INSERT INTO {schema}.book_authors VALUES ('b1', 'a1', 0), ('b2', 'a2', 0);"
    ));
    let file = documents::pipeline_file(dir.path(), schema);
    let source = with_password(&pg::url(), SENTINEL);
    let target = format!(
        "{}?password={SENTINEL}",
        with_password(&pg::url(), SENTINEL)
    );
    let cmd = |args: &[&str]| {
        let mut cmd = refract();
        cmd.args(args)
            .arg(&file)
            .env("PG_URL", &source)
            .env("TARGET_PG_URL", &target);
        cmd
    };
    let _drop_at_end = Dropper(cmd(&["drop", "--yes"]));
    let out = evidence.run("validate authors-books", &mut cmd(&["validate"]));
    assert!(out.status.success(), "validate: {out:?}");
    let out = evidence.run("plan authors-books", &mut cmd(&["plan"]));
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(
        plan.contains("postgres:***@"),
        "plan shows the URL, masked: {plan}"
    );
    let out = evidence.run("run authors-books", cmd(&["run"]).arg("--until-caught-up"));
    assert!(out.status.success(), "run: {}", tail(&out.stderr));
    assert_traced("run authors-books", &out);
    let out = evidence.run("backfill authors-books", &mut cmd(&["backfill"]));
    assert!(out.status.success(), "backfill: {}", tail(&out.stderr));
    let out = evidence.run("verify authors-books", &mut cmd(&["verify"]));
    assert_eq!(out.status.code(), Some(0), "verify: {}", tail(&out.stdout));
    let out = evidence.run("drop (dry run) authors-books", &mut cmd(&["drop"]));
    assert_eq!(out.status.code(), Some(2), "drop without --yes: {out:?}");
    evidence.files(dir.path());

    // PostgreSQL that does not answer: the run keeps trying, and says so.
    let down = format!(
        "postgres://postgres:{WRONG}@127.0.0.1:{}/refract",
        closed_port()
    );
    let mut failing = refract();
    failing
        .args(["run"])
        .arg(&file)
        .env("PG_URL", &down)
        .env("TARGET_PG_URL", &down);
    evidence.run_until(
        "run authors-books, PostgreSQL down",
        &mut failing,
        "onnection refused",
    );
}

/// The embedded demo (files into object JSON, Redis and Parquet) with a bad line that goes to
/// the dead letters; compaction; then a run with the wrong Redis password.
fn demo_files_into_redis_parquet_and_dead_letters(evidence: &mut Evidence, redis: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let mut changes = std::fs::read_to_string(shipped("demo/changes.jsonl")).unwrap();
    changes.push_str("{\"this is\": not a change event\n");
    std::fs::write(&log, changes).unwrap();
    let out_dir = dir.path().join("out");
    let cmd = |args: &[&str], password: &str| {
        let mut cmd = refract();
        cmd.args(args)
            .arg(shipped("demo.toml"))
            .env("STATE_DIR", dir.path().join("state"))
            .env("DEMO_OUT", &out_dir)
            .env("DEMO_CHANGE_LOG", &log)
            .env("OBJECT_STORE_URL", format!("file://{}", out_dir.display()))
            .env("REDIS_URL", with_password(redis, password));
        cmd
    };
    let out = evidence.run("run demo", &mut cmd(&["run"], SENTINEL));
    assert!(out.status.success(), "demo: {}", tail(&out.stderr));
    assert_traced("run demo", &out);
    let letters = std::fs::read_to_string(out_dir.join("dead-letters.ndjson")).unwrap_or_default();
    assert!(
        letters.contains("not a change event"),
        "the bad line is a dead letter: {letters}"
    );
    let out = evidence.run("compact demo", &mut cmd(&["compact"], SENTINEL));
    assert!(out.status.success(), "compact: {}", tail(&out.stderr));
    evidence.files(dir.path());

    // The wrong password: Redis refuses it, and the sink says so.
    std::fs::remove_dir_all(dir.path().join("state")).unwrap();
    evidence.run_until(
        "run demo, wrong Redis password",
        &mut cmd(&["run"], WRONG),
        "authentication failed",
    );
}

/// The tiers demo into a Redis and a PostgreSQL that want the password, then aging and a query.
fn tiers(evidence: &mut Evidence, redis_url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let table = "secrets_heartbeats_warm";
    let file = dir.path().join("tiers.toml");
    let text = std::fs::read_to_string(shipped("demo-tiers.toml"))
        .unwrap()
        .replace("demo_heartbeats_warm", table)
        .replace("name = \"demo-tiers\"", "name = \"secrets-tiers\"");
    std::fs::write(&file, text).unwrap();
    pg::psql(&format!("DROP TABLE IF EXISTS {table} CASCADE"));
    let out_dir = dir.path().join("out");
    let target = with_password(&pg::url(), SENTINEL);
    let cmd = |args: &[&str]| {
        let mut cmd = refract();
        cmd.arg(args[0])
            .arg(&file)
            .args(&args[1..])
            .env("STATE_DIR", dir.path().join("state"))
            .env("DEMO_OUT", &out_dir)
            .env("DEMO_HEARTBEATS", shipped("demo/heartbeats.jsonl"))
            .env("OBJECT_STORE_URL", format!("file://{}", out_dir.display()))
            .env("REDIS_URL", redis_url)
            .env("TARGET_PG_URL", &target);
        cmd
    };
    let out = evidence.run("run demo-tiers", &mut cmd(&["run"]));
    assert!(out.status.success(), "demo-tiers: {}", tail(&out.stderr));
    let out = evidence.run("tiers age", &mut cmd(&["tiers", "age"]));
    assert!(out.status.success(), "tiers age: {}", tail(&out.stderr));
    let out = evidence.run(
        "tiers latest",
        &mut cmd(&["tiers", "latest", "--device", "dev-011", "-n", "3"]),
    );
    assert!(out.status.success(), "tiers latest: {}", tail(&out.stderr));
    evidence.files(dir.path());
    pg::psql(&format!("DROP TABLE IF EXISTS {table} CASCADE"));
}

/// A shadow-write migration's phases with the password in the database URL.
fn migration(evidence: &mut Evidence) {
    let m = Migration::create("secrets_migration", 200);
    let url = with_password(&m.db.url(), SENTINEL);
    let phase = |name: &str, args: &[&str]| {
        let mut cmd = m.command(name, args);
        cmd.env("PG_URL", &url);
        cmd
    };
    let out = evidence.run("migrate start", &mut phase("start", &["--until-caught-up"]));
    assert!(out.status.success(), "start: {}", tail(&out.stderr));
    for name in ["backfill", "verify", "status"] {
        let out = evidence.run(&format!("migrate {name}"), &mut phase(name, &[]));
        assert!(out.status.success(), "{name}: {}", tail(&out.stderr));
    }
    let out = evidence.run(
        "validate migration",
        refract().arg("validate").arg(&m.file).env("PG_URL", &url),
    );
    assert!(out.status.success(), "validate: {out:?}");
    evidence.files(m.state.path());
}

/// A Kafka source (Avro through a registry) and sink with SASL credentials, against a broker
/// and a registry that do not answer; and a pipeline file with an error beside its secrets.
fn kafka_and_bad_config(evidence: &mut Evidence) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kafka.toml");
    std::fs::write(
        &file,
        format!(
            r#"[pipeline]
name = "secrets_kafka"
state_dir = "{state}"

[source]
kind = "kafka"
brokers = "127.0.0.1:{broker}"
topics = ["secrets.public.products"]
format = "debezium_avro"
schema_registry = {{ url = "http://registry:{SENTINEL}@127.0.0.1:{registry}", username = "svc", password = "${{SCHEMA_REGISTRY_PASSWORD}}" }}
properties = {{ "security.protocol" = "SASL_PLAINTEXT", "sasl.mechanism" = "PLAIN", "sasl.username" = "svc", "sasl.password" = "{SENTINEL}" }}

[projections.relay]
kind = "relay"
sinks = ["out"]

[sinks.out]
kind = "kafka"
brokers = "127.0.0.1:{broker}"
topic_prefix = "mirror"
properties = {{ "security.protocol" = "SASL_PLAINTEXT", "sasl.mechanism" = "PLAIN", "sasl.username" = "svc", "sasl.password" = "${{KAFKA_PASSWORD}}" }}
"#,
            state = dir.path().join("state").display(),
            broker = closed_port(),
            registry = closed_port(),
        ),
    )
    .unwrap();
    let cmd = |what: &str| {
        let mut cmd = refract();
        cmd.arg(what)
            .arg(&file)
            .env("SCHEMA_REGISTRY_PASSWORD", SENTINEL)
            .env("KAFKA_PASSWORD", SENTINEL);
        cmd
    };
    for what in ["validate", "plan"] {
        let out = evidence.run(&format!("{what} kafka"), &mut cmd(what));
        assert!(out.status.success(), "{what}: {out:?}");
    }
    evidence.run_until(
        "run kafka, broker down",
        &mut cmd("run"),
        "onnection refused",
    );
    evidence.files(dir.path());

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        format!(
            r#"[pipeline]
name = "secrets_bad"

[source]
kind = "postgres"
url = "postgres://svc:{SENTINEL}@127.0.0.1:1/db?password={SENTINEL}"
chunk_rows = 1

[projections.replica]
kind = "replica"
sinks = ["docs"]

[sinks.docs]
kind = "redis"
url = "rediss://:{SENTINEL}@127.0.0.1:1"
password = "{SENTINEL}"
no_such_setting = true
"#
        ),
    )
    .unwrap();
    for what in ["validate", "plan", "run"] {
        let out = evidence.run(&format!("{what} bad config"), refract().arg(what).arg(&bad));
        assert_eq!(
            out.status.code(),
            Some(2),
            "{what} of a bad file exits 2: {out:?}"
        );
    }
}

/// Runs `refract drop --yes` when the test ends, also when it fails.
struct Dropper(Command);

impl Drop for Dropper {
    fn drop(&mut self) {
        let _ = self.0.env("RUST_LOG", "warn").output();
    }
}
