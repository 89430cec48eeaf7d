//! Liveness of the two consume-process-produce loops. librdkafka's transactional calls can block
//! without end (seen in the fault suite: `send_offsets_to_transaction` waiting forever on a
//! coordinator that moved during a broker restart), and a loop stuck there holds its partitions
//! while delivering nothing. Each loop beats once per turn (and inside its own long waits: a
//! restore, an abort being retried); a watchdog ends the process when a loop has not beaten for
//! `STREAMING_HUB_STALL_TIMEOUT`, so it is restarted and its partitions move.
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Last beat of the hub loop (ms since the epoch; 0 = not running).
pub static HUB: AtomicI64 = AtomicI64::new(0);
/// Last beat of the ingest loop.
pub static INGEST: AtomicI64 = AtomicI64::new(0);

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn beat(loop_: &AtomicI64) {
    loop_.store(now_ms(), Ordering::Relaxed);
}

/// The loop stopped on purpose: nothing to watch.
pub fn rest(loop_: &AtomicI64) {
    loop_.store(0, Ordering::Relaxed);
}

/// The first loop (by name) that has not beaten for `limit`, if any.
pub fn stalled(limit: Duration) -> Option<&'static str> {
    let now = now_ms();
    [("hub", &HUB), ("ingest", &INGEST)]
        .into_iter()
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
        beat(&HUB);
        rest(&INGEST);
        assert_eq!(stalled(Duration::from_secs(60)), None);
        HUB.store(now_ms() - 61_000, Ordering::Relaxed);
        assert_eq!(stalled(Duration::from_secs(60)), Some("hub"));
        rest(&HUB);
        assert_eq!(stalled(Duration::from_secs(60)), None);
    }
}
