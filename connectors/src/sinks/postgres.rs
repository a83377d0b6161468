//! `kind = "postgres"`: documents as JSONB rows of PostgreSQL tables, one table per collection.
//!
//! ```text
//! {schema}.{table} (id text PRIMARY KEY, doc jsonb NOT NULL, source_position text NOT NULL,
//!                   updated_at timestamptz NOT NULL DEFAULT now())
//! ```
//!
//! Tables (and the schema) are created when a collection is first written. Each batch is applied
//! in one transaction, so a source transaction (which a batch never splits, short of a huge one,
//! see the runtime) appears whole or not at all. Within a batch the last operation per key wins;
//! upserts go as multi-row `INSERT … SELECT FROM unnest(…) ON CONFLICT DO UPDATE` statements of
//! `rows_per_statement` documents, deletes as one `DELETE … USING unnest(…)` per collection.
//!
//! **Rejected rows.** When PostgreSQL refuses the batch with a data error (SQLSTATE class 22, a
//! value it cannot store such as `\u0000` in `jsonb`, or 23, a constraint of the target table),
//! the batch is applied again, still in one transaction, row by row in savepoints: each refused
//! row is rolled back and reported as rejected with PostgreSQL's reason (the runtime
//! dead-letters it), and every other row is applied.
//!
//! **Position guard.** `source_position` is the position of the change that wrote the row,
//! zero-padded so that text order is position order: an upsert, delete or truncate only applies
//! to rows written at an older (or the same) position, so a replay of older changes never
//! overwrites a newer document.
//!
//! **Tombstones.** A delete also records, in the same statement, the position that deleted the
//! document in `{schema}.refract_tombstones (target, id, position, deleted_at)`; an upsert older
//! than its document's tombstone is refused in its own statement, so replaying changes older
//! than a delete (at-least-once after a crash) never brings the document back. At open, the
//! tombstones of this sink's tables that are older than both the checkpoint the run resumes from
//! (no replay reaches behind it) and `tombstone_retention_ms` are pruned.

use std::collections::HashSet;

use async_trait::async_trait;
use refract_schemas::config::{POSTGRES_TOMBSTONES_TABLE, PostgresSinkConfig};
use refract_schemas::write::{DocumentOp, OpFamily};
use refract_schemas::{Checkpoint, Position};

use crate::pg_connect::{PgConnectError, PgEndpoint};
use crate::pg_sql::{qualified, quote_ident};
use crate::sinks::documents::{Keyed, segments};
use crate::{Intake, RejectedOp, Sink, SinkBatch, SinkError, WriteReport};

mod privileges;

/// What the PostgreSQL sink accepts: documents.
type Accepted<'a> = &'a DocumentOp;

/// Connection failures, serialization failures, lack of resources and shutdowns pass; other SQL
/// errors (a missing privilege, a value PostgreSQL refuses) do not.
pub(crate) fn classify(sink: &str, what: String, e: tokio_postgres::Error) -> SinkError {
    let transient = match e.code() {
        None => true,
        Some(code) => matches!(&code.code()[..2], "08" | "40" | "53" | "57" | "58"),
    };
    let source = Some(Box::new(e) as Box<dyn std::error::Error + Send + Sync>);
    if transient {
        SinkError::Transient {
            sink: sink.to_owned(),
            message: what,
            source,
        }
    } else {
        SinkError::Permanent {
            sink: sink.to_owned(),
            message: what,
            source,
        }
    }
}

/// The PostgreSQL sink.
pub struct PostgresSink {
    name: String,
    config: PostgresSinkConfig,
    client: Option<tokio_postgres::Client>,
    /// Collections whose table exists.
    ready: HashSet<String>,
}

