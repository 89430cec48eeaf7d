//! Signing secrets: shown once on create and on rotate, sealed at rest, rotated with a grace
//! period; sensitive headers sealed and shown by name only.
use std::time::Duration;

use axum::http::{Method, StatusCode};
use serde_json::json;

use super::{Harness, Hook, START_MS, webhook_body};
use crate::runtime::avro::RecordKind;

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test]
async fn signing_secret_is_shown_on_create_only_and_is_sealed_at_rest() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let a = h
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let secret = a.body["signing_secret"].as_str().unwrap().to_string();
    assert!(
        secret.starts_with("whsec_") && secret.len() > 40,
        "{secret}"
    );
    let id = a.body["id"].as_str().unwrap().to_string();

    let got = h.get(&format!("/v1/subscriptions/{id}"), &token).await;
    let listed = h.get("/v1/subscriptions", &token).await;
    for text in [&got.text, &listed.text] {
        assert!(!text.contains(&secret), "a GET shows the secret: {text}");
        assert!(!text.contains("signing_secret"), "{text}");
    }
    let stored = h.state.subs.get(&id).unwrap();
    assert!(
        !format!("{stored:?}").contains(&secret),
        "Debug of the stored record shows the secret"
    );
    let bytes = crate::runtime::avro::Codec::new()
        .unwrap()
        .encode(RecordKind::Subscription, &*stored)
        .unwrap();
    assert!(
        !contains(&bytes, &secret),
        "the control-topic bytes hold the secret"
    );
    assert!(
        !contains(&bytes, &secret["whsec_".len()..]),
        "the control-topic bytes hold the key"
    );
    assert_eq!(stored.signing_secrets.len(), 1);
    assert_eq!(
        h.kek()
            .open_secret(&stored.signing_secrets[0], &id)
            .unwrap()
            .expose(),
        secret,
        "the seal holds it"
    );
    assert!(
        h.kek()
            .open_secret(&stored.signing_secrets[0], "another-id")
            .is_err(),
        "bound to the subscription id"
    );
}

/// A create and a rotation whose write the producer reports failed though the broker took it
/// (a send that timed out during a leader's failover) are in force: their answers carry the
/// secret, as for any write. A `503` lost it while the record was on the control topic: a
/// duplicate create, and deliveries signed only with a secret nobody held once the old one's
/// grace ended. A write that did not land is still a `503`.
#[tokio::test]
async fn a_write_reported_failed_that_landed_answers_its_secret() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::runtime::avro::Codec;
    use crate::subscriptions::control::Subscriptions;
    let failing = Arc::new(AtomicBool::new(true));
    let codec = Arc::new(Codec::new().unwrap());
    let h = Harness::with_subs(
        true,
        Subscriptions::landed_but_failed(codec.clone(), failing.clone()),
    );
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let created = h
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text);
    let id = created.body["id"].as_str().unwrap().to_string();
    let first = created.body["signing_secret"].as_str().unwrap();
    let uri = format!("/v1/subscriptions/{id}/rotate-secret");
    let rotated = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(rotated.status, StatusCode::OK, "{}", rotated.text);
    let second = rotated.body["signing_secret"].as_str().unwrap();
    assert_ne!(second, first);
    let stored = h.state.subs.get(&id).unwrap();
    let current = h
        .kek()
        .open_secret(&stored.signing_secrets[0], &id)
        .unwrap();
    assert_eq!(
        current.expose(),
        second,
        "the answer's secret is the one that signs"
    );

    // Not landed: refused, and nothing changed.
    let h = Harness::with_subs(true, Subscriptions::failing(codec, failing.clone()));
    failing.store(false, Ordering::SeqCst);
    let created = h
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text);
    let id = created.body["id"].as_str().unwrap().to_string();
    let before = h.state.subs.get(&id).unwrap();
    failing.store(true, Ordering::SeqCst);
    let uri = format!("/v1/subscriptions/{id}/rotate-secret");
    let refused = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.text
    );
    assert!(!refused.text.contains("whsec_"), "{}", refused.text);
    assert_eq!(h.state.subs.get(&id).unwrap(), before);
}

