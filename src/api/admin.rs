//! Admin endpoints. `POST /admin/clock/advance {"by":"5h"}` moves the hub's virtual clock; it
//! exists only when the process runs with `STREAMING_HUB_DANGEROUS_TEST_CLOCK=true` (404
//! otherwise), and only an admin token may call it. It lets tests drive the 28-hour retry curve
//! and the auto-disable windows in seconds against the real binary.
use axum::Json;
use axum::extract::State;
use serde::Deserialize;

use crate::api::ApiState;
use crate::api::auth::Admin;
use crate::api::errors::ApiError;
use crate::api::extract::JsonBody;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Advance {
    /// A duration such as `5s`, `30m`, `5h`.
    pub by: String,
}

pub async fn advance_clock(
    State(state): State<ApiState>,
    _admin: Admin,
    JsonBody(body): JsonBody<Advance>,
) -> Result<Json<serde_json::Value>, ApiError> {
    // Routed only with the test clock (see `api::router`).
    let Some(clock) = &state.test_clock else {
        return Err(crate::api::no_route().await);
    };
    let by = humantime::parse_duration(&body.by)
        .map_err(|e| ApiError::bad_request("invalid", e.to_string()).with_field("by"))?;
    let now_ms = clock.try_advance(by).ok_or_else(|| {
        ApiError::bad_request(
            "invalid",
            "the clock would pass year 10,000 (the hub's times are milliseconds since 1970)",
        )
        .with_field("by")
    })?;
    Ok(Json(serde_json::json!({ "now_ms": now_ms })))
}
