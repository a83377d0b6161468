//! The hot tier in Redis: the last hours of every device, newest first.
//!
//! - `{prefix}:{region}:{device_hash}:{device}`: a sorted set per device, one member per
//!   heartbeat (its time and measurements as a JSON object), scored by event time in
//!   microseconds (exact in a double up to the year 2255). A heartbeat of the same time replaces
//!   the one before (the score is removed first), so duplicates are idempotent.
//! - `{prefix}:{region}:online`: a sorted set per region of its devices, scored by their newest
//!   heartbeat (`ZADD GT`): "devices online in the last N minutes" is one `ZCOUNT`.
//!
//! Every batch trims the device sets and the region sets it wrote to the window, measured on the
//! pipeline clock of its changes, and sets a time to live of one window: a device that falls
//! silent disappears by itself. The aging pass trims every set to the window again (a silent
//! device's set is not touched by writes, and an accelerated clock outruns the time to live).

use std::collections::{BTreeMap, BTreeSet};

use redis::Cmd;
use refract_schemas::config::{TierColumn, TierLayout};
use refract_schemas::write::tiers::{Heartbeat, TierAction, TierWrite};
use serde_json::Value;

/// The member field holding the event time (microseconds since the epoch).
pub const TS_FIELD: &str = "ts";

/// The sorted set of one device's heartbeats.
pub fn device_key(layout: &TierLayout, region: &str, device_hash: &str, device: &str) -> String {
    format!(
        "{}:{region}:{device_hash}:{device}",
        layout.stores.hot.key_prefix
    )
}

/// The sorted set of a region's devices, scored by their newest heartbeat.
pub fn region_key(layout: &TierLayout, region: &str) -> String {
    format!("{}:{region}:online", layout.stores.hot.key_prefix)
}

/// The pattern matching every region's set (for `SCAN`).
pub fn region_pattern(layout: &TierLayout) -> String {
    format!("{}:*:online", layout.stores.hot.key_prefix)
}

/// The region a region set's key names.
pub fn region_of_key<'a>(layout: &TierLayout, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(layout.stores.hot.key_prefix.as_str())?
        .strip_prefix(':')?
        .strip_suffix(":online")
}

/// A heartbeat as a sorted-set member: `{"ts": micros, column: value, …}` in column order.
pub fn member(columns: &[TierColumn], h: &Heartbeat) -> String {
    let mut out = String::with_capacity(64);
    out.push_str("{\"ts\":");
    out.push_str(itoa::Buffer::new().format(h.ts_micros));
    for (c, v) in columns.iter().zip(&h.values) {
        out.push(',');
        out.push_str(&Value::String(c.name.clone()).to_string());
        out.push(':');
        out.push_str(&v.to_string());
    }
    out.push('}');
    out
}

/// The heartbeat a member of `device`'s set holds (`None` when it is not one of ours).
pub fn parse_member(
    columns: &[TierColumn],
    device: &str,
    region: &str,
    device_hash: &str,
    member: &str,
) -> Option<Heartbeat> {
    let Value::Object(mut map): Value = serde_json::from_str(member).ok()? else {
        return None;
    };
    let ts_micros = map.get(TS_FIELD)?.as_i64()?;
    let values = columns
        .iter()
        .map(|c| map.remove(&c.name).unwrap_or(Value::Null))
        .collect();
    Some(Heartbeat {
        device_id: device.to_owned(),
        region: region.to_owned(),
        device_hash: device_hash.to_owned(),
        ts_micros,
        values,
    })
}

/// The window in milliseconds, for time-to-live settings (at least 1).
fn ttl_ms(layout: &TierLayout) -> i64 {
    (layout.hot_micros / 1_000).max(1)
}

