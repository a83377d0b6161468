//! `refract plan`, `refract drop` and a failing `refract backfill` against the real local
//! PostgreSQL (`PG_URL`, default `postgres://postgres@127.0.0.1:5432/refract`, in logical mode:
//! `scripts/test` prepares it). Each test works on its own `adm_*` tables, slot and publication,
//! and drops them at the end.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::pg::{drop_slot, psql, url as pg_url};
use common::*;

fn fresh_table(name: &str) {
    drop_slot(name);
    psql(&format!(
        "DROP TABLE IF EXISTS public.{name};
         CREATE TABLE public.{name} (id int PRIMARY KEY, name text NOT NULL, note text);"
    ));
}

fn slot_exists(name: &str) -> bool {
    psql(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'refract_{name}'"
    )) == "1"
}

fn publication_exists(name: &str) -> bool {
    psql(&format!(
        "SELECT count(*) FROM pg_publication WHERE pubname = 'refract_{name}'"
    )) == "1"
}

/// A pipeline `name` reading `tables` into `{dir}/out`, state in `{dir}/state`, with `source_extra`
/// TOML lines in `[source]` and `url` as the source URL.
fn pipeline_at(
    dir: &Path,
    file: &str,
    name: &str,
    url: &str,
    tables: &[&str],
    source_extra: &str,
) -> PathBuf {
    let tables: Vec<String> = tables.iter().map(|t| format!("\"{t}\"")).collect();
    let text = format!(
        r#"[pipeline]
name = "{name}"
state_dir = "{state}"

[pipeline.batch]
max_delay_ms = 50

[source]
kind = "postgres"
url = "{url}"
tables = [{tables}]
{source_extra}

[projections.replica]
kind = "replica"
sinks = ["docs"]

[sinks.docs]
kind = "object_json"
url = "file://{out}"
"#,
        state = dir.join("state").display(),
        tables = tables.join(", "),
        out = dir.join("out").display()
    );
    let path = dir.join(file);
    std::fs::write(&path, text).unwrap();
    path
}

fn pipeline(dir: &Path, name: &str) -> PathBuf {
    pipeline_with(dir, name, "")
}

/// `pipeline` with `source_extra` lines in `[source]`.
fn pipeline_with(dir: &Path, name: &str, source_extra: &str) -> PathBuf {
    pipeline_at(
        dir,
        "pipeline.toml",
        name,
        &pg_url(),
        &[&format!("public.{name}")],
        source_extra,
    )
}

