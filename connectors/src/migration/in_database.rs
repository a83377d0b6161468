//! The backfill's transform written in SQL, so that PostgreSQL converts and copies a chunk's
//! rows itself (`INSERT INTO target SELECT <transform> FROM source …`), as the same-server copy
//! does, instead of sending each row to refract and back.
//!
//! It is only ever a shortcut for [`Transform::forward`], never a second definition of it. Each
//! column gives an expression and a condition ("sure") under which the expression's value is
//! exactly what `forward` gives; a row is converted in the database only when every column is
//! sure of it. Every other row (a value out of range, a pattern that does not match, a null the
//! target refuses) goes to refract, where `forward` converts it or rejects it with its reason.
//! So a condition may be stricter than needed, never looser. Where a rule has no such
//! condition here (a cast between kinds of types, a pattern outside the subset below), the
//! whole backfill converts in refract ([`InDatabase::compile`] says why).
//!
//! An `extract` pattern is converted when it is `^` literal characters, one group of digits
//! (`\d` or `[0-9]`, with a quantifier), literal characters, `$`: such a pattern matches a text
//! in one way only (the group is what lies between the fixed prefix and suffix), so string
//! functions say exactly what regex-lite finds, without a second regex engine.

use refract_projections::migration::value::ColumnType;
use refract_projections::migration::{ColumnRule, RuleKind, Transform};

use super::catalog::Table;
use crate::pg_sql::quote_ident;

/// The digits of a group: ASCII only, as regex-lite's `\d` (and `[0-9]`) match.
const DIGITS: &str = "0123456789";

/// The most digits a group may have for PostgreSQL to turn it into a `bigint` without the
/// chance of an overflow error (i64's largest value has 19).
const SURE_INTEGER_DIGITS: usize = 18;

/// A transform compiled to SQL over a source row's columns (unqualified, as in
/// `SELECT … FROM source`).
#[derive(Debug, Clone)]
pub struct InDatabase {
    /// Per target column (by name), its value.
    values: Vec<(String, String)>,
    /// True exactly when every value is what [`Transform::forward`] gives (never null).
    sure: String,
}

impl InDatabase {
    /// The transform in SQL for these two tables, or why it cannot be.
    pub fn compile(transform: &Transform, source: &Table, target: &Table) -> Result<Self, String> {
        let mut values = Vec::new();
        let mut sure = Vec::new();
        for c in transform.columns() {
            let source_name = source.type_name(c.source).unwrap_or("text");
            let target_name = target.type_name(c.target).unwrap_or("text");
            let (value, condition) = column(&c, source_name, target_name)?;
            if c.target_not_null && !c.source_not_null {
                sure.push(format!("{} IS NOT NULL", quote_ident(c.source)));
            }
            sure.extend(condition);
            values.push((c.target.to_owned(), value));
        }
        let sure = if sure.is_empty() {
            "true".to_owned()
        } else {
            // A condition over a null is null: not sure.
            format!("coalesce(({}), false)", sure.join(") AND ("))
        };
        Ok(Self { values, sure })
    }

    /// The values of target columns `columns`, in that order, as a select list; `None` when
    /// one of them is not a column of the transform.
    pub fn values_of(&self, columns: &[String]) -> Option<String> {
        let values = columns
            .iter()
            .map(|c| {
                self.values
                    .iter()
                    .find(|(n, _)| n == c)
                    .map(|(_, v)| v.as_str())
            })
            .collect::<Option<Vec<_>>>()?;
        Some(values.join(", "))
    }

    /// The condition under which the whole row is converted in the database.
    pub fn sure(&self) -> &str {
        &self.sure
    }
}

