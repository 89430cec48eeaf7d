//! Redelivery to one subscription: per-subscription replay (`POST /admin/replay`), recover
//! (`POST /v1/subscriptions/{id}/recover`) and redrive (`POST /admin/deliveries/dead/redrive`).
//!
//! All three write *redelivery requests* to `<prefix>.inbox`: the event's headers and value, key =
//! tenant (so the request lands in the partition of the tenant's events), plus
//! `x-streaming-hub-redeliver: <subscription id>` and `x-streaming-hub-request: <request id>`.
//! The hub task owning that partition creates a job for that one subscription in its transaction
//! (no dedup, no new sequence number; nothing if the subscription's job for the event is still
//! pending). Ingest never carries a producer's `x-streaming-hub-*` headers, so only the hub's
//! operators can ask for one.
//!
//! - Replay scans the inbox between two times for the tenant's events that match the subscription
//!   now (each `ce-id` once), skipping earlier redelivery requests.
//! - Recover and redrive read `<prefix>.dlq`, whose records carry the dead event's headers and
//!   value (records without them, written before they did, are counted as `unrecoverable`).
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use crate::config::Config;
use crate::ingest::classify::schema_major;
use crate::runtime::avro::{Codec, RecordKind};
use crate::runtime::changelog::TrackingContext;
use crate::runtime::kafka;
use crate::runtime::records::{DeadLetterRecord, DestinationType, SubscriptionRecord};
use crate::subscriptions::table::{EventRef, sub_matches};

/// Header of a redelivery request on the inbox: the one subscription it is for.
pub const H_REDELIVER: &str = "x-streaming-hub-redeliver";
/// Header of a redelivery request: the replay, recover or redrive that asked for it.
pub const H_REQUEST: &str = "x-streaming-hub-request";
const TIMEOUT: Duration = Duration::from_secs(10);
/// Dead letters a recover read and could not decode (skipped, with a WARN naming each).
pub const DEAD_LETTERS_UNREADABLE: &str = "streaming_hub_recover_dead_letters_unreadable_total";
/// The longest a scan waits for a record before it looks at the stop flag again.
const POLL_SLICE: Duration = Duration::from_secs(1);
/// How long a scan waits at a transaction still open before the end of its range: the hub's
/// producers' transaction timeout (60 s), after which the broker aborts it (it looks every
/// 10 s), and a margin.
const OPEN_TRANSACTION_PATIENCE: Duration = Duration::from_secs(90);

#[derive(Debug, Clone, thiserror::Error)]
pub enum RedeliverError {
    #[error("kafka: {0}")]
    Kafka(String),
    #[error("{0}")]
    Invalid(String),
    /// A redelivery the hub would not send (its subscription disabled or not verified).
    #[error("{0}")]
    Inactive(String),
    /// The instance began shutting down: the run stopped where it was (the requests it queued
    /// so far are written); running it again on a running instance does the rest.
    #[error("stopped: this instance is shutting down (run it again on a running instance)")]
    Stopped,
    /// An operator cancelled the run (`DELETE /admin/replay/{id}`): the requests it queued
    /// before are written, none after.
    #[error("cancelled by an operator; the redeliveries requested before were queued")]
    Cancelled,
    /// The run panicked (a bug): requests it had queued but not yet sent may be lost with it.
    #[error(
        "the run failed unexpectedly (see the instance's log); redeliveries it counted as \
         requested may not have been sent: run it again (receivers deduplicate on webhook-id)"
    )]
    Panicked,
}

/// Runs `op`, a panic in it answered as [`RedeliverError::Panicked`] (logged), so that its
/// progress is finished `failed` instead of showing `running` for good.
pub fn catching_panics<T>(
    op: impl FnOnce() -> Result<T, RedeliverError>,
) -> Result<T, RedeliverError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(op)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(panic = %what, "a replay, recover or redrive panicked");
        Err(RedeliverError::Panicked)
    })
}

fn k(e: RdKafkaError) -> RedeliverError {
    RedeliverError::Kafka(e.to_string())
}

