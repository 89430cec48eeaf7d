//! Kafka clients, configured once from [`Config`]: connection and security settings shared by every
//! client, then the shapes the stages need — a `read_committed` consumer that never auto-commits,
//! an idempotent transactional producer, an admin client.
//!
//! rdkafka's transactional calls block; callers run them on a dedicated thread (ingest) or through
//! `spawn_blocking`, never on an async worker.
use std::time::{Duration, Instant};

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, RebalanceProtocol};
use rdkafka::producer::Producer;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::config::Config;

/// Errors from Kafka, split by what the caller should do.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    /// The client could not be created (bad settings): stop.
    #[error("kafka client setup failed: {0}")]
    Setup(String),
    /// A call failed; retrying later may help.
    #[error("kafka call failed: {0}")]
    Call(#[from] rdkafka::error::KafkaError),
    /// The caller gave the work up (a restore of partitions given up meanwhile).
    #[error("cancelled")]
    Cancelled,
    /// A store's changelog offset is at or past its changelog partition's end: the log it was
    /// built from lost its tail or is not this one (the topic deleted and made again). `spec` is
    /// the index of the restore spec.
    #[error("a store holds changelog offset {stored} of {topic}[{partition}], whose end is {end}")]
    AheadOfChangelog {
        spec: usize,
        topic: String,
        partition: i32,
        stored: i64,
        end: i64,
    },
}

/// The settings every client of this hub shares: brokers, TLS, SASL.
pub fn base(config: &Config) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.kafka_brokers)
        .set("security.protocol", &config.kafka_security_protocol)
        .set("client.id", format!("streaming-hub-{}", config.instance()))
        .set("socket.keepalive.enable", "true")
        // Transactions are chains of small requests (AddPartitions, AddOffsets, TxnOffsetCommit,
        // EndTxn) each waiting for the one before: with Nagle's algorithm on, each can sit out a
        // delayed ACK.
        .set("socket.nagle.disable", "true")
        // A producer's default (true) has a broker with `auto.create.topics.enable` create a
        // hub topic deleted under it, with the broker's defaults: a changelog or the control
        // topic under `delete` (retention then takes state), one partition for the inbox.
        // Topics are made by `topology apply` only.
        .set("allow.auto.create.topics", "false");
    if let Some(mechanism) = &config.kafka_sasl_mechanism {
        c.set("sasl.mechanism", mechanism);
    }
    if let Some(user) = &config.kafka_sasl_username {
        c.set("sasl.username", user);
        c.set("sasl.password", config.kafka_sasl_password.expose());
    }
    if let Some(ca) = &config.kafka_ssl_ca_location {
        c.set("ssl.ca.location", ca);
    }
    if let Some(cert) = &config.kafka_ssl_certificate_location {
        c.set("ssl.certificate.location", cert);
    }
    if let Some(key) = &config.kafka_ssl_key_location {
        c.set("ssl.key.location", key);
    }
    if !config.kafka_ssl_key_password.is_empty() {
        c.set("ssl.key.password", config.kafka_ssl_key_password.expose());
    }
    match &config.kafka_debug {
        // librdkafka logs through the `log` facade (target `librdkafka`), which `init_tracing`
        // lets through at DEBUG when this is set.
        Some(contexts) => {
            c.set("debug", contexts.replace(' ', ""));
            c.set_log_level(rdkafka::config::RDKafkaLogLevel::Debug);
        }
        // Its own level is enough otherwise.
        None => {
            c.set_log_level(rdkafka::config::RDKafkaLogLevel::Warning);
        }
    }
    c
}

/// How long the broker holds a fetch of ingest's and the hub's consumers that finds nothing to
/// read. A held fetch is answered as soon as records become readable (a transaction's markers
/// included), so this costs no latency under load (`load latency=1000` and `5000`: within the
/// spread); what it sets is how often an idle consumer asks again. At 20 ms the two consumers'
/// fetches were two thirds of what an idle instance cost the broker (BENCHMARKS.md, session 63);
/// the price is that a fetch of a new position waits for the one held meanwhile: a partition
/// newly assigned, the hub's resume after a restore, ingest's rewind after an abort may each wait
/// up to this long for their first records (`load recovery`: resumed 1.4-1.8 s after the kill
/// against 1.8-2.5 s at 20 ms).
pub const FETCH_WAIT: Duration = Duration::from_millis(100);

/// A consumer of a consume-process-produce loop: manual offsets (they go into the transaction),
/// `read_committed` (inputs may be other transactions' outputs), static membership.
pub fn transactional_consumer(config: &Config, group: &str, member: &str) -> ClientConfig {
    let mut c = base(config);
    c.set("group.id", group)
        .set("group.instance.id", member)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "false")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", millis(config.session_timeout))
        // A loop stuck in a call is ended by the stall watchdog (the process restarts and its
        // static member rejoins) before librdkafka would leave the group on its behalf: a
        // member that left on a poll gap and rejoined from the same consumer was seen to leave
        // input partitions assigned to nobody for good (fault suite). A poll gap that long
        // anyway ends the stage.
        .set(
            "max.poll.interval.ms",
            millis((config.stall_timeout + config.session_timeout).max(Duration::from_secs(300))),
        )
        .set("heartbeat.interval.ms", millis(config.session_timeout / 4))
        .set(
            "topic.metadata.refresh.interval.ms",
            millis(config.follow_refresh_interval),
        )
        .set("fetch.wait.max.ms", millis(FETCH_WAIT))
        .set("queued.max.messages.kbytes", "16384")
        // Small fetches per partition: a read_committed consumer of a backlog got one partition's
        // records for seconds at a time (1 MiB per fetch, the default, up to the 16 MiB queue),
        // so ingest wrote, and the hub took in, one partition after another, and the tenants of
        // the others waited: in a `throughput` run a whole partition's tenants got nothing for
        // 6-7 s. At 64 KiB that gap was about 1 s and the prefetch holds less (BENCHMARKS.md,
        // session 17). A record larger than this still comes whole.
        .set("max.partition.fetch.bytes", "65536")
        // Consumer lag per partition reaches /metrics through the context's statistics callback.
        .set("statistics.interval.ms", "10000");
    c
}

/// An idempotent, transactional producer. The transactional id must be stable for one logical
/// writer (an instance, a task), so that a restarted writer fences its zombie.
pub fn transactional_producer(config: &Config, transactional_id: &str) -> ClientConfig {
    let mut c = base(config);
    c.set("transactional.id", transactional_id)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("transaction.timeout.ms", "60000")
        // A transaction begun right after a commit meets the previous one's markers still being
        // written: the coordinator answers CONCURRENT_TRANSACTIONS and the client retries after
        // this backoff (100 ms by default, which was the floor of every commit). Backoffs grow
        // exponentially up to `retry.backoff.max.ms` for real failures.
        .set("retry.backoff.ms", "5")
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        // murmur2 is what Java clients use: any producer keying the inbox by tenant agrees with us.
        .set("partitioner", "murmur2_random");
    c
}

/// Whether a record a producer reports delivered has its place on the partition (an offset).
///
/// librdkafka also reports delivered, without an offset, a record it counts "implicitly acked":
/// one whose batch was still unanswered, or failed, when a later batch of the same partition
/// succeeded. It takes the later success as proof that the earlier batch was written. It is
/// not always: a producer's first batches to a partition, both refused at first with "not
/// leader for partition" (a topic seconds old, a leader moving), were retried; the later batch
/// was taken and the first refused again, and the broker accepts a producer it does not know
/// yet at any sequence number. The first batch's records were then reported delivered and
/// never written, and the transaction committed without them (seen on fresh topics: 3 events
/// of 100,000 missing from the inbox). Such a record is treated as not written: the transaction
/// is aborted and its batch done again.
pub fn placed(offset: i64) -> bool {
    offset >= 0
}

/// The error a write ends with when a record of it was reported delivered without a place (see
/// [`placed`]): a retriable one ([`never_clears`] says no). A transaction is aborted and its
/// batch done again, which writes it; a redelivery run fails, to be run again.
pub fn unplaced(records: u64) -> rdkafka::error::KafkaError {
    tracing::warn!(
        records,
        "records reported delivered without an offset (acknowledged only by a later batch of \
         their partition): they may not be written, so their write is taken as failed (a \
         transaction is aborted and done again)"
    );
    rdkafka::error::KafkaError::MessageProduction(RDKafkaErrorCode::Inconsistent)
}

