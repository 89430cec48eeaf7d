//! The subscription API through the real binary and broker: create a webhook subscription (the
//! verification handshake runs against a real local HTTP server), see it matched by real events,
//! see a subscription written straight to the control topic through the API, and never find the
//! signing secret in a GET, in the control topic or in the debug log.
mod common;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use common::*;
use serde_json::{Value, json};
use streaming_hub::runtime::avro::{Codec, RecordKind};
use streaming_hub::runtime::records::SubscriptionRecord;
use streaming_hub::runtime::secret::Secret;

/// A receiver that answers the verification challenge and counts other requests.
async fn echo_server() -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = Router::new().route(
        "/hook",
        post(move |body: String| {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                body // the challenge is in the body: echoing it passes verification
            }
        }),
    );
    let addr = serve(app).await;
    (format!("http://{addr}/hook"), hits)
}

#[tokio::test]
async fn subscription_created_through_the_api_is_verified_matched_and_never_leaks_its_secret() {
    require_broker();
    let prefix = unique("api");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let mut env = api_hub_env(&prefix, &topic);
    env.insert("STREAMING_HUB_LOG".into(), "debug".into());
    let hub = Hub::start(&env);
    let base = format!("http://{}", hub.addr());
    let http = hub_http();
    let token = streaming_hub::api::mint(
        &Secret::new(JWT),
        Some("tenant-a"),
        false,
        Duration::from_secs(600),
    );
    let (url, hits) = echo_server().await;

    // No token: 401.
    let r = http
        .get(format!("{base}/v1/subscriptions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    let r = http
        .post(format!("{base}/v1/subscriptions"))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .body(json!({"event_types": ["transaction.created"], "origin": "ledger", "destination": {"type": "webhook", "url": url}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let created: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    let id = created["id"].as_str().unwrap().to_string();
    let secret = created["signing_secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));
    assert_eq!(created["verification_state"], "active", "{created}");
    assert!(
        hits.load(Ordering::SeqCst) >= 1,
        "the handshake reached the receiver"
    );

    let got = http
        .get(format!("{base}/v1/subscriptions/{id}"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let got: Value = serde_json::from_slice(&got.bytes().await.unwrap()).unwrap();
    assert_eq!(got["id"], id.as_str());
    assert!(
        !got.to_string().contains(&secret[6..]),
        "GET must not show the secret"
    );

    // Events: two match (transaction.created from ledger), one does not (another type).
    let p = producer();
    produce(
        &p,
        &topic,
        &[
            event("tenant-a", "ledger", "transaction", "created"),
            event("tenant-a", "ledger", "transaction", "created"),
            event("tenant-a", "ledger", "account", "created"),
            event("tenant-b", "ledger", "transaction", "created"),
        ],
    );
    let metrics = wait_until(Duration::from_secs(60), "matches counted", || {
        let text = std::process::Command::new("curl")
            .args(["-fsS", &format!("{base}/metrics")])
            .output()
            .ok()?;
        let text = String::from_utf8(text.stdout).ok()?;
        (metric_sum(&text, "streaming_hub_events_unmatched_total") >= 2).then_some(text)
    });
    assert_eq!(metric_sum(&metrics, "streaming_hub_matches_total"), 2);
    assert_eq!(
        metric_sum(&metrics, "streaming_hub_events_unmatched_total"),
        2
    );

    // A subscription written straight to the control topic by a plain producer shows in the API.
    let codec = Codec::new().unwrap();
    let direct = SubscriptionRecord::pull(&uuid::Uuid::now_v7().to_string(), "tenant-a", &["*"]);
    let control = format!("{prefix}.subscriptions");
    let rec = Rec {
        key: Some(direct.id.clone().into_bytes()),
        value: Some(codec.encode(RecordKind::Subscription, &direct).unwrap()),
        ..Default::default()
    };
    produce(&p, &control, &[rec]);
    let listed = wait_until(
        Duration::from_secs(30),
        "direct write visible in the API",
        || {
            let out = std::process::Command::new("curl")
                .args([
                    "-fsS",
                    "-H",
                    &format!("Authorization: Bearer {token}"),
                    &format!("{base}/v1/subscriptions"),
                ])
                .output()
                .ok()?;
            let v: Value = serde_json::from_slice(&out.stdout).ok()?;
            v.to_string().contains(&direct.id).then_some(v)
        },
    );
    assert!(!listed.to_string().contains(&secret[6..]));

    // Another tenant cannot see either.
    let other = streaming_hub::api::mint(
        &Secret::new(JWT),
        Some("tenant-b"),
        false,
        Duration::from_secs(600),
    );
    let r = http
        .get(format!("{base}/v1/subscriptions/{id}"))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // The secret is nowhere in the control topic's bytes or in the debug log.
    for g in read_all(&[&control], Duration::from_secs(30)) {
        let v = g.rec.value.unwrap_or_default();
        assert!(
            !v.windows(secret.len() - 6)
                .any(|w| w == &secret.as_bytes()[6..])
        );
    }
    let log = hub.log_text();
    assert!(log.contains("DEBUG"), "the log really was at debug level");
    assert!(!log.contains(&secret[6..]), "secret in the log");
    assert!(!log.contains(KEK), "KEK in the log");
    // Nothing went wrong, so nothing is logged as an error: the control topic's end of partition
    // and the producers' DLQ pattern matching no topic yet are normal (they were ERROR lines).
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert!(
        errors.is_empty(),
        "ERROR lines in a healthy run: {errors:#?}"
    );
}

/// A receiver as the README's guide writes it: it answers the challenge only when the request's
/// signature verifies under the one secret it was configured with (`401` otherwise).
async fn strict_receiver(secret: &'static str) -> String {
    let app = Router::new().route(
        "/hook",
        post(
            move |headers: axum::http::HeaderMap, body: String| async move {
                let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("");
                let ts: i64 = h("webhook-timestamp").parse().unwrap_or(0);
                let want = streaming_hub::delivery::signing::signature_header(
                    &[Secret::new(secret)],
                    h("webhook-id"),
                    ts,
                    body.as_bytes(),
                )
                .unwrap();
                match h("webhook-signature") == want {
                    true => (axum::http::StatusCode::OK, body),
                    false => (axum::http::StatusCode::UNAUTHORIZED, String::new()),
                }
            },
        ),
    );
    format!("http://{}/hook", serve(app).await)
}

#[tokio::test]
async fn a_caller_chosen_signing_secret_lets_a_strict_receiver_pass_verification_at_create() {
    const CHOSEN: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSwMfKQ9r8GKYo=";
    let s = ApiHub::start("apisecret", &[]).await;
    let url = strict_receiver(CHOSEN).await;
    let webhook = |extra: Value| {
        let mut body =
            json!({"event_types": ["*"], "destination": {"type": "webhook", "url": url}});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let created = s
        .create_subscription("tenant-s", webhook(json!({"signing_secret": CHOSEN})))
        .await;
    assert_eq!(created["verification_state"], "active", "{created}");
    assert_eq!(created["signing_secret"], CHOSEN);
    // A secret the receiver cannot know yet: its probe is refused, the subscription waits.
    let random = s.create_subscription("tenant-s", webhook(json!({}))).await;
    assert_eq!(random["verification_state"], "pending", "{random}");
    assert_ne!(random["signing_secret"], CHOSEN);
    // A malformed secret, or one on a pull subscription: a 400 naming the field, never the value.
    let token = s.token("tenant-s");
    let addr = s.hub.addr();
    for body in [
        webhook(json!({"signing_secret": "whsec_c2hvcnQ="})),
        webhook(json!({"signing_secret": "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"})),
        json!({"event_types": ["*"], "destination": {"type": "pull"}, "signing_secret": CHOSEN}),
    ] {
        let (status, v) = post_json_to(&s.http, &addr, "/v1/subscriptions", &token, &body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["field"], "signing_secret", "{v}");
        let secret = body["signing_secret"].as_str().unwrap();
        assert!(!v.to_string().contains(&secret[6..]), "{v}");
    }
}

/// A receiver that answers the challenge only while `ready` is set (a new endpoint not deployed
/// yet answers 503), and records the `webhook-id` (the `ce-id`) of every delivery it takes.
async fn switchable_receiver(ready: bool) -> (String, Arc<AtomicBool>, Arc<Mutex<Vec<String>>>) {
    let flag = Arc::new(AtomicBool::new(ready));
    let ids = Arc::new(Mutex::new(Vec::new()));
    let (f, got) = (flag.clone(), ids.clone());
    let app = Router::new().route(
        "/hook",
        post(
            move |headers: axum::http::HeaderMap, body: String| async move {
                if !f.load(Ordering::SeqCst) {
                    return (axum::http::StatusCode::SERVICE_UNAVAILABLE, String::new());
                }
                let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok());
                if h("x-lerian-event-type") != Some("streaming_hub.verification") {
                    got.lock()
                        .unwrap()
                        .push(h("webhook-id").unwrap_or("").to_string());
                }
                (axum::http::StatusCode::OK, body)
            },
        ),
    );
    (format!("http://{}/hook", serve(app).await), flag, ids)
}

/// Moving an active webhook to a new URL loses no event: the new URL is probed before anything
/// is written, so while the new endpoint is not up the PATCH is a `422` and the old URL takes the
/// events; once it passes, the change is written `active` at once and the next event goes to the
/// new URL. Written `pending` first (as before), the subscription matched nothing until its
/// probe passed, and every event in between was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_an_active_webhook_to_a_new_url_loses_no_event() {
    let s = ApiHub::start("apimove", &[]).await;
    let (old_url, _, old_got) = switchable_receiver(true).await;
    let (new_url, new_ready, new_got) = switchable_receiver(false).await;
    let created = s
        .create_subscription(
            "tenant-m",
            json!({"event_types": ["*"], "destination": {"type": "webhook", "url": old_url}}),
        )
        .await;
    assert_eq!(created["verification_state"], "active", "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let p = producer();
    let send = |n: &str| {
        let e = event("tenant-m", "ledger", "transaction", n);
        let ce_id = e.id();
        produce(&p, &s.topic, &[e]);
        ce_id
    };
    let arrived = |got: &Arc<Mutex<Vec<String>>>, ce_id: &str| {
        let got = got.clone();
        let ce_id = ce_id.to_string();
        move || got.lock().unwrap().contains(&ce_id).then_some(())
    };
    let first = send("created");
    wait_until(
        Duration::from_secs(60),
        "the first event at the old URL",
        arrived(&old_got, &first),
    );

    let (addr, token) = (s.hub.addr(), s.token("tenant-m"));
    let path = format!("/v1/subscriptions/{id}");
    let patch = |url: &str| {
        let body = json!({"destination": {"type": "webhook", "url": url}});
        let (http, addr, path, token) = (s.http.clone(), addr.clone(), path.clone(), token.clone());
        async move {
            call_json(
                &http,
                reqwest::Method::PATCH,
                &addr,
                &path,
                &token,
                Some(&body),
            )
            .await
        }
    };
    let (status, v) = patch(&new_url).await;
    assert_eq!(status, 422, "{v}");
    assert_eq!(
        (v["error"]["code"].as_str(), v["error"]["field"].as_str()),
        (Some("bad_status"), Some("destination.url")),
        "{v}"
    );
    let second = send("updated");
    wait_until(
        Duration::from_secs(60),
        "the event sent while the new endpoint was down, at the old URL",
        arrived(&old_got, &second),
    );

    new_ready.store(true, Ordering::SeqCst);
    let (status, v) = patch(&new_url).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["verification_state"], "active", "{v}");
    let third = send("settled");
    wait_until(
        Duration::from_secs(60),
        "the next event at the new URL",
        arrived(&new_got, &third),
    );
    assert!(!old_got.lock().unwrap().contains(&third));
    assert!(
        new_got.lock().unwrap().iter().all(|i| *i == third),
        "only the event after the move"
    );
}

/// Two instances behind one load balancer: what one wrote and acknowledged is what the next
/// request finds on the other, even while the other's control reader lags (here by a second a
/// record, `STREAMING_HUB_DANGEROUS_TEST_CONTROL_LAG`). Before, the lagging instance answered from
/// its own table: `404` for a subscription just created on the first, and a PATCH made from an
/// older version that undid a rotated secret without a word; so was a pull subscription's first
/// read there. A reader lagging past the 5 s wait is a `503 table_behind`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_on_one_instance_is_read_and_built_on_by_another_whose_reader_lags() {
    let a = ApiHub::start("apisync", &[]).await;
    let b = lagging_instance(&a, "b", "ingest", "1s");
    let (url, _) = echo_server().await;
    let created = a
        .create_subscription(
            "tenant-y",
            json!({"event_types": ["*"], "destination": {"type": "webhook", "url": url}}),
        )
        .await;
    assert_eq!(created["verification_state"], "active", "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let token = a.token("tenant-y");
    let call = |addr: String, method: reqwest::Method, path: String, body: Option<Value>| {
        let (http, token) = (a.http.clone(), token.clone());
        async move { call_json(&http, method, &addr, &path, &token, body.as_ref()).await }
    };
    let path = format!("/v1/subscriptions/{id}");
    let (status, got) = call(b.addr(), reqwest::Method::GET, path.clone(), None).await;
    assert_eq!(status, 200, "read on the lagging instance: {got}");
    assert_eq!(got["version"], created["version"], "{got}");
    // A pull subscription's first read, on the lagging instance: an empty page, not a 404 that
    // tells the client its subscription is gone.
    let pull = a
        .create_subscription(
            "tenant-y",
            json!({"event_types": ["*"], "destination": {"type": "pull"}}),
        )
        .await;
    let pull_id = pull["id"].as_str().expect("a pull subscription's id");
    let (status, page) = call(
        b.addr(),
        reqwest::Method::GET,
        format!("/v1/events?subscription_id={pull_id}"),
        None,
    )
    .await;
    assert_eq!(status, 200, "a pull read on the lagging instance: {page}");
    assert_eq!(page["events"], json!([]), "{page}");

    let (status, rotated) = call(
        a.hub.addr(),
        reqwest::Method::POST,
        format!("{path}/rotate-secret"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{rotated}");
    let (status, patched) = call(
        b.addr(),
        reqwest::Method::PATCH,
        path.clone(),
        Some(json!({"event_types": ["account.*"]})),
    )
    .await;
    assert_eq!(status, 200, "{patched}");
    let (status, now) = call(a.hub.addr(), reqwest::Method::GET, path.clone(), None).await;
    assert_eq!(status, 200, "{now}");
    assert_eq!(now["event_types"], json!(["account.*"]), "{now}");
    assert_eq!(
        now["version"].as_u64(),
        Some(created["version"].as_u64().unwrap() + 2),
        "the PATCH was made from the rotation's version, not the one before: {now}"
    );
    assert_eq!(patched["version"], now["version"], "{patched}");
    drop(b);

    // A reader further behind than the wait: a typed 503, not a stale answer.
    let c = lagging_instance(&a, "c", "ingest", "8s");
    let (status, _) = call(
        a.hub.addr(),
        reqwest::Method::PATCH,
        path.clone(),
        Some(json!({"event_types": ["account.created"]})),
    )
    .await;
    assert_eq!(status, 200);
    let (status, behind) = call(c.addr(), reqwest::Method::GET, path, None).await;
    assert_eq!(status, 503, "{behind}");
    assert_eq!(behind["error"]["code"], "table_behind", "{behind}");
}
