//! The broker started by `scripts/kafka.sh` supports what the hub stands on: transactions whose
//! committed records a `read_committed` reader sees and whose aborted records it never sees.
mod common;

use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

fn txn_producer(id: &str) -> BaseProducer {
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", id)
        .create()
        .expect("transactional producer");
    p.init_transactions(Duration::from_secs(30))
        .expect("init_transactions");
    p
}

#[tokio::test]
async fn committed_transaction_is_visible_and_aborted_one_is_not() {
    require_broker();
    let topic = unique("txn");
    create_topic(&topic, 1).await;
    let p = txn_producer(&unique("tid"));

    p.begin_transaction().unwrap();
    for i in 0..3 {
        p.send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload(&format!("committed-{i}")),
        )
        .unwrap();
    }
    p.commit_transaction(Duration::from_secs(30)).unwrap();

    p.begin_transaction().unwrap();
    for i in 0..3 {
        p.send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload(&format!("aborted-{i}")),
        )
        .unwrap();
    }
    p.flush(Duration::from_secs(30)).unwrap(); // the aborted records really reach the log
    p.abort_transaction(Duration::from_secs(30)).unwrap();

    p.begin_transaction().unwrap();
    p.send(
        BaseRecord::<str, str>::to(&topic)
            .key("k")
            .payload("after-abort"),
    )
    .unwrap();
    p.commit_transaction(Duration::from_secs(30)).unwrap();

    // Wait for the last committed record: everything before it is decided.
    let got = read_until(&[&topic], Duration::from_secs(30), |r| {
        r.iter()
            .any(|g| g.rec.value.as_deref() == Some(b"after-abort".as_slice()))
    });
    let values: Vec<String> = got
        .iter()
        .map(|g| String::from_utf8(g.rec.value.clone().unwrap()).unwrap())
        .collect();
    assert_eq!(
        values,
        ["committed-0", "committed-1", "committed-2", "after-abort"]
    );
    // The aborted records occupy offsets: the last record sits past them.
    assert!(
        got.last().unwrap().offset > 4,
        "aborted records were written and skipped"
    );
}

#[tokio::test]
async fn a_second_producer_with_the_same_transactional_id_fences_the_first() {
    require_broker();
    let topic = unique("fence");
    create_topic(&topic, 1).await;
    let id = unique("tid");
    let zombie = txn_producer(&id);
    zombie.begin_transaction().unwrap();
    zombie
        .send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload("zombie"),
        )
        .unwrap();
    zombie.flush(Duration::from_secs(30)).unwrap();

    let successor = txn_producer(&id); // bumps the epoch: the zombie's open transaction is aborted
    successor.begin_transaction().unwrap();
    successor
        .send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload("successor"),
        )
        .unwrap();
    successor
        .commit_transaction(Duration::from_secs(30))
        .unwrap();

    let err = zombie
        .commit_transaction(Duration::from_secs(30))
        .expect_err("a fenced producer cannot commit");
    assert!(
        err.to_string().to_lowercase().contains("fenc") || err.to_string().contains("epoch"),
        "{err}"
    );

    let got = read_until(&[&topic], Duration::from_secs(30), |r| !r.is_empty());
    let values: Vec<_> = got.iter().map(|g| g.rec.value.clone().unwrap()).collect();
    assert_eq!(values, [b"successor".to_vec()]);
}