impl PostgresSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A sink named `name`; nothing is connected before [`Sink::open`].
    pub fn new(name: &str, config: PostgresSinkConfig) -> Self {
        Self {
            name: name.to_owned(),
            config,
            client: None,
            ready: HashSet::new(),
        }
    }

    fn table(&self, collection: &str) -> String {
        qualified(&self.config.schema, &self.target(collection))
    }

    /// The unqualified table name of `collection`, as the tombstones name their target.
    fn target(&self, collection: &str) -> String {
        self.config.table.replace("{collection}", collection)
    }

    /// The tombstones table, qualified and quoted.
    fn tombstones(&self) -> String {
        qualified(&self.config.schema, POSTGRES_TOMBSTONES_TABLE)
    }

    /// A failure as [`classify`] sees it; a transient one drops the connection, so the next
    /// attempt reconnects.
    fn classify(&mut self, what: String, e: tokio_postgres::Error) -> SinkError {
        let error = classify(&self.name, what, e);
        if error.is_retryable() {
            self.client = None;
        }
        error
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        if self.client.as_ref().is_some_and(|c| !c.is_closed()) {
            return Ok(());
        }
        self.ready.clear();
        let endpoint =
            PgEndpoint::parse(self.config.url.expose()).map_err(|e| SinkError::Permanent {
                sink: self.name.clone(),
                message: e.to_string(),
                source: None,
            })?;
        let what = format!("cannot connect to {}", self.config.url.masked());
        match endpoint.connect("sink").await {
            Ok(client) => {
                self.client = Some(client);
                Ok(())
            }
            Err(PgConnectError::Connect(e)) => Err(self.classify(what, e)),
            Err(refused @ PgConnectError::Tls(_)) => Err(SinkError::Permanent {
                sink: self.name.clone(),
                message: format!("{what}: {refused}"),
                source: None,
            }),
        }
    }
}

/// The SQL of one batch: the tables to create first, then the statements, in order.
#[derive(Default)]
struct BatchSql {
    /// Collections first written by this batch, with their table and its `CREATE TABLE`.
    creates: Vec<(String, String, String)>,
    /// The statements.
    statements: Vec<Statement>,
}

/// One statement over text arrays, one element per row it writes.
struct Statement {
    sql: String,
    /// Parameters: one text array per column.
    params: Vec<Vec<String>>,
    /// The rows, in the order of the arrays' elements; empty for a truncate (no single row).
    rows: Vec<RowRef>,
}

/// Which document a row of a statement is.
struct RowRef {
    position: Position,
    collection: String,
    key: String,
    /// An upsert (else a delete).
    upsert: bool,
}

impl RowRef {
    fn of(op: &Keyed<'_>) -> Self {
        RowRef {
            position: op.position().clone(),
            collection: op.collection().to_string(),
            key: op.key().to_owned(),
            upsert: matches!(op, Keyed::Upsert { .. }),
        }
    }
}

/// A row the target refused, and whether it was an upsert.
type Refused = (RejectedOp, bool);

/// Data exceptions (class 22: a value PostgreSQL cannot store, like `\u0000` in `jsonb`) and
/// integrity constraint violations (class 23: a `CHECK` or trigger of the target table): the
/// row is at fault, not the batch, and retrying cannot help.
fn is_data_error(e: &tokio_postgres::Error) -> bool {
    e.code()
        .is_some_and(|c| matches!(&c.code()[..2], "22" | "23"))
}

