//! The runs of the aging protocol in `{table}_aging`, and their warm-side steps: pick a day,
//! detach its partitions, drop them once cold holds them (the cold side is in
//! [`super::export`]).

use object_store::ObjectStore;
use object_store::path::Path;
use refract_schemas::config::TierLayout;
use tokio_postgres::{Client, GenericClient};

use super::{AgingReport, DAY_MICROS, day_start, export, warm_error};
use crate::pg_sql::{qualified, quote_ident};
use crate::tiers::{TierError, warm};

/// PostgreSQL's longest identifier in bytes (NAMEDATALEN - 1): a longer name would be cut
/// silently, and two detached tables could end up with one name.
const MAX_IDENTIFIER: usize = 63;

/// Where a run is (the `state` column of `{table}_aging`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// The run row exists; its partitions may still be attached (the detach transaction did
    /// not commit).
    Detaching,
    /// The partitions are detached and renamed; aged files may be partly written.
    Exporting,
    /// Every aged file is written; not yet verified nor dropped.
    Exported,
    /// The detached tables are gone: the run is over.
    Dropped,
}

impl State {
    /// The state's name in the table.
    pub(super) fn name(self) -> &'static str {
        match self {
            State::Detaching => "detaching",
            State::Exporting => "exporting",
            State::Exported => "exported",
            State::Dropped => "dropped",
        }
    }

    fn parse(text: &str) -> Result<Self, TierError> {
        [
            State::Detaching,
            State::Exporting,
            State::Exported,
            State::Dropped,
        ]
        .into_iter()
        .find(|s| s.name() == text)
        .ok_or_else(|| TierError::Config(format!("unknown aging run state `{text}`")))
    }
}

/// One run: one day of the warm tier on its way to cold.
#[derive(Debug, Clone)]
pub(super) struct Run {
    /// The run's number (names its detached tables and its aged files).
    pub(super) id: i64,
    /// The day's start, microseconds since the epoch (midnight UTC).
    pub(super) day: i64,
    /// The day's partitions (their names before detaching; once detached see [`Run::detached`]).
    pub(super) partitions: Vec<String>,
    /// Where the run is.
    pub(super) state: State,
    /// Heartbeats and files exported (once exported).
    pub(super) exported: (u64, u64),
}

impl Run {
    /// The day as `yyyy-mm-dd`.
    pub(super) fn day_text(&self) -> String {
        warm::utc(self.day).format("%Y-%m-%d").to_string()
    }

    /// The detached tables of the run, quoted and qualified.
    pub(super) fn detached(&self, layout: &TierLayout) -> Vec<String> {
        let (schema, _) = warm::schema_and_table(layout);
        self.partitions
            .iter()
            .map(|p| qualified(schema, &detached_name(p, self.id)))
            .collect()
    }
}

/// The name a partition takes when a run detaches it.
fn detached_name(partition: &str, run: i64) -> String {
    format!("{partition}_aging{run}")
}

/// The oldest run that is not over, if any.
pub(super) async fn unfinished(
    client: &Client,
    layout: &TierLayout,
) -> Result<Option<Run>, TierError> {
    let row = client
        .query_opt(
            &format!(
                "SELECT run, day::text, partitions, state, coalesce(rows, 0), coalesce(files, 0) \
                 FROM {} WHERE state <> 'dropped' ORDER BY run LIMIT 1",
                warm::aging_table(layout)
            ),
            &[],
        )
        .await
        .map_err(warm_error("cannot read the aging runs"))?;
    let Some(row) = row else { return Ok(None) };
    let day: String = row.get(1);
    let day = chrono::NaiveDate::parse_from_str(&day, "%Y-%m-%d")
        .map_err(|e| TierError::Config(format!("aging run day `{day}`: {e}")))?
        .and_hms_opt(0, 0, 0)
        .map(|t| t.and_utc().timestamp_micros())
        .unwrap_or_default();
    let (rows, files): (i64, i64) = (row.get(4), row.get(5));
    Ok(Some(Run {
        id: row.get(0),
        day,
        partitions: row.get(2),
        state: State::parse(row.get(3))?,
        exported: (rows as u64, files as u64),
    }))
}

/// Starts a run for the oldest day whose partitions all lie before `cutoff` (the whole day
/// past it), `None` when no day is ready.
pub(super) async fn start(
    client: &Client,
    layout: &TierLayout,
    cutoff: i64,
) -> Result<Option<Run>, TierError> {
    let partitions = warm::partitions(client, layout)
        .await
        .map_err(warm_error("cannot list the warm partitions"))?;
    let Some(day) = partitions.first().map(|(_, hour)| day_start(*hour)) else {
        return Ok(None);
    };
    if day + DAY_MICROS > cutoff {
        return Ok(None);
    }
    let names: Vec<String> = partitions
        .into_iter()
        .filter(|(_, hour)| day_start(*hour) == day)
        .map(|(name, _)| name)
        .collect();
    let day_text = warm::utc(day).format("%Y-%m-%d").to_string();
    let row = client
        .query_one(
            &format!(
                "INSERT INTO {} (day, partitions, state) VALUES ($1::text::date, $2, 'detaching') \
                 RETURNING run",
                warm::aging_table(layout)
            ),
            &[&day_text, &names],
        )
        .await
        .map_err(warm_error("cannot record an aging run"))?;
    let run = Run {
        id: row.get(0),
        day,
        partitions: names,
        state: State::Detaching,
        exported: (0, 0),
    };
    tracing::info!(run = run.id, day = %day_text, partitions = run.partitions.len(), "aging a day of the warm tier");
    Ok(Some(run))
}

