//! The `refract` command line.
//!
//! Exit codes: 0 success; 1 runtime failure (source, sink, state); 2 configuration error;
//! 3 bad input with `on_error = "stop"`; 130 a second SIGINT/SIGTERM while draining.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use refract::runtime::{self, RunError, RunOptions};
use refract_connectors::ReadMode;
use refract_schemas::config::{self, LoadedPipeline};
use tokio::sync::watch;

/// mimalloc: decoding allocates many small maps and strings across threads, where glibc's
/// allocator spent a third of the time and kept freed memory per thread arena.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Print the JSON Schema of pipeline files (committed as schemas/pipeline.schema.json).
    ConfigSchema,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Validate { pipelines } => {
            let mut failed = false;
            for path in pipelines {
                match config::load(&path) {
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
        Command::Plan { pipeline } => match config::load(&pipeline) {
            Ok(loaded) => {
                print!("{}", refract::plan::render(&loaded));
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::from(2)
            }
        },
        Command::ConfigSchema => {
            print!("{}", config::json_schema());
            ExitCode::SUCCESS
        }
        Command::Run {
            pipeline,
            until_caught_up,
            summary_json,
        } => {
            let loaded = match config::load(&pipeline) {
                Ok(l) => l,
                Err(errors) => {
                    eprintln!("{errors}");
                    return ExitCode::from(2);
                }
            };
            let mode = if until_caught_up {
                ReadMode::UntilCaughtUp
            } else {
                ReadMode::Follow
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            rt.block_on(run(loaded, mode, summary_json))
        }
    }
}

async fn run(loaded: LoadedPipeline, mode: ReadMode, summary_json: Option<PathBuf>) -> ExitCode {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
        let _ = stop_tx.send(true);
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
        eprintln!(
            "second signal: exiting without draining (the checkpoint is safe; undelivered changes replay on restart)"
        );
        std::process::exit(130);
    });
    match runtime::run(&loaded, RunOptions { mode }, stop_rx).await {
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
                RunError::BadInput { .. } => ExitCode::from(3),
                _ => ExitCode::FAILURE,
            }
        }
    }
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
