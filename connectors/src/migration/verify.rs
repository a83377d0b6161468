//! `verify`: whether the table reads come from holds, through the transform, exactly the rows
//! of the table the replication reads (Vitess's VDiff for PostgreSQL).
//!
//! The *leading* table is the one the replication carries changes from (the source before a
//! cut-over, the target after it), the *following* table the other. Both are read in key order,
//! a chunk at a time: the leading chunk's rows are converted by the transform and compared, by
//! an MD5 checksum of their canonical values, with the following rows in the same key range.
//! Only a chunk whose checksums differ is diffed row by row. Canonical values make equal values
//! written differently (`1.0` and `1`, one instant in two time zones, JSON objects with their
//! keys in another order) equal (see [`refract_projections::migration::value::canonical`]).
//!
//! While applications write, the two reads of a chunk see the tables at two moments, and the
//! replication is behind by its lag: a row can differ only because its change has not been
//! applied yet. Every row found different is therefore re-checked: read again from the leading
//! table, then, once the slot has confirmed the WAL position of that read (the replication has
//! applied every change committed before it), from the following table. Rows that differ after
//! the re-checks of the settle time are differences.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use md5::{Digest, Md5};
use refract_projections::migration::value::{ColumnType, canonical};
use refract_projections::migration::{ConvertError, Transform, key_text};
use refract_schemas::Row;
use serde::Serialize;
use serde_json::Value;
use tokio_postgres::Client;

use super::catalog::Table;
use super::rows::Reader;
use super::{MigrationError, db};

/// Leading rows per chunk: reads only, so larger than the backfill's write chunks (fewer round
/// trips), and small enough that a chunk of both tables stays a few megabytes in memory.
pub const CHUNK_ROWS: i64 = 10_000;
/// Differences listed in a report; the counts cover them all.
pub const REPORT_LIMIT: usize = 1_000;
/// Differing rows kept for the re-check; the ones past it are counted as found, unchecked (a
/// migration with that many differences has a problem no re-check will solve).
const MAX_SUSPECTS: usize = 100_000;
/// Keys per statement of a re-check.
const RECHECK_BATCH: usize = 10_000;
/// How long a re-check waits for an inactive slot to become active (the dual write restarting)
/// before it compares without waiting.
const INACTIVE_GRACE: Duration = Duration::from_secs(5);
/// How often the slot's confirmed position is polled while waiting.
const POLL: Duration = Duration::from_millis(100);
/// Separates values in a canonical key and in checksums (a byte no canonical text contains).
const SEPARATOR: char = '\u{1f}';

/// Which way the comparison goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// The source's rows, transformed, against the target (before a cut-over).
    Forward,
    /// The target's rows, transformed back, against the source (after a cut-over).
    Reverse,
}

/// What to compare, and how long to let the replication catch up.
pub struct VerifyPlan<'a> {
    /// The migration's transform.
    pub transform: &'a Transform,
    /// The source table.
    pub source: &'a Table,
    /// The target table.
    pub target: &'a Table,
    /// Which table leads.
    pub direction: Direction,
    /// The dual write's slot, whose confirmed position tells what has been applied.
    pub slot: &'a str,
    /// How long differing rows are re-checked while the replication catches up.
    pub settle: Duration,
    /// Leading rows per chunk.
    pub chunk_rows: i64,
}

/// One row that is not as it should be. Keys are `(column=value, ...)` of the leading table's
/// key, or of the following table's key when there is no leading row.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Difference {
    /// In the leading table, not in the following one.
    Missing {
        /// The leading row's key.
        key: String,
    },
    /// In the following table, not in the leading one.
    Extra {
        /// The following row's key.
        key: String,
    },
    /// In both, with different values.
    Differs {
        /// The leading row's key.
        key: String,
        /// Each column that differs.
        columns: Vec<ColumnDifference>,
    },
    /// The transform cannot convert the leading row, so it cannot be in the following table.
    Unconvertible {
        /// The leading row's key.
        key: String,
        /// Why, naming the column and the value.
        reason: String,
    },
}

/// A column of a row in both tables with different values.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ColumnDifference {
    /// The following table's column.
    pub column: String,
    /// The leading row's value through the transform.
    pub expected: Value,
    /// The following row's value.
    pub found: Value,
}

