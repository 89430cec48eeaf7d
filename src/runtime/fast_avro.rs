//! Hand-written readers for the two records the hub decodes on every delivery: a job on each
//! claim and each outcome, a payload on each claim; and writers for the payload the hub stores
//! for every new event ([`encode_payload`]) and the job it writes on each change ([`encode_job`]),
//! byte for byte what the [`Codec`] writes.
//!
//! apache-avro decodes into a [`apache_avro::types::Value`] tree first and then copies it into the
//! struct (every header key, value and the body allocated twice). These read the current schema's
//! bytes straight into the struct. Only records written with the current schema (their
//! fingerprint) take this path, and anything it does not accept as-is (a union index, an enum
//! symbol or a number out of range, bad UTF-8, trailing bytes, a truncated datum) goes to the
//! [`Codec`], whose answer (a value or a typed error) is the one returned. The tests compare both
//! decoders on generated records and on damaged bytes.
use crate::hub::dedup::varint;
use crate::runtime::avro::{Codec, CodecError, HEADER_LEN, MAGIC, RecordKind};
use crate::runtime::records::{EventPayloadRecord, HeaderRecord, JobRecord, JobState};

/// Decodes a job record.
pub fn job(codec: &Codec, bytes: &[u8]) -> Result<JobRecord, CodecError> {
    match current_datum(codec, RecordKind::Job, bytes).and_then(read_job) {
        Some(job) => Ok(job),
        None => codec.decode(RecordKind::Job, bytes),
    }
}

/// Decodes an event payload record.
pub fn payload(codec: &Codec, bytes: &[u8]) -> Result<EventPayloadRecord, CodecError> {
    match current_datum(codec, RecordKind::EventPayload, bytes).and_then(read_payload) {
        Some(p) => Ok(p),
        None => codec.decode(RecordKind::EventPayload, bytes),
    }
}

/// Encodes an event payload record (current schema, with its single-object header) straight
/// from the inbox record's headers and value, without building an [`EventPayloadRecord`] first:
/// the same bytes as `Codec::encode(RecordKind::EventPayload, ..)` (the tests compare them).
pub fn encode_payload<'h>(
    codec: &Codec,
    headers: impl ExactSizeIterator<Item = (&'h str, Option<&'h [u8]>)>,
    value: &[u8],
    refcount: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + value.len() + 64 * (headers.len() + 1));
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&codec.fingerprint(RecordKind::EventPayload));
    // One array block holding every header, then the empty block that ends the array.
    if headers.len() > 0 {
        put_long(&mut out, headers.len() as i64);
        for (key, v) in headers {
            put_bytes(&mut out, key.as_bytes());
            match v {
                None => put_long(&mut out, 0),
                Some(v) => {
                    put_long(&mut out, 1);
                    put_bytes(&mut out, v);
                }
            }
        }
    }
    put_long(&mut out, 0);
    put_bytes(&mut out, value);
    put_long(&mut out, i64::from(refcount));
    out
}

/// Encodes a job record (current schema, with its single-object header): the same bytes as
/// `Codec::encode(RecordKind::Job, ..)` (the tests compare them), without apache-avro's value
/// tree (the hub writes a job when it is created, claimed and rescheduled). A count beyond an
/// Avro `int` goes to the [`Codec`], whose answer is the one returned.
pub fn encode_job(codec: &Codec, job: &JobRecord) -> Result<Vec<u8>, CodecError> {
    let int = |n: u32| i32::try_from(n).ok().map(i64::from);
    let (Some(attempt), Some(reclaims)) = (int(job.attempt), int(job.reclaims)) else {
        return codec.encode(RecordKind::Job, job);
    };
    let mut out = Vec::with_capacity(
        HEADER_LEN
            + job.event_key.len()
            + job.subscription_id.len()
            + job.tenant_id.len()
            + job.last_error.as_ref().map_or(0, String::len)
            + 48,
    );
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&codec.fingerprint(RecordKind::Job));
    put_bytes(&mut out, job.event_key.as_bytes());
    put_bytes(&mut out, job.subscription_id.as_bytes());
    put_bytes(&mut out, job.tenant_id.as_bytes());
    put_long(&mut out, attempt);
    put_long(&mut out, job.due_at);
    match job.lease_until {
        None => put_long(&mut out, 0),
        Some(t) => {
            put_long(&mut out, 1);
            put_long(&mut out, t);
        }
    }
    put_long(&mut out, reclaims);
    match job.last_status {
        None => put_long(&mut out, 0),
        Some(s) => {
            put_long(&mut out, 1);
            put_long(&mut out, i64::from(s));
        }
    }
    match &job.last_error {
        None => put_long(&mut out, 0),
        Some(e) => {
            put_long(&mut out, 1);
            put_bytes(&mut out, e.as_bytes());
        }
    }
    put_long(
        &mut out,
        match job.state {
            JobState::Pending => 0,
            JobState::Leased => 1,
            JobState::Parked => 2,
        },
    );
    Ok(out)
}

