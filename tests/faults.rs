//! Faults under load on the three-broker cluster (`scripts/kafka.sh start --brokers 3`, started by
//! scripts/test.sh on `TEST_KAFKA_CLUSTER_PORT`): three hub instances in one group, replication
//! factor 3 with `min.insync.replicas = 2`, a producer at a steady rate, sinks that sometimes fail
//! or hang. Faults, one at a time and then mixed: SIGKILL an instance; SIGSTOP one for twice the
//! session timeout and resume it (the zombie must be fenced); kill the inbox leader broker and
//! restart it; restart a sink; SIGKILL an instance while a broker is down.
//!
//! The verifier then reads every hub topic and every sink log and checks: no loss (every accepted
//! event reached every subscription it matched), duplicates only for attempts around a fault,
//! no leak (nothing reached a subscription it did not match, nor another tenant), quarantine and
//! drop counts equal to the malformed and system records sent, and contiguous per-tenant arrival
//! sequences (read from a pull subscription per tenant). It prints the figures as one JSON line.
//!
//! This file holds one test: it points the shared helpers at the cluster through
//! `TEST_KAFKA_BROKERS`, which is process-wide. When deliveries stop arriving for a minute, it
//! prints where they are stuck (`STALL:` lines: each missing delivery's inbox partition, its job's
//! last changelog record and attempts, the hub group's assignments, each instance's gauges).
//! Run alone: `TEST_KAFKA_CLUSTER_PORT=19192 cargo test --test faults -- --nocapture`.
mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::*;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::producer::Producer;
use serde_json::json;

const TENANTS: [&str; 4] = ["t0", "t1", "t2", "t3"];
/// Produces events but has no subscription: nothing of it may arrive anywhere.
const LONER: &str = "t4";
const RATE_PER_SEC: usize = 150;
const WORKERS: usize = 8;
const SESSION_TIMEOUT_S: u64 = 6;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn signal(hub: &Hub, sig: libc::c_int) {
    send_signal(hub.child.id(), sig);
}

/// What a sink saw: one HTTP request.
#[derive(Clone, Debug)]
struct Hit {
    /// The subscription's name in this test (`<tenant>/<a|b>`), from the URL path.
    sub: String,
    event_id: String,
    tenant: String,
    event_type: String,
    produced_ms: i64,
    at_ms: i64,
    /// The sink answered 200 at once (the hub saw a success). Failures and hangs are false.
    acked: bool,
}

#[derive(Clone, Default)]
struct SinkLog(Arc<Mutex<Vec<Hit>>>);

/// Fails 5% of deliveries with a 500 and hangs 1% past the hub's HTTP timeout, chosen by the
/// delivery id so a retry gets a fresh draw.
async fn hook(
    State(log): State<SinkLog>,
    Path((tenant, which)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Bytes) {
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    if h("x-lerian-event-type") == "streaming_hub.verification" {
        return (StatusCode::OK, body);
    }
    let draw = h("x-lerian-delivery-id")
        .bytes()
        .fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32))
        % 100;
    let produced_ms = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["produced_ms"].as_i64())
        .unwrap_or(0);
    let mut hit = Hit {
        sub: format!("{tenant}/{which}"),
        event_id: h("x-lerian-event-id"),
        tenant: h("ce-tenantid"),
        event_type: h("x-lerian-event-type"),
        produced_ms,
        at_ms: now_ms(),
        acked: false,
    };
    if draw < 5 {
        log.0.lock().unwrap().push(hit);
        return (StatusCode::INTERNAL_SERVER_ERROR, Bytes::new());
    }
    if draw < 6 {
        log.0.lock().unwrap().push(hit);
        tokio::time::sleep(Duration::from_secs(4)).await; // the hub gives up after 2 s
        return (StatusCode::OK, Bytes::new());
    }
    hit.acked = true;
    log.0.lock().unwrap().push(hit);
    (StatusCode::OK, Bytes::new())
}

