//! `refract plan`: what a pipeline will read, keep and write, with secrets masked.
//!
//! For a PostgreSQL source, [`check_source`] asks the database (through the connectors crate)
//! about the slot, the publication and the published tables; [`render`] shows them next to the
//! file's plan and ends with warnings about what would go wrong: tables PostgreSQL would refuse
//! to update once published, replica identities that do not send what a projection needs from
//! the old row, an invalidated slot.
//!
//! [`render`] (in `plan/render.rs`) writes the plan section by section; [`findings`] (in
//! `plan/findings.rs`) runs the checks against the database, one kind after another.

use std::time::Duration;

use refract_connectors::sources::postgres::{Inspection, PgAdmin};
use refract_schemas::config::{LoadedPipeline, SourceConfig};

mod findings;
mod render;

pub use findings::{Finding, findings};
pub use render::render;

/// How long `plan` waits for the database before showing the plan without it.
const CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// What the source's own store says, when it can be asked.
#[derive(Debug)]
pub enum SourceCheck {
    /// Nothing to ask (file source).
    NotApplicable,
    /// The database could not be asked; why.
    Unreachable(String),
    /// What the PostgreSQL source's database says.
    Postgres(Box<Inspection>),
}

/// Asks the source's store about the pipeline (PostgreSQL: slot, publication, tables).
pub async fn check_source(loaded: &LoadedPipeline) -> SourceCheck {
    let SourceConfig::Postgres(pg) = &loaded.config.source else {
        return SourceCheck::NotApplicable;
    };
    let inspect = async {
        let admin = PgAdmin::connect(pg.url.expose()).await?;
        admin.inspect(pg, &loaded.config.pipeline.name).await
    };
    match tokio::time::timeout(CHECK_TIMEOUT, inspect).await {
        Ok(Ok(inspection)) => SourceCheck::Postgres(Box::new(inspection)),
        Ok(Err(e)) => SourceCheck::Unreachable(e.to_string()),
        Err(_) => {
            SourceCheck::Unreachable(format!("no answer within {} s", CHECK_TIMEOUT.as_secs()))
        }
    }
}

/// `1536` → `1.5 KiB`.
pub fn pretty_bytes(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes.abs() < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests;
