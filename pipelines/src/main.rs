//! The `refract` command line.
//!
//! Exit codes: 0 success; 1 runtime failure (source, sink, state); 2 configuration error;
//! 3 bad input with `on_error = "stop"`; 130 a second SIGINT/SIGTERM while draining.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use refract::checkpoint::{CheckpointError, CheckpointStore};
use refract::runtime::{self, RunError, RunOptions};
use refract_connectors::{BackfillScope, ReadMode};
use refract_schemas::config::{self, LoadedPipeline};

/// mimalloc: decoding allocates many small maps and strings across threads, where glibc's
/// allocator spent a third of the time and kept freed memory per thread arena.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process. mimalloc returns freed memory to the
/// kernel and takes it again as batches come and go; with huge pages every first touch of a
/// 2 MiB region zeroes all of it, which took about a tenth of the CPU of a flatten-to-Parquet
/// run (the kernel's `clear_page`). Databases recommend the same for the same reason.
fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integer arguments and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// refract keeps read models in sync with an engine of record.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Log format on stderr (level from RUST_LOG, default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline as a daemon (SIGINT/SIGTERM drain, checkpoint and exit 0).
    Run {
        /// The pipeline file.
        pipeline: PathBuf,
        /// Stop with exit 0 once caught up with the source's end.
        #[arg(long)]
        until_caught_up: bool,
        /// Also write the run summary as JSON to this file.
        #[arg(long)]
        summary_json: Option<PathBuf>,
    },
    /// Re-read existing rows of a PostgreSQL source into the read models: chunked by primary
    /// key, resumable, safe while the daemon streams.
    Backfill {
        /// The pipeline file.
        pipeline: PathBuf,
        /// Only these tables (`schema.table` or `table`; repeatable). Default: every published table.
        #[arg(long = "table")]
        tables: Vec<String>,
        /// Start over instead of resuming an interrupted backfill of the same tables.
        #[arg(long)]
        restart: bool,
    },
    /// Check pipeline files; errors name file, line and field path.
    Validate {
        /// The pipeline files.
        #[arg(required = true)]
        pipelines: Vec<PathBuf>,
    },
    /// Show what a pipeline will read, keep and write (secrets masked).
    Plan {
        /// The pipeline file.
        pipeline: PathBuf,
    },
    /// Remove a pipeline's replication slot, its publication (when `create = true`) and its
    /// state directory, so that its next run starts over. Refused while the pipeline runs.
    Drop {
        /// The pipeline file.
        pipeline: PathBuf,
        /// Really drop (without it, only show what would be dropped and exit 2).
        #[arg(long)]
        yes: bool,
    },
    /// Rebuild the current-state tables (`{table}/current/`) of a pipeline's Parquet sinks from
    /// their change logs.
    Compact {
        /// The pipeline file.
        pipeline: PathBuf,
    },
    /// Recompute every PostgreSQL read model (replica and document projections) from the source
    /// tables and compare: exit 0 when equal, 1 with a report of missing, extra and differing
    /// documents otherwise.
    Verify {
        /// The pipeline file.
        pipeline: PathBuf,
    },
    /// The hot, warm and cold tiers of a pipeline's `tiers` sink: aging and queries.
    Tiers {
        /// The pipeline file.
        pipeline: PathBuf,
        #[command(subcommand)]
        command: refract::tiers::TiersCommand,
    },
    /// Shadow-write migration of a table into a new one while applications keep writing:
    /// `start` (the dual write), `backfill`, `verify`, `cutover`, `rollback`, `finalize`,
    /// `status`.
    Migrate {
        /// The migration file.
        migration: PathBuf,
        #[command(subcommand)]
        phase: refract::migrate::MigrateCommand,
    },
    /// Print the JSON Schema of pipeline files (committed as schemas/pipeline.schema.json).
    ConfigSchema,
}

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Validate { pipelines } => validate(&pipelines),
        Command::Tiers { pipeline, command } => with_pipeline(&pipeline, |loaded, rt| {
            refract::tiers::run(&loaded, rt, command)
        }),
        Command::Plan { pipeline } if refract::migrate::is_migration_file(&pipeline) => {
            refract::migrate::plan::run(&pipeline)
        }
        Command::Plan { pipeline } => with_pipeline(&pipeline, |loaded, rt| {
            let check = rt.block_on(refract::plan::check_source(&loaded));
            print!("{}", refract::plan::render(&loaded, &check));
            ExitCode::SUCCESS
        }),
        Command::Backfill {
            pipeline,
            tables,
            restart,
        } => with_pipeline(&pipeline, |loaded, rt| {
            rt.block_on(backfill(loaded, BackfillScope { tables, restart }))
        }),
        Command::Drop { pipeline, yes } => with_pipeline(&pipeline, |loaded, rt| {
            ExitCode::from(rt.block_on(refract::drop::run(&loaded, yes)))
        }),
        Command::Compact { pipeline } => with_pipeline(&pipeline, |loaded, rt| {
            // Held while compacting: a run of the pipeline compacts on its own, and two
            // compactions of one state would race to publish.
            let state = runtime::state_path(&loaded.config);
            let _held = match CheckpointStore::open_existing(&state) {
                Ok(held) => held,
                Err(CheckpointError::InUse(_)) => {
                    eprintln!(
                        "error: pipeline `{}` is running (its state {} is in use): it rebuilds \
                         current/ itself, every `compact_interval_ms` and when a run ends; stop it \
                         to compact now. Nothing was compacted.",
                        loaded.config.pipeline.name,
                        state.display()
                    );
                    return ExitCode::FAILURE;
                }
                Err(e) => {
                    tracing::warn!("compacting without the pipeline's state: {e}");
                    None
                }
            };
            match rt.block_on(runtime::compact(&loaded.config)) {
                Ok(reports) if reports.is_empty() => {
                    eprintln!("{}: no parquet sink to compact", pipeline.display());
                    ExitCode::from(2)
                }
                Ok(reports) => {
                    for (sink, r) in reports {
                        println!(
                            "sink `{sink}`: {} table(s) rebuilt, {} rows, {} change file(s) merged ({} row group(s) copied as they were), {} deleted by retention",
                            r.tables, r.rows, r.files_read, r.row_groups_copied, r.files_deleted
                        );
                        if r.superseded > 0 {
                            println!(
                                "sink `{sink}`: {} table(s) left as another compaction published them meanwhile",
                                r.superseded
                            );
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }),
        Command::Verify { pipeline } => with_pipeline(&pipeline, |loaded, rt| {
            match rt.block_on(refract::verify::run(&loaded)) {
                Ok(report) => {
                    print!("{}", report.render());
                    if report.equal() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Err(refract::verify::VerifyError::Unsupported(why)) => {
                    eprintln!("error: {why}");
                    ExitCode::from(2)
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }),
        Command::Migrate { migration, phase } => refract::migrate::run(&migration, phase),
        Command::ConfigSchema => {
            print!("{}", config::json_schema());
            ExitCode::SUCCESS
        }
        Command::Run {
            pipeline,
            until_caught_up,
            summary_json,
        } => with_pipeline(&pipeline, |loaded, rt| {
            let mode = if until_caught_up {
                ReadMode::UntilCaughtUp
            } else {
                ReadMode::Follow
            };
            rt.block_on(run(loaded, mode, summary_json))
        }),
    }
}

/// `refract validate`: pipeline and migration files; exit 2 when any is invalid.
fn validate(paths: &[PathBuf]) -> ExitCode {
    let mut failed = false;
    for path in paths {
        if refract::migrate::is_migration_file(path) {
            match refract::migrate::load(path) {
                Ok(m) => println!(
                    "{}: ok (migration `{}`: {} column(s) of `{}` from `{}`)",
                    path.display(),
                    m.config.migration.name,
                    m.config.columns.len(),
                    m.config.migration.target,
                    m.config.migration.source
                ),
                Err(errors) => {
                    eprintln!("{errors}");
                    failed = true;
                }
            }
            continue;
        }
        match refract::families::load(path) {
            Ok(loaded) => println!(
                "{}: ok ({} projection(s), {} sink(s))",
                path.display(),
                loaded.config.projections.len(),
                loaded.config.sinks.len()
            ),
            Err(errors) => {
                eprintln!("{errors}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

async fn backfill(loaded: LoadedPipeline, scope: BackfillScope) -> ExitCode {
    let stop_rx = refract::signals();
    match refract::backfill::run(&loaded, scope, stop_rx).await {
        Ok(refract::backfill::Outcome::Ran(summary)) => {
            print!("{}", summary.render());
            ExitCode::SUCCESS
        }
        Ok(refract::backfill::Outcome::ThroughDaemon {
            tables,
            skipped,
            elapsed,
        }) => {
            let rows: u64 = tables.iter().map(|(_, n)| n).sum();
            println!(
                "backfill of {rows} rows applied by the running daemon in {:.1}s",
                elapsed.as_secs_f64()
            );
            for (table, n) in tables {
                println!("  {table}: {n} rows");
            }
            for (table, why) in skipped {
                println!("  {table}: skipped ({why})");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(loaded: LoadedPipeline, mode: ReadMode, summary_json: Option<PathBuf>) -> ExitCode {
    let stop_rx = refract::signals();
    let options = RunOptions {
        mode,
        backfill: None,
        progress_bar: false,
    };
    match runtime::run(&loaded, options, stop_rx).await {
        Ok(summary) => {
            print!("{}", summary.render());
            if let Some(path) = summary_json {
                let json = serde_json::to_string_pretty(&summary).expect("a summary serializes");
                if let Err(e) = std::fs::write(&path, json) {
                    eprintln!("cannot write the summary to {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            match e {
                RunError::BadInput { .. } | RunError::Rejected { .. } => ExitCode::from(3),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// Loads a pipeline file (a configuration error exits 2) and runs `command` with it on a tokio
/// runtime. `refract drop` exits 0 dropped (or nothing to drop), 1 refused or failed, 2 `--yes`
/// missing.
fn with_pipeline(
    path: &std::path::Path,
    command: impl FnOnce(LoadedPipeline, &tokio::runtime::Runtime) -> ExitCode,
) -> ExitCode {
    let loaded = match refract::families::load(path) {
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
    command(loaded, &rt)
}

fn init_logging(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
