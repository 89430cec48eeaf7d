//! Workers: each claimed job becomes exactly one HTTP request (DESIGN.md §4), run on the async
//! runtime, at most `STREAMING_HUB_DISPATCH_WORKERS` at a time; its [`Outcome`] goes back to the
//! hub thread, which records it in its next transaction.
//!
//! The request: POST, body = the event's payload bytes unchanged, `Content-Type` =
//! `ce-datacontenttype`, every `ce-*` attribute as a header (CloudEvents HTTP binary mode),
//! `X-Lerian-Event-Id` (= `ce-id`), `X-Lerian-Delivery-Id` (a new UUIDv7 per attempt),
//! `X-Lerian-Event-Type` (`<resource>.<event>`), `X-Lerian-Attempt`, the producer's W3C
//! `traceparent` and `tracestate` when well formed (see [`crate::delivery::trace_context`]), the
//! destination's custom headers (sensitive ones decrypted in memory only), and the Standard
//! Webhooks headers:
//! `webhook-id` (= `ce-id`, stable across retries), `webhook-timestamp`, `webhook-signature` with
//! every secret still valid (two during a rotation). 2xx = success; anything else, a timeout, a
//! redirect or a refused connection = failure. A panic inside an attempt is caught and reported
//! as such (the job is reclaimed, never the process killed).
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::Instant;

use futures::FutureExt;
use reqwest::header::{CONTENT_TYPE, HeaderName, HeaderValue};

use crate::delivery::{client, signing};
use crate::dispatch::fair::FairPermits;
use crate::ingest::classify::CE_HEADER_ESCAPED;
use crate::runtime::clock::SharedClock;
use crate::runtime::secret::Secret;
use crate::subscriptions::model::is_reserved_header;
use crate::subscriptions::sealed_url;
use crate::subscriptions::secrets::{
    Kek, NotSent, headers_not_sent, reserved_header_dropped, secret_unopened, url_unopened,
};
use crate::subscriptions::table::Sub;

/// `Outcome::error_kind` of an attempt given up before it was sent (see [`Outcome::not_attempted`]).
pub const NOT_ATTEMPTED: &str = "not_attempted";

/// Response bytes kept in the attempt record.
pub const BODY_CAP: usize = 64 * 1024;
const KEPT_IN_RECORD: usize = 1024;

// The headers every attempt carries besides the event's (DESIGN.md, "Contract with subscribers").
const X_LERIAN_EVENT_ID: HeaderName = HeaderName::from_static("x-lerian-event-id");
const X_LERIAN_DELIVERY_ID: HeaderName = HeaderName::from_static("x-lerian-delivery-id");
const X_LERIAN_EVENT_TYPE: HeaderName = HeaderName::from_static("x-lerian-event-type");
const X_LERIAN_ATTEMPT: HeaderName = HeaderName::from_static("x-lerian-attempt");
const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// One claimed job, ready to send.
pub struct Attempt {
    pub partition: i32,
    pub job_key: Vec<u8>,
    pub attempt: u32,
    pub lease_until: i64,
    pub event_id: String,
    pub tenant: String,
    pub subscription: Sub,
    /// Headers, type, body and ingest time of the event.
    pub event: crate::dispatch::EventView,
    /// When the claim found this job its payload's only holder: the payload holds count then
    /// ([`jobs::payload_holds`](crate::dispatch::jobs::payload_holds)); else None.
    pub sole_payload: Option<u64>,
    /// Whether its tenant's attempts hold a worker far longer than the loop's do, or are not
    /// timed yet (`Pace::holds_long`): the pool then keeps room for the others' recent demand.
    pub holds_long: bool,
}

