//! Where validation learns which write operations each kind exchanges: the projections'
//! registry says what each projection kind emits, the connectors' registry what each sink kind
//! accepts. Every command loads its pipeline file through [`load`], so a route from a
//! projection to a sink that cannot take its operations is refused before anything runs.

use std::path::Path;

use refract_schemas::config::{
    self, ConfigErrors, Families, LoadedPipeline, ProjectionConfig, SinkConfig,
};
use refract_schemas::write::OpFamily;

/// The declarations of the kinds this binary is built with.
pub struct Registries;

impl Families for Registries {
    fn emits(&self, projection: &ProjectionConfig) -> &'static [OpFamily] {
        refract_projections::emits(projection)
    }

    fn accepts(&self, sink: &SinkConfig) -> &'static [OpFamily] {
        refract_connectors::registry::accepts(sink)
    }
}

/// Reads and validates a pipeline file, routes included (see [`config::load`]).
pub fn load(path: &Path) -> Result<LoadedPipeline, ConfigErrors> {
    config::load(path, &Registries)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid section of each projection kind, writing to sink `s`.
    const PROJECTIONS: &[(&str, &str)] = &[
        ("replica", "kind = \"replica\"\nsinks = [\"s\"]"),
        (
            "cache_invalidation",
            "kind = \"cache_invalidation\"\nsinks = [\"s\"]\n\
             [projections.p.tables.products]\nkeys = [\"product:{id}\"]",
        ),
        (
            "flatten",
            "kind = \"flatten\"\nsinks = [\"s\"]\ntable = \"orders\"\n\
             [[projections.p.outputs]]\nname = \"orders\"\nkey = [\"id\"]\n\
             columns = [{ name = \"id\", path = \"id\" }]",
        ),
        (
            "document",
            "kind = \"document\"\nsinks = [\"s\"]\ntable = \"public.books\"\n\
             fields = [{ name = \"id\", from = \"id\" }]",
        ),
        ("relay", "kind = \"relay\"\nsinks = [\"s\"]"),
        (
            "tiers",
            "kind = \"tiers\"\nsinks = [\"s\"]\ntable = \"hb\"\n\
             columns = [{ name = \"v\", type = \"int\" }]",
        ),
    ];

    /// A minimal valid section of each sink kind.
    const SINKS: &[(&str, &str)] = &[
        (
            "object_json",
            "kind = \"object_json\"\nurl = \"file:///tmp/refract-routes\"",
        ),
        (
            "redis",
            "kind = \"redis\"\nurl = \"redis://127.0.0.1:6379\"",
        ),
        (
            "parquet",
            "kind = \"parquet\"\nurl = \"file:///tmp/refract-routes\"",
        ),
        (
            "postgres",
            "kind = \"postgres\"\nurl = \"postgres://u@127.0.0.1/db\"",
        ),
        (
            "kafka",
            "kind = \"kafka\"\nbrokers = \"127.0.0.1:9092\"\ntopic_prefix = \"shop\"",
        ),
        (
            "tiers",
            "kind = \"tiers\"\nhot = { url = \"redis://r\" }\n\
             warm = { url = \"postgres://u@127.0.0.1/db\" }\ncold = { url = \"file:///tmp/c\" }",
        ),
        ("null", "kind = \"null\""),
    ];

    /// The pairs that work, written out here as an independent model of what each kind does:
    /// documents go to document stores and caches, invalidations to caches, flat rows to
    /// columnar files, change events (and documents) to Kafka; the null sink takes everything.
    const WORKS: &[(&str, &str)] = &[
        ("replica", "object_json"),
        ("replica", "redis"),
        ("replica", "postgres"),
        ("replica", "null"),
        ("document", "object_json"),
        ("document", "redis"),
        ("document", "postgres"),
        ("document", "null"),
        ("replica", "kafka"),
        ("document", "kafka"),
        ("relay", "kafka"),
        ("relay", "null"),
        ("cache_invalidation", "redis"),
        ("cache_invalidation", "null"),
        ("flatten", "parquet"),
        ("flatten", "null"),
        ("tiers", "tiers"),
        ("tiers", "null"),
    ];

    fn pipeline(projection: &str, sink: &str) -> String {
        format!(
            "[pipeline]\nname = \"routes\"\n\
             [source]\nkind = \"file\"\npath = \"/tmp/refract-routes.jsonl\"\n\
             [projections.p]\n{projection}\n\
             [sinks.s]\n{sink}\n"
        )
    }

    /// The `kind` values the JSON Schema lists under `definition` (`ProjectionConfig`, ...).
    fn schema_kinds(definition: &str) -> Vec<String> {
        let text = include_str!("../../schemas/pipeline.schema.json");
        let schema: serde_json::Value = serde_json::from_str(text).expect("the schema parses");
        schema["$defs"][definition]["oneOf"]
            .as_array()
            .expect("a oneOf of kinds")
            .iter()
            .map(|v| {
                v["properties"]["kind"]["const"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    #[test]
    fn the_tables_cover_every_kind_of_the_schema() {
        let names = |t: &[(&str, &str)]| {
            let mut v: Vec<String> = t.iter().map(|(k, _)| (*k).to_owned()).collect();
            v.sort();
            v
        };
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        assert_eq!(names(PROJECTIONS), sorted(schema_kinds("ProjectionConfig")));
        assert_eq!(names(SINKS), sorted(schema_kinds("SinkConfig")));
    }

    #[test]
    fn every_pair_of_projection_and_sink_kinds_that_cannot_work_together_fails_validate_naming_both()
     {
        let mut wrong = Vec::new();
        for (projection, projection_toml) in PROJECTIONS {
            for (sink, sink_toml) in SINKS {
                let text = pipeline(projection_toml, sink_toml);
                let result = config::load_str("routes.toml", &text, &|_| None, Some(&Registries));
                let route_errors: Vec<String> = match &result {
                    Ok(_) => Vec::new(),
                    Err(errors) => errors
                        .0
                        .iter()
                        .filter(|e| e.path == "projections.p.sinks[0]")
                        .map(|e| e.to_string())
                        .collect(),
                };
                let works = WORKS.contains(&(projection, sink));
                let named = route_errors.iter().any(|e| {
                    e.contains(&format!("(kind `{projection}`)"))
                        && e.contains(&format!("(kind `{sink}`)"))
                        && e.contains("routes.toml:")
                });
                let as_expected = if works {
                    result.is_ok()
                } else {
                    named && route_errors.len() == 1
                };
                if !as_expected {
                    wrong.push(format!(
                        "{projection} -> {sink}: expected {}, got {result:?}",
                        if works {
                            "to load"
                        } else {
                            "one route error naming both"
                        }
                    ));
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn a_route_error_says_what_the_sink_accepts() {
        let text = pipeline(PROJECTIONS[2].1, SINKS[1].1);
        let errors = config::load_str("routes.toml", &text, &|_| None, Some(&Registries))
            .expect_err("flat rows cannot go to Redis");
        let message = errors.to_string();
        assert!(
            message.contains(
                "`projections.p.sinks[0]`: projection `p` (kind `flatten`) writes flat table \
                 rows, which sink `s` (kind `redis`) cannot take: it accepts documents and \
                 cache invalidations"
            ),
            "{message}"
        );
    }
}
