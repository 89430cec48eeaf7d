//! `streaming-hub subscriptions apply -f file.json`: subscriptions as code (GitOps).
//!
//! The file is a JSON array; each entry is the desired state of one subscription: a stable `id`
//! (a UUID the author picks, so the next apply finds the subscription again), its `tenant_id`, and
//! the fields of `POST /v1/subscriptions` (`origin`, `event_types`, `schema_major`, `destination`,
//! `retry_schedule`, `enabled`). Unknown fields are refused, as in the API.
//!
//! ```json
//! [{"id": "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1c", "tenant_id": "acme",
//!   "event_types": ["transaction.*"],
//!   "destination": {"type": "webhook", "url": "https://hooks.acme.example/ledger"}}]
//! ```
//!
//! Steps:
//! 1. every entry passes the API's rules ([`CreateSubscription::validate`] under the deployment's
//!    sink policy, the API's tenant id rule); on any error each bad entry is reported by its index
//!    (from 0) and field, and nothing is written;
//! 2. the control topic is read to its end into a table ([`control::follow`], which keeps
//!    following, so each write below is read back before the next: read-your-writes);
//! 3. each entry is compared with the table ([`plan`]):
//!    - an unknown id is created at version 1; a webhook gets the entry's `signing_secret`, or
//!      a new one, sealed under the KEK; a new one (never the entry's: the file has it, and
//!      stdout often goes to CI logs) is printed once on stdout as
//!      `{"id":…,"signing_secret":"whsec_…"}`, also when the write fails (it may have landed: the
//!      last secret printed for an id is the one in force);
//!    - a known id gets the entry's fields, keeps its secrets (an entry's `signing_secret` is
//!      for its creation only, so the file can keep it; rotate to change it) and goes to
//!      version + 1, unless
//!      nothing changes (`unchanged <id>`, no write). Its tenant and destination type cannot
//!      change (an error, as in the API's PATCH). An absent `enabled` leaves `enabled` as it is
//!      (an auto-disabled subscription stays disabled); `true` re-enables and clears
//!      `disabled_reason`/`disabled_at`;
//! 4. a new webhook, or a webhook whose URL changes, is probed ([`Prober`]) before its write and
//!    written `active` when the probe passes, `pending` otherwise (the hub's
//!    [`PendingRetrier`](super::pending::PendingRetrier) keeps trying); except that a new URL
//!    for an `active` webhook that fails its probe is not written at all (exit 1 too): written
//!    `pending`, the subscription would match none of its events until a probe passed, and
//!    they would be lost, as the API's PATCH has it. Writes go through
//!    [`Subscriptions::put`], in file order.
//!
//! Stdout, one line per entry (plus a webhook's secret line before its `created` line):
//! `created <id> v1 active|pending[ <code>: <why>]`, `updated <id> v<N> <state>[ <code>: <why>]`,
//! `unverified <id>: the new URL's probe failed, <code>: <why>; not written, …`,
//! `unchanged <id>`. A summary and any error go to stderr. Exit codes are in [`exit`].
//!
//! Concurrency: like the API, apply reads version N and writes N + 1; another writer of the same
//! subscription at the same time (the API of any instance) races it, and the control topic keeps
//! the last write. Apply itself is idempotent: a second run of the same file writes nothing.
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde_json::Value;

use super::control::{self, RepoError, Subscriptions};
use super::model::{
    CreateSubscription, FieldError, SinkPolicy, ValidCreate, ValidDestination, refuse_redacted,
};
use super::pending::{ProbeError, Prober, open_sensitive_headers, seal_sensitive_headers};
use super::sealed_url;
use super::secrets::{Binding, Kek, SecretError, generate_signing_secret};
use super::table::{SharedTable, Table};
use crate::api::extract::without_string_value;
use crate::config::Config;
use crate::runtime::avro::Codec;
use crate::runtime::clock::{Clock, SharedClock, SystemClock};
use crate::runtime::kafka;
use crate::runtime::records::{
    DestinationRecord, DestinationType, SubscriptionRecord, VerificationState,
};
use crate::runtime::secret::Secret;

/// The command's exit codes.
pub mod exit {
    /// Every entry applied (created, updated or unchanged) and every probed webhook is active.
    pub const APPLIED: u8 = 0;
    /// Some webhook failed its verification probe: written `pending`, or, a new URL of an
    /// `active` one, not written (its current URL stays). The other entries were applied.
    pub const UNVERIFIED: u8 = 1;
    /// The file or the configuration is invalid; nothing was written.
    pub const INVALID: u8 = 2;
    /// The control topic could not be read or written; the lines printed were written, the rest
    /// not. Running again is safe.
    pub const UNAVAILABLE: u8 = 3;
    /// Some subscription was changed by another writer (the API, another apply) between this
    /// run's plan and its write: that entry was not written (the others were). Run it again.
    pub const CONFLICT: u8 = 4;
}

/// How long reading the control topic to its end may take.
const CATCH_UP: Duration = Duration::from_secs(60);
/// Verification probes in flight at once.
const PROBES_AT_ONCE: usize = 8;

/// One entry at fault: its index in the file (from 0) and the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryError {
    pub index: usize,
    pub error: FieldError,
}

impl std::fmt::Display for EntryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = &self.error;
        if e.field.is_empty() {
            write!(f, "entry {}: {} ({})", self.index, e.message, e.code)
        } else {
            write!(
                f,
                "entry {}, field {}: {} ({})",
                self.index, e.field, e.message, e.code
            )
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("{0}")]
    File(String),
    #[error("{} invalid entries; nothing was written", .0.len())]
    Invalid(Vec<EntryError>),
    #[error("STREAMING_HUB_KEK: {0}")]
    Kek(String),
    #[error("{0}")]
    Unavailable(String),
    #[error(
        "subscription {id}: neither its stored credentials nor its signing secrets open ({error}); check STREAMING_HUB_KEK and STREAMING_HUB_KEK_PREVIOUS"
    )]
    Sealed { id: String, error: SecretError },
    #[error("subscription {id}: {error}")]
    Write { id: String, error: RepoError },
}

impl ApplyError {
    pub fn exit_code(&self) -> u8 {
        match self {
            ApplyError::File(_)
            | ApplyError::Invalid(_)
            | ApplyError::Kek(_)
            | ApplyError::Sealed { .. } => exit::INVALID,
            ApplyError::Unavailable(_) | ApplyError::Write { .. } => exit::UNAVAILABLE,
        }
    }
}

/// An entry that passed every rule: the desired state of one subscription.
pub struct Desired {
    pub index: usize,
    /// Canonical form (lower-case, hyphenated).
    pub id: String,
    pub tenant_id: String,
    /// As written: `None` when absent.
    pub enabled: Option<bool>,
    pub spec: ValidCreate,
}

/// Parses the file and checks every entry (step 1 of the module doc).
pub async fn read_entries(text: &str, policy: SinkPolicy) -> Result<Vec<Desired>, ApplyError> {
    let values: Vec<Value> = serde_json::from_str(text).map_err(|e| {
        ApplyError::File(format!(
            "expected a JSON array of subscription definitions: {e}"
        ))
    })?;
    let mut errors = Vec::new();
    let mut out = Vec::new();
    let mut ids = HashSet::new();
    // A JSON value keeps the last of a repeated key (a merge conflict's two `url`s): refused as
    // the API refuses it, naming the field, rather than applied with whichever came last.
    let repeated = repeated_keys(text);
    for (index, value) in values.into_iter().enumerate() {
        if let Some(field) = repeated.iter().find(|(i, _)| *i == index).map(|(_, f)| f) {
            errors.push(EntryError {
                index,
                error: FieldError::new(field, "duplicate", "this field is given twice"),
            });
            continue;
        }
        match entry(index, value, policy).await {
            Ok(d) if !ids.insert(d.id.clone()) => errors.push(EntryError {
                index,
                error: FieldError::new("id", "duplicate", "an earlier entry has this id"),
            }),
            Ok(d) => out.push(d),
            Err(error) => errors.push(EntryError { index, error }),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(ApplyError::Invalid(errors))
    }
}

/// The first key each entry of the JSON array `text` repeats in one of its objects, as the
/// entry's index and the field's path (`destination.url`, `destination.headers.x-a`).
fn repeated_keys(text: &str) -> Vec<(usize, String)> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

    /// Walks a value, noting under `path` the first repeated key of each entry.
    struct Walk<'a> {
        path: &'a mut Vec<String>,
        found: &'a mut Vec<(usize, String)>,
    }

    impl<'de> DeserializeSeed<'de> for Walk<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Walk<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let Walk { path, found } = self;
            let mut i = 0usize;
            loop {
                path.push(format!("[{i}]"));
                let more = seq.next_element_seed(Walk {
                    path: &mut *path,
                    found: &mut *found,
                })?;
                path.pop();
                if more.is_none() {
                    return Ok(());
                }
                i += 1;
            }
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let Walk { path, found } = self;
            let mut seen = HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                let entry = path.first().and_then(|p| {
                    p.strip_prefix('[')?
                        .strip_suffix(']')?
                        .parse::<usize>()
                        .ok()
                });
                if let Some(entry) = entry
                    && !seen.insert(key.clone())
                    && !found.iter().any(|(i, _)| *i == entry)
                {
                    let mut field = String::new();
                    for p in &path[1..] {
                        if !field.is_empty() && !p.starts_with('[') {
                            field.push('.');
                        }
                        field.push_str(p);
                    }
                    if !field.is_empty() {
                        field.push('.');
                    }
                    field.push_str(&key);
                    found.push((entry, field));
                }
                path.push(key);
                map.next_value_seed(Walk {
                    path: &mut *path,
                    found: &mut *found,
                })?;
                path.pop();
            }
            Ok(())
        }
    }

    let mut found = Vec::new();
    let mut de = serde_json::Deserializer::from_str(text);
    let _ = Walk {
        path: &mut Vec::new(),
        found: &mut found,
    }
    .deserialize(&mut de);
    found
}

