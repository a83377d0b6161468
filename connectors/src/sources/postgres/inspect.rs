//! Inspection and administration of a PostgreSQL source, for `refract plan` and `refract drop`:
//! the server, the pipeline's replication slot and publication, and the tables the publication
//! covers (or would cover once created) with their replica identity and primary key.
//!
//! Everything here returns plain data; the CLI renders it and decides what to warn about. Reading
//! never changes the database; only [`PgAdmin::drop_slot`] and [`PgAdmin::drop_publication`] do.

use std::collections::BTreeSet;
use std::time::Duration;

use refract_schemas::config::PostgresSourceConfig;
use tokio_postgres::error::SqlState;

use crate::pg_connect::{PgConnectError, PgEndpoint};
use crate::pg_sql::{qualified, quote_ident};

/// How long connecting may take when the URL does not say (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Failure to inspect or administer the database.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// The URL does not parse.
    #[error("invalid PostgreSQL URL: {0}")]
    Url(String),
    /// The server cannot be reached or refused the connection.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// A catalog query or a drop failed.
    #[error("{what}: {message}")]
    Query {
        /// What was being done.
        what: String,
        /// The server's or the client's error.
        message: String,
    },
    /// The slot is in use by a replication connection (a running refract, or another consumer).
    #[error("replication slot `{slot}` is active (in use by server process {pid})")]
    SlotActive {
        /// The slot.
        slot: String,
        /// The walsender's process id, when known.
        pid: String,
    },
}

fn query_error(what: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> InspectError {
    let what = what.into();
    move |e| InspectError::Query {
        what,
        message: error_text(&e),
    }
}

/// The server's message when there is one (tokio-postgres' Display says only "db error"), else
/// the error with its causes ("error connecting to server: Connection refused").
pub(crate) fn error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return db.message().to_owned();
    }
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// The server and the connected role.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerInfo {
    /// `server_version`, e.g. `15.4 (Debian 15.4-1)`.
    pub version: String,
    /// `server_version_num`, e.g. 150004.
    pub version_num: i32,
    /// `wal_level`; logical replication needs `logical`.
    pub wal_level: String,
    /// `max_slot_wal_keep_size` (`-1` = unlimited), when the server has the setting.
    pub max_slot_wal_keep_size: Option<String>,
    /// The connected role.
    pub user: String,
    /// Whether the role may replicate (REPLICATION or superuser).
    pub can_replicate: bool,
    /// The connected database.
    pub database: String,
}

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotState {
    /// Slot name.
    pub name: String,
    /// `logical` or `physical`.
    pub slot_type: String,
    /// Output plugin of a logical slot (`pgoutput` for refract).
    pub plugin: Option<String>,
    /// Database of a logical slot.
    pub database: Option<String>,
    /// Whether the slot belongs to the connected database (only then can refract use or drop it).
    pub in_this_database: bool,
    /// Whether a replication connection is using the slot now.
    pub active: bool,
    /// The process using it.
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (PostgreSQL 13+).
    pub wal_status: Option<String>,
    /// Oldest WAL position the slot keeps.
    pub restart_lsn: Option<String>,
    /// Position up to which the consumer confirmed the changes.
    pub confirmed_flush_lsn: Option<String>,
    /// Bytes of WAL kept for the slot: `pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)`.
    pub retained_wal_bytes: Option<i64>,
    /// Bytes of WAL that can still be written before the slot is in danger of being invalidated
    /// (`safe_wal_size`; none when `max_slot_wal_keep_size` is unlimited).
    pub safe_wal_size: Option<i64>,
}

impl SlotState {
    /// Whether the slot was invalidated (the WAL it needed was removed).
    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

/// A publication as `pg_publication` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct PublicationState {
    /// Publication name.
    pub name: String,
    /// `FOR ALL TABLES`.
    pub all_tables: bool,
    /// The operations it publishes (`insert`, `update`, `delete`, `truncate`).
    pub publishes: Vec<String>,
}

impl PublicationState {
    /// Whether UPDATE or DELETE are published (PostgreSQL then rejects them on tables without a
    /// replica identity).
    pub fn publishes_updates_or_deletes(&self) -> bool {
        self.publishes
            .iter()
            .any(|p| p == "update" || p == "delete")
    }
}

