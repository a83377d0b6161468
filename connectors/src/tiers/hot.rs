//! The hot tier in Redis: the last hours of every device, newest first.
//!
//! - `{prefix}:{region}:{device_hash}:{device}`: a sorted set per device, one member per
//!   heartbeat (its time and measurements as a JSON object), scored by event time in
//!   microseconds (exact in a double up to the year 2255). A heartbeat of the same time replaces
//!   the one before (the score is removed first), so duplicates are idempotent.
//! - `{prefix}:{region}:online`: a sorted set per region of its devices, scored by their newest
//!   heartbeat (`ZADD GT`): "devices online in the last N minutes" is one `ZCOUNT`.
//!
//! Every write trims the device's set and the region's set to the window, measured on the
//! pipeline clock of the change, and sets a time to live of one window: a device that falls
//! silent disappears by itself. The aging pass trims every set to the window again (a silent
//! device's set is not touched by writes, and an accelerated clock outruns the time to live).

use redis::Pipeline;
use refract_schemas::config::{TierColumn, TierLayout};
use refract_schemas::write::tiers::Heartbeat;
use serde_json::{Map, Value};

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

/// Appends the commands that store `h` (seen at pipeline clock `clock`) to `pipe`.
pub fn put(pipe: &mut Pipeline, layout: &TierLayout, h: &Heartbeat, clock: i64) {
    let key = device_key(layout, &h.region, &h.device_hash, &h.device_id);
    let region = region_key(layout, &h.region);
    let oldest_kept = clock - layout.hot_micros;
    let member = member(&layout.heartbeats.columns, h);
    pipe.cmd("ZREMRANGEBYSCORE")
        .arg(&key)
        .arg(h.ts_micros)
        .arg(h.ts_micros)
        .ignore()
        .cmd("ZADD")
        .arg(&key)
        .arg(h.ts_micros)
        .arg(member)
        .ignore()
        .cmd("ZREMRANGEBYSCORE")
        .arg(&key)
        .arg("-inf")
        .arg(oldest_kept)
        .ignore()
        .cmd("PEXPIRE")
        .arg(&key)
        .arg(ttl_ms(layout))
        .ignore()
        .cmd("ZADD")
        .arg(&region)
        .arg("GT")
        .arg(h.ts_micros)
        .arg(&h.device_id)
        .ignore()
        .cmd("ZREMRANGEBYSCORE")
        .arg(&region)
        .arg("-inf")
        .arg(oldest_kept)
        .ignore()
        .cmd("PEXPIRE")
        .arg(&region)
        .arg(ttl_ms(layout))
        .ignore();
}

/// Appends the commands that remove the heartbeat of `h`'s device and time.
pub fn delete(pipe: &mut Pipeline, layout: &TierLayout, h: &Heartbeat) {
    let key = device_key(layout, &h.region, &h.device_hash, &h.device_id);
    pipe.cmd("ZREMRANGEBYSCORE")
        .arg(key)
        .arg(h.ts_micros)
        .arg(h.ts_micros)
        .ignore();
}

/// Decodes a JSON object member into its map (for callers that print members as they are).
pub fn member_map(member: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str(member).ok()? {
        Value::Object(map) => Some(map),
        _ => None,
    }
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
