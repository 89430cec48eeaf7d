//! Writes again what an auto-disable of this instance's went over.
//!
//! The hub writes an auto-disable inside its transaction, planned from this instance's table:
//! it cannot wait there for the table to reach the control topic's end, as the API does before
//! it writes. A PATCH or a rotation acknowledged by another instance in that moment (the tenant
//! fixing the endpoint that was failing) was then undone on every instance, since the table
//! takes records in the log's order. Such a write restarts the failure span, so the hub would not
//! have disabled the subscription had it seen it: once the reader has read the auto-disable over
//! it ([`crate::subscriptions::table::Table::expect_auto_disable`]), this writes it again, under
//! the next version, with the API's discipline (caught up first, under the write lock, only while
//! the auto-disable is still the latest record). A deletion it went over is made again the same
//! way. An instance that stops between its auto-disable and this write leaves the auto-disable
//! in force.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::runtime::clock::SharedClock;
use crate::subscriptions::control::{RepoError, Subscriptions};
use crate::subscriptions::table::OverNewer;

/// Writes made again, for `/metrics`.
pub const AUTO_DISABLES_UNDONE: &str = "streaming_hub_auto_disables_undone_total";

/// How long a pass waits for the table to reach the control topic's end before it writes.
const SYNC_WAIT: Duration = Duration::from_secs(5);
/// Passes a write is tried in (one a second at least) before it is given up with an ERROR.
const MAX_TRIES: u32 = 120;

#[derive(Clone)]
pub struct Reasserter {
    subs: Subscriptions,
    clock: SharedClock,
    /// The API's lock on this instance's read-modify-writes.
    writes: Arc<tokio::sync::Mutex<()>>,
}

impl Reasserter {
    pub fn new(
        subs: Subscriptions,
        clock: SharedClock,
        writes: Arc<tokio::sync::Mutex<()>>,
    ) -> Reasserter {
        Reasserter {
            subs,
            clock,
            writes,
        }
    }

    /// Until `stop`: takes what the table found and writes each again.
    pub async fn run(self, stop: Arc<AtomicBool>) {
        let table = self.subs.table().clone();
        let mut waiting: Vec<(OverNewer, u32)> = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            table
                .wait_for(Duration::from_secs(1), |t| t.has_over_newer())
                .await;
            let mut found = Vec::new();
            table.apply(|t| found = t.take_over_newer());
            waiting.extend(found.into_iter().map(|o| (o, 0)));
            let mut left = Vec::new();
            for (o, tries) in waiting.drain(..) {
                let id = &o.disable.id;
                match self.reassert(&o).await {
                    Ok(true) => tracing::warn!(
                        subscription_id = %id,
                        tenant = %o.disable.tenant_id,
                        deleted = o.newer.is_none(),
                        "an auto-disable planned from an older version went over a newer write (a PATCH, a rotation, a deletion); that write is made again"
                    ),
                    Ok(false) => tracing::info!(
                        subscription_id = %id,
                        "an auto-disable went over a newer write, and a later one went over it: nothing to make again"
                    ),
                    Err(e) if tries + 1 < MAX_TRIES => {
                        tracing::warn!(subscription_id = %id, error = %e, "a write an auto-disable went over is not made again yet; retrying");
                        left.push((o, tries + 1));
                    }
                    Err(e) => tracing::error!(
                        subscription_id = %id,
                        error = %e,
                        "a write an auto-disable went over could not be made again: the subscription stays disabled; write it again (PATCH)"
                    ),
                }
            }
            waiting = left;
            if !waiting.is_empty() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }

    /// Writes `o.newer` again (or deletes the subscription again) if the auto-disable is still
    /// its latest record: true when written.
    pub async fn reassert(&self, o: &OverNewer) -> Result<bool, RepoError> {
        if let Err(e) = self.subs.sync(SYNC_WAIT).await {
            return Err(RepoError::Write(format!(
                "not attempted, this instance's table is behind: {e}"
            )));
        }
        let guard = self.writes.clone().lock_owned().await;
        let id = &o.disable.id;
        let Some(latest) = self.subs.get(id) else {
            return Ok(false); // deleted since
        };
        if self.subs.table().read().is_unreadable(id)
            || latest.version != o.disable.version
            || latest.updated_at != o.disable.updated_at
            || latest.enabled
        {
            return Ok(false);
        }
        let written = match &o.newer {
            Some(newer) => {
                let Some(version) = latest
                    .version
                    .checked_add(1)
                    .filter(|&v| v < i64::MAX as u64)
                else {
                    return Ok(false);
                };
                let mut again = (**newer).clone();
                again.version = version;
                again.updated_at = self.clock.now_ms();
                self.subs.put_holding(again, guard).await
            }
            None => self.subs.delete_holding(id, guard).await,
        };
        match written {
            Ok(()) | Err(RepoError::NotSeen(_)) => {
                metrics::counter!(AUTO_DISABLES_UNDONE).increment(1);
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }
}
