//! Shared test harness: the real broker started by `scripts/kafka.sh`, a unique topic prefix per
//! test, the hub binary as a child process, and readers that wait for a condition (never a sleep
//! standing in for one).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

pub fn brokers() -> String {
    std::env::var("TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A name no other test (or earlier run) uses: lower case, digits, no dots.
pub fn unique(tag: &str) -> String {
    let id = uuid::Uuid::now_v7().simple().to_string();
    format!("{tag}{}", &id[20..])
}

pub fn admin() -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client")
}

/// Fails the test with a clear message when no broker answers.
pub fn require_broker() {
    let a = admin();
    a.inner()
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap_or_else(|e| {
            panic!(
                "no Kafka broker at {} ({e}); run scripts/kafka.sh start or scripts/test.sh",
                brokers()
            )
        });
}

pub async fn create_topic(name: &str, partitions: i32) {
    create_topic_with(&admin(), name, partitions).await;
}

/// Creates a topic through `a` (any broker, any listener) and waits until it has leaders.
pub async fn create_topic_with(a: &AdminClient<DefaultClientContext>, name: &str, partitions: i32) {
    create_topic_configured(a, name, partitions, &[]).await;
}

/// Creates a topic with topic configs (`max.message.bytes`, ...) and waits until it has leaders.
pub async fn create_topic_configured(
    a: &AdminClient<DefaultClientContext>,
    name: &str,
    partitions: i32,
    configs: &[(&str, &str)],
) {
    let mut t = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    for (k, v) in configs {
        t = t.set(k, v);
    }
    let r = a
        .create_topics(&[t], &AdminOptions::new())
        .await
        .expect("create topic");
    for x in r {
        x.expect("topic created");
    }
    wait_until(Duration::from_secs(30), "topic has leaders", || {
        let md = a
            .inner()
            .fetch_metadata(Some(name), Duration::from_secs(5))
            .ok()?;
        let t = md.topics().first()?;
        (t.partitions().len() == partitions as usize
            && t.partitions().iter().all(|p| p.leader() >= 0))
        .then_some(())
    });
}

/// Remembers the first delivery failure, so `produce` can fail loudly (a flush alone does not).
#[derive(Default)]
pub struct FailOnError(std::sync::Mutex<Option<String>>);

impl rdkafka::ClientContext for FailOnError {}

impl rdkafka::producer::ProducerContext for FailOnError {
    type DeliveryOpaque = ();
    fn delivery(&self, r: &rdkafka::producer::DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = r {
            self.0.lock().unwrap().get_or_insert_with(|| e.to_string());
        }
    }
}

pub type TestProducer = BaseProducer<FailOnError>;

pub fn producer() -> TestProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "5")
        .set("message.max.bytes", "4194304")
        .set("queue.buffering.max.messages", "200000")
        .create_with_context(FailOnError::default())
        .expect("producer")
}

/// A transactional producer (as ingest writes the inbox, or the hub its outputs) that has
/// written `rec` to `topic` in a transaction it leaves open: `read_committed` readers stop short
/// of it until it is committed or aborted.
pub fn open_transaction_with(topic: &str, rec: Rec) -> TestProducer {
    let p: TestProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", format!("{topic}.test-ingest"))
        .create_with_context(FailOnError::default())
        .expect("transactional producer");
    p.init_transactions(Duration::from_secs(30)).unwrap();
    p.begin_transaction().unwrap();
    produce(&p, topic, &[rec]);
    p
}

/// One record to produce: key, headers in order (a value of None is a null header), value.
#[derive(Clone, Debug, Default)]
pub struct Rec {
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub value: Option<Vec<u8>>,
    pub partition: Option<i32>,
}