#[tokio::test]
async fn rotate_puts_the_new_secret_first_and_keeps_the_old_one_until_its_grace_ends() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let created = h
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    let (id, first) = (
        created.body["id"].as_str().unwrap().to_string(),
        created.body["signing_secret"].as_str().unwrap().to_string(),
    );
    let uri = format!("/v1/subscriptions/{id}/rotate-secret");

    let a = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let second = a.body["signing_secret"].as_str().unwrap().to_string();
    assert_ne!(second, first);
    let default_grace_end = START_MS + 24 * 3600 * 1000;
    assert_eq!(
        a.body["previous_secret_expires_at"],
        crate::subscriptions::model::rfc3339(default_grace_end)
    );
    assert!(!a.body["subscription"].to_string().contains("whsec_"));
    let stored = h.state.subs.get(&id).unwrap();
    let opened: Vec<(String, Option<i64>)> = stored
        .signing_secrets
        .iter()
        .map(|s| {
            (
                h.kek().open_secret(s, &id).unwrap().expose().to_string(),
                s.expires_at,
            )
        })
        .collect();
    assert_eq!(
        opened,
        [
            (second.clone(), None),
            (first.clone(), Some(default_grace_end))
        ]
    );

    // A probe now carries both signatures, so either secret verifies it.
    let verified = h
        .call(
            Method::POST,
            &format!("/v1/subscriptions/{id}/verify"),
            Some(&token),
            None,
            &[],
        )
        .await;
    assert_eq!(verified.status, StatusCode::OK, "{}", verified.text);
    let (headers, _) = hook.requests().pop().unwrap();
    assert_eq!(
        headers["webhook-signature"]
            .to_str()
            .unwrap()
            .split(' ')
            .count(),
        2
    );

    // Past the first grace, another rotation drops the expired secret.
    h.clock.advance(Duration::from_secs(25 * 3600));
    let a = h.post(&uri, &h.token("acme"), json!({"grace": "1h"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let third = a.body["signing_secret"].as_str().unwrap().to_string();
    let stored = h.state.subs.get(&id).unwrap();
    let now = START_MS + 25 * 3600 * 1000;
    let opened: Vec<(String, Option<i64>)> = stored
        .signing_secrets
        .iter()
        .map(|s| {
            (
                h.kek().open_secret(s, &id).unwrap().expose().to_string(),
                s.expires_at,
            )
        })
        .collect();
    assert_eq!(opened, [(third, None), (second, Some(now + 3600 * 1000))]);
    assert_eq!(
        stored.version, 4,
        "create (1), probe passed (2), rotate (3), rotate (4)"
    );
}

#[tokio::test]
async fn rotate_refuses_a_sixth_live_secret_until_the_oldest_grace_ends() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let created = h
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    let id = created.body["id"].as_str().unwrap().to_string();
    let uri = format!("/v1/subscriptions/{id}/rotate-secret");
    // Four rotations: the current secret and four in their grace, the first of them ending first.
    for grace in ["1h", "2h", "3h", "4h"] {
        let a = h.post(&uri, &token, json!({ "grace": grace })).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    }
    let before = h.state.subs.get(&id).unwrap();
    assert_eq!(
        before.signing_secrets.len(),
        super::super::secrets::MAX_LIVE_SECRETS
    );
    let refused = h.post(&uri, &token, json!({"grace": "1h"})).await;
    assert_eq!(
        (refused.status, refused.body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("too_many_secrets")),
        "{}",
        refused.text
    );
    let first_free = crate::subscriptions::model::rfc3339(START_MS + 3_600_000);
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&first_free),
        "{}",
        refused.text
    );
    assert_eq!(
        h.state.subs.get(&id).unwrap().version,
        before.version,
        "nothing written"
    );
    // Once the first grace has ended that secret is dropped and a rotation goes through.
    h.clock.advance(Duration::from_secs(3_601));
    let a = h.post(&uri, &h.token("acme"), json!({"grace": "1h"})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(
        h.state.subs.get(&id).unwrap().signing_secrets.len(),
        super::super::secrets::MAX_LIVE_SECRETS
    );
}

#[tokio::test]
async fn rotate_refuses_a_grace_over_seven_days_and_pull_destinations() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    let uri = format!("/v1/subscriptions/{id}/rotate-secret");
    for (grace, code) in [("169h", "too_long"), ("tomorrow", "invalid")] {
        let a = h.post(&uri, &token, json!({"grace": grace})).await;
        assert_eq!(
            (
                a.status,
                a.body["error"]["field"].as_str(),
                a.body["error"]["code"].as_str()
            ),
            (StatusCode::BAD_REQUEST, Some("grace"), Some(code))
        );
    }
    let a = h
        .post(&uri, &token, json!({"grace": "1h", "keep": true}))
        .await;
    assert_eq!(a.body["error"]["field"], "keep");
    assert_eq!(
        h.state.subs.get(&id).unwrap().signing_secrets.len(),
        1,
        "nothing rotated"
    );
    let pull = h.create_pull("acme").await;
    let a = h
        .call(
            Method::POST,
            &format!("/v1/subscriptions/{pull}/rotate-secret"),
            Some(&token),
            None,
            &[],
        )
        .await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("not_a_webhook"))
    );
}

