//! The per-record verdict of ingest: accept, drop or quarantine (issue 3, DESIGN.md §2.1 and §6).
//!
//! [`classify`] is pure: Kafka headers and value in, a [`Verdict`] out. It reads routing and
//! identity from `ce-*` headers only and never parses the payload. It never panics, compiles no
//! pattern per call and allocates only the [`Accepted`] strings (and, for the rare record carrying
//! unknown `ce-*` extensions, one small list to find duplicates among them).
//!
//! Checks run in this order; the first failure is the verdict:
//! 0. **Topic** — a record of a producer's own dead-letter or command topic
//!    (`lerian.streaming.<source>.dlq`, `….commands`) → [`Verdict::Drop`], whatever it carries:
//!    those are never ingested (DESIGN.md §2.1; forensics reads the dead letters), and the
//!    configuration's check of `STREAMING_HUB_FOLLOW_PATTERN` can only try sample names.
//! 1. **Header structure** — over every header named `ce-*` (names are case-sensitive: `CE-Id` is not
//!    a CloudEvents header and is ignored), in header order: a null value, a value that is not UTF-8,
//!    a name or value holding a control character (C0 including CR, LF, NUL; DEL; C1), or a name
//!    whose rest after `ce-` is empty or holds anything but ASCII letters and digits (CloudEvents
//!    1.0 attribute names are `a-z0-9`; upper case is folded, as HTTP reads names in any case;
//!    such a name is also an HTTP token, so it can be sent as a header of a delivery) →
//!    `invalid_header_encoding`; a header line over 8 KiB as sent (each `ce-*` header becomes
//!    one of every delivery: name, `: `, the value percent-encoded (space, `"`, `%` and
//!    non-ASCII bytes count three; `ce-datacontenttype` goes as `Content-Type` as it is), CRLF)
//!    → `headers_too_large`; a second occurrence → `duplicate_header`. Other headers
//!    (`traceparent`, …) are carried, never judged.
//! 2. **Payload size** — over `max_payload_bytes` → `payload_too_large`. A null value is an empty one.
//! 3. **System event** — `ce-systemevent` exactly `true` → [`Verdict::Drop`]. A system event with a
//!    malformed header structure or an oversized payload is still quarantined: it is evidence of a
//!    broken producer. Any other `ce-systemevent` value means a business event.
//! 4. **Attributes**, each "absent → `missing_header`" then its own rule: `ce-specversion` (`1.0`),
//!    `ce-id`, `ce-source`, `ce-resourcetype`, `ce-eventtype` (non-empty, no dot, at most
//!    [`MAX_TYPE_NAME_BYTES`] → `invalid_type`; a resource [`RESERVED_RESOURCE_TYPE`], in any
//!    case → `reserved_resource_type`), `ce-type` (shape → `invalid_type`, disagreement
//!    with source/resource/event → `type_mismatch`), `ce-time`, `ce-schemaversion`; with
//!    `require_source_topic`, right after `ce-type`: a record of a topic named
//!    `lerian.streaming.<rest>` whose `ce-source` is not `<rest>` → `source_mismatch` (failing
//!    closed: `lerian.streaming.ledger.v2` names no source, so nothing matches it); topics not
//!    starting with `lerian.streaming.` are not checked. Then the optional ones, when present:
//!    `ce-subject` empty or blank → `invalid_subject`; `ce-dataschema` not an absolute URI
//!    (see below) → `invalid_dataschema`; `ce-datacontenttype` whose type/subtype starts with
//!    `application/cloudevents` (structured or batch mode's) → `unsupported_datacontenttype`.
//! 5. **Tenant** — `ce-tenantid` absent or empty → `missing_tenant`; any other id the API would
//!    not take ([`super::tenant`]: over [`MAX_TENANT_BYTES`], leading or trailing whitespace, a
//!    whitespace, format or other invisible character such as U+00A0, U+200B, U+202E, U+FEFF) →
//!    `invalid_tenant` (no subscription or token could name that tenant, so its events could
//!    never be delivered, and an id must not look like another; control characters were refused
//!    in step 1).
//! 6. **Signature**, only with `require_signatures` (the HMAC runs only for otherwise valid records):
//!    `ce-sig` or `ce-sigkid` absent → `signature_missing`; a key id the hub does not know →
//!    `signature_unknown_key`; a known key bound to another `ce-source`, a malformed `ce-sig` or a
//!    wrong HMAC → `signature_invalid` ("a record signed by a key of another source is invalid");
//!    then, with `signature_max_age_ms` (`STREAMING_HUB_SIGNATURE_MAX_AGE`), a `ce-sigts` older
//!    than that at `now_ms`, more than 5 minutes ahead, absent or not RFC 3339 →
//!    `signature_expired`; a valid signature on a record that also carries a `ce-*` attribute
//!    outside the signed fifteen (an extension, which would reach subscribers unsigned) →
//!    `signature_invalid` naming it.
//!    Without `require_signatures` a present `ce-sig` is not verified: the hub has no duty to judge
//!    it, and verifying with an incomplete key set would quarantine good records.
//!
//! Profiles of the rules, where the issue leaves room:
//! - `ce-id`: a UUIDv7 in the 36-character hyphenated form (either hex case, one id to dedup:
//!   [`crate::hub::dedup::dedup_key`] folds it), RFC 9562 variant.
//!   Relaxed (`require_uuidv7 = false`): 1–256 bytes without control characters.
//! - `ce-time`: `YYYY-MM-DDTHH:MM:SS[.f{1,9}](Z|±HH:MM)` with a real calendar date. Upper-case `T` and
//!   `Z` only, seconds 00–59: the value is forwarded to subscribers, whose parsers (Go, Java) reject
//!   lower case and leap seconds.
//! - `ce-dataschema`: an absolute URI (CloudEvents' URI type: a scheme, RFC 3986 §4.3; a
//!   fragment is taken, as receivers' SDKs take it), in ASCII; see
//!   [`check_uri_reference`] for what is checked.
//! - `ce-schemaversion`: optional `v`, then 1–3 dot-separated decimal parts without leading zeros
//!   (the SemVer rule), each fitting a u32; no sign. A full version (3 parts) may carry a SemVer
//!   pre-release (`-rc.1`) and build (`+sha.5114f85`); the major is the first part.
//!
//! Quarantine messages name the header at fault (`header ce-type: …`), show offending values
//! escaped and clipped to 64 characters, and never show a signature or a secret.
use std::fmt::Write as _;

use super::signature::{SIGNED_HEADERS, SignatureError, SignatureKeys, is_valid_source};
use super::tenant::{TenantFault, check_tenant};

/// What ingest needs to judge records. Defaults: UUIDv7 required, 1 MiB payloads, no signatures.
#[derive(Debug, Clone)]
pub struct ClassifyConfig {
    /// `STREAMING_HUB_REQUIRE_UUIDV7` (default true).
    pub require_uuidv7: bool,
    /// `STREAMING_HUB_MAX_PAYLOAD_BYTES` (default 1 MiB).
    pub max_payload_bytes: usize,
    /// `STREAMING_HUB_REQUIRE_SIGNATURES` (default false).
    pub require_signatures: bool,
    /// `STREAMING_HUB_SIGNATURE_KEYS` (default none).
    pub keys: SignatureKeys,
    /// `STREAMING_HUB_SIGNATURE_MAX_AGE` in ms (default 0: signatures' times not checked).
    pub signature_max_age_ms: i64,
    /// `STREAMING_HUB_REQUIRE_SOURCE_TOPIC` (default false).
    pub require_source_topic: bool,
}

/// Where and when a record is judged: the topic it was read from and the clock's now.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    pub topic: &'a str,
    pub now_ms: i64,
}

/// The prefix of producer topics: `lerian.streaming.<source>` (DESIGN.md §5).
pub const PRODUCER_TOPIC_PREFIX: &str = "lerian.streaming.";

/// A producer's dead-letter or command topic (`lerian.streaming.<source>.dlq`, `.commands`):
/// never events to ingest, even when a follow pattern matches it.
pub fn is_producers_own_topic(topic: &str) -> bool {
    topic
        .strip_prefix(PRODUCER_TOPIC_PREFIX)
        .is_some_and(|rest| rest.ends_with(".dlq") || rest.ends_with(".commands"))
}

impl Default for ClassifyConfig {
    fn default() -> Self {
        ClassifyConfig {
            require_uuidv7: true,
            max_payload_bytes: 1024 * 1024,
            require_signatures: false,
            keys: SignatureKeys::default(),
            signature_max_age_ms: 0,
            require_source_topic: false,
        }
    }
}

/// The verdict on one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accept(Accepted),
    Drop,
    Quarantine(Quarantined),
}

/// What the rest of the hub needs from an accepted record (all copied from its headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// `ce-tenantid`: the inbox key.
    pub tenant: String,
    pub ce_id: String,
    pub source: String,
    pub resource_type: String,
    /// `ce-eventtype` alone; see [`Accepted::event_key`].
    pub event_type: String,
    /// Major of `ce-schemaversion`.
    pub schema_major: u32,
}

impl Accepted {
    /// `<resource>.<event>`, the `X-Lerian-Event-Type` and matching key.
    pub fn event_key(&self) -> String {
        format!("{}.{}", self.resource_type, self.event_type)
    }
}

/// Why a record is quarantined, and a message naming the header at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    pub reason: Reason,
    pub message: String,
}

/// The reason codes of `x-streaming-hub-reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    MissingHeader,
    UnsupportedSpecversion,
    InvalidId,
    InvalidSource,
    InvalidType,
    TypeMismatch,
    InvalidTime,
    InvalidSchemaversion,
    MissingTenant,
    InvalidTenant,
    DuplicateHeader,
    InvalidHeaderEncoding,
    PayloadTooLarge,
    HeadersTooLarge,
    SignatureMissing,
    SignatureInvalid,
    SignatureUnknownKey,
    SignatureExpired,
    SourceMismatch,
    SystemEventWithTenant,
    InvalidSubject,
    InvalidDataschema,
    ReservedResourceType,
    UnsupportedDatacontenttype,
}

impl Reason {
    pub const ALL: [Reason; 24] = [
        Reason::MissingHeader,
        Reason::UnsupportedSpecversion,
        Reason::InvalidId,
        Reason::InvalidSource,
        Reason::InvalidType,
        Reason::TypeMismatch,
        Reason::InvalidTime,
        Reason::InvalidSchemaversion,
        Reason::MissingTenant,
        Reason::InvalidTenant,
        Reason::DuplicateHeader,
        Reason::InvalidHeaderEncoding,
        Reason::PayloadTooLarge,
        Reason::HeadersTooLarge,
        Reason::SignatureMissing,
        Reason::SignatureInvalid,
        Reason::SignatureUnknownKey,
        Reason::SignatureExpired,
        Reason::SourceMismatch,
        Reason::SystemEventWithTenant,
        Reason::InvalidSubject,
        Reason::InvalidDataschema,
        Reason::ReservedResourceType,
        Reason::UnsupportedDatacontenttype,
    ];

