#!/usr/bin/env bash
# Benchmark: drain a backlog of one 1M-row insert transaction from a logical replication slot into
# the null sink (PostgreSQL source -> replica projection -> null sink), next to pg_recvlogical
# (pgoutput) draining the same backlog from its own slot to /dev/null in the same run.
# Prints `refract changes/s / pg_recvlogical changes/s = ratio` and refract's peak RSS.
#
# Usage: benches/pg_drain.sh [ROWS]   (default 1000000; PG_URL as in the environment contract)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
work=$(mktemp -d)
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
cargo build --release --locked -q -p refract
refract=${CARGO_TARGET_DIR:-target}/release/refract
sql() { psql "$url" -v ON_ERROR_STOP=1 -Atqc "$1"; }
cleanup() {
    sql "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ('refract_bench_drain', 'bench_recv');
         DROP PUBLICATION IF EXISTS bench_pub; DROP TABLE IF EXISTS bench_drain;" >/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
cleanup; mkdir -p "$work"

sql "CREATE TABLE bench_drain (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(12,2), note text);
     CREATE PUBLICATION bench_pub FOR TABLE bench_drain;"
sql "SELECT pg_create_logical_replication_slot('bench_recv', 'pgoutput')" >/dev/null
sql "SELECT pg_create_logical_replication_slot('refract_bench_drain', 'pgoutput')" >/dev/null
cat > "$work/drain.toml" <<TOML
[pipeline]
name = "bench_drain"
state_dir = "$work/state"
[source]
kind = "postgres"
url = "$url"
publication = "bench_pub"
create = false
[projections.replica]
kind = "replica"
sinks = ["null"]
[sinks.null]
kind = "null"
TOML

now() { python3 -c 'import time; print(time.time())'; }
drain_recv() {
    local start; start=$(now)
    pg_recvlogical -d "$url" --slot bench_recv --start --endpos "$1" --no-loop \
        -o proto_version=1 -o publication_names=bench_pub -f /dev/null
    python3 -c "import time; print(time.time() - $start)" >> "$work/recv_secs"
}
drain_refract() {
    local start; start=$(now)
    RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" run "$work/drain.toml" --until-caught-up \
        --summary-json "$work/summary.json" >/dev/null
    python3 -c "import time; print(time.time() - $start)" >> "$work/refract_secs"
    cat "$work/rss" >> "$work/rss_all"
    python3 -c "import json,sys; n=json.load(open('$work/summary.json'))['changes'].get('c',0); sys.exit(0 if n == $rows else f'refract read {n} of $rows inserts')"
}
# Two rounds with the order swapped, so neither side profits from the other's warm caches.
for round in 1 2; do
    echo "round $round: inserting $rows rows in one transaction"
    sql "TRUNCATE bench_drain; INSERT INTO bench_drain SELECT g, 'item ' || g, g % 100, g / 100.0, 'note ' || g FROM generate_series(1, $rows) g"
    endpos=$(sql "SELECT pg_current_wal_lsn()")
    if [ "$round" = 1 ]; then drain_recv "$endpos"; drain_refract; else drain_refract; drain_recv "$endpos"; fi
done

python3 - "$rows" "$work" <<'PY'
import sys
rows, work = int(sys.argv[1]), sys.argv[2]
read = lambda f: [float(x) for x in open(f"{work}/{f}").read().split()]
ref, recv, rss = min(read("refract_secs")), min(read("recv_secs")), max(read("rss_all"))
r, p = rows / ref, rows / recv
print(f"backlog: one transaction of {rows} inserts (best of 2 rounds)")
print(f"drain changes/s: refract {r:,.0f} ({ref:.2f}s) / pg_recvlogical {p:,.0f} ({recv:.2f}s) = {r / p:.2f}x")
print(f"refract peak RSS: {rss / 1024:.1f} MiB")
PY
