//! `GET /v1/events`: a pull subscription's events, read from `<prefix>.pull` at a cursor.
//!
//! The hub task writes each event matched by a pull subscription to `<prefix>.pull` with key =
//! subscription id (inside its transaction, so readers see it once committed), which puts all of
//! one subscription's events in one partition, in arrival order. A cursor is that partition and
//! the next offset to read, encoded opaquely; it is state of the client only, so it survives
//! restarts and any instance serves it, and an old cursor reads the same events again.
//!
//! A read scans at most [`SCAN_CAP`] records of the partition (other subscriptions share it) for
//! up to `limit` events of this subscription, and returns the cursor after the last record it
//! scanned: a page can be empty with a cursor that moved on.
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use crate::config::Config;
use crate::dispatch::H_SEQUENCE;
use crate::runtime::kafka;

/// Most records one request scans.
pub const SCAN_CAP: usize = 20_000;
/// Longest one request reads.
const READ_BUDGET: Duration = Duration::from_secs(3);
/// Payload bytes past which a page ends (the event that crosses it is the page's last): a page
/// of 500 events of a megabyte each would hold half a gigabyte in memory, twice over while it is
/// written as JSON.
pub const PAGE_BYTES: usize = 8 * 1024 * 1024;
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("invalid cursor")]
    BadCursor,
    #[error("kafka: {0}")]
    Kafka(String),
}

/// One event as a pull client sees it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PulledEvent {
    pub id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    pub source: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    pub time: String,
    pub tenant_id: String,
    pub schema_version: String,
    /// The tenant's arrival sequence number.
    pub sequence: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub datacontenttype: Option<String>,
    /// The payload as JSON, when its content type is JSON and it parses: its text as the
    /// producer wrote it (checked, not parsed into a tree, so a page holds about its payloads'
    /// bytes however dense their JSON).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub data: Option<Box<serde_json::value::RawValue>>,
    /// The payload bytes in base64, otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
}

/// A page of events and where the next one starts.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct EventPage {
    pub events: Vec<PulledEvent>,
    /// Pass it as `cursor` to read on; reading with an older cursor reads the same events again.
    pub next_cursor: String,
    /// How far retention had moved past the cursor given: the offsets of the subscription's pull
    /// partition deleted between it and the oldest record kept, where the page starts (the
    /// events of every subscription sharing the partition count, and transaction markers). Some
    /// of this subscription's events may have been among them, and are gone. Absent when
    /// nothing was: a client that reads at least once per retention (`7d`) never sees it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_offsets: Option<u64>,
}

/// Pull reads whose cursor pointed before the oldest record kept (see
/// [`EventPage::skipped_offsets`]).
pub const CURSOR_GAPS: &str = "streaming_hub_pull_cursor_gaps_total";

/// A position in `<prefix>.pull`, and whose it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub partition: i32,
    pub offset: i64,
    /// A tag of the subscription it was answered for ([`subscription_tag`]); None in a cursor
    /// of an earlier version (`v1`), which named the partition alone.
    pub subscription: Option<u32>,
}

/// A short tag of a subscription id, carried in its cursors: a tenant's subscriptions share a
/// partition (one in six pairs, with six), so the partition alone let one subscription's cursor
/// read another's events from a place in the wrong one, skipping or repeating them silently.
pub fn subscription_tag(subscription: &str) -> u32 {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(subscription.as_bytes());
    u32::from_be_bytes([d[0], d[1], d[2], d[3]])
}

impl Cursor {
    pub fn encode(&self) -> String {
        let text = match self.subscription {
            Some(tag) => format!("v2:{}:{}:{tag:08x}", self.partition, self.offset),
            None => format!("v1:{}:{}", self.partition, self.offset),
        };
        URL_SAFE_NO_PAD.encode(text)
    }

