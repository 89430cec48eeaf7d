//! Operations endpoints: the pull API (tenant), recover (tenant), and the admin endpoints for
//! per-subscription replay, forensics (`/admin/dlq`, `/admin/quarantine`,
//! `/admin/deliveries/dead`) and redrive. See `crate::ops` for how each works.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::ApiState;
use super::auth::{Admin, Caller};
use super::errors::{ApiError, ErrorBody, codes};
use super::extract::{ApiPath, ApiQuery, JsonBody};
use super::gate::{GateSlot, TenantGate};
use super::subscriptions::{caught_up, load, synced};
use crate::ops::forensics::{DeadDelivery, Filter, ForensicRecord, Forensics};
use crate::ops::pull::{Cursor, EventPage, PullError, PullReader};
use crate::ops::ratelimit::RateLimiter;
use crate::ops::redeliver::{
    Progress, RedeliverError, Redeliverer, catching_panics, check_redeliverable,
};
use crate::runtime::records::{
    DeadLetterRecord, DestinationType, SubscriptionRecord, VerificationState,
};
use crate::subscriptions::control::Subscriptions;

/// What the operations endpoints share.
pub struct Ops {
    pub pull: PullReader,
    pub limiter: RateLimiter,
    pub redeliver: Arc<Redeliverer>,
    pub forensics: Forensics,
    /// Replays, recovers and redrives of this instance, by id.
    pub progress: Mutex<HashMap<String, Arc<Mutex<Progress>>>>,
    /// Recovers and replays running now, one per tenant and [`MAX_SCANS`] in all (each reads a
    /// whole topic on a blocking thread).
    pub scans: TenantGate,
    /// Pull reads running now.
    pub pull_reads: PullGate,
}

/// Most pull reads one instance runs at once, whatever the tenants: each holds a consumer with
/// up to 16 MiB fetched and builds a page of up to 8 MiB of payloads (the per-tenant rate limit
/// alone let twenty of one tenant's run together).
pub const MAX_PULL_READS: usize = 4;

/// Most pull reads of one tenant at once, so one tenant cannot take every place.
pub const MAX_PULL_READS_PER_TENANT: usize = 2;

/// How long a pull read waits for a place before it is answered `429`.
pub const PULL_READ_WAIT: Duration = Duration::from_secs(2);

/// Places for pull reads ([`MAX_PULL_READS`], [`MAX_PULL_READS_PER_TENANT`]).
pub struct PullGate {
    places: Arc<tokio::sync::Semaphore>,
    /// Each tenant's reads, refused at once past [`MAX_PULL_READS_PER_TENANT`].
    tenants: TenantGate,
}

/// A pull read's place, given back when dropped.
pub struct PullPlace {
    _place: tokio::sync::OwnedSemaphorePermit,
    _tenant: GateSlot,
}

impl Default for PullGate {
    fn default() -> PullGate {
        PullGate {
            places: Arc::new(tokio::sync::Semaphore::new(MAX_PULL_READS)),
            // The instance's bound is the semaphore's, which a read waits for.
            tenants: TenantGate::new(MAX_PULL_READS_PER_TENANT, usize::MAX),
        }
    }
}

impl PullGate {
    /// A place for one of `tenant`'s reads: None at once when the tenant has its most running,
    /// or after `wait` when no place came free.
    pub async fn enter(&self, tenant: &str, wait: Duration) -> Option<PullPlace> {
        let counted = self.tenants.enter(tenant)?;
        let place = tokio::time::timeout(wait, self.places.clone().acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some(PullPlace {
            _place: place,
            _tenant: counted,
        })
    }
}

/// Most recovers and per-subscription replays one instance runs at once; and one tenant runs one
/// at a time. A recover reads every record of `<prefix>.dlq`, a replay every inbox record of its
/// window: without a bound, parallel calls would hold the instance's cores and slow every
/// tenant's deliveries.
pub const MAX_SCANS: usize = 2;

/// A recover or replay refused by the scan gate ([`Ops::scans`]).
fn scans_busy() -> Response {
    too_many(
        "recover_running",
        "a recover or replay of this tenant, or as many as this instance runs at once, is \
         running; retry when it has ended"
            .into(),
        5,
    )
}

/// `429` with `Retry-After` (whole seconds, at least 1).
fn too_many(code: &'static str, message: String, wait_secs: u64) -> Response {
    ApiError::too_many(code, message, wait_secs).into_response()
}

/// Most replays, recovers and redrives remembered (oldest forgotten first).
const MAX_PROGRESS: usize = 1000;

fn ops(state: &ApiState) -> Result<&Arc<Ops>, ApiError> {
    state.ops.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::UNAVAILABLE,
            "operations are not enabled on this instance",
        )
    })
}