#[tokio::test]
async fn sensitive_headers_are_sealed_shown_by_name_and_sent_with_the_probe() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let mut body = webhook_body(&hook.url);
    body["destination"]["headers"] = json!({"X-Team": "payments"});
    body["destination"]["sensitive_headers"] = json!({"Authorization": "Bearer sk_live_topsecret"});
    let a = h.post("/v1/subscriptions", &token, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let id = a.body["id"].as_str().unwrap().to_string();
    let got = h.get(&format!("/v1/subscriptions/{id}"), &token).await;
    assert_eq!(
        got.body["destination"]["headers"],
        json!({"x-team": "payments"})
    );
    assert_eq!(
        got.body["destination"]["sensitive_header_names"],
        json!(["authorization"])
    );
    for text in [&a.text, &got.text] {
        assert!(!text.contains("sk_live_topsecret"), "{text}");
    }
    let stored = h.state.subs.get(&id).unwrap();
    assert!(!format!("{stored:?}").contains("sk_live_topsecret"));
    let bytes = crate::runtime::avro::Codec::new()
        .unwrap()
        .encode(RecordKind::Subscription, &*stored)
        .unwrap();
    assert!(!contains(&bytes, "sk_live_topsecret"));
    let (headers, _) = hook.requests().pop().unwrap();
    assert_eq!(headers["authorization"], "Bearer sk_live_topsecret");
    assert_eq!(headers["x-team"], "payments");

    // Replacing the plain headers keeps the sealed ones; a credential as a plain header is
    // refused (it would be stored and shown as written).
    let patch = json!({"destination": {"type": "webhook", "headers": {"x-env": "prod"}}});
    let p = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&token),
            Some(patch),
            &[],
        )
        .await;
    assert_eq!(
        p.body["destination"]["sensitive_header_names"],
        json!(["authorization"]),
        "{}",
        p.text
    );
    let clash = json!({"destination": {"type": "webhook", "headers": {"authorization": "x"}}});
    let p = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&token),
            Some(clash),
            &[],
        )
        .await;
    assert_eq!(
        (
            p.status,
            &p.body["error"]["field"],
            &p.body["error"]["code"]
        ),
        (
            StatusCode::BAD_REQUEST,
            &json!("destination.headers.authorization"),
            &json!("sensitive")
        ),
        "{}",
        p.text
    );
}

/// Write-only credentials never follow a URL to another receiver: a PATCH that moves the URL to
/// another origin or path without sending `sensitive_headers` again is refused (whoever may
/// PATCH would otherwise read them off their own receiver's probe; one host serves many, told
/// apart by path); with only the query changed they follow, and sent again (or `{}`) they go to
/// the new receiver.
#[tokio::test]
async fn sensitive_headers_never_follow_the_url_to_another_host() {
    let h = Harness::new();
    let (hook, other) = (Hook::start(true).await, Hook::start(true).await);
    let token = h.token("acme");
    let mut body = webhook_body(&hook.url);
    body["destination"]["sensitive_headers"] = json!({"Authorization": "Bearer sk_live_mine"});
    let id = h.post("/v1/subscriptions", &token, body).await.body["id"]
        .as_str()
        .unwrap()
        .to_string();
    let uri = format!("/v1/subscriptions/{id}");
    let patch = |url: &str, extra: Option<serde_json::Value>| {
        let mut d = json!({"type": "webhook", "url": url});
        if let Some(s) = extra {
            d["sensitive_headers"] = s;
        }
        json!({ "destination": d })
    };
    let p = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(patch(&other.url, None)),
            &[],
        )
        .await;
    assert_eq!(
        (
            p.status,
            p.body["error"]["field"].as_str(),
            p.body["error"]["code"].as_str()
        ),
        (
            StatusCode::BAD_REQUEST,
            Some("destination.sensitive_headers"),
            Some("required")
        ),
        "{}",
        p.text
    );
    assert!(
        other.requests().is_empty(),
        "no probe went to the other host"
    );
    assert_eq!(h.state.subs.get(&id).unwrap().version, 2, "nothing written");
    // The same host, another path (another receiver on a shared host): refused too.
    let beside = format!("{}/beside", hook.url.trim_end_matches('/'));
    let p = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(patch(&beside, None)),
            &[],
        )
        .await;
    assert_eq!(
        (p.status, p.body["error"]["field"].as_str()),
        (
            StatusCode::BAD_REQUEST,
            Some("destination.sensitive_headers")
        ),
        "{}",
        p.text
    );
    assert_eq!(h.state.subs.get(&id).unwrap().version, 2, "nothing written");
    // The same receiver, another query: they follow.
    let same = format!("{}?v=2", hook.url);
    let p = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(patch(&same, None)),
            &[],
        )
        .await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.text);
    let (headers, _) = hook.requests().pop().unwrap();
    assert_eq!(headers["authorization"], "Bearer sk_live_mine");
    // Sent again, they go to the new host.
    let again = json!({"Authorization": "Bearer sk_live_theirs"});
    let p = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(patch(&other.url, Some(again))),
            &[],
        )
        .await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.text);
    let (headers, _) = other.requests().pop().unwrap();
    assert_eq!(headers["authorization"], "Bearer sk_live_theirs");
}

