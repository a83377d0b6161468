//! The control table: one row per migration, read by applications (which table to read and
//! write: `read_from`) and operators (phase, positions, progress, last verification).
//!
//! `refract migrate cutover` and `rollback` ask for a switch by setting `requested_read_from`;
//! the table is published to the migration's slot, so the dual write sees the request at its
//! place in the stream and flips `read_from` (and notifies the `refract_migration` channel)
//! once every earlier change has been applied.

use serde::Serialize;
use serde_json::Value;
use tokio_postgres::GenericClient;

use super::{MigrationError, db};
use crate::pg_sql::{self, quote_ident, quote_table};

/// `text` as an SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The session setting that lets refract's own connections write a table the write guard
/// closes to applications.
pub const WRITER_SETTING: &str = "refract.migration_writer";
/// The trigger (and its function) that makes the table reads moved away from read-only to
/// applications, so that a write a late application makes there fails loudly instead of being
/// lost (the dual write carries changes of one table only at a time).
pub const GUARD: &str = "refract_migration_guard";

/// The channel `NOTIFY` is sent on when `read_from` changes; the payload is the control row as
/// JSON.
pub const NOTIFY_CHANNEL: &str = "refract_migration";

/// A migration's phase, as the control table spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The dual write runs (`start`); nothing copied yet.
    Started,
    /// Existing rows are being copied.
    Backfilling,
    /// Every existing row has been copied.
    Backfilled,
    /// Reads are asked to move to the target; the dual write has not reached the request yet.
    CuttingOver,
    /// Reads and writes go to the target; its changes are replicated back to the source.
    CutOver,
    /// Reads are asked to move back to the source.
    RollingBack,
    /// Reads and writes went back to the source; the dual write runs forward again.
    RolledBack,
    /// Replication stopped for good.
    Finalized,
}

impl Phase {
    /// The name in the control table.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Started => "started",
            Phase::Backfilling => "backfilling",
            Phase::Backfilled => "backfilled",
            Phase::CuttingOver => "cutting_over",
            Phase::CutOver => "cut_over",
            Phase::RollingBack => "rolling_back",
            Phase::RolledBack => "rolled_back",
            Phase::Finalized => "finalized",
        }
    }
}

/// The control table of a migration file.
#[derive(Debug, Clone)]
pub struct Control {
    table: String,
    name: String,
}

impl Control {
    /// The control table `table` (as the file names it), row `name`.
    pub fn new(table: &str, name: &str) -> Self {
        Self {
            table: quote_table(table),
            name: name.to_owned(),
        }
    }

    /// The control table quoted for SQL.
    pub fn quoted(&self) -> &str {
        &self.table
    }

