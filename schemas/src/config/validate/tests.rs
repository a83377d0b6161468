use super::mask_url;
use crate::config::load_str;

mod connectors;

#[test]
fn masks_url_passwords() {
    assert_eq!(
        mask_url("postgres://app:s3cr\"et@db:5432/x"),
        "postgres://app:***@db:5432/x"
    );
    assert_eq!(mask_url("redis://token@cache"), "redis://***@cache");
    assert_eq!(mask_url("postgres://app@db/x"), "postgres://app@db/x");
    assert_eq!(mask_url("file:///tmp/out"), "file:///tmp/out");
    assert_eq!(mask_url("s3://bucket/a@b"), "s3://bucket/a@b");
    assert_eq!(
        mask_url("postgres://app@db/x?sslmode=require&password=pw&PassWord=pw2"),
        "postgres://app@db/x?sslmode=require&password=***&PassWord=***"
    );
}

/// The outputs of the `flatten` projection of [`GOOD`], one table per line.
macro_rules! flat_outputs {
    () => {
        r#"outputs = [
    { name = "orders", key = ["id"], columns = [{ name = "id", path = "id" }, { name = "total", path = "doc.total" }], unmapped = { under = "doc", exclude = ["doc.total"] } },
    { name = "order_lines", key = ["order_id", "line"], explode = "doc.lines", columns = [{ name = "order_id", path = "id" }, { name = "line", line_no = true }, { name = "sku", path = "doc.lines[].sku" }, { name = "items", count = "doc.lines" }] },
]
"#
    };
}

/// A valid pipeline with every kind of projection and sink, each route allowed.
const GOOD: &str = concat!(
    r#"
[pipeline]
name = "all_kinds"

[source]
kind = "file"
path = "changes.jsonl"

[projections.replica]
kind = "replica"
sinks = ["objects", "docs_db"]

[projections.book_docs]
kind = "document"
table = "public.books"
sinks = ["docs_db"]
fields = [{ name = "id", from = "id" }]

[projections.flat]
kind = "flatten"
table = "public.orders"
sinks = ["lake"]
"#,
    flat_outputs!(),
    r#"
[projections.invalidate]
kind = "cache_invalidation"
sinks = ["cache", "discard"]
tables = { "public.books" = { keys = ["book:{id}"] } }

[sinks.objects]
kind = "object_json"
url = "file:///tmp/out"

[sinks.docs_db]
kind = "postgres"
url = "postgres://app@db/app"

[sinks.lake]
kind = "parquet"
url = "memory:///"

[sinks.cache]
kind = "redis"
url = "redis://cache"

[sinks.discard]
kind = "null"
"#
);

/// The file source of [`GOOD`], which the PostgreSQL cases replace.
const FILE_SOURCE: &str = "kind = \"file\"\npath = \"changes.jsonl\"";

fn env(_: &str) -> Option<String> {
    None
}

/// [`GOOD`] with each `(from, to)` replaced once, in turn.
fn edit(edits: &[(&str, &str)]) -> String {
    let mut text = GOOD.to_owned();
    for (from, to) in edits {
        assert!(text.contains(from), "`{from}` is not in the pipeline");
        text = text.replacen(from, to, 1);
    }
    text
}

/// `(path, message)` of each error `load_str` reports for `text`, in order.
fn problems(text: &str) -> Vec<(String, String)> {
    match load_str("p.toml", text, &env, None) {
        Ok(_) => Vec::new(),
        Err(errors) => errors.0.into_iter().map(|e| (e.path, e.message)).collect(),
    }
}

#[test]
fn the_pipeline_with_every_kind_is_valid() {
    assert_eq!(problems(GOOD), Vec::new());
    let postgres = edit(&[(
        FILE_SOURCE,
        "kind = \"postgres\"\nurl = \"postgres://db/x\"",
    )]);
    assert_eq!(problems(&postgres), Vec::new());
}

