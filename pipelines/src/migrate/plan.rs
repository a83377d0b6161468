//! `refract plan MIGRATION.toml`: what a migration will read, create and write, checked against
//! the live database (secrets masked).

use std::path::Path;
use std::process::ExitCode;

use refract_connectors::migration::catalog::replica_identity_covers;
use refract_schemas::config::TransformKind;
use serde_json::Value;

use super::{MigrateError, Migration, load};

/// Runs `plan` on a migration file: exit 0 (warnings included), 2 when the file is invalid
/// or does not fit the tables.
pub fn run(path: &Path) -> ExitCode {
    let loaded = match load(path) {
        Ok(l) => l,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(2);
        }
    };
    let file = loaded.config.clone();
    let m = &file.migration;
    println!("migration `{}`", m.name);
    println!("  database:       {}", m.url.masked());
    println!(
        "  source:         `{}` (applications write it today)",
        m.source
    );
    println!("  target:         `{}`", m.target);
    println!("  control table:  `{}` (row `{}`)", m.control_table, m.name);
    println!(
        "  slot:           `{}` (and a publication of that name)",
        file.slot()
    );
    println!(
        "  backfill:       chunks of {} rows{}",
        m.batch_rows,
        m.max_rows_per_second
            .map(|r| format!(", at most {r} rows/s"))
            .unwrap_or_default()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let migration = match Migration::open(path, file.clone()).await {
            Ok(m) => m,
            Err(MigrateError::Config(errors)) => {
                eprintln!("{errors}");
                return ExitCode::from(2);
            }
            Err(e) => {
                println!("  WARNING: cannot check the tables: {e}");
                return ExitCode::SUCCESS;
            }
        };
        println!("  columns of `{}`:", m.target);
        for (name, spec) in &file.columns {
            let from = spec.source_column(name);
            let types = (
                migration.source.type_name(from).unwrap_or("?"),
                migration.target.type_name(name).unwrap_or("?"),
            );
            let rule = match spec.transform {
                TransformKind::Copy if from == name => "copy".to_owned(),
                TransformKind::Copy => format!("rename from `{from}`"),
                TransformKind::Cast => format!("cast from `{from}`"),
                TransformKind::Extract => format!(
                    "extract `{}` from `{from}` (reverse `{}`)",
                    spec.pattern.as_deref().unwrap_or_default(),
                    spec.reverse.as_deref().unwrap_or_default()
                ),
                TransformKind::Scale => format!(
                    "scale `{from}` by {} (reverse divides)",
                    spec.factor.unwrap_or_default()
                ),
            };
            println!("    {name:<16} {} -> {}: {rule}", types.0, types.1);
        }
        println!(
            "  rows matched by: ({}) of `{}` = ({}) of `{}`",
            migration.transform.source_key().join(", "),
            m.source,
            migration.transform.identity().join(", "),
            m.target
        );
        match replica_identity_covers(&migration.client, &migration.target, migration.transform.identity()).await {
            Ok(true) => {}
            Ok(false) => println!(
                "  WARNING: deletes of `{}` do not carry ({}): `start` will refuse; make them part of its primary key or set REPLICA IDENTITY FULL",
                m.target,
                migration.transform.identity().join(", ")
            ),
            Err(e) => println!("  WARNING: cannot read the replica identity of `{}`: {e}", m.target),
        }
        match migration.control.read(&migration.client).await {
            Ok(Some(row)) => println!(
                "  state:          phase `{}`, reads from `{}`",
                row.get("phase").and_then(Value::as_str).unwrap_or("?"),
                row.get("read_from").and_then(Value::as_str).unwrap_or("?")
            ),
            Ok(None) | Err(_) => println!("  state:          not started"),
        }
        ExitCode::SUCCESS
    })
}
