//! Fuzzes the ingest verdict (`streaming_hub::ingest::classify::classify`): any headers and value
//! must get exactly one verdict, the same one every time, without a panic.
//!
//! Random bytes would almost never get past the first `ce-*` check, so the input is a recipe
//! (`arbitrary`): start from nothing or from a valid ledger event, edit its headers (set, push a
//! duplicate, remove, flip a byte, truncate, raw bytes, null), optionally sign the result with one
//! of the configured producer keys, then tamper again. The configuration (UUIDv7 rule, payload
//! limit, required signatures, their maximum age, the clock, the topic and whether its source
//! must be the record's) is part of the input too.
//!
//! Checked besides "no panic":
//! - determinism: classifying the same record twice gives the same verdict;
//! - an accepted record has a non-empty tenant equal to its `ce-tenantid`, and a `ce-sig` when
//!   signatures are required;
//! - a quarantine message never shows the record's `ce-sig` value (when it is a real signature and
//!   no other header name or value carries the same text).
#![no_main]

use std::sync::LazyLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use streaming_hub::ingest::classify::{Arrival, ClassifyConfig, Verdict, classify};
use streaming_hub::ingest::signature::{SignatureKeys, sign};

/// Header names the recipe picks from: every `ce-*` attribute the classifier knows, look-alikes it
/// must ignore, and headers it carries without judging.
const NAMES: &[&str] = &[
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
    "ce-sig",
    "ce-partitionkey",
    "CE-Id",
    "ce-",
    "traceparent",
    "x-streaming-hub-source-offset",
];

/// Topics a record is read from: its source's, another source's, one not named after a source.
const TOPICS: [&str; 3] = [
    "lerian.streaming.ledger",
    "lerian.streaming.tracer",
    "payments-events",
];

/// A valid ledger event (VECTORS.md), in header order.
const VALID: &[(&str, &str)] = &[
    ("ce-specversion", "1.0"),
    ("ce-id", "0190a8e2-0000-7000-8000-000000000001"),
    ("ce-source", "ledger"),
    ("ce-type", "studio.lerian.ledger.transaction.created"),
    ("ce-time", "2026-09-26T12:00:00.123456789-03:00"),
    ("ce-schemaversion", "v1.2.3"),
    ("ce-resourcetype", "transaction"),
    ("ce-eventtype", "created"),
    ("ce-subject", "acc-1"),
    ("ce-datacontenttype", "application/json"),
    ("ce-tenantid", "tenant-1"),
    ("ce-sigts", "2026-09-26T12:00:05Z"),
    (
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ),
];

/// Producer keys: `k1` and `k2` bound to `ledger`, `k3` to `deposit` (signing with it is the
/// "key of another source" case).
const KEYS: &[(&str, &str, [u8; 32])] = &[
    ("k1", "ledger", [1; 32]),
    ("k2", "ledger", [2; 32]),
    ("k3", "deposit", [3; 32]),
];

static SIGNATURE_KEYS: LazyLock<SignatureKeys> = LazyLock::new(|| {
    let mut keys = SignatureKeys::default();
    for (kid, source, secret) in KEYS {
        keys.insert(kid, source, secret).expect("valid fuzz key");
    }
    keys
});

#[derive(Arbitrary, Debug)]
enum Name {
    Known(u8),
    Other(String),
}

impl Name {
    fn text(&self) -> String {
        match self {
            Name::Known(i) => NAMES[usize::from(*i) % NAMES.len()].to_owned(),
            Name::Other(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Value {
    Null,
    Text(String),
    Bytes(Vec<u8>),
    /// The valid value of that header, when it has one.
    Valid,
    /// `true`, the only `ce-systemevent` value that drops.
    True,
}

#[derive(Arbitrary, Debug)]
enum Edit {
    /// Replace the first header of that name (append when absent).
    Set(Name, Value),
    /// Append another header of that name.
    Push(Name, Value),
    Remove(Name),
    /// Replace one byte of the first value of that name.
    Flip(Name, u16, u8),
    Truncate(Name, u16),
}

#[derive(Arbitrary, Debug)]
struct Recipe {
    require_uuidv7: bool,
    require_signatures: bool,
    /// Payload limit: small, so `payload_too_large` is reachable.
    max_payload_bytes: u16,
    /// `STREAMING_HUB_SIGNATURE_MAX_AGE` in minutes (None: off).
    signature_max_age_minutes: Option<u16>,
    /// The classifying clock, in seconds from the signed vector's `ce-sigts`.
    now_from_sigts_secs: i32,
    require_source_topic: bool,
    /// The topic read from: `TOPICS[n % 3]`.
    topic: u8,
    start_valid: bool,
    edits: Vec<Edit>,
    /// Sign with `KEYS[n % 3]` after `edits` (sets `ce-sigkid` and `ce-sig`).
    sign_with: Option<u8>,
    tamper: Vec<Edit>,
    value: Option<Vec<u8>>,
}

type Headers = Vec<(String, Option<Vec<u8>>)>;

fn valid_value(name: &str) -> Option<Vec<u8>> {
    VALID
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_bytes().to_vec())
}

fn value_of(name: &str, value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::Null => None,
        Value::Text(s) => Some(s.as_bytes().to_vec()),
        Value::Bytes(b) => Some(b.clone()),
        Value::Valid => valid_value(name).or_else(|| Some(Vec::new())),
        Value::True => Some(b"true".to_vec()),
    }
}

fn set(headers: &mut Headers, name: &str, value: Option<Vec<u8>>) {
    match headers.iter_mut().find(|(n, _)| n == name) {
        Some(slot) => slot.1 = value,
        None => headers.push((name.to_owned(), value)),
    }
}

fn apply(headers: &mut Headers, edit: &Edit) {
    match edit {
        Edit::Set(name, value) => {
            let name = name.text();
            let value = value_of(&name, value);
            set(headers, &name, value);
        }
        Edit::Push(name, value) => {
            let name = name.text();
            let value = value_of(&name, value);
            headers.push((name, value));
        }
        Edit::Remove(name) => {
            let name = name.text();
            headers.retain(|(n, _)| *n != name);
        }
        Edit::Flip(name, at, byte) => {
            let name = name.text();
            if let Some((_, Some(v))) = headers.iter_mut().find(|(n, _)| *n == name) {
                if !v.is_empty() {
                    let at = usize::from(*at) % v.len();
                    v[at] = *byte;
                }
            }
        }
        Edit::Truncate(name, len) => {
            let name = name.text();
            if let Some((_, Some(v))) = headers.iter_mut().find(|(n, _)| *n == name) {
                v.truncate(usize::from(*len));
            }
        }
    }
}

fn borrowed(headers: &Headers) -> Vec<(&str, Option<&[u8]>)> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_deref()))
        .collect()
}

