//! Ingest against the real broker, through the real `streaming-hub` binary: one record per verdict
//! and reason lands exactly where it should, a salted tenant meets in one inbox partition, a new
//! producer topic is followed without a restart, a SIGKILL mid-run neither loses nor
//! duplicates a record, a batch that aborts is counted once, when it commits, and a record
//! claiming another topic's source is quarantined when that is required.
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use base64::Engine;
use common::*;

const ADDED: [&str; 4] = [
    "x-streaming-hub-source-topic",
    "x-streaming-hub-source-partition",
    "x-streaming-hub-source-offset",
    "x-streaming-hub-ingest-time",
];

fn follow_exactly(topic: &str) -> String {
    format!("^{}$", topic.replace('.', r"\."))
}

/// The record VECTORS.md signs with key k1 of source `ledger`.
fn vector_record() -> Rec {
    let h = |k: &str, v: &str| (k.to_string(), Some(v.as_bytes().to_vec()));
    Rec {
        key: Some(b"tenant-1".to_vec()),
        headers: vec![
            h("ce-specversion", "1.0"),
            h("ce-id", "0190a8e2-0000-7000-8000-000000000001"),
            h("ce-source", "ledger"),
            h("ce-type", "studio.lerian.ledger.transaction.created"),
            h("ce-time", "2026-09-26T12:00:00Z"),
            h("ce-schemaversion", "1.0.0"),
            h("ce-resourcetype", "transaction"),
            h("ce-eventtype", "created"),
            h("ce-subject", "acc-1"),
            h("ce-datacontenttype", "application/json"),
            h("ce-tenantid", "tenant-1"),
            h("ce-sigkid", "k1"),
            h("ce-sigts", "2026-09-26T12:00:05.123456789Z"),
            h("ce-sig", "v1.AJbY2MqfEv5EvFyAS70emQDM59tj3lpf0PBYeUW0ho4"),
        ],
        value: Some(br#"{"amount":"10.00"}"#.to_vec()),
        partition: None,
    }
}

fn system_event() -> Rec {
    let mut r = event("x", "platform-reaper", "platform", "reaper_pass");
    r.key = Some(b"system:reaper_pass".to_vec());
    r.set("ce-tenantid", None)
        .set("ce-time", Some(b"2026-04-18T10:30:45.123456789Z"))
        .add("ce-systemevent", b"true")
}

/// Input records tagged with the outcome each must get: "accept", "drop" or a reason code.
fn table() -> Vec<(&'static str, Rec)> {
    let ok = || event("tenant-a", "ledger", "transaction", "created");
    let ledger_single_tenant = event("default", "ledger", "account", "created")
        .set("ce-time", Some(b"2026-03-01T09:15:00.5-03:00"))
        .set("ce-subject", Some(b"acc-42"));
    vec![
        ("accept", ok()),
        ("accept", ledger_single_tenant),
        (
            "accept",
            event("tenant-b", "ledger", "balance", "config-changed"),
        ),
        ("drop", system_event()),
        (
            "system_event_with_tenant",
            system_event().set("ce-tenantid", Some(b"tenant-a")),
        ),
        (
            "accept_spoofed",
            ok().add("x-streaming-hub-ingest-time", b"1999-01-01T00:00:00Z")
                .add("X-Streaming-Hub-Redeliver", b"some-subscription"),
        ),
        ("missing_header", ok().set("ce-source", None)),
        (
            "unsupported_specversion",
            ok().set("ce-specversion", Some(b"0.3")),
        ),
        ("invalid_id", ok().set("ce-id", Some(b"not-a-uuid"))),
        ("invalid_source", ok().set("ce-source", Some(b"Ledger!"))),
        (
            "invalid_type",
            ok().set("ce-type", Some(b"studio.lerian.ledger.transaction")),
        ),
        (
            "type_mismatch",
            ok().set("ce-type", Some(b"studio.lerian.other.transaction.created")),
        ),
        ("invalid_time", ok().set("ce-time", Some(b"yesterday"))),
        (
            "invalid_schemaversion",
            ok().set("ce-schemaversion", Some(b"one")),
        ),
        ("missing_tenant", ok().set("ce-tenantid", None)),
        // One byte past what a token or a subscription can name: never deliverable.
        (
            "invalid_tenant",
            ok().set("ce-tenantid", Some(&[b't'; 257])),
        ),
        (
            "duplicate_header",
            ok().add("ce-id", uuid::Uuid::now_v7().to_string().as_bytes()),
        ),
        (
            "invalid_header_encoding",
            ok().set("ce-subject", Some(b"acc\r\nX-Injected: 1")),
        ),
        (
            "invalid_header_encoding",
            ok().set("ce-subject", Some(&[0xff, 0xfe, 0x41])),
        ),
        (
            "invalid_header_encoding",
            ok().set(
                "ce-datacontenttype",
                Some("text/plain; charset=\u{201c}utf-8\u{201d}".as_bytes()),
            ),
        ),
        ("headers_too_many", {
            let mut r = ok();
            for i in 0..2000 {
                r = r.add(&format!("x-junk-{i}"), b"");
            }
            r
        }),
        (
            "missing_tenant_spoofed",
            ok().set("ce-tenantid", None)
                .add("x-streaming-hub-reason", b"ok")
                .add("X-Lerian-DLQ-Error-Class", b"old_error"),
        ),
        (
            "headers_too_large",
            ok().set("ce-subject", Some(&vec![b's'; 9 * 1024])),
        ),
        // Under 8 KiB as a value, one byte over as a header line (nginx holds 8 KiB per line,
        // name and CRLF included).
        (
            "headers_too_large",
            ok().set(
                "ce-subject",
                Some(&vec![b's'; 8 * 1024 + 1 - "ce-subject: \r\n".len()]),
            ),
        ),
        // The hub's own resource name: its verification probe goes out as
        // `streaming_hub.verification`.
        (
            "reserved_resource_type",
            event("tenant-a", "ledger", "streaming_hub", "verification"),
        ),
        // Sent as the Content-Type, a CloudEvents envelope type makes SDKs read the body as one.
        (
            "unsupported_datacontenttype",
            ok().set("ce-datacontenttype", Some(b"application/cloudevents+json")),
        ),
        // CloudEvents names are lower-case letters and digits: receivers' SDKs refuse others.
        ("invalid_header_encoding", ok().add("ce-trace_id", b"abc")),
        // Tenant ids that look like another: a trailing blank, an invisible character.
        (
            "invalid_tenant",
            ok().set("ce-tenantid", Some(b"tenant-a ")),
        ),
        (
            "invalid_tenant",
            ok().set("ce-tenantid", Some("tenant-a\u{200b}".as_bytes())),
        ),
        ("invalid_subject", ok().set("ce-subject", Some(b""))),
        (
            "invalid_dataschema",
            ok().add("ce-dataschema", b"not a uri"),
        ),
        // A resource name longer than any subscription can name (its header would be repeated
        // in X-Lerian-Event-Type past receivers' header limits).
        (
            "invalid_type",
            ok().set("ce-resourcetype", Some(&[b'r'; 256])).set(
                "ce-type",
                Some(format!("studio.lerian.ledger.{}.created", "r".repeat(256)).as_bytes()),
            ),
        ),
        ("payload_too_large", {
            let mut r = ok();
            r.value = Some(vec![b'x'; 5000]);
            r
        }),
    ]
}

#[tokio::test]
async fn every_verdict_and_reason_lands_exactly_where_it_should() {
    require_broker();
    let prefix = unique("ing");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let mut env = hub_env(&prefix, &follow_exactly(&topic));
    env.insert("STREAMING_HUB_MAX_PAYLOAD_BYTES".into(), "4096".into());
    let _hub = Hub::start(&env);

    let cases = table();
    let recs: Vec<Rec> = cases.iter().map(|(_, r)| r.clone()).collect();
    produce(&producer(), &topic, &recs);
    let expected_out = cases.iter().filter(|(o, _)| *o != "drop").count();
    let inbox = format!("{prefix}.inbox");
    let quarantine = format!("{prefix}.quarantine");
    // Every input committed first, then everything written read: an extra record (an input
    // written twice, a drop written) is counted, not cut off at the expected number.
    let group = format!("{prefix}-group");
    wait_until(
        Duration::from_secs(60),
        "ingest to commit every input",
        || group_caught_up(&group, &topic).then_some(()),
    );
    let got = read_all(&[&inbox, &quarantine], Duration::from_secs(60));

    // Index outputs by the input offset they came from.
    let mut by_offset: HashMap<i64, &Got> = HashMap::new();
    for g in &got {
        let off = g
            .rec
            .header("x-streaming-hub-source-offset")
            .or_else(|| g.rec.header("x-lerian-dlq-source-offset"))
            .expect("every output names its source offset");
        assert!(
            by_offset.insert(off.parse().unwrap(), g).is_none(),
            "input offset {off} written twice"
        );
    }
    assert_eq!(got.len(), expected_out);
    for (offset, (outcome, input)) in cases.iter().enumerate() {
        let out = by_offset.get(&(offset as i64));
        match *outcome {
            "drop" => assert!(out.is_none(), "system event at {offset} must write nothing"),
            "accept_spoofed" => {
                // A producer's `x-streaming-hub-*` headers are not carried: the hub owns them.
                let g = out.unwrap_or_else(|| panic!("accepted record {offset} missing"));
                assert_eq!(g.topic, inbox);
                let own: Vec<&str> = g
                    .rec
                    .headers
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .filter(|k| k.to_ascii_lowercase().starts_with("x-streaming-hub-"))
                    .collect();
                assert_eq!(own, ADDED, "only the hub's own headers, once each");
                assert_ne!(
                    g.rec.header("x-streaming-hub-ingest-time"),
                    Some("1999-01-01T00:00:00Z")
                );
            }
            "accept" => {
                let g = out.unwrap_or_else(|| panic!("accepted record {offset} missing"));
                assert_eq!(g.topic, inbox);
                let tenant = input.header("ce-tenantid").unwrap();
                assert_eq!(
                    g.rec.key.as_deref(),
                    Some(tenant.as_bytes()),
                    "inbox key = tenant"
                );
                assert_eq!(g.rec.value, input.value, "value unchanged");
                assert_eq!(
                    &g.rec.headers[..input.headers.len()],
                    &input.headers[..],
                    "original headers first, unchanged"
                );
                let added: Vec<&str> = g.rec.headers[input.headers.len()..]
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect();
                assert_eq!(added, ADDED);
                assert_eq!(
                    g.rec.header("x-streaming-hub-source-topic"),
                    Some(topic.as_str())
                );
                assert_eq!(g.rec.header("x-streaming-hub-source-partition"), Some("0"));
                chrono::DateTime::parse_from_rfc3339(
                    g.rec.header("x-streaming-hub-ingest-time").unwrap(),
                )
                .unwrap();
            }
            tag => {
                // Tags that say more than the reason: headers over the record limits (left out
                // but the first of each CloudEvents attribute, the payload kept); a producer's
                // own forensic headers (not carried).
                let (reason, headers_dropped, spoofed) = match tag {
                    "headers_too_many" => ("headers_too_large", true, false),
                    "missing_tenant_spoofed" => ("missing_tenant", false, true),
                    reason => (reason, false, false),
                };
                let g =
                    out.unwrap_or_else(|| panic!("quarantined record {offset} ({reason}) missing"));
                assert_eq!(g.topic, quarantine, "{reason}");
                assert_eq!(
                    g.rec.header("x-streaming-hub-reason"),
                    Some(reason),
                    "record {offset}"
                );
                assert_eq!(g.rec.key, input.key);
                assert_eq!(
                    g.rec.header("x-lerian-dlq-source-topic"),
                    Some(topic.as_str())
                );
                assert_eq!(
                    g.rec.header("x-lerian-dlq-error-class"),
                    Some("validation_error")
                );
                assert_eq!(g.rec.header("x-lerian-dlq-cause-kind"), Some("codec"));
                assert_eq!(g.rec.header("x-lerian-dlq-retry-count"), Some("0"));
                assert_eq!(
                    g.rec.header("x-lerian-dlq-producer-id"),
                    Some(format!("{prefix}-group").as_str())
                );
                assert!(
                    !g.rec
                        .header("x-lerian-dlq-error-message")
                        .unwrap()
                        .is_empty()
                );
                assert!(g.rec.header("x-lerian-dlq-first-failure-at").is_some());
                let size = input.value.as_ref().map_or(0, Vec::len).to_string();
                assert_eq!(
                    g.rec.header("x-lerian-dlq-payload-bytes"),
                    Some(size.as_str())
                );
                if reason == "payload_too_large" {
                    assert_eq!(g.rec.header("x-lerian-dlq-payload-omitted"), Some("true"));
                    assert!(g.rec.value.is_none(), "an oversized payload is not copied");
                } else if headers_dropped {
                    assert_eq!(g.rec.header("x-lerian-dlq-payload-omitted"), Some("false"));
                    assert_eq!(g.rec.value, input.value, "the payload is kept");
                    assert!(g.rec.header("x-junk-0").is_none(), "the headers are not");
                    // Its identity is: the quarantine can be tied to its tenant and event.
                    for name in ["ce-id", "ce-tenantid", "ce-type", "ce-source"] {
                        assert_eq!(g.rec.header(name), input.header(name), "{name}");
                        assert!(input.header(name).is_some(), "{name}");
                    }
                } else if spoofed {
                    assert_eq!(g.rec.value, input.value);
                    let carried: Vec<_> = input
                        .headers
                        .iter()
                        .filter(|(k, _)| {
                            let k = k.to_ascii_lowercase();
                            !k.starts_with("x-streaming-hub-") && !k.starts_with("x-lerian-dlq-")
                        })
                        .cloned()
                        .collect();
                    assert_eq!(carried.len(), input.headers.len() - 2);
                    assert_eq!(&g.rec.headers[..carried.len()], &carried[..]);
                    let reasons = g.rec.headers.iter();
                    let reasons = reasons
                        .filter(|(k, _)| k == "x-streaming-hub-reason")
                        .count();
                    assert_eq!(reasons, 1, "only the hub's reason");
                    let classes = g
                        .rec
                        .headers
                        .iter()
                        .filter(|(k, _)| k.eq_ignore_ascii_case("x-lerian-dlq-error-class"));
                    assert_eq!(classes.count(), 1, "only the hub's forensic headers");
                } else {
                    assert_eq!(g.rec.header("x-lerian-dlq-payload-omitted"), Some("false"));
                    assert_eq!(g.rec.value, input.value);
                    assert_eq!(
                        &g.rec.headers[..input.headers.len()],
                        &input.headers[..],
                        "original headers kept"
                    );
                }
            }
        }
    }
    // The message names the header at fault.
    let at = cases
        .iter()
        .position(|(o, _)| *o == "missing_header")
        .unwrap() as i64;
    let missing = by_offset[&at]
        .rec
        .header("x-lerian-dlq-error-message")
        .unwrap();
    assert!(missing.contains("ce-source"), "{missing}");
}

/// rdkafka's `Headers::iter` panics on a header name that is not UTF-8; read through it, such a
/// record killed the ingest thread, and after every restart again, so nothing behind it got in.
#[tokio::test]
async fn a_header_name_that_is_not_utf8_is_quarantined_and_the_records_behind_it_get_in() {
    require_broker();
    let prefix = unique("ingraw");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let _hub = Hub::start(&hub_env(&prefix, &follow_exactly(&topic)));

    let bad = event("tenant-a", "ledger", "transaction", "created");
    produce_with_raw_header_name(&topic, &bad, b"x-\xff\xfe");
    let next = event("tenant-a", "ledger", "transaction", "created");
    produce(&producer(), &topic, std::slice::from_ref(&next));

    let inbox = format!("{prefix}.inbox");
    let quarantine = format!("{prefix}.quarantine");
    let got = read_until(&[&inbox, &quarantine], Duration::from_secs(60), |r| {
        r.len() >= 2
    });
    assert_eq!(got.len(), 2, "both records came out: {got:?}");
    let q = got
        .iter()
        .find(|g| g.topic == quarantine)
        .expect("the record with the bad name is quarantined");
    assert_eq!(
        q.rec.header("x-streaming-hub-reason"),
        Some("invalid_header_encoding")
    );
    assert_eq!(q.rec.header("x-lerian-dlq-source-offset"), Some("0"));
    let message = q.rec.header("x-lerian-dlq-error-message").unwrap();
    let at = format!("header #{}", bad.headers.len());
    assert!(
        message.contains(&at) && message.contains("not UTF-8"),
        "{message}"
    );
    assert_eq!(
        &q.rec.headers[..bad.headers.len()],
        &bad.headers[..],
        "its other headers kept, in order"
    );
    assert_eq!(q.rec.value, bad.value, "its payload kept");
    let a = got
        .iter()
        .find(|g| g.topic == inbox)
        .expect("the record behind it is accepted");
    assert_eq!(a.rec.header("ce-id"), next.header("ce-id"));
    assert_eq!(a.rec.header("x-streaming-hub-source-offset"), Some("1"));
}

#[tokio::test]
async fn a_large_record_quarantined_for_its_headers_leaves_payload_and_key_out_and_ingest_goes_on()
{
    require_broker();
    let prefix = unique("ingbig");
    let topic = format!("lerian.streaming.{prefix}");
    // The producer's topic takes records up to 4 MiB; the hub's quarantine topic up to 2 MiB.
    create_topic_configured(&admin(), &topic, 1, &[("max.message.bytes", "4194304")]).await;
    let _hub = Hub::start(&hub_env(&prefix, &follow_exactly(&topic)));

    // Headers are judged before the size: this one is quarantined as a duplicate header, and its
    // 2.5 MB payload copied as it is would not fit the quarantine topic (the transaction failed
    // again after every retry: ingest stopped for every topic); nor should a 20 kB key go along.
    let mut big = event("tenant-a", "ledger", "transaction", "created").add("ce-type", b"x");
    // Random bytes: the size limits apply to compressed batches, and a run of one byte shrinks.
    let mut payload = vec![0u8; 2_500_000];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut payload);
    big.value = Some(payload);
    big.key = Some(vec![b'k'; 20_000]);
    let next = event("tenant-a", "ledger", "transaction", "created");
    produce(&producer(), &topic, &[big, next.clone()]);

    let inbox = format!("{prefix}.inbox");
    let quarantine = format!("{prefix}.quarantine");
    let got = read_until(&[&inbox, &quarantine], Duration::from_secs(60), |r| {
        r.len() >= 2
    });
    assert_eq!(got.len(), 2, "both records came out: {got:?}");
    let q = got
        .iter()
        .find(|g| g.topic == quarantine)
        .expect("the large record is quarantined");
    assert_eq!(
        q.rec.header("x-streaming-hub-reason"),
        Some("duplicate_header")
    );
    assert_eq!(q.rec.header("x-lerian-dlq-payload-omitted"), Some("true"));
    assert_eq!(q.rec.header("x-lerian-dlq-payload-bytes"), Some("2500000"));
    assert_eq!(q.rec.header("x-lerian-dlq-key-omitted"), Some("true"));
    assert!(q.rec.value.as_deref().unwrap_or_default().is_empty());
    assert_eq!(q.rec.key, None);
    let a = got
        .iter()
        .find(|g| g.topic == inbox)
        .expect("the record behind it is accepted");
    assert_eq!(a.rec.header("ce-id"), next.header("ce-id"));
}

