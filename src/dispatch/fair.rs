//! The worker pool's permits, handed out fairly across tenants.
//!
//! - **Turns.** When a worker frees up, the next attempt to start is the oldest waiting one of the
//!   next tenant in turn, not the oldest waiting one overall. With a first-come queue, a tenant
//!   whose claims were queued first (a large fan-out, or a destination that hangs until the
//!   timeout) held every worker until its whole queue had drained, however many other tenants
//!   were waiting; with turns, a tenant waits for at most one attempt of each other waiting
//!   tenant.
//! - **Shares.** Turns count grants, not the time a worker is held: a tenant whose destination
//!   takes 10 s to answer (no failure, so no breaker) got one grant in each round like a tenant
//!   whose destination answers in 5 ms, and kept each worker 2,000 times longer, until it held
//!   nearly all of them. So a freed worker goes first to a waiting tenant holding less than its
//!   share (the workers ÷ the tenants holding or waiting for one), in turn; to the others only
//!   when none such waits.
//! - **Reserve.** A worker is held until its attempt ends, so a slow tenant that took the workers
//!   while the others had nothing waiting kept them when the others' next events came. The last
//!   `size / 16` free workers go only to tenants under their share, and never make one tenant
//!   hold more than the others' reserve leaves: a tenant with nothing in flight starts at once
//!   however many workers a slow one holds. A tenant alone leaves them idle: 4 of the default 64
//!   (none below 16 workers).
//! - **Room for the others' recent demand.** A worker given to a tenant over its share is kept
//!   for as long as that tenant's destination takes to answer (10 s for a slow one), however
//!   many attempts of the others arrive meanwhile; with a slow tenant whose demand is more than
//!   the workers (10 events/s × 10 s = 100), every lull of the others' let it take more, until
//!   the others, whose destinations answer in 20 ms, queued for seconds behind the reserve. So a
//!   tenant whose attempts hold a worker far longer than the others' (`Pace::holds_long`), when
//!   over its share or alone, holds at most the workers less the recent peak of the others'
//!   demand: the attempts held or waiting of every tenant but the one wanting most, each counted
//!   up to its share, sampled at most every 50 ms as permits are asked for and given back, kept
//!   10 to 11 s; never less than its share among the most tenants present in that time. A
//!   tenant as fast as the others may use whatever is free: a worker it takes comes back soon.
//!   A tenant alone, or beside tenants that wanted nothing for the window, takes every worker
//!   but the reserve again, from the next permit asked for or given back (nothing re-reads the
//!   window when no permit moves). Before a hub loop has timed any attempt, every tenant counts
//!   as slow; so does a tenant not timed yet.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

#[derive(Default)]
struct Tenant {
    /// Permits it holds.
    held: usize,
    /// Its waiting attempts in arrival order.
    queue: VecDeque<oneshot::Sender<Permit>>,
    /// Whether its attempts hold a worker far longer than the others' (as its last attempt to
    /// ask was told: `Pace::holds_long`): beyond its share, or alone, it keeps room for the
    /// others' recent demand.
    holds_long: bool,
}

/// How often the demand within shares is sampled, and how long a sample counts.
const DEMAND_SAMPLE_EVERY: Duration = Duration::from_millis(50);
const DEMAND_WINDOW: Duration = Duration::from_secs(10);

/// The recent peaks of the demand within shares (the attempts held or waiting of every tenant
/// but the one wanting most, each counted up to its share) and of the tenants holding or
/// waiting for a permit (see the module's doc).
struct Demand {
    every: Duration,
    window: Duration,
    last: Option<Instant>,
    /// (start, highest demand, most tenants) of each tenth of the window, oldest first.
    buckets: VecDeque<(Instant, usize, usize)>,
    peak: usize,
    tenants: usize,
}

impl Demand {
    fn new(every: Duration, window: Duration) -> Demand {
        Demand {
            every,
            window,
            last: None,
            buckets: VecDeque::new(),
            peak: 0,
            tenants: 0,
        }
    }

    /// Whether a sample is due at `now`.
    fn due(&self, now: Instant) -> bool {
        self.last
            .is_none_or(|at| now.duration_since(at) >= self.every)
    }

