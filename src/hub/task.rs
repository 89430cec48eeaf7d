//! The hub stage: one task per assigned inbox partition, all driven by one thread and one
//! transactional producer per instance (Kafka's "EOS v2": zombies are fenced by the consumer group
//! generation carried into every offset commit, and a restarted instance fences its previous
//! incarnation through the shared transactional id `<prefix>.hub.<instance>`).
//!
//! Per batch, one transaction: for each record dedup → sequence → the [`EventHandler`] (matching and
//! jobs hang off it), the changelog records of every store write, the handler's outputs, and the
//! inbox offsets. Store writes are staged and reach RocksDB only after the commit.
//!
//! Rebalance: a partition assigned to us is paused and restored from its changelogs in a thread
//! beside the loop ([`RestoreJob`]); the loop takes its task and resumes it once restored, so
//! none of its records is processed before, and the other partitions are served meanwhile. A
//! revocation stops a restore of the partition (closing its stores) before the callback
//! returns. A partition revoked while a batch was being
//! filled has its records dropped from that batch (no transaction is open while polling, so
//! nothing of it was written): the new owner reads them from the committed offset.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::{BorrowedMessage, Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::config::Config;
use crate::dispatch::jobs::{self, DUE, JOBS, JobStore, TenantRing};
use crate::dispatch::worker::{Attempt, Outcome, Workers};
use crate::dispatch::{EventView, breaker, curve, health, pace};
use crate::hub::dedup::{self, DEDUP, DEDUP_EXPIRY, SEQUENCE, Seen};
use crate::runtime::avro::{Codec, CodecError, RecordKind};
use crate::runtime::changelog::{self, TrackingContext};
use crate::runtime::clock::SharedClock;
use crate::runtime::kafka::{self, KafkaError};
use crate::runtime::orphans::{self, Covers, GroupWatch, Joining, Rejoin};
use crate::runtime::records::{DeadLetterReason, DeadLetterRecord, JobState};
use crate::runtime::records::{DedupEntry, JobRecord, SequenceRecord, VerificationState};
use crate::runtime::store::{FastMap, Staged, Store};
use crate::runtime::telemetry::{self, HubEvent, Restored};
use crate::subscriptions::table::SharedTable;

/// The stores backed by a changelog (`dedup_expiry` is a local index rebuilt on restore).
const CHANGELOGGED: [&str; 3] = [DEDUP, SEQUENCE, JOBS];
/// Where the dedup and sequence stores' records go on the one state changelog (the jobs
/// changelog, whose own keys start `j/`, `p/` or `h/`): the store key behind this prefix.
///
/// One changelog for all three stores, because the broker checks each partition a transaction
/// writes with the transaction coordinator before it appends (KIP-890, on by default): with a
/// changelog per store, a hub transaction wrote 24 partitions (dedup, sequence, jobs, attempts)
/// and that check was half the light-load latency (BENCHMARKS.md, session 13). The dedup and
/// sequence changelogs of earlier versions are still read at restore, before this one.
const DEDUP_ON_STATE_CHANGELOG: &[u8] = b"d/";
const SEQUENCE_ON_STATE_CHANGELOG: &[u8] = b"s/";

/// A dedup or sequence store key as it is written to the state changelog.
fn on_state_changelog(prefix: &[u8], key: &[u8]) -> Vec<u8> {
    [prefix, key].concat()
}

/// The store family and store key of a state changelog record's key.
fn from_state_changelog(key: &[u8]) -> (&'static str, &[u8]) {
    if let Some(k) = key.strip_prefix(DEDUP_ON_STATE_CHANGELOG) {
        (DEDUP, k)
    } else if let Some(k) = key.strip_prefix(SEQUENCE_ON_STATE_CHANGELOG) {
        (SEQUENCE, k)
    } else {
        (JOBS, key)
    }
}
/// Every store family of a hub task (open a task's RocksDB with all of them).
pub const FAMILIES: [&str; 5] = [DEDUP, DEDUP_EXPIRY, SEQUENCE, JOBS, DUE];
const TXN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an abort may keep being retried while a partition leader fails over.
const ABORT_PATIENCE: Duration = Duration::from_secs(60);
/// How long a commit that timed out may keep being retried, from its first call (with an abort
/// after it, inside `STREAMING_HUB_STALL_TIMEOUT`'s default of 120 s).
const COMMIT_PATIENCE: Duration = Duration::from_secs(45);
/// How long a loop whose offsets the coordinator refused for their generation waits for its
/// consumer to join the next one before it runs the batch again (see the loop's abort path).
const NEXT_GENERATION_PATIENCE: Duration = Duration::from_secs(1);
/// After such a refusal: at most this many runs again, within this long of it, each one after
/// the first this much later than the one before.
const RERUNS: u32 = 3;
const RERUN_WINDOW: Duration = Duration::from_secs(2);
const RERUN_PAUSE: Duration = Duration::from_millis(50);
/// `STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS`: whether its one held transaction has been.
static STALE_OFFSETS_HELD: AtomicBool = AtomicBool::new(false);
/// The longest it holds: well inside the producers' `transaction.timeout.ms` (60 s).
const STALE_OFFSETS_HOLD: Duration = Duration::from_secs(45);
/// How long a loop that found no due job waits before it looks again (claims only).
const QUIET_CLAIMS: Duration = Duration::from_millis(50);
/// Shortest gap between two transactions that carry only outcomes and claims (no inbox records).
const TXN_PACE: Duration = Duration::from_millis(25);
/// Longest a hub batch stays open while deliveries are under way.
const BUSY_BATCH: Duration = Duration::from_millis(20);
/// A batch with records closes after this long without a new one.
const QUIET_GAP: Duration = Duration::from_millis(5);
/// How often the due-job backlog gauges are sampled, how many tenants they name, and how many
/// due jobs are counted per tenant at most.
const BACKLOG_EVERY: Duration = Duration::from_secs(10);
const BACKLOG_CAP: usize = 100_000;
/// Expired dedup entries purged per task per batch beyond those the batch writes (bounded work,
/// never a full scan; at least as many purged as written, so the store does not grow for good
/// under batches that write more than this each).
const EXPIRY_PER_BATCH: usize = 500;
/// How long a due job waits, unattempted, while its destination's verification is pending.
const VERIFY_HOLD_MS: i64 = 60_000;
/// A job's `last_error` for an attempt spent without a request: verification failed.
const UNVERIFIED: &str = "the destination failed its verification; no request was sent";

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error("store: {0}")]
    Store(#[from] crate::runtime::store::StoreError),
    #[error("codec: {0}")]
    Codec(String),
    #[error("restoring partition {partition}: {why}")]
    Restore { partition: i32, why: String },
    #[error(
        "fenced: another process has this instance's transactional id or group instance id (a \
         newer incarnation of it, or another instance with the same STREAMING_HUB_INSTANCE_ID), \
         or the broker aborted a transaction open past its 60 s timeout (a broker that slow); the process restarts and the partitions' leases are reclaimed: {0}"
    )]
    Fenced(String),
    /// A commit still running after its patience (`kafka::commit_undecided`): no abort may
    /// interrupt it, so the loop stops and the process restarts.
    #[error("a transaction commit did not finish: {0}")]
    Undecided(String),
    /// Every batch aborted for `STREAMING_HUB_STALL_TIMEOUT` (`kafka::AbortStreak`).
    #[error("the hub loop committed nothing for the stall timeout: {0}")]
    Stuck(String),
    /// Nothing to do this round (no transaction was opened).
    #[error("idle")]
    Idle,
    #[error("jobs: {0}")]
    Jobs(#[from] crate::dispatch::jobs::JobError),
    /// A record of a partition the loop has no stores for (never expected): the loop stops.
    #[error(
        "a record at offset {offset} of inbox partition {partition}, which this loop has no stores for"
    )]
    Unowned { partition: i32, offset: i64 },
}

/// An accepted, deduplicated, sequenced event, as the next stage receives it.
pub struct SequencedEvent<'a> {
    pub tenant: &'a str,
    pub ce_id: &'a str,
    pub sequence: u64,
    pub partition: i32,
    pub offset: i64,
    /// Processed again after an offset reset.
    pub replay: bool,
    pub record: &'a BorrowedMessage<'a>,
    /// The record's place in the transaction's batch.
    pub batch_index: usize,
}

/// The narrow hand-off to matching and jobs: called for each event inside the transaction.
pub trait EventHandler: Send {
    fn on_event(
        &mut self,
        event: &SequencedEvent<'_>,
        out: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError>;

    /// How many jobs the event would create at most (read while a batch fills, to bound the
    /// memory one transaction holds); 0 by default.
    fn weight(&self, _record: &BorrowedMessage<'_>) -> usize {
        0
    }

    /// A new batch starts filling: what `weight` kept for the last one may go.
    fn batch_started(&self) {}

    /// A redelivery request for one subscription (see `ops::redeliver`); ignored by default.
    fn on_redeliver(
        &mut self,
        _event: &SequencedEvent<'_>,
        _subscription_id: &str,
        _out: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        Ok(())
    }
}

/// Nothing downstream (this issue's state: matching plugs in here).
pub struct NoHandler;

impl EventHandler for NoHandler {
    fn on_event(
        &mut self,
        _: &SequencedEvent<'_>,
        _: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        Ok(())
    }
}

/// What a handler may write: records into the open transaction.
pub struct Outputs<'a> {
    producer: &'a BaseProducer<TrackingContext>,
}

impl Outputs<'_> {
    pub fn send(
        &mut self,
        topic: &str,
        partition: Option<i32>,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), HubError> {
        let mut r = BaseRecord::<[u8], [u8]>::to(topic).key(key);
        if let Some(v) = value {
            r = r.payload(v);
        }
        if let Some(p) = partition {
            r = r.partition(p);
        }
        kafka::send_waiting(self.producer, r).map_err(|e| HubError::Kafka(e.into()))
    }

    /// Sends a record with headers into the open transaction.
    pub fn send_with_headers(
        &mut self,
        topic: &str,
        partition: Option<i32>,
        key: &[u8],
        value: Option<&[u8]>,
        headers: &[(&str, Option<&[u8]>)],
    ) -> Result<(), HubError> {
        let mut h = OwnedHeaders::new_with_capacity(headers.len());
        for (k, v) in headers {
            h = h.insert(Header { key: k, value: *v });
        }
        let mut r = BaseRecord::<[u8], [u8]>::to(topic).key(key).headers(h);
        if let Some(v) = value {
            r = r.payload(v);
        }
        if let Some(p) = partition {
            r = r.partition(p);
        }
        kafka::send_waiting(self.producer, r).map_err(|e| HubError::Kafka(e.into()))
    }

    /// Sends `record` as it is into the open transaction.
    pub fn send_record(&mut self, record: BaseRecord<'_, [u8], [u8]>) -> Result<(), HubError> {
        kafka::send_waiting(self.producer, record).map_err(|e| HubError::Kafka(e.into()))
    }
}

/// What a handler sees of its task inside the transaction.
pub struct TaskCtx<'a, 'p> {
    pub out: &'a mut Outputs<'p>,
    pub store: &'a Store,
    pub staged: &'a mut Staged,
    pub ring: &'a mut TenantRing,
    pub codec: &'a Codec,
    pub now: i64,
    /// Jobs created in this transaction (claimed at its end when there is room).
    pub fresh: &'a mut Vec<Fresh>,
    /// The event's new jobs take the committed-claim path: see [`Task::careful_until`].
    pub careful: bool,
    /// The event's new jobs start with one reclaim counted: see [`Task::recount`].
    pub recount: bool,
}

/// A job created in this transaction.
pub struct Fresh {
    pub key: Vec<u8>,
    /// The batch index of its event's record.
    pub batch_index: usize,
    /// Its first attempt may start before the transaction commits: the event is new (its keys
    /// were never stored, so a job delivered within the transaction need write nothing) and not
    /// read on the committed-claim path ([`Task::careful_until`]).
    pub early: bool,
}

impl TaskCtx<'_, '_> {
    /// The task's job store, writing into this transaction.
    pub fn jobs(&mut self) -> JobStore<'_> {
        JobStore {
            store: self.store,
            staged: self.staged,
            codec: self.codec,
        }
    }
}

/// A task: the stores of one inbox partition, and the tenants with timers in them.
struct Task {
    store: Store,
    ring: TenantRing,
    /// The inbox offset to commit for this partition in a transaction that read none of its
    /// records (the committed offset at assignment, then each commit's): every transaction that
    /// writes this task's state carries an offset of its partition, so the group generation
    /// fences it. Without it a claim-only transaction of an instance that had lost the partition
    /// (a session that ran out while it was busy) still committed after the new owner restored,
    /// and the jobs it released were never seen again (found by the fault suite).
    next_offset: Option<i64>,
    /// Records below this inbox offset take the committed-claim path: their attempts start
    /// after the transaction that claims them has committed. Past it, a new event's first
    /// attempts start before (`STREAMING_HUB_EARLY_ATTEMPT_WAIT`). A crash during such an attempt
    /// leaves nothing committed of it, so the records a previous owner may have been attempting
    /// ([`Recount`]) take that path too, where a crash mid-attempt is counted towards poison;
    /// so do the records of a batch that aborted, and every record of a partition the group
    /// never committed until this owner's first commit (`i64::MAX` until then: an owner that
    /// died in its first transaction cannot be told from none).
    careful_until: i64,
    /// The records a previous owner may have been attempting: their new jobs start with one
    /// reclaim, the attempt that owner may have died in (so a poison event is dead-lettered
    /// after `STREAMING_HUB_POISON_THRESHOLD` crashes, as with committed claims).
    recount: Recount,
    /// The newest ingest time of the records read since the task started or its last abort:
    /// how far the dedup purge may go (see [`purge_expired`]). None: nothing purged yet.
    read_through_ms: Option<i64>,
    /// A dedup expiry key no live one sorts before, as of the last commit: the purge seeks here
    /// (see [`purge_expired`]). Empty: from the start, as after a restore.
    purged_to: Vec<u8>,
}

impl Task {
    /// A task over a store just opened and restored: nothing committed or claimed by it yet.
    fn fresh(store: Store) -> Task {
        Task {
            store,
            ring: TenantRing::default(),
            next_offset: None,
            careful_until: i64::MAX,
            recount: Recount::none(0),
            read_through_ms: None,
            purged_to: Vec::new(),
        }
    }
}

/// The records a partition's previous owner may have been attempting without a committed claim:
/// those of its last open batch, at most `STREAMING_HUB_HUB_BATCH_MAX` records (counted as
/// read: transaction markers and aborted records take offsets too) from the committed offset,
/// among those already in the log when the partition was assigned.
#[derive(Clone, Debug)]
struct Recount {
    /// The offsets counted so far: from the committed offset to past the last record counted.
    seen: std::ops::Range<i64>,
    /// Records still to count.
    left: usize,
    /// The high watermark at the assignment (`i64::MAX` when it could not be read).
    until: i64,
}

impl Recount {
    fn none(at: i64) -> Recount {
        Recount {
            seen: at..at,
            left: 0,
            until: at,
        }
    }

    /// Whether the record at `offset` lies in the window, counting it if it is the next one.
    /// Records come in offset order; one read again after an abort is not counted twice.
    fn take(&mut self, offset: i64) -> bool {
        if offset >= self.seen.end && offset < self.until && self.left > 0 {
            self.seen.end = offset + 1;
            self.left -= 1;
        }
        self.seen.contains(&offset)
    }
}

/// Names and settings every task shares.
#[derive(Clone)]
struct Env {
    config: Config,
    codec: Arc<Codec>,
    inbox: String,
    dedup_changelog: String,
    sequence_changelog: String,
    jobs_changelog: String,
    attempts: String,
    dlq: String,
    control: String,
    /// Where an inbox record that is not an ingest output goes (see [`quarantine_invalid`]).
    quarantine: String,
}

impl Env {
    /// The changelog a family is restored from and its store offset counts in: the jobs family's
    /// is the state changelog, written for all three families; dedup's and sequence's are the
    /// ones earlier versions wrote, only read (see `DEDUP_ON_STATE_CHANGELOG`).
    fn changelog_of(&self, family: &str) -> &str {
        match family {
            DEDUP => &self.dedup_changelog,
            JOBS => &self.jobs_changelog,
            _ => &self.sequence_changelog,
        }
    }
}

#[derive(Default)]
struct Shared {
    tasks: HashMap<i32, Task>,
    revoked: HashSet<i32>,
    fatal: Option<HubError>,
    /// Partitions assigned to this loop and not restored yet (paused meanwhile), with where
    /// each starts: the restores under way (one per assignment), then those waiting for one.
    restores: Vec<RestoreJob>,
    to_restore: BTreeMap<i32, Start>,
    /// The loop has ended: an assignment served while its consumer closes starts no restore.
    stopped: bool,
    /// The loop's dispatch, here only while the loop polls for records (the rebalance callbacks
    /// run inside those polls): a revocation then commits the outcomes of the partitions given
    /// up before they go (see `HubContext::commit_given_up`).
    dispatch: Option<Dispatch>,
}

impl Shared {
    fn restoring(&self) -> usize {
        self.to_restore.len()
            + self
                .restores
                .iter()
                .map(|j| j.partitions.len())
                .sum::<usize>()
    }
}

/// Where a partition taken by this loop starts: the offset its records are read from once it
/// is restored, and its fence offset (`Task::next_offset`).
#[derive(Clone, Debug)]
struct Start {
    from: Offset,
    fence: Option<i64>,
    /// See [`Task::careful_until`] and [`Task::recount`].
    careful_until: i64,
    recount: Recount,
}

/// A restore running in a thread of its own, so the loop goes on serving the partitions it has
/// (their records, timers and outcomes) while newly assigned ones catch up with their
/// changelogs. Its partitions stay paused until the loop takes the restored tasks.
struct RestoreJob {
    partitions: BTreeMap<i32, Start>,
    cancel: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<Vec<(i32, Task)>, HubError>>,
}

impl RestoreJob {
    fn start(env: &Env, partitions: BTreeMap<i32, Start>) -> Result<RestoreJob, HubError> {
        let cancel = Arc::new(AtomicBool::new(false));
        let (env, stop) = (env.clone(), cancel.clone());
        let parts: Vec<i32> = partitions.keys().copied().collect();
        let thread = std::thread::Builder::new()
            .name("hub-restore".into())
            .spawn(move || open_and_restore(&env, &parts, &stop).map(|(tasks, _)| tasks))
            .map_err(|e| HubError::Restore {
                partition: first_of(&partitions),
                why: format!("restore thread not started: {e}"),
            })?;
        Ok(RestoreJob {
            partitions,
            cancel,
            thread,
        })
    }

    /// Asks the restore to stop (it looks at the flag between steps).
    fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Stops the restore and waits for its thread, which closes the stores it opened (another
    /// loop or the next restore may open them at once). Returns its partitions. The wait beats
    /// the calling loop's liveness for up to [`STOP_PATIENCE`] (a step between two looks at the
    /// cancel flag, opening a store or a watermark request, can take seconds); a thread stuck
    /// for longer lets the watchdog restart the process.
    fn stop(self) -> BTreeMap<i32, Start> {
        self.cancel();
        let asked = Instant::now();
        while !self.thread.is_finished() {
            if asked.elapsed() < STOP_PATIENCE {
                crate::runtime::liveness::beat_current();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        match self.thread.join() {
            Ok(Ok(_)) | Ok(Err(HubError::Kafka(KafkaError::Cancelled))) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "restore of partitions given up ended in an error")
            }
            Err(_) => tracing::error!("restore thread panicked"),
        }
        self.partitions
    }
}

/// The partition a restore's error names: its first (-1 for none).
fn first_of(partitions: &BTreeMap<i32, Start>) -> i32 {
    partitions.keys().next().copied().unwrap_or(-1)
}

/// How long a loop waits for a restore it stopped while still counting as alive.
const STOP_PATIENCE: Duration = Duration::from_secs(60);

/// Moves the process-wide count of partitions being restored by `to - from` (the gauge set
/// under the same lock, so two loops cannot leave it at an older count).
fn restoring_moved(from: usize, to: usize) {
    static GAUGE: Mutex<()> = Mutex::new(());
    let _order = GAUGE.lock().unwrap_or_else(|p| p.into_inner());
    let n = if to >= from {
        RESTORING.fetch_add(to - from, Ordering::SeqCst) + (to - from)
    } else {
        RESTORING.fetch_sub(from - to, Ordering::SeqCst) - (from - to)
    };
    telemetry::restoring(n);
}

struct HubContext {
    env: Env,
    shared: Arc<Mutex<Shared>>,
    /// The loop's transactional producer (a revocation commits with it, inside the callback).
    producer: Arc<BaseProducer<TrackingContext>>,
    clock: SharedClock,
    router: Arc<OutcomeRouter>,
    stage: usize,
    /// The membership of the last rebalance callback (see `kafka::member_metadata`).
    membership: kafka::ConfirmedMembership,
    /// The group generation of the last offsets the loop sent (a refused batch runs again only
    /// under a later one).
    offsets_generation: std::sync::atomic::AtomicI32,
    /// The process's stop flag: an assignment that waits for stable offsets gives up once set.
    stop: Arc<AtomicBool>,
}

impl ClientContext for HubContext {
    fn stats_raw(&self, statistics: &[u8]) {
        telemetry::lag_from_stats("hub", statistics);
    }
}

/// Partitions being restored now, in this process (`/readyz` answers 503 while it is not zero).
pub static RESTORING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Hands attempt outcomes between the hub loops of one process. An attempt's outcome returns to
/// the loop that claimed it; when that loop no longer owns the job's partition (a rebalance
/// moved it, e.g. to a loop that joined later), the outcome goes to the local loop that owns it
/// now, which commits it: the attempt is not sent a second time after its lease. An outcome of
/// a partition no local loop owns yet is parked until one takes it, even past its lease (a slow
/// restore or a wait for an open transaction can outlast it): the new owner's outcome check
/// (`jobs::apply_outcome`: the job still leased for that attempt and lease) records it if no
/// reclaim came first, and refuses it otherwise, so the job is not sent again for nothing.
/// Parked outcomes go [`PARKED_FOR`] after their lease: by then the partition went to another
/// instance, which resends the job after its lease (at-least-once).
#[derive(Default)]
pub struct OutcomeRouter {
    state: Mutex<RouterState>,
}

/// How long past its lease a parked outcome waits for a local loop to take its partition.
const PARKED_FOR: i64 = 10 * 60 * 1000;

#[derive(Default)]
struct RouterState {
    owners: HashMap<i32, usize>,
    loops: HashMap<usize, std::sync::mpsc::Sender<Outcome>>,
    parked: HashMap<i32, Vec<Outcome>>,
}

impl OutcomeRouter {
    /// Registers loop `stage`; outcomes handed to it arrive on the returned receiver.
    pub fn join(&self, stage: usize) -> std::sync::mpsc::Receiver<Outcome> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.lock().loops.insert(stage, tx);
        rx
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RouterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `stage` owns `partitions` now: outcomes parked for them go to it.
    fn took(&self, stage: usize, partitions: &[i32]) {
        let mut st = self.lock();
        for p in partitions {
            st.owners.insert(*p, stage);
            let parked = st.parked.remove(p).unwrap_or_default();
            if let Some(tx) = st.loops.get(&stage) {
                for o in parked {
                    let _ = tx.send(o);
                }
            }
        }
    }

