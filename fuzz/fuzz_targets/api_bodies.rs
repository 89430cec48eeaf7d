//! Fuzzes what the API does with a request body before it touches Kafka: the strict JSON parse
//! (`api::extract::parse_body`, which names the offending field), the caller's tenant, and each
//! body's rules. Any body must end in a value or an `ApiError`, never a panic, and no body may
//! make a handler answer `500`.
//!
//! Wherever that is safe, the body goes through the real router (`tower::ServiceExt::oneshot`)
//! with a bearer token, on an [`ApiState`] without a broker (in-memory subscriptions, a fixed
//! clock, the test clock on): the whole handler runs, up to the in-memory write. Two things are
//! never done, so those bodies are checked by the handlers' public rule functions instead:
//! - resolving a webhook host (a DNS query per run) and probing a webhook (an HTTP request): a
//!   create or patch whose URL names a host, or that passes every rule with a webhook, stops at
//!   the rules;
//! - recover, replay and redrive need the Kafka-backed operations state before they read the
//!   body; their bodies go through the same parsing and rules the handlers call
//!   (`RecoverRequest::since_ms`, `ReplayRequest::window`, `RedriveRequest::positions`).
//!
//! Input layout: byte 0 picks the body (bits 0-2, modulo 7: create, patch, recover, replay,
//! redrive, rotate-secret, clock advance) and the context: bit 3 allows private and insecure
//! sinks, bit 4 makes the stored subscription a pull one (otherwise a webhook), bit 5 takes the
//! first line of the rest as the `Content-Type` (otherwise `application/json`), bit 6 makes the
//! caller an admin (otherwise the tenant `tenant-a`), bit 7 takes the next line as `If-Match`.
//! The rest is the body.
#![no_main]

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::IntoResponse;
use libfuzzer_sys::fuzz_target;
use streaming_hub::api::auth::mint_at;
use streaming_hub::api::errors::ApiError;
use streaming_hub::api::extract::parse_body;
use streaming_hub::api::ops::{RecoverRequest, RedriveRequest, ReplayRequest};
use streaming_hub::api::{ApiState, Caller, router};
use streaming_hub::config::Config;
use streaming_hub::delivery::ssrf::check_url;
use streaming_hub::runtime::avro::Codec;
use streaming_hub::runtime::clock::ManualClock;
use streaming_hub::runtime::records::{DestinationRecord, DestinationType, SubscriptionRecord};
use streaming_hub::runtime::secret::Secret;
use streaming_hub::subscriptions::control::Subscriptions;
use streaming_hub::subscriptions::model::{
    CreateSubscription, DestinationPatch, DestinationSpec, FieldError, PatchSubscription,
    SinkPolicy, check_webhook_url, parse_retry_schedule, validate_event_types, validate_header_map,
    validate_header_sets, validate_origin,
};
use streaming_hub::subscriptions::secrets::generate_signing_secret;
use tower::ServiceExt;

const TENANT: &str = "tenant-a";
/// The stored subscription patch and rotate-secret act on, reset before each run.
const FIXTURE_ID: &str = "0190b7a4-5c3e-7d2a-9f1b-3c4d5e6f7a8b";
const START_MS: i64 = 1_750_000_000_000;
const JWT_SECRET: &str = "fuzz-jwt-secret-0123456789abcdef-xyz";

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("tokio runtime")
});

/// One state and router per sink policy: strict (`https` to public addresses) or open.
struct Api {
    state: ApiState,
    router: Router,
}

fn api(open: bool) -> Api {
    let vars = [
        ("STREAMING_HUB_JWT_SECRET", JWT_SECRET),
        // base64 of 32 bytes of 42.
        (
            "STREAMING_HUB_KEK",
            "KioqKioqKioqKioqKioqKioqKioqKioqKioqKioqKio=",
        ),
        (
            "STREAMING_HUB_ALLOW_PRIVATE_SINKS",
            if open { "true" } else { "false" },
        ),
        (
            "STREAMING_HUB_ALLOW_INSECURE_SINKS",
            if open { "true" } else { "false" },
        ),
    ];
    let config =
        Config::from_vars(vars.map(|(k, v)| (k.to_string(), v.to_string()))).expect("fuzz config");
    let subs = Subscriptions::in_memory(Arc::new(Codec::new().expect("codec")));
    let clock = Arc::new(ManualClock::new(START_MS));
    let mut state = ApiState::from_config(&config, subs, clock).expect("api state");
    state.test_clock = Some(ManualClock::new(START_MS));
    Api {
        router: router(state.clone()),
        state,
    }
}

static STRICT: LazyLock<Api> = LazyLock::new(|| api(false));
static OPEN: LazyLock<Api> = LazyLock::new(|| api(true));