    /// The stable snake_case code written to `x-streaming-hub-reason` and used as a metric label.
    pub fn code(&self) -> &'static str {
        match self {
            Reason::MissingHeader => "missing_header",
            Reason::UnsupportedSpecversion => "unsupported_specversion",
            Reason::InvalidId => "invalid_id",
            Reason::InvalidSource => "invalid_source",
            Reason::InvalidType => "invalid_type",
            Reason::TypeMismatch => "type_mismatch",
            Reason::InvalidTime => "invalid_time",
            Reason::InvalidSchemaversion => "invalid_schemaversion",
            Reason::MissingTenant => "missing_tenant",
            Reason::InvalidTenant => "invalid_tenant",
            Reason::DuplicateHeader => "duplicate_header",
            Reason::InvalidHeaderEncoding => "invalid_header_encoding",
            Reason::PayloadTooLarge => "payload_too_large",
            Reason::HeadersTooLarge => "headers_too_large",
            Reason::SignatureMissing => "signature_missing",
            Reason::SignatureInvalid => "signature_invalid",
            Reason::SignatureUnknownKey => "signature_unknown_key",
            Reason::SignatureExpired => "signature_expired",
            Reason::SourceMismatch => "source_mismatch",
            Reason::SystemEventWithTenant => "system_event_with_tenant",
            Reason::InvalidSubject => "invalid_subject",
            Reason::InvalidDataschema => "invalid_dataschema",
            Reason::ReservedResourceType => "reserved_resource_type",
            Reason::UnsupportedDatacontenttype => "unsupported_datacontenttype",
        }
    }

    /// `x-lerian-dlq-cause-kind`: `signature` for the reasons that say who may speak for a source
    /// (the signature reasons, and `source_mismatch`, the same check made by the topic's write
    /// ACL), `codec` for the rest.
    pub fn cause_kind(&self) -> &'static str {
        match self {
            Reason::SignatureMissing
            | Reason::SignatureInvalid
            | Reason::SignatureUnknownKey
            | Reason::SignatureExpired
            | Reason::SourceMismatch => "signature",
            _ => "codec",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

pub use super::tenant::MAX_TENANT_BYTES;

// Slots of the known `ce-*` headers: the 15 signed ones in canonical order, then `ce-sig`.
const SPECVERSION: usize = 0;
const ID: usize = 1;
const SOURCE: usize = 2;
const TYPE: usize = 3;
const TIME: usize = 4;
const SUBJECT: usize = 5;
const TENANTID: usize = 6;
const DATACONTENTTYPE: usize = 7;
const DATASCHEMA: usize = 8;
const SCHEMAVERSION: usize = 9;
const RESOURCETYPE: usize = 10;
const EVENTTYPE: usize = 11;
const SYSTEMEVENT: usize = 12;
const SIGKID: usize = 13;
const SIGTS: usize = 14;
const SIG: usize = 15;
const SLOTS: usize = 16;

fn slot_of(name: &str) -> Option<usize> {
    match name {
        "ce-sig" => Some(SIG),
        _ => SIGNED_HEADERS.iter().position(|known| *known == name),
    }
}

type Slots<'h> = [Option<&'h str>; SLOTS];

fn quarantine(reason: Reason, message: String) -> Quarantined {
    Quarantined { reason, message }
}

/// `"header <name>: <what>"` with the name escaped and clipped.
fn at(name: &str, what: std::fmt::Arguments<'_>) -> String {
    let mut m = String::from("header ");
    write_clipped(&mut m, name, false);
    let _ = write!(m, ": {what}");
    m
}

/// Writes `s` escaped (and quoted) and clipped to 64 characters.
fn write_clipped(out: &mut String, s: &str, quoted: bool) {
    let cut = s.char_indices().nth(64).map_or(s.len(), |(i, _)| i);
    let q = if quoted { "\"" } else { "" };
    let more = if cut < s.len() { "…" } else { "" };
    let _ = write!(out, "{q}{}{more}{q}", s[..cut].escape_debug());
}

/// A value as shown in a message: escaped, quoted, clipped.
fn shown(s: &str) -> String {
    let mut out = String::new();
    write_clipped(&mut out, s, true);
    out
}

/// A `ce-*` header name that names a CloudEvents 1.0 attribute: after `ce-`, one or more ASCII
/// letters and digits. The attribute name is the rest folded to lower case (HTTP reads header
/// names in any case); CloudEvents allows only `a-z` and `0-9` in it. Every such name is an HTTP
/// token.
fn is_attribute_header_name(name: &str) -> bool {
    name.strip_prefix("ce-")
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// A byte of an HTTP field name (RFC 9110 `tchar`).
fn is_http_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `type/subtype`, each an HTTP token, then any parameters, all in ASCII (RFC 2046 as the
/// CloudEvents `datacontenttype` attribute requires it; control characters are refused before).
fn is_media_type(s: &str) -> bool {
    let essence = s.split(';').next().unwrap_or_default().trim();
    let token = |t: &str| !t.is_empty() && t.bytes().all(is_http_token_byte);
    s.is_ascii()
        && essence
            .split_once('/')
            .is_some_and(|(ty, sub)| token(ty) && token(sub))
}

pub(crate) fn has_control(s: &str) -> bool {
    if s.is_ascii() {
        s.bytes().any(|b| b < 0x20 || b == 0x7f)
    } else {
        s.chars().any(char::is_control)
    }
}

/// What the CloudEvents HTTP binding (§3.1.3.2) has percent-encoded in a `ce-*` header value:
/// space, `"`, `%` and everything outside printable ASCII (the value's UTF-8 bytes). Kafka's
/// binding carries the values raw, so a subject like `conta 7 – João` reaches a subscriber as
/// `conta%207%20%E2%80%93%20Jo%C3%A3o`, which its CloudEvents SDK decodes back. Deliveries
/// encode with it ([`crate::dispatch::EventView`]); the size limit below is checked on it.
pub const CE_HEADER_ESCAPED: &percent_encoding::AsciiSet =
    &percent_encoding::CONTROLS.add(b' ').add(b'"').add(b'%');

/// Longest header line a `ce-*` attribute may become in a delivery, as sent: name, `: `, the
/// value (percent-encoded; `ce-datacontenttype` goes as `Content-Type: <value>`) and CRLF.
/// Receivers commonly refuse a longer line: nginx's default `large_client_header_buffers` holds
/// 8 KiB per line, name and CRLF included, so a limit on the value alone let through lines such a
/// receiver refuses at every attempt.
pub const MAX_CE_LINE_BYTES: usize = 8 * 1024;
/// Longest the `ce-*` header lines of a delivery may be together, as sent (name, `: `, value,
/// CRLF): receivers refuse a larger header block (Node's default is 16 KiB for all headers, the
/// hub's own and the subscription's custom ones included). Each value within its own limit, a
/// few long ones together were refused by such a receiver at every attempt for 28 hours.
pub const MAX_CE_TOTAL_BYTES: usize = 10 * 1024;
/// Longest `ce-resourcetype` and `ce-eventtype`, each, in bytes. Deliveries send
/// `<resource>.<event>` as `X-Lerian-Event-Type` besides the `ce-*` headers, outside
/// [`MAX_CE_TOTAL_BYTES`]: with these caps it adds at most 511 bytes (three times that once
/// percent-encoded). A key over a subscription's 255 bytes is matched by wildcards only, as
/// before (a cap on the key would have quarantined events wildcards were receiving).
pub const MAX_TYPE_NAME_BYTES: usize = 255;

/// Bytes of the header line `<name>: <value>\r\n` for a value of `value_len` bytes as sent.
fn header_line_bytes(name: &str, value_len: usize) -> usize {
    name.len() + ": ".len() + value_len + "\r\n".len()
}

/// Step 1: one pass over the headers, filling the known slots.
/// Returns the known attributes' slots and the first other `ce-*` header (an extension), if any.
fn scan<'h>(
    headers: &[(&'h str, Option<&'h [u8]>)],
) -> Result<(Slots<'h>, Option<&'h str>), Quarantined> {
    let mut slots: Slots<'h> = [None; SLOTS];
    let mut extensions: Vec<&str> = Vec::new();
    let mut total = 0;
    for &(name, value) in headers {
        if !name.starts_with("ce-") {
            continue;
        }
        let encoding = |what| Err(quarantine(Reason::InvalidHeaderEncoding, at(name, what)));
        if has_control(name) {
            return encoding(format_args!("control character in the header name"));
        }
        // Every `ce-*` header becomes an attribute of the event, and an HTTP request header of
        // each delivery: a name CloudEvents does not allow (`ce-trace_id`, `ce-partition-key`,
        // `ce-a.b`) is refused or dropped by subscribers' SDKs, and one HTTP does not allow could
        // never be sent.
        if !is_attribute_header_name(name) {
            return encoding(format_args!(
                "not a CloudEvents attribute name: after ce-, one or more ASCII letters and \
                 digits (CloudEvents 1.0 names are a-z and 0-9; header names are read in any case)"
            ));
        }
        let Some(value) = value else {
            return encoding(format_args!("null value"));
        };
        // The name the attribute goes under in a delivery: the content type as `Content-Type`.
        let sent_name = if name == "ce-datacontenttype" {
            "content-type"
        } else {
            name
        };
        // Before anything is read of it: encoded, the value only grows.
        let line = header_line_bytes(sent_name, value.len());
        if line > MAX_CE_LINE_BYTES {
            let what = format_args!(
                "at least {line} bytes as an HTTP header line (name, \": \", value, CRLF), over \
                 the limit of {MAX_CE_LINE_BYTES} bytes"
            );
            return Err(quarantine(Reason::HeadersTooLarge, at(name, what)));
        }
        let Ok(value) = std::str::from_utf8(value) else {
            return encoding(format_args!("value is not UTF-8"));
        };
        if has_control(value) {
            return encoding(format_args!("control character in the value"));
        }
        // Sent as the `Content-Type` as it is: a value HTTP cannot carry (non-ASCII) was replaced
        // by `application/json` at delivery, and a JSON receiver then refused the event for 28
        // hours before it was dead-lettered.
        if name == "ce-datacontenttype" && !is_media_type(value) {
            return encoding(format_args!(
                "not a media type (type/subtype[; parameters], in ASCII), so it cannot be sent \
                 as the Content-Type"
            ));
        }
        // Deliveries percent-encode `ce-*` values (space, `"`, `%`, non-ASCII: three bytes each
        // on the wire), all but the content type, which goes as the `Content-Type` as it is.
        let sent: usize = if name == "ce-datacontenttype" {
            value.len()
        } else {
            percent_encoding::utf8_percent_encode(value, CE_HEADER_ESCAPED)
                .map(str::len)
                .sum()
        };
        let line = header_line_bytes(sent_name, sent);
        if line > MAX_CE_LINE_BYTES {
            let what = format_args!(
                "{line} bytes as an HTTP header line (name, \": \", the value percent-encoded, \
                 CRLF), over the limit of {MAX_CE_LINE_BYTES} bytes"
            );
            return Err(quarantine(Reason::HeadersTooLarge, at(name, what)));
        }
        total += line;
        if total > MAX_CE_TOTAL_BYTES {
            let what = format_args!(
                "with this header the ce-* headers come to {total} bytes as sent over HTTP, \
                 over the limit of {MAX_CE_TOTAL_BYTES} bytes for all of them together"
            );
            return Err(quarantine(Reason::HeadersTooLarge, at(name, what)));
        }
        match slot_of(name) {
            Some(slot) if slots[slot].is_some() => {
                let m = at(name, format_args!("present more than once"));
                return Err(quarantine(Reason::DuplicateHeader, m));
            }
            Some(slot) => slots[slot] = Some(value),
            // Names reach subscribers as HTTP headers, where case does not count: `ce-Id` would
            // be a second (unsigned) `ce-id` there.
            None if name.bytes().any(|b| b.is_ascii_uppercase())
                && slot_of(&name.to_ascii_lowercase()).is_some() =>
            {
                return encoding(format_args!(
                    "a CloudEvents attribute name not in lower case; subscribers would read it as that attribute"
                ));
            }
            None => extensions.push(name),
        }
    }
    let first_extension = extensions.first().copied();
    if extensions.len() > 1 {
        let folded = |s: &str| {
            s.bytes()
                .map(|b| b.to_ascii_lowercase())
                .collect::<Vec<u8>>()
        };
        extensions.sort_unstable_by_key(|n| folded(n));
        if let Some(pair) = extensions
            .windows(2)
            .find(|w| w[0].eq_ignore_ascii_case(w[1]))
        {
            let m = at(pair[0], format_args!("present more than once"));
            return Err(quarantine(Reason::DuplicateHeader, m));
        }
    }
    Ok((slots, first_extension))
}

/// The verdict on one record. `headers` are the Kafka headers as given (name, raw value or null);
/// `value` is the record value (null counts as empty).
pub fn classify(
    headers: &[(&str, Option<&[u8]>)],
    value: Option<&[u8]>,
    cfg: &ClassifyConfig,
    arrival: Arrival<'_>,
) -> Verdict {
    if is_producers_own_topic(arrival.topic) {
        return Verdict::Drop;
    }
    let (slots, extension) = match scan(headers) {
        Ok(scanned) => scanned,
        Err(q) => return Verdict::Quarantine(q),
    };
    let value = value.unwrap_or_default();
    if value.len() > cfg.max_payload_bytes {
        let (len, max) = (value.len(), cfg.max_payload_bytes);
        let m = format!("value: {len} bytes, over the limit of {max} bytes");
        return Verdict::Quarantine(quarantine(Reason::PayloadTooLarge, m));
    }
    if slots[SYSTEMEVENT] == Some("true") {
        // System events never carry a tenant: one that does is a tenant's event flagged by
        // mistake, or a record that means both; dropped, it would be lost without a trace.
        if slots[TENANTID].is_some() {
            let m = at(
                "ce-tenantid",
                format_args!("present on a system event (ce-systemevent: true)"),
            );
            return Verdict::Quarantine(quarantine(Reason::SystemEventWithTenant, m));
        }
        return Verdict::Drop;
    }
    match (judge(&slots, value, cfg, arrival), extension) {
        // Every `ce-*` header reaches subscribers as an attribute, and the signature covers its
        // fifteen only: with signatures required, an extension would reach them unsigned (added
        // by anyone who can write the topic, to a copy of a signed record).
        (Ok(_), Some(name)) if cfg.require_signatures => {
            let m = at(
                name,
                format_args!(
                    "an attribute the signature does not cover (with signatures required, \
                     only signed attributes reach subscribers)"
                ),
            );
            Verdict::Quarantine(quarantine(Reason::SignatureInvalid, m))
        }
        (Ok(accepted), _) => Verdict::Accept(accepted),
        (Err(q), _) => Verdict::Quarantine(q),
    }
}

/// Steps 4–6 for a business event.
fn judge(
    slots: &Slots<'_>,
    value: &[u8],
    cfg: &ClassifyConfig,
    arrival: Arrival<'_>,
) -> Result<Accepted, Quarantined> {
    let required = |slot: usize| {
        slots[slot].ok_or_else(|| {
            let m = at(SIGNED_HEADERS[slot], format_args!("absent"));
            quarantine(Reason::MissingHeader, m)
        })
    };
    let bad = |reason, slot: usize, v: &str, rule: &str| {
        let m = at(SIGNED_HEADERS[slot], format_args!("{} {rule}", shown(v)));
        Err(quarantine(reason, m))
    };

    let specversion = required(SPECVERSION)?;
    if specversion != "1.0" {
        return bad(
            Reason::UnsupportedSpecversion,
            SPECVERSION,
            specversion,
            "is not 1.0",
        );
    }
    let id = required(ID)?;
    if cfg.require_uuidv7 && !is_uuidv7(id) {
        return bad(
            Reason::InvalidId,
            ID,
            id,
            "is not a UUIDv7 (hyphenated form)",
        );
    }
    if !cfg.require_uuidv7 && (id.is_empty() || id.len() > 256) {
        return bad(Reason::InvalidId, ID, id, "must be 1 to 256 bytes");
    }
    let source = required(SOURCE)?;
    if !is_valid_source(source) {
        return bad(
            Reason::InvalidSource,
            SOURCE,
            source,
            "must match ^[a-z0-9][a-z0-9_-]*$",
        );
    }
    let resource = required(RESOURCETYPE)?;
    let event = required(EVENTTYPE)?;
    for (slot, v) in [(RESOURCETYPE, resource), (EVENTTYPE, event)] {
        if v.is_empty() || v.contains('.') {
            return bad(
                Reason::InvalidType,
                slot,
                v,
                "must be non-empty without dots",
            );
        }
        if v.len() > MAX_TYPE_NAME_BYTES {
            let rule = format!(
                "is {} bytes, over {MAX_TYPE_NAME_BYTES} (it is sent again in \
                 X-Lerian-Event-Type, outside the ce-* headers' budget)",
                v.len()
            );
            return bad(Reason::InvalidType, slot, v, &rule);
        }
    }
    if is_reserved_resource_type(resource) {
        let rule = format!(
            "is reserved for the hub's own messages: its verification probe is sent with \
             X-Lerian-Event-Type: {}, and receivers tell the probe apart by it",
            crate::delivery::verify::VERIFICATION_EVENT_TYPE
        );
        return bad(Reason::ReservedResourceType, RESOURCETYPE, resource, &rule);
    }
    let ty = required(TYPE)?;
    let mut parts = ty.split('.');
    let segments = [(); 5].map(|_| parts.next().unwrap_or_default());
    if parts.next().is_some()
        || segments.iter().any(|s| s.is_empty())
        || segments[..2] != ["studio", "lerian"]
    {
        return bad(
            Reason::InvalidType,
            TYPE,
            ty,
            "is not studio.lerian.<source>.<resource>.<event>",
        );
    }
    for (segment, slot, expected) in [
        (segments[2], SOURCE, source),
        (segments[3], RESOURCETYPE, resource),
        (segments[4], EVENTTYPE, event),
    ] {
        if segment != expected {
            let rule = format!(
                "disagrees with {} {}",
                SIGNED_HEADERS[slot],
                shown(expected)
            );
            return bad(Reason::TypeMismatch, TYPE, ty, &rule);
        }
    }
    if cfg.require_source_topic {
        if let Some(topic_source) = arrival.topic.strip_prefix(PRODUCER_TOPIC_PREFIX) {
            if topic_source != source {
                let rule = format!("is not the source of topic {}", shown(arrival.topic));
                return bad(Reason::SourceMismatch, SOURCE, source, &rule);
            }
        }
    }
    let time = required(TIME)?;
    if !is_rfc3339(time) {
        return bad(
            Reason::InvalidTime,
            TIME,
            time,
            "is not an RFC 3339 date-time",
        );
    }
    let schemaversion = required(SCHEMAVERSION)?;
    let Some(schema_major) = schema_major(schemaversion) else {
        let rule = "is not a version such as 1.0.0, 1, v2 or 2.1";
        return bad(
            Reason::InvalidSchemaversion,
            SCHEMAVERSION,
            schemaversion,
            rule,
        );
    };
    // Optional, but never empty when present (CloudEvents 1.0: `subject` MUST be a non-empty
    // string, `dataschema` a non-empty URI).
    if let Some(subject) = slots[SUBJECT] {
        if subject.trim().is_empty() {
            let rule = "is empty or blank (leave ce-subject out when the event has none)";
            return bad(Reason::InvalidSubject, SUBJECT, subject, rule);
        }
    }
    if let Some(schema) = slots[DATASCHEMA] {
        if let Err(why) = check_uri_reference(schema) {
            let rule = format!("is not an absolute URI (RFC 3986 §4.3): {why}");
            return bad(Reason::InvalidDataschema, DATASCHEMA, schema, &rule);
        }
    }
    if let Some(content_type) = slots[DATACONTENTTYPE] {
        if is_cloudevents_media_type(content_type) {
            let rule = "is a CloudEvents envelope type (structured or batch mode): sent as a \
                        delivery's Content-Type, it makes receivers' CloudEvents SDKs read the \
                        body as the envelope, not as the event's data";
            return bad(
                Reason::UnsupportedDatacontenttype,
                DATACONTENTTYPE,
                content_type,
                rule,
            );
        }
    }
    let tenant = slots[TENANTID].unwrap_or_default();
    if tenant.is_empty() {
        let what = if slots[TENANTID].is_some() {
            "empty"
        } else {
            "absent"
        };
        let m = at("ce-tenantid", format_args!("{what}"));
        return Err(quarantine(Reason::MissingTenant, m));
    }
    // The rule the API holds a tenant to: an id it could not name would never be delivered, and
    // one that looks like another (a blank, an invisible character) must not pass for it.
    if let Err(fault) = check_tenant(tenant) {
        let m = match fault {
            TenantFault::TooLong { .. } => at("ce-tenantid", format_args!("{fault}")),
            _ => at("ce-tenantid", format_args!("{} {fault}", shown(tenant))),
        };
        return Err(quarantine(Reason::InvalidTenant, m));
    }
    if cfg.require_signatures {
        verify_signature(slots, source, value, &cfg.keys)?;
        if cfg.signature_max_age_ms > 0 {
            check_signature_time(slots[SIGTS], cfg.signature_max_age_ms, arrival.now_ms)?;
        }
    }
    Ok(Accepted {
        tenant: tenant.to_owned(),
        ce_id: id.to_owned(),
        source: source.to_owned(),
        resource_type: resource.to_owned(),
        event_type: event.to_owned(),
        schema_major,
    })
}

/// How far ahead of this hub's clock a signature's time may be (the producers' clocks drift).
pub const SIGNATURE_CLOCK_SKEW_MS: i64 = 5 * 60 * 1000;

/// Step 6, with `STREAMING_HUB_SIGNATURE_MAX_AGE`: a valid signature made longer ago than the
/// limit (a signed record copied and produced again), too far ahead, or without a readable time.
fn check_signature_time(
    sigts: Option<&str>,
    max_age_ms: i64,
    now_ms: i64,
) -> Result<(), Quarantined> {
    let expired = |what: std::fmt::Arguments<'_>| {
        Err(quarantine(Reason::SignatureExpired, at("ce-sigts", what)))
    };
    let Some(text) = sigts else {
        return expired(format_args!("absent; signatures must carry their time"));
    };
    let Ok(signed) = chrono::DateTime::parse_from_rfc3339(text) else {
        return expired(format_args!("{} is not an RFC 3339 time", shown(text)));
    };
    let age_ms = now_ms - signed.timestamp_millis();
    if age_ms > max_age_ms {
        return expired(format_args!(
            "signed {} s ago, over the {} s this hub accepts",
            age_ms / 1000,
            max_age_ms / 1000
        ));
    }
    if -age_ms > SIGNATURE_CLOCK_SKEW_MS {
        return expired(format_args!(
            "signed {} s ahead of this hub's clock (at most {} s accepted)",
            -age_ms / 1000,
            SIGNATURE_CLOCK_SKEW_MS / 1000
        ));
    }
    Ok(())
}

