//! Deliveries end to end: real binary, real broker, real HTTP sinks on 127.0.0.1. A delivery
//! carries the contract's headers and a Standard Webhooks signature that verifies with the secret
//! the API returned; a sink that fails twice gets the event on the third attempt (same event id,
//! new delivery id each time); a sink that always fails gets exactly 1 + len(retry_schedule)
//! attempts and then one dead letter.
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::*;
use serde_json::json;
use streaming_hub::delivery::signing;
use streaming_hub::runtime::avro::{Codec, RecordKind};
use streaming_hub::runtime::records::{
    AttemptOutcome, AttemptRecord, DeadLetterReason, DeadLetterRecord,
};
use streaming_hub::runtime::secret::Secret;

#[derive(Clone, Debug)]
struct Received {
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

#[derive(Clone)]
struct Sink {
    got: Arc<Mutex<Vec<Received>>>,
    /// Status for the n-th delivery (verification probes are answered apart); the last repeats.
    script: Arc<Vec<u16>>,
    /// How long each delivery takes to answer, in ms (a test may change it as it goes).
    delay: Arc<AtomicU64>,
    /// Instead of the script: every first attempt fails (500), every later one succeeds.
    fail_first_attempts: bool,
    /// Deliveries answered (after the delay).
    answered: Arc<AtomicUsize>,
}

async fn sink_handler(
    State(s): State<Sink>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Bytes) {
    let h: BTreeMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    if h.get("x-lerian-event-type").map(String::as_str) == Some("streaming_hub.verification") {
        return (StatusCode::OK, body); // echo the challenge
    }
    let first_attempt = h.get("x-lerian-attempt").map(String::as_str) == Some("1");
    let n = {
        let mut got = s.got.lock().unwrap();
        got.push(Received {
            headers: h,
            body: body.to_vec(),
        });
        got.len() - 1
    };
    let delay = s.delay.load(Ordering::SeqCst);
    if delay > 0 {
        // A slow receiver (the request is recorded on arrival).
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    s.answered.fetch_add(1, Ordering::SeqCst);
    let status = if s.fail_first_attempts {
        if first_attempt { 500 } else { 200 }
    } else {
        *s.script.get(n).or(s.script.last()).unwrap()
    };
    (
        StatusCode::from_u16(status).unwrap(),
        Bytes::from_static(b"sink says hi"),
    )
}

async fn start_sink(script: Vec<u16>) -> (String, Sink) {
    start_slow_sink(script, Duration::ZERO).await
}

async fn start_slow_sink(script: Vec<u16>, delay: Duration) -> (String, Sink) {
    let sink = Sink {
        got: Arc::default(),
        script: Arc::new(script),
        delay: Arc::new(AtomicU64::new(delay.as_millis() as u64)),
        fail_first_attempts: false,
        answered: Arc::default(),
    };
    let app = Router::new()
        .route("/hook", post(sink_handler))
        .with_state(sink.clone());
    let addr = serve(app).await;
    (format!("http://{addr}/hook"), sink)
}

/// A hub whose attempts time out after 5 s, logging at debug (the secret-in-log checks need it).
async fn setup(tag: &str) -> ApiHub {
    ApiHub::start(
        tag,
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "5s"),
            ("STREAMING_HUB_LOG", "info,streaming_hub=debug"),
        ],
    )
    .await
}

/// This file's subscriptions: `transaction.*` to a webhook, active at once; (id, signing secret).
async fn subscribe(
    s: &ApiHub,
    tenant: &str,
    url: &str,
    retry: Option<Vec<&str>>,
) -> (String, String) {
    let mut body =
        json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url}});
    if let Some(r) = retry {
        body["retry_schedule"] = json!(r);
    }
    let v = s.create_subscription(tenant, body).await;
    assert_eq!(v["verification_state"], "active", "{v}");
    (
        v["id"].as_str().unwrap().to_string(),
        v["signing_secret"].as_str().unwrap().to_string(),
    )
}