async fn entry(index: usize, value: Value, policy: SinkPolicy) -> Result<Desired, FieldError> {
    let Value::Object(mut map) = value else {
        return Err(FieldError::new("", "invalid", "an entry is a JSON object"));
    };
    let id = match map.remove("id") {
        None => Err(FieldError::new(
            "id",
            "required",
            "each entry has a stable id (a UUID)",
        )),
        Some(Value::String(s)) => uuid::Uuid::parse_str(&s)
            .ok()
            .filter(|u| !u.is_nil())
            .map(|u| u.to_string())
            .ok_or_else(|| {
                FieldError::new(
                    "id",
                    "invalid",
                    "expected a UUID such as 0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1c",
                )
            }),
        Some(_) => Err(FieldError::new("id", "invalid", "id is a string (a UUID)")),
    }?;
    let body: CreateSubscription = serde_path_to_error::deserialize(Value::Object(map))
        .map_err(|e| serde_field_error(&e.path().to_string(), e.inner()))?;
    let tenant_id = body
        .tenant_id
        .clone()
        .ok_or_else(|| FieldError::new("tenant_id", "required", "each entry names its tenant"))?;
    if !crate::api::auth::valid_tenant(&tenant_id) {
        return Err(FieldError::new(
            "tenant_id",
            "invalid",
            format!("tenant_id must be {}", crate::ingest::tenant::TENANT_RULE),
        ));
    }
    let enabled = body.enabled;
    let spec = body.validate(policy).await?;
    Ok(Desired {
        index,
        id,
        tenant_id,
        enabled,
        spec,
    })
}

/// Names the field of a serde error the way the API's body parser does: the path to it, plus the
/// field serde names for an unknown or missing one (serde puts that in the message).
fn serde_field_error(path: &str, inner: &serde_json::Error) -> FieldError {
    let message = without_string_value(&inner.to_string());
    let named = |prefix: &str| {
        let rest = message.strip_prefix(prefix)?;
        let name = rest.strip_prefix('`')?.split('`').next()?;
        Some(name.to_string())
    };
    let join = |name: String| {
        if path == name || path.ends_with(&format!(".{name}")) {
            path.to_string()
        } else if path.is_empty() || path == "." {
            name
        } else {
            format!("{path}.{name}")
        }
    };
    let path = if path == "." { "" } else { path };
    match (named("unknown field "), named("missing field ")) {
        (Some(name), _) => FieldError::new(join(name), "unknown_field", message),
        (None, Some(name)) => FieldError::new(join(name), "required", message),
        (None, None) => FieldError::new(path, "invalid", message),
    }
}

/// What apply does with one entry.
pub enum Step {
    /// `secret` is the plaintext of a new webhook's signing secret (printed once, after the
    /// write, when `generated`: one the entry gave is not printed).
    Create {
        rec: SubscriptionRecord,
        secret: Option<Secret>,
        generated: bool,
    },
    Update {
        rec: SubscriptionRecord,
        url_changed: bool,
        /// The record it was planned from: written only if the table still holds it.
        base: Box<SubscriptionRecord>,
    },
    Unchanged {
        id: String,
    },
}

impl Step {
    /// The record to probe before the write, if any: a new webhook or a new URL.
    fn to_probe(&self) -> Option<&SubscriptionRecord> {
        match self {
            Step::Create { rec, .. } if rec.destination.kind == DestinationType::Webhook => {
                Some(rec)
            }
            Step::Update {
                rec,
                url_changed: true,
                ..
            } => Some(rec),
            _ => None,
        }
    }
}

/// Compares each desired subscription with the table (step 3 of the module doc). Entries that
/// would change a tenant or a destination type are refused all together, as invalid input.
pub fn plan(
    desired: Vec<Desired>,
    table: &Table,
    kek: &Kek,
    now: i64,
) -> Result<Vec<Step>, ApplyError> {
    let mut steps = Vec::with_capacity(desired.len());
    let mut errors = Vec::new();
    for d in desired {
        let index = d.index;
        // Its latest record cannot be read here: planned from the version before it (or as new,
        // with a new secret) the write would undo it.
        let step = if table.is_unreadable(&d.id) {
            Err(Planned::Invalid(FieldError::new(
                "id",
                "unreadable",
                "this subscription's latest control record cannot be read by this version \
                 (written by a newer version of the hub, or past the API): apply with that \
                 version",
            )))
        } else {
            match table.get(&d.id) {
                None => match &d.spec.destination {
                    ValidDestination::Webhook { url, .. } => {
                        refuse_redacted(url).map_err(Planned::Invalid)
                    }
                    ValidDestination::Pull => Ok(()),
                }
                .map(|()| create(d, kek, now)),
                Some(current) => update(d, &current, kek, now),
            }
        };
        match step {
            Ok(s) => steps.push(s),
            Err(Planned::Invalid(error)) => errors.push(EntryError { index, error }),
            Err(Planned::Sealed(id, error)) => return Err(ApplyError::Sealed { id, error }),
        }
    }
    if errors.is_empty() {
        Ok(steps)
    } else {
        Err(ApplyError::Invalid(errors))
    }
}

enum Planned {
    Invalid(FieldError),
    Sealed(String, SecretError),
}

fn create(d: Desired, kek: &Kek, now: i64) -> Step {
    let chosen = d.spec.signing_secret;
    let generated = chosen.is_none();
    let (destination, secret) = match d.spec.destination {
        ValidDestination::Webhook {
            url,
            headers,
            sensitive_headers,
        } => {
            let stored = sealed_url::seal(kek, &d.id, &url);
            let sealed = seal_sensitive_headers(kek, &d.id, &url, &sensitive_headers);
            let destination = DestinationRecord {
                kind: DestinationType::Webhook,
                url: Some(stored.url),
                headers,
                sensitive_headers: sealed,
                sealed_target: stored.sealed_target,
            };
            (
                destination,
                Some(chosen.unwrap_or_else(generate_signing_secret)),
            )
        }
        ValidDestination::Pull => {
            let destination = DestinationRecord {
                kind: DestinationType::Pull,
                url: None,
                headers: Default::default(),
                sensitive_headers: None,
                sealed_target: None,
            };
            (destination, None)
        }
    };
    let rec = SubscriptionRecord {
        signing_secrets: secret
            .iter()
            .map(|s| kek.seal_secret(s, &d.id, None))
            .collect(),
        verification_state: if secret.is_some() {
            VerificationState::Pending
        } else {
            VerificationState::Active
        },
        id: d.id,
        tenant_id: d.tenant_id,
        origin: d.spec.origin,
        event_types: d.spec.event_types,
        schema_major: d.spec.schema_major,
        destination,
        enabled: d.spec.enabled,
        retry_schedule: d.spec.retry_schedule,
        disabled_reason: None,
        disabled_at: None,
        created_at: now,
        updated_at: now,
        version: 1,
    };
    Step::Create {
        rec,
        secret,
        generated,
    }
}

fn update(d: Desired, current: &SubscriptionRecord, kek: &Kek, now: i64) -> Result<Step, Planned> {
    if current.tenant_id != d.tenant_id {
        return Err(Planned::Invalid(FieldError::new(
            "tenant_id",
            "immutable",
            "a subscription with this id belongs to another tenant; pick a new id",
        )));
    }
    let mut next = current.clone();
    next.origin = d.spec.origin;
    next.event_types = d.spec.event_types;
    next.schema_major = d.spec.schema_major;
    next.retry_schedule = d.spec.retry_schedule;
    if let Some(enabled) = d.enabled {
        if enabled && !next.enabled {
            next.disabled_reason = None;
            next.disabled_at = None;
        }
        next.enabled = enabled;
    }
    let mut url_changed = false;
    match (d.spec.destination, current.destination.kind) {
        (ValidDestination::Pull, DestinationType::Pull) => {}
        (
            ValidDestination::Webhook {
                url,
                headers,
                sensitive_headers,
            },
            DestinationType::Webhook,
        ) => {
            next.destination.headers = headers;
            // A sealed URL that does not open, with no signing secret of the record opening
            // either: the key is wrong (a stale STREAMING_HUB_KEK), not the record. Sealing the
            // file's URL again under it would leave a URL no running instance opens.
            let key_opens = || {
                current
                    .signing_secrets
                    .iter()
                    .any(|s| kek.open_secret(s, &current.id).is_ok())
            };
            if current.destination.sealed_target.is_some()
                && let Err(e) =
                    sealed_url::request_url(Some(kek), &current.id, &current.destination)
                && !key_opens()
            {
                return Err(Planned::Sealed(current.id.clone(), e));
            }
            // The file names the URL as given (or as the API shows it): compared with the one
            // requests go to, so a sealed URL is no change.
            url_changed =
                !sealed_url::names_stored(Some(kek), &current.id, &current.destination, &url);
            if url_changed {
                refuse_redacted(&url).map_err(Planned::Invalid)?;
            }
            let stored = url_changed.then(|| sealed_url::seal(kek, &current.id, &url));
            // Headers are bound to the URL requests go to: unknown here only when the file
            // sends the URL as shown and the stored one does not open (then they stay).
            let bound_to = match &stored {
                Some(_) => Some(url.clone()),
                None => sealed_url::request_url(Some(kek), &current.id, &current.destination)
                    .ok()
                    .map(|u| u.into_owned()),
            };
            // Sealed again when they change, when the URL they are bound to changes, when they
            // were sealed before that binding existed, and when they do not open here (a key
            // removed, a record copied or tampered with): the entry holds the whole desired set,
            // as a PATCH of `sensitive_headers` does, so one such record does not stop the file.
            let reseal = match open_sensitive_headers(kek, current) {
                Ok((stored, binding)) => {
                    stored != sensitive_headers
                        || url_changed
                        || binding == Binding::SubscriptionOnly
                }
                // Only when the same record's signing secrets open, which shows the key is right:
                // under a wrong STREAMING_HUB_KEK every entry would be sealed again under it, and
                // the running instances could not open any.
                Err(e) if key_opens() => {
                    tracing::warn!(subscription_id = %current.id, error = %e, "stored sensitive headers do not open; sealed again from the file");
                    true
                }
                Err(e) => return Err(Planned::Sealed(current.id.clone(), e)),
            };
            if let (true, Some(bound_to)) = (reseal, &bound_to) {
                next.destination.sensitive_headers =
                    seal_sensitive_headers(kek, &current.id, bound_to, &sensitive_headers);
            }
            if let Some(stored) = stored {
                next.destination.url = Some(stored.url);
                next.destination.sealed_target = stored.sealed_target;
                next.verification_state = VerificationState::Pending;
            } else if let Ok(Some(moved)) =
                sealed_url::under_current_key(kek, &current.id, &current.destination)
            {
                // The same URL, sealed under a previous key: moved to the current one.
                next.destination.sealed_target = Some(moved);
            }
        }
        _ => {
            return Err(Planned::Invalid(FieldError::new(
                "destination.type",
                "immutable",
                "the destination type cannot change; delete the subscription or use a new id",
            )));
        }
    }
    if next == *current {
        return Ok(Step::Unchanged {
            id: current.id.clone(),
        });
    }
    next.version = current.version + 1;
    next.updated_at = now;
    Ok(Step::Update {
        rec: next,
        url_changed,
        base: Box::new(current.clone()),
    })
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Summary {
    pub created: usize,
    pub updated: usize,
    pub unchanged: usize,
    /// Webhooks whose probe failed (written `pending`, or not written when a new URL of an
    /// `active` one failed), with the probe's code.
    pub unverified: Vec<(String, String)>,
    /// Entries not written: another writer changed them after this run planned them.
    pub conflicts: Vec<String>,
}

impl Summary {
    pub fn exit_code(&self) -> u8 {
        if !self.conflicts.is_empty() {
            exit::CONFLICT
        } else if self.unverified.is_empty() {
            exit::APPLIED
        } else {
            exit::UNVERIFIED
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} created, {} updated, {} unchanged",
            self.created, self.updated, self.unchanged
        )?;
        if !self.unverified.is_empty() {
            write!(
                f,
                "; {} webhook(s) failed verification (written pending, or a new URL of an active one not written):",
                self.unverified.len()
            )?;
            for (id, code) in &self.unverified {
                write!(f, " {id} ({code})")?;
            }
        }
        if !self.conflicts.is_empty() {
            write!(
                f,
                "; {} changed by another writer meanwhile, not written (run again): {}",
                self.conflicts.len(),
                self.conflicts.join(" ")
            )?;
        }
        Ok(())
    }
}

