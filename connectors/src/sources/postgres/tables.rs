//! Whole tables read outside the replication stream, as read events (`refract verify`
//! recomputes read models from them), and documents read back from PostgreSQL read models.
//!
//! Every table is read inside one REPEATABLE READ transaction, so all of them come from the same
//! snapshot, with COPY; values are converted to JSON exactly as the replication stream converts
//! them ([`text_to_json`]), so a recomputed read model compares equal to a streamed one.

use std::sync::Arc;

use refract_schemas::{ChangeEvent, Offset, Op, Position, Row, TableId};
use serde_json::Value;

use super::snapshot::parse_copy_line;
use super::source::{connect, io};
use super::values::text_to_json;
use crate::SourceError;
use crate::pg_sql::{qualified, quote_ident};

/// A consistent view of a database's tables.
pub struct TableReader {
    client: tokio_postgres::Client,
}

/// One table's columns and key, as read.
struct Columns {
    names: Vec<String>,
    types: Vec<u32>,
    key: Vec<String>,
}

impl TableReader {
    /// Connects and opens the snapshot every read uses.
    pub async fn open(url: &str) -> Result<Self, SourceError> {
        let client = connect(url).await?;
        client
            .batch_execute(
                "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET LOCAL DateStyle = 'ISO'",
            )
            .await
            .map_err(io("cannot open a snapshot of the source"))?;
        Ok(Self { client })
    }

    /// `schema.table` of every table of `publication`, sorted.
    pub async fn published(&self, publication: &str) -> Result<Vec<String>, SourceError> {
        super::snapshot::published_tables(&self.client, publication).await
    }

    /// The planner's estimate of the rows of `table` (`schema.table`; 0 when never analyzed).
    pub async fn estimate(&self, table: &str) -> Result<u64, SourceError> {
        let (schema, name) = table.split_once('.').unwrap_or(("public", table));
        let quoted = qualified(schema, name);
        Ok(super::snapshot::planner_estimate(&self.client, &quoted)
            .await?
            .unwrap_or(0))
    }

    /// The rows of `table` (`schema.table`) as read events; returns how many.
    pub async fn read(
        &self,
        table: &str,
        visit: &mut (dyn FnMut(ChangeEvent) + Send),
    ) -> Result<u64, SourceError> {
        let (schema, name) = table.split_once('.').unwrap_or(("public", table));
        let quoted = qualified(schema, name);
        let columns = self.columns(&quoted).await?;
        let id = TableId::new(schema, name);
        let partition: Arc<str> = Arc::from(format!("verify:{table}"));
        let sql = format!(
            "COPY (SELECT {} FROM {quoted}) TO STDOUT",
            columns
                .names
                .iter()
                .map(|c| quote_ident(c))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut count = 0u64;
        copy_lines(&self.client, &sql, table, &mut |fields| {
            let mut row = Row::new();
            for ((column, oid), value) in columns.names.iter().zip(&columns.types).zip(fields) {
                let value = match value {
                    None => Value::Null,
                    Some(text) => text_to_json(*oid, text).map_err(|e| {
                        SourceError::Inconsistent(format!("`{table}` column `{column}`: {e}"))
                    })?,
                };
                row.insert(column.clone(), value);
            }
            let key: Row = columns
                .key
                .iter()
                .filter_map(|k| row.get(k).map(|v| (k.clone(), v.clone())))
                .collect();
            count += 1;
            visit(ChangeEvent {
                table: id.clone(),
                op: Op::Read,
                key: (!key.is_empty()).then(|| Arc::new(key)),
                key_columns: None,
                before: None,
                after: Some(Arc::new(row)),
                source: Default::default(),
                transaction: None,
                position: Position {
                    partition: partition.clone(),
                    offset: Offset(0, count),
                },
            });
            Ok(())
        })
        .await?;
        Ok(count)
    }

    async fn columns(&self, quoted: &str) -> Result<Columns, SourceError> {
        let rows = self
            .client
            .query(
                "SELECT a.attname::text, a.atttypid, array_position(i.indkey, a.attnum) \
                 FROM pg_attribute a \
                 LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary AND a.attnum = ANY(i.indkey) \
                 WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped \
                   AND a.attgenerated = '' ORDER BY a.attnum",
                &[&quoted],
            )
            .await
            .map_err(io(format!("cannot read the columns of {quoted}")))?;
        let mut key: Vec<(i32, String)> = Vec::new();
        let mut names = Vec::new();
        let mut types = Vec::new();
        for row in &rows {
            let name: String = row.get(0);
            if let Some(position) = row.get::<_, Option<i32>>(2) {
                key.push((position, name.clone()));
            }
            names.push(name);
            types.push(row.get(1));
        }
        key.sort();
        Ok(Columns {
            names,
            types,
            key: key.into_iter().map(|(_, k)| k).collect(),
        })
    }
}

/// Reads the documents of a PostgreSQL read-model table (`id`, `doc`), calling `visit` with
/// each; returns false when the table does not exist.
pub async fn read_documents(
    url: &str,
    schema: &str,
    table: &str,
    visit: &mut (dyn FnMut(String, Value) + Send),
) -> Result<bool, SourceError> {
    let client = connect(url).await?;
    let exists = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&qualified(schema, table)],
        )
        .await
        .map_err(io("cannot look the read model up"))?;
    if !exists.get::<_, bool>(0) {
        return Ok(false);
    }
    let sql = format!(
        "COPY (SELECT id, doc FROM {}.{}) TO STDOUT",
        quote_ident(schema),
        quote_ident(table)
    );
    let what = format!("{schema}.{table}");
    copy_lines(&client, &sql, &what, &mut |fields| {
        let (Some(Some(id)), Some(Some(doc))) = (fields.first(), fields.get(1)) else {
            return Ok(());
        };
        let doc: Value = serde_json::from_str(doc)
            .map_err(|e| SourceError::Inconsistent(format!("{what}: document `{id}`: {e}")))?;
        visit(id.to_string(), doc);
        Ok(())
    })
    .await?;
    Ok(true)
}

/// Runs `sql` (a `COPY … TO STDOUT`) and calls `line` with the fields of each line.
async fn copy_lines(
    client: &tokio_postgres::Client,
    sql: &str,
    what: &str,
    line: &mut (dyn FnMut(&[Option<std::borrow::Cow<'_, str>>]) -> Result<(), SourceError> + Send),
) -> Result<(), SourceError> {
    use futures::StreamExt as _;
    let stream = client
        .copy_out(sql)
        .await
        .map_err(io(format!("cannot read {what}")))?;
    futures::pin_mut!(stream);
    let mut pending: Vec<u8> = Vec::new();
    while let Some(data) = stream.next().await {
        let data = data.map_err(io(format!("reading {what} failed")))?;
        pending.extend_from_slice(&data);
        let mut fields = Vec::new();
        let mut start = 0;
        while let Some(n) = memchr::memchr(b'\n', &pending[start..]) {
            parse_copy_line(&pending[start..start + n], &mut fields)
                .map_err(|e| SourceError::Inconsistent(format!("{what}: unreadable row: {e}")))?;
            start += n + 1;
            line(&fields)?;
        }
        pending.drain(..start);
    }
    Ok(())
}
