//! The control topic against the real broker: a subscription written by a plain producer shows up
//! in the table and in matching, a tombstone removes it, a garbage record is skipped without
//! stopping the reader (its subscription marked unreadable until a readable record), and a write through `Subscriptions` is readable as soon as it returns — with
//! its signing secret encrypted in the topic's bytes.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use rdkafka::producer::Producer;
use streaming_hub::config::Config;
use streaming_hub::runtime::avro::{Codec, RecordKind};
use streaming_hub::runtime::records::SubscriptionRecord;
use streaming_hub::runtime::topology::Topology;
use streaming_hub::subscriptions::control::{self, Subscriptions};
use streaming_hub::subscriptions::secrets::{Kek, generate_signing_secret};
use streaming_hub::subscriptions::table::{EventRef, SharedTable};

fn record(id: &str, tenant: &str, types: &[&str], version: u64) -> SubscriptionRecord {
    let mut r = SubscriptionRecord::pull(id, tenant, types);
    r.origin = Some("ledger".into());
    r.version = version;
    r
}

fn matches(table: &SharedTable, tenant: &str) -> Vec<String> {
    table
        .read()
        .matches(&EventRef {
            tenant,
            source: "ledger",
            resource: "transaction",
            event: "created",
            schema_major: 1,
        })
        .iter()
        .map(|s| s.id.clone())
        .collect()
}

/// A fresh prefix with its topics applied: (prefix, config, codec, control topic).
async fn fresh_control(tag: &str) -> (String, Config, Arc<Codec>, String) {
    require_broker();
    let prefix = unique(tag);
    let config = Config::from_vars(hub_env(&prefix, "^unused$")).unwrap();
    Topology::load(&config.topology_file, &config)
        .unwrap()
        .apply(&config, false)
        .await
        .unwrap();
    let topic = control::topic(&config);
    (prefix, config, Arc::new(Codec::new().unwrap()), topic)
}