fn emit(out: &mut (dyn Write + Send), line: &str) -> Result<(), ApplyError> {
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| ApplyError::Unavailable(format!("writing to stdout: {e}")))
}

/// Probes what needs it, then writes the steps in order, printing one line per entry (step 4).
pub async fn execute(
    steps: Vec<Step>,
    subs: &Subscriptions,
    prober: &Prober,
    out: &mut (dyn Write + Send),
) -> Result<Summary, ApplyError> {
    let probes: Vec<Option<Result<(), ProbeError>>> = futures::stream::iter(&steps)
        .map(|step| async move {
            match step.to_probe() {
                Some(rec) => Some(prober.probe(rec).await),
                None => None,
            }
        })
        .buffered(PROBES_AT_ONCE)
        .collect()
        .await;
    let mut summary = Summary::default();
    for (step, probe) in steps.into_iter().zip(probes) {
        let (mut rec, secret, verb, base) = match step {
            Step::Unchanged { id } => {
                emit(out, &format!("unchanged {id}"))?;
                summary.unchanged += 1;
                continue;
            }
            Step::Create {
                rec,
                secret,
                generated,
            } => (rec, secret.filter(|_| generated), "created", None),
            Step::Update { rec, base, .. } => (rec, None, "updated", Some(base)),
        };
        let mut why = String::new();
        // Counted once written: an entry not written (a conflict) stays whatever it was.
        let mut unverified = None;
        // A new URL for a verified webhook that failed its probe: not written (below, once it is
        // known to be no conflict), so the current URL keeps its events (written `pending`, the
        // subscription matched none of them until a probe passed, and they were lost).
        let mut refused = None;
        match &probe {
            Some(Ok(())) => rec.verification_state = VerificationState::Active,
            Some(Err(e))
                if base
                    .as_ref()
                    .is_some_and(|b| b.verification_state == VerificationState::Active) =>
            {
                refused = Some(e);
            }
            Some(Err(e)) => {
                rec.verification_state = VerificationState::Pending;
                why = format!(" {}: {e}", e.code());
                unverified = Some((rec.id.clone(), e.code().to_string()));
            }
            None => {}
        }
        let (id, version, state) = (rec.id.clone(), rec.version, rec.verification_state);
        // Planned from the table as it was before the probes (up to 15 s each): written only if
        // no other writer changed it since (the same record, not only the same version: another
        // writer may have sent a version number back) and its latest record is still readable
        // here. Written over such a change, it lost that writer's update without a word.
        let (now, unreadable) = {
            let table = subs.table();
            let table = table.read();
            (table.get(&id), table.is_unreadable(&id))
        };
        let same = match (&now, &base) {
            (None, None) => true,
            (Some(now), Some(base)) => **now == **base,
            _ => false,
        };
        if !same || unreadable {
            let now = match now {
                _ if unreadable => "its latest record unreadable here".to_string(),
                None => "deleted".to_string(),
                Some(s) => format!("now v{}", s.version),
            };
            emit(
                out,
                &format!(
                    "conflict {id}: changed by another writer since this run read it ({now}); not written, run apply again"
                ),
            )?;
            summary.conflicts.push(id);
            continue;
        }
        if let Some(e) = refused {
            emit(
                out,
                &format!(
                    "unverified {id}: the new URL's probe failed, {}: {e}; not written, the current URL keeps receiving",
                    e.code()
                ),
            )?;
            summary.unverified.push((id, e.code().to_string()));
            continue;
        }
        let written = subs.put(rec).await;
        // Shown whenever the record may be on the broker: written, not seen back, and a failed
        // send too (a timeout after the send may have landed; a new secret nobody has would
        // leave only `rotate-secret`). Not written, the next run creates it with a new secret,
        // printed then: the last secret printed for an id is the one in force.
        if let (Some(secret), Ok(()) | Err(RepoError::NotSeen(_) | RepoError::Write(_))) =
            (&secret, &written)
        {
            let line = serde_json::json!({"id": id, "signing_secret": secret.expose()});
            emit(out, &line.to_string())?;
        }
        // Taken by the broker but not read back within the wait (a slow reader): in force, as
        // the API's 202 says, so said and counted, and the file goes on.
        let unseen = matches!(written, Err(RepoError::NotSeen(_)));
        if !unseen {
            written.map_err(|error| ApplyError::Write {
                id: id.clone(),
                error,
            })?;
        }
        summary.unverified.extend(unverified);
        let state = match state {
            VerificationState::Pending => "pending",
            VerificationState::Active => "active",
            VerificationState::Failed => "failed",
        };
        let note = if unseen {
            " (written; not yet read back from the control topic)"
        } else {
            ""
        };
        emit(out, &format!("{verb} {id} v{version} {state}{why}{note}"))?;
        if verb == "created" {
            summary.created += 1;
        } else {
            summary.updated += 1;
        }
    }
    Ok(summary)
}

/// Everything apply writes through and with.
pub struct Target {
    pub subs: Subscriptions,
    pub kek: Arc<Kek>,
    pub prober: Prober,
    pub sinks: SinkPolicy,
    pub clock: SharedClock,
}

/// Applies the text of a file to `target` (whose table must be caught up).
pub async fn apply(
    text: &str,
    target: &Target,
    out: &mut (dyn Write + Send),
) -> Result<Summary, ApplyError> {
    let desired = read_entries(text, target.sinks).await?;
    let steps = {
        let table = target.subs.table().read();
        plan(desired, &table, &target.kek, target.clock.now_ms())?
    };
    execute(steps, &target.subs, &target.prober, out).await
}

/// The control topic read on a thread of its own until dropped or stopped.
struct ControlReader {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), kafka::KafkaError>>>,
}

impl ControlReader {
    fn start(config: &Config, codec: Arc<Codec>, table: SharedTable) -> Result<Self, ApplyError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (config, flag) = (config.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control::follow(&config, codec, table, flag))
            .map_err(|e| ApplyError::Unavailable(format!("starting the reader: {e}")))?;
        Ok(ControlReader {
            stop,
            thread: Some(thread),
        })
    }

    async fn caught_up(&mut self, table: &SharedTable) -> Result<(), ApplyError> {
        let deadline = tokio::time::Instant::now() + CATCH_UP;
        while !table.is_caught_up() {
            if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
                let why = match self.thread.take().map(|t| t.join()) {
                    Some(Ok(Err(e))) => e.to_string(),
                    _ => "the reader stopped".to_string(),
                };
                return Err(ApplyError::Unavailable(format!(
                    "reading the control topic failed: {why}"
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ApplyError::Unavailable(format!(
                    "the control topic was not read to its end within {CATCH_UP:?}"
                )));
            }
            table
                .wait_for(Duration::from_millis(200), |_| table.is_caught_up())
                .await;
        }
        Ok(())
    }
}

impl Drop for ControlReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join(); // the reader checks `stop` every 100 ms
        }
    }
}

/// Fails unless the control topic exists (apply never creates topics: `topology apply` does).
async fn require_control_topic(config: &Config) -> Result<(), ApplyError> {
    let topic = control::topic(config);
    let client = kafka::base(config);
    let check = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client.create().map_err(|e| e.to_string())?;
        let md = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(15))
            .map_err(|e| e.to_string())?;
        match md.topics().first() {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(()),
            _ => Err(format!(
                "the control topic {topic} does not exist; run `streaming-hub topology apply` first"
            )),
        }
    });
    match check.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(ApplyError::Unavailable(why)),
        Err(e) => Err(ApplyError::Unavailable(e.to_string())),
    }
}

/// The control topic read to its end into a table, and the subscriptions written through it; the
/// reader goes on following it until dropped (off the runtime: its thread is joined).
async fn read_control_topic(config: &Config) -> Result<(ControlReader, Subscriptions), ApplyError> {
    let codec = Arc::new(Codec::new().map_err(|e| ApplyError::Unavailable(e.to_string()))?);
    require_control_topic(config).await?;
    let table = SharedTable::default();
    let mut reader = ControlReader::start(config, codec.clone(), table.clone())?;
    reader.caught_up(&table).await?;
    let subs = Subscriptions::kafka(config, codec, table)
        .map_err(|e| ApplyError::Unavailable(e.to_string()))?;
    Ok((reader, subs))
}

/// Reads `path`, checks it, reads the control topic and applies the file (the whole command but
/// for its exit code).
pub async fn apply_file(
    config: &Config,
    path: &Path,
    out: &mut (dyn Write + Send),
) -> Result<Summary, ApplyError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ApplyError::File(format!("{}: {e}", path.display())))?;
    if config.kek.is_empty() {
        return Err(ApplyError::Kek(
            "not set; it is needed to seal signing secrets".into(),
        ));
    }
    let kek = Arc::new(Kek::from_config(config).map_err(|e| ApplyError::Kek(e.to_string()))?);
    let sinks = SinkPolicy {
        allow_private: config.allow_private_sinks,
        allow_insecure: config.allow_insecure_sinks,
    };
    // Refuse a bad file before touching the broker; `apply` checks it again (cheap).
    read_entries(&text, sinks).await?;
    let http = crate::delivery::client::build_client(config)
        .map_err(|e| ApplyError::Unavailable(e.to_string()))?;
    let (reader, subs) = read_control_topic(config).await?;
    let clock: SharedClock = Arc::new(SystemClock);
    let target = Target {
        prober: Prober::new(kek.clone(), http, sinks, clock.clone()),
        subs,
        kek,
        sinks,
        clock,
    };
    let result = apply(&text, &target, out).await;
    tokio::task::spawn_blocking(move || drop(reader)).await.ok();
    result
}