/// A producer's context that counts records reported delivered without a place (see
/// [`placed`]); other failures fail the transaction's commit by themselves.
#[derive(Default)]
pub struct PlacedOnly {
    unplaced: std::sync::atomic::AtomicU64,
}

impl rdkafka::ClientContext for PlacedOnly {}

impl rdkafka::producer::ProducerContext for PlacedOnly {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &rdkafka::producer::DeliveryResult<'_>, _: ()) {
        if let Ok(m) = result {
            self.check(rdkafka::Message::offset(m));
        }
    }
}

impl PlacedOnly {
    /// Whether a record reported delivered at `offset` has its place; counts it if not.
    pub fn check(&self, offset: i64) -> bool {
        let ok = placed(offset);
        if !ok {
            self.unplaced
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ok
    }

    /// How many records were reported delivered without a place since the last call.
    pub fn take(&self) -> u64 {
        self.unplaced.swap(0, std::sync::atomic::Ordering::Relaxed)
    }
}

/// Aborts the open transaction. While a partition leader fails over, records still in flight may
/// outlast one abort's timeout; librdkafka then says the abort may be retried, so it is, serving
/// delivery reports in between, for up to `patience`. Any other error is returned.
pub fn abort_waiting<C, P>(
    producer: &P,
    timeout: Duration,
    patience: Duration,
) -> Result<(), rdkafka::error::KafkaError>
where
    C: rdkafka::producer::ProducerContext,
    P: Producer<C>,
{
    let deadline = std::time::Instant::now() + patience;
    // The abort purges what is still queued, and waits for the delivery reports of it to be
    // served: with nobody polling meanwhile, one long abort call only runs into its timeout
    // (seen: 30 s of a hub stalled on a dead leader). Short tries with reports served between.
    let try_for = timeout.min(Duration::from_secs(2));
    let _ = producer.flush(Duration::from_millis(100));
    retry_while(
        || producer.abort_transaction(try_for),
        |e| matches!(e, rdkafka::error::KafkaError::Transaction(e) if e.is_retriable()),
        between_tries(producer, "abort"),
        deadline,
    )
}

/// Commits the open transaction. A commit that runs out of `timeout` goes on in the background
/// (librdkafka says it may be retried then, and an abort called meanwhile is refused as a
/// conflicting call, which ended the process); so a retriable failure is retried, with delivery
/// reports served in between, until `patience` from the first call. An error that requires an
/// abort or a fatal one is returned, and the caller aborts; one still retriable at the end
/// ([`commit_undecided`]) leaves the commit running, which no abort may interrupt: the loop
/// stops and the process restarts (its successor's `init_transactions` settles it).
pub fn commit_waiting<C, P>(
    producer: &P,
    timeout: Duration,
    patience: Duration,
) -> Result<(), rdkafka::error::KafkaError>
where
    C: rdkafka::producer::ProducerContext,
    P: Producer<C>,
{
    let call = |p: &P, try_for| p.commit_transaction(try_for);
    let tries = (timeout, Duration::from_secs(2), patience);
    resume_while(producer, "commit", call, commit_undecided, tries)
}

/// How long [`init_waiting`] calls `init_transactions` again while it may be.
pub const INIT_PATIENCE: Duration = Duration::from_secs(120);

/// Initialises a transactional producer. While the transaction coordinator moves or is still
/// loading, or this id's previous transaction is still finishing, librdkafka says the call may
/// be made again (it resumes): so it is, serving delivery reports in between, until `patience`
/// from the first call, or until `stop` is set (a shutdown does not wait out the patience: the
/// last error is returned then). Any other error is returned. Before, a start in such a moment
/// ended the process, and every instance started then went round in a crash loop for as long as
/// it lasted.
pub fn init_waiting<C, P>(
    producer: &P,
    timeout: Duration,
    patience: Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<(), rdkafka::error::KafkaError>
where
    C: rdkafka::producer::ProducerContext,
    P: Producer<C>,
{
    let call = |p: &P, try_for| p.init_transactions(try_for);
    let tries = (timeout, Duration::from_secs(5), patience);
    let retriable = |e: &rdkafka::error::KafkaError| {
        init_retriable(e) && !stop.load(std::sync::atomic::Ordering::Relaxed)
    };
    resume_while(producer, "init", call, retriable, tries)
}

/// Makes a resumable transaction call, and again while `retriable` says it may be, until
/// `patience` from the first: the first try may take `timeout`, the later ones at most `later`,
/// with delivery reports served in between ([`between_tries`]). `tries` = (timeout, later,
/// patience).
fn resume_while<C, P>(
    producer: &P,
    what: &'static str,
    call: impl Fn(&P, Duration) -> Result<(), rdkafka::error::KafkaError>,
    retriable: impl Fn(&rdkafka::error::KafkaError) -> bool,
    (timeout, later, patience): (Duration, Duration, Duration),
) -> Result<(), rdkafka::error::KafkaError>
where
    C: rdkafka::producer::ProducerContext,
    P: Producer<C>,
{
    let deadline = std::time::Instant::now() + patience;
    let mut first = true;
    retry_while(
        || {
            let try_for = if std::mem::take(&mut first) {
                timeout
            } else {
                timeout.min(later)
            };
            call(producer, try_for)
        },
        retriable,
        between_tries(producer, what),
        deadline,
    )
}

/// An `init_transactions` error librdkafka says the call may be made again after.
fn init_retriable(e: &rdkafka::error::KafkaError) -> bool {
    matches!(e, rdkafka::error::KafkaError::Transaction(e) if e.is_retriable() && !e.is_fatal())
}

/// Whether [`commit_waiting`] gave up on a commit still running (librdkafka goes on with it in
/// the background and refuses an abort meanwhile as a conflicting call). Only for the error of a
/// commit: other calls' retriable errors (`send_offsets_to_transaction` is not resumable) leave
/// the abort open.
pub fn commit_undecided(e: &rdkafka::error::KafkaError) -> bool {
    matches!(e, rdkafka::error::KafkaError::Transaction(e)
        if e.is_retriable() && !e.txn_requires_abort() && !e.is_fatal())
}

/// What [`abort_waiting`], [`commit_waiting`] and [`init_waiting`] do before they call again: say so, beat the
/// liveness watchdog (bounded by their patience) and serve delivery reports.
fn between_tries<'p, C, P>(
    producer: &'p P,
    call: &'static str,
) -> impl FnMut(&rdkafka::error::KafkaError) + 'p
where
    C: rdkafka::producer::ProducerContext,
    P: Producer<C>,
{
    move |e| {
        tracing::warn!(error = %e, "transaction {call} not finished yet; retrying");
        crate::runtime::liveness::beat_current();
        let _ = producer.flush(Duration::from_millis(200));
    }
}

/// Runs `op` until it succeeds, fails with an error `retriable` refuses, or `deadline` passes
/// (the last error is returned then); `between` runs before each retry.
fn retry_while<E>(
    mut op: impl FnMut() -> Result<(), E>,
    retriable: impl Fn(&E) -> bool,
    mut between: impl FnMut(&E),
    deadline: std::time::Instant,
) -> Result<(), E> {
    loop {
        match op() {
            Ok(()) => return Ok(()),
            Err(e) if retriable(&e) && std::time::Instant::now() < deadline => between(&e),
            Err(e) => return Err(e),
        }
    }
}

/// Waits until every record sent so far is acknowledged and its delivery report served.
/// rdkafka's `flush` (also called by `commit_transaction`) polls in 100 ms slices that always run
/// to their end, so every transaction with a record in flight cost at least 100 ms: measured as
/// the floor of each ingest commit and of the end-to-end latency. Here `poll(ZERO)` serves what
/// is queued, and the thread sleeps 0.5 ms when nothing moved (a short blocking poll would spin:
/// rdkafka's poll loops until its deadline).
pub fn wait_delivered(
    in_flight: impl Fn() -> i32,
    poll: impl Fn(Duration),
    timeout: Duration,
) -> Result<(), rdkafka::error::KafkaError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let before = in_flight();
        if before == 0 {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(rdkafka::error::KafkaError::Flush(
                RDKafkaErrorCode::OperationTimedOut,
            ));
        }
        poll(Duration::ZERO);
        if in_flight() == before {
            std::thread::sleep(Duration::from_micros(500));
        }
        // Bounded by `timeout`: beating hides no hang, and the calls before and after it
        // (offsets, commit) may take 30 s each.
        crate::runtime::liveness::beat_current();
    }
}

