//! The hub stage in-process against the real broker, with a manual clock and a recording handler:
//! duplicates at other offsets are dropped, a replay after an offset reset is processed again with
//! its first sequence number, a duplicate whose first copy expired is accepted, and a record of
//! an aborted transaction is never taken in.
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use streaming_hub::config::Config;
use streaming_hub::hub::task::{EventHandler, HubError, HubStage, SequencedEvent, TaskCtx};
use streaming_hub::runtime::avro::Codec;
use streaming_hub::runtime::clock::ManualClock;
use streaming_hub::runtime::topology::Topology;

/// (tenant, ce-id, sequence, offset, replay) of each event handed over.
type Seen = (String, String, u64, i64, bool);

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Seen>>>);

impl EventHandler for Recorder {
    fn on_event(
        &mut self,
        e: &SequencedEvent<'_>,
        _: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        self.0.lock().unwrap().push((
            e.tenant.to_string(),
            e.ce_id.to_string(),
            e.sequence,
            e.offset,
            e.replay,
        ));
        Ok(())
    }
}

impl Recorder {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn events(&self) -> Vec<Seen> {
        self.0.lock().unwrap().clone()
    }
}

/// An inbox record as ingest writes it.
fn inbox_record(tenant: &str, id: &str, ingest_time: &str) -> Rec {
    event(tenant, "ledger", "transaction", "created")
        .set("ce-id", Some(id.as_bytes()))
        .add("x-streaming-hub-ingest-time", ingest_time.as_bytes())
}

fn config(prefix: &str, state: &std::path::Path) -> Config {
    let vars = hub_env(prefix, "^unused$").into_iter().chain([
        (
            "STREAMING_HUB_STATE_DIR".to_string(),
            state.display().to_string(),
        ),
        (
            "STREAMING_HUB_IDEMPOTENCY_TTL".to_string(),
            "24h".to_string(),
        ),
        (
            "STREAMING_HUB_COMMIT_INTERVAL".to_string(),
            "20ms".to_string(),
        ),
    ]);
    Config::from_vars(vars).unwrap()
}

/// A run's config (its state in the returned directory), its topics created; and its inbox.
async fn topics(name: &str) -> (Config, tempfile::TempDir, String) {
    require_broker();
    let prefix = unique(name);
    let state = tempfile::tempdir().unwrap();
    let cfg = config(&prefix, state.path());
    Topology::load(&cfg.topology_file, &cfg)
        .unwrap()
        .apply(&cfg, false)
        .await
        .unwrap();
    (cfg, state, format!("{prefix}.inbox"))
}

fn clock_at(rfc3339: &str) -> ManualClock {
    let at = chrono::DateTime::parse_from_rfc3339(rfc3339).unwrap();
    ManualClock::new(at.timestamp_millis())
}

struct Running {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), HubError>>>,
}

fn start(config: &Config, clock: &ManualClock, rec: &Recorder) -> Running {
    let stop = Arc::new(AtomicBool::new(false));
    let mut stage = HubStage::new(
        config,
        Arc::new(Codec::new().unwrap()),
        Arc::new(clock.clone()),
        Box::new(rec.clone()),
    );
    let s = stop.clone();
    let thread = std::thread::spawn(move || stage.run(s));
    Running {
        stop,
        thread: Some(thread),
    }
}

impl Running {
    fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap().unwrap();
    }
}

fn reset_group_offsets(group: &str, topic: &str, partitions: i32) {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Offset(0))
            .unwrap();
    }
    // A stopped static member stays in the group until its session times out; the group accepts
    // an outside commit only once it is empty.
    wait_until(
        Duration::from_secs(30),
        "the group is empty and takes the reset",
        || c.commit(&tpl, rdkafka::consumer::CommitMode::Sync).ok(),
    );
}