/// How long past its expiry a signing secret under a previous key is still sealed again rather
/// than dropped: the command's clock may run ahead of the hubs'.
const EXPIRED_KEPT_MS: i64 = 10 * 60 * 1000;

/// `sub` as its next version with everything sealed in it under the current key (None: nothing
/// to do):
/// - signing secrets sealed under a previous key, sealed again (those expired more than
///   [`EXPIRED_KEPT_MS`] ago are dropped: they never sign again);
/// - sensitive headers under a previous key, sealed again as they were bound; with
///   `bind_unbound` (the upgrade step), those sealed by the id alone are bound to the URL requests
///   go to. Without it they stay bound to the id alone (not sent): binding them trusts the URL
///   next to them, which anyone who can write the control topic may have put there;
/// - a URL stored before URLs were sealed, sealed past its host; one sealed under a previous key,
///   sealed again (shown the same).
///
/// Anything that does not open fails the whole record: nothing of it is written. `updated_at` is
/// kept: nothing a subscriber sees changed, and a change would open a new failure span for
/// auto-disable and the breaker.
fn resealed(
    sub: &SubscriptionRecord,
    kek: &Kek,
    now: i64,
    bind_unbound: bool,
) -> Result<Option<SubscriptionRecord>, SecretError> {
    let current = kek.current_id();
    let mut rec = sub.clone();
    rec.signing_secrets.clear();
    for s in &sub.signing_secrets {
        if s.key_id == current {
            rec.signing_secrets.push(s.clone());
        } else if s
            .expires_at
            .is_none_or(|t| t.saturating_add(EXPIRED_KEPT_MS) > now)
        {
            rec.signing_secrets.push(kek.reseal_secret(s, &sub.id)?);
        }
    }
    let (headers, binding) = open_sensitive_headers(kek, sub)?;
    let old_key =
        (sub.destination.sensitive_headers.as_ref()).is_some_and(|b| b.key_id.as_str() != current);
    match binding {
        Binding::SubscriptionOnly if bind_unbound => {
            let target = sealed_url::request_url(Some(kek), &sub.id, &sub.destination)?;
            rec.destination.sensitive_headers =
                seal_sensitive_headers(kek, &rec.id, &target, &headers);
        }
        Binding::SubscriptionOnly if old_key => {
            let json = serde_json::to_vec(&headers).expect("a map of strings always serializes");
            rec.destination.sensitive_headers = Some(kek.seal(&json, &rec.id));
        }
        Binding::Url if old_key => {
            let target = sealed_url::request_url(Some(kek), &sub.id, &sub.destination)?;
            rec.destination.sensitive_headers =
                seal_sensitive_headers(kek, &rec.id, &target, &headers);
        }
        _ => {}
    }
    if sub.destination.kind == DestinationType::Webhook {
        let url = sub.destination.url.as_deref().unwrap_or_default();
        match &sub.destination.sealed_target {
            None if sealed_url::redacted(url) != url => {
                let stored = sealed_url::seal(kek, &rec.id, url);
                rec.destination.url = Some(stored.url);
                rec.destination.sealed_target = stored.sealed_target;
            }
            Some(_) => {
                if let Some(moved) = sealed_url::under_current_key(kek, &sub.id, &sub.destination)?
                {
                    rec.destination.sealed_target = Some(moved);
                }
            }
            None => {}
        }
    }
    if rec == *sub {
        return Ok(None);
    }
    rec.version += 1;
    Ok(Some(rec))
}

/// `streaming-hub subscriptions reseal [--bind-unbound]`: brings every subscription's sealed
/// values to the current key (see `resealed`). It ends a KEK rotation: once it has run with
/// nothing left (an empty output), no subscription needs the previous key. It also seals webhook
/// URLs stored before URLs were sealed (in plaintext on the control topic until then). With
/// `--bind-unbound`, a one-off step of an upgrade run while the control topic is trusted, it
/// binds sensitive headers sealed before headers were bound to their URL (until then not sent
/// unless `STREAMING_HUB_SEND_UNBOUND_HEADERS` is on). Prints `resealed <id> v<version>` per
/// subscription; returns the exit code: 0 all done, 2 some did not open, changed while being
/// sealed (run it again) or have a latest record this version cannot read (left alone: run the
/// newer version's), or the KEK is missing, 3 the control topic could not be read or written.
pub async fn reseal_command(config: &Config, bind_unbound: bool) -> u8 {
    let who = "streaming-hub subscriptions reseal";
    let mut out = std::io::stdout();
    let mut report = Reseal::default();
    let result = reseal(config, bind_unbound, &mut out, &mut report).await;
    for (id, e) in &report.failed {
        eprintln!(
            "{who}: {id}: a sealed value (signing secret, sensitive headers or URL) does not open: {e}"
        );
    }
    for id in &report.moved {
        eprintln!("{who}: {id}: written by someone else meanwhile; run again");
    }
    for id in &report.unreadable {
        eprintln!(
            "{who}: {id}: its latest record cannot be read by this version (written by a newer \
             one): not resealed; run the newer version's reseal"
        );
    }
    eprintln!(
        "{who}: {} resealed, {} not opened, {} changed meanwhile, {} unreadable",
        report.resealed,
        report.failed.len(),
        report.moved.len(),
        report.unreadable.len()
    );
    match result {
        Err(e) => {
            eprintln!("{who}: {e}");
            e.exit_code()
        }
        Ok(())
            if report.failed.is_empty()
                && report.moved.is_empty()
                && report.unreadable.is_empty() =>
        {
            exit::APPLIED
        }
        Ok(()) => exit::INVALID,
    }
}

/// What `subscriptions reseal` did.
#[derive(Default)]
pub struct Reseal {
    pub resealed: usize,
    pub failed: Vec<(String, SecretError)>,
    /// Written by someone else between the plan and this write, or after it (not bound here).
    pub moved: Vec<String>,
    /// Their latest record cannot be read by this binary (a newer version of the hub wrote it):
    /// left alone, since resealing the version before it would write over it.
    pub unreadable: Vec<String>,
}

async fn reseal(
    config: &Config,
    bind_unbound: bool,
    out: &mut (dyn Write + Send),
    report: &mut Reseal,
) -> Result<(), ApplyError> {
    if config.kek.is_empty() {
        return Err(ApplyError::Kek(
            "not set; it is needed to open sealed headers".into(),
        ));
    }
    let kek = Kek::from_config(config).map_err(|e| ApplyError::Kek(e.to_string()))?;
    let (reader, subs) = read_control_topic(config).await?;
    let result = reseal_all(&subs, &kek, bind_unbound, out, report).await;
    tokio::task::spawn_blocking(move || drop(reader)).await.ok();
    result
}

/// Binds each subscription's headers from the record the table holds just before its write (not
/// from a snapshot taken at the start: an API write meanwhile would be overwritten), and checks
/// afterwards that the table holds this write, not another writer's of the same version.
pub async fn reseal_all(
    subs: &Subscriptions,
    kek: &Kek,
    bind_unbound: bool,
    out: &mut (dyn Write + Send),
    report: &mut Reseal,
) -> Result<(), ApplyError> {
    // With the ids whose only records are unreadable here: named, since their values may be
    // sealed under the key about to be removed.
    let mut ids: Vec<String> = {
        let table = subs.table();
        let table = table.read();
        table
            .iter()
            .map(|s| s.id.clone())
            .chain(table.unreadable_ids().cloned())
            .collect()
    };
    ids.sort();
    ids.dedup();
    for id in ids {
        if subs.table().read().is_unreadable(&id) {
            report.unreadable.push(id);
            continue;
        }
        let Some(current) = subs.get(&id) else {
            continue; // deleted meanwhile
        };
        let rec = match resealed(&current, kek, SystemClock.now_ms(), bind_unbound) {
            Ok(Some(rec)) => rec,
            Ok(None) => continue,
            Err(e) => {
                report.failed.push((id, e));
                continue;
            }
        };
        let (version, written) = (rec.version, rec.clone());
        subs.put(rec).await.map_err(|error| ApplyError::Write {
            id: id.clone(),
            error,
        })?;
        let ours = subs
            .get(&id)
            .is_some_and(|s| s.version == version && *s == written);
        if ours {
            report.resealed += 1;
            emit(out, &format!("resealed {id} v{version}"))?;
        } else {
            report.moved.push(id);
        }
    }
    Ok(())
}

