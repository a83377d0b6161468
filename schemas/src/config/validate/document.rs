//! The rules of a `document` projection.

use std::collections::BTreeSet;

use crate::config::{DocumentEmbedConfig, DocumentFieldConfig, DocumentProjectionConfig};
use crate::template::KeyTemplate;

/// Most embeds one document may declare: each adds tables to mirror and indexes to keep; the
/// projection numbers its tables with one byte.
const MAX_EMBEDS: usize = 64;

/// The prefix of a column of the link row, in an embed with `through`.
const THROUGH: &str = "through";

/// Checks a `document` projection at `base` (`projections.NAME`).
pub(super) fn validate(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    d: &DocumentProjectionConfig,
) {
    root(problem, base, d);
    // Every top-level field of the document: copied fields, embeds, counts, objects.
    let mut names = BTreeSet::new();
    fields(
        problem,
        &format!("{base}.fields"),
        &d.fields,
        false,
        &mut names,
    );
    embeds(problem, base, d, &mut names);
    one_key_per_table(problem, base, d);
    objects(problem, base, d, &mut names);
}

/// The root table, its key, the collection, and some content.
fn root(problem: &mut impl FnMut(&str, String), base: &str, d: &DocumentProjectionConfig) {
    table_name(problem, &format!("{base}.table"), &d.table);
    columns(problem, &format!("{base}.key"), &d.key);
    if let Some(c) = &d.collection {
        if c.is_empty() || c.contains('/') {
            problem(
                &format!("{base}.collection"),
                format!("`{c}` must be non-empty and contain no `/`"),
            );
        }
    }
    if d.fields.is_empty() && d.embeds.is_empty() && d.objects.is_empty() {
        problem(
            base,
            "a document needs at least one of `fields`, `embeds` or `objects`".into(),
        );
    }
}

/// The embeds: joined on a root key of one column, at most [`MAX_EMBEDS`], then each one.
fn embeds<'a>(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    d: &'a DocumentProjectionConfig,
    names: &mut BTreeSet<&'a str>,
) {
    if !d.embeds.is_empty() && d.key.len() > 1 {
        problem(
            &format!("{base}.key"),
            format!(
                "embeds join on the root key, which must be one column (found {})",
                d.key.len()
            ),
        );
    }
    if d.embeds.len() > MAX_EMBEDS {
        problem(
            &format!("{base}.embeds"),
            format!("{} embeds exceed the limit of {MAX_EMBEDS}", d.embeds.len()),
        );
    }
    for (i, e) in d.embeds.iter().enumerate() {
        embed(problem, &format!("{base}.embeds[{i}]"), e, names);
    }
}

/// One embed at `at` (`projections.NAME.embeds[i]`): its name among the document's fields, its
/// table and key, how it joins, its order, limit and fields, and its count's name.
fn embed<'a>(
    problem: &mut impl FnMut(&str, String),
    at: &str,
    e: &'a DocumentEmbedConfig,
    names: &mut BTreeSet<&'a str>,
) {
    field_name(problem, &format!("{at}.name"), &e.name, names);
    table_name(problem, &format!("{at}.table"), &e.table);
    columns(problem, &format!("{at}.key"), &e.key);
    join(problem, at, e);
    let through = e.through.is_some();
    for (o, entry) in e.order_by.iter().enumerate() {
        let column = entry.strip_prefix('-').unwrap_or(entry);
        column_ref(problem, &format!("{at}.order_by[{o}]"), column, through);
    }
    if e.limit == Some(0) {
        problem(&format!("{at}.limit"), "must be at least 1".into());
    }
    if e.ids && !e.fields.is_empty() {
        problem(
            &format!("{at}.fields"),
            "does not apply with `ids = true` (the array holds the child keys)".into(),
        );
    }
    if !e.ids && e.fields.is_empty() {
        problem(
            &format!("{at}.fields"),
            "must declare at least one field (or set `ids = true`)".into(),
        );
    }
    fields(
        problem,
        &format!("{at}.fields"),
        &e.fields,
        through,
        &mut BTreeSet::new(),
    );
    if let Some(count) = &e.count {
        field_name(problem, &format!("{at}.count"), count, names);
    }
}

