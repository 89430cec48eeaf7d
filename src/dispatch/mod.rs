//! Dispatch: from a matched event to a delivery, at least once.
//!
//! - `jobs`: one job per (event, webhook subscription) and the event's payload stored once, in the
//!   hub task's store, with per-tenant timers; claims and outcomes change them inside the hub
//!   task's transaction;
//! - `curve`: when a failed delivery is tried again;
//! - `health`: failure spans per subscription and auto-disable;
//! - `breaker`: per (tenant, destination) circuit breakers that shed due jobs of a failing sink;
//! - `worker`: one HTTP attempt per claim, on the async runtime, bounded by
//!   `STREAMING_HUB_DISPATCH_WORKERS`.
//!
//! [`DispatchJobs`] is the hub task's event handler: matched pull subscriptions get the event on
//! `<prefix>.pull` (key = subscription id), matched webhook subscriptions get a job.
pub mod breaker;
pub mod curve;
pub mod fair;
pub mod health;
pub mod jobs;
pub mod pace;
pub mod worker;

use rdkafka::message::Message;

use crate::delivery::trace_context;
use crate::hub::matching::matches_for;
use crate::hub::task::{EventHandler, Fresh, HubError, SequencedEvent, TaskCtx};
use crate::ingest::classify::CE_HEADER_ESCAPED;
use crate::runtime::{fast_avro, kafka};
use std::sync::Arc;

use crate::runtime::records::{
    DestinationType, EventPayloadRecord, JobRecord, JobState, VerificationState,
};
use crate::runtime::store::FastMap;
use crate::runtime::telemetry::{Matched, Redelivery};
use crate::subscriptions::table::{SharedTable, Sub};
use std::cell::RefCell;

/// Header added to records on `<prefix>.pull`: the tenant's arrival sequence of the event.
pub const H_SEQUENCE: &str = "x-streaming-hub-sequence";

/// Creates jobs (webhooks) and pull records (pull destinations) for matched events.
pub struct DispatchJobs {
    pub table: SharedTable,
    pub pull_topic: String,
    /// The subscriptions each record of the batch being filled matched when it was weighed
    /// (by inbox partition and offset), for its `on_event`: matching each record twice was 5% of
    /// the hub loop's time under load. Emptied when the next batch starts filling, so an event is
    /// never matched against a table older than its batch.
    matched: RefCell<FastMap<(i32, i64), Vec<Sub>>>,
}

impl DispatchJobs {
    pub fn new(table: SharedTable, pull_topic: String) -> DispatchJobs {
        DispatchJobs {
            table,
            pull_topic,
            matched: RefCell::default(),
        }
    }
}

impl EventHandler for DispatchJobs {
    fn on_event(
        &mut self,
        event: &SequencedEvent<'_>,
        ctx: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        let weighed = self
            .matched
            .get_mut()
            .remove(&(event.partition, event.offset));
        let subs = weighed.unwrap_or_else(|| matches_for(&self.table, event.tenant, event.record));
        Matched {
            ce_id: event.ce_id,
            tenant: event.tenant,
            subscriptions: subs.len(),
        }
        .emit();
        if subs.is_empty() {
            return Ok(());
        }
        let record = event.record;
        let mut created = 0u32;
        // Every job holds its event's payload: with no payload stored, no job of this event
        // exists, and its jobs are created without looking each one up first (a point read per
        // job, ten per event in a ten-subscription fan-out). The payload's bytes go on to
        // `hold_payload`, which would read them otherwise.
        let stored = if subs
            .iter()
            .any(|s| s.destination.kind == DestinationType::Webhook)
        {
            let key = jobs::payload_key(event.tenant, event.ce_id);
            Some(ctx.jobs().get_raw(&key).map_err(HubError::from)?)
        } else {
            None
        };
        let unseen = matches!(stored, Some(None));
        for sub in &subs {
            match sub.destination.kind {
                DestinationType::Pull => {
                    let seq = event.sequence.to_string();
                    let mut headers: Vec<(&str, Option<&[u8]>)> = record
                        .headers()
                        .map(|h| kafka::utf8_headers(h).collect())
                        .unwrap_or_default();
                    headers.push((H_SEQUENCE, Some(seq.as_bytes())));
                    ctx.out.send_with_headers(
                        &self.pull_topic,
                        None,
                        sub.id.as_bytes(),
                        record.payload(),
                        &headers,
                    )?;
                }
                DestinationType::Webhook => {
                    if create_job(ctx, event, &sub.id, !unseen, ctx.now)? {
                        created += 1;
                    }
                }
            }
        }
        hold_payload(ctx, event, created, stored)
    }

