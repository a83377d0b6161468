//! The declared transform of a migration, compiled against the two tables' columns: a source
//! row to a target row ([`Transform::forward`]) and back ([`Transform::reverse`]).

use std::sync::Arc;

use refract_schemas::config::{MigrationFile, TableShape, TransformKind};
use refract_schemas::{Columns, Row};
use regex_lite::Regex;
use serde_json::Value;

use super::value::{ColumnType, cast, char_limit, shift_decimal, text, within};

/// A value a transform could not convert: never written, reported with the row's key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("column `{column}`: {reason}")]
pub struct ConvertError {
    /// The column whose value failed (a source column forward, a target column in reverse).
    pub column: String,
    /// Why, with the value.
    pub reason: String,
}

/// How one target column is made, as [`Transform::columns`] shows it. Null converts to null
/// under every rule, and is refused where the target column is `NOT NULL`.
#[derive(Debug, Clone, Copy)]
pub struct ColumnRule<'a> {
    /// The target column.
    pub target: &'a str,
    /// Its type.
    pub target_type: ColumnType,
    /// Whether it refuses nulls.
    pub target_not_null: bool,
    /// The source column it is made from.
    pub source: &'a str,
    /// Its type.
    pub source_type: ColumnType,
    /// Whether it holds no nulls.
    pub source_not_null: bool,
    /// How.
    pub rule: RuleKind<'a>,
}

/// The conversion of a [`ColumnRule`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind<'a> {
    /// The value as a value of the target type, exactly ([`cast`]; `copy` is a cast between
    /// types of one kind).
    Cast,
    /// The one capture group of `pattern` (regex-lite syntax) in the value's text, cast to the
    /// target type.
    Extract {
        /// The pattern as the migration file wrote it.
        pattern: &'a str,
    },
    /// The number times 10^`digits`, exactly, cast to the target type.
    Scale {
        /// The power of ten (negative divides).
        digits: i32,
    },
}

/// How one target column is made.
#[derive(Debug)]
struct ColumnMap {
    target: String,
    target_type: ColumnType,
    target_not_null: bool,
    /// The target's length limit (`character varying(n)`, `character(n)`), in characters.
    target_chars: Option<usize>,
    source: String,
    source_type: ColumnType,
    source_not_null: bool,
    /// The source's length limit, for the reverse.
    source_chars: Option<usize>,
    rule: Rule,
}

#[derive(Debug)]
enum Rule {
    Copy,
    Cast,
    Extract { pattern: Regex, reverse: String },
    Scale { digits: i32 },
}

/// A migration's transform, both ways.
#[derive(Debug)]
pub struct Transform {
    /// Target columns, sorted, with their maps (same order).
    target_columns: Columns,
    by_target: Vec<ColumnMap>,
    /// Source columns the reverse writes, sorted, each with its map's index in `by_target`.
    source_columns: Columns,
    by_source: Vec<usize>,
    /// The source's primary key (in key order) and the target columns it maps to: what
    /// identifies a row on both sides.
    source_key: Arc<[String]>,
    identity: Arc<[String]>,
}

