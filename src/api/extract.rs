//! Request parts the handlers take, each turning a malformed input into an [`ApiError`] that names
//! it: JSON bodies (strict: unknown fields refused, the offending field named by path), raw
//! bodies, path and query parameters, and the `If-Match` header. Handlers take these, never axum's
//! `Json`, `Path`, `Query` or `Bytes`, whose rejections are plain text.
//!
//! Bodies are read whole, which is safe because the router caps them ([`super::MAX_BODY_BYTES`];
//! over it: `413`).
use axum::body::Bytes;
use axum::extract::path::ErrorKind;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;

use super::errors::{ApiError, codes};

/// A JSON body of type `T`, parsed strictly.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<JsonBody<T>, ApiError> {
        let headers = req.headers().clone();
        let RawBody(bytes) = RawBody::from_request(req, state).await?;
        parse_body(&headers, &bytes).map(JsonBody)
    }
}

/// The body's bytes, whatever their type (`413` over the cap).
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<RawBody, ApiError> {
        Bytes::from_request(req, state)
            .await
            .map(RawBody)
            .map_err(|e| {
                ApiError::new(
                    e.status(),
                    codes::INVALID_BODY,
                    "the request body could not be read (at most 64 KiB)",
                )
            })
    }
}

/// Path parameters: one that does not decode (not UTF-8 once percent-decoded) is `400` naming it.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<ApiPath<T>, ApiError> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(ApiPath(value)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                let key = match e.kind() {
                    ErrorKind::InvalidUtf8InPathParam { key }
                    | ErrorKind::ParseErrorAtKey { key, .. } => key.clone(),
                    _ => "path".to_string(),
                };
                let message = format!("{key} is not a valid path parameter (UTF-8 text)");
                Err(ApiError::bad_request("invalid", message).with_field(key))
            }
            Err(e) => Err(ApiError::internal("path parameters", &e)),
        }
    }
}

/// Query parameters: one given twice is `400` naming it; unknown ones are ignored.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<ApiQuery<T>, ApiError> {
        let e = match Query::<T>::try_from_uri(&parts.uri) {
            Ok(Query(value)) => return Ok(ApiQuery(value)),
            Err(e) => e,
        };
        // The queries are all `Option<String>`: serde only refuses a repeated one, and its message
        // names it (`duplicate field `limit``).
        let text = e.body_text();
        let message = text.rsplit(": ").next().unwrap_or_default().to_string();
        let error = ApiError::bad_request("invalid", message.clone());
        match message.split('`').nth(1) {
            Some(field) => Err(error.with_field(field)),
            None => Err(error),
        }
    }
}

/// Parses `bytes` as JSON `T`, requiring a JSON content type and an object: serde would also
/// fill a struct from an array, by position, which no client means and no error could name.
pub fn parse_body<T: DeserializeOwned>(headers: &HeaderMap, bytes: &[u8]) -> Result<T, ApiError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            codes::UNSUPPORTED_MEDIA_TYPE,
            "send the body as Content-Type: application/json",
        ));
    }
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad_request(
            codes::INVALID_BODY,
            "the body must be a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| body_error(&e.path().to_string(), e.inner()))?;
    de.end().map_err(|e| body_error("", &e))?;
    Ok(value)
}

/// Names the field of a serde error: the path to it, plus the field serde names for an unknown or
/// missing field (serde puts that in the message, `unknown field `x``).
fn body_error(path: &str, inner: &serde_json::Error) -> ApiError {
    let message = inner.to_string();
    let named = |prefix: &str| {
        let rest = message.strip_prefix(prefix)?;
        let name = rest.strip_prefix('`')?.split('`').next()?;
        Some(name.to_string())
    };
    // serde_path_to_error's path already ends at an unknown key, not yet at a missing one.
    let join = |name: String| {
        if path == name || path.ends_with(&format!(".{name}")) {
            path.to_string()
        } else if path.is_empty() || path == "." {
            name
        } else {
            format!("{path}.{name}")
        }
    };
    let (code, field) = if let Some(name) = named("unknown field ") {
        ("unknown_field", Some(join(name)))
    } else if let Some(name) = named("missing field ") {
        ("required", Some(join(name)))
    } else if let Some(name) = named("null field ") {
        ("invalid", Some(join(name)))
    } else if let Some(name) = named("duplicate field ") {
        ("duplicate", Some(join(name)))
    } else if inner.is_syntax() || inner.is_eof() {
        (codes::INVALID_BODY, None)
    } else {
        (
            "invalid",
            (!path.is_empty() && path != ".").then(|| path.to_string()),
        )
    };
    // Types and fields only: a value in the wrong field may be a credential.
    let message = without_string_value(&message);
    let message = message
        .split(" at line ")
        .next()
        .unwrap_or_default()
        .to_string();
    let error = ApiError::bad_request(code, message);
    match field {
        Some(f) => error.with_field(f),
        None => error,
    }
}

