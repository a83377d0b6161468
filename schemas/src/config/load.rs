//! Loading a pipeline file: parse with spans, interpolate string values, deserialize, validate,
//! and report each error with its file, line, column and field path.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_spanned::Spanned;
use toml::de::{DeTable, DeValue};

use super::interpolate::interpolate;
use super::{
    DocumentProjectionConfig, Families, FileSourceConfig, NullSinkConfig, ObjectJsonSinkConfig,
    PipelineFile, PostgresSourceConfig, ProjectionConfig, ReplicaProjectionConfig,
};

/// Variable names whose values are secrets: masked by `plan` and never logged.
const SECRET_WORDS: &[&str] = &[
    "PASSWORD",
    "PASSWD",
    "SECRET",
    "TOKEN",
    "CREDENTIAL",
    "PRIVATE",
    "ACCESS_KEY",
    "API_KEY",
];

/// One configuration error, located in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The pipeline file as named on the command line.
    pub file: String,
    /// 1-based line (0 when the file could not be read).
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// Dotted field path (`sinks.cache.concurrency`), empty for syntax errors.
    pub path: String,
    /// What is wrong, in a sentence.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.line, self.column)?;
        if !self.path.is_empty() {
            write!(f, "`{}`: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// Every error found in a pipeline file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A pipeline file that parsed and validated.
#[derive(Debug, Clone)]
pub struct LoadedPipeline {
    /// Where it was read from.
    pub file: PathBuf,
    /// The typed configuration, variables substituted.
    pub config: PipelineFile,
    /// Field paths whose values are secrets (they came from a secret-named variable).
    pub secret_paths: BTreeSet<String>,
    /// Field paths whose values came (in part) from the environment, with the variables used.
    pub from_env: BTreeMap<String, Vec<String>>,
}

/// Reads, interpolates (from the process environment), deserializes and validates a pipeline
/// file, its routes from projections to sinks included.
pub fn load(path: &Path, families: &dyn Families) -> Result<LoadedPipeline, ConfigErrors> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: name.clone(),
            line: 0,
            column: 0,
            path: String::new(),
            message: format!("cannot read the pipeline file: {e}"),
        }])
    })?;
    let mut loaded = load_str(&name, &text, &environment, Some(families))?;
    loaded.file = path.to_owned();
    Ok(loaded)
}

/// The process environment, with `PWD` falling back to the working directory.
fn environment(name: &str) -> Option<String> {
    std::env::var(name).ok().or_else(|| {
        (name == "PWD")
            .then(|| {
                std::env::current_dir()
                    .ok()
                    .map(|d| d.display().to_string())
            })
            .flatten()
    })
}

/// Loads a pipeline from text; `file` names it in errors, `lookup` resolves variables, and
/// `families` (when given) checks each route from a projection to a sink.
pub fn load_str(
    file: &str,
    text: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
    families: Option<&dyn Families>,
) -> Result<LoadedPipeline, ConfigErrors> {
    let parsed = parse_file(file, text, lookup, |config: &mut PipelineFile| {
        fill_defaults(config);
        let mut problems = config.validate();
        if let Some(families) = families {
            problems.extend(config.route_problems(families));
        }
        problems
    })?;
    Ok(LoadedPipeline {
        file: PathBuf::from(file),
        config: parsed.config,
        secret_paths: parsed.secret_paths,
        from_env: parsed.from_env,
    })
}

/// A configuration file of type `T` that parsed and validated, with what the environment gave.
#[derive(Debug, Clone)]
pub struct Parsed<T> {
    /// The typed configuration, variables substituted.
    pub config: T,
    /// Field paths whose values are secrets (they came from a secret-named variable).
    pub secret_paths: BTreeSet<String>,
    /// Field paths whose values came (in part) from the environment, with the variables used.
    pub from_env: BTreeMap<String, Vec<String>>,
}

