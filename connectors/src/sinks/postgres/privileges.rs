//! What the PostgreSQL sink's role may do, checked when the sink opens, before it writes.
//!
//! The least the sink needs (docs/sinks/postgres.md): USAGE on its schema, and SELECT, INSERT,
//! UPDATE and DELETE on its read-model tables and on the tombstones table; to create what is
//! missing, CREATE on the database (the schema) or on the schema (the tables). With a role
//! limited to DML, an administrator creates the schema and the tables first.

use tokio_postgres::GenericClient;

use crate::pg_sql::quote_ident;
use crate::privileges::Missing;

/// The privileges on a read-model table that writing it takes: SELECT for the upserts' and
/// deletes' position guards, the three others for the writes themselves.
const TABLE_PRIVILEGES: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

/// The missing privileges of the role of `tx` (a client or a transaction) on `schema`, the tombstones table and the
/// existing tables whose names match `pattern` (`LIKE`); `None` when nothing is missing.
pub(super) async fn check(
    tx: &impl GenericClient,
    sink: &str,
    schema: &str,
    tombstones: &str,
    pattern: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let role = tx
        .query_one(
            "SELECT current_user::text, rolsuper, current_database()::text \
             FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (name, superuser, database): (String, bool, String) =
        (role.get(0), role.get(1), role.get(2));
    if superuser {
        return Ok(None);
    }
    let mut missing = Missing::of(&name);
    let grantee = quote_ident(&name);
    let quoted_schema = quote_ident(schema);
    let rights = tx
        .query_opt(
            "SELECT has_schema_privilege(oid, 'USAGE'), has_schema_privilege(oid, 'CREATE') \
             FROM pg_namespace WHERE nspname = $1",
            &[&schema],
        )
        .await?;
    let Some(rights) = rights else {
        let may: bool = tx
            .query_one(
                "SELECT has_database_privilege(current_database(), 'CREATE')",
                &[],
            )
            .await?
            .get(0);
        if !may {
            missing.add(
                format!("CREATE on database {database}, to create schema {schema}"),
                format!("CREATE SCHEMA {quoted_schema}; GRANT USAGE, CREATE ON SCHEMA {quoted_schema} TO {grantee}"),
            );
        }
        return Ok(missing.report(&format!("sink `{sink}`"), "nothing was written"));
    };
    let (usage, create): (bool, bool) = (rights.get(0), rights.get(1));
    if !usage {
        missing.add(
            format!("USAGE on schema {schema}"),
            format!("GRANT USAGE ON SCHEMA {quoted_schema} TO {grantee}"),
        );
        return Ok(missing.report(&format!("sink `{sink}`"), "nothing was written"));
    }
    let tombstones_exist: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2)",
            &[&schema, &tombstones],
        )
        .await?
        .get(0);
    if !tombstones_exist && !create {
        missing.add(
            format!("CREATE on schema {schema}, to create table {schema}.{tombstones}"),
            format!("GRANT CREATE ON SCHEMA {quoted_schema} TO {grantee} (or create the table as docs/sinks/postgres.md shows)"),
        );
    }
    let lacking = tx
        .query(
            "SELECT t.tablename::text, string_agg(p, ', ' ORDER BY o) \
             FROM pg_tables t, unnest($4::text[]) WITH ORDINALITY AS u(p, o) \
             WHERE t.schemaname = $1 AND (t.tablename LIKE $2 OR t.tablename = $3) \
               AND NOT has_table_privilege(format('%I.%I', t.schemaname, t.tablename), p) \
             GROUP BY t.tablename ORDER BY t.tablename",
            &[&schema, &pattern, &tombstones, &TABLE_PRIVILEGES.as_slice()],
        )
        .await?;
    for row in lacking {
        let (table, privileges): (String, String) = (row.get(0), row.get(1));
        missing.add(
            format!("{privileges} on table {schema}.{table}"),
            format!(
                "GRANT {privileges} ON {quoted_schema}.{} TO {grantee}",
                quote_ident(&table)
            ),
        );
    }
    Ok(missing.report(&format!("sink `{sink}`"), "nothing was written"))
}