impl Rec {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// A valid business event: the platform's header set, a UUIDv7 id.
pub fn event(tenant: &str, source: &str, resource: &str, ev: &str) -> Rec {
    let id = uuid::Uuid::now_v7().to_string();
    let h = |k: &str, v: &str| (k.to_string(), Some(v.as_bytes().to_vec()));
    Rec {
        key: Some(tenant.as_bytes().to_vec()),
        headers: vec![
            h("ce-specversion", "1.0"),
            h("ce-id", &id),
            h("ce-source", source),
            h(
                "ce-type",
                &format!("studio.lerian.{source}.{resource}.{ev}"),
            ),
            h("ce-time", "2026-09-26T12:00:00.123456789Z"),
            h("ce-schemaversion", "1.0.0"),
            h("ce-resourcetype", resource),
            h("ce-eventtype", ev),
            h("ce-datacontenttype", "application/json"),
            h("ce-tenantid", tenant),
        ],
        value: Some(format!("{{\"id\":\"{id}\",\"amount\":\"10.00\"}}").into_bytes()),
        partition: None,
    }
}

impl Rec {
    pub fn set(mut self, name: &str, value: Option<&[u8]>) -> Rec {
        self.headers.retain(|(k, _)| k != name);
        if let Some(v) = value {
            self.headers.push((name.to_string(), Some(v.to_vec())));
        }
        self
    }
    pub fn add(mut self, name: &str, value: &[u8]) -> Rec {
        self.headers.push((name.to_string(), Some(value.to_vec())));
        self
    }
    pub fn id(&self) -> String {
        self.header("ce-id").unwrap_or_default().to_string()
    }
}

pub fn produce(producer: &TestProducer, topic: &str, recs: &[Rec]) {
    for r in recs {
        let mut headers = OwnedHeaders::new_with_capacity(r.headers.len());
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: v.as_deref(),
            });
        }
        let mut record = BaseRecord::<[u8], [u8]>::to(topic).headers(headers);
        if let Some(k) = &r.key {
            record = record.key(k);
        }
        if let Some(v) = &r.value {
            record = record.payload(v);
        }
        if let Some(p) = r.partition {
            record = record.partition(p);
        }
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((e, back)) => {
                    assert!(
                        matches!(
                            e,
                            rdkafka::error::KafkaError::MessageProduction(
                                rdkafka::types::RDKafkaErrorCode::QueueFull
                            )
                        ),
                        "produce failed: {e}"
                    );
                    record = back;
                    producer.poll(Duration::from_millis(10));
                }
            }
        }
    }
    // Returns once the records are written; a partition whose leader was killed under load (a
    // fault test) may keep them waiting for minutes.
    producer.flush(Duration::from_secs(200)).expect("flush");
    if let Some(e) = producer.context().0.lock().unwrap().take() {
        panic!("a record was not delivered to {topic}: {e}");
    }
}

/// Produces `rec` with one more header named by the raw bytes `name`: rdkafka's safe API takes
/// only `&str` names, while Kafka and other clients accept any bytes.
pub fn produce_with_raw_header_name(topic: &str, rec: &Rec, name: &[u8]) {
    use rdkafka::message::{BorrowedHeaders, Header, OwnedHeaders};
    use rdkafka::producer::{BaseRecord, Producer};
    let p = producer();
    let mut headers = OwnedHeaders::new();
    for (k, v) in &rec.headers {
        headers = headers.insert(Header {
            key: k,
            value: v.as_deref(),
        });
    }
    let native = headers.as_borrowed() as *const BorrowedHeaders
        as *mut rdkafka::bindings::rd_kafka_headers_t;
    let value = b"1";
    // SAFETY: `native` is the header list `headers` owns, alive and used by nothing else here;
    // librdkafka copies the name and the value.
    let err = unsafe {
        rdkafka::bindings::rd_kafka_header_add(
            native,
            name.as_ptr().cast(),
            name.len() as isize,
            value.as_ptr().cast(),
            value.len() as isize,
        )
    };
    assert_eq!(
        err,
        rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
    );
    let mut record = BaseRecord::<[u8], [u8]>::to(topic).headers(headers);
    if let Some(k) = &rec.key {
        record = record.key(k);
    }
    if let Some(v) = &rec.value {
        record = record.payload(v);
    }
    p.send(record).map_err(|(e, _)| e).expect("send");
    p.flush(Duration::from_secs(60)).expect("flush");
}

/// A record read back, with where it was.
#[derive(Clone, Debug)]
pub struct Got {
    pub rec: Rec,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// Reads everything committed on `topics` from the start until `done(records)` holds, or panics
/// after `timeout` with what it saw.
pub fn read_until(topics: &[&str], timeout: Duration, done: impl Fn(&[Got]) -> bool) -> Vec<Got> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("reader"))
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for t in topics {
        let md = consumer
            .fetch_metadata(Some(t), Duration::from_secs(10))
            .expect("metadata");
        for p in md.topics()[0].partitions() {
            tpl.add_partition_offset(t, p.id(), Offset::Beginning)
                .unwrap();
        }
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    loop {
        if done(&out) {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "condition not met within {timeout:?}; read {} records",
            out.len()
        );
        while let Some(m) = consumer.poll(Duration::from_millis(100)) {
            match m {
                Ok(m) => out.push(got(&m)),
                // A broker of the cluster down (a fault test): librdkafka reports it and goes on
                // with the others; the deadline above still bounds the wait.
                Err(e) => {
                    eprintln!("read_until: {e} (retrying)");
                    break;
                }
            }
            if out.len() % 10_000 == 0 {
                break;
            }
        }
    }
}