/// Progress of one replay, recover or redrive.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct Progress {
    pub id: String,
    pub kind: String,
    pub subscription_id: Option<String>,
    /// `running`, `done`, `failed` or `cancelled` (a replay, `DELETE /admin/replay/{id}`).
    pub state: String,
    /// Records read (a recover: the tenant's dead letters read; a redrive: the dead letters
    /// named).
    pub scanned: u64,
    /// Events selected for redelivery.
    pub matched: u64,
    /// Redelivery requests written to the inbox.
    pub requested: u64,
    /// Dead letters without the event's content (written by an older hub).
    pub unrecoverable: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Set by `DELETE /admin/replay/{id}` (under this progress's lock, while it runs): the run
    /// stops before its next record.
    #[serde(skip)]
    pub cancel: Arc<AtomicBool>,
}

/// Writes redelivery requests and reads the inbox and the DLQ (share it in an `Arc`).
///
/// Each run writes with a producer of its own: a run's `done` or `failed` is then its own
/// requests' outcome, and its flush waits for its own queue only. Runs on one instance shared a
/// producer before, and one run's refused request could be reported by another run beside it.
pub struct Redeliverer {
    config: Config,
    codec: Arc<Codec>,
    inbox: String,
    dlq: String,
    /// The process's stop flag: a run looks at it between records, so a shutdown does not wait
    /// for a long scan (its blocking task kept the process alive after every stage had stopped).
    stop: Arc<AtomicBool>,
}

/// The producer of one run.
type RunProducer = BaseProducer<TrackingContext>;

impl Redeliverer {
    pub fn new(config: &Config, codec: Arc<Codec>) -> Result<Redeliverer, RedeliverError> {
        // Made once here so a configuration librdkafka refuses stops the start, not a run.
        drop(producer(config)?);
        Ok(Redeliverer {
            config: config.clone(),
            codec,
            inbox: format!("{}.inbox", config.topic_prefix),
            dlq: format!("{}.dlq", config.topic_prefix),
            stop: Arc::default(),
        })
    }

    /// Runs stop (with [`RedeliverError::Stopped`]) once `stop` is set.
    pub fn stopping_with(mut self, stop: Arc<AtomicBool>) -> Redeliverer {
        self.stop = stop;
        self
    }
}

/// `Err(Stopped)` once `stop` is set.
fn go_on(stop: &AtomicBool) -> Result<(), RedeliverError> {
    if stop.load(Ordering::Relaxed) {
        Err(RedeliverError::Stopped)
    } else {
        Ok(())
    }
}

/// A producer for one run's redelivery requests.
fn producer(config: &Config) -> Result<RunProducer, RedeliverError> {
    kafka::base(config)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        // The same partitioner as ingest: key = tenant lands in the tenant's inbox partition.
        .set("partitioner", "murmur2_random")
        // As large as what ingest and the hub write to the inbox (an event up to
        // `STREAMING_HUB_MAX_PAYLOAD_BYTES` and its headers): librdkafka's 1 MB default
        // refused the larger events' requests.
        .set("message.max.bytes", "4194304")
        // A run's requests wait in this queue for the broker; a long recover or redrive of large
        // events waits for room (`send_waiting`) instead of holding them all.
        .set("queue.buffering.max.kbytes", "65536")
        .create_with_context(TrackingContext::default())
        .map_err(k)
}

impl Redeliverer {
    fn consumer(&self) -> Result<BaseConsumer<kafka::ReaderContext>, RedeliverError> {
        kafka::base(&self.config)
            .set("group.id", format!("{}.ops-reader", self.config.group_id))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("enable.partition.eof", "true")
            // A range whose start retention deleted after the range was taken (a long scan of
            // an old window) is read from the oldest record kept, not skipped: librdkafka's
            // default resets such a position to the partition's end without telling the
            // application, and the scan then met end-of-partition at once.
            .set("auto.offset.reset", "earliest")
            .create_with_context(kafka::ReaderContext)
            .map_err(k)
    }

    /// Where a run's ranges end: a `read_uncommitted` client, told the log's end (a
    /// `read_committed` one is told the last stable offset, which stops short of a transaction
    /// still open and of everything committed after it: a recover took those dead letters for
    /// not there yet, and answered `done` without them). The scan then waits for that open
    /// transaction to end (see [`scan`]).
    fn ends(&self) -> Result<BaseConsumer<kafka::ReaderContext>, RedeliverError> {
        kafka::base(&self.config)
            .set("group.id", format!("{}.ops-reader", self.config.group_id))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_uncommitted")
            .create_with_context(kafka::ReaderContext)
            .map_err(k)
    }

