//! One typed event per observable thing. Each event both logs (structured, `tracing`) and counts
//! (`metrics`) with fixed labels, so metric names live here and nowhere else.
//!
//! Metric names (Prometheus): `streaming_hub_ingest_records_total{topic,verdict,reason}`,
//! `streaming_hub_ingest_commits_total{outcome}`, `streaming_hub_ingest_commit_seconds`,
//! `streaming_hub_ingest_batch_records`.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use metrics::{counter, gauge, histogram};

use crate::config::MAX_HUB_STAGES;

/// What a hub transaction emits (counters, and the log lines that report a fact of it: an
/// attempt, a dead letter, a breaker's or a subscription's change) waits for its outcome: an
/// aborted batch is processed again, and emitting as it ran counted it once per try.
type Deferred = Box<dyn FnOnce()>;

thread_local! {
    /// The open hub transaction's emits on this thread; None: none open, emits go out at once.
    static STAGED: std::cell::RefCell<Option<Vec<Deferred>>> =
        const { std::cell::RefCell::new(None) };
}

/// A hub transaction's emits, held from [`Staging::begin`] until [`Staging::end`] says whether
/// it committed (dropped unsaid: aborted). One begun inside another (a rebalance's commit inside
/// a poll) holds its own and gives the outer one back.
pub struct Staging {
    outer: Option<Vec<Deferred>>,
    done: bool,
}

impl Staging {
    pub fn begin() -> Staging {
        let outer = STAGED.with(|s| s.borrow_mut().replace(Vec::new()));
        Staging { outer, done: false }
    }

    /// The transaction ended: its emits go out when it `committed`, else are dropped.
    pub fn end(mut self, committed: bool) {
        self.finish(committed);
    }

    fn finish(&mut self, committed: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let outer = self.outer.take();
        let mine = STAGED.with(|s| std::mem::replace(&mut *s.borrow_mut(), outer));
        if committed {
            for emit in mine.into_iter().flatten() {
                emit();
            }
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// The open hub transaction on this thread has committed: what it emitted goes out now, before
/// the attempts of its committed claims are launched and its stores apply it (a reader that sees
/// its offsets finds it counted; a first attempt started early may still reach its receiver
/// before). Later emits of the same staging wait for its end as before.
pub fn committed() {
    let now = STAGED.with(|s| s.borrow_mut().as_mut().map(std::mem::take));
    for emit in now.into_iter().flatten() {
        emit();
    }
}

/// `emit` once the open hub transaction on this thread commits, or now when none is open.
fn on_commit(emit: impl FnOnce() + 'static) {
    let emit = STAGED.with(|s| match &mut *s.borrow_mut() {
        Some(staged) => {
            staged.push(Box::new(emit));
            None
        }
        None => Some(emit),
    });
    if let Some(emit) = emit {
        emit();
    }
}

pub const INGEST_RECORDS: &str = "streaming_hub_ingest_records_total";
pub const INGEST_COMMITS: &str = "streaming_hub_ingest_commits_total";
pub const INGEST_COMMIT_SECONDS: &str = "streaming_hub_ingest_commit_seconds";
pub const INGEST_BATCH_RECORDS: &str = "streaming_hub_ingest_batch_records";

/// A record got its verdict (counted per record; logged at debug, with its `ce-id`, except
/// quarantines, logged at warn: an operator wants to see those).
pub struct IngestVerdict<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub ce_id: Option<&'a str>,
    pub verdict: &'static str,
    pub reason: &'static str,
    pub message: &'a str,
}

impl IngestVerdict<'_> {
    /// Its log line: WARN for a quarantine, DEBUG otherwise. (Counted by [`IngestTally`].)
    pub fn log(&self) {
        if self.verdict == "quarantine" {
            tracing::warn!(
                topic = self.topic,
                partition = self.partition,
                offset = self.offset,
                ce_id = self.ce_id.unwrap_or(""),
                reason = self.reason,
                message = self.message,
                "record quarantined"
            );
        } else {
            tracing::debug!(
                topic = self.topic,
                partition = self.partition,
                offset = self.offset,
                ce_id = self.ce_id.unwrap_or(""),
                verdict = self.verdict,
                "record classified"
            );
        }
    }
}

/// The verdicts of one ingest batch, counted in `streaming_hub_ingest_records_total` and (for
/// quarantines) logged once its transaction has committed: an aborted batch is read and routed
/// again, and counting each record as it was routed counted it once per try.
#[derive(Default)]
pub struct IngestTally<'a> {
    counts: Vec<(&'a str, &'static str, &'static str, u64)>,
    quarantines: Vec<QuarantineLine<'a>>,
}

struct QuarantineLine<'a> {
    topic: &'a str,
    partition: i32,
    offset: i64,
    ce_id: Option<String>,
    reason: &'static str,
    message: String,
}

