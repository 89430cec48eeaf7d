//! Operations against the real binary and broker: the pull API (order, cursor across a restart
//! and across instances, rate limit), recover / redrive / per-subscription replay (each redelivers
//! to one subscription only; a payload that gains a holder while an attempt is in flight outlives
//! that attempt; a run whose request the broker refuses fails alone), the forensics index of
//! producers' DLQs and the quarantine (never delivered), and SIGTERM during deliveries (every
//! attempt a sink saw is recorded).
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::*;
use serde_json::{Value, json};
use streaming_hub::config::Config;
use streaming_hub::ops::redeliver::{Progress, RedeliverError, Redeliverer};
use streaming_hub::runtime::avro::{Codec, RecordKind};
use streaming_hub::runtime::records::{
    AttemptRecord, DeadLetterReason, DeadLetterRecord, HeaderRecord,
};

#[derive(Clone)]
struct Sink {
    got: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
    status: Arc<AtomicU16>,
    delay: Duration,
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
        return (StatusCode::OK, body);
    }
    s.got.lock().unwrap().push(h);
    if !s.delay.is_zero() {
        tokio::time::sleep(s.delay).await;
    }
    (
        StatusCode::from_u16(s.status.load(Ordering::SeqCst)).unwrap(),
        Bytes::new(),
    )
}

async fn start_sink(status: u16, delay: Duration) -> (String, Sink) {
    let sink = Sink {
        got: Arc::default(),
        status: Arc::new(AtomicU16::new(status)),
        delay,
    };
    let app = Router::new()
        .route("/hook", post(sink_handler))
        .with_state(sink.clone());
    let addr = serve(app).await;
    (format!("http://{addr}/hook"), sink)
}

impl Sink {
    fn count(&self, event_id: &str) -> usize {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|h| h.get("x-lerian-event-id").map(String::as_str) == Some(event_id))
            .count()
    }

    fn wait_count(&self, event_id: &str, n: usize) {
        wait_until(
            Duration::from_secs(60),
            &format!("{n} deliveries of {event_id}"),
            || (self.count(event_id) >= n).then_some(()),
        );
    }
}

fn admin_token() -> String {
    streaming_hub::api::mint(
        &streaming_hub::runtime::secret::Secret::new(JWT),
        None,
        true,
        Duration::from_secs(86_400),
    )
}

