//! `streaming-hub bench <stage>`: measures one stage against the real broker, in-process, with
//! the same code the hub runs. The input is written first (not timed); then the stage starts and
//! the clock runs until the stage's consumer group has committed the end of its input.
//!
//! - `ingest`: N CloudEvents records of `--size` bytes over 100 tenants → classify → inbox.
//! - `hub`: N inbox records → dedup + sequence (one transaction per batch), then a second run on an
//!   empty state directory measures restore speed from the changelogs.
//!
//! Each prints one JSON line: records, seconds, records/s, CPU seconds of this process (the stage
//! and its Kafka client threads) and of the broker (from its pid file) per 1,000 records.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::hub::task::{HubStage, NoHandler};
use crate::ingest::pipeline::Ingest;
use crate::runtime::avro::Codec;
use crate::runtime::clock::SystemClock;
use crate::runtime::kafka;
use crate::runtime::topology::Topology;

pub struct BenchOptions {
    pub stage: String,
    pub records: usize,
    pub size: usize,
    pub broker_pid_file: Option<String>,
    /// Reuse this run's topic prefix instead of a new one (the input writer of `jobs`).
    pub prefix: Option<String>,
    /// Only write the stage's input, then exit (`jobs` runs it as a child process, so the input
    /// producer's buffers never count in the stage's memory).
    pub input_only: bool,
}

pub async fn run(config: &Config, opts: BenchOptions) -> Result<(), String> {
    if opts.stage == "match" {
        println!("{}", bench_match(opts.records));
        return Ok(());
    }
    if opts.stage == "deliver" {
        // Its own runtimes are started, blocked on and dropped: not on this async one.
        let (config, records, size) = (config.clone(), opts.records, opts.size);
        let out = std::thread::spawn(move || bench_deliver(&config, records, size))
            .join()
            .map_err(|_| "the deliver bench panicked".to_string())??;
        println!("{out}");
        return Ok(());
    }
    let run_id = match &opts.prefix {
        Some(p) => p.trim_start_matches("bench").to_string(),
        None => uuid::Uuid::now_v7().simple().to_string()[20..].to_string(),
    };
    let mut config = config.clone();
    config.topic_prefix = format!("bench{run_id}");
    config.group_id = format!("bench{run_id}");
    config.instance_id = format!("bench{run_id}");
    config.state_dir = std::env::temp_dir().join(format!("bench{run_id}"));
    if opts.input_only {
        let inbox = format!("{}.inbox", config.topic_prefix);
        return produce(&config, &inbox, opts.records, opts.size, true);
    }
    let topology = Topology::load(&config.topology_file, &config).map_err(|e| e.to_string())?;
    topology
        .apply(&config, false)
        .await
        .map_err(|e| e.to_string())?;
    let out = match opts.stage.as_str() {
        "ingest" => bench_ingest(&config, &opts).await?,
        "hub" => bench_hub(&config, &opts).await?,
        "jobs" => bench_pending_jobs(&config, &opts).await?,
        other => {
            return Err(format!(
                "unknown stage {other:?}: ingest, hub, jobs, match or deliver"
            ));
        }
    };
    let _ = std::fs::remove_dir_all(&config.state_dir);
    println!("{out}");
    Ok(())
}

async fn bench_ingest(config: &Config, opts: &BenchOptions) -> Result<String, String> {
    let topic = format!("lerian.streaming.{}", config.topic_prefix);
    create_topic(config, &topic, 6).await?;
    let mut config = config.clone();
    config.follow_pattern = format!("^{}$", topic.replace('.', r"\."));
    let started = Instant::now();
    produce(&config, &topic, opts.records, opts.size, false)?;
    eprintln!(
        "bench: wrote {} input records in {:?}",
        opts.records,
        started.elapsed()
    );
    let ingest = Ingest::new(&config, Arc::new(SystemClock)).map_err(|e| e.to_string())?;
    let m = measure(&config, opts, &topic, &config.group_id, move |stop| {
        ingest.run(stop).map_err(|e| e.to_string())
    })?;
    Ok(format!(
        r#"{{"bench":"ingest","record_bytes":{},{m}}}"#,
        opts.size
    ))
}

