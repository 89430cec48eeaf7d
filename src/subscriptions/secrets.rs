//! Signing secrets and destination credentials at rest: AES-256-GCM under a key-encryption key
//! (KEK) from the environment, the subscription id as associated data (a ciphertext copied onto
//! another subscription does not open), and the KEK's id stored with each ciphertext so the KEK can
//! be rotated: new writes use `STREAMING_HUB_KEK`, old records open with `STREAMING_HUB_KEK_PREVIOUS`.
//!
//! A webhook's sensitive headers are sent in plaintext to its URL, so they are bound to the URL
//! too ([`Kek::seal_bound`]): whoever can write the control topic but holds no KEK cannot copy a
//! subscription's sealed headers into a record pointing at a URL of their own and have the hub
//! send the credentials there. Headers sealed before this binding (bound to the id only) still
//! open, reported as [`Binding::SubscriptionOnly`], for the API to show their names and for
//! `streaming-hub subscriptions reseal --bind-unbound` to seal them again bound to the URL the record sends to
//! (a one-off step of the upgrade); the delivery workers and verification probes do not send
//! them (any URL could have been written next to them) unless `STREAMING_HUB_SEND_UNBOUND_HEADERS`
//! is on, the upgrade's transition.
//!
//! Plaintext exists only in memory, as [`Secret`]: in the create and rotate responses, and in a
//! delivery worker while it signs. It never reaches a topic, a log or an error.
use std::collections::HashMap;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;
use rand::RngCore;

use crate::config::Config;
use crate::runtime::records::{EncryptedBlob, EncryptedSecret, TimestampMillis};
use crate::runtime::secret::Secret;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("a key-encryption key must be base64 of exactly 32 bytes")]
    BadKek,
    #[error("malformed key list entry {0} (expected <id>:<base64>)")]
    BadKekList(usize),
    /// A `STREAMING_HUB_KEK_PREVIOUS` entry (1-based) whose key is not base64 of 32 bytes (it
    /// was reported as the current key's fault, mid-way through a key rotation).
    #[error("key list entry {0}: its key must be base64 of exactly 32 bytes")]
    BadPreviousKek(usize),
    #[error("no key-encryption key with id {0:?} is configured")]
    UnknownKeyId(String),
    /// A `STREAMING_HUB_KEK_PREVIOUS` entry (1-based) reuses the current key's id or an earlier
    /// entry's: one of the two keys would silently replace the other.
    #[error(
        "key list entry {0}: its key id is already taken by STREAMING_HUB_KEK_ID or an earlier entry"
    )]
    DuplicateKekId(usize),
    #[error("ciphertext does not open (wrong key, wrong subscription or tampered)")]
    Open,
}

/// What [`Kek::open_live_secrets`] found.
#[derive(Default)]
pub struct LiveSecrets {
    pub opened: Vec<Secret>,
    /// Live secrets that did not open, and why the first did not.
    pub unopened: usize,
    pub first_error: Option<SecretError>,
}

/// The key-encryption keys: one current, any number of retired ones (read only).
pub struct Kek {
    current_id: String,
    keys: HashMap<String, Aes256Gcm>,
    /// `STREAMING_HUB_SEND_UNBOUND_HEADERS`: headers sealed by the id alone are sent too (an
    /// upgrade's transition, until `subscriptions reseal` has bound them).
    send_unbound: bool,
}

impl std::fmt::Debug for Kek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<&String> = self.keys.keys().collect();
        ids.sort();
        write!(
            f,
            "Kek {{ current: {:?}, ids: {ids:?}, keys: [redacted] }}",
            self.current_id
        )
    }
}

fn decode_key(b64: &str) -> Result<Aes256Gcm, SecretError> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| SecretError::BadKek)?;
    if bytes.len() != 32 {
        return Err(SecretError::BadKek);
    }
    Aes256Gcm::new_from_slice(&bytes).map_err(|_| SecretError::BadKek)
}

