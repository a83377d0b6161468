//! One transaction reaching many documents (`pipelines/authors-books.toml` against the real
//! PostgreSQL): a rename of an author listed by every book, and a bulk UPDATE of every book,
//! each committed as one transaction whose documents leave in many batches (small batch
//! limits). The daemon is SIGKILLed once part of them is written (the read model half old,
//! half new: `refract verify` fails then), restarted, and `refract verify` must find every
//! document equal to the tables: a batch cut inside the emission never checkpoints the
//! transaction's end, and the state it removed dirty marks from is rolled back.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::documents::{catch_up, fresh_schema, pipeline_file, verify};
use common::pg::{Cleanup, psql, url};
use common::*;

/// Books of the one author (every book): large enough that its documents leave in many
/// batches, small enough for CI.
fn books() -> u64 {
    if in_ci() { 4_000 } else { 40_000 }
}

/// `[pipeline.batch] max_events` of the test's pipeline: a transaction's documents leave in
/// batches of at most four times this (`TRANSACTION_BATCH_FACTOR`).
const MAX_EVENTS: u64 = 100;

/// How long a round waits for its documents to be partly written, then all written.
const ROUND_LIMIT: Duration = Duration::from_secs(300);

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

/// Runs the daemon, commits `change` (one transaction), SIGKILLs the daemon once `written` (a
/// count of documents showing the change) is above zero and below `books`; returns whether
/// the kill landed there (false: the emission ended between two looks).
fn kill_during_emission(pipeline: &Path, change: &str, written: &str, books: u64) -> bool {
    let mut client = postgres::Client::connect(&url(), postgres::NoTls).unwrap();
    let mut daemon = quiet_daemon(pipeline);
    client.batch_execute(change).unwrap();
    let deadline = Instant::now() + ROUND_LIMIT;
    loop {
        let n: i64 = client.query_one(written, &[]).unwrap().get(0);
        let n = n as u64;
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
    let _cleanup = Cleanup::new(schema, &[]);
    fresh_schema(schema);
    seed(schema, books);
    let dir = tempfile::tempdir().unwrap();
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
