//! Jobs, payloads and timers, in the hub task's store; claims and outcomes, in its transaction.
//!
//! Layout (family `jobs`, changelogged to `<prefix>.hub.jobs.changelog`, the hub task's state
//! changelog, which also carries the dedup and sequence stores behind `d/` and `s/`; keys are the
//! changelog keys): `j/<tenant>\0<ce-id>\0<subscription id>` → Avro job (attempt, due time, lease, reclaims,
//! last outcome); `p/<tenant>\0<ce-id>` → Avro payload (headers and value, stored once per event,
//! with the number of jobs still holding it). Family `due` (local, rebuilt on restore):
//! `<tenant>\0<due_at big-endian>\0<job key>` → empty: each tenant's jobs in due order, so the
//! scheduler takes the next due job of each tenant in turn (round robin) without scanning all jobs,
//! and a backlog of millions stays on disk.
//!
//! A job's life: created `pending`, due now → claimed (`leased`, due again at `lease_until`, in a
//! committed transaction, *then* sent; a new event's first attempt may be sent before, see
//! `hub::task::attempt_early`) → outcome: success deletes it; failure reschedules it on the
//! curve or dead-letters it when the curve is exhausted; a lease that expires with no outcome is
//! reclaimed, and after `STREAMING_HUB_POISON_THRESHOLD` reclaims the job is dead-lettered as poison.
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng;

use crate::dispatch::curve;
use crate::dispatch::worker::Outcome;
use crate::runtime::avro::{Codec, RecordKind};
use crate::runtime::fast_avro;
use crate::runtime::records::{
    AttemptOutcome, AttemptRecord, DeadLetterReason, DeadLetterRecord, EventPayloadRecord,
    HeaderRecord, JobRecord, JobState,
};
use crate::runtime::store::{Bounds, Staged, Store, StoreError};

pub const JOBS: &str = "jobs";
pub const DUE: &str = "due";

/// Moves whenever a stored payload may have gained a holder this process did not see claimed:
/// a holder added to a payload already stored (a replay or a redelivery of its event), and a
/// task's stores opened and restored (another instance may have added holders meanwhile).
/// A claim that finds its job the payload's only holder notes the count
/// ([`Attempt::sole_payload`](crate::dispatch::worker::Attempt)); while it has not moved, that
/// job's success deletes the payload without reading it (the read was the hub loop's most
/// frequent look into RocksDB's files under a backlog: the payload was written seconds before,
/// and flushed). One count for the process: a move anywhere only sends outcomes the reading way.
static PAYLOAD_HOLDS: AtomicU64 = AtomicU64::new(0);

/// The current [`PAYLOAD_HOLDS`] count.
pub fn payload_holds() -> u64 {
    PAYLOAD_HOLDS.load(Ordering::SeqCst)
}

/// Moves [`PAYLOAD_HOLDS`]: outcomes of attempts claimed before now read their payload.
pub fn payload_holds_moved() {
    PAYLOAD_HOLDS.fetch_add(1, Ordering::SeqCst);
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("codec: {0}")]
    Codec(String),
}

pub fn job_key(tenant: &str, ce_id: &str, subscription: &str) -> Vec<u8> {
    [
        b"j/",
        tenant.as_bytes(),
        b"\0",
        ce_id.as_bytes(),
        b"\0",
        subscription.as_bytes(),
    ]
    .concat()
}

pub fn payload_key(tenant: &str, ce_id: &str) -> Vec<u8> {
    [b"p/", tenant.as_bytes(), b"\0", ce_id.as_bytes()].concat()
}

/// The payload key of a job key.
pub fn payload_key_of(job_key: &[u8]) -> Option<Vec<u8>> {
    let body = job_key.strip_prefix(b"j/")?;
    let end = body.iter().rposition(|&b| b == 0)?;
    Some([b"p/", &body[..end]].concat())
}

pub fn due_key(tenant: &str, due_at: i64, job_key: &[u8]) -> Vec<u8> {
    [
        tenant.as_bytes(),
        b"\0",
        &(due_at.max(0) as u64).to_be_bytes(),
        b"\0",
        job_key,
    ]
    .concat()
}

/// The first key after every timer of `tenant` due by `due_at`: a bound that sorts after those
/// timers and before the rest.
fn due_key_bound(tenant: &str, due_at: i64) -> Vec<u8> {
    let after = (due_at.max(0) as u64).saturating_add(1);
    [tenant.as_bytes(), b"\0", &after.to_be_bytes()].concat()
}

fn split_due_key(key: &[u8], tenant: &str) -> Option<(i64, Vec<u8>)> {
    let rest = key.strip_prefix(tenant.as_bytes())?.strip_prefix(b"\0")?;
    let (t, rest) = rest.split_at_checked(8)?;
    let due = u64::from_be_bytes(t.try_into().ok()?) as i64;
    Some((due, rest.strip_prefix(b"\0")?.to_vec()))
}

/// Every tenant with at least one timer in the store (a seek per tenant, not a scan of jobs).
pub fn tenants_with_timers(store: &Store) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    let mut from: Vec<u8> = Vec::new();
    while let Some((k, _)) = store.scan_from(DUE, &from, 1)?.into_iter().next() {
        let Some(end) = k.iter().position(|&b| b == 0) else {
            break;
        };
        let tenant = String::from_utf8_lossy(&k[..end]).into_owned();
        from = [&k[..end], b"\x01".as_slice()].concat();
        out.push(tenant);
    }
    Ok(out)
}

/// The tenants of a task that may have jobs, visited in turn.
#[derive(Default)]
pub struct TenantRing {
    order: VecDeque<String>,
    members: HashSet<String>,
    /// Tenants given a job in the open transaction: their timers are not in the store yet, so
    /// an empty scan must not drop them.
    fresh: HashSet<String>,
    /// Per tenant, a timer key no live timer of it sorts before: scans seek there instead of the
    /// tenant's first key. Claimed and finished timers are deleted from the front of a tenant's
    /// range, and RocksDB iterators step over every such tombstone until a compaction; without
    /// the mark a busy tenant's scan walked thousands of them per claim (55% of the hub's CPU
    /// under load). A whole key, not only a due time: 10,000 jobs of one event share one due
    /// time, and a mark by time alone made each claim step over every timer claimed before it.
    /// Lowered by every timer a commit writes ([`TenantRing::note_timers`]).
    marks: std::collections::HashMap<String, Vec<u8>>,
    /// Per tenant, a time no live timer of it is due before, learnt by its last scan that found
    /// nothing due (its next timer's due time, or the end of an empty window looked through: see
    /// [`JobStore::next_timer`]): the tenant is not scanned again before then. Every scan
    /// creates and seeks a RocksDB iterator, and at light load, with each tenant's next timer a
    /// lease minutes away, scanning every tenant in every round was 42% of the hub thread.
    /// Lowered by every timer a commit writes ([`TenantRing::note_timers`]); a timer deleted
    /// since only makes the next scan come early.
    not_before: std::collections::HashMap<String, i64>,
    /// Per tenant whose next timer lies past more tombstones than [`LOOK_AHEAD_SKIPS`]: how far
    /// past now its next look for one reaches (see [`JobStore::next_timer`]). Cleared by every
    /// timer a commit writes for it.
    look_ahead: std::collections::HashMap<String, i64>,
    /// Tenant scans so far (each one to three RocksDB iterators: the timers due, and for a
    /// tenant with none, the look for its next one).
    scans: u64,
}