/// Sends what lingers in a transactional producer's queues now, once a transaction's records
/// are all produced: librdkafka treats `linger.ms` as elapsed while a flush call lasts, and this
/// one lasts at most 1 ms (the broker threads it wakes must see it; one that returned at once
/// would end before they look). The records then travel while the offsets are sent, instead of
/// lingering up to 5 ms more (at 5,000 events/s with 10 ms windows the wait for their
/// acknowledgements went from 7-8.5 to 2-3.5 ms per transaction; BENCHMARKS.md, session 30).
/// Once per transaction: session 15's pushes between every poll cost more than they won.
pub fn push<C: rdkafka::client::ClientContext>(client: &rdkafka::client::Client<C>) {
    // SAFETY: the pointer is the live client's own handle, borrowed for the call; rd_kafka_flush
    // is thread-safe and here only waits (delivery reports are served by `poll`).
    unsafe {
        rdkafka::bindings::rd_kafka_flush(client.native_ptr(), 1);
    }
}

/// The batches a loop aborted in a row. A failure that comes back every run (a record the broker
/// refuses, a write ACL missing, a topic gone) had the loop abort and run the same batch again
/// every 200 ms for good, with only its lag to show it. The pause between runs now grows (up to
/// [`MAX_ABORT_PAUSE`]), and a loop that has committed nothing while its batches failed for
/// `limit` (`STREAMING_HUB_STALL_TIMEOUT`) since the first that failed in a way no retry clears
/// ([`never_clears`]), or for [`ANY_ABORTS_LIMIT_FACTOR`] times that for any reason, ends, so
/// the process exits to be restarted, or looked at. Other failures (too few in-sync replicas,
/// a partition without a leader, a coordinator moving) clear when the cluster recovers: the
/// loop keeps trying that much longer, as every instance restarting at once would only add a
/// rejoin and a restore to the cluster's trouble; past it, a restart is the last thing left to
/// try (a client stuck in an error state).
#[derive(Debug, Clone, Copy)]
pub struct AbortStreak {
    /// The first aborted batch of the streak.
    first: Option<Instant>,
    /// The first that failed for a lasting reason.
    since: Option<Instant>,
    runs: u32,
    limit: Duration,
}

/// How many times `STREAMING_HUB_STALL_TIMEOUT` a loop may abort every batch for reasons that
/// may clear before it ends.
pub const ANY_ABORTS_LIMIT_FACTOR: u32 = 10;

/// The pause after a loop's first aborted batch, doubled by each one after it.
pub const ABORT_PAUSE: Duration = Duration::from_millis(200);
/// The longest pause between runs of an aborted batch.
pub const MAX_ABORT_PAUSE: Duration = Duration::from_secs(5);

impl AbortStreak {
    pub fn new(limit: Duration) -> Self {
        AbortStreak {
            first: None,
            since: None,
            runs: 0,
            limit,
        }
    }

    /// A batch committed (or there was none to commit): the streak is over.
    pub fn committed(&mut self) {
        self.first = None;
        self.since = None;
        self.runs = 0;
    }

    /// One more aborted batch, at `now`, for a reason that does (`lasting`) or may not clear by
    /// itself: the pause before it runs again, or `None` when the loop should end (see the
    /// type's doc).
    pub fn aborted(&mut self, now: Instant, lasting: bool) -> Option<Duration> {
        self.runs = self.runs.saturating_add(1);
        let first = *self.first.get_or_insert(now);
        if lasting {
            self.since.get_or_insert(now);
        }
        let lasting_for = self.since.map(|s| now.saturating_duration_since(s));
        if lasting_for.is_some_and(|d| d >= self.limit)
            || now.saturating_duration_since(first) >= self.limit * ANY_ABORTS_LIMIT_FACTOR
        {
            return None;
        }
        Some(
            ABORT_PAUSE
                .saturating_mul(1 << (self.runs - 1).min(16))
                .min(MAX_ABORT_PAUSE),
        )
    }

    /// One more aborted batch, now: sleeps the pause before it runs again, or answers what the
    /// loop ends with (see [`AbortStreak::aborted`]).
    pub fn pause_after_abort(&mut self, lasting: bool) -> Result<(), String> {
        let now = Instant::now();
        match self.aborted(now, lasting) {
            Some(pause) => {
                // A pause chosen, not a loop stuck: the stall watchdog hears from it.
                let until = now + pause;
                while Instant::now() < until {
                    crate::runtime::liveness::beat_current();
                    std::thread::sleep(
                        until
                            .saturating_duration_since(Instant::now())
                            .min(Duration::from_millis(100)),
                    );
                }
                Ok(())
            }
            None => Err(self.describe(now)),
        }
    }

    /// Batches aborted in this streak, and for how long.
    pub fn describe(&self, now: Instant) -> String {
        let secs = |t: Option<Instant>| t.map_or(0, |t| now.saturating_duration_since(t).as_secs());
        format!(
            "{} batches aborted in a row over {} s, for a reason that does not clear by itself \
             over the last {} s",
            self.runs,
            secs(self.first),
            secs(self.since)
        )
    }
}

/// A failure that no retry clears, only an operator: a record larger than the topic takes,
/// a permission missing, a topic gone or refused by a policy.
pub fn never_clears(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::PolicyViolation
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::GroupAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
                | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                | RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::UnknownTopic
                | RDKafkaErrorCode::UnknownPartition
        )
    )
}

/// How long a transaction's batch stays open: as long as the last transactions took (an average
/// of the last and the one before, roughly), at least `STREAMING_HUB_COMMIT_INTERVAL_MIN` and at
/// most `STREAMING_HUB_COMMIT_INTERVAL`. A loop that polls, then commits, in turn spends about as long
/// gathering as committing: at light load transactions are short and so are the windows (an
/// event waits little), and as the load or the broker slows the transactions, the windows grow
/// with them up to the interval, so the transactions per second fall instead of piling up.
#[derive(Debug, Clone, Copy)]
pub struct BatchWindow {
    recent: Duration,
}

impl BatchWindow {
    /// Starts with nothing measured: the first batch's window is the floor.
    pub fn new() -> BatchWindow {
        BatchWindow {
            recent: Duration::ZERO,
        }
    }

    /// The window for the next batch: at least `shortest`, at most `longest` (`longest` wins).
    pub fn window(&self, shortest: Duration, longest: Duration) -> Duration {
        self.recent.max(shortest).min(longest)
    }

    /// A transaction took `took`, from its start to its commit. One longer than `longest` (a
    /// broker that stalled) counts as `longest`, so the windows come back down within a few
    /// transactions once it recovers.
    pub fn took(&mut self, took: Duration, longest: Duration) {
        self.recent = (self.recent + took.min(longest)) / 2;
    }
}

impl Default for BatchWindow {
    fn default() -> Self {
        BatchWindow::new()
    }
}

/// Sends one record, waiting (and serving delivery reports) while the producer's queue is full.
pub fn send_waiting<C, K, P>(
    producer: &rdkafka::producer::BaseProducer<C>,
    mut record: rdkafka::producer::BaseRecord<'_, K, P, C::DeliveryOpaque>,
) -> Result<(), rdkafka::error::KafkaError>
where
    C: rdkafka::producer::ProducerContext,
    K: rdkafka::message::ToBytes + ?Sized,
    P: rdkafka::message::ToBytes + ?Sized,
{
    use rdkafka::error::KafkaError as RdKafkaError;
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((
                RdKafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull),
                r,
            )) => {
                record = r;
                producer.poll(std::time::Duration::from_millis(5));
            }
            Err((e, _)) => return Err(e),
        }
    }
}

/// The context of a reader whose normal course makes librdkafka report "errors": the end of a
/// partition (`enable.partition.eof`: the control-topic reader's caught-up signal, the pull and
/// redelivery readers' "nothing more") and a pattern subscription that matches no topic yet (the
/// forensics reader's producers' DLQs, ingest's follow pattern). rdkafka's default context logs
/// each at ERROR; this one logs those two at DEBUG and everything else at ERROR, as before.
pub struct ReaderContext;