/// An inbox whose record limit is lowered under a running hub (an operator's change, a topic
/// made again by hand): the broker refuses every ingest batch holding a larger record, and ingest
/// aborts it. It pauses longer between runs and, having committed nothing for the stall
/// timeout, ends: the process exits 1 saying why, instead of aborting the same batch for good
/// with only its lag to show it.
#[tokio::test]
async fn ingest_aborting_every_batch_for_the_stall_timeout_ends_the_process() {
    require_broker();
    let prefix = unique("ingstuck");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let mut env = hub_env(&prefix, &follow_exactly(&topic));
    env.insert("STREAMING_HUB_STALL_TIMEOUT".into(), "36s".into());
    let mut hub = Hub::start(&env);

    let inbox = format!("{prefix}.inbox");
    let (code, log) = refused_writes_end_the_hub(&mut hub, &inbox, &topic, "tenant-a").await;
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("ingest committed nothing for the stall timeout"),
        "{log}"
    );
}

/// Starts a hub requiring signatures (keys `k1` for ledger and `k2` for tracer, both the
/// vector's secret; `extra` settings too), produces `cases` in order to one topic, and answers
/// each offset's outcome (`accept` or the quarantine reason), the hub and the key's base64.
async fn signed_outcomes(
    tag: &str,
    extra: &[(&str, &str)],
    cases: &[(&str, Rec)],
) -> (BTreeMap<i64, String>, BTreeMap<i64, String>, Hub, String) {
    require_broker();
    let prefix = unique(tag);
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let secret: Vec<u8> = (0u8..32).collect();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&secret);
    let mut env = hub_env(&prefix, &follow_exactly(&topic));
    env.insert("STREAMING_HUB_REQUIRE_SIGNATURES".into(), "true".into());
    env.insert(
        "STREAMING_HUB_SIGNATURE_KEYS".into(),
        format!("k1@ledger:{b64},k2@tracer:{b64}"),
    );
    for (k, v) in extra {
        env.insert(k.to_string(), v.to_string());
    }
    let hub = Hub::start(&env);
    let recs: Vec<Rec> = cases.iter().map(|(_, r)| r.clone()).collect();
    produce(&producer(), &topic, &recs);
    let inbox = format!("{prefix}.inbox");
    let quarantine = format!("{prefix}.quarantine");
    let got = read_until(&[&inbox, &quarantine], Duration::from_secs(60), |r| {
        r.len() >= cases.len()
    });
    let mut outcome_by_offset: BTreeMap<i64, String> = BTreeMap::new();
    for g in &got {
        if g.topic == inbox {
            outcome_by_offset.insert(
                g.rec
                    .header("x-streaming-hub-source-offset")
                    .unwrap()
                    .parse()
                    .unwrap(),
                "accept".into(),
            );
        } else {
            let off = g
                .rec
                .header("x-lerian-dlq-source-offset")
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(g.rec.header("x-lerian-dlq-cause-kind"), Some("signature"));
            outcome_by_offset.insert(
                off,
                g.rec.header("x-streaming-hub-reason").unwrap().to_string(),
            );
        }
    }
    let want: BTreeMap<i64, String> = cases
        .iter()
        .enumerate()
        .map(|(i, (o, _))| (i as i64, o.to_string()))
        .collect();
    (outcome_by_offset, want, hub, b64)
}