#[tokio::test]
async fn control_topic_drives_the_table_and_skips_garbage() {
    let (_, config, codec, topic) = fresh_control("ctl").await;

    // One subscription exists before the reader starts: read at start-up.
    let p = producer();
    let first = record(
        &uuid::Uuid::now_v7().to_string(),
        "t1",
        &["transaction.*"],
        1,
    );
    let bytes = codec.encode(RecordKind::Subscription, &first).unwrap();
    produce(
        &p,
        &topic,
        &[Rec {
            key: Some(first.id.clone().into_bytes()),
            value: Some(bytes),
            ..Default::default()
        }],
    );

    let table = SharedTable::default();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (config, codec, table, stop) =
            (config.clone(), codec.clone(), table.clone(), stop.clone());
        std::thread::spawn(move || control::follow(&config, codec, table, stop))
    };
    wait_until(Duration::from_secs(30), "table caught up", || {
        table.is_caught_up().then_some(())
    });
    assert_eq!(matches(&table, "t1"), std::slice::from_ref(&first.id));
    assert!(matches(&table, "t2").is_empty());

    // Garbage, then a valid record: the garbage is skipped and the reader goes on. So is a
    // record whose version has no successor (no later write of it could be encoded), one
    // whose id has a NUL (it would end the hub's job keys, whose separator it is), and one
    // larger than a control record may be (the hub could not write it back, as an
    // auto-disable does, under the topic's limit).
    let second = record(&uuid::Uuid::now_v7().to_string(), "t2", &["*"], 1);
    let types: Vec<String> = (0..2_000)
        .map(|i| format!("transaction.created{i:0>140}"))
        .collect();
    let types: Vec<&str> = types.iter().map(String::as_str).collect();
    let big = record(&uuid::Uuid::now_v7().to_string(), "t2", &types, 1);
    let big_bytes = codec.encode(RecordKind::Subscription, &big).unwrap();
    assert!(big_bytes.len() > control::MAX_RECORD_BYTES);
    assert!(big_bytes.len() < 2 * control::MAX_RECORD_BYTES);
    let nul = record("sub\0one", "t2", &["*"], 1);
    let frozen = record(
        &uuid::Uuid::now_v7().to_string(),
        "t2",
        &["*"],
        i64::MAX as u64,
    );
    produce(
        &p,
        &topic,
        &[
            Rec {
                key: Some(b"junk".to_vec()),
                value: Some(b"\xc3\x01not avro at all".to_vec()),
                ..Default::default()
            },
            // (A record without a key cannot exist here: the broker refuses it on a compacted topic.)
            Rec {
                key: Some(frozen.id.clone().into_bytes()),
                value: Some(codec.encode(RecordKind::Subscription, &frozen).unwrap()),
                ..Default::default()
            },
            Rec {
                key: Some(nul.id.clone().into_bytes()),
                value: Some(codec.encode(RecordKind::Subscription, &nul).unwrap()),
                ..Default::default()
            },
            Rec {
                key: Some(big.id.clone().into_bytes()),
                value: Some(big_bytes),
                ..Default::default()
            },
            Rec {
                key: Some(second.id.clone().into_bytes()),
                value: Some(codec.encode(RecordKind::Subscription, &second).unwrap()),
                ..Default::default()
            },
        ],
    );
    assert!(
        table
            .wait_for(Duration::from_secs(30), |t| t.get(&second.id).is_some())
            .await
    );
    assert_eq!(matches(&table, "t2"), std::slice::from_ref(&second.id));
    assert!(table.read().get("junk").is_none());
    assert!(
        table.read().get(&frozen.id).is_none(),
        "read in order: skipped"
    );
    assert!(
        table.read().get(&nul.id).is_none(),
        "an id with a NUL skipped"
    );
    assert!(table.read().get(&big.id).is_none(), "too large: skipped");
    for id in ["junk", frozen.id.as_str(), nul.id.as_str(), big.id.as_str()] {
        assert!(table.read().is_unreadable(id), "{id}");
    }
    assert!(!table.read().is_unreadable(&second.id));

    // A record that cannot be read, over a subscription the table holds, is its latest word: it
    // is marked (its deliveries are held) until a readable record for it; the version before it
    // stays, still matched (an old instance in a rolling upgrade keeps creating its jobs).
    let garbage = Rec {
        key: Some(second.id.clone().into_bytes()),
        value: Some(b"\xc3\x01\x01\x02\x03\x04\x05\x06\x07\x08a later schema".to_vec()),
        ..Default::default()
    };
    produce(&p, &topic, std::slice::from_ref(&garbage));
    assert!(
        table
            .wait_for(Duration::from_secs(30), |t| t.is_unreadable(&second.id))
            .await
    );
    assert_eq!(table.read().get(&second.id).unwrap().version, 1);
    assert_eq!(matches(&table, "t2"), std::slice::from_ref(&second.id));
    let mut again = second.clone();
    again.version = 2;
    let readable = Rec {
        key: Some(again.id.clone().into_bytes()),
        value: Some(codec.encode(RecordKind::Subscription, &again).unwrap()),
        ..Default::default()
    };
    produce(&p, &topic, std::slice::from_ref(&readable));
    assert!(
        table
            .wait_for(Duration::from_secs(30), |t| !t.is_unreadable(&second.id))
            .await
    );
    assert_eq!(table.read().get(&second.id).unwrap().version, 2);
    assert_eq!(matches(&table, "t2"), std::slice::from_ref(&second.id));

    // A tombstone removes it.
    let tombstone = Rec {
        key: Some(first.id.clone().into_bytes()),
        value: None,
        ..Default::default()
    };
    produce(&p, &topic, std::slice::from_ref(&tombstone));
    assert!(
        table
            .wait_for(Duration::from_secs(30), |t| t.get(&first.id).is_none())
            .await
    );
    assert!(matches(&table, "t1").is_empty());

    // Read-your-writes through the handle; the secret is sealed in the topic's bytes.
    let subs = Subscriptions::kafka(&config, codec.clone(), table.clone()).unwrap();
    let kek = Kek::new("k1", "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=").unwrap();
    let secret = generate_signing_secret();
    let mut third = record(
        &uuid::Uuid::now_v7().to_string(),
        "t3",
        &["transaction.created"],
        1,
    );
    third.signing_secrets = vec![kek.seal_secret(&secret, &third.id, None)];
    subs.put(third.clone()).await.unwrap();
    assert_eq!(
        subs.get(&third.id).unwrap().version,
        1,
        "visible as soon as put returns"
    );
    third.version = 2;
    third.enabled = false;
    subs.put(third.clone()).await.unwrap();
    assert!(matches(&table, "t3").is_empty(), "disabled at version 2");
    subs.delete(&third.id).await.unwrap();
    assert!(subs.get(&third.id).is_none());

    stop.store(true, Ordering::SeqCst);
    reader.join().unwrap().unwrap();
    let raw = read_all(&[&topic], Duration::from_secs(30));
    assert!(raw.len() >= 6);
    let plain = secret.expose().as_bytes();
    let b64 = &secret.expose()[6..];
    for g in raw {
        let v = g.rec.value.unwrap_or_default();
        assert!(
            !v.windows(plain.len()).any(|w| w == plain),
            "plaintext secret in the control topic"
        );
        assert!(
            !v.windows(b64.len()).any(|w| w == b64.as_bytes()),
            "secret key material in the control topic"
        );
    }
}

