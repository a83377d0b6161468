//! A slot the server invalidated (`wal_status = lost`, WAL removed past `max_slot_wal_keep_size`)
//! makes `refract run` stop with instructions instead of resuming silently with changes missing.
//!
//! It lowers `max_slot_wal_keep_size` for the whole server for a moment, so it lives in a test
//! binary of its own (cargo runs test binaries one after another) and restores the setting when
//! it ends, also on failure.

mod common;

use std::time::{Duration, Instant};

use common::pg::{Cleanup, catch_up, psql};
use common::refract;

/// Lowers `max_slot_wal_keep_size` while alive.
struct KeepSize;

impl KeepSize {
    fn set(size: &str) -> Self {
        psql(&format!(
            "ALTER SYSTEM SET max_slot_wal_keep_size = '{size}'"
        ));
        psql("SELECT pg_reload_conf()");
        KeepSize
    }
}

impl Drop for KeepSize {
    fn drop(&mut self) {
        psql("ALTER SYSTEM RESET max_slot_wal_keep_size");
        psql("SELECT pg_reload_conf()");
    }
}

#[test]
fn an_invalidated_slot_stops_the_pipeline_with_instructions() {
    let t = "slot_lost";
    let _cleanup = Cleanup::new(t, &[t, "slot_lost_filler"]);
    psql(&format!(
        "CREATE TABLE public.{t} (id int PRIMARY KEY, v text);
         INSERT INTO public.{t} VALUES (1, 'a');"
    ));
    let dir = tempfile::tempdir().unwrap();
    let pipeline = dir.path().join("p.toml");
    std::fs::write(
        &pipeline,
        format!(
            r#"[pipeline]
name = "{t}"
state_dir = "{state}"
[source]
kind = "postgres"
url = "{url}"
tables = ["public.{t}"]
[projections.replica]
kind = "replica"
sinks = ["null"]
[sinks.null]
kind = "null"
"#,
            state = dir.path().join("state").display(),
            url = common::pg::url(),
        ),
    )
    .unwrap();
    catch_up(&pipeline);
    psql(&format!("INSERT INTO public.{t} VALUES (2, 'b')"));

    // While refract is not running, the server moves on and drops the slot's WAL.
    let _keep = KeepSize::set("32MB");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        psql(
            "DROP TABLE IF EXISTS public.slot_lost_filler;
             CREATE TABLE public.slot_lost_filler AS
               SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 100000) g;
             SELECT pg_switch_wal();
             CHECKPOINT;",
        );
        let status = psql(&format!(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'refract_{t}'"
        ));
        if status == "lost" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot was not invalidated (wal_status {status})"
        );
    }

    let run = refract()
        .args(["run", "--until-caught-up"])
        .arg(&pipeline)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "refract resumed from a lost slot");
    assert!(
        stderr.contains("was invalidated (wal_status = lost)")
            && stderr.contains("Refusing to resume")
            && stderr.contains("refract drop"),
        "{stderr}"
    );
    println!(
        "slot lost: refract exited with {} and said: {}",
        run.status,
        stderr.lines().last().unwrap_or_default()
    );
}