/// `streaming-hub subscriptions apply -f <path>`: applies, reports on stderr, returns the exit code.
pub async fn command(config: &Config, path: &Path) -> u8 {
    let mut out = std::io::stdout();
    let who = "streaming-hub subscriptions apply";
    match apply_file(config, path, &mut out).await {
        Ok(summary) => {
            eprintln!("{who}: {summary}");
            summary.exit_code()
        }
        Err(ApplyError::Invalid(errors)) => {
            for e in &errors {
                eprintln!("{who}: invalid {e}");
            }
            eprintln!(
                "{who}: {} invalid entries; nothing was written",
                errors.len()
            );
            exit::INVALID
        }
        Err(e) => {
            eprintln!("{who}: {e}");
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use axum::Router;
    use axum::routing::post;
    use base64::Engine;
    use serde_json::json;

    use super::*;
    use crate::runtime::clock::ManualClock;

    async fn echo() -> (String, Arc<AtomicUsize>) {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let app = Router::new().route(
            "/hook",
            post(move |body: String| {
                h.fetch_add(1, Ordering::SeqCst);
                async move { body }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (format!("http://{addr}/hook"), hits)
    }

    /// One `subscriptions reseal` run: what it printed and its report.
    async fn reseal_report(t: &Target) -> (String, Reseal) {
        let (mut out, mut report) = (Vec::new(), Reseal::default());
        reseal_all(&t.subs, &t.kek, true, &mut out, &mut report)
            .await
            .unwrap();
        (String::from_utf8(out).unwrap(), report)
    }

    fn target() -> Target {
        let b64 = base64::engine::general_purpose::STANDARD.encode([3u8; 32]);
        let vars = [
            ("STREAMING_HUB_KEK", b64),
            ("STREAMING_HUB_ALLOW_PRIVATE_SINKS", "true".to_string()),
            ("STREAMING_HUB_ALLOW_INSECURE_SINKS", "true".to_string()),
            ("STREAMING_HUB_HTTP_TIMEOUT", "3s".to_string()),
        ];
        let config = Config::from_vars(vars.map(|(k, v)| (k.to_string(), v))).unwrap();
        let kek = Arc::new(Kek::from_config(&config).unwrap());
        let clock: SharedClock = Arc::new(ManualClock::new(1_750_000_000_000));
        let sinks = SinkPolicy {
            allow_private: true,
            allow_insecure: true,
        };
        let http = crate::delivery::client::build_client(&config).unwrap();
        Target {
            subs: Subscriptions::in_memory(Arc::new(Codec::new().unwrap())),
            prober: Prober::new(kek.clone(), http, sinks, clock.clone()),
            kek,
            sinks,
            clock,
        }
    }

    async fn run(t: &Target, file: &Value) -> (Result<Summary, ApplyError>, String) {
        let mut out = Vec::new();
        let r = apply(&file.to_string(), t, &mut out).await;
        (r, String::from_utf8(out).unwrap())
    }

    const A: &str = "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1c";
    const B: &str = "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1d";

    fn invalid(r: Result<Summary, ApplyError>) -> Vec<(usize, String, &'static str)> {
        match r {
            Err(ApplyError::Invalid(errors)) => errors
                .into_iter()
                .map(|e| (e.index, e.error.field, e.error.code))
                .collect(),
            Err(e) => panic!("expected invalid entries, got {e}"),
            Ok(s) => panic!("expected invalid entries, got {s}"),
        }
    }

    /// An entry whose subscription's latest control record this version cannot read is refused:
    /// planned from the version before it, or as new with a new secret, it would undo it.
    #[tokio::test]
    async fn an_entry_whose_latest_record_cannot_be_read_is_refused() {
        let t = target();
        let pull = json!({"type": "pull"});
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            {"id": B, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
        ]);
        let (r, _) = run(&t, &file).await;
        assert!(r.is_ok(), "{r:?}");
        // A's record, then one this version cannot read; B has only such a record (the rest
        // compacted away).
        t.subs.table().apply(|table| {
            table.read_record(B, None, 0, 99);
            table.read_unreadable(A, 0, 100);
            table.read_unreadable(B, 0, 101);
        });
        let desired = vec![
            entry(0, file[0].clone(), t.sinks).await.unwrap(),
            entry(1, file[1].clone(), t.sinks).await.unwrap(),
        ];
        let table = t.subs.table().read();
        let Err(ApplyError::Invalid(errors)) = plan(desired, &table, &t.kek, t.clock.now_ms())
        else {
            panic!("refused")
        };
        let refused: Vec<_> = errors
            .iter()
            .map(|e| (e.index, e.error.field.as_str(), e.error.code))
            .collect();
        assert_eq!(refused, [(0, "id", "unreadable"), (1, "id", "unreadable")]);
    }

    #[tokio::test]
    async fn every_bad_entry_is_named_by_index_and_field_and_nothing_is_written() {
        let t = target();
        let pull = json!({"type": "pull"});
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            {"id": B, "tenant_id": "t1", "event_types": ["a*.b"], "destination": pull},
            {"id": "not-a-uuid", "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            {"id": B.to_uppercase(), "tenant_id": "t1", "event_types": ["a.b"], "destination": pull, "colour": 1},
            {"id": "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1e", "event_types": ["a.b"], "destination": pull},
            {"tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            {"id": "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b1f", "tenant_id": "t1", "event_types": ["a.b"],
             "destination": {"type": "webhook", "url": "ftp://x.example/h"}},
            {"id": "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b20", "tenant_id": "t1", "event_types": ["a.b"],
             "destination": {"type": "webhook", "url": "http://127.0.0.1/h", "bogus": true}},
            {"id": A.to_uppercase(), "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            7,
            {"id": "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b21", "tenant_id": "t1", "event_types": ["a.b"],
             "schema_major": 3_000_000_000u64, "destination": pull},
        ]);
        let (r, out) = run(&t, &file).await;
        assert_eq!(
            invalid(r),
            [
                (1, "event_types[0]".to_string(), "invalid"),
                (2, "id".into(), "invalid"),
                (3, "colour".into(), "unknown_field"),
                (4, "tenant_id".into(), "required"),
                (5, "id".into(), "required"),
                (6, "destination.url".into(), "url_scheme"),
                (7, "destination.bogus".into(), "unknown_field"),
                (8, "id".into(), "duplicate"),
                (9, "".into(), "invalid"),
                (10, "schema_major".into(), "invalid"),
            ]
        );
        assert!(out.is_empty());
        assert!(t.subs.table().read().is_empty(), "nothing written");
        let e = EntryError {
            index: 1,
            error: FieldError::new("event_types[0]", "invalid", "bad"),
        };
        assert_eq!(
            e.to_string(),
            "entry 1, field event_types[0]: bad (invalid)"
        );
    }

    /// A key given twice in an entry (a merge conflict's two `url`s) is refused naming the
    /// field, as the API refuses it; a JSON value alone kept the last one.
    #[tokio::test]
    async fn an_entry_with_a_key_given_twice_is_refused_naming_it() {
        let text = format!(
            r#"[{{"id": "{A}", "tenant_id": "t1", "event_types": ["a.b"], "destination": {{"type": "pull"}}}},
                {{"id": "{B}", "tenant_id": "t1", "event_types": ["a.b"],
                  "destination": {{"type": "webhook", "url": "http://127.0.0.1/a", "url": "http://127.0.0.1/b"}}}},
                {{"id": "{A}", "id": "{B}", "tenant_id": "t1", "event_types": ["a.b"], "destination": {{"type": "pull"}}}},
                {{"id": "0190f5e2-7c1a-7d4e-9b1a-2f4c6e8a0b21", "tenant_id": "t1", "event_types": ["a.b"],
                  "destination": {{"type": "webhook", "url": "http://127.0.0.1/a",
                                   "headers": {{"x-a": "1", "x-a": "2"}}}}}}]"#
        );
        let policy = SinkPolicy {
            allow_private: true,
            allow_insecure: true,
        };
        let got: Vec<(usize, String, &str)> = match read_entries(&text, policy).await {
            Err(ApplyError::Invalid(errors)) => errors
                .into_iter()
                .map(|e| (e.index, e.error.field, e.error.code))
                .collect(),
            other => panic!("{:?}", other.map(|d| d.len())),
        };
        assert_eq!(
            got,
            [
                (1, "destination.url".to_string(), "duplicate"),
                (2, "id".into(), "duplicate"),
                (3, "destination.headers.x-a".into(), "duplicate"),
            ]
        );
    }

    /// A send whose outcome is unknown may have landed: the generated secret is printed before
    /// the error, or a record nobody has the secret of could be in force.
    #[tokio::test]
    async fn a_generated_secret_is_printed_when_the_write_may_have_landed() {
        let mut t = target();
        let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
        t.subs = Subscriptions::failing(Arc::new(Codec::new().unwrap()), failing);
        let (url, _) = echo().await;
        let file = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                           "destination": {"type": "webhook", "url": url}}]);
        let (r, out) = run(&t, &file).await;
        let e = r.expect_err("the write failed");
        assert!(matches!(&e, ApplyError::Write { id, .. } if id == B), "{e}");
        assert_eq!(e.exit_code(), exit::UNAVAILABLE);
        let line: Value = serde_json::from_str(out.lines().next().expect("a line")).unwrap();
        assert_eq!(line["id"], B);
        assert!(
            line["signing_secret"]
                .as_str()
                .is_some_and(|s| s.starts_with("whsec_")),
            "{out}"
        );
    }

    #[tokio::test]
    async fn apply_creates_then_a_second_apply_of_the_same_file_writes_nothing() {
        let t = target();
        let (url, hits) = echo().await;
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.*"], "destination": {"type": "pull"}},
            {"id": B, "tenant_id": "t1", "event_types": ["a.b"], "retry_schedule": ["5s"],
             "destination": {"type": "webhook", "url": url, "headers": {"X-Team": "x"},
                             "sensitive_headers": {"x-api-key": "k1"}}},
        ]);
        let (r, out) = run(&t, &file).await;
        let summary = r.unwrap();
        assert_eq!((summary.created, summary.exit_code()), (2, exit::APPLIED));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], format!("created {A} v1 active"));
        let secret: Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(secret["id"], B);
        let secret = secret["signing_secret"].as_str().unwrap().to_string();
        assert!(secret.starts_with("whsec_"));
        assert_eq!(lines[2], format!("created {B} v1 active"));
        assert_eq!(hits.load(Ordering::SeqCst), 1, "one probe");
        let b = t.subs.get(B).unwrap();
        assert_eq!(
            t.kek
                .open_secret(&b.signing_secrets[0], B)
                .unwrap()
                .expose(),
            secret
        );
        assert_eq!(b.destination.headers["x-team"], "x");

        let (r, out) = run(&t, &file).await;
        assert_eq!(r.unwrap().unchanged, 2);
        assert_eq!(out, format!("unchanged {A}\nunchanged {B}\n"));
        assert_eq!(t.subs.get(B).unwrap().version, 1);
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "no probe when nothing changes"
        );
    }

    #[test]
    fn a_string_value_in_a_serde_error_is_not_repeated() {
        let e = serde_json::from_str::<std::collections::BTreeMap<String, String>>(
            r#""Bearer sk_live_123""#,
        )
        .unwrap_err();
        let shown = without_string_value(&e.to_string());
        assert!(!shown.contains("sk_live_123"), "{shown}");
        assert!(
            shown.starts_with("invalid type: string, expected a map"),
            "{shown}"
        );
        assert_eq!(
            without_string_value("missing field `url`"),
            "missing field `url`"
        );
        assert_eq!(
            without_string_value("invalid value: string \"a\", b\""),
            "invalid value: string (value not shown)"
        );
        assert_eq!(
            without_string_value("invalid type: integer `12345678`, expected a string"),
            "invalid type: integer, expected a string"
        );
        assert_eq!(
            without_string_value("unknown variant `sk_live`, expected `webhook` or `pull`"),
            "unknown variant, expected `webhook` or `pull`"
        );
        assert_eq!(
            without_string_value("invalid type: map, expected a string"),
            "invalid type: map, expected a string"
        );
    }

    #[tokio::test]
    async fn an_entrys_signing_secret_is_used_on_create_and_kept_out_of_later_runs() {
        let t = target();
        let (url, _) = echo().await;
        let chosen = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSwMfKQ9r8GKYo=";
        let file = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
            "signing_secret": chosen, "destination": {"type": "webhook", "url": url}}]);
        let (r, out) = run(&t, &file).await;
        assert_eq!(r.unwrap().created, 1);
        // The file has it: not printed again (stdout often lands in CI logs).
        assert!(
            !out.contains(chosen) && !out.contains("signing_secret"),
            "{out}"
        );
        assert!(out.starts_with(&format!("created {B} v1 ")), "{out}");
        let b = t.subs.get(B).unwrap();
        let stored = t.kek.open_secret(&b.signing_secrets[0], B).unwrap();
        assert_eq!(stored.expose(), chosen);
        // The file keeps the field; a second run changes nothing.
        let (r, out) = run(&t, &file).await;
        assert_eq!(r.unwrap().unchanged, 1);
        assert_eq!(out, format!("unchanged {B}\n"));
    }

    #[tokio::test]
    async fn an_update_keeps_secrets_bumps_the_version_and_probes_only_a_new_url() {
        let t = target();
        let (url, hits) = echo().await;
        let (url2, hits2) = echo().await;
        let entry = |url: &str, types: Value| {
            json!([{"id": B, "tenant_id": "t1", "event_types": types,
                    "destination": {"type": "webhook", "url": url,
                                    "sensitive_headers": {"x-api-key": "k1"}}}])
        };
        run(&t, &entry(&url, json!(["a.b"]))).await.0.unwrap();
        let v1 = t.subs.get(B).unwrap();

        let (r, out) = run(&t, &entry(&url, json!(["a.b", "c.d"]))).await;
        r.unwrap();
        assert_eq!(out, format!("updated {B} v2 active\n"));
        let v2 = t.subs.get(B).unwrap();
        assert_eq!(v2.event_types, ["a.b", "c.d"]);
        assert_eq!(v2.signing_secrets, v1.signing_secrets, "secrets kept");
        assert_eq!(
            v2.destination.sensitive_headers, v1.destination.sensitive_headers,
            "unchanged credentials are not re-sealed"
        );
        assert_eq!(hits.load(Ordering::SeqCst), 1, "no probe without a new URL");

        let (r, out) = run(&t, &entry(&url2, json!(["a.b", "c.d"]))).await;
        r.unwrap();
        assert_eq!(out, format!("updated {B} v3 active\n"));
        assert_eq!(hits2.load(Ordering::SeqCst), 1, "the new URL was probed");
        let v3 = t.subs.get(B).unwrap();
        assert_eq!(v3.destination.url.as_deref(), Some(url2.as_str()));
        assert_eq!(v3.signing_secrets, v1.signing_secrets);
    }

    /// A new URL for an active webhook that fails its probe is not written: the current URL
    /// keeps its events (written pending, the subscription matched none of them). Exit 1.
    #[tokio::test]
    async fn a_new_url_of_an_active_webhook_that_fails_its_probe_is_not_written() {
        let t = target();
        let (url, hits) = echo().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let down = format!("http://{}/hook", listener.local_addr().unwrap());
        drop(listener); // nothing listens: connect_failed
        let entry = |url: &str| {
            json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                    "destination": {"type": "webhook", "url": url}}])
        };
        run(&t, &entry(&url)).await.0.unwrap();
        let v1 = t.subs.get(B).unwrap();
        assert_eq!(v1.verification_state, VerificationState::Active);
        let (r, out) = run(&t, &entry(&down)).await;
        let summary = r.unwrap();
        assert_eq!(summary.exit_code(), exit::UNVERIFIED);
        assert_eq!(
            summary.unverified,
            [(B.to_string(), "connect_failed".to_string())]
        );
        assert_eq!(summary.updated, 0);
        assert!(
            out.starts_with(&format!(
                "unverified {B}: the new URL's probe failed, connect_failed: "
            )),
            "{out}"
        );
        assert_eq!(t.subs.get(B).unwrap(), v1, "nothing written");
        assert_eq!(hits.load(Ordering::SeqCst), 1, "the create's probe only");
    }

    /// Another writer (a PATCH through the API) changed the subscription while this run probed:
    /// the entry planned from the table before is not written over that change (its version,
    /// equal or lower, lost the PATCH without a word), it is reported, exit 4.
    #[tokio::test]
    async fn an_entry_changed_by_another_writer_after_the_plan_is_not_written() {
        let t = target();
        let (url, _) = echo().await;
        let (url2, _) = echo().await;
        let entry = |url: &str| {
            json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                    "destination": {"type": "webhook", "url": url}}])
        };
        let (summary, out) = run_with_a_patch_meanwhile(&t, &entry(&url), &entry(&url2)).await;
        assert!(out.starts_with(&format!("conflict {B}: ")), "{out}");
        assert_eq!(summary.conflicts, [B]);
        assert_eq!(summary.exit_code(), exit::CONFLICT);
        let now = t.subs.get(B).unwrap();
        assert_eq!(
            (now.version, now.event_types.clone()),
            (2, vec!["x.y".to_string()])
        );
        // Run again: planned from the change, written.
        let (r, out) = run(&t, &entry(&url2)).await;
        assert_eq!(r.unwrap().exit_code(), exit::APPLIED);
        assert_eq!(out, format!("updated {B} v3 active\n"));
    }

    /// Applies `first`, plans `then` from it, and has another writer change the record (a
    /// PATCH of its event types) before the planned steps run: what they wrote and said.
    async fn run_with_a_patch_meanwhile(
        t: &Target,
        first: &Value,
        then: &Value,
    ) -> (Summary, String) {
        run(t, first).await.0.unwrap();
        let desired = read_entries(&then.to_string(), t.sinks).await.unwrap();
        let steps = {
            let table = t.subs.table().read();
            plan(desired, &table, &t.kek, t.clock.now_ms()).unwrap()
        };
        // The PATCH, written while the run probes the new URL.
        let mut patched = (*t.subs.get(B).unwrap()).clone();
        patched.event_types = vec!["x.y".into()];
        patched.version += 1;
        t.subs.put(patched).await.unwrap();
        let mut out = Vec::new();
        let summary = execute(steps, &t.subs, &t.prober, &mut out).await.unwrap();
        (summary, String::from_utf8(out).unwrap())
    }

    /// An entry that conflicted was not written: its failed probe is not reported as a webhook
    /// that "stays pending" (it is whatever the other writer made it).
    #[tokio::test]
    async fn a_conflicted_entry_is_not_reported_as_staying_pending() {
        let t = target();
        let (url, _) = echo().await;
        let entry = |url: &str| {
            json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                    "destination": {"type": "webhook", "url": url}}])
        };
        // Nothing listens there: its probe fails.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}/hook", l.local_addr().unwrap())
        };
        let (summary, _) = run_with_a_patch_meanwhile(&t, &entry(&url), &entry(&dead)).await;
        assert_eq!(summary.conflicts, [B]);
        assert!(summary.unverified.is_empty(), "{:?}", summary.unverified);
    }

    /// A write the broker took that the reader has not shown back within the wait is in force
    /// (the API answers 202): said so, counted, and the rest of the file is applied.
    #[tokio::test]
    async fn a_write_not_yet_read_back_is_reported_and_the_file_goes_on() {
        let mut t = target();
        t.subs = Subscriptions::lagging(Arc::new(Codec::new().unwrap()));
        let pull = json!({"type": "pull"});
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            {"id": B, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
        ]);
        let (r, out) = run(&t, &file).await;
        let summary = r.unwrap();
        assert_eq!(summary.created, 2, "{out}");
        assert_eq!(out.lines().count(), 2, "{out}");
        assert!(
            out.lines()
                .all(|l| l.ends_with("(written; not yet read back from the control topic)")),
            "{out}"
        );
        assert!(t.subs.get(A).is_some() && t.subs.get(B).is_some());
    }

    /// The check before each write compares the record, not its version alone: a change of the
    /// same version (a writer that planned from a stale table sends a number back), or a latest
    /// record that turned unreadable here during the probes, is a conflict. A record stored at
    /// version 0 (written past the API) is updated, not reported as a conflict forever.
    #[tokio::test]
    async fn same_version_changes_and_unreadable_records_are_conflicts_and_version_0_updates() {
        let t = target();
        let (url, _) = echo().await;
        let entry = |types: Value| {
            json!([{"id": B, "tenant_id": "t1", "event_types": types,
                    "destination": {"type": "webhook", "url": url}}])
        };
        run(&t, &entry(json!(["a.b"]))).await.0.unwrap();
        let planned = |types: Value| {
            let t = &t;
            let e = entry(types);
            async move {
                let desired = read_entries(&e.to_string(), t.sinks).await.unwrap();
                let table = t.subs.table().read();
                plan(desired, &table, &t.kek, t.clock.now_ms()).unwrap()
            }
        };
        let conflicted = |steps| {
            let t = &t;
            async move {
                let mut out = Vec::new();
                let summary = execute(steps, &t.subs, &t.prober, &mut out).await.unwrap();
                (summary.conflicts == [B], String::from_utf8(out).unwrap())
            }
        };
        // Another writer's change under the same version number.
        let steps = planned(json!(["c.d"])).await;
        let mut same_version = (*t.subs.get(B).unwrap()).clone();
        same_version.event_types = vec!["x.y".into()];
        t.subs.table().apply(|tb| tb.upsert(same_version.clone()));
        let (conflict, out) = conflicted(steps).await;
        assert!(conflict, "{out}");
        assert_eq!(*t.subs.get(B).unwrap(), same_version);
        // A latest record that turned unreadable here meanwhile.
        let steps = planned(json!(["c.d"])).await;
        t.subs
            .table()
            .apply(|tb| tb.read_unreadable(B, 0, 1_000_000));
        let (conflict, out) = conflicted(steps).await;
        assert!(conflict && out.contains("unreadable"), "{out}");
        assert_eq!(*t.subs.get(B).unwrap(), same_version);
        // Version 0, readable again.
        let mut zero = same_version.clone();
        zero.version = 0;
        t.subs
            .table()
            .apply(|tb| tb.read_record(B, Some(zero), 0, 2_000_000));
        let (r, out) = run(&t, &entry(json!(["c.d"]))).await;
        assert_eq!(r.unwrap().exit_code(), exit::APPLIED, "{out}");
        assert_eq!(out, format!("updated {B} v1 active\n"));
    }

    /// A stored record whose sealed headers do not open here (sealed for another record, a key
    /// removed) while its signing secrets do (the key is right) is sealed again from the file,
    /// which holds the whole desired set: it does not stop the file (it did, exit 3, as if the
    /// control topic were unreachable). When nothing of it opens, the key is wrong: the file
    /// stops, exit 2, nothing written.
    #[tokio::test]
    async fn stored_headers_that_do_not_open_are_sealed_again_from_the_file() {
        let t = target();
        let (url, _) = echo().await;
        let entry = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                            "destination": {"type": "webhook", "url": url,
                                            "sensitive_headers": {"x-api-key": "k1"}}}]);
        run(&t, &entry).await.0.unwrap();
        let mut copied = (*t.subs.get(B).unwrap()).clone();
        copied.destination.sensitive_headers = Some(t.kek.seal_bound(
            br#"{"x-api-key":"k1"}"#,
            "another-id",
            &url,
        ));
        copied.version += 1;
        let v = copied.version + 1;
        t.subs.put(copied).await.unwrap();

        let (r, out) = run(&t, &entry).await;
        r.unwrap();
        assert_eq!(out, format!("updated {B} v{v} active\n"));
        let blob = t.subs.get(B).unwrap().destination.sensitive_headers.clone();
        let (opened, binding) = t.kek.open_bound(&blob.unwrap(), B, &url).unwrap();
        assert_eq!(binding, Binding::Url);
        assert_eq!(opened, br#"{"x-api-key":"k1"}"#.to_vec());

        // Neither its headers nor its signing secrets open: the key is wrong, nothing is written.
        let mut foreign = (*t.subs.get(B).unwrap()).clone();
        foreign.signing_secrets = vec![t.kek.seal_secret(
            &crate::subscriptions::secrets::generate_signing_secret(),
            "another-id",
            None,
        )];
        foreign.destination.sensitive_headers = Some(t.kek.seal_bound(
            br#"{"x-api-key":"k1"}"#,
            "another-id",
            &url,
        ));
        foreign.version += 1;
        let version = foreign.version;
        t.subs.put(foreign).await.unwrap();
        let (r, _) = run(&t, &entry).await;
        let e = r.unwrap_err();
        assert!(matches!(e, ApplyError::Sealed { .. }), "{e}");
        assert_eq!(e.exit_code(), exit::INVALID);
        assert_eq!(t.subs.get(B).unwrap().version, version, "nothing written");
    }

    /// A record written past the API with another receiver's URL in plaintext on the same host
    /// (shown as the stored one is, `…/***`): a file naming the URL as shown does not seal the
    /// headers again to it, as if it were the stored URL. It is refused; the URL is named in full.
    #[tokio::test]
    async fn the_url_as_shown_does_not_carry_headers_to_a_plaintext_url_written_past_the_api() {
        let t = target();
        let (url, _) = echo().await;
        let theirs = format!("{url}/tok-A1234567");
        let entry = |u: &str| {
            json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                    "destination": {"type": "webhook", "url": u,
                                    "sensitive_headers": {"x-api-key": "k1"}}}])
        };
        run(&t, &entry(&theirs)).await.0.unwrap();
        let shown = t.subs.get(B).unwrap().destination.url.clone().unwrap();
        assert_eq!(shown, format!("{url}/***"));
        let evil = format!("{url}/evil-B7654321");
        let mut tampered = (*t.subs.get(B).unwrap()).clone();
        tampered.destination.url = Some(evil.clone());
        tampered.destination.sealed_target = None;
        tampered.version += 1;
        t.subs.put(tampered.clone()).await.unwrap();

        match run(&t, &entry(&shown)).await.0 {
            Err(ApplyError::Invalid(errors)) => assert_eq!(errors[0].error.code, "redacted"),
            other => panic!("{:?}", other.map(|s| s.to_string())),
        }
        let now = t.subs.get(B).unwrap();
        assert_eq!(now.version, tampered.version, "nothing written");
        let headers = now.destination.sensitive_headers.clone().unwrap();
        assert!(t.kek.open_bound(&headers, B, &evil).is_err());
        // Named in full, it is the URL requests go to again.
        run(&t, &entry(&theirs)).await.0.unwrap();
        let now = t.subs.get(B).unwrap();
        assert_eq!(
            sealed_url::request_url(Some(&t.kek), B, &now.destination).unwrap(),
            theirs
        );
    }

    /// A sealed URL that does not open and no signing secret that does, with no sensitive
    /// headers to tell: the key is wrong (a stale STREAMING_HUB_KEK), so nothing is written.
    /// Before, the file's URL was sealed again under that key, as a changed URL, and no running
    /// instance could open it.
    #[tokio::test]
    async fn a_sealed_url_under_another_key_stops_the_apply_when_no_secret_opens_either() {
        let t = target();
        let (url, _) = echo().await;
        let given = format!("{url}?code=fn_key_1");
        let entry = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
            "destination": {"type": "webhook", "url": given}}]);
        run(&t, &entry).await.0.unwrap();
        let mut foreign = (*t.subs.get(B).unwrap()).clone();
        foreign.signing_secrets = vec![t.kek.seal_secret(
            &crate::subscriptions::secrets::generate_signing_secret(),
            "another-id",
            None,
        )];
        foreign.destination.sealed_target =
            sealed_url::seal(&t.kek, "another-id", &given).sealed_target;
        foreign.version += 1;
        let version = foreign.version;
        t.subs.put(foreign).await.unwrap();
        let (r, out) = run(&t, &entry).await;
        let e = r.unwrap_err();
        assert!(matches!(e, ApplyError::Sealed { .. }), "{e} {out}");
        assert_eq!(e.exit_code(), exit::INVALID);
        assert_eq!(t.subs.get(B).unwrap().version, version, "nothing written");
    }

    #[tokio::test]
    async fn sealed_headers_follow_a_new_url_and_old_ones_are_sealed_again_bound() {
        let t = target();
        let (url, _) = echo().await;
        let (url2, _) = echo().await;
        let entry = |url: &str| {
            json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                    "destination": {"type": "webhook", "url": url,
                                    "sensitive_headers": {"x-api-key": "k1"}}}])
        };
        let bound_to = |url: &str| {
            let sub = t.subs.get(B).unwrap();
            let blob = sub.destination.sensitive_headers.clone().unwrap();
            t.kek.open_bound(&blob, B, url).map(|(_, b)| b)
        };
        run(&t, &entry(&url)).await.0.unwrap();
        assert_eq!(bound_to(&url), Ok(Binding::Url));
        // A new URL: the same headers, sealed for it (they would not open there otherwise).
        run(&t, &entry(&url2)).await.0.unwrap();
        assert_eq!(bound_to(&url2), Ok(Binding::Url));
        assert_eq!(bound_to(&url), Err(SecretError::Open));

        // Sealed before headers were bound to their URL: the next apply seals them again.
        let mut legacy = (*t.subs.get(B).unwrap()).clone();
        legacy.destination.sensitive_headers = Some(t.kek.seal(br#"{"x-api-key":"k1"}"#, B));
        legacy.version += 1;
        t.subs.put(legacy).await.unwrap();
        assert_eq!(bound_to(&url2), Ok(Binding::SubscriptionOnly));
        let (r, out) = run(&t, &entry(&url2)).await;
        r.unwrap();
        assert_eq!(out, format!("updated {B} v4 active\n"));
        assert_eq!(bound_to(&url2), Ok(Binding::Url));
        let (r, _) = run(&t, &entry(&url2)).await;
        assert_eq!(r.unwrap().unchanged, 1, "and then it is unchanged");
    }

    #[tokio::test]
    async fn reseal_binds_only_headers_sealed_before_the_binding_to_the_url_named_now() {
        let t = target();
        let (url, _) = echo().await;
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.b"],
             "destination": {"type": "webhook", "url": url, "sensitive_headers": {"x-k": "1"}}},
            {"id": B, "tenant_id": "t1", "event_types": ["a.b"],
             "destination": {"type": "webhook", "url": url, "sensitive_headers": {"x-k": "2"}}},
        ]);
        run(&t, &file).await.0.unwrap();
        let a = t.subs.get(A).unwrap();
        let mut legacy = (*t.subs.get(B).unwrap()).clone();
        legacy.destination.sensitive_headers = Some(t.kek.seal(br#"{"x-k":"2"}"#, B));
        legacy.version += 1;
        t.subs.put(legacy.clone()).await.unwrap();
        // Without --bind-unbound they stay bound to the id alone: binding them trusts the URL
        // next to them.
        let (mut out, mut report) = (Vec::new(), Reseal::default());
        reseal_all(&t.subs, &t.kek, false, &mut out, &mut report)
            .await
            .unwrap();
        assert!(out.is_empty() && report.resealed == 0);
        assert_eq!(*t.subs.get(B).unwrap(), legacy);

        let (out, report) = reseal_report(&t).await;
        let v = legacy.version + 1;
        assert_eq!(out, format!("resealed {B} v{v}\n"));
        assert_eq!(
            (report.resealed, report.failed.len(), report.moved.len()),
            (1, 0, 0)
        );
        assert_eq!(t.subs.get(A).unwrap(), a, "A was bound already: untouched");
        let b = t.subs.get(B).unwrap();
        assert_eq!(b.version, v);
        let blob = b.destination.sensitive_headers.as_ref().unwrap();
        let (plain, binding) = t.kek.open_bound(blob, B, &url).unwrap();
        assert_eq!(
            (plain.as_slice(), binding),
            (br#"{"x-k":"2"}"#.as_slice(), Binding::Url)
        );

        // Headers that do not open are named, not dropped or rewritten.
        let mut broken = (*b).clone();
        broken
            .destination
            .sensitive_headers
            .as_mut()
            .unwrap()
            .ciphertext[0] ^= 1;
        broken.version += 1;
        t.subs.put(broken.clone()).await.unwrap();
        let (out, report) = reseal_report(&t).await;
        assert!(out.is_empty());
        assert_eq!(report.failed, [(B.to_string(), SecretError::Open)]);
        assert_eq!(*t.subs.get(B).unwrap(), broken);
    }

    /// A subscription whose latest record this binary cannot read (a newer version of the hub
    /// wrote it) is named and left alone: resealing the version before it would write over it.
    #[tokio::test]
    async fn reseal_leaves_a_subscription_whose_latest_record_is_unreadable_alone() {
        let t = target();
        let (url, _) = echo().await;
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.b"],
             "destination": {"type": "webhook", "url": url, "sensitive_headers": {"x-k": "1"}}},
        ]);
        run(&t, &file).await.0.unwrap();
        let mut legacy = (*t.subs.get(A).unwrap()).clone();
        legacy.destination.sensitive_headers = Some(t.kek.seal(br#"{"x-k":"1"}"#, A));
        legacy.version += 1;
        t.subs.put(legacy.clone()).await.unwrap();
        t.subs
            .table()
            .apply(|tb| tb.read_unreadable(A, 0, 1_000_000));
        // And one whose only record is unreadable here (no earlier version).
        t.subs
            .table()
            .apply(|tb| tb.read_unreadable(B, 0, 1_000_001));
        let (out, report) = reseal_report(&t).await;
        assert!(out.is_empty(), "{out}");
        assert_eq!(
            (report.resealed, report.unreadable.as_slice()),
            (0, [A.to_string(), B.to_string()].as_slice())
        );
        assert_eq!(*t.subs.get(A).unwrap(), legacy);
    }

    #[tokio::test]
    async fn a_url_query_is_sealed_no_change_when_applied_again_and_reseal_seals_an_old_plain_one()
    {
        let t = target();
        let (url, _) = echo().await;
        let given = format!("{url}?code=fn_key_1");
        let shown = format!("{url}?code=***");
        let file = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                           "destination": {"type": "webhook", "url": given,
                                           "sensitive_headers": {"x-k": "2"}}}]);
        run(&t, &file).await.0.unwrap();
        let b = t.subs.get(B).unwrap();
        assert_eq!(b.destination.url.as_deref(), Some(shown.as_str()));
        let opened = sealed_url::request_url(Some(&t.kek), B, &b.destination).unwrap();
        assert_eq!(opened, given);
        // Headers bound to the URL requests go to, not to the shown one.
        let headers = b.destination.sensitive_headers.as_ref().unwrap();
        assert_eq!(
            t.kek.open_bound(headers, B, &given).unwrap().1,
            Binding::Url
        );
        assert!(t.kek.open_bound(headers, B, &shown).is_err());
        // The file names the URL as given; stored sealed, it is the same URL. So does the URL
        // as shown; one edited from it is refused, nothing written.
        let (r, out) = run(&t, &file).await;
        assert_eq!(r.unwrap().unchanged, 1, "{out}");
        let mut as_shown = file.clone();
        as_shown[0]["destination"]["url"] = json!(shown);
        let (r, out) = run(&t, &as_shown).await;
        assert_eq!(r.unwrap().unchanged, 1, "{out}");
        as_shown[0]["destination"]["url"] = json!(format!("{url}?code=***&v=2"));
        match run(&t, &as_shown).await.0 {
            Err(ApplyError::Invalid(errors)) => assert_eq!(errors[0].error.code, "redacted"),
            other => panic!("{:?}", other.map(|s| s.to_string())),
        }
        assert_eq!(t.subs.get(B).unwrap(), b);

        // Written before URLs were sealed: the query in plaintext, headers bound to it. Reseal
        // seals it; the headers stay bound to the URL requests go to, which is the same.
        let mut legacy = (*b).clone();
        legacy.destination.url = Some(given.clone());
        legacy.destination.sealed_target = None;
        legacy.destination.sensitive_headers = Some(t.kek.seal_bound(br#"{"x-k":"2"}"#, B, &given));
        legacy.version += 1;
        t.subs.put(legacy.clone()).await.unwrap();
        let (out, _) = reseal_report(&t).await;
        let v = legacy.version + 1;
        assert_eq!(out, format!("resealed {B} v{v}\n"));
        let b = t.subs.get(B).unwrap();
        assert_eq!(b.destination.url.as_deref(), Some(shown.as_str()));
        let opened = sealed_url::request_url(Some(&t.kek), B, &b.destination).unwrap();
        assert_eq!(opened, given);
        let headers = b.destination.sensitive_headers.as_ref().unwrap();
        let (plain, binding) = t.kek.open_bound(headers, B, &given).unwrap();
        assert_eq!(
            (plain.as_slice(), binding),
            (br#"{"x-k":"2"}"#.as_slice(), Binding::Url)
        );
        // Nothing left to seal.
        let (out, report) = reseal_report(&t).await;
        assert!(out.is_empty() && report.resealed == 0);
    }

    /// A KEK rotation ends with `subscriptions reseal`: every value still sealed under the
    /// previous key is sealed again under the current one (an expired signing secret dropped),
    /// after which the current key alone opens the record.
    #[tokio::test]
    async fn reseal_moves_every_sealed_value_to_the_current_key_and_then_the_old_one_can_go() {
        let t = target();
        let (url, _) = echo().await;
        let given = format!("{url}?code=fn_1");
        let file = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                           "destination": {"type": "webhook", "url": given,
                                           "sensitive_headers": {"x-k": "2"}}}]);
        run(&t, &file).await.0.unwrap();
        let now = SystemClock.now_ms(); // as the command reads it
        let mut b = (*t.subs.get(B).unwrap()).clone();
        let secret = |expires_at| t.kek.seal_secret(&generate_signing_secret(), B, expires_at);
        b.signing_secrets.push(secret(Some(now + 3_600_000))); // in its grace
        b.signing_secrets.push(secret(Some(now - 3_600_000))); // expired an hour ago
        b.version += 1;
        t.subs.put(b.clone()).await.unwrap();

        let b64 = |byte: u8| base64::engine::general_purpose::STANDARD.encode([byte; 32]);
        let vars = [
            ("STREAMING_HUB_KEK", b64(4)),
            ("STREAMING_HUB_KEK_ID", "k2".to_string()),
            (
                "STREAMING_HUB_KEK_PREVIOUS",
                format!("{}:{}", t.kek.current_id(), b64(3)),
            ),
        ];
        let config = Config::from_vars(vars.map(|(k, v)| (k.to_string(), v))).unwrap();
        let rotated = Kek::from_config(&config).unwrap();
        let (mut out, mut report) = (Vec::new(), Reseal::default());
        reseal_all(&t.subs, &rotated, false, &mut out, &mut report)
            .await
            .unwrap();
        let v = b.version + 1;
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("resealed {B} v{v}\n")
        );
        let r = t.subs.get(B).unwrap();
        assert_eq!(r.destination.url, b.destination.url, "shown the same");
        assert_eq!(
            r.updated_at, b.updated_at,
            "no new failure span for auto-disable"
        );
        let expiries: Vec<_> = r.signing_secrets.iter().map(|s| s.expires_at).collect();
        assert_eq!(
            expiries,
            [None, Some(now + 3_600_000)],
            "the expired one dropped"
        );

        let alone = Kek::new("k2", &b64(4)).unwrap();
        let live = alone.open_live_secrets(&r.signing_secrets, B, now);
        assert_eq!((live.opened.len(), live.unopened), (2, 0));
        assert_eq!(
            sealed_url::request_url(Some(&alone), B, &r.destination).unwrap(),
            given
        );
        let (headers, binding) = open_sensitive_headers(&alone, &r).unwrap();
        assert_eq!(headers.get("x-k").map(String::as_str), Some("2"));
        assert_eq!(binding, Binding::Url);

        let (mut out, mut report) = (Vec::new(), Reseal::default());
        reseal_all(&t.subs, &rotated, false, &mut out, &mut report)
            .await
            .unwrap();
        assert!(out.is_empty() && report.resealed == 0, "nothing left");
    }

    #[tokio::test]
    async fn a_webhook_that_fails_its_probe_is_written_pending_and_exits_1() {
        let t = target();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        drop(listener); // nothing listens: connect_failed
        let file = json!([{"id": B, "tenant_id": "t1", "event_types": ["a.b"],
                           "destination": {"type": "webhook", "url": url}}]);
        let (r, out) = run(&t, &file).await;
        let summary = r.unwrap();
        assert_eq!(summary.exit_code(), exit::UNVERIFIED);
        assert_eq!(
            summary.unverified,
            [(B.to_string(), "connect_failed".to_string())]
        );
        assert!(out.contains("signing_secret"), "the secret is shown anyway");
        assert!(
            out.contains(&format!("created {B} v1 pending connect_failed: ")),
            "{out}"
        );
        assert_eq!(
            t.subs.get(B).unwrap().verification_state,
            VerificationState::Pending
        );
    }

    #[tokio::test]
    async fn tenant_and_destination_type_cannot_change() {
        let t = target();
        let pull = json!({"type": "pull"});
        let file = json!([
            {"id": A, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
            {"id": B, "tenant_id": "t1", "event_types": ["a.b"], "destination": pull},
        ]);
        run(&t, &file).await.0.unwrap();
        let file = json!([
            {"id": A, "tenant_id": "t2", "event_types": ["a.b"], "destination": pull},
            {"id": B, "tenant_id": "t1", "event_types": ["a.b"],
             "destination": {"type": "webhook", "url": "http://127.0.0.1:9/h"}},
        ]);
        let (r, out) = run(&t, &file).await;
        assert_eq!(
            invalid(r),
            [
                (0, "tenant_id".to_string(), "immutable"),
                (1, "destination.type".into(), "immutable"),
            ]
        );
        assert!(out.is_empty());
        assert_eq!(t.subs.get(A).unwrap().version, 1);
    }

    #[tokio::test]
    async fn absent_enabled_leaves_an_auto_disabled_subscription_alone() {
        let t = target();
        let entry = |enabled: Option<bool>| {
            let mut e = json!({"id": A, "tenant_id": "t1", "event_types": ["a.b"],
                               "destination": {"type": "pull"}});
            if let Some(v) = enabled {
                e["enabled"] = json!(v);
            }
            json!([e])
        };
        run(&t, &entry(None)).await.0.unwrap();
        let mut off = (*t.subs.get(A).unwrap()).clone();
        off.enabled = false;
        off.disabled_reason = Some("auto_disabled".into());
        off.disabled_at = Some(5);
        off.version = 2;
        t.subs.put(off).await.unwrap();

        let (r, _) = run(&t, &entry(None)).await;
        assert_eq!(r.unwrap().unchanged, 1);
        assert!(!t.subs.get(A).unwrap().enabled);

        let (r, out) = run(&t, &entry(Some(true))).await;
        r.unwrap();
        assert_eq!(out, format!("updated {A} v3 active\n"));
        let now = t.subs.get(A).unwrap();
        assert!(now.enabled);
        assert_eq!(
            (now.disabled_reason.as_deref(), now.disabled_at),
            (None, None)
        );
    }
}
