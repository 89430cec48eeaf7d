//! The ingest loop: consume the follow set, classify each record, write accepted records to
//! `<prefix>.inbox` keyed by tenant and quarantined ones to `<prefix>.quarantine`, and commit the
//! outputs and the input offsets in one Kafka transaction per batch.
//!
//! Invariants:
//! - A `read_committed` reader of inbox + quarantine sees each input record exactly once: outputs
//!   and offsets commit together, an aborted batch is rewound and read again, and a zombie is fenced
//!   by the transactional id `<prefix>.ingest.<instance>` plus the group generation (KIP-447).
//! - A batch closes at `STREAMING_HUB_INGEST_BATCH_MAX` records or `STREAMING_HUB_COMMIT_INTERVAL`
//!   after its first record, whichever comes first, so latency stays low under light load.
//! - The payload is never parsed; a malformed record is a verdict, never an error of the loop.
//! - The loop runs on its own OS thread: rdkafka's transactional calls block.
//!
//! Output layout. Inbox: key = tenant id, value and headers unchanged, plus
//! `x-streaming-hub-source-topic`, `-source-partition`, `-source-offset`, `-ingest-time` (RFC 3339,
//! ms, UTC). Quarantine: key and headers of the input, plus the producers' forensic headers
//! `x-lerian-dlq-*` and `x-streaming-hub-reason`; a `payload_too_large` record keeps only its size
//! (`x-lerian-dlq-payload-omitted: true`), so a huge record cannot stall the partition; a record
//! with too many headers or header bytes keeps of them only the first of each known `ce-*`
//! attribute, its value cut to 1 KiB.
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::config::Config;
use crate::ingest::classify::{
    Arrival, ClassifyConfig, PRODUCER_TOPIC_PREFIX, Reason, Verdict, classify,
};
use crate::runtime::clock::SharedClock;
use crate::runtime::kafka::{self, KafkaError};
use crate::runtime::orphans::{self, Covers, GroupWatch, Joining, PosixRegex, Rejoin};
use crate::runtime::served::Served;
use crate::runtime::telemetry::{self, CommitOutcome, IngestCommit, IngestTally, IngestVerdict};

/// Header names the hub adds to inbox records.
pub const H_SOURCE_TOPIC: &str = "x-streaming-hub-source-topic";
pub const H_SOURCE_PARTITION: &str = "x-streaming-hub-source-partition";
pub const H_SOURCE_OFFSET: &str = "x-streaming-hub-source-offset";
pub const H_INGEST_TIME: &str = "x-streaming-hub-ingest-time";
pub const H_REASON: &str = "x-streaming-hub-reason";

/// Largest number of headers a record may carry; a record over it is quarantined without them.
pub const MAX_HEADERS: usize = 256;
/// Largest total size of a record's headers we copy to an output record.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// The largest producer key a quarantined record keeps (a larger one is left out, and
/// `x-lerian-dlq-key-omitted` says so): with the payload (at most `max_payload_bytes`) and the
/// headers (at most `MAX_HEADER_BYTES`) it stays inside the quarantine topic's 2 MiB.
const MAX_QUARANTINE_KEY_BYTES: usize = 16 * 1024;
const TXN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an abort may keep being retried while a partition leader fails over.
const ABORT_PATIENCE: Duration = Duration::from_secs(60);
/// How long a commit that timed out may keep being retried, from its first call (with an abort
/// after it, inside `STREAMING_HUB_STALL_TIMEOUT`'s default of 120 s).
const COMMIT_PATIENCE: Duration = Duration::from_secs(45);
/// A batch with records closes after this long without a new one.
const QUIET_GAP: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error("configuration: {0}")]
    Config(String),
    /// Every batch aborted for `STREAMING_HUB_STALL_TIMEOUT` (`kafka::AbortStreak`).
    #[error("ingest committed nothing for the stall timeout: {0}")]
    Stuck(String),
    /// Another instance with our transactional id took over: this one must stop.
    #[error(
        "fenced: another process has this instance's transactional id or group instance id (a \
         newer incarnation of it, or another instance with the same STREAMING_HUB_INSTANCE_ID), \
         or the broker aborted a transaction open past its 60 s timeout (a broker that slow); the process restarts and its batch is read again: {0}"
    )]
    Fenced(String),
    /// A commit still running after its patience (`kafka::commit_undecided`): no abort may
    /// interrupt it, so the loop stops and the process restarts.
    #[error("a transaction commit did not finish: {0}")]
    Undecided(String),
}

/// Why a batch did not commit: a Kafka error (the transaction is aborted, the batch read again),
/// or a commit still running after its patience (`kafka::commit_undecided`: no abort may
/// interrupt it, the loop stops).
enum Failed {
    Kafka(RdKafkaError),
    Undecided(RdKafkaError),
}

impl From<RdKafkaError> for Failed {
    fn from(e: RdKafkaError) -> Failed {
        Failed::Kafka(e)
    }
}

/// Partitions revoked since the loop last looked (filled by the rebalance callback, which runs
/// inside `poll`, i.e. while a batch fills).
#[derive(Default)]
struct IngestContext {
    revoked: std::sync::Mutex<std::collections::HashSet<(String, i32)>>,
    /// Set when newly assigned partitions could not be started (their committed offsets stayed
    /// unreadable): the loop stops so the process restarts.
    fatal: std::sync::Mutex<Option<RdKafkaError>>,
    /// The membership of the last rebalance callback (see `kafka::member_metadata`).
    membership: kafka::ConfirmedMembership,
    /// With `STREAMING_HUB_REQUIRE_SOURCE_TOPIC`: followed topics the check cannot apply to (not
    /// named `lerian.streaming.<source>`), each warned about once.
    unchecked: Option<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// The process's stop flag: an assignment that waits for stable offsets gives up once set.
    stop: Arc<AtomicBool>,
}

