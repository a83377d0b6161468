//! The hot, warm and cold tiers of heartbeats (seed 003 §4.2): their layouts, and the
//! connections the `tiers` sink, the aging job and the queries share.
//!
//! - [`hot`]: Redis sorted sets per device and per region, trimmed to the hot window;
//! - [`warm`]: a PostgreSQL table partitioned by the hour;
//! - [`cold`]: Parquet by device and day on object storage (zstd unless a file is tiny);
//! - [`query`]: the three queries (latest heartbeats, devices online, a time range) across them.
//!
//! [`aging`] moves warm days past the window to cold and trims the hot tier.

pub mod aging;
pub mod cold;
pub mod hot;
pub mod query;
pub mod warm;

use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path;
use refract_schemas::config::TierLayout;

use crate::pg_connect::{PgConnectError, PgEndpoint};

/// The advisory lock both cold writers (the sink's late heartbeats and an aging run) hold while
/// they read and rewrite a day's files: `pg_advisory_lock(hashtext(…))` on the warm database.
pub fn cold_lock_sql(layout: &TierLayout, lock: bool) -> String {
    format!(
        "SELECT {}(hashtext('refract.tiers.cold:' || {}))",
        if lock {
            "pg_advisory_lock"
        } else {
            "pg_advisory_unlock"
        },
        quote_literal(&layout.stores.warm.table)
    )
}

pub(crate) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Connects to the warm tier's database (the connection runs on a task of its own).
pub async fn connect_warm(layout: &TierLayout) -> Result<tokio_postgres::Client, TierError> {
    let url = &layout.stores.warm.url;
    let endpoint = PgEndpoint::parse(url.expose()).map_err(|e| TierError::Config(e.to_string()))?;
    let what = format!("cannot connect to {}", url.masked());
    endpoint.connect("warm tier").await.map_err(|e| match e {
        PgConnectError::Connect(e) => TierError::Warm(what, e),
        refused @ PgConnectError::Tls(_) => {
            TierError::Config(format!("warm tier: {what}: {refused}"))
        }
    })
}

/// Opens the cold tier's object store and its root.
pub fn open_cold(layout: &TierLayout) -> Result<(Arc<dyn ObjectStore>, Path), TierError> {
    crate::sinks::object_json::open_store(layout.stores.cold.url.expose()).map_err(|e| {
        TierError::Config(format!(
            "cold tier `{}`: {e}",
            layout.stores.cold.url.masked()
        ))
    })
}

/// A Redis client for the hot tier.
pub fn hot_client(layout: &TierLayout) -> Result<redis::Client, TierError> {
    redis::Client::open(layout.stores.hot.url.expose()).map_err(|e| {
        TierError::Config(format!(
            "hot tier `{}`: {e}",
            layout.stores.hot.url.masked()
        ))
    })
}

/// A failure of the aging job or a query (the sink classifies its own for retries).
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The layout's settings cannot be used.
    #[error("{0}")]
    Config(String),
    /// The warm tier failed.
    #[error("warm tier: {0}: {1}")]
    Warm(String, #[source] tokio_postgres::Error),
    /// The hot tier failed.
    #[error("hot tier: {0}: {1}")]
    Hot(String, #[source] redis::RedisError),
    /// The cold tier failed.
    #[error("cold tier: {0}")]
    Cold(#[from] cold::ColdError),
    /// What was read back does not match what was written.
    #[error("{0}")]
    Mismatch(String),
}
