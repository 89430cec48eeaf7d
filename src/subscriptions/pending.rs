//! Pending verifications, retried (issue 5 item 6: "pending subscriptions are retried a few times,
//! then `failed`"), and the [`Prober`] that sends the verification probe to a stored subscription
//! (used here and by `streaming-hub subscriptions apply`).
//!
//! A webhook subscription is `pending` when its last probe (on create, or on a URL change made
//! before it was ever verified: a new URL of an `active` one is written only once it passed) did
//! not pass. Every [`PASS_INTERVAL`] the [`PendingRetrier`] scans the table for pending webhooks and
//! probes those that are due:
//! - a subscription is noticed on one pass and first probed on the next: the API writes `pending`
//!   before its own create-time probe, so a subscription created a moment ago is not probed twice
//!   at once;
//! - after the k-th failed probe the next one waits 2^k passes (see [`spacing`]): with 30 s passes
//!   the attempts come 30 s, 1.5 min, 3.5 min, 7.5 min and 15.5 min after the subscription was
//!   noticed;
//! - a passing probe writes `active`; the [`MAX_ATTEMPTS`]-th failure, or a failure that waiting
//!   cannot change ([`ProbeError::is_retryable`]: a refused URL, a secret that does not open),
//!   writes `failed`. `failed` stays until `POST /v1/subscriptions/{id}/verify` or a new URL;
//! - a verdict whose write fails (the control topic unavailable) is written again on the next
//!   passes, without probing the endpoint again, onto the record probed (its destination).
//!
//! A verdict is written only onto the version that was probed (as version + 1), and only while that
//! version is still the latest and still `pending`; anything else means someone changed the
//! subscription meanwhile, and the new version is judged on its own.
//!
//! Attempt counts live in memory, keyed by (id, version): a new version of the subscription (an
//! update, a new URL) starts over, and so does a restart of the process, so a restart may give an
//! endpoint up to [`MAX_ATTEMPTS`] more probes before `failed`.
//!
//! Trade-off: every instance with the API on runs its own retrier; there is no leader. An endpoint
//! may thus get up to [`MAX_ATTEMPTS`] probes per instance, and two instances (or this instance's
//! API) may both write version N + 1 of one subscription. The control topic keeps both in order,
//! every instance's table keeps the later one (equal versions replace), so all instances agree on
//! the outcome; the earlier write is lost. Both carry a verdict about the same endpoint, so the
//! usual loss is nothing; the rare bad case (one instance's fifth failure landing after another's
//! pass) leaves a `failed` subscription that `/verify` recovers.
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;

use crate::delivery::verify::{VerifyError, probe};
use crate::runtime::clock::SharedClock;
use crate::runtime::records::{
    DestinationRecord, DestinationType, EncryptedBlob, SubscriptionRecord, VerificationState,
};
use crate::subscriptions::control::{RepoError, Subscriptions};
use crate::subscriptions::model::SinkPolicy;
use crate::subscriptions::sealed_url;
use crate::subscriptions::secrets::{Binding, Kek, SecretError};
use crate::subscriptions::table::Sub;

/// How often the retrier scans for pending subscriptions. The spacing of attempts is counted in
/// passes, so this is the unit of the whole retry curve (about 15 minutes from first notice to
/// `failed`). A constant, not a setting; tests call [`PendingRetrier::run_pass`] directly.
pub const PASS_INTERVAL: Duration = Duration::from_secs(30);
/// Probes of one subscription version before it is `failed`.
pub const MAX_ATTEMPTS: u32 = 5;
/// Probes in flight at once during a pass.
const PROBES_AT_ONCE: usize = 16;
/// How long a verdict's write waits for this instance's table to reach the control topic's end
/// (the API's reads and writes wait as long).
const VERDICT_SYNC_WAIT: Duration = Duration::from_secs(5);
/// Most probes of one tenant in a pass; its other due ones wait for the next pass (no try
/// counted). A pass ends when its last probe does, so a tenant with a thousand pending webhooks
/// at hosts that never answer made every pass last 1,000 / 16 x the HTTP timeout (16 minutes),
/// and every other tenant's pending subscription (matching nothing meanwhile) waited that long.
const TENANT_PROBES_PER_PASS: usize = PROBES_AT_ONCE;

/// `due`, at most [`TENANT_PROBES_PER_PASS`] of each tenant, taken a tenant at a time in turn
/// (so every tenant's first ones are among the first probes started); within a tenant the least
/// tried first (`tries`), so a new webhook is not kept behind the same oldest ones every pass.
fn fair_share(mut due: Vec<Sub>, tries: impl Fn(&Sub) -> u32) -> Vec<Sub> {
    due.sort_by_cached_key(|s| (s.tenant_id.clone(), tries(s), s.id.clone()));
    let mut by_tenant: Vec<std::collections::VecDeque<Sub>> = Vec::new();
    for s in due {
        match by_tenant.last_mut() {
            Some(q) if q.front().is_some_and(|f| f.tenant_id == s.tenant_id) => {
                if q.len() < TENANT_PROBES_PER_PASS {
                    q.push_back(s);
                }
            }
            _ => by_tenant.push(std::collections::VecDeque::from([s])),
        }
    }
    let mut out = Vec::new();
    while by_tenant.iter().any(|q| !q.is_empty()) {
        for q in by_tenant.iter_mut() {
            out.extend(q.pop_front());
        }
    }
    out
}

