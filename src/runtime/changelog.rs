//! Changelogs: the compacted topics that are the truth behind each local store.
//!
//! Writing: a task sends its changelog records inside its batch transaction through a producer
//! whose context ([`TrackingContext`]) remembers the offset of every delivered record; after the
//! commit those offsets go into RocksDB in the same write as the data.
//!
//! Restoring: on assignment, a task reads its changelog partition `read_committed` from the offset
//! after the one its store holds (or from the beginning for an empty store) up to the partition's
//! end, applying records in chunks (one `WriteBatch` each, with the offset). Aborted transactions —
//! a zombie's, or our own before a crash — are never applied.
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::config::Config;
use crate::runtime::kafka::{self, KafkaError};

/// Remembers the highest delivered offset per (topic, partition) since the last `take`.
#[derive(Default)]
pub struct TrackingContext {
    delivered: Mutex<HashMap<String, HashMap<i32, i64>>>,
    failed: Mutex<Option<String>>,
}

impl ClientContext for TrackingContext {}

impl ProducerContext for TrackingContext {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(m) => {
                let mut d = self.delivered.lock().unwrap_or_else(|p| p.into_inner());
                let per_topic = match d.get_mut(m.topic()) {
                    Some(t) => t,
                    None => d.entry(m.topic().to_string()).or_default(),
                };
                let e = per_topic.entry(m.partition()).or_insert(m.offset());
                *e = (*e).max(m.offset());
            }
            Err((e, _)) => {
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            }
        }
    }
}

impl TrackingContext {
    /// The delivered offsets since the last call, and the first delivery error, if any.
    pub fn take(&self) -> (HashMap<String, HashMap<i32, i64>>, Option<String>) {
        let d = std::mem::take(&mut *self.delivered.lock().unwrap_or_else(|p| p.into_inner()));
        let f = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take();
        (d, f)
    }
}

/// What one restore did.
#[derive(Debug, Clone, Default)]
pub struct RestoreStats {
    pub records: u64,
    pub took: Duration,
    pub from: Option<i64>,
    pub to: i64,
}

/// One changelog record as restore hands it over: key, value (None = tombstone), offset.
pub type ChangelogRecord<'a> = (&'a [u8], Option<&'a [u8]>, i64);

/// Reads `topic[partition]` after `after` (None = from the beginning) to its current end and
/// hands records to `apply` in chunks, in order.
pub fn restore(
    config: &Config,
    topic: &str,
    partition: i32,
    after: Option<i64>,
    mut apply: impl FnMut(&[ChangelogRecord<'_>]) -> Result<(), String>,
) -> Result<RestoreStats, KafkaError> {
    let started = Instant::now();
    let consumer: BaseConsumer = kafka::base(config)
        .set("group.id", format!("{}.restore", config.group_id))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "false")
        .set("fetch.max.bytes", "52428800")
        .set("max.partition.fetch.bytes", "16777216")
        .create()
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
    let (low, high) = consumer.fetch_watermarks(topic, partition, Duration::from_secs(30))?;
    let start = match after {
        Some(o) if o + 1 >= low => o + 1,
        _ => low,
    };
    let mut stats = RestoreStats { records: 0, took: Duration::ZERO, from: after, to: high };
    if start >= high {
        stats.took = started.elapsed();
        return Ok(stats);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(start))?;
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut idle_polls = 0u32;
    loop {
        let mut chunk: Vec<rdkafka::message::BorrowedMessage<'_>> = Vec::with_capacity(4096);
        while chunk.len() < 4096 {
            match consumer.poll(Duration::from_millis(if chunk.is_empty() { 200 } else { 0 })) {
                Some(Ok(m)) => chunk.push(m),
                Some(Err(e)) => return Err(e.into()),
                None => break,
            }
        }
        idle_polls = if chunk.is_empty() { idle_polls + 1 } else { 0 };
        if !chunk.is_empty() {
            let records: Vec<ChangelogRecord<'_>> = chunk
                .iter()
                .map(|m| (m.key().unwrap_or_default(), m.payload(), m.offset()))
                .collect();
            apply(&records).map_err(KafkaError::Setup)?;
            stats.records += records.len() as u64;
        }
        // Done when the position passed the end we saw at the start (transaction markers
        // included: the position moves past them).
        let pos = consumer.position()?;
        let at = pos
            .find_partition(topic, partition)
            .and_then(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
            .unwrap_or(start);
        if at >= high {
            break;
        }
        // Aborted records and transaction markers at the very end may leave the position short
        // of the high watermark; 2 s without a committed record there means we have them all.
        if idle_polls >= 10 {
            tracing::debug!(topic, partition, at, high, "restore ended on idle tail");
            break;
        }
        if Instant::now() > deadline {
            return Err(KafkaError::Setup(format!(
                "restore of {topic}[{partition}] stalled at {at} of {high}"
            )));
        }
    }
    stats.took = started.elapsed();
    Ok(stats)
}
