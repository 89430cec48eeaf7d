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
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Default)]
struct Tenant {
    /// Permits it holds.
    held: usize,
    /// Its waiting attempts in arrival order.
    queue: VecDeque<oneshot::Sender<Permit>>,
}

#[derive(Default)]
struct State {
    size: usize,
    /// Free permits kept for tenants holding none.
    reserve: usize,
    free: usize,
    /// Tenants holding a permit or waiting for one (no others).
    tenants: HashMap<String, Tenant>,
    /// Tenants with a waiting attempt, in turn order.
    turns: VecDeque<String>,
}

impl State {
    /// Permits per tenant holding or waiting for one.
    fn share(&self) -> usize {
        self.size.div_ceil(self.tenants.len().max(1))
    }

    /// Whether a free permit may go to a tenant holding `held` of its `share`.
    fn may_take(&self, held: usize, share: usize) -> bool {
        self.free > self.reserve
            || (self.free > 0 && held < share && held + self.reserve < self.size)
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
        FairPermits(Arc::new(Mutex::new(State {
            size,
            reserve: size / 16,
            free: size,
            ..State::default()
        })))
    }

    /// Waits for a permit for `tenant`.
    pub async fn acquire(&self, tenant: &str) -> Permit {
        let rx = {
            let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let s = &mut *guard;
            let (held, queued) = s
                .tenants
                .get(tenant)
                .map_or((0, false), |t| (t.held, !t.queue.is_empty()));
            // At once when it may take a free permit and no one waits who should have it first:
            // nobody in turn, or this tenant under its share (a newcomer counts itself in).
            let share = s
                .size
                .div_ceil(s.tenants.len() + usize::from(held == 0 && !queued));
            if !queued && s.may_take(held, share) && (s.turns.is_empty() || held < share) {
                s.free -= 1;
                // The name is copied once per grant (the permit keeps it), and once more as the
                // key of a tenant new to the pool.
                let name = tenant.to_string();
                match s.tenants.get_mut(tenant) {
                    Some(t) => t.held += 1,
                    None => {
                        let t = Tenant {
                            held: 1,
                            ..Tenant::default()
                        };
                        s.tenants.insert(name.clone(), t);
                    }
                }
                return Permit {
                    pool: Some(self.clone()),
                    tenant: name,
                };
            }
            let (tx, rx) = oneshot::channel();
            let t = s.tenants.entry(tenant.to_string()).or_default();
            t.queue.push_back(tx);
            if t.queue.len() == 1 {
                s.turns.push_back(tenant.to_string());
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

    /// `tenant` gave a permit back: free permits go to the tenants waiting, first those under
    /// their share (in turn), then the others in turn while more than the reserve is free.
    /// (O(tenants waiting) at worst, when those first in turn hold their share.)
    fn release(&self, tenant: &str) {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        if let Some(t) = s.tenants.get_mut(tenant) {
            t.held = t.held.saturating_sub(1);
        }
        s.settle(tenant);
        s.free += 1;
        while s.free > 0 && !s.turns.is_empty() {
            let share = s.share();
            let held = |name: &String| s.tenants.get(name).map_or(0, |t| t.held);
            let next = s
                .turns
                .iter()
                .position(|name| held(name) < share && s.may_take(held(name), share))
                .or_else(|| {
                    s.turns
                        .iter()
                        .position(|name| s.may_take(held(name), share))
                });
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
        let held = pool.acquire("a").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Tenant a queues five attempts first, then b and c one each.
        for (i, tenant) in ["a", "a", "a", "a", "a", "b", "c"].into_iter().enumerate() {
            let (pool, order) = (pool.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _p = pool.acquire(tenant).await;
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
        let pool = pool.clone();
        tokio::spawn(async move { pool.acquire(tenant).await })
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
    async fn never_more_than_size_at_once() {
        let pool = FairPermits::new(3);
        let now = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..40 {
            let (pool, now, most) = (pool.clone(), now.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let _p = pool.acquire(&format!("t{}", i % 4)).await;
                let n = now.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                most.fetch_max(n, std::sync::atomic::Ordering::SeqCst);
                tokio::task::yield_now().await;
                now.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(most.load(std::sync::atomic::Ordering::SeqCst) <= 3);
        assert_eq!(pool.available(), 3);
    }
}
