//! The outgoing HTTP client shared by every delivery attempt and verification probe.
//!
//! One [`reqwest::Client`] per process (it is a handle over a connection pool; clone it freely).
//! Its settings are the delivery contract of DESIGN.md §4 and issue 6 item 4:
//! - DNS through [`GuardedResolver`], which drops private, loopback and link-local addresses unless
//!   `allow_private_sinks` (the connect-time SSRF check); IP-literal hosts skip any resolver, so
//!   requests are started only through [`post`] or [`CheckedUrls::post`], which run [`check_url`]
//!   first (the latter once per URL string: the verdict depends on the string and the two
//!   settings alone, no DNS);
//! - redirects never followed (a 3xx comes back as the response and counts as a failure);
//! - system proxy variables ignored (`no_proxy`);
//! - `http_timeout` covers the whole exchange, connect to the last body byte; success is decided
//!   by the status line alone, so a 2xx whose body is cut by the timeout (a receiver that
//!   trickles or never ends its body) is still a delivery, and the worker is free either way;
//! - HTTP/1.1 only, keep-alive connections pooled per host: as many kept idle as there are
//!   workers ([`pool_max_idle_per_host`]), closed after [`POOL_IDLE_TIMEOUT`];
//! - exactly one request per call: reqwest's own retry layer is turned off (it retries only HTTP/2
//!   refusals, which never happen here, but it copied every request's headers to be able to);
//! - `User-Agent: streaming-hub/<version>`.
//!
//! Response bodies are read with [`read_capped`], never whole. Transport errors are classified by
//! [`classify`] into [`TransportError`]; its messages never carry the URL (a query may hold a token).
use std::error::Error as _;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use reqwest::redirect::Policy;

use super::ssrf::{GuardedResolver, ResolveError, UrlError, check_url};
use crate::config::Config;

pub const USER_AGENT: &str = concat!("streaming-hub/", env!("CARGO_PKG_VERSION"));
/// Idle keep-alive connections kept per destination host, at least.
pub const POOL_MAX_IDLE_PER_HOST: usize = 32;

/// Idle connections kept per host: one per worker, so a destination that keeps every worker busy
/// finds a connection for each after a lull. With fewer (32 against the default 64 workers), each
/// burst closed the extra connections and opened them again: ~150 new connections a second at
/// 5,000 deliveries/s to one sink, measured in the `throughput` scenario.
pub fn pool_max_idle_per_host(config: &Config) -> usize {
    config.dispatch_workers.max(POOL_MAX_IDLE_PER_HOST)
}

/// How long an idle pooled connection is kept.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// TCP keep-alive probes on pooled connections, so dead peers are noticed.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// The usual cap on a response body kept for an attempt record or a probe.
pub const DEFAULT_BODY_CAP: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("building the HTTP client failed: {0}")]
    Build(String),
}

/// Why a request got no HTTP response (or lost its body half-way).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// No public address to connect to: the host resolves only to addresses the SSRF guard
    /// refuses (private, loopback, link-local), or not at all. One answer for both, so a tenant
    /// cannot tell an internal name that exists from one that does not by probing URLs; the
    /// hub's log keeps which it was.
    #[error("{NO_PUBLIC_ADDRESS}")]
    Forbidden,
    #[error("the destination did not answer within the timeout")]
    Timeout,
    #[error("could not reach the destination: {0}")]
    Connect(String),
}

/// The process's outgoing client, configured as described in the module doc.
pub fn build_client(config: &Config) -> Result<reqwest::Client, ClientError> {
    with_resolver(config, GuardedResolver::new(config.allow_private_sinks))
}

/// [`build_client`] over a given guarded resolver (tests: a name service whose answers change).
fn with_resolver(
    config: &Config,
    resolver: GuardedResolver,
) -> Result<reqwest::Client, ClientError> {
    if config.allow_private_sinks {
        tracing::warn!(
            "STREAMING_HUB_ALLOW_PRIVATE_SINKS=true: webhooks may reach private, loopback and \
             link-local addresses (SSRF guard off)"
        );
    }
    if config.allow_insecure_sinks {
        tracing::warn!("STREAMING_HUB_ALLOW_INSECURE_SINKS=true: webhooks may use plain http://");
    }
    reqwest::Client::builder()
        .dns_resolver(resolver)
        .redirect(Policy::none())
        .no_proxy()
        .timeout(config.http_timeout)
        .connect_timeout(config.http_timeout)
        .http1_only()
        .pool_max_idle_per_host(pool_max_idle_per_host(config))
        .retry(reqwest::retry::never().max_retries_per_request(0))
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .tcp_keepalive(TCP_KEEPALIVE)
        .user_agent(USER_AGENT)
        .build()
        .map_err(|e| ClientError::Build(describe(&e.without_url())))
}

