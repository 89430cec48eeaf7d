//! `/v1/subscriptions`: create, list, read, update and delete a tenant's subscriptions.
//!
//! Tenant isolation is structural: every handler takes a [`Caller`], turns it into the one tenant
//! it acts for ([`Caller::tenant_for`]) and reads subscriptions only through [`load`], which takes
//! that tenant and answers `404` for another tenant's id exactly as for an unknown one.
//!
//! Writes go through [`Subscriptions::put`]/[`Subscriptions::delete`], which return once this
//! instance's table has the write. A read-modify-write runs under `ApiState::writes` so two
//! requests of this instance cannot both write version N+1 (writers elsewhere still race; the
//! control topic keeps the last). The lock is never held across a verification probe; it is held
//! across the write itself, which is fine off the hot path (API writes are rare).
//!
//! [`Subscriptions::put`]: crate::subscriptions::control::Subscriptions::put
//! [`Subscriptions::delete`]: crate::subscriptions::control::Subscriptions::delete
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::ApiState;
use super::auth::Caller;
use super::errors::{ApiError, ErrorBody, codes};
use super::extract::{ApiPath, ApiQuery, JsonBody, SubscriptionQuery, if_match};
use super::responses::{
    CheckedSubscription, CreatedSubscription, SubscriptionPage, VerificationOutcome,
};
use super::secrets::{open_sensitive, request_url, seal_sensitive};
use super::verification::{Probe, probe_and_record, probe_now};
use crate::runtime::records::{
    DestinationRecord, DestinationType, SubscriptionRecord, VerificationState,
};
use crate::subscriptions::control::{RepoError, SyncError};
use crate::subscriptions::model::{
    CreateSubscription, DestinationPatch, FieldError, PatchSubscription, SubscriptionView,
    ValidDestination, check_schema_major, check_webhook_url, parse_retry_schedule, refuse_redacted,
    validate_event_types, validate_header_map, validate_header_sets, validate_origin,
};
use crate::subscriptions::sealed_url;
use crate::subscriptions::secrets::generate_signing_secret;
use crate::subscriptions::table::Sub;

/// `503` until this instance's subscription table has read the whole control topic (a start):
/// until then a subscription may be missing or at an old version, so an answer would be wrong
/// and a write made from it could undo a newer one (a rotated secret, a patch).
pub fn caught_up(state: &ApiState) -> Result<(), ApiError> {
    if state.subs.table().is_caught_up() {
        return Ok(());
    }
    Err(ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        super::errors::codes::UNAVAILABLE,
        "the subscription table is still loading; retry shortly",
    ))
}

/// How long a request waits for this instance's table to reach the control topic's end.
pub const SYNC_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Before a request answers from this instance's table or writes over what it holds: the table
/// reads the control topic up to where it ends now ([`Subscriptions::sync`]), so a write any
/// instance acknowledged is seen here (read-your-writes through a load balancer, and no PATCH
/// made from a version older than the latest). `503 table_behind` (`Retry-After`) when it does
/// not get there within [`SYNC_WAIT`], or when this instance's lookups of the end were all in
/// use that long. When the broker cannot say where the topic ends, a read answers from the
/// table as it is (with a WARN), and a write, which needs the broker anyway, is a `503`.
///
/// [`Subscriptions::sync`]: crate::subscriptions::control::Subscriptions::sync
pub async fn synced(state: &ApiState, writing: bool) -> Result<(), ApiError> {
    caught_up(state)?;
    match state.subs.sync(SYNC_WAIT).await {
        Ok(()) => Ok(()),
        Err(SyncError::Unavailable(e)) if !writing => {
            tracing::warn!(error = %e, "control topic's end unknown; answered from this instance's table");
            Ok(())
        }
        // The broker's words go to the log, not to the tenant.
        Err(e @ SyncError::Unavailable(_)) => {
            tracing::warn!(error = %e, "control topic's end unknown; a write answered 503");
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::UNAVAILABLE,
                "the subscription store is unavailable; retry later",
            ))
        }
        Err(e @ (SyncError::Behind(_) | SyncError::Busy)) => {
            metrics::counter!(TABLE_BEHIND).increment(1);
            tracing::warn!(error = %e, "answered 503 table_behind");
            Err(ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    codes::TABLE_BEHIND,
                    format!("{e}; retry (another instance may answer)"),
                )
            })
        }
    }
}

