//! Authentication (401 for every kind of bad token) and tenant isolation (404 across tenants).
use std::time::Duration;

use axum::http::{Method, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::json;

use super::{Harness, Hook, JWT_SECRET, START_MS, pull_body};
use crate::api::auth::mint_at;
use crate::runtime::secret::Secret;

async fn status_with(h: &Harness, authorization: Option<&str>) -> (StatusCode, serde_json::Value) {
    let headers: Vec<(&str, &str)> = authorization
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let a = h
        .call(Method::GET, "/v1/subscriptions", None, None, &headers)
        .await;
    (a.status, a.body)
}

#[tokio::test]
async fn request_without_a_token_is_401_on_every_endpoint() {
    let h = Harness::new();
    let id = h.create_pull("acme").await;
    let calls = [
        (Method::POST, "/v1/subscriptions".to_string()),
        (Method::GET, "/v1/subscriptions".to_string()),
        (Method::GET, format!("/v1/subscriptions/{id}")),
        (Method::PATCH, format!("/v1/subscriptions/{id}")),
        (Method::DELETE, format!("/v1/subscriptions/{id}")),
        (Method::POST, format!("/v1/subscriptions/{id}/verify")),
        (
            Method::POST,
            format!("/v1/subscriptions/{id}/rotate-secret"),
        ),
    ];
    for (method, uri) in calls {
        let a = h
            .call(method.clone(), &uri, None, Some(json!({})), &[])
            .await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{method} {uri}");
        assert_eq!(a.body["error"]["code"], "unauthorized");
        assert_eq!(a.headers["www-authenticate"], "Bearer");
    }
    assert!(h.state.subs.get(&id).is_some());
}

#[tokio::test]
async fn expired_token_is_401_token_expired() {
    let h = Harness::new();
    let token = mint_at(
        &Secret::new(JWT_SECRET),
        Some("acme"),
        false,
        Duration::from_secs(60),
        START_MS / 1000 - 61,
    );
    let (status, body) = status_with(&h, Some(&format!("Bearer {token}"))).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("token_expired"))
    );
    let fresh = h.token("acme");
    assert_eq!(
        status_with(&h, Some(&format!("Bearer {fresh}"))).await.0,
        StatusCode::OK
    );
    h.clock.advance(Duration::from_secs(3600));
    assert_eq!(
        status_with(&h, Some(&format!("Bearer {fresh}"))).await.0,
        StatusCode::UNAUTHORIZED,
        "expires on the injected clock"
    );
}

#[tokio::test]
async fn forged_tampered_unsigned_or_malformed_tokens_are_401() {
    let h = Harness::new();
    let forged = mint_at(
        &Secret::new("someone-elses-secret-0123456789ab"),
        Some("acme"),
        true,
        Duration::from_secs(60),
        START_MS / 1000,
    );
    let good = h.token("acme");
    let mut parts: Vec<&str> = good.split('.').collect();
    let escalated =
        URL_SAFE_NO_PAD.encode(br#"{"tenant_id":"other","admin":true,"exp":9999999999}"#);
    parts[1] = &escalated;
    let tampered = parts.join(".");
    let none_alg = format!(
        "{}.{}.",
        URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#),
        escalated
    );
    for bad in [
        format!("Bearer {forged}"),
        format!("Bearer {tampered}"),
        format!("Bearer {none_alg}"),
        "Bearer x.y.z".to_string(),
        format!("Basic {good}"),
        good.clone(),
    ] {
        let (status, body) = status_with(&h, Some(&bad)).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (StatusCode::UNAUTHORIZED, Some("unauthorized")),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn another_tenants_subscription_is_404_for_read_patch_delete_verify_and_rotate() {
    let h = Harness::new();
    let hook = Hook::start(true).await;
    let owner = h.token("acme");
    let id = h.create_webhook(&owner, &hook.url).await;
    let before = h.state.subs.get(&id).unwrap();
    let probes_before = hook.requests().len();
    let intruder = h.token("other");
    let uri = format!("/v1/subscriptions/{id}");
    let calls = [
        (Method::GET, uri.clone(), None),
        (Method::PATCH, uri.clone(), Some(json!({"enabled": false}))),
        (Method::DELETE, uri.clone(), None),
        (Method::POST, format!("{uri}/verify"), None),
        (
            Method::POST,
            format!("{uri}/rotate-secret"),
            Some(json!({"grace": "1h"})),
        ),
    ];
    let unknown = h
        .get(
            "/v1/subscriptions/0190a000-0000-7000-8000-000000000000",
            &intruder,
        )
        .await;
    for (method, uri, body) in calls {
        let a = h
            .call(method.clone(), &uri, Some(&intruder), body, &[])
            .await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{method} {uri}");
        assert_eq!(a.body, unknown.body, "indistinguishable from an unknown id");
    }
    assert_eq!(h.state.subs.get(&id).unwrap(), before, "nothing changed");
    assert_eq!(
        hook.requests().len(),
        probes_before,
        "no probe was sent for the intruder"
    );
    let listed = h.get("/v1/subscriptions", &intruder).await;
    assert_eq!(listed.body["data"], json!([]));
}

#[tokio::test]
async fn tenant_token_cannot_name_another_tenant() {
    let h = Harness::new();
    let token = h.token("acme");
    let mut body = pull_body();
    body["tenant_id"] = json!("other");
    let a = h.post("/v1/subscriptions", &token, body).await;
    assert_eq!(
        (a.status, a.body["error"]["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant_id"))
    );
    let a = h.get("/v1/subscriptions?tenant_id=other", &token).await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant_not_allowed"))
    );
    assert!(h.state.subs.list("other").is_empty());
}

/// Without the test clock, `/admin/clock/advance` is no route at all: the same `404` for any
/// caller and any body (it checked the token and the body first, which told that it existed).
#[tokio::test]
async fn the_clock_route_is_unknown_without_the_test_clock() {
    let h = Harness::new();
    for token in [h.token("acme"), h.admin_token()] {
        for body in [json!({"by": "1s"}), json!({})] {
            let a = h.post("/admin/clock/advance", &token, body.clone()).await;
            assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text);
            assert_eq!(a.body["error"]["code"], "not_found");
            assert_eq!(a.body["error"]["message"], "no such route");
        }
    }
}
