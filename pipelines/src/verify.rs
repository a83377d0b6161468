//! `refract verify`: recomputes every read model from the source tables and compares it with
//! what the sinks hold.
//!
//! The source's tables are read in one consistent snapshot (COPY, values converted as the
//! replication stream converts them) and fed, as snapshot reads, to fresh copies of the
//! pipeline's projections: a document projection builds its state from scratch in a temporary
//! on-disk store, so nothing incremental (fan-out, dirty marks, replays) is involved. The
//! documents they emit are then compared with each PostgreSQL read-model table: documents
//! missing, extra, or differing (with the differing fields).
//!
//! Run it when the pipeline is caught up and the source is quiet (or compare twice): a change
//! committed after the snapshot, or not yet applied, shows as a difference.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use refract_connectors::SourceError;
use refract_connectors::sources::postgres::tables::{TableReader, read_documents};
use refract_projections::{DocumentOp, Emission, WriteOp};
use refract_schemas::config::{LoadedPipeline, ProjectionConfig, SinkConfig, SourceConfig};
use refract_schemas::{Checkpoint, Position};
use serde_json::Value;

use crate::runtime::keyed_state::KeyedState;
use crate::runtime::rows_bar;

/// Differences listed per kind and read model (the counts are always complete).
const LISTED: usize = 20;
/// Source rows fed between two emissions of the projections' pending documents.
const ROWS_PER_STEP: u64 = 20_000;

/// Why verification could not run.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The pipeline has nothing verify can compare.
    #[error("{0}")]
    Unsupported(String),
    /// Reading the source or a read model failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// A projection failed on a source row.
    #[error("projection `{projection}`: {reason}")]
    Projection {
        /// The projection.
        projection: String,
        /// Why.
        reason: String,
    },
    /// The scratch state store failed.
    #[error(transparent)]
    State(#[from] refract_projections::state::StateError),
    /// The scratch directory could not be made.
    #[error("cannot create a scratch directory: {0}")]
    Scratch(std::io::Error),
}

/// One read model compared.
#[derive(Debug, Default)]
pub struct Comparison {
    /// `projection -> sink (schema.table)`.
    pub read_model: String,
    /// Documents the source says it must hold.
    pub expected: u64,
    /// Documents it holds.
    pub found: u64,
    /// Keys expected but absent (the first [`LISTED`]) and how many in all.
    pub missing: (Vec<String>, u64),
    /// Keys present but not expected.
    pub extra: (Vec<String>, u64),
    /// Keys whose document differs, with the differing fields.
    pub differing: (Vec<(String, Vec<String>)>, u64),
}

impl Comparison {
    /// Whether the read model equals the recomputation.
    pub fn equal(&self) -> bool {
        self.missing.1 == 0 && self.extra.1 == 0 && self.differing.1 == 0
    }
}

/// What `verify` found.
#[derive(Debug, Default)]
pub struct Report {
    /// Source rows read.
    pub rows: u64,
    /// One entry per (projection, PostgreSQL sink).
    pub comparisons: Vec<Comparison>,
    /// Read models verify does not read (other sink kinds), with the reason.
    pub skipped: Vec<String>,
}

impl Report {
    /// Whether every compared read model is equal.
    pub fn equal(&self) -> bool {
        self.comparisons.iter().all(Comparison::equal)
    }

    /// The human-readable report.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "source rows read  {}", self.rows);
        for c in &self.comparisons {
            let verdict = if c.equal() { "equal" } else { "DIFFERENT" };
            let _ = writeln!(
                out,
                "{}: {verdict} ({} expected, {} found; {} missing, {} extra, {} differing)",
                c.read_model, c.expected, c.found, c.missing.1, c.extra.1, c.differing.1
            );
            for key in &c.missing.0 {
                let _ = writeln!(out, "  missing    {key}");
            }
            for key in &c.extra.0 {
                let _ = writeln!(out, "  extra      {key}");
            }
            for (key, fields) in &c.differing.0 {
                let _ = writeln!(out, "  differing  {key}");
                for field in fields {
                    let _ = writeln!(out, "    {field}");
                }
            }
            let listed = c.missing.0.len() + c.extra.0.len() + c.differing.0.len();
            let total = c.missing.1 + c.extra.1 + c.differing.1;
            if (listed as u64) < total {
                let _ = writeln!(out, "  … and {} more", total - listed as u64);
            }
        }
        for s in &self.skipped {
            let _ = writeln!(out, "not compared: {s}");
        }
        out
    }
}