fn wait_for_deliveries(sink: &Sink, n: usize, timeout: Duration) -> Vec<Received> {
    wait_until(timeout, &format!("{n} deliveries at the sink"), || {
        let got = sink.got.lock().unwrap();
        (got.len() >= n).then(|| got.clone())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_carries_the_contract_headers_and_a_verifiable_signature() {
    let s = setup("dlv").await;
    let (url, sink) = start_sink(vec![200]).await;
    let (sub_id, secret) = subscribe(&s, "tenant-a", &url, None).await;
    let ev = event("tenant-a", "ledger", "transaction", "created")
        .set(
            "ce-subject",
            Some("acc 7 \u{2013} Jo\u{e3}o \"50%\"".as_bytes()),
        )
        .set(
            "ce-datacontenttype",
            Some(b"application/vnd.lerian.ledger+json; charset=utf-8"),
        );
    produce(&producer(), &s.topic, std::slice::from_ref(&ev));
    let got = wait_for_deliveries(&sink, 1, Duration::from_secs(60));
    let d = &got[0];
    let h = &d.headers;
    assert_eq!(
        d.body,
        ev.value.clone().unwrap(),
        "body = payload bytes unchanged"
    );
    assert_eq!(
        h["content-type"], "application/vnd.lerian.ledger+json; charset=utf-8",
        "Content-Type = ce-datacontenttype"
    );
    assert!(
        !h.contains_key("ce-datacontenttype"),
        "binary mode: the content type travels as Content-Type only"
    );
    assert_eq!(h["x-lerian-event-id"], ev.id());
    assert_eq!(h["x-lerian-event-type"], "transaction.created");
    assert_eq!(h["x-lerian-attempt"], "1");
    assert_eq!(h["ce-id"], ev.id());
    assert_eq!(h["ce-type"], "studio.lerian.ledger.transaction.created");
    // CloudEvents HTTP binding: space, `"`, `%` and non-ASCII bytes percent-encoded; the
    // subscriber's SDK decodes the producer's subject back.
    assert_eq!(
        h["ce-subject"],
        "acc%207%20%E2%80%93%20Jo%C3%A3o%20%2250%25%22"
    );
    assert_eq!(
        percent_encoding::percent_decode_str(&h["ce-subject"]).decode_utf8_lossy(),
        "acc 7 \u{2013} Jo\u{e3}o \"50%\""
    );
    assert_eq!(h["ce-tenantid"], "tenant-a");
    assert!(uuid::Uuid::parse_str(&h["x-lerian-delivery-id"]).is_ok());
    assert_eq!(h["webhook-id"], ev.id());
    let ts: i64 = h["webhook-timestamp"].parse().unwrap();
    // The time of sending, which receivers' libraries hold within 5 minutes of theirs: not the
    // event's time (`ce-time`, months before).
    let now = chrono::Utc::now().timestamp();
    assert!(
        (now - 300..=now).contains(&ts),
        "webhook-timestamp {ts}, now {now}"
    );
    let want = signing::sign(&Secret::new(secret.clone()), &h["webhook-id"], ts, &d.body).unwrap();
    assert_eq!(
        h["webhook-signature"], want,
        "signature verifies with the secret from the API"
    );
    assert!(
        !h.contains_key("x-streaming-hub-source-topic"),
        "internal headers stay inside"
    );

    // The attempt is recorded, delivered, with the sink's status.
    let codec = Codec::new().unwrap();
    let attempts = read_until(
        &[&format!("{}.attempts", s.prefix)],
        Duration::from_secs(30),
        |r| !r.is_empty(),
    );
    let a: AttemptRecord = codec
        .decode(RecordKind::Attempt, attempts[0].rec.value.as_ref().unwrap())
        .unwrap();
    assert_eq!(
        (a.event_id.as_str(), a.subscription_id.as_str(), a.status),
        (ev.id().as_str(), sub_id.as_str(), Some(200))
    );
    assert!(
        !s.hub.log_text().contains(&secret[6..]),
        "secret in the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_record_with_a_header_name_that_is_not_utf8_is_delivered_not_a_panic() {
    let s = setup("rawinbox").await;
    let (url, sink) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-a", &url, None).await;
    // Ingest never writes such a name, but anyone with access to the inbox can: rdkafka's header
    // iterator panics on it, which killed the hub loop (and again after every restart).
    let odd = event("tenant-a", "ledger", "transaction", "created");
    produce_with_raw_header_name(&format!("{}.inbox", s.prefix), &odd, b"x-\xff\xfe");
    let next = event("tenant-a", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&next));

    let got = wait_for_deliveries(&sink, 2, Duration::from_secs(60));
    let ids: std::collections::BTreeSet<&str> = got
        .iter()
        .map(|d| d.headers["x-lerian-event-id"].as_str())
        .collect();
    assert_eq!(
        ids,
        [odd.id(), next.id()].iter().map(String::as_str).collect(),
        "both events delivered"
    );
    let delivered = got
        .iter()
        .find(|d| d.headers["x-lerian-event-id"] == odd.id())
        .unwrap();
    assert_eq!(delivered.body, odd.value.clone().unwrap());
    assert_eq!(
        delivered.headers["ce-type"],
        "studio.lerian.ledger.transaction.created"
    );
}

/// An inbox record written past ingest whose tenant holds a control character (a NUL, which
/// ends the tenant in the hub's store keys) is refused as `invalid`: its jobs' timers would be
/// filed under another tenant's name and never come due. Ingest quarantines such a tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_record_whose_tenant_holds_a_control_character_is_invalid() {
    let s = setup("nulinbox").await;
    let odd = event("tenant-a\0b", "ledger", "transaction", "created");
    produce(&producer(), &format!("{}.inbox", s.prefix), &[odd]);
    s.wait_metric("streaming_hub_hub_events_total{outcome=\"invalid\"", 1)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_failing_twice_gets_the_event_on_the_third_attempt() {
    let s = setup("retry").await;
    let (url, sink) = start_sink(vec![500, 503, 200]).await;
    subscribe(&s, "tenant-r", &url, Some(vec!["1s", "1s", "1s"])).await;
    let ev = event("tenant-r", "ledger", "transaction", "posted");
    produce(&producer(), &s.topic, std::slice::from_ref(&ev));
    let got = wait_for_deliveries(&sink, 3, Duration::from_secs(60));
    let attempts: Vec<&str> = got
        .iter()
        .map(|d| d.headers["x-lerian-attempt"].as_str())
        .collect();
    assert_eq!(attempts, ["1", "2", "3"]);
    assert!(
        got.iter()
            .all(|d| d.headers["x-lerian-event-id"] == ev.id()),
        "event id stable"
    );
    let ids: std::collections::HashSet<&str> = got
        .iter()
        .map(|d| d.headers["x-lerian-delivery-id"].as_str())
        .collect();
    assert_eq!(ids.len(), 3, "a new delivery id per attempt");
    // Delivered: nothing more comes, and no dead letter is written.
    let codec = Codec::new().unwrap();
    let attempts = read_until(
        &[&format!("{}.attempts", s.prefix)],
        Duration::from_secs(30),
        |r| r.len() >= 3,
    );
    let last: AttemptRecord = codec
        .decode(RecordKind::Attempt, attempts[2].rec.value.as_ref().unwrap())
        .unwrap();
    assert_eq!(last.status, Some(200));
    assert_eq!(last.outcome, AttemptOutcome::Delivered);
    // The job is finished (its last changelog record a tombstone) before the absence of a
    // fourth attempt and of a dead letter is checked: a job still scheduled would show here.
    let job = format!("j/tenant-r\0{}\0", ev.id());
    let job_ended = |r: &[Got]| key_history(r, &job).last() == Some(&false);
    let changelog = read_until(
        &[&format!("{}.hub.jobs.changelog", s.prefix)],
        Duration::from_secs(30),
        job_ended,
    );
    assert!(job_ended(&changelog), "the job's tombstone");
    assert_eq!(sink.got.lock().unwrap().len(), 3, "no fourth attempt");
    assert_eq!(
        read_all(&[&format!("{}.dlq", s.prefix)], Duration::from_secs(30)).len(),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_fan_out_deliveries_each_carry_their_own_events_body() {
    // Every first attempt fails, so every second one is a due job whose event is read from the
    // stored payload, and kept for the other jobs of that event claimed in the same transaction:
    // six events, three subscriptions each, their retries due within the same second. A guard
    // on what each retry carries, not a count of how often a view was reused (it passed before
    // the views were kept; with them keyed wrongly it fails).
    let s = setup("fanout-retry").await;
    let sink = Sink {
        got: Arc::default(),
        script: Arc::new(vec![]),
        delay: Arc::default(),
        fail_first_attempts: true,
        answered: Arc::default(),
    };
    let app = Router::new()
        .route("/hook", post(sink_handler))
        .with_state(sink.clone());
    let url = format!("http://{}/hook", serve(app).await);
    let mut subs = Vec::new();
    for _ in 0..3 {
        subs.push(subscribe(&s, "tenant-f", &url, Some(vec!["1s"])).await.0);
    }
    let events: Vec<Rec> = (0..6)
        .map(|_| event("tenant-f", "ledger", "transaction", "posted"))
        .collect();
    produce(&producer(), &s.topic, &events);
    let got = wait_for_deliveries(&sink, 36, Duration::from_secs(60));
    let body_of: BTreeMap<String, Vec<u8>> = events
        .iter()
        .map(|e| (e.id(), e.value.clone().unwrap()))
        .collect();
    let mut retried: BTreeMap<&str, usize> = BTreeMap::new();
    for d in &got {
        let id = d.headers["x-lerian-event-id"].as_str();
        assert_eq!(d.headers["ce-id"], id, "ce-id of another event");
        assert_eq!(
            d.body, body_of[id],
            "attempt {} of {id} carried another event's body",
            d.headers["x-lerian-attempt"]
        );
        if d.headers["x-lerian-attempt"] == "2" {
            *retried.entry(id).or_default() += 1;
        }
    }
    assert_eq!(retried.len(), 6, "every event retried: {retried:?}");
    assert!(retried.values().all(|&n| n == subs.len()), "{retried:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_failing_sink_gets_one_plus_schedule_attempts_then_one_dead_letter() {
    let s = setup("dead").await;
    let (url, sink) = start_sink(vec![500]).await;
    let (sub_id, _) = subscribe(&s, "tenant-d", &url, Some(vec!["1s", "1s", "1s"])).await;
    let ev = event("tenant-d", "ledger", "transaction", "posted");
    produce(&producer(), &s.topic, std::slice::from_ref(&ev));
    let codec = Codec::new().unwrap();
    let dlq = read_until(
        &[&format!("{}.dlq", s.prefix)],
        Duration::from_secs(60),
        |r| !r.is_empty(),
    );
    let dl: DeadLetterRecord = codec
        .decode(RecordKind::DeadLetter, dlq[0].rec.value.as_ref().unwrap())
        .unwrap();
    assert_eq!(dl.reason, DeadLetterReason::Exhausted);
    assert_eq!(
        (dl.event_id.as_str(), dl.subscription_id.as_str()),
        (ev.id().as_str(), sub_id.as_str())
    );
    assert_eq!(dl.attempts, 4);
    assert_eq!(dl.last_status, Some(500));
    assert_eq!(
        sink.got.lock().unwrap().len(),
        4,
        "exactly 1 + 3 attempts reached the sink"
    );
    let attempts = read_all(
        &[&format!("{}.attempts", s.prefix)],
        Duration::from_secs(30),
    );
    assert_eq!(attempts.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_backlog_does_not_delay_another_tenants_event_by_more_than_a_few_deliveries() {
    // Scaled from the issue's 50,000 to 3,000 jobs so the debug-build suite stays quick; the
    // bound does not depend on the backlog's size (claims go round-robin across tenants and
    // across partitions; the worker permits go round-robin across tenants). A's sink takes
    // 500 ms, so A is delivered at about 16/s with 8 workers while hundreds of its claims wait
    // for a worker.
    // 8 workers (not the default): the bound below is reasoned from the worker count.
    let s = ApiHub::start(
        "fair",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "5s"),
            ("STREAMING_HUB_LOG", "info,streaming_hub=debug"),
            ("STREAMING_HUB_DISPATCH_WORKERS", "8"),
        ],
    )
    .await;
    let (slow_url, slow) = start_slow_sink(vec![200], Duration::from_millis(500)).await;
    let (fast_url, fast) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-a", &slow_url, None).await;
    subscribe(&s, "tenant-b", &fast_url, None).await;
    let p = producer();
    let backlog: Vec<Rec> = (0..3000)
        .map(|_| event("tenant-a", "ledger", "transaction", "posted"))
        .collect();
    produce(&p, &s.topic, &backlog);
    s.wait_metric("streaming_hub_matches_total", 3000).await;
    let matched = s.metric("streaming_hub_matches_total").await;
    assert!(matched >= 3000, "all of tenant A's jobs exist ({matched})");
    wait_for_deliveries(&slow, 50, Duration::from_secs(60)); // A's backlog is being worked off
    let before = slow.got.lock().unwrap().len();
    let b = event("tenant-b", "ledger", "transaction", "posted");
    produce(&p, &s.topic, std::slice::from_ref(&b));
    let got = wait_for_deliveries(&fast, 1, Duration::from_secs(60));
    let after = slow.got.lock().unwrap().len();
    assert_eq!(got[0].headers["x-lerian-event-id"], b.id());
    eprintln!(
        "tenant A deliveries while B waited: {}; A delivered so far: {after}",
        after - before
    );
    assert!(
        after < 3000,
        "tenant A still had a backlog when B's event went out ({after})"
    );
    // What B waits for: its own ingest, hub and claim commits (A keeps being delivered
    // meanwhile, ~16/s) plus one turn of the workers (8). An unfair scheduler would make B wait
    // for the whole backlog (~2,900, due order across tenants) or for every claim of A queued
    // before B's (first-come permits: up to 64 x 8 workers = 512). The bound sits between the
    // two, so a slow machine (B's commits taking seconds, A delivered meanwhile) does not fail it.
    assert!(
        after - before <= 250,
        "B's event waited behind {} of A's deliveries",
        after - before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_hub_replay_by_offset_reset_redelivers_every_event() {
    let mut s = setup("replay").await;
    let (url, sink) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-r", &url, None).await;
    let events: Vec<Rec> = (0..2)
        .map(|_| event("tenant-r", "ledger", "transaction", "posted"))
        .collect();
    produce(&producer(), &s.topic, &events);
    wait_for_deliveries(&sink, 2, Duration::from_secs(60));

    let env = s.hub.env.clone();
    // A replay while the hub runs is refused, saying why (the group has an active member). A
    // delivery can come before its transaction commits the inbox offsets (early attempts), and
    // a group with nothing committed is refused for that first: asked again until it is not.
    let refused = wait_until(
        Duration::from_secs(60),
        "the hub group's first commit",
        || {
            let out = replay(&env, &["--to-offset", "earliest"]);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                !out.status.success(),
                "replay ran while the hub did: {stderr}"
            );
            (!stderr.contains("no committed offset")).then_some(stderr)
        },
    );
    assert!(refused.contains("still active"), "{refused}");
    s.hub.terminate();
    // The stopped static member stays in the group until its session times out: replay refuses
    // (and says why) until then, and changes nothing.
    // A time after every record (a mistyped year) moves nothing, and says so, partitions the
    // hub never committed (no event of theirs) included.
    let mut refusals = Vec::new();
    let nothing = wait_until(Duration::from_secs(60), "replay accepted", || {
        let out = replay(&env, &["--to-datetime", "2999-01-01T00:00:00Z"]);
        if out.status.success() {
            return Some(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        refusals.push(String::from_utf8_lossy(&out.stderr).into_owned());
        std::thread::sleep(Duration::from_millis(500));
        None
    });
    assert!(
        refusals.iter().all(|r| r.contains("still active")),
        "{refusals:?}"
    );
    assert!(nothing.contains("no partition moved"), "{nothing}");
    // A dry run, where an operator checks the target first, says so too.
    let dry = replay(
        &env,
        &["--to-datetime", "2999-01-01T00:00:00Z", "--dry-run"],
    );
    let dry_err = String::from_utf8_lossy(&dry.stderr);
    assert!(dry_err.contains("no partition would move"), "{dry_err}");
    // A dry run says where each partition would go and commits nothing: the replay after it
    // finds the same committed offsets and moves them the same way.
    let dry = replay(&env, &["--to-offset", "earliest", "--dry-run"]);
    let dry_err = String::from_utf8_lossy(&dry.stderr);
    assert!(dry.status.success(), "{dry_err}");
    assert!(dry_err.contains("dry run: nothing committed"), "{dry_err}");
    let out = replay(&env, &["--to-offset", "earliest"]);
    let moved = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(moved.contains("-> 0"), "{moved}");
    assert_eq!(String::from_utf8_lossy(&dry.stdout), moved);
    // Undone with the old offsets it printed (forward, as only --to-offsets moves), then
    // done again.
    // `<partition>:<old offset>` of each partition the group had committed.
    let olds = |printed: &str| -> Vec<String> {
        printed
            .lines()
            .filter_map(|l| {
                let (p, rest) = l.strip_prefix("inbox partition ")?.split_once(": ")?;
                let (old, _) = rest.split_once(" -> ")?;
                Some(format!("{p}:{old}"))
            })
            .filter(|po| !po.ends_with(":none"))
            .collect()
    };
    let old = olds(&moved);
    assert!(!old.is_empty(), "{moved}");
    let undo = replay(&env, &["--to-offsets", &old.join(",")]);
    let undo_err = String::from_utf8_lossy(&undo.stderr);
    assert!(undo.status.success(), "{undo_err}");
    assert!(
        String::from_utf8_lossy(&undo.stdout).contains("SKIPS up to"),
        "a forward move says what it leaves unread"
    );
    assert!(undo_err.contains("moved forward"), "{undo_err}");
    let check = replay(&env, &["--to-offset", "earliest", "--dry-run"]);
    let now = olds(&String::from_utf8_lossy(&check.stdout));
    assert!(
        old.iter().all(|po| now.contains(po)),
        "the offsets are back where they were: {old:?}, {now:?}"
    );
    let out = replay(&env, &["--to-offset", "earliest"]);
    let moved = String::from_utf8_lossy(&out.stdout);
    assert!(moved.contains("-> 0"), "{moved}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("no partition moved"),
        "moved back: no note"
    );

    // A group nobody runs (a mistyped STREAMING_HUB_GROUP_ID) is refused, not "replayed".
    let mut wrong = env.clone();
    wrong.insert("STREAMING_HUB_GROUP_ID".into(), unique("no-such-group"));
    let out = replay(&wrong, &["--to-offset", "earliest"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("has no committed offset"), "{err}");

    s.hub = Hub::start(&env);
    let got = wait_for_deliveries(&sink, 4, Duration::from_secs(60));
    // Parallel workers do not promise order between events: compare as sets.
    let ids = |r: &[Received]| -> std::collections::BTreeSet<String> {
        r.iter()
            .map(|d| d.headers["x-lerian-event-id"].clone())
            .collect()
    };
    let want: std::collections::BTreeSet<String> = events.iter().map(Rec::id).collect();
    assert_eq!(ids(&got[..2]), want);
    assert_eq!(ids(&got[2..4]), want, "every event delivered again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_changelog_record_that_does_not_decode_is_skipped_at_restore_not_a_crash_loop() {
    let mut s = ApiHub::start("garbage", &[]).await;
    let (url, sink) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-g", &url, None).await;
    // A receiver that fails: the event's job waits for its retry, its payload kept for it.
    let (failing_url, failing) = start_sink(vec![500]).await;
    let (failing_sub, _) = subscribe(&s, "tenant-g", &failing_url, Some(vec!["10s"])).await;
    let p = producer();
    let first = event("tenant-g", "ledger", "transaction", "created");
    produce(&p, &s.topic, std::slice::from_ref(&first));
    wait_for_deliveries(&sink, 1, Duration::from_secs(60));
    wait_for_deliveries(&failing, 1, Duration::from_secs(60));
    s.hub.terminate();

    // A job key, a dedup key and the waiting job's payload whose values are not hub records, in
    // every partition of the state changelog (each inbox partition's task restores one).
    let changelog = format!("{}.hub.jobs.changelog", s.prefix);
    let payload_key = [&b"p/tenant-g\0"[..], first.id().as_bytes()].concat();
    let garbage: Vec<Rec> = (0..6)
        .flat_map(|partition| {
            [
                &b"j/tenant-g\0x\0y"[..],
                &b"d/tenant-g\0x"[..],
                &payload_key[..],
            ]
            .map(|key| Rec {
                key: Some(key.to_vec()),
                value: Some(b"not a hub record".to_vec()),
                partition: Some(partition),
                ..Default::default()
            })
        })
        .collect();
    produce(&p, &changelog, &garbage);

    // The hub comes back (it exited on every restart before), restores, and delivers.
    let env = s.hub.env.clone();
    s.hub = Hub::start(&env);
    produce(
        &p,
        &s.topic,
        &[event("tenant-g", "ledger", "transaction", "created")],
    );
    wait_for_deliveries(&sink, 2, Duration::from_secs(60));
    assert_eq!(
        s.metric("streaming_hub_restore_skipped_total").await,
        garbage.len() as u64,
        "every record that does not decode counted"
    );
    // The job whose payload is gone cannot be sent: when due it is dead-lettered, its loss on
    // the DLQ with its ids (it vanished unseen before), and never sent again.
    // (The second event's failing delivery is dead-lettered too, its retry spent.)
    let codec = Codec::new().unwrap();
    let decode = |g: &Got| -> DeadLetterRecord {
        codec
            .decode(RecordKind::DeadLetter, g.rec.value.as_ref().unwrap())
            .unwrap()
    };
    let dlq = read_until(
        &[&format!("{}.dlq", s.prefix)],
        Duration::from_secs(60),
        |r| r.iter().any(|g| decode(g).event_id == first.id()),
    );
    let dl = dlq
        .iter()
        .map(decode)
        .find(|d| d.event_id == first.id())
        .unwrap();
    assert_eq!(dl.subscription_id, failing_sub);
    assert_eq!(dl.reason, DeadLetterReason::Poison);
    assert_eq!(dl.last_error.as_deref(), Some("payload_missing"));
    assert_eq!(
        (dl.attempts, dl.event_value),
        (1, None),
        "one attempt spent"
    );
    let sent = failing
        .got
        .lock()
        .unwrap()
        .iter()
        .filter(|d| d.headers["x-lerian-event-id"] == first.id())
        .count();
    assert_eq!(sent, 1, "the job without its payload was not sent again");
}

/// A pending job whose changelog record does not decode is restored as a stand-in named by its
/// key, due at once: its event is delivered again (at least once), where before the job was
/// dropped and the delivery lost, with only a counter to say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_record_that_does_not_decode_is_delivered_again_not_lost() {
    let mut s = ApiHub::start("standin", &[]).await;
    let (url, sink) = start_sink(vec![500]).await;
    let (sub, _) = subscribe(&s, "tenant-j", &url, Some(vec!["1h"])).await;
    let p = producer();
    let ev = event("tenant-j", "ledger", "transaction", "created");
    produce(&p, &s.topic, std::slice::from_ref(&ev));
    wait_for_deliveries(&sink, 1, Duration::from_secs(60)); // failed; its retry up to 1 h away
    s.hub.terminate();
    // Its job record, written over on its own changelog partition with bytes that are no job.
    let changelog = format!("{}.hub.jobs.changelog", s.prefix);
    let key = [
        &b"j/tenant-j\0"[..],
        ev.id().as_bytes(),
        b"\0",
        sub.as_bytes(),
    ]
    .concat();
    let found = read_until(&[&changelog], Duration::from_secs(30), |r| {
        r.iter().any(|g| g.rec.key.as_deref() == Some(&key[..]))
    });
    let partition = found
        .iter()
        .find(|g| g.rec.key.as_deref() == Some(&key[..]))
        .unwrap()
        .partition;
    produce(
        &p,
        &changelog,
        &[Rec {
            key: Some(key.clone()),
            value: Some(b"not a hub record".to_vec()),
            partition: Some(partition),
            ..Default::default()
        }],
    );
    let env = s.hub.env.clone();
    s.hub = Hub::start(&env);
    let got = wait_for_deliveries(&sink, 2, Duration::from_secs(60));
    assert!(
        got.iter()
            .all(|d| d.headers["x-lerian-event-id"] == ev.id()),
        "the same event, sent again"
    );
    assert_eq!(s.metric("streaming_hub_restore_skipped_total").await, 1);
}

/// Hub loops of one instance, and which inbox partitions each owns now (the
/// `streaming_hub_inbox_partition_owned{partition,loop}` gauges at 1).
async fn partitions_by_loop(s: &ApiHub) -> BTreeMap<String, Vec<String>> {
    owned_by_loop(&s.metrics_text().await)
}

/// The inbox partitions each hub loop owns, from a hub's `/metrics` page.
fn owned_by_loop(text: &str) -> BTreeMap<String, Vec<String>> {
    let label = |line: &str, name: &str| {
        let from = line.find(&format!("{name}=\""))? + name.len() + 2;
        Some(line[from..].split('"').next()?.to_string())
    };
    let mut owned: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        if !line.starts_with("streaming_hub_inbox_partition_owned{") || !line.ends_with(" 1") {
            continue;
        }
        if let (Some(l), Some(p)) = (label(line, "loop"), label(line, "partition")) {
            owned.entry(l).or_default().push(p);
        }
    }
    owned
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hub_loops_split_the_inbox_and_deliver_every_event_once() {
    let s = ApiHub::start(
        "loops",
        &[
            ("STREAMING_HUB_HUB_STAGES", "2"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "5s"),
        ],
    )
    .await;
    let (url, sink) = start_sink(vec![200]).await;
    let tenants: Vec<String> = (0..12).map(|i| format!("tenant-{i}")).collect();
    for t in &tenants {
        subscribe(&s, t, &url, None).await;
    }
    let events: Vec<Rec> = (0..240)
        .map(|i| {
            event(
                &tenants[i % tenants.len()],
                "ledger",
                "transaction",
                "created",
            )
        })
        .collect();
    produce(&producer(), &s.topic, &events);
    let got = wait_for_deliveries(&sink, events.len(), Duration::from_secs(90));
    let mut ids: Vec<&str> = got
        .iter()
        .map(|r| r.headers["x-lerian-event-id"].as_str())
        .collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "an event was delivered twice");
    let want: std::collections::BTreeSet<String> = events.iter().map(|e| e.id()).collect();
    let have: std::collections::BTreeSet<String> = ids.iter().map(|s| s.to_string()).collect();
    assert_eq!(have, want, "every event, once");

    // Both loops own a share of the six inbox partitions, and no partition has two owners.
    let mut owned = BTreeMap::new();
    for _ in 0..600 {
        owned = partitions_by_loop(&s).await;
        if owned.len() == 2 && owned.values().map(Vec::len).sum::<usize>() == 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        owned.keys().map(String::as_str).collect::<Vec<_>>(),
        vec!["0", "1"],
        "{owned:?}"
    );
    let mut all: Vec<&String> = owned.values().flatten().collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 6, "{owned:?}");
    assert_eq!(owned.values().map(Vec::len).sum::<usize>(), 6, "{owned:?}");
}

/// A member of the hub's group outside any hub (dynamic: it leaves when dropped), polling until
/// `stop`; `held` is its assignment as of its last poll.
fn squatter_thread(
    group: String,
    inbox: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
    held: Arc<Mutex<Vec<i32>>>,
) -> std::thread::JoinHandle<()> {
    use rdkafka::config::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    std::thread::spawn(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", &group)
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", "6000")
            .set("enable.auto.commit", "false")
            .create()
            .expect("squatter");
        c.subscribe(&[inbox.as_str()]).expect("subscribe");
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            // Records it is handed are never committed: the hub reads them after it leaves.
            let _ = c.poll(Duration::from_millis(50));
            if let Ok(a) = c.assignment() {
                *held.lock().unwrap() = a.elements().iter().map(|e| e.partition()).collect();
            }
        }
        c.unsubscribe();
    })
}

/// A newly assigned partition is restored beside the loop, not inside the rebalance callback:
/// while one waits for its changelog (here an open transaction at its end, as a previous
/// owner's would leave), the partitions the loop already had keep delivering, and the waiting
/// one delivers nothing until it is restored; then every event is delivered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_already_held_keep_delivering_while_a_new_one_restores() {
    use rdkafka::config::ClientConfig;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let s = setup("bgrestore").await;
    let (url, sink) = start_sink(vec![200]).await;
    let tenants: Vec<String> = (0..12).map(|i| format!("tenant-{i}")).collect();
    for t in &tenants {
        subscribe(&s, t, &url, None).await;
    }
    let inbox = format!("{}.inbox", s.prefix);
    let group = format!("{}-group.hub", s.prefix);
    let owned = |want: usize| {
        let s = &s;
        async move {
            for _ in 0..1200 {
                let n = partitions_by_loop(s)
                    .await
                    .values()
                    .map(Vec::len)
                    .sum::<usize>();
                if n == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("the hub never owned {want} inbox partitions");
        }
    };
    // State in every store first: a wave of events, delivered.
    let first: Vec<Rec> = tenants
        .iter()
        .map(|t| event(t, "ledger", "transaction", "created"))
        .collect();
    produce(&producer(), &s.topic, &first);
    wait_for_deliveries(&sink, first.len(), Duration::from_secs(90));
    owned(6).await;
    // Which inbox partition each tenant's events go to (ingest keys them by tenant).
    let first_ids: std::collections::BTreeSet<String> = first.iter().map(Rec::id).collect();
    let with_tenants: std::collections::BTreeSet<i32> =
        read_until(&[&inbox], Duration::from_secs(60), |got| {
            got.iter()
                .filter(|g| {
                    g.rec
                        .header("ce-id")
                        .is_some_and(|id| first_ids.contains(id))
                })
                .count()
                == first_ids.len()
        })
        .iter()
        .filter(|g| {
            g.rec
                .header("ce-id")
                .is_some_and(|id| first_ids.contains(id))
        })
        .map(|g| g.partition)
        .collect();

    // Another member takes half of the inbox.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = Arc::new(Mutex::new(Vec::new()));
    let squatter = squatter_thread(group, inbox.clone(), stop.clone(), held.clone());
    let theirs: Vec<i32> = wait_until(Duration::from_secs(120), "the squatter holds 3", || {
        let h = held.lock().unwrap().clone();
        (h.len() == 3).then_some(h)
    });
    owned(3).await;
    // One of them that some tenant's events go to, so that holding it back shows.
    let blocked = *theirs
        .iter()
        .find(|p| with_tenants.contains(p))
        .expect("a tenant on the squatter's partitions");

    // A transaction left open at the end of one of those partitions' state changelog.
    let blocker: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", unique("blocker"))
        .set("transaction.timeout.ms", "180000")
        .create()
        .expect("producer");
    blocker.init_transactions(Duration::from_secs(30)).unwrap();
    blocker.begin_transaction().unwrap();
    let changelog = format!("{}.hub.jobs.changelog", s.prefix);
    blocker
        .send(
            BaseRecord::<[u8], [u8]>::to(&changelog)
                .partition(blocked)
                .key(&b"test/restore-blocker"[..]),
        )
        .map_err(|(e, _)| e)
        .unwrap();
    blocker.flush(Duration::from_secs(10)).unwrap();

    // The squatter leaves; its partitions come back to the hub and wait on the changelog.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    squatter.join().unwrap();
    s.wait_metric("streaming_hub_restoring_partitions", 1).await;

    let second: Vec<Rec> = tenants
        .iter()
        .flat_map(|t| (0..2).map(move |_| event(t, "ledger", "transaction", "created")))
        .collect();
    produce(&producer(), &s.topic, &second);
    let wanted: std::collections::BTreeSet<String> = second.iter().map(Rec::id).collect();
    let on_inbox = read_until(&[&inbox], Duration::from_secs(60), |got| {
        got.iter()
            .filter(|g| g.rec.header("ce-id").is_some_and(|id| wanted.contains(id)))
            .count()
            == wanted.len()
    });
    let partition_of: BTreeMap<String, i32> = on_inbox
        .iter()
        .filter_map(|g| Some((g.rec.header("ce-id")?.to_string(), g.partition)))
        .filter(|(id, _)| wanted.contains(id))
        .collect();
    let mine: Vec<&String> = partition_of
        .iter()
        .filter(|(_, p)| !theirs.contains(p))
        .map(|(id, _)| id)
        .collect();
    assert!(
        !mine.is_empty(),
        "no event landed on the hub's own partitions: {partition_of:?}"
    );
    let delivered_ids = |sink: &Sink| -> Vec<String> {
        sink.got
            .lock()
            .unwrap()
            .iter()
            .filter_map(|r| r.headers.get("x-lerian-event-id").cloned())
            .collect()
    };
    wait_until(
        Duration::from_secs(60),
        "the events of the partitions the hub kept delivered during the restore",
        || {
            let got = delivered_ids(&sink);
            mine.iter().all(|id| got.contains(id)).then_some(())
        },
    );
    let text = s.metrics_text().await;
    assert!(
        metric_sum(&text, "streaming_hub_restoring_partitions") > 0,
        "the restore ended before the open transaction did"
    );
    assert!(
        partition_of.values().any(|p| *p == blocked),
        "no event of the second wave on partition {blocked}: {partition_of:?}"
    );
    let got = delivered_ids(&sink);
    let early: Vec<&String> = partition_of
        .iter()
        .filter(|(id, p)| **p == blocked && got.contains(id))
        .map(|(id, _)| id)
        .collect();
    assert!(
        early.is_empty(),
        "events of partition {blocked} delivered before its stores were restored: {early:?}"
    );

    // The transaction ends; the restore finishes and the rest is delivered, each event once.
    blocker.abort_transaction(Duration::from_secs(30)).unwrap();
    let all = wait_for_deliveries(&sink, first.len() + second.len(), Duration::from_secs(120));
    let mut ids: Vec<String> = all
        .iter()
        .filter_map(|r| r.headers.get("x-lerian-event-id").cloned())
        .collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "an event was delivered twice");
    assert!(
        wanted.iter().all(|id| ids.contains(id)),
        "every event delivered"
    );
    owned(6).await;
    assert_eq!(
        s.metric("streaming_hub_restoring_partitions").await,
        0,
        "no restore left"
    );
}

/// Claims ahead of the workers are bounded by the event bytes they hold, not only by count: with
/// `STREAMING_HUB_DISPATCH_CLAIMS_AHEAD_BYTES` at 250 kB and events of ~100 kB to a slow sink,
/// at most three attempts are out at once (64 workers would send all ten together), and every
/// event is still delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_ahead_are_bounded_by_the_bytes_their_events_hold() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    #[derive(Clone, Default)]
    struct Gauge {
        now: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        done: Arc<AtomicUsize>,
    }
    async fn slow(State(g): State<Gauge>, headers: HeaderMap, body: Bytes) -> (StatusCode, Bytes) {
        if headers
            .get("x-lerian-event-type")
            .and_then(|v| v.to_str().ok())
            == Some("streaming_hub.verification")
        {
            return (StatusCode::OK, body); // echo the challenge
        }
        let n = g.now.fetch_add(1, Ordering::SeqCst) + 1;
        g.most.fetch_max(n, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(700)).await;
        g.now.fetch_sub(1, Ordering::SeqCst);
        g.done.fetch_add(1, Ordering::SeqCst);
        (StatusCode::OK, Bytes::new())
    }
    let s = ApiHub::start(
        "claimbytes",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "5s"),
            ("STREAMING_HUB_DISPATCH_CLAIMS_AHEAD_BYTES", "250000"),
        ],
    )
    .await;
    let gauge = Gauge::default();
    let app = Router::new()
        .route("/hook", post(slow))
        .with_state(gauge.clone());
    let addr = serve(app).await;
    let url = format!("http://{addr}/hook");
    subscribe(&s, "tenant-big", &url, None).await;
    let pad = "x".repeat(100_000);
    let events: Vec<Rec> = (0..10)
        .map(|_| {
            let mut e = event("tenant-big", "ledger", "transaction", "created");
            e.value = Some(format!("{{\"pad\":\"{pad}\"}}").into_bytes());
            e
        })
        .collect();
    produce(&producer(), &s.topic, &events);
    wait_until(Duration::from_secs(120), "ten deliveries", || {
        (gauge.done.load(Ordering::SeqCst) >= events.len()).then_some(())
    });
    let most = gauge.most.load(Ordering::SeqCst);
    assert!(
        (1..=3).contains(&most),
        "{most} deliveries of ~100 kB events at once under a 250 kB bound"
    );
}

/// Claims run ahead of the workers only as far as the attempts' measured time lets them start
/// within their lease. One worker and a 1 s timeout (an 11 s lease: an attempt may wait 10 s
/// for the worker):
/// - the sink answers at once: the tenant's attempts are timed fast;
/// - it turns to 300 ms, and 40 events come at once: claimed together at the fast pace, 12 s of
///   work for one worker. Those that waited past 10 s are handed back unsent and counted
///   (`streaming_hub_attempts_unsent_total`), claimed again, and delivered;
/// - 40 more events at 300 ms: claimed at the measured pace (one running and 17 waiting, 5 s of
///   work), none is handed back. With fixed bounds alone they were all claimed at once, as before.
///
/// Every event is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_run_ahead_only_as_far_as_the_workers_start_them_within_the_lease() {
    let s = ApiHub::start(
        "unsent",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "1s"),
            ("STREAMING_HUB_DISPATCH_WORKERS", "1"),
        ],
    )
    .await;
    let (url, sink) = start_slow_sink(vec![200], Duration::ZERO).await;
    subscribe(&s, "tenant-slow", &url, None).await;
    let p = producer();
    let batch = |n: usize| -> Vec<Rec> {
        (0..n)
            .map(|_| event("tenant-slow", "ledger", "transaction", "created"))
            .collect()
    };
    let mut events = batch(10);
    produce(&p, &s.topic, &events);
    wait_for_deliveries(&sink, events.len(), Duration::from_secs(60));

    sink.delay.store(300, Ordering::SeqCst);
    let burst = batch(40);
    produce(&p, &s.topic, &burst);
    events.extend(burst);
    s.wait_metric("streaming_hub_attempts_unsent_total", 1)
        .await;
    wait_for_deliveries(&sink, events.len(), Duration::from_secs(120));
    let unsent = s.metric("streaming_hub_attempts_unsent_total").await;

    let paced = batch(40);
    produce(&p, &s.topic, &paced);
    events.extend(paced);
    let got = wait_for_deliveries(&sink, events.len(), Duration::from_secs(120));
    assert_eq!(
        s.metric("streaming_hub_attempts_unsent_total").await,
        unsent,
        "claimed at the measured pace, no attempt waited out its lease"
    );
    let mut ids: Vec<&str> = got
        .iter()
        .map(|r| r.headers["x-lerian-event-id"].as_str())
        .collect();
    ids.sort_unstable();
    let mut want: Vec<String> = events.iter().map(|e| e.id()).collect();
    want.sort_unstable();
    assert_eq!(
        ids, want,
        "each event once: an attempt handed back was never sent"
    );
}

