//! Forensics: a bounded, searchable, in-memory index of what never gets delivered.
//!
//! - producers' dead letters: `lerian.streaming.<source>.dlq` (records with `x-lerian-dlq-*`
//!   headers, written by the platform's producers; never matched, never delivered);
//! - the hub's quarantine, `<prefix>.quarantine` (same forensic headers, plus the reason);
//! - the hub's dead deliveries, `<prefix>.dlq` (Avro dead-letter records).
//!
//! One consumer (group `<STREAMING_HUB_DLQ_GROUP>-<instance>`: each instance its own group, so
//! every instance indexes every partition and any instance answers) reads them from the start of
//! their retention and never commits: the index is rebuilt at each start. It keeps records for
//! `STREAMING_HUB_DLQ_RETENTION` (by record time) and at most [`MAX_PER_KIND`] of each kind,
//! payloads up to [`MAX_PAYLOAD`] bytes (larger: size only), and at most [`MAX_BYTES_PER_KIND`]
//! of producer dead letters and of quarantined records each (the oldest go first): a flood of
//! large malformed records must not take the process's memory. Payloads are kept as bytes and
//! parsed only for an answer.
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use serde::Serialize;

use crate::config::Config;
use crate::ingest::classify::Reason;
use crate::ingest::pipeline::rfc3339_ms;
use crate::runtime::avro::{Codec, RecordKind};
use crate::runtime::clock::SharedClock;
use crate::runtime::kafka;
use crate::runtime::records::{DeadLetterReason, DeadLetterRecord};

/// Records kept per kind at most.
pub const MAX_PER_KIND: usize = 100_000;
/// Largest payload kept in the index.
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// Bytes of producer dead letters, and of quarantined records, kept at most (payloads, headers,
/// keys, as [`Kept::weigh`] counts them).
pub const MAX_BYTES_PER_KIND: usize = 64 * 1024 * 1024;
/// The producers' dead-letter topics.
pub const PRODUCER_DLQ_PATTERN: &str = r"^lerian\.streaming\.[a-z0-9_-]+\.dlq$";

/// A producer dead letter or a quarantined record.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ForensicRecord {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The record's time (RFC 3339).
    pub time: String,
    /// Where the listing files it (RFC 3339): its time, or a little past the hub's clock for a
    /// record stamped further ahead. `since` and `until` compare with it; the next page passes
    /// the last record's `filed_at` as `until`.
    pub filed_at: String,
    /// The producer's source: a dead letter's from its topic (`lerian.streaming.<source>.dlq`); a
    /// quarantined record's `ce-source`, else (and for `source_mismatch`) the source of the topic
    /// it was read from (`x-lerian-dlq-source-topic`).
    pub source: Option<String>,
    pub tenant_id: Option<String>,
    /// `x-lerian-dlq-cause-kind`.
    pub cause: Option<String>,
    /// The hub's quarantine reason (`x-streaming-hub-reason`), quarantine only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Every `x-lerian-dlq-*` header, without the prefix (`source-topic`, `error-class`, …).
    pub dlq: BTreeMap<String, String>,
    /// Every header, values as text (invalid UTF-8 replaced).
    pub headers: Vec<HeaderText>,
    pub key: Option<String>,
    /// The payload as JSON when it parses, else absent (see `payload_base64`): its text as the
    /// writer wrote it (checked, not parsed into a tree, so a page of 1,000 dense payloads holds
    /// about their bytes, not the tens of times more a tree of small values takes).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub payload: Option<Box<serde_json::value::RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    pub payload_bytes: usize,
    /// True when the payload is not here (too large for the index, or omitted by the writer).
    pub payload_omitted: bool,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HeaderText {
    pub key: String,
    pub value: Option<String>,
}

/// A delivery the hub gave up on (`<prefix>.dlq`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DeadDelivery {
    /// `<partition>-<offset>` in `<prefix>.dlq`: what redrive takes.
    pub id: String,
    pub event_id: String,
    pub subscription_id: String,
    pub tenant_id: String,
    pub attempts: u32,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    /// `exhausted`, `poison` or `subscription_disabled`.
    pub reason: String,
    pub dead_at: String,
    #[serde(skip)]
    pub dead_at_ms: i64,
    /// Whether the record carries the event (redrive and recover need it).
    pub redrivable: bool,
    pub payload_bytes: usize,
}

/// What a forensic query asks for; every field optional.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub source: Option<String>,
    pub tenant: Option<String>,
    pub cause: Option<String>,
    pub subscription_id: Option<String>,
    pub reason: Option<String>,
    pub since_ms: Option<i64>,
    /// At or before this time: the next page of a listing, older than the last one's records.
    pub until_ms: Option<i64>,
    /// With `until_ms`: only the records of the `until` instant after the one with this id in
    /// the listing's order (the last one of the page before), so that a page starts where the
    /// last one stopped even when more than a page's worth share that instant (one
    /// transaction's dead letters do). A dead delivery's `id`; a record's
    /// `<topic>:<partition>:<offset>`.
    pub before_id: Option<String>,
    pub limit: usize,
}

/// JSON bytes past which an answer ends (the record that crosses it is its last): 1,000 records
/// of 64 KiB headers and payloads, written as JSON (a control byte takes six, base64 a third
/// more), would be hundreds of megabytes on an instance that also delivers.
pub const ANSWER_BYTES: usize = 8 * 1024 * 1024;

#[derive(Default)]
struct Inner {
    dlq: Queue,
    quarantine: Queue,
    dead: Ordered<DeadDelivery>,
    /// The next offset to take in each partition read, by topic: the index's group commits
    /// nothing, so a rebalance (a new producer DLQ topic matching the pattern) starts its
    /// partitions over.
    next: HashMap<String, HashMap<i32, i64>>,
}

/// A record as the index keeps it: its payload raw (a parsed JSON value takes many times its
/// text), turned into `payload` or `payload_base64` when it is answered.
struct Kept {
    time: i64,
    rec: ForensicRecord,
    raw: Option<Box<[u8]>>,
    bytes: usize,
}

impl Kept {
    fn new(time: i64, rec: ForensicRecord, raw: Option<&[u8]>) -> Kept {
        let mut kept = Kept {
            time,
            rec,
            raw: raw.map(Box::from),
            bytes: 0,
        };
        kept.bytes = kept.weigh();
        kept
    }

