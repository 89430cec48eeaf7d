//! Time, injected. Every stage asks a [`Clock`] for the time, so tests (and the dangerous test
//! clock of the dispatch issue) can move it: a 28-hour retry curve runs in seconds.
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> i64;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        chrono::Utc::now().timestamp_millis()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    pub fn new(start_ms: i64) -> Self {
        ManualClock(Arc::new(AtomicI64::new(start_ms)))
    }

    pub fn advance(&self, by: std::time::Duration) {
        self.try_advance(by)
            .expect("a test clock advanced past year 292 million");
    }

    /// Moves the clock by `by` and answers the new time, or refuses (`None`, leaving it as it
    /// was) when the time would pass year 10,000: the hub's own sums on top of it (due times,
    /// leases) must still fit in milliseconds since the epoch.
    pub fn try_advance(&self, by: std::time::Duration) -> Option<i64> {
        const ROOM_MS: i64 = 10_000 * 365 * 24 * 3600 * 1000;
        let by = i64::try_from(by.as_millis()).ok()?;
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                now.checked_add(by).filter(|t| *t <= ROOM_MS)
            })
            .map(|before| before + by)
            .ok()
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

pub type SharedClock = Arc<dyn Clock>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let c = ManualClock::new(1_000);
        assert_eq!(c.now_ms(), 1_000);
        c.advance(std::time::Duration::from_secs(5 * 3600));
        assert_eq!(c.now_ms(), 1_000 + 5 * 3600 * 1000);
        let shared: SharedClock = Arc::new(c.clone());
        c.advance(std::time::Duration::from_millis(1));
        assert_eq!(shared.now_ms(), 1_000 + 5 * 3600 * 1000 + 1);
    }

    #[test]
    fn a_test_clock_refuses_an_advance_that_would_not_fit() {
        let c = ManualClock::new(1_750_000_000_000);
        assert_eq!(
            c.try_advance(std::time::Duration::from_secs(3600)),
            Some(1_750_003_600_000)
        );
        let huge = std::time::Duration::from_secs(300_000_000 * 365 * 24 * 3600);
        assert_eq!(c.try_advance(huge), None);
        assert_eq!(c.now_ms(), 1_750_003_600_000, "unchanged");
    }
}