async fn get_json(s: &ApiHub, addr: &str, path: &str, token: &str) -> (u16, Value, HeaderMap) {
    let r = s
        .http
        .get(format!("http://{addr}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
        headers,
    )
}

async fn post_json(s: &ApiHub, path: &str, token: &str, body: Value) -> (u16, Value) {
    post_json_to(&s.http, &s.hub.addr(), path, token, &body).await
}

/// `POST /admin/deliveries/dead/redrive` of `ids` with `token`.
async fn redrive(s: &ApiHub, token: &str, ids: Value) -> (u16, Value) {
    post_json(
        s,
        "/admin/deliveries/dead/redrive",
        token,
        json!({ "ids": ids }),
    )
    .await
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_reads_in_order_resumes_anywhere_and_is_rate_limited() {
    let mut s = ApiHub::start(
        "pull",
        &[
            ("STREAMING_HUB_PULL_RATE", "1"),
            ("STREAMING_HUB_PULL_BURST", "30"),
        ],
    )
    .await;
    let v = s
        .create_subscription(
            "tenant-p",
            json!({"event_types": ["transaction.*"], "destination": {"type": "pull"}}),
        )
        .await;
    let sub = v["id"].as_str().unwrap().to_string();
    let evs: Vec<Rec> = (0..5)
        .map(|_| event("tenant-p", "ledger", "transaction", "created"))
        .collect();
    let mut input = evs.clone();
    input.insert(2, event("tenant-p", "ledger", "account", "created")); // not matched
    input.insert(3, event("tenant-q", "ledger", "transaction", "created")); // another tenant
    produce(&producer(), &s.topic, &input);
    let token = s.token("tenant-p");
    let addr = s.hub.addr();

    // Page 1: the first three, in order, once all five are on the pull topic (waited for there:
    // each read of the API spends a token of the 30 this test's limit allows).
    let want: Vec<String> = evs.iter().map(Rec::id).collect();
    let pull_topic = format!("{}.pull", s.prefix);
    {
        let (pull_topic, want) = (pull_topic.clone(), want.clone());
        tokio::task::spawn_blocking(move || {
            read_until(&[&pull_topic], Duration::from_secs(120), |got| {
                want.iter().all(|id| {
                    got.iter()
                        .any(|g| g.rec.header("ce-id") == Some(id.as_str()))
                })
            })
        })
        .await
        .unwrap();
    }
    // A read has a time budget, which a loaded machine may spend before the third event: a few
    // tries.
    let mut page1 = Value::Null;
    for _ in 0..5 {
        let (st, body, _) = get_json(
            &s,
            &addr,
            &format!("/v1/events?subscription_id={sub}&limit=3"),
            &token,
        )
        .await;
        assert_eq!(st, 200, "{body}");
        page1 = body;
        if page1["events"].as_array().unwrap().len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(page_ids(&page1), want[..3], "first page in arrival order");
    let first = &page1["events"][0];
    assert_eq!(first["type"], "studio.lerian.ledger.transaction.created");
    assert_eq!(first["tenant_id"], "tenant-p");
    assert_eq!(
        first["data"],
        serde_json::from_slice::<Value>(evs[0].value.as_ref().unwrap()).unwrap(),
        "JSON payload as JSON"
    );
    let seqs: Vec<u64> = page1["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["sequence"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let cursor = page1["next_cursor"].as_str().unwrap().to_string();
    let (_, page2, _) = get_json(
        &s,
        &addr,
        &format!("/v1/events?subscription_id={sub}&cursor={cursor}&limit=10"),
        &token,
    )
    .await;
    assert_eq!(
        page_ids(&page2),
        want[3..],
        "the cursor resumes after page 1"
    );

    // Another tenant cannot read it; a webhook-only caller gets the field at fault.
    let (st, _, _) = get_json(
        &s,
        &addr,
        &format!("/v1/events?subscription_id={sub}"),
        &s.token("tenant-q"),
    )
    .await;
    assert_eq!(st, 404);
    let (st, body, _) = get_json(
        &s,
        &addr,
        &format!("/v1/events?subscription_id={sub}&cursor=nope"),
        &token,
    )
    .await;
    assert_eq!((st, body["error"]["field"].as_str()), (400, Some("cursor")));

    // After a restart the same cursor reads the same events; so does another instance.
    s.hub.terminate();
    s.hub = Hub::start(&s.hub.env.clone());
    let addr = s.hub.addr();
    let (_, again, _) = get_json(
        &s,
        &addr,
        &format!("/v1/events?subscription_id={sub}&cursor={cursor}&limit=10"),
        &token,
    )
    .await;
    assert_eq!(page_ids(&again), want[3..], "cursor survives a restart");

    let env2 = another_instance(&s.hub.env, "2");
    let other = Hub::start(&env2);
    let (_, there, _) = get_json(
        &s,
        &other.addr(),
        &format!("/v1/events?subscription_id={sub}&limit=3"),
        &token,
    )
    .await;
    assert_eq!(
        page_ids(&there),
        want[..3],
        "another instance serves the same stream"
    );

    // Retention took the events the cursor points at (the 4th event and everything before it):
    // the next page starts at the oldest event kept, instead of an empty page that never moves
    // on.
    let fourth = read_all(&[&pull_topic], Duration::from_secs(30))
        .into_iter()
        .find(|g| g.rec.header("ce-id") == Some(want[3].as_str()))
        .expect("the 4th event on the pull topic");
    delete_records_before(&pull_topic, fourth.partition, fourth.offset + 1);
    let (st, aged, _) = get_json(
        &s,
        &addr,
        &format!("/v1/events?subscription_id={sub}&cursor={cursor}&limit=10"),
        &token,
    )
    .await;
    assert_eq!(st, 200, "{aged}");
    assert_eq!(
        page_ids(&aged),
        want[4..],
        "from the oldest event retention kept"
    );

    // Past the burst: 429 with Retry-After.
    let mut limited = None;
    for _ in 0..100 {
        let (st, _, headers) = get_json(
            &s,
            &other.addr(),
            &format!("/v1/events?subscription_id={sub}&limit=1"),
            &token,
        )
        .await;
        if st == 429 {
            limited = Some(headers);
            break;
        }
    }
    let headers = limited.expect("the pull rate limit answered 429");
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    // Reads reached the end of inbox partitions: normal, so not logged as an error.
    assert_no_eof_errors(&s.hub.log_text());
    assert_no_eof_errors(&other.log_text());
}

/// A subscription id deleted by one tenant and then applied for another keys both tenants'
/// records in the same partition of `<prefix>.pull`; the new owner's reads, from its creation
/// or from a cursor it made up, return only its own tenant's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_subscription_id_does_not_read_the_previous_tenants_events() {
    let s = ApiHub::start("pull-reuse", &[]).await;
    let addr = s.hub.addr();
    let v = s
        .create_subscription(
            "tenant-old",
            json!({"event_types": ["transaction.*"], "destination": {"type": "pull"}}),
        )
        .await;
    let sub = v["id"].as_str().unwrap().to_string();
    let old_event = event("tenant-old", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&old_event));
    let old_token = s.token("tenant-old");
    let path = format!("/v1/events?subscription_id={sub}");
    let mut seen_by_old = false;
    for _ in 0..300 {
        let (st, body, _) = get_json(&s, &addr, &path, &old_token).await;
        assert_eq!(st, 200, "{body}");
        if body["events"][0]["id"] == old_event.id().as_str() {
            seen_by_old = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen_by_old, "the first tenant read its event");
    let r = s
        .http
        .delete(format!("http://{addr}/v1/subscriptions/{sub}"))
        .bearer_auth(&old_token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);

    // An operator applies the freed id for another tenant, which then gets an event of its own.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("subscriptions.json");
    let entry = json!([{"id": sub, "tenant_id": "tenant-new", "event_types": ["transaction.*"],
                        "destination": {"type": "pull"}}]);
    std::fs::write(&file, serde_json::to_vec(&entry).unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
        .args(["subscriptions", "apply", "-f", file.to_str().unwrap()])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(&s.hub.env)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let new_token = s.token("tenant-new");
    let mut owned = false;
    for _ in 0..300 {
        let (st, _, _) = get_json(&s, &addr, &path, &new_token).await;
        if st == 200 {
            owned = true;
            break;
        }
        assert_eq!(st, 404);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        owned,
        "the hub serves the applied subscription to its new tenant"
    );
    let new_event = event("tenant-new", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&new_event));

    // From its creation (a minute of margin before it: the old event is inside it), and from
    // the partition's first offset: only the new tenant's event.
    let mut from_creation = Value::Null;
    for _ in 0..300 {
        let (st, body, _) = get_json(&s, &addr, &path, &new_token).await;
        assert_eq!(st, 200, "{body}");
        if body["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["id"] == new_event.id().as_str())
        {
            from_creation = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        page_ids(&from_creation),
        vec![new_event.id()],
        "{from_creation}"
    );
    let cursor =
        streaming_hub::ops::pull::Cursor::decode(from_creation["next_cursor"].as_str().unwrap())
            .unwrap();
    let made_up = streaming_hub::ops::pull::Cursor {
        offset: 0,
        ..cursor
    }
    .encode();
    let (st, from_zero, _) =
        get_json(&s, &addr, &format!("{path}&cursor={made_up}"), &new_token).await;
    assert_eq!(st, 200, "{from_zero}");
    assert_eq!(page_ids(&from_zero), vec![new_event.id()], "{from_zero}");
}

/// The readers that stop at a partition's end (pull, redelivery) see it as a librdkafka "error";
/// it must not reach the log as an ERROR line (rdkafka's default context logged one per end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_page_of_large_events_ends_at_its_byte_bound_and_the_next_goes_on() {
    let s = ApiHub::start("pull-big", &[]).await;
    let v = s
        .create_subscription(
            "tenant-big",
            json!({"event_types": ["transaction.*"], "destination": {"type": "pull"}}),
        )
        .await;
    let sub = v["id"].as_str().unwrap().to_string();
    const SIZE: usize = 900_000;
    let evs: Vec<Rec> = (0..12)
        .map(|i| {
            let mut e = event("tenant-big", "ledger", "transaction", "created");
            let pad = "x".repeat(SIZE - 20);
            e.value = Some(format!("{{\"n\":{i:>5},\"pad\":\"{pad}\"}}").into_bytes());
            assert_eq!(e.value.as_ref().unwrap().len(), SIZE);
            e
        })
        .collect();
    produce(&producer(), &s.topic, &evs);
    // All twelve on the pull topic first, so the first page could take them all.
    let pull = format!("{}.pull", s.prefix);
    read_until(&[&pull], Duration::from_secs(60), |r| {
        r.iter()
            .filter(|g| g.rec.key.as_deref() == Some(sub.as_bytes()))
            .count()
            >= 12
    });
    let token = s.token("tenant-big");
    let addr = s.hub.addr();
    let page = |cursor: Option<String>| {
        let path = match cursor {
            Some(c) => format!("/v1/events?subscription_id={sub}&cursor={c}&limit=500"),
            None => format!("/v1/events?subscription_id={sub}&limit=500"),
        };
        let (s, addr, token) = (&s, &addr, &token);
        async move {
            let (st, body, _) = get_json(s, addr, &path, token).await;
            assert_eq!(st, 200);
            body
        }
    };
    // The event that crosses the bound is the page's last.
    let first_page = streaming_hub::ops::pull::PAGE_BYTES.div_ceil(SIZE);
    let p1 = page(None).await;
    let want: Vec<String> = evs.iter().map(Rec::id).collect();
    assert_eq!(page_ids(&p1), want[..first_page]);
    let p2 = page(Some(p1["next_cursor"].as_str().unwrap().to_string())).await;
    assert_eq!(
        page_ids(&p2),
        want[first_page..],
        "the next page goes on after it"
    );
}

/// A pull subscription's copy counts toward `STREAMING_HUB_HUB_BATCH_JOBS` as a webhook job
/// does: with the bound at 2 and two pull subscriptions, each hub transaction takes one event
/// (the copies were uncounted: all four events, eight copies, went in one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_copies_count_toward_the_bound_of_a_hub_transaction() {
    let mut s = ApiHub::start("pull-bound", &[("STREAMING_HUB_HUB_BATCH_JOBS", "2")]).await;
    let tenant = "tenant-bound";
    for _ in 0..2 {
        let pull = json!({"event_types": ["*"], "destination": {"type": "pull"}});
        s.create_subscription(tenant, pull).await;
    }
    // Produced while the hub is down, so they reach its inbox together.
    s.hub.terminate();
    let evs: Vec<Rec> = (0..4)
        .map(|_| event(tenant, "ledger", "transaction", "created"))
        .collect();
    produce(&producer(), &s.topic, &evs);
    let env = s.hub.env.clone();
    s.hub = Hub::start(&env);
    let pull = format!("{}.pull", s.prefix);
    read_until(&[&pull], Duration::from_secs(60), |r| r.len() >= 8);
    s.wait_metric("streaming_hub_hub_events_total{outcome=\"new\"", 4)
        .await;
    let text = s.metrics_text().await;
    let largest = text
        .lines()
        .find_map(|l| l.strip_prefix("streaming_hub_hub_batch_records{quantile=\"1\"} "))
        .and_then(|v| v.parse::<f64>().ok())
        .expect(&text);
    assert_eq!(largest, 1.0, "one event per transaction");
}

fn assert_no_eof_errors(log: &str) {
    let eof: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" ERROR ") && l.contains("PartitionEOF"))
        .collect();
    assert!(eof.is_empty(), "end of partition logged as ERROR: {eof:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_redrive_and_replay_redeliver_to_one_subscription_only() {
    let s = ApiHub::start("redo", &[]).await;
    let (url_a, sink_a) = start_sink(500, Duration::ZERO).await;
    let (url_b, sink_b) = start_sink(200, Duration::ZERO).await;
    // A fails: two attempts one second apart, then a dead letter. B is healthy.
    let a = s
        .create_subscription(
            "tenant-r",
            json!({"event_types": ["transaction.*"], "retry_schedule": ["1s"],
                   "destination": {"type": "webhook", "url": url_a}}),
        )
        .await;
    let b = s
        .create_subscription(
            "tenant-r",
            json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url_b}}),
        )
        .await;
    // A's first delivery only starts after the subscription was active.
    sink_a.status.store(500, Ordering::SeqCst);
    let (a, b) = (
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
    );
    let t0 = now_rfc3339();
    let admin = admin_token();
    let e1 = event("tenant-r", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&e1));
    sink_a.wait_count(&e1.id(), 2);
    sink_b.wait_count(&e1.id(), 1);
    let addr = s.hub.addr();
    let dead = wait_until(
        Duration::from_secs(60),
        "e1 in /admin/deliveries/dead",
        || {
            futures_block(get_json(
                &s,
                &addr,
                &format!("/admin/deliveries/dead?subscription_id={a}"),
                &admin,
            ))
            .1["deliveries"]
                .as_array()
                .filter(|d| !d.is_empty())
                .cloned()
        },
    );
    assert_eq!(dead[0]["event_id"], e1.id());
    assert_eq!(dead[0]["reason"], "exhausted");
    assert_eq!(dead[0]["redrivable"], true);

    // Recover: only A gets e1 again, now successfully. Another tenant's dead letter on the
    // same topic is neither requested nor counted in the tenant's answer; one that does not
    // decode is skipped and counted for the operators, the recover going on past it.
    sink_a.status.store(200, Ordering::SeqCst);
    let codec = Codec::new().unwrap();
    let now_ms = chrono::Utc::now().timestamp_millis();
    let unreadable = Rec {
        key: Some(b"tenant-r".to_vec()),
        value: Some(b"\xffnot a dead letter".to_vec()),
        ..Rec::default()
    };
    produce(
        &producer(),
        &format!("{}.dlq", s.prefix),
        &[
            dead_letter_rec(&codec, "tenant-x", "sub-x", now_ms, 10),
            unreadable,
        ],
    );
    let (st, _) = post_json(
        &s,
        &format!("/v1/subscriptions/{a}/recover"),
        &s.token("tenant-x"),
        json!({"since": t0}),
    )
    .await;
    assert_eq!(st, 404, "another tenant's subscription");
    let (st, body) = post_json(
        &s,
        &format!("/v1/subscriptions/{a}/recover"),
        &s.token("tenant-r"),
        json!({"since": t0}),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        (
            body["state"].as_str(),
            body["requested"].as_u64(),
            body["scanned"].as_u64()
        ),
        (Some("done"), Some(1), Some(1)),
        "{body}"
    );
    s.wait_metric("streaming_hub_recover_dead_letters_unreadable_total", 1)
        .await;
    sink_a.wait_count(&e1.id(), 3);
    s.wait_metric("streaming_hub_redeliveries_total{outcome=\"queued\"", 1)
        .await;
    assert_eq!(
        sink_b.count(&e1.id()),
        1,
        "recover touches only the dead-lettered subscription"
    );

    // Redrive a chosen dead letter by id.
    sink_a.status.store(500, Ordering::SeqCst);
    let e2 = event("tenant-r", "ledger", "transaction", "posted");
    produce(&producer(), &s.topic, std::slice::from_ref(&e2));
    sink_a.wait_count(&e2.id(), 2);
    let id2 = wait_until(Duration::from_secs(60), "e2 dead", || {
        futures_block(get_json(
            &s,
            &addr,
            &format!("/admin/deliveries/dead?subscription_id={a}"),
            &admin,
        ))
        .1["deliveries"]
            .as_array()
            .and_then(|d| d.iter().find(|x| x["event_id"] == e2.id()).cloned())
    })["id"]
        .as_str()
        .unwrap()
        .to_string();
    sink_a.status.store(200, Ordering::SeqCst);
    let (st, body) = redrive(&s, &s.token("tenant-r"), json!([id2])).await;
    assert_eq!(st, 403, "{body}");
    let (st, body) = redrive(&s, &admin, json!(["9-999999"])).await;
    assert_eq!((st, body["error"]["field"].as_str()), (400, Some("ids")));
    // While A is disabled the hub would drop the redelivery: refused, nothing queued.
    let set_enabled = |on: bool| {
        s.http
            .patch(format!("http://{addr}/v1/subscriptions/{a}"))
            .bearer_auth(s.token("tenant-r"))
            .header("content-type", "application/json")
            .body(json!({ "enabled": on }).to_string())
            .send()
    };
    assert_eq!(set_enabled(false).await.unwrap().status(), 200);
    let (st, body) = redrive(&s, &admin, json!([id2])).await;
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (409, Some("subscription_inactive")),
        "{body}"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains(&id2),
        "{body}"
    );
    assert_eq!(set_enabled(true).await.unwrap().status(), 200);
    let (st, body) = redrive(&s, &admin, json!([id2])).await;
    assert_eq!((st, body["requested"].as_u64()), (200, Some(1)), "{body}");
    sink_a.wait_count(&e2.id(), 3);

    // Per-subscription replay of B: e1 and e2 again to B, nothing more to A.
    let a_before = sink_a.got.lock().unwrap().len();
    let (st, body) = post_json(
        &s,
        "/admin/replay",
        &admin,
        json!({"subscription_id": b, "from": t0}),
    )
    .await;
    assert_eq!(st, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    let done = wait_until(Duration::from_secs(60), "replay done", || {
        let (_, p, _) = futures_block(get_json(&s, &addr, &format!("/admin/replay/{id}"), &admin));
        (p["state"] == "done").then_some(p)
    });
    assert_eq!(done["requested"], 2, "{done}");
    sink_b.wait_count(&e1.id(), 2);
    sink_b.wait_count(&e2.id(), 2);
    s.wait_metric("streaming_hub_redeliveries_total{outcome=\"queued\"", 4)
        .await;
    assert_eq!(
        sink_a.got.lock().unwrap().len(),
        a_before,
        "replay of B never reaches A"
    );
    // Six deliveries: e1 and e2 to B, then four redeliveries (the recover, the redrive, the
    // replay's two). The latency histogram times the first two from their ingest, not the
    // redeliveries, which an operator asked for later (counted at the same commit as each
    // attempt; an event sent twice around an abort adds one to both counts).
    s.wait_metric("streaming_hub_attempts_total{outcome=\"delivered\"", 6)
        .await;
    let text = s.metrics_text().await;
    let delivered = metric_sum(&text, "streaming_hub_attempts_total{outcome=\"delivered\"");
    let timed = metric_sum(&text, "streaming_hub_delivery_latency_seconds_count");
    assert!(
        timed >= 2 && timed + 4 <= delivered,
        "{timed} deliveries timed of {delivered}: the four redeliveries are not"
    );
    assert_no_eof_errors(&s.hub.log_text());
}