    pub fn decode(text: &str) -> Result<Cursor, PullError> {
        let raw = URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| PullError::BadCursor)?;
        let raw = String::from_utf8(raw).map_err(|_| PullError::BadCursor)?;
        let parts: Vec<&str> = raw.split(':').collect();
        let (p, o, subscription) = match parts[..] {
            ["v1", p, o] => (p, o, None),
            ["v2", p, o, tag] if tag.len() == 8 => (
                p,
                o,
                Some(u32::from_str_radix(tag, 16).map_err(|_| PullError::BadCursor)?),
            ),
            _ => return Err(PullError::BadCursor),
        };
        let partition = p.parse().map_err(|_| PullError::BadCursor)?;
        let offset = o.parse().map_err(|_| PullError::BadCursor)?;
        if partition < 0 || offset < 0 {
            return Err(PullError::BadCursor);
        }
        Ok(Cursor {
            partition,
            offset,
            subscription,
        })
    }

    /// Whether it was answered for `subscription`, whose events are in `partition` (a cursor of
    /// an earlier version is judged by its partition alone).
    pub fn belongs_to(&self, subscription: &str, partition: i32) -> bool {
        self.partition == partition
            && self
                .subscription
                .is_none_or(|tag| tag == subscription_tag(subscription))
    }
}

/// Reads `<prefix>.pull`.
#[derive(Clone)]
pub struct PullReader {
    config: Config,
    topic: String,
}

impl PullReader {
    pub fn new(config: &Config) -> PullReader {
        PullReader {
            config: config.clone(),
            topic: format!("{}.pull", config.topic_prefix),
        }
    }

    /// Up to `limit` events of `subscription`, a subscription of `tenant`, from `cursor` (from
    /// the subscription's creation when none). Blocking: call it off the async runtime.
    ///
    /// Only records of `tenant` are returned: a cursor is the client's (it can be made up), and
    /// an id once another tenant's (deleted, then applied for this one) keys that tenant's
    /// events in the same partition.
    pub fn read(
        &self,
        subscription: &str,
        tenant: &str,
        created_at_ms: i64,
        cursor: Option<Cursor>,
        limit: usize,
    ) -> Result<EventPage, PullError> {
        let k = |e: RdKafkaError| PullError::Kafka(e.to_string());
        let consumer: BaseConsumer<kafka::ReaderContext> = kafka::base(&self.config)
            .set("group.id", format!("{}.pull-reader", self.config.group_id))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("enable.partition.eof", "true")
            .set("fetch.wait.max.ms", "50")
            // One request reads one partition and at most a page: no 64 MiB prefetch each.
            .set("queued.max.messages.kbytes", "16384")
            .set("max.partition.fetch.bytes", "4194304")
            // An offset the topic no longer holds reads on from its oldest record.
            .set("auto.offset.reset", "earliest")
            .create_with_context(kafka::ReaderContext)
            .map_err(k)?;
        let partitions = kafka::partition_ids(&consumer, &self.topic, TIMEOUT)
            .map_err(|e| PullError::Kafka(e.to_string()))?
            .len() as i32;
        let partition = super::partition_for(subscription.as_bytes(), partitions);
        let (low, high) = consumer
            .fetch_watermarks(&self.topic, partition, TIMEOUT)
            .map_err(k)?;
        let mut skipped_offsets = None;
        let start = match cursor {
            Some(c) if !c.belongs_to(subscription, partition) => return Err(PullError::BadCursor),
            // Older than the topic's retention: told (see `EventPage::skipped_offsets`).
            Some(c) if c.offset < low => {
                let gap = (low - c.offset) as u64;
                metrics::counter!(CURSOR_GAPS).increment(1);
                tracing::warn!(
                    subscription_id = subscription,
                    partition,
                    cursor_offset = c.offset,
                    oldest_kept = low,
                    skipped_offsets = gap,
                    "pull cursor older than the topic's retention: the records deleted past it are gone; the page starts at the oldest kept"
                );
                skipped_offsets = Some(gap);
                low.min(high.max(low))
            }
            // One past the end (a truncated log, a forged cursor) waits at the end. (One older
            // than the topic's retention, above, reads on from the oldest event kept: what was
            // deleted is gone, and an empty page at the old cursor would never move on. Retention
            // moving on between the ends asked above and the read goes unsaid.)
            Some(c) => c.offset.min(high.max(low)),
            None => {
                // Nothing of this subscription precedes its creation (a minute of margin for
                // clocks). A creation time ahead of the wall clock (the test clock) proves
                // nothing: then from the start of the partition.
                let wall = chrono::Utc::now().timestamp_millis();
                if created_at_ms > wall {
                    low
                } else {
                    let mut tpl = TopicPartitionList::new();
                    tpl.add_partition_offset(
                        &self.topic,
                        partition,
                        Offset::Offset(created_at_ms.saturating_sub(60_000).max(0)),
                    )
                    .map_err(k)?;
                    let found = consumer.offsets_for_times(tpl, TIMEOUT).map_err(k)?;
                    kafka::offset_for_time(&found, &self.topic, partition)
                        .map_err(k)?
                        .unwrap_or(high)
                }
            }
        };
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, partition, Offset::Offset(start))
            .map_err(k)?;
        consumer.assign(&tpl).map_err(k)?;
        let mut events = Vec::new();
        let mut next = start;
        let mut scanned = 0usize;
        let mut page_bytes = 0usize;
        let deadline = Instant::now() + READ_BUDGET;
        while events.len() < limit
            && scanned < SCAN_CAP
            && page_bytes < PAGE_BYTES
            && Instant::now() < deadline
        {
            match consumer.poll(deadline.saturating_duration_since(Instant::now())) {
                None => break,
                Some(Err(RdKafkaError::PartitionEOF(_))) => break,
                Some(Err(e)) => return Err(k(e)),
                Some(Ok(m)) => {
                    scanned += 1;
                    next = m.offset() + 1;
                    if m.key() == Some(subscription.as_bytes())
                        && header_is(&m, "ce-tenantid", tenant)
                    {
                        page_bytes += m.payload_len();
                        events.push(event_of(&m));
                    }
                }
            }
        }
        Ok(EventPage {
            events,
            next_cursor: Cursor {
                partition,
                offset: next,
                subscription: Some(subscription_tag(subscription)),
            }
            .encode(),
            skipped_offsets,
        })
    }
}

