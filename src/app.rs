//! Wiring: the pieces a `streaming-hub run` process starts, in order, and how it stops.
//!
//! Start: apply the topology (create what is missing, warn about differences), start ingest on its
//! own thread (role `all` or `ingest`), start the hub stage on its own thread (role `all` or
//! `delivery`), follow the control topic into the subscription table, serve HTTP (`/healthz`, `/readyz`, `/metrics`),
//! and with the API (KEK set) the task that retries pending verifications. Stop on
//! SIGTERM or Ctrl-C: readiness goes false, ingest commits its open batch and leaves, then exit.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::api::{self, ApiState};
use crate::config::{Config, LogFormat, Role};
use crate::dispatch::DispatchJobs;
use crate::dispatch::worker::Workers;
use crate::hub::task::{Dispatch, HubStage};
use crate::ingest::pipeline::Ingest;
use crate::runtime::avro::Codec;
use crate::runtime::clock::{Clock, ManualClock, SharedClock, SystemClock};
use crate::runtime::topology::Topology;
use crate::subscriptions::control::{self, Subscriptions};
use crate::subscriptions::pending::{PendingRetrier, Prober};
use crate::subscriptions::secrets::Kek;
use crate::subscriptions::table::SharedTable;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Topology(#[from] crate::runtime::topology::TopologyError),
    #[error(transparent)]
    Ingest(#[from] crate::ingest::pipeline::IngestError),
    #[error(transparent)]
    Hub(#[from] crate::hub::task::HubError),
    #[error("codec: {0}")]
    Codec(String),
    #[error("http server: {0}")]
    Http(String),
    /// A stage that panicked or whose error has no type of its own (the control reader): the
    /// process still exits non-zero, so an orchestrator restarts it and an operator sees it.
    #[error("{0}")]
    Stage(String),
}

impl AppError {
    /// The process's exit code: 2 for a configuration or topic the hub refuses (README), 1 for
    /// anything else that stopped it.
    pub fn exit_code(&self) -> u8 {
        match self {
            AppError::Topology(e) if e.is_refusal() => 2,
            _ => 1,
        }
    }
}

pub fn init_tracing(config: &Config) {
    let mut filter = tracing_subscriber::EnvFilter::try_new(&config.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if config.kafka_debug.is_some() {
        // Asked for: shown whatever the filter says about other targets.
        filter = filter.add_directive(
            "librdkafka=debug"
                .parse()
                .expect("a constant directive parses"),
        );
    }
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match config.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

#[derive(Clone)]
struct Health {
    ready: Arc<AtomicBool>,
    table: SharedTable,
    metrics: PrometheusHandle,
    /// The broker answered the last metadata request (checked every 5 s).
    broker: Arc<AtomicBool>,
    /// `/readyz` has answered 200 once: from then on restores do not count (see [`readiness`]).
    served: Arc<AtomicBool>,
}

/// Runs the task `start` makes until it returns, making and running it again 10 s after it
/// panicked (a bug would otherwise end it for good, silently), until `stop`.
fn supervised<F, T>(what: &'static str, stop: Arc<AtomicBool>, start: F)
where
    F: Fn(Arc<AtomicBool>) -> T + Send + 'static,
    T: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match tokio::spawn(start(stop.clone())).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::error!(error = %e, "{what} failed; it starts again in 10 s")
                }
            }
            tokio::time::sleep(std::time::Duration::from_secs(10)).await;
            if stop.load(Ordering::SeqCst) {
                return;
            }
        }
    });
}

/// Asks the brokers for metadata every 5 s and records whether they answered (`/readyz`).
fn watch_broker(
    config: &Config,
    ok: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> Result<(), AppError> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let client: BaseConsumer = crate::runtime::kafka::base(config)
        .create()
        .map_err(|e| AppError::Http(e.to_string()))?;
    std::thread::Builder::new()
        .name("broker-watch".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let answered = client
                    .fetch_metadata(None, std::time::Duration::from_secs(3))
                    .is_ok();
                if ok.swap(answered, Ordering::SeqCst) != answered {
                    if answered {
                        tracing::info!("broker reachable again");
                    } else {
                        tracing::warn!("broker unreachable: /readyz answers 503");
                    }
                }
                for _ in 0..50 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        })
        .map_err(|e| AppError::Http(e.to_string()))?;
    Ok(())
}

/// Ends the liveness watchdog when `run` returns (however it returns), and forgets the beats
/// of its loops (a loop that failed keeps its last one), so a later run in the same process
/// does not start from them.
struct WatchdogOff(Arc<AtomicBool>);