#[tokio::test]
async fn signed_vector_is_accepted_with_its_key_and_quarantined_otherwise() {
    let mut tampered = vector_record();
    tampered.value = Some(br#"{"amount":"99.00"}"#.to_vec());
    let cases = [
        ("accept", vector_record()),
        ("signature_invalid", tampered),
        (
            "signature_unknown_key",
            vector_record().set("ce-sigkid", Some(b"k9")),
        ),
        // k2 exists but is bound to another source: invalid, not unknown.
        (
            "signature_invalid",
            vector_record().set("ce-sigkid", Some(b"k2")),
        ),
        ("signature_missing", vector_record().set("ce-sig", None)),
        // An attribute added to a signed record: it would reach subscribers unsigned.
        (
            "signature_invalid",
            vector_record().set("ce-priority", Some(b"override")),
        ),
    ];
    let (got, want, hub, b64) = signed_outcomes("sig", &[], &cases).await;
    assert_eq!(got, want);
    // The signing secret never reaches the log.
    assert!(!hub.log_text().contains(&b64));
}

/// `STREAMING_HUB_SIGNATURE_MAX_AGE`: a validly signed record copied and produced again later
/// (the vector, signed in September) is quarantined as `signature_expired`; one signed now gets
/// in; one signed an hour ahead of the hub's clock, or without a time, does not.
#[tokio::test]
async fn a_signature_older_than_the_max_age_is_quarantined_as_expired() {
    let secret: Vec<u8> = (0u8..32).collect();
    // The vector signed again with `ce-sigts` = `at` (None: no time at all).
    let signed_at = |at: Option<chrono::DateTime<chrono::Utc>>| {
        let at = at.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true));
        let rec = vector_record()
            .set("ce-sig", None)
            .set("ce-sigts", at.as_deref().map(str::as_bytes));
        let h: Vec<(&str, Option<&[u8]>)> = rec
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        let sig =
            streaming_hub::ingest::signature::sign(&secret, &h, rec.value.as_deref().unwrap());
        rec.set("ce-sig", Some(sig.as_bytes()))
    };
    let now = chrono::Utc::now();
    let cases = [
        ("accept", signed_at(Some(now))),
        ("signature_expired", vector_record()),
        (
            "signature_expired",
            signed_at(Some(now + chrono::Duration::hours(1))),
        ),
        ("signature_expired", signed_at(None)),
        (
            "accept",
            signed_at(Some(now - chrono::Duration::minutes(50))),
        ),
    ];
    let extra = [("STREAMING_HUB_SIGNATURE_MAX_AGE", "1h")];
    let (got, want, _hub, _) = signed_outcomes("sigage", &extra, &cases).await;
    assert_eq!(got, want);
}

