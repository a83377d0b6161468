//! The two tables of a migration as the catalog describes them, and the identity index: the
//! unique index on the target columns the source's primary key maps to, which the dual write's
//! upserts and verify's chunk reads go through.

use refract_schemas::config::{ColumnShape, TableShape};
use tokio_postgres::Client;

use super::{MigrationError, db};
use crate::pg_sql::{quote_ident, quote_table};

/// PostgreSQL's longest identifier, in bytes.
const MAX_IDENTIFIER: usize = 63;

/// A table of a migration: its shape and what reading and writing it needs.
#[derive(Debug, Clone)]
pub struct Table {
    /// Columns, types and key.
    pub shape: TableShape,
    /// Each column's type OID, in the order of `shape.columns`.
    pub oids: Vec<u32>,
    /// Each column's collation OID (0 where the type has none), in the same order.
    pub collations: Vec<u32>,
    /// Each column's type as values are cast to it, in the same order: its name without the
    /// modifier (`"pg_catalog"."varchar"`, not `character varying(20)`), and for a domain the
    /// type under it. A cast to the full type (or to a domain over `varchar(20)`) would cut a
    /// longer text, or a bit string, without a word; assigned to the column, the value is held
    /// to the modifier (and the domain's checks), and a value too long is refused.
    pub casts: Vec<String>,
    /// The table quoted for SQL.
    pub quoted: String,
}

impl Table {
    /// The type OID of column `name`.
    pub fn oid(&self, name: &str) -> Option<u32> {
        let i = self.shape.columns.iter().position(|c| c.name == name)?;
        Some(self.oids[i])
    }

    /// The collation OID of column `name` (0 where its type has none).
    pub fn collation(&self, name: &str) -> Option<u32> {
        let i = self.shape.columns.iter().position(|c| c.name == name)?;
        Some(self.collations[i])
    }

    /// The `format_type` text of column `name` (`character varying(20)`).
    pub fn type_name(&self, name: &str) -> Option<&str> {
        self.shape.column(name).map(|c| c.type_name.as_str())
    }

    /// The type values of column `name` are cast to (see [`Table::casts`]); `text` for a
    /// column the table does not have.
    pub fn cast_type(&self, name: &str) -> &str {
        let i = self.shape.columns.iter().position(|c| c.name == name);
        i.map_or("text", |i| self.casts[i].as_str())
    }
}

/// Reads `table` (as the migration file names it) from the catalog.
pub async fn read_table(client: &Client, table: &str) -> Result<Table, MigrationError> {
    let quoted = quote_table(table);
    let columns = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull, \
                    a.atttypid::oid, a.attcollation::oid, \
                    (WITH RECURSIVE d(oid) AS ( \
                         SELECT a.atttypid \
                         UNION ALL \
                         SELECT t.typbasetype FROM pg_type t JOIN d ON t.oid = d.oid \
                         WHERE t.typtype = 'd') \
                     SELECT quote_ident(n.nspname) || '.' || quote_ident(t.typname) \
                     FROM d JOIN pg_type t ON t.oid = d.oid \
                     JOIN pg_namespace n ON n.oid = t.typnamespace \
                     WHERE t.typtype <> 'd') \
             FROM pg_attribute a \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped \
             ORDER BY a.attnum",
            &[&quoted],
        )
        .await
        .map_err(db(format!("cannot read the columns of `{table}`")))?;
    if columns.is_empty() {
        return Err(MigrationError::Refused(format!(
            "table `{table}` does not exist (create it before the migration starts)"
        )));
    }
    let key = client
        .query(
            "SELECT a.attname::text \
             FROM pg_index i \
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
             WHERE i.indrelid = to_regclass($1) AND i.indisprimary \
             ORDER BY k.n",
            &[&quoted],
        )
        .await
        .map_err(db(format!("cannot read the primary key of `{table}`")))?;
    let shape = TableShape {
        table: table.to_owned(),
        key: key.iter().map(|r| r.get(0)).collect(),
        columns: columns
            .iter()
            .map(|r| ColumnShape {
                name: r.get(0),
                type_name: r.get(1),
                not_null: r.get(2),
            })
            .collect(),
    };
    if shape.key.is_empty() {
        return Err(MigrationError::Refused(format!(
            "table `{table}` has no primary key: rows could not be matched across the tables"
        )));
    }
    Ok(Table {
        shape,
        oids: columns.iter().map(|r| r.get(3)).collect(),
        collations: columns.iter().map(|r| r.get(4)).collect(),
        casts: columns.iter().map(|r| r.get(5)).collect(),
        quoted,
    })
}