    /// About what the record holds in memory: its texts (headers twice for the `dlq` copies),
    /// its payload, and a fixed part for the rest.
    fn weigh(&self) -> usize {
        let r = &self.rec;
        let texts = [&r.topic, &r.time]
            .iter()
            .map(|t| t.len())
            .chain(
                [&r.source, &r.tenant_id, &r.cause, &r.reason, &r.key]
                    .iter()
                    .map(|t| t.as_ref().map_or(0, String::len)),
            )
            .sum::<usize>();
        let headers: usize = r
            .headers
            .iter()
            .map(|h| 48 + h.key.len() + h.value.as_ref().map_or(0, String::len))
            .sum();
        let dlq: usize = r.dlq.iter().map(|(k, v)| 64 + k.len() + v.len()).sum();
        256 + texts + headers + dlq + self.raw.as_ref().map_or(0, |p| p.len())
    }

    /// The record as answered, its payload as JSON when it parses, else base64.
    fn answer(&self) -> ForensicRecord {
        let mut rec = self.rec.clone();
        rec.filed_at = rfc3339_ms(self.time);
        if let Some(p) = &self.raw {
            // Parsed as a tree first and the tree dropped (one at a time): the raw form alone
            // passes what a client's parser refuses (nesting past 128, `1e400`, a lone
            // surrogate), which would make the whole page unreadable.
            let json = serde_json::from_slice::<serde_json::Value>(p)
                .ok()
                .and_then(|_| serde_json::from_slice::<Box<serde_json::value::RawValue>>(p).ok());
            match json {
                Some(json) => rec.payload = Some(json),
                None => rec.payload_base64 = Some(STANDARD.encode(p)),
            }
        }
        rec
    }
}

/// How far ahead of this instance's clock a record's time may be and still be filed by it.
const FUTURE_SKEW_MS: i64 = 5 * 60_000;

/// Where a record of time `record_ms` is filed, seen at `now`: at its time, but no later than a
/// little past now. A producer whose clock runs far ahead writes the time it sets; filed there, a
/// flood of its records would outrank every later record, and a full index, dropping the oldest
/// first, would keep every later one out until that time came. (It is shown with its own time.)
fn filed_at(record_ms: i64, now: i64) -> i64 {
    record_ms.min(now.saturating_add(FUTURE_SKEW_MS))
}

/// Where a record was read (its topic, partition and offset, or a dead letter's id): the same on
/// every instance and after every restart, unlike the order records happen to be read in.
trait Placed {
    fn place(&self) -> String;
}

impl Placed for Kept {
    fn place(&self) -> String {
        format!(
            "{}:{}:{}",
            self.rec.topic, self.rec.partition, self.rec.offset
        )
    }
}

impl Placed for DeadDelivery {
    fn place(&self) -> String {
        self.id.clone()
    }
}

/// Items in time order, those of one time by where they were read: every instance lists them
/// alike, so a page's cursor (`before`) continues on any instance, and a record read again (a
/// rebalance of the index's group starts its partitions over) takes its own place again. A
/// B-tree, not a sorted `VecDeque`: records do not come in time order (topics and partitions
/// read interleaved, a producer's clock that jumps), and an insert in the middle of a full deque
/// moved tens of thousands of records, under the lock the API's reads wait on.
struct Ordered<T> {
    items: BTreeMap<(i64, String), T>,
}

impl<T> Default for Ordered<T> {
    fn default() -> Self {
        Ordered {
            items: BTreeMap::new(),
        }
    }
}

impl<T: Placed> Ordered<T> {
    /// Files `item` at `time`; the item it replaces (the same record read again), if any.
    fn insert(&mut self, time: i64, item: T) -> Option<T> {
        self.items.insert((time, item.place()), item)
    }
}

impl<T> Ordered<T> {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The oldest.
    fn front(&self) -> Option<&T> {
        self.items.values().next()
    }

    /// The newest.
    #[cfg(test)]
    fn back(&self) -> Option<&T> {
        self.items.values().next_back()
    }

    fn pop_front(&mut self) -> Option<T> {
        self.items.pop_first().map(|(_, v)| v)
    }

    /// Oldest first.
    fn iter(&self) -> impl DoubleEndedIterator<Item = &T> {
        self.items.values()
    }
}

impl Inner {
    /// Whether the record at `offset` of (`topic`, `partition`) is read for the first time.
    fn first_read(&mut self, topic: &str, partition: i32, offset: i64) -> bool {
        let partitions = match self.next.get_mut(topic) {
            Some(p) => p,
            None => self.next.entry(topic.to_string()).or_default(),
        };
        let next = partitions.entry(partition).or_insert(0);
        if offset < *next {
            return false;
        }
        *next = offset + 1;
        true
    }
}

/// One kind's records, oldest first, bounded by count and by bytes.
#[derive(Default)]
struct Queue {
    items: Ordered<Kept>,
    bytes: usize,
}

impl Queue {
    /// Keeps `kept` in record-time order (topics and partitions are read interleaved, and a
    /// backlog may be read after newer records): when full, the oldest by record time goes, which
    /// is `kept` itself when it is older than all the others.
    fn push(&mut self, kept: Kept) {
        while !self.items.is_empty()
            && (self.items.len() >= MAX_PER_KIND || self.bytes + kept.bytes > MAX_BYTES_PER_KIND)
        {
            if self
                .items
                .front()
                .is_some_and(|oldest| oldest.time > kept.time)
            {
                return;
            }
            self.pop_front();
        }
        self.bytes += kept.bytes;
        if let Some(old) = self.items.insert(kept.time, kept) {
            self.bytes -= old.bytes;
        }
    }

    fn pop_front(&mut self) {
        if let Some(k) = self.items.pop_front() {
            self.bytes -= k.bytes;
        }
    }

    fn prune(&mut self, horizon: i64) {
        while self.items.front().is_some_and(|k| k.time < horizon) {
            self.pop_front();
        }
    }
}

/// Keeps `d` among the dead deliveries in `dead_at` order, as [`Queue::push`] keeps the other
/// kinds in record-time order (the DLQ's partitions are read interleaved, and a backlog may be
/// read after newer records): when full, the oldest goes, which is `d` itself when it is older
/// than all the others.
fn keep_dead(dead: &mut Ordered<DeadDelivery>, d: DeadDelivery) {
    if dead.len() >= MAX_PER_KIND {
        if dead
            .front()
            .is_some_and(|oldest| oldest.dead_at_ms > d.dead_at_ms)
        {
            return;
        }
        dead.pop_front();
    }
    dead.insert(d.dead_at_ms, d);
}

