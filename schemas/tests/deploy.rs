//! The monitoring files under `deploy/` (the Grafana dashboard and the Prometheus alert rules)
//! name only metrics refract exports: each `refract_*` name they query is declared as a string
//! in the runtime's or a connector's source. (`promtool check rules` and `promtool test rules`
//! check the rules themselves; `scripts/test` runs them.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the schemas crate lives in the workspace")
        .to_path_buf()
}

/// Every `refract_[a-z_]+` word of `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(found) = text[at..].find("refract_") {
        let start = at + found;
        let mut end = start + "refract_".len();
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        let before_ok =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        if before_ok {
            names.insert(text[start..end].to_owned());
        }
        at = end;
    }
    names
}

/// The metric names declared as string literals in the Rust sources under `dir`.
fn declared(dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            declared(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            for name in metric_names(&text) {
                if text.contains(&format!("\"{name}\"")) {
                    out.insert(name);
                }
            }
        }
    }
}

/// The PromQL expressions of the dashboard's panels.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    for panel in dashboard["panels"]
        .as_array()
        .expect("the dashboard has panels")
    {
        for target in panel["targets"]
            .as_array()
            .expect("every panel has targets")
        {
            exprs.push(
                target["expr"]
                    .as_str()
                    .expect("every target has an expr")
                    .to_owned(),
            );
        }
    }
    exprs
}

#[test]
fn the_dashboard_and_the_alert_rules_query_metrics_refract_exports() {
    let root = workspace();
    let mut exported = BTreeSet::new();
    declared(&root.join("pipelines/src"), &mut exported);
    declared(&root.join("connectors/src"), &mut exported);
    assert!(exported.contains("refract_sink_healthy"), "{exported:?}");

    let text = std::fs::read_to_string(root.join("deploy/grafana/refract.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 10, "{} queries", exprs.len());
    let rules = std::fs::read_to_string(root.join("deploy/prometheus/refract-alerts.yml")).unwrap();
    let expr_lines: Vec<&str> = rules
        .lines()
        .filter(|l| l.trim_start().starts_with("expr:"))
        .collect();
    assert!(expr_lines.len() >= 4, "{expr_lines:?}");

    for (file, expr) in exprs
        .iter()
        .map(|e| ("deploy/grafana/refract.json", e.as_str()))
        .chain(
            expr_lines
                .iter()
                .map(|e| ("deploy/prometheus/refract-alerts.yml", *e)),
        )
    {
        let names = metric_names(expr);
        assert!(
            !names.is_empty(),
            "{file}: `{expr}` queries no refract metric"
        );
        for name in names {
            // A histogram's series carry suffixes its declaration does not.
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            assert!(
                exported.contains(&name) || exported.contains(base),
                "{file}: `{name}` in `{expr}` is not a metric refract exports"
            );
        }
    }
}
