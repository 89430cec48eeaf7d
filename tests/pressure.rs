//! Limits under pressure, through the real binary and broker: destinations that answer with a
//! 1 GiB body, trickle one byte per second, send headers and never finish, or never answer at all
//! hold at most `STREAMING_HUB_DISPATCH_WORKERS` requests at once, cost no more than the response
//! cap in memory, and do not stop another tenant's deliveries; 10,000 subscriptions on one tenant
//! fan one event out to every one of them with bounded memory. Each test prints its figures as
//! one JSON line.
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::*;
use serde_json::json;
use streaming_hub::runtime::avro::{Codec, RecordKind};
use streaming_hub::runtime::records::AttemptRecord;

const WORKERS: usize = 8;
const MIB: u64 = 1024 * 1024;

/// The hub process's peak resident memory (VmHWM), in MiB.
fn peak_rss_mib(hub: &Hub) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", hub.child.id())).unwrap();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    kb / 1024
}

/// Requests being answered right now, across every hostile sink, and the most at once.
#[derive(Clone, Default)]
struct Pressure {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    /// Bytes of the 1 GiB body actually handed to the connection.
    huge_sent: Arc<AtomicU64>,
    /// Requests per behaviour.
    requests: Arc<Mutex<BTreeMap<String, usize>>>,
}

/// Held for as long as a request is being answered (moved into its body stream).
struct InFlight(Pressure);

