//! Rows of a migration's tables: read in key order, written in batches.
//!
//! Values travel as text both ways: read with `column::text` and turned into JSON by type OID
//! (the PostgreSQL source's mapping, so a backfilled row and a streamed row are the same value),
//! written as `text[]` parameters cast to each column's type in the statement. One statement
//! writes a whole batch (`unnest` of one array per column), whatever its size.

use refract_schemas::{Columns, Row};
use serde_json::Value;
use tokio_postgres::GenericClient;
use tokio_postgres::ToStatement;
use tokio_postgres::types::ToSql;

use super::catalog::Table;
use super::{MigrationError, db};
use crate::pg_sql::quote_ident;
use crate::sources::postgres::values::text_to_json;

/// A value as PostgreSQL's text input reads it (`None`: SQL null).
pub fn pg_text(value: &Value) -> Option<String> {
    match value {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        other => Some(other.to_string()),
    }
}

/// `expr`, a column of type `type_name`, in a form `IS DISTINCT FROM` can compare: `json`,
/// `xml` and the geometric types have no equality operator, so they are compared as `jsonb`
/// or as text.
fn comparable(expr: &str, type_name: &str) -> String {
    const WITHOUT_EQUALITY: [&str; 8] = [
        "xml", "point", "line", "lseg", "box", "path", "polygon", "circle",
    ];
    let base = type_name.trim_end_matches("[]");
    if type_name == "json" {
        format!("{expr}::jsonb")
    } else if base == "json" || WITHOUT_EQUALITY.contains(&base) {
        format!("{expr}::text")
    } else {
        expr.to_owned()
    }
}

/// Reads rows of a table in the order of a set of key columns, a range at a time.
#[derive(Debug, Clone)]
pub struct Reader {
    table: Table,
    key: Vec<String>,
    /// Sorted column names, and for each the index of its `::text` in the select list.
    columns: Columns,
    select: Vec<usize>,
    oids: Vec<u32>,
}

impl Reader {
    /// A reader of `table` in the order of `key` (its primary key, or columns with a unique
    /// index: the identity of a target table).
    pub fn new(table: &Table, key: &[String]) -> Self {
        let names: Vec<String> = table.shape.columns.iter().map(|c| c.name.clone()).collect();
        let columns: Columns = names.iter().cloned().collect();
        let select = columns
            .names()
            .iter()
            .map(|n| names.iter().position(|m| m == n).expect("a column"))
            .collect();
        Self {
            table: table.clone(),
            key: key.to_vec(),
            columns,
            select,
            oids: table.oids.clone(),
        }
    }

    /// How many columns a row has (the select list's first columns, in table order).
    pub(super) fn width(&self) -> usize {
        self.select.len()
    }

    /// The key columns.
    pub fn key(&self) -> &[String] {
        &self.key
    }

    /// The values of the key columns of `row` (null for a missing one).
    pub fn key_of(&self, row: &Row) -> Vec<Value> {
        self.key
            .iter()
            .map(|k| row.get(k).cloned().unwrap_or(Value::Null))
            .collect()
    }

    /// Every column as text, `qualifier` before each (`t.`). Aliased: an output column named
    /// like a key column would be what ORDER BY sorts by, and integers sorted as text would
    /// put `10` before `9`.
    pub(super) fn select_list(&self, qualifier: &str) -> String {
        let list: Vec<String> = self
            .table
            .shape
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{qualifier}{}::text AS c{i}", quote_ident(&c.name)))
            .collect();
        list.join(", ")
    }

    /// The statement reading the rows whose key is after `$after` (when `after`), at most
    /// `$through` (when `through`), in key order, at most `limit` (when given), share-locked
    /// when `lock`.
    pub(super) fn statement(&self, after: bool, through: bool, limit: bool, lock: bool) -> String {
        self.statement_selecting(&self.select_list(""), after, through, limit, lock)
    }

