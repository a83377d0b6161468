//! One transaction reaching many documents (`pipelines/authors-books.toml` against the real
//! PostgreSQL): a rename of an author listed by every book, and a bulk UPDATE of every book,
//! each committed as one transaction whose documents leave in many batches (small batch
//! limits). The daemon is SIGKILLed once part of them is written (the read model half old,
//! half new: `refract verify` fails then), restarted, and `refract verify` must find every
//! document equal to the tables: a batch cut inside the emission never checkpoints the
//! transaction's end, and the state it removed dirty marks from is rolled back.
//!
//! The initial snapshot is one such unit: its rows come framed as one transaction, so each
//! document is written once, at the end of the load; a SIGKILL during the load or during that
//! emission is followed by a restart that ends equal to the tables.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::documents::{catch_up, fresh_schema, pipeline_file, verify};
use common::pg::{Cleanup, psql, url};
use common::*;
use serde_json::Value;

/// Books of the one author (every book): large enough that its documents leave in many
/// batches, small enough for CI.
fn books() -> u64 {
    if in_ci() { 4_000 } else { 40_000 }
}

/// `[pipeline.batch] max_events` of the test's pipeline: a transaction's rows come in batches of
/// at most four times this (`TRANSACTION_BATCH_FACTOR`), its documents in batches of this.
const MAX_EVENTS: u64 = 100;

/// How long a round waits for its documents to be partly written, then all written.
const ROUND_LIMIT: Duration = Duration::from_secs(300);

/// The bootstrap SIGKILL loop: a life lasts 200 ms plus a random part of a window that starts
/// at `FIRST_WINDOW` and grows by `WINDOW_GROWTH` after each life that wrote no document, up to
/// `LONGEST_WINDOW`; the load must end within `MAX_LIVES` lives.
const FIRST_WINDOW: Duration = Duration::from_secs(1);
const WINDOW_GROWTH: f64 = 1.1;
const LONGEST_WINDOW: Duration = Duration::from_secs(30);
const MAX_LIVES: u32 = 100;

/// Rounds whose kill missed the emission (it ended between two looks) before the test gives up.
const ATTEMPTS: u32 = 5;

