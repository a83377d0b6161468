//! `refract tiers age`: one aging pass. (Being built: see issue 23.)

use refract_schemas::clock::Clock;
use refract_schemas::config::TierLayout;

/// Runs one aging pass and prints what it did.
pub async fn run(_layout: &TierLayout, _clock: &Clock) -> Result<(), String> {
    Err("aging is not built yet".into())
}
