//! A webhook URL's credentials at rest (DESIGN.md §3: credentials on the control topic are
//! sealed).
//!
//! Many receivers take their credential in the URL itself: in the query (Azure Functions'
//! `code`, Teams workflows' `sig`, Google Chat's `key` and `token`) or in the path (Slack's and
//! Discord's webhook tokens, Make's and n8n's hook ids). Stored as given, it would be in plaintext
//! on the control topic and in every answer of the API. So a webhook URL is stored in two parts:
//! - `destination.url`, what may be shown: scheme, host and port as given; each path segment
//!   that reads as words ([`shown_segment`]) as given, any other as [`REDACTED`]; every query
//!   value and the fragment as [`REDACTED`], the query's names kept
//!   (`https://hooks.slack.com/services/***/***/***`, `https://r.example/api/in?code=***`);
//! - `destination.sealed_target`: everything past the host as given (path, query, fragment),
//!   sealed under the KEK, bound to the subscription id and the URL as shown. None when nothing
//!   was redacted: the URL is stored as given.
//!
//! Query values are sealed whatever their names: no guess at which are credentials. Requests go to
//! the shown URL's scheme, host and port followed by the opened text ([`request_url`]); that URL
//! is what sensitive headers are bound to. The shown URL is what the API answers and what the
//! breaker's origin comes from. A URL sent back as the API shows it names the stored one
//! ([`names_stored`]), so a read-modify-write keeps what is sealed; one edited from it, still
//! holding a [`REDACTED`] mark, is refused ([`holds_redacted`]): stored, the mark would be sent.
//!
//! What reads as words is a guess: a path segment of letters only, in runs of at most 16 between
//! `-`, `_`, `.` or `~`, is shown as given, so a credential of that shape (rare among random
//! tokens, which carry digits or are longer) is stored in plaintext. The host is always shown;
//! a user name and password before it never are (the API refuses them; a record written past it
//! may hold them, and nothing is ever sent to such a URL).
use std::borrow::Cow;

use crate::runtime::records::{DestinationRecord, EncryptedBlob};
use crate::subscriptions::secrets::{Kek, SecretError};

/// What a sealed path segment, query value or fragment is shown as.
pub const REDACTED: &str = "***";

/// The longest run of letters in a path segment shown as given.
const MAX_WORD: usize = 16;

/// The longest path segment shown as given.
const MAX_SEGMENT: usize = 48;

/// `url` split past its host: scheme, `//` and authority; then the rest (path, query,
/// fragment; empty when there is none). A checked URL has no `/`, `?` or `#` in its authority.
fn split(url: &str) -> (&str, &str) {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let end = url[after_scheme..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| after_scheme + i);
    url.split_at(end)
}

/// Whether a path segment is shown as given: empty, at most 3 characters (`v1`, `api`), or words:
/// letters in runs of at most [`MAX_WORD`] between `-`, `_`, `.` or `~`, at most [`MAX_SEGMENT`]
/// in all. Anything else (digits, percent-escapes, long runs) may be a token.
pub fn shown_segment(segment: &str) -> bool {
    if segment.len() <= 3 {
        return true;
    }
    segment.len() <= MAX_SEGMENT
        && segment
            .bytes()
            .all(|b| b.is_ascii_alphabetic() || matches!(b, b'-' | b'_' | b'.' | b'~'))
        && segment
            .split(['-', '_', '.', '~'])
            .all(|run| run.len() <= MAX_WORD)
}

