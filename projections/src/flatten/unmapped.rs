//! Unmapped fields: flattened into columns named by their path, or collected into one JSON
//! value (`unmapped.mode`).

use serde_json::{Map, Value};

use super::schema::{infer, kind, short};
use super::{FlatColumn, FlatType, FlatValue, FlattenProjection, Output, Staged, Unmapped};

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
            return self.walk(output, u, inner, dotted, name, row, staged);
        }
        if was_object {
            return Err(format!(
                "type conflict in table `{}`: field `{dotted}` held an object and is now {} {}",
                output.schema.table,
                kind(value),
                short(value)
            ));
        }
        let inferred = match value {
            Value::Array(_) => FlatValue::Str(value.to_string()),
            other => infer(other).expect("scalars infer"),
        };
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
                count
            }
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
