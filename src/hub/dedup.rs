//! Dedup on `ce-id`, scoped by tenant, and the tenant's arrival sequence.
//!
//! Rule (DESIGN.md §2): the store maps (tenant, ce-id) to the inbox offset where the id was first
//! seen. Seen at another offset: a duplicate — nothing is written, it is counted. Seen at the same
//! offset: a replay after an offset reset — processed again, with the sequence number it got the
//! first time. Unseen, or seen but expired: a new event, which takes the tenant's next sequence.
//!
//! Expiry: an entry lives `STREAMING_HUB_IDEMPOTENCY_TTL` from the first copy's ingest time. An
//! index family (`dedup_expiry`, key = expires_at big-endian ‖ dedup key) lets each batch delete
//! what has expired by walking the index from its start — never a scan of all entries, never work
//! per event. An expired entry not yet purged counts as absent.
//!
//! Keys: dedup = `tenant 0x00 ce-id` (a tenant id cannot contain NUL: ingest quarantines control
//! characters), a UUIDv7 `ce-id` in lower case (see [`dedup_key`]); sequence = `tenant`. On the state changelog (the jobs changelog) they are written
//! behind `d/` and `s/` (see `hub::task`).
use crate::runtime::records::DedupEntry;

/// The store families of this module.
pub const DEDUP: &str = "dedup";
pub const DEDUP_EXPIRY: &str = "dedup_expiry";
pub const SEQUENCE: &str = "sequence";

/// What the dedup store says of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// First sighting (or the earlier one expired): assign the next sequence.
    New,
    /// The same id at another offset: drop.
    Duplicate { first_offset: i64 },
    /// The same id at the same offset: an offset reset replays it; keep its sequence.
    Replay { sequence: u64 },
}

/// Judges an event at `offset` of `partition`, ingested at `ingest_ms`, given the stored entry
/// for its (tenant, ce-id).
pub fn judge(existing: Option<&DedupEntry>, partition: i32, offset: i64, ingest_ms: i64) -> Seen {
    match existing {
        Some(e) if e.expires_at > ingest_ms => {
            if e.first_offset == offset && e.inbox_partition == partition {
                Seen::Replay {
                    sequence: e.sequence,
                }
            } else {
                Seen::Duplicate {
                    first_offset: e.first_offset,
                }
            }
        }
        _ => Seen::New,
    }
}

/// The store key of (tenant, ce-id). A UUIDv7 id is keyed in lower case: its hex digits' case
/// does not change a UUID (RFC 9562 §4), ingest takes either, and `0190A8E2-…` next to
/// `0190a8e2-…` is one event written twice (each copy was delivered). Any other id (allowed with
/// `STREAMING_HUB_REQUIRE_UUIDV7=false`) is keyed as written: case may tell a producer's ids apart.
/// The id itself, as stored and as delivered, stays as the producer wrote it.
pub fn dedup_key(tenant: &str, ce_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(tenant.len() + 1 + ce_id.len());
    k.extend_from_slice(tenant.as_bytes());
    k.push(0);
    if ce_id.bytes().any(|b| b.is_ascii_uppercase()) && crate::ingest::classify::is_uuidv7(ce_id) {
        k.extend(ce_id.bytes().map(|b| b.to_ascii_lowercase()));
    } else {
        k.extend_from_slice(ce_id.as_bytes());
    }
    k
}

/// The key (tenant, ce-id) had before ids were keyed in lower case, when it differs from `key`
/// (its [`dedup_key`]): an upper-case UUIDv7.
pub fn key_as_written(tenant: &str, ce_id: &str, key: &[u8]) -> Option<Vec<u8>> {
    // Checked before any allocation: this runs for every event new to the store.
    if !ce_id.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let old = [tenant.as_bytes(), b"\0", ce_id.as_bytes()].concat();
    (old != key).then_some(old)
}

pub fn expiry_key(expires_at: i64, dedup_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(8 + dedup_key.len());
    k.extend_from_slice(&(expires_at.max(0) as u64).to_be_bytes());
    k.extend_from_slice(dedup_key);
    k
}

/// Splits an expiry index key into (expires_at, dedup key).
pub fn split_expiry_key(key: &[u8]) -> Option<(i64, &[u8])> {
    let (t, rest) = key.split_at_checked(8)?;
    Some((u64::from_be_bytes(t.try_into().ok()?) as i64, rest))
}