/// Reads any refract configuration file (pipelines, migrations) from text: parse with spans,
/// interpolate string values, deserialize, then `check` (which may fill defaults) returns the
/// semantic problems as (field path, message). Every error names `file`, line and field path.
pub fn parse_file<T: DeserializeOwned>(
    file: &str,
    text: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
    check: impl FnOnce(&mut T) -> Vec<(String, String)>,
) -> Result<Parsed<T>, ConfigErrors> {
    let at = |span: Option<Range<usize>>, path: String, message: String| {
        let (line, column) = span.map_or((1, 1), |s| line_col(text, s.start));
        ConfigError {
            file: file.to_owned(),
            line,
            column,
            path,
            message,
        }
    };
    let mut root = DeTable::parse(text)
        .map_err(|e| ConfigErrors(vec![at(e.span(), String::new(), e.message().to_owned())]))?;

    let mut errors = Vec::new();
    let mut secret_paths = BTreeSet::new();
    let mut from_env = BTreeMap::new();
    for (key, value) in root.get_mut().iter_mut() {
        let mut path = key.get_ref().to_string();
        walk(value, &mut path, lookup, &mut |path, result| match result {
            Ok(used) => {
                if used.iter().any(|v| is_secret_name(v)) {
                    secret_paths.insert(path.to_owned());
                }
                if !used.is_empty() {
                    from_env.insert(path.to_owned(), used);
                }
            }
            Err((span, message)) => errors.push(at(Some(span), path.to_owned(), message)),
        });
    }
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }

    let snapshot = root.get_ref().clone();
    let mut config: T = match serde_path_to_error::deserialize(toml::de::Deserializer::from(root)) {
        Ok(c) => c,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let (path, span, message) = refine(&snapshot, path, inner);
            return Err(ConfigErrors(vec![at(span, path, message)]));
        }
    };
    let problems = check(&mut config);
    if !problems.is_empty() {
        let errors = problems
            .into_iter()
            .map(|(path, message)| {
                let span = locate(&snapshot, &path);
                at(span, path, message)
            })
            .collect();
        return Err(ConfigErrors(errors));
    }
    Ok(Parsed {
        config,
        secret_paths,
        from_env,
    })
}

/// Reads a configuration file from disk with [`parse_file`], variables from the process
/// environment.
pub fn read_file<T: DeserializeOwned>(
    path: &Path,
    check: impl FnOnce(&mut T) -> Vec<(String, String)>,
) -> Result<Parsed<T>, ConfigErrors> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: name.clone(),
            line: 0,
            column: 0,
            path: String::new(),
            message: format!("cannot read the file: {e}"),
        }])
    })?;
    parse_file(&name, &text, &environment, check)
}

/// Defaults that depend on where a value sits: a document projection's collection is its name.
fn fill_defaults(config: &mut PipelineFile) {
    for (name, projection) in &mut config.projections {
        if let ProjectionConfig::Document(d) = projection {
            d.collection.get_or_insert_with(|| name.clone());
        }
    }
}

type Report<'a> = dyn FnMut(&str, Result<Vec<String>, (Range<usize>, String)>) + 'a;

/// Interpolates every string value below `value`, reporting each result with its path.
fn walk(
    value: &mut Spanned<DeValue<'_>>,
    path: &mut String,
    lookup: &dyn Fn(&str) -> Option<String>,
    report: &mut Report<'_>,
) {
    let span = value.span();
    match value.get_mut() {
        DeValue::String(s) => match interpolate(s, lookup) {
            Ok(done) => {
                if done.value != **s {
                    *s = done.value.into();
                }
                report(path, Ok(done.used));
            }
            Err(e) => report(path, Err((span, e.to_string()))),
        },
        DeValue::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                walk(item, path, lookup, report);
                path.truncate(len);
            }
        }
        DeValue::Table(table) => {
            for (key, item) in table.iter_mut() {
                let len = path.len();
                path.push('.');
                path.push_str(key.get_ref());
                walk(item, path, lookup, report);
                path.truncate(len);
            }
        }
        _ => {}
    }
}

fn is_secret_name(var: &str) -> bool {
    let upper = var.to_ascii_uppercase();
    SECRET_WORDS.iter().any(|w| upper.contains(w))
}

