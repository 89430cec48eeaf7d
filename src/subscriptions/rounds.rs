//! Lookups of the control topic's end, shared: one runs at a time, and every caller that came
//! before it started takes its answer ([`Rounds::next`]).
//!
//! Every read of the API looks up where the control topic ends before it answers
//! ([`crate::subscriptions::control::Subscriptions::sync`]). With a lookup of its own per request,
//! one tenant reading in a loop took all of the instance's lookups and every other tenant's read
//! waited behind it, then answered `503`; each lookup also cost the broker a request per control
//! partition. Shared, a flood of reads costs at most one lookup after another, and no caller
//! waits longer than two of them.
//!
//! A caller cannot take the answer of a lookup already running: it may have asked the broker
//! before a write this caller must see was acknowledged. It takes the next one, which starts as
//! soon as the running one ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::watch;

/// Where each non-empty control partition ends (its last offset), or why it is not known.
pub type Ends = Result<Vec<(i32, i64)>, String>;

/// The lookup a round runs, on a blocking thread.
pub type Lookup = Arc<dyn Fn() -> Ends + Send + Sync>;

/// Lookups made, for `/metrics`.
pub const END_LOOKUPS: &str = "streaming_hub_control_end_lookups_total";

pub struct Rounds {
    lookup: Lookup,
    state: std::sync::Mutex<State>,
    /// The latest round that ended: its number and its answer.
    done: watch::Sender<Option<(u64, Arc<Ends>)>>,
    made: AtomicU64,
}

/// A place in a round ([`Rounds::join`]).
pub struct Ticket {
    done: watch::Receiver<Option<(u64, Arc<Ends>)>>,
    round: u64,
}

impl Ticket {
    /// The answer of the round this ticket is for (or of a later one).
    pub async fn answer(mut self) -> Ends {
        loop {
            if let Some((n, ends)) = &*self.done.borrow_and_update() {
                if *n >= self.round {
                    return (**ends).clone();
                }
            }
            if self.done.changed().await.is_err() {
                return Err("the lookups of the control topic's end stopped".into());
            }
        }
    }
}

#[derive(Default)]
struct State {
    /// A round is running (or about to start the next one).
    running: bool,
    /// Rounds started so far; the running one's number when `running`.
    started: u64,
    /// The highest round a caller waits for.
    wanted: u64,
}

impl Rounds {
    pub fn new(lookup: Lookup) -> Arc<Rounds> {
        Arc::new(Rounds {
            lookup,
            state: std::sync::Mutex::new(State::default()),
            done: watch::Sender::new(None),
            made: AtomicU64::new(0),
        })
    }

    /// The answer of a round that starts after this call: the next one, started now when none is
    /// running. A caller dropped meanwhile leaves the round to run for the others.
    pub async fn next(self: &Arc<Self>) -> Ends {
        self.join().answer().await
    }

    /// Takes a place in the next round ([`Rounds::next`] in two steps).
    pub fn join(self: &Arc<Self>) -> Ticket {
        let done = self.done.subscribe();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let round = s.started + 1;
        s.wanted = s.wanted.max(round);
        if !s.running {
            s.running = true;
            tokio::spawn(self.clone().run());
        }
        Ticket { done, round }
    }

    /// Lookups made so far.
    pub fn made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }

    /// Runs rounds until none is waited for.
    async fn run(self: Arc<Self>) {
        loop {
            let n = {
                let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                s.started += 1;
                s.started
            };
            self.made.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(END_LOOKUPS).increment(1);
            let lookup = self.lookup.clone();
            let ends = tokio::task::spawn_blocking(move || lookup())
                .await
                .unwrap_or_else(|e| {
                    Err(format!("the lookup of the control topic's end failed: {e}"))
                });
            self.done.send_replace(Some((n, Arc::new(ends))));
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if s.wanted <= n {
                s.running = false;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A lookup that answers its round's number once the test lets it go.
    fn gated() -> (Lookup, mpsc::Sender<()>, Arc<AtomicU64>) {
        let (go, gate) = mpsc::channel::<()>();
        let gate = std::sync::Mutex::new(gate);
        let calls = Arc::new(AtomicU64::new(0));
        let counted = calls.clone();
        let lookup: Lookup = Arc::new(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            gate.lock().unwrap().recv().map_err(|e| e.to_string())?;
            Ok(vec![(0, n as i64)])
        });
        (lookup, go, calls)
    }

    /// Waits until the lookup has been called `n` times (10 s at most).
    async fn until_calls(calls: &AtomicU64, n: u64) {
        let waited = tokio::time::timeout(Duration::from_secs(10), async {
            while calls.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        assert!(waited.await.is_ok(), "lookup {n} never started");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_during_a_lookup_share_the_next_one_not_the_running_one() {
        let (lookup, go, calls) = gated();
        let rounds = Rounds::new(lookup);
        let first = tokio::spawn({
            let r = rounds.clone();
            async move { r.next().await }
        });
        until_calls(&calls, 1).await;
        // Round 1 is asking the broker: these came after it started.
        let later: Vec<_> = (0..50).map(|_| rounds.join()).collect();
        go.send(()).unwrap();
        assert_eq!(first.await.unwrap(), Ok(vec![(0, 1)]));
        until_calls(&calls, 2).await;
        go.send(()).unwrap();
        for l in later {
            assert_eq!(
                l.answer().await,
                Ok(vec![(0, 2)]),
                "the round after theirs began"
            );
        }
        assert_eq!(rounds.made(), 2, "fifty callers, one lookup");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_after_the_rounds_ended_starts_a_new_one_and_errors_are_answered() {
        let failing: Lookup = Arc::new(|| Err("broker down".to_string()));
        let rounds = Rounds::new(failing);
        assert_eq!(rounds.next().await, Err("broker down".into()));
        assert_eq!(rounds.next().await, Err("broker down".into()));
        assert_eq!(
            rounds.made(),
            2,
            "each caller after the last round ended gets a new one"
        );
        let panicking: Lookup = Arc::new(|| panic!("lookup panicked"));
        let rounds = Rounds::new(panicking);
        assert!(rounds.next().await.is_err());
        assert!(
            rounds.next().await.is_err(),
            "a round's panic stops no later one"
        );
    }
}
