//! The Kafka consume benchmark's fixture (benches/kafka_consume.sh): starts librdkafka's mock
//! cluster in this process (3 brokers, the real Kafka protocol on loopback), fills 6-partition
//! topics per format with N Debezium change events of the showcase `products` table
//! (`changes.rs`; one topic per tenant schema, as the mock keeps only 5 MiB per partition), then
//! times, in interleaved rounds, two child processes draining the topics (one regex
//! subscription) in a consumer group of their own:
//!   - the baseline: this binary's `drain`, a bare rdkafka `BaseConsumer` with the Kafka source's
//!     group settings (no auto commit, no auto offset store, read_committed) that only counts
//!     the messages and their bytes, then commits once;
//!   - `refract run --until-caught-up` of a kafka source -> replica projection -> null sink.
//!
//! It prints `figure / baseline = ratio` per format, and both peak RSS (`/usr/bin/time`).
//!
//! Usage: kafka-fixture bench REFRACT WORK_DIR N [json] [avro]   (ROUNDS, default 5)
//!        kafka-fixture drain BROKERS TOPIC_OR_PATTERN GROUP N

mod changes;
mod registry;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::Message as _;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

use changes::{AvroEncoding, Counts, Message};

type Cluster<'c> = rdkafka::mocking::MockCluster<'c, rdkafka::producer::DefaultProducerContext>;

/// Partitions of each topic, as issue 22 asks.
const PARTITIONS: i32 = 6;
/// Mock brokers: partition leaders spread over three connections, as on a real cluster.
const BROKERS: i32 = 3;
/// Messages per topic: librdkafka's mock broker keeps at most 5 MiB of each partition (fixed in
/// rdkafka_mock.c; older message sets are dropped), so N messages are spread over as many
/// topics of [`PARTITIONS`] partitions as keep every partition under about 4 MiB (JSON); Avro,
/// smaller, uses the same layout, so both formats are read from as many partitions.
const PER_TOPIC: &[(&str, u64)] = &[("json", 40_000), ("avro", 40_000)];
/// A drain that takes longer than this has hung (a group that never gets its partitions).
const DRAIN_DEADLINE: Duration = Duration::from_secs(600);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("drain") if args.len() == 5 => {
            let n = args[4].parse().expect("N");
            if let Err(e) = drain(&args[1], &args[2], &args[3], n) {
                eprintln!("drain: {e}");
                std::process::exit(1);
            }
        }
        Some("bench") if args.len() >= 4 => {
            let n = args[3].parse().expect("N");
            let formats: Vec<&str> = args[4..].iter().map(String::as_str).collect();
            let formats = if formats.is_empty() {
                vec!["json", "avro"]
            } else {
                formats
            };
            bench(Path::new(&args[1]), Path::new(&args[2]), n, &formats);
        }
        _ => {
            eprintln!(
                "usage: kafka-fixture bench REFRACT WORK_DIR N [json] [avro]\n       \
                 kafka-fixture drain BROKERS TOPIC GROUP N"
            );
            std::process::exit(2);
        }
    }
}

/// The baseline: reads N messages of `topic` in `group`, touching every key and value byte
/// count, and commits the positions once.
fn drain(brokers: &str, topic: &str, group: &str, n: u64) -> Result<(), String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        // As refract's source sets it (FETCH_QUEUE_BACKOFF_MS there): at librdkafka's default
        // (1 s) a round of the bare consumer took 1 s or 2 s depending on whether its fetch queue
        // happened to fill, and the ratio followed that rather than refract.
        .set("fetch.queue.backoff.ms", "10")
        .create()
        .map_err(|e| e.to_string())?;
    consumer.subscribe(&[topic]).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + DRAIN_DEADLINE;
    let (mut read, mut bytes) = (0u64, 0usize);
    while read < n {
        if Instant::now() > deadline {
            return Err(format!("read {read} of {n} messages before the deadline"));
        }
        match consumer.poll(Duration::from_millis(50)) {
            Some(Ok(m)) => {
                read += 1;
                bytes += m.key().map_or(0, <[u8]>::len) + m.payload().map_or(0, <[u8]>::len);
            }
            Some(Err(e)) => eprintln!("drain: consumer error (retrying): {e}"),
            None => {}
        }
    }
    // No offset is stored (as in the source): commit the positions read to.
    let positions = consumer.position().map_err(|e| e.to_string())?;
    consumer
        .commit(&positions, CommitMode::Sync)
        .map_err(|e| e.to_string())?;
    println!("{read} messages, {bytes} bytes");
    Ok(())
}