impl<'a> IngestTally<'a> {
    /// Notes one record's verdict (`topic` is `v.topic`, borrowed for as long as the tally); its
    /// DEBUG line goes out now, a quarantine's WARN with the counts.
    pub fn note(&mut self, topic: &'a str, v: &IngestVerdict<'_>) {
        // A batch has a handful of (topic, verdict, reason) keys: a scan beats a map.
        match self.counts.iter_mut().find(|(t, verdict, reason, _)| {
            *verdict == v.verdict && *reason == v.reason && *t == topic
        }) {
            Some(c) => c.3 += 1,
            None => self.counts.push((topic, v.verdict, v.reason, 1)),
        }
        if v.verdict != "quarantine" {
            v.log();
        } else {
            self.quarantines.push(QuarantineLine {
                topic,
                partition: v.partition,
                offset: v.offset,
                ce_id: v.ce_id.map(str::to_string),
                reason: v.reason,
                message: v.message.to_string(),
            });
        }
    }

    /// Counts and logs the batch, once its transaction has committed.
    pub fn emit(self) {
        for (topic, verdict, reason, n) in self.counts {
            counter!(INGEST_RECORDS, "topic" => topic.to_string(), "verdict" => verdict, "reason" => reason)
                .increment(n);
        }
        for q in self.quarantines {
            IngestVerdict {
                topic: q.topic,
                partition: q.partition,
                offset: q.offset,
                ce_id: q.ce_id.as_deref(),
                verdict: "quarantine",
                reason: q.reason,
                message: &q.message,
            }
            .log();
        }
    }
}

/// A batch transaction committed or aborted.
pub struct IngestCommit {
    pub records: usize,
    pub took: Duration,
    pub outcome: CommitOutcome,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    Committed,
    Aborted,
}

impl IngestCommit {
    pub fn emit(&self, error: Option<&str>) {
        let outcome = match self.outcome {
            CommitOutcome::Committed => "committed",
            CommitOutcome::Aborted => "aborted",
        };
        counter!(INGEST_COMMITS, "outcome" => outcome).increment(1);
        if self.outcome == CommitOutcome::Committed {
            histogram!(INGEST_COMMIT_SECONDS).record(self.took.as_secs_f64());
            histogram!(INGEST_BATCH_RECORDS).record(self.records as f64);
            tracing::trace!(
                records = self.records,
                took_ms = self.took.as_millis() as u64,
                "ingest batch committed"
            );
        } else {
            tracing::warn!(
                records = self.records,
                error = error.unwrap_or(""),
                "ingest batch aborted; it will be read again"
            );
        }
    }
}

/// Partitions moved to or from this instance.
pub struct Rebalance<'a> {
    pub stage: &'static str,
    pub kind: &'static str,
    pub partitions: &'a str,
}

impl Rebalance<'_> {
    pub fn emit(&self) {
        tracing::info!(
            stage = self.stage,
            kind = self.kind,
            partitions = self.partitions,
            "rebalance"
        );
    }
}

pub const HUB_EVENTS: &str = "streaming_hub_hub_events_total";
pub const HUB_COMMIT_SECONDS: &str = "streaming_hub_hub_commit_seconds";
pub const HUB_BATCH_RECORDS: &str = "streaming_hub_hub_batch_records";
pub const RESTORE_RECORDS: &str = "streaming_hub_restore_records_total";
pub const RESTORE_SECONDS: &str = "streaming_hub_restore_seconds";
pub const DEDUP_EXPIRED: &str = "streaming_hub_dedup_expired_total";

/// The hub task's decision on one inbox record: `new`, `replay`, `duplicate` or `invalid`.
pub struct HubEvent<'a> {
    pub outcome: &'static str,
    pub partition: i32,
    pub offset: i64,
    pub ce_id: &'a str,
}

impl HubEvent<'_> {
    pub fn emit(&self) {
        let outcome = self.outcome;
        on_commit(move || counter!(HUB_EVENTS, "outcome" => outcome).increment(1));
        tracing::debug!(
            outcome = self.outcome,
            partition = self.partition,
            offset = self.offset,
            ce_id = self.ce_id,
            "hub event"
        );
    }
}

/// An inbox record that is not an ingest output, quarantined by the hub: a WARN line when its
/// transaction commits (counted as `HubEvent` `invalid`).
pub fn invalid_inbox_record(partition: i32, offset: i64, why: &'static str) {
    on_commit(move || {
        tracing::warn!(
            partition,
            offset,
            why,
            "an inbox record that is not an ingest output was quarantined (inbox_record_invalid): \
             something other than ingest writes to the inbox"
        )
    });
}