/// Why a probe of a stored subscription did not pass.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Verify(#[from] VerifyError),
    /// A signing secret or the sealed headers do not open under the configured KEKs.
    #[error("a stored secret or credential does not open: {0}")]
    Sealed(#[from] SecretError),
}

impl ProbeError {
    /// A stable code (the probe's codes, plus `sealed_secret`).
    pub fn code(&self) -> &'static str {
        match self {
            ProbeError::Verify(e) => e.code(),
            ProbeError::Sealed(_) => "sealed_secret",
        }
    }

    /// Whether a later probe can pass without the subscription changing. A secret sealed under a
    /// key this instance lacks can: another instance, further along a rolling key rotation, sealed
    /// it, and this one gets the key when its turn comes (the retry count still ends it).
    pub fn is_retryable(&self) -> bool {
        match self {
            ProbeError::Verify(e) => e.is_retryable(),
            ProbeError::Sealed(SecretError::UnknownKeyId(_)) => true,
            ProbeError::Sealed(_) => false,
        }
    }
}

/// Sends the verification probe ([`crate::delivery::verify::probe`]) to a stored subscription's
/// destination, signed with its live secrets and carrying its custom headers, sealed ones opened.
#[derive(Clone)]
pub struct Prober {
    kek: Arc<Kek>,
    http: reqwest::Client,
    sinks: SinkPolicy,
    clock: SharedClock,
}

impl Prober {
    /// `http` is the delivery client (SSRF-guarded, no redirects).
    pub fn new(
        kek: Arc<Kek>,
        http: reqwest::Client,
        sinks: SinkPolicy,
        clock: SharedClock,
    ) -> Self {
        Prober {
            kek,
            http,
            sinks,
            clock,
        }
    }

    /// Probes `rec`; a pull destination passes without a probe.
    pub async fn probe(&self, rec: &SubscriptionRecord) -> Result<(), ProbeError> {
        if rec.destination.kind == DestinationType::Pull {
            return Ok(());
        }
        // Signed as deliveries are: with every live secret that opens, the others left out; it
        // fails only when none opens.
        let live = self
            .kek
            .open_live_secrets(&rec.signing_secrets, &rec.id, self.clock.now_ms());
        if let (true, Some(e)) = (live.opened.is_empty(), live.first_error) {
            return Err(e.into());
        }
        let secrets = live.opened;
        let mut headers = rec.destination.headers.clone();
        let (sensitive, binding) = open_sensitive_headers(&self.kek, rec)?;
        if self.kek.may_send(binding, &rec.id) {
            headers.extend(sensitive);
        }
        let url = sealed_url::request_url(Some(&self.kek), &rec.id, &rec.destination)?;
        probe(
            &self.http,
            &url,
            &headers,
            &secrets,
            self.sinks.allow_private,
            self.sinks.allow_insecure,
        )
        .await?;
        Ok(())
    }
}

/// Seals a webhook's sensitive headers for subscription `id` and the `url` requests go to as
/// the API does (one JSON object); none → `None`.
pub fn seal_sensitive_headers(
    kek: &Kek,
    id: &str,
    url: &str,
    headers: &BTreeMap<String, String>,
) -> Option<EncryptedBlob> {
    if headers.is_empty() {
        return None;
    }
    let json = serde_json::to_vec(headers).expect("a map of strings always serializes");
    Some(kek.seal_bound(&json, id, url))
}

/// Opens a subscription's sensitive headers (empty when it has none), and how they are bound
/// (sealed for its URL, or before headers were bound to one).
pub fn open_sensitive_headers(
    kek: &Kek,
    rec: &SubscriptionRecord,
) -> Result<(BTreeMap<String, String>, Binding), SecretError> {
    let Some(blob) = &rec.destination.sensitive_headers else {
        return Ok((BTreeMap::new(), Binding::Url));
    };
    let url = sealed_url::request_url(Some(kek), &rec.id, &rec.destination)?;
    let (plain, binding) = kek.open_bound(blob, &rec.id, &url)?;
    let headers = serde_json::from_slice(&plain).map_err(|_| SecretError::Open)?;
    Ok((headers, binding))
}

/// Passes to wait after the `tries`-th failed probe before the next one: 2, 4, 8, 16.
pub fn spacing(tries: u32) -> u64 {
    1u64 << tries.min(16)
}