impl Drop for WatchdogOff {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        crate::runtime::liveness::rest_all();
    }
}

pub async fn run(config: Config) -> Result<(), AppError> {
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| AppError::Http(e.to_string()))?;
    if config.dangerous_test_stale_offsets {
        tracing::warn!(
            "STREAMING_HUB_DANGEROUS_TEST_STALE_OFFSETS is on: one hub transaction's offsets are held until the group moves on, and refused. NEVER in production."
        );
    }
    if !config.dangerous_test_control_lag.is_zero() {
        tracing::warn!(
            lag_ms = config.dangerous_test_control_lag.as_millis() as u64,
            "STREAMING_HUB_DANGEROUS_TEST_CONTROL_LAG is on: every subscription change is applied late. NEVER in production."
        );
    }
    let test_clock = config.dangerous_test_clock.then(|| {
        tracing::warn!("STREAMING_HUB_DANGEROUS_TEST_CLOCK is on: time moves only through POST /admin/clock/advance. NEVER in production.");
        ManualClock::new(SystemClock.now_ms())
    });
    let clock: SharedClock = match &test_clock {
        Some(c) => Arc::new(c.clone()),
        None => Arc::new(SystemClock),
    };

    let topology = Topology::load(&config.topology_file, &config)?;
    crate::runtime::kafka::preflight(&config, crate::runtime::kafka::ADMIN_TIMEOUT)
        .map_err(crate::runtime::topology::TopologyError::from)?;
    for finding in topology.apply(&config, false).await? {
        // A compacted topic (the control topic, the changelogs) under `delete`, or
        // `compact,delete`, loses the subscriptions and state retention takes: refused. So is
        // a topic taking smaller records than the hub writes (every batch holding one would be
        // refused and run again for good). Other differences are reported.
        if let crate::runtime::topology::Finding::Differs {
            topic,
            setting,
            want,
            have,
        } = &finding
        {
            if setting == "cleanup.policy"
                && crate::runtime::topology::retention_deletes_kept_records(want, have)
            {
                return Err(crate::runtime::topology::TopologyError::CleanupPolicy {
                    topic: topic.clone(),
                    want: want.clone(),
                    have: have.clone(),
                }
                .into());
            }
            let need = crate::runtime::topology::largest_write(config.max_payload_bytes as u64);
            if setting == "max.message.bytes"
                && crate::runtime::topology::records_too_large_for(want, have, need)
            {
                return Err(crate::runtime::topology::TopologyError::MaxMessageBytes {
                    topic: topic.clone(),
                    want: want.clone(),
                    have: have.clone(),
                    need,
                }
                .into());
            }
            if setting == "delete.retention.ms"
                && crate::runtime::topology::changelog_tombstones_too_short(topic, have)
            {
                return Err(crate::runtime::topology::TopologyError::DeleteRetention {
                    topic: topic.clone(),
                    have: have.clone(),
                }
                .into());
            }
        }
        if finding.needs_attention() {
            tracing::warn!(%finding, "topic differs from the topology or was not compared");
        } else {
            tracing::debug!(%finding, "topology");
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicBool::new(false));
    // A stage that ends while nobody asked it to (a fatal error) takes the process down, so that
    // it is restarted instead of answering HTTP while delivering nothing.
    let stage_down = Arc::new(tokio::sync::Notify::new());
    // The port first: taken by another process, the hub stops here, before any stage has
    // started (a stage left running while `run` returns would end without closing its
    // transaction, and a restart loop would keep finding its partitions held).
    let listener = tokio::net::TcpListener::bind(config.http_listen_addr)
        .await
        .map_err(|e| AppError::Http(format!("bind {}: {e}", config.http_listen_addr)))?;
    let metrics_listener = match config.metrics_listen_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| AppError::Http(format!("bind {addr}: {e}")))?,
        ),
        None => None,
    };
    let mut ingest_thread = None;
    if matches!(config.role, Role::All | Role::Ingest) {
        let ingest = Ingest::new(&config, clock.clone())?
            .with_joining(crate::runtime::orphans::Joining::new());
        let (stop, down) = (stop.clone(), stage_down.clone());
        ingest_thread = Some(
            std::thread::Builder::new()
                .name("ingest".into())
                .spawn(move || {
                    let _end = StageEnd("ingest", stop.clone(), down);
                    let result = ingest.run(stop);
                    // Its consumer closed, whatever the outcome: no call of it can stall now. A
                    // failed loop's last beat, left set, ran on while the others drained, and
                    // the watchdog could end a healthy shutdown (exit 70).
                    crate::runtime::liveness::rest(&crate::runtime::liveness::INGEST);
                    if let Err(e) = &result {
                        tracing::error!(error = %e, "ingest stage failed");
                    }
                    result
                })
                .map_err(|e| AppError::Http(e.to_string()))?,
        );
    }

    let codec = Arc::new(Codec::new().map_err(|e| AppError::Codec(e.to_string()))?);
    let table = SharedTable::default();
    let control_thread = {
        let (config, codec, table, stop, down) = (
            config.clone(),
            codec.clone(),
            table.clone(),
            stop.clone(),
            stage_down.clone(),
        );
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                let _end = StageEnd("control", stop.clone(), down);
                let result = control::follow(&config, codec, table, stop);
                if let Err(e) = &result {
                    tracing::error!(error = %e, "control topic reader stopped: the subscription table no longer follows");
                }
                result
            })
            .map_err(|e| AppError::Http(e.to_string()))?
    };
    let mut hub_threads = Vec::new();
    if matches!(config.role, Role::All | Role::Delivery) {
        let kek = if config.kek.is_empty() {
            tracing::warn!(
                "delivery runs without STREAMING_HUB_KEK: webhook deliveries of the partitions \
                 this instance owns are held (no attempt spent, \
                 streaming_hub_deliveries_held_no_key_total) until an instance with the key \
                 owns them"
            );
            None
        } else {
            Some(Arc::new(
                Kek::from_config(&config).map_err(|e| AppError::Http(e.to_string()))?,
            ))
        };
        let workers = Workers {
            http: crate::delivery::client::build_client(&config)
                .map_err(|e| AppError::Http(e.to_string()))?,
            kek,
            clock: clock.clone(),
            urls: crate::delivery::client::CheckedUrls::new(
                config.allow_private_sinks,
                config.allow_insecure_sinks,
            ),
            permits: crate::dispatch::fair::FairPermits::new(config.dispatch_workers),
            http_timeout_ms: config.http_timeout.as_millis() as i64,
        };
        // One hub loop per stage, each its own group member and transactional producer, all
        // sharing the workers (and so `STREAMING_HUB_DISPATCH_WORKERS`).
        let stages = config.hub_stage_count();
        let router = Arc::new(crate::hub::task::OutcomeRouter::default());
        for stage in 0..stages {
            let handler = DispatchJobs::new(table.clone(), format!("{}.pull", config.topic_prefix));
            let dispatch = Dispatch::new(
                table.clone(),
                workers.clone(),
                tokio::runtime::Handle::current(),
                &config,
            )
            .for_stage(stage, stages);
            let mut hub = HubStage::new(&config, codec.clone(), clock.clone(), Box::new(handler))
                .with_dispatch(dispatch)
                .with_stage(stage, router.clone())
                .with_joining(crate::runtime::orphans::Joining::new());
            let (stop, down) = (stop.clone(), stage_down.clone());
            hub_threads.push(
                std::thread::Builder::new()
                    .name(if stage == 0 {
                        "hub".into()
                    } else {
                        format!("hub-{stage}")
                    })
                    .spawn(move || {
                        let _end = StageEnd("hub", stop.clone(), down);
                        let result = hub.run(stop);
                        // As ingest's: its consumer and restores are gone.
                        crate::runtime::liveness::rest(&crate::runtime::liveness::HUB[stage]);
                        if let Err(e) = &result {
                            tracing::error!(error = %e, stage, "hub stage failed");
                        }
                        result
                    })
                    .map_err(|e| AppError::Http(e.to_string()))?,
            );
        }
    }

    // Liveness watchdog: a loop stuck in a call that never returns ends the process. It watches
    // through the shutdown too (until every stage has been joined): a loop stuck while the
    // process shuts down would otherwise hold its partitions, delivering nothing, for good (seen
    // in the fault suite: an instance whose hub stage was fenced never finished shutting down).
    let watchdog_off = WatchdogOff(Arc::new(AtomicBool::new(false)));
    {
        let (off, limit) = (watchdog_off.0.clone(), config.stall_timeout);
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                while !off.load(Ordering::SeqCst) {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                    if let Some(stage) = crate::runtime::liveness::stalled(limit) {
                        tracing::error!(
                            stage,
                            stall_timeout = ?limit,
                            "a stage has not turned within STREAMING_HUB_STALL_TIMEOUT; exiting so the process is restarted"
                        );
                        std::process::exit(70);
                    }
                }
            })
            .map_err(|e| AppError::Http(e.to_string()))?;
    }

    let broker = Arc::new(AtomicBool::new(true)); // the topology was just applied through it
    watch_broker(&config, broker.clone(), stop.clone())?;
    let health = Health {
        ready: ready.clone(),
        metrics,
        table: table.clone(),
        broker,
        served: Arc::default(),
    };
    let probes = || -> Router<Health> {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
    };
    // `/metrics` on its own address when one is set (it names tenants and takes no token), and
    // the health endpoints on both.
    let metrics_router: Option<Router> = metrics_listener.is_some().then(|| {
        probes()
            .route("/metrics", get(metrics_text))
            .fallback(api::no_route)
            .with_state(health.clone())
    });
    let mut router: Router = match metrics_router {
        Some(_) => probes().with_state(health),
        None => probes()
            .route("/metrics", get(metrics_text))
            .with_state(health),
    };
    if config.kek.is_empty() {
        tracing::warn!(
            "STREAMING_HUB_KEK is not set: the subscription API is off (it cannot seal secrets)"
        );
        router = router.fallback(api::api_off);
    } else {
        let subs = Subscriptions::kafka(&config, codec.clone(), table.clone())
            .map_err(|e| AppError::Http(e.to_string()))?;
        let mut state = ApiState::from_config(&config, subs, clock.clone())
            .map_err(|e| AppError::Http(e.to_string()))?;
        state.test_clock = test_clock.clone();
        // Operations: pull, replay, recover, redrive, and the forensics index (its own thread;
        // record times are wall-clock, so it never runs on the test clock).
        let forensics =
            crate::ops::forensics::Forensics::new(config.dlq_retention, Arc::new(SystemClock));
        {
            let (forensics, config, codec, stop) = (
                forensics.clone(),
                config.clone(),
                codec.clone(),
                stop.clone(),
            );
            std::thread::Builder::new()
                .name("forensics".into())
                .spawn(move || {
                    // Started again when it fails or panics: an index that stopped had
                    // `/admin/dlq`, `/admin/quarantine` and `/admin/deliveries/dead` answer 200
                    // with what it held then, for good, telling the operator nothing failed. Not
                    // a stage whose end takes the process down: it is for looking only, and
                    // ingest and delivery must not stop for it.
                    while !stop.load(Ordering::SeqCst) {
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            forensics.follow(&config, codec.clone(), stop.clone())
                        }));
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        match run {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => tracing::error!(error = %e, "forensics index stopped; starting it again in 5 s"),
                            Err(_) => tracing::error!("forensics index panicked; starting it again in 5 s"),
                        }
                        for _ in 0..50 {
                            if stop.load(Ordering::SeqCst) {
                                break;
                            }
                            std::thread::sleep(std::time::Duration::from_millis(100));
                        }
                    }
                })
                .map_err(|e| AppError::Http(e.to_string()))?;
        }
        let redeliver = crate::ops::redeliver::Redeliverer::new(&config, codec.clone())
            .map_err(|e| AppError::Http(e.to_string()))?
            .stopping_with(stop.clone());
        state.ops = Some(Arc::new(crate::api::ops::Ops {
            pull: crate::ops::pull::PullReader::new(&config),
            limiter: crate::ops::ratelimit::RateLimiter::new(config.pull_rate, config.pull_burst),
            redeliver: Arc::new(redeliver),
            forensics,
            progress: Default::default(),
            scans: crate::api::gate::TenantGate::new(1, crate::api::ops::MAX_SCANS),
            pull_reads: Default::default(),
        }));
        let prober = Prober::new(
            state.kek.clone(),
            state.http.clone(),
            state.sinks,
            clock.clone(),
        );
        // Supervised: a panic in a pass (a bug) would otherwise end it for good, silently, and
        // no pending subscription of this instance would be probed again (their deliveries held).
        {
            let (subs, clock, writes) = (state.subs.clone(), clock.clone(), state.write_lock());
            supervised(
                "the pending-verification retrier",
                stop.clone(),
                move |stop| {
                    PendingRetrier::new(subs.clone(), prober.clone(), clock.clone())
                        .with_write_lock(writes.clone())
                        .run(stop)
                },
            );
        }
        // What an auto-disable of this instance's hub loops went over is written again.
        if matches!(config.role, Role::All | Role::Delivery) {
            let reasserter = crate::subscriptions::reassert::Reasserter::new(
                state.subs.clone(),
                clock.clone(),
                state.write_lock(),
            );
            supervised("the auto-disable checker", stop.clone(), move |stop| {
                reasserter.clone().run(stop)
            });
        }
        router = router.merge(
            api::router(state).layer(axum::middleware::from_fn_with_state(
                stop.clone(),
                api::refuse_when_stopping,
            )),
        );
    }
    if config.allow_private_sinks {
        tracing::warn!(
            "STREAMING_HUB_ALLOW_PRIVATE_SINKS is on: webhooks may target private and loopback addresses"
        );
    }
    if config.allow_insecure_sinks {
        tracing::warn!("STREAMING_HUB_ALLOW_INSECURE_SINKS is on: webhooks may use plain http");
    }

    tracing::info!(addr = %config.http_listen_addr, role = ?config.role, "streaming hub running");
    ready.store(true, Ordering::SeqCst);

    // The HTTP server runs until the hub threads have drained: meanwhile `/readyz` answers 503
    // (a load balancer takes the instance out) and `/healthz` and `/metrics` still answer (a
    // liveness probe refused during a drain of up to STREAMING_HUB_SHUTDOWN_TIMEOUT would have
    // the instance killed mid-drain).
    let http_down = Arc::new(tokio::sync::Notify::new());
    let limits = api::serve::Limits {
        max_connections: config.http_max_connections,
        read_timeout: Some(config.http_read_timeout).filter(|t| !t.is_zero()),
        write_stall: api::serve::WRITE_STALL,
    };
    let metrics_server = match (metrics_listener, metrics_router) {
        (Some(listener), Some(router)) => {
            Some(tokio::spawn(api::serve::serve(listener, router, limits, {
                let http_down = http_down.clone();
                async move { http_down.notified().await }
            })))
        }
        _ => None,
    };
    let mut server = tokio::spawn(api::serve::serve(listener, router, limits, {
        let http_down = http_down.clone();
        async move { http_down.notified().await }
    }));
    let server_ended_early = tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            None
        }
        _ = stage_down.notified() => {
            tracing::error!("shutting down after a stage failed");
            None
        }
        ended = &mut server => Some(ended),
    };
    ready.store(false, Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    // Every thread is joined before the first error is returned: the hub loops drain their
    // in-flight attempts and commit their outcomes on the way out, which a return here cut off.
    let mut ingest_error = None;
    // A stage that panicked, or the control reader's error: exit non-zero all the same.
    let mut stage_error = None;
    if let Some(handle) = ingest_thread {
        match tokio::task::spawn_blocking(move || handle.join()).await {
            Ok(Ok(result)) => ingest_error = result.err(),
            _ => {
                tracing::error!("ingest thread panicked");
                stage_error.get_or_insert(AppError::Stage("the ingest thread panicked".into()));
            }
        }
    }
    match tokio::task::spawn_blocking(move || control_thread.join()).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => {
            // Logged by the thread itself as it stopped.
            stage_error.get_or_insert(AppError::Stage(format!("control topic reader: {e}")));
        }
        _ => {
            tracing::error!("control topic reader panicked");
            stage_error.get_or_insert(AppError::Stage("the control topic reader panicked".into()));
        }
    }
    let mut first_error = None;
    for handle in hub_threads {
        match tokio::task::spawn_blocking(move || handle.join()).await {
            Ok(Ok(Err(e))) => {
                first_error.get_or_insert(e);
            }
            Ok(Ok(Ok(()))) => {}
            _ => {
                tracing::error!("hub thread panicked");
                stage_error.get_or_insert(AppError::Stage("a hub thread panicked".into()));
            }
        }
    }
    // Every server waiting on it (the API's, and the metrics one when it has its own address).
    http_down.notify_waiters();
    if let Some(metrics_server) = metrics_server {
        let _ = tokio::time::timeout(HTTP_DRAIN, metrics_server).await;
    }
    let served = match server_ended_early {
        Some(ended) => ended,
        // Requests still in progress get a bounded time: a client that keeps its connection
        // busy (a slow upload, a read that is never finished) would hold the exit for good.
        None => match tokio::time::timeout(HTTP_DRAIN, &mut server).await {
            Ok(ended) => ended,
            Err(_) => {
                tracing::warn!(
                    waited = ?HTTP_DRAIN,
                    "HTTP requests still in progress at exit were cut off"
                );
                server.abort();
                Ok(())
            }
        },
    };
    let served = match served {
        Ok(()) => Ok(()),
        Err(e) => Err(AppError::Http(format!("HTTP server task failed: {e}"))),
    };
    if let Some(e) = ingest_error {
        return Err(e.into());
    }
    if let Some(e) = first_error {
        return Err(e.into());
    }
    if let Some(e) = stage_error {
        return Err(e);
    }
    served
}