/// The most internal entries a look for a tenant's next timer steps over (a deleted timer is two
/// until a compaction: its tombstone and the put it hides) before it looks only a window ahead
/// instead (see [`JobStore::next_timer`]).
const LOOK_AHEAD_SKIPS: u64 = 128;
/// The first window such a look reads past now; each empty one makes the next four times as
/// long, up to [`LOOK_AHEAD_WHOLE_MS`].
const LOOK_AHEAD_FIRST_MS: i64 = 1_000;
/// A window this long or longer reads the tenant's whole range: no timer is set further out than
/// a retry step (10 h at most) with its jitter, so a few hours of empty windows are rare.
const LOOK_AHEAD_WHOLE_MS: i64 = 4 * 3_600_000;

impl TenantRing {
    pub fn add(&mut self, tenant: &str) {
        self.fresh.insert(tenant.to_string());
        if self.members.insert(tenant.to_string()) {
            self.order.push_back(tenant.to_string());
        }
    }

    /// Tenant scans made so far.
    pub fn scans(&self) -> u64 {
        self.scans
    }

    /// The transaction aborted: what its scans learnt (timers it deleted and will not delete
    /// after all) is forgotten, so every tenant is scanned again.
    pub fn aborted(&mut self) {
        self.not_before.clear();
        self.look_ahead.clear();
    }

    /// The transaction committed: its new timers are in the store now.
    pub fn committed(&mut self) {
        self.fresh.clear();
    }
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether a scan at `now` could find a due job: some tenant not known to have none due
    /// before a later time. A tenant whose only job waits out a 10 h backoff stays in the ring,
    /// and a loop that opened a transaction to scan it found nothing, every 50 ms, for 10 h.
    pub fn may_have_due(&self, now: i64) -> bool {
        !self.fresh.is_empty()
            || self
                .order
                .iter()
                .any(|t| self.not_before.get(t).is_none_or(|&due| due <= now))
    }

    /// Tenants with timers (due or not) in this task.
    pub fn tenants(&self) -> usize {
        self.order.len()
    }

    /// Each tenant's due jobs at `now` (counted up to `cap`) and the oldest one's due time, for
    /// the tenants with one due. A tenant's timers are read from its mark, not over the
    /// tombstones of the timers claimed before it (see `marks`), and a tenant known to have none
    /// due before a later time is not read.
    pub fn backlog(
        &self,
        store: &Store,
        now: i64,
        cap: usize,
    ) -> Result<Vec<(String, usize, i64)>, StoreError> {
        let mut out = Vec::new();
        for tenant in &self.order {
            if self.not_before.get(tenant).is_some_and(|&t| t > now) {
                continue;
            }
            let prefix = [tenant.as_bytes(), b"\0"].concat();
            let start = self.marks.get(tenant).unwrap_or(&prefix);
            let mut oldest = None;
            let due_by_now = due_key_bound(tenant, now);
            let within = Bounds {
                until: Some(&due_by_now),
                skip_at_most: 0,
            };
            let n = store.visit_within(DUE, start, within, cap, |k| {
                match split_due_key(k, tenant) {
                    Some((due, _)) if due <= now => {
                        oldest.get_or_insert(due);
                        true
                    }
                    _ => false,
                }
            })?;
            let n = n.unwrap_or_default();
            if let Some(oldest) = oldest {
                out.push((tenant.clone(), n, oldest));
            }
        }
        Ok(out)
    }

    /// Lowers the tenants' marks to the timers a committed batch wrote (call before applying it).
    pub fn note_timers(&mut self, staged: &Staged) {
        for k in staged.puts_in(DUE) {
            let Some(end) = k.iter().position(|&b| b == 0) else {
                continue;
            };
            let tenant = String::from_utf8_lossy(&k[..end]);
            if let Some(m) = self.marks.get_mut(tenant.as_ref()) {
                if k < m.as_slice() {
                    *m = k.to_vec();
                }
            }
            self.look_ahead.remove(tenant.as_ref());
            if let Some(t) = self.not_before.get_mut(tenant.as_ref()) {
                match split_due_key(k, &tenant) {
                    Some((due, _)) => *t = (*t).min(due),
                    None => *t = i64::MIN,
                }
            }
        }
    }
}

/// The store operations on jobs for one task inside one transaction. Its writes are staged; the
/// hub sends the staging's final job writes as the transaction's changelog records.
pub struct JobStore<'a> {
    pub store: &'a Store,
    pub staged: &'a mut Staged,
    pub codec: &'a Codec,
}

