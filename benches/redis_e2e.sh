#!/usr/bin/env bash
# Benchmark: drain a backlog of product updates from a logical replication slot into Redis
# (PostgreSQL source -> cache_invalidation projection -> redis sink, UNLINK pipelined), next to
# pg_recvlogical (pgoutput) draining the same backlog from its own slot to /dev/null, in the same
# run. The table is the showcase `products` (../shared/showcase/products.sql: REPLICA IDENTITY
# FULL, so every update carries its old row) with PRODUCT_ROWS rows (default 100,000), in a
# database of its own; the backlog is UPDATES single-row updates (default 1,000,000) made by
# whole-table UPDATE statements of PRODUCT_ROWS rows each (one transaction each): the price and
# updated_at change in every row, the sku in one row of ten (its old sku key is deleted too).
# Prints `refract changes/s / pg_recvlogical changes/s = ratio`, refract's deletes/s (the
# UNLINKs the sink sent) and its peak RSS. The keys do not exist in Redis (REDIS_DB is flushed).
#
# Usage: benches/redis_e2e.sh [UPDATES]   (PG_URL as in the environment contract, its database is
#        only used to create and drop the benchmark's own; PRODUCT_ROWS; PIPELINE_DEPTH (default
#        100); REDIS_URL (default redis://127.0.0.1:6379); REDIS_DB (default 9, flushed))
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
updates=${1:-1000000}
url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
rows=${PRODUCT_ROWS:-100000}
depth=${PIPELINE_DEPTH:-100}
redis_url=${REDIS_URL:-redis://127.0.0.1:6379}
db=${REDIS_DB:-9}
passes=$(( (updates + rows - 1) / rows ))
updates=$(( passes * rows ))
bench_db=refract_bench_redis
bench_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$url" "$bench_db")
admin_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/postgres")))' "$url")
read -r rhost rport < <(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(p.hostname or "127.0.0.1", p.port or 6379)' "$redis_url")
work=$(mktemp -d)
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
command -v pg_recvlogical >/dev/null || PATH=$PATH:$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
command -v pg_recvlogical >/dev/null || { echo "pg_recvlogical not found (PATH or /usr/lib/postgresql/*/bin)" >&2; exit 1; }
cargo build --release --locked -q -p refract
refract=${CARGO_TARGET_DIR:-target}/release/refract
sqla() { psql "$admin_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
sql() { psql "$bench_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
rcli() { redis-cli -h "$rhost" -p "$rport" -n "$db" "$@"; }
cleanup() {
    if [ "$(sqla "SELECT count(*) FROM pg_database WHERE datname = '$bench_db'" 2>/dev/null)" = 1 ]; then
        sql "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ('refract_bench_cache', 'bench_cache_recv') AND NOT active" >/dev/null || true
        sqla "DROP DATABASE IF EXISTS $bench_db" >/dev/null || true
    fi
    rcli FLUSHDB >/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
cleanup; mkdir -p "$work"

# --- The table, refract's slot and publication, pg_recvlogical's slot ---------------------------
sqla "CREATE DATABASE $bench_db"
create_products "$rows"
{
    cat <<TOML
[pipeline]
name = "bench_cache"
state_dir = "$work/state"
TOML
    products_cache_sections
} > "$work/cache.toml"
# A first run creates the slot refract_bench_cache and the publication refract_bench_cache.
RUST_LOG=warn "$refract" run "$work/cache.toml" --until-caught-up >/dev/null
sql "SELECT pg_create_logical_replication_slot('bench_cache_recv', 'pgoutput')" >/dev/null

now() { python3 -c 'import time; print(time.time())'; }
drain_recv() {   # drain_recv ENDPOS
    local start; start=$(now)
    pg_recvlogical -d "$bench_url" --slot bench_cache_recv --start --endpos "$1" --no-loop \
        -o proto_version=1 -o publication_names=refract_bench_cache -f /dev/null
    python3 -c "import time; print(time.time() - $start)" >> "$work/recv.secs"
}
drain_refract() {   # refract drains into Redis; it must read exactly the backlog's updates
    rcli FLUSHDB >/dev/null
    local start; start=$(now)
    RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" run "$work/cache.toml" --until-caught-up \
        --summary-json "$work/summary.json" >/dev/null
    python3 -c "import time; print(time.time() - $start)" >> "$work/refract.secs"
    cat "$work/rss" >> "$work/refract.rss"
    python3 - "$work/summary.json" "$updates" "$work/refract.deleted" <<'PY'
import json, sys
s, updates = json.load(open(sys.argv[1])), int(sys.argv[2])
if s["changes"] != {"u": updates} or s["dead_letters"] != 0:
    sys.exit(f"refract read changes {s['changes']} with {s['dead_letters']} dead letters; expected {updates} updates")
open(sys.argv[3], "a").write(f"{s['sinks']['redis']['deleted']}\n")
PY
}

# Two rounds with the order swapped, so neither side profits from the other's warm caches.
for round in 1 2; do
    echo "round $round: $passes UPDATE statements of $rows rows = $updates single-row updates"
    for pass in $(seq 1 "$passes"); do
        # Asynchronous commit only makes the backlog quicker to produce; the WAL is the same.
        PGOPTIONS='-c synchronous_commit=off' sql "UPDATE products SET price_cents = price_cents + 1, updated_at = now(),
            sku = CASE WHEN id % 10 = $pass % 10 THEN 'SKU-' || lpad(id::text, 8, '0') || '-$round-$pass' ELSE sku END"
    done
    sql "VACUUM products"
    # The insert position: with asynchronous commit the write position may still be short of
    # the last commits, and pg_recvlogical would stop before them.
    endpos=$(sql "SELECT pg_current_wal_insert_lsn()")
    if [ "$round" = 1 ]; then drain_recv "$endpos"; drain_refract; else drain_refract; drain_recv "$endpos"; fi
    echo "  refract $(tail -1 "$work/refract.secs" | xargs printf '%.2f')s, pg_recvlogical $(tail -1 "$work/recv.secs" | xargs printf '%.2f')s"
done

python3 - "$work" "$updates" "$rows" "$depth" <<'PY'
import os, sys
work, updates, rows, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
read = lambda f: [float(x) for x in open(os.path.join(work, f)).read().split()]
secs, recv, rss, deleted = read("refract.secs"), read("recv.secs"), read("refract.rss"), read("refract.deleted")
best = min(range(len(secs)), key=lambda i: secs[i])
r, p = updates / secs[best], updates / min(recv)
print(f"\nbacklog: {updates} single-row updates of products ({updates // rows} UPDATE statements of {rows} rows, "
      f"REPLICA IDENTITY FULL); best of 2 rounds on {os.cpu_count()} cores")
print(f"drain changes/s: refract -> Redis {r:,.0f} ({secs[best]:.2f}s) / pg_recvlogical {p:,.0f} ({min(recv):.2f}s) = {r / p:.2f}x")
print(f"refract deletes/s: {deleted[best] / secs[best]:,.0f} ({deleted[best]:,.0f} UNLINKs, pipeline_depth {depth})")
print(f"refract peak RSS: {max(rss) / 1024:.1f} MiB")
rounds = lambda xs: ", ".join(f"{x:.2f}s" for x in xs)
print(f"  each round: refract {rounds(secs)}; pg_recvlogical {rounds(recv)}")
PY
