//! Every validation rule through the router: `400` with a stable code and the field at fault, and
//! nothing written.
use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::Harness;

fn webhook(url: &str, extra: Value) -> Value {
    let mut destination = json!({"type": "webhook", "url": url});
    for (k, v) in extra.as_object().unwrap() {
        destination[k] = v.clone();
    }
    json!({"event_types": ["a.b"], "destination": destination})
}

fn with(field: &str, value: Value) -> Value {
    let mut body = json!({"event_types": ["a.b"], "destination": {"type": "pull"}});
    body[field] = value;
    body
}

/// A public address literal: it passes the URL rules. Only tests that fail validation before any
/// request use it — tests never send traffic off this machine.
const PUBLIC_URL: &str = "https://93.184.215.14/hook";

#[tokio::test]
async fn each_create_validation_error_names_its_field() {
    let h = Harness::strict();
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            json!({"destination": {"type": "pull"}}),
            "event_types",
            "required",
        ),
        (with("event_types", json!([])), "event_types", "required"),
        (
            with("event_types", json!(vec!["a.b"; 101])),
            "event_types",
            "too_many",
        ),
        (
            with("event_types", json!(["a.b", "Transaction.Cre*ated"])),
            "event_types[1]",
            "invalid",
        ),
        (
            with("event_types", json!(["a.b.c"])),
            "event_types[0]",
            "invalid",
        ),
        (with("origin", json!("Ledger")), "origin", "invalid"),
        (with("schema_major", json!(-1)), "schema_major", "invalid"),
        (
            with("retry_schedule", json!(["5s", "11h"])),
            "retry_schedule[1]",
            "too_long",
        ),
        (
            with("retry_schedule", json!(["later"])),
            "retry_schedule[0]",
            "invalid",
        ),
        (
            with("retry_schedule", json!(vec!["1s"; 13])),
            "retry_schedule",
            "too_many",
        ),
        (with("enabled", json!("yes")), "enabled", "invalid"),
        (with("colour", json!("red")), "colour", "unknown_field"),
        (
            json!({"event_types": ["a.b"], "destination": {"type": "sms"}}),
            "destination.type",
            "invalid",
        ),
        (
            json!({"event_types": ["a.b"], "destination": {"type": "pull", "url": "x"}}),
            "destination.url",
            "unknown_field",
        ),
        (
            json!({"event_types": ["a.b"], "destination": {"type": "webhook"}}),
            "destination.url",
            "required",
        ),
        (
            webhook("http://93.184.215.14/hook", json!({})),
            "destination.url",
            "url_insecure",
        ),
        (
            webhook("ftp://93.184.215.14/hook", json!({})),
            "destination.url",
            "url_scheme",
        ),
        (
            // Edited from a URL as shown: the mark would be sent as it is.
            webhook("https://93.184.215.14/hook?code=***", json!({})),
            "destination.url",
            "redacted",
        ),
        (
            // 2,021 bytes as given, 4,019 as shown (`?***&***…`): it could not be sent back.
            webhook(
                &format!("https://93.184.215.14/h?{}", vec!["a"; 999].join("&")),
                json!({}),
            ),
            "destination.url",
            "too_long",
        ),
        (
            webhook("https://10.0.0.7/hook", json!({})),
            "destination.url",
            "url_private_address",
        ),
        (
            webhook("https://127.0.0.1/hook", json!({})),
            "destination.url",
            "url_private_address",
        ),
        (
            webhook("https://[::1]/hook", json!({})),
            "destination.url",
            "url_private_address",
        ),
        (
            webhook("https://169.254.169.254/latest", json!({})),
            "destination.url",
            "url_private_address",
        ),
        (
            webhook("https://localhost/hook", json!({})),
            "destination.url",
            "url_private_address",
        ),
        (
            webhook("https://user:pw@93.184.215.14/hook", json!({})),
            "destination.url",
            "url_credentials",
        ),
        (
            webhook("not a url", json!({})),
            "destination.url",
            "url_invalid",
        ),
        (
            webhook(PUBLIC_URL, json!({"headers": {"Connection": "close"}})),
            "destination.headers.Connection",
            "reserved",
        ),
        (
            webhook(PUBLIC_URL, json!({"headers": {"webhook-id": "x"}})),
            "destination.headers.webhook-id",
            "reserved",
        ),
        (
            webhook(PUBLIC_URL, json!({"headers": {"X-Lerian-Attempt": "9"}})),
            "destination.headers.X-Lerian-Attempt",
            "reserved",
        ),
        (
            webhook(
                PUBLIC_URL,
                json!({"headers": {"content-type": "text/plain"}}),
            ),
            "destination.headers.content-type",
            "reserved",
        ),
        (
            webhook(PUBLIC_URL, json!({"headers": {"bad header": "v"}})),
            "destination.headers",
            "invalid",
        ),
        (
            // A header line pasted in as a name: its credential is not echoed.
            webhook(
                PUBLIC_URL,
                json!({"sensitive_headers": {"Authorization: Bearer sk_live_pasted": "x"}}),
            ),
            "destination.sensitive_headers",
            "invalid",
        ),
        (
            webhook(PUBLIC_URL, json!({"headers": {"x-a": "1\r\nx-b: 2"}})),
            "destination.headers.x-a",
            "invalid",
        ),
        (
            webhook(
                PUBLIC_URL,
                json!({"sensitive_headers": {"Authorization": "a\nb"}}),
            ),
            "destination.sensitive_headers.Authorization",
            "invalid",
        ),
        (
            webhook(
                PUBLIC_URL,
                json!({"headers": {"x-k": "1"}, "sensitive_headers": {"X-K": "2"}}),
            ),
            "destination.sensitive_headers.x-k",
            "duplicate",
        ),
        (
            // Each value within its 4096 bytes, 8 KiB together with their names.
            webhook(
                PUBLIC_URL,
                json!({"headers": {"x-a": "a".repeat(4096), "x-b": "b".repeat(4091)}}),
            ),
            "destination.headers",
            "too_large",
        ),
        (
            webhook(
                PUBLIC_URL,
                json!({"headers": {"x-a": "a".repeat(4096)},
                       "sensitive_headers": {"x-key": "k".repeat(4089)}}),
            ),
            "destination.sensitive_headers",
            "too_large",
        ),
        (
            webhook(PUBLIC_URL, json!({"secret": "mine"})),
            "destination.secret",
            "unknown_field",
        ),
    ];
    let token = h.token("acme");
    for (body, field, code) in cases {
        let a = h.post("/v1/subscriptions", &token, body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text);
        assert_eq!(a.body["error"]["field"], field, "{body}: {}", a.text);
        assert_eq!(a.body["error"]["code"], code, "{body}: {}", a.text);
        assert!(!a.body["error"]["message"].as_str().unwrap().is_empty());
        assert!(!a.text.contains("sk_live_pasted"), "{}", a.text);
    }
    assert!(h.state.subs.list("acme").is_empty(), "nothing was written");
}