    fn record(&mut self, now: Instant, demand: usize, tenants: usize) {
        self.last = Some(now);
        let width = self.window / 10;
        match self.buckets.back_mut() {
            Some((start, most, many)) if now.duration_since(*start) < width => {
                *most = (*most).max(demand);
                *many = (*many).max(tenants);
            }
            _ => self.buckets.push_back((now, demand, tenants)),
        }
        while self
            .buckets
            .front()
            .is_some_and(|(start, ..)| now.duration_since(*start) >= self.window + width)
        {
            self.buckets.pop_front();
        }
        self.peak = self.buckets.iter().map(|b| b.1).max().unwrap_or(0);
        self.tenants = self.buckets.iter().map(|b| b.2).max().unwrap_or(0);
    }

    /// The most permits a tenant over its share (or alone) may hold in a pool of `size`: what
    /// the others' recent demand leaves, and never less than its share among the tenants
    /// recently there (so at least one).
    fn room(&self, size: usize) -> usize {
        size.saturating_sub(self.peak)
            .max(size.div_ceil(self.tenants.max(1)))
    }
}

struct State {
    size: usize,
    /// Free permits kept for tenants holding none.
    reserve: usize,
    free: usize,
    /// Tenants holding a permit or waiting for one (no others).
    tenants: HashMap<String, Tenant>,
    /// Tenants with a waiting attempt, in turn order.
    turns: VecDeque<String>,
    demand: Demand,
}

impl State {
    /// Permits per tenant holding or waiting for one.
    fn share(&self) -> usize {
        self.size.div_ceil(self.tenants.len().max(1))
    }

    /// Whether a free permit may go to a tenant holding `held` of its `share`: under its share
    /// beside others, any free one but the reserve's last; over it, or alone (the others may
    /// only be between two attempts), one past the reserve and within the room the others'
    /// recent demand leaves.
    fn may_take(&self, held: usize, share: usize, holds_long: bool) -> bool {
        if held < share && share < self.size {
            self.free > self.reserve || (self.free > 0 && held + self.reserve < self.size)
        } else {
            self.free > self.reserve && (!holds_long || held < self.demand.room(self.size))
        }
    }

    /// Samples the demand within shares, when one is due.
    fn sample(&mut self) {
        let now = Instant::now();
        if !self.demand.due(now) {
            return;
        }
        let share = self.share();
        let (mut within, mut most) = (0, 0);
        for t in self.tenants.values() {
            let wants = t.held + t.queue.len();
            within += wants.min(share);
            most = most.max(wants);
        }
        let sample = within - most.min(share);
        self.demand.record(now, sample, self.tenants.len());
    }

    /// Forgets a tenant holding nothing and waiting for nothing.
    fn settle(&mut self, tenant: &str) {
        if self
            .tenants
            .get(tenant)
            .is_some_and(|t| t.held == 0 && t.queue.is_empty())
        {
            self.tenants.remove(tenant);
        }
    }
}

/// `size` permits shared by every tenant (see the module's doc).
#[derive(Clone)]
pub struct FairPermits(Arc<Mutex<State>>);

/// One worker's slot; given back (to the next tenant due one) when dropped.
pub struct Permit {
    pool: Option<FairPermits>,
    tenant: String,
}

impl FairPermits {
    pub fn new(size: usize) -> FairPermits {
        FairPermits::sampling(size, DEMAND_SAMPLE_EVERY, DEMAND_WINDOW)
    }

    /// A pool whose demand within shares is sampled every `every`, each sample counting for
    /// `window`.
    fn sampling(size: usize, every: Duration, window: Duration) -> FairPermits {
        FairPermits(Arc::new(Mutex::new(State {
            size,
            reserve: size / 16,
            free: size,
            tenants: HashMap::new(),
            turns: VecDeque::new(),
            demand: Demand::new(every, window),
        })))
    }

