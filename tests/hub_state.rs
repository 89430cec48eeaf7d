//! The hub's exactly-once state through the real binary: two instances scaling out and back,
//! repeated SIGKILLs, and a restore from an empty state directory. After each run the committed
//! state must hold every unique event once, per-tenant sequences must be contiguous (no gap, no
//! repeat), and every store on disk must equal its changelog up to the offset it records.
mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use streaming_hub::dispatch::jobs::JOBS;
use streaming_hub::hub::dedup::DEDUP;
use streaming_hub::runtime::avro::{Codec, RecordKind};
use streaming_hub::runtime::orphans::{GroupView, describe};
use streaming_hub::runtime::records::{DedupEntry, SequenceRecord};
use streaming_hub::runtime::store::{Staged, Store};

/// Latest value and offset per (partition, key) of a changelog.
type ChangelogState = BTreeMap<(i32, Vec<u8>), (Option<Vec<u8>>, i64)>;

struct Run {
    prefix: String,
    topic: String,
    /// Unique events produced: (tenant, ce-id).
    unique: BTreeSet<(String, String)>,
}

impl Run {
    async fn new(tag: &str) -> Run {
        require_broker();
        let prefix = unique(tag);
        let topic = format!("lerian.streaming.{prefix}");
        create_topic(&topic, 3).await;
        Run {
            prefix,
            topic,
            unique: BTreeSet::new(),
        }
    }

    fn env(&self, instance: u32, state: &Path) -> BTreeMap<String, String> {
        let mut env = hub_env(
            &self.prefix,
            &format!("^{}$", self.topic.replace('.', r"\.")),
        );
        env.insert(
            "STREAMING_HUB_INSTANCE_ID".into(),
            format!("{}-{instance}", self.prefix),
        );
        env.insert(
            "STREAMING_HUB_STATE_DIR".into(),
            state.display().to_string(),
        );
        env
    }

    /// Produces `n` events over 37 tenants, and re-sends `dups` of them (same ce-id).
    fn produce(&mut self, n: usize, dups: usize) {
        let mut recs: Vec<Rec> = (0..n)
            .map(|i| {
                let tenant = format!("tenant-{}", i % 37);
                let mut r = event(&tenant, "ledger", "transaction", "posted");
                r.partition = Some((i % 3) as i32);
                self.unique.insert((tenant, r.id()));
                r
            })
            .collect();
        let copies: Vec<Rec> = recs
            .iter()
            .step_by((n / dups.max(1)).max(1))
            .take(dups)
            .cloned()
            .collect();
        recs.extend(copies);
        produce(&producer(), &self.topic, &recs);
    }

    fn inbox(&self) -> String {
        format!("{}.inbox", self.prefix)
    }

    fn caught_up(&self) -> bool {
        // The inbox to the end ingest wrote: its last transaction's offsets may show before its
        // records do.
        group_caught_up(&format!("{}-group", self.prefix), &self.topic)
            && group_caught_up_with_all_written(
                &format!("{}-group.hub", self.prefix),
                &self.inbox(),
            )
    }

    fn wait_caught_up(&self, timeout: Duration) {
        wait_until(timeout, "ingest and hub caught up", || {
            self.caught_up().then_some(())
        });
    }

    /// The dedup store's records on the state changelog (the jobs changelog, keys `d/` + the
    /// store key), read committed: latest value per (partition, store key) with its offset.
    fn changelog(&self) -> ChangelogState {
        let topic = format!("{}.hub.jobs.changelog", self.prefix);
        let mut state = BTreeMap::new();
        for g in read_all(&[&topic], Duration::from_secs(120)) {
            let key = g.rec.key.clone().unwrap();
            let Some(key) = key.strip_prefix(b"d/") else {
                continue;
            };
            state.insert((g.partition, key.to_vec()), (g.rec.value.clone(), g.offset));
        }
        state
    }

