//! Every PostgreSQL connection refract opens goes through here, with the TLS its URL asks for:
//! the ordinary connections (source control and snapshots, sink, warm tier, migration, `plan`,
//! `verify`, `backfill`) through [`PgEndpoint::connect`], and the replication stream with the
//! matching [`PgEndpoint::replication_tls`].
//!
//! The URL's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` mean what they mean to libpq (see
//! [`refract_schemas::config::pg_tls`], which reads them, and `docs/sources/postgres.md`). They
//! are taken out of the URL before tokio-postgres parses it (it refuses `verify-ca`,
//! `verify-full` and the file parameters); the checks are made by the rustls configuration
//! built here, on ring (the crypto provider the rest of refract uses).
//!
//! A server refused by TLS (a certificate not signed by the CA, or issued for another host) is a
//! [`PgConnectError::Tls`] whose message names the cause; retrying cannot help. Messages never
//! carry the URL, so never its password.

use std::sync::Arc;

use refract_schemas::config::pg_tls::{self, PgTls, RootCerts, SslMode};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::sources::postgres::inspect::error_text;
use crate::tls_refusal;

/// The `application_name` of refract's sessions when the URL names none, so that an operator
/// (and `pg_stat_activity`) can tell them from the applications'.
const DEFAULT_APPLICATION_NAME: &str = "refract";

/// What tokio-postgres says when the server answers `N` to the TLS request.
const SERVER_REFUSES_TLS: &str = "server does not support TLS";

/// How the message of a [`PgConnectError::Tls`] starts, for callers that sort errors by their
/// text (a TLS refusal is permanent).
pub const TLS_REFUSED: &str = "TLS: ";

/// A URL that cannot be used: not the driver's syntax, or a TLS parameter refract cannot act on.
/// The text never carries the URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid PostgreSQL URL: {0}")]
pub struct InvalidPgUrl(pub String);

/// Opening a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum PgConnectError {
    /// TLS refused the server or could not be set up (a certificate file unreadable): a
    /// configuration problem that retrying cannot fix.
    #[error("TLS: {0}")]
    Tls(String),
    /// Connecting failed otherwise (server down, authentication refused, ...).
    #[error("{}", error_text(.0))]
    Connect(#[source] tokio_postgres::Error),
}

/// A PostgreSQL server as a URL names it: the driver's settings and the TLS the URL asks for.
#[derive(Debug, Clone)]
pub struct PgEndpoint {
    /// The driver's settings (the URL without its TLS parameters): callers may add timeouts or
    /// an application name before connecting.
    pub config: tokio_postgres::Config,
    tls: PgTls,
}

impl PgEndpoint {
    /// Reads `url` (a `postgres://` URL, with libpq's TLS parameters).
    pub fn parse(url: &str) -> Result<Self, InvalidPgUrl> {
        let (rest, tls) = pg_tls::split_tls(url).map_err(|e| InvalidPgUrl(e.to_string()))?;
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e: tokio_postgres::Error| InvalidPgUrl(e.to_string()))?;
        config.ssl_mode(match tls.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        if config.get_application_name().is_none() {
            config.application_name(DEFAULT_APPLICATION_NAME);
        }
        Ok(Self { config, tls })
    }

    /// What the URL asks of TLS.
    pub fn tls(&self) -> &PgTls {
        &self.tls
    }

