//! The per-record verdict of ingest: accept, drop or quarantine (issue 3, DESIGN.md §2.1 and §6).
//!
//! [`classify`] is pure: Kafka headers and value in, a [`Verdict`] out. It reads routing and
//! identity from `ce-*` headers only and never parses the payload. It never panics, compiles no
//! pattern per call and allocates only the [`Accepted`] strings (and, for the rare record carrying
//! unknown `ce-*` extensions, one small list to find duplicates among them).
//!
//! Checks run in this order; the first failure is the verdict:
//! 1. **Header structure** — over every header named `ce-*` (names are case-sensitive: `CE-Id` is not
//!    a CloudEvents header and is ignored), in header order: a null value, a value that is not UTF-8
//!    or a name or value holding a control character (C0 including CR, LF, NUL; DEL; C1) →
//!    `invalid_header_encoding`; a second occurrence → `duplicate_header`. Other headers
//!    (`traceparent`, …) are carried, never judged.
//! 2. **Payload size** — over `max_payload_bytes` → `payload_too_large`. A null value is an empty one.
//! 3. **System event** — `ce-systemevent` exactly `true` → [`Verdict::Drop`]. A system event with a
//!    malformed header structure or an oversized payload is still quarantined: it is evidence of a
//!    broken producer. Any other `ce-systemevent` value means a business event.
//! 4. **Attributes**, each "absent → `missing_header`" then its own rule: `ce-specversion` (`1.0`),
//!    `ce-id`, `ce-source`, `ce-resourcetype`, `ce-eventtype` (non-empty, no dot → `invalid_type`),
//!    `ce-type` (shape → `invalid_type`, disagreement with source/resource/event → `type_mismatch`),
//!    `ce-time`, `ce-schemaversion`.
//! 5. **Tenant** — `ce-tenantid` absent or empty → `missing_tenant`.
//! 6. **Signature**, only with `require_signatures` (the HMAC runs only for otherwise valid records):
//!    `ce-sig` or `ce-sigkid` absent → `signature_missing`; a key id the hub does not know →
//!    `signature_unknown_key`; a known key bound to another `ce-source`, a malformed `ce-sig` or a
//!    wrong HMAC → `signature_invalid` ("a record signed by a key of another source is invalid").
//!    Without `require_signatures` a present `ce-sig` is not verified: the hub has no duty to judge
//!    it, and verifying with an incomplete key set would quarantine good records.
//!
//! Profiles of the rules, where the issue leaves room:
//! - `ce-id`: a UUIDv7 in the 36-character hyphenated form (either hex case), RFC 9562 variant.
//!   Relaxed (`require_uuidv7 = false`): 1–256 bytes without control characters.
//! - `ce-time`: `YYYY-MM-DDTHH:MM:SS[.f{1,9}](Z|±HH:MM)` with a real calendar date. Upper-case `T` and
//!   `Z` only, seconds 00–59: the value is forwarded to subscribers, whose parsers (Go, Java) reject
//!   lower case and leap seconds.
//! - `ce-schemaversion`: optional `v`, then 1–3 dot-separated decimal parts without leading zeros
//!   (the SemVer rule), each fitting a u32; no sign, no pre-release or build suffix.
//!
//! Quarantine messages name the header at fault (`header ce-type: …`), show offending values
//! escaped and clipped to 64 characters, and never show a signature or a secret.
use std::fmt::Write as _;

use super::signature::{SIGNED_HEADERS, SignatureError, SignatureKeys, is_valid_source};

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
}