/// What happened to one attempt.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub partition: i32,
    pub job_key: Vec<u8>,
    pub attempt: u32,
    pub lease_until: i64,
    pub delivery_id: String,
    pub started_at: i64,
    pub latency_ms: u64,
    pub status: Option<u16>,
    /// None on success.
    pub error_kind: Option<String>,
    pub retry_after_ms: Option<u64>,
    pub response_body: Option<Vec<u8>>,
    pub ingest_ms: Option<i64>,
    pub tenant: String,
    /// The attempt's [`Attempt::sole_payload`].
    pub sole_payload: Option<u64>,
    /// The size of the event body the attempt held (the hub bounds the bytes claimed ahead).
    pub body_bytes: usize,
    /// The destination URL of the attempt (its subscription's when it was claimed): the breaker
    /// the outcome counts for, even if the subscription has moved to another URL since.
    pub url: Option<String>,
    /// The nonce of the URL's sealed target, if any (sealed again on every change of the URL):
    /// with `url`, which URL the attempt went to, without its credentials in plaintext.
    pub target_nonce: Option<[u8; 12]>,
}

/// [`Outcome::target_nonce`] of a destination (no allocation per attempt). A nonce that is not
/// 12 bytes never opens, so its attempts never deliver and nothing compares them.
pub fn target_nonce(d: &crate::runtime::records::DestinationRecord) -> Option<[u8; 12]> {
    d.sealed_target
        .as_ref()
        .and_then(|b| b.nonce.as_slice().try_into().ok())
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.error_kind.is_none()
    }

    /// A failure of the destination's origin, which its breaker counts: no answer (a timeout, a
    /// refused connection), a 5xx, 408 or 429. Any other answer (a 2xx, a redirect, another 4xx
    /// such as 404 or 410) shows the origin up: it is the URL's own, and a tenant's other
    /// subscriptions on that origin (one host serving many webhooks) must not be shed for it.
    /// A 429 or 503 with a `Retry-After` is left out of the breaker where outcomes are recorded:
    /// its subscription's hold answers for it.
    pub fn origin_down(&self) -> bool {
        !self.success() && self.status.is_none_or(|s| s >= 500 || s == 408 || s == 429)
    }

    /// The attempt failed on the hub's side before any request went out: no key to open the
    /// subscription's secret, no secret, signing failed, the worker panicked. Counted on the
    /// retry curve like any failure, but never against the destination (breaker, auto-disable).
    pub fn hub_side(&self) -> bool {
        matches!(
            self.error_kind.as_deref(),
            Some(
                "no_kek"
                    | "secret_unreadable"
                    | "url_unreadable"
                    | "no_signing_secret"
                    | "signing_failed"
                    | "panic"
            )
        )
    }

    /// No request went out because the subscription's own record cannot make one (no URL, a URL
    /// the policy refuses, headers HTTP cannot carry or too many: a record written past the
    /// API, or a policy changed since). Not the destination's doing, so its origin's breaker,
    /// which the tenant's other subscriptions share, does not hear of it; the subscription's own
    /// auto-disable span does (it would fail this way for good).
    pub fn sent_nothing(&self) -> bool {
        self.hub_side()
            || matches!(
                self.error_kind.as_deref(),
                Some(k) if k == "no_url" || k == "invalid_request" || k.starts_with("url_")
            )
    }

    /// The attempt was never made: it waited for a worker until too little of its lease was left
    /// to finish within it. Its job goes back to due, with no attempt counted.
    pub fn not_attempted(&self) -> bool {
        self.error_kind.as_deref() == Some(NOT_ATTEMPTED)
    }
}

/// Everything a worker needs besides the attempt.
#[derive(Clone)]
pub struct Workers {
    pub http: reqwest::Client,
    pub kek: Option<Arc<Kek>>,
    pub clock: SharedClock,
    /// Destination URLs, checked once (under the private/insecure sink settings).
    pub urls: client::CheckedUrls,
    /// The worker slots, granted round-robin across tenants.
    pub permits: FairPermits,
    /// `STREAMING_HUB_HTTP_TIMEOUT`: an attempt starts only with at least this much lease left.
    pub http_timeout_ms: i64,
}