/// The filled topics of one format.
struct Topics {
    /// The subscription: a regular expression matching every topic.
    pattern: String,
    topics: usize,
    counts: Counts,
    value_bytes: u64,
    registry: Option<String>,
}

fn bench(refract: &Path, work: &Path, n: u64, formats: &[&str]) {
    // The producer owns the mock cluster (`test.mock.num.brokers`), which lives as long as it.
    let producer: BaseProducer = ClientConfig::new()
        .set("test.mock.num.brokers", BROKERS.to_string())
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "500000")
        .create()
        .expect("producer with a mock cluster");
    let cluster = producer.client().mock_cluster().expect("the mock cluster");
    // SAFETY: the handle's mock cluster is alive as long as `producer`; librdkafka's setter
    // only stores the value. The default (3 s, as brokers' `group.initial.rebalance.delay.ms`)
    // would add the same fixed wait to every run of both sides.
    unsafe {
        let mock = rdkafka::bindings::rd_kafka_handle_mock_cluster(producer.client().native_ptr());
        rdkafka::bindings::rd_kafka_mock_group_initial_rebalance_delay_ms(mock, 0);
    }
    let brokers = cluster.bootstrap_servers();
    let rounds: usize = std::env::var("ROUNDS").map_or(5, |r| r.parse().expect("ROUNDS"));
    for format in formats {
        let topics = fill(&producer, &cluster, format, n);
        let mut figures = Figures::default();
        for round in 1..=rounds {
            let base = || figures_of(run_drain(work, &brokers, &topics, format, round, n));
            let refr = || figures_of(run_refract(refract, work, &brokers, &topics, format, round));
            let (b, r) = if round % 2 == 1 {
                let b = base();
                (b, refr())
            } else {
                let r = refr();
                (base(), r)
            };
            println!(
                "round {round} ({format}): refract {:.2}s, bare consumer {:.2}s",
                r.0, b.0
            );
            figures.refract.push(r);
            figures.base.push(b);
        }
        figures.report(format, &topics, n, rounds);
    }
}

/// Produces the topics of `format`, [`PER_TOPIC`] messages each, and checks that the mock kept
/// every one.
fn fill(producer: &BaseProducer, cluster: &Cluster<'_>, format: &str, n: u64) -> Topics {
    let started = Instant::now();
    let prefix = match format {
        "json" => "dbserver1",
        "avro" => "dbserver1_avro",
        other => panic!("unknown format {other:?}: json or avro"),
    };
    let per_topic = PER_TOPIC
        .iter()
        .find(|(f, _)| *f == format)
        .map_or(1, |p| p.1);
    let mut schemas = Vec::new();
    let (mut counts, mut value_bytes, mut names) = (Counts::default(), 0u64, Vec::new());
    while counts.messages() < n {
        let tenant = format!("t{}", names.len());
        let name = changes::topic(prefix, &tenant);
        let avro = (format == "avro").then(|| {
            let first_id = 1 + 2 * names.len() as u32;
            AvroEncoding::new(prefix, &tenant, first_id, |id, text| {
                schemas.push((id, text))
            })
        });
        cluster
            .create_topic(&name, PARTITIONS, BROKERS)
            .expect("topic created");
        let these = per_topic.min(n - counts.messages());
        counts.add(changes::changes(these, &tenant, |change| {
            let message = match &avro {
                None => changes::json_message(&change),
                Some(a) => a.message(&change),
            };
            value_bytes += message.1.as_ref().map_or(0, |v| v.len() as u64);
            send(producer, &name, &message);
        }));
        names.push(name);
    }
    producer
        .flush(Duration::from_secs(120))
        .expect("every message acknowledged");
    for name in &names {
        for p in 0..PARTITIONS {
            let (low, _) = producer
                .client()
                .fetch_watermarks(name, p, Duration::from_secs(10))
                .expect("watermarks");
            assert_eq!(
                low, 0,
                "the mock cluster dropped the start of {name}/{p}: lower PER_TOPIC"
            );
        }
    }
    println!(
        "produced {} {format} messages to {} topics in {:.1}s",
        counts.messages(),
        names.len(),
        started.elapsed().as_secs_f64()
    );
    Topics {
        pattern: format!("^{}\\.t[0-9]+\\.products$", prefix),
        topics: names.len(),
        counts,
        value_bytes,
        registry: (format == "avro").then(|| registry::serve(schemas)),
    }
}

