//! TLS to PostgreSQL on every connection refract opens, against the local server with a private
//! CA (`common::pg_tls`): the source (control, snapshot and replication connections) and the
//! sink under `verify-full` with a client certificate, `require` encrypting every connection,
//! and a wrong CA or a wrong host name refused with an error that names the cause.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::pg::{Cleanup, catch_up, hang_guard, psql};
use common::pg_table::{fresh_table, table_state};
use common::pg_tls::{CLIENT_DN, address_url, localhost_url, tls, with_params};
use common::*;
use serde_json::Value;

/// A password in the test URLs: the server trusts loopback and never asks for it, so it is only
/// there to be looked for (and not found) in refract's messages.
const PASSWORD: &str = "tls-s3cret";

/// `url` with [`PASSWORD`] as the user's password.
fn with_password(url: &str) -> String {
    url.replacen("://postgres@", &format!("://postgres:{PASSWORD}@"), 1)
}

/// A pipeline replicating table `name` into the PostgreSQL sink (schema `{name}_rm`), the
/// source and the sink at the URLs given.
fn pipeline_file(dir: &Path, name: &str, source_url: &str, sink_url: &str) -> PathBuf {
    let sink =
        format!("[sinks.pg]\nkind = \"postgres\"\nurl = \"{sink_url}\"\nschema = \"{name}_rm\"\n");
    common::pg::replica_pipeline(dir, name, source_url, "", &["pg"], &sink)
}

/// The sink's documents of table `name`, keyed as [`table_state`] keys the source's rows.
fn read_model(name: &str) -> BTreeMap<(String, String), Value> {
    let exists = psql(&format!(
        "SELECT to_regclass('{name}_rm.{name}') IS NOT NULL"
    ));
    if exists != "t" {
        return BTreeMap::new();
    }
    let json = psql(&format!(
        "SELECT coalesce(json_agg(json_build_array(id, doc)), '[]') FROM {name}_rm.{name}"
    ));
    let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
    rows.into_iter()
        .map(|r| {
            (
                (name.to_owned(), r[0].as_str().unwrap().to_owned()),
                r[1].clone(),
            )
        })
        .collect()
}

/// Waits until the sink holds exactly the source's rows (a daemon is applying them).
fn wait_for_equal(name: &str) {
    let deadline = Instant::now() + hang_guard();
    loop {
        let problems = diff(&table_state(name), &read_model(name));
        if problems.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the read model differs from the source: {:?}",
            &problems[..problems.len().min(5)]
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Fresh table `name` with rows, its slot, publication and read-model schema removed at the end.
fn fresh(name: &str) -> Cleanup {
    let cleanup = Cleanup::new(name, &[name]);
    psql(&format!("DROP SCHEMA IF EXISTS {name}_rm CASCADE"));
    fresh_table(name);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'row ' || g, g % 7, g * 1.25, NULL FROM generate_series(1, 300) g"
    ));
    cleanup
}

/// Changes after the snapshot: updates, deletes, a transaction, new rows.
fn change(name: &str) {
    psql(&format!(
        "UPDATE {name} SET qty = qty + 100, note = 'changed' WHERE id % 3 = 0;
         DELETE FROM {name} WHERE id % 5 = 0;
         BEGIN; UPDATE {name} SET name = 'in a transaction' WHERE id = 1; DELETE FROM {name} WHERE id = 2; COMMIT;
         INSERT INTO {name} SELECT g, 'new ' || g, 1, 2.50, 'n' FROM generate_series(1001, 1100) g;"
    ));
}

/// The TLS state of every session of refract's (those of `application_name`, which the
/// replication stream carries too): (backend type, ssl, client certificate's DN).
fn sessions(application_name: &str) -> Vec<(String, String, String)> {
    let text = psql(&format!(
        "SELECT a.backend_type, s.ssl, coalesce(s.client_dn, '-')
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
         WHERE a.application_name = '{application_name}' ORDER BY 1"
    ));
    text.lines()
        .map(|line| {
            let mut parts = line.split('|').map(str::to_owned);
            let mut next = || parts.next().unwrap_or_default();
            (next(), next(), next())
        })
        .collect()
}

