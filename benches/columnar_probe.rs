//! A probe for planning, not a product path: how fast a columnar decode of the flatten
//! benchmark's input could be. It reads the same file of Debezium envelopes as
//! benches/parquet_flatten.sh (whole, into memory: its peak RSS is not a figure to compare),
//! parses each line with simd-json into a borrowed value (no owned tree, no event), appends the
//! shipped pipeline's columns straight into Arrow builders on two threads, and writes the three
//! tables (orders, customers with the last occurrence of each customer, order_items) with zstd.
//! No change log, no positions, no compaction, no schema drift, no dead letters: a lower bound
//! for what a columnar fast path in refract would cost.
//!
//! Usage: columnar-probe IN_JSONL OUT_DIR
//! Prints `columnar probe: N docs in S s = R docs/s` and the row count of each table.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::builder::{Int64Builder, StringBuilder, TimestampMicrosecondBuilder};
use arrow_array::{ArrayRef, RecordBatch, UInt32Array};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use simd_json::prelude::*;

/// Microseconds since the epoch of `YYYY-MM-DDTHH:MM:SS[.ffffff]Z`.
fn micros(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        std::str::from_utf8(b.get(r)?).ok()?.parse().ok()
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let frac = match b.get(19) {
        Some(b'.') => {
            let digits = &text[20..text.len() - 1];
            let n: i64 = digits.parse().ok()?;
            n * 10_i64.pow(6u32.saturating_sub(digits.len() as u32))
        }
        _ => 0,
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1_000_000) + frac)
}

#[derive(Default)]
struct Tables {
    order_id: StringBuilder,
    customer_id: StringBuilder,
    status: StringBuilder,
    total_cents: Int64Builder,
    created_at: TimestampMicrosecondBuilder,
    shipping_method: StringBuilder,
    shipping_status: StringBuilder,
    shipping_city: StringBuilder,
    item_count: Int64Builder,
    updated_at: TimestampMicrosecondBuilder,
    // customers, one row per order (deduplicated at the end)
    c_id: StringBuilder,
    c_name: StringBuilder,
    c_email: StringBuilder,
    c_phone: StringBuilder,
    c_city: StringBuilder,
    c_state: StringBuilder,
    // order_items
    i_order: StringBuilder,
    i_line: Int64Builder,
    i_sku: StringBuilder,
    i_qty: Int64Builder,
    i_price: Int64Builder,
}

fn s<'v>(v: Option<&'v simd_json::BorrowedValue<'v>>) -> Option<&'v str> {
    v.and_then(|v| v.as_str())
}

impl Tables {
    fn add(&mut self, line: &mut [u8]) {
        let Ok(envelope) = simd_json::to_borrowed_value(line) else {
            return;
        };
        let Some(after) = envelope.get("after").filter(|a| a.is_object()) else {
            return;
        };
        let doc = after.get("doc");
        let at = |path: &[&str]| {
            let mut v = doc?;
            for p in path {
                v = v.get(*p)?;
            }
            Some(v)
        };
        let id = s(after.get("id"));
        self.order_id.append_option(id);
        let customer = at(&["customer"]);
        let customer_id = s(customer.and_then(|c| c.get("id")));
        self.customer_id.append_option(customer_id);
        self.status.append_option(s(at(&["status"])));
        self.total_cents
            .append_option(at(&["total_cents"]).and_then(|v| v.as_i64()));
        self.created_at
            .append_option(s(at(&["created_at"])).and_then(micros));
        self.shipping_method
            .append_option(s(at(&["shipping", "method"])));
        self.shipping_status
            .append_option(s(at(&["shipping", "status"])));
        self.shipping_city
            .append_option(s(at(&["shipping", "address", "city"])));
        let items = at(&["items"]).and_then(|v| v.as_array());
        self.item_count.append_option(items.map(|i| i.len() as i64));
        self.updated_at
            .append_option(s(after.get("updated_at")).and_then(micros));

        let contact = |field: &str| {
            customer?
                .get("contactDetails")?
                .as_array()?
                .iter()
                .find_map(|c| c.get(field).and_then(|v| v.as_str()))
        };
        self.c_id.append_option(customer_id);
        self.c_name
            .append_option(s(customer.and_then(|c| c.get("name"))));
        self.c_email.append_option(contact("email"));
        self.c_phone.append_option(contact("phone"));
        let billing = customer.and_then(|c| c.get("billingAddress"));
        self.c_city
            .append_option(s(billing.and_then(|b| b.get("city"))));
        self.c_state
            .append_option(s(billing.and_then(|b| b.get("state"))));

        for (n, item) in items.into_iter().flatten().enumerate() {
            self.i_order.append_option(id);
            self.i_line.append_value(n as i64 + 1);
            self.i_sku.append_option(s(item.get("sku")));
            self.i_qty
                .append_option(item.get("qty").and_then(|v| v.as_i64()));
            self.i_price
                .append_option(item.get("unit_price_cents").and_then(|v| v.as_i64()));
        }
    }