/// How many rows of each kind of difference.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Rows missing from the following table.
    pub missing: u64,
    /// Rows only the following table has.
    pub extra: u64,
    /// Rows with different values.
    pub differing: u64,
    /// Leading rows the transform cannot convert.
    pub unconvertible: u64,
}

impl Counts {
    fn add(&mut self, d: &Difference) {
        match d {
            Difference::Missing { .. } => self.missing += 1,
            Difference::Extra { .. } => self.extra += 1,
            Difference::Differs { .. } => self.differing += 1,
            Difference::Unconvertible { .. } => self.unconvertible += 1,
        }
    }

    /// Whether there is no difference at all.
    pub fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

/// The outcome of a verification.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Which way it compared.
    pub direction: Direction,
    /// The leading table.
    pub leading: String,
    /// The following table.
    pub following: String,
    /// Rows read from the leading table.
    pub leading_rows: u64,
    /// Rows read from the following table.
    pub following_rows: u64,
    /// Chunks compared.
    pub chunks: u64,
    /// Chunks whose checksums differed.
    pub chunks_differing: u64,
    /// Rows re-checked after the replication caught up.
    pub rechecked: u64,
    /// Whether the last re-check saw the slot confirm its read position (false: the dual write
    /// was not running, or was further behind than the settle time).
    pub settled: bool,
    /// The differences, counted.
    pub counts: Counts,
    /// The first [`REPORT_LIMIT`] differences.
    pub differences: Vec<Difference>,
    /// How long it took.
    pub seconds: f64,
}

impl Report {
    /// Whether the tables are equal through the transform.
    pub fn equal(&self) -> bool {
        self.counts.is_zero()
    }
}

/// Progress, after each chunk.
#[derive(Clone, Copy, Debug, Default)]
pub struct VerifyProgress {
    /// Leading rows compared so far.
    pub rows: u64,
    /// The leading table's estimated row count.
    pub total: u64,
}

/// A difference with what a re-check reads again: the leading and the following key.
#[derive(Clone, Debug)]
struct Finding {
    difference: Difference,
    lead_key: Option<Vec<Value>>,
    follow_key: Option<Vec<Value>>,
}

/// A row in the form compared: its following-table key, canonical, and canonical values.
struct Canon {
    key: String,
    key_values: Vec<Value>,
    lead_key: Option<Vec<Value>>,
    row: Row,
    values: Vec<String>,
}

/// The two tables of a direction, and the conversion between them.
struct Sides<'a> {
    transform: &'a Transform,
    direction: Direction,
    lead: Reader,
    follow: Reader,
    /// The following table's columns the converted rows have, with their types.
    compared: Vec<(String, ColumnType)>,
}

impl<'a> Sides<'a> {
    fn new(plan: &VerifyPlan<'a>) -> Result<Self, MigrationError> {
        let t = plan.transform;
        if let Some((source, target)) = t.key_order_changes() {
            return Err(MigrationError::Refused(format!(
                "the key column `{source}` is cast to another kind of type in `{target}`, so the \
                 two tables do not sort their rows alike and cannot be compared a key range at a \
                 time (verify compares keys that keep their order: copies and casts within a kind)"
            )));
        }
        let (lead, follow, lead_key, follow_key) = match plan.direction {
            Direction::Forward => (plan.source, plan.target, t.source_key(), t.identity()),
            Direction::Reverse => (plan.target, plan.source, t.identity(), t.source_key()),
        };
        let compared = follow
            .shape
            .columns
            .iter()
            .filter_map(|c| {
                let ty = match plan.direction {
                    Direction::Forward => t.target_type(&c.name),
                    Direction::Reverse => t.source_type(&c.name),
                };
                ty.map(|ty| (c.name.clone(), ty))
            })
            .collect();
        Ok(Self {
            transform: t,
            direction: plan.direction,
            lead: Reader::new(lead, lead_key),
            follow: Reader::new(follow, follow_key),
            compared,
        })
    }

    /// A leading row in the following table's form.
    fn convert(&self, row: &Row) -> Result<Row, ConvertError> {
        match self.direction {
            Direction::Forward => self.transform.forward(row),
            Direction::Reverse => self.transform.reverse(row),
        }
    }

