//! The tenant HTTP API (issue 5): subscriptions, their verification and their signing secrets,
//! behind bearer tokens, plus `GET /openapi.json`.
//!
//! | Method and path                            | Handler                          |
//! |--------------------------------------------|----------------------------------|
//! | `POST /v1/subscriptions`                   | [`subscriptions::create`]        |
//! | `GET /v1/subscriptions`                    | [`subscriptions::list`]          |
//! | `GET/PATCH/DELETE /v1/subscriptions/{id}`  | [`subscriptions`]                |
//! | `POST /v1/subscriptions/{id}/verify`       | [`verification::verify`]         |
//! | `POST /v1/subscriptions/{id}/rotate-secret`| [`secrets::rotate`]              |
//! | `POST /v1/subscriptions/{id}/recover`      | [`ops::recover`]                 |
//! | `GET /v1/events` (pull)                    | [`ops::pull_events`]             |
//! | `POST /admin/replay`, `GET`/`DELETE /admin/replay/{id}` | [`ops::start_replay`] |
//! | `GET /admin/dlq`, `/admin/quarantine`, `/admin/deliveries/dead` | [`ops`]     |
//! | `POST /admin/deliveries/dead/redrive`      | [`ops::redrive`]                 |
//! | `GET /openapi.json` (no token)             | [`openapi::serve`]               |
//!
//! Invariants: every `/v1` handler takes a [`auth::Caller`] (no token, no handler), acts for one
//! tenant, and finds subscriptions only through [`subscriptions::load`], which takes that tenant;
//! another tenant's subscription is `404`, never `403`. Errors are JSON
//! `{"error":{"code","message","field"}}` ([`errors`]). Plaintext signing secrets leave the
//! process only in the create and rotate answers. The API talks to the rest of the hub through
//! [`Subscriptions`] (the control topic, read-your-writes), the KEK and the delivery module's probe.
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};

use crate::config::Config;
use crate::runtime::clock::SharedClock;
use crate::subscriptions::control::Subscriptions;
use crate::subscriptions::model::SinkPolicy;
use crate::subscriptions::secrets::{Kek, SecretError};
use errors::ApiError;

pub mod admin;
pub mod auth;
pub mod errors;
pub mod extract;
pub mod gate;
pub mod openapi;
pub mod ops;
pub mod responses;
pub mod secrets;
pub mod serve;
pub mod subscriptions;
pub mod verification;

#[cfg(test)]
mod tests;

pub use auth::{Caller, JwtKeys, mint};

