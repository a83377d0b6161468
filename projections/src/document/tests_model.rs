//! A randomized test: random transactions over authors, books and their links, applied to a
//! plain model of the three tables and to the projections; after each transaction the documents
//! written so far must equal the documents computed from scratch over the model.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::tests::{change, end_position, projection, render};
use super::*;
use crate::test_support::end_all;

/// xorshift64*: a fixed-seed stream, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

const AUTHORS: &[&str] = &["a0", "a1", "a2", "a3"];
const BOOKS: &[&str] = &["b0", "b1", "b2", "b3", "b4"];

/// The three tables.
#[derive(Default)]
struct Model {
    authors: BTreeMap<String, Value>,
    books: BTreeMap<String, Value>,
    /// (book, author) to position.
    links: BTreeMap<(String, String), i64>,
}

impl Model {
    /// The book document, computed from scratch.
    fn book_doc(&self, id: &str) -> Option<Value> {
        let book = self.books.get(id)?;
        let mut authors: Vec<(i64, &String, &Value)> = self
            .links
            .iter()
            .filter(|((b, _), _)| b == id)
            .filter_map(|((_, a), pos)| Some((*pos, a, self.authors.get(a)?)))
            .collect();
        authors.sort_by(|x, y| (x.0, x.1).cmp(&(y.0, y.1)));
        let authors: Vec<Value> = authors
            .into_iter()
            .map(|(_, a, row)| {
                json!({"id": a,
                       "name": format!("{} {}", row["first_name"].as_str().unwrap(), row["last_name"].as_str().unwrap()),
                       "thumbnailUrl": row["thumbnail_url"]})
            })
            .collect();
        Some(json!({"id": id, "name": book["name"], "authors": authors}))
    }

    /// The author document, computed from scratch.
    fn author_doc(&self, id: &str) -> Option<Value> {
        let row = self.authors.get(id)?;
        let books: Vec<&String> = self
            .links
            .keys()
            .filter(|(b, a)| a == id && self.books.contains_key(b))
            .map(|(b, _)| b)
            .collect();
        let images: Vec<Value> = [
            ("thumbnail", "thumbnail_url"),
            ("profile", "profile_url"),
            ("large", "large_url"),
        ]
        .into_iter()
        .filter(|(_, column)| !row[*column].is_null())
        .map(|(name, column)| json!({name: row[column]}))
        .collect();
        Some(
            json!({"id": id, "firstName": row["first_name"], "lastName": row["last_name"],
                    "countOfBooks": books.len(), "books": books, "images": images}),
        )
    }

    /// Every document, by `collection/key`.
    fn documents(&self) -> BTreeMap<String, Value> {
        let mut docs = BTreeMap::new();
        for id in self.books.keys() {
            docs.insert(format!("book_docs/{id}"), self.book_doc(id).unwrap());
        }
        for id in self.authors.keys() {
            docs.insert(format!("author_docs/{id}"), self.author_doc(id).unwrap());
        }
        docs
    }
}

fn maybe(rng: &mut Rng, value: &str) -> Value {
    if rng.below(3) == 0 {
        Value::Null
    } else {
        Value::String(value.to_owned())
    }
}