#[tokio::test]
async fn each_patch_validation_error_names_its_field() {
    let h = Harness::strict();
    let token = h.token("acme");
    let id = h.create_pull("acme").await;
    let uri = format!("/v1/subscriptions/{id}");
    let cases = [
        (json!({"event_types": []}), "event_types", "required"),
        (json!({"event_types": null}), "event_types", "invalid"),
        (json!({"enabled": null}), "enabled", "invalid"),
        (json!({"destination": null}), "destination", "invalid"),
        (
            json!({"destination": {"type": "webhook", "sensitive_headers": null}}),
            "destination.sensitive_headers",
            "invalid",
        ),
        (
            json!({"destination": {"type": "webhook", "headers": null}}),
            "destination.headers",
            "invalid",
        ),
        (
            json!({"destination": {"type": "webhook", "url": null}}),
            "destination.url",
            "invalid",
        ),
        (
            json!({"event_types": ["*", "x.*.y"]}),
            "event_types[1]",
            "invalid",
        ),
        (json!({"origin": "-x"}), "origin", "invalid"),
        (
            json!({"retry_schedule": ["10h 1m"]}),
            "retry_schedule[0]",
            "too_long",
        ),
        (json!({"tenant_id": "other"}), "tenant_id", "unknown_field"),
        (json!({"version": 7}), "version", "unknown_field"),
        (
            json!({"destination": {"type": "pull", "extra": 1}}),
            "destination.extra",
            "unknown_field",
        ),
    ];
    for (body, field, code) in cases {
        let a = h
            .call(Method::PATCH, &uri, Some(&token), Some(body.clone()), &[])
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text);
        assert_eq!(
            (
                a.body["error"]["field"].as_str(),
                a.body["error"]["code"].as_str()
            ),
            (Some(field), Some(code)),
            "{body}"
        );
    }
    assert_eq!(
        h.state.subs.get(&id).unwrap().version,
        1,
        "nothing was written"
    );
}

#[tokio::test]
async fn a_value_in_the_wrong_place_is_named_by_its_field_never_shown() {
    let h = Harness::strict();
    let token = h.token("acme");
    let credential = "Bearer sk_live_4f9a";
    let a = h
        .post(
            "/v1/subscriptions",
            &token,
            webhook(PUBLIC_URL, json!({"sensitive_headers": credential})),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text);
    assert_eq!(a.body["error"]["field"], "destination", "{}", a.text);
    assert!(
        a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid type: string"),
        "{}",
        a.text
    );
    let id = h.create_pull("acme").await;
    let patches = [
        json!({"destination": {"type": credential}}),
        json!({"enabled": credential}),
        json!({"retry_schedule": credential}),
    ];
    for body in patches {
        let a = h
            .call(
                Method::PATCH,
                &format!("/v1/subscriptions/{id}"),
                Some(&token),
                Some(body.clone()),
                &[],
            )
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text);
        assert!(!a.text.contains("sk_live"), "{body}: {}", a.text);
    }
    assert!(!a.text.contains("sk_live"), "{}", a.text);
}

#[tokio::test]
async fn malformed_json_is_400_and_a_non_json_body_is_415() {
    let h = Harness::new();
    let token = h.token("acme");
    let auth = format!("Bearer {token}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    let a = h
        .call(Method::POST, "/v1/subscriptions", None, None, &headers)
        .await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_body"))
    );
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "text/plain"),
    ];
    let a = h
        .call(Method::POST, "/v1/subscriptions", None, None, &headers)
        .await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Some("unsupported_media_type")
        )
    );
}
