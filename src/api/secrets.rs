//! The API's side of secrets at rest: sealing and opening a subscription's sensitive headers and
//! signing secrets with the KEK, and `POST /v1/subscriptions/{id}/rotate-secret`.
//!
//! Rotation: the new secret goes first in `signing_secrets` with no expiry; the previous current
//! one gets `expires_at = now + grace` (deliveries carry both signatures until then); secrets of
//! earlier rotations that are still in their grace stay, those already expired are dropped. Only
//! the new secret is ever in plaintext, in the response; the others are not even opened. At most
//! [`MAX_LIVE_SECRETS`] are live at once: every delivery carries one signature per live secret, so
//! rotating without end would grow every request's headers (and the control record) without end.
use std::collections::BTreeMap;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

use super::ApiState;
use super::auth::Caller;
use super::errors::{ApiError, ErrorBody, codes};
use super::extract::{ApiPath, ApiQuery, RawBody, SubscriptionQuery, parse_body};
use super::responses::{RotateSecretRequest, RotatedSecret};
use super::subscriptions::{load, synced_writing, view_of};
use crate::runtime::records::{DestinationType, EncryptedBlob, SubscriptionRecord};
use crate::runtime::secret::Secret;
use crate::subscriptions::control::RepoError;
use crate::subscriptions::model::{FieldError, rfc3339};
use crate::subscriptions::sealed_url;
use crate::subscriptions::secrets::{Binding, generate_signing_secret};

/// The longest grace a rotated-out secret may get.
pub const MAX_GRACE: Duration = Duration::from_secs(7 * 86_400);

/// The most signing secrets one subscription holds at once: the current one and those of earlier
/// rotations still in their grace.
pub const MAX_LIVE_SECRETS: usize = 5;

/// Seals a webhook's sensitive headers (a JSON object) for subscription `id` and the `url`
/// requests go to (see [`crate::subscriptions::secrets`]); none → `None`.
pub fn seal_sensitive(
    state: &ApiState,
    id: &str,
    url: &str,
    headers: &BTreeMap<String, String>,
) -> Result<Option<EncryptedBlob>, ApiError> {
    if headers.is_empty() {
        return Ok(None);
    }
    let json = serde_json::to_vec(headers)
        .map_err(|e| ApiError::internal("sensitive headers do not serialize", &e))?;
    Ok(Some(state.kek.seal_bound(&json, id, url)))
}

/// Opens a subscription's sensitive headers (empty when it has none), and how they are bound
/// (to its URL, or to the id alone: sealed before headers were bound to their URL).
pub fn open_sensitive(
    state: &ApiState,
    rec: &SubscriptionRecord,
) -> Result<(BTreeMap<String, String>, Binding), ApiError> {
    let Some(blob) = &rec.destination.sensitive_headers else {
        return Ok((BTreeMap::new(), Binding::Url));
    };
    let url = request_url(state, rec)?;
    // Sealed for another subscription or URL (a record copied on the control topic), or under a
    // key this instance does not have: the caller mends it by sending the headers again.
    let unopened = |why: &dyn std::fmt::Display| {
        tracing::warn!(subscription_id = %rec.id, error = %why, "stored sensitive headers do not open");
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "sealed_headers",
            "the stored sensitive headers do not open for this subscription and URL; send sensitive_headers again",
        )
        .with_field("destination.sensitive_headers")
    };
    let (plain, binding) = state
        .kek
        .open_bound(blob, &rec.id, &url)
        .map_err(|e| unopened(&e))?;
    // Not the parser's error: it quotes the opened text, which would put a header's value in
    // the log.
    let headers = serde_json::from_slice(&plain)
        .map_err(|_| unopened(&"the opened headers are not a map of names to strings"))?;
    Ok((headers, binding))
}

/// The URL requests to `rec`'s webhook go to: its sealed target opened (see
/// [`crate::subscriptions::sealed_url`]). One that does not open here is `422 sealed_url`: the
/// caller mends it by sending `destination.url` again.
pub fn request_url<'a>(
    state: &ApiState,
    rec: &'a SubscriptionRecord,
) -> Result<std::borrow::Cow<'a, str>, ApiError> {
    sealed_url::request_url(Some(&state.kek), &rec.id, &rec.destination).map_err(|e| {
        tracing::warn!(subscription_id = %rec.id, error = %e, "the stored URL's sealed target does not open");
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "sealed_url",
            "the stored URL's sealed path and query do not open for this subscription and URL; send destination.url again",
        )
        .with_field("destination.url")
    })
}

