//! How far claims may run ahead of the workers.
//!
//! A claimed attempt waits for one of the `STREAMING_HUB_DISPATCH_WORKERS` permits, and starts
//! only while its lease still has `STREAMING_HUB_HTTP_TIMEOUT` left; one that waited longer is
//! handed back unsent (`streaming_hub_attempts_unsent_total`), its claim and transaction spent
//! for nothing. With fixed bounds alone, a backlog to slow sinks was claimed far ahead of what
//! the workers could start in time: a tenant alone may hold every claim ahead (4,096 by default),
//! and at one second per delivery the 64 workers take 64 s to start them all, against 10 s of
//! lease to spare.
//!
//! So the bounds follow the attempts' measured time (Little's law): the claims that hold a
//! worker, plus what the workers start within half the lease's spare time (the horizon):
//! - the loop's claims ahead: at most `workers + its share of the workers × horizon ÷ mean
//!   attempt time` (several loops share the workers);
//! - a tenant's: the workers it holds now, plus what it starts within the horizon: at most one
//!   attempt in `waiting` grants (the tenants waiting for a worker take turns; `fair` may give
//!   a tenant over its share fewer), grants coming at `workers ÷ mean attempt time`; never
//!   faster than `workers ÷ its own attempt time`, nor than the workers it holds free up (the
//!   pool may give it no more: its share, the reserve).
//!
//! A tenant with no attempt timed yet is held to `STREAMING_HUB_DISPATCH_WORKERS × 4` claims
//! until its first one ends (four attempt times of the whole pool): claiming more for a sink
//! nobody has timed could already outrun the lease.
use crate::runtime::store::FastMap;

/// Weight of each new attempt time in a tenant's average (a few attempts move it).
const TENANT_WEIGHT: f64 = 0.2;
/// Weight of each new attempt time in the loop's average (it sees every tenant's).
const LOOP_WEIGHT: f64 = 0.02;
/// Tenants whose attempt time is kept; past it, those with nothing in flight are forgotten.
const MAX_TIMED_TENANTS: usize = 100_000;
/// A tenant whose attempts take this many times the loop's average holds its workers long
/// (`holds_long`).
const LONG_HOLD: f64 = 4.0;

/// Attempt times, averaged per tenant and over the loop, and the bounds they give.
pub struct Pace {
    /// All the loops' workers (`STREAMING_HUB_DISPATCH_WORKERS`).
    workers: f64,
    /// This loop's share of them (the loops of an instance share one pool).
    loop_workers: f64,
    /// Half of what a claim may wait for its permit: lease − HTTP timeout.
    horizon_ms: f64,
    loop_ms: Option<f64>,
    tenant_ms: FastMap<String, f64>,
}

impl Pace {
    /// `lease_ms`, `http_timeout_ms`: an attempt's lease and how much of it must be left to
    /// start; `loops`: the hub loops sharing the `workers`.
    pub fn new(workers: usize, loops: usize, lease_ms: i64, http_timeout_ms: i64) -> Pace {
        let workers = workers.max(1) as f64;
        Pace {
            workers,
            loop_workers: workers / loops.max(1) as f64,
            horizon_ms: ((lease_ms - http_timeout_ms).max(2) / 2) as f64,
            loop_ms: None,
            tenant_ms: FastMap::default(),
        }
    }

    /// An attempt of `tenant` that sent its request took `ms` (from its permit to its outcome).
    pub fn timed(&mut self, tenant: &str, ms: u64) {
        let ms = (ms as f64).max(1.0);
        self.loop_ms = Some(match self.loop_ms {
            Some(avg) => avg + LOOP_WEIGHT * (ms - avg),
            None => ms,
        });
        match self.tenant_ms.get_mut(tenant) {
            Some(avg) => *avg += TENANT_WEIGHT * (ms - *avg),
            None => {
                self.tenant_ms.insert(tenant.to_string(), ms);
            }
        }
    }

    /// Forgets the times of tenants with nothing in flight, once too many are kept.
    pub fn trim(&mut self, in_flight: impl Fn(&str) -> bool) {
        if self.tenant_ms.len() > MAX_TIMED_TENANTS {
            self.tenant_ms.retain(|t, _| in_flight(t));
        }
    }

    /// Whether `tenant`'s attempts hold a worker at least [`LONG_HOLD`] times as long as the
    /// loop's average attempt, or are not timed yet: a worker it takes beyond its share is lost
    /// to the others for that long, so the pool keeps room for their recent demand
    /// (`fair::FairPermits`). A tenant as fast as the rest may use whatever is free.
    pub fn holds_long(&self, tenant: &str) -> bool {
        match (self.tenant_ms.get(tenant), self.loop_ms) {
            (Some(&own), Some(mean)) => own >= LONG_HOLD * mean,
            _ => true,
        }
    }

    /// The most claims this loop may have ahead, under `max` (its fixed bound).
    pub fn loop_limit(&self, max: usize) -> usize {
        let Some(ms) = self.loop_ms else {
            return max;
        };
        let started = (self.loop_workers * self.horizon_ms / ms).ceil() as usize;
        (self.workers as usize).saturating_add(started).min(max)
    }