/// One random operation: its events, applied to the model.
fn operation(rng: &mut Rng, model: &mut Model) -> Vec<ChangeEvent> {
    let mut events = Vec::new();
    match rng.below(100) {
        // Author upsert: names, urls and an unused column vary.
        0..=24 => {
            let id = rng.pick(AUTHORS);
            let row = json!({"id": id, "first_name": rng.pick(&["Tom", "Ann"]), "last_name": rng.pick(&["Lee", "Ng"]),
                             "thumbnail_url": maybe(rng, "t"), "profile_url": maybe(rng, "p"),
                             "large_url": maybe(rng, "l"), "updated_at": rng.below(1000)});
            let op = match (model.authors.contains_key(id), rng.below(4)) {
                (_, 0) => "r",
                (true, _) => "u",
                (false, _) => "c",
            };
            events.push(change("authors", op, Value::Null, row.clone()));
            model.authors.insert(id.to_owned(), row);
        }
        // Book upsert.
        25..=44 => {
            let id = rng.pick(BOOKS);
            let row =
                json!({"id": id, "name": rng.pick(&["Rust", "Go"]), "published_on": rng.below(9)});
            let op = if model.books.contains_key(id) {
                "u"
            } else {
                "c"
            };
            events.push(change("books", op, Value::Null, row.clone()));
            model.books.insert(id.to_owned(), row);
        }
        // Link upsert (its book or author may not exist: nothing enforces it here).
        45..=64 => {
            let (book, author) = (rng.pick(BOOKS), rng.pick(AUTHORS));
            let position = rng.below(3) as i64;
            let key = (book.to_owned(), author.to_owned());
            let op = if model.links.contains_key(&key) {
                "u"
            } else {
                "c"
            };
            let row = json!({"book_id": book, "author_id": author, "position": position});
            events.push(change("book_authors", op, Value::Null, row));
            model.links.insert(key, position);
        }
        // Link delete, by key.
        65..=74 => {
            if let Some((book, author)) = nth_key(rng, &model.links) {
                events.push(link_delete(&book, &author));
                model.links.remove(&(book, author));
            }
        }
        // Link moved to another author (the old row carries the key).
        75..=79 => {
            if let Some((book, author)) = nth_key(rng, &model.links) {
                let to = rng.pick(AUTHORS);
                if !model.links.contains_key(&(book.clone(), to.to_owned())) {
                    let position = model.links.remove(&(book.clone(), author.clone())).unwrap();
                    let before = json!({"book_id": book, "author_id": author});
                    let after = json!({"book_id": book, "author_id": to, "position": position});
                    events.push(change("book_authors", "u", before, after));
                    model.links.insert((book, to.to_owned()), position);
                }
            }
        }
        // Author or book delete, by key, with or without the cascade's link deletes.
        80..=93 => {
            let author = rng.below(2) == 0;
            let ids = if author { AUTHORS } else { BOOKS };
            let id = rng.pick(ids).to_owned();
            if rng.below(2) == 0 {
                let doomed: Vec<(String, String)> = model
                    .links
                    .keys()
                    .filter(|(b, a)| if author { *a == id } else { *b == id })
                    .cloned()
                    .collect();
                for (book, author) in doomed {
                    events.push(link_delete(&book, &author));
                    model.links.remove(&(book, author));
                }
            }
            let (table, rows) = if author {
                ("authors", &mut model.authors)
            } else {
                ("books", &mut model.books)
            };
            if rows.remove(&id).is_some() || rng.below(2) == 0 {
                events.push(change(table, "d", json!({"id": id}), Value::Null));
            }
        }
        // Book key change.
        94..=96 => {
            let free: Vec<&str> = BOOKS
                .iter()
                .copied()
                .filter(|b| !model.books.contains_key(*b))
                .collect();
            if let (Some((from, _)), false) =
                (nth_key(rng, &model.books).map(|k| (k, ())), free.is_empty())
            {
                let to = rng.pick(&free);
                let mut row = model.books.remove(&from).unwrap();
                row["id"] = json!(to);
                events.push(change("books", "u", json!({"id": from}), row.clone()));
                model.books.insert(to.to_owned(), row);
            }
        }
        // Truncate.
        _ => {
            let table = rng.pick(&["authors", "books", "book_authors"]);
            events.push(change(table, "t", Value::Null, Value::Null));
            match table {
                "authors" => model.authors.clear(),
                "books" => model.books.clear(),
                _ => model.links.clear(),
            }
        }
    }
    events
}

fn link_delete(book: &str, author: &str) -> ChangeEvent {
    change(
        "book_authors",
        "d",
        json!({"book_id": book, "author_id": author}),
        Value::Null,
    )
}

fn nth_key<K: Clone, V>(rng: &mut Rng, map: &BTreeMap<K, V>) -> Option<K> {
    if map.is_empty() {
        return None;
    }
    map.keys()
        .nth(rng.below(map.len() as u64) as usize)
        .cloned()
}

#[test]
fn incremental_documents_match_a_from_scratch_computation() {
    for seed in [1u64, 7, 42, 2026] {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut model = Model::default();
        let mut projections = [projection("book_docs"), projection("author_docs")];
        // What a sink holds after applying every emitted operation.
        let mut sink: BTreeMap<String, Value> = BTreeMap::new();
        let mut operations = 0;
        let mut tx = 0u64;
        while operations < 400 {
            tx += 1;
            let mut events = Vec::new();
            for _ in 0..=rng.below(5) {
                events.extend(operation(&mut rng, &mut model));
                operations += 1;
            }
            let mut emitted: Vec<String> = Vec::new();
            for p in &mut projections {
                let mut out = Vec::new();
                for e in &events {
                    if p.reads(&e.table) {
                        p.project(e, 0, &mut out).expect("the event projects");
                    }
                }
                // In chunks of 1 to 3 documents, as the runtime may ask.
                let limit = 1 + rng.below(3) as usize;
                end_all(p, &end_position(tx), limit, &mut out).unwrap();
                for op in render(&out) {
                    let obj: &Map<String, Value> = op.as_object().unwrap();
                    if let Some(collection) = obj.get("truncate").and_then(Value::as_str) {
                        sink.retain(|k, _| !k.starts_with(&format!("{collection}/")));
                        continue;
                    }
                    let (key, doc) = match (obj.get("upsert"), obj.get("delete")) {
                        (Some(k), _) => (k.as_str().unwrap().to_owned(), Some(obj["doc"].clone())),
                        (_, Some(k)) => (k.as_str().unwrap().to_owned(), None),
                        _ => unreachable!(),
                    };
                    assert!(
                        !emitted.contains(&key),
                        "seed {seed} tx {tx}: `{key}` emitted twice in one transaction"
                    );
                    emitted.push(key.clone());
                    // Every emitted document is the one computed from scratch.
                    let want = model.documents().remove(&key);
                    assert_eq!(doc, want, "seed {seed} tx {tx}: `{key}` after {events:#?}");
                    match doc {
                        Some(doc) => sink.insert(key, doc),
                        None => sink.remove(&key),
                    };
                }
            }
            // And no document was missed.
            assert_eq!(
                sink,
                model.documents(),
                "seed {seed} tx {tx}: after {events:#?}"
            );
        }
    }
}