pub const TXN_PHASE_SECONDS: &str = "streaming_hub_txn_phase_seconds";

/// Where a committed transaction's time went, per stage (`ingest`, `hub`) and phase: `work`
/// (records processed and sent), `offsets` (`send_offsets_to_transaction`), `delivered`
/// (waiting for the records' acknowledgements), `commit` (`commit_transaction`), `apply`
/// (the hub's store writes after the commit).
pub fn txn_phase(stage: &'static str, phase: &'static str, took: Duration) {
    histogram!(TXN_PHASE_SECONDS, "stage" => stage, "phase" => phase).record(took.as_secs_f64());
}

pub const EARLY_ATTEMPTS: &str = "streaming_hub_early_attempts_total";

/// A hub transaction started `launched` first attempts of new events before committing:
/// `within_wait` came back within its wait for them, `before_writes` after it but before the
/// transaction's jobs changelog writes (both recorded in that transaction), the rest later
/// (`after_wait`, recorded in a later one).
/// Counted once the transaction commits.
pub fn early_attempts(launched: usize, within_wait: usize, before_writes: usize) {
    on_commit(move || {
        counter!(EARLY_ATTEMPTS, "ended" => "within_wait").increment(within_wait as u64);
        counter!(EARLY_ATTEMPTS, "ended" => "before_writes").increment(before_writes as u64);
        let after = launched.saturating_sub(within_wait + before_writes);
        counter!(EARLY_ATTEMPTS, "ended" => "after_wait").increment(after as u64);
    });
}

pub const RESENDS_AVOIDED: &str = "streaming_hub_resends_avoided_total";

/// A claim took the delivery of an earlier attempt of its job instead of sending the event again
/// (its transaction had aborted): `how` = `waited` (that attempt was still in flight) or
/// `delivered` (it had ended).
pub fn resend_avoided(how: &'static str) {
    counter!(RESENDS_AVOIDED, "how" => how).increment(1);
}

pub const ATTEMPTS_UNSENT: &str = "streaming_hub_attempts_unsent_total";

/// A claimed attempt handed back unsent: it waited for a worker until too little of its lease was
/// left to finish within it (claims ahead of slow destinations). Its job is due again at once,
/// with no attempt counted, and is claimed again.
pub fn attempt_unsent() {
    counter!(ATTEMPTS_UNSENT).increment(1);
}

pub const HUB_BATCHES_RUN_AGAIN: &str = "streaming_hub_hub_batches_run_again_total";

/// A hub batch whose offsets the coordinator refused as the group moved to its next generation
/// runs again at once under that generation.
pub fn hub_batch_run_again() {
    counter!(HUB_BATCHES_RUN_AGAIN).increment(1);
}

/// A hub batch committed.
pub struct HubCommit {
    pub records: usize,
    pub took: Duration,
}

impl HubCommit {
    pub fn emit(&self) {
        histogram!(HUB_COMMIT_SECONDS).record(self.took.as_secs_f64());
        histogram!(HUB_BATCH_RECORDS).record(self.records as f64);
        tracing::debug!(
            records = self.records,
            took_ms = self.took.as_millis() as u64,
            "hub transaction committed"
        );
    }
}

/// Newly assigned tasks caught up with their changelogs.
pub struct Restored {
    pub partitions: usize,
    pub records: u64,
    pub took: Duration,
}

impl Restored {
    pub fn emit(&self) {
        counter!(RESTORE_RECORDS).increment(self.records);
        histogram!(RESTORE_SECONDS).record(self.took.as_secs_f64());
        let rate = self.records as f64 / self.took.as_secs_f64().max(1e-9);
        tracing::info!(
            partitions = self.partitions,
            records = self.records,
            took_ms = self.took.as_millis() as u64,
            records_per_s = rate as u64,
            "stores restored"
        );
    }
}

/// A dedup entry reached its TTL and was deleted.
pub struct DedupExpired {
    pub partition: i32,
}

impl DedupExpired {
    pub fn emit(&self) {
        on_commit(|| counter!(DEDUP_EXPIRED).increment(1));
    }
}

pub const MATCHES: &str = "streaming_hub_matches_total";
pub const EVENTS_UNMATCHED: &str = "streaming_hub_events_unmatched_total";

/// An event was matched against the subscription table (zero matches is correct, not an error).
pub struct Matched<'a> {
    pub ce_id: &'a str,
    pub tenant: &'a str,
    pub subscriptions: usize,
}

impl Matched<'_> {
    pub fn emit(&self) {
        let n = self.subscriptions as u64;
        on_commit(move || {
            if n == 0 {
                counter!(EVENTS_UNMATCHED).increment(1);
            } else {
                counter!(MATCHES).increment(n);
            }
        });
        tracing::debug!(
            ce_id = self.ce_id,
            tenant = self.tenant,
            subscriptions = self.subscriptions,
            "event matched"
        );
    }
}

