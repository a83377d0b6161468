#!/usr/bin/env bash
# Check: one source transaction reaching many documents keeps refract's memory flat. The shipped
# pipeline pipelines/authors-books.toml (document projections, rows kept in state.redb) on
# schema bench_bulk (read models in bench_bulk_rm, PostgreSQL sink):
#
#   snapshot  BOOKS books (default 2,000,000), author a0 on the first RENAME_BOOKS of them
#             (default 1,000,000), a1 on every other one: `refract run --until-caught-up`.
#   rename    `UPDATE authors SET first_name = … WHERE id = 'a0'` (one transaction reaching
#             RENAME_BOOKS book documents and a0's own document), then `refract run
#             --until-caught-up`.
#   update    `UPDATE books SET name = …` of every book (one transaction of BOOKS rows and as
#             many documents), then `refract run --until-caught-up`.
#
# For each run: peak RSS of refract (/usr/bin/time; target < 300 MiB whatever the transaction's
# size), wall time and documents written per second; then `refract verify`, which must exit 0
# (every document equal to what the tables say). Baseline for scale: a `COPY … TO STDOUT` of the
# books table and PostgreSQL rewriting the same book documents itself in one UPDATE of a copy of
# the read model.
#
# Usage: benches/documents_bulk.sh
#        BOOKS (default 2000000; 40000 with CI=true), RENAME_BOOKS (default BOOKS/2),
#        PG_URL (default postgres://postgres@127.0.0.1:5432/refract), BENCH_DIR (keeps the
#        state and logs), REFRACT_BIN (another refract binary to measure, e.g. an older build),
#        BENCH_SCHEMA (default bench_bulk: the schema, pipeline and slot name), VERIFY=last
#        (`refract verify` after the last run only: at full size each verify takes minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
ci_div=1
[ "${CI:-}" = "true" ] && ci_div=50
books=${BOOKS:-$(( 2000000 / ci_div ))}
rename_books=${RENAME_BOOKS:-$(( books / 2 ))}
pg_url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
export PG_URL=$pg_url
unset TARGET_PG_URL
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
[ -n "${REFRACT_BIN:-}" ] || cargo build --release --locked -q -p refract
target=${CARGO_TARGET_DIR:-target}
refract=${REFRACT_BIN:-$target/release/refract}
sql() { psql "$pg_url" -X -q -v ON_ERROR_STOP=1 -Atc "$1"; }
schema=${BENCH_SCHEMA:-bench_bulk}
cleanup() {
    sql "SET client_min_messages = warning;
         SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'refract_$schema';
         DROP PUBLICATION IF EXISTS refract_$schema;
         DROP SCHEMA IF EXISTS $schema CASCADE; DROP SCHEMA IF EXISTS ${schema}_rm CASCADE" >/dev/null || true
    rm -rf "$work/state"
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$work"
echo "$(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg); refract: $refract"

# The showcase tables (tests/documents.rs), filled, then their foreign keys.
sql "SET client_min_messages = warning; CREATE SCHEMA $schema;
     CREATE TABLE $schema.authors (id text PRIMARY KEY, first_name text NOT NULL, last_name text NOT NULL,
         thumbnail_url text, profile_url text, large_url text, updated_at timestamptz NOT NULL DEFAULT now());
     CREATE TABLE $schema.books (id text PRIMARY KEY, name text NOT NULL, published_on date,
         updated_at timestamptz NOT NULL DEFAULT now());
     CREATE TABLE $schema.book_authors (book_id text NOT NULL, author_id text NOT NULL,
         position int NOT NULL DEFAULT 0, PRIMARY KEY (book_id, author_id));
     INSERT INTO $schema.authors (id, first_name, last_name, thumbnail_url)
         VALUES ('a0', 'First0', 'Last0', 'https://img/t/0'), ('a1', 'First1', 'Last1', NULL);
     INSERT INTO $schema.books (id, name) SELECT 'b' || g, 'Book ' || g FROM generate_series(0, $(( books - 1 ))) g;
     INSERT INTO $schema.book_authors SELECT 'b' || g, 'a0', 0 FROM generate_series(0, $(( rename_books - 1 ))) g;
     INSERT INTO $schema.book_authors SELECT 'b' || g, 'a1', 1 FROM generate_series(0, $(( books - 1 )), 2) g;
     ALTER TABLE $schema.book_authors
         ADD FOREIGN KEY (book_id) REFERENCES $schema.books(id) ON DELETE CASCADE,
         ADD FOREIGN KEY (author_id) REFERENCES $schema.authors(id) ON DELETE CASCADE;"
for t in authors books book_authors; do sql "VACUUM ANALYZE $schema.$t"; done

# The shipped pipeline on schema bench_bulk, its state in $work/state.
python3 - "$schema" "$work" > "$work/pipeline.toml" <<'PY'
import sys
schema, dir = sys.argv[1:]
text = (open("pipelines/authors-books.toml").read()
        .replace('name = "authors-books"', f'name = "{schema}"')
        .replace("public.", f"{schema}.")
        .replace('schema = "read_models"', f'schema = "{schema}_rm"')
        .replace("${STATE_DIR:-./state}", f"{dir}/state"))
assert f"{schema}.book_authors" in text
print(text)
PY

# run NAME DOCS: `refract run --until-caught-up` measured; prints its figures (DOCS: documents
# the run must write, for the rate).
run() {
    local name=$1 docs=$2
    RUST_LOG=warn timed "$work/$name.time" "$refract" run "$work/pipeline.toml" --until-caught-up \
        --summary-json "$work/$name.json"
    python3 - "$name" "$docs" "$work/$name.time" "$work/$name.json" <<'PY'
import json, sys
name, docs, time_file, summary_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
wall, rss, user, system = (float(x) for x in open(time_file).read().split()[-4:])
summary = json.load(open(summary_file))
written = summary["sinks"]["target"].get("upserted", 0)
if summary["dead_letters"]:
    sys.exit(f"{name}: {summary['dead_letters']} dead letters")
if written < docs:
    sys.exit(f"{name}: {written} documents written; expected at least {docs}")
verdict = "ok" if rss / 1024 < 300 else "OVER the 300 MiB target"
print(f"{name}: refract peak RSS {rss / 1024:.1f} MiB ({verdict}); {summary['records']:,} records, {written:,} documents"
      f" in {wall:.1f} s ({written / wall:,.0f} documents/s, {user + system:.1f} CPU-s)")
PY
}

verify() {
    [ "${VERIFY:-}" = last ] && [ "$1" != update ] && return
    local start; start=$(python3 -c 'import time; print(time.time())')
    if ! RUST_LOG=warn "$refract" verify "$work/pipeline.toml" > "$work/verify-$1.txt" 2>&1; then
        echo "verify after $1 FAILED:" >&2; head -40 "$work/verify-$1.txt" >&2; exit 1
    fi
    echo "  refract verify after $1: exit 0 ($(python3 -c "import time; print(f'{time.time() - $start:.0f}')") s)"
}

start=$(python3 -c 'import time; print(time.time())')
psql "$pg_url" -X -Atqc "COPY (SELECT * FROM $schema.books) TO STDOUT" > /dev/null
copy=$(python3 -c "import time; print(f'{time.time() - $start:.2f}')")
echo "snapshot: $books books, 2 authors, $(( rename_books + (books + 1) / 2 )) links; COPY of books TO STDOUT: $copy s"
run snapshot $(( books + 2 ))
verify snapshot

sql "UPDATE $schema.authors SET first_name = 'Renamed' WHERE id = 'a0'"
echo "rename: one transaction (1 row) reaching $rename_books book documents and a0's document"
run rename "$rename_books"
verify rename
[ "$(sql "SELECT count(*) FROM ${schema}_rm.book_docs WHERE doc->'authors' @> '[{\"name\": \"Renamed Last0\"}]'")" = "$rename_books" ] \
    || { echo "rename: not every book shows the new name" >&2; exit 1; }

start=$(python3 -c 'import time; print(time.time())')
sql "UPDATE $schema.books SET name = 'Edition 2 of ' || id"
update_s=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
echo "update: one transaction of $books book rows (PostgreSQL: $update_s s), reaching $books book documents"
run update "$books"
verify update

# Baseline for scale: PostgreSQL rewriting the same book documents itself (a copy of book_docs).
sql "CREATE TABLE $schema.docs_copy AS SELECT * FROM ${schema}_rm.book_docs"
start=$(python3 -c 'import time; print(time.time())')
sql "UPDATE $schema.docs_copy SET doc = jsonb_set(doc, '{name}', to_jsonb('Edition 3 of ' || id)), updated_at = now()"
direct=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
echo "baseline: PostgreSQL rewriting the same $books documents in one UPDATE of a copy: $direct s"