/// A sink on a fixed port that can be stopped (connections refused) and started again.
struct RestartableSink {
    port: u16,
    log: SinkLog,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RestartableSink {
    async fn start(port: u16, log: SinkLog) -> RestartableSink {
        let mut s = RestartableSink {
            port,
            log,
            stop: None,
            task: None,
        };
        s.up().await;
        s
    }

    async fn up(&mut self) {
        let app = Router::new()
            .route("/hook/{tenant}/{which}", post(hook))
            .with_state(self.log.clone());
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .expect("bind the sink's port again");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.stop = Some(tx);
        self.task = Some(tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        }));
    }

    async fn down(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }
}

/// Which records the producer sent, by kind.
#[derive(Default)]
struct Sent {
    /// ce-id → (tenant, "<resource>.<event>").
    accepted: BTreeMap<String, (String, String)>,
    /// ce-ids of the business events sent without a tenant (quarantined).
    malformed: BTreeSet<String>,
    /// System events sent (dropped).
    system: usize,
}

/// A producer on the cluster at `RATE_PER_SEC` until `stop`: business events of five tenants
/// (three types), every 37th a business event without a tenant (quarantine), every 41st a
/// system event (drop).
fn run_producer(
    topic: String,
    bootstrap: String,
    stop: Arc<AtomicBool>,
    produced: Arc<AtomicUsize>,
) -> Sent {
    let producer: TestProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("message.timeout.ms", "180000")
        .create_with_context(FailOnError::default())
        .unwrap();
    let types = [
        ("transaction", "created"),
        ("account", "created"),
        ("account", "updated"),
    ];
    let mut sent = Sent::default();
    let start = Instant::now();
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let due = (start.elapsed().as_millis() as usize) * RATE_PER_SEC / 1000;
        let mut batch = Vec::new();
        while i < due {
            let tenant = if i % 5 == 4 { LONER } else { TENANTS[i % 5] };
            let (res, ev) = types[(i / 5) % 3];
            let mut r = event(tenant, "ledger", res, ev);
            let id = r.id();
            r.value = Some(
                json!({"id": id, "amount": "10.00", "produced_ms": now_ms()})
                    .to_string()
                    .into_bytes(),
            );
            if i % 37 == 36 {
                r = r.set("ce-tenantid", None);
                sent.malformed.insert(id);
            } else if i % 41 == 40 {
                let mut s = event("x", "platform-reaper", "platform", "reaper_pass");
                s.key = Some(b"system:reaper_pass".to_vec());
                r = s.set("ce-tenantid", None).add("ce-systemevent", b"true");
                sent.system += 1;
            } else {
                sent.accepted
                    .insert(id, (tenant.to_string(), format!("{res}.{ev}")));
            }
            batch.push(r);
            i += 1;
        }
        if !batch.is_empty() {
            // `produce` flushes: at most a tick of records waits on a broker election.
            produce(&producer, &topic, &batch);
            produced.store(i, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(20)); // the rate's tick, not a wait for a condition
    }
    producer.flush(Duration::from_secs(60)).unwrap();
    sent
}

/// Which test subscriptions an event matches: `a` = transaction.*, `b` = account.created,
/// `p` = the tenant's pull subscription (everything).
fn expected_subs(tenant: &str, ty: &str) -> Vec<String> {
    if !TENANTS.contains(&tenant) {
        return Vec::new();
    }
    let mut v = vec![format!("{tenant}/p")];
    if ty.starts_with("transaction.") {
        v.push(format!("{tenant}/a"));
    }
    if ty == "account.created" {
        v.push(format!("{tenant}/b"));
    }
    v
}

struct Fault {
    name: String,
    at_ms: i64,
}

