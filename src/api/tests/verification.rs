//! The verification handshake against real local HTTP endpoints: on create, on URL change and on
//! `/verify`, including the recovery of an auto-disabled subscription.
use axum::http::{Method, StatusCode};
use serde_json::json;

use super::{Harness, Hook, START_MS, webhook_body};
use crate::delivery::signing::sign;
use crate::runtime::records::VerificationState;
use crate::runtime::secret::Secret;

#[tokio::test]
async fn webhook_that_echoes_the_challenge_is_active_when_create_returns() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let a = h
        .post(
            "/v1/subscriptions",
            &h.token("acme"),
            webhook_body(&hook.url),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["verification_state"], "active");
    assert_eq!(a.body["verification"], json!({"state": "active"}));
    assert_eq!(a.body["version"], 2, "written pending (1), then active (2)");
    let id = a.body["id"].as_str().unwrap();
    assert_eq!(
        h.state.subs.get(id).unwrap().verification_state,
        VerificationState::Active
    );

    let requests = hook.requests();
    assert_eq!(requests.len(), 1, "one probe");
    let (headers, body) = &requests[0];
    let probe: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(probe["type"], "streaming_hub.verification");
    assert_eq!(headers["x-lerian-event-type"], "streaming_hub.verification");
    // Signed with the secret the create response showed.
    let secret = Secret::new(a.body["signing_secret"].as_str().unwrap());
    let (msg_id, ts) = (
        headers["webhook-id"].to_str().unwrap(),
        headers["webhook-timestamp"].to_str().unwrap(),
    );
    let expected = sign(&secret, msg_id, ts.parse().unwrap(), body.as_bytes()).unwrap();
    assert_eq!(headers["webhook-signature"].to_str().unwrap(), expected);
}

#[tokio::test]
async fn webhook_that_does_not_echo_the_challenge_stays_pending_and_the_answer_says_why() {
    let h = Harness::new();
    let hook = Hook::start(false).await;
    let a = h
        .post(
            "/v1/subscriptions",
            &h.token("acme"),
            webhook_body(&hook.url),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["verification_state"], "pending");
    assert_eq!(a.body["verification"]["state"], "pending");
    assert_eq!(a.body["verification"]["error_code"], "challenge_missing");
    assert_eq!(a.body["version"], 1);
    assert!(
        a.body["signing_secret"]
            .as_str()
            .unwrap()
            .starts_with("whsec_"),
        "the secret is still shown once"
    );
    assert_eq!(hook.requests().len(), 1);
}

#[tokio::test]
async fn unreachable_webhook_stays_pending_with_connect_failed() {
    let h = Harness::new();
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", closed.local_addr().unwrap());
    drop(closed);
    let a = h
        .post("/v1/subscriptions", &h.token("acme"), webhook_body(&url))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(
        (
            a.body["verification"]["state"].as_str(),
            a.body["verification"]["error_code"].as_str()
        ),
        (Some("pending"), Some("connect_failed"))
    );
}

#[tokio::test]
async fn verify_failure_is_422_with_the_probe_code_and_marks_the_subscription_failed() {
    let h = Harness::new();
    let hook = Hook::start(false).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    let a = h
        .call(
            Method::POST,
            &format!("/v1/subscriptions/{id}/verify"),
            Some(&token),
            None,
            &[],
        )
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.body["error"]["code"], "challenge_missing");
    assert_eq!(a.body["error"]["field"], "destination.url");
    let stored = h.state.subs.get(&id).unwrap();
    assert_eq!(
        (stored.verification_state, stored.version),
        (VerificationState::Failed, 2)
    );
    assert_eq!(hook.requests().len(), 2, "create probe, verify probe");
}

#[tokio::test]
async fn verify_success_reactivates_and_reenables_an_auto_disabled_subscription() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    // What auto-disable writes: enabled = false with a reason, verification untouched.
    let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
    (
        rec.enabled,
        rec.disabled_reason,
        rec.disabled_at,
        rec.version,
    ) = (false, Some("failing for 120h".into()), Some(START_MS), 3);
    h.state.subs.put(rec).await.unwrap();

    hook.echo.store(false, std::sync::atomic::Ordering::SeqCst);
    let uri = format!("/v1/subscriptions/{id}/verify");
    let failed = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(failed.status, StatusCode::UNPROCESSABLE_ENTITY);
    let stored = h.state.subs.get(&id).unwrap();
    assert!(!stored.enabled, "a failed probe does not re-enable");
    assert_eq!(
        (stored.verification_state, stored.version),
        (VerificationState::Active, 3),
        "verified before: a failed re-probe writes nothing"
    );

    hook.echo.store(true, std::sync::atomic::Ordering::SeqCst);
    let a = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.body["verification"]["state"], "active");
    assert_eq!(
        (
            a.body["enabled"].as_bool(),
            a.body["verification_state"].as_str()
        ),
        (Some(true), Some("active"))
    );
    assert_eq!(
        (
            a.body["disabled_reason"].clone(),
            a.body["disabled_at"].clone()
        ),
        (json!(null), json!(null))
    );
    let stored = h.state.subs.get(&id).unwrap();
    assert!(stored.enabled && stored.disabled_reason.is_none() && stored.disabled_at.is_none());
    assert_eq!(stored.verification_state, VerificationState::Active);
}

