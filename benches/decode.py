"""Times refract (file source -> replica -> null sink) against pyarrow.json.read_json on the same
file, best of three rounds each, and prints `figure / baseline = ratio`. Called by decode.sh."""
import json
import os
import shutil
import subprocess
import sys
import time

import pyarrow.json as pj

refract, work, log, events = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
pipeline = os.path.join(work, "decode.toml")
summary = os.path.join(work, "summary.json")


rss_kib = []
refract_cpu = []
pyarrow_cpu = []


def run_refract():
    shutil.rmtree(os.path.join(work, "state"), ignore_errors=True)
    rss_file = os.path.join(work, "rss")
    t = time.perf_counter()
    # /usr/bin/time reports refract's own peak RSS (a child of this process would report
    # the pages it inherited from this Python, pyarrow table included).
    subprocess.run(["/usr/bin/time", "-f", "%M %U %S", "-o", rss_file, refract, "run", pipeline, "--summary-json", summary],
                   check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
    elapsed = time.perf_counter() - t
    rss, user, sys_ = open(rss_file).read().split()[-3:]
    rss_kib.append(int(rss))
    refract_cpu.append(float(user) + float(sys_))
    records = json.load(open(summary))["records"]
    assert records == events, f"refract read {records} of {events} records"
    return elapsed


def run_pyarrow():
    t, c = time.perf_counter(), time.process_time()
    table = pj.read_json(log)
    elapsed = time.perf_counter() - t
    pyarrow_cpu.append(time.process_time() - c)
    assert table.num_rows == events, f"pyarrow read {table.num_rows} of {events} rows"
    return elapsed


refract_times, pyarrow_times = [], []
for round_no in range(1, 4):
    refract_times.append(run_refract())
    pyarrow_times.append(run_pyarrow())
    print(f"round {round_no}: refract {refract_times[-1]:.3f}s, pyarrow {pyarrow_times[-1]:.3f}s", flush=True)

rss_mib = max(rss_kib) / 1024
size_mib = os.path.getsize(log) / 2**20
r, p = events / min(refract_times), events / min(pyarrow_times)
print(f"\nfile: {events} events, {size_mib:.1f} MiB; best of 3 rounds on {os.cpu_count()} cores")
print(f"decode events/s: refract {r:,.0f} / pyarrow.json.read_json {p:,.0f} = {r / p:.2f}x")
print(f"refract peak RSS: {rss_mib:.1f} MiB")
# CPU time is steadier than wall time on a shared machine: events per CPU-second of all threads.
rc, pc = events / min(refract_cpu), events / min(pyarrow_cpu)
print(f"events per CPU-second: refract {rc:,.0f} / pyarrow {pc:,.0f} = {rc / pc:.2f}x")
