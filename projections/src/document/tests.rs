//! Table-driven tests of the document projection: the authors/books documents of the showcase
//! (`/work/shared/showcase/authors_books.sql`) and customers with their recent orders.

use refract_schemas::config::{ProjectionConfig, load_str};
use refract_schemas::{Offset, Position};
use serde_json::{Value, json};

use super::*;
use crate::state::MemoryStore;
use crate::test_support::{end_all, event};

/// The shipped author and book documents (`pipelines/authors-books.toml`), and customers with
/// their five most recent orders.
pub(super) const PIPELINE: &str = concat!(
    include_str!("../../../pipelines/authors-books.toml"),
    r#"
[projections.customer_docs]
kind = "document"
table = "public.customers"
sinks = ["target"]
fields = [{ name = "id", from = "id" }, { name = "name", from = "name" }]

[[projections.customer_docs.embeds]]
name = "recentOrders"
table = "public.orders"
foreign_key = "customer_id"
order_by = ["-created_at"]
limit = 5
count = "orderCount"
fields = [{ name = "id", from = "id" }, { name = "total", from = "total_cents" }]
"#
);

/// The configuration of projection `name` in [`PIPELINE`].
pub(super) fn config(name: &str) -> DocumentProjectionConfig {
    let loaded =
        load_str("authors-books.toml", PIPELINE, &|_| None, None).expect("the pipeline loads");
    match &loaded.config.projections[name] {
        ProjectionConfig::Document(d) => d.clone(),
        other => panic!("{other:?}"),
    }
}

/// A projection of [`PIPELINE`] with a fresh in-memory store.
pub(super) fn projection(name: &str) -> DocumentProjection {
    let mut p = DocumentProjection::new(&config(name));
    assert!(p.wants_store());
    p.attach_store(Box::new(MemoryStore::new()));
    p
}

/// A change of `public.{table}`.
pub(super) fn change(table: &str, op: &str, before: Value, after: Value) -> ChangeEvent {
    event(json!({"before": before, "after": after, "op": op,
                 "source": {"schema": "public", "table": table}}))
}

fn c(table: &str, row: Value) -> ChangeEvent {
    change(table, "c", Value::Null, row)
}

fn u(table: &str, row: Value) -> ChangeEvent {
    change(table, "u", Value::Null, row)
}

fn d(table: &str, key: Value) -> ChangeEvent {
    change(table, "d", key, Value::Null)
}

fn t(table: &str) -> ChangeEvent {
    change(table, "t", Value::Null, Value::Null)
}

fn author(id: &str, first: &str, last: &str, thumbnail: Option<&str>) -> Value {
    json!({"id": id, "first_name": first, "last_name": last, "thumbnail_url": thumbnail,
           "profile_url": format!("https://img/{id}/profile"), "large_url": null,
           "updated_at": "2026-01-01T00:00:00Z"})
}

fn book(id: &str, name: &str) -> Value {
    json!({"id": id, "name": name, "published_on": "2020-01-01", "updated_at": "2026-01-01T00:00:00Z"})
}

fn link(book: &str, author: &str, position: i64) -> Value {
    json!({"book_id": book, "author_id": author, "position": position})
}

/// The operations in a comparable form: `{"upsert": "collection/key", "doc": …}`,
/// `{"delete": "collection/key"}`, `{"truncate": "collection"}`.
pub(super) fn render(ops: &[WriteOp]) -> Vec<Value> {
    ops.iter()
        .map(|op| match op {
            WriteOp::Document(DocumentOp::Upsert {
                collection,
                key,
                doc,
                ..
            }) => json!({"upsert": format!("{collection}/{key}"), "doc": **doc}),
            WriteOp::Document(DocumentOp::Delete {
                collection, key, ..
            }) => json!({"delete": format!("{collection}/{key}")}),
            WriteOp::Document(DocumentOp::Truncate { collection, .. }) => {
                json!({"truncate": **collection})
            }
            other => panic!("a document projection emitted {other:?}"),
        })
        .collect()
}

pub(super) fn end_position(n: u64) -> Position {
    Position {
        partition: "p".into(),
        offset: Offset(n, u64::MAX),
    }
}