/// Runs the pipeline: a catch-up run (the initial snapshot), then the changes under a daemon
/// until the sink equals the source; returns the daemon's sessions seen then.
fn replicate(name: &str, dir: &Path, pipeline: &Path) -> Vec<(String, String, String)> {
    catch_up(pipeline);
    wait_for_equal(name);
    let mut daemon = Running::spawn(
        refract()
            .arg("run")
            .arg(pipeline)
            .stderr(std::fs::File::create(dir.join("daemon.log")).unwrap()),
    );
    change(name);
    wait_for_equal(name);
    let seen = sessions(name);
    daemon.terminate();
    let status = daemon.into_child().wait().unwrap();
    let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap();
    assert!(status.success(), "the daemon failed: {log}");
    assert!(!log.contains(PASSWORD), "{log}");
    seen
}

/// Asserts that refract had a walsender and ordinary sessions, each encrypted, with the client
/// DN given (`-` for none).
fn assert_all_encrypted(seen: &[(String, String, String)], client_dn: &str) {
    assert!(
        seen.iter().any(|(kind, _, _)| kind == "walsender"),
        "the replication stream: {seen:?}"
    );
    assert!(
        seen.iter()
            .filter(|(kind, _, _)| kind == "client backend")
            .count()
            >= 2,
        "the source's control connection and the sink's: {seen:?}"
    );
    for (kind, ssl, dn) in seen {
        assert_eq!(
            (ssl.as_str(), dn.as_str()),
            ("t", client_dn),
            "{kind}: {seen:?}"
        );
    }
}

#[test]
fn source_and_sink_under_verify_full_with_a_client_certificate() {
    let name = "tls_full";
    let files = tls();
    let _cleanup = fresh(name);
    let dir = tempfile::tempdir().unwrap();
    let url = with_params(
        &with_password(&localhost_url()),
        &format!(
            "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}&application_name={name}",
            files.ca.display(),
            files.client_cert.display(),
            files.client_key.display()
        ),
    );
    let pipeline = pipeline_file(dir.path(), name, &url, &url);
    let seen = replicate(name, dir.path(), &pipeline);
    assert_all_encrypted(&seen, CLIENT_DN);
    println!("verify-full + client certificate: read model equals the source; sessions {seen:?}");
}

#[test]
fn require_encrypts_every_connection() {
    let name = "tls_require";
    tls();
    let _cleanup = fresh(name);
    let dir = tempfile::tempdir().unwrap();
    // No CA: `require` encrypts without checking the certificate, so any host name will do.
    let url = with_params(
        &address_url(),
        &format!("sslmode=require&application_name={name}"),
    );
    let pipeline = pipeline_file(dir.path(), name, &url, &url);
    let seen = replicate(name, dir.path(), &pipeline);
    assert_all_encrypted(&seen, "-");
    println!("require: every session encrypted: {seen:?}");
}

/// Runs `refract COMMAND PIPELINE`, expecting failure; returns its stderr.
fn refused(command: &[&str], pipeline: &Path) -> String {
    let out = output(refract().args(command).arg(pipeline));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{command:?} succeeded: {stderr}");
    assert!(!stderr.contains(PASSWORD), "{stderr}");
    stderr
}

/// What `refract plan PIPELINE` says, on stdout and stderr (it reports a source it cannot reach
/// and goes on).
fn plan_text(pipeline: &Path) -> String {
    let out = output(refract().arg("plan").arg(pipeline));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains(PASSWORD), "{text}");
    text
}