    /// The most claims `tenant` may have ahead, under `max` (its fixed bound), with `waiting`
    /// tenants waiting for a worker now; `untimed` for a tenant with no attempt timed yet;
    /// `held` tells the workers it holds now (asked only when the bound may depend on it).
    pub fn tenant_limit(
        &self,
        tenant: &str,
        waiting: usize,
        max: usize,
        untimed: usize,
        held: impl FnOnce() -> usize,
    ) -> usize {
        let Some(&own) = self.tenant_ms.get(tenant) else {
            return untimed.min(max).max(1);
        };
        let waiting = waiting.max(1) as f64;
        // Attempts per ms this tenant can start: its turns among the tenants waiting, at most.
        let mut rate = self.workers / own;
        if let Some(mean) = self.loop_ms {
            rate = rate.min(self.workers / (waiting * mean));
        }
        if rate * self.horizon_ms >= max as f64 {
            return max.max(1); // fast attempts: the fixed bound binds first
        }
        let running = held();
        let rate = rate.min(running.max(1) as f64 / own);
        let started = (rate * self.horizon_ms).ceil() as usize;
        running.saturating_add(started).clamp(1, max.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults: 64 workers, a 15 s timeout and its 25 s lease: a 5 s horizon.
    fn pace(loops: usize) -> Pace {
        Pace::new(64, loops, 25_000, 15_000)
    }

    #[test]
    fn untimed_the_fixed_bounds_hold_and_a_new_tenant_gets_four_attempts_per_worker() {
        let p = pace(1);
        assert_eq!(p.loop_limit(4096), 4096);
        assert_eq!(p.tenant_limit("t", 1, 4096, 256, || 0), 256);
        assert_eq!(
            p.tenant_limit("t", 1, 40, 256, || 0),
            40,
            "never above the fixed bound"
        );
        assert_eq!(p.tenant_limit("t", 1, 0, 0, || 0), 1, "never below one");
    }

    #[test]
    fn a_slow_sink_is_claimed_only_as_far_as_the_workers_start_within_the_horizon() {
        let mut p = pace(1);
        p.timed("slow", 1000);
        // Alone: the 64 workers it runs, and the 320 they start in 5 s at 1 s each.
        assert_eq!(p.tenant_limit("slow", 1, 4096, 256, || 64), 384);
        assert_eq!(p.loop_limit(4096), 384);
        // Holding 40 (others hold the rest, or it is the reserve): what those 40 start.
        assert_eq!(p.tenant_limit("slow", 1, 4096, 256, || 40), 240);
        // Holding none yet: it grows as the workers come.
        assert_eq!(p.tenant_limit("slow", 1, 4096, 256, || 0), 5);
        // With 99 other tenants waiting as well, its turns come once in 100 grants: one
        // running, and 3.2 started in 5 s.
        let mut p = pace(1);
        p.timed("slow", 1000);
        for i in 0..99 {
            p.timed(&format!("t{i}"), 1000);
        }
        assert_eq!(p.tenant_limit("slow", 100, 4096, 256, || 1), 5);
        // Two loops share the workers: each may have all of them running (the other loop may
        // be idle), and half of what they start.
        let mut p = pace(2);
        p.timed("slow", 1000);
        assert_eq!(p.loop_limit(4096), 64 + 160);
        for _ in 0..500 {
            p.timed("slow", 60_000);
        }
        assert_eq!(p.loop_limit(4096), 64 + 3, "every worker, however slow");
        // Alone with a sink that takes 10 s, a tenant keeps every worker busy.
        let mut p = pace(1);
        p.timed("ten", 10_000);
        assert_eq!(p.tenant_limit("ten", 1, 4096, 256, || 64), 64 + 32);
        // Among 1,000 tenants waiting: one running, one more.
        assert_eq!(p.tenant_limit("ten", 1000, 4096, 256, || 1), 2);
    }

    #[test]
    fn a_tenant_holds_long_when_untimed_or_far_slower_than_the_loop() {
        let mut p = pace(1);
        assert!(p.holds_long("new"), "untimed");
        for i in 0..50 {
            p.timed(&format!("t{i}"), 20);
        }
        p.timed("slow", 10_000);
        assert!(p.holds_long("slow"));
        assert!(!p.holds_long("t3"));
        // A loop whose attempts are all slow: none is slower than the rest.
        let mut p = pace(1);
        for _ in 0..200 {
            p.timed("a", 1_000);
            p.timed("b", 1_200);
        }
        assert!(!p.holds_long("a") && !p.holds_long("b"));
    }

    #[test]
    fn fast_sinks_keep_the_fixed_bounds() {
        let mut p = pace(1);
        for i in 0..100 {
            p.timed(&format!("t{i}"), 5);
        }
        assert_eq!(p.loop_limit(4096), 4096);
        let not_asked = || -> usize { panic!("the fixed bound binds first") };
        assert_eq!(p.tenant_limit("t7", 100, 256, 256, not_asked), 256);
    }

    #[test]
    fn the_averages_follow_a_sink_that_turns_slow() {
        let mut p = pace(1);
        for _ in 0..20 {
            p.timed("t", 2);
        }
        assert_eq!(p.tenant_limit("t", 1, 4096, 256, || 0), 4096);
        for _ in 0..30 {
            p.timed("t", 500);
        }
        // 64 running, and at ~500 ms 640 started in 5 s (the average is within a few ms of 500
        // by now).
        let limit = p.tenant_limit("t", 1, 4096, 256, || 64);
        assert!((64 + 620..=64 + 700).contains(&limit), "{limit}");
        // With nine other tenants waiting, its turns come once in ten grants.
        let shared = p.tenant_limit("t", 10, 4096, 256, || 7);
        assert!(shared < limit / 2, "{shared}");
    }

    #[test]
    fn tenants_with_nothing_in_flight_are_forgotten_past_the_bound() {
        let mut p = pace(1);
        for i in 0..=MAX_TIMED_TENANTS {
            p.timed(&format!("t{i}"), 10);
        }
        p.trim(|t| t == "t3");
        assert_eq!(p.tenant_ms.len(), 1);
        assert_eq!(
            p.tenant_limit("t4", 1, 4096, 256, || 0),
            256,
            "untimed again"
        );
        p.trim(|_| false);
        assert_eq!(
            p.tenant_ms.len(),
            1,
            "under the bound, nothing is forgotten"
        );
    }
}