/// Restarts every instance that left on its own (a fenced zombie, a stage that failed: the
/// process exits to be restarted), as an orchestrator would; each restart counts as a fault.
/// Leaving is allowed only the ways the hub leaves on purpose (exit 1, or 70 from the stall
/// watchdog), never by a panic or a signal the test did not send.
fn supervise(
    hubs: &mut [Hub],
    envs: &[BTreeMap<String, String>],
    faults: &mut Vec<Fault>,
    exited: &mut Vec<String>,
) -> bool {
    let mut restarted = false;
    for (i, hub) in hubs.iter_mut().enumerate() {
        if let Some(status) = hub.child.try_wait().unwrap() {
            let log = hub.log_text();
            assert!(
                matches!(status.code(), Some(1 | 70))
                    && !log.contains("panicked at")
                    && !log.contains("panicked=true"),
                "instance {} left with {status}:\n{log}",
                i + 1
            );
            exited.push(format!("instance {}: {status}", i + 1));
            faults.push(Fault {
                name: format!("restart of instance {} after it exited", i + 1),
                at_ms: now_ms(),
            });
            // Ready once its partitions' stores are restored, which waits for the transactions
            // its previous incarnation left open: up to their 60 s timeout.
            *hub = Hub::spawn(&envs[i]);
            hub.wait_ready_within(Duration::from_secs(240));
            restarted = true;
        }
    }
    restarted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_under_load_lose_nothing_leak_nothing_and_keep_sequences() {
    let bootstrap = use_cluster();

    let prefix = unique("faults");
    let topic = format!("lerian.streaming.{prefix}");
    let t = NewTopic::new(&topic, 4, TopicReplication::Fixed(3)).set("min.insync.replicas", "2");
    for r in admin()
        .create_topics(&[t], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }

    // Sinks: t1's on a port that will be restarted, the others on one that stays up.
    let log = SinkLog::default();
    let steady_port = free_port();
    let restart_port = free_port();
    let _steady = RestartableSink::start(steady_port, log.clone()).await;
    let mut restartable = RestartableSink::start(restart_port, log.clone()).await;

    let mut env = api_hub_env(&prefix, &format!("^{}$", topic.replace('.', r"\.")));
    env.insert(
        "STREAMING_HUB_FOLLOW_PATTERN".into(),
        format!("^{}$", topic.replace('.', r"\.")),
    );
    env.insert("STREAMING_HUB_REPLICATION_FACTOR".into(), "3".into());
    env.insert(
        "STREAMING_HUB_SESSION_TIMEOUT".into(),
        format!("{SESSION_TIMEOUT_S}s"),
    );
    env.insert("STREAMING_HUB_HTTP_TIMEOUT".into(), "2s".into());
    env.insert("STREAMING_HUB_DISPATCH_WORKERS".into(), WORKERS.to_string());
    env.insert("STREAMING_HUB_SHUTDOWN_TIMEOUT".into(), "5s".into());
    // A loop stuck in a Kafka call ends its process after this; the supervisor restarts it.
    env.insert("STREAMING_HUB_STALL_TIMEOUT".into(), "40s".into());
    let envs = [
        env.clone(),
        another_instance(&env, "2"),
        another_instance(&env, "3"),
    ];
    let mut hubs: Vec<Hub> = envs.iter().map(Hub::start).collect();

    // Subscriptions through the first instance's API; a short retry curve so a failure costs
    // seconds, not hours.
    let http = hub_http();
    let token = |tenant: &str| {
        streaming_hub::api::mint(
            &streaming_hub::runtime::secret::Secret::new(JWT),
            Some(tenant),
            false,
            Duration::from_secs(86_400),
        )
    };
    let curve = [
        "1s", "2s", "3s", "5s", "5s", "5s", "10s", "10s", "10s", "10s",
    ];
    let mut sub_ids = Vec::new();
    // The test's name of each subscription (`<tenant>/<a|b|p>`) → its id.
    let mut sub_names: BTreeMap<String, String> = BTreeMap::new();
    for tenant in TENANTS {
        let sink_port = if tenant == "t1" {
            restart_port
        } else {
            steady_port
        };
        let bodies = [
            json!({"event_types": ["transaction.*"], "retry_schedule": curve,
                   "destination": {"type": "webhook", "url": format!("http://127.0.0.1:{sink_port}/hook/{tenant}/a")}}),
            json!({"event_types": ["account.created"], "retry_schedule": curve,
                   "destination": {"type": "webhook", "url": format!("http://127.0.0.1:{sink_port}/hook/{tenant}/b")}}),
            json!({"event_types": ["transaction.*", "account.*"], "destination": {"type": "pull"}}),
        ];
        for (which, body) in ["a", "b", "p"].into_iter().zip(bodies) {
            let v = post_subscription(&http, &hubs[0].addr(), &token(tenant), &body).await;
            assert_eq!(v["verification_state"], "active", "{v}");
            sub_ids.push((tenant, v["id"].as_str().unwrap().to_string()));
            sub_names.insert(
                format!("{tenant}/{which}"),
                v["id"].as_str().unwrap().to_string(),
            );
        }
    }
    // Every instance has applied every subscription before the first event.
    for hub in &hubs {
        for (tenant, id) in &sub_ids {
            let url = format!("http://{}/v1/subscriptions/{id}", hub.addr());
            let mut tries = 0;
            while http
                .get(&url)
                .bearer_auth(token(tenant))
                .send()
                .await
                .unwrap()
                .status()
                != 200
            {
                tries += 1;
                assert!(tries < 600, "{} never applied {id}", hub.addr());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let produced = Arc::new(AtomicUsize::new(0));
    let producer = {
        let (topic, bootstrap, stop, produced) = (
            topic.clone(),
            bootstrap.clone(),
            stop.clone(),
            produced.clone(),
        );
        std::thread::spawn(move || run_producer(topic, bootstrap, stop, produced))
    };
    let reached = |n: usize| {
        let produced = produced.clone();
        move || (produced.load(Ordering::Relaxed) >= n).then_some(())
    };
    let step = RATE_PER_SEC * 6; // six seconds of load between faults
    let mut faults: Vec<Fault> = Vec::new();
    let mut exited: Vec<String> = Vec::new();
    let mut mark = 0usize;
    let next = |mark: &mut usize| {
        *mark += step;
        *mark
    };

    // 1. SIGKILL an instance, start it again.
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    faults.push(Fault {
        name: "sigkill instance 2".into(),
        at_ms: now_ms(),
    });
    hubs[1].kill();
    wait_until(
        Duration::from_secs(120),
        "load",
        reached(mark + RATE_PER_SEC * 2),
    );
    // Ready as in `supervise`: its restores may wait for what the killed one left open.
    hubs[1] = Hub::spawn(&envs[1]);
    hubs[1].wait_ready_within(Duration::from_secs(240));

    // 2. SIGSTOP an instance for twice the session timeout: the group moves its partitions,
    //    and when it resumes, its transactions are fenced.
    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    faults.push(Fault {
        name: "sigstop instance 3 (zombie)".into(),
        at_ms: now_ms(),
    });
    signal(&hubs[2], libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(2 * SESSION_TIMEOUT_S)); // the fault's length
    signal(&hubs[2], libc::SIGCONT);

    // 3. Kill the broker that leads inbox partition 0, restart it.
    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    let inbox = format!("{prefix}.inbox");
    let leader_of = |topic: &str| {
        let md = admin()
            .inner()
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()?;
        let p = md.topics().first()?.partitions().first()?;
        (p.leader() >= 0).then_some(p.leader())
    };
    let leader = wait_until(Duration::from_secs(30), "inbox leader", || {
        leader_of(&inbox)
    });
    faults.push(Fault {
        name: "kill inbox leader broker".into(),
        at_ms: now_ms(),
    });
    let down = BrokerDown::kill(leader);
    wait_until(Duration::from_secs(120), "a new inbox leader", || {
        leader_of(&inbox).filter(|l| *l != leader)
    });
    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    down.restart();
    // Every partition of the cluster, the transaction and offset topics' included: step 5 kills
    // another broker, and a partition the restarted one has not caught up on would be left
    // under its minimum in-sync replicas.
    let all_in_sync = || {
        let md = admin()
            .inner()
            .fetch_metadata(None, Duration::from_secs(5))
            .ok()?;
        let ps: Vec<_> = md.topics().iter().flat_map(|t| t.partitions()).collect();
        let inbox_back = md
            .topics()
            .iter()
            .find(|t| t.name() == inbox)
            .is_some_and(|t| t.partitions().iter().all(|p| p.isr().len() == 3));
        (inbox_back && ps.iter().all(|p| p.isr().len() == p.replicas().len())).then_some(())
    };
    wait_until(
        Duration::from_secs(180),
        "the broker back in sync",
        all_in_sync,
    );

    // 4. Restart a sink.
    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    faults.push(Fault {
        name: "restart t1's sink".into(),
        at_ms: now_ms(),
    });
    restartable.down().await;
    tokio::time::sleep(Duration::from_secs(3)).await; // the outage's length
    restartable.up().await;

    // 5. Mixed: SIGKILL an instance while a broker is down.
    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    let victim = if leader == 1 { 2 } else { 1 };
    faults.push(Fault {
        name: "sigkill instance 1 while a broker is down".into(),
        at_ms: now_ms(),
    });
    let down = BrokerDown::kill(victim);
    hubs[0].kill();
    wait_until(
        Duration::from_secs(120),
        "load",
        reached(mark + RATE_PER_SEC * 3),
    );
    // Ready once its stores are restored, which reads each changelog to the end its killed
    // incarnation left open in a transaction: that ends when the coordinator aborts it, fenced
    // by the new producer once the coordinator can write its markers with a broker down, else
    // after the transaction timeout (60 s) and the coordinator's next check (10 s). CI saw the
    // coordinator answer CONCURRENT_TRANSACTIONS past 60 s here.
    hubs[0] = Hub::spawn(&envs[0]);
    hubs[0].wait_ready_within(Duration::from_secs(240));
    down.restart();

    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    wait_until(Duration::from_secs(120), "load", reached(next(&mut mark)));
    stop.store(true, Ordering::Relaxed);
    supervise(&mut hubs, &envs, &mut faults, &mut exited);
    let sent = producer.join().unwrap();
    let stopped_ms = now_ms();

    // Every accepted event reaches every subscription it matched.
    let mut expected: BTreeSet<(String, String)> = BTreeSet::new();
    for (id, (tenant, ty)) in &sent.accepted {
        for sub in expected_subs(tenant, ty) {
            if !sub.ends_with("/p") {
                expected.insert((sub, id.clone()));
            }
        }
    }
    let acked_pairs = || -> BTreeSet<(String, String)> {
        log.0
            .lock()
            .unwrap()
            .iter()
            .filter(|h| h.acked)
            .map(|h| (h.sub.clone(), h.event_id.clone()))
            .collect()
    };
    let converged = Instant::now();
    let (mut last_missing, mut last_change, mut explained) = (usize::MAX, Instant::now(), false);
    loop {
        let missing_pairs: Vec<(String, String)> =
            expected.difference(&acked_pairs()).cloned().collect();
        let missing = missing_pairs.len();
        if missing == 0 {
            break;
        }
        if missing != last_missing {
            (last_missing, last_change) = (missing, Instant::now());
        } else if !explained && last_change.elapsed() > Duration::from_secs(60) {
            explained = true;
            explain_stall(&prefix, &missing_pairs, &sub_names, &hubs).await;
        }
        if supervise(&mut hubs, &envs, &mut faults, &mut exited) {
            // The wait for a restarted instance is not a stall.
            last_change = Instant::now();
        }
        // Failed when nothing arrives for 3 minutes (the backlog the faults left grows with
        // how slow the machine was), or after 15 in all.
        assert!(
            last_change.elapsed() < Duration::from_secs(180)
                && converged.elapsed() < Duration::from_secs(900),
            "{missing} of {} matched deliveries never arrived",
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let settle_s = converged.elapsed().as_secs_f64();

    let hits = log.0.lock().unwrap().clone();
    // No leak: nothing to a subscription the event did not match, nothing of another tenant.
    for h in &hits {
        let (tenant, ty) = sent
            .accepted
            .get(&h.event_id)
            .unwrap_or_else(|| panic!("a delivery of an event never accepted: {h:?}"));
        assert!(
            expected_subs(tenant, ty).contains(&h.sub),
            "leak: {h:?} reached a subscription it does not match"
        );
        assert_eq!(&h.tenant, tenant, "leak across tenants: {h:?}");
        assert_eq!(&h.event_type, ty);
    }
    // Duplicates: only for attempts around a fault: a first success from 20 s before a fault
    // (its outcome was not committed yet) to 45 s after it (partitions still moving: the group
    // rebalances as restarted instances rejoin, and an outcome whose partition moved is lost,
    // so the job is reclaimed once its lease ends).
    let mut acks: HashMap<(String, String), Vec<i64>> = HashMap::new();
    for h in hits.iter().filter(|h| h.acked) {
        acks.entry((h.sub.clone(), h.event_id.clone()))
            .or_default()
            .push(h.at_ms);
    }
    let mut duplicates = 0usize;
    for (pair, times) in &acks {
        if times.len() > 1 {
            duplicates += times.len() - 1;
            let first = times[0];
            assert!(
                faults
                    .iter()
                    .any(|f| first <= f.at_ms + 45_000 && first >= f.at_ms - 20_000),
                "duplicate delivery of {pair:?} far from any fault: {times:?}; faults: {:?}",
                faults
                    .iter()
                    .map(|f| (&f.name, f.at_ms))
                    .collect::<Vec<_>>()
            );
        }
    }
    assert!(
        duplicates <= faults.len() * 3 * WORKERS * 64,
        "{duplicates} duplicates"
    );

    // Exactly what was sent, once: inbox = accepted, quarantine = malformed, drops = system.
    let inbox_recs = read_all(&[&inbox], Duration::from_secs(60));
    let quarantine = read_all(&[&format!("{prefix}.quarantine")], Duration::from_secs(60));
    let inbox_ids: Vec<String> = inbox_recs
        .iter()
        .map(|g| g.rec.header("ce-id").unwrap_or_default().to_string())
        .collect();
    let distinct: BTreeSet<&String> = inbox_ids.iter().collect();
    if distinct.len() != inbox_ids.len() {
        explain_inbox_duplicates(&inbox_recs);
        // When each fault began (wall clock, as the instances' logs print it) and which
        // instances left on their own: the duplicates' ingest times point into this timeline.
        for f in &faults {
            eprintln!(
                "FAULT {} at {}",
                f.name,
                streaming_hub::ingest::pipeline::rfc3339_ms(f.at_ms)
            );
        }
        eprintln!("EXITED {exited:?}");
        eprintln!(
            "instance logs: {}",
            std::env::temp_dir()
                .join(format!("{prefix}-*.log"))
                .display()
        );
    }
    assert_eq!(
        (inbox_ids.len(), distinct.len()),
        (sent.accepted.len(), sent.accepted.len()),
        "the inbox holds every accepted event exactly once"
    );
    // Exactly the accepted ones there, exactly the malformed ones in quarantine: so every system
    // event was dropped (the three sets are disjoint), none taken in or quarantined.
    assert!(
        distinct.iter().all(|id| sent.accepted.contains_key(*id)),
        "the inbox holds an event never accepted"
    );
    let quarantined: BTreeSet<String> = quarantine.iter().map(|g| g.rec.id()).collect();
    assert_eq!(
        quarantine.len(),
        quarantined.len(),
        "a record quarantined twice"
    );
    assert_eq!(quarantined, sent.malformed, "quarantine = malformed sent");
    assert!(sent.system > 0, "no system event was sent");

    // Per-tenant arrival sequences: every accepted event of a subscribed tenant once on its pull
    // subscription, numbered without gaps or repeats.
    let pulled = read_all(&[&format!("{prefix}.pull")], Duration::from_secs(60));
    let mut seqs: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
    for g in &pulled {
        let tenant = g.rec.header("ce-tenantid").unwrap().to_string();
        let seq: u64 = g
            .rec
            .header("x-streaming-hub-sequence")
            .unwrap()
            .parse()
            .unwrap();
        seqs.entry(tenant).or_default().push((seq, g.rec.id()));
    }
    assert!(!seqs.contains_key(LONER), "a tenant without subscriptions");
    for tenant in TENANTS {
        let mut got = seqs.remove(tenant).unwrap_or_default();
        got.sort();
        let want: usize = sent.accepted.values().filter(|(t, _)| t == tenant).count();
        let ids: BTreeSet<&String> = got.iter().map(|(_, id)| id).collect();
        assert_eq!(
            (got.len(), ids.len()),
            (want, want),
            "{tenant}: each accepted event once on its pull subscription"
        );
        let first = got[0].0;
        for (k, (seq, _)) in got.iter().enumerate() {
            assert_eq!(*seq, first + k as u64, "{tenant}: sequences contiguous");
        }
    }
    let dead = read_all(&[&format!("{prefix}.dlq")], Duration::from_secs(60));
    assert!(dead.is_empty(), "{} dead letters", dead.len());

    // Figures: how long events waited for their first successful delivery (produce -> sink),
    // before any fault and for events produced within 10 s after each fault. Failures the
    // sinks inject (5% errors, 1% hangs) cost retries in every window.
    let mut first_ack: HashMap<(String, String), &Hit> = HashMap::new();
    for h in hits.iter().filter(|h| h.acked) {
        first_ack
            .entry((h.sub.clone(), h.event_id.clone()))
            .or_insert(h);
    }
    let window = |from: i64, to: i64| {
        let mut d: Vec<i64> = first_ack
            .values()
            .filter(|h| h.produced_ms >= from && h.produced_ms < to)
            .map(|h| h.at_ms - h.produced_ms)
            .collect();
        d.sort_unstable();
        let q = |x: f64| {
            d.get(((d.len() as f64 - 1.0) * x).round() as usize)
                .map_or(0.0, |v| *v as f64 / 1000.0)
        };
        json!({"events": d.len(), "p50_s": q(0.5), "p99_s": q(0.99), "max_s": q(1.0)})
    };
    let mut delays = vec![json!({"fault": "none (before the first)",
                                 "delay": window(0, faults[0].at_ms)})];
    for f in &faults {
        delays.push(json!({"fault": f.name, "delay": window(f.at_ms, f.at_ms + 10_000)}));
    }
    let line = json!({
        "scenario": "faults",
        "events_sent": sent.accepted.len() + sent.malformed.len() + sent.system,
        "accepted": sent.accepted.len(),
        "quarantined": sent.malformed.len(),
        "dropped": sent.system,
        "matched_deliveries": expected.len(),
        "sink_requests": hits.len(),
        "duplicates": duplicates,
        "instances_that_exited_on_their_own": exited,
        "faults": delays,
        "settle_after_producer_stopped_s": settle_s,
        "producer_stopped_ms": stopped_ms,
    });
    report(&line);
}

/// Says where deliveries that stopped arriving are stuck: per missing (subscription, event) its
/// inbox partition, its job's last changelog record and the attempts recorded for it; the hub
/// group's members and assignments; each instance's process and delivery gauges.
async fn explain_stall(
    prefix: &str,
    missing: &[(String, String)],
    sub_names: &BTreeMap<String, String>,
    hubs: &[Hub],
) {
    let codec = streaming_hub::runtime::avro::Codec::new().unwrap();
    let inbox = read_all(&[&format!("{prefix}.inbox")], Duration::from_secs(60));
    let partition_of: HashMap<String, i32> =
        inbox.iter().map(|g| (g.rec.id(), g.partition)).collect();
    let changelog = read_all(
        &[&format!("{prefix}.hub.jobs.changelog")],
        Duration::from_secs(60),
    );
    // Each job key's last changelog record.
    let mut jobs: HashMap<&[u8], &Got> = HashMap::new();
    for g in &changelog {
        if let Some(k) = &g.rec.key {
            jobs.insert(k, g);
        }
    }
    let attempts = read_all(&[&format!("{prefix}.attempts")], Duration::from_secs(60));
    let mut attempts_of: HashMap<String, usize> = HashMap::new();
    for g in &attempts {
        if let Some(k) = &g.rec.key {
            *attempts_of
                .entry(String::from_utf8_lossy(k).into_owned())
                .or_default() += 1;
        }
    }
    let mut by_place: BTreeMap<(String, Option<i32>), usize> = BTreeMap::new();
    for (sub, id) in missing {
        *by_place
            .entry((sub.clone(), partition_of.get(id).copied()))
            .or_default() += 1;
    }
    eprintln!(
        "STALL: {} deliveries missing; by (subscription, inbox partition): {by_place:?}",
        missing.len()
    );
    for (sub, id) in missing.iter().take(12) {
        let tenant = sub.split('/').next().unwrap();
        let key = streaming_hub::dispatch::jobs::job_key(tenant, id, &sub_names[sub]);
        let job = match jobs.get(key.as_slice()) {
            None => "no changelog record".to_string(),
            Some(g) => match &g.rec.value {
                None => format!("tombstone at {}/{}", g.partition, g.offset),
                Some(v) => format!(
                    "at {}/{}: {:?}",
                    g.partition,
                    g.offset,
                    codec.decode::<streaming_hub::runtime::records::JobRecord>(
                        streaming_hub::runtime::avro::RecordKind::Job,
                        v
                    )
                ),
            },
        };
        eprintln!(
            "STALL: {sub} {id} inbox partition {:?}, attempts recorded {}, job {job}",
            partition_of.get(id),
            attempts_of.get(id).copied().unwrap_or(0)
        );
    }
    // The hub group's members as the coordinator sees them (the Maven-installed broker has no
    // kafka-consumer-groups.sh).
    let group = format!("{prefix}-group.hub");
    let described = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create::<rdkafka::consumer::BaseConsumer>()
        .and_then(|c| {
            use rdkafka::consumer::Consumer;
            c.fetch_group_list(Some(&group), Duration::from_secs(10))
        });
    match described {
        Ok(list) => {
            for g in list.groups() {
                eprintln!("STALL: group {} state {}", g.name(), g.state());
                for m in g.members() {
                    eprintln!(
                        "STALL:   member {} client {} host {}",
                        m.id(),
                        m.client_id(),
                        m.client_host()
                    );
                }
            }
        }
        Err(e) => eprintln!("STALL: group {group} not described: {e}"),
    }
    let http = hub_http();
    for hub in hubs {
        let metrics = hub
            .metrics_text(&http)
            .await
            .unwrap_or_else(|e| format!("no answer: {e}"));
        let gauges: Vec<&str> = metrics
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                [
                    "claimed",
                    "executing",
                    "restoring",
                    "breaker",
                    "due",
                    "owned",
                    "lag",
                ]
                .iter()
                .any(|k| l.contains(k))
            })
            .collect();
        eprintln!(
            "STALL: instance {} pid {} log {}:\n  {}",
            hub.env["STREAMING_HUB_INSTANCE_ID"],
            hub.child.id(),
            hub.log.display(),
            gauges.join("\n  ")
        );
    }
}

/// Says where inbox records written twice came from: per source partition, how many, the source
/// offset range, and the inbox partition, offset and ingest time of each copy of the first few.
fn explain_inbox_duplicates(inbox: &[Got]) {
    let mut copies: BTreeMap<String, Vec<&Got>> = BTreeMap::new();
    for g in inbox {
        copies.entry(g.rec.id()).or_default().push(g);
    }
    let header = |g: &Got, k: &str| g.rec.header(k).unwrap_or("?").to_string();
    let mut per_source: BTreeMap<String, (usize, i64, i64)> = BTreeMap::new();
    let mut shown = 0;
    for (id, gs) in copies.iter().filter(|(_, gs)| gs.len() > 1) {
        let source = header(gs[0], "x-streaming-hub-source-partition");
        let offset: i64 = header(gs[0], "x-streaming-hub-source-offset")
            .parse()
            .unwrap_or(-1);
        let e = per_source.entry(source).or_insert((0, i64::MAX, i64::MIN));
        e.0 += 1;
        e.1 = e.1.min(offset);
        e.2 = e.2.max(offset);
        if shown < 8 {
            shown += 1;
            let where_: Vec<String> = gs
                .iter()
                .map(|g| {
                    format!(
                        "inbox {}/{} source {}/{} ingested {}",
                        g.partition,
                        g.offset,
                        header(g, "x-streaming-hub-source-partition"),
                        header(g, "x-streaming-hub-source-offset"),
                        header(g, "x-streaming-hub-ingest-time")
                    )
                })
                .collect();
            eprintln!("INBOX DUPLICATE {id}: {where_:?}");
        }
    }
    eprintln!(
        "INBOX DUPLICATES per source partition (count, first, last source offset): {per_source:?}"
    );
}
