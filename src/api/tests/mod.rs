//! Router tests: the whole API through `tower::ServiceExt::oneshot`, no port for the API itself.
//! Subscriptions live in [`Subscriptions::in_memory`]; the clock is a [`ManualClock`]; tokens are
//! minted at the clock's time. Verification probes are the real delivery probe against real
//! local HTTP servers ([`Hook`]: axum on `127.0.0.1:0`), which is why the default harness allows
//! private and insecure sinks; [`Harness::strict`] does not, for the URL rules.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use base64::Engine;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{ApiState, router};
use crate::config::Config;
use crate::runtime::avro::Codec;
use crate::runtime::clock::{Clock, ManualClock};
use crate::runtime::secret::Secret;
use crate::subscriptions::control::Subscriptions;
use crate::subscriptions::secrets::Kek;

mod access;
mod crud;
mod known_errors;
mod limits;
mod rotation;
mod validation;
mod verification;

pub const JWT_SECRET: &str = "test-jwt-secret-0123456789abcdef-xyz";
pub const START_MS: i64 = 1_750_000_000_000;

pub struct Harness {
    pub state: ApiState,
    pub clock: ManualClock,
}

/// One answer: status, headers, JSON body (`Null` when empty).
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub text: String,
}

impl Harness {
    /// Private and insecure sinks allowed (the local hook servers are `http://127.0.0.1`).
    pub fn new() -> Harness {
        Harness::with(true)
    }

    /// The production URL rules: https only, no private addresses.
    pub fn strict() -> Harness {
        Harness::with(false)
    }

    /// [`Harness::new`] whose subscription writes are never seen back in its table.
    pub fn lagging() -> Harness {
        Harness::with_subs(
            true,
            Subscriptions::lagging(Arc::new(Codec::new().unwrap())),
        )
    }

    /// [`Harness::new`] whose table is still reading the control topic (a start).
    pub fn loading() -> Harness {
        Harness::with_subs(
            true,
            Subscriptions::loading(Arc::new(Codec::new().unwrap())),
        )
    }

    fn with(open: bool) -> Harness {
        Harness::with_subs(
            open,
            Subscriptions::in_memory(Arc::new(Codec::new().unwrap())),
        )
    }

    fn with_subs(open: bool, subs: Subscriptions) -> Harness {
        // Tests write freely: `limits.rs` tests the write rate with a limit of its own.
        Harness::with_vars(open, subs, &[("STREAMING_HUB_API_WRITE_RATE", "0")])
    }

    /// [`Harness::new`] with `vars` set too.
    pub fn with_settings(vars: &[(&str, &str)]) -> Harness {
        Harness::with_vars(
            true,
            Subscriptions::in_memory(Arc::new(Codec::new().unwrap())),
            vars,
        )
    }

    fn with_vars(open: bool, subs: Subscriptions, extra: &[(&str, &str)]) -> Harness {
        let kek = base64::engine::general_purpose::STANDARD.encode([42u8; 32]);
        let vars = [
            ("STREAMING_HUB_JWT_SECRET", JWT_SECRET.to_string()),
            ("STREAMING_HUB_KEK", kek),
            ("STREAMING_HUB_ALLOW_PRIVATE_SINKS", open.to_string()),
            ("STREAMING_HUB_ALLOW_INSECURE_SINKS", open.to_string()),
            ("STREAMING_HUB_HTTP_TIMEOUT", "3s".to_string()),
        ];
        let config = Config::from_vars(
            vars.into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .chain(extra.iter().map(|(k, v)| (k.to_string(), v.to_string()))),
        )
        .unwrap();
        let clock = ManualClock::new(START_MS);
        let state = ApiState::from_config(&config, subs, Arc::new(clock.clone())).unwrap();
        Harness { state, clock }
    }

    pub fn kek(&self) -> &Kek {
        &self.state.kek
    }

    /// A token for `tenant` valid for an hour from the harness clock's now.
    pub fn token(&self, tenant: &str) -> String {
        self.mint(Some(tenant), false)
    }

    /// Creates a webhook subscription to `url` for the token's tenant; its id.
    pub async fn create_webhook(&self, token: &str, url: &str) -> String {
        let a = self
            .post("/v1/subscriptions", token, webhook_body(url))
            .await;
        a.body["id"].as_str().expect(&a.text).to_string()
    }

    /// An admin token that carries a tenant of its own.
    pub fn admin_token_with_tenant(&self, tenant: &str) -> String {
        self.mint(Some(tenant), true)
    }

    pub fn admin_token(&self) -> String {
        self.mint(None, true)
    }

    fn mint(&self, tenant: Option<&str>, admin: bool) -> String {
        super::auth::mint_at(
            &Secret::new(JWT_SECRET),
            tenant,
            admin,
            Duration::from_secs(3600),
            self.now_secs(),
        )
    }

    fn now_secs(&self) -> i64 {
        self.clock.now_ms() / 1000
    }

    /// Sends one request through a fresh router.
    pub async fn call(
        &self,
        method: Method,
        uri: &str,
        token: Option<&str>,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = body
            .map(|b| Body::from(b.to_string()))
            .unwrap_or_else(Body::empty);
        let response = router(self.state.clone())
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).to_string();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or(Value::Null)
        };
        Answer {
            status,
            headers,
            body,
            text,
        }
    }

    pub async fn post(&self, uri: &str, token: &str, body: Value) -> Answer {
        self.call(Method::POST, uri, Some(token), Some(body), &[])
            .await
    }

    pub async fn get(&self, uri: &str, token: &str) -> Answer {
        self.call(Method::GET, uri, Some(token), None, &[]).await
    }

    /// Creates a pull subscription for `tenant` and returns its id.
    pub async fn create_pull(&self, tenant: &str) -> String {
        let a = self
            .post("/v1/subscriptions", &self.token(tenant), pull_body())
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
        a.body["id"].as_str().unwrap().to_string()
    }
}

pub fn pull_body() -> Value {
    json!({"event_types": ["transaction.created"], "destination": {"type": "pull"}})
}

pub fn webhook_body(url: &str) -> Value {
    json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url}})
}

/// What a local webhook endpoint received: headers and body of each request.
#[derive(Clone, Default)]
pub struct Received(pub Arc<Mutex<Vec<(HeaderMap, String)>>>);

/// A real HTTP endpoint on `127.0.0.1:0`. While `echo` is on it answers 200 with the request body
/// (which contains the challenge); otherwise 200 with `ok`.
pub struct Hook {
    pub url: String,
    pub received: Received,
    /// Each request's query, as received.
    pub queries: Arc<Mutex<Vec<Option<String>>>>,
    pub echo: Arc<std::sync::atomic::AtomicBool>,
}

impl Hook {
    pub async fn start(echo: bool) -> Hook {
        let received = Received::default();
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(echo));
        let queries = Arc::new(Mutex::new(Vec::new()));
        let (r, f, q) = (received.clone(), flag.clone(), queries.clone());
        use axum::extract::RawQuery;
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(
                move |headers: HeaderMap, RawQuery(query): RawQuery, body: String| async move {
                    r.0.lock().unwrap().push((headers, body.clone()));
                    q.lock().unwrap().push(query);
                    if f.load(std::sync::atomic::Ordering::SeqCst) {
                        body
                    } else {
                        "ok".to_string()
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Hook {
            url,
            received,
            queries,
            echo: flag,
        }
    }

    pub fn requests(&self) -> Vec<(HeaderMap, String)> {
        self.received.0.lock().unwrap().clone()
    }
}