impl PostgresSink {
    /// Creates the table of `collection` in this batch unless it exists already; refuses a
    /// collection whose table would be the tombstones table.
    fn ensure(&self, sql: &mut BatchSql, collection: &str) -> Result<(), SinkError> {
        if self.ready.contains(collection) || sql.creates.iter().any(|(c, ..)| c == collection) {
            return Ok(());
        }
        if self.target(collection) == POSTGRES_TOMBSTONES_TABLE {
            return Err(SinkError::Permanent {
                sink: self.name.clone(),
                message: format!(
                    "collection `{collection}` would be written to `{POSTGRES_TOMBSTONES_TABLE}`, \
                     the table of the sink's tombstones: rename the collection or change `table`"
                ),
                source: None,
            });
        }
        let table = self.table(collection);
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY, doc jsonb NOT NULL, \
             source_position text COLLATE \"C\" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())"
        );
        sql.creates.push((collection.to_owned(), table, create));
        Ok(())
    }

    /// The SQL of `ops`: per segment between truncates, the winning upserts of each collection
    /// as multi-row statements, then its deletes, then the truncate.
    fn batch_sql(
        &self,
        ops: &[&DocumentOp],
        report: &mut WriteReport,
    ) -> Result<BatchSql, SinkError> {
        let mut sql = BatchSql::default();
        let tombstones = self.tombstones();
        for segment in segments(ops) {
            report.coalesced += segment.coalesced;
            for (collection, winners) in by_collection(&segment.winners) {
                self.ensure(&mut sql, collection)?;
                let guard = Guard {
                    table: self.table(collection),
                    tombstones: &tombstones,
                    target: self.target(collection),
                };
                let (upserts, deletes): (Vec<Keyed<'_>>, Vec<Keyed<'_>>) = winners
                    .into_iter()
                    .partition(|op| matches!(op, Keyed::Upsert { .. }));
                report.upserted += upserts.len() as u64;
                report.deleted += deletes.len() as u64;
                for chunk in upserts.chunks(self.config.rows_per_statement) {
                    sql.statements.push(upsert_statement(&guard, chunk));
                }
                if !deletes.is_empty() {
                    sql.statements.push(delete_statement(&guard, &deletes));
                }
            }
            // Every document older than the truncate goes (a DELETE, not TRUNCATE, so that a
            // replayed truncate spares documents written after it).
            if let Some(truncate) = segment.truncate {
                self.ensure(&mut sql, truncate.collection)?;
                report.deleted += 1;
                sql.statements.push(Statement {
                    sql: format!(
                        "DELETE FROM {} WHERE source_position <= ($1::text[])[1]",
                        self.table(truncate.collection)
                    ),
                    params: vec![vec![truncate.position.offset.sortable()]],
                    rows: Vec::new(),
                });
            }
        }
        Ok(sql)
    }

    /// Applies `sql` in one transaction; after a data error, again row by row, rejecting the
    /// rows PostgreSQL refuses (see [`apply_sql`]).
    async fn apply(&mut self, sql: &BatchSql) -> Result<Vec<Refused>, SinkError> {
        let schema = self.config.schema.clone();
        let Some(client) = self.client.as_mut() else {
            return Err(SinkError::not_open(&self.name));
        };
        let result = match apply_sql(client, &schema, sql, false).await {
            Err((_, e)) if is_data_error(&e) => {
                tracing::warn!(sink = %self.name, error = %e, "a row was refused: applying the batch row by row to isolate it");
                apply_sql(client, &schema, sql, true).await
            }
            other => other,
        };
        result.map_err(|(what, e)| self.classify(what, e))
    }
}

/// Applies `sql` in one transaction, creating the schema and tables it needs first. Row by row,
/// each row goes in a savepoint, and a row refused with a data error is rolled back and returned
/// while the others are applied.
async fn apply_sql(
    client: &mut tokio_postgres::Client,
    schema: &str,
    sql: &BatchSql,
    row_by_row: bool,
) -> Result<Vec<Refused>, (String, tokio_postgres::Error)> {
    let mut tx = client
        .transaction()
        .await
        .map_err(|e| ("cannot begin a transaction".to_owned(), e))?;
    if !sql.creates.is_empty() {
        create_missing(&tx, schema, &sql.creates).await?;
    }
    let mut refused = Vec::new();
    for statement in &sql.statements {
        if row_by_row && !statement.rows.is_empty() {
            refused.extend(execute_rows(&mut tx, statement).await?);
        } else {
            execute(&tx, &statement.sql, &statement.params).await?;
        }
    }
    tx.commit()
        .await
        .map_err(|e| ("cannot commit the batch".to_owned(), e))?;
    Ok(refused)
}

