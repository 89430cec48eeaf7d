//! `streaming-hub load <scenario>`: the end-to-end load harness (issue 8).
//!
//! One run starts the real hub binary (`streaming-hub run`, release build, its own topic prefix),
//! a local HTTP/1.1 keep-alive sink on 127.0.0.1 that verifies every Standard Webhooks signature
//! and records receive times, creates the subscriptions through the API, produces CloudEvents to
//! `lerian.streaming.<run>` (UUIDv7 ids, the platform's headers, JSON payloads carrying their
//! produce time, records keyed by tenant), and then checks that every expected delivery arrived
//! (no loss) and counts duplicates. Latency = sink receive time − produce time, in an HDR
//! histogram. Each run prints one JSON line (also appended to `<out>/results.jsonl`) and a table
//! row; `all` runs every scenario, measures the machine's limits beside them (raw Kafka
//! produce→consume and the sink's request rate with the same clients) and draws
//! `<out>/latency.png` (percentiles against rate).
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use hdrhistogram::Histogram;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use serde_json::json;

use crate::config::Config;
use crate::delivery::signing;
use crate::runtime::kafka;
use crate::runtime::secret::Secret;

/// Harness options (the command line).
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub scenario: String,
    /// Measured time of each run (after the warm-up).
    pub duration: Duration,
    pub warmup: Duration,
    /// Unmeasured throughput runs first, for at least this long (0: none).
    pub warm_broker: Duration,
    /// Payload bytes.
    pub size: usize,
    /// Where results.jsonl, latency.png and each run's metrics-*.prom (the hub's /metrics) go.
    pub out: PathBuf,
    /// Leave each run's topics on the broker (by default they are deleted after a run that
    /// missed nothing; a run that missed deliveries always leaves them, for tracing).
    pub keep_topics: bool,
}

/// One run's shape.
#[derive(Debug, Clone)]
struct Spec {
    name: String,
    /// Events per second; None = as fast as the producer can (throughput).
    rate: Option<u32>,
    tenants: usize,
    subs_per_tenant: usize,
    /// Tenants (the first N) whose sink answers 500 to everything.
    failing_tenants: usize,
    /// Tenants (the N after the failing ones) whose sink holds each delivery `slow_delay`, then
    /// answers 200.
    slow_tenants: usize,
    slow_delay: Duration,
    sink_delay: Duration,
    /// The share (percent) of events whose first delivery to each subscription the sink
    /// answers 500; the hub's retry (5 s on its curve, full jitter) must then bring it.
    refuse_first_percent: u8,
    workers: Option<usize>,
    /// SIGKILL the hub this long into the measured window, then restart it.
    kill_after: Option<Duration>,
    /// Start a second instance of the hub this long into the measured window (it takes half
    /// of the partitions in a rebalance); the run then also waits out the attempts' leases, so
    /// a delivery sent again by the new owner is counted as a duplicate.
    scale_out_after: Option<Duration>,
    /// Events to produce when `rate` is None.
    events: usize,
}

/// What one run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunResult {
    pub scenario: String,
    pub target_rate: Option<u32>,
    /// At a fixed rate, the events the producer got to the broker per second of the measured
    /// window (a run that fell short says so on stderr).
    pub achieved_rate: Option<f64>,
    pub events: u64,
    pub expected_deliveries: u64,
    pub delivered: u64,
    pub missing: u64,
    /// Deliveries of an event to a subscription it was not for (never counted as delivered).
    pub unexpected: u64,
    pub duplicates: u64,
    pub bad_signatures: u64,
    /// First deliveries the sink answered 500 on purpose (`flaky=<percent>`), each expected again.
    pub sink_refused: Option<u64>,
    pub deliveries_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub healthy_p99_ms: Option<f64>,
    pub hub_cpu_s_per_1k: f64,
    /// The harness's own CPU (the sink, the load producer) per 1,000 deliveries: it shares the
    /// machine with the hub, so what it takes the hub cannot have.
    pub harness_cpu_s_per_1k: f64,
    /// The broker's CPU per 1,000 deliveries, when it is `scripts/kafka.sh`'s single broker.
    pub broker_cpu_s_per_1k: Option<f64>,
    pub hub_peak_rss_mib: u64,
    pub kafka_bytes_per_delivery: Option<f64>,
    /// The same, per topic of the hub (name after the prefix); its values sum to the above.
    pub kafka_bytes_per_delivery_by_topic: Option<BTreeMap<String, f64>>,
    pub recovery_s: Option<f64>,
    /// The longest time one healthy tenant went without a delivery between its first and its
    /// last one (ms): a tenant, or a whole inbox partition's tenants, left waiting while the
    /// others were served shows here (session 17: 5.6-7.5 s in `throughput` before the fetch
    /// size, 24 s for jobs stranded until a lease).
    pub longest_tenant_wait_ms: Option<f64>,
    /// Seconds of unmeasured throughput runs on the broker before this run's scenarios
    /// (`--warm-broker`; 0 = the broker as the run found it).
    pub broker_warmed_s: f64,
    /// Claimed attempts the hub handed back unsent, having waited for a worker until too little
    /// of their lease was left (`streaming_hub_attempts_unsent_total` as the run left it): each
    /// is a claim, and its transaction, spent for nothing.
    pub attempts_unsent: Option<u64>,
}

/// The sink: verifies signatures, records (event, subscription, latency).
#[derive(Clone, Default)]
struct Sink {
    secrets: Arc<Mutex<HashMap<String, Secret>>>,
    got: Arc<Mutex<Vec<Got>>>,
    /// The distinct (event, subscription) pairs in `got`: what the wait for stragglers counts,
    /// so a duplicate never stands in for a delivery still on its way.
    unique: Arc<Mutex<std::collections::HashSet<(String, String)>>>,
    failing: Arc<Mutex<std::collections::HashSet<String>>>,
    delay: Duration,
    slow: Arc<Mutex<std::collections::HashSet<String>>>,
    slow_delay: Duration,
    /// The payload size the producer writes: each body must be exactly what it wrote.
    size: usize,
    bad: Arc<AtomicU64>,
    /// Percent of events whose first delivery to a subscription is answered 500.
    refuse_first_percent: u8,
    /// The (event, subscription) pairs refused so far: each is refused once.
    refused: Arc<Mutex<std::collections::HashSet<(String, String)>>>,
}

/// The most `flaky=<percent>` refuses. Past a few percent a tenant's receiver fails 5 deliveries
/// in a row now and then, and its breaker sheds it for 30 s, then longer each time its probe is
/// refused too: the run waits that out (see `run_one`), but a receiver failing most first
/// deliveries measures the breaker, not the retry.
const FLAKY_MAX_PERCENT: u8 = 20;

/// Whether an event is one of the `percent` in 100 whose first delivery the sink refuses:
/// a hash of its id (FNV-1a), so the choice is the same at every attempt and spread evenly.
fn refused_first(event: &str, percent: u8) -> bool {
    let hash = event.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    hash % 100 < u64::from(percent)
}

#[derive(Clone)]
struct Got {
    event: String,
    sub: String,
    received_us: i64,
    produced_us: i64,
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

async fn sink_handler(
    State(s): State<Sink>,
    Path((tenant, n)): Path<(String, u32)>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Bytes) {
    let received_us = now_us();
    let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("");
    if h("x-lerian-event-type") == "streaming_hub.verification" {
        return (StatusCode::OK, body); // echoes the challenge
    }
    let path = format!("{tenant}/{n}");
    let secret = s.secrets.lock().unwrap().get(&path).cloned();
    let ts: i64 = h("webhook-timestamp").parse().unwrap_or(0);
    let ok = secret.is_some_and(|secret| {
        signing::sign(&secret, h("webhook-id"), ts, &body)
            .is_ok_and(|want| h("webhook-signature").split(' ').any(|sig| sig == want))
    });
    // The event is named by the signed `webhook-id`; `X-Lerian-Event-Id` must say the same
    // (DESIGN.md §4), or a delivery could be counted for an event it does not carry. The body
    // must be the producer's, byte for byte (signed, a garbled one would still verify), and the
    // timestamp within the 5 minutes receivers allow (Standard Webhooks).
    let event = h("webhook-id");
    let produced_us = produced_at(&body);
    let as_produced = produced_us > 0 && body[..] == payload(s.size, produced_us, event)[..];
    let fresh = (received_us / 1_000_000).abs_diff(ts) <= SIGNATURE_TOLERANCE_S;
    if !ok || !fresh || !as_produced || h("x-lerian-event-id") != event {
        s.bad.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::UNAUTHORIZED, Bytes::new());
    }
    if !s.delay.is_zero() {
        tokio::time::sleep(s.delay).await;
    }
    if s.slow.lock().unwrap().contains(&tenant) {
        tokio::time::sleep(s.slow_delay).await;
    }
    if s.failing.lock().unwrap().contains(&tenant) {
        return (StatusCode::INTERNAL_SERVER_ERROR, Bytes::new());
    }
    if refused_first(event, s.refuse_first_percent)
        && s.refused
            .lock()
            .unwrap()
            .insert((event.to_string(), path.clone()))
    {
        return (StatusCode::INTERNAL_SERVER_ERROR, Bytes::new());
    }
    s.unique
        .lock()
        .unwrap()
        .insert((event.to_string(), path.clone()));
    s.got.lock().unwrap().push(Got {
        event: event.to_string(),
        sub: path,
        received_us,
        produced_us,
    });
    (StatusCode::OK, Bytes::new())
}

