//! The HTTP server of the API, `/metrics` and the health endpoints, with the limits
//! `axum::serve` does not set: at most [`Limits::max_connections`] connections at once (past
//! it, new ones wait in the kernel's accept queue), and a read timeout for a request's headers
//! (hyper's, which also closes a keep-alive connection idle that long) and then for its body.
//! Without them a client that opens connections and sends nothing, or a byte a minute, holds a
//! socket, a task and hyper's read buffer for as long as it likes, until the process runs out of
//! file descriptors, which deliveries, RocksDB and Kafka need too.
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;

/// How long a graceful stop waits for open connections to finish their request (the process
/// gives the server as long before it leaves).
const DRAIN: Duration = Duration::from_secs(10);
/// How long a connection may leave an answer unread before it is closed. A client that sends
/// requests and never reads the answers (pipelined, so the read timeout never runs) held its
/// connection, and its place under the cap, for good.
pub const WRITE_STALL: Duration = Duration::from_secs(30);
/// The most a request's head (its line and headers) may take while it is read: a token is at
/// most 8 KiB and a URL 2 KiB. hyper's default, about 400 KiB a connection, let a client with no
/// token hold that much per connection, up to the connection cap, by never ending its headers.
/// Past it the answer is `431`.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Answers up to this size are not counted against [`ANSWER_BUDGET_KIB`]: the connection cap
/// bounds them.
const SMALL_ANSWER: usize = 64 * 1024;
/// KiB of larger answers (subscription lists, pull pages, `/metrics`) built and not yet sent,
/// over every connection: 128 MiB. An answer waits on its client for up to [`WRITE_STALL`], so a
/// client that asks for large answers on many connections and reads none held them all, gigabytes
/// at the connection cap. Past the budget a large answer is replaced by a `503` with
/// `Retry-After` (counted in [`ANSWERS_REFUSED`]).
const ANSWER_BUDGET_KIB: usize = 128 * 1024;
/// Large answers replaced by a `503` because [`ANSWER_BUDGET_KIB`] was spent.
pub const ANSWERS_REFUSED: &str = "streaming_hub_http_answers_refused_total";

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    /// `None`: no read timeout.
    pub read_timeout: Option<Duration>,
    /// How long an answer may wait on a client that does not read it ([`WRITE_STALL`]).
    pub write_stall: Duration,
}

/// Serves `router` on `listener` until `shutdown` completes, then stops accepting and gives open
/// connections [`DRAIN`] to finish the request they are on.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let budget = Budget::new(ANSWER_BUDGET_KIB);
    let (stopping, stop_seen) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(true);
    let mut at_limit_said = false;
    tokio::pin!(shutdown);
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if !at_limit_said {
                    tracing::warn!(
                        max = limits.max_connections,
                        "HTTP connections at STREAMING_HUB_HTTP_MAX_CONNECTIONS: new ones wait"
                    );
                    at_limit_said = true;
                }
                tokio::select! {
                    _ = &mut shutdown => break,
                    p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
                }
            }
        };
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was taken: the
                    // listener stays usable; a pause keeps a persistent error from spinning.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        if permits.available_permits() > 0 {
            at_limit_said = false;
        }
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let read_timeout = limits.read_timeout;
        let budget = budget.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let req = req.map(|body| match read_timeout {
                Some(limit) => Body::new(BodyDeadline::new(body, limit)),
                None => Body::new(body),
            });
            let (router, budget) = (router.clone(), budget.clone());
            async move {
                let answer = router.oneshot(req).await;
                answer.map(|a| budgeted(a, &budget))
            }
        });
        let stream = WriteStall::new(stream, limits.write_stall);
        let conn = http.serve_connection(TokioIo::new(stream), service);
        let mut stop_seen = stop_seen.clone();
        tokio::spawn(async move {
            let _permit = permit;
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stop_seen.wait_for(|s| *s) => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(DRAIN, conn).await;
        });
    }
    // No new connection is taken from here: one the kernel queued would be reset unserved.
    drop(listener);
    let _ = stopping.send(true);
    // Every connection task holds a permit: all of them back = all connections closed.
    let all = u32::try_from(limits.max_connections.max(1)).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(DRAIN + Duration::from_secs(1), permits.acquire_many(all)).await;
}

/// KiB of large answers that may wait to be sent ([`ANSWER_BUDGET_KIB`]), shared by connections.
#[derive(Clone)]
struct Budget {
    kib: Arc<Semaphore>,
    total: usize,
    /// Refusing since the last large answer admitted: the WARN is said once per such spell, not
    /// once per request of a client flooding the instance.
    refusing: Arc<std::sync::atomic::AtomicBool>,
}