#[tokio::test]
async fn duplicates_drop_replays_reprocess_and_expired_duplicates_are_new() {
    let (cfg, _state, inbox) = topics("dedup").await;
    let clock = clock_at("2026-09-26T12:00:00Z");
    let t0 = "2026-09-26T12:00:00.000Z";

    let id_a = uuid::Uuid::now_v7().to_string();
    let id_b = uuid::Uuid::now_v7().to_string();
    // a, b, a again (a duplicate, e.g. the producer retried), all one tenant: one partition.
    let recs = vec![
        inbox_record("t1", &id_a, t0),
        inbox_record("t1", &id_b, t0),
        inbox_record("t1", &id_a, t0),
    ];
    let p = producer();
    produce(&p, &inbox, &recs);

    let rec = Recorder::default();
    let hub = start(&cfg, &clock, &rec);
    wait_until(Duration::from_secs(60), "two events processed", || {
        (rec.len() >= 2).then_some(())
    });
    wait_until(Duration::from_secs(30), "hub caught up", || {
        group_caught_up(&cfg.hub_group_id(), &inbox).then_some(())
    });
    hub.stop();
    let first = rec.events();
    assert_eq!(
        first.len(),
        2,
        "the duplicate must not be processed: {first:?}"
    );
    assert_eq!(
        (first[0].1.as_str(), first[0].2, first[0].4),
        (id_a.as_str(), 0, false)
    );
    assert_eq!(
        (first[1].1.as_str(), first[1].2, first[1].4),
        (id_b.as_str(), 1, false)
    );

    // Replay: reset the hub group's offsets to the start; both events are processed again with
    // their first sequence numbers, and the duplicate is still dropped.
    reset_group_offsets(&cfg.hub_group_id(), &inbox, 6);
    let replayed = Recorder::default();
    let hub = start(&cfg, &clock, &replayed);
    wait_until(Duration::from_secs(60), "replayed events", || {
        (replayed.len() >= 2).then_some(())
    });
    wait_until(Duration::from_secs(30), "hub caught up", || {
        group_caught_up(&cfg.hub_group_id(), &inbox).then_some(())
    });
    let again = replayed.events();
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(again.iter().all(|e| e.4), "processed as replays");
    assert_eq!(
        again.iter().map(|e| (e.1.clone(), e.2)).collect::<Vec<_>>(),
        vec![(id_a.clone(), 0), (id_b.clone(), 1)]
    );

    // 23 hours later the id is still remembered; 25 hours later its entry has expired and a new
    // copy is a new event with the next sequence.
    clock.advance(Duration::from_secs(23 * 3600));
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id_a, "2026-09-27T11:00:00.000Z")],
    );
    wait_until(Duration::from_secs(30), "hub caught up", || {
        group_caught_up(&cfg.hub_group_id(), &inbox).then_some(())
    });
    assert_eq!(replayed.len(), 2, "a copy within the TTL is a duplicate");
    clock.advance(Duration::from_secs(2 * 3600));
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id_a, "2026-09-27T13:00:00.000Z")],
    );
    wait_until(
        Duration::from_secs(30),
        "expired duplicate accepted",
        || (replayed.len() >= 3).then_some(()),
    );
    hub.stop();
    let last = replayed.events().pop().unwrap();
    assert_eq!((last.1.as_str(), last.2, last.4), (id_a.as_str(), 2, false));
}

/// Expired entries are purged at least as fast as new ones are written: a batch purges as many
/// as it writes and 500 more. Before, 500 per batch: a partition whose batches wrote thousands of
/// new ids each (a hot tenant, a catch-up) kept entries past their time for good.
#[tokio::test]
async fn batches_purge_as_many_expired_entries_as_they_write() {
    const N: usize = 3000;
    let (cfg, state, inbox) = topics("dedup-purge").await;
    let clock = clock_at("2026-09-26T12:00:00Z");
    let p = producer();
    let mut total = 0;
    for (round, at) in [
        (0, "2026-09-26T12:00:00.000Z"),
        (1, "2026-09-27T13:00:00.000Z"),
    ] {
        if round == 1 {
            clock.advance(Duration::from_secs(25 * 3600)); // every first-round entry expired
        }
        // One tenant: one partition, its records all in the inbox before the hub reads them,
        // so they come in a few large batches.
        let recs: Vec<Rec> = (0..N)
            .map(|_| inbox_record("t1", &uuid::Uuid::now_v7().to_string(), at))
            .collect();
        produce(&p, &inbox, &recs);
        total += N;
        let rec = Recorder::default();
        let hub = start(&cfg, &clock, &rec);
        wait_until(Duration::from_secs(120), "the round's events", || {
            (rec.len() >= N).then_some(())
        });
        wait_until(Duration::from_secs(30), "hub caught up", || {
            group_caught_up(&cfg.hub_group_id(), &inbox).then_some(())
        });
        hub.stop();
    }
    // What the stores hold: the second round's entries only.
    let mut held = 0;
    for e in std::fs::read_dir(state.path().join(&cfg.topic_prefix)).unwrap() {
        let store = streaming_hub::runtime::store::Store::open(
            &e.unwrap().path(),
            &streaming_hub::hub::task::FAMILIES,
        )
        .unwrap();
        held += store
            .scan_from(streaming_hub::hub::dedup::DEDUP, &[], usize::MAX)
            .unwrap()
            .len();
    }
    assert_eq!(
        held, N,
        "dedup entries kept of {total} written, {N} of them expired"
    );
}