fn text(out: &Output) -> (Option<i32>, String, String) {
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn plan(pipeline: &Path) -> String {
    let (code, stdout, stderr) = text(&output(refract().arg("plan").arg(pipeline)));
    assert_eq!(code, Some(0), "plan failed: {stdout}{stderr}");
    stdout
}

fn drop_cmd(pipeline: &Path, yes: bool) -> (Option<i32>, String, String) {
    let mut cmd = refract();
    cmd.arg("drop").arg(pipeline);
    if yes {
        cmd.arg("--yes");
    }
    text(&output(&mut cmd))
}

fn catch_up(pipeline: &Path) -> String {
    let (code, stdout, stderr) = text(&output(
        refract().arg("run").arg(pipeline).arg("--until-caught-up"),
    ));
    assert_eq!(code, Some(0), "catch-up failed: {stdout}{stderr}");
    stdout
}

/// The lines of `plan` output that are warnings.
fn warnings(plan: &str) -> Vec<&str> {
    plan.lines().filter(|l| l.starts_with("warning:")).collect()
}

#[test]
fn plan_shows_replica_identity_and_keys_and_warns_for_a_table_without_primary_key() {
    let name = "adm_plan";
    drop_slot(name);
    psql(
        "DROP TABLE IF EXISTS public.adm_plan_pk, public.adm_plan_nopk, public.adm_plan_full;
         DROP SCHEMA IF EXISTS adm_plans CASCADE;
         CREATE TABLE public.adm_plan_pk (id int PRIMARY KEY, body text);
         CREATE TABLE public.adm_plan_nopk (a int, b text);
         CREATE TABLE public.adm_plan_full (id int PRIMARY KEY, body text);
         ALTER TABLE public.adm_plan_full REPLICA IDENTITY FULL;
         CREATE SCHEMA adm_plans;
         CREATE TABLE adm_plans.one (tenant int, id int, PRIMARY KEY (tenant, id));
         CREATE TABLE adm_plans.two (code text NOT NULL UNIQUE, v int);
         ALTER TABLE adm_plans.two REPLICA IDENTITY USING INDEX two_code_key;",
    );
    let dir = tempfile::tempdir().unwrap();
    // A password in the URL never shows (the local server trusts the connection anyway).
    let url = pg_url().replacen("postgres://postgres@", "postgres://postgres:s3cr3t@", 1);
    let file = pipeline_at(
        dir.path(),
        "pipeline.toml",
        name,
        &url,
        &[
            "public.adm_plan_pk",
            "public.adm_plan_nopk",
            "public.adm_plan_full",
            "adm_plans.*",
        ],
        "",
    );
    let out = plan(&file);
    assert!(!out.contains("s3cr3t"), "{out}");
    assert!(
        out.contains("slot        `refract_adm_plan` does not exist: `refract run` creates it"),
        "{out}"
    );
    assert!(
        out.contains("publication `refract_adm_plan` does not exist: `refract run` creates it")
            && out.contains("TABLES IN SCHEMA adm_plans")
            && out.contains(": 5 tables now"),
        "{out}"
    );
    let row = |table: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(&format!("{table} ")))
            .unwrap_or_else(|| panic!("no line for {table} in\n{out}"))
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        row("public.adm_plan_pk"),
        "replica identity default, primary key (id)"
    );
    assert_eq!(
        row("public.adm_plan_nopk"),
        "replica identity default, no primary key"
    );
    assert_eq!(
        row("public.adm_plan_full"),
        "replica identity full, primary key (id)"
    );
    // `schema.*` lists the tables it covers.
    assert_eq!(
        row("adm_plans.one"),
        "replica identity default, primary key (tenant, id)"
    );
    assert_eq!(
        row("adm_plans.two"),
        "replica identity index two_code_key (code), no primary key"
    );
    let warned = warnings(&out);
    assert_eq!(warned.len(), 1, "only the table without a key: {out}");
    assert!(
        warned[0]
            .contains("`public.adm_plan_nopk` has no primary key and REPLICA IDENTITY DEFAULT")
            && warned[0].contains("rejects its UPDATE and DELETE")
            && warned[0].contains("refract has no key for its documents"),
        "{out}"
    );
    assert!(
        out.contains("note: `public.adm_plan_nopk` has no primary key: the initial snapshot and `refract backfill` leave it out"),
        "{out}"
    );
    // TOAST is a note, for tables with text columns whose identity is not FULL.
    let toast: Vec<&str> = out.lines().filter(|l| l.contains("TOASTed")).collect();
    assert_eq!(toast.len(), 2, "{out}");
    assert!(
        toast[0].starts_with("note: `adm_plans.two` has REPLICA IDENTITY USING INDEX")
            && toast[0].contains("(code)"),
        "{out}"
    );
    assert!(
        toast[1].starts_with("note: `public.adm_plan_pk` has REPLICA IDENTITY DEFAULT")
            && toast[1].contains("(body)"),
        "{out}"
    );
    // plan changed nothing.
    assert!(!slot_exists(name) && !publication_exists(name));
    psql(
        "DROP TABLE public.adm_plan_pk, public.adm_plan_nopk, public.adm_plan_full;
         DROP SCHEMA adm_plans CASCADE;",
    );
}

#[test]
fn plan_reports_the_slot_when_it_exists_and_when_it_is_absent() {
    let name = "adm_slot";
    fresh_table(name);
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), name);
    catch_up(&file);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'n' || g, NULL FROM generate_series(1, 100) g"
    ));
    let out = plan(&file);
    let slot = out
        .lines()
        .find(|l| l.starts_with("  slot "))
        .unwrap_or_else(|| panic!("no slot line in\n{out}"));
    assert!(
        slot.contains(
            "`refract_adm_slot` exists, not active, wal_status reserved, confirmed_flush_lsn "
        ) && slot.contains(" of WAL"),
        "{out}"
    );
    assert!(
        out.contains("publication `refract_adm_slot` exists, publishes insert, update, delete, truncate: 1 table"),
        "{out}"
    );
    assert!(warnings(&out).is_empty(), "{out}");
    assert!(!out.contains("covers other tables"), "{out}");

    // The slot gone (as after `pg_drop_replication_slot`): created again by the next run, or,
    // with `create = false`, a warning that the run will fail.
    psql(&format!(
        "SELECT pg_drop_replication_slot('refract_{name}')"
    ));
    let out = plan(&file);
    assert!(
        out.contains("slot        `refract_adm_slot` does not exist: `refract run` creates it"),
        "{out}"
    );
    let strict = pipeline_at(
        dir.path(),
        "strict.toml",
        name,
        &pg_url(),
        &[],
        "create = false",
    );
    // A table of the database the publication does not cover (whatever other tests left).
    psql("CREATE TABLE IF NOT EXISTS public.adm_slot_other (id int PRIMARY KEY)");
    let out = plan(&strict);
    psql("DROP TABLE IF EXISTS public.adm_slot_other");
    assert!(
        warnings(&out).iter().any(|w| w.contains(
            "slot `refract_adm_slot` does not exist and `create = false`: `refract run` will fail"
        )),
        "{out}"
    );
    // Its `tables = []` (every table) is not what the existing publication covers.
    assert!(
        out.contains("publication `refract_adm_slot` exists and covers other tables than `tables` in the file")
            && out.contains("in the file, not published: "),
        "{out}"
    );
    drop_slot(name);
    psql(&format!("DROP TABLE public.{name}"));
}

