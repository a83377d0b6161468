//! The Kafka source at scale against librdkafka's in-process mock cluster (three brokers, the
//! real protocol on loopback), writing a replica into PostgreSQL:
//!
//! - three `refract run` members of one consumer group share a 6-partition topic while keyed
//!   Debezium events stream in; one is SIGKILLed and one SIGTERMed mid-stream, the survivor
//!   takes every partition and the table ends equal to the model computed from what was
//!   produced, no key ever went back to an older version, and the group's committed offsets
//!   reach the topic's end;
//! - one member rides out all brokers down for 10 s, and while the target table refuses writes
//!   the group's committed offsets never pass what the table holds.

mod common;
#[path = "kafka_scale/support.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::pg::{Session, hang_guard, psql};
use common::{Running, in_ci, refract};
use rdkafka::mocking::MockCluster;
use support::*;

/// The two tests run one after the other: each starts processes that compete for two cores,
/// and their figures should not depend on the other's load.
static SERIAL: Mutex<()> = Mutex::new(());
/// How long the stream of the first test lasts: long enough for the kill and the stop to land
/// mid-stream, whatever the number of events.
const STREAM: Duration = Duration::from_secs(20);
/// How long every broker stays down in the second test: longer than the members' session
/// timeout (6 s), so the group itself has to recover.
const OUTAGE: Duration = Duration::from_secs(10);

/// A `refract run` member with its own state directory, logging partition movements to a file.
struct Member {
    process: Running,
    log: PathBuf,
}