/// The hub's pull topic takes smaller records than a pull subscription's event once the hub
/// runs (an operator's change): the broker refuses the hub transaction's copy of it every time.
/// The hub loop pauses longer between runs and, having committed nothing for the stall timeout
/// since a batch failed that way, ends: the process exits 1 naming why, instead of aborting
/// the same batch for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_loop_whose_writes_the_broker_always_refuses_ends_the_process() {
    let mut s = ApiHub::start("hubstuck", &[("STREAMING_HUB_STALL_TIMEOUT", "36s")]).await;
    s.create_subscription(
        "tenant-s",
        json!({"event_types": ["transaction.*"], "destination": {"type": "pull"}}),
    )
    .await;
    let pull = format!("{}.pull", s.prefix);
    let topic = s.topic.clone();
    let (code, log) = refused_writes_end_the_hub(&mut s.hub, &pull, &topic, "tenant-s").await;
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("the hub loop committed nothing for the stall timeout"),
        "{log}"
    );
}

/// A replay started by mistake (a week to one receiver) can be stopped: `DELETE
/// /admin/replay/{id}` while it runs answers 202 and the run ends `cancelled` before its next
/// record, the redeliveries it requested before queued and no more after; on one already
/// ended it answers 200 and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_replay_can_be_cancelled() {
    let s = ApiHub::start("cancel", &[]).await;
    let (url, _sink) = start_sink(200, Duration::ZERO).await;
    let t0 = now_rfc3339();
    let sub = s
        .create_subscription(
            "tenant-c",
            json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url}}),
        )
        .await;
    let sub = sub["id"].as_str().unwrap().to_string();
    let evs: Vec<Rec> = (0..3000)
        .map(|_| event("tenant-c", "ledger", "transaction", "posted"))
        .collect();
    produce(&producer(), &s.topic, &evs);
    s.wait_metric("streaming_hub_matches_total", 3000).await;
    let admin = admin_token();
    let addr = s.hub.addr();
    let cancel = |id: String| {
        s.http
            .delete(format!("http://{addr}/admin/replay/{id}"))
            .bearer_auth(&admin)
            .send()
    };
    // A run may end before the DELETE reaches it: then 200, and another run is tried.
    let mut cancelled = None;
    for _ in 0..10 {
        let (st, body) = post_json(
            &s,
            "/admin/replay",
            &admin,
            json!({"subscription_id": sub, "from": t0}),
        )
        .await;
        assert_eq!(st, 202, "{body}");
        let id = body["id"].as_str().unwrap().to_string();
        let answer = cancel(id.clone()).await.unwrap();
        let status = answer.status().as_u16();
        let body: Value = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
        let ended = wait_until(Duration::from_secs(60), "the replay ends", || {
            let (_, p, _) =
                futures_block(get_json(&s, &addr, &format!("/admin/replay/{id}"), &admin));
            (p["state"] != "running").then_some(p)
        });
        match status {
            // Asked while it ran: it stopped early, or had read its last record by then.
            202 if ended["state"] == "cancelled" => {
                cancelled = Some(ended);
                break;
            }
            202 => assert_eq!(ended["state"], "done", "{ended}"),
            200 => {
                assert_eq!(body["state"], "done", "{body}");
                assert_eq!(ended["state"], "done", "{ended}");
            }
            other => panic!("DELETE answered {other}: {body}"),
        }
    }
    let ended = cancelled.expect("a DELETE stopped a running replay");
    assert!(
        ended["requested"].as_u64().unwrap() < 3000,
        "it stopped before its end: {ended}"
    );
    assert!(
        ended["error"].as_str().unwrap().contains("cancelled"),
        "{ended}"
    );
    // Ended: a second DELETE changes nothing.
    let id = ended["id"].as_str().unwrap().to_string();
    let again = cancel(id.clone()).await.unwrap();
    assert_eq!(again.status().as_u16(), 200);
    let (st, body) = post_json(&s, "/admin/replay", &s.token("tenant-c"), json!({})).await;
    assert_eq!(st, 403, "{body}");
    let unknown = cancel("0190a000-0000-7000-8000-000000000000".into())
        .await
        .unwrap();
    assert_eq!(unknown.status().as_u16(), 404);
}