/// A consumed record, owned.
fn got(m: &rdkafka::message::BorrowedMessage<'_>) -> Got {
    let headers = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|x| (x.key.to_string(), x.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default();
    Got {
        rec: Rec {
            key: m.key().map(<[u8]>::to_vec),
            headers,
            value: m.payload().map(<[u8]>::to_vec),
            partition: Some(m.partition()),
        },
        topic: m.topic().to_string(),
        partition: m.partition(),
        offset: m.offset(),
    }
}

/// Polls `f` until it returns Some, or panics naming `what`.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The hub binary as a child process with its own environment.
pub struct Hub {
    pub child: Child,
    pub env: BTreeMap<String, String>,
    pub log: std::path::PathBuf,
}

pub fn hub_env(prefix: &str, follow: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("STREAMING_HUB_KAFKA_BROKERS".into(), brokers());
    env.insert("STREAMING_HUB_TOPIC_PREFIX".into(), prefix.into());
    env.insert("STREAMING_HUB_GROUP_ID".into(), format!("{prefix}-group"));
    env.insert("STREAMING_HUB_INSTANCE_ID".into(), format!("{prefix}-1"));
    env.insert("STREAMING_HUB_FOLLOW_PATTERN".into(), follow.into());
    env.insert(
        "STREAMING_HUB_HTTP_LISTEN_ADDR".into(),
        format!("127.0.0.1:{}", free_port()),
    );
    env.insert(
        "STREAMING_HUB_STATE_DIR".into(),
        std::env::temp_dir().join(prefix).display().to_string(),
    );
    env.insert(
        "STREAMING_HUB_TOPOLOGY_FILE".into(),
        concat!(env!("CARGO_MANIFEST_DIR"), "/topology/topics.toml").into(),
    );
    env.insert("STREAMING_HUB_SESSION_TIMEOUT".into(), "6s".into());
    env.insert("STREAMING_HUB_FOLLOW_REFRESH_INTERVAL".into(), "2s".into());
    env.insert("STREAMING_HUB_LOG".into(), "info,streaming_hub=info".into());
    env
}

/// The environment of another instance of the same hub (same topics and groups): its own
/// instance id, HTTP port and state directory, named with `suffix`.
pub fn another_instance(env: &BTreeMap<String, String>, suffix: &str) -> BTreeMap<String, String> {
    let mut env = env.clone();
    let prefix = env["STREAMING_HUB_TOPIC_PREFIX"].clone();
    env.insert(
        "STREAMING_HUB_INSTANCE_ID".into(),
        format!("{prefix}-{suffix}"),
    );
    env.insert(
        "STREAMING_HUB_HTTP_LISTEN_ADDR".into(),
        format!("127.0.0.1:{}", free_port()),
    );
    env.insert(
        "STREAMING_HUB_STATE_DIR".into(),
        std::env::temp_dir()
            .join(format!("{prefix}-{suffix}"))
            .display()
            .to_string(),
    );
    env
}

/// Test-only key-encryption key (32 bytes 0x00..0x1f) and JWT secret.
pub const KEK: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
pub const JWT: &str = "a-test-jwt-secret-that-is-at-least-32-bytes";

/// A hub with its API on: KEK and JWT secret set, local http sinks allowed, following `topic`.
pub fn api_hub_env(prefix: &str, topic: &str) -> BTreeMap<String, String> {
    let mut env = hub_env(prefix, &format!("^{}$", topic.replace('.', r"\.")));
    env.insert("STREAMING_HUB_KEK".into(), KEK.into());
    env.insert("STREAMING_HUB_JWT_SECRET".into(), JWT.into());
    env.insert("STREAMING_HUB_ALLOW_PRIVATE_SINKS".into(), "true".into());
    env.insert("STREAMING_HUB_ALLOW_INSECURE_SINKS".into(), "true".into());
    env
}

/// Serves `app` on 127.0.0.1 (a free port) for the rest of the test; returns its address.
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A port a server started later (a hub, a restartable sink) can bind: see
/// [`streaming_hub::load::free_port`] for why not the kernel's `bind(0)` port.
pub fn free_port() -> u16 {
    streaming_hub::load::free_port()
}

impl Hub {
    pub fn start(env: &BTreeMap<String, String>) -> Hub {
        let hub = Hub::spawn(env);
        hub.wait_ready();
        hub
    }

    /// Starts the binary without waiting for it to be ready (it may not become ready).
    pub fn spawn(env: &BTreeMap<String, String>) -> Hub {
        let log = std::env::temp_dir().join(format!(
            "{}-{}.log",
            env["STREAMING_HUB_INSTANCE_ID"],
            unique("h")
        ));
        let file = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_streaming-hub"));
        command
            .arg("run")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env)
            .stdout(Stdio::null())
            .stderr(file);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent. The hub dies
        // with the test process, also one aborted or killed (a CI timeout), so no hub outlives
        // its test holding ports and CPU.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start hub");
        Hub {
            child,
            env: env.clone(),
            log,
        }
    }

    pub fn addr(&self) -> String {
        self.env["STREAMING_HUB_HTTP_LISTEN_ADDR"].clone()
    }

    /// The hub's `/metrics` page as it is now.
    pub async fn metrics_text(&self, http: &reqwest::Client) -> reqwest::Result<String> {
        http.get(format!("http://{}/metrics", self.addr()))
            .send()
            .await?
            .text()
            .await
    }

    /// The hub's `/metrics` page once the metric lines starting with `name` sum to at least
    /// `at_least` (panics after 60 s).
    pub async fn metrics_when(&self, http: &reqwest::Client, name: &str, at_least: u64) -> String {
        let mut text = String::new();
        for _ in 0..3000 {
            text = self.metrics_text(http).await.unwrap_or_default();
            if metric_sum(&text, name) >= at_least {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "{name} never reached {at_least} (is {})",
            metric_sum(&text, name)
        );
    }

    /// Waits for `/readyz` to answer 200; fails at once, with the log, if the hub has exited
    /// (what answers on its port would then be another process).
    pub fn wait_ready(&self) {
        self.wait_ready_within(Duration::from_secs(60));
    }

    /// [`Hub::wait_ready`] for up to `timeout`.
    pub fn wait_ready_within(&self, timeout: Duration) {
        wait_until(timeout, "hub /readyz", || {
            assert!(
                !self.exited(),
                "the hub exited before it was ready:\n{}",
                log_tail(&self.log_text(), 40)
            );
            (self.status_of("/readyz")? == 200).then_some(())
        });
    }

    /// Whether the process has ended (it stays a zombie until reaped, so its pid is not reused).
    pub fn exited(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))
            .map(|stat| {
                stat.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
            })
            .unwrap_or(true)
    }

    /// The status a plain `GET path` gets now; None when the connection is refused or no answer
    /// comes within 5 s.
    pub fn status_of(&self, path: &str) -> Option<u16> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(self.addr()).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
            .ok()?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).ok()?;
        buf.strip_prefix("HTTP/1.0 ")?.get(..3)?.parse().ok()
    }

    /// Sends SIGTERM and returns at once (see [`Hub::terminate`] to wait for the exit).
    pub fn sigterm(&self) {
        unsafe_sigterm(self.child.id());
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for the process to end, which must be a clean exit (0). A graceful
    /// stop longer than the default stall timeout (120 s) plus a margin is a hang: it fails the
    /// test (the hub is killed when this `Hub` drops) instead of hanging the suite; so does an
    /// exit by the stall watchdog (code 70), which only a loop stuck during the stop triggers,
    /// and any other failure (a stage that failed or panicked: 1, or a signal).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        unsafe_sigterm(self.child.id());
        let child = &mut self.child;
        let status = wait_until(
            Duration::from_secs(150),
            "the hub to stop after SIGTERM",
            || child.try_wait().unwrap(),
        );
        assert_ne!(
            status.code(),
            Some(70),
            "the stall watchdog ended the hub during its stop:\n{}",
            self.log_text()
        );
        assert!(
            status.success(),
            "the hub did not stop cleanly on SIGTERM ({status}):\n{}",
            self.log_text()
        );
        status
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until this hub's log has `needle`; on a timeout the failure shows the last lines
    /// of this hub's log and of `others`' (what the hubs did instead).
    pub fn wait_logged(&self, timeout: Duration, needle: &str, others: &[&Hub]) {
        let deadline = Instant::now() + timeout;
        while !self.log_text().contains(needle) {
            if Instant::now() >= deadline {
                let tails: Vec<String> = std::iter::once(self)
                    .chain(others.iter().copied())
                    .map(|h| {
                        format!(
                            "--- {}:\n{}",
                            h.env["STREAMING_HUB_INSTANCE_ID"],
                            log_tail(&h.log_text(), 80)
                        )
                    })
                    .collect();
                panic!(
                    "timed out after {timeout:?} waiting for the log line {needle:?}\n{}",
                    tails.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `n` lines of a hub's log, without colour codes, each cut at 400 characters.
fn log_tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| {
            let plain = strip_ansi(l);
            plain.chars().take(400).collect::<String>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn unsafe_sigterm(pid: u32) {
    send_signal(pid, libc::SIGTERM);
}

/// kill(2): one the process already gone (ESRCH: it ended and was waited for) is no error; any
/// other failure is.
pub fn send_signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on the pid of this process's child.
    if unsafe { libc::kill(pid as libc::pid_t, signal) } != 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ESRCH),
            "signal {signal} to {pid}: {e}"
        );
    }
}

/// How long [`read_all`] waits for the last stable offsets to reach the high watermarks.
/// A transaction's commit returns before the coordinator has written its markers to every
/// partition; until it has, a `read_committed` client is told an end before the transaction's
/// records. A transaction left open (its producer killed and not replaced) keeps the two apart
/// until it times out: after this wait, the end before it is read, as it was without the wait.
const SETTLE: Duration = Duration::from_secs(15);

/// Reads every committed record of `topics` up to their current end (a settled topic: nobody is
/// writing). The end a `read_committed` client is told is the last stable offset: it is waited
/// for (at most [`SETTLE`]) to reach the high watermark, so the last transaction committed is
/// read whole. Positions move past transaction markers.
pub fn read_all(topics: &[&str], timeout: Duration) -> Vec<Got> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("reader"))
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    // Asks for the high watermark.
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("isolation.level", "read_uncommitted")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    let mut ends = Vec::new();
    // One wait for all the partitions: a transaction left open holds several back.
    let settled = Instant::now() + SETTLE.min(timeout);
    for t in topics {
        // A topic that does not exist has no partition: it must not read as an empty one, or
        // a check that something was never written passes for a misspelt name.
        let what = format!("topic {t} to exist (no partition)");
        let md = wait_until(timeout, &what, || {
            let md = consumer
                .fetch_metadata(Some(t), Duration::from_secs(10))
                .expect("metadata");
            (!md.topics()[0].partitions().is_empty()).then_some(md)
        });
        for p in md.topics()[0].partitions() {
            tpl.add_partition_offset(t, p.id(), Offset::Beginning)
                .unwrap();
            // A topic created a moment ago may not have its leader yet.
            let end_of = |c: &BaseConsumer| {
                wait_until(timeout, &format!("the end of {t}/{}", p.id()), || {
                    c.fetch_watermarks(t, p.id(), Duration::from_secs(10)).ok()
                })
                .1
            };
            let high = end_of(&probe);
            let stable = loop {
                let stable = end_of(&consumer);
                if stable >= high {
                    break stable;
                }
                if Instant::now() > settled {
                    eprintln!(
                        "read_all: {t}/{} has a transaction open from {stable} to {high}: read \
                         to {stable}",
                        p.id()
                    );
                    break stable;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            ends.push((t.to_string(), p.id(), stable));
        }
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    loop {
        while let Some(m) = consumer.poll(Duration::from_millis(200)) {
            out.push(got(&m.expect("consume")));
        }
        let pos = consumer.position().unwrap();
        let done = ends.iter().all(|(t, p, high)| {
            *high == 0
                || pos
                    .find_partition(t, *p)
                    .and_then(|e| match e.offset() {
                        Offset::Offset(o) => Some(o >= *high),
                        _ => None,
                    })
                    .unwrap_or(false)
        });
        if done {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "did not reach the end of {topics:?} within {timeout:?}; read {}",
            out.len()
        );
    }
}

/// `group` has done everything on `topic`: reading `read_committed` from its committed offsets
/// finds no record before the end (only transaction markers may remain, which is why comparing
/// offsets with the high watermark is not enough).
pub fn group_caught_up(group: &str, topic: &str) -> bool {
    group_caught_up_on(group, topic, None)
}

/// [`group_caught_up`] for some of the topic's partitions (`None`: all of them).
pub fn group_caught_up_on(group: &str, topic: &str, only: Option<&[i32]>) -> bool {
    caught_up(group, topic, only, "read_committed")
}

/// [`group_caught_up`] up to the end of what was written, not only of what was committed: a
/// transaction committed but whose marker on `topic` is not written yet counts as still to
/// read. The end a read_committed client is told is the last stable offset, before such a
/// transaction; and a writer's commit can show its consumer offsets (on `__consumer_offsets`)
/// before its records here, so a check of the writer's group, then of the reader's, could pass
/// with the writer's last records still unread. A transaction left open holds this back until
/// it ends.
pub fn group_caught_up_with_all_written(group: &str, topic: &str) -> bool {
    caught_up(group, topic, None, "read_uncommitted")
}

fn caught_up(group: &str, topic: &str, only: Option<&[i32]>, ends_as: &str) -> bool {
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        // The ends it asks for: the high watermark, or the last stable offset.
        .set("isolation.level", ends_as)
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let Ok(md) = probe.fetch_metadata(Some(topic), Duration::from_secs(10)) else {
        return false;
    };
    let mut tpl = TopicPartitionList::new();
    for p in md.topics()[0].partitions() {
        if only.is_none_or(|o| o.contains(&p.id())) {
            tpl.add_partition(topic, p.id());
        }
    }
    // A topic that does not exist (or has none of `only`) is not a caught-up one: a check that
    // nothing more will arrive must not pass for a misspelt name.
    if tpl.count() == 0 {
        return false;
    }
    let Ok(committed) = probe.committed_offsets(tpl, Duration::from_secs(10)) else {
        return false;
    };
    let mut start = TopicPartitionList::new();
    let mut ends = Vec::new();
    for e in committed.elements() {
        let Ok((_, high)) = probe.fetch_watermarks(topic, e.partition(), Duration::from_secs(10))
        else {
            return false;
        };
        let from = match e.offset() {
            Offset::Offset(o) => o,
            _ => 0,
        };
        if from < high {
            start
                .add_partition_offset(topic, e.partition(), Offset::Offset(from))
                .unwrap();
            ends.push((e.partition(), high));
        }
    }
    if ends.is_empty() {
        return true;
    }
    // A separate reader (no group) so the probe never joins or disturbs the group.
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("probe"))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    reader.assign(&start).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if reader.poll(Duration::from_millis(100)).is_some() {
            return false; // a record (or an error) before the end: not caught up
        }
        let Ok(pos) = reader.position() else {
            return false;
        };
        let done = ends.iter().all(|(p, high)| {
            matches!(pos.find_partition(topic, *p).map(|e| e.offset()), Some(Offset::Offset(o)) if o >= *high)
        });
        if done {
            return true;
        }
    }
    false
}

/// `POST <path>` of a JSON body to the hub at `addr` with `token`: (status, body as JSON, or
/// null when it is not JSON).
pub async fn post_json_to(
    http: &reqwest::Client,
    addr: &str,
    path: &str,
    token: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    call_json(http, reqwest::Method::POST, addr, path, token, Some(body)).await
}

/// `<method> <path>` to the hub at `addr` with `token` and a JSON body if given: (status, body
/// as JSON, or null when it is not JSON).
pub async fn call_json(
    http: &reqwest::Client,
    method: reqwest::Method,
    addr: &str,
    path: &str,
    token: &str,
    body: Option<&serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut r = http
        .request(method, format!("http://{addr}{path}"))
        .bearer_auth(token);
    if let Some(body) = body {
        r = r
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let bytes = r.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// `POST /v1/subscriptions` to the hub at `addr` with `token`; asserts 201 and returns the body.
pub async fn post_subscription(
    http: &reqwest::Client,
    addr: &str,
    token: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    let (status, v) = post_json_to(http, addr, "/v1/subscriptions", token, body).await;
    assert_eq!(status, 201, "{v}");
    v
}

/// A running hub with its API on, its own producer topic, and an HTTP client to talk to it.
/// Lowers `topic`'s `max.message.bytes` to 4 KiB under a running hub (an operator's change),
/// sends `tenant`'s event of 16 KiB of random bytes (the limit applies to compressed batches)
/// to `source_topic`, and waits for `hub` to exit: its exit code and log.
pub async fn refused_writes_end_the_hub(
    hub: &mut Hub,
    topic: &str,
    source_topic: &str,
    tenant: &str,
) -> (Option<i32>, String) {
    use rdkafka::admin::{AlterConfig, ResourceSpecifier};
    for r in admin()
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(topic)).set("max.message.bytes", "4096")],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let mut big = event(tenant, "ledger", "transaction", "created");
    let mut payload = vec![0u8; 16_384];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut payload);
    big.value = Some(payload);
    produce(&producer(), source_topic, &[big]);
    let child = &mut hub.child;
    let status = wait_until(Duration::from_secs(150), "the hub exits", || {
        child.try_wait().unwrap()
    });
    (status.code(), hub.log_text())
}