pub const REDELIVERIES: &str = "streaming_hub_redeliveries_total";

/// A redelivery request (replay, recover, redrive) reached the hub task.
pub struct Redelivery<'a> {
    pub ce_id: &'a str,
    pub subscription_id: &'a str,
    /// `queued` (a job was created), `deferred` (a job was created, due in 10 s: the subscription
    /// was unknown or inactive in this loop's table, which may not have read the record the API
    /// found it active in), `pending` (its job is still pending), or why it was skipped:
    /// `other_tenant`, `not_a_webhook`.
    pub outcome: &'static str,
}

impl Redelivery<'_> {
    pub fn emit(&self) {
        let (ce_id, subscription_id) = (self.ce_id.to_string(), self.subscription_id.to_string());
        let outcome = self.outcome;
        on_commit(move || {
            counter!(REDELIVERIES, "outcome" => outcome).increment(1);
            tracing::info!(ce_id, subscription_id, outcome, "redelivery request");
        });
    }
}

pub const DELIVERY_LATENCY: &str = "streaming_hub_delivery_latency_seconds";
pub const BREAKERS_OPEN: &str = "streaming_hub_breakers_open";
pub const ATTEMPTS_EXECUTING: &str = "streaming_hub_attempts_executing";
pub const DUE_JOBS: &str = "streaming_hub_due_jobs";
pub const OLDEST_DUE: &str = "streaming_hub_oldest_due_seconds";
pub const CONSUMER_LAG: &str = "streaming_hub_consumer_lag";
pub const RESTORING: &str = "streaming_hub_restoring_partitions";
pub const PARTITION_OWNED: &str = "streaming_hub_inbox_partition_owned";
pub const ATTEMPTS_CLAIMED: &str = "streaming_hub_attempts_claimed";
pub const CLAIMS_AHEAD_LIMIT: &str = "streaming_hub_claims_ahead_limit";

/// A successful delivery, `ms` after ingest accepted the event (end-to-end latency in the hub).
pub fn delivered_after(ms: i64) {
    on_commit(move || histogram!(DELIVERY_LATENCY).record(ms.max(0) as f64 / 1000.0));
}

/// Circuit breakers open now.
/// An instance-wide gauge that every hub loop (stage) feeds its own part of: the gauge shows
/// the sum, not whichever loop wrote last.
struct PerStage([AtomicUsize; MAX_HUB_STAGES]);

impl PerStage {
    const fn new() -> PerStage {
        PerStage([const { AtomicUsize::new(0) }; MAX_HUB_STAGES])
    }

    /// Sets `stage`'s part; returns the sum over all stages.
    fn set(&self, stage: usize, n: usize) -> f64 {
        self.0[stage.min(MAX_HUB_STAGES - 1)].store(n, Ordering::Relaxed);
        self.0
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .sum::<usize>() as f64
    }
}

static OPEN_BY_STAGE: PerStage = PerStage::new();
static CLAIMED_BY_STAGE: PerStage = PerStage::new();
static LIMIT_BY_STAGE: PerStage = PerStage::new();

pub fn breakers_open(stage: usize, n: usize) {
    gauge!(BREAKERS_OPEN).set(OPEN_BY_STAGE.set(stage, n));
}

/// Delivery attempts holding a worker now (at most `STREAMING_HUB_DISPATCH_WORKERS`).
pub fn attempts_executing(delta: f64) {
    gauge!(ATTEMPTS_EXECUTING).increment(delta);
}

/// Inbox partitions this instance's hub stage took (1) or gave up (0): which instance owns
/// which partition, as its rebalance callbacks saw it.
pub fn partitions_owned(hub_loop: usize, partitions: &[i32], owned: bool) {
    for p in partitions {
        gauge!(PARTITION_OWNED, "partition" => p.to_string(), "loop" => hub_loop.to_string())
            .set(if owned { 1.0 } else { 0.0 });
    }
}

/// Attempts claimed and not yet finished (waiting for a worker or executing).
pub fn attempts_claimed(stage: usize, n: usize) {
    gauge!(ATTEMPTS_CLAIMED).set(CLAIMED_BY_STAGE.set(stage, n));
}

/// The most attempts the hub loops may have claimed now: the fixed bound, or less while attempts
/// are slow (`dispatch::pace`).
pub fn claims_ahead_limit(stage: usize, n: usize) {
    gauge!(CLAIMS_AHEAD_LIMIT).set(LIMIT_BY_STAGE.set(stage, n));
}

/// Partitions whose stores are being restored now (`/readyz` is 503 meanwhile).
pub fn restoring(n: usize) {
    gauge!(RESTORING).set(n as f64);
}

