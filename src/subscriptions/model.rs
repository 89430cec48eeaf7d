//! The API's JSON shapes of a subscription and the rules an input must pass before it becomes a
//! [`SubscriptionRecord`].
//!
//! Requests ([`CreateSubscription`], [`PatchSubscription`]) are snake_case and refuse unknown
//! fields. The response shape ([`SubscriptionView`]) is the record minus its secrets: signing
//! secrets never appear, sensitive headers only by name, times as RFC 3339 UTC, the retry schedule
//! as humantime strings (`"5s"`, `"10m"`). Every rule failure is a [`FieldError`] naming the input
//! by path (`destination.url`, `event_types[1]`, `destination.headers.x-api-key`); header names
//! are stored lower case. A webhook URL is checked by [`crate::delivery::ssrf::check_url`] (IP
//! literals, `localhost` names); a host name is not resolved here but at each connection, through
//! the SSRF guard (see [`check_webhook_url`]).
use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;

use crate::delivery::ssrf::check_url;
use crate::runtime::records::{DestinationType, SubscriptionRecord, VerificationState};
use crate::runtime::secret::Secret;

const MAX_EVENT_TYPES: usize = 100;
const MAX_KEY_BYTES: usize = 255;
const MAX_RETRY_STEPS: usize = 12;
const MAX_RETRY_STEP: Duration = Duration::from_secs(10 * 3600);
pub const MAX_HEADERS: usize = 32;
const MAX_HEADER_VALUE_BYTES: usize = 4096;
/// Most bytes a webhook's custom headers may have together, names and values, plain and sensitive
/// alike: each is a line of every delivery and probe, next to the hub's own and the event's
/// `ce-*` ones, and receivers hold a whole header block to 8 to 16 KiB (nginx, Node); 32 headers
/// of 4096 bytes each came to 128 KiB. Checked when a subscription is written through the API or
/// `subscriptions apply`, not when a record is read from the control topic.
pub const MAX_HEADERS_TOTAL_BYTES: usize = 8 * 1024;
const MAX_URL_BYTES: usize = 2048;
/// Headers the hub sets itself or that belong to the connection, never a subscriber's.
const RESERVED_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-type",
    "traceparent",
    "tracestate",
];
const RESERVED_PREFIXES: &[&str] = &["webhook-", "x-lerian-", "ce-"];
/// Headers that carry a credential: only as `sensitive_headers` (sealed, never shown), never as
/// plain `headers` (stored as written and returned by every read of the subscription).
const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "cookie",
    "x-api-key",
    "api-key",
    "x-auth-token",
    "x-functions-key",
    "ocp-apim-subscription-key",
    "x-goog-api-key",
];
/// Words that make any header name a credential's (`X-Access-Token`, `X-Client-Secret`,
/// `X-Upstream-Authorization`, `X-Hub-Signature`): a name that only looks like one goes sealed
/// too, and is still sent; one that is and went plain would be shown by every read and stored in
/// plaintext. Not `key` alone: `Idempotency-Key` and `X-Routing-Key` are no credentials.
const CREDENTIAL_WORDS: &[&str] = &[
    "auth",
    "token",
    "secret",
    "password",
    "passwd",
    "apikey",
    "api-key",
    "api_key",
    "access-key",
    "access_key",
    "private-key",
    "private_key",
    "signature",
    "credential",
    "session",
];

/// Whether a (lower-case) header name carries a credential.
fn is_credential_header(lower: &str) -> bool {
    CREDENTIAL_HEADERS.contains(&lower) || CREDENTIAL_WORDS.iter().any(|w| lower.contains(w))
}

/// One input that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub code: &'static str,
    pub message: String,
}

impl FieldError {
    pub fn new(
        field: impl Into<String>,
        code: &'static str,
        message: impl Into<String>,
    ) -> FieldError {
        FieldError {
            field: field.into(),
            code,
            message: message.into(),
        }
    }
}

/// What the deployment allows as a webhook URL (`STREAMING_HUB_ALLOW_*_SINKS`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SinkPolicy {
    pub allow_private: bool,
    pub allow_insecure: bool,
}

