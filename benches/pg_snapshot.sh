#!/usr/bin/env bash
# Benchmark: the initial snapshot of a ROWS-row table into the null sink (PostgreSQL source with
# `snapshot = "initial"` -> replica projection -> null sink), next to
# `COPY (SELECT * FROM t) TO STDOUT` of the same table into /dev/null, in the same run.
# Each refract round starts from no slot and no state, so it creates the slot with an exported
# snapshot and reads the table with COPY before streaming (what a first `refract run` does).
# BACKFILL=1 times `refract backfill` instead, with no daemon running: it runs the pipeline itself
# and reads the table from a temporary slot's exported snapshot (COPY) into its stream.
# BACKFILL=daemon times `refract backfill` while a daemon streams the pipeline: the backfill asks
# the daemon, which reads a temporary slot's exported snapshot (COPY) into its own stream; the
# time ends when the rows are durable (the backfill process has followed them).
# Prints `refract rows/s / COPY rows/s = ratio` and refract's peak RSS.
#
# Usage: benches/pg_snapshot.sh [ROWS]   (default 1000000; PG_URL as in the environment contract)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
work=$(mktemp -d)
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
cargo build --release --locked -q -p refract
refract=${CARGO_TARGET_DIR:-target}/release/refract
sql() { psql "$url" -v ON_ERROR_STOP=1 -Atqc "$1"; }
drop_slot() {
    sql "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_bench_snap'" >/dev/null
}
cleanup() {
    drop_slot || true
    sql "SET client_min_messages = warning; DROP PUBLICATION IF EXISTS refract_bench_snap; DROP TABLE IF EXISTS bench_snap;" >/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
cleanup; mkdir -p "$work"

sql "CREATE TABLE bench_snap (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(12,2), note text);
     INSERT INTO bench_snap SELECT g, 'item ' || g, g % 100, g / 100.0, 'note ' || g FROM generate_series(1, $rows) g;"
sql "VACUUM ANALYZE bench_snap"
cat > "$work/snap.toml" <<TOML
[pipeline]
name = "bench_snap"
state_dir = "$work/state"
[source]
kind = "postgres"
url = "$url"
tables = ["public.bench_snap"]
snapshot = "initial"
chunk_rows = ${CHUNK_ROWS:-10000}
[projections.replica]
kind = "replica"
sinks = ["null"]
[sinks.null]
kind = "null"
TOML

# Wall-clock seconds, read without starting an interpreter (which would add its start-up time
# to every figure).
now() { date +%s.%N; }
since() { local end; end=$(now); python3 -c "print($end - $1)"; }
copy_out() {
    local start; start=$(now)
    psql "$url" -Atqc "COPY (SELECT * FROM bench_snap) TO STDOUT" > /dev/null
    since "$start" >> "$work/copy_secs"
    # For context only (the ratio is against the plain COPY above): the query refract itself
    # runs, in key order (which its resumable notes need).
    start=$(now)
    psql "$url" -Atqc "COPY (SELECT * FROM bench_snap ORDER BY id) TO STDOUT" > /dev/null
    since "$start" >> "$work/ordered_secs"
}
snapshot() {
    drop_slot; rm -rf "$work/state"
    local start
    if [ -n "${BACKFILL:-}" ]; then
        # The slot exists first (snapshot = never), then the backfill reads every row in chunks.
        sed 's/^snapshot = .*/snapshot = "never"/' "$work/snap.toml" > "$work/never.toml"
        RUST_LOG=warn "$refract" run "$work/never.toml" --until-caught-up >/dev/null
        local daemon=""
        if [ "$BACKFILL" = daemon ]; then
            # The daemon reads the rows: its peak RSS is the one printed.
            RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" run "$work/never.toml" >/dev/null 2>&1 &
            daemon=$!
            sleep 1
            start=$(now)
            RUST_LOG=warn "$refract" backfill "$work/never.toml" > "$work/backfill.out"
        else
            start=$(now)
            RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" backfill "$work/never.toml" > "$work/backfill.out"
        fi
        since "$start" >> "$work/refract_secs"
        if [ -n "$daemon" ]; then
            # `time` does not pass signals on: the daemon is its child.
            pkill -TERM -P "$daemon"; wait "$daemon" || true
            grep -q "applied by the running daemon" "$work/backfill.out" || { cat "$work/backfill.out"; exit 1; }
            grep -q "$rows rows" "$work/backfill.out" || { cat "$work/backfill.out"; exit 1; }
        else
            grep -q "r=$rows" "$work/backfill.out" || { cat "$work/backfill.out"; exit 1; }
        fi
        cat "$work/rss" >> "$work/rss_all"
        return
    fi
    start=$(now)
    RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" run "$work/snap.toml" --until-caught-up \
        --summary-json "$work/summary.json" >/dev/null
    since "$start" >> "$work/refract_secs"
    cat "$work/rss" >> "$work/rss_all"
    python3 - "$work/summary.json" "$rows" <<'PY'
import json, sys
summary, rows = json.load(open(sys.argv[1])), int(sys.argv[2])
read = summary["changes"].get("r", 0)
if read != rows or summary["dead_letters"] != 0:
    sys.exit(f"refract read {summary['changes']} with {summary['dead_letters']} dead letters; expected {rows} reads")
PY
}

# ROUNDS rounds (default 3), the order swapped every other round, so neither side profits
# from the other's warm caches; the best of each side is compared (this machine is noisy).
for round in $(seq 1 "${ROUNDS:-3}"); do
    echo "round $round"
    if [ $((round % 2)) = 1 ]; then copy_out; snapshot; else snapshot; copy_out; fi
done
python3 - "$rows" "$work" <<'PY'
import sys
rows, work = int(sys.argv[1]), sys.argv[2]
read = lambda f: [float(x) for x in open(f"{work}/{f}").read().split()]
ref, copy, rss = min(read("refract_secs")), min(read("copy_secs")), max(read("rss_all"))
r, c = rows / ref, rows / copy
import os
path = {
    "": "initial snapshot (exported snapshot + COPY)",
    "daemon": "refract backfill beside a running daemon (the daemon reads a temporary slot's exported snapshot with COPY into its stream; RSS is the daemon's)",
}.get(os.environ.get("BACKFILL", ""), "refract backfill, no daemon (temporary slot's exported snapshot + COPY, read into the stream)")
print("refract path: " + path)
print(f"table: {rows} rows (id int, name text, qty int, price numeric, note text) (best of {len(read('copy_secs'))} rounds)")
print(f"snapshot rows/s: refract {r:,.0f} ({ref:.2f}s) / COPY TO STDOUT {c:,.0f} ({copy:.2f}s) = {r / c:.2f}x")
print(f"refract peak RSS: {rss / 1024:.1f} MiB")
rounds = lambda f: ", ".join(f"{x:.2f}s" for x in read(f))
print(f"  each round: refract {rounds('refract_secs')}; COPY {rounds('copy_secs')}")
ordered = min(read("ordered_secs"))
print(f"  context: the same COPY in key order (refract's query) {rows / ordered:,.0f} rows/s ({ordered:.2f}s); refract / it = {r / (rows / ordered):.2f}x")
PY