/// A restore reads to the log end, not to the last stable offset: a transaction left open on the
/// changelog (a stuck previous owner's) is waited for, and what another owner committed after it
/// is restored. Stopping at the last stable offset lost those records (the fault suite's stall:
/// jobs due and never attempted).
#[tokio::test]
async fn restore_waits_for_an_open_transaction_and_reads_what_was_committed_after_it() {
    require_broker();
    let topic = unique("restore-lso");
    create_topic(&topic, 1).await;
    let send = |p: &BaseProducer, v: &str| {
        p.send(BaseRecord::<str, str>::to(&topic).key(v).payload(v))
            .unwrap()
    };
    // Committed before anything else: the restore applies it first.
    let first = txn_producer(&unique("tid-first"));
    first.begin_transaction().unwrap();
    send(&first, "before");
    first.commit_transaction(Duration::from_secs(30)).unwrap();
    // A stuck owner: its transaction stays open (records on the log, no marker).
    let stuck = txn_producer(&unique("tid-stuck"));
    stuck.begin_transaction().unwrap();
    send(&stuck, "stuck");
    stuck.flush(Duration::from_secs(30)).unwrap();
    // The next owner commits after it.
    let next = txn_producer(&unique("tid-next"));
    next.begin_transaction().unwrap();
    send(&next, "after");
    next.commit_transaction(Duration::from_secs(30)).unwrap();

    let config = streaming_hub::config::Config::from_vars(hub_env(&unique("r"), "^unused$"))
        .expect("config");
    let spec = streaming_hub::runtime::changelog::RestoreSpec {
        topic: topic.clone(),
        partition: 0,
        after: None,
    };
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let restore = std::thread::spawn(move || {
        let mut keys: Vec<String> = Vec::new();
        streaming_hub::runtime::changelog::restore(
            &config,
            &[spec],
            &Default::default(),
            |_, records| {
                for (k, _, _) in records {
                    keys.push(String::from_utf8_lossy(k).into_owned());
                }
                let _ = started_tx.send(());
                Ok(())
            },
        )
        .expect("restore");
        keys
    });
    // Once the restore has applied what precedes the open transaction, the stuck owner's
    // transaction ends (here: aborted, as its restarted instance or the timeout would).
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the restore applied the first record");
    stuck.abort_transaction(Duration::from_secs(30)).unwrap();
    let keys = restore.join().expect("restore thread");
    assert_eq!(
        keys,
        vec!["before".to_string(), "after".to_string()],
        "the restore holds what was committed before and after the open transaction, and not \
         the aborted record"
    );
}

/// A static member of `group` on the cooperative protocol, as the loops' consumers are, with a
/// short session and frequent heartbeats so rebalances take little time.
fn member_config(group: &str, instance: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("group.instance.id", instance)
        .set("enable.auto.commit", "false")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "300");
    c
}

/// A consumer of a transactional loop: its rebalance callback is the hub's own
/// (`kafka::rebalance_at_committed`), which records the membership each callback runs under.
#[derive(Default)]
struct LoopContext(streaming_hub::runtime::kafka::ConfirmedMembership);

impl rdkafka::ClientContext for LoopContext {}

impl rdkafka::consumer::ConsumerContext for LoopContext {
    fn rebalance(
        &self,
        consumer: &rdkafka::consumer::BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        tpl: &mut rdkafka::TopicPartitionList,
    ) {
        streaming_hub::runtime::kafka::rebalance_at_committed(
            self,
            consumer,
            err,
            tpl,
            &|| {},
            &|| false,
            &self.0,
            |e| panic!("assignment failed: {e}"),
        );
    }
}