impl Budget {
    fn new(total: usize) -> Budget {
        Budget {
            kib: Arc::new(Semaphore::new(total)),
            total,
            refusing: Arc::default(),
        }
    }
}

/// `answer` as it goes out: one larger than [`SMALL_ANSWER`] holds its size of `budget` until its
/// body is sent or dropped (the connection closed), or, when the budget is spent, is replaced by
/// a `503 unavailable` with `Retry-After: 1`. One larger than the whole budget takes all of it.
fn budgeted(answer: axum::response::Response, budget: &Budget) -> axum::response::Response {
    use axum::response::IntoResponse;
    let Some(len) = hyper::body::Body::size_hint(answer.body()).exact() else {
        return answer; // streamed: none of ours
    };
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len <= SMALL_ANSWER {
        return answer;
    }
    let kib = len.div_ceil(1024).min(budget.total);
    let kib = u32::try_from(kib).unwrap_or(u32::MAX);
    use std::sync::atomic::Ordering;
    match budget.kib.clone().try_acquire_many_owned(kib) {
        Ok(held) => {
            budget.refusing.store(false, Ordering::Relaxed);
            answer.map(|body| Body::new(Held { body, _held: held }))
        }
        Err(_) => {
            metrics::counter!(ANSWERS_REFUSED).increment(1);
            if !budget.refusing.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    bytes = len,
                    "large answers refused (503) until some are sent: those waiting on their \
                     clients fill the 128 MiB budget (streaming_hub_http_answers_refused_total \
                     counts them)"
                );
            }
            super::errors::ApiError {
                retry_after: Some(1),
                ..super::errors::ApiError::new(
                    hyper::StatusCode::SERVICE_UNAVAILABLE,
                    super::errors::codes::UNAVAILABLE,
                    "this instance is busy sending other large answers; retry",
                )
            }
            .into_response()
        }
    }
}

/// An answer's body with its share of the answer budget, given back when the body is dropped.
struct Held {
    body: Body,
    _held: tokio::sync::OwnedSemaphorePermit,
}

impl hyper::body::Body for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.body)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.body)
    }
}

/// A connection whose writes may wait on the client at most [`WRITE_STALL`] in a row; past it
/// they fail, and hyper closes the connection.
struct WriteStall {
    inner: tokio::net::TcpStream,
    limit: Duration,
    /// Set while a write waits on the client: when it started to wait.
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteStall {
    fn new(inner: tokio::net::TcpStream, limit: Duration) -> WriteStall {
        WriteStall {
            inner,
            limit,
            waiting: None,
        }
    }

    /// A write's result: waiting arms the deadline (once), progress clears it.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if r.is_ready() {
            self.waiting = None;
            return r;
        }
        let deadline = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(self.limit)));
        if deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client left the answer unread",
            )));
        }
        Poll::Pending
    }
}

