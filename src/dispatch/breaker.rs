//! Circuit breakers, one per (tenant, destination origin): a destination that keeps failing stops
//! receiving requests for a while, and its due jobs are shed — rescheduled without an attempt,
//! which costs them nothing on their retry curve.
//!
//! Closed → open after `OPEN_AFTER` consecutive failures; open for `COOL_DOWN` (on the injected
//! clock); then half-open: exactly one job goes through as a probe while the others keep being
//! shed; its success closes the breaker, its failure opens it again for twice as long as the
//! last time, up to `MAX_COOL_DOWN` (every shed job is written again each time it comes due: a
//! destination down for days with a large backlog would have it all rewritten every 30 s). State is in memory per
//! instance (a restart starts closed; the retry curve still spaces attempts).
use std::collections::HashMap;

/// Consecutive failures that open a breaker.
pub const OPEN_AFTER: u32 = 5;
/// How long an open breaker sheds before it lets one probe through (ms).
pub const COOL_DOWN_MS: i64 = 30_000;
/// The longest an open breaker sheds between probes, its cool-down doubled by each failed probe
/// (ms).
pub const MAX_COOL_DOWN_MS: i64 = 300_000;
/// How long a job shed while a probe is in flight waits at least before it is looked at again
/// (ms): as long as the probe has been out, beyond that (see [`Breakers::admit`]).
const PROBE_WAIT_MS: i64 = 1_000;
/// A probe with no outcome after this long is taken as lost (its outcome went with a partition
/// that moved, or its process died): the next due job may probe (ms).
pub const PROBE_LOST_MS: i64 = 120_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Send it (closed, or the half-open probe).
    Go,
    /// Do not send; look at it again at this time.
    Shed { until: i64 },
}

/// A state change worth logging and counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Opened,
    Closed,
}

#[derive(Debug, Default, Clone)]
struct State {
    consecutive: u32,
    open_until: Option<i64>,
    /// When the half-open probe in flight was admitted.
    probing: Option<i64>,
    /// The last admit or outcome of this destination.
    seen_at: i64,
    /// The cool-down of its last opening (ms).
    cool_down: i64,
}

/// An open breaker not asked about for this long is not counted as open (its destination has no
/// due job: the subscription was deleted, its URL moved, or its partition went to another loop).
/// Its shed jobs come due again at the end of its cool-down, so it is asked about at least that
/// often while it has any.
const QUIET_MS: i64 = MAX_COOL_DOWN_MS + PROBE_LOST_MS;
/// A breaker not asked about for this long is forgotten (longer than the longest retry step, so
/// the consecutive failures of a destination retried hours apart still add up).
const FORGET_MS: i64 = 24 * 3600 * 1000;

/// Breakers by tenant, then origin: looked up without allocating. Only destinations that failed
/// since their last success have an entry; a success removes it.
///
/// Changes made inside a transaction are journaled ([`Breakers::begin`]): an aborted transaction
/// is handled again from its start, and without [`Breakers::rollback`] its outcomes would count
/// twice (a breaker open after three real failures) and a half-open probe it admitted, never
/// sent, would hold the probe slot for [`PROBE_LOST_MS`].
#[derive(Debug, Default)]
pub struct Breakers {
    states: HashMap<String, HashMap<String, State>>,
    /// Since [`Breakers::begin`]: each destination changed, with its state before the first
    /// change (None: it had no entry).
    journal: Option<HashMap<String, HashMap<String, Option<State>>>>,
}

impl Breakers {
    /// A transaction starts: changes from here on can be undone by [`Breakers::rollback`].
    pub fn begin(&mut self) {
        self.journal = Some(HashMap::new());
    }

    /// The transaction committed: its changes stay.
    pub fn commit(&mut self) {
        self.journal = None;
    }

    /// The transaction aborted: every destination it changed is as it was at [`Breakers::begin`].
    pub fn rollback(&mut self) {
        let changed = self.journal.take().unwrap_or_default();
        for (tenant, origin, before) in changed
            .into_iter()
            .flat_map(|(t, m)| m.into_iter().map(move |(o, b)| (t.clone(), o, b)))
        {
            match before {
                Some(state) => {
                    self.states.entry(tenant).or_default().insert(origin, state);
                }
                None => {
                    if let Some(per_tenant) = self.states.get_mut(&tenant) {
                        per_tenant.remove(&origin);
                        if per_tenant.is_empty() {
                            self.states.remove(&tenant);
                        }
                    }
                }
            }
        }
    }