pub struct ApiHub {
    pub prefix: String,
    pub topic: String,
    pub hub: Hub,
    pub http: reqwest::Client,
}

/// Another instance of `s`'s hub (its own member of the groups, its own state) in `role`, whose
/// control reader, once caught up, waits `lag` before each record
/// (`STREAMING_HUB_DANGEROUS_TEST_CONTROL_LAG`); started, and ready.
pub fn lagging_instance(s: &ApiHub, suffix: &str, role: &str, lag: &str) -> Hub {
    let mut env = another_instance(&api_hub_env(&s.prefix, &s.topic), suffix);
    env.insert("STREAMING_HUB_ROLE".into(), role.into());
    env.insert(
        "STREAMING_HUB_DANGEROUS_TEST_CONTROL_LAG".into(),
        lag.into(),
    );
    let hub = Hub::start(&env);
    hub.wait_ready();
    hub
}

impl ApiHub {
    /// Starts a hub following a fresh `lerian.streaming.<prefix>` topic, with `extra` settings.
    pub async fn start(tag: &str, extra: &[(&str, &str)]) -> ApiHub {
        require_broker();
        let prefix = unique(tag);
        let topic = format!("lerian.streaming.{prefix}");
        create_topic(&topic, 1).await;
        let mut env = api_hub_env(&prefix, &topic);
        for (k, v) in extra {
            env.insert(k.to_string(), v.to_string());
        }
        let hub = Hub::start(&env);
        ApiHub {
            prefix,
            topic,
            hub,
            http: hub_http(),
        }
    }