impl ReaderContext {
    /// Whether librdkafka's error is part of a reader's normal course (see the type's doc).
    pub fn is_expected(error: &rdkafka::error::KafkaError, reason: &str) -> bool {
        match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::PartitionEOF) => true,
            Some(RDKafkaErrorCode::UnknownTopicOrPartition) => {
                reason.starts_with("Subscribed topic not available: ^")
            }
            _ => false,
        }
    }
}

impl rdkafka::ClientContext for ReaderContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        log_client_error(error, reason);
    }
}

/// What a client context's `error` callback does: the errors of a reader's normal course
/// ([`ReaderContext::is_expected`]) at DEBUG, every other one at ERROR.
pub fn log_client_error(error: rdkafka::error::KafkaError, reason: &str) {
    if ReaderContext::is_expected(&error, reason) {
        tracing::debug!(error = %error, reason, "librdkafka");
    } else {
        tracing::error!("librdkafka: {error}: {reason}");
    }
}

impl ConsumerContext for ReaderContext {}

/// What librdkafka reported last for a client (its error callback runs when the client is polled).
#[derive(Default)]
struct ErrorTrap(std::sync::Mutex<Option<(Option<RDKafkaErrorCode>, String)>>);

impl rdkafka::ClientContext for ErrorTrap {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *last = Some((error.rdkafka_error_code(), reason.to_string()));
    }
}

impl rdkafka::producer::ProducerContext for ErrorTrap {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, _: ()) {}
}

/// Connects once before anything else talks to the brokers: `Ok` as soon as one answers a
/// metadata request. Brokers that refuse the credentials or the TLS handshake fail it at once with
/// librdkafka's reason (without this, the first admin call only says "broker transport failure",
/// 30 s later: the admin client never serves librdkafka's error callback); brokers that do not
/// answer fail it after `timeout`.
pub fn preflight(config: &Config, timeout: Duration) -> Result<(), KafkaError> {
    let client: rdkafka::producer::BaseProducer<ErrorTrap> = base(config)
        .create_with_context(ErrorTrap::default())
        .map_err(|e| KafkaError::Setup(e.to_string()))?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if client
            .client()
            .fetch_metadata(None, Duration::from_millis(500))
            .is_ok()
        {
            return Ok(());
        }
        client.poll(Duration::ZERO);
        let last = client
            .context()
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some((
            Some(
                RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SaslAuthenticationFailed
                | RDKafkaErrorCode::SSL,
            ),
            reason,
        )) = &last
        {
            return Err(KafkaError::Setup(format!(
                "the brokers at {} refused this client: {reason} (check \
                 STREAMING_HUB_KAFKA_SECURITY_PROTOCOL, STREAMING_HUB_KAFKA_SASL_* and \
                 STREAMING_HUB_KAFKA_SSL_*)",
                config.kafka_brokers
            )));
        }
        if std::time::Instant::now() >= deadline {
            let why = last.map(|(_, r)| format!(": {r}")).unwrap_or_default();
            return Err(KafkaError::Setup(format!(
                "no broker at {} answered within {timeout:?}{why}",
                config.kafka_brokers
            )));
        }
    }
}

pub fn admin(config: &Config) -> Result<AdminClient<DefaultClientContext>, KafkaError> {
    base(config)
        .create()
        .map_err(|e| KafkaError::Setup(e.to_string()))
}

/// The timeout for metadata and admin calls.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Why [`partition_ids`] has no answer.
#[derive(Debug, thiserror::Error)]
pub enum PartitionsError {
    #[error("kafka call failed: {0}")]
    Call(#[from] rdkafka::error::KafkaError),
    /// The brokers answered, but not with this topic's partitions: it is not there (yet), or its
    /// description came back with an error (its leaders moving).
    #[error("{topic} could not be described: {why}")]
    Undescribed { topic: String, why: String },
}

/// The ids of `topic`'s partitions, from the brokers' metadata; never an empty list.
pub fn partition_ids<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, PartitionsError> {
    let md = consumer.fetch_metadata(Some(topic), timeout)?;
    let undescribed = |why: String| PartitionsError::Undescribed {
        topic: topic.to_string(),
        why,
    };
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| undescribed("not in the brokers' answer".into()))?;
    if let Some(e) = t.error() {
        return Err(undescribed(RDKafkaErrorCode::from(e).to_string()));
    }
    if t.partitions().is_empty() {
        return Err(undescribed(
            "no partitions (is the topology applied?)".into(),
        ));
    }
    Ok(t.partitions().iter().map(|p| p.id()).collect())
}

fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

/// How long a newly assigned partition may wait for its committed offset to become stable: the
/// open transaction that holds it back (a previous owner's) ends within the transaction timeout
/// (60 s), by fencing or by expiry.
const STABLE_OFFSETS_PATIENCE: Duration = Duration::from_secs(120);
/// Shortest time between two questions for those offsets.
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// The rebalance of a `read_committed` consume-process-produce loop: newly assigned partitions
/// start at their committed offsets, read by us as stable, never by librdkafka.
///
/// Why: librdkafka 2.12 asks for the committed offsets of an assignment itself, and when the
/// answer is `UNSTABLE_OFFSET_COMMIT` (another producer's open transaction carries offsets of
/// the partition) and the assignment changed while the question was out, it starts the
/// partition with the answer's offset, -1, i.e. at `auto.offset.reset`: the beginning. The
/// fault suite saw a source partition ingested twice that way (`rdkafka_assignment.c`,
/// `rd_kafka_assignment_apply_offsets`). Explicit start offsets skip that path.
///
/// The wait blocks the caller's poll (as a restore does): the group's rebalance waits with it.
/// If the offsets stay unreadable past the patience, nothing is assigned and `on_fatal` gets the
/// error: the stage must stop so its process restarts. Once `stopping` says so (the process is
/// shutting down), the wait ends and nothing is started: the loop leaves the group as it stops,
/// and the partitions go to another member (a SIGTERM while a previous owner's transaction was
/// open waited for it up to 120 s, past `STREAMING_HUB_SHUTDOWN_TIMEOUT`). `beat` keeps the
/// stage's liveness while it waits. Revocations and errors go as rdkafka's default rebalance sends them. Each callback
/// records the membership it runs under in `confirmed` (see [`member_metadata`]).
#[allow(clippy::too_many_arguments)] // librdkafka's callback arguments and the stage's hooks
pub fn rebalance_at_committed<C: ConsumerContext>(
    context: &C,
    consumer: &BaseConsumer<C>,
    err: RDKafkaRespErr,
    tpl: &TopicPartitionList,
    beat: &dyn Fn(),
    stopping: &dyn Fn() -> bool,
    confirmed: &ConfirmedMembership,
    on_fatal: impl FnOnce(rdkafka::error::KafkaError),
) {
    // librdkafka waits in this callback for the assign or unassign below: the membership read
    // now is the one this assignment belongs to.
    confirmed.set(membership(consumer));
    let _in_callback = confirmed.callback();
    let cooperative = is_cooperative(consumer);
    match err {
        RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
            // `tpl` belongs to librdkafka: it is read, never replaced.
            let at = match stable_committed(consumer, tpl, beat, stopping) {
                Ok(Some(at)) => at,
                Ok(None) => {
                    tracing::info!(
                        partitions = tpl.count(),
                        "shutting down: newly assigned partitions are not started"
                    );
                    // The callback's assign is still owed to librdkafka: an empty one.
                    let none = TopicPartitionList::new();
                    let assigned = if cooperative {
                        consumer.incremental_assign(&none)
                    } else {
                        consumer.assign(&none)
                    };
                    if let Err(e) = assigned {
                        tracing::warn!(error = %e, "empty assignment refused");
                    }
                    return;
                }
                Err(e) => return on_fatal(e),
            };
            let rebalance = Rebalance::Assign(&at);
            context.pre_rebalance(consumer, &rebalance);
            let assigned = if cooperative {
                consumer.incremental_assign(&at)
            } else {
                consumer.assign(&at)
            };
            if let Err(e) = assigned {
                return on_fatal(e);
            }
            context.post_rebalance(consumer, &rebalance);
        }
        other => {
            let rebalance = if other == RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS {
                Rebalance::Revoke(tpl)
            } else {
                let code: RDKafkaErrorCode = other.into();
                tracing::error!(error = %code, "rebalance error");
                Rebalance::Error(rdkafka::error::KafkaError::Rebalance(code))
            };
            context.pre_rebalance(consumer, &rebalance);
            let unassigned = if cooperative {
                consumer.incremental_unassign(&held_of(consumer, tpl))
            } else {
                consumer.unassign()
            };
            if let Err(e) = unassigned {
                tracing::error!(error = %e, "unassign failed");
            }
            context.post_rebalance(consumer, &rebalance);
        }
    }
}