    fn weight(&self, record: &rdkafka::message::BorrowedMessage<'_>) -> usize {
        let Some(tenant) = record.key().and_then(|k| std::str::from_utf8(k).ok()) else {
            return 0;
        };
        if record.headers().is_some_and(|h| {
            kafka::utf8_headers(h).any(|(key, _)| key == crate::ops::redeliver::H_REDELIVER)
        }) {
            return 1;
        }
        let subs = matches_for(&self.table, tenant, record);
        // A pull subscription's copy carries the payload and headers into the transaction as a
        // job does: counted alike (uncounted, one event matched by hundreds of pull
        // subscriptions put hundreds of payload copies in one transaction, whatever the bound).
        let jobs = subs.len();
        self.matched
            .borrow_mut()
            .insert((record.partition(), record.offset()), subs);
        jobs
    }

    fn batch_started(&self) {
        self.matched.borrow_mut().clear();
    }

    fn on_redeliver(
        &mut self,
        event: &SequencedEvent<'_>,
        subscription_id: &str,
        ctx: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        let sub = self.table.read().get(subscription_id);
        let skipped = match &sub {
            Some(s) if s.tenant_id != event.tenant => Some("other_tenant"),
            Some(s) if s.destination.kind != DestinationType::Webhook => Some("not_a_webhook"),
            _ => None,
        };
        // Unknown here, or not enabled and active: the API took the request because its table,
        // read to the control topic's end, had the subscription active, and this loop's table
        // may not have read that record yet (a verify, then a recover, each answered a moment
        // ago by another instance); dropped, the recover was lost though answered. So the job is
        // made due a little later and judged then as any due job is: sent if the subscription is
        // active by then, held while its verification is pending, dead-lettered again
        // (`subscription_disabled`) if it is still disabled, dropped if it was deleted.
        let active = sub
            .as_ref()
            .is_some_and(|s| s.enabled && s.verification_state == VerificationState::Active);
        let due_at = match active {
            true => ctx.now,
            false => ctx.now.saturating_add(REDELIVERY_RECHECK_MS),
        };
        let outcome = match skipped {
            Some(why) => why,
            None => match create_job(ctx, event, subscription_id, true, due_at)? {
                false => "pending",
                true => {
                    hold_payload(ctx, event, 1, None)?;
                    if active { "queued" } else { "deferred" }
                }
            },
        };
        Redelivery {
            ce_id: event.ce_id,
            subscription_id,
            outcome,
        }
        .emit();
        Ok(())
    }
}

/// How long a redelivery for a subscription this loop's table does not show active waits before
/// it is judged (see `on_redeliver`): the API waits up to 5 s for its own table, and a reader
/// that lags more than that is an outage of its own.
const REDELIVERY_RECHECK_MS: i64 = 10_000;