/// How long the HTTP server waits at exit for requests still in progress, once the stages have
/// stopped (the requests had the whole drain as well).
const HTTP_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Dropped when a stage's thread ends, by returning or by panicking: a stage that ends while the
/// process is not stopping shuts the process down, so it is restarted instead of running on
/// without it (a panicked control reader left the subscription table frozen, unnoticed).
struct StageEnd(&'static str, Arc<AtomicBool>, Arc<tokio::sync::Notify>);

impl Drop for StageEnd {
    fn drop(&mut self) {
        if !self.1.load(Ordering::SeqCst) {
            tracing::error!(
                stage = self.0,
                panicked = std::thread::panicking(),
                "a stage stopped on its own; the process shuts down so it can be restarted"
            );
            self.2.notify_one();
        }
    }
}

/// What `/readyz` answers (see [`readiness`]).
#[derive(Debug, Clone, Copy)]
struct ReadyState {
    started: bool,
    table_caught_up: bool,
    joining: bool,
    restoring: bool,
    broker: bool,
    /// `/readyz` answered 200 before.
    served: bool,
}

/// Ready once started, with the subscription table caught up, every loop in its consumer group
/// (its share of the partitions handed out: see `runtime::orphans::Joining`), no store being
/// restored and the broker answering; else the first reason (and while shutting down).
///
/// Restores count only until the instance was first ready: a new instance of a rolling update
/// is not ready before it can serve its share, but one already serving stays ready while it
/// restores what a rebalance gave it (an instance leaving has every other restore its
/// partitions at once: all answering 503 took the whole API out of a load balancer, `/admin`
/// included, when the operator needs it).
fn readiness(s: ReadyState) -> Result<(), &'static str> {
    if !s.started {
        Err("not ready: starting or stopping")
    } else if !s.table_caught_up {
        Err("not ready: subscription table catching up")
    } else if s.joining {
        Err("not ready: joining the consumer group")
    } else if s.restoring && !s.served {
        Err("not ready: restoring stores")
    } else if !s.broker {
        Err("not ready: broker unreachable")
    } else {
        Ok(())
    }
}