async fn bench_hub(config: &Config, opts: &BenchOptions) -> Result<String, String> {
    let inbox = format!("{}.inbox", config.topic_prefix);
    produce(config, &inbox, opts.records, opts.size, true)?;
    let codec = Arc::new(Codec::new().map_err(|e| e.to_string())?);
    let mut stage = HubStage::new(
        config,
        codec.clone(),
        Arc::new(SystemClock),
        Box::new(NoHandler),
    );
    let m = measure(config, opts, &inbox, &config.hub_group_id(), move |stop| {
        stage.run(stop).map_err(|e| e.to_string())
    })?;
    // Restore: an empty state directory, a new instance; time until the stores are rebuilt.
    std::fs::remove_dir_all(&config.state_dir).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let partitions: Vec<i32> = (0..6).collect();
    let restored =
        crate::hub::task::restore_only(config, codec, &partitions).map_err(|e| e.to_string())?;
    let secs = started.elapsed().as_secs_f64();
    Ok(format!(
        r#"{{"bench":"hub","record_bytes":{},{m},"restore_records":{restored},"restore_seconds":{secs:.3},"restore_records_per_s":{:.0}}}"#,
        opts.size,
        restored as f64 / secs
    ))
}

/// Pending jobs held on disk: N events for 100 tenants, each tenant with a webhook subscription
/// whose destination refuses connections (127.0.0.1:9), so every job stays pending (the breakers
/// open and shed them). Reports the process's resident memory once all N jobs exist.
async fn bench_pending_jobs(config: &Config, opts: &BenchOptions) -> Result<String, String> {
    use crate::dispatch::DispatchJobs;
    use crate::dispatch::worker::Workers;
    use crate::hub::task::Dispatch;
    use crate::runtime::records::{DestinationType, SubscriptionRecord};
    use crate::subscriptions::secrets::{Kek, generate_signing_secret};
    use crate::subscriptions::table::SharedTable;
    use base64::Engine;

    let mut config = config.clone();
    config.allow_private_sinks = true;
    config.allow_insecure_sinks = true;
    let inbox = format!("{}.inbox", config.topic_prefix);
    // The input is written by a child process: the producer's buffers (librdkafka's, in the C
    // heap, which keeps them resident after they are freed) must not count in the stage's memory.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let status = std::process::Command::new(exe)
        .args([
            "bench",
            "jobs",
            "--input-only",
            "--prefix",
            &config.topic_prefix,
        ])
        .args(["--records", &opts.records.to_string()])
        .args(["--size", &opts.size.to_string()])
        .status()
        .map_err(|e| format!("input writer: {e}"))?;
    if !status.success() {
        return Err(format!("input writer failed: {status}"));
    }
    let kek = Arc::new(
        Kek::new(
            "bench",
            &base64::engine::general_purpose::STANDARD.encode([7u8; 32]),
        )
        .map_err(|e| e.to_string())?,
    );
    let table = SharedTable::default();
    table.apply(|t| {
        for i in 0..100 {
            let id = format!("sub-{i}");
            let mut sub = SubscriptionRecord::pull(&id, &format!("tenant-{i}"), &["*"]);
            sub.destination.kind = DestinationType::Webhook;
            sub.destination.url = Some("http://127.0.0.1:9/refused".into());
            sub.signing_secrets = vec![kek.seal_secret(&generate_signing_secret(), &id, None)];
            t.upsert(sub);
        }
    });
    table.set_caught_up();
    let codec = Arc::new(Codec::new().map_err(|e| e.to_string())?);
    let clock: crate::runtime::clock::SharedClock = Arc::new(SystemClock);
    let workers = Workers {
        http: crate::delivery::client::build_client(&config).map_err(|e| e.to_string())?,
        kek: Some(kek),
        clock: clock.clone(),
        urls: crate::delivery::client::CheckedUrls::new(true, true),
        permits: crate::dispatch::fair::FairPermits::new(config.dispatch_workers),
        http_timeout_ms: config.http_timeout.as_millis() as i64,
    };
    let dispatch = Dispatch::new(
        table.clone(),
        workers,
        tokio::runtime::Handle::current(),
        &config,
    );
    let handler = DispatchJobs::new(table, format!("{}.pull", config.topic_prefix));
    let mut stage = HubStage::new(&config, codec, clock, Box::new(handler)).with_dispatch(dispatch);
    let m = measure(&config, opts, &inbox, &config.hub_group_id(), move |stop| {
        stage.run(stop).map_err(|e| e.to_string())
    })?;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok(format!(
        r#"{{"bench":"pending_jobs","record_bytes":{},{m},"rss_mib_after":{},"peak_rss_mib":{}}}"#,
        opts.size,
        kb("VmRSS:") / 1024,
        kb("VmHWM:") / 1024
    ))
}

