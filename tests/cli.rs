//! The command line: config errors name file, line and field path; `plan` never prints a secret;
//! every shipped pipeline validates; the embedded demo runs to completion with no service; the
//! daemon runs without transparent huge pages.

mod common;

use std::path::Path;

use common::*;

const WORKSPACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

const GOOD: &str = r#"[pipeline]
name = "cli"
state_dir = "/tmp/refract-cli-state"

[source]
kind = "file"
path = "/data/${API_TOKEN:-none}/changes.jsonl"

[projections.replica]
kind = "replica"
sinks = ["docs"]

[sinks.docs]
kind = "object_json"
url = "https://svc:${HTTP_PASSWORD:-x}@objects.example/bucket"
"#;

fn validate(dir: &Path, text: &str) -> (Option<i32>, String, String) {
    let path = dir.join("p.toml");
    std::fs::write(&path, text).unwrap();
    let out = output(
        refract()
            .arg("validate")
            .arg(&path)
            .env_remove("API_TOKEN")
            .env_remove("CHANGE_LOG"),
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn config_errors_name_file_line_and_field_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.toml").display().to_string();
    // (edit, expected "file:line:col: `path`: words")
    let cases = [
        (
            "kind = \"object_json\"\n",
            "kind = \"object_json\"\nconcurency = 8\n",
            15,
            "sinks.docs.concurency",
            "unknown field `concurency`",
        ),
        (
            "name = \"cli\"",
            "name = [\"cli\"]",
            2,
            "pipeline.name",
            "invalid type: sequence, expected a string",
        ),
        (
            "${API_TOKEN:-none}",
            "${CHANGE_LOG}",
            7,
            "source.path",
            "environment variable `CHANGE_LOG` is not set",
        ),
    ];
    for (from, to, line, path, words) in cases {
        let (code, _, stderr) = validate(dir.path(), &GOOD.replacen(from, to, 1));
        assert_eq!(code, Some(2), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "one clear error: {stderr}");
        let prefix = format!("{file}:{line}:");
        assert!(stderr.starts_with(&prefix), "want {prefix} in {stderr}");
        assert!(
            stderr.contains(&format!("`{path}`: ")) && stderr.contains(words),
            "{stderr}"
        );
    }
    let (code, stdout, stderr) = validate(dir.path(), GOOD);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("ok"));
}

#[test]
fn plan_masks_url_passwords_that_are_not_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.toml");
    std::fs::write(&path, GOOD.replace("${HTTP_PASSWORD:-x}", "literal-secret")).unwrap();
    let out = output(refract().arg("plan").arg(&path));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("https://svc:***@objects.example/bucket"),
        "{stdout}"
    );
    assert!(!stdout.contains("literal-secret"), "{stdout}");
}

#[test]
fn plan_never_prints_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.toml");
    std::fs::write(&path, GOOD).unwrap();
    let secret_token = "tok-9f8e7d6c";
    let secret_password = "pa\"ss'w0rd]";
    let out = output(
        refract()
            .arg("plan")
            .arg(&path)
            .env("API_TOKEN", secret_token)
            .env("HTTP_PASSWORD", secret_password),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stdout.matches("*** (secret)").count(),
        2,
        "the token path and the password URL are masked: {stdout}"
    );
    for secret in [secret_token, secret_password, "w0rd"] {
        assert!(
            !stdout.contains(secret) && !stderr.contains(secret),
            "{secret} leaked: {stdout}{stderr}"
        );
    }
    assert!(
        stdout.contains("API_TOKEN") && stdout.contains("HTTP_PASSWORD"),
        "variable names are shown: {stdout}"
    );
}