    /// `stage` gave `partitions` up.
    fn gave_up(&self, stage: usize, partitions: &[i32]) {
        let mut st = self.lock();
        for p in partitions {
            if st.owners.get(p) == Some(&stage) {
                st.owners.remove(p);
            }
        }
    }

    /// An outcome its own loop cannot record (not the partition's owner): to the owner, or
    /// parked. Parked outcomes [`PARKED_FOR`] past their lease are dropped on the way.
    fn hand_over(&self, from: usize, o: Outcome, now: i64) {
        let mut st = self.lock();
        match st.owners.get(&o.partition).copied() {
            Some(owner) if owner != from => {
                if let Some(tx) = st.loops.get(&owner) {
                    let _ = tx.send(o);
                }
            }
            Some(_) => {} // its own loop owns it again: recorded there already
            None => {
                let kept = |o: &Outcome| o.lease_until.saturating_add(PARKED_FOR) > now;
                st.parked.values_mut().for_each(|v| v.retain(kept));
                st.parked.retain(|_, v| !v.is_empty());
                if kept(&o) {
                    st.parked.entry(o.partition).or_default().push(o);
                }
            }
        }
    }
}

impl HubContext {
    /// On revocation (in order, not lost): waits up to `STREAMING_HUB_REBALANCE_WAIT` for the
    /// attempts in flight of the partitions given up, then commits every outcome taken so far in
    /// one last transaction while this loop still owns them (DESIGN.md: "on revocation it
    /// commits and closes"). Without it, their outcomes were dropped: the next owner sent those
    /// events again after their leases, and counted the attempts towards poison. An attempt still
    /// in flight then, or a commit that fails, leaves its job to the next owner as before
    /// (at-least-once); the failed transaction is aborted.
    fn commit_given_up(&self, consumer: &BaseConsumer<Self>, shared: &mut Shared, parts: &[i32]) {
        let Shared {
            tasks,
            dispatch,
            fatal,
            ..
        } = shared;
        let Some(d) = dispatch.as_mut() else {
            return; // not polling for records (stopping): drained by `drain_on_stop`
        };
        if fatal.is_some() {
            return; // the loop stops after this poll
        }
        if !parts.iter().any(|p| tasks.contains_key(p)) {
            return;
        }
        let deadline = Instant::now() + self.env.config.rebalance_wait;
        let waited = Instant::now();
        let mut said = false;
        loop {
            crate::runtime::liveness::beat_current();
            d.drain();
            d.take_handed();
            let left: usize = parts.iter().map(|p| d.in_flight_of(*p)).sum();
            if left == 0 {
                break;
            }
            let Some(rest) = deadline.checked_duration_since(Instant::now()) else {
                tracing::warn!(
                    in_flight = left,
                    "partitions given up with attempts still in flight: their next owner sends them again after their leases"
                );
                break;
            };
            if !said {
                tracing::info!(
                    in_flight = left,
                    "partitions given up: waiting for their attempts in flight"
                );
                said = true;
            }
            if let Ok(o) = d.done_rx.recv_timeout(rest.min(Duration::from_millis(100))) {
                d.ended(o);
            }
        }
        if !d.pending.iter().any(|o| parts.contains(&o.partition)) {
            return;
        }
        let now = self.clock.now_ms();
        d.hand_over(tasks, &self.router, now);
        let producer = &*self.producer;
        let staging = telemetry::Staging::begin();
        let committed = (|| {
            producer.begin_transaction().map_err(fatal_or_kafka)?;
            d.breakers.begin();
            let _ = producer.context().take();
            let mut staged: HashMap<i32, Staged> = HashMap::new();
            let mut outputs = Outputs { producer };
            record_outcomes(&self.env, d, tasks, &mut staged, &mut outputs, now, 0)?;
            let mut offsets = HashMap::new();
            fence_offsets(tasks, &mut offsets);
            send_offsets(&self.env, producer, consumer, &offsets, &mut |_| {}, false)?;
            let delivered =
                write_jobs_and_commit(&self.env, producer, &staged, &mut outputs, &mut |_| {})?;
            telemetry::committed();
            d.breakers.commit();
            apply_committed(&self.env, tasks, staged, &offsets, &delivered)
        })();
        staging.end(counts_as_committed(&committed));
        match committed {
            Ok(()) => {
                tracing::info!(
                    outcomes = d.pending.len(),
                    waited_ms = waited.elapsed().as_millis() as u64,
                    "outcomes of partitions given up committed"
                );
                d.pending.clear();
            }
            Err(e) => {
                tracing::warn!(error = %e, "outcomes of partitions given up not committed; their next owner sends them again after their leases");
                if let HubError::Fenced(_) | HubError::Undecided(_) = e {
                    fatal.get_or_insert(e);
                } else if let Err(abort) = abort_and_forget(producer) {
                    fatal.get_or_insert(fatal_or_kafka(abort));
                }
                d.breakers.rollback();
                for task in tasks.values_mut() {
                    task.ring.aborted();
                }
            }
        }
    }
}

impl ConsumerContext for HubContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let beat = crate::runtime::liveness::beat_current;
        let stopping = || self.stop.load(Ordering::Relaxed);
        kafka::rebalance_at_committed(
            self,
            consumer,
            err,
            tpl,
            &beat,
            &stopping,
            &self.membership,
            |e| {
                tracing::error!(error = %e, "assigned partitions could not be started");
                self.shared.lock().unwrap_or_else(|p| p.into_inner()).fatal =
                    Some(fatal_or_kafka(e));
            },
        );
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Given up in order (not lost to a session timeout): nobody else wrote these
            // partitions' changelogs while we held them, so their stores are current now.
            let current = !consumer.assignment_lost();
            let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
            if current {
                self.commit_given_up(consumer, &mut shared, &parts);
            }
            let restoring = shared.restoring();
            // A restore that includes a partition given up stops here, its stores closed before
            // the callback returns (the next owner may be another loop of this process); its
            // other partitions wait for the next one.
            let (stopped, going): (Vec<RestoreJob>, Vec<RestoreJob>) =
                std::mem::take(&mut shared.restores)
                    .into_iter()
                    .partition(|j| parts.iter().any(|p| j.partitions.contains_key(p)));
            shared.restores = going;
            stopped.iter().for_each(RestoreJob::cancel); // all at once, then each waited for
            for job in stopped {
                let back = job.stop();
                shared.to_restore.extend(back);
            }
            for p in &parts {
                shared.to_restore.remove(p);
            }
            restoring_moved(restoring, shared.restoring());
            for p in &parts {
                // Dropping the task closes its RocksDB.
                let stamped = match shared.tasks.remove(p) {
                    Some(task) if current => task.store.stamp(now_ms()),
                    _ => Ok(()),
                };
                if let Err(e) = stamped {
                    tracing::warn!(partition = p, error = %e, "could not stamp a store given up");
                }
                shared.revoked.insert(*p);
            }
            self.router.gave_up(self.stage, &parts);
            telemetry::partitions_owned(self.stage, &parts, false);
            telemetry::lag_gone(
                "hub",
                tpl.elements().iter().map(|e| (e.topic(), e.partition())),
            );
            telemetry::Rebalance {
                stage: "hub",
                kind: "revoke",
                partitions: &format!("{parts:?}"),
            }
            .emit();
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
            telemetry::Rebalance {
                stage: "hub",
                kind: "assign",
                partitions: &format!("{parts:?}"),
            }
            .emit();
            // Restored in a thread started here (`RestoreJob`): the loop keeps serving the
            // partitions it has meanwhile, and a long restore cannot hold the poll past
            // `max.poll.interval.ms`. Paused until then: no record of a partition is processed
            // before its stores are current.
            if let Err(e) = consumer.pause(tpl) {
                tracing::error!(error = %e, "assigned partitions could not be paused for their restore");
                self.shared.lock().unwrap_or_else(|p| p.into_inner()).fatal =
                    Some(fatal_or_kafka(e));
                return;
            }
            // The committed offsets come first (`kafka::rebalance_at_committed` reads them as
            // stable and starts the partitions there): the broker holds them back while a
            // transaction that carries an offset of these partitions is still open (a previous
            // owner's), and every transaction that writes a task's state carries one
            // (`Task::next_offset`). Restoring before they are stable could miss that
            // transaction's changelog records, which may not even have reached the brokers yet
            // (a tenant sequence number given twice, found by the fault suite).
            // A partition the group never committed (a new group, offsets expired) starts at
            // its low watermark, which then fences claim-only transactions like a committed
            // offset would.
            let starts: Vec<(i32, Start)> = tpl
                .elements()
                .iter()
                .map(|e| {
                    // Up to two 5 s reads per partition: a slow broker with many partitions
                    // assigned would otherwise outlast the stall timeout without a beat.
                    crate::runtime::liveness::beat_current();
                    let fence = match e.offset() {
                        Offset::Offset(o) => o,
                        // If the watermark cannot be read, 0: committed below the log start it
                        // means the log start (`auto.offset.reset` is earliest).
                        _ => consumer
                            .fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(5))
                            .map(|(low, _)| low)
                            .unwrap_or_else(|err| {
                                tracing::warn!(partition = e.partition(), error = %err, "low watermark not read; the partition's fence offset is 0");
                                0
                            }),
                    };
                    // See `Recount`. Only past a committed offset: a partition the group never
                    // committed takes the committed-claim path until this owner's first commit.
                    let (careful_until, recount) = match e.offset() {
                        Offset::Offset(_) => {
                            let until = consumer
                                .fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(5))
                                .map(|(_, high)| high)
                                .unwrap_or_else(|err| {
                                    tracing::warn!(partition = e.partition(), error = %err, "high watermark not read; the whole batch window past the committed offset takes the committed-claim path");
                                    i64::MAX
                                });
                            let recount = Recount {
                                seen: fence..fence,
                                left: self.env.config.hub_batch_max,
                                until,
                            };
                            (fence, recount)
                        }
                        _ => (i64::MAX, Recount::none(fence)),
                    };
                    let start = Start {
                        from: e.offset(),
                        fence: Some(fence),
                        careful_until,
                        recount,
                    };
                    (e.partition(), start)
                })
                .collect();
            let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            if shared.stopped {
                return;
            }
            let restoring = shared.restoring();
            shared.to_restore.extend(starts);
            let started = start_queued(&self.env, &mut shared);
            restoring_moved(restoring, shared.restoring());
            if let Err(e) = started {
                tracing::error!(error = %e, "restore of assigned partitions not started");
                shared.fatal = Some(e);
            }
        }
    }
}

/// Takes the tasks of finished restores (their partitions resume where they start) and starts a
/// restore of the assigned partitions waiting for one. Runs on the loop's thread, between polls:
/// rebalance callbacks, which also change what is restored, run on it too. Restores of
/// different assignments run side by side, so a partition that waits long for its changelog
/// (an open transaction at its end) holds back only those assigned with it.
fn advance_restores(
    env: &Env,
    consumer: &BaseConsumer<HubContext>,
    router: &OutcomeRouter,
    stage: usize,
) -> Result<(), HubError> {
    let mut shared = consumer
        .context()
        .shared
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if shared.restores.is_empty() && shared.to_restore.is_empty() {
        return Ok(());
    }
    let restoring = shared.restoring();
    let taken = take_restored(env, consumer, &mut shared, router, stage);
    let started = match taken {
        Ok(()) => start_queued(env, &mut shared),
        Err(e) => Err(e),
    };
    restoring_moved(restoring, shared.restoring());
    started
}

/// Starts a restore of the partitions waiting for one (all of them in one thread).
fn start_queued(env: &Env, shared: &mut Shared) -> Result<(), HubError> {
    if shared.to_restore.is_empty() {
        return Ok(());
    }
    let next = std::mem::take(&mut shared.to_restore);
    match RestoreJob::start(env, next.clone()) {
        Ok(job) => {
            shared.restores.push(job);
            Ok(())
        }
        Err(e) => {
            shared.to_restore = next;
            Err(e)
        }
    }
}

fn take_restored(
    env: &Env,
    consumer: &BaseConsumer<HubContext>,
    shared: &mut Shared,
    router: &OutcomeRouter,
    stage: usize,
) -> Result<(), HubError> {
    let (done, running): (Vec<RestoreJob>, Vec<RestoreJob>) = std::mem::take(&mut shared.restores)
        .into_iter()
        .partition(|j| j.thread.is_finished());
    shared.restores = running;
    for job in done {
        crate::runtime::liveness::beat_current(); // a seek below may take its 10 s
        let tasks = job.thread.join().unwrap_or_else(|_| {
            Err(HubError::Restore {
                partition: first_of(&job.partitions),
                why: "the restore thread panicked".into(),
            })
        });
        let tasks = match tasks {
            Ok(tasks) => tasks,
            Err(e) => {
                tracing::error!(error = %e, "restore failed");
                return Err(e);
            }
        };
        let mut from = TopicPartitionList::new();
        for (p, _) in &tasks {
            from.add_partition_offset(&env.inbox, *p, job.partitions[p].from)
                .map_err(KafkaError::from)?;
        }
        // Resumed first, then sought to where each starts: records fetched before the pause went
        // with it, and resuming alone would go on after them. The order matters: librdkafka's
        // fetcher looks at a partition again when a seek starts its fetch, not when a resume
        // clears its pause, so a seek before the resume left it waiting for the fetcher's next
        // round, a second later (measured: the first record 1.0 s after the resume, deliveries
        // after a restart resuming a second later). A seek that fails (a broker going away)
        // pauses the partitions again and restores them again (from their stores, so quickly).
        consumer.resume(&from).map_err(KafkaError::from)?;
        let seek_started = Instant::now();
        let sought = consumer
            .seek_partitions(from.clone(), Duration::from_secs(10))
            .and_then(|tpl| {
                tpl.elements().iter().try_for_each(|e| e.error())?;
                Ok(())
            });
        if let Err(e) = sought {
            tracing::warn!(error = %e, "restored partitions could not be sought to their start; restoring them again");
            consumer.pause(&from).map_err(KafkaError::from)?;
            drop(tasks); // closes their stores before they are opened again
            shared.to_restore.extend(job.partitions);
            continue;
        }
        let mut parts = Vec::with_capacity(tasks.len());
        for (p, mut task) in tasks {
            let start = &job.partitions[&p];
            task.next_offset = start.fence;
            task.careful_until = start.careful_until;
            task.recount = start.recount.clone();
            shared.tasks.insert(p, task);
            parts.push(p);
        }
        telemetry::partitions_owned(stage, &parts, true);
        router.took(stage, &parts);
        tracing::info!(
            partitions = ?parts,
            seek_ms = seek_started.elapsed().as_millis() as u64,
            "restored partitions resumed"
        );
    }
    Ok(())
}

/// Stops this loop's restores when the loop ends, however it ends, and marks it stopped: it is
/// dropped before the consumer, whose close may still serve an assignment, which then starts none.
struct StopRestores(Arc<Mutex<Shared>>);

impl Drop for StopRestores {
    fn drop(&mut self) {
        let mut shared = self.0.lock().unwrap_or_else(|p| p.into_inner());
        shared.stopped = true;
        let restoring = shared.restoring();
        let jobs = std::mem::take(&mut shared.restores);
        jobs.iter().for_each(RestoreJob::cancel);
        for job in jobs {
            job.stop();
        }
        shared.to_restore.clear();
        restoring_moved(restoring, 0);
    }
}

pub fn store_path(config: &Config, partition: i32) -> std::path::PathBuf {
    config
        .state_dir
        .join(&config.topic_prefix)
        .join(format!("hub-{partition}"))
}

/// Opens the stores of newly assigned partitions and brings them up to date with their
/// changelogs (one consumer for all of them) before any of their records is processed.
fn open_and_restore(
    env: &Env,
    partitions: &[i32],
    cancel: &AtomicBool,
) -> Result<(Vec<(i32, Task)>, u64), HubError> {
    // Another instance may have added holders to these stores' payloads since we last had them.
    jobs::payload_holds_moved();
    // A restore's records are read from now on: once it reaches the ends, the stores are as
    // current as this moment. Until then each keeps its own stamp (a restore cut short must not
    // make an old store look recent); a new or discarded one gets this moment.
    let restore_started = now_ms();
    let mut stamps = Vec::new();
    let mut tasks = Vec::new();
    let mut specs = Vec::new();
    for &partition in partitions {
        let path = store_path(&env.config, partition);
        std::fs::create_dir_all(&path).map_err(|e| HubError::Restore {
            partition,
            why: e.to_string(),
        })?;
        let (store, current_at) = open_when_free(&path, partition, cancel, STORE_HELD_PATIENCE)?;
        stamps.push(current_at.unwrap_or(restore_started));
        for family in CHANGELOGGED {
            specs.push((
                tasks.len(),
                family,
                changelog::RestoreSpec {
                    topic: env.changelog_of(family).to_string(),
                    partition,
                    after: None, // read from the store at each round below
                },
            ));
        }
        tasks.push((partition, Task::fresh(store)));
    }
    let mut tenants: Vec<std::collections::BTreeSet<String>> =
        vec![Default::default(); tasks.len()];
    // The dedup and sequence changelogs of earlier versions first, then the state changelog:
    // its records are newer than theirs for the same key (an entry written again after it
    // expired, a purge's tombstone). Once a store holds their ends, they add nothing.
    let (mut records, mut took) = (0, Duration::ZERO);
    // Each round restores every store from its own offsets; a store found ahead of its changelog
    // is discarded and the rounds start again (the others then read nothing new), so there are
    // at most as many rounds as stores, plus one.
    'rounds: loop {
        for (task_index, family, spec) in &mut specs {
            spec.after = tasks[*task_index].1.store.changelog_offset(family)?;
        }
        for legacy in [true, false] {
            let pass: Vec<usize> = (0..specs.len())
                .filter(|&i| (specs[i].1 != JOBS) == legacy)
                .collect();
            let plain: Vec<changelog::RestoreSpec> =
                pass.iter().map(|&i| specs[i].2.clone()).collect();
            let restored = changelog::restore(&env.config, &plain, cancel, |j, records| {
                let (task_index, family, _) = &specs[pass[j]];
                let store = &tasks[*task_index].1.store;
                let mut staged = Staged::default();
                for (key, value, _) in records {
                    if let Some(t) =
                        restore_one(store, &env.codec, &mut staged, family, key, *value)?
                    {
                        tenants[*task_index].insert(t);
                    }
                }
                let last = records.last().map(|r| r.2).unwrap_or_default();
                store
                    .apply_at(staged, &[(family, last)], stamps[*task_index])
                    .map_err(|e| e.to_string())
            });
            let stats = match restored {
                Ok(stats) => stats,
                Err(KafkaError::AheadOfChangelog {
                    spec,
                    topic,
                    partition,
                    stored,
                    end,
                }) => {
                    let task_index = specs[pass[spec]].0;
                    tracing::warn!(
                        partition,
                        topic,
                        stored_offset = stored,
                        changelog_end = end,
                        "local state is ahead of its changelog (the log lost its tail, or the \
                         topic was made again): discarded, restoring from the start"
                    );
                    metrics::counter!(STORES_AHEAD_DISCARDED).increment(1);
                    let (partition, task) = tasks.remove(task_index);
                    drop(task);
                    let store = discard_store(&store_path(&env.config, partition), partition)?;
                    tasks.insert(task_index, (partition, Task::fresh(store)));
                    stamps[task_index] = restore_started;
                    tenants[task_index].clear();
                    continue 'rounds;
                }
                Err(e @ KafkaError::Cancelled) => return Err(HubError::Kafka(e)),
                Err(e) => {
                    return Err(HubError::Restore {
                        partition: partitions.first().copied().unwrap_or(-1),
                        why: e.to_string(),
                    });
                }
            };
            records += stats.records;
            took += stats.took;
        }
        break;
    }
    Restored {
        partitions: partitions.len(),
        records,
        took,
    }
    .emit();
    for (_, task) in &tasks {
        task.store.stamp(restore_started)?;
    }
    for (i, (_, task)) in tasks.iter_mut().enumerate() {
        // Tenants with timers: from the restored tail, and from the store for the part before it.
        for t in &tenants[i] {
            task.ring.add(t);
        }
        let with_timers = jobs::tenants_with_timers(&task.store)?;
        tracing::debug!(
            tenants = with_timers.len(),
            restored = tenants[i].len(),
            "tenants with timers"
        );
        for t in with_timers {
            task.ring.add(&t);
        }
    }
    Ok((tasks, records))
}