fn token(admin: bool) -> String {
    let tenant = (!admin).then_some(TENANT);
    mint_at(
        &Secret::new(JWT_SECRET),
        tenant,
        admin,
        Duration::from_secs(3600),
        START_MS / 1000,
    )
}

static TENANT_TOKEN: LazyLock<String> = LazyLock::new(|| token(false));
static ADMIN_TOKEN: LazyLock<String> = LazyLock::new(|| token(true));

/// The fixture: a pull subscription or a webhook one with a sealed signing secret.
fn fixture(state: &ApiState, pull: bool) -> SubscriptionRecord {
    let mut rec = SubscriptionRecord::pull(FIXTURE_ID, TENANT, &["transaction.*"]);
    if !pull {
        rec.destination = DestinationRecord {
            kind: DestinationType::Webhook,
            url: Some("https://hooks.example.com/in".into()),
            headers: BTreeMap::from([("x-team".to_owned(), "payments".to_owned())]),
            sensitive_headers: None,
            sealed_target: None,
        };
        rec.signing_secrets =
            vec![
                state
                    .kek
                    .seal_secret(&generate_signing_secret(), FIXTURE_ID, None),
            ];
    }
    rec
}

/// One request through the real router; panics on a `500`. Returns the `Location` header.
fn route(
    api: &Api,
    method: Method,
    uri: &str,
    headers: &HeaderMap,
    admin: bool,
    body: &[u8],
) -> Option<String> {
    let bearer = if admin { &*ADMIN_TOKEN } else { &*TENANT_TOKEN };
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::AUTHORIZATION, format!("Bearer {bearer}"));
    for (name, value) in headers {
        req = req.header(name, value);
    }
    let req = req.body(Body::from(body.to_vec())).expect("request");
    let response = RUNTIME
        .block_on(api.router.clone().oneshot(req))
        .expect("infallible");
    let status = response.status();
    let location = response
        .headers()
        .get(header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = RUNTIME
        .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
        .expect("response body");
    assert_ne!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "500 for {uri}: {}",
        String::from_utf8_lossy(&bytes)
    );
    location
}

/// Puts the fixture back as it was (patch and rotate change it).
fn reset(api: &Api, pull: bool) {
    let rec = fixture(&api.state, pull);
    RUNTIME.block_on(async {
        api.state
            .subs
            .delete(FIXTURE_ID)
            .await
            .expect("in-memory delete");
        api.state.subs.put(rec).await.expect("in-memory put");
    });
}

/// The error answer a client would get (serialises the JSON body).
fn answer(e: ApiError) {
    drop(e.into_response());
}

fn split_line(rest: &[u8]) -> (&[u8], &[u8]) {
    match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[]),
    }
}

/// True when checking `url` resolves no host name (too long, refused first, or an IP literal).
fn resolves_nothing(url: &str, policy: SinkPolicy) -> bool {
    url.len() > 2048
        || check_url(url, policy.allow_private, policy.allow_insecure)
            .map_or(true, |u| u.domain().is_none())
}

/// The URL rules: the real check when it resolves nothing, else all of it but resolving.
fn check_url_rules(url: &str, policy: SinkPolicy) -> Result<(), FieldError> {
    if resolves_nothing(url, policy) {
        RUNTIME.block_on(check_webhook_url(url, policy))?;
    } else {
        check_url(url, policy.allow_private, policy.allow_insecure)
            .map_err(|e| FieldError::new("destination.url", e.code(), e.to_string()))?;
    }
    Ok(())
}

/// `CreateSubscription::validate`'s rules in its order, without resolving the host.
fn create_rules(body: &CreateSubscription, policy: SinkPolicy) -> Result<(), FieldError> {
    if let Some(o) = &body.origin {
        validate_origin(o)?;
    }
    validate_event_types(&body.event_types)?;
    if let Some(steps) = &body.retry_schedule {
        parse_retry_schedule(steps)?;
    }
    if let DestinationSpec::Webhook {
        url,
        headers,
        sensitive_headers,
    } = &body.destination
    {
        let plain = validate_header_map("headers", headers)?;
        let sensitive = validate_header_map("sensitive_headers", sensitive_headers)?;
        validate_header_sets(&plain, &sensitive)?;
        check_url_rules(url, policy)?;
    }
    Ok(())
}

