#!/usr/bin/env bash
# Benchmark: a release build decoding a 1M-event Debezium JSON file into the null sink (through the
# replica projection), next to pyarrow.json.read_json reading the same file in the same run.
# Prints `figure / baseline = ratio` and refract's peak RSS.
#
# Usage: benches/decode.sh [EVENTS]   (default 1000000)
set -euo pipefail
cd "$(dirname "$0")/.."
events=${1:-1000000}
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"

python3 -c 'import pyarrow' 2>/dev/null || python3 -m pip install -q pyarrow
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
cargo build --release --locked -q -p refract -p refract-benches
target=${CARGO_TARGET_DIR:-target}

log="$work/envelopes-$events.jsonl"
[ -s "$log" ] || "$target/release/gen-envelopes" "$events" "$log"
bytes=$(stat -c %s "$log")

cat > "$work/decode.toml" <<TOML
[pipeline]
name = "bench-decode"
state_dir = "$work/state"
[source]
kind = "file"
path = "$log"
follow = false
[projections.replica]
kind = "replica"
sinks = ["null"]
[sinks.null]
kind = "null"
TOML

exec python3 benches/decode.py "${REFRACT_BIN:-$target/release/refract}" "$work" "$log" "$events"
