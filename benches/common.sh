# Shared by the benchmark scripts (sourced, not run): the showcase `products` table
# (../shared/showcase/products.sql), filled; pgbench sending the PostgreSQL sink's upserts; the
# shipped flatten-to-Parquet pipeline over a file of customer_orders envelopes and the setup of
# its benchmarks; timing a command.

# create_products ROWS: creates and fills `products` through the caller's `sql` function.
create_products() {
    sql "CREATE TABLE products (
             id          bigint PRIMARY KEY,
             tenant_id   text   NOT NULL,
             sku         text   NOT NULL UNIQUE,
             name        text   NOT NULL,
             price_cents bigint NOT NULL,
             updated_at  timestamptz NOT NULL DEFAULT now()
         );
         ALTER TABLE products REPLICA IDENTITY FULL;
         INSERT INTO products (id, tenant_id, sku, name, price_cents)
             SELECT g, 't' || (g % 100), 'SKU-' || lpad(g::text, 8, '0'), 'product ' || g, 1000 + g % 9000
             FROM generate_series(1, $1) g;"
    sql "VACUUM ANALYZE products"
}

# products_cache_sections: the source, projection and sink sections of the products -> Redis
# pipelines, from the caller's $bench_url, $redis_url, $db and $depth.
products_cache_sections() {
    cat <<TOML
[source]
kind = "postgres"
url = "$bench_url"
tables = ["public.products"]
snapshot = "never"
[projections.cache]
kind = "cache_invalidation"
sinks = ["redis"]
[projections.cache.tables."public.products"]
keys = ["product:{id}:v3", "product:sku:{sku}:v3"]
[sinks.redis]
kind = "redis"
url = "${redis_url%/}/$db"
command = "unlink"
pipeline_depth = $depth
TOML
}

# The PostgreSQL sink's document upserts as pgbench sends them (benches/pg_upsert.sh,
# benches/documents.sh): one multi-row `INSERT … ON CONFLICT (id) DO UPDATE … WHERE
# t.source_position <= excluded.source_position` of 100 documents per transaction, on one
# connection, into a table of the sink's shape.

# pgbench_bench_setup: what the benchmarks next to pgbench need (GNU time, pgbench, the release
# binaries), and sets $target, $refract and a `sql` function on the caller's $pg_url.
pgbench_bench_setup() {
    [ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
    command -v pgbench >/dev/null || { apt-get update -qq && apt-get install -y -qq postgresql-contrib; }
    cargo build --release --locked -q -p refract -p refract-benches
    target=${CARGO_TARGET_DIR:-target}
    refract=$target/release/refract
    sql() { psql "$pg_url" -X -q -v ON_ERROR_STOP=1 -Atc "$1"; }
}

# pgbench_docs_table TABLE: creates TABLE in the sink's shape through the caller's `sql` function.
pgbench_docs_table() {
    sql "CREATE TABLE $1 (id text PRIMARY KEY, doc jsonb NOT NULL,
         source_position text COLLATE \"C\" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())"
}

# pgbench_upsert_tps TABLE DOCS IDS KEY_PREFIX FIRST DOC: sends DOCS / 100 such statements into
# TABLE, each upserting the 100 consecutive keys KEY_PREFIX || (n .. n + 99) of a block drawn at
# random over FIRST .. FIRST + IDS - 1, every document DOC (JSON text, the size of the pipeline's);
# prints pgbench's tps (statements/s). Uses the caller's $pg_url and $work.
pgbench_upsert_tps() {
    local table=$1 docs=$2 ids=$3 prefix=$4 first=$5 doc=$6
    python3 - "$table" "$ids" "$prefix" "$first" "$doc" > "$work/pgbench.sql" <<'PY'
import sys
table, ids, prefix, first, doc = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
print(f"\\set base random(0, {ids // 100 - 1})")
rows = [f"('{prefix}' || (:base * 100 + {first + k})::text, '{doc}', '00000000000000000001.00000000000000000000')"
        for k in range(100)]
print(f"INSERT INTO {table} AS t (id, doc, source_position) VALUES " + ", ".join(rows)
      + " ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, source_position = excluded.source_position,"
      + " updated_at = now() WHERE t.source_position <= excluded.source_position;")
PY
    local out tps
    out=$(pgbench -n -c 1 -j 1 -t "$(( docs / 100 ))" -f "$work/pgbench.sql" "$pg_url" 2>&1)
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out" | tail -1)
    [ -n "$tps" ] || { echo "pgbench failed: $out" >&2; return 1; }
    echo "$tps"
}

# orders_flatten_pipeline WORK LOG: prints a pipeline reading the envelope file LOG (follow =
# false) through the shipped pipeline's projection and sink, as users run them: everything from
# the line `# --- flatten ---` to the end of pipelines/orders-analytics.toml, the sink's `url`
# pointed at WORK/out, the state in WORK/state.
orders_flatten_pipeline() {
    local work=$1 log=$2 showcase=pipelines/orders-analytics.toml sections
    [ -f "$showcase" ] || { echo "$showcase not found (it holds the flatten projection and the Parquet sink)" >&2; return 1; }
    sections=$(sed -n '/^# --- flatten ---/,$p' "$showcase" | sed "s|^\([[:space:]]*\)url[[:space:]]*=.*|\1url = \"file://$work/out\"|")
    [ -n "$sections" ] || { echo "$showcase has no '# --- flatten ---' line" >&2; return 1; }
    cat <<TOML
[pipeline]
name = "bench-parquet"
state_dir = "$work/state"
[pipeline.batch]
max_events = 20000
[source]
kind = "file"
path = "$log"
follow = false
TOML
    # The header, unless the sections copied below carry it themselves.
    grep -q '^\[projections\.orders_flat\]' <<<"$sections" || printf '[projections.orders_flat]\nkind = "flatten"\n'
    printf '%s\n' "$sections"
}

# timed OUT COMMAND...: runs COMMAND (its stdout discarded) and writes its wall seconds, peak RSS
# (KiB), user and system CPU seconds to OUT, as `/usr/bin/time -f '%e %M %U %S'` prints them
# (with Python's resource module where the Debian package `time` is not installed).
timed() {
    local out=$1
    shift
    if [ -x /usr/bin/time ]; then
        /usr/bin/time -f '%e %M %U %S' -o "$out" "$@" >/dev/null
    else
        python3 -c '
import resource, subprocess, sys, time
t = time.perf_counter()
subprocess.run(sys.argv[2:], check=True, stdout=subprocess.DEVNULL)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"{time.perf_counter() - t:.2f} {r.ru_maxrss} {r.ru_utime:.2f} {r.ru_stime:.2f}", file=open(sys.argv[1], "w"))
' "$out" "$@"
    fi
}

# parquet_bench_setup: what the Parquet benchmarks share: $work (BENCH_DIR, kept; or a temporary
# directory removed at exit), pyarrow present, the release build, $target and $refract.
parquet_bench_setup() {
    work=${BENCH_DIR:-$(mktemp -d)}
    mkdir -p "$work"
    trap '[ -n "${BENCH_DIR:-}" ] || rm -rf "$work"' EXIT
    python3 -c 'import pyarrow' 2>/dev/null || {
        echo "pyarrow is missing: python3 -m pip install pyarrow" >&2
        exit 1
    }
    cargo build --release --locked -q -p refract -p refract-benches
    target=${CARGO_TARGET_DIR:-target}
    refract=$target/release/refract
}