/// A piece of a URL as [`walk`] hands it out: shown as given, or hidden (shown as [`REDACTED`]).
enum Piece<'a> {
    Shown(&'a str),
    Hidden(&'a str),
}

/// Hands out `url` in order, as pieces shown or hidden (see the module doc): each path segment
/// by [`shown_segment`], every query value (a nameless piece when not empty) and a non-empty
/// fragment hidden; what separates them, the query's names and the part up to the host shown,
/// but a user name and password before it hidden. The API and `subscriptions apply` refuse a URL
/// with those (no request goes to one); a record written past them may hold one, which the API
/// must not show nor a reseal keep.
fn walk<'a>(url: &'a str, mut on: impl FnMut(Piece<'a>)) {
    let (base, rest) = split(url);
    let (path, rest) = rest.split_at(rest.find(['?', '#']).unwrap_or(rest.len()));
    let (query, fragment) = match rest.find('#') {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let after_scheme = base.find("://").map_or(0, |i| i + 3);
    match base[after_scheme..].rfind('@') {
        Some(at) => {
            let at = after_scheme + at;
            on(Piece::Shown(&base[..after_scheme]));
            on(Piece::Hidden(&base[after_scheme..at]));
            on(Piece::Shown(&base[at..]));
        }
        None => on(Piece::Shown(base)),
    }
    for (i, segment) in path.split('/').enumerate() {
        if i > 0 {
            on(Piece::Shown("/"));
        }
        if shown_segment(segment) {
            on(Piece::Shown(segment));
        } else {
            on(Piece::Hidden(segment));
        }
    }
    if let Some(query) = query.strip_prefix('?') {
        on(Piece::Shown("?"));
        for (i, piece) in query.split('&').enumerate() {
            if i > 0 {
                on(Piece::Shown("&"));
            }
            match piece.split_once('=') {
                Some((name, value)) => {
                    on(Piece::Shown(name));
                    on(Piece::Shown("="));
                    on(Piece::Hidden(value));
                }
                // A piece without a name may be the credential itself (`?s3cr3t`).
                None if !piece.is_empty() => on(Piece::Hidden(piece)),
                None => {}
            }
        }
    }
    if let Some(fragment) = fragment {
        on(Piece::Shown("#"));
        if !fragment.is_empty() {
            on(Piece::Hidden(fragment));
        }
    }
}

/// `url` as it may be shown (see the module doc): `?a=1&b&c=` → `?a=***&***&c=***`, empty
/// pieces stay empty. Unchanged when nothing is redacted, and for a URL already shown so.
pub fn redacted(url: &str) -> Cow<'_, str> {
    let mut shown = String::with_capacity(url.len());
    walk(url, |piece| match piece {
        Piece::Shown(s) => shown.push_str(s),
        Piece::Hidden(_) => shown.push_str(REDACTED),
    });
    if shown == url {
        Cow::Borrowed(url)
    } else {
        Cow::Owned(shown)
    }
}

/// What of `url` is not shown, for what the hub keeps of a receiver's answer (an error page that
/// names the request's path): everything past the host, then each hidden piece that is not
/// empty. Nothing for a URL shown as given.
pub fn hidden_pieces(url: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    walk(url, |piece| {
        if let Piece::Hidden(s) = piece
            && !s.is_empty()
        {
            pieces.push(s);
        }
    });
    if !pieces.is_empty() {
        pieces.insert(0, split(url).1);
    }
    pieces
}

/// A webhook URL as stored: what `destination.url` shows and the sealed rest, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredUrl {
    pub url: String,
    pub sealed_target: Option<EncryptedBlob>,
}

/// Stores a checked webhook URL for subscription `id`: shown redacted, everything past its host
/// sealed. A URL with nothing to redact is stored as given, with nothing sealed.
pub fn seal(kek: &Kek, id: &str, url: &str) -> StoredUrl {
    match redacted(url) {
        Cow::Borrowed(_) => StoredUrl {
            url: url.to_string(),
            sealed_target: None,
        },
        Cow::Owned(shown) => {
            let (_, rest) = split(url);
            let sealed = kek.seal_url_target(rest, id, &shown);
            StoredUrl {
                url: shown,
                sealed_target: Some(sealed),
            }
        }
    }
}

/// The URL requests to `d` (of subscription `id`) go to. Without a sealed target, its `url` as
/// stored; with one, the shown URL's scheme, host and port and the opened rest. It fails when
/// the sealed target does not open here (no KEK, a key this instance lacks, copied from another
/// subscription or URL, tampered with): the shown URL is never sent to, since it is not the
/// receiver's.
pub fn request_url<'a>(
    kek: Option<&Kek>,
    id: &str,
    d: &'a DestinationRecord,
) -> Result<Cow<'a, str>, SecretError> {
    let url = d.url.as_deref().unwrap_or_default();
    let Some(blob) = &d.sealed_target else {
        return Ok(Cow::Borrowed(url));
    };
    let kek = kek.ok_or(SecretError::Open)?;
    let rest = kek.open_url_target(blob, id, url)?;
    // What was sealed is what follows the host: anything else (it cannot open under a forged
    // shown URL) would move the request to another host, and is refused all the same.
    if !rest.is_empty() && !rest.starts_with(['/', '?', '#']) {
        return Err(SecretError::Open);
    }
    let (base, _) = split(url);
    Ok(Cow::Owned(format!("{base}{rest}")))
}

