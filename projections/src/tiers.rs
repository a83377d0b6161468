//! `kind = "tiers"`: each heartbeat goes to the tiers its age puts it in (seed 003 §4.2).
//!
//! Age is the pipeline clock (`now`) minus the heartbeat's event time:
//! - younger than the hot window: hot and warm (the warm tier is the record of the last weeks);
//! - younger than the warm window: warm only;
//! - older (late data, a backfill of history): cold, straight away.
//!
//! A heartbeat in the future (a device clock ahead) counts as age 0. Deletes remove the
//! heartbeat from hot and warm; the cold tier is an append-only archive, so deleting a heartbeat
//! older than the warm window is bad input. A truncate of the heartbeat table is bad input too:
//! emptying every tier because a source table was emptied is not what an archive is for.

use std::sync::Arc;

use refract_schemas::config::{TierColumn, TierColumnType, TiersProjectionConfig, window_micros};
/// The first four hex digits of `md5(device_id)`: spreads consecutive device ids over shards
/// (defined in `refract_schemas`, shared with the connectors).
pub use refract_schemas::write::tiers::device_hash;
use refract_schemas::write::tiers::{Heartbeat, Tier, TierAction, TierWrite};
use refract_schemas::{ChangeEvent, Op, Position, Row, TableId};
use serde_json::Value;

use crate::{OpFamily, Projection, ProjectionError, WriteOp};

/// The tiers projection.
pub struct TiersProjection {
    config: TiersProjectionConfig,
    hot_micros: i64,
    warm_micros: i64,
}

impl TiersProjection {
    /// The families of write operations this projection emits.
    pub const EMITS: &'static [OpFamily] = &[OpFamily::Tiers];

    /// Builds the projection from a validated configuration (windows that parse).
    pub fn new(config: &TiersProjectionConfig) -> Self {
        // Validation refuses windows that do not parse; none would mean "never older".
        let micros = |w: &str| window_micros(w).unwrap_or(i64::MAX);
        Self {
            hot_micros: micros(&config.hot),
            warm_micros: micros(&config.warm),
            config: config.clone(),
        }
    }

    /// The tiers a heartbeat of time `ts` belongs in at clock `now` (both microseconds).
    pub fn tiers_at(&self, ts: i64, now: i64) -> &'static [Tier] {
        let age = now.saturating_sub(ts).max(0);
        if age < self.hot_micros {
            &[Tier::Hot, Tier::Warm]
        } else if age < self.warm_micros {
            &[Tier::Warm]
        } else {
            &[Tier::Cold]
        }
    }

    /// The heartbeat in `row`; with `values = false` only its key (device, time, region).
    fn heartbeat(&self, row: &Row, values: bool) -> Result<Heartbeat, ProjectionError> {
        let c = &self.config;
        let device_id = text(row, &c.device)?;
        let ts_micros = event_time(row.get(&c.time), &c.time)?;
        let region = text(row, &c.region)?;
        let values = if values {
            c.columns
                .iter()
                .map(|col| typed(row.get(&col.name), col))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(Heartbeat {
            device_hash: device_hash(&device_id),
            device_id,
            region,
            ts_micros,
            values,
        })
    }

    fn emit(
        &self,
        action: TierAction,
        heartbeat: Heartbeat,
        now: i64,
        position: &Position,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let tiers = self.tiers_at(heartbeat.ts_micros, now);
        let tiers: &[Tier] = match action {
            TierAction::Put => tiers,
            TierAction::Delete if tiers == [Tier::Cold] => {
                return Err(ProjectionError::Invalid(format!(
                    "heartbeat of device `{}` at {} is older than the warm window ({}): the cold \
                     tier is an append-only archive and does not delete",
                    heartbeat.device_id,
                    format_micros(heartbeat.ts_micros),
                    self.config.warm
                )));
            }
            TierAction::Delete => &[Tier::Hot, Tier::Warm],
        };
        let heartbeat = Arc::new(heartbeat);
        for &tier in tiers {
            out.push(WriteOp::Tier(TierWrite {
                tier,
                action: action.clone(),
                heartbeat: heartbeat.clone(),
                clock_micros: now,
                position: position.clone(),
            }));
        }
        Ok(())
    }
}

impl Projection for TiersProjection {
    fn reads(&self, table: &TableId) -> bool {
        table.matches(&self.config.table)
    }

    /// A delete needs the region (in the hot tier's key) besides the primary key.
    fn before_image_columns(&self, _table: &TableId) -> Vec<String> {
        vec![
            self.config.device.clone(),
            self.config.time.clone(),
            self.config.region.clone(),
        ]
    }

