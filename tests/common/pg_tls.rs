//! A private CA for the local PostgreSQL (`PG_URL`, on this machine): its certificate, a server
//! certificate it signed for `DNS:localhost` only (so `127.0.0.1` under `verify-full` is the
//! wrong host), a client certificate it signed, and a second CA that signed nothing (the wrong
//! CA). The server is pointed at them with `ALTER SYSTEM` and a reload, never a restart.
//!
//! Other tests run at the same time and connect without TLS, which these settings do not touch.
//! Two runs of the TLS tests must not break each other either, so the files are made once, in a
//! fixed directory that appears whole (made aside, then renamed into place: a run that loses the
//! race uses the winner's) and is reused afterwards; the server settings are only ever set to
//! that directory's files.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use super::pg::{hang_guard, psql};

/// Where the certificates live: beside the cluster's data, readable by the `postgres` user, kept
/// across runs (the server's settings name these files, so they must outlive the test).
const DEFAULT_DIR: &str = "/var/lib/postgresql/refract-test-tls";
/// The owner of the server's key file (PostgreSQL refuses a key others can read).
const SERVER_USER: &str = "postgres";
/// Validity of the certificates: far beyond any run, since the directory is reused.
const DAYS: &str = "3650";
/// The subject of the client certificate, as `pg_stat_ssl.client_dn` shows it.
pub const CLIENT_DN: &str = "/CN=refract-test-client";

/// The files of the private CA.
pub struct TlsFiles {
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    /// A CA that signed neither.
    pub other_ca: PathBuf,
    /// The client certificate and its key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    dir: PathBuf,
}

/// The CA's files, made if missing, with the server using them (once per test process).
pub fn tls() -> &'static TlsFiles {
    static FILES: OnceLock<TlsFiles> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = PathBuf::from(
            std::env::var("REFRACT_TEST_PG_TLS_DIR").unwrap_or_else(|_| DEFAULT_DIR.into()),
        );
        if !dir.join("ca.pem").exists() {
            make_directory(&dir);
        }
        let files = TlsFiles {
            ca: dir.join("ca.pem"),
            other_ca: dir.join("other-ca.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            dir,
        };
        point_the_server_at(&files);
        files
    })
}

/// Makes the files in a directory of their own, then renames it to `dir`. A rename onto a
/// directory another run has already filled fails, and that run's files are used.
fn make_directory(dir: &Path) {
    let parent = dir.parent().expect("the TLS directory has a parent");
    let aside = parent.join(format!(
        ".refract-test-tls-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&aside).unwrap();
    make_certificates(&aside);
    if std::fs::rename(&aside, dir).is_err() {
        std::fs::remove_dir_all(&aside).unwrap();
        assert!(dir.join("ca.pem").exists(), "no TLS directory at {dir:?}");
    }
}

/// The CA, the server and client certificates it signed, and the other CA, with openssl.
fn make_certificates(d: &Path) {
    std::fs::write(d.join("server.ext"), "subjectAltName=DNS:localhost\n").unwrap();
    // An extension makes an X.509 v3 certificate, the only version rustls sends.
    std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    let ca = |name: &str, cn: &str| -> Vec<String> {
        let args = format!(
            "req -x509 -newkey rsa:2048 -nodes -days {DAYS} -subj /CN={cn} \
             -keyout {name}.key -out {name}.pem"
        );
        args.split_whitespace().map(str::to_owned).collect()
    };
    let signed = |name: &str, cn: &str, ext: &str| -> [Vec<String>; 2] {
        let request = format!(
            "req -newkey rsa:2048 -nodes -subj /CN={cn} -keyout {name}.key -out {name}.csr"
        );
        let sign = format!(
            "x509 -req -in {name}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days {DAYS} \
             {ext} -out {name}.pem"
        );
        [request, sign].map(|s| s.split_whitespace().map(str::to_owned).collect())
    };
    let [server_req, server_sign] = signed("server", "localhost", "-extfile server.ext");
    let [client_req, client_sign] = signed("client", "refract-test-client", "-extfile client.ext");
    let steps = [
        ca("ca", "refract-test-ca"),
        ca("other-ca", "refract-test-other-ca"),
        server_req,
        server_sign,
        client_req,
        client_sign,
    ];
    for args in steps {
        let out = Command::new("openssl")
            .args(&args)
            .current_dir(d)
            .output()
            .expect("openssl runs");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    }
    let key = d.join("server.key");
    let chown = Command::new("chown")
        .arg(format!("{SERVER_USER}:{SERVER_USER}"))
        .arg(&key)
        .status()
        .unwrap();
    assert!(chown.success(), "chown {SERVER_USER} {key:?}");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Points the server at the CA's files (only when it does not already use them), reloads its
/// configuration unless it already presents them, and waits until a `verify-full` connection
/// through libpq succeeds: the reload is done.
fn point_the_server_at(files: &TlsFiles) {
    let wanted = [
        ("ssl", "on".to_owned()),
        ("ssl_ca_file", files.ca.display().to_string()),
        (
            "ssl_cert_file",
            files.dir.join("server.pem").display().to_string(),
        ),
        (
            "ssl_key_file",
            files.dir.join("server.key").display().to_string(),
        ),
    ];
    let mut changed = false;
    for (name, value) in &wanted {
        if psql(&format!("SELECT current_setting('{name}')")) != *value {
            psql(&format!("ALTER SYSTEM SET {name} = '{value}'"));
            changed = true;
        }
    }
    // A reload also when the settings are already right but the server still presents other
    // files (made again since it last loaded them).
    if changed {
        psql("SELECT pg_reload_conf()");
    }
    let mut reloaded = changed;
    let probe = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        localhost_url(),
        files.ca.display()
    );
    let deadline = Instant::now() + hang_guard();
    loop {
        let out = Command::new("psql")
            .args([&probe, "-X", "-Atqc", "SELECT 1"])
            .output()
            .expect("psql runs");
        if out.status.success() {
            return;
        }
        if !reloaded {
            psql("SELECT pg_reload_conf()");
            reloaded = true;
        }
        assert!(
            Instant::now() < deadline,
            "the server does not present the test CA's certificate after a reload: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `PG_URL` with host `localhost`, the name the server certificate is for.
pub fn localhost_url() -> String {
    super::pg::url().replacen("@127.0.0.1", "@localhost", 1)
}

/// `PG_URL` with host `127.0.0.1`, an address the server certificate is not for.
pub fn address_url() -> String {
    super::pg::url().replacen("@localhost", "@127.0.0.1", 1)
}

/// `base` with the query parameters `params` (`key=value&...`).
pub fn with_params(base: &str, params: &str) -> String {
    let separator = if base.contains('?') { '&' } else { '?' };
    format!("{base}{separator}{params}")
}
