//! What one tenant may take of an instance: its subscription writes per second, and the
//! verification probes it runs at once.
use axum::http::{Method, StatusCode};

use super::{Harness, Hook, pull_body, webhook_body};
use crate::api::verification::{MAX_TENANT_PROBES, Probe, probe_and_record};

#[tokio::test]
async fn a_tenant_past_its_write_burst_is_429_with_retry_after_and_others_are_not() {
    let h = Harness::with_settings(&[
        ("STREAMING_HUB_API_WRITE_RATE", "1"),
        ("STREAMING_HUB_API_WRITE_BURST", "2"),
    ]);
    let acme = h.token("acme");
    for _ in 0..2 {
        let a = h.post("/v1/subscriptions", &acme, pull_body()).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    }
    let refused = h.post("/v1/subscriptions", &acme, pull_body()).await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        refused.text
    );
    assert_eq!(refused.body["error"]["code"], "rate_limited");
    assert_eq!(refused.headers["retry-after"], "1");
    // Every write route counts: a DELETE is refused too, and nothing was deleted.
    let id = h.create_pull("globex").await;
    let other = h.token("globex");
    let a = h.post("/v1/subscriptions", &other, pull_body()).await;
    assert_eq!(
        a.status,
        StatusCode::CREATED,
        "another tenant has its own burst"
    );
    let a = h.post("/v1/subscriptions", &other, pull_body()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.text);
    let a = h
        .call(
            Method::DELETE,
            &format!("/v1/subscriptions/{id}"),
            Some(&other),
            None,
            &[],
        )
        .await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.text);
    assert!(h.state.subs.get(&id).is_some());
    // Reads are not writes.
    let a = h.get("/v1/subscriptions", &acme).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    // An admin acting for the tenant is not held to it.
    let admin = h.admin_token_with_tenant("acme");
    let a = h.post("/v1/subscriptions", &admin, pull_body()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
}

/// A recover queues every dead letter of its window again, each time it is asked: one of the
/// tenant's writes (it was not, and nothing but the one-at-a-time gate bounded a loop of them).
#[tokio::test]
async fn a_recover_is_one_of_the_tenants_writes() {
    let h = Harness::with_settings(&[
        ("STREAMING_HUB_API_WRITE_RATE", "1"),
        ("STREAMING_HUB_API_WRITE_BURST", "1"),
    ]);
    let hook = Hook::start(true).await;
    // An admin's create is not held to the rate: the tenant's one write is left.
    let id = h
        .create_webhook(&h.admin_token_with_tenant("acme"), &hook.url)
        .await;
    let acme = h.token("acme");
    let uri = format!("/v1/subscriptions/{id}/recover");
    let since = serde_json::json!({"since": "2026-01-01T00:00:00Z"});
    // This harness runs no operations (503): nothing ran, and the write is given back.
    let a = h.post(&uri, &acme, since.clone()).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text);
    let a = h.post("/v1/subscriptions", &acme, pull_body()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    // That create spent it: the recover is refused before it would run.
    let a = h.post(&uri, &acme, since).await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("rate_limited")),
        "{}",
        a.text
    );
}

#[tokio::test]
async fn probes_past_the_tenants_share_are_refused_or_deferred_not_run() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let token = h.token("acme");
    let id = h.create_webhook(&token, &hook.url).await;
    assert_eq!(hook.requests().len(), 1);
    // The tenant's probes all in use (four slow receivers, say).
    let held: Vec<_> = (0..MAX_TENANT_PROBES)
        .map(|_| h.state.probes.enter("acme").expect("a place"))
        .collect();
    let verify = format!("/v1/subscriptions/{id}/verify");
    let a = h.call(Method::POST, &verify, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.text);
    assert_eq!(a.body["error"]["code"], "probe_busy");
    assert!(a.headers.contains_key("retry-after"));
    // A create is written and answered, its probe left to the background retrier.
    let a = h
        .post("/v1/subscriptions", &token, webhook_body(&hook.url))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["verification_state"], "pending");
    assert_eq!(a.body["verification"]["error_code"], "probe_deferred");
    assert_eq!(hook.requests().len(), 1, "no probe sent past the bound");
    // Another tenant's probes still run.
    let other = h.token("globex");
    let a = h
        .post("/v1/subscriptions", &other, webhook_body(&hook.url))
        .await;
    assert_eq!(a.body["verification_state"], "active", "{}", a.text);
    assert_eq!(hook.requests().len(), 2);
    // Places given back: the tenant's verify runs again.
    drop(held);
    let a = h.call(Method::POST, &verify, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(hook.requests().len(), 3);
}

/// A `/verify` refused for want of a probe place costs no write: retrying it as `Retry-After`
/// says does not use up the tenant's rate for its creates and PATCHes.
#[tokio::test]
async fn a_verify_refused_as_probe_busy_costs_no_write() {
    let h = Harness::with_settings(&[
        ("STREAMING_HUB_API_WRITE_RATE", "1"),
        ("STREAMING_HUB_API_WRITE_BURST", "1"),
    ]);
    let hook = Hook::start(true).await;
    let admin = h.admin_token_with_tenant("acme");
    let id = h.create_webhook(&admin, &hook.url).await;
    let token = h.token("acme");
    let verify = format!("/v1/subscriptions/{id}/verify");
    let held: Vec<_> = (0..MAX_TENANT_PROBES)
        .map(|_| h.state.probes.enter("acme").expect("a place"))
        .collect();
    for _ in 0..3 {
        let a = h.call(Method::POST, &verify, Some(&token), None, &[]).await;
        assert_eq!(a.body["error"]["code"], "probe_busy", "{}", a.text);
    }
    drop(held);
    let a = h.call(Method::POST, &verify, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
}

#[tokio::test]
async fn a_verdict_is_not_written_onto_an_id_now_anothers() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let id = h.create_webhook(&h.token("acme"), &hook.url).await;
    let started = (*h.state.subs.get(&id).unwrap()).clone();
    // While the probe ran, the id was written again for another tenant (a stale `apply` file),
    // same destination, disabled.
    let mut theirs = started.clone();
    theirs.tenant_id = "globex".into();
    theirs.enabled = false;
    theirs.version = started.version + 1;
    h.state.subs.put(theirs.clone()).await.unwrap();
    let (rec, _) = probe_and_record(&h.state, started.clone(), Probe::Requested)
        .await
        .unwrap();
    assert_eq!(rec.tenant_id, "acme", "the caller's own record answered");
    assert_eq!(*h.state.subs.get(&id).unwrap(), theirs, "theirs untouched");
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let h = Harness::new();
    let token = h.token("acme");
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} {token}");
        let a = h
            .call(
                Method::GET,
                "/v1/subscriptions",
                None,
                None,
                &[("authorization", &auth)],
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{scheme}: {}", a.text);
    }
    let a = h
        .call(
            Method::GET,
            "/v1/subscriptions",
            None,
            None,
            &[("authorization", &format!("Basic {token}"))],
        )
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
}