/// How an embed joins its parent: exactly one of a link table (`through`, whose row names the
/// child by one column) or a child column holding the root key (`foreign_key`).
fn join(problem: &mut impl FnMut(&str, String), at: &str, e: &DocumentEmbedConfig) {
    match (&e.through, &e.foreign_key) {
        (Some(_), Some(_)) | (None, None) => problem(
            at,
            "must have exactly one of `through` (a link table) or `foreign_key` (a child column)"
                .into(),
        ),
        (Some(link), None) => {
            table_name(problem, &format!("{at}.through.table"), &link.table);
            for (field, column) in [("parent", &link.parent), ("child", &link.child)] {
                if column.is_empty() {
                    problem(
                        &format!("{at}.through.{field}"),
                        "must name a column of the link table".into(),
                    );
                }
            }
            if let Some(key) = &link.key {
                columns(problem, &format!("{at}.through.key"), key);
            }
            if e.key.len() > 1 {
                problem(
                    &format!("{at}.key"),
                    format!(
                        "the link row names its child by one column, so the child key must be one column (found {})",
                        e.key.len()
                    ),
                );
            }
        }
        (None, Some(fk)) => {
            if fk.is_empty() {
                problem(
                    &format!("{at}.foreign_key"),
                    "must name the child column holding the root key".into(),
                );
            }
        }
    }
}

/// A table mirrored once whatever parts it plays (root, embed, link): one key.
fn one_key_per_table(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    d: &DocumentProjectionConfig,
) {
    let mut keys: Vec<(&str, Vec<String>, String)> =
        vec![(&d.table, d.key.clone(), format!("{base}.key"))];
    for (i, e) in d.embeds.iter().enumerate() {
        let at = format!("{base}.embeds[{i}]");
        keys.push((&e.table, e.key.clone(), format!("{at}.key")));
        if let Some(link) = &e.through {
            keys.push((&link.table, link.key_columns(), format!("{at}.through.key")));
        }
    }
    for (i, (table, key, path)) in keys.iter().enumerate() {
        if let Some((_, other, other_path)) =
            keys[..i].iter().find(|(t, k, _)| t == table && k != key)
        {
            problem(
                path,
                format!(
                    "table `{table}` is keyed by ({}) here but by ({}) at `{other_path}`: one table has one key",
                    key.join(", "),
                    other.join(", ")
                ),
            );
        }
    }
}

/// The objects: each named among the document's fields, with at least one item.
fn objects<'a>(
    problem: &mut impl FnMut(&str, String),
    base: &str,
    d: &'a DocumentProjectionConfig,
    names: &mut BTreeSet<&'a str>,
) {
    for (i, o) in d.objects.iter().enumerate() {
        let at = format!("{base}.objects[{i}]");
        field_name(problem, &format!("{at}.name"), &o.name, names);
        if o.items.is_empty() {
            problem(
                &format!("{at}.items"),
                "must declare at least one item".into(),
            );
        }
        fields(
            problem,
            &format!("{at}.items"),
            &o.items,
            false,
            &mut BTreeSet::new(),
        );
    }
}

/// `table` or `schema.table`.
fn table_name(problem: &mut impl FnMut(&str, String), path: &str, table: &str) {
    let parts: Vec<&str> = table.split('.').collect();
    if parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
        problem(
            path,
            format!("`{table}` must be written `table` or `schema.table`"),
        );
    }
}

