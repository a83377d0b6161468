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
//! **Position guard.** `source_position` is the position of the change that wrote the row,
//! zero-padded so that text order is position order: an upsert, delete or truncate only applies
//! to rows written at an older (or the same) position, so a replay of older changes never
//! overwrites a newer document. (A document deleted later can come back if changes older than
//! its delete are replayed without the delete: deletes leave no tombstone.)

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use refract_projections::WriteOp;
use refract_schemas::config::{PostgresSinkConfig, mask_url};

use crate::{Sink, SinkBatch, SinkError, WriteReport};

/// The PostgreSQL sink.
pub struct PostgresSink {
    name: String,
    config: PostgresSinkConfig,
    client: Option<tokio_postgres::Client>,
    /// Collections whose table exists.
    ready: HashSet<String>,
}

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl PostgresSink {
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
        format!(
            "{}.{}",
            quote(&self.config.schema),
            quote(&self.config.table.replace("{collection}", collection))
        )
    }

    /// Connection failures, serialization failures, lack of resources and shutdowns pass;
    /// other SQL errors (a missing privilege, a value PostgreSQL refuses) do not.
    fn classify(&mut self, what: String, e: tokio_postgres::Error) -> SinkError {
        let transient = match e.code() {
            None => true,
            Some(code) => {
                let class = &code.code()[..2];
                matches!(class, "08" | "40" | "53" | "57" | "58")
            }
        };
        if transient {
            // The next attempt reconnects.
            self.client = None;
            SinkError::Transient {
                sink: self.name.clone(),
                message: what,
                source: Some(Box::new(e)),
            }
        } else {
            SinkError::Permanent {
                sink: self.name.clone(),
                message: what,
                source: Some(Box::new(e)),
            }
        }
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        if self.client.as_ref().is_some_and(|c| !c.is_closed()) {
            return Ok(());
        }
        self.ready.clear();
        let pg: tokio_postgres::Config =
            self.config.url.parse().map_err(|e| SinkError::Permanent {
                sink: self.name.clone(),
                message: format!("invalid PostgreSQL URL `{}`", mask_url(&self.config.url)),
                source: Some(Box::new(e)),
            })?;
        let (client, connection) = match pg.connect(tokio_postgres::NoTls).await {
            Ok(c) => c,
            Err(e) => {
                let what = format!("cannot connect to {}", mask_url(&self.config.url));
                return Err(self.classify(what, e));
            }
        };
        let name = self.name.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(sink = %name, error = %e, "connection ended");
            }
        });
        self.client = Some(client);
        Ok(())
    }
}

/// The statements of one batch, per collection, after the last operation per key won.
#[derive(Default)]
struct Changes {
    upserts: Vec<(String, String, String)>,
    deletes: Vec<(String, String)>,
}

#[async_trait]
impl Sink for PostgresSink {
    fn name(&self) -> &str {
        &self.name
    }

