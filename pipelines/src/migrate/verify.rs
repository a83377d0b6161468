//! `refract migrate FILE verify` (being written).

use std::process::ExitCode;

use refract_connectors::migration::MigrationError;

use super::{MigrateError, Migration};

/// Options of `verify`.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {}

/// Runs `verify`.
pub async fn run(_m: Migration, _args: VerifyArgs) -> Result<ExitCode, MigrateError> {
    Err(MigrationError::Refused("verify is not written yet".into()).into())
}