impl Workers {
    /// Starts an attempt on the runtime; its outcome is sent to `done`.
    pub fn spawn(&self, handle: &tokio::runtime::Handle, a: Attempt, done: Sender<Outcome>) {
        let w = self.clone();
        handle.spawn(async move {
            let _permit = w.permits.acquire(&a.tenant, a.holds_long).await;
            if w.clock.now_ms() + w.http_timeout_ms > a.lease_until {
                // Sending now could outlive the lease: the hub may already be reclaiming the job,
                // and a second copy would go out. Hand it back unsent instead.
                crate::runtime::telemetry::attempt_unsent();
                let _ = done.send(Outcome {
                    partition: a.partition,
                    job_key: a.job_key.clone(),
                    attempt: a.attempt,
                    lease_until: a.lease_until,
                    delivery_id: String::new(),
                    started_at: w.clock.now_ms(),
                    latency_ms: 0,
                    status: None,
                    error_kind: Some(NOT_ATTEMPTED.into()),
                    retry_after_ms: None,
                    response_body: None,
                    ingest_ms: a.event.ingest_ms,
                    tenant: a.tenant.clone(),
                    sole_payload: a.sole_payload,
                    body_bytes: a.event.body.len(),
                    url: a.subscription.destination.url.clone(),
                    target_nonce: target_nonce(&a.subscription.destination),
                });
                return;
            }
            crate::runtime::telemetry::attempts_executing(1.0);
            let started_at = w.clock.now_ms();
            let base = Outcome {
                partition: a.partition,
                job_key: a.job_key.clone(),
                attempt: a.attempt,
                lease_until: a.lease_until,
                delivery_id: uuid::Uuid::now_v7().to_string(),
                started_at,
                latency_ms: 0,
                status: None,
                error_kind: None,
                retry_after_ms: None,
                response_body: None,
                ingest_ms: a.event.ingest_ms,
                tenant: a.tenant.clone(),
                sole_payload: a.sole_payload,
                body_bytes: a.event.body.len(),
                url: a.subscription.destination.url.clone(),
                target_nonce: target_nonce(&a.subscription.destination),
            };
            let t0 = Instant::now();
            let result = std::panic::AssertUnwindSafe(w.send(&a, base.clone()))
                .catch_unwind()
                .await;
            let mut outcome = result.unwrap_or_else(|_| Outcome {
                error_kind: Some("panic".into()),
                ..base
            });
            outcome.latency_ms = t0.elapsed().as_millis() as u64;
            crate::runtime::telemetry::attempts_executing(-1.0);
            let _ = done.send(outcome);
        });
    }