#[test]
fn plan_without_the_database_shows_the_file_plan_and_why_it_could_not_connect() {
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline_at(
        dir.path(),
        "pipeline.toml",
        "adm_offline",
        "postgres://postgres@127.0.0.1:1/refract",
        &["public.adm_offline"],
        "",
    );
    let out = plan(&file);
    assert!(
        out.contains("reads  PostgreSQL postgres://postgres@127.0.0.1:1/refract through slot `refract_adm_offline`"),
        "{out}"
    );
    assert!(
        out.contains("could not connect") && out.contains("refused"),
        "{out}"
    );
    assert!(out.contains("projects `replica`"), "{out}");
}

#[test]
fn a_run_on_a_table_that_does_not_exist_fails_with_the_servers_reason() {
    let name = "adm_missing";
    drop_slot(name);
    psql(&format!(
        "DROP TABLE IF EXISTS public.{name};
         SET client_min_messages = warning; DROP PUBLICATION IF EXISTS refract_{name};"
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), name);
    let (code, stdout, stderr) = text(&output(
        refract().arg("run").arg(&file).arg("--until-caught-up"),
    ));
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    // The server's message, not tokio-postgres' bare "db error".
    assert!(
        stderr.contains(&format!("cannot create publication `refract_{name}`"))
            && stderr.contains(&format!("relation \"public.{name}\" does not exist")),
        "{stderr}"
    );
    assert!(!publication_exists(name) && !slot_exists(name));
}

#[test]
fn drop_asks_for_yes_then_drops_slot_publication_and_state_and_the_next_run_starts_fresh() {
    let name = "adm_drop";
    fresh_table(name);
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), name);
    let state = dir.path().join("state").join(name);
    catch_up(&file);
    psql(&format!("INSERT INTO {name} VALUES (1, 'one', NULL)"));
    catch_up(&file);
    assert!(dir.path().join(format!("out/{name}/1.json")).exists());
    assert!(slot_exists(name) && publication_exists(name) && state.exists());

    // Without --yes: the list, exit 2, nothing dropped.
    let (code, stdout, stderr) = drop_cmd(&file, false);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stdout.contains("replication slot `refract_adm_drop`")
            && stdout.contains("publication `refract_adm_drop`")
            && stdout.contains(&format!("state directory {}", state.display()))
            && stdout.contains("checkpoint.redb")
            && stdout.contains("--yes"),
        "{stdout}"
    );
    assert!(slot_exists(name) && publication_exists(name) && state.exists());

    // With --yes: all three gone; the read models stay.
    let (code, stdout, stderr) = drop_cmd(&file, true);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("dropped replication slot `refract_adm_drop`")
            && stdout.contains("dropped publication `refract_adm_drop`")
            && stdout.contains("removed state directory"),
        "{stdout}"
    );
    assert!(!slot_exists(name), "slot dropped");
    assert!(!publication_exists(name), "publication dropped");
    assert!(!state.exists(), "state removed");
    assert!(dir.path().join(format!("out/{name}/1.json")).exists());
    let out = plan(&file);
    assert!(
        out.contains("checkpoint: none yet") && out.contains("`refract_adm_drop` does not exist"),
        "{out}"
    );

    // The next run starts fresh: new slot and publication, no checkpoint to resume from, and
    // changes from then on flow.
    let summary = catch_up(&file);
    assert!(!summary.contains("resumed from"), "{summary}");
    assert!(slot_exists(name) && publication_exists(name) && state.exists());
    psql(&format!(
        "INSERT INTO {name} VALUES (3, 'three', NULL); UPDATE {name} SET name = 'uno' WHERE id = 1"
    ));
    catch_up(&file);
    let docs = read_output(&dir.path().join("out"));
    assert_eq!(
        docs[&(name.to_owned(), "3".to_owned())]["name"],
        "three",
        "{docs:?}"
    );
    assert_eq!(docs[&(name.to_owned(), "1".to_owned())]["name"], "uno");

    // Dropped again; then there is nothing left to drop.
    assert_eq!(drop_cmd(&file, true).0, Some(0));
    let (code, stdout, _) = drop_cmd(&file, false);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("nothing to drop"), "{stdout}");
    psql(&format!("DROP TABLE public.{name}"));
}

