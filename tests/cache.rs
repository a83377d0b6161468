//! Cache invalidation end to end: PostgreSQL (logical replication) -> `cache_invalidation` ->
//! Redis, against the real local PostgreSQL and a `redis-server` each test starts for itself.
//!
//! - deletes come strictly after their commit (MONITOR time vs the time COMMIT was sent), never
//!   for a rolled-back transaction, and a sku change deletes the id key, the old and the new sku
//!   key;
//! - Redis killed for 30 s under a write load: afterwards every key that had to go is gone, and
//!   while Redis was down the slot's `confirmed_flush_lsn` never passed the commit of the first
//!   transaction whose deletes were not delivered (commit LSNs read from the WAL with
//!   pg_walinspect);
//! - SIGKILL of refract at random moments under load, 20 times: after catch-up no key filled
//!   before a committed change survives, and keys of untouched products do.
//!
//! Each runs twice: against one `redis-server`, and against a three-master Redis Cluster the
//! test starts on loopback (the sink with `cluster = true`), except the TLS test.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::cache::*;
use common::pg::{Cleanup, catch_up, pin_wal};
use common::{Rng, Running, refract};

fn exists(conn: &mut dyn redis::ConnectionLike, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(conn).unwrap() == 1
}

fn keys(conn: &mut dyn redis::ConnectionLike, pattern: &str) -> BTreeSet<String> {
    redis::cmd("KEYS")
        .arg(pattern)
        .query::<Vec<String>>(conn)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn deletes_follow_commits_skip_rollbacks_and_cover_the_old_and_new_sku() {
    deletes_follow_commits(Flavor::Single);
}

#[test]
fn on_a_cluster_deletes_follow_commits_skip_rollbacks_and_cover_the_old_and_new_sku() {
    deletes_follow_commits(Flavor::Cluster);
}

fn deletes_follow_commits(flavor: Flavor) {
    let t = &flavor.name("cache_order");
    let _cleanup = Cleanup::new(t, &[t]);
    fresh_products(t, 200);
    let redis = TestRedis::start(flavor, false);
    let monitor = Monitor::start(&redis);
    let dir = tempfile::tempdir().unwrap();
    let pipeline = cache_pipeline(dir.path(), t, &redis.url(), &redis.sink_extra(""), "");
    catch_up(&pipeline);
    let _daemon = Running::spawn(refract().arg("run").arg(&pipeline));

    let mut pg = pg_client();
    // (keys the transaction must delete, time COMMIT was sent)
    let mut committed: Vec<(Vec<String>, f64)> = Vec::new();
    for id in 1..=40i64 {
        let mut tx = pg.transaction().unwrap();
        let mut due = vec![format!("{t}:{id}"), format!("{t}:sku:sku-{id}")];
        if id % 4 == 0 {
            tx.execute(
                &format!(
                    "UPDATE {t} SET sku = sku || '-b', updated_at = clock_timestamp() WHERE id = $1"
                ),
                &[&id],
            )
            .unwrap();
            due.push(format!("{t}:sku:sku-{id}-b"));
        } else {
            tx.execute(
                &format!("UPDATE {t} SET price_cents = price_cents + 1 WHERE id = $1"),
                &[&id],
            )
            .unwrap();
        }
        if id % 10 == 0 {
            // Two products in one transaction.
            let other = id + 100;
            tx.execute(
                &format!("UPDATE {t} SET name = 'renamed' WHERE id = $1"),
                &[&other],
            )
            .unwrap();
            due.push(format!("{t}:{other}"));
            due.push(format!("{t}:sku:sku-{other}"));
        }
        // A delete before the commit would land in this pause.
        std::thread::sleep(Duration::from_millis(60));
        let sent = now();
        tx.commit().unwrap();
        committed.push((due, sent));
    }
    // Rolled back: products 151..=160 must see no command at all.
    for id in 151..=160i64 {
        let mut tx = pg.transaction().unwrap();
        tx.execute(
            &format!("UPDATE {t} SET sku = 'rolled-back-{id}', price_cents = 0 WHERE id = $1"),
            &[&id],
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        tx.rollback().unwrap();
    }
    // A last committed change: once its key is deleted, everything before it was processed.
    pg.execute(
        &format!("UPDATE {t} SET price_cents = 1 WHERE id = 200"),
        &[],
    )
    .unwrap();
    monitor.wait_for("UNLINK", &format!("{t}:200"), Duration::from_secs(60));

    let mut deletes: BTreeMap<String, f64> = BTreeMap::new();
    for s in monitor.commands("UNLINK") {
        for key in &s.args[1..] {
            deletes.entry(key.clone()).or_insert(s.at);
        }
    }
    let mut gaps = Vec::new();
    for (due, sent) in &committed {
        for key in due {
            let at = *deletes
                .get(key)
                .unwrap_or_else(|| panic!("{key} was never deleted"));
            // MONITOR stamps microseconds; the commit happened after `sent`.
            assert!(
                at + 1e-6 >= *sent,
                "{key} deleted {:.1} ms before its transaction's COMMIT was sent",
                (sent - at) * 1000.0
            );
            gaps.push(at - sent);
        }
    }
    for id in 151..=160 {
        let mentioned: Vec<_> = monitor
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| {
                s.args
                    .iter()
                    .any(|a| a == &format!("{t}:{id}") || a.contains(&format!("rolled-back-{id}")))
            })
            .cloned()
            .collect();
        assert!(
            mentioned.is_empty(),
            "rolled-back product {id}: {mentioned:?}"
        );
    }
    gaps.sort_by(f64::total_cmp);
    println!(
        "order ({flavor:?}): {} committed transactions, {} keys deleted, every delete after its COMMIT was sent \
         (gap min {:.1} ms, median {:.1} ms, max {:.1} ms); 10 rolled-back transactions: no command",
        committed.len(),
        gaps.len(),
        gaps[0] * 1000.0,
        gaps[gaps.len() / 2] * 1000.0,
        gaps[gaps.len() - 1] * 1000.0
    );
}

/// One writer transaction of the "Redis down" test.
struct Written {
    xid: i64,
    id: i64,
    sent: f64,
}

#[test]
fn redis_down_for_30_seconds_holds_the_slot_and_loses_no_delete() {
    redis_down(Flavor::Single);
}

#[test]
fn cluster_down_for_30_seconds_holds_the_slot_and_loses_no_delete() {
    redis_down(Flavor::Cluster);
}

fn redis_down(flavor: Flavor) {
    // Leaked: the writer thread borrows it for the rest of the test.
    let t: &'static str = flavor.name("cache_down").leak();
    let products = 3000i64;
    let _cleanup = Cleanup::new(t, &[t]);
    fresh_products(t, products as u32);
    let mut redis = TestRedis::start(flavor, true);
    redis.fill((1..=products).map(|id| format!("{t}:{id}")));
    let dir = tempfile::tempdir().unwrap();
    let extra = redis.sink_extra("unhealthy_after_ms = 5000");
    let pipeline = cache_pipeline(dir.path(), t, &redis.url(), &extra, "");
    let status = free_addr();
    let text = std::fs::read_to_string(&pipeline).unwrap().replacen(
        "[pipeline.batch]",
        &format!("metrics_addr = \"{status}\"\n\n[pipeline.batch]"),
        1,
    );
    std::fs::write(&pipeline, text).unwrap();
    catch_up(&pipeline);
    let mut pg = pg_client();
    pg.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        .unwrap();
    // The commits are read back from the WAL at the end, after the daemon has confirmed them.
    pin_wal(t);
    let start_lsn: String = pg
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .unwrap()
        .get(0);
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let mut daemon = Running::spawn(
        refract()
            .arg("run")
            .arg(&pipeline)
            .env("RUST_LOG", "info")
            .stderr(log),
    );

    // The writer: one product per transaction, each product once, 50 transactions/s.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut pg = pg_client();
            let mut rng = Rng::new(4);
            let mut order: Vec<i64> = (1..=products).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut written = Vec::new();
            for id in order {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let mut tx = pg.transaction().unwrap();
                tx.execute(
                    &format!("UPDATE {t} SET price_cents = price_cents + 1 WHERE id = $1"),
                    &[&id],
                )
                .unwrap();
                let xid: i64 = tx
                    .query_one(
                        "SELECT pg_current_xact_id()::text::bigint % 4294967296",
                        &[],
                    )
                    .unwrap()
                    .get(0);
                let sent = now();
                tx.commit().unwrap();
                written.push(Written { xid, id, sent });
                std::thread::sleep(Duration::from_millis(20));
            }
            written
        })
    };
    let down_secs = 30;
    std::thread::sleep(Duration::from_secs(4));
    let killed_at = now();
    let confirmed_at_kill = confirmed_flush(&mut pg, &format!("refract_{t}"));
    redis.kill();
    let mut samples = Vec::new();
    let until = Instant::now() + Duration::from_secs(down_secs);
    while Instant::now() < until {
        samples.push(confirmed_flush(&mut pg, &format!("refract_{t}")));
        std::thread::sleep(Duration::from_millis(250));
    }
    // The daemon reports itself unhealthy while a batch waits past its bound.
    let (code, body) = http_get(&status, "/health");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("\"redis\"") && body.contains("has waited"),
        "{body}"
    );
    let (_, metrics) = http_get(&status, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("refract_sink_healthy{")
                && l.contains("sink=\"redis\"")
                && l.ends_with(" 0")),
        "{metrics}"
    );
    let wal_while_down: i64 = pg
        .query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[])
        .unwrap()
        .get(0);
    redis.start_again();
    let restarted_at = now();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    // The held deletes go out at the next retry (within about 10 s); then the daemon drains.
    let mut conn = redis.connection();
    let deadline = Instant::now() + Duration::from_secs(60);
    while written
        .iter()
        .any(|w| exists(&mut *conn, &format!("{t}:{}", w.id)))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let recovered_after = now() - restarted_at;
    let (code, body) = http_get(&status, "/health");
    assert_eq!(
        code, 200,
        "healthy again once the held deletes went out: {body}"
    );
    daemon.terminate();
    let run = daemon.wait_with_output();
    let daemon_log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(
        run.status.success(),
        "the daemon ended with {}: {}",
        run.status,
        &daemon_log[daemon_log.len().saturating_sub(3000)..]
    );
    catch_up(&pipeline);

    // Every product the writer changed lost its key; the others kept theirs.
    let changed: BTreeSet<i64> = written.iter().map(|w| w.id).collect();
    let survivors: Vec<i64> = changed
        .iter()
        .copied()
        .filter(|id| exists(&mut *conn, &format!("{t}:{id}")))
        .collect();
    assert!(
        survivors.is_empty(),
        "keys of committed changes survived: {survivors:?}"
    );
    let untouched = (1..=products).filter(|id| !changed.contains(id)).count();
    assert!(untouched > 0, "the writer must leave some products alone");
    assert_eq!(
        keys(&mut *conn, &format!("{t}:*")).len(),
        untouched,
        "untouched products keep their keys"
    );

    // The commit LSN of every writer transaction, from the WAL.
    let commits: BTreeMap<i64, u64> = pg
        .query(
            "SELECT xid::text::bigint, (start_lsn - '0/0')::bigint FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn())
             WHERE resource_manager = 'Transaction' AND record_type = 'COMMIT'",
            &[&start_lsn],
        )
        .unwrap()
        .into_iter()
        .map(|r| (r.get::<_, i64>(0), r.get::<_, i64>(1) as u64))
        .collect();
    let first_undelivered = written
        .iter()
        .filter(|w| w.sent > killed_at)
        .map(|w| commits[&w.xid])
        .min()
        .expect("transactions committed while Redis was down");
    let during: Vec<&Written> = written
        .iter()
        .filter(|w| w.sent > killed_at && w.sent < restarted_at)
        .collect();
    let max_confirmed = samples.iter().copied().max().unwrap();
    assert!(
        max_confirmed <= first_undelivered,
        "while Redis was down the slot was confirmed up to {}, past the commit {} of the first \
         transaction whose deletes were not delivered",
        lsn(max_confirmed),
        lsn(first_undelivered)
    );
    assert!(
        (wal_while_down as u64) > first_undelivered,
        "the WAL moved on while Redis was down"
    );
    let after = confirmed_flush(&mut pg, &format!("refract_{t}"));
    assert!(after > first_undelivered, "confirmed after Redis came back");
    assert!(
        daemon_log.contains("pipeline unhealthy"),
        "a delete waiting longer than unhealthy_after_ms is reported"
    );
    println!(
        "redis ({flavor:?}) down {down_secs} s: {} transactions committed meanwhile; slot confirmed_flush_lsn \
         {} at the kill, at most {} while down ({} samples), first undelivered commit at {}, WAL at \
         {} when Redis came back, confirmed {} after catch-up; {} changed products, 0 keys left, \
         {untouched} untouched keys kept; 'pipeline unhealthy' logged and /health 503 while down, 200 after; keys gone {recovered_after:.1} s \
         after Redis came back",
        during.len(),
        lsn(confirmed_at_kill),
        lsn(max_confirmed),
        samples.len(),
        lsn(first_undelivered),
        lsn(wal_while_down as u64),
        lsn(after),
        changed.len()
    );
}

