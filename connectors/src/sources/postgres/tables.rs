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
use super::source::{connect, io, quote_ident};
use super::values::text_to_json;
use crate::SourceError;

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
        let rows = self
            .client
            .query(
                "SELECT schemaname::text || '.' || tablename::text FROM pg_publication_tables \
                 WHERE pubname = $1 ORDER BY 1",
                &[&publication],
            )
            .await
            .map_err(io("cannot list the publication's tables"))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// The planner's estimate of the rows of `table` (`schema.table`; 0 when never analyzed).
    pub async fn estimate(&self, table: &str) -> Result<u64, SourceError> {
        let (schema, name) = table.split_once('.').unwrap_or(("public", table));
        let quoted = format!("{}.{}", quote_ident(schema), quote_ident(name));
        let row = self
            .client
            .query_one(
                "SELECT reltuples::int8 FROM pg_class WHERE oid = $1::text::regclass",
                &[&quoted],
            )
            .await
            .map_err(io(format!("cannot estimate the rows of {table}")))?;
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    /// The rows of `table` (`schema.table`) as read events; returns how many.
    pub async fn read(
        &self,
        table: &str,
        visit: &mut (dyn FnMut(ChangeEvent) + Send),
    ) -> Result<u64, SourceError> {
        use futures::StreamExt as _;
        let (schema, name) = table.split_once('.').unwrap_or(("public", table));
        let quoted = format!("{}.{}", quote_ident(schema), quote_ident(name));
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
        let stream = self
            .client
            .copy_out(sql.as_str())
            .await
            .map_err(io(format!("cannot read `{table}`")))?;
        futures::pin_mut!(stream);
        let mut pending: Vec<u8> = Vec::new();
        let mut count = 0u64;
        while let Some(data) = stream.next().await {
            let data = data.map_err(io(format!("reading `{table}` failed")))?;
            pending.extend_from_slice(&data);
            let mut fields = Vec::new();
            let mut start = 0;
            while let Some(n) = memchr::memchr(b'\n', &pending[start..]) {
                let line = &pending[start..start + n];
                start += n + 1;
                parse_copy_line(line, &mut fields).map_err(|e| {
                    SourceError::Inconsistent(format!("`{table}`: unreadable row: {e}"))
                })?;
                let mut row = Row::new();
                for ((column, oid), value) in columns.names.iter().zip(&columns.types).zip(&fields)
                {
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
                    before: None,
                    after: Some(Arc::new(row)),
                    source: Default::default(),
                    transaction: None,
                    position: Position {
                        partition: partition.clone(),
                        offset: Offset(0, count),
                    },
                });
            }
            pending.drain(..start);
        }
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
    use futures::StreamExt as _;
    let client = connect(url).await?;
    let exists = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{}.{}", quote_ident(schema), quote_ident(table))],
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
    let stream = client
        .copy_out(sql.as_str())
        .await
        .map_err(io(format!("cannot read {schema}.{table}")))?;
    futures::pin_mut!(stream);
    let mut pending: Vec<u8> = Vec::new();
    while let Some(data) = stream.next().await {
        let data = data.map_err(io(format!("reading {schema}.{table} failed")))?;
        pending.extend_from_slice(&data);
        let mut fields = Vec::new();
        let mut start = 0;
        while let Some(n) = memchr::memchr(b'\n', &pending[start..]) {
            let line = &pending[start..start + n];
            start += n + 1;
            parse_copy_line(line, &mut fields)
                .map_err(|e| SourceError::Inconsistent(format!("{schema}.{table}: {e}")))?;
            let (Some(Some(id)), Some(Some(doc))) = (fields.first(), fields.get(1)) else {
                continue;
            };
            let doc: Value = serde_json::from_str(doc).map_err(|e| {
                SourceError::Inconsistent(format!("{schema}.{table}: document `{id}`: {e}"))
            })?;
            visit(id.to_string(), doc);
        }
        pending.drain(..start);
    }
    Ok(true)
}
