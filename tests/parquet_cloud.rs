//! The Parquet sink on cloud object stores, each a real server of its protocol installed by
//! scripts/test: S3 (moto, from PyPI) and Azure Blob Storage (Azurite, from npm).
//!
//! On S3 the server sits behind a TCP proxy the test takes down and brings back, as an outage of
//! the store. The daemon starts while the store is down, rides out an outage under a stream of
//! changes, and is killed (SIGKILL) during a second one; after a catch-up run the current state
//! read back with pyarrow equals the change log, with no change twice in the log. On Azure, two
//! runs (the second compacting over the first's current state) give the same.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::cache::free_port;
use common::parquet::*;
use common::*;
use serde_json::json;

const BUCKET: &str = "lake";

/// A TCP proxy on `port` in front of `target`. Down, it answers every request `503 Service
/// Unavailable` (counted in `refused`) and cuts the connections it was forwarding; up again, it
/// forwards as before. The server behind it keeps its state (moto keeps buckets in memory:
/// stopping it would lose them).
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
}

impl Proxy {
    /// A proxy that starts down.
    fn new(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (up, refused) = (Arc::new(AtomicBool::new(false)), Arc::default());
        let (serving, counting) = (up.clone(), Arc::clone(&refused));
        std::thread::spawn(move || serve(&listener, target, &serving, &counting));
        Self { port, up, refused }
    }

    fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::SeqCst);
        // The serving thread notices within a poll.
        std::thread::sleep(Duration::from_millis(50));
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

