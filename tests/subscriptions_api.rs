//! The subscription API through the real binary and broker: create a webhook subscription (the
//! verification handshake runs against a real local HTTP server), see it matched by real events,
//! see a subscription written straight to the control topic through the API, and never find the
//! signing secret in a GET, in the control topic or in the debug log.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
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