/// A hub that reads its inbox more than the TTL after ingest (down for a day, a lagging
/// `STREAMING_HUB_ROLE` split) still drops the copies: the TTL runs from when the hub first saw
/// the id, not from the ingest time the records carry.
#[tokio::test]
async fn copies_read_a_day_late_are_still_duplicates() {
    let (cfg, _state, inbox) = topics("dedup-late").await;
    // Ingested at 12:00 on the 26th, read by the hub 25 hours later.
    let clock = clock_at("2026-09-27T13:00:00Z");
    let t0 = "2026-09-26T12:00:00.000Z";
    let id = uuid::Uuid::now_v7().to_string();
    let p = producer();
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id, t0), inbox_record("t1", &id, t0)],
    );
    let rec = Recorder::default();
    let hub = start(&cfg, &clock, &rec);
    wait_until(Duration::from_secs(60), "hub caught up", || {
        (rec.len() >= 1 && group_caught_up(&cfg.hub_group_id(), &inbox)).then_some(())
    });
    // A third copy, ingested 23 hours after the hub first saw the id (47 after the first
    // copy's ingest): still inside the TTL, which runs from when the hub first saw the id.
    clock.advance(Duration::from_secs(23 * 3600));
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id, "2026-09-28T12:00:00.000Z")],
    );
    wait_until(Duration::from_secs(30), "hub caught up", || {
        group_caught_up(&cfg.hub_group_id(), &inbox).then_some(())
    });
    hub.stop();
    let seen = rec.events();
    assert_eq!(seen.len(), 1, "one event, two copies dropped: {seen:?}");
    assert_eq!((seen[0].1.as_str(), seen[0].2), (id.as_str(), 0));
}

/// A hub behind its inbox judges each copy at its ingest time: a producer's retry ingested
/// within the TTL of the first copy is dropped even when the hub reads it after the first
/// copy's entry would have expired by the clock, and the purge does not remove that entry while
/// records ingested before its expiry may still be ahead in the inbox.
#[tokio::test]
async fn a_lagging_hub_still_drops_a_copy_ingested_within_the_ttl() {
    let (cfg, _state, inbox) = topics("dedup-lag").await;
    let clock = clock_at("2026-09-26T12:00:00Z");
    let id = uuid::Uuid::now_v7().to_string();
    let p = producer();
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id, "2026-09-26T12:00:00.000Z")],
    );
    let rec = Recorder::default();
    let hub = start(&cfg, &clock, &rec);
    wait_until(Duration::from_secs(60), "the first copy", || {
        (rec.len() >= 1 && group_caught_up(&cfg.hub_group_id(), &inbox)).then_some(())
    });
    // The hub's clock is now past the entry's expiry (12:00 on the 27th), but it reads records
    // ingested before it: another event ingested ten minutes after the first copy (its batch
    // runs the purge)...
    clock.advance(Duration::from_secs(24 * 3600 + 5 * 60));
    produce(
        &p,
        &inbox,
        &[inbox_record(
            "t1",
            &uuid::Uuid::now_v7().to_string(),
            "2026-09-26T12:10:00.000Z",
        )],
    );
    wait_until(Duration::from_secs(30), "the other event", || {
        (rec.len() >= 2 && group_caught_up(&cfg.hub_group_id(), &inbox)).then_some(())
    });
    // ...then a copy ingested at 11:50 on the 27th, inside the TTL: dropped.
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id, "2026-09-27T11:50:00.000Z")],
    );
    wait_until(Duration::from_secs(30), "hub caught up", || {
        group_caught_up(&cfg.hub_group_id(), &inbox).then_some(())
    });
    assert_eq!(
        rec.len(),
        2,
        "the copy within the TTL was processed: {:?}",
        rec.events()
    );
    // A copy ingested after the expiry is a new event.
    produce(
        &p,
        &inbox,
        &[inbox_record("t1", &id, "2026-09-27T12:01:00.000Z")],
    );
    wait_until(Duration::from_secs(30), "the copy past the TTL", || {
        (rec.len() >= 3).then_some(())
    });
    hub.stop();
    let seen = rec.events();
    assert_eq!(
        seen.iter().map(|e| (e.1.clone(), e.2)).collect::<Vec<_>>()[2],
        (id.clone(), 2),
        "{seen:?}"
    );
}