/// The value of one target column and the condition it is sure under (`None`: always, nulls
/// aside), or why it cannot be written in SQL.
fn column(
    c: &ColumnRule<'_>,
    source_name: &str,
    target_name: &str,
) -> Result<(String, Option<String>), String> {
    let col = quote_ident(c.source);
    let refuse = |what: &str| {
        Err(format!(
            "`{}` ({source_name}) into `{}` ({target_name}): {what}",
            c.source, c.target
        ))
    };
    match c.rule {
        RuleKind::Cast => match (c.source_type, c.target_type) {
            _ if source_name == target_name => Ok((col, None)),
            (ColumnType::Integer { .. }, ColumnType::Integer { max }) => {
                Ok((col.clone(), Some(in_range(&col, max))))
            }
            (ColumnType::Numeric { .. }, ColumnType::Numeric { scale }) => Ok((
                col.clone(),
                scale.map(|s| format!("{col} = trunc({col}, {s})")),
            )),
            (ColumnType::Integer { .. }, ColumnType::Numeric { .. }) => {
                Ok((format!("{col}::numeric"), None))
            }
            (ColumnType::Numeric { .. }, ColumnType::Integer { max }) => Ok((
                col.clone(),
                Some(format!("{col} = trunc({col}) AND {}", in_range(&col, max))),
            )),
            (ColumnType::Text, ColumnType::Text) if plain_text(target_name) => {
                Ok((format!("{col}::text"), None))
            }
            _ => refuse("no exact cast in SQL for these types"),
        },
        RuleKind::Extract { pattern } => {
            if c.source_type != ColumnType::Text {
                return refuse("extract from a column that is not text");
            }
            let Some(p) = Pattern::parse(pattern) else {
                return refuse(&format!(
                    "the pattern `{pattern}` is not `^`literal`(\\d<quantifier>)`literal`$`"
                ));
            };
            match c.target_type {
                ColumnType::Integer { max } => {
                    // An empty group is no integer, and a group of more than
                    // SURE_INTEGER_DIGITS digits might not fit: refract decides those.
                    let most = p.most.map_or(SURE_INTEGER_DIGITS as u32, |m| {
                        m.min(SURE_INTEGER_DIGITS as u32)
                    });
                    let (group, shape) = p.sql(&col, p.least.max(1), Some(most));
                    let fits = (max < i64::MAX).then(|| in_range(&format!("{group}::bigint"), max));
                    Ok((format!("{group}::bigint"), Some(all_of(shape, fits))))
                }
                ColumnType::Text if plain_text(target_name) => {
                    let (group, shape) = p.sql(&col, p.least, p.most);
                    Ok((group, Some(all_of(shape, None))))
                }
                _ => refuse("extract into a type other than an integer or text"),
            }
        }
        RuleKind::Scale { digits } => {
            let source = match c.source_type {
                ColumnType::Integer { max } => Bounds::integer(max),
                ColumnType::Numeric { .. } => Bounds::numeric(source_name),
                _ => return refuse("scale of a value that is not a number"),
            };
            let scaled = format!(
                "({col}::numeric * {}::numeric)",
                sql_text(&format!("1e{digits}"))
            );
            let source = source.scaled(digits);
            match c.target_type {
                ColumnType::Integer { max } => {
                    let mut sure = Vec::new();
                    if source.scale != Some(0) {
                        sure.push(format!("{scaled} = trunc({scaled})"));
                    }
                    if !source.within(max) {
                        sure.push(in_range(&scaled, max));
                    }
                    Ok((scaled, (!sure.is_empty()).then(|| sure.join(" AND "))))
                }
                // Without trailing zeros, as `forward` writes a shifted decimal.
                ColumnType::Numeric { scale } => Ok((
                    format!("trim_scale({scaled})"),
                    scale
                        .filter(|&t| source.scale.is_none_or(|s| s > i64::from(t)))
                        .map(|t| format!("{scaled} = trunc({scaled}, {t})")),
                )),
                _ => refuse("scale into a type that is not a number"),
            }
        }
    }
}

/// `CASE WHEN` each condition in turn: a later one (a cast) is evaluated only where the ones
/// before it hold, which `AND` does not promise.
fn all_of(first: Vec<String>, last: Option<String>) -> String {
    let mut conditions = first;
    conditions.extend(last);
    let mut sql = "true".to_owned();
    for c in conditions.iter().rev() {
        sql = format!("CASE WHEN {c} THEN {sql} ELSE false END");
    }
    sql
}

/// What the values of a number column can be, as far as its type says.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    /// Digits after the point, at most (`None`: unknown).
    scale: Option<i64>,
    /// The largest magnitude (`None`: unknown or beyond i128).
    largest: Option<i128>,
}

impl Bounds {
    fn integer(max: i64) -> Self {
        Self {
            scale: Some(0),
            largest: Some(i128::from(max) + 1),
        }
    }

    /// A `numeric(p, s)` column: at most `s` digits after the point, under 10^(p-s).
    fn numeric(type_name: &str) -> Self {
        let shape = type_name
            .split_once('(')
            .and_then(|(_, rest)| rest.strip_suffix(')'))
            .map(|inside| inside.split(',').map(|n| n.trim().parse::<i64>().ok()));
        let Some(mut numbers) = shape else {
            return Self {
                scale: None,
                largest: None,
            };
        };
        let precision = numbers.next().flatten();
        let scale = numbers.next().flatten().unwrap_or(0);
        Self {
            scale: Some(scale),
            largest: precision.and_then(|p| power_of_ten(p - scale)),
        }
    }