    async fn send(&self, a: &Attempt, mut out: Outcome) -> Outcome {
        let sub = &a.subscription;
        if sub.destination.url.is_none() {
            out.error_kind = Some("no_url".into());
            return out;
        }
        let secrets = match self.secrets(sub) {
            Ok(s) => s,
            Err(kind) => {
                out.error_kind = Some(kind.into());
                return out;
            }
        };
        // The request, and the sensitive headers' binding, go to the URL with its sealed target
        // opened.
        let target = match sealed_url::request_url(self.kek.as_deref(), &sub.id, &sub.destination) {
            Ok(target) => target,
            Err(_) => {
                url_unopened(&sub.id);
                out.error_kind = Some("url_unreadable".into());
                return out;
            }
        };
        let timestamp = self.clock.now_ms() / 1000;
        // The id as its `ce-id` header carries it (percent-encoded as every `ce-*` value): the same
        // string in `webhook-id`, `X-Lerian-Event-Id` and the signed content, visible ASCII even
        // for an id that is not a UUID (`STREAMING_HUB_REQUIRE_UUIDV7=false`); a UUID is as it is.
        let event_id: std::borrow::Cow<str> =
            percent_encoding::utf8_percent_encode(&a.event_id, CE_HEADER_ESCAPED).into();
        let signature =
            match signing::signature_header(&secrets, &event_id, timestamp, &a.event.body) {
                Ok(s) => s,
                Err(_) => {
                    out.error_kind = Some("signing_failed".into());
                    return out;
                }
            };
        let mut req = match self.urls.post(&self.http, &target) {
            Ok(r) => r,
            Err(e) => {
                out.error_kind = Some(e.code().into());
                return out;
            }
        };
        // More than a subscription may have is a record the API did not write (an HTTP header
        // map panics past 32,768 entries): refused, not sent.
        let max_headers = crate::subscriptions::model::MAX_HEADERS;
        if sub.destination.headers.len() > max_headers {
            out.error_kind = Some("invalid_request".into());
            return out;
        }
        for (k, v) in &sub.destination.headers {
            if is_reserved_header(k) {
                reserved_header_dropped(&sub.id, k);
                continue;
            }
            req = req.header(k.as_str(), v.as_str());
        }
        // The sensitive headers' values as sent: scrubbed from what is kept of the answer.
        let mut sensitive = Vec::new();
        if let (Some(blob), Some(kek)) = (&sub.destination.sensitive_headers, &self.kek) {
            // Bound to this subscription and this URL: a sealed blob copied onto another
            // subscription or URL does not open, and the attempt goes without it. Nor does one
            // sealed before headers were bound to their URL (any URL may have been written next
            // to it since), unless STREAMING_HUB_SEND_UNBOUND_HEADERS is on: `streaming-hub
            // subscriptions reseal --bind-unbound` binds those.
            match kek.open_bound(blob, &sub.id, &target) {
                Ok((plain, binding)) if kek.may_send(binding, &sub.id) => {
                    match serde_json::from_slice::<std::collections::BTreeMap<String, String>>(
                        &plain,
                    ) {
                        Ok(map) if map.len() > max_headers => {
                            out.error_kind = Some("invalid_request".into());
                            return out;
                        }
                        Ok(map) => {
                            for (k, v) in map {
                                if is_reserved_header(&k) {
                                    reserved_header_dropped(&sub.id, &k);
                                    continue;
                                }
                                req = req.header(k, v.as_str());
                                sensitive.push(v);
                            }
                        }
                        Err(_) => headers_not_sent(&sub.id, NotSent::Unopened),
                    }
                }
                Ok(_) => {} // counted by `may_send`
                Err(_) => headers_not_sent(&sub.id, NotSent::Unopened),
            }
        }
        // The event's headers come parsed (once per event); this attempt's own are built here
        // under names known at compile time.
        let (client, req) = req.build_split();
        let mut req = match req {
            Ok(r) => r,
            Err(_) => {
                out.error_kind = Some("invalid_request".into());
                return out;
            }
        };
        let headers = req.headers_mut();
        headers.reserve(a.event.ce_headers.len() + 10);
        for (k, v) in a.event.ce_headers.iter() {
            headers.append(k.clone(), v.clone());
        }
        // The producer's trace context, when well formed (custom headers never carry these
        // names: reserved, dropped above).
        for (k, v) in a.event.trace.headers() {
            headers.append(k, v.clone());
        }
        let value = |s: &str| HeaderValue::from_str(s).ok();
        let event_id = value(&event_id);
        let own = [
            (CONTENT_TYPE, Some(a.event.content_type.clone())),
            (X_LERIAN_EVENT_ID, event_id.clone()),
            (X_LERIAN_DELIVERY_ID, value(&out.delivery_id)),
            (X_LERIAN_EVENT_TYPE, Some(a.event.event_type.clone())),
            (X_LERIAN_ATTEMPT, Some(HeaderValue::from(a.attempt))),
            (WEBHOOK_ID, event_id),
            (WEBHOOK_TIMESTAMP, Some(HeaderValue::from(timestamp))),
            (WEBHOOK_SIGNATURE, value(&signature)),
        ];
        for (k, v) in own {
            let Some(v) = v else {
                out.error_kind = Some("invalid_request".into());
                return out;
            };
            headers.append(k, v);
        }
        *req.body_mut() = Some(a.event.body.clone().into());
        match client.execute(req).await {
            Ok(resp) => {
                let status = resp.status();
                out.status = Some(status.as_u16());
                out.retry_after_ms = retry_after(&resp, self.clock.now_ms());
                // What came before a body failed is kept: the status decides, and a cut error
                // page is still the receiver's answer.
                let (body, _) = client::read_capped_partial(resp, BODY_CAP).await;
                // The URL's hidden pieces are scrubbed whether it is sealed or not: one kept as
                // given (a record from before URLs were sealed, or written past the API, not yet
                // resealed) has its credential on the control topic already, not on the attempts.
                out.response_body = Some(kept_answer(&body, &target, &sensitive));
                if !status.is_success() {
                    out.error_kind = Some(
                        if status.is_redirection() {
                            "redirect"
                        } else {
                            "bad_status"
                        }
                        .into(),
                    );
                }
            }
            Err(e) => {
                out.error_kind = Some(
                    match client::classify(e) {
                        client::TransportError::Forbidden => "forbidden_address",
                        client::TransportError::Timeout => "timeout",
                        client::TransportError::Connect(_) => "connect_failed",
                    }
                    .into(),
                );
            }
        }
        out
    }

