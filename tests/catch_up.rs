//! A hub restarted while its control topic cannot be read takes no inbox partition until its
//! subscription table has caught up, on the three-broker cluster of scripts/test.sh
//! (`TEST_KAFKA_CLUSTER_PORT`). The control topic lives on one broker only, which is down while
//! the hub restarts: a new event waits in the inbox and a job whose first attempt failed waits in
//! the store, and both are delivered once the broker is back — neither is matched against an
//! empty table (the new event would match nothing) nor dropped as a job of a deleted
//! subscription.
//!
//! Once the new event is in the inbox, the test waits for whichever comes first: the restarted
//! hub reporting its loops held (`streaming_hub_hub_loops_waiting_for_subscriptions`), or the
//! hub having processed an event (what a hub without the gate does). Only the first passes.
mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::*;
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use serde_json::json;

/// Event ids in arrival order; an id in `fail_once` gets a 503 the first time it arrives.
#[derive(Clone, Default)]
struct Sink {
    got: Arc<Mutex<Vec<String>>>,
    fail_once: Arc<Mutex<BTreeSet<String>>>,
}

async fn hook(State(s): State<Sink>, headers: HeaderMap, body: Bytes) -> (StatusCode, Bytes) {
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    if h("x-lerian-event-type") == "streaming_hub.verification" {
        return (StatusCode::OK, body);
    }
    let id = h("x-lerian-event-id");
    s.got.lock().unwrap().push(id.clone());
    if s.fail_once.lock().unwrap().remove(&id) {
        return (StatusCode::SERVICE_UNAVAILABLE, Bytes::new());
    }
    (StatusCode::OK, Bytes::new())
}

impl Sink {
    fn count(&self, id: &str) -> usize {
        self.got.lock().unwrap().iter().filter(|g| *g == id).count()
    }
}

async fn metric(http: &reqwest::Client, hub: &Hub, name: &str) -> Option<u64> {
    Some(metric_sum(&hub.metrics_text(http).await.ok()?, name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_hub_waits_for_its_subscription_table_before_matching_or_claiming() {
    use_cluster();
    let md = admin()
        .inner()
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    let nodes: Vec<i32> = md.brokers().iter().map(|b| b.id()).collect();
    assert_eq!(
        nodes.len(),
        3,
        "the 3-broker cluster is not whole: {nodes:?}"
    );
    let victim = *nodes.iter().max().unwrap();

    let prefix = unique("catchup");
    let topic = format!("lerian.streaming.{prefix}");
    let source =
        NewTopic::new(&topic, 1, TopicReplication::Fixed(3)).set("min.insync.replicas", "2");
    // The control topic before the hub creates it: one replica, on the broker to be stopped.
    let control = format!("{prefix}.subscriptions");
    let assignment: &[&[i32]] = &[&[victim]];
    let control_topic = NewTopic::new(&control, 1, TopicReplication::Variable(assignment))
        .set("cleanup.policy", "compact");
    for r in admin()
        .create_topics(&[source, control_topic], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }

    let sink = Sink::default();
    let app = Router::new()
        .route("/hook", post(hook))
        .with_state(sink.clone());
    let url = format!("http://{}/hook", serve(app).await);

    let mut env = api_hub_env(&prefix, &topic);
    env.insert("STREAMING_HUB_REPLICATION_FACTOR".into(), "3".into());
    env.insert("STREAMING_HUB_HTTP_TIMEOUT".into(), "5s".into());
    let mut hub = Hub::start(&env);
    let http = hub_http();
    let token = streaming_hub::api::mint(
        &streaming_hub::runtime::secret::Secret::new(JWT),
        Some("t1"),
        false,
        Duration::from_secs(86_400),
    );
    let body = json!({"event_types": ["transaction.*"], "retry_schedule": ["1s", "1s", "1s"],
                      "destination": {"type": "webhook", "url": url}});
    post_subscription(&http, &hub.addr(), &token, &body).await;

    // A delivery that works, then one whose first attempt fails: its retry is due in the store
    // when the hub dies.
    let p = producer();
    let first = event("t1", "ledger", "transaction", "created");
    produce(&p, &topic, std::slice::from_ref(&first));
    wait_until(Duration::from_secs(60), "the first delivery", || {
        (sink.count(&first.id()) == 1).then_some(())
    });
    let retried = event("t1", "ledger", "transaction", "created");
    sink.fail_once.lock().unwrap().insert(retried.id());
    produce(&p, &topic, std::slice::from_ref(&retried));
    wait_until(Duration::from_secs(60), "the failed first attempt", || {
        (sink.count(&retried.id()) == 1).then_some(())
    });
    hub.kill();

    // The control topic's only broker goes down; the hub restarts and a new event comes in.
    let down = BrokerDown::kill(victim);
    let hub = Hub::spawn(&env);
    let fresh = event("t1", "ledger", "transaction", "created");
    produce(&p, &topic, std::slice::from_ref(&fresh));
    // Ingest goes on while the hub waits: the new event is committed to the inbox, where a hub
    // loop without the gate would take it at once.
    let inbox = format!("{prefix}.inbox");
    let want = fresh.id();
    tokio::task::spawn_blocking(move || {
        read_until(&[&inbox], Duration::from_secs(180), |got| {
            got.iter().any(|g| g.rec.id() == want)
        })
    })
    .await
    .unwrap();
    let held = {
        let mut outcome = None;
        for _ in 0..3000 {
            let waiting = metric(
                &http,
                &hub,
                "streaming_hub_hub_loops_waiting_for_subscriptions",
            )
            .await
            .unwrap_or(0);
            let processed = metric(&http, &hub, "streaming_hub_hub_events_total")
                .await
                .unwrap_or(0);
            if processed > 0 {
                outcome = Some(false);
                break;
            }
            if waiting > 0 {
                outcome = Some(true);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        outcome.expect("the restarted hub neither held its loops nor processed the new event")
    };
    assert!(
        held,
        "the hub processed events before its subscription table had caught up"
    );
    assert_eq!(sink.count(&fresh.id()), 0);
    assert_eq!(sink.count(&retried.id()), 1);

    // The broker returns: the table catches up and both deliveries are made.
    down.restart();
    wait_until(
        Duration::from_secs(120),
        "the new event and the retried one delivered after the catch-up",
        || (sink.count(&fresh.id()) >= 1 && sink.count(&retried.id()) >= 2).then_some(()),
    );
    assert_eq!(
        metric(
            &http,
            &hub,
            "streaming_hub_hub_loops_waiting_for_subscriptions"
        )
        .await,
        Some(0)
    );
    drop(hub);
}