/// A destination already verified that fails a re-probe (an endpoint mid-deploy) keeps
/// `active`: its events go on matching and its deliveries go on (retried, dead-lettered,
/// auto-disabled on their own evidence). Demoted, its events would match nothing, with no dead
/// letter.
#[tokio::test]
async fn a_failed_reprobe_of_an_active_subscription_answers_422_and_keeps_it_active() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    assert_eq!(
        h.state.subs.get(&id).unwrap().verification_state,
        VerificationState::Active
    );
    hook.echo.store(false, std::sync::atomic::Ordering::SeqCst);
    let uri = format!("/v1/subscriptions/{id}/verify");
    let a = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(a.body["error"]["code"], "challenge_missing");
    let stored = h.state.subs.get(&id).unwrap();
    assert_eq!(
        (stored.verification_state, stored.enabled, stored.version),
        (VerificationState::Active, true, 2)
    );
    assert_eq!(hook.requests().len(), 2, "create probe, verify probe");
}

/// A new URL for an `active` webhook is probed before anything is written: a failing one is a
/// `422` that leaves the subscription as it was (its old URL still matched, so no event is lost
/// to a `pending` gap), a passing one is written `active` in one record.
#[tokio::test]
async fn a_new_url_of_an_active_webhook_is_written_only_once_its_probe_passed() {
    let h = Harness::new();
    let good = Hook::start(true).await;
    let silent = Hook::start(false).await;
    let other = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &good.url).await;
    let before = h.state.subs.get(&id).unwrap();
    assert_eq!(before.verification_state, VerificationState::Active);
    let uri = format!("/v1/subscriptions/{id}");
    let to_silent = json!({"destination": {"type": "webhook", "url": silent.url}});
    let a = h
        .call(Method::PATCH, &uri, Some(&token), Some(to_silent), &[])
        .await;
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", a.text);
    assert_eq!(
        (
            a.body["error"]["code"].as_str(),
            a.body["error"]["field"].as_str()
        ),
        (Some("challenge_missing"), Some("destination.url"))
    );
    assert_eq!(silent.requests().len(), 1, "the new URL was probed");
    assert_eq!(
        h.state.subs.get(&id).unwrap(),
        before,
        "nothing written: still active at its old URL"
    );
    let to_other = json!({"destination": {"type": "webhook", "url": other.url}});
    let a = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(to_other),
            &[("if-match", &format!("\"{}\"", before.version))],
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(
        (
            a.body["verification_state"].as_str(),
            a.body["verification"]["state"].as_str(),
            a.body["destination"]["url"].as_str(),
            a.body["version"].as_u64()
        ),
        (
            Some("active"),
            Some("active"),
            Some(other.url.as_str()),
            Some(before.version + 1)
        ),
        "one record, written active"
    );
    assert_eq!(other.requests().len(), 1, "probed once, before the write");
    let same = json!({"destination": {"type": "webhook", "url": other.url}});
    let a = h
        .call(Method::PATCH, &uri, Some(&token), Some(same), &[])
        .await;
    assert!(
        a.body.get("verification").is_none(),
        "an unchanged URL is not probed again"
    );
    assert_eq!(other.requests().len(), 1);
    assert_eq!(good.requests().len(), 1, "the create's probe only");
}

