#!/usr/bin/env bash
# Benchmark: the PostgreSQL JSONB sink's document upserts, fed from a file of change events (so
# the source is not the bottleneck), next to pgbench sending multi-row
# `INSERT … ON CONFLICT (id) DO UPDATE … WHERE source_position <= …` statements of 100 documents
# each into a table of the same shape, on one connection, in the same run.
# The file holds DOCS Debezium updates of the showcase `products` table over PRODUCT_IDS ids
# (gen-envelopes --products); the replica projection makes each one a document upsert into
# `bench_upsert.products`, 100 per statement (rows_per_statement) like pgbench. pgbench upserts as many documents of the same size into
# `bench_upsert.pgbench_docs`, its keys drawn over the same id range.
# Prints `pg sink upserts/s / pgbench upserts/s = ratio` and refract's peak RSS.
#
# Usage: benches/pg_upsert.sh [DOCS]   (default 1000000; 200000 with CI=true; PRODUCT_IDS
#        (default 1000000), PG_URL (default postgres://postgres@127.0.0.1:5432/refract),
#        BENCH_DIR (keeps the generated file for another run))
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
default_docs=1000000
[ "${CI:-}" = "true" ] && default_docs=200000
docs=${1:-$default_docs}
ids=${PRODUCT_IDS:-1000000}
pg_url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
pgbench_bench_setup
cleanup() {
    sql "DROP SCHEMA IF EXISTS bench_upsert CASCADE" || true
    rm -rf "$work/state" "$work/summary.json" "$work/time" "$work/pgbench.sql"
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

log="$work/products-$docs-$ids.jsonl"
[ -s "$log" ] || "$target/release/gen-envelopes" --products "$docs" "$log" "$ids"

sql "DROP SCHEMA IF EXISTS bench_upsert CASCADE; CREATE SCHEMA bench_upsert"
pgbench_docs_table bench_upsert.pgbench_docs

cat > "$work/pipeline.toml" <<TOML
[pipeline]
name = "bench_upsert"
state_dir = "$work/state"
[source]
kind = "file"
path = "$log"
follow = false
[projections.replica]
kind = "replica"
sinks = ["pg"]
[sinks.pg]
kind = "postgres"
url = "$pg_url"
schema = "bench_upsert"
# The statements pgbench sends: 100 documents each.
rows_per_statement = 100
TOML

echo "file: $docs products updates over $ids ids, $(( $(stat -c %s "$log") / 1048576 )) MiB; $(nproc) cores"
rm -rf "$work/state"
RUST_LOG=warn /usr/bin/time -f '%e %M' -o "$work/time" \
    "$refract" run "$work/pipeline.toml" --summary-json "$work/summary.json" >/dev/null
# pgbench: keys at random over the id range, each document as large as the products the pipeline
# writes.
tps=$(pgbench_upsert_tps bench_upsert.pgbench_docs "$docs" "$ids" "" 1 \
    '{"id": 1234567, "sku": "sku-12345", "name": "Product 1234567", "tenant_id": "t1", "price_cents": 12345, "updated_at": "2026-09-21T14:13:20.000000Z"}')
rows=$(sql "SELECT count(*) FROM bench_upsert.products")

python3 - "$work" "$docs" "$tps" "$rows" <<'PY'
import json, os, sys
work, docs, tps, rows = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
summary = json.load(open(os.path.join(work, "summary.json")))
secs = float(summary["elapsed"])
upserted = summary["sinks"]["pg"]["upserted"]
rss = int(open(os.path.join(work, "time")).read().split()[-1]) / 1024
rate, base = upserted / secs, tps * 100
print(f"refract: {summary['records']} events, {upserted} documents upserted in {secs:.2f} s ({rows} rows in the table)")
print(f"pg sink upserts: {rate:.0f} docs/s / pgbench {base:.0f} docs/s = {rate / base:.2f}x")
print(f"refract peak RSS: {rss:.1f} MiB")
PY