    /// [`Reader::statement`] selecting `list` (over the table's columns, unqualified) instead
    /// of every column as text.
    pub(super) fn statement_selecting(
        &self,
        list: &str,
        after: bool,
        through: bool,
        limit: bool,
        lock: bool,
    ) -> String {
        let key: Vec<String> = self.key.iter().map(|k| quote_ident(k)).collect();
        let key = format!("({})", key.join(", "));
        let params = |first: usize| -> String {
            let p: Vec<String> = self
                .key
                .iter()
                .enumerate()
                .map(|(i, k)| format!("${}::text::{}", first + i, self.table.cast_type(k)))
                .collect();
            format!("({})", p.join(", "))
        };
        let mut sql = format!("SELECT {list} FROM {}", self.table.quoted);
        let mut conditions = Vec::new();
        let mut next = 1;
        if after {
            conditions.push(format!("{key} > {}", params(next)));
            next += self.key.len();
        }
        if through {
            conditions.push(format!("{key} <= {}", params(next)));
            next += self.key.len();
        }
        if !conditions.is_empty() {
            sql.push_str(&format!(" WHERE {}", conditions.join(" AND ")));
        }
        sql.push_str(&format!(
            " ORDER BY {}",
            self.key
                .iter()
                .map(|k| quote_ident(k))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        if limit {
            sql.push_str(&format!(" LIMIT ${next}"));
        }
        if lock {
            sql.push_str(" FOR SHARE");
        }
        sql
    }

    /// Reads the rows whose key is one of `keys` (each the values of the key columns), in
    /// key order.
    pub async fn read_keys(
        &self,
        client: &impl GenericClient,
        keys: &[Vec<Value>],
    ) -> Result<Vec<Row>, MigrationError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let list = self.select_list("t.");
        let names: Vec<String> = (0..self.key.len()).map(|i| format!("k{i}")).collect();
        let matches: Vec<String> = self
            .key
            .iter()
            .enumerate()
            .map(|(i, k)| format!("t.{} = u.k{i}::{}", quote_ident(k), self.table.cast_type(k)))
            .collect();
        let arrays: Vec<String> = (1..=self.key.len())
            .map(|i| format!("${i}::text[]"))
            .collect();
        let order: Vec<String> = self
            .key
            .iter()
            .map(|k| format!("t.{}", quote_ident(k)))
            .collect();
        let sql = format!(
            "SELECT {list} FROM {} AS t JOIN unnest({}) AS u({}) ON {} ORDER BY {}",
            self.table.quoted,
            arrays.join(", "),
            names.join(", "),
            matches.join(" AND "),
            order.join(", ")
        );
        let columns: Vec<Vec<Option<String>>> = (0..self.key.len())
            .map(|i| keys.iter().map(|k| k.get(i).and_then(pg_text)).collect())
            .collect();
        let params: Vec<&(dyn ToSql + Sync)> =
            columns.iter().map(|a| a as &(dyn ToSql + Sync)).collect();
        let rows = client
            .query(&sql, &params)
            .await
            .map_err(db(format!("cannot read `{}`", self.table.shape.table)))?;
        self.decode(&rows)
    }

    /// Reads the rows after key `after` (from the start when `None`) through key `through`
    /// (to the end when `None`), in key order, at most `limit` of them; `lock` share-locks
    /// them until the transaction `client` is in ends.
    pub async fn read(
        &self,
        client: &impl GenericClient,
        after: Option<&[Value]>,
        through: Option<&[Value]>,
        limit: Option<i64>,
        lock: bool,
    ) -> Result<Vec<Row>, MigrationError> {
        let sql = self.statement(after.is_some(), through.is_some(), limit.is_some(), lock);
        let rows = self
            .query_with(client, sql.as_str(), after, through, limit)
            .await?;
        self.decode(&rows)
    }

    /// [`Reader::read`] with `statement` (its SQL text, or that of [`Reader::statement`] for
    /// the same `after`, `through` and `limit`, prepared on `client`), without the decoding:
    /// `statement` may select more after the columns (see [`Reader::statement_selecting`]).
    pub(super) async fn query_with<S>(
        &self,
        client: &impl GenericClient,
        statement: &S,
        after: Option<&[Value]>,
        through: Option<&[Value]>,
        limit: Option<i64>,
    ) -> Result<Vec<tokio_postgres::Row>, MigrationError>
    where
        S: ToStatement + Sync + Send + ?Sized,
    {
        let mut texts: Vec<Option<String>> = Vec::new();
        for key in [after, through].into_iter().flatten() {
            texts.extend(key.iter().map(pg_text));
        }
        let mut params: Vec<&(dyn ToSql + Sync)> =
            texts.iter().map(|t| t as &(dyn ToSql + Sync)).collect();
        if let Some(limit) = &limit {
            params.push(limit);
        }
        client
            .query(statement, &params)
            .await
            .map_err(db(format!("cannot read `{}`", self.table.shape.table)))
    }

    /// Rows as the select list of [`Reader::statement`] returns them, as JSON values (columns
    /// after that list are the caller's to read).
    pub(super) fn decode(&self, rows: &[tokio_postgres::Row]) -> Result<Vec<Row>, MigrationError> {
        rows.iter()
            .map(|r| {
                let values = self
                    .select
                    .iter()
                    .map(|&i| {
                        let text: Option<&str> = r.get(i);
                        match text {
                            None => Ok(Value::Null),
                            Some(t) => text_to_json(self.oids[i], t).map_err(|e| {
                                MigrationError::Refused(format!(
                                    "`{}`.`{}`: {e}",
                                    self.table.shape.table, self.table.shape.columns[i].name
                                ))
                            }),
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Row::from_columns(self.columns.clone(), values))
            })
            .collect()
    }
}

/// Writes batches of rows into one table, matched by a set of identity columns.
#[derive(Debug, Clone)]
pub struct Writer {
    table: String,
    columns: Vec<String>,
    identity: Vec<String>,
    upsert: String,
    delete: String,
    /// `INSERT INTO table (columns)` and its `ON CONFLICT …` clause, around a row source.
    insert: [String; 2],
}

impl Writer {
    /// A writer of `table`, whose rows are identified by `identity` (columns with a unique
    /// index: an upsert replaces the row with the same identity values).
    pub fn new(table: &Table, identity: &[String]) -> Self {
        let columns: Vec<String> = table.shape.columns.iter().map(|c| c.name.clone()).collect();
        let cast =
            |alias: &str, c: &str| format!("{alias}.{}::{}", quote_ident(c), table.cast_type(c));
        let arrays = |n: usize| -> String {
            (1..=n)
                .map(|i| format!("${i}::text[]"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let quoted: Vec<String> = columns.iter().map(|c| quote_ident(c)).collect();
        let rest: Vec<&String> = columns.iter().filter(|c| !identity.contains(c)).collect();
        let conflict = if rest.is_empty() {
            "DO NOTHING".to_owned()
        } else {
            let set: Vec<String> = rest
                .iter()
                .map(|c| format!("{0} = EXCLUDED.{0}", quote_ident(c)))
                .collect();
            let compared = |qualifier: &str, c: &str| {
                comparable(
                    &format!("{qualifier}.{}", quote_ident(c)),
                    table.type_name(c).unwrap_or("text"),
                )
            };
            let old: Vec<String> = rest.iter().map(|c| compared(&table.quoted, c)).collect();
            let new: Vec<String> = rest.iter().map(|c| compared("EXCLUDED", c)).collect();
            // A row already equal is not rewritten: no dead tuple, no WAL, no echo.
            format!(
                "DO UPDATE SET {} WHERE ({}) IS DISTINCT FROM ({})",
                set.join(", "),
                old.join(", "),
                new.join(", ")
            )
        };
        let identity_quoted: Vec<String> = identity.iter().map(|c| quote_ident(c)).collect();
        let insert = format!("INSERT INTO {} ({})", table.quoted, quoted.join(", "));
        let on_conflict = format!("ON CONFLICT ({}) {conflict}", identity_quoted.join(", "));
        let upsert = format!(
            "{insert} SELECT {casts} FROM unnest({arrays}) AS u({cols}) {on_conflict}",
            cols = quoted.join(", "),
            casts = columns
                .iter()
                .map(|c| cast("u", c))
                .collect::<Vec<_>>()
                .join(", "),
            arrays = arrays(columns.len()),
        );
        let matches: Vec<String> = identity
            .iter()
            .map(|c| format!("t.{} = {}", quote_ident(c), cast("u", c)))
            .collect();
        let delete = format!(
            "DELETE FROM {table} AS t USING unnest({arrays}) AS u({cols}) WHERE {matches}",
            table = table.quoted,
            arrays = arrays(identity.len()),
            cols = identity_quoted.join(", "),
            matches = matches.join(" AND "),
        );
        Self {
            table: table.shape.table.clone(),
            columns,
            identity: identity.to_vec(),
            upsert,
            delete,
            insert: [insert, on_conflict],
        }
    }

    /// The columns written, in the order of [`Writer::upsert_selecting`]'s `select`.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// The statement that inserts the rows of `select` (as [`Writer::upsert_selecting`]),
    /// failing on a row whose identity the table holds already.
    pub fn insert_selecting(&self, select: &str) -> String {
        format!("{} {select}", self.insert[0])
    }

    /// The statement that upserts the rows of `select` (one column per [`Writer::columns`],
    /// in that order) as [`Writer::upsert`] upserts its rows.
    pub fn upsert_selecting(&self, select: &str) -> String {
        format!("{} {select} {}", self.insert[0], self.insert[1])
    }

    /// The identity columns.
    pub fn identity(&self) -> &[String] {
        &self.identity
    }

    /// Inserts `rows`, replacing those with the same identity; no two may share an identity.
    pub async fn upsert(
        &self,
        client: &impl GenericClient,
        rows: &[&Row],
    ) -> Result<u64, MigrationError> {
        self.upsert_with(client, self.upsert.as_str(), rows).await
    }

    /// Prepares on `client` the statement of [`Writer::upsert`], for [`Writer::upsert_with`].
    pub async fn prepare_upsert(
        &self,
        client: &impl GenericClient,
    ) -> Result<tokio_postgres::Statement, MigrationError> {
        client
            .prepare(&self.upsert)
            .await
            .map_err(db(format!("cannot write into `{}`", self.table)))
    }

    /// [`Writer::upsert`] with `statement`: its SQL text, or the statement
    /// [`Writer::prepare_upsert`] prepared on `client`.
    pub async fn upsert_with<S>(
        &self,
        client: &impl GenericClient,
        statement: &S,
        rows: &[&Row],
    ) -> Result<u64, MigrationError>
    where
        S: ToStatement + Sync + Send + ?Sized,
    {
        if rows.is_empty() {
            return Ok(0);
        }
        let arrays: Vec<Vec<Option<String>>> = self
            .columns
            .iter()
            .map(|c| rows.iter().map(|r| r.get(c).and_then(pg_text)).collect())
            .collect();
        let params: Vec<&(dyn ToSql + Sync)> =
            arrays.iter().map(|a| a as &(dyn ToSql + Sync)).collect();
        client.execute(statement, &params).await.map_err(db(format!(
            "cannot write {} rows into `{}`",
            rows.len(),
            self.table
        )))
    }

    /// Deletes the rows whose identity columns hold the values of `keys`.
    pub async fn delete(
        &self,
        client: &impl GenericClient,
        keys: &[&Row],
    ) -> Result<u64, MigrationError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let arrays: Vec<Vec<Option<String>>> = self
            .identity
            .iter()
            .map(|c| keys.iter().map(|r| r.get(c).and_then(pg_text)).collect())
            .collect();
        let params: Vec<&(dyn ToSql + Sync)> =
            arrays.iter().map(|a| a as &(dyn ToSql + Sync)).collect();
        client
            .execute(&self.delete, &params)
            .await
            .map_err(db(format!(
                "cannot delete {} rows of `{}`",
                keys.len(),
                self.table
            )))
    }
}
