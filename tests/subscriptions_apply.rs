//! `streaming-hub subscriptions apply -f file.json` and the pending-verification retrier, through
//! the real binary and the real broker: subscriptions applied from a file show up in a running
//! hub's API (the webhook verified against a real local HTTP server, its secret printed once and
//! really the one that signs), a second apply of the same file writes nothing, an invalid file is
//! refused whole, and a webhook whose endpoint comes up late is made `active` by the retrier with
//! no call to `/verify`.
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::*;
use serde_json::{Value, json};
use streaming_hub::config::Config;
use streaming_hub::runtime::avro::Codec;
use streaming_hub::runtime::clock::{SharedClock, SystemClock};
use streaming_hub::runtime::records::VerificationState;
use streaming_hub::runtime::secret::Secret;
use streaming_hub::subscriptions::control::{self, Subscriptions};
use streaming_hub::subscriptions::model::SinkPolicy;
use streaming_hub::subscriptions::pending::{PendingRetrier, Prober};
use streaming_hub::subscriptions::secrets::Kek;
use streaming_hub::subscriptions::table::SharedTable;

/// The hub's environment with the API on and local `http://` sinks allowed; apply runs with it too.
fn env_for(prefix: &str) -> BTreeMap<String, String> {
    let mut env = hub_env(prefix, &format!(r"^lerian\.streaming\.{prefix}$"));
    env.insert("STREAMING_HUB_KEK".into(), KEK.into());
    env.insert("STREAMING_HUB_JWT_SECRET".into(), JWT.into());
    env.insert("STREAMING_HUB_ALLOW_PRIVATE_SINKS".into(), "true".into());
    env.insert("STREAMING_HUB_ALLOW_INSECURE_SINKS".into(), "true".into());
    env.insert("STREAMING_HUB_HTTP_TIMEOUT".into(), "5s".into());
    env
}

/// One request the endpoint received: its headers and body.
type Seen = Arc<Mutex<Vec<(HeaderMap, String)>>>;

