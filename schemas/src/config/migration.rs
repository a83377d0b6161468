//! Migration files: a shadow-write migration of one PostgreSQL table into a new one (seed 003
//! §5.2), as `refract migrate MIGRATION.toml PHASE` runs it.
//!
//! Same conventions as pipeline files: TOML, `${VAR:-default}` in string values, unknown fields
//! refused, every error with its file, line and field path. `[migration]` names the two tables and
//! the settings; `[columns.NAME]` declares, for each column of the target table, the source
//! column it comes from and the transform on the way (and so the reverse transform a rollback
//! writes back with).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::SecretUrl;

/// Rows per backfill and verify chunk when the file does not say: the seed's batch of 1,000, one
/// short transaction each, so that no lock is held for long.
pub const DEFAULT_MIGRATION_BATCH_ROWS: u32 = 1_000;
/// The control table when the file does not say.
pub const DEFAULT_CONTROL_TABLE: &str = "refract_migrations";
/// The largest power of ten a `scale` transform may use: 10^18 still fits a bigint's 19 digits.
const MAX_SCALE_DIGITS: u32 = 18;

/// A migration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationFile {
    /// The migration as a whole.
    pub migration: MigrationSection,
    /// Every column of the target table, by name, with where its value comes from.
    pub columns: BTreeMap<String, ColumnSpec>,
}

/// The `[migration]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationSection {
    /// Names the migration: its control-table row, state directory, slot and publication.
    /// Letters, digits, `-` and `_`.
    pub name: String,
    /// The database holding both tables and the control table (`${PG_URL}`). The role needs
    /// REPLICATION, SELECT and DML on both tables, and CREATE on the database the first time.
    pub url: SecretUrl,
    /// The table applications write today (`orders` or `schema.orders`).
    pub source: String,
    /// The table the rows move to (`orders_v2`); it must exist, created by the operator.
    pub target: String,
    /// Directory for the migration's checkpoint and state (`${STATE_DIR:-./state}`).
    #[serde(default = "default_state_dir")]
    pub state_dir: String,
    /// Replication slot of the dual write; default `refract_migrate_{name}`.
    #[serde(default)]
    pub slot: Option<String>,
    /// The control table (created when missing) that applications and operators read:
    /// `phase`, `read_from`, positions and timestamps, one row per migration.
    #[serde(default = "default_control_table")]
    pub control_table: String,
    /// Rows per backfill and verify chunk (100 to 100,000).
    #[serde(default = "default_batch_rows")]
    pub batch_rows: u32,
    /// Throttle of the backfill in rows per second; none when unset.
    #[serde(default)]
    pub max_rows_per_second: Option<u32>,
    /// Serve the dual write's Prometheus metrics and `/health` at this address
    /// (`127.0.0.1:9464`) while `start` runs; none when unset.
    #[serde(default)]
    pub metrics_addr: Option<String>,
}

fn default_state_dir() -> String {
    "./state".into()
}
fn default_control_table() -> String {
    DEFAULT_CONTROL_TABLE.into()
}
fn default_batch_rows() -> u32 {
    DEFAULT_MIGRATION_BATCH_ROWS
}

/// One target column: where its value comes from and how it is converted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ColumnSpec {
    /// The source column (default: the target column's own name; another name is a rename).
    #[serde(default)]
    pub from: Option<String>,
    /// The conversion.
    #[serde(default)]
    pub transform: TransformKind,
    /// `extract`: a regular expression with one capture group, matched against the whole
    /// source value (`'^U(\d+)$'`); the group is the target value.
    #[serde(default)]
    pub pattern: Option<String>,
    /// `extract`: the source value rebuilt from the target value, `{}` standing for it
    /// (`"U{}"`); what a rollback writes back.
    #[serde(default)]
    pub reverse: Option<String>,
    /// `scale`: the power of ten the source value is multiplied by (`100`: 12.34 -> 1234); the
    /// result must be exact in the target type, and the reverse divides.
    #[serde(default)]
    pub factor: Option<u64>,
}

/// How a source value becomes a target value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TransformKind {
    /// The value as it is (the types must agree: equal, or both text, or both integers).
    #[default]
    Copy,
    /// The value converted to the target column's type, exactly (`'42'` -> `42`, `12.00` ->
    /// `12`; `12.5` into an integer is refused), and back to the source type on the reverse.
    Cast,
    /// The capture group of `pattern`, cast to the target type; the reverse fills `reverse`.
    Extract,
    /// The numeric value times `factor`, exact; the reverse divides.
    Scale,
}

impl TransformKind {
    /// The name as written in files.
    pub fn name(self) -> &'static str {
        match self {
            TransformKind::Copy => "copy",
            TransformKind::Cast => "cast",
            TransformKind::Extract => "extract",
            TransformKind::Scale => "scale",
        }
    }
}

impl ColumnSpec {
    /// The source column of target column `target`.
    pub fn source_column<'a>(&'a self, target: &'a str) -> &'a str {
        self.from.as_deref().unwrap_or(target)
    }