    /// Reads each `(partition, start, end)` range of `topic` as the operations read theirs
    /// (`read_committed`; a start retention has deleted reads from the oldest record kept),
    /// calling `f` for each record.
    pub fn read_ranges(
        &self,
        topic: &str,
        ranges: &[(i32, i64, i64)],
        f: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> Result<(), RedeliverError>,
    ) -> Result<(), RedeliverError> {
        scan(&self.consumer()?, topic, ranges, &self.stop, f)
    }

    /// Queues one redelivery request.
    fn request(
        &self,
        producer: &RunProducer,
        tenant: &str,
        subscription: &str,
        request_id: &str,
        headers: &[(String, Option<Vec<u8>>)],
        value: Option<&[u8]>,
    ) -> Result<(), RedeliverError> {
        let mut h = OwnedHeaders::new_with_capacity(headers.len() + 2);
        for (key, v) in headers {
            if key.eq_ignore_ascii_case(H_REDELIVER) || key.eq_ignore_ascii_case(H_REQUEST) {
                continue;
            }
            h = h.insert(Header {
                key,
                value: v.as_deref(),
            });
        }
        h = h
            .insert(Header {
                key: H_REDELIVER,
                value: Some(subscription),
            })
            .insert(Header {
                key: H_REQUEST,
                value: Some(request_id),
            });
        let mut r = BaseRecord::<str, [u8]>::to(&self.inbox)
            .key(tenant)
            .headers(h);
        if let Some(v) = value {
            r = r.payload(v);
        }
        kafka::send_waiting(producer, r).map_err(k)
    }

    /// Ends a run: its requests queued so far are written whether or not it failed partway
    /// (dropping the producer would purge them, though `progress` counted them requested); the
    /// run's own error wins over a write failure.
    fn finish(
        producer: &RunProducer,
        run: Result<(), RedeliverError>,
    ) -> Result<(), RedeliverError> {
        match (run, Self::flush(producer)) {
            (Ok(()), written) => written,
            (Err(e), Ok(())) => Err(e),
            // Both: the run's error, and that some of what it counted was not written.
            (Err(e), Err(w)) => Err(RedeliverError::Kafka(format!(
                "{e}; and not every request counted was written: {w}"
            ))),
        }
    }

