//! A database of the test's own on the test server (`PG_URL`): created afresh (an earlier
//! run's is dropped with its slots), dropped with its slots when the test ends, also when it
//! fails. Replication slots are cluster-wide, so each test names its own.

use std::process::Command;

/// A database of the test's own.
pub struct TestDb {
    pub name: String,
    /// Replication slots to drop with the database.
    pub slots: Vec<String>,
}

impl TestDb {
    /// Creates database `name` afresh, runs `schema` in it.
    pub fn create(name: &str, slots: &[&str], schema: &str) -> Self {
        let db = TestDb {
            name: name.to_owned(),
            slots: slots.iter().map(|s| (*s).to_owned()).collect(),
        };
        db.drop_all();
        super::pg::psql(&format!("CREATE DATABASE {name}"));
        db.psql(schema);
        db
    }

    fn drop_all(&self) {
        for slot in &self.slots {
            // A slot still held by a dying walsender cannot be dropped at once.
            let _ = psql_at(
                &super::pg::url(),
                &format!(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                     WHERE slot_name = '{slot}' AND active_pid IS NOT NULL"
                ),
            );
            let _ = psql_at(
                &super::pg::url(),
                &format!(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = '{slot}'"
                ),
            );
        }
        super::pg::psql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }

    /// The URL of this database.
    pub fn url(&self) -> String {
        let base = super::pg::url();
        let root = base.rsplit_once('/').map_or(base.as_str(), |(r, _)| r);
        format!("{root}/{}", self.name)
    }

    /// Runs SQL in this database; psql's unaligned output (fails the test on an error).
    pub fn psql(&self, sql: &str) -> String {
        psql_at(&self.url(), sql).unwrap_or_else(|e| panic!("psql failed on {sql}: {e}"))
    }

    /// A client of this database.
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url(), postgres::NoTls).expect("the test database answers")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::env::var_os("REFRACT_TEST_KEEP_DB").is_none() {
            self.drop_all();
        }
    }
}

/// Runs SQL at `url`; psql's unaligned output, or its error.
pub fn psql_at(url: &str, sql: &str) -> Result<String, String> {
    let out = Command::new("psql")
        .args([url, "-X", "-v", "ON_ERROR_STOP=1", "-Atqc", sql])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}