/// How many tenants `/metrics` names in the due-backlog gauges.
pub const BACKLOG_TENANTS: usize = 10;

/// A hub loop's backlog sample: its tenants with the oldest due jobs (due jobs, age of the
/// oldest in seconds) and its total.
type BacklogSample = (Vec<(String, usize, f64)>, usize);
/// Each hub loop's latest sample; None before its first.
static BACKLOG_BY_STAGE: std::sync::Mutex<[Option<BacklogSample>; MAX_HUB_STAGES]> =
    std::sync::Mutex::new([const { None }; MAX_HUB_STAGES]);

/// Keeps a hub loop's backlog sample for [`render_backlog`]: `top` its tenants with the oldest
/// due jobs (due jobs, oldest's age in s), `total` its due jobs.
pub fn due_backlog(stage: usize, top: Vec<(String, usize, f64)>, total: usize) {
    let mut by_stage = BACKLOG_BY_STAGE.lock().unwrap_or_else(|p| p.into_inner());
    by_stage[stage.min(MAX_HUB_STAGES - 1)] = Some((top, total));
}

/// `streaming_hub_due_jobs{tenant}` and `streaming_hub_oldest_due_seconds{tenant}` in the
/// Prometheus text format, from the hub loops' latest samples: the [`BACKLOG_TENANTS`] tenants
/// with the oldest due job over all loops, and `tenant="_all"` the total. They are written here
/// rather than kept by the recorder, which cannot remove a series: a tenant that leaves the top
/// is no longer named, so the series stay bounded however many tenants pass through it.
pub fn render_backlog() -> String {
    let by_stage = BACKLOG_BY_STAGE.lock().unwrap_or_else(|p| p.into_inner());
    backlog_text(&by_stage.iter().flatten().collect::<Vec<_>>())
}

fn backlog_text(samples: &[&BacklogSample]) -> String {
    if samples.is_empty() {
        return String::new();
    }
    let mut merged: std::collections::HashMap<&str, (usize, f64)> = Default::default();
    for (top, _) in samples {
        // A tenant named `_all` would be a second series of the total's labels.
        for (tenant, due, oldest) in top.iter().filter(|t| t.0 != "_all") {
            let e = merged.entry(tenant).or_insert((0, 0.0));
            e.0 += due;
            e.1 = e.1.max(*oldest);
        }
    }
    let mut ranked: Vec<_> = merged.into_iter().collect();
    ranked.sort_by(|a, b| b.1.1.total_cmp(&a.1.1).then(a.0.cmp(b.0)));
    ranked.truncate(BACKLOG_TENANTS);
    let total: usize = samples.iter().map(|(_, total)| total).sum();
    let mut out = format!(
        "# HELP {DUE_JOBS} Due delivery jobs, sampled every 10 s: the tenants with the oldest due job, and _all.\n# TYPE {DUE_JOBS} gauge\n{DUE_JOBS}{{tenant=\"_all\"}} {total}\n"
    );
    for (tenant, (due, _)) in &ranked {
        out += &format!("{DUE_JOBS}{{tenant=\"{}\"}} {due}\n", label_value(tenant));
    }
    out += &format!(
        "# HELP {OLDEST_DUE} Age of the oldest due delivery job, sampled every 10 s, of the tenants with the oldest.\n# TYPE {OLDEST_DUE} gauge\n"
    );
    for (tenant, (_, oldest)) in &ranked {
        out += &format!(
            "{OLDEST_DUE}{{tenant=\"{}\"}} {oldest}\n",
            label_value(tenant)
        );
    }
    out
}

/// A Prometheus label value, escaped (backslash, double quote, line feed).
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Consumer lag of every assigned partition in one librdkafka statistics report (raw JSON):
/// last stable offset − the position handed to the application. librdkafka's own
/// `consumer_lag` counts from the committed offset, which a transactional consumer never learns
/// (its offsets are committed by the producer's transaction).
pub fn lag_from_stats(stage: &'static str, raw: &[u8]) {
    for (topic, partition, lag) in lags(raw) {
        consumer_lag(stage, &topic, partition, lag);
    }
}

/// (topic, partition, lag) of the partitions this consumer is fetching, from one statistics
/// report. A partition it no longer fetches (revoked: its fetch state is `stopped` or `none`)
/// is left out even while librdkafka still reports its last position: that stale lag would
/// otherwise be set again and again, alongside the new owner's.
fn lags(raw: &[u8]) -> Vec<(String, i32, i64)> {
    let mut out = Vec::new();
    each_partition_stats(raw, |topic, partition, p| {
        if p.get("fetch_state")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|s| s != "active")
        {
            return;
        }
        let num = |k: &str| p.get(k).and_then(serde_json::Value::as_i64).unwrap_or(-1);
        let (stable, position) = (num("ls_offset"), num("app_offset"));
        if stable >= 0 && position >= 0 {
            out.push((topic.to_string(), partition, (stable - position).max(0)));
        }
    });
    out
}