/// Runs one statement over text-array parameters.
async fn execute(
    tx: &tokio_postgres::Transaction<'_>,
    statement: &str,
    params: &[Vec<String>],
) -> Result<u64, (String, tokio_postgres::Error)> {
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
        .iter()
        .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    tx.execute(statement, &params).await.map_err(|e| {
        let what = statement.split(" AS ").next().unwrap_or(statement);
        (format!("cannot apply the batch ({what})"), e)
    })
}

/// Runs `statement` one row at a time, each in a savepoint; returns the rows refused with a data
/// error (rolled back), with the reason PostgreSQL gave.
async fn execute_rows(
    tx: &mut tokio_postgres::Transaction<'_>,
    statement: &Statement,
) -> Result<Vec<Refused>, (String, tokio_postgres::Error)> {
    let mut refused = Vec::new();
    for (i, row) in statement.rows.iter().enumerate() {
        let params: Vec<Vec<String>> = statement
            .params
            .iter()
            .map(|column| vec![column[i].clone()])
            .collect();
        let savepoint = tx
            .savepoint("refract_row")
            .await
            .map_err(|e| ("cannot set a savepoint".to_owned(), e))?;
        match execute(&savepoint, &statement.sql, &params).await {
            Ok(_) => savepoint.commit().await,
            Err((_, e)) if is_data_error(&e) => {
                refused.push((refusal(row, &e), row.upsert));
                savepoint.rollback().await
            }
            Err(failure) => return Err(failure),
        }
        .map_err(|e| ("cannot end a savepoint".to_owned(), e))?;
    }
    Ok(refused)
}

/// The rejection of `row`, with PostgreSQL's reason.
fn refusal(row: &RowRef, e: &tokio_postgres::Error) -> RejectedOp {
    let reason = match e.as_db_error() {
        Some(db) => format!(
            "PostgreSQL refused the row: {} (SQLSTATE {}){}",
            db.message(),
            db.code().code(),
            db.detail().map(|d| format!("; {d}")).unwrap_or_default()
        ),
        None => format!("PostgreSQL refused the row: {e}"),
    };
    RejectedOp {
        position: row.position.clone(),
        table: row.collection.clone(),
        key: row.key.clone(),
        reason,
    }
}

impl PostgresSink {
    /// Creates the tombstones table when missing, then prunes the tombstones of this sink's
    /// tables older than both `resume` and the retention, in one transaction.
    async fn prepare_tombstones(&mut self, resume: &Checkpoint) -> Result<(), SinkError> {
        let schema_name = self.config.schema.clone();
        let tombstones = self.tombstones();
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {tombstones} (target text COLLATE \"C\" NOT NULL, \
             id text NOT NULL, position text COLLATE \"C\" NOT NULL, \
             deleted_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, id))"
        );
        let creates = [(String::new(), tombstones.clone(), create)];
        // No replay reaches behind the lowest position the run resumes from.
        let horizon = resume.values().min().map(|o| o.sortable());
        let targets = like_pattern(&self.config.table);
        let retention_s = self.config.tombstone_retention_ms as f64 / 1000.0;
        let name = self.name.clone();
        let Some(client) = self.client.as_mut() else {
            return Err(SinkError::not_open(&self.name));
        };
        let checked = privileges::check(
            &*client,
            &name,
            &schema_name,
            POSTGRES_TOMBSTONES_TABLE,
            &targets,
        )
        .await;
        match checked {
            Ok(None) => {}
            Ok(Some(report)) => {
                return Err(SinkError::Permanent {
                    sink: name,
                    message: report,
                    source: None,
                });
            }
            Err(e) => return Err(self.classify("cannot check the role's privileges".into(), e)),
        }
        let Some(client) = self.client.as_mut() else {
            return Err(SinkError::not_open(&self.name));
        };
        let result: Result<(), (String, tokio_postgres::Error)> = async {
            let tx = client
                .transaction()
                .await
                .map_err(|e| ("cannot begin a transaction".to_owned(), e))?;
            create_missing(&tx, &schema_name, &creates).await?;
            if let Some(horizon) = &horizon {
                let prune = format!(
                    "DELETE FROM {tombstones} WHERE target LIKE $1 AND position <= $2 \
                     AND deleted_at < now() - make_interval(secs => $3)"
                );
                let pruned = tx
                    .execute(&prune, &[&targets, horizon, &retention_s])
                    .await
                    .map_err(|e| ("cannot prune tombstones".to_owned(), e))?;
                tracing::debug!(sink = %name, pruned, "tombstones pruned");
            }
            tx.commit()
                .await
                .map_err(|e| ("cannot commit the tombstones' pruning".to_owned(), e))
        }
        .await;
        result.map_err(|(what, e)| self.classify(what, e))
    }
}

