//! The verification handshake as the API runs it: on create, on a URL change and on
//! `POST /v1/subscriptions/{id}/verify` (the probe itself is [`crate::delivery::verify::probe`]).
//!
//! State changes, one place ([`probe_and_record`]):
//! - create, or a URL change of a subscription not yet verified ([`Probe::OnChange`]): the
//!   subscription was written `pending`; a pass writes `active`, a failure leaves it `pending`
//!   (the answer says why);
//! - a URL change of an `active` subscription is probed before anything is written
//!   ([`probe_now`], called by the PATCH handler): a pass writes the new URL `active` in one
//!   record, a failure answers `422` and writes nothing. Written `pending` first, its events
//!   matched nothing until the probe passed (only `active` subscriptions match): every event of
//!   the gap was lost, for a quarter of an hour when the new endpoint was not up yet;
//! - `/verify` ([`Probe::Requested`]): a pass writes `active` AND `enabled = true` and clears
//!   `disabled_reason`/`disabled_at` (how an auto-disabled subscription comes back); a failure
//!   answers `422` with the probe's code, and writes `failed` only over `pending` or `failed`: a
//!   destination already verified stays `active`. A failed re-probe (an endpoint mid-deploy) is
//!   no reason to stop matching its events, which would lose them with no dead letter; whether
//!   it is broken is the retry curve's, the breaker's and auto-disable's to judge, from its
//!   deliveries.
//!
//! The probe runs without the write lock. Its result is written onto the subscription as it is
//! after the probe, and only if the destination is still the one probed; a result about a URL
//! that has been replaced (or a deleted subscription) is reported, never written.
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;

use super::ApiState;
use super::auth::Caller;
use super::errors::{ApiError, ErrorBody, codes};
use super::extract::{ApiPath, ApiQuery, SubscriptionQuery};
use super::responses::{CheckedSubscription, VerificationOutcome};
use super::secrets::{open_secrets, open_sensitive, request_url};
use super::subscriptions::{load, synced, synced_writing, view_of};
use crate::delivery::verify::{VerifyError, probe};
use crate::runtime::records::{DestinationType, SubscriptionRecord, VerificationState};
use crate::subscriptions::control::RepoError;

/// Most verification probes the API runs at once on an instance, and per tenant. A probe holds a
/// connection and, while its host name resolves, one of the runtime's blocking threads (the
/// resolver is `getaddrinfo`) for up to the HTTP timeout: without a bound, one tenant's burst of
/// `/verify` calls to a host whose DNS never answers filled the blocking pool that every
/// delivery's lookups share, and healthy receivers' deliveries failed as timeouts.
pub const MAX_PROBES: usize = 32;
pub const MAX_TENANT_PROBES: usize = 4;

/// `429 probe_busy`: the tenant's or the instance's probes are all in use.
fn probes_busy() -> ApiError {
    ApiError::too_many(
        codes::PROBE_BUSY,
        format!(
            "as many verification probes as this tenant ({MAX_TENANT_PROBES}) or this instance \
             ({MAX_PROBES}) runs at once are running; retry shortly"
        ),
        2,
    )
}

/// Why a probe runs, which decides what a result changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    OnChange,
    Requested,
}

/// Sends the probe to `rec`'s destination (pull destinations pass without one).
async fn run(
    state: &ApiState,
    rec: &SubscriptionRecord,
) -> Result<Result<(), VerifyError>, ApiError> {
    if rec.destination.kind == DestinationType::Pull {
        return Ok(Ok(()));
    }
    let secrets = open_secrets(state, rec, state.clock.now_ms())?;
    let mut headers = rec.destination.headers.clone();
    // Headers sealed before they were bound to their URL are not sent (see `secrets`).
    let (sensitive, binding) = open_sensitive(state, rec)?;
    if state.kek.may_send(binding, &rec.id) {
        headers.extend(sensitive);
    }
    let url = request_url(state, rec)?;
    let sinks = state.sinks;
    Ok(probe(
        &state.http,
        &url,
        &headers,
        &secrets,
        sinks.allow_private,
        sinks.allow_insecure,
    )
    .await)
}

/// Probes `rec`'s destination as it is given (written or not), in a place of the probe gate
/// ([`ApiState::probes`]): `429 probe_busy` when it has none. The probe's own failure is the
/// inner result; a secret or sealed value that does not open here is the outer error.
pub async fn probe_now(
    state: &ApiState,
    rec: &SubscriptionRecord,
) -> Result<Result<(), VerifyError>, ApiError> {
    let slot = state.probes.enter(&rec.tenant_id).ok_or_else(probes_busy)?;
    // The probe runs to its end (the HTTP timeout bounds it) holding its place, also when the
    // caller goes away: a client that hung up at once freed the place while its probe, and the
    // host-name lookup on a blocking thread under it, went on.
    let result = {
        let (state, rec) = (state.clone(), rec.clone());
        tokio::spawn(async move {
            let _slot = slot;
            run(&state, &rec).await
        })
        .await
        .map_err(|e| ApiError::internal("verification probe", &e))??
    };
    if let Err(e) = &result {
        tracing::info!(subscription_id = %rec.id, code = e.code(), error = %e, "verification probe failed");
    }
    Ok(result)
}