/// Partitions given up in a rebalance: their lag is this consumer's no more (0, not the last
/// value it saw, which would stay in `/metrics` for good).
pub fn lag_gone<'a>(stage: &'static str, partitions: impl IntoIterator<Item = (&'a str, i32)>) {
    for (topic, partition) in partitions {
        consumer_lag(stage, topic, partition, 0);
    }
}

/// Calls `f(topic, partition, stats)` for every partition of one librdkafka statistics report
/// (raw JSON); reports that do not parse are skipped.
pub fn each_partition_stats(raw: &[u8], mut f: impl FnMut(&str, i32, &serde_json::Value)) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(raw) else {
        return;
    };
    let Some(topics) = v.get("topics").and_then(|t| t.as_object()) else {
        return;
    };
    for (topic, t) in topics {
        let Some(parts) = t.get("partitions").and_then(|p| p.as_object()) else {
            continue;
        };
        for p in parts.values() {
            match p.get("partition").and_then(serde_json::Value::as_i64) {
                Some(partition) if partition >= 0 => f(topic, partition as i32, p),
                _ => {}
            }
        }
    }
}

/// Consumer lag of one partition (from librdkafka's statistics).
pub fn consumer_lag(stage: &'static str, topic: &str, partition: i32, lag: i64) {
    gauge!(CONSUMER_LAG, "stage" => stage, "topic" => topic.to_string(), "partition" => partition.to_string())
        .set(lag as f64);
}

pub const ATTEMPTS: &str = "streaming_hub_attempts_total";
pub const ATTEMPT_SECONDS: &str = "streaming_hub_attempt_seconds";
pub const DEAD_LETTERS: &str = "streaming_hub_dead_letters_total";

/// One delivery attempt finished (recorded in the hub's transaction).
pub struct AttemptDone<'a> {
    pub outcome: &'a crate::runtime::records::AttemptRecord,
}

impl AttemptDone<'_> {
    pub fn emit(&self) {
        let a = self.outcome;
        let outcome = match a.outcome {
            crate::runtime::records::AttemptOutcome::Delivered => "delivered",
            crate::runtime::records::AttemptOutcome::RetryScheduled => "retry_scheduled",
            crate::runtime::records::AttemptOutcome::DeadLettered => "dead_lettered",
        };
        let class = match a.status {
            Some(s) => ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .get((s / 100).saturating_sub(1) as usize)
                .copied()
                .unwrap_or("other"),
            None => "none",
        };
        let seconds = a.latency_ms as f64 / 1000.0;
        // Its line's fields copied only when the line is written.
        let line = tracing::enabled!(tracing::Level::INFO).then(|| {
            (
                a.event_id.clone(),
                a.subscription_id.clone(),
                a.tenant_id.clone(),
                a.attempt,
                a.delivery_id.clone(),
                a.status,
                a.error_kind.clone().unwrap_or_default(),
            )
        });
        on_commit(move || {
            counter!(ATTEMPTS, "outcome" => outcome, "status_class" => class).increment(1);
            histogram!(ATTEMPT_SECONDS).record(seconds);
            if let Some((ce_id, subscription_id, tenant, attempt, delivery_id, status, error)) =
                line
            {
                tracing::info!(
                    ce_id,
                    subscription_id,
                    tenant,
                    attempt,
                    delivery_id,
                    status,
                    error,
                    outcome,
                    "delivery attempt"
                );
            }
        });
    }
}

/// A delivery was dead-lettered.
pub struct DeadLettered<'a> {
    pub record: &'a crate::runtime::records::DeadLetterRecord,
}

impl DeadLettered<'_> {
    pub fn emit(&self) {
        let r = self.record;
        let reason = match r.reason {
            crate::runtime::records::DeadLetterReason::Exhausted => "exhausted",
            crate::runtime::records::DeadLetterReason::Poison => "poison",
            crate::runtime::records::DeadLetterReason::SubscriptionDisabled => {
                "subscription_disabled"
            }
        };
        let (ce_id, subscription_id, tenant, attempts) = (
            r.event_id.clone(),
            r.subscription_id.clone(),
            r.tenant_id.clone(),
            r.attempts,
        );
        on_commit(move || {
            counter!(DEAD_LETTERS, "reason" => reason).increment(1);
            tracing::warn!(
                ce_id,
                subscription_id,
                tenant,
                attempts,
                reason,
                "delivery dead-lettered"
            );
        });
    }
}