/// `n` events of `tenant`.
fn wave(tenant: &str, n: usize) -> Vec<Rec> {
    (0..n)
        .map(|_| event(tenant, "ledger", "transaction", "created"))
        .collect()
}

/// A destination that holds its requests (no failure, so no breaker) does not keep the workers
/// from another tenant: S's 16 requests are held at a gate that opens only after F's event is
/// delivered, with 16 workers and a timeout far past the test's waits. F's delivery can then come
/// only from a worker S does not hold: a hub that let S take them all would deliver F only once
/// a held request timed out (120 s), and the 60 s wait fails. No timing bound is involved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_destination_does_not_keep_the_workers_from_another_tenant() {
    let s = ApiHub::start(
        "slowneighbour",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "120s"),
            ("STREAMING_HUB_DISPATCH_WORKERS", "16"),
        ],
    )
    .await;
    let (slow_url, held, gate) = start_gated_sink(StatusCode::OK).await;
    let (fast_url, fast_sink) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-s", &slow_url, None).await;
    subscribe(&s, "tenant-f", &fast_url, None).await;
    let p = producer();
    produce(&p, &s.topic, &wave("tenant-s", 16));
    wait_until(Duration::from_secs(60), "S holding 15 workers", || {
        (*held.lock().unwrap() >= 15).then_some(())
    });
    let ev = event("tenant-f", "ledger", "transaction", "created");
    produce(&p, &s.topic, std::slice::from_ref(&ev));
    let got = wait_for_deliveries(&fast_sink, 1, Duration::from_secs(60));
    assert_eq!(got[0].headers["x-lerian-event-id"], ev.id());
    gate.send(true).unwrap();
    wait_until(Duration::from_secs(60), "S's 16 requests", || {
        (*held.lock().unwrap() == 16).then_some(())
    });
}

