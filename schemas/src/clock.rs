//! The pipeline's clock: what time-based projections (the tiers' windows) and the aging job
//! measure age against.
//!
//! `[pipeline] clock` is `wall` (the default: the system clock), a fixed instant
//! (`2026-02-05T00:00:00Z`: time stands still, for tests and reproducible replays), or an
//! accelerated clock (`2026-01-01T00:00:00Z x3600`: starts at that instant when the process
//! starts and runs 3,600 times faster than the wall clock, for demos that replay days in
//! minutes).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// How the pipeline's clock runs (`[pipeline] clock`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ClockSpec {
    /// The system clock.
    Wall,
    /// Always this instant (milliseconds since the epoch).
    Fixed(i64),
    /// From `start_ms` at process start, `speed` times faster than the wall clock.
    Accelerated {
        /// The clock's reading when the process starts, in milliseconds since the epoch.
        start_ms: i64,
        /// How many clock milliseconds pass per wall millisecond (above 0).
        speed: f64,
    },
}

impl ClockSpec {
    /// Parses `wall`, `INSTANT` or `INSTANT xSPEED` (RFC 3339 instants).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() || text == "wall" {
            return Ok(ClockSpec::Wall);
        }
        let (instant, speed) = match text.split_once(char::is_whitespace) {
            Some((i, s)) => (i, Some(s.trim())),
            None => (text, None),
        };
        let start_ms = chrono::DateTime::parse_from_rfc3339(instant)
            .map_err(|e| format!("`{instant}` is not an RFC 3339 instant ({e})"))?
            .timestamp_millis();
        let Some(speed) = speed else {
            return Ok(ClockSpec::Fixed(start_ms));
        };
        let factor = speed
            .strip_prefix('x')
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| format!("`{speed}` is not a speed like `x3600`"))?;
        Ok(ClockSpec::Accelerated {
            start_ms,
            speed: factor,
        })
    }

    /// A running clock of this kind, started now.
    pub fn start(self) -> Clock {
        Clock {
            spec: self,
            started: Instant::now(),
        }
    }
}

/// A running pipeline clock.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    spec: ClockSpec,
    started: Instant,
}

impl Clock {
    /// The clock's reading, in milliseconds since the epoch.
    pub fn now_ms(&self) -> i64 {
        match self.spec {
            ClockSpec::Wall => wall_ms(),
            ClockSpec::Fixed(ms) => ms,
            ClockSpec::Accelerated { start_ms, speed } => {
                start_ms + (self.started.elapsed().as_secs_f64() * 1_000.0 * speed) as i64
            }
        }
    }
}

/// The system clock, in milliseconds since the epoch.
pub fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(ClockSpec::parse("wall"), Ok(ClockSpec::Wall));
        assert_eq!(ClockSpec::parse(""), Ok(ClockSpec::Wall));
        assert_eq!(
            ClockSpec::parse("1970-01-01T00:00:01Z"),
            Ok(ClockSpec::Fixed(1_000))
        );
        assert_eq!(
            ClockSpec::parse("1970-01-01T00:00:01Z x3600"),
            Ok(ClockSpec::Accelerated {
                start_ms: 1_000,
                speed: 3600.0
            })
        );
        for bad in [
            "yesterday",
            "1970-01-01T00:00:01Z fast",
            "1970-01-01T00:00:01Z x0",
        ] {
            assert!(ClockSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn clocks_run_as_specified() {
        let fixed = ClockSpec::Fixed(42).start();
        assert_eq!(fixed.now_ms(), 42);
        let fast = ClockSpec::Accelerated {
            start_ms: 0,
            speed: 1e6,
        }
        .start();
        let a = fast.now_ms();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(fast.now_ms() >= a + 1_000_000, "a million times faster");
        let wall = ClockSpec::Wall.start().now_ms();
        assert!((wall - wall_ms()).abs() < 1_000);
    }
}
