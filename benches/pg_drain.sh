#!/usr/bin/env bash
# Benchmark: drain backlogs from logical replication slots into the null sink (PostgreSQL source
# -> replica projection -> null sink), next to pg_recvlogical (pgoutput) draining the same backlog
# from its own slot to /dev/null in the same run. Two backlogs:
#   1. one transaction of ROWS inserts (default 1,000,000) into one table;
#   2. a pgbench TPC-B backlog of about PGBENCH_CHANGES row changes (default 100,000) in many
#      small transactions over four tables: each TPC-B transaction updates pgbench_accounts,
#      pgbench_tellers and pgbench_branches and inserts into pgbench_history (4 changes).
# Each prints `refract changes/s / pg_recvlogical changes/s = ratio` and refract's peak RSS.
#
# Usage: benches/pg_drain.sh [ROWS]   (PG_URL as in the environment contract; PGBENCH_CHANGES,
#                                      PGBENCH_SCALE (default 4) and PGBENCH_CLIENTS (default 4)
#                                      tune the second backlog)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-1000000}
url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
pgbench_changes=${PGBENCH_CHANGES:-100000}
pgbench_scale=${PGBENCH_SCALE:-4}
pgbench_clients=${PGBENCH_CLIENTS:-4}
# The TPC-B backlog lives in its own database, so pgbench's tables meet nothing else.
pgbench_db=refract_bench_pgbench
pgbench_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$url" "$pgbench_db")
work=$(mktemp -d)
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
pgbench=$(command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench 2>/dev/null | sort -V | tail -1)
[ -x "$pgbench" ] || { echo "pgbench not found (PATH or /usr/lib/postgresql/*/bin)" >&2; exit 1; }
cargo build --release --locked -q -p refract
refract=${REFRACT_BIN:-${CARGO_TARGET_DIR:-target}/release/refract}
sql() { psql "$url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
sqlb() { psql "$pgbench_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
cleanup() {
    sql "SET client_min_messages = warning;
         SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ('refract_bench_drain', 'bench_recv');
         DROP PUBLICATION IF EXISTS bench_pub; DROP TABLE IF EXISTS bench_drain;" >/dev/null || true
    if [ "$(sql "SELECT count(*) FROM pg_database WHERE datname = '$pgbench_db'" 2>/dev/null)" = 1 ]; then
        sqlb "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ('refract_bench_pgbench', 'bench_pgbench_recv')" >/dev/null || true
        sql "DROP DATABASE IF EXISTS $pgbench_db" >/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
cleanup; mkdir -p "$work"

# Wall-clock seconds, read without starting an interpreter (which would add its start-up time
# to every figure).
now() { date +%s.%N; }
since() { local end; end=$(now); python3 -c "print($end - $1)"; }
# drain_recv URL SLOT PUBLICATION ENDPOS NAME: pg_recvlogical drains SLOT up to ENDPOS.
drain_recv() {
    local start; start=$(now)
    pg_recvlogical -d "$1" --slot "$2" --start --endpos "$4" --no-loop \
        -o proto_version=1 -o publication_names="$3" -f /dev/null
    since "$start" >> "$work/$5.recv_secs"
}
# drain_refract PIPELINE NAME EXPECTED_CHANGES_JSON: refract drains into the null sink; the run
# must have read exactly the expected number of changes for each op named, without dead letters.
drain_refract() {
    local start; start=$(now)
    RUST_LOG=warn /usr/bin/time -f '%M' -o "$work/rss" "$refract" run "$1" --until-caught-up \
        --summary-json "$work/summary.json" >/dev/null
    since "$start" >> "$work/$2.refract_secs"
    cat "$work/rss" >> "$work/$2.rss_all"
    python3 - "$work/summary.json" "$3" <<'PY'
import json, sys
summary, expected = json.load(open(sys.argv[1])), json.loads(sys.argv[2])
read = {op: summary["changes"].get(op, 0) for op in expected}
if read != expected or summary["dead_letters"] != 0:
    sys.exit(f"refract read changes {summary['changes']} with {summary['dead_letters']} dead letters; expected {expected}")
PY
}
# report NAME CHANGES DESCRIPTION
report() {
    python3 - "$2" "$work/$1" "$3" <<'PY'
import sys
changes, prefix, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
read = lambda f: [float(x) for x in open(f"{prefix}.{f}").read().split()]
ref, recv, rss = min(read("refract_secs")), min(read("recv_secs")), max(read("rss_all"))
r, p = changes / ref, changes / recv
print(f"backlog: {what} (best of {len(read('recv_secs'))} rounds)")
print(f"drain changes/s: refract {r:,.0f} ({ref:.2f}s) / pg_recvlogical {p:,.0f} ({recv:.2f}s) = {r / p:.2f}x")
print(f"refract peak RSS: {rss / 1024:.1f} MiB")
rounds = lambda f: ", ".join(f"{x:.2f}s" for x in read(f))
print(f"  each round: refract {rounds('refract_secs')}; pg_recvlogical {rounds('recv_secs')}")
PY
}

# --- Backlog 1: one transaction of ROWS inserts -----------------------------------------------
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

# ROUNDS rounds of each backlog (default 3), the order swapped every other round, so neither
# side profits from the other's warm caches; the best of each side is compared (this machine is
# noisy).
rounds=${ROUNDS:-3}
for round in $(seq 1 "$rounds"); do
    echo "round $round: inserting $rows rows in one transaction"
    sql "TRUNCATE bench_drain; INSERT INTO bench_drain SELECT g, 'item ' || g, g % 100, g / 100.0, 'note ' || g FROM generate_series(1, $rows) g"
    endpos=$(sql "SELECT pg_current_wal_lsn()")
    expected="{\"c\": $rows}"   # (each round's TRUNCATE is in the backlog too: one `t`)
    if [ $((round % 2)) = 1 ]; then
        drain_recv "$url" bench_recv bench_pub "$endpos" insert; drain_refract "$work/drain.toml" insert "$expected"
    else
        drain_refract "$work/drain.toml" insert "$expected"; drain_recv "$url" bench_recv bench_pub "$endpos" insert
    fi
done

# --- Backlog 2: pgbench TPC-B -------------------------------------------------------------------
# Standard TPC-B: 4 row changes per transaction (3 updates, 1 insert into pgbench_history).
transactions_per_client=$(( (pgbench_changes / 4 + pgbench_clients - 1) / pgbench_clients ))
transactions=$(( transactions_per_client * pgbench_clients ))
changes=$(( transactions * 4 ))
sql "CREATE DATABASE $pgbench_db"
echo "pgbench -i -s $pgbench_scale into database $pgbench_db"
"$pgbench" -i -q -s "$pgbench_scale" "$pgbench_url" 2>&1 | tail -1
# pgbench_history has no primary key: inserts are published whatever the replica identity;
# REPLICA IDENTITY FULL makes every column its identity (and lets updates/deletes be published,
# which TPC-B never does). refract keys its documents by the columns below.
sqlb "ALTER TABLE pgbench_history REPLICA IDENTITY FULL;
      CREATE PUBLICATION bench_pgbench_pub FOR TABLE pgbench_accounts, pgbench_tellers, pgbench_branches, pgbench_history;"
sqlb "SELECT pg_create_logical_replication_slot('bench_pgbench_recv', 'pgoutput')" >/dev/null
sqlb "SELECT pg_create_logical_replication_slot('refract_bench_pgbench', 'pgoutput')" >/dev/null
cat > "$work/pgbench.toml" <<TOML
[pipeline]
name = "bench_pgbench"
state_dir = "$work/state"
[source]
kind = "postgres"
url = "$pgbench_url"
publication = "bench_pgbench_pub"
create = false
[projections.replica]
kind = "replica"
key_columns = { pgbench_history = ["tid", "bid", "aid", "mtime"] }
sinks = ["null"]
[sinks.null]
kind = "null"
TOML
for round in $(seq 1 "$rounds"); do
    echo "round $round: pgbench TPC-B, $pgbench_clients clients x $transactions_per_client transactions = $changes row changes"
    # Asynchronous commit only makes the backlog quicker to produce; the WAL is the same.
    PGOPTIONS='-c synchronous_commit=off' "$pgbench" -n -t "$transactions_per_client" -c "$pgbench_clients" -j 2 "$pgbench_url" \
        > "$work/pgbench.out" 2>&1 || { cat "$work/pgbench.out"; exit 1; }
    grep -E 'number of transactions actually processed|tps' "$work/pgbench.out" | sed 's/^/  /'
    grep -q "actually processed: $transactions/$transactions" "$work/pgbench.out" \
        || { echo "pgbench did not process all $transactions transactions" >&2; exit 1; }
    # The insert position: with asynchronous commit the write position may still be short of
    # the last commits, and pg_recvlogical would stop before them.
    endpos=$(sqlb "SELECT pg_current_wal_insert_lsn()")
    expected="{\"c\": $transactions, \"u\": $(( transactions * 3 )), \"d\": 0, \"t\": 0}"
    if [ $((round % 2)) = 1 ]; then
        drain_recv "$pgbench_url" bench_pgbench_recv bench_pgbench_pub "$endpos" tpcb
        drain_refract "$work/pgbench.toml" tpcb "$expected"
    else
        drain_refract "$work/pgbench.toml" tpcb "$expected"
        drain_recv "$pgbench_url" bench_pgbench_recv bench_pgbench_pub "$endpos" tpcb
    fi
done

report insert "$rows" "one transaction of $rows inserts"
report tpcb "$changes" "pgbench TPC-B, $transactions transactions of 4 row changes ($changes changes: $(( transactions * 3 )) updates, $transactions inserts into pgbench_history), scale $pgbench_scale, $pgbench_clients clients"
