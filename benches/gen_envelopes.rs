//! Writes N Debezium JSON envelopes (the bare `schemas.enable=false` form), one per line, for the
//! decode benchmark: 70% creates, 25% updates with a before image, 5% deletes, on an orders-like
//! table of ten columns. Deterministic for a given N.
//!
//! With `--products`, for the Redis sink benchmark (benches/redis_sink.sh): N updates (op `u`,
//! full old and new rows) of the showcase `public.products` table, each on a product id drawn
//! from 1..=IDS (default 1,000,000); the sku changes in 10% of them, the price in all.
//!
//! Usage: gen-envelopes N OUTPUT
//!        gen-envelopes --products N OUTPUT [IDS]

use std::io::{BufWriter, Write};

use serde_json::json;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--products") {
        return products(std::env::args().skip(2));
    }
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .expect("usage: gen-envelopes N OUTPUT");
    let path = args.next().expect("usage: gen-envelopes N OUTPUT");
    let mut out = BufWriter::new(std::fs::File::create(&path).expect("output file"));
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
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
        let envelope = json!({
            "before": before,
            "after": after,
            "op": op,
            "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "bench", "ts_ms": 1_790_000_000_000u64 + i,
                       "snapshot": "false", "db": "shop", "schema": "public", "table": "orders", "txId": 1000 + i / 10, "lsn": 40_000_000 + i * 200},
            "ts_ms": 1_790_000_000_000u64 + i + 5,
        });
        serde_json::to_writer(&mut out, &envelope).expect("write");
        out.write_all(b"\n").expect("write");
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
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
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
        let envelope = json!({
            "before": row(id, &old_sku, price, i),
            "after": row(id, &new_sku, price + 1, i + 1),
            "op": "u",
            "source": {"version": "2.7.0.Final", "connector": "postgresql", "name": "bench", "ts_ms": 1_790_000_000_000u64 + i,
                       "snapshot": "false", "db": "shop", "schema": "public", "table": "products", "txId": 1000 + i, "lsn": 40_000_000 + i * 200},
            "ts_ms": 1_790_000_000_000u64 + i + 5,
        });
        serde_json::to_writer(&mut out, &envelope).expect("write");
        out.write_all(b"\n").expect("write");
    }
    out.flush().expect("flush");
}