#[tokio::test]
async fn salted_tenant_meets_in_one_inbox_partition() {
    require_broker();
    let prefix = unique("salt");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 3).await;
    let _hub = Hub::start(&hub_env(&prefix, &follow_exactly(&topic)));
    let recs: Vec<Rec> = (0..30)
        .map(|i| {
            let mut r = event("hot-tenant", "ledger", "transaction", "posted");
            r.key = Some(format!("hot-tenant#{}", i % 3).into_bytes()); // the producer salts its key
            r.partition = Some(i % 3);
            r
        })
        .collect();
    produce(&producer(), &topic, &recs);
    let inbox = format!("{prefix}.inbox");
    let got = read_until(&[&inbox], Duration::from_secs(60), |r| r.len() >= 30);
    assert_eq!(got.len(), 30);
    let partitions: HashSet<i32> = got.iter().map(|g| g.partition).collect();
    assert_eq!(
        partitions.len(),
        1,
        "one tenant, one inbox partition: {partitions:?}"
    );
    let sources: HashSet<&str> = got
        .iter()
        .map(|g| g.rec.header("x-streaming-hub-source-partition").unwrap())
        .collect();
    assert_eq!(
        sources.len(),
        3,
        "the input really was spread over 3 partitions"
    );
    assert!(
        got.iter()
            .all(|g| g.rec.key.as_deref() == Some(b"hot-tenant".as_slice()))
    );
}