    /// Where events missing from the committed state are: on the source topic and the inbox
    /// (partition, offset), against what the ingest and hub groups committed.
    fn where_are(&self, missing: &[&(String, String)]) -> String {
        let mut out = String::new();
        for (topic, group) in [
            (self.topic.clone(), format!("{}-group", self.prefix)),
            (self.inbox(), format!("{}-group.hub", self.prefix)),
        ] {
            let found = read_all(&[&topic], Duration::from_secs(60));
            let committed = committed_offsets(&group, &topic);
            out += &format!(
                "{topic}: {} records, {group} committed {committed:?}\n",
                found.len()
            );
            for (tenant, id) in missing {
                let at: Vec<(i32, i64)> = found
                    .iter()
                    .filter(|g| g.rec.id() == *id)
                    .map(|g| (g.partition, g.offset))
                    .collect();
                out += &format!("  {tenant} {id}: at {at:?}\n");
            }
        }
        out
    }

    /// Checks the committed state: each unique event once, contiguous sequences per tenant.
    fn check_committed_state(&self) -> ChangelogState {
        let codec = Codec::new().unwrap();
        let state = self.changelog();
        let mut ids = BTreeSet::new();
        let mut seqs: HashMap<String, Vec<u64>> = HashMap::new();
        let mut tenant_partition: HashMap<String, i32> = HashMap::new();
        for ((p, _), (v, _)) in &state {
            let e: DedupEntry = codec
                .decode(
                    RecordKind::DedupEntry,
                    v.as_ref().expect("no expiry in this test"),
                )
                .unwrap();
            assert_eq!(
                *tenant_partition.entry(e.tenant_id.clone()).or_insert(*p),
                *p,
                "a tenant lives in one partition"
            );
            ids.insert((e.tenant_id.clone(), e.ce_id.clone()));
            seqs.entry(e.tenant_id).or_default().push(e.sequence);
        }
        if ids != self.unique {
            let missing: Vec<&(String, String)> = self.unique.difference(&ids).collect();
            let extra: Vec<&(String, String)> = ids.difference(&self.unique).collect();
            panic!(
                "every unique event exactly once in the committed state: {} of {} there, \
                 {} missing, {} not produced\n{}",
                ids.len(),
                self.unique.len(),
                missing.len(),
                extra.len(),
                self.where_are(&missing)
            );
        }
        for (tenant, mut s) in seqs {
            s.sort_unstable();
            let want: Vec<u64> = (0..s.len() as u64).collect();
            assert_eq!(
                s, want,
                "sequence of {tenant} must be contiguous from 0 without repeats"
            );
        }
        state
    }
}

/// `group`'s committed offsets on `topic`, by partition (what the broker answers, else why not).
fn committed_offsets(group: &str, topic: &str) -> Result<Vec<(i32, Offset)>, String> {
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| e.to_string())?;
    let md = probe
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    let mut tpl = TopicPartitionList::new();
    for p in md.topics()[0].partitions() {
        tpl.add_partition(topic, p.id());
    }
    let committed = probe
        .committed_offsets(tpl, Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    Ok(committed
        .elements()
        .iter()
        .map(|e| (e.partition(), e.offset()))
        .collect())
}

/// Every store directory under `state` equals the changelog up to the offset it records.
fn check_stores_match_changelog(
    state_dirs: &[&Path],
    prefix: &str,
    changelog: &ChangelogState,
) -> usize {
    let topic_dir = |d: &Path| d.join(prefix);
    let mut checked = 0;
    for dir in state_dirs {
        let Ok(entries) = std::fs::read_dir(topic_dir(dir)) else {
            continue;
        };
        for e in entries {
            let path: PathBuf = e.unwrap().path();
            let p: i32 = path
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .trim_start_matches("hub-")
                .parse()
                .unwrap();
            let store = Store::open(&path, &streaming_hub::hub::task::FAMILIES).unwrap();
            let Some(upto) = store.changelog_offset(JOBS).unwrap() else {
                continue;
            };
            // The changelog's state of partition p as of `upto`, compared key by key.
            for ((cp, key), (value, offset)) in changelog {
                if *cp != p {
                    continue;
                }
                let have = store.get(DEDUP, key).unwrap();
                if *offset <= upto {
                    assert_eq!(
                        &have,
                        value,
                        "store {} differs from its changelog",
                        path.display()
                    );
                }
            }
            let in_store = store.scan_from(DEDUP, &[], usize::MAX).unwrap();
            for (k, _) in in_store {
                // Every key the store holds was written to the changelog (a stale store may
                // hold an older value of it; the loop above checks values up to `upto`).
                assert!(
                    changelog.contains_key(&(p, k.clone())),
                    "a store key that is not in the changelog"
                );
            }
            checked += 1;
        }
    }
    checked
}

