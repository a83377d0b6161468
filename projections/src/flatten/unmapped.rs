//! Unmapped fields: flattened into columns named by their path, or collected into one JSON
//! value (`unmapped.mode`).

use serde_json::{Map, Value};

use super::schema::{infer, kind, short};
use refract_schemas::field_path::Step;

use super::{
    FlatColumn, FlatType, FlatValue, FlattenProjection, Output, Resolved, Staged, Unmapped,
};

impl FlattenProjection {
    /// Flattens the unmapped fields of `fields` into columns named by their path.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn walk(
        &self,
        output: &Output,
        u: &Unmapped,
        fields: &Map<String, Value>,
        dotted: &mut String,
        name: &mut String,
        row: &mut Vec<(usize, FlatValue)>,
        staged: &mut Staged,
    ) -> Result<(), String> {
        for (field, value) in fields {
            let (dotted_len, name_len) = (dotted.len(), name.len());
            dotted.push('.');
            dotted.push_str(field);
            if !u.skip.contains(dotted.as_str()) && !value.is_null() {
                if !name.is_empty() {
                    name.push_str(&u.separator);
                }
                name.push_str(field);
                let result = self.unmapped_field(output, u, value, dotted, name, row, staged);
                name.truncate(name_len);
                result?;
            }
            dotted.truncate(dotted_len);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn unmapped_field(
        &self,
        output: &Output,
        u: &Unmapped,
        value: &Value,
        dotted: &mut String,
        name: &mut String,
        row: &mut Vec<(usize, FlatValue)>,
        staged: &mut Staged,
    ) -> Result<(), String> {
        // A path seen before (the usual case) skips naming and conflict checks.
        match (output.resolved.get(dotted.as_str()), value) {
            (Some(Resolved::Column(column)), v) if !v.is_object() => {
                return self.fill(output, *column, value, dotted, row, staged);
            }
            (Some(Resolved::Object(below)), Value::Object(inner)) => {
                let mut below = below.clone();
                return self.walk(output, u, inner, dotted, &mut below, row, staged);
            }
            _ => {}
        }
        let name = &self.column_name(output, u, dotted, name, staged)?;
        let was_object = output.object_paths.contains(dotted.as_str())
            || staged.added_objects.iter().any(|p| p == dotted);
        if let Value::Object(inner) = value {
            if self.column_index(output, name, staged).is_some() && !was_object {
                return Err(format!(
                    "type conflict in table `{}`: field `{dotted}` (column `{name}`) held a scalar and is now an object",
                    output.schema.table
                ));
            }
            if !was_object {
                staged.added_objects.push(dotted.clone());
            }
            // The walk below names the fields from the path, not from a renamed column.
            let mut below = name_of_path(u, dotted);
            staged
                .resolved
                .push((dotted.clone(), Resolved::Object(below.clone())));
            return self.walk(output, u, inner, dotted, &mut below, row, staged);
        }
        if was_object {
            return Err(format!(
                "type conflict in table `{}`: field `{dotted}` held an object and is now {} {}",
                output.schema.table,
                kind(value),
                short(value)
            ));
        }
        let column = match self.column_index(output, name, staged) {
            Some(c) => c,
            None => {
                // A new field: a new nullable column (schema drift).
                let count = output.schema.columns.len() + staged.added.len();
                if count >= self.max_columns {
                    return Err(format!(
                        "table `{}` would have {} columns, more than max_columns = {}: map or exclude \
                         the new fields, or keep unmapped fields as one JSON column (unmapped.mode = \"json\")",
                        output.schema.table,
                        count + 1,
                        self.max_columns
                    ));
                }
                let ty = if value.is_array() {
                    FlatType::Json
                } else {
                    FlatType::Unknown
                };
                staged.added.push(FlatColumn {
                    name: name.clone(),
                    ty,
                });
                staged.added_origins.push((name.clone(), dotted.clone()));
                count
            }
        };
        self.fill(output, column, value, dotted, row, staged)?;
        staged
            .resolved
            .push((dotted.clone(), Resolved::Column(column)));
        Ok(())
    }

    /// Puts the scalar or array `value` of unmapped field `dotted` into `column`.
    fn fill(
        &self,
        output: &Output,
        column: usize,
        value: &Value,
        dotted: &str,
        row: &mut Vec<(usize, FlatValue)>,
        staged: &mut Staged,
    ) -> Result<(), String> {
        let inferred = match value {
            Value::Array(_) => FlatValue::Str(value.to_string()),
            other => infer(other).expect("scalars infer"),
        };
        if staged.type_of(output, column) == FlatType::Json {
            if !value.is_array() {
                return Err(format!(
                    "type conflict in table `{}`: field `{dotted}` held an array and is now {} {}",
                    output.schema.table,
                    kind(value),
                    short(value)
                ));
            }
            row.push((column, inferred));
            return Ok(());
        }
        let fitted = staged
            .put(output, column, inferred, value)
            .map_err(|e| format!("field `{dotted}`: {e}"))?;
        row.push((column, fitted));
        Ok(())
    }
}

impl FlattenProjection {
    /// The column an unmapped field goes to: its path below `under` joined by the separator,
    /// prefixed with `under`'s last name when a declared column already has that name (a new
    /// `doc.order_id` must not overwrite the key). Two fields that flatten to one name (`a.b`
    /// and `a_b`) are a conflict.
    fn column_name(
        &self,
        output: &Output,
        u: &Unmapped,
        dotted: &str,
        name: &str,
        staged: &Staged,
    ) -> Result<String, String> {
        let declared = |n: &str| output.index.get(n).is_some_and(|&i| i < output.rules.len());
        let mut column = name.to_owned();
        if declared(&column) {
            let under = match u.under.path.steps.iter().rev().find_map(|s| match s {
                Step::Field(f) => Some(f.as_str()),
                Step::Each => None,
            }) {
                Some(f) => f,
                None => u.under.path.column.as_str(),
            };
            column = format!("{under}{}{name}", u.separator);
            if declared(&column) {
                return Err(format!(
                    "table `{}`: field `{dotted}` would be column `{name}` or `{column}`, both declared; exclude it",
                    output.schema.table
                ));
            }
        }
        let origin = output.origins.get(&column).map(String::as_str).or_else(|| {
            staged
                .added_origins
                .iter()
                .find(|(c, _)| *c == column)
                .map(|(_, o)| o.as_str())
        });
        if let Some(origin) = origin {
            if origin != dotted {
                return Err(format!(
                    "table `{}`: fields `{origin}` and `{dotted}` both flatten to column `{column}`; \
                     exclude one of them, or keep unmapped fields as JSON (unmapped.mode = \"json\")",
                    output.schema.table
                ));
            }
        }
        Ok(column)
    }
}

/// The column name of a dotted path below `under` (what `walk` builds field by field).
fn name_of_path(u: &Unmapped, dotted: &str) -> String {
    let base = u.under.path.to_string();
    dotted
        .strip_prefix(&base)
        .unwrap_or(dotted)
        .trim_start_matches('.')
        .split('.')
        .collect::<Vec<_>>()
        .join(&u.separator)
}

/// Collects unmapped leaves of `fields` into `kept`, keyed by their dotted path below `under`.
pub(super) fn collect(
    u: &Unmapped,
    fields: &Map<String, Value>,
    dotted: &mut String,
    relative: &str,
    kept: &mut Map<String, Value>,
) {
    for (field, value) in fields {
        let len = dotted.len();
        dotted.push('.');
        dotted.push_str(field);
        if !u.skip.contains(dotted.as_str()) && !value.is_null() {
            let name = if relative.is_empty() {
                field.clone()
            } else {
                format!("{relative}.{field}")
            };
            match value {
                Value::Object(inner) => collect(u, inner, dotted, &name, kept),
                other => {
                    kept.insert(name, other.clone());
                }
            }
        }
        dotted.truncate(len);
    }
}