/// The authors-books pipeline on `schema` with small batches.
fn bulk_pipeline(dir: &Path, schema: &str) -> PathBuf {
    let path = pipeline_file(dir, schema);
    let text = std::fs::read_to_string(&path).unwrap();
    let text = text.replace(
        "max_delay_ms = 50",
        &format!("max_delay_ms = 50\nmax_events = {MAX_EVENTS}"),
    );
    assert!(text.contains("max_events"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Author `a0` on every book (position 0), `a1` on every other one (position 1).
fn seed(schema: &str, books: u64) {
    psql(&format!(
        "INSERT INTO {schema}.authors (id, first_name, last_name, thumbnail_url)
           VALUES ('a0', 'First0', 'Last0', 'https://img/t/0'), ('a1', 'First1', 'Last1', NULL);
         INSERT INTO {schema}.books (id, name) SELECT 'b' || g, 'Book ' || g FROM generate_series(0, {last}) g;
         INSERT INTO {schema}.book_authors SELECT 'b' || g, 'a0', 0 FROM generate_series(0, {last}) g;
         INSERT INTO {schema}.book_authors SELECT 'b' || g, 'a1', 1 FROM generate_series(0, {last}, 2) g;",
        last = books - 1
    ));
}

/// The count query `sql` returns; 0 before the sink created the read model's table (with its
/// first write).
fn count(client: &mut postgres::Client, sql: &str) -> u64 {
    match client.query_one(sql, &[]) {
        Ok(row) => row.get::<_, i64>(0) as u64,
        Err(e) if e.code() == Some(&postgres::error::SqlState::UNDEFINED_TABLE) => 0,
        Err(e) => panic!("{sql}: {e}"),
    }
}

/// A fresh schema `schema` seeded with `books` books (dropped with its slot when the guard
/// goes), and a directory for the pipeline's file and state.
fn seeded(schema: &str, books: u64) -> (Cleanup, tempfile::TempDir) {
    let cleanup = Cleanup::new(schema, &[]);
    fresh_schema(schema);
    seed(schema, books);
    (cleanup, tempfile::tempdir().unwrap())
}

/// Runs the daemon, commits `change` (one transaction), SIGKILLs the daemon once `written` (a
/// count of documents showing the change) is above zero and below `books`; returns whether
/// the kill landed there (false: the emission ended between two looks).
fn kill_during_emission(pipeline: &Path, change: &str, written: &str, books: u64) -> bool {
    let mut client = postgres::Client::connect(&url(), postgres::NoTls).unwrap();
    let mut daemon = quiet_daemon(pipeline);
    if !change.is_empty() {
        client.batch_execute(change).unwrap();
    }
    let deadline = Instant::now() + ROUND_LIMIT;
    loop {
        let n = count(&mut client, written);
        if n > 0 && n < books {
            daemon.child().kill().unwrap();
            daemon.child().wait().unwrap();
            eprintln!("SIGKILL with {n} of {books} documents written");
            return true;
        }
        if n == books {
            daemon.terminate();
            daemon.child().wait().unwrap();
            return false;
        }
        assert!(
            daemon.child().try_wait().unwrap().is_none(),
            "the daemon ended"
        );
        assert!(
            Instant::now() < deadline,
            "{n} of {books} documents written"
        );
    }
}

/// Rounds of `change(round)` (one transaction reaching every book) with a SIGKILL during the
/// emission of its documents, until one lands there; then a restart, and verify.
fn survives_a_kill_during_emission(
    pipeline: &Path,
    books: u64,
    change: &dyn Fn(u32) -> (String, String),
) {
    for round in 1..=ATTEMPTS {
        let (sql, written) = change(round);
        if !kill_during_emission(pipeline, &sql, &written, books) {
            eprintln!("round {round}: the emission ended before the kill; again");
            continue;
        }
        let (code, report) = verify(pipeline);
        assert_eq!(code, 1, "killed half-way, the read model differs: {report}");
        catch_up(pipeline);
        let (code, report) = verify(pipeline);
        assert_eq!(code, 0, "after the SIGKILL and a restart: {report}");
        let n: u64 = psql(&written).parse().unwrap();
        assert_eq!(n, books, "every document shows the change");
        return;
    }
    panic!("no SIGKILL landed during the emission in {ATTEMPTS} rounds");
}

#[test]
fn a_transaction_s_documents_survive_a_sigkill_in_the_middle_of_their_emission() {
    let schema = "docs_bulk";
    let books = books();
    let (_cleanup, dir) = seeded(schema, books);
    let pipeline = bulk_pipeline(dir.path(), schema);
    catch_up(&pipeline);
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "after the snapshot: {report}");

    // A rename of the author every book lists.
    survives_a_kill_during_emission(&pipeline, books, &|round| {
        (
            format!("UPDATE {schema}.authors SET first_name = 'Renamed{round}' WHERE id = 'a0'"),
            format!(
                "SELECT count(*) FROM {schema}_rm.book_docs \
                 WHERE doc->'authors' @> '[{{\"name\": \"Renamed{round} Last0\"}}]'"
            ),
        )
    });
    // A bulk UPDATE of every book.
    survives_a_kill_during_emission(&pipeline, books, &|round| {
        (
            format!("UPDATE {schema}.books SET name = 'Edition {round} of ' || id"),
            format!(
                "SELECT count(*) FROM {schema}_rm.book_docs WHERE doc->>'name' LIKE 'Edition {round} of %'"
            ),
        )
    });
}

/// Documents of the seeded schema: every book and the two authors.
fn documents(books: u64) -> u64 {
    books + 2
}

#[test]
fn the_initial_snapshot_writes_each_document_once() {
    let schema = "docs_boot_once";
    let books = books();
    let (_cleanup, dir) = seeded(schema, books);
    let pipeline = bulk_pipeline(dir.path(), schema);
    let summary = dir.path().join("summary.json");
    let out = output(
        refract()
            .arg("run")
            .arg(&pipeline)
            .arg("--until-caught-up")
            .arg("--summary-json")
            .arg(&summary),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let rows = books + 2 + books + books.div_ceil(2);
    assert_eq!(summary["changes"]["r"], rows, "{summary}");
    // Batches of at most 4 x MAX_EVENTS rows: a book's row, its links and its authors arrive in
    // different batches, and each batch's end would rebuild the book again. Framed as one
    // transaction, each document is built once, when the load ends.
    let target = &summary["sinks"]["target"];
    assert_eq!(target["upserted"], documents(books), "{summary}");
    assert_eq!(target["coalesced"], 0, "{summary}");
    assert_eq!(summary["transactions"], 1, "{summary}");
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "after the snapshot: {report}");
}

#[test]
fn a_bootstrap_killed_again_and_again_ends_equal_to_the_tables() {
    let schema = "docs_boot_kill";
    // Enough rows that the load outlasts several short lives of the daemon.
    let books = books() * 15;
    let kills = if in_ci() { 5 } else { 10 };
    let (_cleanup, dir) = seeded(schema, books);
    // The shipped batch limits: with tiny batches a resumed chunk's documents take longer to
    // write than a life lasts, and the load would never get past it.
    let pipeline = pipeline_file(dir.path(), schema);
    let mut client = postgres::Client::connect(&url(), postgres::NoTls).unwrap();
    let written = format!("SELECT count(*) FROM {schema}_rm.book_docs");
    let mut rng = Rng::new(27);
    let (mut landed, mut lives, mut before) = (0, 0, 0);
    let mut window = FIRST_WINDOW;
    // Each life starts or resumes the load and is SIGKILLed at a random moment; a kill that
    // leaves books without their document landed during the bootstrap (the first ones may
    // land before the COPY began: the snapshot is due then too). Until one leaves them all.
    loop {
        lives += 1;
        assert!(
            lives <= MAX_LIVES,
            "the load did not complete in {MAX_LIVES} lives"
        );
        let lifetime = Duration::from_millis(200) + window.mul_f64(rng.below(1000) as f64 / 1000.0);
        assert!(
            run_and_kill(&pipeline, lifetime),
            "the daemon ended by itself"
        );
        let n = count(&mut client, &written);
        eprintln!("life {lives}: SIGKILL after {lifetime:?}, {n} of {books} book documents");
        if n == books {
            break;
        }
        landed += 1;
        // Most of the load's documents leave at its end, so lives that write none are the
        // rule; on a slow machine a life can also end before its restart and its first
        // durable step are over, again and again. Longer lives after those that wrote
        // nothing keep every kill at a random moment and let the load end on any machine.
        if n == before {
            window = window.mul_f64(WINDOW_GROWTH).min(LONGEST_WINDOW);
        }
        before = n;
    }
    assert!(
        landed >= kills,
        "only {landed} SIGKILLs landed during the load: give it more rows"
    );
    catch_up(&pipeline);
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "after {landed} SIGKILLs during the load: {report}");
}

#[test]
fn a_bootstrap_killed_while_it_writes_its_documents_writes_them_all_at_the_next_start() {
    let schema = "docs_boot_emit";
    let books = books();
    let (_cleanup, dir) = seeded(schema, books);
    let pipeline = bulk_pipeline(dir.path(), schema);
    // The documents leave when the load ends, in batches of MAX_EVENTS. Killed between
    // two of them, the END that frames the load is not durable (a batch cut inside an emission
    // does not move the checkpoint): the next start reads the rest again in chunks, whose own
    // transactions end what the load marked. Nothing changes in the tables afterwards, so no
    // later change writes them instead.
    let written = format!("SELECT count(*) FROM {schema}_rm.book_docs");
    for attempt in 1..=ATTEMPTS {
        if kill_during_emission(&pipeline, "", &written, books) {
            let (code, report) = verify(&pipeline);
            assert_eq!(code, 1, "killed half-way, the read model differs: {report}");
            catch_up(&pipeline);
            let (code, report) = verify(&pipeline);
            assert_eq!(code, 0, "after the SIGKILL and a restart: {report}");
            return;
        }
        eprintln!("attempt {attempt}: the emission ended before the kill; again");
        psql(&format!("DROP SCHEMA {schema}_rm CASCADE"));
        std::fs::remove_dir_all(dir.path().join("state")).unwrap();
        common::pg::drop_slot(schema);
    }
    panic!("no SIGKILL landed during the emission in {ATTEMPTS} attempts");
}