/// How long a store may go unwritten and still restore from its offsets. A restore reads the
/// changelog after the store's offset: a key deleted there since (a job finished or dead-lettered
/// by the partition's owner meanwhile, a purged dedup entry) is deleted only while its tombstone
/// is on the compacted topic, which keeps it `delete.retention.ms` after cleaning it (the
/// topology pins 1 day). A store older than this comes back wrong (finished jobs delivered again),
/// so it is discarded and restored from the start. Half the tombstones' day leaves room for
/// clocks that disagree and a restore that takes its time.
pub const STALE_AFTER: Duration = Duration::from_secs(12 * 3600);

/// Wall-clock now, in ms since the epoch: stores' stamps are compared on the same host, and
/// with the brokers' real time, never the injected clock.
fn now_ms() -> i64 {
    use crate::runtime::clock::Clock;
    crate::runtime::clock::SystemClock.now_ms()
}

/// The newest modification time of the store's table files (ms since the epoch), for a store a
/// version before stamps wrote: RocksDB writes one at each flush (every clean close), never
/// touches them after, and rewrites other files when it opens. None: no table file.
fn newest_table_file_ms(path: &std::path::Path) -> Option<i64> {
    std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "sst"))
        .filter_map(|e| e.metadata().ok()?.modified().ok())
        .filter_map(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
        .max()
}

/// How long a restore waits for a store another loop of this process still holds.
const STORE_HELD_PATIENCE: Duration = Duration::from_secs(120);

