//! The verification handshake (issue 5 item 6): proof that a webhook URL belongs to someone who
//! expects our deliveries, sent on create, on URL change and on `POST /v1/subscriptions/{id}/verify`.
//!
//! On the wire: one signed POST, exactly like a delivery but for its body and event type:
//! ```text
//! Content-Type: application/json
//! X-Lerian-Event-Type: streaming_hub.verification
//! webhook-id: msg_<uuidv7, simple>
//! webhook-timestamp: <unix seconds>
//! webhook-signature: v1,<…> [v1,<…>]        (every active secret, as in a delivery)
//! <the destination's custom headers>
//!
//! {"type":"streaming_hub.verification","challenge":"<32 random base64url characters>"}
//! ```
//! The endpoint passes when it answers 2xx with a body (read up to [`RESPONSE_CAP`]) that contains
//! the challenge. A redirect is a failure, never followed. Custom headers cannot replace the hub's
//! own: those are set last.
//!
//! What to do with a failure (retry, mark `failed`) is the caller's; [`VerifyError::code`] is the
//! stable code for API responses, [`VerifyError::is_retryable`] says whether trying again later can
//! change the answer. No message carries a secret, a header value or the URL's path and query.
use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use rand::RngCore;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};

use super::client::{TransportError, classify, post, read_capped_partial};
use super::signing::{SigningError, signature_header};
use super::ssrf::UrlError;
use crate::runtime::secret::Secret;

/// `X-Lerian-Event-Type` and `type` of a probe.
pub const VERIFICATION_EVENT_TYPE: &str = "streaming_hub.verification";
/// How much of the endpoint's answer is read when looking for the challenge.
pub const RESPONSE_CAP: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Url(#[from] UrlError),
    /// See [`TransportError::Forbidden`].
    #[error("{}", super::client::NO_PUBLIC_ADDRESS)]
    Forbidden,
    #[error("could not reach the destination: {0}")]
    Connect(String),
    #[error("the destination did not answer within the timeout")]
    Timeout,
    #[error("the destination answered HTTP {0}, expected 2xx")]
    Status(u16),
    #[error("the destination answered 2xx, but its body does not contain the challenge")]
    ChallengeMissing,
    #[error("the destination answered a redirect (HTTP {0}); redirects are not followed")]
    Redirect(u16),
    /// A custom header whose name or value HTTP cannot carry (the name is given, not the value).
    #[error("custom header {0:?} is not a valid HTTP header")]
    InvalidHeader(String),
    /// More custom headers than a subscription may have (a record the API did not write).
    #[error("{0} custom headers, at most {max}", max = crate::subscriptions::model::MAX_HEADERS)]
    TooManyHeaders(usize),
    #[error(transparent)]
    Signing(#[from] SigningError),
}

impl VerifyError {
    /// A stable code for API error responses.
    pub fn code(&self) -> &'static str {
        match self {
            VerifyError::Url(e) => e.code(),
            VerifyError::Forbidden => "forbidden_address",
            VerifyError::Connect(_) => "connect_failed",
            VerifyError::Timeout => "timeout",
            VerifyError::Status(_) => "bad_status",
            VerifyError::ChallengeMissing => "challenge_missing",
            VerifyError::Redirect(_) => "redirect",
            VerifyError::InvalidHeader(_) => "invalid_header",
            VerifyError::TooManyHeaders(_) => "too_many_headers",
            VerifyError::Signing(_) => "signing_failed",
        }
    }

    /// Whether a later attempt can pass without the subscription changing (the endpoint may come
    /// up or be fixed, a host name may come to resolve to a public address); a refused URL,
    /// header or secret will fail the same way every time.
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            VerifyError::Url(_)
                | VerifyError::InvalidHeader(_)
                | VerifyError::TooManyHeaders(_)
                | VerifyError::Signing(_)
        )
    }
}

impl From<TransportError> for VerifyError {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::Forbidden => VerifyError::Forbidden,
            TransportError::Timeout => VerifyError::Timeout,
            TransportError::Connect(why) => VerifyError::Connect(why),
        }
    }
}

