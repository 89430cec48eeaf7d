//! Producer envelope signatures (`ce-sig`), as in `../shared/VECTORS.md`.
//!
//! Owns the canonical encoding producers sign, the HMAC over it, and the operator's key set
//! (`STREAMING_HUB_SIGNATURE_KEYS`).
//!
//! Wire layout of the canonical bytes:
//!
//! ```text
//! "lerian.streaming.sig.v1" 0x00
//! 15 x { presence: u8 (1 | 0), length: u32 big-endian (0 when absent), value bytes }
//!        in the order of [`SIGNED_HEADERS`]
//! SHA-256(record value), 32 bytes
//! ```
//!
//! `ce-sig` = `v1.` + unpadded base64url of HMAC-SHA256(secret, canonical bytes). Absent is not the
//! same as empty. A Kafka header with a null value counts as absent; when a header appears twice the
//! first occurrence is signed (ingest quarantines duplicated `ce-*` headers before it verifies).
//!
//! Invariants:
//! - each key id is bound to exactly one `ce-source`; a record from another source signed with that
//!   key is invalid ([`SignatureError::WrongSource`]);
//! - secrets never leave this module in readable form: [`SignatureKeys`] keeps only the keyed HMAC
//!   state, its `Debug` prints key ids and sources, and [`KeySpecError`] never echoes a secret (not
//!   even a malformed entry, which could contain one);
//! - verification compares in constant time (`hmac`'s `verify_slice`);
//! - signing and verifying stream the canonical bytes into the MAC: nothing is allocated per record.
use std::collections::HashMap;
use std::fmt;

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// Domain-separation prefix of the canonical bytes (including its NUL terminator).
pub const CANONICAL_PREFIX: &[u8] = b"lerian.streaming.sig.v1\0";

/// The 15 headers covered by a signature, in canonical order.
pub const SIGNED_HEADERS: [&str; 15] = [
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-time",
    "ce-subject",
    "ce-tenantid",
    "ce-datacontenttype",
    "ce-dataschema",
    "ce-schemaversion",
    "ce-resourcetype",
    "ce-eventtype",
    "ce-systemevent",
    "ce-sigkid",
    "ce-sigts",
];

/// Version prefix of a `ce-sig` value.
pub const SIG_PREFIX: &str = "v1.";

/// Minimum secret length, in bytes after base64 decoding.
pub const MIN_SECRET_BYTES: usize = 32;

/// Standard alphabet, padding optional: operators paste secrets from many tools.
const SECRET_B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Signed fields looked up in Kafka headers: first occurrence wins, a null value is absent.
pub(crate) fn signed_fields<'a>(headers: &[(&str, Option<&'a [u8]>)]) -> [Option<&'a [u8]>; 15] {
    let mut fields = [None; 15];
    for (slot, name) in fields.iter_mut().zip(SIGNED_HEADERS) {
        *slot = headers
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| *v);
    }
    fields
}

/// Streams the canonical bytes of `fields` and `value` into `sink`.
fn feed_canonical(fields: &[Option<&[u8]>; 15], value: &[u8], mut sink: impl FnMut(&[u8])) {
    sink(CANONICAL_PREFIX);
    for field in fields {
        match field {
            Some(bytes) => {
                // A header over 4 GiB cannot exist in a Kafka record; saturate instead of panicking.
                let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                sink(&[1]);
                sink(&len.to_be_bytes());
                sink(bytes);
            }
            None => sink(&[0, 0, 0, 0, 0]),
        }
    }
    sink(&Sha256::digest(value));
}

/// The canonical bytes a producer signs for these headers and record value.
pub fn canonical_bytes(headers: &[(&str, Option<&[u8]>)], value: &[u8]) -> Vec<u8> {
    let fields = signed_fields(headers);
    let mut out = Vec::with_capacity(CANONICAL_PREFIX.len() + 15 * 5 + 32 + 256);
    feed_canonical(&fields, value, |b| out.extend_from_slice(b));
    out
}

fn new_mac(secret: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length: this never fails.
    <HmacSha256 as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length")
}

/// The `ce-sig` value (`v1.` + unpadded base64url HMAC-SHA256) for these headers and value.
pub fn sign(secret: &[u8], headers: &[(&str, Option<&[u8]>)], value: &[u8]) -> String {
    let mut mac = new_mac(secret);
    feed_canonical(&signed_fields(headers), value, |b| mac.update(b));
    let mut out = String::with_capacity(SIG_PREFIX.len() + 43);
    out.push_str(SIG_PREFIX);
    URL_SAFE_NO_PAD.encode_string(mac.finalize().into_bytes(), &mut out);
    out
}

