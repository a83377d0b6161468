//! The TLS parameters of a `postgres://` URL, read as libpq reads them: `sslmode`, `sslrootcert`,
//! `sslcert` and `sslkey` in the query string, percent-decoded.
//!
//! Pure: this module only reads the URL. `refract_connectors::pg_connect` opens the connections
//! (every ordinary one and the replication stream) with what it says, and `validate` refuses what
//! [`split_tls`] refuses, so a bad `sslmode` is a config error, not a failure at run time.
//!
//! | `sslmode` | encrypted | chain checked | host name checked |
//! |---|---|---|---|
//! | `disable` | no | - | - |
//! | `prefer` (default) | when the server offers TLS | no | no |
//! | `require` | yes | only when `sslrootcert` is given (as libpq) | no |
//! | `verify-ca` | yes | yes, against `sslrootcert` | no |
//! | `verify-full` | yes | yes, against `sslrootcert` | yes |
//!
//! Unlike libpq, nothing is read from `~/.postgresql/`: the verifying modes need `sslrootcert`
//! (a file, or `system` for the well-known public roots), and a client certificate is sent only
//! when `sslcert` and `sslkey` name it.

use std::borrow::Cow;
use std::path::PathBuf;

/// `sslrootcert=system`: the well-known public roots instead of a file (libpq 16's spelling).
pub const SYSTEM_ROOT_CERTS: &str = "system";

/// The query parameters this module owns, taken out of the URL handed to the driver (which
/// refuses `verify-ca`, `verify-full` and the three file parameters).
const TLS_PARAMETERS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// How much TLS a connection asks for (libpq's `sslmode`; `allow` is not supported).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS when the server offers it, else plain; the certificate is not checked.
    #[default]
    Prefer,
    /// TLS or no connection; the chain is checked only when `sslrootcert` is given.
    Require,
    /// TLS, the server's chain checked against `sslrootcert`.
    VerifyCa,
    /// TLS, the chain checked and the certificate issued for the host connected to.
    VerifyFull,
}

impl SslMode {
    /// Every mode, in the order of increasing checks.
    pub const ALL: [SslMode; 5] = [
        SslMode::Disable,
        SslMode::Prefer,
        SslMode::Require,
        SslMode::VerifyCa,
        SslMode::VerifyFull,
    ];

    /// The mode as `sslmode` spells it.
    pub fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// The mode `name` spells, if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// The certificates a verifying connection trusts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// The CA certificates (PEM) in this file.
    File(PathBuf),
    /// The well-known public roots (`sslrootcert=system`).
    System,
}

/// A client certificate for mutual TLS: `sslcert` and `sslkey` (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// What a URL asks of TLS.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PgTls {
    /// `sslmode`, `prefer` when absent (as libpq).
    pub mode: SslMode,
    /// `sslrootcert`.
    pub root_certs: Option<RootCerts>,
    /// `sslcert` and `sslkey`.
    pub client_cert: Option<ClientCert>,
}

impl PgTls {
    /// Whether the server's certificate chain is checked: `verify-ca`, `verify-full`, and
    /// `require` when `sslrootcert` is given (libpq then behaves as `verify-ca`).
    pub fn verifies_chain(&self) -> bool {
        match self.mode {
            SslMode::Disable | SslMode::Prefer => false,
            SslMode::Require => self.root_certs.is_some(),
            SslMode::VerifyCa | SslMode::VerifyFull => true,
        }
    }

    /// Whether the certificate must be issued for the host connected to (`verify-full`).
    pub fn verifies_host(&self) -> bool {
        self.mode == SslMode::VerifyFull
    }

    /// `sslrootcert` as the URL wrote it, for error messages.
    pub fn root_certs_text(&self) -> String {
        match &self.root_certs {
            Some(RootCerts::File(path)) => format!("sslrootcert={}", path.display()),
            Some(RootCerts::System) => format!("sslrootcert={SYSTEM_ROOT_CERTS}"),
            None => "no sslrootcert".to_owned(),
        }
    }
}

/// A TLS parameter refract cannot act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PgTlsError {
    /// `sslmode` names no mode.
    #[error("sslmode `{0}` is not one of disable, prefer, require, verify-ca, verify-full")]
    UnknownMode(String),
    /// A verifying mode without anything to verify against.
    #[error(
        "sslmode={0} needs sslrootcert: the file of the CA that signed the server's certificate, \
         or `system` for the well-known public roots"
    )]
    NoRootCerts(&'static str),
    /// One of `sslcert` and `sslkey` without the other.
    #[error("sslcert and sslkey go together: `{0}` is missing")]
    HalfClientCert(&'static str),
    /// A parameter given twice.
    #[error("`{0}` is given twice")]
    Repeated(&'static str),
    /// An empty value.
    #[error("`{0}` is empty")]
    Empty(&'static str),
    /// A value that does not percent-decode to UTF-8.
    #[error("`{0}` is not percent-encoded UTF-8")]
    Encoding(&'static str),
}

/// Splits `url` into the URL without its TLS parameters (what the driver is handed) and those
/// parameters. A URL without a query string comes back unchanged, with the defaults.
pub fn split_tls(url: &str) -> Result<(String, PgTls), PgTlsError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), PgTls::default()));
    };
    let mut kept = Vec::new();
    let mut values: [Option<Cow<'_, str>>; 4] = Default::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match TLS_PARAMETERS.iter().position(|p| *p == key) {
            None => kept.push(pair),
            Some(i) => {
                let name = TLS_PARAMETERS[i];
                if values[i].is_some() {
                    return Err(PgTlsError::Repeated(name));
                }
                values[i] = Some(decode(name, value)?);
            }
        }
    }
    let [mode, root, cert, key] = values;
    let tls = PgTls {
        mode: mode_of(mode.as_deref())?,
        root_certs: root.map(|r| root_certs(&r)),
        client_cert: client_cert(cert.as_deref(), key.as_deref())?,
    };
    if matches!(tls.mode, SslMode::VerifyCa | SslMode::VerifyFull) && tls.root_certs.is_none() {
        return Err(PgTlsError::NoRootCerts(tls.mode.name()));
    }
    let stripped = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((stripped, tls))
}