/// A `LIKE` pattern matching every table the `table` template makes.
fn like_pattern(template: &str) -> String {
    template
        .split("{collection}")
        .map(|part| {
            part.replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_")
        })
        .collect::<Vec<_>>()
        .join("%")
}

/// `winners` grouped by collection, collections in order of first appearance, batch order kept
/// within each.
fn by_collection<'a>(winners: &[Keyed<'a>]) -> Vec<(&'a str, Vec<Keyed<'a>>)> {
    let mut out: Vec<(&'a str, Vec<Keyed<'a>>)> = Vec::new();
    for op in winners {
        let collection: &'a str = op.collection();
        match out.iter_mut().find(|(c, _)| *c == collection) {
            Some((_, ops)) => ops.push(*op),
            None => out.push((collection, vec![*op])),
        }
    }
    out
}

/// Where a collection's statements write, and the tombstones that guard them.
struct Guard<'a> {
    /// The collection's table, qualified and quoted.
    table: String,
    /// The tombstones table, qualified and quoted.
    tombstones: &'a str,
    /// The collection's table as its tombstones name it.
    target: String,
}

/// One multi-row upsert of `chunk`, guarded by position: neither a newer row nor a newer
/// tombstone is overwritten.
fn upsert_statement(guard: &Guard<'_>, chunk: &[Keyed<'_>]) -> Statement {
    let (mut ids, mut docs, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for op in chunk {
        if let Keyed::Upsert {
            key, doc, position, ..
        } = op
        {
            ids.push((*key).to_owned());
            docs.push(serde_json::to_string(&***doc).expect("a JSON map serializes"));
            positions.push(position.offset.sortable());
        }
    }
    let Guard {
        table,
        tombstones,
        target,
    } = guard;
    let targets = vec![target.clone(); ids.len()];
    Statement {
        sql: format!(
            "INSERT INTO {table} AS t (id, doc, source_position) \
             SELECT i, d::jsonb, p FROM unnest($1::text[], $2::text[], $3::text[]) AS u(i, d, p) \
             WHERE NOT EXISTS (SELECT 1 FROM {tombstones} AS b \
                 WHERE b.target = ($4::text[])[1] AND b.id = u.i AND b.position > u.p) \
             ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, source_position = excluded.source_position, updated_at = now() \
             WHERE t.source_position <= excluded.source_position"
        ),
        params: vec![ids, docs, positions, targets],
        rows: chunk.iter().map(RowRef::of).collect(),
    }
}

/// One delete of `deletes`, guarded by position, recording (or moving forward) each key's
/// tombstone in the same statement.
fn delete_statement(guard: &Guard<'_>, deletes: &[Keyed<'_>]) -> Statement {
    let Guard {
        table,
        tombstones,
        target,
    } = guard;
    let (ids, positions) = deletes
        .iter()
        .map(|op| (op.key().to_owned(), op.position().offset.sortable()))
        .unzip();
    let targets = vec![target.clone(); deletes.len()];
    Statement {
        sql: format!(
            "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[]) AS u(i, p)), \
             gone AS (DELETE FROM {table} AS t USING u WHERE t.id = u.i AND t.source_position <= u.p) \
             INSERT INTO {tombstones} AS b (target, id, position) \
             SELECT ($3::text[])[1], i, p FROM u \
             ON CONFLICT (target, id) DO UPDATE SET position = excluded.position, deleted_at = now() \
             WHERE b.position < excluded.position"
        ),
        params: vec![ids, positions, targets],
        rows: deletes.iter().map(RowRef::of).collect(),
    }
}