    /// The following key of a leading row (or key image).
    fn follow_key_of(&self, lead: &Row) -> Option<Vec<Value>> {
        let key = match self.direction {
            Direction::Forward => self.transform.forward_key(lead),
            Direction::Reverse => self.transform.reverse_key(lead),
        };
        key.ok().map(|k| self.follow.key_of(&k))
    }

    /// The leading key of a following row (or key image).
    fn lead_key_of(&self, follow: &Row) -> Option<Vec<Value>> {
        let key = match self.direction {
            Direction::Forward => self.transform.reverse_key(follow),
            Direction::Reverse => self.transform.forward_key(follow),
        };
        key.ok().map(|k| self.lead.key_of(&k))
    }

    /// `row` (in the following table's form) as compared.
    fn canon(&self, row: Row, lead_key: Option<Vec<Value>>) -> Canon {
        let key_values = self.follow.key_of(&row);
        let key = self.canonical_key(&key_values);
        let values = self
            .compared
            .iter()
            .map(|(c, ty)| canonical(row.get(c).unwrap_or(&Value::Null), *ty))
            .collect();
        Canon {
            key,
            key_values,
            lead_key,
            row,
            values,
        }
    }

    fn canonical_key(&self, values: &[Value]) -> String {
        let mut key = String::new();
        for (name, value) in self.follow.key().iter().zip(values) {
            let ty = self
                .compared
                .iter()
                .find(|(c, _)| c == name)
                .map_or(ColumnType::Text, |(_, ty)| *ty);
            key.push_str(&canonical(value, ty));
            key.push(SEPARATOR);
        }
        key
    }

    /// The differences between leading rows and the following rows of the same keys.
    fn compare(&self, lead_rows: &[Row], follow_rows: &[Row]) -> Vec<Finding> {
        let mut findings = Vec::new();
        let mut expected = Vec::with_capacity(lead_rows.len());
        // Following keys of leading rows the transform refuses: not extra, already reported.
        let mut refused: HashSet<String> = HashSet::new();
        for row in lead_rows {
            let lead_key = self.lead.key_of(row);
            match self.convert(row) {
                Ok(converted) => expected.push(self.canon(converted, Some(lead_key))),
                Err(e) => {
                    let follow_key = self.follow_key_of(row);
                    if let Some(k) = &follow_key {
                        refused.insert(self.canonical_key(k));
                    }
                    findings.push(Finding {
                        difference: Difference::Unconvertible {
                            key: key_text(row, self.lead.key()),
                            reason: e.to_string(),
                        },
                        lead_key: Some(lead_key),
                        follow_key,
                    });
                }
            }
        }
        let found: Vec<Canon> = follow_rows
            .iter()
            .map(|r| self.canon(r.clone(), self.lead_key_of(r)))
            .collect();
        if checksum(&expected) == checksum(&found) {
            return findings;
        }
        findings.extend(self.diff(expected, found, &refused));
        findings
    }

    /// Row-by-row differences between converted leading rows and following rows.
    fn diff(
        &self,
        expected: Vec<Canon>,
        found: Vec<Canon>,
        refused: &HashSet<String>,
    ) -> Vec<Finding> {
        let mut findings = Vec::new();
        let mut found: HashMap<String, Canon> =
            found.into_iter().map(|c| (c.key.clone(), c)).collect();
        for e in expected {
            let lead_text = self.lead_key_text(e.lead_key.as_deref());
            let difference = match found.remove(&e.key) {
                Some(f) if f.values == e.values => continue,
                Some(f) => Difference::Differs {
                    key: lead_text,
                    columns: self.column_differences(&e, &f),
                },
                None => Difference::Missing { key: lead_text },
            };
            findings.push(Finding {
                difference,
                lead_key: e.lead_key,
                follow_key: Some(e.key_values),
            });
        }
        let mut extra: Vec<Canon> = found
            .into_values()
            .filter(|f| !refused.contains(&f.key))
            .collect();
        extra.sort_by(|a, b| a.key.cmp(&b.key));
        findings.extend(extra.into_iter().map(|f| Finding {
            difference: Difference::Extra {
                key: key_text(&f.row, self.follow.key()),
            },
            lead_key: f.lead_key,
            follow_key: Some(f.key_values),
        }));
        findings
    }

