//! The control topic `<prefix>.subscriptions` (compacted; key = subscription id, value = Avro
//! subscription record, tombstone = deleted) and the two things done with it:
//!
//! - [`follow`]: every instance reads it whole at start-up into its [`SharedTable`] (the table is
//!   "caught up" only then) and keeps following it live. A record that does not decode is logged
//!   and skipped; it never stops the reader.
//! - [`Subscriptions`]: the API's and CLI's handle. A write produces to the topic and returns once
//!   this instance's table shows it (read-your-writes). Any other producer may write the topic too.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::Message;
use rdkafka::producer::BaseProducer;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::runtime::avro::{Codec, CodecError, RecordKind};
use crate::runtime::kafka::{self, KafkaError};
use crate::runtime::records::SubscriptionRecord;
use crate::runtime::served::{self, Awaited, Served};
use crate::subscriptions::rounds::Rounds;
use crate::subscriptions::table::{SharedTable, Sub, Table};

/// How long a write waits to see itself in the table before it reports a timeout.
const READ_YOUR_WRITES: Duration = Duration::from_secs(15);

/// How long a write waits for room in the producer's queue.
const QUEUE_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum RepoError {
    #[error("writing the control topic failed: {0}")]
    Write(String),
    #[error("the write was not seen back within {0:?}")]
    NotSeen(Duration),
    /// A deletion the reader went past while a record written after it (another writer's)
    /// brought the subscription back: it is not deleted.
    #[error("the subscription was written again after its deletion, by another writer")]
    WrittenAgain,
    #[error("encoding: {0}")]
    Codec(String),
}

/// Why [`Subscriptions::sync`] did not end with the table at the control topic's end.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The control topic's ends could not be asked (the broker unreachable).
    #[error("the control topic's end could not be read: {0}")]
    Unavailable(String),
    /// No lookup of the ends answered within the wait (the broker slow to).
    #[error("the control topic's end was not told within the wait")]
    Busy,
    /// This instance's reader had not got there within the wait.
    #[error(
        "this instance's subscription table did not reach the control topic's end within {0:?}"
    )]
    Behind(Duration),
}

impl RepoError {
    pub fn is_retryable(&self) -> bool {
        !matches!(self, RepoError::Codec(_) | RepoError::WrittenAgain)
    }
}

pub fn topic(config: &Config) -> String {
    format!("{}.subscriptions", config.topic_prefix)
}