#[tokio::test]
async fn new_producer_topic_is_followed_without_restart_and_dlq_topics_never_are() {
    require_broker();
    let prefix = unique("follow");
    let first = format!("lerian.streaming.{prefix}a");
    create_topic(&first, 1).await;
    // The default follow pattern's shape, narrowed to this test's topics.
    let pattern = format!(r"^lerian\.streaming\.{prefix}[a-z0-9_-]*$");
    let _hub = Hub::start(&hub_env(&prefix, &pattern));
    let p = producer();
    produce(
        &p,
        &first,
        &[event("t1", "ledger", "transaction", "created")],
    );
    let inbox = format!("{prefix}.inbox");
    read_until(&[&inbox], Duration::from_secs(60), |r| r.len() == 1);

    // Created while the hub runs: followed within 30 s.
    let second = format!("lerian.streaming.{prefix}b");
    let dlq = format!("{second}.dlq");
    create_topic(&second, 1).await;
    create_topic(&dlq, 1).await;
    let late = event("t2", "ledger", "transaction", "created");
    produce(&p, &second, std::slice::from_ref(&late));
    produce(&p, &dlq, &[event("t3", "ledger", "transaction", "created")]);
    let started = std::time::Instant::now();
    let got = read_until(&[&inbox], Duration::from_secs(30), |r| {
        r.iter().any(|g| g.rec.id() == late.id())
    });
    eprintln!("new topic followed after {:?}", started.elapsed());
    assert!(
        got.iter()
            .all(|g| g.rec.header("x-streaming-hub-source-topic") != Some(dlq.as_str()))
    );
    // The dlq record is never read: once the hub has caught up on the second topic, nothing more.
    wait_until(Duration::from_secs(30), "ingest caught up", || {
        group_caught_up(&format!("{prefix}-group"), &second).then_some(())
    });
    let all = read_all(&[&inbox], Duration::from_secs(30));
    assert_eq!(all.len(), 2, "the .dlq topic must not be followed");
}

/// A follow pattern wider than the default that matches a producer's own dead-letter and
/// command topics (the configuration check only tries sample names): their records are dropped,
/// counted under their own reason, never ingested.
#[tokio::test]
async fn records_of_producers_own_topics_a_wide_pattern_matches_are_dropped() {
    require_broker();
    let prefix = unique("wide");
    let main = format!("lerian.streaming.{prefix}");
    let (dlq, commands) = (format!("{main}.dlq"), format!("{main}.commands"));
    for t in [&main, &dlq, &commands] {
        create_topic(t, 1).await;
    }
    let hub = Hub::start(&hub_env(
        &prefix,
        &format!(r"^lerian\.streaming\.{prefix}.*"),
    ));
    let p = producer();
    for t in [&main, &dlq, &commands] {
        produce(&p, t, &[event("t1", "ledger", "transaction", "created")]);
    }
    // Dead letters whose headers the quarantine would refuse: more than 256 of them (a dead
    // letter adds eleven to its event's), and a name that is not UTF-8.
    let mut crowded = event("t1", "ledger", "transaction", "created");
    for i in 0..260 {
        crowded = crowded.add(&format!("x-lerian-dlq-note-{i}"), b"x");
    }
    produce(&p, &dlq, &[crowded]);
    produce_with_raw_header_name(
        &dlq,
        &event("t1", "ledger", "transaction", "created"),
        b"\xff-name",
    );
    let http = hub_http();
    let dropped = |t: &str| {
        format!(
            "streaming_hub_ingest_records_total{{topic=\"{t}\",verdict=\"drop\",reason=\"producer_own_topic\""
        )
    };
    let text = hub.metrics_when(&http, &dropped(&dlq), 3).await;
    assert_eq!(metric_sum(&text, &dropped(&dlq)), 3, "{text}");
    hub.metrics_when(&http, &dropped(&commands), 1).await;
    let accepted =
        format!("streaming_hub_ingest_records_total{{topic=\"{main}\",verdict=\"accept\"");
    let text = hub.metrics_when(&http, &accepted, 1).await;
    assert_eq!(metric_sum(&text, &accepted), 1, "{text}");
    let inbox = format!("{prefix}.inbox");
    let all = read_all(&[&inbox], Duration::from_secs(30));
    assert_eq!(all.len(), 1, "only the producer topic's event is ingested");
    let quarantine = format!("{prefix}.quarantine");
    assert!(
        read_all(&[&quarantine], Duration::from_secs(5)).is_empty(),
        "nothing of a producer's own topics is quarantined"
    );
}

