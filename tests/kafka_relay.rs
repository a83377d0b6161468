//! PostgreSQL -> relay -> Kafka sink -> Kafka source -> replica: refract as a Debezium without a
//! JVM. After the initial snapshot, under a pgbench load of inserts, updates and deletes, the
//! relay is SIGKILLed again and again; a second process reads the topic into documents; at the
//! end the documents equal the table, row for row. Then every broker goes down for 10 s while
//! both processes run: they retry, and again nothing is lost.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pg::{catch_up, drop_slot, pgbench, psql, url};
use common::{Rng, Running, in_ci, quiet_daemon, read_output, read_output_live};
use serde_json::Value;

const TABLE: &str = "kafka_relay_items";
const PREFIX: &str = "relay";
const PARTITIONS: i32 = 6;
/// How long every broker is down while the relay produces and the reader consumes.
const BROKER_OUTAGE: Duration = Duration::from_secs(10);

fn fresh_table(rows: u64) {
    drop_slot(TABLE);
    psql(&format!(
        "DROP TABLE IF EXISTS public.{TABLE};
         CREATE TABLE public.{TABLE} (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(20,2), note text);
         ALTER TABLE public.{TABLE} REPLICA IDENTITY FULL;
         INSERT INTO public.{TABLE} SELECT g, 'row ' || g, g % 13, g * 0.25 - 100, NULL FROM generate_series(1, {rows}) g;"
    ));
}

/// The table as the read model must hold it (numerics as exact strings, as refract keeps them).
fn table_state() -> BTreeMap<(String, String), Value> {
    let json = psql(&format!(
        "SELECT coalesce(json_agg(json_build_object('id', id, 'name', name, 'qty', qty, 'price', price::text, 'note', note)), '[]') FROM public.{TABLE}"
    ));
    let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
    rows.into_iter()
        .map(|r| ((TABLE.to_owned(), r["id"].to_string()), r))
        .collect()
}

fn write(dir: &Path, name: &str, text: String) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The relay: the table's changes, with its initial snapshot, as Debezium envelopes on
/// `{PREFIX}.public.{TABLE}`.
fn relay_pipeline(dir: &Path, brokers: &str) -> PathBuf {
    write(
        dir,
        TABLE,
        format!(
            "[pipeline]\nname = \"{TABLE}\"\nstate_dir = \"{state}\"\n\n[pipeline.batch]\nmax_events = 500\nmax_delay_ms = 50\n\n\
             [source]\nkind = \"postgres\"\nurl = \"{url}\"\ntables = [\"public.{TABLE}\"]\n\n\
             [projections.relay]\nkind = \"relay\"\nsinks = [\"kafka\"]\n\n\
             [sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\ntopic_prefix = \"{PREFIX}\"\n",
            state = dir.join("relay-state").display(),
            url = url(),
        ),
    )
}

/// The reader: the topic into one JSON document per row under `out`.
fn reader_pipeline(dir: &Path, brokers: &str, out: &Path) -> PathBuf {
    write(
        dir,
        "reader",
        format!(
            "[pipeline]\nname = \"reader\"\nstate_dir = \"{state}\"\n\n[pipeline.batch]\nmax_delay_ms = 50\n\n\
             [source]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\ntopics = [\"{PREFIX}.public.{TABLE}\"]\ngroup_id = \"relay-reader\"\n\n\
             [projections.replica]\nkind = \"replica\"\nsinks = [\"docs\"]\n\n\
             [sinks.docs]\nkind = \"object_json\"\nurl = \"file://{out}\"\n",
            state = dir.join("reader-state").display(),
            out = out.display(),
        ),
    )
}

