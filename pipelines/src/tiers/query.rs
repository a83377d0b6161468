//! `refract tiers latest | online | range`: the tier queries of
//! [`refract_connectors::tiers::query`], printed as JSON lines on stdout.
//!
//! One object per heartbeat: `device_id`, `ts` (RFC 3339, microseconds, UTC), `region`, the
//! measurement columns in the pipeline's order, and the `tier` it was read from. `online`
//! prints one object: `{"region", "minutes", "online", "at"}` (`at`: the pipeline clock the
//! window ends at). Warnings (the hot tier down, answered without it) go to stderr.

use std::fmt::Write as _;
use std::io::Write as _;

use refract_connectors::tiers::query::{Answer, Found, TierReader, parse_instant, rfc3339_micros};
use refract_schemas::clock::Clock;
use refract_schemas::config::{TierColumn, TierLayout};
use serde_json::Value;

/// The latest `count` heartbeats of `device`, newest first.
pub async fn latest(
    layout: &TierLayout,
    clock: &Clock,
    device: &str,
    count: usize,
) -> Result<(), String> {
    let mut reader = TierReader::new(layout).map_err(|e| e.to_string())?;
    let answer = reader
        .latest(clock_micros(clock), device, count)
        .await
        .map_err(|e| e.to_string())?;
    print_answer(layout, &answer)
}

/// The devices of `region` online in the last `minutes`.
pub async fn online(
    layout: &TierLayout,
    clock: &Clock,
    region: &str,
    minutes: u64,
) -> Result<(), String> {
    let mut reader = TierReader::new(layout).map_err(|e| e.to_string())?;
    let at = clock_micros(clock);
    let online = reader
        .online(at, region, minutes)
        .await
        .map_err(|e| e.to_string())?;
    write_stdout(&online_line(region, minutes, online, at))
}

/// `device`'s heartbeats in `[from, to)` across the tiers, in time order.
pub async fn range(
    layout: &TierLayout,
    clock: &Clock,
    device: &str,
    from: &str,
    to: &str,
) -> Result<(), String> {
    let (from, to) = (instant("--from", from)?, instant("--to", to)?);
    let mut reader = TierReader::new(layout).map_err(|e| e.to_string())?;
    let answer = reader
        .range(clock_micros(clock), device, from, to)
        .await
        .map_err(|e| e.to_string())?;
    print_answer(layout, &answer)
}

fn clock_micros(clock: &Clock) -> i64 {
    clock.now_ms().saturating_mul(1_000)
}

/// An RFC 3339 argument in microseconds since the epoch.
fn instant(flag: &str, text: &str) -> Result<i64, String> {
    parse_instant(text).map_err(|e| format!("{flag} {e}"))
}

/// The warnings on stderr, then one line per heartbeat on stdout.
fn print_answer(layout: &TierLayout, answer: &Answer) -> Result<(), String> {
    for warning in &answer.warnings {
        eprintln!("warning: {warning}");
    }
    let columns = &layout.heartbeats.columns;
    let mut out = String::new();
    for found in &answer.rows {
        out.push_str(&line(columns, found));
        out.push('\n');
    }
    write_stdout(&out)
}

/// The answer of `online` as a JSON line, its fields in a fixed order.
fn online_line(region: &str, minutes: u64, online: u64, at: i64) -> String {
    format!(
        "{{\"region\":{},\"minutes\":{minutes},\"online\":{online},\"at\":\"{}\"}}\n",
        Value::from(region),
        rfc3339_micros(at)
    )
}

/// A heartbeat as a JSON object, its fields in a fixed order.
pub fn line(columns: &[TierColumn], found: &Found) -> String {
    let h = &found.heartbeat;
    let mut out = String::with_capacity(160);
    let _ = write!(
        out,
        "{{\"device_id\":{},\"ts\":\"{}\",\"region\":{}",
        Value::from(h.device_id.as_str()),
        rfc3339_micros(h.ts_micros),
        Value::from(h.region.as_str())
    );
    for (c, v) in columns.iter().zip(&h.values) {
        let _ = write!(out, ",{}:{v}", Value::from(c.name.as_str()));
    }
    let _ = write!(out, ",\"tier\":\"{}\"}}", found.tier.name());
    out
}

/// Writes to stdout; a closed pipe (`| head`) is not an error worth a message.
fn write_stdout(text: &str) -> Result<(), String> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("cannot write to stdout: {e}"))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use refract_schemas::config::TierColumnType;
    use refract_schemas::write::tiers::{Heartbeat, Tier};
    use serde_json::json;

    use super::*;

    #[test]
    fn lines_keep_the_field_order() {
        let columns = vec![
            TierColumn {
                name: "battery".into(),
                kind: TierColumnType::Real,
            },
            TierColumn {
                name: "signal".into(),
                kind: TierColumnType::Int,
            },
        ];
        let found = Found {
            tier: Tier::Warm,
            heartbeat: Heartbeat {
                device_id: "d\"1".into(),
                region: "EU".into(),
                device_hash: "abcd".into(),
                ts_micros: 1_770_249_600_000_001,
                values: vec![json!(0.25), json!(null)],
            },
        };
        assert_eq!(
            line(&columns, &found),
            r#"{"device_id":"d\"1","ts":"2026-02-05T00:00:00.000001Z","region":"EU","battery":0.25,"signal":null,"tier":"warm"}"#
        );
        assert_eq!(
            instant("--from", "2026-02-05T01:00:00+01:00"),
            Ok(1_770_249_600_000_000)
        );
        assert!(instant("--to", "yesterday").is_err());
        assert_eq!(
            online_line("EU", 5, 42, 1_770_249_600_000_000),
            "{\"region\":\"EU\",\"minutes\":5,\"online\":42,\"at\":\"2026-02-05T00:00:00.000000Z\"}\n"
        );
    }
}