pub const BREAKER_TRANSITIONS: &str = "streaming_hub_breaker_transitions_total";
pub const BREAKER_SHED: &str = "streaming_hub_breaker_shed_total";

/// A destination's circuit breaker opened or closed.
pub struct BreakerChanged<'a> {
    pub tenant: &'a str,
    pub origin: &'a str,
    pub opened: bool,
}

impl BreakerChanged<'_> {
    pub fn emit(&self) {
        let state = if self.opened { "opened" } else { "closed" };
        let (tenant, destination) = (self.tenant.to_string(), self.origin.to_string());
        on_commit(move || {
            counter!(BREAKER_TRANSITIONS, "state" => state).increment(1);
            tracing::warn!(tenant, destination, state, "circuit breaker");
        });
    }
}

/// A due job was shed (rescheduled without an attempt) by an open breaker.
pub struct Shed<'a> {
    pub tenant: &'a str,
}

impl Shed<'_> {
    pub fn emit(&self) {
        on_commit(|| counter!(BREAKER_SHED).increment(1));
        tracing::debug!(tenant = self.tenant, "due job shed by an open breaker");
    }
}

pub const HELD_UNVERIFIED: &str = "streaming_hub_deliveries_held_total";

/// Times a loop left its group and joined again to hand out partitions held by no member
/// (`runtime::orphans`).
pub const GROUP_REJOINS: &str = "streaming_hub_group_rejoins_total";

/// A due job was held back, its destination not verified: postponed with no attempt spent
/// (verification pending), or its attempt spent without a request (verification failed).
pub struct HeldUnverified<'a> {
    pub subscription_id: &'a str,
    pub spent: bool,
}

impl HeldUnverified<'_> {
    pub fn emit(&self) {
        let verification = if self.spent { "failed" } else { "pending" };
        on_commit(move || counter!(HELD_UNVERIFIED, "verification" => verification).increment(1));
        tracing::debug!(
            subscription_id = self.subscription_id,
            verification,
            "due delivery held: its destination is not verified"
        );
    }
}

pub const HELD_NO_KEY: &str = "streaming_hub_deliveries_held_no_key_total";
/// Due deliveries postponed, no attempt spent, while their receiver's `Retry-After` runs.
pub const HELD_RETRY_AFTER: &str = "streaming_hub_deliveries_held_retry_after_total";
pub const HELD_UNREADABLE: &str = "streaming_hub_deliveries_held_unreadable_total";

/// Why a due delivery was postponed with no attempt spent, besides its verification.
#[derive(Debug, Clone, Copy)]
pub enum HeldFor {
    /// This instance has no key-encryption key (`STREAMING_HUB_KEK`): it could neither sign
    /// nor open a sealed URL.
    NoKey,
    /// Its subscription's latest control record could not be read here (see
    /// `Table::read_unreadable`).
    Unreadable,
    /// Its receiver answered a 429 or 503 with `Retry-After`, not yet over.
    RetryAfter,
}

pub struct Held<'a> {
    pub subscription_id: &'a str,
    pub why: HeldFor,
}

impl Held<'_> {
    pub fn emit(&self) {
        let (name, why) = match self.why {
            HeldFor::NoKey => (HELD_NO_KEY, "this instance has no key-encryption key"),
            HeldFor::Unreadable => (
                HELD_UNREADABLE,
                "its subscription's latest control record could not be read",
            ),
            HeldFor::RetryAfter => (HELD_RETRY_AFTER, "its receiver asked to wait (Retry-After)"),
        };
        on_commit(move || counter!(name).increment(1));
        tracing::debug!(
            subscription_id = self.subscription_id,
            why,
            "due delivery held"
        );
    }
}

pub const DROPPED_DELETED: &str = "streaming_hub_deliveries_dropped_deleted_total";

/// A due delivery whose subscription was deleted (or whose id another tenant's subscription
/// holds now) was finished with no attempt.
pub fn dropped_deleted(subscription_id: &str, tenant: &str) {
    on_commit(|| counter!(DROPPED_DELETED).increment(1));
    tracing::debug!(
        subscription_id,
        tenant,
        "due delivery dropped: its subscription was deleted"
    );
}

pub const AUTO_DISABLED: &str = "streaming_hub_auto_disabled_total";

/// A subscription was auto-disabled.
pub struct AutoDisabled<'a> {
    pub subscription_id: &'a str,
    pub tenant: &'a str,
    pub reason: &'a str,
}