/// An operation's read of a range whose start retention deleted after the range was taken (a
/// long replay or recover of an old window) goes on from the oldest record kept. With
/// librdkafka's default reset the position went to the partition's end without a word, and the
/// whole range was skipped while the run reported `done`.
#[tokio::test]
async fn a_range_whose_start_retention_deleted_is_read_from_the_oldest_record_kept() {
    require_broker();
    let topic = unique("ops-aged");
    create_topic(&topic, 1).await;
    let recs: Vec<Rec> = (0..100)
        .map(|i| event(&format!("tenant-{i}"), "ledger", "transaction", "created"))
        .collect();
    produce(&producer(), &topic, &recs);
    // The range was taken from offset 10; retention then deleted everything before 50.
    delete_records_before(&topic, 0, 50);
    let config = Config::from_vars(hub_env(&unique("ops-aged"), "^unused$")).unwrap();
    let r = Redeliverer::new(&config, Arc::new(Codec::new().unwrap())).unwrap();
    let mut read = Vec::new();
    r.read_ranges(&topic, &[(0, 10, 100)], |m| {
        read.push(rdkafka::Message::offset(m));
        Ok(())
    })
    .unwrap();
    assert_eq!(read, (50..100).collect::<Vec<i64>>());
}

/// A scan stops at the record where the process's stop flag turned: a shutdown does not wait for
/// a long replay or recover (its blocking task kept the process alive after every stage had
/// stopped, past `STREAMING_HUB_SHUTDOWN_TIMEOUT`).
#[tokio::test]
async fn a_scan_stops_where_the_instance_begins_to_shut_down() {
    require_broker();
    let topic = unique("ops-stop");
    create_topic(&topic, 1).await;
    let recs: Vec<Rec> = (0..100)
        .map(|i| event(&format!("tenant-{i}"), "ledger", "transaction", "created"))
        .collect();
    produce(&producer(), &topic, &recs);
    let config = Config::from_vars(hub_env(&unique("ops-stop"), "^unused$")).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = Redeliverer::new(&config, Arc::new(Codec::new().unwrap()))
        .unwrap()
        .stopping_with(stop.clone());
    let mut read = Vec::new();
    let scanned = r.read_ranges(&topic, &[(0, 0, 100)], |m| {
        read.push(rdkafka::Message::offset(m));
        if read.len() == 10 {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    });
    assert!(
        matches!(scanned, Err(RedeliverError::Stopped)),
        "{scanned:?}"
    );
    assert_eq!(
        read,
        (0..10).collect::<Vec<i64>>(),
        "nothing read past the stop"
    );
}

/// A record of `<prefix>.dlq`: the dead letter of a new event of `tenant` for its subscription
/// `sub`, the event's value `value_len` bytes.
fn dead_letter_rec(codec: &Codec, tenant: &str, sub: &str, dead_at: i64, value_len: usize) -> Rec {
    let e = event(tenant, "ledger", "transaction", "created");
    let dl = DeadLetterRecord {
        event_id: e.id(),
        subscription_id: sub.into(),
        tenant_id: tenant.into(),
        attempts: 1,
        last_status: Some(500),
        last_error: None,
        reason: DeadLetterReason::Exhausted,
        dead_at,
        event_headers: Some(
            e.headers
                .iter()
                .map(|(key, value)| HeaderRecord {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
        ),
        event_value: Some(vec![b'x'; value_len]),
    };
    Rec {
        key: Some(tenant.as_bytes().to_vec()),
        value: Some(codec.encode(RecordKind::DeadLetter, &dl).unwrap()),
        ..Rec::default()
    }
}

/// One redrive whose redelivery request the broker refuses (its event is larger than the inbox
/// takes) fails alone: a redrive beside it, or after it on the same instance, is `done`. Runs
/// shared one producer: its first refusal went to whichever run looked first, and a run could
/// wait on another's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_request_is_refused_fails_alone() {
    require_broker();
    let prefix = unique("ops-iso");
    let config = Config::from_vars(hub_env(&prefix, "^unused$")).unwrap();
    let inbox = format!("{prefix}.inbox");
    let dlq = format!("{prefix}.dlq");
    create_topic_configured(&admin(), &inbox, 1, &[("max.message.bytes", "65536")]).await;
    create_topic(&dlq, 1).await;
    let codec = Arc::new(Codec::new().unwrap());
    let dead = |value_len: usize| dead_letter_rec(&codec, "tenant-iso", "sub-iso", 1, value_len);
    // Offset 0 fits the inbox, offset 1 does not.
    produce(&producer(), &dlq, &[dead(100), dead(200_000)]);
    let r = Redeliverer::new(&config, codec.clone()).unwrap();
    let run = |offset: i64| {
        let p = Mutex::new(Progress {
            id: format!("run-{offset}"),
            ..Progress::default()
        });
        r.redrive(&[(0, offset)], None, &p, |_| Ok(()))
    };
    let refused = run(1).expect_err("the inbox refuses a 200 kB request");
    assert!(refused.to_string().contains("not written"), "{refused}");
    run(0).expect("a run after a refused one");
    for round in 0..8 {
        let start = std::sync::Barrier::new(2);
        let (big, small) = std::thread::scope(|s| {
            let big = s.spawn(|| {
                start.wait();
                run(1)
            });
            let small = s.spawn(|| {
                start.wait();
                run(0)
            });
            (big.join().unwrap(), small.join().unwrap())
        });
        assert!(big.is_err(), "round {round}: the refused run");
        small.unwrap_or_else(|e| panic!("round {round}: the run beside it failed: {e}"));
    }
    let requests = read_all(&[&inbox], Duration::from_secs(5));
    assert_eq!(requests.len(), 9, "one request per run of offset 0");
}

/// A replay answered by one instance while the instance whose hub loop owns the tenant's
/// partition has not yet read the record that enabled the subscription again (its control
/// reader lags, here 6 s a record): the hub holds the redelivery and judges it when due, by then
/// on the record it lacked, and delivers it. Before, it dropped it as `inactive`, though the
/// replay had been accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_read_before_the_hub_has_its_subscription_enabled_is_delivered() {
    let s = ApiHub::start("lagredo", &[("STREAMING_HUB_ROLE", "ingest")]).await;
    let b = lagging_instance(&s, "b", "delivery", "6s");
    let (url, sink) = start_sink(200, Duration::ZERO).await;
    let created = s
        .create_subscription(
            "tenant-l",
            json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url}}),
        )
        .await;
    let id = created["id"].as_str().unwrap().to_string();
    let token = s.token("tenant-l");
    let path = format!("/v1/subscriptions/{id}");
    // B's table, read through B's API (which waits for its reader), has what A wrote.
    let b_has = |check: fn(&Value) -> bool| {
        let (http, addr, path, token) = (s.http.clone(), b.addr(), path.clone(), token.clone());
        wait_until(
            Duration::from_secs(90),
            "B's table has the change",
            move || {
                let (status, got) = futures_block(call_json(
                    &http,
                    reqwest::Method::GET,
                    &addr,
                    &path,
                    &token,
                    None,
                ));
                (status == 200 && check(&got)).then_some(())
            },
        )
    };
    b_has(|g| g["verification_state"] == "active" && g["enabled"] == true);
    let t0 = now_rfc3339();
    let e1 = event("tenant-l", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&e1));
    sink.wait_count(&e1.id(), 1);
    let patch = |enabled: bool| {
        let (http, addr, path, token) = (s.http.clone(), s.hub.addr(), path.clone(), token.clone());
        async move {
            let body = json!({ "enabled": enabled });
            let (status, got) = call_json(
                &http,
                reqwest::Method::PATCH,
                &addr,
                &path,
                &token,
                Some(&body),
            )
            .await;
            assert_eq!(status, 200, "{got}");
        }
    };
    patch(false).await;
    b_has(|g| g["enabled"] == false);
    // Enabled again and replayed at once, through A: B reads the request before the record,
    // which its reader holds 6 s (the replay's scan and B's batch take well under that).
    patch(true).await;
    let (status, run) = post_json(
        &s,
        "/admin/replay",
        &admin_token(),
        json!({"subscription_id": id, "from": t0}),
    )
    .await;
    assert_eq!(status, 202, "{run}");
    let deferred = "streaming_hub_redeliveries_total{outcome=\"deferred\"";
    let text = b.metrics_when(&s.http, deferred, 1).await;
    assert_eq!(metric_sum(&text, deferred), 1, "{text}");
    sink.wait_count(&e1.id(), 2);
}