/// The control topic took the write but this instance's table has not shown it back in time:
/// the subscription exists, so its secret is answered (a 503 lost it, and a client retrying the
/// create made a second subscription).
#[tokio::test]
async fn a_write_not_yet_seen_back_still_answers_the_new_secret() {
    let lagging = Harness::lagging();
    let token = lagging.token("acme");
    let hook = Hook::start(true).await;
    let a = lagging
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.text);
    assert!(
        a.body["signing_secret"]
            .as_str()
            .unwrap()
            .starts_with("whsec_")
    );
    assert_eq!(a.body["verification"]["error_code"], "not_yet_visible");
    assert!(hook.received.0.lock().unwrap().is_empty(), "no probe yet");
    // This instance reads it from now on (a GET, a PATCH, a retry of the create's caller).
    let id = a.body["id"].as_str().unwrap();
    let got = lagging
        .get(&format!("/v1/subscriptions/{id}"), &token)
        .await;
    assert_eq!(got.status, StatusCode::OK, "{}", got.text);
    // Rotation: the subscription is in the table, the new version is not seen back.
    let h = Harness::new();
    let created = h
        .post(
            "/v1/subscriptions",
            &h.token("acme"),
            webhook_body(&hook.url),
        )
        .await;
    let id = created.body["id"].as_str().unwrap().to_string();
    let rec = (*h.state.subs.get(&id).unwrap()).clone();
    lagging.state.subs.table().apply(|t| t.upsert(rec));
    let uri = format!("/v1/subscriptions/{id}/rotate-secret");
    let r = lagging.post(&uri, &token, json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        r.body["signing_secret"]
            .as_str()
            .unwrap()
            .starts_with("whsec_")
    );
}