/// The index; cheap to clone (shared).
#[derive(Clone)]
pub struct Forensics {
    inner: Arc<Mutex<Inner>>,
    retention_ms: i64,
    clock: SharedClock,
    /// See [`Forensics::complete`].
    complete: Arc<AtomicBool>,
}

/// Whether the index is complete: 1 once it has read every partition it follows up to where that
/// partition ended when the index first saw it, 0 before (after a start, a rebalance of its
/// group, a new producer `.dlq` topic).
pub const INDEX_COMPLETE: &str = "streaming_hub_forensics_index_complete";
/// How often the index checks its positions against the ends it noted, at least.
const CATCH_UP_CHECK: Duration = Duration::from_millis(500);
/// How long the index waits before it asks the brokers about a partition again: one whose end
/// they did not tell (no leader), or of which nothing has been read (its records may have been
/// deleted under the noted end since).
const ASK_AGAIN_MS: i64 = 30_000;
/// The most partitions one check asks about: the index reads no record while it asks.
const ASKS_PER_CHECK: usize = 4;
/// How long one ask waits for the brokers.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);

type Part = (String, i32);

/// The index's reading against the ends of what it follows. Each partition's end is noted when
/// the index first sees the partition in its assignment; a partition read up to it stays read
/// while assigned (records after it are the live tail, not a backlog).
#[derive(Default)]
struct CatchUp {
    /// The noted end (`high` when first told) of each assigned partition not yet read to it.
    ends: HashMap<Part, i64>,
    read: std::collections::HashSet<Part>,
    /// When each partition not yet read was last asked about (ms, the caller's clock).
    asked: HashMap<Part, i64>,
}

impl CatchUp {
    /// Given the assignment now with each partition's position (`None`: nothing fetched yet),
    /// whether every assigned partition is read up to its noted end. `end_of` asks the brokers
    /// for a partition's `(low, high)` (`None`: no answer): for one whose end is not noted yet,
    /// and again every [`ASK_AGAIN_MS`] for one of which nothing has been read, at most
    /// [`ASKS_PER_CHECK`] a check. A partition whose `low` is at or past its noted end has
    /// nothing left to read (empty, or deleted under it). No assignment (not in the group yet)
    /// is not complete.
    fn check(
        &mut self,
        assigned: &[(Part, Option<i64>)],
        now_ms: i64,
        mut end_of: impl FnMut(&str, i32) -> Option<(i64, i64)>,
    ) -> bool {
        let now: std::collections::HashSet<&Part> = assigned.iter().map(|(tp, _)| tp).collect();
        self.ends.retain(|tp, _| now.contains(tp));
        self.read.retain(|tp| now.contains(tp));
        self.asked.retain(|tp, _| now.contains(tp));
        let mut complete = !assigned.is_empty();
        let mut asks = 0;
        for (tp, position) in assigned {
            if self.read.contains(tp) {
                continue;
            }
            let due = self
                .asked
                .get(tp)
                .is_none_or(|&at| now_ms.saturating_sub(at) >= ASK_AGAIN_MS);
            let unknown = !self.ends.contains_key(tp);
            if due && (unknown || position.is_none()) && asks < ASKS_PER_CHECK {
                asks += 1;
                self.asked.insert(tp.clone(), now_ms);
                if let Some((low, high)) = end_of(&tp.0, tp.1) {
                    let end = *self.ends.entry(tp.clone()).or_insert(high);
                    if low >= end {
                        self.read.insert(tp.clone());
                        continue;
                    }
                }
            }
            // librdkafka moves the position past transaction markers, so a partition whose last
            // offset is a commit marker (the quarantine, the dead deliveries) is read to `high`.
            match self.ends.get(tp) {
                Some(&end) if position.is_some_and(|p| p >= end) => {
                    self.read.insert(tp.clone());
                }
                _ => complete = false,
            }
        }
        if complete {
            self.ends.clear();
            self.asked.clear();
        }
        complete
    }
}

/// Sets the index incomplete when its reader ends, however it ends (a failed start of the next
/// one would otherwise leave pages saying `complete` of an index nothing feeds).
struct IncompleteOnExit<'a>(&'a Forensics);

impl Drop for IncompleteOnExit<'_> {
    fn drop(&mut self) {
        self.0.complete.store(false, Ordering::Relaxed);
        metrics::gauge!(INDEX_COMPLETE).set(0.0);
    }
}

impl Forensics {
    pub fn new(retention: Duration, clock: SharedClock) -> Forensics {
        Forensics {
            inner: Arc::default(),
            retention_ms: retention.as_millis() as i64,
            clock,
            complete: Arc::default(),
        }
    }

    /// Whether the index has read every partition it follows up to where that partition ended
    /// when the index first saw it. False after a start (it reads its topics from their start),
    /// a rebalance of its group, or a new producer `.dlq` topic, until it has: pages answered
    /// meanwhile may lack records.
    pub fn complete(&self) -> bool {
        self.complete.load(Ordering::Relaxed)
    }

