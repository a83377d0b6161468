//! The rules of the Kafka source and of the tiers projection and sink.

use super::{FILE_SOURCE, edit, problems};

/// A Kafka source: its own rules, and the projections it cannot feed.
#[test]
fn kafka_source_rules_name_their_field() {
    let kafka = |source: &str| {
        format!(
            "[pipeline]\nname = \"k\"\n\n[source]\nkind = \"kafka\"\nbrokers = \"b:9092\"\n{source}\n\n\
             [projections.r]\nkind = \"replica\"\nsinks = [\"s\"]\n\n[sinks.s]\nkind = \"null\"\n"
        )
    };
    assert_eq!(
        problems(&kafka("topics = [\"a.b.c\", \"^a\\\\..*\"]")),
        Vec::new()
    );
    let cases = [
        ("topics = []", "source.topics", "at least one topic"),
        (
            "topics = [\"a b\"]",
            "source.topics[0]",
            "is not a topic name",
        ),
        (
            "topics = [\"t\"]\nformat = \"debezium_avro\"",
            "source.schema_registry",
            "needs a schema registry",
        ),
        (
            "topics = [\"t\"]\nschema_registry = { url = \"ftp://r\" }",
            "source.schema_registry.url",
            "is not an http(s):// URL",
        ),
        (
            "topics = [\"t\"]\nproperties = { \"enable.auto.commit\" = \"true\" }",
            "source.properties.\"enable.auto.commit\"",
            "is set by refract",
        ),
    ];
    for (source, path, words) in cases {
        let found = problems(&kafka(source));
        assert_eq!(found.len(), 1, "{source}: {found:?}");
        assert_eq!(found[0].0, path, "{source}");
        assert!(found[0].1.contains(words), "{source}: {}", found[0].1);
    }
    // The document projection of the pipeline with every kind cannot read Kafka.
    let documents = edit(&[(
        FILE_SOURCE,
        "kind = \"kafka\"\nbrokers = \"b\"\ntopics = [\"t\"]",
    )]);
    let found = problems(&documents);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, "projections.book_docs");
    assert!(
        found[0].1.contains("cannot read a Kafka source"),
        "{}",
        found[0].1
    );
}

/// A tiers projection and its sink: their own rules, one projection per sink, and the clock.
#[test]
fn tiers_rules_name_their_field() {
    let tiers = |projection: &str, sink: &str, extra: &str| {
        format!(
            "[pipeline]\nname = \"t\"\n{extra}\n\n[source]\nkind = \"file\"\npath = \"h.jsonl\"\n\n\
             [projections.hb]\nkind = \"tiers\"\ntable = \"device_heartbeats\"\n\
             columns = [{{ name = \"battery\", type = \"real\" }}]\nsinks = [\"t\"]\n{projection}\n\n\
             [sinks.t]\nkind = \"tiers\"\nhot = {{ url = \"redis://r\" }}\n\
             warm = {{ url = \"postgres://db/x\" }}\ncold = {{ url = \"file:///tmp/cold\" }}\n{sink}\n"
        )
    };
    assert_eq!(problems(&tiers("", "", "")), Vec::new());
    assert_eq!(
        problems(&tiers(
            "hot = \"90m\"\nwarm = \"7d\"",
            "",
            "clock = \"2026-01-01T00:00:00Z x60\""
        )),
        Vec::new()
    );
    let cases = [
        (
            "hot = \"soon\"",
            "",
            "",
            "projections.hb.hot",
            "is not a duration",
        ),
        ("hot = \"30s\"", "", "", "projections.hb.hot", "at least 1m"),
        (
            "warm = \"2h30m\"",
            "",
            "",
            "projections.hb.warm",
            "an hour longer",
        ),
        (
            "device = \"Device\"",
            "",
            "",
            "projections.hb.device",
            "lower-case",
        ),
        (
            "columns = []",
            "",
            "",
            "projections.hb.columns",
            "at least one",
        ),
        (
            "columns = [{ name = \"ts\", type = \"int\" }]",
            "",
            "",
            "projections.hb.columns[0].name",
            "declared twice",
        ),
        (
            "",
            "warm = { url = \"mysql://db\" }",
            "",
            "sinks.t.warm.url",
            "postgres://",
        ),
        (
            "",
            "warm = { url = \"postgres://db\", table = \"a.b.c\" }",
            "",
            "sinks.t.warm.table",
            "schema.table",
        ),
        (
            "",
            "warm = { url = \"postgres://db\", partitions_ahead = 0 }",
            "",
            "sinks.t.warm.partitions_ahead",
            "between 1 and 168",
        ),
        (
            "",
            "hot = { url = \"http://r\" }",
            "",
            "sinks.t.hot.url",
            "redis://",
        ),
        (
            "",
            "aging_interval_ms = 10",
            "",
            "sinks.t.aging_interval_ms",
            "between",
        ),
        (
            "",
            "",
            "clock = \"yesterday\"",
            "pipeline.clock",
            "RFC 3339",
        ),
    ];
    for (projection, sink, extra, path, words) in cases {
        let own_columns = usize::from(projection.starts_with("columns"));
        let text = tiers(projection, sink, extra)
            .replacen(
                "columns = [{ name = \"battery\", type = \"real\" }]\n",
                "",
                own_columns,
            )
            .replacen(
                "hot = { url = \"redis://r\" }\n",
                "",
                usize::from(sink.starts_with("hot")),
            )
            .replacen(
                "warm = { url = \"postgres://db/x\" }\n",
                "",
                usize::from(sink.starts_with("warm")),
            );
        let found = problems(&text);
        assert_eq!(found.len(), 1, "{projection} {sink} {extra}: {found:?}");
        assert_eq!(found[0].0, path, "{projection} {sink} {extra}");
        assert!(found[0].1.contains(words), "{path}: {}", found[0].1);
    }
    // A tiers sink is written by one tiers projection only.
    let replica = tiers("", "", "") + "\n[projections.copy]\nkind = \"replica\"\nsinks = [\"t\"]\n";
    let found = problems(&replica);
    assert!(
        found
            .iter()
            .any(|(p, m)| p == "sinks.t" && m.contains("exactly one projection of kind `tiers`")),
        "{found:?}"
    );
}