/// Each case: (name, pipeline, path of the one error, words of its message).
#[test]
fn each_rule_names_its_field() {
    let pg = |extra: &str| {
        edit(&[(
            FILE_SOURCE,
            &format!("kind = \"postgres\"\nurl = \"postgres://db/x\"\n{extra}"),
        )])
    };
    let pipeline = |extra: &str| {
        edit(&[(
            "name = \"all_kinds\"",
            &format!("name = \"all_kinds\"\n{extra}"),
        )])
    };
    let sink = |name: &str, extra: &str| {
        let header = format!("[sinks.{name}]\n");
        edit(&[(&header, &format!("{header}{extra}\n"))])
    };
    let cases: Vec<(&str, String, &str, &str)> = vec![
        // Pipeline settings.
        (
            "pipeline name",
            edit(&[("name = \"all_kinds\"", "name = \"all kinds\"")]),
            "pipeline.name",
            "`all kinds` must be non-empty letters, digits, `-` or `_`",
        ),
        (
            "empty state_dir",
            pipeline("state_dir = \"\""),
            "pipeline.state_dir",
            "must not be empty",
        ),
        (
            "max_events",
            pipeline("batch = { max_events = 0 }"),
            "pipeline.batch.max_events",
            "must be between 1 and 1000000, found 0",
        ),
        (
            "max_bytes",
            pipeline("batch = { max_bytes = 10 }"),
            "pipeline.batch.max_bytes",
            "must be between 1024 and 1073741824, found 10",
        ),
        (
            "max_delay_ms",
            pipeline("batch = { max_delay_ms = 60001 }"),
            "pipeline.batch.max_delay_ms",
            "must be between 0 and 60000, found 60001",
        ),
        (
            "queue_depth",
            pipeline("queue_depth = 0"),
            "pipeline.queue_depth",
            "must be between 1 and 64, found 0",
        ),
        (
            "metrics_addr",
            pipeline("metrics_addr = \"localhost:9464\""),
            "pipeline.metrics_addr",
            "`localhost:9464` is not an IP address and port (like `127.0.0.1:9464`)",
        ),
        // Dead letters.
        (
            "dead letters to a path and a url",
            pipeline("dead_letter = { path = \"dl\", url = \"file:///dl\" }"),
            "pipeline.dead_letter",
            "set `path` or `url`, not both",
        ),
        (
            "dead letters to an unsupported url",
            pipeline("dead_letter = { url = \"ftp://x/dl\" }"),
            "pipeline.dead_letter.url",
            "unsupported scheme `ftp` (supported: file, memory, s3, s3a, gs, az, adl, azure, abfs, abfss, http, https)",
        ),
        (
            "dead letters to an empty path",
            pipeline("dead_letter = { path = \"\" }"),
            "pipeline.dead_letter.path",
            "must not be empty",
        ),
        // File source.
        (
            "empty source path",
            edit(&[("path = \"changes.jsonl\"", "path = \"\"")]),
            "source.path",
            "must not be empty",
        ),
        (
            "poll_interval_ms",
            edit(&[(
                "path = \"changes.jsonl\"",
                "path = \"c\"\npoll_interval_ms = 5",
            )]),
            "source.poll_interval_ms",
            "must be between 10 and 60000, found 5",
        ),
        (
            "decode_threads",
            edit(&[(
                "path = \"changes.jsonl\"",
                "path = \"c\"\ndecode_threads = 65",
            )]),
            "source.decode_threads",
            "must be between 0 and 64, found 65",
        ),
        // PostgreSQL source.
        (
            "source url",
            edit(&[(
                FILE_SOURCE,
                "kind = \"postgres\"\nurl = \"mysql://u:pw@db/x\"",
            )]),
            "source.url",
            "`mysql://u:***@db/x` is not a postgres:// URL",
        ),
        (
            "source sslmode",
            edit(&[(
                FILE_SOURCE,
                "kind = \"postgres\"\nurl = \"postgres://db/x?sslmode=on\"",
            )]),
            "source.url",
            "sslmode `on` is not one of disable, prefer, require, verify-ca, verify-full",
        ),
        (
            "slot",
            pg("slot = \"Bad-Slot\""),
            "source.slot",
            "`Bad-Slot` must be 1 to 63 lower-case letters, digits or `_`",
        ),
        (
            "publication",
            pg("publication = \"\""),
            "source.publication",
            "`` must be 1 to 63 lower-case letters, digits or `_`",
        ),
        (
            "source table",
            pg("tables = [\"public.books\", \"books\"]"),
            "source.tables[1]",
            "`books` must be written `schema.table` or `schema.*`",
        ),
        (
            "chunk_rows",
            pg("chunk_rows = 99"),
            "source.chunk_rows",
            "99 is outside 100 to 100,000",
        ),
        (
            "read_timeout_ms",
            pg("read_timeout_ms = 999"),
            "source.read_timeout_ms",
            "999 is outside 1,000 to 3,600,000",
        ),
        (
            "source unhealthy_after_ms",
            pg("unhealthy_after_ms = 99"),
            "source.unhealthy_after_ms",
            "99 is outside 100 to 86,400,000",
        ),
        // Each projection's list of sinks.
        (
            "a projection without sinks",
            edit(&[("sinks = [\"docs_db\"]", "sinks = []")]),
            "projections.book_docs.sinks",
            "must name at least one sink",
        ),
        (
            "an unknown sink",
            edit(&[(
                "sinks = [\"objects\", \"docs_db\"]",
                "sinks = [\"objects\", \"docs_db\", \"nowhere\"]",
            )]),
            "projections.replica.sinks[2]",
            "no sink named `nowhere` (sinks: cache, discard, docs_db, lake, objects)",
        ),
        // Replica projection.
        (
            "replica default_key",
            edit(&[("kind = \"replica\"", "kind = \"replica\"\ndefault_key = []")]),
            "projections.replica.default_key",
            "must name at least one column",
        ),
        (
            "replica key_columns",
            edit(&[(
                "kind = \"replica\"",
                "kind = \"replica\"\nkey_columns = { \"public.x\" = [] }",
            )]),
            "projections.replica.key_columns.public.x",
            "must name at least one column",
        ),
        (
            "replica collection",
            edit(&[(
                "kind = \"replica\"",
                "kind = \"replica\"\ncollection = \"a/b\"",
            )]),
            "projections.replica.collection",
            "`a/b` must be non-empty and contain no `/`",
        ),
        // Flatten projection.
        (
            "flatten table",
            edit(&[("table = \"public.orders\"", "table = \"\"")]),
            "projections.flat.table",
            "must name the source table",
        ),
        (
            "flatten without outputs",
            edit(&[(flat_outputs!(), "outputs = []\n")]),
            "projections.flat.outputs",
            "must declare at least one table",
        ),
        (
            "max_columns",
            edit(&[(
                "sinks = [\"lake\"]",
                "sinks = [\"lake\"]\nmax_columns = 10001",
            )]),
            "projections.flat.max_columns",
            "must be between 1 and 10000, found 10001",
        ),
        (
            "output name",
            edit(&[("name = \"orders\"", "name = \"_orders\"")]),
            "projections.flat.outputs[0].name",
            "`_orders` must be non-empty, contain no `/` and not start with `.` or `_`",
        ),
        (
            "output declared twice",
            edit(&[("name = \"order_lines\"", "name = \"orders\"")]),
            "projections.flat.outputs[1].name",
            "table `orders` is declared twice",
        ),
        (
            "too many columns",
            edit(&[("sinks = [\"lake\"]", "sinks = [\"lake\"]\nmax_columns = 3")]),
            "projections.flat.outputs[1].columns",
            "4 columns exceed max_columns = 3",
        ),
        (
            "column name",
            edit(&[("name = \"total\"", "name = \"_total\"")]),
            "projections.flat.outputs[0].columns[1].name",
            "`_total` must be non-empty and not start with `_` (refract's own columns do)",
        ),
        (
            "column declared twice",
            edit(&[("name = \"total\"", "name = \"id\"")]),
            "projections.flat.outputs[0].columns[1].name",
            "column `id` is declared twice",
        ),
        (
            "column with a path and a count",
            edit(&[(
                "count = \"doc.lines\"",
                "count = \"doc.lines\", path = \"x\"",
            )]),
            "projections.flat.outputs[1].columns[3]",
            "must have exactly one of `path`, `count` or `line_no = true`",
        ),
        (
            "line_no without explode",
            edit(&[(
                "{ name = \"total\", path = \"doc.total\" }",
                "{ name = \"total\", line_no = true }",
            )]),
            "projections.flat.outputs[0].columns[1].line_no",
            "only applies to a table with `explode`",
        ),
        (
            "column path",
            edit(&[("path = \"doc.total\"", "path = \"doc..total\"")]),
            "projections.flat.outputs[0].columns[1].path",
            "`doc..total`",
        ),
        (
            "column count",
            edit(&[("count = \"doc.lines\"", "count = \"doc..lines\"")]),
            "projections.flat.outputs[1].columns[3].count",
            "`doc..lines`",
        ),
        (
            "empty output key",
            edit(&[("key = [\"id\"]", "key = []")]),
            "projections.flat.outputs[0].key",
            "must name at least one column",
        ),
        (
            "output key not a column",
            edit(&[("key = [\"id\"]", "key = [\"id\", \"nope\"]")]),
            "projections.flat.outputs[0].key[1]",
            "`nope` is not one of the table's columns",
        ),
        (
            "exploded key without the parent's",
            edit(&[("key = [\"order_id\", \"line\"]", "key = [\"line\"]")]),
            "projections.flat.outputs[1].key",
            "an exploded table's key must include a column taken from outside the array (the parent's key)",
        ),
        (
            "unmapped under",
            edit(&[("under = \"doc\"", "under = \"\"")]),
            "projections.flat.outputs[0].unmapped.under",
            "a path must not be empty",
        ),
        (
            "unmapped exclude",
            edit(&[("exclude = [\"doc.total\"]", "exclude = [\"doc..total\"]")]),
            "projections.flat.outputs[0].unmapped.exclude[0]",
            "`doc..total`",
        ),
        (
            "unmapped separator",
            edit(&[("under = \"doc\"", "under = \"doc\", separator = \"\"")]),
            "projections.flat.outputs[0].unmapped.separator",
            "must not be empty",
        ),
        (
            "unmapped column",
            edit(&[("under = \"doc\"", "under = \"doc\", column = \"\"")]),
            "projections.flat.outputs[0].unmapped.column",
            "must not be empty",
        ),
        (
            "unmapped json column declared",
            edit(&[(
                "under = \"doc\"",
                "under = \"doc\", mode = \"json\", column = \"total\"",
            )]),
            "projections.flat.outputs[0].unmapped.column",
            "`total` is already a declared column",
        ),
        // Cache invalidation projection.
        (
            "no tables to invalidate",
            edit(&[(
                "tables = { \"public.books\" = { keys = [\"book:{id}\"] } }",
                "tables = {}",
            )]),
            "projections.invalidate.tables",
            "must name at least one table and its keys",
        ),
        (
            "no keys to invalidate",
            edit(&[("keys = [\"book:{id}\"]", "keys = []")]),
            "projections.invalidate.tables.public.books.keys",
            "must list at least one key",
        ),
        (
            "key template",
            edit(&[("keys = [\"book:{id}\"]", "keys = [\"book:{id\"]")]),
            "projections.invalidate.tables.public.books.keys[0]",
            "`book:{id`: `{` at byte 5 is not closed",
        ),
        (
            "empty version_column",
            edit(&[(
                "keys = [\"book:{id}\"]",
                "keys = [\"book:{id}\"], version_column = \"\"",
            )]),
            "projections.invalidate.tables.public.books.version_column",
            "must not be empty",
        ),
        (
            "tombstones without versions",
            sink("cache", "command = \"tombstone\""),
            "projections.invalidate.tables.public.books.version_column",
            "sink `cache` writes tombstones, which need the row's version: name a version column",
        ),
        // Each sink's writers.
        (
            "a sink nothing writes",
            edit(&[(
                "[sinks.discard]",
                "[sinks.spare]\nkind = \"null\"\n\n[sinks.discard]",
            )]),
            "sinks.spare",
            "sink `spare` is not written by any projection",
        ),
        // Object JSON sink.
        (
            "object url without a scheme",
            edit(&[("url = \"file:///tmp/out\"", "url = \"out\"")]),
            "sinks.objects.url",
            "`out` is not a URL (expected `file:///abs/dir`, `s3://bucket/prefix`, ...)",
        ),
        (
            "object url scheme",
            edit(&[("url = \"file:///tmp/out\"", "url = \"ftp://u:pw@x/out\"")]),
            "sinks.objects.url",
            "unsupported scheme `ftp`",
        ),
        (
            "relative object url",
            edit(&[("url = \"file:///tmp/out\"", "url = \"file://u:pw@out\"")]),
            "sinks.objects.url",
            "`file://u:***@out` must be an absolute file URL (`file:///abs/dir`)",
        ),
        (
            "object concurrency",
            sink("objects", "concurrency = 0"),
            "sinks.objects.concurrency",
            "must be between 1 and 1024, found 0",
        ),
        // Redis sink.
        (
            "redis url",
            edit(&[("url = \"redis://cache\"", "url = \"http://u:pw@cache\"")]),
            "sinks.cache.url",
            "`http://u:***@cache` is not a redis://, rediss:// or unix:// URL",
        ),
        (
            "pipeline_depth",
            sink("cache", "pipeline_depth = 0"),
            "sinks.cache.pipeline_depth",
            "must be between 1 and 10000, found 0",
        ),
        (
            "keys_per_command",
            sink("cache", "keys_per_command = 1001"),
            "sinks.cache.keys_per_command",
            "must be between 1 and 1000, found 1001",
        ),
        (
            "second_delete_ms",
            sink("cache", "second_delete_ms = 600001"),
            "sinks.cache.second_delete_ms",
            "must be between 0 and 600000, found 600001",
        ),
        (
            "tombstone_ttl_ms",
            sink("cache", "tombstone_ttl_ms = 0"),
            "sinks.cache.tombstone_ttl_ms",
            "must be between 1 and 86400000, found 0",
        ),
        (
            "unhealthy_after_ms",
            sink("cache", "unhealthy_after_ms = 99"),
            "sinks.cache.unhealthy_after_ms",
            "must be between 100 and 86400000, found 99",
        ),
        (
            "tls_ca_file without tls",
            sink("cache", "tls_ca_file = \"ca.pem\""),
            "sinks.cache.tls_ca_file",
            "only applies to a rediss:// (TLS) URL",
        ),
        (
            "empty fallback_file",
            sink("cache", "fallback_file = \"\""),
            "sinks.cache.fallback_file",
            "must not be empty",
        ),
        // Parquet sink.
        (
            "parquet url",
            edit(&[("url = \"memory:///\"", "url = \"lake\"")]),
            "sinks.lake.url",
            "`lake` is not a URL",
        ),
        (
            "zstd_level",
            sink("lake", "zstd_level = -1"),
            "sinks.lake.zstd_level",
            "must be between 1 and 22, found 0",
        ),
        (
            "row_group_rows",
            sink("lake", "row_group_rows = 999"),
            "sinks.lake.row_group_rows",
            "must be between 1000 and 10000000, found 999",
        ),
        (
            "roll_rows",
            sink("lake", "roll_rows = 0"),
            "sinks.lake.roll_rows",
            "must be between 1 and 100000000, found 0",
        ),
        (
            "roll_bytes",
            sink("lake", "roll_bytes = 1"),
            "sinks.lake.roll_bytes",
            "must be between 1048576 and 4294967296, found 1",
        ),
        (
            "roll_ms",
            sink("lake", "roll_ms = 99"),
            "sinks.lake.roll_ms",
            "must be between 100 and 3600000, found 99",
        ),
        (
            "buffer_bytes",
            sink("lake", "buffer_bytes = 1"),
            "sinks.lake.buffer_bytes",
            "must be between 16777216 and 68719476736, found 1",
        ),
        (
            "change_retention_days",
            sink("lake", "change_retention_days = 36501"),
            "sinks.lake.change_retention_days",
            "must be between 0 and 36500, found 36501",
        ),
        (
            "compact_interval_ms",
            sink("lake", "compact_interval_ms = 999"),
            "sinks.lake.compact_interval_ms",
            "must be between 1000 and 86400000, found 999",
        ),
        // PostgreSQL sink.
        (
            "postgres sink url",
            edit(&[(
                "url = \"postgres://app@db/app\"",
                "url = \"pg://u:pw@db/app\"",
            )]),
            "sinks.docs_db.url",
            "`pg://u:***@db/app` is not a postgres:// URL",
        ),
        (
            "postgres sink sslmode",
            edit(&[(
                "url = \"postgres://app@db/app\"",
                "url = \"postgres://u:pw@db/app?sslmode=verify_full\"",
            )]),
            "sinks.docs_db.url",
            "sslmode `verify_full` is not one of disable, prefer, require, verify-ca, verify-full",
        ),
        (
            "postgres sink verify-full without a CA",
            edit(&[(
                "url = \"postgres://app@db/app\"",
                "url = \"postgres://app@db/app?sslmode=verify-full\"",
            )]),
            "sinks.docs_db.url",
            "sslmode=verify-full needs sslrootcert",
        ),
        (
            "postgres sink schema",
            sink("docs_db", "schema = \"read-models\""),
            "sinks.docs_db.schema",
            "`read-models` must be 1 to 63 letters, digits or `_`",
        ),
        (
            "postgres sink table",
            sink("docs_db", "table = \"rm_{table}\""),
            "sinks.docs_db.table",
            "`rm_{table}` must be letters, digits, `_` and `{collection}`",
        ),
        (
            "rows_per_statement",
            sink("docs_db", "rows_per_statement = 100001"),
            "sinks.docs_db.rows_per_statement",
            "must be between 1 and 100000, found 100001",
        ),
        (
            "tombstone_retention_ms",
            sink("docs_db", "tombstone_retention_ms = 999"),
            "sinks.docs_db.tombstone_retention_ms",
            "must be between 1000 and 3153600000000, found 999",
        ),
        (
            "postgres sink table named like the tombstones",
            sink("docs_db", "table = \"refract_tombstones\""),
            "sinks.docs_db.table",
            "`refract_tombstones` is `refract_tombstones`, the table where the sink keeps its tombstones",
        ),
        (
            "a collection making the tombstones table",
            edit(&[
                (
                    "[sinks.docs_db]\n",
                    "[sinks.docs_db]\ntable = \"refract_{collection}\"\n",
                ),
                (
                    "table = \"public.books\"",
                    "table = \"public.books\"\ncollection = \"tombstones\"",
                ),
            ]),
            "sinks.docs_db.table",
            "`refract_{collection}` for collection `tombstones` is `refract_tombstones`",
        ),
    ];
    for (name, text, path, words) in &cases {
        let found = problems(text);
        assert_eq!(found.len(), 1, "{name}: {found:?}");
        let (p, message) = &found[0];
        assert_eq!(p, path, "{name}: {message}");
        assert!(message.contains(words), "{name}: {message}");
    }
}

