//! The API's one error type and its wire shape: `{"error":{"code":…,"message":…,"field":…}}`.
//!
//! Codes are stable strings clients may branch on (listed in [`codes`]); messages are for humans
//! and may change. A `field` is present when one input is at fault and names it by path
//! (`destination.url`, `event_types[2]`, the `If-Match` header). Internal failures (the control
//! topic, a seal that does not open) are logged with their details and reach the client only as
//! `internal` or `unavailable` with a fixed message: no broker address, key id or stack in a body.
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::subscriptions::control::RepoError;
use crate::subscriptions::model::FieldError;

/// The stable error codes of the API, besides the validation codes of
/// [`crate::subscriptions::model`] and the verification probe's codes.
pub mod codes {
    pub const UNAUTHORIZED: &str = "unauthorized";
    pub const TOKEN_EXPIRED: &str = "token_expired";
    pub const NOT_FOUND: &str = "not_found";
    pub const INVALID_BODY: &str = "invalid_body";
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported_media_type";
    pub const VERSION_MISMATCH: &str = "version_mismatch";
    pub const WRITTEN_AGAIN: &str = "written_again";
    pub const NOT_A_WEBHOOK: &str = "not_a_webhook";
    pub const SUBSCRIPTION_INACTIVE: &str = "subscription_inactive";
    pub const SUBSCRIPTION_LIMIT: &str = "subscription_limit";
    pub const RECORD_UNREADABLE: &str = "record_unreadable";
    pub const TOO_MANY_SECRETS: &str = "too_many_secrets";
    pub const UNAVAILABLE: &str = "unavailable";
    pub const INTERNAL: &str = "internal";
    pub const RATE_LIMITED: &str = "rate_limited";
    pub const PROBE_BUSY: &str = "probe_busy";
    pub const NOT_CANCELLABLE: &str = "not_cancellable";
    pub const CHANGED_MEANWHILE: &str = "changed_meanwhile";
    pub const TABLE_BEHIND: &str = "table_behind";
}

/// An error answer: status, stable code, human message, optional field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    pub field: Option<String>,
    /// `Retry-After` in whole seconds (a `429`'s).
    pub retry_after: Option<u64>,
}

/// The JSON body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, machine-readable code.
    pub code: String,
    /// Human-readable explanation; not stable.
    pub message: String,
    /// The offending input (`destination.url`, `event_types[0]`, `If-Match`), when one is at fault.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.to_string(),
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    /// `429` with `Retry-After` (whole seconds, at least 1).
    pub fn too_many(code: &str, message: impl Into<String>, wait_secs: u64) -> ApiError {
        ApiError {
            retry_after: Some(wait_secs.max(1)),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, code, message)
        }
    }

    pub fn with_field(mut self, field: impl Into<String>) -> ApiError {
        self.field = Some(field.into());
        self
    }

    pub fn unauthorized(code: &str, message: &str) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, code, message)
    }

    /// Unknown id, or another tenant's: the two are indistinguishable on purpose.
    pub fn not_found() -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::NOT_FOUND,
            "no such subscription",
        )
    }

    pub fn bad_request(code: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// A failure the client cannot fix: logged in full, answered with a fixed message.
    pub fn internal(context: &str, error: &dyn std::fmt::Display) -> ApiError {
        tracing::error!(error = %error, "{context}");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::INTERNAL,
            "internal error",
        )
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            code: e.code.to_string(),
            message: e.message,
            field: Some(e.field),
            retry_after: None,
        }
    }
}

impl From<RepoError> for ApiError {
    fn from(e: RepoError) -> ApiError {
        if matches!(e, RepoError::WrittenAgain) {
            return ApiError::new(
                StatusCode::CONFLICT,
                codes::WRITTEN_AGAIN,
                "the subscription was written again after this deletion (by the hub or another \
                 client); read it and delete it again",
            );
        }
        if e.is_retryable() {
            tracing::warn!(error = %e, "subscription write failed");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::UNAVAILABLE,
                "the subscription store is unavailable; retry later",
            )
        } else {
            ApiError::internal("subscription write failed", &e)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
                field: self.field,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(secs),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(e: ApiError) -> (StatusCode, serde_json::Value) {
        let response = e.into_response();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn field_error_becomes_400_naming_the_field() {
        let e: ApiError =
            FieldError::new("destination.url", "insecure_url", "must be https").into();
        let (status, body) = body_of(e).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["code"], "insecure_url");
        assert_eq!(body["error"]["field"], "destination.url");
    }

    #[tokio::test]
    async fn store_failure_hides_its_details_from_the_client() {
        let e: ApiError = RepoError::Write("broker 10.1.2.3:9092 unreachable".into()).into();
        let (status, body) = body_of(e).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["code"], "unavailable");
        assert!(!body.to_string().contains("10.1.2.3"));
        assert!(body["error"].get("field").is_none());
        let (status, body) =
            body_of(RepoError::Codec("schema mismatch at field x".into()).into()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!body.to_string().contains("schema"));
    }
}