#[test]
fn every_shipped_pipeline_validates() {
    let mut shipped: Vec<_> = std::fs::read_dir(Path::new(WORKSPACE).join("pipelines"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml") && !p.ends_with("Cargo.toml"))
        .collect();
    shipped.sort();
    assert!(!shipped.is_empty());
    let out = output(
        refract()
            .arg("validate")
            .args(&shipped)
            .current_dir(WORKSPACE),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_committed_json_schema_matches_the_binary() {
    let out = output(refract().arg("config-schema"));
    let committed =
        std::fs::read_to_string(Path::new(WORKSPACE).join("schemas/pipeline.schema.json")).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), committed);
}

/// A `redis://` URL nothing answers at.
fn unreachable_redis() -> String {
    format!("redis://127.0.0.1:{}", common::cache::free_port())
}

/// Runs the demo into `dir` (state and output) against the Redis at `redis_url`, asserting
/// success; returns its stdout.
fn run_demo(dir: &Path, redis_url: &str) -> String {
    let out_dir = dir.join("out");
    let run = output(
        refract()
            .args(["run", "pipelines/demo.toml"])
            .current_dir(WORKSPACE)
            .env("STATE_DIR", dir.join("state"))
            .env("DEMO_OUT", &out_dir)
            .env("REDIS_URL", redis_url)
            .env("OBJECT_STORE_URL", format!("file://{}", out_dir.display())),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    String::from_utf8_lossy(&run.stdout).into_owned()
}

#[test]
fn the_demo_runs_to_completion_without_services() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let stdout = run_demo(dir.path(), &unreachable_redis());
    assert!(stdout.contains("dead letters   0"), "{stdout}");
    assert!(stdout.contains("records read   4255"), "{stdout}");
    let docs = read_output(&out_dir);
    let count = |c: &str| docs.keys().filter(|(coll, _)| coll == c).count();
    assert_eq!(count("authors"), 40);
    for c in [
        "books",
        "book_authors",
        "products",
        "customer_orders",
        "device_heartbeats",
        "orders",
    ] {
        assert!(count(c) > 0, "no {c} documents");
    }
    // The nested customer_orders documents, flattened: pyarrow reads one current row per live
    // order (as many as the replica's documents), each file with a valid footer.
    let analytics = common::parquet::read_back(&out_dir.join("analytics"));
    assert_eq!(analytics["bad_files"], serde_json::json!([]));
    assert_eq!(
        analytics["tables"]["orders"]["current"]
            .as_array()
            .unwrap()
            .len(),
        count("customer_orders")
    );
    assert!(
        !analytics["tables"]["order_items"]["current"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    // The wrapped `orders` events had their logical types converted.
    let order = docs.iter().find(|((c, _), _)| c == "orders").unwrap().1;
    assert!(
        order["total_amount"]
            .as_str()
            .is_some_and(|s| s.contains('.')),
        "{order}"
    );
    assert!(
        order["created_at"].as_str().is_some_and(|s| s.len() == 26),
        "{order}"
    );
    // The denormalized documents agree with the replicated rows: every book document embeds its
    // linked authors (by position, then id) with their current names, every author document
    // lists its books and counts them.
    let row = |c: &str, k: &str| docs.get(&(c.to_owned(), k.to_owned()));
    assert_eq!(count("book_docs"), count("books"));
    assert_eq!(count("author_docs"), count("authors"));
    for ((c, book), doc) in &docs {
        if c != "book_docs" {
            continue;
        }
        let mut links: Vec<(i64, String)> = docs
            .iter()
            .filter(|((c, _), l)| c == "book_authors" && l["book_id"] == book.as_str())
            .map(|(_, l)| {
                (
                    l["position"].as_i64().unwrap(),
                    l["author_id"].as_str().unwrap().to_owned(),
                )
            })
            .filter(|(_, a)| row("authors", a).is_some())
            .collect();
        links.sort();
        let embedded: Vec<serde_json::Value> = links
            .iter()
            .map(|(_, a)| {
                let author = row("authors", a).unwrap();
                serde_json::json!({
                    "id": a,
                    "name": format!("{} {}", author["first_name"].as_str().unwrap(), author["last_name"].as_str().unwrap()),
                    "thumbnailUrl": author["thumbnail_url"],
                })
            })
            .collect();
        assert_eq!(
            doc["authors"],
            serde_json::Value::Array(embedded),
            "book {book}"
        );
    }
    let linked = docs
        .iter()
        .filter(|((c, _), l)| {
            c == "book_authors" && row("books", l["book_id"].as_str().unwrap()).is_some()
        })
        .count() as u64;
    let counted: u64 = docs
        .iter()
        .filter(|((c, _), _)| c == "author_docs")
        .map(|(_, d)| d["countOfBooks"].as_u64().unwrap())
        .sum();
    assert!(linked > 0);
    assert_eq!(counted, linked);
    // Without Redis the cache invalidations went to the fallback file, and the summary says so.
    let commands = std::fs::read_to_string(out_dir.join("redis-commands.txt")).unwrap();
    assert!(
        stdout.contains("NOTE") && stdout.contains("redis-commands.txt"),
        "{stdout}"
    );
    for (_, id) in docs.keys().filter(|(c, _)| c == "products") {
        assert!(
            commands.contains(&format!("\"UNLINK\" \"demo:product:{id}:v3\"")),
            "product {id} invalidated"
        );
    }
}

#[test]
fn the_demo_invalidates_product_keys_in_a_redis_that_answers() {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    // Every product id the log touches, as a reader would have cached it.
    let log =
        std::fs::read_to_string(Path::new(WORKSPACE).join("pipelines/demo/changes.jsonl")).unwrap();
    let mut keys = std::collections::BTreeSet::new();
    for line in log.lines().filter(|l| l.contains(r#""table":"products""#)) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for image in ["before", "after"] {
            if let Some(row) = v[image].as_object() {
                keys.insert(format!("demo:product:{}:v3", row["id"]));
                keys.insert(format!(
                    "demo:product:sku:{}:v3",
                    row["sku"].as_str().unwrap()
                ));
            }
        }
    }
    assert!(keys.len() > 20, "{keys:?}");
    for k in &keys {
        redis::cmd("SET")
            .arg(k)
            .arg("cached")
            .exec(&mut redis)
            .unwrap();
    }
    let stdout = run_demo(dir.path(), &redis_url);
    assert!(!stdout.contains("NOTE"), "{stdout}");
    assert!(!out_dir.join("redis-commands.txt").exists());
    let left: Vec<&String> = keys
        .iter()
        .filter(|k| {
            redis::cmd("EXISTS")
                .arg(*k)
                .query::<i64>(&mut redis)
                .unwrap()
                == 1
        })
        .collect();
    assert!(
        left.is_empty(),
        "keys of changed products survived: {left:?}"
    );
}

/// The daemon turns transparent huge pages off for itself: with them, mimalloc's release and
/// reuse of memory made the kernel zero whole 2 MiB pages (a tenth of a flatten run's CPU).
#[test]
fn the_daemon_runs_without_transparent_huge_pages() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    std::fs::write(&log, "").unwrap();
    let pipeline = dir.path().join("p.toml");
    std::fs::write(
        &pipeline,
        format!(
            "[pipeline]\nname = \"thp\"\nstate_dir = \"{state}\"\n[source]\nkind = \"file\"\npath = \"{log}\"\n\
             follow = true\n[projections.replica]\nkind = \"replica\"\nsinks = [\"null\"]\n[sinks.null]\nkind = \"null\"\n",
            state = dir.path().join("state").display(),
            log = log.display(),
        ),
    )
    .unwrap();
    let mut daemon = quiet_daemon(&pipeline);
    let status = format!("/proc/{}/status", daemon.child().id());
    // The setting is made first thing in main; by the time the state directory exists it is on.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !dir.path().join("state").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon never started"
        );
        assert!(
            daemon.child().try_wait().unwrap().is_none(),
            "the daemon ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let text = std::fs::read_to_string(&status).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("THP_enabled:"))
        .expect("this kernel reports THP_enabled in /proc/PID/status");
    assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
    daemon.terminate();
}

#[test]
fn a_migration_file_is_validated_with_lines_and_field_paths() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.toml");
    std::fs::write(
        &file,
        r#"[migration]
name = "orders_v2"
url = "postgres://127.0.0.1/db"
source = "orders"
target = "orders_v2"

[columns.region]
pattern = '^x$'

[columns.total_cents]
from = "total_amount"
transform = "scale"
factor = 150
"#,
    )
    .unwrap();
    let out = output(refract().arg("validate").arg(&file));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(":8:")
            && stderr.contains("`columns.region.pattern`: is not used by transform `copy`"),
        "{stderr}"
    );
    assert!(
        stderr.contains(":13:")
            && stderr.contains("`columns.total_cents.factor`: must be a power of ten"),
        "{stderr}"
    );
}