/// An Avro `int` or `long`: zigzag, then base-128 little-endian groups.
pub(crate) fn put_long(out: &mut Vec<u8>, v: i64) {
    let mut n = ((v << 1) ^ (v >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// An Avro `bytes` or `string`: its length, then the bytes.
fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_long(out, b.len() as i64);
    out.extend_from_slice(b);
}

/// The datum after the single-object header, when it names the current schema of `kind`.
pub(crate) fn current_datum<'b>(
    codec: &Codec,
    kind: RecordKind,
    bytes: &'b [u8],
) -> Option<&'b [u8]> {
    let (header, datum) = bytes.split_first_chunk::<HEADER_LEN>()?;
    (header[..MAGIC.len()] == MAGIC && header[MAGIC.len()..] == codec.fingerprint(kind))
        .then_some(datum)
}

fn int(r: &mut &[u8]) -> Option<i32> {
    i32::try_from(varint(r)?).ok()
}

/// An Avro `bytes` or `string`: its length, then that many bytes.
pub(crate) fn raw<'b>(r: &mut &'b [u8]) -> Option<&'b [u8]> {
    let len = usize::try_from(varint(r)?).ok()?;
    if len > r.len() {
        return None;
    }
    let (head, rest) = r.split_at(len);
    *r = rest;
    Some(head)
}

fn string(r: &mut &[u8]) -> Option<String> {
    String::from_utf8(raw(r)?.to_vec()).ok()
}

/// A `["null", T]` union: `Some(None)` for null, `Some(Some(t))` for a value.
fn nullable<T>(r: &mut &[u8], read: impl FnOnce(&mut &[u8]) -> Option<T>) -> Option<Option<T>> {
    match varint(r)? {
        0 => Some(None),
        1 => Some(Some(read(r)?)),
        _ => None,
    }
}

/// `schemas/job.avsc`, field by field.
fn read_job(mut r: &[u8]) -> Option<JobRecord> {
    let r = &mut r;
    let job = JobRecord {
        event_key: string(r)?,
        subscription_id: string(r)?,
        tenant_id: string(r)?,
        attempt: u32::try_from(int(r)?).ok()?,
        due_at: varint(r)?,
        lease_until: nullable(r, varint)?,
        reclaims: u32::try_from(int(r)?).ok()?,
        last_status: nullable(r, |r| u16::try_from(int(r)?).ok())?,
        last_error: nullable(r, string)?,
        state: match varint(r)? {
            0 => JobState::Pending,
            1 => JobState::Leased,
            2 => JobState::Parked,
            _ => return None,
        },
    };
    r.is_empty().then_some(job)
}

