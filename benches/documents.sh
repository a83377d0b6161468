#!/usr/bin/env bash
# Benchmark: the `document` projection (pipelines/authors-books.toml: author and book documents
# with fan-out, rows kept in state.redb) into the PostgreSQL sink, three measurements, each next
# to a baseline measured in the same run:
#
# rename   Author rename fan-out. `a0` has RENAME_BOOKS books (default 10,000; 1,000 other
#          authors and 20,000 other books, two authors per book, around it). The shipped pipeline
#          on schema bench_docs (read models in bench_docs_rm) runs as a daemon; once its snapshot
#          has written every document, `UPDATE authors SET first_name = … WHERE id = 'a0'`
#          commits and the read model is polled until every book of a0 embeds the new name: the
#          time from the commit to the last document visible (measured inside PostgreSQL: a
#          procedure commits the update, then polls every 2 ms). Baseline: PostgreSQL itself
#          rewriting the same documents in one `UPDATE … SET doc = jsonb_set(…) WHERE id IN (…)`
#          on a copy of the book_docs table, the write the fan-out must do. Best of 3 renames;
#          also split at the sink transaction's start (the documents' updated_at).
# upserts  Steady-state document upserts from a file of EVENTS Debezium creates/updates of
#          `books` over BOOK_IDS ids (gen-envelopes --books; file source, so the source is not the
#          bottleneck) -> the shipped `book_docs` projection (no link events: `authors` is
#          empty) -> PostgreSQL sink, 100 documents per statement. Baseline: pgbench sending as
#          many documents of the same size in 100-row `INSERT … ON CONFLICT (id) DO UPDATE …
#          WHERE source_position <= …` statements into a table of the same shape (as
#          benches/pg_upsert.sh). Events of one id within a batch make one document, so pgbench
#          sends the number of documents refract wrote. (pgbench commits every statement; refract
#          commits once per batch of up to 5,000 events.)
# state    Peak RSS with BOOKS documents in state: BOOKS books, BOOKS/10 authors and 2*BOOKS links
#          (schema bench_docs_state) read by the shipped pipeline's initial snapshot
#          (`refract run --until-caught-up`) into STATE_SINK (postgres, the default, or null);
#          prints peak RSS, time, rows/s and the size of state.redb. Baseline for scale: `psql`
#          `COPY (SELECT * FROM t) TO STDOUT` of the same three tables.
#
# Usage: benches/documents.sh [rename] [upserts] [state]   (default: all three)
#        RENAME_BOOKS (default 10000), EVENTS (default 1000000; 100000 with CI=true), BOOK_IDS
#        (default EVENTS/4), BOOKS (default 1000000; 100000 with CI=true), STATE_SINK
#        (postgres|null), PG_URL (default postgres://postgres@127.0.0.1:5432/refract),
#        BENCH_DIR (keeps the generated event file for another run)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
parts=${*:-rename upserts state}
ci_div=1
[ "${CI:-}" = "true" ] && ci_div=10
rename_books=${RENAME_BOOKS:-10000}
events=${EVENTS:-$(( 1000000 / ci_div ))}
book_ids=${BOOK_IDS:-$(( events / 4 ))}
books=${BOOKS:-$(( 1000000 / ci_div ))}
state_sink=${STATE_SINK:-postgres}
pg_url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
export PG_URL=$pg_url
unset TARGET_PG_URL
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
pgbench_bench_setup
daemon=""
cleanup() {
    if [ -n "$daemon" ]; then kill -TERM "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
    # The daemon's walsender may outlive it for a moment.
    local i
    for i in $(seq 50); do
        [ "$(sql "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name IN ('refract_bench_docs', 'refract_bench_docs_state')" || echo 0)" = 0 ] && break
        sleep 0.2
    done
    sql "SET client_min_messages = warning;
         SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE slot_name IN ('refract_bench_docs', 'refract_bench_docs_state');
         DROP PUBLICATION IF EXISTS refract_bench_docs; DROP PUBLICATION IF EXISTS refract_bench_docs_state;
         DROP SCHEMA IF EXISTS bench_docs CASCADE; DROP SCHEMA IF EXISTS bench_docs_rm CASCADE;
         DROP SCHEMA IF EXISTS bench_docs_state CASCADE; DROP SCHEMA IF EXISTS bench_docs_state_rm CASCADE;
         DROP SCHEMA IF EXISTS bench_docs_upsert CASCADE" >/dev/null || true
    rm -rf "$work"/rename "$work"/upserts "$work"/state "$work/pgbench.sql"
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$work"
secs() { python3 -c 'import time; print(time.time())'; }
echo "$(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"

# schema_tables SCHEMA: the showcase tables authors, books and book_authors (tests/documents.rs),
# their foreign keys added by fill_tables once filled.
schema_tables() {
    sql "SET client_min_messages = warning;
         DROP SCHEMA IF EXISTS $1 CASCADE; DROP SCHEMA IF EXISTS $1_rm CASCADE; CREATE SCHEMA $1;
         CREATE TABLE $1.authors (id text PRIMARY KEY, first_name text NOT NULL, last_name text NOT NULL,
             thumbnail_url text, profile_url text, large_url text, updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE $1.books (id text PRIMARY KEY, name text NOT NULL, published_on date,
             updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE $1.book_authors (book_id text NOT NULL, author_id text NOT NULL,
             position int NOT NULL DEFAULT 0, PRIMARY KEY (book_id, author_id));"
}

# fill_tables SCHEMA SQL: runs the inserts SQL, then adds the foreign keys (checked in one pass)
# and vacuums.
fill_tables() {
    local start; start=$(secs)
    sql "$2"
    sql "ALTER TABLE $1.book_authors
             ADD FOREIGN KEY (book_id) REFERENCES $1.books(id) ON DELETE CASCADE,
             ADD FOREIGN KEY (author_id) REFERENCES $1.authors(id) ON DELETE CASCADE"
    local t
    for t in authors books book_authors; do sql "VACUUM ANALYZE $1.$t"; done
    echo "$1: tables filled in $(python3 -c "import time; print(f'{time.time() - $start:.1f}')") s"
}

# pipeline SCHEMA DIR [SINK]: the shipped pipeline on the tables of SCHEMA, read models in
# SCHEMA_rm, pipeline (slot) name SCHEMA, state in DIR/state, batches of at most 50 ms (as
# tests/documents.rs does); SINK=null swaps the PostgreSQL sink for the null sink.
pipeline() {
    python3 - "$1" "$2" "${3:-postgres}" > "$2/pipeline.toml" <<'PY'
import sys
schema, dir, sink = sys.argv[1:]
text = (open("pipelines/authors-books.toml").read()
        .replace('name = "authors-books"', f'name = "{schema}"')
        .replace("public.", f"{schema}.")
        .replace('schema = "read_models"', f'schema = "{schema}_rm"')
        .replace('on_error = "dead_letter"', 'on_error = "dead_letter"\n[pipeline.batch]\nmax_delay_ms = 50')
        .replace("${STATE_DIR:-./state}", f"{dir}/state"))
assert f"{schema}.book_authors" in text
if sink == "null":
    text = text[:text.index("[sinks.target]")] + '[sinks.target]\nkind = "null"\n'
print(text)
PY
}

rename() {
    local dir=$work/rename others=1000 other_books=20000
    mkdir -p "$dir"
    schema_tables bench_docs
    # a0's books first (a co-author at position 1 on every other one), then the other books with
    # two distinct other authors each.
    fill_tables bench_docs "INSERT INTO bench_docs.authors (id, first_name, last_name, thumbnail_url)
             SELECT 'a' || g, 'First' || g, 'Last' || g, 'https://img/t/' || g FROM generate_series(0, $others) g;
         INSERT INTO bench_docs.books (id, name) SELECT 'b' || g, 'Book ' || g
             FROM generate_series(0, $(( rename_books + other_books - 1 ))) g;
         INSERT INTO bench_docs.book_authors SELECT 'b' || g, 'a0', 0 FROM generate_series(0, $(( rename_books - 1 ))) g;
         INSERT INTO bench_docs.book_authors SELECT 'b' || g, 'a' || (1 + g % $others), 1
             FROM generate_series(0, $(( rename_books - 1 )), 2) g;
         INSERT INTO bench_docs.book_authors SELECT 'b' || g, 'a' || (1 + (g * 7 + k * 13) % $others), k
             FROM generate_series($rename_books, $(( rename_books + other_books - 1 ))) g, generate_series(0, 1) k;"
    local total_books=$(( rename_books + other_books )) total_authors=$(( others + 1 ))
    pipeline bench_docs "$dir"
    RUST_LOG=warn "$refract" run "$dir/pipeline.toml" > "$dir/daemon.log" 2>&1 &
    daemon=$!
    # Caught up: every document is in the read model.
    local start; start=$(secs)
    until [ "$(sql "SELECT (SELECT count(*) FROM bench_docs_rm.book_docs) + (SELECT count(*) FROM bench_docs_rm.author_docs)" 2>/dev/null || echo 0)" = $(( total_books + total_authors )) ]; do
        kill -0 "$daemon" 2>/dev/null || { cat "$dir/daemon.log"; exit 1; }
        python3 -c "import time, sys; sys.exit(time.time() - $start > 600)" || { echo "snapshot not caught up after 600 s" >&2; exit 1; }
        sleep 0.2
    done
    echo "rename: snapshot of $total_authors authors, $total_books books written by the daemon in $(python3 -c "import time; print(f'{time.time() - $start:.1f}')") s"
    sleep 1

    # The commit-to-visible time, inside PostgreSQL: commit the rename, then poll every 2 ms one
    # of the documents (a cheap lookup, so that polling does not compete with refract for the
    # cores); once it shows the name, count all of them (the count's snapshot is taken then).
    # `to_sink`: from the commit to the start of the sink's transaction (the documents'
    # updated_at), i.e. decoding, fan-out and making the state durable; the rest is the sink's write.
    sql "CREATE PROCEDURE bench_docs.rename_a0(new_first text, books bigint, INOUT ms float8 DEFAULT NULL,
             INOUT to_sink float8 DEFAULT NULL) LANGUAGE plpgsql AS \$\$
         DECLARE committed timestamptz; seen timestamptz; n bigint := 0;
             renamed jsonb := jsonb_build_array(jsonb_build_object('name', new_first || ' Last0'));
         BEGIN
             UPDATE bench_docs.authors SET first_name = new_first WHERE id = 'a0';
             COMMIT;
             committed := clock_timestamp();
             LOOP
                 IF EXISTS (SELECT FROM bench_docs_rm.book_docs WHERE id = 'b' || (books - 1) AND doc->'authors' @> renamed) THEN
                     seen := clock_timestamp();
                     SELECT count(*) INTO n FROM bench_docs_rm.book_docs WHERE doc->'authors' @> renamed;
                     EXIT WHEN n >= books;
                 END IF;
                 IF clock_timestamp() - committed > interval '10 minutes' THEN
                     RAISE EXCEPTION 'only % of % documents renamed after 10 minutes', n, books;
                 END IF;
                 PERFORM pg_sleep(0.002);
             END LOOP;
             ms := 1000 * extract(epoch FROM seen - committed);
             to_sink := 1000 * extract(epoch FROM (SELECT min(updated_at) FROM bench_docs_rm.book_docs
                 WHERE doc->'authors' @> renamed) - committed);
         END \$\$"
    # The baseline: the same documents rewritten by one UPDATE (committed) of a copy of book_docs.
    sql "CREATE TABLE bench_docs.book_docs_copy (LIKE bench_docs_rm.book_docs INCLUDING ALL);
         INSERT INTO bench_docs.book_docs_copy SELECT * FROM bench_docs_rm.book_docs"
    sql "VACUUM ANALYZE bench_docs.book_docs_copy"
    sql "CREATE PROCEDURE bench_docs.rewrite(new_first text, books bigint, INOUT ms float8 DEFAULT NULL) LANGUAGE plpgsql AS \$\$
         DECLARE started timestamptz := clock_timestamp(); n bigint;
         BEGIN
             UPDATE bench_docs.book_docs_copy
                 SET doc = jsonb_set(doc, '{authors,0,name}', to_jsonb(new_first || ' Last0')), updated_at = now()
                 WHERE id IN (SELECT book_id FROM bench_docs.book_authors WHERE author_id = 'a0');
             GET DIAGNOSTICS n = ROW_COUNT;
             IF n <> books THEN RAISE EXCEPTION 'rewrote % documents, not %', n, books; END IF;
             COMMIT;
             ms := 1000 * extract(epoch FROM clock_timestamp() - started);
         END \$\$"
    local round refract_ms=() direct_ms=()
    for round in 1 2 3; do
        refract_ms+=("$(sql "CALL bench_docs.rename_a0('Renamed$round', $rename_books)" | tr '|' ,)")
        direct_ms+=("$(sql "CALL bench_docs.rewrite('Renamed$round', $rename_books)")")
        sleep 1
    done
    local rss; rss=$(awk '/^VmHWM:/ {print $2}' "/proc/$daemon/status")
    kill -TERM "$daemon"; wait "$daemon"; daemon=""
    python3 - "$rename_books" "$rss" "${refract_ms[*]}" "${direct_ms[*]}" <<'PY'
import sys
books, rss = int(sys.argv[1]), int(sys.argv[2])
ref = [tuple(float(y) for y in x.split(",")) for x in sys.argv[3].split()]
direct = [float(x) for x in sys.argv[4].split()]
(r, to_sink), d = min(ref), min(direct)
print(f"rename fan-out: refract {r:.0f} ms / direct jsonb UPDATE of the same {books:,} docs {d:.0f} ms = {r / d:.2f}x"
      " (best of 3; commit to last document visible; lower is better, 1x = as fast as PostgreSQL rewriting them itself)")
print(f"  best round: {to_sink:.0f} ms from the commit to the sink's transaction start (decode, fan-out, state"
      f" commit), {r - to_sink:.0f} ms writing the documents")
print(f"  each round: refract {', '.join(f'{x:.0f}' for x, _ in ref)} ms; direct UPDATE {', '.join(f'{x:.0f}' for x in direct)} ms;"
      f" daemon peak RSS {rss / 1024:.1f} MiB")
PY
}

upserts() {
    local dir=$work/upserts
    mkdir -p "$dir"
    local log="$work/books-$events-$book_ids.jsonl"
    [ -s "$log" ] || "$target/release/gen-envelopes" --books "$events" "$log" "$book_ids"
    sql "SET client_min_messages = warning; DROP SCHEMA IF EXISTS bench_docs_upsert CASCADE; CREATE SCHEMA bench_docs_upsert"
    pgbench_docs_table bench_docs_upsert.pgbench_docs
    # The shipped book_docs projection, unchanged (the file's events are of public.books).
    {
        cat <<TOML
[pipeline]
name = "bench_docs_upsert"
state_dir = "$dir/state"
[source]
kind = "file"
path = "$log"
follow = false
TOML
        sed -n '/^\[projections.book_docs\]/,/^# --- sinks/p' pipelines/authors-books.toml | grep -v '^# --- sinks'
        cat <<TOML
[sinks.target]
kind = "postgres"
url = "$pg_url"
schema = "bench_docs_upsert"
# The statements pgbench sends: 100 documents each.
rows_per_statement = 100
TOML
    } > "$dir/pipeline.toml"
    echo "upserts: $events books creates/updates over $book_ids ids, $(( $(stat -c %s "$log") / 1048576 )) MiB; load $(cut -d' ' -f1-3 /proc/loadavg)"
    RUST_LOG=warn /usr/bin/time -f '%e %M' -o "$dir/time" \
        "$refract" run "$dir/pipeline.toml" --summary-json "$dir/summary.json" >/dev/null
    local upserted rows tps
    upserted=$(python3 -c "import json; print(json.load(open('$dir/summary.json'))['sinks']['target']['upserted'])")
    rows=$(sql "SELECT count(*) FROM bench_docs_upsert.book_docs")
    # A document as large as the ones refract writes (`authors` empty, ids of the same length).
    local doc; doc=$(sql "SELECT doc::text FROM bench_docs_upsert.book_docs ORDER BY length(doc::text) DESC, id LIMIT 1")
    tps=$(pgbench_upsert_tps bench_docs_upsert.pgbench_docs "$upserted" "$book_ids" b 0 "$doc")
    python3 - "$dir" "$tps" "$rows" "$doc" <<'PY'
import json, os, sys
dir, tps, rows, doc = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
summary = json.load(open(os.path.join(dir, "summary.json")))
secs = float(summary["elapsed"])
upserted = summary["sinks"]["target"]["upserted"]
rss = int(open(os.path.join(dir, "time")).read().split()[-1]) / 1024
rate, base = upserted / secs, tps * 100
print(f"refract: {summary['records']} events, {upserted} documents upserted in {secs:.2f} s ({rows} rows in the table);"
      f" pgbench: {upserted // 100 * 100} documents like {doc}")
print(f"document upserts/s: refract {rate:.0f} / pgbench {base:.0f} = {rate / base:.2f}x (higher is better; target >= 0.7x)")
print(f"refract peak RSS: {rss:.1f} MiB")
PY
}

state() {
    local dir=$work/state authors=$(( books / 10 ))
    mkdir -p "$dir"
    schema_tables bench_docs_state
    # Two distinct authors per book (positions 0 and 1), 20 books per author.
    fill_tables bench_docs_state "INSERT INTO bench_docs_state.authors (id, first_name, last_name, thumbnail_url, profile_url)
             SELECT 'a' || g, 'First' || g, 'Last' || g, 'https://img/t/' || g,
                    CASE WHEN g % 2 = 0 THEN 'https://img/p/' || g END FROM generate_series(0, $(( authors - 1 ))) g;
         INSERT INTO bench_docs_state.books (id, name, published_on) SELECT 'b' || g, 'Book ' || g, date '2000-01-01' + g % 9000
             FROM generate_series(0, $(( books - 1 ))) g;
         INSERT INTO bench_docs_state.book_authors SELECT 'b' || g, 'a' || ((g * 7 + k * 13) % $authors), k
             FROM generate_series(0, $(( books - 1 ))) g, generate_series(0, 1) k;"
    local rows
    rows=$(sql "SELECT (SELECT count(*) FROM bench_docs_state.authors) + (SELECT count(*) FROM bench_docs_state.books)
                     + (SELECT count(*) FROM bench_docs_state.book_authors)")
    pipeline bench_docs_state "$dir" "$state_sink"
    echo "state: $authors authors, $books books, $(( rows - authors - books )) links ($rows rows) -> $state_sink sink; load $(cut -d' ' -f1-3 /proc/loadavg)"
    local start copy ref
    start=$(secs)
    for t in authors books book_authors; do
        psql "$pg_url" -X -Atqc "COPY (SELECT * FROM bench_docs_state.$t) TO STDOUT" > /dev/null
    done
    copy=$(python3 -c "import time; print(time.time() - $start)")
    start=$(secs)
    RUST_LOG=warn /usr/bin/time -f '%M %U %S' -o "$dir/rss" "$refract" run "$dir/pipeline.toml" --until-caught-up \
        --summary-json "$dir/summary.json" > /dev/null
    ref=$(python3 -c "import time; print(time.time() - $start)")
    local docs=-1
    [ "$state_sink" = postgres ] && docs=$(sql "SELECT (SELECT count(*) FROM bench_docs_state_rm.book_docs) + (SELECT count(*) FROM bench_docs_state_rm.author_docs)")
    python3 - "$dir" "$rows" "$ref" "$copy" "$(tr ' ' , < "$dir/rss")" "$(stat -c %s "$dir/state/bench_docs_state/state.redb")" "$docs" "$(( books + authors ))" <<'PY'
import json, os, sys
dir, rows, ref, copy, rss, redb, docs, expected = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
summary = json.load(open(os.path.join(dir, "summary.json")))
read = summary["changes"].get("r", 0)
if read != rows or summary["dead_letters"] != 0:
    sys.exit(f"refract read {summary['changes']} with {summary['dead_letters']} dead letters; expected {rows} reads")
if docs >= 0 and docs != expected:
    sys.exit(f"{docs} documents in the read models; expected {expected}")
written = summary["sinks"]["target"].get("upserted", 0)
rss, user, system = (float(x) for x in rss.split(","))
print(f"state: refract peak RSS {rss / 1024:.1f} MiB with {expected:,} documents in state; state.redb {redb / 1048576:.0f} MiB")
print(f"snapshot rows/s: refract {rows / ref:,.0f} ({ref:.1f} s, {user + system:.1f} CPU-s, {written:,} document writes) / COPY TO STDOUT {rows / copy:,.0f} ({copy:.1f} s) = {copy / ref:.3f}x"
      " (for scale: COPY only reads the rows)")
PY
}

for part in $parts; do
    case $part in
        rename | upserts | state) "$part" ;;
        *) echo "unknown part $part (rename, upserts, state)" >&2; exit 2 ;;
    esac
done