#[derive(Debug, Clone)]
struct Attempts {
    tries: u32,
    next_pass: u64,
    /// A verdict reached whose write failed, with the record probed (the verdict is about its
    /// destination): written again on the next pass, without a new probe.
    unwritten: Option<(VerificationState, Sub)>,
    /// Where the tries went: a version sent back to another destination (a stale writer's) is
    /// judged on its own, its count started over.
    destination: DestinationRecord,
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PassReport {
    /// Pending webhooks in the table.
    pub pending: usize,
    pub probed: usize,
    /// Verdicts written.
    pub activated: usize,
    pub failed: usize,
}

/// The background task that re-probes pending webhooks (see the module doc).
pub struct PendingRetrier {
    subs: Subscriptions,
    prober: Prober,
    clock: SharedClock,
    pass: u64,
    attempts: HashMap<(String, u64), Attempts>,
    /// The API's lock on this instance's read-modify-writes: a verdict is written under it, so
    /// it cannot take the version a rotation or patch of this instance is writing (and undo it).
    writes: Arc<tokio::sync::Mutex<()>>,
}

impl PendingRetrier {
    pub fn new(subs: Subscriptions, prober: Prober, clock: SharedClock) -> PendingRetrier {
        PendingRetrier {
            subs,
            prober,
            clock,
            pass: 0,
            attempts: HashMap::new(),
            writes: Arc::default(),
        }
    }

    /// Writes under `writes`, the lock the API's handlers take ([`crate::api::ApiState::write_lock`]).
    pub fn with_write_lock(mut self, writes: Arc<tokio::sync::Mutex<()>>) -> PendingRetrier {
        self.writes = writes;
        self
    }

    /// Runs a pass every [`PASS_INTERVAL`] (once the table has caught up) until `stop`.
    pub async fn run(self, stop: Arc<AtomicBool>) {
        self.run_every(PASS_INTERVAL, stop).await
    }

    /// [`PendingRetrier::run`] with another interval (tests).
    #[doc(hidden)]
    pub async fn run_every(mut self, every: Duration, stop: Arc<AtomicBool>) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // the first tick is immediate; start one interval in
        loop {
            tick.tick().await;
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if !self.subs.table().is_caught_up() {
                continue;
            }
            let report = self.run_pass().await;
            if report.probed > 0 {
                tracing::info!(
                    pending = report.pending,
                    probed = report.probed,
                    activated = report.activated,
                    failed = report.failed,
                    "pending verifications retried"
                );
            }
        }
    }

    /// One pass: notice pending webhooks, probe the due ones, write the verdicts.
    pub async fn run_pass(&mut self) -> PassReport {
        self.pass += 1;
        let pass = self.pass;
        // Not one whose latest record this instance cannot read: what it has may be stale (a
        // newer version made it active), and a verdict written onto it would undo the newer one.
        let pending: Vec<Sub> = {
            let table = self.subs.table();
            let table = table.read();
            table
                .iter()
                .filter(|s| {
                    s.destination.kind == DestinationType::Webhook
                        && s.verification_state == VerificationState::Pending
                        && !table.is_unreadable(&s.id)
                })
                .cloned()
                .collect()
        };
        let live: std::collections::HashSet<(&str, u64)> =
            pending.iter().map(|s| (s.id.as_str(), s.version)).collect();
        self.attempts
            .retain(|(id, v), _| live.contains(&(id.as_str(), *v)));
        let mut due = Vec::new();
        for s in &pending {
            let fresh = || Attempts {
                tries: 0,
                next_pass: pass + 1,
                unwritten: None,
                destination: s.destination.clone(),
            };
            let a = self
                .attempts
                .entry((s.id.clone(), s.version))
                .or_insert_with(fresh);
            if a.destination != s.destination {
                *a = fresh();
            }
            if a.next_pass <= pass {
                due.push(s.clone());
            }
        }
        let mut report = PassReport {
            pending: pending.len(),
            ..PassReport::default()
        };
        // Verdicts reached before whose write failed: written now, the endpoint not probed
        // again (it was probed every pass while the control topic refused writes, and a later
        // probe could turn a `failed` into `active` past the attempts' limit).
        let (unwritten, due): (Vec<Sub>, Vec<Sub>) = due.into_iter().partition(|s| {
            self.attempts
                .get(&(s.id.clone(), s.version))
                .is_some_and(|a| a.unwritten.is_some())
        });
        for sub in unwritten {
            let key = (sub.id.clone(), sub.version);
            let Some((state, probed)) = self.attempts.get(&key).and_then(|a| a.unwritten.clone())
            else {
                continue;
            };
            // Onto the record probed, not the one in the table now: `record` writes only while
            // they send to the same place.
            self.write_verdict(&probed, state, pass, &mut report).await;
        }
        let due = fair_share(due, |s| {
            self.attempts
                .get(&(s.id.clone(), s.version))
                .map_or(0, |a| a.tries)
        });
        // Each verdict is written as its probe ends, while the others go on: waiting for every
        // probe of the pass held a passing endpoint's verdict (and its subscription's matching)
        // behind every slow one, up to the HTTP timeout per 16 of them.
        let (done, mut ended) = tokio::sync::mpsc::unbounded_channel();
        let prober = self.prober.clone();
        let probing = AbortOnDrop(tokio::spawn(async move {
            futures::stream::iter(due)
                .map(|s| {
                    let prober = prober.clone();
                    async move {
                        let r = prober.probe(&s).await;
                        (s, r)
                    }
                })
                .buffer_unordered(PROBES_AT_ONCE)
                .for_each(|ended| {
                    let _ = done.send(ended);
                    async {}
                })
                .await;
        }));
        while let Some((sub, result)) = ended.recv().await {
            report.probed += 1;
            let key = (sub.id.clone(), sub.version);
            let Some(a) = self.attempts.get_mut(&key) else {
                continue;
            };
            a.tries += 1;
            let tries = a.tries;
            let verdict = match &result {
                Ok(()) => Some(VerificationState::Active),
                Err(e) if !e.is_retryable() || tries >= MAX_ATTEMPTS => {
                    Some(VerificationState::Failed)
                }
                Err(_) => {
                    a.next_pass = pass + spacing(tries);
                    None
                }
            };
            RetryAttempt {
                sub: &sub,
                tries,
                result: &result,
                verdict,
            }
            .emit();
            let Some(state) = verdict else { continue };
            self.write_verdict(&sub, state, pass, &mut report).await;
        }
        drop(probing);
        report
    }