/// How far a delivery's `webhook-timestamp` may be from the sink's clock (Standard Webhooks'
/// default tolerance).
const SIGNATURE_TOLERANCE_S: u64 = 300;

/// The produce time the payload starts with: `{"produced_us":<n>,`. At a fixed rate it is the
/// time the event was due on the producer's schedule, not when the producer got to it: a
/// producer that fell behind (descheduled, or waiting on a full queue) would otherwise hide the
/// wait from the latency (coordinated omission).
fn produced_at(body: &[u8]) -> i64 {
    let text = std::str::from_utf8(&body[..body.len().min(40)]).unwrap_or("");
    text.strip_prefix("{\"produced_us\":")
        .and_then(|t| t.split(',').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}

/// An event's payload: when it was due, its own id (so a body sent under another event's id
/// does not pass as this one's), padded to `size` bytes.
fn payload(size: usize, produced_us: i64, id: &str) -> Vec<u8> {
    let head =
        format!("{{\"produced_us\":{produced_us},\"id\":\"{id}\",\"amount\":\"100.00\",\"pad\":\"");
    let mut v = head.into_bytes();
    if v.len() + 2 < size {
        v.resize(size - 2, b'x');
    }
    v.extend_from_slice(b"\"}");
    v
}

/// A free port on 127.0.0.1 for a server started later by another process (a hub, a sink).
///
/// Ports come in turn from the 2,500 just below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`). A port from `bind(0)` was released when this
/// returned it, and the kernel could hand it again before the server bound it: to another
/// `bind(0)` listener or as an outgoing connection's local port (every Kafka connection takes
/// one). Then the server failed to bind while whatever held the port answered in its place.
/// The kernel gives out neither below that range, and this process's turns never repeat a
/// port until it wraps. A port in use now is skipped; one process's pid picks where it starts.
pub fn free_port() -> u16 {
    static TURN: AtomicU64 = AtomicU64::new(0);
    const SPAN: u64 = 2_500;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .filter(|low| *low > SPAN + 1024 && *low <= u64::from(u16::MAX));
    if let Some(low) = ephemeral_low {
        let start = u64::from(std::process::id()) % SPAN;
        for _ in 0..SPAN {
            let port = (low - SPAN + (start + TURN.fetch_add(1, Ordering::Relaxed)) % SPAN) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18080)
}

/// CPU seconds (user + system) of a process.
fn cpu_seconds(pid: u32) -> f64 {
    crate::bench::cpu_seconds(&pid.to_string())
}

fn peak_rss_mib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        / 1024
}

/// Bytes on the broker's disk per topic of `prefix` (write amplification), keyed by the topic's
/// name after the prefix (`hub.jobs.changelog`, `attempts`, …). Their growth over a run is a lower
/// bound of what was written: the log cleaner may compact a changelog's rolled segments meanwhile,
/// and the broker's own transaction and offsets topics are not counted.
fn kafka_bytes(data_dir: &std::path::Path, prefix: &str) -> Option<BTreeMap<String, u64>> {
    let mut by_topic = BTreeMap::new();
    for e in std::fs::read_dir(data_dir).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // A partition's directory is `<topic>-<partition>`.
        let Some(topic) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('.'))
            .and_then(|rest| rest.rsplit_once('-'))
            .map(|(topic, _)| topic.to_string())
        else {
            continue;
        };
        let mut bytes = 0;
        for f in std::fs::read_dir(e.path()).ok()?.flatten() {
            if f.file_name().to_string_lossy().ends_with(".log") {
                bytes += f.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        *by_topic.entry(topic).or_insert(0) += bytes;
    }
    Some(by_topic)
}

struct HubProcess {
    child: Child,
    env: Vec<(String, String)>,
    addr: String,
}

impl HubProcess {
    fn start(env: &[(String, String)], addr: &str) -> Result<HubProcess, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let log = std::fs::File::create(log_path(env)).map_err(|e| e.to_string())?;
        let child = Command::new(exe)
            .arg("run")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start hub: {e}"))?;
        let mut hub = HubProcess {
            child,
            env: env.to_vec(),
            addr: addr.to_string(),
        };
        hub.wait_ready()?;
        Ok(hub)
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "the hub exited ({status}); its log: {}",
                    log_path(&self.env).display()
                ));
            }
            if let Ok(mut s) = std::net::TcpStream::connect(&self.addr) {
                use std::io::Read;
                let _ = s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n");
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                if buf.starts_with("HTTP/1.0 200") {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("the hub did not become ready within 90 s".into())
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Where a hub the harness starts logs: `streaming-hub-load-hub.log` in the temporary
/// directory, `-<n>` before `.log` for the instance a `scale-out` run adds.
fn log_path(env: &[(String, String)]) -> std::path::PathBuf {
    let second = env
        .iter()
        .any(|(k, v)| k == "STREAMING_HUB_INSTANCE_ID" && v.ends_with("-2"));
    std::env::temp_dir().join(if second {
        "streaming-hub-load-hub-2.log"
    } else {
        "streaming-hub-load-hub.log"
    })
}

impl Drop for HubProcess {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Subscriptions per event in the `fanout` scenario (its tenants' events each match them all).
const FANOUT_SUBSCRIPTIONS: usize = 10;

/// The runs a scenario name stands for (and the broker's warm-up run), or why the name is wrong.
fn specs_of(scenario: &str, d: Duration) -> Result<(Vec<Spec>, Spec), String> {
    let at = |rate: u32| Spec {
        name: "latency".into(),
        rate: Some(rate),
        tenants: 100,
        subs_per_tenant: 1,
        failing_tenants: 0,
        slow_tenants: 0,
        slow_delay: Duration::ZERO,
        sink_delay: Duration::ZERO,
        refuse_first_percent: 0,
        workers: None,
        kill_after: None,
        scale_out_after: None,
        events: 0,
    };
    let throughput = Spec {
        name: "throughput".into(),
        rate: None,
        events: 200_000,
        ..at(0)
    };
    let warm_up = Spec {
        name: "broker-warm-up".into(),
        events: 100_000,
        ..throughput.clone()
    };
    let fanout = Spec {
        name: "fanout".into(),
        rate: None,
        tenants: 10,
        subs_per_tenant: FANOUT_SUBSCRIPTIONS,
        events: 20_000,
        ..at(0)
    };
    // Every delivery held 50 ms at the sink, 20,000 events as fast as the producer can: what
    // the workers can deliver (64 by default: at most 1,280/s at 50 ms each; 256: 5,120/s).
    let slow = |workers: Option<usize>| Spec {
        name: format!(
            "slow-sink-{}",
            workers.map_or("default".into(), |w| w.to_string())
        ),
        rate: None,
        events: 20_000,
        sink_delay: Duration::from_millis(50),
        workers,
        ..at(0)
    };
    let noisy = Spec {
        name: "noisy-neighbour".into(),
        failing_tenants: 1,
        ..at(1000)
    };
    // One tenant's sink answers, but only after 10 s (under the 15 s timeout: no failure, no
    // breaker), while 99 others are healthy: its backlog must not take the workers from them.
    let slow_neighbour = Spec {
        name: "slow-neighbour".into(),
        slow_tenants: 1,
        slow_delay: Duration::from_secs(10),
        ..at(1000)
    };
    let recovery = Spec {
        name: "recovery".into(),
        kill_after: Some(d / 3),
        ..at(1000)
    };
    // A receiver that fails now and then: `percent` of the events' first deliveries are
    // answered 500, and each must arrive at its retry (5 s on the hub's curve, full jitter), once.
    let flaky = |percent: u8| Spec {
        name: format!("flaky-{percent}pct"),
        refuse_first_percent: percent,
        ..at(1000)
    };
    // More events than the sinks can take: 100 tenants at 100 events/s in all, each delivery
    // held `ms` at the sink, so the default 64 workers keep up only with sinks faster than
    // 640 ms. A backlog builds, and claims must not run so far ahead of the workers that they
    // wait out their lease (`attempts_unsent`).
    let backlog = |delay_ms: u64| Spec {
        name: format!("backlog-{delay_ms}ms"),
        sink_delay: Duration::from_millis(delay_ms),
        ..at(100)
    };
    // Not in `all`: it adds the attempts' lease (25 s by default) to its run. The sink takes
    // 50 ms, as a real receiver might: attempts then outlast their transaction's early wait
    // (`STREAMING_HUB_EARLY_ATTEMPT_WAIT`, 20 ms) and are in flight across the rebalance.
    let scale_out = Spec {
        name: "scale-out".into(),
        scale_out_after: Some(d / 3),
        sink_delay: Duration::from_millis(50),
        ..at(1000)
    };
    let specs: Vec<Spec> = match scenario {
        "throughput" => vec![throughput],
        "latency" => vec![at(1000), at(5000), at(10_000)],
        "fanout" => vec![fanout],
        "slow-sink" => vec![slow(None), slow(Some(256))],
        "noisy-neighbour" => vec![noisy],
        "slow-neighbour" => vec![slow_neighbour],
        // The others' sinks taking `ms` as well (the slow one's 10 s then hold fewer workers).
        one if one.starts_with("slow-neighbour=") => {
            match one["slow-neighbour=".len()..].parse::<u64>() {
                Ok(ms) => vec![Spec {
                    name: format!("slow-neighbour-{ms}ms"),
                    sink_delay: Duration::from_millis(ms),
                    ..slow_neighbour
                }],
                _ => {
                    return Err(format!(
                        "bad scenario {one:?}: slow-neighbour=<the other sinks' delay in ms>"
                    ));
                }
            }
        }
        "recovery" => vec![recovery],
        "scale-out" => vec![scale_out],
        "limits" => vec![],
        one if one.starts_with("flaky=") => match one["flaky=".len()..].parse::<u8>() {
            Ok(percent) if (1..=FLAKY_MAX_PERCENT).contains(&percent) => vec![flaky(percent)],
            _ => {
                return Err(format!(
                    "bad scenario {one:?}: flaky=<percent of first deliveries refused, 1-{FLAKY_MAX_PERCENT}>, e.g. flaky=10"
                ));
            }
        },
        one if one.starts_with("backlog=") => match one["backlog=".len()..].parse::<u64>() {
            Ok(ms) if ms > 0 => vec![backlog(ms)],
            _ => {
                return Err(format!(
                    "bad scenario {one:?}: backlog=<sink delay in ms>, e.g. backlog=1000"
                ));
            }
        },
        // One rate of the latency curve, for A/B runs of a setting at that rate.
        one if one.starts_with("latency=") => match one["latency=".len()..].parse::<u32>() {
            Ok(rate) if rate > 0 => vec![at(rate)],
            _ => {
                return Err(format!(
                    "bad scenario {one:?}: latency=<events per second>, e.g. latency=5000"
                ));
            }
        },
        "all" => vec![
            throughput,
            at(1000),
            at(5000),
            at(10_000),
            fanout,
            slow(None),
            slow(Some(256)),
            noisy,
            recovery,
        ],
        other => {
            return Err(format!(
                "unknown scenario {other:?}: throughput, latency, latency=<rate>, fanout, slow-sink, backlog=<ms>, flaky=<percent>, noisy-neighbour, slow-neighbour[=<ms>], recovery, scale-out, limits or all"
            ));
        }
    };
    Ok((specs, warm_up))
}

/// Runs the scenario(s) named in `opts`.
pub async fn run(config: &Config, opts: LoadOptions) -> Result<(), String> {
    let (specs, warm_up) = specs_of(&opts.scenario, opts.duration)?;
    std::fs::create_dir_all(&opts.out).map_err(|e| e.to_string())?;
    // The broker's JVM compiles its hot code during the first minutes of load: on this 2-core
    // machine a freshly started broker spent as much CPU compiling as serving (BENCHMARKS.md).
    let warming = Instant::now();
    let mut warm_runs = 0;
    while warming.elapsed() < opts.warm_broker {
        let r = run_one(config, &opts, &warm_up).await?;
        warm_runs += 1;
        println!(
            "broker warm-up run {warm_runs}: {} of {} delivered, {:.0}/s (not in results.jsonl)",
            r.delivered, r.expected_deliveries, r.deliveries_per_s
        );
    }
    let broker_warmed_s = if warm_runs > 0 {
        warming.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let mut results = Vec::new();
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>8} {:>9} {:>6} {:>8} {:>8}",
        "scenario",
        "rate",
        "events",
        "delivered",
        "miss",
        "dup",
        "deliv/s",
        "p50 ms",
        "p99 ms",
        "p99.9",
        "cpu/1k",
        "rss",
        "harn/1k",
        "brk/1k"
    );
    for spec in specs {
        let mut r = run_one(config, &opts, &spec).await?;
        r.broker_warmed_s = broker_warmed_s;
        println!(
            "{:<22} {:>7} {:>9} {:>9} {:>6} {:>5} {:>10.0} {:>8.1} {:>8.1} {:>8.1} {:>9.3} {:>6} {:>8.3} {:>8}",
            r.scenario,
            r.target_rate.map_or("max".into(), |r| r.to_string()),
            r.events,
            r.delivered,
            r.missing,
            r.duplicates,
            r.deliveries_per_s,
            r.p50_ms,
            r.p99_ms,
            r.p999_ms,
            r.hub_cpu_s_per_1k,
            r.hub_peak_rss_mib,
            r.harness_cpu_s_per_1k,
            r.broker_cpu_s_per_1k
                .map_or("-".into(), |c| format!("{c:.3}"))
        );
        let line = serde_json::to_string(&r).map_err(|e| e.to_string())?;
        eprintln!("{line}");
        append(&opts.out.join("results.jsonl"), &line)?;
        results.push(r);
    }
    if matches!(opts.scenario.as_str(), "limits" | "all") {
        let kafka = kafka_limit(config, opts.size, 300_000).await?;
        let sink = sink_limit(config, opts.size, Duration::from_secs(5)).await?;
        let ceiling_throughput = ceiling(kafka, sink, 1);
        let ceiling_fanout = ceiling(kafka, sink, FANOUT_SUBSCRIPTIONS as u32);
        let line = json!({"limits": {"kafka_produce_consume_records_per_s": kafka, "sink_requests_per_s": sink}, "ceiling_deliveries_per_s": {"throughput": ceiling_throughput, "fanout": ceiling_fanout}, "size": opts.size, "broker_warmed_s": broker_warmed_s}).to_string();
        println!("limits: Kafka produce→consume {kafka:.0} records/s; sink {sink:.0} requests/s");
        println!(
            "ceiling from these limits (two produce→consume trips per event, one request per delivery, nothing else): throughput {ceiling_throughput:.0}/s, fanout {ceiling_fanout:.0}/s"
        );
        for (scenario, ceiling) in [
            ("throughput", ceiling_throughput),
            ("fanout", ceiling_fanout),
        ] {
            if let Some(t) = results.iter().find(|r| r.scenario == scenario) {
                println!(
                    "{scenario}: {:.0}% of the lower limit, {:.0}% of its ceiling",
                    100.0 * t.deliveries_per_s / kafka.min(sink),
                    100.0 * t.deliveries_per_s / ceiling
                );
            }
        }
        append(&opts.out.join("results.jsonl"), &line)?;
    }
    let curve: Vec<&RunResult> = results.iter().filter(|r| r.scenario == "latency").collect();
    if curve.len() >= 2 {
        plot(&curve, &opts.out.join("latency.png"))?;
        println!("plot: {}", opts.out.join("latency.png").display());
    }
    Ok(())
}

fn append(path: &std::path::Path, line: &str) -> Result<(), String> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| e.to_string())?;
    writeln!(f, "{line}").map_err(|e| e.to_string())
}

async fn run_one(config: &Config, opts: &LoadOptions, spec: &Spec) -> Result<RunResult, String> {
    let id = uuid::Uuid::now_v7().simple().to_string()[20..].to_string();
    let prefix = format!("load{id}");
    let topic = format!("lerian.streaming.{prefix}");
    crate::bench::create_topic(config, &topic, 6).await?;

    // The sink.
    let sink = Sink {
        delay: spec.sink_delay,
        slow_delay: spec.slow_delay,
        size: opts.size,
        refuse_first_percent: spec.refuse_first_percent,
        ..Sink::default()
    };
    for t in 0..spec.failing_tenants {
        sink.failing.lock().unwrap().insert(format!("tenant-{t}"));
    }
    for t in spec.failing_tenants..spec.failing_tenants + spec.slow_tenants {
        sink.slow.lock().unwrap().insert(format!("tenant-{t}"));
    }
    let app = Router::new()
        .route("/hook/{tenant}/{n}", post(sink_handler))
        .with_state(sink.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let sink_addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    // The hub.
    let hub_addr = format!("127.0.0.1:{}", free_port());
    let jwt = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        rand::random::<[u8; 32]>(),
    );
    let kek = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        rand::random::<[u8; 32]>(),
    );
    let state_dir = std::env::temp_dir().join(&prefix);
    let mut env: Vec<(String, String)> = vec![
        (
            "STREAMING_HUB_KAFKA_BROKERS".into(),
            config.kafka_brokers.clone(),
        ),
        ("STREAMING_HUB_TOPIC_PREFIX".into(), prefix.clone()),
        ("STREAMING_HUB_GROUP_ID".into(), prefix.clone()),
        ("STREAMING_HUB_INSTANCE_ID".into(), prefix.clone()),
        (
            "STREAMING_HUB_FOLLOW_PATTERN".into(),
            format!("^{}$", topic.replace('.', r"\.")),
        ),
        ("STREAMING_HUB_HTTP_LISTEN_ADDR".into(), hub_addr.clone()),
        (
            "STREAMING_HUB_STATE_DIR".into(),
            state_dir.display().to_string(),
        ),
        (
            "STREAMING_HUB_TOPOLOGY_FILE".into(),
            std::fs::canonicalize(&config.topology_file)
                .map_err(|e| format!("{}: {e}", config.topology_file.display()))?
                .display()
                .to_string(),
        ),
        ("STREAMING_HUB_KEK".into(), kek),
        ("STREAMING_HUB_JWT_SECRET".into(), jwt.clone()),
        ("STREAMING_HUB_ALLOW_PRIVATE_SINKS".into(), "true".into()),
        ("STREAMING_HUB_ALLOW_INSECURE_SINKS".into(), "true".into()),
        ("STREAMING_HUB_SESSION_TIMEOUT".into(), "6s".into()),
        // The hub logs at warn unless `LOAD_HUB_LOG` says otherwise (what the default `info`,
        // a line per delivery attempt, costs: BENCHMARKS.md, session 23).
        (
            "STREAMING_HUB_LOG".into(),
            std::env::var("LOAD_HUB_LOG").unwrap_or_else(|_| "warn".into()),
        ),
    ];
    if let Some(w) = spec.workers {
        env.push(("STREAMING_HUB_DISPATCH_WORKERS".into(), w.to_string()));
    }
    // Experiments: any other STREAMING_HUB_* setting of the harness's environment reaches the hub.
    for (k, v) in std::env::vars() {
        if k.starts_with("STREAMING_HUB_") && !env.iter().any(|(e, _)| *e == k) {
            env.push((k, v));
        }
    }
    let mut hub = Some(HubProcess::start(&env, &hub_addr)?);

    // Subscriptions through the API (pooled connections idle less than its read timeout).
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    for t in 0..spec.tenants {
        let tenant = format!("tenant-{t}");
        let token = crate::api::mint(
            &Secret::new(jwt.clone()),
            Some(&tenant),
            false,
            Duration::from_secs(86_400),
        );
        for n in 0..spec.subs_per_tenant {
            let url = format!("http://{sink_addr}/hook/{tenant}/{n}");
            let r = http
                .post(format!("http://{hub_addr}/v1/subscriptions"))
                .bearer_auth(&token)
                .header("content-type", "application/json")
                .body(json!({"event_types": ["transaction.*"], "destination": {"type": "webhook", "url": url}}).to_string())
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let bytes = r.bytes().await.map_err(|e| e.to_string())?;
            let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
            // The answer carries the signing secret: only its id and state are shown.
            if v["verification_state"] != "active" {
                return Err(format!("subscription not active: {}", without_secret(&v)));
            }
            let secret = v["signing_secret"]
                .as_str()
                .ok_or_else(|| format!("subscription not created: {}", without_secret(&v)))?;
            sink.secrets
                .lock()
                .unwrap()
                .insert(format!("{tenant}/{n}"), Secret::new(secret));
        }
    }

    // Produce: warm-up, then the measured window.
    let data_dir = dirs_kafka_data();
    let bytes0 = data_dir.as_deref().and_then(|d| kafka_bytes(d, &prefix));
    let stop = Arc::new(AtomicBool::new(false));
    let produced: Arc<Mutex<Vec<(String, usize, i64)>>> = Arc::default();
    let mut cpu0 = hub.as_ref().map_or(0.0, |h| cpu_seconds(h.pid()));
    // What a hub killed in the run (`recovery`) used before it died: its CPU from the start of
    // the load and its peak memory, read just before the kill (its /proc entry goes with it).
    let (mut killed_cpu, mut killed_rss) = (0.0, 0);
    let broker = broker_pid(data_dir.as_deref());
    let harness_cpu0 = cpu_seconds(std::process::id());
    let broker_cpu0 = broker.map(cpu_seconds);
    let started = Instant::now();
    let producer = {
        let (config, topic, stop, produced, spec, size) = (
            config.clone(),
            topic.clone(),
            stop.clone(),
            produced.clone(),
            spec.clone(),
            opts.size,
        );
        std::thread::spawn(move || produce_loop(&config, &topic, &spec, size, &stop, &produced))
    };
    let measure_from = started + opts.warmup;
    let mut recovery_s = None;
    let mut second: Option<HubProcess> = None;
    if spec.rate.is_some() {
        {
            if let Some(after) = spec.kill_after {
                tokio::time::sleep(opts.warmup + after).await;
                if let Some(mut h) = hub.take() {
                    killed_cpu = cpu_seconds(h.pid()) - cpu0;
                    killed_rss = peak_rss_mib(h.pid());
                    cpu0 = 0.0; // the new process counts from its start
                    let _ = h.child.kill(); // SIGKILL
                    let _ = h.child.wait();
                    let env = std::mem::take(&mut h.env);
                    std::mem::forget(h);
                    let seen = sink.got.lock().unwrap().len();
                    let killed = Instant::now();
                    hub = Some(HubProcess::start(&env, &hub_addr)?);
                    while sink.got.lock().unwrap().len() == seen
                        && killed.elapsed() < Duration::from_secs(120)
                    {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    if sink.got.lock().unwrap().len() > seen {
                        recovery_s = Some(killed.elapsed().as_secs_f64());
                    } else {
                        eprintln!("load: no delivery within 120 s of the restart");
                    }
                }
                let left = (opts.warmup + opts.duration).saturating_sub(started.elapsed());
                tokio::time::sleep(left).await;
            } else if let Some(after) = spec.scale_out_after {
                tokio::time::sleep(opts.warmup + after).await;
                let addr2 = format!("127.0.0.1:{}", free_port());
                let mut env2 = env.clone();
                for (k, v) in env2.iter_mut() {
                    match k.as_str() {
                        "STREAMING_HUB_INSTANCE_ID" => *v = format!("{prefix}-2"),
                        "STREAMING_HUB_HTTP_LISTEN_ADDR" => v.clone_from(&addr2),
                        "STREAMING_HUB_STATE_DIR" => {
                            *v = format!("{}-2", state_dir.display());
                        }
                        _ => {}
                    }
                }
                second = Some(HubProcess::start(&env2, &addr2)?);
                let left = (opts.warmup + opts.duration).saturating_sub(started.elapsed());
                tokio::time::sleep(left).await;
            } else {
                tokio::time::sleep(opts.warmup + opts.duration).await;
            }
            stop.store(true, Ordering::SeqCst);
        }
    }
    producer
        .join()
        .map_err(|_| "producer panicked".to_string())??;
    let produced = std::mem::take(&mut *produced.lock().unwrap());
    let expected: u64 = produced
        .iter()
        .filter(|(_, t, _)| *t >= spec.failing_tenants)
        .count() as u64
        * spec.subs_per_tenant as u64;
    // Wait for every expected delivery, counted once each (or until nothing arrives for 60 s;
    // with a flaky sink, for as long again as a breaker's longest cool-down: a tenant whose
    // receiver refused 5 in a row is shed that long).
    // The distinct pairs are counted as they come; only once there are enough are they checked
    // against what was expected, so an unexpected one never stands in for one still on its way.
    let wanted = expected_pairs(&produced, spec.failing_tenants, spec.subs_per_tenant);
    let quiet_limit = Duration::from_secs(60)
        + if spec.refuse_first_percent > 0 {
            Duration::from_millis(crate::dispatch::breaker::MAX_COOL_DOWN_MS as u64)
        } else {
            Duration::ZERO
        };
    let mut last = 0usize;
    let mut quiet_since = Instant::now();
    loop {
        let arrived = {
            let unique = sink.unique.lock().unwrap();
            unique.len() as u64 >= expected
                && unique
                    .iter()
                    .filter(|(e, s)| wanted.contains(&(e.as_str(), s.clone())))
                    .count() as u64
                    >= expected
        };
        if arrived {
            break;
        }
        let n = sink.got.lock().unwrap().len();
        if n != last {
            last = n;
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() > quiet_limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What the run cost, read before the wait below (idle time is not the deliveries').
    // A second instance's CPU counts from its start.
    let cpu = killed_cpu + hub.as_ref().map_or(0.0, |h| cpu_seconds(h.pid())) - cpu0
        + second.as_ref().map_or(0.0, |h| cpu_seconds(h.pid()));
    let harness_cpu = cpu_seconds(std::process::id()) - harness_cpu0;
    // None when the broker was not there to read at both ends (not `scripts/kafka.sh`'s, or
    // restarted meanwhile: its counters then start again below the first reading).
    let broker_cpu = broker
        .zip(broker_cpu0)
        .map(|(pid, c0)| cpu_seconds(pid) - c0)
        .filter(|c| *c > 0.0);
    let rss = hub
        .iter()
        .chain(second.iter())
        .map(|h| peak_rss_mib(h.pid()))
        .fold(killed_rss, u64::max);
    // In every scenario: an attempt sent again (its outcome lost to an abort, a rebalance, a
    // kill) goes out once its lease ends (`STREAMING_HUB_HTTP_TIMEOUT` + 10 s). Waited out with
    // the sink still taking deliveries, so such a second delivery counts as a duplicate below
    // (a sink that stopped at the last expected delivery could only ever count 0).
    let lease = config.http_timeout + Duration::from_secs(15);
    tokio::time::sleep(lease).await;
    // Where the time went: the hub's own metrics (transaction phases, batch sizes, ingest to
    // outcome) as the run left them, next to the results.
    let mut attempts_unsent = None;
    for (n, h) in hub.iter().chain(second.iter()).enumerate() {
        let instance = if n == 0 {
            String::new()
        } else {
            format!("-{}", n + 1)
        };
        let name = match spec.rate {
            Some(r) => format!("metrics-{}-{r}{instance}.prom", spec.name),
            None => format!("metrics-{}{instance}.prom", spec.name),
        };
        match http.get(format!("http://{}/metrics", h.addr)).send().await {
            Ok(r) => {
                let text = r.text().await.unwrap_or_default();
                *attempts_unsent.get_or_insert(0) +=
                    counter_of(&text, crate::runtime::telemetry::ATTEMPTS_UNSENT);
                if let Err(e) = std::fs::write(opts.out.join(&name), text) {
                    eprintln!("load: could not write {name}: {e}");
                }
            }
            Err(e) => eprintln!("load: could not read the hub's metrics ({}): {e}", h.addr),
        }
    }
    drop(second);
    drop(hub);
    server.abort();
    let bytes1 = data_dir.as_deref().and_then(|d| kafka_bytes(d, &prefix));
    let _ = std::fs::remove_dir_all(&state_dir);
    let _ = std::fs::remove_dir_all(format!("{}-2", state_dir.display()));

    // Results.
    let got = sink.got.lock().unwrap().clone();
    let Tally {
        first,
        duplicates,
        unexpected,
        missing: wanted,
        twice,
    } = tally(&got, wanted);
    for ((event, sub), n) in twice.iter().take(20) {
        // Which deliveries came more than once, so the hub logs can tell who sent them.
        eprintln!("load: delivered {n} times: event {event} subscription {sub}");
    }
    let delivered = first.len() as u64;
    if unexpected > 0 {
        eprintln!("load: {unexpected} deliveries of an event to a subscription it was not for");
    }
    if !wanted.is_empty() {
        // Which events, so a miss can be traced (inbox, jobs changelog, DLQ) while the topics
        // are still there.
        let short: Vec<_> = wanted.iter().take(20).collect();
        eprintln!(
            "load: {} deliveries missing (topic prefix {prefix}); (ce-id, subscription) short, first 20: {short:?}",
            wanted.len()
        );
    }
    if !wanted.is_empty() || opts.keep_topics {
        println!("load: the run's topics stay on the broker (prefix {prefix})");
    } else if let Err(e) = delete_run_topics(config, &prefix).await {
        eprintln!("load: could not delete the run's topics (prefix {prefix}): {e}");
    }
    let measure_from_us = now_us() - measure_from.elapsed().as_micros() as i64;
    let measure_to_us = measure_from_us + opts.duration.as_micros() as i64;
    let in_measured = |us: i64| us >= measure_from_us && us < measure_to_us;
    // At a fixed rate: how many events the producer queued to the broker in the measured window.
    // Below the rate asked, the run measured a lighter load than its name says.
    let achieved_rate = spec.rate.map(|_| {
        produced
            .iter()
            .filter(|(_, _, at)| in_measured(*at))
            .count() as f64
            / opts.duration.as_secs_f64()
    });
    if let (Some(rate), Some(reached)) = (spec.rate, achieved_rate) {
        if reached < 0.98 * f64::from(rate) {
            eprintln!("load: the producer reached {reached:.0} events/s of the {rate} asked");
        }
    }
    // Up to an hour; a later one counts as an hour (`saturating_record`), never left out.
    let mut all =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| e.to_string())?;
    let mut healthy = all.clone();
    let in_window = |g: &Got| match spec.rate {
        Some(_) => in_measured(g.produced_us),
        None => true,
    };
    // Healthy: not a failing tenant's (none of theirs arrive) nor a slow one's.
    let slow = sink.slow.lock().unwrap().clone();
    for g in first.iter().filter(|g| in_window(g)) {
        let lat = (g.received_us - g.produced_us).max(1) as u64;
        all.saturating_record(lat);
        if !g.sub.split('/').next().is_some_and(|t| slow.contains(t)) {
            healthy.saturating_record(lat);
        }
    }
    // Max rate: from the producer's first send (the first transactions' time counts) to the
    // last delivery.
    let first_sent = produced
        .iter()
        .map(|(_, _, at)| *at)
        .min()
        .unwrap_or(i64::MAX);
    let last_rx = first
        .iter()
        .map(|g| g.received_us)
        .max()
        .unwrap_or(i64::MIN);
    let deliveries_per_s = match spec.rate {
        None if first.len() > 1 && last_rx > first_sent => {
            first.len() as f64 / ((last_rx - first_sent) as f64 / 1e6)
        }
        _ => {
            first.iter().filter(|g| in_measured(g.received_us)).count() as f64
                / opts.duration.as_secs_f64()
        }
    };
    let tenant_of_event: HashMap<&str, usize> = produced
        .iter()
        .map(|(id, t, _)| (id.as_str(), *t))
        .collect();
    let longest_tenant_wait_ms = longest_tenant_wait(first.iter().filter_map(|g| {
        tenant_of_event
            .get(g.event.as_str())
            .map(|t| (*t, g.received_us))
    }))
    .map(|us| us as f64 / 1000.0);
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let kafka_bytes_by_topic = match (bytes0, bytes1) {
        (Some(a), Some(b)) if delivered > 0 => Some(
            b.iter()
                .map(|(t, n)| {
                    let before = a.get(t).copied().unwrap_or(0);
                    (
                        t.clone(),
                        n.saturating_sub(before) as f64 / delivered as f64,
                    )
                })
                .filter(|(_, per)| *per > 0.0)
                .collect::<BTreeMap<String, f64>>(),
        ),
        _ => None,
    };
    let kafka_bytes_per_delivery = kafka_bytes_by_topic.as_ref().map(|m| m.values().sum());
    Ok(RunResult {
        scenario: spec.name.clone(),
        target_rate: spec.rate,
        achieved_rate,
        events: produced.len() as u64,
        expected_deliveries: expected,
        delivered,
        missing: wanted.len() as u64,
        unexpected,
        duplicates,
        bad_signatures: sink.bad.load(Ordering::Relaxed),
        sink_refused: (spec.refuse_first_percent > 0)
            .then(|| sink.refused.lock().unwrap().len() as u64),
        deliveries_per_s,
        p50_ms: ms(&all, 0.5),
        p99_ms: ms(&all, 0.99),
        p999_ms: ms(&all, 0.999),
        max_ms: all.max() as f64 / 1000.0,
        healthy_p99_ms: (spec.failing_tenants + spec.slow_tenants > 0).then(|| ms(&healthy, 0.99)),
        hub_cpu_s_per_1k: per_1k(cpu, delivered),
        harness_cpu_s_per_1k: per_1k(harness_cpu, delivered),
        broker_cpu_s_per_1k: broker_cpu.map(|c| per_1k(c, delivered)),
        hub_peak_rss_mib: rss,
        kafka_bytes_per_delivery,
        kafka_bytes_per_delivery_by_topic: kafka_bytes_by_topic,
        recovery_s,
        longest_tenant_wait_ms,
        broker_warmed_s: 0.0,
        attempts_unsent,
    })
}

/// What a run's deliveries come to against what it produced.
struct Tally<'a> {
    /// The first arrival of each expected (event, subscription) pair: the deliveries.
    first: Vec<&'a Got>,
    /// Arrivals after a pair's first.
    duplicates: u64,
    /// Pairs that arrived but were not expected (another tenant's subscription, an event never
    /// produced): never a delivery, so never a stand-in for a missing one.
    unexpected: u64,
    /// Expected pairs that never arrived, sorted.
    missing: Vec<(&'a str, String)>,
    /// Pairs that arrived more than once, with their count, sorted.
    twice: Vec<((&'a str, &'a str), usize)>,
}

/// The (ce-id, subscription) pairs a run expects from `produced` (ce-id, tenant index, _): every
/// event of a tenant at or past `failing`, once at each of its tenant's `subs` subscriptions
/// (`tenant-<t>/<n>`).
fn expected_pairs(
    produced: &[(String, usize, i64)],
    failing: usize,
    subs: usize,
) -> std::collections::HashSet<(&str, String)> {
    produced
        .iter()
        .filter(|(_, t, _)| *t >= failing)
        .flat_map(|(id, t, _)| (0..subs).map(move |n| (id.as_str(), format!("tenant-{t}/{n}"))))
        .collect()
}

/// Tallies `got` against the pairs `wanted` ([`expected_pairs`]).
fn tally<'a>(
    got: &'a [Got],
    mut wanted: std::collections::HashSet<(&'a str, String)>,
) -> Tally<'a> {
    let mut arrivals: HashMap<(&str, &str), (usize, &Got)> = HashMap::new();
    for g in got {
        let e = arrivals
            .entry((g.event.as_str(), g.sub.as_str()))
            .or_insert((0, g));
        e.0 += 1;
        if g.received_us < e.1.received_us {
            e.1 = g;
        }
    }
    let (mut first, mut unexpected) = (Vec::with_capacity(arrivals.len()), 0);
    for ((event, sub), (_, g)) in &arrivals {
        if wanted.remove(&(*event, sub.to_string())) {
            first.push(*g);
        } else {
            unexpected += 1;
        }
    }
    let mut missing: Vec<(&str, String)> = wanted.into_iter().collect();
    missing.sort();
    let mut twice: Vec<((&str, &str), usize)> = arrivals
        .iter()
        .filter(|(_, (n, _))| *n > 1)
        .map(|(k, (n, _))| (*k, *n))
        .collect();
    twice.sort();
    Tally {
        first,
        duplicates: (got.len() - arrivals.len()) as u64,
        unexpected,
        missing,
        twice,
    }
}

/// A counter's value in a Prometheus text exposition (0 when it is not there: never counted).
fn counter_of(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name))
        .filter(|rest| rest.starts_with([' ', '{']))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The longest gap between two consecutive deliveries of one tenant, over `(tenant, receive
/// time in µs)` pairs in any order; None without two deliveries of one tenant.
fn longest_tenant_wait(deliveries: impl IntoIterator<Item = (usize, i64)>) -> Option<i64> {
    let mut by_tenant: HashMap<usize, Vec<i64>> = HashMap::new();
    for (tenant, at) in deliveries {
        by_tenant.entry(tenant).or_default().push(at);
    }
    by_tenant
        .into_values()
        .filter_map(|mut at| {
            at.sort_unstable();
            at.windows(2).map(|w| w[1] - w[0]).max()
        })
        .max()
}

/// CPU seconds per 1,000 deliveries (0 without a delivery).
fn per_1k(cpu_s: f64, delivered: u64) -> f64 {
    if delivered > 0 {
        cpu_s * 1000.0 / delivered as f64
    } else {
        0.0
    }
}

/// The pid of the broker whose data directory is `data_dir` (`scripts/kafka.sh` writes it next to
/// the data), if that process runs.
fn broker_pid(data_dir: Option<&std::path::Path>) -> Option<u32> {
    let file = data_dir?.parent()?.join("kafka.pid");
    let pid: u32 = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
    std::path::Path::new(&format!("/proc/{pid}"))
        .exists()
        .then_some(pid)
}

/// The single broker's data directory from `scripts/kafka.sh` (write amplification), if present.
fn dirs_kafka_data() -> Option<PathBuf> {
    let port = std::env::var("KAFKA_PORT").unwrap_or_else(|_| "9092".into());
    let home = std::env::var("HOME").ok()?;
    let p = PathBuf::from(home).join(format!(
        ".cache/streaming-hub/kafka-data-{port}/node-1/data"
    ));
    p.is_dir().then_some(p)
}

/// Counts the load producer's records the broker did not take (failed delivery reports, and
/// those reported delivered without an offset): an event counted as produced but never written
/// would otherwise read as a delivery the hub lost.
#[derive(Default)]
struct Acks {
    failed: AtomicU64,
}

impl rdkafka::ClientContext for Acks {}

impl rdkafka::producer::ProducerContext for Acks {
    type DeliveryOpaque = ();

    fn delivery(&self, report: &rdkafka::message::DeliveryResult<'_>, _: ()) {
        // Reported delivered without an offset: maybe never written (see `kafka::placed`).
        let written = report
            .as_ref()
            .is_ok_and(|m| kafka::placed(rdkafka::Message::offset(m)));
        if !written {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn producer(config: &Config) -> Result<BaseProducer<Acks>, String> {
    kafka::base(config)
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .set("queue.buffering.max.messages", "200000")
        .set("partitioner", "murmur2_random")
        .set("enable.idempotence", "true")
        .create_with_context(Acks::default())
        .map_err(|e| e.to_string())
}

/// The shortest sleep of the load producer at a fixed rate. It sends what is due, then sleeps
/// until the next event is due but at least this long, and sends what came due meanwhile in one
/// go: at 5,000/s a sleep per event woke its thread 5,000 times a second, about a third of the
/// harness's CPU (session 64's profile), taken from the two cores the hub and the broker share
/// with it. Each event still carries the time it was due, so the up to 1 ms it waits here counts
/// in its latency.
const PACE_STEP: Duration = Duration::from_millis(1);

/// How long the producer sleeps before an event due at `due`: none when it is due already,
/// otherwise until then but at least [`PACE_STEP`].
fn pace_wait(due: Instant, now: Instant) -> Option<Duration> {
    (due > now).then(|| (due - now).max(PACE_STEP))
}

/// Produces the run's events: (ce-id, tenant index, time it was queued to the broker: librdkafka's
/// queue, acknowledged later) of each. At a fixed rate the payload carries the time each event was
/// due (see [`produced_at`]).
fn produce_loop(
    config: &Config,
    topic: &str,
    spec: &Spec,
    size: usize,
    stop: &AtomicBool,
    produced: &Mutex<Vec<(String, usize, i64)>>,
) -> Result<(), String> {
    let p = producer(config)?;
    let (started, started_us) = (Instant::now(), now_us());
    let mut i: u64 = 0;
    loop {
        let stamp_us = match spec.rate {
            Some(rate) => {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let after = Duration::from_secs_f64(i as f64 / rate as f64);
                if let Some(wait) = pace_wait(started + after, Instant::now()) {
                    std::thread::sleep(wait);
                }
                started_us + after.as_micros() as i64
            }
            None => {
                if i as usize >= spec.events {
                    break;
                }
                now_us()
            }
        };
        let t = (i as usize) % spec.tenants;
        let tenant = format!("tenant-{t}");
        let id = uuid::Uuid::now_v7().to_string();
        let time = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let mut h = OwnedHeaders::new_with_capacity(10);
        for (k, v) in [
            ("ce-specversion", "1.0"),
            ("ce-id", id.as_str()),
            ("ce-source", "ledger"),
            ("ce-type", "studio.lerian.ledger.transaction.created"),
            ("ce-time", time.as_str()),
            ("ce-schemaversion", "1.0.0"),
            ("ce-resourcetype", "transaction"),
            ("ce-eventtype", "created"),
            ("ce-datacontenttype", "application/json"),
            ("ce-tenantid", tenant.as_str()),
        ] {
            h = h.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        let body = payload(size, stamp_us, &id);
        let record = BaseRecord::to(topic)
            .key(tenant.as_str())
            .payload(&body)
            .headers(h);
        kafka::send_waiting(&p, record).map_err(|e| e.to_string())?;
        produced.lock().unwrap().push((id, t, now_us()));
        i += 1;
        if i % 1000 == 0 {
            p.poll(Duration::ZERO);
        }
    }
    p.flush(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    match p.context().failed.load(Ordering::Relaxed) {
        0 => Ok(()),
        n => Err(format!(
            "the load producer could not write {n} of its records (or was not told where they \
             are): this run's counts are void"
        )),
    }
}

/// The most deliveries/s this machine could make if a delivery cost only what the design cannot
/// do without, priced by the limits measured beside it: every event crosses the broker twice
/// (producer → source topic → ingest, ingest → inbox → hub task), each crossing at least what one
/// record of the Kafka limit run cost the whole machine (1 / `kafka` s), and every delivery is
/// one request, at least what one request of the sink limit run cost (1 / `sink` s); an event
/// with `deliveries_per_event` matching subscriptions shares its two crossings among them. Dedup,
/// jobs, claims, attempts, transactions and signing are priced at zero, so the hub's real
/// figure can only be lower.
fn ceiling(kafka: f64, sink: f64, deliveries_per_event: u32) -> f64 {
    if kafka <= 0.0 || sink <= 0.0 || deliveries_per_event == 0 {
        return 0.0;
    }
    1.0 / (1.0 / sink + 2.0 / (kafka * f64::from(deliveries_per_event)))
}

/// The topics of the run with topic prefix `prefix` among `topics`: its producers' topic
/// (`lerian.streaming.<prefix>`, and its `.dlq` if any) and every topic under the prefix.
fn topics_of_run<'a>(topics: impl IntoIterator<Item = &'a str>, prefix: &str) -> Vec<String> {
    let source = format!("lerian.streaming.{prefix}");
    let (under, under_source) = (format!("{prefix}."), format!("{source}."));
    topics
        .into_iter()
        .filter(|t| *t == source || t.starts_with(&under) || t.starts_with(&under_source))
        .map(str::to_string)
        .collect()
}

/// Deletes the topics a run made. Every run makes its own (about 60 partitions, the changelogs
/// compacted), and a broker that had kept those of a day's runs (5,212 partitions) measured
/// slower at 5,000 events/s than after they were deleted (BENCHMARKS.md, session 19).
async fn delete_run_topics(config: &Config, prefix: &str) -> Result<(), String> {
    let admin = kafka::admin(config).map_err(|e| e.to_string())?;
    let names: Vec<String> = {
        let md = admin
            .inner()
            .fetch_metadata(None, kafka::ADMIN_TIMEOUT)
            .map_err(|e| e.to_string())?;
        topics_of_run(md.topics().iter().map(|t| t.name()), prefix)
    };
    delete_topics(&admin, &names).await
}

async fn delete_topics(
    admin: &rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>,
    names: &[String],
) -> Result<(), String> {
    if names.is_empty() {
        return Ok(());
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    for r in admin
        .delete_topics(&refs, &rdkafka::admin::AdminOptions::new())
        .await
        .map_err(|e| e.to_string())?
    {
        r.map_err(|(t, e)| format!("{t}: {e}"))?;
    }
    Ok(())
}

/// The broker's produce→consume rate for this record size through the same client library, from
/// the producer's start to the last record consumed. The consumer is assigned its partitions
/// (no group to join) before the producer starts, so neither a join nor a backlog built during
/// one is in the figure.
async fn kafka_limit(config: &Config, size: usize, n: usize) -> Result<f64, String> {
    let topic = format!(
        "load-limit-{}",
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    );
    crate::bench::create_topic(config, &topic, 6).await?;
    let consumer: BaseConsumer = kafka::base(config)
        .set("group.id", &topic)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| e.to_string())?;
    let mut partitions = rdkafka::TopicPartitionList::new();
    for p in 0..6 {
        partitions
            .add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
            .map_err(|e| e.to_string())?;
    }
    consumer.assign(&partitions).map_err(|e| e.to_string())?;
    let spec = Spec {
        name: "limit".into(),
        rate: None,
        tenants: 100,
        subs_per_tenant: 1,
        failing_tenants: 0,
        slow_tenants: 0,
        slow_delay: Duration::ZERO,
        sink_delay: Duration::ZERO,
        refuse_first_percent: 0,
        workers: None,
        kill_after: None,
        scale_out_after: None,
        events: n,
    };
    let started = Instant::now();
    let (config2, topic2) = (config.clone(), topic.clone());
    let producer = std::thread::spawn(move || {
        let produced = Mutex::new(Vec::new());
        produce_loop(
            &config2,
            &topic2,
            &spec,
            size,
            &AtomicBool::new(false),
            &produced,
        )
    });
    let consumed = tokio::task::spawn_blocking(move || {
        let mut got = 0usize;
        let deadline = Instant::now() + Duration::from_secs(300);
        while got < n && Instant::now() < deadline {
            if let Some(Ok(_)) = consumer.poll(Duration::from_millis(100)) {
                got += 1;
            }
        }
        got
    })
    .await
    .map_err(|e| e.to_string())?;
    let rate = consumed as f64 / started.elapsed().as_secs_f64();
    producer.join().map_err(|_| "limit producer panicked")??;
    if let Ok(admin) = kafka::admin(config) {
        if let Err(e) = delete_topics(&admin, std::slice::from_ref(&topic)).await {
            eprintln!("load: could not delete {topic}: {e}");
        }
    }
    Ok(rate)
}

/// The sink's request rate from the hub's own HTTP client (`delivery::client::build_client`:
/// keep-alive, HTTP/1.1, its pool and timeouts), 64 in flight, bodies of the run's size.
async fn sink_limit(config: &Config, size: usize, for_how_long: Duration) -> Result<f64, String> {
    let sink = Sink {
        size,
        ..Sink::default()
    };
    sink.secrets.lock().unwrap().insert(
        "tenant-0/0".into(),
        Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
    );
    let app = Router::new()
        .route("/hook/{tenant}/{n}", post(sink_handler))
        .with_state(sink.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut hub_like = config.clone();
    hub_like.allow_private_sinks = true;
    let http = crate::delivery::client::build_client(&hub_like).map_err(|e| e.to_string())?;
    let secret = Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (http, secret, done) = (http.clone(), secret.clone(), done.clone());
        let url = format!("http://{addr}/hook/tenant-0/0");
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < for_how_long {
                let id = uuid::Uuid::now_v7().to_string();
                let body = payload(size, now_us(), &id);
                let ts = chrono::Utc::now().timestamp();
                let sig = signing::sign(&secret, &id, ts, &body).unwrap_or_default();
                let ok = http
                    .post(&url)
                    .header("webhook-id", &id)
                    .header("webhook-timestamp", ts.to_string())
                    .header("webhook-signature", sig)
                    .header("x-lerian-event-id", &id)
                    .body(body)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ok {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    server.abort();
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The p99 latency target at 5,000 events/s (issue 8), drawn on the plot for reference.
const P99_TARGET_MS: f64 = 50.0;

/// The rate a latency run is drawn at: what the producer reached, else the rate asked.
fn rate_of(r: &RunResult) -> Option<f64> {
    r.achieved_rate.or(r.target_rate.map(f64::from))
}

/// Latency percentiles against rate, as a PNG. The latency axis is logarithmic: a rate the hub
/// cannot keep up with reaches seconds, and on a linear axis it flattens every other point.
fn plot(runs: &[&RunResult], path: &std::path::Path) -> Result<(), String> {
    use plotters::prelude::*;
    let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
        .map_err(|e| format!("font for the plot (apt install fonts-dejavu-core): {e}"))?;
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| "font did not load".to_string())?;
    let max_rate = runs.iter().filter_map(|r| rate_of(r)).fold(1.0, f64::max);
    let max_ms = runs.iter().map(|r| r.p999_ms).fold(P99_TARGET_MS, f64::max) * 1.5;
    let min_ms = runs
        .iter()
        .map(|r| r.p50_ms)
        .fold(P99_TARGET_MS, f64::min)
        .max(0.1)
        / 1.5;
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Streaming Hub: end-to-end latency (produce → sink) by rate",
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max_rate * 1.1, (min_ms..max_ms).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("events/s produced (the rate reached)")
        .y_desc("latency (ms, log scale)")
        .draw()
        .map_err(|e| e.to_string())?;
    type Series = (&'static str, fn(&RunResult) -> f64, RGBColor);
    let series: [Series; 3] = [
        ("p50", |r| r.p50_ms, BLUE),
        ("p99", |r| r.p99_ms, RED),
        ("p99.9", |r| r.p999_ms, BLACK),
    ];
    let target = RGBColor(0, 150, 0);
    chart
        .draw_series(DashedLineSeries::new(
            [(0.0, P99_TARGET_MS), (max_rate * 1.1, P99_TARGET_MS)],
            8,
            6,
            target.stroke_width(1),
        ))
        .map_err(|e| e.to_string())?
        .label("p99 target (50 ms at 5,000/s)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], target.stroke_width(3)));
    for (label, f, color) in series {
        let mut pts: Vec<(f64, f64)> = runs
            .iter()
            .filter_map(|r| Some((rate_of(r)?, f(r))))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// An API answer as it may be printed: without its `signing_secret`.
fn without_secret(v: &serde_json::Value) -> serde_json::Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("signing_secret");
    }
    v
}

#[cfg(test)]
mod tests {
    use super::{
        Got, PACE_STEP, Sink, broker_pid, ceiling, counter_of, longest_tenant_wait, now_us,
        pace_wait, payload, per_1k, produced_at, refused_first, sink_handler, specs_of, tally,
        topics_of_run,
    };
    use crate::delivery::signing;
    use crate::runtime::secret::Secret;
    use axum::body::Bytes;
    use axum::extract::{Path, State};
    use axum::http::{HeaderMap, StatusCode};
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    /// Sends the sink a delivery of `body` as event `id` to tenant-1's subscription `n`, signed
    /// with `secret` at `ts`; its answer's status.
    async fn deliver(
        sink: &Sink,
        secret: &Secret,
        id: String,
        ts: i64,
        n: u32,
        body: Vec<u8>,
    ) -> StatusCode {
        let mut h = HeaderMap::new();
        let sig = signing::sign(secret, &id, ts, &body).unwrap();
        h.insert("webhook-id", id.parse().unwrap());
        h.insert("x-lerian-event-id", id.parse().unwrap());
        h.insert("webhook-timestamp", ts.to_string().parse().unwrap());
        h.insert("webhook-signature", sig.parse().unwrap());
        let path = Path(("tenant-1".to_string(), n));
        sink_handler(State(sink.clone()), path, h, Bytes::from(body))
            .await
            .0
    }

    /// The sink takes a delivery only when it is signed, fresh, and carries the producer's body
    /// byte for byte: a hub that garbled a body (and signed what it sent) or sent a stale
    /// timestamp would otherwise count as delivering.
    #[tokio::test]
    async fn the_sink_counts_only_fresh_signed_deliveries_of_the_bodies_produced() {
        let secret = Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
        let sink = Sink {
            size: 256,
            ..Sink::default()
        };
        sink.secrets
            .lock()
            .unwrap()
            .insert("tenant-1/0".into(), secret.clone());
        let id = uuid::Uuid::now_v7().to_string();
        let send = |body: Vec<u8>, ts: i64| deliver(&sink, &secret, id.clone(), ts, 0, body);
        let now_s = now_us() / 1_000_000;
        let good = payload(256, now_us(), &id);
        assert_eq!(send(good.clone(), now_s).await, StatusCode::OK);
        let mut garbled = good.clone();
        garbled[100] = b'y';
        assert_eq!(send(garbled, now_s).await, StatusCode::UNAUTHORIZED);
        assert_eq!(
            send(payload(300, now_us(), &id), now_s).await,
            StatusCode::UNAUTHORIZED,
            "another size"
        );
        let other = uuid::Uuid::now_v7().to_string();
        assert_eq!(
            send(payload(256, now_us(), &other), now_s).await,
            StatusCode::UNAUTHORIZED,
            "another event's body"
        );
        assert_eq!(
            send(good.clone(), i64::MIN).await,
            StatusCode::UNAUTHORIZED,
            "a timestamp that would overflow"
        );
        assert_eq!(
            send(good.clone(), now_s - 301).await,
            StatusCode::UNAUTHORIZED,
            "stale"
        );
        assert_eq!(
            send(good.clone(), now_s * 1000).await,
            StatusCode::UNAUTHORIZED,
            "milliseconds"
        );
        assert_eq!(sink.bad.load(Ordering::Relaxed), 6);
        assert_eq!(sink.got.lock().unwrap().len(), 1);
    }

    /// `flaky=<percent>` refuses about that share of events, the same ones at every attempt.
    #[test]
    fn a_flaky_sink_refuses_the_share_of_events_asked() {
        let ids: Vec<String> = (0..20_000)
            .map(|_| uuid::Uuid::now_v7().to_string())
            .collect();
        let share = |percent| ids.iter().filter(|id| refused_first(id, percent)).count();
        assert_eq!(share(0), 0);
        assert_eq!(share(100), ids.len());
        let ten = share(10);
        assert!(
            (1_700..=2_300).contains(&ten),
            "10% of 20,000 refused: {ten}"
        );
        let fifty = share(50);
        assert!(
            (9_400..=10_600).contains(&fifty),
            "50% of 20,000 refused: {fifty}"
        );
        let specs = specs_of("flaky=10", Duration::from_secs(15)).unwrap().0;
        assert_eq!(specs[0].refuse_first_percent, 10);
        assert!(specs_of("flaky=0", Duration::from_secs(15)).is_err());
        assert!(specs_of("flaky=21", Duration::from_secs(15)).is_err());
    }

    /// A refused event's first delivery to a subscription is answered 500 and not counted; the
    /// next is taken; another subscription's first delivery of it is refused too.
    #[tokio::test]
    async fn a_flaky_sink_refuses_each_delivery_once_then_takes_it() {
        let secret = Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
        let sink = Sink {
            size: 128,
            refuse_first_percent: 100,
            ..Sink::default()
        };
        for path in ["tenant-1/0", "tenant-1/1"] {
            sink.secrets
                .lock()
                .unwrap()
                .insert(path.into(), secret.clone());
        }
        let id = uuid::Uuid::now_v7().to_string();
        let body = payload(128, now_us(), &id);
        let send = |n: u32| {
            let ts = now_us() / 1_000_000;
            deliver(&sink, &secret, id.clone(), ts, n, body.clone())
        };
        assert_eq!(send(0).await, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(sink.got.lock().unwrap().is_empty());
        assert_eq!(send(0).await, StatusCode::OK);
        assert_eq!(send(1).await, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(send(1).await, StatusCode::OK);
        assert_eq!(
            send(0).await,
            StatusCode::OK,
            "a duplicate is taken (and counted)"
        );
        assert_eq!(sink.got.lock().unwrap().len(), 3);
        assert_eq!(sink.refused.lock().unwrap().len(), 2);
        assert_eq!(sink.bad.load(Ordering::Relaxed), 0);
    }

    fn got(event: &str, sub: &str, received_us: i64) -> Got {
        Got {
            event: event.into(),
            sub: sub.into(),
            received_us,
            produced_us: 0,
        }
    }

    #[test]
    fn a_delivery_counts_once_and_only_for_the_subscription_it_was_for() {
        // e1 of tenant-1 (two subscriptions), e2 of tenant-0 (failing: nothing expected).
        let produced = vec![("e1".to_string(), 1, 0), ("e2".to_string(), 0, 0)];
        let got = vec![
            got("e1", "tenant-1/0", 30),
            got("e1", "tenant-1/0", 10), // the same pair again, earlier: the first arrival
            got("e1", "tenant-2/0", 20), // another tenant's subscription: not a delivery
            got("e2", "tenant-0/0", 40), // a failing tenant's: not expected
        ];
        let t = tally(&got, super::expected_pairs(&produced, 1, 2));
        assert_eq!(t.first.len(), 1);
        assert_eq!(t.first[0].received_us, 10);
        assert_eq!(t.duplicates, 1);
        assert_eq!(t.unexpected, 2);
        // e1 at tenant-1/1 never came: the two unexpected ones do not make up for it.
        assert_eq!(t.missing, vec![("e1", "tenant-1/1".to_string())]);
        assert_eq!(t.twice, vec![(("e1", "tenant-1/0"), 2)]);
    }

    #[test]
    fn the_payload_carries_the_time_it_was_due_at_the_size_asked() {
        let body = payload(
            1024,
            1_700_000_000_123_456,
            "01a25123-7f49-77c8-a708-9be8ab6f5b1a",
        );
        assert_eq!(body.len(), 1024);
        assert_eq!(produced_at(&body), 1_700_000_000_123_456);
        serde_json::from_slice::<serde_json::Value>(&body).unwrap();
    }

    #[test]
    fn the_producer_sends_what_is_due_at_once_and_sleeps_at_least_a_pace_step() {
        let now = Instant::now();
        assert_eq!(pace_wait(now, now), None);
        assert_eq!(pace_wait(now, now + Duration::from_micros(300)), None);
        let soon = now + Duration::from_micros(200);
        assert_eq!(pace_wait(soon, now), Some(PACE_STEP));
        let later = now + Duration::from_millis(3);
        assert_eq!(pace_wait(later, now), Some(Duration::from_millis(3)));
    }

    #[test]
    fn a_counter_is_read_from_the_hubs_metrics_by_its_whole_name() {
        let text = "# TYPE streaming_hub_attempts_unsent_total counter\n\
                    streaming_hub_attempts_unsent_total 42\n\
                    streaming_hub_attempts_unsent_total_other 7\n\
                    streaming_hub_x{a=\"1\"} 2\nstreaming_hub_x{a=\"2\"} 3\n";
        assert_eq!(counter_of(text, "streaming_hub_attempts_unsent_total"), 42);
        assert_eq!(
            counter_of(text, "streaming_hub_x"),
            5,
            "labelled series add up"
        );
        assert_eq!(counter_of(text, "streaming_hub_absent_total"), 0);
        let (specs, _) = specs_of("slow-neighbour=20", Duration::from_secs(20)).unwrap();
        assert_eq!(specs[0].sink_delay, Duration::from_millis(20));
        assert_eq!(specs[0].slow_delay, Duration::from_secs(10));
        let (specs, _) = specs_of("backlog=1000", Duration::from_secs(20)).unwrap();
        assert_eq!(specs[0].name, "backlog-1000ms");
        assert_eq!(specs[0].sink_delay, Duration::from_secs(1));
        assert!(specs_of("backlog=0", Duration::from_secs(20)).is_err());
        assert!(specs_of("backlog=x", Duration::from_secs(20)).is_err());
    }

    #[test]
    fn the_broker_is_found_by_the_pid_file_beside_its_data_while_it_runs() {
        let node = tempfile::tempdir().unwrap();
        let data = node.path().join("data");
        std::fs::create_dir(&data).unwrap();
        assert_eq!(broker_pid(Some(&data)), None, "no pid file");
        assert_eq!(broker_pid(None), None, "no data directory");
        // A running process (this test's own) stands in for the broker.
        std::fs::write(
            node.path().join("kafka.pid"),
            format!("{}\n", std::process::id()),
        )
        .unwrap();
        assert_eq!(broker_pid(Some(&data)), Some(std::process::id()));
        // A pid no process has (above the kernel's pid_max), or not a pid at all.
        std::fs::write(node.path().join("kafka.pid"), "4294967294").unwrap();
        assert_eq!(broker_pid(Some(&data)), None);
        std::fs::write(node.path().join("kafka.pid"), "kafka").unwrap();
        assert_eq!(broker_pid(Some(&data)), None);
        assert_eq!(per_1k(3.0, 2_000), 1.5);
        assert_eq!(per_1k(3.0, 0), 0.0);
    }

    #[test]
    fn a_runs_topics_are_its_source_and_those_under_its_prefix_only() {
        let all = [
            "lerian.streaming.loadab12",
            "loadab12.inbox",
            "loadab12.hub.jobs.changelog",
            "loadab12x.inbox",
            "lerian.streaming.loadab12x",
            "lerian.streaming.loadab12.dlq",
            "loadab1.inbox",
            "__consumer_offsets",
        ];
        assert_eq!(
            topics_of_run(all, "loadab12"),
            vec![
                "lerian.streaming.loadab12",
                "loadab12.inbox",
                "loadab12.hub.jobs.changelog",
                "lerian.streaming.loadab12.dlq"
            ]
        );
    }

    /// `slow-sink` runs as fast as the producer can, once with the default workers and once
    /// with 256: the deliveries/s each reaches (at a fixed rate both only kept up).
    #[test]
    fn slow_sink_runs_at_full_speed_with_two_worker_settings() {
        let (specs, _) = specs_of("slow-sink", Duration::from_secs(15)).unwrap();
        let shape: Vec<_> = specs
            .iter()
            .map(|s| (s.rate, s.workers, s.events, s.sink_delay))
            .collect();
        let delay = Duration::from_millis(50);
        assert_eq!(
            shape,
            [
                (None, None, 20_000, delay),
                (None, Some(256), 20_000, delay)
            ]
        );
    }

    #[test]
    fn latency_at_one_rate_runs_that_rate_alone_and_bad_rates_are_refused() {
        let d = Duration::from_secs(15);
        let (specs, _) = specs_of("latency=5000", d).unwrap();
        let rates: Vec<_> = specs.iter().map(|s| (s.name.as_str(), s.rate)).collect();
        assert_eq!(rates, [("latency", Some(5000))]);
        let (curve, _) = specs_of("latency", d).unwrap();
        let rates: Vec<_> = curve.iter().map(|s| s.rate).collect();
        assert_eq!(rates, [Some(1000), Some(5000), Some(10_000)]);
        for bad in [
            "latency=",
            "latency=0",
            "latency=fast",
            "latency=-5",
            "nonsense",
        ] {
            let e = specs_of(bad, d).err().unwrap_or_default();
            assert!(e.contains(bad), "{bad:?}: {e:?}");
        }
    }

    #[test]
    fn the_longest_tenant_wait_is_the_largest_gap_between_one_tenants_deliveries() {
        // Listed out of order (as the sink's threads record them): tenant 1 received at 100,
        // 200 and 900 µs, so it waited 700 (not 800, the gap in listing order); tenant 2's are
        // at most 200 apart; tenant 3 has a single delivery.
        let got = [
            (1, 100),
            (2, 400),
            (1, 900),
            (2, 100),
            (3, 5_000),
            (1, 200),
            (2, 300),
        ];
        assert_eq!(longest_tenant_wait(got), Some(700));
        assert_eq!(longest_tenant_wait([(3, 5_000)]), None);
        assert_eq!(longest_tenant_wait([]), None);
    }

    #[test]
    fn the_ceiling_prices_two_broker_crossings_per_event_and_one_request_per_delivery() {
        // 200 records/s and 100 requests/s: an event costs 2/200 s of crossings + 1/100 s of
        // request, so 50 deliveries/s; two deliveries share one event's crossings.
        assert!((ceiling(200.0, 100.0, 1) - 50.0).abs() < 1e-9);
        assert!((ceiling(200.0, 100.0, 2) - 200.0 / 3.0).abs() < 1e-9);
        // Never above the sink's own rate, and nearing it as fan-out grows.
        assert!(ceiling(84_179.0, 25_750.0, 10) < 25_750.0);
        assert!(ceiling(84_179.0, 25_750.0, 1000) > 25_000.0);
        // No limit measured: no ceiling.
        assert_eq!(ceiling(0.0, 25_750.0, 1), 0.0);
        assert_eq!(ceiling(84_179.0, 25_750.0, 0), 0.0);
    }
}