impl Default for ClassifyConfig {
    fn default() -> Self {
        ClassifyConfig {
            require_uuidv7: true,
            max_payload_bytes: 1024 * 1024,
            require_signatures: false,
            keys: SignatureKeys::default(),
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
    DuplicateHeader,
    InvalidHeaderEncoding,
    PayloadTooLarge,
    SignatureMissing,
    SignatureInvalid,
    SignatureUnknownKey,
}

impl Reason {
    pub const ALL: [Reason; 15] = [
        Reason::MissingHeader,
        Reason::UnsupportedSpecversion,
        Reason::InvalidId,
        Reason::InvalidSource,
        Reason::InvalidType,
        Reason::TypeMismatch,
        Reason::InvalidTime,
        Reason::InvalidSchemaversion,
        Reason::MissingTenant,
        Reason::DuplicateHeader,
        Reason::InvalidHeaderEncoding,
        Reason::PayloadTooLarge,
        Reason::SignatureMissing,
        Reason::SignatureInvalid,
        Reason::SignatureUnknownKey,
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
            Reason::DuplicateHeader => "duplicate_header",
            Reason::InvalidHeaderEncoding => "invalid_header_encoding",
            Reason::PayloadTooLarge => "payload_too_large",
            Reason::SignatureMissing => "signature_missing",
            Reason::SignatureInvalid => "signature_invalid",
            Reason::SignatureUnknownKey => "signature_unknown_key",
        }
    }

    /// `x-lerian-dlq-cause-kind`: `signature` for the signature reasons, `codec` for the rest.
    pub fn cause_kind(&self) -> &'static str {
        match self {
            Reason::SignatureMissing | Reason::SignatureInvalid | Reason::SignatureUnknownKey => {
                "signature"
            }
            _ => "codec",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

// Slots of the known `ce-*` headers: the 15 signed ones in canonical order, then `ce-sig`.
const SPECVERSION: usize = 0;
const ID: usize = 1;
const SOURCE: usize = 2;
const TYPE: usize = 3;
const TIME: usize = 4;
const TENANTID: usize = 6;
const SCHEMAVERSION: usize = 9;
const RESOURCETYPE: usize = 10;
const EVENTTYPE: usize = 11;
const SYSTEMEVENT: usize = 12;
const SIG: usize = 15;
const SLOTS: usize = 16;

fn slot_of(name: &str) -> Option<usize> {
    match name {
        "ce-sig" => Some(SIG),
        _ => SIGNED_HEADERS.iter().position(|known| *known == name),
    }
}

type Slots<'h> = [Option<&'h str>; SLOTS];

fn quarantine(reason: Reason, message: String) -> Verdict {
    Verdict::Quarantine(Quarantined { reason, message })
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

fn has_control(s: &str) -> bool {
    if s.is_ascii() {
        s.bytes().any(|b| b < 0x20 || b == 0x7f)
    } else {
        s.chars().any(char::is_control)
    }
}

/// Step 1: one pass over the headers, filling the known slots.
fn scan<'h>(headers: &[(&'h str, Option<&'h [u8]>)]) -> Result<Slots<'h>, Verdict> {
    let mut slots: Slots<'h> = [None; SLOTS];
    let mut extensions: Vec<&str> = Vec::new();
    for &(name, value) in headers {
        if !name.starts_with("ce-") {
            continue;
        }
        let encoding = |what| Err(quarantine(Reason::InvalidHeaderEncoding, at(name, what)));
        if has_control(name) {
            return encoding(format_args!("control character in the header name"));
        }
        let Some(value) = value else {
            return encoding(format_args!("null value"));
        };
        let Ok(value) = std::str::from_utf8(value) else {
            return encoding(format_args!("value is not UTF-8"));
        };
        if has_control(value) {
            return encoding(format_args!("control character in the value"));
        }
        match slot_of(name) {
            Some(slot) if slots[slot].is_some() => {
                let m = at(name, format_args!("present more than once"));
                return Err(quarantine(Reason::DuplicateHeader, m));
            }
            Some(slot) => slots[slot] = Some(value),
            None => extensions.push(name),
        }
    }
    if extensions.len() > 1 {
        extensions.sort_unstable();
        if let Some(pair) = extensions.windows(2).find(|w| w[0] == w[1]) {
            let m = at(pair[0], format_args!("present more than once"));
            return Err(quarantine(Reason::DuplicateHeader, m));
        }
    }
    Ok(slots)
}

/// The verdict on one record. `headers` are the Kafka headers as given (name, raw value or null);
/// `value` is the record value (null counts as empty).
pub fn classify(
    headers: &[(&str, Option<&[u8]>)],
    value: Option<&[u8]>,
    cfg: &ClassifyConfig,
) -> Verdict {
    let slots = match scan(headers) {
        Ok(slots) => slots,
        Err(verdict) => return verdict,
    };
    let value = value.unwrap_or_default();
    if value.len() > cfg.max_payload_bytes {
        let (len, max) = (value.len(), cfg.max_payload_bytes);
        let m = format!("value: {len} bytes, over the limit of {max} bytes");
        return quarantine(Reason::PayloadTooLarge, m);
    }
    if slots[SYSTEMEVENT] == Some("true") {
        return Verdict::Drop;
    }
    match judge(&slots, value, cfg) {
        Ok(accepted) => Verdict::Accept(accepted),
        Err(verdict) => verdict,
    }
}

/// Steps 4–6 for a business event.
fn judge(slots: &Slots<'_>, value: &[u8], cfg: &ClassifyConfig) -> Result<Accepted, Verdict> {
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
        return bad(Reason::UnsupportedSpecversion, SPECVERSION, specversion, "is not 1.0");
    }
    let id = required(ID)?;
    if cfg.require_uuidv7 && !is_uuidv7(id) {
        return bad(Reason::InvalidId, ID, id, "is not a UUIDv7 (hyphenated form)");
    }
    if !cfg.require_uuidv7 && (id.is_empty() || id.len() > 256) {
        return bad(Reason::InvalidId, ID, id, "must be 1 to 256 bytes");
    }
    let source = required(SOURCE)?;
    if !is_valid_source(source) {
        return bad(Reason::InvalidSource, SOURCE, source, "must match ^[a-z0-9][a-z0-9_-]*$");
    }
    let resource = required(RESOURCETYPE)?;
    let event = required(EVENTTYPE)?;
    for (slot, v) in [(RESOURCETYPE, resource), (EVENTTYPE, event)] {
        if v.is_empty() || v.contains('.') {
            return bad(Reason::InvalidType, slot, v, "must be non-empty without dots");
        }
    }
    let ty = required(TYPE)?;
    let mut parts = ty.split('.');
    let segments = [(); 5].map(|_| parts.next().unwrap_or_default());
    if parts.next().is_some()
        || segments.iter().any(|s| s.is_empty())
        || segments[..2] != ["studio", "lerian"]
    {
        return bad(Reason::InvalidType, TYPE, ty, "is not studio.lerian.<source>.<resource>.<event>");
    }
    for (segment, slot, expected) in [
        (segments[2], SOURCE, source),
        (segments[3], RESOURCETYPE, resource),
        (segments[4], EVENTTYPE, event),
    ] {
        if segment != expected {
            let rule = format!("disagrees with {} {}", SIGNED_HEADERS[slot], shown(expected));
            return bad(Reason::TypeMismatch, TYPE, ty, &rule);
        }
    }
    let time = required(TIME)?;
    if !is_rfc3339(time) {
        return bad(Reason::InvalidTime, TIME, time, "is not an RFC 3339 date-time");
    }
    let schemaversion = required(SCHEMAVERSION)?;
    let Some(schema_major) = schema_major(schemaversion) else {
        let rule = "is not a version such as 1.0.0, 1, v2 or 2.1";
        return bad(Reason::InvalidSchemaversion, SCHEMAVERSION, schemaversion, rule);
    };
    let tenant = match slots[TENANTID] {
        Some(t) if !t.is_empty() => t,
        Some(_) => return Err(quarantine(Reason::MissingTenant, at("ce-tenantid", format_args!("empty")))),
        None => return Err(quarantine(Reason::MissingTenant, at("ce-tenantid", format_args!("absent")))),
    };
    if cfg.require_signatures {
        verify_signature(slots, source, value, &cfg.keys)?;
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

/// Step 6. Messages carry the key id (not secret) but never the signature.
fn verify_signature(
    slots: &Slots<'_>,
    source: &str,
    value: &[u8],
    keys: &SignatureKeys,
) -> Result<(), Verdict> {
    let Some(sig) = slots[SIG] else {
        let m = at("ce-sig", format_args!("absent; signatures are required"));
        return Err(quarantine(Reason::SignatureMissing, m));
    };
    let mut fields = [None; 15];
    for (field, slot) in fields.iter_mut().zip(slots) {
        *field = slot.map(str::as_bytes);
    }
    let kid = slots[13].unwrap_or_default();
    let err = match keys.verify_fields(source, &fields, sig.as_bytes(), value) {
        Ok(()) => return Ok(()),
        Err(err) => err,
    };
    let (reason, m) = match err {
        SignatureError::MissingSig | SignatureError::MissingKid => {
            (Reason::SignatureMissing, err.to_string())
        }
        SignatureError::UnknownKey => {
            let m = at("ce-sigkid", format_args!("key id {} not known to this hub", shown(kid)));
            (Reason::SignatureUnknownKey, m)
        }
        SignatureError::WrongSource => {
            let bound = keys.source_of(kid).unwrap_or_default();
            let what = format_args!("key {} is bound to source {}, not {}", shown(kid), shown(bound), shown(source));
            (Reason::SignatureInvalid, at("ce-sigkid", what))
        }
        SignatureError::Malformed | SignatureError::Mismatch => (Reason::SignatureInvalid, err.to_string()),
    };
    Err(quarantine(reason, m))
}

/// A UUIDv7 (RFC 9562 variant) in the 36-character hyphenated form.
fn is_uuidv7(id: &str) -> bool {
    id.len() == 36
        && uuid::Uuid::try_parse(id).is_ok_and(|u| {
            u.get_version_num() == 7 && u.get_variant() == uuid::Variant::RFC4122
        })
}

/// `digits` ASCII digits at `at`, as a number.
fn digits(b: &[u8], at: usize, len: usize) -> Option<u32> {
    let field = b.get(at..at + len)?;
    field.iter().try_fold(0u32, |n, &c| c.is_ascii_digit().then(|| n * 10 + u32::from(c - b'0')))
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
fn schema_major(s: &str) -> Option<u32> {
    let body = s.strip_prefix('v').unwrap_or(s);
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
}