/// Why a signature did not verify. Carries no secret and no signature bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("header ce-sig: absent")]
    MissingSig,
    #[error("header ce-sigkid: absent")]
    MissingKid,
    #[error("header ce-sigkid: key id not known to this hub")]
    UnknownKey,
    #[error("header ce-sigkid: key is bound to another ce-source")]
    WrongSource,
    #[error("header ce-sig: not a v1 signature (v1. + 43 base64url characters)")]
    Malformed,
    #[error("header ce-sig: signature does not match")]
    Mismatch,
}

struct Key {
    source: String,
    /// HMAC state already keyed with the secret; cloned per verification (no re-keying).
    mac: HmacSha256,
}

/// The operator's signature keys: key id → (bound `ce-source`, secret).
#[derive(Default)]
pub struct SignatureKeys {
    keys: HashMap<String, Key>,
}

impl Clone for SignatureKeys {
    fn clone(&self) -> Self {
        let keys = self
            .keys
            .iter()
            .map(|(kid, k)| {
                let key = Key {
                    source: k.source.clone(),
                    mac: k.mac.clone(),
                };
                (kid.clone(), key)
            })
            .collect();
        SignatureKeys { keys }
    }
}

impl fmt::Debug for SignatureKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut kids: Vec<(&str, &str)> = self
            .keys
            .iter()
            .map(|(kid, k)| (kid.as_str(), k.source.as_str()))
            .collect();
        kids.sort_unstable();
        let mut map = f.debug_map();
        for (kid, source) in kids {
            map.entry(&kid, &source);
        }
        map.finish()
    }
}

/// A malformed `STREAMING_HUB_SIGNATURE_KEYS`. Never carries secret material: entries are named by
/// position and key id only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeySpecError {
    #[error("signature key entry {index}: empty")]
    EmptyEntry { index: usize },
    #[error("signature key entry {index}: expected <kid>@<source>:<base64 secret>")]
    Malformed { index: usize },
    /// The key id is not shown: in an entry written in the wrong order it is the secret.
    #[error(
        "signature key entry {index}: the key id (before the '@') must match ^[a-z0-9][a-z0-9._-]{{0,63}}$"
    )]
    InvalidKid { index: usize },
    /// The source is not shown either: in an entry with the secret and source swapped, or a
    /// trailing ':', it is the secret. Nor is the key id in any error: a secret that reads as a
    /// key id (`openssl rand -hex 32`) written first, as `<secret>@<source>:<kid>`, stands in
    /// its place and fails only later, at the secret or the source.
    #[error(
        "signature key entry {index}: the source (between '@' and ':') must match ^[a-z0-9][a-z0-9_-]*$"
    )]
    InvalidSource { index: usize },
    #[error("signature key entry {index}: secret is not valid standard base64")]
    InvalidSecretEncoding { index: usize },
    #[error(
        "signature key entry {index}: secret is {len} bytes, at least {MIN_SECRET_BYTES} required"
    )]
    SecretTooShort { index: usize, len: usize },
    #[error("signature key entry {index}: its key id is defined by an earlier entry too")]
    DuplicateKid { index: usize },
}

/// `^[a-z0-9][a-z0-9._-]{0,63}$`, without a regex.
pub fn is_valid_kid(kid: &str) -> bool {
    let b = kid.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && matches!(b[0], b'a'..=b'z' | b'0'..=b'9')
        && b.iter()
            .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'))
}

/// `^[a-z0-9][a-z0-9_-]*$` (the `ce-source` rule), without a regex.
pub fn is_valid_source(source: &str) -> bool {
    let b = source.as_bytes();
    !b.is_empty()
        && matches!(b[0], b'a'..=b'z' | b'0'..=b'9')
        && b.iter()
            .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'))
}