/// A slow tenant left alone between another tenant's waves keeps room for that tenant's recent
/// demand. With 16 workers: tenant F's 8 requests are held 8 s at its sink, S's 20 arrive
/// meanwhile (not timed yet, so taken as slow) and take F's share at a sink that holds them at a
/// gate, then F's requests end and S is alone. S may hold 16 less F's recent peak (7 or 8, as
/// sampled), so of the 7 or 8 workers left F's second wave of 8 gets all but the reserve's one
/// (kept for a tenant holding none) at once: 6 or 7, checked as 6 at the sink before any is
/// answered. The rest go when those end, and the wave is answered while every request of S's is
/// still held. Before, S took 15 workers the moment F's
/// first wave ended, and F's second wave went one at a time on the last worker (64 s, past the
/// 60 s wait). S's gate opens only after that, and the timeout (120 s) is past every wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tenant_alone_between_another_tenants_waves_leaves_room_for_them() {
    let s = ApiHub::start(
        "slowroom",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "120s"),
            ("STREAMING_HUB_DISPATCH_WORKERS", "16"),
        ],
    )
    .await;
    let (slow_url, held, gate) = start_gated_sink(StatusCode::OK).await;
    let (fast_url, fast_sink) = start_slow_sink(vec![200], Duration::from_secs(8)).await;
    subscribe(&s, "tenant-s", &slow_url, None).await;
    subscribe(&s, "tenant-f", &fast_url, None).await;
    let p = producer();
    produce(&p, &s.topic, &wave("tenant-f", 8));
    wait_for_deliveries(&fast_sink, 8, Duration::from_secs(60));
    produce(&p, &s.topic, &wave("tenant-s", 20));
    wait_until(Duration::from_secs(60), "S holding 8 workers", || {
        (*held.lock().unwrap() >= 8).then_some(())
    });
    wait_until(Duration::from_secs(60), "F's first wave answered", || {
        (fast_sink.answered.load(Ordering::SeqCst) == 8).then_some(())
    });
    produce(&p, &s.topic, &wave("tenant-f", 8));
    // 6 of the second wave at the sink at once: each is held 8 s there, so none is answered yet.
    // On one worker each would wait for the one before it to be answered.
    wait_until(
        Duration::from_secs(60),
        "6 of F's second wave received",
        || (fast_sink.got.lock().unwrap().len() >= 14).then_some(()),
    );
    assert_eq!(
        fast_sink.answered.load(Ordering::SeqCst),
        8,
        "F's second wave went out one request at a time"
    );
    wait_until(Duration::from_secs(60), "F's second wave answered", || {
        (fast_sink.answered.load(Ordering::SeqCst) == 16).then_some(())
    });
    gate.send(true).unwrap();
    wait_until(Duration::from_secs(120), "S's 20 requests", || {
        (*held.lock().unwrap() == 20).then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_delivered_within_its_transaction_writes_no_job_or_payload_to_the_state_changelog()
{
    // A new event's first attempts start before its transaction commits, and one that ends
    // within `STREAMING_HUB_EARLY_ATTEMPT_WAIT` (generous here: a slow machine's first
    // connection) is recorded in that transaction: its job, timers and payload were new to the
    // store, so nothing of them is written. An event with a failed first attempt keeps its job
    // and payload, and its retry still carries its body.
    let s = ApiHub::start(
        "early",
        &[
            ("STREAMING_HUB_EARLY_ATTEMPT_WAIT", "10s"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "5s"),
        ],
    )
    .await;
    let (ok_url, ok_sink) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-e", &ok_url, None).await;
    s.commit_inbox_offsets().await;
    // One at a time: a transaction stops waiting once later records have come in (see
    // `a_transaction_stops_waiting_for_its_first_attempts_once_new_events_come_in`).
    let p = producer();
    for n in 1..=5 {
        let ev = event("tenant-e", "ledger", "transaction", "posted");
        produce(&p, &s.topic, std::slice::from_ref(&ev));
        wait_for_deliveries(&ok_sink, n, Duration::from_secs(60));
    }
    let codec = Codec::new().unwrap();
    let attempts_topic = format!("{}.attempts", s.prefix);
    let attempts = read_until(&[&attempts_topic], Duration::from_secs(30), |r| {
        r.len() >= 5
    });
    for a in &attempts {
        let a: AttemptRecord = codec
            .decode(RecordKind::Attempt, a.rec.value.as_ref().unwrap())
            .unwrap();
        assert_eq!(a.status, Some(200));
    }
    let changelog = format!("{}.hub.jobs.changelog", s.prefix);
    let keys = |got: &[Got]| -> Vec<String> {
        got.iter()
            .map(|g| String::from_utf8_lossy(g.rec.key.as_deref().unwrap_or_default()).into_owned())
            .collect()
    };
    let written = keys(&read_all(&[&changelog], Duration::from_secs(30)));
    assert_eq!(
        written
            .iter()
            .filter(|k| k.starts_with("d/tenant-e"))
            .count(),
        5,
        "each event's dedup entry: {written:?}"
    );
    assert!(
        !written
            .iter()
            .any(|k| k.starts_with("j/") || k.starts_with("p/")),
        "no job or payload written for events delivered within their transaction: {written:?}"
    );

    // A second subscription whose first attempt fails: the event's job for it, and its payload
    // (one holder left), are written; the retry gets the event's body.
    let (retry_url, retry_sink) = start_sink(vec![500, 200]).await;
    subscribe(&s, "tenant-e", &retry_url, Some(vec!["1s"])).await;
    let ev = event("tenant-e", "ledger", "transaction", "posted");
    produce(&producer(), &s.topic, std::slice::from_ref(&ev));
    let got = wait_for_deliveries(&retry_sink, 2, Duration::from_secs(60));
    assert_eq!(got[1].body, ev.value.clone().unwrap(), "the retry's body");
    assert_eq!(got[1].headers["x-lerian-event-id"], ev.id());
    wait_for_deliveries(&ok_sink, 6, Duration::from_secs(60));
    let job = format!("j/tenant-e\0{}\0", ev.id());
    let payload = format!("p/tenant-e\0{}", ev.id());
    // Written while it waited for its retry, then deleted once delivered (a tombstone last).
    let history = key_history;
    let got = read_until(&[&changelog], Duration::from_secs(30), |r| {
        history(r, &job).last() == Some(&false)
    });
    let (jobs, payloads) = (history(&got, &job), history(&got, &payload));
    assert!(jobs.len() >= 2 && jobs[0], "job records: {jobs:?}");
    assert!(
        payloads.len() >= 2 && payloads[0] && payloads.last() == Some(&false),
        "payload records: {payloads:?}"
    );

    // Nothing was lost to a restart: the delivered events are not delivered again.
    let mut s = s;
    let env = s.hub.env.clone();
    s.hub.kill();
    s.hub = Hub::start(&env);
    let last = event("tenant-e", "ledger", "transaction", "posted");
    produce(&producer(), &s.topic, std::slice::from_ref(&last));
    let got = wait_for_deliveries(&ok_sink, 7, Duration::from_secs(60));
    assert_eq!(got[6].headers["x-lerian-event-id"], last.id());
    let ids: std::collections::HashSet<&str> = got
        .iter()
        .map(|d| d.headers["x-lerian-event-id"].as_str())
        .collect();
    assert_eq!(ids.len(), 7, "every event once at the first sink");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_attempt_that_ends_while_its_transaction_sends_its_offsets_is_recorded_in_it() {
    // With a 1 µs wait for its first attempts a transaction sees none end within it (and the
    // next ones then do not wait at all); an attempt that ends while the transaction's
    // offsets go to the coordinator, a broker round trip, is still recorded in it, before its
    // jobs changelog writes, and leaves no job or payload record, as one that ends within the
    // wait. Events go one at a time until one has: a hub that wrote its jobs changelog before
    // the offsets records none there, whatever the timing.
    let s = ApiHub::start("early-late", &[("STREAMING_HUB_EARLY_ATTEMPT_WAIT", "1us")]).await;
    let (url, sink) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-l", &url, None).await;
    s.commit_inbox_offsets().await;
    const NEW: &str = "streaming_hub_hub_events_total{outcome=\"new\"";
    let new_before = s.metric(NEW).await;
    const EARLY: &str = "streaming_hub_early_attempts_total";
    let ended = |text: &str, when: &str| metric_sum(text, &format!("{EARLY}{{ended=\"{when}\""));
    let p = producer();
    let mut sent = 0;
    let text = loop {
        produce(
            &p,
            &s.topic,
            &[event("tenant-l", "ledger", "transaction", "posted")],
        );
        sent += 1;
        wait_for_deliveries(&sink, sent, Duration::from_secs(60));
        // Its transaction committed (its early attempts are counted with it).
        let text = s
            .hub
            .metrics_when(&s.http, NEW, new_before + sent as u64)
            .await;
        if ended(&text, "before_writes") > 0 || sent == 200 {
            break text;
        }
    };
    let (within, late, after) = (
        ended(&text, "within_wait"),
        ended(&text, "before_writes"),
        ended(&text, "after_wait"),
    );
    assert!(
        late >= 1,
        "no first attempt recorded between its transaction's offsets and its writes in {sent} events \
         ({within} within the wait, {after} after)"
    );
    // Each event's first attempt was early, but for one whose transaction aborted (read again
    // on the committed-claim path).
    assert!(
        within + late + after <= sent as u64,
        "{within} + {late} + {after} > {sent}"
    );
    // Only the events whose first attempt was not recorded in their own transaction wrote a job
    // and a payload (and, once delivered, their tombstones).
    let changelog = format!("{}.hub.jobs.changelog", s.prefix);
    let events_with = |prefix: &str, got: &[Got]| -> std::collections::HashSet<String> {
        got.iter()
            .filter_map(|g| {
                let key = String::from_utf8_lossy(g.rec.key.as_deref()?).into_owned();
                let rest = key.strip_prefix(prefix)?;
                Some(rest.split('\0').nth(1)?.to_string())
            })
            .collect()
    };
    let got = read_all(&[&changelog], Duration::from_secs(30));
    let (jobs, payloads) = (events_with("j/", &got), events_with("p/", &got));
    assert_eq!(
        jobs.len() as u64,
        sent as u64 - within - late,
        "events with job records: {jobs:?}"
    );
    assert_eq!(payloads, jobs, "events with payload records");
}

/// A sink that holds every delivery until the test opens its gate, then answers `status`.
async fn start_gated_sink(
    status: StatusCode,
) -> (String, Arc<Mutex<usize>>, tokio::sync::watch::Sender<bool>) {
    #[derive(Clone)]
    struct Gated {
        got: Arc<Mutex<usize>>,
        open: tokio::sync::watch::Receiver<bool>,
        status: StatusCode,
    }
    async fn held(State(g): State<Gated>, headers: HeaderMap, body: Bytes) -> (StatusCode, Bytes) {
        let probe = headers
            .get("x-lerian-event-type")
            .is_some_and(|v| v == "streaming_hub.verification");
        if probe {
            return (StatusCode::OK, body); // echo the challenge
        }
        *g.got.lock().unwrap() += 1;
        let mut open = g.open.clone();
        let _ = open.wait_for(|o| *o).await;
        (g.status, Bytes::new())
    }
    let (gate, open) = tokio::sync::watch::channel(false);
    let got = Arc::new(Mutex::new(0));
    let app = Router::new().route("/hook", post(held)).with_state(Gated {
        got: got.clone(),
        open,
        status,
    });
    let addr = serve(app).await;
    (format!("http://{addr}/hook"), got, gate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_stops_waiting_for_its_first_attempts_once_new_events_come_in() {
    // The transaction that took A's event in waits for A's first attempt (up to the 30 s set
    // here) while the hub cannot take in anything else; once B's event has come in, it stops
    // waiting and commits, so B is delivered while A's receiver still holds its request. A
    // hub that waited the whole bound would deliver B only after it (the 20 s below fail then).
    let s = ApiHub::start(
        "early-stop",
        &[
            ("STREAMING_HUB_EARLY_ATTEMPT_WAIT", "30s"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "60s"),
        ],
    )
    .await;
    let (held_url, held, gate) = start_gated_sink(StatusCode::OK).await;
    let (fast_url, fast) = start_sink(vec![200]).await;
    subscribe(&s, "tenant-a", &held_url, None).await;
    subscribe(&s, "tenant-b", &fast_url, None).await;
    s.commit_inbox_offsets().await;
    let p = producer();
    let a = event("tenant-a", "ledger", "transaction", "posted");
    produce(&p, &s.topic, std::slice::from_ref(&a));
    wait_until(
        Duration::from_secs(60),
        "A's first attempt at its sink",
        || (*held.lock().unwrap() == 1).then_some(()),
    );
    let b = event("tenant-b", "ledger", "transaction", "posted");
    produce(&p, &s.topic, std::slice::from_ref(&b));
    let got = wait_for_deliveries(&fast, 1, Duration::from_secs(20));
    assert_eq!(got[0].headers["x-lerian-event-id"], b.id());
    // The transaction committed without A's outcome: A's job was written, to be finished later.
    let changelog = format!("{}.hub.jobs.changelog", s.prefix);
    let job = format!("j/tenant-a\0{}\0", a.id());
    read_until(&[&changelog], Duration::from_secs(30), |r| {
        r.iter().any(|g| {
            g.rec.value.is_some()
                && g.rec
                    .key
                    .as_deref()
                    .is_some_and(|k| k.starts_with(job.as_bytes()))
        })
    });
    // Opened, A's attempt ends and is recorded: one attempt, delivered.
    gate.send(true).unwrap();
    let codec = Codec::new().unwrap();
    let attempts_topic = format!("{}.attempts", s.prefix);
    let attempts = read_until(&[&attempts_topic], Duration::from_secs(60), |r| {
        r.iter()
            .any(|g| g.rec.key.as_deref() == Some(a.id().as_bytes()))
    });
    let of_a: Vec<AttemptRecord> = attempts
        .iter()
        .filter(|g| g.rec.key.as_deref() == Some(a.id().as_bytes()))
        .map(|g| {
            codec
                .decode(RecordKind::Attempt, g.rec.value.as_ref().unwrap())
                .unwrap()
        })
        .collect();
    assert_eq!(of_a.len(), 1, "A's attempts: {of_a:?}");
    assert_eq!(of_a[0].status, Some(200));
    assert_eq!(*held.lock().unwrap(), 1, "A was sent once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_of_attempts_sent_before_a_url_change_count_for_the_old_destinations_breaker() {
    // Five attempts are in flight to A when the subscription moves to B; A then fails all five.
    // They are A's failures: A's breaker opens, B's does not (it would shed B's deliveries for
    // the cool-down while B is healthy).
    let s = ApiHub::start("moved", &[("STREAMING_HUB_HTTP_TIMEOUT", "60s")]).await;
    let (url_a, held, gate) = start_gated_sink(StatusCode::INTERNAL_SERVER_ERROR).await;
    let (url_b, sink_b) = start_sink(vec![200]).await;
    let (id, _) = subscribe(&s, "tenant-m", &url_a, None).await;
    let p = producer();
    let events: Vec<_> = (0..5)
        .map(|_| event("tenant-m", "ledger", "transaction", "posted"))
        .collect();
    produce(&p, &s.topic, &events);
    wait_until(Duration::from_secs(60), "five attempts held at A", || {
        (*held.lock().unwrap() == 5).then_some(())
    });
    let mut moved = control_records(&s.prefix)[&id].clone();
    moved.destination.url = Some(url_b.clone());
    moved.version += 1;
    write_control_record(&s, &moved).await;
    gate.send(true).unwrap();
    let codec = Codec::new().unwrap();
    let attempts_topic = format!("{}.attempts", s.prefix);
    read_until(&[&attempts_topic], Duration::from_secs(60), |r| {
        r.iter()
            .filter_map(|g| g.rec.value.as_ref())
            .filter(|v| {
                codec
                    .decode::<AttemptRecord>(RecordKind::Attempt, v)
                    .is_ok_and(|a| a.status == Some(500))
            })
            .count()
            >= 5
    });
    let origin = |url: &str| format!("destination=\"{}\"", url.trim_end_matches("/hook"));
    let log = s.hub.log_text();
    let opened: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("circuit breaker") && l.contains("opened"))
        .collect();
    assert!(
        opened.iter().any(|l| l.contains(&origin(&url_a))),
        "A's breaker opened: {opened:?}"
    );
    assert!(
        !opened.iter().any(|l| l.contains(&origin(&url_b))),
        "B's breaker opened on A's failures: {opened:?}"
    );
    // B, its breaker closed, takes a new event (the five retries follow on their curve).
    let ev = event("tenant-m", "ledger", "transaction", "posted");
    produce(&p, &s.topic, std::slice::from_ref(&ev));
    wait_until(Duration::from_secs(60), "the new event at B", || {
        sink_b
            .got
            .lock()
            .unwrap()
            .iter()
            .any(|d| d.headers["x-lerian-event-id"] == ev.id())
            .then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_that_is_not_a_uuid_goes_percent_encoded_alike_in_every_id_header_and_the_signature()
{
    // With STREAMING_HUB_REQUIRE_UUIDV7=false an id may hold a space, `%` or non-ASCII letters.
    // `ce-id` carries it percent-encoded (the CloudEvents HTTP binding); `webhook-id` and
    // `X-Lerian-Event-Id` carry that same visible-ASCII string, and it is what is signed, so a
    // receiver verifies over the header it reads whatever charset its framework decodes with.
    let s = ApiHub::start(
        "raw-id",
        &[
            ("STREAMING_HUB_REQUIRE_UUIDV7", "false"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "5s"),
        ],
    )
    .await;
    let (url, sink) = start_sink(vec![200]).await;
    let (_, secret) = subscribe(&s, "tenant-r", &url, None).await;
    let raw = format!(
        "pedido 42/a\u{e7}\u{e3}o 100% {}",
        uuid::Uuid::now_v7().simple()
    );
    let ev =
        event("tenant-r", "ledger", "transaction", "created").set("ce-id", Some(raw.as_bytes()));
    produce(&producer(), &s.topic, std::slice::from_ref(&ev));
    let got = wait_for_deliveries(&sink, 1, Duration::from_secs(60));
    let h = &got[0].headers;
    let encoded = h["ce-id"].clone();
    assert!(
        encoded.starts_with("pedido%2042/a%C3%A7%C3%A3o%20100%25%20"),
        "{encoded}"
    );
    assert_eq!(
        percent_encoding::percent_decode_str(&encoded)
            .decode_utf8()
            .unwrap(),
        raw
    );
    assert_eq!(h["webhook-id"], encoded);
    assert_eq!(h["x-lerian-event-id"], encoded);
    let ts: i64 = h["webhook-timestamp"].parse().unwrap();
    let want = signing::sign(&Secret::new(secret), &h["webhook-id"], ts, &got[0].body).unwrap();
    assert_eq!(h["webhook-signature"], want);
}

/// `streaming-hub replay <args>` with exactly the environment `env`.
fn replay(env: &BTreeMap<String, String>, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
        .arg("replay")
        .args(args)
        .env_clear()
        .envs(env)
        .output()
        .unwrap()
}

/// Of the records whose key starts with `key`, in order: whether each has a value (false: a
/// tombstone).
fn key_history(got: &[Got], key: &str) -> Vec<bool> {
    got.iter()
        .filter(|g| {
            g.rec
                .key
                .as_deref()
                .is_some_and(|k| k.starts_with(key.as_bytes()))
        })
        .map(|g| g.rec.value.is_some())
        .collect()
}

/// A hub with `extra` settings, 12 tenants subscribed to one gated sink (closed), and every inbox
/// partition of the hub's: the sink's request count and its gate.
async fn gated_hub(
    tag: &str,
    extra: &[(&str, &str)],
) -> (
    ApiHub,
    Vec<String>,
    Arc<Mutex<usize>>,
    tokio::sync::watch::Sender<bool>,
) {
    let s = ApiHub::start(tag, extra).await;
    let (url, got, gate) = start_gated_sink(StatusCode::OK).await;
    let tenants: Vec<String> = (0..12).map(|i| format!("tenant-{i}")).collect();
    for t in &tenants {
        subscribe(&s, t, &url, None).await;
    }
    assert_eq!(
        wait_owned(&s, 6).await,
        6,
        "the hub owns every inbox partition"
    );
    (s, tenants, got, gate)
}

/// Waits (up to 120 s) until the hub's loops own `n` inbox partitions; how many they own then.
async fn wait_owned(s: &ApiHub, n: usize) -> usize {
    let mut owned = 0;
    for _ in 0..1200 {
        owned = partitions_by_loop(s).await.values().map(Vec::len).sum();
        if owned == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    owned
}

/// One event per tenant, produced to the hub's source topic.
fn produce_one_each(s: &ApiHub, tenants: &[String]) -> Vec<Rec> {
    let events: Vec<Rec> = tenants
        .iter()
        .map(|t| event(t, "ledger", "transaction", "created"))
        .collect();
    produce(&producer(), &s.topic, &events);
    events
}

/// The events `<prefix>.attempts` records as delivered.
fn delivered_events(codec: &Codec, recs: &[Got]) -> std::collections::BTreeSet<String> {
    recs.iter()
        .filter_map(|g| {
            codec
                .decode::<AttemptRecord>(RecordKind::Attempt, g.rec.value.as_ref()?)
                .ok()
        })
        .filter(|a| a.outcome == streaming_hub::runtime::records::AttemptOutcome::Delivered)
        .map(|a| a.event_id)
        .collect()
}

/// Waits until `<prefix>.attempts` records each of `events` as delivered.
fn wait_delivered(s: &ApiHub, events: &[Rec], timeout: Duration) {
    let ids: std::collections::BTreeSet<String> = events.iter().map(Rec::id).collect();
    let codec = Codec::new().unwrap();
    let attempts = format!("{}.attempts", s.prefix);
    read_until(&[&attempts], timeout, |recs| {
        delivered_events(&codec, recs).is_superset(&ids)
    });
}

/// After a second instance `b` joined while `events` (one per tenant) were being delivered:
/// they and one more event per tenant are all delivered, `b` took partitions, and the sink got
/// each event once (`before`: its count before `events`).
async fn each_sent_once(
    s: &ApiHub,
    b: &Hub,
    tenants: &[String],
    got: &Mutex<usize>,
    before: usize,
    events: &[Rec],
) {
    wait_delivered(s, events, Duration::from_secs(120));
    // One more event per tenant: once each is delivered, whichever instance owns its partition
    // has read past the events above.
    let last = produce_one_each(s, tenants);
    wait_delivered(s, &last, Duration::from_secs(120));
    let theirs = owned_by_loop(&b.metrics_text(&s.http).await.unwrap());
    assert!(
        !theirs.is_empty(),
        "the second instance took no partition: nothing moved"
    );
    assert_eq!(
        *got.lock().unwrap(),
        before + events.len() + last.len(),
        "an event was sent again (second instance's partitions: {theirs:?})"
    );
}

/// A partition given up in order (another member joins the group) takes its attempts'
/// outcomes with it (DESIGN.md §3: "on revocation it commits and closes"): the loop waits for
/// the attempts in flight of the partitions it gives up and commits their outcomes inside the
/// revocation, so each is on `<prefix>.attempts` while the new owner holds the partition. A hub
/// that dropped them left those jobs leased: the next owner sent the events again after their
/// leases (70 s here), and no attempt was recorded while another member held them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_of_attempts_in_flight_on_partitions_given_up_are_committed_before_they_go() {
    let (s, tenants, got, gate) = gated_hub(
        "revoke",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "60s"),
            // Longer than the default: the test opens the sink once it reads the hub waiting.
            ("STREAMING_HUB_REBALANCE_WAIT", "30s"),
        ],
    )
    .await;
    let inbox = format!("{}.inbox", s.prefix);
    let group = format!("{}-group.hub", s.prefix);
    let events = produce_one_each(&s, &tenants);
    // Every attempt is in flight, held by the sink.
    wait_until(Duration::from_secs(90), "12 attempts at the sink", || {
        (*got.lock().unwrap() == events.len()).then_some(())
    });

    // Another member joins: the hub gives up some partitions while their attempts are held.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = Arc::new(Mutex::new(Vec::new()));
    let squatter = squatter_thread(group, inbox.clone(), stop.clone(), held.clone());
    s.hub.wait_logged(
        Duration::from_secs(120),
        "partitions given up: waiting for their attempts in flight",
        &[],
    );
    gate.send(true).unwrap();
    let theirs: Vec<i32> = wait_until(Duration::from_secs(120), "the squatter holds some", || {
        let h = held.lock().unwrap().clone();
        (!h.is_empty()).then_some(h)
    });

    // The events on the squatter's partitions, now nobody's in the hub.
    let ids: std::collections::BTreeSet<String> = events.iter().map(Rec::id).collect();
    let on_theirs: std::collections::BTreeSet<String> =
        read_until(&[&inbox], Duration::from_secs(60), |got| {
            got.iter()
                .filter(|g| g.rec.header("ce-id").is_some_and(|id| ids.contains(id)))
                .count()
                == ids.len()
        })
        .iter()
        .filter(|g| theirs.contains(&g.partition))
        .filter_map(|g| g.rec.header("ce-id").map(str::to_string))
        .filter(|id| ids.contains(id))
        .collect();
    assert!(
        !on_theirs.is_empty(),
        "no event on the partitions given up {theirs:?}: the test shows nothing"
    );
    // Their attempts are recorded, delivered, while the squatter holds their partitions.
    let codec = Codec::new().unwrap();
    let delivered = |recs: &[Got]| delivered_events(&codec, recs);
    let attempts = read_until(
        &[&format!("{}.attempts", s.prefix)],
        Duration::from_secs(30),
        |recs| delivered(recs) == ids,
    );
    assert!(delivered(&attempts).is_superset(&on_theirs));
    assert_eq!(
        *held.lock().unwrap(),
        theirs,
        "the squatter held its partitions throughout"
    );
    assert_eq!(*got.lock().unwrap(), events.len(), "no attempt sent twice");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    squatter.join().unwrap();
}

/// A hub transaction still open when another instance joins the group commits under the
/// generation that follows instead of aborting: in the cooperative protocol the partitions it
/// holds stay its own or nobody's until it serves their revocation. The new instance then starts
/// the partitions it takes past that transaction's events, whose first attempts were already
/// sent, and sends none of them again. Before, the transaction aborted ("the group moved to
/// generation N"), and the new owner of each partition that moved sent its events a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_when_another_instance_joins_commits_and_its_events_go_once() {
    let (s, tenants, got, gate) = gated_hub(
        "joined",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "60s"),
            // The transaction stays open on its held first attempts until the group has moved.
            ("STREAMING_HUB_EARLY_ATTEMPT_WAIT", "30s"),
            // The revocation waits for the attempts it gives up until the test lets them end.
            ("STREAMING_HUB_REBALANCE_WAIT", "60s"),
        ],
    )
    .await;
    // One event per tenant goes through first: a partition the group never committed takes
    // every record on the committed-claim path, with no early attempt.
    gate.send(true).unwrap();
    let first = produce_one_each(&s, &tenants);
    wait_delivered(&s, &first, Duration::from_secs(90));
    gate.send(false).unwrap();
    let before = *got.lock().unwrap();

    let events = produce_one_each(&s, &tenants);
    wait_until(Duration::from_secs(90), "12 attempts at the sink", || {
        (*got.lock().unwrap() == before + events.len()).then_some(())
    });

    // Another instance joins while the transaction waits for its first attempts. It is ready
    // only once it has its share, which waits for this revocation, so not waited for yet.
    let b = Hub::spawn(&another_instance(&s.hub.env, "2"));
    s.hub.wait_logged(
        Duration::from_secs(120),
        "partitions given up: waiting for their attempts in flight",
        &[&b],
    );
    gate.send(true).unwrap();
    b.wait_ready();
    each_sent_once(&s, &b, &tenants, &got, before, &events).await;
    // Not asserted: no abort at all. A later transaction's offsets can still meet the broker's
    // refusal in the moment the next round moves the generation (seen in CI); its events were
    // all on partitions this instance keeps, and the count above holds.
}

/// A transaction whose offsets the coordinator refuses because the group moved to the next
/// generation while they were on their way (`ILLEGAL_GENERATION`: librdkafka then forces an
/// abort) runs again at once under that generation, before its loop serves the revocation, so the
/// partitions that move go with their events done and the new owner sends none of them again.
/// Before, the loop read the batch again after the revocation, and the new owner of each
/// partition that moved sent its events' first attempts a second time (the duplicates left in
/// session 38's `scale-out` runs). The refusal is made on demand: the first transaction with
/// early first attempts holds its offsets, group metadata taken, until a second instance has
/// joined and the group has moved on (`STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_offsets_were_refused_as_the_group_moved_runs_again_and_its_events_go_once() {
    let (s, tenants, got, gate) = gated_hub(
        "refused",
        &[
            ("STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS", "true"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "60s"),
        ],
    )
    .await;
    gate.send(true).unwrap();
    // First one event per tenant that no subscription takes (`account.*`), so every partition
    // of theirs has a committed offset (a partition the group never committed takes every
    // record on the committed-claim path, with no early attempt) and no transaction has started
    // a first attempt early: the hold is the next batch's. Delivered events here would race:
    // a partition first committed by one transaction and read again in the next takes the
    // early path, and that earlier transaction took the one hold (seen in CI).
    let unmatched: Vec<Rec> = tenants
        .iter()
        .map(|t| event(t, "ledger", "account", "created"))
        .collect();
    produce(&producer(), &s.topic, &unmatched);
    let inbox = format!("{}.inbox", s.prefix);
    let ids: std::collections::BTreeSet<String> = unmatched.iter().map(Rec::id).collect();
    read_until(&[&inbox], Duration::from_secs(90), |got| {
        let seen: std::collections::BTreeSet<String> = got.iter().map(|g| g.rec.id()).collect();
        seen.is_superset(&ids)
    });
    let group = format!("{}-group.hub", s.prefix);
    wait_until(
        Duration::from_secs(90),
        "the hub group past the unmatched events",
        || group_caught_up(&group, &inbox).then_some(()),
    );
    assert!(
        !s.hub
            .log_text()
            .contains("holding this transaction's offsets until the group moves on"),
        "a transaction without first attempts was held"
    );
    let before = *got.lock().unwrap();
    assert_eq!(before, 0, "an unmatched event was delivered");

    // The sink holds the first attempts, so their jobs stay leased in the held transaction (its
    // dedup and sequence records written before the hold; its jobs records would follow the
    // refused offsets), and the run again must not send them a second time.
    gate.send(false).unwrap();
    let events = produce_one_each(&s, &tenants);
    s.hub.wait_logged(
        Duration::from_secs(90),
        "holding this transaction's offsets until the group moves on",
        &[],
    );
    // The second instance without the hook: its own first transaction is not held.
    let mut env2 = another_instance(&s.hub.env, "2");
    env2.remove("STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS");
    // Ready only once it has its share, which waits for the revocation of the attempts the
    // sink holds: not waited for until the sink lets them end.
    let b = Hub::spawn(&env2);
    s.hub.wait_logged(
        Duration::from_secs(120),
        "hub batch runs again at once under the group's next generation",
        &[&b],
    );
    let again = metric_sum(
        &s.hub.metrics_text(&s.http).await.unwrap(),
        "streaming_hub_hub_batches_run_again_total",
    );
    assert_eq!(again, 1, "one batch run again");
    gate.send(true).unwrap();
    b.wait_ready();
    each_sent_once(&s, &b, &tenants, &got, before, &events).await;
    // Each event counted new once over both instances (with the one more per tenant that
    // `each_sent_once` sends): the run whose offsets were refused aborted, and its counts with
    // it. Counted as it ran, the events of the refused run were counted twice.
    wait_until(
        Duration::from_secs(90),
        "the hub group past every event",
        || group_caught_up(&group, &inbox).then_some(()),
    );
    let expected = (unmatched.len() + events.len() + tenants.len()) as u64;
    let new_events = "streaming_hub_hub_events_total{outcome=\"new\"";
    let mut counted = 0;
    for _ in 0..100 {
        counted = 0;
        for hub in [&s.hub, &b] {
            counted += metric_sum(&hub.metrics_text(&s.http).await.unwrap(), new_events);
        }
        if counted >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(counted, expected, "events counted new");
}