    /// Waits for a permit for `tenant`, whose attempts hold a worker far longer than the
    /// others' when `holds_long` (see [`Tenant::holds_long`]).
    pub async fn acquire(&self, tenant: &str, holds_long: bool) -> Permit {
        let rx = {
            let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let s = &mut *guard;
            let (held, queued) = match s.tenants.get_mut(tenant) {
                Some(t) => {
                    t.holds_long = holds_long;
                    (t.held, !t.queue.is_empty())
                }
                None => (0, false),
            };
            // At once when it may take a free permit and no one waits who should have it first:
            // nobody in turn, or this tenant under its share (a newcomer counts itself in).
            let share = s
                .size
                .div_ceil(s.tenants.len() + usize::from(held == 0 && !queued));
            if !queued
                && s.may_take(held, share, holds_long)
                && (s.turns.is_empty() || held < share)
            {
                s.free -= 1;
                // The name is copied once per grant (the permit keeps it), and once more as the
                // key of a tenant new to the pool.
                let name = tenant.to_string();
                match s.tenants.get_mut(tenant) {
                    Some(t) => t.held += 1,
                    None => {
                        let t = Tenant {
                            held: 1,
                            holds_long,
                            ..Tenant::default()
                        };
                        s.tenants.insert(name.clone(), t);
                    }
                }
                s.sample();
                return Permit {
                    pool: Some(self.clone()),
                    tenant: name,
                };
            }
            let (tx, rx) = oneshot::channel();
            let t = s.tenants.entry(tenant.to_string()).or_default();
            t.holds_long = holds_long;
            t.queue.push_back(tx);
            if t.queue.len() == 1 {
                s.turns.push_back(tenant.to_string());
            }
            // Permits past the reserve that the tenants in turn may not take (held to their
            // room) may be this one's, or another's in turn. (Anything less than that, the
            // last release already gave to whoever could take it.) Sampled first, so a room
            // that has grown counts at once.
            s.sample();
            if s.free > s.reserve {
                self.grant(s);
            }
            rx
        };
        match rx.await {
            Ok(permit) => permit,
            // The pool was dropped: nothing limits anything any more.
            Err(_) => Permit {
                pool: None,
                tenant: tenant.to_string(),
            },
        }
    }

    /// `tenant` gave a permit back: see [`FairPermits::grant`].
    fn release(&self, tenant: &str) {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        if let Some(t) = s.tenants.get_mut(tenant) {
            t.held = t.held.saturating_sub(1);
        }
        s.settle(tenant);
        s.free += 1;
        // Sampled first, so a room that has grown (old demand forgotten) counts at once.
        s.sample();
        self.grant(s);
    }

    /// Free permits go to the tenants waiting, first those under their share (in turn), then
    /// the others in turn while more than the reserve is free and within their room.
    /// (O(tenants waiting) at worst, when those first in turn may take none.)
    fn grant(&self, s: &mut State) {
        while s.free > 0 && !s.turns.is_empty() {
            let share = s.share();
            // One lookup per tenant in turn and pass: under its share only, then any.
            let may = |name: &String, under_only: bool| {
                let (held, long) = s
                    .tenants
                    .get(name)
                    .map_or((0, false), |t| (t.held, t.holds_long));
                (!under_only || held < share) && s.may_take(held, share, long)
            };
            let next = s
                .turns
                .iter()
                .position(|name| may(name, true))
                .or_else(|| s.turns.iter().position(|name| may(name, false)));
            let Some(at) = next else {
                break;
            };
            let Some(name) = s.turns.remove(at) else {
                break;
            };
            let Some(t) = s.tenants.get_mut(&name) else {
                continue;
            };
            let Some(tx) = t.queue.pop_front() else {
                s.settle(&name);
                continue;
            };
            let more = !t.queue.is_empty();
            let permit = Permit {
                pool: Some(self.clone()),
                tenant: name.clone(),
            };
            // A waiter that gave up after this hands the permit back through its drop.
            match tx.send(permit) {
                Ok(()) => {
                    t.held += 1;
                    s.free -= 1;
                }
                Err(mut unused) => unused.pool = None, // its receiver is gone: try the next
            }
            if more {
                s.turns.push_back(name);
            } else {
                s.settle(&name);
            }
        }
    }

    /// Permits `tenant` holds now.
    pub fn held(&self, tenant: &str) -> usize {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.tenants.get(tenant).map_or(0, |t| t.held)
    }