/// [`synced`] for a write whose rate token `caller` has taken: given back when it fails (no
/// write was made).
pub async fn synced_writing(
    state: &ApiState,
    caller: &Caller,
    tenant: &str,
) -> Result<(), ApiError> {
    synced(state, true)
        .await
        .inspect_err(|_| state.give_back_write(caller, tenant))
}

/// Requests answered `503 table_behind`: this instance's control reader lags the topic.
pub const TABLE_BEHIND: &str = "streaming_hub_api_table_behind_total";

/// The tenant's subscription `id`, or `404` (`503` while the table loads; `409
/// record_unreadable` when its latest control record cannot be read here: what this instance
/// has of it may be stale, and a write from it would undo the newer one).
pub fn load(state: &ApiState, tenant: &str, id: &str) -> Result<Sub, ApiError> {
    caught_up(state)?;
    let sub = state
        .subs
        .get(id)
        .filter(|s| s.tenant_id == tenant)
        .ok_or_else(ApiError::not_found)?;
    if state.subs.table().read().is_unreadable(id) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            codes::RECORD_UNREADABLE,
            "this subscription's latest record cannot be read by this instance: written by a \
             newer version of the hub (use an instance that runs that version), or an unreadable \
             one written past the API, too large or undecodable (write a readable one; \
             streaming_hub_control_records_skipped_total has the reason)",
        ));
    }
    Ok(sub)
}

/// The view of `rec`, with the names of its sealed headers.
pub fn view_of(state: &ApiState, rec: &SubscriptionRecord) -> SubscriptionView {
    let names = match open_sensitive(state, rec) {
        Ok((map, _)) => map.into_keys().collect(),
        Err(e) => {
            tracing::warn!(subscription_id = %rec.id, error = %e.message, "sensitive headers do not open; shown without names");
            Vec::new()
        }
    };
    SubscriptionView::of(rec, names)
}

fn etag(version: u64) -> [(header::HeaderName, HeaderValue); 1] {
    [(
        header::ETAG,
        HeaderValue::from_str(&format!("\"{version}\"")).expect("digits are a valid header value"),
    )]
}

#[utoipa::path(post, path = "/v1/subscriptions", tag = "subscriptions", request_body = CreateSubscription,
    params(SubscriptionQuery), security(("bearer" = [])),
    responses(
        (status = 201, description = "Created; webhooks were probed before this answer, unless the tenant's or the instance's probes were all in use (`verification.error_code` `probe_deferred`: probed in the background)", body = CreatedSubscription),
        (status = 202, description = "Written to the control topic but not yet visible to this instance (no probe yet: the background retrier probes it); the signing secret is in this answer all the same", body = CreatedSubscription),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 409, description = "The tenant has as many subscriptions as the hub allows (`subscription_limit`), or as many pull subscriptions (`subscription_limit`, field `destination.type`: STREAMING_HUB_MAX_PULL_SUBSCRIPTIONS_PER_TENANT)", body = ErrorBody),
        (status = 415, description = "Body is not JSON", body = ErrorBody),
        (status = 429, description = "Over the tenant's subscription write rate (`rate_limited`, STREAMING_HUB_API_WRITE_RATE); see Retry-After", body = ErrorBody),
        (status = 503, description = "The control topic is unavailable", body = ErrorBody)))]
