//! The retry curve: when the next attempt of a failed delivery is due.
//!
//! Default: attempts at `0 · 5s · 5m · 30m · 2h · 5h · 10h · 10h` — 8 attempts, the 7 delays
//! between them drawn with full jitter (uniform in `[0, step]`): at most about 28 hours in all
//! (the steps' sum), about 14 on average. A
//! subscription may carry its own list of delays (at most 12, each at most 10h; anything else falls
//! back to the default). A `Retry-After` on a 429 or 503 wins when it is longer than the drawn
//! delay, capped at 10h.
use rand::Rng;

pub const MAX_STEP_MS: u64 = 10 * 3600 * 1000;
pub const MAX_STEPS: usize = 12;

/// Delays between attempts, in milliseconds: attempt n+1 comes `DEFAULT[n-1]` after attempt n.
pub const DEFAULT_DELAYS_MS: [u64; 7] = [
    5_000,
    5 * 60_000,
    30 * 60_000,
    2 * 3_600_000,
    5 * 3_600_000,
    10 * 3_600_000,
    10 * 3_600_000,
];

/// The delays a subscription's jobs follow.
pub fn delays(custom: Option<&[u64]>) -> &[u64] {
    match custom {
        Some(c) if !c.is_empty() && c.len() <= MAX_STEPS && c.iter().all(|&d| d <= MAX_STEP_MS) => {
            c
        }
        _ => &DEFAULT_DELAYS_MS,
    }
}

/// Total attempts a job gets: the first plus one per delay.
pub fn max_attempts(custom: Option<&[u64]>) -> u32 {
    delays(custom).len() as u32 + 1
}

/// The delay before attempt `next_attempt` (2, 3, …), jittered; None when the curve is exhausted.
pub fn next_delay(
    custom: Option<&[u64]>,
    next_attempt: u32,
    retry_after_ms: Option<u64>,
    rng: &mut impl Rng,
) -> Option<u64> {
    let steps = delays(custom);
    let step = *steps.get(next_attempt.checked_sub(2)? as usize)?;
    let drawn = if step == 0 {
        0
    } else {
        rng.gen_range(0..=step)
    };
    Some(match retry_after_ms {
        Some(ra) => drawn.max(ra.min(MAX_STEP_MS)),
        None => drawn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn default_curve_gives_eight_attempts_over_about_28_hours() {
        assert_eq!(max_attempts(None), 8);
        let total: u64 = DEFAULT_DELAYS_MS.iter().sum();
        assert!(
            (27 * 3_600_000..=29 * 3_600_000).contains(&total),
            "{total}"
        );
    }

    /// What the README tells receivers: a delivery's retries end at most about 28 hours after its
    /// first attempt, about 14 on average (full jitter halves each step on average).
    #[test]
    fn a_whole_jittered_schedule_spans_about_14_hours_on_average_and_at_most_28() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let runs = 10_000u64;
        let totals: Vec<u64> = (0..runs)
            .map(|_| {
                (2..=max_attempts(None))
                    .map(|n| next_delay(None, n, None, &mut rng).unwrap())
                    .sum()
            })
            .collect();
        let sum: u64 = DEFAULT_DELAYS_MS.iter().sum();
        assert!(totals.iter().all(|&t| t <= sum));
        let mean_h = totals.iter().sum::<u64>() as f64 / runs as f64 / 3_600_000.0;
        assert!((13.0..14.6).contains(&mean_h), "mean {mean_h:.2} h");
    }

    #[test]
    fn jittered_delay_stays_within_its_step_and_spreads() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let draws: Vec<u64> = (0..1000)
            .map(|_| next_delay(None, 3, None, &mut rng).unwrap())
            .collect();
        assert!(draws.iter().all(|&d| d <= 5 * 60_000));
        let min = *draws.iter().min().unwrap();
        let max = *draws.iter().max().unwrap();
        assert!(
            min < 30_000 && max > 270_000,
            "full jitter uses the whole range: {min}..{max}"
        );
    }

    #[test]
    fn exhausted_curve_has_no_next_delay() {
        let mut rng = rand::thread_rng();
        assert!(next_delay(None, 8, None, &mut rng).is_some());
        assert!(next_delay(None, 9, None, &mut rng).is_none());
        assert!(
            next_delay(None, 1, None, &mut rng).is_none(),
            "attempt 1 is not a retry"
        );
    }

    #[test]
    fn custom_schedule_of_three_steps_gives_four_attempts() {
        let custom = [1_000, 2_000, 3_000];
        assert_eq!(max_attempts(Some(&custom)), 4);
        let mut rng = rand::thread_rng();
        assert!(next_delay(Some(&custom), 4, None, &mut rng).unwrap() <= 3_000);
        assert!(next_delay(Some(&custom), 5, None, &mut rng).is_none());
    }

    #[test]
    fn malformed_custom_schedule_falls_back_to_the_default() {
        assert_eq!(max_attempts(Some(&[])), 8);
        assert_eq!(max_attempts(Some(&[MAX_STEP_MS + 1])), 8);
        assert_eq!(max_attempts(Some(&[1; 13])), 8);
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_as_an_http_date() {
        use crate::dispatch::worker::parse_retry_after;
        let now = chrono::DateTime::parse_from_rfc3339("2026-10-21T06:28:00Z")
            .unwrap()
            .timestamp_millis();
        assert_eq!(parse_retry_after("120", now), Some(120_000));
        assert_eq!(parse_retry_after(" 7 ", now), Some(7_000));
        let date = "Wed, 21 Oct 2026 07:28:00 GMT";
        assert_eq!(parse_retry_after(date, now), Some(3_600_000));
        // The obsolete forms RFC 9110 §5.6.7 still has recipients accept.
        for old in [
            "Wednesday, 21-Oct-26 07:28:00 GMT",
            "Wed Oct 21 07:28:00 2026",
        ] {
            assert_eq!(parse_retry_after(old, now), Some(3_600_000), "{old:?}");
        }
        assert_eq!(
            parse_retry_after(date, now + 7_200_000),
            Some(0),
            "a date past"
        );
        for bad in ["soon", "-5", "", "1.5"] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn longer_retry_after_wins_and_is_capped() {
        let mut rng = rand::thread_rng();
        assert_eq!(next_delay(None, 2, Some(60_000), &mut rng), Some(60_000));
        assert_eq!(
            next_delay(None, 2, Some(100 * 3_600_000), &mut rng),
            Some(MAX_STEP_MS)
        );
        assert!(next_delay(None, 2, Some(1), &mut rng).unwrap() <= 5_000);
    }
}
