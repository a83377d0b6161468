//! The status page of a running daemon (`/` of `metrics_addr`), loaded in headless Chromium
//! while a PostgreSQL -> Redis pipeline runs under a write load (one product updated per
//! transaction, and now and then a row of a published table no projection reads, which is
//! dead-lettered at the `routing` stage):
//! - a screenshot under load and one with the sink down: PNGs, not blank (many colours), kept
//!   under the target directory for a person to look at (the test prints their paths);
//! - the page's DOM once its script ran (`--dump-dom` with a virtual-time budget) holds the three
//!   plots (lag in seconds, lag in bytes, throughput per sink) with data, and every figure it
//!   shows equals the same series of `/metrics` scraped right after;
//! - Redis killed: `/health` turns 503, and the page shows the sink unhealthy with its error in
//!   the recent errors.
//!
//! "The same moment" under load: the figures move with every batch, so the test stops the
//! writer and waits (polling) until the pipeline has caught up and its counters stand still: a
//! marker change committed last has reached Redis, nothing read is pending
//! (`refract_source_lag_seconds` is 0), and two scrapes in a row agree. Only then is the DOM
//! dumped and `/metrics` scraped. Two gauges move with the shared server's WAL rather than with
//! this pipeline (the slot's lag and retained WAL in bytes, which other tests' writes change):
//! they are checked to be on the page, not compared.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::cache::*;
use common::pg::{Cleanup, catch_up, hang_guard};
use common::{Running, png, refract};

/// Window of the screenshots: wide enough for the page's two columns, tall enough for all of it.
const WINDOW: &str = "--window-size=1280,1500";
/// Virtual time Chromium gives the page's script before it dumps or shoots: the first fetch of
/// `/status.json` and its rendering (time waiting on the network is not counted).
const VIRTUAL_TIME: &str = "--virtual-time-budget=4000";
/// The figures compared with `/metrics`: everything the page shows but the two gauges that
/// move with the shared server's WAL (see the module's note).
const COMPARED: &[&str] = &[
    "refract_records_read_total",
    "refract_dead_letters_total",
    "refract_sink_events_written_total",
    "refract_sink_batches_written_total",
    "refract_sink_retries_total",
    "refract_sink_queue_depth",
    "refract_source_lag_seconds",
    "refract_checkpoint_offset",
];
/// Products the writer updates; product `PRODUCTS + 1` is the marker only the test updates.
const PRODUCTS: u32 = 500;
/// Every how many transactions the writer also writes a row no projection reads.
const ORPHAN_EVERY: u64 = 25;
/// Fewest distinct colours of a screenshot that is not blank: the page has badges, three
/// plots in several colours and anti-aliased text (a blank page has one).
const MIN_COLOURS: usize = 20;

#[test]
fn the_status_page_shows_what_metrics_says_and_a_sink_going_down() {
    let t: &'static str = "status_page";
    let orphan: &'static str = "status_page_orphan";
    let _cleanup = Cleanup::new(t, &[t, orphan]);
    fresh_products(t, PRODUCTS + 1);
    common::pg::psql(&format!(
        "DROP TABLE IF EXISTS public.{orphan};
         CREATE TABLE public.{orphan} (id bigserial PRIMARY KEY, note text NOT NULL);"
    ));
    let mut redis = RedisServer::start(false);
    let dir = tempfile::tempdir().unwrap();
    let status = free_addr();
    let pipeline = pipeline_file(dir.path(), t, orphan, &redis.url(), &status);
    catch_up(&pipeline);
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let mut daemon = Running::spawn(
        refract()
            .arg("run")
            .arg(&pipeline)
            .env("RUST_LOG", "info")
            .stderr(log),
    );
    wait_for("the daemon to be ready", || {
        try_http_get(&status, "/ready").is_some_and(|(code, _)| code == 200)
    });

    let stop = Arc::new(AtomicBool::new(false));
    let writer = spawn_writer(t, orphan, stop.clone());
    // Under load until the history holds two sampled points of the sink beside the current
    // one, so that every plot (throughput is a difference of two samples) has a line.
    wait_for("three samples of the sink under load", || {
        let data = status_json(&status);
        let history = data["history"].as_array().unwrap();
        let of_sink = history.iter().filter(|s| s["events"]["redis"].is_number());
        of_sink.count() >= 3
            && history
                .iter()
                .any(|s| s["events"]["redis"].as_f64() > Some(0.0))
    });
    let artifacts = artifacts_dir();
    let under_load = artifacts.join("under_load.png");
    screenshot(&status, &under_load);
    stop.store(true, Ordering::Relaxed);
    let transactions = writer.join().unwrap();
    assert!(
        transactions > ORPHAN_EVERY,
        "the writer committed {transactions} transactions"
    );

    // Caught up: a key the last committed change invalidates is gone, nothing is pending, and
    // the figures stand still between two scrapes.
    let marker = PRODUCTS + 1;
    redis.fill([format!("{t}:{marker}")]);
    common::pg::psql(&format!(
        "UPDATE public.{t} SET price_cents = price_cents + 1 WHERE id = {marker}"
    ));
    let mut conn = redis.connection();
    wait_for("the marker change to reach Redis", || {
        !redis::cmd("EXISTS")
            .arg(format!("{t}:{marker}"))
            .query::<bool>(&mut conn)
            .unwrap()
    });
    let mut previous = BTreeMap::new();
    wait_for("the figures to stand still", || {
        let now = compared(&http_get(&status, "/metrics").1);
        let still = now == previous && now.values().all(|v| v.is_finite());
        let idle = now
            .iter()
            .any(|(s, v)| s.starts_with("refract_source_lag_seconds") && *v == 0.0);
        previous = now;
        still && idle
    });
    let dom = dump_dom(&status);
    let metrics = http_get(&status, "/metrics").1;
    check_figures(&dom, &metrics);
    check_plots(&dom);

    // Redis down: the sink's next batch waits past `unhealthy_after_ms`.
    redis.kill();
    common::pg::psql(&format!(
        "UPDATE public.{t} SET price_cents = price_cents + 1 WHERE id = 2"
    ));
    wait_for("/health to turn 503", || {
        http_get(&status, "/health").0 == 503
    });
    let sink_down = check_sink_down(&status, &artifacts);
    daemon.terminate();
    println!(
        "status page screenshots: {} (under load), {} (sink down)",
        under_load.display(),
        sink_down.display()
    );
}