/// Why `kafka::member_metadata` stands between the loops and `send_offsets_to_transaction`: the
/// group coordinator checks a transaction's offsets against the sender's generation and member
/// id, not against who owns the partition; and librdkafka joins a new generation in its own
/// thread, before the application has been told what it lost. The fault suite saw an instance
/// commit a source partition's records a second time in that window. Here: a member not joined
/// yet is refused; a member that has joined the next generation but not served its rebalance yet
/// is given the metadata, because in the cooperative protocol that generation gives the
/// partitions it still holds to nobody else (the newcomer holds none until the member has served
/// its revocation and joined again); it is given the metadata once it has served it too; and the
/// coordinator takes offsets of a partition the group gave to another member from it, which is
/// why any other membership is refused (`kafka::may_commit_under`'s unit test has the cases;
/// `the_next_generation_is_refused_inside_a_revocation` the one a broker can show).
#[tokio::test]
async fn offsets_are_sent_only_under_the_membership_whose_assignment_the_loop_was_told() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{Offset, TopicPartitionList};
    use streaming_hub::runtime::kafka;

    require_broker();
    let topic = unique("member");
    create_topic(&topic, 2).await;
    let group = unique("group");
    let config = |instance: &str| {
        let mut c = member_config(&group, instance);
        c.set("isolation.level", "read_committed");
        c
    };
    let at = |partition: i32, offset: i64| {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, partition, Offset::Offset(offset))
            .unwrap();
        tpl
    };
    let owned = |c: &BaseConsumer<LoopContext>| -> Vec<i32> {
        let mut p: Vec<i32> = c
            .assignment()
            .unwrap()
            .elements()
            .iter()
            .map(|e| e.partition())
            .collect();
        p.sort();
        p
    };

    // A consumer without a member id (not joined yet) is refused.
    let first: BaseConsumer<LoopContext> = config("first")
        .create_with_context(LoopContext::default())
        .unwrap();
    let unjoined = kafka::membership(&first).expect("metadata of a consumer with a group");
    assert!(!unjoined.is_member(), "{unjoined:?}");
    assert!(kafka::member_metadata(&first, &first.context().0).is_err());

    // Joined, told its assignment: given the metadata.
    first.subscribe(&[&topic]).unwrap();
    wait_until(
        Duration::from_secs(60),
        "the first member's assignment",
        || {
            let _ = first.poll(Duration::from_millis(100));
            (owned(&first) == [0, 1]).then_some(())
        },
    );
    let joined = kafka::membership(&first).unwrap();
    assert!(joined.is_member(), "{joined:?}");
    assert!(kafka::member_metadata(&first, &first.context().0).is_ok());

    // A second member joins while the first does not poll: the first's librdkafka joins the new
    // generation on its own. Until a poll serves that generation's rebalance (the revocation of
    // one partition) the first still holds both, and the second neither: the first is given
    // metadata of the new generation, under which the coordinator takes its offsets.
    let second: BaseConsumer<LoopContext> = config("second")
        .create_with_context(LoopContext::default())
        .unwrap();
    second.subscribe(&[&topic]).unwrap();
    let moved = wait_until(
        Duration::from_secs(60),
        "the first member in a new generation, the second's empty assignment served",
        || {
            let _ = second.poll(Duration::from_millis(50));
            kafka::membership(&first)
                .filter(|m| m.generation > joined.generation)
                .filter(|_| kafka::member_metadata(&second, &second.context().0).is_ok())
        },
    );
    assert_eq!(moved.generation, joined.generation + 1, "{moved:?}");
    assert_eq!(moved.member_id, joined.member_id);
    assert_eq!(owned(&first), [0, 1], "the first served no rebalance");
    assert_eq!(owned(&second), Vec::<i32>::new(), "{moved:?}");
    let next = kafka::member_metadata(&first, &first.context().0)
        .expect("the next generation of the same member, its revocation not served: allowed");
    let early = txn_producer(&unique("tid"));
    early.begin_transaction().unwrap();
    early
        .send_offsets_to_transaction(&at(0, 7), &next, Duration::from_secs(30))
        .unwrap();
    early.commit_transaction(Duration::from_secs(30)).unwrap();
    let committed = first
        .committed_offsets(at(0, 0), Duration::from_secs(10))
        .unwrap();
    assert_eq!(committed.elements()[0].offset(), Offset::Offset(7));

    // Both poll until each has one partition and has served its last rebalance: both given
    // metadata again.
    let first_metadata = wait_until(
        Duration::from_secs(60),
        "one partition each, rebalances served",
        || {
            let _ = first.poll(Duration::from_millis(50));
            let _ = second.poll(Duration::from_millis(50));
            let settled = owned(&first).len() == 1
                && owned(&second).len() == 1
                && kafka::member_metadata(&second, &second.context().0).is_ok();
            settled
                .then(|| kafka::member_metadata(&first, &first.context().0).ok())
                .flatten()
        },
    );

    // The coordinator takes the first member's offsets for the second member's partition.
    let theirs = owned(&second)[0];
    let producer = txn_producer(&unique("tid"));
    producer.begin_transaction().unwrap();
    producer
        .send_offsets_to_transaction(&at(theirs, 42), &first_metadata, Duration::from_secs(30))
        .unwrap();
    producer
        .commit_transaction(Duration::from_secs(30))
        .unwrap();
    let committed = second
        .committed_offsets(at(theirs, 0), Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        committed.elements()[0].offset(),
        Offset::Offset(42),
        "offsets of a partition the sender does not own, taken"
    );
}