    /// Opens a connection and spawns its connection task (its end is logged with `label`). The
    /// certificate files are read again at each connection, so a renewed one is picked up.
    pub async fn connect(
        &self,
        label: &'static str,
    ) -> Result<tokio_postgres::Client, PgConnectError> {
        let make_tls = MakeRustlsConnect::new(client_config(&self.tls)?);
        let (client, connection) =
            self.config
                .connect(make_tls)
                .await
                .map_err(|e| match tls_refusal(&e, &self.tls) {
                    Some(cause) => PgConnectError::Tls(cause),
                    None => PgConnectError::Connect(e),
                })?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(connection = label, error = %e, "a PostgreSQL connection ended");
            }
        });
        Ok(client)
    }

    /// The replication stream's TLS settings for `host`, checking what [`PgEndpoint::connect`]
    /// checks (`sslrootcert=system` is the Mozilla root set there and here).
    pub fn replication_tls(&self, host: &str) -> pgwire_replication::TlsConfig {
        use pgwire_replication::TlsConfig;
        let ca = match &self.tls.root_certs {
            Some(RootCerts::File(path)) => Some(path.clone()),
            Some(RootCerts::System) | None => None,
        };
        let config = match self.tls.mode {
            SslMode::Disable => return TlsConfig::disabled(),
            SslMode::Prefer => TlsConfig {
                mode: pgwire_replication::SslMode::Prefer,
                ..TlsConfig::default()
            },
            _ if self.tls.verifies_host() => TlsConfig::verify_full(ca),
            _ if self.tls.verifies_chain() => TlsConfig::verify_ca(ca),
            _ => TlsConfig::require(),
        };
        // The host as the server name also when it is an IP address: pgwire-replication refuses
        // verify-full to an address otherwise, where libpq checks the certificate's IP names.
        let config = config.with_sni_hostname(host);
        match &self.tls.client_cert {
            Some(c) => config.with_client_cert(&c.cert, &c.key),
            None => config,
        }
    }
}

/// The rustls configuration for `tls`: the verifier its mode asks for, the roots it names, the
/// client certificate it names.
fn client_config(tls: &PgTls) -> Result<ClientConfig, PgConnectError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = verifier(tls, &provider)?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PgConnectError::Tls(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let Some(client) = &tls.client_cert else {
        return Ok(builder.with_no_client_auth());
    };
    let chain = CertificateDer::pem_file_iter(&client.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| unreadable("sslcert", &client.cert, e))?;
    let key = PrivateKeyDer::from_pem_file(&client.key)
        .map_err(|e| unreadable("sslkey", &client.key, e))?;
    builder
        .with_client_auth_cert(chain, key)
        .map_err(|e| PgConnectError::Tls(format!("sslcert and sslkey do not make a pair: {e}")))
}

/// The server-certificate check of `tls`'s mode.
fn verifier(
    tls: &PgTls,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ServerCertVerifier>, PgConnectError> {
    let Some(roots) = (match &tls.root_certs {
        Some(roots) if tls.verifies_chain() => Some(root_store(roots)?),
        _ => None,
    }) else {
        return Ok(Arc::new(AnyCertificate(provider.clone())));
    };
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| PgConnectError::Tls(format!("cannot use {}: {e}", tls.root_certs_text())))?;
    Ok(if tls.verifies_host() {
        webpki
    } else {
        Arc::new(ChainOnly(webpki))
    })
}

/// The CA certificates `roots` names.
fn root_store(roots: &RootCerts) -> Result<RootCertStore, PgConnectError> {
    let path = match roots {
        RootCerts::System => {
            return Ok(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            });
        }
        RootCerts::File(path) => path,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| unreadable("sslrootcert", path, e))?;
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(PgConnectError::Tls(format!(
            "sslrootcert={} holds no CA certificate",
            path.display()
        )));
    }
    Ok(store)
}

fn unreadable(
    parameter: &str,
    path: &std::path::Path,
    e: rustls::pki_types::pem::Error,
) -> PgConnectError {
    PgConnectError::Tls(format!("cannot read {parameter}={}: {e}", path.display()))
}

/// What a verifying connection trusts, completing "not signed by …".
fn trusted(tls: &PgTls) -> String {
    match &tls.root_certs {
        Some(RootCerts::System) => "any of the well-known roots (sslrootcert=system)".to_owned(),
        _ => format!("the CA in {}", tls.root_certs_text()),
    }
}

