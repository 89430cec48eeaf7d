//! Rust shapes of the records the hub writes to its own topics, one struct per schema in
//! `schemas/*.avsc` (the schema files are the source of truth; these mirror them field by field).
//!
//! Mapping rules, so a struct and its schema cannot drift apart silently:
//! - field names are the Avro field names; a field whose Avro name is a Rust keyword is renamed
//!   with `#[serde(rename)]` (`Destination.type` → [`DestinationRecord::kind`]);
//! - `["null", T]` unions are `Option<T>`;
//! - `timestamp-millis` is `i64` milliseconds since the Unix epoch (UTC), the unit of the
//!   injected clock; durations in milliseconds are `u64`;
//! - Avro `int` counters are `u32` (HTTP statuses `u16`, Kafka partitions `i32`), Avro `long`
//!   offsets are `i64` (as Kafka has them) and sequence numbers and versions `u64`; a negative value
//!   on the wire is a decode error;
//! - Avro enums are unit enums whose serde names are the Avro symbols;
//! - Avro `bytes` are `Vec<u8>` with apache-avro's `serde_avro_bytes` helpers: without them serde
//!   writes a `Vec<u8>` as an array of ints and reading it back as bytes fails.
//!
//! Every test round trip in `runtime::avro` goes through these structs, so a mismatch fails there.
use std::collections::BTreeMap;

use apache_avro::{serde_avro_bytes, serde_avro_bytes_opt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::avro::RecordKind;

/// Milliseconds since the Unix epoch, UTC (Avro `timestamp-millis`).
pub type TimestampMillis = i64;

/// A record type the codec knows: ties each struct to its schema so callers cannot pair a value
/// with the wrong [`RecordKind`].
pub trait AvroRecord: Serialize + DeserializeOwned {
    const KIND: RecordKind;
}

/// What a negative retry step reads as: one past the longest step a schedule may have (10 h), so
/// the schedule is malformed (see `dispatch::curve::delays`), and still a `long` when the record
/// is written again (an auto-disable rewrites the record it read).
pub const MALFORMED_STEP_MS: u64 = 10 * 3600 * 1000 + 1;

fn steps_or_malformed<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<u64>>, D::Error> {
    let steps: Option<Vec<i64>> = Option::deserialize(d)?;
    Ok(steps.map(|steps| {
        steps
            .into_iter()
            .map(|ms| u64::try_from(ms).unwrap_or(MALFORMED_STEP_MS))
            .collect()
    }))
}

/// `schemas/subscription.avsc`: value of `<prefix>.subscriptions` (key = `id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscriptionRecord {
    pub id: String,
    pub tenant_id: String,
    pub origin: Option<String>,
    pub event_types: Vec<String>,
    pub schema_major: Option<u32>,
    pub destination: DestinationRecord,
    pub enabled: bool,
    pub verification_state: VerificationState,
    /// Delays in milliseconds before attempt 2, 3, ... A negative one, which only a record
    /// written past the API holds (the schema's steps are `long`s), reads as
    /// [`MALFORMED_STEP_MS`], so the schedule is malformed and the hub's curve is followed, as
    /// for any malformed schedule. Refused, it made the whole record unreadable: the
    /// subscription's deliveries were held until another record.
    #[serde(default, deserialize_with = "steps_or_malformed")]
    pub retry_schedule: Option<Vec<u64>>,
    pub disabled_reason: Option<String>,
    pub disabled_at: Option<TimestampMillis>,
    pub created_at: TimestampMillis,
    pub updated_at: TimestampMillis,
    pub version: u64,
    /// Current secret first; a rotated-out secret carries `expires_at`.
    pub signing_secrets: Vec<EncryptedSecret>,
}

impl SubscriptionRecord {
    /// An enabled, active pull subscription at version 1 (tools, tests and benchmarks start from
    /// it and change what they need).
    pub fn pull(id: &str, tenant: &str, event_types: &[&str]) -> SubscriptionRecord {
        SubscriptionRecord {
            id: id.into(),
            tenant_id: tenant.into(),
            origin: None,
            event_types: event_types.iter().map(|t| t.to_string()).collect(),
            schema_major: None,
            destination: DestinationRecord {
                kind: DestinationType::Pull,
                url: None,
                headers: BTreeMap::new(),
                sensitive_headers: None,
                sealed_target: None,
            },
            enabled: true,
            verification_state: VerificationState::Active,
            retry_schedule: None,
            disabled_reason: None,
            disabled_at: None,
            created_at: 0,
            updated_at: 0,
            version: 1,
            signing_secrets: vec![],
        }
    }
}