/// A value percent-decoded, not empty.
fn decode<'a>(name: &'static str, value: &'a str) -> Result<Cow<'a, str>, PgTlsError> {
    let decoded = percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .map_err(|_| PgTlsError::Encoding(name))?;
    if decoded.is_empty() {
        return Err(PgTlsError::Empty(name));
    }
    Ok(decoded)
}

fn mode_of(value: Option<&str>) -> Result<SslMode, PgTlsError> {
    match value {
        None => Ok(SslMode::default()),
        Some(v) => SslMode::parse(v).ok_or_else(|| PgTlsError::UnknownMode(v.to_owned())),
    }
}

fn root_certs(value: &str) -> RootCerts {
    if value == SYSTEM_ROOT_CERTS {
        RootCerts::System
    } else {
        RootCerts::File(PathBuf::from(value))
    }
}

fn client_cert(cert: Option<&str>, key: Option<&str>) -> Result<Option<ClientCert>, PgTlsError> {
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(PgTlsError::HalfClientCert("sslkey")),
        (None, Some(_)) => Err(PgTlsError::HalfClientCert("sslcert")),
        (Some(cert), Some(key)) => Ok(Some(ClientCert {
            cert: PathBuf::from(cert),
            key: PathBuf::from(key),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_what_they_ask() {
        let file = |p: &str| Some(RootCerts::File(PathBuf::from(p)));
        let cases: [(&str, &str, SslMode, Option<RootCerts>); 6] = [
            (
                "postgres://u@h/db",
                "postgres://u@h/db",
                SslMode::Prefer,
                None,
            ),
            (
                "postgres://u@h/db?sslmode=disable",
                "postgres://u@h/db",
                SslMode::Disable,
                None,
            ),
            (
                "postgres://u:p@h/db?application_name=x&sslmode=require&connect_timeout=3",
                "postgres://u:p@h/db?application_name=x&connect_timeout=3",
                SslMode::Require,
                None,
            ),
            (
                "postgres://h/db?sslmode=verify-ca&sslrootcert=/etc/ca%20dir/ca.pem",
                "postgres://h/db",
                SslMode::VerifyCa,
                file("/etc/ca dir/ca.pem"),
            ),
            (
                "postgres://h/db?sslrootcert=system&sslmode=verify-full",
                "postgres://h/db",
                SslMode::VerifyFull,
                Some(RootCerts::System),
            ),
            (
                "postgres://h/db?sslrootcert=/ca.pem&sslmode=require",
                "postgres://h/db",
                SslMode::Require,
                file("/ca.pem"),
            ),
        ];
        for (url, stripped, mode, roots) in cases {
            let (left, tls) = split_tls(url).unwrap();
            assert_eq!((left.as_str(), tls.mode), (stripped, mode), "{url}");
            assert_eq!(tls.root_certs, roots, "{url}");
        }
    }

    #[test]
    fn which_modes_check_what() {
        let tls = |mode, roots: bool| PgTls {
            mode,
            root_certs: roots.then_some(RootCerts::System),
            client_cert: None,
        };
        let chain: Vec<bool> = SslMode::ALL
            .iter()
            .map(|m| tls(*m, false).verifies_chain())
            .collect();
        assert_eq!(chain, [false, false, false, true, true]);
        assert!(
            tls(SslMode::Require, true).verifies_chain(),
            "libpq: as verify-ca"
        );
        assert!(!tls(SslMode::Prefer, true).verifies_chain());
        assert!(!tls(SslMode::VerifyCa, true).verifies_host());
        assert!(tls(SslMode::VerifyFull, true).verifies_host());
    }

    #[test]
    fn client_certificates() {
        let (_, tls) =
            split_tls("postgres://h/db?sslmode=require&sslcert=/c.pem&sslkey=/k.pem").unwrap();
        assert_eq!(
            tls.client_cert,
            Some(ClientCert {
                cert: "/c.pem".into(),
                key: "/k.pem".into()
            })
        );
    }

    #[test]
    fn refusals_name_the_cause() {
        let cases = [
            (
                "postgres://h/db?sslmode=verify_full",
                "sslmode `verify_full` is not one of disable, prefer, require, verify-ca, verify-full",
            ),
            (
                "postgres://h/db?sslmode=allow",
                "sslmode `allow` is not one of",
            ),
            (
                "postgres://h/db?sslmode=verify-full",
                "sslmode=verify-full needs sslrootcert",
            ),
            (
                "postgres://h/db?sslcert=/c.pem",
                "sslcert and sslkey go together: `sslkey` is missing",
            ),
            (
                "postgres://h/db?sslmode=require&sslmode=disable",
                "`sslmode` is given twice",
            ),
            ("postgres://h/db?sslrootcert=", "`sslrootcert` is empty"),
            (
                "postgres://h/db?sslrootcert=%FF",
                "`sslrootcert` is not percent-encoded UTF-8",
            ),
        ];
        for (url, expected) in cases {
            let error = split_tls(url).unwrap_err().to_string();
            assert!(error.starts_with(expected), "{url}: {error}");
        }
    }
}
