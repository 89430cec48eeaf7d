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
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::runtime::avro::{Codec, RecordKind};
use crate::runtime::kafka::{self, KafkaError};
use crate::runtime::records::SubscriptionRecord;
use crate::subscriptions::table::{SharedTable, Sub, Table};

/// How long a write waits to see itself in the table before it reports a timeout.
const READ_YOUR_WRITES: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum RepoError {
    #[error("writing the control topic failed: {0}")]
    Write(String),
    #[error("the write was not seen back within {0:?}")]
    NotSeen(Duration),
    #[error("encoding: {0}")]
    Codec(String),
}

impl RepoError {
    pub fn is_retryable(&self) -> bool {
        !matches!(self, RepoError::Codec(_))
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
    while !stop.load(Ordering::Relaxed) {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                let Some(id) = m.key().and_then(|k| std::str::from_utf8(k).ok()) else {
                    tracing::warn!(
                        offset = m.offset(),
                        "control record without a valid key skipped"
                    );
                    continue;
                };
                match m.payload() {
                    None => {
                        table.apply(|t| {
                            t.remove(id);
                        });
                        tracing::info!(subscription_id = id, "subscription deleted");
                    }
                    Some(bytes) => {
                        match codec.decode::<SubscriptionRecord>(RecordKind::Subscription, bytes) {
                            // A version with no successor (the next write would not encode as
                            // an Avro long) would freeze the subscription: no PATCH could pass.
                            Ok(rec) if rec.id == id && rec.version >= i64::MAX as u64 => {
                                tracing::warn!(
                                    subscription_id = id,
                                    offset = m.offset(),
                                    "control record whose version has no successor skipped"
                                )
                            }
                            Ok(rec) if rec.id == id => {
                                tracing::debug!(
                                    subscription_id = id,
                                    version = rec.version,
                                    "subscription updated"
                                );
                                table.apply(|t| t.upsert(rec));
                            }
                            Ok(_) => tracing::warn!(
                                subscription_id = id,
                                offset = m.offset(),
                                "control record whose key and id differ skipped"
                            ),
                            Err(e) => {
                                tracing::warn!(subscription_id = id, offset = m.offset(), error = %e, "undecodable control record skipped")
                            }
                        }
                    }
                }
            }
            Some(Err(RdKafkaError::PartitionEOF(p)))
                if reading
                    .get(&p)
                    .is_some_and(|e| read_through(&consumer, &topic, p, e)) =>
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
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let parts = md
        .topics()
        .first()
        .map(|t| t.partitions())
        .unwrap_or_default();
    if parts.is_empty() {
        return Err(KafkaError::Setup(format!(
            "{topic} has no partitions (yet)"
        )));
    }
    let mut tpl = TopicPartitionList::new();
    let mut ends = Vec::new();
    for p in parts {
        tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
        let (low, high) = consumer.fetch_watermarks(topic, p.id(), Duration::from_secs(10))?;
        ends.push((p.id(), Ends { low, high }));
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
    Kafka {
        producer: FutureProducer,
        topic: String,
    },
}

impl Subscriptions {
    pub fn kafka(
        config: &Config,
        codec: Arc<Codec>,
        table: SharedTable,
    ) -> Result<Subscriptions, KafkaError> {
        let producer: FutureProducer = kafka::base(config)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "0")
            .create()
            .map_err(|e| KafkaError::Setup(e.to_string()))?;
        Ok(Subscriptions {
            table,
            codec,
            writer: Writer::Kafka {
                producer,
                topic: topic(config),
            },
        })
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
        let bytes = self
            .codec
            .encode(RecordKind::Subscription, &rec)
            .map_err(|e| RepoError::Codec(e.to_string()))?;
        let (id, version) = (rec.id.clone(), rec.version);
        let wait = match &self.writer {
            // Taken, never shown back by a reader: the NotSeen path below, at once.
            #[cfg(test)]
            Writer::Lagging => Duration::ZERO,
            _ => READ_YOUR_WRITES,
        };
        match &self.writer {
            Writer::Memory => self.table.apply(|t| t.upsert(rec.clone())),
            #[cfg(test)]
            Writer::Lagging => {}
            Writer::Kafka { producer, topic } => {
                producer
                    .send(
                        FutureRecord::to(topic).key(&id).payload(&bytes),
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|(e, _)| RepoError::Write(e.to_string()))?;
            }
        }
        let newer = |t: &Table| t.get(&id).is_some_and(|s| s.version >= version);
        if self.table.wait_for(wait, newer).await {
            return Ok(());
        }
        // The broker has it: this instance's reads and next writes start from it (the reader's
        // copy, when it comes, replaces it). Only when the table still has nothing as new: the
        // reader may have shown it, or a later version, in the meantime.
        self.table.apply(|t| {
            if !newer(t) {
                t.upsert(rec)
            }
        });
        Err(RepoError::NotSeen(wait))
    }

    /// Deletes a subscription (a tombstone) and returns once the table no longer has it.
    pub async fn delete(&self, id: &str) -> Result<(), RepoError> {
        match &self.writer {
            Writer::Memory => self.table.apply(|t| {
                t.remove(id);
            }),
            #[cfg(test)]
            Writer::Lagging => return Err(RepoError::NotSeen(READ_YOUR_WRITES)),
            Writer::Kafka { producer, topic } => {
                producer
                    .send(
                        FutureRecord::<str, [u8]>::to(topic).key(id),
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|(e, _)| RepoError::Write(e.to_string()))?;
            }
        }
        if self
            .table
            .wait_for(READ_YOUR_WRITES, |t| t.get(id).is_none())
            .await
        {
            Ok(())
        } else {
            // The broker has the tombstone; the table drops it when the reader gets there (a
            // removal now would let the reader's older records of it, still to come, add it back).
            Err(RepoError::NotSeen(READ_YOUR_WRITES))
        }
    }
}
