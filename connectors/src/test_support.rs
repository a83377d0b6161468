//! What the unit tests share: checks that a live service a test needs is there.
//!
//! A few unit tests talk to a real service: Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), moto's S3 server (started by the test, from the `moto` Python
//! package). Such a test begins with a check from here. Where the service is missing, the test
//! says so on stderr and returns (passing) on a developer's machine; in CI (the environment
//! variable `CI` set to anything non-empty, as CI services set it) it fails instead, so a
//! missing service never passes for a green run there.

use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long a probe waits for a TCP connection: a service on loopback answers at once, and
/// an absent one refuses at once; the bound is for an address that drops packets.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// The address of Redis when `REDIS_URL` does not say.
const REDIS_DEFAULT: &str = "redis://127.0.0.1:6379";

/// Whether `service` accepts TCP connections at `addr` (`host:port`). When it does not: false
/// after a message on stderr, or a panic in CI (see the module doc).
pub(crate) fn live_service(service: &str, addr: &str) -> bool {
    reachable(addr) || missing(service, &format!("not reachable at {addr}"))
}

/// Whether something accepts TCP connections at `addr` within [`PROBE_TIMEOUT`].
fn reachable(addr: &str) -> bool {
    addr.to_socket_addrs()
        .is_ok_and(|mut addrs| addrs.any(|a| TcpStream::connect_timeout(&a, PROBE_TIMEOUT).is_ok()))
}

/// Whether the Redis of `REDIS_URL` (default `redis://127.0.0.1:6379`) is reachable; see
/// [`live_service`].
pub(crate) fn redis() -> bool {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| REDIS_DEFAULT.into());
    let addr = match url::Url::parse(&url) {
        Ok(u) => format!(
            "{}:{}",
            u.host_str().unwrap_or("127.0.0.1"),
            u.port().unwrap_or(6379)
        ),
        Err(_) => url,
    };
    live_service("Redis", &addr)
}

/// Whether `python3` can import `module` (a service the test starts itself, such as moto's
/// server); see [`live_service`].
pub(crate) fn python_module(module: &str) -> bool {
    let imported = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    imported
        || missing(
            module,
            &format!("not installed (python3 -c \"import {module}\")"),
        )
}

/// The service is missing: fails the test in CI, else says why it is skipped. Returns false.
fn missing(service: &str, why: &str) -> bool {
    // libtest runs each test on a thread named after it.
    let current = std::thread::current();
    let test = current.name().unwrap_or("a test");
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    match verdict(test, service, why, ci) {
        Ok(skip) => {
            // Written to stderr itself: libtest captures `eprintln!` and shows it only on
            // failure.
            let _ = writeln!(std::io::stderr(), "{skip}");
            false
        }
        Err(failure) => panic!("{failure}"),
    }
}

/// What a missing service means for `test`: the message it is skipped with, or in CI the
/// message it fails with.
fn verdict(test: &str, service: &str, why: &str, ci: bool) -> Result<String, String> {
    if ci {
        Err(format!(
            "{test}: {service} {why}; CI is set, so the test fails instead of skipping"
        ))
    } else {
        Ok(format!("skipping {test}: {service} {why} (CI runs it)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_port_is_reachable_and_a_closed_one_is_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        assert!(reachable(&addr));
        drop(listener);
        assert!(!reachable(&addr));
    }

    #[test]
    fn a_missing_service_skips_except_in_ci() {
        let why = "not reachable at 127.0.0.1:6379";
        assert_eq!(
            verdict("t", "Redis", why, false).unwrap(),
            "skipping t: Redis not reachable at 127.0.0.1:6379 (CI runs it)"
        );
        let failure = verdict("t", "Redis", why, true).unwrap_err();
        assert!(failure.contains("CI is set"), "{failure}");
    }
}