    /// Writes a verdict reached on `sub` (the record probed); one not written is kept to be
    /// written again later.
    async fn write_verdict(
        &mut self,
        sub: &Sub,
        state: VerificationState,
        pass: u64,
        report: &mut PassReport,
    ) {
        let key = (sub.id.clone(), sub.version);
        let written = self.record(sub, state).await;
        if written.is_ok() {
            // Written, or no longer the record to write it onto (the version was judged anew):
            // probes resume for whatever is pending now.
            if let Some(a) = self.attempts.get_mut(&key) {
                a.unwritten = None;
            }
        }
        match written {
            Ok(true) if state == VerificationState::Active => report.activated += 1,
            Ok(true) => report.failed += 1,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(subscription_id = %sub.id, error = %e, "verification verdict not written; writing it again later");
                // Next pass: a write costs the endpoint nothing, and the subscription's
                // deliveries are held while it stays pending.
                if let Some(a) = self.attempts.get_mut(&key) {
                    a.unwritten = Some((state, sub.clone()));
                    a.next_pass = pass + 1;
                }
            }
        }
    }

    /// Writes `state` onto `probed` if that version is still the latest, still pending, and
    /// still sends where the probe went (versions follow the control topic's order, which a
    /// writer that planned from a stale table can send back to a number already used: the
    /// destination is what the verdict is about).
    async fn record(
        &self,
        probed: &SubscriptionRecord,
        state: VerificationState,
    ) -> Result<bool, RepoError> {
        // First this instance reads the control topic to its end, as the API does before it
        // writes: a change another instance acknowledged while the probe ran (a rotated secret,
        // a PATCH) is then the latest here, and the verdict is not written onto the version
        // before it. The table takes records in the log's order, so that write would have come
        // last and undone the change on every instance. Not caught up: written on a later pass.
        if let Err(e) = self.subs.sync(VERDICT_SYNC_WAIT).await {
            return Err(RepoError::Write(format!(
                "not attempted, this instance's table is behind: {e}"
            )));
        }
        let guard = self.writes.clone().lock_owned().await;
        let Some(latest) = self.subs.get(&probed.id) else {
            return Ok(false);
        };
        if self.subs.table().read().is_unreadable(&probed.id) {
            return Ok(false); // its latest record became unreadable while the probe ran
        }
        if latest.version != probed.version
            || latest.verification_state != VerificationState::Pending
            || latest.destination != probed.destination
        {
            return Ok(false);
        }
        let mut next = (*latest).clone();
        next.verification_state = state;
        next.version += 1;
        next.updated_at = self.clock.now_ms();
        match self.subs.put_holding(next, guard).await {
            // The broker has it (this instance's table too): written.
            Ok(()) | Err(RepoError::NotSeen(_)) => Ok(true),
            Err(e) => Err(e),
        }
    }
}

/// One retried probe: logged with its outcome (never the URL or a header).
struct RetryAttempt<'a> {
    sub: &'a SubscriptionRecord,
    tries: u32,
    result: &'a Result<(), ProbeError>,
    verdict: Option<VerificationState>,
}

impl RetryAttempt<'_> {
    fn emit(&self) {
        let (id, version, tries) = (&self.sub.id, self.sub.version, self.tries);
        match (self.result, self.verdict) {
            (Ok(()), _) => {
                tracing::info!(subscription_id = %id, version, tries, "pending subscription passed verification")
            }
            (Err(e), Some(_)) => {
                tracing::warn!(subscription_id = %id, version, tries, code = e.code(), error = %e, "pending subscription failed verification for good")
            }
            (Err(e), None) => {
                tracing::info!(subscription_id = %id, version, tries, code = e.code(), error = %e, "pending subscription probe failed; will retry")
            }
        }
    }
}

