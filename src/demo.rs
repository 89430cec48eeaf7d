//! `streaming-hub demo`: a producer of sample platform events and a live view of what the running
//! hub did with them, read from its `/metrics`. It creates the producer topic if needed, writes
//! ledger events for a few tenants (with an occasional producer retry, i.e. a duplicate `ce-id`),
//! a system event (dropped) and a malformed record (quarantined) every few seconds.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::config::Config;
use crate::runtime::kafka;

pub struct DemoOptions {
    pub topic: String,
    pub rate: u32,
    pub duration: Option<Duration>,
    pub hub_url: String,
}

pub async fn run(config: &Config, opts: DemoOptions) -> Result<(), String> {
    let admin = kafka::admin(config).map_err(|e| e.to_string())?;
    let topic = NewTopic::new(
        &opts.topic,
        3,
        TopicReplication::Fixed(config.replication_factor),
    );
    let _ = admin.create_topics(&[topic], &AdminOptions::new()).await; // exists already: fine
    let producer: FutureProducer = kafka::base(config)
        .set("linger.ms", "5")
        .create()
        .map_err(|e| e.to_string())?;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        // Idle less than the hub's read timeout, which closes keep-alive connections.
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let tenants = ["acme-bank", "globex-pay", "initech-credit"];
    if !config.jwt_secret.is_empty() {
        let receiver = start_receiver().await?;
        for tenant in &tenants[..2] {
            let token = crate::api::mint(
                &config.jwt_secret,
                Some(tenant),
                false,
                Duration::from_secs(3600),
            );
            let body = serde_json::json!({
                "event_types": ["transaction.*"],
                "origin": "ledger",
                "destination": {"type": "webhook", "url": receiver},
            });
            let resp = http
                .post(format!("{}/v1/subscriptions", opts.hub_url))
                .bearer_auth(token)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .map_err(|e| format!("creating a subscription: {e}"))?;
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            println!(
                "subscription for {tenant}: HTTP {status}, id {}, verification {}",
                v["id"].as_str().unwrap_or("?"),
                v["verification_state"].as_str().unwrap_or("?")
            );
        }
    }
    let started = Instant::now();
    let mut sent = 0u64;
    // The last ledger event (tenant, ce-id): a producer retry re-sends it with the same ce-id.
    let mut last: Option<(&str, String)> = None;
    // At least 1 µs apart: a period that rounds to zero panics in tokio.
    let period =
        Duration::from_secs_f64(1.0 / opts.rate.max(1) as f64).max(Duration::from_micros(1));
    let mut tick = tokio::time::interval(period);
    let mut last_print = Instant::now();
    println!(
        "producing sample events to {} at {}/s; watching {}",
        opts.topic, opts.rate, opts.hub_url
    );
    loop {
        if opts.duration.is_some_and(|d| started.elapsed() >= d) {
            break;
        }
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => break,
        }
        let mut tenant = tenants[(sent % 3) as usize];
        let kind = match sent % 50 {
            17 => Sample::System,
            33 => Sample::Malformed,
            41 if last.is_some() => {
                let (t, id) = last.clone().expect("checked");
                tenant = t;
                Sample::Retry(id)
            }
            _ => Sample::Ledger,
        };
        let (key, headers, value, id) = sample(tenant, &kind, sent);
        if matches!(kind, Sample::Ledger) {
            last = Some((tenant, id));
        }
        let mut hs = OwnedHeaders::new();
        for (k, v) in &headers {
            hs = hs.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        let record = FutureRecord::to(&opts.topic)
            .key(&key)
            .payload(&value)
            .headers(hs);
        if let Err((e, _)) = producer.send(record, Duration::from_secs(5)).await {
            eprintln!("demo: produce failed: {e}");
        }
        sent += 1;
        if last_print.elapsed() >= Duration::from_secs(1) {
            last_print = Instant::now();
            let m = scrape(&http, &opts.hub_url).await;
            println!(
                "[{:>4}s] produced {sent:>6} | accepted {:>6} dropped {:>4} quarantined {:>4} | hub: new {:>6} duplicates {:>4} | matched {:>6} delivered {:>6}",
                started.elapsed().as_secs(),
                m.get("accept").copied().unwrap_or(0),
                m.get("drop").copied().unwrap_or(0),
                m.get("quarantine").copied().unwrap_or(0),
                m.get("new").copied().unwrap_or(0),
                m.get("duplicate").copied().unwrap_or(0),
                m.get("matched").copied().unwrap_or(0),
                m.get("delivered").copied().unwrap_or(0),
            );
        }
    }
    let m = scrape(&http, &opts.hub_url).await;
    println!(
        "demo done: produced {sent}, accepted {}, dropped {}, quarantined {}, processed {} ({} duplicates dropped), delivered {}",
        m.get("accept").copied().unwrap_or(0),
        m.get("drop").copied().unwrap_or(0),
        m.get("quarantine").copied().unwrap_or(0),
        m.get("new").copied().unwrap_or(0),
        m.get("duplicate").copied().unwrap_or(0),
        m.get("delivered").copied().unwrap_or(0),
    );
    if opts.duration.is_some() {
        // CI mode: the run must have shown each thing the demo is for.
        let missing: Vec<&str> = ["delivered", "drop", "quarantine"]
            .into_iter()
            .filter(|k| m.get(*k).copied().unwrap_or(0) == 0)
            .collect();
        if !missing.is_empty() {
            return Err(format!("the run showed no {}", missing.join(", no ")));
        }
    }
    Ok(())
}