impl AutoDisabled<'_> {
    pub fn emit(&self) {
        let (subscription_id, tenant, reason) = (
            self.subscription_id.to_string(),
            self.tenant.to_string(),
            self.reason.to_string(),
        );
        on_commit(move || {
            counter!(AUTO_DISABLED).increment(1);
            tracing::warn!(
                subscription_id,
                tenant,
                reason,
                "subscription auto-disabled"
            );
        });
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_transactions_emits_wait_for_its_commit_and_an_aborted_ones_are_dropped() {
        use super::{Staging, on_commit};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let n = Arc::new(AtomicUsize::new(0));
        let add = |k: usize| {
            let n = n.clone();
            move || {
                n.fetch_add(k, Ordering::SeqCst);
            }
        };
        let outer = Staging::begin();
        on_commit(add(1));
        let inner = Staging::begin(); // a rebalance's commit inside a poll
        on_commit(add(10));
        inner.end(true);
        assert_eq!(
            n.load(Ordering::SeqCst),
            10,
            "the inner one's, not the outer's"
        );
        on_commit(add(100));
        drop(outer); // aborted
        assert_eq!(n.load(Ordering::SeqCst), 10);
        on_commit(add(1000)); // none open: at once
        assert_eq!(n.load(Ordering::SeqCst), 1010);
        let t = Staging::begin();
        on_commit(add(1));
        assert_eq!(n.load(Ordering::SeqCst), 1010);
        t.end(true);
        assert_eq!(n.load(Ordering::SeqCst), 1011);
    }

    #[test]
    fn the_backlog_names_the_current_top_tenants_only_summed_over_the_loops() {
        let first = (
            vec![("old".to_string(), 3, 40.0), ("a\"b".to_string(), 1, 5.0)],
            4,
        );
        let other = (vec![("old".to_string(), 2, 60.0)], 2);
        let text = backlog_text(&[&first, &other]);
        assert!(
            text.contains("streaming_hub_due_jobs{tenant=\"_all\"} 6\n"),
            "{text}"
        );
        assert!(
            text.contains("streaming_hub_due_jobs{tenant=\"old\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("streaming_hub_oldest_due_seconds{tenant=\"old\"} 60\n"),
            "{text}"
        );
        assert!(
            text.contains("streaming_hub_due_jobs{tenant=\"a\\\"b\"} 1\n"),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE").count(), 2, "{text}");

        // The next sample no longer has "old": its series is gone, not left at zero.
        let later = (vec![("a\"b".to_string(), 1, 15.0)], 1);
        let text = backlog_text(&[&later]);
        assert!(!text.contains("\"old\""), "{text}");
        assert!(
            text.contains("streaming_hub_due_jobs{tenant=\"_all\"} 1\n"),
            "{text}"
        );

        // At most BACKLOG_TENANTS tenants, the oldest first.
        let many = (
            (0..25)
                .map(|i| (format!("t{i}"), 1, f64::from(i)))
                .collect::<Vec<_>>(),
            25,
        );
        let text = backlog_text(&[&many]);
        assert_eq!(
            text.matches("streaming_hub_oldest_due_seconds{").count(),
            BACKLOG_TENANTS,
            "{text}"
        );
        assert!(
            text.contains("{tenant=\"t24\"}") && !text.contains("{tenant=\"t14\"}"),
            "{text}"
        );
        assert_eq!(backlog_text(&[]), "", "nothing before the first sample");
        // A tenant named like the total is left out, not written as a second series of it.
        let clash = (vec![("_all".to_string(), 7, 3.0)], 7);
        let text = backlog_text(&[&clash]);
        assert_eq!(text.matches("{tenant=\"_all\"}").count(), 1, "{text}");
    }
    use super::*;

    #[test]
    fn lag_is_read_only_for_partitions_this_consumer_is_fetching() {
        // Shaped like librdkafka's statistics: partition 0 fetched, 1 revoked (stopped, its last
        // position still reported), 2 another member's (none, no position), -1 the internal one.
        let raw = br#"{"topics": {"lerian.inbox": {"partitions": {
            "0": {"partition": 0, "fetch_state": "active", "ls_offset": 120, "app_offset": 100},
            "1": {"partition": 1, "fetch_state": "stopped", "ls_offset": 90, "app_offset": 40},
            "2": {"partition": 2, "fetch_state": "none", "ls_offset": 70, "app_offset": -1001},
            "-1": {"partition": -1, "fetch_state": "none", "ls_offset": -1, "app_offset": -1}
        }}}}"#;
        assert_eq!(lags(raw), vec![("lerian.inbox".to_string(), 0, 20)]);
        // A report without fetch states (older librdkafka) is read by its offsets alone.
        let raw = br#"{"topics": {"t": {"partitions": {
            "3": {"partition": 3, "ls_offset": 10, "app_offset": 12}
        }}}}"#;
        assert_eq!(lags(raw), vec![("t".to_string(), 3, 0)]);
        assert!(lags(b"not json").is_empty());
    }
}