/// A new job for (event, subscription), due at `due_at`; false when that job exists already (a
/// replay or redelivery while the first delivery is still pending). `check`: look for it first
/// (false only when the event has no stored payload, so no job either).
fn create_job(
    ctx: &mut TaskCtx<'_, '_>,
    event: &SequencedEvent<'_>,
    subscription_id: &str,
    check: bool,
    due_at: i64,
) -> Result<bool, HubError> {
    let key = jobs::job_key(event.tenant, event.ce_id, subscription_id);
    let now = ctx.now;
    // Read again where its previous owner may have died mid-attempt (see `TaskCtx::recount`).
    let reclaims = u32::from(ctx.recount);
    let early = !check && !ctx.careful;
    let mut js = ctx.jobs();
    if check && js.get_job(&key).map_err(HubError::from)?.is_some() {
        return Ok(false);
    }
    let job = JobRecord {
        event_key: event.ce_id.to_string(),
        subscription_id: subscription_id.to_string(),
        tenant_id: event.tenant.to_string(),
        attempt: 1,
        due_at,
        lease_until: None,
        reclaims,
        last_status: None,
        last_error: None,
        state: JobState::Pending,
    };
    js.put_job(&key, &job, None).map_err(HubError::from)?;
    if due_at > now {
        return Ok(true); // its timer brings it
    }
    ctx.fresh.push(Fresh {
        key,
        batch_index: event.batch_index,
        // Unchecked: the event has no stored payload, so none of its keys is stored.
        early,
    });
    Ok(true)
}

/// Stores the event's payload for `created` new jobs (once per event) and arms its tenant's timers.
/// `stored`: the payload's stored bytes when the caller read them already (`Some(None)`: none).
fn hold_payload(
    ctx: &mut TaskCtx<'_, '_>,
    event: &SequencedEvent<'_>,
    created: u32,
    stored: Option<Option<Vec<u8>>>,
) -> Result<(), HubError> {
    if created == 0 {
        return Ok(());
    }
    let record = event.record;
    let codec = ctx.codec;
    let value = record.payload().unwrap_or_default();
    // Indexed, so the encoder knows the header count up front (the array's block count).
    let encode = |refcount| match record.headers() {
        Some(h) => {
            let pairs: Vec<_> = kafka::utf8_headers(h).collect();
            fast_avro::encode_payload(codec, pairs.into_iter(), value, refcount)
        }
        None => fast_avro::encode_payload(codec, std::iter::empty(), value, refcount),
    };
    ctx.jobs()
        .hold_payload(
            jobs::payload_key(event.tenant, event.ce_id),
            stored,
            encode,
            created,
        )
        .map_err(HubError::from)?;
    ctx.ring.add(event.tenant);
    Ok(())
}

/// Most `ce-*` headers an attempt sends: ingest quarantines a record with more headers than this
/// (`headers_too_large`), so only a record written to the inbox around it has more, and an HTTP
/// header map panics past 32,768 entries.
const MAX_CE_HEADERS: usize = 256;

/// What an attempt sends of its event: its `ce-*` headers, `<resource>.<event>` type, body and
/// ingest time. Read once per event and shared by the attempts of its jobs (a fan-out event's
/// claims in one transaction share one), from the inbox record when the job was created in the
/// same transaction, else from the stored payload. The headers are parsed into HTTP header names
/// and values here, once per event: each attempt parsed and validated every one again (a few
/// per cent of the workers' CPU under load).
#[derive(Clone, Debug)]
pub struct EventView {
    /// `<resource>.<event>`, as `X-Lerian-Event-Type` sends it.
    pub event_type: reqwest::header::HeaderValue,
    /// `ce-*` headers of the event, in order, except `ce-datacontenttype` (sent as the
    /// `Content-Type`), values percent-encoded ([`CE_HEADER_ESCAPED`]). Ingest quarantines what
    /// could not go on the wire (a value that is not UTF-8, a name HTTP does not allow); such a
    /// header in a record that bypassed it is left out.
    pub ce_headers: Arc<[(reqwest::header::HeaderName, reqwest::header::HeaderValue)]>,
    /// `ce-datacontenttype` (the last one), else `application/json`.
    pub content_type: reqwest::header::HeaderValue,
    /// The producer's `traceparent` and `tracestate`, those forwarded ([`trace_context`]).
    pub trace: trace_context::TraceContext,
    pub body: bytes::Bytes,
    /// When ingest accepted the event (hub clock, ms): the delivery latency histogram's origin.
    /// None for a redelivery (a recover, a redrive, a replay): its time since ingest is when an
    /// operator asked for it again, not the hub's latency, and a replay of last week's events
    /// would fill the histogram's top with days.
    pub ingest_ms: Option<i64>,
}

