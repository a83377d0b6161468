//! The refract runtime (wiring, batching, checkpoints, backpressure, shutdown) and the commands
//! of the `refract` binary.

pub mod backfill;
pub mod checkpoint;
pub mod drop;
pub mod families;
pub mod migrate;
pub mod plan;
pub mod runtime;
pub mod tiers;
pub mod verify;

use tokio::sync::watch;

/// SIGINT/SIGTERM turn the returned flag true (drain and stop); a second one exits at once.
pub fn signals() -> watch::Receiver<bool> {
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
        let _ = stop_tx.send(true);
        tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
        eprintln!(
            "second signal: exiting without draining (the checkpoint is safe; undelivered changes replay on restart)"
        );
        std::process::exit(130);
    });
    stop_rx
}