async fn readyz(State(h): State<Health>) -> (StatusCode, &'static str) {
    let state = ReadyState {
        started: h.ready.load(Ordering::SeqCst),
        table_caught_up: h.table.is_caught_up(),
        joining: crate::runtime::orphans::joining() > 0,
        restoring: crate::hub::task::RESTORING.load(Ordering::SeqCst) > 0,
        broker: h.broker.load(Ordering::SeqCst),
        served: h.served.load(Ordering::SeqCst),
    };
    match readiness(state) {
        Ok(()) => {
            h.served.store(true, Ordering::SeqCst);
            (StatusCode::OK, "ready")
        }
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

async fn metrics_text(State(h): State<Health>) -> String {
    h.metrics.render() + &crate::runtime::telemetry::render_backlog()
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restores_hold_readiness_back_only_until_the_instance_was_first_ready() {
        let ready = ReadyState {
            started: true,
            table_caught_up: true,
            joining: false,
            restoring: false,
            broker: true,
            served: false,
        };
        assert_eq!(readiness(ready), Ok(()));
        let restoring = ReadyState {
            restoring: true,
            ..ready
        };
        assert_eq!(readiness(restoring), Err("not ready: restoring stores"));
        let served = ReadyState {
            served: true,
            ..restoring
        };
        assert_eq!(readiness(served), Ok(()), "a later restore keeps it ready");
        // Everything else still counts after the first 200.
        for (state, why) in [
            (
                ReadyState {
                    started: false,
                    ..served
                },
                "not ready: starting or stopping",
            ),
            (
                ReadyState {
                    table_caught_up: false,
                    ..served
                },
                "not ready: subscription table catching up",
            ),
            (
                ReadyState {
                    broker: false,
                    ..served
                },
                "not ready: broker unreachable",
            ),
        ] {
            assert_eq!(readiness(state), Err(why));
        }
    }
}