impl IngestContext {
    /// The operator asked for every record's source to be checked against its topic; a followed
    /// topic whose name carries no source is not, and says so once.
    fn warn_unchecked(&self, rebalance: &Rebalance<'_>) {
        let (Some(warned), Rebalance::Assign(tpl)) = (&self.unchecked, rebalance) else {
            return;
        };
        let mut warned = warned.lock().unwrap_or_else(|p| p.into_inner());
        for e in tpl.elements() {
            let topic = e.topic();
            if !topic.starts_with(PRODUCER_TOPIC_PREFIX) && warned.insert(topic.to_string()) {
                tracing::warn!(
                    topic,
                    "STREAMING_HUB_REQUIRE_SOURCE_TOPIC is on, but this followed topic's records \
                     are not checked: its name is not lerian.streaming.<source>"
                );
            }
        }
    }
}

impl ClientContext for IngestContext {
    fn stats_raw(&self, statistics: &[u8]) {
        crate::runtime::telemetry::lag_from_stats("ingest", statistics);
    }

    /// A follow pattern that matches no topic yet is normal (no producer has written one).
    fn error(&self, error: RdKafkaError, reason: &str) {
        kafka::log_client_error(error, reason);
    }
}

impl ConsumerContext for IngestContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let beat = || crate::runtime::liveness::beat(&crate::runtime::liveness::INGEST);
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
                *self.fatal.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            },
        );
    }
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            log_rebalance("revoke", rebalance);
            let mut revoked = self.revoked.lock().unwrap_or_else(|p| p.into_inner());
            for e in tpl.elements() {
                revoked.insert((e.topic().to_string(), e.partition()));
            }
            telemetry::lag_gone(
                "ingest",
                tpl.elements().iter().map(|e| (e.topic(), e.partition())),
            );
        }
    }
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if !matches!(rebalance, Rebalance::Revoke(_)) {
            log_rebalance("assign", rebalance);
            self.warn_unchecked(rebalance);
        }
    }
}

fn log_rebalance(kind: &'static str, rebalance: &Rebalance<'_>) {
    let partitions = match rebalance {
        Rebalance::Assign(tpl) | Rebalance::Revoke(tpl) => tpl
            .elements()
            .iter()
            .map(|e| format!("{}[{}]", e.topic(), e.partition()))
            .collect::<Vec<_>>()
            .join(","),
        Rebalance::Error(e) => format!("error: {e}"),
    };
    telemetry::Rebalance {
        stage: "ingest",
        kind,
        partitions: &partitions,
    }
    .emit();
}

/// Everything the loop needs, resolved once.
pub struct Ingest {
    config: Config,
    classify: ClassifyConfig,
    inbox: String,
    quarantine: String,
    clock: SharedClock,
    /// Counted in `/readyz` until the loop is in its group (see [`Joining`]).
    joining: std::sync::Mutex<Option<Joining>>,
}

impl Ingest {
    pub fn new(config: &Config, clock: SharedClock) -> Result<Ingest, IngestError> {
        let keys = config
            .signature_keys()
            .map_err(|e| IngestError::Config(e.to_string()))?;
        Ok(Ingest {
            classify: ClassifyConfig {
                require_uuidv7: config.require_uuidv7,
                max_payload_bytes: config.max_payload_bytes,
                require_signatures: config.require_signatures,
                keys,
                // At most the dedup TTL (checked with the configuration): it fits.
                signature_max_age_ms: i64::try_from(config.signature_max_age.as_millis())
                    .unwrap_or(i64::MAX),
                require_source_topic: config.require_source_topic,
            },
            inbox: format!("{}.inbox", config.topic_prefix),
            quarantine: format!("{}.quarantine", config.topic_prefix),
            config: config.clone(),
            clock,
            joining: Default::default(),
        })
    }

    /// Counts the loop as not yet in its group (`/readyz`) until it is.
    pub fn with_joining(self, joining: Joining) -> Ingest {
        *self.joining.lock().unwrap_or_else(|p| p.into_inner()) = Some(joining);
        self
    }

