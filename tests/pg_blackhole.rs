//! A network black hole between refract and PostgreSQL: a proxy started by the test stops
//! forwarding without closing anything (no FIN, no RST) while a writer keeps changing the table.
//! refract must notice within the black hole (the stream's read deadline, `/health` answering
//! 503 naming the source), and once the network is back, reopen the stream and bring the read
//! model to equal the table. The connections caught in the black hole stay dead for good, as
//! flows a middlebox forgot: without a read deadline the stream would wait on them forever.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::cache::try_http_get;
use common::pg::{Cleanup, hang_guard, url as pg_url};
use common::pg_table::{filled_table, stop_load, table_state, update_delete_load};
use common::proxy::Proxy;
use common::*;

/// The replication connection's read deadline in the pipeline: short, so the black hole is
/// noticed well within it.
const READ_TIMEOUT_MS: u64 = 5_000;
/// The source's bound on a reconnection before `/health` says 503.
const UNHEALTHY_AFTER_MS: u64 = 2_000;

/// How long the network stays black-holed: 30 s, 15 s in CI.
fn hole() -> Duration {
    Duration::from_secs(if in_ci() { 15 } else { 30 })
}

/// `(host:port, URL through the proxy listening on proxy_port)` of the test server.
fn through_proxy(proxy_port: u16) -> (String, String) {
    let url = pg_url();
    let (scheme_user, rest) = url.split_once('@').expect("PG_URL names a user");
    let (host_port, db) = rest.split_once('/').expect("PG_URL names a database");
    let upstream = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    };
    (
        upstream,
        format!("{scheme_user}@127.0.0.1:{proxy_port}/{db}"),
    )
}

fn pipeline_file(dir: &Path, name: &str, url: &str, status: &str) -> std::path::PathBuf {
    let text = format!(
        r#"[pipeline]
name = "{name}"
state_dir = "{state}"
metrics_addr = "{status}"

[pipeline.batch]
max_events = 300
max_delay_ms = 50

[source]
kind = "postgres"
url = "{url}"
tables = ["public.{name}"]
read_timeout_ms = {READ_TIMEOUT_MS}
unhealthy_after_ms = {UNHEALTHY_AFTER_MS}

[projections.replica]
kind = "replica"
sinks = ["docs"]

[sinks.docs]
kind = "object_json"
url = "file://{out}"
"#,
        state = dir.join("state").display(),
        out = dir.join("out").display(),
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Polls `path` on the status endpoint until `done` holds of (status, body), or `deadline`;
/// returns the last answer and whether `done` held.
fn poll_status(
    status: &str,
    path: &str,
    deadline: Instant,
    done: impl Fn(u16, &str) -> bool,
) -> (Option<(u16, String)>, bool) {
    loop {
        let answer = try_http_get(status, path);
        if answer
            .as_ref()
            .is_some_and(|(code, body)| done(*code, body))
        {
            return (answer, true);
        }
        if Instant::now() >= deadline {
            return (answer, false);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_network_black_hole_is_noticed_and_the_stream_resumes_without_loss() {
    let name = "pg_blackhole";
    let _cleanup = Cleanup::new(name, &[name]);
    let rows = if in_ci() { 2_000 } else { 10_000 };
    filled_table(name, rows);
    let proxy = Proxy::start(&through_proxy(0).0);
    let (_, url) = through_proxy(proxy.port());
    let dir = tempfile::tempdir().unwrap();
    let status = common::cache::free_addr();
    let pipeline = pipeline_file(dir.path(), name, &url, &status);
    let log = dir.path().join("daemon.log");
    let mut daemon = Running::spawn(
        refract()
            .env("RUST_LOG", "info")
            .arg("run")
            .arg(&pipeline)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap()),
    );
    let daemon_log = || std::fs::read_to_string(&log).unwrap_or_default();

    // Ready (streaming, sinks open), the existing rows read, a writer running.
    let (answer, ready) = poll_status(&status, "/ready", Instant::now() + hang_guard(), |c, _| {
        c == 200
    });
    assert!(ready, "never ready: {answer:?}\n{}", daemon_log());
    let load = update_delete_load(name, rows, 200, 3_600);
    let out = dir.path().join("out");
    let deadline = Instant::now() + hang_guard();
    while !read_output_live(&out)
        .values()
        .any(|d| d["name"].as_str().is_some_and(|n| n.starts_with("load ")))
    {
        assert!(
            Instant::now() < deadline,
            "the load never reached the read model\n{}",
            daemon_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The black hole: /health must say 503, naming the source as reconnecting, before it ends.
    let connections_before = proxy.connections();
    proxy.black_hole();
    let started = Instant::now();
    let (answer, noticed) = poll_status(&status, "/health", started + hole(), |code, body| {
        code == 503
            && body.contains(&format!("pg:refract_{name}"))
            && body.contains("\"reconnecting\"")
    });
    let noticed_after = started.elapsed();
    assert!(
        noticed,
        "not noticed within the {} s black hole; /health answered {answer:?}\n{}",
        hole().as_secs(),
        daemon_log()
    );
    let source_gauge = |value: &'static str| {
        let series = format!("source=\"pg:refract_{name}\"");
        move |code: u16, body: &str| {
            code == 200
                && body.lines().any(|l| {
                    l.starts_with("refract_source_healthy{")
                        && l.contains(&series)
                        && l.ends_with(value)
                })
        }
    };
    let (metrics, exported) =
        poll_status(&status, "/metrics", started + hole(), source_gauge(" 0"));
    assert!(
        exported,
        "refract_source_healthy 0 in the black hole: {metrics:?}"
    );
    assert!(
        daemon.child().try_wait().unwrap().is_none(),
        "the daemon keeps running through the black hole"
    );
    // The rest of the black hole, as long as the fault lasts (not a wait for a state).
    std::thread::sleep(hole().saturating_sub(started.elapsed()));
    proxy.lift();
    let load_running = stop_load(load);
    assert!(load_running, "the writer ran through the black hole");

    // Back: the stream reopened through new connections, the read model equals the table.
    let expected = table_state(name);
    let deadline = Instant::now() + hang_guard();
    while read_output_live(&out) != expected {
        assert!(
            Instant::now() < deadline,
            "the read model never caught up after the black hole\n{}",
            daemon_log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (answer, healthy) =
        poll_status(&status, "/health", Instant::now() + hang_guard(), |c, _| {
            c == 200
        });
    assert!(healthy, "healthy again: {answer:?}");
    let (metrics, exported) = poll_status(
        &status,
        "/metrics",
        Instant::now() + hang_guard(),
        source_gauge(" 1"),
    );
    assert!(exported, "refract_source_healthy 1 after it: {metrics:?}");
    daemon.terminate();
    let exit = daemon.child().wait().unwrap();
    let text = daemon_log();
    assert!(exit.success(), "{text}");
    assert!(text.contains("silent past its read deadline"), "{text}");
    assert!(text.contains("the control connection"), "{text}");
    assert!(
        proxy.connections() > connections_before,
        "reconnected through the proxy"
    );
    assert_read_model(&expected, &out, "after the black hole");
    eprintln!(
        "black hole of {} s under 200 tx/s: noticed (503, source reconnecting) after {:.1} s; {} rows equal after it",
        hole().as_secs(),
        noticed_after.as_secs_f64(),
        expected.len()
    );
}