impl SignatureKeys {
    /// Parses the env format `<kid>@<source>:<base64 secret>`, comma separated. Entries are trimmed
    /// of surrounding whitespace; a blank spec is an empty key set; an empty entry between commas is
    /// an error (it is almost always a paste mistake).
    pub fn parse(spec: &str) -> Result<SignatureKeys, KeySpecError> {
        let mut keys = SignatureKeys::default();
        if spec.trim().is_empty() {
            return Ok(keys);
        }
        for (index, entry) in spec.split(',').enumerate() {
            let entry = entry.trim();
            if entry.is_empty() {
                return Err(KeySpecError::EmptyEntry { index });
            }
            // The base64 alphabet has neither '@' nor ':', so the first of each splits unambiguously.
            let (kid, rest) = entry
                .split_once('@')
                .ok_or(KeySpecError::Malformed { index })?;
            let (source, secret_b64) = rest
                .split_once(':')
                .ok_or(KeySpecError::Malformed { index })?;
            if !is_valid_kid(kid) {
                return Err(KeySpecError::InvalidKid { index });
            }
            let secret = SECRET_B64
                .decode(secret_b64)
                .map_err(|_| KeySpecError::InvalidSecretEncoding { index })?;
            keys.insert(kid, source, &secret)?;
        }
        Ok(keys)
    }