/// Inserts, updates and deletes at `rate` transactions/s for `seconds`.
fn load(rows: u64, rate: u32, seconds: u32) -> Running {
    let script = std::env::temp_dir().join("refract_kafka_relay_load.sql");
    std::fs::write(
        &script,
        format!(
            "\\set u random(1, {rows})\n\\set d random(1, {rows})\n\\set i random({rows}, {})\n\
             UPDATE {TABLE} SET qty = coalesce(qty, 0) + 1, name = 'load ' || :u, price = price + 0.01 WHERE id = :u;\n\
             DELETE FROM {TABLE} WHERE id = :d;\n\
             INSERT INTO {TABLE} VALUES (:i, 'new', 1, -1.50, 'n') ON CONFLICT (id) DO UPDATE SET note = 'again';\n",
            rows * 2
        ),
    )
    .unwrap();
    Command::new(pgbench())
        .args([
            "-n",
            "-c",
            "2",
            "-R",
            &rate.to_string(),
            "-T",
            &seconds.to_string(),
            "-f",
        ])
        .arg(&script)
        .arg(url())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map(Running::adopt)
        .expect("pgbench starts")
}

#[test]
fn relay_killed_again_and_again_under_load_loses_nothing_downstream() {
    let rows = if in_ci() { 5_000 } else { 20_000 };
    let kills_wanted = if in_ci() { 10 } else { 15 };
    fresh_table(rows);
    let cluster = common::kafka::cluster(&[&format!("{PREFIX}.public.{TABLE}")], PARTITIONS);
    // A slow network: a message is acknowledged 100 ms after it is sent, so a relay that
    // confirmed the slot before its messages were acknowledged would lose them to the kills.
    for broker in 1..=3 {
        cluster
            .broker_round_trip_time(broker, Duration::from_millis(100))
            .expect("round-trip time set");
    }
    let brokers = cluster.bootstrap_servers();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let relay = relay_pipeline(dir.path(), &brokers);
    let reader = reader_pipeline(dir.path(), &brokers, &out);

    // The initial snapshot first, in one run; the kills hit the stream.
    catch_up(&relay);
    let mut reader_daemon = quiet_daemon(&reader);
    let mut writes = load(rows, 300, 600);
    let mut rng = Rng::new(22);
    let mut kills = 0;
    let started = Instant::now();
    while kills < kills_wanted {
        let mut daemon = quiet_daemon(&relay);
        std::thread::sleep(Duration::from_millis(400 + rng.below(900)));
        let child = daemon.child();
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the relay kept exiting by itself"
        );
    }
    // Every broker down for 10 s while the relay produces and the reader consumes, the load
    // still writing: both retry, and nothing is lost.
    let mut daemon = quiet_daemon(&relay);
    std::thread::sleep(Duration::from_secs(1));
    for broker in 1..=3 {
        cluster.broker_down(broker).expect("broker down");
    }
    std::thread::sleep(BROKER_OUTAGE);
    for broker in 1..=3 {
        cluster.broker_up(broker).expect("broker up");
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        daemon.child().try_wait().unwrap().is_none(),
        "the relay rode out the outage"
    );
    daemon.terminate();
    assert!(
        daemon.child().wait().unwrap().success(),
        "the relay stops cleanly after the outage"
    );
    let live_documents = read_output_live(&out).len();
    let load_running = writes.child().try_wait().unwrap().is_none();
    writes.child().kill().unwrap();
    writes.child().wait().unwrap();

    // The last relay run catches up with the table; then the reader drains the topic.
    catch_up(&relay);
    reader_daemon.terminate();
    assert!(
        reader_daemon.child().wait().unwrap().success(),
        "the reader stops cleanly"
    );
    catch_up(&reader);
    let expected = table_state();
    let actual = read_output(&out);
    let diff = common::diff(&expected, &actual);
    assert!(
        diff.is_empty(),
        "{} differences, first: {:?}",
        diff.len(),
        &diff[..diff.len().min(5)]
    );
    eprintln!(
        "relay: {rows} rows snapshotted, {kills} SIGKILLs and a {BROKER_OUTAGE:?} outage of every broker under load (load still running: {load_running}), \
         {live_documents} documents while it ran; {} rows equal downstream",
        expected.len()
    );
    drop_slot(TABLE);
}