fuzz_target!(|recipe: Recipe| {
    let mut headers: Headers = Vec::new();
    if recipe.start_valid {
        for (name, value) in VALID {
            headers.push(((*name).to_owned(), Some(value.as_bytes().to_vec())));
        }
    }
    for edit in &recipe.edits {
        apply(&mut headers, edit);
    }
    let value = recipe.value.as_deref();
    let mut signature = None;
    if let Some(n) = recipe.sign_with {
        let (kid, _, secret) = &KEYS[usize::from(n) % KEYS.len()];
        set(&mut headers, "ce-sigkid", Some(kid.as_bytes().to_vec()));
        let sig = sign(secret, &borrowed(&headers), value.unwrap_or_default());
        set(&mut headers, "ce-sig", Some(sig.clone().into_bytes()));
        signature = Some(sig);
    }
    for edit in &recipe.tamper {
        apply(&mut headers, edit);
    }

    let cfg = ClassifyConfig {
        require_uuidv7: recipe.require_uuidv7,
        max_payload_bytes: usize::from(recipe.max_payload_bytes),
        require_signatures: recipe.require_signatures,
        keys: SIGNATURE_KEYS.clone(),
        signature_max_age_ms: recipe
            .signature_max_age_minutes
            .map_or(0, |m| i64::from(m) * 60_000),
        require_source_topic: recipe.require_source_topic,
    };
    // VECTORS.md's `ce-sigts`, 2026-09-26T12:00:05.123Z, moved by the recipe.
    let now_ms = 1_790_424_005_123 + i64::from(recipe.now_from_sigts_secs) * 1000;
    let view = borrowed(&headers);
    let arrival = Arrival {
        topic: TOPICS[usize::from(recipe.topic) % TOPICS.len()],
        now_ms,
    };
    let verdict = classify(&view, value, &cfg, arrival);
    assert_eq!(
        verdict,
        classify(&view, value, &cfg, arrival),
        "verdict not stable"
    );

    let first = |name: &str| view.iter().find(|(n, _)| *n == name).and_then(|(_, v)| *v);
    match &verdict {
        Verdict::Accept(accepted) => {
            assert!(!accepted.tenant.is_empty(), "accepted without a tenant");
            assert_eq!(
                first("ce-tenantid"),
                Some(accepted.tenant.as_bytes()),
                "tenant is not ce-tenantid"
            );
            if let Some(source) = arrival.topic.strip_prefix("lerian.streaming.") {
                if cfg.require_source_topic {
                    assert_eq!(first("ce-source"), Some(source.as_bytes()), "another topic's source");
                }
            }
            if cfg.require_signatures {
                assert!(first("ce-sig").is_some(), "accepted unsigned");
                if cfg.signature_max_age_ms > 0 {
                    assert!(first("ce-sigts").is_some(), "accepted without a signature time");
                }
            }
        }
        Verdict::Quarantine(q) => {
            // Only a real signature, and only when no header name or other value carries it (a
            // message may show those).
            let sig = signature.filter(|s| first("ce-sig") == Some(s.as_bytes()));
            if let Some(sig) = sig {
                let holds = |b: &[u8]| b.windows(sig.len()).any(|w| w == sig.as_bytes());
                let elsewhere = view
                    .iter()
                    .any(|(n, v)| holds(n.as_bytes()) || (*n != "ce-sig" && v.is_some_and(holds)));
                if !elsewhere {
                    assert!(!q.message.contains(&sig), "message shows ce-sig: {q:?}");
                }
            }
        }
        Verdict::Drop => {}
    }
});