fn parse_time(text: &str, field: &str) -> Result<i64, ApiError> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.timestamp_millis())
        .map_err(|_| {
            ApiError::bad_request("invalid", format!("{field} must be an RFC 3339 time"))
                .with_field(field)
        })
}

fn parse_limit(text: Option<&str>, default: usize, max: usize) -> Result<usize, ApiError> {
    match text {
        None => Ok(default),
        Some(t) => t
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("invalid", format!("limit is a number from 1 to {max}"))
                    .with_field("limit")
            }),
    }
}

fn unavailable(e: &dyn std::fmt::Display) -> ApiError {
    tracing::warn!(error = %e, "operations: Kafka unavailable");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        codes::UNAVAILABLE,
        "the event store is unavailable; retry later",
    )
}

fn remember(ops: &Ops, kind: &str, subscription: Option<&str>) -> Arc<Mutex<Progress>> {
    let id = uuid::Uuid::now_v7().to_string();
    let p = Arc::new(Mutex::new(Progress {
        id: id.clone(),
        kind: kind.to_string(),
        subscription_id: subscription.map(str::to_string),
        state: "running".into(),
        ..Progress::default()
    }));
    let mut all = ops.progress.lock().unwrap_or_else(|e| e.into_inner());
    make_room(&mut all, MAX_PROGRESS);
    all.insert(id, p.clone());
    p
}

/// Forgets runs until one more fits under `most`: the oldest finished first (ids are UUIDv7: the
/// smallest is the oldest). A running one is kept, so its progress can still be read and a
/// replay cancelled (`DELETE /admin/replay/{id}`) however many short runs come after it (a long
/// replay was forgotten behind a thousand recovers and could no longer be stopped); only when
/// every one kept is running, more than the gates let run at once, does the oldest go.
fn make_room(all: &mut HashMap<String, Arc<Mutex<Progress>>>, most: usize) {
    while all.len() >= most.max(1) {
        let running = |p: &Arc<Mutex<Progress>>| {
            p.lock().unwrap_or_else(|e| e.into_inner()).state == "running"
        };
        let oldest = all
            .iter()
            .filter(|(_, p)| !running(p))
            .map(|(id, _)| id)
            .min()
            .or_else(|| all.keys().min())
            .cloned();
        match oldest {
            Some(id) => all.remove(&id),
            None => return,
        };
    }
}

/// A recover, replay or redrive to a subscription that is disabled or not verified: `409`. The
/// hub would not send the redeliveries (it holds them, and dead-letters them again while the
/// subscription stays disabled), so queueing them would answer success for nothing.
fn check_active(sub: &SubscriptionRecord) -> Result<(), ApiError> {
    inactive_why(sub).map_err(|why| {
        ApiError::new(
            StatusCode::CONFLICT,
            codes::SUBSCRIPTION_INACTIVE,
            format!(
                "nothing is redelivered to this subscription while {why}: verify it \
                 (POST /v1/subscriptions/{{id}}/verify) or enable it first"
            ),
        )
    })
}

/// Why the hub would not send a redelivery to `sub`, if it would not.
fn inactive_why(sub: &SubscriptionRecord) -> Result<(), &'static str> {
    if !sub.enabled {
        return Err("it is disabled");
    }
    match sub.verification_state {
        VerificationState::Active => Ok(()),
        VerificationState::Pending => Err("its destination's verification is pending"),
        VerificationState::Failed => Err("its destination failed verification"),
    }
}

/// Whether a dead letter can be redriven: its subscription still there (the hub drops a
/// redelivery to a deleted one), a webhook one, and active.
fn admit_dead_letter(subs: &Subscriptions, dl: &DeadLetterRecord) -> Result<(), RedeliverError> {
    let Some(sub) = subs
        .get(&dl.subscription_id)
        .filter(|s| s.tenant_id == dl.tenant_id)
    else {
        return Err(RedeliverError::Invalid(format!(
            "subscription {} was deleted: nothing would be redelivered",
            dl.subscription_id
        )));
    };
    check_redeliverable(&sub)?;
    inactive_why(&sub).map_err(|why| {
        RedeliverError::Inactive(format!(
            "nothing is redelivered to subscription {id} while {why}: verify it \
             (POST /v1/subscriptions/{id}/verify) or enable it first",
            id = sub.id
        ))
    })
}

