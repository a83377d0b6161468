#!/usr/bin/env bash
# Benchmark: `refract migrate` of the showcase `orders` (ROWS rows) into `orders_v2` with the
# shipped migration file, next to PostgreSQL's own work on the same server, in the same run:
# - backfill rows/s next to `INSERT INTO orders_v2 SELECT <the transform in SQL> FROM orders`
#   (the same-server copy, the physical limit); both run while the dual write streams (the slot
#   exists and decodes both copies alike), each into an empty `orders_v2`;
#   Before the backfill starts, the dual write catches up with the WAL of the INSERT … SELECT
#   (which it decodes after that commit): the backfill's time holds the decoding of its own
#   writes, not of the baseline's (the catch-up time is printed);
# - verify rows/s next to one SELECT hashing both tables (md5 of every row, in key order).
# Prints `figure / baseline = ratio` for each.
#
# Usage: benches/migrate.sh [ROWS]   (default 1000000; PG_URL names the server, as in the
# environment contract; the benchmark works in a database of its own, `refract_bench_migrate`;
# MIGRATION_FILE another migration file of the same tables, e.g. with another batch_rows)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
server=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
db=refract_bench_migrate
url="${server%/*}/$db"
slot=refract_bench_migrate
work=$(mktemp -d)
cargo build --release --locked -q -p refract
refract=${CARGO_TARGET_DIR:-target}/release/refract
sql() { psql "$url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
daemon=
cleanup() {
    [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
    psql "$server" -X -Atqc "SELECT pg_drop_replication_slot('$slot') FROM pg_replication_slots WHERE slot_name = '$slot'" >/dev/null || true
    psql "$server" -X -Atqc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$work"
psql "$server" -X -qc "CREATE DATABASE $db"
sql "$(cat pipelines/orders-v2.sql)"
sql "INSERT INTO orders SELECT 'ORD-' || lpad(g::text, 8, '0'), 'U' || (g % 50000),
       (ARRAY['US','EU','APAC'])[1 + g % 3], (ARRAY['pending','paid','shipped'])[1 + g % 3],
       (g % 100000) / 100.0, timestamptz '2024-01-01' + g * interval '1 second'
     FROM generate_series(1, $rows) g"
sql "VACUUM ANALYZE orders"

migrate() {
    PG_URL="$url" REFRACT_SLOT="$slot" STATE_DIR="$work/state" RUST_LOG=warn \
        "$refract" migrate "${MIGRATION_FILE:-pipelines/orders-v2.migration.toml}" "$@"
}
now() { date +%s.%N; }
since() { local end; end=$(now); python3 -c "print($end - $1)"; }
ratio() { python3 -c "a, b = $1, $2; print(f'{a:,.0f} rows/s / {b:,.0f} rows/s = {a / b:.2f}x')"; }

# Not through `migrate`: $! must be refract itself, for the cleanup to stop it.
PG_URL="$url" REFRACT_SLOT="$slot" STATE_DIR="$work/state" RUST_LOG=warn \
    "$refract" migrate "${MIGRATION_FILE:-pipelines/orders-v2.migration.toml}" start >"$work/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 1 600); do
    [ "$(sql "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$slot' AND confirmed_flush_lsn IS NOT NULL")" = 1 ] && break
    sleep 0.1
done

echo "orders: $rows rows; the dual write runs (slot $slot)"
start=$(now)
sql "INSERT INTO orders_v2 SELECT region, substring(user_id from 2)::bigint, order_id, status,
       (total_amount * 100)::bigint, created_at FROM orders"
insert_s=$(since "$start")
sql "TRUNCATE orders_v2"
sql "VACUUM ANALYZE orders_v2"
start=$(now)
wal=$(sql "SELECT pg_current_wal_lsn()")
for _ in $(seq 1 3000); do
    [ "$(sql "SELECT confirmed_flush_lsn >= '$wal' FROM pg_replication_slots WHERE slot_name = '$slot'")" = t ] && break
    sleep 0.1
done
catchup_s=$(since "$start")

start=$(now)
migrate backfill >"$work/backfill.log" 2>&1 || { cat "$work/backfill.log"; exit 1; }
backfill_s=$(since "$start")
copied=$(sql "SELECT count(*) FROM orders_v2")
[ "$copied" = "$rows" ] || { echo "backfill copied $copied rows of $rows"; exit 1; }

start=$(now)
sql "SELECT (SELECT md5(string_agg(o::text, '' ORDER BY order_id)) FROM orders o),
            (SELECT md5(string_agg(v::text, '' ORDER BY order_id)) FROM orders_v2 v)" >/dev/null
hash_s=$(since "$start")

start=$(now)
migrate verify >"$work/verify.log" 2>&1 || { cat "$work/verify.log"; exit 1; }
verify_s=$(since "$start")

printf 'INSERT … SELECT %.2fs (then %.2fs for the dual write to decode it), backfill %.2fs, hashing SELECT %.2fs, verify %.2fs\n' \
    "$insert_s" "$catchup_s" "$backfill_s" "$hash_s" "$verify_s"
echo "backfill: $(ratio "$rows / $backfill_s" "$rows / $insert_s")   (target >= 0.5x)"
echo "verify:   $(ratio "$rows / $verify_s" "$rows / $hash_s")"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