    /// The secrets to sign with: every one not yet expired that opens, newest first. One that
    /// does not open (a retired key no longer configured, a sealed value copied from another
    /// record) is left out and counted, so a rotation's other secret still signs; only when none
    /// opens is the attempt a hub-side failure.
    fn secrets(&self, sub: &Sub) -> Result<Vec<Secret>, &'static str> {
        let kek = self.kek.as_ref().ok_or("no_kek")?;
        let live = kek.open_live_secrets(&sub.signing_secrets, &sub.id, self.clock.now_ms());
        for _ in 0..live.unopened {
            secret_unopened(&sub.id);
        }
        match (live.opened.is_empty(), live.unopened > 0) {
            (false, _) => Ok(live.opened),
            (true, true) => Err("secret_unreadable"),
            (true, false) => Err("no_signing_secret"),
        }
    }
}

/// `Retry-After` of a 429 or 503, in milliseconds from `now_ms`.
fn retry_after(resp: &reqwest::Response, now_ms: i64) -> Option<u64> {
    if !matches!(resp.status().as_u16(), 429 | 503) {
        return None;
    }
    parse_retry_after(resp.headers().get("retry-after")?.to_str().ok()?, now_ms)
}

/// A `Retry-After` value (RFC 9110: seconds, or an HTTP-date such as `Wed, 21 Oct 2026
/// 07:28:00 GMT`, or in the two obsolete forms a recipient must also accept, RFC 850's
/// `Wednesday, 21-Oct-26 07:28:00 GMT` and asctime's `Wed Oct 21 07:28:00 2026`) as
/// milliseconds from `now_ms`; a date already past is 0.
pub fn parse_retry_after(value: &str, now_ms: i64) -> Option<u64> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(seconds.saturating_mul(1000));
    }
    let at_ms = match chrono::DateTime::parse_from_rfc2822(value) {
        Ok(at) => at.timestamp_millis(),
        Err(_) => {
            let at = httpdate::parse_http_date(value).ok()?;
            let since_epoch = at.duration_since(std::time::UNIX_EPOCH).ok()?;
            i64::try_from(since_epoch.as_millis()).ok()?
        }
    };
    Some(at_ms.saturating_sub(now_ms).max(0) as u64)
}

/// The shortest piece of a request scrubbed from its answer: shorter ones (`?v=1`'s `1`) would
/// blot the answer out and are no credential.
const MIN_SCRUBBED: usize = 4;

/// The words of a sensitive header's value scrubbed on their own (`Bearer <token>`'s token), at
/// most: a value of many words is scrubbed whole as well.
const WORDS_SCRUBBED: usize = 4;