/// Sends one verification probe to `url` and judges the answer (see the module doc).
pub async fn probe(
    client: &reqwest::Client,
    url: &str,
    headers: &BTreeMap<String, String>,
    secrets: &[Secret],
    allow_private: bool,
    allow_insecure: bool,
) -> Result<(), VerifyError> {
    let builder = post(client, url, allow_private, allow_insecure)?;
    let challenge = new_challenge();
    let body = Bytes::from(
        serde_json::json!({ "type": VERIFICATION_EVENT_TYPE, "challenge": challenge }).to_string(),
    );
    let msg_id = format!("msg_{}", uuid::Uuid::now_v7().simple());
    let timestamp = unix_seconds();
    let signature = signature_header(secrets, &msg_id, timestamp, &body)?;

    if headers.len() > crate::subscriptions::model::MAX_HEADERS {
        // `HeaderMap` panics past 32,768 entries; the API allows 32.
        return Err(VerifyError::TooManyHeaders(headers.len()));
    }
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        if crate::subscriptions::model::is_reserved_header(name) {
            // Refused by the API; a record written to the control topic by other means may
            // still carry one: the hub's own headers and the connection's are not replaceable.
            continue;
        }
        let invalid = || VerifyError::InvalidHeader(name.clone());
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| invalid())?;
        let value = HeaderValue::from_str(value).map_err(|_| invalid())?;
        map.insert(name, value);
    }
    let timestamp = timestamp.to_string();
    let ours = [
        (CONTENT_TYPE, "application/json"),
        (
            HeaderName::from_static("x-lerian-event-type"),
            VERIFICATION_EVENT_TYPE,
        ),
        (HeaderName::from_static("webhook-id"), msg_id.as_str()),
        (
            HeaderName::from_static("webhook-timestamp"),
            timestamp.as_str(),
        ),
        (
            HeaderName::from_static("webhook-signature"),
            signature.as_str(),
        ),
    ];
    for (name, value) in ours {
        let value = HeaderValue::from_str(value).expect("the hub's header values are ASCII");
        map.insert(name, value);
    }

    let resp = builder
        .headers(map)
        .body(body)
        .send()
        .await
        .map_err(classify)?;
    let status = resp.status();
    if status.is_redirection() {
        return Err(VerifyError::Redirect(status.as_u16()));
    }
    if !status.is_success() {
        return Err(VerifyError::Status(status.as_u16()));
    }
    // The challenge counts where it came, even if the body then failed (never ended, the
    // connection dropped before its length).
    let (answer, ended) = read_capped_partial(resp, RESPONSE_CAP).await;
    if contains(&answer, challenge.as_bytes()) {
        Ok(())
    } else {
        ended?;
        Err(VerifyError::ChallengeMissing)
    }
}

/// 24 random bytes as 32 base64url characters (no padding, nothing to escape in JSON or a URL).
fn new_challenge() -> String {
    let mut bytes = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

fn unix_seconds() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenge_is_32_url_safe_characters_and_fresh_each_time() {
        let a = new_challenge();
        let b = new_challenge();
        assert_eq!(a.len(), 32);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'),
            "{a}"
        );
        assert_ne!(a, b);
    }

    #[test]
    fn challenge_is_found_anywhere_in_the_body() {
        assert!(contains(b"{\"challenge\":\"abc\"}", b"abc"));
        assert!(contains(b"abc", b"abc"));
        assert!(!contains(b"ab", b"abc"));
        assert!(!contains(b"anything", b""));
    }

    #[test]
    fn every_error_has_a_distinct_stable_code() {
        let all = [
            VerifyError::Url(UrlError::Insecure),
            VerifyError::Forbidden,
            VerifyError::Connect("refused".into()),
            VerifyError::Timeout,
            VerifyError::Status(500),
            VerifyError::ChallengeMissing,
            VerifyError::Redirect(302),
            VerifyError::InvalidHeader("x".into()),
            VerifyError::TooManyHeaders(40),
            VerifyError::Signing(SigningError::NoSecrets),
        ];
        let mut codes: Vec<_> = all.iter().map(VerifyError::code).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
        assert_eq!(VerifyError::Status(500).code(), "bad_status");
        assert_eq!(
            VerifyError::Url(UrlError::PrivateAddress("10.0.0.1".into())).code(),
            "url_private_address"
        );
        assert!(VerifyError::Timeout.is_retryable());
        assert!(
            VerifyError::Forbidden.is_retryable(),
            "a name may come to resolve"
        );
    }
}
