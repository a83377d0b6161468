use super::*;

const GOOD: &str = r#"
[pipeline]
name = "demo"
state_dir = "${STATE_DIR:-./state}"

[source]
kind = "file"
path = "${LOG:-changes.jsonl}"

[projections.replica]
kind = "replica"
key_columns = { "public.book_authors" = ["book_id", "author_id"] }
sinks = ["objects"]

[sinks.objects]
kind = "object_json"
url = "${OBJECT_STORE_URL:-file://${PWD}/out}"
"#;

fn env(name: &str) -> Option<String> {
    match name {
        "PWD" => Some("/srv".into()),
        "DB_PASSWORD" => Some(r#"p"a'ss]=x"#.into()),
        _ => None,
    }
}

fn errors(text: &str) -> Vec<ConfigError> {
    load_str("p.toml", text, &env, None)
        .expect_err("the file must be rejected")
        .0
}

#[test]
fn a_good_file_loads_with_defaults_and_interpolation() {
    let loaded = load_str("p.toml", GOOD, &env, None).unwrap();
    let c = &loaded.config;
    assert_eq!(c.pipeline.state_dir, "./state");
    assert_eq!(c.pipeline.batch, BatchConfig::default());
    assert_eq!(c.pipeline.on_error, OnError::DeadLetter);
    let SinkConfig::ObjectJson(s) = &c.sinks["objects"] else {
        panic!()
    };
    assert_eq!(s.url.expose(), "file:///srv/out");
    assert_eq!(
        loaded.from_env["sinks.objects.url"],
        vec!["PWD".to_string()]
    );
}

#[test]
fn a_value_with_quotes_cannot_break_the_file() {
    let text = GOOD.replace("${LOG:-changes.jsonl}", "/logs/${DB_PASSWORD}.jsonl");
    let loaded = load_str("p.toml", &text, &env, None).unwrap();
    let SourceConfig::File(f) = &loaded.config.source else {
        panic!("a file source")
    };
    assert_eq!(f.path, r#"/logs/p"a'ss]=x.jsonl"#);
    assert!(loaded.secret_paths.contains("source.path"));
}

/// Each case: (name, edit of GOOD, expected line, expected path, words the message must contain).
#[test]
fn each_error_names_line_and_field_path() {
    let cases: &[(&str, &str, &str, usize, &str, &str)] = &[
        (
            "misspelt field",
            "url = \"${OBJECT",
            "urll = \"${OBJECT",
            17,
            "sinks.objects.urll",
            "unknown field `urll`",
        ),
        (
            "wrong type",
            "name = \"demo\"",
            "name = 42",
            3,
            "pipeline.name",
            "invalid type: integer `42`",
        ),
        (
            "missing variable",
            "${LOG:-changes.jsonl}",
            "${CHANGE_LOG}",
            8,
            "source.path",
            "`CHANGE_LOG` is not set",
        ),
        (
            "unknown kind",
            "kind = \"object_json\"",
            "kind = \"objekt_json\"",
            16,
            "sinks.objects.kind",
            "unknown variant `objekt_json`",
        ),
        (
            "bad nested type",
            "sinks = [\"objects\"]",
            "sinks = \"objects\"",
            13,
            "projections.replica.sinks",
            "invalid type: string",
        ),
        (
            "range",
            "url = \"${OBJECT",
            "concurrency = 0\nurl = \"${OBJECT",
            17,
            "sinks.objects.concurrency",
            "between 1 and 1024",
        ),
        (
            "unknown sink",
            "sinks = [\"objects\"]",
            "sinks = [\"objects\", \"cache\"]",
            13,
            "projections.replica.sinks[1]",
            "no sink named `cache`",
        ),
        (
            "section field",
            "state_dir =",
            "statedir =",
            4,
            "pipeline.statedir",
            "unknown field `statedir`",
        ),
        (
            "relative file url",
            "${OBJECT_STORE_URL:-file://${PWD}/out}",
            "file://out",
            17,
            "sinks.objects.url",
            "absolute file URL",
        ),
    ];
    for (name, from, to, line, path, words) in cases {
        assert!(GOOD.contains(from), "{name}: edit does not apply");
        let errs = errors(&GOOD.replacen(from, to, 1));
        assert_eq!(errs.len(), 1, "{name}: {errs:?}");
        let e = &errs[0];
        assert_eq!((e.line, e.path.as_str()), (*line, *path), "{name}: {e}");
        assert!(e.message.contains(words), "{name}: {e}");
        assert!(
            e.to_string().starts_with(&format!("p.toml:{line}:")),
            "{name}: {e}"
        );
    }
}

#[test]
fn syntax_errors_carry_a_line() {
    let errs = errors("[pipeline]\nname = \"x\nfoo = 1\n");
    assert_eq!(errs[0].line, 2, "{}", errs[0]);
}

#[test]
fn committed_json_schema_is_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/pipeline.schema.json");
    let generated = json_schema();
    if std::env::var_os("REFRACT_UPDATE_GOLDEN").is_some() {
        std::fs::write(path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == generated,
        "schemas/pipeline.schema.json is stale: run `refract config-schema > schemas/pipeline.schema.json` \
         (or REFRACT_UPDATE_GOLDEN=1 cargo test -p refract-schemas)"
    );
    // Field docs reach the schema.
    assert!(generated.contains("Most events per batch"));
}