impl tokio::io::AsyncRead for WriteStall {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for WriteStall {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A request body that must arrive whole within its deadline, counted from when its headers
/// were read; past it, reading it fails (the handler answers `400`).
struct BodyDeadline {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    limit: Duration,
}

impl BodyDeadline {
    fn new(inner: Incoming, limit: Duration) -> BodyDeadline {
        BodyDeadline {
            inner,
            deadline: Box::pin(tokio::time::sleep(limit)),
            limit,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
struct BodyTimedOut(Duration);

impl hyper::body::Body for BodyDeadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(BodyTimedOut(self.limit).into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Limits for a test: connections, read timeout and write stall in ms.
    fn limits(max_connections: usize, read_ms: Option<u64>, stall_ms: u64) -> Limits {
        Limits {
            max_connections,
            read_timeout: read_ms.map(Duration::from_millis),
            write_stall: Duration::from_millis(stall_ms),
        }
    }

    /// A real server on 127.0.0.1 with `limits`; the sender stops it.
    async fn start(limits: Limits) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let router = Router::new()
            .route("/ok", get(|| async { "ok" }))
            .route("/echo", post(|body: Bytes| async move { body }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, router, limits, async move {
            let _ = stopped.await;
        }));
        (addr, stop)
    }

    /// Reads until the server closes the connection; what it sent.
    async fn read_to_close(s: &mut TcpStream, within: Duration) -> Option<String> {
        let mut got = Vec::new();
        tokio::time::timeout(within, s.read_to_end(&mut got))
            .await
            .ok()?
            .ok()?;
        Some(String::from_utf8_lossy(&got).into_owned())
    }

    async fn get_ok(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        read_to_close(&mut s, Duration::from_secs(10))
            .await
            .expect("an answer")
    }

    #[tokio::test]
    async fn headers_that_never_finish_are_cut_at_the_read_timeout() {
        let limits = limits(8, Some(300), 30_000);
        let (addr, _stop) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        // Without the timeout the server waits for the rest forever: no close within 20 s.
        let answer = read_to_close(&mut s, Duration::from_secs(20)).await;
        assert!(answer.is_some(), "the connection was not closed");
        assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed_at_the_read_timeout() {
        let limits = limits(8, Some(300), 30_000);
        let (addr, _stop) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let answer = read_to_close(&mut s, Duration::from_secs(20))
            .await
            .expect("the idle connection was not closed");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn a_body_that_never_finishes_is_refused_at_the_read_timeout() {
        let limits = limits(8, Some(300), 30_000);
        let (addr, _stop) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
            .await
            .unwrap();
        let answer = read_to_close(&mut s, Duration::from_secs(20))
            .await
            .expect("no answer to a body that never finished");
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    }

    #[tokio::test]
    async fn connections_past_the_limit_wait_until_one_closes() {
        let limits = limits(2, None, 30_000);
        let (addr, _stop) = start(limits).await;
        // Two connections that send nothing hold both places.
        let first = TcpStream::connect(addr).await.unwrap();
        let second = TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::spawn(get_ok(addr));
        // The third is not served while both are held (no read timeout closes them): its answer
        // would come at once otherwise.
        let early = tokio::time::timeout(Duration::from_millis(500), async {
            while !waiting.is_finished() {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(
            early.is_err(),
            "a third connection was served past the limit"
        );
        drop(first);
        let answer = waiting.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        drop(second);
    }

    /// A client that pipelines requests and never reads the answers: once its answers wait on it
    /// past the write stall, its connection is closed and its place under the cap freed.
    #[tokio::test]
    async fn a_connection_that_leaves_its_answers_unread_is_closed() {
        let limits = limits(1, None, 300);
        let (addr, _stop) = start(limits).await;
        let hog = TcpStream::connect(addr).await.unwrap();
        let (_unread, mut writer) = hog.into_split();
        // Far more answers than the sockets' buffers hold (about 8 MiB of them).
        let flood = b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n".repeat(100_000);
        tokio::spawn(async move {
            let _ = writer.write_all(&flood).await;
        });
        // The only place is the hog's until its answers stall; then another client is served.
        assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn a_request_head_past_its_bound_is_refused_at_once() {
        let limits = limits(8, Some(30_000), 30_000);
        let (addr, _stop) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        // 100 KiB of one header, never ended: under hyper's default bound the server would wait
        // for the rest until the read timeout, 30 s.
        let mut head = b"GET /ok HTTP/1.1\r\nhost: x\r\nx-filler: ".to_vec();
        head.extend(std::iter::repeat_n(b'a', 100 * 1024));
        let _ = s.write_all(&head).await; // the server may close before it has read it all
        let answer = read_to_close(&mut s, Duration::from_secs(10))
            .await
            .expect("the connection was not closed at once");
        assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
        assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn large_answers_past_the_budget_are_refused_until_one_is_sent() {
        use axum::response::IntoResponse;
        // A budget of 1 MiB; answers of a little over half of it.
        let budget = Budget::new(1024);
        let half = 512 * 1024 + 1;
        let large = || vec![b'x'; half].into_response();
        let first = budgeted(large(), &budget);
        assert_eq!(first.status(), 200);
        // Small answers are not counted.
        let small = budgeted("ok".into_response(), &budget);
        assert_eq!(budget.kib.available_permits(), 1024 - 513);
        drop(small);
        // The second large one does not fit beside the first, unsent.
        let refused = budgeted(large(), &budget);
        assert_eq!(refused.status(), 503);
        assert_eq!(refused.headers()["retry-after"], "1");
        assert!(budget.refusing.load(std::sync::atomic::Ordering::Relaxed));
        // The first sent (its body read to the end and dropped): room again.
        let body = axum::body::to_bytes(first.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(body.len(), half);
        assert_eq!(budget.kib.available_permits(), 1024);
        let second = budgeted(large(), &budget);
        assert_eq!(second.status(), 200);
        assert!(!budget.refusing.load(std::sync::atomic::Ordering::Relaxed));
        // A connection closed before its answer went out gives it back too.
        drop(second);
        // One larger than the whole budget takes all of it, and is sent.
        let huge = budgeted(vec![b'x'; 4 << 20].into_response(), &budget);
        assert_eq!(huge.status(), 200);
        assert_eq!(budget.kib.available_permits(), 0);
    }

    #[tokio::test]
    async fn a_stop_ends_the_server_with_an_idle_connection_open() {
        let limits = limits(4, None, 30_000);
        let router = Router::new().route("/ok", get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, limits, async move {
            let _ = stopped.await;
        }));
        let _idle = TcpStream::connect(addr).await.unwrap();
        assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"));
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(20), server)
            .await
            .expect("the server did not stop")
            .unwrap();
    }
}