/// A pipeline from a one-line change log into the PostgreSQL sink at `sink_url`.
fn sink_only_pipeline(dir: &Path, name: &str, sink_url: &str) -> PathBuf {
    let log = dir.join("changes.jsonl");
    std::fs::write(
        &log,
        r#"{"before":null,"after":{"id":1,"name":"a"},"op":"c","source":{"connector":"postgresql","schema":"public","table":"items","ts_ms":1790000000000}}
"#,
    )
    .unwrap();
    let text = format!(
        r#"[pipeline]
name = "{name}"
state_dir = "{state}"

[source]
kind = "file"
path = "{log}"

[projections.replica]
kind = "replica"
tables = ["items"]
sinks = ["pg"]

[sinks.pg]
kind = "postgres"
url = "{sink_url}"
schema = "{name}_rm"
"#,
        state = dir.join("state-sink-only").display(),
        log = log.display(),
    );
    let path = dir.join("sink-only.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_wrong_ca_is_refused_with_its_cause() {
    let name = "tls_wrong_ca";
    let files = tls();
    let _cleanup = fresh(name);
    let dir = tempfile::tempdir().unwrap();
    let wrong = with_params(
        &with_password(&localhost_url()),
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            files.other_ca.display()
        ),
    );
    let expected = format!(
        "TLS: the server certificate is not signed by the CA in sslrootcert={}",
        files.other_ca.display()
    );
    let right = with_params(
        &localhost_url(),
        &format!("sslmode=verify-full&sslrootcert={}", files.ca.display()),
    );
    let source_wrong = pipeline_file(dir.path(), name, &wrong, &right);
    let run = refused(&["run", "--until-caught-up"], &source_wrong);
    assert!(run.contains(&expected), "the source: {run}");
    let plan = plan_text(&source_wrong);
    assert!(plan.contains(&expected), "plan: {plan}");
    let sink_wrong = sink_only_pipeline(dir.path(), name, &wrong);
    let sink = refused(&["run", "--until-caught-up"], &sink_wrong);
    assert!(sink.contains(&expected), "the sink: {sink}");
    println!("wrong CA refused: {}", run.trim());
}

#[test]
fn a_wrong_host_is_refused_under_verify_full_and_not_checked_under_verify_ca() {
    let name = "tls_wrong_host";
    let files = tls();
    let _cleanup = fresh(name);
    let dir = tempfile::tempdir().unwrap();
    let at_address = |mode: &str| {
        with_params(
            &with_password(&address_url()),
            &format!("sslmode={mode}&sslrootcert={}", files.ca.display()),
        )
    };
    let full = at_address("verify-full");
    let pipeline = pipeline_file(dir.path(), name, &full, &full);
    let run = refused(&["run", "--until-caught-up"], &pipeline);
    assert!(
        run.contains("TLS: the server certificate is for localhost, not 127.0.0.1"),
        "{run}"
    );
    let sink_wrong = sink_only_pipeline(dir.path(), name, &full);
    let sink = refused(&["run", "--until-caught-up"], &sink_wrong);
    assert!(
        sink.contains("TLS: the server certificate is for localhost, not 127.0.0.1"),
        "the sink: {sink}"
    );
    // verify-ca checks the chain only: the same address is accepted (by the sink's and plan's
    // connections; pgwire-replication 0.5's verify-ca checks the host name too, see
    // docs/sources/postgres.md).
    let ca = at_address("verify-ca");
    catch_up(&sink_only_pipeline(dir.path(), name, &ca));
    assert_eq!(
        psql(&format!("SELECT count(*) FROM {name}_rm.items")),
        "1",
        "the sink wrote under verify-ca"
    );
    let plan = plan_text(&pipeline_file(dir.path(), name, &ca, &ca));
    assert!(!plan.contains("TLS:"), "plan: {plan}");
    println!("wrong host refused: {}", run.trim());
}

#[test]
fn validate_names_an_unknown_sslmode() {
    let dir = tempfile::tempdir().unwrap();
    let url = with_params(&with_password(&localhost_url()), "sslmode=verify_full");
    let pipeline = pipeline_file(dir.path(), "tls_validate", &url, &localhost_url());
    let stderr = refused(&["validate"], &pipeline);
    assert!(
        stderr.contains("source.url")
            && stderr.contains(
                "sslmode `verify_full` is not one of disable, prefer, require, verify-ca, verify-full"
            ),
        "{stderr}"
    );
}