/// `pg_class.relreplident`: which columns of the old row PostgreSQL writes to the WAL on UPDATE and
/// DELETE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaIdentity {
    /// The primary key columns (nothing when there is no primary key).
    Default,
    /// Every column.
    Full,
    /// The columns of a chosen unique index.
    Index,
    /// Nothing.
    Nothing,
}

impl ReplicaIdentity {
    fn from_code(code: &str) -> Self {
        match code {
            "f" => Self::Full,
            "i" => Self::Index,
            "n" => Self::Nothing,
            _ => Self::Default,
        }
    }

    /// The SQL keyword (`default`, `full`, `index`, `nothing`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Full => "full",
            Self::Index => "index",
            Self::Nothing => "nothing",
        }
    }
}

/// A published table.
#[derive(Debug, Clone, PartialEq)]
pub struct TableInfo {
    /// Schema.
    pub schema: String,
    /// Table name.
    pub name: String,
    /// Its replica identity.
    pub replica_identity: ReplicaIdentity,
    /// Primary key columns, in key order (empty without a primary key).
    pub primary_key: Vec<String>,
    /// Under `REPLICA IDENTITY USING INDEX`: the index and its columns.
    pub identity_index: Option<(String, Vec<String>)>,
    /// Every column, in table order.
    pub columns: Vec<String>,
    /// Columns whose values may be stored out of line (TOAST): an UPDATE that leaves them
    /// unchanged does not send them unless the replica identity is FULL.
    pub toastable: Vec<String>,
}

impl TableInfo {
    /// `schema.name`.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }

    /// The columns PostgreSQL sends in the old row of a DELETE, or of an UPDATE that changes
    /// them; `None` means every column (FULL). Under DEFAULT without a primary key and under
    /// NOTHING this is empty: no old row at all, and PostgreSQL rejects UPDATE and DELETE once
    /// the table is in a publication that publishes them.
    pub fn identity_columns(&self) -> Option<&[String]> {
        match self.replica_identity {
            ReplicaIdentity::Full => None,
            ReplicaIdentity::Default => Some(&self.primary_key),
            ReplicaIdentity::Index => Some(self.identity_index.as_ref().map_or(&[], |(_, c)| c)),
            ReplicaIdentity::Nothing => Some(&[]),
        }
    }
}

/// An entry of the pipeline file's `tables` that a publication to be created could not cover.
#[derive(Debug, Clone, PartialEq)]
pub struct UnmatchedTable {
    /// The entry as written.
    pub pattern: String,
    /// Why (no such table, not a table, empty schema).
    pub reason: String,
}

/// What the database says about a PostgreSQL source.
#[derive(Debug, Clone, PartialEq)]
pub struct Inspection {
    /// The server.
    pub server: ServerInfo,
    /// The slot the pipeline uses.
    pub slot_name: String,
    /// The slot, when it exists (in any database).
    pub slot: Option<SlotState>,
    /// The publication the pipeline uses.
    pub publication_name: String,
    /// The publication, when it exists.
    pub publication: Option<PublicationState>,
    /// The tables the publication covers, or would cover once created from the file's `tables`.
    pub tables: Vec<TableInfo>,
    /// Entries of `tables` that match nothing (only when the publication is yet to be created).
    pub unmatched: Vec<UnmatchedTable>,
    /// When the publication exists: the tables (`schema.name`) the file's `tables` would cover,
    /// to tell whether the file and the publication disagree.
    pub file_tables: Option<Vec<String>>,
}

/// A connection for inspecting and administering a PostgreSQL source.
pub struct PgAdmin {
    client: tokio_postgres::Client,
}

impl PgAdmin {
    /// Connects to `url` (a `connect_timeout` of 5 s unless the URL sets one).
    pub async fn connect(url: &str) -> Result<Self, InspectError> {
        let mut endpoint = PgEndpoint::parse(url).map_err(|e| InspectError::Url(e.0))?;
        let config = &mut endpoint.config;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        config.application_name("refract-admin");
        let client = endpoint.connect("admin").await.map_err(|e| match e {
            PgConnectError::Connect(e) => InspectError::Connect(error_text(&e)),
            other => InspectError::Connect(other.to_string()),
        })?;
        Ok(Self { client })
    }

