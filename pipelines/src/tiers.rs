//! `refract tiers …`: the jobs and queries of a pipeline's hot, warm and cold tiers.
//!
//! - `age`: one aging pass (warm partitions past the window exported to cold, read back,
//!   counted, dropped; hot sets trimmed), the same pass a running pipeline makes on its
//!   schedule ([`age`]);
//! - `latest`, `online`, `range`: the three queries, printing JSON lines ([`query`]).
//!
//! Age is measured on the pipeline's clock (`[pipeline] clock`), like the projection does.

pub mod age;
pub mod query;

use std::process::ExitCode;

use clap::Subcommand;
use refract_schemas::config::{LoadedPipeline, TierLayout};

/// The subcommands of `refract tiers`.
#[derive(Debug, Subcommand)]
pub enum TiersCommand {
    /// Age the tiers once: export every warm partition past the warm window to cold (read
    /// back and counted before the partition is dropped; resumable after a kill) and trim the
    /// hot tier to its window.
    Age {
        /// The tiers sink, when the pipeline has more than one.
        #[arg(long)]
        sink: Option<String>,
    },
    /// The latest heartbeats of a device, newest first (hot, falling back to warm).
    Latest {
        /// The device.
        #[arg(long)]
        device: String,
        /// How many.
        #[arg(short = 'n', long, default_value_t = 10)]
        count: usize,
        /// The tiers sink, when the pipeline has more than one.
        #[arg(long)]
        sink: Option<String>,
    },
    /// How many devices of a region sent a heartbeat in the last N minutes (hot tier).
    Online {
        /// The region.
        #[arg(long)]
        region: String,
        /// The window, in minutes (at most the hot window).
        #[arg(long)]
        minutes: u64,
        /// The tiers sink, when the pipeline has more than one.
        #[arg(long)]
        sink: Option<String>,
    },
    /// A device's heartbeats in `[from, to)` from every tier, merged in time order.
    Range {
        /// The device.
        #[arg(long)]
        device: String,
        /// Start (RFC 3339), inclusive.
        #[arg(long)]
        from: String,
        /// End (RFC 3339), exclusive.
        #[arg(long)]
        to: String,
        /// The tiers sink, when the pipeline has more than one.
        #[arg(long)]
        sink: Option<String>,
    },
}

impl TiersCommand {
    fn sink(&self) -> Option<&str> {
        match self {
            TiersCommand::Age { sink }
            | TiersCommand::Latest { sink, .. }
            | TiersCommand::Online { sink, .. }
            | TiersCommand::Range { sink, .. } => sink.as_deref(),
        }
    }
}

/// The tier layout a command works on: the one named, or the pipeline's only one.
pub fn layout(loaded: &LoadedPipeline, sink: Option<&str>) -> Result<TierLayout, String> {
    let layouts = loaded.config.tier_layouts();
    match sink {
        Some(name) => layouts
            .into_iter()
            .find(|l| l.sink == name)
            .ok_or_else(|| format!("no sink `{name}` of kind `tiers` in the pipeline")),
        None => match <[TierLayout; 1]>::try_from(layouts) {
            Ok([only]) => Ok(only),
            Err(all) if all.is_empty() => Err("the pipeline has no sink of kind `tiers`".into()),
            Err(all) => Err(format!(
                "the pipeline has {} tiers sinks: name one with --sink",
                all.len()
            )),
        },
    }
}

/// Runs `command` on `loaded`'s tiers; the exit code.
pub fn run(
    loaded: &LoadedPipeline,
    rt: &tokio::runtime::Runtime,
    command: TiersCommand,
) -> ExitCode {
    let layout = match layout(loaded, command.sink()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let clock = crate::runtime::pipeline_clock(&loaded.config);
    let result = rt.block_on(async {
        match command {
            TiersCommand::Age { .. } => age::run(&layout, &clock).await,
            TiersCommand::Latest { device, count, .. } => {
                query::latest(&layout, &clock, &device, count).await
            }
            TiersCommand::Online {
                region, minutes, ..
            } => query::online(&layout, &clock, &region, minutes).await,
            TiersCommand::Range {
                device, from, to, ..
            } => query::range(&layout, &clock, &device, &from, &to).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
