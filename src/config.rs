//! The hub's configuration: every `STREAMING_HUB_*` variable, its default and its meaning, in one
//! table ([`VARIABLES`]), read from the environment and optionally a TOML file.
//!
//! Sources, later wins: built-in defaults, the file named by `STREAMING_HUB_CONFIG_FILE` (keys are
//! the variable names without the prefix, lower case: `kafka_brokers = "…"`), the environment.
//! Unknown `STREAMING_HUB_*` variables and unknown file keys are errors (a typo must not silently
//! fall back to a default). Every error names the variable at fault. `streaming-hub config` prints
//! the table as Markdown; the README's table is that output.
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::ingest::signature::SignatureKeys;
use crate::runtime::secret::Secret;

pub const PREFIX: &str = "STREAMING_HUB_";
pub const CONFIG_FILE_VAR: &str = "STREAMING_HUB_CONFIG_FILE";
/// librdkafka's debug contexts (`STREAMING_HUB_KAFKA_DEBUG`), as librdkafka 2.12 names them.
pub const KAFKA_DEBUG_CONTEXTS: &[&str] = &[
    "generic",
    "broker",
    "topic",
    "metadata",
    "feature",
    "queue",
    "msg",
    "protocol",
    "cgrp",
    "security",
    "fetch",
    "interceptor",
    "plugin",
    "consumer",
    "admin",
    "eos",
    "mock",
    "assignor",
    "conf",
    "telemetry",
    "all",
];

/// Most hub loops one instance runs (`STREAMING_HUB_HUB_STAGES`).
pub const MAX_HUB_STAGES: usize = 8;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{var} is required: {why}")]
    Missing { var: &'static str, why: String },
    #[error("{var} is invalid: {why}")]
    Invalid { var: String, why: String },
    #[error("{var} is not a known setting (see `streaming-hub config` for the list)")]
    Unknown { var: String },
    #[error("config file {path}: {why}")]
    File { path: String, why: String },
}

/// One documented setting.
#[derive(Debug, Clone, Copy)]
pub struct Variable {
    pub name: &'static str,
    pub default: &'static str,
    pub doc: &'static str,
}

/// Which parts of the hub a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    All,
    Ingest,
    Delivery,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Parses one variable's text into its typed value.
pub trait FromVar: Sized {
    fn from_var(text: &str) -> Result<Self, String>;
}

impl FromVar for String {
    fn from_var(text: &str) -> Result<Self, String> {
        Ok(text.to_string())
    }
}

impl FromVar for Secret {
    fn from_var(text: &str) -> Result<Self, String> {
        Ok(Secret::new(text))
    }
}

impl FromVar for Option<String> {
    fn from_var(text: &str) -> Result<Self, String> {
        Ok((!text.is_empty()).then(|| text.to_string()))
    }
}

impl FromVar for bool {
    fn from_var(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            _ => Err(format!("expected true or false, got {text:?}")),
        }
    }
}

macro_rules! from_var_number {
    ($($t:ty),*) => {$(
        impl FromVar for $t {
            fn from_var(text: &str) -> Result<Self, String> {
                text.trim().parse::<$t>().map_err(|e| format!("expected a number, got {text:?} ({e})"))
            }
        }
    )*};
}
from_var_number!(u16, u32, u64, usize, i32);

/// The largest `STREAMING_HUB_MAX_PAYLOAD_BYTES`: an accepted payload is copied into the inbox,
/// the payload changelog and the pull topic with headers around it, each topic taking at most
/// 2 MiB a record (`topology/topics.toml`); a larger one would fail every transaction it is in.
pub const MAX_PAYLOAD_BYTES: usize = 1_572_864;

/// The most `STREAMING_HUB_DISPATCH_WORKERS`: the claim bounds are multiples of it, which a
/// value near `usize::MAX` overflowed.
const MAX_DISPATCH_WORKERS: usize = 100_000;
/// The most `STREAMING_HUB_HTTP_MAX_CONNECTIONS`: more than a process's file descriptors, and a
/// value past `usize::MAX >> 3` panicked the server at start instead of naming the setting.
const MAX_HTTP_CONNECTIONS: usize = 1_000_000;

/// The longest duration a setting takes: deadlines are `Instant::now() + setting`, which panics
/// past the clock's range (e.g. `18446744073709551615s`).
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The least `STREAMING_HUB_STALL_TIMEOUT` before `STREAMING_HUB_EARLY_ATTEMPT_WAIT`: a Kafka
/// transaction call's 30 s bound and a margin.
const STALL_MARGIN: Duration = Duration::from_secs(35);

impl FromVar for Duration {
    fn from_var(text: &str) -> Result<Self, String> {
        let d = humantime::parse_duration(text.trim()).map_err(|e| {
            format!("expected a duration such as 30s, 5m or 24h, got {text:?} ({e})")
        })?;
        if d > MAX_DURATION {
            return Err(format!("expected at most 100 years, got {text:?}"));
        }
        Ok(d)
    }
}

impl FromVar for SocketAddr {
    fn from_var(text: &str) -> Result<Self, String> {
        text.parse()
            .map_err(|e| format!("expected host:port, got {text:?} ({e})"))
    }
}

impl FromVar for Option<SocketAddr> {
    fn from_var(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Ok(None);
        }
        SocketAddr::from_var(text).map(Some)
    }
}

impl FromVar for PathBuf {
    fn from_var(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("must not be empty".into());
        }
        Ok(PathBuf::from(text))
    }
}

impl FromVar for Role {
    fn from_var(text: &str) -> Result<Self, String> {
        match text {
            "all" => Ok(Role::All),
            "ingest" => Ok(Role::Ingest),
            "delivery" => Ok(Role::Delivery),
            _ => Err(format!("expected all, ingest or delivery, got {text:?}")),
        }
    }
}

impl FromVar for LogFormat {
    fn from_var(text: &str) -> Result<Self, String> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("expected text or json, got {text:?}")),
        }
    }
}