/// A recover or redrive that failed on Kafka: `503`, naming the run and what it queued when it
/// stopped partway (a retry queues those again). The broker's words (topics, partitions,
/// addresses) stay in the log and the run's progress, which only operators read: a recover's
/// answer goes to a tenant.
fn stopped(progress: &Mutex<Progress>, e: RedeliverError) -> ApiError {
    let p = finish(progress, Err(e.clone()));
    if p.requested == 0 {
        return unavailable(&e);
    }
    tracing::warn!(run = %p.id, requested = p.requested, error = %e, "operations: a run stopped partway");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        codes::UNAVAILABLE,
        format!(
            "the run {} stopped partway, after queueing {} redeliveries (a retry queues them \
             again); why is in the instance's log",
            p.id, p.requested
        ),
    )
}

/// Records how a run ended. Called where the run ran (its blocking task), not after the
/// handler's await: a client gone before the answer drops the handler, and the run would show
/// `running` for good.
fn finish(p: &Mutex<Progress>, result: Result<(), RedeliverError>) -> Progress {
    let mut g = p.lock().unwrap_or_else(|e| e.into_inner());
    match result {
        Ok(()) => g.state = "done".into(),
        Err(RedeliverError::Cancelled) => {
            g.state = "cancelled".into();
            g.error = Some(RedeliverError::Cancelled.to_string());
        }
        Err(e) => {
            g.state = "failed".into();
            g.error = Some(e.to_string());
        }
    }
    g.clone()
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PullQuery {
    /// The pull subscription to read (required; absent is a `400` naming it).
    #[param(required = true)]
    pub subscription_id: Option<String>,
    /// `next_cursor` of the previous page; absent = from the subscription's creation.
    pub cursor: Option<String>,
    /// Events per page, 1-500 (default 100).
    pub limit: Option<String>,
    /// Admin tokens: the tenant acted for.
    pub tenant_id: Option<String>,
}

impl RecoverRequest {
    /// `since` in epoch milliseconds (400 naming `since` when it is not RFC 3339).
    pub fn since_ms(&self) -> Result<i64, ApiError> {
        parse_time(&self.since, "since")
    }
}

#[utoipa::path(get, path = "/v1/events", tag = "pull", params(PullQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The next events and the cursor after them", body = EventPage),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription", body = ErrorBody),
        (status = 409, description = "`record_unreadable`: its latest control record cannot be read by this instance (written by a newer version of the hub: use an instance that runs that version; or an unreadable one written past the API: write a readable one)", body = ErrorBody),
        (status = 429, description = "Over the tenant's pull rate (`rate_limited`), or as many pull reads as the instance (4) or the tenant (2) runs at once are running (`pull_busy`); see Retry-After", body = ErrorBody),
        (status = 503, description = "Kafka unavailable", body = ErrorBody)))]