impl JobStore<'_> {
    pub fn get_job(&self, key: &[u8]) -> Result<Option<JobRecord>, JobError> {
        match self.staged.read(self.store, JOBS, key)? {
            Some(b) => Ok(Some(
                fast_avro::job(self.codec, &b).map_err(|e| JobError::Codec(e.to_string()))?,
            )),
            None => Ok(None),
        }
    }

    /// A record's bytes as this transaction sees them, undecoded.
    pub fn get_raw(&self, key: &[u8]) -> Result<Option<Vec<u8>>, JobError> {
        Ok(self.staged.read(self.store, JOBS, key)?)
    }

    pub fn get_payload(&self, key: &[u8]) -> Result<Option<EventPayloadRecord>, JobError> {
        match self.staged.read(self.store, JOBS, key)? {
            Some(b) => Ok(Some(
                fast_avro::payload(self.codec, &b).map_err(|e| JobError::Codec(e.to_string()))?,
            )),
            None => Ok(None),
        }
    }

    /// Reads any Avro record of this store (health records, for instance).
    pub fn get_record<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
        kind: RecordKind,
    ) -> Result<Option<T>, JobError> {
        match self.staged.read(self.store, JOBS, key)? {
            Some(b) => Ok(Some(
                self.codec
                    .decode(kind, &b)
                    .map_err(|e| JobError::Codec(e.to_string()))?,
            )),
            None => Ok(None),
        }
    }

    pub fn put_record<T: serde::Serialize>(
        &mut self,
        key: Vec<u8>,
        kind: RecordKind,
        value: &T,
    ) -> Result<(), JobError> {
        let bytes = self
            .codec
            .encode(kind, value)
            .map_err(|e| JobError::Codec(e.to_string()))?;
        self.put(key, bytes);
        Ok(())
    }

    pub fn delete_record(&mut self, key: Vec<u8>) {
        self.delete(key);
    }

    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.staged.put(JOBS, key, value);
    }

    fn delete(&mut self, key: Vec<u8>) {
        self.staged.delete(JOBS, key);
    }

    /// Writes a job and moves its timer from `old_due` (if any) to its `due_at`.
    pub fn put_job(
        &mut self,
        key: &[u8],
        job: &JobRecord,
        old_due: Option<i64>,
    ) -> Result<(), JobError> {
        if let Some(old) = old_due {
            self.staged.delete(DUE, due_key(&job.tenant_id, old, key));
        }
        self.staged
            .put(DUE, due_key(&job.tenant_id, job.due_at, key), Vec::new());
        let bytes =
            fast_avro::encode_job(self.codec, job).map_err(|e| JobError::Codec(e.to_string()))?;
        self.put(key.to_vec(), bytes);
        Ok(())
    }

    /// Deletes a job, its timer, and its payload when no other job holds it (else counts one
    /// holder less), without decoding the payload: the refcount is its record's last field
    /// ([`payload_refcount`]), so a fan-out event's payload is not decoded and re-encoded once
    /// per finished job. Records of another schema take the decoding path.
    pub fn finish_job_quietly(&mut self, key: &[u8], job: &JobRecord) -> Result<(), JobError> {
        self.delete_job(key, job);
        let Some(pk) = payload_key_of(key) else {
            return Ok(());
        };
        let Some(bytes) = self.staged.read(self.store, JOBS, &pk)? else {
            return Ok(());
        };
        match payload_refcount(self.codec, &bytes) {
            Some((_, n)) if n <= 1 => self.delete(pk),
            Some((at, n)) => {
                let mut patched = bytes;
                patched.truncate(at);
                fast_avro::put_long(&mut patched, i64::from(n - 1));
                self.put(pk, patched);
            }
            None => {
                self.release_payload(pk)?;
            }
        }
        Ok(())
    }

    /// Deletes a job, its timer, and its payload, unread: for a job that was its payload's only
    /// holder when claimed, no holder having been added since ([`PAYLOAD_HOLDS`]).
    pub fn finish_sole_job(&mut self, key: &[u8], job: &JobRecord) {
        self.delete_job(key, job);
        if let Some(pk) = payload_key_of(key) {
            self.delete(pk);
        }
    }

    /// The holder count of a payload this transaction wrote (None: not written here, or deleted).
    pub fn staged_refcount(&self, key: &[u8]) -> Option<u32> {
        let bytes = self.staged.get(JOBS, key)??;
        payload_refcount(self.codec, bytes).map(|(_, n)| n)
    }

    /// Deletes a job, its timer, and its payload when no other job holds it; returns the payload
    /// as it was (dead letters carry it).
    pub fn finish_job(
        &mut self,
        key: &[u8],
        job: &JobRecord,
    ) -> Result<Option<EventPayloadRecord>, JobError> {
        self.delete_job(key, job);
        let Some(pk) = payload_key_of(key) else {
            return Ok(None);
        };
        self.release_payload(pk)
    }

    /// Deletes a job and its timer.
    fn delete_job(&mut self, key: &[u8], job: &JobRecord) {
        self.staged
            .delete(DUE, due_key(&job.tenant_id, job.due_at, key));
        self.delete(key.to_vec());
    }

    /// One holder less for a payload (decoded): deleted with its last holder. Returns it as it was.
    fn release_payload(&mut self, pk: Vec<u8>) -> Result<Option<EventPayloadRecord>, JobError> {
        let Some(mut p) = self.get_payload(&pk)? else {
            return Ok(None);
        };
        if p.refcount <= 1 {
            self.delete(pk);
        } else {
            p.refcount -= 1;
            let bytes = self
                .codec
                .encode(RecordKind::EventPayload, &p)
                .map_err(|e| JobError::Codec(e.to_string()))?;
            self.put(pk, bytes);
        }
        Ok(Some(p))
    }

    /// Stores the event's payload once (or adds `jobs` holders to the stored one). A new payload
    /// is written by `encode(jobs)` (the bytes, refcount included); a stored one gets its refcount
    /// patched in place ([`payload_refcount`]), or decoded and re-encoded when written with
    /// another schema.
    /// `stored`: its stored bytes if the caller read them already (`Some(None)`: none stored).
    pub fn hold_payload(
        &mut self,
        key: Vec<u8>,
        stored: Option<Option<Vec<u8>>>,
        encode: impl FnOnce(u32) -> Vec<u8>,
        jobs: u32,
    ) -> Result<(), JobError> {
        let stored = match stored {
            Some(bytes) => bytes,
            None => self.staged.read(self.store, JOBS, &key)?,
        };
        let Some(stored) = stored else {
            self.put(key, encode(jobs));
            return Ok(());
        };
        payload_holds_moved();
        let held = payload_refcount(self.codec, &stored)
            .and_then(|(at, n)| Some((at, i32::try_from(n.checked_add(jobs)?).ok()?)));
        let bytes = match held {
            Some((at, n)) => {
                let mut patched = stored;
                patched.truncate(at);
                fast_avro::put_long(&mut patched, i64::from(n));
                patched
            }
            None => {
                let mut p = fast_avro::payload(self.codec, &stored)
                    .map_err(|e| JobError::Codec(e.to_string()))?;
                p.refcount = p.refcount.saturating_add(jobs);
                self.codec
                    .encode(RecordKind::EventPayload, &p)
                    .map_err(|e| JobError::Codec(e.to_string()))?
            }
        };
        self.put(key, bytes);
        Ok(())
    }

    /// Up to `limit` due jobs, tenants in turn, each taking at most an equal share of `limit`
    /// per turn: (job key, job). One pass over its due timers per turn collects a tenant's share (a pass
    /// per job stepped over every job this call had already taken from the same tenant). Jobs
    /// created in this transaction are not seen (they are claimed by the next one).
    pub fn due_jobs(
        &mut self,
        ring: &mut TenantRing,
        now: i64,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, JobRecord)>, JobError> {
        let mut out = Vec::new();
        let mut taken: HashSet<Vec<u8>> = HashSet::new();
        let mut idle_pass = 0usize;
        let share = limit.div_ceil(ring.order.len().max(1)).max(1);
        // Tenants whose last scan in this call ended before its share: nothing more is due.
        let mut exhausted: HashSet<String> = HashSet::new();
        while out.len() < limit && !ring.order.is_empty() && idle_pass < ring.order.len() {
            let tenant = ring.order.pop_front().expect("non-empty");
            if exhausted.contains(&tenant) || ring.not_before.get(&tenant).is_some_and(|&t| t > now)
            {
                idle_pass += 1;
                ring.order.push_back(tenant);
                continue;
            }
            ring.scans += 1;
            let prefix = [tenant.as_bytes(), b"\0"].concat();
            let start = ring.marks.get(&tenant).cloned().unwrap_or(prefix);
            let want = share.min(limit - out.len());
            // This tenant's timers from its mark: the first `want` not taken this call (nor
            // deleted in the open transaction) that are due. Keys are visited in place, none
            // copied but the ones found.
            // (job key, its timer's due time: the timer's key is derived from the two)
            let mut found: Vec<(Vec<u8>, i64)> = Vec::new();
            let mut first_live: Option<Vec<u8>> = None;
            // Due timers this call returned already: the caller may leave them unclaimed (a
            // tenant at its in-flight cap), so they are still due after this scan.
            let mut passed_over = false;
            let staged = &*self.staged;
            // Only the timers due by now: the iterator stops at the bound after them, and does
            // not step over the tombstones between it and the next live timer (the leases of
            // attempts that ended, up to a lease ahead: at 5,000 events/s walking them was 39%
            // of the hub thread).
            let due_by_now = due_key_bound(&tenant, now);
            let within = Bounds {
                until: Some(&due_by_now),
                skip_at_most: 0,
            };
            self.store
                .visit_within(DUE, &start, within, usize::MAX, |k| {
                    let Some((due, job)) = split_due_key(k, &tenant) else {
                        return false;
                    };
                    if first_live.is_none() {
                        first_live = Some(k.to_vec());
                    }
                    if taken.contains(&job) {
                        passed_over = true;
                    } else if staged.get(DUE, k).is_none() {
                        found.push((job, due));
                    }
                    found.len() < want
                })?;
            // Nothing due before its next timer unless a commit writes one (which lowers it);
            // a tenant that yielded jobs or is given one is scanned again next round. Nor is a
            // tenant whose due jobs an earlier scan of this call returned put to sleep: the ones
            // left unclaimed stay due, and sleeping until its next timer (a lease, 25 s away)
            // stranded them there (the last deliveries of a `throughput` run, 24 s late).
            let asleep = found.is_empty() && !passed_over && !ring.fresh.contains(&tenant);
            // Read up to `due_by_now` (or from the mark, when that is further on).
            let read_to = (&due_by_now).max(&start).clone();
            let next = if asleep {
                self.next_timer(ring, &tenant, &read_to, now)?
            } else {
                ring.not_before.remove(&tenant);
                NextTimer::NotLooked
            };
            // A tenant with no live timer at all leaves the ring (below).
            let any = first_live.is_some() || !matches!(next, NextTimer::Nothing);
            // No live timer sorts before the mark: the first one seen, or where the reads found
            // none up to.
            let mark = match (first_live, next) {
                (Some(k), _) | (None, NextTimer::At(k)) | (None, NextTimer::NoneUntil(k)) => k,
                (None, NextTimer::NotLooked) => read_to,
                // The next one written lowers it.
                (None, NextTimer::Nothing) => [tenant.as_bytes(), b"\0", &[0xff; 9]].concat(),
            };
            ring.marks.insert(tenant.clone(), mark);
            if !found.is_empty() {
                idle_pass = 0;
                if found.len() < want {
                    exhausted.insert(tenant.clone());
                }
                for (job_key, due) in found {
                    match self.get_job(&job_key)? {
                        Some(job) if job.due_at == due => {
                            taken.insert(job_key.clone());
                            out.push((job_key, job));
                        }
                        // A timer its job no longer names (every writer moves the timer with
                        // the job; a job written again as new over one whose timer stayed, as
                        // when a replayed event finds its payload skipped at restore, leaves
                        // one): deleted like a gone job's. Taken, it returned the job while it
                        // was leased or waiting out a retry, and each round reclaimed it.
                        Some(_) => {
                            tracing::warn!(
                                tenant = %tenant,
                                "a due timer its job no longer names was found and is deleted"
                            );
                            self.staged.delete(DUE, due_key(&tenant, due, &job_key));
                        }
                        // A timer whose job is gone (no writer leaves one; a store edited or
                        // restored by other means could): deleted with this transaction (timers
                        // are local, never on the changelog) and passed over until then. Found
                        // again every turn, it kept the loop going without end.
                        None => {
                            tracing::warn!(
                                tenant = %tenant,
                                "a due timer whose job is gone was found and is deleted"
                            );
                            self.staged.delete(DUE, due_key(&tenant, due, &job_key));
                            taken.insert(job_key);
                        }
                    }
                }
                ring.order.push_back(tenant);
            } else if any || ring.fresh.contains(&tenant) {
                idle_pass += 1;
                ring.order.push_back(tenant);
            } else {
                // No timers left for this tenant; a new job adds it back (its first scan then
                // starts at the tenant's first key: nothing of it is kept meanwhile, so a task
                // seeing many tenants come and go holds only the ones with timers).
                ring.members.remove(&tenant);
                ring.not_before.remove(&tenant);
                ring.marks.remove(&tenant);
                ring.look_ahead.remove(&tenant);
            }
        }
        Ok(out)
    }

    /// A tenant with nothing due now: its next live timer from `from` on, whose due time it
    /// sleeps until (`TenantRing::not_before`). The tombstones of the timers deleted since the
    /// last compaction lie between (the leases of attempts that ended, up to a lease ahead), and
    /// a RocksDB iterator steps over every one: the look gives up past [`LOOK_AHEAD_SKIPS`]
    /// entries, and from then on reads only a window ahead of now (the tenant sleeps until the
    /// window's end when it is empty), each empty window four times the last, until a timer
    /// written for the tenant starts it again from the whole range. An empty window's end can
    /// wake an idle loop for a transaction that finds nothing: a tenant whose next lease is 25 s
    /// away behind many tombstones wakes at about +1 s, +5 s and +21 s before it, where a walk
    /// over them all (once per sleep) would not wake it; the windows keep a busy loop's looks
    /// short.
    fn next_timer(
        &self,
        ring: &mut TenantRing,
        tenant: &str,
        from: &[u8],
        now: i64,
    ) -> Result<NextTimer, StoreError> {
        let tenant_end = [tenant.as_bytes(), b"\x01"].concat();
        let window = ring.look_ahead.get(tenant).copied();
        let (until, skip_at_most) = match window {
            None => (tenant_end, LOOK_AHEAD_SKIPS),
            Some(w) if w >= LOOK_AHEAD_WHOLE_MS => (tenant_end, 0),
            Some(w) => (due_key_bound(tenant, now.saturating_add(w)), 0),
        };
        let bounds = Bounds {
            until: Some(&until),
            skip_at_most,
        };
        let mut next = None;
        let looked = self.store.visit_within(DUE, from, bounds, 1, |k| {
            next = Some(k.to_vec());
            false
        })?;
        if looked.is_none() {
            ring.look_ahead
                .insert(tenant.to_string(), LOOK_AHEAD_FIRST_MS);
            return self.next_timer(ring, tenant, from, now);
        }
        match (
            next.and_then(|k| Some((split_due_key(&k, tenant)?.0, k))),
            window,
        ) {
            (Some((due, k)), _) => {
                ring.not_before.insert(tenant.to_string(), due);
                Ok(NextTimer::At(k))
            }
            (None, Some(w)) if w < LOOK_AHEAD_WHOLE_MS => {
                // Nothing due by the window's end; no live timer sorts before it (nor before
                // `from`, which may be further on).
                ring.not_before
                    .insert(tenant.to_string(), now.saturating_add(w).saturating_add(1));
                ring.look_ahead
                    .insert(tenant.to_string(), w.saturating_mul(4));
                Ok(NextTimer::NoneUntil(until.max(from.to_vec())))
            }
            (None, _) => {
                ring.not_before.remove(tenant);
                Ok(NextTimer::Nothing)
            }
        }
    }
}