impl Kek {
    pub fn from_config(config: &Config) -> Result<Kek, SecretError> {
        let mut kek = Kek::new(&config.kek_id, config.kek.expose())?;
        for (i, entry) in config
            .kek_previous
            .expose()
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .enumerate()
        {
            let (id, key) = entry
                .split_once(':')
                .ok_or(SecretError::BadKekList(i + 1))?;
            if kek.keys.contains_key(id) {
                return Err(SecretError::DuplicateKekId(i + 1));
            }
            let key = decode_key(key).map_err(|_| SecretError::BadPreviousKek(i + 1))?;
            kek.keys.insert(id.to_string(), key);
        }
        kek.send_unbound = config.send_unbound_headers;
        Ok(kek)
    }

    /// Whether sensitive headers of this binding may be sent to the URL they were opened for:
    /// bound to it, or sealed by the id alone while `STREAMING_HUB_SEND_UNBOUND_HEADERS` is on.
    /// A refusal is counted and logged ([`headers_not_sent`]).
    pub fn may_send(&self, binding: Binding, subscription_id: &str) -> bool {
        match binding {
            Binding::Url => true,
            Binding::SubscriptionOnly if self.send_unbound => true,
            Binding::SubscriptionOnly => {
                headers_not_sent(subscription_id, NotSent::Unbound);
                false
            }
        }
    }

    /// A KEK from its id and base64 key.
    pub fn new(id: &str, base64_key: &str) -> Result<Kek, SecretError> {
        let mut keys = HashMap::new();
        keys.insert(id.to_string(), decode_key(base64_key)?);
        Ok(Kek {
            current_id: id.to_string(),
            keys,
            send_unbound: false,
        })
    }

    pub fn current_id(&self) -> &str {
        &self.current_id
    }

    /// Encrypts under the current key, bound to `subscription_id`.
    pub fn seal(&self, plaintext: &[u8], subscription_id: &str) -> EncryptedBlob {
        self.seal_with(plaintext, subscription_id.as_bytes())
    }