/// Queues one message, serving delivery reports while the producer's queue is full.
fn send(producer: &BaseProducer, topic: &str, (key, value): &Message) {
    let mut record = BaseRecord::<[u8], [u8]>::to(topic).key(key.as_slice());
    if let Some(v) = value {
        record = record.payload(v.as_slice());
    }
    loop {
        match producer.send(record) {
            Ok(()) => return,
            Err((_, r)) => {
                producer.poll(Duration::from_millis(10));
                record = r;
            }
        }
    }
}

/// Wall seconds (measured here), peak RSS KiB, CPU seconds (user + system).
type Run = (f64, u64, f64);

/// Runs `command` under `/usr/bin/time`; its figures, or the run's failure.
fn timed(work: &Path, command: &mut Command) -> Result<Run, String> {
    let out = work.join("time.out");
    let mut timed = Command::new("/usr/bin/time");
    timed
        .args(["-f", "%M %U %S", "-o"])
        .arg(&out)
        .arg(command.get_program())
        .args(command.get_args())
        .envs(command.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .stdout(Stdio::null());
    let started = Instant::now();
    let status = timed.status().map_err(|e| e.to_string())?;
    let wall = started.elapsed().as_secs_f64();
    if !status.success() {
        return Err(format!("{:?} failed: {status}", command.get_program()));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
    let f: Vec<f64> = text
        .split_whitespace()
        .rev()
        .take(3)
        .filter_map(|x| x.parse().ok())
        .collect();
    match f[..] {
        [sys, user, rss] => Ok((wall, rss as u64, user + sys)),
        _ => Err(format!("unreadable /usr/bin/time output: {text}")),
    }
}

fn figures_of(run: Result<Run, String>) -> Run {
    run.unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    })
}

fn run_drain(
    work: &Path,
    brokers: &str,
    topics: &Topics,
    format: &str,
    round: usize,
    n: u64,
) -> Result<Run, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    timed(
        work,
        Command::new(me).args([
            "drain",
            brokers,
            &topics.pattern,
            &format!("bench-bare-{format}-{round}"),
            &n.to_string(),
        ]),
    )
}