/// The partitions of `tpl` this consumer holds. The group may revoke more: partitions it gave
/// that were never started (an assignment left empty while stopping, or one whose offsets stayed
/// unreadable). librdkafka refuses an incremental unassign naming any partition it does not hold
/// (`rd_kafka_assignment_subtract`), and then waits for an unassign call for good: the loop's
/// leave and close hung until the watchdog ended the process (exit 70).
fn held_of<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    tpl: &TopicPartitionList,
) -> TopicPartitionList {
    let Ok(held) = consumer.assignment() else {
        return tpl.clone();
    };
    let mut mine = TopicPartitionList::new();
    for e in tpl.elements() {
        if held.find_partition(e.topic(), e.partition()).is_some() {
            mine.add_partition(e.topic(), e.partition());
        }
    }
    mine
}

/// `partitions` with their committed offsets as start offsets (the beginning where the group
/// never committed one), read with `require_stable` (a `read_committed` consumer asks so): the
/// answer waits for open transactions that carry offsets of these partitions. `None` once
/// `stopping` says so while it waits.
pub fn stable_committed<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    partitions: &TopicPartitionList,
    beat: &dyn Fn(),
    stopping: &dyn Fn() -> bool,
) -> Result<Option<TopicPartitionList>, rdkafka::error::KafkaError> {
    if partitions.count() == 0 {
        return Ok(Some(partitions.clone()));
    }
    let started = std::time::Instant::now();
    let mut waiting_said = false;
    let committed = loop {
        beat();
        let asked = std::time::Instant::now();
        let answer = consumer
            .committed_offsets(partitions.clone(), Duration::from_secs(1))
            .and_then(|c| {
                // A partition's own error (e.g. still unstable) fails the whole answer.
                c.elements().iter().try_for_each(|e| e.error())?;
                Ok(c)
            });
        match answer {
            Ok(c) => break c,
            Err(_) if stopping() => return Ok(None),
            Err(e) if started.elapsed() < STABLE_OFFSETS_PATIENCE => {
                if !waiting_said {
                    let names: Vec<String> = partitions
                        .elements()
                        .iter()
                        .map(|p| format!("{}[{}]", p.topic(), p.partition()))
                        .collect();
                    tracing::warn!(error = %e, partitions = %names.join(","), "committed offsets not stable yet (an open transaction may hold them); waiting");
                    waiting_said = true;
                }
                // An error answered at once (no coordinator yet) is asked again after a pause,
                // not in a tight loop.
                std::thread::sleep(RETRY_PAUSE.saturating_sub(asked.elapsed()));
            }
            Err(e) => return Err(e),
        }
    };
    if waiting_said {
        tracing::info!(
            waited_ms = started.elapsed().as_millis() as u64,
            "committed offsets stable"
        );
    }
    let mut at = TopicPartitionList::new();
    for e in committed.elements() {
        let start = match e.offset() {
            Offset::Offset(o) => Offset::Offset(o),
            _ => Offset::Beginning,
        };
        at.add_partition_offset(e.topic(), e.partition(), start)?;
    }
    Ok(Some(at))
}

/// A consumer's place in its group as the group coordinator sees it in a transaction's offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub generation: i32,
    pub member_id: String,
}

impl Membership {
    /// A member of a generation: the coordinator checks both against the group's before it takes
    /// offsets sent with them.
    pub fn is_member(&self) -> bool {
        self.generation >= 0 && !self.member_id.is_empty()
    }
}

/// The membership the application was last told about: recorded by [`rebalance_at_committed`]
/// at each rebalance callback, checked by [`member_metadata`]. librdkafka waits for the
/// callback's assign or unassign before it joins again, so in the usual flows the membership
/// read at the callback's start is the one its partitions belong to. Not covered: a membership
/// lost while a callback waits to be served (a heartbeat answered UNKNOWN_MEMBER_ID, a session
/// timeout) followed by a rejoin librdkafka starts anyway (a metadata change) and completes
/// before the poll that serves the old callback: that callback records the new membership, and
/// until the new one is served a batch of partitions the group gave away would pass. A change
/// during the callback (its committed-offsets wait, a revocation's last commit) is refused, the
/// next generation included: librdkafka has already taken the partitions being revoked out of
/// the ones it reports owning, so a rejoin it starts meanwhile (a subscribed topic's partition
/// count changed) may hand them to another member in that very generation.
#[derive(Debug, Default)]
pub struct ConfirmedMembership {
    told: std::sync::Mutex<Option<Membership>>,
    in_callback: std::sync::atomic::AtomicBool,
}

impl ConfirmedMembership {
    fn set(&self, m: Option<Membership>) {
        *self.told.lock().unwrap_or_else(|p| p.into_inner()) = m;
    }
    fn get(&self) -> Option<Membership> {
        self.told.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn in_callback(&self) -> bool {
        self.in_callback.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// Marks a rebalance callback under way until the guard drops.
    fn callback(&self) -> impl Drop + '_ {
        struct Leave<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.store(false, std::sync::atomic::Ordering::SeqCst);
            }
        }
        self.in_callback
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Leave(&self.in_callback)
    }
}

/// The group metadata to send with a transaction's offsets, only while the consumer's
/// membership is the one its last rebalance callback ran under, or the generation right after it
/// (see [`may_commit_under`]). The group coordinator checks a
/// transaction's offsets against the sender's generation and member id, never against which
/// member owns the partitions; librdkafka moves to a new generation (or clears its member id on
/// a session timeout) in its own thread, and tells the application which partitions it lost
/// only at a later poll. In between, a loop still holding records of partitions the group gave
/// to another instance would commit them a second time, under a generation the coordinator
/// takes. Seen in the fault suite: an instance stalled in an abort while its coordinator failed
/// over rejoined as a static member and committed a source partition's records the new owner
/// had already written to the inbox. Refused here; the caller aborts, and its next poll serves
/// the callback (which forgets revoked partitions' records and records the new membership).
pub fn member_metadata<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    confirmed: &ConfirmedMembership,
) -> Result<rdkafka::consumer::ConsumerGroupMetadata, rdkafka::error::KafkaError> {
    member_metadata_as(consumer, confirmed).map(|(metadata, _)| metadata)
}

/// [`member_metadata`], with the membership the metadata holds.
pub fn member_metadata_as<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    confirmed: &ConfirmedMembership,
) -> Result<(rdkafka::consumer::ConsumerGroupMetadata, Membership), rdkafka::error::KafkaError> {
    // rdkafka keeps its metadata's pointer to itself: the membership is read just before and
    // just after it is taken. Every rejoin gets a new member id, so two equal readings mean the
    // metadata between them is either the same or taken during a reset (generation -1 or no
    // member id), which the coordinator refuses from a static member.
    let before = membership(consumer);
    let metadata = consumer.group_metadata();
    let after = membership(consumer);
    let why = match (before.as_ref(), metadata) {
        (None, _) | (_, None) => "no group metadata yet".to_string(),
        (Some(m), Some(_)) if m.is_member() && after.as_ref() != Some(m) => {
            MOVED_WHILE_TAKEN.to_string()
        }
        (Some(m), Some(metadata)) => match may_commit_as(consumer, confirmed, m) {
            Ok(()) => return Ok((metadata, m.clone())),
            Err(why) => why,
        },
    };
    Err(rdkafka::error::KafkaError::Subscription(why))
}

/// [`may_commit_under`] with what `consumer` and `confirmed` say now, for the membership `m`.
fn may_commit_as<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    confirmed: &ConfirmedMembership,
    m: &Membership,
) -> Result<(), String> {
    may_commit_under(
        m,
        confirmed.get().as_ref(),
        is_cooperative(consumer),
        consumer.assignment_lost(),
        confirmed.in_callback(),
    )
}