    fn seal_with(&self, plaintext: &[u8], aad: &[u8]) -> EncryptedBlob {
        let cipher = &self.keys[&self.current_id];
        let mut nonce = [0u8; 12];
        rand::thread_rng().fill_bytes(&mut nonce);
        let ciphertext = cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad,
                },
            )
            .expect("AES-GCM encryption of an in-memory buffer cannot fail");
        EncryptedBlob {
            key_id: self.current_id.clone(),
            nonce: nonce.to_vec(),
            ciphertext,
        }
    }

    pub fn open(
        &self,
        blob: &EncryptedBlob,
        subscription_id: &str,
    ) -> Result<Vec<u8>, SecretError> {
        self.open_parts(
            &blob.key_id,
            &blob.nonce,
            &blob.ciphertext,
            subscription_id.as_bytes(),
        )
    }

    /// Encrypts under the current key, bound to `subscription_id` and the destination `url` the
    /// plaintext will be sent to (sensitive headers).
    pub fn seal_bound(&self, plaintext: &[u8], subscription_id: &str, url: &str) -> EncryptedBlob {
        self.seal_with(plaintext, &bound_aad(subscription_id, url))
    }

    /// Opens what [`Kek::seal_bound`] sealed for this subscription and URL, or what was sealed
    /// for the subscription alone before headers were bound to their URL (which says so).
    pub fn open_bound(
        &self,
        blob: &EncryptedBlob,
        subscription_id: &str,
        url: &str,
    ) -> Result<(Vec<u8>, Binding), SecretError> {
        let (key_id, nonce, ct) = (&blob.key_id, &blob.nonce, &blob.ciphertext);
        match self.open_parts(key_id, nonce, ct, &bound_aad(subscription_id, url)) {
            Ok(plain) => Ok((plain, Binding::Url)),
            Err(SecretError::Open) => self
                .open_parts(key_id, nonce, ct, subscription_id.as_bytes())
                .map(|plain| (plain, Binding::SubscriptionOnly)),
            Err(e) => Err(e),
        }
    }

    /// Seals a webhook URL past its host (`target`: path, query, fragment), bound to
    /// `subscription_id` and the URL as shown (`shown`, redacted): see
    /// [`crate::subscriptions::sealed_url`].
    pub fn seal_url_target(
        &self,
        target: &str,
        subscription_id: &str,
        shown: &str,
    ) -> EncryptedBlob {
        self.seal_with(
            target.as_bytes(),
            &tagged_aad(URL_TARGET_TAG, subscription_id, shown),
        )
    }

    /// Opens what [`Kek::seal_url_target`] sealed for this subscription and shown URL.
    pub fn open_url_target(
        &self,
        blob: &EncryptedBlob,
        subscription_id: &str,
        shown: &str,
    ) -> Result<String, SecretError> {
        let aad = tagged_aad(URL_TARGET_TAG, subscription_id, shown);
        let plain = self.open_parts(&blob.key_id, &blob.nonce, &blob.ciphertext, &aad)?;
        String::from_utf8(plain).map_err(|_| SecretError::Open)
    }

    fn open_parts(
        &self,
        key_id: &str,
        nonce: &[u8],
        ciphertext: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, SecretError> {
        let cipher = self
            .keys
            .get(key_id)
            .ok_or_else(|| SecretError::UnknownKeyId(key_id.to_string()))?;
        if nonce.len() != 12 {
            return Err(SecretError::Open);
        }
        cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .map_err(|_| SecretError::Open)
    }

    /// Seals a signing secret; `expires_at` is set for a rotated-out secret.
    pub fn seal_secret(
        &self,
        secret: &Secret,
        subscription_id: &str,
        expires_at: Option<TimestampMillis>,
    ) -> EncryptedSecret {
        let b = self.seal(secret.expose().as_bytes(), subscription_id);
        EncryptedSecret {
            key_id: b.key_id,
            nonce: b.nonce,
            ciphertext: b.ciphertext,
            expires_at,
        }
    }

    pub fn open_secret(
        &self,
        s: &EncryptedSecret,
        subscription_id: &str,
    ) -> Result<Secret, SecretError> {
        let plain = self.open_parts(
            &s.key_id,
            &s.nonce,
            &s.ciphertext,
            subscription_id.as_bytes(),
        )?;
        String::from_utf8(plain)
            .map(Secret::new)
            .map_err(|_| SecretError::Open)
    }

    /// The secrets to sign with at `now`: every one not yet expired that opens, in their order
    /// (current first). One that does not open (sealed under a key this instance lacks, as in
    /// a rolling key rotation, or copied from another record) is left out, so a rotation's other
    /// secret still signs: deliveries, verification probes and the API's probes all sign so.
    pub fn open_live_secrets(
        &self,
        sealed: &[EncryptedSecret],
        subscription_id: &str,
        now: TimestampMillis,
    ) -> LiveSecrets {
        let mut live = LiveSecrets::default();
        for s in sealed
            .iter()
            .filter(|s| s.expires_at.is_none_or(|t| t > now))
        {
            match self.open_secret(s, subscription_id) {
                Ok(secret) => live.opened.push(secret),
                Err(e) => {
                    live.unopened += 1;
                    live.first_error.get_or_insert(e);
                }
            }
        }
        live
    }

    /// Re-encrypts a secret under the current key (KEK rotation); a no-op for current ones.
    pub fn reseal_secret(
        &self,
        s: &EncryptedSecret,
        subscription_id: &str,
    ) -> Result<EncryptedSecret, SecretError> {
        if s.key_id == self.current_id {
            return Ok(s.clone());
        }
        let plain = self.open_secret(s, subscription_id)?;
        Ok(self.seal_secret(&plain, subscription_id, s.expires_at))
    }
}

/// A new Standard Webhooks signing secret: `whsec_` + base64 of 32 random bytes.
pub fn generate_signing_secret() -> Secret {
    let mut key = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut key);
    Secret::new(format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(key)
    ))
}

/// What a sealed blob of sensitive headers is bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// The subscription id and the destination URL.
    Url,
    /// The subscription id alone: sealed before headers were bound to their URL.
    SubscriptionOnly,
}

/// Why a subscription's sealed headers were not sent with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotSent {
    /// Sealed by the subscription id alone, before headers were bound to their URL.
    Unbound,
    /// They do not open for this subscription and URL (copied from another record, sealed under
    /// a key this instance does not have, tampered with) or are not a JSON object.
    Unopened,
}