#[tokio::test]
async fn sigkill_mid_run_neither_loses_nor_duplicates_records() {
    require_broker();
    let prefix = unique("kill");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 3).await;
    const N: usize = 100_000;
    // One in ten malformed (quarantined), one in 50 a system event (dropped).
    let recs: Vec<Rec> = (0..N)
        .map(|i| {
            let mut r = event(
                &format!("tenant-{}", i % 17),
                "ledger",
                "transaction",
                "posted",
            );
            r.partition = Some((i % 3) as i32);
            if i % 10 == 3 {
                r = r.set("ce-time", Some(b"not-a-time"));
            } else if i % 50 == 7 {
                r = r.add("ce-systemevent", b"true").set("ce-tenantid", None);
            }
            r
        })
        .collect();
    let drops = (0..N).filter(|i| i % 10 != 3 && i % 50 == 7).count();
    produce(&producer(), &topic, &recs);

    let env = hub_env(&prefix, &follow_exactly(&topic));
    let inbox = format!("{prefix}.inbox");
    let quarantine = format!("{prefix}.quarantine");
    let mut hub = Hub::start(&env);
    read_until(&[&inbox], Duration::from_secs(120), |r| r.len() >= N / 5);
    hub.kill();
    drop(hub);
    let partial = read_all(&[&inbox, &quarantine], Duration::from_secs(60)).len();
    assert!(
        partial < N - drops,
        "the kill must land mid-run (had {partial})"
    );

    let mut hub = Hub::start(&env);
    wait_until(
        Duration::from_secs(240),
        "ingest caught up after restart",
        || group_caught_up(&format!("{prefix}-group"), &topic).then_some(()),
    );
    hub.terminate();
    let got = read_all(&[&inbox, &quarantine], Duration::from_secs(120));
    let mut seen: HashMap<(String, i64), usize> = HashMap::new();
    for g in &got {
        let part = g
            .rec
            .header("x-streaming-hub-source-partition")
            .or(g.rec.header("x-lerian-dlq-source-partition"))
            .unwrap();
        let off = g
            .rec
            .header("x-streaming-hub-source-offset")
            .or(g.rec.header("x-lerian-dlq-source-offset"))
            .unwrap();
        *seen
            .entry((part.to_string(), off.parse().unwrap()))
            .or_default() += 1;
    }
    let dup = seen.values().filter(|&&c| c > 1).count();
    assert_eq!(dup, 0, "input records written more than once");
    assert_eq!(
        got.len(),
        N - drops,
        "every non-dropped input record exactly once"
    );
    let q = got.iter().filter(|g| g.topic == quarantine).count();
    assert_eq!(q, N / 10);
}

/// A partition whose committed offset is held back by another producer's open transaction (a
/// killed instance's, until it is fenced or times out) starts at that committed offset once the
/// transaction ends, also when the assignment changes while the hub waits for it: nothing is
/// ingested twice and nothing is skipped. (librdkafka 2.12 can start such a partition at
/// `auto.offset.reset` when its own query is answered `UNSTABLE_OFFSET_COMMIT` after an
/// assignment change; the hub now reads the offsets itself, see `kafka::rebalance_at_committed`.
/// This test did not hit that race on the old code in three runs: it guards the new path.)
#[tokio::test]
async fn an_open_transaction_never_sends_the_next_owner_back_to_the_start() {
    use rdkafka::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::Producer;

    require_broker();
    let prefix = unique("unstable");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 2).await;
    let batch = |from: usize| -> Vec<Rec> {
        (from..from + 20)
            .map(|i| {
                let mut r = event("tenant-a", "ledger", "transaction", "posted");
                r.partition = Some((i % 2) as i32);
                r
            })
            .collect()
    };
    let p = producer();
    produce(&p, &topic, &batch(0));
    let env = hub_env(&prefix, &follow_exactly(&topic));
    let group = format!("{prefix}-group");
    let inbox = format!("{prefix}.inbox");
    let mut a = Hub::start(&env);
    wait_until(Duration::from_secs(60), "the first 20 ingested", || {
        group_caught_up(&group, &topic).then_some(())
    });
    a.terminate();

    // A zombie of the ingest group: it joins, sends offsets of both partitions into a
    // transaction, leaves the group and never ends the transaction until told to.
    let zombie = open_zombie_transaction(&topic, &group, &[0, 1], 5, &format!("{prefix}.zombie"));

    produce(&p, &topic, &batch(20));
    // The first instance in the group is assigned both partitions and waits for the
    // transaction; the second joins, which takes one partition away while it waits. Neither is
    // ready before the transaction ends (their assignments wait for it): not waited for.
    let mut a = Hub::spawn(&env);
    let mut b = Hub::spawn(&another_instance(&env, "2"));
    let members = || -> Option<usize> {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .ok()?;
        let groups = probe
            .fetch_group_list(Some(&group), Duration::from_secs(5))
            .ok()?;
        Some(groups.groups().first()?.members().len())
    };
    wait_until(
        Duration::from_secs(60),
        "both instances in the ingest group",
        || (members()? == 2).then_some(()),
    );
    // The transaction ends only once an instance met the assignment change while waiting: it
    // either served a revocation, or still waits for stable offsets (and serves it after).
    wait_until(
        Duration::from_secs(60),
        "an instance revoked a partition or waits for stable offsets",
        || {
            [&a, &b]
                .iter()
                .any(|h| {
                    let log = h.log_text();
                    log.contains(r#"stage="ingest" kind="revoke""#)
                        || log.lines().any(|l| {
                            l.contains("committed offsets not stable yet") && l.contains(&topic)
                        })
                })
                .then_some(())
        },
    );
    zombie.abort_transaction(Duration::from_secs(30)).unwrap();

    wait_until(Duration::from_secs(120), "all 40 ingested", || {
        group_caught_up(&group, &topic).then_some(())
    });
    a.wait_ready();
    b.wait_ready();
    a.terminate();
    b.terminate();
    let got = read_all(&[&inbox], Duration::from_secs(60));
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for g in &got {
        let at = (
            g.rec
                .header("x-streaming-hub-source-partition")
                .unwrap()
                .to_string(),
            g.rec
                .header("x-streaming-hub-source-offset")
                .unwrap()
                .to_string(),
        );
        *seen.entry(at).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "ingested more than once: {twice:?}");
    assert_eq!(seen.len(), 40, "every input record once");
}

