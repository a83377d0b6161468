//! `kind = "migration"`: the dual write of a shadow-write migration, applied to the database
//! that holds both tables.
//!
//! A batch is one target transaction: its deletes and upserts (the last operation per row
//! wins), the switches of `read_from` it carries, and the position it reaches, recorded in the
//! control table's `applied_position`. Positions at or before the recorded one are skipped, so a
//! replay after a crash applies nothing twice and the target never goes back to an older value.
//! Upserts of rows already equal rewrite nothing.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use refract_schemas::config::MigrationSinkConfig;
use refract_schemas::write::OpFamily;
use refract_schemas::write::migration::{MigrationAction, MigrationOp};
use refract_schemas::{Checkpoint, Offset, Row};
use serde_json::Value;

use crate::migration::catalog::read_table;
use crate::migration::control::Control;
use crate::migration::rows::Writer;
use crate::migration::{MigrationError, connect};
use crate::{Intake, Sink, SinkBatch, SinkError, WriteReport};

/// What the migration sink accepts: migration rows.
type Accepted<'a> = &'a MigrationOp;

/// The migration sink.
pub struct MigrationSink {
    name: String,
    config: MigrationSinkConfig,
    control: Control,
    client: Option<tokio_postgres::Client>,
    /// Writers by table, built on first use.
    writers: HashMap<Arc<str>, Writer>,
    /// The newest position applied (from the control table).
    applied: Option<Offset>,
}

impl MigrationSink {
    /// The families of write operations this sink accepts.
    pub const ACCEPTS: &'static [OpFamily] = <Accepted<'static> as Intake<'static>>::FAMILIES;

    /// A sink named `name`; nothing is connected before [`Sink::open`].
    pub fn new(name: &str, config: MigrationSinkConfig) -> Self {
        Self {
            name: name.to_owned(),
            control: Control::new(&config.control_table, &config.migration),
            config,
            client: None,
            writers: HashMap::new(),
            applied: None,
        }
    }

    fn error(&mut self, e: MigrationError) -> SinkError {
        let (sink, message) = (self.name.clone(), e.to_string());
        if e.is_transient() {
            self.client = None;
            SinkError::Transient {
                sink,
                message,
                source: Some(Box::new(e)),
            }
        } else {
            SinkError::Permanent {
                sink,
                message,
                source: Some(Box::new(e)),
            }
        }
    }

    async fn writer(
        &mut self,
        table: &Arc<str>,
        identity: &[String],
    ) -> Result<(), MigrationError> {
        if self.writers.contains_key(table) {
            return Ok(());
        }
        let client = self
            .client
            .as_ref()
            .ok_or_else(|| MigrationError::Refused("not connected".into()))?;
        let shape = read_table(client, table).await?;
        self.writers
            .insert(table.clone(), Writer::new(&shape, identity));
        Ok(())
    }

    /// The identity values of `row` for `table`'s writer, as one comparable text.
    fn key_text(&self, table: &Arc<str>, row: &Row) -> String {
        identity_text(row, self.writers[table].identity())
    }