    /// Notes a destination's state before its first change in the open transaction.
    fn journal(&mut self, tenant: &str, origin: &str) {
        let Some(journal) = self.journal.as_mut() else {
            return;
        };
        if journal.get(tenant).is_some_and(|m| m.contains_key(origin)) {
            return;
        }
        let before = self.states.get(tenant).and_then(|m| m.get(origin)).cloned();
        journal
            .entry(tenant.to_string())
            .or_default()
            .insert(origin.to_string(), before);
    }

    fn get_mut(&mut self, tenant: &str, origin: &str) -> Option<&mut State> {
        self.states.get_mut(tenant)?.get_mut(origin)
    }

    /// May a due job to this destination be attempted now?
    pub fn admit(&mut self, tenant: &str, origin: &str, now: i64) -> Admit {
        if self.get_mut(tenant, origin).is_none() {
            return Admit::Go;
        }
        self.journal(tenant, origin);
        let Some(s) = self.get_mut(tenant, origin) else {
            return Admit::Go;
        };
        s.seen_at = now;
        // Times set while the clock was ahead (a VM resumed with the wrong time, a bad NTP
        // step) and then set back: an opening no cool-down could have set, or a probe admitted
        // in the future, would shed the destination's jobs for as long as the clock had been
        // ahead, days with no probe. Such an opening has ended; such a probe is lost.
        if s.open_until.is_some_and(|t| t > now + MAX_COOL_DOWN_MS) {
            s.open_until = Some(now);
        }
        if s.probing.is_some_and(|since| since > now) {
            s.probing = None;
        }
        match (s.open_until, s.probing) {
            (None, _) => Admit::Go,
            (Some(t), _) if now < t => Admit::Shed { until: t },
            (Some(_), Some(since)) if now < since + PROBE_LOST_MS => {
                // As long again as the probe has been out (1 s at least), until it counts as
                // lost: a probe that waits for its timeout (15 s) or is lost (2 min) had the
                // whole backlog of its destination rewritten every second meanwhile; now a
                // handful of times. A quick probe's answer comes within the first second.
                Admit::Shed {
                    until: behind_probe(since, now),
                }
            }
            (Some(_), _) => {
                s.probing = Some(now);
                Admit::Go
            }
        }
    }

    /// Records an attempt's result; returns a transition when the breaker opened or closed.
    pub fn record(
        &mut self,
        tenant: &str,
        origin: &str,
        success: bool,
        now: i64,
    ) -> Option<Transition> {
        if success && self.get_mut(tenant, origin).is_none() {
            return None; // a healthy destination: nothing to change
        }
        self.journal(tenant, origin);
        if success {
            let per_tenant = self.states.get_mut(tenant)?;
            let was_open = per_tenant.remove(origin)?.open_until.is_some();
            if per_tenant.is_empty() {
                self.states.remove(tenant);
            }
            return was_open.then_some(Transition::Closed);
        }
        let s = self
            .states
            .entry(tenant.to_string())
            .or_default()
            .entry(origin.to_string())
            .or_default();
        s.seen_at = now;
        s.consecutive += 1;
        if s.probing.is_some() || (s.open_until.is_none() && s.consecutive >= OPEN_AFTER) {
            let opened = s.open_until.is_none();
            s.cool_down = if opened {
                COOL_DOWN_MS
            } else {
                (s.cool_down * 2).clamp(COOL_DOWN_MS, MAX_COOL_DOWN_MS)
            };
            s.open_until = Some(now + s.cool_down);
            s.probing = None;
            return opened.then_some(Transition::Opened);
        }
        None
    }