/// Takes `run` through its remaining steps, adding what it did to `report`.
pub(super) async fn finish(
    client: &mut Client,
    layout: &TierLayout,
    cold: &(std::sync::Arc<dyn ObjectStore>, Path),
    mut run: Run,
    report: &mut AgingReport,
) -> Result<(), TierError> {
    if run.state == State::Detaching {
        detach(client, layout, &mut run).await?;
    }
    if run.state == State::Exporting {
        run.exported = export::export(client, layout, cold, &run).await?;
        set_exported(client, layout, &run).await?;
        run.state = State::Exported;
    }
    if run.state == State::Exported {
        export::verify(client, layout, cold, &run).await?;
        drop_detached(client, layout, &run).await?;
        report.days_aged += 1;
        report.partitions_dropped += run.partitions.len() as u64;
        report.rows_exported += run.exported.0;
        report.files_written += run.exported.1;
        tracing::info!(run = run.id, day = %run.day_text(), partitions = run.partitions.len(), rows = run.exported.0, files = run.exported.1, "aged a day to cold");
    }
    Ok(())
}

/// In one transaction: locks the warm table, detaches every partition of the run's day and
/// renames it after the run (so that a late write to one of its hours makes a fresh partition),
/// and records the run as exporting. The day's partitions are listed again under the lock: a
/// resumed run's first attempt rolled back, and a partition may have been made since.
async fn detach(client: &mut Client, layout: &TierLayout, run: &mut Run) -> Result<(), TierError> {
    let fail = warm_error("cannot detach the day's partitions");
    let table = warm::table(layout);
    let (schema, _) = warm::schema_and_table(layout);
    let tx = client.transaction().await.map_err(&fail)?;
    tx.batch_execute(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .await
        .map_err(&fail)?;
    let partitions: Vec<String> = warm::partitions(&tx, layout)
        .await
        .map_err(&fail)?
        .into_iter()
        .filter(|(_, hour)| day_start(*hour) == run.day)
        .map(|(name, _)| name)
        .collect();
    for p in &partitions {
        let renamed = detached_name(p, run.id);
        if renamed.len() > MAX_IDENTIFIER {
            return Err(TierError::Config(format!(
                "warm partition `{p}` of run {}: the detached name `{renamed}` is longer than \
                 PostgreSQL's {MAX_IDENTIFIER} bytes (use a shorter warm table name)",
                run.id
            )));
        }
        let partition = qualified(schema, p);
        tx.batch_execute(&format!(
            "ALTER TABLE {table} DETACH PARTITION {partition}; \
             ALTER TABLE {partition} RENAME TO {}",
            quote_ident(&renamed)
        ))
        .await
        .map_err(&fail)?;
    }
    set_state(&tx, layout, run.id, State::Exporting, Some(&partitions))
        .await
        .map_err(&fail)?;
    tx.commit().await.map_err(&fail)?;
    run.partitions = partitions;
    run.state = State::Exporting;
    Ok(())
}

/// Records the run's export (its figures and state).
async fn set_exported(client: &Client, layout: &TierLayout, run: &Run) -> Result<(), TierError> {
    let (rows, files) = (run.exported.0 as i64, run.exported.1 as i64);
    client
        .execute(
            &format!(
                "UPDATE {} SET state = 'exported', rows = $2, files = $3 WHERE run = $1",
                warm::aging_table(layout)
            ),
            &[&run.id, &rows, &files],
        )
        .await
        .map_err(warm_error("cannot record an export"))?;
    Ok(())
}

/// In one transaction: drops the run's detached tables and records the run as over.
async fn drop_detached(
    client: &mut Client,
    layout: &TierLayout,
    run: &Run,
) -> Result<(), TierError> {
    let fail = warm_error("cannot drop the aged partitions");
    let tx = client.transaction().await.map_err(&fail)?;
    for table in run.detached(layout) {
        tx.batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
            .await
            .map_err(&fail)?;
    }
    set_state(&tx, layout, run.id, State::Dropped, None)
        .await
        .map_err(&fail)?;
    tx.commit().await.map_err(&fail)
}

/// Sets a run's state (and its partitions when given; `finished_at` once dropped).
async fn set_state(
    client: &impl GenericClient,
    layout: &TierLayout,
    run: i64,
    state: State,
    partitions: Option<&[String]>,
) -> Result<(), tokio_postgres::Error> {
    let finished = if state == State::Dropped {
        ", finished_at = now()"
    } else {
        ""
    };
    let partitions = partitions.map(<[String]>::to_vec);
    client
        .execute(
            &format!(
                "UPDATE {} SET state = $2, partitions = coalesce($3, partitions){finished} \
                 WHERE run = $1",
                warm::aging_table(layout)
            ),
            &[&run, &state.name(), &partitions],
        )
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip() {
        for s in [
            State::Detaching,
            State::Exporting,
            State::Exported,
            State::Dropped,
        ] {
            assert_eq!(State::parse(s.name()).unwrap(), s);
        }
        assert!(State::parse("half").is_err());
    }
}