pub async fn pull_events(
    State(state): State<ApiState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PullQuery>,
) -> Result<Response, ApiError> {
    let ops = ops(&state)?.clone();
    let tenant = caller.tenant_for(q.tenant_id.as_deref())?;
    if let Err(wait) = ops.limiter.take(&tenant, Instant::now()) {
        let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
        return Ok(too_many(
            "rate_limited",
            format!("pull rate exceeded; retry in {secs} s"),
            secs,
        ));
    }
    let id = q.subscription_id.as_deref().ok_or_else(|| {
        ApiError::bad_request("required", "subscription_id is required")
            .with_field("subscription_id")
    })?;
    // Not found here: it may have been created through another instance a moment ago (a client
    // behind a load balancer reads right after its create), so this instance reads the control
    // topic to its end first, as a read of the subscription does, and looks again. Only then is
    // it `404`; a found one costs no wait.
    let sub = match load(&state, &tenant, id) {
        Err(e) if e.status == StatusCode::NOT_FOUND => {
            synced(&state, false).await?;
            load(&state, &tenant, id)?
        }
        found => found?,
    };
    if sub.destination.kind != DestinationType::Pull {
        return Err(ApiError::bad_request(
            "not_a_pull_subscription",
            "this subscription delivers by webhook",
        )
        .with_field("subscription_id"));
    }
    let limit = parse_limit(q.limit.as_deref(), 100, 500)?;
    let cursor = match q.cursor.as_deref() {
        None | Some("") => None,
        Some(c) => Some(Cursor::decode(c).map_err(|_| {
            ApiError::bad_request("invalid", "cursor is not one this API returned")
                .with_field("cursor")
        })?),
    };
    let created = sub.created_at;
    let sub_id = sub.id.clone();
    let sub_tenant = sub.tenant_id.clone();
    let Some(place) = ops.pull_reads.enter(&tenant, PULL_READ_WAIT).await else {
        ops.limiter.give_back(&tenant);
        return Ok(too_many(
            "pull_busy",
            "as many pull reads as this instance (or this tenant) runs at once are running; \
             retry shortly"
                .into(),
            1,
        ));
    };
    // Read and serialized while the place is held: the page's events are freed before it goes.
    let page = tokio::task::spawn_blocking(move || {
        let _place = place;
        ops.pull
            .read(&sub_id, &sub_tenant, created, cursor, limit)
            .map(|page| serde_json::to_vec(&page))
    })
    .await
    .map_err(|e| ApiError::internal("pull read panicked", &e))?;
    match page {
        Ok(Ok(body)) => Ok((
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response()),
        Ok(Err(e)) => Err(ApiError::internal("pull page not serialized", &e)),
        Err(PullError::BadCursor) => Err(ApiError::bad_request(
            "invalid",
            "cursor does not belong to this subscription",
        )
        .with_field("cursor")),
        Err(e) => Err(unavailable(&e)),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RecoverRequest {
    /// Redeliver what was dead-lettered at or after this time (RFC 3339).
    #[schema(format = DateTime)]
    pub since: String,
    /// Admin tokens: the tenant acted for.
    pub tenant_id: Option<String>,
}

/// The tenant acted for, for admin tokens (or in the body); other parameters ignored.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TenantQuery {
    /// Admin tokens: the tenant acted for.
    pub tenant_id: Option<String>,
}

#[utoipa::path(post, path = "/v1/subscriptions/{id}/recover", tag = "subscriptions",
    request_body = RecoverRequest, security(("bearer" = [])),
    params(("id" = String, Path, description = "Subscription id"), TenantQuery),
    responses(
        (status = 200, description = "Dead-lettered deliveries since then were queued again", body = Progress),
        (status = 429, description = "A recover or replay of this tenant, or as many as this instance runs at once, is running (`recover_running`), or over the tenant's subscription write rate (`rate_limited`, STREAMING_HUB_API_WRITE_RATE); see Retry-After", body = ErrorBody),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription", body = ErrorBody),
        (status = 409, description = "The subscription is disabled or not verified: nothing would be redelivered (`subscription_inactive`); or `record_unreadable`: its latest control record cannot be read by this instance", body = ErrorBody),
        (status = 503, description = "Kafka unavailable, or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn recover(
    State(state): State<ApiState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<TenantQuery>,
    JsonBody(body): JsonBody<RecoverRequest>,
) -> Result<Response, ApiError> {
    // Named in the body or the query (ignored before: an admin token carrying a tenant of its own
    // acted for that one).
    let tenant = caller.tenant_for_either(body.tenant_id.as_deref(), query.tenant_id.as_deref())?;
    synced(&state, false).await?;
    let sub = load(&state, &tenant, &id)?;
    check_redeliverable(&sub)
        .map_err(|e| ApiError::bad_request(codes::NOT_A_WEBHOOK, e.to_string()).with_field("id"))?;
    let since = body.since_ms()?;
    check_active(&sub)?;
    // A recover queues deliveries again, each time it is asked: a write, held to the tenant's
    // write rate like the others (before, nothing but the one-at-a-time gate bounded a loop of
    // them requeueing every dead letter of the window). Given back when nothing runs.
    state.take_write(&caller, &tenant)?;
    let ops = ops(&state)
        .inspect_err(|_| state.give_back_write(&caller, &tenant))?
        .clone();
    let Some(slot) = ops.scans.enter(&tenant) else {
        state.give_back_write(&caller, &tenant);
        return Ok(scans_busy());
    };
    let progress = remember(&ops, "recover", Some(&sub.id));
    let p = progress.clone();
    let (done, result) = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let result = catching_panics(|| ops.redeliver.recover(&sub, since, &p));
        (finish(&p, result.clone()), result)
    })
    .await
    .map_err(|e| ApiError::internal("recover panicked", &e))?;
    match result {
        Err(e @ (RedeliverError::Kafka(_) | RedeliverError::Stopped)) => Err(stopped(&progress, e)),
        Err(e @ RedeliverError::Panicked) => Err(ApiError::internal("recover", &e)),
        _ => Ok(Json(done).into_response()),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    pub subscription_id: String,
    /// Start of the window (RFC 3339), by inbox time.
    #[schema(format = DateTime)]
    pub from: String,
    /// End of the window (RFC 3339, exclusive); default now.
    #[schema(format = DateTime)]
    pub to: Option<String>,
}

impl ReplayRequest {
    /// The window `[from, to)` in epoch milliseconds (`to` defaults to now); 400 naming the field
    /// at fault.
    pub fn window(&self) -> Result<(i64, i64), ApiError> {
        let from = parse_time(&self.from, "from")?;
        let to = match &self.to {
            Some(t) => parse_time(t, "to")?,
            None => chrono::Utc::now().timestamp_millis() + 1,
        };
        if to <= from {
            return Err(ApiError::bad_request("invalid", "to must be after from").with_field("to"));
        }
        Ok((from, to))
    }
}

#[utoipa::path(post, path = "/admin/replay", tag = "admin", request_body = ReplayRequest,
    security(("bearer" = [])),
    responses(
        (status = 202, description = "Replay started; poll /admin/replay/{id}", body = Progress),
        (status = 429, description = "A recover or replay of this tenant, or as many as this instance runs at once, is running (`Retry-After`)", body = ErrorBody),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 403, description = "Not an admin token", body = ErrorBody),
        (status = 404, description = "No such subscription", body = ErrorBody),
        (status = 409, description = "The subscription is disabled or not verified: nothing would be redelivered (`subscription_inactive`); or `record_unreadable`: its latest control record cannot be read by this instance, which would replay to a version the hub holds", body = ErrorBody),
        (status = 503, description = "The subscription table is still loading (a start), or Kafka is unavailable", body = ErrorBody)))]
