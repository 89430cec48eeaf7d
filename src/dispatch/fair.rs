//! The worker pool's permits, handed out fairly across tenants: when a worker frees up, the next
//! attempt to start is the oldest waiting one of the next tenant in turn, not the oldest waiting
//! one overall. With a first-come queue, a tenant whose claims were queued first (a large fan-out,
//! or a destination that hangs until the timeout) held every worker until its whole queue had
//! drained, however many other tenants were waiting; with turns, a tenant waits for at most one
//! attempt of each other waiting tenant.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Default)]
struct State {
    free: usize,
    /// Per tenant, its waiting attempts in arrival order.
    waiting: HashMap<String, VecDeque<oneshot::Sender<Permit>>>,
    /// Tenants with a waiting attempt, in turn order.
    turns: VecDeque<String>,
}

/// `size` permits shared by every tenant, granted round-robin across the tenants waiting.
#[derive(Clone)]
pub struct FairPermits(Arc<Mutex<State>>);

/// One worker's slot; given back (to the next tenant in turn) when dropped.
pub struct Permit(Option<FairPermits>);

impl FairPermits {
    pub fn new(size: usize) -> FairPermits {
        FairPermits(Arc::new(Mutex::new(State {
            free: size,
            ..State::default()
        })))
    }

    /// Waits for a permit on `tenant`'s turn.
    pub async fn acquire(&self, tenant: &str) -> Permit {
        let rx = {
            let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
            if s.free > 0 && s.turns.is_empty() {
                s.free -= 1;
                return Permit(Some(self.clone()));
            }
            let (tx, rx) = oneshot::channel();
            let queue = s.waiting.entry(tenant.to_string()).or_default();
            queue.push_back(tx);
            if queue.len() == 1 {
                s.turns.push_back(tenant.to_string());
            }
            rx
        };
        match rx.await {
            Ok(permit) => permit,
            // The pool was dropped: nothing limits anything any more.
            Err(_) => Permit(None),
        }
    }

    /// Gives a freed permit to the next tenant in turn, or back to the pool.
    fn release(&self) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(tenant) = s.turns.pop_front() {
            let Some(queue) = s.waiting.get_mut(&tenant) else {
                continue;
            };
            let next = queue.pop_front();
            if queue.is_empty() {
                s.waiting.remove(&tenant);
            } else {
                s.turns.push_back(tenant);
            }
            if let Some(tx) = next {
                // A waiter that gave up hands the permit back through its drop, not here.
                match tx.send(Permit(Some(self.clone()))) {
                    Ok(()) => return,
                    Err(mut unused) => unused.0 = None, // its receiver is gone: try the next
                }
            }
        }
        s.free += 1;
    }

    /// Tenants waiting for a permit now (each gets one in that many grants).
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
        if let Some(pool) = self.0.take() {
            pool.release();
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
