//! Every semantic rule of pipeline files, in one place. Each problem names the field path and the
//! broken rule; the loader turns the path into a line.
//!
//! [`PipelineFile::validate`] checks the file section by section, in the file's order, and each
//! kind of connector beside its kind's other rules: the `[pipeline]` settings and dead letters
//! here, the source in `source.rs`, the projections in `projections.rs` (`document` and
//! `flatten` in their own files), the sinks in `sinks.rs`. A new connector adds its checks there.

use super::{DeadLetterConfig, PipelineFile, PipelineSection, SecretUrl};

mod document;
mod flatten;
mod projections;
pub(crate) mod routes;
mod sinks;
mod source;
mod tiers;

/// Object-store URL schemes refract can write to.
const OBJECT_STORE_SCHEMES: &[&str] = &[
    "file", "memory", "s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https",
];

impl PipelineFile {
    /// Checks the rules serde cannot express; returns `(field path, problem)` pairs in the order
    /// of the file's sections: `[pipeline]`, its dead letters, `[source]`, each projection, each
    /// sink.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        let mut problem = |path: &str, message: String| problems.push((path.to_owned(), message));
        pipeline_settings(&mut problem, &self.pipeline);
        dead_letter(&mut problem, &self.pipeline.dead_letter);
        source::validate(&mut problem, &self.source);
        source::kafka_projections(&mut problem, self);
        projections::validate(&mut problem, self);
        sinks::validate(&mut problem, self);
        problems
    }
}

/// The `[pipeline]` settings: a usable name and state directory, batch and queue bounds, and a
/// metrics address that parses.
fn pipeline_settings(problem: &mut impl FnMut(&str, String), p: &PipelineSection) {
    if p.name.is_empty()
        || !p
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        problem(
            "pipeline.name",
            format!("`{}` must be non-empty letters, digits, `-` or `_`", p.name),
        );
    }
    if p.state_dir.is_empty() {
        problem("pipeline.state_dir", "must not be empty".into());
    }
    range(
        problem,
        "pipeline.batch.max_events",
        p.batch.max_events as u64,
        1,
        1_000_000,
    );
    range(
        problem,
        "pipeline.batch.max_bytes",
        p.batch.max_bytes,
        1024,
        1 << 30,
    );
    range(
        problem,
        "pipeline.batch.max_delay_ms",
        p.batch.max_delay_ms,
        0,
        60_000,
    );
    range(problem, "pipeline.queue_depth", p.queue_depth as u64, 1, 64);
    if let Err(e) = crate::clock::ClockSpec::parse(&p.clock) {
        problem(
            "pipeline.clock",
            format!("{e}: use `wall`, an instant, or `INSTANT xSPEED`"),
        );
    }
    if let Some(addr) = &p.metrics_addr {
        if addr.parse::<std::net::SocketAddr>().is_err() {
            problem(
                "pipeline.metrics_addr",
                format!("`{addr}` is not an IP address and port (like `127.0.0.1:9464`)"),
            );
        }
    }
}

/// `pipeline.dead_letter`: a local path or an object-store URL, not both.
fn dead_letter(problem: &mut impl FnMut(&str, String), d: &DeadLetterConfig) {
    match (&d.path, &d.url) {
        (Some(_), Some(_)) => problem(
            "pipeline.dead_letter",
            "set `path` or `url`, not both".into(),
        ),
        (_, Some(url)) => object_store_url(problem, "pipeline.dead_letter.url", url),
        (Some(path), None) if path.is_empty() => {
            problem("pipeline.dead_letter.path", "must not be empty".into())
        }
        _ => {}
    }
}

/// `value` within `min..=max`.
fn range(problem: &mut impl FnMut(&str, String), path: &str, value: u64, min: u64, max: u64) {
    if value < min || value > max {
        problem(
            path,
            format!("must be between {min} and {max}, found {value}"),
        );
    }
}

/// An object-store URL of a supported scheme; a `file` URL must be absolute.
fn object_store_url(problem: &mut impl FnMut(&str, String), path: &str, url: &SecretUrl) {
    let url = url.expose();
    let Some((scheme, rest)) = url.split_once("://") else {
        problem(
            path,
            format!(
                "`{}` is not a URL (expected `file:///abs/dir`, `s3://bucket/prefix`, ...)",
                mask_url(url)
            ),
        );
        return;
    };
    if !OBJECT_STORE_SCHEMES.contains(&scheme) {
        problem(
            path,
            format!(
                "unsupported scheme `{scheme}` (supported: {})",
                OBJECT_STORE_SCHEMES.join(", ")
            ),
        );
    } else if scheme == "file" && !rest.starts_with('/') {
        problem(
            path,
            format!(
                "`{}` must be an absolute file URL (`file:///abs/dir`)",
                mask_url(url)
            ),
        );
    }
}

/// A `postgres://` URL whose TLS parameters (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`)
/// refract can act on.
pub(crate) fn postgres_url(problem: &mut impl FnMut(&str, String), path: &str, url: &str) {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        problem(
            path,
            format!("`{}` is not a postgres:// URL", mask_url(url)),
        );
    } else if let Err(e) = super::pg_tls::split_tls(url) {
        problem(path, e.to_string());
    }
}

/// Whether a pass-through client setting (a Kafka sink's `properties`) holds a secret, by its
/// name: passwords, secrets, private keys, JAAS configs, tokens. `plan` shows such values as
/// `***`.
pub fn is_secret_property(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["password", "secret", "jaas", "token", "credential"]
        .iter()
        .any(|word| name.contains(word))
        || (name.contains("key") && !name.ends_with(".location"))
}

/// Query parameters of a connection URL that hold a secret (libpq reads `password` and
/// `sslpassword` from the URL as well as from the user-info).
const SECRET_QUERY_PARAMETERS: &[&str] = &["password", "sslpassword"];

/// Hides the password of a URL's user-info (`scheme://user:secret@host` → `scheme://user:***@host`)
/// and of its `password=` query parameters.
pub fn mask_url(value: &str) -> String {
    let (address, query) = match value.split_once('?') {
        Some((address, query)) => (address, Some(query)),
        None => (value, None),
    };
    let mut masked = mask_user_info(address);
    if let Some(query) = query {
        masked.push('?');
        masked.push_str(&mask_query(query));
    }
    masked
}

fn mask_user_info(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else {
        return value.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return value.to_owned();
    };
    let userinfo = &authority[..at];
    let masked = match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        // A lone user name is not a secret, except where the scheme puts a token there.
        None if scheme.starts_with("postgres") || scheme.starts_with("mysql") => {
            return value.to_owned();
        }
        None => "***".to_owned(),
    };
    format!("{scheme}://{masked}{}", &rest[at..])
}

fn mask_query(query: &str) -> String {
    let masked: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _))
                if SECRET_QUERY_PARAMETERS.contains(&name.to_ascii_lowercase().as_str()) =>
            {
                format!("{name}=***")
            }
            _ => pair.to_owned(),
        })
        .collect();
    masked.join("&")
}

#[cfg(test)]
mod tests;
