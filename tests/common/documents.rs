//! The document read models' end-to-end helpers (tests/documents.rs, tests/documents_bulk.rs):
//! the shipped pipelines on a schema of their own, the showcase tables, `refract verify`.

use std::path::{Path, PathBuf};

use super::pg::psql;
use super::{output, refract};

/// The shipped pipeline `pipelines/{file}.toml`, on the tables of schema `schema` and with read
/// models in `{schema}_rm`, under its own pipeline (slot) name.
pub fn shipped_pipeline(dir: &Path, file: &str, schema: &str) -> PathBuf {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../pipelines/{file}.toml")),
    )
    .unwrap();
    let text = shipped
        .replace(
            &format!("name = \"{file}\""),
            &format!("name = \"{schema}\""),
        )
        .replace("public.", &format!("{schema}."))
        .replace(
            "schema = \"read_models\"",
            &format!("schema = \"{schema}_rm\""),
        )
        .replace(
            "on_error = \"dead_letter\"",
            "on_error = \"dead_letter\"\n[pipeline.batch]\nmax_delay_ms = 50",
        );
    assert!(text.contains(&format!("name = \"{schema}\"")));
    let path = dir.join(format!("{file}.toml"));
    std::fs::write(
        &path,
        text.replace(
            "${STATE_DIR:-./state}",
            &dir.join("state").display().to_string(),
        ),
    )
    .unwrap();
    path
}

/// The shipped `pipelines/authors-books.toml` on the tables of `schema`.
pub fn pipeline_file(dir: &Path, schema: &str) -> PathBuf {
    shipped_pipeline(dir, "authors-books", schema)
}

/// The showcase tables (`../shared/showcase/authors_books.sql`) in a fresh schema.
pub fn fresh_schema(schema: &str) {
    psql(&format!(
        "SET client_min_messages = warning;
         DROP SCHEMA IF EXISTS {schema} CASCADE; DROP SCHEMA IF EXISTS {schema}_rm CASCADE;
         CREATE SCHEMA {schema};
         CREATE TABLE {schema}.authors (id text PRIMARY KEY, first_name text NOT NULL, last_name text NOT NULL,
             thumbnail_url text, profile_url text, large_url text, updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE {schema}.books (id text PRIMARY KEY, name text NOT NULL, published_on date,
             updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE {schema}.book_authors (
             book_id text NOT NULL REFERENCES {schema}.books(id) ON DELETE CASCADE,
             author_id text NOT NULL REFERENCES {schema}.authors(id) ON DELETE CASCADE,
             position int NOT NULL DEFAULT 0, PRIMARY KEY (book_id, author_id));"
    ));
}

/// `refract verify PIPELINE`: its exit code and its report (stdout, then stderr).
pub fn verify(pipeline: &Path) -> (i32, String) {
    let out = output(refract().arg("verify").arg(pipeline));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), format!("{stdout}{stderr}"))
}

/// `refract run PIPELINE --until-caught-up`, asserting success.
pub fn catch_up(pipeline: &Path) {
    let out = output(refract().arg("run").arg(pipeline).arg("--until-caught-up"));
    assert!(
        out.status.success(),
        "catch-up failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