/// `d`'s sealed target sealed again under the current key, when it was sealed under another (a
/// KEK rotation); the URL as shown stays the same, and with it what its sensitive headers are
/// bound to. `Ok(None)`: nothing sealed, or already under the current key; an error: it does not
/// open here.
pub fn under_current_key(
    kek: &Kek,
    id: &str,
    d: &DestinationRecord,
) -> Result<Option<EncryptedBlob>, SecretError> {
    let Some(blob) = d.sealed_target.as_ref() else {
        return Ok(None);
    };
    if blob.key_id == kek.current_id() {
        return Ok(None);
    }
    // Bound to the URL as stored, not as the rules would show it now.
    let shown = d.url.as_deref().unwrap_or_default();
    let rest = kek.open_url_target(blob, id, shown)?;
    Ok(Some(kek.seal_url_target(&rest, id, shown)))
}

/// Whether `url` holds the [`REDACTED`] mark past its host: a URL as the API shows it, or one
/// edited from it (`/***/in?code=new`). Such a URL names a stored one or nothing: requests would
/// go to the mark itself.
pub fn holds_redacted(url: &str) -> bool {
    split(url).1.contains(REDACTED)
}

/// Whether `given`, a checked URL, names the destination stored in `d`: it is the URL as the API
/// shows it (a read-modify-write), or the URL requests go to. A sealed target that does not open
/// here names nothing else. The shown form names a stored URL only when what it hides is sealed
/// (or it hides nothing): a record holding a URL with credentials in plaintext (written past the
/// API, or by a version before URLs were sealed) may name any receiver on that host
/// (`webhook.site/<theirs>` shows as `webhook.site/***` too), and sensitive headers sealed again
/// to it would go there. Such a URL is named in full (`subscriptions reseal` seals it).
pub fn names_stored(kek: Option<&Kek>, id: &str, d: &DestinationRecord, given: &str) -> bool {
    let Some(stored) = d.url.as_deref() else {
        return false;
    };
    if d.sealed_target.is_some() && redacted(stored) == given {
        return true;
    }
    request_url(kek, id, d).is_ok_and(|url| url == given)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::records::DestinationType;

    fn kek(byte: u8) -> Kek {
        use base64::Engine;
        Kek::new(
            "k1",
            &base64::engine::general_purpose::STANDARD.encode([byte; 32]),
        )
        .unwrap()
    }

    fn webhook(stored: StoredUrl) -> DestinationRecord {
        DestinationRecord {
            kind: DestinationType::Webhook,
            url: Some(stored.url),
            headers: Default::default(),
            sensitive_headers: None,
            sealed_target: stored.sealed_target,
        }
    }

    /// A user name and password (refused by the API, possible in a record written past it) are
    /// never shown, nor kept by a seal, and are scrubbed from kept answers.
    #[test]
    fn a_user_name_and_password_are_hidden() {
        let url = "https://user:pa55word@h.example:8443/hook";
        assert_eq!(redacted(url), "https://***@h.example:8443/hook");
        assert!(hidden_pieces(url).contains(&"user:pa55word"));
        let stored = seal(&kek(1), "sub-1", url);
        assert_eq!(stored.url, "https://***@h.example:8443/hook");
        assert!(!format!("{stored:?}").contains("pa55word"));
        assert_eq!(redacted("https://h.example/a@b"), "https://h.example/a@b");
    }

    #[test]
    fn the_hidden_pieces_are_what_the_shown_url_hides() {
        let url = "https://h.example/v1/hooks/1234567/in?code=abc&flag&empty=#frag";
        assert_eq!(
            hidden_pieces(url),
            [
                "/v1/hooks/1234567/in?code=abc&flag&empty=#frag",
                "1234567",
                "abc",
                "flag",
                "frag"
            ]
        );
        assert!(hidden_pieces("https://h.example/webhooks/in").is_empty());
    }

    #[test]
    fn what_may_be_a_credential_is_shown_redacted_and_names_and_words_kept() {
        let cases = [
            (
                "https://hooks.slack.com/services/T0123ABCD/B0123ABCD/abcdefghijklmnopqrstuvwx",
                "https://hooks.slack.com/services/***/***/***",
            ),
            (
                "https://discord.com/api/webhooks/123456789012345678/AbC-dEf_gh",
                "https://discord.com/api/webhooks/***/AbC-dEf_gh",
            ),
            (
                "https://hooks.zapier.com/hooks/catch/1234567/abc1de2/",
                "https://hooks.zapier.com/hooks/catch/***/***/",
            ),
            (
                "https://api.tenant.example/webhooks/streaming-hub",
                "https://api.tenant.example/webhooks/streaming-hub",
            ),
            (
                "https://h.example/v1/tenants/42/in",
                "https://h.example/v1/tenants/42/in",
            ),
            ("https://h.example/hook%20x/in", "https://h.example/***/in"),
            // The load harness's sinks: every delivery of `streaming-hub load` opens its URL.
            (
                "http://127.0.0.1:8080/hook/tenant-17/0",
                "http://127.0.0.1:8080/hook/***/0",
            ),
            (
                "https://h.example/a-very-long-path-segment-of-words-that-goes-on-and-on",
                "https://h.example/***",
            ),
            (
                "https://[::1]:8443/a1b2c3d4?x=1",
                "https://[::1]:8443/***?x=***",
            ),
            ("https://h.example", "https://h.example"),
            ("https://h.example/", "https://h.example/"),
            ("https://h.example?x=1", "https://h.example?x=***"),
            ("https://h.example/in", "https://h.example/in"),
            ("https://h.example/in?", "https://h.example/in?"),
            (
                "https://h.example/api/x?code=abc%3D%3D&clientId=default",
                "https://h.example/api/x?code=***&clientId=***",
            ),
            ("https://h.example/in?s3cr3t", "https://h.example/in?***"),
            (
                "https://h.example/in?a=&&b=2",
                "https://h.example/in?a=***&&b=***",
            ),
            ("https://h.example/in#tok", "https://h.example/in#***"),
            ("https://h.example/in?a=1#", "https://h.example/in?a=***#"),
            (
                "https://h.example:8443/?x=1#y",
                "https://h.example:8443/?x=***#***",
            ),
        ];
        for (given, shown) in cases {
            assert_eq!(redacted(given), shown, "{given}");
            assert_eq!(redacted(shown), shown, "shown again: {shown}");
        }
    }

    #[test]
    fn a_query_is_stored_sealed_and_requests_go_to_the_url_as_given() {
        let k = kek(1);
        let given = "https://chat.example/v1/spaces/AAA/messages?key=AIzaSy-secret&token=t0k%3D";
        let stored = seal(&k, "sub-1", given);
        assert_eq!(
            stored.url,
            "https://chat.example/v1/spaces/AAA/messages?key=***&token=***"
        );
        let blob = stored.sealed_target.clone().unwrap();
        let text = format!("{blob:?}");
        assert!(!text.contains("AIzaSy") && !text.contains("t0k"));
        let d = webhook(stored);
        assert_eq!(request_url(Some(&k), "sub-1", &d).unwrap(), given);
        assert!(names_stored(Some(&k), "sub-1", &d, given));
        assert!(names_stored(
            Some(&k),
            "sub-1",
            &d,
            d.url.as_deref().unwrap()
        ));
        assert!(!names_stored(
            Some(&k),
            "sub-1",
            &d,
            "https://chat.example/v1/spaces/AAA/messages?key=other&token=t0k%3D"
        ));
    }

    #[test]
    fn the_shown_form_does_not_name_a_url_stored_with_its_credentials_in_plaintext() {
        let k = kek(1);
        // Written past the API (or before URLs were sealed): the path in plaintext.
        let d = DestinationRecord {
            kind: DestinationType::Webhook,
            url: Some("https://webhook.site/0b6c3f5e-theirs".into()),
            headers: Default::default(),
            sensitive_headers: None,
            sealed_target: None,
        };
        assert!(!names_stored(
            Some(&k),
            "sub-1",
            &d,
            "https://webhook.site/***"
        ));
        assert!(names_stored(
            Some(&k),
            "sub-1",
            &d,
            "https://webhook.site/0b6c3f5e-theirs"
        ));
    }

    #[test]
    fn a_path_is_stored_sealed_and_requests_go_to_the_url_as_given() {
        let k = kek(1);
        let given =
            "https://hooks.slack.com/services/T0123ABCD/B0123ABCD/abcdefghijklmnopqrstuvwx?x=1#f";
        let stored = seal(&k, "sub-1", given);
        assert_eq!(
            stored.url,
            "https://hooks.slack.com/services/***/***/***?x=***#***"
        );
        let d = webhook(stored);
        assert_eq!(request_url(Some(&k), "sub-1", &d).unwrap(), given);
        assert!(names_stored(Some(&k), "sub-1", &d, given));
        let other =
            "https://hooks.slack.com/services/T0123ABCD/B0123ABCD/abcdefghijklmnopqrstuvwy?x=1#f";
        assert!(!names_stored(Some(&k), "sub-1", &d, other));
    }

    #[test]
    fn a_url_with_nothing_to_redact_is_stored_as_given() {
        let k = kek(1);
        let stored = seal(&k, "sub-1", "https://h.example/in");
        assert_eq!(stored.sealed_target, None);
        let d = webhook(stored);
        assert_eq!(
            request_url(None, "sub-1", &d).unwrap(),
            "https://h.example/in"
        );
    }

    #[test]
    fn a_query_sealed_under_a_previous_key_moves_to_the_current_one_shown_the_same() {
        use base64::Engine;
        let old = kek(1);
        let given = "https://h.example/in?sig=abc";
        let d = webhook(seal(&old, "sub-1", given));
        let b64 = |byte: u8| base64::engine::general_purpose::STANDARD.encode([byte; 32]);
        let config = crate::config::Config::from_vars([
            ("STREAMING_HUB_KEK".to_string(), b64(2)),
            ("STREAMING_HUB_KEK_ID".to_string(), "k2".to_string()),
            (
                "STREAMING_HUB_KEK_PREVIOUS".to_string(),
                format!("k1:{}", b64(1)),
            ),
        ])
        .unwrap();
        let rotated = Kek::from_config(&config).unwrap();
        let blob = under_current_key(&rotated, "sub-1", &d).unwrap().unwrap();
        assert_eq!(blob.key_id, "k2");
        let moved = DestinationRecord {
            sealed_target: Some(blob),
            ..d.clone()
        };
        assert_eq!(request_url(Some(&rotated), "sub-1", &moved).unwrap(), given);
        assert_eq!(
            under_current_key(&rotated, "sub-1", &moved),
            Ok(None),
            "already there"
        );
        assert_eq!(under_current_key(&old, "sub-1", &d), Ok(None));
    }

    #[test]
    fn a_sealed_target_opens_only_for_its_subscription_shown_url_and_key() {
        let k = kek(1);
        let d = webhook(seal(&k, "sub-1", "https://h.example/in?sig=abc"));
        // Another subscription's record holding the copy.
        assert!(request_url(Some(&k), "sub-2", &d).is_err());
        // The same blob under another host or path, or other names.
        for url in [
            "https://evil.example/in?sig=***",
            "https://h.example/other?sig=***",
            "https://h.example/in?sog=***",
        ] {
            let moved = DestinationRecord {
                url: Some(url.into()),
                ..d.clone()
            };
            assert!(request_url(Some(&k), "sub-1", &moved).is_err(), "{url}");
            assert!(!names_stored(
                Some(&k),
                "sub-1",
                &moved,
                "https://h.example/in?sig=abc"
            ));
        }
        // Another key, or none.
        assert!(request_url(Some(&kek(2)), "sub-1", &d).is_err());
        assert!(request_url(None, "sub-1", &d).is_err());
        // A header blob is not a URL tail, even for the same subscription and URL.
        let headers = k.seal_bound(b"?sig=abc", "sub-1", "https://h.example/in?sig=***");
        let swapped = DestinationRecord {
            sealed_target: Some(headers),
            ..d.clone()
        };
        assert!(request_url(Some(&k), "sub-1", &swapped).is_err());
    }
}
