"""The pyarrow baseline of benches/parquet_flatten.sh: reads a file of Debezium envelopes of
`public.customer_orders` (gen-envelopes --orders) with pyarrow.json.read_json, flattens the `doc`
of every `after` image into three tables with pyarrow compute only (no per-row Python), and writes
each with pyarrow.parquet.write_table (zstd) into OUT_DIR:
  orders.parquet       one row per order
  customers.parquet    one row per customer_id (its last occurrence in the file wins)
  order_items.parquet  one row per item, line_no 1-based
Prints `pyarrow: ROWS docs in SECS s = RATE docs/s` (ROWS: envelopes read; the time covers the
whole read-flatten-write), `pyarrow peak RSS: X MiB` and `pyarrow CPU: S s` (user + system, the
whole process).

Usage: python3 benches/parquet_flatten.py IN_JSONL OUT_DIR"""
import os
import resource
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

src, out_dir = sys.argv[1], sys.argv[2]
os.makedirs(out_dir, exist_ok=True)

ts = pa.timestamp("us", "UTC")
# Only the timestamps are given (inference would make created_at a naive timestamp[s] and leave
# updated_at, with its fraction, a string); every other field is inferred.
schema = pa.schema([
    ("after", pa.struct([
        ("id", pa.string()),
        ("updated_at", ts),
        ("doc", pa.struct([("created_at", ts)])),
    ])),
])
parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer")


def first_valid(lists, field):
    """Per list (of structs) in `lists`: the first non-null `field` of its elements, or null.
    Returns (parents, values): the list indices that have one, ascending, and their values."""
    flat = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists)
    values = pc.struct_field(flat, field)
    valid = pc.is_valid(values)
    parents, values = parents.filter(valid), values.filter(valid)
    # Elements come in list order, so the first of each run of equal parents is the first valid.
    parents = pa.concat_arrays(parents.chunks) if isinstance(parents, pa.ChunkedArray) else parents
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if len(parents) == 0:
        return parents, values
    starts = pa.concat_arrays([pa.array([True]), pc.not_equal(parents[1:], parents[:-1])])
    return parents.filter(starts), values.filter(starts)


start = time.perf_counter()
table = pj.read_json(src, parse_options=parse)
rows = table.num_rows
after = table["after"]
after = after.filter(pc.is_valid(after))  # deletes have no after image
n = len(after)


def f(*path):
    return pc.struct_field(after, list(path))


order_id = f("id")
customer_id = f("doc", "customer", "id")
items = f("doc", "items")
orders = pa.table({
    "order_id": order_id,
    "customer_id": customer_id,
    "status": f("doc", "status"),
    "total_cents": f("doc", "total_cents").cast(pa.int64()),
    "created_at": f("doc", "created_at"),
    "shipping_method": f("doc", "shipping", "method"),
    "shipping_status": f("doc", "shipping", "status"),
    "shipping_city": f("doc", "shipping", "address", "city"),
    "item_count": pc.list_value_length(items).cast(pa.int64()),
    "updated_at": f("updated_at"),
})
pq.write_table(orders, os.path.join(out_dir, "orders.parquet"), compression="zstd")

# customers: the last row of each customer_id (the largest row index per key).
row_index = pc.subtract(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), n)), 1)
last = (pa.table({"customer_id": customer_id, "i": row_index})
        .group_by("customer_id").aggregate([("i", "max")])["i_max"])
contacts = f("doc", "customer", "contactDetails")


def contact(field):
    parents, values = first_valid(contacts, field)
    return pc.take(values, pc.index_in(last, value_set=parents))


billing = f("doc", "customer", "billingAddress")
customers = pa.table({
    "customer_id": pc.take(customer_id, last),
    "name": pc.take(f("doc", "customer", "name"), last),
    "email": contact("email"),
    "phone": contact("phone"),
    "billing_city": pc.take(pc.struct_field(billing, "city"), last),
    "billing_state": pc.take(pc.struct_field(billing, "state"), last),
})
pq.write_table(customers, os.path.join(out_dir, "customers.parquet"), compression="zstd")

# order_items: items exploded; line_no = position in the list + 1.
flat = pc.list_flatten(items)
parents = pc.list_parent_indices(items)
lengths = pc.list_value_length(items).cast(pa.int64())
first_pos = pc.subtract(pc.cumulative_sum(lengths), lengths)  # position of each list's first item
item_pos = pc.subtract(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), len(flat))), 1)
order_items = pa.table({
    "order_id": pc.take(order_id, parents),
    "line_no": pc.add(pc.subtract(item_pos, pc.take(first_pos, parents)), 1),
    "sku": pc.struct_field(flat, "sku"),
    "qty": pc.struct_field(flat, "qty").cast(pa.int64()),
    "unit_price_cents": pc.struct_field(flat, "unit_price_cents").cast(pa.int64()),
})
pq.write_table(order_items, os.path.join(out_dir, "order_items.parquet"), compression="zstd")
secs = time.perf_counter() - start

print(f"pyarrow: {rows} docs in {secs:.2f} s = {rows / secs:.0f} docs/s")
print(f"pyarrow rows: orders {orders.num_rows}, customers {customers.num_rows}, order_items {order_items.num_rows}")
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"pyarrow peak RSS: {usage.ru_maxrss / 1024:.1f} MiB")
print(f"pyarrow CPU: {usage.ru_utime + usage.ru_stime:.2f} s")
