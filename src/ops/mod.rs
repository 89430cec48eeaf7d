//! Operations: what operators and pull clients do with the hub's topics, outside the hub task.
//!
//! - `pull`: `GET /v1/events` reads a pull subscription's events from `<prefix>.pull` at a cursor;
//! - `ratelimit`: per-tenant token buckets (pull API);
//! - `redeliver`: per-subscription replay, recover and redrive, all by writing *redelivery
//!   requests* to `<prefix>.inbox` (the event's headers and value plus
//!   `x-streaming-hub-redeliver: <subscription id>`, key = tenant). The hub task that owns the
//!   tenant's partition turns each into a job for that one subscription inside its transaction,
//!   bypassing dedup; so a redelivery is exactly as durable, fenced and fair as a first delivery;
//! - `forensics`: an index of producers' `lerian.streaming.<source>.dlq` topics, the hub's
//!   quarantine and its dead deliveries, read by a consumer group of its own.
pub mod forensics;
pub mod pull;
pub mod ratelimit;
pub mod redeliver;

/// Kafka's default partitioner for keyed records (Java clients, and librdkafka's
/// `murmur2_random`, which every hub producer uses): `(murmur2(key) & 0x7fffffff) % partitions`.
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    ((murmur2(key) & 0x7fff_ffff) % partitions.max(1) as u32) as i32
}

/// MurmurHash2, 32-bit, seed 0x9747b28c, as in `org.apache.kafka.common.utils.Utils.murmur2`.
pub fn murmur2(data: &[u8]) -> u32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ len as u32;
    let chunks = data.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    match tail.len() {
        3 => {
            h ^= (tail[2] as u32) << 16;
            h ^= (tail[1] as u32) << 8;
            h ^= tail[0] as u32;
            h = h.wrapping_mul(M);
        }
        2 => {
            h ^= (tail[1] as u32) << 8;
            h ^= tail[0] as u32;
            h = h.wrapping_mul(M);
        }
        1 => {
            h ^= tail[0] as u32;
            h = h.wrapping_mul(M);
        }
        _ => {}
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_kafkas_own_test_vectors() {
        // org.apache.kafka.common.utils.UtilsTest#testMurmur2
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ];
        for (input, want) in cases {
            assert_eq!(murmur2(input.as_bytes()) as i32, want, "{input}");
        }
    }

    #[test]
    fn partitions_stay_in_range() {
        for i in 0..1000 {
            let p = partition_for(format!("key-{i}").as_bytes(), 6);
            assert!((0..6).contains(&p));
        }
    }
}