#[tokio::test]
async fn two_instances_scale_out_and_back_with_exactly_once_state() {
    let mut run = Run::new("scale").await;
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut a = Hub::start(&run.env(1, a_dir.path()));
    let mut b = Hub::start(&run.env(2, b_dir.path()));
    run.produce(4000, 200);
    read_until(&[&run.inbox()], Duration::from_secs(120), |r| {
        r.len() >= 1000
    });
    b.terminate(); // B leaves; after its session times out, A takes its partitions
    run.produce(4000, 200);
    let mut b = Hub::start(&run.env(2, b_dir.path()));
    run.produce(4000, 200);
    run.wait_caught_up(Duration::from_secs(180));
    a.terminate();
    b.terminate();
    let changelog = run.check_committed_state();
    let checked_a = check_stores_match_changelog(&[a_dir.path()], &run.prefix, &changelog);
    let checked_b = check_stores_match_changelog(&[b_dir.path()], &run.prefix, &changelog);
    // Every partition's store is checked in one directory or the other. (Not each instance's:
    // B's stores may hold nothing the changelog has an offset for, as one CI run showed.)
    assert!(
        checked_a + checked_b >= 6,
        "the instances' stores checked (A {checked_a}, B {checked_b})"
    );
}

/// A second instance answers ready only once it has its share of the partitions: a rolling
/// update that stops the old instance when the new one is ready must not take the partitions
/// of both out of service at once. At the first 200, each of its groups is stable, every
/// partition has an owner, and its hub loop holds some of the inbox.
#[tokio::test]
async fn a_new_instance_is_ready_only_once_its_groups_have_handed_it_its_share() {
    let run = Run::new("joinready").await;
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut a = Hub::start(&run.env(1, a_dir.path()));
    let mut b = Hub::spawn(&run.env(2, b_dir.path()));
    wait_until(Duration::from_secs(90), "B's /readyz", || {
        if b.status_of("/readyz")? == 200 {
            return Some(());
        }
        std::thread::sleep(Duration::from_millis(20));
        None
    });
    let inbox = run.inbox();
    for (group, topic, partitions, loop_name) in [
        (
            format!("{}-group.hub", run.prefix),
            inbox.as_str(),
            6,
            "hub",
        ),
        (
            format!("{}-group", run.prefix),
            run.topic.as_str(),
            3,
            "ingest",
        ),
    ] {
        // Member ids start with the group instance id, `<loop>-<instance>`.
        let b_member = format!("{loop_name}-{}-2-", run.prefix);
        let view = describe_group(&group).unwrap_or_else(|| {
            panic!("{group} could not be described when B was ready (a rebalance under way?)")
        });
        let expected: BTreeSet<(String, i32)> =
            (0..partitions).map(|p| (topic.to_string(), p)).collect();
        assert_eq!(view.state, "Stable", "{group} when B was ready: {view:?}");
        assert!(
            view.orphans(&expected).is_empty(),
            "{group} had partitions held by nobody when B was ready: {view:?}"
        );
        let held: Vec<&(String, i32)> = view
            .members
            .iter()
            .filter(|(id, _)| id.starts_with(&b_member))
            .flat_map(|(_, p)| p)
            .collect();
        assert!(
            view.members.iter().any(|(id, _)| id.starts_with(&b_member)),
            "B is not a member of {group} when ready: {view:?}"
        );
        // 6 inbox and 3 source partitions over two members: B's share is never empty.
        assert!(
            !held.is_empty(),
            "B held no partition of {topic} when ready: {view:?}"
        );
    }
    b.terminate();
    a.terminate();
}