fn is_cooperative<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> bool {
    matches!(
        consumer.rebalance_protocol(),
        RebalanceProtocol::Cooperative
    )
}

/// Whether a transaction's offsets may go under the membership `now` when the last rebalance
/// callback ran under `told`; why not, if not.
///
/// Under `told` itself, always. Under the generation right after it (same member id, the
/// cooperative protocol, no assignment lost, not inside a rebalance callback) too: a loop's open
/// transaction then commits instead of aborting when another member joins or leaves, so the
/// first attempts it already sent are not sent again by the partitions' next owner (who would
/// read the aborted records anew). That is safe because in the cooperative protocol a partition
/// moves in two rebalances (KIP-429): the member's own JoinGroup for `told.generation + 1`, sent
/// from a settled assignment, named every partition it holds, and that generation leaves each
/// of them to it or to nobody until its revocation is served and the member joins again
/// (librdkafka ignores a rebalance under way while a callback is unserved); meanwhile only this
/// member may commit them, as Java's consumer does in `onPartitionsRevoked` under the new
/// generation. Refused: two generations or more past the callback, a new member id (the member
/// left, or was removed, and joined again: a partition may have gone to another member in
/// between), an assignment librdkafka lost (its revocation not served yet), the eager protocol
/// (where a generation reassigns at once), and any change during a callback (see
/// [`ConfirmedMembership`]).
pub fn may_commit_under(
    now: &Membership,
    told: Option<&Membership>,
    cooperative: bool,
    lost: bool,
    in_callback: bool,
) -> Result<(), String> {
    if !now.is_member() {
        return Err(format!(
            "not a member of a generation (generation {}, member id {}): waiting to rejoin",
            now.generation,
            if now.member_id.is_empty() {
                "none"
            } else {
                "set"
            }
        ));
    }
    if told == Some(now) {
        return Ok(());
    }
    let why_not_next = match told {
        None => {
            return Err(format!(
                "the group membership is generation {} and no rebalance has been served yet: \
             offsets wait for the assignment",
                now.generation
            ));
        }
        Some(t) if t.member_id != now.member_id => "under another member id",
        Some(t) if t.generation.checked_add(1) != Some(now.generation) => "",
        Some(_) if in_callback => "during a rebalance callback",
        Some(_) if lost => "with the assignment lost",
        Some(_) if !cooperative => "under the eager protocol",
        Some(_) => return Ok(()),
    };
    Err(format!(
        "the group membership moved to generation {} (last rebalance seen: generation {}{}{}) \
         and the assignment that goes with it is not served yet: offsets sent now could be a \
         partition another member owns",
        now.generation,
        told.map_or(-1, |t| t.generation),
        if why_not_next.is_empty() { "" } else { ", " },
        why_not_next
    ))
}

/// Why a loop did not work on a batch: [`may_commit_now`] said no.
pub const NOT_TOLD: &str = "the group membership is neither the one the last rebalance was served \
     under nor the next generation of the same member";

/// The cheap form of [`member_metadata`]'s check (one reading), for a loop deciding whether a
/// batch is worth working on.
pub fn may_commit_now<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    confirmed: &ConfirmedMembership,
) -> bool {
    membership(consumer).is_some_and(|m| may_commit_as(consumer, confirmed, &m).is_ok())
}

/// Why [`member_metadata`] refused: the membership read just before and just after the metadata
/// was taken differ.
pub const MOVED_WHILE_TAKEN: &str = "the group membership changed while its metadata was taken";

/// Whether `e` says the group moved on while a transaction's offsets were being sent: the
/// coordinator refused them for their generation (`ILLEGAL_GENERATION`, the group moved in the
/// moment between their metadata being taken and checked; librdkafka makes it an abort), or
/// [`member_metadata`] saw the membership change while it took the metadata.
pub fn generation_refused(e: &KafkaError) -> bool {
    match e {
        KafkaError::Call(rdkafka::error::KafkaError::Subscription(why)) => why == MOVED_WHILE_TAKEN,
        KafkaError::Call(e) => e.rdkafka_error_code() == Some(RDKafkaErrorCode::IllegalGeneration),
        _ => false,
    }
}

/// After [`generation_refused`] of offsets sent under generation `refused`: waits up to
/// `patience` for this consumer to reach a generation past both that one and the one its loop
/// was told, as a membership its offsets may go under
/// ([`may_commit_under`]: the next generation of the same member, cooperative, nothing lost).
/// The coordinator refused because it has moved there, so the consumer's join response is on its
/// way. Reads the membership only: no poll, so no rebalance callback is served meanwhile.
pub fn wait_next_generation<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    confirmed: &ConfirmedMembership,
    refused: i32,
    patience: Duration,
) -> bool {
    let Some(told) = confirmed.get() else {
        return false;
    };
    let past = told.generation.max(refused);
    let deadline = std::time::Instant::now() + patience;
    loop {
        if let Some(m) = membership(consumer) {
            if m.generation > past && may_commit_as(consumer, confirmed, &m).is_ok() {
                return true;
            }
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The consumer's member id in its group (empty before it has joined).
pub fn member_id<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> String {
    membership(consumer)
        .map(|m| m.member_id)
        .unwrap_or_default()
}

/// Whether the consumer's membership is the one its last rebalance callback ran under (nothing
/// moved since the application was last told).
pub fn membership_confirmed<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    confirmed: &ConfirmedMembership,
) -> bool {
    membership(consumer).is_some_and(|m| m.is_member() && confirmed.get().as_ref() == Some(&m))
}

/// How long a stopping loop waits for its consumer's partitions to be revoked (see
/// [`leave_group`]).
pub const LEAVE_PATIENCE: Duration = Duration::from_secs(10);

/// Leaves the consumer group before the consumer is dropped (which closes it): unsubscribes,
/// then polls, serving the revocation that follows, until nothing is assigned or `patience`
/// has passed; records polled meanwhile are dropped (nothing is committed after them). A
/// consumer closed while it still holds partitions calls the rebalance callback from within the
/// close, and the unassign made there can wait forever (librdkafka 2.12, its issue #4884): an
/// instance was seen never to exit after SIGTERM. `beat` keeps the loop's liveness meanwhile.
pub fn leave_group<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    patience: Duration,
    beat: &dyn Fn(),
) {
    consumer.unsubscribe();
    let until = std::time::Instant::now() + patience;
    loop {
        beat();
        let held = consumer.assignment().map(|a| a.count()).unwrap_or(0);
        if held == 0 || std::time::Instant::now() >= until {
            break;
        }
        let _ = consumer.poll(Duration::from_millis(100));
    }
}

/// Whether the consumer holds fetched records (or other events) not yet polled.
pub fn has_queued<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> bool {
    use rdkafka::bindings as rd;
    // SAFETY: the client pointer is valid while `consumer` lives; the queue handle librdkafka
    // returns is a new reference we own, destroyed right after its length is read.
    unsafe {
        let q = rd::rd_kafka_queue_get_consumer(consumer.client().native_ptr());
        if q.is_null() {
            return false;
        }
        let n = rd::rd_kafka_queue_length(q);
        rd::rd_kafka_queue_destroy(q);
        n > 0
    }
}

/// The consumer's generation and member id now (librdkafka's group metadata, serialised).
pub fn membership<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> Option<Membership> {
    use rdkafka::bindings as rd;
    // SAFETY: the client pointer is valid while `consumer` lives; librdkafka returns a metadata
    // copy we own (destroyed below) or null, and `write` hands back a buffer of `size` bytes it
    // allocated (freed below with `rd_kafka_mem_free`) or an error we own (destroyed).
    unsafe {
        let md = rd::rd_kafka_consumer_group_metadata(consumer.client().native_ptr());
        if md.is_null() {
            return None;
        }
        let mut buf: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut size = 0usize;
        let err = rd::rd_kafka_consumer_group_metadata_write(md, &mut buf, &mut size);
        rd::rd_kafka_consumer_group_metadata_destroy(md);
        if !err.is_null() {
            rd::rd_kafka_error_destroy(err);
            return None;
        }
        if buf.is_null() {
            return None;
        }
        let parsed = parse_group_metadata(std::slice::from_raw_parts(buf.cast::<u8>(), size));
        rd::rd_kafka_mem_free(std::ptr::null_mut(), buf);
        parsed
    }
}

/// librdkafka's serialised group metadata (`rd_kafka_consumer_group_metadata_write`): the magic
/// `CGMDv2:`, the generation (native-endian i32), then NUL-terminated group id and member id.
fn parse_group_metadata(bytes: &[u8]) -> Option<Membership> {
    let rest = bytes.strip_prefix(b"CGMDv2:")?;
    let (generation, rest) = rest.split_at_checked(4)?;
    let generation = i32::from_ne_bytes(generation.try_into().ok()?);
    let group_end = rest.iter().position(|&b| b == 0)?;
    let rest = &rest[group_end + 1..];
    let member_end = rest.iter().position(|&b| b == 0)?;
    Some(Membership {
        generation,
        member_id: String::from_utf8_lossy(&rest[..member_end]).into_owned(),
    })
}

/// The headers of a consumed record whose names are UTF-8, in order; any other is skipped.
/// Every reader of consumed headers goes through this or [`raw_header`], never rdkafka's
/// `Headers::iter` / `get` (see [`raw_header`]): the hub's own topics can be written by others.
pub fn utf8_headers(
    headers: &rdkafka::message::BorrowedHeaders,
) -> impl Iterator<Item = (&str, Option<&[u8]>)> + '_ {
    use rdkafka::message::Headers;
    (0..headers.count()).filter_map(move |i| {
        let (name, value) = raw_header(headers, i)?;
        Some((std::str::from_utf8(name).ok()?, value))
    })
}