    /// The bounds of the values times 10^`digits`.
    fn scaled(self, digits: i32) -> Self {
        let digits = i64::from(digits);
        Self {
            scale: self.scale.map(|s| (s - digits).max(0)),
            largest: self
                .largest
                .zip(power_of_ten(digits))
                .and_then(|(l, p)| l.checked_mul(p)),
        }
    }

    /// Whether every value fits an integer type whose largest value is `max`.
    fn within(self, max: i64) -> bool {
        self.largest.is_some_and(|l| l <= i128::from(max))
    }
}

/// 10^`n`, for 0 <= `n` and while it fits.
fn power_of_ten(n: i64) -> Option<i128> {
    10i128.checked_pow(u32::try_from(n).ok()?)
}

/// `expr BETWEEN` the smallest and the largest value of an integer type whose largest is `max`.
fn in_range(expr: &str, max: i64) -> String {
    format!("{expr} BETWEEN {} AND {max}", -max - 1)
}

/// Whether a text column of this type takes any text as it is: no length to cut values to,
/// no other type behind it.
fn plain_text(type_name: &str) -> bool {
    matches!(type_name, "text" | "character varying")
}

/// `text` as an SQL string literal, the same whatever `standard_conforming_strings` says.
fn sql_text(text: &str) -> String {
    format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

/// An `extract` pattern of the subset that matches in one way only (see the module's text).
#[derive(Debug, PartialEq, Eq)]
struct Pattern {
    prefix: String,
    /// The group's least and most digits (`None`: no limit).
    least: u32,
    most: Option<u32>,
    suffix: String,
}

impl Pattern {
    /// The pattern, when it is in the subset.
    fn parse(pattern: &str) -> Option<Self> {
        let body = pattern.strip_prefix('^')?.strip_suffix('$')?;
        let mut chars = body.chars().peekable();
        let prefix = literals(&mut chars);
        if chars.next()? != '(' {
            return None;
        }
        let class: String = chars.by_ref().take(2).collect();
        match class.as_str() {
            "\\d" => {}
            "[0" => {
                if chars.by_ref().take(3).collect::<String>() != "-9]" {
                    return None;
                }
            }
            _ => return None,
        }
        let (least, most) = match chars.next()? {
            '+' => (1, None),
            '*' => (0, None),
            '?' => (0, Some(1)),
            '{' => {
                let inside: String = chars.by_ref().take_while(|&c| c != '}').collect();
                match inside.split_once(',') {
                    None => {
                        let n = inside.parse().ok()?;
                        (n, Some(n))
                    }
                    Some((a, "")) => (a.parse().ok()?, None),
                    Some((a, b)) => (a.parse().ok()?, Some(b.parse().ok()?)),
                }
            }
            _ => return None,
        };
        if chars.next()? != ')' {
            return None;
        }
        let suffix = literals(&mut chars);
        // Anything left (an escaped `$`'s backslash, say: then `$` was no anchor) is outside.
        if chars.next().is_some() || most.is_some_and(|m| m < least) {
            return None;
        }
        Some(Self {
            prefix,
            least,
            most,
            suffix,
        })
    }

    /// The group of `col` (its text) in SQL, and the conditions under which the pattern
    /// matches with a group of `least` to `most` digits, in the order they may be evaluated:
    /// no regular expression (slower, and a second engine's rules to trust), only the fixed
    /// prefix and suffix and the digits between them.
    fn sql(&self, col: &str, least: u32, most: Option<u32>) -> (String, Vec<String>) {
        let text = format!("{col}::text");
        let (p, s) = (self.prefix.len(), self.suffix.len());
        let fixed = p + s;
        let group = format!("substr({text}, {}, length({text}) - {fixed})", p + 1);
        let length = match most {
            Some(most) => format!(
                "length({text}) BETWEEN {} AND {}",
                fixed + least as usize,
                fixed + most as usize
            ),
            None => format!("length({text}) >= {}", fixed + least as usize),
        };
        let mut shape = Vec::new();
        if p > 0 {
            shape.push(format!("left({text}, {p}) = {}", sql_text(&self.prefix)));
        }
        if s > 0 {
            shape.push(format!("right({text}, {s}) = {}", sql_text(&self.suffix)));
        }
        shape.push(format!("ltrim({group}, {}) = ''", sql_text(DIGITS)));
        (group, vec![length, shape.join(" AND ")])
    }
}

/// The literal characters at the front of `chars`: ASCII letters and digits, a few
/// punctuation characters that are no regex syntax, and any ASCII punctuation escaped with
/// `\`. Stops before anything else.
fn literals(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> String {
    let mut out = String::new();
    loop {
        match chars.peek().copied() {
            Some(c) if c.is_ascii_alphanumeric() || "-_:/#@=,;!%&~ '\"<>".contains(c) => {
                out.push(c);
                chars.next();
            }
            Some('\\') => {
                let mut ahead = chars.clone();
                ahead.next();
                match ahead.next() {
                    Some(e) if e.is_ascii_punctuation() => {
                        out.push(e);
                        chars.next();
                        chars.next();
                    }
                    _ => return out,
                }
            }
            _ => return out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_of_the_subset_are_read_and_written_for_postgresql() {
        let p = Pattern::parse(r"^U(\d+)$").unwrap();
        assert_eq!(
            p,
            Pattern {
                prefix: "U".into(),
                least: 1,
                most: None,
                suffix: String::new()
            }
        );
        let (group, conditions) = p.sql("\"c\"", 1, Some(18));
        assert_eq!(group, r#"substr("c"::text, 2, length("c"::text) - 1)"#);
        assert_eq!(
            conditions,
            [
                r#"length("c"::text) BETWEEN 2 AND 19"#,
                r#"left("c"::text, 1) = E'U' AND ltrim(substr("c"::text, 2, length("c"::text) - 1), E'0123456789') = ''"#
            ]
        );
        let p = Pattern::parse(r"^ORD\-([0-9]{4,8})\.v1$").unwrap();
        assert_eq!((p.prefix.as_str(), p.suffix.as_str()), ("ORD-", ".v1"));
        assert_eq!((p.least, p.most), (4, Some(8)));
        let (group, conditions) = p.sql("c", p.least, p.most);
        assert_eq!(group, "substr(c::text, 5, length(c::text) - 7)");
        assert_eq!(conditions[0], "length(c::text) BETWEEN 11 AND 15");
        assert!(conditions[1].contains("right(c::text, 3) = E'.v1'"));
        assert_eq!(Pattern::parse(r"^(\d{3})$").unwrap().most, Some(3));
        assert_eq!(Pattern::parse(r"^(\d*)x$").unwrap().least, 0);
    }

    #[test]
    fn patterns_outside_the_subset_are_refused() {
        for p in [
            r"U(\d+)$",         // not anchored at the start
            r"^U(\d+)",         // nor at the end
            r"^U(\d+)\$",       // `$` escaped: a literal, no anchor
            r"^U(\w+)$",        // not digits
            r"^U(\d)$",         // no quantifier
            r"^U(\d+)(\d)$",    // two groups
            r"^U+(\d+)$",       // a quantified literal
            r"^U(\d{5,2})$",    // an empty range
            r"^U(?:x)(\d+)$",   // other syntax
            r"^[UV](\d+)$",     // a class outside the group
            r"^U(\d+)|V(\d+)$", // alternation
        ] {
            assert_eq!(Pattern::parse(p), None, "{p}");
        }
    }

    #[test]
    fn a_scale_needs_no_condition_only_where_the_column_type_rules_out_a_failure() {
        // numeric(12,2) in cents: whole numbers under 10^12, so any bigint holds them.
        let cents = Bounds::numeric("numeric(12,2)").scaled(2);
        assert_eq!(cents.scale, Some(0));
        assert!(cents.within(i64::MAX));
        assert!(!cents.within(i32::MAX.into()));
        // numeric(12,4) in cents keeps two digits after the point.
        assert_eq!(Bounds::numeric("numeric(12,4)").scaled(2).scale, Some(2));
        // An unconstrained numeric, a division, a bigint times 100: anything can happen.
        assert!(!Bounds::numeric("numeric").scaled(2).within(i64::MAX));
        assert_eq!(Bounds::integer(i64::MAX).scaled(-2).scale, Some(2));
        assert!(!Bounds::integer(i64::MAX).scaled(2).within(i64::MAX));
        assert!(Bounds::integer(i32::MAX.into()).scaled(2).within(i64::MAX));
    }

    #[test]
    fn sql_text_survives_either_setting_of_standard_conforming_strings() {
        assert_eq!(sql_text(r"^a\.b'c$"), r"E'^a\\.b''c$'");
    }
}
