#!/usr/bin/env bash
# Benchmark: the decode and drain benchmarks run with two refract binaries in one session, an
# earlier build (BEFORE) and this checkout's release build, each next to the baseline it measures
# in the same run (pyarrow for decode, pg_recvlogical for drain). A change that must not slow
# refract down compares the two ratios. Order alternates (before, after, after, before) so that a
# machine that slows down over the run does not favour one side.
#
# Usage: benches/before_after.sh BEFORE_BINARY [EVENTS] [ROWS]
#   EVENTS: decode file size (default 1000000); ROWS: drain insert backlog (default 1000000).
#   Build BEFORE from an earlier commit, e.g.:
#     git worktree add /tmp/before REV && (cd /tmp/before && cargo build --release -p refract)
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(realpath "${1:?usage: benches/before_after.sh BEFORE_BINARY [EVENTS] [ROWS]}")
events=${2:-1000000}
rows=${3:-1000000}
cargo build --release --locked -q -p refract -p refract-benches
after=$(realpath "${CARGO_TARGET_DIR:-target}/release/refract")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run() { # run LABEL BINARY
    echo "=== $1: $2"
    BENCH_DIR="$work/decode" REFRACT_BIN="$2" benches/decode.sh "$events" | grep -E '^(decode|refract peak|file)'
    REFRACT_BIN="$2" PGBENCH_CHANGES=${PGBENCH_CHANGES:-100000} benches/pg_drain.sh "$rows" \
        | grep -E '^(drain|refract peak)'
}
run before "$before"
run after "$after"
run after "$after"
run before "$before"
