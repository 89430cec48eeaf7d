//! Delivery against real local HTTP servers (axum on 127.0.0.1:0): the probe's verdicts, its
//! signature headers, the SSRF guard at both layers, redirects, timeouts and capped bodies.
//!
//! Every server records each request it answers before answering, so "zero requests" is checked
//! after the client's call has returned, without waiting.
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::client::{TransportError, USER_AGENT, build_client, classify, read_capped};
use super::signing::{sign, signature_header};
use super::ssrf::UrlError;
use super::verify::{VERIFICATION_EVENT_TYPE, VerifyError, probe};
use crate::config::Config;
use crate::runtime::secret::Secret;

const OLD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NEW_SECRET: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX";

/// A request a [`Sink`] answered.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) headers: HeaderMap,
    body: Bytes,
    peer: SocketAddr,
}

/// A local HTTP server answering every request with `reply(body)`; stopped on drop. Other
/// modules' tests send to it too (a delivery's headers in `dispatch::worker`).
pub(crate) struct Sink {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    server: tokio::task::JoinHandle<()>,
}

impl Sink {
    pub(crate) async fn start<F, Fut>(reply: F) -> Sink
    where
        F: Fn(Bytes) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Response> + Send + 'static,
    {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let app = Router::new().fallback(
            move |ConnectInfo(peer): ConnectInfo<SocketAddr>, headers: HeaderMap, body: Bytes| {
                let (record, reply) = (record.clone(), reply.clone());
                async move {
                    record.lock().unwrap().push(Seen {
                        headers,
                        body: body.clone(),
                        peer,
                    });
                    reply(body).await
                }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        let server = tokio::spawn(async move {
            axum::serve(listener, service).await.unwrap();
        });
        Sink { addr, seen, server }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn hits(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub(crate) async fn echo(body: Bytes) -> Response {
    body.into_response()
}

pub(crate) fn client(allow_private: bool, timeout: &str) -> reqwest::Client {
    let config = Config::from_vars([
        (
            "STREAMING_HUB_ALLOW_PRIVATE_SINKS".to_string(),
            allow_private.to_string(),
        ),
        (
            "STREAMING_HUB_HTTP_TIMEOUT".to_string(),
            timeout.to_string(),
        ),
    ])
    .unwrap();
    build_client(&config).unwrap()
}

fn secrets() -> Vec<Secret> {
    vec![Secret::new(NEW_SECRET), Secret::new(OLD_SECRET)]
}

/// A probe to a local sink: private and insecure allowed, as in a development set-up.
async fn probe_local(url: &str, headers: &BTreeMap<String, String>) -> Result<(), VerifyError> {
    probe(&client(true, "5s"), url, headers, &secrets(), true, true).await
}

/// A probe to a local sink that times out after `timeout`.
async fn probe_within(url: &str, timeout: &str) -> Result<(), VerifyError> {
    probe(
        &client(true, timeout),
        url,
        &BTreeMap::new(),
        &secrets(),
        true,
        true,
    )
    .await
}

fn header<'a>(seen: &'a Seen, name: &str) -> &'a str {
    seen.headers.get(name).unwrap().to_str().unwrap()
}

#[tokio::test]
async fn probe_passes_when_the_endpoint_echoes_the_challenge() {
    let sink = Sink::start(echo).await;
    probe_local(&sink.url(), &BTreeMap::new()).await.unwrap();
    assert_eq!(sink.hits(), 1);
}

#[tokio::test]
async fn probe_request_carries_valid_standard_webhooks_headers() {
    let sink = Sink::start(echo).await;
    let custom = BTreeMap::from([("X-Tenant-Token".to_string(), "t0k".to_string())]);
    probe_local(&sink.url(), &custom).await.unwrap();
    let seen = &sink.seen()[0];

    let body: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(body["type"], VERIFICATION_EVENT_TYPE);
    assert_eq!(body["challenge"].as_str().unwrap().len(), 32);
    assert_eq!(header(seen, "content-type"), "application/json");
    assert_eq!(header(seen, "x-lerian-event-type"), VERIFICATION_EVENT_TYPE);
    assert_eq!(header(seen, "x-tenant-token"), "t0k");
    assert_eq!(header(seen, "user-agent"), USER_AGENT);

    let id = header(seen, "webhook-id");
    let uuid = id.strip_prefix("msg_").unwrap();
    assert_eq!(uuid::Uuid::parse_str(uuid).unwrap().get_version_num(), 7);
    let ts: i64 = header(seen, "webhook-timestamp").parse().unwrap();
    let now = chrono::Utc::now().timestamp();
    assert!((now - ts).abs() <= 60, "timestamp {ts} is not now ({now})");

    let signature = header(seen, "webhook-signature");
    assert_eq!(
        signature,
        signature_header(&secrets(), id, ts, &seen.body).unwrap()
    );
    let parts: Vec<&str> = signature.split(' ').collect();
    assert_eq!(
        parts,
        [
            sign(&Secret::new(NEW_SECRET), id, ts, &seen.body).unwrap(),
            sign(&Secret::new(OLD_SECRET), id, ts, &seen.body).unwrap(),
        ]
    );
}

#[tokio::test]
async fn custom_headers_cannot_replace_the_hub_headers() {
    let sink = Sink::start(echo).await;
    let custom = BTreeMap::from([
        ("webhook-signature".to_string(), "v1,forged".to_string()),
        ("Content-Type".to_string(), "text/plain".to_string()),
        // Refused by the API; a record written to the control topic by other means may carry it.
        ("Host".to_string(), "evil.example".to_string()),
    ]);
    probe_local(&sink.url(), &custom).await.unwrap();
    let seen = &sink.seen()[0];
    assert_eq!(header(seen, "host"), sink.addr.to_string());
    let signatures: Vec<_> = seen.headers.get_all("webhook-signature").iter().collect();
    assert_eq!(signatures.len(), 1);
    assert!(!signatures[0].to_str().unwrap().contains("forged"));
    assert_eq!(header(seen, "content-type"), "application/json");
}

#[tokio::test]
async fn invalid_custom_header_is_named_and_nothing_is_sent() {
    let sink = Sink::start(echo).await;
    let custom = BTreeMap::from([("x-token".to_string(), "s3cr3t\r\nx: y".to_string())]);
    let e = probe_local(&sink.url(), &custom).await.unwrap_err();
    assert_eq!(e, VerifyError::InvalidHeader("x-token".into()));
    assert!(!e.to_string().contains("s3cr3t"));
    let custom = BTreeMap::from([("bad name".to_string(), "v".to_string())]);
    let e = probe_local(&sink.url(), &custom).await.unwrap_err();
    assert_eq!(e.code(), "invalid_header");
    // More than a subscription may have (a control record the API did not write): refused, not
    // a panic (`HeaderMap` panics past 32,768), and at the limit the probe goes.
    let many = |n: usize| -> BTreeMap<String, String> {
        (0..n)
            .map(|i| (format!("x-h{i}"), "v".to_string()))
            .collect()
    };
    let e = probe_local(&sink.url(), &many(40_000)).await.unwrap_err();
    assert_eq!(e, VerifyError::TooManyHeaders(40_000));
    assert_eq!(sink.hits(), 0);
    probe_local(&sink.url(), &many(32)).await.unwrap();
    assert_eq!(sink.hits(), 1);
}

#[tokio::test]
async fn probe_fails_with_challenge_missing_when_a_2xx_body_lacks_it() {
    let sink = Sink::start(|_| async { "ok".into_response() }).await;
    let e = probe_local(&sink.url(), &BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e, VerifyError::ChallengeMissing);
    let empty = Sink::start(|_| async { StatusCode::NO_CONTENT.into_response() }).await;
    let e = probe_local(&empty.url(), &BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e, VerifyError::ChallengeMissing);
}

#[tokio::test]
async fn challenge_past_the_response_cap_is_not_found() {
    let sink = Sink::start(|body: Bytes| async move {
        let mut padded = vec![b' '; super::verify::RESPONSE_CAP];
        padded.extend_from_slice(&body);
        padded.into_response()
    })
    .await;
    let e = probe_local(&sink.url(), &BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e, VerifyError::ChallengeMissing);
}

#[tokio::test]
async fn probe_fails_with_the_status_of_a_non_2xx_answer() {
    let sink = Sink::start(|body: Bytes| async move {
        // Echoing the challenge does not rescue a 500.
        (StatusCode::INTERNAL_SERVER_ERROR, body).into_response()
    })
    .await;
    let e = probe_local(&sink.url(), &BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e, VerifyError::Status(500));
    assert!(e.is_retryable());
}

#[tokio::test]
async fn redirect_is_not_followed_and_fails_the_probe() {
    let target = Sink::start(echo).await;
    let location = target.url();
    let redirector = Sink::start(move |_| {
        let location = location.clone();
        async move { (StatusCode::FOUND, [(header::LOCATION, location)]).into_response() }
    })
    .await;
    let e = probe_local(&redirector.url(), &BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e, VerifyError::Redirect(302));
    assert_eq!(redirector.hits(), 1);
    assert_eq!(target.hits(), 0, "the redirect target must not be reached");
}

#[tokio::test]
async fn client_returns_a_redirect_as_the_response_without_following_it() {
    let target = Sink::start(echo).await;
    let location = target.url();
    let redirector = Sink::start(move |_| {
        let location = location.clone();
        async move {
            (
                StatusCode::TEMPORARY_REDIRECT,
                [(header::LOCATION, location)],
            )
                .into_response()
        }
    })
    .await;
    let resp = client(true, "5s")
        .post(redirector.url())
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::TEMPORARY_REDIRECT);
    assert_eq!(target.hits(), 0);
}

#[tokio::test]
async fn probe_refuses_private_destinations_without_sending_anything() {
    let sink = Sink::start(echo).await;
    let port = sink.addr.port();
    let urls = [
        format!("http://127.0.0.1:{port}/hook"),
        format!("http://2130706433:{port}/hook"),
        format!("http://0177.0.0.1:{port}/hook"),
        format!("http://0x7f.0.0.1:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
        format!("http://localhost:{port}/hook"),
    ];
    let client = client(false, "5s");
    for url in &urls {
        let e = probe(&client, url, &BTreeMap::new(), &secrets(), false, true)
            .await
            .unwrap_err();
        assert!(
            matches!(e, VerifyError::Url(UrlError::PrivateAddress(_))),
            "{url}: {e:?}"
        );
        assert!(!e.is_retryable());
    }
    assert_eq!(sink.hits(), 0);
}

#[tokio::test]
async fn connect_time_guard_refuses_a_name_resolving_to_loopback() {
    // The URL check is bypassed on purpose: only the guarded resolver stands in the way.
    let sink = Sink::start(echo).await;
    let url = format!("http://localhost:{}/hook", sink.addr.port());
    let guarded = client(false, "5s");
    let e = guarded.post(&url).body("x").send().await.unwrap_err();
    assert_eq!(classify(e), TransportError::Forbidden);
    let e = probe(&guarded, &url, &BTreeMap::new(), &secrets(), true, true)
        .await
        .unwrap_err();
    assert_eq!(e, VerifyError::Forbidden);
    assert_eq!(e.code(), "forbidden_address");
    assert_eq!(sink.hits(), 0, "no request may reach a loopback sink");
}

#[tokio::test]
async fn allowed_private_sinks_are_reached_by_name() {
    let sink = Sink::start(echo).await;
    let url = format!("http://localhost:{}/hook", sink.addr.port());
    probe(
        &client(true, "5s"),
        &url,
        &BTreeMap::new(),
        &secrets(),
        true,
        true,
    )
    .await
    .unwrap();
    assert_eq!(sink.hits(), 1);
}

#[tokio::test]
async fn probe_times_out_on_an_endpoint_that_never_answers() {
    let sink = Sink::start(|_| std::future::pending::<Response>()).await;
    let e = probe_within(&sink.url(), "300ms").await.unwrap_err();
    assert_eq!(e, VerifyError::Timeout);
}

#[tokio::test]
async fn timeout_covers_a_body_that_never_ends() {
    let sink = Sink::start(|_| async {
        Response::new(Body::from_stream(futures::stream::pending::<
            Result<Bytes, Infallible>,
        >()))
    })
    .await;
    let e = probe_within(&sink.url(), "300ms").await.unwrap_err();
    assert_eq!(e, VerifyError::Timeout);
}

/// The challenge counts where it came: a body that then never ends (its `Content-Length` not
/// reached) still passes. Without it, the same answer is a timeout.
#[tokio::test]
async fn a_challenge_that_came_before_the_body_stalled_passes() {
    let stalled = |with_challenge: bool| {
        move |body: Bytes| async move {
            let first = if with_challenge { body } else { Bytes::new() };
            let stream = futures::StreamExt::chain(
                futures::stream::iter([Ok::<_, Infallible>(first)]),
                futures::stream::pending(),
            );
            Response::new(Body::from_stream(stream))
        }
    };
    let sink = Sink::start(stalled(true)).await;
    let passed = probe_within(&sink.url(), "500ms").await;
    assert_eq!(passed, Ok(()));
    let sink = Sink::start(stalled(false)).await;
    let e = probe_within(&sink.url(), "500ms").await.unwrap_err();
    assert_eq!(e, VerifyError::Timeout);
}

#[tokio::test]
async fn refused_connection_is_a_connect_error_without_the_url_query() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let url = format!("http://{addr}/hook?token=s3cr3t");
    let e = probe_local(&url, &BTreeMap::new()).await.unwrap_err();
    assert!(matches!(e, VerifyError::Connect(_)), "{e:?}");
    assert!(!e.to_string().contains("s3cr3t"), "{e}");
    assert!(e.is_retryable());
}

#[tokio::test]
async fn read_capped_stops_at_the_cap_of_an_endless_body() {
    let sink = Sink::start(|_| async {
        let chunk = Bytes::from_static(&[b'x'; 8192]);
        let endless = futures::stream::repeat_with(move || Ok::<_, Infallible>(chunk.clone()));
        Response::new(Body::from_stream(endless))
    })
    .await;
    let resp = client(true, "5s").post(sink.url()).send().await.unwrap();
    let (body, truncated) = read_capped(resp, 64 * 1024).await.unwrap();
    assert_eq!(body.len(), 64 * 1024);
    assert!(truncated);
}

#[tokio::test]
async fn read_capped_returns_bodies_up_to_the_cap_whole() {
    let sink = Sink::start(|_| async { "0123456789".into_response() }).await;
    let client = client(true, "5s");
    let resp = client.post(sink.url()).send().await.unwrap();
    assert_eq!(
        read_capped(resp, 10).await.unwrap(),
        (Bytes::from_static(b"0123456789"), false)
    );
    let resp = client.post(sink.url()).send().await.unwrap();
    assert_eq!(
        read_capped(resp, 9).await.unwrap(),
        (Bytes::from_static(b"012345678"), true)
    );
}

#[tokio::test]
async fn sequential_requests_to_one_host_reuse_the_connection() {
    let sink = Sink::start(echo).await;
    let client = client(true, "5s");
    for _ in 0..3 {
        let resp = client.post(sink.url()).body("x").send().await.unwrap();
        read_capped(resp, 1024).await.unwrap();
    }
    let peers: Vec<SocketAddr> = sink.seen().iter().map(|s| s.peer).collect();
    assert_eq!(peers.len(), 3);
    assert!(peers.iter().all(|p| *p == peers[0]), "{peers:?}");
}

/// A connection is kept for every worker: two bursts of 64 requests in flight at once (the default
/// worker count) go over the same connections. With 32 kept idle, as before, the second burst
/// opened 32 new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_as_wide_as_the_workers_reuses_its_connections() {
    const WIDTH: usize = 64;
    let all_in = Arc::new(tokio::sync::Barrier::new(WIDTH));
    let sink = Sink::start(move |body: Bytes| {
        let all_in = all_in.clone();
        async move {
            // Every request of a burst is held until all of them are in: 64 connections at once.
            all_in.wait().await;
            body.into_response()
        }
    })
    .await;
    let config = Config::from_vars([
        (
            "STREAMING_HUB_ALLOW_PRIVATE_SINKS".to_string(),
            "true".to_string(),
        ),
        (
            "STREAMING_HUB_DISPATCH_WORKERS".to_string(),
            WIDTH.to_string(),
        ),
    ])
    .unwrap();
    let client = build_client(&config).unwrap();
    for _ in 0..2 {
        let burst: Vec<_> = (0..WIDTH)
            .map(|_| {
                let (client, url) = (client.clone(), sink.url());
                tokio::spawn(async move {
                    let resp = client.post(url).body("x").send().await.unwrap();
                    read_capped(resp, 1024).await.unwrap();
                })
            })
            .collect();
        for request in burst {
            request.await.unwrap();
        }
    }
    let peers: Vec<SocketAddr> = sink.seen().iter().map(|s| s.peer).collect();
    assert_eq!(peers.len(), 2 * WIDTH);
    // A request is recorded when it arrives, and the second burst starts after the first ended.
    let first: std::collections::HashSet<SocketAddr> = peers[..WIDTH].iter().copied().collect();
    assert_eq!(
        first.len(),
        WIDTH,
        "the first burst holds 64 connections at once"
    );
    let opened_again = peers[WIDTH..].iter().filter(|p| !first.contains(p)).count();
    assert!(
        opened_again < WIDTH / 2,
        "the second burst opened {opened_again} new connections; the pool kept too few"
    );
}
