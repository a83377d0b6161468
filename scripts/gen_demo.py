#!/usr/bin/env python3
"""Generates pipelines/demo/changes.jsonl: a deterministic change log over the showcase tables.

Debezium envelopes as PostgreSQL's connector writes them: snapshot reads, creates, updates and
deletes on authors, books, book_authors, products, customer_orders, device_heartbeats and orders;
several multi-table transactions framed by BEGIN/END markers; the `orders` events in the wrapped
form (`schema` + `payload`) with Decimal and MicroTimestamp logical types.

Usage: python3 scripts/gen_demo.py [OUTPUT]   (default pipelines/demo/changes.jsonl)
"""
import base64
import json
import random
import sys

rng = random.Random(20261202)
out_path = sys.argv[1] if len(sys.argv) > 1 else "pipelines/demo/changes.jsonl"
lines = []
lsn = 0x1600000
tx_id = 700
ts = 1_790_000_000_000  # 2026-09-21

FIRST = ["Thomas", "Ana", "Wei", "Priya", "Lars", "Mei", "Omar", "Sofia", "Kenji", "Ines"]
LAST = ["Andersen", "Silva", "Zhang", "Patel", "Berg", "Chen", "Haddad", "Rossi", "Sato", "Costa"]
STATUSES = ["pending", "paid", "shipped", "delivered", "cancelled"]
REGIONS = ["EU", "US", "CN_SHANGHAI", "APAC"]


def source(table, snapshot=False):
    return {"version": "2.7.0.Final", "connector": "postgresql", "name": "demo", "ts_ms": ts,
            "snapshot": "true" if snapshot else "false", "db": "refract", "schema": "public",
            "table": table, "txId": tx_id, "lsn": lsn}


tx_state = {"id": None, "order": 0}


def emit(table, op, before, after, snapshot=False):
    global lsn, ts
    lsn += rng.randint(40, 400)
    ts += rng.randint(1, 900)
    env = {"before": before, "after": after, "op": op, "source": source(table, snapshot), "ts_ms": ts + 3}
    if tx_state["id"] is not None:
        tx_state["order"] += 1
        env["transaction"] = {"id": f"{tx_id}:{lsn}", "total_order": tx_state["order"],
                              "data_collection_order": tx_state["order"]}
    lines.append(json.dumps(env, separators=(",", ":")))


def begin():
    global tx_id
    tx_id += 1
    tx_state.update(id=str(tx_id), order=0)
    lines.append(json.dumps({"status": "BEGIN", "id": str(tx_id), "event_count": None,
                             "data_collections": None, "ts_ms": ts}))


def end():
    lines.append(json.dumps({"status": "END", "id": tx_state["id"], "event_count": tx_state["order"],
                             "data_collections": [], "ts_ms": ts}))
    tx_state.update(id=None, order=0)


def iso(ms):
    import datetime
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


authors, books, links, products, orders_docs, legacy_orders = {}, {}, {}, {}, {}, {}

# Snapshot of authors and books.
for i in range(1, 41):
    a = {"id": f"a{i}", "first_name": rng.choice(FIRST), "last_name": rng.choice(LAST),
         "thumbnail_url": f"https://img.example/a{i}/thumb.png" if i % 3 else None,
         "profile_url": f"https://img.example/a{i}/profile.png", "large_url": None, "updated_at": iso(ts)}
    authors[a["id"]] = a
    emit("authors", "r", None, a, snapshot=True)
for i in range(1, 121):
    b = {"id": f"b{i}", "name": f"Book {i}: {rng.choice(['Cosmos', 'Graphs', 'Caches', 'Streams'])} 101",
         "published_on": 19000 + i, "updated_at": iso(ts)}
    books[b["id"]] = b
    emit("books", "r", None, b, snapshot=True)
    for pos, a in enumerate(rng.sample(sorted(authors), rng.randint(1, 3))):
        l = {"book_id": b["id"], "author_id": a, "position": pos}
        links[(b["id"], a)] = l
        emit("book_authors", "r", None, l, snapshot=True)


def product_row(pid):
    return {"id": pid, "tenant_id": rng.choice(["t1", "t2"]), "sku": f"sku-{rng.randint(1, 99999)}",
            "name": f"Product {pid}", "price_cents": rng.randint(100, 50000), "updated_at": iso(ts)}


def order_doc(oid):
    c = rng.randint(1, 80)
    items = [{"sku": f"sku-{rng.randint(1, 5000)}", "qty": rng.randint(1, 4),
              "unit_price_cents": rng.randint(100, 9000)} for _ in range(rng.randint(1, 4))]
    return {"id": oid, "doc": json.dumps({
        "status": rng.choice(STATUSES), "created_at": iso(ts), "total_cents": sum(i["qty"] * i["unit_price_cents"] for i in items),
        "customer": {"id": f"c{c}", "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
                     "contactDetails": [{"email": f"c{c}@example.com"}, {"phone": f"+1 555 {c:04d}"}]},
        "shipping": {"method": rng.choice(["ground", "air"]), "status": "pending",
                     "address": {"city": rng.choice(["Portland", "Seattle", "Lyon"]), "state": "OR"}},
        "items": items}), "updated_at": iso(ts)}


ORDER_SCHEMA_FIELDS = [
    {"type": "string", "optional": False, "field": "order_id"},
    {"type": "string", "optional": False, "field": "user_id"},
    {"type": "string", "optional": False, "field": "region"},
    {"type": "string", "optional": False, "field": "status"},
    {"type": "bytes", "optional": False, "name": "org.apache.kafka.connect.data.Decimal", "version": 1,
     "parameters": {"scale": "2", "connect.decimal.precision": "12"}, "field": "total_amount"},
    {"type": "int64", "optional": False, "name": "io.debezium.time.MicroTimestamp", "version": 1, "field": "created_at"},
]