/// Reads the control topic into `table` until `stop`; blocking (run it on its own thread).
pub fn follow(
    config: &Config,
    codec: Arc<Codec>,
    table: SharedTable,
    stop: Arc<AtomicBool>,
) -> Result<(), KafkaError> {
    let topic = topic(config);
    let consumer: BaseConsumer<kafka::ReaderContext> = kafka::base(config)
        .set("group.id", format!("{}.control", config.group_id))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        // The end of a partition as the consumer sees it (its last stable offset, past the
        // markers of committed and aborted transactions): the only signal of "caught up".
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "50")
        .create_with_context(kafka::ReaderContext)
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
    // The topic may have been created a moment ago: wait until its partitions and ends are known.
    let (tpl, ends) = loop {
        match start_positions(&consumer, &topic) {
            Ok(found) => break found,
            Err(e) => {
                tracing::warn!(topic = %topic, error = %e, "control topic not readable yet; retrying");
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    };
    consumer.assign(&tpl)?;
    // Partitions not yet read to their end. The table is caught up once every one has reported
    // its end (a fetch reached the last stable offset) at or past the end asked for at start:
    // never on a quiet spell, which a slow broker or a leader election also produces, and not
    // on the end a newly elected leader reports before its high watermark has caught up.
    let mut reading: BTreeMap<i32, Ends> = ends.into_iter().collect();
    let lag = config.dangerous_test_control_lag;
    while !stop.load(Ordering::Relaxed) {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                if !lag.is_zero() && table.is_caught_up() {
                    std::thread::sleep(lag);
                }
                // Noted after the record's change (below): a write waiting to be read back is
                // seen from either (`Subscriptions::put`).
                let _noted = Noted(&table, m.partition(), m.offset());
                let Some(id) = m.key().and_then(|k| std::str::from_utf8(k).ok()) else {
                    metrics::counter!(CONTROL_SKIPPED, "reason" => "invalid_key").increment(1);
                    tracing::warn!(
                        offset = m.offset(),
                        "control record without a valid key skipped"
                    );
                    continue;
                };
                match m.payload() {
                    None => {
                        table.apply(|t| t.read_record(id, None, m.partition(), m.offset()));
                        tracing::info!(subscription_id = id, "subscription deleted");
                    }
                    Some(bytes) if bytes.len() > MAX_RECORD_BYTES => {
                        tracing::warn!(
                            subscription_id = id,
                            offset = m.offset(),
                            bytes = bytes.len(),
                            max = MAX_RECORD_BYTES,
                            "control record larger than a subscription can be skipped: its deliveries are held"
                        );
                        unreadable(&table, "too_large", id, &m);
                    }
                    Some(bytes) => {
                        match codec.decode::<SubscriptionRecord>(RecordKind::Subscription, bytes) {
                            // A version with no successor (the next write would not encode as
                            // an Avro long) would freeze the subscription: no PATCH could pass.
                            // The id ends the hub's job keys after a NUL separator (see
                            // `dispatch::jobs::job_key`): one with a NUL would break the payload
                            // key taken from them, and no writer of ours makes one (the API's
                            // and `subscriptions apply`'s ids are UUIDs).
                            Ok(rec) if rec.id == id && rec.id.chars().any(char::is_control) => {
                                tracing::warn!(
                                    subscription_id = id.escape_debug().to_string(),
                                    offset = m.offset(),
                                    "control record whose id has a control character skipped"
                                );
                                unreadable(&table, "control_character", id, &m);
                            }
                            Ok(rec) if rec.id == id && rec.version >= i64::MAX as u64 => {
                                tracing::warn!(
                                    subscription_id = id,
                                    offset = m.offset(),
                                    "control record whose version has no successor skipped"
                                );
                                unreadable(&table, "no_successor_version", id, &m);
                            }
                            Ok(rec) if rec.id == id => {
                                tracing::debug!(
                                    subscription_id = id,
                                    version = rec.version,
                                    "subscription updated"
                                );
                                table.apply(|t| {
                                    t.read_record(id, Some(rec), m.partition(), m.offset())
                                });
                            }
                            Ok(_) => {
                                tracing::warn!(
                                    subscription_id = id,
                                    offset = m.offset(),
                                    "control record whose key and id differ skipped"
                                );
                                unreadable(&table, "key_not_id", id, &m);
                            }
                            Err(e @ CodecError::UnknownFingerprint(_)) => {
                                tracing::error!(subscription_id = id, offset = m.offset(), error = %e, "control record of a schema this version does not know skipped (written by a newer version of the hub? run that version): its deliveries are held");
                                unreadable(&table, "unknown_schema", id, &m);
                            }
                            Err(e) => {
                                tracing::warn!(subscription_id = id, offset = m.offset(), error = %e, "undecodable control record skipped");
                                unreadable(&table, "undecodable", id, &m);
                            }
                        }
                    }
                }
            }
            Some(Err(RdKafkaError::PartitionEOF(p)))
                if {
                    note_end(&consumer, &topic, &table, p);
                    reading
                        .get(&p)
                        .is_some_and(|e| read_through(&consumer, &topic, p, e))
                } =>
            {
                reading.remove(&p);
                if reading.is_empty() {
                    table.set_caught_up();
                    tracing::info!(
                        subscriptions = table.read().len(),
                        "subscription table caught up"
                    );
                }
            }
            Some(Err(RdKafkaError::PartitionEOF(_))) => {}
            Some(Err(e)) => tracing::warn!(error = %e, "control topic read error"),
            None => {}
        }
    }
    Ok(())
}

/// A control record for `id` that could not be read: the latest word on the subscription, so its
/// deliveries are held until a readable record for it (the version before it, if the table has
/// one, is still matched; see `Table::read_unreadable`).
fn unreadable(
    table: &SharedTable,
    reason: &'static str,
    id: &str,
    m: &rdkafka::message::BorrowedMessage<'_>,
) {
    metrics::counter!(CONTROL_SKIPPED, "reason" => reason).increment(1);
    table.apply(|t| t.read_unreadable(id, m.partition(), m.offset()));
}

pub const CONTROL_SKIPPED: &str = "streaming_hub_control_records_skipped_total";

/// The largest control record the reader takes, 256 KiB; a larger one is skipped (`too_large`)
/// as an unreadable one is. The API's bounds keep a subscription's record under a fifth of it.
/// Only a write past the API makes one, and the hub rewrites the records it reads (an
/// auto-disable adds its reason and times): one close to the control topic's 1 MiB would be
/// refused at every try, aborting its hub loop's transaction each time, which stalled that inbox
/// partition for every tenant on it.
pub const MAX_RECORD_BYTES: usize = 256 * 1024;

/// Notes a control record as read when dropped: after its change, on every path out of its
/// handling.
struct Noted<'a>(&'a SharedTable, i32, i64);

impl Drop for Noted<'_> {
    fn drop(&mut self) {
        let Noted(table, partition, offset) = *self;
        table.apply(|t| t.note_read(partition, offset));
    }
}