/// Whether the record's header `name` (exactly that name, as ingest judged it) is `value`.
fn header_is(
    m: &impl Message<Headers = rdkafka::message::BorrowedHeaders>,
    name: &str,
    value: &str,
) -> bool {
    m.headers().is_some_and(|h| {
        crate::runtime::kafka::utf8_headers(h)
            .find(|(key, _)| *key == name)
            .and_then(|(_, v)| v)
            == Some(value.as_bytes())
    })
}

fn event_of(m: &impl Message<Headers = rdkafka::message::BorrowedHeaders>) -> PulledEvent {
    let header = |name: &str| -> Option<String> {
        m.headers().and_then(|h| {
            crate::runtime::kafka::utf8_headers(h)
                // Exactly the names ingest judged: a `CE-ID` it carried as an ordinary header
                // must not stand in for the `ce-id` it checked.
                .find(|(key, _)| *key == name)
                .and_then(|(_, value)| value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
    };
    let payload = m.payload().unwrap_or_default();
    let (content_type, data, data_base64) = data_of(header("ce-datacontenttype"), payload);
    PulledEvent {
        id: header("ce-id").unwrap_or_default(),
        event_type: header("ce-type").unwrap_or_default(),
        source: header("ce-source").unwrap_or_default(),
        subject: header("ce-subject"),
        time: header("ce-time").unwrap_or_default(),
        tenant_id: header("ce-tenantid").unwrap_or_default(),
        schema_version: header("ce-schemaversion").unwrap_or_default(),
        sequence: header(H_SEQUENCE).and_then(|s| s.parse().ok()),
        datacontenttype: content_type,
        data_base64,
        data,
    }
}

/// An event's content type and data as a pull page shows them: `data` as JSON when the content
/// type is JSON and the payload parses, else `data_base64`. An event without
/// `ce-datacontenttype` is `application/json` (DESIGN.md §6), as its webhook deliveries say.
fn data_of(
    content_type: Option<String>,
    payload: &[u8],
) -> (
    Option<String>,
    Option<Box<serde_json::value::RawValue>>,
    Option<String>,
) {
    let content_type = content_type.unwrap_or_else(|| "application/json".to_string());
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    // Parsed in full first (and dropped): only JSON every strict parser reads goes out as
    // `data` (no lone surrogate, no number out of range, nesting within serde_json's limit), as
    // before; then carried as its text, so a page holds one tree at a time, not all of them.
    let data = if (essence == "application/json" || essence.ends_with("+json"))
        && serde_json::from_slice::<serde_json::Value>(payload).is_ok()
    {
        serde_json::from_slice::<Box<serde_json::value::RawValue>>(payload).ok()
    } else {
        None
    };
    let data_base64 = data.is_none().then(|| STANDARD.encode(payload));
    (Some(content_type), data, data_base64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_without_a_content_type_is_json() {
        let text = |d: Option<Box<serde_json::value::RawValue>>| d.map(|d| d.get().to_string());
        let (ct, data, b64) = data_of(None, br#"{"amount":1}"#);
        assert_eq!(ct.as_deref(), Some("application/json"));
        assert_eq!(text(data).as_deref(), Some(r#"{"amount":1}"#));
        assert_eq!(b64, None);
        let (ct, data, b64) = data_of(
            Some("application/cloudevents+json; charset=utf-8".into()),
            b"[1]",
        );
        assert_eq!(
            ct.as_deref(),
            Some("application/cloudevents+json; charset=utf-8")
        );
        assert_eq!((text(data).as_deref(), b64), (Some("[1]"), None));
        let (_, data, b64) = data_of(Some("application/octet-stream".into()), b"{}");
        assert_eq!((text(data), b64.as_deref()), (None, Some("e30=")));
        let (_, data, b64) = data_of(None, b"not json");
        assert_eq!((text(data), b64.as_deref()), (None, Some("bm90IGpzb24=")));
        // JSON is carried as written (its spacing and key order), not as a tree.
        let (_, data, _) = data_of(None, br#" {"b": 1,  "a": [0, 0]} "#);
        assert_eq!(text(data).as_deref(), Some(r#"{"b": 1,  "a": [0, 0]}"#));
        // What a strict parser refuses goes as base64, as before.
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for bad in [r#"{"a":"\ud800"}"#, "1e400", deep.as_str()] {
            let (_, data, b64) = data_of(None, bad.as_bytes());
            assert!(text(data).is_none() && b64.is_some(), "{bad}");
        }
    }

    #[test]
    fn cursors_round_trip_and_garbage_is_refused() {
        let c = Cursor {
            partition: 3,
            offset: 42,
            subscription: Some(subscription_tag("sub-a")),
        };
        assert_eq!(Cursor::decode(&c.encode()).unwrap(), c);
        assert!(c.belongs_to("sub-a", 3));
        assert!(
            !c.belongs_to("sub-b", 3),
            "another subscription's, same partition"
        );
        assert!(!c.belongs_to("sub-a", 4));
        // An earlier version's cursor: its partition alone.
        let old = Cursor::decode(&URL_SAFE_NO_PAD.encode("v1:3:42")).unwrap();
        assert_eq!(old.subscription, None);
        assert!(old.belongs_to("sub-b", 3));
        for bad in [
            "",
            "!!",
            "djE6Mzpmb28",
            &URL_SAFE_NO_PAD.encode("v2:1:2"),
            &URL_SAFE_NO_PAD.encode("v2:1:2:zzzzzzzz"),
            &URL_SAFE_NO_PAD.encode("v2:1:2:abc"),
            &URL_SAFE_NO_PAD.encode("v3:1:2"),
            &URL_SAFE_NO_PAD.encode("v1:-1:2"),
            &URL_SAFE_NO_PAD.encode("v1:1:2:3"),
        ] {
            assert!(Cursor::decode(bad).is_err(), "{bad}");
        }
    }
}
