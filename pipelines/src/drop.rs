//! `refract drop PIPELINE.toml [--yes]`: removes what a pipeline keeps outside its read models so
//! that its next run starts over: its PostgreSQL replication slot, its publication when refract
//! may have created it (`create = true`), and its state directory (checkpoint, snapshot progress,
//! default dead-letter file).
//!
//! Only what the pipeline file names (or defaults to) is touched. Nothing is dropped while the
//! pipeline runs: a state directory locked by a running process or an active slot is refused.
//! Without `--yes` it lists what it would drop and exits 2.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use refract_connectors::sources::postgres::{InspectError, PgAdmin};
use refract_schemas::config::{LoadedPipeline, PostgresSourceConfig, SourceConfig};

use crate::checkpoint::{CheckpointError, CheckpointStore};
use crate::plan::pretty_bytes;
use crate::runtime::state_path;

/// How long each database step may take.
const DB_TIMEOUT: Duration = Duration::from_secs(15);

/// Exit code: dropped, or nothing to drop.
pub const EXIT_OK: u8 = 0;
/// Exit code: refused (the pipeline runs) or failed.
pub const EXIT_FAILED: u8 = 1;
/// Exit code: `--yes` is needed.
pub const EXIT_NEEDS_YES: u8 = 2;

/// What the pipeline's PostgreSQL source has that `drop` removes.
struct PgTargets {
    admin: PgAdmin,
    slot: Option<String>,
    publication: Option<String>,
}

/// Runs `refract drop`; prints what it does (stdout) or why not (stderr) and returns the exit
/// code.
pub async fn run(loaded: &LoadedPipeline, yes: bool) -> u8 {
    let c = &loaded.config;
    let name = &c.pipeline.name;
    let mut drops: Vec<String> = Vec::new();
    let mut kept: Vec<String> = Vec::new();

    // The state: refused while a running process holds its checkpoint store. The store stays
    // open (locked) until the state is removed, so no run starts on it meanwhile.
    let state = state_path(c);
    let mut lock = None;
    match CheckpointStore::open_existing(&state) {
        Ok(store) => lock = store,
        Err(CheckpointError::InUse(_)) => {
            eprintln!(
                "error: the state of pipeline `{name}` ({}) is in use by a running refract process; \
                 stop it first. Nothing was dropped.",
                state.display()
            );
            return EXIT_FAILED;
        }
        // A damaged store is no reason to keep it.
        Err(e) => kept.push(format!("(the checkpoint store is unreadable: {e})")),
    }

    // The database: refused while the slot is active.
    let mut pg_targets = None;
    if let SourceConfig::Postgres(pg) = &c.source {
        let url = if loaded.secret_paths.contains("source.url") {
            "*** (secret)".to_owned()
        } else {
            pg.url.masked()
        };
        let targets = pg_targets_of(pg, name, &url, &mut drops, &mut kept);
        match tokio::time::timeout(DB_TIMEOUT, targets).await {
            Ok(Ok(t)) => pg_targets = Some(t),
            Ok(Err(Refusal(message))) => {
                eprintln!("error: {message}. Nothing was dropped.");
                return EXIT_FAILED;
            }
            Err(_) => {
                eprintln!(
                    "error: PostgreSQL {url} did not answer within {} s. Nothing was dropped.",
                    DB_TIMEOUT.as_secs()
                );
                return EXIT_FAILED;
            }
        }
    }
    if state.exists() {
        drops.push(format!(
            "state directory {} ({})",
            state.display(),
            contents(&state)
        ));
    } else {
        kept.push(format!("no state directory at {}", state.display()));
    }
    if let Some(path) = &c.pipeline.dead_letter.path
        && !Path::new(path).starts_with(&state)
    {
        kept.push(format!("the dead-letter file {path}"));
    }
    if c.pipeline.dead_letter.url.is_some() {
        kept.push("the dead letters under `dead_letter.url`".into());
    }
    kept.push("the read models (sinks are not touched)".into());

    let mut report = String::new();
    if drops.is_empty() {
        let _ = writeln!(report, "nothing to drop for pipeline `{name}`:");
        for k in &kept {
            let _ = writeln!(report, "  {k}");
        }
        print!("{report}");
        return EXIT_OK;
    }
    if !yes {
        let _ = writeln!(report, "refract drop would remove, for pipeline `{name}`:");
        for d in &drops {
            let _ = writeln!(report, "  {d}");
        }
        let _ = writeln!(report, "and leave:");
        for k in &kept {
            let _ = writeln!(report, "  {k}");
        }
        let _ = writeln!(
            report,
            "Nothing was dropped. Run again with --yes to drop them; the next `refract run` then starts over."
        );
        print!("{report}");
        return EXIT_NEEDS_YES;
    }

    if let Some(t) = &pg_targets {
        let step = async {
            if let Some(slot) = &t.slot {
                t.admin.drop_slot(slot).await?;
                println!("dropped replication slot `{slot}`");
            }
            if let Some(publication) = &t.publication {
                t.admin.drop_publication(publication).await?;
                println!("dropped publication `{publication}`");
            }
            Ok::<(), InspectError>(())
        };
        match tokio::time::timeout(DB_TIMEOUT, step).await {
            Ok(Ok(())) => {}
            Ok(Err(e @ InspectError::SlotActive { .. })) => {
                eprintln!(
                    "error: {e}: a running `refract run` (or another consumer) holds it; stop it first. \
                     Nothing was dropped."
                );
                return EXIT_FAILED;
            }
            Ok(Err(e)) => {
                eprintln!("error: {e}; the state directory was left in place");
                return EXIT_FAILED;
            }
            Err(_) => {
                eprintln!(
                    "error: PostgreSQL did not answer within {} s; the state directory was left in place",
                    DB_TIMEOUT.as_secs()
                );
                return EXIT_FAILED;
            }
        }
    }
    drop(lock);
    if state.exists() {
        if let Err(e) = std::fs::remove_dir_all(&state) {
            eprintln!(
                "error: cannot remove the state directory {}: {e}",
                state.display()
            );
            return EXIT_FAILED;
        }
        println!("removed state directory {}", state.display());
    }
    println!("left:");
    for k in &kept {
        println!("  {k}");
    }
    println!("pipeline `{name}` dropped: the next `refract run` starts over");
    EXIT_OK
}

