//! The rules of a `flatten` projection: the source table, then each output table (its name, the
//! array it explodes, its columns, its key, its unmapped fields).

use std::collections::BTreeSet;

use super::range;
use crate::config::{
    FlatColumnConfig, FlatOutputConfig, FlattenProjectionConfig, UnmappedConfig, UnmappedMode,
};
use crate::field_path::{FieldPath, Step};

/// Checks a `flatten` projection at `base` (`projections.NAME`).
pub(super) fn validate(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    f: &FlattenProjectionConfig,
) {
    if f.table.is_empty() {
        problem(
            &format!("{base}.table"),
            "must name the source table".into(),
        );
    }
    if f.outputs.is_empty() {
        problem(
            &format!("{base}.outputs"),
            "must declare at least one table".into(),
        );
    }
    range(
        problem,
        &format!("{base}.max_columns"),
        f.max_columns as u64,
        1,
        10_000,
    );
    let mut names = BTreeSet::new();
    for (t, out) in f.outputs.iter().enumerate() {
        output(
            problem,
            &format!("{base}.outputs[{t}]"),
            out,
            f.max_columns,
            &mut names,
        );
    }
}

/// One output table at `at` (`projections.NAME.outputs[i]`); `names` holds the names of the
/// tables before it.
fn output<'a>(
    problem: &mut impl FnMut(&str, String),
    at: &str,
    out: &'a FlatOutputConfig,
    max_columns: usize,
    names: &mut BTreeSet<&'a str>,
) {
    output_name(problem, at, &out.name, names);
    // The path of each element of the exploded array.
    let element = explode(problem, at, out.explode.as_deref()).map(|mut path| {
        path.steps.push(Step::Each);
        path
    });
    let (columns, parent_key) = columns(problem, at, out, max_columns, element.as_ref());
    key(problem, at, &out.key, &columns);
    if element.is_some() && !parent_key {
        problem(
            &format!("{at}.key"),
            "an exploded table's key must include a column taken from outside the array (the parent's key)".into(),
        );
    }
    if let Some(u) = &out.unmapped {
        unmapped(problem, at, u, &columns);
    }
}

/// A table name usable as a directory, declared once.
fn output_name<'a>(
    problem: &mut impl FnMut(&str, String),
    at: &str,
    name: &'a str,
    names: &mut BTreeSet<&'a str>,
) {
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with(['.', '_']) {
        problem(
            &format!("{at}.name"),
            format!("`{name}` must be non-empty, contain no `/` and not start with `.` or `_`"),
        );
    } else if !names.insert(name) {
        problem(
            &format!("{at}.name"),
            format!("table `{name}` is declared twice"),
        );
    }
}

/// The array a table explodes, one path without `[]`; `None` when there is none or it is wrong.
fn explode(
    problem: &mut impl FnMut(&str, String),
    at: &str,
    explode: Option<&str>,
) -> Option<FieldPath> {
    let e = explode?;
    let path = field_path(problem, &format!("{at}.explode"), e)?;
    if path.has_each() {
        problem(
            &format!("{at}.explode"),
            format!("`{e}` must name one array, without `[]`"),
        );
        return None;
    }
    Some(path)
}

/// The columns of a table: at least one and at most `max_columns`, each named once with one
/// source. Returns the declared names, and whether a key column is taken from outside the
/// exploded array (`element`).
fn columns<'a>(
    problem: &mut impl FnMut(&str, String),
    at: &str,
    out: &'a FlatOutputConfig,
    max_columns: usize,
    element: Option<&FieldPath>,
) -> (BTreeSet<&'a str>, bool) {
    if out.columns.is_empty() {
        problem(
            &format!("{at}.columns"),
            "must declare at least one column".into(),
        );
    }
    if out.columns.len() > max_columns {
        problem(
            &format!("{at}.columns"),
            format!(
                "{} columns exceed max_columns = {max_columns}",
                out.columns.len()
            ),
        );
    }
    let mut columns = BTreeSet::new();
    let mut parent_key = false;
    for (c, col) in out.columns.iter().enumerate() {
        let cat = format!("{at}.columns[{c}]");
        if col.name.is_empty() || col.name.starts_with('_') {
            problem(
                &format!("{cat}.name"),
                format!(
                    "`{}` must be non-empty and not start with `_` (refract's own columns do)",
                    col.name
                ),
            );
        } else if !columns.insert(col.name.as_str()) {
            problem(
                &format!("{cat}.name"),
                format!("column `{}` is declared twice", col.name),
            );
        }
        let outside = column_source(problem, &cat, col, element);
        if outside && out.key.contains(&col.name) {
            parent_key = true;
        }
    }
    (columns, parent_key)
}

/// Where a column's value comes from: exactly one of a path, a count or the line number (in an
/// exploded table only), each path parsing. Returns whether the value is taken from outside the
/// exploded array (`element`).
fn column_source(
    problem: &mut impl FnMut(&str, String),
    cat: &str,
    col: &FlatColumnConfig,
    element: Option<&FieldPath>,
) -> bool {
    let sources = usize::from(col.path.is_some())
        + usize::from(col.count.is_some())
        + usize::from(col.line_no);
    if sources != 1 {
        problem(
            cat,
            "must have exactly one of `path`, `count` or `line_no = true`".into(),
        );
    }
    if col.line_no && element.is_none() {
        problem(
            &format!("{cat}.line_no"),
            "only applies to a table with `explode`".into(),
        );
    }
    let mut outside = col.count.is_some();
    if let Some(text) = &col.path {
        if let Some(path) = field_path(problem, &format!("{cat}.path"), text) {
            outside = element.is_none_or(|e| !path.starts_with(e));
        }
    }
    if let Some(text) = &col.count {
        field_path(problem, &format!("{cat}.count"), text);
    }
    outside
}

/// A table's key: at least one column, each a declared one.
fn key(problem: &mut impl FnMut(&str, String), at: &str, key: &[String], columns: &BTreeSet<&str>) {
    if key.is_empty() {
        problem(&format!("{at}.key"), "must name at least one column".into());
    }
    for (k, name) in key.iter().enumerate() {
        if !columns.contains(name.as_str()) {
            problem(
                &format!("{at}.key[{k}]"),
                format!("`{name}` is not one of the table's columns"),
            );
        }
    }
}

/// The fields no column takes: paths that parse, a separator, and a column of their own.
fn unmapped(
    problem: &mut impl FnMut(&str, String),
    at: &str,
    u: &UnmappedConfig,
    columns: &BTreeSet<&str>,
) {
    field_path(problem, &format!("{at}.unmapped.under"), &u.under);
    for (e, text) in u.exclude.iter().enumerate() {
        field_path(problem, &format!("{at}.unmapped.exclude[{e}]"), text);
    }
    if u.separator.is_empty() {
        problem(
            &format!("{at}.unmapped.separator"),
            "must not be empty".into(),
        );
    }
    if u.column.is_empty() {
        problem(&format!("{at}.unmapped.column"), "must not be empty".into());
    } else if u.mode == UnmappedMode::Json && columns.contains(u.column.as_str()) {
        problem(
            &format!("{at}.unmapped.column"),
            format!("`{}` is already a declared column", u.column),
        );
    }
}

/// Parses a field path, reporting it at `at` when it does not parse.
fn field_path(problem: &mut impl FnMut(&str, String), at: &str, text: &str) -> Option<FieldPath> {
    match FieldPath::parse(text) {
        Ok(p) => Some(p),
        Err(e) => {
            problem(at, e);
            None
        }
    }
}
