//! Denormalized documents with fan-out (`pipelines/authors-books.toml`) against the real
//! PostgreSQL: a random workload over authors, books and their links (renames, link churn,
//! cascading deletes, rolled-back transactions) while the daemon streams, then `refract verify`
//! recomputes every document from the tables and must find them equal; a document tampered with
//! by hand must be named. The same under 20 SIGKILLs.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::documents::{catch_up, fresh_schema, pipeline_file, shipped_pipeline, verify};
use common::pg::{Cleanup, psql, url};
use common::*;

const AUTHORS: u64 = 300;
const BOOKS: u64 = 2_000;
const NAMES: [&str; 8] = [
    "Thomas", "Ana", "Wei", "Olu", "Maya", "Jonas", "Priya", "Lena",
];

/// One random statement over the three tables.
fn operation(rng: &mut Rng, schema: &str) -> String {
    let a = rng.below(AUTHORS);
    let b = rng.below(BOOKS);
    let name = NAMES[rng.below(8) as usize];
    let url = |rng: &mut Rng, kind: &str| {
        if rng.below(3) == 0 {
            "NULL".to_owned()
        } else {
            format!("'https://img/{kind}/{}'", rng.below(1000))
        }
    };
    match rng.below(100) {
        0..=11 => format!(
            "INSERT INTO {schema}.authors (id, first_name, last_name, thumbnail_url, profile_url, large_url) \
             VALUES ('a{a}', '{name}', 'L{a}', {}, {}, {}) ON CONFLICT DO NOTHING",
            url(rng, "t"),
            url(rng, "p"),
            url(rng, "l")
        ),
        12..=26 => format!(
            "UPDATE {schema}.authors SET first_name = '{name}', last_name = 'R{}' WHERE id = 'a{a}'",
            rng.below(1000)
        ),
        27..=31 => format!(
            "UPDATE {schema}.authors SET thumbnail_url = {}, large_url = {} WHERE id = 'a{a}'",
            url(rng, "t"),
            url(rng, "l")
        ),
        32..=34 => format!("DELETE FROM {schema}.authors WHERE id = 'a{a}'"),
        35..=46 => format!(
            "INSERT INTO {schema}.books (id, name) VALUES ('b{b}', 'Book {b}') ON CONFLICT DO NOTHING"
        ),
        47..=51 => format!(
            "UPDATE {schema}.books SET name = 'Book {b} ed. {}' WHERE id = 'b{b}'",
            rng.below(9)
        ),
        52..=54 => format!("DELETE FROM {schema}.books WHERE id = 'b{b}'"),
        55..=79 => format!(
            "INSERT INTO {schema}.book_authors (book_id, author_id, position) \
             SELECT 'b{b}', 'a{a}', {} WHERE EXISTS (SELECT 1 FROM {schema}.books WHERE id = 'b{b}') \
             AND EXISTS (SELECT 1 FROM {schema}.authors WHERE id = 'a{a}') ON CONFLICT DO NOTHING",
            rng.below(4)
        ),
        80..=88 => format!(
            "DELETE FROM {schema}.book_authors WHERE ctid = (SELECT ctid FROM {schema}.book_authors \
             WHERE book_id = 'b{b}' OR author_id = 'a{a}' LIMIT 1)"
        ),
        89..=95 => format!(
            "UPDATE {schema}.book_authors SET position = {} WHERE book_id = 'b{b}'",
            rng.below(4)
        ),
        // A column no document uses.
        _ => format!("UPDATE {schema}.books SET updated_at = now() WHERE id = 'b{b}'"),
    }
}