fn serve(listener: &TcpListener, target: u16, up: &AtomicBool, refused: &AtomicUsize) {
    listener.set_nonblocking(true).unwrap();
    let mut forwarding: Vec<TcpStream> = Vec::new();
    loop {
        if !up.load(Ordering::SeqCst) {
            for stream in forwarding.drain(..) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        let Ok((client, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        client.set_nonblocking(false).unwrap();
        if !up.load(Ordering::SeqCst) {
            refused.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || unavailable(client));
            continue;
        }
        let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
            continue;
        };
        forwarding.extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
        pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
        pipe(server, client);
    }
}

/// Reads a request's head and answers 503.
fn unavailable(mut client: TcpStream) {
    client
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match client.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let _ = client.write_all(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
    let _ = client.shutdown(Shutdown::Both);
}

/// Copies `from` into `to` on a thread of its own until either side closes.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// moto's S3 server on `port`, with the bucket made; killed when dropped.
fn s3_server(port: u16) -> Running {
    let server = listening(
        port,
        Command::new("python3").args(["-m", "moto.server", "-H", "127.0.0.1", "-p"]),
    );
    boto3(port, &format!("s3.create_bucket(Bucket='{BUCKET}')"));
    server
}

/// Azurite's blob service on `port`, with the container made; killed when dropped.
fn azurite(port: u16) -> Running {
    let server = listening(
        port,
        Command::new("azurite-blob")
            .args(["--inMemoryPersistence", "--disableTelemetry"])
            .args([
                "--skipApiVersionCheck",
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
            ]),
    );
    azure_blob(port, &format!("blobs.create_container('{BUCKET}')"));
    server
}

/// Starts `server` with `port` as its last argument, its output discarded, and waits until it
/// listens there.
fn listening(port: u16, server: &mut Command) -> Running {
    let what = format!("{server:?}");
    let running = Running::spawn(
        server
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    running
}

/// Runs `code` with `blobs`, an azure-storage-blob client of Azurite on `port` (its well-known
/// development account).
fn azure_blob(port: u16, code: &str) {
    python(&format!(
        "import os\n\
         from azure.storage.blob import BlobServiceClient\n\
         blobs = BlobServiceClient.from_connection_string('DefaultEndpointsProtocol=http;\
         AccountName=devstoreaccount1;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;\
         BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;')\n{code}\n"
    ));
}

fn python(script: &str) {
    let run = output(Command::new("python3").arg("-c").arg(script));
    assert!(
        run.status.success(),
        "python: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The sink's emulator switch and address, from the environment as users give them.
fn azure_env(cmd: &mut Command, port: u16) -> &mut Command {
    cmd.env("AZURE_STORAGE_USE_EMULATOR", "true").env(
        "AZURITE_BLOB_STORAGE_URL",
        format!("http://127.0.0.1:{port}"),
    )
}

/// Runs `code` with `s3`, a boto3 client of the server on `port`.
fn boto3(port: u16, code: &str) {
    python(&format!(
        "import boto3, os, sys\n\
         s3 = boto3.client('s3', endpoint_url='http://127.0.0.1:{port}', aws_access_key_id='test', \
         aws_secret_access_key='test', region_name='us-east-1')\n{code}\n"
    ));
}

/// The sink's credentials and endpoint, from the environment as users give them.
fn s3_env(cmd: &mut Command, port: u16) -> &mut Command {
    cmd.env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
}

/// Changes `from..to` of a deterministic stream of orders: creates, updates (a new status and
/// items) and deletes, at positions 10 apart; `live` is kept as the orders' state after them:
/// order id → (status, total, item skus), as [`parquet_orders`] reads it back.
fn changes(
    from: u64,
    to: u64,
    live: &mut BTreeMap<String, (String, i64, Vec<String>)>,
) -> Vec<String> {
    (from..to)
        .map(|step| {
            // Each 200 changes over 150 orders of their own: what a lost change did is not
            // written over by a later stretch.
            let id = format!("o{}", step * 7 % 150 + 1 + 150 * (step / 200));
            let lsn = 10 * (step + 1);
            if live.contains_key(&id) && step % 5 == 0 {
                live.remove(&id);
                return envelope("d", &id, Some(json!({"id": id})), None, lsn);
            }
            let items = (step % 4 + 1) as usize;
            let status = format!("s{step}");
            let row = order(&id, (step % 40) as u32, items, json!({"status": status}));
            let skus = (0..items).map(|i| format!("sku-{i}")).collect();
            let op = if live.contains_key(&id) { "u" } else { "c" };
            live.insert(id.clone(), (status, 100 * items as i64, skus));
            envelope(op, &id, None, Some(row), lsn)
        })
        .collect()
}

fn append(log: &Path, lines: &[String]) {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .unwrap();
    for line in lines {
        writeln!(file, "{line}").unwrap();
    }
}

/// A bucket that does not exist is retried (it may be on its way), and the log says why:
/// the store's answer, not only what refract was doing.
#[test]
fn a_missing_bucket_is_named_in_the_log() {
    let s3_port = free_port();
    let _server = s3_server(s3_port);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    append(&log, &changes(0, 10, &mut BTreeMap::new()));
    let pipeline = cloud_pipeline(dir.path(), &log, "s3://no-such-bucket/analytics");
    let stderr = dir.path().join("daemon.log");
    let mut daemon = Running::spawn(
        s3_env(refract().arg("run").arg(&pipeline), s3_port)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap()),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let logged = std::fs::read_to_string(&stderr).unwrap();
        if logged.contains("open failed, retrying") {
            assert!(logged.contains("NoSuchBucket"), "{logged}");
            break;
        }
        assert!(Instant::now() < deadline, "no retry logged: {logged}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(daemon.child().try_wait().unwrap().is_none(), "it gave up");
}

/// `dir/p.toml`: the shipped flatten sections over `log` (followed) into `url`, publishing files
/// every 200 ms and compacting every second.
fn cloud_pipeline(dir: &Path, log: &Path, url: &str) -> std::path::PathBuf {
    let local = dir.join("unused");
    let pipeline = file_pipeline(
        dir,
        log,
        &local,
        50,
        "roll_ms = 200\ncompact_interval_ms = 1000",
        true,
    );
    let text = std::fs::read_to_string(&pipeline)
        .unwrap()
        .replace(&format!("file://{}", local.display()), url);
    std::fs::write(&pipeline, text).unwrap();
    pipeline
}

#[test]
fn parquet_on_s3_rides_out_a_store_outage_and_current_equals_the_log() {
    let s3_port = free_port();
    let _server = s3_server(s3_port);
    let proxy = Proxy::new(s3_port);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let mut live = BTreeMap::new();
    append(&log, &changes(0, 200, &mut live));
    // Files every 200 ms and a compaction every second: both meet the outage.
    let pipeline = cloud_pipeline(dir.path(), &log, &format!("s3://{BUCKET}/analytics"));

    // The store is down when the daemon starts.
    let daemon_log = dir.path().join("daemon.log");
    let mut daemon = Running::spawn(
        s3_env(refract().arg("run").arg(&pipeline), proxy.port)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&daemon_log).unwrap()),
    );
    std::thread::sleep(Duration::from_secs(2));
    let mut refused = proxy.refused();
    assert!(
        refused > 0,
        "the daemon sent nothing while the store was down"
    );
    proxy.set_up(true);
    // Down again under a stream of changes, twice: the daemon rides out the first outage and is
    // killed (SIGKILL) during the second, with what it read since unpublished.
    for (from, to, kill) in [(200, 400, false), (400, 600, true)] {
        std::thread::sleep(Duration::from_millis(1500));
        proxy.set_up(false);
        append(&log, &changes(from, to, &mut live));
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            proxy.refused() > refused,
            "the daemon sent nothing during the outage"
        );
        refused = proxy.refused();
        if kill {
            daemon.child().kill().unwrap();
            daemon.child().wait().unwrap();
        }
        proxy.set_up(true);
    }
    append(&log, &changes(600, 800, &mut live));
    let logged = std::fs::read_to_string(&daemon_log).unwrap();
    assert!(
        !logged.contains("ERROR") && !logged.contains("panicked"),
        "{logged}"
    );

    // The restart replays what the killed daemon left unpublished; then the bucket is read back.
    caught_up(&pipeline, s3_env, proxy.port);
    let copy = dir.path().join("copy");
    boto3(
        s3_port,
        &format!(
            "for page in s3.get_paginator('list_objects_v2').paginate(Bucket='{BUCKET}', Prefix='analytics/'):\n\
             \x20   for o in page.get('Contents', []):\n\
             \x20       path = os.path.join('{}', o['Key'][len('analytics/'):])\n\
             \x20       os.makedirs(os.path.dirname(path), exist_ok=True)\n\
             \x20       s3.download_file('{BUCKET}', o['Key'], path)",
            copy.display()
        ),
    );
    assert_output(&copy, &live);
}

/// Runs `refract run PIPELINE --until-caught-up` with the store's environment (`env` of the
/// store on `port`), which must succeed.
fn caught_up(pipeline: &Path, env: fn(&mut Command, u16) -> &mut Command, port: u16) {
    let run = output(env(
        refract().arg("run").arg(pipeline).arg("--until-caught-up"),
        port,
    ));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The output copied to `copy`, read back with pyarrow: valid footers, no change twice in the
/// log, and the orders of `current/` as `live` says.
fn assert_output(copy: &Path, live: &BTreeMap<String, (String, i64, Vec<String>)>) {
    let result = read_back(copy);
    assert_eq!(result["bad_files"], json!([]), "{result}");
    for t in ["orders", "customers", "order_items"] {
        assert_eq!(
            result["tables"][t]["duplicate_changes"], 0,
            "{t}: a change is in the log twice"
        );
    }
    assert_eq!(
        &parquet_orders(&result),
        live,
        "current/ against the change log"
    );
}

#[test]
fn parquet_on_azure_blob_storage_equals_the_log_over_two_runs() {
    let port = free_port();
    let _server = azurite(port);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("changes.jsonl");
    let pipeline = cloud_pipeline(dir.path(), &log, &format!("az://{BUCKET}/analytics"));
    let mut live = BTreeMap::new();
    // The second run compacts over the current state the first one published.
    for (from, to) in [(0, 200), (200, 400)] {
        append(&log, &changes(from, to, &mut live));
        caught_up(&pipeline, azure_env, port);
    }
    let copy = dir.path().join("copy");
    azure_blob(
        port,
        &format!(
            "container = blobs.get_container_client('{BUCKET}')\n\
             for blob in container.list_blobs(name_starts_with='analytics/'):\n\
             \x20   path = os.path.join('{}', blob.name[len('analytics/'):])\n\
             \x20   os.makedirs(os.path.dirname(path), exist_ok=True)\n\
             \x20   open(path, 'wb').write(container.download_blob(blob.name).readall())",
            copy.display()
        ),
    );
    assert_output(&copy, &live);
}
