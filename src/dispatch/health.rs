//! Destination health and auto-disable (DESIGN.md §2.3).
//!
//! Each webhook subscription with an open failure span has a health record in its tenant's hub
//! task store (`h/<subscription id>` in the `jobs` family, so it is changelogged and survives
//! restarts and rebalances): when the span opened (first failure), the last failure, how many in a
//! row. One success clears it. A subscription is disabled when both gates hold:
//! span open ≥ `STREAMING_HUB_AUTODISABLE_FAILURE_WINDOW` (120h) AND first-to-last failure ≥
//! `STREAMING_HUB_AUTODISABLE_FAILURE_SPREAD` (12h), unless `STREAMING_HUB_AUTODISABLE_ENABLED` is
//! false. Disabling writes the subscription with `enabled = false`, `disabled_reason` and
//! `disabled_at` (never `verification_state`) to the control topic inside the hub transaction;
//! its remaining jobs are then dead-lettered as `subscription_disabled` when they come due, and
//! `POST /v1/subscriptions/{id}/verify` re-enables it in place.
//!
//! A span belongs to the subscription as it was when the span opened: one that opened before
//! the subscription last changed (`updated_at`: a patched URL, a re-enable, a verdict, a
//! rotation) restarts at the next failure, so a destination fixed by its owner is not disabled
//! for the broken one's hours. So does a span that saw no failure for a whole failure window
//! (nothing was tried: no traffic): it is no evidence that the destination is broken now, and
//! one failed attempt after a quiet week no longer disables the subscription at once.
use crate::dispatch::jobs::{JobError, JobStore};
use crate::runtime::records::{BreakerState, HealthRecord};

/// The two gates and the kill switch.
#[derive(Debug, Clone, Copy)]
pub struct Gates {
    pub enabled: bool,
    pub window_ms: i64,
    pub spread_ms: i64,
}

/// Both gates hold for a span that opened at `first`, last failed at `last`, seen at `now`.
pub fn should_disable(g: &Gates, first: i64, last: i64, now: i64) -> bool {
    g.enabled
        && now.saturating_sub(first) >= g.window_ms
        && last.saturating_sub(first) >= g.spread_ms
}

pub fn health_key(subscription_id: &str) -> Vec<u8> {
    [b"h/", subscription_id.as_bytes()].concat()
}

/// Deletes a subscription's failure span, if it has one (a deleted subscription's: neither a
/// success nor an auto-disable will come to delete it).
pub fn forget(js: &mut JobStore<'_>, subscription_id: &str) -> Result<(), JobError> {
    let key = health_key(subscription_id);
    if js.get_raw(&key)?.is_some() {
        js.delete_record(key);
    }
    Ok(())
}

/// What to do after recording an outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    Disable { reason: String },
}

/// When the span a failure at `now` belongs to opened: the stored span's start, unless the
/// subscription changed since (`changed_at`) or the span's last failure is more than
/// `window_ms` old (a quiet span), when a new one opens now.
pub fn span_start(
    stored: Option<(i64, Option<i64>)>,
    changed_at: i64,
    now: i64,
    window_ms: i64,
) -> i64 {
    match stored {
        Some((first, last))
            if first >= changed_at && now.saturating_sub(last.unwrap_or(first)) <= window_ms =>
        {
            first
        }
        _ => now,
    }
}

