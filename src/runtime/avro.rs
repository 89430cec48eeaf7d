//! Avro codec for every record the hub writes to its own topics (control topic, changelogs,
//! attempts, DLQ). It owns the schema registry: the schemas in `schemas/*.avsc`, compiled in with
//! `include_str!` so the files are the only source of truth, plus any older writer schemas that
//! must stay readable.
//!
//! Wire layout (Avro single-object encoding):
//! ```text
//! 0xC3 0x01 | fingerprint: 8 bytes | datum: Avro binary
//!           | CRC-64-AVRO (Rabin) of the writer schema's Parsing Canonical Form, little-endian
//! ```
//! Encoding always uses the current schema of the kind. Decoding looks the fingerprint up among
//! the known writer schemas (current and retired), decodes with that writer schema and resolves
//! the datum to the current reader schema: fields added since the record was written take their
//! schema default (every optional field defaults to null), removed fields are dropped.
//!
//! Invariants:
//! - Malformed input is a [`CodecError`], never a panic: the header is checked before any
//!   decoding, a datum that needs bytes beyond the end of the input is `Decode` (apache-avro would
//!   otherwise read a missing union index as null and accept some truncated records), trailing
//!   bytes are `Decode`, and [`Codec::new`] caps apache-avro's per-length allocation at
//!   [`MAX_DECODE_ALLOCATION`] (2 MiB) so a forged length cannot ask for gigabytes.
//! - A fingerprint of one kind is never decoded as another kind (`Decode`).
//!
//! Evolving a schema: change `schemas/<kind>.avsc` only in compatible ways (new fields with a
//! default), copy the previous text to `schemas/retired/<kind>.v<N>.avsc` and add it to
//! `RETIRED_WRITER_SCHEMAS`, so records already in the topics keep their fingerprint readable.
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};

use apache_avro::Schema;
use apache_avro::rabin::Rabin;
use apache_avro::types::Value;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::records::AvroRecord;

/// First two bytes of every single-object encoded record.
pub const MAGIC: [u8; 2] = [0xC3, 0x01];
/// Magic plus fingerprint.
pub const HEADER_LEN: usize = 10;
/// Largest length (bytes of a string or `bytes` value, items in an array or map block) apache-avro
/// may allocate for while decoding: the hub's topics' `max.message.bytes` (2 MiB), since no field
/// is larger than the record that holds it. The largest legitimate value is an event payload (at
/// most 1.5 MiB, `STREAMING_HUB_MAX_PAYLOAD_BYTES`). apache-avro checks an array's or map's item
/// count against it, not their bytes: a forged count still reserves up to 2 Mi items (a few
/// hundred MB of address space, not touched before the datum ends early and is refused).
pub const MAX_DECODE_ALLOCATION: usize = 2 * 1024 * 1024;
/// Namespace of every hub schema.
pub const NAMESPACE: &str = "studio.lerian.streaming_hub";

/// Previous versions of the bundled schemas, still readable after a schema change; see the module
/// doc. `dead_letter` v2 added the dead event's headers and value; `subscription` v3 added
/// `destination.sealed_target`.
const RETIRED_WRITER_SCHEMAS: &[&str] = &[
    include_str!("../../schemas/retired/dead_letter.v1.avsc"),
    include_str!("../../schemas/retired/subscription.v2.avsc"),
];

/// The records the hub writes, one per schema file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordKind {
    Subscription,
    DedupEntry,
    Sequence,
    Job,
    EventPayload,
    Attempt,
    DeadLetter,
    Health,
}

impl RecordKind {
    pub const ALL: [RecordKind; 8] = [
        RecordKind::Subscription,
        RecordKind::DedupEntry,
        RecordKind::Sequence,
        RecordKind::Job,
        RecordKind::EventPayload,
        RecordKind::Attempt,
        RecordKind::DeadLetter,
        RecordKind::Health,
    ];

    /// The schema's record name (without the namespace).
    pub fn record_name(self) -> &'static str {
        match self {
            RecordKind::Subscription => "Subscription",
            RecordKind::DedupEntry => "DedupEntry",
            RecordKind::Sequence => "Sequence",
            RecordKind::Job => "Job",
            RecordKind::EventPayload => "EventPayload",
            RecordKind::Attempt => "Attempt",
            RecordKind::DeadLetter => "DeadLetter",
            RecordKind::Health => "Health",
        }
    }

    /// `studio.lerian.streaming_hub.<RecordName>`.
    pub fn full_name(self) -> String {
        format!("{NAMESPACE}.{}", self.record_name())
    }

    /// The current schema text, compiled in from `schemas/`.
    pub fn schema_source(self) -> &'static str {
        match self {
            RecordKind::Subscription => include_str!("../../schemas/subscription.avsc"),
            RecordKind::DedupEntry => include_str!("../../schemas/dedup_entry.avsc"),
            RecordKind::Sequence => include_str!("../../schemas/sequence.avsc"),
            RecordKind::Job => include_str!("../../schemas/job.avsc"),
            RecordKind::EventPayload => include_str!("../../schemas/event_payload.avsc"),
            RecordKind::Attempt => include_str!("../../schemas/attempt.avsc"),
            RecordKind::DeadLetter => include_str!("../../schemas/dead_letter.avsc"),
            RecordKind::Health => include_str!("../../schemas/health.avsc"),
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    fn from_full_name(name: &str) -> Option<RecordKind> {
        RecordKind::ALL.into_iter().find(|k| k.full_name() == name)
    }
}