fn run_refract(
    refract: &Path,
    work: &Path,
    brokers: &str,
    topics: &Topics,
    format: &str,
    round: usize,
) -> Result<Run, String> {
    let state = work.join(format!("state-{format}"));
    let _ = std::fs::remove_dir_all(&state);
    let registry = topics.registry.as_ref().map_or(String::new(), |url| {
        format!("[source.schema_registry]\nurl = \"{url}\"\n")
    });
    let pipeline = format!(
        "[pipeline]\nname = \"bench-kafka-{format}\"\nstate_dir = \"{state}\"\n\
         [source]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\ntopics = ['{pattern}']\n\
         group_id = \"bench-refract-{format}-{round}\"\nformat = \"debezium_{format}\"\n{registry}\
         [projections.replica]\nkind = \"replica\"\nsinks = [\"null\"]\n\
         [sinks.null]\nkind = \"null\"\n",
        state = state.display(),
        pattern = topics.pattern,
    );
    let path = work.join(format!("kafka-{format}.toml"));
    std::fs::write(&path, pipeline).map_err(|e| e.to_string())?;
    let summary = work.join("summary.json");
    let run = timed(
        work,
        Command::new(refract)
            .arg("run")
            .arg(&path)
            .arg("--until-caught-up")
            .arg("--summary-json")
            .arg(&summary)
            .env("RUST_LOG", "warn"),
    )?;
    check_summary(&summary, &topics.counts)?;
    Ok(run)
}

/// The run read every message: each change once, each tombstone passed over, no dead letter.
fn check_summary(path: &Path, counts: &Counts) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let s: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let got = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let expected = [
        ("records", got(&s["records"]), counts.messages()),
        ("creates", got(&s["changes"]["c"]), counts.creates),
        ("updates", got(&s["changes"]["u"]), counts.updates),
        ("deletes", got(&s["changes"]["d"]), counts.deletes),
        ("tombstones", got(&s["tombstones"]), counts.tombstones),
        ("dead letters", got(&s["dead_letters"]), 0),
    ];
    for (what, got, want) in expected {
        if got != want {
            return Err(format!(
                "refract read {got} {what}, expected {want}: {text}"
            ));
        }
    }
    Ok(())
}

#[derive(Default)]
struct Figures {
    refract: Vec<Run>,
    base: Vec<Run>,
}

impl Figures {
    fn report(&self, format: &str, topics: &Topics, n: u64, rounds: usize) {
        // The median round: the best one flattered whichever side had one lucky round.
        let median = |runs: &[Run], f: fn(&Run) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let (rw, bw) = (median(&self.refract, |r| r.0), median(&self.base, |r| r.0));
        let (rc, bc) = (median(&self.refract, |r| r.2), median(&self.base, |r| r.2));
        let rss = |runs: &[Run]| runs.iter().map(|r| r.1).max().unwrap_or(0) as f64 / 1024.0;
        let n = n as f64;
        let c = &topics.counts;
        println!(
            "\ntopics {} ({} topics of {PARTITIONS} partitions on {BROKERS} mock brokers): \
             {} messages ({} creates, {} updates, {} deletes, {} tombstones), \
             values {:.1} MiB ({:.0} B each); median of {rounds} rounds on {} cores",
            topics.pattern,
            topics.topics,
            c.messages(),
            c.creates,
            c.updates,
            c.deletes,
            c.tombstones,
            topics.value_bytes as f64 / 1048576.0,
            topics.value_bytes as f64 / (c.messages() - c.tombstones) as f64,
            std::thread::available_parallelism().map_or(0, |p| p.get()),
        );
        println!(
            "consume+decode events/s (Debezium {}): refract {:.0} ({rw:.2}s) / bare rdkafka \
             consumer {:.0} ({bw:.2}s) = {:.2}x (target >= 0.6x)",
            if format == "avro" { "Avro" } else { "JSON" },
            n / rw,
            n / bw,
            bw / rw
        );
        println!(
            "refract peak RSS: {:.1} MiB (bare consumer: {:.1} MiB)",
            rss(&self.refract),
            rss(&self.base)
        );
        println!(
            "events per CPU-second: refract {:.0} / bare consumer {:.0} = {:.2}x",
            n / rc,
            n / bc,
            bc / rc
        );
        let each = |runs: &[Run]| {
            let t: Vec<String> = runs.iter().map(|r| format!("{:.2}s", r.0)).collect();
            t.join(", ")
        };
        println!(
            "  each round: refract {}; bare consumer {}",
            each(&self.refract),
            each(&self.base)
        );
    }
}