pub async fn start_replay(
    State(state): State<ApiState>,
    _admin: Admin,
    JsonBody(body): JsonBody<ReplayRequest>,
) -> Result<Response, ApiError> {
    // A table still loading would answer a wrong 404.
    caught_up(&state)?;
    let sub = state
        .subs
        .get(&body.subscription_id)
        .ok_or_else(ApiError::not_found)?;
    let sub = load(&state, &sub.tenant_id, &sub.id)?;
    check_redeliverable(&sub).map_err(|e| {
        ApiError::bad_request(codes::NOT_A_WEBHOOK, e.to_string()).with_field("subscription_id")
    })?;
    let (from, to) = body.window()?;
    check_active(&sub)?;
    let ops = ops(&state)?.clone();
    let Some(slot) = ops.scans.enter(&sub.tenant_id) else {
        return Ok(scans_busy());
    };
    let progress = remember(&ops, "replay", Some(&sub.id));
    let snapshot = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let result = catching_panics(|| ops.redeliver.replay(&sub, from, to, &progress));
        let done = finish(&progress, result);
        tracing::info!(id = %done.id, subscription_id = %sub.id, state = %done.state, requested = done.requested, "per-subscription replay finished");
    });
    let mut r = (StatusCode::ACCEPTED, Json(snapshot.clone())).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("/admin/replay/{}", snapshot.id)) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    Ok(r)
}

#[utoipa::path(get, path = "/admin/replay/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = String, Path, description = "Replay, recover or redrive id")),
    responses(
        (status = 200, description = "Its progress", body = Progress),
        (status = 403, description = "Not an admin token", body = ErrorBody),
        (status = 404, description = "Unknown to this instance", body = ErrorBody)))]
pub async fn replay_status(
    State(state): State<ApiState>,
    _admin: Admin,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Progress>, ApiError> {
    let run = run_of(ops(&state)?, &id)?;
    let p = run.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok(Json(p))
}

/// The run `id` of this instance (runs are kept where they ran).
fn run_of(ops: &Ops, id: &str) -> Result<Arc<Mutex<Progress>>, ApiError> {
    let all = ops.progress.lock().unwrap_or_else(|e| e.into_inner());
    all.get(id).cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::NOT_FOUND,
            "no such replay on this instance",
        )
    })
}

#[utoipa::path(delete, path = "/admin/replay/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = String, Path, description = "Replay id")),
    responses(
        (status = 202, description = "The replay was running: it stops before its next record (the redeliveries it requested before stay queued) and ends `cancelled`, or `done` if it had read its last one; poll GET /admin/replay/{id}", body = Progress),
        (status = 200, description = "It had already ended: nothing to cancel; its progress", body = Progress),
        (status = 403, description = "Not an admin token", body = ErrorBody),
        (status = 404, description = "Unknown to this instance", body = ErrorBody),
        (status = 409, description = "A recover or redrive (`not_cancellable`): it answers its client when it ends", body = ErrorBody)))]