    fn set_complete(&self, complete: bool, started: std::time::Instant) {
        let was = self.complete.swap(complete, Ordering::Relaxed);
        metrics::gauge!(INDEX_COMPLETE).set(if complete { 1.0 } else { 0.0 });
        if complete && !was {
            tracing::info!(
                took_ms = started.elapsed().as_millis() as u64,
                "forensics index complete: every partition it follows read up to where it ended"
            );
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Producers' dead letters, newest first.
    pub fn producer_dlq(&self, f: &Filter) -> Vec<ForensicRecord> {
        self.prune();
        query(&self.lock().dlq, f)
    }

    /// The hub's quarantine, newest first.
    pub fn quarantine(&self, f: &Filter) -> Vec<ForensicRecord> {
        self.prune();
        query(&self.lock().quarantine, f)
    }

    /// Dead deliveries, newest first (of one instant, by id, descending).
    pub fn dead(&self, f: &Filter) -> Vec<DeadDelivery> {
        self.prune();
        // The `until` instant's records up to `before_id` were on the page before.
        let mut passed = f.before_id.is_none() || f.until_ms.is_none();
        self.lock()
            .dead
            .iter()
            .rev()
            .filter(|d| {
                after_cursor(f, &mut passed, d.dead_at_ms, || {
                    f.before_id.as_deref() == Some(d.id.as_str())
                }) && f.tenant.as_ref().is_none_or(|t| *t == d.tenant_id)
                    && f.subscription_id
                        .as_ref()
                        .is_none_or(|s| *s == d.subscription_id)
                    && f.reason.as_ref().is_none_or(|r| *r == d.reason)
                    && f.since_ms.is_none_or(|s| d.dead_at_ms >= s)
                    && f.until_ms.is_none_or(|u| d.dead_at_ms <= u)
            })
            .take(f.limit)
            .cloned()
            .collect()
    }

    fn prune(&self) {
        let horizon = self.clock.now_ms() - self.retention_ms;
        let mut inner = self.lock();
        inner.dlq.prune(horizon);
        inner.quarantine.prune(horizon);
        while inner.dead.front().is_some_and(|d| d.dead_at_ms < horizon) {
            inner.dead.pop_front();
        }
    }

    fn add(&self, kind: Kind, m: &BorrowedMessage<'_>, codec: &Codec) {
        let now = self.clock.now_ms();
        let time = m.timestamp().to_millis().unwrap_or(now);
        let mut inner = self.lock();
        if !inner.first_read(m.topic(), m.partition(), m.offset()) {
            return;
        }
        if time < now - self.retention_ms {
            return;
        }
        match kind {
            Kind::ProducerDlq | Kind::Quarantine => {
                let mut kept = forensic_record(m, time, kind);
                kept.time = filed_at(time, now);
                let q = if kind == Kind::Quarantine {
                    &mut inner.quarantine
                } else {
                    &mut inner.dlq
                };
                q.push(kept);
            }
            Kind::Dead => {
                let Some(dl) = m.payload().and_then(|v| {
                    codec
                        .decode::<DeadLetterRecord>(RecordKind::DeadLetter, v)
                        .ok()
                }) else {
                    tracing::warn!(
                        partition = m.partition(),
                        offset = m.offset(),
                        "undecodable dead letter skipped"
                    );
                    return;
                };
                keep_dead(
                    &mut inner.dead,
                    DeadDelivery {
                        id: format!("{}-{}", m.partition(), m.offset()),
                        event_id: dl.event_id,
                        subscription_id: dl.subscription_id,
                        tenant_id: dl.tenant_id,
                        attempts: dl.attempts,
                        last_status: dl.last_status,
                        last_error: dl.last_error,
                        reason: reason_code(dl.reason).to_string(),
                        dead_at: rfc3339_ms(dl.dead_at),
                        dead_at_ms: dl.dead_at,
                        redrivable: dl.event_headers.is_some(),
                        payload_bytes: dl.event_value.as_ref().map_or(0, Vec::len),
                    },
                );
            }
        }
    }

    /// Follows the three kinds of topics until `stop`; blocking (run it on its own thread).
    pub fn follow(
        &self,
        config: &Config,
        codec: Arc<Codec>,
        stop: Arc<AtomicBool>,
    ) -> Result<(), kafka::KafkaError> {
        let started = std::time::Instant::now();
        self.set_complete(false, started);
        let _incomplete = IncompleteOnExit(self);
        let group = format!("{}-{}", config.dlq_group(), config.instance());
        let consumer: BaseConsumer<kafka::ReaderContext> = kafka::base(config)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("isolation.level", "read_committed")
            .set(
                "topic.metadata.refresh.interval.ms",
                config.follow_refresh_interval.as_millis().to_string(),
            )
            .create_with_context(kafka::ReaderContext)
            .map_err(|e| kafka::KafkaError::Setup(e.to_string()))?;
        let quarantine = format!("{}.quarantine", config.topic_prefix);
        let dead = format!("{}.dlq", config.topic_prefix);
        consumer
            .subscribe(&[PRODUCER_DLQ_PATTERN, &quarantine, &dead])
            .map_err(kafka::KafkaError::from)?;
        tracing::info!(%group, "forensics index following producers' DLQs, quarantine and dead deliveries");
        // A new consumer reads its partitions over (the index skips what it holds).
        let mut catch_up = CatchUp::default();
        let mut next_check = started;
        while !stop.load(Ordering::Relaxed) {
            if std::time::Instant::now() >= next_check {
                let began = std::time::Instant::now();
                let now_ms = began.duration_since(started).as_millis() as i64;
                let complete = self.caught_up(&consumer, &mut catch_up, now_ms);
                self.set_complete(complete, started);
                // Asks that wait on the brokers take at most a fifth of the reader's time.
                next_check = std::time::Instant::now() + CATCH_UP_CHECK.max(began.elapsed() * 4);
            }
            match consumer.poll(Duration::from_millis(200)) {
                None => {}
                Some(Ok(m)) => {
                    let kind = if m.topic() == quarantine {
                        Kind::Quarantine
                    } else if m.topic() == dead {
                        Kind::Dead
                    } else {
                        Kind::ProducerDlq
                    };
                    self.add(kind, &m, &codec);
                }
                Some(Err(e)) => tracing::warn!(error = %e, "forensics consumer error"),
            }
        }
        Ok(())
    }
}

impl Forensics {
    /// [`CatchUp::check`] of `consumer`'s assignment and positions now.
    fn caught_up(
        &self,
        consumer: &BaseConsumer<kafka::ReaderContext>,
        catch_up: &mut CatchUp,
        now_ms: i64,
    ) -> bool {
        let Ok(positions) = consumer.position() else {
            return false;
        };
        let assigned: Vec<(Part, Option<i64>)> = positions
            .elements()
            .iter()
            .map(|e| {
                let position = match e.offset() {
                    rdkafka::Offset::Offset(o) => Some(o),
                    _ => None,
                };
                ((e.topic().to_string(), e.partition()), position)
            })
            .collect();
        catch_up.check(&assigned, now_ms, |topic, partition| {
            consumer
                .fetch_watermarks(topic, partition, ASK_TIMEOUT)
                .ok()
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    ProducerDlq,
    Quarantine,
    Dead,
}

pub fn reason_code(r: DeadLetterReason) -> &'static str {
    match r {
        DeadLetterReason::Exhausted => "exhausted",
        DeadLetterReason::Poison => "poison",
        DeadLetterReason::SubscriptionDisabled => "subscription_disabled",
    }
}

/// Whether a record listed at `time` with `id` comes after the page `f` continues (see
/// [`Filter::before_id`]); `passed` carries the answer along the listing's order.
fn after_cursor(f: &Filter, passed: &mut bool, time: i64, id: impl FnOnce() -> bool) -> bool {
    if *passed {
        return true;
    }
    match (f.until_ms, f.before_id.is_some()) {
        (Some(u), true) if time == u => {
            *passed = id();
            false
        }
        (Some(u), _) if time < u => {
            *passed = true;
            true
        }
        _ => true,
    }
}

fn query(q: &Queue, f: &Filter) -> Vec<ForensicRecord> {
    let mut passed = f.before_id.is_none() || f.until_ms.is_none();
    let cursor = f.before_id.as_deref().unwrap_or_default();
    q.items
        .iter()
        .rev()
        .filter(
            |Kept {
                 time: t, rec: r, ..
             }| {
                after_cursor(f, &mut passed, *t, || {
                    cursor == format!("{}:{}:{}", r.topic, r.partition, r.offset)
                }) && f
                    .source
                    .as_ref()
                    .is_none_or(|s| r.source.as_ref() == Some(s))
                    && f.tenant
                        .as_ref()
                        .is_none_or(|s| r.tenant_id.as_ref() == Some(s))
                    && f.cause
                        .as_ref()
                        .is_none_or(|s| r.cause.as_ref() == Some(s) || r.reason.as_ref() == Some(s))
                    && f.since_ms.is_none_or(|s| *t >= s)
                    && f.until_ms.is_none_or(|u| *t <= u)
            },
        )
        .take(f.limit)
        .map(Kept::answer)
        .scan(0usize, |bytes, answer| {
            // The first record always; the one that crosses the bound is the last.
            if *bytes >= ANSWER_BYTES {
                return None;
            }
            *bytes += serde_json::to_vec(&answer).map_or(0, |v| v.len());
            Some(answer)
        })
        .collect()
}

/// A `ce-*` attribute's value as ingest reads it: the header of exactly that (lower-case) name.
/// Read regardless of case, a `CE-SOURCE` on a record quarantined for its missing `ce-source`
/// filed it under that producer instead of its topic's.
fn attribute(headers: &[HeaderText], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value.clone())
}

fn forensic_record(m: &BorrowedMessage<'_>, time: i64, kind: Kind) -> Kept {
    let mut headers = Vec::new();
    let mut dlq = BTreeMap::new();
    if let Some(h) = m.headers() {
        // Producers write these topics: a header name that is not UTF-8 is shown lossily, never
        // read through rdkafka's `Headers::iter`, which panics on it (see `kafka::raw_header`).
        for (key, value) in (0..h.count()).map_while(|i| kafka::raw_header(h, i)) {
            let key = String::from_utf8_lossy(key).into_owned();
            let value = value.map(|v| String::from_utf8_lossy(v).into_owned());
            let lower = key.to_ascii_lowercase();
            if let (Some(name), Some(v)) = (lower.strip_prefix("x-lerian-dlq-"), &value) {
                dlq.insert(name.to_string(), v.clone());
            }
            headers.push(HeaderText { key, value });
        }
    }
    let header = |name: &str| attribute(&headers, name);
    // The hub writes its reason after the record's own headers: the last one is the hub's.
    let reason = headers
        .iter()
        .rev()
        .find(|h| h.key.eq_ignore_ascii_case("x-streaming-hub-reason"))
        .and_then(|h| h.value.clone());
    let source = record_source(
        kind,
        m.topic(),
        header("ce-source").as_deref(),
        dlq.get("source-topic").map(String::as_str),
        reason.as_deref(),
    );
    let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
    let tenant_id = header("ce-tenantid").or_else(|| key.clone().filter(|k| !k.is_empty()));
    let payload = m.payload();
    let declared: Option<usize> = dlq.get("payload-bytes").and_then(|v| v.parse().ok());
    let omitted_by_writer = dlq.get("payload-omitted").is_some_and(|v| v == "true");
    let payload_bytes = payload.map_or(0, <[u8]>::len).max(if omitted_by_writer {
        declared.unwrap_or(0)
    } else {
        0
    });
    let kept = payload.filter(|p| p.len() <= MAX_PAYLOAD);
    let rec = ForensicRecord {
        topic: m.topic().to_string(),
        partition: m.partition(),
        offset: m.offset(),
        time: rfc3339_ms(time),
        filed_at: String::new(),
        source,
        tenant_id,
        cause: dlq.get("cause-kind").cloned(),
        reason,
        dlq,
        headers,
        key,
        payload_base64: None,
        payload: None,
        payload_bytes,
        payload_omitted: omitted_by_writer || (payload.is_some() && kept.is_none()),
    };
    Kept::new(time, rec, kept)
}

/// The source a record is filed under. A producer's dead letter: its topic's
/// (`lerian.streaming.<source>.dlq`). A quarantined record: its `ce-source`, else the source of the
/// topic it was read from (`x-lerian-dlq-source-topic`); but a `source_mismatch` is filed under
/// its topic's source, since its `ce-source` is a claim the topic's writer had no right to make
/// (`?source=ledger` does not show what tracer's writer sent claiming to be ledger).
fn record_source(
    kind: Kind,
    topic: &str,
    ce_source: Option<&str>,
    source_topic: Option<&str>,
    reason: Option<&str>,
) -> Option<String> {
    let topic_source = || {
        source_topic
            .and_then(|t| t.strip_prefix("lerian.streaming."))
            .map(str::to_string)
    };
    match kind {
        Kind::ProducerDlq => topic
            .strip_prefix("lerian.streaming.")
            .and_then(|t| t.strip_suffix(".dlq"))
            .map(str::to_string),
        _ if reason == Some(Reason::SourceMismatch.code()) => topic_source(),
        _ => ce_source.map(str::to_string).or_else(topic_source),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Complete once every assigned partition is read to where it ended when first seen: not
    /// before the group assigns anything, not while a partition's end is unknown, and again not
    /// when a new partition comes; the live tail after the noted end does not count.
    #[test]
    fn the_index_is_complete_once_each_partition_is_read_to_its_end_when_first_seen() {
        let tp = |t: &str, p: i32| (t.to_string(), p);
        let mut c = CatchUp::default();
        let mut asked = Vec::new();
        let mut ends = HashMap::from([(tp("q", 0), (0, 10)), (tp("d", 0), (5, 5))]);
        // The brokers answer `ends` (none for a partition not in it); each ask is noted.
        fn check(
            c: &mut CatchUp,
            assigned: &[(Part, Option<i64>)],
            at: i64,
            ends: &HashMap<Part, (i64, i64)>,
            asked: &mut Vec<Part>,
        ) -> bool {
            c.check(assigned, at, |t, p| {
                asked.push((t.to_string(), p));
                ends.get(&(t.to_string(), p)).copied()
            })
        }
        assert!(
            !check(&mut c, &[], 0, &ends, &mut asked),
            "not in the group"
        );
        let assigned = |q: Option<i64>| vec![(tp("q", 0), q), (tp("d", 0), None)];
        // `d` is empty: read at once. `q` ends at 10.
        assert!(!check(&mut c, &assigned(None), 0, &ends, &mut asked));
        assert!(!check(&mut c, &assigned(Some(9)), 500, &ends, &mut asked));
        assert_eq!(asked.len(), 2, "each end noted once: {asked:?}");
        assert!(check(&mut c, &assigned(Some(10)), 1_000, &ends, &mut asked));
        // The tail grows: read already.
        ends.insert(tp("q", 0), (0, 50));
        assert!(check(&mut c, &assigned(Some(12)), 1_500, &ends, &mut asked));
        assert_eq!(asked.len(), 2);
        // A new producer DLQ whose end the brokers do not tell (no leader): not complete, and
        // asked again only after a while, not at every check.
        let mut more = assigned(Some(12));
        more.push((tp("p", 1), None));
        assert!(!check(&mut c, &more, 2_000, &ends, &mut asked));
        assert!(!check(&mut c, &more, 2_500, &ends, &mut asked));
        assert_eq!(asked.len(), 3, "{asked:?}");
        ends.insert(tp("p", 1), (3, 7));
        let t = 2_000 + ASK_AGAIN_MS;
        assert!(!check(&mut c, &more, t, &ends, &mut asked), "at none of 7");
        assert_eq!(asked.len(), 4);
        more[2].1 = Some(7);
        assert!(check(&mut c, &more, t + 500, &ends, &mut asked));
        // Taken away and given back (a rebalance): its end is noted again.
        assert!(check(
            &mut c,
            &assigned(Some(12)),
            t + 1_000,
            &ends,
            &mut asked
        ));
        ends.insert(tp("p", 1), (3, 9));
        assert!(
            !check(&mut c, &more, t + 1_500, &ends, &mut asked),
            "7 of 9"
        );
        // Records deleted under the noted end before any was read: nothing left to read, told
        // at the next ask.
        let mut gone = assigned(Some(12));
        gone.push((tp("r", 0), None));
        ends.insert(tp("r", 0), (0, 4));
        let t = t + 2_000;
        assert!(!check(&mut c, &gone, t, &ends, &mut asked));
        ends.insert(tp("r", 0), (4, 4));
        assert!(!check(&mut c, &gone, t + 500, &ends, &mut asked));
        assert!(check(&mut c, &gone, t + ASK_AGAIN_MS, &ends, &mut asked));
        // A check asks about a few partitions at most: the index reads nothing meanwhile.
        let many: Vec<(Part, Option<i64>)> = (0..10).map(|i| (tp("m", i), None)).collect();
        let before = asked.len();
        assert!(!check(&mut c, &many, 0, &ends, &mut asked));
        assert_eq!(asked.len() - before, ASKS_PER_CHECK);
    }

    #[test]
    fn a_record_is_filed_under_its_source_and_a_spoof_under_its_topics() {
        let dlq = Kind::ProducerDlq;
        let q = Kind::Quarantine;
        let of = |kind, ce, reason| {
            record_source(
                kind,
                "sh.quarantine",
                ce,
                Some("lerian.streaming.tracer"),
                reason,
            )
        };
        assert_eq!(
            record_source(dlq, "lerian.streaming.ledger.dlq", None, None, None).as_deref(),
            Some("ledger")
        );
        assert_eq!(
            of(q, Some("ledger"), Some("type_invalid")).as_deref(),
            Some("ledger")
        );
        assert_eq!(
            of(q, None, Some("source_missing")).as_deref(),
            Some("tracer")
        );
        assert_eq!(
            of(q, Some("ledger"), Some("source_mismatch")).as_deref(),
            Some("tracer"),
            "the claim is not believed"
        );
    }

    fn dead_at(ms: i64) -> DeadDelivery {
        DeadDelivery {
            id: format!("0-{ms}"),
            event_id: "e".into(),
            subscription_id: "s".into(),
            tenant_id: "t".into(),
            attempts: 8,
            last_status: Some(500),
            last_error: None,
            reason: "exhausted".into(),
            dead_at: rfc3339_ms(ms),
            dead_at_ms: ms,
            redrivable: true,
            payload_bytes: 0,
        }
    }

    /// Two DLQ partitions read one after the other: the newest first by `dead_at` whatever the
    /// read order, and when full the oldest by `dead_at` goes, not the first read.
    #[test]
    fn attributes_are_read_by_their_exact_names_as_ingest_reads_them() {
        let h = |key: &str, value: &str| HeaderText {
            key: key.into(),
            value: Some(value.into()),
        };
        let headers = [h("CE-SOURCE", "ledger"), h("ce-tenantid", "t1")];
        assert_eq!(attribute(&headers, "ce-source"), None);
        assert_eq!(attribute(&headers, "ce-tenantid").as_deref(), Some("t1"));
    }

    #[test]
    fn dead_deliveries_are_kept_in_dead_at_order() {
        let mut dead = Ordered::default();
        // Partition 1's backlog (older), read after partition 0's newer records.
        for ms in [50, 60, 70, 10, 20, 30] {
            keep_dead(&mut dead, dead_at(ms));
        }
        let order: Vec<i64> = dead.iter().map(|d| d.dead_at_ms).collect();
        assert_eq!(order, [10, 20, 30, 50, 60, 70]);
        let mut full = Ordered::default();
        for i in 0..MAX_PER_KIND as i64 {
            full.insert(1_000 + i, dead_at(1_000 + i));
        }
        keep_dead(&mut full, dead_at(5));
        assert_eq!(
            full.front().unwrap().dead_at_ms,
            1_000,
            "older than all: not kept"
        );
        // Another partition's record at a time already held (the same id would be the same
        // record read again, taking its own place).
        let mut other = dead_at(1_500);
        other.id = "1-1500".into();
        keep_dead(&mut full, other);
        assert_eq!(full.len(), MAX_PER_KIND);
        assert_eq!(full.front().unwrap().dead_at_ms, 1_001, "the oldest went");
        assert!(full.iter().any(|d| d.dead_at_ms == 1_500));
    }

    /// More dead letters of one instant than a page holds (one transaction's): `before` = the
    /// last id of a page continues after it, with no repeat and none skipped.
    #[test]
    fn pages_of_one_instant_continue_after_the_last_id() {
        let clock = Arc::new(crate::runtime::clock::ManualClock::new(10_000));
        let f = Forensics::new(Duration::from_secs(3600), clock);
        {
            let mut inner = f.lock();
            keep_dead(&mut inner.dead, dead_at(8_000));
            for i in 0..250 {
                let mut d = dead_at(9_000);
                d.id = format!("0-{}", 100 + i);
                keep_dead(&mut inner.dead, d);
            }
            keep_dead(&mut inner.dead, dead_at(7_000));
        }
        let mut seen = Vec::new();
        let mut filter = Filter {
            limit: 100,
            ..Filter::default()
        };
        loop {
            let page = f.dead(&filter);
            let Some(last) = page.last() else { break };
            filter.until_ms = Some(last.dead_at_ms);
            filter.before_id = Some(last.id.clone());
            seen.extend(page.iter().map(|d| d.id.clone()));
            assert!(seen.len() <= 252, "pages repeat: {}", seen.len());
        }
        let unique: std::collections::BTreeSet<&String> = seen.iter().collect();
        assert_eq!((seen.len(), unique.len()), (252, 252));
        assert_eq!(seen.last().map(String::as_str), Some("0-7000"));
    }

    fn parse_rfc3339_ms(t: &str) -> i64 {
        chrono::DateTime::parse_from_rfc3339(t)
            .unwrap()
            .timestamp_millis()
    }

    fn kept(time: i64, payload: &[u8]) -> Kept {
        let rec = ForensicRecord {
            topic: "lerian.streaming.x.dlq".into(),
            partition: 0,
            offset: time,
            time: rfc3339_ms(time),
            filed_at: String::new(),
            source: Some("x".into()),
            tenant_id: None,
            cause: None,
            reason: None,
            dlq: BTreeMap::new(),
            headers: vec![HeaderText {
                key: "ce-id".into(),
                value: Some(format!("id-{time}")),
            }],
            key: None,
            payload: None,
            payload_base64: None,
            payload_bytes: payload.len(),
            payload_omitted: false,
        };
        Kept::new(time, rec, Some(payload))
    }

    /// Records of one instant are listed alike on every instance whatever order each read them
    /// in, so a page taken from one instance continues on another; and a record read again (the
    /// index's group rebalanced and started its partitions over) is kept once.
    #[test]
    fn one_instants_records_page_alike_on_every_instance_and_are_kept_once() {
        let at = |id: &str| {
            let mut d = dead_at(7_000);
            d.id = id.into();
            d
        };
        let (mut a, mut b) = (Ordered::default(), Ordered::default());
        for id in ["1-5", "0-9"] {
            keep_dead(&mut a, at(id));
        }
        for id in ["0-9", "1-5"] {
            keep_dead(&mut b, at(id));
        }
        let page = |o: &Ordered<DeadDelivery>, before: Option<&str>| -> Vec<String> {
            let f = Filter {
                limit: 1,
                until_ms: before.map(|_| 7_000),
                before_id: before.map(str::to_string),
                ..Filter::default()
            };
            let mut passed = f.before_id.is_none() || f.until_ms.is_none();
            o.iter()
                .rev()
                .filter(|d| {
                    after_cursor(&f, &mut passed, d.dead_at_ms, || {
                        f.before_id.as_deref() == Some(d.id.as_str())
                    })
                })
                .take(f.limit)
                .map(|d| d.id.clone())
                .collect()
        };
        let first = page(&a, None);
        let second = page(&b, Some(&first[0]));
        let mut seen = [first, second].concat();
        seen.sort();
        assert_eq!(seen, ["0-9", "1-5"]);
        // Read again: in its place, not twice.
        keep_dead(&mut a, at("1-5"));
        assert_eq!(a.len(), 2);
        let mut inner = Inner::default();
        assert!(inner.first_read("t", 0, 5));
        assert!(inner.first_read("t", 0, 6));
        assert!(
            !inner.first_read("t", 0, 5),
            "a record read again after a rebalance"
        );
        assert!(inner.first_read("t", 1, 0));
    }

    #[test]
    fn records_from_a_clock_far_ahead_do_not_keep_later_ones_out() {
        let now = 1_800_000_000_000;
        let year_2100 = 4_102_444_800_000;
        assert_eq!(filed_at(now - 5, now), now - 5);
        assert_eq!(filed_at(year_2100, now), now + FUTURE_SKEW_MS);
        let mut q = Queue::default();
        for i in 0..MAX_PER_KIND {
            let mut k = kept(year_2100, b"{}");
            k.rec.offset = i as i64;
            k.time = filed_at(year_2100, now);
            q.push(k);
        }
        // Later, a genuine record: filed after the flood, so the oldest of the flood goes.
        let later = now + FUTURE_SKEW_MS + 1;
        q.push(kept(filed_at(later, later), b"{}"));
        assert_eq!(q.items.len(), MAX_PER_KIND);
        assert_eq!(q.items.back().unwrap().time, later, "kept, the newest");
        assert_eq!(
            q.items.back().unwrap().rec.time,
            rfc3339_ms(later),
            "shown with its own time"
        );
    }

    #[test]
    fn large_records_are_bounded_by_bytes_the_oldest_going_first() {
        let mut q = Queue::default();
        // A JSON array of 64 KiB, as a flood of malformed records would carry.
        let big = format!("[{}0]", "0,".repeat(32 * 1024 - 2)).into_bytes();
        assert!(big.len() <= MAX_PAYLOAD && big.len() > MAX_PAYLOAD - 4);
        let n = MAX_BYTES_PER_KIND / big.len() + 100;
        for t in 0..n as i64 {
            q.push(kept(t, &big));
            assert!(q.bytes <= MAX_BYTES_PER_KIND, "{} bytes at {t}", q.bytes);
        }
        assert!(
            q.items.len() < n && q.items.len() > n - 200,
            "{}",
            q.items.len()
        );
        assert_eq!(
            q.items.back().unwrap().time,
            n as i64 - 1,
            "the newest kept"
        );
        assert!(
            q.items.front().unwrap().time >= 100,
            "the oldest gone first"
        );
        assert_eq!(q.bytes, q.items.iter().map(|k| k.bytes).sum::<usize>());
        q.prune(n as i64);
        assert_eq!((q.items.len(), q.bytes), (0, 0));
    }

    #[test]
    fn the_newest_by_record_time_are_kept_whatever_order_they_are_read_in() {
        let mut q = Queue::default();
        let big = vec![b'x'; 60 * 1024];
        let fits = MAX_BYTES_PER_KIND / kept(0, &big).bytes;
        // A small producer's recent dead letters read first, then another topic's older backlog,
        // more than the index holds.
        for t in 0..10 {
            q.push(kept(1_000_000 + t, &big));
        }
        for t in 0..fits as i64 + 50 {
            q.push(kept(t, &big));
        }
        let newest: Vec<i64> = q.items.iter().rev().take(10).map(|k| k.time).collect();
        assert_eq!(newest, (1_000_000..1_000_010).rev().collect::<Vec<i64>>());
        assert!(
            q.items
                .iter()
                .zip(q.items.iter().skip(1))
                .all(|(a, b)| a.time <= b.time),
            "in record-time order"
        );
        assert!(q.bytes <= MAX_BYTES_PER_KIND);
        assert_eq!(q.bytes, q.items.iter().map(|k| k.bytes).sum::<usize>());
        // Queries answer newest first by record time.
        let f = Filter {
            limit: 3,
            ..Filter::default()
        };
        let times: Vec<i64> = query(&q, &f).iter().map(|r| r.offset).collect();
        assert_eq!(times, [1_000_009, 1_000_008, 1_000_007]);
        // The next page: at or before the last one's time (that record comes again).
        let f = Filter {
            limit: 3,
            until_ms: Some(1_000_007),
            ..Filter::default()
        };
        let times: Vec<i64> = query(&q, &f).iter().map(|r| r.offset).collect();
        assert_eq!(times, [1_000_007, 1_000_006, 1_000_005]);
    }

    /// Pages follow `filed_at` and the `<topic>:<partition>:<offset>` cursor: a record stamped a
    /// day ahead (filed a little past now) and more records of one instant than a page holds
    /// are each listed once, none skipped.
    #[test]
    fn pages_follow_filed_at_and_the_record_cursor() {
        let now = 1_000_000;
        let mut q = Queue::default();
        let mut ahead = kept(now + 86_400_000, b"{}");
        ahead.time = filed_at(now + 86_400_000, now);
        q.push(ahead);
        for i in 0..7 {
            let mut k = kept(900_000, b"{}");
            k.rec.offset = i;
            q.push(k);
        }
        q.push(kept(800_000, b"{}"));
        let mut f = Filter {
            limit: 3,
            ..Filter::default()
        };
        let mut seen = Vec::new();
        loop {
            let page = query(&q, &f);
            let Some(last) = page.last() else { break };
            f.until_ms = Some(parse_rfc3339_ms(&last.filed_at));
            f.before_id = Some(format!("{}:{}:{}", last.topic, last.partition, last.offset));
            seen.extend(page.iter().map(|r| (r.time.clone(), r.offset)));
            assert!(seen.len() <= 9, "pages repeat: {seen:?}");
        }
        assert_eq!(seen.len(), 9, "{seen:?}");
        assert_eq!(
            seen[0].0,
            rfc3339_ms(now + 86_400_000),
            "shown with its own time"
        );
    }

    #[test]
    fn an_answer_ends_after_the_record_that_crosses_its_byte_bound() {
        let mut q = Queue::default();
        // Records of 60 KiB of control bytes: 60 KiB kept, 360 KiB as JSON (`\u0001`).
        let mut k = |t: i64| {
            let mut r = kept(t, b"{}");
            r.rec.headers.push(HeaderText {
                key: "x-junk".into(),
                value: Some("\u{1}".repeat(60 * 1024)),
            });
            q.push(r);
        };
        for t in 0..100 {
            k(t);
        }
        let f = Filter {
            limit: 1000,
            ..Filter::default()
        };
        let page = query(&q, &f);
        let bytes: usize = page
            .iter()
            .map(|r| serde_json::to_vec(r).unwrap().len())
            .sum();
        let one = serde_json::to_vec(&page[0]).unwrap().len();
        assert!(
            page.len() < q.items.len(),
            "{} of {}",
            page.len(),
            q.items.len()
        );
        assert!(
            bytes >= ANSWER_BYTES && bytes < ANSWER_BYTES + one,
            "{bytes}"
        );
    }

    #[test]
    fn a_payload_is_answered_as_json_when_it_parses_and_base64_when_not() {
        let json = kept(1, br#"{"amount": 10, "ids": [1,2]}"#).answer();
        assert_eq!(
            json.payload
                .as_deref()
                .map(serde_json::value::RawValue::get),
            Some(r#"{"amount": 10, "ids": [1,2]}"#),
            "the text as written, not a tree"
        );
        let page = serde_json::to_value(&json).unwrap();
        assert_eq!(
            page["payload"],
            serde_json::json!({"amount": 10, "ids": [1, 2]})
        );
        assert_eq!(json.payload_base64, None);
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for strict in [&b"[1e400]"[..], br#""\ud800""#, deep.as_bytes()] {
            let k = kept(3, strict).answer();
            assert!(k.payload.is_none(), "{}", String::from_utf8_lossy(strict));
            assert!(k.payload_base64.is_some());
        }
        let raw = kept(2, b"\x00not json").answer();
        assert!(raw.payload.is_none());
        assert_eq!(raw.payload_base64, Some(STANDARD.encode(b"\x00not json")));
    }
}