/// [`open_current`], waiting while another loop of this process still holds the store (RocksDB
/// refuses a second open of one database in a process). With several hub loops, a partition can
/// move from a loop whose lost session's revocation is still queued (the loop is inside a slow
/// transaction call) to a sibling: the restore failed, the loop ended, and the process stopped.
/// The wait ends when the holder's revocation closes the store, at `cancel`, or after `patience`.
fn open_when_free(
    path: &std::path::Path,
    partition: i32,
    cancel: &AtomicBool,
    patience: Duration,
) -> Result<(Store, Option<i64>), HubError> {
    let since = Instant::now();
    loop {
        match open_current(path, partition) {
            Err(e) if is_held(&e, path) && since.elapsed() < patience => {
                // A second apart: each refused open also rotates the holder's RocksDB info log.
                for _ in 0..10 {
                    if cancel.load(Ordering::SeqCst) {
                        return Err(HubError::Kafka(KafkaError::Cancelled));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            done => return done,
        }
    }
}

/// Whether RocksDB refused to open the store at `path` because its lock file is held (by this
/// process: "lock hold by current process"; by another: "While lock file"), not for another
/// reason naming that file (permissions, no file handles left), which fails at once.
fn is_held(e: &HubError, path: &std::path::Path) -> bool {
    let text = e.to_string();
    text.contains(&format!("{}/LOCK", path.display()))
        && (text.contains("lock hold by current process") || text.contains("While lock file"))
}

/// Opens the store at `path`, discarding it first if it was last known current more than
/// [`STALE_AFTER`] ago. A store with offsets and no stamp (written by an earlier version) is
/// dated by its newest table file. The directory is renamed before it is deleted, so a crash
/// in between leaves no half-deleted database where a store is looked for.
/// Returns the store and the time it was last known current (None: empty or just discarded).
fn open_current(path: &std::path::Path, partition: i32) -> Result<(Store, Option<i64>), HubError> {
    let gone = |e: std::io::Error| HubError::Restore {
        partition,
        why: format!("discarding stale local state: {e}"),
    };
    let aside = path.with_extension("discarded");
    if aside.exists() {
        // Left by a crash between the rename and the delete below.
        std::fs::remove_dir_all(&aside).map_err(gone)?;
    }
    let table_files_ms = newest_table_file_ms(path);
    let store = match Store::open(path, &FAMILIES) {
        Ok(store) => store,
        // The local store is a cache of the changelogs: one RocksDB finds corrupt (a disk that
        // lost a write, a file cut short when the disk filled up) is rebuilt from them, not a
        // loop failing at every start (a crash loop until someone deletes it by hand).
        Err(crate::runtime::store::StoreError::Rocks(e))
            if e.kind() == rocksdb::ErrorKind::Corruption =>
        {
            // Deleted, not kept aside: a disk that filled up would have no room to restore.
            // RocksDB's error names the file at fault.
            tracing::error!(
                partition,
                path = %path.display(),
                error = %e,
                "local state is corrupt: deleted, restoring from the changelogs' start (a disk losing writes?)"
            );
            metrics::counter!(STORES_CORRUPT_DISCARDED).increment(1);
            return Ok((discard_store(path, partition)?, None));
        }
        Err(e) => return Err(e.into()),
    };
    if store.changelog_offset(JOBS)?.is_none() {
        return Ok((store, None));
    }
    let current_at = store.written_at()?.or(table_files_ms);
    let now = now_ms();
    if dated_current(current_at, now) {
        return Ok((store, current_at));
    }
    drop(store);
    let age_ms = current_at.map(|at| now.saturating_sub(at));
    if age_ms.is_some_and(|a| a < 0) {
        tracing::warn!(
            partition,
            ahead_s = age_ms.map(|a| -a / 1000),
            "local state stamped ahead of this clock (a clock that ran ahead, or was set back): its \
             age cannot be told, discarded, restoring from the start"
        );
    } else {
        tracing::info!(
            partition,
            age_h = age_ms.map(|a| a / 3_600_000),
            "local state older than tombstones are sure to stay on the changelog: discarded, restoring from the start"
        );
    }
    Ok((discard_store(path, partition)?, None))
}

/// How far ahead of this clock a store's stamp may be and still date it (a clock stepped back
/// by a time sync).
const STAMP_AHEAD_TOLERATED_MS: i64 = 5 * 60 * 1000;

/// Whether a store last known current at `at` (this host's wall clock, ms) may be restored from
/// its offsets at `now`: not older than [`STALE_AFTER`], and not stamped more than
/// [`STAMP_AHEAD_TOLERATED_MS`] ahead. A stamp further ahead was written by a clock running
/// ahead, so the store's true age is unknown: a store a day and a half old, stamped while the
/// clock ran two days ahead, read as fresh, and tombstones compacted away since brought
/// finished jobs back.
fn dated_current(at: Option<i64>, now: i64) -> bool {
    at.is_some_and(|at| {
        let age = now.saturating_sub(at);
        (-STAMP_AHEAD_TOLERATED_MS..=STALE_AFTER.as_millis() as i64).contains(&age)
    })
}

/// Stores RocksDB found corrupt at open, discarded and restored from their changelogs.
pub const STORES_CORRUPT_DISCARDED: &str = "streaming_hub_stores_corrupt_discarded_total";

/// Stores found ahead of their changelog and discarded (see [`KafkaError::AheadOfChangelog`]).
pub const STORES_AHEAD_DISCARDED: &str = "streaming_hub_stores_ahead_discarded_total";

/// Deletes the (closed) store at `path` and opens an empty one there. The directory is renamed
/// before it is deleted, so a crash in between leaves no half-deleted database where a store is
/// looked for ([`open_current`] removes what is left aside).
fn discard_store(path: &std::path::Path, partition: i32) -> Result<Store, HubError> {
    let gone = |e: std::io::Error| HubError::Restore {
        partition,
        why: format!("discarding local state: {e}"),
    };
    let aside = path.with_extension("discarded");
    std::fs::rename(path, &aside).map_err(gone)?;
    std::fs::remove_dir_all(&aside).map_err(gone)?;
    std::fs::create_dir_all(path).map_err(gone)?;
    Ok(Store::open(path, &FAMILIES)?)
}

/// Opens and restores the stores of `partitions`, then closes them; returns the records read.
/// For benchmarks and operators' tools (warming a state directory before a cut-over).
pub fn restore_only(
    config: &Config,
    codec: Arc<Codec>,
    partitions: &[i32],
) -> Result<u64, HubError> {
    let stage = HubStage::new(
        config,
        codec,
        Arc::new(crate::runtime::clock::SystemClock),
        Box::new(NoHandler),
    );
    open_and_restore(&stage.env, partitions, &AtomicBool::new(false)).map(|(_, records)| records)
}

/// Applies one changelog record to the staging, keeping the expiry index in step.
///
/// A record that is not what its key says (not Avro, a record of another kind, a job or dedup
/// entry that does not decode) is skipped, loudly: its key leaves the store as if deleted (a
/// job's is given a stand-in, [`stand_in_job`]), and `streaming_hub_restore_skipped_total`
/// counts it. Failing instead kept the partition from
/// coming up anywhere, the process exiting on every instance that took it. A record of a schema
/// this version does not know (written by a newer one, before a rollback) still fails the
/// restore: skipping those would drop live jobs.
fn restore_one(
    store: &Store,
    codec: &Codec,
    staged: &mut Staged,
    family: &'static str,
    key: &[u8],
    value: Option<&[u8]>,
) -> Result<Option<String>, String> {
    let (family, key) = match family {
        JOBS => from_state_changelog(key),
        legacy => (legacy, key),
    };
    let mut stand_in = None;
    let checked = match value.map(|v| check_state_record(codec, family, key, v)) {
        None => None,
        Some(Ok(c)) => Some(c),
        Some(Err(CodecError::UnknownFingerprint(f))) => {
            return Err(format!(
                "a {family} record of a schema this version does not know ({}): written by a \
                 newer version of the hub? run that version",
                CodecError::UnknownFingerprint(f)
            ));
        }
        Some(Err(e)) => {
            metrics::counter!(RESTORE_SKIPPED, "store" => family).increment(1);
            let shown = String::from_utf8_lossy(&key[..key.len().min(256)]).into_owned();
            match stand_in_job(codec, family, key) {
                Some((job, bytes)) => {
                    tracing::error!(store = family, key = %shown, error = %e, "a job record that does not decode is restored as a stand-in named by its key: pending, due now, from its first attempt (its tries so far are forgotten, so its receiver may get it again)");
                    stand_in = Some(bytes);
                    Some(Checked::Job(job))
                }
                None => {
                    tracing::error!(store = family, key = %shown, error = %e, "a state changelog record that does not decode is skipped: its key is dropped");
                    None
                }
            }
        }
    };
    let value = match &stand_in {
        Some(bytes) => Some(bytes.as_slice()),
        None => checked.as_ref().and(value),
    };
    let mut tenant = None;
    if family == JOBS && key.starts_with(b"j/") {
        if let Some(old) = staged.read(store, JOBS, key).map_err(|e| e.to_string())? {
            if let Ok(old) = crate::runtime::fast_avro::job(codec, &old) {
                staged.delete(DUE, jobs::due_key(&old.tenant_id, old.due_at, key));
            }
        }
        if let Some(Checked::Job(job)) = checked {
            staged.put(
                DUE,
                jobs::due_key(&job.tenant_id, job.due_at, key),
                Vec::new(),
            );
            tenant = Some(job.tenant_id);
        }
    } else if let Some(Checked::Expiry(expires_at)) = checked {
        // The previous entry's index key is not looked up: a stale expiry key is harmless (the
        // purge checks the entry's current expiry before deleting) and skipping the read keeps
        // restore fast.
        staged.put(DEDUP_EXPIRY, dedup::expiry_key(expires_at, key), Vec::new());
    }
    match value {
        Some(v) => staged.put(family, key.to_vec(), v.to_vec()),
        None => staged.delete(family, key.to_vec()),
    }
    Ok(tenant)
}

/// Restore counter of state changelog records skipped because they do not decode.
pub const RESTORE_SKIPPED: &str = "streaming_hub_restore_skipped_total";

/// What stands in for a job whose changelog record does not decode: its key names the tenant,
/// the event and the subscription, so the delivery is made again from its first attempt (or
/// dead-lettered `poison` with `payload_missing` when its payload is gone too), instead of
/// vanishing with only a counter to say so. None for any other key.
fn stand_in_job(codec: &Codec, family: &str, key: &[u8]) -> Option<(JobRecord, Vec<u8>)> {
    if family != JOBS {
        return None;
    }
    // `j/<tenant>\0<ce-id>\0<subscription>`: none of the three holds a control character (ingest
    // and the API refuse them), so each NUL is a separator; anything else names no job.
    let rest = std::str::from_utf8(key.strip_prefix(b"j/")?).ok()?;
    let mut parts = rest.split('\0');
    let (tenant_id, event_key, subscription_id) = (parts.next()?, parts.next()?, parts.next()?);
    let named = |p: &str| !p.is_empty() && !p.chars().any(char::is_control);
    if parts.next().is_some()
        || ![tenant_id, event_key, subscription_id]
            .into_iter()
            .all(named)
    {
        return None;
    }
    let (tenant_id, event_key, subscription_id) = (
        tenant_id.to_string(),
        event_key.to_string(),
        subscription_id.to_string(),
    );
    let job = JobRecord {
        event_key,
        subscription_id,
        tenant_id,
        attempt: 1,
        due_at: 0,
        lease_until: None,
        reclaims: 0,
        last_status: None,
        last_error: Some(JOB_UNDECODABLE.to_string()),
        state: JobState::Pending,
    };
    let bytes = crate::runtime::fast_avro::encode_job(codec, &job).ok()?;
    Some((job, bytes))
}

/// A restored job's `last_error` when its changelog record did not decode ([`stand_in_job`]).
pub const JOB_UNDECODABLE: &str = "job_record_undecodable";

/// What a restored state record turned out to be.
enum Checked {
    Job(JobRecord),
    /// A dedup entry and its expiry.
    Expiry(i64),
    Other,
}

/// Checks a state record against what its store and key say it is, by decoding it as the hub
/// will when it reads it (a record that passed on its header but not as a whole would fail every
/// batch that reads it instead).
fn check_state_record(
    codec: &Codec,
    family: &str,
    key: &[u8],
    value: &[u8],
) -> Result<Checked, CodecError> {
    use crate::runtime::records::HealthRecord;
    match family {
        DEDUP => match dedup::expires_at_fast(codec, value) {
            Some(t) => Ok(Checked::Expiry(t)),
            None => Ok(Checked::Expiry(
                codec
                    .decode::<DedupEntry>(RecordKind::DedupEntry, value)?
                    .expires_at,
            )),
        },
        SEQUENCE => codec
            .decode::<SequenceRecord>(RecordKind::Sequence, value)
            .map(|_| Checked::Other),
        JOBS if key.starts_with(b"j/") => {
            crate::runtime::fast_avro::job(codec, value).map(Checked::Job)
        }
        JOBS if key.starts_with(b"p/") => {
            crate::runtime::fast_avro::payload(codec, value).map(|_| Checked::Other)
        }
        JOBS if key.starts_with(b"h/") => codec
            .decode::<HealthRecord>(RecordKind::Health, value)
            .map(|_| Checked::Other),
        _ => Ok(Checked::Other),
    }
}

pub struct HubStage {
    env: Env,
    clock: SharedClock,
    handler: Box<dyn EventHandler>,
    dispatch: Option<Dispatch>,
    /// This loop's number within the instance (`STREAMING_HUB_HUB_STAGES`).
    stage: usize,
    /// Shared by the loops of this process (see [`OutcomeRouter`]).
    router: Arc<OutcomeRouter>,
    /// Outcomes other loops handed to this one (moved into the dispatch when the loop starts).
    handed: Option<std::sync::mpsc::Receiver<Outcome>>,
    /// How long the next batch stays open (follows this loop's transaction times).
    window: kafka::BatchWindow,
    /// Counted in `/readyz` until the loop is in its group (see [`Joining`]).
    joining: Option<Joining>,
}

/// The delivery side of the hub loop: claims due jobs, hands them to the workers after the claim
/// committed, and records their outcomes in the next transaction (a new event's first attempts
/// start before, and may be recorded in the same transaction: [`attempt_early`]).
pub struct Dispatch {
    pub table: SharedTable,
    pub workers: Workers,
    pub runtime: tokio::runtime::Handle,
    pub max_in_flight: usize,
    /// Most attempts of one tenant claimed and not finished (fairness: another tenant's next
    /// event waits behind at most this many of a backlogged tenant's attempts).
    pub max_in_flight_per_tenant: usize,
    /// `STREAMING_HUB_DISPATCH_WORKERS` (every loop's).
    workers_total: usize,
    in_flight_by_tenant: FastMap<String, TenantCap>,
    /// Attempts in flight per inbox partition (a partition given up waits for its own).
    in_flight_by_partition: FastMap<i32, usize>,
    /// Outcomes other loops of this process hand to this one (`OutcomeRouter`; taken from
    /// `HubStage` when the loop starts).
    handed: Option<std::sync::mpsc::Receiver<Outcome>>,
    pub lease_ms: i64,
    /// `STREAMING_HUB_EARLY_ATTEMPT_WAIT` in ms, part of `lease_ms`.
    early_ms: i64,
    pub poison_threshold: u32,
    done_tx: std::sync::mpsc::Sender<Outcome>,
    done_rx: std::sync::mpsc::Receiver<Outcome>,
    in_flight: usize,
    /// Event body bytes the attempts in flight hold, and the most they may
    /// (`STREAMING_HUB_DISPATCH_CLAIMS_AHEAD_BYTES`, split between the loops).
    in_flight_bytes: usize,
    max_in_flight_bytes: usize,
    breakers: breaker::Breakers,
    /// Subscriptions whose receiver asked the hub to wait (`Retry-After`).
    holds: breaker::Holds,
    /// Claim rounds so far (rotates which task claims first).
    round: usize,
    /// After a round that found nothing due, the next claim-only round waits until then (timers
    /// in the future must not cost a transaction every few milliseconds).
    quiet_until: Option<Instant>,
    /// Outcomes taken from the workers but not yet committed (kept across an abort).
    pending: Vec<Outcome>,
    /// The hub loop this dispatch belongs to (its part of the instance-wide gauges).
    stage: usize,
    /// Breaker origin per destination URL (see [`cached_origin`]).
    origins: FastMap<String, String>,
    /// Transactions left that start early attempts without waiting for them (see
    /// [`attempt_early`]).
    early_unwaited: u32,
    /// Attempts in flight per job, by a hash of its key (no key copied per attempt; two jobs
    /// with one hash only make an attempt wait for the other's, see [`Dispatch::launch`]).
    in_flight_jobs: FastMap<u64, u32>,
    /// Attempts launched while an earlier attempt of their job (by key hash) was still in
    /// flight: each waits for it, and takes its outcome when it delivered the same job.
    waiting: FastMap<u64, Vec<Attempt>>,
    /// Hashes job keys for the two maps above.
    job_hasher: foldhash::fast::RandomState,
    /// Deliveries that found no lease of theirs to record them on (their transaction aborted),
    /// by job key, with when they stop counting (see [`Dispatch::launch`]).
    unrecorded: FastMap<Vec<u8>, (i64, Outcome)>,
    /// Attempt times, and how far they let claims run ahead of the workers.
    pace: pace::Pace,
    /// Tenants waiting for a worker when this round of claims began.
    waiting_tenants: usize,
}

impl Dispatch {
    pub fn new(
        table: SharedTable,
        workers: Workers,
        runtime: tokio::runtime::Handle,
        config: &Config,
    ) -> Dispatch {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let timeout_ms = config.http_timeout.as_millis() as i64;
        // The attempt's timeout, 10 s to spare, and the early wait: a transaction's due claims
        // start after it commits, which the early wait can hold up to 30 s, and a worker hands
        // back an attempt with less than its timeout left (a 15 s early wait handed back every
        // due claim of a transaction that waited it out).
        let early_ms = config.early_attempt_wait.as_millis() as i64;
        let lease_ms = timeout_ms + 10_000 + early_ms;
        Dispatch {
            table,
            workers,
            runtime,
            // Claims run ahead of the workers (a claim costs a transaction; an attempt waits for
            // one of `STREAMING_HUB_DISPATCH_WORKERS` permits), bounded per tenant for fairness.
            // Bounded: every claim holds its payload in memory until its attempt ends.
            max_in_flight: match config.dispatch_claims_ahead {
                0 => (config.dispatch_workers * 64).min(4096),
                n => n,
            }
            .max(config.dispatch_workers * 4),
            max_in_flight_per_tenant: config.dispatch_workers * 4,
            workers_total: config.dispatch_workers,
            in_flight_by_tenant: FastMap::default(),
            in_flight_by_partition: FastMap::default(),
            handed: None,
            lease_ms,
            poison_threshold: config.poison_threshold,
            done_tx,
            done_rx,
            in_flight: 0,
            in_flight_bytes: 0,
            max_in_flight_bytes: config.dispatch_claims_ahead_bytes,
            breakers: breaker::Breakers::default(),
            holds: breaker::Holds::default(),
            round: 0,
            quiet_until: None,
            pending: Vec::new(),
            stage: 0,
            origins: FastMap::default(),
            early_unwaited: 0,
            in_flight_jobs: FastMap::default(),
            waiting: FastMap::default(),
            job_hasher: Default::default(),
            unrecorded: FastMap::default(),
            // Paced on the lease without the early wait, which the wait itself may have spent.
            pace: pace::Pace::new(config.dispatch_workers, 1, lease_ms - early_ms, timeout_ms),
            early_ms,
            waiting_tenants: 0,
        }
    }

    /// One of `stages` hub loops' dispatch: an equal share of the claims ahead (the workers
    /// are shared by every loop).
    pub fn for_stage(mut self, stage: usize, stages: usize) -> Dispatch {
        self.stage = stage;
        self.max_in_flight = self
            .max_in_flight
            .div_ceil(stages.max(1))
            .max(self.max_in_flight_per_tenant);
        self.max_in_flight_bytes = self.max_in_flight_bytes.div_ceil(stages.max(1));
        self.pace = pace::Pace::new(
            self.workers_total,
            stages,
            self.lease_ms - self.early_ms,
            self.workers.http_timeout_ms,
        );
        self
    }

    fn drain(&mut self) {
        while let Ok(o) = self.done_rx.try_recv() {
            self.ended(o);
        }
    }

    /// An attempt of this loop ended: its slot is free, its outcome waits to be recorded.
    fn ended(&mut self, o: Outcome) {
        // Only requests that went out tell how long the tenant's destinations take.
        if !o.not_attempted() && !o.sent_nothing() {
            self.pace.timed(&o.tenant, o.latency_ms);
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(o.body_bytes);
        if let Some(n) = self.in_flight_by_partition.get_mut(&o.partition) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight_by_partition.remove(&o.partition);
            }
        }
        if let Some(n) = self.in_flight_by_tenant.get_mut(&o.tenant) {
            n.attempts = n.attempts.saturating_sub(1);
            n.bytes = n.bytes.saturating_sub(o.body_bytes);
            if n.attempts == 0 {
                self.in_flight_by_tenant.remove(&o.tenant);
            }
        }
        let job = self.job_hasher.hash_one(&o.job_key);
        if let Some(n) = self.in_flight_jobs.get_mut(&job) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight_jobs.remove(&job);
            }
        }
        if let Some(next) = self.next_waiting(job) {
            match reused(&o, &next) {
                Some(taken) => {
                    telemetry::resend_avoided("waited");
                    let _ = self.done_tx.send(taken);
                }
                None => self
                    .workers
                    .spawn(&self.runtime, next, self.done_tx.clone()),
            }
        }
        self.pending.push(o);
    }

    /// The first attempt waiting for the attempt of `key` that just ended.
    fn next_waiting(&mut self, job: u64) -> Option<Attempt> {
        let list = self.waiting.get_mut(&job)?;
        let next = (!list.is_empty()).then(|| list.remove(0));
        if list.is_empty() {
            self.waiting.remove(&job);
        }
        next
    }

    /// Takes outcomes until every attempt of `keys` has ended, `until`, or `more_to_read` says
    /// records wait to be read; how many of them ended, and whether records cut the wait short.
    fn wait_for(
        &mut self,
        keys: &HashSet<Vec<u8>>,
        until: Instant,
        more_to_read: &dyn Fn() -> bool,
    ) -> (usize, bool) {
        let mut ended = 0;
        while ended < keys.len() {
            if more_to_read() {
                return (ended, true);
            }
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                break;
            };
            match self.done_rx.recv_timeout(left.min(EARLY_WAIT_SLICE)) {
                Ok(o) => {
                    if keys.contains(&o.job_key) {
                        ended += 1;
                    }
                    self.ended(o);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        (ended, false)
    }

    /// Outcomes other loops of this process handed over (their attempts, this loop's
    /// partitions now): recorded like its own, with no worker slot of its own to give back.
    fn take_handed(&mut self) {
        if let Some(rx) = &self.handed {
            self.pending.extend(rx.try_iter());
        }
    }

    /// Outcomes of partitions this loop no longer owns go to the loop that does.
    fn hand_over(&mut self, tasks: &HashMap<i32, Task>, router: &OutcomeRouter, now: i64) {
        if self
            .pending
            .iter()
            .all(|o| tasks.contains_key(&o.partition))
        {
            return;
        }
        let (mine, theirs): (Vec<Outcome>, Vec<Outcome>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|o| tasks.contains_key(&o.partition));
        self.pending = mine;
        for o in theirs {
            router.hand_over(self.stage, o, now);
        }
    }

    /// Attempts of inbox partition `p` in flight.
    fn in_flight_of(&self, p: i32) -> usize {
        self.in_flight_by_partition.get(&p).copied().unwrap_or(0)
    }

    /// Whether another claim fits, `claimed` bytes claimed so far in this transaction: under
    /// both bounds, and always when nothing is in flight (an event larger than the byte bound
    /// still gets its attempt, one at a time).
    fn may_claim(&self, claimed_bytes: usize) -> bool {
        let held = self.in_flight_bytes + claimed_bytes;
        self.in_flight < self.claims_limit() && (held == 0 || held < self.max_in_flight_bytes)
    }

    /// The most claims ahead now: the fixed bound, or less when attempts are slow enough that
    /// the workers would not start that many before their leases run short (see `pace`).
    fn claims_limit(&self) -> usize {
        self.pace.loop_limit(self.max_in_flight)
    }

    /// Starts the attempts of a transaction's claims; one of a job with an attempt in flight or
    /// a delivery not yet recorded (an event read again after its transaction aborted, its first
    /// attempt made early) takes that attempt's outcome when it delivered to the same URL
    /// instead of sending the event again: the receiver gets one request, and the attempt
    /// record is that request's. The first attempt's own outcome finds no lease of its own.
    fn launch(&mut self, attempts: Vec<Attempt>) {
        let now = self.workers.clock.now_ms();
        for a in attempts {
            let job = self.job_hasher.hash_one(&a.job_key);
            let earlier = self.in_flight_jobs.contains_key(&job);
            self.started(&a, job);
            let kept = match self.unrecorded.is_empty() {
                true => None,
                false => match self.unrecorded.remove(&a.job_key) {
                    Some((until, o)) if until > now => reused(&o, &a),
                    _ => None,
                },
            };
            if let Some(taken) = kept {
                telemetry::resend_avoided("delivered");
                let _ = self.done_tx.send(taken);
            } else if earlier {
                tracing::info!(
                    event_id = %a.event_id,
                    subscription_id = %a.subscription.id,
                    "a claim waits for its job's attempt still in flight (its transaction aborted)"
                );
                self.waiting.entry(job).or_default().push(a);
            } else {
                self.workers.spawn(&self.runtime, a, self.done_tx.clone());
            }
        }
    }

    fn started(&mut self, a: &Attempt, job: u64) {
        *self.in_flight_jobs.entry(job).or_default() += 1;
        self.in_flight += 1;
        *self.in_flight_by_partition.entry(a.partition).or_default() += 1;
        self.in_flight_bytes += a.event.body.len();
        let n = self
            .in_flight_by_tenant
            .entry(a.tenant.clone())
            .or_default();
        n.attempts += 1;
        n.bytes += a.event.body.len();
    }
}

impl HubStage {
    pub fn new(
        config: &Config,
        codec: Arc<Codec>,
        clock: SharedClock,
        handler: Box<dyn EventHandler>,
    ) -> HubStage {
        let p = &config.topic_prefix;
        HubStage {
            env: Env {
                config: config.clone(),
                codec,
                inbox: format!("{p}.inbox"),
                dedup_changelog: format!("{p}.hub.dedup.changelog"),
                sequence_changelog: format!("{p}.hub.sequence.changelog"),
                jobs_changelog: format!("{p}.hub.jobs.changelog"),
                attempts: format!("{p}.attempts"),
                dlq: format!("{p}.dlq"),
                control: format!("{p}.subscriptions"),
                quarantine: format!("{p}.quarantine"),
            },
            clock,
            handler,
            dispatch: None,
            stage: 0,
            router: Arc::new(OutcomeRouter::default()),
            handed: None,
            window: kafka::BatchWindow::new(),
            joining: None,
        }
    }

    /// Counts the loop as not yet in its group (`/readyz`) until it is.
    pub fn with_joining(mut self, joining: Joining) -> HubStage {
        self.joining = Some(joining);
        self
    }

    /// Makes this loop stage `stage` of its instance: its own consumer group member and
    /// transactional id (stage 0 keeps the names of an instance with a single loop).
    pub fn with_stage(mut self, stage: usize, router: Arc<OutcomeRouter>) -> HubStage {
        self.stage = stage.min(crate::config::MAX_HUB_STAGES - 1);
        self.handed = Some(router.join(self.stage));
        self.router = router;
        self
    }

    fn liveness(&self) -> &'static std::sync::atomic::AtomicI64 {
        &crate::runtime::liveness::HUB[self.stage]
    }

    /// Turns on delivery: due jobs are claimed and attempted by `dispatch`'s workers.
    pub fn with_dispatch(mut self, dispatch: Dispatch) -> HubStage {
        self.dispatch = Some(dispatch);
        self
    }

    /// Runs until `stop` is set or a fatal error; blocking (run it on its own thread).
    pub fn run(&mut self, stop: Arc<AtomicBool>) -> Result<(), HubError> {
        let config = self.env.config.clone();
        let instance = match self.stage {
            0 => config.instance(),
            k => format!("{}-{k}", config.instance()),
        };
        crate::runtime::liveness::run_on_this_thread(self.liveness());
        if let (Some(d), Some(rx)) = (self.dispatch.as_mut(), self.handed.take()) {
            d.handed = Some(rx);
        }
        // Matching and claims read the subscription table: before it has caught up with the
        // control topic (a restart), a new event would match nothing and a due job would look
        // like one of a deleted subscription, and both would be dropped. No partition is taken
        // until then.
        if let Some(d) = self.dispatch.as_ref().filter(|d| !d.table.is_caught_up()) {
            let waiting = metrics::gauge!("streaming_hub_hub_loops_waiting_for_subscriptions");
            waiting.increment(1.0);
            tracing::info!(hub_loop = %instance, "waiting for the subscription table to catch up before taking partitions");
            while !d.table.is_caught_up() && !stop.load(Ordering::Relaxed) {
                crate::runtime::liveness::beat(self.liveness());
                std::thread::sleep(Duration::from_millis(20));
            }
            waiting.decrement(1.0);
            if stop.load(Ordering::Relaxed) {
                // Stopped before it began: no beat left behind for the watchdog to call a stall
                // while the rest of the process shuts down.
                crate::runtime::liveness::rest(self.liveness());
                return Ok(());
            }
        }
        let shared = Arc::new(Mutex::new(Shared::default()));
        let owned_producer: Arc<BaseProducer<TrackingContext>> = Arc::new(
            kafka::transactional_producer(
                &config,
                &format!("{}.hub.{instance}", config.topic_prefix),
            )
            .set("message.max.bytes", "4194304")
            .create_with_context(TrackingContext::default())
            .map_err(|e| KafkaError::Setup(e.to_string()))?,
        );
        let producer: &BaseProducer<TrackingContext> = &owned_producer;
        if let Err(e) = kafka::init_waiting(producer, TXN_TIMEOUT, kafka::INIT_PATIENCE, &stop) {
            if stop.load(Ordering::Relaxed) {
                // Stopped while the coordinator could not take the producer: nothing was begun.
                crate::runtime::liveness::rest(self.liveness());
                return Ok(());
            }
            return Err(fatal_or_kafka(e));
        }
        let consumer: BaseConsumer<HubContext> = kafka::transactional_consumer(
            &config,
            &config.hub_group_id(),
            &format!("hub-{instance}"),
        )
        .create_with_context(HubContext {
            env: self.env.clone(),
            shared: shared.clone(),
            producer: owned_producer.clone(),
            clock: self.clock.clone(),
            router: self.router.clone(),
            stage: self.stage,
            membership: Default::default(),
            offsets_generation: Default::default(),
            stop: stop.clone(),
        })
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
        consumer
            .subscribe(&[self.env.inbox.as_str()])
            .map_err(KafkaError::from)?;
        let _restores = StopRestores(shared.clone());
        tracing::info!(group = %config.hub_group_id(), stage = self.stage, dispatch = self.dispatch.is_some(), "hub stage started");
        let watch = GroupWatch::shared(
            &config,
            &config.hub_group_id(),
            Covers::Topic(self.env.inbox.clone()),
        );
        let mut rejoin = Rejoin::default();
        let mut aborts = kafka::AbortStreak::new(config.stall_timeout);
        let mut last_abort = String::new();
        let mut lasting = false;
        let mut joining = self.joining.take();

        let mut backlog_at = Instant::now();
        let mut last_txn_at = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            crate::runtime::liveness::beat(self.liveness());
            rejoin
                .tick(
                    &watch,
                    &consumer,
                    &consumer.context().membership,
                    &self.env.inbox,
                    "hub",
                )
                .map_err(KafkaError::from)?;
            orphans::settle(
                &mut joining,
                Some(&watch),
                &consumer,
                &consumer.context().membership,
                "hub",
            );
            advance_restores(&self.env, &consumer, &self.router, self.stage)?;
            if self.dispatch.is_some() && backlog_at.elapsed() >= BACKLOG_EVERY {
                backlog_at = Instant::now();
                let guard = shared.lock().unwrap_or_else(|p| p.into_inner());
                sample_backlog(self.stage, &guard.tasks, self.clock.now_ms());
                if let Some(d) = &self.dispatch {
                    telemetry::attempts_claimed(self.stage, d.in_flight);
                    telemetry::claims_ahead_limit(self.stage, d.claims_limit());
                }
            }
            let (due, restoring) = {
                let guard = shared.lock().unwrap_or_else(|p| p.into_inner());
                let due = guard.tasks.values().any(|t| !t.ring.is_empty());
                (due, guard.restoring() > 0)
            };
            let busy = due
                || self
                    .dispatch
                    .as_ref()
                    .is_some_and(|d| d.in_flight > 0 || !d.pending.is_empty());
            // Parked where the rebalance callbacks, which run inside the polls, can reach it.
            shared.lock().unwrap_or_else(|p| p.into_inner()).dispatch = self.dispatch.take();
            let batch = self.fill_batch(&consumer, busy, restoring);
            {
                let mut guard = shared.lock().unwrap_or_else(|p| p.into_inner());
                self.dispatch = guard.dispatch.take();
                if let Some(e) = guard.fatal.take() {
                    return Err(e);
                }
            }
            if let Some(d) = &mut self.dispatch {
                d.drain();
                d.take_handed();
            }
            let has_dispatch_work = self
                .dispatch
                .as_ref()
                .is_some_and(|d| !d.pending.is_empty() || d.may_claim(0));
            // Outcomes and claims alone wait for a pace: committing them as fast as attempts end
            // (a transaction every few ms at light load) costs the hub and the brokers CPU for
            // nothing; new events (a non-empty batch) never wait.
            if batch.is_empty() && (!has_dispatch_work || last_txn_at.elapsed() < TXN_PACE) {
                continue;
            }
            let started = Instant::now();
            let mut guard = shared.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(d) = &mut self.dispatch {
                d.hand_over(&guard.tasks, &self.router, self.clock.now_ms());
            }
            // Run again only after the first run's offsets were refused because the group moved
            // on as they were sent (see below).
            let mut runs = 0;
            let mut refused_at: Option<Instant> = None;
            let aborted = loop {
                runs += 1;
                let staging = telemetry::Staging::begin();
                let result = self.process_batch(producer, &consumer, &mut guard.tasks, &batch);
                staging.end(counts_as_committed(&result));
                match result {
                    Ok((n, launched)) => {
                        last_txn_at = Instant::now();
                        self.window
                            .took(started.elapsed(), self.env.config.commit_interval);
                        if n > 0 || launched > 0 {
                            telemetry::HubCommit {
                                records: n,
                                took: started.elapsed(),
                            }
                            .emit();
                        }
                        if let Some(d) = &mut self.dispatch {
                            d.quiet_until = (n == 0 && launched == 0 && d.pending.is_empty())
                                .then(|| Instant::now() + QUIET_CLAIMS);
                            d.pending.clear();
                        }
                        break false;
                    }
                    Err(e @ (HubError::Fenced(_) | HubError::Undecided(_))) => return Err(e),
                    Err(HubError::Idle) => break false,
                    Err(e @ HubError::Unowned { .. }) => {
                        let _ = crate::runtime::kafka::abort_waiting(
                            producer,
                            TXN_TIMEOUT,
                            ABORT_PATIENCE,
                        );
                        return Err(e);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, records = batch.len(), "hub batch aborted; it will be read again");
                        last_abort = e.to_string();
                        lasting = matches!(&e, HubError::Kafka(KafkaError::Call(k)) if kafka::never_clears(k.rdkafka_error_code()));
                        self.undo_aborted(producer, &mut guard.tasks, &batch)?;
                        // Refused because the group moved to the next generation while the
                        // offsets were on their way (by the coordinator, or by `member_metadata`
                        // seeing the membership change as it took them): this loop still holds
                        // every partition of the batch until it serves the revocation, and may
                        // commit under that generation (`kafka::may_commit_under`). The batch
                        // runs again at once, before the next poll serves the revocation, so the
                        // partitions go with its events done; read again after the revocation,
                        // the next owner of a partition that moved would send their first
                        // attempts a second time. The second run's claims take those attempts'
                        // deliveries (`Dispatch::launch`).
                        // A run right after the abort can fail too, on a producer or a
                        // coordinator still settling it (seen under load: "Erroneous state"
                        // from the offsets); a few more runs, a little later each, within
                        // RERUN_WINDOW of the refusal.
                        if runs == 1
                            && matches!(&e, HubError::Kafka(k) if kafka::generation_refused(k))
                        {
                            refused_at = Some(Instant::now());
                        }
                        let again = refused_at.is_some_and(|at| at.elapsed() < RERUN_WINDOW)
                            && runs <= RERUNS
                            && kafka::wait_next_generation(
                                &consumer,
                                &consumer.context().membership,
                                consumer.context().offsets_generation.load(Ordering::SeqCst),
                                NEXT_GENERATION_PATIENCE,
                            );
                        if again {
                            std::thread::sleep(RERUN_PAUSE * (runs - 1));
                            tracing::info!(
                                records = batch.len(),
                                run = runs + 1,
                                "hub batch runs again at once under the group's next generation"
                            );
                            if runs == 1 {
                                telemetry::hub_batch_run_again();
                            }
                            continue;
                        }
                        break true;
                    }
                }
            };
            drop(guard);
            if aborted {
                rewind(&consumer, &batch);
                aborts.pause_after_abort(lasting).map_err(|streak| {
                    HubError::Stuck(format!("{streak}; the last: {last_abort}"))
                })?;
            } else {
                aborts.committed();
            }
        }
        self.drain_on_stop(producer, &consumer, &shared)?;
        if !consumer.assignment_lost() {
            // Still the owner: the stores are current (see `STALE_AFTER`).
            let stopped = now_ms();
            for task in shared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .tasks
                .values()
            {
                if let Err(e) = task.store.stamp(stopped) {
                    tracing::warn!(error = %e, "could not stamp a store at stop");
                }
            }
        }
        tracing::info!(stage = self.stage, "hub stage stopping");
        let live = self.liveness();
        kafka::leave_group(&consumer, kafka::LEAVE_PATIENCE, &|| {
            crate::runtime::liveness::beat(live)
        });
        // Closed while the loop is still watched (see the ingest loop's end).
        drop(consumer);
        crate::runtime::liveness::rest(live);
        Ok(())
    }

    /// On stop: claims nothing more, waits up to `STREAMING_HUB_SHUTDOWN_TIMEOUT` for the
    /// attempts in flight and commits their outcomes, so a restart neither loses them nor waits
    /// for their leases to expire. What is still in flight then is reclaimed after its lease.
    fn drain_on_stop(
        &mut self,
        producer: &BaseProducer<TrackingContext>,
        consumer: &BaseConsumer<HubContext>,
        shared: &Mutex<Shared>,
    ) -> Result<(), HubError> {
        let Some(d) = &mut self.dispatch else {
            return Ok(());
        };
        d.max_in_flight = 0; // no new claims
        let deadline = Instant::now() + self.env.config.shutdown_timeout;
        let in_flight = d.in_flight;
        if in_flight > 0 {
            tracing::info!(in_flight, "waiting for attempts in flight before leaving");
        }
        loop {
            crate::runtime::liveness::beat(self.liveness());
            let d = self.dispatch.as_mut().expect("checked above");
            d.drain();
            d.take_handed();
            if d.in_flight == 0 && d.pending.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    in_flight = d.in_flight,
                    "shutdown timeout: attempts still in flight are reclaimed after their lease"
                );
                break;
            }
            if d.pending.is_empty() {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            let mut guard = shared.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(d) = &mut self.dispatch {
                d.hand_over(&guard.tasks, &self.router, self.clock.now_ms());
            }
            let staging = telemetry::Staging::begin();
            let result = self.process_batch(producer, consumer, &mut guard.tasks, &[]);
            staging.end(counts_as_committed(&result));
            match result {
                Ok(_) | Err(HubError::Idle) => {
                    if let Some(d) = &mut self.dispatch {
                        d.pending.clear();
                    }
                }
                Err(e @ (HubError::Fenced(_) | HubError::Undecided(_))) => return Err(e),
                Err(e) => {
                    let _ = abort_and_forget(producer);
                    if let Some(d) = self.dispatch.as_mut() {
                        d.breakers.rollback();
                    }
                    drop(guard);
                    if !kafka::membership_confirmed(consumer, &consumer.context().membership) {
                        // The group moved and this loop has not served the rebalance: a poll
                        // serves it (a record it returns is left for the partition's next
                        // reader), then the outcomes are committed under the new membership.
                        // The dispatch is parked where the callbacks reach it, as in the loop:
                        // a revocation commits the outcomes of the partitions it gives up
                        // (`commit_given_up`), which found none here and left them to be
                        // parked with no owner when the process exits.
                        shared.lock().unwrap_or_else(|p| p.into_inner()).dispatch =
                            self.dispatch.take();
                        let _ = consumer.poll(Duration::from_millis(50));
                        let mut guard = shared.lock().unwrap_or_else(|p| p.into_inner());
                        self.dispatch = guard.dispatch.take();
                        if let Some(e) = guard.fatal.take() {
                            return Err(e);
                        }
                        if self.dispatch.is_none() {
                            return Ok(());
                        }
                        continue;
                    }
                    tracing::warn!(error = %e, "committing outcomes at shutdown failed");
                    break;
                }
            }
        }
        if in_flight > 0 {
            tracing::info!(in_flight, "attempts in flight at shutdown recorded");
        }
        Ok(())
    }

    fn fill_batch<'c>(
        &self,
        consumer: &'c BaseConsumer<HubContext>,
        busy: bool,
        restoring: bool,
    ) -> Vec<BorrowedMessage<'c>> {
        let config = &self.env.config;
        let mut batch = Vec::new();
        let mut deadline: Option<Instant> = None;
        let mut last: HashMap<i32, i64> = HashMap::new();
        // A restore under way: its tasks are taken between polls, so short waits.
        let idle_wait = if busy || restoring {
            Duration::from_millis(10)
        } else {
            Duration::from_millis(100)
        };
        let mut jobs = 0usize;
        self.handler.batch_started();
        while batch.len() < config.hub_batch_max && jobs < config.hub_batch_jobs {
            let wait = match deadline {
                None => idle_wait,
                // Once a batch is open, a short quiet gap closes it early: light load commits at
                // once (low latency), a steady stream fills it up to its size or interval.
                Some(d) => d.saturating_duration_since(Instant::now()).min(QUIET_GAP),
            };
            if deadline.is_some() && wait.is_zero() {
                break;
            }
            let polled = consumer.poll(wait);
            forget_revoked(consumer, &mut batch, &mut last);
            match polled {
                // Nothing within the wait: hand back to the loop, which also serves due timers
                // and worker outcomes (and notices `stop`).
                None => break,
                Some(Ok(m)) => {
                    if last.get(&m.partition()).is_some_and(|&o| m.offset() <= o) {
                        continue;
                    }
                    last.insert(m.partition(), m.offset());
                    jobs += self.handler.weight(&m);
                    batch.push(m);
                    if deadline.is_none() {
                        // With deliveries under way, outcomes and claims wait for this batch to
                        // commit: keep it short so the delivery loop turns quickly.
                        let longest = if busy {
                            config.commit_interval.min(BUSY_BATCH)
                        } else {
                            config.commit_interval
                        };
                        let shortest = config.commit_interval_min.min(longest);
                        deadline = Some(Instant::now() + self.window.window(shortest, longest));
                    }
                }
                Some(Err(rdkafka::error::KafkaError::MessageConsumptionFatal(code)))
                | Some(Err(rdkafka::error::KafkaError::MessageConsumption(
                    code @ RDKafkaErrorCode::PollExceeded,
                ))) => {
                    // The consumer is dead (e.g. another member took this static member id):
                    // the loop stops on it, so the process is restarted.
                    consumer
                        .context()
                        .shared
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .fatal
                        .get_or_insert(HubError::Fenced(format!("fatal consumer error: {code}")));
                    break;
                }
                Some(Err(e)) => tracing::warn!(error = %e, "hub consumer error"),
            }
        }
        batch
    }

    /// One transaction: the inbox records, then the workers' outcomes, then new claims.
    /// Returns the records processed and the attempts started (the claims', once committed).
    /// Aborts the open transaction and undoes what it changed in memory: the tenants' rings and
    /// the breakers go back, and the batch's records take the committed-claim path when they
    /// come again, their first attempts possibly made (see `Task::careful_until`).
    fn undo_aborted(
        &mut self,
        producer: &BaseProducer<TrackingContext>,
        tasks: &mut HashMap<i32, Task>,
        batch: &[BorrowedMessage<'_>],
    ) -> Result<(), HubError> {
        if let Err(abort) = abort_and_forget(producer) {
            return Err(fatal_or_kafka(abort));
        }
        for task in tasks.values_mut() {
            task.ring.aborted();
            // Its records are read again; until then the purge waits.
            task.read_through_ms = None;
        }
        for m in batch {
            if let Some(task) = tasks.get_mut(&m.partition()) {
                task.careful_until = task.careful_until.max(m.offset() + 1);
            }
        }
        if let Some(d) = self.dispatch.as_mut() {
            d.breakers.rollback();
        }
        Ok(())
    }

    fn process_batch(
        &mut self,
        producer: &BaseProducer<TrackingContext>,
        consumer: &BaseConsumer<HubContext>,
        tasks: &mut HashMap<i32, Task>,
        batch: &[BorrowedMessage<'_>],
    ) -> Result<(usize, usize), HubError> {
        let env = &self.env;
        let now = self.clock.now_ms();
        let ttl = env.config.idempotency_ttl.as_millis() as i64;
        // Due work is looked for before the transaction opens, so an idle loop opens none.
        // (Looked at only when there is nothing else to do: it visits every tenant with timers.)
        let claimable = || match &self.dispatch {
            Some(d) if d.may_claim(0) && d.quiet_until.is_none_or(|t| Instant::now() >= t) => {
                tasks.values().any(|t| t.ring.may_have_due(now))
            }
            _ => false,
        };
        let outcomes = self.dispatch.as_ref().map_or(0, |d| d.pending.len());
        if batch.is_empty() && outcomes == 0 && !claimable() {
            return Err(HubError::Idle);
        }
        producer.begin_transaction().map_err(fatal_or_kafka)?;
        // Breaker changes of this transaction are undone if it aborts (its outcomes come again).
        if let Some(d) = self.dispatch.as_mut() {
            d.breakers.begin();
        }
        // Checked again where the offsets go; this saves the work of a batch that could not.
        if !tasks.is_empty() && !kafka::may_commit_now(consumer, &consumer.context().membership) {
            return Err(KafkaError::Setup(kafka::NOT_TOLD.into()).into());
        }
        let _ = producer.context().take();
        let mut phase = Instant::now();
        let mut phase_done = |name: &'static str| {
            telemetry::txn_phase("hub", name, phase.elapsed());
            phase = Instant::now();
        };
        let mut staged: HashMap<i32, Staged> = HashMap::new();
        let mut sequences: FastMap<(i32, String), u64> = FastMap::default();
        let mut offsets: HashMap<i32, i64> = HashMap::new();
        let mut fresh: HashMap<i32, Vec<Fresh>> = HashMap::new();
        let early_on = self.dispatch.is_some() && !env.config.early_attempt_wait.is_zero();
        let mut outputs = Outputs { producer };
        for (batch_index, m) in batch.iter().enumerate() {
            let p = m.partition();
            let Some(task) = tasks.get_mut(&p) else {
                // Not expected: revoked partitions were dropped from the batch, and assigned
                // ones stay paused until restored (a failed unassign could leave one fetching).
                // Never skipped (its offset would commit), and not retried in place either
                // (every batch would meet it again): the loop stops, the process restarts.
                return Err(HubError::Unowned {
                    partition: p,
                    offset: m.offset(),
                });
            };
            offsets.insert(p, m.offset() + 1);
            let recount = task.recount.take(m.offset());
            let careful = !early_on || recount || m.offset() < task.careful_until;
            let st = staged.entry(p).or_default();
            let (tenant, ce_id, ingest_ms) = match identity(m) {
                Ok(identity) => identity,
                Err(why) => {
                    quarantine_invalid(env, &mut outputs, m, why, now)?;
                    HubEvent {
                        outcome: "invalid",
                        partition: p,
                        offset: m.offset(),
                        ce_id: "",
                    }
                    .emit();
                    continue;
                }
            };
            // A copy is judged at its ingest time, not at when the hub reads it: a hub behind its
            // inbox still drops a copy ingested within the TTL of the first (a producer's retry
            // read after the first copy's entry would have expired by the clock).
            let seen_at = ingest_ms.map_or(now, |t| t.min(now + INGEST_SKEW_MS));
            task.read_through_ms = Some(task.read_through_ms.map_or(seen_at, |t| t.max(seen_at)));
            // A redelivery request (replay, recover, redrive) names one subscription and skips
            // dedup and sequencing; anything else is judged by the dedup store.
            let redeliver = redelivery_of(m);
            let (sequence, replay) = if redeliver.is_some() {
                (0, true)
            } else {
                let key = dedup::dedup_key(tenant, ce_id);
                // An upper-case UUIDv7 first seen by a version that keyed ids as written is
                // under that key until it expires: a replay of it stays a replay.
                let bytes = match st.read(&task.store, DEDUP, &key)? {
                    None => match dedup::key_as_written(tenant, ce_id, &key) {
                        Some(old) => st.read(&task.store, DEDUP, &old)?,
                        None => None,
                    },
                    found => found,
                };
                let existing = match bytes {
                    Some(bytes) => Some(
                        env.codec
                            .decode::<DedupEntry>(RecordKind::DedupEntry, &bytes)
                            .map_err(|e| HubError::Codec(e.to_string()))?,
                    ),
                    None => None,
                };
                let (sequence, replay) =
                    match dedup::judge(existing.as_ref(), p, m.offset(), seen_at) {
                        Seen::Duplicate { .. } => {
                            HubEvent {
                                outcome: "duplicate",
                                partition: p,
                                offset: m.offset(),
                                ce_id,
                            }
                            .emit();
                            continue;
                        }
                        Seen::Replay { sequence } => (sequence, true),
                        Seen::New => {
                            let next = match sequences.get(&(p, tenant.to_string())) {
                                Some(n) => *n,
                                None => read_sequence(&env.codec, st, &task.store, tenant)?,
                            };
                            sequences.insert((p, tenant.to_string()), next + 1);
                            let entry = DedupEntry {
                                tenant_id: tenant.to_string(),
                                ce_id: ce_id.to_string(),
                                inbox_partition: p,
                                first_offset: m.offset(),
                                sequence: next,
                                // From when the hub first sees it, not from ingest: a hub that
                                // reads its inbox more than the TTL late (down for a day, a lagging
                                // role split) would otherwise write entries already expired, and
                                // every later copy would be a new event.
                                expires_at: ingest_ms.unwrap_or(now).max(now) + ttl,
                            };
                            if let Some(old) = &existing {
                                st.delete(DEDUP_EXPIRY, dedup::expiry_key(old.expires_at, &key));
                            }
                            let bytes = env
                                .codec
                                .encode(RecordKind::DedupEntry, &entry)
                                .map_err(|e| HubError::Codec(e.to_string()))?;
                            outputs.send(
                                &env.jobs_changelog,
                                Some(p),
                                &on_state_changelog(DEDUP_ON_STATE_CHANGELOG, &key),
                                Some(&bytes),
                            )?;
                            st.put(
                                DEDUP_EXPIRY,
                                dedup::expiry_key(entry.expires_at, &key),
                                Vec::new(),
                            );
                            st.put(DEDUP, key, bytes);
                            (next, false)
                        }
                    };
                HubEvent {
                    outcome: if replay { "replay" } else { "new" },
                    partition: p,
                    offset: m.offset(),
                    ce_id,
                }
                .emit();
                (sequence, replay)
            };
            let event = SequencedEvent {
                tenant,
                ce_id,
                sequence,
                partition: p,
                offset: m.offset(),
                replay,
                record: m,
                batch_index,
            };
            let mut ctx = TaskCtx {
                out: &mut outputs,
                store: &task.store,
                staged: st,
                ring: &mut task.ring,
                codec: &env.codec,
                now,
                fresh: fresh.entry(p).or_default(),
                careful,
                recount,
            };
            match redeliver {
                Some(sub_id) => self.handler.on_redeliver(&event, sub_id, &mut ctx)?,
                None => self.handler.on_event(&event, &mut ctx)?,
            }
        }
        for ((p, tenant), next) in sequences {
            let rec = SequenceRecord {
                tenant_id: tenant.clone(),
                next_sequence: next,
            };
            let bytes = env
                .codec
                .encode(RecordKind::Sequence, &rec)
                .map_err(|e| HubError::Codec(e.to_string()))?;
            outputs.send(
                &env.jobs_changelog,
                Some(p),
                &on_state_changelog(SEQUENCE_ON_STATE_CHANGELOG, tenant.as_bytes()),
                Some(&bytes),
            )?;
            staged
                .entry(p)
                .or_default()
                .put(SEQUENCE, tenant.into_bytes(), bytes);
        }
        let mut purged_to = Vec::new();
        for (p, task) in tasks.iter() {
            let Some(read_through) = task.read_through_ms else {
                continue;
            };
            let st = staged.entry(*p).or_default();
            let mark = purge_expired(
                env,
                &task.store,
                st,
                &mut outputs,
                *p,
                (read_through - INGEST_SKEW_MS).min(now),
                &task.purged_to,
            )?;
            purged_to.push((*p, mark));
        }
        let mut attempts = Vec::new();
        let mut early = Vec::new();
        if let Some(d) = self.dispatch.as_mut() {
            record_outcomes(env, d, tasks, &mut staged, &mut outputs, now, 0)?;
            claim_due(
                env,
                d,
                tasks,
                &mut staged,
                &mut outputs,
                now,
                batch,
                &fresh,
                &mut attempts,
                &mut early,
            )?;
        }
        let launched_early = early.len();
        let mut started_early = None;
        if let (Some(d), false) = (self.dispatch.as_mut(), early.is_empty()) {
            let router = &self.router;
            let more = || kafka::has_queued(consumer);
            started_early = Some(attempt_early(
                env,
                d,
                router,
                tasks,
                &mut staged,
                &mut outputs,
                now,
                early,
                &more,
            )?);
        }
        let hold = env.config.dangerous_test_stale_offsets
            && launched_early > 0
            && !STALE_OFFSETS_HELD.swap(true, Ordering::SeqCst);
        fence_offsets(tasks, &mut offsets);
        send_offsets(env, producer, consumer, &offsets, &mut phase_done, hold)?;
        // The jobs changelog goes after the offsets so that the first attempts that ended while
        // the offsets went to the coordinator are recorded before it: a job created and
        // delivered in one transaction writes nothing.
        if let (Some(d), Some(early)) = (self.dispatch.as_mut(), started_early.as_ref()) {
            let router = &self.router;
            pick_up_early(env, d, router, tasks, &mut staged, &mut outputs, now, early)?;
        }
        let delivered =
            write_jobs_and_commit(env, producer, &staged, &mut outputs, &mut phase_done)?;
        telemetry::committed();
        // Its purges' deletions are committed: the next purge seeks past them.
        for (p, mark) in purged_to {
            if let Some(task) = tasks.get_mut(&p) {
                task.purged_to = mark;
            }
        }
        // The claims are durable: their attempts start now, not after the stores below have
        // caught up (a few ms per batch on every delivery's latency). Their outcomes come back to
        // this thread, which handles them in a later transaction, after this one's writes.
        let launched = attempts.len() + launched_early;
        if let Some(d) = self.dispatch.as_mut() {
            d.breakers.commit();
            d.launch(attempts);
        }
        apply_committed(env, tasks, staged, &offsets, &delivered)?;
        phase_done("apply");
        Ok((batch.len(), launched))
    }
}