/// Updates the subscription's failure span with one attempt's result; `changed_at` is the
/// subscription's `updated_at`.
pub fn record(
    js: &mut JobStore<'_>,
    subscription_id: &str,
    success: bool,
    now: i64,
    changed_at: i64,
    gates: &Gates,
) -> Result<Verdict, JobError> {
    let key = health_key(subscription_id);
    let existing: Option<HealthRecord> =
        js.get_record(&key, crate::runtime::avro::RecordKind::Health)?;
    if success {
        if existing.is_some() {
            js.delete_record(key);
        }
        return Ok(Verdict::Keep);
    }
    let first = span_start(
        existing
            .as_ref()
            .and_then(|h| Some((h.first_failure_at?, h.last_failure_at))),
        changed_at,
        now,
        gates.window_ms,
    );
    let mut h = existing
        .filter(|h| h.first_failure_at == Some(first))
        .unwrap_or(HealthRecord {
            subscription_id: subscription_id.to_string(),
            first_failure_at: Some(now),
            last_failure_at: None,
            consecutive_failures: 0,
            breaker_state: BreakerState::Closed,
            breaker_opened_at: None,
        });
    h.first_failure_at = Some(first);
    h.last_failure_at = Some(now);
    // The schema's `int`: a destination failing for months with auto-disable off would pass
    // it, and a record that cannot be encoded aborted every transaction of its partition.
    h.consecutive_failures = h
        .consecutive_failures
        .saturating_add(1)
        .min(i32::MAX as u32);
    if should_disable(gates, first, now, now) {
        js.delete_record(key);
        let hours = |ms: i64| ms / 3_600_000;
        return Ok(Verdict::Disable {
            reason: format!(
                "auto-disabled: failing for {}h ({} failed attempts in a row, none succeeded)",
                hours(now - first),
                h.consecutive_failures
            ),
        });
    }
    js.put_record(key, crate::runtime::avro::RecordKind::Health, &h)?;
    Ok(Verdict::Keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: i64 = 3_600_000;
    const GATES: Gates = Gates {
        enabled: true,
        window_ms: 120 * H,
        spread_ms: 12 * H,
    };

    #[test]
    fn both_gates_must_hold() {
        assert!(should_disable(&GATES, 0, 120 * H, 120 * H));
        assert!(
            !should_disable(&GATES, 0, 119 * H, 119 * H),
            "window not reached"
        );
        // A span opened 130h ago whose failures all fell within 11h (then nothing was tried):
        assert!(
            !should_disable(&GATES, 0, 11 * H, 130 * H),
            "spread not reached"
        );
        assert!(should_disable(&GATES, 0, 12 * H, 130 * H));
    }

    #[test]
    fn a_span_restarts_when_the_subscription_changed_after_it_opened() {
        let w = GATES.window_ms;
        // Failing since hour 0, unchanged since before: the span goes on.
        assert_eq!(span_start(Some((0, Some(99 * H))), -5 * H, 100 * H, w), 0);
        // Changed at hour 0, the span opened then: the same.
        assert_eq!(span_start(Some((0, Some(99 * H))), 0, 100 * H, w), 0);
        // The owner fixed the URL at hour 100; a failure at 121h opens a new span there, so
        // both gates start again (not disabled for the old URL's 100 hours).
        let first = span_start(Some((0, Some(99 * H))), 100 * H, 121 * H, w);
        assert_eq!(first, 121 * H);
        assert!(!should_disable(&GATES, first, 121 * H, 121 * H));
        // No span yet: it opens now.
        assert_eq!(span_start(None, 0, 7 * H, w), 7 * H);
    }

    /// A subscription with little traffic: one event failed all its attempts over 14 hours, then
    /// nothing was sent for six days, then one attempt failed (a blip). It was disabled on that
    /// one failure, the quiet week counted as failing. The quiet span gives way to a new one.
    #[test]
    fn a_span_quiet_for_a_whole_window_restarts_at_the_next_failure() {
        let w = GATES.window_ms;
        assert_eq!(span_start(Some((0, Some(14 * H))), -H, 158 * H, w), 158 * H);
        // Quiet for exactly the window: still the same span.
        assert_eq!(span_start(Some((0, Some(14 * H))), -H, 134 * H, w), 0);
        // Through the store, as the hub records outcomes.
        let (_dir, store, codec) = job_store();
        let mut staged = crate::runtime::store::Staged::default();
        let mut js = JobStore {
            store: &store,
            staged: &mut staged,
            codec: &codec,
        };
        let fail = |js: &mut JobStore<'_>, at: i64| record(js, "s", false, at, -H, &GATES).unwrap();
        for at in [0, 5 * H, 14 * H] {
            assert_eq!(fail(&mut js, at), Verdict::Keep);
        }
        assert_eq!(
            fail(&mut js, 158 * H),
            Verdict::Keep,
            "the blip after a quiet week"
        );
        // Failing on from there, it is disabled once the new span is a window old.
        assert_eq!(fail(&mut js, 270 * H), Verdict::Keep);
        assert!(matches!(fail(&mut js, 278 * H), Verdict::Disable { .. }));
    }

    /// A job store in a temporary directory (kept while the first value lives).
    fn job_store() -> (
        tempfile::TempDir,
        crate::runtime::store::Store,
        crate::runtime::avro::Codec,
    ) {
        use crate::dispatch::jobs::{DUE, JOBS};
        let dir = tempfile::tempdir().unwrap();
        let store = crate::runtime::store::Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        (dir, store, crate::runtime::avro::Codec::new().unwrap())
    }

    #[test]
    fn the_failure_count_stops_at_what_its_schema_holds() {
        use crate::runtime::avro::RecordKind;
        let (_dir, store, codec) = job_store();
        let mut staged = crate::runtime::store::Staged::default();
        let mut js = JobStore {
            store: &store,
            staged: &mut staged,
            codec: &codec,
        };
        let off = Gates {
            enabled: false,
            ..GATES
        };
        let near = HealthRecord {
            subscription_id: "s".into(),
            first_failure_at: Some(0),
            last_failure_at: Some(H),
            consecutive_failures: i32::MAX as u32 - 1,
            breaker_state: BreakerState::Closed,
            breaker_opened_at: None,
        };
        js.put_record(health_key("s"), RecordKind::Health, &near)
            .unwrap();
        for at in [2 * H, 3 * H] {
            assert_eq!(
                record(&mut js, "s", false, at, -H, &off).unwrap(),
                Verdict::Keep
            );
        }
        let h: HealthRecord = js
            .get_record(&health_key("s"), RecordKind::Health)
            .unwrap()
            .unwrap();
        assert_eq!(h.consecutive_failures, i32::MAX as u32);
    }

    #[test]
    fn kill_switch_prevents_disabling() {
        let off = Gates {
            enabled: false,
            ..GATES
        };
        assert!(!should_disable(&off, 0, 500 * H, 500 * H));
    }
}