/// A consumer whose revocation callback waits, inside it, for librdkafka to move to another
/// generation, then asks `kafka::member_metadata` whether it may commit: what the hub's
/// revocation does with its last transaction (`commit_given_up`).
struct RevokeProbe {
    confirmed: streaming_hub::runtime::kafka::ConfirmedMembership,
    /// Run once inside the first revocation, before the wait (here: grow the topic).
    during: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// (membership at the callback, membership it moved to, the check's answer).
    seen: std::sync::Mutex<Option<ProbeSeen>>,
    probed: std::sync::atomic::AtomicBool,
}

type ProbeSeen = (
    streaming_hub::runtime::kafka::Membership,
    Option<streaming_hub::runtime::kafka::Membership>,
    Result<(), String>,
);

impl rdkafka::ClientContext for RevokeProbe {}

impl rdkafka::consumer::ConsumerContext for RevokeProbe {
    fn rebalance(
        &self,
        consumer: &rdkafka::consumer::BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        tpl: &mut rdkafka::TopicPartitionList,
    ) {
        use rdkafka::consumer::Consumer;
        if self.probed.load(std::sync::atomic::Ordering::SeqCst) {
            // Probed: the rest of the rebalance is served as plainly as librdkafka allows.
            let _ = match err {
                rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                    consumer.incremental_assign(tpl)
                }
                _ => consumer.incremental_unassign(tpl),
            };
            return;
        }
        streaming_hub::runtime::kafka::rebalance_at_committed(
            self,
            consumer,
            err,
            tpl,
            &|| {},
            &|| false,
            &self.confirmed,
            |e| panic!("assignment failed: {e}"),
        );
    }

    fn pre_rebalance(
        &self,
        consumer: &rdkafka::consumer::BaseConsumer<Self>,
        rebalance: &rdkafka::consumer::Rebalance<'_>,
    ) {
        use streaming_hub::runtime::kafka;
        let rdkafka::consumer::Rebalance::Revoke(tpl) = rebalance else {
            return;
        };
        let Some(during) = self.during.lock().unwrap().take() else {
            return;
        };
        if tpl.count() == 0 {
            *self.during.lock().unwrap() = Some(during);
            return;
        }
        let at = kafka::membership(consumer).expect("a membership in a callback");
        during();
        let moved = (0..1200).find_map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            kafka::membership(consumer).filter(|m| m.generation > at.generation)
        });
        let answer = kafka::member_metadata(consumer, &self.confirmed)
            .map(|_| ())
            .map_err(|e| e.to_string());
        *self.seen.lock().unwrap() = Some((at, moved, answer));
        self.probed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Inside a revocation's callback only the membership it runs under is taken, not the next
