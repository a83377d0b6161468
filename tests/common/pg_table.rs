//! The table of the PostgreSQL source's tests (`id, name, qty, price numeric, note`), what the
//! read model must hold of it, and a write load on it (pgbench).

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use serde_json::Value;

use super::Running;
use super::pg::{drop_slot, pgbench, psql, url as pg_url};

/// A fresh table `name` (id, name, qty, price numeric, note text), with its slot and publication
/// removed from earlier runs.
pub fn fresh_table(name: &str) {
    drop_slot(name);
    psql(&format!(
        "DROP TABLE IF EXISTS public.{name};
         CREATE TABLE public.{name} (id int PRIMARY KEY, name text NOT NULL, qty int, price numeric(20,2), note text);"
    ));
}

/// The table as the read model must hold it: key → document.
pub fn table_state(name: &str) -> BTreeMap<(String, String), Value> {
    let json = psql(&format!(
        "SELECT coalesce(json_agg(json_build_object('id', id, 'name', name, 'qty', qty, 'price', price::text, 'note', note)), '[]') FROM public.{name}"
    ));
    let rows: Vec<Value> = serde_json::from_str(&json).unwrap();
    rows.into_iter()
        .map(|r| ((name.to_owned(), r["id"].to_string()), r))
        .collect()
}

/// A fresh table of `rows` rows (no note).
pub fn filled_table(name: &str, rows: u64) {
    fresh_table(name);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'row ' || g, g % 13, g * 0.25, NULL FROM generate_series(1, {rows}) g"
    ));
}

/// Stops a load from [`update_delete_load`]; returns whether it was still running.
pub fn stop_load(load: Running) -> bool {
    let mut load = load.into_child();
    let running = load.try_wait().unwrap().is_none();
    if running {
        load.kill().unwrap();
        load.wait().unwrap();
    } else {
        assert!(load.wait().unwrap().success(), "pgbench failed");
    }
    running
}

/// A writer of random updates and deletes at `rate` transactions/s (two statements each), for
/// `seconds`, through pgbench (killed if the test fails before [`stop_load`]).
pub fn update_delete_load(name: &str, rows: u64, rate: u32, seconds: u32) -> Running {
    let script = std::env::temp_dir().join(format!("refract_{name}_load.sql"));
    std::fs::write(
        &script,
        format!(
            "\\set u random(1, {rows})\n\\set d random(1, {rows})\n\
             UPDATE {name} SET qty = coalesce(qty, 0) + 1, name = 'load ' || :u WHERE id = :u;\n\
             DELETE FROM {name} WHERE id = :d;\n"
        ),
    )
    .unwrap();
    Command::new(pgbench())
        .args([
            "-n",
            "-c",
            "2",
            "-R",
            &rate.to_string(),
            "-T",
            &seconds.to_string(),
            "-f",
        ])
        .arg(&script)
        .arg(pg_url())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map(Running::adopt)
        .expect("pgbench starts")
}