/// A new URL for a webhook not yet verified is written `pending` and probed then, as on create:
/// it received nothing before, so nothing is lost, and the receiver may come up later.
#[tokio::test]
async fn a_new_url_of_a_pending_webhook_is_written_pending_then_probed() {
    let h = Harness::new();
    let silent = Hook::start(false).await;
    let good = Hook::start(true).await;
    let token = h.token("acme");
    let a = h
        .post("/v1/subscriptions", &token, webhook_body(&silent.url))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["verification_state"], "pending");
    let id = a.body["id"].as_str().unwrap();
    let uri = format!("/v1/subscriptions/{id}");
    let to_silent_again =
        json!({"destination": {"type": "webhook", "url": format!("{}?v=2", silent.url)}});
    let a = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(to_silent_again),
            &[],
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.body["verification_state"], "pending");
    assert_eq!(a.body["verification"]["error_code"], "challenge_missing");
    let to_good = json!({"destination": {"type": "webhook", "url": good.url}});
    let a = h
        .call(Method::PATCH, &uri, Some(&token), Some(to_good), &[])
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(
        (
            a.body["verification_state"].as_str(),
            a.body["version"].as_u64()
        ),
        (Some("active"), Some(4)),
        "written pending (3), then its verdict (4)"
    );
}

/// Another write while a new URL's probe runs: it is not held up by the probe, and the change
/// is not written over it (`409 changed_meanwhile`).
#[tokio::test]
async fn a_write_made_while_a_new_url_was_probed_is_not_written_over() {
    use std::sync::Arc;
    use tokio::sync::Notify;
    let h = Harness::new();
    let good = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &good.url).await;
    // A receiver that answers the challenge once the gate opens.
    let (probed, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (p, g) = (probed.clone(), gate.clone());
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: String| async move {
            p.notify_one();
            g.notified().await;
            body
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow_url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let uri = format!("/v1/subscriptions/{id}");
    let moving = h.call(
        Method::PATCH,
        &uri,
        Some(&token),
        Some(json!({"destination": {"type": "webhook", "url": slow_url}})),
        &[],
    );
    let meanwhile = async {
        probed.notified().await;
        let a = h
            .call(
                Method::PATCH,
                &uri,
                Some(&token),
                Some(json!({"event_types": ["account.*"]})),
                &[],
            )
            .await;
        gate.notify_one();
        a
    };
    let (moved, other) = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        tokio::join!(moving, meanwhile)
    })
    .await
    .expect("the other write waited for the probe");
    assert_eq!(other.status, StatusCode::OK, "{}", other.text);
    assert_eq!(moved.status, StatusCode::CONFLICT, "{}", moved.text);
    assert_eq!(moved.body["error"]["code"], "changed_meanwhile");
    let now = h.state.subs.get(&id).unwrap();
    assert_eq!(
        (now.event_types.clone(), now.destination.url.clone()),
        (vec!["account.*".to_string()], Some(good.url.clone())),
        "the other write stands, the URL is the old one"
    );
}

#[tokio::test]
async fn verify_of_a_pull_subscription_passes_without_a_probe() {
    let h = Harness::new();
    let id = h.create_pull("acme").await;
    let a = h
        .call(
            Method::POST,
            &format!("/v1/subscriptions/{id}/verify"),
            Some(&h.token("acme")),
            None,
            &[],
        )
        .await;
    assert_eq!(
        (a.status, a.body["verification"]["state"].as_str()),
        (StatusCode::OK, Some("active"))
    );
}

/// A URL change whose write is read back but whose verdict's write is not (the control reader
/// fell behind in between): the change and the verdict are both on the control topic and in
/// this instance's table, so the PATCH is answered with the verdict, not a 503 that would make
/// the caller retry into its own `If-Match`.
#[tokio::test]
async fn a_verdict_written_but_not_seen_back_is_answered_not_503() {
    // Versions 1-2 (the create, left pending, and the PATCH of its URL) are read back; the
    // PATCH's verdict is not.
    let subs = crate::subscriptions::control::Subscriptions::scripted(
        std::sync::Arc::new(crate::runtime::avro::Codec::new().unwrap()),
        |table, _, rec| {
            let rec = rec.expect("no deletion here");
            let at = rec.version as i64;
            if rec.version <= 2 {
                let rec = rec.clone();
                table.apply(|t| {
                    t.upsert(rec);
                    t.note_read(0, at);
                });
            }
            Some((0, at))
        },
    );
    let h = Harness::with_subs(true, subs);
    let (first, second) = (Hook::start(false).await, Hook::start(true).await);
    let t = h.token("acme");
    let a = h
        .post("/v1/subscriptions", &t, webhook_body(&first.url))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(
        (
            a.body["version"].as_u64(),
            a.body["verification_state"].as_str()
        ),
        (Some(1), Some("pending"))
    );
    let id = a.body["id"].as_str().unwrap();
    let patched = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&t),
            Some(json!({"destination": {"type": "webhook", "url": second.url}})),
            &[("if-match", "\"1\"")],
        )
        .await;
    assert_eq!(patched.status, StatusCode::OK, "{}", patched.text);
    assert_eq!(patched.body["verification"], json!({"state": "active"}));
    assert_eq!(patched.headers["etag"], "\"3\"", "{}", patched.text);
    assert_eq!(
        h.state.subs.get(id).unwrap().version,
        3,
        "this instance has it"
    );
}

