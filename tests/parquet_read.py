"""Reads a Parquet sink's output with pyarrow (an independent reader) for the end-to-end tests.

Usage: python3 tests/parquet_read.py OUT_DIR
       python3 tests/parquet_read.py --history OUT_DIR TABLE KEY_COLUMN KEY...
Prints JSON: per table, the current state's rows and column types, each change-log file's
columns, row count and schema version, and how many change rows (position and key) appear more
than once; plus every visible .parquet file whose footer pyarrow cannot read.
With --history: every change-log row and current row of the given keys, as text lines (what a
failing test reports).
"""
import datetime
import glob
import json
import os
import sys

import pyarrow.parquet as pq


def plain(value):
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    return value


def main(out):
    result = {"tables": {}, "bad_files": [], "files": 0}
    for path in sorted(glob.glob(os.path.join(out, "**", "*.parquet"), recursive=True)):
        result["files"] += 1
        try:
            pq.ParquetFile(path).metadata
        except Exception as e:  # noqa: BLE001 - any unreadable footer is what the test looks for
            result["bad_files"].append(f"{path}: {e}")
    for table_dir in sorted(glob.glob(os.path.join(out, "*"))):
        if not os.path.isdir(table_dir):
            continue
        table = os.path.basename(table_dir)
        entry = {"current": None, "current_types": {}, "changes": []}
        current = os.path.join(table_dir, "current", "part-0.parquet")
        if os.path.exists(current):
            t = pq.read_table(current)
            entry["current_types"] = {f.name: str(f.type) for f in t.schema}
            entry["current"] = [{k: plain(v) for k, v in row.items()} for row in t.to_pylist()]
        seen, duplicates = set(), 0
        for path in sorted(glob.glob(os.path.join(table_dir, "changes", "*", "*.parquet"))):
            f = pq.ParquetFile(path)
            meta = f.schema_arrow.metadata or {}
            # A change is its position and key: one that appears twice was written twice.
            key = ["_position"] + meta.get(b"refract.key", b"").decode().split(",")
            for row in f.read(columns=key).to_pylist():
                identity = tuple(plain(row[k]) for k in key)
                duplicates += identity in seen
                seen.add(identity)
            entry["changes"].append({
                "path": os.path.relpath(path, out),
                "columns": {fl.name: str(fl.type) for fl in f.schema_arrow},
                "rows": f.metadata.num_rows,
                "schema_version": meta.get(b"refract.schema_version", b"").decode(),
            })
        entry["duplicate_changes"] = duplicates
        result["tables"][table] = entry
    json.dump(result, sys.stdout)


def history(out, table, key_column, keys):
    wanted = set(keys)
    lines = []
    for path in sorted(glob.glob(os.path.join(out, table, "changes", "*", "*.parquet"))):
        rows = pq.read_table(path, columns=["_position", "_op", key_column]).to_pylist()
        lines += [
            f"  {r[key_column]} {r['_position']} {r['_op']} in {os.path.relpath(path, out)}"
            for r in rows
            if r[key_column] in wanted
        ]
    lines.sort(key=lambda line: line.split()[:2])
    current = os.path.join(out, table, "current", "part-0.parquet")
    if os.path.exists(current):
        t = pq.read_table(current)
        lines += [
            f"  {r[key_column]} current: {dict((k, plain(v)) for k, v in r.items())}"
            for r in t.to_pylist()
            if r[key_column] in wanted
        ]
        meta = t.schema.metadata or {}
        lines.append(f"  current/ merged through {meta.get(b'refract.merged_through', b'?').decode()}")
    print("\n".join(lines))


if sys.argv[1] == "--history":
    history(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
else:
    main(sys.argv[1])