/// `schemas/event_payload.avsc`: headers (array blocks of {key, value: null|bytes}), value,
/// refcount.
fn read_payload(mut r: &[u8]) -> Option<EventPayloadRecord> {
    let r = &mut r;
    let mut headers = Vec::new();
    loop {
        let mut count = varint(r)?;
        if count == 0 {
            break;
        }
        if count < 0 {
            varint(r)?; // the block's size in bytes
            count = count.checked_neg()?;
        }
        // Each header takes at least two bytes: a count larger than that is damage, not a
        // reason to reserve memory.
        if usize::try_from(count).ok()? > r.len() / 2 {
            return None;
        }
        for _ in 0..count {
            headers.push(HeaderRecord {
                key: string(r)?,
                value: nullable(r, |r| raw(r).map(<[u8]>::to_vec))?,
            });
        }
    }
    let value = raw(r)?.to_vec();
    let refcount = u32::try_from(int(r)?).ok()?;
    r.is_empty().then_some(EventPayloadRecord {
        headers,
        value,
        refcount,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn codec() -> &'static Codec {
        static CODEC: std::sync::OnceLock<Codec> = std::sync::OnceLock::new();
        CODEC.get_or_init(|| Codec::new().unwrap())
    }

    fn job_strategy() -> impl Strategy<Value = JobRecord> {
        (
            (".{0,12}", "[a-z0-9-]{0,40}", "\\PC{0,8}"),
            (0..=i32::MAX as u32, any::<i64>(), any::<Option<i64>>()),
            (
                0..=i32::MAX as u32,
                any::<Option<u16>>(),
                any::<Option<String>>(),
            ),
            prop_oneof![
                Just(JobState::Pending),
                Just(JobState::Leased),
                Just(JobState::Parked)
            ],
        )
            .prop_map(
                |(
                    (event_key, subscription_id, tenant_id),
                    (attempt, due_at, lease_until),
                    (reclaims, last_status, last_error),
                    state,
                )| JobRecord {
                    event_key,
                    subscription_id,
                    tenant_id,
                    attempt,
                    due_at,
                    lease_until,
                    reclaims,
                    last_status,
                    last_error,
                    state,
                },
            )
    }

    fn payload_strategy() -> impl Strategy<Value = EventPayloadRecord> {
        (
            proptest::collection::vec(
                (
                    "[a-z-]{0,20}",
                    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
                ),
                0..20,
            ),
            proptest::collection::vec(any::<u8>(), 0..2048),
            0..=i32::MAX as u32,
        )
            .prop_map(|(headers, value, refcount)| EventPayloadRecord {
                headers: headers
                    .into_iter()
                    .map(|(key, value)| HeaderRecord { key, value })
                    .collect(),
                value,
                refcount,
            })
    }

    /// Both decoders' answers on the same bytes: equal values, or both an error.
    fn agree<T: PartialEq + std::fmt::Debug + serde::de::DeserializeOwned>(
        kind: RecordKind,
        bytes: &[u8],
        fast: fn(&Codec, &[u8]) -> Result<T, CodecError>,
    ) -> Result<(), TestCaseError> {
        let slow = codec().decode::<T>(kind, bytes);
        let quick = fast(codec(), bytes);
        match (&slow, &quick) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "decoders disagree: {slow:?} against {quick:?}"),
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn a_job_reads_back_as_the_full_decoder_reads_it(job in job_strategy()) {
            let bytes = codec().encode(RecordKind::Job, &job).unwrap();
            let datum = current_datum(codec(), RecordKind::Job, &bytes).unwrap();
            // The fast path itself took it (not the fallback).
            prop_assert_eq!(read_job(datum), Some(job.clone()));
            prop_assert_eq!(super::job(codec(), &bytes).unwrap(), job);
        }

        #[test]
        fn a_job_is_written_byte_for_byte_as_the_codec_writes_it(
            job in job_strategy(),
            attempt in prop_oneof![Just(None), Just(Some(u32::MAX)), (0..=u32::MAX).prop_map(Some)],
        ) {
            // Now and then an attempt count beyond an Avro int: the codec's answer either way.
            let job = JobRecord { attempt: attempt.unwrap_or(job.attempt), ..job };
            let quick = encode_job(codec(), &job).map_err(|e| e.to_string());
            let slow = codec().encode(RecordKind::Job, &job).map_err(|e| e.to_string());
            prop_assert_eq!(&quick, &slow);
            if let Ok(bytes) = quick {
                prop_assert_eq!(super::job(codec(), &bytes).unwrap(), job);
            }
        }

        #[test]
        fn a_payload_reads_back_as_the_full_decoder_reads_it(p in payload_strategy()) {
            let bytes = codec().encode(RecordKind::EventPayload, &p).unwrap();
            let datum = current_datum(codec(), RecordKind::EventPayload, &bytes).unwrap();
            prop_assert_eq!(read_payload(datum), Some(p.clone()));
            prop_assert_eq!(payload(codec(), &bytes).unwrap(), p);
        }

        #[test]
        fn a_payload_is_written_byte_for_byte_as_the_codec_writes_it(p in payload_strategy()) {
            let headers = p.headers.iter().map(|h| (h.key.as_str(), h.value.as_deref()));
            let bytes = encode_payload(codec(), headers, &p.value, p.refcount);
            prop_assert_eq!(&bytes, &codec().encode(RecordKind::EventPayload, &p).unwrap());
            prop_assert_eq!(payload(codec(), &bytes).unwrap(), p);
        }

        #[test]
        fn damaged_jobs_get_the_full_decoders_answer(
            job in job_strategy(),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let bytes = codec().encode(RecordKind::Job, &job).unwrap();
            let truncated = &bytes[..HEADER_LEN + cut.index(bytes.len() - HEADER_LEN)];
            agree(RecordKind::Job, truncated, super::job)?;
            let mut flipped = bytes.clone();
            let at = HEADER_LEN + flip.index(bytes.len() - HEADER_LEN);
            flipped[at] = byte;
            agree(RecordKind::Job, &flipped, super::job)?;
            let mut longer = bytes;
            longer.push(0);
            agree(RecordKind::Job, &longer, super::job)?;
        }

        #[test]
        fn damaged_payloads_get_the_full_decoders_answer(
            p in payload_strategy(),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let bytes = codec().encode(RecordKind::EventPayload, &p).unwrap();
            let truncated = &bytes[..HEADER_LEN + cut.index(bytes.len() - HEADER_LEN)];
            agree(RecordKind::EventPayload, truncated, payload)?;
            let mut flipped = bytes.clone();
            let at = HEADER_LEN + flip.index(bytes.len() - HEADER_LEN);
            flipped[at] = byte;
            agree(RecordKind::EventPayload, &flipped, payload)?;
        }
    }

    #[test]
    fn a_header_array_in_size_prefixed_blocks_reads_like_the_full_decoder() {
        // Avro writers may split an array into blocks with a negative count and a byte size;
        // apache-avro never writes it, other writers may.
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&codec().fingerprint(RecordKind::EventPayload));
        // Block of -1 item, 4 bytes: key "a" (02 61), value null (00)... then one more block of
        // 1 item: key "b", value bytes "x".
        bytes.extend_from_slice(&[0x01, 0x06, 0x02, b'a', 0x00]);
        bytes.extend_from_slice(&[0x02, 0x02, b'b', 0x02, 0x02, b'x']);
        bytes.extend_from_slice(&[0x00, 0x04, b'h', b'i', 0x04]);
        let slow = codec()
            .decode::<EventPayloadRecord>(RecordKind::EventPayload, &bytes)
            .unwrap();
        let datum = current_datum(codec(), RecordKind::EventPayload, &bytes).unwrap();
        assert_eq!(read_payload(datum).as_ref(), Some(&slow));
        assert_eq!(slow.headers.len(), 2);
        assert_eq!(slow.headers[1].value.as_deref(), Some(&b"x"[..]));
        assert_eq!(slow.refcount, 2);
    }

    #[test]
    fn another_kinds_bytes_are_refused_with_the_codecs_error() {
        let p = EventPayloadRecord {
            headers: vec![],
            value: b"{}".to_vec(),
            refcount: 1,
        };
        let bytes = codec().encode(RecordKind::EventPayload, &p).unwrap();
        let e = job(codec(), &bytes).unwrap_err();
        assert!(e.to_string().contains("expected a Job"), "{e}");
    }
}