    /// Creates the table when missing.
    pub async fn create_table(&self, client: &impl GenericClient) -> Result<(), MigrationError> {
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (
                    name text PRIMARY KEY,
                    source_table text NOT NULL,
                    target_table text NOT NULL,
                    phase text NOT NULL,
                    read_from text NOT NULL,
                    requested_read_from text NOT NULL,
                    slot text NOT NULL,
                    applied_position text,
                    applied_at timestamptz,
                    switch_position text,
                    switched_at timestamptz,
                    rows_copied bigint NOT NULL DEFAULT 0,
                    rows_rejected bigint NOT NULL DEFAULT 0,
                    backfill_after jsonb,
                    backfill_started_at timestamptz,
                    backfill_done_at timestamptz,
                    verified_at timestamptz,
                    verify_equal boolean,
                    verify_summary jsonb,
                    started_at timestamptz NOT NULL DEFAULT now(),
                    updated_at timestamptz NOT NULL DEFAULT now()
                )",
                self.table
            ))
            .await
            .map_err(db("cannot create the control table"))
    }

    /// Inserts the migration's row (phase `started`, reads from `source`) unless it exists.
    pub async fn register(
        &self,
        client: &impl GenericClient,
        source: &str,
        target: &str,
        slot: &str,
    ) -> Result<(), MigrationError> {
        client
            .execute(
                &format!(
                    "INSERT INTO {} (name, source_table, target_table, phase, read_from, \
                                     requested_read_from, slot) \
                     VALUES ($1, $2, $3, 'started', $2, $2, $4) ON CONFLICT (name) DO NOTHING",
                    self.table
                ),
                &[&self.name, &source, &target, &slot],
            )
            .await
            .map_err(db("cannot register the migration in the control table"))?;
        Ok(())
    }

    /// The migration's row as JSON (column name to value), `None` before `start`.
    pub async fn read(&self, client: &impl GenericClient) -> Result<Option<Value>, MigrationError> {
        let row = client
            .query_opt(
                &format!(
                    "SELECT to_jsonb(c) FROM {} AS c WHERE name = $1",
                    self.table
                ),
                &[&self.name],
            )
            .await
            .map_err(db("cannot read the control table"))?;
        Ok(row.map(|r| r.get(0)))
    }

    /// The migration's row; an error telling to run `start` first when there is none.
    pub async fn require(&self, client: &impl GenericClient) -> Result<Value, MigrationError> {
        self.read(client).await?.ok_or_else(|| {
            MigrationError::Refused(format!(
                "migration `{}` has not started: run `refract migrate FILE start` first",
                self.name
            ))
        })
    }

    /// Asks for reads to move to `to` (away from `from`), and in the same transaction closes
    /// `from` to applications' writes and opens `to`: every write committed to `from` before
    /// the request is in the stream before it, and none can follow. `to` joins `publication`
    /// (the dual write's) in that transaction if it is not in it yet.
    pub async fn request_switch(
        &self,
        client: &mut tokio_postgres::Client,
        publication: &str,
        from: &str,
        to: &str,
        phase: Phase,
    ) -> Result<(), MigrationError> {
        let tx = client
            .transaction()
            .await
            .map_err(db("cannot begin the switch request"))?;
        // After the switch the dual write replicates `to`'s changes: it is published from
        // this transaction on, so from the request on in the stream.
        publish(&tx, publication, to).await?;
        tx.batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION {GUARD}() RETURNS trigger LANGUAGE plpgsql AS $guard$
             BEGIN
               IF current_setting('{WRITER_SETTING}', true) = 'on' THEN
                 RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
               END IF;
               RAISE EXCEPTION 'table % is closed to writes by refract migrate: reads and writes go to %',
                 TG_TABLE_NAME, TG_ARGV[0] USING ERRCODE = 'read_only_sql_transaction';
             END $guard$;
             DROP TRIGGER IF EXISTS {GUARD} ON {to_q};
             DROP TRIGGER IF EXISTS {GUARD}_truncate ON {to_q};
             DROP TRIGGER IF EXISTS {GUARD} ON {from_q};
             DROP TRIGGER IF EXISTS {GUARD}_truncate ON {from_q};
             CREATE TRIGGER {GUARD} BEFORE INSERT OR UPDATE OR DELETE ON {from_q}
               FOR EACH ROW EXECUTE FUNCTION {GUARD}({to_lit});
             CREATE TRIGGER {GUARD}_truncate BEFORE TRUNCATE ON {from_q}
               FOR EACH STATEMENT EXECUTE FUNCTION {GUARD}({to_lit});",
            from_q = quote_table(from),
            to_q = quote_table(to),
            to_lit = literal(to),
        ))
        .await
        .map_err(db(format!("cannot close `{from}` to writes")))?;
        self.update(
            &tx,
            "requested_read_from = $2, phase = $3",
            &[&to, &phase.name()],
        )
        .await?;
        tx.commit()
            .await
            .map_err(db("cannot commit the switch request"))
    }

    /// Removes the write guard from `table` (at `finalize`).
    pub async fn open_writes(
        &self,
        client: &impl GenericClient,
        table: &str,
    ) -> Result<(), MigrationError> {
        let q = quote_table(table);
        client
            .batch_execute(&format!(
                "DROP TRIGGER IF EXISTS {GUARD} ON {q}; DROP TRIGGER IF EXISTS {GUARD}_truncate ON {q};"
            ))
            .await
            .map_err(db(format!("cannot open `{table}` to writes")))
    }

    /// Sets `phase` (and `updated_at`).
    pub async fn set_phase(
        &self,
        client: &impl GenericClient,
        phase: Phase,
    ) -> Result<(), MigrationError> {
        self.update(client, "phase = $2", &[&phase.name()]).await
    }

    /// Runs `UPDATE control SET {set}, updated_at = now() WHERE name = $1`, `params` being `$2…`.
    pub async fn update(
        &self,
        client: &impl GenericClient,
        set: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<(), MigrationError> {
        self.update_with(client, self.update_sql(set).as_str(), params)
            .await
    }

    /// Prepares on `client` the statement of [`Control::update`] with `set`, for
    /// [`Control::update_with`].
    pub async fn prepare_update(
        &self,
        client: &impl GenericClient,
        set: &str,
    ) -> Result<tokio_postgres::Statement, MigrationError> {
        client
            .prepare(&self.update_sql(set))
            .await
            .map_err(db("cannot update the control table"))
    }

    /// [`Control::update`] with `statement`: its SQL text, or a statement
    /// [`Control::prepare_update`] prepared on `client`.
    pub async fn update_with<S>(
        &self,
        client: &impl GenericClient,
        statement: &S,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<(), MigrationError>
    where
        S: tokio_postgres::ToStatement + Sync + Send + ?Sized,
    {
        let mut all: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&self.name];
        all.extend_from_slice(params);
        client
            .execute(statement, &all)
            .await
            .map_err(db("cannot update the control table"))?;
        Ok(())
    }

    /// The statement of [`Control::update`].
    fn update_sql(&self, set: &str) -> String {
        format!(
            "UPDATE {} SET {set}, updated_at = now() WHERE name = $1",
            self.table
        )
    }

    /// Records that reads now go to `read_from` (at source position `position`), and notifies
    /// listeners on [`NOTIFY_CHANNEL`] when the transaction commits.
    pub async fn switch(
        &self,
        client: &impl GenericClient,
        read_from: &str,
        position: &str,
    ) -> Result<(), MigrationError> {
        client
            .execute(
                &format!(
                    "UPDATE {} SET read_from = $2, switch_position = $3, switched_at = now(), \
                       updated_at = now(), \
                       phase = CASE WHEN $2 = target_table THEN 'cut_over' ELSE 'rolled_back' END \
                     WHERE name = $1",
                    self.table
                ),
                &[&self.name, &read_from, &position],
            )
            .await
            .map_err(db("cannot record the switch in the control table"))?;
        client
            .execute(
                &format!(
                    "SELECT pg_notify('{NOTIFY_CHANNEL}', to_jsonb(c)::text) FROM {} AS c \
                     WHERE name = $1",
                    self.table
                ),
                &[&self.name],
            )
            .await
            .map_err(db("cannot notify the switch"))?;
        Ok(())
    }
}