/// The control topic also carries transactions (the hub's auto-disable writes are transactional,
/// any producer may use them): the table counts as caught up only once the reader has passed
/// every committed record, with the log ending in a commit marker and an aborted transaction,
/// and the aborted record never shows. Nothing about it rests on a quiet spell of the topic.
#[tokio::test]
async fn the_table_catches_up_past_transaction_markers_with_every_committed_record() {
    let (prefix, config, codec, topic) = fresh_control("ctlx").await;
    let encoded = |r: &SubscriptionRecord| Rec {
        key: Some(r.id.clone().into_bytes()),
        value: Some(codec.encode(RecordKind::Subscription, r).unwrap()),
        ..Default::default()
    };

    // Plain writes, then a committed transaction, then an aborted one: the log ends in markers.
    let plain: Vec<SubscriptionRecord> = (0..3_000)
        .map(|i| record(&format!("{prefix}-p{i}"), "t1", &["*"], 1))
        .collect();
    let p = producer();
    produce(&p, &topic, &plain.iter().map(encoded).collect::<Vec<_>>());
    p.flush(Duration::from_secs(30)).unwrap();
    let tx: TestProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", unique("ctlx-tid"))
        .create_with_context(FailOnError::default())
        .unwrap();
    tx.init_transactions(Duration::from_secs(30)).unwrap();
    let committed = [
        record(&format!("{prefix}-c0"), "t2", &["*"], 1),
        record(&format!("{prefix}-c1"), "t2", &["*"], 1),
    ];
    tx.begin_transaction().unwrap();
    produce(
        &tx,
        &topic,
        &committed.iter().map(encoded).collect::<Vec<_>>(),
    );
    tx.commit_transaction(Duration::from_secs(30)).unwrap();
    let aborted = record(&format!("{prefix}-a0"), "t3", &["*"], 1);
    tx.begin_transaction().unwrap();
    produce(&tx, &topic, &[encoded(&aborted)]);
    tx.flush(Duration::from_secs(30)).unwrap();
    tx.abort_transaction(Duration::from_secs(30)).unwrap();

    let table = SharedTable::default();
    let stop = Arc::new(AtomicBool::new(false));
    // The table's size at the moment it reports caught up (the reader goes on after it).
    let at_catch_up = {
        let table = table.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while !table.is_caught_up() {
                assert!(std::time::Instant::now() < deadline, "never caught up");
                std::thread::sleep(Duration::from_millis(1));
            }
            table.read().len()
        })
    };
    let reader = {
        let (config, codec, table, stop) =
            (config.clone(), codec.clone(), table.clone(), stop.clone());
        std::thread::spawn(move || control::follow(&config, codec, table, stop))
    };
    let size = at_catch_up.join().expect("the table catches up");
    assert_eq!(
        size,
        plain.len() + committed.len(),
        "caught up with a partial table"
    );
    let t = table.read();
    assert!(
        plain
            .iter()
            .chain(&committed)
            .all(|r| t.get(&r.id).is_some())
    );
    assert!(
        t.get(&aborted.id).is_none(),
        "an aborted write is not a subscription"
    );
    drop(t);
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap().unwrap();
}

/// Every read of the API asks where the control topic ends ([`Subscriptions::sync`]). Two hundred
/// reads at once share a few lookups instead of making one each (one tenant reading in a loop
/// took every lookup place of the instance, and the other tenants' reads answered 503), and each
/// still sees a write acknowledged before it began, with the reader lagging behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_at_once_share_lookups_of_the_end_and_each_sees_what_was_written_before_it() {
    let (prefix, _, codec, topic) = fresh_control("ctlr").await;
    let mut vars = hub_env(&prefix, "^unused$");
    vars.insert(
        "STREAMING_HUB_DANGEROUS_TEST_CONTROL_LAG".into(),
        "300ms".into(),
    );
    let lagging = Config::from_vars(vars).unwrap();
    assert_eq!(control::topic(&lagging), topic);
    let table = SharedTable::default();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (config, codec, table, stop) =
            (lagging.clone(), codec.clone(), table.clone(), stop.clone());
        std::thread::spawn(move || control::follow(&config, codec, table, stop))
    };
    wait_until(Duration::from_secs(30), "table caught up", || {
        table.is_caught_up().then_some(())
    });
    let subs = Subscriptions::kafka(&lagging, codec.clone(), table.clone()).unwrap();
    let p = producer();
    for wave in 0..2 {
        // Acknowledged before the reads begin; the reader applies it 300 ms after it reads it.
        let written = record(&uuid::Uuid::now_v7().to_string(), "t1", &["*"], 1);
        produce(
            &p,
            &topic,
            &[Rec {
                key: Some(written.id.clone().into_bytes()),
                value: Some(codec.encode(RecordKind::Subscription, &written).unwrap()),
                ..Default::default()
            }],
        );
        p.flush(Duration::from_secs(30)).unwrap();
        assert!(subs.get(&written.id).is_none(), "the reader lags");
        let before = subs.end_lookups();
        let reads: Vec<_> = (0..200)
            .map(|_| {
                let (subs, id) = (subs.clone(), written.id.clone());
                tokio::spawn(async move {
                    subs.sync(Duration::from_secs(20)).await?;
                    Ok::<bool, control::SyncError>(subs.get(&id).is_some())
                })
            })
            .collect();
        for r in reads {
            assert!(
                r.await.unwrap().unwrap(),
                "wave {wave}: a read saw the table without the write acknowledged before it"
            );
        }
        let made = subs.end_lookups() - before;
        assert!(
            (1..=20).contains(&made),
            "wave {wave}: 200 reads made {made} lookups of the control topic's end"
        );
    }
    stop.store(true, Ordering::SeqCst);
    reader.join().unwrap().unwrap();
}