/// A recover and a redrive read the dead letters committed behind a transaction still open on
/// the DLQ (another instance's, in flight or stuck): they wait for it to end. A `read_committed`
/// reader is told the last stable offset as the partition's end, so the recover ended its range
/// before that transaction and answered `done` without the dead letters after it, and the
/// redrive answered "no dead letter" for one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_and_redrive_read_dead_letters_committed_behind_an_open_transaction() {
    require_broker();
    let prefix = unique("ops-lso");
    let config = Config::from_vars(hub_env(&prefix, "^unused$")).unwrap();
    let inbox = format!("{prefix}.inbox");
    let dlq = format!("{prefix}.dlq");
    create_topic(&inbox, 1).await;
    create_topic(&dlq, 1).await;
    let codec = Arc::new(Codec::new().unwrap());
    let (tenant, sub_id) = ("tenant-lso", "sub-lso");
    let dead = || dead_letter_rec(&codec, tenant, sub_id, 1, 100);
    // Offset 0 committed; 1 in a transaction left open; 2, 3 and 4 committed after it began.
    produce(&producer(), &dlq, &[dead()]);
    let open = open_transaction_with(&dlq, dead());
    produce(&producer(), &dlq, &[dead(), dead(), dead()]);
    let sub = streaming_hub::runtime::records::SubscriptionRecord::pull(sub_id, tenant, &[]);
    let r = Arc::new(Redeliverer::new(&config, codec.clone()).unwrap());
    let progress = |id: &str| {
        Arc::new(Mutex::new(Progress {
            id: id.into(),
            ..Progress::default()
        }))
    };
    let (redriven, recovered) = (progress("redrive"), progress("recover"));
    let redrive = {
        let (r, p) = (r.clone(), redriven.clone());
        std::thread::spawn(move || r.redrive(&[(0, 3)], Some(tenant), &p, |_| Ok(())))
    };
    let recover = {
        let (r, p) = (r.clone(), recovered.clone());
        std::thread::spawn(move || r.recover(&sub, 0, &p))
    };
    // The recover has read the dead letter before the open transaction: its range was taken.
    wait_until(
        Duration::from_secs(30),
        "the recover reads offset 0",
        || (recovered.lock().unwrap().scanned >= 1).then_some(()),
    );
    rdkafka::producer::Producer::abort_transaction(&open, Duration::from_secs(30)).unwrap();
    redrive.join().unwrap().expect("the redrive");
    recover.join().unwrap().expect("the recover");
    let done = |p: &Mutex<Progress>| {
        let p = p.lock().unwrap();
        (p.scanned, p.matched, p.requested)
    };
    assert_eq!(done(&recovered), (4, 4, 4), "every committed dead letter");
    assert_eq!(done(&redriven), (1, 1, 1));
    let requests = read_all(&[&inbox], Duration::from_secs(5));
    assert_eq!(requests.len(), 5, "four recovered, one redriven");
}

/// A sink that takes each event delivery and answers 200 only once the test opens its gate
/// (verification probes pass at once).
async fn start_gated_sink() -> (String, Arc<Mutex<Vec<String>>>, Arc<tokio::sync::Semaphore>) {
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (g, o) = (got.clone(), gate.clone());
    let app = Router::new().route(
        "/hook",
        post(move |headers: HeaderMap, body: Bytes| {
            let (got, gate) = (g.clone(), o.clone());
            async move {
                let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("");
                if h("x-lerian-event-type") == "streaming_hub.verification" {
                    return (StatusCode::OK, body); // the challenge echoed
                }
                got.lock().unwrap().push(h("x-lerian-event-id").to_string());
                let _ = gate.acquire().await.map(|p| p.forget());
                (StatusCode::OK, Bytes::new())
            }
        }),
    );
    (format!("http://{}/hook", serve(app).await), got, gate)
}

