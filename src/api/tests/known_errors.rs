//! Failure modes `scripts/api-fuzz.sh` (schemathesis against `/openapi.json`) found, or that its
//! findings led to, each as a named test: no `500` for bad input, and every error a JSON
//! [`ErrorBody`](crate::api::errors::ErrorBody) naming the field at fault, whichever layer
//! refuses the request.
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{Harness, pull_body};
use crate::api::router;

/// Sends a raw request (any body bytes and content type); answers status, content type and the
/// body as JSON (`Null` when it is not JSON).
async fn raw(
    h: &Harness,
    method: Method,
    uri: &str,
    token: &str,
    body: Vec<u8>,
) -> (StatusCode, String, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let response = router(h.state.clone()).oneshot(req).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, content_type, body)
}

#[tokio::test]
async fn schema_major_beyond_an_avro_int_is_400_naming_it_not_500() {
    // Found: {"schema_major": 2147483648} passed validation, then failed to encode for the
    // control topic (Avro `int`): 500.
    let h = Harness::new();
    let token = h.token("acme");
    let mut body = pull_body();
    body["schema_major"] = json!(2_147_483_648u64);
    let a = h.post("/v1/subscriptions", &token, body.clone()).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text);
    assert_eq!(a.body["error"]["field"], "schema_major");
    assert!(h.state.subs.list("acme").is_empty(), "nothing written");

    body["schema_major"] = json!(2_147_483_647u64);
    let a = h.post("/v1/subscriptions", &token, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let id = a.body["id"].as_str().unwrap();
    let a = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&token),
            Some(json!({"schema_major": 4_294_967_295u64})),
            &[],
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text);
    assert_eq!(a.body["error"]["field"], "schema_major");
    assert_eq!(h.state.subs.get(id).unwrap().version, 1);
}

#[tokio::test]
async fn json_array_body_is_refused_not_read_by_position() {
    // Found: serde fills a struct from an array, so `[null, null, ["a.b"], null, {"type":
    // "pull"}]` created a subscription, and `[null, null]` errors named no field.
    let h = Harness::new();
    let token = h.token("acme");
    let array = json!([null, null, ["a.b"], null, {"type": "pull"}]).to_string();
    let (status, content_type, body) = raw(
        &h,
        Method::POST,
        "/v1/subscriptions",
        &token,
        array.into_bytes(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(content_type, "application/json");
    assert_eq!(body["error"]["code"], "invalid_body");
    assert!(h.state.subs.list("acme").is_empty(), "nothing written");
    for other in ["null", "0", "\"AAA\"", "false"] {
        let (status, _, body) =
            raw(&h, Method::POST, "/v1/subscriptions", &token, other.into()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{other}");
        assert_eq!(body["error"]["code"], "invalid_body", "{other}");
    }
}

#[tokio::test]
async fn undecodable_path_parameter_is_a_json_400_naming_it() {
    // axum's own rejection was `400 text/plain`, which the document does not describe.
    let h = Harness::new();
    let token = h.token("acme");
    for (method, uri) in [
        (Method::GET, "/v1/subscriptions/%FF"),
        (Method::DELETE, "/v1/subscriptions/%FF"),
        (Method::POST, "/v1/subscriptions/%FF/verify"),
    ] {
        let (status, content_type, body) = raw(&h, method, uri, &token, Vec::new()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(content_type, "application/json", "{uri}");
        assert_eq!(body["error"]["field"], "id", "{uri}");
    }
}

#[tokio::test]
async fn repeated_query_parameter_is_a_json_400_naming_it() {
    // axum's own rejection was `400 text/plain` ("Failed to deserialize query string").
    let h = Harness::new();
    let (status, content_type, body) = raw(
        &h,
        Method::GET,
        "/v1/subscriptions?limit=1&limit=2",
        &h.token("acme"),
        Vec::new(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(content_type, "application/json");
    assert_eq!(body["error"]["field"], "limit");
}

#[tokio::test]
async fn oversized_rotate_body_is_a_json_413() {
    // rotate-secret read its optional body with axum's `Bytes`: `413 text/plain` over 64 KiB.
    let h = Harness::new();
    let big = format!(
        r#"{{"grace":"{}"}}"#,
        "1".repeat(super::super::MAX_BODY_BYTES)
    );
    let (status, content_type, body) = raw(
        &h,
        Method::POST,
        "/v1/subscriptions/0190a000-0000-7000-8000-000000000000/rotate-secret",
        &h.token("acme"),
        big.into_bytes(),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(content_type, "application/json");
    assert_eq!(body["error"]["code"], "invalid_body");
}

/// A path no route has and a method a route does not take answer the JSON error format too
/// (they were empty 404 and 405 answers).
#[tokio::test]
async fn an_unknown_route_or_method_is_a_json_error() {
    let h = Harness::new();
    let token = h.token("acme");
    let (status, content_type, body) =
        raw(&h, Method::GET, "/v1/nothing-here", &token, Vec::new()).await;
    assert_eq!(
        (
            status,
            content_type.as_str(),
            body["error"]["code"].as_str()
        ),
        (StatusCode::NOT_FOUND, "application/json", Some("not_found"))
    );
    let (status, _, body) = raw(&h, Method::PUT, "/v1/subscriptions", &token, Vec::new()).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed"))
    );
}

/// Without a KEK the process's fallback says the API is off for its paths only.
#[tokio::test]
async fn without_the_api_its_paths_say_so_and_others_are_not_found() {
    use axum::response::IntoResponse;
    for (path, code) in [
        ("/v1/subscriptions", "api_off"),
        ("/admin/dlq", "api_off"),
        ("/openapi.json", "api_off"),
        ("/metricsx", "not_found"),
    ] {
        let answer = crate::api::api_off(path.parse().unwrap())
            .await
            .into_response();
        assert_eq!(answer.status(), StatusCode::NOT_FOUND);
        let bytes = answer.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["error"]["code"], code, "{path}");
    }
}