/// A POST to a checked URL: the only way delivery code starts a request, so IP literals (which
/// the resolver never sees) are checked too.
pub fn post(
    client: &reqwest::Client,
    url: &str,
    allow_private: bool,
    allow_insecure: bool,
) -> Result<reqwest::RequestBuilder, UrlError> {
    let url = check_url(url, allow_private, allow_insecure)?;
    Ok(client.post(url))
}

/// Destination URLs checked once, for the delivery workers: [`post`] parsed and checked the URL
/// of every attempt again, a few per cent of the workers' CPU under load. The verdict (the
/// parsed URL or why it is refused) is kept per URL string under the two settings it was
/// checked with; the connect-time check (the resolver) still runs on every new connection.
/// At most [`CHECKED_URLS`] entries: a full map is emptied and filled again.
#[derive(Clone)]
pub struct CheckedUrls {
    allow_private: bool,
    allow_insecure: bool,
    verdicts: std::sync::Arc<std::sync::Mutex<crate::runtime::store::FastMap<String, CheckedUrl>>>,
}

type CheckedUrl = Result<reqwest::Url, UrlError>;

/// How many destination URLs [`CheckedUrls`] keeps.
pub const CHECKED_URLS: usize = 4096;

impl CheckedUrls {
    pub fn new(allow_private: bool, allow_insecure: bool) -> CheckedUrls {
        CheckedUrls {
            allow_private,
            allow_insecure,
            verdicts: Default::default(),
        }
    }

    /// [`post`], with the URL's check kept for the next attempt.
    pub fn post(
        &self,
        client: &reqwest::Client,
        url: &str,
    ) -> Result<reqwest::RequestBuilder, UrlError> {
        let verdict = {
            let mut verdicts = self
                .verdicts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match verdicts.get(url) {
                Some(v) => v.clone(),
                None => {
                    let v = check_url(url, self.allow_private, self.allow_insecure);
                    if verdicts.len() >= CHECKED_URLS {
                        verdicts.clear();
                    }
                    verdicts.insert(url.to_string(), v.clone());
                    v
                }
            }
        };
        Ok(client.post(verdict?))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.verdicts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

/// Reads at most `cap` bytes of a response body; `true` when the body was longer (the rest is
/// not read and the connection is dropped rather than drained).
///
/// Returns an error when the body fails before the cap or its end (for example the timeout).
pub async fn read_capped(
    resp: reqwest::Response,
    cap: usize,
) -> Result<(Bytes, bool), TransportError> {
    let (body, ended) = read_capped_partial(resp, cap).await;
    ended.map(|truncated| (body, truncated))
}

/// [`read_capped`], keeping what was read before the body failed: a receiver whose body never
/// ends, or whose connection drops before its `Content-Length`, has still answered what came.
pub async fn read_capped_partial(
    mut resp: reqwest::Response,
    cap: usize,
) -> (Bytes, Result<bool, TransportError>) {
    let hint = resp.content_length().unwrap_or(0).min(cap as u64) as usize;
    let mut buf = BytesMut::with_capacity(hint);
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = cap - buf.len();
                if chunk.len() > room {
                    buf.extend_from_slice(&chunk[..room]);
                    return (buf.freeze(), Ok(true));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => return (buf.freeze(), Ok(false)),
            Err(e) => return (buf.freeze(), Err(classify(e))),
        }
    }
}

/// What a tenant is told when a webhook host has no public address (see
/// [`TransportError::Forbidden`]).
pub const NO_PUBLIC_ADDRESS: &str = "the destination's host does not resolve to a public address (it does not resolve, or only \
     to private, loopback or link-local addresses)";

/// Sorts a reqwest error into what the caller acts on. The guarded resolver's answers (a refusal,
/// a name that does not resolve) are found by type in the error's source chain, never by message
/// text.
pub fn classify(err: reqwest::Error) -> TransportError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = err.source();
    while let Some(e) = source {
        if let Some(resolve) = e.downcast_ref::<ResolveError>() {
            tracing::debug!(error = %resolve, "webhook host has no public address");
            return TransportError::Forbidden;
        }
        source = e.source();
    }
    if err.is_timeout() {
        return TransportError::Timeout;
    }
    TransportError::Connect(describe(&err.without_url()))
}