/// Counts a request sent without the subscription's sealed headers
/// (`streaming_hub_sensitive_headers_not_sent_total{reason="unbound"|"unopened"}`), with a WARN
/// line the first time for each subscription in this process (for the first 10,000
/// subscriptions; the count goes on).
pub fn headers_not_sent(subscription_id: &str, why: NotSent) {
    let reason = match why {
        NotSent::Unbound => "unbound",
        NotSent::Unopened => "unopened",
    };
    metrics::counter!("streaming_hub_sensitive_headers_not_sent_total", "reason" => reason)
        .increment(1);
    match (first_warning(reason, subscription_id), why) {
        (false, _) => {}
        (true, NotSent::Unbound) => tracing::warn!(
            subscription_id,
            "sensitive headers sealed before they were bound to their URL are not sent; run \
             `streaming-hub subscriptions reseal --bind-unbound` to bind them"
        ),
        (true, NotSent::Unopened) => tracing::warn!(
            subscription_id,
            "sensitive headers do not open for this subscription and URL (copied from another \
             record, sealed under a key not configured, or tampered with); requests go without \
             them"
        ),
    }
}

/// Counts a request signed without one of the subscription's unexpired signing secrets, which
/// did not open (sealed under a key not configured, copied from another record, tampered with):
/// `streaming_hub_signing_secrets_unopened_total`, with a WARN line the first time for each
/// subscription. The request is signed with the ones that opened; only when none did is the
/// attempt a hub-side failure (`secret_unreadable`).
pub fn secret_unopened(subscription_id: &str) {
    metrics::counter!("streaming_hub_signing_secrets_unopened_total").increment(1);
    if first_warning("secret", subscription_id) {
        tracing::warn!(
            subscription_id,
            "a signing secret does not open for this subscription (sealed under a key not \
             configured, copied from another record, or tampered with); requests are signed \
             with the secrets that open"
        );
    }
}

/// Counts an attempt not sent because its webhook URL's sealed target did not open (sealed under
/// a key not configured, copied from another record or URL, tampered with): the request cannot
/// go to the URL as shown, which is not the receiver's. A hub-side failure (`url_unreadable`),
/// `streaming_hub_sealed_urls_unopened_total`, with a WARN line the first time for each
/// subscription.
pub fn url_unopened(subscription_id: &str) {
    metrics::counter!("streaming_hub_sealed_urls_unopened_total").increment(1);
    if first_warning("url", subscription_id) {
        tracing::warn!(
            subscription_id,
            "the webhook URL's sealed path and query do not open for this subscription and URL (sealed \
             under a key not configured, copied from another record, or tampered with); \
             attempts fail on the hub's side (url_unreadable) until it opens or the URL is set \
             again"
        );
    }
}

/// Counts a custom header dropped from a request because the hub or the connection owns its
/// name (a record the API did not write: any producer may write the control topic):
/// `streaming_hub_reserved_headers_dropped_total`, with a WARN line the first time for each
/// subscription. The name is logged, never the value.
pub fn reserved_header_dropped(subscription_id: &str, name: &str) {
    metrics::counter!("streaming_hub_reserved_headers_dropped_total").increment(1);
    if first_warning("reserved", subscription_id) {
        tracing::warn!(
            subscription_id,
            header = name,
            "a custom header with a name the hub or the connection owns is not sent (the API \
             refuses these; the record was written to the control topic by other means)"
        );
    }
}