/// The reader reached the end of partition `p`: everything before its position, transaction
/// markers included (which no record notes), is applied, so a [`Subscriptions::sync`] asking
/// for that end is answered.
fn note_end(
    consumer: &BaseConsumer<kafka::ReaderContext>,
    topic: &str,
    table: &SharedTable,
    p: i32,
) {
    if let Some(Offset::Offset(o)) = consumer
        .position()
        .ok()
        .and_then(|pos| pos.find_partition(topic, p).map(|x| x.offset()))
    {
        if o > 0 {
            table.apply(|t| t.note_read(p, o - 1));
        }
    }
}

/// Whether partition `p` has been read up to its end asked for at start-up.
fn read_through(
    consumer: &BaseConsumer<kafka::ReaderContext>,
    topic: &str,
    p: i32,
    e: &Ends,
) -> bool {
    e.high <= e.low
        || matches!(
            consumer
                .position()
                .ok()
                .and_then(|pos| pos.find_partition(topic, p).map(|x| x.offset())),
            Some(Offset::Offset(o)) if o >= e.high
        )
}

/// A control partition's offsets at start-up, as a `read_committed` client is told them (the
/// end is the last stable offset; asked by ListOffsets, which a leader answers only once its
/// high watermark is current).
struct Ends {
    low: i64,
    high: i64,
}

/// Every partition of the control topic, from the beginning, and its ends.
fn start_positions(
    consumer: &BaseConsumer<kafka::ReaderContext>,
    topic: &str,
) -> Result<(TopicPartitionList, Vec<(i32, Ends)>), KafkaError> {
    let parts =
        kafka::partition_ids(consumer, topic, Duration::from_secs(10)).map_err(|e| match e {
            kafka::PartitionsError::Call(e) => KafkaError::Call(e),
            e => KafkaError::Setup(e.to_string()),
        })?;
    let mut tpl = TopicPartitionList::new();
    let mut ends = Vec::new();
    for p in parts {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?;
        ends.push((p, Ends { low, high }));
    }
    Ok((tpl, ends))
}

/// The subscriptions as the API and CLI see them.
#[derive(Clone)]
pub struct Subscriptions {
    table: SharedTable,
    codec: Arc<Codec>,
    writer: Writer,
}

#[derive(Clone)]
enum Writer {
    /// Writes go straight to the table (router tests; no broker).
    Memory,
    /// Writes are taken but never reach the table (router tests of a control reader that lags).
    #[cfg(test)]
    Lagging,
    /// A write plays out as the script says (what the reader then applies to the table) and
    /// lands where it returns; the writer looks once, without waiting.
    #[cfg(test)]
    Scripted(Arc<Script>),
    /// While the flag is set, every write fails as a send whose outcome is unknown does (a
    /// timeout after the send); otherwise writes go as [`Writer::Memory`]'s.
    #[cfg(test)]
    Failing(Arc<std::sync::atomic::AtomicBool>),
    /// While the flag is set, every write lands (as [`Writer::Memory`]'s) and is then reported
    /// failed, as a send that timed out after the broker had taken it; otherwise as Memory's.
    #[cfg(test)]
    LandedButFailed(Arc<std::sync::atomic::AtomicBool>),
    /// Each write waits for the gate to open once, then goes as [`Writer::Memory`]'s (a broker
    /// slow to take it).
    #[cfg(test)]
    Gated(Arc<tokio::sync::Notify>),
    Kafka {
        producer: Arc<Served<Awaited>>,
        topic: String,
        /// Asks the control partitions' ends ([`Subscriptions::sync`]), in rounds that every
        /// read waiting meanwhile shares.
        ends: Arc<ControlEnds>,
        rounds: Arc<Rounds>,
    },
}

/// Where the control partitions end now, for [`Subscriptions::sync`].
pub struct ControlEnds {
    /// `read_committed`, so an end is the last stable offset, as the reader sees it.
    consumer: BaseConsumer<kafka::ReaderContext>,
    /// The control topic's partitions, once known: the ones the reader assigned itself at start
    /// (it follows no partition added later, so neither does this).
    partitions: std::sync::Mutex<Option<Vec<i32>>>,
    /// When a lookup last failed: for [`FAILED_FOR`] after, a read answers from the table at
    /// once instead of waiting out its own lookup (a broker down made every read take 5 s).
    failed_at: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How long a write reported failed waits for the table to reach the control topic's end, to
/// see whether it landed ([`Subscriptions::landed_or`]).
const LANDED_CHECK_WAIT: Duration = Duration::from_secs(5);

/// How long one lookup of the control topic's end may take ([`Rounds`]).
const LOOKUP_WAIT: Duration = Duration::from_secs(5);
/// How long a failed lookup of the ends is taken as the answer for the next ones.
const FAILED_FOR: Duration = Duration::from_secs(1);

impl ControlEnds {
    fn failed_recently(&self) -> bool {
        self.failed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| at.elapsed() < FAILED_FOR)
    }

    fn note_failure(&self) {
        *self.failed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
    }