impl Member {
    fn start(pipeline: &Path, dir: &Path, name: &str) -> Self {
        let log = dir.join(format!("{name}.log"));
        let process = Running::spawn(
            refract()
                .arg("run")
                .arg(pipeline)
                .env("STATE_DIR", dir.join(format!("state-{name}")))
                .env("RUST_LOG", "warn,refract_connectors::sources::kafka=info")
                .env("NO_COLOR", "1")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap()),
        );
        Member { process, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The partitions of this member's last assignment, if it got one.
    fn last_assignment(&self) -> Option<usize> {
        let log = self.log();
        let line = log
            .lines()
            .rev()
            .find(|l| l.contains("kafka partitions assigned"))?;
        Some(line.matches("public.items/").count())
    }

    fn running(&mut self) -> bool {
        self.process.child().try_wait().unwrap().is_none()
    }

    /// SIGTERMs the member and waits (with a deadline) for it to exit 0.
    fn stop(mut self, what: &str) {
        self.process.terminate();
        let deadline = Instant::now() + hang_guard();
        let status = loop {
            if let Some(status) = self.process.child().try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(status.success(), "{what} exited {status}: {}", self.log());
    }
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

/// Waits until the table equals `model` and the group's committed offsets equal the topic's
/// end offsets.
fn wait_converged(
    schema: &str,
    model: &std::collections::BTreeMap<String, serde_json::Value>,
    offsets: &Offsets,
) {
    wait_for(
        hang_guard(),
        || documents(schema) == *model && offsets.committed() == offsets.ends(),
        || {
            format!(
                "table: {}; committed {:?}, ends {:?}",
                differences(model, &documents(schema)),
                offsets.committed(),
                offsets.ends()
            )
        },
    );
}

/// No update ever replaced a document by an older version; returns how many deleted keys came
/// back at an older version for a while (a replay of changes before their delete, which the
/// sink documents: deletes leave no tombstone).
fn assert_no_regression(schema: &str) -> u64 {
    let regressions = psql(&format!(
        "SELECT count(*) || '|' || coalesce(string_agg(format('%s: v%s->v%s (%s -> %s)', id, old_v, new_v, old_position, new_position), '; '), '')
         FROM (SELECT * FROM {schema}.regressions LIMIT 5) r"
    ));
    assert!(
        regressions.starts_with("0|"),
        "documents went back to an older version: {regressions}"
    );
    psql(&format!("SELECT count(*) FROM {schema}.resurrections"))
        .parse()
        .unwrap()
}

#[test]
fn three_members_lose_one_to_sigkill_and_one_to_sigterm_and_the_survivor_finishes() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    let cluster = MockCluster::new(3).expect("mock cluster");
    let topic = "kscale.public.items";
    cluster.create_topic(topic, PARTITIONS, 3).expect("topic");
    let brokers = cluster.bootstrap_servers();
    let schema = "refract_kafka_scale";
    create_watched_table(schema);
    let group = unique("refract_kscale");
    let events = if in_ci() { 20_000 } else { 100_000 };
    let mut changes = Changes::new(2_000, 41);
    let messages = changes.next(events);
    let model = changes.model();
    let dir = tempfile::tempdir().unwrap();
    let pipeline = pipeline_file(dir.path(), &brokers, topic, &group, schema);
    let offsets = Offsets::new(&brokers, &group, topic);

    let mut members: Vec<Member> = ["a", "b", "c"]
        .iter()
        .map(|n| Member::start(&pipeline, dir.path(), n))
        .collect();
    wait_for(
        hang_guard(),
        || members.iter().all(|m| m.last_assignment().unwrap_or(0) > 0),
        || {
            format!(
                "not every member got partitions: {:?}",
                members.iter().map(Member::log).collect::<Vec<_>>()
            )
        },
    );
    let slices = messages.len().div_ceil(1_000) as u32;
    let producing = Producing::start(&brokers, topic, messages, STREAM / slices);
    let total = producing.total;

    // SIGKILL one member a third of the way in, once the group has committed something.
    wait_for(
        hang_guard(),
        || producing.produced() * 3 >= total && offsets.committed().iter().sum::<i64>() > 0,
        || {
            format!(
                "{} of {total} produced, committed {:?}",
                producing.produced(),
                offsets.committed()
            )
        },
    );
    let mut killed = members.remove(0);
    assert!(killed.running(), "member a ended early: {}", killed.log());
    killed.process.child().kill().unwrap();
    killed.process.child().wait().unwrap();
    let killed_at = producing.produced();

    // SIGTERM another at two thirds: it drains, commits and leaves the group.
    wait_for(
        hang_guard(),
        || producing.produced() * 3 >= total * 2,
        || format!("{} of {total} produced", producing.produced()),
    );
    let stopped_at = producing.produced();
    members.remove(0).stop("member b");
    assert!(stopped_at < total, "the stop landed after the stream ended");
    producing.join();
    let survivor = &mut members[0];

    wait_converged(schema, &model, &offsets);
    let resurrections = assert_no_regression(schema);
    assert_eq!(
        survivor.last_assignment(),
        Some(PARTITIONS as usize),
        "the survivor owns every partition: {}",
        survivor.log()
    );
    assert!(survivor.running(), "the survivor ended: {}", survivor.log());
    let survivor = members.remove(0);
    let assignments =
        [&killed, &survivor].map(|m| m.log().matches("kafka partitions assigned").count());
    survivor.stop("member c");
    assert_eq!(
        offsets.committed(),
        offsets.ends(),
        "committed offsets after the survivor stopped"
    );
    eprintln!(
        "kafka_scale: {events} events ({total} messages with tombstones) over {} keys, {} live at the end; \
         SIGKILL at {killed_at}, SIGTERM at {stopped_at} messages; assignments (killed, survivor) {assignments:?}; converged; \
         {resurrections} deleted keys briefly resurrected by replays; {:.1} s",
        2_000,
        model.len(),
        started.elapsed().as_secs_f64()
    );
    psql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
}

#[test]
fn brokers_down_and_a_blocked_table_never_let_offsets_pass_what_is_durable() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    let cluster = MockCluster::new(3).expect("mock cluster");
    let topic = "kbroker.public.items";
    cluster.create_topic(topic, PARTITIONS, 3).expect("topic");
    let brokers = cluster.bootstrap_servers();
    let schema = "refract_kafka_broker";
    create_watched_table(schema);
    let group = unique("refract_kbroker");
    let events = if in_ci() { 10_000 } else { 30_000 };
    let mut changes = Changes::new(500, 43);
    let messages = changes.next(events);
    let dir = tempfile::tempdir().unwrap();
    let pipeline = pipeline_file(dir.path(), &brokers, topic, &group, schema);
    let offsets = Offsets::new(&brokers, &group, topic);

    let mut member = Member::start(&pipeline, dir.path(), "solo");
    wait_for(
        hang_guard(),
        || member.last_assignment() == Some(PARTITIONS as usize),
        || format!("the member got no partitions: {}", member.log()),
    );
    let slices = messages.len().div_ceil(1_000) as u32;
    let producing = Producing::start(&brokers, topic, messages, STREAM / slices);
    let total = producing.total;
    wait_for(
        hang_guard(),
        || producing.produced() * 10 >= total * 3 && offsets.committed().iter().sum::<i64>() > 0,
        || {
            format!(
                "{} of {total} produced, committed {:?}",
                producing.produced(),
                offsets.committed()
            )
        },
    );
    let down_at = producing.produced();
    for id in 1..=3 {
        cluster.broker_down(id).expect("broker down");
    }
    // The outage's length, not a synchronisation: the brokers are simply gone meanwhile.
    std::thread::sleep(OUTAGE);
    for id in 1..=3 {
        cluster.broker_up(id).expect("broker up");
    }
    assert!(
        member.running(),
        "the member ended in the outage: {}",
        member.log()
    );
    assert!(down_at < total, "the outage came after the stream ended");
    producing.join();
    let model = changes.model();
    wait_converged(schema, &model, &offsets);
    let after_outage = started.elapsed();

    // The table refuses writes: an open transaction holds an exclusive lock on it.
    let durable: i64 = offsets.ends().iter().sum();
    let mut lock = Session::open("kafka_lock");
    lock.run(&format!(
        "BEGIN; LOCK TABLE {schema}.items IN ACCESS EXCLUSIVE MODE;"
    ));
    let more = changes.next(if in_ci() { 2_000 } else { 5_000 });
    let more_messages = more.len() as i64;
    Producing::start(&brokers, topic, more, Duration::ZERO).join();
    wait_for(
        hang_guard(),
        || {
            psql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> {} AND query ILIKE '%{schema}%'",
                lock.pid
            )) != "0"
        },
        || format!("the sink never waited on the lock: {}", member.log()),
    );
    let mut samples = 0;
    let blocked_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < blocked_until {
        let committed: i64 = offsets.committed().iter().sum();
        assert!(
            committed <= durable,
            "committed offsets sum to {committed} while the table holds the effects of {durable} messages"
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    lock.run("ROLLBACK;");
    drop(lock);
    let model = changes.model();
    wait_converged(schema, &model, &offsets);
    assert_eq!(
        offsets.committed().iter().sum::<i64>(),
        durable + more_messages
    );
    let resurrections = assert_no_regression(schema);
    member.stop("the member");
    eprintln!(
        "kafka_broker: {events} events ({total} messages), all 3 brokers down for {OUTAGE:?} at {down_at} messages, \
         converged at {:.1} s; table locked while {more_messages} more arrived: {samples} samples of the committed offsets, \
         none above {durable}; converged again; {resurrections} resurrections; {:.1} s",
        after_outage.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    psql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
}