impl EventView {
    pub fn new<'h>(
        headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
        body: bytes::Bytes,
    ) -> EventView {
        let mut ce_headers = Vec::new();
        let mut content_type = None;
        let (mut resource, mut event, mut ingest) = (None, None, None);
        let mut redelivery = false;
        let mut trace = trace_context::TraceHeaders::default();
        for (key, value) in headers {
            trace.add(key, value);
            let text = value.and_then(|v| std::str::from_utf8(v).ok());
            match key {
                "ce-resourcetype" => {
                    resource.get_or_insert(text.unwrap_or(""));
                }
                "ce-eventtype" => {
                    event.get_or_insert(text.unwrap_or(""));
                }
                crate::ingest::pipeline::H_INGEST_TIME => {
                    ingest.get_or_insert(text);
                }
                crate::ops::redeliver::H_REDELIVER => redelivery = true,
                _ => {}
            }
            let (true, Some(v)) = (key.starts_with("ce-"), text) else {
                continue;
            };
            if key == "ce-datacontenttype" {
                // A media type, sent as the `Content-Type` as it is.
                if let Ok(v) = reqwest::header::HeaderValue::from_str(v) {
                    content_type = Some(v);
                }
                continue;
            }
            let v: std::borrow::Cow<str> =
                percent_encoding::utf8_percent_encode(v, CE_HEADER_ESCAPED).into();
            let (Ok(k), Ok(v)) = (
                reqwest::header::HeaderName::from_bytes(key.as_bytes()),
                reqwest::header::HeaderValue::from_str(&v),
            ) else {
                continue;
            };
            if ce_headers.len() < MAX_CE_HEADERS {
                ce_headers.push((k, v));
            }
        }
        // Percent-encoded as the `ce-*` values are: a name ingest took with a non-ASCII letter
        // (`transação`) went out as raw UTF-8 bytes, which HTTP stacks read as Latin-1, and
        // differently from the same name in `ce-type`.
        let event_type = format!("{}.{}", resource.unwrap_or(""), event.unwrap_or(""));
        let event_type: std::borrow::Cow<str> =
            percent_encoding::utf8_percent_encode(&event_type, CE_HEADER_ESCAPED).into();
        EventView {
            event_type: reqwest::header::HeaderValue::from_str(&event_type)
                .unwrap_or_else(|_| reqwest::header::HeaderValue::from_static(".")),
            ce_headers: ce_headers.into(),
            content_type: content_type
                .unwrap_or_else(|| reqwest::header::HeaderValue::from_static("application/json")),
            trace: trace.forwarded(),
            body,
            ingest_ms: ingest
                .filter(|_| !redelivery)
                .flatten()
                .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
                .map(|t| t.timestamp_millis()),
        }
    }

    /// From an inbox record.
    pub fn of_record(record: &rdkafka::message::BorrowedMessage<'_>) -> EventView {
        let body = bytes::Bytes::copy_from_slice(record.payload().unwrap_or_default());
        match record.headers() {
            Some(h) => EventView::new(kafka::utf8_headers(h), body),
            None => EventView::new(std::iter::empty(), body),
        }
    }

    /// From a stored payload.
    pub fn of_payload(payload: EventPayloadRecord) -> EventView {
        EventView::new(
            payload
                .headers
                .iter()
                .map(|h| (h.key.as_str(), h.value.as_deref())),
            bytes::Bytes::from(payload.value),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::records::HeaderRecord;
    use reqwest::header::HeaderValue;

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn header(key: &str, value: Option<&[u8]>) -> HeaderRecord {
        HeaderRecord {
            key: key.into(),
            value: value.map(<[u8]>::to_vec),
        }
    }

    #[test]
    fn an_event_view_reads_the_same_from_a_record_and_from_its_stored_payload() {
        let headers = vec![
            header("ce-id", Some(b"0193-id")),
            header("ce-resourcetype", Some(b"transaction")),
            header("ce-eventtype", Some(b"created")),
            header("ce-binary", Some(&[0xff, 0xfe])), // not UTF-8: not sent
            header("ce-subject", None),
            header("ce-datacontenttype", Some(b"application/xml")),
            header("ce-datacontenttype", Some(b"text/plain")), // the last one counts
            header("ce-title", Some(b"two\nlines")),           // encoded, as any control
            header(
                "ce-subject",
                Some("conta 7 \u{2013} Jo\u{e3}o \"50%\"".as_bytes()),
            ),
            header("ce-bad name", Some(b"x")), // not a valid header name: not sent
            header("x-other", Some(b"kept out")),
            header("traceparent", Some(TRACEPARENT.as_bytes())), // forwarded on its own
            header("tracestate", Some(b"rojo=00f067aa0ba902b7")),
            header("ce-eventtype", Some(b"second")), // repeated: the first counts
            header(
                crate::ingest::pipeline::H_INGEST_TIME,
                Some(b"2026-12-01T10:00:00.250Z"),
            ),
        ];
        let from_record = EventView::new(
            headers.iter().map(|h| (h.key.as_str(), h.value.as_deref())),
            bytes::Bytes::from_static(b"{\"amount\":1}"),
        );
        let from_payload = EventView::of_payload(EventPayloadRecord {
            headers: headers.clone(),
            value: b"{\"amount\":1}".to_vec(),
            refcount: 2,
        });
        for v in [&from_record, &from_payload] {
            assert_eq!(v.event_type, "transaction.created");
            let sent: Vec<(&str, &str)> = v
                .ce_headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
                .collect();
            assert_eq!(
                sent,
                [
                    ("ce-id", "0193-id"),
                    ("ce-resourcetype", "transaction"),
                    ("ce-eventtype", "created"),
                    ("ce-title", "two%0Alines"),
                    (
                        "ce-subject",
                        "conta%207%20%E2%80%93%20Jo%C3%A3o%20%2250%25%22"
                    ),
                    ("ce-eventtype", "second"),
                ]
            );
            assert_eq!(v.content_type, "text/plain");
            assert_eq!(
                (v.trace.traceparent.clone(), v.trace.tracestate.clone()),
                (
                    Some(HeaderValue::from_static(TRACEPARENT)),
                    Some(HeaderValue::from_static("rojo=00f067aa0ba902b7"))
                )
            );
            assert_eq!(v.body.as_ref(), b"{\"amount\":1}");
            assert_eq!(v.ingest_ms, Some(1_796_119_200_250));
        }
        // A redelivery keeps the event's headers, its ingest time too, but is not timed from it.
        let mut redelivered = headers.clone();
        redelivered.push(header(crate::ops::redeliver::H_REDELIVER, Some(b"sub-1")));
        let v = EventView::new(
            redelivered
                .iter()
                .map(|h| (h.key.as_str(), h.value.as_deref())),
            bytes::Bytes::new(),
        );
        assert_eq!(v.ingest_ms, None);
        let bare = EventView::new(std::iter::empty(), bytes::Bytes::new());
        assert_eq!(bare.event_type, ".");
        assert_eq!(bare.content_type, "application/json");
        assert_eq!(bare.ingest_ms, None);
        assert_eq!(bare.trace, trace_context::TraceContext::default());
    }

    #[test]
    fn an_event_type_with_spaces_or_non_ascii_letters_is_sent_percent_encoded() {
        let v = EventView::new(
            [
                ("ce-resourcetype", Some("transação".as_bytes())),
                ("ce-eventtype", Some("paga mento".as_bytes())),
            ],
            bytes::Bytes::new(),
        );
        assert_eq!(v.event_type, "transa%C3%A7%C3%A3o.paga%20mento");
    }
}