    /// The last offset of each non-empty control partition; blocking, until `deadline` at most.
    fn wanted(&self, topic: &str, deadline: std::time::Instant) -> Result<Vec<(i32, i64)>, String> {
        let remaining = || deadline.saturating_duration_since(std::time::Instant::now());
        // Nothing is assigned: this only serves the client's events, which pile up otherwise.
        while self.consumer.poll(Duration::ZERO).is_some() {}
        let known = self
            .partitions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let parts = match known {
            Some(parts) => parts,
            None => {
                let parts = kafka::partition_ids(&self.consumer, topic, remaining())
                    .map_err(|e| e.to_string())?;
                *self.partitions.lock().unwrap_or_else(|p| p.into_inner()) = Some(parts.clone());
                parts
            }
        };
        let mut wanted = Vec::with_capacity(parts.len());
        for p in parts {
            let (low, high) = self
                .consumer
                .fetch_watermarks(topic, p, remaining())
                .map_err(|e| e.to_string())?;
            if high > low {
                wanted.push((p, high - 1));
            }
        }
        Ok(wanted)
    }
}

/// A scripted write: what the reader applies, and where the write landed.
#[cfg(test)]
/// A scripted write: the table, the id, the record (`None`: a deletion); where it landed.
type Script =
    dyn Fn(&SharedTable, &str, Option<&SubscriptionRecord>) -> Option<(i32, i64)> + Send + Sync;