/// What a look for a tenant's next timer past its due ones found (see [`JobStore::next_timer`]).
enum NextTimer {
    /// Not looked for: the tenant is scanned again next round.
    NotLooked,
    /// Its next live timer's key.
    At(Vec<u8>),
    /// None before this key (a window's end).
    NoneUntil(Vec<u8>),
    /// None at all from where it looked.
    Nothing,
}

/// Where an encoded payload record's `refcount` starts, and its value, read without a full
/// decode. Only records written with the current schema (its fingerprint); None for anything
/// else. Layout after the 10-byte single-object header: `headers` (Avro array blocks of
/// {key: string, value: union null|bytes}), `value` (bytes), `refcount` (zigzag int), nothing
/// after.
pub fn payload_refcount(codec: &Codec, bytes: &[u8]) -> Option<(usize, u32)> {
    use crate::hub::dedup::varint;
    let mut r = fast_avro::current_datum(codec, RecordKind::EventPayload, bytes)?;
    loop {
        let mut count = varint(&mut r)?;
        if count == 0 {
            break;
        }
        if count < 0 {
            varint(&mut r)?; // the block's size in bytes
            count = count.checked_neg()?;
        }
        for _ in 0..count {
            fast_avro::raw(&mut r)?; // key
            match varint(&mut r)? {
                0 => {}
                1 => {
                    fast_avro::raw(&mut r)?;
                }
                _ => return None,
            }
        }
    }
    fast_avro::raw(&mut r)?; // value
    let at = bytes.len() - r.len();
    let n = u32::try_from(varint(&mut r)?).ok()?;
    r.is_empty().then_some((at, n))
}

