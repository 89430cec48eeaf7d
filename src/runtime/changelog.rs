//! Changelogs: the compacted topics that are the truth behind each local store.
//!
//! Writing: a task sends its changelog records inside its batch transaction through a producer
//! whose context ([`TrackingContext`]) remembers the offset of every delivered record; after the
//! commit those offsets go into RocksDB in the same write as the data.
//!
//! Restoring: on assignment, a task reads its changelog partition `read_committed` from the offset
//! after the one its store holds (or from the beginning for an empty store) up to the partition's
//! end, applying records in chunks (one `WriteBatch` each, with the offset). Aborted transactions —
//! a zombie's, or our own before a crash — are never applied; a transaction still open at the end
//! is waited for, since it may yet commit. A store whose offset is at or past its partition's end
//! (the log lost its tail, or the topic was made again) is not read on from: the restore stops
//! with [`KafkaError::AheadOfChangelog`], and the hub discards that store and restores it from the
//! start.
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
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
    failed: Mutex<Option<rdkafka::error::KafkaError>>,
    /// Reported delivered without an offset: not surely written (see `kafka::placed`).
    unplaced: kafka::PlacedOnly,
}

impl ClientContext for TrackingContext {}

impl ProducerContext for TrackingContext {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(m) if !self.unplaced.check(m.offset()) => {}
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
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
            }
        }
    }
}

impl TrackingContext {
    /// The delivered offsets since the last call, and the last delivery error, if any (its code
    /// tells a record the broker will never take from a broker in trouble), else the error of
    /// records reported delivered without an offset (`kafka::unplaced`).
    pub fn take(
        &self,
    ) -> (
        HashMap<String, HashMap<i32, i64>>,
        Option<rdkafka::error::KafkaError>,
    ) {
        let d = std::mem::take(&mut *self.delivered.lock().unwrap_or_else(|p| p.into_inner()));
        let f = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take();
        let unplaced = self.unplaced.take();
        (
            d,
            f.or_else(|| (unplaced > 0).then(|| kafka::unplaced(unplaced))),
        )
    }
}

/// What one restore did.
#[derive(Debug, Clone, Default)]
pub struct RestoreStats {
    pub records: u64,
    pub took: Duration,
}

/// One changelog record as restore hands it over: key, value (None = tombstone), offset.
pub type ChangelogRecord<'a> = (&'a [u8], Option<&'a [u8]>, i64);

/// One changelog partition to restore: read it after `after` (None = from the beginning).
#[derive(Debug, Clone)]
pub struct RestoreSpec {
    pub topic: String,
    pub partition: i32,
    pub after: Option<i64>,
}

