//! `refract migrate FILE start`: prepares the database (control table and row, identity index,
//! publication of the source and the control table, slot) and runs the dual write as a
//! pipeline: the PostgreSQL source, the `migration` projection and the `migration` sink.
//!
//! The pipeline is the ordinary runtime (checkpoints, batching, retries, dead letters, metrics,
//! SIGTERM drain), written from the migration file and the catalog; a restart resumes from its
//! checkpoint, and the sink skips what the control row says is applied already.

use std::process::ExitCode;

use refract_connectors::ReadMode;
use refract_connectors::migration::MigrationError;
use refract_connectors::migration::catalog::{
    ensure_identity_index, qualified_name, replica_identity_covers,
};
use refract_connectors::migration::control::create_publication;
use refract_schemas::config::{
    LoadedPipeline, MigrationProjectionConfig, MigrationSinkConfig, PipelineFile,
};
use serde_json::{Value, json};

use super::{LoadedMigration, MigrateError, Migration};
use crate::runtime::{self, RunError, RunOptions};

/// The name of the projection and of the sink in the dual write's pipeline.
const PART: &str = "dual_write";

/// Prepares the database for the dual write; safe to run again.
pub async fn prepare(m: &Migration) -> Result<(), MigrationError> {
    let file = &m.file.migration;
    let row = m.control.read(&m.client).await.ok().flatten();
    if row
        .as_ref()
        .and_then(|r| r.get("phase"))
        .and_then(Value::as_str)
        == Some("finalized")
    {
        return Err(MigrationError::Refused(format!(
            "migration `{}` is finalized: its replication was stopped for good",
            file.name
        )));
    }
    m.control.create_table(&m.client).await?;
    m.control
        .register(&m.client, &file.source, &file.target, &m.file.slot())
        .await?;
    if let Some(index) = ensure_identity_index(&m.client, &m.target, m.transform.identity()).await?
    {
        tracing::info!(index = %index, table = %file.target, "created the identity index the dual write upserts through");
    }
    // The target joins the publication at the cut-over (`create_publication` says why).
    let publication = m.file.publication();
    let published = [file.source.clone(), file.control_table.clone()];
    if create_publication(&m.client, &publication, &published).await? {
        tracing::info!(%publication, tables = ?published, "created the dual write's publication");
    }
    if !replica_identity_covers(&m.client, &m.target, m.transform.identity()).await? {
        return Err(MigrationError::Refused(format!(
            "the deletes of `{}` would not carry ({}), so after a cut-over they could not be \
             replicated back: make its primary key include them, or run \
             `ALTER TABLE {} REPLICA IDENTITY FULL`",
            file.target,
            m.transform.identity().join(", "),
            m.target.quoted
        )));
    }
    Ok(())
}

/// The dual write as a pipeline file; `tables` are the source, target and control tables
/// qualified with their schemas.
pub fn pipeline(m: &Migration, tables: [String; 3]) -> PipelineFile {
    let file = &m.file.migration;
    let projection = MigrationProjectionConfig {
        migration: m.file.clone(),
        source_shape: m.source.shape.clone(),
        target_shape: m.target.shape.clone(),
        sinks: vec![PART.into()],
    };
    let sink = MigrationSinkConfig {
        url: file.url.clone(),
        migration: file.name.clone(),
        control_table: file.control_table.clone(),
    };
    let mut projection = serde_json::to_value(projection).expect("a projection serializes");
    projection["kind"] = json!("migration");
    let mut sink = serde_json::to_value(sink).expect("a sink serializes");
    sink["kind"] = json!("migration");
    serde_json::from_value(json!({
        "pipeline": {
            "name": m.pipeline_name(),
            "state_dir": file.state_dir,
            "metrics_addr": file.metrics_addr,
        },
        "source": {
            "kind": "postgres",
            "url": file.url,
            "slot": m.file.slot(),
            "publication": m.file.publication(),
            "tables": tables,
            "snapshot": "never",
        },
        "projections": { PART: projection },
        "sinks": { PART: sink },
    }))
    .expect("the dual write's pipeline is a valid pipeline file")
}

/// Runs `start`.
pub async fn run(
    m: Migration,
    loaded: &LoadedMigration,
    until_caught_up: bool,
) -> Result<ExitCode, MigrateError> {
    prepare(&m).await?;
    m.record().await?;
    let mut tables = Vec::new();
    for table in [
        &m.file.migration.source,
        &m.file.migration.target,
        &m.file.migration.control_table,
    ] {
        tables.push(qualified_name(&m.client, table).await?);
    }
    let config = pipeline(&m, tables.try_into().expect("three tables"));
    let problems = config.validate();
    if !problems.is_empty() {
        return Err(MigrationError::Refused(format!(
            "the dual write's pipeline is invalid: {problems:?}"
        ))
        .into());
    }
    let pipeline = LoadedPipeline {
        file: m.path.clone(),
        config,
        secret_paths: loaded
            .secret_paths
            .iter()
            .map(|p| format!("source.{}", p.trim_start_matches("migration.")))
            .collect(),
        from_env: Default::default(),
    };
    let options = RunOptions {
        mode: if until_caught_up {
            ReadMode::UntilCaughtUp
        } else {
            ReadMode::Follow
        },
        backfill: None,
        progress_bar: false,
    };
    eprintln!(
        "dual write of `{}` into `{}` running (slot `{}`); SIGINT/SIGTERM to stop",
        m.file.migration.source,
        m.file.migration.target,
        m.file.slot()
    );
    let stop = crate::signals();
    match runtime::run(&pipeline, options, stop).await {
        Ok(summary) => {
            print!("{}", summary.render());
            m.record().await?;
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(match e {
                RunError::BadInput { .. } => ExitCode::from(3),
                _ => ExitCode::FAILURE,
            })
        }
    }
}