/// Projects one transaction into each projection, in order; their operations, concatenated.
pub(super) fn transaction(
    projections: &mut [DocumentProjection],
    events: &[ChangeEvent],
) -> Vec<Value> {
    let mut all = Vec::new();
    for p in projections.iter_mut() {
        let mut out = Vec::new();
        for e in events {
            if p.reads(&e.table) {
                p.project(e, 0, &mut out).expect("the event projects");
            }
        }
        // Two documents a call: the tables' transactions end in several calls.
        end_all(p, &end_position(9), 2, &mut out).expect("the transaction ends");
        all.extend(render(&out));
    }
    all
}

/// Three authors (`a3` without books), three books, `b1` by `a2` then `a1`.
fn fixture() -> Vec<ChangeEvent> {
    vec![
        c(
            "authors",
            author("a1", "Thomas", "Andersen", Some("https://img/a1/t")),
        ),
        c("authors", author("a2", "Jane", "Doe", None)),
        c(
            "authors",
            author("a3", "Ann", "Lee", Some("https://img/a3/t")),
        ),
        c("books", book("b1", "Azure Cosmos DB 101")),
        c("books", book("b2", "Rust")),
        c("books", book("b3", "Go")),
        c("book_authors", link("b1", "a1", 1)),
        c("book_authors", link("b1", "a2", 0)),
        c("book_authors", link("b2", "a1", 0)),
        c("book_authors", link("b3", "a2", 0)),
    ]
}

fn thomas() -> Value {
    json!({"id": "a1", "name": "Thomas Andersen", "thumbnailUrl": "https://img/a1/t"})
}

fn jane() -> Value {
    json!({"id": "a2", "name": "Jane Doe", "thumbnailUrl": null})
}

fn book_doc(id: &str, name: &str, authors: Vec<Value>) -> Value {
    json!({"upsert": format!("book_docs/{id}"), "doc": {"id": id, "name": name, "authors": authors}})
}

fn author_doc(id: &str, first: &str, last: &str, books: &[&str], thumbnail: bool) -> Value {
    let mut images = Vec::new();
    if thumbnail {
        images.push(json!({"thumbnail": format!("https://img/{id}/t")}));
    }
    images.push(json!({"profile": format!("https://img/{id}/profile")}));
    json!({"upsert": format!("author_docs/{id}"), "doc": {
        "id": id, "firstName": first, "lastName": last,
        "countOfBooks": books.len(), "books": books, "images": images}})
}

fn a1(books: &[&str]) -> Value {
    author_doc("a1", "Thomas", "Andersen", books, true)
}

fn a2(books: &[&str]) -> Value {
    author_doc("a2", "Jane", "Doe", books, false)
}

#[test]
fn the_fixture_makes_the_showcase_documents() {
    let mut ps = [projection("book_docs"), projection("author_docs")];
    let got = transaction(&mut ps, &fixture());
    let want = vec![
        book_doc("b1", "Azure Cosmos DB 101", vec![jane(), thomas()]),
        book_doc("b2", "Rust", vec![thomas()]),
        book_doc("b3", "Go", vec![jane()]),
        a1(&["b1", "b2"]),
        a2(&["b1", "b3"]),
        author_doc("a3", "Ann", "Lee", &[], true),
    ];
    assert_eq!(got, want);
    // The showcase's author document, field for field.
    assert_eq!(
        got[3]["doc"],
        json!({"id": "a1", "firstName": "Thomas", "lastName": "Andersen", "countOfBooks": 2,
               "books": ["b1", "b2"],
               "images": [{"thumbnail": "https://img/a1/t"}, {"profile": "https://img/a1/profile"}]})
    );
}