/// Probes `rec` and records the outcome (see the module doc). Returns the subscription as it now
/// is and the outcome; the probe's error, if any, is in the outcome. `429 probe_busy` when the
/// probe gate ([`ApiState::probes`]) has no place for it.
pub async fn probe_and_record(
    state: &ApiState,
    rec: SubscriptionRecord,
    why: Probe,
) -> Result<(SubscriptionRecord, VerificationOutcome), ApiError> {
    let result = probe_now(state, &rec).await?;
    // What other instances wrote while the probe ran (up to the HTTP timeout) is read first: the
    // verdict is written onto the latest version, not over a rotation or a disable made there.
    synced(state, true).await?;
    let guard = state.writes.clone().lock_owned().await;
    // Not written onto a record whose latest version turned unreadable here meanwhile: what
    // this instance has of it may be stale.
    let unreadable = state.subs.table().read().is_unreadable(&rec.id);
    // Only the caller's tenant's: an id deleted and written again for another tenant (a stale
    // `subscriptions apply` file) while the probe ran is not this caller's to see or change.
    let current = state
        .subs
        .get(&rec.id)
        .filter(|s| s.tenant_id == rec.tenant_id);
    let latest = match current {
        Some(latest) if latest.destination == rec.destination && !unreadable => latest,
        other => {
            let now = other.map(|s| (*s).clone()).unwrap_or(rec);
            return Ok((now.clone(), outcome(now.verification_state, &result)));
        }
    };
    let mut next = (*latest).clone();
    match (&result, why) {
        (Ok(()), Probe::OnChange) => next.verification_state = VerificationState::Active,
        // Re-enabled, unless a write made while the probe ran changed whether it is enabled
        // (a `PATCH {"enabled": false}` answered 200 meanwhile is not undone).
        (Ok(()), Probe::Requested)
            if latest.enabled == rec.enabled && latest.disabled_at == rec.disabled_at =>
        {
            next.verification_state = VerificationState::Active;
            next.enabled = true;
            next.disabled_reason = None;
            next.disabled_at = None;
        }
        (Ok(()), Probe::Requested) => next.verification_state = VerificationState::Active,
        (Err(_), Probe::OnChange) => {}
        (Err(_), Probe::Requested) if latest.verification_state == VerificationState::Active => {}
        (Err(_), Probe::Requested) => next.verification_state = VerificationState::Failed,
    }
    if next != *latest {
        next.version = latest.version + 1;
        next.updated_at = state.clock.now_ms();
        match state.subs.put_holding(next.clone(), guard).await {
            Ok(()) => {}
            // On the control topic, not read back in time: this instance's table has it, and
            // the verdict is answered (a 503 would invite a retry that the If-Match refuses, or
            // a second probe).
            Err(RepoError::NotSeen(waited)) => {
                tracing::warn!(subscription_id = %next.id, waited_secs = waited.as_secs(), "verification verdict written but not seen back");
            }
            Err(e) => return Err(e.into()),
        }
    }
    let state_now = next.verification_state;
    Ok((next, outcome(state_now, &result)))
}

fn outcome(state: VerificationState, result: &Result<(), VerifyError>) -> VerificationOutcome {
    match result {
        Ok(()) => VerificationOutcome {
            state: state.into(),
            error_code: None,
            message: None,
        },
        Err(e) => VerificationOutcome {
            state: state.into(),
            error_code: Some(e.code().to_string()),
            message: Some(e.to_string()),
        },
    }
}

#[utoipa::path(post, path = "/v1/subscriptions/{id}/verify", tag = "subscriptions",
    params(("id" = String, Path, description = "Subscription id"), SubscriptionQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Probe passed: `active` and `enabled` (re-enables an auto-disabled subscription)",
            body = CheckedSubscription),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription for this tenant", body = ErrorBody),
        (status = 409, description = "`record_unreadable`: its latest control record cannot be read by this instance (written by a newer version of the hub: use an instance that runs that version; or an unreadable one written past the API: write a readable one)", body = ErrorBody),
        (status = 422, description = "Probe failed (code: `challenge_missing`, `bad_status`, `connect_failed`, \
            `timeout`, `redirect`, …); a subscription not yet verified is now `failed`, an `active` one stays `active`. Or no probe: the stored sealed headers or URL \
            do not open here (`sealed_headers`, `sealed_url`): send them again", body = ErrorBody),
        (status = 429, description = "Over the tenant's subscription write rate (`rate_limited`, STREAMING_HUB_API_WRITE_RATE), or as many probes as the tenant (4) or the instance (32) runs at once are running (`probe_busy`); see Retry-After", body = ErrorBody),
        (status = 503, description = "The control topic is unavailable, or no live signing secret opens on this instance (`signing_secret_unavailable`), or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn verify(
    State(state): State<ApiState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
) -> Result<Json<CheckedSubscription>, ApiError> {
    let tenant = caller.tenant_for(query.tenant_id.as_deref())?;
    state.take_write(&caller, &tenant)?;
    synced_writing(&state, &caller, &tenant).await?;
    let current = load(&state, &tenant, &id)?;
    let (rec, outcome) = match probe_and_record(&state, (*current).clone(), Probe::Requested).await
    {
        // Refused before any probe: it costs the tenant none of its write rate.
        Err(e) if e.code == codes::PROBE_BUSY => {
            state.give_back_write(&caller, &tenant);
            return Err(e);
        }
        other => other?,
    };
    if let Some(code) = &outcome.error_code {
        let message = outcome.message.clone().unwrap_or_default();
        return Err(
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
                .with_field("destination.url"),
        );
    }
    tracing::info!(subscription_id = %rec.id, "subscription verified");
    Ok(Json(CheckedSubscription {
        subscription: view_of(&state, &rec),
        verification: Some(outcome),
    }))
}
