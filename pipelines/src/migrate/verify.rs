//! `refract migrate FILE verify`: the two tables compared through the transform (see
//! [`refract_connectors::migration::verify`]); a report naming every missing, extra and
//! differing row, exit 0 equal, 1 different. The outcome is recorded in the control row
//! (`verified_at`, `verify_equal`, `verify_summary`) and the whole report in the state
//! directory (`verify.json`).

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use refract_connectors::migration::MigrationError;
use refract_connectors::migration::verify::{
    self, CHUNK_ROWS, Difference, Direction, Report, VerifyPlan, VerifyProgress,
};
use serde_json::{Value, json};

use super::{MigrateError, Migration};
use crate::runtime::rows_bar;

/// How often the rate and time left are logged.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Options of `verify`.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Compare the source's rows, transformed, against the target (the default before a
    /// cut-over).
    #[arg(long, conflicts_with = "reverse")]
    forward: bool,
    /// Compare the target's rows, transformed back, against the source (the default after a
    /// cut-over).
    #[arg(long)]
    reverse: bool,
    /// How long rows found different are re-checked while the dual write catches up, in
    /// seconds (0: report what the first read found).
    #[arg(long, default_value_t = 30)]
    settle: u64,
    /// Leading rows per chunk.
    #[arg(long, default_value_t = CHUNK_ROWS)]
    chunk_rows: i64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `verify`.
pub async fn run(m: Migration, args: VerifyArgs) -> Result<ExitCode, MigrateError> {
    let row = m.control.require(&m.client).await?;
    if args.chunk_rows < 1 {
        return Err(MigrationError::Refused("--chunk-rows must be at least 1".into()).into());
    }
    let reads_target =
        row.get("read_from").and_then(Value::as_str) == Some(&m.file.migration.target);
    let direction = if args.reverse || (reads_target && !args.forward) {
        Direction::Reverse
    } else {
        Direction::Forward
    };
    let slot = m.file.slot();
    let plan = VerifyPlan {
        transform: &m.transform,
        source: &m.source,
        target: &m.target,
        direction,
        slot: &slot,
        settle: Duration::from_secs(args.settle),
        chunk_rows: args.chunk_rows,
    };
    let bar = std::io::stderr().is_terminal().then(|| rows_bar(0));
    let started = Instant::now();
    let mut logged = Instant::now();
    let on_progress = |p: VerifyProgress| {
        if let Some(bar) = &bar {
            bar.set_length(p.total.max(p.rows));
            bar.set_position(p.rows);
        }
        if logged.elapsed() >= LOG_EVERY {
            logged = Instant::now();
            let rate = p.rows as f64 / started.elapsed().as_secs_f64().max(1e-3);
            let left = p.total.saturating_sub(p.rows) as f64 / rate.max(1.0);
            tracing::info!(
                rows = p.rows,
                total = p.total,
                rows_per_s = rate as u64,
                eta_s = left as u64,
                "verify"
            );
        }
    };
    let report = verify::run(&m.client, &plan, on_progress).await;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let report = report?;
    record(&m, &report).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("JSON"));
    } else {
        print_report(&report);
    }
    Ok(if report.equal() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The report without its list of differences: what the control row keeps.
fn summary(report: &Report) -> Value {
    json!({
        "direction": report.direction,
        "leading": report.leading,
        "following": report.following,
        "leading_rows": report.leading_rows,
        "following_rows": report.following_rows,
        "chunks": report.chunks,
        "chunks_differing": report.chunks_differing,
        "rechecked": report.rechecked,
        "settled": report.settled,
        "counts": report.counts,
        "seconds": report.seconds,
    })
}

/// Records the outcome in the control row and the report in the state directory.
async fn record(m: &Migration, report: &Report) -> Result<(), MigrationError> {
    m.control
        .update(
            &m.client,
            "verified_at = now(), verify_equal = $2, verify_summary = $3",
            &[&report.equal(), &summary(report)],
        )
        .await?;
    m.record().await?;
    let path = m.state_path().join("verify.json");
    if let Err(e) = std::fs::write(&path, serde_json::to_vec_pretty(report).expect("JSON")) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the verify report");
    }
    Ok(())
}

fn print_report(report: &Report) {
    let c = &report.counts;
    println!(
        "{} -> {} ({:?}): {} rows against {} in {} chunks ({} with different checksums), {:.1}s",
        report.leading,
        report.following,
        report.direction,
        report.leading_rows,
        report.following_rows,
        report.chunks,
        report.chunks_differing,
        report.seconds,
    );
    if report.rechecked > 0 {
        println!(
            "{} rows re-checked after the dual write caught up{}",
            report.rechecked,
            if report.settled {
                ""
            } else {
                " (it did not catch up within --settle: the differences may be lag)"
            }
        );
    }
    for d in &report.differences {
        match d {
            Difference::Missing { key } => {
                println!("missing   {key}: not in `{}`", report.following)
            }
            Difference::Extra { key } => println!("extra     {key}: not in `{}`", report.leading),
            Difference::Differs { key, columns } => {
                for col in columns {
                    println!(
                        "differs   {key}: `{}` is {} in `{}`, expected {}",
                        col.column, col.found, report.following, col.expected
                    );
                }
            }
            Difference::Unconvertible { key, reason } => {
                println!("unconvertible {key}: {reason}")
            }
        }
    }
    let listed = report.differences.len() as u64;
    let total = c.missing + c.extra + c.differing + c.unconvertible;
    if total > listed {
        println!("... and {} more", total - listed);
    }
    if report.equal() {
        println!("equal");
    } else {
        println!(
            "different: {} missing, {} extra, {} differing, {} unconvertible",
            c.missing, c.extra, c.differing, c.unconvertible
        );
    }
}