    /// Runs until `stop` is set (then commits what it has and returns) or a fatal error.
    pub fn run(&self, stop: Arc<AtomicBool>) -> Result<(), IngestError> {
        // Code this loop calls beats it too (`liveness::beat_current`: waits for delivery
        // reports, a commit's retries).
        crate::runtime::liveness::run_on_this_thread(&crate::runtime::liveness::INGEST);
        let instance = self.config.instance();
        let consumer: BaseConsumer<IngestContext> = kafka::transactional_consumer(
            &self.config,
            &self.config.group_id,
            &format!("ingest-{instance}"),
        )
        .create_with_context(IngestContext {
            unchecked: self.config.require_source_topic.then(Default::default),
            stop: stop.clone(),
            ..IngestContext::default()
        })
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
        let txn_id = format!("{}.ingest.{instance}", self.config.topic_prefix);
        let producer: BaseProducer<kafka::PlacedOnly> =
            kafka::transactional_producer(&self.config, &txn_id)
                .set("message.max.bytes", "4194304")
                .create_with_context(kafka::PlacedOnly::default())
                .map_err(|e| KafkaError::Setup(e.to_string()))?;
        // Its delivery reports are served as they come, by a thread that sleeps meanwhile.
        let producer = Served::new(producer, "ingest-reports")
            .map_err(|e| KafkaError::Setup(format!("serving the producer's reports: {e}")))?;
        if let Err(e) = kafka::init_waiting(&*producer, TXN_TIMEOUT, kafka::INIT_PATIENCE, &stop) {
            if stop.load(Ordering::Relaxed) {
                // Stopped while the coordinator could not take the producer: nothing was begun.
                crate::runtime::liveness::rest(&crate::runtime::liveness::INGEST);
                return Ok(());
            }
            return Err(fatal_or_kafka(e));
        }
        consumer
            .subscribe(&[self.config.follow_pattern.as_str()])
            .map_err(KafkaError::from)?;
        tracing::info!(pattern = %self.config.follow_pattern, group = %self.config.group_id, transactional_id = %txn_id, "ingest started");
        // Matched as librdkafka matches the subscription (checked when the configuration was
        // read; `None` only for a configuration built otherwise, then ingest runs unwatched).
        let watch = PosixRegex::new(&self.config.follow_pattern)
            .map(|re| GroupWatch::shared(&self.config, &self.config.group_id, Covers::Pattern(re)));
        if watch.is_none() {
            tracing::warn!(pattern = %self.config.follow_pattern, "the follow pattern is not a POSIX extended regular expression: partitions held by no member will not be looked for");
        }
        let mut rejoin = Rejoin::default();
        let mut joining = self
            .joining
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let mut window = kafka::BatchWindow::new();
        let mut aborts = kafka::AbortStreak::new(self.config.stall_timeout);

        // Not all of a huge setting up front (it would fail to allocate): the batch grows to it.
        let mut batch: Vec<BorrowedMessage<'_>> =
            Vec::with_capacity(self.config.ingest_batch_max.min(65_536));
        while !stop.load(Ordering::Relaxed) {
            crate::runtime::liveness::beat(&crate::runtime::liveness::INGEST);
            batch.clear();
            if let Some(watch) = &watch {
                rejoin
                    .tick(
                        watch,
                        &consumer,
                        &consumer.context().membership,
                        &self.config.follow_pattern,
                        "ingest",
                    )
                    .map_err(KafkaError::from)?;
            }
            orphans::settle(
                &mut joining,
                watch.as_deref(),
                &consumer,
                &consumer.context().membership,
                "ingest",
            );
            self.fill_batch(
                &consumer,
                &mut batch,
                window.window(self.config.commit_interval_min, self.config.commit_interval),
            )?;
            if batch.is_empty() {
                continue;
            }
            let started = Instant::now();
            match self.commit_batch(&producer, &consumer, &batch) {
                Ok(tally) => {
                    aborts.committed();
                    tally.emit();
                    let took = started.elapsed();
                    window.took(took, self.config.commit_interval);
                    IngestCommit {
                        records: batch.len(),
                        took,
                        outcome: CommitOutcome::Committed,
                    }
                    .emit(None)
                }
                Err(Failed::Undecided(e)) => return Err(IngestError::Undecided(e.to_string())),
                Err(Failed::Kafka(e)) => {
                    let msg = e.to_string();
                    let lasting = kafka::never_clears(e.rdkafka_error_code());
                    if let Some(code) = e.rdkafka_error_code() {
                        if is_fenced(code) {
                            return Err(IngestError::Fenced(msg));
                        }
                    }
                    IngestCommit {
                        records: batch.len(),
                        took: started.elapsed(),
                        outcome: CommitOutcome::Aborted,
                    }
                    .emit(Some(&msg));
                    if let Err(abort) = crate::runtime::kafka::abort_waiting(
                        &*producer,
                        TXN_TIMEOUT,
                        ABORT_PATIENCE,
                    ) {
                        return Err(fatal_or_kafka(abort));
                    }
                    rewind(&consumer, &batch);
                    aborts.pause_after_abort(lasting).map_err(|streak| {
                        IngestError::Stuck(format!("{streak}; the last: {msg}"))
                    })?;
                }
            }
        }
        tracing::info!("ingest stopping");
        drop(batch);
        let beat = || crate::runtime::liveness::beat(&crate::runtime::liveness::INGEST);
        kafka::leave_group(&consumer, kafka::LEAVE_PATIENCE, &beat);
        // Closed while the loop is still watched: a close that never returns ends the process
        // after `STREAMING_HUB_STALL_TIMEOUT` instead of keeping it from exiting.
        drop(consumer);
        crate::runtime::liveness::rest(&crate::runtime::liveness::INGEST);
        Ok(())
    }

