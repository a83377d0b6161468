//! Progress of a run whose source knows its size: a bar of rows on a terminal, and the rate and
//! time left in the log.

use std::time::Instant;

/// A progress bar of rows on stderr (drawn only on a terminal): rows, rows/s, ETA.
pub fn rows_bar(total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {human_pos}/{human_len} rows  {per_sec}  ETA {eta}  {msg}",
        )
        .expect("a valid progress template"),
    );
    bar
}

/// Progress of a source that knows its size: a bar on a terminal, rate and ETA in the log.
pub(super) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    first: u64,
}

impl Progress {
    /// Starts at `done` of `total`; draws a bar when `draw`.
    pub(super) fn new(draw: bool, done: u64, total: u64) -> Self {
        let bar = draw.then(|| {
            let bar = rows_bar(total);
            bar.set_position(done);
            bar
        });
        Self {
            bar,
            started: Instant::now(),
            first: done,
        }
    }

    /// Moves the bar to `done` of `total`.
    pub(super) fn update(&self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
        }
    }

    /// Rows per second and seconds left, for the log.
    pub(super) fn rate(&self, done: u64, total: u64) -> (f64, Option<f64>) {
        let secs = self.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            done.saturating_sub(self.first) as f64 / secs
        } else {
            0.0
        };
        let eta = (rate > 0.0).then(|| total.saturating_sub(done) as f64 / rate);
        (rate, eta)
    }

    /// Clears the bar.
    pub(super) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