enum Sample {
    Ledger,
    System,
    Malformed,
    Retry(String),
}

type Built = (String, Vec<(&'static str, String)>, String, String);

fn sample(tenant: &str, kind: &Sample, n: u64) -> Built {
    let id = match kind {
        Sample::Retry(id) => id.clone(),
        _ => uuid::Uuid::now_v7().to_string(),
    };
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
    let (source, resource, event) = match kind {
        Sample::System => ("platform-reaper", "platform", "reaper_pass"),
        _ if n % 2 == 0 => ("ledger", "transaction", "posted"),
        _ => ("ledger", "account", "created"),
    };
    let mut h: Vec<(&'static str, String)> = vec![
        ("ce-specversion", "1.0".into()),
        ("ce-id", id.clone()),
        ("ce-source", source.into()),
        (
            "ce-type",
            format!("studio.lerian.{source}.{resource}.{event}"),
        ),
        ("ce-time", now),
        ("ce-schemaversion", "1.0.0".into()),
        ("ce-resourcetype", resource.into()),
        ("ce-eventtype", event.into()),
        ("ce-datacontenttype", "application/json".into()),
    ];
    let key = match kind {
        Sample::System => {
            h.push(("ce-systemevent", "true".into()));
            format!("system:{event}")
        }
        Sample::Malformed => {
            h.retain(|(k, _)| *k != "ce-time");
            h.push(("ce-time", "yesterday".into()));
            h.push(("ce-tenantid", tenant.into()));
            tenant.to_string()
        }
        _ => {
            h.push(("ce-tenantid", tenant.into()));
            h.push(("ce-subject", format!("acc-{}", n % 97)));
            tenant.to_string()
        }
    };
    let value = format!(
        r#"{{"id":"{id}","amount":"{}.{:02}","currency":"BRL"}}"#,
        n % 1000,
        n % 100
    );
    (key, h, value, id)
}

/// Verdict and hub outcome counters from the hub's `/metrics`.
async fn scrape(http: &reqwest::Client, base: &str) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let Ok(resp) = http.get(format!("{base}/metrics")).send().await else {
        return out;
    };
    let Ok(text) = resp.text().await else {
        return out;
    };
    for line in text.lines() {
        let label = if line.starts_with("streaming_hub_ingest_records_total{") {
            line.split("verdict=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
        } else if line.starts_with("streaming_hub_matches_total") {
            Some("matched")
        } else if line.starts_with("streaming_hub_attempts_total{outcome=\"delivered\"") {
            Some("delivered")
        } else if line.starts_with("streaming_hub_hub_events_total{") {
            line.split("outcome=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
        } else {
            None
        };
        if let (Some(label), Some(v)) = (
            label,
            line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()),
        ) {
            *out.entry(label.to_string()).or_default() += v as u64;
        }
    }
    out
}

/// A local receiver: answers the verification challenge (it echoes the body, which carries it).
async fn start_receiver() -> Result<String, String> {
    let app = axum::Router::new().route(
        "/webhook",
        axum::routing::post(|body: String| async move { body }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(format!("http://{addr}/webhook"))
}