/// Runs `operations` random statements in transactions of 1 to 6 statements (one in twenty
/// rolled back); a short pause every `pause_every` transactions.
fn workload(schema: &str, seed: u64, operations: u64, pause_every: u64) {
    let mut client = postgres::Client::connect(&url(), postgres::NoTls).unwrap();
    let mut rng = Rng::new(seed);
    let mut done = 0;
    let mut transactions = 0u64;
    while done < operations {
        let size = 1 + rng.below(6);
        let mut sql = String::from("BEGIN;");
        for _ in 0..size {
            sql.push_str(&operation(&mut rng, schema));
            sql.push(';');
        }
        sql.push_str(if rng.below(20) == 0 {
            "ROLLBACK;"
        } else {
            "COMMIT;"
        });
        client.batch_execute(&sql).unwrap();
        done += size;
        transactions += 1;
        if pause_every > 0 && transactions.is_multiple_of(pause_every) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The initial rows: every author and book, and about three authors per book.
fn seed_rows(schema: &str) {
    psql(&format!(
        "INSERT INTO {schema}.authors (id, first_name, last_name, thumbnail_url, profile_url)
           SELECT 'a' || g, 'First' || g, 'Last' || g, CASE WHEN g % 3 > 0 THEN 'https://img/t/' || g END,
                  CASE WHEN g % 2 = 0 THEN 'https://img/p/' || g END FROM generate_series(0, {}) g;
         INSERT INTO {schema}.books (id, name) SELECT 'b' || g, 'Book ' || g FROM generate_series(0, {}) g;
         INSERT INTO {schema}.book_authors SELECT 'b' || g, 'a' || ((g * 7 + k * 13) % {AUTHORS}), k
           FROM generate_series(0, {}) g, generate_series(0, 2) k ON CONFLICT DO NOTHING;",
        AUTHORS - 1,
        BOOKS - 1,
        BOOKS - 1
    ));
}

/// Fresh seeded tables in `schema` and the authors-books pipeline on them, caught up (its
/// snapshot read); the slot goes with the returned cleanup.
fn seeded(schema: &str) -> (Cleanup, tempfile::TempDir, PathBuf) {
    let cleanup = Cleanup::new(schema, &[]);
    fresh_schema(schema);
    seed_rows(schema);
    let dir = tempfile::tempdir().unwrap();
    let pipeline = pipeline_file(dir.path(), schema);
    catch_up(&pipeline);
    (cleanup, dir, pipeline)
}

#[test]
fn a_random_workload_streams_into_documents_that_verify_finds_equal_and_tampering_is_named() {
    let schema = "docs_workload";
    // The first run snapshots the tables and builds every document.
    let (_cleanup, _dir, pipeline) = seeded(schema);
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "after the snapshot: {report}");
    // A rolled-back transaction (a rename reaching many books, a new link) leaves no trace.
    psql(&format!(
        "BEGIN; UPDATE {schema}.authors SET first_name = 'Ghost' WHERE id = 'a1';
         INSERT INTO {schema}.book_authors VALUES ('b5', 'a1', 9) ON CONFLICT DO NOTHING; ROLLBACK;
         UPDATE {schema}.books SET name = 'After the rollback' WHERE id = 'b5';"
    ));
    catch_up(&pipeline);
    assert_eq!(
        psql(&format!(
            "SELECT count(*) FROM {schema}_rm.book_docs WHERE doc::text LIKE '%Ghost%' OR \
             (id = 'b5' AND doc->'authors' @> '[{{\"id\": \"a1\"}}]' AND NOT EXISTS \
              (SELECT 1 FROM {schema}.book_authors WHERE book_id = 'b5' AND author_id = 'a1'))"
        )),
        "0"
    );
    assert_eq!(
        psql(&format!(
            "SELECT doc->>'name' FROM {schema}_rm.book_docs WHERE id = 'b5'"
        )),
        "After the rollback"
    );

    let mut daemon = quiet_daemon(&pipeline);
    workload(schema, 0x5eed, 50_000, 0);
    daemon.terminate();
    assert!(daemon.child().wait().unwrap().success());
    catch_up(&pipeline);
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "after 50,000 operations: {report}");
    eprintln!("{report}");
    let books: u64 = psql(&format!("SELECT count(*) FROM {schema}.books"))
        .parse()
        .unwrap();
    let docs: u64 = psql(&format!("SELECT count(*) FROM {schema}_rm.book_docs"))
        .parse()
        .unwrap();
    assert_eq!(books, docs);

    // Tampering by hand: a changed field and a removed document are named.
    let book = psql(&format!(
        "SELECT id FROM {schema}_rm.book_docs WHERE jsonb_array_length(doc->'authors') > 0 ORDER BY id LIMIT 1"
    ));
    let author = psql(&format!(
        "SELECT id FROM {schema}_rm.author_docs ORDER BY id DESC LIMIT 1"
    ));
    psql(&format!(
        "UPDATE {schema}_rm.book_docs SET doc = jsonb_set(doc, '{{authors,0,name}}', '\"Someone Else\"') WHERE id = '{book}';
         DELETE FROM {schema}_rm.author_docs WHERE id = '{author}'"
    ));
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 1, "{report}");
    assert!(
        report.contains(&format!("differing  {book}")) && report.contains("Someone Else"),
        "{report}"
    );
    assert!(report.contains(&format!("missing    {author}")), "{report}");
    assert!(report.contains("book_docs -> target"), "{report}");
}