/// A delivery whose job was its event's only holder when claimed deletes the stored payload
/// with it, unread; a holder added while that attempt was in flight (here a replay to a second
/// subscription) must keep the payload for the second job's later attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_gaining_a_holder_during_an_attempt_outlives_that_attempt() {
    // A minute for the held attempt: the steps below happen while it is in flight.
    let s = ApiHub::start("sole", &[("STREAMING_HUB_HTTP_TIMEOUT", "60s")]).await;
    let (url_a, got_a, gate_a) = start_gated_sink().await;
    let (url_b, sink_b) = start_sink(500, Duration::ZERO).await;
    let tenant = "tenant-s";
    let a = s
        .create_subscription(
            tenant,
            json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url_a}}),
        )
        .await;
    assert_eq!(a["verification_state"], "active", "{a}");
    let t0 = now_rfc3339();
    let e = event(tenant, "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&e));
    // A's attempt is in flight, claimed while its job was the payload's only holder.
    wait_until(Duration::from_secs(60), "A holds e", || {
        (got_a.lock().unwrap().as_slice() == [e.id()]).then_some(())
    });
    let b = s
        .create_subscription(
            tenant,
            json!({"event_types": ["transaction.*"], "retry_schedule": ["1s", "1s", "1s", "1s", "1s", "1s"],
                   "destination": {"type": "webhook", "url": url_b}}),
        )
        .await;
    assert_eq!(b["verification_state"], "active", "{b}");
    let admin = admin_token();
    let (st, body) = post_json(
        &s,
        "/admin/replay",
        &admin,
        json!({"subscription_id": b["id"], "from": t0}),
    )
    .await;
    assert_eq!(st, 202, "{body}");
    // B's job holds the payload too, and its first attempt failed: it will need the payload again.
    s.wait_metric("streaming_hub_redeliveries_total{outcome=\"queued\"", 1)
        .await;
    sink_b.wait_count(&e.id(), 1);
    assert_eq!(s.metric(ATTEMPTS_DELIVERED).await, 0, "A is still held");
    gate_a.add_permits(1);
    s.wait_metric(ATTEMPTS_DELIVERED, 1).await;
    // A is done. B's next attempts read the payload A no longer holds.
    sink_b.status.store(200, Ordering::SeqCst);
    s.wait_metric(ATTEMPTS_DELIVERED, 2).await;
    let bodies = sink_b.count(&e.id());
    assert!(bodies >= 2, "B got e {bodies} times");
    assert_eq!(got_a.lock().unwrap().len(), 1, "A got e once");
}

/// A producer sending an event again after its dedup window, while the first delivery of it is
/// still in flight, gets no second job (nor delivery) for it: the event's stored payload tells the
/// hub a job may exist, and it looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_sent_again_after_its_dedup_window_during_its_delivery_gets_no_second_job() {
    let s = ApiHub::start(
        "again",
        &[
            ("STREAMING_HUB_DANGEROUS_TEST_CLOCK", "true"),
            ("STREAMING_HUB_IDEMPOTENCY_TTL", "1s"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "60s"),
        ],
    )
    .await;
    let (url_a, got_a, gate_a) = start_gated_sink().await;
    let (url_b, sink_b) = start_sink(200, Duration::ZERO).await;
    let tenant = "tenant-g";
    for (ty, url) in [
        ("transaction.created", &url_a),
        ("transaction.posted", &url_b),
    ] {
        let v = s
            .create_subscription(
                tenant,
                json!({"event_types": [ty], "destination": {"type": "webhook", "url": url}}),
            )
            .await;
        assert_eq!(v["verification_state"], "active", "{v}");
    }
    let e = event(tenant, "ledger", "transaction", "created");
    let p = producer();
    produce(&p, &s.topic, std::slice::from_ref(&e));
    wait_until(Duration::from_secs(60), "A holds e", || {
        (got_a.lock().unwrap().as_slice() == [e.id()]).then_some(())
    });
    // e's dedup entry has expired; its job is leased for 70 s of the same clock.
    s.advance("2s").await;
    let f = event(tenant, "ledger", "transaction", "posted");
    produce(&p, &s.topic, &[e.clone(), f.clone()]);
    sink_b.wait_count(&f.id(), 1);
    // B's outcome is applied in a transaction after the one that took e again.
    s.wait_metric(ATTEMPTS_DELIVERED, 1).await;
    assert_eq!(got_a.lock().unwrap().len(), 1, "A still holds e");
    assert_eq!(
        s.metric("streaming_hub_hub_events_total{outcome=\"new\"")
            .await,
        3,
        "e was judged new again (its dedup window over), then f"
    );
    // A second job of e would have replaced the first: the first attempt's outcome is then stale
    // and only a second request to A could count as A's delivery.
    gate_a.add_permits(2);
    s.wait_metric(ATTEMPTS_DELIVERED, 2).await;
    assert_eq!(got_a.lock().unwrap().len(), 1, "A got e once");
}

const ATTEMPTS_DELIVERED: &str = "streaming_hub_attempts_total{outcome=\"delivered\"";

/// Runs a future to completion from synchronous test code (inside `wait_until`).
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_dead_letters_are_searchable_and_never_delivered() {
    let s = ApiHub::start("fore", &[]).await;
    let dlq = format!("{}.dlq", s.topic);
    create_topic(&dlq, 1).await;
    let (url, sink) = start_sink(200, Duration::ZERO).await;
    s.create_subscription(
        "tenant-f",
        json!({"event_types": ["*"], "destination": {"type": "webhook", "url": url}}),
    )
    .await;
    let source = s.topic.trim_start_matches("lerian.streaming.").to_string();
    let dead = event("tenant-f", "ledger", "transaction", "created")
        .add("x-lerian-dlq-source-topic", s.topic.as_bytes())
        .add("x-lerian-dlq-cause-kind", b"business")
        .add("x-lerian-dlq-error-class", b"validation_error")
        .add("x-lerian-dlq-error-message", b"amount must be positive")
        .add("x-lerian-dlq-retry-count", b"3");
    // A producer's header name need not be UTF-8 (Kafka takes any bytes): the index shows it
    // lossily instead of its thread dying on it (rdkafka's `Headers::iter` panics there).
    produce_with_raw_header_name(&dlq, &dead, b"x-\xff-raw");
    let bad =
        event("tenant-f", "ledger", "transaction", "created").set("ce-specversion", Some(b"0.3"));
    let live = event("tenant-f", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, &[bad.clone(), live.clone()]);
    sink.wait_count(&live.id(), 1);

    let admin = admin_token();
    let addr = s.hub.addr();
    let q = format!("/admin/dlq?source={source}&tenant=tenant-f");
    let records = wait_until(
        Duration::from_secs(60),
        "the producer dead letter indexed",
        || {
            futures_block(get_json(&s, &addr, &q, &admin)).1["records"]
                .as_array()
                .filter(|r| !r.is_empty())
                .cloned()
        },
    );
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r["topic"], dlq.as_str());
    assert_eq!(r["source"], source.as_str());
    assert_eq!(r["cause"], "business");
    assert_eq!(r["dlq"]["error-message"], "amount must be positive");
    assert_eq!(r["dlq"]["retry-count"], "3");
    assert_eq!(r["dlq"]["source-topic"], s.topic.as_str());
    let keys: Vec<&str> = r["headers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|h| h["key"].as_str())
        .collect();
    assert!(keys.contains(&"x-\u{fffd}-raw"), "{keys:?}");
    assert_eq!(keys.len(), dead.headers.len() + 1, "{keys:?}");
    assert_eq!(
        r["payload"],
        serde_json::from_slice::<Value>(dead.value.as_ref().unwrap()).unwrap()
    );
    let (_, none, _) = get_json(&s, &addr, &format!("{q}&cause=codec"), &admin).await;
    assert_eq!(none["records"].as_array().unwrap().len(), 0, "cause filter");
    let (st, _, _) = get_json(&s, &addr, &q, &s.token("tenant-f")).await;
    assert_eq!(st, 403, "admin only");

    let quarantined = wait_until(
        Duration::from_secs(60),
        "the malformed record in /admin/quarantine",
        || {
            futures_block(get_json(
                &s,
                &addr,
                "/admin/quarantine?tenant=tenant-f",
                &admin,
            ))
            .1["records"]
                .as_array()
                .filter(|r| !r.is_empty())
                .cloned()
        },
    );
    assert_eq!(quarantined[0]["reason"], "unsupported_specversion");
    assert_eq!(quarantined[0]["dlq"]["source-topic"], s.topic.as_str());

    // A later event is delivered; the dead letter never was.
    let later = event("tenant-f", "ledger", "transaction", "posted");
    produce(&producer(), &s.topic, std::slice::from_ref(&later));
    sink.wait_count(&later.id(), 1);
    assert_eq!(
        sink.count(&dead.id()),
        0,
        "a producer's dead letter is never delivered"
    );
    assert_eq!(sink.count(&bad.id()), 0);
}