/// What of an answer is kept for `<prefix>.attempts`: its first [`KEPT_IN_RECORD`] bytes, with
/// what of the request is secret and may come back in it (an error page naming the request's
/// path, a debug endpoint echoing its headers) shown as [`sealed_url::REDACTED`]: the pieces of
/// `target` (the URL as requested, sealed or not) that its shown form hides, and
/// the sensitive headers' values (and their first words of 8 or more characters: a bearer
/// token), each as sent, percent-decoded, and with `/` escaped as JSON may (`\/`). The whole
/// answer read is scrubbed before it is cut, in one pass, so no secret is cut in two.
fn kept_answer(body: &[u8], target: &str, sensitive: &[String]) -> Vec<u8> {
    let cut = |b: &[u8]| b[..b.len().min(KEPT_IN_RECORD)].to_vec();
    if body.is_empty() {
        return cut(body);
    }
    let mut secrets: Vec<Vec<u8>> = Vec::new();
    let mut add = |piece: &str| {
        let decoded: Vec<u8> = percent_encoding::percent_decode_str(piece).collect();
        let escaped = piece.replace('/', "\\/").into_bytes();
        for s in [piece.as_bytes().to_vec(), decoded, escaped] {
            if s.len() >= MIN_SCRUBBED {
                secrets.push(s);
            }
        }
    };
    for piece in sealed_url::hidden_pieces(target) {
        add(piece);
    }
    for value in sensitive {
        add(value.trim());
        for word in value
            .split_whitespace()
            .filter(|w| w.len() >= 8)
            .take(WORDS_SCRUBBED)
        {
            add(word);
        }
    }
    if secrets.is_empty() {
        return cut(body);
    }
    // Leftmost-longest: the whole path and query before each of its pieces.
    let Ok(finder) = aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(&secrets)
    else {
        // (Too large to build: not with these bounds.) Nothing kept rather than a secret.
        return Vec::new();
    };
    let mut kept = Vec::with_capacity(body.len().min(KEPT_IN_RECORD));
    // Stopped once past the part kept: the rest is appended as it is, and cut off below.
    let scrubbed = finder.try_replace_all_with_bytes(body, &mut kept, |_, _, out| {
        out.extend_from_slice(sealed_url::REDACTED.as_bytes());
        out.len() < KEPT_IN_RECORD
    });
    if scrubbed.is_err() {
        return Vec::new();
    }
    kept.truncate(KEPT_IN_RECORD);
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A webhook URL whose shown form hides nothing.
    const PLAIN: &str = "https://h.example/hook";

    /// One attempt of an event with `headers` to a local sink, the subscription carrying
    /// `custom` headers as a record written past the API may; the request the sink saw.
    async fn delivered(
        headers: &[(&str, &str)],
        custom: &[(&str, &str)],
    ) -> reqwest::header::HeaderMap {
        use crate::delivery::tests::{Sink, client, echo};
        use crate::runtime::records::{DestinationType, SubscriptionRecord};
        use crate::subscriptions::secrets::generate_signing_secret;
        use base64::Engine;

        let sink = Sink::start(echo).await;
        let key = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        let kek = Arc::new(Kek::new("test", &key).unwrap());
        let mut sub = SubscriptionRecord::pull("sub-1", "tenant-1", &["*"]);
        sub.destination.kind = DestinationType::Webhook;
        sub.destination.url = Some(sink.url());
        sub.destination.headers = custom
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        sub.signing_secrets = vec![kek.seal_secret(&generate_signing_secret(), &sub.id, None)];
        let clock: SharedClock = Arc::new(crate::runtime::clock::SystemClock);
        let workers = Workers {
            http: client(true, "5s"),
            kek: Some(kek),
            clock: clock.clone(),
            urls: crate::delivery::client::CheckedUrls::new(true, true),
            permits: FairPermits::new(1),
            http_timeout_ms: 5_000,
        };
        let id = "0190a8e2-0000-7000-8000-000000000001";
        let event = crate::dispatch::EventView::new(
            [("ce-id", id)]
                .iter()
                .chain(headers)
                .map(|(k, v)| (*k, Some(v.as_bytes()))),
            bytes::Bytes::from_static(b"{}"),
        );
        let attempt = Attempt {
            partition: 0,
            job_key: id.as_bytes().to_vec(),
            attempt: 1,
            lease_until: clock.now_ms() + 60_000,
            event_id: id.into(),
            tenant: "tenant-1".into(),
            subscription: Arc::new(sub),
            event,
            sole_payload: None,
            holds_long: false,
        };
        let (done, outcomes) = std::sync::mpsc::channel();
        workers.spawn(&tokio::runtime::Handle::current(), attempt, done);
        let outcome = tokio::task::spawn_blocking(move || {
            outcomes.recv_timeout(std::time::Duration::from_secs(10))
        })
        .await
        .unwrap()
        .unwrap();
        assert!(outcome.success(), "{outcome:?}");
        let seen = sink.seen();
        assert_eq!(seen.len(), 1);
        seen[0].headers.clone()
    }

    /// A receiver's trace joins the producer's: its W3C trace context goes with the delivery,
    /// when well formed, and a subscription's custom headers cannot replace it.
    #[tokio::test]
    async fn a_delivery_forwards_the_producers_trace_context_and_custom_headers_cannot_set_it() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let state = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";
        let custom = [
            (
                "traceparent",
                "00-11111111111111111111111111111111-2222222222222222-01",
            ),
            ("TraceState", "custom=1"),
            ("x-team", "payments"),
        ];
        let sent = delivered(&[("traceparent", parent), ("tracestate", state)], &custom).await;
        let all = |name: &str| -> Vec<&str> {
            sent.get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect()
        };
        assert_eq!(all("traceparent"), [parent]);
        assert_eq!(all("tracestate"), [state]);
        assert_eq!(all("x-team"), ["payments"]);
        // A malformed traceparent goes nowhere, nor the tracestate that came with it; nor does
        // a custom header fill in for it.
        let bad_parent = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
        let sent = delivered(
            &[("traceparent", bad_parent), ("tracestate", state)],
            &custom,
        )
        .await;
        assert!(
            !sent.contains_key("traceparent") && !sent.contains_key("tracestate"),
            "{sent:?}"
        );
    }

    #[test]
    fn what_is_kept_of_an_answer_shows_no_sealed_piece_of_the_request() {
        let target = "https://h.example/hooks/catch/1234567/abc1de2/?code=s3cr3t%2Fc0de&v=1";
        let sensitive = ["Bearer tok-0123456789".to_string()];
        let body = "<pre>Cannot POST /hooks/catch/1234567/abc1de2/?code=s3cr3t%2Fc0de&v=1</pre> \
                    segment 1234567, code decoded s3cr3t/c0de, \
                    header Bearer tok-0123456789, token tok-0123456789, v=1 kept";
        let kept = String::from_utf8(kept_answer(body.as_bytes(), target, &sensitive)).unwrap();
        for secret in ["1234567", "abc1de2", "s3cr3t", "c0de", "tok-0123456789"] {
            assert!(!kept.contains(secret), "{secret} in {kept}");
        }
        assert!(kept.starts_with("<pre>Cannot POST ***</pre>"), "{kept}");
        // What is shown of the URL stays, and pieces too short to be a credential.
        assert!(
            kept.contains("segment ***,") && kept.ends_with("v=1 kept"),
            "{kept}"
        );
        // Nothing hidden, nothing sensitive: the answer as it came.
        assert_eq!(kept_answer(body.as_bytes(), PLAIN, &[]), body.as_bytes());
    }

    #[test]
    fn a_secret_pushed_into_the_kept_part_by_earlier_scrubs_is_scrubbed_too() {
        let target = "https://h.example/hooks/catch/Zq9xW2mP4kLm7Nb3/in";
        let rest = "/hooks/catch/Zq9xW2mP4kLm7Nb3/in";
        let mut body = format!("Cannot POST {rest}\n").into_bytes();
        body.resize(KEPT_IN_RECORD + 10, b'.');
        body.extend_from_slice(format!(" again {rest}").as_bytes());
        let kept = kept_answer(&body, target, &[]);
        let text = String::from_utf8_lossy(&kept);
        assert!(!text.contains("Zq9x"), "{text}");
        // And escaped as JSON may, and decoded.
        let echo = br#"{"url":"\/hooks\/catch\/Zq9xW2mP4kLm7Nb3\/in","h":"a b%2Fc"}"#;
        let kept = kept_answer(echo, target, &["tok a/b%2Fc".into()]);
        let text = String::from_utf8_lossy(&kept);
        assert!(!text.contains("Zq9x"), "{text}");
    }

    #[test]
    fn a_secret_across_the_kept_length_is_scrubbed_before_the_answer_is_cut() {
        let secret = "0123456789abcdef0123".to_string();
        let mut body = vec![b'x'; KEPT_IN_RECORD - 5];
        body.extend_from_slice(secret.as_bytes());
        let kept = kept_answer(&body, PLAIN, &[secret]);
        assert_eq!(kept.len(), KEPT_IN_RECORD - 5 + 3);
        assert!(kept.ends_with(b"x***"));
        // A long answer is still cut to the length kept.
        let long = vec![b'y'; 3 * KEPT_IN_RECORD];
        assert_eq!(
            kept_answer(&long, PLAIN, &["zzzzzzzz".into()]).len(),
            KEPT_IN_RECORD
        );
    }
}