/// Largest request body accepted (a subscription is well under 64 KiB).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    pub subs: Subscriptions,
    pub kek: Arc<Kek>,
    pub jwt: JwtKeys,
    pub clock: SharedClock,
    /// The delivery client (SSRF-guarded resolver, no redirects) the verification probe uses.
    pub http: reqwest::Client,
    pub sinks: SinkPolicy,
    /// Default grace of a rotated-out signing secret.
    pub rotation_grace: Duration,
    /// `STREAMING_HUB_MAX_SUBSCRIPTIONS_PER_TENANT` (`0` = no limit).
    pub max_subscriptions_per_tenant: usize,
    /// `STREAMING_HUB_MAX_PULL_SUBSCRIPTIONS_PER_TENANT` (`0` = no limit of its own).
    pub max_pull_subscriptions_per_tenant: usize,
    /// The virtual clock, when `STREAMING_HUB_DANGEROUS_TEST_CLOCK` is on (`/admin/clock/advance`).
    pub test_clock: Option<crate::runtime::clock::ManualClock>,
    /// Pull, replay, recover, forensics and redrive (absent in unit tests of the other routes).
    pub ops: Option<Arc<ops::Ops>>,
    /// Serializes this instance's read-modify-writes (see [`subscriptions`]).
    writes: Arc<tokio::sync::Mutex<()>>,
    /// `STREAMING_HUB_API_WRITE_RATE`/`_BURST`, per tenant.
    write_limiter: Arc<crate::ops::ratelimit::RateLimiter>,
    /// Verification probes the API runs at once ([`verification::MAX_TENANT_PROBES`] of a tenant,
    /// [`verification::MAX_PROBES`] in all).
    pub probes: Arc<gate::TenantGate>,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiSetupError {
    #[error("STREAMING_HUB_KEK: {0}")]
    Kek(#[from] SecretError),
    #[error(transparent)]
    Client(#[from] crate::delivery::client::ClientError),
}

impl ApiState {
    /// The state from its parts; the policy, grace and JWT secret come from `config`.
    pub fn new(
        config: &Config,
        subs: Subscriptions,
        kek: Arc<Kek>,
        clock: SharedClock,
        http: reqwest::Client,
    ) -> ApiState {
        if config.jwt_secret.is_empty() {
            tracing::warn!("STREAMING_HUB_JWT_SECRET is empty: the API refuses every token");
        }
        ApiState {
            subs,
            kek,
            jwt: JwtKeys::new(config.jwt_secret.clone()),
            clock,
            http,
            sinks: SinkPolicy {
                allow_private: config.allow_private_sinks,
                allow_insecure: config.allow_insecure_sinks,
            },
            rotation_grace: config.secret_rotation_grace,
            max_subscriptions_per_tenant: config.max_subscriptions_per_tenant as usize,
            max_pull_subscriptions_per_tenant: config.max_pull_subscriptions_per_tenant as usize,
            test_clock: None,
            ops: None,
            writes: Arc::default(),
            write_limiter: Arc::new(crate::ops::ratelimit::RateLimiter::new(
                config.api_write_rate,
                config.api_write_burst,
            )),
            probes: Arc::new(gate::TenantGate::new(
                verification::MAX_TENANT_PROBES,
                verification::MAX_PROBES,
            )),
        }
    }

    /// Gives back the write [`ApiState::take_write`] took for a request refused for another
    /// reason before it wrote or probed anything.
    pub fn give_back_write(&self, caller: &auth::Caller, tenant: &str) {
        if !caller.admin {
            self.write_limiter.give_back(tenant);
        }
    }

    /// Takes one of `tenant`'s subscription writes (`STREAMING_HUB_API_WRITE_RATE`), or `429
    /// rate_limited` with `Retry-After`. An admin caller is not held to it (operators' bulk
    /// changes; `subscriptions apply` writes past the API altogether). Without it, one tenant's
    /// stream of writes queued every other tenant's behind this instance's write lock, each
    /// held until its record is read back, and grew the control topic every instance reads whole
    /// at start.
    pub fn take_write(&self, caller: &auth::Caller, tenant: &str) -> Result<(), ApiError> {
        if caller.admin {
            return Ok(());
        }
        self.write_limiter
            .take(tenant, std::time::Instant::now())
            .map_err(|wait| {
                let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
                ApiError::too_many(
                    errors::codes::RATE_LIMITED,
                    format!("subscription write rate exceeded; retry in {secs} s"),
                    secs,
                )
            })
    }

    /// The lock every read-modify-write of this instance's subscriptions is made under (the
    /// handlers', the pending-verification retrier's).
    pub fn write_lock(&self) -> Arc<tokio::sync::Mutex<()>> {
        self.writes.clone()
    }

    /// The state with the KEK and the delivery client built from `config`.
    pub fn from_config(
        config: &Config,
        subs: Subscriptions,
        clock: SharedClock,
    ) -> Result<ApiState, ApiSetupError> {
        let kek = Arc::new(Kek::from_config(config)?);
        let http = crate::delivery::client::build_client(config)?;
        Ok(ApiState::new(config, subs, kek, clock, http))
    }
}

/// The API's routes; merge it into the process's HTTP server.
pub fn router(state: ApiState) -> Router {
    let mut routes = Router::new()
        .route(
            "/v1/subscriptions",
            post(subscriptions::create).get(subscriptions::list),
        )
        .route(
            "/v1/subscriptions/{id}",
            get(subscriptions::get_one)
                .patch(subscriptions::patch)
                .delete(subscriptions::delete),
        )
        .route("/v1/subscriptions/{id}/verify", post(verification::verify))
        .route(
            "/v1/subscriptions/{id}/rotate-secret",
            post(secrets::rotate),
        )
        .route("/v1/subscriptions/{id}/recover", post(ops::recover))
        .route("/v1/events", get(ops::pull_events))
        .route("/admin/replay", post(ops::start_replay))
        .route(
            "/admin/replay/{id}",
            get(ops::replay_status).delete(ops::cancel_replay),
        )
        .route("/admin/dlq", get(ops::producer_dlq))
        .route("/admin/quarantine", get(ops::quarantine))
        .route("/admin/deliveries/dead", get(ops::dead_deliveries))
        .route("/admin/deliveries/dead/redrive", post(ops::redrive))
        .route("/openapi.json", get(openapi::serve));
    // Only with the test clock: otherwise the path is as unknown as any other (`404 not_found`
    // "no such route", for any caller), not a route that checks the token and the body first.
    if state.test_clock.is_some() {
        routes = routes.route("/admin/clock/advance", post(admin::advance_clock));
    }
    routes
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(no_route)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// A path no route has: a JSON error as every other answer (it was an empty 404).
pub async fn no_route() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        errors::codes::NOT_FOUND,
        "no such route",
    )
}

/// A route asked with a method it does not take: a JSON error (it was an empty 405).
async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method",
    )
}

/// The process's fallback when the API is off (no `STREAMING_HUB_KEK`): `api_off` under `/v1`,
/// `/admin` and `/openapi.json`, `not_found` elsewhere.
pub async fn api_off(uri: axum::http::Uri) -> ApiError {
    let path = uri.path();
    if path.starts_with("/v1/") || path.starts_with("/admin/") || path == "/openapi.json" {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "api_off",
            "the subscription API is off on this instance (STREAMING_HUB_KEK is not set)",
        )
    } else {
        no_route().await
    }
}

/// Refuses API requests once the process is stopping: the control reader has stopped, so reads
/// would answer from a table no longer kept current and each write would wait its whole
/// read-back time for nothing. `/healthz`, `/readyz` and `/metrics` are not behind it.
pub async fn refuse_when_stopping(
    axum::extract::State(stopping): axum::extract::State<Arc<std::sync::atomic::AtomicBool>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if stopping.load(std::sync::atomic::Ordering::SeqCst) {
        let mut response = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "this instance is shutting down; retry on another",
        )
        .into_response();
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
        return response;
    }
    next.run(request).await
}