    /// Adds one key, with the same validation as [`SignatureKeys::parse`].
    pub fn insert(&mut self, kid: &str, source: &str, secret: &[u8]) -> Result<(), KeySpecError> {
        // Entries are inserted in order, each failing one ends the parse: this is its index.
        let index = self.keys.len();
        if !is_valid_kid(kid) {
            return Err(KeySpecError::InvalidKid { index });
        }
        if !is_valid_source(source) {
            return Err(KeySpecError::InvalidSource { index });
        }
        if secret.len() < MIN_SECRET_BYTES {
            return Err(KeySpecError::SecretTooShort {
                index,
                len: secret.len(),
            });
        }
        if self.keys.contains_key(kid) {
            return Err(KeySpecError::DuplicateKid { index });
        }
        let key = Key {
            source: source.to_owned(),
            mac: new_mac(secret),
        };
        self.keys.insert(kid.to_owned(), key);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The source a key id is bound to, if the key is known.
    pub fn source_of(&self, kid: &str) -> Option<&str> {
        self.keys.get(kid).map(|k| k.source.as_str())
    }

    /// Verifies the `ce-sig` of a record whose `ce-source` is `source`.
    pub fn verify(
        &self,
        source: &str,
        headers: &[(&str, Option<&[u8]>)],
        value: &[u8],
    ) -> Result<(), SignatureError> {
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| *n == name)
                .and_then(|(_, v)| *v)
        };
        let sig = find("ce-sig").ok_or(SignatureError::MissingSig)?;
        let fields = signed_fields(headers);
        self.verify_fields(source, &fields, sig, value)
    }

    /// Verification over already-extracted signed fields (`fields[13]` is `ce-sigkid`).
    pub(crate) fn verify_fields(
        &self,
        source: &str,
        fields: &[Option<&[u8]>; 15],
        sig: &[u8],
        value: &[u8],
    ) -> Result<(), SignatureError> {
        let kid = fields[13].ok_or(SignatureError::MissingKid)?;
        let kid = std::str::from_utf8(kid).map_err(|_| SignatureError::UnknownKey)?;
        let key = self.keys.get(kid).ok_or(SignatureError::UnknownKey)?;
        if key.source != source {
            return Err(SignatureError::WrongSource);
        }
        let encoded = sig
            .strip_prefix(SIG_PREFIX.as_bytes())
            .ok_or(SignatureError::Malformed)?;
        if encoded.len() != 43 {
            return Err(SignatureError::Malformed);
        }
        let mut tag = [0u8; 48];
        let n = URL_SAFE_NO_PAD
            .decode_slice(encoded, &mut tag)
            .map_err(|_| SignatureError::Malformed)?;
        let mut mac = key.mac.clone();
        feed_canonical(fields, value, |b| mac.update(b));
        mac.verify_slice(&tag[..n])
            .map_err(|_| SignatureError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Standard base64 with padding, as operators write secrets.
    pub(crate) fn encode_secret(secret: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(secret)
    }

    const VECTOR_SIG: &str = "v1.AJbY2MqfEv5EvFyAS70emQDM59tj3lpf0PBYeUW0ho4";
    const VECTOR_VALUE: &[u8] = br#"{"amount":"10.00"}"#;

    fn vector_secret() -> Vec<u8> {
        (0u8..32).collect()
    }

    fn vector_headers() -> Vec<(&'static str, Option<&'static [u8]>)> {
        [
            ("ce-specversion", "1.0"),
            ("ce-id", "0190a8e2-0000-7000-8000-000000000001"),
            ("ce-source", "ledger"),
            ("ce-type", "studio.lerian.ledger.transaction.created"),
            ("ce-time", "2026-09-26T12:00:00Z"),
            ("ce-schemaversion", "1.0.0"),
            ("ce-resourcetype", "transaction"),
            ("ce-eventtype", "created"),
            ("ce-subject", "acc-1"),
            ("ce-datacontenttype", "application/json"),
            ("ce-tenantid", "tenant-1"),
            ("ce-sigkid", "k1"),
            ("ce-sigts", "2026-09-26T12:00:05.123456789Z"),
        ]
        .into_iter()
        .map(|(n, v)| (n, Some(v.as_bytes())))
        .collect()
    }

    fn vector_keys() -> SignatureKeys {
        SignatureKeys::parse(&format!("k1@ledger:{}", encode_secret(&vector_secret()))).unwrap()
    }

    #[test]
    fn producer_vector_signature_is_reproduced_byte_for_byte() {
        assert_eq!(
            sign(&vector_secret(), &vector_headers(), VECTOR_VALUE),
            VECTOR_SIG
        );
    }

    #[test]
    fn canonical_bytes_follow_the_documented_layout() {
        let bytes = canonical_bytes(&vector_headers(), VECTOR_VALUE);
        assert!(bytes.starts_with(b"lerian.streaming.sig.v1\0"));
        let rest = &bytes[CANONICAL_PREFIX.len()..];
        assert_eq!(&rest[..8], b"\x01\x00\x00\x00\x031.0");
        assert_eq!(
            &bytes[bytes.len() - 32..],
            Sha256::digest(VECTOR_VALUE).as_slice()
        );
        // ce-dataschema and ce-systemevent are absent: presence 0 and length 0, no value bytes.
        let absent = canonical_bytes(&[], b"");
        assert_eq!(absent.len(), CANONICAL_PREFIX.len() + 15 * 5 + 32);
    }

    #[test]
    fn absent_header_signs_differently_from_empty_header() {
        let empty = [("ce-subject", Some(&b""[..]))];
        assert_ne!(canonical_bytes(&empty, b"x"), canonical_bytes(&[], b"x"));
        assert_ne!(
            sign(&vector_secret(), &empty, b"x"),
            sign(&vector_secret(), &[], b"x")
        );
    }

    #[test]
    fn vector_verifies_with_its_key_bound_to_its_source() {
        let mut headers = vector_headers();
        headers.push(("ce-sig", Some(VECTOR_SIG.as_bytes())));
        assert_eq!(
            vector_keys().verify("ledger", &headers, VECTOR_VALUE),
            Ok(())
        );
    }

    #[test]
    fn key_of_another_source_is_wrong_source() {
        let mut headers = vector_headers();
        headers.push(("ce-sig", Some(VECTOR_SIG.as_bytes())));
        let got = vector_keys().verify("tracer", &headers, VECTOR_VALUE);
        assert_eq!(got, Err(SignatureError::WrongSource));
    }

    #[test]
    fn tampered_value_or_malformed_sig_does_not_verify() {
        let mut headers = vector_headers();
        headers.push(("ce-sig", Some(VECTOR_SIG.as_bytes())));
        let keys = vector_keys();
        assert_eq!(
            keys.verify("ledger", &headers, b"{}"),
            Err(SignatureError::Mismatch)
        );
        for bad in [
            "v2.AJbY2MqfEv5EvFyAS70emQDM59tj3lpf0PBYeUW0ho4",
            "v1.",
            "v1.!!!",
            "",
        ] {
            let last = headers.len() - 1;
            headers[last].1 = Some(bad.as_bytes());
            assert_eq!(
                keys.verify("ledger", &headers, VECTOR_VALUE),
                Err(SignatureError::Malformed)
            );
        }
        // Padded base64url is not the wire form.
        let padded = format!("{VECTOR_SIG}=");
        let last = headers.len() - 1;
        headers[last].1 = Some(padded.as_bytes());
        assert_eq!(
            keys.verify("ledger", &headers, VECTOR_VALUE),
            Err(SignatureError::Malformed)
        );
    }

    #[test]
    fn key_spec_parses_several_keys_trimmed() {
        let s = encode_secret(&[7u8; 32]);
        let keys = SignatureKeys::parse(&format!(" k1@ledger:{s} , k.2_x-y@tracer:{s}")).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.source_of("k1"), Some("ledger"));
        assert_eq!(keys.source_of("k.2_x-y"), Some("tracer"));
        assert!(SignatureKeys::parse("  ").unwrap().is_empty());
    }

    #[test]
    fn key_spec_accepts_secret_with_or_without_padding() {
        let padded = encode_secret(&[9u8; 32]);
        assert!(padded.ends_with('='));
        let unpadded = padded.trim_end_matches('=');
        assert!(SignatureKeys::parse(&format!("a@s:{padded}")).is_ok());
        assert!(SignatureKeys::parse(&format!("a@s:{unpadded}")).is_ok());
    }

    #[test]
    fn key_spec_errors_never_contain_the_secret() {
        let secret = encode_secret(b"0123456789abcdef0123456789abcdef");
        let short = encode_secret(b"too-short-secret");
        let cases = [
            format!("k1ledger{secret}"),
            format!("k1@ledger{secret}"),
            format!("K1@ledger:{secret}"),
            format!("k1@Ledger:{secret}"),
            format!("k1@ledger:{secret}!"),
            format!("k1@ledger:{short}"),
            format!("k1@ledger:{secret},k1@tracer:{secret}"),
            format!("k1@ledger:{secret},,k2@tracer:{secret}"),
            format!("{}@ledger:{secret}", "k".repeat(65)),
            // In the wrong order the secret stands where the key id belongs.
            format!("{secret}@ledger:k1"),
            // Secret and source swapped (`fees` decodes as base64), or a trailing ':': the
            // secret stands where the source belongs.
            format!("k1@{secret}:fees"),
            format!("k1@{secret}:"),
        ];
        for spec in &cases {
            let err = SignatureKeys::parse(spec).expect_err(spec);
            let shown = format!("{err} {err:?}");
            assert!(
                !shown.contains(&secret) && !shown.contains(&short),
                "{shown}"
            );
            assert!(!shown.contains("0123456789abcdef"), "{shown}");
        }
        // A hex secret (`openssl rand -hex 32`) reads as a key id: written first, it stands in
        // the key id's place and the entry fails later, at the secret or the source.
        let hex = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        for spec in [
            format!("{hex}@ledger:k1"),
            format!("{hex}@ledger:{short}"),
            format!("{hex}@Ledger:{secret}"),
            format!("k1@ledger:{secret},{hex}@ledger:{secret},{hex}@tracer:{secret}"),
        ] {
            let err = SignatureKeys::parse(&spec).expect_err(&spec);
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains(hex), "{shown}");
        }
    }

    #[test]
    fn key_spec_rejects_each_malformation_with_its_own_error() {
        let s = encode_secret(&[1u8; 32]);
        let err = |spec: String| SignatureKeys::parse(&spec).unwrap_err();
        assert!(matches!(
            err(format!("k1:{s}")),
            KeySpecError::Malformed { index: 0 }
        ));
        assert!(matches!(
            err(format!("-k@a:{s}")),
            KeySpecError::InvalidKid { .. }
        ));
        assert!(matches!(
            err(format!("k@a.b:{s}")),
            KeySpecError::InvalidSource { .. }
        ));
        assert!(matches!(
            err("k@a:%%%".into()),
            KeySpecError::InvalidSecretEncoding { .. }
        ));
        let short = encode_secret(&[1u8; 31]);
        assert!(matches!(
            err(format!("k@a:{short}")),
            KeySpecError::SecretTooShort { len: 31, .. }
        ));
        assert!(matches!(
            err(format!("k@a:{s},k@b:{s}")),
            KeySpecError::DuplicateKid { .. }
        ));
        assert!(matches!(
            err(format!("k@a:{s},")),
            KeySpecError::EmptyEntry { index: 1 }
        ));
    }

    #[test]
    fn debug_of_keys_shows_kids_and_sources_but_no_secret() {
        let secret = [0xabu8; 32];
        let mut keys = SignatureKeys::default();
        keys.insert("k1", "ledger", &secret).unwrap();
        let shown = format!("{keys:?} {:?}", keys.clone());
        assert_eq!(format!("{keys:?}"), r#"{"k1": "ledger"}"#);
        assert!(!shown.contains(&encode_secret(&secret)) && !shown.to_lowercase().contains("abab"));
    }

    #[test]
    fn kid_rule_matches_the_documented_pattern() {
        assert!(is_valid_kid("k1") && is_valid_kid("0") && is_valid_kid(&"a".repeat(64)));
        assert!(!is_valid_kid("") && !is_valid_kid(".a") && !is_valid_kid(&"a".repeat(65)));
        assert!(!is_valid_kid("a/b") && !is_valid_kid("A"));
    }
}