/// One projection's expected documents: collection → key → document.
type Expected = BTreeMap<String, BTreeMap<String, Value>>;

/// Recomputes and compares every read model of `loaded` kept in PostgreSQL.
pub async fn run(loaded: &LoadedPipeline) -> Result<Report, VerifyError> {
    let config = &loaded.config;
    let SourceConfig::Postgres(pg) = &config.source else {
        return Err(VerifyError::Unsupported(
            "`refract verify` recomputes read models from PostgreSQL source tables: it needs a `kind = \"postgres\"` source"
                .into(),
        ));
    };
    let mut report = Report::default();
    // (projection name, config, its PostgreSQL sinks)
    let mut targets = Vec::new();
    for (name, projection) in &config.projections {
        if !matches!(
            projection,
            ProjectionConfig::Replica(_) | ProjectionConfig::Document(_)
        ) {
            continue;
        }
        let mut sinks = Vec::new();
        for sink in projection.sinks() {
            match config.sinks.get(sink) {
                Some(SinkConfig::Postgres(s)) => sinks.push((sink.clone(), s.clone())),
                Some(_) => report.skipped.push(format!(
                    "{name} -> {sink} (verify reads PostgreSQL read models only)"
                )),
                None => {}
            }
        }
        if !sinks.is_empty() {
            targets.push((name.clone(), projection, sinks));
        }
    }
    if targets.is_empty() {
        return Err(VerifyError::Unsupported(
            "no replica or document projection of this pipeline writes to a `kind = \"postgres\"` sink: nothing to verify"
                .into(),
        ));
    }

    let reader = TableReader::open(pg.url.expose()).await?;
    let publication = pg.publication_name(&config.pipeline.name);
    let tables = reader.published(&publication).await?;
    if tables.is_empty() {
        return Err(VerifyError::Unsupported(format!(
            "publication `{publication}` is missing or empty: run the pipeline once (it creates the publication) before verifying"
        )));
    }
    let total: u64 = {
        let mut sum = 0;
        for t in &tables {
            sum += reader.estimate(t).await?;
        }
        sum * targets.len() as u64
    };
    let bar = rows_bar(total);
    // The scratch stores live beside the pipeline's state (same disk, same permissions) and go
    // when verification ends.
    let scratch = Scratch::create(crate::runtime::state_path(config).join("verify-scratch"))?;

    for (name, config, sinks) in targets {
        let mut expected = recompute(
            &name,
            config,
            &tables,
            &reader,
            &scratch.0.join(format!("{name}.redb")),
            &bar,
            &mut report.rows,
        )
        .await?;
        // A document projection's collection is compared even when the source says it must be
        // empty (documents left in it are extra).
        if let ProjectionConfig::Document(d) = config {
            let collection = d.collection.clone().unwrap_or_else(|| name.clone());
            expected.entry(collection).or_default();
        }
        for (sink, s) in sinks {
            for (collection, documents) in &expected {
                let table = s.table.replace("{collection}", collection);
                let mut comparison = Comparison {
                    read_model: format!("{name} -> {sink} ({}.{table})", s.schema),
                    expected: documents.len() as u64,
                    ..Comparison::default()
                };
                let mut remaining = documents.clone();
                let mut visit = |id: String, doc: Value| {
                    comparison.found += 1;
                    match remaining.remove(&id) {
                        None => note(&mut comparison.extra, id),
                        Some(want) if want != doc => {
                            let fields = differences(&want, &doc);
                            note(&mut comparison.differing, (id, fields));
                        }
                        Some(_) => {}
                    }
                };
                read_documents(s.url.expose(), &s.schema, &table, &mut visit).await?;
                for key in remaining.into_keys() {
                    note(&mut comparison.missing, key);
                }
                report.comparisons.push(comparison);
            }
        }
    }
    bar.finish_and_clear();
    Ok(report)
}