/// What `offsets_for_times` answered for one partition: the offset of its first record at or
/// after the time asked, None when it has none (the caller reads to the end), or the lookup's
/// error. librdkafka answers the call as a whole: a partition whose lookup failed (its leader
/// moving) carries its own error and no offset, which is not "nothing after that time" (taken
/// for that, a window's start skipped the partition and its end ran past the window).
pub fn offset_for_time(
    found: &TopicPartitionList,
    topic: &str,
    partition: i32,
) -> Result<Option<i64>, rdkafka::error::KafkaError> {
    let Some(e) = found.find_partition(topic, partition) else {
        return Err(rdkafka::error::KafkaError::OffsetFetch(
            RDKafkaErrorCode::UnknownPartition,
        ));
    };
    e.error()?;
    Ok(match e.offset() {
        Offset::Offset(o) if o >= 0 => Some(o),
        _ => None,
    })
}

/// The header at `idx` of a consumed record, its name as raw bytes (None past the last one).
///
/// rdkafka's `Headers::iter`, `get` and `try_get` on a consumed record unwrap the name's UTF-8
/// check, so a record whose header name is not UTF-8 (which Kafka accepts from any client) would
/// panic the thread reading it, and again after every restart. Records producers wrote are read
/// through this instead, and a name that is not UTF-8 gets a typed outcome.
pub fn raw_header(
    headers: &rdkafka::message::BorrowedHeaders,
    idx: usize,
) -> Option<(&[u8], Option<&[u8]>)> {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut value: *const std::ffi::c_void = std::ptr::null();
    let mut size = 0usize;
    let native = headers as *const rdkafka::message::BorrowedHeaders
        as *const rdkafka::bindings::rd_kafka_headers_t;
    // SAFETY: a `&BorrowedHeaders` is a pointer to librdkafka's headers of a message that outlives
    // the borrow (rdkafka casts it the same way); on success librdkafka points `name` at a
    // NUL-terminated string and `value` at `size` bytes (or null), both owned by those headers.
    let err = unsafe {
        rdkafka::bindings::rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size)
    };
    if err != rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
        return None;
    }
    // SAFETY: as above; the lifetimes are tied to `headers`.
    let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
    let value =
        (!value.is_null()).then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) });
    Some((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// librdkafka's "no offset" (`RD_KAFKA_OFFSET_INVALID`), which an implicitly acknowledged
    /// record keeps, is not a place; the first offset of a partition is. The transaction that
    /// ends on one is retried, not stopped.
    #[test]
    fn a_record_reported_delivered_without_an_offset_is_not_placed_and_its_transaction_retries() {
        assert!(!placed(-1001));
        assert!(!placed(-1));
        assert!(placed(0));
        assert!(placed(i64::MAX));
        assert!(!never_clears(unplaced(1).rdkafka_error_code()));
    }

    /// A transactional producer whose coordinator cannot be reached (here no broker at its
    /// address: librdkafka's retriable timeout, as while a coordinator moves or loads) is
    /// initialised again until the patience runs out; once the process is stopping, not again.
    #[test]
    fn init_is_tried_again_while_retriable_and_not_once_stopping() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let producer: rdkafka::producer::BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", addr.to_string())
            .set("transactional.id", "init-waiting-test")
            .create()
            .unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let timeout = Duration::from_millis(500);
        let patience = Duration::from_secs(3);
        let t0 = Instant::now();
        let e = init_waiting(&producer, timeout, patience, &stop).unwrap_err();
        assert!(init_retriable(&e), "{e}");
        assert!(
            t0.elapsed() >= patience,
            "gave up after {:?}, before its patience",
            t0.elapsed()
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let t1 = Instant::now();
        let e = init_waiting(&producer, timeout, Duration::from_secs(30), &stop).unwrap_err();
        assert!(init_retriable(&e), "{e}");
        assert!(
            t1.elapsed() < Duration::from_secs(20),
            "stopping, it still tried for {:?}",
            t1.elapsed()
        );
    }

    #[test]
    fn a_loop_aborting_every_batch_pauses_longer_each_run_and_ends_after_its_limit() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(60);
        let mut s = AbortStreak::new(limit);
        let pauses: Vec<u64> = (0..8)
            .map(|i| {
                s.aborted(t0 + Duration::from_secs(i), true)
                    .unwrap()
                    .as_millis() as u64
            })
            .collect();
        assert_eq!(pauses, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(
            s.aborted(t0 + limit, true),
            None,
            "aborting for the whole limit"
        );
        let said = s.describe(t0 + limit);
        assert!(
            said.starts_with("9 batches aborted in a row over 60 s"),
            "{said}"
        );
        assert!(said.ends_with("over the last 60 s"), "{said}");
        // A commit between aborts starts a new streak, from the shortest pause.
        s.committed();
        assert_eq!(s.aborted(t0 + 2 * limit, true), Some(ABORT_PAUSE));
        assert_eq!(
            s.aborted(t0 + 3 * limit - Duration::from_millis(1), true),
            Some(2 * ABORT_PAUSE)
        );
        assert_eq!(s.aborted(t0 + 3 * limit, true), None);
        // Failures that may clear (a cluster in trouble) end the loop only after ten times as
        // long.
        let mut s = AbortStreak::new(limit);
        for i in 0..10 {
            assert!(s.aborted(t0 + i * limit, false).is_some());
        }
        assert_eq!(s.aborted(t0 + 10 * limit, false), None);
        // A lasting one counts from itself, whatever came between.
        let mut s = AbortStreak::new(limit);
        assert!(s.aborted(t0, false).is_some());
        assert!(s.aborted(t0 + limit, true).is_some());
        assert!(
            s.aborted(t0 + 2 * limit - Duration::from_millis(1), false)
                .is_some()
        );
        assert_eq!(s.aborted(t0 + 2 * limit, false), None);
        assert!(never_clears(Some(RDKafkaErrorCode::MessageSizeTooLarge)));
        assert!(!never_clears(Some(RDKafkaErrorCode::NotEnoughReplicas)));
        assert!(!never_clears(None));
    }

    #[test]
    fn no_client_has_the_broker_create_a_topic_it_writes_to() {
        let config = crate::config::Config::from_vars(std::iter::empty()).unwrap();
        for c in [
            base(&config),
            transactional_producer(&config, "t"),
            transactional_consumer(&config, "g", "m"),
        ] {
            assert_eq!(c.get("allow.auto.create.topics"), Some("false"));
        }
    }

    #[test]
    fn a_partition_whose_time_lookup_failed_is_an_error_not_the_end() {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset("t", 0, Offset::Offset(42))
            .unwrap();
        tpl.add_partition_offset("t", 1, Offset::End).unwrap();
        tpl.add_partition_offset("t", 2, Offset::Offset(7)).unwrap();
        // SAFETY: the list holds three elements; only the third's error code is written (its
        // offset stays: an error wins over whatever offset came with it).
        unsafe {
            (*(*tpl.ptr()).elems.add(2)).err =
                rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION;
        }
        assert_eq!(offset_for_time(&tpl, "t", 0).unwrap(), Some(42));
        assert_eq!(offset_for_time(&tpl, "t", 1).unwrap(), None);
        assert!(offset_for_time(&tpl, "t", 2).is_err());
        assert!(offset_for_time(&tpl, "t", 3).is_err(), "no answer for it");
    }

    #[test]
    fn the_group_moving_on_is_told_from_other_failures() {
        use rdkafka::error::KafkaError as Rd;
        let call = KafkaError::Call;
        assert!(generation_refused(&call(Rd::Subscription(
            MOVED_WHILE_TAKEN.into()
        ))));
        assert!(generation_refused(&call(Rd::ConsumerCommit(
            RDKafkaErrorCode::IllegalGeneration
        ))));
        assert!(!generation_refused(&call(Rd::Subscription(
            NOT_TOLD.into()
        ))));
        assert!(!generation_refused(&call(Rd::ConsumerCommit(
            RDKafkaErrorCode::UnknownMemberId
        ))));
        assert!(!generation_refused(&KafkaError::Setup(
            MOVED_WHILE_TAKEN.into()
        )));
    }

    #[test]
    fn offsets_go_under_the_told_membership_or_the_next_generation_of_the_same_member() {
        let m = |generation: i32, id: &str| Membership {
            generation,
            member_id: id.into(),
        };
        let told = m(4, "a");
        // (now, cooperative, lost, in a callback): nothing moved since the last callback, even
        // inside one; the next generation of the same member, which still holds every
        // partition it held.
        for (now, cooperative, lost, in_callback) in [
            (m(4, "a"), false, false, false),
            (m(4, "a"), true, false, true),
            (m(5, "a"), true, false, false),
        ] {
            let r = may_commit_under(&now, Some(&told), cooperative, lost, in_callback);
            assert_eq!(r, Ok(()), "{now:?}");
        }
        // Refused: two generations on, an earlier one, another member id, a lost assignment,
        // the eager protocol, a move during a callback, no callback yet, no membership.
        let says = |now: Membership, told: Option<&Membership>, flags: (bool, bool, bool)| {
            may_commit_under(&now, told, flags.0, flags.1, flags.2).unwrap_err()
        };
        let plain = (true, false, false);
        for (why, expected) in [
            (
                says(m(6, "a"), Some(&told), plain),
                "generation 6 (last rebalance seen: generation 4)",
            ),
            (
                says(m(3, "a"), Some(&told), plain),
                "generation 3 (last rebalance seen: generation 4)",
            ),
            (
                says(m(5, "b"), Some(&told), plain),
                "generation 4, under another member id",
            ),
            (
                says(m(4, "b"), Some(&told), plain),
                "under another member id",
            ),
            (
                says(m(5, "a"), Some(&told), (true, true, false)),
                "with the assignment lost",
            ),
            (
                says(m(5, "a"), Some(&told), (false, false, false)),
                "under the eager protocol",
            ),
            (
                says(m(5, "a"), Some(&told), (true, false, true)),
                "during a rebalance callback",
            ),
            (
                says(m(1, "a"), None, plain),
                "no rebalance has been served yet",
            ),
            (
                says(m(-1, ""), Some(&told), plain),
                "not a member of a generation",
            ),
        ] {
            assert!(why.contains(expected), "{why}");
        }
    }

    #[test]
    fn a_retriable_failure_is_retried_until_it_passes_and_no_other_is() {
        let far = std::time::Instant::now() + Duration::from_secs(60);
        // Two retriable failures, then success: three calls, two waits between them.
        let (mut calls, mut waits) = (0, 0);
        let r = retry_while(
            || {
                calls += 1;
                if calls < 3 { Err("timed out") } else { Ok(()) }
            },
            |e| *e == "timed out",
            |_| waits += 1,
            far,
        );
        assert_eq!((r, calls, waits), (Ok(()), 3, 2));
        // An error that is not retriable comes back at once.
        let mut calls = 0;
        let r = retry_while(
            || {
                calls += 1;
                Err("requires abort")
            },
            |e| *e == "timed out",
            |_| {},
            far,
        );
        assert_eq!((r, calls), (Err("requires abort"), 1));
        // Past the deadline the retriable error is returned, after the one call.
        let mut calls = 0;
        let r = retry_while(
            || {
                calls += 1;
                Err("timed out")
            },
            |e| *e == "timed out",
            |_| {},
            std::time::Instant::now(),
        );
        assert_eq!((r, calls), (Err("timed out"), 1));
    }

    #[test]
    fn a_batch_window_follows_the_transactions_between_the_floor_and_the_interval() {
        let ms = Duration::from_millis;
        let (floor, interval) = (ms(5), ms(100));
        let mut w = BatchWindow::new();
        assert_eq!(w.window(floor, interval), floor, "starts at the floor");
        // Fast transactions keep it at the floor.
        w.took(ms(2), interval);
        w.took(ms(1), interval);
        assert_eq!(w.window(floor, interval), floor);
        // Slower ones widen it, halfway each time.
        for _ in 0..20 {
            w.took(ms(30), interval);
        }
        let now = w.window(floor, interval);
        assert!(now > ms(29) && now <= ms(30), "{now:?}");
        // A stall counts as the interval (no overflow on an absurd one): never past it.
        w.took(Duration::MAX, interval);
        let once = w.window(floor, interval);
        assert!(once > ms(64) && once <= ms(65), "(30 + 100) / 2: {once:?}");
        for _ in 0..20 {
            w.took(ms(5_000), interval);
        }
        let stalled = w.window(floor, interval);
        assert!(stalled > ms(99) && stalled <= interval, "{stalled:?}");
        // Two quick transactions after it halve the window twice: (100 + 4) / 2, (52 + 4) / 2.
        w.took(ms(4), interval);
        w.took(ms(4), interval);
        let after = w.window(floor, interval);
        assert!(after > ms(27) && after <= ms(28), "{after:?}");
        // And it comes back down as they speed up again.
        for _ in 0..30 {
            w.took(ms(8), interval);
        }
        let back = w.window(floor, interval);
        assert!(back >= ms(8) && back < ms(9), "{back:?}");
        // A floor equal to the interval is a fixed window; an interval below the floor wins.
        assert_eq!(w.window(interval, interval), interval);
        assert_eq!(BatchWindow::new().window(floor, ms(2)), ms(2));
    }

    /// The format is librdkafka's own: metadata it builds and serialises parses back.
    #[test]
    fn group_metadata_written_by_librdkafka_parses_to_its_generation_and_member_id() {
        use rdkafka::bindings as rd;
        let cases = [(7, "member-1"), (-1, "")];
        for (generation, member) in cases {
            let group = std::ffi::CString::new("a-group").unwrap();
            let member_c = std::ffi::CString::new(member).unwrap();
            let instance = std::ffi::CString::new("instance-1").unwrap();
            // SAFETY: NUL-terminated strings that outlive the calls; what librdkafka returns is
            // freed as in `membership`.
            let parsed = unsafe {
                let md = rd::rd_kafka_consumer_group_metadata_new_with_genid(
                    group.as_ptr(),
                    generation,
                    member_c.as_ptr(),
                    instance.as_ptr(),
                );
                let mut buf: *mut std::ffi::c_void = std::ptr::null_mut();
                let mut size = 0usize;
                let err = rd::rd_kafka_consumer_group_metadata_write(md, &mut buf, &mut size);
                assert!(err.is_null());
                rd::rd_kafka_consumer_group_metadata_destroy(md);
                let parsed =
                    parse_group_metadata(std::slice::from_raw_parts(buf.cast::<u8>(), size));
                rd::rd_kafka_mem_free(std::ptr::null_mut(), buf);
                parsed
            };
            let m = parsed.expect("parses");
            assert_eq!((m.generation, m.member_id.as_str()), (generation, member));
            assert_eq!(m.is_member(), generation >= 0 && !member.is_empty());
        }
        assert_eq!(parse_group_metadata(b"CGMDv1:...."), None);
        assert_eq!(parse_group_metadata(b"CGMDv2:\x01\x00"), None);
    }
}