/// What the hub writes for one outcome besides the job itself.
pub struct OutcomeRecords {
    pub attempt: AttemptRecord,
    pub dead_letter: Option<DeadLetterRecord>,
}

/// Puts the job of an attempt that was never sent ([`Outcome::not_attempted`]) back to due now,
/// with no attempt and no reclaim counted. A stale outcome changes nothing.
pub fn release_unattempted(js: &mut JobStore<'_>, o: &Outcome, now: i64) -> Result<(), JobError> {
    let Some(mut job) = js.get_job(&o.job_key)? else {
        return Ok(());
    };
    if job.state != JobState::Leased || job.attempt != o.attempt || job.due_at != o.lease_until {
        return Ok(());
    }
    let old_due = job.due_at;
    job.state = JobState::Pending;
    job.lease_until = None;
    job.due_at = now;
    js.put_job(&o.job_key, &job, Some(old_due))
}

/// Applies an attempt's outcome to its job: done, rescheduled on the curve, or dead-lettered.
/// Returns None when the outcome is stale (the job moved on: reclaimed, deleted).
/// `job` is the outcome's job as the open transaction sees it (the caller read it).
pub fn apply_outcome(
    js: &mut JobStore<'_>,
    o: &Outcome,
    job: Option<JobRecord>,
    retry_schedule: Option<&[u64]>,
    now: i64,
    poison_threshold: u32,
    rng: &mut impl Rng,
) -> Result<Option<OutcomeRecords>, JobError> {
    let Some(mut job) = job else {
        return Ok(None);
    };
    if job.state != JobState::Leased || job.attempt != o.attempt || job.due_at != o.lease_until {
        return Ok(None);
    }
    let event_id = event_id_of(&o.job_key);
    let mut attempt = AttemptRecord {
        delivery_id: o.delivery_id.clone(),
        event_id: event_id.clone(),
        subscription_id: job.subscription_id.clone(),
        tenant_id: job.tenant_id.clone(),
        attempt: o.attempt,
        started_at: o.started_at,
        latency_ms: o.latency_ms,
        status: o.status,
        outcome: AttemptOutcome::Delivered,
        error_kind: o.error_kind.clone(),
        response_body_truncated: o.response_body.clone(),
    };
    if o.success() {
        if o.sole_payload.is_some_and(|n| n == payload_holds()) {
            js.finish_sole_job(&o.job_key, &job);
        } else {
            js.finish_job_quietly(&o.job_key, &job)?;
        }
        return Ok(Some(OutcomeRecords {
            attempt,
            dead_letter: None,
        }));
    }
    let old_due = job.due_at;
    job.last_status = o.status;
    job.last_error = o.error_kind.clone();
    if o.error_kind.as_deref() == Some("panic") {
        // Counts as a reclaim: same attempt again, unless it keeps happening.
        job.reclaims += 1;
        if job.reclaims >= poison_threshold {
            return dead_letter(
                js,
                &o.job_key,
                job,
                event_id,
                attempt,
                DeadLetterReason::Poison,
                now,
            );
        }
        job.state = JobState::Pending;
        job.lease_until = None;
        job.due_at = now;
        js.put_job(&o.job_key, &job, Some(old_due))?;
        attempt.outcome = AttemptOutcome::RetryScheduled;
        return Ok(Some(OutcomeRecords {
            attempt,
            dead_letter: None,
        }));
    }
    match curve::next_delay(retry_schedule, o.attempt + 1, o.retry_after_ms, rng) {
        Some(delay) => {
            job.attempt += 1;
            // An attempt that came back with an answer did not kill its process: poison counts
            // reclaims in a row only. Counted over the job's whole life, five unrelated lost
            // leases over its 28 hours (deploys, rebalances with a backlog leased) dead-lettered
            // a healthy job as poison.
            job.reclaims = 0;
            job.state = JobState::Pending;
            job.lease_until = None;
            job.due_at = now + delay as i64;
            js.put_job(&o.job_key, &job, Some(old_due))?;
            attempt.outcome = AttemptOutcome::RetryScheduled;
            Ok(Some(OutcomeRecords {
                attempt,
                dead_letter: None,
            }))
        }
        None => dead_letter(
            js,
            &o.job_key,
            job,
            event_id,
            attempt,
            DeadLetterReason::Exhausted,
            now,
        ),
    }
}

fn dead_letter(
    js: &mut JobStore<'_>,
    key: &[u8],
    job: JobRecord,
    event_id: String,
    mut attempt: AttemptRecord,
    reason: DeadLetterReason,
    now: i64,
) -> Result<Option<OutcomeRecords>, JobError> {
    let payload = js.finish_job(key, &job)?;
    attempt.outcome = AttemptOutcome::DeadLettered;
    let (event_headers, event_value) = split_payload(payload);
    let dl = DeadLetterRecord {
        event_id,
        subscription_id: job.subscription_id.clone(),
        tenant_id: job.tenant_id.clone(),
        attempts: job.attempt,
        last_status: job.last_status,
        last_error: job.last_error.clone(),
        reason,
        dead_at: now,
        event_headers,
        event_value,
    };
    Ok(Some(OutcomeRecords {
        attempt,
        dead_letter: Some(dl),
    }))
}

/// Dead-letters a job without an attempt (poison after reclaims, disabled subscription).
pub fn dead_letter_without_attempt(
    js: &mut JobStore<'_>,
    key: &[u8],
    job: JobRecord,
    reason: DeadLetterReason,
    now: i64,
) -> Result<DeadLetterRecord, JobError> {
    let (event_headers, event_value) = split_payload(js.finish_job(key, &job)?);
    // A leased job's attempt started (its request may have gone out) and counts as spent: the
    // poison one it kept dying in, one whose subscription was disabled while its lease ran out.
    // Otherwise the job's attempt is the next one, not spent (a job whose payload is gone).
    let attempts = match job.state {
        JobState::Leased => job.attempt,
        JobState::Pending | JobState::Parked => job.attempt.saturating_sub(1),
    };
    Ok(DeadLetterRecord {
        event_id: event_id_of(key),
        subscription_id: job.subscription_id.clone(),
        tenant_id: job.tenant_id.clone(),
        attempts,
        last_status: job.last_status,
        last_error: job.last_error.clone(),
        reason,
        dead_at: now,
        event_headers,
        event_value,
    })
}

