//! `${VAR}` / `${VAR:-default}` interpolation inside configuration string values.
//!
//! Substitution happens on parsed string values, never on the raw file, so a value containing
//! quotes or newlines cannot change the file's structure. Rules, as in POSIX shells:
//! - `${NAME}`: the variable's value; an error when it is unset;
//! - `${NAME:-default}`: the default when the variable is unset or empty; the default may itself
//!   contain `${…}`;
//! - `$$`: a literal `$`; a `$` not followed by `{` or `$` is kept as is.
//!
//! Written here rather than taken from a crate: the `subst` crate spells defaults `${NAME:default}`,
//! while the environment contract of our pipeline files uses the shell's `${NAME:-default}`.

/// Why a value could not be interpolated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterpolateError {
    /// `${NAME}` without default, and NAME is not set.
    #[error("environment variable `{0}` is not set (write `${{{0}:-default}}` to give a default)")]
    Missing(String),
    /// `${` without its closing `}`.
    #[error("`${{` without a closing `}}`")]
    Unterminated,
    /// A variable name that is not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error("`{0}` is not a valid variable name")]
    BadName(String),
}

/// The result of interpolating one value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpolated {
    /// The value with every reference substituted.
    pub value: String,
    /// The variables whose values were substituted (for secret masking).
    pub used: Vec<String>,
}

/// Substitutes `${…}` references in `input`, reading variables through `lookup`.
pub fn interpolate(
    input: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Interpolated, InterpolateError> {
    let mut out = Interpolated {
        value: String::with_capacity(input.len()),
        used: Vec::new(),
    };
    let rest = expand(input, lookup, &mut out, false)?;
    debug_assert!(rest.is_empty());
    Ok(out)
}

/// Expands `input` into `out`; when `nested`, stops at the `}` that closes the enclosing
/// reference and returns what follows it.
fn expand<'a>(
    mut input: &'a str,
    lookup: &dyn Fn(&str) -> Option<String>,
    out: &mut Interpolated,
    nested: bool,
) -> Result<&'a str, InterpolateError> {
    loop {
        let stop = if nested {
            input.find(['$', '}'])
        } else {
            input.find('$')
        };
        let Some(i) = stop else {
            if nested {
                return Err(InterpolateError::Unterminated);
            }
            out.value.push_str(input);
            return Ok("");
        };
        out.value.push_str(&input[..i]);
        let tail = &input[i..];
        if tail.starts_with('}') {
            return Ok(&tail[1..]);
        }
        if let Some(after) = tail.strip_prefix("$$") {
            out.value.push('$');
            input = after;
        } else if let Some(after) = tail.strip_prefix("${") {
            input = reference(after, lookup, out)?;
        } else {
            out.value.push('$');
            input = &tail[1..];
        }
    }
}

/// Expands one reference; `input` starts just after `${`.
fn reference<'a>(
    input: &'a str,
    lookup: &dyn Fn(&str) -> Option<String>,
    out: &mut Interpolated,
) -> Result<&'a str, InterpolateError> {
    let end = input
        .find(['}', ':'])
        .ok_or(InterpolateError::Unterminated)?;
    let name = &input[..end];
    if name.is_empty()
        || name.starts_with(|c: char| c.is_ascii_digit())
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(InterpolateError::BadName(name.to_owned()));
    }
    let value = lookup(name);
    let after = &input[end..];
    if let Some(rest) = after.strip_prefix('}') {
        let value = value.ok_or_else(|| InterpolateError::Missing(name.to_owned()))?;
        out.value.push_str(&value);
        out.used.push(name.to_owned());
        return Ok(rest);
    }
    let Some(default) = after.strip_prefix(":-") else {
        return Err(InterpolateError::BadName(format!(
            "{name}{}",
            &after[..after.len().min(2)]
        )));
    };
    match value.filter(|v| !v.is_empty()) {
        Some(v) => {
            out.value.push_str(&v);
            out.used.push(name.to_owned());
            // Skip the default without substituting it (its variables need not exist).
            let mut skipped = Interpolated {
                value: String::new(),
                used: Vec::new(),
            };
            expand(default, &|_| Some(String::new()), &mut skipped, true)
        }
        None => expand(default, lookup, out, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("db.internal".into()),
            "EMPTY" => Some(String::new()),
            "QUOTED" => Some(r#"pa"ss'w{o}rd"#.into()),
            "PWD" => Some("/srv/app".into()),
            _ => None,
        }
    }

    #[test]
    fn table() {
        let cases: &[(&str, Result<&str, InterpolateError>)] = &[
            ("plain", Ok("plain")),
            ("${HOST}:5432", Ok("db.internal:5432")),
            ("${NOPE:-127.0.0.1}", Ok("127.0.0.1")),
            ("${EMPTY:-fallback}", Ok("fallback")),
            ("${HOST:-ignored}", Ok("db.internal")),
            (
                "file://${OBJECT_STORE:-${PWD}/out}",
                Ok("file:///srv/app/out"),
            ),
            ("${QUOTED}", Ok(r#"pa"ss'w{o}rd"#)),
            ("cost: $5 and $$HOME", Ok("cost: $5 and $HOME")),
            ("${NOPE:-}", Ok("")),
            ("${NOPE}", Err(InterpolateError::Missing("NOPE".into()))),
            ("${HOST", Err(InterpolateError::Unterminated)),
            (
                "${NOPE:-${ALSO_NOPE}}",
                Err(InterpolateError::Missing("ALSO_NOPE".into())),
            ),
            ("${HOST:-${ALSO_NOPE}}", Ok("db.internal")),
            ("${1BAD}", Err(InterpolateError::BadName("1BAD".into()))),
            ("${A-B}", Err(InterpolateError::BadName("A-B".into()))),
        ];
        for (input, want) in cases {
            let got = interpolate(input, &env).map(|i| i.value);
            assert_eq!(
                got.as_deref().map_err(Clone::clone),
                want.clone(),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn records_the_variables_used() {
        let got = interpolate("${HOST}/${NOPE:-${PWD}}", &env).unwrap();
        assert_eq!(got.used, vec!["HOST".to_string(), "PWD".to_string()]);
    }
}