/// `POST /v1/subscriptions`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSubscription {
    /// Admin tokens only: the tenant the subscription belongs to.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// Pin to one producer (`ce-source`), e.g. `ledger`.
    #[serde(default)]
    pub origin: Option<String>,
    /// `<resource>.<event>`, `<resource>.*` or `*`; 1 to 100 keys.
    #[schema(example = json!(["transaction.created", "account.*"]))]
    pub event_types: Vec<String>,
    /// Only events whose `ce-schemaversion` has this major.
    #[serde(default)]
    pub schema_major: Option<u32>,
    pub destination: DestinationSpec,
    /// Delays before attempt 2, 3, …: at most 12, each at most 10h. Default: the hub's curve.
    #[serde(default)]
    #[schema(example = json!(["5s", "5m", "30m"]))]
    pub retry_schedule: Option<Vec<String>>,
    /// Default `true`.
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Webhooks only: the signing secret to use (`whsec_` + base64 of 24 to 64 bytes), so the
    /// receiver can have it before the verification probe this request sends. Default: a new
    /// random one. Either way it is in the `201` and never shown again.
    #[serde(default, deserialize_with = "secret_field")]
    #[schema(value_type = Option<String>, example = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")]
    pub signing_secret: Option<Secret>,
}

fn secret_field<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Secret>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.map(Secret::new))
}

/// Shortest and longest key a caller may give as a signing secret, in bytes (Standard Webhooks
/// asks for 24 to 64; the hub's own are 32).
const SECRET_KEY_BYTES: std::ops::RangeInclusive<usize> = 24..=64;

/// A caller's signing secret: `whsec_` + standard base64 of 24 to 64 bytes. The error never
/// repeats the value.
pub fn check_signing_secret(secret: &Secret) -> Result<(), FieldError> {
    use base64::Engine;
    let key = secret
        .expose()
        .strip_prefix("whsec_")
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok());
    match key {
        Some(k) if SECRET_KEY_BYTES.contains(&k.len()) => Ok(()),
        _ => Err(FieldError::new(
            "signing_secret",
            "invalid",
            "expected whsec_ followed by the standard base64 of 24 to 64 random bytes",
        )),
    }
}

/// Where deliveries go.
#[derive(Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum DestinationSpec {
    /// Signed HTTPS POSTs to `url`.
    Webhook {
        /// Stored sealed past its host, like `sensitive_headers`, and shown with each path
        /// segment that does not read as words, every query value and the fragment as `***`.
        url: String,
        /// Extra request headers, stored and shown as they are. With `sensitive_headers`: at
        /// most 32, each value at most 4096 bytes, names and values at most 8192 bytes in all.
        #[serde(default)]
        headers: BTreeMap<String, String>,
        /// Extra request headers holding credentials: stored encrypted, shown by name only.
        /// They count toward the limits of `headers`.
        #[serde(default)]
        sensitive_headers: BTreeMap<String, String>,
    },
    /// Events are kept in the pull queue and read over HTTP.
    Pull {},
}

impl std::fmt::Debug for DestinationSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DestinationSpec::Webhook {
                url,
                headers,
                sensitive_headers,
            } => f
                .debug_struct("Webhook")
                .field("url", &super::sealed_url::redacted(url))
                .field("headers", headers)
                .field(
                    "sensitive_headers",
                    &sensitive_headers.keys().collect::<Vec<_>>(),
                )
                .finish(),
            DestinationSpec::Pull {} => f.write_str("Pull"),
        }
    }
}

/// `PATCH /v1/subscriptions/{id}`: absent fields stay; `null` clears `origin`, `schema_major` and
/// `retry_schedule` (and is a 400 for the others). The destination type cannot change; within a webhook, absent `url`,
/// `headers` or `sensitive_headers` stay and a given map replaces the stored one whole.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchSubscription {
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>, nullable)]
    pub origin: Option<Option<String>>,
    #[serde(default, deserialize_with = "not_null")]
    #[schema(value_type = Vec<String>, required = false)]
    pub event_types: Option<Vec<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<u32>, nullable)]
    pub schema_major: Option<Option<u32>>,
    #[serde(default, deserialize_with = "not_null")]
    #[schema(value_type = DestinationPatch, required = false)]
    pub destination: Option<DestinationPatch>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<Vec<String>>, nullable)]
    pub retry_schedule: Option<Option<Vec<String>>>,
    #[serde(default, deserialize_with = "not_null")]
    #[schema(value_type = bool, required = false)]
    pub enabled: Option<bool>,
}

