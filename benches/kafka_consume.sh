#!/usr/bin/env bash
# Benchmark (issue 22): a release build consuming Debezium change events of the showcase
# `products` table from a 6-partition Kafka topic and decoding them into the null sink (kafka
# source -> replica projection -> null sink, `refract run --until-caught-up`), next to a bare
# rdkafka consumer draining the same topic without decoding, in the same run; Debezium JSON,
# then Debezium Avro (Confluent framing, a schema registry). The broker is librdkafka's mock
# cluster (3 brokers, the real protocol on loopback) inside the fixture process
# (benches/kafka_fixture/), which spawns both consumers. Prints `figure / baseline = ratio`
# (target >= 0.6x) and both peak RSS.
#
# Usage: benches/kafka_consume.sh [EVENTS] [json] [avro]
#        (default 1,000,000, 100,000 with CI=true; both formats; ROUNDS rounds, default 5; the median round of each side is compared)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${CI:-}" = true ]; then default=100000; else default=1000000; fi
events=${1:-$default}
shift || true
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
trap '[ -n "${BENCH_DIR:-}" ] || rm -rf "$work"' EXIT

[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
cargo build --release --locked -q -p refract -p refract-benches
target=${CARGO_TARGET_DIR:-target}

"$target/release/kafka-fixture" bench "${REFRACT_BIN:-$target/release/refract}" "$work" "$events" "$@"