    fn column_differences(&self, expected: &Canon, found: &Canon) -> Vec<ColumnDifference> {
        self.compared
            .iter()
            .enumerate()
            .filter(|(i, _)| expected.values[*i] != found.values[*i])
            .map(|(_, (c, _))| ColumnDifference {
                column: c.clone(),
                expected: expected.row.get(c).cloned().unwrap_or(Value::Null),
                found: found.row.get(c).cloned().unwrap_or(Value::Null),
            })
            .collect()
    }

    fn lead_key_text(&self, key: Option<&[Value]>) -> String {
        let Some(key) = key else {
            return "(?)".into();
        };
        let mut row = Row::new();
        for (name, value) in self.lead.key().iter().zip(key) {
            row.insert(name.clone(), value.clone());
        }
        key_text(&row, self.lead.key())
    }
}

/// MD5 of the canonical rows, in order, keys included.
fn checksum(rows: &[Canon]) -> [u8; 16] {
    let mut hash = Md5::new();
    let mut buf = [0u8; 4];
    for row in rows {
        hash.update(row.key.as_bytes());
        for value in &row.values {
            hash.update(value.as_bytes());
            hash.update(SEPARATOR.encode_utf8(&mut buf).as_bytes());
        }
        hash.update(b"\n");
    }
    hash.finalize().into()
}