    /// Inspects the source of pipeline `pipeline`: server, slot, publication, tables.
    pub async fn inspect(
        &self,
        config: &PostgresSourceConfig,
        pipeline: &str,
    ) -> Result<Inspection, InspectError> {
        let server = self.server().await?;
        let slot_name = config.slot_name(pipeline);
        let publication_name = config.publication_name(pipeline);
        let slot = self.slot(&slot_name, server.version_num).await?;
        let publication = self.publication(&publication_name).await?;
        let (oids, unmatched, file_tables) = match &publication {
            Some(_) => {
                let (from_file, _) = self.planned_oids(&config.tables).await?;
                (
                    self.published_oids(&publication_name).await?,
                    Vec::new(),
                    Some(self.names(&from_file).await?),
                )
            }
            None => {
                let (oids, unmatched) = self.planned_oids(&config.tables).await?;
                (oids, unmatched, None)
            }
        };
        let tables = self.tables(&oids).await?;
        Ok(Inspection {
            server,
            slot_name,
            slot,
            publication_name,
            publication,
            tables,
            unmatched,
            file_tables,
        })
    }

    /// `schema.name` of the tables `oids`, sorted.
    async fn names(&self, oids: &BTreeSet<u32>) -> Result<Vec<String>, InspectError> {
        let oids: Vec<u32> = oids.iter().copied().collect();
        let rows = self
            .client
            .query(
                "SELECT n.nspname::text || '.' || c.relname::text FROM pg_class c \
                 JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = ANY($1) ORDER BY 1",
                &[&oids],
            )
            .await
            .map_err(query_error("cannot read table names"))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// The server and the connected role.
    pub async fn server(&self) -> Result<ServerInfo, InspectError> {
        let row = self
            .client
            .query_one(
                "SELECT current_setting('server_version'), current_setting('server_version_num')::int, \
                 current_setting('wal_level'), current_setting('max_slot_wal_keep_size', true), \
                 current_user::text, \
                 coalesce((SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user), false), \
                 current_database()::text",
                &[],
            )
            .await
            .map_err(query_error("cannot read the server settings"))?;
        Ok(ServerInfo {
            version: row.get(0),
            version_num: row.get(1),
            wal_level: row.get(2),
            max_slot_wal_keep_size: row.get(3),
            user: row.get(4),
            can_replicate: row.get(5),
            database: row.get(6),
        })
    }

    /// The slot `name`, in whichever database it is.
    pub async fn slot(
        &self,
        name: &str,
        version_num: i32,
    ) -> Result<Option<SlotState>, InspectError> {
        // wal_status and safe_wal_size exist from PostgreSQL 13 on.
        let (wal_status, safe_wal_size) = if version_num >= 130_000 {
            ("wal_status::text", "safe_wal_size::bigint")
        } else {
            ("NULL::text", "NULL::bigint")
        };
        let sql = format!(
            "SELECT slot_type::text, plugin::text, database::text, coalesce(database = current_database(), false), \
             active, active_pid, {wal_status}, restart_lsn::text, confirmed_flush_lsn::text, \
             CASE WHEN pg_is_in_recovery() OR restart_lsn IS NULL THEN NULL \
                  ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint END, \
             {safe_wal_size} \
             FROM pg_replication_slots WHERE slot_name = $1"
        );
        let row = self
            .client
            .query_opt(&sql, &[&name])
            .await
            .map_err(query_error("cannot read pg_replication_slots"))?;
        Ok(row.map(|r| SlotState {
            name: name.to_owned(),
            slot_type: r.get(0),
            plugin: r.get(1),
            database: r.get(2),
            in_this_database: r.get(3),
            active: r.get(4),
            active_pid: r.get(5),
            wal_status: r.get(6),
            restart_lsn: r.get(7),
            confirmed_flush_lsn: r.get(8),
            retained_wal_bytes: r.get(9),
            safe_wal_size: r.get(10),
        }))
    }

    /// The publication `name`.
    pub async fn publication(&self, name: &str) -> Result<Option<PublicationState>, InspectError> {
        let row = self
            .client
            .query_opt(
                "SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate \
                 FROM pg_publication WHERE pubname = $1",
                &[&name],
            )
            .await
            .map_err(query_error("cannot read pg_publication"))?;
        Ok(row.map(|r| {
            let publishes = ["insert", "update", "delete", "truncate"]
                .iter()
                .enumerate()
                .filter(|(i, _)| r.get::<_, bool>(i + 1))
                .map(|(_, op)| (*op).to_owned())
                .collect();
            PublicationState {
                name: name.to_owned(),
                all_tables: r.get(0),
                publishes,
            }
        }))
    }

    /// The tables an existing publication covers.
    async fn published_oids(&self, publication: &str) -> Result<BTreeSet<u32>, InspectError> {
        let rows = self
            .client
            .query(
                "SELECT c.oid FROM pg_publication_tables p \
                 JOIN pg_namespace n ON n.nspname = p.schemaname \
                 JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename \
                 WHERE p.pubname = $1",
                &[&publication],
            )
            .await
            .map_err(query_error("cannot read pg_publication_tables"))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// The tables a publication created from `tables` would cover, as the source creates it
    /// (`FOR ALL TABLES` when empty; `schema.*` as `TABLES IN SCHEMA`; partitioned tables
    /// published through their partitions, as PostgreSQL does by default).
    async fn planned_oids(
        &self,
        tables: &[String],
    ) -> Result<(BTreeSet<u32>, Vec<UnmatchedTable>), InspectError> {
        const ORDINARY: &str = "c.relkind = 'r' AND c.relpersistence = 'p'";
        let mut oids = BTreeSet::new();
        let mut unmatched = Vec::new();
        if tables.is_empty() {
            let rows = self
                .client
                .query(
                    &format!(
                        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                         WHERE {ORDINARY} AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
                         AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp%'"
                    ),
                    &[],
                )
                .await
                .map_err(query_error("cannot list the tables"))?;
            oids.extend(rows.iter().map(|r| r.get::<_, u32>(0)));
            return Ok((oids, unmatched));
        }
        for pattern in tables {
            match pattern.split_once('.') {
                Some((schema, "*")) => {
                    let rows = self
                        .client
                        .query(
                            &format!(
                                "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                                 WHERE {ORDINARY} AND n.nspname = $1"
                            ),
                            &[&schema],
                        )
                        .await
                        .map_err(query_error(format!("cannot list the tables of `{schema}`")))?;
                    if rows.is_empty() {
                        let exists = self
                            .client
                            .query_opt("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[&schema])
                            .await
                            .map_err(query_error("cannot read pg_namespace"))?
                            .is_some();
                        unmatched.push(UnmatchedTable {
                            pattern: pattern.clone(),
                            reason: if exists {
                                "the schema has no tables (yet)".into()
                            } else {
                                "no such schema".into()
                            },
                        });
                    }
                    oids.extend(rows.iter().map(|r| r.get::<_, u32>(0)));
                }
                split => {
                    // As CREATE PUBLICATION resolves it: `schema.table`, or `table` on the search path.
                    let name = match split {
                        Some((schema, table)) => qualified(schema, table),
                        None => quote_ident(pattern),
                    };
                    let row = self
                        .client
                        .query_one(
                            "SELECT c.oid, c.relkind::text FROM (SELECT to_regclass($1) AS oid) r \
                             LEFT JOIN pg_class c ON c.oid = r.oid",
                            &[&name],
                        )
                        .await
                        .map_err(query_error(format!("cannot look up `{pattern}`")))?;
                    let (oid, kind): (Option<u32>, Option<String>) = (row.get(0), row.get(1));
                    match (oid, kind.as_deref()) {
                        (Some(oid), Some("r")) => {
                            oids.insert(oid);
                        }
                        (Some(oid), Some("p")) => {
                            let leaves = self
                                .client
                                .query(
                                    "SELECT relid::oid FROM pg_partition_tree($1::oid::regclass) WHERE isleaf",
                                    &[&oid],
                                )
                                .await
                                .map_err(query_error(format!("cannot list the partitions of `{pattern}`")))?;
                            oids.extend(leaves.iter().map(|r| r.get::<_, u32>(0)));
                        }
                        (Some(_), _) => unmatched.push(UnmatchedTable {
                            pattern: pattern.clone(),
                            reason: "not a table (only tables can be published)".into(),
                        }),
                        (None, _) => unmatched.push(UnmatchedTable {
                            pattern: pattern.clone(),
                            reason: "no such table".into(),
                        }),
                    }
                }
            }
        }
        Ok((oids, unmatched))
    }

    /// Replica identity, keys and columns of the tables `oids`, sorted by schema and name.
    async fn tables(&self, oids: &BTreeSet<u32>) -> Result<Vec<TableInfo>, InspectError> {
        if oids.is_empty() {
            return Ok(Vec::new());
        }
        let oids: Vec<u32> = oids.iter().copied().collect();
        let rows = self
            .client
            .query(
                "SELECT n.nspname::text, c.relname::text, c.relreplident::text, \
                 coalesce((SELECT array_agg(a.attname::text ORDER BY array_position(i.indkey::int2[], a.attnum)) \
                   FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                   WHERE i.indrelid = c.oid AND i.indisprimary), '{}'), \
                 (SELECT ic.relname::text FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid \
                   WHERE i.indrelid = c.oid AND i.indisreplident LIMIT 1), \
                 coalesce((SELECT array_agg(a.attname::text ORDER BY array_position(i.indkey::int2[], a.attnum)) \
                   FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                   WHERE i.indrelid = c.oid AND i.indisreplident), '{}'), \
                 coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a \
                   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'), \
                 coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a \
                   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped \
                   AND a.attlen = -1 AND a.attstorage IN ('x', 'e')), '{}') \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE c.oid = ANY($1) ORDER BY 1, 2",
                &[&oids],
            )
            .await
            .map_err(query_error("cannot read the published tables"))?;
        Ok(rows
            .iter()
            .map(|r| {
                let replica_identity = ReplicaIdentity::from_code(&r.get::<_, String>(2));
                let index: Option<String> = r.get(4);
                TableInfo {
                    schema: r.get(0),
                    name: r.get(1),
                    replica_identity,
                    primary_key: r.get(3),
                    identity_index: index.map(|i| (i, r.get(5))),
                    columns: r.get(6),
                    toastable: r.get(7),
                }
            })
            .collect())
    }

    /// Drops the logical slot `name` of the connected database. Returns whether it existed.
    /// Fails with [`InspectError::SlotActive`] when a replication connection holds it.
    pub async fn drop_slot(&self, name: &str) -> Result<bool, InspectError> {
        match self
            .client
            .query(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND database = current_database()",
                &[&name],
            )
            .await
        {
            Ok(rows) => Ok(!rows.is_empty()),
            Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) => {
                // "replication slot "x" is active for PID 1234"
                let message = error_text(&e);
                let pid = message
                    .rsplit(' ')
                    .next()
                    .filter(|p| p.chars().all(|c| c.is_ascii_digit()))
                    .unwrap_or("?")
                    .to_owned();
                Err(InspectError::SlotActive {
                    slot: name.to_owned(),
                    pid,
                })
            }
            Err(e) => Err(query_error(format!(
                "cannot drop replication slot `{name}`"
            ))(e)),
        }
    }

    /// Drops the publication `name`. Returns whether it existed.
    pub async fn drop_publication(&self, name: &str) -> Result<bool, InspectError> {
        let existed = self.publication(name).await?.is_some();
        if existed {
            self.client
                .batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", quote_ident(name)))
                .await
                .map_err(query_error(format!("cannot drop publication `{name}`")))?;
        }
        Ok(existed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(identity: ReplicaIdentity, pk: &[&str]) -> TableInfo {
        TableInfo {
            schema: "public".into(),
            name: "t".into(),
            replica_identity: identity,
            primary_key: pk.iter().map(|s| s.to_string()).collect(),
            identity_index: None,
            columns: vec!["id".into(), "sku".into()],
            toastable: vec![],
        }
    }

    #[test]
    fn identity_columns_follow_the_replica_identity() {
        assert_eq!(
            table(ReplicaIdentity::Default, &["id"]).identity_columns(),
            Some(&["id".to_string()][..])
        );
        assert_eq!(
            table(ReplicaIdentity::Default, &[]).identity_columns(),
            Some(&[][..])
        );
        assert_eq!(table(ReplicaIdentity::Full, &[]).identity_columns(), None);
        assert_eq!(
            table(ReplicaIdentity::Nothing, &["id"]).identity_columns(),
            Some(&[][..])
        );
        let mut t = table(ReplicaIdentity::Index, &[]);
        t.identity_index = Some(("t_sku_key".into(), vec!["sku".into()]));
        assert_eq!(t.identity_columns(), Some(&["sku".to_string()][..]));
        assert_eq!(ReplicaIdentity::from_code("f"), ReplicaIdentity::Full);
        assert_eq!(ReplicaIdentity::from_code("d").as_str(), "default");
    }
}