/// Reads `expires_at` straight from an encoded dedup entry, without a full Avro decode (restore
/// calls this for every changelog record). Only records written with the current schema (its
/// fingerprint) are read this way; None for anything else, and the caller decodes normally.
/// Layout after the 10-byte single-object header: tenant_id and ce_id (length + bytes),
/// inbox_partition, first_offset, sequence, expires_at (zigzag varints), nothing after.
pub fn expires_at_fast(codec: &crate::runtime::avro::Codec, bytes: &[u8]) -> Option<i64> {
    if bytes.len() < 10
        || bytes[..2] != [0xC3, 0x01]
        || bytes[2..10] != codec.fingerprint(crate::runtime::avro::RecordKind::DedupEntry)
    {
        return None;
    }
    // Everything the full decode would refuse is refused here too (a record taken here that the
    // hub later fails to decode would stop its partition on every batch).
    let mut r = &bytes[10..];
    for _ in 0..2 {
        let len = usize::try_from(varint(&mut r)?).ok()?;
        std::str::from_utf8(r.get(..len)?).ok()?;
        r = &r[len..];
    }
    i32::try_from(varint(&mut r)?).ok()?; // inbox_partition
    varint(&mut r)?; // first_offset
    u64::try_from(varint(&mut r)?).ok()?; // sequence
    let expires_at = varint(&mut r)?;
    r.is_empty().then_some(expires_at)
}