    /// Tenants waiting for a permit now (they take turns; one over its share gets fewer).
    pub fn waiting_tenants(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).turns.len()
    }

    /// Permits free now (for tests and metrics).
    pub fn available(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).free
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.release(&self.tenant);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn permits_go_round_robin_across_waiting_tenants() {
        let pool = FairPermits::new(1);
        let held = pool.acquire("a", true).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Tenant a queues five attempts first, then b and c one each.
        for (i, tenant) in ["a", "a", "a", "a", "a", "b", "c"].into_iter().enumerate() {
            let (pool, order) = (pool.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _p = pool.acquire(tenant, true).await;
                order.lock().unwrap().push(format!("{tenant}{i}"));
            }));
            tokio::task::yield_now().await; // let it queue before the next one
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            ["a0", "b5", "c6", "a1", "a2", "a3", "a4"],
            "b and c wait for one of a's attempts, not all five"
        );
        assert_eq!(pool.available(), 1, "every permit came back");
    }

    /// Waits until `task` has ended, or panics: for grants that must come at once.
    async fn granted<T>(task: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("granted")
            .unwrap()
    }

    /// Lets every spawned task run until it waits.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    fn take(pool: &FairPermits, tenant: &'static str) -> tokio::task::JoinHandle<Permit> {
        take_as(pool, tenant, true)
    }

    fn take_as(
        pool: &FairPermits,
        tenant: &'static str,
        holds_long: bool,
    ) -> tokio::task::JoinHandle<Permit> {
        let pool = pool.clone();
        tokio::spawn(async move { pool.acquire(tenant, holds_long).await })
    }

    #[tokio::test]
    async fn a_slow_tenant_holding_the_workers_yields_them_to_tenants_under_their_share() {
        let pool = FairPermits::new(16); // a reserve of one
        // Alone, a tenant takes all but the reserve.
        let mut slow = Vec::new();
        for _ in 0..15 {
            slow.push(granted(take(&pool, "slow")).await);
        }
        let slow_16th = take(&pool, "slow");
        settle().await;
        assert!(!slow_16th.is_finished(), "the last one is kept");
        assert_eq!(pool.available(), 1);
        // A tenant holding none starts at once on it.
        let fast = granted(take(&pool, "fast")).await;
        let fast_2nd = take(&pool, "fast");
        settle().await;
        assert!(!fast_2nd.is_finished(), "none free");
        // The next one slow gives back goes to fast (1 of its share of 8), not to slow
        // (waiting first, but holding 14).
        drop(slow.pop());
        let fast_2nd = granted(fast_2nd).await;
        assert!(!slow_16th.is_finished());
        // Slow holds 13, over its share while fast holds some: the one it gives back now is
        // the reserve, and stays free.
        drop(slow.pop());
        settle().await;
        assert!(
            !slow_16th.is_finished(),
            "over its share, no reserve for it"
        );
        assert_eq!(pool.available(), 1);
        assert_eq!((pool.held("slow"), pool.held("fast")), (13, 2));
        // Fast gives one back: two free, more than the reserve, and slow's waiting attempt takes
        // one; then the other, and fast holds none.
        drop((fast, fast_2nd));
        assert_eq!(pool.held("fast"), 0);
        let slow_16th = granted(slow_16th).await;
        assert_eq!(pool.available(), 2);
        drop((slow, slow_16th));
        assert_eq!(pool.available(), 16, "every permit came back");
    }

    #[tokio::test]
    async fn a_tenant_over_its_share_leaves_room_for_the_others_recent_demand() {
        // Every change sampled, each sample kept for the whole test.
        let pool = FairPermits::sampling(16, Duration::ZERO, Duration::from_secs(3600));
        let mut fast = grants(&pool, "fast", 6).await;
        let mut slow = grants(&pool, "slow", 9).await;
        assert_eq!(pool.available(), 1, "the reserve");
        let mut waiting: Vec<_> = (0..6).map(|_| take(&pool, "slow")).collect();
        settle().await;
        // Fast's attempts end and fast holds none, so slow is alone; yet it takes one more only:
        // 10 of 16, room for the 6 fast wanted.
        fast.clear();
        settle().await;
        let (done, rest): (Vec<_>, Vec<_>) = waiting.drain(..).partition(|t| t.is_finished());
        assert_eq!(done.len(), 1, "slow took one of the six fast gave back");
        for t in done {
            slow.push(t.await.unwrap());
        }
        assert_eq!((pool.held("slow"), pool.available()), (10, 6));
        // Fast's next six start at once.
        fast.extend(grants(&pool, "fast", 6).await);
        assert_eq!(pool.available(), 0);
        drop((fast, slow));
        for t in rest {
            drop(granted(t).await);
        }
        assert_eq!(pool.available(), 16, "every permit came back");
    }

    #[tokio::test]
    async fn a_tenant_as_fast_as_the_others_may_use_whatever_is_free() {
        let pool = FairPermits::sampling(16, Duration::ZERO, Duration::from_secs(3600));
        let fast = grants(&pool, "fast", 6).await;
        let mut other = grants_as(&pool, "other", 9, false).await;
        let waiting: Vec<_> = (0..6).map(|_| take_as(&pool, "other", false)).collect();
        settle().await;
        drop(fast);
        for t in waiting {
            other.push(granted(t).await);
        }
        assert_eq!(
            (pool.held("other"), pool.available()),
            (15, 1),
            "not held to the room"
        );
    }

    #[tokio::test]
    async fn a_tenant_alone_holds_all_but_the_reserve_once_the_others_demand_is_old() {
        // No sample outlives the change after it: the others' demand is forgotten at once.
        let pool = FairPermits::sampling(16, Duration::ZERO, Duration::ZERO);
        let fast: Vec<_> = grants(&pool, "fast", 6).await;
        let mut slow = grants(&pool, "slow", 9).await;
        let waiting: Vec<_> = (0..6).map(|_| take(&pool, "slow")).collect();
        settle().await;
        drop(fast);
        for t in waiting {
            slow.push(granted(t).await);
        }
        assert_eq!((pool.held("slow"), pool.available()), (15, 1));
    }

    async fn grants(pool: &FairPermits, tenant: &'static str, n: usize) -> Vec<Permit> {
        grants_as(pool, tenant, n, true).await
    }

    async fn grants_as(
        pool: &FairPermits,
        tenant: &'static str,
        n: usize,
        holds_long: bool,
    ) -> Vec<Permit> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(granted(take_as(pool, tenant, holds_long)).await);
        }
        out
    }

    #[test]
    fn the_demand_peak_forgets_samples_older_than_the_window() {
        let mut d = Demand::new(Duration::ZERO, Duration::from_secs(10));
        let t0 = Instant::now();
        d.record(t0, 6, 3);
        d.record(t0 + Duration::from_secs(5), 2, 2);
        assert_eq!((d.peak, d.tenants), (6, 3));
        assert_eq!(d.room(16), 10);
        // A sample counts for 10 to 11 s (the window, rounded up to its tenth).
        d.record(t0 + Duration::from_millis(10_900), 1, 1);
        assert_eq!(d.peak, 6);
        d.record(t0 + Duration::from_millis(11_500), 1, 1);
        assert_eq!((d.peak, d.tenants), (2, 2));
        d.record(t0 + Duration::from_millis(16_500), 1, 1);
        assert_eq!((d.peak, d.tenants), (1, 1));
        // Never below the share among the tenants recently there.
        d.record(t0 + Duration::from_millis(16_600), 99, 100);
        assert_eq!(d.room(64), 1);
        let mut d = Demand::new(Duration::ZERO, Duration::from_secs(10));
        d.record(t0, 70, 4);
        assert_eq!(d.room(64), 16);
    }

    #[tokio::test]
    async fn never_more_than_size_at_once() {
        let pool = FairPermits::new(3);
        let now = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..40 {
            let (pool, now, most) = (pool.clone(), now.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let _p = pool.acquire(&format!("t{}", i % 4), i % 2 == 0).await;
                let n = now.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                most.fetch_max(n, std::sync::atomic::Ordering::SeqCst);
                tokio::task::yield_now().await;
                now.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Three at once, never more (and not fewer: a pool that let one through at a time
        // would pass a bound alone).
        assert_eq!(most.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(pool.available(), 3);
    }
}
