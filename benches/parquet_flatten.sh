#!/usr/bin/env bash
# Benchmark: DOCS Debezium creates of the showcase `public.customer_orders` table (a nested JSON
# `doc` per order, gen-envelopes --orders) in a file -> flatten projection -> Parquet (zstd), next
# to pyarrow doing the same read-flatten-write in the same run (benches/parquet_flatten.py:
# pyarrow.json.read_json, pyarrow compute, pyarrow.parquet.write_table) into the same three tables:
# orders, customers (one row per customer, the last occurrence wins) and order_items.
# Prints `flatten to parquet: refract docs/s / pyarrow docs/s = ratio`, the peak RSS and the CPU
# time (user + system, whole processes) of both, the columnar probe's rate next to pyarrow's
# (benches/columnar_probe.rs: a bound for planning, not refract's path), and the row counts of all
# three outputs per table (a mismatch fails the run).
# One run of each.
#
# Usage: benches/parquet_flatten.sh [DOCS]   (default 1000000, 100000 when CI=true;
#        BENCH_DIR keeps the generated file and both outputs for another look)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
if [ "${CI:-}" = true ]; then docs=${1:-100000}; else docs=${1:-1000000}; fi
parquet_bench_setup

log="$work/orders-$docs.jsonl"
[ -s "$log" ] || "$target/release/gen-envelopes" --orders "$docs" "$log"

orders_flatten_pipeline "$work" "$log" > "$work/pipeline.toml"

echo "file: $docs customer_orders creates, $(( $(stat -c %s "$log") / 1048576 )) MiB; $(nproc) cores"
rm -rf "$work/pyarrow"
python3 benches/parquet_flatten.py "$log" "$work/pyarrow" | tee "$work/pyarrow.txt"

rm -rf "$work/state" "$work/out"
RUST_LOG=warn timed "$work/time" \
    "$refract" run "$work/pipeline.toml" --until-caught-up --summary-json "$work/summary.json"

# For planning: the columnar probe (benches/columnar_probe.rs) decodes the same file straight
# into Arrow builders and writes the three tables, with no change log, positions or compaction.
# It is not refract's path; it bounds what a columnar fast path could reach.
rm -rf "$work/probe"
"$target/release/columnar-probe" "$log" "$work/probe" > "$work/probe.txt"

python3 - "$work" "$docs" <<'PY'
import glob, json, os, re, sys
import pyarrow.parquet as pq
work, docs = sys.argv[1], int(sys.argv[2])
summary = json.load(open(os.path.join(work, "summary.json")))
records = summary["records"]
# The summary's elapsed time ends when the change log is published, before compaction.
log_secs = float(summary["elapsed"])
if records != docs:
    sys.exit(f"refract read {records} of {docs} envelopes")
secs, rss_kib, user, system = open(os.path.join(work, "time")).read().split()[-4:]
secs, rss_mib, cpu = float(secs), int(rss_kib) / 1024, float(user) + float(system)
text = open(os.path.join(work, "pyarrow.txt")).read()
p_secs, p_rate = (float(x) for x in re.search(r"^pyarrow: \d+ docs in ([\d.]+) s = ([\d.]+) docs/s$", text, re.M).groups())
p_rss = re.search(r"^pyarrow peak RSS: (.*)$", text, re.M).group(1)
p_cpu = float(re.search(r"^pyarrow CPU: ([\d.]+) s$", text, re.M).group(1))
rate = docs / secs
print(f"\nrefract: {docs} docs in {secs:.2f} s = {rate:.0f} docs/s")
print(f"pyarrow: {docs} docs in {p_secs:.2f} s = {p_rate:.0f} docs/s")
print(f"flatten to parquet: {rate:.0f} docs/s / pyarrow {p_rate:.0f} docs/s = {rate / p_rate:.2f}x")
print(f"  of which the change log: {log_secs:.2f} s ({docs / log_secs:.0f} docs/s / pyarrow = {docs / log_secs / p_rate:.2f}x), "
      f"compaction into current/: {secs - log_secs:.2f} s")
print(f"peak RSS: refract {rss_mib:.1f} MiB, pyarrow {p_rss}")
# On a machine with few cores, the CPU time is what a faster wall time must come out of.
print(f"CPU (user + system): refract {cpu:.2f} s, pyarrow {p_cpu:.2f} s = {cpu / p_cpu:.2f}x the CPU; "
      f"{os.cpu_count()} cores")
probe = open(os.path.join(work, "probe.txt")).read()
q_rate = float(re.search(r"^columnar probe: \d+ docs in [\d.]+ s = ([\d.]+) docs/s$", probe, re.M).group(1))
print(f"columnar probe (not refract's path: no change log, positions or compaction): "
      f"{q_rate:.0f} docs/s / pyarrow {p_rate:.0f} docs/s = {q_rate / p_rate:.2f}x")

rows = lambda files: sum(pq.ParquetFile(f).metadata.num_rows for f in files)
failed = False
for table in ["orders", "customers", "order_items"]:
    r = rows(glob.glob(os.path.join(work, "out", table, "current", "**", "*.parquet"), recursive=True))
    p = rows([os.path.join(work, "pyarrow", f"{table}.parquet")])
    q = rows([os.path.join(work, "probe", f"{table}.parquet")])
    print(f"rows {table}: refract {r}, pyarrow {p}, probe {q}{'' if r == p == q else '  MISMATCH'}")
    failed |= not r == p == q
sys.exit(1 if failed else 0)
PY
