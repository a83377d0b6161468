//! Writes N Debezium JSON envelopes (the bare `schemas.enable=false` form), one per line, for the
//! decode benchmark: 70% creates, 25% updates with a before image, 5% deletes, on an orders-like
//! table of ten columns. Deterministic for a given N.
//!
//! With `--products`, for the Redis sink benchmark (benches/redis_sink.sh): N updates (op `u`,
//! full old and new rows) of the showcase `public.products` table, each on a product id drawn
//! from 1..=IDS (default 1,000,000); the sku changes in 10% of them, the price in all.
//!
//! With `--orders`, for the flatten-to-Parquet benchmark (benches/parquet_flatten.sh): N creates
//! (op `c`) of the showcase `public.customer_orders` table (`id` text `o1`..`oN`, `doc` a nested
//! JSON object, `updated_at`). Every doc has the same fields: status, created_at (over September
//! 2026), total_cents (the sum of qty * unit_price_cents), customer (one of c1..c100000, with a
//! name, contactDetails `[{email}, {phone, extension}]` and a billingAddress; the same customer
//! always has the same details), shipping (method, status, address) and 1 to 4 items (sku, qty,
//! unit_price_cents).
//!
//! With `--books`, for the document benchmark (benches/documents.sh): N changes of the showcase
//! `public.books` table (`id` text `b0`..`b{IDS-1}`, `name`, `published_on`, `updated_at`), each on
//! an id drawn from the range: a create (op `c`) the first time an id comes up, an update (op `u`,
//! full old and new rows, the name changed) after that.
//!
//! Usage: gen-envelopes N OUTPUT
//!        gen-envelopes --products N OUTPUT [IDS]
//!        gen-envelopes --orders N OUTPUT
//!        gen-envelopes --books N OUTPUT IDS

use std::io::{BufWriter, Write};

use serde_json::json;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--products") {
        return products(std::env::args().skip(2));
    }
    if std::env::args().nth(1).as_deref() == Some("--orders") {
        return orders(std::env::args().skip(2));
    }
    if std::env::args().nth(1).as_deref() == Some("--books") {
        return books(std::env::args().skip(2));
    }
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .expect("usage: gen-envelopes N OUTPUT");
    let path = args.next().expect("usage: gen-envelopes N OUTPUT");
    let mut out = BufWriter::new(std::fs::File::create(&path).expect("output file"));
    let mut next = xorshift(0x2545_F491_4F6C_DD1Du64);
    let statuses = ["pending", "paid", "shipped", "delivered", "cancelled"];
    let row = |id: u64, r: u64| {
        json!({
            "id": id,
            "customer_id": format!("c{}", r % 100_000),
            "status": statuses[(r % 5) as usize],
            "total_cents": r % 1_000_000,
            "currency": "USD",
            "created_at": format!("2026-09-{:02}T{:02}:{:02}:{:02}Z", 1 + r % 28, r % 24, r % 60, (r >> 8) % 60),
            "note": format!("order note {}", r % 9973),
            "qty": 1 + r % 9,
            "weight": (r % 1000) as f64 / 100.0 + 0.5,
            "active": r % 2 == 0,
        })
    };
    for i in 0..n {
        let r = next();
        let id = r % (n / 2 + 1);
        let kind = r % 100;
        let (op, before, after) = if kind < 70 {
            ("c", serde_json::Value::Null, row(id, r))
        } else if kind < 95 {
            ("u", row(id, r >> 3), row(id, r))
        } else {
            ("d", row(id, r >> 3), serde_json::Value::Null)
        };
        write_envelope(
            &mut out,
            Source {
                db: "shop",
                table: "orders",
                i,
                tx: 1000 + i / 10,
            },
            op,
            before,
            after,
        );
    }
    out.flush().expect("flush");
}