/// Why TLS refused the server, when it did: the rustls error in `e`'s chain, or the server
/// refusing TLS that the mode requires.
fn tls_refusal(e: &tokio_postgres::Error, tls: &PgTls) -> Option<String> {
    if let Some(refusal) = tls_refusal::find(e) {
        return Some(tls_refusal::describe(refusal, &trusted(tls)));
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.to_string() == SERVER_REFUSES_TLS {
            return Some(format!(
                "the server does not accept TLS connections, and sslmode={} requires TLS",
                tls.mode.name()
            ));
        }
        cause = c.source();
    }
    None
}

/// `require` without `sslrootcert` (and `prefer`): any certificate, as libpq, which encrypts
/// without authenticating the server. The handshake signatures are still checked, so the server
/// holds the key of the certificate it shows.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca` (and `require` with `sslrootcert`): the chain must lead to the CA; the host name
/// is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verdict =
            self.0
                .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now);
        match verdict {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_is_handed_the_url_without_the_tls_parameters() {
        let endpoint = PgEndpoint::parse(
            "postgres://app:pw@db:6432/x?sslmode=verify-full&sslrootcert=/ca.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(
            endpoint.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(endpoint.config.get_application_name(), Some("refract"));
        assert_eq!(endpoint.config.get_ports(), [6432]);
        assert!(endpoint.tls().verifies_host());
        let named = PgEndpoint::parse("postgres://db/x?application_name=me").unwrap();
        assert_eq!(named.config.get_application_name(), Some("me"));
    }

    #[test]
    fn the_replication_stream_checks_what_the_connections_check() {
        use pgwire_replication::SslMode as Repl;
        let cases = [
            ("sslmode=disable", Repl::Disable, None),
            ("sslmode=prefer", Repl::Prefer, None),
            ("sslmode=require", Repl::Require, None),
            (
                "sslmode=require&sslrootcert=/ca.pem",
                Repl::VerifyCa,
                Some("/ca.pem"),
            ),
            (
                "sslmode=verify-ca&sslrootcert=/ca.pem",
                Repl::VerifyCa,
                Some("/ca.pem"),
            ),
            (
                "sslmode=verify-full&sslrootcert=/ca.pem",
                Repl::VerifyFull,
                Some("/ca.pem"),
            ),
            (
                "sslmode=verify-full&sslrootcert=system",
                Repl::VerifyFull,
                None,
            ),
        ];
        for (query, mode, ca) in cases {
            let endpoint = PgEndpoint::parse(&format!("postgres://db/x?{query}")).unwrap();
            let tls = endpoint.replication_tls("db");
            assert_eq!(tls.mode, mode, "{query}");
            assert_eq!(
                tls.ca_pem_path.as_deref(),
                ca.map(std::path::Path::new),
                "{query}"
            );
        }
        let mtls = PgEndpoint::parse("postgres://db/x?sslmode=require&sslcert=/c&sslkey=/k")
            .unwrap()
            .replication_tls("db");
        assert!(mtls.is_mtls());
    }

    #[test]
    fn bad_urls_do_not_show_their_password() {
        for url in [
            "postgres://app:s3cret@db/x?sslmode=verify_full",
            "postgres://app:s3cret@db/x?bogus=1",
        ] {
            let error = PgEndpoint::parse(url).unwrap_err().to_string();
            assert!(error.starts_with("invalid PostgreSQL URL"), "{error}");
            assert!(!error.contains("s3cret"), "{error}");
        }
    }

    #[test]
    fn tls_errors_start_as_callers_look_for() {
        let error = PgConnectError::Tls("refused".into()).to_string();
        assert!(error.starts_with(TLS_REFUSED), "{error}");
    }

    #[test]
    fn unreadable_certificate_files_are_named() {
        let tls =
            pg_tls::split_tls("postgres://db/x?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem")
                .unwrap()
                .1;
        let error = client_config(&tls).unwrap_err().to_string();
        assert!(
            error.starts_with("TLS: cannot read sslrootcert=/nonexistent/ca.pem"),
            "{error}"
        );
    }
}
