//! Standard Webhooks signatures (<https://www.standardwebhooks.com/>), as sent to subscribers.
//!
//! Signed content: `<webhook-id>.<webhook-timestamp>.<body>` (the body bytes unchanged). The key is
//! the base64 decoding of the secret after its `whsec_` prefix (a secret without the prefix is
//! decoded whole, as the reference libraries do). One signature is `v1,<base64 HMAC-SHA256>`; the
//! `webhook-signature` header holds one per active secret, separated by a single space, so during a
//! secret rotation subscribers verifying with either the old or the new secret succeed.
//!
//! Errors never carry the secret nor any part of it.
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::runtime::secret::Secret;

/// The prefix signing secrets are shown with.
pub const SECRET_PREFIX: &str = "whsec_";

/// Standard alphabet; padding optional, so a secret copied without its `=` still works.
const KEY_DECODER: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SigningError {
    #[error("signing secret is not valid base64 after the `whsec_` prefix")]
    NotBase64,
    #[error("signing secret decodes to an empty key")]
    EmptyKey,
    #[error("no signing secret to sign with")]
    NoSecrets,
}

/// The decoded HMAC key of a `whsec_…` secret.
fn key(secret: &Secret) -> Result<Vec<u8>, SigningError> {
    let text = secret.expose();
    let encoded = text.strip_prefix(SECRET_PREFIX).unwrap_or(text);
    let key = KEY_DECODER
        .decode(encoded.trim())
        .map_err(|_| SigningError::NotBase64)?;
    if key.is_empty() {
        return Err(SigningError::EmptyKey);
    }
    Ok(key)
}

/// One signature: `v1,<base64 HMAC-SHA256(key, "msg_id.timestamp.body")>`.
pub fn sign(
    secret: &Secret,
    msg_id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<String, SigningError> {
    let key = key(secret)?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC accepts keys of any length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Ok(format!(
        "v1,{}",
        STANDARD.encode(mac.finalize().into_bytes())
    ))
}

/// The `webhook-signature` header value: one `v1,…` per secret, in the given order, separated by
/// a single space (rotation: the new secret and the one still in its grace period). A secret that
/// cannot sign (not base64: a record written past the API, which refuses one) is left out, as
/// one that does not open is, so the other still signs; an error only when none signs.
pub fn signature_header(
    secrets: &[Secret],
    msg_id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<String, SigningError> {
    let mut first_error = None;
    let mut signatures = Vec::with_capacity(secrets.len());
    for s in secrets {
        match sign(s, msg_id, timestamp, body) {
            Ok(sig) => signatures.push(sig),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if signatures.is_empty() {
        return Err(first_error.unwrap_or(SigningError::NoSecrets));
    }
    Ok(signatures.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    // ../shared/VECTORS.md, "Standard Webhooks signature (delivery side)".
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const MSG_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TIMESTAMP: i64 = 1614265330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn standard_webhooks_vector_is_reproduced_byte_for_byte() {
        let sig = sign(&Secret::new(SECRET), MSG_ID, TIMESTAMP, BODY).unwrap();
        assert_eq!(sig, SIGNATURE);
    }

    #[test]
    fn secret_without_prefix_signs_like_the_prefixed_one() {
        let bare = Secret::new(SECRET.strip_prefix(SECRET_PREFIX).unwrap());
        assert_eq!(sign(&bare, MSG_ID, TIMESTAMP, BODY).unwrap(), SIGNATURE);
    }

    #[test]
    fn any_change_to_id_timestamp_or_body_changes_the_signature() {
        let s = Secret::new(SECRET);
        assert_ne!(sign(&s, "msg_other", TIMESTAMP, BODY).unwrap(), SIGNATURE);
        assert_ne!(sign(&s, MSG_ID, TIMESTAMP + 1, BODY).unwrap(), SIGNATURE);
        assert_ne!(
            sign(&s, MSG_ID, TIMESTAMP, br#"{"test": 2432232315}"#).unwrap(),
            SIGNATURE
        );
    }

    #[test]
    fn rotation_header_carries_both_signatures_space_separated() {
        let old = Secret::new(SECRET);
        let new = Secret::new("whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX");
        let header = signature_header(&[new.clone(), old], MSG_ID, TIMESTAMP, BODY).unwrap();
        let parts: Vec<&str> = header.split(' ').collect();
        assert_eq!(parts.len(), 2, "{header}");
        assert_eq!(parts[0], sign(&new, MSG_ID, TIMESTAMP, BODY).unwrap());
        assert_eq!(parts[1], SIGNATURE);
        assert!(!header.contains("  "));
    }

    #[test]
    fn single_secret_header_is_one_signature() {
        let header = signature_header(&[Secret::new(SECRET)], MSG_ID, TIMESTAMP, BODY).unwrap();
        assert_eq!(header, SIGNATURE);
    }

    #[test]
    fn a_secret_that_cannot_sign_is_left_out_and_the_other_signs() {
        let bad = Secret::new("whsec_not*base64*at*all");
        let header =
            signature_header(&[bad.clone(), Secret::new(SECRET)], MSG_ID, TIMESTAMP, BODY).unwrap();
        assert_eq!(header, SIGNATURE);
        assert!(signature_header(&[bad], MSG_ID, TIMESTAMP, BODY).is_err());
    }

    #[test]
    fn no_secret_is_an_error_not_an_empty_header() {
        assert_eq!(
            signature_header(&[], MSG_ID, TIMESTAMP, BODY),
            Err(SigningError::NoSecrets)
        );
    }

    #[test]
    fn malformed_secret_error_does_not_echo_the_secret() {
        let secret = "whsec_not*base64*at*all-Sup3rS3cret";
        let e = sign(&Secret::new(secret), MSG_ID, TIMESTAMP, BODY).unwrap_err();
        assert_eq!(e, SigningError::NotBase64);
        let text = format!("{e} {e:?}");
        assert!(!text.contains("Sup3rS3cret"), "{text}");
        assert!(!text.contains("not*base64"), "{text}");
        assert_eq!(
            sign(&Secret::new("whsec_"), MSG_ID, TIMESTAMP, BODY),
            Err(SigningError::EmptyKey)
        );
    }
}