/// Step 6. Messages carry the key id (not secret) but never the signature.
fn verify_signature(
    slots: &Slots<'_>,
    source: &str,
    value: &[u8],
    keys: &SignatureKeys,
) -> Result<(), Quarantined> {
    let Some(sig) = slots[SIG] else {
        let m = at("ce-sig", format_args!("absent; signatures are required"));
        return Err(quarantine(Reason::SignatureMissing, m));
    };
    let mut fields = [None; 15];
    for (field, slot) in fields.iter_mut().zip(slots) {
        *field = slot.map(str::as_bytes);
    }
    let kid = slots[SIGKID].unwrap_or_default();
    let err = match keys.verify_fields(source, &fields, sig.as_bytes(), value) {
        Ok(()) => return Ok(()),
        Err(err) => err,
    };
    let (reason, m) = match err {
        SignatureError::MissingSig | SignatureError::MissingKid => {
            (Reason::SignatureMissing, err.to_string())
        }
        SignatureError::UnknownKey => {
            let m = at(
                "ce-sigkid",
                format_args!("key id {} not known to this hub", shown(kid)),
            );
            (Reason::SignatureUnknownKey, m)
        }
        SignatureError::WrongSource => {
            let bound = keys.source_of(kid).unwrap_or_default();
            let what = format_args!(
                "key {} is bound to source {}, not {}",
                shown(kid),
                shown(bound),
                shown(source)
            );
            (Reason::SignatureInvalid, at("ce-sigkid", what))
        }
        SignatureError::Malformed | SignatureError::Mismatch => {
            (Reason::SignatureInvalid, err.to_string())
        }
    };
    Err(quarantine(reason, m))
}

/// The resource name of the hub's own messages: the verification probe goes out as
/// `<this>.verification` ([`crate::delivery::verify::VERIFICATION_EVENT_TYPE`]).
pub const RESERVED_RESOURCE_TYPE: &str = "streaming_hub";

/// `ce-resourcetype` naming the hub's own messages, in any case (a receiver may compare
/// `X-Lerian-Event-Type` folded).
fn is_reserved_resource_type(resource: &str) -> bool {
    resource.eq_ignore_ascii_case(RESERVED_RESOURCE_TYPE)
}

/// What CloudEvents' structured and batch modes send as the `Content-Type`
/// (`application/cloudevents+json`, `application/cloudevents-batch+json`, …).
const CLOUDEVENTS_MEDIA_TYPE_PREFIX: &str = "application/cloudevents";