fn split_payload(p: Option<EventPayloadRecord>) -> (Option<Vec<HeaderRecord>>, Option<Vec<u8>>) {
    match p {
        Some(p) => (Some(p.headers), Some(p.value)),
        None => (None, None),
    }
}

/// The `ce-id` inside a job key.
pub fn event_id_of(job_key: &[u8]) -> String {
    let mut parts = job_key
        .strip_prefix(b"j/")
        .unwrap_or(job_key)
        .split(|&b| b == 0);
    parts.next();
    parts
        .next()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn job(tenant: &str, id: &str, due_at: i64) -> JobRecord {
        JobRecord {
            event_key: id.into(),
            subscription_id: "s".into(),
            tenant_id: tenant.into(),
            attempt: 1,
            due_at,
            lease_until: None,
            reclaims: 0,
            last_status: None,
            last_error: None,
            state: JobState::Pending,
        }
    }

    /// Writes jobs as a committed transaction does: staged, timers noted, applied.
    fn commit_jobs(store: &Store, codec: &Codec, ring: &mut TenantRing, jobs: &[JobRecord]) {
        let mut staged = Staged::default();
        let mut js = JobStore {
            store,
            staged: &mut staged,
            codec,
        };
        for j in jobs {
            js.put_job(&job_key(&j.tenant_id, &j.event_key, "s"), j, None)
                .unwrap();
            ring.add(&j.tenant_id);
        }
        ring.note_timers(&staged);
        store.apply(staged, &[]).unwrap();
        ring.committed();
    }

    fn due_ids(store: &Store, codec: &Codec, ring: &mut TenantRing, now: i64) -> Vec<String> {
        due_ids_up_to(store, codec, ring, now, 100)
    }

    /// One `due_jobs` call, at most `limit` jobs, in a transaction that writes nothing.
    fn due_ids_up_to(
        store: &Store,
        codec: &Codec,
        ring: &mut TenantRing,
        now: i64,
        limit: usize,
    ) -> Vec<String> {
        let mut staged = Staged::default();
        let mut js = JobStore {
            store,
            staged: &mut staged,
            codec,
        };
        js.due_jobs(ring, now, limit)
            .unwrap()
            .into_iter()
            .map(|(_, j)| j.event_key)
            .collect()
    }

    /// Writes a due timer straight to the store, whatever job it names (or none).
    fn put_timer(store: &Store, due: Vec<u8>) {
        let mut staged = Staged::default();
        staged.put(DUE, due, Vec::new());
        store.apply(staged, &[]).unwrap();
    }

    #[test]
    fn a_timer_whose_job_is_gone_is_passed_over_not_scanned_forever() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        commit_jobs(&store, &codec, &mut ring, &[job("t", "live", 5)]);
        let orphan = job_key("t", "gone", "s");
        put_timer(&store, due_key("t", 1, &orphan));
        // Run where a scan that never ends fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // One free slot: the orphan, first due, filled the tenant's share at every turn.
            let one = due_ids_up_to(&store, &codec, &mut ring, 10, 1);
            let _ = tx.send((one, due_ids(&store, &codec, &mut ring, 10)));
        });
        let (one, all) = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("due_jobs returned");
        assert_eq!(
            (one, all),
            (vec!["live".to_string()], vec!["live".to_string()])
        );
    }

    #[test]
    fn a_ring_whose_tenants_have_nothing_due_until_later_has_nothing_to_scan_until_then() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        assert!(!ring.may_have_due(0), "empty");
        commit_jobs(&store, &codec, &mut ring, &[job("t", "later", 1_000)]);
        assert!(ring.may_have_due(10), "not scanned yet");
        assert!(due_ids(&store, &codec, &mut ring, 10).is_empty());
        assert!(!ring.may_have_due(10), "its next timer is at 1,000");
        assert!(!ring.may_have_due(999));
        assert!(ring.may_have_due(1_000));
        // A timer written since lowers it.
        commit_jobs(&store, &codec, &mut ring, &[job("t", "sooner", 20)]);
        assert!(!ring.may_have_due(19));
        assert!(ring.may_have_due(20));
        // A job given in the open transaction: not in the store yet, looked for.
        ring.add("u");
        assert!(ring.may_have_due(10));
        ring.committed();
        assert!(ring.may_have_due(10), "u not scanned yet");
        // An abort forgets what scans learnt.
        assert!(due_ids(&store, &codec, &mut ring, 10).is_empty());
        assert!(!ring.may_have_due(10));
        ring.aborted();
        assert!(ring.may_have_due(10));
    }

    #[test]
    fn a_tenant_without_timers_leaves_the_ring_with_nothing_kept_and_comes_back_with_a_job() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        commit_jobs(&store, &codec, &mut ring, &[job("t", "a", 1)]);
        assert_eq!(due_ids(&store, &codec, &mut ring, 10), ["a"]);
        assert!(ring.marks.contains_key("t"));
        // Its job ends: timer and job deleted.
        let key = job_key("t", "a", "s");
        let mut staged = Staged::default();
        staged.delete(DUE, due_key("t", 1, &key));
        staged.delete(JOBS, key);
        store.apply(staged, &[]).unwrap();
        assert!(due_ids(&store, &codec, &mut ring, 10).is_empty());
        assert!(ring.members.is_empty() && ring.is_empty());
        assert!(ring.marks.is_empty(), "no mark kept for a tenant gone");
        assert!(ring.not_before.is_empty());
        commit_jobs(&store, &codec, &mut ring, &[job("t", "b", 5)]);
        assert_eq!(due_ids(&store, &codec, &mut ring, 10), ["b"]);
    }

    #[test]
    fn a_timer_its_job_no_longer_names_is_deleted_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        // The job is due at 1,000 (a retry's wait); a timer at 1 stayed from before.
        commit_jobs(&store, &codec, &mut ring, &[job("t", "waiting", 1_000)]);
        let key = job_key("t", "waiting", "s");
        let stale = due_key("t", 1, &key);
        put_timer(&store, stale.clone());
        let mut staged = Staged::default();
        let mut js = JobStore {
            store: &store,
            staged: &mut staged,
            codec: &codec,
        };
        assert!(
            js.due_jobs(&mut ring, 10, 10).unwrap().is_empty(),
            "not due before 1,000"
        );
        assert_eq!(staged.get(DUE, &stale), Some(None), "its deletion staged");
        store.apply(staged, &[]).unwrap();
        assert_eq!(store.get(DUE, &stale).unwrap(), None);
        ring.committed();
        assert_eq!(due_ids(&store, &codec, &mut ring, 1_000), ["waiting"]);
    }

    #[test]
    fn a_timer_whose_job_is_gone_is_deleted_with_the_transaction_that_finds_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        commit_jobs(&store, &codec, &mut ring, &[job("t", "live", 5)]);
        let orphan = due_key("t", 1, &job_key("t", "gone", "s"));
        put_timer(&store, orphan.clone());
        let mut staged = Staged::default();
        let mut js = JobStore {
            store: &store,
            staged: &mut staged,
            codec: &codec,
        };
        let due = js.due_jobs(&mut ring, 10, 10).unwrap();
        assert_eq!(due.len(), 1);
        assert_eq!(staged.get(DUE, &orphan), Some(None), "its deletion staged");
        assert!(
            staged.writes_in(JOBS).next().is_none(),
            "nothing for the changelog"
        );
        store.apply(staged, &[]).unwrap();
        assert_eq!(store.get(DUE, &orphan).unwrap(), None);
        assert!(
            store
                .get(DUE, &due_key("t", 5, &job_key("t", "live", "s")))
                .unwrap()
                .is_some(),
            "the live job's timer kept"
        );
    }

    #[test]
    fn a_tenant_with_nothing_due_is_not_scanned_until_its_next_timer_or_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        commit_jobs(&store, &codec, &mut ring, &[job("t", "later", 1_000)]);
        assert!(due_ids(&store, &codec, &mut ring, 10).is_empty());
        assert_eq!(ring.not_before.get("t"), Some(&1_000));
        // Nothing due before 1,000 and nothing written: no scan at all.
        let scans = ring.scans();
        assert!(due_ids(&store, &codec, &mut ring, 999).is_empty());
        assert_eq!(ring.scans(), scans);
        // A committed new timer wakes the tenant at once.
        commit_jobs(&store, &codec, &mut ring, &[job("t", "now", 10)]);
        assert_eq!(due_ids(&store, &codec, &mut ring, 10), vec!["now"]);
        assert_eq!(ring.scans(), scans + 1);
        // An aborted transaction forgets what scans learnt: scanned again.
        assert!(due_ids(&store, &codec, &mut ring, 11).contains(&"now".to_string()));
        ring.not_before.insert("t".into(), 999);
        ring.aborted();
        let scans = ring.scans();
        due_ids(&store, &codec, &mut ring, 11);
        assert_eq!(ring.scans(), scans + 1);
        // Its next timer's time comes: scanned, and due.
        assert_eq!(
            due_ids(&store, &codec, &mut ring, 1_000),
            vec!["now", "later"]
        );
    }

    /// Tombstones of `n` timers of `tenant`, due every `every` ms from `first` on: written, then
    /// deleted, as the leases of attempts that ended leave them until a compaction.
    fn tombstones(store: &Store, tenant: &str, first: i64, every: i64, n: i64) {
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let job = job_key(tenant, &format!("ended-{i}"), "s");
                due_key(tenant, first + i * every, &job)
            })
            .collect();
        let mut put = Staged::default();
        let mut delete = Staged::default();
        for k in keys {
            put.put(DUE, k.clone(), Vec::new());
            delete.delete(DUE, k);
        }
        store.apply(put, &[]).unwrap();
        store.apply(delete, &[]).unwrap();
    }

    #[test]
    fn a_tenant_whose_next_timer_lies_past_many_tombstones_steps_over_few_and_wakes_on_time() {
        use rocksdb::perf::{PerfContext, PerfMetric, PerfStatsLevel, set_perf_stats};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        // A lease far ahead, and 5,000 ended ones between now and it.
        commit_jobs(&store, &codec, &mut ring, &[job("t", "leased", 200_000)]);
        tombstones(&store, "t", 20, 20, 5_000);
        set_perf_stats(PerfStatsLevel::EnableCount);
        let mut perf = PerfContext::default();
        let mut now = 10;
        let mut rounds = Vec::new();
        let mut total_skipped = 0;
        let due_at = loop {
            perf.reset();
            let due = due_ids(&store, &codec, &mut ring, now);
            let skipped = perf.metric(PerfMetric::InternalDeleteSkippedCount);
            total_skipped += skipped;
            rounds.push((now, skipped));
            if !due.is_empty() {
                assert_eq!(due, ["leased"]);
                break now;
            }
            now = *ring.not_before.get("t").expect("asleep until a later time");
            assert!(now <= 200_000, "slept past its next timer: {rounds:?}");
            assert!(rounds.len() < 10, "{rounds:?}");
        };
        assert_eq!(due_at, 200_000, "{rounds:?}");
        // Every scan used to step over all 5,000 (and the first one still steps over 128).
        assert!(rounds[0].1 < 500, "{rounds:?}");
        assert!(total_skipped < 5_500, "{total_skipped}: {rounds:?}");
        // Its last job ends: the tenant leaves the ring after a few longer and longer looks.
        let key = job_key("t", "leased", "s");
        let mut staged = Staged::default();
        staged.delete(DUE, due_key("t", 200_000, &key));
        staged.delete(JOBS, key);
        store.apply(staged, &[]).unwrap();
        let mut looks = 0;
        while !ring.is_empty() {
            looks += 1;
            assert!(looks < 10, "still in the ring at {now}");
            assert!(due_ids(&store, &codec, &mut ring, now).is_empty());
            now = ring.not_before.get("t").copied().unwrap_or(now);
        }
        assert!(ring.marks.is_empty() && ring.look_ahead.is_empty());
        // A new timer starts the looks again from the whole range.
        commit_jobs(&store, &codec, &mut ring, &[job("t", "b", now)]);
        assert_eq!(due_ids(&store, &codec, &mut ring, now), ["b"]);
    }

    #[test]
    fn due_jobs_left_unclaimed_are_due_again_next_round() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let mut ring = TenantRing::default();
        // Tenant t: two jobs due and a lease running; tenant u: only a timer not due yet.
        commit_jobs(
            &store,
            &codec,
            &mut ring,
            &[
                job("t", "a", 5),
                job("t", "b", 5),
                job("t", "leased", 1_000),
            ],
        );
        commit_jobs(&store, &codec, &mut ring, &[job("u", "later", 1_000)]);
        // A limit of 4 over two tenants: t's share (2) is its whole due set, so t is scanned a
        // second time in the same call and finds only what the first scan returned.
        assert_eq!(
            due_ids_up_to(&store, &codec, &mut ring, 10, 4),
            vec!["a", "b"]
        );
        // Nothing was claimed (t at its in-flight cap) and nothing committed: both are still
        // due, and the next round returns them without waiting for t's lease.
        assert_eq!(due_ids(&store, &codec, &mut ring, 11), vec!["a", "b"]);
    }

    fn payload(headers: usize, value: usize, refcount: u32) -> EventPayloadRecord {
        EventPayloadRecord {
            headers: (0..headers)
                .map(|i| HeaderRecord {
                    key: format!("ce-h{i}"),
                    value: (i % 3 != 0).then(|| vec![b'x'; i * 7]),
                })
                .collect(),
            value: vec![b'{'; value],
            refcount,
        }
    }

    #[test]
    fn fast_refcount_read_and_patch_agree_with_the_full_codec() {
        let codec = Codec::new().unwrap();
        for (headers, value, refcount) in [
            (0, 0, 1),
            (1, 10, 2),
            (12, 1024, 10),
            (40, 300_000, 70_000),
            (3, 5, 0),
        ] {
            let p = payload(headers, value, refcount);
            let bytes = codec.encode(RecordKind::EventPayload, &p).unwrap();
            let (at, n) = payload_refcount(&codec, &bytes).expect("current schema");
            assert_eq!(n, refcount);
            let mut patched = bytes[..at].to_vec();
            fast_avro::put_long(&mut patched, i64::from(refcount) + 1);
            let back: EventPayloadRecord =
                codec.decode(RecordKind::EventPayload, &patched).unwrap();
            assert_eq!(back.refcount, refcount + 1);
            assert_eq!((back.headers, back.value), (p.headers, p.value));
        }
        // Not a payload of this schema: no answer, the caller decodes.
        let job = JobRecord {
            event_key: "e".into(),
            subscription_id: "s".into(),
            tenant_id: "t".into(),
            attempt: 1,
            due_at: 1,
            lease_until: None,
            reclaims: 0,
            last_status: None,
            last_error: None,
            state: JobState::Pending,
        };
        let other = codec.encode(RecordKind::Job, &job).unwrap();
        assert_eq!(payload_refcount(&codec, &other), None);
        assert_eq!(payload_refcount(&codec, b"short"), None);
    }

    #[test]
    fn a_held_payload_counts_its_holders_and_goes_with_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let p = payload(3, 100, 0);
        let pk = payload_key("t", "e");
        let stored = |staged: &Staged| -> Option<EventPayloadRecord> {
            let b = staged.read(&store, JOBS, &pk).unwrap()?;
            Some(codec.decode(RecordKind::EventPayload, &b).unwrap())
        };
        let mut staged = Staged::default();
        let mut js = JobStore {
            store: &store,
            staged: &mut staged,
            codec: &codec,
        };
        let encode = |n| {
            let headers = p
                .headers
                .iter()
                .map(|h| (h.key.as_str(), h.value.as_deref()));
            fast_avro::encode_payload(&codec, headers, &p.value, n)
        };
        js.hold_payload(pk.clone(), None, encode, 2).unwrap();
        // A replay adds a holder to the payload this batch already holds; `encode` is not used.
        js.hold_payload(pk.clone(), None, |_| unreachable!("stored already"), 1)
            .unwrap();
        store.apply(staged, &[]).unwrap();
        let mut staged = Staged::default();
        let held = stored(&staged).expect("stored once");
        assert_eq!(held.refcount, 3);
        assert_eq!((&held.headers, &held.value), (&p.headers, &p.value));
        for (n, left) in [(1, Some(2)), (2, Some(1)), (3, None)] {
            let key = job_key("t", "e", &format!("s{n}"));
            let job = JobRecord {
                subscription_id: format!("s{n}"),
                ..job("t", "e", 1)
            };
            JobStore {
                store: &store,
                staged: &mut staged,
                codec: &codec,
            }
            .finish_job_quietly(&key, &job)
            .unwrap();
            assert_eq!(stored(&staged).map(|p| p.refcount), left);
        }
    }

    /// A job dead-lettered with no attempt of its own counts the attempt its lease was for when
    /// it was leased (its request may have gone out before the process died): the dead letter
    /// said one fewer than the requests a receiver saw.
    #[test]
    fn a_leased_job_dead_lettered_without_an_attempt_counts_its_leased_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let key = job_key("t", "e", "s");
        for (state, reason, attempts) in [
            (JobState::Leased, DeadLetterReason::SubscriptionDisabled, 3),
            (JobState::Pending, DeadLetterReason::SubscriptionDisabled, 2),
            (JobState::Leased, DeadLetterReason::Poison, 3),
            (JobState::Pending, DeadLetterReason::Poison, 2),
        ] {
            let job = JobRecord {
                attempt: 3,
                state,
                ..job("t", "e", 100)
            };
            let mut staged = Staged::default();
            let mut js = JobStore {
                store: &store,
                staged: &mut staged,
                codec: &codec,
            };
            js.put_job(&key, &job, None).unwrap();
            let dl = dead_letter_without_attempt(&mut js, &key, job, reason, 200).unwrap();
            assert_eq!(dl.attempts, attempts, "{state:?} {reason:?}");
        }
    }

    /// Reclaims count towards poison only in a row: an attempt that came back with an answer
    /// (a failure rescheduled on the curve) starts the count again; a panic adds to it.
    #[test]
    fn an_answered_attempt_starts_the_poison_count_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &[JOBS, DUE]).unwrap();
        let codec = Codec::new().unwrap();
        let key = job_key("t", "e", "s");
        let leased = |attempt: u32, reclaims: u32| JobRecord {
            attempt,
            reclaims,
            state: JobState::Leased,
            lease_until: Some(100),
            ..job("t", "e", 100)
        };
        let outcome = |attempt: u32, error: &str| Outcome {
            partition: 0,
            job_key: key.clone(),
            attempt,
            lease_until: 100,
            delivery_id: "d".into(),
            started_at: 50,
            latency_ms: 1,
            status: (error == "http_status").then_some(500),
            error_kind: Some(error.into()),
            retry_after_ms: None,
            response_body: None,
            ingest_ms: None,
            tenant: "t".into(),
            sole_payload: None,
            body_bytes: 0,
            url: None,
            target_nonce: None,
        };
        let apply = |job: JobRecord, o: &Outcome| {
            let mut staged = Staged::default();
            let mut js = JobStore {
                store: &store,
                staged: &mut staged,
                codec: &codec,
            };
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let records = apply_outcome(&mut js, o, Some(job), None, 60, 5, &mut rng)
                .unwrap()
                .expect("not stale");
            (records, js.get_job(&key).unwrap())
        };
        // Four reclaims so far, then an answered failure: rescheduled with the count at zero.
        let (records, after) = apply(leased(2, 4), &outcome(2, "http_status"));
        assert!(records.dead_letter.is_none());
        let after = after.expect("rescheduled");
        assert_eq!((after.attempt, after.reclaims), (3, 0));
        // A panic adds to the count, and the fifth in a row is poison.
        let (records, after) = apply(leased(3, 0), &outcome(3, "panic"));
        assert!(records.dead_letter.is_none());
        assert_eq!(after.expect("due again").reclaims, 1);
        let (records, _) = apply(leased(3, 4), &outcome(3, "panic"));
        assert!(matches!(
            records.dead_letter.map(|d| d.reason),
            Some(DeadLetterReason::Poison)
        ));
    }

    #[test]
    fn keys_round_trip_their_parts() {
        let k = job_key("t1", "id-1", "sub-9");
        assert_eq!(payload_key_of(&k).unwrap(), payload_key("t1", "id-1"));
        assert_eq!(event_id_of(&k), "id-1");
        let d = due_key("t1", 1234, &k);
        assert_eq!(split_due_key(&d, "t1"), Some((1234, k.clone())));
        assert_eq!(
            split_due_key(&d, "t"),
            None,
            "a tenant prefix of another never matches"
        );
        assert!(
            due_key("t1", 5, &k) < due_key("t1", 6, &k),
            "timers sort by due time"
        );
    }
}
