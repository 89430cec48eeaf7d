//! Liveness of the two consume-process-produce loops. librdkafka's transactional calls can block
//! without end (seen in the fault suite: `send_offsets_to_transaction` waiting forever on a
//! coordinator that moved during a broker restart), and a loop stuck there holds its partitions
//! while delivering nothing. Each loop beats once per turn (and inside its own long waits: a
//! restore, an abort being retried); a watchdog ends the process when a loop has not beaten for
//! `STREAMING_HUB_STALL_TIMEOUT`, so it is restarted and its partitions move.
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crate::config::MAX_HUB_STAGES;

/// Last beat of each hub loop (ms on this process's monotonic clock; 0 = not running), by stage
/// number.
pub static HUB: [AtomicI64; MAX_HUB_STAGES] = [const { AtomicI64::new(0) }; MAX_HUB_STAGES];
/// Last beat of the ingest loop.
pub static INGEST: AtomicI64 = AtomicI64::new(0);

thread_local! {
    /// The loop this thread runs, for code it calls that cannot name it (a restore inside a
    /// rebalance callback).
    static CURRENT: Cell<Option<&'static AtomicI64>> = const { Cell::new(None) };
}

/// Marks `loop_` as the one this thread runs (see [`beat_current`]).
pub fn run_on_this_thread(loop_: &'static AtomicI64) {
    CURRENT.with(|c| c.set(Some(loop_)));
}

/// Beats the loop this thread runs, if any.
pub fn beat_current() {
    if let Some(l) = CURRENT.with(Cell::get) {
        beat(l);
    }
}

/// Milliseconds on a monotonic clock, never 0 (that is "resting"), a day past this process's
/// first call. Not the wall clock: an NTP step or a VM resumed after a pause moves it by minutes,
/// which would stop every instance at once (forward) or blind the watchdog (backward).
fn now_ms() -> i64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    const OFFSET_MS: i64 = 86_400_000;
    let start = *START.get_or_init(Instant::now);
    OFFSET_MS.saturating_add(i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX / 2))
}

pub fn beat(loop_: &AtomicI64) {
    loop_.store(now_ms(), Ordering::Relaxed);
}

/// The loop stopped on purpose: nothing to watch.
pub fn rest(loop_: &AtomicI64) {
    loop_.store(0, Ordering::Relaxed);
}

/// Every loop stopped (the process's stages have all been joined).
pub fn rest_all() {
    HUB.iter().chain([&INGEST]).for_each(rest);
}

/// The first loop (by name) that has not beaten for `limit`, if any.
pub fn stalled(limit: Duration) -> Option<&'static str> {
    let now = now_ms();
    HUB.iter()
        .map(|b| ("hub", b))
        .chain([("ingest", &INGEST)])
        .find(|(_, b)| {
            let at = b.load(Ordering::Relaxed);
            at > 0 && now - at > limit.as_millis() as i64
        })
        .map(|(name, _)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_stops_beating_is_reported_and_a_resting_one_is_not() {
        beat(&HUB[0]);
        beat(&HUB[1]);
        rest(&INGEST);
        assert_eq!(stalled(Duration::from_secs(60)), None);
        // One stuck stage is found although another keeps beating.
        HUB[1].store(now_ms() - 61_000, Ordering::Relaxed);
        assert_eq!(stalled(Duration::from_secs(60)), Some("hub"));
        rest(&HUB[1]);
        rest(&HUB[0]);
        assert_eq!(stalled(Duration::from_secs(60)), None);
    }

    #[test]
    fn the_current_loop_is_the_one_this_thread_named() {
        let other = std::thread::spawn(|| {
            run_on_this_thread(&HUB[3]);
            HUB[3].store(1, Ordering::Relaxed);
            beat_current();
            HUB[3].load(Ordering::Relaxed)
        });
        assert!(other.join().unwrap() > 1);
        // This thread named none: beating it touches nothing.
        HUB[4].store(0, Ordering::Relaxed);
        beat_current();
        assert_eq!(HUB[4].load(Ordering::Relaxed), 0);
    }
}