    /// Polls until the batch is full, or `window` has passed since its first record (see
    /// [`kafka::BatchWindow`]), or no record came for [`QUIET_GAP`].
    fn fill_batch<'c>(
        &self,
        consumer: &'c BaseConsumer<IngestContext>,
        batch: &mut Vec<BorrowedMessage<'c>>,
        window: Duration,
    ) -> Result<(), IngestError> {
        let mut deadline: Option<Instant> = None;
        // Never take an offset twice in one batch (a fetch restarted at a position we already
        // passed).
        let mut last: HashMap<(String, i32), i64> = HashMap::new();
        while batch.len() < self.config.ingest_batch_max {
            let wait = match deadline {
                None => Duration::from_millis(100),
                // Once a batch is open, a short quiet gap closes it early: light load commits at
                // once (low latency), a steady stream fills it up to its size or interval.
                Some(d) => d.saturating_duration_since(Instant::now()).min(QUIET_GAP),
            };
            if deadline.is_some() && wait.is_zero() {
                break;
            }
            crate::runtime::liveness::beat(&crate::runtime::liveness::INGEST); // idle is alive
            let polled = consumer.poll(wait);
            let fatal = consumer
                .context()
                .fatal
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if let Some(e) = fatal {
                return Err(fatal_or_kafka(e));
            }
            forget_revoked(consumer, batch, &mut last);
            match polled {
                // Idle or a quiet gap: back to the loop (which looks after its group between
                // batches) with what there is.
                None => break,
                Some(Ok(msg)) => {
                    let key = (msg.topic().to_string(), msg.partition());
                    if last.get(&key).is_some_and(|&o| msg.offset() <= o) {
                        continue;
                    }
                    last.insert(key, msg.offset());
                    batch.push(msg);
                    if deadline.is_none() {
                        deadline = Some(Instant::now() + window);
                    }
                }
                Some(Err(rdkafka::error::KafkaError::MessageConsumptionFatal(code)))
                | Some(Err(rdkafka::error::KafkaError::MessageConsumption(
                    code @ RDKafkaErrorCode::PollExceeded,
                ))) => {
                    // The consumer is dead (e.g. another member took this static member id), or
                    // it left the group after a poll gap (see `kafka::transactional_consumer`):
                    // stop, so the process is restarted instead of holding partitions forever.
                    return Err(IngestError::Fenced(format!("fatal consumer error: {code}")));
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "ingest consumer error");
                }
            }
        }
        Ok(())
    }

    /// Routes the batch and commits it with its offsets; answers its verdicts, to be counted
    /// once it has committed.
    fn commit_batch<'b>(
        &self,
        producer: &BaseProducer<kafka::PlacedOnly>,
        consumer: &BaseConsumer<IngestContext>,
        batch: &'b [BorrowedMessage<'_>],
    ) -> Result<IngestTally<'b>, Failed> {
        // Left from an aborted transaction: this one counts its own.
        producer.context().take();
        producer.begin_transaction()?;
        // Checked again where the offsets go; this saves the work of a batch that could not.
        if !kafka::may_commit_now(consumer, &consumer.context().membership) {
            return Err(RdKafkaError::Subscription(kafka::NOT_TOLD.into()).into());
        }
        let mut phase = std::time::Instant::now();
        let mut phase_done = |name: &'static str| {
            telemetry::txn_phase("ingest", name, phase.elapsed());
            phase = std::time::Instant::now();
        };
        let now_ms = self.clock.now_ms();
        let ingest_time = rfc3339_ms(now_ms);
        let mut offsets: HashMap<(&str, i32), i64> = HashMap::new();
        let mut tally = IngestTally::default();
        for msg in batch {
            self.route(producer, msg, (now_ms, &ingest_time), &mut tally)?;
            offsets.insert((msg.topic(), msg.partition()), msg.offset() + 1);
        }
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), next) in offsets {
            tpl.add_partition_offset(topic, partition, Offset::Offset(next))?;
        }
        let metadata = kafka::member_metadata(consumer, &consumer.context().membership)?;
        kafka::push(producer.client());
        phase_done("work");
        // Bounded calls, each starting on a fresh beat (see the hub's transaction).
        crate::runtime::liveness::beat_current();
        producer.send_offsets_to_transaction(&tpl, &metadata, TXN_TIMEOUT)?;
        crate::runtime::liveness::beat_current();
        phase_done("offsets");
        // The producer's own thread (`Served`) serves the delivery reports; committing with none
        // in flight skips rdkafka's flush, which costs 100 ms (see `kafka::wait_delivered`).
        kafka::wait_delivered(|| producer.in_flight_count(), |_| {}, TXN_TIMEOUT)?;
        phase_done("delivered");
        // Reported delivered without an offset: maybe never written (see `kafka::placed`).
        let unplaced = producer.context().take();
        if unplaced > 0 {
            return Err(Failed::Kafka(kafka::unplaced(unplaced)));
        }
        if let Err(e) = kafka::commit_waiting(producer, TXN_TIMEOUT, COMMIT_PATIENCE) {
            if kafka::commit_undecided(&e) {
                // The process stops and librdkafka most likely completes the commit; if it
                // does, the next owner reads on after this batch, which is then counted only
                // here.
                tally.emit();
                return Err(Failed::Undecided(e));
            }
            return Err(Failed::Kafka(e));
        }
        phase_done("commit");
        Ok(tally)
    }

    /// Classifies one record and sends its output (if any) into the open transaction; its
    /// verdict goes into `tally`.
    fn route<'b>(
        &self,
        producer: &BaseProducer<kafka::PlacedOnly>,
        msg: &'b BorrowedMessage<'_>,
        (now_ms, ingest_time): (i64, &str),
        tally: &mut IngestTally<'b>,
    ) -> Result<(), RdKafkaError> {
        let read = match msg.headers() {
            Some(h) => read_headers(h.count(), |idx| kafka::raw_header(h, idx)),
            None => read_headers(0, |_| None),
        };
        let ReadHeaders {
            headers,
            count,
            bytes: header_bytes,
            bad_name,
        } = read;
        let oversized_headers = count > MAX_HEADERS || header_bytes > MAX_HEADER_BYTES;
        let value = msg.payload();
        let verdict = if crate::ingest::classify::is_producers_own_topic(msg.topic()) {
            // A producer's dead-letter or command topic, whatever its records carry: dropped
            // before any check of their headers (a dead letter adds eleven to its event's, and
            // was quarantined as `headers_too_large`, a forensic record filed as the hub's own).
            Verdict::Drop
        } else if oversized_headers {
            // Its headers are left out of the quarantined copy (they are what does not fit), but
            // for the first of each CloudEvents attribute, cut short; its payload is kept when it
            // is within the limit.
            Verdict::Quarantine(crate::ingest::classify::Quarantined {
                reason: Reason::HeadersTooLarge,
                message: format!(
                    "record headers: {count} headers, {header_bytes} bytes (limits {MAX_HEADERS} headers, {MAX_HEADER_BYTES} bytes; the headers are left out of this record but for the first of each ce-* attribute, cut to {MAX_KEPT_VALUE_BYTES} bytes)"
                ),
            })
        } else if let Some(idx) = bad_name {
            Verdict::Quarantine(crate::ingest::classify::Quarantined {
                reason: Reason::InvalidHeaderEncoding,
                message: format!(
                    "header #{idx}: its name is not UTF-8 (the header is left out of this record)"
                ),
            })
        } else {
            let arrival = Arrival {
                topic: msg.topic(),
                now_ms,
            };
            classify(&headers, value, &self.classify, arrival)
        };
        let ce_id = headers
            .iter()
            .find(|(k, _)| *k == "ce-id")
            .and_then(|(_, v)| v.and_then(|v| std::str::from_utf8(v).ok()))
            .map(clip_id);
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        match verdict {
            Verdict::Accept(accepted) => {
                note(tally, msg, ce_id, "accept", "accepted", "");
                let mut out = OwnedHeaders::new_with_capacity(headers.len() + 4);
                for (k, v) in &headers {
                    // The hub owns the `x-streaming-hub-` namespace on the inbox (source position,
                    // ingest time, redelivery requests): a producer's copies are not carried.
                    if is_hub_header(k) {
                        continue;
                    }
                    out = out.insert(Header { key: k, value: *v });
                }
                out = out
                    .insert(Header {
                        key: H_SOURCE_TOPIC,
                        value: Some(msg.topic()),
                    })
                    .insert(Header {
                        key: H_SOURCE_PARTITION,
                        value: Some(&partition),
                    })
                    .insert(Header {
                        key: H_SOURCE_OFFSET,
                        value: Some(&offset),
                    })
                    .insert(Header {
                        key: H_INGEST_TIME,
                        value: Some(ingest_time),
                    });
                let mut record = BaseRecord::<str, [u8]>::to(&self.inbox)
                    .key(accepted.tenant.as_str())
                    .headers(out);
                if let Some(v) = value {
                    record = record.payload(v);
                }
                send(producer, record)
            }
            Verdict::Drop => {
                // A producer's dead-letter or command topic a wide follow pattern matched: told
                // apart, it is the one sign of that misconfiguration.
                let why = if crate::ingest::classify::is_producers_own_topic(msg.topic()) {
                    "producer_own_topic"
                } else {
                    "system_event"
                };
                note(tally, msg, ce_id, "drop", why, "");
                Ok(())
            }
            Verdict::Quarantine(q) => {
                note(tally, msg, ce_id, "quarantine", q.reason.code(), &q.message);
                // A record quarantined for another reason may be too large as well (the headers
                // are checked first): its payload is left out then too, or the quarantine topic
                // (2 MiB) would refuse it and the transaction would fail again after every retry.
                let omit = q.reason == Reason::PayloadTooLarge
                    || value.map_or(0, <[u8]>::len) > self.classify.max_payload_bytes;
                let copy = QuarantineCopy::of(
                    msg,
                    &headers,
                    oversized_headers,
                    omit,
                    &Why {
                        reason: q.reason.code(),
                        cause_kind: q.reason.cause_kind(),
                        message: &q.message,
                        at: ingest_time,
                        by: &self.config.group_id,
                    },
                );
                send(producer, copy.record(&self.quarantine))
            }
        }
    }
}