/// With the sink down (`/health` 503): the page shows it unhealthy and its retries in the recent
/// errors; returns the screenshot's path.
fn check_sink_down(status: &str, artifacts: &Path) -> PathBuf {
    let (_, health) = http_get(status, "/health");
    assert!(health.contains("\"redis\""), "{health}");
    let dom = dump_dom(status);
    let sink_health = element_text(&dom, "data-health=\"redis\"", "</td>");
    assert!(sink_health.contains("unhealthy"), "{sink_health}");
    let errors = element_text(&dom, "id=\"errors\"", SECTION_END);
    assert!(
        errors.contains("redis") && errors.contains("failed, retrying"),
        "the recent errors name the sink's retries: {errors}"
    );
    let overall = element_text(&dom, "id=\"overall\"", "</span>");
    assert!(overall.contains("unhealthy"), "{overall}");
    let sink_down = artifacts.join("sink_down.png");
    screenshot(status, &sink_down);
    sink_down
}

/// Commits one product update per transaction (and every [`ORPHAN_EVERY`]th transaction a row
/// no projection reads) until `stop`; returns how many transactions it committed.
fn spawn_writer(
    t: &'static str,
    orphan: &'static str,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut pg = pg_client();
        let mut committed = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let id = i64::from(committed as u32 % PRODUCTS + 1);
            let mut tx = pg.transaction().unwrap();
            tx.execute(
                &format!("UPDATE public.{t} SET price_cents = price_cents + 1 WHERE id = $1"),
                &[&id],
            )
            .unwrap();
            let since_orphan = committed % ORPHAN_EVERY;
            if since_orphan == 0 {
                tx.execute(
                    &format!("INSERT INTO public.{orphan} (note) VALUES ('read by no projection')"),
                    &[],
                )
                .unwrap();
            }
            tx.commit().unwrap();
            committed += 1;
        }
        committed
    })
}

/// The pipeline file: `t` into the cache at `redis_url`, `orphan` published but read by no
/// projection, the status endpoint at `status`.
fn pipeline_file(dir: &Path, t: &str, orphan: &str, redis_url: &str, status: &str) -> PathBuf {
    let pipeline = cache_pipeline(dir, t, redis_url, "unhealthy_after_ms = 1000", "");
    let text = std::fs::read_to_string(&pipeline)
        .unwrap()
        .replacen(
            "[pipeline.batch]",
            &format!("metrics_addr = \"{status}\"\n\n[pipeline.batch]"),
            1,
        )
        .replacen(
            &format!("tables = [\"public.{t}\"]"),
            &format!("tables = [\"public.{t}\", \"public.{orphan}\"]"),
            1,
        );
    std::fs::write(&pipeline, text).unwrap();
    pipeline
}