pub async fn create(
    State(state): State<ApiState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
    JsonBody(body): JsonBody<CreateSubscription>,
) -> Result<Response, ApiError> {
    // The tenant may be named in the body or the query, as on every other route; named in both,
    // the two must agree. (The query was ignored here: an admin token carrying a tenant of its
    // own created the subscription for that tenant, not the one the query named.)
    let tenant = caller.tenant_for_either(body.tenant_id.as_deref(), query.tenant_id.as_deref())?;
    state.take_write(&caller, &tenant)?;
    caught_up(&state)?;
    let most = state.max_subscriptions_per_tenant;
    if most > 0 && state.subs.list(&tenant).len() >= most {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            codes::SUBSCRIPTION_LIMIT,
            format!(
                "the tenant has {most} subscriptions, the most this hub allows \
                 (STREAMING_HUB_MAX_SUBSCRIPTIONS_PER_TENANT): delete one first"
            ),
        ));
    }
    let valid = body.validate(state.sinks).await?;
    let id = uuid::Uuid::now_v7().to_string();
    let now = state.clock.now_ms();
    let (destination, secret) = match valid.destination {
        ValidDestination::Webhook {
            url,
            headers,
            sensitive_headers,
        } => {
            refuse_redacted(&url)?;
            let stored = sealed_url::seal(&state.kek, &id, &url);
            let sealed = seal_sensitive(&state, &id, &url, &sensitive_headers)?;
            let destination = DestinationRecord {
                kind: DestinationType::Webhook,
                url: Some(stored.url),
                headers,
                sensitive_headers: sealed,
                sealed_target: stored.sealed_target,
            };
            let secret = valid.signing_secret.unwrap_or_else(generate_signing_secret);
            (destination, Some(secret))
        }
        ValidDestination::Pull => {
            // Each pull subscription keeps its own copy of what it matches on the pull topic.
            let most = state.max_pull_subscriptions_per_tenant;
            let pulls = || {
                let subs = state.subs.list(&tenant);
                subs.iter()
                    .filter(|s| s.destination.kind == DestinationType::Pull)
                    .count()
            };
            if most > 0 && pulls() >= most {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    codes::SUBSCRIPTION_LIMIT,
                    format!(
                        "the tenant has {most} pull subscriptions, the most this hub allows \
                         (STREAMING_HUB_MAX_PULL_SUBSCRIPTIONS_PER_TENANT; each keeps its own \
                         copy of the events it matches): delete one, or widen one's filter"
                    ),
                )
                .with_field("destination.type"));
            }
            let destination = DestinationRecord {
                kind: DestinationType::Pull,
                url: None,
                headers: Default::default(),
                sensitive_headers: None,
                sealed_target: None,
            };
            (destination, None)
        }
    };
    let rec = SubscriptionRecord {
        signing_secrets: secret
            .iter()
            .map(|s| state.kek.seal_secret(s, &id, None))
            .collect(),
        verification_state: if secret.is_some() {
            VerificationState::Pending
        } else {
            VerificationState::Active
        },
        id,
        tenant_id: tenant,
        origin: valid.origin,
        event_types: valid.event_types,
        schema_major: valid.schema_major,
        destination,
        enabled: valid.enabled,
        retry_schedule: valid.retry_schedule,
        disabled_reason: None,
        disabled_at: None,
        created_at: now,
        updated_at: now,
        version: 1,
    };
    // On the control topic but not in this instance's table yet: the subscription exists, so its
    // secret is answered now (a 503 would lose it and invite a duplicate create), with a `202`;
    // the background retrier probes it once the table has it.
    let status = match state.subs.put(rec.clone()).await {
        Ok(()) => StatusCode::CREATED,
        Err(RepoError::NotSeen(waited)) => {
            tracing::warn!(subscription_id = %rec.id, waited_secs = waited.as_secs(), "subscription written but not seen back; answered 202");
            StatusCode::ACCEPTED
        }
        Err(e) => return Err(e.into()),
    };
    tracing::info!(subscription_id = %rec.id, tenant_id = %rec.tenant_id, "subscription created");
    let (rec, verification) = match (rec.destination.kind, status) {
        // Version 1 is written: whatever becomes of the verdict's write, the caller gets the
        // secret (the retrier probes a subscription left `pending`).
        (DestinationType::Webhook, StatusCode::CREATED) => probe_after_write(&state, rec).await,
        (DestinationType::Webhook, _) => (rec, VerificationOutcome::not_yet_visible()),
        (DestinationType::Pull, _) => (rec, VerificationOutcome::passed()),
    };
    let location = HeaderValue::from_str(&format!("/v1/subscriptions/{}", rec.id))
        .expect("a UUID is a valid header value");
    let body = CreatedSubscription {
        subscription: view_of(&state, &rec),
        signing_secret: secret,
        verification,
    };
    Ok((
        status,
        etag(rec.version),
        [(header::LOCATION, location)],
        Json(body),
    )
        .into_response())
}