    async fn open(&mut self) -> Result<(), SinkError> {
        self.connect().await
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        if batch
            .ops
            .iter()
            .any(|op| matches!(op, WriteOp::Invalidate { .. } | WriteOp::Flat { .. }))
        {
            return Err(SinkError::Permanent {
                sink: self.name.clone(),
                message: "holds documents only: write cache invalidations to a `redis` sink and flat rows to a `parquet` sink".into(),
                source: None,
            });
        }
        self.connect().await?;
        let mut report = WriteReport::default();
        // Segments between truncates, each: collection -> the last operation per key.
        let mut segments: Vec<(Vec<(String, Changes)>, Option<(String, String)>)> = Vec::new();
        for segment in batch
            .ops
            .split_inclusive(|op| matches!(op, WriteOp::Truncate { .. }))
        {
            let (body, truncate) = match segment.split_last() {
                Some((
                    WriteOp::Truncate {
                        collection,
                        position,
                    },
                    body,
                )) => (
                    body,
                    Some((collection.to_string(), position.offset.sortable())),
                ),
                _ => (segment, None),
            };
            let mut last: HashMap<(&str, &str), usize> = HashMap::with_capacity(body.len());
            for (i, op) in body.iter().enumerate() {
                if let WriteOp::Upsert {
                    collection, key, ..
                }
                | WriteOp::Delete {
                    collection, key, ..
                } = op
                {
                    last.insert((collection, key), i);
                }
            }
            report.coalesced += (body.len() - last.len()) as u64;
            let mut winners: Vec<usize> = last.into_values().collect();
            winners.sort_unstable();
            let mut by_collection: Vec<(String, Changes)> = Vec::new();
            for i in winners {
                let (collection, change) = match &body[i] {
                    WriteOp::Upsert {
                        collection,
                        key,
                        doc,
                        position,
                    } => {
                        report.upserted += 1;
                        let json = serde_json::to_string(&**doc).expect("a JSON map serializes");
                        (
                            collection,
                            Ok((key.clone(), json, position.offset.sortable())),
                        )
                    }
                    WriteOp::Delete {
                        collection,
                        key,
                        position,
                    } => {
                        report.deleted += 1;
                        (collection, Err((key.clone(), position.offset.sortable())))
                    }
                    _ => unreachable!("only upserts and deletes are indexed"),
                };
                let entry = match by_collection
                    .iter_mut()
                    .position(|(c, _)| **c == **collection)
                {
                    Some(p) => &mut by_collection[p].1,
                    None => {
                        by_collection.push((collection.to_string(), Changes::default()));
                        &mut by_collection.last_mut().expect("pushed").1
                    }
                };
                match change {
                    Ok(upsert) => entry.upserts.push(upsert),
                    Err(delete) => entry.deletes.push(delete),
                }
            }
            segments.push((by_collection, truncate));
        }

        let mut statements: Vec<(String, Vec<Vec<String>>)> = Vec::new();
        let mut creates: Vec<(String, String)> = Vec::new();
        let mut new_tables: Vec<String> = Vec::new();
        let mut ensure = |collection: &str, this: &Self| {
            if !this.ready.contains(collection) && !new_tables.iter().any(|c| c == collection) {
                new_tables.push(collection.to_owned());
                creates.push((
                    this.table(collection),
                    format!(
                        "CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, doc jsonb NOT NULL, \
                         source_position text COLLATE \"C\" NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())",
                        this.table(collection)
                    ),
                ));
            }
        };
        for (collections, truncate) in &segments {
            for (collection, changes) in collections {
                ensure(collection, self);
                let table = self.table(collection);
                for chunk in changes.upserts.chunks(self.config.rows_per_statement) {
                    let (mut ids, mut docs, mut positions) = (Vec::new(), Vec::new(), Vec::new());
                    for (id, doc, position) in chunk {
                        ids.push(id.clone());
                        docs.push(doc.clone());
                        positions.push(position.clone());
                    }
                    statements.push((
                        format!(
                            "INSERT INTO {table} AS t (id, doc, source_position) \
                             SELECT i, d::jsonb, p FROM unnest($1::text[], $2::text[], $3::text[]) AS u(i, d, p) \
                             ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, source_position = excluded.source_position, updated_at = now() \
                             WHERE t.source_position <= excluded.source_position"
                        ),
                        vec![ids, docs, positions],
                    ));
                }
                if !changes.deletes.is_empty() {
                    let (ids, positions): (Vec<String>, Vec<String>) =
                        changes.deletes.iter().cloned().unzip();
                    statements.push((
                        format!(
                            "DELETE FROM {table} AS t USING unnest($1::text[], $2::text[]) AS u(i, p) \
                             WHERE t.id = u.i AND t.source_position <= u.p"
                        ),
                        vec![ids, positions],
                    ));
                }
            }
            // Every document older than the truncate goes (a DELETE, not TRUNCATE, so that a
            // replayed truncate spares documents written after it).
            if let Some((collection, position)) = truncate {
                ensure(collection, self);
                report.deleted += 1;
                statements.push((
                    format!(
                        "DELETE FROM {} WHERE source_position <= ($1::text[])[1]",
                        self.table(collection)
                    ),
                    vec![vec![position.clone()]],
                ));
            }
        }
        let schema = quote(&self.config.schema);
        let schema_name = self.config.schema.clone();
        let client = self.client.as_mut().expect("connected above");
        let result: Result<(), (String, tokio_postgres::Error)> = async {
            let tx = client
                .transaction()
                .await
                .map_err(|e| ("cannot begin a transaction".to_owned(), e))?;
            // Look before creating: PostgreSQL checks the CREATE privilege even when the object
            // exists, and a writer may only have rights on tables made for it.
            if !creates.is_empty() {
                let exists = tx
                    .query_opt(
                        "SELECT 1 FROM pg_namespace WHERE nspname = $1",
                        &[&schema_name],
                    )
                    .await
                    .map_err(|e| ("cannot look up the schema".to_owned(), e))?
                    .is_some();
                if !exists {
                    tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                        .await
                        .map_err(|e| (format!("cannot create schema {schema}"), e))?;
                }
                for (table, create) in &creates {
                    let exists: bool = tx
                        .query_one("SELECT to_regclass($1) IS NOT NULL", &[table])
                        .await
                        .map_err(|e| ("cannot look up a read-model table".to_owned(), e))?
                        .get(0);
                    if !exists {
                        tx.batch_execute(create).await.map_err(|e| {
                            (format!("cannot create a read-model table ({create})"), e)
                        })?;
                    }
                }
            }
            for (sql, params) in &statements {
                let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                    .iter()
                    .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
                    .collect();
                tx.execute(sql.as_str(), &params).await.map_err(|e| {
                    (
                        format!(
                            "cannot apply the batch ({})",
                            sql.split(" AS ").next().unwrap_or(sql)
                        ),
                        e,
                    )
                })?;
            }
            tx.commit()
                .await
                .map_err(|e| ("cannot commit the batch".to_owned(), e))
        }
        .await;
        match result {
            Ok(()) => {
                self.ready.extend(new_tables);
                Ok(report)
            }
            Err((what, e)) => Err(self.classify(what, e)),
        }
    }

    async fn close(&mut self) -> Result<(), SinkError> {
        self.client = None;
        Ok(())
    }
}