    /// A tenant token, long-lived (the hub checks expiry on its own, possibly virtual, clock).
    pub fn token(&self, tenant: &str) -> String {
        streaming_hub::api::mint(
            &streaming_hub::runtime::secret::Secret::new(JWT),
            Some(tenant),
            false,
            Duration::from_secs(30 * 86_400),
        )
    }

    /// `POST /v1/subscriptions`; asserts 201 and returns the response body.
    pub async fn create_subscription(
        &self,
        tenant: &str,
        body: serde_json::Value,
    ) -> serde_json::Value {
        post_subscription(&self.http, &self.hub.addr(), &self.token(tenant), &body).await
    }

    pub async fn get_subscription(&self, tenant: &str, id: &str) -> serde_json::Value {
        let r = self
            .http
            .get(format!("http://{}/v1/subscriptions/{id}", self.hub.addr()))
            .bearer_auth(self.token(tenant))
            .send()
            .await
            .unwrap();
        serde_json::from_slice(&r.bytes().await.unwrap()).unwrap()
    }

    /// The sum of every series of a metric whose line starts with `name` (a label prefix may
    /// follow the name, e.g. `streaming_hub_attempts_total{outcome="delivered"`).
    pub async fn metric(&self, name: &str) -> u64 {
        metric_sum(&self.metrics_text().await, name)
    }

