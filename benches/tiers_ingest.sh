#!/usr/bin/env bash
# Benchmark (issue 23): heartbeats ingested into the hot, warm and cold tiers, and the latency of
# the online-devices query, each next to a baseline measured in the same run.
#
# 1. tiers_gen.py writes EVENTS heartbeats (default 1,000,000) of DEVICES devices (default
#    10,000) as a file of Debezium JSON creates in event-time order, and the same rows as CSV.
#    Ages at the fixed clock: 30% within the hot window, 1% past the warm window (cold on
#    arrival), the rest warm (HOT_SHARE, COLD_SHARE). refract runs the projection and sink
#    sections of pipelines/device-tiers.toml from a file source (`refract run --until-caught-up`,
#    from scratch each time: empty warm table, Redis database and cold directory), next to
#    PostgreSQL's `COPY` of the same rows from the CSV into a fresh copy of the warm table with
#    every hourly partition made beforehand (untimed). refract's warm table likewise keeps the
#    partitions it made in its first run: later runs start from it emptied (TRUNCATE), so both
#    sides load rows into partitions that exist, as a running daemon does (it makes each hour's
#    partition ahead of the data). Both times include process start. Prints
#    `refract heartbeats/s / COPY rows/s = ratio` (target 0.5x), best of ROUNDS (default 2) with
#    the order swapped every other round, and refract's peak RSS; and the first load, which
#    makes every partition (723 for 35 days), next to COPY plus PostgreSQL's own `CREATE TABLE
#    … PARTITION OF` of as many partitions. Each refract run is checked:
#    every event read, no dead letter, the warm table's and the cold files' row counts (DuckDB)
#    and the devices in the hot region sets equal what the generator made.
# 2. benches/tiers_online.rs: `TierReader::online` (what `refract tiers … online` calls) run
#    in-process ITERATIONS times (default 20,000) next to a raw ZCOUNT on its own connection,
#    interleaved: p50/p99/mean and ratios. For context, also CLI_RUNS (default 200) whole
#    `refract tiers … online` processes next to as many `redis-cli ZCOUNT` processes.
#
# Usage: benches/tiers_ingest.sh [EVENTS]   (DEVICES (default 10000); PG_URL as in the environment
#        contract, its server gets the benchmark's own database; REDIS_URL (default
#        redis://127.0.0.1:6379); REDIS_DB (default 11, flushed); ROUNDS (default 2); ITERATIONS
#        (default 20000); CLI_RUNS (default 200); BENCH_DIR (keeps the generated files))
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
events=${1:-1000000}
devices=${DEVICES:-10000}
rounds=${ROUNDS:-2}
iterations=${ITERATIONS:-20000}
cli_runs=${CLI_RUNS:-200}
clock=2026-02-05T12:00:00Z
url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
redis_url=${REDIS_URL:-redis://127.0.0.1:6379}
rdb=${REDIS_DB:-11}
bench_db=refract_bench_tiers
bench_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$url" "$bench_db")
admin_url=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/postgres")))' "$url")
read -r rhost rport < <(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(p.hostname or "127.0.0.1", p.port or 6379)' "$redis_url")
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
python3 -c 'import duckdb' 2>/dev/null || python3 -m pip install -q 'duckdb>=1'
cargo build --release --locked -q -p refract -p refract-benches
target=${CARGO_TARGET_DIR:-target}
refract=$target/release/refract
sqla() { psql "$admin_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
sql() { psql "$bench_url" -X -v ON_ERROR_STOP=1 -Atqc "$1"; }
rcli() { redis-cli -h "$rhost" -p "$rport" -n "$rdb" "$@"; }
cleanup() {
    sqla "DROP DATABASE IF EXISTS $bench_db" >/dev/null 2>&1 || true
    rcli FLUSHDB >/dev/null 2>&1 || true
    rm -rf "$work/state" "$work/out" "$work"/trash.* "$work"/*.secs "$work"/*.rss "$work"/*.times "$work/ddl" "$work/summary.json"
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
sqla "DROP DATABASE IF EXISTS $bench_db" >/dev/null
sqla "CREATE DATABASE $bench_db"

log="$work/heartbeats-$events-$devices.jsonl"
csv="$work/heartbeats-$events-$devices.csv"
if [ ! -s "$log" ] || [ ! -s "$work/tiers.json" ]; then
    python3 benches/tiers_gen.py "$events" "$devices" "$clock" "$log" "$csv" \
        "${HOT_SHARE:-0.3}" "${COLD_SHARE:-0.01}" > "$work/tiers.json"
fi

# The shipped projection and sink, as users run them, behind a file source on a fixed clock.
{
    cat <<TOML
[pipeline]
name = "bench_tiers"
state_dir = "$work/state"
clock = "$clock"
[source]
kind = "file"
path = "$log"
follow = false
TOML
    sed -n '/^\[projections\.heartbeats\]/,$p' pipelines/device-tiers.toml
} > "$work/tiers.toml"
export TARGET_PG_URL=$bench_url WARM_TABLE=heartbeats_warm REDIS_URL="${redis_url%/}/$rdb" \
    HOT_PREFIX=bench_hb OBJECT_STORE_URL="file://$work/out"

# run_refract [first]: `first` starts from no warm table at all (its time goes to first.secs).
run_refract() {
    local times=refract.secs
    if [ "${1:-}" = first ]; then
        sql "DROP TABLE IF EXISTS heartbeats_warm, heartbeats_warm_aging CASCADE" >/dev/null
        times=first.secs
    else
        sql "TRUNCATE heartbeats_warm; DROP TABLE IF EXISTS heartbeats_warm_aging" >/dev/null
    fi
    rcli FLUSHDB >/dev/null
    # The last run's files are moved aside, not removed: ext4 reusing the inodes just freed
    # made the cold tier's time swing 1.5-7 s between identical runs. They go at the end.
    rm -rf "$work/state"
    [ -d "$work/out" ] && mv "$work/out" "$(mktemp -d -p "$work" trash.XXXXXX)"
    sql "CHECKPOINT" >/dev/null
    sync
    RUST_LOG=warn timed "$work/run" "$refract" run "$work/tiers.toml" --until-caught-up \
        --summary-json "$work/summary.json"
    read -r secs rss _ < "$work/run"
    echo "$secs" >> "$work/$times"
    echo "$rss" >> "$work/refract.rss"
    local warm cold hot
    warm=$(sql "SELECT count(*) FROM heartbeats_warm")
    cold=$(python3 -c 'import duckdb, sys; print(duckdb.sql(f"SELECT count(*) FROM read_parquet(\"{sys.argv[1]}/heartbeats/*/*/*.parquet\")").fetchall()[0][0])' "$work/out")
    hot=0
    for key in $(rcli --scan --pattern 'bench_hb:*:online'); do hot=$(( hot + $(rcli ZCARD "$key") )); done
    python3 - "$work/summary.json" "$work/tiers.json" "$events" "$warm" "$cold" "$hot" <<'PY'
import json, sys
s, t = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
events, warm, cold, hot = (int(x) for x in sys.argv[3:7])
problems = []
if s["changes"] != {"c": events} or s["dead_letters"] != 0:
    problems.append(f"read {s['changes']} with {s['dead_letters']} dead letters, expected {events} creates")
if warm != t["hot"] + t["warm"]:
    problems.append(f"warm table holds {warm} rows, expected {t['hot'] + t['warm']}")
if cold != t["cold"]:
    problems.append(f"cold files hold {cold} rows, expected {t['cold']}")
if hot != t["hot_devices"]:
    problems.append(f"region sets hold {hot} devices, expected {t['hot_devices']}")
if problems:
    sys.exit("refract's tiers are wrong: " + "; ".join(problems))
PY
}

run_copy() {
    sql "DROP TABLE IF EXISTS copy_warm CASCADE" >/dev/null
    sql "CREATE TABLE copy_warm (device_id text NOT NULL, ts timestamptz NOT NULL, region text NOT NULL,
             device_hash text NOT NULL, battery real, signal integer, lat double precision,
             lon double precision, PRIMARY KEY (device_id, ts)) PARTITION BY RANGE (ts)"
    timed "$work/ddl" psql "$bench_url" -X -q -v ON_ERROR_STOP=1 -c "DO \$\$ DECLARE h timestamptz; BEGIN
           FOR h IN SELECT generate_series(timestamptz '$clock' - interval '35 days 1 hour',
                                           timestamptz '$clock' + interval '2 hours', interval '1 hour') LOOP
             EXECUTE format('CREATE TABLE %I PARTITION OF copy_warm FOR VALUES FROM (%L) TO (%L)',
                            'copy_warm_p' || to_char(h AT TIME ZONE 'UTC', 'YYYYMMDDHH24'), h, h + interval '1 hour');
           END LOOP; END \$\$"
    read -r secs _ < "$work/ddl"
    echo "$secs" >> "$work/ddl.secs"
    sql "CHECKPOINT" >/dev/null
    sync
    timed "$work/copy" psql "$bench_url" -X -q -v ON_ERROR_STOP=1 -c "\\copy copy_warm FROM '$csv' (FORMAT csv)"
    read -r secs _ < "$work/copy"
    echo "$secs" >> "$work/copy.secs"
    local n; n=$(sql "SELECT count(*) FROM copy_warm")
    [ "$n" = "$events" ] || { echo "COPY loaded $n rows, expected $events" >&2; exit 1; }
}

echo "file: $events heartbeats of $devices devices, $(( $(stat -c %s "$log") / 1048576 )) MiB; tiers $(cat "$work/tiers.json"); clock $clock; $(nproc) cores"
# The first load, with every partition to make; then the rounds.
run_refract first
echo "first load (makes the partitions): refract $(tail -1 "$work/first.secs")s"
for round in $(seq 1 "$rounds"); do
    if [ $(( round % 2 )) = 1 ]; then run_refract; run_copy; else run_copy; run_refract; fi
    echo "round $round: refract $(tail -1 "$work/refract.secs")s, COPY $(tail -1 "$work/copy.secs")s"
done
# The last refract run's hot tier stays for the latency part.
[ $(( rounds % 2 )) = 1 ] && run_refract

python3 - "$work" "$events" <<'PY'
import os, sys
work, events = sys.argv[1], int(sys.argv[2])
read = lambda f: [float(x) for x in open(os.path.join(work, f)).read().split()]
r, c = min(read("refract.secs")), min(read("copy.secs"))
print(f"\ningest (best of {len(read('copy.secs'))} rounds):")
print(f"  heartbeats/s: refract into hot+warm+cold {events / r:,.0f} ({r:.2f}s) / "
      f"PostgreSQL COPY into the partitioned warm table {events / c:,.0f} ({c:.2f}s) = {c / r:.2f}x")
print(f"  refract peak RSS: {max(read('refract.rss')) / 1024:.1f} MiB")
f, d = read("first.secs")[0], min(read("ddl.secs"))
print(f"  first load, partitions made by the run: refract {events / f:,.0f} ({f:.2f}s) / COPY after "
      f"PostgreSQL's own DDL of the partitions {events / (c + d):,.0f} ({c:.2f}s + {d:.2f}s) = {(c + d) / f:.2f}x")
PY

echo
"$target/release/tiers-online" "$work/tiers.toml" "$iterations"

# Whole processes, for context: what a shell user waits for.
region=$(rcli --scan --pattern 'bench_hb:*:online' | head -1 | sed 's/^bench_hb:\(.*\):online$/\1/')
python3 - "$refract" "$work/tiers.toml" "$region" "$cli_runs" "$rhost" "$rport" "$rdb" "$clock" <<'PY'
import datetime, statistics, subprocess, sys, time
refract, pipeline, region, runs, host, port, db, clock = sys.argv[1:9]
runs = int(runs)
since = int(datetime.datetime.fromisoformat(clock.replace("Z", "+00:00")).timestamp()) * 1_000_000 - 5 * 60_000_000
def timed(cmd):
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        out.append((time.perf_counter() - t) * 1000)
    out.sort()
    return out[len(out) // 2], out[min(len(out) - 1, round((len(out) - 1) * 0.99))]
a = timed([refract, "tiers", pipeline, "online", "--region", region, "--minutes", "5"])
b = timed(["redis-cli", "-h", host, "-p", port, "-n", db, "ZCOUNT", f"bench_hb:{region}:online", f"({since}", "+inf"])
print(f"\nwhole processes, {runs} runs each (region {region}, 5 min):")
print(f"  p50: refract tiers online {a[0]:.1f} ms / redis-cli ZCOUNT {b[0]:.1f} ms = {a[0] / b[0]:.2f}x")
print(f"  p99: refract tiers online {a[1]:.1f} ms / redis-cli ZCOUNT {b[1]:.1f} ms = {a[1] / b[1]:.2f}x")
PY