impl InFlight {
    fn new(p: &Pressure) -> InFlight {
        let n = p.now.fetch_add(1, Ordering::SeqCst) + 1;
        p.most.fetch_max(n, Ordering::SeqCst);
        InFlight(p.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn hostile(
    State(p): State<Pressure>,
    Path(kind): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if headers
        .get("x-lerian-event-type")
        .is_some_and(|v| v == "streaming_hub.verification")
    {
        return (StatusCode::OK, body).into_response(); // pass the probe
    }
    *p.requests.lock().unwrap().entry(kind.clone()).or_default() += 1;
    let guard = InFlight::new(&p);
    match kind.as_str() {
        "huge" => {
            // 1 GiB in 64 KiB chunks, made as they are read.
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let stream = futures::stream::unfold((0u64, guard), move |(sent, g)| {
                let chunk = chunk.clone();
                async move {
                    if sent >= 1024 * MIB {
                        return None;
                    }
                    g.0.huge_sent
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    Some((
                        Ok::<_, std::io::Error>(chunk.clone()),
                        (sent + chunk.len() as u64, g),
                    ))
                }
            });
            (StatusCode::OK, Body::from_stream(stream)).into_response()
        }
        "trickle" => {
            let stream = futures::stream::unfold(guard, |g| async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Some((Ok::<_, std::io::Error>(Bytes::from_static(b".")), g))
            });
            (StatusCode::OK, Body::from_stream(stream)).into_response()
        }
        "endless" => {
            // Headers, then a body that never ends and never sends a byte.
            let stream = futures::stream::unfold(guard, |g| async move {
                std::future::pending::<()>().await;
                Some((Ok::<_, std::io::Error>(Bytes::new()), g))
            });
            (StatusCode::OK, Body::from_stream(stream)).into_response()
        }
        _ => {
            // "silent": never answers at all.
            let _g = guard;
            std::future::pending::<()>().await;
            unreachable!()
        }
    }
}

/// A sink that answers 200 at once and counts requests per path.
async fn counting_sink() -> (std::net::SocketAddr, Arc<Mutex<BTreeMap<String, usize>>>) {
    let seen: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let s = seen.clone();
    let app = Router::new().route(
        "/ok/{name}",
        post(
            move |Path(name): Path<String>, headers: HeaderMap, body: Bytes| {
                let s = s.clone();
                async move {
                    if headers
                        .get("x-lerian-event-type")
                        .is_some_and(|v| v == "streaming_hub.verification")
                    {
                        return (StatusCode::OK, body);
                    }
                    *s.lock().unwrap().entry(name).or_default() += 1;
                    (StatusCode::OK, Bytes::new())
                }
            },
        ),
    );
    (serve(app).await, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_sinks_hold_at_most_the_workers_and_memory_stays_bounded() {
    let s = ApiHub::start(
        "press",
        &[
            ("STREAMING_HUB_HTTP_TIMEOUT", "2s"),
            ("STREAMING_HUB_DISPATCH_WORKERS", "8"),
        ],
    )
    .await;
    let pressure = Pressure::default();
    let app = Router::new()
        .route("/h/{kind}", post(hostile))
        .with_state(pressure.clone());
    let (calm_addr, calm_seen) = counting_sink().await;
    let kinds = ["huge", "trickle", "endless", "silent"];
    let mut sub_kind = BTreeMap::new();
    for kind in kinds {
        // One server per behaviour: each is its own destination (and breaker).
        let addr = serve(app.clone()).await;
        let v = s
            .create_subscription(
                "press",
                json!({"event_types": ["transaction.*"], "retry_schedule": ["1s", "1s"],
                       "destination": {"type": "webhook", "url": format!("http://{addr}/h/{kind}")}}),
            )
            .await;
        sub_kind.insert(v["id"].as_str().unwrap().to_string(), kind);
    }
    s.create_subscription(
        "calm",
        json!({"event_types": ["transaction.*"],
               "destination": {"type": "webhook", "url": format!("http://{calm_addr}/ok/calm")}}),
    )
    .await;

    const EVENTS: usize = 20;
    let mut recs = Vec::new();
    for _ in 0..EVENTS {
        recs.push(event("press", "ledger", "transaction", "created"));
        recs.push(event("calm", "ledger", "transaction", "created"));
    }
    produce(&producer(), &s.topic, &recs);

    // The calm tenant gets everything while the hostile sinks hold what they can; meanwhile the
    // hub's own count of attempts holding a worker is sampled (until the calm tenant has all
    // and a sample saw the hostile sinks holding workers: the calm deliveries can all land
    // before the first hostile attempt starts).
    let mut busiest = 0u64;
    let mut tries = 0;
    while calm_seen.lock().unwrap().get("calm").copied().unwrap_or(0) < EVENTS || busiest == 0 {
        busiest = busiest.max(s.metric("streaming_hub_attempts_executing").await);
        tries += 1;
        assert!(
            tries < 6000,
            "the calm tenant's deliveries never all arrived, or no attempt was seen holding a \
             worker (busiest {busiest})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every hostile behaviour has had an attempt whose outcome is recorded: the worker came back.
    let codec = Codec::new().unwrap();
    let attempts_topic = format!("{}.attempts", s.prefix);
    let outcomes = read_until(&[&attempts_topic], Duration::from_secs(120), |got| {
        let kinds_done: std::collections::BTreeSet<&str> = got
            .iter()
            .filter_map(|g| {
                let a: AttemptRecord = codec
                    .decode(RecordKind::Attempt, g.rec.value.as_ref()?)
                    .ok()?;
                sub_kind.get(&a.subscription_id).copied()
            })
            .collect();
        kinds_done.len() == kinds.len()
    });
    let mut by_kind: BTreeMap<&str, Vec<AttemptRecord>> = BTreeMap::new();
    for g in &outcomes {
        let a: AttemptRecord = codec
            .decode(RecordKind::Attempt, g.rec.value.as_ref().unwrap())
            .unwrap();
        if let Some(kind) = sub_kind.get(&a.subscription_id) {
            by_kind.entry(kind).or_default().push(a);
        }
    }
    // The 1 GiB answer is a 200 (success) read only up to the response cap.
    assert!(
        by_kind["huge"].iter().all(|a| a.status == Some(200)),
        "{:?}",
        by_kind["huge"]
    );
    let huge_requests = pressure.requests.lock().unwrap()["huge"] as u64;
    let huge_sent = pressure.huge_sent.load(Ordering::Relaxed);
    assert!(
        huge_sent < huge_requests * 64 * MIB,
        "{huge_sent} bytes of the 1 GiB body sent for {huge_requests} requests: the hub kept reading"
    );
    // A 200 whose body never ends is a success decided by its status line; its body is read
    // until the timeout, and the worker comes back (the attempt is recorded at all).
    for kind in ["trickle", "endless"] {
        assert!(
            by_kind[kind].iter().all(|a| a.status == Some(200)),
            "{kind}: {:?}",
            by_kind[kind]
        );
    }
    for a in &by_kind["silent"] {
        assert_eq!(
            a.status, None,
            "silent: a request never answered has no status"
        );
        assert_eq!(a.error_kind.as_deref(), Some("timeout"), "silent: {a:?}");
    }
    assert!(
        busiest > 0 && busiest <= WORKERS as u64,
        "{busiest} attempts holding a worker at once with {WORKERS} workers"
    );
    // Seen from the sinks, a request counts until the server notices the hub hung up, so this
    // figure may exceed the workers by the requests being torn down; it is reported, not checked.
    let most = pressure.most.load(Ordering::SeqCst);
    let rss = peak_rss_mib(&s.hub);
    assert!(rss < 512, "peak RSS {rss} MiB");
    assert!(!s.hub.log_text().contains("panicked"), "a panic in the log");
    report(
        &json!({"scenario": "hostile-sinks", "hostile_requests": *pressure.requests.lock().unwrap(),
               "most_at_once_seen_by_sinks": most, "most_executing_seen_by_hub": busiest, "workers": WORKERS, "huge_bytes_sent": huge_sent,
               "calm_delivered": EVENTS, "peak_rss_mib": rss}),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_subscriptions_on_one_tenant_each_get_the_event() {
    require_broker();
    const SUBS: usize = 10_000;
    let prefix = unique("wide");
    let topic = format!("lerian.streaming.{prefix}");
    create_topic(&topic, 1).await;
    let env = api_hub_env(&prefix, &topic);
    let hub = Hub::start(&env);
    let (addr, seen) = counting_sink().await;

    // Written by `streaming-hub subscriptions apply` (probes run concurrently).
    let file: Vec<serde_json::Value> = (0..SUBS)
        .map(|i| {
            json!({"id": uuid::Uuid::now_v7().to_string(), "tenant_id": "wide",
                   "event_types": ["transaction.*"],
                   "destination": {"type": "webhook", "url": format!("http://{addr}/ok/{i}")}})
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("subs.json");
    std::fs::write(&path, serde_json::to_vec(&file).unwrap()).unwrap();
    let t0 = Instant::now();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
        .args(["subscriptions", "apply", "-f", path.to_str().unwrap()])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(&env)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let apply_s = t0.elapsed().as_secs_f64();
    let http = hub_http();
    let base = format!("http://{}", hub.addr());
    // The running hub has every one (its table follows the control topic) before the event.
    let token = streaming_hub::api::mint(
        &streaming_hub::runtime::secret::Secret::new(JWT),
        Some("wide"),
        false,
        Duration::from_secs(3600),
    );
    let last = file[SUBS - 1]["id"].as_str().unwrap().to_string();
    let mut tries = 0;
    while http
        .get(format!("{base}/v1/subscriptions/{last}"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .status()
        != 200
    {
        tries += 1;
        assert!(tries < 1200, "the hub never applied the last subscription");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let t1 = Instant::now();
    produce(
        &producer(),
        &topic,
        &[event("wide", "ledger", "transaction", "created")],
    );
    wait_until(Duration::from_secs(300), "10,000 deliveries", || {
        (seen.lock().unwrap().len() == SUBS).then_some(())
    });
    let fanout_s = t1.elapsed().as_secs_f64();
    let counts = seen.lock().unwrap().clone();
    assert!(
        counts.values().all(|n| *n == 1),
        "each subscription once (no sink fails)"
    );
    let rss = peak_rss_mib(&hub);
    assert!(rss < 512, "peak RSS {rss} MiB");
    report(
        &json!({"scenario": "10k-subscriptions", "subscriptions": SUBS, "apply_s": apply_s,
               "fanout_s": fanout_s, "peak_rss_mib": rss}),
    );
}