fn create(api: &Api, headers: &HeaderMap, body: &[u8], admin: bool) {
    let policy = api.state.sinks;
    let routed = match parse_body::<CreateSubscription>(headers, body) {
        Err(_) => true,
        Ok(parsed) => match &parsed.destination {
            DestinationSpec::Pull {} => true,
            DestinationSpec::Webhook { url, .. } if resolves_nothing(url, policy) => {
                // Route only a webhook the rules refuse: one they accept would be probed.
                RUNTIME.block_on(parsed.validate(policy)).is_err()
            }
            DestinationSpec::Webhook { .. } => {
                if let Err(e) = create_rules(&parsed, policy) {
                    answer(e.into());
                }
                false
            }
        },
    };
    if routed {
        let location = route(api, Method::POST, "/v1/subscriptions", headers, admin, body);
        // A created subscription is deleted again, so the table stays small.
        if let Some(id) = location.and_then(|l| l.rsplit('/').next().map(str::to_string)) {
            RUNTIME
                .block_on(api.state.subs.delete(&id))
                .expect("in-memory delete");
        }
    }
}

fn patch(api: &Api, headers: &HeaderMap, body: &[u8], admin: bool, pull: bool) {
    let policy = api.state.sinks;
    if let Ok(parsed) = parse_body::<PatchSubscription>(headers, body) {
        if let Some(DestinationPatch::Webhook {
            url: Some(url),
            headers,
            sensitive_headers,
        }) = &parsed.destination
        {
            // A new URL may be resolved and probed: the handler's rules only.
            let rules = || -> Result<(), FieldError> {
                if let Some(Some(o)) = &parsed.origin {
                    validate_origin(o)?;
                }
                if let Some(types) = &parsed.event_types {
                    validate_event_types(types)?;
                }
                if let Some(Some(steps)) = &parsed.retry_schedule {
                    parse_retry_schedule(steps)?;
                }
                check_url_rules(url, policy)?;
                let plain = match headers {
                    Some(h) => validate_header_map("headers", h)?,
                    None => BTreeMap::new(),
                };
                let sensitive = match sensitive_headers {
                    Some(s) => validate_header_map("sensitive_headers", s)?,
                    None => BTreeMap::new(),
                };
                validate_header_sets(&plain, &sensitive)
            };
            if let Err(e) = rules() {
                answer(e.into());
            }
            return;
        }
    }
    reset(api, pull);
    let uri = format!("/v1/subscriptions/{FIXTURE_ID}?tenant_id={TENANT}");
    let uri = if admin {
        uri
    } else {
        format!("/v1/subscriptions/{FIXTURE_ID}")
    };
    route(api, Method::PATCH, &uri, headers, admin, body);
}

fn recover(headers: &HeaderMap, body: &[u8], caller: &Caller) {
    let run = || -> Result<(), ApiError> {
        let body: RecoverRequest = parse_body(headers, body)?;
        caller.tenant_for(body.tenant_id.as_deref())?;
        body.since_ms()?;
        Ok(())
    };
    if let Err(e) = run() {
        answer(e);
    }
}

fn replay(headers: &HeaderMap, body: &[u8]) {
    if let Err(e) = parse_body::<ReplayRequest>(headers, body).and_then(|b| b.window()) {
        answer(e);
    }
}

fn redrive(headers: &HeaderMap, body: &[u8]) {
    if let Err(e) = parse_body::<RedriveRequest>(headers, body).and_then(|b| b.positions()) {
        answer(e);
    }
}

fn rotate(api: &Api, headers: &HeaderMap, body: &[u8], admin: bool, pull: bool) {
    reset(api, pull);
    let path = format!("/v1/subscriptions/{FIXTURE_ID}/rotate-secret");
    let uri = if admin {
        format!("{path}?tenant_id={TENANT}")
    } else {
        path
    };
    route(api, Method::POST, &uri, headers, admin, body);
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let api = if flags & 0x08 != 0 { &*OPEN } else { &*STRICT };
    let pull = flags & 0x10 != 0;
    let admin = flags & 0x40 != 0;
    let mut headers = HeaderMap::new();
    let mut content_type = HeaderValue::from_static("application/json");
    if flags & 0x20 != 0 {
        let (line, body) = split_line(rest);
        rest = body;
        match HeaderValue::from_bytes(line) {
            Ok(v) => content_type = v,
            Err(_) => return,
        }
    }
    headers.insert(header::CONTENT_TYPE, content_type);
    if flags & 0x80 != 0 {
        let (line, body) = split_line(rest);
        rest = body;
        match HeaderValue::from_bytes(line) {
            Ok(v) => drop(headers.insert(header::IF_MATCH, v)),
            Err(_) => return,
        }
    }
    let caller = Caller {
        tenant: (!admin).then(|| TENANT.to_string()),
        admin,
    };
    match (flags & 7) % 7 {
        0 => create(api, &headers, rest, admin),
        1 => patch(api, &headers, rest, admin, pull),
        2 => recover(&headers, rest, &caller),
        3 => replay(&headers, rest),
        4 => redrive(&headers, rest),
        5 => rotate(api, &headers, rest, admin, pull),
        _ => drop(route(
            api,
            Method::POST,
            "/admin/clock/advance",
            &headers,
            admin,
            rest,
        )),
    }
});