/// One Avro zigzag varint (int or long).
pub(crate) fn varint(r: &mut &[u8]) -> Option<i64> {
    let mut n: u64 = 0;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = r.split_first()?;
        *r = rest;
        n |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some((n >> 1) as i64 ^ -((n & 1) as i64));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_expiry_read_agrees_with_the_full_decode() {
        let codec = crate::runtime::avro::Codec::new().unwrap();
        for (tenant, id, offset, seq, exp) in [
            ("t", "id", 0i64, 0u64, 0i64),
            (
                "tenant-with-a-longer-name",
                "0190a8e2-0000-7000-8000-000000000001",
                9_000_000_001,
                41,
                1_796_025_075_554,
            ),
            ("x", "", 1, 1, -5),
        ] {
            let e = DedupEntry {
                tenant_id: tenant.into(),
                ce_id: id.into(),
                inbox_partition: 3,
                first_offset: offset,
                sequence: seq,
                expires_at: exp,
            };
            let bytes = codec
                .encode(crate::runtime::avro::RecordKind::DedupEntry, &e)
                .unwrap();
            assert_eq!(expires_at_fast(&codec, &bytes), Some(exp));
            assert_eq!(
                expires_at_fast(&codec, &bytes[..bytes.len() - 1]),
                None,
                "truncated"
            );
        }
        assert_eq!(expires_at_fast(&codec, b"\xc3\x01garbage!!"), None);
    }

    #[test]
    fn the_fast_read_refuses_what_the_full_decode_refuses() {
        let codec = crate::runtime::avro::Codec::new().unwrap();
        let zigzag = |v: i64, out: &mut Vec<u8>| {
            let mut n = ((v << 1) ^ (v >> 63)) as u64;
            while n >= 0x80 {
                out.push((n as u8) | 0x80);
                n >>= 7;
            }
            out.push(n as u8);
        };
        let record = |tenant: &[u8], partition: i64, sequence: i64| {
            let mut b = vec![0xC3, 0x01];
            b.extend(codec.fingerprint(crate::runtime::avro::RecordKind::DedupEntry));
            zigzag(tenant.len() as i64, &mut b);
            b.extend(tenant);
            zigzag(2, &mut b);
            b.extend(b"id");
            for v in [partition, 7, sequence, 1_796_025_075_554] {
                zigzag(v, &mut b);
            }
            b
        };
        let good = record(b"t", 3, 41);
        assert_eq!(expires_at_fast(&codec, &good), Some(1_796_025_075_554));
        for bad in [
            record(b"t\xff", 3, 41),
            record(b"t", 1 << 40, 41),
            record(b"t", 3, -1),
        ] {
            assert!(
                codec
                    .decode::<DedupEntry>(crate::runtime::avro::RecordKind::DedupEntry, &bad)
                    .is_err()
            );
            assert_eq!(expires_at_fast(&codec, &bad), None);
        }
    }

    fn entry(offset: i64, sequence: u64, expires_at: i64) -> DedupEntry {
        DedupEntry {
            tenant_id: "t".into(),
            ce_id: "id".into(),
            inbox_partition: 2,
            first_offset: offset,
            sequence,
            expires_at,
        }
    }

    #[test]
    fn unseen_id_is_new() {
        assert_eq!(judge(None, 2, 10, 1_000), Seen::New);
    }

    #[test]
    fn same_id_at_another_offset_is_a_duplicate() {
        let e = entry(10, 4, 5_000);
        assert_eq!(
            judge(Some(&e), 2, 11, 1_000),
            Seen::Duplicate { first_offset: 10 }
        );
    }

    #[test]
    fn same_id_at_the_same_offset_is_a_replay_with_its_first_sequence() {
        let e = entry(10, 4, 5_000);
        assert_eq!(judge(Some(&e), 2, 10, 1_000), Seen::Replay { sequence: 4 });
    }

    #[test]
    fn same_offset_in_another_partition_is_a_duplicate_not_a_replay() {
        let e = entry(10, 4, 5_000);
        assert_eq!(
            judge(Some(&e), 3, 10, 1_000),
            Seen::Duplicate { first_offset: 10 }
        );
    }

    #[test]
    fn duplicate_whose_first_copy_expired_is_new() {
        let e = entry(10, 4, 5_000);
        assert_eq!(judge(Some(&e), 2, 99, 5_000), Seen::New);
        assert_eq!(
            judge(Some(&e), 2, 99, 4_999),
            Seen::Duplicate { first_offset: 10 }
        );
    }

    #[test]
    fn a_uuidv7_id_in_upper_case_is_a_duplicate_of_the_same_id_in_lower_case() {
        let lower = "0190a8e2-0000-7000-8000-00000000abcd";
        let upper = "0190A8E2-0000-7000-8000-00000000ABCD";
        let mixed = "0190a8E2-0000-7000-8000-00000000AbCd";
        assert_eq!(dedup_key("t", upper), dedup_key("t", lower));
        assert_eq!(dedup_key("t", mixed), dedup_key("t", lower));
        assert_eq!(
            dedup_key("t", upper),
            [b"t\0".as_slice(), lower.as_bytes()].concat()
        );
        // Still scoped by tenant, which is never folded.
        assert_ne!(dedup_key("T", upper), dedup_key("t", lower));
        // A free-form id (relaxed STREAMING_HUB_REQUIRE_UUIDV7) keeps its case, and so does a
        // UUID of another version or a UUIDv7 in another form: those are not UUIDv7 ids to ingest.
        let (simple_upper, simple_lower) = (upper.replace('-', ""), lower.replace('-', ""));
        for (a, b) in [
            ("Order-ABC", "order-abc"),
            (
                "0190A8E2-0000-4000-8000-00000000ABCD",
                "0190a8e2-0000-4000-8000-00000000abcd",
            ),
            (simple_upper.as_str(), simple_lower.as_str()),
        ] {
            assert_ne!(dedup_key("t", a), dedup_key("t", b), "{a}");
            assert_eq!(
                dedup_key("t", a),
                [b"t\0".as_slice(), a.as_bytes()].concat()
            );
            assert_eq!(key_as_written("t", a, &dedup_key("t", a)), None);
        }
        // An upper-case UUIDv7's key before ids were folded, looked up when the folded one
        // is not there (a replay of an event the previous version took in).
        assert_eq!(
            key_as_written("t", upper, &dedup_key("t", upper)),
            Some([b"t\0".as_slice(), upper.as_bytes()].concat())
        );
        assert_eq!(key_as_written("t", lower, &dedup_key("t", lower)), None);
    }

    #[test]
    fn expiry_keys_sort_by_time_and_split_back() {
        let a = expiry_key(1_000, &dedup_key("t", "b"));
        let b = expiry_key(2_000, &dedup_key("t", "a"));
        assert!(a < b, "index walks oldest first");
        let (t, k) = split_expiry_key(&b).unwrap();
        assert_eq!(t, 2_000);
        assert_eq!(k, dedup_key("t", "a").as_slice());
        assert_eq!(split_expiry_key(b"short"), None);
    }
}