/// True the first time `(what, subscription_id)` is seen in this process (for the first 10,000;
/// after that, never): warnings once per subscription, however many requests.
fn first_warning(what: &'static str, subscription_id: &str) -> bool {
    static WARNED: std::sync::Mutex<Option<std::collections::HashSet<(&'static str, String)>>> =
        std::sync::Mutex::new(None);
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    let warned = warned.get_or_insert_with(Default::default);
    let key = (what, subscription_id.to_string());
    !warned.contains(&key) && warned.len() < 10_000 && warned.insert(key)
}

/// Associated data of a blob bound to a subscription and a URL: a version tag, the id's length
/// (8 bytes, big-endian), the id, the URL. Length-prefixed, so no id and URL pair reads as
/// another pair whatever bytes either holds.
fn bound_aad(subscription_id: &str, url: &str) -> Vec<u8> {
    tagged_aad(b"streaming-hub/headers/v2", subscription_id, url)
}

/// The version tag of a sealed URL target's associated data: a header blob never opens as a URL
/// target, nor the other way round.
const URL_TARGET_TAG: &[u8] = b"streaming-hub/url-target/v1";

/// Associated data: `tag`, the id's length (8 bytes, big-endian), the id, the URL.
fn tagged_aad(tag: &[u8], subscription_id: &str, url: &str) -> Vec<u8> {
    let id = subscription_id.as_bytes();
    [tag, &(id.len() as u64).to_be_bytes(), id, url.as_bytes()].concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> String {
        base64::engine::general_purpose::STANDARD.encode([byte; 32])
    }

    #[test]
    fn sealed_secret_opens_only_for_its_subscription() {
        let kek = Kek::new("k1", &key(7)).unwrap();
        let secret = generate_signing_secret();
        let sealed = kek.seal_secret(&secret, "sub-a", None);
        assert_eq!(sealed.key_id, "k1");
        assert!(
            !sealed.ciphertext.windows(10).any(|w| secret
                .expose()
                .as_bytes()
                .windows(10)
                .any(|s| s == w))
        );
        assert_eq!(kek.open_secret(&sealed, "sub-a").unwrap(), secret);
        assert_eq!(
            kek.open_secret(&sealed, "sub-b").unwrap_err(),
            SecretError::Open
        );
        let mut tampered = sealed.clone();
        tampered.ciphertext[0] ^= 1;
        assert_eq!(
            kek.open_secret(&tampered, "sub-a").unwrap_err(),
            SecretError::Open
        );
    }

    #[test]
    fn sealed_headers_open_only_for_their_subscription_and_url() {
        let kek = Kek::new("k1", &key(7)).unwrap();
        let blob = kek.seal_bound(
            b"{\"authorization\":\"Bearer t\"}",
            "sub-a",
            "https://a.example/h",
        );
        let (plain, binding) = kek
            .open_bound(&blob, "sub-a", "https://a.example/h")
            .unwrap();
        assert_eq!(plain, b"{\"authorization\":\"Bearer t\"}");
        assert_eq!(binding, Binding::Url);
        // Copied onto another URL or another subscription, it does not open.
        let other_url = kek.open_bound(&blob, "sub-a", "https://evil.example/h");
        assert_eq!(other_url.unwrap_err(), SecretError::Open);
        let other_sub = kek.open_bound(&blob, "sub-b", "https://a.example/h");
        assert_eq!(other_sub.unwrap_err(), SecretError::Open);
        // Nor as if it were bound to the id alone.
        assert_eq!(kek.open(&blob, "sub-a").unwrap_err(), SecretError::Open);
    }

    #[test]
    fn headers_sealed_before_the_url_binding_still_open_and_say_so() {
        let kek = Kek::new("k1", &key(7)).unwrap();
        let legacy = kek.seal(b"{}", "sub-a");
        let (plain, binding) = kek
            .open_bound(&legacy, "sub-a", "https://a.example/h")
            .unwrap();
        assert_eq!(
            (plain.as_slice(), binding),
            (b"{}".as_slice(), Binding::SubscriptionOnly)
        );
        let other = kek.open_bound(&legacy, "sub-b", "https://a.example/h");
        assert_eq!(other.unwrap_err(), SecretError::Open);
        // An unknown key id is that, not a failed open retried without the URL.
        let mut unknown = legacy.clone();
        unknown.key_id = "k9".into();
        assert_eq!(
            kek.open_bound(&unknown, "sub-a", "u").unwrap_err(),
            SecretError::UnknownKeyId("k9".into())
        );
    }

    #[test]
    fn headers_sealed_by_the_id_alone_are_sent_only_while_the_transition_is_on() {
        let strict = Kek::new("k1", &key(7)).unwrap();
        assert!(strict.may_send(Binding::Url, "s"));
        assert!(!strict.may_send(Binding::SubscriptionOnly, "s"));
        let transition = Kek {
            send_unbound: true,
            ..Kek::new("k1", &key(7)).unwrap()
        };
        assert!(transition.may_send(Binding::SubscriptionOnly, "s"));
    }

    #[test]
    fn a_previous_kek_reusing_a_key_id_is_refused_not_silently_replacing_it() {
        let with_previous = |previous: String| {
            let vars = [
                ("STREAMING_HUB_KEK".to_string(), key(2)),
                ("STREAMING_HUB_KEK_ID".to_string(), "k2".to_string()),
                ("STREAMING_HUB_KEK_PREVIOUS".to_string(), previous),
            ];
            Config::from_vars(vars).map(|c| Kek::from_config(&c).is_ok())
        };
        let refused = |previous: String| with_previous(previous).unwrap_err().to_string();
        let e = refused(format!("k2:{}", key(1)));
        assert!(
            e.contains("STREAMING_HUB_KEK_PREVIOUS") && e.contains("entry 1: its key id"),
            "the current key's id: {e}"
        );
        // A key that is not 32 bytes names the entry, not the current key.
        let short = "c2hvcnQ=";
        let e = refused(format!("k1:{},k0:{short}", key(1)));
        assert!(
            e.contains("STREAMING_HUB_KEK_PREVIOUS") && e.contains("entry 2: its key must be"),
            "{e}"
        );
        assert!(!e.contains(short), "{e}");
        let e = refused(format!("k1:{},k1:{}", key(1), key(3)));
        assert!(
            e.contains("entry 2: its key id"),
            "an earlier entry's id: {e}"
        );
        assert!(!e.contains(&key(3)), "{e}");
        assert_eq!(
            with_previous(format!("k1:{},k0:{}", key(1), key(3))).ok(),
            Some(true)
        );
    }

    #[test]
    fn rotated_kek_reads_old_records_and_reseals_under_the_new_key() {
        let old = Kek::new("k1", &key(1)).unwrap();
        let sealed = old.seal_secret(&Secret::new("whsec_x"), "sub", None);
        let vars = [
            ("STREAMING_HUB_KEK".to_string(), key(2)),
            ("STREAMING_HUB_KEK_ID".to_string(), "k2".to_string()),
            (
                "STREAMING_HUB_KEK_PREVIOUS".to_string(),
                format!("k1:{}", key(1)),
            ),
        ];
        let config = Config::from_vars(vars).unwrap();
        let new = Kek::from_config(&config).unwrap();
        assert_eq!(new.open_secret(&sealed, "sub").unwrap().expose(), "whsec_x");
        let resealed = new.reseal_secret(&sealed, "sub").unwrap();
        assert_eq!(resealed.key_id, "k2");
        assert_eq!(
            Kek::new("k2", &key(2))
                .unwrap()
                .open_secret(&resealed, "sub")
                .unwrap()
                .expose(),
            "whsec_x"
        );
        assert!(matches!(
            Kek::new("k2", &key(2)).unwrap().open_secret(&sealed, "sub"),
            Err(SecretError::UnknownKeyId(_))
        ));
    }

    #[test]
    fn malformed_kek_is_rejected_and_debug_hides_keys() {
        assert_eq!(Kek::new("k1", "c2hvcnQ=").unwrap_err(), SecretError::BadKek);
        let e =
            Config::from_vars([("STREAMING_HUB_KEK".to_string(), "nope".to_string())]).unwrap_err();
        assert!(e.to_string().contains("STREAMING_HUB_KEK"));
        let kek = Kek::new("k1", &key(9)).unwrap();
        assert!(!format!("{kek:?}").contains(&key(9)));
    }

    #[test]
    fn generated_secrets_are_whsec_of_32_random_bytes() {
        let a = generate_signing_secret();
        let b = generate_signing_secret();
        assert_ne!(a, b);
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&a.expose()[6..])
            .unwrap();
        assert!(a.expose().starts_with("whsec_"));
        assert_eq!(raw.len(), 32);
    }
}