/// Runs `stage` on a thread until `group` has committed the end of `topic`; returns JSON fields.
fn measure(
    config: &Config,
    opts: &BenchOptions,
    topic: &str,
    group: &str,
    stage: impl FnOnce(Arc<AtomicBool>) -> Result<(), String> + Send + 'static,
) -> Result<String, String> {
    let ends = end_offsets(config, topic)?;
    let stop = Arc::new(AtomicBool::new(false));
    let cpu0 = cpu_seconds("self");
    let broker0 = opts
        .broker_pid_file
        .as_deref()
        .and_then(pid_of)
        .map(|p| cpu_seconds(&p));
    let started = Instant::now();
    let s = stop.clone();
    let handle = std::thread::spawn(move || stage(s));
    let deadline = Instant::now() + Duration::from_secs(900);
    while !caught_up(config, group, topic, &ends)? {
        if handle.is_finished() || Instant::now() > deadline {
            stop.store(true, Ordering::SeqCst);
            return Err(format!("stage stopped or timed out: {:?}", handle.join()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds("self") - cpu0;
    let broker = match (broker0, opts.broker_pid_file.as_deref().and_then(pid_of)) {
        (Some(b0), Some(p)) => format!(
            "{:.3}",
            (cpu_seconds(&p) - b0) * 1000.0 / opts.records as f64
        ),
        _ => "null".into(),
    };
    stop.store(true, Ordering::SeqCst);
    let _ = handle.join();
    Ok(format!(
        r#""records":{},"seconds":{secs:.3},"records_per_s":{:.0},"cpu_s_per_1k":{:.4},"broker_cpu_s_per_1k":{broker}"#,
        opts.records,
        opts.records as f64 / secs,
        cpu * 1000.0 / opts.records as f64
    ))
}

pub(crate) async fn create_topic(
    config: &Config,
    topic: &str,
    partitions: i32,
) -> Result<(), String> {
    let admin = kafka::admin(config).map_err(|e| e.to_string())?;
    let t = NewTopic::new(
        topic,
        partitions,
        TopicReplication::Fixed(config.replication_factor),
    );
    admin
        .create_topics(&[t], &AdminOptions::new())
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The platform's header set for a bench event (`ledger`'s `transaction.posted`).
fn event_headers<'a>(id: &'a str, tenant: &'a str, now: &'a str) -> [(&'static str, &'a str); 10] {
    [
        ("ce-specversion", "1.0"),
        ("ce-id", id),
        ("ce-source", "ledger"),
        ("ce-type", "studio.lerian.ledger.transaction.posted"),
        ("ce-time", now),
        ("ce-schemaversion", "1.0.0"),
        ("ce-resourcetype", "transaction"),
        ("ce-eventtype", "posted"),
        ("ce-datacontenttype", "application/json"),
        ("ce-tenantid", tenant),
    ]
}

/// Writes `n` records: CloudEvents keyed by tenant, or inbox-shaped records when `inbox`.
fn produce(config: &Config, topic: &str, n: usize, size: usize, inbox: bool) -> Result<(), String> {
    let producer: BaseProducer = kafka::base(config)
        .set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .set("queue.buffering.max.messages", "500000")
        .set("partitioner", "murmur2_random")
        .create()
        .map_err(|e| e.to_string())?;
    let value = vec![b'x'; size];
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    for i in 0..n {
        let tenant = format!("tenant-{}", i % 100);
        let id = uuid::Uuid::now_v7().to_string();
        let mut h = OwnedHeaders::new_with_capacity(12);
        for (k, v) in event_headers(&id, &tenant, &now) {
            h = h.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        if inbox {
            h = h.insert(Header {
                key: crate::ingest::pipeline::H_INGEST_TIME,
                value: Some(now.as_str()),
            });
        }
        let mut record = BaseRecord::<str, [u8]>::to(topic)
            .key(&tenant)
            .payload(&value)
            .headers(h);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((_, r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(5));
                }
            }
        }
        if i % 1000 == 0 {
            producer.poll(Duration::ZERO);
        }
    }
    producer
        .flush(Duration::from_secs(120))
        .map_err(|e| e.to_string())
}

fn end_offsets(config: &Config, topic: &str) -> Result<Vec<(i32, i64)>, String> {
    let c: BaseConsumer = kafka::base(config).create().map_err(|e| e.to_string())?;
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for p in md.topics()[0].partitions() {
        let (_, high) = c
            .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        out.push((p.id(), high));
    }
    Ok(out)
}

fn caught_up(
    config: &Config,
    group: &str,
    topic: &str,
    ends: &[(i32, i64)],
) -> Result<bool, String> {
    let c: BaseConsumer = kafka::base(config)
        .set("group.id", group)
        .create()
        .map_err(|e| e.to_string())?;
    let mut tpl = TopicPartitionList::new();
    for (p, _) in ends {
        tpl.add_partition(topic, *p);
    }
    let committed = c
        .committed_offsets(tpl, Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    Ok(ends.iter().all(|(p, high)| {
        *high == 0
            || matches!(committed.find_partition(topic, *p).map(|e| e.offset()), Some(Offset::Offset(o)) if o >= *high)
    }))
}

fn pid_of(file: &str) -> Option<String> {
    std::fs::read_to_string(file)
        .ok()
        .map(|s| s.trim().to_string())
}

/// User + system CPU seconds of a process (`self` or a pid), from /proc.
pub(crate) fn cpu_seconds(pid: &str) -> f64 {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// User + system CPU seconds in a `/proc/.../stat` file (a process's or a thread's); 0 when
/// unreadable.
fn stat_cpu_seconds(path: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0.0;
    };
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0 // utime, stime (fields 14, 15), USER_HZ = 100
}

/// The delivery workers alone: `records` attempts of `size`-byte events (the platform's header
/// set, 100 tenants with one webhook each) through [`Workers`](crate::dispatch::worker::Workers)
/// on their own runtime (`STREAMING_HUB_DISPATCH_WORKERS` permits, at most 4,096 claimed ahead),
/// to a sink on 127.0.0.1 that answers 200 at once, on a runtime of its own. No Kafka: what an
/// attempt costs in CPU, per thread group (the workers' runtime, the caller building the
/// attempts as the hub loop does, the sink), read from `/proc/self/task`.
fn bench_deliver(config: &Config, records: usize, size: usize) -> Result<String, String> {
    if records == 0 {
        return Err("--records must be at least 1".into());
    }
    use crate::dispatch::EventView;
    use crate::dispatch::worker::{Attempt, Workers};
    use crate::runtime::records::{DestinationType, SubscriptionRecord};
    use crate::subscriptions::secrets::{Kek, generate_signing_secret};
    use base64::Engine;

    let sink_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-sink")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let listener = sink_rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(|e| e.to_string())?; // (a plain thread: no runtime around it)
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let app = axum::Router::new().route(
        "/hook/{tenant}",
        axum::routing::post(|_body: axum::body::Bytes| async { axum::http::StatusCode::OK }),
    );
    sink_rt.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let workers_rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("bench-workers")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;

    let kek = Arc::new(
        Kek::new(
            "bench",
            &base64::engine::general_purpose::STANDARD.encode([7u8; 32]),
        )
        .map_err(|e| e.to_string())?,
    );
    let subs: Vec<crate::subscriptions::table::Sub> = (0..100)
        .map(|i| {
            let id = format!("sub-{i}");
            let mut sub = SubscriptionRecord::pull(&id, &format!("tenant-{i}"), &["*"]);
            sub.destination.kind = DestinationType::Webhook;
            sub.destination.url = Some(format!("http://{addr}/hook/tenant-{i}"));
            sub.signing_secrets = vec![kek.seal_secret(&generate_signing_secret(), &id, None)];
            Arc::new(sub)
        })
        .collect();
    let clock: crate::runtime::clock::SharedClock = Arc::new(SystemClock);
    let workers = Workers {
        http: crate::delivery::client::build_client(&Config {
            allow_private_sinks: true,
            allow_insecure_sinks: true,
            ..config.clone()
        })
        .map_err(|e| e.to_string())?,
        kek: Some(kek),
        clock: clock.clone(),
        urls: crate::delivery::client::CheckedUrls::new(true, true),
        permits: crate::dispatch::fair::FairPermits::new(config.dispatch_workers),
        http_timeout_ms: config.http_timeout.as_millis() as i64,
    };
    let body = bytes::Bytes::from(vec![b'x'; size]);
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let ahead = (config.dispatch_workers * 64).min(4096);
    let cpu0 = thread_cpu_seconds();
    let started = Instant::now();
    let (mut sent, mut done, mut delivered) = (0usize, 0usize, 0usize);
    let mut last_outcome = Instant::now();
    while done < records {
        while sent < records && sent - done < ahead {
            let i = sent % subs.len();
            let id = uuid::Uuid::now_v7().to_string();
            let tenant = format!("tenant-{i}");
            let headers = event_headers(&id, &tenant, &now)
                .into_iter()
                .chain([(crate::ingest::pipeline::H_INGEST_TIME, now.as_str())]);
            let event = EventView::new(headers.map(|(k, v)| (k, Some(v.as_bytes()))), body.clone());
            let a = Attempt {
                partition: 0,
                job_key: id.as_bytes().to_vec(),
                attempt: 1,
                lease_until: clock.now_ms() + 3_600_000,
                event_id: id,
                tenant,
                subscription: subs[i].clone(),
                event,
                sole_payload: None,
                holds_long: false,
            };
            workers.spawn(workers_rt.handle(), a, done_tx.clone());
            sent += 1;
        }
        // As the hub loop does: outcomes are taken when it comes round, never waited for on
        // the channel (a blocked receiver costs every worker a wake-up call per outcome).
        let mut got = 0;
        while let Ok(o) = done_rx.try_recv() {
            got += 1;
            delivered += usize::from(o.success());
        }
        done += got;
        if got == 0 {
            if last_outcome.elapsed() > Duration::from_secs(60) {
                return Err(format!("no outcome within 60 s ({done} of {sent} back)"));
            }
            std::thread::sleep(Duration::from_millis(1));
        } else {
            last_outcome = Instant::now();
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu1 = thread_cpu_seconds();
    if delivered < records {
        return Err(format!(
            "{} of {} attempts failed",
            records - delivered,
            records
        ));
    }
    let per = |group: &str| {
        let used =
            cpu1.get(group).copied().unwrap_or(0.0) - cpu0.get(group).copied().unwrap_or(0.0);
        used * 1e6 / records as f64
    };
    Ok(format!(
        r#"{{"bench":"deliver","attempts":{},"body_bytes":{},"workers":{},"seconds":{secs:.2},"attempts_per_s":{:.0},"cpu_us_per_attempt":{{"workers":{:.1},"caller":{:.1},"sink":{:.1}}}}}"#,
        records,
        size,
        config.dispatch_workers,
        records as f64 / secs,
        per("bench-workers"),
        per("caller"),
        per("bench-sink"),
    ))
}

/// CPU seconds of this process's threads by group: the named runtimes' threads under their
/// name, every other thread as `caller`.
fn thread_cpu_seconds() -> std::collections::HashMap<String, f64> {
    let mut out = std::collections::HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let group = match comm.trim() {
            c if c.starts_with("bench-workers") => "bench-workers",
            c if c.starts_with("bench-sink") => "bench-sink",
            _ => "caller",
        };
        let stat = t.path().join("stat");
        *out.entry(group.to_string()).or_default() += stat_cpu_seconds(&stat.to_string_lossy());
    }
    out
}

/// Matching cost: 100,000 subscriptions over 1,000 tenants (100 each, over 100 event types, a
/// tenth of them wildcards on other resources), events that match exactly one subscription.
fn bench_match(events: usize) -> String {
    use crate::runtime::records::SubscriptionRecord;
    use crate::subscriptions::table::{EventRef, Table};
    let mut table = Table::default();
    for t in 0..1000 {
        for k in 0..100 {
            let types = if k % 10 == 9 {
                vec![format!("other{k}.*")]
            } else {
                vec![format!("res{k}.created")]
            };
            let mut sub =
                SubscriptionRecord::pull(&format!("sub-{t}-{k}"), &format!("tenant-{t}"), &[]);
            sub.origin = Some("ledger".into());
            sub.event_types = types;
            sub.schema_major = Some(1);
            table.upsert(sub);
        }
    }
    let tenants: Vec<String> = (0..1000).map(|t| format!("tenant-{t}")).collect();
    let resources: Vec<String> = (0..100).map(|k| format!("res{k}")).collect();
    let started = Instant::now();
    let mut matched = 0usize;
    for i in 0..events {
        let k = (i * 7) % 100;
        let k = if k % 10 == 9 { k - 1 } else { k };
        let e = EventRef {
            tenant: &tenants[i % 1000],
            source: "ledger",
            resource: &resources[k],
            event: "created",
            schema_major: 1,
        };
        matched += std::hint::black_box(table.matches(&e)).len();
    }
    let secs = started.elapsed().as_secs_f64();
    format!(
        r#"{{"bench":"match","subscriptions":{},"tenants":1000,"events":{events},"matches":{matched},"ns_per_event":{:.0}}}"#,
        table.len(),
        secs * 1e9 / events as f64
    )
}