/// Probes of a pass whose run was dropped (the retrier stopping) end with it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use base64::Engine;

    use super::*;
    use crate::config::Config;
    use crate::runtime::avro::Codec;
    use crate::runtime::clock::ManualClock;
    use crate::subscriptions::secrets::generate_signing_secret;

    /// A local endpoint that answers 500 to its first `fail_first` probes and echoes after.
    async fn endpoint(fail_first: usize) -> (String, Arc<AtomicUsize>) {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let app = Router::new().route(
            "/hook",
            post(move |body: String| {
                let h = h.clone();
                async move {
                    if h.fetch_add(1, Ordering::SeqCst) < fail_first {
                        (StatusCode::INTERNAL_SERVER_ERROR, String::new())
                    } else {
                        (StatusCode::OK, body)
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (format!("http://{addr}/hook"), hits)
    }

    fn retrier(open: bool) -> (PendingRetrier, Subscriptions, Arc<Kek>) {
        let kek = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        let vars = [
            ("STREAMING_HUB_KEK", kek),
            ("STREAMING_HUB_ALLOW_PRIVATE_SINKS", open.to_string()),
            ("STREAMING_HUB_ALLOW_INSECURE_SINKS", open.to_string()),
            ("STREAMING_HUB_HTTP_TIMEOUT", "3s".to_string()),
        ];
        let config = Config::from_vars(vars.map(|(k, v)| (k.to_string(), v))).unwrap();
        let kek = Arc::new(Kek::from_config(&config).unwrap());
        let clock: SharedClock = Arc::new(ManualClock::new(1_750_000_000_000));
        let http = crate::delivery::client::build_client(&config).unwrap();
        let sinks = SinkPolicy {
            allow_private: open,
            allow_insecure: open,
        };
        let subs = Subscriptions::in_memory(Arc::new(Codec::new().unwrap()));
        let prober = Prober::new(kek.clone(), http, sinks, clock.clone());
        (PendingRetrier::new(subs.clone(), prober, clock), subs, kek)
    }

    fn pending_webhook(kek: &Kek, url: &str) -> SubscriptionRecord {
        let id = uuid::Uuid::now_v7().to_string();
        let sensitive = BTreeMap::from([("x-api-key".to_string(), "k".to_string())]);
        SubscriptionRecord {
            signing_secrets: vec![kek.seal_secret(&generate_signing_secret(), &id, None)],
            destination: DestinationRecord {
                kind: DestinationType::Webhook,
                url: Some(url.to_string()),
                headers: Default::default(),
                sensitive_headers: seal_sensitive_headers(kek, &id, url, &sensitive),
                sealed_target: None,
            },
            id,
            tenant_id: "t1".into(),
            origin: None,
            event_types: vec!["*".into()],
            schema_major: None,
            enabled: true,
            verification_state: VerificationState::Pending,
            retry_schedule: None,
            disabled_reason: None,
            disabled_at: None,
            created_at: 0,
            updated_at: 0,
            version: 1,
        }
    }

    /// Runs passes until `done`, returning the passes on which the endpoint was probed.
    async fn passes_until(
        r: &mut PendingRetrier,
        hits: &AtomicUsize,
        done: impl Fn(&PassReport) -> bool,
    ) -> Vec<u64> {
        let mut probed_on = Vec::new();
        for _ in 0..64 {
            let before = hits.load(Ordering::SeqCst);
            let report = r.run_pass().await;
            if hits.load(Ordering::SeqCst) > before {
                probed_on.push(r.pass);
            }
            if done(&report) {
                return probed_on;
            }
        }
        panic!("not done within 64 passes; probed on {probed_on:?}");
    }

    #[test]
    fn spacing_doubles_after_each_failure() {
        assert_eq!((1..=4).map(spacing).collect::<Vec<_>>(), [2, 4, 8, 16]);
    }

    /// A verdict is about a destination: one probed at URL A is not written onto a record of the
    /// same version that sends to URL B (a stale writer sent the version number back, then a
    /// PATCH reached it again with another URL).
    #[tokio::test]
    async fn a_verdict_is_not_written_onto_the_same_version_at_another_url() {
        let (r, subs, kek) = retrier(true);
        let probed = pending_webhook(&kek, "http://127.0.0.1:9/a");
        subs.put(probed.clone()).await.unwrap();
        let mut other = probed.clone();
        other.destination.url = Some("http://127.0.0.1:9/b".into());
        subs.table()
            .apply(|t| t.read_record(&other.id, Some(other.clone()), 0, 1));
        assert_eq!(subs.get(&probed.id).unwrap().version, probed.version);
        let written = r.record(&probed, VerificationState::Active).await.unwrap();
        assert!(!written);
        let now = subs.get(&probed.id).unwrap();
        assert_eq!(now.verification_state, VerificationState::Pending);
        // At the URL it probed, it is written.
        subs.table()
            .apply(|t| t.read_record(&probed.id, Some(probed.clone()), 0, 2));
        assert!(r.record(&probed, VerificationState::Active).await.unwrap());
    }

    /// A subscription whose latest control record this instance cannot read (a newer version
    /// of the hub wrote it, maybe active by now) is neither probed nor written over.
    #[tokio::test]
    async fn a_pending_webhook_whose_latest_record_is_unreadable_is_left_alone() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(usize::MAX).await;
        let sub = pending_webhook(&kek, &url);
        subs.put(sub.clone()).await.unwrap();
        subs.table()
            .apply(|t| t.read_unreadable(&sub.id, 0, 1_000_000));
        for _ in 0..40 {
            r.run_pass().await;
        }
        assert_eq!(hits.load(Ordering::SeqCst), 0, "probed");
        assert_eq!(subs.get(&sub.id).unwrap().version, sub.version, "written");
        // A verdict of a probe that was under way when the record turned unreadable.
        assert!(!r.record(&sub, VerificationState::Failed).await.unwrap());
        assert_eq!(
            subs.get(&sub.id).unwrap().verification_state,
            VerificationState::Pending
        );
    }

    #[tokio::test]
    async fn pending_webhook_fails_after_five_probes_with_growing_spacing() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(usize::MAX).await;
        let sub = pending_webhook(&kek, &url);
        subs.put(sub.clone()).await.unwrap();
        let probed_on = passes_until(&mut r, &hits, |rep| rep.failed == 1).await;
        assert_eq!(probed_on, [2, 4, 8, 16, 32], "noticed on pass 1");
        let now = subs.get(&sub.id).unwrap();
        assert_eq!(now.verification_state, VerificationState::Failed);
        assert_eq!(now.version, 2);
        assert_eq!(now.signing_secrets, sub.signing_secrets, "secrets kept");
        let before = hits.load(Ordering::SeqCst);
        for _ in 0..40 {
            r.run_pass().await;
        }
        assert_eq!(hits.load(Ordering::SeqCst), before, "failed is not retried");
    }

    /// The same version sent back to another destination (a stale writer's) is judged on its
    /// own: its count starts over, not at the tries the first destination spent.
    #[tokio::test]
    async fn the_same_version_at_another_url_gets_its_own_count_of_probes() {
        let (mut r, subs, kek) = retrier(true);
        let (url_a, hits_a) = endpoint(usize::MAX).await;
        let sub = pending_webhook(&kek, &url_a);
        subs.put(sub.clone()).await.unwrap();
        while hits_a.load(Ordering::SeqCst) < 4 {
            r.run_pass().await;
        }
        let (url_b, hits_b) = endpoint(usize::MAX).await;
        let mut moved = subs.get(&sub.id).unwrap().as_ref().clone();
        let sensitive = BTreeMap::from([("x-api-key".to_string(), "k".to_string())]);
        moved.destination.url = Some(url_b.clone());
        moved.destination.sensitive_headers =
            seal_sensitive_headers(&kek, &moved.id, &url_b, &sensitive);
        subs.table().apply(|t| t.upsert(moved));
        passes_until(&mut r, &hits_b, |rep| rep.failed == 1).await;
        assert_eq!(hits_a.load(Ordering::SeqCst), 4);
        assert_eq!(hits_b.load(Ordering::SeqCst), MAX_ATTEMPTS as usize);
    }

    /// A retrier whose writes fail while the returned flag is set (set now), and a pending
    /// webhook in its table whose endpoint passes (its probes counted).
    async fn unwritable_with_a_passing_endpoint() -> (
        PendingRetrier,
        Subscriptions,
        Arc<AtomicBool>,
        SubscriptionRecord,
        Arc<AtomicUsize>,
    ) {
        let (r, _, kek) = retrier(true);
        let failing = Arc::new(AtomicBool::new(true));
        let subs = Subscriptions::failing(Arc::new(Codec::new().unwrap()), failing.clone());
        let r = PendingRetrier::new(subs.clone(), r.prober, r.clock);
        let (url, hits) = endpoint(0).await;
        let sub = pending_webhook(&kek, &url);
        subs.table().apply(|t| t.upsert(sub.clone()));
        (r, subs, failing, sub, hits)
    }

    /// While the control topic refuses writes, a verdict reached is written again on later
    /// passes; the endpoint is not probed again (it was, every pass).
    #[tokio::test]
    async fn a_verdict_not_written_is_written_again_without_another_probe() {
        let (mut r, subs, failing, sub, hits) = unwritable_with_a_passing_endpoint().await;
        for _ in 0..8 {
            r.run_pass().await;
        }
        assert_eq!(hits.load(Ordering::SeqCst), 1, "probed once");
        assert_eq!(
            subs.get(&sub.id).unwrap().verification_state,
            VerificationState::Pending,
            "not written yet"
        );
        failing.store(false, Ordering::SeqCst);
        let mut activated = 0;
        for _ in 0..16 {
            activated += r.run_pass().await.activated;
        }
        assert_eq!(activated, 1);
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "written without another probe"
        );
        let now = subs.get(&sub.id).unwrap();
        assert_eq!(
            (now.verification_state, now.version),
            (VerificationState::Active, 2)
        );
    }

    /// A verdict kept unwritten is about the destination probed: once another writer has put
    /// another URL under the same version, it is not written onto that one.
    #[tokio::test]
    async fn a_verdict_kept_unwritten_is_not_written_onto_another_url() {
        let (mut r, subs, failing, sub, hits) = unwritable_with_a_passing_endpoint().await;
        r.run_pass().await;
        r.run_pass().await;
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "probed, verdict not written"
        );
        // Another writer's record of the same version, at a URL nobody answers.
        let mut moved = sub.clone();
        moved.destination.url = Some("http://127.0.0.1:9/elsewhere".into());
        subs.table().apply(|t| t.upsert(moved.clone()));
        failing.store(false, Ordering::SeqCst);
        for _ in 0..4 {
            r.run_pass().await;
        }
        // Judged on its own probe (which fails) if at all, never activated by A's.
        let now = subs.get(&sub.id).unwrap();
        assert_eq!(now.destination.url, moved.destination.url);
        assert_ne!(now.verification_state, VerificationState::Active);
    }

    /// A passing endpoint's verdict is written as its probe ends, not after the pass's slow
    /// ones: 8 webhooks whose host takes the connection and never answers (each probe runs to
    /// the 3 s timeout) hold no verdict back. Before, every verdict waited for every probe.
    #[tokio::test]
    async fn a_verdict_is_written_as_its_probe_ends_not_after_the_slow_ones() {
        let (mut r, subs, kek) = retrier(true);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent = format!("http://{}/hook", listener.local_addr().unwrap());
        let ended = Arc::new(AtomicUsize::new(0));
        let e = ended.clone();
        tokio::spawn(async move {
            loop {
                let (mut conn, _) = listener.accept().await.unwrap();
                let e = e.clone();
                tokio::spawn(async move {
                    use tokio::io::AsyncReadExt;
                    let mut buf = [0u8; 4096];
                    while conn.read(&mut buf).await.is_ok_and(|n| n > 0) {}
                    e.fetch_add(1, Ordering::SeqCst); // the prober gave up on it
                });
            }
        });
        for _ in 0..8 {
            subs.put(pending_webhook(&kek, &silent)).await.unwrap();
        }
        let (url, _) = endpoint(0).await;
        let good = pending_webhook(&kek, &url);
        subs.put(good.clone()).await.unwrap();
        r.run_pass().await; // notices them; the next pass probes
        let watch = async {
            for _ in 0..600 {
                if subs.get(&good.id).unwrap().verification_state == VerificationState::Active {
                    return ended.load(Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("the passing endpoint's verdict was never written");
        };
        let (report, ended_before) = tokio::join!(r.run_pass(), watch);
        assert_eq!(ended_before, 0, "written only after the slow probes ended");
        assert_eq!((report.probed, report.activated), (9, 1));
    }

    /// A tenant with more due probes than its share gets its share this pass and the rest the
    /// next (no try counted for them); another tenant's is probed in the same pass, among the
    /// first ones started.
    #[tokio::test]
    async fn a_pass_probes_each_tenant_up_to_its_share_in_turn() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(usize::MAX).await; // answers 500: each stays pending
        let extra = 4;
        for _ in 0..TENANT_PROBES_PER_PASS + extra {
            subs.put(pending_webhook(&kek, &url)).await.unwrap();
        }
        let mut quiet = pending_webhook(&kek, &url);
        quiet.tenant_id = "t2".into();
        subs.put(quiet.clone()).await.unwrap();
        r.run_pass().await; // notices them; the next pass probes
        let report = r.run_pass().await;
        assert_eq!(report.probed, TENANT_PROBES_PER_PASS + 1);
        assert_eq!(hits.load(Ordering::SeqCst), TENANT_PROBES_PER_PASS + 1);
        assert_eq!(r.attempts[&(quiet.id.clone(), quiet.version)].tries, 1);
        // The rest of the first tenant's, next pass (the probed ones wait their spacing).
        let report = r.run_pass().await;
        assert_eq!(report.probed, extra);
        // The order: tenants in turn, the least tried first within one (a1 tried twice).
        let order = fair_share(
            ["a1", "a2", "a3", "b1"]
                .iter()
                .map(|id| {
                    let mut s = pending_webhook(&kek, &url);
                    (s.id, s.tenant_id) = (id.to_string(), id[..1].to_string());
                    Arc::new(s)
                })
                .collect(),
            |s| u32::from(s.id == "a1") * 2,
        );
        let ids: Vec<&str> = order.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["a2", "b1", "a3", "a1"]);
    }

    #[tokio::test]
    async fn pending_webhook_whose_endpoint_comes_up_becomes_active() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(2).await;
        let sub = pending_webhook(&kek, &url);
        subs.put(sub.clone()).await.unwrap();
        let probed_on = passes_until(&mut r, &hits, |rep| rep.activated == 1).await;
        assert_eq!(probed_on, [2, 4, 8]);
        let now = subs.get(&sub.id).unwrap();
        assert_eq!(now.verification_state, VerificationState::Active);
        assert_eq!(now.version, 2);
    }

    #[tokio::test]
    async fn a_new_version_starts_the_count_over() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(usize::MAX).await;
        let sub = pending_webhook(&kek, &url);
        subs.put(sub.clone()).await.unwrap();
        passes_until(&mut r, &hits, |_| hits.load(Ordering::SeqCst) == 4).await;
        let mut v2 = (*subs.get(&sub.id).unwrap()).clone();
        v2.version = 2;
        v2.event_types = vec!["a.b".into()];
        subs.put(v2).await.unwrap();
        let probed_on = passes_until(&mut r, &hits, |rep| rep.failed == 1).await;
        assert_eq!(probed_on.len(), MAX_ATTEMPTS as usize, "{probed_on:?}");
        assert_eq!(hits.load(Ordering::SeqCst), 4 + MAX_ATTEMPTS as usize);
        assert_eq!(subs.get(&sub.id).unwrap().version, 3);
    }

    /// A secret sealed under a key of another instance, further along a rolling key rotation.
    fn sealed_elsewhere(sub: &SubscriptionRecord) -> crate::runtime::records::EncryptedSecret {
        let key = base64::engine::general_purpose::STANDARD.encode([9u8; 32]);
        Kek::new("k-next", &key)
            .unwrap()
            .seal_secret(&generate_signing_secret(), &sub.id, None)
    }

    /// A pending webhook whose secret this instance cannot open (sealed under a key it lacks) is
    /// retried like an unreachable endpoint, not failed for the whole cluster on the first pass:
    /// the instance may get the key, and another may probe it meanwhile. Nothing is sent.
    #[tokio::test]
    async fn a_secret_under_a_key_this_instance_lacks_is_retried_not_failed_at_once() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(0).await;
        let mut sub = pending_webhook(&kek, &url);
        sub.signing_secrets = vec![sealed_elsewhere(&sub)];
        subs.put(sub.clone()).await.unwrap();
        let mut tries = Vec::new();
        for pass in 1..=64 {
            let report = r.run_pass().await;
            if report.probed > 0 {
                tries.push(pass);
            }
            if report.failed == 1 {
                break;
            }
            assert_eq!(
                subs.get(&sub.id).unwrap().verification_state,
                VerificationState::Pending,
                "pass {pass}"
            );
        }
        assert_eq!(tries, [2, 4, 8, 16, 32], "retried on the usual spacing");
        assert_eq!(hits.load(Ordering::SeqCst), 0, "nothing sent unsigned");
    }

    /// A webhook with a secret that opens and one that does not is probed, signed with the one
    /// that opens, as its deliveries are.
    #[tokio::test]
    async fn a_probe_is_signed_with_the_secrets_that_open() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(0).await;
        let mut sub = pending_webhook(&kek, &url);
        sub.signing_secrets.push(sealed_elsewhere(&sub));
        subs.put(sub.clone()).await.unwrap();
        passes_until(&mut r, &hits, |rep| rep.activated == 1).await;
        assert_eq!(
            subs.get(&sub.id).unwrap().verification_state,
            VerificationState::Active
        );
    }

    #[tokio::test]
    async fn a_refused_url_fails_at_once() {
        let (mut r, subs, kek) = retrier(false); // http://127.0.0.1 is refused by the policy
        let sub = pending_webhook(&kek, "http://127.0.0.1:9/hook");
        subs.put(sub.clone()).await.unwrap();
        assert_eq!(r.run_pass().await.probed, 0, "noticed, not yet due");
        let report = r.run_pass().await;
        assert_eq!((report.probed, report.failed), (1, 1));
        assert_eq!(
            subs.get(&sub.id).unwrap().verification_state,
            VerificationState::Failed
        );
    }

    #[tokio::test]
    async fn active_pull_and_disabled_states_are_left_alone() {
        let (mut r, subs, kek) = retrier(true);
        let (url, hits) = endpoint(0).await;
        let mut active = pending_webhook(&kek, &url);
        active.verification_state = VerificationState::Active;
        let mut failed = pending_webhook(&kek, &url);
        failed.verification_state = VerificationState::Failed;
        subs.put(active).await.unwrap();
        subs.put(failed).await.unwrap();
        for _ in 0..8 {
            assert_eq!(r.run_pass().await, PassReport::default());
        }
        assert_eq!(hits.load(Ordering::SeqCst), 0);
    }
}