fn hub_committed_total(prefix: &str) -> i64 {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", format!("{prefix}-group.hub"))
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..6 {
        tpl.add_partition(&format!("{prefix}.inbox"), p);
    }
    c.committed_offsets(tpl, Duration::from_secs(10))
        .map(|t| {
            t.elements()
                .iter()
                .map(|e| match e.offset() {
                    Offset::Offset(o) => o,
                    _ => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn sigkill_three_times_during_100k_events_keeps_state_exactly_once() {
    let mut run = Run::new("hkill").await;
    let state = tempfile::tempdir().unwrap();
    run.produce(100_000, 2_000);
    let env = run.env(1, state.path());
    let mut hub = Hub::start(&env);
    let mut gaps = Vec::new();
    for threshold in [15_000i64, 40_000, 70_000] {
        wait_until(Duration::from_secs(300), "hub progress", || {
            (hub_committed_total(&run.prefix) >= threshold).then_some(())
        });
        hub.kill();
        // Its stores were restored from their own offsets: a SIGKILL loses nothing the
        // changelog has, so none is ahead of it.
        assert!(
            !hub.log_text()
                .contains("local state is ahead of its changelog"),
            "a store discarded after a SIGKILL"
        );
        let before = hub_committed_total(&run.prefix);
        let started = Instant::now();
        hub = Hub::start(&env);
        wait_until(Duration::from_secs(120), "processing resumed", || {
            (hub_committed_total(&run.prefix) > before).then_some(())
        });
        gaps.push(started.elapsed());
    }
    run.wait_caught_up(Duration::from_secs(300));
    hub.terminate();
    assert!(
        !hub.log_text()
            .contains("local state is ahead of its changelog"),
        "a store discarded after a SIGKILL"
    );
    eprintln!("restart-to-processing gaps after SIGKILL: {gaps:?}");
    let changelog = run.check_committed_state();
    assert!(check_stores_match_changelog(&[state.path()], &run.prefix, &changelog) >= 6);
}

#[tokio::test]
async fn restore_from_an_empty_state_dir_rebuilds_stores_from_changelogs() {
    let mut run = Run::new("restore").await;
    let state = tempfile::tempdir().unwrap();
    let env = run.env(1, state.path());
    let mut hub = Hub::start(&env);
    run.produce(3000, 0);
    run.wait_caught_up(Duration::from_secs(120));
    hub.terminate();
    let before = run.check_committed_state();

    std::fs::remove_dir_all(state.path().join(&run.prefix)).unwrap();
    let mut hub = Hub::start(&env);
    // Copies of already-seen events must still be dropped, new events continue each sequence.
    let copies: Vec<Rec> = {
        let mut r = event("tenant-0", "ledger", "transaction", "posted");
        let (t, id) = run.unique.iter().next().unwrap().clone();
        r = r
            .set("ce-id", Some(id.as_bytes()))
            .set("ce-tenantid", Some(t.as_bytes()));
        r.key = Some(t.into_bytes());
        vec![r]
    };
    produce(&producer(), &run.topic, &copies);
    run.produce(500, 0);
    run.wait_caught_up(Duration::from_secs(120));
    hub.terminate();
    let after = run.check_committed_state();
    assert!(after.len() > before.len());
    assert!(check_stores_match_changelog(&[state.path()], &run.prefix, &after) >= 6);
    // The restart really restored: the stores came back from the changelogs, not from nothing.
    let restored: u64 = hub
        .log_text()
        .lines()
        .filter(|l| l.contains("stores restored"))
        .filter_map(|l| {
            l.split("records=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    assert!(
        restored as usize >= before.len(),
        "restored {restored} records, changelog had {}",
        before.len()
    );
}

/// Stores written by an earlier version, with a changelog per store, are still restored: the old
/// dedup and sequence changelogs first, then the state changelog (the jobs changelog, which now
/// carries all three stores), whose records are the newer ones. An earlier version saw event
/// of `tenant-legacy` and gave out its sequence numbers up to 40: a copy of that event
/// is a duplicate, and the tenant's next events get 41, then (after a second restore from
/// nothing) 42. Had the old sequence changelog been read after the state changelog, the second
/// restore would have handed out 41 again.
#[tokio::test]
async fn restore_reads_an_earlier_versions_changelogs_before_the_state_changelog() {
    let run = Run::new("legacy").await;
    let state = tempfile::tempdir().unwrap();
    let env = run.env(1, state.path());
    // The first start creates the topics; nothing is written for tenant-legacy.
    let mut hub = Hub::start(&env);
    hub.terminate();
    let _ = std::fs::remove_dir_all(state.path().join(&run.prefix));

    let tenant = "tenant-legacy";
    let [legacy_id, new_1, new_2] = [(); 3].map(|_| uuid::Uuid::now_v7().hyphenated().to_string());
    let codec = Codec::new().unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    // What the earlier version left, in every partition (whichever the tenant's is).
    let mut legacy_dedup = Vec::new();
    let mut legacy_sequence = Vec::new();
    for p in 0..6 {
        let entry = DedupEntry {
            tenant_id: tenant.into(),
            ce_id: legacy_id.clone(),
            inbox_partition: p,
            first_offset: 1_000_000,
            sequence: 40,
            expires_at: now_ms + 86_400_000,
        };
        legacy_dedup.push(Rec {
            key: Some(streaming_hub::hub::dedup::dedup_key(tenant, &legacy_id)),
            value: Some(codec.encode(RecordKind::DedupEntry, &entry).unwrap()),
            partition: Some(p),
            ..Default::default()
        });
        let seq = SequenceRecord {
            tenant_id: tenant.into(),
            next_sequence: 41,
        };
        legacy_sequence.push(Rec {
            key: Some(tenant.as_bytes().to_vec()),
            value: Some(codec.encode(RecordKind::Sequence, &seq).unwrap()),
            partition: Some(p),
            ..Default::default()
        });
    }
    let p = producer();
    produce(
        &p,
        &format!("{}.hub.dedup.changelog", run.prefix),
        &legacy_dedup,
    );
    produce(
        &p,
        &format!("{}.hub.sequence.changelog", run.prefix),
        &legacy_sequence,
    );

    let with_id = |id: &str| {
        let mut r = event(tenant, "ledger", "transaction", "posted");
        r = r.set("ce-id", Some(id.as_bytes()));
        r.key = Some(tenant.as_bytes().to_vec());
        r
    };
    let mut hub = Hub::start(&env);
    produce(&p, &run.topic, &[with_id(&legacy_id), with_id(&new_1)]);
    run.wait_caught_up(Duration::from_secs(120));
    let http = hub_http();
    // Counted as its transaction commits, a moment after the offsets are seen.
    let duplicates = r#"streaming_hub_hub_events_total{outcome="duplicate""#;
    let metrics = hub.metrics_when(&http, duplicates, 1).await;
    assert_eq!(
        metric_sum(&metrics, duplicates),
        1,
        "the copy was judged a duplicate:\n{metrics}"
    );
    hub.terminate();

    std::fs::remove_dir_all(state.path().join(&run.prefix)).unwrap();
    let mut hub = Hub::start(&env);
    produce(&p, &run.topic, &[with_id(&new_2)]);
    run.wait_caught_up(Duration::from_secs(120));
    hub.terminate();

    let sequence_of = |id: &str| -> Option<u64> {
        let key = streaming_hub::hub::dedup::dedup_key(tenant, id);
        run.changelog()
            .into_iter()
            .find(|((_, k), _)| *k == key)
            .map(|(_, (v, _))| {
                codec
                    .decode::<DedupEntry>(RecordKind::DedupEntry, &v.unwrap())
                    .unwrap()
                    .sequence
            })
    };
    assert_eq!(
        sequence_of(&legacy_id),
        None,
        "the copy of an event the earlier version saw wrote no dedup entry"
    );
    assert_eq!(sequence_of(&new_1), Some(41));
    assert_eq!(sequence_of(&new_2), Some(42));
}

/// The group as its coordinator describes it.
fn describe_group(group: &str) -> Option<GroupView> {
    let client: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .ok()?;
    describe(&client, group)
}

/// A static member of a hub group with the hub's protocol, outside any hub.
fn squatter(group: &str, topic: &str) -> BaseConsumer {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("group.instance.id", "squatter")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", "45000")
        .set("max.poll.interval.ms", "300000")
        .set("enable.auto.commit", "false")
        .create()
        .expect("squatter");
    c.subscribe(&[topic]).expect("subscribe");
    c
}

/// A cooperative rebalance that moves partitions takes two rounds; a member that stops between
/// them (here a squatter told to give up partitions, which closes instead) and comes back as the
/// same static member gets its stored assignment with no rebalance, and the partitions it gave
/// up belong to nobody: without `runtime::orphans` the hub never reads them (the CI flake of
/// `two_instances_scale_out_and_back_with_exactly_once_state`). The hub's loop of that group
/// finds them and rejoins. `stage` is "hub" (group `<group>.hub` on the inbox) or "ingest"
/// (group `<group>` on the source topic).
async fn partitions_given_up_between_rounds_are_handed_out_again(stage: &str) {
    let mut run = Run::new(&format!("orphan{stage}")).await;
    let (code, out) = topology_apply(&run.prefix, &[]);
    assert_eq!(code, 0, "{out}");
    let (group, topic, partitions) = match stage {
        "hub" => (format!("{}-group.hub", run.prefix), run.inbox(), 6i32),
        _ => (format!("{}-group", run.prefix), run.topic.clone(), 3i32),
    };

    let first = squatter(&group, &topic);
    wait_until(
        Duration::from_secs(60),
        "the squatter holds the topic",
        || {
            first.poll(Duration::from_millis(100));
            (first.assignment().ok()?.count() == partitions as usize).then_some(())
        },
    );
    let squatter_id = streaming_hub::runtime::kafka::membership(&first)
        .expect("membership")
        .member_id;
    // The hub joins. The squatter no longer polls: librdkafka's own thread answers the first
    // round, and the revocation it is told to make waits for a poll that never comes. The hub
    // is not ready meanwhile (it has no share yet): not waited for.
    let dir = tempfile::tempdir().unwrap();
    let mut hub = Hub::spawn(&run.env(1, dir.path()));
    wait_until(
        Duration::from_secs(120),
        "first round: the squatter keeps part of the topic, the hub holds nothing yet",
        || {
            let g = describe_group(&group)?;
            let kept = &g.members.iter().find(|(id, _)| *id == squatter_id)?.1;
            let hub_holds: usize = g
                .members
                .iter()
                .filter(|(id, _)| *id != squatter_id)
                .map(|(_, p)| p.len())
                .sum();
            let partial = kept.len() < partitions as usize;
            (g.state == "Stable" && g.members.len() == 2 && partial && hub_holds == 0).then_some(())
        },
    );
    // It closes instead (as an instance shutting down would), and comes back at once. The close
    // is not waited for: one was seen to hang once, with its revocation pending (the static
    // member that comes back replaces it anyway).
    std::thread::spawn(move || drop(first));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = std::sync::Arc::new(std::sync::Mutex::new(None::<BTreeSet<i32>>));
    let second = {
        let (stop, held, group, topic) = (stop.clone(), held.clone(), group.clone(), topic.clone());
        std::thread::spawn(move || {
            let c = squatter(&group, &topic);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(Err(e)) = c.poll(Duration::from_millis(100)) {
                    eprintln!("squatter: {e}");
                }
                if let Ok(a) = c.assignment() {
                    let now: BTreeSet<i32> = a.elements().iter().map(|e| e.partition()).collect();
                    let mut held = held.lock().unwrap();
                    if held.as_ref() != Some(&now) {
                        eprintln!("squatter holds {now:?}");
                    }
                    *held = Some(now);
                }
            }
        })
    };

    run.produce(600, 0);
    if stage == "hub" {
        // Ingest (not squatted) writes them to the inbox.
        read_until(&[&topic], Duration::from_secs(120), |r| r.len() >= 600);
    }
    let rest = wait_until(
        Duration::from_secs(180),
        "the partitions the squatter does not hold read by the hub",
        || {
            let held = held.lock().unwrap().clone()?;
            let rest: Vec<i32> = (0..partitions).filter(|p| !held.contains(p)).collect();
            (!rest.is_empty() && group_caught_up_on(&group, &topic, Some(&rest))).then_some(rest)
        },
    );
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let written: i64 = rest
        .iter()
        .map(|&p| {
            c.fetch_watermarks(&topic, p, Duration::from_secs(10))
                .unwrap()
                .1
        })
        .sum();
    assert!(written > 0, "events reached the partitions {rest:?}");
    // Handed its share, it is ready.
    hub.wait_ready();
    let metrics = hub
        .metrics_text(&reqwest::Client::new())
        .await
        .expect("metrics");
    let rejoins = format!("streaming_hub_group_rejoins_total{{stage=\"{stage}\"}}");
    assert!(
        metric_sum(&metrics, &rejoins) >= 1,
        "the hub's {stage} loop rejoined to hand the partitions out:\n{}",
        hub.log_text()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    second.join().unwrap();
    hub.terminate();
}

#[tokio::test]
async fn inbox_partitions_given_up_between_rebalance_rounds_are_handed_out_again() {
    partitions_given_up_between_rounds_are_handed_out_again("hub").await;
}

#[tokio::test]
async fn source_partitions_given_up_between_rebalance_rounds_are_handed_out_again() {
    partitions_given_up_between_rounds_are_handed_out_again("ingest").await;
}

/// A store last written longer ago than tombstones surely stay on the compacted changelog is
/// discarded and restored from the start. Here partition 0's store holds a dedup entry the
/// changelog never had (standing in for a key deleted there while the store was away, its
/// tombstone since compacted) and was last written two days ago: restored from its offset it
/// would keep that entry for good.
#[tokio::test]
async fn a_store_unwritten_for_longer_than_tombstones_last_is_restored_from_the_start() {
    let two_days_ago = now_ms() - 48 * 3_600_000;
    a_planted_store_is_discarded("stale", 0, "local state older than tombstones", |store| {
        let mut staged = Staged::default();
        staged.put(DEDUP, b"tenant-x\0gone".to_vec(), b"stale".to_vec());
        store.apply_at(staged, &[], two_days_ago).unwrap();
    })
    .await;
}

/// A store whose changelog offset is past its changelog partition's end (the log lost its tail,
/// or the topic was deleted and made again) holds what the changelog does not: it is discarded
/// and restored from the start, not read on from its offset (which would keep what it holds
/// and read nothing). Here partition 1's store, written just now, holds a dedup entry the
/// changelog never had, and an offset a million records past its end.
#[tokio::test]
async fn a_store_ahead_of_its_changelog_is_restored_from_the_start() {
    a_planted_store_is_discarded(
        "ahead",
        1,
        "local state is ahead of its changelog",
        |store| {
            let at = store.changelog_offset(JOBS).unwrap().unwrap();
            let mut staged = Staged::default();
            staged.put(DEDUP, b"tenant-x\0ghost".to_vec(), b"ghost".to_vec());
            store
                .apply_at(staged, &[(JOBS, at + 1_000_000)], now_ms())
                .unwrap();
        },
    )
    .await;
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Runs a hub over 300 events, has `plant` change the stopped hub's store of `partition`, runs
/// it again over 300 more, and checks that the store was discarded (one line with `logged`,
/// naming the partition) and that every store then matches the changelog.
async fn a_planted_store_is_discarded(
    tag: &str,
    partition: i32,
    logged: &str,
    plant: impl FnOnce(&Store),
) {
    let mut run = Run::new(tag).await;
    let dir = tempfile::tempdir().unwrap();
    let env = run.env(1, dir.path());
    run.produce(300, 0);
    let mut hub = Hub::start(&env);
    run.wait_caught_up(Duration::from_secs(120));
    hub.terminate();
    {
        let path = dir
            .path()
            .join(&run.prefix)
            .join(format!("hub-{partition}"));
        let store = Store::open(&path, &streaming_hub::hub::task::FAMILIES).unwrap();
        assert!(
            store.changelog_offset(JOBS).unwrap().is_some(),
            "partition {partition} has state"
        );
        plant(&store);
    }
    run.produce(300, 0);
    let mut hub = Hub::start(&env);
    run.wait_caught_up(Duration::from_secs(120));
    hub.terminate();
    let changelog = run.check_committed_state();
    let checked = check_stores_match_changelog(&[dir.path()], &run.prefix, &changelog);
    assert_eq!(checked, 6, "every store checked against its changelog");
    let log = hub.log_text();
    let discarded: Vec<&str> = log.lines().filter(|l| l.contains(logged)).collect();
    assert_eq!(discarded.len(), 1, "one store discarded:\n{log}");
    assert!(
        discarded[0].contains(&format!("partition={partition}")),
        "{}",
        discarded[0]
    );
}
