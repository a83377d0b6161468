#!/usr/bin/env bash
# Benchmark: the Redis sink deleting cache keys (file source -> cache_invalidation projection ->
# redis sink) next to redis-benchmark sending DEL on one connection at the same pipeline depth, in
# the same run. The file holds EVENTS Debezium updates of the showcase `public.products` table
# (../shared/showcase/products.sql: full old and new rows) over PRODUCT_IDS distinct ids, so few
# keys repeat within a batch; the sku changes in 10% of them. Each update deletes
# `product:{id}:v3` and `product:sku:{sku}:v3` (and the old sku key when the sku changed).
# Prints `refract deletes/s / redis-benchmark DEL/s = ratio` (deletes = the DEL/UNLINK commands
# the sink sent, its `deleted` count), refract's events/s and peak RSS, and for reference the same
# pipeline into the null sink (decode and projection only: the most the Redis sink could reach).
# Both sides delete keys that do not exist (database REDIS_DB is flushed before every run).
#
# Usage: benches/redis_sink.sh [EVENTS]   (default 1000000; PIPELINE_DEPTH (default 100),
#        PRODUCT_IDS (default 1000000), REDIS_URL (default redis://127.0.0.1:6379), REDIS_DB
#        (default 9, flushed), REDIS_COMMAND (unlink or del, default unlink; the baseline sends DEL),
#        KEYS_PER_COMMAND (refract's keys per UNLINK, default 100; 1 sends one key per command
#        like the baseline),
#        BENCH_DIR (keeps the generated file for another run))
set -euo pipefail
cd "$(dirname "$0")/.."
events=${1:-1000000}
depth=${PIPELINE_DEPTH:-100}
keys_per_command=${KEYS_PER_COMMAND:-100}
ids=${PRODUCT_IDS:-1000000}
redis_url=${REDIS_URL:-redis://127.0.0.1:6379}
db=${REDIS_DB:-9}
command=${REDIS_COMMAND:-unlink}
read -r host port < <(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(p.hostname or "127.0.0.1", p.port or 6379)' "$redis_url")
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
command -v redis-benchmark >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-tools; }
cargo build --release --locked -q -p refract -p refract-benches
target=${CARGO_TARGET_DIR:-target}
refract=$target/release/refract
rcli() { redis-cli -h "$host" -p "$port" -n "$db" "$@"; }
cleanup() {
    rcli FLUSHDB >/dev/null || true
    rm -rf "$work/state" "$work"/*.secs "$work"/*.rss "$work"/rss "$work"/summary.json
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

log="$work/products-$events-$ids.jsonl"
[ -s "$log" ] || "$target/release/gen-envelopes" --products "$events" "$log" "$ids"

pipeline() {   # pipeline SINK: the pipeline file into the redis or the null sink
    cat <<TOML
[pipeline]
name = "bench_cache"
state_dir = "$work/state"
[source]
kind = "file"
path = "$log"
follow = false
[projections.cache]
kind = "cache_invalidation"
sinks = ["$1"]
[projections.cache.tables."public.products"]
keys = ["product:{id}:v3", "product:sku:{sku}:v3"]
TOML
    if [ "$1" = redis ]; then
        printf '[sinks.redis]\nkind = "redis"\nurl = "%s"\ncommand = "%s"\npipeline_depth = %s\nkeys_per_command = %s\n' \
            "${redis_url%/}/$db" "$command" "$depth" "$keys_per_command"
    else
        printf '[sinks.null]\nkind = "null"\n'
    fi
}
pipeline redis > "$work/redis.toml"
pipeline null > "$work/null.toml"

now() { python3 -c 'import time; print(time.time())'; }
# run_refract SINK: one run from scratch; appends seconds, peak RSS and the deleted count.
run_refract() {
    rm -rf "$work/state"
    rcli FLUSHDB >/dev/null
    local start; start=$(now)
    RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" run "$work/$1.toml" --until-caught-up \
        --summary-json "$work/summary.json" >/dev/null
    python3 -c "import time; print(time.time() - $start)" >> "$work/$1.secs"
    cat "$work/rss" >> "$work/$1.rss"
    python3 - "$work/summary.json" "$events" "$1" "$work/$1.deleted" <<'PY'
import json, sys
s, events, sink = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
if s["changes"] != {"u": events} or s["dead_letters"] != 0:
    sys.exit(f"refract read changes {s['changes']} with {s['dead_letters']} dead letters; expected {events} updates")
open(sys.argv[4], "a").write(f"{s['sinks'][sink]['deleted']}\n")
PY
}
# run_baseline N: redis-benchmark sends N DELs on one connection, DEPTH per round trip.
run_baseline() {
    rcli FLUSHDB >/dev/null
    redis-benchmark -h "$host" -p "$port" --dbnum "$db" -c 1 -P "$depth" -n "$1" -r "$ids" --csv \
        DEL 'product:__rand_int__:v3' > "$work/baseline.csv"
    python3 -c 'import csv, sys; print(next(csv.DictReader(open(sys.argv[1])))["rps"])' "$work/baseline.csv" >> "$work/baseline.rps"
}

echo "file: $events product updates over $ids ids, $(( $(stat -c %s "$log") / 1048576 )) MiB; pipeline_depth $depth; refract sends ${command^^} with up to $keys_per_command keys per command"
# Two rounds with the order swapped, so neither side profits from running second.
for round in 1 2; do
    if [ "$round" = 1 ]; then
        run_refract redis
        deleted=$(tail -1 "$work/redis.deleted")
        run_baseline "$deleted"; run_refract null
    else
        run_refract null; run_baseline "$deleted"; run_refract redis
    fi
    echo "round $round: refract $(tail -1 "$work/redis.secs" | xargs printf '%.2f')s, redis-benchmark $(tail -1 "$work/baseline.rps") DEL/s, null sink $(tail -1 "$work/null.secs" | xargs printf '%.2f')s"
done

python3 - "$work" "$events" "$depth" "${command^^}" <<'PY'
import os, sys
work, events, depth, command = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
read = lambda f: [float(x) for x in open(os.path.join(work, f)).read().split()]
deleted = read("redis.deleted")
assert len(set(deleted)) == 1, f"the two runs deleted different counts: {deleted}"
deleted = deleted[0]
secs, null_secs, rps = min(read("redis.secs")), min(read("null.secs")), max(read("baseline.rps"))
d = deleted / secs
print(f"\n{events} events -> {deleted:,.0f} keys deleted by {command} (best of 2 rounds, {os.cpu_count()} cores)")
print(f"deletes/s: refract {d:,.0f} ({secs:.2f}s) / redis-benchmark -c 1 -P {depth} DEL {rps:,.0f} = {d / rps:.2f}x")
print(f"refract events/s: {events / secs:,.0f}")
print(f"refract peak RSS: {max(read('redis.rss')) / 1024:.1f} MiB")
print(f"reference, same pipeline into the null sink (decode + projection, no Redis): "
      f"{events / null_secs:,.0f} events/s, {deleted / null_secs:,.0f} keys/s ({null_secs:.2f}s) "
      f"= {deleted / null_secs / rps:.2f}x of redis-benchmark")
PY
