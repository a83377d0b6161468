#!/usr/bin/env bash
# Benchmark: compaction of the flattened Parquet tables after a daemon's interval of changes.
# DOCS customer_orders creates (gen-envelopes --orders) are loaded through the shipped pipeline's
# projection and sink (untimed); then CHANGED of those orders change (every tenth deleted, the
# others updated with an item fewer) and `refract run --until-caught-up` writes them to the change
# log (and compacts). The current states from before the changes are then put back and
# `refract compact` alone rebuilds current/ from them and the new change files: that is the
# compaction timed. Next to it, in the same run, pyarrow does the same merge of the same inputs
# (benches/parquet_compaction.py merge: read_table, group_by and joins, write_table with zstd),
# and both results are compared row for row (a difference fails the run).
# Prints the rows of each table, `compaction: refract S s / pyarrow S s = ratio`, and the peak
# RSS and CPU time of both (refract's of `refract compact`, pyarrow's of its whole process).
# One run of each. order_items has about 2.5 rows an order: 4000000 orders make a 10M-row table.
#
# Usage: benches/parquet_compaction.sh [DOCS] [CHANGED]   (default 1000000 and 1%, 100000 when
#        CI=true; BENCH_DIR keeps the files for another look)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
if [ "${CI:-}" = true ]; then docs=${1:-100000}; else docs=${1:-1000000}; fi
changed=${2:-$((docs / 100))}
parquet_bench_setup

log="$work/compaction-$docs.jsonl"
rm -rf "$work/state" "$work/out" "$work/before" "$work/pyarrow"
"$target/release/gen-envelopes" --orders "$docs" "$log"
orders_flatten_pipeline "$work" "$log" > "$work/pipeline.toml"
RUST_LOG=warn "$refract" run "$work/pipeline.toml" --until-caught-up >/dev/null
mkdir -p "$work/before"
for table in orders customers order_items; do
    cp "$work/out/$table/current/part-0.parquet" "$work/before/$table.parquet"
done
find "$work/out" -path '*/changes/*.parquet' | sort > "$work/files-before"
echo "state: $docs orders loaded, $(du -sh "$work/before" | cut -f1) of current state; $changed orders change; $(nproc) cores"
python3 -c 'import os, sys, pyarrow.parquet as pq
d = sys.argv[1]
print("rows: " + ", ".join(t + " " + str(pq.ParquetFile(os.path.join(d, t + ".parquet")).metadata.num_rows) for t in sys.argv[2:]))' \
    "$work/before" orders customers order_items

python3 benches/parquet_compaction.py changes "$log" "$changed"
RUST_LOG=warn "$refract" run "$work/pipeline.toml" --until-caught-up >/dev/null
find "$work/out" -path '*/changes/*.parquet' | sort | comm -13 "$work/files-before" - > "$work/files-new"
# The states from before the changes, so that `refract compact` alone merges the changes in.
for table in orders customers order_items; do
    cp "$work/before/$table.parquet" "$work/out/$table/current/part-0.parquet"
done
RUST_LOG=warn timed "$work/time" "$refract" compact "$work/pipeline.toml"

python3 benches/parquet_compaction.py merge "$work/before" "$work/pyarrow" "$work/files-new" | tee "$work/pyarrow.txt"

python3 - "$work" <<'PY'
import json, os, re, sys
work = sys.argv[1]
wall, rss_kib, user, system = open(os.path.join(work, "time")).read().split()[-4:]
secs = float(wall)
text = open(os.path.join(work, "pyarrow.txt")).read()
p_secs = float(re.search(r"^pyarrow: \d+ rows in ([\d.]+) s$", text, re.M).group(1))
p_rss = float(re.search(r"^pyarrow peak RSS: ([\d.]+) MiB$", text, re.M).group(1))
p_cpu = float(re.search(r"^pyarrow CPU: ([\d.]+) s$", text, re.M).group(1))
rss = int(rss_kib) / 1024
print(f"\ncompaction: refract {secs:.2f} s / pyarrow {p_secs:.2f} s = {p_secs / secs:.2f}x pyarrow's speed")
print(f"peak RSS: refract {rss:.1f} MiB (refract compact) / pyarrow {p_rss:.1f} MiB = {rss / p_rss:.2f}")
print(f"CPU (user + system): refract {float(user) + float(system):.2f} s (refract compact), pyarrow {p_cpu:.2f} s")
PY
python3 benches/parquet_compaction.py compare "$work/out" "$work/pyarrow"
