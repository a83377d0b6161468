//! Helpers of the Parquet sink's end-to-end tests: the shipped flatten pipeline pointed at a test
//! directory or bucket, change events of the showcase `customer_orders` table, and the output
//! read back with pyarrow (tests/parquet_read.py, an independent reader).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use super::{output, refract};

/// The shipped pipeline's projection and sink (pipelines/orders-analytics.toml), reading
/// `table`, writing under `out`, with `sink_extra` lines in the sink section.
pub fn flatten_sections(table: &str, out: &Path, sink_extra: &str) -> String {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("orders-analytics.toml"),
    )
    .unwrap();
    let start = shipped
        .find("# --- flatten ---")
        .expect("the flatten marker");
    let mut sections = shipped[start..]
        .replace(
            "table = \"customer_orders\"",
            &format!("table = \"{table}\""),
        )
        .lines()
        .map(|l| {
            if l.starts_with("url = ") {
                format!("url = \"file://{}\"\n{sink_extra}", out.display())
            } else {
                l.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    sections.push('\n');
    sections
}

/// The output read by pyarrow (tests/parquet_read.py).
pub fn read_back(out: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/parquet_read.py");
    let run = Command::new("python3")
        .arg(script)
        .arg(out)
        .output()
        .expect("python3 runs");
    assert!(
        run.status.success(),
        "pyarrow could not read the output: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    serde_json::from_slice(&run.stdout).expect("the reader prints JSON")
}

pub fn envelope(
    op: &str,
    id: &str,
    before: Option<Value>,
    after: Option<Value>,
    lsn: u64,
) -> String {
    json!({
        "before": before, "after": after, "op": op,
        "source": {"connector": "postgresql", "db": "refract", "schema": "public", "table": "customer_orders",
                   "txId": lsn, "lsn": lsn, "ts_ms": 1_790_000_000_000u64 + lsn},
        "ts_ms": 1_790_000_000_000u64 + lsn,
        "id_for_humans": id,
    })
    .to_string()
}

pub fn order(id: &str, customer: u32, items: usize, extra: Value) -> Value {
    let mut doc = json!({
        "status": "paid",
        "created_at": "2026-09-22T10:31:00Z",
        "total_cents": 100 * items,
        "customer": {"id": format!("c{customer}"), "name": format!("Customer {customer}"),
                     "contactDetails": [{"email": format!("c{customer}@example.com")},
                                        {"phone": format!("+1 555 {customer:04}"), "extension": 5555}],
                     "billingAddress": {"line1": "100 Some Street", "city": "Seattle", "state": "WA", "zip": "98012"}},
        "shipping": {"method": "ground", "status": "pending",
                     "address": {"line1": "1 Main St", "city": "Portland", "state": "OR", "zip": "97201"}},
        "items": (0..items).map(|i| json!({"sku": format!("sku-{i}"), "qty": i + 1, "unit_price_cents": 100})).collect::<Vec<_>>(),
    });
    if let (Value::Object(d), Value::Object(e)) = (&mut doc, extra) {
        d.extend(e);
    }
    // Debezium sends a jsonb column as a string holding the document.
    json!({"id": id, "doc": doc.to_string(), "updated_at": "2026-09-22T10:31:00.000000Z"})
}

/// Writes `dir/p.toml`: the shipped flatten sections over the change log `log` (file source,
/// followed or read to its end, `max_events` per batch, `sink_extra` lines in the sink section)
/// into `out`, with its state under `dir`.
pub fn file_pipeline(
    dir: &Path,
    log: &Path,
    out: &Path,
    max_events: usize,
    sink_extra: &str,
    follow: bool,
) -> std::path::PathBuf {
    let pipeline = dir.join("p.toml");
    std::fs::write(
        &pipeline,
        format!(
            "[pipeline]\nname = \"flat\"\nstate_dir = \"{}\"\n[pipeline.batch]\nmax_events = {max_events}\n\
             [source]\nkind = \"file\"\npath = \"{}\"\nfollow = {follow}\n{}",
            dir.join("state").display(),
            log.display(),
            flatten_sections("customer_orders", out, sink_extra)
        ),
    )
    .unwrap();
    pipeline
}

/// Every change-log row and current row of `keys` in `table` (keyed by `key_column`), one per
/// line, sorted by key and position: what a failing test reports.
pub fn history(out: &Path, table: &str, key_column: &str, keys: &[&String]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/parquet_read.py");
    let run = Command::new("python3")
        .arg(script)
        .args(["--history"])
        .arg(out)
        .args([table, key_column])
        .args(keys.iter().map(|k| k.as_str()))
        .output()
        .expect("python3 runs");
    format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    )
}

/// Runs `refract compact PIPELINE`, which must succeed.
pub fn compact(pipeline: &Path) {
    let run = output(refract().arg("compact").arg(pipeline));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// A current state's rows as sorted JSON texts, to compare states row for row.
pub fn sorted_rows(v: &Value) -> Vec<String> {
    let mut rows: Vec<String> = v.as_array().unwrap().iter().map(Value::to_string).collect();
    rows.sort();
    rows
}

/// The same, from the Parquet current state.
pub fn parquet_orders(result: &Value) -> BTreeMap<String, (String, i64, Vec<String>)> {
    let mut items: BTreeMap<String, BTreeMap<i64, String>> = BTreeMap::new();
    for r in result["tables"]["order_items"]["current"]
        .as_array()
        .unwrap()
    {
        items
            .entry(r["order_id"].as_str().unwrap().to_owned())
            .or_default()
            .insert(
                r["line_no"].as_i64().unwrap(),
                r["sku"].as_str().unwrap().to_owned(),
            );
    }
    let mut orders: BTreeMap<String, (String, i64, Vec<String>)> =
        result["tables"]["orders"]["current"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let id = r["order_id"].as_str().unwrap().to_owned();
                let skus = items
                    .remove(&id)
                    .unwrap_or_default()
                    .into_values()
                    .collect();
                (
                    id,
                    (
                        r["status"].as_str().unwrap().to_owned(),
                        r["total_cents"].as_i64().unwrap(),
                        skus,
                    ),
                )
            })
            .collect();
    for (id, i) in items {
        orders.insert(
            id,
            (
                "<items without an order>".into(),
                -1,
                i.into_values().collect(),
            ),
        );
    }
    orders
}
