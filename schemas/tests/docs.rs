//! The reference in `docs/` documents every field of `schemas/pipeline.schema.json`, and the
//! local links of `README.md` and `docs/` lead to files that exist.
//!
//! Each kind has its page: `docs/sources/{kind}.md`, `docs/projections/{kind}.md`,
//! `docs/sinks/{kind}.md`; the rest of the file (`[pipeline]` and the top-level tables) is
//! `docs/pipeline.md`. A page's `## Fields` section is a table whose first cell names each field
//! by its path inside the kind's table: `` | `url` | ``, `` | `outputs[].columns[].path` | ``
//! (an array of tables), `` | `tables.<name>.keys` | `` (a table of tables, by name). Every field
//! of the schema needs its row, and every row a field of the schema.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Where the documents live: the workspace root.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the schemas crate lives in the workspace")
        .to_path_buf()
}

fn schema() -> Value {
    let path = workspace().join("schemas/pipeline.schema.json");
    let text = std::fs::read_to_string(&path).expect("schemas/pipeline.schema.json is readable");
    serde_json::from_str(&text).expect("schemas/pipeline.schema.json is JSON")
}

/// The definition a `{"$ref": "#/$defs/Name"}` points to, with its name.
fn resolve<'a>(schema: &'a Value, node: &Value) -> Option<(&'a str, &'a Value)> {
    let name = node.get("$ref")?.as_str()?.strip_prefix("#/$defs/")?;
    let (name, def) = schema["$defs"].as_object()?.get_key_value(name)?;
    Some((name.as_str(), def))
}

/// The object a property holds, if it holds tables of fields: itself (`name.`), as array
/// elements (`name[].`) or as the values of a table keyed by name (`name.<name>.`). Kinds
/// (`oneOf` of objects, such as `source`) have pages of their own and are not followed.
fn nested<'a>(
    schema: &'a Value,
    property: &'a Value,
) -> Option<(&'static str, &'a str, &'a Value)> {
    let mut candidates = vec![(".", property)];
    let optional = property["anyOf"].as_array().into_iter().flatten();
    candidates.extend(optional.map(|node| (".", node)));
    candidates.push(("[].", &property["items"]));
    candidates.push((".<name>.", &property["additionalProperties"]));
    candidates.into_iter().find_map(|(separator, node)| {
        let (name, def) = resolve(schema, node)?;
        def.get("properties")
            .is_some()
            .then_some((separator, name, def))
    })
}

/// Every field path of `object`, nested objects included, under `prefix`; notes the definitions
/// it went through in `seen`.
fn fields(
    schema: &Value,
    object: &Value,
    prefix: &str,
    seen: &mut BTreeSet<String>,
) -> Vec<String> {
    let mut paths = Vec::new();
    let properties = object["properties"].as_object().into_iter().flatten();
    for (name, property) in properties {
        let path = format!("{prefix}{name}");
        if let Some((separator, def_name, def)) = nested(schema, property) {
            seen.insert(def_name.to_owned());
            paths.extend(fields(schema, def, &format!("{path}{separator}"), seen));
        }
        paths.push(path);
    }
    paths
}

/// A page and the field paths its table must list.
struct Section {
    page: String,
    fields: Vec<String>,
}

/// The pipeline-level page, then one page per source, projection and sink kind.
fn sections(schema: &Value, seen: &mut BTreeSet<String>) -> Vec<Section> {
    let mut sections = vec![Section {
        page: "docs/pipeline.md".into(),
        fields: fields(schema, schema, "", seen),
    }];
    for (dir, def_name) in [
        ("sources", "SourceConfig"),
        ("projections", "ProjectionConfig"),
        ("sinks", "SinkConfig"),
    ] {
        seen.insert(def_name.to_owned());
        let kinds = schema["$defs"][def_name]["oneOf"].as_array();
        for variant in kinds.expect("a kind enum is a oneOf") {
            let kind = variant["properties"]["kind"]["const"]
                .as_str()
                .expect("every kind has a `kind` constant");
            sections.push(Section {
                page: format!("docs/{dir}/{kind}.md"),
                fields: fields(schema, variant, "", seen),
            });
        }
    }
    sections
}

/// The field paths in the first cells of the `## Fields` section's table rows.
fn documented_fields(page: &str) -> BTreeSet<String> {
    let mut in_fields = false;
    let mut rows = BTreeSet::new();
    for line in page.lines() {
        if line.starts_with("## ") {
            in_fields = line.trim() == "## Fields";
        } else if in_fields && line.starts_with("| `") {
            let cell = line[1..].split('|').next().unwrap_or_default().trim();
            rows.insert(cell.trim_matches('`').to_owned());
        }
    }
    rows
}

#[test]
fn docs_document_every_field_of_the_schema() {
    let schema = schema();
    let mut seen = BTreeSet::new();
    let mut problems = Vec::new();
    for section in sections(&schema, &mut seen) {
        let Ok(page) = std::fs::read_to_string(workspace().join(&section.page)) else {
            problems.push(format!("{}: missing page", section.page));
            continue;
        };
        let documented = documented_fields(&page);
        for field in &section.fields {
            if !documented.contains(field) {
                problems.push(format!(
                    "{}: no row for `{field}` in its `## Fields` table",
                    section.page
                ));
            }
        }
        for row in documented
            .iter()
            .filter(|row| !section.fields.contains(row))
        {
            problems.push(format!(
                "{}: the `## Fields` table lists `{row}`, which the schema does not have",
                section.page
            ));
        }
    }
    // A new configuration struct must be reachable by the walk above, or its fields would go
    // unchecked.
    let defs = schema["$defs"].as_object().expect("the schema has $defs");
    for (name, def) in defs {
        if def.get("properties").is_some() && !seen.contains(name) {
            problems.push(format!("$defs/{name}: not reached from any page's section"));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/ is behind the schema:\n{}",
        problems.join("\n")
    );
}

/// `README.md` and every Markdown file under `docs/`.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![workspace().join("README.md")];
    let mut dirs = vec![workspace().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("docs/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The targets of the `[text](target)` links of a Markdown text, outside code blocks.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            targets.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    targets
}

#[test]
fn local_links_lead_to_files_that_exist() {
    let mut problems = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).expect("a Markdown file is readable");
        let dir = file.parent().expect("a file has a directory");
        for target in link_targets(&text) {
            let path = target.split('#').next().unwrap_or_default();
            let external = ["http://", "https://", "mailto:"]
                .iter()
                .any(|scheme| target.starts_with(scheme));
            if !external && !path.is_empty() && !dir.join(path).exists() {
                let shown = file.strip_prefix(workspace()).unwrap_or(&file);
                problems.push(format!(
                    "{}: link to `{target}`: no such file",
                    shown.display()
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_index_links_every_page() {
    let docs = workspace().join("docs");
    let index = std::fs::read_to_string(docs.join("README.md")).expect("docs/README.md exists");
    let linked: BTreeSet<String> = link_targets(&index)
        .into_iter()
        .map(|t| t.split('#').next().unwrap_or_default().to_owned())
        .collect();
    let missing: Vec<String> = markdown_files()
        .iter()
        .filter_map(|file| file.strip_prefix(&docs).ok())
        .map(|page| page.display().to_string())
        .filter(|page| page != "README.md" && !linked.contains(page))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/README.md does not link: {}",
        missing.join(", ")
    );
}