macro_rules! settings {
    ($( $(#[doc = $doc:literal])+ $field:ident : $ty:ty = $default:literal; )*) => {
        /// The whole configuration, typed. Field docs are the README's.
        #[derive(Debug, Clone)]
        pub struct Config {
            $( $(#[doc = $doc])+ pub $field: $ty, )*
        }

        /// Every variable, its default and its meaning.
        pub const VARIABLES: &[Variable] = &[
            $( Variable {
                name: concat!("STREAMING_HUB_", upper!($field)),
                default: $default,
                doc: concat!($($doc),+),
            }, )*
        ];

        impl Config {
            fn build(values: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
                Ok(Config { $(
                    $field: {
                        let var = concat!("STREAMING_HUB_", upper!($field));
                        let text = values.get(var).map(String::as_str).unwrap_or($default);
                        <$ty as FromVar>::from_var(text)
                            .map_err(|why| ConfigError::Invalid { var: var.to_string(), why })?
                    },
                )* })
            }
        }
    };
}

// `concat!` cannot upper-case, so each field name is spelled out once more in upper case here,
// next to the table; a field missing here does not compile.
macro_rules! upper {
    (kafka_brokers) => {
        "KAFKA_BROKERS"
    };
    (kafka_security_protocol) => {
        "KAFKA_SECURITY_PROTOCOL"
    };
    (kafka_sasl_mechanism) => {
        "KAFKA_SASL_MECHANISM"
    };
    (kafka_sasl_username) => {
        "KAFKA_SASL_USERNAME"
    };
    (kafka_sasl_password) => {
        "KAFKA_SASL_PASSWORD"
    };
    (kafka_ssl_ca_location) => {
        "KAFKA_SSL_CA_LOCATION"
    };
    (kafka_ssl_certificate_location) => {
        "KAFKA_SSL_CERTIFICATE_LOCATION"
    };
    (kafka_ssl_key_location) => {
        "KAFKA_SSL_KEY_LOCATION"
    };
    (kafka_ssl_key_password) => {
        "KAFKA_SSL_KEY_PASSWORD"
    };
    (kafka_debug) => {
        "KAFKA_DEBUG"
    };
    (topic_prefix) => {
        "TOPIC_PREFIX"
    };
    (topology_file) => {
        "TOPOLOGY_FILE"
    };
    (replication_factor) => {
        "REPLICATION_FACTOR"
    };
    (group_id) => {
        "GROUP_ID"
    };
    (instance_id) => {
        "INSTANCE_ID"
    };
    (role) => {
        "ROLE"
    };
    (http_listen_addr) => {
        "HTTP_LISTEN_ADDR"
    };
    (metrics_listen_addr) => {
        "METRICS_LISTEN_ADDR"
    };
    (http_max_connections) => {
        "HTTP_MAX_CONNECTIONS"
    };
    (http_read_timeout) => {
        "HTTP_READ_TIMEOUT"
    };
    (state_dir) => {
        "STATE_DIR"
    };
    (follow_pattern) => {
        "FOLLOW_PATTERN"
    };
    (follow_refresh_interval) => {
        "FOLLOW_REFRESH_INTERVAL"
    };
    (require_uuidv7) => {
        "REQUIRE_UUIDV7"
    };
    (max_payload_bytes) => {
        "MAX_PAYLOAD_BYTES"
    };
    (require_signatures) => {
        "REQUIRE_SIGNATURES"
    };
    (signature_keys) => {
        "SIGNATURE_KEYS"
    };
    (signature_max_age) => {
        "SIGNATURE_MAX_AGE"
    };
    (require_source_topic) => {
        "REQUIRE_SOURCE_TOPIC"
    };
    (ingest_batch_max) => {
        "INGEST_BATCH_MAX"
    };
    (hub_batch_max) => {
        "HUB_BATCH_MAX"
    };
    (hub_batch_jobs) => {
        "HUB_BATCH_JOBS"
    };
    (hub_stages) => {
        "HUB_STAGES"
    };
    (api_write_rate) => {
        "API_WRITE_RATE"
    };
    (api_write_burst) => {
        "API_WRITE_BURST"
    };
    (pull_rate) => {
        "PULL_RATE"
    };
    (max_subscriptions_per_tenant) => {
        "MAX_SUBSCRIPTIONS_PER_TENANT"
    };
    (max_pull_subscriptions_per_tenant) => {
        "MAX_PULL_SUBSCRIPTIONS_PER_TENANT"
    };
    (pull_burst) => {
        "PULL_BURST"
    };
    (dlq_group) => {
        "DLQ_GROUP"
    };
    (dlq_retention) => {
        "DLQ_RETENTION"
    };
    (shutdown_timeout) => {
        "SHUTDOWN_TIMEOUT"
    };
    (stall_timeout) => {
        "STALL_TIMEOUT"
    };
    (rebalance_wait) => {
        "REBALANCE_WAIT"
    };
    (commit_interval) => {
        "COMMIT_INTERVAL"
    };
    (commit_interval_min) => {
        "COMMIT_INTERVAL_MIN"
    };
    (idempotency_ttl) => {
        "IDEMPOTENCY_TTL"
    };
    (session_timeout) => {
        "SESSION_TIMEOUT"
    };
    (kek) => {
        "KEK"
    };
    (kek_id) => {
        "KEK_ID"
    };
    (kek_previous) => {
        "KEK_PREVIOUS"
    };
    (jwt_secret) => {
        "JWT_SECRET"
    };
    (allow_private_sinks) => {
        "ALLOW_PRIVATE_SINKS"
    };
    (allow_insecure_sinks) => {
        "ALLOW_INSECURE_SINKS"
    };
    (send_unbound_headers) => {
        "SEND_UNBOUND_HEADERS"
    };
    (secret_rotation_grace) => {
        "SECRET_ROTATION_GRACE"
    };
    (http_timeout) => {
        "HTTP_TIMEOUT"
    };
    (dispatch_workers) => {
        "DISPATCH_WORKERS"
    };
    (dispatch_claims_ahead) => {
        "DISPATCH_CLAIMS_AHEAD"
    };
    (dispatch_claims_ahead_bytes) => {
        "DISPATCH_CLAIMS_AHEAD_BYTES"
    };
    (early_attempt_wait) => {
        "EARLY_ATTEMPT_WAIT"
    };
    (poison_threshold) => {
        "POISON_THRESHOLD"
    };
    (dangerous_test_clock) => {
        "DANGEROUS_TEST_CLOCK"
    };
    (dangerous_test_stale_offsets) => {
        "DANGEROUS_TEST_STALE_OFFSETS"
    };
    (dangerous_test_control_lag) => {
        "DANGEROUS_TEST_CONTROL_LAG"
    };
    (autodisable_enabled) => {
        "AUTODISABLE_ENABLED"
    };
    (autodisable_failure_window) => {
        "AUTODISABLE_FAILURE_WINDOW"
    };
    (autodisable_failure_spread) => {
        "AUTODISABLE_FAILURE_SPREAD"
    };
    (log) => {
        "LOG"
    };
    (log_format) => {
        "LOG_FORMAT"
    };
}

settings! {
    /// Kafka bootstrap servers, comma separated.
    kafka_brokers: String = "127.0.0.1:9092";
    /// `plaintext`, `ssl`, `sasl_plaintext` or `sasl_ssl`.
    kafka_security_protocol: String = "plaintext";
    /// SASL mechanism when the protocol is `sasl_*`: `SCRAM-SHA-256`, `SCRAM-SHA-512` or `PLAIN`.
    kafka_sasl_mechanism: Option<String> = "";
    /// SASL user name (required with a SASL protocol).
    kafka_sasl_username: Option<String> = "";
    /// SASL password (secret; never logged).
    kafka_sasl_password: Secret = "";
    /// PEM file of the CA that signed the brokers' certificates (TLS).
    kafka_ssl_ca_location: Option<String> = "";
    /// PEM client certificate for mutual TLS.
    kafka_ssl_certificate_location: Option<String> = "";
    /// PEM client private key for mutual TLS.
    kafka_ssl_key_location: Option<String> = "";
    /// Password of the client private key (secret).
    kafka_ssl_key_password: Secret = "";
    /// librdkafka debug contexts for every Kafka client of the hub, comma separated (e.g.
    /// `eos,protocol`: each transaction's requests and their round trips; `cgrp`: group
    /// membership). Their lines are logged at DEBUG under the target `librdkafka`, shown whatever
    /// `STREAMING_HUB_LOG` says. Empty = none. Verbose: for a diagnosis, not for everyday use.
    kafka_debug: Option<String> = "";
    /// Prefix of every topic the hub owns (`<prefix>.inbox`, …); letters, digits, `.`, `_`, `-`.
    topic_prefix: String = "streaming-hub";
    /// The topology file: the hub's topics and their settings.
    topology_file: PathBuf = "topology/topics.toml";
    /// Replication factor of the hub's topics (3 in production; `min.insync.replicas` is capped by
    /// it); 1 to 5.
    replication_factor: i32 = "1";
    /// Consumer group of ingest (input topics); the hub tasks use `<group>.hub`.
    group_id: String = "streaming-hub";
    /// This instance's stable name: transactional ids and static group membership derive from it.
    /// Empty = the host name (`/etc/hostname`, else the kernel's); the hub refuses to start when
    /// neither can be read. Two instances must never share one.
    instance_id: String = "";
    /// Which parts run in this process: `all`, `ingest` or `delivery`.
    role: Role = "all";
    /// Address of the HTTP API, `/metrics` and health endpoints.
    http_listen_addr: SocketAddr = "127.0.0.1:8080";
    /// A separate address for `/metrics` (and `/healthz`, `/readyz`), for an instance whose API
    /// address tenants reach: `/metrics` names tenants (the ones with the oldest due deliveries)
    /// and needs no token, so with this set it is served here only. Empty = on
    /// `STREAMING_HUB_HTTP_LISTEN_ADDR`.
    metrics_listen_addr: Option<SocketAddr> = "";
    /// Most HTTP connections open at once on that address; past it, new ones wait in the
    /// kernel's accept queue until one closes (so clients that open connections and send nothing
    /// cannot take the process's file descriptors, which deliveries and Kafka need too). At most
    /// 1,000,000.
    http_max_connections: usize = "1024";
    /// An HTTP request's headers, and then its body, must each arrive within this; a keep-alive
    /// connection idle this long is closed. `0s` = no limit (not for an address clients reach).
    http_read_timeout: std::time::Duration = "10s";
    /// Directory of the local RocksDB stores (a cache rebuilt from Kafka).
    state_dir: PathBuf = ".streaming-hub-state";
    /// Regex of the producer topics ingest follows. A pattern that matches producers'
    /// dead-letter topics (`lerian.streaming.<source>.dlq`) or one of the hub's own topics stops
    /// the start, naming it (checked on sample names; records of a `.dlq` or `.commands` topic
    /// a pattern still matches are dropped, never ingested).
    follow_pattern: String = r"^lerian\.streaming\.[a-z0-9_-]+$";
    /// How often the follow set is re-evaluated (a new producer topic is followed within this);
    /// 1s to 1h.
    follow_refresh_interval: std::time::Duration = "10s";
    /// `ce-id` must be a UUIDv7; `false` accepts any id of at most 256 bytes without control characters.
    require_uuidv7: bool = "true";
    /// Largest record value accepted; larger ones are quarantined as `payload_too_large`. At most 1572864 (1.5 MiB): the hub's topics take records up to 2 MiB and its copies of an event add headers.
    max_payload_bytes: usize = "1048576";
    /// Quarantine records without a valid producer envelope signature (`ce-sig`), and signed records that carry a `ce-*` attribute the signature does not cover (an extension: it would reach subscribers unsigned).
    require_signatures: bool = "false";
    /// Producer signing keys, `<kid>@<source>:<base64 secret>`, comma separated (secret).
    signature_keys: Secret = "";
    /// With `STREAMING_HUB_REQUIRE_SIGNATURES`: a record whose signature time (`ce-sigts`) is
    /// older than this when ingest reads it, more than 5 minutes ahead, absent or not an RFC 3339
    /// time is quarantined as `signature_expired` (`0s` = not checked). A signed record copied
    /// and produced again after its dedup entry expired (`STREAMING_HUB_IDEMPOTENCY_TTL`) is then
    /// refused. At least 1m and at most that TTL minus 5m (set without
    /// `STREAMING_HUB_REQUIRE_SIGNATURES`, it stops the start), and above the longest backlog
    /// ingest may have to read.
    signature_max_age: std::time::Duration = "0s";
    /// Quarantine a record whose `ce-source` is not the `<source>` of the topic it was read from
    /// (`lerian.streaming.<source>`) as `source_mismatch`: per-topic write ACLs then decide who
    /// may speak for a source, without signatures. Topics not starting with `lerian.streaming.`
    /// are not checked (a WARN names each such followed topic once when it is assigned); on one
    /// that does, the rest of its name must be the `ce-source`.
    require_source_topic: bool = "false";
    /// Most records ingest puts in one transaction.
    ingest_batch_max: usize = "20000";
    /// Most inbox records the hub task puts in one transaction.
    hub_batch_max: usize = "20000";
    /// Most new jobs (matched webhook deliveries, and pull subscriptions' copies, estimated while
    /// the batch fills) one hub transaction creates: each holds its payload, job and changelog
    /// records (a copy: its payload and headers) in memory until the commit (1,000,000 pending jobs: 664 MiB peak with 20000 records per batch, 462 MiB with
    /// this bound at 5000; BENCHMARKS.md).
    hub_batch_jobs: usize = "5000";
    /// Hub loops per instance, each a consumer group member on its own thread with its own
    /// transactional producer, sharing the delivery workers (`0` = one per CPU core, at most 8).
    /// Inbox partitions are spread over every loop of every instance. More loops mean more,
    /// smaller transactions: on a 2-core machine shared with the broker one loop measured best
    /// (BENCHMARKS.md).
    hub_stages: usize = "1";
    /// Longest a batch stays open before it commits. Within it a batch stays open about as long as
    /// the loop's last transactions took (at least `STREAMING_HUB_COMMIT_INTERVAL_MIN`): short
    /// windows while transactions are quick, growing to this as load or a slow broker lengthens
    /// them; a batch also closes after 5 ms without a new record. Against fixed 100 ms windows:
    /// p50 / p99 39-41 / 64-72 ms instead of 82-87 / 150-163 ms at 5,000 events/s, 36 / 52-56
    /// instead of 58-60 / 132-133 ms at 1,000/s, the same deliveries/s at full load, for 30-40%
    /// more hub CPU per delivery at 5,000/s and 55% more at 1,000/s (BENCHMARKS.md, session 30);
    /// the broker spends about 0.2 cores more on the shorter transactions at 1,000 and 5,000/s
    /// (session 31). At least 1ms; at most 10 s and a quarter of `STREAMING_HUB_STALL_TIMEOUT` (a
    /// batch fills without its loop beating).
    commit_interval: std::time::Duration = "100ms";
    /// Shortest a batch stays open (unless a 5 ms quiet gap closes it): the floor of the window
    /// above. Raise it to spend less CPU per delivery at light load for a longer wait; equal to
    /// `STREAMING_HUB_COMMIT_INTERVAL` it gives fixed windows (the behaviour before session 30).
    commit_interval_min: std::time::Duration = "5ms";
    /// How long a `ce-id` is remembered for dedup (at least 1s): a copy ingested within this long
    /// of the first copy's ingest time, or of when the hub first read the id if later, is a
    /// duplicate, however late the hub reads it.
    idempotency_ttl: std::time::Duration = "24h";
    /// Consumer group session timeout (how fast a dead instance's partitions move); 6s to 30m,
    /// Kafka's default bounds.
    session_timeout: std::time::Duration = "10s";
    /// Key-encryption key for signing secrets and credentials: base64 of 32 bytes (secret).
    /// Required to run the subscription API and to deliver webhooks (without it, an instance that
    /// runs delivery holds its due deliveries, no attempt spent); never logged.
    kek: Secret = "";
    /// Id of `STREAMING_HUB_KEK`, stored next to every ciphertext so the key can be rotated.
    kek_id: String = "k1";
    /// Retired key-encryption keys still needed to read old records: `<id>:<base64>`, comma
    /// separated (secret).
    kek_previous: Secret = "";
    /// HS256 secret that signs API tokens (`Authorization: Bearer`), at least 32 bytes (secret).
    jwt_secret: Secret = "";
    /// DANGEROUS: allow webhook URLs that resolve to private, loopback or link-local addresses.
    allow_private_sinks: bool = "false";
    /// DANGEROUS: allow `http://` webhook URLs (otherwise `https://` only).
    allow_insecure_sinks: bool = "false";
    /// Upgrade transition only: also send sensitive headers sealed before they were bound to
    /// their URL (by the subscription id alone), until `streaming-hub subscriptions reseal
    /// --bind-unbound` has bound them. Off, such headers are not sent: any URL may have been written next to them.
    send_unbound_headers: bool = "false";
    /// Default grace period of a rotated-out signing secret (at most 7 days).
    secret_rotation_grace: std::time::Duration = "24h";
    /// Concurrent delivery attempts per instance, granted round-robin across the tenants waiting,
    /// first to those holding less than their share (README, "Fairness").
    /// Also the idle keep-alive connections kept per destination host (at least 32). The design
    /// card (DESIGN.md) says 8: with 8, `throughput` delivered 1,974/s, with 64 4,516-4,618/s (BENCHMARKS.md).
    /// At most 100,000.
    dispatch_workers: usize = "64";
    /// Most attempts claimed ahead of the workers (each holds its payload in memory until it
    /// ends); `0` = 64x `STREAMING_HUB_DISPATCH_WORKERS`, at most 4,096. Never below 4x the
    /// workers. Split between the hub loops, each holding at least 4x the workers. Fewer are claimed when attempts are slow: those the workers run plus what they
    /// start within 5 s (half the time a claim may wait for one), by measured attempt times; a
    /// tenant gets its turns' part of them, and 4x the workers until its first attempt is timed
    /// (README, "Claims and first attempts").
    dispatch_claims_ahead: usize = "0";
    /// Event bytes those claims may hold in memory, per instance (split between its hub loops,
    /// and between the tenants with due deliveries): large events claim fewer attempts ahead. A
    /// claim is made while under it (so one event may pass it) and one attempt always is.
    dispatch_claims_ahead_bytes: usize = "268435456";
    /// Reclaims in a row of a job whose lease expired without an outcome (or whose worker panicked) before it is dead-lettered as poison; an attempt that comes back with an answer starts the count again.
    poison_threshold: u32 = "5";
    /// How long a hub transaction waits for the first attempts of the new events it took in,
    /// started before it commits: an attempt that ends within it is recorded in the same
    /// transaction, and a delivered job then writes no job or payload record at all. The wait
    /// ends sooner once new inbox records have come in (they wait for this transaction to
    /// commit; under a steady stream they do not wait for the attempts). An attempt that ends
    /// after the wait, while the transaction sends its offsets, is recorded in it too. `0` starts
    /// every attempt after its claim has committed. Events the partition's previous owner may
    /// have been attempting uncommitted (read again after a crash or a handover) take the
    /// committed-claim path, their possible attempt counted as one reclaim (README, "Claims and
    /// first attempts"). At most 30s. Measured in BENCHMARKS.md (sessions 33, 34, 61).
    early_attempt_wait: std::time::Duration = "20ms";
    /// Kill switch of auto-disable: `false` never disables a subscription, however long it fails.
    autodisable_enabled: bool = "true";
    /// Auto-disable gate 1: a subscription's failure span (no success since) has been open this long
    /// (at least 1m; turn auto-disable off with `STREAMING_HUB_AUTODISABLE_ENABLED`).
    autodisable_failure_window: std::time::Duration = "120h";
    /// Auto-disable gate 2: its first and last failure are at least this far apart.
    autodisable_failure_spread: std::time::Duration = "12h";
    /// DANGEROUS, tests only: run on a virtual clock that `POST /admin/clock/advance` moves.
    dangerous_test_clock: bool = "false";
    /// DANGEROUS, tests only: the first hub transaction that started first attempts early takes
    /// its group metadata, then holds its offsets until the consumer group has moved to the next
    /// generation (another instance joined), so the broker refuses them as stale, as when a
    /// rebalance completes in the moment between the two.
    dangerous_test_stale_offsets: bool = "false";
    /// DANGEROUS, tests only: once the subscription table has caught up, its control reader
    /// applies each record this long after reading it, as a lagging instance's would (`0s` =
    /// off).
    dangerous_test_control_lag: std::time::Duration = "0s";
    /// Timeout of one outgoing HTTP request (delivery or verification), whole response included
    /// (at least 100ms).
    http_timeout: std::time::Duration = "15s";
    /// Subscription writes through the API (create, PATCH, DELETE, rotate-secret, verify,
    /// recover): requests per second per tenant (per instance) before `429 rate_limited` with
    /// `Retry-After`; `0` turns the limit off. Admin tokens are not held to it.
    api_write_rate: u32 = "5";
    /// Subscription writes a tenant may make in a burst (`0` counts as 1).
    api_write_burst: u32 = "20";
    /// Pull API: requests per second per tenant (per instance); `0` turns the limit off.
    pull_rate: u32 = "10";
    /// Pull API: requests a tenant may make in a burst before `429 Retry-After` (`0` counts as 1).
    pull_burst: u32 = "20";
    /// Most subscriptions a tenant may have: a create through the API past it answers `409
    /// subscription_limit` (every instance holds every subscription in memory). `0` = no
    /// limit. `subscriptions apply` and writers of the control topic are not held to it.
    max_subscriptions_per_tenant: u32 = "1000";
    /// Most pull subscriptions a tenant may have, within the limit above: each keeps its own
    /// copy of every event it matches on `<prefix>.pull`, so a tenant's N pull subscriptions on
    /// `*` write each of its events N times. A create through the API past it answers `409
    /// subscription_limit` naming `destination.type`. `0` = no limit of its own.
    /// `subscriptions apply` and writers of the control topic are not held to it.
    max_pull_subscriptions_per_tenant: u32 = "20";
    /// Consumer group of the forensics index (producers' `.dlq` topics, quarantine, dead
    /// deliveries), suffixed `-<instance>` so every instance indexes everything; empty =
    /// `<STREAMING_HUB_GROUP_ID>.forensics`.
    dlq_group: String = "";
    /// How long the forensics index keeps a record (by record time).
    dlq_retention: std::time::Duration = "168h";
    /// On SIGTERM, how long in-flight deliveries may take to finish before the hub leaves.
    shutdown_timeout: std::time::Duration = "30s";
    /// How long a hub loop giving partitions up in a rebalance waits for their in-flight
    /// deliveries, whose outcomes it then commits before they go (one still running is sent
    /// again by the next owner after its lease). The loop's other partitions wait too; `0s`
    /// commits only the outcomes already in. At most 60s.
    rebalance_wait: std::time::Duration = "5s";
    /// Liveness: the process exits (to be restarted) when its hub or ingest loop has not turned
    /// for this long, e.g. stuck in a Kafka call that never returns, also while it shuts down;
    /// also (exit 1) when one has aborted every batch for this long since one failed in a way no
    /// retry clears (a record too large, an authorization refused, a topic gone), or for ten
    /// times this long for any reason.
    /// The consumers' own poll limit (`max.poll.interval.ms`) is set above it: this exit comes
    /// first. At least 35s plus `STREAMING_HUB_EARLY_ATTEMPT_WAIT` (a Kafka transaction call may
    /// take 30s without the loop turning), at most 24h minus `STREAMING_HUB_SESSION_TIMEOUT`.
    stall_timeout: std::time::Duration = "120s";
    /// Log filter (`tracing` env-filter syntax), e.g. `info` or `streaming_hub=debug`.
    log: String = "info";
    /// Log format: `text` or `json`.
    log_format: LogFormat = "text";
}

/// This host's name: `/etc/hostname`, else the kernel's (`/proc/sys/kernel/hostname`).
fn host_name() -> Option<String> {
    ["/etc/hostname", "/proc/sys/kernel/hostname"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .map(|h| h.trim().to_string())
        .find(|h| !h.is_empty())
}

impl Config {
    /// Reads the process environment (and the file it names).
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_vars(std::env::vars())
    }

    /// Reads the given variables (and the file they name); for tests and embedding.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let env: BTreeMap<String, String> = vars
            .into_iter()
            .filter(|(k, _)| k.starts_with(PREFIX))
            .collect();
        let mut values = BTreeMap::new();
        if let Some(path) = env.get(CONFIG_FILE_VAR) {
            values.extend(read_file(path)?);
        }
        for (k, v) in env {
            if k != CONFIG_FILE_VAR {
                values.insert(k, v);
            }
        }
        for key in values.keys() {
            if !VARIABLES.iter().any(|v| v.name == key) {
                return Err(ConfigError::Unknown { var: key.clone() });
            }
        }
        let config = Config::build(&values)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |var: &str, why: &str| ConfigError::Invalid {
            var: var.to_string(),
            why: why.to_string(),
        };
        if self.kafka_brokers.trim().is_empty() {
            return Err(invalid("STREAMING_HUB_KAFKA_BROKERS", "must not be empty"));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log) {
            let why = format!("not a log filter such as `info` or `warn,streaming_hub=debug`: {e}");
            return Err(invalid("STREAMING_HUB_LOG", &why));
        }
        if self.instance_id.is_empty() && host_name().is_none() {
            // A constant in its place would give every such instance the same transactional
            // ids and static membership: they would fence each other.
            return Err(invalid(
                "STREAMING_HUB_INSTANCE_ID",
                "empty, and this host's name could not be read (/etc/hostname, \
                 /proc/sys/kernel/hostname): set it, different on every instance",
            ));
        }
        if self.topic_prefix.is_empty()
            || !self
                .topic_prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(invalid(
                "STREAMING_HUB_TOPIC_PREFIX",
                "use letters, digits, '.', '_' and '-' only",
            ));
        }
        if self.group_id.is_empty() {
            return Err(invalid("STREAMING_HUB_GROUP_ID", "must not be empty"));
        }
        if !(1..=5).contains(&self.replication_factor) {
            return Err(invalid(
                "STREAMING_HUB_REPLICATION_FACTOR",
                "must be between 1 and 5",
            ));
        }
        if let Err(e) = regex::Regex::new(&self.follow_pattern) {
            return Err(invalid("STREAMING_HUB_FOLLOW_PATTERN", &e.to_string()));
        }
        // librdkafka matches the subscription as a POSIX extended expression (so does the
        // group watch, `runtime::orphans`).
        if crate::runtime::orphans::PosixRegex::new(&self.follow_pattern).is_none() {
            return Err(invalid(
                "STREAMING_HUB_FOLLOW_PATTERN",
                "not a POSIX extended regular expression (librdkafka matches it as one)",
            ));
        }
        if !self.follow_pattern.starts_with('^') {
            return Err(invalid(
                "STREAMING_HUB_FOLLOW_PATTERN",
                "must start with '^' (Kafka treats other names as literal topics)",
            ));
        }
        // Producers' dead letters are the forensics reader's, never ingested (DESIGN.md §2.4):
        // a wider pattern took them in as events. Checked on a sample of such names.
        if let Ok(re) = regex::Regex::new(&self.follow_pattern) {
            let dlq = ["lerian.streaming.ledger.dlq", "lerian.streaming.a.dlq"];
            if let Some(name) = dlq.iter().find(|n| re.is_match(n)) {
                return Err(invalid(
                    "STREAMING_HUB_FOLLOW_PATTERN",
                    &format!(
                        "matches producers' dead-letter topics such as {name}: they are never \
                         ingested (forensics reads them)"
                    ),
                ));
            }
        }
        if self.dispatch_workers == 0 || self.dispatch_workers > MAX_DISPATCH_WORKERS {
            return Err(invalid(
                "STREAMING_HUB_DISPATCH_WORKERS",
                "must be 1 to 100000",
            ));
        }
        if self.dispatch_claims_ahead_bytes == 0 {
            return Err(invalid(
                "STREAMING_HUB_DISPATCH_CLAIMS_AHEAD_BYTES",
                "must be at least 1",
            ));
        }
        if self.poison_threshold == 0 {
            return Err(invalid(
                "STREAMING_HUB_POISON_THRESHOLD",
                "must be at least 1",
            ));
        }
        if self.ingest_batch_max == 0 {
            return Err(invalid(
                "STREAMING_HUB_INGEST_BATCH_MAX",
                "must be at least 1",
            ));
        }
        if self.hub_batch_max == 0 {
            return Err(invalid("STREAMING_HUB_HUB_BATCH_MAX", "must be at least 1"));
        }
        if self.hub_stages > MAX_HUB_STAGES {
            return Err(invalid("STREAMING_HUB_HUB_STAGES", "must be at most 8"));
        }
        if self.http_max_connections == 0 || self.http_max_connections > MAX_HTTP_CONNECTIONS {
            return Err(invalid(
                "STREAMING_HUB_HTTP_MAX_CONNECTIONS",
                "must be 1 to 1000000",
            ));
        }
        if self.hub_batch_jobs == 0 {
            return Err(invalid(
                "STREAMING_HUB_HUB_BATCH_JOBS",
                "must be at least 1",
            ));
        }
        // A transaction may stay open that long on top of its work: well inside the
        // transactions' 60 s timeout.
        if self.early_attempt_wait > std::time::Duration::from_secs(30) {
            return Err(invalid(
                "STREAMING_HUB_EARLY_ATTEMPT_WAIT",
                "must be at most 30s",
            ));
        }
        // Zero closed every batch after its first record: a transaction per record.
        if self.commit_interval < Duration::from_millis(1) {
            return Err(invalid(
                "STREAMING_HUB_COMMIT_INTERVAL",
                "must be at least 1ms (each batch would hold one record)",
            ));
        }
        if self.commit_interval_min > self.commit_interval {
            return Err(invalid(
                "STREAMING_HUB_COMMIT_INTERVAL_MIN",
                "must be at most STREAMING_HUB_COMMIT_INTERVAL",
            ));
        }
        // Durations that make the process useless at zero or near it: every delivery timing
        // out, or the watchdog restarting the process before a loop can turn.
        for (var, value, least) in [
            (
                "STREAMING_HUB_HTTP_TIMEOUT",
                self.http_timeout,
                Duration::from_millis(100),
            ),
            (
                "STREAMING_HUB_STALL_TIMEOUT",
                self.stall_timeout,
                Duration::from_secs(10),
            ),
            // Zero is not "off" here: dedup would forget every id at once.
            (
                "STREAMING_HUB_IDEMPOTENCY_TTL",
                self.idempotency_ttl,
                Duration::from_secs(1),
            ),
            // Kafka's `group.min.session.timeout.ms` (6 s by default): a shorter one is refused
            // at join, and the loops would wait for an assignment forever.
            (
                "STREAMING_HUB_SESSION_TIMEOUT",
                self.session_timeout,
                Duration::from_secs(6),
            ),
            // librdkafka never refreshes the follow set at 0: new producer topics unfollowed.
            (
                "STREAMING_HUB_FOLLOW_REFRESH_INTERVAL",
                self.follow_refresh_interval,
                Duration::from_secs(1),
            ),
            // Zero is not "off" (that is STREAMING_HUB_AUTODISABLE_ENABLED=false): every
            // subscription would be disabled at its first failed delivery.
            (
                "STREAMING_HUB_AUTODISABLE_FAILURE_WINDOW",
                self.autodisable_failure_window,
                Duration::from_secs(60),
            ),
        ] {
            if value < least {
                return Err(invalid(var, &format!("must be at least {least:?}")));
            }
        }
        // One Kafka transaction call (init, offsets, commit) may take up to 30 s and an early
        // attempt's wait holds the transaction as long again, without the loop turning: a
        // shorter limit made the watchdog end a healthy process (exit 70) in a leader failover.
        let least = STALL_MARGIN + self.early_attempt_wait;
        if self.stall_timeout < least {
            return Err(invalid(
                "STREAMING_HUB_STALL_TIMEOUT",
                &format!(
                    "must be at least 35s plus STREAMING_HUB_EARLY_ATTEMPT_WAIT ({least:?}): a \
                     Kafka transaction call may take 30s without the loop turning"
                ),
            ));
        }
        // The consumers' poll limit is the two together (`max.poll.interval.ms`), which
        // librdkafka takes up to 24 h: above, every consumer failed to start with a setting
        // this check had let through.
        if self.stall_timeout + self.session_timeout > Duration::from_secs(24 * 3600) {
            return Err(invalid(
                "STREAMING_HUB_STALL_TIMEOUT",
                "must be at most 24h minus STREAMING_HUB_SESSION_TIMEOUT (with it, the \
                 consumers' max.poll.interval.ms, which Kafka takes up to 24h)",
            ));
        }
        // A batch fills for up to this long without its loop beating: a longer one under a
        // steady stream is a stall to the watchdog (exit 70), and it holds its transaction's
        // records back as long.
        if self.commit_interval > Duration::from_secs(10)
            || self.commit_interval > self.stall_timeout / 4
        {
            return Err(invalid(
                "STREAMING_HUB_COMMIT_INTERVAL",
                "must be at most 10s and at most a quarter of STREAMING_HUB_STALL_TIMEOUT",
            ));
        }
        for (var, value, most) in [
            // Kafka's `group.max.session.timeout.ms` (30 min by default).
            (
                "STREAMING_HUB_SESSION_TIMEOUT",
                self.session_timeout,
                Duration::from_secs(1800),
            ),
            // librdkafka's `topic.metadata.refresh.interval.ms` takes at most an hour.
            (
                "STREAMING_HUB_FOLLOW_REFRESH_INTERVAL",
                self.follow_refresh_interval,
                Duration::from_secs(3600),
            ),
            // The group's rebalance waits for it (and every other partition of the loop).
            (
                "STREAMING_HUB_REBALANCE_WAIT",
                self.rebalance_wait,
                Duration::from_secs(60),
            ),
        ] {
            if value > most {
                return Err(invalid(var, &format!("must be at most {most:?}")));
            }
        }
        if self.max_payload_bytes == 0 || self.max_payload_bytes > MAX_PAYLOAD_BYTES {
            return Err(invalid(
                "STREAMING_HUB_MAX_PAYLOAD_BYTES",
                "must be 1 to 1572864 (the hub's topics take records up to 2 MiB)",
            ));
        }
        if let Some(debug) = &self.kafka_debug {
            if let Some(bad) = debug
                .split(',')
                .map(str::trim)
                .find(|c| !KAFKA_DEBUG_CONTEXTS.contains(c))
            {
                return Err(invalid(
                    "STREAMING_HUB_KAFKA_DEBUG",
                    &format!(
                        "{bad:?} is not a librdkafka debug context (one of {})",
                        KAFKA_DEBUG_CONTEXTS.join(", ")
                    ),
                ));
            }
        }
        match self.kafka_security_protocol.as_str() {
            "plaintext" | "ssl" => {}
            "sasl_plaintext" | "sasl_ssl" => {
                if self.kafka_sasl_mechanism.is_none() {
                    return Err(ConfigError::Missing {
                        var: "STREAMING_HUB_KAFKA_SASL_MECHANISM",
                        why: "a sasl_* security protocol needs a mechanism".into(),
                    });
                }
                if self.kafka_sasl_username.is_none() {
                    return Err(ConfigError::Missing {
                        var: "STREAMING_HUB_KAFKA_SASL_USERNAME",
                        why: "a sasl_* security protocol needs a user name".into(),
                    });
                }
            }
            _ => {
                return Err(invalid(
                    "STREAMING_HUB_KAFKA_SECURITY_PROTOCOL",
                    "expected plaintext, ssl, sasl_plaintext or sasl_ssl",
                ));
            }
        }
        if self.secret_rotation_grace > Duration::from_secs(7 * 86_400) {
            return Err(invalid(
                "STREAMING_HUB_SECRET_ROTATION_GRACE",
                "at most 7 days",
            ));
        }
        if !self.kek.is_empty() {
            use crate::subscriptions::secrets::{Kek, SecretError};
            Kek::from_config(self).map_err(|e| {
                let var = match e {
                    SecretError::BadKekList(_)
                    | SecretError::BadPreviousKek(_)
                    | SecretError::DuplicateKekId(_) => "STREAMING_HUB_KEK_PREVIOUS",
                    _ => "STREAMING_HUB_KEK",
                };
                invalid(var, &e.to_string())
            })?;
        }
        if !self.jwt_secret.is_empty() && self.jwt_secret.expose().len() < 32 {
            return Err(invalid(
                "STREAMING_HUB_JWT_SECRET",
                "must be at least 32 bytes",
            ));
        }
        let keys = self.signature_keys()?;
        if self.require_signatures && keys.is_empty() {
            return Err(ConfigError::Missing {
                var: "STREAMING_HUB_SIGNATURE_KEYS",
                why: "STREAMING_HUB_REQUIRE_SIGNATURES=true needs at least one key".into(),
            });
        }
        if !self.signature_max_age.is_zero() {
            if !self.require_signatures {
                return Err(invalid(
                    "STREAMING_HUB_SIGNATURE_MAX_AGE",
                    "checks signatures' times: it needs STREAMING_HUB_REQUIRE_SIGNATURES=true",
                ));
            }
            if self.signature_max_age < std::time::Duration::from_secs(60) {
                return Err(invalid(
                    "STREAMING_HUB_SIGNATURE_MAX_AGE",
                    "at least 1m (or 0s: not checked)",
                ));
            }
            // A signature may be up to 5 minutes ahead, so an event's dedup entry (from when
            // the hub first saw it) can end 5 minutes before its signature's time + the TTL.
            let skew = std::time::Duration::from_secs(5 * 60);
            if self.signature_max_age + skew > self.idempotency_ttl {
                return Err(invalid(
                    "STREAMING_HUB_SIGNATURE_MAX_AGE",
                    "at most STREAMING_HUB_IDEMPOTENCY_TTL minus 5m (the clock skew a \
                     signature may have): a copy signed longer ago could outlive its dedup entry",
                ));
            }
        }
        Ok(())
    }

    /// The producer signing keys, parsed (errors never echo the secret).
    pub fn signature_keys(&self) -> Result<SignatureKeys, ConfigError> {
        SignatureKeys::parse(self.signature_keys.expose()).map_err(|e| ConfigError::Invalid {
            var: "STREAMING_HUB_SIGNATURE_KEYS".into(),
            why: e.to_string(),
        })
    }

    /// The instance id, defaulting to the host name (a configuration without either was refused).
    pub fn instance(&self) -> String {
        if !self.instance_id.is_empty() {
            return self.instance_id.clone();
        }
        host_name().unwrap_or_else(|| "streaming-hub".to_string())
    }

    /// The forensics index's consumer group (before the instance suffix).
    pub fn dlq_group(&self) -> String {
        if self.dlq_group.is_empty() {
            format!("{}.forensics", self.group_id)
        } else {
            self.dlq_group.clone()
        }
    }

    /// The consumer group of the hub tasks (the one replay resets on `<prefix>.inbox`).
    /// Hub loops this instance runs (`STREAMING_HUB_HUB_STAGES`, `0` resolved to the cores).
    pub fn hub_stage_count(&self) -> usize {
        match self.hub_stages {
            0 => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(MAX_HUB_STAGES),
            n => n,
        }
    }

    pub fn hub_group_id(&self) -> String {
        format!("{}.hub", self.group_id)
    }

    /// The configuration table as Markdown (the README's).
    pub fn markdown_table() -> String {
        let mut out = String::from("| Variable | Default | Meaning |\n|---|---|---|\n");
        for v in VARIABLES {
            let default = if v.default.is_empty() {
                "(empty)".to_string()
            } else {
                format!("`{}`", v.default)
            };
            let doc = v.doc.trim().replace("\n", " ").replace(" |", " \\|");
            out.push_str(&format!("| `{}` | {} | {} |\n", v.name, default, doc));
        }
        out
    }
}

fn read_file(path: &str) -> Result<BTreeMap<String, String>, ConfigError> {
    let err = |why: String| ConfigError::File {
        path: path.to_string(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    // toml's own message quotes the offending line, which may hold a secret (an unquoted or
    // unterminated `kek = ...`): only its position and kind are shown.
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        err(match e.span() {
            Some(span) => {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                format!(
                    "not valid TOML at line {line} (the line is not shown: it may hold a secret)"
                )
            }
            None => "not valid TOML".to_string(),
        })
    })?;
    let mut out = BTreeMap::new();
    for (key, value) in table {
        let var = format!("{PREFIX}{}", key.to_ascii_uppercase());
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(err(format!(
                    "{key}: expected a string, number or boolean, got {} (a list of values goes in one comma-separated string)",
                    other.type_str()
                )));
            }
        };
        out.insert(var, text);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_apply_when_nothing_is_set() {
        let c = Config::from_vars(vars(&[("PATH", "/bin")])).unwrap();
        assert_eq!(c.kafka_brokers, "127.0.0.1:9092");
        assert_eq!(c.topic_prefix, "streaming-hub");
        assert_eq!(c.http_listen_addr.to_string(), "127.0.0.1:8080");
        assert!(c.require_uuidv7);
        assert_eq!(c.max_payload_bytes, 1 << 20);
        assert_eq!(c.hub_group_id(), "streaming-hub.hub");
    }

    /// A count the process multiplies or hands to a semaphore is bounded: past it, the start
    /// is refused naming the setting (a value near `usize::MAX` overflowed the claim bounds, or
    /// panicked the HTTP server).
    #[test]
    fn counts_past_their_bounds_are_refused_naming_the_variable() {
        for (name, most) in [
            ("STREAMING_HUB_DISPATCH_WORKERS", MAX_DISPATCH_WORKERS),
            ("STREAMING_HUB_HTTP_MAX_CONNECTIONS", MAX_HTTP_CONNECTIONS),
        ] {
            assert!(Config::from_vars(vars(&[(name, &most.to_string())])).is_ok());
            for bad in [(most + 1).to_string(), usize::MAX.to_string()] {
                let e = Config::from_vars(vars(&[(name, &bad)])).unwrap_err();
                assert!(e.to_string().starts_with(name), "{e}");
            }
        }
    }

    #[test]
    fn a_log_filter_that_does_not_parse_is_refused_naming_the_variable() {
        let e = Config::from_vars(vars(&[("STREAMING_HUB_LOG", "info,streaming_hub=loud")]))
            .unwrap_err();
        assert!(
            e.to_string().starts_with("STREAMING_HUB_LOG is invalid"),
            "{e}"
        );
        let c = Config::from_vars(vars(&[("STREAMING_HUB_LOG", "warn,streaming_hub=debug")]));
        assert_eq!(c.unwrap().log, "warn,streaming_hub=debug");
    }

    #[test]
    fn malformed_variable_is_named_in_the_error() {
        let e = Config::from_vars(vars(&[("STREAMING_HUB_HTTP_LISTEN_ADDR", "nope")])).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("STREAMING_HUB_HTTP_LISTEN_ADDR is invalid"),
            "{e}"
        );
        let e = Config::from_vars(vars(&[("STREAMING_HUB_REQUIRE_UUIDV7", "maybe")])).unwrap_err();
        assert!(
            e.to_string().contains("STREAMING_HUB_REQUIRE_UUIDV7"),
            "{e}"
        );
        let e = Config::from_vars(vars(&[(
            "STREAMING_HUB_COMMIT_INTERVAL",
            "18446744073709551615s",
        )]))
        .unwrap_err();
        assert!(
            e.to_string().contains("STREAMING_HUB_COMMIT_INTERVAL")
                && e.to_string().contains("at most 100 years"),
            "{e}"
        );
        let e =
            Config::from_vars(vars(&[("STREAMING_HUB_COMMIT_INTERVAL_MIN", "200ms")])).unwrap_err();
        assert!(
            e.to_string().contains("STREAMING_HUB_COMMIT_INTERVAL_MIN")
                && e.to_string()
                    .contains("at most STREAMING_HUB_COMMIT_INTERVAL"),
            "{e}"
        );
        // A window the watchdog would take for a stall.
        for (interval, stall) in [("11s", "120s"), ("10s", "39s")] {
            let e = Config::from_vars(vars(&[
                ("STREAMING_HUB_COMMIT_INTERVAL", interval),
                ("STREAMING_HUB_STALL_TIMEOUT", stall),
            ]))
            .unwrap_err();
            assert!(
                e.to_string().contains("STREAMING_HUB_COMMIT_INTERVAL")
                    && e.to_string().contains("STREAMING_HUB_STALL_TIMEOUT"),
                "{e}"
            );
        }
        Config::from_vars(vars(&[
            ("STREAMING_HUB_COMMIT_INTERVAL", "10s"),
            ("STREAMING_HUB_STALL_TIMEOUT", "40s"),
        ]))
        .unwrap();
        let fixed = Config::from_vars(vars(&[
            ("STREAMING_HUB_COMMIT_INTERVAL", "50ms"),
            ("STREAMING_HUB_COMMIT_INTERVAL_MIN", "50ms"),
        ]))
        .unwrap();
        assert_eq!(fixed.commit_interval_min, Duration::from_millis(50));
        let e = Config::from_vars(vars(&[("STREAMING_HUB_COMMIT_INTERVAL", "soon")])).unwrap_err();
        assert!(
            e.to_string().contains("STREAMING_HUB_COMMIT_INTERVAL"),
            "{e}"
        );
        let e = Config::from_vars(vars(&[("STREAMING_HUB_TOPIC_PREFIX", "a b")])).unwrap_err();
        assert!(e.to_string().contains("STREAMING_HUB_TOPIC_PREFIX"), "{e}");
    }

    #[test]
    fn a_follow_pattern_must_leave_producers_dead_letters_out() {
        let follow = |p: &str| Config::from_vars(vars(&[("STREAMING_HUB_FOLLOW_PATTERN", p)]));
        assert!(follow(r"^lerian\.streaming\.[a-z0-9_-]+$").is_ok());
        assert!(follow(r"^lerian\.streaming\.(ledger|tracer)$").is_ok());
        for wide in [r"^lerian\.streaming\..*", "^.*"] {
            let e = follow(wide).unwrap_err();
            assert!(e.to_string().contains("dead-letter"), "{wide}: {e}");
        }
    }

    #[test]
    fn a_signature_max_age_needs_signatures_and_a_minute() {
        let key = "k1@ledger:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let signed = |age: &str, require: &str| {
            Config::from_vars(vars(&[
                ("STREAMING_HUB_REQUIRE_SIGNATURES", require),
                ("STREAMING_HUB_SIGNATURE_KEYS", key),
                ("STREAMING_HUB_SIGNATURE_MAX_AGE", age),
            ]))
        };
        let c = signed("23h", "true").unwrap();
        assert_eq!(
            c.signature_max_age,
            std::time::Duration::from_secs(23 * 3600)
        );
        assert!(signed("0s", "false").is_ok(), "off");
        for (age, require) in [
            ("23h", "false"),
            ("30s", "true"),
            ("24h", "true"),
            ("1436m", "true"),
        ] {
            let e = signed(age, require).unwrap_err();
            assert!(
                e.to_string().contains("STREAMING_HUB_SIGNATURE_MAX_AGE"),
                "{e}"
            );
        }
    }

    #[test]
    fn missing_variable_is_named_in_the_error() {
        let e =
            Config::from_vars(vars(&[("STREAMING_HUB_REQUIRE_SIGNATURES", "true")])).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Missing {
                var: "STREAMING_HUB_SIGNATURE_KEYS",
                why: "STREAMING_HUB_REQUIRE_SIGNATURES=true needs at least one key".into()
            }
        );
        let e = Config::from_vars(vars(&[
            ("STREAMING_HUB_KAFKA_SECURITY_PROTOCOL", "sasl_ssl"),
            ("STREAMING_HUB_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512"),
        ]))
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("STREAMING_HUB_KAFKA_SASL_USERNAME is required"),
            "{e}"
        );
    }

    #[test]
    fn durations_too_short_to_work_are_refused_naming_the_variable() {
        for (var, value) in [
            ("STREAMING_HUB_HTTP_TIMEOUT", "0s"),
            ("STREAMING_HUB_HTTP_TIMEOUT", "50ms"),
            ("STREAMING_HUB_STALL_TIMEOUT", "0s"),
            ("STREAMING_HUB_STALL_TIMEOUT", "5s"),
            ("STREAMING_HUB_IDEMPOTENCY_TTL", "0s"),
            ("STREAMING_HUB_SESSION_TIMEOUT", "1s"),
            ("STREAMING_HUB_FOLLOW_REFRESH_INTERVAL", "0s"),
            ("STREAMING_HUB_AUTODISABLE_FAILURE_WINDOW", "0s"),
            ("STREAMING_HUB_COMMIT_INTERVAL", "0s"),
        ] {
            let e = Config::from_vars(vars(&[(var, value)])).unwrap_err();
            assert!(
                e.to_string().starts_with(var) && e.to_string().contains("at least"),
                "{var}={value}: {e}"
            );
        }
        for (var, value) in [
            ("STREAMING_HUB_SESSION_TIMEOUT", "31m"),
            ("STREAMING_HUB_FOLLOW_REFRESH_INTERVAL", "2h"),
            ("STREAMING_HUB_REBALANCE_WAIT", "61s"),
            // With the session timeout, librdkafka's max.poll.interval.ms: at most 24h.
            ("STREAMING_HUB_STALL_TIMEOUT", "24h"),
        ] {
            let e = Config::from_vars(vars(&[(var, value)])).unwrap_err();
            assert!(
                e.to_string().starts_with(var) && e.to_string().contains("at most"),
                "{var}={value}: {e}"
            );
        }
        // Shorter than a Kafka transaction call may take with an early attempt's wait on top.
        for (stall, early) in [("34s", "0s"), ("36s", "2s")] {
            let e = Config::from_vars(vars(&[
                ("STREAMING_HUB_STALL_TIMEOUT", stall),
                ("STREAMING_HUB_EARLY_ATTEMPT_WAIT", early),
            ]))
            .unwrap_err();
            assert!(
                e.to_string().starts_with("STREAMING_HUB_STALL_TIMEOUT")
                    && e.to_string().contains("STREAMING_HUB_EARLY_ATTEMPT_WAIT"),
                "{stall} {early}: {e}"
            );
        }
        let c = Config::from_vars(vars(&[
            ("STREAMING_HUB_HTTP_TIMEOUT", "100ms"),
            ("STREAMING_HUB_STALL_TIMEOUT", "36s"),
            ("STREAMING_HUB_IDEMPOTENCY_TTL", "1s"),
            ("STREAMING_HUB_SESSION_TIMEOUT", "6s"),
            ("STREAMING_HUB_FOLLOW_REFRESH_INTERVAL", "1s"),
            ("STREAMING_HUB_AUTODISABLE_FAILURE_WINDOW", "1m"),
            ("STREAMING_HUB_AUTODISABLE_FAILURE_SPREAD", "0s"),
        ]))
        .unwrap();
        assert_eq!(c.stall_timeout, Duration::from_secs(36));
        assert_eq!(c.session_timeout, Duration::from_secs(6));
    }

    #[test]
    fn kafka_debug_takes_librdkafka_contexts_only() {
        let c = Config::from_vars(vars(&[("STREAMING_HUB_KAFKA_DEBUG", "eos, protocol")])).unwrap();
        assert_eq!(c.kafka_debug.as_deref(), Some("eos, protocol"));
        assert!(Config::from_vars(vars(&[])).unwrap().kafka_debug.is_none());
        let e = Config::from_vars(vars(&[("STREAMING_HUB_KAFKA_DEBUG", "eos,txn")])).unwrap_err();
        assert!(
            e.to_string().starts_with("STREAMING_HUB_KAFKA_DEBUG")
                && e.to_string()
                    .contains("\"txn\" is not a librdkafka debug context"),
            "{e}"
        );
    }

    #[test]
    fn unknown_variable_is_rejected_not_ignored() {
        let e = Config::from_vars(vars(&[("STREAMING_HUB_KAFKA_BROKER", "x:1")])).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Unknown {
                var: "STREAMING_HUB_KAFKA_BROKER".into()
            }
        );
    }

    #[test]
    fn secret_keys_error_does_not_echo_the_secret() {
        let e = Config::from_vars(vars(&[(
            "STREAMING_HUB_SIGNATURE_KEYS",
            "k1@ledger:c2hvcnQ=",
        )]))
        .unwrap_err();
        assert!(
            e.to_string().contains("STREAMING_HUB_SIGNATURE_KEYS"),
            "{e}"
        );
        assert!(!e.to_string().contains("c2hvcnQ"), "{e}");
        let c =
            Config::from_vars(vars(&[("STREAMING_HUB_KAFKA_SASL_PASSWORD", "pa55word")])).unwrap();
        assert!(!format!("{c:?}").contains("pa55word"));
    }

    #[test]
    fn config_file_errors_never_quote_a_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.toml");
        let secret = "c2VjcmV0c2VjcmV0c2VjcmV0";
        for (text, names) in [
            // unquoted: not valid TOML, and toml's message quotes the line
            (format!("group_id = \"g\"\nkek = {secret}\n"), "line 2"),
            // unterminated string
            (format!("jwt_secret = \"{secret}\n"), "line 1"),
            // a list where one comma-separated string is expected
            (
                format!("signature_keys = [\"k1@ledger:{secret}\"]\n"),
                "signature_keys: expected a string, number or boolean, got array",
            ),
        ] {
            std::fs::write(&path, &text).unwrap();
            let e = Config::from_vars(vars(&[(CONFIG_FILE_VAR, path.to_str().unwrap())]))
                .unwrap_err()
                .to_string();
            assert!(!e.contains(secret), "{e}");
            assert!(e.contains(names), "{e}");
        }
    }

    #[test]
    fn file_values_apply_and_environment_overrides_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.toml");
        std::fs::write(
            &path,
            "topic_prefix = \"from-file\"\ningest_batch_max = 10\ngroup_id = \"g\"\n",
        )
        .unwrap();
        let c = Config::from_vars(vars(&[
            (CONFIG_FILE_VAR, path.to_str().unwrap()),
            ("STREAMING_HUB_GROUP_ID", "from-env"),
        ]))
        .unwrap();
        assert_eq!(c.topic_prefix, "from-file");
        assert_eq!(c.ingest_batch_max, 10);
        assert_eq!(c.group_id, "from-env");
        std::fs::write(&path, "topic_prefixx = \"typo\"\n").unwrap();
        let e = Config::from_vars(vars(&[(CONFIG_FILE_VAR, path.to_str().unwrap())])).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Unknown {
                var: "STREAMING_HUB_TOPIC_PREFIXX".into()
            }
        );
    }

    #[test]
    fn every_variable_is_documented_once() {
        let mut names: Vec<_> = VARIABLES.iter().map(|v| v.name).collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "a variable is listed twice");
        for v in VARIABLES {
            assert!(v.name.starts_with(PREFIX));
            assert!(!v.doc.trim().is_empty(), "{} has no doc", v.name);
        }
        let table = Config::markdown_table();
        assert_eq!(table.lines().count(), n + 2);
    }
}
