#!/usr/bin/env bash
# Benchmark: commit-to-delete latency of cache invalidation at a steady RATE transactions/s
# (default 2,000) for SECONDS (default 30). refract runs as a daemon (PostgreSQL source ->
# cache_invalidation projection -> redis sink, UNLINK) on the showcase `products` table
# (../shared/showcase/products.sql) in a database of its own; redis_latency.py pre-fills every
# `product:{id}:v3` key, commits single-row updates on a fixed schedule from WRITERS processes
# (default 8: 4 reached only 1,600-1,800 tx/s on a loaded 2-core machine), each on a connection of
# its own and each update on a different id, notes time.time() right after each COMMIT returns,
# and reads the server time of each key's UNLINK from Redis MONITOR (same machine clock).
# Prints p50/p90/p99/max latency, the transactions and the achieved rate, the deletes never seen
# (must be 0), a measurement floor (a client's own UNLINK seen through MONITOR), and refract's
# peak RSS.
#
# Usage: benches/redis_latency.sh [SECONDS]   (PG_URL as in the environment contract, its database
#        is only used to create and drop the benchmark's own; RATE (default 2000); WRITERS
#        (default 8); BATCH_MAX_DELAY_MS (default 10; `default` keeps refract's batch defaults:
#        200 ms); PIPELINE_DEPTH (default 100); REDIS_URL (default redis://127.0.0.1:6379); REDIS_DB
#        (default 9, flushed))
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
seconds=${1:-30}
rate=${RATE:-2000}
writers=${WRITERS:-8}
max_delay=${BATCH_MAX_DELAY_MS:-10}
depth=${PIPELINE_DEPTH:-100}
url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
redis_url=${REDIS_URL:-redis://127.0.0.1:6379}
db=${REDIS_DB:-9}
rows=$(python3 -c "print(int($seconds * $rate))")
bench_db=refract_bench_redis_latency
bench_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$url" "$bench_db")
admin_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/postgres")))' "$url")
read -r rhost rport < <(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(p.hostname or "127.0.0.1", p.port or 6379)' "$redis_url")
work=$(mktemp -d)
python3 -c 'import psycopg, redis' 2>/dev/null || python3 -m pip install -q 'psycopg[binary]' redis
cargo build --release --locked -q -p refract
refract=${CARGO_TARGET_DIR:-target}/release/refract
sqla() { psql "$admin_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
sql() { psql "$bench_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
daemon=
cleanup() {
    if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then kill -TERM "$daemon"; wait "$daemon" || true; fi
    if [ "$(sqla "SELECT count(*) FROM pg_database WHERE datname = '$bench_db'" 2>/dev/null)" = 1 ]; then
        sql "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_bench_cache_latency' AND NOT active" >/dev/null || true
        sqla "DROP DATABASE IF EXISTS $bench_db" >/dev/null || true
    fi
    redis-cli -h "$rhost" -p "$rport" -n "$db" FLUSHDB >/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
cleanup; mkdir -p "$work"

sqla "CREATE DATABASE $bench_db"
create_products "$rows"
{
    cat <<TOML
[pipeline]
name = "bench_cache_latency"
state_dir = "$work/state"
TOML
    [ "$max_delay" = default ] || printf '[pipeline.batch]\nmax_delay_ms = %s\n' "$max_delay"
    products_cache_sections
} > "$work/cache.toml"
# A first run creates the slot and the publication; then the daemon streams.
RUST_LOG=warn "$refract" run "$work/cache.toml" --until-caught-up >/dev/null
RUST_LOG=warn "$refract" run "$work/cache.toml" > "$work/daemon.out" 2>&1 &
daemon=$!
for _ in $(seq 1 100); do
    [ "$(sql "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'refract_bench_cache_latency' AND active")" = 1 ] && break
    sleep 0.1
done
sleep 1

batching="[pipeline.batch] max_delay_ms = $max_delay"
[ "$max_delay" != default ] || batching="refract's batch defaults (max_delay_ms 200, max_events 5000)"
echo "refract daemon: $batching; redis pipeline_depth $depth; $rate tx/s for ${seconds}s from $writers writers; $(nproc) cores"
status=0
python3 benches/redis_latency.py "$bench_url" "$rhost" "$rport" "$db" "$seconds" "$rate" "$writers" || status=$?
rss=$(awk '/VmHWM/ {print $2}' "/proc/$daemon/status")
kill -TERM "$daemon"; wait "$daemon" || { echo "refract daemon failed:" >&2; cat "$work/daemon.out" >&2; exit 1; }
daemon=
python3 -c "print(f'refract peak RSS: {$rss / 1024:.1f} MiB')"
exit "$status"
