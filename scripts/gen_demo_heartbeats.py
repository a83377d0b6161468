#!/usr/bin/env python3
"""Generates pipelines/demo/heartbeats.jsonl: 40 days of device heartbeats, as Debezium envelopes.

12 devices in 3 regions beat every 4 hours (every 20 minutes in the last 6 hours; each at its own
minute) from 2026-01-20 to
2026-03-01T00:00:00Z, the instant pipelines/demo-tiers.toml's clock starts at: the first ten days
are older than the warm window on arrival (cold), the rest warm, the last two hours hot too. Some
heartbeats arrive twice and some late, out of order, as devices that were offline send their
backlog.

Usage: python3 scripts/gen_demo_heartbeats.py [OUTPUT]   (default pipelines/demo/heartbeats.jsonl)
"""
import datetime
import json
import random
import sys

rng = random.Random(20261205)
out_path = sys.argv[1] if len(sys.argv) > 1 else "pipelines/demo/heartbeats.jsonl"
START = datetime.datetime(2026, 1, 20, tzinfo=datetime.timezone.utc)
END = datetime.datetime(2026, 3, 1, tzinfo=datetime.timezone.utc)
REGIONS = ["EU", "CN_SHANGHAI", "US_EAST"]
lsn = 0x2000000


def envelope(row):
    global lsn
    lsn += rng.randint(100, 300)
    return json.dumps({
        "before": None, "after": row, "op": "c",
        "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "demo",
                   "db": "refract", "schema": "public", "table": "device_heartbeats",
                   "lsn": lsn, "snapshot": "false"},
    }, separators=(",", ":"))


rows = []
t = START
while t < END:
    for d in range(12):
        ts = t + datetime.timedelta(minutes=(7 if t < END - datetime.timedelta(hours=6) else 1) * d)
        if ts >= END:
            continue
        rows.append({
            "device_id": f"dev-{d:03d}",
            "ts": ts.isoformat().replace("+00:00", "Z"),
            "region": REGIONS[d % 3],
            "battery": round(1.0 - (ts - START).total_seconds() / 3.5e6 * (0.5 + d / 24), 3),
            "signal": -50 - rng.randint(0, 40),
            "lat": round(48.0 + d * 0.5 + rng.random() / 100, 5),
            "lon": round(11.0 + d * 0.3 + rng.random() / 100, 5),
        })
    # Every 4 hours, and every 20 minutes in the last 6 hours (the hot tier's window and more).
    t += datetime.timedelta(hours=4 if t < END - datetime.timedelta(hours=6) else 1) / (1 if t < END - datetime.timedelta(hours=6) else 3)

# Device 11 was offline for its last three days: its backlog arrives at the end, newest first.
backlog = [r for r in rows if r["device_id"] == "dev-011" and r["ts"] >= "2026-02-26"]
rows = [r for r in rows if r not in backlog] + list(reversed(backlog))
# Every 50th heartbeat is sent twice.
rows += rows[::50]

with open(out_path, "w") as f:
    for row in rows:
        f.write(envelope(row) + "\n")
print(f"{out_path}: {len(rows)} heartbeats")