/// A record's headers as ingest reads them.
struct ReadHeaders<'h> {
    /// The headers whose name is UTF-8, in order: every one of the first `MAX_HEADERS + 1`, then
    /// only the first of each of [`KEPT_ATTRIBUTES`] (the record is quarantined for its headers,
    /// which keeps no other), so at most `MAX_HEADERS + 14`.
    headers: Vec<(&'h str, Option<&'h [u8]>)>,
    /// How many headers the record has.
    count: usize,
    /// Their names' and values' bytes, all of them.
    bytes: usize,
    /// The position of the first header whose name is not UTF-8: such a header cannot be named or
    /// carried, so the record is quarantined (without it) instead of classified.
    bad_name: Option<usize>,
}

/// Reads a record's `count` headers, `get(idx)` giving the raw name and value of each.
fn read_headers<'h>(
    count: usize,
    get: impl Fn(usize) -> Option<(&'h [u8], Option<&'h [u8]>)>,
) -> ReadHeaders<'h> {
    let mut read = ReadHeaders {
        headers: Vec::with_capacity(count.min(MAX_HEADERS + 1)),
        count,
        bytes: 0,
        bad_name: None,
    };
    // Which of KEPT_ATTRIBUTES came past the limit.
    let mut kept_past = 0u16;
    for idx in 0..count {
        let Some((name, value)) = get(idx) else {
            break;
        };
        read.bytes += name.len() + value.map_or(0, <[u8]>::len);
        // Past the limit the record is quarantined for its headers: it keeps the first of each
        // known `ce-*` attribute only, wherever it comes.
        if idx > MAX_HEADERS {
            let Some(i) = KEPT_ATTRIBUTES.iter().position(|k| k.as_bytes() == name) else {
                continue;
            };
            if kept_past & (1 << i) != 0 {
                continue;
            }
            kept_past |= 1 << i;
        }
        match std::str::from_utf8(name) {
            Ok(name) => read.headers.push((name, value)),
            Err(_) => {
                read.bad_name.get_or_insert(idx);
            }
        }
    }
    read
}