/// `table` (as a file names it) as `schema.table`, the schema found on the search path.
pub async fn qualified_name(client: &Client, table: &str) -> Result<String, MigrationError> {
    let row = client
        .query_opt(
            "SELECT n.nspname::text || '.' || c.relname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
            &[&quote_table(table)],
        )
        .await
        .map_err(db(format!("cannot find `{table}`")))?;
    row.map(|r| r.get(0))
        .ok_or_else(|| MigrationError::Refused(format!("table `{table}` does not exist")))
}

/// Makes sure a unique index over exactly `columns` exists on `table` (its primary key, or
/// another unique index); creates `{table}_refract_identity` concurrently when none does.
/// Returns the name of the index it created, if it did.
pub async fn ensure_identity_index(
    client: &Client,
    table: &Table,
    columns: &[String],
) -> Result<Option<String>, MigrationError> {
    let found = client
        .query_one(
            "SELECT EXISTS ( \
               SELECT 1 FROM pg_index i \
               WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indisvalid \
                 AND i.indpred IS NULL AND i.indexprs IS NULL \
                 AND (SELECT array_agg(a.attname::text ORDER BY a.attname) \
                      FROM pg_attribute a \
                      WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)) \
                     = (SELECT array_agg(c ORDER BY c) FROM unnest($2::text[]) AS c))",
            &[&table.quoted, &columns],
        )
        .await
        .map_err(db(format!(
            "cannot read the indexes of `{}`",
            table.shape.table
        )))?;
    if found.get::<_, bool>(0) {
        return Ok(None);
    }
    let base = table
        .shape
        .table
        .rsplit('.')
        .next()
        .unwrap_or(&table.shape.table);
    let mut name = format!("{base}_refract_identity");
    name.truncate(MAX_IDENTIFIER);
    // An earlier attempt killed half-way leaves an invalid index of that name: start over.
    let schema_prefix = match table.shape.table.split_once('.') {
        Some((schema, _)) => format!("{}.", quote_ident(schema)),
        None => String::new(),
    };
    client
        .batch_execute(&format!(
            "DROP INDEX CONCURRENTLY IF EXISTS {schema_prefix}{}",
            quote_ident(&name)
        ))
        .await
        .map_err(db("cannot drop a half-built identity index"))?;
    let cols: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
    client
        .batch_execute(&format!(
            "CREATE UNIQUE INDEX CONCURRENTLY {} ON {} ({})",
            quote_ident(&name),
            table.quoted,
            cols.join(", ")
        ))
        .await
        .map_err(db(format!(
            "cannot create a unique index on ({}) of `{}` (two rows share those values?)",
            columns.join(", "),
            table.shape.table
        )))?;
    Ok(Some(name))
}

/// Whether the old rows a delete of `table` sends hold `columns` (its replica identity: the
/// primary key by default, an index, or the full row).
pub async fn replica_identity_covers(
    client: &Client,
    table: &Table,
    columns: &[String],
) -> Result<bool, MigrationError> {
    let row = client
        .query_one(
            "SELECT c.relreplident::text, \
                    coalesce((SELECT array_agg(a.attname::text) FROM pg_index i \
                              JOIN pg_attribute a ON a.attrelid = i.indrelid \
                                                  AND a.attnum = ANY (i.indkey) \
                              WHERE i.indrelid = c.oid \
                                AND ((c.relreplident = 'd' AND i.indisprimary) \
                                  OR (c.relreplident = 'i' AND i.indisreplident))), \
                             '{}') \
             FROM pg_class c WHERE c.oid = to_regclass($1)",
            &[&table.quoted],
        )
        .await
        .map_err(db(format!(
            "cannot read the replica identity of `{}`",
            table.shape.table
        )))?;
    let kind: String = row.get(0);
    let held: Vec<String> = row.get(1);
    Ok(kind == "f" || columns.iter().all(|c| held.contains(c)))
}