    /// The hub's `/metrics` page as it is now.
    pub async fn metrics_text(&self) -> String {
        self.hub.metrics_text(&self.http).await.unwrap()
    }

    pub async fn wait_metric(&self, name: &str, at_least: u64) {
        self.hub.metrics_when(&self.http, name, at_least).await;
    }

    /// Has the hub commit its inbox offsets once, with an event no one subscribed to: until a
    /// partition has a committed offset its new events' first attempts start only after their
    /// claim committed (a later owner could not tell what this one was attempting).
    pub async fn commit_inbox_offsets(&self) {
        produce(
            &producer(),
            &self.topic,
            &[event("tenant-nobody", "ledger", "transaction", "posted")],
        );
        self.wait_metric("streaming_hub_hub_commit_seconds_count", 1)
            .await;
    }

    /// Moves the hub's dangerous test clock (`POST /admin/clock/advance`).
    pub async fn advance(&self, by: &str) {
        advance_clock(&self.http, &self.hub, by).await;
    }
}

/// Moves the dangerous test clock of `hub` (`POST /admin/clock/advance`).
pub async fn advance_clock(http: &reqwest::Client, hub: &Hub, by: &str) {
    let admin = streaming_hub::api::mint(
        &streaming_hub::runtime::secret::Secret::new(JWT),
        None,
        true,
        Duration::from_secs(7 * 86_400),
    );
    let r = http
        .post(format!("http://{}/admin/clock/advance", hub.addr()))
        .bearer_auth(admin)
        .header("content-type", "application/json")
        .body(serde_json::json!({ "by": by }).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
}

/// Sums the values of Prometheus text lines that start with `name`.
pub fn metric_sum(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Prints a test's figures (one JSON line) straight to stderr, past the test harness's output
/// capture, so the test command's log shows them for passing tests too.
pub fn report(line: &serde_json::Value) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "FIGURES {line}");
}