/// A codec error. All are data errors: retrying the same bytes gives the same error, so the caller
/// skips or quarantines the record (or fixes its own value, for `Encode`).
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("not an Avro single-object record: missing magic bytes C3 01")]
    BadMagic,
    #[error("unknown writer schema fingerprint {}", hex8(.0))]
    UnknownFingerprint([u8; 8]),
    #[error("invalid Avro schema: {0}")]
    Schema(String),
    #[error("cannot encode record: {0}")]
    Encode(String),
    #[error("cannot decode record: {0}")]
    Decode(String),
}

impl CodecError {
    /// Always false: a codec error is a property of the data or the schema, not of the moment.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// Parsed schemas of one kind's current version.
struct ReaderEntry {
    schema: Schema,
    fingerprint: [u8; 8],
}

/// A schema some record may have been written with.
struct WriterEntry {
    schema: Schema,
    kind: RecordKind,
}

/// The codec registry. Build it once (parsing the schemas costs milliseconds) and share it; it is
/// `Send + Sync` and every method takes `&self`.
pub struct Codec {
    /// Indexed by [`RecordKind::index`].
    readers: Vec<ReaderEntry>,
    writers: HashMap<[u8; 8], WriterEntry>,
}

impl fmt::Debug for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Codec")
            .field("kinds", &self.readers.len())
            .field("writer_schemas", &self.writers.len())
            .finish()
    }
}

impl Codec {
    /// Parses every bundled schema (current and retired).
    pub fn new() -> Result<Codec, CodecError> {
        // Set-once and process-wide in apache-avro; the first caller wins. Nothing else in the hub
        // decodes Avro, and a limit set earlier by someone else is only less strict.
        apache_avro::util::max_allocation_bytes(MAX_DECODE_ALLOCATION);

        let mut readers = Vec::with_capacity(RecordKind::ALL.len());
        let mut writers = HashMap::new();
        for kind in RecordKind::ALL {
            let schema = parse(kind.schema_source())?;
            let name = full_name(&schema);
            if name != kind.full_name() {
                return Err(CodecError::Schema(format!(
                    "schema for {kind:?} is named {name}, expected {}",
                    kind.full_name()
                )));
            }
            let fingerprint = fingerprint_of(&schema);
            writers.insert(
                fingerprint,
                WriterEntry {
                    schema: schema.clone(),
                    kind,
                },
            );
            readers.push(ReaderEntry {
                schema,
                fingerprint,
            });
        }
        let mut codec = Codec { readers, writers };
        codec.add_writer_schemas(RETIRED_WRITER_SCHEMAS)?;
        Ok(codec)
    }

    /// Like [`Codec::new`], and also reads records written with the given older schemas (JSON
    /// text). Each must be a record named like one of the kinds.
    pub fn with_writer_schemas(extra: &[&str]) -> Result<Codec, CodecError> {
        let mut codec = Codec::new()?;
        codec.add_writer_schemas(extra)?;
        Ok(codec)
    }

    fn add_writer_schemas(&mut self, sources: &[&str]) -> Result<(), CodecError> {
        for source in sources {
            let schema = parse(source)?;
            let name = full_name(&schema);
            let kind = RecordKind::from_full_name(&name).ok_or_else(|| {
                CodecError::Schema(format!("writer schema {name} is not a hub record"))
            })?;
            self.writers
                .insert(fingerprint_of(&schema), WriterEntry { schema, kind });
        }
        Ok(())
    }