/// A non-empty list of distinct, non-empty column names.
fn columns(problem: &mut impl FnMut(&str, String), path: &str, columns: &[String]) {
    if columns.is_empty() {
        problem(path, "must name at least one column".into());
    }
    for (i, c) in columns.iter().enumerate() {
        if c.is_empty() {
            problem(&format!("{path}[{i}]"), "must not be empty".into());
        } else if columns[..i].contains(c) {
            problem(
                &format!("{path}[{i}]"),
                format!("column `{c}` is named twice"),
            );
        }
    }
}

/// A field name, distinct from the others of its object.
fn field_name<'a>(
    problem: &mut impl FnMut(&str, String),
    path: &str,
    name: &'a str,
    names: &mut BTreeSet<&'a str>,
) {
    if name.is_empty() {
        problem(path, "must not be empty".into());
    } else if !names.insert(name) {
        problem(path, format!("field `{name}` is declared twice"));
    }
}

/// Fields of one object: distinct names, and a column or template each.
fn fields<'a>(
    problem: &mut impl FnMut(&str, String),
    path: &str,
    fields: &'a [DocumentFieldConfig],
    through: bool,
    names: &mut BTreeSet<&'a str>,
) {
    for (i, f) in fields.iter().enumerate() {
        field_name(problem, &format!("{path}[{i}].name"), &f.name, names);
        let at = format!("{path}[{i}].from");
        if f.from.contains('{') {
            match KeyTemplate::parse(&f.from) {
                Ok(t) => {
                    for column in t.columns() {
                        column_ref(problem, &at, column, through);
                    }
                }
                Err(e) => problem(&at, e),
            }
        } else {
            column_ref(problem, &at, &f.from, through);
        }
    }
}