/// The first port of the 3-broker cluster that scripts/test.sh starts (`TEST_KAFKA_CLUSTER_PORT`).
pub fn cluster_port() -> u16 {
    std::env::var("TEST_KAFKA_CLUSTER_PORT")
        .expect(
            "TEST_KAFKA_CLUSTER_PORT unset: run scripts/test.sh, which starts the 3-broker cluster",
        )
        .parse()
        .unwrap()
}

/// The 3-broker cluster's bootstrap list (`TEST_KAFKA_CLUSTER_PORT` and the next two ports).
pub fn cluster_bootstrap() -> String {
    let port = cluster_port();
    format!(
        "127.0.0.1:{port},127.0.0.1:{},127.0.0.1:{}",
        port + 1,
        port + 2
    )
}

/// Points the shared helpers (`brokers()`, hubs started after) at the 3-broker cluster, for a
/// test binary that holds one test: `TEST_KAFKA_BROKERS` is process-wide.
pub fn use_cluster() -> String {
    let bootstrap = cluster_bootstrap();
    // SAFETY: the calling binary has one test; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("TEST_KAFKA_BROKERS", &bootstrap) };
    require_broker();
    bootstrap
}

/// `scripts/kafka.sh <args>` on the 3-broker cluster (e.g. `kill 2`, `restart-node 2`).
pub fn cluster_kafka_sh(args: &[&str]) {
    let status = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kafka.sh"))
        .args(args)
        .env("KAFKA_PORT", cluster_port().to_string())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "kafka.sh {args:?} failed");
}

/// A broker of the 3-broker cluster killed for a test; restarted by [`BrokerDown::restart`], or
/// when dropped, also when the test fails, so that the tests after it (in this binary and the
/// next ones on the same cluster) find the cluster whole.
pub struct BrokerDown(Option<i32>);

impl BrokerDown {
    pub fn kill(node: i32) -> BrokerDown {
        cluster_kafka_sh(&["kill", &node.to_string()]);
        BrokerDown(Some(node))
    }

    /// Restarts the broker and waits until it answers metadata.
    pub fn restart(mut self) {
        if let Some(node) = self.0.take() {
            cluster_kafka_sh(&["restart-node", &node.to_string()]);
        }
    }
}