    /// Waits for every request of the run sent; fails if the brokers refused one (a flush alone
    /// succeeds once the queue is empty, delivered or not).
    fn flush(producer: &RunProducer) -> Result<(), RedeliverError> {
        producer.flush(TIMEOUT).map_err(k)?;
        match producer.context().take().1 {
            Some(e) => Err(RedeliverError::Kafka(format!(
                "a redelivery request was not written: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// Per-subscription replay: the tenant's inbox events in `[from_ms, to_ms)` that match `sub`.
    pub fn replay(
        &self,
        sub: &SubscriptionRecord,
        from_ms: i64,
        to_ms: i64,
        progress: &Mutex<Progress>,
    ) -> Result<(), RedeliverError> {
        let consumer = self.consumer()?;
        let ranges = ranges_for_times(&self.ends()?, &self.inbox, from_ms, to_ms, &self.stop)?;
        let producer = producer(&self.config)?;
        let request_id = request_id_of(progress);
        let mut seen = RecentIds::new(REPLAY_IDS_KEPT);
        let scanned = scan(&consumer, &self.inbox, &ranges, &self.stop, |m| {
            let mut p = progress.lock().unwrap_or_else(|p| p.into_inner());
            if p.cancel.load(Ordering::SeqCst) {
                return Err(RedeliverError::Cancelled);
            }
            p.scanned += 1;
            drop(p);
            if m.key() != Some(sub.tenant_id.as_bytes()) {
                return Ok(());
            }
            let headers = owned_headers(m);
            let get = |name: &str| {
                headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .and_then(|(_, v)| v.as_deref())
                    .and_then(|v| std::str::from_utf8(v).ok())
            };
            if get(H_REDELIVER).is_some() {
                return Ok(()); // an earlier redelivery request, not an event
            }
            let (Some(source), Some(resource), Some(event), Some(major), Some(id)) = (
                get("ce-source"),
                get("ce-resourcetype"),
                get("ce-eventtype"),
                get("ce-schemaversion").and_then(schema_major),
                get("ce-id"),
            ) else {
                return Ok(());
            };
            let e = EventRef {
                tenant: &sub.tenant_id,
                source,
                resource,
                event,
                schema_major: major,
            };
            if !sub_matches(sub, &e) || !seen.insert(id) {
                return Ok(());
            }
            self.request(
                &producer,
                &sub.tenant_id,
                &sub.id,
                &request_id,
                &headers,
                m.payload(),
            )?;
            let mut p = progress.lock().unwrap_or_else(|p| p.into_inner());
            p.matched += 1;
            p.requested += 1;
            Ok(())
        });
        Self::finish(&producer, scanned)
    }

    /// Recover: the subscription's dead letters since `since_ms`, each event once.
    pub fn recover(
        &self,
        sub: &SubscriptionRecord,
        since_ms: i64,
        progress: &Mutex<Progress>,
    ) -> Result<(), RedeliverError> {
        let consumer = self.consumer()?;
        let ranges = ranges_for_times(&self.ends()?, &self.dlq, since_ms, i64::MAX, &self.stop)?;
        let producer = producer(&self.config)?;
        let request_id = request_id_of(progress);
        // Each dead letter is requested as the scan reaches it: only the ids seen are kept, not
        // the events (a long outage dead-letters many, each up to the payload limit), and at
        // most the last `REPLAY_IDS_KEPT` of them (a 16-byte digest each), as replay does: an event
        // dead-lettered again that far apart is requested again.
        let mut seen = RecentIds::new(REPLAY_IDS_KEPT);
        let scanned = scan(&consumer, &self.dlq, &ranges, &self.stop, |m| {
            let decoded = m.payload().map(|v| {
                self.codec
                    .decode::<DeadLetterRecord>(RecordKind::DeadLetter, v)
            });
            let dl = match decoded {
                Some(Ok(dl)) => dl,
                // Whose it is cannot be told: the operators are, not the tenant (its count
                // would tell it of others' dead letters). A record without a value is not one.
                Some(Err(e)) => {
                    metrics::counter!(DEAD_LETTERS_UNREADABLE).increment(1);
                    tracing::warn!(
                        topic = %self.dlq,
                        partition = m.partition(),
                        offset = m.offset(),
                        error = %e,
                        "a recover skipped a dead letter it cannot read (written by a newer \
                         version of the hub, or damaged): redrive it by id from an instance \
                         that reads it"
                    );
                    return Ok(());
                }
                None => return Ok(()),
            };
            // Only the tenant's own dead letters count as scanned: the answer goes to the
            // tenant, and the others' would tell it how many deliveries died hub-wide.
            if dl.tenant_id != sub.tenant_id {
                return Ok(());
            }
            progress.lock().unwrap_or_else(|p| p.into_inner()).scanned += 1;
            if dl.subscription_id == sub.id
                && dl.tenant_id == sub.tenant_id
                && dl.dead_at >= since_ms
                && seen.insert(&dl.event_id)
            {
                self.request_one_dead(&producer, &dl, &request_id, progress)?;
            }
            Ok(())
        });
        Self::finish(&producer, scanned)
    }

    /// Redrive: the dead letters at these `<partition>-<offset>` positions of `<prefix>.dlq`.
    ///
    /// Every position is checked before any request is written (a missing one, one of another
    /// tenant, or one `admit` refuses fails the run with nothing written); then each is read
    /// again and requested. Only one dead letter (up to the payload limit) is held at a time,
    /// whatever the list's length.
    pub fn redrive(
        &self,
        positions: &[(i32, i64)],
        tenant: Option<&str>,
        progress: &Mutex<Progress>,
        admit: impl Fn(&DeadLetterRecord) -> Result<(), RedeliverError>,
    ) -> Result<(), RedeliverError> {
        let consumer = self.consumer()?;
        let ends = self.ends()?;
        let partitions: HashSet<i32> = kafka::partition_ids(&consumer, &self.dlq, TIMEOUT)
            .map_err(|e| RedeliverError::Kafka(e.to_string()))?
            .into_iter()
            .collect();
        for &(partition, offset) in positions {
            go_on(&self.stop)?;
            let dl = self.dead_at(&consumer, &ends, &partitions, partition, offset, tenant)?;
            progress.lock().unwrap_or_else(|p| p.into_inner()).scanned += 1;
            let named = |m: String| format!("dead letter {partition}-{offset}: {m}");
            admit(&dl).map_err(|e| match e {
                RedeliverError::Inactive(m) => RedeliverError::Inactive(named(m)),
                RedeliverError::Invalid(m) => RedeliverError::Invalid(named(m)),
                e => e,
            })?;
        }
        let request_id = request_id_of(progress);
        let producer = producer(&self.config)?;
        let requested = positions.iter().try_for_each(|&(partition, offset)| {
            go_on(&self.stop)?;
            // Checked above: one gone since (retention) or unreadable now fails the run, with
            // the requests before it queued.
            let dl = self
                .dead_at(&consumer, &ends, &partitions, partition, offset, tenant)
                .map_err(|e| match e {
                    RedeliverError::Invalid(m) => {
                        RedeliverError::Kafka(format!("{m} any more (deleted while the run went)"))
                    }
                    e => e,
                })?;
            self.request_one_dead(&producer, &dl, &request_id, progress)
        });
        Self::finish(&producer, requested)
    }

    /// The dead letter at `partition`-`offset` of the DLQ (of `tenant`, when given). One behind a
    /// transaction still open (committed after it began) is waited for, as a scan waits.
    fn dead_at(
        &self,
        consumer: &BaseConsumer<kafka::ReaderContext>,
        ends: &BaseConsumer<kafka::ReaderContext>,
        partitions: &HashSet<i32>,
        partition: i32,
        offset: i64,
        tenant: Option<&str>,
    ) -> Result<DeadLetterRecord, RedeliverError> {
        let missing = || RedeliverError::Invalid(format!("no dead letter at {partition}-{offset}"));
        if !partitions.contains(&partition) {
            return Err(missing());
        }
        let (low, high) = ends
            .fetch_watermarks(&self.dlq, partition, TIMEOUT)
            .map_err(k)?;
        if offset < low || offset >= high {
            return Err(missing());
        }
        // That offset may hold no record (a transaction marker, an aborted write): then the scan
        // reads nothing there.
        let mut found = None;
        scan(
            consumer,
            &self.dlq,
            &[(partition, offset, offset + 1)],
            &self.stop,
            |m| {
                if m.offset() == offset {
                    found = m.payload().and_then(|v| {
                        self.codec
                            .decode::<DeadLetterRecord>(RecordKind::DeadLetter, v)
                            .ok()
                    });
                }
                Ok(())
            },
        )?;
        match found {
            Some(dl) if tenant.is_none_or(|t| t == dl.tenant_id) => Ok(dl),
            _ => Err(missing()),
        }
    }

    /// One dead letter's redelivery request (counted in `progress`; one without the event's
    /// headers, written by an earlier version, is counted unrecoverable).
    fn request_one_dead(
        &self,
        producer: &RunProducer,
        dl: &DeadLetterRecord,
        request_id: &str,
        progress: &Mutex<Progress>,
    ) -> Result<(), RedeliverError> {
        let mut p = progress.lock().unwrap_or_else(|p| p.into_inner());
        p.matched += 1;
        let Some(headers) = &dl.event_headers else {
            p.unrecoverable += 1;
            return Ok(());
        };
        drop(p);
        let headers: Vec<(String, Option<Vec<u8>>)> = headers
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect();
        self.request(
            producer,
            &dl.tenant_id,
            &dl.subscription_id,
            request_id,
            &headers,
            dl.event_value.as_deref(),
        )?;
        progress.lock().unwrap_or_else(|p| p.into_inner()).requested += 1;
        Ok(())
    }
}

/// How many matched event ids a replay keeps to skip copies of an event (a producer's retries,
/// at other offsets): the most recent ones, about 50 MiB at most (a set and a queue of 16-byte
/// keys). A copy further on than that from the first is requested again, which the delivery
/// contract allows (at least once; receivers deduplicate on `webhook-id`); keeping every id of a
/// long window of a busy tenant (tens of millions) would take gigabytes of the instance that
/// also delivers.
pub const REPLAY_IDS_KEPT: usize = 1_000_000;

/// The last `cap` ids inserted, as 128-bit keys: a UUID's own bits, another id's SHA-256 prefix.
struct RecentIds {
    set: HashSet<u128>,
    order: std::collections::VecDeque<u128>,
    cap: usize,
}

impl RecentIds {
    fn new(cap: usize) -> RecentIds {
        RecentIds {
            set: HashSet::new(),
            order: std::collections::VecDeque::new(),
            cap,
        }
    }

    /// Whether `id` is new among the ids kept (it is kept from now on).
    fn insert(&mut self, id: &str) -> bool {
        use sha2::Digest;
        let mut canonical = uuid::Uuid::encode_buffer();
        let key = match uuid::Uuid::try_parse(id) {
            // As the hub's dedup tells ids apart (`hub::dedup::dedup_key`): a UUIDv7 in either
            // case is one event; any other spelling, or another id, by its text.
            Ok(u) if crate::ingest::classify::is_uuidv7(id) => u.as_u128(),
            Ok(u) if u.hyphenated().encode_lower(&mut canonical) == id => u.as_u128(),
            _ => {
                let d = sha2::Sha256::digest(id.as_bytes());
                u128::from_be_bytes(d[..16].try_into().expect("16 bytes"))
            }
        };
        if !self.set.insert(key) {
            return false;
        }
        self.order.push_back(key);
        if self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }
}

/// The id of the run `progress` follows, written into each of its redelivery requests.
fn request_id_of(progress: &Mutex<Progress>) -> String {
    progress
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .id
        .clone()
}

/// Whether a subscription can be redelivered to (webhooks only: pull clients re-read by cursor).
pub fn check_redeliverable(sub: &SubscriptionRecord) -> Result<(), RedeliverError> {
    if sub.destination.kind != DestinationType::Webhook {
        return Err(RedeliverError::Invalid(
            "a pull subscription re-reads its events with an older cursor".into(),
        ));
    }
    Ok(())
}

fn owned_headers(
    m: &impl Message<Headers = rdkafka::message::BorrowedHeaders>,
) -> Vec<(String, Option<Vec<u8>>)> {
    m.headers()
        .map(|h| {
            crate::runtime::kafka::utf8_headers(h)
                .map(|(key, value)| (key.to_string(), value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default()
}

/// For each partition of `topic`: the offsets of the first record at or after `from_ms` and of the
/// first at or after `to_ms` (the high watermark when none), as half-open ranges; empty ones left
/// out. `consumer` is `read_uncommitted` ([`Redeliverer::ends`]): ranges end where the log ends,
/// not at the last stable offset.
fn ranges_for_times(
    consumer: &BaseConsumer<kafka::ReaderContext>,
    topic: &str,
    from_ms: i64,
    to_ms: i64,
    stop: &AtomicBool,
) -> Result<Vec<(i32, i64, i64)>, RedeliverError> {
    // A topic the broker could not describe (its leaders moving, not there): not "no records".
    let partitions = kafka::partition_ids(consumer, topic, TIMEOUT)
        .map_err(|e| RedeliverError::Kafka(e.to_string()))?;
    let at = |ms: i64| -> Result<TopicPartitionList, RedeliverError> {
        let mut tpl = TopicPartitionList::new();
        for p in &partitions {
            tpl.add_partition_offset(topic, *p, Offset::Offset(ms.max(0)))
                .map_err(k)?;
        }
        consumer.offsets_for_times(tpl, TIMEOUT).map_err(k)
    };
    let starts = at(from_ms)?;
    let ends = if to_ms == i64::MAX {
        None
    } else {
        Some(at(to_ms)?)
    };
    let mut out = Vec::new();
    for p in partitions {
        go_on(stop)?;
        let (_, high) = consumer.fetch_watermarks(topic, p, TIMEOUT).map_err(k)?;
        let off = |tpl: &TopicPartitionList| -> Result<i64, RedeliverError> {
            Ok(kafka::offset_for_time(tpl, topic, p)
                .map_err(k)?
                .unwrap_or(high))
        };
        let start = off(&starts)?;
        let end = match &ends {
            Some(ends) => off(ends)?,
            None => high,
        };
        if start < end {
            out.push((p, start, end));
        }
    }
    Ok(out)
}

/// Reads each `(partition, start, end)` range of `topic`, calling `f` for each record, until
/// `stop` is set (then `Err(Stopped)`).
///
/// A range is read once the consumer's position has reached its end. A `read_committed` reader
/// stops at the last stable offset: short of `end` while a transaction begun before it is still
/// open, though records after it may be committed (another instance's dead letters). When no
/// record comes for [`TIMEOUT`] and that is why, the scan waits on for that transaction to end,
/// up to [`OPEN_TRANSACTION_PATIENCE`] in all, then reads what it committed and what others
/// committed after it. Transaction markers and aborted records move the position unread.
fn scan(
    consumer: &BaseConsumer<kafka::ReaderContext>,
    topic: &str,
    ranges: &[(i32, i64, i64)],
    stop: &AtomicBool,
    mut f: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> Result<(), RedeliverError>,
) -> Result<(), RedeliverError> {
    for &(partition, start, end) in ranges {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, partition, Offset::Offset(start))
            .map_err(k)?;
        consumer.assign(&tpl).map_err(k)?;
        // Polled a second at a time, so a stop is seen while the brokers are slow to answer.
        let mut idle = Duration::ZERO;
        // The last stable offset, once a wait found it short of `end`.
        let mut held_at: Option<i64> = None;
        loop {
            go_on(stop)?;
            match consumer.poll(POLL_SLICE) {
                Some(Ok(m)) => {
                    idle = Duration::ZERO;
                    held_at = None;
                    if m.offset() >= end {
                        break;
                    }
                    f(&m)?;
                    if m.offset() + 1 >= end {
                        break;
                    }
                }
                // At the end of what it may read: the range's end once markers and aborted
                // records are stepped over; short of it while a transaction is open.
                Some(Err(RdKafkaError::PartitionEOF(_))) => {
                    if position(consumer, topic, partition)?.is_some_and(|o| o >= end) {
                        break;
                    }
                }
                Some(Err(e)) => return Err(k(e)),
                None => {
                    idle += POLL_SLICE;
                    if idle >= TIMEOUT && held_at.is_none() {
                        let (_, stable) = consumer
                            .fetch_watermarks(topic, partition, TIMEOUT)
                            .map_err(k)?;
                        if stable >= end {
                            return Err(RedeliverError::Kafka(format!(
                                "no record from {topic}/{partition} within {TIMEOUT:?}"
                            )));
                        }
                        tracing::info!(
                            topic,
                            partition,
                            open_at = stable,
                            end,
                            "a scan waits for a transaction still open before the end of its range"
                        );
                        held_at = Some(stable);
                    }
                    if let Some(at) = held_at.filter(|_| idle >= OPEN_TRANSACTION_PATIENCE) {
                        return Err(RedeliverError::Kafka(format!(
                            "{topic}/{partition} stays behind a transaction open at offset {at} \
                             (the range ends at {end}) after {OPEN_TRANSACTION_PATIENCE:?}"
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The consumer's position on `topic`/`partition`: the offset after the last record, marker or
/// aborted record it stepped over (None before it read anything there).
fn position(
    consumer: &BaseConsumer<kafka::ReaderContext>,
    topic: &str,
    partition: i32,
) -> Result<Option<i64>, RedeliverError> {
    let positions = consumer.position().map_err(k)?;
    Ok(positions
        .find_partition(topic, partition)
        .and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_that_panics_ends_failed_not_running() {
        let r: Result<(), _> = catching_panics(|| panic!("a bug"));
        assert!(matches!(r, Err(RedeliverError::Panicked)));
        let r = catching_panics(|| Ok::<_, RedeliverError>(7));
        assert_eq!(r.ok(), Some(7));
    }

    #[test]
    fn a_replay_skips_copies_among_the_ids_it_keeps_and_forgets_the_oldest() {
        let mut seen = RecentIds::new(2);
        let a = "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1c";
        assert!(seen.insert(a));
        assert!(!seen.insert(a), "a copy is skipped");
        // The same UUIDv7 in upper case is the same event to the hub's dedup.
        assert!(!seen.insert(&a.to_uppercase()));
        // Another version's UUID in another spelling is keyed as written there: another id.
        assert!(seen.insert("9F1C6A52-3B1E-4D2A-8C4F-1A2B3C4D5E6F"));
        assert!(seen.insert("not-a-uuid"));
        assert!(!seen.insert("not-a-uuid"));
        // Three kept past a cap of two: the first is forgotten, so its copy is requested again.
        assert!(seen.insert(a));
        assert_eq!(seen.set.len(), 2);
        assert_eq!(seen.order.len(), 2);
    }
}