/// Compares the two tables of `plan`; `progress` is called after each chunk.
pub async fn run(
    client: &Client,
    plan: &VerifyPlan<'_>,
    mut progress: impl FnMut(VerifyProgress),
) -> Result<Report, MigrationError> {
    let started = Instant::now();
    let sides = Sides::new(plan)?;
    let (lead_table, follow_table) = match plan.direction {
        Direction::Forward => (plan.source, plan.target),
        Direction::Reverse => (plan.target, plan.source),
    };
    let mut report = Report {
        direction: plan.direction,
        leading: lead_table.shape.table.clone(),
        following: follow_table.shape.table.clone(),
        leading_rows: 0,
        following_rows: 0,
        chunks: 0,
        chunks_differing: 0,
        rechecked: 0,
        settled: true,
        counts: Counts::default(),
        differences: Vec::new(),
        seconds: 0.0,
    };
    let total = super::backfill::estimate(client, lead_table).await?;
    let mut unchecked = Vec::new();
    let mut findings = Vec::new();
    scan(
        client,
        &sides,
        plan.chunk_rows,
        &mut report,
        |chunk, rows| {
            for f in chunk {
                if findings.len() < MAX_SUSPECTS {
                    findings.push(f);
                } else {
                    unchecked.push(f.difference);
                }
            }
            progress(VerifyProgress { rows, total });
        },
    )
    .await?;
    if !findings.is_empty() {
        let deadline = Instant::now() + plan.settle;
        findings = recheck(client, &sides, plan.slot, findings, deadline, &mut report).await?;
    }
    for d in findings.into_iter().map(|f| f.difference).chain(unchecked) {
        report.counts.add(&d);
        if report.differences.len() < REPORT_LIMIT {
            report.differences.push(d);
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Reads both tables a chunk at a time, handing each chunk's findings and the leading rows
/// read so far to `chunk_done`.
async fn scan(
    client: &Client,
    sides: &Sides<'_>,
    chunk_rows: i64,
    report: &mut Report,
    mut chunk_done: impl FnMut(Vec<Finding>, u64),
) -> Result<(), MigrationError> {
    let mut after_lead: Option<Vec<Value>> = None;
    let mut after_follow: Option<Vec<Value>> = None;
    loop {
        let lead_rows = sides
            .lead
            .read(client, after_lead.as_deref(), None, Some(chunk_rows), false)
            .await?;
        let last = (lead_rows.len() as i64) < chunk_rows;
        // The chunk ends at the following key of its last row whose key converts; the last
        // chunk takes every following row left.
        let through = if last {
            None
        } else {
            lead_rows.iter().rev().find_map(|r| sides.follow_key_of(r))
        };
        let follow_rows = if last || through.is_some() {
            sides
                .follow
                .read(
                    client,
                    after_follow.as_deref(),
                    through.as_deref(),
                    None,
                    false,
                )
                .await?
        } else {
            Vec::new()
        };
        report.chunks += 1;
        report.leading_rows += lead_rows.len() as u64;
        report.following_rows += follow_rows.len() as u64;
        let findings = sides.compare(&lead_rows, &follow_rows);
        if !findings.is_empty() {
            report.chunks_differing += 1;
        }
        chunk_done(findings, report.leading_rows);
        if last {
            return Ok(());
        }
        after_lead = lead_rows.last().map(|r| sides.lead.key_of(r));
        if through.is_some() {
            after_follow = through;
        }
    }
}

/// Reads the rows of `findings` again, the leading table first and the following table once
/// the slot has confirmed the position of that read, until no difference is left, the
/// replication cannot be waited for, or `deadline`; returns the differences that remain.
async fn recheck(
    client: &Client,
    sides: &Sides<'_>,
    slot: &str,
    mut findings: Vec<Finding>,
    deadline: Instant,
    report: &mut Report,
) -> Result<Vec<Finding>, MigrationError> {
    loop {
        report.rechecked += findings.len() as u64;
        let lead_keys: Vec<Vec<Value>> =
            findings.iter().filter_map(|f| f.lead_key.clone()).collect();
        let follow_keys: Vec<Vec<Value>> = findings
            .iter()
            .filter_map(|f| f.follow_key.clone())
            .collect();
        let lead_rows = read_keys(client, &sides.lead, &lead_keys).await?;
        let position: String = client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .map_err(db("cannot read the WAL position"))?
            .get(0);
        report.settled = wait_for_slot(client, slot, &position, deadline).await?;
        let follow_rows = read_keys(client, &sides.follow, &follow_keys).await?;
        let mut again = sides.compare(&lead_rows, &follow_rows);
        // A leading row the first read missed (inserted meanwhile) has no finding to recheck.
        let wanted: HashSet<String> = follow_keys.iter().map(|k| sides.canonical_key(k)).collect();
        again.retain(|f| {
            f.follow_key
                .as_ref()
                .is_none_or(|k| wanted.contains(&sides.canonical_key(k)))
        });
        // Unchanged findings (a value the transform refuses, a row the replication did not
        // apply) stay as they are: reading them again is no use.
        let unchanged = again.len() == findings.len()
            && again
                .iter()
                .zip(&findings)
                .all(|(a, b)| a.difference == b.difference);
        findings = again;
        if findings.is_empty() || unchanged || !report.settled || Instant::now() >= deadline {
            return Ok(findings);
        }
    }
}

/// The rows of `reader`'s table with the given keys, [`RECHECK_BATCH`] keys per statement.
async fn read_keys(
    client: &Client,
    reader: &Reader,
    keys: &[Vec<Value>],
) -> Result<Vec<Row>, MigrationError> {
    let mut rows = Vec::new();
    for batch in keys.chunks(RECHECK_BATCH) {
        rows.extend(reader.read_keys(client, batch).await?);
    }
    Ok(rows)
}

/// Waits until `slot` has confirmed WAL position `position`: the replication has applied every
/// change committed before it. `false` when the slot is gone, inactive for longer than
/// [`INACTIVE_GRACE`], or `deadline` passes first.
async fn wait_for_slot(
    client: &Client,
    slot: &str,
    position: &str,
    deadline: Instant,
) -> Result<bool, MigrationError> {
    let mut inactive_since: Option<Instant> = None;
    loop {
        let row = client
            .query_opt(
                "SELECT active, coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false) \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot, &position],
            )
            .await
            .map_err(db("cannot read the dual write's slot"))?;
        let Some(row) = row else {
            return Ok(false);
        };
        let (active, reached): (bool, bool) = (row.get(0), row.get(1));
        if reached {
            return Ok(true);
        }
        if active {
            inactive_since = None;
        } else if inactive_since.get_or_insert_with(Instant::now).elapsed() >= INACTIVE_GRACE {
            return Ok(false);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(POLL).await;
    }
}
