//! The plan's lines for a `tiers` projection (what goes where by age) and a `tiers` sink (the
//! three stores, the partitions, the aging schedule).

use std::fmt::Write as _;

use refract_schemas::config::{LoadedPipeline, TiersProjectionConfig, TiersSinkConfig};

use super::shown;

/// A tiers projection: the table, the columns and the windows.
pub(super) fn render_tiers(out: &mut String, name: &str, t: &TiersProjectionConfig) {
    let columns: Vec<String> = t
        .columns
        .iter()
        .map(|c| format!("{} {}", c.name, c.kind.sql()))
        .collect();
    let _ = writeln!(
        out,
        "projects `{name}` (tiers): {} (device `{}`, time `{}`, region `{}`; {}) -> younger than {} hot and warm, younger than {} warm, older cold -> sinks {}",
        t.table,
        t.device,
        t.time,
        t.region,
        columns.join(", "),
        t.hot,
        t.warm,
        t.sinks.join(", ")
    );
}

/// A tiers sink: where each tier lives and when aging runs.
pub(super) fn render_tiers_sink(
    out: &mut String,
    loaded: &LoadedPipeline,
    name: &str,
    s: &TiersSinkConfig,
) {
    let aging = if s.aging_interval_ms == 0 {
        "never while running (`refract tiers age` does it)".to_owned()
    } else {
        format!("every {} s while running", s.aging_interval_ms / 1000)
    };
    let _ = writeln!(
        out,
        "writes `{name}` (tiers): hot {} ({}:{{region}}:{{device_hash}}:{{device}}, {}:{{region}}:online); \
         warm {} table {} by the hour, {} partition(s) ahead; cold {}/device_id={{device}}/date={{yyyyMMdd}}/*.parquet; aging {aging}",
        shown(loaded, &format!("sinks.{name}.hot.url"), s.hot.url.expose()),
        s.hot.key_prefix,
        s.hot.key_prefix,
        shown(
            loaded,
            &format!("sinks.{name}.warm.url"),
            s.warm.url.expose()
        ),
        s.warm.table,
        s.warm.partitions_ahead,
        shown(
            loaded,
            &format!("sinks.{name}.cold.url"),
            s.cold.url.expose()
        ),
    );
}