/// Improves a deserialization error: finds its span when serde lost it, and for the tagged
/// sections (`source`, `projections.X`, `sinks.X`), whose variants serde buffers without paths,
/// deserializes the variant alone to name the exact field.
fn refine(
    root: &DeTable<'_>,
    path: String,
    err: toml::de::Error,
) -> (String, Option<Range<usize>>, String) {
    let message = err.message().to_owned();
    let segments: Vec<&str> = path.split('.').collect();
    let tagged = matches!(
        segments.as_slice(),
        ["source"] | ["projections", _] | ["sinks", _]
    );
    if tagged {
        if message.contains("unknown variant") || message.contains("missing field `kind`") {
            let kind_path = format!("{path}.kind");
            let span = locate(root, &kind_path).or_else(|| locate(root, &path));
            let shown = if message.contains("unknown variant") {
                kind_path
            } else {
                path
            };
            return (shown, span, message);
        }
        if let Some(value) = lookup_value(root, &path) {
            if let Some((inner_path, inner)) = explain_variant(segments[0], value.clone()) {
                let full = if inner_path.is_empty() || inner_path == "." {
                    path.clone()
                } else {
                    format!("{path}.{inner_path}")
                };
                let span = unknown_field_span(root, &full, inner.message())
                    .or(inner.span())
                    .or_else(|| locate(root, &full));
                return (full, span, inner.message().to_owned());
            }
        }
    }
    let span = unknown_field_span(root, &path, &message)
        .or(err.span())
        .or_else(|| locate(root, &path));
    (path, span, message)
}

/// For "unknown field `x`" errors, the span of that field (serde points at its table).
fn unknown_field_span(root: &DeTable<'_>, path: &str, message: &str) -> Option<Range<usize>> {
    let field = message.strip_prefix("unknown field `")?.split('`').next()?;
    let field_path = if path.ends_with(&format!(".{field}")) || path == field {
        path.to_owned()
    } else {
        format!("{path}.{field}")
    };
    lookup_value(root, &field_path).map(Spanned::span)
}

/// Deserializes a tagged section as its concrete variant, returning the error's inner path.
fn explain_variant(
    section: &str,
    mut value: Spanned<DeValue<'_>>,
) -> Option<(String, toml::de::Error)> {
    let DeValue::Table(table) = value.get_mut() else {
        return None;
    };
    let kind = table
        .iter()
        .find(|(k, _)| k.get_ref() == "kind")
        .and_then(|(_, v)| match v.get_ref() {
            DeValue::String(s) => Some(s.to_string()),
            _ => None,
        })?;
    let kind_key = table
        .iter()
        .find(|(k, _)| k.get_ref() == "kind")
        .map(|(k, _)| k.clone())?;
    table.remove(&kind_key);
    let de = toml::de::ValueDeserializer::from(value);
    match (section, kind.as_str()) {
        ("source", "file") => first_error::<FileSourceConfig>(de),
        ("source", "postgres") => first_error::<PostgresSourceConfig>(de),
        ("projections", "replica") => first_error::<ReplicaProjectionConfig>(de),
        ("projections", "document") => first_error::<DocumentProjectionConfig>(de),
        ("sinks", "object_json") => first_error::<ObjectJsonSinkConfig>(de),
        ("sinks", "null") => first_error::<NullSinkConfig>(de),
        _ => None,
    }
}

fn first_error<T: DeserializeOwned>(
    de: toml::de::ValueDeserializer<'_>,
) -> Option<(String, toml::de::Error)> {
    serde_path_to_error::deserialize::<_, T>(de)
        .err()
        .map(|e| (e.path().to_string(), e.into_inner()))
}

/// Finds the value at a dotted path (`sinks.out.url`, `projections.p.sinks[0]`).
fn lookup_value<'a, 'i>(root: &'a DeTable<'i>, path: &str) -> Option<&'a Spanned<DeValue<'i>>> {
    let mut current: Option<&Spanned<DeValue<'i>>> = None;
    for segment in path.split('.') {
        let (name, indexes) = match segment.find('[') {
            Some(i) => (&segment[..i], &segment[i..]),
            None => (segment, ""),
        };
        let table = match current {
            None => root,
            Some(v) => match v.get_ref() {
                DeValue::Table(t) => t,
                _ => return None,
            },
        };
        let mut value = table
            .iter()
            .find(|(k, _)| k.get_ref() == name)
            .map(|(_, v)| v)?;
        for index in indexes.split(['[', ']']).filter(|s| !s.is_empty()) {
            let i: usize = index.parse().ok()?;
            value = match value.get_ref() {
                DeValue::Array(items) => items.get(i)?,
                _ => return None,
            };
        }
        current = Some(value);
    }
    current
}

/// The span of the value at `path`, or of its nearest existing ancestor.
pub(super) fn locate(root: &DeTable<'_>, path: &str) -> Option<Range<usize>> {
    let mut path = path;
    loop {
        if let Some(v) = lookup_value(root, path) {
            return Some(v.span());
        }
        path = &path[..path.rfind('.')?];
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}