#[tokio::test]
async fn a_url_query_is_sealed_shown_redacted_and_a_url_sent_back_as_shown_keeps_it() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let query = "code=fn_key_topsecret&clientId=default";
    let shown = format!("{}?code=***&clientId=***", hook.url);
    let last_query = || hook.queries.lock().unwrap().last().cloned().flatten();
    let a = h
        .post(
            "/v1/subscriptions",
            &token,
            webhook_body(&format!("{}?{query}", hook.url)),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["verification_state"], "active", "{}", a.text);
    assert_eq!(
        last_query().as_deref(),
        Some(query),
        "the probe goes to the URL as given"
    );
    let id = a.body["id"].as_str().unwrap().to_string();
    let uri = format!("/v1/subscriptions/{id}");
    let got = h.get(&uri, &token).await;
    assert_eq!(got.body["destination"]["url"], shown.as_str());
    for text in [&a.text, &got.text] {
        assert!(!text.contains("fn_key_topsecret"), "{text}");
    }
    let stored = h.state.subs.get(&id).unwrap();
    assert!(stored.destination.sealed_target.is_some());
    assert!(!format!("{stored:?}").contains("fn_key_topsecret"));
    let bytes = crate::runtime::avro::Codec::new()
        .unwrap()
        .encode(RecordKind::Subscription, &*stored)
        .unwrap();
    assert!(!contains(&bytes, "fn_key_topsecret"));

    // Sent back as shown (a read-modify-write): the stored URL stays, nothing is probed again.
    let probes = hook.requests().len();
    let patch = |url: String| {
        let body = json!({"destination": {"type": "webhook", "url": url}});
        h.call(Method::PATCH, &uri, Some(&token), Some(body), &[])
    };
    let p = patch(shown.clone()).await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.text);
    assert_eq!(p.body["verification_state"], "active", "{}", p.text);
    assert_eq!(
        h.state.subs.get(&id).unwrap().destination,
        stored.destination
    );
    assert_eq!(hook.requests().len(), probes);
    // Edited from the shown URL, it is refused: the mark would be sent.
    let p = patch(format!("{}?code=***&clientId=other", hook.url)).await;
    assert_eq!(
        (
            p.status,
            &p.body["error"]["code"],
            &p.body["error"]["field"]
        ),
        (
            StatusCode::BAD_REQUEST,
            &json!("redacted"),
            &json!("destination.url")
        ),
        "{}",
        p.text
    );
    // So is the URL as given.
    let p = patch(format!("{}?{query}", hook.url)).await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.text);
    assert_eq!(
        h.state.subs.get(&id).unwrap().destination,
        stored.destination
    );
    assert_eq!(hook.requests().len(), probes);
    // A verification probe opens it.
    let v = h
        .call(
            Method::POST,
            &format!("{uri}/verify"),
            Some(&token),
            None,
            &[],
        )
        .await;
    assert_eq!(v.status, StatusCode::OK, "{}", v.text);
    assert_eq!(hook.requests().len(), probes + 1);
    assert_eq!(last_query().as_deref(), Some(query));

    // A new value is a new URL: sealed again and probed there, shown the same.
    let rotated = "code=rotated_key&clientId=default";
    let p = patch(format!("{}?{rotated}", hook.url)).await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.text);
    assert_eq!(p.body["destination"]["url"], shown.as_str());
    assert_eq!(last_query().as_deref(), Some(rotated));
    let now = h.state.subs.get(&id).unwrap();
    assert_ne!(
        now.destination.sealed_target,
        stored.destination.sealed_target
    );
    assert!(!p.text.contains("rotated_key"), "{}", p.text);
}

/// A webhook whose sealed URL no longer opens here (sealed for another record, or under a key
/// removed before reseal) and which has sensitive headers: a PATCH with a new URL alone is
/// `422 sealed_headers` naming the headers (bound to the URL that does not open), not the
/// `sealed_url` that asks for the URL just sent; with both, it is mended.
#[tokio::test]
async fn mending_a_sealed_url_that_does_not_open_asks_for_the_sensitive_headers_it_binds() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let mut body = webhook_body(&format!("{}?code=fn_key_topsecret", hook.url));
    body["destination"]["sensitive_headers"] = json!({"Authorization": "Bearer sk_live_mine"});
    let a = h.post("/v1/subscriptions", &token, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let id = a.body["id"].as_str().unwrap().to_string();
    let uri = format!("/v1/subscriptions/{id}");
    // Its sealed target replaced by one sealed for another subscription: it does not open.
    let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
    let other = crate::subscriptions::sealed_url::seal(
        &h.state.kek,
        &uuid::Uuid::now_v7().to_string(),
        &format!("{}?code=elsewhere", hook.url),
    );
    rec.destination.sealed_target = other.sealed_target;
    rec.version += 1;
    h.state.subs.table().apply(|t| t.upsert(rec));
    let v = h
        .call(
            Method::POST,
            &format!("{uri}/verify"),
            Some(&token),
            None,
            &[],
        )
        .await;
    assert_eq!(v.body["error"]["code"], "sealed_url", "{}", v.text);

    let mended = format!("{}?code=new_key", hook.url);
    let p = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"destination": {"type": "webhook", "url": mended}})),
            &[],
        )
        .await;
    assert_eq!(
        (
            p.status,
            &p.body["error"]["code"],
            &p.body["error"]["field"]
        ),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            &json!("sealed_headers"),
            &json!("destination.sensitive_headers")
        ),
        "{}",
        p.text
    );
    let p = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"destination": {"type": "webhook", "url": mended,
                "sensitive_headers": {"Authorization": "Bearer sk_live_mine"}}})),
            &[],
        )
        .await;
    assert_eq!(p.status, StatusCode::OK, "{}", p.text);
    assert_eq!(p.body["verification_state"], "active", "{}", p.text);
}