/// The CloudEvents attributes a record quarantined for its headers (over [`MAX_HEADERS`] or
/// [`MAX_HEADER_BYTES`]) still carries, the first of each, so its quarantined copy can be told
/// apart and traced (`GET /admin/quarantine` files it by `ce-source` and `ce-tenantid`, an
/// operator follows it by `ce-id`).
const KEPT_ATTRIBUTES: [&str; 13] = [
    "ce-id",
    "ce-tenantid",
    "ce-type",
    "ce-source",
    "ce-specversion",
    "ce-time",
    "ce-subject",
    "ce-schemaversion",
    "ce-resourcetype",
    "ce-eventtype",
    "ce-datacontenttype",
    "ce-dataschema",
    "ce-systemevent",
];

/// The longest value of a [`KEPT_ATTRIBUTES`] header on such a record: 13 of them stay far inside
/// the quarantine topic's 2 MiB, whatever the headers that did not fit held.
const MAX_KEPT_VALUE_BYTES: usize = 1024;

/// A header as read from a record: its name, its value (`None`: null).
pub type HeaderRef<'h> = (&'h str, Option<&'h [u8]>);

/// Why and by whom a record is quarantined: its forensic headers' values.
pub struct Why<'a> {
    /// `x-streaming-hub-reason`.
    pub reason: &'a str,
    /// `x-lerian-dlq-cause-kind`.
    pub cause_kind: &'a str,
    /// `x-lerian-dlq-error-message`.
    pub message: &'a str,
    /// `x-lerian-dlq-first-failure-at` (RFC 3339).
    pub at: &'a str,
    /// `x-lerian-dlq-producer-id`: the group of the stage that quarantined it.
    pub by: &'a str,
}

/// The quarantined copy of a record: the headers it carries, then the forensic ones; its key
/// unless over [`MAX_QUARANTINE_KEY_BYTES`]; its payload unless omitted.
pub struct QuarantineCopy<'m> {
    headers: OwnedHeaders,
    key: Option<&'m [u8]>,
    payload: Option<&'m [u8]>,
}

impl<'m> QuarantineCopy<'m> {
    /// `headers` are `msg`'s as read; `oversized_headers` keeps only the first of each of
    /// [`KEPT_ATTRIBUTES`] (see [`quarantine_carried`]); `omit_payload` leaves the payload out.
    pub fn of(
        msg: &'m BorrowedMessage<'_>,
        headers: &[(&str, Option<&[u8]>)],
        oversized_headers: bool,
        omit_payload: bool,
        why: &Why<'_>,
    ) -> QuarantineCopy<'m> {
        let value = msg.payload();
        let key = msg.key().filter(|k| k.len() <= MAX_QUARANTINE_KEY_BYTES);
        let key_omitted = msg.key().is_some() && key.is_none();
        let size = value.map_or(0, <[u8]>::len).to_string();
        let (partition, offset) = (msg.partition().to_string(), msg.offset().to_string());
        let carried = quarantine_carried(headers, oversized_headers);
        let mut out = OwnedHeaders::new_with_capacity(carried.len() + 13);
        for (k, v) in carried {
            out = out.insert(Header { key: k, value: v });
        }
        let flag = |b: bool| if b { "true" } else { "false" };
        let forensic: [(&str, &str); 13] = [
            ("x-lerian-dlq-source-topic", msg.topic()),
            ("x-lerian-dlq-source-partition", &partition),
            ("x-lerian-dlq-source-offset", &offset),
            ("x-lerian-dlq-error-class", "validation_error"),
            ("x-lerian-dlq-error-message", why.message),
            ("x-lerian-dlq-cause-kind", why.cause_kind),
            ("x-lerian-dlq-retry-count", "0"),
            ("x-lerian-dlq-first-failure-at", why.at),
            ("x-lerian-dlq-producer-id", why.by),
            ("x-lerian-dlq-payload-omitted", flag(omit_payload)),
            ("x-lerian-dlq-payload-bytes", &size),
            ("x-lerian-dlq-key-omitted", flag(key_omitted)),
            (H_REASON, why.reason),
        ];
        for (k, v) in forensic {
            out = out.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        QuarantineCopy {
            headers: out,
            key,
            payload: value.filter(|_| !omit_payload),
        }
    }

    /// The record to send to `topic` (the quarantine).
    pub fn record<'t>(self, topic: &'t str) -> BaseRecord<'t, [u8], [u8]>
    where
        'm: 't,
    {
        let mut record = BaseRecord::<[u8], [u8]>::to(topic).headers(self.headers);
        if let Some(k) = self.key {
            record = record.key(k);
        }
        if let Some(v) = self.payload {
            record = record.payload(v);
        }
        record
    }
}

/// A record's headers as ingest reads them and whether they are over the bounds a copy carries
/// whole ([`MAX_HEADERS`], [`MAX_HEADER_BYTES`]); a header whose name is not UTF-8 is left out.
pub fn headers_of<'h>(msg: &'h BorrowedMessage<'_>) -> (Vec<HeaderRef<'h>>, bool) {
    let read = match msg.headers() {
        Some(h) => read_headers(h.count(), |idx| kafka::raw_header(h, idx)),
        None => read_headers(0, |_| None),
    };
    let oversized = read.count > MAX_HEADERS || read.bytes > MAX_HEADER_BYTES;
    (read.headers, oversized)
}