impl Subscriptions {
    pub fn kafka(
        config: &Config,
        codec: Arc<Codec>,
        table: SharedTable,
    ) -> Result<Subscriptions, KafkaError> {
        let producer: BaseProducer<Awaited> = kafka::base(config)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "0")
            // A write the broker has not taken within this fails (librdkafka's default is 300
            // s): the writer holds this instance's write lock meanwhile, and every other
            // tenant's PATCH, DELETE and rotation waits behind it.
            .set(
                "message.timeout.ms",
                CONTROL_SEND_TIMEOUT.as_millis().to_string(),
            )
            .create_with_context(Awaited)
            .map_err(|e| KafkaError::Setup(e.to_string()))?;
        // Each write's delivery report goes to the request awaiting it, served by a thread that
        // sleeps meanwhile.
        let producer = Served::new(producer, "control-writes")
            .map(Arc::new)
            .map_err(|e| KafkaError::Setup(format!("serving the producer's reports: {e}")))?;
        let consumer: BaseConsumer<kafka::ReaderContext> = kafka::base(config)
            .set("group.id", format!("{}.control", config.group_id))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create_with_context(kafka::ReaderContext)
            .map_err(|e| KafkaError::Setup(e.to_string()))?;
        let ends = ControlEnds {
            consumer,
            partitions: std::sync::Mutex::new(None),
            failed_at: std::sync::Mutex::new(None),
        };
        let (ends, topic) = (Arc::new(ends), topic(config));
        let rounds = Rounds::new({
            let (ends, topic) = (ends.clone(), topic.clone());
            Arc::new(move || {
                ends.wanted(&topic, std::time::Instant::now() + LOOKUP_WAIT)
                    .inspect_err(|_| ends.note_failure())
            })
        });
        Ok(Subscriptions {
            table,
            codec,
            writer: Writer::Kafka {
                producer,
                topic,
                ends,
                rounds,
            },
        })
    }

    /// Waits, at most `timeout`, until this instance's table has read the control topic up to
    /// where it ends now (its last stable offset): every write acknowledged before the call and
    /// not behind a transaction still open is in the table then (the API's own writes all are:
    /// each is read back before it is answered). An instance answering from its own table alone
    /// answered `404` for a subscription another instance had just created (one client's create,
    /// then read, through a load balancer), and a PATCH made from its older version undid a
    /// newer write, a rotated secret or a URL change, without a word.
    pub async fn sync(&self, timeout: Duration) -> Result<(), SyncError> {
        let Writer::Kafka { ends, rounds, .. } = &self.writer else {
            return Ok(()); // tests' writers: the table is all there is
        };
        let deadline = tokio::time::Instant::now() + timeout;
        if ends.failed_recently() {
            return Err(SyncError::Unavailable(
                "the control topic's end could not be read a moment ago".into(),
            ));
        }
        // One lookup at a time, on a blocking thread (the pool deliveries' name lookups share),
        // its answer taken by every read that came before it started: one tenant reading in a
        // loop neither takes the lookups from the others nor costs the broker a request per read.
        let wanted = tokio::time::timeout_at(deadline, rounds.next())
            .await
            .map_err(|_| SyncError::Busy)?
            .map_err(SyncError::Unavailable)?;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let read = self
            .table
            .wait_for(left, |t| wanted.iter().all(|&(p, o)| t.has_read(p, o)))
            .await;
        if read {
            Ok(())
        } else {
            Err(SyncError::Behind(timeout))
        }
    }

    /// Lookups of the control topic's end this instance has made ([`Subscriptions::sync`]); 0 for
    /// the tests' writers.
    pub fn end_lookups(&self) -> u64 {
        match &self.writer {
            Writer::Kafka { rounds, .. } => rounds.made(),
            _ => 0,
        }
    }

    /// A table without a broker behind it: for the API's router tests.
    pub fn in_memory(codec: Arc<Codec>) -> Subscriptions {
        let table = SharedTable::default();
        table.set_caught_up();
        Subscriptions {
            table,
            codec,
            writer: Writer::Memory,
        }
    }

    /// [`Subscriptions::in_memory`] whose writes are never seen back in time (a lagging control
    /// reader): each is put in the table as a write the broker took but the reader has not shown.
    #[cfg(test)]
    pub fn lagging(codec: Arc<Codec>) -> Subscriptions {
        Subscriptions {
            writer: Writer::Lagging,
            ..Subscriptions::in_memory(codec)
        }
    }

    /// [`Subscriptions::in_memory`] whose writes fail as a send that timed out does, while
    /// `failing` is set.
    #[cfg(test)]
    pub fn failing(
        codec: Arc<Codec>,
        failing: Arc<std::sync::atomic::AtomicBool>,
    ) -> Subscriptions {
        Subscriptions {
            writer: Writer::Failing(failing),
            ..Subscriptions::in_memory(codec)
        }
    }

    /// [`Subscriptions::in_memory`] whose writes land and are reported failed while `failing`
    /// is set (a send that timed out after the broker took it).
    #[cfg(test)]
    pub fn landed_but_failed(
        codec: Arc<Codec>,
        failing: Arc<std::sync::atomic::AtomicBool>,
    ) -> Subscriptions {
        Subscriptions {
            writer: Writer::LandedButFailed(failing),
            ..Subscriptions::in_memory(codec)
        }
    }

    /// [`Subscriptions::in_memory`] whose writes each wait for one `gate.notify_one()`.
    #[cfg(test)]
    pub fn gated(codec: Arc<Codec>, gate: Arc<tokio::sync::Notify>) -> Subscriptions {
        Subscriptions {
            writer: Writer::Gated(gate),
            ..Subscriptions::in_memory(codec)
        }
    }

    /// [`Subscriptions::in_memory`] whose writes play out as `script` says: what the control
    /// reader then applies to the table, and where each write landed (see `Writer::Scripted`).
    #[cfg(test)]
    pub fn scripted(
        codec: Arc<Codec>,
        script: impl Fn(&SharedTable, &str, Option<&SubscriptionRecord>) -> Option<(i32, i64)>
        + Send
        + Sync
        + 'static,
    ) -> Subscriptions {
        Subscriptions {
            writer: Writer::Scripted(Arc::new(script)),
            ..Subscriptions::in_memory(codec)
        }
    }

    /// [`Subscriptions::in_memory`] whose table has not read the control topic to its end yet
    /// (an instance starting).
    #[cfg(test)]
    pub fn loading(codec: Arc<Codec>) -> Subscriptions {
        Subscriptions {
            table: SharedTable::default(),
            ..Subscriptions::in_memory(codec)
        }
    }

    pub fn table(&self) -> &SharedTable {
        &self.table
    }

    pub fn get(&self, id: &str) -> Option<Sub> {
        self.table.read().get(id)
    }

    pub fn list(&self, tenant: &str) -> Vec<Sub> {
        self.table.read().list(tenant)
    }

    /// Writes a subscription (create or update) and returns once the table shows this version.
    pub async fn put(&self, rec: SubscriptionRecord) -> Result<(), RepoError> {
        self.put_holding(rec, ()).await
    }

    /// [`Subscriptions::put`] as a task of its own, `hold` (the write lock's guard) kept until
    /// it ends. A caller dropped midway (the HTTP client went away) does not stop it between
    /// the broker taking the record and this instance's table showing it: stopped there, the
    /// table kept the version before, and the next write made here from it (the pending
    /// retrier's, a PATCH's) undid this one on every instance.
    pub async fn put_holding<H: Send + 'static>(
        &self,
        rec: SubscriptionRecord,
        hold: H,
    ) -> Result<(), RepoError> {
        let this = self.clone();
        detached(async move {
            let written = this.put_now(rec).await;
            drop(hold);
            written
        })
        .await
    }

    async fn put_now(&self, rec: SubscriptionRecord) -> Result<(), RepoError> {
        let bytes = self
            .codec
            .encode(RecordKind::Subscription, &rec)
            .map_err(|e| RepoError::Codec(e.to_string()))?;
        if bytes.len() > MAX_RECORD_BYTES {
            // No reader would take it.
            return Err(RepoError::Codec(format!(
                "the record is {} bytes, more than the {MAX_RECORD_BYTES} a control record may be",
                bytes.len()
            )));
        }
        let (id, version) = (rec.id.clone(), rec.version);
        let wait = match &self.writer {
            // Taken, never shown back by a reader: the NotSeen path below, at once.
            #[cfg(test)]
            Writer::Lagging | Writer::Scripted(_) => Duration::ZERO,
            _ => READ_YOUR_WRITES,
        };
        // Where the write landed (control partition, offset), when a broker took it.
        let at: Option<(i32, i64)> = match &self.writer {
            Writer::Memory => {
                self.table.apply(|t| t.upsert(rec.clone()));
                None
            }
            #[cfg(test)]
            Writer::Lagging => None,
            #[cfg(test)]
            Writer::Scripted(script) => script(&self.table, &rec.id, Some(&rec)),
            #[cfg(test)]
            Writer::Failing(failing) => {
                if failing.load(std::sync::atomic::Ordering::SeqCst) {
                    return self.landed_or(&rec, "Message timed out".into()).await;
                }
                self.table.apply(|t| t.upsert(rec.clone()));
                None
            }
            #[cfg(test)]
            Writer::LandedButFailed(failing) => {
                self.table.apply(|t| t.upsert(rec.clone()));
                if failing.load(std::sync::atomic::Ordering::SeqCst) {
                    return self.landed_or(&rec, "Message timed out".into()).await;
                }
                None
            }
            #[cfg(test)]
            Writer::Gated(gate) => {
                gate.notified().await;
                self.table.apply(|t| t.upsert(rec.clone()));
                None
            }
            Writer::Kafka {
                producer, topic, ..
            } => {
                let sent =
                    served::send_awaited(producer, topic, &id, Some(&bytes), QUEUE_WAIT).await;
                match sent {
                    Ok(at) => Some(at),
                    Err(e) => return self.landed_or(&rec, e.to_string()).await,
                }
            }
        };
        // Seen: the table shows this version (or a later one), or the reader has gone past the
        // write, so the table already holds what the records after it made of it (a tombstone
        // right after it, another instance's DELETE, leaves nothing).
        let seen = |t: &Table| {
            t.get(&id).is_some_and(|s| s.version >= version)
                || at.is_some_and(|(p, o)| t.has_read(p, o))
        };
        if self.table.wait_for(wait, seen).await {
            return Ok(());
        }
        // The broker has it: this instance's reads and next writes start from it (the reader's
        // copy, when it comes, replaces it, and a later tombstone removes it). Only while the
        // reader has not got there: once past it, putting it back would undo what came after.
        self.table.apply(|t| {
            if seen(t) {
                return;
            }
            match at {
                Some((p, o)) => t.write_local(&id, Some(rec), p, o),
                None => t.upsert(rec),
            }
        });
        Err(RepoError::NotSeen(wait))
    }

    /// A write the producer reported failed, `error`: it may have landed all the same (a send
    /// that timed out after the broker took it, as in a leader's failover). This instance reads
    /// the control topic to its end, and the write counts as made when the table then holds
    /// this very record: its sealed secrets' random nonces tell it from another writer's of the
    /// same version. A created subscription's or a rotated secret's answer then carries the
    /// secret, which a `503` lost while the record was on the topic and signing with it.
    /// Otherwise it failed, as far as this instance can tell (one overwritten by a later write
    /// meanwhile is not told apart).
    async fn landed_or(&self, rec: &SubscriptionRecord, error: String) -> Result<(), RepoError> {
        let synced = self.sync(LANDED_CHECK_WAIT).await;
        if self.table.read().get(&rec.id).is_some_and(|s| *s == *rec) {
            tracing::warn!(subscription_id = %rec.id, version = rec.version, error = %error, "a control write reported failed is on the control topic: taken as written");
            return Ok(());
        }
        Err(RepoError::Write(match synced {
            Ok(()) => error,
            Err(e) => format!("{error} (whether it landed could not be read: {e})"),
        }))
    }

    /// Deletes a subscription (a tombstone) and returns once the table no longer has it.
    pub async fn delete(&self, id: &str) -> Result<(), RepoError> {
        self.delete_holding(id, ()).await
    }

    /// [`Subscriptions::delete`] as a task of its own, `hold` kept until it ends (see
    /// [`Subscriptions::put_holding`]: a tombstone the broker took but this instance's table
    /// never showed let the pending retrier write the subscription back).
    pub async fn delete_holding<H: Send + 'static>(
        &self,
        id: &str,
        hold: H,
    ) -> Result<(), RepoError> {
        let (this, id) = (self.clone(), id.to_string());
        detached(async move {
            let deleted = this.delete_now(&id).await;
            drop(hold);
            deleted
        })
        .await
    }

    async fn delete_now(&self, id: &str) -> Result<(), RepoError> {
        let at: Option<(i32, i64)> = match &self.writer {
            Writer::Memory => {
                self.table.apply(|t| {
                    t.remove(id);
                });
                None
            }
            #[cfg(test)]
            Writer::Lagging => return Err(RepoError::NotSeen(READ_YOUR_WRITES)),
            #[cfg(test)]
            Writer::Scripted(script) => script(&self.table, id, None),
            #[cfg(test)]
            Writer::Failing(failing) => {
                if failing.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(RepoError::Write("Message timed out".into()));
                }
                self.table.apply(|t| {
                    t.remove(id);
                });
                None
            }
            #[cfg(test)]
            Writer::LandedButFailed(failing) => {
                self.table.apply(|t| {
                    t.remove(id);
                });
                if failing.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(RepoError::Write("Message timed out".into()));
                }
                None
            }
            #[cfg(test)]
            Writer::Gated(gate) => {
                gate.notified().await;
                self.table.apply(|t| {
                    t.remove(id);
                });
                None
            }
            Writer::Kafka {
                producer, topic, ..
            } => {
                let at = served::send_awaited(producer, topic, id, None, QUEUE_WAIT)
                    .await
                    .map_err(|e| RepoError::Write(e.to_string()))?;
                Some(at)
            }
        };
        let wait = match &self.writer {
            #[cfg(test)]
            Writer::Scripted(_) => Duration::ZERO,
            _ => READ_YOUR_WRITES,
        };
        // Seen: gone, or the reader went past the tombstone; then a record after it (another
        // writer's: an auto-disable, a verify, a PATCH planned before the deletion) has brought
        // it back. Waited for its absence alone, that case waited the whole 15 s and answered
        // "deleted" for a subscription every instance has again.
        let passed = |t: &Table| at.is_some_and(|(p, o)| t.has_read(p, o));
        if self
            .table
            .wait_for(wait, |t| t.get(id).is_none() || passed(t))
            .await
        {
            let back = self.table.read();
            return if back.get(id).is_some() && passed(&back) {
                Err(RepoError::WrittenAgain)
            } else {
                Ok(())
            };
        }
        // The broker has the tombstone: gone from this instance's table now, and kept gone over
        // the records before it the reader has still to apply (`Table::write_local`). Left in
        // place before, a GET still found it, and a PATCH, a verify or the pending retrier wrote
        // a version after the tombstone that brought it back on every instance.
        if let Some((p, o)) = at {
            self.table.apply(|t| t.write_local(id, None, p, o));
        }
        Err(RepoError::NotSeen(wait))
    }
}