/// generation: librdkafka has already left the partitions being revoked out of the ones it says
/// it owns, and it starts a rejoin without waiting for the callback when a subscribed topic
/// grows. That generation may give those partitions to the other member, so offsets sent under
/// it from the callback could commit a partition another member owns.
#[tokio::test]
async fn the_next_generation_is_refused_inside_a_revocation() {
    use rdkafka::admin::{AdminOptions, NewPartitions};
    use rdkafka::consumer::{BaseConsumer, Consumer};

    require_broker();
    let topic = unique("revoking");
    create_topic(&topic, 2).await;
    let group = unique("group");
    let config = |instance: &str| {
        let mut c = member_config(&group, instance);
        // The topic's growth is seen within a third of a second.
        c.set("topic.metadata.refresh.interval.ms", "300");
        c
    };
    let grow = {
        let topic = topic.clone();
        move || {
            let a = admin();
            let r = futures::executor::block_on(
                a.create_partitions(&[NewPartitions::new(&topic, 3)], &AdminOptions::new()),
            )
            .expect("create partitions");
            assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
        }
    };
    let probe = RevokeProbe {
        confirmed: Default::default(),
        during: std::sync::Mutex::new(Some(Box::new(grow))),
        seen: std::sync::Mutex::new(None),
        probed: Default::default(),
    };
    let first: BaseConsumer<RevokeProbe> = config("first").create_with_context(probe).unwrap();
    first.subscribe(&[&topic]).unwrap();
    wait_until(
        Duration::from_secs(60),
        "the first member's assignment",
        || {
            let _ = first.poll(Duration::from_millis(100));
            (first.assignment().unwrap().count() == 2).then_some(())
        },
    );

    // A second member, polled on its own thread, makes the first give up one partition.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let second = {
        let (stop, config) = (stop.clone(), config("second"));
        std::thread::spawn(move || {
            let c: BaseConsumer<LoopContext> =
                config.create_with_context(LoopContext::default()).unwrap();
            c.subscribe(&[&topic]).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = c.poll(Duration::from_millis(50));
            }
        })
    };
    let (at, moved, answer) =
        wait_until(Duration::from_secs(120), "the revocation's check", || {
            let _ = first.poll(Duration::from_millis(50));
            first.context().seen.lock().unwrap().take()
        });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    second.join().unwrap();
    let moved = moved.expect("librdkafka rejoined during the callback");
    assert_eq!(
        (moved.generation, &moved.member_id),
        (at.generation + 1, &at.member_id),
        "the next generation of the same member"
    );
    let refused = answer.expect_err("the next generation, inside the revocation: refused");
    assert!(refused.contains("during a rebalance callback"), "{refused}");
}

/// The threads of this process named `name`.
fn threads_named(name: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| t.ok().map(|t| t.path()))
        .filter(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim_end() == name))
        .collect()
}

/// Nanoseconds a thread has run on a CPU (the kernel's scheduler statistics, not sampled).
fn ran_ns(thread: &std::path::Path) -> u64 {
    let stat = std::fs::read_to_string(thread.join("schedstat")).expect("schedstat");
    stat.split_whitespace().next().unwrap().parse().unwrap()
}

/// A producer whose reports a `Served` thread serves gets each one as it comes (its place, in
/// order), while that thread runs for nothing when nothing comes: rdkafka's own polling thread
/// spun through the last millisecond of every 100 ms (about 9 ms of CPU a second, idle). Its
/// thread ends with it.
#[tokio::test]
async fn a_served_producer_gets_its_reports_and_its_thread_sleeps_while_idle() {
    use streaming_hub::runtime::served::{Awaited, Served, send_awaited};
    require_broker();
    let topic = unique("served");
    create_topic(&topic, 1).await;
    let name = "test-served";
    let producer: BaseProducer<Awaited> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create_with_context(Awaited)
        .expect("producer");
    let served = Served::new(producer, name).expect("served");
    for i in 0..20 {
        let at = send_awaited(&served, &topic, "k", Some(b"v"), Duration::from_secs(10))
            .await
            .expect("delivered");
        assert_eq!(at, (0, i), "record {i}'s report");
    }
    assert!(served.wakeups() >= 1, "the reports woke the thread");
    let thread = match threads_named(name).as_slice() {
        [t] => t.clone(),
        other => panic!("one thread named {name} expected, found {other:?}"),
    };
    // Idle for a second (the span observed, not a wait for something): its thread sleeps.
    let (ran, woke) = (ran_ns(&thread), served.wakeups());
    std::thread::sleep(Duration::from_secs(1));
    let idle_ns = ran_ns(&thread) - ran;
    assert!(
        idle_ns < 2_000_000,
        "the serving thread ran {idle_ns} ns in an idle second"
    );
    assert!(served.wakeups() - woke <= 1, "woken while idle");
    // Still served after the idle second.
    let at = send_awaited(&served, &topic, "k", None, Duration::from_secs(10))
        .await
        .expect("delivered after idling");
    assert_eq!(at, (0, 20));
    drop(served);
    // Joined by the drop; its /proc entry may outlast the join by a moment.
    wait_until(
        Duration::from_secs(5),
        "the thread to end with its producer",
        || threads_named(name).is_empty().then_some(()),
    );
}