/// A directory removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn create(path: std::path::PathBuf) -> Result<Self, VerifyError> {
        // Left over by an interrupted verification.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).map_err(VerifyError::Scratch)?;
        Ok(Self(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn note<T>(list: &mut (Vec<T>, u64), item: T) {
    if list.0.len() < LISTED {
        list.0.push(item);
    }
    list.1 += 1;
}

/// Feeds every source table a projection reads to a fresh copy of it; returns its documents.
async fn recompute(
    name: &str,
    config: &ProjectionConfig,
    tables: &[String],
    reader: &TableReader,
    store_path: &std::path::Path,
    bar: &indicatif::ProgressBar,
    rows: &mut u64,
) -> Result<Expected, VerifyError> {
    let mut projection = refract_projections::build(config);
    let keyed = if projection.wants_store() {
        let keyed = KeyedState::scratch(store_path)?;
        projection.attach_store(keyed.handle(name));
        Some(keyed)
    } else {
        None
    };
    let fail = |reason: String| VerifyError::Projection {
        projection: name.to_owned(),
        reason,
    };
    let mut expected = Expected::new();
    let mut ops = Vec::new();
    let mut last: Option<Position> = None;
    for table in tables {
        let (schema, t) = table.split_once('.').unwrap_or(("public", table));
        if !projection.reads(&refract_schemas::TableId::new(schema, t)) {
            continue;
        }
        let mut failure = None;
        let mut fed = 0u64;
        let mut visit = |event: refract_schemas::ChangeEvent| {
            if failure.is_some() {
                return;
            }
            if let Err(e) = projection.project(&event, crate::runtime::now_ms(), &mut ops) {
                failure = Some(format!("{table}: {e}"));
                return;
            }
            last = Some(event.position.clone());
            fed += 1;
            if fed.is_multiple_of(ROWS_PER_STEP) {
                bar.inc(ROWS_PER_STEP);
                if let Err(e) = step(
                    &mut *projection,
                    keyed.as_ref(),
                    &last,
                    &mut ops,
                    &mut expected,
                ) {
                    failure = Some(e);
                }
            }
        };
        *rows += reader.read(table, &mut visit).await?;
        bar.inc(fed % ROWS_PER_STEP);
        if let Some(reason) = failure {
            return Err(fail(reason));
        }
    }
    step(
        &mut *projection,
        keyed.as_ref(),
        &last,
        &mut ops,
        &mut expected,
    )
    .map_err(fail)?;
    Ok(expected)
}

/// Emits what the projection buffered, applies its operations to `expected` and makes the
/// scratch state durable, [`ROWS_PER_STEP`] documents at a time (the overlay and the operations
/// stay small however many documents are buffered).
fn step(
    projection: &mut dyn refract_projections::Projection,
    keyed: Option<&KeyedState>,
    last: &Option<Position>,
    ops: &mut Vec<WriteOp>,
    expected: &mut Expected,
) -> Result<(), String> {
    loop {
        let emission = match last {
            Some(position) => projection
                .end_transaction(position, ROWS_PER_STEP as usize, ops)
                .map_err(|e| e.to_string())?,
            None => Emission::Done,
        };
        apply_expected(ops, expected);
        if let Some(keyed) = keyed {
            keyed
                .commit(Vec::new(), &Checkpoint::new())
                .map_err(|e| e.to_string())?;
        }
        if emission == Emission::Done {
            return Ok(());
        }
    }
}

/// Applies (and drains) `ops` to `expected`.
fn apply_expected(ops: &mut Vec<WriteOp>, expected: &mut Expected) {
    for op in ops.drain(..) {
        // `verify` compares document read models; other families have nothing to compare.
        let WriteOp::Document(op) = op else { continue };
        match op {
            DocumentOp::Upsert {
                collection,
                key,
                doc,
                ..
            } => {
                expected
                    .entry(collection.to_string())
                    .or_default()
                    .insert(key, Value::from((*doc).clone()));
            }
            DocumentOp::Delete {
                collection, key, ..
            } => {
                if let Some(c) = expected.get_mut(&*collection) {
                    c.remove(&key);
                }
            }
            DocumentOp::Truncate { collection, .. } => {
                expected.remove(&*collection);
            }
        }
    }
}

/// The top-level fields in which two documents differ, as `field: expected …, found …`.
fn differences(want: &Value, got: &Value) -> Vec<String> {
    let short = |v: Option<&Value>| -> String {
        let text = v.map_or_else(|| "(absent)".to_owned(), Value::to_string);
        match text.char_indices().nth(160) {
            Some((cut, _)) => format!("{}…", &text[..cut]),
            None => text,
        }
    };
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            let mut fields: Vec<&String> = w.keys().chain(g.keys()).collect();
            fields.sort();
            fields.dedup();
            fields
                .into_iter()
                .filter(|f| w.get(*f) != g.get(*f))
                .map(|f| {
                    format!(
                        "{f}: expected {}, found {}",
                        short(w.get(f)),
                        short(g.get(f))
                    )
                })
                .collect()
        }
        _ => vec![format!(
            "expected {}, found {}",
            short(Some(want)),
            short(Some(got))
        )],
    }
}
