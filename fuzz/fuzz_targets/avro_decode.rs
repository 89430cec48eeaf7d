//! Fuzzes the Avro decoders of every hub record (`Codec::decode_record::<R>` for the eight record
//! types of `streaming_hub::runtime::records`): any bytes must decode to a record or return a
//! `CodecError`, never panic, and whatever decodes must survive an encode/decode round trip
//! unchanged (a record the hub can read but not write back would wedge a changelog restore).
//!
//! Input layout: byte 0 picks the record type (bits 0-2) and how the rest becomes a record
//! (bits 3-4), so most inputs get past the single-object header to the datum decoder:
//! - 0: the rest as it is (magic, fingerprint and datum all fuzzed);
//! - 1: magic + the type's current fingerprint + the rest as the datum;
//! - 2: a valid encoded sample of the type (or the retired `dead_letter` v1, byte 1 decides),
//!   edited by the rest in 4-byte steps (op, position high, position low, byte): overwrite,
//!   insert, delete, truncate;
//! - 3: magic + a fingerprint byte 1 picks among every known writer schema (current and retired,
//!   so also another type's and the schema-resolution path) + the rest as the datum.
#![no_main]

use std::collections::BTreeMap;
use std::sync::LazyLock;

use apache_avro::Schema;
use apache_avro::rabin::Rabin;
use libfuzzer_sys::fuzz_target;
use streaming_hub::runtime::avro::{Codec, MAGIC, RecordKind};
use streaming_hub::runtime::records::*;

static CODEC: LazyLock<Codec> = LazyLock::new(|| Codec::new().expect("bundled schemas parse"));

const DEAD_LETTER_V1: &str = include_str!("../../schemas/retired/dead_letter.v1.avsc");

/// Fingerprints of every writer schema the codec reads: the current eight, then the retired ones.
static FINGERPRINTS: LazyLock<Vec<[u8; 8]>> = LazyLock::new(|| {
    let mut all: Vec<[u8; 8]> = RecordKind::ALL
        .iter()
        .map(|k| CODEC.fingerprint(*k))
        .collect();
    all.push(fingerprint_of(DEAD_LETTER_V1));
    all
});

/// Valid encoded samples, indexed like `RecordKind::ALL`, then `dead_letter` v1.
static SAMPLES: LazyLock<Vec<Vec<u8>>> = LazyLock::new(samples);

fn fingerprint_of(source: &str) -> [u8; 8] {
    let schema = Schema::parse_str(source).expect("retired schema parses");
    let bytes = schema.fingerprint::<Rabin>().bytes;
    bytes[..8].try_into().expect("8 bytes")
}

fn header(fingerprint: [u8; 8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&fingerprint);
    out
}

