//! Per-tenant token buckets: `rate` tokens per second, at most `burst` saved up. One request costs
//! one token; without one the caller is told how long to wait. In memory, per instance: a tenant
//! spreading requests over N instances gets up to N times the rate (documented in the README).
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Tenants remembered at most; past it, buckets full for a while are forgotten first.
const MAX_TENANTS: usize = 100_000;

pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    /// `rate` requests per second with bursts of `burst`; a rate of 0 turns the limit off.
    pub fn new(rate: u32, burst: u32) -> RateLimiter {
        RateLimiter {
            rate: rate as f64,
            burst: burst.max(1) as f64,
            buckets: Mutex::default(),
        }
    }

    /// Takes a token for `tenant`, or says how long until one is available.
    pub fn take(&self, tenant: &str, now: Instant) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_TENANTS && !buckets.contains_key(tenant) {
            let (rate, burst) = (self.rate, self.burst);
            buckets.retain(|_, b| refill(*b, now, rate, burst).tokens < burst);
        }
        let b = buckets.entry(tenant.to_string()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        *b = refill(*b, now, self.rate, self.burst);
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / self.rate))
        }
    }
}

impl RateLimiter {
    /// Gives back the token a request took when the request was turned away for another reason
    /// (a pull read refused as busy): being refused should not also cost the tenant its rate.
    pub fn give_back(&self, tenant: &str) {
        if self.rate <= 0.0 {
            return;
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(tenant) {
            b.tokens = (b.tokens + 1.0).min(self.burst);
        }
    }
}

fn refill(b: Bucket, now: Instant, rate: f64, burst: f64) -> Bucket {
    let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
    Bucket {
        tokens: (b.tokens + elapsed * rate).min(burst),
        at: now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_rate() {
        let l = RateLimiter::new(2, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(l.take("a", t0).is_ok());
        }
        let wait = l.take("a", t0).unwrap_err();
        assert!(wait > Duration::from_millis(400) && wait <= Duration::from_millis(500));
        // Another tenant has its own bucket.
        assert!(l.take("b", t0).is_ok());
        // Half a second later one token is back, not two.
        let t1 = t0 + Duration::from_millis(500);
        assert!(l.take("a", t1).is_ok());
        assert!(l.take("a", t1).is_err());
    }

    #[test]
    fn a_token_given_back_can_be_taken_again_but_never_past_the_burst() {
        let l = RateLimiter::new(1, 2);
        let t0 = Instant::now();
        assert!(l.take("a", t0).is_ok());
        assert!(l.take("a", t0).is_ok());
        assert!(l.take("a", t0).is_err());
        l.give_back("a");
        assert!(l.take("a", t0).is_ok(), "the token given back");
        assert!(l.take("a", t0).is_err());
        // A full bucket stays at the burst.
        l.give_back("b");
        assert!(l.take("b", t0).is_ok());
        l.give_back("b");
        l.give_back("b");
        assert!(l.take("b", t0).is_ok());
        assert!(l.take("b", t0).is_ok());
        assert!(l.take("b", t0).is_err(), "no more than the burst of 2");
    }

    #[test]
    fn rate_zero_is_unlimited() {
        let l = RateLimiter::new(0, 1);
        let t0 = Instant::now();
        for _ in 0..100 {
            assert!(l.take("a", t0).is_ok());
        }
    }
}