/// Reads every spec'd changelog partition, with one consumer, from after its stored offset to its
/// current end, and hands records to `apply(spec index, chunk)` in order per partition.
/// Setting `cancel` ends it early with [`KafkaError::Cancelled`] (within ~20 ms while it reads or
/// waits, within one watermark request while it starts).
pub fn restore(
    config: &Config,
    specs: &[RestoreSpec],
    cancel: &AtomicBool,
    mut apply: impl FnMut(usize, &[ChangelogRecord<'_>]) -> Result<(), String>,
) -> Result<RestoreStats, KafkaError> {
    let started = Instant::now();
    let mut stats = RestoreStats::default();
    let consumer: BaseConsumer = kafka::base(config)
        .set("group.id", format!("{}.restore", config.group_id))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        // A start below the log start by the time it is fetched (records deleted in between)
        // reads from the oldest record kept: librdkafka's default would go to the end silently.
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        .set("fetch.wait.max.ms", "10")
        .set("fetch.max.bytes", "52428800")
        .set("max.partition.fetch.bytes", "16777216")
        .create()
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
    // The end to restore to is the log end, asked by a `read_uncommitted` client: a
    // `read_committed` one is told the last stable offset, which stops short of a transaction
    // still open (a previous owner's, stuck or dead) and of everything committed after it by
    // the owners in between. A restore that stopped there, then checkpointed past them with its
    // own writes, lost those owners' jobs for good (found by the fault suite: jobs due and never
    // attempted).
    let ends: BaseConsumer = kafka::base(config)
        .set("group.id", format!("{}.restore", config.group_id))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_uncommitted")
        .create()
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
    let mut tpl = TopicPartitionList::new();
    // (spec index, end offset) of the partitions that have something to read.
    let mut pending: Vec<(usize, i64)> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let (low, high) = watermarks(&ends, &s.topic, s.partition, cancel)?;
        // A record the store applied was committed and replicated, so the end is past it; an end
        // at or before it means the log lost its tail (unclean leader election, a broker's
        // disk) or is another log (the topic deleted and made again). The store then holds what
        // the changelog does not, and reading on from its offset would keep it: the caller
        // discards the store and restores it from the start.
        if let Some(stored) = s.after.filter(|o| *o >= high) {
            return Err(KafkaError::AheadOfChangelog {
                spec: i,
                topic: s.topic.clone(),
                partition: s.partition,
                stored,
                end: high,
            });
        }
        let start = match s.after {
            Some(o) if o + 1 >= low => o + 1,
            _ => low,
        };
        if start < high {
            tpl.add_partition_offset(&s.topic, s.partition, Offset::Offset(start))?;
            pending.push((i, high));
        }
    }
    if pending.is_empty() {
        stats.took = started.elapsed();
        return Ok(stats);
    }
    consumer.assign(&tpl)?;
    // A restore fails only when it stopped moving: a long one (a state directory deleted, a
    // store discarded as stale, the first start after an upgrade) that still reads records goes
    // on; one that waits that long for an open transaction (which the transaction timeout ends
    // in a minute) or reads nothing through errors stops, and its process restarts.
    let mut progress_at = Instant::now();
    let mut idle_since = Instant::now();
    let mut waiting_logged = false;
    loop {
        crate::runtime::liveness::beat_current(); // restoring is turning
        if cancel.load(Ordering::Relaxed) {
            return Err(KafkaError::Cancelled);
        }
        let mut chunk: Vec<rdkafka::message::BorrowedMessage<'_>> = Vec::with_capacity(4096);
        while chunk.len() < 4096 {
            match consumer.poll(Duration::from_millis(if chunk.is_empty() { 20 } else { 0 })) {
                Some(Ok(m)) => chunk.push(m),
                Some(Err(e)) => {
                    // A broker going away mid-restore (its partitions move to another leader):
                    // librdkafka reconnects. Not idle either: an error must not pass for the
                    // quiet end of the changelog below.
                    tracing::warn!(error = %e, "changelog read error during restore; retrying");
                    idle_since = Instant::now();
                    std::thread::sleep(Duration::from_millis(100));
                    break;
                }
                None => break,
            }
        }
        if !chunk.is_empty() {
            idle_since = Instant::now();
            progress_at = idle_since;
            // Hand records over per partition, in order.
            let mut by_spec: HashMap<usize, Vec<ChangelogRecord<'_>>> = HashMap::new();
            for m in &chunk {
                let found = specs
                    .iter()
                    .position(|s| s.partition == m.partition() && s.topic == m.topic());
                if let Some(i) = found {
                    by_spec.entry(i).or_default().push((
                        m.key().unwrap_or_default(),
                        m.payload(),
                        m.offset(),
                    ));
                }
            }
            for (i, records) in by_spec {
                apply(i, &records).map_err(KafkaError::Setup)?;
                stats.records += records.len() as u64;
            }
        }
        // Done when each position passed the end seen at the start (positions move past
        // transaction markers).
        let pos = consumer.position()?;
        let at = |i: usize| {
            let s = &specs[i];
            pos.find_partition(&s.topic, s.partition)
                .and_then(|e| match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                })
        };
        pending.retain(|(i, high)| !matches!(at(*i), Some(o) if o >= *high));
        if pending.is_empty() {
            break;
        }
        // An open transaction at the end (a previous owner's: one that lost the partition
        // while its transaction was open, or that died in one) keeps the position short of the
        // end. The restore waits for it to end — committed (its records are read) or aborted (by
        // its restarted instance, or by the transaction timeout): a transaction whose offsets
        // the group accepted can still commit after the new owner took over, and a restore that
        // stopped at the last stable offset missed those writes (found by the fault suite).
        if idle_since.elapsed() > Duration::from_secs(2) && !waiting_logged {
            waiting_logged = true;
            tracing::info!(
                left = pending.len(),
                "restore waiting for an open transaction on a changelog to end"
            );
        }
        if progress_at.elapsed() > RESTORE_STALL {
            return Err(KafkaError::Setup(format!(
                "restore stalled: no record in {} s with {} partitions left",
                RESTORE_STALL.as_secs(),
                pending.len()
            )));
        }
    }
    stats.took = started.elapsed();
    Ok(stats)
}

/// How long a restore may read nothing before it fails.
const RESTORE_STALL: Duration = Duration::from_secs(600);

/// A partition's watermarks, retried for up to a minute: right after a topic is created or a
/// broker dies, its leader may not be known yet (`NotLeaderForPartition`, transport errors), and
/// a restore must wait that out rather than fail the task.
fn watermarks<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
    cancel: &AtomicBool,
) -> Result<(i64, i64), KafkaError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(KafkaError::Cancelled);
        }
        match consumer.fetch_watermarks(topic, partition, Duration::from_secs(10)) {
            Ok(w) => return Ok(w),
            Err(e) if Instant::now() < deadline => {
                tracing::warn!(topic, partition, error = %e, "changelog watermarks not readable yet; retrying");
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