#[test]
fn drop_leaves_a_publication_refract_did_not_create() {
    let name = "adm_keep";
    fresh_table(name);
    psql(&format!(
        "CREATE PUBLICATION refract_{name} FOR TABLE public.{name}"
    ));
    // A separate transaction: a slot cannot be created in one that wrote.
    psql(&format!(
        "SELECT 1 FROM pg_create_logical_replication_slot('refract_{name}', 'pgoutput')"
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline_at(
        dir.path(),
        "pipeline.toml",
        name,
        &pg_url(),
        &[],
        "create = false",
    );
    let (code, stdout, stderr) = drop_cmd(&file, false);
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stdout.contains("replication slot `refract_adm_keep`")
            && stdout.contains(
                "publication `refract_adm_keep`, left in place: with `create = false` refract did not create it"
            ),
        "{stdout}"
    );
    let (code, stdout, stderr) = drop_cmd(&file, true);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("dropped replication slot `refract_adm_keep`")
            && !stdout.contains("dropped publication")
            && stdout.contains("  publication `refract_adm_keep`, left in place"),
        "{stdout}"
    );
    assert!(!slot_exists(name));
    assert!(
        publication_exists(name),
        "a publication refract did not create stays"
    );
    drop_slot(name);
    psql(&format!("DROP TABLE public.{name}"));
}

#[test]
fn drop_refuses_while_a_daemon_runs_the_pipeline() {
    let name = "adm_busy";
    fresh_table(name);
    let dir = tempfile::tempdir().unwrap();
    let file = pipeline(dir.path(), name);
    let state = dir.path().join("state").join(name);
    catch_up(&file);

    let mut daemon = streaming_daemon(name, &file);

    // The same pipeline: its state is locked by the daemon.
    for yes in [false, true] {
        let (code, stdout, stderr) = drop_cmd(&file, yes);
        assert_eq!(code, Some(1), "--yes {yes}: {stdout}{stderr}");
        assert!(
            stderr.contains("in use by a running refract process")
                && stderr.contains("Nothing was dropped"),
            "{stderr}"
        );
    }
    // Another pipeline file naming the same slot: the slot is active.
    let other = pipeline_at(
        dir.path(),
        "other.toml",
        "adm_busy_other",
        &pg_url(),
        &[],
        &format!("slot = \"refract_{name}\"\npublication = \"refract_{name}\""),
    );
    let (code, stdout, stderr) = drop_cmd(&other, true);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("replication slot `refract_adm_busy` is active (in use by server process"),
        "{stderr}"
    );
    assert!(slot_exists(name) && publication_exists(name) && state.exists());

    // Stopped, it can be dropped.
    daemon.terminate();
    let status = daemon.child().wait().unwrap();
    assert!(status.success(), "the daemon drained and exited 0");
    let (code, stdout, stderr) = drop_cmd(&file, true);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(!slot_exists(name) && !publication_exists(name) && !state.exists());
    psql(&format!("DROP TABLE public.{name}"));
}

/// A fresh table `name` of 100 rows and a pipeline on it without an initial snapshot (only a
/// backfill reads the rows), in `dir`.
fn hundred_rows_to_backfill(dir: &Path, name: &str) -> PathBuf {
    fresh_table(name);
    psql(&format!(
        "INSERT INTO {name} SELECT g, 'row ' || g, NULL FROM generate_series(1, 100) g"
    ));
    pipeline_with(dir, name, "snapshot = \"never\"")
}

/// `refract run` on `file` (pipeline `name`), its output dropped, once it streams from the slot.
fn streaming_daemon(name: &str, file: &Path) -> Running {
    let mut daemon = quiet_daemon(file);
    wait_until_streaming(name, &mut daemon);
    daemon
}

