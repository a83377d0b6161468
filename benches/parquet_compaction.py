"""The pyarrow side of benches/parquet_compaction.sh.

  python3 benches/parquet_compaction.py changes LOG K
      Appends K changes of the first K orders of LOG (gen-envelopes --orders) to it: every tenth
      a delete, the others updates (status `refunded`, the last item dropped when there are two
      or more, a new `updated_at`).

  python3 benches/parquet_compaction.py merge BEFORE OUT NEW_FILES
      The baseline: pyarrow doing the compaction refract does, per table, from the current state
      before the changes (BEFORE/{table}.parquet) and the change-log files they added (listed in
      NEW_FILES, one path per line, under .../{table}/changes/...): per key (per order in
      order_items, whose rows are replaced as a group) the change with the newest `_position`
      wins, a winning delete removes the key, and the untouched rows are kept. pyarrow.parquet
      read_table, pyarrow compute (group_by, joins), write_table (zstd) into OUT/{table}.parquet.
      Prints `pyarrow: ROWS rows in SECS s`, its peak RSS and CPU time.

  python3 benches/parquet_compaction.py compare REFRACT_OUT PYARROW_OUT
      Whether refract's current state ({table}/current/*.parquet) equals pyarrow's, row for
      row (sorted by key, every column); exits 1 if a table differs.
"""
import glob
import json
import os
import resource
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

TABLES = {"orders": (["order_id"], None), "customers": (["customer_id"], None),
          "order_items": (["order_id", "line_no"], ["order_id"])}


def changes(log, k):
    with open(log) as f:
        first = [json.loads(next(f)) for _ in range(k)]
    with open(log, "a") as out:
        for i, e in enumerate(first):
            after = e["after"]
            e["source"]["lsn"] += 10**9
            if i % 10 == 9:
                e.update(op="d", before={"id": after["id"]}, after=None)
            else:
                doc = after["doc"]
                doc["status"] = "refunded"
                if len(doc["items"]) > 1:
                    doc["items"].pop()
                after["updated_at"] = "2026-10-01T00:00:00.000000Z"
                e.update(op="u", before=None)
            out.write(json.dumps(e, separators=(",", ":")) + "\n")


def merge_table(current, new_files, key, group):
    by = group or key
    ch = pa.concat_tables([pq.read_table(p) for p in new_files], promote_options="default")
    newest = ch.group_by(by).aggregate([("_position", "max")])
    ch = ch.join(newest, keys=by)
    ch = ch.filter(pc.equal(ch["_position"], ch["_position_max"]))
    upserts = ch.filter(pc.equal(ch["_op"], "u"))
    kept = current.join(newest.select(by), keys=by, join_type="left anti")
    names = current.column_names
    return pa.concat_tables([t.select(names).cast(current.schema) for t in (kept, upserts)])


def merge(before, out, new_list):
    new_files = [line.strip() for line in open(new_list) if line.strip()]
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    rows = 0
    for table, (key, group) in TABLES.items():
        current = pq.read_table(os.path.join(before, f"{table}.parquet"))
        mine = [p for p in new_files if f"/{table}/changes/" in p]
        merged = merge_table(current, mine, key, group) if mine else current
        pq.write_table(merged, os.path.join(out, f"{table}.parquet"), compression="zstd")
        rows += merged.num_rows
    secs = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"pyarrow: {rows} rows in {secs:.2f} s")
    print(f"pyarrow peak RSS: {usage.ru_maxrss / 1024:.1f} MiB")
    print(f"pyarrow CPU: {usage.ru_utime + usage.ru_stime:.2f} s")


def compare(refract_out, pyarrow_out):
    failed = False
    for table, (key, _) in TABLES.items():
        files = glob.glob(os.path.join(refract_out, table, "current", "*.parquet"))
        r = pa.concat_tables([pq.read_table(f) for f in files]).replace_schema_metadata(None)
        p = pq.read_table(os.path.join(pyarrow_out, f"{table}.parquet")).replace_schema_metadata(None)
        order = [(k, "ascending") for k in key]
        same = r.num_rows == p.num_rows and r.sort_by(order).equals(p.select(r.column_names).sort_by(order))
        print(f"current {table}: refract {r.num_rows} rows, pyarrow {p.num_rows}, "
              f"{'equal row for row' if same else 'DIFFERENT'}")
        failed |= not same
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "changes":
        changes(args[0], int(args[1]))
    elif command == "merge":
        merge(*args)
    elif command == "compare":
        compare(*args)
    else:
        sys.exit(__doc__)