    /// An attempt admitted at `admitted_at` was never sent (it waited past its lease): if it was
    /// the half-open probe (admitted when the probe was), the next due job may probe instead;
    /// another attempt's does not free the probe's slot (several probes would hit a fragile
    /// destination at once). Counts as neither success nor failure.
    pub fn unsent(&mut self, tenant: &str, origin: &str, admitted_at: i64) {
        if self
            .get_mut(tenant, origin)
            .is_none_or(|s| s.probing != Some(admitted_at))
        {
            return;
        }
        self.journal(tenant, origin);
        if let Some(s) = self.get_mut(tenant, origin) {
            s.probing = None;
        }
    }

    /// Breakers open now (open or waiting for their half-open probe) whose destination was asked
    /// about lately; forgets those not asked about for a day.
    pub fn open_count(&mut self, now: i64) -> usize {
        self.states.retain(|_, per_tenant| {
            per_tenant.retain(|_, s| now - s.seen_at < FORGET_MS);
            !per_tenant.is_empty()
        });
        self.states
            .values()
            .flat_map(HashMap::values)
            .filter(|s| s.open_until.is_some() && now - s.seen_at < QUIET_MS)
            .count()
    }

    pub fn is_open(&self, tenant: &str, origin: &str) -> bool {
        self.states
            .get(tenant)
            .and_then(|m| m.get(origin))
            .is_some_and(|s| s.open_until.is_some())
    }

    /// Destinations with an entry (failing since their last success).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.states.values().map(HashMap::len).sum()
    }
}

/// The longest a receiver's `Retry-After` holds its subscription's deliveries (ms).
pub const MAX_HOLD_MS: i64 = MAX_COOL_DOWN_MS;

/// Subscriptions whose receiver asked the hub to wait (a 429 or 503 with `Retry-After`): their
/// due deliveries are postponed until then, no attempt spent, instead of each going out to be
/// refused again. Then one goes alone, as the breaker's probe does: an answer without an ask
/// lets the others go, another ask holds them again (a receiver still limiting would otherwise
/// get the whole backlog at once, and each refused one would spend an attempt). Held per
/// subscription, not per origin as the breaker is: one host serving many webhooks
/// (`hooks.slack.com`) rate-limits each on its own. Not journaled: a hold set by an outcome of
/// a transaction that aborted is set again when it runs again, and one that stays is still what
/// the receiver asked; a probe admitted there and never sent is given up after
/// [`PROBE_LOST_MS`].
#[derive(Debug, Default)]
pub struct Holds {
    held: HashMap<String, Hold>,
}

#[derive(Debug, Clone, Copy)]
struct Hold {
    until: i64,
    /// When the one delivery let through after `until` was admitted.
    probe: Option<i64>,
}

impl Holds {
    /// An attempt of `subscription` was answered, with `retry_after_ms` (None: no ask).
    pub fn hold(&mut self, subscription: &str, retry_after_ms: Option<u64>, now: i64) {
        let asked = retry_after_ms.map_or(0, |ms| ms.min(MAX_HOLD_MS as u64) as i64);
        if asked == 0 {
            // The hold was over and its one delivery went: the receiver takes them again.
            if self
                .held
                .get(subscription)
                .is_some_and(|h| h.probe.is_some())
            {
                self.held.remove(subscription);
            }
            return;
        }
        if self.held.len() >= 100_000 {
            self.held
                .retain(|_, h| h.until > now || h.probe.is_some_and(|p| now < p + PROBE_LOST_MS));
        }
        let h = self.held.entry(subscription.to_string()).or_insert(Hold {
            until: 0,
            probe: None,
        });
        h.until = h.until.max(now + asked);
        h.probe = None;
    }

    /// Until when this due delivery of `subscription` waits, if it does (None: it goes). Times
    /// further away than any ask could set, or a probe admitted in the future, were set while
    /// the clock ran ahead: the hold is over.
    pub fn held_until(&mut self, subscription: &str, now: i64) -> Option<i64> {
        let h = self.held.get_mut(subscription)?;
        if h.until > now + MAX_HOLD_MS || h.probe.is_some_and(|p| p > now) {
            self.held.remove(subscription);
            return None;
        }
        if now < h.until {
            return Some(h.until);
        }
        match h.probe {
            // Its answer is awaited: as long again as it has been out, a second at least.
            Some(since) if now < since + PROBE_LOST_MS => Some(behind_probe(since, now)),
            Some(_) => {
                self.held.remove(subscription);
                None
            }
            None => {
                h.probe = Some(now);
                None
            }
        }
    }