#[utoipa::path(get, path = "/v1/subscriptions", tag = "subscriptions", params(SubscriptionQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "One page of the tenant's subscriptions", body = SubscriptionPage),
        (status = 400, description = "Bad `limit`, or an admin token without `tenant_id`", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 503, description = "The subscription table is still loading (a start), or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn list(
    State(state): State<ApiState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
) -> Result<Json<SubscriptionPage>, ApiError> {
    let tenant = caller.tenant_for(query.tenant_id.as_deref())?;
    let limit = query.limit()?;
    synced(&state, false).await?;
    let after = query.cursor.as_deref().unwrap_or("");
    let mut rest = state
        .subs
        .list(&tenant)
        .into_iter()
        .filter(|s| s.id.as_str() > after);
    let data: Vec<SubscriptionView> = rest
        .by_ref()
        .take(limit)
        .map(|s| view_of(&state, &s))
        .collect();
    let next_cursor = match rest.next() {
        Some(_) => data.last().map(|v| v.id.clone()),
        None => None,
    };
    Ok(Json(SubscriptionPage { data, next_cursor }))
}

#[utoipa::path(get, path = "/v1/subscriptions/{id}", tag = "subscriptions",
    params(("id" = String, Path, description = "Subscription id"), SubscriptionQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The subscription; `ETag` is its version", body = SubscriptionView),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription for this tenant", body = ErrorBody),
        (status = 409, description = "`record_unreadable`: its latest control record cannot be read by this instance (written by a newer version of the hub: use an instance that runs that version; or an unreadable one written past the API: write a readable one)", body = ErrorBody),
        (status = 503, description = "The subscription table is still loading (a start), or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn get_one(
    State(state): State<ApiState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
) -> Result<Response, ApiError> {
    let tenant = caller.tenant_for(query.tenant_id.as_deref())?;
    synced(&state, false).await?;
    let sub = load(&state, &tenant, &id)?;
    Ok((etag(sub.version), Json(view_of(&state, &sub))).into_response())
}

/// A [`PatchSubscription`] whose parts passed the rules that need no stored state.
struct ValidPatch {
    patch: PatchSubscription,
    event_types: Option<Vec<String>>,
    retry_schedule: Option<Option<Vec<u64>>>,
    url: Option<String>,
}

async fn validate_patch(
    state: &ApiState,
    patch: PatchSubscription,
) -> Result<ValidPatch, FieldError> {
    if let Some(Some(o)) = &patch.origin {
        validate_origin(o)?;
    }
    check_schema_major(patch.schema_major.flatten())?;
    let event_types = patch
        .event_types
        .as_deref()
        .map(validate_event_types)
        .transpose()?;
    let retry_schedule = match &patch.retry_schedule {
        Some(steps) => Some(steps.as_deref().map(parse_retry_schedule).transpose()?),
        None => None,
    };
    let mut url = None;
    if let Some(DestinationPatch::Webhook { url: Some(u), .. }) = &patch.destination {
        url = Some(check_webhook_url(u, state.sinks).await?);
    }
    Ok(ValidPatch {
        patch,
        event_types,
        retry_schedule,
        url,
    })
}

