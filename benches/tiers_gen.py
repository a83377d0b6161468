"""Heartbeats for benches/tiers_ingest.sh: N heartbeats of DEVICES devices (rows of the showcase
`device_heartbeats` table, ../shared/showcase/device_heartbeats.sql), written twice:

- LOG: Debezium JSON creates (bare envelope, op `c`), one per line, in event-time order as a
  stream replaying history would carry them;
- CSV: the same rows as the warm table holds them (device_id, ts, region, device_hash, battery,
  signal, lat, lon) for PostgreSQL's COPY.

Ages at CLOCK (RFC 3339): HOT_SHARE within the hot window (2 h), COLD_SHARE past the warm window
(30 to 35 days: cold on arrival), the rest in between. Deterministic for given arguments.
Prints how many rows fall in each tier, and how many devices have hot ones.

Usage: tiers_gen.py N DEVICES CLOCK LOG CSV [HOT_SHARE] [COLD_SHARE]
"""

import datetime
import hashlib
import json
import random
import sys

HOUR_US = 3_600_000_000
DAY_US = 24 * HOUR_US
REGIONS = ["EU", "US", "CN_SHANGHAI", "AP_SOUTH"]


def main():
    n, devices, clock_text, log, csv = sys.argv[1:6]
    n, devices = int(n), int(devices)
    hot_share = float(sys.argv[6]) if len(sys.argv) > 6 else 0.3
    cold_share = float(sys.argv[7]) if len(sys.argv) > 7 else 0.01
    clock = datetime.datetime.fromisoformat(clock_text.replace("Z", "+00:00"))
    clock_us = int(clock.timestamp()) * 1_000_000
    rng = random.Random(23)
    ids = [f"dev-{i:05}" for i in range(devices)]
    hashes = [hashlib.md5(d.encode()).hexdigest()[:4] for d in ids]
    seen = set()
    rows = []
    while len(rows) < n:
        r = rng.random()
        if r < hot_share:
            age = rng.randrange(1, 2 * HOUR_US)
        elif r < hot_share + cold_share:
            age = rng.randrange(30 * DAY_US, 35 * DAY_US)
        else:
            age = rng.randrange(2 * HOUR_US, 30 * DAY_US)
        d = rng.randrange(devices)
        ts = clock_us - age
        if (d, ts) in seen:
            continue
        seen.add((d, ts))
        rows.append((ts, d))
    rows.sort()
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    tiers = {"hot": 0, "warm": 0, "cold": 0}
    hot_devices = set()
    with open(log, "w") as lf, open(csv, "w") as cf:
        for ts, d in rows:
            age = clock_us - ts
            tiers["hot" if age < 2 * HOUR_US else "warm" if age < 30 * DAY_US else "cold"] += 1
            if age < 2 * HOUR_US:
                hot_devices.add(d)
            when = (epoch + datetime.timedelta(microseconds=ts)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            battery = round(rng.uniform(0, 100), 2)
            signal = rng.randrange(-120, -30)
            lat = round(rng.uniform(-60, 60), 6)
            lon = round(rng.uniform(-180, 180), 6)
            region = REGIONS[d % len(REGIONS)]
            after = {"device_id": ids[d], "ts": when, "region": region, "battery": battery,
                     "signal": signal, "lat": lat, "lon": lon}
            lf.write(json.dumps({"before": None, "after": after, "op": "c",
                                 "source": {"connector": "postgresql", "schema": "public",
                                            "table": "device_heartbeats",
                                            "ts_ms": clock_us // 1000}},
                                separators=(",", ":")))
            lf.write("\n")
            cf.write(f"{ids[d]},{when},{region},{hashes[d]},{battery},{signal},{lat},{lon}\n")
    tiers["hot_devices"] = len(hot_devices)
    print(json.dumps(tiers))


main()