/// A field that may be left out but not cleared: `null` is a 400 naming it (it was taken for
/// absent, so `{"event_types": null}` changed nothing and answered 200).
fn not_null<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[derive(Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum DestinationPatch {
    // Each field may be left out (kept as it is) but not `null`: `"sensitive_headers": null`
    // answered 200 and kept sending the credential its caller meant to drop (`{}` drops them).
    Webhook {
        #[serde(default, deserialize_with = "url_not_null")]
        #[schema(value_type = String, required = false)]
        url: Option<String>,
        #[serde(default, deserialize_with = "headers_not_null")]
        #[schema(value_type = BTreeMap<String, String>, required = false)]
        headers: Option<BTreeMap<String, String>>,
        #[serde(default, deserialize_with = "sensitive_headers_not_null")]
        #[schema(value_type = BTreeMap<String, String>, required = false)]
        sensitive_headers: Option<BTreeMap<String, String>>,
    },
    Pull {},
}

/// [`not_null`] for a field of a tagged enum's variant, whose path the error would lose: the
/// message names the field (`null field `url``), and the API names it by path from that.
fn not_null_named<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    name: &str,
) -> Result<Option<T>, D::Error> {
    match Option::<T>::deserialize(d)? {
        Some(v) => Ok(Some(v)),
        None => Err(serde::de::Error::custom(format!(
            "null field `{name}`: leave it out to keep it as it is"
        ))),
    }
}

fn url_not_null<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    not_null_named(d, "url")
}

fn headers_not_null<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    not_null_named(d, "headers")
}

fn sensitive_headers_not_null<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    not_null_named(d, "sensitive_headers")
}

impl std::fmt::Debug for DestinationPatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DestinationPatch::Webhook {
                url,
                headers,
                sensitive_headers,
            } => f
                .debug_struct("Webhook")
                .field("url", &url.as_deref().map(super::sealed_url::redacted))
                .field("headers", headers)
                .field(
                    "sensitive_headers",
                    &sensitive_headers
                        .as_ref()
                        .map(|h| h.keys().collect::<Vec<_>>()),
                )
                .finish(),
            DestinationPatch::Pull {} => f.write_str("Pull"),
        }
    }
}