/// `--products N OUTPUT [IDS]`: product updates, see the module comment.
fn products(mut args: impl Iterator<Item = String>) {
    const USAGE: &str = "usage: gen-envelopes --products N OUTPUT [IDS]";
    let n: u64 = args.next().and_then(|a| a.parse().ok()).expect(USAGE);
    let path = args.next().expect(USAGE);
    let ids: u64 = args.next().map_or(1_000_000, |a| a.parse().expect(USAGE));
    let mut out = BufWriter::new(std::fs::File::create(&path).expect("output file"));
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15u64);
    let row = |id: u64, sku: &str, price: u64, ts: u64| {
        json!({
            "id": id,
            "tenant_id": format!("t{}", id % 100),
            "sku": sku,
            "name": format!("product {id}"),
            "price_cents": price,
            "updated_at": format!("2026-09-{:02}T{:02}:{:02}:{:02}.{:06}Z", 1 + ts / 86_400 % 28, ts / 3600 % 24, ts / 60 % 60, ts % 60, ts % 1_000_000),
        })
    };
    for i in 0..n {
        let r = next();
        let id = 1 + r % ids;
        let old_sku = format!("SKU-{id:08}");
        let new_sku = if (r >> 32) % 10 == 0 {
            format!("SKU-{id:08}-{i}")
        } else {
            old_sku.clone()
        };
        let price = (r >> 12) % 100_000;
        write_envelope(
            &mut out,
            Source {
                db: "shop",
                table: "products",
                i,
                tx: 1000 + i,
            },
            "u",
            row(id, &old_sku, price, i),
            row(id, &new_sku, price + 1, i + 1),
        );
    }
    out.flush().expect("flush");
}

/// `--books N OUTPUT IDS`: book creates and updates, see the module comment.
fn books(mut args: impl Iterator<Item = String>) {
    const USAGE: &str = "usage: gen-envelopes --books N OUTPUT IDS";
    let n: u64 = args.next().and_then(|a| a.parse().ok()).expect(USAGE);
    let path = args.next().expect(USAGE);
    let ids: u64 = args.next().and_then(|a| a.parse().ok()).expect(USAGE);
    let mut out = BufWriter::new(std::fs::File::create(&path).expect("output file"));
    let mut next = xorshift(0xA076_1D64_78BD_642Fu64);
    // The edition each id is at: 0 before its create.
    let mut editions = vec![0u32; usize::try_from(ids).expect("IDS fits in memory")];
    let row = |id: u64, edition: u32, ts: u64| {
        json!({
            "id": format!("b{id}"),
            "name": format!("Book {id} ed. {edition}"),
            "published_on": format!("20{:02}-{:02}-{:02}", id % 26, 1 + id % 12, 1 + id % 28),
            "updated_at": format!("2026-09-{:02}T{:02}:{:02}:{:02}.{:06}Z", 1 + ts / 86_400 % 28, ts / 3600 % 24, ts / 60 % 60, ts % 60, ts % 1_000_000),
        })
    };
    for i in 0..n {
        let id = next() % ids;
        let edition = &mut editions[id as usize];
        *edition += 1;
        let (op, before) = if *edition == 1 {
            ("c", serde_json::Value::Null)
        } else {
            ("u", row(id, *edition - 1, i))
        };
        write_envelope(
            &mut out,
            Source {
                db: "refract",
                table: "books",
                i,
                tx: 1000 + i,
            },
            op,
            before,
            row(id, *edition, i + 1),
        );
    }
    out.flush().expect("flush");
}

