#!/usr/bin/env bash
# Benchmark (issue 27): document streaming. A backlog of UPDATES one-row updates to books and
# links, each its own transaction, applied by the shipped pipeline pipelines/authors-books.toml to
# both document read models (author_docs and book_docs, PostgreSQL sink), next to pg_recvlogical
# draining the same backlog, measured in the same run.
#
# Data (schema bench_stream, the showcase tables as benches/documents_bootstrap.sh creates and
# fills them): BOOKS books, BOOKS/10 authors and 2*BOOKS links (two distinct authors per book),
# plus one author without books and one book without authors.
#
# Setup     The shipped pipeline on bench_stream (read models in bench_stream_rm, slot and
#           publication refract_bench_stream, state in $BENCH_DIR/state): a first `refract run
#           --until-caught-up` snapshots the tables and writes every document (untimed). Then
#           pg_recvlogical's slot bench_stream_recv (pgoutput) is created.
# Backlog   A PL/pgSQL procedure (CALL, COMMIT inside its loop; synchronous_commit off, which only
#           makes the backlog quicker to write, the WAL is the same) commits UPDATES transactions
#           of one row each while nothing reads: every odd one `UPDATE books SET name = … WHERE
#           id = …` of a random book (its book document), every even one `UPDATE book_authors SET
#           position = … WHERE book_id = … AND author_id = …` of one of a random book's two links
#           (the book document's author order; the author document's input). The end LSN is
#           pg_current_wal_insert_lsn() right after it, and a CHECKPOINT flushes the WAL before
#           either side reads.
# refract   `refract run --until-caught-up` drains its slot into the read models: wall time and
#           peak RSS (/usr/bin/time, as `timed` in benches/common.sh); it must read exactly
#           UPDATES updates and no dead letters.
# baseline  `pg_recvlogical --start --endpos END_LSN -o proto_version=1 -o
#           publication_names=refract_bench_stream -f /dev/null` drains its own slot, timed the
#           same way (as benches/pg_drain.sh).
# Rounds    ROUNDS rounds (default 2), each with a fresh backlog, interleaved: pg_recvlogical first
#           in odd rounds, refract first in even ones, so neither side profits from the other's
#           warm caches; the best of each side is compared. changes/s = UPDATES / seconds.
# Prints `refract changes/s / pg_recvlogical changes/s = ratio` (target >= 1.0x) and refract's
# peak RSS; then `refract verify` must exit 0 (the script fails otherwise).
#
# Usage: benches/documents_stream.sh
#        BOOKS (default 100000; 10000 with CI=true), UPDATES (default 100000; 10000 with CI=true),
#        ROUNDS (default 2), PG_URL (default postgres://postgres@127.0.0.1:5432/refract),
#        BENCH_DIR (keeps the state and logs), REFRACT_BIN (the refract binary to measure;
#        default: cargo build --release into ${CARGO_TARGET_DIR:-target})
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh
default_size=100000
[ "${CI:-}" = "true" ] && default_size=10000
books=${BOOKS:-$default_size}
updates=${UPDATES:-$default_size}
rounds=${ROUNDS:-2}
authors=$(( books / 10 ))
[ "$authors" -ge 14 ] || { echo "BOOKS must be at least 140 (two distinct authors per book)" >&2; exit 1; }
pg_url=${PG_URL:-postgres://postgres@127.0.0.1:5432/refract}
export PG_URL=$pg_url
unset TARGET_PG_URL
work=${BENCH_DIR:-$(mktemp -d)}
mkdir -p "$work"
[ -x /usr/bin/time ] || { apt-get update -qq && apt-get install -y -qq time; }
command -v pg_recvlogical >/dev/null || PATH=$PATH:$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
command -v pg_recvlogical >/dev/null || { echo "pg_recvlogical not found (PATH or /usr/lib/postgresql/*/bin)" >&2; exit 1; }
[ -n "${REFRACT_BIN:-}" ] || cargo build --release --locked -q -p refract
refract=${REFRACT_BIN:-${CARGO_TARGET_DIR:-target}/release/refract}
sql() { psql "$pg_url" -X -q -v ON_ERROR_STOP=1 -Atc "$1"; }
now() { python3 -c 'import time; print(time.time())'; }
schema=bench_stream
slots="'refract_$schema', '${schema}_recv'"
cleanup() {
    local i   # refract's walsender (or pg_recvlogical's) may outlive it for a moment
    for i in $(seq 50); do
        [ "$(sql "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name IN ($slots)" || echo 0)" = 0 ] && break
        sleep 0.2
    done
    sql "SET client_min_messages = warning;
         SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ($slots);
         DROP PUBLICATION IF EXISTS refract_$schema;
         DROP SCHEMA IF EXISTS $schema CASCADE; DROP SCHEMA IF EXISTS ${schema}_rm CASCADE" >/dev/null || true
    rm -rf "$work/state"
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$work"
echo "$(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg); refract: $refract"

# The showcase tables (tests/documents.rs), filled as benches/documents_bootstrap.sh fills them,
# then their foreign keys.
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
links=$(sql "SELECT count(*) FROM $schema.book_authors")
echo "tables: $(( authors + 1 )) authors, $(( books + 1 )) books, $links links filled in $(python3 -c "print(f'{$(now) - $start:.1f}')") s"

# The backlog's writer: N transactions of one row each, alternating books and book_authors, on
# random books (the two links of book g are to authors (7g) mod A and (7g + 13) mod A); every
# UPDATE must hit exactly one row.
sql "CREATE PROCEDURE $schema.backlog(n int, nbooks int, nauthors int, rnd int)
     LANGUAGE plpgsql AS \$\$
     DECLARE g int; hit int;
     BEGIN
         PERFORM setseed((rnd % 100) / 100.0);
         FOR i IN 1..n LOOP
             g := floor(random() * nbooks)::int;
             IF i % 2 = 1 THEN
                 UPDATE $schema.books SET name = 'Book ' || g || ' (r' || rnd || '.' || i || ')' WHERE id = 'b' || g;
             ELSE
                 UPDATE $schema.book_authors SET position = (i / 2) % 5
                 WHERE book_id = 'b' || g AND author_id = 'a' || ((g * 7 + ((i / 2) % 2) * 13) % nauthors);
             END IF;
             GET DIAGNOSTICS hit = ROW_COUNT;
             IF hit <> 1 THEN RAISE EXCEPTION 'update % of book b% hit % rows', i, g, hit; END IF;
             COMMIT;
         END LOOP;
     END \$\$"

# The shipped pipeline on schema bench_stream, its state in $work/state.
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

# The initial snapshot (untimed): creates the slot and publication refract_bench_stream and
# writes every document.
start=$(now)
RUST_LOG=warn "$refract" run "$work/pipeline.toml" --until-caught-up --summary-json "$work/snapshot.json" >/dev/null
echo "initial snapshot (untimed): $(python3 -c "print(f'{$(now) - $start:.1f}')") s"
# pg_recvlogical's slot, at the same point of the WAL as refract's (nothing has written since).
sql "SELECT pg_create_logical_replication_slot('${schema}_recv', 'pgoutput')" >/dev/null

# drain_recv ROUND ENDPOS: pg_recvlogical drains its slot up to ENDPOS.
drain_recv() {
    timed "$work/recv-$1.time" pg_recvlogical -d "$pg_url" --slot "${schema}_recv" --start --endpos "$2" --no-loop \
        -o proto_version=1 -o publication_names="refract_$schema" -f /dev/null
    # The next round must not decode this round's backlog again.
    [ "$(sql "SELECT confirmed_flush_lsn >= '$2' FROM pg_replication_slots WHERE slot_name = '${schema}_recv'")" = t ] \
        || { echo "round $1: pg_recvlogical's slot did not confirm $2" >&2; exit 1; }
}
# drain_refract ROUND: refract drains its slot into the read models; it must read exactly the
# backlog's updates, without dead letters.
drain_refract() {
    RUST_LOG=warn timed "$work/refract-$1.time" "$refract" run "$work/pipeline.toml" --until-caught-up \
        --summary-json "$work/refract-$1.json"
    python3 - "$work/refract-$1.json" "$updates" <<'PY'
import json, sys
s, updates = json.load(open(sys.argv[1])), int(sys.argv[2])
changes = {op: n for op, n in s["changes"].items() if n}
if changes != {"u": updates} or s["dead_letters"] != 0:
    sys.exit(f"refract read changes {s['changes']} with {s['dead_letters']} dead letters; expected {updates} updates")
PY
}

for round in $(seq 1 "$rounds"); do
    start=$(now)
    # The end LSN: the insert position right after the last commit (with asynchronous commit,
    # pg_current_wal_lsn(), the write position, may still be short of the last commits).
    endpos=$(PGOPTIONS='-c synchronous_commit=off' psql "$pg_url" -X -q -v ON_ERROR_STOP=1 -At \
        -c "CALL $schema.backlog($updates, $books, $authors, $round)" -c "SELECT pg_current_wal_insert_lsn()")
    sql "CHECKPOINT"
    echo "round $round: backlog of $updates one-row transactions ($(( (updates + 1) / 2 )) books, $(( updates / 2 )) book_authors) written in $(python3 -c "print(f'{$(now) - $start:.1f}')") s, up to $endpos"
    if [ $(( round % 2 )) = 1 ]; then
        drain_recv "$round" "$endpos"; drain_refract "$round"
    else
        drain_refract "$round"; drain_recv "$round" "$endpos"
    fi
    python3 - "$work/refract-$round.time" "$work/recv-$round.time" "$work/refract-$round.json" <<'PY'
import json, sys
ref, recv = (open(f).read().split()[-4:] for f in sys.argv[1:3])
docs = json.load(open(sys.argv[3]))["sinks"]["target"].get("upserted", 0)
print(f"  refract {float(ref[0]):.2f}s ({float(ref[2]) + float(ref[3]):.2f} CPU-s, {float(ref[1]) / 1024:.1f} MiB, {docs:,} upserts sent by the sink);"
      f" pg_recvlogical {float(recv[0]):.2f}s ({float(recv[2]) + float(recv[3]):.2f} CPU-s)")
PY
done

python3 - "$work" "$updates" "$rounds" <<'PY'
import sys
work, updates, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
read = lambda name, r: [float(x) for x in open(f"{work}/{name}-{r}.time").read().split()[-4:]]
ref = [read("refract", r) for r in range(1, rounds + 1)]
recv = [read("recv", r) for r in range(1, rounds + 1)]
best_ref, best_recv = min(t[0] for t in ref), min(t[0] for t in recv)
r, p = updates / best_ref, updates / best_recv
print(f"backlog: {updates:,} one-row updates, each its own transaction, half to books, half to book_authors"
      f" (best of {rounds} rounds, pg_recvlogical first in odd rounds)")
print(f"drain changes/s: refract -> author_docs + book_docs {r:,.0f} ({best_ref:.2f}s) / pg_recvlogical {p:,.0f}"
      f" ({best_recv:.2f}s) = {r / p:.2f}x (higher is better; target >= 1.0x)")
print(f"refract peak RSS: {max(t[1] for t in ref) / 1024:.1f} MiB")
PY

start=$(now)
set +e
RUST_LOG=warn "$refract" verify "$work/pipeline.toml" > "$work/verify.txt" 2>&1
rc=$?
set -e
echo "refract verify: exit $rc ($(python3 -c "print(f'{$(now) - $start:.0f}')") s)"
[ "$rc" = 0 ] || { head -40 "$work/verify.txt" >&2; exit 1; }
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