    /// Encodes `value` with the current schema of `kind`: header, then the datum.
    pub fn encode<T: Serialize>(&self, kind: RecordKind, value: &T) -> Result<Vec<u8>, CodecError> {
        let reader = &self.readers[kind.index()];
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&reader.fingerprint);
        // apache-avro's schema-directed serializer writes straight to `out` (3-6x faster than
        // building and resolving a `Value`). It writes struct fields in declaration order and does
        // not fill in missing ones, so each struct in `records` must list exactly the schema's
        // fields in the schema's order; the tests compare it with the resolving encoder per kind.
        apache_avro::write_avro_datum_ref(&reader.schema, value, &mut out)
            .map_err(|e| CodecError::Encode(clip(e)))?;
        Ok(out)
    }

    /// Decodes a record of `kind`, resolving from whichever known schema wrote it to the current.
    pub fn decode<T: DeserializeOwned>(
        &self,
        kind: RecordKind,
        bytes: &[u8],
    ) -> Result<T, CodecError> {
        let value = self.decode_value(kind, bytes)?;
        apache_avro::from_value(&value).map_err(|e| CodecError::Decode(clip(e)))
    }

    /// [`Codec::encode`] with the kind taken from the record type.
    pub fn encode_record<R: AvroRecord>(&self, record: &R) -> Result<Vec<u8>, CodecError> {
        self.encode(R::KIND, record)
    }

    /// [`Codec::decode`] with the kind taken from the record type.
    pub fn decode_record<R: AvroRecord>(&self, bytes: &[u8]) -> Result<R, CodecError> {
        self.decode(R::KIND, bytes)
    }

    /// Fingerprint of the current schema of `kind`, as written in the header.
    pub fn fingerprint(&self, kind: RecordKind) -> [u8; 8] {
        self.readers[kind.index()].fingerprint
    }

    /// The current (reader) schema of `kind`.
    pub fn schema(&self, kind: RecordKind) -> &Schema {
        &self.readers[kind.index()].schema
    }

    fn decode_value(&self, kind: RecordKind, bytes: &[u8]) -> Result<Value, CodecError> {
        let (fingerprint, datum) = split_header(bytes)?;
        let writer = self
            .writers
            .get(&fingerprint)
            .ok_or(CodecError::UnknownFingerprint(fingerprint))?;
        if writer.kind != kind {
            return Err(CodecError::Decode(format!(
                "record is a {:?}, expected a {kind:?}",
                writer.kind
            )));
        }
        let reader = &self.readers[kind.index()];
        // Same schema: the decoded value already has the reader's shape.
        let reader_schema = (fingerprint != reader.fingerprint).then_some(&reader.schema);

        let mut input = DatumReader {
            rest: datum,
            wanted_past_end: false,
        };
        let result = apache_avro::from_avro_datum(&writer.schema, &mut input, reader_schema);
        if input.wanted_past_end {
            return Err(CodecError::Decode(format!(
                "truncated: datum of {} bytes ends early",
                datum.len()
            )));
        }
        let value = result.map_err(|e| CodecError::Decode(clip(e)))?;
        if !input.rest.is_empty() {
            return Err(CodecError::Decode(format!(
                "{} trailing bytes after the datum",
                input.rest.len()
            )));
        }
        Ok(value)
    }
}

fn split_header(bytes: &[u8]) -> Result<([u8; 8], &[u8]), CodecError> {
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(CodecError::BadMagic);
    }
    let Some((header, datum)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(CodecError::Decode(format!(
            "truncated header: {} bytes, need {HEADER_LEN}",
            bytes.len()
        )));
    };
    let mut fingerprint = [0u8; 8];
    fingerprint.copy_from_slice(&header[MAGIC.len()..]);
    Ok((fingerprint, datum))
}

fn parse(source: &str) -> Result<Schema, CodecError> {
    Schema::parse_str(source).map_err(|e| CodecError::Schema(clip(e)))
}

fn full_name(schema: &Schema) -> String {
    schema
        .name()
        .map(|n| n.fullname(None))
        .unwrap_or_else(|| "<unnamed>".to_owned())
}

/// CRC-64-AVRO (Rabin) of the schema's Parsing Canonical Form, little-endian as the spec's
/// single-object header wants it.
fn fingerprint_of(schema: &Schema) -> [u8; 8] {
    let bytes = schema.fingerprint::<Rabin>().bytes;
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[..8]);
    out
}