    fn finish(mut self) -> [RecordBatch; 3] {
        let ts = |b: &mut TimestampMicrosecondBuilder| -> ArrayRef {
            Arc::new(b.finish().with_timezone("UTC"))
        };
        let orders = RecordBatch::try_from_iter([
            ("order_id", Arc::new(self.order_id.finish()) as ArrayRef),
            ("customer_id", Arc::new(self.customer_id.finish())),
            ("status", Arc::new(self.status.finish())),
            ("total_cents", Arc::new(self.total_cents.finish())),
            ("created_at", ts(&mut self.created_at)),
            ("shipping_method", Arc::new(self.shipping_method.finish())),
            ("shipping_status", Arc::new(self.shipping_status.finish())),
            ("shipping_city", Arc::new(self.shipping_city.finish())),
            ("item_count", Arc::new(self.item_count.finish())),
            ("updated_at", ts(&mut self.updated_at)),
        ])
        .expect("orders");
        let customers = RecordBatch::try_from_iter([
            ("customer_id", Arc::new(self.c_id.finish()) as ArrayRef),
            ("name", Arc::new(self.c_name.finish())),
            ("email", Arc::new(self.c_email.finish())),
            ("phone", Arc::new(self.c_phone.finish())),
            ("billing_city", Arc::new(self.c_city.finish())),
            ("billing_state", Arc::new(self.c_state.finish())),
        ])
        .expect("customers");
        let items = RecordBatch::try_from_iter([
            ("order_id", Arc::new(self.i_order.finish()) as ArrayRef),
            ("line_no", Arc::new(self.i_line.finish())),
            ("sku", Arc::new(self.i_sku.finish())),
            ("qty", Arc::new(self.i_qty.finish())),
            ("unit_price_cents", Arc::new(self.i_price.finish())),
        ])
        .expect("order_items");
        [orders, customers, items]
    }
}

/// The last row of each customer id, across `parts` in order.
fn last_per_customer(parts: &[RecordBatch]) -> RecordBatch {
    let all = arrow_select::concat::concat_batches(&parts[0].schema(), parts).expect("concat");
    let ids = all
        .column(0)
        .as_any()
        .downcast_ref::<arrow_array::StringArray>()
        .expect("customer ids");
    let mut last: HashMap<&str, u32> = HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        if let Some(id) = id {
            last.insert(id, i as u32);
        }
    }
    let mut rows: Vec<u32> = last.into_values().collect();
    rows.sort_unstable();
    arrow_select::take::take_record_batch(&all, &UInt32Array::from(rows)).expect("take")
}

fn write(path: &std::path::Path, batches: &[RecordBatch]) -> usize {
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).expect("level")))
        .build();
    let file = std::fs::File::create(path).expect("output file");
    let mut writer =
        ArrowWriter::try_new(file, batches[0].schema(), Some(props)).expect("parquet writer");
    let mut rows = 0;
    for b in batches {
        writer.write(b).expect("write");
        rows += b.num_rows();
    }
    writer.close().expect("close");
    rows
}

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: columnar-probe IN_JSONL OUT_DIR";
    let input = args.next().expect(usage);
    let out = std::path::PathBuf::from(args.next().expect(usage));
    std::fs::create_dir_all(&out).expect("output directory");
    let start = Instant::now();
    let mut data = std::fs::read(&input).expect("input file");
    // Two halves, split at a line end, one per core.
    let mid = data[data.len() / 2..]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(data.len(), |p| data.len() / 2 + p + 1);
    let (a, b) = data.split_at_mut(mid);
    let decode = |half: &mut [u8]| {
        let mut tables = Tables::default();
        let mut docs = 0;
        for line in half.split_mut(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            tables.add(line);
            docs += 1;
        }
        (docs, tables.finish())
    };
    let ((docs_a, first), (docs_b, second)) = std::thread::scope(|scope| {
        let other = scope.spawn(|| decode(b));
        (decode(a), other.join().expect("decode thread"))
    });
    let [orders_a, customers_a, items_a] = first;
    let [orders_b, customers_b, items_b] = second;
    let customers = last_per_customer(&[customers_a, customers_b]);
    let (orders, items) = std::thread::scope(|scope| {
        let items = scope.spawn(|| write(&out.join("order_items.parquet"), &[items_a, items_b]));
        let orders = write(&out.join("orders.parquet"), &[orders_a, orders_b]);
        (orders, items.join().expect("writer thread"))
    });
    let customers = write(&out.join("customers.parquet"), &[customers]);
    let secs = start.elapsed().as_secs_f64();
    let docs = docs_a + docs_b;
    println!(
        "columnar probe: {docs} docs in {secs:.2} s = {:.0} docs/s",
        docs as f64 / secs
    );
    println!("columnar probe rows: orders {orders}, customers {customers}, order_items {items}");
}