/// `Some(None)` for an explicit `null`, `None` (via `default`) for an absent field.
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// A subscription as the API shows it: the record without its secrets.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SubscriptionView {
    /// UUIDv7, assigned by the hub.
    pub id: String,
    pub tenant_id: String,
    pub origin: Option<String>,
    pub event_types: Vec<String>,
    pub schema_major: Option<u32>,
    pub destination: DestinationView,
    /// `false` after auto-disable or by request; deliveries stop.
    pub enabled: bool,
    pub verification_state: VerificationStateView,
    pub retry_schedule: Option<Vec<String>>,
    pub disabled_reason: Option<String>,
    /// RFC 3339.
    pub disabled_at: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    /// Increments on every change; send it as `If-Match` to update safely.
    pub version: u64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DestinationView {
    Webhook {
        /// As stored: path segments that do not read as words, query values and the fragment
        /// shown as `***` (sent back as it is, it leaves the URL as it is).
        url: String,
        headers: BTreeMap<String, String>,
        sensitive_header_names: Vec<String>,
    },
    Pull {},
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VerificationStateView {
    Pending,
    Active,
    Failed,
}

impl From<VerificationState> for VerificationStateView {
    fn from(s: VerificationState) -> Self {
        match s {
            VerificationState::Pending => VerificationStateView::Pending,
            VerificationState::Active => VerificationStateView::Active,
            VerificationState::Failed => VerificationStateView::Failed,
        }
    }
}

/// Milliseconds since the epoch as RFC 3339 UTC with milliseconds.
pub fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl SubscriptionView {
    /// The view of `rec`; `sensitive_header_names` come from opening its sealed headers.
    pub fn of(rec: &SubscriptionRecord, sensitive_header_names: Vec<String>) -> SubscriptionView {
        let destination = match rec.destination.kind {
            DestinationType::Webhook => DestinationView::Webhook {
                // Redacted again: a record written before queries were sealed holds its query
                // as given (`subscriptions reseal` seals it).
                url: super::sealed_url::redacted(
                    rec.destination.url.as_deref().unwrap_or_default(),
                )
                .into_owned(),
                headers: rec.destination.headers.clone(),
                sensitive_header_names,
            },
            DestinationType::Pull => DestinationView::Pull {},
        };
        SubscriptionView {
            id: rec.id.clone(),
            tenant_id: rec.tenant_id.clone(),
            origin: rec.origin.clone(),
            event_types: rec.event_types.clone(),
            schema_major: rec.schema_major,
            destination,
            enabled: rec.enabled,
            verification_state: rec.verification_state.into(),
            retry_schedule: rec.retry_schedule.as_ref().map(|steps| {
                steps
                    .iter()
                    .map(|ms| humantime::format_duration(Duration::from_millis(*ms)).to_string())
                    .collect()
            }),
            disabled_reason: rec.disabled_reason.clone(),
            disabled_at: rec.disabled_at.map(rfc3339),
            created_at: rfc3339(rec.created_at),
            updated_at: rfc3339(rec.updated_at),
            version: rec.version,
        }
    }
}

/// A resource or event name a pattern can hold: what ingest accepts in `ce-resourcetype` and
/// `ce-eventtype` (non-empty, no dot, at most [`MAX_KEY_BYTES`] bytes each; control characters
/// never pass ingest), but `*`, the wildcard. A stricter rule (lower case, digits, `_`, `-`) left
/// events ingest took, such as `LoanApplication.Approved`, matched by `*` alone. Names holding a
/// `*`, and keys over [`MAX_KEY_BYTES`] in all, are still matched by wildcards only.
fn is_type_segment(s: &str) -> bool {
    !s.is_empty() && !s.chars().any(|c| c == '.' || c == '*' || c.is_control())
}

fn is_segment(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// `ce-source` syntax: `^[a-z0-9][a-z0-9_-]*$`.
pub fn validate_origin(origin: &str) -> Result<(), FieldError> {
    let ok = origin.len() <= MAX_KEY_BYTES
        && origin
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && is_segment(origin);
    if ok {
        Ok(())
    } else {
        Err(FieldError::new(
            "origin",
            "invalid",
            "origin must match ^[a-z0-9][a-z0-9_-]*$",
        ))
    }
}

/// 1 to 100 keys, each `<resource>.<event>`, `<resource>.*` or `*`; repeated keys are dropped.
pub fn validate_event_types(keys: &[String]) -> Result<Vec<String>, FieldError> {
    if keys.is_empty() {
        return Err(FieldError::new(
            "event_types",
            "required",
            "at least one event type is required",
        ));
    }
    if keys.len() > MAX_EVENT_TYPES {
        return Err(FieldError::new(
            "event_types",
            "too_many",
            "at most 100 event types",
        ));
    }
    let mut out: Vec<String> = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        let ok = key.len() <= MAX_KEY_BYTES
            && (key == "*"
                || key
                    .split_once('.')
                    .is_some_and(|(r, e)| is_type_segment(r) && (e == "*" || is_type_segment(e))));
        if !ok {
            return Err(FieldError::new(
                format!("event_types[{i}]"),
                "invalid",
                "expected <resource>.<event>, <resource>.* or * (segments without dots, `*` or \
                 control characters)",
            ));
        }
        if !out.contains(key) {
            out.push(key.clone());
        }
    }
    Ok(out)
}

/// At most 12 humantime durations, each at most 10h, as milliseconds.
pub fn parse_retry_schedule(steps: &[String]) -> Result<Vec<u64>, FieldError> {
    if steps.is_empty() {
        // Dispatch takes an empty list for a malformed one and follows the default curve:
        // accepted, it would promise "no retries" and deliver eight attempts.
        return Err(FieldError::new(
            "retry_schedule",
            "empty",
            "at least one retry step; leave retry_schedule out (or null) for the hub's curve",
        ));
    }
    if steps.len() > MAX_RETRY_STEPS {
        return Err(FieldError::new(
            "retry_schedule",
            "too_many",
            "at most 12 retry steps",
        ));
    }
    let mut out = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let field = format!("retry_schedule[{i}]");
        let d = humantime::parse_duration(step.trim()).map_err(|_| {
            FieldError::new(
                &field,
                "invalid",
                "expected a duration such as 5s, 10m or 2h",
            )
        })?;
        if d > MAX_RETRY_STEP {
            return Err(FieldError::new(
                field,
                "too_long",
                "a retry step is at most 10h",
            ));
        }
        out.push(d.as_millis() as u64);
    }
    Ok(out)
}

fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A header name (any case) the hub sets itself or that belongs to the connection: refused by the
/// API, and dropped at sending from a record that carries one anyway (any producer may write the
/// control topic, and sealed headers are only seen once opened).
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED_HEADERS
        .iter()
        .any(|r| r.eq_ignore_ascii_case(name))
        || RESERVED_PREFIXES.iter().any(|p| {
            name.len() >= p.len() && name.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes())
        })
}

/// Checks one header map (`which` is `headers` or `sensitive_headers`); names come back lower case.
pub fn validate_header_map(
    which: &str,
    map: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, FieldError> {
    let mut out = BTreeMap::new();
    for (name, value) in map {
        let lower = name.to_ascii_lowercase();
        if !is_token(name) {
            // Not echoed, in the field or the message: a name that is not a token is most
            // likely a whole header line pasted in (`Authorization: Bearer …`), its credential
            // with it, and errors end up in clients' and CI logs.
            return Err(FieldError::new(
                format!("destination.{which}"),
                "invalid",
                "a header name is an HTTP token of at most 128 bytes (no spaces or colons); \
                 one here is not (it is not repeated here, in case it holds a credential)",
            ));
        }
        let field = format!("destination.{which}.{name}");
        if is_reserved_header(&lower) {
            return Err(FieldError::new(
                field,
                "reserved",
                "this header is set by the hub or the connection",
            ));
        }
        if which == "headers" && is_credential_header(&lower) {
            return Err(FieldError::new(
                field,
                "sensitive",
                "this header carries a credential: put it in destination.sensitive_headers, \
                 which is stored encrypted and never shown",
            ));
        }
        if value.contains(['\r', '\n'])
            || value.len() > MAX_HEADER_VALUE_BYTES
            || axum::http::HeaderValue::from_str(value).is_err()
        {
            return Err(FieldError::new(
                field,
                "invalid",
                "a header value is printable, at most 4096 bytes, without CR or LF",
            ));
        }
        if out.insert(lower, value.clone()).is_some() {
            return Err(FieldError::new(
                field,
                "duplicate",
                "header names are case-insensitive; this one is repeated",
            ));
        }
    }
    Ok(out)
}

/// The final header sets of a webhook: not too many, not too large together
/// ([`MAX_HEADERS_TOTAL_BYTES`]), no name in both.
pub fn validate_header_sets(
    plain: &BTreeMap<String, String>,
    sensitive: &BTreeMap<String, String>,
) -> Result<(), FieldError> {
    if plain.len() + sensitive.len() > MAX_HEADERS {
        return Err(FieldError::new(
            "destination.headers",
            "too_many",
            "at most 32 custom headers",
        ));
    }
    // The plain headers first: when they fit, the sensitive ones tipped the sum over.
    let bytes = |map: &BTreeMap<String, String>| -> usize {
        map.iter()
            .map(|(name, value)| name.len() + value.len())
            .sum()
    };
    let plain_bytes = bytes(plain);
    let total = plain_bytes + bytes(sensitive);
    if total > MAX_HEADERS_TOTAL_BYTES {
        let field = if plain_bytes > MAX_HEADERS_TOTAL_BYTES {
            "destination.headers"
        } else {
            "destination.sensitive_headers"
        };
        return Err(FieldError::new(
            field,
            "too_large",
            format!(
                "the custom headers' names and values (headers and sensitive_headers) come to \
                 {total} bytes, at most {MAX_HEADERS_TOTAL_BYTES} in all"
            ),
        ));
    }
    match sensitive.keys().find(|k| plain.contains_key(*k)) {
        Some(k) => Err(FieldError::new(
            format!("destination.sensitive_headers.{k}"),
            "duplicate",
            "also in headers",
        )),
        None => Ok(()),
    }
}

/// Refuses a new webhook URL that holds the `***` mark of a URL as the API shows it (see
/// [`super::sealed_url`]): edited from the shown form, the mark would be sent as it is.
pub fn refuse_redacted(url: &str) -> Result<(), FieldError> {
    if super::sealed_url::holds_redacted(url) {
        return Err(FieldError::new(
            "destination.url",
            "redacted",
            "the URL holds *** where the shown URL hides a value: send the URL as given in full, \
             or as shown unchanged to keep it (a URL stored unsealed, before URLs were sealed or \
             past the API, is named in full until `subscriptions reseal` seals it)",
        ));
    }
    Ok(())
}

/// Checks a webhook URL against the policy and resolves its host; returns the normalised URL.
pub async fn check_webhook_url(url: &str, policy: SinkPolicy) -> Result<String, FieldError> {
    let field = "destination.url";
    if url.len() > MAX_URL_BYTES {
        return Err(FieldError::new(
            field,
            "too_long",
            "a URL is at most 2048 bytes",
        ));
    }
    let parsed = check_url(url, policy.allow_private, policy.allow_insecure)
        .map_err(|e| FieldError::new(field, e.code(), e.to_string()))?;
    // Shown with its query values redacted it may be longer (`?a&b` → `?***&***`): it is held
    // to the same bound, so the URL the API shows can be sent back.
    let shown = super::sealed_url::redacted(parsed.as_str());
    if parsed.as_str().len().max(shown.len()) > MAX_URL_BYTES {
        return Err(FieldError::new(
            field,
            "too_long",
            "a URL is at most 2048 bytes, also as shown with its query values as ***",
        ));
    }
    // A host name is not resolved here: every connection (the verification probe, each
    // delivery) resolves it through the SSRF guard, which answers a name that resolves only to
    // private addresses as it answers one that does not resolve (`forbidden_address`). Refusing
    // the first here, and taking the second for a name whose DNS is not set up yet, told a
    // tenant which internal names exist.
    Ok(parsed.to_string())
}

/// A webhook or pull destination that passed every rule.
#[derive(Clone, PartialEq, Eq)]
pub enum ValidDestination {
    Webhook {
        url: String,
        headers: BTreeMap<String, String>,
        sensitive_headers: BTreeMap<String, String>,
    },
    Pull,
}

/// A [`CreateSubscription`] that passed every rule (the tenant is the handler's to resolve).
pub struct ValidCreate {
    pub tenant_id: Option<String>,
    pub origin: Option<String>,
    pub event_types: Vec<String>,
    pub schema_major: Option<u32>,
    pub destination: ValidDestination,
    pub retry_schedule: Option<Vec<u64>>,
    pub enabled: bool,
    /// The caller's signing secret, checked (webhooks only).
    pub signing_secret: Option<Secret>,
}

/// The largest `schema_major` a subscription can hold: the control topic stores it as an Avro
/// `int`, so a larger one would fail to encode (a `500`, or a failed `subscriptions apply`)
/// instead of being refused.
pub const MAX_SCHEMA_MAJOR: u32 = i32::MAX as u32;

pub fn check_schema_major(major: Option<u32>) -> Result<(), FieldError> {
    match major {
        Some(m) if m > MAX_SCHEMA_MAJOR => Err(FieldError::new(
            "schema_major",
            "invalid",
            format!("schema_major is at most {MAX_SCHEMA_MAJOR}"),
        )),
        _ => Ok(()),
    }
}

impl CreateSubscription {
    pub async fn validate(self, policy: SinkPolicy) -> Result<ValidCreate, FieldError> {
        check_schema_major(self.schema_major)?;
        if let Some(o) = &self.origin {
            validate_origin(o)?;
        }
        let event_types = validate_event_types(&self.event_types)?;
        let retry_schedule = self
            .retry_schedule
            .as_deref()
            .map(parse_retry_schedule)
            .transpose()?;
        if let Some(secret) = &self.signing_secret {
            if matches!(self.destination, DestinationSpec::Pull {}) {
                return Err(FieldError::new(
                    "signing_secret",
                    "not_allowed",
                    "a pull subscription has no signing secret",
                ));
            }
            check_signing_secret(secret)?;
        }
        let destination = match self.destination {
            DestinationSpec::Pull {} => ValidDestination::Pull,
            DestinationSpec::Webhook {
                url,
                headers,
                sensitive_headers,
            } => {
                let headers = validate_header_map("headers", &headers)?;
                let sensitive_headers =
                    validate_header_map("sensitive_headers", &sensitive_headers)?;
                validate_header_sets(&headers, &sensitive_headers)?;
                ValidDestination::Webhook {
                    url: check_webhook_url(&url, policy).await?,
                    headers,
                    sensitive_headers,
                }
            }
        };
        Ok(ValidCreate {
            tenant_id: self.tenant_id,
            origin: self.origin,
            event_types,
            schema_major: self.schema_major,
            destination,
            retry_schedule,
            enabled: self.enabled.unwrap_or(true),
            signing_secret: self.signing_secret,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Ingest caps `ce-resourcetype` and `ce-eventtype` at the same number of bytes a key may
    /// have in all, so no key names a longer one.
    #[test]
    fn an_event_type_key_is_held_to_the_longest_name_ingest_takes() {
        let limit = crate::ingest::classify::MAX_TYPE_NAME_BYTES;
        let key = |bytes: usize| format!("{}.e", "r".repeat(bytes - 2));
        assert_eq!(key(limit).len(), limit);
        assert!(validate_event_types(&[key(limit)]).is_ok());
        assert!(validate_event_types(&[key(limit + 1)]).is_err());
    }

    #[test]
    fn event_type_keys_accept_exact_resource_wildcard_and_catch_all() {
        let ok = validate_event_types(&strings(&[
            "loan_application.approved",
            "account.*",
            "*",
            "a-b.c_d",
            "*",
            "LoanApplication.Approved",
        ]))
        .unwrap();
        assert_eq!(
            ok,
            strings(&[
                "loan_application.approved",
                "account.*",
                "*",
                "a-b.c_d",
                "LoanApplication.Approved"
            ]),
            "repeats dropped"
        );
        assert!(validate_event_types(&strings(&["Loan Application.ação", "a.b "])).is_ok());
        for (bad, i) in [
            ("a*.created", 1),
            ("a.cre*ted", 1),
            ("a\u{1}.b", 1),
            ("a.b.c", 1),
            ("*.created", 1),
            ("a.", 1),
            ("a", 1),
        ] {
            let e = validate_event_types(&strings(&["x.y", bad])).unwrap_err();
            assert_eq!(e.field, format!("event_types[{i}]"), "{bad}");
        }
        assert_eq!(validate_event_types(&[]).unwrap_err().code, "required");
        assert_eq!(
            validate_event_types(&vec!["a.b".to_string(); 101])
                .unwrap_err()
                .code,
            "too_many"
        );
    }

    #[test]
    fn a_destination_as_debugged_shows_no_credential() {
        let url = "https://r.example/in?code=fn_key_1";
        let spec: DestinationSpec = serde_json::from_value(serde_json::json!(
            {"type": "webhook", "url": url, "sensitive_headers": {"authorization": "Bearer t0k"}}
        ))
        .unwrap();
        let patch: DestinationPatch =
            serde_json::from_value(serde_json::json!({"type": "webhook", "url": url})).unwrap();
        for text in [format!("{spec:?}"), format!("{patch:?}")] {
            assert!(text.contains("code=***"), "{text}");
            assert!(
                !text.contains("fn_key_1") && !text.contains("t0k"),
                "{text}"
            );
        }
    }

    #[test]
    fn origin_follows_ce_source_syntax() {
        assert!(validate_origin("ledger").is_ok());
        assert!(validate_origin("0x_a-b").is_ok());
        for bad in ["", "-ledger", "Ledger", "led.ger", "_x"] {
            assert_eq!(validate_origin(bad).unwrap_err().field, "origin", "{bad:?}");
        }
    }

    #[test]
    fn retry_schedule_is_at_most_twelve_steps_of_at_most_ten_hours() {
        assert_eq!(
            parse_retry_schedule(&strings(&["5s", "10m", "10h"])).unwrap(),
            [5_000, 600_000, 36_000_000]
        );
        assert_eq!(
            parse_retry_schedule(&strings(&["5s", "10h 1s"]))
                .unwrap_err()
                .field,
            "retry_schedule[1]"
        );
        assert_eq!(
            parse_retry_schedule(&strings(&["soon"])).unwrap_err().code,
            "invalid"
        );
        assert_eq!(
            parse_retry_schedule(&[]).unwrap_err().field,
            "retry_schedule"
        );
        assert_eq!(
            parse_retry_schedule(&vec!["1s".to_string(); 13])
                .unwrap_err()
                .field,
            "retry_schedule"
        );
    }

    #[test]
    fn custom_headers_refuse_reserved_names_bad_tokens_and_line_breaks() {
        let map = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert_eq!(
            validate_header_map("headers", &map("X-Team", "a")).unwrap(),
            map("x-team", "a")
        );
        for name in [
            "Connection",
            "transfer-encoding",
            "Webhook-Signature",
            "x-lerian-attempt",
            "Content-Type",
            "ce-type",
            // Deliveries forward the producer's trace context under these.
            "traceparent",
            "TraceState",
        ] {
            let e = validate_header_map("headers", &map(name, "v")).unwrap_err();
            assert_eq!(
                (e.field.as_str(), e.code),
                (format!("destination.headers.{name}").as_str(), "reserved")
            );
        }
        for name in [
            "Authorization",
            "cookie",
            "X-Api-Key",
            "X-Access-Token",
            "X-Client-Secret",
            "X-Upstream-Authorization",
            "X-Session-Id",
            "X-Db-Password",
            "x-functions-key",
            "Ocp-Apim-Subscription-Key",
            "X-Hub-Signature-256",
            "X-Client-Credential",
        ] {
            let e = validate_header_map("headers", &map(name, "v")).unwrap_err();
            assert_eq!(
                (e.field.as_str(), e.code),
                (format!("destination.headers.{name}").as_str(), "sensitive")
            );
            assert!(validate_header_map("sensitive_headers", &map(name, "v")).is_ok());
        }
        for name in [
            "X-Tenant",
            "Accept-Language",
            "X-Request-Source",
            "X-Routing-Key",
        ] {
            assert!(
                validate_header_map("headers", &map(name, "v")).is_ok(),
                "{name}"
            );
        }
        assert_eq!(
            validate_header_map("headers", &map("bad name", "v"))
                .unwrap_err()
                .code,
            "invalid"
        );
        let e = validate_header_map("sensitive_headers", &map("x-key", "a\r\nInjected: 1"))
            .unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.code),
            ("destination.sensitive_headers.x-key", "invalid")
        );
        let both = validate_header_sets(&map("x-key", "a"), &map("x-key", "b")).unwrap_err();
        assert_eq!(both.field, "destination.sensitive_headers.x-key");
    }

    /// 32 headers of 4096 bytes each passed every per-header rule and came to 128 KiB of header
    /// lines on every request; names and values are held to 8 KiB together.
    #[test]
    fn custom_headers_names_and_values_are_at_most_8_kib_together() {
        let map = |pairs: &[(&str, usize)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(name, len)| (name.to_string(), "v".repeat(*len)))
                .collect()
        };
        let checked = |plain: &[(&str, usize)], sensitive: &[(&str, usize)]| {
            let plain = validate_header_map("headers", &map(plain)).unwrap();
            let sensitive = validate_header_map("sensitive_headers", &map(sensitive)).unwrap();
            validate_header_sets(&plain, &sensitive).map_err(|e| (e.field, e.code))
        };
        // "x-a" + 4096 and "x-b" + 4090: 8192 bytes.
        assert_eq!(MAX_HEADERS_TOTAL_BYTES, 8192);
        assert!(checked(&[("x-a", 4096), ("x-b", 4090)], &[]).is_ok());
        let too_large = |field: &str| Err((field.to_string(), "too_large"));
        assert_eq!(
            checked(&[("x-a", 4096), ("x-b", 4091)], &[]),
            too_large("destination.headers")
        );
        // The sensitive headers count as well: the field named is theirs when they tip it over.
        assert!(checked(&[("x-a", 4096)], &[("x-key", 4088)]).is_ok());
        assert_eq!(
            checked(&[("x-a", 4096)], &[("x-key", 4089)]),
            too_large("destination.sensitive_headers")
        );
        assert_eq!(
            checked(&[("x-a", 4096), ("x-b", 4091)], &[("x-key", 1)]),
            too_large("destination.headers")
        );
    }

    #[tokio::test]
    async fn webhook_url_must_be_https_and_public_unless_allowed() {
        let strict = SinkPolicy::default();
        assert!(
            check_webhook_url("https://93.184.215.14/hook", strict)
                .await
                .is_ok()
        );
        assert_eq!(
            check_webhook_url("http://93.184.215.14/hook", strict)
                .await
                .unwrap_err()
                .code,
            "url_insecure"
        );
        let private = check_webhook_url("https://10.1.2.3/hook", strict)
            .await
            .unwrap_err();
        assert_eq!(
            (private.field.as_str(), private.code),
            ("destination.url", "url_private_address")
        );
        assert_eq!(
            check_webhook_url("https://localhost/x", strict)
                .await
                .unwrap_err()
                .code,
            "url_private_address"
        );
        let open = SinkPolicy {
            allow_private: true,
            allow_insecure: true,
        };
        assert!(
            check_webhook_url("http://127.0.0.1:9/hook", open)
                .await
                .is_ok()
        );
    }
}