/// A column of the row, or `through.column` of the link row where there is one.
fn column_ref(problem: &mut impl FnMut(&str, String), path: &str, column: &str, through: bool) {
    match column.split_once('.') {
        _ if column.is_empty() => problem(path, "must name a column".into()),
        Some((THROUGH, rest)) if !through => problem(
            path,
            format!(
                "`{THROUGH}.{rest}` reads the link row, but only an embed with `through` has one"
            ),
        ),
        Some((THROUGH, "")) => problem(
            path,
            format!("`{column}` must name a column of the link row"),
        ),
        Some((THROUGH, _)) => {}
        Some((prefix, _)) => problem(
            path,
            format!(
                "`{column}`: unknown column prefix `{prefix}.` (only `{THROUGH}.`, for the link row)"
            ),
        ),
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ProjectionConfig, load_str};

    const GOOD: &str = r#"
[pipeline]
name = "docs"

[source]
kind = "file"
path = "changes.jsonl"

[sinks.target]
kind = "null"

[projections.book_docs]
kind = "document"
table = "public.books"
sinks = ["target"]
fields = [{ name = "id", from = "id" }, { name = "name", from = "name" }]

[[projections.book_docs.embeds]]
name = "authors"
table = "public.authors"
through = { table = "public.book_authors", parent = "book_id", child = "author_id" }
order_by = ["through.position", "id"]
fields = [{ name = "id", from = "id" }, { name = "name", from = "{first_name} {last_name}" }]

[projections.customer_docs]
kind = "document"
table = "public.customers"
collection = "customers"
sinks = ["target"]
fields = [{ name = "id", from = "id" }]
objects = [{ name = "phones", items = [{ name = "home", from = "home_phone" }] }]

[[projections.customer_docs.embeds]]
name = "recentOrders"
table = "public.orders"
foreign_key = "customer_id"
order_by = ["-created_at"]
limit = 5
count = "orderCount"
fields = [{ name = "id", from = "id" }, { name = "total", from = "total_cents" }]
"#;

    fn env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn a_good_file_loads_and_the_collection_defaults_to_the_name() {
        let loaded = load_str("p.toml", GOOD, &env, None).unwrap();
        let collection = |name: &str| match &loaded.config.projections[name] {
            ProjectionConfig::Document(d) => d.collection.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(collection("book_docs").as_deref(), Some("book_docs"));
        assert_eq!(collection("customer_docs").as_deref(), Some("customers"));
    }

    /// Each case: (name, edit of GOOD, path, words of the message).
    #[test]
    fn each_rule_names_its_field() {
        let cases: &[(&str, &str, &str, &str, &str)] = &[
            (
                "both through and foreign_key",
                "foreign_key = \"customer_id\"",
                "foreign_key = \"customer_id\"\nthrough = { table = \"l\", parent = \"a\", child = \"b\" }",
                "projections.customer_docs.embeds[0]",
                "exactly one of `through`",
            ),
            (
                "neither through nor foreign_key",
                "foreign_key = \"customer_id\"\n",
                "",
                "projections.customer_docs.embeds[0]",
                "exactly one of `through`",
            ),
            (
                "through column without through",
                "order_by = [\"-created_at\"]",
                "order_by = [\"-through.created_at\"]",
                "projections.customer_docs.embeds[0].order_by[0]",
                "only an embed with `through` has one",
            ),
            (
                "unknown prefix",
                "order_by = [\"through.position\", \"id\"]",
                "order_by = [\"link.position\", \"id\"]",
                "projections.book_docs.embeds[0].order_by[0]",
                "unknown column prefix `link.`",
            ),
            (
                "empty order_by entry",
                "order_by = [\"through.position\", \"id\"]",
                "order_by = [\"-\"]",
                "projections.book_docs.embeds[0].order_by[0]",
                "must name a column",
            ),
            (
                "empty field name",
                "{ name = \"name\", from = \"name\" }",
                "{ name = \"\", from = \"name\" }",
                "projections.book_docs.fields[1].name",
                "must not be empty",
            ),
            (
                "duplicate field name",
                "{ name = \"name\", from = \"name\" }",
                "{ name = \"id\", from = \"name\" }",
                "projections.book_docs.fields[1].name",
                "field `id` is declared twice",
            ),
            (
                "embed named like a field",
                "name = \"authors\"",
                "name = \"name\"",
                "projections.book_docs.embeds[0].name",
                "field `name` is declared twice",
            ),
            (
                "count named like a field",
                "count = \"orderCount\"",
                "count = \"id\"",
                "projections.customer_docs.embeds[0].count",
                "field `id` is declared twice",
            ),
            (
                "bad template",
                "from = \"{first_name} {last_name}\"",
                "from = \"{first_name} {last_name\"",
                "projections.book_docs.embeds[0].fields[1].from",
                "is not closed",
            ),
            (
                "template with an unknown prefix",
                "from = \"{first_name} {last_name}\"",
                "from = \"{a.first_name}\"",
                "projections.book_docs.embeds[0].fields[1].from",
                "unknown column prefix `a.`",
            ),
            (
                "through field at the root",
                "{ name = \"name\", from = \"name\" }",
                "{ name = \"name\", from = \"through.name\" }",
                "projections.book_docs.fields[1].from",
                "only an embed with `through`",
            ),
            (
                "empty from",
                "{ name = \"name\", from = \"name\" }",
                "{ name = \"name\", from = \"\" }",
                "projections.book_docs.fields[1].from",
                "must name a column",
            ),
            (
                "zero limit",
                "limit = 5",
                "limit = 0",
                "projections.customer_docs.embeds[0].limit",
                "at least 1",
            ),
            (
                "ids with fields",
                "limit = 5",
                "limit = 5\nids = true",
                "projections.customer_docs.embeds[0].fields",
                "does not apply with `ids = true`",
            ),
            (
                "objects without fields",
                "fields = [{ name = \"id\", from = \"id\" }, { name = \"total\", from = \"total_cents\" }]",
                "fields = []",
                "projections.customer_docs.embeds[0].fields",
                "or set `ids = true`",
            ),
            (
                "composite root key with embeds",
                "table = \"public.books\"",
                "table = \"public.books\"\nkey = [\"id\", \"edition\"]",
                "projections.book_docs.key",
                "must be one column (found 2)",
            ),
            (
                "composite child key with through",
                "table = \"public.authors\"",
                "table = \"public.authors\"\nkey = [\"id\", \"x\"]",
                "projections.book_docs.embeds[0].key",
                "child key must be one column",
            ),
            (
                "empty key",
                "table = \"public.books\"",
                "table = \"public.books\"\nkey = []",
                "projections.book_docs.key",
                "at least one column",
            ),
            (
                "duplicate key column",
                "foreign_key = \"customer_id\"",
                "foreign_key = \"customer_id\"\nkey = [\"id\", \"id\"]",
                "projections.customer_docs.embeds[0].key[1]",
                "named twice",
            ),
            (
                "bad table name",
                "table = \"public.books\"",
                "table = \"a.b.c\"",
                "projections.book_docs.table",
                "`table` or `schema.table`",
            ),
            (
                "empty link column",
                "parent = \"book_id\"",
                "parent = \"\"",
                "projections.book_docs.embeds[0].through.parent",
                "must name a column",
            ),
            (
                "empty foreign key",
                "foreign_key = \"customer_id\"",
                "foreign_key = \"\"",
                "projections.customer_docs.embeds[0].foreign_key",
                "must name the child column",
            ),
            (
                "collection with a slash",
                "collection = \"customers\"",
                "collection = \"a/b\"",
                "projections.customer_docs.collection",
                "contain no `/`",
            ),
            (
                "objects without items",
                "items = [{ name = \"home\", from = \"home_phone\" }]",
                "items = []",
                "projections.customer_docs.objects[0].items",
                "at least one item",
            ),
            (
                "duplicate item",
                "items = [{ name = \"home\", from = \"home_phone\" }]",
                "items = [{ name = \"home\", from = \"home_phone\" }, { name = \"home\", from = \"x\" }]",
                "projections.customer_docs.objects[0].items[1].name",
                "field `home` is declared twice",
            ),
            (
                "one table, two keys",
                "table = \"public.orders\"",
                "table = \"public.customers\"\nkey = [\"customer_id\"]",
                "projections.customer_docs.embeds[0].key",
                "is keyed by (customer_id) here but by (id) at `projections.customer_docs.key`",
            ),
            (
                "an empty document",
                "fields = [{ name = \"id\", from = \"id\" }]\nobjects",
                "fields = []\nobjects",
                "",
                "",
            ),
            (
                "unknown field",
                "limit = 5",
                "limit = 5\nlimt = 4",
                "projections.customer_docs.embeds",
                "unknown field `limt`",
            ),
        ];
        for (name, from, to, path, words) in cases {
            assert!(GOOD.contains(from), "{name}: edit does not apply");
            let result = load_str("p.toml", &GOOD.replacen(from, to, 1), &env, None);
            if path.is_empty() {
                // Still valid: embeds alone make a document.
                assert!(result.is_ok(), "{name}: {:?}", result.err());
                continue;
            }
            let errs = result.expect_err(name).0;
            assert_eq!(errs.len(), 1, "{name}: {errs:?}");
            let e = &errs[0];
            assert!(e.path.starts_with(path), "{name}: {e}");
            assert!(e.message.contains(words), "{name}: {e}");
        }
    }

    #[test]
    fn a_document_without_content_is_rejected() {
        let text = GOOD.replacen(
            "fields = [{ name = \"id\", from = \"id\" }]\nobjects = [{ name = \"phones\", items = [{ name = \"home\", from = \"home_phone\" }] }]",
            "",
            1,
        );
        let text = text.replacen("\n[[projections.customer_docs.embeds]]", "\n[unused]", 1);
        let text = &text[..text.find("\n[unused]").unwrap()];
        let errs = load_str("p.toml", text, &env, None)
            .expect_err("rejected")
            .0;
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "projections.customer_docs");
        assert!(
            errs[0].message.contains("at least one of `fields`"),
            "{}",
            errs[0]
        );
    }
}