/// Why `drop` refuses.
struct Refusal(String);

/// Looks at the slot and publication of the pipeline, describing what would be dropped and
/// what is left; refuses when the slot is active or the database cannot be asked.
async fn pg_targets_of(
    pg: &PostgresSourceConfig,
    pipeline: &str,
    url: &str,
    drops: &mut Vec<String>,
    kept: &mut Vec<String>,
) -> Result<PgTargets, Refusal> {
    let fail = |e: InspectError| Refusal(format!("PostgreSQL {url}: {e}"));
    let admin = PgAdmin::connect(pg.url.expose()).await.map_err(fail)?;
    let server = admin.server().await.map_err(fail)?;
    let slot_name = pg.slot_name(pipeline);
    let publication_name = pg.publication_name(pipeline);
    let mut slot = None;
    match admin
        .slot(&slot_name, server.version_num)
        .await
        .map_err(fail)?
    {
        None => kept.push(format!("no replication slot `{slot_name}` (none exists)")),
        Some(s) if !s.in_this_database => kept.push(format!(
            "replication slot `{slot_name}`: it is a {} slot of {}, not this pipeline's",
            s.slot_type,
            s.database
                .as_deref()
                .map_or("no database".to_owned(), |d| format!("database `{d}`"))
        )),
        Some(s) if s.active => {
            return Err(Refusal(format!(
                "replication slot `{slot_name}` is active (in use by server process {}): a running \
                 `refract run` (or another consumer) holds it; stop it first",
                s.active_pid.map_or("?".to_owned(), |p| p.to_string())
            )));
        }
        Some(s) => {
            let mut text = format!(
                "replication slot `{slot_name}` in {url} (wal_status {}, confirmed_flush_lsn {}",
                s.wal_status.as_deref().unwrap_or("unknown"),
                s.confirmed_flush_lsn.as_deref().unwrap_or("none")
            );
            if let Some(bytes) = s.retained_wal_bytes {
                let _ = write!(text, ", retains {} of WAL", pretty_bytes(bytes));
            }
            text.push(')');
            drops.push(text);
            slot = Some(slot_name);
        }
    }
    let mut publication = None;
    match admin
        .publication(&publication_name)
        .await
        .map_err(fail)?
    {
        None => kept.push(format!(
            "no publication `{publication_name}` (none exists)"
        )),
        Some(_) if !pg.create => kept.push(format!(
            "publication `{publication_name}`, left in place: with `create = false` refract did not create it"
        )),
        Some(_) => {
            drops.push(format!(
                "publication `{publication_name}` (`create = true`: refract may have created it)"
            ));
            publication = Some(publication_name);
        }
    }
    Ok(PgTargets {
        admin,
        slot,
        publication,
    })
}

/// `checkpoint.redb, dead-letters.ndjson (12 KiB)`: the entries of a directory, with sizes.
fn contents(dir: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return "unreadable".into();
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            match e.metadata() {
                Ok(m) if m.is_file() => {
                    format!(
                        "{name} {}",
                        pretty_bytes(i64::try_from(m.len()).unwrap_or(i64::MAX))
                    )
                }
                Ok(m) if m.is_dir() => format!("{name}/"),
                _ => name,
            }
        })
        .collect();
    names.sort();
    if names.is_empty() {
        "empty".into()
    } else {
        names.join(", ")
    }
}