/// The producer's headers a quarantined record carries, in their order, before the forensic
/// headers the hub writes. Most records carry them all but the forensic ones: a producer's own
/// (`x-streaming-hub-reason`, or a re-driven record's old `x-lerian-dlq-*`) would come first and
/// be read in place of this quarantine's. A record quarantined for its headers (`oversized`)
/// carries only the first of each of [`KEPT_ATTRIBUTES`], its value cut to
/// [`MAX_KEPT_VALUE_BYTES`] (on a character boundary when it is UTF-8); a null one stays null.
fn quarantine_carried<'h>(
    headers: &[(&'h str, Option<&'h [u8]>)],
    oversized: bool,
) -> Vec<(&'h str, Option<&'h [u8]>)> {
    if !oversized {
        return headers
            .iter()
            .filter(|(k, _)| !is_forensic_header(k))
            .copied()
            .collect();
    }
    let mut kept: Vec<(&str, Option<&[u8]>)> = Vec::with_capacity(KEPT_ATTRIBUTES.len());
    for &(k, v) in headers {
        if KEPT_ATTRIBUTES.contains(&k) && !kept.iter().any(|(seen, _)| *seen == k) {
            kept.push((k, v.map(clip_value)));
            if kept.len() == KEPT_ATTRIBUTES.len() {
                break;
            }
        }
    }
    kept
}

/// `v` cut to at most [`MAX_KEPT_VALUE_BYTES`], not inside a UTF-8 character (backing off over at
/// most 3 continuation bytes, so bytes that are not UTF-8 are cut near the limit too).
fn clip_value(v: &[u8]) -> &[u8] {
    if v.len() <= MAX_KEPT_VALUE_BYTES {
        return v;
    }
    let mut end = MAX_KEPT_VALUE_BYTES;
    while end > MAX_KEPT_VALUE_BYTES - 3 && v[end] & 0xC0 == 0x80 {
        end -= 1;
    }
    &v[..end]
}

/// A `ce-id` as logged and counted: an accepted one is at most 256 bytes, a quarantined one may be
/// up to the 64 KiB of headers, and one log line per quarantined record must stay a line.
/// Notes a record's verdict in its batch's tally.
fn note<'b>(
    tally: &mut IngestTally<'b>,
    msg: &'b BorrowedMessage<'_>,
    ce_id: Option<&str>,
    verdict: &'static str,
    reason: &'static str,
    message: &str,
) {
    let v = IngestVerdict {
        topic: msg.topic(),
        partition: msg.partition(),
        offset: msg.offset(),
        ce_id,
        verdict,
        reason,
        message,
    };
    tally.note(msg.topic(), &v);
}

fn clip_id(id: &str) -> &str {
    let mut end = id.len().min(256);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    &id[..end]
}

/// Sends into the open transaction, waiting while the local queue is full.
fn send<K: rdkafka::message::ToBytes + ?Sized, P: rdkafka::message::ToBytes + ?Sized>(
    producer: &BaseProducer<kafka::PlacedOnly>,
    mut record: BaseRecord<'_, K, P>,
) -> Result<(), RdKafkaError> {
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((RdKafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                record = r;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err((e, _)) => return Err(e),
        }
    }
}

/// Forgets the records of partitions revoked during the last poll (the rebalance callback runs
/// inside it). Their next owner reads them from the committed offset, and a transaction of ours
/// with them (and their offsets, which the group accepts from any member of the current
/// generation) would write them to the inbox a second time. A partition that comes back starts
/// again from its committed offset, which may be past these records if another member had it in
/// between: so they are not sought back to, and the partition's high mark is cleared.
fn forget_revoked(
    consumer: &BaseConsumer<IngestContext>,
    batch: &mut Vec<BorrowedMessage<'_>>,
    last: &mut HashMap<(String, i32), i64>,
) {
    let revoked = std::mem::take(
        &mut *consumer
            .context()
            .revoked
            .lock()
            .unwrap_or_else(|p| p.into_inner()),
    );
    if revoked.is_empty() {
        return;
    }
    batch.retain(|m| !revoked.contains(&(m.topic().to_string(), m.partition())));
    for key in &revoked {
        last.remove(key);
    }
}

/// After an abort, moves each partition of the batch back to the batch's first offset so the
/// same records are read again. A partition we no longer own is skipped: its new owner starts
/// from the last committed offset anyway.
fn rewind(consumer: &BaseConsumer<IngestContext>, batch: &[BorrowedMessage<'_>]) {
    let mut first: HashMap<(&str, i32), i64> = HashMap::new();
    for m in batch {
        first
            .entry((m.topic(), m.partition()))
            .or_insert(m.offset());
    }
    for ((topic, partition), offset) in first {
        if let Err(e) = consumer.seek(
            topic,
            partition,
            Offset::Offset(offset),
            Duration::from_secs(5),
        ) {
            tracing::debug!(topic, partition, error = %e, "rewind skipped");
        }
    }
}

fn is_fenced(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
    )
}

fn fatal_or_kafka(e: RdKafkaError) -> IngestError {
    match e.rdkafka_error_code() {
        Some(code) if is_fenced(code) => IngestError::Fenced(e.to_string()),
        _ => IngestError::Kafka(KafkaError::from(e)),
    }
}

/// A header in the namespace the hub writes on the inbox (`x-streaming-hub-*`, any case).
pub fn is_hub_header(key: &str) -> bool {
    key.len() >= HUB_HEADER_PREFIX.len()
        && key.as_bytes()[..HUB_HEADER_PREFIX.len()]
            .eq_ignore_ascii_case(HUB_HEADER_PREFIX.as_bytes())
}

const HUB_HEADER_PREFIX: &str = "x-streaming-hub-";

/// A header the quarantine writes itself: the hub's namespace and the producers' forensic set.
fn is_forensic_header(key: &str) -> bool {
    const DLQ: &str = "x-lerian-dlq-";
    is_hub_header(key)
        || key
            .get(..DLQ.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(DLQ))
}

