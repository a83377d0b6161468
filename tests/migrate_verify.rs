//! `refract migrate FILE verify` against real PostgreSQL:
//! - a corruption seeded by hand in `orders_v2` (a changed value, a deleted row, an extra row):
//!   exit 1, and the report names all three; a value the transform cannot convert is reported
//!   with its key, and stops neither the dual write nor the rest of the report;
//! - equal values written differently (`1.0` and `1.00`, one instant in two time zones, JSON
//!   with its keys in another order) are not differences, integer keys are chunked in numeric
//!   order, and a real difference among them is found with its column and both values;
//! - the backfill converting in PostgreSQL copies and rejects exactly the rows that refract's
//!   own conversion copies and rejects, edge values included, and a chunk its probe wrongly
//!   finds empty of the dual write's rows is upserted.

mod common;

use common::migrate::Migration;
use serde_json::Value;

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `verify --json` (with a short settle: nothing writes), returns its exit success and
/// the report.
fn verify(m: &Migration, extra: &[&str]) -> (bool, Value) {
    let mut args = vec!["--json", "--settle", "3"];
    args.extend_from_slice(extra);
    let out = m.run("verify", &args);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("verify printed no JSON report ({e}): {}", text(&out)));
    (out.status.success(), report)
}

/// Runs `backfill` to its end, which must succeed with its rows converted `by` PostgreSQL or
/// refract (as it prints).
fn backfill_converted(m: &Migration, by: &str) {
    let out = m.run("backfill", &[]);
    assert!(out.status.success(), "backfill: {}", text(&out));
    let by = format!("converted by {by}");
    assert!(text(&out).contains(&by), "not {by}: {}", text(&out));
}