/// Creates the schema and the tables of `creates` that do not exist yet. Looks before creating:
/// PostgreSQL checks the CREATE privilege even when the object exists, and a writer may only
/// have rights on tables made for it.
async fn create_missing(
    tx: &tokio_postgres::Transaction<'_>,
    schema_name: &str,
    creates: &[(String, String, String)],
) -> Result<(), (String, tokio_postgres::Error)> {
    let exists = tx
        .query_opt(
            "SELECT 1 FROM pg_namespace WHERE nspname = $1",
            &[&schema_name],
        )
        .await
        .map_err(|e| ("cannot look up the schema".to_owned(), e))?
        .is_some();
    if !exists {
        let schema = quote_ident(schema_name);
        create_racing(tx, &format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .await
            .map_err(|e| (format!("cannot create schema {schema}"), e))?;
    }
    for (_, table, create) in creates {
        let exists: bool = tx
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[table])
            .await
            .map_err(|e| ("cannot look up a read-model table".to_owned(), e))?
            .get(0);
        if !exists {
            create_racing(tx, create)
                .await
                .map_err(|e| (format!("cannot create a read-model table ({create})"), e))?;
        }
    }
    Ok(())
}

/// Runs `create` (`CREATE … IF NOT EXISTS`) in a savepoint. Two processes creating the same
/// object at once (the members of a scaled-out pipeline opening together) both pass `IF NOT
/// EXISTS`; the second then fails on the catalog's unique index (23505) or finds the object
/// (42P07, 42P06) once the first commits, or, for a table, finds its row type first (42710,
/// `type "items" already exists`: seen in the server log of a failed run of
/// `tests/pg_sink.rs`). The object exists then, which is all that was asked: that failure is
/// rolled back to the savepoint and the transaction goes on.
async fn create_racing(
    tx: &tokio_postgres::Transaction<'_>,
    create: &str,
) -> Result<(), tokio_postgres::Error> {
    use tokio_postgres::error::SqlState;
    tx.batch_execute("SAVEPOINT refract_create").await?;
    match tx.batch_execute(create).await {
        Ok(()) => tx.batch_execute("RELEASE SAVEPOINT refract_create").await,
        Err(e)
            if e.code().is_some_and(|c| {
                [
                    SqlState::UNIQUE_VIOLATION,
                    SqlState::DUPLICATE_TABLE,
                    SqlState::DUPLICATE_SCHEMA,
                    SqlState::DUPLICATE_OBJECT,
                ]
                .contains(c)
            }) =>
        {
            tracing::debug!(error = %e, "created concurrently by another process");
            tx.batch_execute(
                "ROLLBACK TO SAVEPOINT refract_create; RELEASE SAVEPOINT refract_create",
            )
            .await
        }
        Err(e) => Err(e),
    }
}

#[async_trait]
impl Sink for PostgresSink {
    async fn open(&mut self, resume: &Checkpoint) -> Result<(), SinkError> {
        self.connect().await?;
        self.prepare_tombstones(resume).await
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let ops = batch.intake::<Accepted>(&self.name)?;
        self.connect().await?;
        let mut report = WriteReport::default();
        let sql = self.batch_sql(&ops, &mut report)?;
        for (op, upsert) in self.apply(&sql).await? {
            if upsert {
                report.upserted -= 1;
            } else {
                report.deleted -= 1;
            }
            report.rejected.push(op);
        }
        self.ready.extend(sql.creates.into_iter().map(|(c, ..)| c));
        Ok(report)
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        self.client = None;
        Ok(None)
    }
}
