//! Why a TLS handshake refused a server, in words an operator acts on ("the server certificate
//! is not signed by the CA in sslrootcert=/etc/ca.pem"), for every client of refract that checks
//! servers with rustls: PostgreSQL (`pg_connect`) and Redis.
//!
//! Drivers hand rustls' error back wrapped (in an `io::Error`, or an `Arc` of one): [`find`]
//! unwraps what they do.

use std::error::Error;
use std::sync::Arc;

use rustls::CertificateError;

/// The rustls error in `e`'s chain of causes, if any.
pub(crate) fn find<'a>(e: &'a (dyn Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(found) = unwrap(c) {
            return Some(found);
        }
        cause = c.source();
    }
    None
}

/// `e` as a rustls error, looking inside the wrappers drivers use (whose `source` skips it).
fn unwrap<'a>(e: &'a (dyn Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(found) = e.downcast_ref::<rustls::Error>() {
        return Some(found);
    }
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        return io.get_ref().and_then(|inner| unwrap(inner));
    }
    if let Some(shared) = e.downcast_ref::<Arc<dyn Error + Send + Sync>>() {
        return unwrap(shared.as_ref());
    }
    None
}

/// The refusal `e` in words. `trusted` completes "the server certificate is not signed by …":
/// `the CA in sslrootcert=/etc/ca.pem`, say.
pub(crate) fn describe(e: &rustls::Error, trusted: &str) -> String {
    let rustls::Error::InvalidCertificate(certificate) = e else {
        return format!("the handshake with the server failed: {e}");
    };
    match certificate {
        CertificateError::UnknownIssuer => {
            format!("the server certificate is not signed by {trusted}")
        }
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => format!(
            "the server certificate is for {}, not {}",
            names(presented),
            expected.to_str()
        ),
        CertificateError::NotValidForName => {
            "the server certificate is not for the host connected to".to_owned()
        }
        other => format!("the server certificate is refused: {other}"),
    }
}

/// The names of a certificate as rustls reports them (`DnsName("localhost")`), plainly.
fn names(presented: &[String]) -> String {
    if presented.is_empty() {
        return "no host name".to_owned();
    }
    let plain: Vec<&str> = presented
        .iter()
        .map(|n| {
            n.split_once('(')
                .and_then(|(_, rest)| rest.strip_suffix(')'))
                .unwrap_or(n)
                .trim_matches('"')
        })
        .collect();
    plain.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::ServerName;

    #[test]
    fn refusals_are_put_plainly() {
        let unknown = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        assert_eq!(
            describe(&unknown, "the CA in sslrootcert=/etc/ca.pem"),
            "the server certificate is not signed by the CA in sslrootcert=/etc/ca.pem"
        );
        let wrong_host =
            rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                expected: ServerName::try_from("127.0.0.1").unwrap(),
                presented: vec![
                    "DnsName(\"localhost\")".to_owned(),
                    "DnsName(\"db\")".to_owned(),
                ],
            });
        assert_eq!(
            describe(&wrong_host, "-"),
            "the server certificate is for localhost, db, not 127.0.0.1"
        );
    }

    #[test]
    fn found_inside_the_wrappers_of_drivers() {
        let refusal = || rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, refusal());
        assert_eq!(find(&io), Some(&refusal()));
        let shared: Arc<dyn Error + Send + Sync> = Arc::new(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            refusal(),
        ));
        assert_eq!(find(&shared), Some(&refusal()));
        let other = std::io::Error::other("connection reset");
        assert_eq!(find(&other), None);
    }
}