#[test]
fn sigkill_at_random_moments_leaves_no_key_of_a_committed_change() {
    sigkill_at_random_moments(Flavor::Single);
}

#[test]
fn on_a_cluster_sigkill_at_random_moments_leaves_no_key_of_a_committed_change() {
    sigkill_at_random_moments(Flavor::Cluster);
}

fn sigkill_at_random_moments(flavor: Flavor) {
    let t = flavor.name("cache_crash");
    let products = 2000i64;
    let controls = 100i64;
    let _cleanup = Cleanup::new(&t, &[&t]);
    fresh_products(&t, products as u32);
    let redis = TestRedis::start(flavor, false);
    let mut conn = redis.connection();
    redis.fill((products - controls + 1..=products).map(|id| format!("{t}:{id}")));
    let dir = tempfile::tempdir().unwrap();
    let pipeline = cache_pipeline(dir.path(), &t, &redis.url(), &redis.sink_extra(""), "");
    catch_up(&pipeline);

    // The writer: a reader fills the keys of a product, then the product changes (a tenth of the
    // changes move its sku, some transactions change several products).
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let connect = redis.connector();
        let t = t.clone();
        std::thread::spawn(move || {
            let mut pg = pg_client();
            let mut cache = connect();
            let mut rng = Rng::new(7);
            let mut skus: BTreeMap<i64, String> =
                (1..=products).map(|id| (id, format!("sku-{id}"))).collect();
            let (mut txs, mut fills) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let n = if rng.below(10) == 0 { 5 } else { 1 };
                let ids: BTreeSet<i64> = (0..n)
                    .map(|_| 1 + rng.below((products - controls) as u64) as i64)
                    .collect();
                for id in &ids {
                    for key in [format!("{t}:{id}"), format!("{t}:sku:{}", skus[id])] {
                        redis::cmd("SET")
                            .arg(key)
                            .arg("cached")
                            .exec(&mut *cache)
                            .unwrap();
                        fills += 1;
                    }
                }
                let mut tx = pg.transaction().unwrap();
                for id in &ids {
                    if rng.below(10) == 0 {
                        let sku = format!("sku-{id}-{txs}");
                        tx.execute(
                            &format!("UPDATE {t} SET sku = $2 WHERE id = $1"),
                            &[id, &sku],
                        )
                        .unwrap();
                        skus.insert(*id, sku);
                    } else {
                        tx.execute(
                            &format!("UPDATE {t} SET price_cents = price_cents + 1 WHERE id = $1"),
                            &[id],
                        )
                        .unwrap();
                    }
                }
                tx.commit().unwrap();
                txs += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (txs, fills)
        })
    };
    let mut rng = Rng::new(11);
    let kills = 20;
    for _ in 0..kills {
        let mut daemon = Running::spawn(
            refract()
                .arg("run")
                .arg(&pipeline)
                .stderr(std::process::Stdio::null()),
        );
        std::thread::sleep(Duration::from_millis(300 + rng.below(1200)));
        daemon.child().kill().unwrap();
        daemon.child().wait().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (txs, fills) = writer.join().unwrap();
    catch_up(&pipeline);

    let left = keys(&mut *conn, &format!("{t}:*"));
    let control: BTreeSet<String> = (products - controls + 1..=products)
        .map(|id| format!("{t}:{id}"))
        .collect();
    let survivors: Vec<&String> = left.difference(&control).collect();
    assert!(
        survivors.is_empty(),
        "{} keys filled before a committed change survived, e.g. {:?}",
        survivors.len(),
        survivors.iter().take(5).collect::<Vec<_>>()
    );
    assert_eq!(left, control, "keys of untouched products stay");
    println!(
        "crash ({flavor:?}): {kills} SIGKILLs during {txs} writer transactions ({fills} keys filled before their \
         change): 0 survived after catch-up, {controls} untouched keys kept"
    );
}