    fn project(
        &mut self,
        event: &ChangeEvent,
        now_ms: i64,
        out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        let now = now_ms.saturating_mul(1_000);
        let pos = &event.position;
        match event.op {
            Op::Create | Op::Read | Op::Update => {
                let after = event
                    .after
                    .as_deref()
                    .ok_or_else(|| ProjectionError::Invalid("no after image".into()))?;
                let new = self.heartbeat(after, true)?;
                // A heartbeat whose device or time changed leaves its old place first.
                if let Some(before) = event.before.as_deref().filter(|_| event.op == Op::Update) {
                    let old = self.heartbeat(before, false)?;
                    if old.device_id != new.device_id || old.ts_micros != new.ts_micros {
                        self.emit(TierAction::Delete, old, now, pos, out)?;
                    }
                }
                self.emit(TierAction::Put, new, now, pos, out)
            }
            Op::Delete => {
                let before = event.before.as_deref().ok_or_else(|| {
                    ProjectionError::Invalid("delete without a before image".into())
                })?;
                let old = self.heartbeat(before, false)?;
                self.emit(TierAction::Delete, old, now, pos, out)
            }
            Op::Truncate => Err(ProjectionError::Invalid(format!(
                "truncate of `{}`: the tiers keep their heartbeats (empty them with `refract drop` \
                 or by hand)",
                event.table
            ))),
        }
    }
}

/// A non-empty text column.
fn text(row: &Row, column: &str) -> Result<String, ProjectionError> {
    match row.get(column) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(Value::Null) | None => Err(missing(column)),
        Some(v) => Err(ProjectionError::Invalid(format!(
            "column `{column}` must be text, not {v}"
        ))),
    }
}

fn missing(column: &str) -> ProjectionError {
    ProjectionError::Invalid(format!("column `{column}` is missing or null"))
}

/// The event time: an RFC 3339 string (PostgreSQL's `timestamptz`, Debezium's ZonedTimestamp)
/// or an integer of microseconds since the epoch (Debezium's MicroTimestamp).
fn event_time(value: Option<&Value>, column: &str) -> Result<i64, ProjectionError> {
    let bad = |v: &dyn std::fmt::Display| {
        ProjectionError::Invalid(format!(
            "column `{column}`: `{v}` is not a time (an RFC 3339 string or microseconds since \
             the epoch)"
        ))
    };
    match value {
        Some(Value::String(s)) => chrono::DateTime::parse_from_rfc3339(s)
            .or_else(|_| chrono::DateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f%#z"))
            .map(|t| t.timestamp_micros())
            .map_err(|_| bad(s)),
        Some(Value::Number(n)) => n.as_i64().ok_or_else(|| bad(n)),
        Some(Value::Null) | None => Err(missing(column)),
        Some(v) => Err(bad(v)),
    }
}

/// A measurement value checked against its declared type (null is always allowed).
fn typed(value: Option<&Value>, column: &TierColumn) -> Result<Value, ProjectionError> {
    let v = value.cloned().unwrap_or(Value::Null);
    let ok = match (&v, column.kind) {
        (Value::Null, _) => true,
        (Value::String(_), TierColumnType::Text) => true,
        (Value::Bool(_), TierColumnType::Boolean) => true,
        (Value::Number(n), TierColumnType::Int) => {
            n.as_i64().is_some_and(|i| i32::try_from(i).is_ok())
        }
        (Value::Number(n), TierColumnType::Bigint) => n.as_i64().is_some(),
        (Value::Number(_), TierColumnType::Real | TierColumnType::Double) => true,
        _ => false,
    };
    if ok {
        Ok(match (v, column.kind) {
            // What a `real` holds: the shortest decimal of the nearest f32, in every tier.
            (Value::Number(n), TierColumnType::Real) => n
                .as_f64()
                .and_then(|f| (f as f32).to_string().parse::<f64>().ok())
                .and_then(serde_json::Number::from_f64)
                .map_or(Value::Null, Value::Number),
            (v, _) => v,
        })
    } else {
        Err(ProjectionError::Invalid(format!(
            "column `{}`: `{v}` is not a {}",
            column.name,
            column.kind.sql()
        )))
    }
}

/// Microseconds since the epoch as RFC 3339, for messages.
pub fn format_micros(micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
        .unwrap_or_else(|| micros.to_string())
}

#[cfg(test)]
mod tests;