/// The index is read from its topics' start at each start, so its pages say whether it has read
/// them up to where they ended: a page that says `complete` holds every record written before,
/// a topic written in transactions (its last offset a commit marker, never a record) included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forensic_page_that_says_complete_holds_everything_written_before_the_start() {
    use rdkafka::producer::Producer;
    const N: usize = 300;
    let source = unique("catchup");
    let dlq = format!("lerian.streaming.{source}.dlq");
    create_topic(&dlq, 1).await;
    let p: TestProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", format!("{dlq}.test"))
        .create_with_context(FailOnError::default())
        .expect("transactional producer");
    p.init_transactions(Duration::from_secs(30)).unwrap();
    p.begin_transaction().unwrap();
    let recs: Vec<Rec> = (0..N)
        .map(|_| {
            event("tenant-c", "ledger", "transaction", "created")
                .add("x-lerian-dlq-source-topic", b"lerian.streaming.ledger")
                .add("x-lerian-dlq-cause-kind", b"business")
        })
        .collect();
    produce(&p, &dlq, &recs);
    p.commit_transaction(Duration::from_secs(30)).unwrap();

    let s = ApiHub::start("cu", &[]).await;
    let (admin, addr) = (admin_token(), s.hub.addr());
    let q = format!("/admin/dlq?source={source}&limit=1000");
    let mut partial = 0;
    wait_until(Duration::from_secs(60), "a complete page", || {
        let (st, page, _) = futures_block(get_json(&s, &addr, &q, &admin));
        assert_eq!(st, 200, "{page}");
        let got = page["records"].as_array().map_or(0, Vec::len);
        match page["complete"].as_bool() {
            Some(true) => {
                assert_eq!(got, N, "a page that says complete holds them all");
                Some(())
            }
            Some(false) => {
                partial += 1;
                None
            }
            None => panic!("no `complete` in {page}"),
        }
    });
    eprintln!("{partial} answers before the index was complete");
    // The same flag (another test's new producer DLQ topic may turn it false again meanwhile).
    for path in ["/admin/quarantine", "/admin/deliveries/dead"] {
        let (st, page, _) = get_json(&s, &addr, path, &admin).await;
        assert_eq!(st, 200, "{path}: {page}");
        assert!(page["complete"].is_boolean(), "{path}: {page}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_deliveries_records_every_attempt_the_sink_saw() {
    let mut s = ApiHub::start("term", &[("STREAMING_HUB_SHUTDOWN_TIMEOUT", "20s")]).await;
    // Each delivery takes 1.5 s: SIGTERM lands while attempts are in flight.
    let (url, sink) = start_sink(200, Duration::from_millis(1500)).await;
    s.create_subscription(
        "tenant-t",
        json!({"event_types": ["*"], "destination": {"type": "webhook", "url": url}}),
    )
    .await;
    let evs: Vec<Rec> = (0..20)
        .map(|_| event("tenant-t", "ledger", "transaction", "created"))
        .collect();
    produce(&producer(), &s.topic, &evs);
    wait_until(Duration::from_secs(60), "attempts in flight", || {
        (sink.got.lock().unwrap().len() >= 3).then_some(())
    });
    s.hub.terminate();
    let log = s.hub.log_text();
    assert!(
        log.contains("attempts in flight at shutdown recorded"),
        "{log}"
    );
    let seen: Vec<String> = sink
        .got
        .lock()
        .unwrap()
        .iter()
        .map(|h| h["x-lerian-delivery-id"].clone())
        .collect();
    let codec = Codec::new().unwrap();
    let attempts: Vec<String> = read_all(
        &[&format!("{}.attempts", s.prefix)],
        Duration::from_secs(30),
    )
    .iter()
    .map(|g| {
        codec
            .decode::<AttemptRecord>(RecordKind::Attempt, g.rec.value.as_ref().unwrap())
            .unwrap()
            .delivery_id
    })
    .collect();
    for d in &seen {
        assert!(
            attempts.contains(d),
            "attempt {d} reached the sink but was not recorded"
        );
    }
    // The restarted hub delivers the rest: every event at least once.
    s.hub = Hub::start(&s.hub.env.clone());
    for e in &evs {
        sink.wait_count(&e.id(), 1);
    }
}

/// While a stopping hub drains its attempts in flight, its HTTP server still answers: `/readyz`
/// 503 (taken out of a load balancer), `/healthz` and `/metrics` 200 (a liveness probe refused
/// mid-drain would have the instance killed). The server stopped accepting at the signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_hub_answers_not_ready_but_alive_until_it_exits() {
    let mut s = ApiHub::start("drain", &[("STREAMING_HUB_SHUTDOWN_TIMEOUT", "20s")]).await;
    let (url, sink) = start_sink(200, Duration::from_secs(8)).await;
    s.create_subscription(
        "tenant-d",
        json!({"event_types": ["*"], "destination": {"type": "webhook", "url": url}}),
    )
    .await;
    let e = event("tenant-d", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, std::slice::from_ref(&e));
    wait_until(Duration::from_secs(60), "an attempt in flight", || {
        (!sink.got.lock().unwrap().is_empty()).then_some(())
    });
    assert_eq!(s.hub.status_of("/readyz"), Some(200));
    s.hub.sigterm();
    wait_until(
        Duration::from_secs(30),
        "/readyz 503 while draining",
        || (s.hub.status_of("/readyz")? == 503).then_some(()),
    );
    assert_eq!(
        s.hub.status_of("/healthz"),
        Some(200),
        "alive while draining"
    );
    assert_eq!(s.hub.status_of("/metrics"), Some(200));
    // The API is refused: its table is no longer kept current.
    assert_eq!(s.hub.status_of("/v1/subscriptions"), Some(503));
    s.hub.terminate();
    assert_eq!(
        s.hub.status_of("/healthz"),
        None,
        "closed once the hub exits"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_and_delivery_roles_run_apart_and_together_deliver() {
    // Hub A ingests only; hub B runs the hub tasks and delivers only. Same topics and groups.
    let a = ApiHub::start("roles", &[("STREAMING_HUB_ROLE", "ingest")]).await;
    let mut env_b = another_instance(&a.hub.env, "b");
    env_b.insert("STREAMING_HUB_ROLE".into(), "delivery".into());
    let b = ApiHub {
        prefix: a.prefix.clone(),
        topic: a.topic.clone(),
        hub: Hub::start(&env_b),
        http: a.http.clone(),
    };
    let (url, sink) = start_sink(200, Duration::ZERO).await;
    b.create_subscription(
        "tenant-o",
        json!({"event_types": ["*"], "destination": {"type": "webhook", "url": url}}),
    )
    .await;
    let e = event("tenant-o", "ledger", "transaction", "created");
    produce(&producer(), &a.topic, std::slice::from_ref(&e));
    sink.wait_count(&e.id(), 1);
    assert!(a.metric("streaming_hub_ingest_records_total").await >= 1);
    assert_eq!(
        b.metric("streaming_hub_ingest_records_total").await,
        0,
        "B does not ingest"
    );
    // Counted once its transaction commits, which a first attempt may beat to the sink.
    b.wait_metric("streaming_hub_hub_events_total", 1).await;
    assert_eq!(
        a.metric("streaming_hub_hub_events_total").await,
        0,
        "A runs no hub task"
    );
    // The delivery side's metrics: end-to-end latency, backlog sample, consumer lag.
    b.wait_metric("streaming_hub_delivery_latency_seconds_count", 1)
        .await;
    let mut text = String::new();
    for _ in 0..300 {
        text = b.metrics_text().await;
        if text.contains("streaming_hub_due_jobs{tenant=\"_all\"}")
            && text.contains("streaming_hub_consumer_lag{stage=\"hub\"")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        text.contains("streaming_hub_due_jobs{tenant=\"_all\"}"),
        "{text}"
    );
    assert!(
        text.contains("streaming_hub_consumer_lag{stage=\"hub\""),
        "{text}"
    );
    assert!(text.contains("streaming_hub_breakers_open"), "{text}");
}

/// `STREAMING_HUB_KAFKA_DEBUG` turns librdkafka's debug output on for the hub's Kafka clients and
/// lets it through the log filter by itself: with the filter at `warn`, the transactional
/// producers' `eos` lines (their `init_transactions` at start) reach the log, and the filter
/// still holds for everything else. A hub without the setting, at `debug`, logs no such line:
/// the setting, not the filter, is what turns them on.
#[test]
fn kafka_debug_shows_librdkafka_lines_whatever_the_log_filter() {
    require_broker();
    let eos_line = |log: &str| {
        log.lines()
            .any(|l| l.contains("librdkafka: TXNAPI") && l.contains("init_transactions"))
    };
    let prefix = unique("kafka-debug");
    let mut env = hub_env(&prefix, "^unused$");
    env.insert("STREAMING_HUB_LOG".into(), "warn".into());
    env.insert("STREAMING_HUB_KAFKA_DEBUG".into(), "eos".into());
    let mut hub = Hub::start(&env);
    wait_until(Duration::from_secs(60), "librdkafka's eos lines", || {
        eos_line(&hub.log_text()).then_some(())
    });
    hub.terminate();
    let log = hub.log_text();
    assert!(
        !log.lines().any(|l| l.contains(" INFO ")),
        "the filter still holds for the hub's own lines"
    );

    let mut env = hub_env(&unique("kafka-debug-off"), "^unused$");
    env.insert("STREAMING_HUB_LOG".into(), "debug".into());
    let mut hub = Hub::start(&env);
    wait_until(Duration::from_secs(60), "the hub's own debug lines", || {
        hub.log_text().contains(" DEBUG ").then_some(())
    });
    hub.terminate();
    assert!(
        !eos_line(&hub.log_text()),
        "librdkafka's debug output is off unless asked for"
    );
}

/// `streaming-hub token` mints only what the API takes: a tenant of 1-256 bytes without control
/// characters (an empty one was printed, exit 0, and every request with it was refused).
#[test]
fn the_token_command_refuses_a_tenant_the_api_would_not_take() {
    let token = |tenant: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
            .args(["token", "--tenant", tenant])
            .env("STREAMING_HUB_JWT_SECRET", JWT)
            .output()
            .unwrap()
    };
    for bad in ["", "a\tb", &"t".repeat(257)] {
        let out = token(bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(out.stdout.is_empty(), "nothing minted for {bad:?}");
    }
    let out = token("acme");
    assert_eq!(out.status.code(), Some(0));
    let minted = String::from_utf8(out.stdout).unwrap();
    let keys =
        streaming_hub::api::auth::JwtKeys::new(streaming_hub::runtime::secret::Secret::new(JWT));
    let caller = streaming_hub::api::auth::verify(&keys, minted.trim(), 0).unwrap();
    assert_eq!(caller.tenant.as_deref(), Some("acme"));
}

/// `/metrics` names tenants and takes no token: with `STREAMING_HUB_METRICS_LISTEN_ADDR` set it is
/// served on that address only, the API's answering `404` for it; the health endpoints answer on
/// both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_their_own_address_are_not_served_on_the_apis() {
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let s = ApiHub::start(
        "metrics-addr",
        &[("STREAMING_HUB_METRICS_LISTEN_ADDR", &metrics_addr)],
    )
    .await;
    let get = |addr: String, path: &'static str| {
        let http = s.http.clone();
        async move {
            let r = http
                .get(format!("http://{addr}{path}"))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, text) = get(metrics_addr.clone(), "/metrics").await;
    assert_eq!(status, 200);
    assert!(text.contains("streaming_hub_"), "{text}");
    let (status, text) = get(s.hub.addr(), "/metrics").await;
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("no such route"), "{text}");
    for addr in [metrics_addr, s.hub.addr()] {
        assert_eq!(get(addr.clone(), "/healthz").await.0, 200, "{addr}");
        assert_eq!(get(addr.clone(), "/readyz").await.0, 200, "{addr}");
    }
}