/// A local endpoint that answers 503 to its first `fail_first` requests, then echoes the body
/// (which passes verification: the challenge is in it).
async fn endpoint(fail_first: usize) -> (String, Arc<AtomicUsize>, Seen) {
    let hits = Arc::new(AtomicUsize::new(0));
    let seen: Seen = Arc::default();
    let (h, s) = (hits.clone(), seen.clone());
    let app = Router::new().route(
        "/hook",
        post(move |headers: HeaderMap, body: String| {
            let (h, s) = (h.clone(), s.clone());
            async move {
                s.lock().unwrap().push((headers, body.clone()));
                if h.fetch_add(1, Ordering::SeqCst) < fail_first {
                    (StatusCode::SERVICE_UNAVAILABLE, String::new())
                } else {
                    (StatusCode::OK, body)
                }
            }
        }),
    );
    let addr = serve(app).await;
    (format!("http://{addr}/hook"), hits, seen)
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs the binary with `args` and exactly `env` (plus PATH).
async fn binary(env: &BTreeMap<String, String>, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .output()
        .await
        .expect("run streaming-hub");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn apply(env: &BTreeMap<String, String>, file: &Value) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("subscriptions.json");
    std::fs::write(&path, serde_json::to_vec_pretty(file).unwrap()).unwrap();
    binary(
        env,
        &["subscriptions", "apply", "-f", path.to_str().unwrap()],
    )
    .await
}

/// Polls `check` until it gives a value, or panics naming `what` (a condition, not a sleep).
async fn eventually<T, F: Future<Output = Option<T>>>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn token(tenant: &str) -> String {
    streaming_hub::api::mint(
        &Secret::new(JWT),
        Some(tenant),
        false,
        Duration::from_secs(600),
    )
}

async fn get(base: &str, token: &str, path: &str) -> Option<Value> {
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("{base}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    serde_json::from_slice(&r.bytes().await.ok()?).ok()
}

/// Every record of the control topic, as bytes.
async fn control_records(prefix: &str) -> Vec<Got> {
    let topic = format!("{prefix}.subscriptions");
    tokio::task::spawn_blocking(move || read_all(&[&topic], Duration::from_secs(30)))
        .await
        .unwrap()
}

fn secret_lines(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn applied_file_shows_in_the_api_and_a_second_apply_writes_nothing() {
    require_broker();
    let prefix = unique("apply");
    let env = env_for(&prefix);
    let hub = Hub::start(&env);
    let base = format!("http://{}", hub.addr());
    let (url, hits, seen) = endpoint(0).await;
    let (pull, hook) = (
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
    );
    let file = json!([
        {"id": pull, "tenant_id": "tenant-a", "event_types": ["transaction.*"],
         "destination": {"type": "pull"}},
        {"id": hook, "tenant_id": "tenant-a", "origin": "ledger",
         "event_types": ["transaction.created", "account.*"], "retry_schedule": ["5s", "1m"],
         "destination": {"type": "webhook", "url": url, "headers": {"X-Team": "payments"},
                         "sensitive_headers": {"X-Api-Key": "k-123"}}},
    ]);

    let first = apply(&env, &file).await;
    assert_eq!(
        first.code, 0,
        "stdout:\n{}\nstderr:\n{}",
        first.stdout, first.stderr
    );
    assert!(
        first.stdout.contains(&format!("created {pull} v1 active")),
        "{}",
        first.stdout
    );
    assert!(
        first.stdout.contains(&format!("created {hook} v1 active")),
        "{}",
        first.stdout
    );
    let secrets = secret_lines(&first.stdout);
    assert_eq!(
        secrets.len(),
        1,
        "one secret, the webhook's: {}",
        first.stdout
    );
    assert_eq!(secrets[0]["id"], hook.as_str());
    let secret = secrets[0]["signing_secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));
    assert_eq!(hits.load(Ordering::SeqCst), 1, "one verification probe");
    {
        // The printed secret is the one that signed the probe.
        let (headers, body) = seen.lock().unwrap()[0].clone();
        let h = |n: &str| headers[n].to_str().unwrap().to_string();
        let expected = streaming_hub::delivery::signing::sign(
            &Secret::new(secret.clone()),
            &h("webhook-id"),
            h("webhook-timestamp").parse().unwrap(),
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(h("webhook-signature"), expected);
        assert_eq!(h("x-api-key"), "k-123", "sealed header sent");
    }

    // The running hub follows the control topic: both show in its API, the webhook active.
    let tenant = token("tenant-a");
    let listed = eventually(
        "both subscriptions in the API",
        Duration::from_secs(30),
        || {
            let (base, tenant) = (base.clone(), tenant.clone());
            async move {
                let v = get(&base, &tenant, "/v1/subscriptions").await?;
                (v["data"].as_array()?.len() == 2).then_some(v)
            }
        },
    )
    .await;
    assert!(
        !listed.to_string().contains(&secret[6..]),
        "no secret in GET"
    );
    let got = get(&base, &tenant, &format!("/v1/subscriptions/{hook}"))
        .await
        .unwrap();
    assert_eq!(got["verification_state"], "active", "{got}");
    assert_eq!(got["version"], 1);
    assert_eq!(got["origin"], "ledger");
    assert_eq!(got["destination"]["headers"]["x-team"], "payments");
    assert_eq!(
        got["destination"]["sensitive_header_names"],
        json!(["x-api-key"])
    );
    assert_eq!(got["retry_schedule"], json!(["5s", "1m"]));
    let got = get(&base, &tenant, &format!("/v1/subscriptions/{pull}"))
        .await
        .unwrap();
    assert_eq!(
        (
            got["destination"]["type"].as_str(),
            got["verification_state"].as_str()
        ),
        (Some("pull"), Some("active"))
    );
    assert!(
        get(
            &base,
            &token("tenant-b"),
            &format!("/v1/subscriptions/{hook}")
        )
        .await
        .is_none(),
        "another tenant does not see it"
    );
    let records = control_records(&prefix).await.len();
    assert_eq!(records, 2, "one write per new subscription");

    // Again: nothing changes, nothing is written, no secret, no probe.
    let second = apply(&env, &file).await;
    assert_eq!(second.code, 0, "stderr:\n{}", second.stderr);
    assert_eq!(
        second.stdout,
        format!("unchanged {pull}\nunchanged {hook}\n")
    );
    assert_eq!(control_records(&prefix).await.len(), records);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    let log = hub.log_text();
    assert!(!log.contains(&secret[6..]), "secret in the hub's log");
    assert!(!first.stderr.contains(&secret[6..]), "secret on stderr");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_file_exits_2_naming_entry_and_field_and_writes_nothing() {
    require_broker();
    let prefix = unique("applybad");
    let env = env_for(&prefix);
    let topology = binary(&env, &["topology", "apply"]).await;
    assert_eq!(topology.code, 0, "{}", topology.stderr);
    let file = json!([
        {"id": uuid::Uuid::now_v7().to_string(), "tenant_id": "tenant-a",
         "event_types": ["transaction.created"], "destination": {"type": "pull"}},
        {"id": uuid::Uuid::now_v7().to_string(), "tenant_id": "tenant-a",
         "event_types": ["transaction.created"],
         "destination": {"type": "webhook", "url": "ftp://hooks.example/x"}},
        {"id": uuid::Uuid::now_v7().to_string(), "tenant_id": "tenant-a",
         "event_types": ["Transaction.Cre*ated"], "destination": {"type": "pull"}},
    ]);
    let run = apply(&env, &file).await;
    assert_eq!(
        run.code, 2,
        "stdout:\n{}\nstderr:\n{}",
        run.stdout, run.stderr
    );
    assert!(
        run.stderr.contains("entry 1, field destination.url"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("entry 2, field event_types[0]"),
        "{}",
        run.stderr
    );
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert!(
        control_records(&prefix).await.is_empty(),
        "nothing written, not even the valid entry"
    );

    let run = apply(&env, &json!({"not": "an array"})).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pending_webhook_becomes_active_through_the_retrier_without_verify() {
    require_broker();
    let prefix = unique("applyretry");
    let env = env_for(&prefix);
    let hub = Hub::start(&env);
    let base = format!("http://{}", hub.addr());
    let (url, hits, _) = endpoint(2).await;
    let id = uuid::Uuid::now_v7().to_string();
    let file = json!([{"id": id, "tenant_id": "tenant-a", "event_types": ["*"],
                       "destination": {"type": "webhook", "url": url}}]);

    // The endpoint is down: the subscription is written pending, and apply says so (exit 1).
    let run = apply(&env, &file).await;
    assert_eq!(
        run.code, 1,
        "stdout:\n{}\nstderr:\n{}",
        run.stdout, run.stderr
    );
    assert!(
        run.stdout
            .contains(&format!("created {id} v1 pending bad_status: ")),
        "{}",
        run.stdout
    );
    assert_eq!(
        secret_lines(&run.stdout).len(),
        1,
        "the secret is shown anyway"
    );
    let tenant = token("tenant-a");
    let path = format!("/v1/subscriptions/{id}");
    eventually("pending in the API", Duration::from_secs(30), || {
        let (base, tenant, path) = (base.clone(), tenant.clone(), path.clone());
        async move {
            let v = get(&base, &tenant, &path).await?;
            (v["verification_state"] == "pending").then_some(())
        }
    })
    .await;

    // The retrier, in process, against the same broker and topic: passes until it writes.
    let config = Config::from_vars(env.clone()).unwrap();
    let codec = Arc::new(Codec::new().unwrap());
    let table = SharedTable::default();
    let stop = Arc::new(AtomicBool::new(false));
    let follower = {
        let (config, codec, table, stop) =
            (config.clone(), codec.clone(), table.clone(), stop.clone());
        std::thread::spawn(move || control::follow(&config, codec, table, stop))
    };
    let caught_up = table.clone();
    assert!(
        table
            .wait_for(Duration::from_secs(30), |_| caught_up.is_caught_up())
            .await,
        "control topic read"
    );
    let clock: SharedClock = Arc::new(SystemClock);
    let prober = Prober::new(
        Arc::new(Kek::from_config(&config).unwrap()),
        streaming_hub::delivery::client::build_client(&config).unwrap(),
        SinkPolicy {
            allow_private: true,
            allow_insecure: true,
        },
        clock.clone(),
    );
    let subs = Subscriptions::kafka(&config, codec, table.clone()).unwrap();
    let mut retrier = PendingRetrier::new(subs.clone(), prober, clock);
    let mut passes = 0;
    while subs.get(&id).unwrap().verification_state == VerificationState::Pending {
        passes += 1;
        assert!(passes <= 64, "still pending after 64 passes");
        retrier.run_pass().await;
    }
    assert_eq!(
        subs.get(&id).unwrap().verification_state,
        VerificationState::Active
    );
    assert!(
        hits.load(Ordering::SeqCst) >= 3,
        "the create probe and two retries"
    );

    // The hub sees it too: active at version 2, and nobody called /verify.
    let got = eventually("active in the API", Duration::from_secs(30), || {
        let (base, tenant, path) = (base.clone(), tenant.clone(), path.clone());
        async move {
            let v = get(&base, &tenant, &path).await?;
            (v["verification_state"] == "active").then_some(v)
        }
    })
    .await;
    assert_eq!(got["version"], 2, "{got}");
    assert!(
        !hub.log_text().contains("subscription verified"),
        "no /verify"
    );
    stop.store(true, Ordering::SeqCst);
    tokio::task::spawn_blocking(move || follower.join())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
