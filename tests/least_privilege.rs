//! Least privilege (issue 26): the showcase (documents, cache, Parquet) runs with a source role
//! that may only replicate and read its tables (the publications made by an administrator), a
//! target role that may only read and write the rows of read-model tables an administrator
//! made, and a Redis user whose ACL allows only the pipeline's keys and commands. Each missing
//! privilege is named, with its object and grant, before anything is read or written.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::cache::RedisServer;
use common::documents::{self, shipped_pipeline};
use common::{parquet, pg, refract};

/// The roles this test makes (cluster-wide names, this test's own).
const READER: &str = "lp_reader";
const WRITER: &str = "lp_writer";
const NO_REPLICATION: &str = "lp_no_replication";
const NO_SELECT: &str = "lp_no_select";
const NO_UPDATE: &str = "lp_no_update";
const ROLES: [&str; 5] = [READER, WRITER, NO_REPLICATION, NO_SELECT, NO_UPDATE];
/// The schemas of the three pipelines' source tables; `lp_docs_rm` holds the read models.
const SCHEMAS: [&str; 4] = ["lp_docs", "lp_docs_rm", "lp_cache", "lp_pq"];

/// The read-model table of the PostgreSQL sink, as docs/sinks/postgres.md gives it to
/// administrators.
const READ_MODEL_TABLE: &str = "(id text PRIMARY KEY, doc jsonb NOT NULL, \
    source_position text COLLATE \"C\" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())";
const TOMBSTONES_TABLE: &str = "(target text COLLATE \"C\" NOT NULL, id text NOT NULL, \
    position text COLLATE \"C\" NOT NULL, deleted_at timestamptz NOT NULL DEFAULT now(), \
    PRIMARY KEY (target, id))";

/// The test's roles, schemas, slots and publications, removed before and after it.
struct Setup;

impl Setup {
    fn new() -> Self {
        clean();
        let mut sql = String::new();
        for role in ROLES {
            sql.push_str(&format!("CREATE ROLE {role} LOGIN;"));
        }
        sql.push_str(&format!(
            "ALTER ROLE {READER} REPLICATION; ALTER ROLE {NO_SELECT} REPLICATION;"
        ));
        pg::psql(&sql);
        Setup
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if std::env::var_os("REFRACT_TEST_KEEP_DB").is_none() {
            clean();
        }
    }
}