    /// The number of decimal digits `factor` shifts by (`100` -> 2), once validated.
    pub fn scale_digits(&self) -> Option<u32> {
        let factor = self.factor?;
        let digits = factor.checked_ilog10()?;
        (10u64.checked_pow(digits) == Some(factor) && digits >= 1).then_some(digits)
    }
}

impl MigrationFile {
    /// The replication slot of the dual write.
    pub fn slot(&self) -> String {
        self.migration
            .slot
            .clone()
            .unwrap_or_else(|| format!("refract_migrate_{}", self.migration.name))
    }

    /// The dual write's publication: named as its slot.
    pub fn publication(&self) -> String {
        self.slot()
    }

    /// Every semantic problem, as (field path, message); empty when the file is usable. The
    /// rules that need the database (columns exist, types agree) are checked by `migrate` and
    /// `plan` against the live catalog.
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        let m = &self.migration;
        let mut say = |path: &str, message: String| problems.push((path.to_owned(), message));
        if m.name.is_empty()
            || !m
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            say(
                "migration.name",
                "must be letters, digits, `-` and `_` (it names a slot and a directory)".into(),
            );
        }
        if let Err(e) = super::pg_tls::split_tls(m.url.expose()) {
            say("migration.url", e.to_string());
        }
        if m.source == m.target {
            say(
                "migration.target",
                "must be another table than `migration.source`".into(),
            );
        }
        if !(100..=100_000).contains(&m.batch_rows) {
            say(
                "migration.batch_rows",
                "must be between 100 and 100000".into(),
            );
        }
        if m.max_rows_per_second == Some(0) {
            say(
                "migration.max_rows_per_second",
                "must be at least 1 (leave it out for no throttle)".into(),
            );
        }
        if self.columns.is_empty() {
            say(
                "columns",
                "must declare every column of the target table".into(),
            );
        }
        for (name, spec) in &self.columns {
            let path = |field: &str| format!("columns.{name}.{field}");
            let kind = spec.transform;
            let allowed = |field: &str, present: bool, wanted: bool| -> Option<(String, String)> {
                match (present, wanted) {
                    (true, false) => Some((
                        path(field),
                        format!("is not used by transform `{}`", kind.name()),
                    )),
                    (false, true) => Some((
                        path(field),
                        format!("is required by transform `{}`", kind.name()),
                    )),
                    _ => None,
                }
            };
            let extract = kind == TransformKind::Extract;
            let scale = kind == TransformKind::Scale;
            problems.extend(allowed("pattern", spec.pattern.is_some(), extract));
            problems.extend(allowed("reverse", spec.reverse.is_some(), extract));
            problems.extend(allowed("factor", spec.factor.is_some(), scale));
            if let Some(reverse) = &spec.reverse
                && reverse.matches("{}").count() != 1
            {
                problems.push((
                    path("reverse"),
                    "must hold `{}` exactly once (where the target value goes)".into(),
                ));
            }
            if scale
                && spec.factor.is_some()
                && spec.scale_digits().is_none_or(|d| d > MAX_SCALE_DIGITS)
            {
                problems.push((
                    path("factor"),
                    format!("must be a power of ten from 10 to 10^{MAX_SCALE_DIGITS}"),
                ));
            }
        }
        problems
    }
}

/// A table as the migration found it in the catalog: what the transforms convert between.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TableShape {
    /// The table as the migration file names it.
    pub table: String,
    /// Primary-key columns, in key order.
    pub key: Vec<String>,
    /// Every column, in table order.
    pub columns: Vec<ColumnShape>,
}

/// One column of a [`TableShape`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ColumnShape {
    /// The column name.
    pub name: String,
    /// The type as `format_type` prints it (`numeric(12,2)`, `bigint`, `text`).
    pub type_name: String,
    /// Whether the column refuses nulls.
    pub not_null: bool,
}

impl TableShape {
    /// The column called `name`.
    pub fn column(&self, name: &str) -> Option<&ColumnShape> {
        self.columns.iter().find(|c| c.name == name)
    }
}

/// `kind = "migration"` projection: the dual write of `refract migrate` (which writes this
/// section itself, from the migration file and the catalog): changes of the source table become
/// rows of the target through the transforms, and after the cut-over changes of the target go
/// back to the source through the reverse transforms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationProjectionConfig {
    /// The migration.
    pub migration: MigrationFile,
    /// The source table as found in the catalog.
    pub source_shape: TableShape,
    /// The target table as found in the catalog.
    pub target_shape: TableShape,
    /// The `migration` sink (exactly one).
    pub sinks: Vec<String>,
}

/// `kind = "migration"` sink: applies migration rows to the database of both tables, one
/// source transaction per target transaction, and keeps the control table's row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationSinkConfig {
    /// The database (the migration's `url`).
    pub url: SecretUrl,
    /// The migration's name (its control-table row).
    pub migration: String,
    /// The control table.
    #[serde(default = "default_control_table")]
    pub control_table: String,
}

/// Whether TOML `text` is a migration file (it has a `[migration]` table) rather than a
/// pipeline file: `refract validate` and `plan` take both.
pub fn is_migration_text(text: &str) -> bool {
    text.parse::<toml::Table>()
        .is_ok_and(|t| t.contains_key("migration"))
}