impl Drop for BrokerDown {
    fn drop(&mut self) {
        let Some(node) = self.0.take() else { return };
        if std::thread::panicking() {
            // No second panic (it would abort): say it when the restart fails.
            let restarted = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kafka.sh"))
                .args(["restart-node", &node.to_string()])
                .env("KAFKA_PORT", cluster_port().to_string())
                .status()
                .is_ok_and(|s| s.success());
            if !restarted {
                eprintln!("broker {node} of the test cluster could not be restarted");
            }
        } else {
            cluster_kafka_sh(&["restart-node", &node.to_string()]);
        }
    }
}

/// An HTTP client for the hub's API: no proxy, and pooled connections idle less than the hub's
/// read timeout (10 s), which closes them (a request sent on one as it closes fails).
pub fn hub_http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// The latest record of each subscription on the control topic.
pub fn control_records(
    prefix: &str,
) -> BTreeMap<String, streaming_hub::runtime::records::SubscriptionRecord> {
    let codec = streaming_hub::runtime::avro::Codec::new().unwrap();
    let control = format!("{prefix}.subscriptions");
    let mut latest = BTreeMap::new();
    for g in read_all(&[&control], Duration::from_secs(30)) {
        if let Some(v) = g.rec.value {
            let r: streaming_hub::runtime::records::SubscriptionRecord = codec
                .decode(streaming_hub::runtime::avro::RecordKind::Subscription, &v)
                .unwrap();
            latest.insert(r.id.clone(), r);
        }
    }
    latest
}

/// Writes `rec` to the control topic as any producer with write access to it could, and waits
/// until the hub's table shows its URL.
pub async fn write_control_record(
    api: &ApiHub,
    rec: &streaming_hub::runtime::records::SubscriptionRecord,
) {
    let bytes = streaming_hub::runtime::avro::Codec::new()
        .unwrap()
        .encode(streaming_hub::runtime::avro::RecordKind::Subscription, rec)
        .unwrap();
    let control = format!("{}.subscriptions", api.prefix);
    let r = Rec {
        key: Some(rec.id.clone().into_bytes()),
        value: Some(bytes),
        ..Default::default()
    };
    produce(&producer(), &control, &[r]);
    // As the API shows it (a record written before URLs were sealed holds it as given).
    let url = rec.destination.url.clone().unwrap();
    let want = streaming_hub::subscriptions::sealed_url::redacted(&url).into_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = api.get_subscription(&rec.tenant_id, &rec.id).await;
        if v["destination"]["url"] == want.as_str() && v["version"] == rec.version {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the table never showed {want}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deletes the records of `topic`'s `partition` before `offset`, as retention would (rust-rdkafka
/// has no binding for librdkafka's DeleteRecords admin call, so it is called directly), and waits
/// until the broker reports the new log start.
pub fn delete_records_before(topic: &str, partition: i32, offset: i64) {
    use rdkafka::bindings as rd;
    let client: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("client");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset))
        .unwrap();
    let rk = client.client().native_ptr();
    // SAFETY: every handle is created here, used on this thread and destroyed once; the request
    // copies the partition list; the event is polled from the queue the request was given.
    unsafe {
        let mut request = rd::rd_kafka_DeleteRecords_new(tpl.ptr());
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_DeleteRecords(rk, &mut request, 1, std::ptr::null(), queue);
        let answer = rd::rd_kafka_queue_poll(queue, 30_000);
        assert!(!answer.is_null(), "no answer to DeleteRecords within 30 s");
        let err = rd::rd_kafka_event_error(answer);
        rd::rd_kafka_event_destroy(answer);
        rd::rd_kafka_DeleteRecords_destroy(request);
        rd::rd_kafka_queue_destroy(queue);
        assert_eq!(err, rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
    }
    wait_until(Duration::from_secs(30), "the new log start", || {
        let (low, _) = client
            .client()
            .fetch_watermarks(topic, partition, Duration::from_secs(5))
            .ok()?;
        (low == offset).then_some(())
    });
}

/// `streaming-hub topology apply [extra]` for `prefix` with the repository's topology file:
/// (exit code, stdout + stderr).
pub fn topology_apply(prefix: &str, extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
        .args(["topology", "apply"])
        .args(extra)
        .env("STREAMING_HUB_KAFKA_BROKERS", brokers())
        .env("STREAMING_HUB_TOPIC_PREFIX", prefix)
        .env(
            "STREAMING_HUB_TOPOLOGY_FILE",
            concat!(env!("CARGO_MANIFEST_DIR"), "/topology/topics.toml"),
        )
        .output()
        .expect("run topology apply");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// The ids of a pull page's events (`GET /v1/events`), in order.
#[allow(dead_code)] // not every test crate reads pull pages
pub fn page_ids(page: &serde_json::Value) -> Vec<String> {
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect()
}