/// `redis-cli` over TLS against `port` (as `user` when given), run to its end.
fn tls_cli_output(
    dir: &std::path::Path,
    port: u16,
    user: Option<(&str, &str)>,
    args: &[&str],
) -> std::process::Output {
    let mut cmd = std::process::Command::new("redis-cli");
    cmd.args([
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "--tls",
        "--cacert",
    ])
    .arg(dir.join("ca.pem"));
    if let Some((name, password)) = user {
        cmd.args(["--user", name, "--pass", password, "--no-auth-warning"]);
    }
    cmd.args(args).output().expect("redis-cli runs")
}

/// [`tls_cli_output`], asserting success; returns the reply.
fn tls_cli(dir: &std::path::Path, port: u16, user: Option<(&str, &str)>, args: &[&str]) -> String {
    let out = tls_cli_output(dir, port, user, args);
    assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A redis-server taking only TLS on a free port, with a certificate for 127.0.0.1 and localhost
/// signed by a private CA (`ca.pem` in the returned directory, beside `other-ca.pem`, a CA that
/// signed nothing). Returns (directory, port, server).
fn tls_redis() -> (tempfile::TempDir, u16, Running) {
    let dir = tempfile::tempdir().unwrap();
    // A private CA, and a server certificate it signed for 127.0.0.1 and localhost.
    let d = dir.path();
    std::fs::write(
        d.join("san.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    let steps: [Vec<&str>; 4] = [
        vec![
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=refract test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
        vec![
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=another test CA",
            "-keyout",
            "other-ca.key",
            "-out",
            "other-ca.pem",
        ],
        vec![
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "key.pem",
            "-out",
            "server.csr",
        ],
        vec![
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "cert.pem",
        ],
    ];
    for args in steps {
        let out = std::process::Command::new("openssl")
            .args(&args)
            .current_dir(d)
            .output()
            .expect("openssl runs");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    }
    let port = free_port();
    let server = Running::spawn(
        std::process::Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--tls-auth-clients",
                "no",
            ])
            .arg("--tls-cert-file")
            .arg(dir.path().join("cert.pem"))
            .arg("--tls-key-file")
            .arg(dir.path().join("key.pem"))
            .arg("--tls-ca-cert-file")
            .arg(dir.path().join("ca.pem"))
            .stdout(std::process::Stdio::null()),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !String::from_utf8_lossy(&tls_cli_output(dir.path(), port, None, &["PING"]).stdout)
        .contains("PONG")
    {
        assert!(
            Instant::now() < deadline,
            "the TLS redis-server did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (dir, port, server)
}

#[test]
fn tls_and_an_acl_user_from_the_environment() {
    let t = "cache_tls";
    let _cleanup = Cleanup::new(t, &[t]);
    fresh_products(t, 10);
    let (dir, port, mut server) = tls_redis();
    // Only the ACL user `refract` may do anything.
    tls_cli(
        dir.path(),
        port,
        None,
        &[
            "ACL",
            "SETUSER",
            "refract",
            "on",
            ">s3cret-pw",
            "~*",
            "+@all",
        ],
    );
    tls_cli(
        dir.path(),
        port,
        None,
        &["ACL", "SETUSER", "default", "off"],
    );
    let user = Some(("refract", "s3cret-pw"));
    for id in 1..=3 {
        tls_cli(
            dir.path(),
            port,
            user,
            &["SET", &format!("{t}:{id}"), "cached"],
        );
    }
    let pipeline = cache_pipeline(
        dir.path(),
        t,
        &format!("rediss://localhost:{port}"),
        &format!(
            "tls_ca_file = \"{}\"\nusername = \"${{REDIS_USERNAME}}\"\npassword = \"${{REDIS_PASSWORD}}\"",
            dir.path().join("ca.pem").display()
        ),
        "",
    );
    let env = [
        ("REDIS_USERNAME", "refract"),
        ("REDIS_PASSWORD", "s3cret-pw"),
    ];
    let plan = refract()
        .arg("plan")
        .arg(&pipeline)
        .envs(env)
        .output()
        .unwrap();
    let plan_text = String::from_utf8_lossy(&plan.stdout);
    assert!(plan.status.success(), "{plan:?}");
    assert!(
        plan_text.contains("as `refract` with a password") && !plan_text.contains("s3cret"),
        "{plan_text}"
    );
    // The first run creates the slot; the second replicates the changes.
    let run = |pipeline: &std::path::Path| {
        let out = refract()
            .args(["run", "--until-caught-up"])
            .arg(pipeline)
            .envs(env)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cret"));
    };
    run(&pipeline);
    common::pg::psql(&format!(
        "UPDATE {t} SET price_cents = 0 WHERE id IN (1, 2)"
    ));
    run(&pipeline);
    let exists = |id: i64| tls_cli(dir.path(), port, user, &["EXISTS", &format!("{t}:{id}")]);
    assert_eq!(
        (exists(1), exists(2), exists(3)),
        ("0".into(), "0".into(), "1".into())
    );
    server.child().kill().unwrap();
    println!(
        "tls: rediss:// with a private CA and an ACL user from REDIS_USERNAME/REDIS_PASSWORD: keys of changed products deleted, plan shows no password"
    );
}

#[test]
fn tls_refuses_a_server_signed_by_another_ca() {
    let t = "cache_tls_wrong_ca";
    let _cleanup = Cleanup::new(t, &[t]);
    fresh_products(t, 3);
    let (dir, port, mut server) = tls_redis();
    let pipeline_trusting = |ca: &str| {
        cache_pipeline(
            dir.path(),
            t,
            &format!("rediss://localhost:{port}"),
            &format!("tls_ca_file = \"{}\"", dir.path().join(ca).display()),
            "",
        )
    };
    let out = refract()
        .args(["run", "--until-caught-up"])
        .arg(pipeline_trusting("other-ca.pem"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let expected = format!(
        "TLS: the server certificate is not signed by the CA in tls_ca_file={}",
        dir.path().join("other-ca.pem").display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
    // The same server with the CA that signed its certificate: the refusal was the CA's doing.
    catch_up(&pipeline_trusting("ca.pem"));
    server.child().kill().unwrap();
    println!("tls: a Redis server signed by another CA is refused: {expected}");
}

#[test]
fn old_values_the_replica_identity_does_not_send_are_reported() {
    old_values_not_sent(Flavor::Single);
}

#[test]
fn on_a_cluster_old_values_the_replica_identity_does_not_send_are_reported() {
    old_values_not_sent(Flavor::Cluster);
}

fn old_values_not_sent(flavor: Flavor) {
    let t = &flavor.name("cache_identity");
    let _cleanup = Cleanup::new(t, &[t]);
    fresh_products(t, 5);
    common::pg::psql(&format!("ALTER TABLE {t} REPLICA IDENTITY DEFAULT"));
    let redis = TestRedis::start(flavor, false);
    let dir = tempfile::tempdir().unwrap();
    let pipeline = cache_pipeline(dir.path(), t, &redis.url(), &redis.sink_extra(""), "");
    let plan = |pipeline: &std::path::Path| {
        let out = refract().arg("plan").arg(pipeline).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = plan(&pipeline);
    assert!(
        text.contains("needs (sku) from the old row") && text.contains("REPLICA IDENTITY FULL"),
        "{text}"
    );
    // Run anyway: the sku change deletes what can be built and dead-letters the rest.
    catch_up(&pipeline);
    let mut conn = redis.connection();
    redis.fill([
        format!("{t}:1"),
        format!("{t}:sku:sku-1"),
        format!("{t}:sku:sku-1-new"),
    ]);
    common::pg::psql(&format!("UPDATE {t} SET sku = 'sku-1-new' WHERE id = 1"));
    let summary = catch_up(&pipeline);
    assert_eq!(summary["dead_letters"], 1, "{summary}");
    assert!(!exists(&mut *conn, &format!("{t}:1")));
    assert!(!exists(&mut *conn, &format!("{t}:sku:sku-1-new")));
    assert!(
        exists(&mut *conn, &format!("{t}:sku:sku-1")),
        "the old sku is unknown without the old row"
    );
    let letters =
        std::fs::read_to_string(dir.path().join(format!("state/{t}/dead-letters.ndjson"))).unwrap();
    assert!(
        letters.contains("old cache keys unknown") && letters.contains("REPLICA IDENTITY FULL"),
        "{letters}"
    );
    common::pg::psql(&format!("ALTER TABLE {t} REPLICA IDENTITY FULL"));
    assert!(
        !plan(&pipeline).contains("from the old row"),
        "FULL sends every column"
    );
}
