//! The tiers projection: routing by age, deletes, bad input.

use serde_json::json;

use super::*;
use crate::test_support::event;

const HOUR: i64 = 3_600_000_000;
/// The clock of every case: 2026-02-05T00:00:00Z.
const NOW_MS: i64 = 1_770_249_600_000;
const NOW: i64 = NOW_MS * 1_000;

fn projection() -> TiersProjection {
    TiersProjection::new(&TiersProjectionConfig {
        table: "public.device_heartbeats".into(),
        device: "device_id".into(),
        time: "ts".into(),
        region: "region".into(),
        columns: vec![
            TierColumn {
                name: "battery".into(),
                kind: TierColumnType::Real,
            },
            TierColumn {
                name: "signal".into(),
                kind: TierColumnType::Int,
            },
        ],
        hot: "2h".into(),
        warm: "30d".into(),
        sinks: vec!["tiers".into()],
    })
}

fn at(micros: i64) -> String {
    format_micros(micros)
}

fn row(device: &str, ts: i64) -> serde_json::Value {
    json!({"device_id": device, "ts": at(ts), "region": "EU", "battery": 0.5, "signal": -70})
}

fn envelope(
    op: &str,
    before: Option<serde_json::Value>,
    after: Option<serde_json::Value>,
) -> serde_json::Value {
    json!({"before": before, "after": after, "op": op,
           "source": {"schema": "public", "table": "device_heartbeats", "lsn": 7}})
}

type Effect = (Tier, TierAction, String, i64);

/// `(tier, action, device, ts)` of each operation.
fn project(line: serde_json::Value) -> Result<Vec<Effect>, ProjectionError> {
    let mut out = Vec::new();
    let result = projection().project(&event(line), NOW_MS, &mut out);
    result.map(|()| {
        out.into_iter()
            .map(|op| match op {
                WriteOp::Tier(w) => {
                    assert_eq!(w.clock_micros, NOW);
                    (
                        w.tier,
                        w.action,
                        w.heartbeat.device_id.clone(),
                        w.heartbeat.ts_micros,
                    )
                }
                other => panic!("{other:?}"),
            })
            .collect()
    })
}

#[test]
fn heartbeats_go_to_the_tiers_of_their_age() {
    use Tier::*;
    let day = 24 * HOUR;
    let cases = [
        ("just now", NOW, vec![Hot, Warm]),
        ("from the future", NOW + HOUR, vec![Hot, Warm]),
        ("1h59m old", NOW - 2 * HOUR + 60_000_000, vec![Hot, Warm]),
        ("exactly 2h old", NOW - 2 * HOUR, vec![Warm]),
        ("3h old", NOW - 3 * HOUR, vec![Warm]),
        ("29d23h old", NOW - 30 * day + HOUR, vec![Warm]),
        ("exactly 30d old", NOW - 30 * day, vec![Cold]),
        ("a year old", NOW - 365 * day, vec![Cold]),
    ];
    for (name, ts, tiers) in cases {
        for op in ["c", "r", "u"] {
            let got = project(envelope(op, None, Some(row("d1", ts)))).unwrap();
            let want: Vec<_> = tiers
                .iter()
                .map(|&t| (t, TierAction::Put, "d1".to_owned(), ts))
                .collect();
            assert_eq!(got, want, "{name}, op {op}");
        }
    }
}

#[test]
fn values_are_typed_and_hashed() {
    let mut out = Vec::new();
    projection()
        .project(
            &event(envelope("c", None, Some(row("dev-42", NOW)))),
            NOW_MS,
            &mut out,
        )
        .unwrap();
    let WriteOp::Tier(w) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(w.heartbeat.values, vec![json!(0.5), json!(-70)]);
    assert_eq!(w.heartbeat.region, "EU");
    // Computed independently: `echo -n dev-42 | md5sum` = c6b11096…, `echo -n | md5sum` = d41d8cd9…
    assert_eq!(w.heartbeat.device_hash, "c6b1");
    assert_eq!(device_hash(""), "d41d");
}

#[test]
fn deletes_and_moves_leave_hot_and_warm() {
    use Tier::*;
    let old = NOW - 3 * HOUR;
    let got = project(envelope("d", Some(row("d1", old)), None)).unwrap();
    assert_eq!(
        got,
        vec![
            (Hot, TierAction::Delete, "d1".into(), old),
            (Warm, TierAction::Delete, "d1".into(), old)
        ]
    );
    // An update that moves the heartbeat in time deletes the old one first.
    let got = project(envelope("u", Some(row("d1", old)), Some(row("d1", NOW)))).unwrap();
    assert_eq!(
        got,
        vec![
            (Hot, TierAction::Delete, "d1".into(), old),
            (Warm, TierAction::Delete, "d1".into(), old),
            (Hot, TierAction::Put, "d1".into(), NOW),
            (Warm, TierAction::Put, "d1".into(), NOW)
        ]
    );
    // An update in place is one put per tier.
    let got = project(envelope("u", Some(row("d1", NOW)), Some(row("d1", NOW)))).unwrap();
    assert_eq!(got.len(), 2);
}

#[test]
fn bad_heartbeats_are_refused_with_the_reason() {
    let cold = NOW - 31 * 24 * HOUR;
    let now = at(NOW);
    let cases = [
        (
            "cold delete",
            envelope("d", Some(row("d1", cold)), None),
            "append-only",
        ),
        (
            "truncate",
            json!({"op": "t", "source": {"schema": "public", "table": "device_heartbeats"}}),
            "truncate",
        ),
        (
            "no device",
            envelope("c", None, Some(json!({"ts": now, "region": "EU"}))),
            "`device_id` is missing",
        ),
        (
            "bad time",
            envelope(
                "c",
                None,
                Some(json!({"device_id": "d", "ts": "noon", "region": "EU"})),
            ),
            "not a time",
        ),
        (
            "no region",
            envelope("c", None, Some(json!({"device_id": "d", "ts": now}))),
            "`region` is missing",
        ),
        (
            "text in a real",
            envelope(
                "c",
                None,
                Some(json!({"device_id": "d", "ts": now, "region": "EU", "battery": "full"})),
            ),
            "not a real",
        ),
        (
            "int too big",
            envelope(
                "c",
                None,
                Some(json!({"device_id": "d", "ts": now, "region": "EU", "signal": 1u64 << 40})),
            ),
            "not a integer",
        ),
    ];
    for (name, line, want) in cases {
        let err = project(line).unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
    }
}

#[test]
fn times_parse_in_every_form_the_sources_send() {
    for v in [
        json!("2026-02-05T00:00:00Z"),
        json!("2026-02-05T01:00:00+01:00"),
        json!("2026-02-05 00:00:00+00"),
        json!("2026-02-05 00:00:00.000000+00"),
        json!(NOW),
    ] {
        assert_eq!(event_time(Some(&v), "ts").unwrap(), NOW, "{v}");
    }
}