/// Every owned partition's inbox offset goes into the transaction: `offsets` has those of the
/// records read; the others go at `Task::next_offset`, so the group generation fences the whole
/// transaction.
fn fence_offsets(tasks: &HashMap<i32, Task>, offsets: &mut HashMap<i32, i64>) {
    for (p, task) in tasks.iter() {
        if let (false, Some(next)) = (offsets.contains_key(p), task.next_offset) {
            offsets.insert(*p, next);
        }
    }
}

/// The first half of the end of a hub transaction: the records produced so far are pushed, then
/// the inbox offsets (`offsets`, see [`fence_offsets`]) go into it. The jobs changelog follows
/// ([`write_jobs_and_commit`]), so the first attempts that ended during this round trip are
/// recorded in it (see [`pick_up_early`]).
fn send_offsets(
    env: &Env,
    producer: &BaseProducer<TrackingContext>,
    consumer: &BaseConsumer<HubContext>,
    offsets: &HashMap<i32, i64>,
    phase_done: &mut dyn FnMut(&'static str),
    hold: bool,
) -> Result<(), HubError> {
    // `STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS`: the metadata is taken and held before the
    // offsets go, so the coordinator refuses them, as when the group moves on while a loaded
    // loop sends them (the batch's dedup and sequence records were written before; its jobs
    // records would follow the offsets).
    let held = if hold {
        let metadata = kafka::member_metadata_as(consumer, &consumer.context().membership)
            .map_err(KafkaError::from)?;
        hold_until_the_group_moves(consumer);
        Some(metadata)
    } else {
        None
    };
    kafka::push(producer.client());
    phase_done("work");
    // The batch's work done: the bounded calls below each start on a fresh beat.
    crate::runtime::liveness::beat_current();
    if !offsets.is_empty() {
        let mut tpl = TopicPartitionList::new();
        for (p, next) in offsets.iter() {
            tpl.add_partition_offset(&env.inbox, *p, Offset::Offset(*next))
                .map_err(KafkaError::from)?;
        }
        let (metadata, member) = match held {
            Some(held) => held,
            None => kafka::member_metadata_as(consumer, &consumer.context().membership)
                .map_err(KafkaError::from)?,
        };
        consumer
            .context()
            .offsets_generation
            .store(member.generation, Ordering::SeqCst);
        producer
            .send_offsets_to_transaction(&tpl, &metadata, TXN_TIMEOUT)
            .map_err(fatal_or_kafka)?;
        // Each call is bounded (30 s): a beat between them hides no hang, and without it the
        // offsets, the delivery reports and the commit's first try ran 90 s unbeaten.
        crate::runtime::liveness::beat_current();
    }
    phase_done("offsets");
    Ok(())
}

/// The second half of the end of a hub transaction, after [`send_offsets`]: the jobs changelog
/// writes `staged` holds, the wait for the records' acknowledgements, and the commit. Returns
/// the changelog offsets written, per topic and partition.
fn write_jobs_and_commit(
    env: &Env,
    producer: &BaseProducer<TrackingContext>,
    staged: &HashMap<i32, Staged>,
    outputs: &mut Outputs<'_>,
    phase_done: &mut dyn FnMut(&'static str),
) -> Result<HashMap<String, HashMap<i32, i64>>, HubError> {
    // The jobs changelog is the batch's final job writes: a key written twice in one
    // transaction (a job created and claimed) needs only its last record in the compacted
    // changelog, and the staging holds exactly that.
    for (p, st) in staged.iter() {
        for (k, v) in st.writes_in(JOBS) {
            outputs.send(&env.jobs_changelog, Some(*p), k, v)?;
        }
    }
    kafka::push(producer.client());
    phase_done("jobs");
    // Serves delivery reports: the changelog offsets.
    kafka::wait_delivered(
        || producer.in_flight_count(),
        |d| producer.poll(d),
        TXN_TIMEOUT,
    )
    .map_err(fatal_or_kafka)?;
    phase_done("delivered");
    let (delivered, failed) = producer.context().take();
    if let Some(why) = failed {
        // As it came (its code says whether it can clear: `kafka::never_clears`).
        tracing::warn!(error = %why, "a changelog or output write of the hub transaction failed");
        return Err(KafkaError::Call(why).into());
    }
    kafka::commit_waiting(producer, TXN_TIMEOUT, COMMIT_PATIENCE).map_err(undecided_or_kafka)?;
    phase_done("commit");
    Ok(delivered)
}

/// `STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS`: with the transaction's group metadata taken,
/// waits (at most [`STALE_OFFSETS_HOLD`]) until the consumer's generation has moved on, so the
/// offsets go with a generation the coordinator has left.
fn hold_until_the_group_moves(consumer: &BaseConsumer<HubContext>) {
    let Some(taken) = kafka::membership(consumer) else {
        return;
    };
    tracing::warn!(
        generation = taken.generation,
        "DANGEROUS_TEST_STALE_OFFSETS: holding this transaction's offsets until the group moves on"
    );
    let until = Instant::now() + STALE_OFFSETS_HOLD;
    while Instant::now() < until {
        crate::runtime::liveness::beat_current();
        if kafka::membership(consumer).is_some_and(|m| m.generation != taken.generation) {
            tracing::warn!(
                generation = taken.generation,
                "DANGEROUS_TEST_STALE_OFFSETS: the group moved on; the offsets go with the generation it left"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// After a commit: the local stores move, each with its changelog offsets (`delivered`), and
/// each partition's committed inbox offset becomes its fence (`Task::next_offset`).
fn apply_committed(
    env: &Env,
    tasks: &mut HashMap<i32, Task>,
    staged: HashMap<i32, Staged>,
    offsets: &HashMap<i32, i64>,
    delivered: &HashMap<String, HashMap<i32, i64>>,
) -> Result<(), HubError> {
    for (p, task) in tasks.iter_mut() {
        task.ring.committed();
        if let Some(next) = offsets.get(p) {
            task.next_offset = Some(*next);
            if task.careful_until == i64::MAX {
                task.careful_until = *next; // the partition's first committed offset
            }
        }
    }
    for (p, st) in staged {
        let Some(task) = tasks.get_mut(&p) else {
            continue;
        };
        task.ring.note_timers(&st);
        // The state changelog is the only one written (for all three stores); its offset is
        // kept with the jobs family (see `Env::changelog_of`).
        let marks: Vec<(&str, i64)> = delivered
            .get(env.jobs_changelog.as_str())
            .and_then(|m| m.get(&p))
            .map(|o| (JOBS, *o))
            .into_iter()
            .collect();
        task.store.apply(st, &marks)?;
    }
    Ok(())
}

/// The breaker origin of a destination URL, parsed once per URL (parsing it on every claim and
/// outcome was 2% of the hub's CPU under load). Bounded: forgotten wholesale past 10,000 URLs.
fn cached_origin(origins: &mut FastMap<String, String>, url: Option<&str>) -> String {
    let url = url.unwrap_or("");
    if let Some(o) = origins.get(url) {
        return o.clone();
    }
    if origins.len() >= 10_000 {
        origins.clear();
    }
    let o = breaker::origin_of(url);
    origins.insert(url.to_string(), o.clone());
    o
}

/// Inside the transaction: records the outcomes taken from the workers since `from` (their index
/// in `Dispatch::pending`).
fn record_outcomes(
    env: &Env,
    d: &mut Dispatch,
    tasks: &mut HashMap<i32, Task>,
    staged: &mut HashMap<i32, Staged>,
    out: &mut Outputs<'_>,
    now: i64,
    from: usize,
) -> Result<(), HubError> {
    let mut rng = rand::thread_rng();
    for o in &d.pending[from.min(d.pending.len())..] {
        let Some(task) = tasks.get(&o.partition) else {
            continue;
        };
        let st = staged.entry(o.partition).or_default();
        let mut js = JobStore {
            store: &task.store,
            staged: st,
            codec: &env.codec,
        };
        if o.not_attempted() {
            if let Some(job) = js.get_job(&o.job_key)? {
                let origin = cached_origin(&mut d.origins, o.url.as_deref());
                // Claimed (and admitted) a lease before its end.
                let admitted_at = o.lease_until - d.lease_ms;
                d.breakers.unsent(&o.tenant, &origin, admitted_at);
                d.holds.unsent(&job.subscription_id, admitted_at);
            }
            jobs::release_unattempted(&mut js, o, now)?;
            continue;
        }
        // Read once: the checks below and the outcome itself use it. The job's tenant's
        // subscription only: another tenant's under the same id is not this job's.
        let job = js.get_job(&o.job_key)?;
        let (sub, unreadable) = job.as_ref().map_or((None, false), |j| {
            let table = d.table.read();
            (
                table.get_of(&j.tenant_id, &j.subscription_id),
                table.is_unreadable(&j.subscription_id),
            )
        });
        let schedule = sub.as_ref().and_then(|s| s.retry_schedule.clone());
        // A failure of the hub's own (no key to open the secret, ...) sent no request: it is not
        // the destination's, so neither its breaker nor its auto-disable span hears of it.
        let hub_side = o.hub_side();
        // No request went out (the hub's failure, or one of the subscription's record): the
        // origin's breaker, shared by the tenant's other subscriptions there, does not hear of it.
        let sent_nothing = o.sent_nothing();
        // Its job's lease still current: a stale one's probe slot may be another job's by now.
        let current = job.as_ref().is_some_and(|j| {
            j.state == JobState::Leased && j.attempt == o.attempt && j.due_at == o.lease_until
        });
        // The breaker is the origin's (the tenant's and the URL the attempt went to), and counts
        // what shows the origin down (`Outcome::origin_down`; a 410 of one URL does not): it hears
        // of an attempt whose subscription was deleted meanwhile too, or a probe's slot would
        // stay taken until it is given up as lost.
        if sent_nothing && current {
            let origin = cached_origin(&mut d.origins, o.url.as_deref());
            d.breakers
                .unsent(&o.tenant, &origin, o.lease_until - d.lease_ms);
            // Nor does a receiver's hold: the one let through after it went nowhere.
            if let Some(j) = &job {
                d.holds
                    .unsent(&j.subscription_id, o.lease_until - d.lease_ms);
            }
        }
        if !sent_nothing && job.is_some() {
            let origin = cached_origin(&mut d.origins, o.url.as_deref());
            // A receiver that asked to wait (`Retry-After`) gets nothing more of this
            // subscription until then.
            if let Some(j) = &job {
                d.holds.hold(&j.subscription_id, o.retry_after_ms, now);
            }
            if o.retry_after_ms.is_some_and(|ms| ms > 0) {
                // Its receiver asked to wait: the hold answers for it. Not counted against the
                // origin, whose other webhooks may be taking deliveries (one host serving many,
                // each rate-limited on its own); the breaker's probe answered so frees its slot.
                if current {
                    d.breakers
                        .unsent(&o.tenant, &origin, o.lease_until - d.lease_ms);
                }
            } else if let Some(t) = d.breakers.record(&o.tenant, &origin, !o.origin_down(), now) {
                telemetry::BreakerChanged {
                    tenant: &o.tenant,
                    origin: &origin,
                    opened: t == breaker::Transition::Opened,
                }
                .emit();
            }
        }
        // Not for a subscription whose latest record this instance cannot read (`unreadable`,
        // read with it): a verdict to disable it could not be written (the copy here may be
        // stale, and the write would undo the newer one), and the span is spent once judged. Its
        // jobs are held meanwhile.
        if let (Some(sub), false, false) = (&sub, hub_side, unreadable) {
            let gates = health::Gates {
                enabled: env.config.autodisable_enabled,
                window_ms: env.config.autodisable_failure_window.as_millis() as i64,
                spread_ms: env.config.autodisable_failure_spread.as_millis() as i64,
            };
            if let health::Verdict::Disable { reason } =
                health::record(&mut js, &sub.id, o.success(), now, sub.updated_at, &gates)?
            {
                if sub.enabled {
                    let mut disabled = (**sub).clone();
                    disabled.enabled = false;
                    disabled.disabled_reason = Some(reason.clone());
                    disabled.disabled_at = Some(now);
                    disabled.updated_at = now;
                    disabled.version += 1;
                    let bytes = env
                        .codec
                        .encode(RecordKind::Subscription, &disabled)
                        .map_err(|e| HubError::Codec(e.to_string()))?;
                    if bytes.len() > crate::subscriptions::control::MAX_RECORD_BYTES {
                        // Written, no reader would take it: the subscription would be held as
                        // unreadable rather than disabled. Only a record written past the API
                        // within a few hundred bytes of the bound grows past it.
                        tracing::warn!(
                            subscription_id = %sub.id,
                            tenant = %sub.tenant_id,
                            bytes = bytes.len(),
                            "auto-disable not written: the record would be larger than a control record may be"
                        );
                    } else {
                        // Planned from this table, which may lag a write made meanwhile: the
                        // table keeps it should it be read back over one (`reassert`).
                        d.table.apply(|t| t.expect_auto_disable(&disabled));
                        out.send(&env.control, None, disabled.id.as_bytes(), Some(&bytes))?;
                        telemetry::AutoDisabled {
                            subscription_id: &sub.id,
                            tenant: &sub.tenant_id,
                            reason: &reason,
                        }
                        .emit();
                    }
                }
            }
        }
        // A deleted subscription's failure span goes with it (see `claim`), here for an attempt
        // that was out when it was deleted.
        if let (None, false, Some(j)) = (&sub, unreadable, &job) {
            if d.table.read().get(&j.subscription_id).is_none() {
                health::forget(&mut js, &j.subscription_id)?;
            }
        }
        let Some(records) = jobs::apply_outcome(
            &mut js,
            o,
            job,
            schedule.as_deref(),
            now,
            d.poison_threshold,
            &mut rng,
        )?
        else {
            keep_unrecorded(&mut d.unrecorded, o, now);
            continue;
        };
        if o.success() && !d.unrecorded.is_empty() {
            d.unrecorded.remove(&o.job_key);
        }
        telemetry::AttemptDone {
            outcome: &records.attempt,
        }
        .emit();
        if let (true, Some(ingest)) = (o.success(), o.ingest_ms) {
            telemetry::delivered_after(now - ingest);
        }
        let key = records.attempt.event_id.clone();
        let bytes = env
            .codec
            .encode(RecordKind::Attempt, &records.attempt)
            .map_err(|e| HubError::Codec(e.to_string()))?;
        out.send(&env.attempts, None, key.as_bytes(), Some(&bytes))?;
        if let Some(dl) = records.dead_letter {
            emit_dead_letter(env, out, &dl)?;
        }
    }
    telemetry::breakers_open(d.stage, d.breakers.open_count(now));
    Ok(())
}

/// Inside the transaction: claims due jobs (fair across tenants) up to the free worker capacity,
/// then the jobs this transaction created: the attempts of committed claims go
/// to `attempts` (started once the transaction has committed), the first attempts of new events
/// not on the committed-claim path (`Fresh::early`) to `early` (started before).
#[allow(clippy::too_many_arguments)]
fn claim_due(
    env: &Env,
    d: &mut Dispatch,
    tasks: &mut HashMap<i32, Task>,
    staged: &mut HashMap<i32, Staged>,
    out: &mut Outputs<'_>,
    now: i64,
    batch: &[BorrowedMessage<'_>],
    fresh: &HashMap<i32, Vec<Fresh>>,
    attempts: &mut Vec<Attempt>,
    early: &mut Vec<Attempt>,
) -> Result<(), HubError> {
    let mut capacity = d.claims_limit().saturating_sub(d.in_flight);
    d.waiting_tenants = d.workers.permits.waiting_tenants();
    d.pace.trim(|t| d.in_flight_by_tenant.contains_key(t));
    // Body bytes the claims of this transaction hold (see `Dispatch::may_claim`).
    let mut claimed_bytes = 0usize;
    // Fair across tasks too: each task with timers gets an equal share of this round's capacity
    // (and the order rotates), so one partition's backlog cannot starve another's tenants.
    let mut order: Vec<i32> = tasks
        .iter()
        .filter(|(_, t)| !t.ring.is_empty())
        .map(|(p, _)| *p)
        .collect();
    order.sort_unstable();
    if !order.is_empty() {
        let shift = d.round % order.len();
        order.rotate_left(shift);
    }
    d.round = d.round.wrapping_add(1);
    let share = capacity.div_ceil(order.len().max(1));
    // Per tenant at most an equal share of the claims in flight, and never less than
    // `max_in_flight_per_tenant`: a tenant alone (a 10,000-subscription fan-out) gets them all;
    // the worker permits go round-robin across tenants anyway.
    let tenants_with_timers: usize = tasks.values().map(|t| t.ring.tenants()).sum();
    // Bytes likewise: an equal share of the byte bound (one attempt always), so a tenant of
    // large events to a slow sink cannot hold the whole bound while others wait.
    let per_tenant_cap = TenantCap {
        attempts: d
            .max_in_flight_per_tenant
            .max(d.max_in_flight / tenants_with_timers.max(1)),
        bytes: d.max_in_flight_bytes / tenants_with_timers.max(1),
    };
    // Claimed in this transaction per tenant (a tenant's events are all in one partition).
    let mut claimed_here: FastMap<String, TenantCap> = FastMap::default();
    let mut views = EventViews {
        batch,
        last: None,
        stored: FastMap::default(),
    };
    for p in order {
        let Some(task) = tasks.get_mut(&p) else {
            continue;
        };
        let p = &p;
        if capacity == 0 {
            break;
        }
        let capacity_here = share.min(capacity);
        let st = staged.entry(*p).or_default();
        let mut js = JobStore {
            store: &task.store,
            staged: st,
            codec: &env.codec,
        };
        let due = js.due_jobs(&mut task.ring, now, capacity_here)?;
        for (key, job) in due {
            if !d.may_claim(claimed_bytes) {
                capacity = 0;
                break;
            }
            if claim(
                env,
                d,
                &mut js,
                out,
                key,
                job,
                now,
                *p,
                per_tenant_cap,
                &mut claimed_here,
                attempts,
                &mut views,
                None,
            )? {
                capacity -= 1;
                claimed_bytes += attempts.last().map_or(0, |a| a.event.body.len());
            }
        }
    }
    // Then jobs this transaction created, with what capacity is left (older due jobs first): a
    // new event's attempt starts after this commit, not the next one's (one transaction less
    // between an event and its delivery).
    for (p, keys) in fresh.iter() {
        let Some(task) = tasks.get(p) else {
            continue;
        };
        let st = staged.entry(*p).or_default();
        let mut js = JobStore {
            store: &task.store,
            staged: st,
            codec: &env.codec,
        };
        for f in keys {
            if capacity == 0 || !d.may_claim(claimed_bytes) {
                return Ok(());
            }
            let Some(job) = js.get_job(&f.key)? else {
                continue;
            };
            if job.state != JobState::Pending || job.due_at > now {
                continue;
            }
            let to = if f.early { &mut *early } else { &mut *attempts };
            if claim(
                env,
                d,
                &mut js,
                out,
                f.key.clone(),
                job,
                now,
                *p,
                per_tenant_cap,
                &mut claimed_here,
                to,
                &mut views,
                Some(f.batch_index),
            )? {
                capacity -= 1;
                claimed_bytes += to.last().map_or(0, |a| a.event.body.len());
            }
        }
    }
    Ok(())
}

/// The events of one transaction's attempts, each read once for all its jobs.
/// - A job created in this transaction has its event read from its inbox record (no stored
///   payload decoded); its jobs are created, and claimed, one after another.
/// - A due job has its event read from the stored payload, kept (by inbox partition and payload
///   key) for the other jobs of the same event claimed in this transaction: the due jobs of a
///   fan-out event come interleaved with other tenants' (round-robin), and each read its payload
///   and decoded it (5% of the hub's CPU in `fanout`). A kept view cannot go stale: a payload
///   only changes its holder count, and while a job of the event is being claimed it still
///   holds it.
struct EventViews<'b, 'm> {
    batch: &'b [BorrowedMessage<'m>],
    last: Option<(usize, EventView)>,
    /// By inbox partition and payload key: after a change of the inbox's partition count one
    /// (tenant, ce-id) may be stored in two partitions' stores, possibly with different bodies.
    stored: FastMap<(i32, Vec<u8>), EventView>,
}

impl EventViews<'_, '_> {
    /// The event of a due job (None: its payload is gone), and whether the job is the payload's
    /// only holder.
    fn stored(
        &mut self,
        js: &JobStore<'_>,
        partition: i32,
        payload_key: Vec<u8>,
    ) -> Result<Option<(EventView, bool)>, HubError> {
        let key = (partition, payload_key);
        if let Some(v) = self.stored.get(&key) {
            return Ok(Some((v.clone(), false)));
        }
        let Some(payload) = js.get_payload(&key.1)? else {
            return Ok(None);
        };
        // Kept only when another job holds it too: an event with one subscription is read once.
        let shared = payload.refcount > 1;
        let v = EventView::of_payload(payload);
        if shared {
            self.stored.insert(key, v.clone());
        }
        Ok(Some((v, !shared)))
    }

    fn of(&mut self, index: usize) -> Option<EventView> {
        match &self.last {
            Some((i, v)) if *i == index => Some(v.clone()),
            _ => {
                let v = EventView::of_record(self.batch.get(index)?);
                self.last = Some((index, v.clone()));
                Some(v)
            }
        }
    }
}

/// A tenant's attempts and event bytes: claimed or in flight, or the most it may have.
#[derive(Clone, Copy, Default)]
struct TenantCap {
    attempts: usize,
    bytes: usize,
}

/// Claims one due job: leases it and queues its attempt (true), or sheds, finishes or
/// dead-letters it without an attempt, or leaves it due for a busy tenant (false).
#[allow(clippy::too_many_arguments)]
fn claim(
    env: &Env,
    d: &mut Dispatch,
    js: &mut JobStore<'_>,
    out: &mut Outputs<'_>,
    key: Vec<u8>,
    mut job: JobRecord,
    now: i64,
    p: i32,
    per_tenant_cap: TenantCap,
    claimed_here: &mut FastMap<String, TenantCap>,
    attempts: &mut Vec<Attempt>,
    views: &mut EventViews<'_, '_>,
    fresh: Option<usize>,
) -> Result<bool, HubError> {
    let flying = d
        .in_flight_by_tenant
        .get(&job.tenant_id)
        .copied()
        .unwrap_or_default();
    let here = claimed_here
        .get(&job.tenant_id)
        .copied()
        .unwrap_or_default();
    let (busy, bytes) = (flying.attempts + here.attempts, flying.bytes + here.bytes);
    let most = d.pace.tenant_limit(
        &job.tenant_id,
        d.waiting_tenants,
        per_tenant_cap.attempts,
        d.max_in_flight_per_tenant,
        || d.workers.permits.held(&job.tenant_id),
    );
    if busy >= most || (busy > 0 && bytes >= per_tenant_cap.bytes) {
        return Ok(false); // this tenant has enough in flight; its job stays due
    }
    let old_due = job.due_at;
    let (sub, unreadable, deleted) = {
        let table = d.table.read();
        let id = &job.subscription_id;
        let sub = table.get_of(&job.tenant_id, id);
        let deleted = sub.is_none() && table.get(id).is_none();
        (sub, table.is_unreadable(id), deleted)
    };
    if sub.is_none() && !unreadable {
        // The subscription was deleted (or its id is another tenant's now): its pending
        // deliveries go with it.
        js.finish_job_quietly(&key, &job)?;
        telemetry::dropped_deleted(&job.subscription_id, &job.tenant_id);
        // So does the failure span of a deleted one, or it stayed in the store and its
        // changelog for good (a success or an auto-disable deletes it, and neither comes now).
        // Not for an id that is another tenant's now: the span may be that subscription's.
        if deleted {
            health::forget(js, &job.subscription_id)?;
        }
        return Ok(false);
    }
    if sub.as_ref().is_some_and(|s| !s.enabled) && !unreadable {
        let dl = jobs::dead_letter_without_attempt(
            js,
            &key,
            job,
            DeadLetterReason::SubscriptionDisabled,
            now,
        )?;
        emit_dead_letter(env, out, &dl)?;
        return Ok(false);
    }
    if job.state == JobState::Leased {
        // Its lease ran out with no outcome (the process died mid-attempt): reclaim. Counted
        // before anything postpones it (a shed, a held verification), so poison is seen.
        job.reclaims += 1;
        if job.reclaims >= d.poison_threshold {
            let dl =
                jobs::dead_letter_without_attempt(js, &key, job, DeadLetterReason::Poison, now)?;
            emit_dead_letter(env, out, &dl)?;
            return Ok(false);
        }
    }
    let sub = match sub {
        Some(sub) if !unreadable => sub,
        _ => {
            // Its latest control record could not be read (a newer version's schema, a bad
            // write past the API): not deleted, and what the table has of it may be stale.
            // Held, no attempt spent, until a record for it can be read.
            let id = job.subscription_id.clone();
            postpone(js, &key, job, now + VERIFY_HOLD_MS)?;
            telemetry::Held {
                subscription_id: &id,
                why: telemetry::HeldFor::Unreadable,
            }
            .emit();
            return Ok(false);
        }
    };
    // Only a destination that answered its verification gets deliveries (a new URL is probed
    // first). While the probe is pending the job waits, no attempt spent; once verification
    // failed each due attempt is spent without a request, on the retry curve (no breaker, no
    // auto-disable), so the job goes on after a passing `POST /verify` and is dead-lettered when
    // the curve runs out.
    match sub.verification_state {
        VerificationState::Active => {}
        VerificationState::Pending => {
            postpone(js, &key, job, now + VERIFY_HOLD_MS)?;
            telemetry::HeldUnverified {
                subscription_id: &sub.id,
                spent: false,
            }
            .emit();
            return Ok(false);
        }
        VerificationState::Failed => {
            job.last_status = None;
            job.last_error = Some(UNVERIFIED.into());
            let schedule = sub.retry_schedule.as_deref();
            let delay = curve::next_delay(schedule, job.attempt + 1, None, &mut rand::thread_rng());
            job.attempt += 1;
            // Spent here, without a request: a lapsed lease's attempt is this one, not one more
            // (its dead letter counts the attempts before it).
            job.state = JobState::Pending;
            telemetry::HeldUnverified {
                subscription_id: &sub.id,
                spent: true,
            }
            .emit();
            match delay {
                Some(delay) => postpone(js, &key, job, now + delay as i64)?,
                None => {
                    let dl = jobs::dead_letter_without_attempt(
                        js,
                        &key,
                        job,
                        DeadLetterReason::Exhausted,
                        now,
                    )?;
                    emit_dead_letter(env, out, &dl)?;
                }
            }
            return Ok(false);
        }
    }
    if d.workers.kek.is_none() {
        // No key-encryption key here (a deployment that left it out): nothing could be signed,
        // and every attempt would be spent on the hub's own failure until the job was
        // dead-lettered. It waits, no attempt spent, for an instance that has the key.
        postpone(js, &key, job, now + VERIFY_HOLD_MS)?;
        telemetry::Held {
            subscription_id: &sub.id,
            why: telemetry::HeldFor::NoKey,
        }
        .emit();
        return Ok(false);
    }
    if let Some(until) = d.holds.held_until(&sub.id, now) {
        // Its receiver asked the hub to wait (`Retry-After`).
        postpone(js, &key, job, until)?;
        telemetry::Held {
            subscription_id: &sub.id,
            why: telemetry::HeldFor::RetryAfter,
        }
        .emit();
        return Ok(false);
    }
    let origin = cached_origin(&mut d.origins, sub.destination.url.as_deref());
    if let breaker::Admit::Shed { until } = d.breakers.admit(&job.tenant_id, &origin, now) {
        // The destination's breaker is open.
        d.holds.unsent(&sub.id, now);
        let tenant = job.tenant_id.clone();
        postpone(js, &key, job, until)?;
        telemetry::Shed { tenant: &tenant }.emit();
        return Ok(false);
    }
    let Some(payload_key) = jobs::payload_key_of(&key) else {
        d.breakers.unsent(&job.tenant_id, &origin, now);
        d.holds.unsent(&sub.id, now);
        return Ok(false);
    };
    let (event, sole) = match fresh.and_then(|i| views.of(i)) {
        // Created in this transaction: its payload's holders are in the staging.
        Some(event) => (event, js.staged_refcount(&payload_key) == Some(1)),
        None => {
            let Some(stored) = views.stored(js, p, payload_key)? else {
                // Its event is gone from the store (a payload record skipped at restore as
                // undecodable): it can never be sent. Dead-lettered, so the loss is on
                // `<prefix>.dlq` with its ids and counted, not a job that vanished unseen.
                d.breakers.unsent(&job.tenant_id, &origin, now);
                d.holds.unsent(&sub.id, now);
                job.last_error = Some(PAYLOAD_MISSING.to_string());
                let dl = jobs::dead_letter_without_attempt(
                    js,
                    &key,
                    job,
                    DeadLetterReason::Poison,
                    now,
                )?;
                emit_dead_letter(env, out, &dl)?;
                return Ok(false);
            };
            stored
        }
    };
    job.state = JobState::Leased;
    job.lease_until = Some(now + d.lease_ms);
    job.due_at = now + d.lease_ms;
    js.put_job(&key, &job, Some(old_due))?;
    // Only attempts count against the tenant's share: jobs shed, held or finished above do not
    // keep its other destinations' jobs from being claimed.
    let here = claimed_here.entry(job.tenant_id.clone()).or_default();
    here.attempts += 1;
    here.bytes += event.body.len();
    attempts.push(Attempt {
        partition: p,
        job_key: key,
        attempt: job.attempt,
        lease_until: job.due_at,
        event_id: job.event_key.clone(),
        tenant: job.tenant_id.clone(),
        subscription: sub,
        event,
        sole_payload: sole.then(jobs::payload_holds),
        holds_long: d.pace.holds_long(&job.tenant_id),
    });
    Ok(true)
}

/// Starts the first attempts of new events before the transaction commits, waits up to
/// `STREAMING_HUB_EARLY_ATTEMPT_WAIT` for them, and records the outcomes that came meanwhile in
/// this transaction. The wait ends early once `more_to_read` says new inbox records have come:
/// while the loop waits they cannot be taken in, so under a steady stream (5,000 events/s on a
/// 2-core machine) waiting for every attempt put the whole wait on the next events' latency
/// (BENCHMARKS.md, session 34). A job created and delivered within it leaves no write at all: its job,
/// timers and (with its event's last job) payload were new to the store, so their staged
/// writes are dropped rather than sent as records and tombstones. Where most attempts outlast
/// the wait (a slow destination), the next transactions start theirs early without waiting.
#[allow(clippy::too_many_arguments)]
fn attempt_early(
    env: &Env,
    d: &mut Dispatch,
    router: &OutcomeRouter,
    tasks: &mut HashMap<i32, Task>,
    staged: &mut HashMap<i32, Staged>,
    out: &mut Outputs<'_>,
    now: i64,
    early: Vec<Attempt>,
    more_to_read: &dyn Fn() -> bool,
) -> Result<EarlyStarted, HubError> {
    let keys: HashSet<Vec<u8>> = early.iter().map(|a| a.job_key.clone()).collect();
    // Each job's partition, key, and its two timers: as created (due now) and as claimed.
    let written: Vec<(i32, [Vec<u8>; 3])> = early
        .iter()
        .map(|a| {
            let timers = [
                a.job_key.clone(),
                jobs::due_key(&a.tenant, now, &a.job_key),
                jobs::due_key(&a.tenant, a.lease_until, &a.job_key),
            ];
            (a.partition, timers)
        })
        .collect();
    let launched = early.len();
    d.launch(early);
    let mut started = EarlyStarted {
        keys,
        written,
        launched,
        ended: 0,
    };
    if d.early_unwaited > 0 {
        d.early_unwaited -= 1;
        return Ok(started);
    }
    let from = d.pending.len();
    let (ended, cut) = d.wait_for(
        &started.keys,
        Instant::now() + env.config.early_attempt_wait,
        more_to_read,
    );
    started.ended = ended;
    // Other attempts of this loop ended meanwhile too: those of partitions it no longer owns go
    // to the loop that does, as before a transaction (the ones before `from` are all its own).
    d.hand_over(tasks, router, now);
    // A wait that new records cut short says nothing of how long the attempts take.
    if ended * 2 < launched && !cut {
        d.early_unwaited = EARLY_UNWAITED;
    }
    record_outcomes(env, d, tasks, staged, out, now, from)?;
    forget_delivered_early(staged, &started.written);
    Ok(started)
}

/// A transaction's first attempts started before it commits (see [`attempt_early`]).
struct EarlyStarted {
    /// Their job keys.
    keys: HashSet<Vec<u8>>,
    /// Each job's partition, key, and its two timers: as created (due now) and as claimed.
    written: Vec<(i32, [Vec<u8>; 3])>,
    launched: usize,
    /// How many ended within the wait.
    ended: usize,
}

/// Between a transaction's offsets ([`send_offsets`]) and its jobs changelog writes
/// ([`write_jobs_and_commit`]): the outcomes that came while the offsets went to the coordinator
/// (a round trip of a few ms, about as long as a local receiver takes) are recorded in this
/// transaction too, with no wait of its own, and an early attempt that delivered leaves no
/// write, as within the wait. Under a steady
/// stream the wait ends at once (new records came), so before this most first attempts ended
/// after it, and each such delivery wrote its job and payload and then their tombstones in the
/// next transaction. Counts the transaction's early attempts by when they ended.
#[allow(clippy::too_many_arguments)]
fn pick_up_early(
    env: &Env,
    d: &mut Dispatch,
    router: &OutcomeRouter,
    tasks: &mut HashMap<i32, Task>,
    staged: &mut HashMap<i32, Staged>,
    out: &mut Outputs<'_>,
    now: i64,
    early: &EarlyStarted,
) -> Result<(), HubError> {
    let from = d.pending.len();
    d.drain();
    let late = d.pending[from..]
        .iter()
        .filter(|o| early.keys.contains(&o.job_key))
        .count();
    telemetry::early_attempts(early.launched, early.ended, late);
    if d.pending.len() > from {
        // As after the wait: the ones before `from` are all this loop's own.
        d.hand_over(tasks, router, now);
        record_outcomes(env, d, tasks, staged, out, now, from)?;
        forget_delivered_early(staged, &early.written);
    }
    Ok(())
}

/// A job created and delivered in this transaction leaves no write: its job, its timers and
/// (with its event's last job) its payload were new to the store, so their staged writes are
/// dropped rather than sent as records and tombstones.
fn forget_delivered_early(staged: &mut HashMap<i32, Staged>, written: &[(i32, [Vec<u8>; 3])]) {
    for (p, [key, created, leased]) in written {
        let Some(st) = staged.get_mut(p) else {
            continue;
        };
        if st.get(JOBS, key) != Some(None) {
            continue; // not finished here (still leased, rescheduled) or not ours
        }
        st.forget(JOBS, key);
        st.forget(DUE, created);
        st.forget(DUE, leased);
        if let Some(pk) = jobs::payload_key_of(key) {
            if st.get(JOBS, &pk) == Some(None) {
                st.forget(JOBS, &pk);
            }
        }
    }
}

/// How long a delivery recorded on no lease is kept for a claim of its job (see
/// [`Dispatch::launch`]): an event read again after its transaction aborted is claimed within a
/// second or so, or after the restore of a partition that went and came back.
const UNRECORDED_KEPT_MS: i64 = 10_000;
/// Most such deliveries kept per loop.
const UNRECORDED_MAX: usize = 10_000;

/// A delivery recorded on no lease (its job not found, or leased again since): its transaction
/// aborted, and the event read again may be claimed anew. Kept for [`UNRECORDED_KEPT_MS`],
/// within its lease, for that claim to take instead of sending again.
fn keep_unrecorded(kept: &mut FastMap<Vec<u8>, (i64, Outcome)>, o: &Outcome, now: i64) {
    if !o.success() {
        return;
    }
    if kept.len() >= UNRECORDED_MAX {
        kept.retain(|_, (until, _)| *until > now);
        if kept.len() >= UNRECORDED_MAX {
            return;
        }
    }
    let until = o.lease_until.min(now + UNRECORDED_KEPT_MS);
    kept.insert(o.job_key.clone(), (until, o.clone()));
}

/// What attempt `a` takes from `o`, an attempt of the same job that ended: its delivery, when
/// it delivered to the URL `a` would send to (the request the receiver got, its delivery id and
/// response), on `a`'s lease. None: `a` is sent.
fn reused(o: &Outcome, a: &Attempt) -> Option<Outcome> {
    let d = &a.subscription.destination;
    // A URL sealed again (its path or query changed, shown the same) is another URL too.
    let same_url = o.url == d.url && o.target_nonce == crate::dispatch::worker::target_nonce(d);
    if !o.success() || o.job_key != a.job_key || !same_url {
        return None;
    }
    Some(Outcome {
        partition: a.partition,
        job_key: a.job_key.clone(),
        attempt: a.attempt,
        lease_until: a.lease_until,
        delivery_id: o.delivery_id.clone(),
        started_at: o.started_at,
        latency_ms: o.latency_ms,
        status: o.status,
        error_kind: None,
        retry_after_ms: None,
        response_body: o.response_body.clone(),
        ingest_ms: a.event.ingest_ms,
        tenant: a.tenant.clone(),
        sole_payload: a.sole_payload,
        body_bytes: a.event.body.len(),
        url: o.url.clone(),
        target_nonce: o.target_nonce,
    })
}

/// Transactions that start their early attempts without waiting for them after one where fewer
/// than half ended within the whole wait.
const EARLY_UNWAITED: u32 = 16;

/// How often the wait for early attempts looks whether records wait to be read.
const EARLY_WAIT_SLICE: Duration = Duration::from_millis(1);

/// Makes a due job due again at `until`, no attempt made or counted.
fn postpone(
    js: &mut JobStore<'_>,
    key: &[u8],
    mut job: JobRecord,
    until: i64,
) -> Result<(), HubError> {
    let old_due = job.due_at;
    job.due_at = until;
    job.state = JobState::Pending;
    job.lease_until = None;
    js.put_job(key, &job, Some(old_due))?;
    Ok(())
}

/// Samples the due-job backlog of every task for `/metrics`.
fn sample_backlog(stage: usize, tasks: &HashMap<i32, Task>, now: i64) {
    let mut per_tenant: HashMap<String, (usize, i64)> = HashMap::new();
    for task in tasks.values() {
        let Ok(tenants) = task.ring.backlog(&task.store, now, BACKLOG_CAP) else {
            continue;
        };
        for (t, n, oldest) in tenants {
            let e = per_tenant.entry(t).or_insert((0, oldest));
            e.0 += n;
            e.1 = e.1.min(oldest);
        }
    }
    let total = per_tenant.values().map(|(n, _)| n).sum();
    let mut ranked: Vec<(String, usize, f64)> = per_tenant
        .into_iter()
        .map(|(t, (n, oldest))| (t, n, now.saturating_sub(oldest).max(0) as f64 / 1000.0))
        .collect();
    ranked.sort_by(|a, b| b.2.total_cmp(&a.2));
    ranked.truncate(telemetry::BACKLOG_TENANTS);
    telemetry::due_backlog(stage, ranked, total);
}

/// A dead letter's `last_error` when its event's payload was not in the store.
pub const PAYLOAD_MISSING: &str = "payload_missing";

fn emit_dead_letter(
    env: &Env,
    out: &mut Outputs<'_>,
    dl: &DeadLetterRecord,
) -> Result<(), HubError> {
    telemetry::DeadLettered { record: dl }.emit();
    let bytes = env
        .codec
        .encode(RecordKind::DeadLetter, dl)
        .map_err(|e| HubError::Codec(e.to_string()))?;
    out.send(&env.dlq, None, dl.event_id.as_bytes(), Some(&bytes))
}

fn read_sequence(codec: &Codec, st: &Staged, store: &Store, tenant: &str) -> Result<u64, HubError> {
    match st.read(store, SEQUENCE, tenant.as_bytes())? {
        Some(b) => Ok(codec
            .decode::<SequenceRecord>(RecordKind::Sequence, &b)
            .map_err(|e| HubError::Codec(e.to_string()))?
            .next_sequence),
        None => Ok(0),
    }
}

/// How far apart the ingest times stamped on one inbox partition may run out of order (several
/// ingest instances write it, each stamping its records on its own clock before its transaction
/// commits): the dedup purge stays this far behind the newest ingest time read, and an ingest
/// time further ahead of this instance's clock counts as now plus this.
const INGEST_SKEW_MS: i64 = 5 * 60_000;

/// Deletes dedup entries whose time is up by `now`, oldest first, a bounded number per batch.
/// `now` is no later than the newest ingest time the task has read: a copy still in the inbox
/// behind it, ingested before an entry's expiry, must find the entry (copies are judged at
/// their ingest time).
///
/// The index is read from `from`, an expiry key no live one sorts before, and the key to read
/// from next time is returned (for once this batch has committed). Each purge deletes the front
/// of the index, and a RocksDB iterator steps over every deleted key until a compaction drops
/// it: seeking from the start, as before, each batch stepped over the deletions of every batch
/// since the last compaction (the timers' scans, which read the same way, spent 55% of the hub's
/// CPU on that before they got a mark; see `TenantRing::marks`). A key sorts before the mark
/// only if written with an expiry before the purge's `now`, which no batch writes (an entry
/// expires a TTL after `now` at least); one written anyway lowers the mark.
fn purge_expired(
    env: &Env,
    store: &Store,
    st: &mut Staged,
    out: &mut Outputs<'_>,
    partition: i32,
    now: i64,
    from: &[u8],
) -> Result<Vec<u8>, HubError> {
    // Only the expired keys at the front are read (copying 500 live keys per task per
    // transaction was half of the hub's CPU under load). As many as the batch writes, and 500
    // more: a hot tenant's partition (batches of thousands of new ids) or a catch-up would
    // otherwise write entries faster than they are purged.
    let budget = EXPIRY_PER_BATCH + st.puts_in(DEDUP_EXPIRY).count();
    let mut candidates: Vec<Vec<u8>> = Vec::new();
    store.visit_from(
        DEDUP_EXPIRY,
        from,
        budget,
        |ikey| match dedup::split_expiry_key(ikey) {
            Some((expires_at, _)) if expires_at > now => false,
            _ => {
                candidates.push(ikey.to_vec());
                true
            }
        },
    )?;
    // Past every candidate deleted, up to the first one this batch keeps.
    let mut next = from.to_vec();
    let mut kept = false;
    for ikey in candidates {
        let Some((expires_at, key)) = dedup::split_expiry_key(&ikey) else {
            continue;
        };
        if let Some(written) = st.get(DEDUP_EXPIRY, &ikey) {
            // Touched in this batch: a deletion goes anyway, a key written again stays.
            kept |= written.is_some();
            continue;
        }
        st.delete(DEDUP_EXPIRY, ikey.clone());
        if !kept {
            next.clone_from(&ikey);
        }
        let current = st.read(store, DEDUP, key)?;
        let still = current
            .and_then(|b| {
                env.codec
                    .decode::<DedupEntry>(RecordKind::DedupEntry, &b)
                    .ok()
            })
            .is_some_and(|e| e.expires_at == expires_at);
        if still {
            out.send(
                &env.jobs_changelog,
                Some(partition),
                &on_state_changelog(DEDUP_ON_STATE_CHANGELOG, key),
                None,
            )?;
            st.delete(DEDUP, key.to_vec());
            telemetry::DedupExpired { partition }.emit();
        }
    }
    if let Some(lowest) = st.puts_in(DEDUP_EXPIRY).min() {
        if lowest < next.as_slice() {
            next = lowest.to_vec();
        }
    }
    Ok(next)
}

/// An inbox record that is not an ingest output (someone else wrote to the inbox: ingest writes
/// only records with a tenant key and a `ce-id`) goes to the quarantine in the batch's
/// transaction, reason `inbox_record_invalid`, with the producers' forensic headers naming its
/// inbox place, instead of being dropped with a counter only: an operator finds it in
/// `GET /admin/quarantine` and the WARN line at commit.
fn quarantine_invalid(
    env: &Env,
    out: &mut Outputs<'_>,
    m: &BorrowedMessage<'_>,
    why: &'static str,
    now: i64,
) -> Result<(), HubError> {
    let (headers, oversized) = crate::ingest::pipeline::headers_of(m);
    let omit = m.payload().map_or(0, <[u8]>::len) > env.config.max_payload_bytes;
    let at = crate::ingest::pipeline::rfc3339_ms(now);
    let group = env.config.hub_group_id();
    let copy = crate::ingest::pipeline::QuarantineCopy::of(
        m,
        &headers,
        oversized,
        omit,
        &crate::ingest::pipeline::Why {
            reason: INBOX_RECORD_INVALID,
            cause_kind: "codec",
            message: why,
            at: &at,
            by: &group,
        },
    );
    out.send_record(copy.record(&env.quarantine))?;
    crate::runtime::telemetry::invalid_inbox_record(m.partition(), m.offset(), why);
    Ok(())
}

/// The quarantine reason of an inbox record that is not an ingest output.
pub const INBOX_RECORD_INVALID: &str = "inbox_record_invalid";

/// The most headers an ingest output carries: the producer's, within ingest's limits, 4 of
/// ingest's own, and a redelivery request's few, with room to spare.
const INBOX_MAX_HEADERS: usize = crate::ingest::pipeline::MAX_HEADERS + 16;
/// The most header bytes an ingest output carries, counted as ingest counts them.
const INBOX_MAX_HEADER_BYTES: usize = crate::ingest::pipeline::MAX_HEADER_BYTES + 16 * 1024;
/// The longest `ce-id` ingest takes.
const MAX_CE_ID_BYTES: usize = 256;

/// Tenant (the key), `ce-id` and the ingest time of an inbox record; or why it is not an ingest
/// output (someone else wrote to the inbox). Ingest's bounds are checked again: a record past
/// them (a `ce-id` of 600 KiB, a payload near the inbox's 2 MiB) made the hub's own records of
/// it (dedup, attempts, payload, dead letter) larger than their topics take, and a write the
/// broker refuses never clears: every batch aborted on it, the loop stopped, the process
/// restarted and met it again, the partition stalled for every tenant on it. The payload is held
/// to the largest `STREAMING_HUB_MAX_PAYLOAD_BYTES` takes, not the one set now: a record ingest
/// took before the setting was lowered is still its output.
fn identity<'m>(
    m: &'m BorrowedMessage<'_>,
) -> Result<(&'m str, &'m str, Option<i64>), &'static str> {
    // No control character (ingest quarantines them): a NUL ends the tenant in the store's
    // keys, and the jobs of `a\0b` were timed under `a`, never coming due.
    let usable = |s: &&str| !s.is_empty() && !crate::ingest::classify::has_control(s);
    let key = m
        .key()
        .ok_or("the record has no key (ingest keys each by its tenant id)")?;
    let tenant = std::str::from_utf8(key).ok().filter(usable).ok_or(
        "the record's key is not a tenant id (empty, not UTF-8, or with control characters)",
    )?;
    if tenant.len() > crate::ingest::tenant::MAX_TENANT_BYTES {
        return Err("the record's key is over 256 bytes, longer than any tenant id ingest takes");
    }
    if m.payload().map_or(0, <[u8]>::len) > crate::config::MAX_PAYLOAD_BYTES {
        return Err("the record's payload is larger than ingest takes at any setting");
    }
    use rdkafka::message::Headers;
    let headers = m.headers().ok_or("the record has no headers (no ce-id)")?;
    if headers.count() > INBOX_MAX_HEADERS {
        return Err("the record has more headers than ingest carries");
    }
    let mut bytes = 0;
    let mut ce_id = None;
    let mut ingest = None;
    for idx in 0..headers.count() {
        let Some((name, value)) = kafka::raw_header(headers, idx) else {
            continue;
        };
        bytes += name.len() + value.map_or(0, <[u8]>::len);
        match name {
            b"ce-id" => ce_id = value.and_then(|v| std::str::from_utf8(v).ok()),
            n if n == crate::ingest::pipeline::H_INGEST_TIME.as_bytes() => {
                ingest = value
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
                    .map(|t| t.timestamp_millis())
            }
            _ => {}
        }
    }
    if bytes > INBOX_MAX_HEADER_BYTES {
        return Err("the record's headers are larger than ingest carries");
    }
    let ce_id = ce_id.filter(usable).ok_or(
        "the record has no usable ce-id header (missing, empty, not UTF-8, or with control \
         characters)",
    )?;
    if ce_id.len() > MAX_CE_ID_BYTES {
        return Err("the record's ce-id is over 256 bytes, longer than ingest takes");
    }
    Ok((tenant, ce_id, ingest))
}

/// The subscription id of a redelivery request (`x-streaming-hub-redeliver`), if the record is one.
fn redelivery_of<'m>(m: &'m BorrowedMessage<'_>) -> Option<&'m str> {
    kafka::utf8_headers(m.headers()?)
        .find(|(key, _)| *key == crate::ops::redeliver::H_REDELIVER)
        .and_then(|(_, value)| value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .filter(|s| !s.is_empty())
}

/// Seeks each partition of an aborted batch back to the batch's first record of it, so the next
/// batch reads them again. A seek that fails does not let the next batch read past the aborted
/// records (a review asked; librdkafka 2.12's source says): the seek raises the partition's
/// version barrier before it waits, so whatever was fetched from the old position is dropped at
/// the next poll, and one that times out is still applied when its partition's thread gets to
/// it. The errors that refuse a seek outright (`__STATE`, a seek already in progress, an
/// unknown partition) mean the partition is not being fetched: given up, or not started. So a
/// failure is logged, not acted on (stopping the loop, tried this session, restarted every
/// instance on a broker outage; pausing the partition blocks on the same thread the seek
/// timed out on).
fn rewind(consumer: &BaseConsumer<HubContext>, batch: &[BorrowedMessage<'_>]) {
    let mut first: HashMap<(&str, i32), i64> = HashMap::new();
    for m in batch {
        first
            .entry((m.topic(), m.partition()))
            .or_insert(m.offset());
    }
    for ((topic, p), o) in first {
        if let Err(e) = consumer.seek(topic, p, Offset::Offset(o), Duration::from_secs(5)) {
            tracing::info!(partition = p, offset = o, error = %e, "rewind not confirmed");
        }
    }
}

/// Whether what a hub transaction emitted goes out (see `telemetry::Staging`): it committed, had
/// nothing to do, or its commit's outcome is unknown (the process ends as if it committed, as
/// ingest counts it); an aborted one's is dropped, its batch runs again.
fn counts_as_committed<T>(result: &Result<T, HubError>) -> bool {
    matches!(result, Ok(_) | Err(HubError::Idle | HubError::Undecided(_)))
}

/// Aborts the open transaction ([`kafka::abort_waiting`]), then serves the delivery reports of
/// what the abort purged and forgets them: left queued, the next transaction's wait for its own
/// records served them and took a purged record's failure for one of its writes, and aborted too
/// (seen once in a `scale-out` load run, right after an offsets refusal, as "a changelog write
/// failed: ... PurgeQueue"; `abort_waiting`'s flush before the abort serves the reports of what
/// ends within it, so only records still in flight after it, under load, meet this).
fn abort_and_forget(producer: &BaseProducer<TrackingContext>) -> Result<(), RdKafkaError> {
    kafka::abort_waiting(producer, TXN_TIMEOUT, ABORT_PATIENCE)?;
    let _ = producer.flush(Duration::from_secs(1));
    let _ = producer.context().take();
    Ok(())
}

fn fatal_or_kafka(e: RdKafkaError) -> HubError {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch,
        ) => HubError::Fenced(e.to_string()),
        _ => HubError::Kafka(KafkaError::from(e)),
    }
}

/// As [`fatal_or_kafka`], and a commit librdkafka left running after its patience
/// (`kafka::commit_undecided`) is `Undecided`: an abort would be refused.
fn undecided_or_kafka(e: RdKafkaError) -> HubError {
    if kafka::commit_undecided(&e) {
        HubError::Undecided(e.to_string())
    } else {
        fatal_or_kafka(e)
    }
}

/// Forgets the records of partitions revoked during the last poll (the rebalance callback runs
/// inside it): their next owner processes them. A partition that comes back starts again from
/// its committed offset, which is past these records if another instance had it in between, so
/// they are not sought back to; its high mark is cleared so the records are taken again.
fn forget_revoked(
    consumer: &BaseConsumer<HubContext>,
    batch: &mut Vec<BorrowedMessage<'_>>,
    last: &mut HashMap<i32, i64>,
) {
    let revoked = std::mem::take(
        &mut consumer
            .context()
            .shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .revoked,
    );
    if revoked.is_empty() {
        return;
    }
    batch.retain(|m| !revoked.contains(&m.partition()));
    for p in &revoked {
        last.remove(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store is restored from its offsets only when its stamp dates it within the tombstones'
    /// safe window, and a stamp from a clock that ran ahead does not pass for a fresh one.
    #[test]
    fn a_store_stamped_ahead_of_the_clock_is_not_taken_for_current() {
        let now = 1_800_000_000_000;
        let (h, m) = (3_600_000, 60_000);
        assert!(!dated_current(None, now), "no stamp");
        assert!(dated_current(Some(now), now));
        assert!(dated_current(Some(now - 12 * h), now));
        assert!(!dated_current(Some(now - 12 * h - 1), now), "stale");
        assert!(dated_current(Some(now + 5 * m), now), "a time sync's step");
        assert!(!dated_current(Some(now + 5 * m + 1), now));
        assert!(
            !dated_current(Some(now + 48 * h), now),
            "a clock that ran ahead"
        );
        assert!(!dated_current(Some(i64::MIN), now));
        assert!(!dated_current(Some(i64::MAX), now));
    }

    fn attempt_to(url: &str, lease_until: i64) -> Attempt {
        let mut sub = crate::runtime::records::SubscriptionRecord::pull("s1", "t1", &["*"]);
        sub.destination.kind = crate::runtime::records::DestinationType::Webhook;
        sub.destination.url = Some(url.into());
        Attempt {
            partition: 3,
            job_key: jobs::job_key("t1", "e1", "s1"),
            attempt: 1,
            lease_until,
            event_id: "e1".into(),
            tenant: "t1".into(),
            subscription: Arc::new(sub),
            event: crate::dispatch::EventView::new(
                std::iter::empty::<(&str, Option<&[u8]>)>(),
                bytes::Bytes::from_static(b"{}"),
            ),
            sole_payload: Some(7),
            holds_long: false,
        }
    }

    fn delivered_to(url: &str, lease_until: i64) -> Outcome {
        Outcome {
            partition: 3,
            job_key: jobs::job_key("t1", "e1", "s1"),
            attempt: 1,
            lease_until,
            delivery_id: "d-first".into(),
            started_at: 1_000,
            latency_ms: 40,
            status: Some(204),
            error_kind: None,
            retry_after_ms: None,
            response_body: Some(b"ok".to_vec()),
            ingest_ms: Some(900),
            tenant: "t1".into(),
            sole_payload: None,
            body_bytes: 2,
            url: Some(url.into()),
            target_nonce: None,
        }
    }

    #[test]
    fn a_claim_takes_an_earlier_delivery_of_its_job_only_to_the_same_url() {
        let a = attempt_to("https://a.example/hook", 90_000);
        let taken = reused(&delivered_to("https://a.example/hook", 50_000), &a).unwrap();
        // The request the receiver got, recorded on the new claim's lease.
        assert_eq!(taken.delivery_id, "d-first");
        assert_eq!(taken.status, Some(204));
        assert_eq!(taken.started_at, 1_000);
        assert_eq!((taken.attempt, taken.lease_until), (1, 90_000));
        assert_eq!(taken.sole_payload, Some(7));
        assert!(taken.success());
        // Sent elsewhere (the URL changed since): this claim's URL still gets its request.
        assert!(reused(&delivered_to("https://b.example/hook", 50_000), &a).is_none());
        // So with a sealed query: shown the same, sealed again when its values changed.
        let blob = |nonce: u8| crate::runtime::records::EncryptedBlob {
            key_id: "k1".into(),
            nonce: vec![nonce; 12],
            ciphertext: vec![0; 20],
        };
        let mut sealed = attempt_to("https://a.example/hook?code=***", 90_000);
        Arc::make_mut(&mut sealed.subscription)
            .destination
            .sealed_target = Some(blob(2));
        let mut earlier = delivered_to("https://a.example/hook?code=***", 50_000);
        earlier.target_nonce = Some([1; 12]);
        assert!(reused(&earlier, &sealed).is_none());
        earlier.target_nonce = Some([2; 12]);
        assert!(reused(&earlier, &sealed).is_some());
        earlier.target_nonce = None;
        assert!(reused(&earlier, &sealed).is_none());
        // A failure proves nothing delivered.
        let mut failed = delivered_to("https://a.example/hook", 50_000);
        failed.error_kind = Some("bad_status".into());
        failed.status = Some(500);
        assert!(reused(&failed, &a).is_none());
        // Another job's delivery.
        let mut other = delivered_to("https://a.example/hook", 50_000);
        other.job_key = jobs::job_key("t1", "e2", "s1");
        assert!(reused(&other, &a).is_none());
    }

    #[test]
    fn only_deliveries_are_kept_unrecorded_and_for_at_most_their_lease() {
        let mut kept = FastMap::default();
        let mut failed = delivered_to("https://a.example/hook", 50_000);
        failed.error_kind = Some("timeout".into());
        keep_unrecorded(&mut kept, &failed, 45_000);
        assert!(kept.is_empty());
        keep_unrecorded(
            &mut kept,
            &delivered_to("https://a.example/hook", 50_000),
            45_000,
        );
        assert_eq!(kept.values().next().map(|(until, _)| *until), Some(50_000));
        keep_unrecorded(
            &mut kept,
            &delivered_to("https://a.example/hook", 90_000),
            45_000,
        );
        assert_eq!(
            kept.values().next().map(|(until, _)| *until),
            Some(45_000 + UNRECORDED_KEPT_MS)
        );
    }

    /// A store another loop of this process still holds is opened once it is closed; a
    /// cancelled restore stops waiting.
    #[test]
    fn a_restore_waits_for_a_store_another_loop_still_holds() {
        let dir = tempfile::tempdir().unwrap();
        let held = Store::open(dir.path(), &FAMILIES).unwrap();
        let cancel = AtomicBool::new(false);
        let refused = open_when_free(dir.path(), 3, &cancel, Duration::ZERO).err();
        assert!(
            refused.as_ref().is_some_and(|e| is_held(e, dir.path())),
            "a second open in one process is refused: {refused:?}"
        );
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        let opened = open_when_free(dir.path(), 3, &cancel, Duration::from_secs(30));
        closer.join().unwrap();
        assert!(opened.is_ok(), "{:?}", opened.err());
        let again = opened.unwrap();
        cancel.store(true, Ordering::SeqCst);
        let cancelled = open_when_free(dir.path(), 3, &cancel, Duration::from_secs(30));
        assert!(
            matches!(cancelled, Err(HubError::Kafka(KafkaError::Cancelled))),
            "{:?}",
            cancelled.err()
        );
        drop(again);
    }

    /// RocksDB finding a store corrupt at open (here its CURRENT file garbled) is not a loop
    /// failing at every start: the store is discarded and restored from the changelogs' start.
    #[test]
    fn a_corrupt_store_is_discarded_to_be_restored_not_a_crash_loop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub-3");
        drop(Store::open(&path, &FAMILIES).unwrap());
        std::fs::write(path.join("CURRENT"), b"no such manifest").unwrap();
        let refused = Store::open(&path, &FAMILIES).err();
        assert!(
            refused
                .as_ref()
                .is_some_and(|e| matches!(e, crate::runtime::store::StoreError::Rocks(r) if r.kind() == rocksdb::ErrorKind::Corruption)),
            "{refused:?}"
        );
        let (store, current_at) = open_current(&path, 3).unwrap();
        assert_eq!(current_at, None, "restored from the start");
        assert_eq!(store.changelog_offset(JOBS).unwrap(), None);
        drop(store);
        assert!(Store::open(&path, &FAMILIES).is_ok(), "a sound store now");
    }

    #[test]
    fn restore_skips_a_state_record_that_does_not_decode_and_stands_in_for_a_job() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &FAMILIES).unwrap();
        let codec = Codec::new().unwrap();
        let key = b"j/t1\0e1\0s1".to_vec();
        let job = JobRecord {
            event_key: "e1".into(),
            subscription_id: "s1".into(),
            tenant_id: "t1".into(),
            attempt: 1,
            due_at: 42,
            lease_until: None,
            reclaims: 0,
            last_status: None,
            last_error: None,
            state: JobState::Pending,
        };
        let good = crate::runtime::fast_avro::encode_job(&codec, &job).unwrap();
        let mut st = Staged::default();
        let t = restore_one(&store, &codec, &mut st, JOBS, &key, Some(&good)).unwrap();
        assert_eq!(t.as_deref(), Some("t1"));
        store.apply(st, &[]).unwrap();
        let due = jobs::due_key("t1", 42, &key);
        assert!(store.get(DUE, &due).unwrap().is_some());

        // The same key again, as bytes that are no job: a stand-in named by the key takes its
        // place, due at once from its first attempt, its old timer gone.
        let mut st = Staged::default();
        for garbage in [&b"not avro"[..], &good[..good.len() - 3]] {
            let t = restore_one(&store, &codec, &mut st, JOBS, &key, Some(garbage)).unwrap();
            assert_eq!(t.as_deref(), Some("t1"));
        }
        let dedup_key = on_state_changelog(DEDUP_ON_STATE_CHANGELOG, b"t1\0e1");
        restore_one(&store, &codec, &mut st, JOBS, &dedup_key, Some(&good)).unwrap();
        restore_one(&store, &codec, &mut st, JOBS, b"p/t1\0e1", Some(&good)).unwrap();
        // A payload whose header is right but whose body is cut short is no payload either; a
        // whole one is kept.
        let payload =
            crate::runtime::fast_avro::encode_payload(&codec, std::iter::empty(), b"{}", 1);
        let cut = &payload[..payload.len() - 2];
        restore_one(&store, &codec, &mut st, JOBS, b"p/t1\0e2", Some(cut)).unwrap();
        restore_one(&store, &codec, &mut st, JOBS, b"p/t1\0e3", Some(&payload)).unwrap();
        store.apply(st, &[]).unwrap();
        assert_eq!(store.get(JOBS, b"p/t1\0e2").unwrap(), None);
        assert_eq!(store.get(JOBS, b"p/t1\0e3").unwrap(), Some(payload));
        let stand_in =
            crate::runtime::fast_avro::job(&codec, &store.get(JOBS, &key).unwrap().unwrap())
                .unwrap();
        assert_eq!(
            (
                stand_in.tenant_id.as_str(),
                stand_in.event_key.as_str(),
                stand_in.subscription_id.as_str(),
                stand_in.attempt,
                stand_in.due_at,
                stand_in.state,
                stand_in.last_error.as_deref()
            ),
            (
                "t1",
                "e1",
                "s1",
                1,
                0,
                JobState::Pending,
                Some(JOB_UNDECODABLE)
            )
        );
        assert_eq!(store.get(DUE, &due).unwrap(), None);
        assert!(
            store
                .get(DUE, &jobs::due_key("t1", 0, &key))
                .unwrap()
                .is_some()
        );
        // A key that names no job is dropped.
        let mut st = Staged::default();
        restore_one(&store, &codec, &mut st, JOBS, b"j/t1\0e9", Some(b"x")).unwrap();
        store.apply(st, &[]).unwrap();
        assert_eq!(store.get(JOBS, b"j/t1\0e9").unwrap(), None);
        assert_eq!(
            store.get(DEDUP, b"t1\0e1").unwrap(),
            None,
            "a job is no dedup entry"
        );
        assert_eq!(store.get(JOBS, b"p/t1\0e1").unwrap(), None, "nor a payload");

        // A schema this version does not know fails the restore, saying so.
        let mut newer = good.clone();
        newer[2..10].copy_from_slice(&[0xEE; 8]);
        let mut st = Staged::default();
        let e = restore_one(&store, &codec, &mut st, JOBS, &key, Some(&newer)).unwrap_err();
        assert!(e.contains("newer version"), "{e}");
    }

    /// The dedup purge reads its index from where the last committed purge got to, not over the
    /// deletions of every purge since the last compaction (RocksDB's own count of the deleted
    /// keys an iterator stepped over), and a key written below that point still gets purged.
    #[test]
    fn the_dedup_purge_seeks_past_what_it_purged_before() {
        use rdkafka::config::ClientConfig;
        use rocksdb::perf::{PerfContext, PerfMetric, PerfStatsLevel, set_perf_stats};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), &FAMILIES).unwrap();
        let codec = Arc::new(Codec::new().unwrap());
        let env = Env {
            config: Config::from_vars(std::iter::empty()).unwrap(),
            codec: codec.clone(),
            inbox: "t.inbox".into(),
            dedup_changelog: "t.dedup".into(),
            sequence_changelog: "t.sequence".into(),
            jobs_changelog: "t.jobs".into(),
            attempts: "t.attempts".into(),
            dlq: "t.dlq".into(),
            control: "t.control".into(),
            quarantine: "t.quarantine".into(),
        };
        // Nothing is sent: the records only queue.
        let producer: BaseProducer<TrackingContext> = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:1")
            .create_with_context(TrackingContext::default())
            .unwrap();
        let entry = |ce_id: &str, expires_at: i64| {
            let e = DedupEntry {
                tenant_id: "t1".into(),
                ce_id: ce_id.into(),
                inbox_partition: 0,
                first_offset: 0,
                sequence: 0,
                expires_at,
            };
            codec.encode(RecordKind::DedupEntry, &e).unwrap()
        };
        let write = |st: &mut Staged, i: i64, expires_at: i64| {
            let key = dedup::dedup_key("t1", &format!("e{i:05}"));
            st.put(
                DEDUP_EXPIRY,
                dedup::expiry_key(expires_at, &key),
                Vec::new(),
            );
            st.put(DEDUP, key, entry(&format!("e{i:05}"), expires_at));
        };
        const N: i64 = 5 * EXPIRY_PER_BATCH as i64;
        let mut st = Staged::default();
        for i in 0..N {
            write(&mut st, i, 1_000 + i);
        }
        store.apply(st, &[]).unwrap();
        set_perf_stats(PerfStatsLevel::EnableCount);
        let mut perf = PerfContext::default();
        let mut mark = Vec::new();
        for round in 0..6 {
            let mut st = Staged::default();
            if round == 3 {
                // A key below the mark (no batch writes one: its expiry is before the purge's
                // `now`): the mark goes back to it.
                write(&mut st, N, 1);
            }
            perf.reset();
            let next = purge_expired(
                &env,
                &store,
                &mut st,
                &mut Outputs {
                    producer: &producer,
                },
                0,
                1_000_000,
                &mark,
            )
            .unwrap();
            let stepped_over = perf.metric(PerfMetric::InternalDeleteSkippedCount);
            // Round 4 reads from the key written below the mark, over what rounds 0-3 deleted
            // (at least 1,500 keys; every round without the mark would).
            assert!(
                stepped_over <= 2 || round == 4,
                "round {round} stepped over {stepped_over} deleted keys"
            );
            assert!(
                next >= mark || round == 3,
                "round {round}: the mark went back"
            );
            mark = next;
            store.apply(st, &[]).unwrap();
        }
        let left = store.scan_from(DEDUP, &[], usize::MAX).unwrap().len();
        let index = store
            .scan_from(DEDUP_EXPIRY, &[], usize::MAX)
            .unwrap()
            .len();
        assert_eq!((left, index), (0, 0), "every expired entry purged");
    }

    fn outcome(partition: i32, lease_until: i64) -> Outcome {
        Outcome {
            partition,
            job_key: format!("j/t\0e-{partition}-{lease_until}\0s").into_bytes(),
            attempt: 1,
            lease_until,
            delivery_id: "d".into(),
            started_at: 0,
            latency_ms: 1,
            status: Some(200),
            error_kind: None,
            retry_after_ms: None,
            response_body: None,
            ingest_ms: None,
            tenant: "t".into(),
            sole_payload: None,
            body_bytes: 0,
            url: None,
            target_nonce: None,
        }
    }

    #[test]
    fn the_recount_window_is_counted_in_records_read_not_in_offsets() {
        // Committed at 100, three records of the previous owner's batch at most, the log ended
        // at 120 when the partition was assigned. Offsets 101 and 103 are transaction markers.
        let mut w = Recount {
            seen: 100..100,
            left: 3,
            until: 120,
        };
        let taken: Vec<bool> = [100, 102, 104, 105].iter().map(|o| w.take(*o)).collect();
        assert_eq!(
            taken,
            [true, true, true, false],
            "three records, not three offsets"
        );
        // Read again after an abort: still inside, and not counted again.
        assert!(w.take(102) && w.take(104));
        assert!(!w.take(106));
        // Records written after the assignment were never read by anyone before.
        let mut w = Recount {
            seen: 100..100,
            left: 50,
            until: 102,
        };
        let taken: Vec<bool> = [100, 101, 102, 103].iter().map(|o| w.take(*o)).collect();
        assert_eq!(taken, [true, true, false, false]);
        assert!(
            !Recount::none(100).take(100),
            "never committed: nothing counted"
        );
    }

    #[test]
    fn state_changelog_keys_go_back_to_the_family_and_key_they_came_from() {
        let dedup = dedup::dedup_key("tenant-1", "0190-id");
        let on = on_state_changelog(DEDUP_ON_STATE_CHANGELOG, &dedup);
        assert_eq!(from_state_changelog(&on), (DEDUP, dedup.as_slice()));
        let on = on_state_changelog(SEQUENCE_ON_STATE_CHANGELOG, b"tenant-1");
        assert_eq!(
            from_state_changelog(&on),
            (SEQUENCE, b"tenant-1".as_slice())
        );
        // Every key the jobs family writes stays a jobs key.
        for key in [
            jobs::job_key("tenant-1", "0190-id", "sub-1"),
            jobs::payload_key("tenant-1", "0190-id"),
            crate::dispatch::health::health_key("sub-1"),
        ] {
            assert_eq!(from_state_changelog(&key), (JOBS, key.as_slice()));
        }
    }

    #[test]
    fn an_outcome_goes_to_the_loop_that_owns_its_partition_now() {
        let router = OutcomeRouter::default();
        let (rx0, rx1) = (router.join(0), router.join(1));
        router.took(0, &[1, 2]);
        router.gave_up(0, &[2]);
        router.took(1, &[2]);
        router.hand_over(0, outcome(2, 1_000), 10);
        let got: Vec<i32> = rx1.try_iter().map(|o| o.partition).collect();
        assert_eq!(got, vec![2]);
        assert!(rx0.try_iter().next().is_none());
    }

    #[test]
    fn an_outcome_waits_for_its_partition_to_be_taken_past_its_lease_but_not_for_ever() {
        let router = OutcomeRouter::default();
        let rx1 = router.join(1);
        router.took(0, &[3]);
        router.gave_up(0, &[3]);
        // Between the revoke and the assignment: parked, a lease just over too (the new owner's
        // outcome check decides).
        router.hand_over(0, outcome(3, 1_000), 10);
        router.hand_over(0, outcome(3, 5), 10);
        assert!(rx1.try_iter().next().is_none());
        router.took(1, &[3]);
        let got: Vec<i64> = rx1.try_iter().map(|o| o.lease_until).collect();
        assert_eq!(got, vec![1_000, 5]);
        // Parked outcomes long past their lease are dropped when the next one is parked.
        router.gave_up(1, &[3]);
        router.hand_over(1, outcome(3, 20), 10);
        router.hand_over(1, outcome(4, 1_000), PARKED_FOR + 30);
        router.took(1, &[3]);
        assert!(rx1.try_iter().next().is_none());
        // And one long over is not parked at all.
        router.gave_up(1, &[3]);
        router.hand_over(1, outcome(3, 5), PARKED_FOR + 5);
        router.took(1, &[3]);
        assert!(rx1.try_iter().next().is_none());
    }
}