/// A media type whose type/subtype (before any `;` parameters, trimmed, in any case) starts with
/// `application/cloudevents`: a receiver's CloudEvents SDK takes a request with that
/// `Content-Type` for an event in structured or batch mode and reads its body as the envelope.
fn is_cloudevents_media_type(media_type: &str) -> bool {
    let essence = media_type.split(';').next().unwrap_or_default().trim();
    let prefix = CLOUDEVENTS_MEDIA_TYPE_PREFIX.as_bytes();
    essence
        .as_bytes()
        .get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// A UUIDv7 (RFC 9562 variant) in the 36-character hyphenated form, hex digits in either case.
pub(crate) fn is_uuidv7(id: &str) -> bool {
    id.len() == 36
        && uuid::Uuid::try_parse(id)
            .is_ok_and(|u| u.get_version_num() == 7 && u.get_variant() == uuid::Variant::RFC4122)
}

/// `ce-dataschema`: an absolute URI (`https://…`, `urn:…`; CloudEvents types it URI, absolute,
/// and receivers' SDKs, sdk-go's among them, refuse a relative one such as
/// `/schemas/account.json`), in ASCII. Checked: not empty; a scheme; only the characters a URI
/// holds (unreserved, reserved, `%` and two hex digits; not whitespace, `"`, `<`, `>`, `\`, `^`,
/// a backtick, `{`, `|`, `}` or non-ASCII, which must be percent-encoded; control characters were
/// refused in step 1); a part before the first `:` that comes before any `/`, `?`, `#` is a
/// scheme (`ALPHA *(ALPHA / DIGIT / + - .)`); at most one `#`; `[` and `]` only in the authority
/// (an IP literal). The rest (the authority's and the path's inner structure) is not parsed:
/// subscribers take the value as an opaque name.
fn check_uri_reference(s: &str) -> Result<(), &'static str> {
    if s.is_empty() {
        return Err("it is empty");
    }
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = |at: usize| b.get(at).is_some_and(u8::is_ascii_hexdigit);
                if !(hex(i + 1) && hex(i + 2)) {
                    return Err("a % not followed by two hex digits");
                }
                i += 3;
                continue;
            }
            c if c.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&c) => {}
            _ => {
                return Err(
                    "a character a URI does not hold (whitespace, a quote, <, >, \\, ^, \
                            `, {, |, } or non-ASCII: percent-encode it)",
                );
            }
        }
        i += 1;
    }
    let rest = match s.find([':', '/', '?', '#']) {
        Some(colon) if b[colon] == b':' => {
            let scheme = &b[..colon];
            let ok = scheme.first().is_some_and(u8::is_ascii_alphabetic)
                && scheme
                    .iter()
                    .all(|c| c.is_ascii_alphanumeric() || b"+-.".contains(c));
            if !ok {
                return Err("the part before the first : is not a scheme");
            }
            &s[colon + 1..]
        }
        _ => return Err("no scheme: an absolute URI such as https://… or urn:… is required"),
    };
    if s.bytes().filter(|&c| c == b'#').count() > 1 {
        return Err("more than one #");
    }
    let outside_authority = match rest.strip_prefix("//") {
        Some(auth) => auth.find(['/', '?', '#']).map_or("", |end| &auth[end..]),
        None => rest,
    };
    if outside_authority.contains(['[', ']']) {
        return Err("[ or ] outside the host");
    }
    Ok(())
}

/// `digits` ASCII digits at `at`, as a number.
fn digits(b: &[u8], at: usize, len: usize) -> Option<u32> {
    let field = b.get(at..at + len)?;
    field.iter().try_fold(0u32, |n, &c| {
        c.is_ascii_digit().then(|| n * 10 + u32::from(c - b'0'))
    })
}