fn clean() {
    let mut sql = String::from("SET client_min_messages = warning;");
    for name in ["lp_docs", "lp_cache", "lp_pq"] {
        sql.push_str(&format!(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
               WHERE slot_name = 'refract_{name}' AND active_pid IS NOT NULL;
             SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
               WHERE slot_name = 'refract_{name}';
             DROP PUBLICATION IF EXISTS refract_{name};"
        ));
    }
    for schema in SCHEMAS {
        sql.push_str(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE;"));
    }
    for role in ROLES {
        sql.push_str(&format!(
            "DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN \
               EXECUTE 'DROP OWNED BY {role}'; EXECUTE 'DROP ROLE {role}'; END IF; END $$;"
        ));
    }
    pg::psql(&sql);
}

/// The test server's URL, connecting as `role` (the server trusts loopback: no password).
fn as_role(role: &str) -> String {
    let url = pg::url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{role}@{host}")
}

/// `refract run FILE --until-caught-up` with the source as `source` and the target as `target`.
fn run(file: &Path, source: &str, target: &str, env: &[(&str, String)]) -> Output {
    let mut cmd = refract();
    cmd.arg("run")
        .arg(file)
        .arg("--until-caught-up")
        .env("PG_URL", as_role(source))
        .env("TARGET_PG_URL", as_role(target));
    for (name, value) in env {
        cmd.env(name, value);
    }
    cmd.output().expect("refract runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `file` as `source` / `target` expecting a refusal that names each of `named`, with no
/// slot made and nothing written.
fn refused(file: &Path, source: &str, target: &str, named: &[&str]) {
    let state = file.parent().unwrap().join("state");
    let _ = std::fs::remove_dir_all(&state);
    let out = run(file, source, target, &[]);
    let text = stderr(&out);
    assert!(
        !out.status.success(),
        "{source}/{target}: the run must fail: {text}"
    );
    for name in named {
        assert!(
            text.contains(name),
            "{source}/{target}: `{name}` is not named: {text}"
        );
    }
    let written = pg::psql(
        "SELECT (SELECT count(*) FROM lp_docs_rm.author_docs) + (SELECT count(*) FROM lp_docs_rm.book_docs)",
    );
    assert_eq!(
        written, "0",
        "{source}/{target}: read models written: {text}"
    );
    drop_slot("lp_docs");
    let _ = std::fs::remove_dir_all(&state);
}

fn drop_slot(name: &str) {
    pg::psql(&format!(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name = 'refract_{name}' AND active_pid IS NULL"
    ));
}

#[test]
fn the_showcase_runs_with_least_privileged_roles_and_each_missing_privilege_is_named() {
    let _setup = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    documents_with_a_reader_and_a_writer(dir.path());
    cache_with_a_redis_acl(dir.path());
    parquet_with_a_reader(dir.path());
}

/// The documents pipeline: refused for each missing privilege, then run and verified.
fn documents_with_a_reader_and_a_writer(dir: &Path) {
    documents::fresh_schema("lp_docs");
    pg::psql(&format!(
        "INSERT INTO lp_docs.authors (id, first_name, last_name) VALUES ('a1', 'Ada', 'L'), ('a2', 'Bo', 'K');
         INSERT INTO lp_docs.books (id, name) VALUES ('b1', 'One'), ('b2', 'Two');
         INSERT INTO lp_docs.book_authors VALUES ('b1', 'a1', 0), ('b2', 'a2', 0), ('b2', 'a1', 1);
         CREATE PUBLICATION refract_lp_docs FOR TABLE lp_docs.authors, lp_docs.books, lp_docs.book_authors;
         CREATE SCHEMA lp_docs_rm;
         CREATE TABLE lp_docs_rm.author_docs {READ_MODEL_TABLE};
         CREATE TABLE lp_docs_rm.book_docs {READ_MODEL_TABLE};
         CREATE TABLE lp_docs_rm.refract_tombstones {TOMBSTONES_TABLE};
         GRANT USAGE ON SCHEMA lp_docs TO {READER}, {NO_REPLICATION}, {NO_SELECT};
         GRANT SELECT ON ALL TABLES IN SCHEMA lp_docs TO {READER}, {NO_REPLICATION};
         GRANT SELECT ON lp_docs.authors, lp_docs.book_authors TO {NO_SELECT};
         GRANT USAGE ON SCHEMA lp_docs_rm TO {WRITER}, {NO_UPDATE};
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA lp_docs_rm TO {WRITER};
         GRANT SELECT, INSERT, DELETE ON ALL TABLES IN SCHEMA lp_docs_rm TO {NO_UPDATE};
         GRANT SELECT ON ALL TABLES IN SCHEMA lp_docs_rm TO {READER};"
    ));
    let docs = dir.join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    let file = shipped_pipeline(&docs, "authors-books", "lp_docs");

    refused(
        &file,
        NO_REPLICATION,
        WRITER,
        &[
            "role `lp_no_replication`",
            "the REPLICATION attribute",
            "ALTER ROLE",
        ],
    );
    refused(
        &file,
        NO_SELECT,
        WRITER,
        &[
            "SELECT on table lp_docs.books",
            "GRANT SELECT ON lp_docs.books TO",
        ],
    );
    refused(
        &file,
        READER,
        NO_UPDATE,
        &[
            "role `lp_no_update`",
            "UPDATE on table lp_docs_rm.author_docs",
            "UPDATE on table lp_docs_rm.book_docs",
            "UPDATE on table lp_docs_rm.refract_tombstones",
        ],
    );
    let unmade = docs.join("unmade.toml");
    std::fs::write(
        &unmade,
        std::fs::read_to_string(&file).unwrap().replacen(
            "[source]\n",
            "[source]\npublication = \"lp_docs_unmade\"\n",
            1,
        ),
    )
    .unwrap();
    refused(
        &unmade,
        READER,
        WRITER,
        &[
            "CREATE on database",
            "to create publication `lp_docs_unmade`",
            "ownership of table lp_docs.books",
            "CREATE PUBLICATION \"lp_docs_unmade\" FOR TABLE",
        ],
    );

    let out = run(&file, READER, WRITER, &[]);
    assert!(
        out.status.success(),
        "documents as {READER}/{WRITER}: {}",
        stderr(&out)
    );
    pg::psql(
        "UPDATE lp_docs.books SET name = 'Uno' WHERE id = 'b1'; DELETE FROM lp_docs.book_authors WHERE book_id = 'b2' AND author_id = 'a1';",
    );
    let out = run(&file, READER, WRITER, &[]);
    assert!(
        out.status.success(),
        "documents, streaming: {}",
        stderr(&out)
    );
    let verify = refract()
        .arg("verify")
        .arg(&file)
        .env("PG_URL", as_role(READER))
        .env("TARGET_PG_URL", as_role(WRITER))
        .output()
        .unwrap();
    assert_eq!(
        verify.status.code(),
        Some(0),
        "verify: {}{}",
        String::from_utf8_lossy(&verify.stdout),
        stderr(&verify)
    );
    assert_eq!(pg::psql("SELECT count(*) FROM lp_docs_rm.book_docs"), "2");
}

/// The cache pipeline as the reader, into a Redis whose user may only UNLINK `product:*` keys.
fn cache_with_a_redis_acl(dir: &Path) {
    pg::psql(&format!(
        "CREATE SCHEMA lp_cache;
         CREATE TABLE lp_cache.products (id bigint PRIMARY KEY, sku text NOT NULL, name text NOT NULL);
         ALTER TABLE lp_cache.products REPLICA IDENTITY FULL;
         INSERT INTO lp_cache.products SELECT g, 'sku-' || g, 'product ' || g FROM generate_series(1, 3) g;
         CREATE PUBLICATION refract_lp_cache FOR TABLE lp_cache.products;
         GRANT USAGE ON SCHEMA lp_cache TO {READER};
         GRANT SELECT ON lp_cache.products TO {READER};"
    ));
    let redis = RedisServer::start(false);
    let acl = redis_cli(
        redis.port,
        &[
            "ACL",
            "SETUSER",
            "lp_cache",
            "on",
            ">lp-cache-pw",
            "resetkeys",
            "~product:*",
            "resetchannels",
            "-@all",
            "+@connection",
            "+unlink",
            "+del",
        ],
    );
    assert_eq!(acl.trim(), "OK");
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    // The shipped file has its own `[pipeline.batch]`, which `shipped_pipeline` would add again.
    let file = cache.join("product-cache.toml");
    let shipped =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("product-cache.toml"))
            .unwrap()
            .replace("name = \"product-cache\"", "name = \"lp_cache\"")
            .replace("public.", "lp_cache.")
            .replace(
                "${STATE_DIR:-./state}",
                &cache.join("state").display().to_string(),
            );
    std::fs::write(&file, shipped).unwrap();
    let redis_url = format!("redis://lp_cache:lp-cache-pw@127.0.0.1:{}", redis.port);
    let env = [("REDIS_URL", redis_url)];
    // The first run makes the slot; the cache is filled; the changes after it invalidate.
    let out = run(&file, READER, WRITER, &env);
    assert!(out.status.success(), "cache, first run: {}", stderr(&out));
    for key in [
        "product:1:v3",
        "product:sku:sku-1:v3",
        "product:2:v3",
        "other:1",
    ] {
        redis_cli(redis.port, &["SET", key, "cached"]);
    }
    pg::psql("UPDATE lp_cache.products SET name = 'renamed' WHERE id = 1");
    let out = run(&file, READER, WRITER, &env);
    assert!(
        out.status.success(),
        "cache as {READER} and an ACL user: {}",
        stderr(&out)
    );
    assert_eq!(
        redis_cli(redis.port, &["EXISTS", "product:1:v3"]).trim(),
        "0"
    );
    assert_eq!(
        redis_cli(redis.port, &["EXISTS", "product:sku:sku-1:v3"]).trim(),
        "0"
    );
    assert_eq!(
        redis_cli(redis.port, &["EXISTS", "product:2:v3"]).trim(),
        "1"
    );
    assert_eq!(redis_cli(redis.port, &["EXISTS", "other:1"]).trim(), "1");
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The Parquet pipeline as the reader.
fn parquet_with_a_reader(dir: &Path) {
    pg::psql(&format!(
        "CREATE SCHEMA lp_pq;
         CREATE TABLE lp_pq.customer_orders (id text PRIMARY KEY, doc jsonb NOT NULL,
             updated_at timestamptz NOT NULL DEFAULT now());
         CREATE PUBLICATION refract_lp_pq FOR TABLE lp_pq.customer_orders;
         GRANT USAGE ON SCHEMA lp_pq TO {READER};
         GRANT SELECT ON lp_pq.customer_orders TO {READER};"
    ));
    for (id, customer, items) in [("o1", 1, 2), ("o2", 2, 1), ("o3", 1, 3)] {
        let order = parquet::order(id, customer, items, serde_json::json!({}));
        pg::psql(&format!(
            "INSERT INTO lp_pq.customer_orders (id, doc) VALUES ('{id}', '{}')",
            order["doc"].as_str().unwrap().replace('\'', "''")
        ));
    }
    let pq = dir.join("parquet");
    std::fs::create_dir_all(&pq).unwrap();
    let file = shipped_pipeline(&pq, "orders-analytics", "lp_pq");
    let out_dir = pq.join("out");
    let env = [("OBJECT_STORE_URL", format!("file://{}", out_dir.display()))];
    let out = run(&file, READER, WRITER, &env);
    assert!(
        out.status.success(),
        "parquet as {READER}: {}",
        stderr(&out)
    );
    let read = parquet::read_back(&out_dir.join("analytics"));
    let orders = parquet::parquet_orders(&read);
    assert_eq!(orders.len(), 3, "{read}");
}
