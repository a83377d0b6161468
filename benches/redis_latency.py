"""Commit-to-delete latency of refract's Redis sink; called by redis_latency.sh (which starts the
refract daemon). Pre-fills `product:{id}:v3` for every id, watches Redis MONITOR in a process of
its own, commits single-row updates of `products` on a fixed schedule of RATE transactions/s from
WRITERS processes (each on its own connection, each update on a different id), and compares each
commit's return time (time.time() right after COMMIT returns) with the server time of the first
UNLINK/DEL of that product's key in MONITOR (same machine, same clock).

Usage: redis_latency.py PG_URL REDIS_HOST REDIS_PORT REDIS_DB SECONDS RATE WRITERS"""
import multiprocessing as mp
import re
import socket
import statistics
import sys
import time

import psycopg
import redis

pg_url, rhost, rport, rdb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seconds, rate, writers = float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
total = int(seconds * rate)
key = "product:{}:v3".format
# `+1733150000.123456 [9 127.0.0.1:40000] "UNLINK" "product:42:v3" "product:sku:…"` (refract
# puts up to `keys_per_command` keys in one UNLINK: every key counts)
LINE = re.compile(rb'^\+(\d+\.\d+) \[(\d+) [^\]]*\] "(?i:unlink|del)" (.*)$')
ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')


def monitor(db, ready, stop, out):
    """Records the server time of the first UNLINK/DEL of each key in database DB until STOP is
    set; then sends {key: time} through OUT."""
    seen = {}
    s = socket.create_connection((rhost, rport))
    s.sendall(b"MONITOR\r\n")
    s.settimeout(0.2)
    buf = b""
    while not buf.startswith(b"+OK\r\n"):
        buf += s.recv(65536)
    buf = buf[5:]
    ready.set()
    dbs = str(db).encode()
    while not stop.is_set():
        try:
            chunk = s.recv(1 << 20)
        except socket.timeout:
            continue
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\r\n")
        for line in lines:
            m = LINE.match(line)
            if m and m.group(2) == dbs:
                at = float(m.group(1))
                for k in ARG.findall(m.group(3)):
                    seen.setdefault(k.decode(), at)
    out.send(seen)


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


r = redis.Redis(host=rhost, port=rport, db=rdb)
r.flushdb()
# Every key the run will invalidate exists beforehand (ids 1..total), plus the probe key.
pipe = r.pipeline(transaction=False)
for i in range(1, total + 1):
    pipe.set(key(i), "cached")
    if i % 10000 == 0:
        pipe.execute()
pipe.execute()

ready, stop = mp.Event(), mp.Event()
parent, child = mp.Pipe()
watcher = mp.Process(target=monitor, args=(rdb, ready, stop, child), daemon=True)
watcher.start()
ready.wait(10)

# Measurement floor: a client's own UNLINK sent right after time.time() shows up in MONITOR this
# much later (the same clock read, one round trip to Redis, and the MONITOR timestamp).
probe = {}
for i in range(1000):
    t = time.time()
    r.unlink(f"bench:probe:{i}")
    probe[f"bench:probe:{i}"] = t

# The writers, each a process of its own (threads would wait for one another's GIL between COMMIT
# returning and time.time()): transaction i (id i + 1) is due at t0 + i / rate and belongs to
# writer i % writers; a late writer does not wait.
def writer(k, t0, out):
    commits, late = {}, 0
    with psycopg.connect(pg_url, autocommit=False) as conn:
        cur = conn.cursor()
        for i in range(k, total, writers):
            delay = t0 + i / rate - time.time()
            if delay > 0:
                time.sleep(delay)
            elif delay < -0.01:
                late += 1
            cur.execute("UPDATE products SET price_cents = price_cents + 1, updated_at = now() WHERE id = %s", (i + 1,))
            conn.commit()
            commits[i] = time.time()
    out.send((commits, late))


t0 = time.time() + 1.0
pipes = [mp.Pipe() for _ in range(writers)]
procs = [mp.Process(target=writer, args=(k, t0, pipes[k][1])) for k in range(writers)]
for p in procs:
    p.start()
commits, late = [0.0] * total, 0
for recv_end, _ in pipes:
    part, n_late = recv_end.recv()
    late += n_late
    for i, t in part.items():
        commits[i] = t
for p in procs:
    p.join()
t_end = max(commits)
achieved = total / (t_end - t0)

# Wait for the last deletes (at most 15 s), then stop the watcher.
deadline = time.time() + 15
while time.time() < deadline and r.exists(key(total), key(1 + total // 2), key(1)):
    time.sleep(0.05)
time.sleep(1)
stop.set()
seen = parent.recv()
watcher.join(5)

latencies = [(seen[key(i + 1)] - commits[i]) * 1000 for i in range(total) if key(i + 1) in seen]
missing = total - len(latencies)
still_there = sum(r.exists(*[key(i) for i in range(j, min(j + 1000, total + 1))]) for j in range(1, total + 1, 1000))
floor = [(seen[k] - t) * 1000 for k, t in probe.items() if k in seen]

print(f"transactions: {total} single-row updates committed by {writers} writers in {t_end - t0:.1f}s: "
      f"{achieved:,.0f} tx/s achieved of {rate:,.0f} scheduled ({late} started over 10 ms late)")
if latencies:
    print(f"commit-to-delete latency (ms): p50 {statistics.median(latencies):.1f}, p90 {percentile(latencies, 0.90):.1f}, "
          f"p99 {percentile(latencies, 0.99):.1f}, max {max(latencies):.1f}, min {min(latencies):.1f} "
          f"(MONITOR server time of the first UNLINK - time.time() after COMMIT returned)")
print(f"deletes never seen: {missing}; keys still in Redis after the run: {still_there}; "
      f"deletes seen before COMMIT returned: {sum(x < 0 for x in latencies)}")
if floor:
    print(f"measurement floor: a client's own UNLINK appears in MONITOR p50 {statistics.median(floor):.2f} ms, "
          f"p99 {percentile(floor, 0.99):.2f} ms after its time.time()")
print("note: COMMIT returns slightly after the commit is durable, so these latencies are a little "
      "below the true commit-to-delete time (a lower bound, give or take the floor above)")
sys.exit(1 if missing or still_there else 0)
