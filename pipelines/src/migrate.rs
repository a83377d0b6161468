//! `refract migrate MIGRATION.toml PHASE`: a shadow-write migration of one table into a new one
//! while applications keep writing (seed 003 §5.2; Vitess's MoveTables, VDiff, SwitchTraffic
//! and ReverseTraffic for PostgreSQL).
//!
//! - `start`: the dual write, as a daemon (the PostgreSQL source, the `migration` projection and
//!   sink): every committed change of the source applied to the target through the transform,
//!   in commit order, exactly once ([`start`]);
//! - `backfill`: the rows that existed before, copied in key chunks, resumable ([`backfill`]);
//! - `verify`: counts, per-chunk checksums, then a row-by-row diff ([`verify`]);
//! - `cutover` / `rollback`: reads move to the target / back to the source, at a point of the
//!   stream where every earlier change has been applied; after a cut-over the target's changes
//!   go back to the source ([`switch`]);
//! - `finalize`: replication stops for good; the old table is dropped only when asked;
//! - `status`: phase, lag, rows copied, last verification, as text or JSON ([`status`]).
//!
//! Every phase is recorded in the control table (and copied to the state directory), and each
//! resumes after a kill.

pub mod backfill;
pub mod plan;
pub mod start;
pub mod status;
pub mod switch;
pub mod verify;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;
use refract_connectors::migration::catalog::{Table, read_table};
use refract_connectors::migration::control::Control;
use refract_connectors::migration::{MigrationError, connect};
use refract_projections::migration::Transform;
use refract_schemas::config::{self, ConfigError, ConfigErrors, MigrationFile, Parsed};

/// The phases of `refract migrate`.
#[derive(Debug, Subcommand)]
pub enum MigrateCommand {
    /// Run the dual write (a daemon until SIGINT/SIGTERM): every committed change of the source
    /// table applied to the target through the transform, and after a cut-over every change of
    /// the target applied back to the source.
    Start {
        /// Stop with exit 0 once caught up with the source's end.
        #[arg(long)]
        until_caught_up: bool,
    },
    /// Copy the rows that exist in the source into the target, in primary-key chunks
    /// (`batch_rows`), throttled by `max_rows_per_second`, resumable after a kill.
    Backfill {
        /// Start over from the first key instead of resuming.
        #[arg(long)]
        restart: bool,
    },
    /// Compare the two tables: counts and per-chunk checksums of canonical values, then a
    /// row-by-row diff of the chunks that differ. Exit 0 equal, 1 different.
    Verify(verify::VerifyArgs),
    /// Move reads (and writes) to the target once the dual write has applied every change
    /// committed before now; from then on the target's changes go back to the source.
    Cutover {
        /// How long to wait for the dual write to reach the cut-over, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
        /// Cut over although the last verification found differences.
        #[arg(long)]
        force: bool,
    },
    /// Move reads (and writes) back to the source, which holds every write made to the target.
    Rollback {
        /// How long to wait for the reverse replication to reach the rollback, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Stop the replication for good (drops the slot and the publication); the dual write must
    /// be stopped first.
    Finalize {
        /// Also drop the table reads no longer go to (only after a cut-over).
        #[arg(long)]
        drop_old_table: bool,
    },
    /// Phase, lag, rows copied, last verification.
    Status {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A migration file that loaded, with the environment's contribution.
pub type LoadedMigration = Parsed<MigrationFile>;

/// Reads and validates a migration file (the rules that need no database).
pub fn load(path: &Path) -> Result<LoadedMigration, ConfigErrors> {
    config::read_file(path, |file: &mut MigrationFile| file.validate())
}

/// Whether the TOML file at `path` is a migration file (it has a `[migration]` table) rather
/// than a pipeline file.
pub fn is_migration_file(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|text| config::is_migration_text(&text))
}

/// What every phase works with: the file, a connection, both tables and the transform.
pub struct Migration {
    /// The migration file.
    pub file: MigrationFile,
    /// Where it was read from.
    pub path: PathBuf,
    /// A connection to the database of both tables.
    pub client: tokio_postgres::Client,
    /// The source table.
    pub source: Table,
    /// The target table.
    pub target: Table,
    /// The transform, compiled against both tables.
    pub transform: Transform,
    /// The control row.
    pub control: Control,
}

/// Why a phase could not run.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The file does not fit the tables (exit 2).
    #[error("{0}")]
    Config(ConfigErrors),
    /// The database, or the migration's state, said no (exit 1).
    #[error("{0}")]
    Migration(#[from] MigrationError),
}

impl Migration {
    /// Connects, reads both tables and compiles the transform; problems of the file against
    /// the tables are configuration errors naming the field.
    pub async fn open(path: &Path, file: MigrationFile) -> Result<Self, MigrateError> {
        let m = &file.migration;
        let client = connect(m.url.expose()).await?;
        let source = read_table(&client, &m.source).await?;
        let target = read_table(&client, &m.target).await?;
        let transform =
            Transform::new(&file, &source.shape, &target.shape).map_err(|problems| {
                MigrateError::Config(ConfigErrors(
                    problems
                        .into_iter()
                        .map(|(field, message)| ConfigError {
                            file: path.display().to_string(),
                            line: 0,
                            column: 0,
                            path: field,
                            message,
                        })
                        .collect(),
                ))
            })?;
        let control = Control::new(&m.control_table, &m.name);
        Ok(Self {
            path: path.to_owned(),
            client,
            source,
            target,
            transform,
            control,
            file,
        })
    }

    /// The dual write's pipeline name (its state directory under `state_dir`).
    pub fn pipeline_name(&self) -> String {
        format!("migrate-{}", self.file.migration.name)
    }

    /// The dual write's state directory.
    pub fn state_path(&self) -> PathBuf {
        PathBuf::from(&self.file.migration.state_dir).join(self.pipeline_name())
    }

    /// Copies the control row into the state directory (`migration.json`), so that the state
    /// directory tells the phase too when the database is not at hand.
    pub async fn record(&self) -> Result<(), MigrationError> {
        let Some(row) = self.control.read(&self.client).await? else {
            return Ok(());
        };
        let dir = self.state_path();
        let written = std::fs::create_dir_all(&dir).and_then(|()| {
            let tmp = dir.join("migration.json.tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&row).expect("JSON"))?;
            std::fs::rename(&tmp, dir.join("migration.json"))
        });
        if let Err(e) = written {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot copy the control row to the state directory");
        }
        Ok(())
    }
}

/// Runs `refract migrate FILE command`.
pub fn run(path: &Path, command: MigrateCommand) -> ExitCode {
    let loaded = match load(path) {
        Ok(l) => l,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async move {
        let migration = match Migration::open(path, loaded.config.clone()).await {
            Ok(m) => m,
            Err(MigrateError::Config(errors)) => {
                eprintln!("{errors}");
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        let result = match command {
            MigrateCommand::Start { until_caught_up } => {
                start::run(migration, &loaded, until_caught_up).await
            }
            MigrateCommand::Backfill { restart } => backfill::run(migration, restart).await,
            MigrateCommand::Verify(args) => verify::run(migration, args).await,
            MigrateCommand::Cutover { timeout, force } => {
                switch::cutover(migration, timeout, force).await
            }
            MigrateCommand::Rollback { timeout } => switch::rollback(migration, timeout).await,
            MigrateCommand::Finalize { drop_old_table } => {
                switch::finalize(migration, drop_old_table).await
            }
            MigrateCommand::Status { json } => status::run(migration, json).await,
        };
        match result {
            Ok(code) => code,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