/// An instance told to stop while its new partitions wait for another producer's open
/// transaction stops at once, cleanly, without starting them: the wait (up to 120 s) outlasted
/// `STREAMING_HUB_SHUTDOWN_TIMEOUT` before, and ended in a fatal error at its patience.
#[tokio::test]
async fn a_stop_while_offsets_wait_for_an_open_transaction_ends_the_wait() {
    use rdkafka::producer::Producer;

    require_broker();
    let prefix = unique("stopwait");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let env = hub_env(&prefix, &follow_exactly(&topic));
    let group = format!("{prefix}-group");
    // A zombie of the ingest group: offsets of the partition in a transaction it never ends
    // (its timeout is far past the hub's patience of 120 s).
    let zombie = open_zombie_transaction(&topic, &group, &[0], 0, &format!("{prefix}.zombie"));

    let mut hub = Hub::spawn(&env);
    let log = stopped_while_waiting(&mut hub, &topic);
    assert!(
        log.contains("shutting down: newly assigned partitions are not started"),
        "{log}"
    );
    // The transaction was open all along: the hub did not wait for it to end.
    zombie.commit_transaction(Duration::from_secs(30)).unwrap();
}

/// The same while the instance already holds another partition: the group then revokes the
/// one never started along with the one held as the instance leaves. librdkafka refused that
/// unassign (a partition it does not hold) and waited for another for good: the stop hung
/// until the watchdog ended the process (exit 70).
#[tokio::test]
async fn a_stop_while_a_new_partition_waits_leaves_the_partitions_held_cleanly() {
    use rdkafka::admin::{AdminOptions, NewPartitions};
    use rdkafka::producer::Producer;

    require_broker();
    let prefix = unique("stopheld");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let mut env = hub_env(&prefix, &follow_exactly(&topic));
    env.insert("STREAMING_HUB_FOLLOW_REFRESH_INTERVAL".into(), "1s".into());
    let group = format!("{prefix}-group");
    let mut hub = Hub::start(&env);
    // A second partition: a zombie of the group takes it, leaves an open transaction with its
    // offset, and leaves the group; the instance is given it and waits.
    admin()
        .create_partitions(&[NewPartitions::new(&topic, 2)], &AdminOptions::new())
        .await
        .unwrap()
        .into_iter()
        .for_each(|r| {
            r.unwrap();
        });
    // Whichever partition the group gives the zombie: the instance may have taken the new one
    // first, and the rebalance the zombie's join makes then moves either.
    let zombie = open_zombie_transaction(&topic, &group, &[], 0, &format!("{prefix}.zombie"));
    let log = stopped_while_waiting(&mut hub, &topic);
    assert!(!log.contains("unassign failed"), "{log}");
    zombie.commit_transaction(Duration::from_secs(30)).unwrap();
}

/// Waits until `hub` waits for stable offsets of `topic`, stops it, asserts it exited cleanly
/// (0, not the watchdog's 70) and returns its log.
fn stopped_while_waiting(hub: &mut Hub, topic: &str) -> String {
    wait_until(
        Duration::from_secs(60),
        "the hub waits for stable offsets",
        || {
            hub.log_text()
                .lines()
                .any(|l| l.contains("committed offsets not stable yet") && l.contains(topic))
                .then_some(())
        },
    );
    let status = hub.terminate();
    let log = hub.log_text();
    assert!(status.success(), "{status}:\n{log}");
    log
}

/// A zombie of the ingest group `group`: it joins, waits until it holds the topic's
/// `partitions` (none named: any it is given), sends offset `offset` of each into a
/// transaction (timing out after 10 minutes), leaves the group, and never ends the transaction
/// until the caller does with the producer returned.
fn open_zombie_transaction(
    topic: &str,
    group: &str,
    partitions: &[i32],
    offset: i64,
    transactional_id: &str,
) -> rdkafka::producer::BaseProducer {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::{BaseProducer, Producer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .create()
        .expect("zombie consumer");
    consumer.subscribe(&[topic]).unwrap();
    let partitions: Vec<i32> = wait_until(
        Duration::from_secs(60),
        "the zombie owns its partitions",
        || {
            consumer.poll(Duration::from_millis(100));
            let held: Vec<i32> = (consumer.assignment().ok()?.elements().iter())
                .filter(|e| e.topic() == topic)
                .map(|e| e.partition())
                .collect();
            let owned = match partitions {
                [] => !held.is_empty(),
                wanted => wanted.iter().all(|p| held.contains(p)),
            };
            owned.then(|| {
                if partitions.is_empty() {
                    held
                } else {
                    partitions.to_vec()
                }
            })
        },
    );
    let zombie: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", transactional_id)
        .set("transaction.timeout.ms", "600000")
        .create()
        .expect("zombie producer");
    zombie.init_transactions(Duration::from_secs(30)).unwrap();
    zombie.begin_transaction().unwrap();
    let mut offsets = TopicPartitionList::new();
    for &part in &partitions {
        offsets
            .add_partition_offset(topic, part, Offset::Offset(offset))
            .unwrap();
    }
    zombie
        .send_offsets_to_transaction(
            &offsets,
            &consumer.group_metadata().unwrap(),
            Duration::from_secs(30),
        )
        .unwrap();
    consumer.unsubscribe();
    drop(consumer); // leaves the group; the transaction stays open
    zombie
}

/// Sets one topic config (the others go back to the broker's defaults: a test topic's do not
/// matter here).
async fn set_topic_config(topic: &str, key: &str, value: &str) {
    use rdkafka::admin::{AdminOptions, AlterConfig, ResourceSpecifier};
    let r = admin()
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(topic)).set(key, value)],
            &AdminOptions::new(),
        )
        .await
        .expect("alter configs");
    for x in r {
        x.expect("topic config set");
    }
    // The broker applies it from the metadata log a moment later: a record produced before
    // then is still held to the old limit (the tally test once saw its batch commit unrefused).
    // Its DescribeConfigs answers from what it has applied.
    for _ in 0..300 {
        let described = admin()
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &AdminOptions::new())
            .await
            .expect("describe configs");
        let applied = described.iter().flatten().any(|r| {
            r.get(key)
                .is_some_and(|e| e.value.as_deref() == Some(value))
        });
        if applied {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{topic}: {key}={value} never applied");
}