/// Polls `condition` until it holds; fails the test past [`hang_guard`].
fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + hang_guard();
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn status_json(status: &str) -> serde_json::Value {
    let (code, body) = http_get(status, "/status.json");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Where the screenshots are kept after the test (under the target directory).
fn artifacts_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status_page");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs headless Chromium on the status page with `args`; returns what it printed.
fn chromium(status: &str, args: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args([WINDOW, VIRTUAL_TIME])
        .args(args)
        .arg(format!("http://{status}/"))
        .output()
        .expect("chromium runs (scripts/test installs Debian's package)");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn dump_dom(status: &str) -> String {
    chromium(status, &["--dump-dom"])
}

/// A screenshot of the page at `path`, checked to be a PNG of the window's size that is not
/// blank.
fn screenshot(status: &str, path: &Path) {
    let _ = std::fs::remove_file(path);
    chromium(status, &[&format!("--screenshot={}", path.display())]);
    let bytes = std::fs::read(path).expect("chromium wrote the screenshot");
    let (width, height, colours) = png::colours(&bytes);
    assert_eq!((width, height), (1280, 1500), "{}", path.display());
    assert!(
        colours >= MIN_COLOURS,
        "{} has {colours} colours: blank?",
        path.display()
    );
}

/// The series of `/metrics` that the page's figures are compared with.
fn compared(metrics: &str) -> BTreeMap<String, f64> {
    metrics
        .lines()
        .filter(|l| {
            COMPARED.iter().any(|name| {
                l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))
            })
        })
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The page's figures: `(series, value)` of each element tagged `data-series`.
fn figures(dom: &str) -> Vec<(String, f64)> {
    dom.split("class=\"fig\" data-series=\"")
        .skip(1)
        .map(|rest| {
            let (series, after) = rest.split_once('"').unwrap();
            let value = after[after.find('>').unwrap() + 1..]
                .split('<')
                .next()
                .unwrap();
            let series = series
                .replace("&quot;", "\"")
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&amp;", "&");
            (series, value.parse().unwrap_or(f64::NAN))
        })
        .collect()
}

/// Every compared figure on the page equals `/metrics`; the ones the test relies on are there.
fn check_figures(dom: &str, metrics: &str) {
    let scraped = compared(metrics);
    let shown: Vec<(String, f64)> = figures(dom)
        .into_iter()
        .filter(|(s, _)| COMPARED.iter().any(|name| s.starts_with(name)))
        .collect();
    for (series, value) in &shown {
        assert_eq!(
            scraped.get(series),
            Some(value),
            "the page shows {series} = {value}, /metrics says {:?}",
            scraped.get(series)
        );
    }
    let value = |prefix: &str, label: &str| {
        shown
            .iter()
            .find(|(s, _)| s.starts_with(prefix) && s.contains(label))
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("the page shows no {prefix} {label}: {shown:?}"))
    };
    assert!(value("refract_sink_events_written_total", "sink=\"redis\"") > 0.0);
    assert!(value("refract_sink_batches_written_total", "sink=\"redis\"") > 0.0);
    assert!(value("refract_dead_letters_total", "stage=\"routing\"") > 0.0);
    assert!(value("refract_checkpoint_offset", "partition=") > 0.0);
    assert!(value("refract_records_read_total", "") > 0.0);
    let all = figures(dom);
    assert!(
        all.iter()
            .any(|(s, _)| s.starts_with("refract_slot_lag_bytes")),
        "the page shows the slot's lag in bytes: {all:?}"
    );
    let letters = element_text(dom, "id=\"dead-letters\"", SECTION_END);
    assert!(
        letters.contains("no projection reads table") && letters.contains("routing"),
        "the page lists the latest dead letters with their reasons: {letters}"
    );
}

/// Each plot is drawn with data: an SVG whose polyline has points.
fn check_plots(dom: &str) {
    for plot in ["plot-lag-seconds", "plot-lag-bytes", "plot-throughput"] {
        let svg = element_text(dom, &format!("id=\"{plot}\""), SECTION_END);
        // The lags' one line, the sink's line of the throughput.
        let line = if plot == "plot-throughput" {
            "data-series=\"redis\""
        } else {
            "<polyline"
        };
        let points = svg
            .split(line)
            .nth(1)
            .and_then(|p| p.split(" points=\"").nth(1))
            .and_then(|p| p.split('"').next())
            .unwrap_or_else(|| panic!("{plot} has no polyline: {svg}"));
        assert!(
            points.split(' ').count() >= 2,
            "{plot} plots a line: {points}"
        );
    }
}

/// Where a section of the page ends.
const SECTION_END: &str = "</section>";

/// The markup from the element carrying `attribute` to the first `end` after it.
fn element_text<'a>(dom: &'a str, attribute: &str, end: &str) -> &'a str {
    let start = dom
        .find(attribute)
        .unwrap_or_else(|| panic!("no element with {attribute} in the page"));
    let end = dom[start..].find(end).map_or(dom.len(), |e| start + e);
    &dom[start..end]
}