/// A serde message without the value it quotes (`invalid type: string "Bearer …", expected a
/// map`, an integer or a variant in backticks): the value may be a credential put in the wrong
/// field, and API answers and apply's errors (stderr, often a CI log) end up in logs. The kind
/// of value stays.
pub(crate) fn without_string_value(message: &str) -> String {
    let end = message.rfind(", expected");
    let cut = |at: usize| match end {
        Some(end) if end >= at => format!("{}{}", &message[..at], &message[end..]),
        _ => format!("{} (value not shown)", &message[..at]),
    };
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(i) = message.find(prefix) {
            let from = i + prefix.len();
            let upto = end.filter(|&e| e >= from).unwrap_or(message.len());
            // Keep the kind ("string", "integer", "map"); cut what follows it.
            return match message[from..upto].find(' ') {
                Some(k) => cut(from + k),
                None => message.to_string(),
            };
        }
    }
    match message.find("unknown variant ") {
        Some(i) => cut(i + "unknown variant".len()),
        None => message.to_string(),
    }
}

/// The `If-Match` header: `None` when absent or `*`, else the version it names (`3` or `"3"`).
pub fn if_match(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(value) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad_request(
            "invalid",
            "If-Match must be a subscription version such as \"3\"",
        )
        .with_field("If-Match")
    };
    let text = value.to_str().map_err(|_| bad())?.trim();
    if text == "*" {
        return Ok(None);
    }
    let text = text.strip_prefix("W/").unwrap_or(text);
    let text = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    text.parse::<u64>().map(Some).map_err(|_| bad())
}

/// The query parameters the subscription endpoints read; all optional, others ignored.
#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SubscriptionQuery {
    /// Admin tokens: the tenant acted for.
    pub tenant_id: Option<String>,
    /// Page size, 1-200 (default 50). List only.
    pub limit: Option<String>,
    /// `next_cursor` of the previous page. List only.
    pub cursor: Option<String>,
}

impl SubscriptionQuery {
    pub const DEFAULT_LIMIT: usize = 50;
    pub const MAX_LIMIT: usize = 200;

    pub fn limit(&self) -> Result<usize, ApiError> {
        match &self.limit {
            None => Ok(Self::DEFAULT_LIMIT),
            Some(text) => text
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=Self::MAX_LIMIT).contains(n))
                .ok_or_else(|| {
                    ApiError::bad_request("invalid", "limit is a number from 1 to 200")
                        .with_field("limit")
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subscriptions::model::CreateSubscription;

    fn json_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "application/json; charset=utf-8".parse().unwrap(),
        );
        h
    }

    fn err(body: &str) -> ApiError {
        parse_body::<CreateSubscription>(&json_headers(), body.as_bytes()).unwrap_err()
    }

    #[test]
    fn unknown_and_missing_fields_are_named_by_path() {
        let e = err(r#"{"event_types":["a.b"],"destination":{"type":"pull"},"colour":"red"}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("unknown_field", Some("colour"))
        );
        let e = err(
            r#"{"event_types":["a.b"],"destination":{"type":"webhook","url":"https://x","secret":"s"}}"#,
        );
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("unknown_field", Some("destination.secret"))
        );
        let e = err(r#"{"destination":{"type":"pull"}}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("required", Some("event_types"))
        );
        let e = err(r#"{"event_types":["a.b"],"destination":{"type":"webhook"}}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("required", Some("destination.url"))
        );
        let e =
            err(r#"{"event_types":["a.b"],"destination":{"type":"pull"},"schema_major":"one"}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("invalid", Some("schema_major"))
        );
        let e =
            err(r#"{"event_types":["a.b"],"destination":{"type":"pull"},"event_types":["c.d"]}"#);
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("duplicate", Some("event_types"))
        );
        let e = err(
            r#"{"event_types":["a.b"],"destination":{"type":"webhook","url":"https://x","url":"https://y"}}"#,
        );
        assert_eq!(
            (e.code.as_str(), e.field.as_deref()),
            ("duplicate", Some("destination.url"))
        );
        assert_eq!(err("{nope").code, "invalid_body");
        assert_eq!(
            err(r#"{"event_types":["a.b"],"destination":{"type":"pull"}} trailing"#).code,
            "invalid_body"
        );
    }

    #[test]
    fn body_without_json_content_type_is_415() {
        let e = parse_body::<CreateSubscription>(&HeaderMap::new(), b"{}").unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[test]
    fn if_match_accepts_bare_quoted_weak_and_star() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::IF_MATCH, v.parse().unwrap());
            m
        };
        assert_eq!(if_match(&HeaderMap::new()).unwrap(), None);
        assert_eq!(if_match(&h("3")).unwrap(), Some(3));
        assert_eq!(if_match(&h("\"4\"")).unwrap(), Some(4));
        assert_eq!(if_match(&h("W/\"5\"")).unwrap(), Some(5));
        assert_eq!(if_match(&h("*")).unwrap(), None);
        assert_eq!(
            if_match(&h("abc")).unwrap_err().field.as_deref(),
            Some("If-Match")
        );
    }
}