/// A batch whose transaction aborts is read and routed again: its records are counted in
/// `streaming_hub_ingest_records_total` (and a quarantine logged) once, when a try commits. They
/// were counted at every try: a record the inbox refused three times counted four accepts.
#[tokio::test]
async fn an_aborted_batch_is_counted_once_when_it_commits() {
    require_broker();
    let prefix = unique("ingtally");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let mut env = hub_env(&prefix, &follow_exactly(&topic));
    env.insert("STREAMING_HUB_ROLE".into(), "ingest".into());
    let hub = Hub::start(&env);
    let inbox = format!("{prefix}.inbox");
    // The inbox now refuses what the record will be (random bytes: compression cannot shrink
    // them under the limit).
    set_topic_config(&inbox, "max.message.bytes", "20000").await;
    let mut rec = event("tenant-a", "ledger", "transaction", "created");
    let mut payload = vec![0u8; 50_000];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut payload);
    rec.value = Some(payload);
    let bad = event("tenant-a", "ledger", "transaction", "created").add("ce-type", b"x");
    produce(&producer(), &topic, &[rec.clone(), bad]);
    let http = hub_http();
    let accepted =
        format!("streaming_hub_ingest_records_total{{topic=\"{topic}\",verdict=\"accept\"");
    let quarantined =
        format!("streaming_hub_ingest_records_total{{topic=\"{topic}\",verdict=\"quarantine\"");
    let aborted = "streaming_hub_ingest_commits_total{outcome=\"aborted\"";
    let text = hub.metrics_when(&http, aborted, 3).await;
    assert!(metric_sum(&text, aborted) >= 3, "the batch aborted 3 times");
    assert_eq!(metric_sum(&text, &accepted), 0, "no try committed yet");
    assert_eq!(metric_sum(&text, &quarantined), 0);
    // The inbox takes it again: the next try commits, and each record counts once.
    set_topic_config(&inbox, "max.message.bytes", "2097152").await;
    let got = read_until(&[&inbox], Duration::from_secs(60), |r| !r.is_empty());
    assert_eq!(got[0].rec.header("ce-id"), rec.header("ce-id"));
    let committed = "streaming_hub_ingest_commits_total{outcome=\"committed\"";
    let text = hub.metrics_when(&http, committed, 1).await;
    assert_eq!(metric_sum(&text, &accepted), 1);
    assert_eq!(metric_sum(&text, &quarantined), 1);
    let warned = hub
        .log_text()
        .lines()
        .filter(|l| l.contains("record quarantined"))
        .count();
    assert_eq!(warned, 1, "one WARN for the quarantined record");
}

/// `STREAMING_HUB_REQUIRE_SOURCE_TOPIC`: a record written to `lerian.streaming.<x>` speaks for
/// source `x` only; one claiming another source is quarantined as `source_mismatch`, so per-topic
/// ACLs decide who may speak for a source.
#[tokio::test]
async fn a_record_claiming_another_topics_source_is_quarantined_when_required() {
    require_broker();
    let prefix = unique("srctopic");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    // A followed topic whose name carries no source: not checked, and said so.
    let plain = format!("{prefix}-plain");
    create_topic(&plain, 1).await;
    let follow = format!(
        "^({}|{})$",
        topic.replace('.', r"\."),
        plain.replace('.', r"\.")
    );
    let mut env = hub_env(&prefix, &follow);
    env.insert("STREAMING_HUB_REQUIRE_SOURCE_TOPIC".into(), "true".into());
    env.insert("STREAMING_HUB_ROLE".into(), "ingest".into());
    let hub = Hub::start(&env);
    let own = event("tenant-a", &prefix, "transaction", "created");
    let spoofed = event("tenant-a", "ledger", "transaction", "created");
    produce(&producer(), &topic, &[own.clone(), spoofed.clone()]);
    let unchecked = event("tenant-a", "ledger", "transaction", "created");
    produce(&producer(), &plain, std::slice::from_ref(&unchecked));
    let inbox = format!("{prefix}.inbox");
    let quarantine = format!("{prefix}.quarantine");
    let got = read_until(&[&inbox, &quarantine], Duration::from_secs(60), |r| {
        r.len() >= 3
    });
    let by_id: HashMap<String, (&str, Option<&str>)> = got
        .iter()
        .map(|g| {
            let reason = g.rec.header("x-streaming-hub-reason");
            (g.rec.id(), (g.topic.as_str(), reason))
        })
        .collect();
    assert_eq!(by_id[&own.id()], (inbox.as_str(), None));
    assert_eq!(
        by_id[&spoofed.id()],
        (quarantine.as_str(), Some("source_mismatch"))
    );
    assert_eq!(by_id[&unchecked.id()], (inbox.as_str(), None));
    let warned: Vec<String> = hub
        .log_text()
        .lines()
        .filter(|l| l.contains("REQUIRE_SOURCE_TOPIC") && l.contains("WARN"))
        .map(str::to_string)
        .collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains(&plain), "{}", warned[0]);
    assert!(!warned[0].contains(&topic), "{}", warned[0]);
    let q = got.iter().find(|g| g.topic == quarantine).unwrap();
    assert_eq!(
        q.rec.header("x-lerian-dlq-source-topic"),
        Some(topic.as_str())
    );
    // Who may speak for a source, as the signature reasons.
    assert_eq!(q.rec.header("x-lerian-dlq-cause-kind"), Some("signature"));
    let message = q
        .rec
        .header("x-lerian-dlq-error-message")
        .unwrap_or_default();
    assert!(message.contains(&topic), "{message}");
}
