#!/usr/bin/env bash
# Benchmark (issue 27): the bootstrap of the two document read models of the shipped pipeline
# pipelines/authors-books.toml (author_docs and book_docs, PostgreSQL sink), next to PostgreSQL
# building the same documents itself, measured in the same run.
#
# Data (schema bench_boot): BOOKS books, BOOKS/10 authors and 2*BOOKS links (two distinct authors
# per book, as benches/documents.sh `state`), plus one author without books and one book without
# authors; some thumbnails missing, some profile and large urls set, and every other book's two
# links at the same position (so the order falls back to the author id).
#
# refract   The shipped pipeline on bench_boot (read models in bench_boot_rm, slot and publication
#           refract_bench_boot, state in $BENCH_DIR/state): `refract run --until-caught-up`, whose
#           first run snapshots the three tables (COPY) and writes every document. Wall time, peak
#           RSS, state.redb size, document writes (pg_stat_user_tables n_tup_ins + n_tup_upd of the
#           read-model tables).
# baseline  PostgreSQL building the same documents with `INSERT … SELECT … jsonb_agg … GROUP BY`
#           into empty tables of the sink's shape (id text PRIMARY KEY, doc jsonb, source_position,
#           updated_at), both collections; the documents must equal refract's.
# Rate: rows/s, rows = books + authors + links. Then `refract verify` must exit 0.
#
# Usage: benches/documents_bootstrap.sh
#        BOOKS (default 1000000; 20000 with CI=true), PG_URL (default
#        postgres://postgres@127.0.0.1:5432/refract), BENCH_DIR (keeps the state and logs),
#        REFRACT_BIN (the refract binary to measure; default: cargo build --release into
#        ${CARGO_TARGET_DIR:-target})
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
default_books=1000000
[ "${CI:-}" = "true" ] && default_books=20000
books=${BOOKS:-$default_books}
authors=$(( books / 10 ))
pg_url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
export PG_URL=$pg_url
unset TARGET_PG_URL
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
[ -n "${REFRACT_BIN:-}" ] || cargo build --release --locked -q -p refract
refract=${REFRACT_BIN:-${CARGO_TARGET_DIR:-target}/release/refract}
sql() { psql "$pg_url" -X -q -v ON_ERROR_STOP=1 -Atc "$1"; }
now() { python3 -c 'import time; print(time.time())'; }
schema=bench_boot
cleanup() {
    local i   # refract's walsender may outlive it for a moment
    for i in $(seq 50); do
        [ "$(sql "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name = 'refract_$schema'" || echo 0)" = 0 ] && break
        sleep 0.2
    done
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
start=$(now)
sql "SET client_min_messages = warning; CREATE SCHEMA $schema;
     CREATE TABLE $schema.authors (id text PRIMARY KEY, first_name text NOT NULL, last_name text NOT NULL,
         thumbnail_url text, profile_url text, large_url text, updated_at timestamptz NOT NULL DEFAULT now());
     CREATE TABLE $schema.books (id text PRIMARY KEY, name text NOT NULL, published_on date,
         updated_at timestamptz NOT NULL DEFAULT now());
     CREATE TABLE $schema.book_authors (book_id text NOT NULL, author_id text NOT NULL,
         position int NOT NULL DEFAULT 0, PRIMARY KEY (book_id, author_id));
     INSERT INTO $schema.authors (id, first_name, last_name, thumbnail_url, profile_url, large_url)
         SELECT 'a' || g, 'First' || g, 'Last' || g, CASE WHEN g % 5 <> 0 THEN 'https://img/t/' || g END,
                CASE WHEN g % 2 = 0 THEN 'https://img/p/' || g END, CASE WHEN g % 3 = 0 THEN 'https://img/l/' || g END
         FROM generate_series(0, $(( authors - 1 ))) g;
     INSERT INTO $schema.authors (id, first_name, last_name) VALUES ('a_none', 'No', 'Books');
     INSERT INTO $schema.books (id, name, published_on) SELECT 'b' || g, 'Book ' || g, date '2000-01-01' + g % 9000
         FROM generate_series(0, $(( books - 1 ))) g;
     INSERT INTO $schema.books (id, name) VALUES ('b_none', 'No authors');
     INSERT INTO $schema.book_authors SELECT 'b' || g, 'a' || ((g * 7 + k * 13) % $authors), k * (g % 2)
         FROM generate_series(0, $(( books - 1 ))) g, generate_series(0, 1) k;
     ALTER TABLE $schema.book_authors
         ADD FOREIGN KEY (book_id) REFERENCES $schema.books(id) ON DELETE CASCADE,
         ADD FOREIGN KEY (author_id) REFERENCES $schema.authors(id) ON DELETE CASCADE;"
for t in authors books book_authors; do sql "VACUUM ANALYZE $schema.$t"; done
rows=$(sql "SELECT (SELECT count(*) FROM $schema.authors) + (SELECT count(*) FROM $schema.books)
                 + (SELECT count(*) FROM $schema.book_authors)")
docs=$(( books + 1 + authors + 1 ))
echo "tables: $(( authors + 1 )) authors, $(( books + 1 )) books, $(( rows - docs )) links ($rows rows) filled in $(python3 -c "print(f'{$(now) - $start:.1f}')") s"

# The shipped pipeline on schema bench_boot, its state in $work/state.
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

# refract: the first run snapshots the tables and writes every document.
sql "CHECKPOINT"
RUST_LOG=warn timed "$work/refract.time" "$refract" run "$work/pipeline.toml" --until-caught-up \
    --summary-json "$work/summary.json"
sleep 1   # the statistics of refract's (closed) sessions reach pg_stat_user_tables
writes=$(sql "SELECT coalesce(sum(n_tup_ins + n_tup_upd), 0) FROM pg_stat_user_tables
              WHERE schemaname = '${schema}_rm' AND relname IN ('author_docs', 'book_docs')")
position=$(sql "SELECT source_position FROM ${schema}_rm.book_docs LIMIT 1")

# The baseline: the same documents built by PostgreSQL into tables of the sink's shape.
for c in author_docs book_docs; do
    sql "CREATE TABLE $schema.base_$c (id text PRIMARY KEY, doc jsonb NOT NULL,
         source_position text COLLATE \"C\" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())"
done
sql "CHECKPOINT"
start=$(now)
sql "INSERT INTO $schema.base_book_docs (id, doc, source_position)
     SELECT b.id, jsonb_build_object('id', b.id, 'name', b.name, 'authors', coalesce(x.authors, '[]')), '$position'
     FROM $schema.books b LEFT JOIN (
         SELECT l.book_id, jsonb_agg(jsonb_build_object('id', a.id, 'name', a.first_name || ' ' || a.last_name,
                                                        'thumbnailUrl', a.thumbnail_url)
                                     ORDER BY l.position, a.id COLLATE \"C\") AS authors
         FROM $schema.book_authors l JOIN $schema.authors a ON a.id = l.author_id GROUP BY l.book_id
     ) x ON x.book_id = b.id;
     INSERT INTO $schema.base_author_docs (id, doc, source_position)
     SELECT a.id, jsonb_build_object('id', a.id, 'firstName', a.first_name, 'lastName', a.last_name,
                'books', coalesce(x.books, '[]'), 'countOfBooks', coalesce(x.n, 0),
                'images', CASE WHEN a.thumbnail_url IS NULL THEN '[]' ELSE jsonb_build_array(jsonb_build_object('thumbnail', a.thumbnail_url)) END
                       || CASE WHEN a.profile_url IS NULL THEN '[]' ELSE jsonb_build_array(jsonb_build_object('profile', a.profile_url)) END
                       || CASE WHEN a.large_url IS NULL THEN '[]' ELSE jsonb_build_array(jsonb_build_object('large', a.large_url)) END), '$position'
     FROM $schema.authors a LEFT JOIN (
         -- the foreign key guarantees every linked book exists
         SELECT author_id, jsonb_agg(book_id ORDER BY book_id COLLATE \"C\") AS books, count(*) AS n
         FROM $schema.book_authors GROUP BY author_id
     ) x ON x.author_id = a.id"
base=$(python3 -c "print($(now) - $start)")

# The baseline is honest only if its documents are refract's.
for c in author_docs book_docs; do
    diff=$(sql "SELECT count(*) FROM ${schema}_rm.$c r FULL JOIN $schema.base_$c b USING (id) WHERE r.doc IS DISTINCT FROM b.doc")
    if [ "$diff" != 0 ]; then
        echo "$c: $diff documents differ between refract and the SQL baseline, e.g.:" >&2
        sql "SELECT id, r.doc, b.doc FROM ${schema}_rm.$c r FULL JOIN $schema.base_$c b USING (id)
             WHERE r.doc IS DISTINCT FROM b.doc ORDER BY id LIMIT 3" >&2
        exit 1
    fi
done
echo "documents: refract's equal the baseline's ($docs in both collections)"

python3 - "$rows" "$docs" "$base" "$writes" "$work/refract.time" "$work/summary.json" \
    "$(stat -c %s "$work/state/$schema/state.redb")" <<'PY'
import json, sys
rows, docs, base, writes = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
wall, rss, user, system = (float(x) for x in open(sys.argv[5]).read().split()[-4:])
summary, redb = json.load(open(sys.argv[6])), int(sys.argv[7])
read = summary["changes"].get("r", 0)
if read != rows or summary["dead_letters"]:
    sys.exit(f"refract read {summary['changes']} with {summary['dead_letters']} dead letters; expected {rows} reads")
upserted = summary["sinks"]["target"].get("upserted", 0)
ratio = (rows / wall) / (rows / base)
print(f"bootstrap rows/s: refract {rows / wall:,.0f} ({wall:.1f} s, {user + system:.1f} CPU-s) / PostgreSQL"
      f" INSERT … SELECT … jsonb_agg {rows / base:,.0f} ({base:.1f} s) = {ratio:.3f}x (higher is better; target >= 0.5x)")
print(f"state bytes per source row: {redb / rows:,.0f} (state.redb {redb / 1048576:.0f} MiB / {rows:,} rows)")
verdict = "ok" if rss / 1024 < 300 else "OVER the 300 MiB target"
print(f"refract peak RSS: {rss / 1024:.1f} MiB ({verdict})")
print(f"document writes per document: {writes / docs:.2f} ({writes:,} rows inserted + updated in the read models,"
      f" {upserted:,} upserts sent by the sink, for {docs:,} documents)")
PY

start=$(now)
set +e
RUST_LOG=warn "$refract" verify "$work/pipeline.toml" > "$work/verify.txt" 2>&1
rc=$?
set -e
echo "refract verify: exit $rc ($(python3 -c "print(f'{$(now) - $start:.0f}')") s)"
[ "$rc" = 0 ] || { head -40 "$work/verify.txt" >&2; exit 1; }
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