/// `--orders N OUTPUT`: customer order documents, see the module comment.
fn orders(mut args: impl Iterator<Item = String>) {
    const USAGE: &str = "usage: gen-envelopes --orders N OUTPUT";
    const FIRST: [&str; 8] = [
        "Thomas", "Maria", "Aiko", "Lars", "Fatima", "Jonas", "Priya", "Elena",
    ];
    const LAST: [&str; 8] = [
        "Andersen", "Garcia", "Tanaka", "Novak", "Okafor", "Berg", "Sharma", "Rossi",
    ];
    const CITIES: [(&str, &str, &str); 6] = [
        ("Seattle", "WA", "98012"),
        ("Portland", "OR", "97201"),
        ("Austin", "TX", "73301"),
        ("Denver", "CO", "80202"),
        ("Boston", "MA", "02108"),
        ("Chicago", "IL", "60601"),
    ];
    let n: u64 = args.next().and_then(|a| a.parse().ok()).expect(USAGE);
    let path = args.next().expect(USAGE);
    let mut out = BufWriter::new(std::fs::File::create(&path).expect("output file"));
    let mut next = xorshift(0xD1B5_4A32_D192_ED03u64);
    let statuses = ["pending", "paid", "shipped", "delivered", "cancelled"];
    let methods = ["ground", "express", "overnight"];
    let shipping_statuses = ["pending", "in_transit", "delivered"];
    // A timestamp `s` seconds (and `us` microseconds) into September 2026.
    let at = |s: u64, us: Option<u64>| {
        let frac = us.map_or(String::new(), |us| format!(".{us:06}"));
        format!(
            "2026-09-{:02}T{:02}:{:02}:{:02}{frac}Z",
            1 + s / 86_400,
            s / 3600 % 24,
            s / 60 % 60,
            s % 60
        )
    };
    let september = 30 * 86_400;
    for i in 0..n {
        let r = next();
        // The customer's details depend on the customer only.
        let c = 1 + r % 100_000;
        let (city, st, zip) = CITIES[(c % 6) as usize];
        let customer = json!({
            "id": format!("c{c}"),
            "name": format!("{} {}", FIRST[(c % 8) as usize], LAST[(c / 8 % 8) as usize]),
            "contactDetails": [
                {"email": format!("c{c}@example.com")},
                {"phone": format!("+1 555 {:04}", c % 10_000), "extension": 1000 + c % 9000},
            ],
            "billingAddress": {"line1": format!("{} Some Street", 1 + c % 999), "city": city, "state": st, "zip": zip},
        });
        let r2 = next();
        let items: Vec<_> = (0..1 + r2 % 4)
            .map(|k| {
                let x = r2 >> (8 + 12 * k);
                json!({"sku": format!("sku-{}", 1 + x % 10_000), "qty": 1 + (x >> 3) % 5, "unit_price_cents": 100 * (1 + (x >> 6) % 200)})
            })
            .collect();
        let total: u64 = items
            .iter()
            .map(|it| it["qty"].as_u64().unwrap() * it["unit_price_cents"].as_u64().unwrap())
            .sum();
        let (ship_city, ship_st, ship_zip) = CITIES[((r >> 20) % 6) as usize];
        let created = (r >> 24) % september;
        let updated = (created + (r >> 40) % 86_400).min(september - 1);
        let doc = json!({
            "status": statuses[((r >> 17) % 5) as usize],
            "created_at": at(created, None),
            "total_cents": total,
            "customer": customer,
            "shipping": {
                "method": methods[((r >> 33) % 3) as usize],
                "status": shipping_statuses[((r >> 36) % 3) as usize],
                "address": {"line1": format!("{} Main St", 1 + (r >> 44) % 999), "city": ship_city, "state": ship_st, "zip": ship_zip},
            },
            "items": items,
        });
        write_envelope(
            &mut out,
            Source {
                db: "refract",
                table: "customer_orders",
                i,
                tx: 1000 + i / 10,
            },
            "c",
            serde_json::Value::Null,
            json!({"id": format!("o{}", i + 1), "doc": doc, "updated_at": at(updated, Some((r >> 8) % 1_000_000))}),
        );
    }
    out.flush().expect("flush");
}

/// Where an envelope's change happened: database, table, its number `i` in the file and its
/// transaction id.
struct Source {
    db: &'static str,
    table: &'static str,
    i: u64,
    tx: u64,
}

/// Writes one Debezium envelope line (PostgreSQL connector source block) to `out`.
fn write_envelope(
    out: &mut impl Write,
    source: Source,
    op: &str,
    before: serde_json::Value,
    after: serde_json::Value,
) {
    let Source { db, table, i, tx } = source;
    let envelope = json!({
        "before": before,
        "after": after,
        "op": op,
        "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "bench", "ts_ms": 1_790_000_000_000u64 + i,
                   "snapshot": "false", "db": db, "schema": "public", "table": table, "txId": tx, "lsn": 40_000_000 + i * 200},
        "ts_ms": 1_790_000_000_000u64 + i + 5,
    });
    serde_json::to_writer(&mut *out, &envelope).expect("write");
    out.write_all(b"\n").expect("write");
}

/// A deterministic xorshift64 stream from `seed`: the same file for the same arguments.
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
