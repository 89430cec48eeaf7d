//! `streaming-hub replay`: whole-hub replay by offset reset (DESIGN.md §3). It moves the hub
//! group's (`<group>.hub`) committed offsets on `<prefix>.inbox` back to a time or an offset;
//! when the hub starts again every event from there is matched and delivered again (the dedup
//! store recognises each as a replay of its own first offset, so it keeps its sequence number,
//! and copies of it at other offsets are still dropped).
//!
//! The group must be stopped: Kafka accepts an outside offset commit only for an empty group, so
//! a running (or not yet timed-out) instance makes the command fail with a clear message and
//! changes nothing.
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::runtime::kafka;

/// Where to move the group.
#[derive(Debug, Clone)]
pub enum Target {
    /// The first offset at or after this time (ms since the epoch) in every partition.
    Time(i64),
    /// This offset in every partition (clamped to what the log still holds).
    ///
    /// Whatever the target, no partition moves past the group's committed offset ([`moved_to`]).
    Offset(i64),
    Earliest,
    /// Exactly these offsets in the partitions named (clamped to what the log holds), forward
    /// too: to undo a replay with the old offsets it printed. Partitions not named stay.
    Exact(Vec<(i32, i64)>),
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "the hub group {group} is still active (or its members have not timed out yet): stop every hub instance, wait for the session timeout, and run replay again"
    )]
    GroupActive { group: String },
    #[error(
        "the hub group {group} has no committed offset on {inbox}: nothing to move back (a hub that never ran starts at the log start anyway); check STREAMING_HUB_GROUP_ID and STREAMING_HUB_TOPIC_PREFIX"
    )]
    NothingCommitted { group: String, inbox: String },
    #[error("{inbox} has no partition {partition} (it has {count}, from 0)")]
    NoSuchPartition {
        inbox: String,
        partition: i32,
        count: usize,
    },
    #[error("kafka: {0}")]
    Kafka(String),
}

/// Moves the hub group's offsets (with `commit`; without, only says where they would go);
/// returns (partition, old committed, new) per partition moved or kept.
pub fn run(
    config: &Config,
    target: &Target,
    commit: bool,
) -> Result<Vec<(i32, Option<i64>, i64)>, ReplayError> {
    let kafka_err = |e: rdkafka::error::KafkaError| ReplayError::Kafka(e.to_string());
    let group = config.hub_group_id();
    let inbox = format!("{}.inbox", config.topic_prefix);
    let consumer: BaseConsumer = kafka::base(config)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(kafka_err)?;
    let timeout = Duration::from_secs(30);
    let partitions = kafka::partition_ids(&consumer, &inbox, timeout)
        .map_err(|e| ReplayError::Kafka(e.to_string()))?;
    if let Target::Exact(named) = target {
        if let Some((p, _)) = named.iter().find(|(p, _)| !partitions.contains(p)) {
            return Err(ReplayError::NoSuchPartition {
                inbox,
                partition: *p,
                count: partitions.len(),
            });
        }
    }
    let mut current = TopicPartitionList::new();
    for p in &partitions {
        current.add_partition(&inbox, *p);
    }
    let committed = consumer
        .committed_offsets(current, timeout)
        .map_err(kafka_err)?;
    // A mistyped group or prefix finds none: committing the log start for a group nobody runs
    // would print like a replay done.
    if committed
        .elements()
        .iter()
        .all(|e| !matches!(e.offset(), Offset::Offset(_)))
    {
        return Err(ReplayError::NothingCommitted { group, inbox });
    }
    let mut wanted = TopicPartitionList::new();
    let mut out = Vec::new();
    let by_time = match target {
        Target::Time(ms) => {
            let mut q = TopicPartitionList::new();
            for p in &partitions {
                q.add_partition_offset(&inbox, *p, Offset::Offset(*ms))
                    .map_err(kafka_err)?;
            }
            Some(consumer.offsets_for_times(q, timeout).map_err(kafka_err)?)
        }
        _ => None,
    };
    for p in &partitions {
        let (low, high) = consumer
            .fetch_watermarks(&inbox, *p, timeout)
            .map_err(kafka_err)?;
        let old = match committed.find_partition(&inbox, *p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        };
        let to = match target {
            Target::Exact(named) => match named.iter().find(|(q, _)| q == p) {
                Some((_, o)) => {
                    // Told exactly: forward too (undoing a replay). One never committed is
                    // where the hub would start it, the log start: a move past it skips records,
                    // and says so.
                    let new = (*o).min(high).max(low);
                    wanted
                        .add_partition_offset(&inbox, *p, Offset::Offset(new))
                        .map_err(kafka_err)?;
                    out.push((*p, old.or(Some(low)), new));
                    continue;
                }
                None => continue,
            },
            Target::Earliest => low,
            Target::Offset(o) => (*o).min(high).max(low), // `clamp` panics if low > high
            Target::Time(_) => {
                let found = by_time
                    .as_ref()
                    .map(|t| kafka::offset_for_time(t, &inbox, *p));
                match found {
                    // The lookup failed for this partition: not "nothing after that time".
                    Some(Err(e)) => return Err(kafka_err(e)),
                    Some(Ok(Some(o))) => o,
                    _ => high, // nothing at or after that time
                }
            }
        };
        let new = moved_to(to, old, low);
        wanted
            .add_partition_offset(&inbox, *p, Offset::Offset(new))
            .map_err(kafka_err)?;
        out.push((*p, old, new));
    }
    if !commit {
        return Ok(out);
    }
    match consumer.commit(&wanted, CommitMode::Sync) {
        Ok(()) => Ok(out),
        Err(e) => match e.rdkafka_error_code() {
            Some(
                RDKafkaErrorCode::UnknownMemberId
                | RDKafkaErrorCode::RebalanceInProgress
                | RDKafkaErrorCode::IllegalGeneration,
            ) => Err(ReplayError::GroupActive { group }),
            _ => Err(kafka_err(e)),
        },
    }
}