/// The commands that apply a batch's hot writes, in an order that keeps the batch's order per
/// key: per heartbeat a `ZREMRANGEBYSCORE` of its time (a repeat replaces it) and, for a put,
/// its `ZADD`; then once per device set touched, a trim to the window and a time to live; then
/// once per region, one `ZADD GT` of its devices' newest times, a trim and a time to live. The
/// window is measured on the newest clock of the batch (the clock only moves forward).
pub fn batch_commands(layout: &TierLayout, ops: &[&TierWrite]) -> Vec<Cmd> {
    let Some(clock) = ops.iter().map(|op| op.clock_micros).max() else {
        return Vec::new();
    };
    let oldest_kept = clock - layout.hot_micros;
    let mut commands = Vec::with_capacity(ops.len() * 2 + 16);
    let mut devices: BTreeSet<String> = BTreeSet::new();
    let mut regions: BTreeMap<&str, BTreeMap<&str, i64>> = BTreeMap::new();
    for op in ops {
        let h = &op.heartbeat;
        let key = device_key(layout, &h.region, &h.device_hash, &h.device_id);
        let mut remove = redis::cmd("ZREMRANGEBYSCORE");
        remove.arg(&key).arg(h.ts_micros).arg(h.ts_micros);
        commands.push(remove);
        if op.action == TierAction::Put {
            let mut add = redis::cmd("ZADD");
            add.arg(&key)
                .arg(h.ts_micros)
                .arg(member(&layout.heartbeats.columns, h));
            commands.push(add);
            let newest = regions
                .entry(&h.region)
                .or_default()
                .entry(&h.device_id)
                .or_default();
            *newest = (*newest).max(h.ts_micros);
            devices.insert(key);
        }
    }
    for key in &devices {
        commands.extend(trim_and_expire(layout, key, oldest_kept));
    }
    for (region, newest) in regions {
        let key = region_key(layout, region);
        let mut add = redis::cmd("ZADD");
        add.arg(&key).arg("GT");
        for (device, ts) in newest {
            add.arg(ts).arg(device);
        }
        commands.push(add);
        commands.extend(trim_and_expire(layout, &key, oldest_kept));
    }
    commands
}

/// Trims the sorted set `key` to scores above `oldest_kept` and makes it live one window.
fn trim_and_expire(layout: &TierLayout, key: &str, oldest_kept: i64) -> [Cmd; 2] {
    let mut trim = redis::cmd("ZREMRANGEBYSCORE");
    trim.arg(key).arg("-inf").arg(oldest_kept);
    let mut expire = redis::cmd("PEXPIRE");
    expire.arg(key).arg(ttl_ms(layout));
    [trim, expire]
}

#[cfg(test)]
mod tests {
    use refract_schemas::config::TierColumnType;
    use serde_json::json;

    use super::*;

    #[test]
    fn members_round_trip() {
        let columns = vec![
            TierColumn {
                name: "battery".into(),
                kind: TierColumnType::Real,
            },
            TierColumn {
                name: "note \"x\"".into(),
                kind: TierColumnType::Text,
            },
        ];
        let h = Heartbeat {
            device_id: "d1".into(),
            region: "EU".into(),
            device_hash: "abcd".into(),
            ts_micros: 1_770_249_600_123_456,
            values: vec![json!(0.25), json!("a\"b")],
        };
        let m = member(&columns, &h);
        assert_eq!(
            m,
            r#"{"ts":1770249600123456,"battery":0.25,"note \"x\"":"a\"b"}"#
        );
        assert_eq!(
            parse_member(&columns, "d1", "EU", "abcd", &m),
            Some(h.clone())
        );
        assert_eq!(parse_member(&columns, "d1", "EU", "abcd", "[1]"), None);
        // A double reads back to the same bits (serde_json's default parser missed the last
        // bit of this one).
        let lat = -56.715161241197364_f64;
        let h = Heartbeat {
            values: vec![json!(lat), Value::Null],
            ..h
        };
        let back = parse_member(&columns, "d1", "EU", "abcd", &member(&columns, &h)).unwrap();
        assert_eq!(
            back.values[0].as_f64().map(f64::to_bits),
            Some(lat.to_bits())
        );
    }
}