/// `Destination`: a webhook or the pull queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestinationRecord {
    #[serde(rename = "type")]
    pub kind: DestinationType,
    pub url: Option<String>,
    /// Non-sensitive custom headers. A `BTreeMap` keeps `Debug` and equality deterministic; the
    /// order of map entries on the wire is not significant.
    pub headers: BTreeMap<String, String>,
    /// Encrypted JSON object of sensitive headers.
    pub sensitive_headers: Option<EncryptedBlob>,
    /// The URL past its host as given (path, query, fragment), sealed: `url` shows it redacted (see
    /// [`crate::subscriptions::sealed_url`]). None: `url` is the URL requests go to.
    #[serde(default)]
    pub sealed_target: Option<EncryptedBlob>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DestinationType {
    Webhook,
    Pull,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerificationState {
    Pending,
    Active,
    Failed,
}

/// `EncryptedBlob`: AES-256-GCM ciphertext (tag appended) under the key-encryption key `key_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncryptedBlob {
    pub key_id: String,
    #[serde(with = "serde_avro_bytes")]
    pub nonce: Vec<u8>,
    #[serde(with = "serde_avro_bytes")]
    pub ciphertext: Vec<u8>,
}

/// `EncryptedSecret`: one sealed signing secret; never plaintext.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncryptedSecret {
    pub key_id: String,
    #[serde(with = "serde_avro_bytes")]
    pub nonce: Vec<u8>,
    #[serde(with = "serde_avro_bytes")]
    pub ciphertext: Vec<u8>,
    /// End of the rotation grace period; `None` for the current secret.
    pub expires_at: Option<TimestampMillis>,
}

/// `schemas/dedup_entry.avsc`: where a tenant's `ce-id` was first seen in the inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupEntry {
    pub tenant_id: String,
    pub ce_id: String,
    pub inbox_partition: i32,
    pub first_offset: i64,
    /// The tenant's arrival sequence number given at first sight; a replay keeps it.
    pub sequence: u64,
    pub expires_at: TimestampMillis,
}

/// `schemas/sequence.avsc`: a tenant's arrival sequence counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceRecord {
    pub tenant_id: String,
    pub next_sequence: u64,
}

/// `schemas/job.avsc`: one delivery job per (event, webhook subscription).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub event_key: String,
    pub subscription_id: String,
    pub tenant_id: String,
    /// Number of the next attempt, 1 for a new job.
    pub attempt: u32,
    pub due_at: TimestampMillis,
    pub lease_until: Option<TimestampMillis>,
    pub reclaims: u32,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub state: JobState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Pending,
    Leased,
    Parked,
}

/// `schemas/event_payload.avsc`: an event's headers and value, stored once per event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventPayloadRecord {
    /// Kafka headers in their original order (keys may repeat).
    pub headers: Vec<HeaderRecord>,
    #[serde(with = "serde_avro_bytes")]
    pub value: Vec<u8>,
    pub refcount: u32,
}

/// `Header`: one Kafka record header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRecord {
    pub key: String,
    #[serde(with = "serde_avro_bytes_opt")]
    pub value: Option<Vec<u8>>,
}

/// `schemas/attempt.avsc`: one HTTP delivery attempt, appended to `<prefix>.attempts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub delivery_id: String,
    pub event_id: String,
    pub subscription_id: String,
    pub tenant_id: String,
    pub attempt: u32,
    pub started_at: TimestampMillis,
    pub latency_ms: u64,
    pub status: Option<u16>,
    pub outcome: AttemptOutcome,
    pub error_kind: Option<String>,
    #[serde(with = "serde_avro_bytes_opt")]
    pub response_body_truncated: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    Delivered,
    RetryScheduled,
    DeadLettered,
}

/// `schemas/dead_letter.avsc`: a delivery that ended without success, in `<prefix>.dlq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterRecord {
    pub event_id: String,
    pub subscription_id: String,
    pub tenant_id: String,
    pub attempts: u32,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub reason: DeadLetterReason,
    pub dead_at: TimestampMillis,
    /// The dead event's headers and value (recover and redrive); None in v1 records.
    pub event_headers: Option<Vec<HeaderRecord>>,
    #[serde(with = "serde_avro_bytes_opt")]
    pub event_value: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterReason {
    Exhausted,
    Poison,
    SubscriptionDisabled,
}

/// `schemas/health.avsc`: a subscription's failure span and breaker state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthRecord {
    pub subscription_id: String,
    pub first_failure_at: Option<TimestampMillis>,
    pub last_failure_at: Option<TimestampMillis>,
    pub consecutive_failures: u32,
    pub breaker_state: BreakerState,
    pub breaker_opened_at: Option<TimestampMillis>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl AvroRecord for SubscriptionRecord {
    const KIND: RecordKind = RecordKind::Subscription;
}
impl AvroRecord for DedupEntry {
    const KIND: RecordKind = RecordKind::DedupEntry;
}
impl AvroRecord for SequenceRecord {
    const KIND: RecordKind = RecordKind::Sequence;
}
impl AvroRecord for JobRecord {
    const KIND: RecordKind = RecordKind::Job;
}
impl AvroRecord for EventPayloadRecord {
    const KIND: RecordKind = RecordKind::EventPayload;
}
impl AvroRecord for AttemptRecord {
    const KIND: RecordKind = RecordKind::Attempt;
}
impl AvroRecord for DeadLetterRecord {
    const KIND: RecordKind = RecordKind::DeadLetter;
}
impl AvroRecord for HealthRecord {
    const KIND: RecordKind = RecordKind::Health;
}