def order_schema():
    row = {"type": "struct", "fields": ORDER_SCHEMA_FIELDS, "optional": True, "name": "demo.public.orders.Value"}
    return {"type": "struct", "name": "demo.public.orders.Envelope", "optional": False, "fields": [
        dict(row, field="before"), dict(row, field="after"),
        {"type": "struct", "fields": [], "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source"},
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"}]}


def decimal_b64(cents):
    n = (cents.bit_length() + 8) // 8
    return base64.b64encode(cents.to_bytes(n, "big", signed=True)).decode()


def emit_order(op, before, after):
    global lsn, ts
    lsn += rng.randint(40, 400)
    ts += rng.randint(1, 900)
    wire = lambda r: None if r is None else dict(r, total_amount=decimal_b64(r["total_cents"]), created_at=r["created_us"]) | {"total_cents": None, "created_us": None}
    clean = lambda r: None if r is None else {k: v for k, v in wire(r).items() if v is not None}
    lines.append(json.dumps({"schema": order_schema(), "payload": {
        "before": clean(before), "after": clean(after), "op": op, "source": source("orders"), "ts_ms": ts}},
        separators=(",", ":")))


# Live changes.
for step in range(2600):
    roll = rng.random()
    if roll < 0.12:  # a product created, repriced, re-skued or deleted
        if not products or rng.random() < 0.5:
            pid = len(products) + 1 + step
            p = product_row(pid)
            products[pid] = p
            emit("products", "c", None, p)
        else:
            pid = rng.choice(sorted(products))
            old = products[pid]
            if rng.random() < 0.2:
                emit("products", "d", old, None)
                del products[pid]
            else:
                new = dict(old, price_cents=rng.randint(100, 50000), updated_at=iso(ts))
                if rng.random() < 0.3:
                    new["sku"] = f"sku-{rng.randint(100000, 199999)}"
                products[pid] = new
                emit("products", "u", old, new)
    elif roll < 0.30:  # customer orders
        if not orders_docs or rng.random() < 0.6:
            oid = f"o{step}"
            orders_docs[oid] = order_doc(oid)
            emit("customer_orders", "c", None, orders_docs[oid])
        else:
            oid = rng.choice(sorted(orders_docs))
            old = orders_docs[oid]
            if rng.random() < 0.15:
                emit("customer_orders", "d", old, None)
                del orders_docs[oid]
            else:
                doc = json.loads(old["doc"])
                doc["status"] = rng.choice(STATUSES)
                doc["shipping"]["status"] = rng.choice(["pending", "shipped", "delivered"])
                new = dict(old, doc=json.dumps(doc), updated_at=iso(ts))
                orders_docs[oid] = new
                emit("customer_orders", "u", old, new)
    elif roll < 0.62:  # heartbeats (insert-only)
        d = rng.randint(1, 60)
        emit("device_heartbeats", "c", None, {"device_id": f"dev-{d:03d}", "ts": iso(ts), "region": REGIONS[d % 4],
                                               "battery": round(rng.uniform(5, 100), 1), "signal": rng.randint(-110, -40),
                                               "lat": round(rng.uniform(-60, 60), 5), "lon": round(rng.uniform(-150, 150), 5)})
    elif roll < 0.72:  # legacy orders (wrapped envelopes with logical types)
        if not legacy_orders or rng.random() < 0.6:
            oid = f"ORD-2026-{step:04d}"
            r = {"order_id": oid, "user_id": f"U{rng.randint(1, 500)}", "region": rng.choice(REGIONS[:2]),
                 "status": "pending", "total_cents": rng.randint(-500, 900000), "created_us": ts * 1000 + 123}
            legacy_orders[oid] = r
            emit_order("c", None, r)
        else:
            oid = rng.choice(sorted(legacy_orders))
            old = legacy_orders[oid]
            new = dict(old, status=rng.choice(STATUSES))
            legacy_orders[oid] = new
            emit_order("u", old, new)
    elif roll < 0.82:  # author rename
        a = rng.choice(sorted(authors))
        old = authors[a]
        new = dict(old, last_name=rng.choice(LAST), updated_at=iso(ts))
        authors[a] = new
        emit("authors", "u", old, new)
    elif roll < 0.90:  # a new book with its authors: one multi-table transaction
        begin()
        bid = f"b{1000 + step}"
        b = {"id": bid, "name": f"New book {step}", "published_on": 20000 + step % 300, "updated_at": iso(ts)}
        books[bid] = b
        emit("books", "c", None, b)
        for pos, a in enumerate(rng.sample(sorted(authors), rng.randint(1, 3))):
            l = {"book_id": bid, "author_id": a, "position": pos}
            links[(bid, a)] = l
            emit("book_authors", "c", None, l)
        end()
    elif roll < 0.95 and len(books) > 20:  # a book deleted with its links, in one transaction
        begin()
        bid = rng.choice(sorted(books))
        for key in [k for k in links if k[0] == bid]:
            emit("book_authors", "d", links.pop(key), None)
        emit("books", "d", books.pop(bid), None)
        end()
    else:  # author image changes
        a = rng.choice(sorted(authors))
        old = authors[a]
        new = dict(old, large_url=f"https://img.example/{a}/large-{step}.png")
        authors[a] = new
        emit("authors", "u", old, new)

with open(out_path, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"wrote {len(lines)} records to {out_path}")