/// Waits until the daemon streams from the pipeline's slot.
fn wait_until_streaming(name: &str, daemon: &mut Running) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while psql(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'refract_{name}' AND active"
    )) != "1"
    {
        assert!(Instant::now() < deadline, "the daemon never took the slot");
        assert!(
            daemon.child().try_wait().unwrap().is_none(),
            "the daemon ended"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_backfill_the_daemon_cannot_read_is_reported_and_the_daemon_goes_on() {
    let name = "adm_backfill_err";
    // The name of the temporary slot the daemon exports the backfill's snapshot from.
    let blocker = format!("refract_{name}_backfill");
    let drop_blocker = || drop_slot(&format!("{name}_backfill"));
    drop_blocker();
    let dir = tempfile::tempdir().unwrap();
    let file = hundred_rows_to_backfill(dir.path(), name);
    catch_up(&file);
    // Taken by another slot: the daemon cannot create its temporary slot.
    psql(&format!(
        "SELECT 1 FROM pg_create_logical_replication_slot('{blocker}', 'pgoutput')"
    ));
    let mut daemon = streaming_daemon(name, &file);
    let (code, stdout, stderr) = text(&output(refract().arg("backfill").arg(&file)));
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("the daemon could not read the backfill")
            && stderr.contains(&blocker)
            && stderr.contains("already exists"),
        "{stderr}"
    );
    // `refract plan` shows the failure the daemon recorded.
    let (code, plan, stderr) = text(&output(refract().arg("plan").arg(&file)));
    assert_eq!(code, Some(0), "{plan}{stderr}");
    assert!(
        plan.lines().any(|l| l
            .trim_start()
            .starts_with("backfill    of every table, request ")
            && l.contains("failed:")
            && l.contains(&blocker)),
        "{plan}"
    );
    // The daemon goes on; once the name is free, the same backfill goes through it.
    drop_blocker();
    psql(&format!("UPDATE {name} SET note = 'after' WHERE id = 1"));
    let (code, stdout, stderr) = text(&output(refract().arg("backfill").arg(&file)));
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("applied by the running daemon") && stdout.contains("100 rows"),
        "{stdout}"
    );
    assert!(
        daemon.child().try_wait().unwrap().is_none(),
        "the daemon still runs"
    );
    let (code, plan, stderr) = text(&output(refract().arg("plan").arg(&file)));
    assert_eq!(code, Some(0), "{plan}{stderr}");
    assert!(
        plan.lines()
            .any(|l| l.trim_start().starts_with("backfill    of every table")
                && l.ends_with(": complete, 100 rows")),
        "{plan}"
    );
    daemon.terminate();
    assert!(daemon.child().wait().unwrap().success());
    let docs = dir.path().join("out").join(name);
    assert_eq!(std::fs::read_dir(&docs).unwrap().count(), 100);
    let first = std::fs::read_to_string(docs.join("1.json")).unwrap();
    assert!(first.contains("\"note\":\"after\""), "{first}");
    let (code, stdout, stderr) = drop_cmd(&file, true);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    psql(&format!("DROP TABLE public.{name}"));
}

#[test]
fn a_backfill_beside_a_daemon_is_written_without_waiting_for_the_batch_delay() {
    let name = "adm_backfill_delay";
    let dir = tempfile::tempdir().unwrap();
    let file = hundred_rows_to_backfill(dir.path(), name);
    // Batches that wait up to a minute for more events to fill them.
    let toml = std::fs::read_to_string(&file).unwrap();
    assert!(toml.contains("max_delay_ms = 50"), "{toml}");
    std::fs::write(
        &file,
        toml.replace("max_delay_ms = 50", "max_delay_ms = 60000"),
    )
    .unwrap();
    catch_up(&file);
    let mut daemon = streaming_daemon(name, &file);
    // The backfill's last rows end the daemon's batch: the backfill is durable, and done, well
    // before the minute a partial batch would wait.
    let mut backfill = Running::spawn(
        refract()
            .arg("backfill")
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while backfill.child().try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the backfill's rows waited for the batch delay"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, stdout, stderr) = text(&backfill.wait_with_output());
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("applied by the running daemon") && stdout.contains("100 rows"),
        "{stdout}"
    );
    let docs = dir.path().join("out").join(name);
    assert_eq!(std::fs::read_dir(&docs).unwrap().count(), 100);
    daemon.terminate();
    assert!(daemon.child().wait().unwrap().success());
    let (code, stdout, stderr) = drop_cmd(&file, true);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    psql(&format!("DROP TABLE public.{name}"));
}