/// A pull client that comes back after retention deleted what its cursor points at: the page
/// starts at the oldest record kept, as before, and now says how many records of the partition
/// were deleted past the cursor (`skipped_offsets`), so the client knows it missed events
/// instead of reading on as if nothing had happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_cursor_older_than_retention_says_how_much_was_deleted_past_it() {
    let s = ApiHub::start("pullgap", &[]).await;
    let v = s
        .create_subscription(
            "tenant-g",
            json!({"event_types": ["*"], "destination": {"type": "pull"}}),
        )
        .await;
    let sub = v["id"].as_str().unwrap().to_string();
    let (token, addr) = (s.token("tenant-g"), s.hub.addr());
    let page = |cursor: Option<String>| {
        let (s, token, addr, sub) = (&s, token.clone(), addr.clone(), sub.clone());
        async move {
            let at = cursor.map(|c| format!("&cursor={c}")).unwrap_or_default();
            let path = format!("/v1/events?subscription_id={sub}&limit=10{at}");
            let (st, body, _) = get_json(s, &addr, &path, &token).await;
            assert_eq!(st, 200, "{body}");
            body
        }
    };
    let until = |want: usize, cursor: Option<String>| {
        let page = &page;
        async move {
            for _ in 0..300 {
                let body = page(cursor.clone()).await;
                if body["events"].as_array().unwrap().len() >= want {
                    return body;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("fewer than {want} events after 30 s");
        }
    };
    let ev = || event("tenant-g", "ledger", "transaction", "created");
    produce(&producer(), &s.topic, &[ev(), ev()]);
    let first = until(2, None).await;
    assert!(first.get("skipped_offsets").is_none(), "{first}");
    let cursor = first["next_cursor"].as_str().unwrap().to_string();
    // Two more reach the pull topic; retention then deletes everything it holds.
    produce(&producer(), &s.topic, &[ev(), ev()]);
    until(2, Some(cursor.clone())).await;
    let pull = format!("{}.pull", s.prefix);
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..6 {
        tpl.add_partition_offset(&pull, p, rdkafka::Offset::End)
            .unwrap();
    }
    admin()
        .delete_records(&tpl, &rdkafka::admin::AdminOptions::new())
        .await
        .unwrap();
    let last = ev();
    produce(&producer(), &s.topic, std::slice::from_ref(&last));
    let gap = until(1, Some(cursor)).await;
    assert_eq!(page_ids(&gap), [last.id()], "{gap}");
    // The two events deleted past the cursor, and the transaction markers after them.
    let skipped = gap["skipped_offsets"].as_u64().unwrap_or(0);
    assert!(skipped >= 2, "{gap}");
    let next = gap["next_cursor"].as_str().unwrap().to_string();
    let after = page(Some(next)).await;
    assert!(after.get("skipped_offsets").is_none(), "{after}");
    assert!(s.metric("streaming_hub_pull_cursor_gaps_total").await >= 1);
}