    /// A delivery of `subscription` let through at `admitted_at` was never sent (shed by its
    /// origin's breaker, its payload gone, or it waited past its lease): if it was the one let
    /// through after a hold, the next due delivery goes in its place. Before, the others waited
    /// behind a probe that never went out, up to [`PROBE_LOST_MS`].
    pub fn unsent(&mut self, subscription: &str, admitted_at: i64) {
        if let Some(h) = self.held.get_mut(subscription) {
            if h.probe == Some(admitted_at) {
                h.probe = None;
            }
        }
    }
}

/// When a delivery due at `now`, waiting behind a probe admitted at `since`, is looked at
/// again: as long again as the probe has been out ([`PROBE_WAIT_MS`] at least), until the probe
/// counts as lost.
fn behind_probe(since: i64, now: i64) -> i64 {
    (now + PROBE_WAIT_MS.max(now - since)).min(since + PROBE_LOST_MS)
}

/// `scheme://host:port` of a URL, the breaker's unit of destination. A URL that does not parse
/// (the API refuses one; a record written straight to the control topic may hold one) shares
/// one named origin: the URL itself may carry a credential, and the origin is logged and shown.
pub fn origin_of(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(u) => u.origin().ascii_serialization(),
        Err(_) => INVALID_URL_ORIGIN.to_string(),
    }
}