/// The hub reads its inbox `read_committed`: a record of an aborted ingest transaction (a batch
/// that failed, a killed instance's open one after it is fenced) is never processed.
#[tokio::test]
async fn a_record_of_an_aborted_ingest_transaction_is_never_processed() {
    use rdkafka::producer::Producer;
    let (cfg, _state, inbox) = topics("dedup-committed").await;
    let clock = clock_at("2026-09-26T12:00:00Z");
    let t0 = "2026-09-26T12:00:00.000Z";
    let rec = Recorder::default();
    let hub = start(&cfg, &clock, &rec);

    let id_a = uuid::Uuid::now_v7().to_string();
    let id_b = uuid::Uuid::now_v7().to_string();
    let ingest = open_transaction_with(&inbox, inbox_record("t1", &id_a, t0));
    ingest.abort_transaction(Duration::from_secs(30)).unwrap();
    // After the aborted record, in the same partition.
    produce(&producer(), &inbox, &[inbox_record("t1", &id_b, t0)]);
    wait_until(Duration::from_secs(60), "the later event processed", || {
        (rec.len() >= 1 && group_caught_up(&cfg.hub_group_id(), &inbox)).then_some(())
    });
    hub.stop();
    let seen = rec.events();
    assert_eq!(
        seen.iter().map(|e| e.1.clone()).collect::<Vec<_>>(),
        vec![id_b],
        "only the committed event: {seen:?}"
    );
}

/// An inbox record ingest did not write (no key; no `ce-id`) is quarantined by the hub in its
/// transaction, reason `inbox_record_invalid`, naming its inbox place, payload kept; the records
/// around it are taken in. It was dropped with a counter only.
#[tokio::test]
async fn an_inbox_record_ingest_did_not_write_is_quarantined_not_dropped() {
    let (cfg, _state, inbox) = topics("dedup-invalid").await;
    let quarantine = format!("{}.quarantine", cfg.topic_prefix);
    let clock = clock_at("2026-09-26T12:00:00Z");
    let t0 = "2026-09-26T12:00:00.000Z";
    let rec = Recorder::default();
    let id = || uuid::Uuid::now_v7().to_string();
    let (id_a, id_b) = (id(), id());
    let at_0 = |r: Rec| Rec {
        partition: Some(0),
        ..r
    };
    let no_key = Rec {
        key: None,
        ..inbox_record("t1", &id(), t0)
    };
    let no_id = inbox_record("t1", &id(), t0).set("ce-id", None);
    // Past ingest's bounds: the hub's records of them would be larger than their topics take.
    let long_id = inbox_record("t1", &"i".repeat(257), t0);
    let large = Rec {
        value: Some(vec![b'x'; 1_572_865]),
        ..inbox_record("t1", &id(), t0)
    };
    let records = [
        inbox_record("t1", &id_a, t0),
        no_key.clone(),
        no_id.clone(),
        long_id.clone(),
        large.clone(),
        inbox_record("t1", &id_b, t0),
    ]
    .map(at_0);
    // One at a time: a request retried (a machine under load) may land after the next one.
    let p = producer();
    for r in &records {
        produce(&p, &inbox, std::slice::from_ref(r));
    }
    let hub = start(&cfg, &clock, &rec);
    let got = read_until(&[&quarantine], Duration::from_secs(60), |got| {
        got.len() >= 4
    });
    wait_until(Duration::from_secs(60), "the events around them", || {
        (rec.len() >= 2).then_some(())
    });
    hub.stop();
    let seen: Vec<String> = rec.events().into_iter().map(|e| e.1).collect();
    assert_eq!(seen, vec![id_a, id_b], "{:?}", rec.events());
    assert_eq!(got.len(), 4, "{got:?}");
    for (offset, original, why) in [
        (1, &no_key, "no key"),
        (2, &no_id, "ce-id"),
        (3, &long_id, "ce-id is over 256 bytes"),
        (4, &large, "payload is larger"),
    ] {
        // The quarantine has several partitions: found by the place each names.
        let q = got
            .iter()
            .find(|q| q.rec.header("x-lerian-dlq-source-offset") == Some(&offset.to_string()))
            .unwrap_or_else(|| panic!("offset {offset} not quarantined: {got:?}"));
        let h = |name: &str| q.rec.header(name).unwrap_or_default().to_string();
        assert_eq!(h("x-streaming-hub-reason"), "inbox_record_invalid");
        assert_eq!(h("x-lerian-dlq-source-topic"), inbox);
        assert_eq!(h("x-lerian-dlq-source-partition"), "0");
        assert_eq!(h("x-lerian-dlq-producer-id"), cfg.hub_group_id());
        assert!(h("x-lerian-dlq-error-message").contains(why), "{q:?}");
        // Over STREAMING_HUB_MAX_PAYLOAD_BYTES: left out, as ingest leaves it out.
        let omitted = original.value.as_ref().is_some_and(|v| v.len() > 1 << 20);
        assert_eq!(h("x-lerian-dlq-payload-omitted"), omitted.to_string());
        if !omitted {
            assert_eq!(q.rec.value, original.value);
        }
        assert_eq!(q.rec.key, original.key);
        assert_eq!(q.rec.header("ce-type"), original.header("ce-type"));
    }
}