fn samples() -> Vec<Vec<u8>> {
    let c = &*CODEC;
    let enc = |r: Result<Vec<u8>, _>| r.expect("sample encodes");
    let headers = vec![
        HeaderRecord {
            key: "ce-id".into(),
            value: Some(b"0190a8e2-0000-7000-8000-000000000001".to_vec()),
        },
        HeaderRecord {
            key: "traceparent".into(),
            value: None,
        },
    ];
    let mut subscription = SubscriptionRecord::pull(
        "0190b7a4-5c3e-7d2a-9f1b-3c4d5e6f7a8b",
        "tenant-a",
        &["transaction.created", "account.*"],
    );
    subscription.origin = Some("ledger".into());
    subscription.schema_major = Some(2);
    subscription.destination = DestinationRecord {
        kind: DestinationType::Webhook,
        url: Some("https://hooks.example.com/in".into()),
        headers: BTreeMap::from([("x-team".to_owned(), "payments".to_owned())]),
        sensitive_headers: Some(EncryptedBlob {
            key_id: "k1".into(),
            nonce: vec![7; 12],
            ciphertext: vec![0xde, 0xad, 0xbe, 0xef],
        }),
        sealed_target: Some(EncryptedBlob {
            key_id: "k1".into(),
            nonce: vec![8; 12],
            ciphertext: vec![0x51; 24],
        }),
    };
    subscription.retry_schedule = Some(vec![5_000, 300_000]);
    subscription.disabled_reason = Some("failing".into());
    subscription.disabled_at = Some(1_750_000_000_000);
    subscription.signing_secrets = vec![EncryptedSecret {
        key_id: "k1".into(),
        nonce: vec![1; 12],
        ciphertext: vec![2; 48],
        expires_at: Some(1_750_000_000_000),
    }];
    let dead_letter = |event_headers, event_value| DeadLetterRecord {
        event_id: "0190a8e2-0000-7000-8000-000000000001".into(),
        subscription_id: "sub-1".into(),
        tenant_id: "tenant-a".into(),
        attempts: 12,
        last_status: Some(503),
        last_error: Some("status 503".into()),
        reason: DeadLetterReason::Exhausted,
        dead_at: 1_750_000_000_000,
        event_headers,
        event_value,
    };
    let mut out = vec![
        enc(c.encode_record(&subscription)),
        enc(c.encode_record(&DedupEntry {
            tenant_id: "tenant-a".into(),
            ce_id: "0190a8e2-0000-7000-8000-000000000001".into(),
            inbox_partition: 3,
            first_offset: 42,
            sequence: 7,
            expires_at: 1_750_000_000_000,
        })),
        enc(c.encode_record(&SequenceRecord {
            tenant_id: "tenant-a".into(),
            next_sequence: 8,
        })),
        enc(c.encode_record(&JobRecord {
            event_key: "p/tenant-a\00190a8e2".into(),
            subscription_id: "sub-1".into(),
            tenant_id: "tenant-a".into(),
            attempt: 2,
            due_at: 1_750_000_000_000,
            lease_until: Some(1_750_000_030_000),
            reclaims: 1,
            last_status: Some(500),
            last_error: Some("status 500".into()),
            state: JobState::Leased,
        })),
        enc(c.encode_record(&EventPayloadRecord {
            headers: headers.clone(),
            value: br#"{"amount":"10.00"}"#.to_vec(),
            refcount: 2,
        })),
        enc(c.encode_record(&AttemptRecord {
            delivery_id: "0190a8e2-0000-7000-8000-000000000002".into(),
            event_id: "0190a8e2-0000-7000-8000-000000000001".into(),
            subscription_id: "sub-1".into(),
            tenant_id: "tenant-a".into(),
            attempt: 1,
            started_at: 1_750_000_000_000,
            latency_ms: 120,
            status: Some(502),
            outcome: AttemptOutcome::RetryScheduled,
            error_kind: Some("status".into()),
            response_body_truncated: Some(b"bad gateway".to_vec()),
        })),
        enc(c.encode_record(&dead_letter(
            Some(headers),
            Some(br#"{"amount":"10.00"}"#.to_vec()),
        ))),
        enc(c.encode_record(&HealthRecord {
            subscription_id: "sub-1".into(),
            first_failure_at: Some(1_750_000_000_000),
            last_failure_at: Some(1_750_000_100_000),
            consecutive_failures: 4,
            breaker_state: BreakerState::HalfOpen,
            breaker_opened_at: Some(1_750_000_050_000),
        })),
    ];
    // dead_letter v1 is v2 without its last two fields (two null unions, one 0 byte each).
    let v2 = enc(c.encode_record(&dead_letter(None, None)));
    let mut v1 = header(fingerprint_of(DEAD_LETTER_V1));
    v1.extend_from_slice(&v2[MAGIC.len() + 8..v2.len() - 2]);
    out.push(v1);
    for (i, bytes) in out.iter().enumerate() {
        let kind = RecordKind::ALL
            .get(i)
            .copied()
            .unwrap_or(RecordKind::DeadLetter);
        assert!(
            check_kind(kind, bytes),
            "sample {i} ({kind:?}) does not decode"
        );
    }
    out
}

/// Applies `edits` in 4-byte steps (op, position high, position low, byte) to `bytes`.
fn edit(mut bytes: Vec<u8>, edits: &[u8]) -> Vec<u8> {
    for step in edits.chunks_exact(4) {
        let at = usize::from(u16::from_be_bytes([step[1], step[2]]));
        match step[0] % 4 {
            0 if !bytes.is_empty() => {
                let at = at % bytes.len();
                bytes[at] = step[3];
            }
            1 => {
                let at = at % (bytes.len() + 1);
                bytes.insert(at, step[3]);
            }
            2 if !bytes.is_empty() => {
                let at = at % bytes.len();
                bytes.remove(at);
            }
            3 => bytes.truncate(at),
            _ => {}
        }
    }
    bytes
}

/// Decodes `bytes` as `R`; on success, checks the encode/decode round trip. True if it decoded.
fn check<R: AvroRecord + PartialEq + std::fmt::Debug>(bytes: &[u8]) -> bool {
    let Ok(record) = CODEC.decode_record::<R>(bytes) else {
        return false;
    };
    let again = CODEC
        .encode_record(&record)
        .unwrap_or_else(|e| panic!("decoded {record:?} does not encode: {e}"));
    let back = CODEC
        .decode_record::<R>(&again)
        .unwrap_or_else(|e| panic!("re-encoded {record:?} does not decode: {e}"));
    assert_eq!(record, back, "round trip changed the record");
    true
}

fn check_kind(kind: RecordKind, bytes: &[u8]) -> bool {
    match kind {
        RecordKind::Subscription => check::<SubscriptionRecord>(bytes),
        RecordKind::DedupEntry => check::<DedupEntry>(bytes),
        RecordKind::Sequence => check::<SequenceRecord>(bytes),
        RecordKind::Job => check::<JobRecord>(bytes),
        RecordKind::EventPayload => check::<EventPayloadRecord>(bytes),
        RecordKind::Attempt => check::<AttemptRecord>(bytes),
        RecordKind::DeadLetter => check::<DeadLetterRecord>(bytes),
        RecordKind::Health => check::<HealthRecord>(bytes),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let kind = RecordKind::ALL[usize::from(selector & 7)];
    let bytes = match (selector >> 3) & 3 {
        0 => rest.to_vec(),
        1 => [header(CODEC.fingerprint(kind)).as_slice(), rest].concat(),
        2 => {
            let Some((&pick, edits)) = rest.split_first() else {
                return;
            };
            let sample = if kind == RecordKind::DeadLetter && pick & 1 == 1 {
                SAMPLES.len() - 1
            } else {
                usize::from(selector & 7)
            };
            edit(SAMPLES[sample].clone(), edits)
        }
        _ => {
            let Some((&pick, datum)) = rest.split_first() else {
                return;
            };
            let fingerprint = FINGERPRINTS[usize::from(pick) % FINGERPRINTS.len()];
            [header(fingerprint).as_slice(), datum].concat()
        }
    };
    check_kind(kind, &bytes);
});