/// An error and its causes, `: `-separated (reqwest's own message says only "error sending
/// request").
fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let part = e.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};

    use super::*;

    fn config(allow_private: bool) -> Config {
        Config::from_vars([
            (
                "STREAMING_HUB_ALLOW_PRIVATE_SINKS".to_string(),
                allow_private.to_string(),
            ),
            ("STREAMING_HUB_HTTP_TIMEOUT".to_string(), "2s".to_string()),
        ])
        .unwrap()
    }

    /// A TCP listener on 127.0.0.1 that answers every request `200 OK` and counts connections.
    async fn loopback_sink() -> (u16, &'static AtomicUsize) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                });
            }
        });
        (port, accepted)
    }

    fn answer(
        addrs: Vec<SocketAddr>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>>
    {
        Box::pin(async move { Ok(addrs) })
    }

    #[tokio::test]
    async fn checked_urls_keep_each_verdict_under_their_own_settings() {
        let (port, accepted) = loopback_sink().await;
        let http = build_client(&config(true)).unwrap();
        let strict = CheckedUrls::new(false, false);
        let open = CheckedUrls::new(true, true);
        let url = format!("http://127.0.0.1:{port}/hook");
        // Twice each: the second answer comes from the kept verdict and must be the same.
        for round in 1..=2 {
            assert_eq!(strict.post(&http, &url).err(), Some(UrlError::Insecure));
            let https = format!("https://127.0.0.1:{port}/hook");
            assert!(matches!(
                strict.post(&http, &https).err(),
                Some(UrlError::PrivateAddress(_))
            ));
            assert!(matches!(
                open.post(&http, "ftp://127.0.0.1/x").err(),
                Some(UrlError::Scheme(_))
            ));
            let request = open.post(&http, &url).unwrap();
            if round == 1 {
                assert_eq!(request.send().await.unwrap().status(), 200);
                assert_eq!(accepted.load(Ordering::SeqCst), 1);
            }
        }
        assert_eq!((strict.len(), open.len()), (2, 2));
        for i in 0..CHECKED_URLS + 10 {
            let _ = open.post(&http, &format!("http://127.0.0.1:{port}/{i}"));
        }
        assert!(open.len() <= CHECKED_URLS, "kept {} URLs", open.len());
    }

    /// A public address (not routed in tests: nothing may depend on reaching it).
    const PUBLIC: &str = "100.128.0.1:0";

    #[tokio::test]
    async fn a_name_that_does_not_resolve_answers_as_one_resolving_to_private_addresses() {
        // An internal name that exists (loopback here) and one that does not: a tenant probing
        // URLs must not tell them apart.
        fn internal(
            host: String,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>,
        > {
            Box::pin(async move {
                match host.as_str() {
                    "vault.internal.test" => Ok(vec!["127.0.0.1:0".parse().unwrap()]),
                    _ => Err(std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "failed to lookup address information: Name or service not known",
                    )),
                }
            })
        }
        let client = with_resolver(
            &config(false),
            GuardedResolver::with_lookup(false, internal),
        )
        .unwrap();
        let mut answers = Vec::new();
        for host in ["vault.internal.test", "nothing.internal.test"] {
            let url = format!("http://{host}:8200/hook");
            let e = post(&client, &url, false, true)
                .unwrap()
                .send()
                .await
                .unwrap_err();
            let t = classify(e);
            let probed = crate::delivery::verify::probe(
                &client,
                &url,
                &std::collections::BTreeMap::new(),
                &[crate::runtime::secret::Secret::new("whsec_dGVzdA==")],
                false,
                true,
            )
            .await
            .unwrap_err();
            answers.push((t, probed.code(), probed.to_string()));
        }
        assert_eq!(answers[0].0, TransportError::Forbidden);
        assert_eq!(answers[0], answers[1], "the same answer for both names");
        assert!(!answers[0].2.contains("lookup"), "{}", answers[0].2);
    }

    #[tokio::test]
    async fn dns_answer_that_turns_private_after_the_check_is_refused_at_connect_time() {
        // A rebinding attacker's DNS: public for the first question (the check when the
        // subscription is written), loopback for every later one (the delivery's connection).
        static ASKED: AtomicUsize = AtomicUsize::new(0);
        fn rebinding(
            _host: String,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>,
        > {
            let first = ASKED.fetch_add(1, Ordering::SeqCst) == 0;
            answer(vec![if first {
                PUBLIC.parse().unwrap()
            } else {
                "127.0.0.1:0".parse().unwrap()
            }])
        }
        let (port, accepted) = loopback_sink().await;
        let resolver = GuardedResolver::with_lookup(false, rebinding);
        let checked = resolver.lookup("hooks.rebind.test").await.unwrap();
        assert_eq!(checked, vec![PUBLIC.parse::<SocketAddr>().unwrap()]);

        let client = with_resolver(&config(false), resolver).unwrap();
        let url = format!("http://hooks.rebind.test:{port}/hook");
        let e = post(&client, &url, false, true)
            .expect("a host name passes the URL check")
            .body("x")
            .send()
            .await
            .unwrap_err();
        assert_eq!(classify(e), TransportError::Forbidden);
        assert!(
            ASKED.load(Ordering::SeqCst) >= 2,
            "the connection asked again"
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            0,
            "nothing reached 127.0.0.1"
        );
    }

    #[tokio::test]
    async fn connections_dial_only_the_addresses_the_guard_returned() {
        // A name only this resolver knows: reaching the sink proves the connection used the
        // guarded resolver's answer, not another lookup of its own.
        static PORT: AtomicU16 = AtomicU16::new(0);
        fn only_here(
            host: String,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>,
        > {
            assert_eq!(host, "sink.only-here.test");
            let port = PORT.load(Ordering::SeqCst);
            answer(vec![SocketAddr::from(([127, 0, 0, 1], port))])
        }
        let (port, accepted) = loopback_sink().await;
        PORT.store(port, Ordering::SeqCst);
        let url = format!("http://sink.only-here.test:{port}/hook");
        let allowed =
            with_resolver(&config(true), GuardedResolver::with_lookup(true, only_here)).unwrap();
        let resp = post(&allowed, &url, true, true)
            .unwrap()
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        let guarded = with_resolver(
            &config(false),
            GuardedResolver::with_lookup(false, only_here),
        )
        .unwrap();
        let e = post(&guarded, &url, false, true)
            .unwrap()
            .send()
            .await
            .unwrap_err();
        assert_eq!(classify(e), TransportError::Forbidden);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the guard stopped the second one"
        );
    }

    #[tokio::test]
    async fn private_answers_mixed_with_public_ones_are_never_dialled() {
        static PORT: AtomicU16 = AtomicU16::new(0);
        fn mixed(
            _host: String,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>,
        > {
            let port = PORT.load(Ordering::SeqCst);
            answer(vec![
                SocketAddr::from(([127, 0, 0, 1], port)),
                PUBLIC.parse().unwrap(),
                SocketAddr::from(([0, 0, 0, 0, 0, 0xffff, 0x7f00, 1], port)),
            ])
        }
        let (port, accepted) = loopback_sink().await;
        PORT.store(port, Ordering::SeqCst);
        let resolver = GuardedResolver::with_lookup(false, mixed);
        let kept = resolver.lookup("mixed.test").await.unwrap();
        assert_eq!(kept, vec![PUBLIC.parse::<SocketAddr>().unwrap()]);
        let client = with_resolver(&config(false), resolver).unwrap();
        let url = format!("http://mixed.test:{port}/hook");
        // The public address does not answer here: the request fails, and never by loopback.
        let e = post(&client, &url, false, true)
            .unwrap()
            .send()
            .await
            .unwrap_err();
        assert_ne!(classify(e), TransportError::Forbidden);
        assert_eq!(accepted.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn client_builds_from_the_default_config() {
        let config = Config::from_vars(Vec::<(String, String)>::new()).unwrap();
        build_client(&config).unwrap();
        assert!(USER_AGENT.starts_with("streaming-hub/"));
    }

    #[test]
    fn post_refuses_a_private_literal_before_any_request() {
        let config = Config::from_vars(Vec::<(String, String)>::new()).unwrap();
        let client = build_client(&config).unwrap();
        let e = post(&client, "https://10.1.2.3/hook", false, false).unwrap_err();
        assert_eq!(e, UrlError::PrivateAddress("10.1.2.3".into()));
        assert!(post(&client, "https://10.1.2.3/hook", true, false).is_ok());
    }
}