fn hex8(bytes: &[u8; 8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// apache-avro errors can embed whole values (a 1 MiB payload); keep messages short for logs.
fn clip(error: impl fmt::Display) -> String {
    const MAX: usize = 300;
    let mut message = error.to_string();
    if message.len() > MAX {
        let mut end = MAX;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

/// A slice reader that remembers whether the decoder ever wanted bytes past the end. apache-avro
/// reads exactly what a datum needs, so that flag means the datum is truncated — even where the
/// decoder itself would have carried on (it reads a missing union index as null).
struct DatumReader<'a> {
    rest: &'a [u8],
    wanted_past_end: bool,
}

impl Read for DatumReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.len() > self.rest.len() {
            self.wanted_past_end = true;
        }
        let n = buf.len().min(self.rest.len());
        let (head, tail) = self.rest.split_at(n);
        buf[..n].copy_from_slice(head);
        self.rest = tail;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::LazyLock;

    use proptest::prelude::*;

    use super::*;
    use crate::runtime::records::*;

    const SUBSCRIPTION_V1: &str = include_str!("../../schemas/testdata/subscription.v1.avsc");

    static CODEC: LazyLock<Codec> = LazyLock::new(|| Codec::new().expect("bundled schemas parse"));

    fn subscription() -> SubscriptionRecord {
        SubscriptionRecord {
            id: "0190b7a4-5c3e-7d2a-9f1b-3c4d5e6f7a8b".into(),
            tenant_id: "tenant-a".into(),
            origin: Some("lender".into()),
            event_types: vec!["loan_application.approved".into(), "loan.*".into()],
            schema_major: Some(2),
            destination: DestinationRecord {
                kind: DestinationType::Webhook,
                url: Some("https://hooks.example.com/in".into()),
                headers: BTreeMap::from([("x-team".to_owned(), "payments".to_owned())]),
                sensitive_headers: Some(EncryptedBlob {
                    key_id: "kek-1".into(),
                    nonce: vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
                    ciphertext: vec![0xde, 0xad, 0xbe, 0xef, 0x00, 0xff],
                }),
                sealed_target: None,
            },
            enabled: false,
            verification_state: VerificationState::Active,
            retry_schedule: Some(vec![0, 5_000, 300_000]),
            disabled_reason: Some("failing for 120h".into()),
            disabled_at: Some(1_720_000_000_000),
            created_at: 1_710_000_000_000,
            updated_at: 1_720_000_000_000,
            version: 7,
            signing_secrets: vec![
                EncryptedSecret {
                    key_id: "kek-1".into(),
                    nonce: vec![9; 12],
                    ciphertext: vec![1; 48],
                    expires_at: None,
                },
                EncryptedSecret {
                    key_id: "kek-0".into(),
                    nonce: vec![8; 12],
                    ciphertext: vec![2; 48],
                    expires_at: Some(1_720_086_400_000),
                },
            ],
        }
    }

    fn pull_subscription() -> SubscriptionRecord {
        SubscriptionRecord {
            origin: None,
            schema_major: None,
            destination: DestinationRecord {
                kind: DestinationType::Pull,
                url: None,
                headers: BTreeMap::new(),
                sensitive_headers: None,
                sealed_target: None,
            },
            enabled: true,
            verification_state: VerificationState::Pending,
            retry_schedule: None,
            disabled_reason: None,
            disabled_at: None,
            signing_secrets: vec![],
            ..subscription()
        }
    }

    fn dedup_entry() -> DedupEntry {
        DedupEntry {
            tenant_id: "tenant-a".into(),
            ce_id: "0190b7a4-5c3e-7d2a-9f1b-3c4d5e6f7a8b".into(),
            inbox_partition: 5,
            first_offset: 9_000_000_001,
            sequence: 41,
            expires_at: 1_720_086_400_000,
        }
    }

    fn job() -> JobRecord {
        JobRecord {
            event_key: "3:1042".into(),
            subscription_id: "sub-1".into(),
            tenant_id: "tenant-a".into(),
            attempt: 3,
            due_at: 1_720_000_005_000,
            lease_until: Some(1_720_000_035_000),
            reclaims: 1,
            last_status: Some(503),
            last_error: Some("status 503".into()),
            state: JobState::Leased,
        }
    }

    fn payload() -> EventPayloadRecord {
        EventPayloadRecord {
            headers: vec![
                HeaderRecord {
                    key: "ce-id".into(),
                    value: Some(b"0190b7a4-5c3e-7d2a-9f1b-3c4d5e6f7a8b".to_vec()),
                },
                HeaderRecord {
                    key: "x-empty".into(),
                    value: None,
                },
                HeaderRecord {
                    key: "ce-id".into(),
                    value: Some(vec![]),
                },
            ],
            value: (0..=255).collect(),
            refcount: 2,
        }
    }

    fn attempt() -> AttemptRecord {
        AttemptRecord {
            delivery_id: "d-1".into(),
            event_id: "e-1".into(),
            subscription_id: "sub-1".into(),
            tenant_id: "tenant-a".into(),
            attempt: 1,
            started_at: 1_720_000_000_000,
            latency_ms: 42,
            status: Some(500),
            outcome: AttemptOutcome::RetryScheduled,
            error_kind: Some("status".into()),
            response_body_truncated: Some(b"oops\x00\xff".to_vec()),
        }
    }

    fn dead_letter() -> DeadLetterRecord {
        DeadLetterRecord {
            event_id: "e-1".into(),
            subscription_id: "sub-1".into(),
            tenant_id: "tenant-a".into(),
            attempts: 8,
            last_status: None,
            last_error: Some("timeout".into()),
            reason: DeadLetterReason::SubscriptionDisabled,
            dead_at: 1_720_100_000_000,
            event_headers: Some(vec![
                HeaderRecord {
                    key: "ce-id".into(),
                    value: Some(b"e-1".to_vec()),
                },
                HeaderRecord {
                    key: "empty".into(),
                    value: None,
                },
            ]),
            event_value: Some(b"{\"amount\":1}\x00\xff".to_vec()),
        }
    }

    #[test]
    fn a_v1_dead_letter_still_decodes_without_the_event() {
        // v1 had no event fields: its datum is the v2 datum's prefix.
        let codec = Codec::new().unwrap();
        let v1 = parse(include_str!("../../schemas/retired/dead_letter.v1.avsc")).unwrap();
        let mut dl = dead_letter();
        dl.event_headers = None;
        dl.event_value = None;
        let mut datum = Vec::new();
        {
            use apache_avro::types::Record;
            let mut r = Record::new(&v1).unwrap();
            r.put("event_id", dl.event_id.clone());
            r.put("subscription_id", dl.subscription_id.clone());
            r.put("tenant_id", dl.tenant_id.clone());
            r.put("attempts", dl.attempts as i32);
            r.put("last_status", Value::Union(0, Box::new(Value::Null)));
            r.put(
                "last_error",
                Value::Union(1, Box::new(Value::String("timeout".into()))),
            );
            r.put("reason", Value::Enum(2, "subscription_disabled".into()));
            r.put("dead_at", Value::TimestampMillis(dl.dead_at));
            datum.extend(apache_avro::to_avro_datum(&v1, r).unwrap());
        }
        let mut bytes = MAGIC.to_vec();
        bytes.extend(fingerprint_of(&v1));
        bytes.extend(datum);
        let back: DeadLetterRecord = codec.decode(RecordKind::DeadLetter, &bytes).unwrap();
        assert_eq!(back, dl);
    }

    fn health() -> HealthRecord {
        HealthRecord {
            subscription_id: "sub-1".into(),
            first_failure_at: Some(1_700_000_000_000),
            last_failure_at: Some(1_700_100_000_000),
            consecutive_failures: 12,
            breaker_state: BreakerState::HalfOpen,
            breaker_opened_at: Some(1_700_050_000_000),
        }
    }

    /// The reference encoder: resolves a `Value` to `schema` (fields by name, union branches, enum
    /// symbols, defaults), then writes header + datum. Slow, but independent of struct field order.
    fn encode_by_resolution(
        schema: &Schema,
        fingerprint: [u8; 8],
        value: Value,
    ) -> Result<Vec<u8>, CodecError> {
        let value = value
            .resolve(schema)
            .map_err(|e| CodecError::Encode(clip(e)))?;
        let datum =
            apache_avro::to_avro_datum(schema, value).map_err(|e| CodecError::Encode(clip(e)))?;
        let mut out = Vec::with_capacity(HEADER_LEN + datum.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&fingerprint);
        out.extend_from_slice(&datum);
        Ok(out)
    }

    fn round_trip<R: AvroRecord + PartialEq + fmt::Debug>(record: R) {
        let bytes = CODEC.encode_record(&record).expect("encodes");
        let back: R = CODEC.decode_record(&bytes).expect("decodes");
        assert_eq!(back, record, "{:?} did not round-trip", R::KIND);
    }

    /// Zig-zag varint, as Avro writes `long`s.
    fn avro_long(n: i64) -> Vec<u8> {
        let mut z = ((n << 1) ^ (n >> 63)) as u64;
        let mut out = vec![];
        loop {
            if z <= 0x7f {
                out.push(z as u8);
                return out;
            }
            out.push(0x80 | (z & 0x7f) as u8);
            z >>= 7;
        }
    }

    fn header(kind: RecordKind) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&CODEC.fingerprint(kind));
        out
    }

    /// Decodes `bytes` as `kind` into its record type, dropping the value.
    fn decode_as(kind: RecordKind, bytes: &[u8]) -> Result<(), CodecError> {
        match kind {
            RecordKind::Subscription => CODEC.decode::<SubscriptionRecord>(kind, bytes).map(drop),
            RecordKind::DedupEntry => CODEC.decode::<DedupEntry>(kind, bytes).map(drop),
            RecordKind::Sequence => CODEC.decode::<SequenceRecord>(kind, bytes).map(drop),
            RecordKind::Job => CODEC.decode::<JobRecord>(kind, bytes).map(drop),
            RecordKind::EventPayload => CODEC.decode::<EventPayloadRecord>(kind, bytes).map(drop),
            RecordKind::Attempt => CODEC.decode::<AttemptRecord>(kind, bytes).map(drop),
            RecordKind::DeadLetter => CODEC.decode::<DeadLetterRecord>(kind, bytes).map(drop),
            RecordKind::Health => CODEC.decode::<HealthRecord>(kind, bytes).map(drop),
        }
    }

    /// A retry step below zero, which only a record written past the API holds (the schema's
    /// steps are `long`s), makes the schedule malformed, so the hub's curve is followed: the
    /// record stays readable. Refused by the decoder, the subscription's deliveries were held.
    #[test]
    fn a_negative_retry_step_reads_as_a_malformed_schedule_not_an_unreadable_record() {
        use crate::dispatch::curve::{DEFAULT_DELAYS_MS, MAX_STEP_MS, delays};
        let mut rec = subscription();
        rec.retry_schedule = Some(vec![5_000]);
        let bytes = CODEC.encode_record(&rec).unwrap();
        // The schedule's array: one item (count 1), 5000, end; written again with -100.
        let [one, end] = [avro_long(1), avro_long(0)];
        let find = [one.clone(), avro_long(5_000), end.clone()].concat();
        let with = [one, avro_long(-100), end].concat();
        let at = bytes
            .windows(find.len())
            .position(|w| w == find.as_slice())
            .expect("the schedule's bytes");
        assert_eq!(find.len(), with.len(), "same length, nothing else moves");
        let mut patched = bytes.clone();
        patched[at..at + find.len()].copy_from_slice(&with);
        let back: SubscriptionRecord = CODEC.decode_record(&patched).expect("readable");
        assert_eq!(back.retry_schedule, Some(vec![MALFORMED_STEP_MS]));
        const { assert!(MALFORMED_STEP_MS > MAX_STEP_MS) };
        assert_eq!(delays(back.retry_schedule.as_deref()), DEFAULT_DELAYS_MS);
        assert_eq!(back.id, rec.id, "the rest as written");
        // Written again (an auto-disable), it reads the same.
        let again: SubscriptionRecord = CODEC
            .decode_record(&CODEC.encode_record(&back).unwrap())
            .unwrap();
        assert_eq!(again, back);
    }

    #[test]
    fn every_kind_round_trips_exactly() {
        round_trip(subscription());
        let mut sealed = subscription();
        sealed.destination.url = Some("https://hooks.example.com/in?code=***".into());
        sealed.destination.sealed_target = Some(EncryptedBlob {
            key_id: "kek-1".into(),
            nonce: vec![7; 12],
            ciphertext: vec![0x51; 30],
        });
        round_trip(sealed);
        round_trip(pull_subscription());
        round_trip(dedup_entry());
        round_trip(SequenceRecord {
            tenant_id: "tenant-a".into(),
            next_sequence: 1 << 40,
        });
        round_trip(job());
        round_trip(JobRecord {
            lease_until: None,
            last_status: None,
            last_error: None,
            state: JobState::Parked,
            ..job()
        });
        round_trip(payload());
        round_trip(EventPayloadRecord {
            headers: vec![],
            value: vec![],
            refcount: 0,
        });
        round_trip(attempt());
        round_trip(AttemptRecord {
            status: None,
            error_kind: None,
            response_body_truncated: None,
            outcome: AttemptOutcome::Delivered,
            ..attempt()
        });
        round_trip(dead_letter());
        round_trip(health());
        round_trip(HealthRecord {
            first_failure_at: None,
            last_failure_at: None,
            breaker_opened_at: None,
            breaker_state: BreakerState::Closed,
            ..health()
        });
    }

    fn assert_same_bytes_as_resolution<R: AvroRecord + fmt::Debug>(record: &R) {
        let fast = CODEC.encode_record(record).expect("encodes");
        let reference = encode_by_resolution(
            CODEC.schema(R::KIND),
            CODEC.fingerprint(R::KIND),
            apache_avro::to_value(record).unwrap(),
        )
        .unwrap();
        assert_eq!(
            fast,
            reference,
            "{:?}: struct fields differ from the schema's fields or their order",
            R::KIND
        );
    }

    #[test]
    fn every_record_struct_lists_its_schema_fields_in_schema_order() {
        // The direct encoder trusts struct field order; the reference encoder places fields by
        // name. Equal bytes for every kind (maps here hold at most one entry, so their order
        // cannot differ) mean each struct mirrors its schema.
        assert_same_bytes_as_resolution(&subscription());
        assert_same_bytes_as_resolution(&pull_subscription());
        assert_same_bytes_as_resolution(&dedup_entry());
        assert_same_bytes_as_resolution(&SequenceRecord {
            tenant_id: "tenant-a".into(),
            next_sequence: 7,
        });
        assert_same_bytes_as_resolution(&job());
        assert_same_bytes_as_resolution(&payload());
        assert_same_bytes_as_resolution(&attempt());
        assert_same_bytes_as_resolution(&dead_letter());
        assert_same_bytes_as_resolution(&health());
    }

    #[test]
    fn every_bundled_schema_parses_with_its_own_fingerprint() {
        let mut seen = std::collections::HashSet::new();
        for kind in RecordKind::ALL {
            assert_eq!(
                CODEC.schema(kind).name().unwrap().fullname(None),
                kind.full_name()
            );
            assert!(
                seen.insert(CODEC.fingerprint(kind)),
                "{kind:?} shares a fingerprint"
            );
        }
    }

    #[test]
    fn encoded_record_starts_with_magic_and_the_writer_schema_fingerprint() {
        let bytes = CODEC.encode_record(&job()).unwrap();
        assert_eq!(bytes[..2], [0xC3, 0x01]);
        assert_eq!(bytes[2..10], CODEC.fingerprint(RecordKind::Job));
        let datum = apache_avro::to_avro_datum(
            CODEC.schema(RecordKind::Job),
            apache_avro::to_value(job())
                .unwrap()
                .resolve(CODEC.schema(RecordKind::Job))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            bytes[10..],
            datum[..],
            "the datum follows the header unframed"
        );
    }

    #[test]
    fn fingerprint_is_crc64_avro_of_the_canonical_form_little_endian() {
        // Vector from the Avro specification's test suite: "null" -> 7195948357588979594.
        let expected = 7_195_948_357_588_979_594_u64.to_le_bytes();
        assert_eq!(fingerprint_of(&Schema::Null), expected);
        // Docs and defaults are not part of the canonical form, so they do not move it.
        let plain = r#"{"type":"record","name":"R","fields":[{"name":"a","type":"long"}]}"#;
        let documented = r#"{"type":"record","name":"R","doc":"d",
            "fields":[{"name":"a","type":"long","doc":"x","default":1}]}"#;
        assert_eq!(
            fingerprint_of(&Schema::parse_str(plain).unwrap()),
            fingerprint_of(&Schema::parse_str(documented).unwrap())
        );
    }

    #[test]
    fn bytes_without_the_magic_are_bad_magic() {
        for bytes in [
            &b""[..],
            &[0xC3],
            &[0x00, 0x01, 1, 2, 3, 4, 5, 6, 7, 8],
            b"{\"json\":true}",
        ] {
            assert!(matches!(
                CODEC.decode::<JobRecord>(RecordKind::Job, bytes),
                Err(CodecError::BadMagic)
            ));
        }
    }

    #[test]
    fn header_shorter_than_ten_bytes_is_a_decode_error() {
        let bytes = &header(RecordKind::Job)[..7];
        assert!(matches!(
            CODEC.decode::<JobRecord>(RecordKind::Job, bytes),
            Err(CodecError::Decode(_))
        ));
    }

    #[test]
    fn unknown_fingerprint_is_reported_with_its_bytes() {
        let mut bytes = CODEC.encode_record(&job()).unwrap();
        bytes[2..10].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let err = CODEC
            .decode::<JobRecord>(RecordKind::Job, &bytes)
            .unwrap_err();
        assert!(matches!(
            err,
            CodecError::UnknownFingerprint([1, 2, 3, 4, 5, 6, 7, 8])
        ));
        assert!(err.to_string().contains("0102030405060708"), "{err}");
    }

    #[test]
    fn every_truncation_of_a_record_is_a_decode_error() {
        // Cuts right before an optional field used to decode as null with apache-avro alone.
        for bytes in [
            CODEC.encode_record(&subscription()).unwrap(),
            CODEC.encode_record(&pull_subscription()).unwrap(),
            CODEC.encode_record(&health()).unwrap(),
            CODEC.encode_record(&attempt()).unwrap(),
        ] {
            for cut in HEADER_LEN..bytes.len() {
                let err = CODEC
                    .decode::<SubscriptionRecord>(RecordKind::Subscription, &bytes[..cut])
                    .err();
                let kind_err = RecordKind::ALL
                    .into_iter()
                    .find(|k| CODEC.fingerprint(*k) == bytes[2..10])
                    .map(|k| decode_as(k, &bytes[..cut]));
                assert!(err.is_some(), "cut at {cut} decoded");
                assert!(
                    matches!(kind_err, Some(Err(CodecError::Decode(_)))),
                    "cut at {cut} of {} gave {kind_err:?}",
                    bytes.len()
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_after_the_datum_are_a_decode_error() {
        let mut bytes = CODEC.encode_record(&health()).unwrap();
        bytes.push(0);
        assert!(matches!(
            CODEC.decode_record::<HealthRecord>(&bytes),
            Err(CodecError::Decode(_))
        ));
    }

    #[test]
    fn a_forged_huge_length_is_refused_without_allocating_it() {
        for len in [i64::MAX, 1 << 40, (MAX_DECODE_ALLOCATION as i64) + 1, -5] {
            let mut bytes = header(RecordKind::Sequence);
            bytes.extend(avro_long(len)); // tenant_id's length
            assert!(
                matches!(
                    CODEC.decode_record::<SequenceRecord>(&bytes),
                    Err(CodecError::Decode(_))
                ),
                "length {len}"
            );
        }
        let mut bytes = header(RecordKind::EventPayload);
        bytes.extend(avro_long(1 << 50)); // headers' block count
        assert!(matches!(
            CODEC.decode_record::<EventPayloadRecord>(&bytes),
            Err(CodecError::Decode(_))
        ));
    }

    #[test]
    fn a_record_of_another_kind_is_not_decoded_as_this_kind() {
        let bytes = CODEC.encode_record(&job()).unwrap();
        assert!(matches!(
            CODEC.decode::<SubscriptionRecord>(RecordKind::Subscription, &bytes),
            Err(CodecError::Decode(_))
        ));
    }

    #[test]
    fn a_negative_counter_on_the_wire_is_a_decode_error_not_a_wrapped_value() {
        let mut bytes = header(RecordKind::Sequence);
        bytes.extend(avro_long(1)); // tenant_id: one byte
        bytes.push(b't');
        bytes.extend(avro_long(-3)); // next_sequence
        assert!(matches!(
            CODEC.decode_record::<SequenceRecord>(&bytes),
            Err(CodecError::Decode(_))
        ));
    }

    #[test]
    fn a_value_the_schema_cannot_hold_is_an_encode_error() {
        let record = SequenceRecord {
            tenant_id: "t".into(),
            next_sequence: u64::MAX,
        };
        assert!(matches!(
            CODEC.encode_record(&record),
            Err(CodecError::Encode(_))
        ));
    }

    #[test]
    fn a_counter_beyond_avro_int_is_an_encode_error() {
        let record = JobRecord {
            attempt: u32::MAX,
            ..job()
        };
        assert!(matches!(
            CODEC.encode_record(&record),
            Err(CodecError::Encode(_))
        ));
    }

    #[test]
    fn old_writer_schema_is_still_readable_by_the_current_reader() {
        let v1 = Schema::parse_str(SUBSCRIPTION_V1).unwrap();
        let v1_fingerprint = fingerprint_of(&v1);
        assert_ne!(v1_fingerprint, CODEC.fingerprint(RecordKind::Subscription));
        // What a V1 writer produced: the fields V1 knows (resolution to V1 drops the others).
        let written = subscription();
        let bytes = encode_by_resolution(
            &v1,
            v1_fingerprint,
            apache_avro::to_value(&written).unwrap(),
        )
        .unwrap();
        assert_eq!(bytes[2..10], v1_fingerprint);

        let codec = Codec::with_writer_schemas(&[SUBSCRIPTION_V1]).unwrap();
        let read: SubscriptionRecord = codec.decode_record(&bytes).unwrap();

        assert_eq!(read.retry_schedule, None, "new field takes its default");
        assert_eq!(read.disabled_reason, None, "new field takes its default");
        assert_eq!(read.disabled_at, None, "new field takes its default");
        assert_eq!(
            read,
            SubscriptionRecord {
                retry_schedule: None,
                disabled_reason: None,
                disabled_at: None,
                ..written
            }
        );
    }

    #[test]
    fn a_subscription_written_before_sealed_queries_still_decodes() {
        // What every instance wrote before v3: no `sealed_target`, so its URL is the one requests go to.
        let v2 = parse(include_str!("../../schemas/retired/subscription.v2.avsc")).unwrap();
        let written = subscription();
        let bytes = encode_by_resolution(
            &v2,
            fingerprint_of(&v2),
            apache_avro::to_value(&written).unwrap(),
        )
        .unwrap();
        assert_ne!(bytes[2..10], CODEC.fingerprint(RecordKind::Subscription));
        let read: SubscriptionRecord = CODEC.decode_record(&bytes).unwrap();
        assert_eq!(read, written);
        assert_eq!(read.destination.sealed_target, None);
    }

    #[test]
    fn old_writer_schema_unknown_to_the_codec_is_an_unknown_fingerprint() {
        let v1 = Schema::parse_str(SUBSCRIPTION_V1).unwrap();
        let bytes = encode_by_resolution(
            &v1,
            fingerprint_of(&v1),
            apache_avro::to_value(subscription()).unwrap(),
        )
        .unwrap();
        assert!(matches!(
            CODEC.decode_record::<SubscriptionRecord>(&bytes),
            Err(CodecError::UnknownFingerprint(_))
        ));
    }

    #[test]
    fn a_writer_schema_that_is_not_a_hub_record_is_refused() {
        let foreign = r#"{"type":"record","name":"Other","namespace":"x","fields":[]}"#;
        assert!(matches!(
            Codec::with_writer_schemas(&[foreign]),
            Err(CodecError::Schema(_))
        ));
        assert!(matches!(
            Codec::with_writer_schemas(&["not json"]),
            Err(CodecError::Schema(_))
        ));
    }

    #[test]
    fn codec_errors_are_never_retryable() {
        let errors = [
            CodecError::BadMagic,
            CodecError::UnknownFingerprint([0; 8]),
            CodecError::Schema("s".into()),
            CodecError::Encode("e".into()),
            CodecError::Decode("d".into()),
        ];
        assert!(errors.iter().all(|e| !e.is_retryable()));
    }

    /// Policy for every schema file, so evolution keeps working as the files change: a namespace,
    /// a doc on every named type and field, and every optional field a `["null", T]` union with
    /// a null default.
    #[test]
    fn bundled_schemas_document_every_field_and_default_every_optional_field_to_null() {
        fn check_type(ty: &serde_json::Value, path: &str) {
            match ty {
                serde_json::Value::Array(branches) => {
                    for b in branches {
                        check_type(b, path);
                    }
                }
                serde_json::Value::Object(obj) => {
                    let t = obj["type"].as_str().unwrap_or_default();
                    if matches!(t, "record" | "enum") {
                        assert!(obj.contains_key("doc"), "{path}: type without doc");
                    }
                    if t == "record" {
                        for field in obj["fields"].as_array().unwrap() {
                            check_field(field, path);
                        }
                    }
                    for key in ["items", "values"] {
                        if let Some(inner) = obj.get(key) {
                            check_type(inner, path);
                        }
                    }
                }
                _ => {}
            }
        }
        fn check_field(field: &serde_json::Value, parent: &str) {
            let path = format!("{parent}.{}", field["name"].as_str().unwrap());
            assert!(field.get("doc").is_some(), "{path}: field without doc");
            if let serde_json::Value::Array(branches) = &field["type"]
                && branches.iter().any(|b| b == "null")
            {
                assert_eq!(branches[0], "null", "{path}: null must be the first branch");
                assert_eq!(
                    field.get("default"),
                    Some(&serde_json::Value::Null),
                    "{path}: optional field needs a null default"
                );
            }
            check_type(&field["type"], &path);
        }
        for kind in RecordKind::ALL {
            let json: serde_json::Value = serde_json::from_str(kind.schema_source()).unwrap();
            assert_eq!(json["namespace"], NAMESPACE, "{kind:?}");
            check_type(&json, kind.record_name());
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_after_a_valid_header_never_panic(
            kind in prop::sample::select(RecordKind::ALL.to_vec()),
            body in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut bytes = header(kind);
            bytes.extend(body);
            let _ = decode_as(kind, &bytes);
        }

        #[test]
        fn a_corrupted_record_is_decoded_or_refused_never_panics(
            position in 0usize..4096,
            byte in any::<u8>(),
        ) {
            let mut bytes = CODEC.encode_record(&subscription()).unwrap();
            let at = position % bytes.len();
            bytes[at] = byte;
            let _ = CODEC.decode_record::<SubscriptionRecord>(&bytes);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_as(RecordKind::Subscription, &bytes);
        }
    }
}