/// The origin of every URL that does not parse.
pub const INVALID_URL_ORIGIN: &str = "invalid-url";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_success_forgets_the_destination_and_a_quiet_open_one_stops_counting() {
        let mut b = Breakers::default();
        for _ in 0..OPEN_AFTER {
            b.record("t", "https://a", false, 0);
        }
        b.record("t", "https://b", false, 0);
        assert_eq!((b.len(), b.open_count(0)), (2, 1));
        assert_eq!(b.record("t", "https://b", true, 1), None);
        assert_eq!(b.len(), 1, "a success removes the entry");
        // Nobody asks about the open one (its subscription was deleted): not counted as open...
        assert_eq!(b.open_count(QUIET_MS), 0);
        assert!(b.is_open("t", "https://a"));
        // ...and forgotten after a day.
        assert_eq!(b.open_count(FORGET_MS), 0);
        assert_eq!(b.len(), 0);
        // Asked about, it counts again.
        for _ in 0..OPEN_AFTER {
            b.record("t", "https://a", false, FORGET_MS);
        }
        b.admit("t", "https://a", FORGET_MS + QUIET_MS - 1);
        assert_eq!(b.open_count(FORGET_MS + QUIET_MS), 1);
    }

    #[test]
    fn an_aborted_transaction_leaves_the_breakers_as_they_were() {
        let mut b = Breakers::default();
        // Three failures in a transaction that aborts, then the same three again (the outcomes
        // are handled anew) and two more: five in all, open only at the fifth.
        b.begin();
        for _ in 0..3 {
            b.record("t", "https://a", false, 0);
        }
        b.rollback();
        assert_eq!(b.len(), 0, "the destination had no entry before");
        b.begin();
        for _ in 0..3 {
            b.record("t", "https://a", false, 0);
        }
        b.commit();
        b.begin();
        assert_eq!(b.record("t", "https://a", false, 1), None);
        assert_eq!(
            b.record("t", "https://a", false, 1),
            Some(Transition::Opened)
        );
        b.commit();
        // A half-open probe admitted in an aborted transaction was never sent: the next one may
        // probe at once, not after PROBE_LOST_MS.
        let half_open = 1 + COOL_DOWN_MS;
        b.begin();
        assert_eq!(b.admit("t", "https://a", half_open), Admit::Go);
        b.rollback();
        b.begin();
        assert_eq!(b.admit("t", "https://a", half_open + 1), Admit::Go);
        assert!(matches!(
            b.admit("t", "https://a", half_open + 2),
            Admit::Shed { .. }
        ));
        // A success rolled back leaves the breaker open.
        b.rollback();
        b.begin();
        b.record("t", "https://a", true, half_open + 3);
        b.rollback();
        assert!(b.is_open("t", "https://a"));
    }

    #[test]
    fn an_unparsable_url_never_becomes_an_origin_that_is_logged() {
        assert_eq!(
            origin_of("https://h.example:8443/cb?x=1"),
            "https://h.example:8443"
        );
        assert_eq!(
            origin_of("https://h:99999/cb?token=SECRET"),
            INVALID_URL_ORIGIN
        );
    }

    #[test]
    fn jobs_shed_behind_a_probe_wait_as_long_again_as_it_has_been_out() {
        let mut b = Breakers::default();
        for _ in 0..OPEN_AFTER {
            b.record("t", "https://a", false, 0);
        }
        let probe_at = COOL_DOWN_MS;
        assert_eq!(b.admit("t", "https://a", probe_at), Admit::Go, "the probe");
        let shed = |b: &mut Breakers, after: i64| match b.admit("t", "https://a", probe_at + after)
        {
            Admit::Shed { until } => until - probe_at,
            Admit::Go => panic!("a second probe {after} ms after the first"),
        };
        assert_eq!(shed(&mut b, 200), 1_200, "a second at least");
        assert_eq!(shed(&mut b, 10_000), 20_000, "as long again");
        assert_eq!(
            shed(&mut b, 100_000),
            PROBE_LOST_MS,
            "no later than it counts as lost"
        );
        // Lost: the next due job probes.
        assert_eq!(
            b.admit("t", "https://a", probe_at + PROBE_LOST_MS),
            Admit::Go
        );
    }

    #[test]
    fn a_probe_that_was_never_sent_lets_the_next_job_probe() {
        let mut b = Breakers::default();
        for i in 0..OPEN_AFTER as i64 {
            b.record("t", "https://a", false, i);
        }
        let later = 10 + COOL_DOWN_MS;
        assert_eq!(b.admit("t", "https://a", later), Admit::Go, "the probe");
        assert!(matches!(
            b.admit("t", "https://a", later),
            Admit::Shed { .. }
        ));
        // An attempt admitted before the breaker opened, never sent: not the probe.
        b.unsent("t", "https://a", 3);
        assert!(matches!(
            b.admit("t", "https://a", later),
            Admit::Shed { .. }
        ));
        b.unsent("t", "https://a", later);
        assert_eq!(b.admit("t", "https://a", later), Admit::Go, "a new probe");
        assert!(
            b.is_open("t", "https://a"),
            "still open until a probe succeeds"
        );
    }

    #[test]
    fn a_probe_whose_outcome_never_comes_is_replaced_after_a_while() {
        let mut b = Breakers::default();
        for i in 0..OPEN_AFTER as i64 {
            b.record("t", "https://a", false, i);
        }
        let t = 10 + COOL_DOWN_MS;
        assert_eq!(b.admit("t", "https://a", t), Admit::Go, "the probe");
        let before = t + PROBE_LOST_MS - 1;
        assert!(matches!(
            b.admit("t", "https://a", before),
            Admit::Shed { .. }
        ));
        assert_eq!(
            b.admit("t", "https://a", t + PROBE_LOST_MS),
            Admit::Go,
            "the lost probe is replaced"
        );
    }

    /// The clock ran a week ahead while a destination failed, then was set back: the breaker
    /// opened (and probed) at times that are now a week away. It probes at once instead of
    /// shedding the destination's jobs for that week.
    #[test]
    fn times_set_while_the_clock_ran_ahead_do_not_hold_a_breaker_open() {
        let week = 7 * 86_400_000;
        let mut b = Breakers::default();
        for i in 0..OPEN_AFTER as i64 {
            b.record("t", "https://a", false, week + i);
        }
        assert!(matches!(
            b.admit("t", "https://a", week + 10),
            Admit::Shed { .. }
        ));
        // Set back: the opening's end is a week away.
        assert_eq!(b.admit("t", "https://a", 1_000), Admit::Go, "the probe");
        // A probe admitted while the clock was ahead counts as lost once it is set back.
        let mut b = Breakers::default();
        for i in 0..OPEN_AFTER as i64 {
            b.record("t", "https://a", false, week + i);
        }
        assert_eq!(
            b.admit("t", "https://a", week + COOL_DOWN_MS + 10),
            Admit::Go
        );
        assert_eq!(b.admit("t", "https://a", 1_000), Admit::Go, "a new probe");
        // A cool-down of the ordinary kind still sheds.
        let mut b = Breakers::default();
        for i in 0..OPEN_AFTER as i64 {
            b.record("t", "https://a", false, i);
        }
        assert!(matches!(b.admit("t", "https://a", 10), Admit::Shed { .. }));
    }

    #[test]
    fn opens_after_five_consecutive_failures_and_sheds_until_cool_down() {
        let mut b = Breakers::default();
        for i in 0..4 {
            assert_eq!(b.record("t", "https://a", false, i), None);
            assert_eq!(b.admit("t", "https://a", i), Admit::Go);
        }
        assert_eq!(
            b.record("t", "https://a", false, 10),
            Some(Transition::Opened)
        );
        assert_eq!(
            b.admit("t", "https://a", 11),
            Admit::Shed {
                until: 10 + COOL_DOWN_MS
            }
        );
        assert_eq!(
            b.admit("t", "https://b", 11),
            Admit::Go,
            "other destinations are unaffected"
        );
        assert_eq!(
            b.admit("u", "https://a", 11),
            Admit::Go,
            "other tenants are unaffected"
        );
    }

    #[test]
    fn a_success_in_between_resets_the_count() {
        let mut b = Breakers::default();
        for i in 0..4 {
            b.record("t", "o", false, i);
        }
        b.record("t", "o", true, 5);
        for i in 0..4 {
            assert_eq!(b.record("t", "o", false, 10 + i), None);
        }
        assert!(!b.is_open("t", "o"));
    }

    #[test]
    fn half_open_lets_one_probe_through_and_its_result_decides() {
        let mut b = Breakers::default();
        for i in 0..5 {
            b.record("t", "o", false, i);
        }
        let after = 4 + COOL_DOWN_MS;
        assert_eq!(b.admit("t", "o", after), Admit::Go, "the probe");
        assert_eq!(
            b.admit("t", "o", after),
            Admit::Shed {
                until: after + PROBE_WAIT_MS
            },
            "only one probe"
        );
        assert_eq!(
            b.record("t", "o", false, after + 1),
            None,
            "probe failed: open again"
        );
        // Open again, for twice as long.
        let later = after + 1 + 2 * COOL_DOWN_MS;
        assert_eq!(b.admit("t", "o", later - 1), Admit::Shed { until: later });
        assert_eq!(b.admit("t", "o", later), Admit::Go);
        assert_eq!(b.record("t", "o", true, later), Some(Transition::Closed));
        assert_eq!(b.admit("t", "o", later), Admit::Go);
    }

    #[test]
    fn each_failed_probe_doubles_the_cool_down_up_to_its_bound_and_a_close_resets_it() {
        let mut b = Breakers::default();
        let mut now = 0;
        for _ in 0..OPEN_AFTER {
            b.record("t", "o", false, now);
        }
        let mut waits = Vec::new();
        for _ in 0..6 {
            let Admit::Shed { until } = b.admit("t", "o", now) else {
                panic!("open")
            };
            waits.push(until - now);
            now = until;
            assert_eq!(b.admit("t", "o", now), Admit::Go, "the probe");
            b.record("t", "o", false, now);
        }
        let s = 1_000;
        assert_eq!(waits, [30 * s, 60 * s, 120 * s, 240 * s, 300 * s, 300 * s]);
        assert_eq!(MAX_COOL_DOWN_MS, 300 * s);
        assert_eq!(
            b.open_count(now + MAX_COOL_DOWN_MS),
            1,
            "counted open through its longest cool-down, no job asking meanwhile"
        );
        // Closed by a success, then open again: from the first cool-down.
        let Admit::Shed { until } = b.admit("t", "o", now) else {
            panic!("open")
        };
        b.admit("t", "o", until);
        b.record("t", "o", true, until);
        for _ in 0..OPEN_AFTER {
            b.record("t", "o", false, until);
        }
        assert_eq!(
            b.admit("t", "o", until),
            Admit::Shed {
                until: until + COOL_DOWN_MS
            }
        );
    }

    /// The one delivery let through after a hold, never sent (its origin's breaker shed it, or
    /// it waited past its lease), frees its place: the next due one goes, instead of all of them
    /// waiting behind a probe that never went out until it counted as lost.
    #[test]
    fn a_hold_s_probe_never_sent_lets_the_next_one_through() {
        let s = 1_000;
        let mut h = Holds::default();
        h.hold("sub-a", Some(20 * s as u64), 0);
        assert_eq!(h.held_until("sub-a", 20 * s), None, "let through");
        assert!(h.held_until("sub-a", 20 * s + 1).is_some(), "behind it");
        // Another delivery's admission time frees nothing.
        h.unsent("sub-a", 20 * s - 1);
        assert!(h.held_until("sub-a", 20 * s + 2).is_some());
        h.unsent("sub-a", 20 * s);
        assert_eq!(h.held_until("sub-a", 20 * s + 3), None, "the next one goes");
        assert!(
            h.held_until("sub-a", 20 * s + 4).is_some(),
            "behind that one"
        );
        // Nothing held: nothing to free.
        h.unsent("sub-z", 5);
        assert_eq!(h.held_until("sub-z", 6), None);
    }

    #[test]
    fn a_retry_after_holds_its_subscription_then_lets_one_through_first() {
        let s = 1_000;
        let mut h = Holds::default();
        h.hold("sub-a", Some(20 * s as u64), 0);
        assert_eq!(h.held_until("sub-a", 1), Some(20 * s));
        assert_eq!(
            h.held_until("sub-b", 1),
            None,
            "another subscription on the origin"
        );
        // Over: one goes; the others wait for its answer (a second at least).
        assert_eq!(h.held_until("sub-a", 20 * s), None, "the one let through");
        assert_eq!(h.held_until("sub-a", 20 * s + 1), Some(21 * s + 1));
        // Asked again: held again, for as long.
        h.hold("sub-a", Some(10 * s as u64), 21 * s);
        assert_eq!(h.held_until("sub-a", 22 * s), Some(31 * s));
        assert_eq!(
            h.held_until("sub-a", 31 * s),
            None,
            "the next one let through"
        );
        // An answer without an ask (taken, or another failure): all go.
        h.hold("sub-a", None, 32 * s);
        assert_eq!(h.held_until("sub-a", 32 * s), None);
        assert_eq!(h.held_until("sub-a", 32 * s), None);
        // An answer without an ask to a delivery sent before the hold ends nothing.
        h.hold("sub-a", Some(10 * s as u64), 40 * s);
        h.hold("sub-a", None, 41 * s);
        assert_eq!(h.held_until("sub-a", 42 * s), Some(50 * s));
        // A probe whose answer never comes is given up.
        assert_eq!(h.held_until("sub-a", 50 * s), None);
        assert_eq!(h.held_until("sub-a", 50 * s + PROBE_LOST_MS), None);
        assert_eq!(h.held_until("sub-a", 50 * s + PROBE_LOST_MS), None);
        // A shorter ask does not shorten a hold; a longer one extends it; an hour is capped.
        h.hold("sub-c", Some(100 * s as u64), 0);
        h.hold("sub-c", Some(2 * s as u64), 1);
        assert_eq!(h.held_until("sub-c", 2), Some(100 * s));
        h.hold("sub-c", Some(3_600 * s as u64), 0);
        assert_eq!(h.held_until("sub-c", 2), Some(MAX_HOLD_MS));
        // None or zero asks nothing.
        h.hold("sub-d", Some(0), 0);
        h.hold("sub-e", None, 0);
        assert_eq!(
            (h.held_until("sub-d", 1), h.held_until("sub-e", 1)),
            (None, None)
        );
        // Set while the clock ran ahead, then set back: over, not held for as long.
        h.hold("sub-f", Some(60 * s as u64), 7 * 24 * 3_600 * s);
        assert_eq!(h.held_until("sub-f", 0), None);
    }

    #[test]
    fn origin_is_scheme_host_and_port() {
        assert_eq!(
            origin_of("https://hooks.example.com/a/b?x=1"),
            "https://hooks.example.com"
        );
        assert_eq!(
            origin_of("http://127.0.0.1:8080/hook"),
            "http://127.0.0.1:8080"
        );
    }
}