impl Transform {
    /// Compiles `file`'s columns against the tables as the catalog describes them; every
    /// problem as (field path, message).
    pub fn new(
        file: &MigrationFile,
        source: &TableShape,
        target: &TableShape,
    ) -> Result<Self, Vec<(String, String)>> {
        let mut problems = Vec::new();
        let mut maps = Vec::new();
        for column in &target.columns {
            if !file.columns.contains_key(&column.name) {
                problems.push((
                    "columns".to_owned(),
                    format!(
                        "declares no transform for column `{}` of `{}`",
                        column.name, target.table
                    ),
                ));
            }
        }
        for (name, spec) in &file.columns {
            let path = format!("columns.{name}");
            let Some(t) = target.column(name) else {
                problems.push((path, format!("`{}` has no column `{name}`", target.table)));
                continue;
            };
            let from = spec.source_column(name);
            let Some(s) = source.column(from) else {
                problems.push((
                    format!("{path}.from"),
                    format!("`{}` has no column `{from}`", source.table),
                ));
                continue;
            };
            let (source_type, target_type) = (
                ColumnType::from_pg(&s.type_name),
                ColumnType::from_pg(&t.type_name),
            );
            let rule = match spec.transform {
                TransformKind::Copy => {
                    if std::mem::discriminant(&source_type) != std::mem::discriminant(&target_type)
                    {
                        problems.push((
                            format!("{path}.transform"),
                            format!(
                                "`copy` needs the same kind of type on both sides, and `{from}` is {} while `{name}` is {}: use `cast`",
                                s.type_name, t.type_name
                            ),
                        ));
                    }
                    Rule::Copy
                }
                TransformKind::Cast => Rule::Cast,
                TransformKind::Extract => {
                    let pattern = spec.pattern.as_deref().unwrap_or_default();
                    match Regex::new(pattern) {
                        Ok(re) if re.captures_len() == 2 => Rule::Extract {
                            pattern: re,
                            reverse: spec.reverse.clone().unwrap_or_default(),
                        },
                        Ok(_) => {
                            problems.push((
                                format!("{path}.pattern"),
                                "must have exactly one capture group".into(),
                            ));
                            continue;
                        }
                        Err(e) => {
                            problems.push((format!("{path}.pattern"), format!("{e}")));
                            continue;
                        }
                    }
                }
                TransformKind::Scale => {
                    if matches!(
                        source_type,
                        ColumnType::Integer { .. } | ColumnType::Numeric { .. }
                    ) && matches!(
                        target_type,
                        ColumnType::Integer { .. } | ColumnType::Numeric { .. }
                    ) {
                        Rule::Scale {
                            digits: spec.scale_digits().unwrap_or(0) as i32,
                        }
                    } else {
                        problems.push((
                            format!("{path}.transform"),
                            "`scale` needs a number on both sides".into(),
                        ));
                        continue;
                    }
                }
            };
            maps.push(ColumnMap {
                target: name.clone(),
                target_type,
                target_not_null: t.not_null,
                target_chars: char_limit(&t.type_name),
                source: from.to_owned(),
                source_type,
                source_not_null: s.not_null,
                source_chars: char_limit(&s.type_name),
                rule,
            });
        }
        let mut identity = Vec::new();
        for key in &source.key {
            match maps
                .iter()
                .find(|m| &m.source == key && matches!(m.rule, Rule::Copy | Rule::Cast))
            {
                Some(m) => identity.push(m.target.clone()),
                None => problems.push((
                    "columns".to_owned(),
                    format!(
                        "no target column copies `{key}` of the primary key of `{}`: rows could not be matched across the tables",
                        source.table
                    ),
                )),
            }
        }
        let mut sources: Vec<&str> = maps.iter().map(|m| m.source.as_str()).collect();
        sources.sort_unstable();
        if let Some(w) = sources.windows(2).find(|w| w[0] == w[1]) {
            problems.push((
                "columns".to_owned(),
                format!(
                    "source column `{}` feeds two target columns: the reverse transform could not choose",
                    w[0]
                ),
            ));
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        maps.sort_by(|a, b| a.target.cmp(&b.target));
        let target_columns: Columns = maps.iter().map(|m| m.target.clone()).collect();
        let source_columns: Columns = maps.iter().map(|m| m.source.clone()).collect();
        let by_source = source_columns
            .names()
            .iter()
            .map(|s| maps.iter().position(|m| &m.source == s).expect("mapped"))
            .collect();
        Ok(Self {
            target_columns,
            by_target: maps,
            source_columns,
            by_source,
            source_key: source.key.clone().into(),
            identity: identity.into(),
        })
    }

    /// The source's primary-key columns, in key order.
    pub fn source_key(&self) -> &Arc<[String]> {
        &self.source_key
    }

    /// The target columns the source's primary key maps to, in the same order.
    pub fn identity(&self) -> &Arc<[String]> {
        &self.identity
    }

    /// The first key column whose map does not keep the order of keys (a cast to another
    /// kind of type, such as text to a number: `'10' < '9'` but `10 > 9`), as (source column,
    /// target column); `None` when reading both tables in key order meets the rows in the same
    /// order, which `verify`'s chunks rely on.
    pub fn key_order_changes(&self) -> Option<(&str, &str)> {
        self.source_key
            .iter()
            .zip(self.identity.iter())
            .map(|(_, target)| self.map_of_target(target))
            .find(|m| {
                std::mem::discriminant(&m.source_type) != std::mem::discriminant(&m.target_type)
            })
            .map(|m| (m.source.as_str(), m.target.as_str()))
    }

    /// The type of target column `name`.
    pub fn target_type(&self, name: &str) -> Option<ColumnType> {
        self.by_target
            .iter()
            .find(|m| m.target == name)
            .map(|m| m.target_type)
    }

    /// The type of source column `name`.
    pub fn source_type(&self, name: &str) -> Option<ColumnType> {
        self.by_target
            .iter()
            .find(|m| m.source == name)
            .map(|m| m.source_type)
    }

    /// The target row of source row `row`.
    pub fn forward(&self, row: &Row) -> Result<Row, ConvertError> {
        let mut values = Vec::with_capacity(self.by_target.len());
        for m in &self.by_target {
            let value = row.get(&m.source).unwrap_or(&Value::Null);
            let converted = m
                .forward(value)
                .and_then(|v| within(v, m.target_chars))
                .map_err(|reason| ConvertError {
                    column: m.source.clone(),
                    reason: format!("{reason} (into `{}`)", m.target),
                })?;
            if converted.is_null() && m.target_not_null {
                return Err(ConvertError {
                    column: m.source.clone(),
                    reason: format!("null, and `{}` refuses nulls", m.target),
                });
            }
            values.push(converted);
        }
        Ok(Row::from_columns(self.target_columns.clone(), values))
    }

    /// The source row of target row `row` (the reverse transforms).
    pub fn reverse(&self, row: &Row) -> Result<Row, ConvertError> {
        let mut values = Vec::with_capacity(self.by_source.len());
        for &i in &self.by_source {
            let m = &self.by_target[i];
            let value = row.get(&m.target).unwrap_or(&Value::Null);
            let converted = m
                .reverse(value)
                .and_then(|v| within(v, m.source_chars))
                .map_err(|reason| ConvertError {
                    column: m.target.clone(),
                    reason: format!("{reason} (back into `{}`)", m.source),
                })?;
            if converted.is_null() && m.source_not_null {
                return Err(ConvertError {
                    column: m.target.clone(),
                    reason: format!("null, and `{}` refuses nulls", m.source),
                });
            }
            values.push(converted);
        }
        Ok(Row::from_columns(self.source_columns.clone(), values))
    }

    /// The target identity (column, value) pairs of a source key image (`key` holds at least
    /// the source key columns).
    pub fn forward_key(&self, key: &Row) -> Result<Row, ConvertError> {
        let mut out = Row::new();
        for (source, target) in self.source_key.iter().zip(self.identity.iter()) {
            let m = self.map_of_target(target);
            let value = key.get(source).unwrap_or(&Value::Null);
            out.insert(
                target.clone(),
                m.forward(value).map_err(|reason| ConvertError {
                    column: source.clone(),
                    reason,
                })?,
            );
        }
        Ok(out)
    }

    /// The source key of a target identity image (`key` holds at least the identity columns).
    pub fn reverse_key(&self, key: &Row) -> Result<Row, ConvertError> {
        let mut out = Row::new();
        for (source, target) in self.source_key.iter().zip(self.identity.iter()) {
            let m = self.map_of_target(target);
            let value = key.get(target).unwrap_or(&Value::Null);
            out.insert(
                source.clone(),
                m.reverse(value).map_err(|reason| ConvertError {
                    column: target.clone(),
                    reason,
                })?,
            );
        }
        Ok(out)
    }

    /// Each target column and how it is made, in target column order: what a database that
    /// converts rows itself (the backfill's in-database copy) needs to know.
    pub fn columns(&self) -> impl Iterator<Item = ColumnRule<'_>> {
        self.by_target.iter().map(|m| ColumnRule {
            target: &m.target,
            target_type: m.target_type,
            target_not_null: m.target_not_null,
            source: &m.source,
            source_type: m.source_type,
            source_not_null: m.source_not_null,
            rule: match &m.rule {
                Rule::Copy | Rule::Cast => RuleKind::Cast,
                Rule::Extract { pattern, .. } => RuleKind::Extract {
                    pattern: pattern.as_str(),
                },
                Rule::Scale { digits } => RuleKind::Scale { digits: *digits },
            },
        })
    }