/// How long a control-topic write may wait for the broker to take it.
const CONTROL_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a write to its end whatever becomes of the caller.
async fn detached(
    write: impl std::future::Future<Output = Result<(), RepoError>> + Send + 'static,
) -> Result<(), RepoError> {
    tokio::spawn(write)
        .await
        .unwrap_or_else(|e| Err(RepoError::Write(format!("the write's task ended: {e}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scripted(
        script: impl Fn(&SharedTable, &str, Option<&SubscriptionRecord>) -> Option<(i32, i64)>
        + Send
        + Sync
        + 'static,
    ) -> Subscriptions {
        Subscriptions::scripted(Arc::new(Codec::new().unwrap()), script)
    }

    fn v2() -> SubscriptionRecord {
        let mut rec = SubscriptionRecord::pull("sub-1", "acme", &["transaction.*"]);
        rec.version = 2;
        rec
    }

    /// A caller dropped while its write waits on the broker (an HTTP client that went away) does
    /// not stop the write: the table shows it once the broker takes it, and the write lock the
    /// caller held stays taken until then. Dropped with the caller before, the write could land
    /// on the topic while this instance's table kept the version before it, and the next write
    /// made here from that version undid it on every instance.
    #[tokio::test]
    async fn a_write_whose_caller_is_dropped_still_ends() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let subs = Subscriptions::gated(Arc::new(Codec::new().unwrap()), gate.clone());
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        for deletion in [false, true] {
            let guard = lock.clone().lock_owned().await;
            let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let caller = {
                let (subs, started) = (subs.clone(), started.clone());
                tokio::spawn(async move {
                    // In the same poll as the write's start (a current-thread runtime).
                    started.store(true, std::sync::atomic::Ordering::SeqCst);
                    if deletion {
                        subs.delete_holding("sub-1", guard).await
                    } else {
                        subs.put_holding(v2(), guard).await
                    }
                })
            };
            // The caller is in its write, waiting on the broker; then it is dropped.
            while !started.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::task::yield_now().await;
            }
            caller.abort();
            assert!(caller.await.unwrap_err().is_cancelled());
            assert!(
                lock.try_lock().is_err(),
                "the lock was given back mid-write"
            );
            gate.notify_one();
            let written = subs
                .table()
                .wait_for(Duration::from_secs(10), |t| {
                    t.get("sub-1").is_some() != deletion
                })
                .await;
            assert!(
                written,
                "the write stopped with its caller (deletion: {deletion})"
            );
            // Given back once the write has ended.
            let _ = tokio::time::timeout(Duration::from_secs(10), lock.lock())
                .await
                .expect("the lock was never given back");
        }
    }

    /// Another instance deleted the subscription right after this write, and the reader applied
    /// both before the writer looked: the write was seen (the reader went past it), and the table
    /// keeps the deletion. Before, the writer found neither its version nor anything newer, took
    /// its write for unseen after the wait, and put the deleted subscription back for good.
    #[tokio::test]
    async fn a_write_deleted_right_after_is_not_put_back() {
        let subs = scripted(|table, _, rec| {
            let rec = rec.unwrap().clone();
            table.apply(|t| {
                t.upsert(rec.clone());
                t.note_read(0, 7);
                t.remove(&rec.id);
                t.note_read(0, 8);
            });
            Some((0, 7))
        });
        subs.put(v2()).await.unwrap();
        assert!(
            subs.get("sub-1").is_none(),
            "the deleted subscription came back"
        );
    }

    /// A write the reader has not reached within the wait is put in this instance's table (its
    /// reads and next writes start from it) and reported as not seen.
    #[tokio::test]
    async fn a_write_the_reader_has_not_reached_is_kept_as_written() {
        let subs = scripted(|table, _, _| {
            table.apply(|t| t.note_read(0, 6));
            Some((0, 7))
        });
        assert!(matches!(subs.put(v2()).await, Err(RepoError::NotSeen(_))));
        assert_eq!(subs.get("sub-1").map(|s| s.version), Some(2));
    }

    /// A record no reader would take is not written: the broker is never asked.
    #[tokio::test]
    async fn a_record_larger_than_a_control_record_may_be_is_not_written() {
        let subs = scripted(|_, _, _| panic!("written"));
        let types: Vec<String> = (0..2_000).map(|i| format!("t{i:0>140}.*")).collect();
        let types: Vec<&str> = types.iter().map(String::as_str).collect();
        let mut big = SubscriptionRecord::pull("sub-1", "acme", &types);
        big.version = 2;
        assert!(matches!(subs.put(big).await, Err(RepoError::Codec(_))));
        assert!(subs.get("sub-1").is_none());
    }

    /// A write landing at control offset 3 and read there at once.
    fn read_at_3(table: &SharedTable, rec: &SubscriptionRecord) -> Option<(i32, i64)> {
        table.apply(|t| {
            t.read_record(&rec.id, Some(rec.clone()), 0, 3);
            t.note_read(0, 3);
        });
        Some((0, 3))
    }

    /// A deletion the reader has not reached is gone from this instance's table at once: a GET
    /// does not find it, so no PATCH, verify or retrier writes a version after the tombstone
    /// (which brought it back everywhere); and the records before the tombstone the reader has
    /// still to apply do not bring it back either.
    #[tokio::test]
    async fn a_deletion_the_reader_has_not_reached_is_gone_at_once_and_stays_gone() {
        let subs = scripted(|table, _, rec| match rec {
            Some(rec) => read_at_3(table, rec),
            None => Some((0, 9)),
        });
        subs.put(v2()).await.unwrap();
        assert!(matches!(
            subs.delete("sub-1").await,
            Err(RepoError::NotSeen(_))
        ));
        assert!(subs.get("sub-1").is_none(), "gone at once");
        // The reader catches up: a version written before the tombstone, then the tombstone.
        let mut v3 = v2();
        v3.version = 3;
        subs.table()
            .apply(|t| t.read_record("sub-1", Some(v3), 0, 6));
        assert!(subs.get("sub-1").is_none(), "not brought back");
        subs.table().apply(|t| t.read_record("sub-1", None, 0, 9));
        assert!(subs.get("sub-1").is_none());
    }

    /// A deletion the reader goes past while another writer's record after it brings the
    /// subscription back is not answered as done (it waited the whole 15 s for an absence that
    /// never came, then said deleted).
    #[tokio::test]
    async fn a_deletion_written_over_by_a_later_record_is_not_reported_deleted() {
        let subs = scripted(|table, _, rec| match rec {
            Some(rec) => read_at_3(table, rec),
            None => {
                // The tombstone at 9, then an auto-disable's version at 10, both read.
                let mut v3 = v2();
                v3.version = 3;
                table.apply(|t| {
                    t.read_record("sub-1", None, 0, 9);
                    t.read_record("sub-1", Some(v3), 0, 10);
                    t.note_read(0, 10);
                });
                Some((0, 9))
            }
        });
        subs.put(v2()).await.unwrap();
        assert!(matches!(
            subs.delete("sub-1").await,
            Err(RepoError::WrittenAgain)
        ));
        assert_eq!(subs.get("sub-1").map(|s| s.version), Some(3));
    }
}