/// The signing secrets that still sign at `now` and open here, current first (as deliveries
/// sign). When live ones exist and none opens (sealed under a key this instance lacks, as in a
/// rolling key rotation), `503 signing_secret_unavailable`: another instance, or this one once it
/// has the key, can sign.
pub fn open_secrets(
    state: &ApiState,
    rec: &SubscriptionRecord,
    now: i64,
) -> Result<Vec<Secret>, ApiError> {
    let live = state
        .kek
        .open_live_secrets(&rec.signing_secrets, &rec.id, now);
    if let (true, Some(e)) = (live.opened.is_empty(), &live.first_error) {
        tracing::warn!(subscription_id = %rec.id, error = %e, "no live signing secret opens");
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "signing_secret_unavailable",
            "no live signing secret of this subscription opens on this instance (sealed under a \
             key-encryption key it lacks); retry later",
        ));
    }
    Ok(live.opened)
}

fn grace_of(state: &ApiState, headers: &HeaderMap, body: &[u8]) -> Result<Duration, ApiError> {
    let request: RotateSecretRequest = if body.iter().all(u8::is_ascii_whitespace) {
        RotateSecretRequest::default()
    } else {
        parse_body(headers, body)?
    };
    let Some(text) = request.grace else {
        return Ok(state.rotation_grace);
    };
    let grace = humantime::parse_duration(text.trim()).map_err(|_| {
        FieldError::new("grace", "invalid", "expected a duration such as 1h or 24h")
    })?;
    if grace > MAX_GRACE {
        return Err(
            FieldError::new("grace", "too_long", "the grace period is at most 7 days").into(),
        );
    }
    Ok(grace)
}

#[utoipa::path(post, path = "/v1/subscriptions/{id}/rotate-secret", tag = "subscriptions",
    request_body(content = Option<RotateSecretRequest>, description = "Optional; default grace from the configuration"),
    params(("id" = String, Path, description = "Subscription id"), SubscriptionQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The new secret, shown this once", body = RotatedSecret),
        (status = 400, description = "Bad `grace`", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription for this tenant", body = ErrorBody),
        (status = 409, description = "A pull destination has no signing secret, or `too_many_secrets`: five are live, wait for the oldest grace to end; or `record_unreadable`: its latest control record cannot be read by this instance", body = ErrorBody),
        (status = 429, description = "Over the tenant's subscription write rate (`rate_limited`, STREAMING_HUB_API_WRITE_RATE); see Retry-After", body = ErrorBody),
        (status = 503, description = "The control topic is unavailable, or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn rotate(
    State(state): State<ApiState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<RotatedSecret>, ApiError> {
    let tenant = caller.tenant_for(query.tenant_id.as_deref())?;
    state.take_write(&caller, &tenant)?;
    synced_writing(&state, &caller, &tenant).await?;
    load(&state, &tenant, &id)?;
    let grace = grace_of(&state, &headers, &body)?;
    let guard = state.writes.clone().lock_owned().await;
    let current = load(&state, &tenant, &id)?;
    if current.destination.kind != DestinationType::Webhook {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            codes::NOT_A_WEBHOOK,
            "only webhook subscriptions have a signing secret",
        ));
    }
    let now = state.clock.now_ms();
    let expires_at = now.saturating_add(grace.as_millis() as i64);
    let secret = generate_signing_secret();
    let mut rec = (*current).clone();
    rec.signing_secrets = std::iter::once(state.kek.seal_secret(&secret, &rec.id, None))
        .chain(
            current
                .signing_secrets
                .iter()
                .filter_map(|s| match s.expires_at {
                    None => Some(crate::runtime::records::EncryptedSecret {
                        expires_at: Some(expires_at),
                        ..s.clone()
                    }),
                    Some(t) if t > now => Some(s.clone()),
                    Some(_) => None,
                }),
        )
        .collect();
    if rec.signing_secrets.len() > MAX_LIVE_SECRETS {
        let first_free = current
            .signing_secrets
            .iter()
            .filter_map(|s| s.expires_at.filter(|t| *t > now))
            .min()
            .unwrap_or(now);
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            codes::TOO_MANY_SECRETS,
            format!(
                "{MAX_LIVE_SECRETS} signing secrets are live (the current one and those still in \
                 their grace); rotate again after {}, when the oldest grace ends",
                rfc3339(first_free)
            ),
        ));
    }
    rec.version += 1;
    rec.updated_at = now;
    // Written but not seen back: the new secret signs once the table has it, so it is answered
    // all the same (a 503 would lose it while its record is on the topic).
    match state.subs.put_holding(rec.clone(), guard).await {
        Ok(()) | Err(RepoError::NotSeen(_)) => {}
        Err(e) => return Err(e.into()),
    }
    tracing::info!(subscription_id = %rec.id, grace_secs = grace.as_secs(), "signing secret rotated");
    Ok(Json(RotatedSecret {
        signing_secret: secret,
        previous_secret_expires_at: rfc3339(expires_at),
        subscription: view_of(&state, &rec),
    }))
}