/// Where a partition goes: back to `to`, never forward. A target past the group's committed
/// offset (a time after the partition's last record, one inside a backlog the hub has not
/// reached, an offset ahead of it) would skip records the hub never processed, so such a
/// partition stays where it is; one the group never committed starts at the log start (where
/// the hub would start it anyway).
fn moved_to(to: i64, committed: Option<i64>, low: i64) -> i64 {
    match committed {
        Some(c) => to.min(c.max(low)),
        None => low,
    }
}

/// Parses `--to-offset` (an offset, 0 or more, or `earliest`). A negative number is refused:
/// Kafka's tools read `-1` as "latest" and `-1000` may be meant as "1,000 back", and either
/// would otherwise be taken as the earliest offset, replaying everything kept.
pub fn parse_offset(text: &str) -> Result<Target, String> {
    if text == "earliest" {
        return Ok(Target::Earliest);
    }
    match text.parse::<i64>() {
        Ok(o) if o >= 0 => Ok(Target::Offset(o)),
        Ok(_) => Err(format!(
            "expected an offset of 0 or more or `earliest`, got {text:?} \
             (to replay from a time, use --to-datetime)"
        )),
        Err(_) => Err(format!("expected an offset or `earliest`, got {text:?}")),
    }
}

/// Parses `--to-offsets` (`<partition>:<offset>,…`, each offset 0 or more, each partition once).
pub fn parse_offsets(text: &str) -> Result<Target, String> {
    let mut named: Vec<(i32, i64)> = Vec::new();
    for item in text.split(',').map(str::trim) {
        let parsed = item.split_once(':').and_then(|(p, o)| {
            Some((p.trim().parse::<i32>().ok()?, o.trim().parse::<i64>().ok()?))
        });
        match parsed {
            Some((p, o)) if p >= 0 && o >= 0 => {
                if named.iter().any(|(q, _)| *q == p) {
                    return Err(format!("partition {p} is named twice in {text:?}"));
                }
                named.push((p, o));
            }
            _ => {
                return Err(format!(
                    "expected <partition>:<offset>,… (each 0 or more), such as 0:1200,1:880, \
                     got {item:?}"
                ));
            }
        }
    }
    Ok(Target::Exact(named))
}

/// Parses `--to-datetime` (RFC 3339; a time before 1970 is refused: Kafka keeps none).
pub fn parse_time(text: &str) -> Result<Target, String> {
    let t = chrono::DateTime::parse_from_rfc3339(text)
        .map_err(|e| format!("expected an RFC 3339 time such as 2026-11-30T08:00:00Z ({e})"))?;
    match t.timestamp_millis() {
        ms if ms >= 0 => Ok(Target::Time(ms)),
        _ => Err(format!(
            "{text:?} is before 1970: to replay everything kept, use --to-offset earliest"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_moves_back_never_forward() {
        // Back to the target.
        assert_eq!(moved_to(100, Some(500), 0), 100);
        // A target past what the hub committed (its backlog, the log end): stays.
        assert_eq!(moved_to(1000, Some(900), 0), 900);
        assert_eq!(moved_to(900, Some(900), 0), 900);
        // Committed below the log start (truncated): the log start, not further.
        assert_eq!(moved_to(800, Some(10), 50), 50);
        // Never committed: the log start, whatever the target.
        assert_eq!(moved_to(700, None, 20), 20);
    }

    #[test]
    fn exact_offsets_parse_and_bad_input_is_named() {
        assert!(matches!(
            parse_offsets("0:1200, 1:880"),
            Ok(Target::Exact(v)) if v == [(0, 1200), (1, 880)]
        ));
        for bad in [
            "", "0", "0:", ":5", "0:-1", "-1:5", "a:1", "0:1,0:2", "0:1;1:2",
        ] {
            assert!(parse_offsets(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn targets_parse_and_bad_input_is_named() {
        assert!(matches!(parse_offset("earliest"), Ok(Target::Earliest)));
        assert!(matches!(parse_offset("42"), Ok(Target::Offset(42))));
        assert!(parse_offset("soon").unwrap_err().contains("soon"));
        // Not taken as the earliest offset (which is what the clamp to the log would make it).
        for negative in ["-1", "-1000"] {
            assert!(parse_offset(negative).unwrap_err().contains(negative));
        }
        assert!(matches!(parse_offset("0"), Ok(Target::Offset(0))));
        assert!(parse_time("1969-12-31T23:59:59Z").is_err());
        assert!(matches!(
            parse_time("1970-01-01T00:00:00Z"),
            Ok(Target::Time(0))
        ));
        assert!(
            matches!(parse_time("2026-11-30T08:00:00Z"), Ok(Target::Time(t)) if t == 1_796_025_600_000)
        );
        assert!(parse_time("yesterday").is_err());
    }
}