    fn map_of_target(&self, target: &str) -> &ColumnMap {
        self.by_target
            .iter()
            .find(|m| m.target == target)
            .expect("identity columns are mapped")
    }
}

impl ColumnMap {
    fn forward(&self, value: &Value) -> Result<Value, String> {
        if value.is_null() {
            return Ok(Value::Null);
        }
        match &self.rule {
            Rule::Copy | Rule::Cast => cast(value, self.source_type, self.target_type),
            Rule::Extract { pattern, .. } => {
                let text = text(value);
                let group = pattern
                    .captures(&text)
                    .and_then(|c| c.get(1))
                    .ok_or_else(|| format!("`{text}` does not match `{}`", pattern.as_str()))?;
                cast(
                    &Value::String(group.as_str().to_owned()),
                    ColumnType::Text,
                    self.target_type,
                )
            }
            Rule::Scale { digits } => {
                let shifted = shift_decimal(&text(value), *digits)?;
                cast(
                    &Value::String(shifted),
                    ColumnType::Numeric { scale: None },
                    self.target_type,
                )
            }
        }
    }

    fn reverse(&self, value: &Value) -> Result<Value, String> {
        if value.is_null() {
            return Ok(Value::Null);
        }
        match &self.rule {
            Rule::Copy | Rule::Cast => cast(value, self.target_type, self.source_type),
            Rule::Extract { reverse, pattern } => {
                let rebuilt = reverse.replacen("{}", &text(value), 1);
                if !pattern.is_match(&rebuilt) {
                    return Err(format!(
                        "`{rebuilt}` (the reverse of {value}) does not match `{}` again",
                        pattern.as_str()
                    ));
                }
                cast(&Value::String(rebuilt), ColumnType::Text, self.source_type)
            }
            Rule::Scale { digits } => {
                let shifted = shift_decimal(&text(value), -*digits)?;
                cast(
                    &Value::String(shifted),
                    ColumnType::Numeric { scale: None },
                    self.source_type,
                )
            }
        }
    }
}