    async fn apply(&mut self, ops: &[&MigrationOp]) -> Result<WriteReport, MigrationError> {
        let mut report = WriteReport::default();
        // The last operation on each row wins; switches keep their order.
        let mut last: HashMap<(Arc<str>, String), usize> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            let Some((table, row)) = row_of(op) else {
                continue;
            };
            let identity: Vec<String> = match &op.action {
                MigrationAction::Upsert { identity, .. } => identity.to_vec(),
                _ => row.keys().cloned().collect(),
            };
            self.writer(table, &identity).await?;
            let key = (table.clone(), self.key_text(table, row));
            if last.insert(key, i).is_some() {
                report.coalesced += 1;
            }
        }
        let mut upserts: HashMap<Arc<str>, Vec<&Row>> = HashMap::new();
        let mut deletes: HashMap<Arc<str>, Vec<&Row>> = HashMap::new();
        let mut switches = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            match (&op.action, row_of(op)) {
                (MigrationAction::Switch { read_from }, _) => {
                    switches.push((read_from.clone(), op.position.offset))
                }
                (action, Some((table, row))) => {
                    if last.get(&(table.clone(), self.key_text(table, row))) != Some(&i) {
                        continue;
                    }
                    let into = if matches!(action, MigrationAction::Delete { .. }) {
                        &mut deletes
                    } else {
                        &mut upserts
                    };
                    into.entry(table.clone()).or_default().push(row);
                }
                (_, None) => {}
            }
        }
        let reached = ops.iter().map(|op| op.position.offset).max();
        let client = self
            .client
            .as_mut()
            .ok_or_else(|| MigrationError::Refused("not connected".into()))?;
        let tx = client
            .transaction()
            .await
            .map_err(crate::migration::db("cannot begin a transaction"))?;
        for (table, keys) in &deletes {
            report.deleted += self.writers[table].delete(&tx, keys).await?;
        }
        for (table, rows) in &upserts {
            self.writers[table].upsert(&tx, rows).await?;
            report.upserted += rows.len() as u64;
        }
        for (read_from, at) in &switches {
            self.control.switch(&tx, read_from, &at.sortable()).await?;
            tracing::info!(read_from = %read_from, position = %at, "migration switched reads");
        }
        if let Some(reached) = reached {
            self.control
                .update(
                    &tx,
                    "applied_position = $2, applied_at = now()",
                    &[&reached.sortable()],
                )
                .await?;
        }
        tx.commit()
            .await
            .map_err(crate::migration::db("cannot commit the dual write"))?;
        if reached.is_some() {
            self.applied = reached;
        }
        Ok(report)
    }
}

/// The table and row (or key) an upsert or delete writes.
fn row_of(op: &MigrationOp) -> Option<(&Arc<str>, &Row)> {
    match &op.action {
        MigrationAction::Upsert { table, row, .. } => Some((table, row)),
        MigrationAction::Delete { table, key } => Some((table, key)),
        MigrationAction::Switch { .. } => None,
    }
}

/// The values of `names` in `row`, as one comparable text.
fn identity_text(row: &Row, names: &[String]) -> String {
    let values: Vec<&Value> = names
        .iter()
        .map(|n| row.get(n).unwrap_or(&Value::Null))
        .collect();
    serde_json::to_string(&values).expect("JSON values serialize")
}

/// An offset as [`Offset::sortable`] wrote it.
pub fn parse_sortable(text: &str) -> Option<Offset> {
    let (major, minor) = text.split_once('.')?;
    Some(Offset(major.parse().ok()?, minor.parse().ok()?))
}

#[async_trait]
impl Sink for MigrationSink {
    async fn open(&mut self, _resume: &Checkpoint) -> Result<(), SinkError> {
        if self.client.as_ref().is_some_and(|c| !c.is_closed()) {
            return Ok(());
        }
        let result = async {
            let client = connect(self.config.url.expose()).await?;
            let row = self.control.require(&client).await?;
            let applied = row
                .get("applied_position")
                .and_then(Value::as_str)
                .and_then(parse_sortable);
            Ok::<_, MigrationError>((client, applied))
        }
        .await;
        match result {
            Ok((client, applied)) => {
                self.client = Some(client);
                self.applied = applied;
                Ok(())
            }
            Err(e) => Err(self.error(e)),
        }
    }

    async fn write(&mut self, batch: &SinkBatch) -> Result<WriteReport, SinkError> {
        let ops = batch.intake::<Accepted>(&self.name)?;
        let applied = self.applied;
        let fresh: Vec<&MigrationOp> = ops
            .into_iter()
            .filter(|op| applied.is_none_or(|a| op.position.offset > a))
            .collect();
        if fresh.is_empty() {
            return Ok(WriteReport::default());
        }
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = None;
            self.open(&Checkpoint::new()).await?;
        }
        match self.apply(&fresh).await {
            Ok(report) => Ok(report),
            Err(e) => Err(self.error(e)),
        }
    }

    async fn close(&mut self) -> Result<Option<String>, SinkError> {
        self.client = None;
        Ok(None)
    }
}
