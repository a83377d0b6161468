//! What the source's role may do, checked before any data moves.
//!
//! A role that lacks a privilege would otherwise fail half-way (the slot created, the snapshot
//! refused on its third table) with PostgreSQL's `permission denied for table x`. Here every
//! missing privilege is found at once and named with its object and the statement an
//! administrator runs to grant it. The least the source needs (docs/sources/postgres.md):
//! - the REPLICATION attribute (for the slot and the replication connection);
//! - SELECT on each published table (snapshot, TOAST re-reads, `refract verify`);
//! - a publication: made by an administrator, or created by refract, which needs CREATE on the
//!   database and ownership of the tables (a superuser for `FOR ALL TABLES` or a schema);
//! - UPDATE on each table read in chunks (`refract backfill`, a snapshot resumed after a crash):
//!   the chunks lock their rows `FOR SHARE`, which PostgreSQL allows only with UPDATE.

use tokio_postgres::Client;

use super::snapshot::published_tables;
use super::source::io;
use crate::SourceError;
use crate::pg_sql::quote_ident;
use crate::privileges::Missing;

/// The error of `missing`, if anything is.
fn refuse(missing: &Missing) -> Result<(), SourceError> {
    match missing.report("this pipeline's source", "nothing was read") {
        Some(report) => Err(SourceError::Inconsistent(report)),
        None => Ok(()),
    }
}

/// What the source will do, which decides the privileges it needs.
pub(crate) struct Needs<'a> {
    /// The publication it reads.
    pub publication: &'a str,
    /// The tables of a publication refract is to create (`schema.table`, `schema.*`; empty:
    /// every table), when it does not exist yet and `create` allows it.
    pub create_for: Option<&'a [String]>,
}

/// Checks the role of `client` against `needs`: the REPLICATION attribute, the rights to create
/// the publication when it is to be created, SELECT on every table it publishes.
pub(crate) async fn check_source(client: &Client, needs: &Needs<'_>) -> Result<(), SourceError> {
    let row = client
        .query_one(
            "SELECT current_user::text, current_database()::text, rolsuper, rolreplication \
             FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(io("cannot read the role's attributes"))?;
    let (role, database, superuser, replication): (String, String, bool, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let mut missing = Missing::of(&role);
    if superuser {
        return Ok(());
    }
    if !replication {
        missing.add(
            "the REPLICATION attribute".into(),
            format!("ALTER ROLE {} REPLICATION", quote_ident(&role)),
        );
    }
    let tables = match needs.create_for {
        Some(tables) => {
            check_create_publication(client, &database, needs.publication, tables, &mut missing)
                .await?;
            tables
                .iter()
                .filter(|t| !t.ends_with(".*"))
                .cloned()
                .collect()
        }
        None => published_tables(client, needs.publication).await?,
    };
    lacking(client, &role, &tables, "SELECT", &mut missing).await?;
    refuse(&missing)
}

/// Checks that the role may lock the tables of `scope` (empty: every table of `publication`)
/// `FOR SHARE`, as chunked reads do: UPDATE on each.
pub(crate) async fn check_chunked_reads(
    client: &Client,
    publication: &str,
    scope: &[String],
) -> Result<(), SourceError> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(io("cannot read the role's attributes"))?;
    let (role, superuser): (String, bool) = (row.get(0), row.get(1));
    if superuser {
        return Ok(());
    }
    let mut missing = Missing::of(&role);
    let tables = if scope.is_empty() {
        published_tables(client, publication).await?
    } else {
        scope.to_vec()
    };
    lacking(client, &role, &tables, "UPDATE", &mut missing).await?;
    refuse(&missing)
}

/// Adds to `missing` each of `tables` (that exists) on which the role lacks `privilege`.
async fn lacking(
    client: &Client,
    role: &str,
    tables: &[String],
    privilege: &str,
    missing: &mut Missing,
) -> Result<(), SourceError> {
    let rows = client
        .query(
            "SELECT t FROM unnest($1::text[]) t \
             WHERE to_regclass(t) IS NOT NULL AND NOT has_table_privilege(to_regclass(t), $2)",
            &[&tables, &privilege],
        )
        .await
        .map_err(io(format!("cannot check the {privilege} privilege")))?;
    for row in rows {
        let table: String = row.get(0);
        missing.add(
            format!("{privilege} on table {table}"),
            format!("GRANT {privilege} ON {table} TO {}", quote_ident(role)),
        );
    }
    Ok(())
}

/// What creating the publication needs: CREATE on the database, ownership of each table (a
/// superuser for every table or a schema's).
async fn check_create_publication(
    client: &Client,
    database: &str,
    publication: &str,
    tables: &[String],
    missing: &mut Missing,
) -> Result<(), SourceError> {
    let made_by_admin = format!(
        "CREATE PUBLICATION {} FOR {}, then set `create = false`",
        quote_ident(publication),
        crate::pg_sql::publication_target(tables)
    );
    if tables.is_empty() || tables.iter().any(|t| t.ends_with(".*")) {
        missing.add(
            format!(
                "superuser, to create publication `{publication}` for every table or a whole schema"
            ),
            made_by_admin,
        );
        return Ok(());
    }
    let can_create: bool = client
        .query_one(
            "SELECT has_database_privilege(current_database(), 'CREATE')",
            &[],
        )
        .await
        .map_err(io("cannot check the CREATE privilege"))?
        .get(0);
    if !can_create {
        missing.add(
            format!("CREATE on database {database}, to create publication `{publication}`"),
            made_by_admin.clone(),
        );
    }
    let not_owned = client
        .query(
            "SELECT t FROM unnest($1::text[]) t JOIN pg_class c ON c.oid = to_regclass(t) \
             WHERE NOT pg_has_role(c.relowner, 'USAGE')",
            &[&tables],
        )
        .await
        .map_err(io("cannot check the tables' owners"))?;
    for row in not_owned {
        let table: String = row.get(0);
        missing.add(
            format!("ownership of table {table}, to add it to publication `{publication}`"),
            made_by_admin.clone(),
        );
    }
    Ok(())
}