/// Applies a validated patch to a copy of `current`; `true` when the URL changed.
fn apply(
    state: &ApiState,
    current: &SubscriptionRecord,
    p: ValidPatch,
) -> Result<(SubscriptionRecord, bool), ApiError> {
    let mut rec = current.clone();
    if let Some(origin) = p.patch.origin {
        rec.origin = origin;
    }
    if let Some(types) = p.event_types {
        rec.event_types = types;
    }
    if let Some(major) = p.patch.schema_major {
        rec.schema_major = major;
    }
    if let Some(steps) = p.retry_schedule {
        rec.retry_schedule = steps;
    }
    if let Some(enabled) = p.patch.enabled {
        if enabled && !rec.enabled {
            rec.disabled_reason = None;
            rec.disabled_at = None;
        }
        rec.enabled = enabled;
    }
    let mut url_changed = false;
    match (p.patch.destination, rec.destination.kind) {
        (None, _) | (Some(DestinationPatch::Pull {}), DestinationType::Pull) => {}
        (
            Some(DestinationPatch::Webhook {
                headers,
                sensitive_headers,
                ..
            }),
            DestinationType::Webhook,
        ) => {
            if let Some(h) = headers {
                rec.destination.headers = validate_header_map("headers", &h)?;
            }
            let sensitive = match &sensitive_headers {
                Some(s) => validate_header_map("sensitive_headers", s)?,
                // Bound to a URL that does not open here: a `422 sealed_url` asking for the URL
                // would answer a caller who just sent it; the headers are what is missing.
                None if rec.destination.sensitive_headers.is_some()
                    && request_url(state, &rec).is_err() =>
                {
                    return Err(ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "sealed_headers",
                        "the stored sensitive headers are bound to the stored URL, whose sealed \
                         path and query do not open on this instance; send destination.url and \
                         sensitive_headers again",
                    )
                    .with_field("destination.sensitive_headers"));
                }
                None => open_sensitive(state, &rec)?.0,
            };
            validate_header_sets(&rec.destination.headers, &sensitive)?;
            // A URL sent back as shown (redacted), or as given, is no change.
            let kek = Some(&*state.kek);
            let same = |u: &String| sealed_url::names_stored(kek, &rec.id, &rec.destination, u);
            match p.url {
                Some(url) if !same(&url) => {
                    refuse_redacted(&url)?;
                    let stored = sealed_url::seal(&state.kek, &rec.id, &url);
                    rec.destination.url = Some(stored.url);
                    rec.destination.sealed_target = stored.sealed_target;
                    rec.verification_state = VerificationState::Pending;
                    url_changed = true;
                }
                // The same URL: its sealed target moves to the current key (a KEK rotation), nothing
                // else changes.
                Some(_) => {
                    if let Ok(Some(moved)) =
                        sealed_url::under_current_key(&state.kek, &rec.id, &rec.destination)
                    {
                        rec.destination.sealed_target = Some(moved);
                    }
                }
                None => {}
            }
            // Sealed again when they change and when the URL they are bound to changes (the
            // caller's URL: headers sealed before that binding, by the id alone, are bound to it
            // then). A PATCH of anything else leaves them as they are: binding old headers to
            // whatever URL the record names now would bind them to one someone else wrote.
            // Write-only credentials never follow the URL to another receiver: a token that may
            // PATCH would otherwise read them from its own receiver's verification probe. Moved
            // to another origin or path, they are sent again (`{}` drops them): one host serves
            // many unrelated receivers, told apart by their path (`webhook.site/<uuid>`,
            // Zapier's and Make's hooks). A change of the query alone keeps them.
            if url_changed && sensitive_headers.is_none() && !sensitive.is_empty() {
                let before = receiver(&request_url(state, current)?);
                let moved = match (before, receiver(&request_url(state, &rec)?)) {
                    (Some(before), Some(after)) => before != after,
                    _ => true,
                };
                if moved {
                    let e = FieldError::new(
                        "destination.sensitive_headers",
                        "required",
                        "the URL moves to another host or path: send the sensitive headers \
                         again for it (`{}` drops them); they never follow the URL to a \
                         receiver they were not given for",
                    );
                    return Err(e.into());
                }
            }
            if sensitive_headers.is_some() || url_changed {
                let url = request_url(state, &rec)?.into_owned();
                rec.destination.sensitive_headers =
                    seal_sensitive(state, &rec.id, &url, &sensitive)?;
            }
        }
        _ => {
            let e = FieldError::new(
                "destination.type",
                "immutable",
                "the destination type cannot change; create a new subscription",
            );
            return Err(e.into());
        }
    }
    Ok((rec, url_changed))
}

/// A URL's scheme, host, port and path: who receives what is sent to it.
fn receiver(url: &str) -> Option<String> {
    let url = reqwest::Url::parse(url).ok()?;
    let origin = url.origin();
    origin
        .is_tuple()
        .then(|| format!("{}{}", origin.ascii_serialization(), url.path()))
}