/// Creates publication `name` of `tables` unless it exists. The dual write's publication starts
/// with the source and the control table; the target joins it at the cut-over request
/// ([`Control::request_switch`]), so that until then the backfill's and the dual write's own
/// writes to the target are not decoded and sent to a dual write that would skip them.
pub async fn create_publication(
    client: &impl GenericClient,
    name: &str,
    tables: &[String],
) -> Result<bool, MigrationError> {
    if pg_sql::publication_exists(client, name)
        .await
        .map_err(db("cannot read pg_publication"))?
    {
        return Ok(false);
    }
    pg_sql::create_publication(client, name, tables)
        .await
        .map_err(db(format!("cannot create publication `{name}`")))?;
    Ok(true)
}

/// Adds `table` to publication `name` unless the publication covers it already.
async fn publish(
    client: &impl GenericClient,
    name: &str,
    table: &str,
) -> Result<(), MigrationError> {
    let covered = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables \
             WHERE pubname = $1 AND format('%I.%I', schemaname, tablename)::regclass = to_regclass($2)",
            &[&name, &quote_table(table)],
        )
        .await
        .map_err(db("cannot read pg_publication_tables"))?
        .is_some();
    if covered {
        return Ok(());
    }
    client
        .batch_execute(&format!(
            "ALTER PUBLICATION {} ADD TABLE {}",
            quote_ident(name),
            quote_table(table)
        ))
        .await
        .map_err(db(format!("cannot add `{table}` to publication `{name}`")))
}