#[test]
fn documents_survive_sigkills_during_the_workload() {
    let schema = "docs_kill";
    let (_cleanup, _dir, pipeline) = seeded(schema);
    let writer = std::thread::spawn(move || workload(schema, 0xc0ffee, 50_000, 10));
    let mut rng = Rng::new(7);
    let mut kills = 0;
    let mut runs = 0;
    while kills < 20 || !writer.is_finished() {
        runs += 1;
        assert!(runs < 200, "the workload did not end");
        let lifetime = Duration::from_millis(300 + rng.below(1_500));
        if run_and_kill(&pipeline, lifetime) {
            kills += 1;
        }
    }
    writer.join().unwrap();
    catch_up(&pipeline);
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "after {kills} SIGKILLs: {report}");
    eprintln!("{kills} SIGKILLs in {runs} runs; {report}");
}

#[test]
fn customers_keep_their_five_most_recent_orders_through_a_random_workload() {
    let schema = "docs_customers";
    let _cleanup = Cleanup::new(schema, &[]);
    psql(&format!(
        "SET client_min_messages = warning;
         DROP SCHEMA IF EXISTS {schema} CASCADE; DROP SCHEMA IF EXISTS {schema}_rm CASCADE;
         CREATE SCHEMA {schema};
         CREATE TABLE {schema}.customers (id text PRIMARY KEY, name text NOT NULL, email text, tier text);
         CREATE TABLE {schema}.orders (order_id text PRIMARY KEY, user_id text NOT NULL, region text NOT NULL,
             status text NOT NULL, total_amount numeric(12,2) NOT NULL, created_at timestamptz NOT NULL);
         INSERT INTO {schema}.customers SELECT 'U' || g, 'Customer ' || g, 'c' || g || '@example.com', 'gold'
           FROM generate_series(0, 99) g;
         INSERT INTO {schema}.orders SELECT 'ORD-' || g, 'U' || (g % 120), 'EU', 'paid', g * 1.25,
           timestamptz '2026-01-01' + g * interval '1 hour' FROM generate_series(0, 1999) g;"
    ));
    let dir = tempfile::tempdir().unwrap();
    let pipeline = shipped_pipeline(dir.path(), "customer-orders", schema);
    catch_up(&pipeline);
    let mut client = postgres::Client::connect(&url(), postgres::NoTls).unwrap();
    let mut rng = Rng::new(42);
    for _ in 0..3_000 {
        let order = rng.below(2_500);
        let user = rng.below(120);
        let sql = match rng.below(10) {
            0..=3 => format!(
                "INSERT INTO {schema}.orders VALUES ('ORD-{order}', 'U{user}', 'US', 'pending', {}, now() - interval '{} minutes')
                 ON CONFLICT (order_id) DO UPDATE SET status = 'shipped'",
                rng.below(10_000),
                rng.below(100_000)
            ),
            4 | 5 => format!("DELETE FROM {schema}.orders WHERE order_id = 'ORD-{order}'"),
            // An order moves to another customer.
            6 => format!("UPDATE {schema}.orders SET user_id = 'U{user}' WHERE order_id = 'ORD-{order}'"),
            7 => format!("UPDATE {schema}.customers SET name = 'Renamed {}' WHERE id = 'U{user}'", rng.below(99)),
            8 => format!("DELETE FROM {schema}.customers WHERE id = 'U{user}'"),
            _ => format!(
                "INSERT INTO {schema}.customers VALUES ('U{user}', 'New {user}', NULL, 'silver') ON CONFLICT DO NOTHING"
            ),
        };
        client.batch_execute(&sql).unwrap();
    }
    catch_up(&pipeline);
    let (code, report) = verify(&pipeline);
    assert_eq!(code, 0, "{report}");
    // Spot check against SQL: the five newest orders of the customer with the most.
    let user = psql(&format!(
        "SELECT c.id FROM {schema}.customers c JOIN {schema}.orders o ON o.user_id = c.id
         GROUP BY c.id ORDER BY count(*) DESC, c.id LIMIT 1"
    ));
    let want = psql(&format!(
        "SELECT string_agg(order_id, ',') FROM (SELECT order_id FROM {schema}.orders WHERE user_id = '{user}'
         ORDER BY created_at DESC, order_id LIMIT 5) t"
    ));
    let got = psql(&format!(
        "SELECT string_agg(o->>'orderId', ',') FROM {schema}_rm.customer_docs, jsonb_array_elements(doc->'recentOrders') o
         WHERE id = '{user}'"
    ));
    assert_eq!(got, want);
    let count = psql(&format!(
        "SELECT (doc->>'orderCount')::int = (SELECT count(*) FROM {schema}.orders WHERE user_id = '{user}')
         FROM {schema}_rm.customer_docs WHERE id = '{user}'"
    ));
    assert_eq!(count, "t");
}