/// `YYYY-MM-DDTHH:MM:SS[.f{1,9}](Z|±HH:MM)` with a real calendar date (see the module doc).
fn is_rfc3339(s: &str) -> bool {
    let b = s.as_bytes();
    let sep = |at: usize, c: u8| b.get(at) == Some(&c);
    let (Some(year), Some(month), Some(day)) = (digits(b, 0, 4), digits(b, 5, 2), digits(b, 8, 2))
    else {
        return false;
    };
    let (Some(hour), Some(minute), Some(second)) =
        (digits(b, 11, 2), digits(b, 14, 2), digits(b, 17, 2))
    else {
        return false;
    };
    if !(sep(4, b'-') && sep(7, b'-') && sep(10, b'T') && sep(13, b':') && sep(16, b':')) {
        return false;
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    if day == 0 || day > month_days || hour > 23 || minute > 59 || second > 59 {
        return false;
    }
    let mut i = 19;
    if sep(i, b'.') {
        let fraction = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if !(1..=9).contains(&fraction) {
            return false;
        }
        i += 1 + fraction;
    }
    match b.get(i) {
        Some(b'Z') => b.len() == i + 1,
        Some(b'+' | b'-') => {
            b.len() == i + 6
                && sep(i + 3, b':')
                && digits(b, i + 1, 2).is_some_and(|h| h <= 23)
                && digits(b, i + 4, 2).is_some_and(|m| m <= 59)
        }
        _ => false,
    }
}

/// The major of a `ce-schemaversion` (see the module doc), or `None` when malformed.
pub fn schema_major(s: &str) -> Option<u32> {
    let body = s.strip_prefix('v').unwrap_or(s);
    // A full SemVer version may carry a pre-release and a build (`2.0.0-rc.1+sha.5114f85`): the
    // core decides the major.
    let (body, build) = match body.split_once('+') {
        Some((core, build)) => (core, Some(build)),
        None => (body, None),
    };
    let (body, pre) = match body.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (body, None),
    };
    let identifiers = |text: &str, numeric_rule: bool| {
        text.split('.').all(|id| {
            !id.is_empty()
                && id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                && !(numeric_rule
                    && id.len() > 1
                    && id.starts_with('0')
                    && id.bytes().all(|c| c.is_ascii_digit()))
        })
    };
    if (pre.is_some() || build.is_some())
        && (body.split('.').count() != 3
            || !pre.is_none_or(|p| identifiers(p, true))
            || !build.is_none_or(|b| identifiers(b, false)))
    {
        return None;
    }
    let mut major = None;
    for (index, part) in body.split('.').enumerate() {
        let numeric = !part.is_empty() && part.bytes().all(|c| c.is_ascii_digit());
        if index >= 3 || !numeric || (part.len() > 1 && part.starts_with('0')) {
            return None;
        }
        let n: u32 = part.parse().ok()?;
        major.get_or_insert(n);
    }
    major
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UUID7: &str = "0190a8e2-0000-7000-8000-000000000001";
    const VECTOR_SIG: &str = "v1.AJbY2MqfEv5EvFyAS70emQDM59tj3lpf0PBYeUW0ho4";

    /// An owned record, so tests can mutate headers before borrowing them as Kafka gives them.
    #[derive(Clone, Debug)]
    struct Rec {
        headers: Vec<(String, Option<Vec<u8>>)>,
        value: Option<Vec<u8>>,
    }

    impl Rec {
        /// A record written as in VECTORS.md: `name value | name value | ...`.
        fn parse(spec: &str, value: &[u8]) -> Rec {
            let headers = spec
                .split('|')
                .map(|h| h.trim().split_once(' ').unwrap())
                .map(|(n, v)| (n.to_string(), Some(v.trim().as_bytes().to_vec())))
                .collect();
            Rec {
                headers,
                value: Some(value.to_vec()),
            }
        }

        /// VECTORS.md: the single-tenant ledger event.
        fn ledger() -> Rec {
            let spec = "ce-specversion 1.0 | ce-id 0190a8e2-0000-7000-8000-000000000001 \
                | ce-source ledger | ce-type studio.lerian.ledger.account.created \
                | ce-time 2026-03-01T09:15:00.5-03:00 | ce-schemaversion 1.0.0 \
                | ce-resourcetype account | ce-eventtype created | ce-subject acc-1 \
                | ce-datacontenttype application/json | ce-tenantid default \
                | traceparent 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            Rec::parse(spec, br#"{"id":"acc-1"}"#)
        }

        /// VECTORS.md: the system event.
        fn system() -> Rec {
            let spec = "ce-specversion 1.0 | ce-id 0190a8e2-0000-7000-8000-000000000001 \
                | ce-source platform-reaper \
                | ce-type studio.lerian.platform-reaper.platform.reaper_pass \
                | ce-time 2026-04-18T10:30:45.123456789Z | ce-schemaversion 1.0.0 \
                | ce-resourcetype platform | ce-eventtype reaper_pass \
                | ce-datacontenttype application/json | ce-systemevent true";
            Rec::parse(spec, b"{}")
        }

        /// VECTORS.md: the signed transaction, with its `ce-sig`.
        fn signed_vector() -> Rec {
            let spec = "ce-specversion 1.0 | ce-id 0190a8e2-0000-7000-8000-000000000001 \
                | ce-source ledger | ce-type studio.lerian.ledger.transaction.created \
                | ce-time 2026-09-26T12:00:00Z | ce-schemaversion 1.0.0 \
                | ce-resourcetype transaction | ce-eventtype created | ce-subject acc-1 \
                | ce-datacontenttype application/json | ce-tenantid tenant-1 | ce-sigkid k1 \
                | ce-sigts 2026-09-26T12:00:05.123456789Z \
                | ce-sig v1.AJbY2MqfEv5EvFyAS70emQDM59tj3lpf0PBYeUW0ho4";
            Rec::parse(spec, br#"{"amount":"10.00"}"#)
        }

        fn set(self, name: &str, value: &str) -> Rec {
            self.set_raw(name, Some(value.as_bytes()))
        }

        fn set_raw(mut self, name: &str, value: Option<&[u8]>) -> Rec {
            let value = value.map(<[u8]>::to_vec);
            match self.headers.iter_mut().find(|(n, _)| n == name) {
                Some(slot) => slot.1 = value,
                None => self.headers.push((name.to_string(), value)),
            }
            self
        }

        fn push(mut self, name: &str, value: &str) -> Rec {
            self.headers
                .push((name.to_string(), Some(value.as_bytes().to_vec())));
            self
        }

        fn remove(mut self, name: &str) -> Rec {
            self.headers.retain(|(n, _)| n != name);
            self
        }

        /// Sets `ce-sigkid` and a `ce-sig` computed with `secret`.
        fn signed(self, kid: &str, secret: &[u8]) -> Rec {
            let mut rec = self.remove("ce-sig").set("ce-sigkid", kid);
            let sig = {
                let h = rec.borrowed();
                super::super::signature::sign(secret, &h, rec.value.as_deref().unwrap_or_default())
            };
            rec.headers.push(("ce-sig".into(), Some(sig.into_bytes())));
            rec
        }

        fn borrowed(&self) -> Vec<(&str, Option<&[u8]>)> {
            self.headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_deref()))
                .collect()
        }

        fn classify(&self, cfg: &ClassifyConfig) -> Verdict {
            self.classify_at(cfg, VECTOR_NOW_MS)
        }

        fn classify_at(&self, cfg: &ClassifyConfig, now_ms: i64) -> Verdict {
            self.classify_from("lerian.streaming.ledger", cfg, now_ms)
        }

        fn classify_from(&self, topic: &str, cfg: &ClassifyConfig, now_ms: i64) -> Verdict {
            let arrival = Arrival { topic, now_ms };
            classify(&self.borrowed(), self.value.as_deref(), cfg, arrival)
        }
    }

    #[test]
    fn records_of_producers_dead_letter_and_command_topics_are_never_ingested() {
        let cfg = ClassifyConfig::default();
        for topic in [
            "lerian.streaming.ledger.dlq",
            "lerian.streaming.payments.commands",
        ] {
            assert!(
                matches!(Rec::ledger().classify_from(topic, &cfg, 0), Verdict::Drop),
                "{topic}"
            );
        }
        // A source whose name merely contains the word is a producer topic like any other.
        let v = Rec::ledger().classify_from("lerian.streaming.ledger", &cfg, 0);
        assert!(matches!(v, Verdict::Accept(_)), "{v:?}");
        assert!(!is_producers_own_topic("lerian.streaming.dlq_reader"));
    }

    /// A minute after the signed vector's `ce-sigts` (2026-09-26T12:00:05.123456789Z).
    const VECTOR_NOW_MS: i64 = 1_790_424_065_123;

    fn vector_secret() -> Vec<u8> {
        (0u8..32).collect()
    }

    fn signing_cfg() -> ClassifyConfig {
        let mut keys = SignatureKeys::default();
        keys.insert("k1", "ledger", &vector_secret()).unwrap();
        keys.insert("t1", "tracer", &[7u8; 32]).unwrap();
        ClassifyConfig {
            require_signatures: true,
            keys,
            ..ClassifyConfig::default()
        }
    }

    #[track_caller]
    fn assert_quarantined(verdict: Verdict, reason: Reason, header: &str) {
        match verdict {
            Verdict::Quarantine(q) => {
                assert_eq!(q.reason, reason, "{}", q.message);
                assert!(
                    q.message.contains(header),
                    "{:?} should name {header}",
                    q.message
                );
            }
            other => panic!("expected quarantine {reason}, got {other:?}"),
        }
    }

    /// The value a `ce-subject` may have for its header line to be `bytes` long as sent.
    fn subject_for_line(bytes: usize) -> String {
        "s".repeat(bytes - "ce-subject: \r\n".len())
    }

    /// nginx holds 8 KiB per header line, name and CRLF included: a value of 8 KiB passed the
    /// limit when it was on the value alone, and its line was refused at every attempt.
    #[test]
    fn a_ce_header_line_over_8_kib_as_sent_is_quarantined_and_one_at_the_limit_is_not() {
        let cfg = ClassifyConfig::default();
        accepted(
            Rec::ledger()
                .set("ce-subject", &subject_for_line(MAX_CE_LINE_BYTES))
                .classify(&cfg),
        );
        let over = subject_for_line(MAX_CE_LINE_BYTES + 1);
        assert!(over.len() < MAX_CE_LINE_BYTES, "a value under 8 KiB");
        assert_quarantined(
            Rec::ledger().set("ce-subject", &over).classify(&cfg),
            Reason::HeadersTooLarge,
            "ce-subject",
        );
        let value_of_8_kib = "s".repeat(MAX_CE_LINE_BYTES);
        assert_quarantined(
            Rec::ledger()
                .set("ce-subject", &value_of_8_kib)
                .classify(&cfg),
            Reason::HeadersTooLarge,
            "ce-subject",
        );
        // The limit is on what goes on the wire: percent-encoded, "é" is 6 bytes, "%" 3.
        let value_room = subject_for_line(MAX_CE_LINE_BYTES).len();
        let encoded_at_limit = "\u{e9}".repeat(value_room / 6);
        assert_eq!(encoded_at_limit.len() * 3, value_room);
        accepted(
            Rec::ledger()
                .set("ce-subject", &encoded_at_limit)
                .classify(&cfg),
        );
        let encoded_over = format!("{encoded_at_limit}%");
        assert!(encoded_over.len() < value_room, "short before encoding");
        assert_quarantined(
            Rec::ledger()
                .set("ce-subject", &encoded_over)
                .classify(&cfg),
            Reason::HeadersTooLarge,
            "ce-subject",
        );
        // The content type is sent as it is (encoded, these spaces would pass the limit), under
        // the name `Content-Type`.
        let long_type = format!("text/plain; a=\"{}\"", " ".repeat(4000));
        accepted(
            Rec::ledger()
                .set("ce-datacontenttype", &long_type)
                .classify(&cfg),
        );
        let type_for_line = |bytes: usize| {
            let room = bytes - "Content-Type: \r\n".len() - "text/plain; a=".len();
            format!("text/plain; a={}", "b".repeat(room))
        };
        accepted(
            Rec::ledger()
                .set("ce-datacontenttype", &type_for_line(MAX_CE_LINE_BYTES))
                .classify(&cfg),
        );
        assert_quarantined(
            Rec::ledger()
                .set("ce-datacontenttype", &type_for_line(MAX_CE_LINE_BYTES + 1))
                .classify(&cfg),
            Reason::HeadersTooLarge,
            "ce-datacontenttype",
        );
    }

    #[track_caller]
    fn accepted(verdict: Verdict) -> Accepted {
        match verdict {
            Verdict::Accept(a) => a,
            other => panic!("expected accept, got {other:?}"),
        }
    }

    /// The ledger event with `header` set to each of `values` is quarantined for `reason` (the
    /// message naming the header), under the default configuration.
    #[track_caller]
    fn quarantined_with_each(header: &str, values: &[&str], reason: Reason) {
        for value in values {
            let rec = Rec::ledger().set(header, value);
            assert_quarantined(rec.classify(&ClassifyConfig::default()), reason, header);
        }
    }

    /// The ledger event with `header` set to each of `values` is accepted.
    #[track_caller]
    fn accepted_with_each(header: &str, values: &[&str]) {
        for value in values {
            accepted(
                Rec::ledger()
                    .set(header, value)
                    .classify(&ClassifyConfig::default()),
            );
        }
    }

    /// Expected verdict of a table row: accept, drop, or quarantine naming a header.
    enum Expect {
        Pass,
        Gone,
        Q(Reason, &'static str),
    }

    #[test]
    fn one_record_per_verdict_and_per_reason_gets_exactly_that_verdict() {
        use Expect::*;
        use Reason::*;
        let plain = &ClassifyConfig::default();
        let small = &ClassifyConfig {
            max_payload_bytes: 8,
            ..ClassifyConfig::default()
        };
        let signing = &signing_cfg();
        let strict_topics = &ClassifyConfig {
            require_source_topic: true,
            ..ClassifyConfig::default()
        };
        let aging = &ClassifyConfig {
            signature_max_age_ms: 30_000,
            ..signing_cfg()
        };
        let ledger = Rec::ledger;
        let other_type = "studio.lerian.ledger.account.deleted";
        let table: Vec<(&str, Rec, &ClassifyConfig, Expect)> = vec![
            ("accept", ledger(), plain, Pass),
            ("drop", Rec::system(), plain, Gone),
            (
                "missing",
                ledger().remove("ce-time"),
                plain,
                Q(MissingHeader, "ce-time"),
            ),
            (
                "specversion",
                ledger().set("ce-specversion", "0.3"),
                plain,
                Q(UnsupportedSpecversion, "ce-specversion"),
            ),
            (
                "id",
                ledger().set("ce-id", "42"),
                plain,
                Q(InvalidId, "ce-id"),
            ),
            (
                "source",
                ledger().set("ce-source", "Ledger"),
                plain,
                Q(InvalidSource, "ce-source"),
            ),
            (
                "type",
                ledger().set("ce-type", "a.b.c.d.e"),
                plain,
                Q(InvalidType, "ce-type"),
            ),
            (
                "mismatch",
                ledger().set("ce-type", other_type),
                plain,
                Q(TypeMismatch, "ce-type"),
            ),
            (
                "time",
                ledger().set("ce-time", "2026-03-01"),
                plain,
                Q(InvalidTime, "ce-time"),
            ),
            (
                "schemaversion",
                ledger().set("ce-schemaversion", "1.0.0.0"),
                plain,
                Q(InvalidSchemaversion, "ce-schemaversion"),
            ),
            (
                "tenant",
                ledger().remove("ce-tenantid"),
                plain,
                Q(MissingTenant, "ce-tenantid"),
            ),
            (
                "long tenant",
                ledger().set("ce-tenantid", &"t".repeat(MAX_TENANT_BYTES + 1)),
                plain,
                Q(InvalidTenant, "ce-tenantid"),
            ),
            (
                "duplicate",
                ledger().push("ce-id", UUID7),
                plain,
                Q(DuplicateHeader, "ce-id"),
            ),
            (
                "encoding",
                ledger().set_raw("ce-subject", Some(b"acc-\xff")),
                plain,
                Q(InvalidHeaderEncoding, "ce-subject"),
            ),
            (
                "content type not in ASCII",
                ledger().set(
                    "ce-datacontenttype",
                    "text/plain; charset=\u{201c}utf-8\u{201d}",
                ),
                plain,
                Q(InvalidHeaderEncoding, "ce-datacontenttype"),
            ),
            (
                "content type not a media type",
                ledger().set("ce-datacontenttype", "json"),
                plain,
                Q(InvalidHeaderEncoding, "ce-datacontenttype"),
            ),
            (
                "content type with parameters",
                ledger().set("ce-datacontenttype", "text/plain; charset=utf-8"),
                plain,
                Pass,
            ),
            (
                "ce values each within their limit, too large together",
                ledger()
                    .set("ce-subject", &subject_for_line(MAX_CE_LINE_BYTES - 100))
                    .set(
                        "ce-dataschema",
                        &format!("https://s.example/{}", "d".repeat(3000)),
                    ),
                plain,
                Q(HeadersTooLarge, "ce-dataschema"),
            ),
            (
                "long ce values within the limit together",
                ledger()
                    .set("ce-subject", &subject_for_line(MAX_CE_LINE_BYTES - 100))
                    .set(
                        "ce-dataschema",
                        &format!("https://s.example/{}", "d".repeat(1000)),
                    ),
                plain,
                Pass,
            ),
            (
                "huge ce value",
                ledger().set("ce-subject", &subject_for_line(MAX_CE_LINE_BYTES + 1)),
                plain,
                Q(HeadersTooLarge, "ce-subject"),
            ),
            ("payload", ledger(), small, Q(PayloadTooLarge, "value")),
            ("unsigned", ledger(), signing, Q(SignatureMissing, "ce-sig")),
            (
                "bad sig",
                ledger().signed("k1", &[9; 32]),
                signing,
                Q(SignatureInvalid, "ce-sig"),
            ),
            (
                "unknown key",
                ledger().signed("k9", &vector_secret()),
                signing,
                Q(SignatureUnknownKey, "ce-sigkid"),
            ),
            (
                "unsigned extension",
                ledger()
                    .signed("k1", &vector_secret())
                    .set("ce-priority", "high"),
                signing,
                Q(SignatureInvalid, "ce-priority"),
            ),
            (
                "signed",
                ledger().signed("k1", &vector_secret()),
                signing,
                Pass,
            ),
            (
                "extension without required signatures",
                ledger().set("ce-priority", "high"),
                plain,
                Pass,
            ),
            (
                "other topic's source",
                tracer_source(),
                strict_topics,
                Q(SourceMismatch, "ce-source"),
            ),
            // Signed a minute before the classifying clock's now.
            (
                "old sig",
                Rec::signed_vector(),
                aging,
                Q(SignatureExpired, "ce-sigts"),
            ),
            (
                "system event with a tenant",
                Rec::system().set("ce-tenantid", "t1"),
                plain,
                Q(SystemEventWithTenant, "ce-tenantid"),
            ),
            (
                "blank subject",
                ledger().set("ce-subject", " "),
                plain,
                Q(InvalidSubject, "ce-subject"),
            ),
            (
                "dataschema not a URI",
                ledger().set("ce-dataschema", "schemas/account v1.json"),
                plain,
                Q(InvalidDataschema, "ce-dataschema"),
            ),
            (
                "dataschema",
                ledger().set("ce-dataschema", "https://schemas.example/account/v1.json"),
                plain,
                Pass,
            ),
            (
                "the hub's own resource name",
                ledger()
                    .set("ce-resourcetype", "streaming_hub")
                    .set("ce-type", "studio.lerian.ledger.streaming_hub.verification")
                    .set("ce-eventtype", "verification"),
                plain,
                Q(ReservedResourceType, "ce-resourcetype"),
            ),
            (
                "cloudevents envelope as the content type",
                ledger().set("ce-datacontenttype", "application/cloudevents+json"),
                plain,
                Q(UnsupportedDatacontenttype, "ce-datacontenttype"),
            ),
        ];
        let mut seen = std::collections::HashSet::new();
        for (name, rec, cfg, expect) in table {
            let verdict = rec.classify(cfg);
            match (expect, verdict) {
                (Pass, Verdict::Accept(_)) | (Gone, Verdict::Drop) => {}
                (Q(reason, header), Verdict::Quarantine(q)) => {
                    assert_eq!(q.reason, reason, "{name}: {}", q.message);
                    assert!(
                        q.message.contains(header),
                        "{name}: {:?} names {header}",
                        q.message
                    );
                    seen.insert(reason);
                }
                (_, verdict) => panic!("{name}: unexpected {verdict:?}"),
            }
        }
        assert_eq!(seen.len(), Reason::ALL.len(), "every reason code has a row");
    }

    /// A ledger event under resource `resource` and event `event`, its `ce-type` agreeing.
    fn ledger_event(resource: &str, event: &str) -> Rec {
        Rec::ledger()
            .set("ce-resourcetype", resource)
            .set("ce-eventtype", event)
            .set(
                "ce-type",
                &format!("studio.lerian.ledger.{resource}.{event}"),
            )
    }

    /// Receivers tell the hub's verification probe apart by `X-Lerian-Event-Type:
    /// streaming_hub.verification` (the README's example receivers do): a producer's event under
    /// that resource would be answered as a probe, or a probe taken for it.
    #[test]
    fn an_event_under_the_hubs_own_resource_name_is_quarantined() {
        let probe_type = crate::delivery::verify::VERIFICATION_EVENT_TYPE;
        assert_eq!(
            probe_type.split_once('.').map(|(resource, _)| resource),
            Some(RESERVED_RESOURCE_TYPE)
        );
        let cfg = ClassifyConfig::default();
        for (resource, event) in [
            ("streaming_hub", "verification"),
            ("streaming_hub", "created"),
            ("Streaming_Hub", "verification"),
        ] {
            let v = ledger_event(resource, event).classify(&cfg);
            assert_quarantined(v.clone(), Reason::ReservedResourceType, "ce-resourcetype");
            let Verdict::Quarantine(q) = v else {
                unreachable!()
            };
            assert!(q.message.contains(probe_type), "{}", q.message);
        }
        // Names that only look like it are a producer's to use.
        for resource in ["streaming-hub", "streaming_hubs", "hub"] {
            accepted(ledger_event(resource, "verification").classify(&cfg));
        }
        // A system event is never delivered: dropped, whatever its resource.
        let system = Rec::system().set("ce-resourcetype", "streaming_hub").set(
            "ce-type",
            "studio.lerian.platform-reaper.streaming_hub.reaper_pass",
        );
        assert_eq!(system.classify(&cfg), Verdict::Drop);
    }

    /// The content type goes out as the delivery's `Content-Type`: CloudEvents' structured and
    /// batch media types there make receivers' SDKs read the body as the envelope.
    #[test]
    fn a_cloudevents_envelope_media_type_as_the_data_content_type_is_quarantined() {
        quarantined_with_each(
            "ce-datacontenttype",
            &[
                "application/cloudevents+json",
                "application/cloudevents-batch+json",
                "application/cloudevents",
                "Application/CloudEvents+JSON; charset=utf-8",
                " application/cloudevents+json ; charset=utf-8",
            ],
            Reason::UnsupportedDatacontenttype,
        );
        accepted_with_each(
            "ce-datacontenttype",
            &[
                "application/json",
                "application/json; profile=\"application/cloudevents+json\"",
                "text/cloudevents+json",
                "application/vnd.cloudevents+json",
            ],
        );
        // A system event is never delivered: dropped, whatever its content type.
        let system = Rec::system().set("ce-datacontenttype", "application/cloudevents+json");
        assert_eq!(system.classify(&ClassifyConfig::default()), Verdict::Drop);
    }

    #[test]
    fn signed_vector_is_accepted_with_its_key() {
        let a = accepted(Rec::signed_vector().classify(&signing_cfg()));
        assert_eq!(
            (a.tenant.as_str(), a.event_key().as_str()),
            ("tenant-1", "transaction.created")
        );
    }

    #[test]
    fn signed_vector_with_a_wrong_secret_is_signature_invalid() {
        let mut cfg = signing_cfg();
        cfg.keys = SignatureKeys::default();
        cfg.keys.insert("k1", "ledger", &[0x55; 32]).unwrap();
        let verdict = Rec::signed_vector().classify(&cfg);
        assert_quarantined(verdict, Reason::SignatureInvalid, "ce-sig");
    }

    #[test]
    fn signed_vector_with_an_unknown_kid_is_signature_unknown_key() {
        let rec = Rec::signed_vector().set("ce-sigkid", "k2");
        assert_quarantined(
            rec.classify(&signing_cfg()),
            Reason::SignatureUnknownKey,
            "ce-sigkid",
        );
    }

    #[test]
    fn signed_vector_without_ce_sig_is_signature_missing() {
        let rec = Rec::signed_vector().remove("ce-sig");
        assert_quarantined(
            rec.classify(&signing_cfg()),
            Reason::SignatureMissing,
            "ce-sig",
        );
        let rec = Rec::signed_vector().remove("ce-sigkid");
        assert_quarantined(
            rec.classify(&signing_cfg()),
            Reason::SignatureMissing,
            "ce-sigkid",
        );
    }

    #[test]
    fn record_signed_by_a_key_of_another_source_is_signature_invalid() {
        let rec = Rec::ledger().signed("t1", &[7u8; 32]);
        let verdict = rec.classify(&signing_cfg());
        assert_quarantined(verdict.clone(), Reason::SignatureInvalid, "ce-sigkid");
        let Verdict::Quarantine(q) = verdict else {
            unreachable!()
        };
        assert!(q.message.contains("tracer"), "{}", q.message);
    }

    #[test]
    fn tampered_signed_header_is_signature_invalid() {
        let rec = Rec::signed_vector().set("ce-subject", "acc-2");
        assert_quarantined(
            rec.classify(&signing_cfg()),
            Reason::SignatureInvalid,
            "ce-sig",
        );
        let rec = Rec::signed_vector().remove("ce-subject");
        assert_quarantined(
            rec.classify(&signing_cfg()),
            Reason::SignatureInvalid,
            "ce-sig",
        );
    }

    #[test]
    fn signature_messages_never_show_the_signature_or_secret() {
        let secret = [0x5au8; 32];
        let rec = Rec::ledger().signed("k1", &secret);
        let Verdict::Quarantine(q) = rec.classify(&signing_cfg()) else {
            panic!()
        };
        let sig = rec
            .headers
            .iter()
            .find(|(n, _)| n == "ce-sig")
            .unwrap()
            .1
            .clone()
            .unwrap();
        let sig = String::from_utf8(sig).unwrap();
        assert!(
            !q.message.contains(&sig[3..]) && !q.message.contains("5a5a"),
            "{}",
            q.message
        );
    }

    #[test]
    fn present_signature_is_not_verified_when_not_required() {
        let rec = Rec::ledger()
            .set("ce-sigkid", "nobody")
            .set("ce-sig", "v1.garbage");
        accepted(rec.classify(&ClassifyConfig::default()));
    }

    /// `STREAMING_HUB_SIGNATURE_MAX_AGE`: a valid signature counts only within its age and up
    /// to 5 minutes ahead (a signed record copied and produced again once its dedup entry expired
    /// is refused); without the setting, times are not read.
    #[test]
    fn a_signature_older_than_the_max_age_or_ahead_of_the_clock_is_expired() {
        let cfg = ClassifyConfig {
            signature_max_age_ms: 3_600_000,
            ..signing_cfg()
        };
        let signed_at = VECTOR_NOW_MS - 60_000;
        let v = Rec::signed_vector();
        accepted(v.classify_at(&cfg, signed_at + 3_600_000));
        accepted(v.classify_at(&cfg, signed_at - 300_000));
        assert_quarantined(
            v.classify_at(&cfg, signed_at + 3_600_001),
            Reason::SignatureExpired,
            "ce-sigts",
        );
        assert_quarantined(
            v.classify_at(&cfg, signed_at - 300_001),
            Reason::SignatureExpired,
            "ce-sigts",
        );
        // Years later, the check off: accepted (its dedup entry is the only guard then).
        accepted(v.classify_at(&signing_cfg(), signed_at + 3 * 365 * 86_400_000));
        // Signed without a time, or with one that does not read: expired, never accepted.
        let secret = vector_secret();
        for (sigts, what) in [(None, "absent"), (Some("yesterday"), "RFC 3339")] {
            let rec = match sigts {
                Some(t) => Rec::ledger().set("ce-sigts", t),
                None => Rec::ledger().remove("ce-sigts"),
            }
            .signed("k1", &secret);
            accepted(rec.classify_at(&signing_cfg(), VECTOR_NOW_MS));
            match rec.classify_at(&cfg, VECTOR_NOW_MS) {
                Verdict::Quarantine(q) => {
                    assert_eq!(q.reason, Reason::SignatureExpired);
                    assert!(q.message.contains(what), "{}", q.message);
                }
                other => panic!("{other:?}"),
            }
        }
        // A bad signature stays invalid, whatever its time.
        let tampered = Rec::signed_vector().set("ce-subject", "acc-2");
        assert_quarantined(
            tampered.classify_at(&cfg, signed_at + 7_200_000),
            Reason::SignatureInvalid,
            "ce-sig",
        );
    }

    /// A ledger event read from the ledger topic (`Rec::classify` reads from there).
    fn tracer_source() -> Rec {
        Rec::ledger()
            .set("ce-source", "tracer")
            .set("ce-type", "studio.lerian.tracer.account.created")
    }

    /// `STREAMING_HUB_REQUIRE_SOURCE_TOPIC`: a record speaks for the source of the topic it was
    /// written to, so per-topic ACLs decide who may speak for a source (as signatures do).
    #[test]
    fn a_source_other_than_its_topics_is_quarantined_when_required() {
        let strict = ClassifyConfig {
            require_source_topic: true,
            ..ClassifyConfig::default()
        };
        let ledger = Rec::ledger();
        accepted(ledger.classify_from("lerian.streaming.ledger", &strict, 0));
        let v = ledger.classify_from("lerian.streaming.tracer", &strict, 0);
        match v {
            Verdict::Quarantine(q) => {
                assert_eq!(q.reason, Reason::SourceMismatch);
                assert!(
                    q.message.contains("lerian.streaming.tracer"),
                    "{}",
                    q.message
                );
            }
            other => panic!("{other:?}"),
        }
        // Off (the default): any producer topic may carry any source.
        accepted(ledger.classify_from("lerian.streaming.tracer", &ClassifyConfig::default(), 0));
        // A topic not starting with lerian.streaming. is not checked; one that does but names
        // no source matches no record (closed, not open).
        accepted(ledger.classify_from("payments-events", &strict, 0));
        assert!(matches!(
            ledger.classify_from("lerian.streaming.ledger.v2", &strict, 0),
            Verdict::Quarantine(_)
        ));
        // Checked before the signature: a validly signed record from another source's topic is
        // a mismatch, whatever its signature says.
        let signed_strict = ClassifyConfig {
            require_source_topic: true,
            ..signing_cfg()
        };
        let v = Rec::signed_vector();
        accepted(v.classify_from("lerian.streaming.ledger", &signed_strict, VECTOR_NOW_MS));
        assert_quarantined(
            v.classify_from("lerian.streaming.tracer", &signed_strict, VECTOR_NOW_MS),
            Reason::SourceMismatch,
            "ce-source",
        );
        assert_quarantined(
            v.remove("ce-sig").classify_from(
                "lerian.streaming.tracer",
                &signed_strict,
                VECTOR_NOW_MS,
            ),
            Reason::SourceMismatch,
            "lerian.streaming.tracer",
        );
        accepted(tracer_source().classify_from("lerian.streaming.tracer", &strict, 0));
    }

    #[test]
    fn system_event_is_dropped_not_quarantined() {
        assert_eq!(
            Rec::system().classify(&ClassifyConfig::default()),
            Verdict::Drop
        );
        // Even when signatures are required, or attributes beyond the structure are wrong.
        assert_eq!(Rec::system().classify(&signing_cfg()), Verdict::Drop);
        let sloppy = Rec::system().remove("ce-time").set("ce-type", "x");
        assert_eq!(sloppy.classify(&ClassifyConfig::default()), Verdict::Drop);
    }

    /// A system event never carries a tenant: one with `ce-tenantid` (a tenant's event flagged
    /// as a system event by mistake) is quarantined, not dropped without a trace.
    #[test]
    fn a_system_event_carrying_a_tenant_is_quarantined() {
        let flagged = Rec::system().set("ce-tenantid", "tenant-a");
        assert_quarantined(
            flagged.classify(&ClassifyConfig::default()),
            Reason::SystemEventWithTenant,
            "ce-tenantid",
        );
        let empty = Rec::system().set("ce-tenantid", "");
        assert_quarantined(
            empty.classify(&ClassifyConfig::default()),
            Reason::SystemEventWithTenant,
            "ce-tenantid",
        );
    }

    #[test]
    fn system_event_with_broken_header_structure_is_still_quarantined() {
        let cfg = ClassifyConfig::default();
        let garbage = Rec::system().set_raw("ce-subject", Some(b"\x00"));
        assert_quarantined(
            garbage.classify(&cfg),
            Reason::InvalidHeaderEncoding,
            "ce-subject",
        );
        let twice = Rec::system().push("ce-systemevent", "true");
        assert_quarantined(
            twice.classify(&cfg),
            Reason::DuplicateHeader,
            "ce-systemevent",
        );
        let small = ClassifyConfig {
            max_payload_bytes: 1,
            ..ClassifyConfig::default()
        };
        assert_quarantined(
            Rec::system().classify(&small),
            Reason::PayloadTooLarge,
            "value",
        );
    }

    #[test]
    fn systemevent_other_than_true_is_a_business_event() {
        let cfg = ClassifyConfig::default();
        for v in ["false", "TRUE", "1", ""] {
            let rec = Rec::system().set("ce-systemevent", v);
            assert_quarantined(rec.classify(&cfg), Reason::MissingTenant, "ce-tenantid");
        }
    }

    #[test]
    fn single_tenant_ledger_event_with_offset_time_is_accepted() {
        let a = accepted(Rec::ledger().classify(&ClassifyConfig::default()));
        let want = Accepted {
            tenant: "default".into(),
            ce_id: UUID7.into(),
            source: "ledger".into(),
            resource_type: "account".into(),
            event_type: "created".into(),
            schema_major: 1,
        };
        assert_eq!(a, want);
        assert_eq!(a.event_key(), "account.created");
    }

    #[test]
    fn real_producer_types_with_dashes_and_underscores_are_accepted() {
        let cfg = ClassifyConfig::default();
        for (source, resource, event) in [
            ("ledger", "transaction", "posted"),
            ("ledger", "balance", "config-changed"),
            ("tracer", "rule", "activated"),
            ("lender", "loan_application", "approved"),
        ] {
            let rec = Rec::ledger()
                .set("ce-source", source)
                .set("ce-resourcetype", resource)
                .set("ce-eventtype", event)
                .set(
                    "ce-type",
                    &format!("studio.lerian.{source}.{resource}.{event}"),
                );
            assert_eq!(
                accepted(rec.classify(&cfg)).event_key(),
                format!("{resource}.{event}")
            );
        }
    }

    #[test]
    fn schema_versions_parse_to_their_major() {
        let cfg = ClassifyConfig::default();
        for (v, major) in [
            ("1.0.0", 1),
            ("1", 1),
            ("v2", 2),
            ("2.1", 2),
            ("0.9", 0),
            ("v10.0.3", 10),
            ("2.0.0-rc.1", 2),
            ("1.0.0-alpha-1.0+build.5114f85", 1),
            ("3.1.4+20261130", 3),
        ] {
            let a = accepted(Rec::ledger().set("ce-schemaversion", v).classify(&cfg));
            assert_eq!(a.schema_major, major, "{v}");
        }
        let invalid = [
            "1.0.0.0",
            "x",
            "",
            "v",
            "+1",
            "-1",
            "1.",
            ".1",
            "1..0",
            "01",
            "1.0-rc.1",
            "1.0.0-",
            "1.0.0+",
            "1.0.0-rc..1",
            "1.0.0-01",
            "1.0.0-rc_1",
            "1.0.0+b+c",
            "V2",
        ];
        quarantined_with_each("ce-schemaversion", &invalid, Reason::InvalidSchemaversion);
        assert_eq!(schema_major("4294967295"), Some(u32::MAX));
        assert_eq!(schema_major("4294967296"), None);
    }

    #[test]
    fn rfc3339_times_with_any_offset_and_up_to_nanoseconds_are_accepted() {
        let good = [
            "2026-03-01T09:15:00.5-03:00",
            "2026-04-18T10:30:45.123456789Z",
            "2026-09-26T12:00:00Z",
            "2024-02-29T23:59:59+14:00",
            "2000-02-29T00:00:00-00:00",
        ];
        for t in good {
            assert!(is_rfc3339(t), "{t}");
            assert!(
                chrono::DateTime::parse_from_rfc3339(t).is_ok(),
                "chrono agrees on {t}"
            );
        }
        let bad = [
            "",
            "2026-03-01",
            "2026-03-01T09:15:00",
            "2026-03-01 09:15:00Z",
            "2026-03-01t09:15:00z",
            "2026-03-01T09:15:00.1234567890Z",
            "2026-03-01T09:15:00.Z",
            "2025-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2026-03-01T24:00:00Z",
            "2026-03-01T23:60:00Z",
            "2026-12-31T23:59:60Z",
            "2026-03-01T09:15:00+0300",
            "2026-03-01T09:15:00+24:00",
            "2026-03-01T09:15:00Z ",
            "+2026-03-01T09:15:00Z",
            "２０２６-03-01T09:15:00Z",
        ];
        for t in bad {
            assert!(!is_rfc3339(t), "{t}");
            let rec = Rec::ledger().set("ce-time", t);
            assert_quarantined(
                rec.classify(&ClassifyConfig::default()),
                Reason::InvalidTime,
                "ce-time",
            );
        }
    }

    #[test]
    fn id_must_be_a_uuidv7_unless_relaxed() {
        let strict = ClassifyConfig::default();
        let relaxed = ClassifyConfig {
            require_uuidv7: false,
            ..ClassifyConfig::default()
        };
        let v4 = "0190a8e2-0000-4000-8000-000000000001";
        let bad_variant = "0190a8e2-0000-7000-c000-000000000001";
        let simple = "0190a8e200007000800000000000000a";
        for id in [v4, bad_variant, simple, "order-42", ""] {
            let rec = Rec::ledger().set("ce-id", id);
            assert_quarantined(rec.classify(&strict), Reason::InvalidId, "ce-id");
        }
        accepted(
            Rec::ledger()
                .set("ce-id", &UUID7.to_uppercase())
                .classify(&strict),
        );
        let longest = "i".repeat(256);
        for id in ["order-42", v4, longest.as_str()] {
            accepted(Rec::ledger().set("ce-id", id).classify(&relaxed));
        }
        for id in ["", &"i".repeat(257)] {
            let rec = Rec::ledger().set("ce-id", id);
            assert_quarantined(rec.classify(&relaxed), Reason::InvalidId, "ce-id");
        }
    }

    #[test]
    fn control_characters_and_bad_utf8_are_invalid_header_encoding() {
        let cfg = ClassifyConfig::default();
        let values: [&[u8]; 7] = [
            b"a\rb",
            b"a\nb",
            b"a\0b",
            b"a\tb",
            b"a\x7fb",
            "a\u{85}b".as_bytes(),
            b"\xc3",
        ];
        for v in values {
            let rec = Rec::ledger().set_raw("ce-tenantid", Some(v));
            assert_quarantined(
                rec.classify(&cfg),
                Reason::InvalidHeaderEncoding,
                "ce-tenantid",
            );
        }
        let null = Rec::ledger().set_raw("ce-dataschema", None);
        assert_quarantined(
            null.classify(&cfg),
            Reason::InvalidHeaderEncoding,
            "ce-dataschema",
        );
        let name = Rec::ledger().push("ce-x\n", "1");
        assert_quarantined(
            name.classify(&cfg),
            Reason::InvalidHeaderEncoding,
            "ce-x\\n",
        );
        // A name HTTP does not allow could never go out as a header of a delivery.
        for bad in ["ce-foo bar", "ce-a/b", "ce-é", "ce-a:b"] {
            let name = Rec::ledger().push(bad, "1");
            assert_quarantined(name.classify(&cfg), Reason::InvalidHeaderEncoding, bad);
        }
        // An HTTP token, but no CloudEvents attribute name: see the test below.
        let token = Rec::ledger().push("ce-Trace_Id.v2", "1");
        assert_quarantined(
            token.classify(&cfg),
            Reason::InvalidHeaderEncoding,
            "ce-Trace_Id.v2",
        );
        // Non-ce headers are carried, never judged.
        let other = Rec::ledger()
            .set_raw("x-binary", Some(b"\xff\x00"))
            .set_raw("x-null", None);
        accepted(other.classify(&cfg));
        // Non-ASCII text without control characters is fine.
        accepted(Rec::ledger().set("ce-subject", "conta-çé-✓").classify(&cfg));
    }

    #[test]
    fn a_ce_name_is_a_cloudevents_attribute_name_of_letters_and_digits() {
        let cfg = ClassifyConfig::default();
        for bad in [
            "ce-trace_id",
            "ce-partition-key",
            "ce-a.b",
            "ce-",
            "ce-Trace_Id.v2",
            "ce-TRACE-ID",
            "ce-x~",
        ] {
            let rec = Rec::ledger().push(bad, "1");
            match rec.classify(&cfg) {
                Verdict::Quarantine(q) => {
                    assert_eq!(q.reason, Reason::InvalidHeaderEncoding, "{bad}");
                    assert!(
                        q.message
                            .starts_with(&format!("header {bad}: not a CloudEvents")),
                        "{}",
                        q.message
                    );
                }
                other => panic!("{bad}: {other:?}"),
            }
            // A system event too: its producer is as broken.
            let system = Rec::system().push(bad, "1");
            assert_quarantined(system.classify(&cfg), Reason::InvalidHeaderEncoding, bad);
        }
        // Upper case is read as lower case, as HTTP reads header names.
        for good in [
            "ce-traceid",
            "ce-TraceId",
            "ce-partitionkey2",
            "ce-0",
            "ce-X",
        ] {
            accepted(Rec::ledger().push(good, "1").classify(&cfg));
        }
        // Other headers are carried, never judged.
        for other in [
            "traceparent",
            "tracestate",
            "baggage-trace_id",
            "x_weird.name",
            "CE-Trace_Id",
            "ce_trace.id",
        ] {
            accepted(Rec::ledger().push(other, "1").classify(&cfg));
        }
    }

    #[test]
    fn header_names_are_case_sensitive() {
        let cfg = ClassifyConfig::default();
        let upper = Rec::ledger().remove("ce-id").push("CE-ID", UUID7);
        assert_quarantined(upper.classify(&cfg), Reason::MissingHeader, "ce-id");
        accepted(
            Rec::ledger()
                .push("Ce-Id", "whatever")
                .push("ce_id", "x")
                .classify(&cfg),
        );
    }

    #[test]
    fn names_that_differ_only_in_case_are_one_header_to_subscribers() {
        let cfg = ClassifyConfig::default();
        // An attribute in another case would reach subscribers as a second `ce-id`, `ce-tenantid`.
        for (name, value) in [
            ("ce-Id", UUID7),
            ("ce-TENANTID", "other"),
            ("ce-Sig", "v1.x"),
        ] {
            let rec = Rec::ledger().push(name, value);
            assert_quarantined(rec.classify(&cfg), Reason::InvalidHeaderEncoding, name);
        }
        let ext = Rec::ledger().push("ce-foo", "1").push("ce-FOO", "2");
        assert_quarantined(ext.classify(&cfg), Reason::DuplicateHeader, "ce-");
        accepted(
            Rec::ledger()
                .push("ce-Foo", "1")
                .push("ce-bar", "2")
                .classify(&cfg),
        );
    }

    #[test]
    fn duplicated_extension_is_duplicate_header_but_other_duplicates_are_carried() {
        let cfg = ClassifyConfig::default();
        let ext = Rec::ledger()
            .push("ce-partitionkey", "a")
            .push("ce-foo", "1")
            .push("ce-partitionkey", "a");
        assert_quarantined(
            ext.classify(&cfg),
            Reason::DuplicateHeader,
            "ce-partitionkey",
        );
        accepted(
            Rec::ledger()
                .push("traceparent", "x")
                .push("ce-partitionkey", "a")
                .classify(&cfg),
        );
    }

    #[test]
    fn resource_and_event_types_must_be_present_non_empty_and_dotless() {
        let cfg = ClassifyConfig::default();
        for h in ["ce-resourcetype", "ce-eventtype"] {
            assert_quarantined(
                Rec::ledger().remove(h).classify(&cfg),
                Reason::MissingHeader,
                h,
            );
            assert_quarantined(
                Rec::ledger().set(h, "").classify(&cfg),
                Reason::InvalidType,
                h,
            );
            assert_quarantined(
                Rec::ledger().set(h, "a.b").classify(&cfg),
                Reason::InvalidType,
                h,
            );
        }
    }

    /// Deliveries send `<resource>.<event>` as `X-Lerian-Event-Type`, outside the budget of the
    /// `ce-*` headers: each name is capped at what a subscription can name.
    #[test]
    fn resource_and_event_types_over_255_bytes_are_invalid_type() {
        let cfg = ClassifyConfig::default();
        let typed = ledger_event;
        let longest = "r".repeat(MAX_TYPE_NAME_BYTES);
        let a = accepted(typed(&longest, &longest).classify(&cfg));
        assert_eq!(a.event_key().len(), 2 * MAX_TYPE_NAME_BYTES + 1);
        // 128 two-byte characters: 256 bytes.
        let over = "ç".repeat(128);
        for (resource, event, header) in [
            (over.as_str(), "created", "ce-resourcetype"),
            ("account", over.as_str(), "ce-eventtype"),
        ] {
            match typed(resource, event).classify(&cfg) {
                Verdict::Quarantine(q) => {
                    assert_eq!(q.reason, Reason::InvalidType, "{}", q.message);
                    assert!(q.message.starts_with(&format!("header {header}: ")));
                    assert!(
                        q.message.contains("is 256 bytes, over 255"),
                        "{}",
                        q.message
                    );
                }
                other => panic!("{header}: {other:?}"),
            }
        }
    }

    #[test]
    fn type_shape_is_invalid_type_and_disagreement_is_type_mismatch() {
        let cfg = ClassifyConfig::default();
        for t in [
            "studio.lerian.ledger.account",
            "studio.lerian.ledger.account.created.v2",
            "studio.lerian..account.created",
            "studio.lerian.ledger.account.",
            "lerian.studio.ledger.account.created",
            "",
        ] {
            let rec = Rec::ledger().set("ce-type", t);
            assert_quarantined(rec.classify(&cfg), Reason::InvalidType, "ce-type");
        }
        for (t, names) in [
            ("studio.lerian.tracer.account.created", "ce-source"),
            ("studio.lerian.ledger.balance.created", "ce-resourcetype"),
            ("studio.lerian.ledger.account.updated", "ce-eventtype"),
        ] {
            let rec = Rec::ledger().set("ce-type", t);
            assert_quarantined(rec.classify(&cfg), Reason::TypeMismatch, names);
        }
    }

    #[test]
    fn a_tenant_id_is_taken_up_to_the_bytes_a_token_can_name() {
        // 85 three-byte characters and one byte: 256 bytes, the longest the API takes.
        let longest = format!("{}x", "租".repeat(85));
        assert_eq!(longest.len(), MAX_TENANT_BYTES);
        let rec = Rec::ledger().set("ce-tenantid", &longest);
        match rec.classify(&ClassifyConfig::default()) {
            Verdict::Accept(a) => {
                assert_eq!(a.tenant, longest);
                assert!(crate::api::auth::valid_tenant(&a.tenant));
            }
            other => panic!("{other:?}"),
        }
        let over = format!("{longest}x");
        assert!(!crate::api::auth::valid_tenant(&over));
        let rec = Rec::ledger().set("ce-tenantid", &over);
        match rec.classify(&ClassifyConfig::default()) {
            Verdict::Quarantine(q) => {
                assert_eq!(q.reason, Reason::InvalidTenant, "{}", q.message);
                assert_eq!(q.message, "header ce-tenantid: is 257 bytes, over 256");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tenant_id_with_whitespace_or_an_invisible_character_is_invalid_tenant() {
        let cfg = ClassifyConfig::default();
        for (tenant, what) in [
            (" tenant-1", "has leading or trailing whitespace"),
            ("tenant-1 ", "has leading or trailing whitespace"),
            ("\u{a0}tenant-1", "has leading or trailing whitespace"),
            ("   ", "has leading or trailing whitespace"),
            ("tenant\u{a0}1", "holds U+00A0 at byte 6"),
            ("tenant-1\u{200b}", "holds U+200B at byte 8"),
            ("\u{202e}1-tnanet", "holds U+202E at byte 0"),
            ("\u{feff}tenant-1", "holds U+FEFF at byte 0"),
            ("ten\u{ad}ant", "holds U+00AD at byte 3"),
        ] {
            let rec = Rec::ledger().set("ce-tenantid", tenant);
            match rec.classify(&cfg) {
                Verdict::Quarantine(q) => {
                    assert_eq!(q.reason, Reason::InvalidTenant, "{tenant:?}: {}", q.message);
                    assert!(
                        q.message.starts_with("header ce-tenantid: ") && q.message.contains(what),
                        "{tenant:?}: {}",
                        q.message
                    );
                }
                other => panic!("{tenant:?}: {other:?}"),
            }
            // The API would not name that tenant either.
            assert!(!crate::api::auth::valid_tenant(tenant), "{tenant:?}");
        }
        for tenant in ["default", "tenant-1", "租户-7", "acme_ltda.br", "acme ltda"] {
            let a = accepted(Rec::ledger().set("ce-tenantid", tenant).classify(&cfg));
            assert_eq!(a.tenant, tenant);
            assert!(crate::api::auth::valid_tenant(tenant));
        }
    }

    #[test]
    fn an_empty_or_blank_subject_is_invalid_subject() {
        let blank = ["", " ", "\u{a0}\u{3000}", "  "];
        quarantined_with_each("ce-subject", &blank, Reason::InvalidSubject);
        accepted_with_each("ce-subject", &["acc-1", " acc 1 ", "conta 7 – João"]);
        // Absent is fine: the attribute is optional.
        accepted(
            Rec::ledger()
                .remove("ce-subject")
                .classify(&ClassifyConfig::default()),
        );
    }

    #[test]
    fn a_dataschema_must_be_a_uri_reference() {
        let cfg = ClassifyConfig::default();
        for good in [
            "https://schemas.lerian.studio/ledger/account/1.0.0.json",
            "urn:lerian:schema:ledger.account:1",
            "https://schemas.lerian.studio/account.json#/definitions/v1",
            "https://[2001:db8::1]:8443/s?v=1&x=%20",
            "http://user@s.example/a(b)!*'$,;=~",
        ] {
            accepted(Rec::ledger().set("ce-dataschema", good).classify(&cfg));
        }
        for (bad, why) in [
            ("", "empty"),
            (" ", "a character a URI does not hold"),
            ("https://s.example/a b", "a character a URI does not hold"),
            (" https://s.example/a", "a character a URI does not hold"),
            (
                "https://s.example/a\u{a0}",
                "a character a URI does not hold",
            ),
            ("https://s.example/ação", "a character a URI does not hold"),
            ("https://s.example/{id}", "a character a URI does not hold"),
            ("\"https://s.example/a\"", "a character a URI does not hold"),
            (
                "https://s.example/%zz",
                "a % not followed by two hex digits",
            ),
            ("https://s.example/%2", "a % not followed by two hex digits"),
            (
                "1https://s.example/a",
                "the part before the first : is not a scheme",
            ),
            (
                "://s.example/a",
                "the part before the first : is not a scheme",
            ),
            (
                "my_schemas:account.json",
                "the part before the first : is not a scheme",
            ),
            ("/schemas/account.json", "no scheme"),
            ("account.json#/definitions/v1", "no scheme"),
            ("https://s.example/a#b#c", "more than one #"),
            ("https://s.example/a[1]", "[ or ] outside the host"),
        ] {
            let rec = Rec::ledger().set("ce-dataschema", bad);
            match rec.classify(&cfg) {
                Verdict::Quarantine(q) => {
                    assert_eq!(
                        q.reason,
                        Reason::InvalidDataschema,
                        "{bad:?}: {}",
                        q.message
                    );
                    assert!(
                        q.message.starts_with("header ce-dataschema: ") && q.message.contains(why),
                        "{bad:?}: {}",
                        q.message
                    );
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn empty_tenant_is_missing_tenant() {
        let rec = Rec::ledger().set("ce-tenantid", "");
        assert_quarantined(
            rec.classify(&ClassifyConfig::default()),
            Reason::MissingTenant,
            "ce-tenantid",
        );
    }

    #[test]
    fn payload_at_the_limit_is_accepted_and_null_value_is_empty() {
        let rec = Rec::ledger();
        let len = rec.value.as_ref().unwrap().len();
        let cfg = ClassifyConfig {
            max_payload_bytes: len,
            ..ClassifyConfig::default()
        };
        accepted(rec.classify(&cfg));
        let null = Rec {
            value: None,
            ..Rec::ledger()
        };
        accepted(null.classify(&ClassifyConfig {
            max_payload_bytes: 0,
            ..cfg
        }));
    }

    #[test]
    fn messages_clip_long_values() {
        let long = "x".repeat(10_000);
        let Verdict::Quarantine(q) = Rec::ledger()
            .set("ce-source", &long)
            .classify(&ClassifyConfig::default())
        else {
            panic!()
        };
        assert!(q.message.len() < 200, "{}", q.message);
    }

    #[test]
    fn reason_codes_are_unique_snake_case_with_their_cause_kind() {
        let codes: std::collections::HashSet<_> = Reason::ALL.iter().map(Reason::code).collect();
        assert_eq!(codes.len(), Reason::ALL.len());
        assert!(
            codes
                .iter()
                .all(|c| c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        );
        for r in Reason::ALL {
            let kind = if r.code().starts_with("signature_") || r == Reason::SourceMismatch {
                "signature"
            } else {
                "codec"
            };
            assert_eq!(r.cause_kind(), kind, "{r}");
            assert_eq!(r.to_string(), r.code());
        }
    }

    #[test]
    fn known_slots_follow_the_canonical_signature_order() {
        for (i, name) in SIGNED_HEADERS.iter().enumerate() {
            assert_eq!(slot_of(name), Some(i));
        }
        assert_eq!(slot_of("ce-sig"), Some(SIG));
        assert_eq!(SIGNED_HEADERS[TENANTID], "ce-tenantid");
        assert_eq!(SIGNED_HEADERS[SIGKID], "ce-sigkid");
        assert_eq!(slot_of("ce-other"), None);
    }

    fn header_name() -> impl Strategy<Value = String> {
        let known: Vec<String> = SIGNED_HEADERS
            .iter()
            .chain(&["ce-sig", "CE-ID", "traceparent", "ce-", "ce-x"])
            .map(|s| s.to_string())
            .collect();
        prop_oneof![
            4 => proptest::sample::select(known),
            1 => "ce-[a-z\\x00-\\x1f\\n]{0,6}",
            1 => any::<String>(),
        ]
    }

    fn header_value() -> impl Strategy<Value = Option<Vec<u8>>> {
        let plausible = [
            "1.0",
            UUID7,
            "ledger",
            "studio.lerian.ledger.account.created",
            "account",
            "created",
            "2026-03-01T09:15:00.5-03:00",
            "1.0.0",
            "v2",
            "true",
            "default",
            "k1",
            VECTOR_SIG,
            "",
            "studio.lerian...",
            "9999-99-99T99:99:99.9999999999+99:99",
            "v1.",
            "4294967296",
        ];
        let plausible: Vec<Vec<u8>> = plausible.iter().map(|s| s.as_bytes().to_vec()).collect();
        proptest::option::weighted(
            0.95,
            prop_oneof![
                3 => proptest::sample::select(plausible),
                1 => proptest::collection::vec(any::<u8>(), 0..48),
                1 => any::<String>().prop_map(String::into_bytes),
            ],
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn classify_never_panics_on_arbitrary_headers(
            headers in proptest::collection::vec((header_name(), header_value()), 0..24),
            keep in proptest::collection::vec(any::<bool>(), 14),
            value in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64)),
            relaxed in any::<bool>(),
            require_signatures in any::<bool>(),
            max_age in any::<bool>(),
        ) {
            // Start from a valid signed record, drop some of its headers, then add arbitrary ones
            // (which may duplicate or contradict the rest).
            let mut rec = Rec::signed_vector();
            let mut keep = keep.into_iter();
            rec.headers.retain(|_| keep.next().unwrap_or(true));
            rec.headers.extend(headers);
            rec.value = value;
            let cfg = ClassifyConfig {
                require_uuidv7: !relaxed,
                max_payload_bytes: 48,
                require_signatures,
                signature_max_age_ms: if max_age { 3_600_000 } else { 0 },
                ..signing_cfg()
            };
            match rec.classify(&cfg) {
                Verdict::Accept(a) => {
                    prop_assert!(!a.tenant.is_empty());
                    prop_assert!(is_valid_source(&a.source));
                }
                Verdict::Quarantine(q) => prop_assert!(q.message.starts_with("header ") || q.message.starts_with("value")),
                Verdict::Drop => {}
            }
        }

        #[test]
        fn time_and_version_parsers_never_panic(s in any::<String>()) {
            let _ = is_rfc3339(&s);
            let _ = schema_major(&s);
            let _ = is_uuidv7(&s);
        }

        #[test]
        fn generated_rfc3339_times_agree_with_chrono(
            // Up to a day before the end of 9999 UTC: a positive offset must not carry the local
            // time into year 10000, which chrono writes as `+10000` (not an RFC 3339 year).
            secs in 0i64..253_402_214_400,
            nanos in 0u32..1_000_000_000,
            digits in 0usize..10,
            offset_min in -1439i32..=1439,
        ) {
            let offset = chrono::FixedOffset::east_opt(offset_min * 60).unwrap();
            let t = chrono::DateTime::from_timestamp(secs, nanos).unwrap().with_timezone(&offset);
            let mut s = t.format("%Y-%m-%dT%H:%M:%S").to_string();
            if digits > 0 {
                let frac = format!("{nanos:09}");
                s.push('.');
                s.push_str(&frac[..digits]);
            }
            s.push_str(&t.format("%:z").to_string());
            prop_assert!(is_rfc3339(&s), "{}", s);
        }
    }
}