/// Files with several errors: each case lists the paths in the order they are reported, which is
/// the order of the file's sections and, within a section, of its checks.
#[test]
fn errors_come_in_the_order_of_the_checks() {
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "no projections",
            "[pipeline]\nname = \"p\"\n[source]\nkind = \"file\"\npath = \"c\"\n[sinks.discard]\nkind = \"null\"\n".into(),
            &["projections", "sinks.discard"],
        ),
        (
            "one error per section",
            edit(&[
                ("[sinks.discard]", "[sinks.spare]\nkind = \"null\"\n\n[sinks.discard]"),
                ("url = \"redis://cache\"", "url = \"redis://cache\"\npipeline_depth = 0"),
                ("key = [\"id\"]", "key = []"),
                ("kind = \"replica\"", "kind = \"replica\"\ndefault_key = []"),
                ("path = \"changes.jsonl\"", "path = \"\""),
                ("name = \"all_kinds\"", "name = \"\"\nqueue_depth = 0\ndead_letter = { path = \"\" }"),
            ]),
            &[
                "pipeline.name",
                "pipeline.queue_depth",
                "pipeline.dead_letter.path",
                "source.path",
                "projections.flat.outputs[0].key",
                "projections.replica.default_key",
                "sinks.cache.pipeline_depth",
                "sinks.spare",
            ],
        ),
        (
            "a sink's writers before its settings",
            edit(&[
                ("[sinks.discard]", "[sinks.spare]\nkind = \"redis\"\nurl = \"x\"\n\n[sinks.discard]"),
            ]),
            &["sinks.spare", "sinks.spare.url"],
        ),
        (
            "a projection's sinks before its settings",
            edit(&[(
                "sinks = [\"objects\", \"docs_db\"]",
                "sinks = [\"objects\", \"docs_db\", \"nowhere\"]\ndefault_key = []",
            )]),
            &["projections.replica.sinks[2]", "projections.replica.default_key"],
        ),
        // Routes a sink's kind cannot take are checked from the kinds' declarations, after
        // these rules: see `refract::families`.
        (
            "tombstones with a second delete",
            edit(&[(
                "url = \"redis://cache\"",
                "url = \"redis://cache\"\ncommand = \"tombstone\"\nsecond_delete_ms = 5",
            )]),
            &[
                "projections.invalidate.tables.public.books.version_column",
                "sinks.cache.second_delete_ms",
            ],
        ),
        (
            "a bad explode and the line number it leaves without an array",
            edit(&[("explode = \"doc.lines\"", "explode = \"doc.lines[]\"")]),
            &[
                "projections.flat.outputs[1].explode",
                "projections.flat.outputs[1].columns[1].line_no",
            ],
        ),
        (
            "a table without columns",
            edit(&[(
                "columns = [{ name = \"id\", path = \"id\" }, { name = \"total\", path = \"doc.total\" }]",
                "columns = []",
            )]),
            &[
                "projections.flat.outputs[0].columns",
                "projections.flat.outputs[0].key[0]",
            ],
        ),
        (
            "a document broken everywhere",
            edit(&[(
                "fields = [{ name = \"id\", from = \"id\" }]",
                r#"fields = [{ name = "id", from = "id" }, { name = "id", from = "x.y" }]
key = ["id", "id"]
collection = "a/b"
embeds = [
    { name = "id", table = "a.b.c", key = [], limit = 0, fields = [], count = "id" },
    { name = "e2", table = "public.books", key = ["isbn"], foreign_key = "book_id", order_by = ["through.x"], ids = true, fields = [{ name = "a", from = "b" }] },
]
objects = [{ name = "", items = [] }]"#,
            )]),
            &[
                "projections.book_docs.key[1]",
                "projections.book_docs.collection",
                "projections.book_docs.fields[1].name",
                "projections.book_docs.fields[1].from",
                "projections.book_docs.key",
                "projections.book_docs.embeds[0].name",
                "projections.book_docs.embeds[0].table",
                "projections.book_docs.embeds[0].key",
                "projections.book_docs.embeds[0]",
                "projections.book_docs.embeds[0].limit",
                "projections.book_docs.embeds[0].fields",
                "projections.book_docs.embeds[0].count",
                "projections.book_docs.embeds[1].order_by[0]",
                "projections.book_docs.embeds[1].fields",
                "projections.book_docs.embeds[1].key",
                "projections.book_docs.objects[0].name",
                "projections.book_docs.objects[0].items",
            ],
        ),
        (
            "every parquet limit",
            edit(&[(
                "url = \"memory:///\"",
                "url = \"memory:///\"\nzstd_level = 0\nrow_group_rows = 0\nroll_rows = 0\nroll_bytes = 0\n\
                 roll_ms = 0\nbuffer_bytes = 0\nchange_retention_days = 36501\ncompact_interval_ms = 1",
            )]),
            &[
                "sinks.lake.zstd_level",
                "sinks.lake.row_group_rows",
                "sinks.lake.roll_rows",
                "sinks.lake.roll_bytes",
                "sinks.lake.roll_ms",
                "sinks.lake.buffer_bytes",
                "sinks.lake.change_retention_days",
                "sinks.lake.compact_interval_ms",
            ],
        ),
    ];
    for (name, text, paths) in &cases {
        let found: Vec<String> = problems(text).into_iter().map(|(p, _)| p).collect();
        assert_eq!(found, *paths, "{name}");
    }
}