pub async fn cancel_replay(
    State(state): State<ApiState>,
    _admin: Admin,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let run = run_of(ops(&state)?, &id)?;
    let p = run.lock().unwrap_or_else(|e| e.into_inner());
    if p.kind != "replay" {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            codes::NOT_CANCELLABLE,
            "only a replay can be cancelled: a recover or redrive ends with its request",
        ));
    }
    let status = if p.state == "running" {
        p.cancel.store(true, std::sync::atomic::Ordering::SeqCst);
        tracing::info!(id = %p.id, subscription_id = ?p.subscription_id, "per-subscription replay cancelled by an operator");
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(p.clone())).into_response())
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ForensicQuery {
    /// The producer's `ce-source`.
    pub source: Option<String>,
    /// Tenant id (`ce-tenantid`).
    pub tenant: Option<String>,
    /// `x-lerian-dlq-cause-kind` (or the quarantine reason).
    pub cause: Option<String>,
    /// Only records at or after this time (RFC 3339).
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// Only records filed at or before this time (RFC 3339): for the next page, the `filed_at`
    /// of the last record of this one, with `before`.
    #[param(format = DateTime)]
    pub until: Option<String>,
    /// With `until`: `<topic>:<partition>:<offset>` of the last record of the page before; the
    /// next page starts right after it (without it, records of that instant come again).
    pub before: Option<String>,
    /// 1-1000 (default 100).
    pub limit: Option<String>,
}

impl ForensicQuery {
    fn filter(&self) -> Result<Filter, ApiError> {
        Ok(Filter {
            source: self.source.clone(),
            tenant: self.tenant.clone(),
            cause: self.cause.clone(),
            since_ms: self
                .since
                .as_deref()
                .map(|s| parse_time(s, "since"))
                .transpose()?,
            until_ms: self
                .until
                .as_deref()
                .map(|s| parse_time(s, "until"))
                .transpose()?,
            before_id: self.before.clone(),
            limit: parse_limit(self.limit.as_deref(), 100, 1000)?,
            ..Filter::default()
        })
    }
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ForensicPage {
    /// Newest first; ends early (fewer than `limit`) after the record that brings the answer
    /// past 8 MiB of JSON.
    pub records: Vec<ForensicRecord>,
    /// False while this instance's index has not yet read every partition it follows up to
    /// where that partition ended when the index first saw it (after the instance started, a
    /// rebalance of the index's group, a new producer `.dlq` topic): records may be missing from
    /// the page; ask again.
    pub complete: bool,
}

#[utoipa::path(get, path = "/admin/dlq", tag = "admin", params(ForensicQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Producers' dead letters (lerian.streaming.<source>.dlq), newest first", body = ForensicPage),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 403, description = "Not an admin token", body = ErrorBody)))]
pub async fn producer_dlq(
    State(state): State<ApiState>,
    _admin: Admin,
    ApiQuery(q): ApiQuery<ForensicQuery>,
) -> Result<Json<ForensicPage>, ApiError> {
    forensic_page(&state, &q, Forensics::producer_dlq)
}

#[utoipa::path(get, path = "/admin/quarantine", tag = "admin", params(ForensicQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The hub's quarantine, newest first", body = ForensicPage),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 403, description = "Not an admin token", body = ErrorBody)))]
pub async fn quarantine(
    State(state): State<ApiState>,
    _admin: Admin,
    ApiQuery(q): ApiQuery<ForensicQuery>,
) -> Result<Json<ForensicPage>, ApiError> {
    forensic_page(&state, &q, Forensics::quarantine)
}

fn forensic_page(
    state: &ApiState,
    q: &ForensicQuery,
    pick: fn(&Forensics, &Filter) -> Vec<ForensicRecord>,
) -> Result<Json<ForensicPage>, ApiError> {
    let f = q.filter()?;
    let index = &ops(state)?.forensics;
    // Read before the records: a page that says complete holds all that was read by then.
    let complete = index.complete();
    Ok(Json(ForensicPage {
        records: pick(index, &f),
        complete,
    }))
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeadQuery {
    pub tenant: Option<String>,
    pub subscription_id: Option<String>,
    /// `exhausted`, `poison` or `subscription_disabled`.
    pub reason: Option<String>,
    /// Only dead letters at or after this time (RFC 3339).
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// Only dead letters at or before this time (RFC 3339): for the next page, the `dead_at` of
    /// the last one of this page, with `before` (without it, dead letters of that instant come
    /// again; drop those seen by `id`).
    #[param(format = DateTime)]
    pub until: Option<String>,
    /// With `until`: the `id` of the last dead letter of the page before; the next page starts
    /// after it (one transaction's dead letters share their `dead_at`, more than a page of them
    /// when a backlog comes due).
    pub before: Option<String>,
    /// 1-1000 (default 100).
    pub limit: Option<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct DeadPage {
    /// Newest first.
    pub deliveries: Vec<DeadDelivery>,
    /// False while this instance's index has not yet read every partition it follows up to
    /// where that partition ended when the index first saw it (after the instance started, a
    /// rebalance of the index's group, a new producer `.dlq` topic): records may be missing from
    /// the page; ask again.
    pub complete: bool,
}

#[utoipa::path(get, path = "/admin/deliveries/dead", tag = "admin", params(DeadQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Dead deliveries (<prefix>.dlq), newest first", body = DeadPage),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 403, description = "Not an admin token", body = ErrorBody)))]
pub async fn dead_deliveries(
    State(state): State<ApiState>,
    _admin: Admin,
    ApiQuery(q): ApiQuery<DeadQuery>,
) -> Result<Json<DeadPage>, ApiError> {
    let f = Filter {
        tenant: q.tenant,
        subscription_id: q.subscription_id,
        reason: q.reason,
        since_ms: q
            .since
            .as_deref()
            .map(|s| parse_time(s, "since"))
            .transpose()?,
        until_ms: q
            .until
            .as_deref()
            .map(|s| parse_time(s, "until"))
            .transpose()?,
        before_id: q.before,
        limit: parse_limit(q.limit.as_deref(), 100, 1000)?,
        ..Filter::default()
    };
    let index = &ops(&state)?.forensics;
    let complete = index.complete();
    Ok(Json(DeadPage {
        deliveries: index.dead(&f),
        complete,
    }))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    /// Dead delivery ids (`<partition>-<offset>`, from `GET /admin/deliveries/dead`), 1-1000.
    pub ids: Vec<String>,
}

impl RedriveRequest {
    /// The dead letters' (partition, offset) positions, each once, in the order first named; 400
    /// naming `ids` or the id at fault.
    pub fn positions(&self) -> Result<Vec<(i32, i64)>, ApiError> {
        if self.ids.is_empty() || self.ids.len() > 1000 {
            return Err(
                ApiError::bad_request("invalid", "ids holds 1 to 1000 ids").with_field("ids")
            );
        }
        let mut positions = Vec::with_capacity(self.ids.len());
        for (i, id) in self.ids.iter().enumerate() {
            let parsed = id
                .split_once('-')
                .and_then(|(p, o)| Some((p.parse::<i32>().ok()?, o.parse::<i64>().ok()?)))
                .filter(|(p, o)| *p >= 0 && *o >= 0);
            match parsed {
                // Named twice: redriven once.
                Some(pos) if positions.contains(&pos) => {}
                Some(pos) => positions.push(pos),
                None => {
                    return Err(ApiError::bad_request(
                        "invalid",
                        "an id is <partition>-<offset> as GET /admin/deliveries/dead returns it",
                    )
                    .with_field(format!("ids[{i}]")));
                }
            }
        }
        Ok(positions)
    }
}

#[utoipa::path(post, path = "/admin/deliveries/dead/redrive", tag = "admin",
    request_body = RedriveRequest, security(("bearer" = [])),
    responses(
        (status = 200, description = "Queued again", body = Progress),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 403, description = "Not an admin token", body = ErrorBody),
        (status = 409, description = "A dead letter's subscription is disabled or not verified: nothing would be redelivered (`subscription_inactive`); nothing was queued", body = ErrorBody),
        (status = 503, description = "Kafka unavailable, or the subscription table is still loading", body = ErrorBody)))]