#[test]
fn table() {
    // A delete known by its record key alone (no before image at all).
    let key_only = |table: &str, key: Value| {
        let mut e = d(table, key.clone());
        e.before = None;
        e.key = Some(std::sync::Arc::new(key.as_object().unwrap().clone().into()));
        e
    };
    let cases: Vec<(&str, Vec<Vec<ChangeEvent>>, Vec<Value>)> = vec![
        (
            "author insert: its document, no book changes",
            vec![vec![c("authors", author("a4", "Mo", "Ng", None))]],
            vec![author_doc("a4", "Mo", "Ng", &[], false)],
        ),
        (
            "book insert: its document without authors",
            vec![vec![c("books", book("b4", "Zig"))]],
            vec![book_doc("b4", "Zig", vec![])],
        ),
        (
            "book rename: the book only (author documents list ids)",
            vec![vec![u("books", book("b2", "Rust 2"))]],
            vec![book_doc("b2", "Rust 2", vec![thomas()])],
        ),
        (
            "unused columns change: nothing",
            vec![vec![
                u(
                    "books",
                    json!({"id": "b1", "name": "Azure Cosmos DB 101", "published_on": "1999-01-01", "updated_at": "x"}),
                ),
                u(
                    "authors",
                    json!({"id": "a3", "first_name": "Ann", "last_name": "Lee", "thumbnail_url": "https://img/a3/t",
                                    "profile_url": "https://img/a3/profile", "large_url": null, "updated_at": "y"}),
                ),
                change("books", "r", Value::Null, book("b3", "Go")),
            ]],
            vec![],
        ),
        (
            "profile change: the author only (books embed no profile)",
            vec![vec![u(
                "authors",
                json!({"id": "a1", "first_name": "Thomas", "last_name": "Andersen",
                                          "thumbnail_url": "https://img/a1/t", "profile_url": null, "large_url": "L"}),
            )]],
            vec![
                json!({"upsert": "author_docs/a1", "doc": {"id": "a1", "firstName": "Thomas", "lastName": "Andersen",
                        "countOfBooks": 2, "books": ["b1", "b2"],
                        "images": [{"thumbnail": "https://img/a1/t"}, {"large": "L"}]}}),
            ],
        ),
        (
            "author rename reaches every book listing it, and no other",
            vec![vec![u(
                "authors",
                author("a1", "Tom", "Andersen", Some("https://img/a1/t")),
            )]],
            vec![
                book_doc(
                    "b1",
                    "Azure Cosmos DB 101",
                    vec![
                        jane(),
                        json!({"id": "a1", "name": "Tom Andersen", "thumbnailUrl": "https://img/a1/t"}),
                    ],
                ),
                book_doc(
                    "b2",
                    "Rust",
                    vec![
                        json!({"id": "a1", "name": "Tom Andersen", "thumbnailUrl": "https://img/a1/t"}),
                    ],
                ),
                author_doc("a1", "Tom", "Andersen", &["b1", "b2"], true),
            ],
        ),
        (
            "link insert: the book and the author",
            vec![vec![c("book_authors", link("b2", "a2", 1))]],
            vec![
                book_doc("b2", "Rust", vec![thomas(), jane()]),
                a2(&["b1", "b2", "b3"]),
            ],
        ),
        (
            "link delete carrying only its key",
            vec![vec![d(
                "book_authors",
                json!({"book_id": "b1", "author_id": "a1"}),
            )]],
            vec![
                book_doc("b1", "Azure Cosmos DB 101", vec![jane()]),
                a1(&["b2"]),
            ],
        ),
        (
            "authors reordered: the book only",
            vec![vec![u("book_authors", link("b1", "a1", -1))]],
            vec![book_doc(
                "b1",
                "Azure Cosmos DB 101",
                vec![thomas(), jane()],
            )],
        ),
        (
            "equal positions order by author id",
            vec![vec![u("book_authors", link("b1", "a1", 0))]],
            vec![book_doc(
                "b1",
                "Azure Cosmos DB 101",
                vec![thomas(), jane()],
            )],
        ),
        (
            "author delete without cascade events: gone from every book",
            vec![vec![d("authors", json!({"id": "a1"}))]],
            vec![
                book_doc("b1", "Azure Cosmos DB 101", vec![jane()]),
                book_doc("b2", "Rust", vec![]),
                json!({"delete": "author_docs/a1"}),
            ],
        ),
        (
            "author delete with cascade events: each document once",
            vec![vec![
                d("book_authors", json!({"book_id": "b1", "author_id": "a1"})),
                d("book_authors", json!({"book_id": "b2", "author_id": "a1"})),
                d("authors", json!({"id": "a1"})),
            ]],
            vec![
                book_doc("b1", "Azure Cosmos DB 101", vec![jane()]),
                book_doc("b2", "Rust", vec![]),
                json!({"delete": "author_docs/a1"}),
            ],
        ),
        (
            "book delete with cascade events: deleted, gone from its authors, counts follow",
            vec![vec![
                d("book_authors", json!({"book_id": "b1", "author_id": "a1"})),
                d("book_authors", json!({"book_id": "b1", "author_id": "a2"})),
                d("books", json!({"id": "b1"})),
            ]],
            vec![json!({"delete": "book_docs/b1"}), a1(&["b2"]), a2(&["b3"])],
        ),
        (
            "book delete without cascade events, by record key",
            vec![vec![key_only("books", json!({"id": "b1"}))]],
            vec![json!({"delete": "book_docs/b1"}), a1(&["b2"]), a2(&["b3"])],
        ),
        (
            "one transaction touching a document many times emits it once",
            vec![vec![
                u("authors", author("a1", "T", "A", Some("https://img/a1/t"))),
                u(
                    "authors",
                    author("a1", "Thomas", "A", Some("https://img/a1/t")),
                ),
                u("book_authors", link("b1", "a1", -1)),
                c("book_authors", link("b2", "a2", 5)),
                u("books", book("b1", "Azure")),
                u("books", book("b1", "Azure Cosmos DB 101")),
            ]],
            vec![
                book_doc(
                    "b1",
                    "Azure Cosmos DB 101",
                    vec![
                        json!({"id": "a1", "name": "Thomas A", "thumbnailUrl": "https://img/a1/t"}),
                        jane(),
                    ],
                ),
                book_doc(
                    "b2",
                    "Rust",
                    vec![
                        json!({"id": "a1", "name": "Thomas A", "thumbnailUrl": "https://img/a1/t"}),
                        jane(),
                    ],
                ),
                author_doc("a1", "Thomas", "A", &["b1", "b2"], true),
                a2(&["b1", "b2", "b3"]),
            ],
        ),
        (
            "children before their parent and link",
            vec![
                vec![c("book_authors", link("b9", "a9", 0))],
                vec![c("authors", author("a9", "Al", "Z", None))],
                vec![c("books", book("b9", "Late"))],
            ],
            vec![
                book_doc(
                    "b9",
                    "Late",
                    vec![json!({"id": "a9", "name": "Al Z", "thumbnailUrl": null})],
                ),
                author_doc("a9", "Al", "Z", &["b9"], false),
            ],
        ),
        (
            "book key change: old deleted, new without the old links",
            vec![vec![change(
                "books",
                "u",
                json!({"id": "b2"}),
                book("b4", "Rust"),
            )]],
            vec![
                json!({"delete": "book_docs/b2"}),
                book_doc("b4", "Rust", vec![]),
                a1(&["b1"]),
            ],
        ),
        (
            "link moved to another author",
            vec![vec![change(
                "book_authors",
                "u",
                json!({"book_id": "b2", "author_id": "a1"}),
                link("b2", "a3", 0),
            )]],
            vec![
                book_doc(
                    "b2",
                    "Rust",
                    vec![
                        json!({"id": "a3", "name": "Ann Lee", "thumbnailUrl": "https://img/a3/t"}),
                    ],
                ),
                a1(&["b1"]),
                author_doc("a3", "Ann", "Lee", &["b2"], true),
            ],
        ),
        (
            "root truncate empties the collection; rows re-created follow it",
            vec![vec![t("books"), c("books", book("b2", "Rust"))]],
            vec![
                json!({"truncate": "book_docs"}),
                book_doc("b2", "Rust", vec![thomas()]),
                a1(&["b2"]),
                a2(&[]),
            ],
        ),
        (
            "link truncate: every document that listed a link",
            vec![vec![t("book_authors")]],
            vec![
                book_doc("b1", "Azure Cosmos DB 101", vec![]),
                book_doc("b2", "Rust", vec![]),
                book_doc("b3", "Go", vec![]),
                a1(&[]),
                a2(&[]),
            ],
        ),
        (
            "author truncate",
            vec![vec![t("authors")]],
            vec![
                book_doc("b1", "Azure Cosmos DB 101", vec![]),
                book_doc("b2", "Rust", vec![]),
                book_doc("b3", "Go", vec![]),
                json!({"truncate": "author_docs"}),
            ],
        ),
        (
            "delete of a row never seen: its document goes (idempotent), nothing else",
            vec![vec![
                d("books", json!({"id": "b7"})),
                d("book_authors", link("b7", "a1", 0)),
            ]],
            vec![json!({"delete": "book_docs/b7"})],
        ),
    ];
    for (name, transactions, want) in cases {
        let mut ps = [projection("book_docs"), projection("author_docs")];
        transaction(&mut ps, &fixture());
        let mut got = Vec::new();
        for events in &transactions {
            got = transaction(&mut ps, events);
        }
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn customers_list_their_five_most_recent_orders() {
    let order = |id: &str, customer: &str, day: u32| {
        json!({"id": id, "customer_id": customer, "created_at": format!("2026-01-{day:02}T00:00:00Z"),
               "total_cents": day * 100, "note": "n"})
    };
    let customer = |id: &str, recent: &[(&str, u32)], count: usize| {
        let orders: Vec<Value> = recent
            .iter()
            .map(|(o, day)| json!({"id": o, "total": day * 100}))
            .collect();
        json!({"upsert": format!("customer_docs/{id}"), "doc": {
            "id": id, "name": id.to_uppercase(), "recentOrders": orders, "orderCount": count}})
    };
    let setup: Vec<ChangeEvent> = [
        c("customers", json!({"id": "c1", "name": "C1"})),
        c("customers", json!({"id": "c2", "name": "C2"})),
    ]
    .into_iter()
    .chain((1..=7).map(|day| c("orders", order(&format!("o{day}"), "c1", day))))
    .collect();
    let c1_all = [("o7", 7), ("o6", 6), ("o5", 5), ("o4", 4), ("o3", 3)];
    let cases: Vec<(&str, Vec<ChangeEvent>, Vec<Value>)> = vec![
        (
            "setup: the five most recent of seven, newest first",
            vec![],
            vec![customer("c1", &c1_all, 7), customer("c2", &[], 0)],
        ),
        (
            "an old order changes: listed set unchanged, but the document is rebuilt",
            vec![u(
                "orders",
                json!({"id": "o1", "customer_id": "c1", "created_at": "2026-01-01T00:00:00Z", "total_cents": 1, "note": "n"}),
            )],
            vec![customer("c1", &c1_all, 7)],
        ),
        (
            "an unused column changes: nothing",
            vec![u(
                "orders",
                json!({"id": "o7", "customer_id": "c1", "created_at": "2026-01-07T00:00:00Z", "total_cents": 700, "note": "changed"}),
            )],
            vec![],
        ),
        (
            "an order moves to another customer",
            vec![u("orders", order("o7", "c2", 7))],
            vec![
                customer(
                    "c1",
                    &[("o6", 6), ("o5", 5), ("o4", 4), ("o3", 3), ("o2", 2)],
                    6,
                ),
                customer("c2", &[("o7", 7)], 1),
            ],
        ),
        (
            "a delete carrying only the key",
            vec![d("orders", json!({"id": "o6"}))],
            vec![customer(
                "c1",
                &[("o7", 7), ("o5", 5), ("o4", 4), ("o3", 3), ("o2", 2)],
                6,
            )],
        ),
        (
            "an order of a customer not seen yet, then the customer",
            vec![
                c("orders", order("o9", "c9", 9)),
                c("customers", json!({"id": "c9", "name": "C9"})),
            ],
            vec![customer("c9", &[("o9", 9)], 1)],
        ),
        (
            "customer delete: its document goes, its orders stay mirrored",
            vec![d("customers", json!({"id": "c2"}))],
            vec![json!({"delete": "customer_docs/c2"})],
        ),
        (
            "orders truncate: the customers that had orders",
            vec![t("orders")],
            vec![customer("c1", &[], 0)],
        ),
    ];
    for (name, events, want) in cases {
        let mut ps = [projection("customer_docs")];
        let got = transaction(&mut ps, &setup);
        let got = if events.is_empty() {
            got
        } else {
            transaction(&mut ps, &events)
        };
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn upserts_carry_the_transaction_end_and_bad_events_are_reported() {
    let mut p = projection("book_docs");
    let mut out = Vec::new();
    p.project(&c("books", book("b1", "x")), 0, &mut out)
        .unwrap();
    assert!(out.is_empty(), "nothing before the end of the transaction");
    end_all(&mut p, &end_position(42), 1, &mut out).unwrap();
    assert!(
        matches!(&out[..], [WriteOp::Document(DocumentOp::Upsert { position, .. })] if *position == end_position(42))
    );
    out.clear();
    end_all(&mut p, &end_position(43), 1, &mut out).unwrap();
    assert!(out.is_empty(), "marks are cleared");

    let err = p.project(&c("books", json!({"name": "no id"})), 0, &mut out);
    assert!(
        matches!(err, Err(ProjectionError::MissingKey { .. })),
        "{err:?}"
    );
    let mut no_key = d("books", json!({"id": "b1"}));
    no_key.before = None;
    let err = p.project(&no_key, 0, &mut out);
    assert!(
        matches!(err, Err(ProjectionError::MissingKey { .. })),
        "{err:?}"
    );

    let mut bare = DocumentProjection::new(&config("book_docs"));
    let err = bare.project(&c("books", book("b1", "x")), 0, &mut out);
    assert!(
        matches!(&err, Err(ProjectionError::State(m)) if m.contains("attach")),
        "{err:?}"
    );
}

#[test]
fn reads_its_tables_and_needs_no_before_image() {
    let p = projection("book_docs");
    for (table, read) in [
        ("books", true),
        ("authors", true),
        ("book_authors", true),
        ("orders", false),
    ] {
        let id = TableId::new("public", table);
        assert_eq!(p.reads(&id), read, "{table}");
        assert!(p.before_image_columns(&id).is_empty());
    }
    assert!(!p.reads(&TableId::new("other", "books")));
}

/// A store shared with the test, to look inside it after the projection ran.
#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<MemoryStore>>);

impl StateStore for Shared {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, crate::state::StateError> {
        self.0.lock().unwrap().get(key)
    }
    fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), crate::state::StateError> {
        self.0.lock().unwrap().put(key, value)
    }
    fn remove(&mut self, key: &[u8]) -> Result<(), crate::state::StateError> {
        self.0.lock().unwrap().remove(key)
    }
    fn scan_prefix(
        &mut self,
        prefix: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), crate::state::StateError> {
        self.0.lock().unwrap().scan_prefix(prefix, visit)
    }
}

#[test]
fn dirty_marks_live_in_the_store_and_deleted_rows_leave_nothing_behind() {
    let store = Shared::default();
    let mut p = DocumentProjection::new(&config("book_docs"));
    p.attach_store(Box::new(store.clone()));
    let mut out = Vec::new();
    for e in fixture() {
        p.project(&e, 0, &mut out).unwrap();
    }
    // Three books marked, in the store (a crash before the end loses no mark).
    assert_eq!(store.0.lock().unwrap().count_prefix(b"d"), 3);
    // A restarted projection on the same store finishes the transaction.
    let mut restarted = DocumentProjection::new(&config("book_docs"));
    restarted.attach_store(Box::new(store.clone()));
    end_all(&mut restarted, &end_position(1), 2, &mut out).unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(store.0.lock().unwrap().count_prefix(b"d"), 0);
    // Mirrored rows: 3 authors, 3 books, 4 links; index entries: 2 per link.
    assert_eq!(store.0.lock().unwrap().count_prefix(b"m"), 10);
    assert_eq!(store.0.lock().unwrap().count_prefix(b"i"), 8);
    let deletes = [
        d("book_authors", json!({"book_id": "b1", "author_id": "a1"})),
        d("book_authors", json!({"book_id": "b1", "author_id": "a2"})),
        d("book_authors", json!({"book_id": "b2", "author_id": "a1"})),
        d("book_authors", json!({"book_id": "b3", "author_id": "a2"})),
        d("books", json!({"id": "b1"})),
        d("books", json!({"id": "b2"})),
        d("books", json!({"id": "b3"})),
        d("authors", json!({"id": "a1"})),
        d("authors", json!({"id": "a2"})),
        d("authors", json!({"id": "a3"})),
    ];
    for e in &deletes {
        restarted.project(e, 0, &mut out).unwrap();
    }
    end_all(&mut restarted, &end_position(2), 2, &mut out).unwrap();
    // Only the configuration fingerprint is left.
    assert_eq!(store.0.lock().unwrap().len(), 1);

    // Another shape on the same store is refused.
    let mut other = DocumentProjection::new(&config("author_docs"));
    other.attach_store(Box::new(store.clone()));
    let err = other.project(&c("books", book("b1", "x")), 0, &mut out);
    assert!(
        matches!(&err, Err(ProjectionError::State(m)) if m.contains("configuration changed")),
        "{err:?}"
    );
}

#[test]
fn values_order_like_postgres() {
    use std::cmp::Ordering::*;
    let cases = [
        (json!(2), json!(10), Less),
        (json!(-1), json!(1.5), Less),
        (json!("b"), json!("a"), Greater),
        (json!(false), json!(true), Less),
        (json!(null), json!(1), Greater),
        (json!(u64::MAX), json!(1), Greater),
        (json!(1), json!("1"), Less),
    ];
    for (a, b, want) in cases {
        assert_eq!(shape::compare(Some(&a), Some(&b)), want, "{a} vs {b}");
    }
    assert_eq!(shape::compare(None, Some(&json!(null))), Equal);
    assert_eq!(
        shape::document_key(&["a:b".into(), "c%".into()]),
        "a%3Ab:c%25"
    );
    assert_eq!(shape::document_key(&["a:b".into()]), "a:b");
}