/// The differences of a report of `kind`, by key.
fn keys_of(report: &Value, kind: &str) -> Vec<String> {
    report["differences"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| d["key"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn seeded_corruption_is_named_row_by_row_and_an_unconvertible_value_stops_nothing() {
    let m = Migration::create("refract_mig_verify", 5_000);
    let mut daemon = m.start();
    let out = m.run("backfill", &[]);
    assert!(out.status.success(), "backfill: {}", text(&out));
    let (equal, report) = verify(&m, &[]);
    assert!(equal, "verify after the backfill: {report:#}");
    assert_eq!(report["leading_rows"], 5_000);

    // A value the transform cannot convert, then a good row after it: the dual write goes on.
    m.db.psql("INSERT INTO orders VALUES ('ORD-BAD', 'X99', 'EU', 'paid', 1.00, now())");
    m.catch_up("orders", "orders_v2", "after-bad");
    let dead =
        std::fs::read_to_string(m.state.path().join("migrate-orders_v2/dead-letters.ndjson"))
            .unwrap_or_default();
    assert!(
        dead.contains("ORD-BAD"),
        "the dual write did not report the row: {dead}"
    );

    // Corruption by hand: a changed value, a deleted row, an extra row.
    m.db.psql(
        "UPDATE orders_v2 SET status = 'lost' WHERE order_id = 'ORD-0000100'; \
         DELETE FROM orders_v2 WHERE order_id = 'ORD-0000200'; \
         INSERT INTO orders_v2 VALUES ('EU', 7, 'ORD-9999999', 'paid', 100, now());",
    );
    let (equal, report) = verify(&m, &[]);
    assert!(!equal, "verify missed the corruption: {report:#}");
    assert_eq!(
        keys_of(&report, "missing"),
        [r#"(order_id="ORD-0000200")"#],
        "{report:#}"
    );
    assert_eq!(
        keys_of(&report, "extra"),
        [r#"(order_id="ORD-9999999")"#],
        "{report:#}"
    );
    assert_eq!(
        keys_of(&report, "differs"),
        [r#"(order_id="ORD-0000100")"#],
        "{report:#}"
    );
    assert_eq!(
        keys_of(&report, "unconvertible"),
        [r#"(order_id="ORD-BAD")"#],
        "{report:#}"
    );
    let differs = report["differences"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["kind"] == "differs")
        .unwrap();
    assert_eq!(differs["columns"][0]["column"], "status");
    assert_eq!(differs["columns"][0]["found"], "lost");
    assert_eq!(differs["columns"][0]["expected"], "paid");
    assert_eq!(report["counts"]["missing"], 1);
    assert_eq!(report["counts"]["extra"], 1);
    assert_eq!(report["counts"]["differing"], 1);
    assert_eq!(report["counts"]["unconvertible"], 1);
    assert_eq!(m.control("verify_equal").as_deref(), Some("false"));

    // The text report names them too, and the cut-over refuses.
    let out = m.run("verify", &["--settle", "3"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let printed = text(&out);
    for key in ["ORD-0000100", "ORD-0000200", "ORD-9999999", "ORD-BAD"] {
        assert!(printed.contains(key), "{key} not in the report: {printed}");
    }
    let out = m.run("cutover", &[]);
    assert!(
        !out.status.success(),
        "cut over after a failed verify: {}",
        text(&out)
    );
    assert!(text(&out).contains("differences"), "{}", text(&out));

    // Repaired by hand, the tables verify again.
    m.db.psql(
        "UPDATE orders_v2 SET status = 'paid' WHERE order_id = 'ORD-0000100'; \
         INSERT INTO orders_v2 SELECT region, substring(user_id from 2)::bigint, order_id, \
           status, (total_amount * 100)::bigint, created_at FROM orders \
         WHERE order_id = 'ORD-0000200'; \
         DELETE FROM orders_v2 WHERE order_id = 'ORD-9999999'; \
         DELETE FROM orders WHERE order_id = 'ORD-BAD';",
    );
    m.catch_up("orders", "orders_v2", "repaired");
    let (equal, report) = verify(&m, &[]);
    assert!(equal, "verify after the repair: {report:#}");
    daemon.terminate();
}

const TRAPS_SCHEMA: &str = "
    CREATE TABLE items (
        id bigint PRIMARY KEY,
        price numeric(12,2) NOT NULL,
        seen text NOT NULL,
        doc json NOT NULL
    );
    CREATE TABLE items_v2 (
        id bigint PRIMARY KEY,
        price numeric NOT NULL,
        seen timestamptz NOT NULL,
        doc json NOT NULL
    );
    INSERT INTO items SELECT g, g + 0.5, '2024-03-01 12:00:00+02', '{\"a\": 1, \"b\": [1, 2]}'
    FROM generate_series(1, 2500) g;";

const TRAPS_FILE: &str = r#"
[migration]
name = "items_v2"
url = "${PG_URL}"
source = "items"
target = "items_v2"
state_dir = "${STATE_DIR}"
slot = "${REFRACT_SLOT}"

[columns.id]
[columns.price]
transform = "cast"
[columns.seen]
transform = "cast"
[columns.doc]
"#;

#[test]
fn equal_values_written_differently_are_equal_and_integer_keys_chunk_in_order() {
    let m = Migration::with_file("refract_mig_traps", TRAPS_SCHEMA, "items_v2", TRAPS_FILE);
    let mut daemon = m.start();
    // Text to an instant has no exact SQL here: these rows go through refract.
    backfill_converted(&m, "refract");
    // The same values, written differently: `2.0` for `2.50`'s neighbour `2.00`, the instant
    // written in another zone (the source has it as text with +02), the JSON keys reordered.
    m.db.psql(
        "INSERT INTO items VALUES (0, 2.00, '2024-03-01 10:00:00Z', '{\"b\": [1, 2], \"a\": 1}'); \
         UPDATE items_v2 SET doc = '{ \"b\" : [1,2], \"a\" : 1.0 }' WHERE id % 7 = 0; \
         UPDATE items_v2 SET price = price * 1.000 WHERE id % 5 = 0;",
    );
    m.catch_up_with(
        "INSERT INTO items VALUES (99999, 1, '2024-01-01 00:00:00+00', '{}')",
        "items_v2",
        "id = 99999",
    );
    m.db.psql("UPDATE items_v2 SET price = 2.0 WHERE id = 0");
    // Small chunks: many boundaries, where ids sorted as text (`10` before `9`) would break.
    let (equal, report) = verify(&m, &["--chunk-rows", "97"]);
    assert!(equal, "false differences: {report:#}");
    assert_eq!(report["leading_rows"], 2_502);
    assert_eq!(report["following_rows"], 2_502);
    assert!(report["chunks"].as_u64().unwrap() > 25, "{report:#}");

    // A real difference among them is found, with the column and both values.
    m.db.psql("UPDATE items_v2 SET price = 1001.51 WHERE id = 1001");
    let (equal, report) = verify(&m, &["--chunk-rows", "97"]);
    assert!(!equal, "verify missed a changed price: {report:#}");
    assert_eq!(keys_of(&report, "differs"), ["(id=1001)"], "{report:#}");
    let column = &report["differences"][0]["columns"][0];
    assert_eq!(column["column"], "price");
    assert_eq!(column["found"], "1001.51");
    assert_eq!(column["expected"], "1001.50");
    assert_eq!(report["chunks_differing"], 1, "{report:#}");
    daemon.terminate();
}

/// Edge values of an `extract` into a bigint, a `scale` into a bigint and a narrowing cast:
/// each row says what the transform does with it.
const EDGES_SCHEMA: &str = "
    CREATE TABLE accounts (
        id integer PRIMARY KEY,
        code text,
        amount numeric(16,4) NOT NULL,
        small bigint NOT NULL
    );
    CREATE TABLE accounts_v2 (
        id integer PRIMARY KEY,
        code bigint NOT NULL,
        cents bigint NOT NULL,
        small smallint NOT NULL
    );
    INSERT INTO accounts VALUES
        (1, 'U1', 12.34, 1),                      -- copied: 1, 1234, 1
        (2, 'U007', -0.01, -32768),               -- copied: 7, -1, -32768
        (3, 'U', 1, 1),                           -- rejected: no digits
        (4, 'U12a', 1, 1),                        -- rejected: no match
        (5, 'u12', 1, 1),                         -- rejected: case
        (6, 'U-5', 1, 1),                         -- rejected: a sign is no digit
        (7, 'U 5', 1, 1),                         -- rejected: a space
        (8, 'U999999999999999999', 0, 32767),     -- copied: 18 digits
        (9, 'U9223372036854775807', 5, 5),        -- copied: the largest bigint (19 digits)
        (10, 'U9223372036854775808', 5, 5),       -- rejected: out of range
        (11, 'U\u{FF11}\u{FF12}', 1, 1),         -- rejected: full-width digits are no \\d
        (12, NULL, 1, 1),                         -- rejected: null into NOT NULL
        (13, 'U5', 12.345, 1),                    -- rejected: 1234.5 cents
        (14, 'U5', 99999999999.99, 1),            -- copied: 9999999999999 cents
        (15, 'U5', 1, 32768),                     -- rejected: over smallint
        (16, 'U5', 1, -32769),                    -- rejected: under smallint
        (17, E'U5\\n', 1, 1);                     -- rejected: `$` is the end of the text
    INSERT INTO accounts SELECT g, 'U' || g, g / 100.0, g % 30000 FROM generate_series(100, 3099) g;";

/// The migration of [`EDGES_SCHEMA`], its `extract` pattern left open.
fn edges_file(pattern: &str) -> String {
    format!(
        r#"
[migration]
name = "accounts_v2"
url = "${{PG_URL}}"
source = "accounts"
target = "accounts_v2"
state_dir = "${{STATE_DIR}}"
slot = "${{REFRACT_SLOT}}"
batch_rows = 100

[columns.id]
[columns.code]
transform = "extract"
pattern = '{pattern}'
reverse = "U{{}}"
[columns.cents]
from = "amount"
transform = "scale"
factor = 100
[columns.small]
transform = "cast"
"#
    )
}

#[test]
fn the_backfill_converting_in_postgresql_copies_and_rejects_what_refract_does() {
    // The same pattern twice: in the subset PostgreSQL is given, and with a group that keeps it
    // out of that subset, so that refract converts every row.
    let runs = [
        ("refract_mig_edges_db", r"^U(\d+)$", "PostgreSQL"),
        ("refract_mig_edges_rf", r"^(?:U)(\d+)$", "refract"),
    ];
    let mut results = Vec::new();
    for (db, pattern, by) in runs {
        let m = Migration::with_file(db, EDGES_SCHEMA, "accounts_v2", &edges_file(pattern));
        let mut daemon = m.start();
        backfill_converted(&m, by);
        let copied = m.db.psql(
            "SELECT string_agg(format('%s:%s:%s:%s', id, code, cents, small), ' ' ORDER BY id) \
             FROM accounts_v2 WHERE id < 100",
        );
        let bulk = m.db.psql(
            "SELECT count(*) FROM accounts a JOIN accounts_v2 v USING (id) \
             WHERE a.id >= 100 AND v.code = a.id AND v.cents = a.amount * 100 AND v.small = a.small",
        );
        let rejects =
            std::fs::read_to_string(m.state.path().join("migrate-accounts_v2/rejected.ndjson"))
                .unwrap_or_default();
        let mut rejected: Vec<String> = rejects
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["key"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        rejected.sort();
        daemon.terminate();
        results.push((copied, bulk, rejected));
    }
    let (copied, bulk, rejected) = &results[0];
    assert_eq!(
        copied,
        "1:1:1234:1 2:7:-1:-32768 8:999999999999999999:0:32767 \
         9:9223372036854775807:500:5 14:5:9999999999999:1"
    );
    assert_eq!(bulk, "3000");
    let mut expected: Vec<String> = [3, 4, 5, 6, 7, 10, 11, 12, 13, 15, 16, 17]
        .iter()
        .map(|id| format!("(id={id})"))
        .collect();
    expected.sort();
    assert_eq!(rejected, &expected);
    assert_eq!(
        results[0], results[1],
        "PostgreSQL and refract converted differently"
    );
}

/// Text longer than its target column: rejected with its reason, never cut. (Seen failing
/// before: the writer cast each value to `character varying(5)`, which cuts, and `abcdef`
/// arrived as `abcde`.)
#[test]
fn a_text_longer_than_its_target_column_is_rejected_not_cut() {
    let schema = "
        CREATE TABLE notes (id integer PRIMARY KEY, body text NOT NULL);
        CREATE TABLE notes_v2 (id integer PRIMARY KEY, body character varying(5) NOT NULL);
        INSERT INTO notes VALUES (1, 'abcde'), (2, 'abcdef'), (3, 'ééééé'), (4, 'éééééé'),
                                 (5, 'abcd  ');";
    let file = COLLATIONS_FILE.replace("tags", "notes").replace(
        "[columns.code]\n[columns.v]",
        "[columns.id]\n[columns.body]\ntransform = \"cast\"",
    );
    let m = Migration::with_file("refract_mig_long", schema, "notes_v2", &file);
    let mut daemon = m.start();
    backfill_converted(&m, "refract");
    assert_eq!(
        m.db.psql("SELECT string_agg(id || ':' || body, ' ' ORDER BY id) FROM notes_v2"),
        "1:abcde 3:ééééé"
    );
    let rejects =
        std::fs::read_to_string(m.state.path().join("migrate-notes_v2/rejected.ndjson")).unwrap();
    let rejected: Vec<Value> = rejects
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let keys: Vec<&str> = rejected
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["(id=2)", "(id=4)", "(id=5)"], "{rejects}");
    assert!(
        rejects.contains("`abcdef` is longer than 5 characters: it would be cut"),
        "{rejects}"
    );
    daemon.terminate();
}

/// A domain over `varchar(n)` (which the transform sees as text of any length): the backfill
/// stops on the value PostgreSQL refuses, it does not cut it. (Seen failing before: the value
/// was cast to the domain, which cuts, and `abcdef` arrived as `abc`.)
#[test]
fn a_text_longer_than_a_domain_over_varchar_stops_the_backfill_uncut() {
    let schema = "
        CREATE DOMAIN short_text AS varchar(3);
        CREATE TABLE notes (id integer PRIMARY KEY, body text NOT NULL);
        CREATE TABLE notes_v2 (id integer PRIMARY KEY, body short_text NOT NULL);
        INSERT INTO notes VALUES (1, 'abc'), (2, 'abcdef');";
    let file = COLLATIONS_FILE.replace("tags", "notes").replace(
        "[columns.code]\n[columns.v]",
        "[columns.id]\n[columns.body]\ntransform = \"cast\"",
    );
    let m = Migration::with_file("refract_mig_domain", schema, "notes_v2", &file);
    let mut daemon = m.start();
    let out = m.run("backfill", &[]);
    assert!(!out.status.success(), "backfill: {}", text(&out));
    assert!(text(&out).contains("value too long"), "{}", text(&out));
    assert_eq!(
        m.db.psql("SELECT count(*) FROM notes_v2 WHERE length(body) < 6 AND id = 2"),
        "0"
    );
    daemon.terminate();
}

/// The source sorts its keys byte by byte, the target in ICU's order: `B` comes before `a` in
/// the one and after it in the other.
const COLLATIONS_SCHEMA: &str = r#"
    CREATE TABLE tags (code text COLLATE "C" PRIMARY KEY, v integer NOT NULL);
    CREATE TABLE tags_v2 (code text COLLATE "und-x-icu" PRIMARY KEY, v integer NOT NULL);
    INSERT INTO tags VALUES ('A', 1), ('B', 1), ('a', 1), ('b', 1);"#;

const COLLATIONS_FILE: &str = r#"
[migration]
name = "tags_v2"
url = "${PG_URL}"
source = "tags"
target = "tags_v2"
state_dir = "${STATE_DIR}"
slot = "${REFRACT_SLOT}"
batch_rows = 100

[columns.code]
[columns.v]
"#;

/// Keys in two collations: the backfill does not probe the target for the chunk's key range
/// (the range would be another one there), it upserts. (Seen failing before: the probe
/// compared keys of both collations, and PostgreSQL refused to choose one.)
#[test]
fn keys_sorted_in_another_collation_in_the_target_are_copied() {
    let m = Migration::with_file(
        "refract_mig_collate",
        COLLATIONS_SCHEMA,
        "tags_v2",
        COLLATIONS_FILE,
    );
    let mut daemon = m.start();
    m.catch_up_with(
        "UPDATE tags SET v = 2 WHERE code = 'B'",
        "tags_v2",
        "code = 'B' AND v = 2",
    );
    backfill_converted(&m, "PostgreSQL");
    assert_eq!(
        m.db.psql("SELECT string_agg(code || v, ' ' ORDER BY code COLLATE \"C\") FROM tags_v2"),
        "A1 B2 a1 b1"
    );
    daemon.terminate();
}

/// A chunk whose plain `INSERT` meets a row another transaction inserted after the chunk's
/// probe of the target (the dual write, here a session standing in for it, its `INSERT` not
/// yet committed when the probe looks) is copied again with upserts, and the row ends with the
/// source's value. (Seen failing without the second copy: the backfill stopped on the primary
/// key of `tags_v2`.)
#[test]
fn a_chunk_meeting_a_row_inserted_after_its_probe_is_copied_again_with_upserts() {
    let schema = COLLATIONS_SCHEMA.replace(r#"COLLATE "und-x-icu" "#, r#"COLLATE "C" "#);
    let m = Migration::with_file("refract_mig_probe", &schema, "tags_v2", COLLATIONS_FILE);
    // The backfill's lock waits last a fifth of this: long enough for the session's commit
    // below to come while the chunk waits, rather than after it gave way.
    m.db.psql(&format!(
        "ALTER DATABASE refract_mig_probe SET deadlock_timeout = '{}s'",
        common::pg::hang_guard().as_secs()
    ));
    let mut daemon = m.start();
    let mut early = common::pg::Session::open_at(&m.db.url(), "early_insert");
    early.run("BEGIN; INSERT INTO tags_v2 VALUES ('B', 7);");
    let backfill = m
        .command("backfill", &[])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    m.wait_for("the chunk's INSERT to wait for the session's row", || {
        m.db.psql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'refract_mig_probe' \
             AND wait_event_type = 'Lock' AND pid <> {}",
            early.pid
        )) != "0"
    });
    early.run("COMMIT;");
    let out = backfill.wait_with_output().unwrap();
    assert!(out.status.success(), "backfill: {}", text(&out));
    assert!(
        text(&out).contains("copied again with upserts"),
        "{}",
        text(&out)
    );
    assert_eq!(
        m.db.psql("SELECT string_agg(code || v, ' ' ORDER BY code) FROM tags_v2"),
        "A1 B1 a1 b1"
    );
    daemon.terminate();
}