pub async fn redrive(
    State(state): State<ApiState>,
    _admin: Admin,
    JsonBody(body): JsonBody<RedriveRequest>,
) -> Result<Json<Progress>, ApiError> {
    let ops = ops(&state)?.clone();
    let positions = body.positions()?;
    caught_up(&state)?;
    let subs = state.subs.clone();
    let progress = remember(&ops, "redrive", None);
    let p = progress.clone();
    let (done, result) = tokio::task::spawn_blocking(move || {
        let result = catching_panics(|| {
            ops.redeliver
                .redrive(&positions, None, &p, |dl| admit_dead_letter(&subs, dl))
        });
        (finish(&p, result.clone()), result)
    })
    .await
    .map_err(|e| ApiError::internal("redrive panicked", &e))?;
    match result {
        Err(
            e @ (RedeliverError::Kafka(_) | RedeliverError::Stopped | RedeliverError::Cancelled),
        ) => Err(stopped(&progress, e)),
        Err(e @ RedeliverError::Panicked) => Err(ApiError::internal("redrive", &e)),
        Err(RedeliverError::Invalid(msg)) => {
            Err(ApiError::bad_request(codes::NOT_FOUND, msg).with_field("ids"))
        }
        Err(RedeliverError::Inactive(msg)) => {
            Err(
                ApiError::new(StatusCode::CONFLICT, codes::SUBSCRIPTION_INACTIVE, msg)
                    .with_field("ids"),
            )
        }
        Ok(()) => Ok(Json(done)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pull_reads_past_the_bounds_wait_or_are_refused() {
        let gate = Arc::new(PullGate::default());
        let short = Duration::from_millis(50);
        // A tenant's third read is refused at once, even with places free.
        let a1 = gate.enter("a", short).await.expect("a's first");
        let a2 = gate.enter("a", short).await.expect("a's second");
        // (Given 60 s to wait: it must not take them.)
        let third = tokio::time::timeout(
            Duration::from_secs(5),
            gate.enter("a", Duration::from_secs(60)),
        );
        assert!(
            third
                .await
                .expect("refused at once, not after waiting")
                .is_none()
        );
        let b1 = gate.enter("b", short).await.expect("b's first");
        let c1 = gate.enter("c", short).await.expect("c's first");
        // Every place taken: one more waits, then none.
        assert!(gate.enter("d", short).await.is_none());
        // A waiting read gets the place a finished one gives back.
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter("d", Duration::from_secs(30)).await.is_some() }
        });
        tokio::task::yield_now().await;
        drop(b1);
        assert!(waiting.await.unwrap(), "woken by the place given back");
        // A tenant's count goes down as its reads end.
        drop(a1);
        let a3 = gate.enter("a", Duration::from_secs(30)).await;
        assert!(a3.is_some(), "a has one running: another is let in");
        drop((a2, c1));
    }

    #[test]
    fn a_running_run_is_kept_while_finished_ones_are_forgotten_oldest_first() {
        let run = |id: &str, state: &str| {
            let p = Progress {
                id: id.into(),
                state: state.into(),
                ..Progress::default()
            };
            (id.to_string(), Arc::new(Mutex::new(p)))
        };
        // Ids sort by age, as UUIDv7s do.
        let mut all: HashMap<_, _> = [
            run("1-replay", "running"),
            run("2-recover", "done"),
            run("3-recover", "failed"),
        ]
        .into_iter()
        .collect();
        make_room(&mut all, 3);
        let mut kept: Vec<_> = all.keys().cloned().collect();
        kept.sort();
        assert_eq!(kept, ["1-replay", "3-recover"], "the oldest finished goes");
        make_room(&mut all, 2);
        assert_eq!(all.keys().collect::<Vec<_>>(), ["1-replay"]);
        // Every one running: the oldest goes after all.
        all.extend([run("4-replay", "running")]);
        make_room(&mut all, 2);
        assert_eq!(all.keys().collect::<Vec<_>>(), ["4-replay"]);
    }

    #[test]
    fn a_run_stopped_partway_names_the_run_not_the_brokers_words() {
        let progress = Mutex::new(Progress {
            id: "run-1".into(),
            requested: 3,
            ..Progress::default()
        });
        let broker = "no record from hub.dlq/3 within 10s (broker 10.0.4.2:9092)";
        let e = stopped(&progress, RedeliverError::Kafka(broker.to_string()));
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(e.message.contains("run-1") && e.message.contains("3 redeliveries"));
        assert!(!e.message.contains("hub.dlq") && !e.message.contains("10.0.4.2"));
        let p = progress.lock().unwrap();
        assert_eq!(p.state, "failed");
        let kept = format!("kafka: {broker}");
        assert_eq!(p.error.as_deref(), Some(kept.as_str()), "operators read it");
    }

    #[test]
    fn a_dead_letter_named_twice_is_redriven_once() {
        let ids = |ids: &[&str]| RedriveRequest {
            ids: ids.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(
            ids(&["0-17", "1-3", "0-17", "1-3", "0-18"])
                .positions()
                .unwrap(),
            vec![(0, 17), (1, 3), (0, 18)]
        );
        assert_eq!(ids(&["0-17"; 1000]).positions().unwrap(), vec![(0, 17)]);
        let bad = ids(&["0-17", "x"]).positions().unwrap_err();
        assert_eq!(bad.field.as_deref(), Some("ids[1]"));
    }

    #[test]
    fn a_tenant_runs_one_recover_at_a_time_and_an_instance_at_most_max_scans() {
        let gate = TenantGate::new(1, MAX_SCANS);
        let a = gate.enter("tenant-a").expect("a first recover runs");
        assert!(gate.enter("tenant-a").is_none(), "a second of one tenant");
        let b = gate.enter("tenant-b").expect("another tenant's runs");
        assert_eq!(MAX_SCANS, 2);
        assert!(
            gate.enter("tenant-c").is_none(),
            "past the instance's bound"
        );
        drop(a);
        assert!(gate.enter("tenant-a").is_some(), "its slot given back");
        let c = gate.enter("tenant-c").expect("a slot is free again");
        drop((b, c));
        assert!(gate.is_idle());
    }
}