pub fn rfc3339_ms(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    type RawHeaders = Vec<(Vec<u8>, Option<Vec<u8>>)>;

    fn raw(pairs: &[(&str, Option<&[u8]>)]) -> RawHeaders {
        pairs
            .iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.map(<[u8]>::to_vec)))
            .collect()
    }

    fn read(raw: &RawHeaders) -> ReadHeaders<'_> {
        read_headers(raw.len(), |i| {
            raw.get(i).map(|(n, v)| (n.as_slice(), v.as_deref()))
        })
    }

    const ID: &[u8] = b"0190a8e2-0000-7000-8000-000000000001";

    #[test]
    fn a_record_with_too_many_headers_keeps_the_first_of_each_ce_attribute_cut_to_1_kib() {
        // "é" takes bytes 1023 and 1024: the cut at 1024 would split it.
        let subject = format!("{}é-and-more", "s".repeat(MAX_KEPT_VALUE_BYTES - 1));
        let mut headers = raw(&[
            ("ce-specversion", Some(b"1.0")),
            ("ce-id", Some(ID)),
            (
                "traceparent",
                Some(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            ),
            ("ce-tenantid", Some(b"tenant-1")),
            ("ce-subject", Some(subject.as_bytes())),
            ("ce-id", Some(b"a second id")),
            ("ce-systemevent", None),
            ("ce-priority", Some(b"high")),
            ("CE-SOURCE", Some(b"not-this-one")),
            ("x-streaming-hub-reason", Some(b"spoofed")),
        ]);
        for i in 0..MAX_HEADERS {
            headers.push((format!("x-filler-{i}").into_bytes(), Some(b"v".to_vec())));
        }
        // Past the first MAX_HEADERS + 1 headers: found all the same.
        headers.extend(raw(&[
            ("ce-source", Some(b"ledger")),
            ("x-more", Some(b"v")),
            ("ce-tenantid", Some(b"another-tenant")),
            ("ce-type", Some(b"studio.lerian.ledger.account.created")),
            ("ce-priority", Some(b"high")),
        ]));
        for _ in 0..1000 {
            headers.extend(raw(&[("ce-source", Some(b"again"))]));
        }
        let read = read(&headers);
        assert_eq!(read.count, headers.len());
        // Past the limit only the first of each attribute was taken.
        assert_eq!(read.headers.len(), MAX_HEADERS + 1 + 3);
        assert!(read.count > MAX_HEADERS && read.bad_name.is_none());
        let kept = quarantine_carried(&read.headers, true);
        let cut = &subject.as_bytes()[..MAX_KEPT_VALUE_BYTES - 1];
        assert!(std::str::from_utf8(cut).is_ok());
        assert_eq!(
            kept,
            vec![
                ("ce-specversion", Some(b"1.0".as_slice())),
                ("ce-id", Some(ID)),
                ("ce-tenantid", Some(b"tenant-1".as_slice())),
                ("ce-subject", Some(cut)),
                ("ce-systemevent", None),
                ("ce-source", Some(b"ledger".as_slice())),
                (
                    "ce-type",
                    Some(b"studio.lerian.ledger.account.created".as_slice())
                ),
            ]
        );
    }

    #[test]
    fn a_record_with_too_many_header_bytes_keeps_its_ce_attributes_only() {
        let big = vec![b'x'; MAX_HEADER_BYTES];
        let headers = raw(&[
            ("x-big", Some(&big)),
            ("ce-id", Some(ID)),
            ("ce-dataschema", Some(&big)),
            ("x-lerian-dlq-error-class", Some(b"old")),
        ]);
        let read = read(&headers);
        assert!(read.count <= MAX_HEADERS && read.bytes > MAX_HEADER_BYTES);
        assert_eq!(
            quarantine_carried(&read.headers, true),
            vec![
                ("ce-id", Some(ID)),
                ("ce-dataschema", Some(&big[..MAX_KEPT_VALUE_BYTES])),
            ]
        );
    }

    #[test]
    fn other_quarantined_records_carry_every_header_but_the_forensic_ones() {
        let headers = raw(&[
            ("ce-id", Some(ID)),
            ("X-Streaming-Hub-Reason", Some(b"spoofed")),
            ("traceparent", None),
            ("x-lerian-dlq-error-class", Some(b"old")),
            ("ce-id", Some(b"again")),
        ]);
        let read = read(&headers);
        assert_eq!(
            quarantine_carried(&read.headers, false),
            vec![
                ("ce-id", Some(ID)),
                ("traceparent", None),
                ("ce-id", Some(b"again".as_slice())),
            ]
        );
    }

    #[test]
    fn a_kept_value_is_cut_near_1_kib_whatever_its_bytes() {
        let exact = vec![b'a'; MAX_KEPT_VALUE_BYTES];
        assert_eq!(clip_value(&exact), exact.as_slice());
        let three = "€".repeat(400); // 1,200 bytes, a character every 3
        let cut = clip_value(three.as_bytes());
        assert_eq!(cut.len(), 1023);
        assert!(std::str::from_utf8(cut).is_ok());
        let not_utf8 = vec![0x80; 5000];
        assert_eq!(clip_value(&not_utf8).len(), MAX_KEPT_VALUE_BYTES - 3);
    }

    #[test]
    fn a_long_ce_id_is_clipped_at_a_character_boundary() {
        let short = "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1e";
        assert_eq!(clip_id(short), short);
        let long = format!("a{}", "é".repeat(30_000));
        assert_eq!(clip_id(&long).len(), 255);
        assert!(long.starts_with(clip_id(&long)));
    }
}