/// A secret sealed under a key of another instance, further along a rolling key rotation.
fn sealed_elsewhere(id: &str) -> crate::runtime::records::EncryptedSecret {
    use base64::Engine;
    let key = base64::engine::general_purpose::STANDARD.encode([9u8; 32]);
    crate::subscriptions::secrets::Kek::new("k-next", &key)
        .unwrap()
        .seal_secret(
            &crate::subscriptions::secrets::generate_signing_secret(),
            id,
            None,
        )
}

/// Mid rolling key rotation: probes sign with the live secrets that open here, as deliveries do
/// (a secret this instance cannot open answered 500 before); none opening is a typed 503; and a
/// URL change written is answered 200 whatever becomes of its probe.
#[tokio::test]
async fn probes_sign_with_the_secrets_that_open_and_a_write_is_answered_whatever_its_probe() {
    let h = Harness::new();
    let (hook, other) = (Hook::start(true).await, Hook::start(true).await);
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    // A rotation made by an instance with a key this one lacks: its secret first.
    let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
    rec.signing_secrets.insert(0, sealed_elsewhere(&id));
    rec.version += 1;
    h.state.subs.put(rec.clone()).await.unwrap();
    let uri = format!("/v1/subscriptions/{id}/verify");
    let a = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let sigs = hook.requests().last().unwrap().0["webhook-signature"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(sigs.split(' ').count(), 1, "signed with the one that opens");
    // None opens here.
    rec.signing_secrets = vec![sealed_elsewhere(&id)];
    rec.version = h.state.subs.get(&id).unwrap().version + 1;
    h.state.subs.put(rec).await.unwrap();
    let before = hook.requests().len();
    let a = h.call(Method::POST, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text);
    assert_eq!(a.body["error"]["code"], "signing_secret_unavailable");
    assert_eq!(hook.requests().len(), before, "nothing sent unsigned");
    // A new URL for this active subscription is probed before it is written: a probe that
    // cannot sign here writes nothing.
    let version = h.state.subs.get(&id).unwrap().version;
    let refused = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&token),
            Some(json!({"destination": {"type": "webhook", "url": other.url}})),
            &[("if-match", &format!("\"{version}\""))],
        )
        .await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.text
    );
    assert_eq!(refused.body["error"]["code"], "signing_secret_unavailable");
    assert_eq!(h.state.subs.get(&id).unwrap().version, version);
    assert!(other.requests().is_empty(), "nothing sent unsigned");
    // Not verified yet: the URL change is written, and its probe cannot sign here: 200 with the
    // change, not a 5xx that would invite a retry its own If-Match refuses.
    let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
    rec.verification_state = VerificationState::Pending;
    rec.version += 1;
    h.state.subs.put(rec).await.unwrap();
    let version = h.state.subs.get(&id).unwrap().version;
    let patched = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&token),
            Some(json!({"destination": {"type": "webhook", "url": other.url}})),
            &[("if-match", &format!("\"{version}\""))],
        )
        .await;
    assert_eq!(patched.status, StatusCode::OK, "{}", patched.text);
    assert_eq!(patched.body["destination"]["url"], json!(other.url));
    assert_eq!(patched.body["verification_state"], "pending");
    assert_eq!(h.state.subs.get(&id).unwrap().version, version + 1);
}

/// A verify whose probe ran while a `PATCH {"enabled": false}` was answered does not undo it.
#[tokio::test]
async fn a_verify_does_not_re_enable_what_was_disabled_while_its_probe_ran() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    // The record the verify started from, then the PATCH written while its probe ran.
    let started = (*h.state.subs.get(&id).unwrap()).clone();
    assert!(started.enabled);
    let mut disabled = started.clone();
    (disabled.enabled, disabled.version) = (false, started.version + 1);
    h.state.subs.put(disabled).await.unwrap();
    let (rec, _) = super::super::verification::probe_and_record(
        &h.state,
        started,
        super::super::verification::Probe::Requested,
    )
    .await
    .unwrap();
    assert!(!rec.enabled, "the PATCH's disable kept");
    assert!(!h.state.subs.get(&id).unwrap().enabled);
    assert_eq!(rec.verification_state, VerificationState::Active);
}