#[utoipa::path(patch, path = "/v1/subscriptions/{id}", tag = "subscriptions", request_body = PatchSubscription,
    params(("id" = String, Path, description = "Subscription id"),
        ("If-Match" = Option<String>, Header, description = "Apply only if the version is this one"), SubscriptionQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Updated. A new URL of an `active` webhook was probed first and written `active` (the old URL took the events until then); a new URL of one not yet verified is written `pending` and probed before this answer, unless the tenant's or the instance's probes were all in use (`verification.error_code` `probe_deferred`: probed in the background)", body = CheckedSubscription),
        (status = 202, description = "Written to the control topic but not yet visible to this instance (a new URL of a webhook not yet verified is probed in the background); the body is the version written", body = CheckedSubscription),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription for this tenant", body = ErrorBody),
        (status = 409, description = "`record_unreadable`: its latest control record cannot be read by this instance (written by a newer version of the hub: use an instance that runs that version; or an unreadable one written past the API: write a readable one). Or `changed_meanwhile`: another write changed the subscription while its new URL was probed; nothing was written", body = ErrorBody),
        (status = 412, description = "`If-Match` names another version", body = ErrorBody),
        (status = 422, description = "A webhook `destination` sent without `sensitive_headers` while the stored ones do not open here (`sealed_headers`, field `destination.sensitive_headers`): send them again. Or the new URL of an `active` webhook failed its verification probe (the probe's code: `challenge_missing`, `bad_status`, `connect_failed`, `timeout`, …; field `destination.url`): nothing was written, the current URL keeps receiving", body = ErrorBody),
        (status = 429, description = "Over the tenant's subscription write rate (`rate_limited`, STREAMING_HUB_API_WRITE_RATE), or, for a new URL of an `active` webhook, as many probes as the tenant (4) or the instance (32) runs at once are running (`probe_busy`); see Retry-After", body = ErrorBody),
        (status = 503, description = "The control topic is unavailable; or, for a new URL of an `active` webhook, no live signing secret opens on this instance to sign its probe (`signing_secret_unavailable`), or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn patch(
    State(state): State<ApiState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<PatchSubscription>,
) -> Result<Response, ApiError> {
    let tenant = caller.tenant_for(query.tenant_id.as_deref())?;
    state.take_write(&caller, &tenant)?;
    synced_writing(&state, &caller, &tenant).await?;
    let expected = if_match(&headers)?;
    load(&state, &tenant, &id)?;
    let valid = validate_patch(&state, body).await?;
    let mut guard = state.writes.clone().lock_owned().await;
    let current = load(&state, &tenant, &id)?;
    check_version(expected, &current)?;
    let (mut rec, url_changed) = apply(&state, &current, valid)?;
    // A verified webhook moving to a new URL: the new URL is probed first and the change written
    // only once it passed, `active` (see `verification`'s module doc). Until then the old URL
    // keeps taking the events; written `pending` first, they matched nothing meanwhile.
    let verified_first = url_changed && current.verification_state == VerificationState::Active;
    if verified_first {
        drop(guard); // the probe takes up to the HTTP timeout; other writes go on meanwhile
        let result = match probe_now(&state, &rec).await {
            // Refused before any probe: it costs the tenant none of its write rate.
            Err(e) if e.code == codes::PROBE_BUSY => {
                state.give_back_write(&caller, &tenant);
                return Err(e);
            }
            other => other?,
        };
        if let Err(e) = result {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                e.code(),
                format!(
                    "the new URL's verification probe failed ({e}); nothing was changed and the \
                     current URL keeps receiving the events: make the new endpoint answer the \
                     challenge, then send the change again"
                ),
            )
            .with_field("destination.url"));
        }
        // What other instances wrote while the probe ran (up to the HTTP timeout) is read
        // first: the check below sees only this instance's table.
        synced_writing(&state, &caller, &tenant).await?;
        guard = state.writes.clone().lock_owned().await;
        if load(&state, &tenant, &id)? != current {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                codes::CHANGED_MEANWHILE,
                "the subscription was changed while the new URL was probed: nothing was \
                 written; read it and send the change again",
            ));
        }
        rec.verification_state = VerificationState::Active;
    }
    if rec == *current {
        return Ok((
            etag(rec.version),
            Json(CheckedSubscription {
                subscription: view_of(&state, &rec),
                verification: None,
            }),
        )
            .into_response());
    }
    rec.version = current.version + 1;
    rec.updated_at = state.clock.now_ms();
    // The lock is given back when the write ends (the probe below runs without it).
    match state.subs.put_holding(rec.clone(), guard).await {
        Ok(()) => {}
        // The broker has it: a 503 would invite a retry that its own If-Match then refuses.
        Err(RepoError::NotSeen(waited)) => {
            tracing::warn!(subscription_id = %rec.id, waited_secs = waited.as_secs(), "subscription update written but not seen back; answered 202");
            // A new URL of an active webhook was probed and written `active`: nothing is left
            // for the background.
            let verification = if verified_first {
                Some(VerificationOutcome::of_state(VerificationState::Active))
            } else {
                url_changed.then(VerificationOutcome::not_yet_visible)
            };
            return Ok((
                StatusCode::ACCEPTED,
                etag(rec.version),
                Json(CheckedSubscription {
                    subscription: view_of(&state, &rec),
                    verification,
                }),
            )
                .into_response());
        }
        Err(e) => return Err(e.into()),
    }
    let (rec, verification) = if verified_first {
        (
            rec,
            Some(VerificationOutcome::of_state(VerificationState::Active)),
        )
    } else if url_changed {
        let (rec, outcome) = probe_after_write(&state, rec).await;
        (rec, Some(outcome))
    } else {
        (rec, None)
    };
    Ok((
        etag(rec.version),
        Json(CheckedSubscription {
            subscription: view_of(&state, &rec),
            verification,
        }),
    )
        .into_response())
}

/// `If-Match` against the version this instance has: `412 version_mismatch` naming it.
fn check_version(expected: Option<u64>, current: &SubscriptionRecord) -> Result<(), ApiError> {
    match expected {
        Some(v) if v != current.version => Err(ApiError::new(
            StatusCode::PRECONDITION_FAILED,
            codes::VERSION_MISMATCH,
            format!("the subscription is at version {}", current.version),
        )
        .with_field("If-Match")),
        _ => Ok(()),
    }
}

#[utoipa::path(delete, path = "/v1/subscriptions/{id}", tag = "subscriptions",
    params(("id" = String, Path, description = "Subscription id"),
        ("If-Match" = Option<String>, Header, description = "Delete only if the version is this one"), SubscriptionQuery),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Deleted; no further deliveries are created"),
        (status = 400, description = "Invalid input; `field` names it", body = ErrorBody),
        (status = 401, description = "Missing, forged or expired token", body = ErrorBody),
        (status = 404, description = "No such subscription for this tenant", body = ErrorBody),
        (status = 409, description = "Written again after the deletion, by the hub (an auto-disable) or another client: not deleted (`written_again`); or `record_unreadable`: its latest control record cannot be read by this instance", body = ErrorBody),
        (status = 412, description = "`If-Match` names another version", body = ErrorBody),
        (status = 429, description = "Over the tenant's subscription write rate (`rate_limited`, STREAMING_HUB_API_WRITE_RATE); see Retry-After", body = ErrorBody),
        (status = 503, description = "The control topic is unavailable, or behind (`table_behind`, `Retry-After`: this instance's subscription table did not reach the control topic's end within 5 s)", body = ErrorBody)))]
pub async fn delete(
    State(state): State<ApiState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<SubscriptionQuery>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let tenant = caller.tenant_for(query.tenant_id.as_deref())?;
    state.take_write(&caller, &tenant)?;
    synced_writing(&state, &caller, &tenant).await?;
    let expected = if_match(&headers)?;
    let guard = state.writes.clone().lock_owned().await;
    let sub = load(&state, &tenant, &id)?;
    check_version(expected, &sub)?;
    match state.subs.delete_holding(&sub.id, guard).await {
        // The tombstone is on the control topic: deleted, whenever this instance shows it.
        Ok(()) | Err(RepoError::NotSeen(_)) => {}
        Err(e) => return Err(e.into()),
    }
    tracing::info!(subscription_id = %sub.id, tenant_id = %tenant, "subscription deleted");
    Ok(StatusCode::NO_CONTENT)
}

/// Probes a destination just written (`rec`, seen back) and records the verdict. The write is
/// done whatever becomes of the probe or of the verdict's write: an error there is not the
/// caller's (a 5xx would invite a retry its own `If-Match` then refuses), so the answer is what
/// this instance has, with an `unrecorded` verification when the verdict is not in its table
/// (the background retrier probes a subscription left `pending`).
async fn probe_after_write(
    state: &ApiState,
    rec: SubscriptionRecord,
) -> (SubscriptionRecord, VerificationOutcome) {
    match probe_and_record(state, rec.clone(), Probe::OnChange).await {
        Ok(done) => done,
        // No probe now: the record stays `pending`, and the background retrier probes it.
        Err(e) if e.code == super::errors::codes::PROBE_BUSY => {
            (rec, VerificationOutcome::deferred())
        }
        Err(e) => {
            tracing::warn!(subscription_id = %rec.id, code = %e.code, "verification verdict not confirmed; answered with what this instance has");
            // Written but not seen back: this instance's table has the verdict (the caller's
            // tenant's only: an id written again for another tenant is not this caller's).
            match state
                .subs
                .get(&rec.id)
                .filter(|s| s.tenant_id == rec.tenant_id)
            {
                Some(now) if now.version > rec.version => {
                    let state_now = now.verification_state;
                    ((*now).clone(), VerificationOutcome::of_state(state_now))
                }
                _ => (rec, VerificationOutcome::unrecorded()),
            }
        }
    }
}
