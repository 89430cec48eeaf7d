//! Dispatch: from a matched event to a delivery, at least once.
//!
//! - `jobs`: one job per (event, webhook subscription) and the event's payload stored once, in the
//!   hub task's store, with per-tenant timers; claims and outcomes change them inside the hub
//!   task's transaction;
//! - `curve`: when a failed delivery is tried again;
//! - `health`: failure spans per subscription and auto-disable;
//! - `breaker`: per (tenant, destination) circuit breakers that shed due jobs of a failing sink;
//! - `worker`: one HTTP attempt per claim, on the async runtime, bounded by
//!   `STREAMING_HUB_DISPATCH_WORKERS`.
//!
//! [`DispatchJobs`] is the hub task's event handler: matched pull subscriptions get the event on
//! `<prefix>.pull` (key = subscription id), matched webhook subscriptions get a job.
pub mod breaker;
pub mod curve;
pub mod fair;
pub mod health;
pub mod jobs;
pub mod worker;

use rdkafka::message::{Headers, Message};

use crate::hub::matching::matches_for;
use crate::hub::task::{EventHandler, HubError, SequencedEvent, TaskCtx};
use crate::runtime::fast_avro;
use crate::runtime::records::{
    DestinationType, HeaderRecord, JobRecord, JobState, VerificationState,
};
use crate::runtime::telemetry::{Matched, Redelivery};
use crate::subscriptions::table::SharedTable;

/// Header added to records on `<prefix>.pull`: the tenant's arrival sequence of the event.
pub const H_SEQUENCE: &str = "x-streaming-hub-sequence";

/// Creates jobs (webhooks) and pull records (pull destinations) for matched events.
pub struct DispatchJobs {
    pub table: SharedTable,
    pub pull_topic: String,
}

impl EventHandler for DispatchJobs {
    fn on_event(
        &mut self,
        event: &SequencedEvent<'_>,
        ctx: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        let subs = matches_for(&self.table, event.tenant, event.record);
        Matched {
            ce_id: event.ce_id,
            tenant: event.tenant,
            subscriptions: subs.len(),
        }
        .emit();
        if subs.is_empty() {
            return Ok(());
        }
        let record = event.record;
        let mut created = 0u32;
        for sub in &subs {
            match sub.destination.kind {
                DestinationType::Pull => {
                    let seq = event.sequence.to_string();
                    let mut headers: Vec<(&str, Option<&[u8]>)> = record
                        .headers()
                        .map(|h| h.iter().map(|x| (x.key, x.value)).collect())
                        .unwrap_or_default();
                    headers.push((H_SEQUENCE, Some(seq.as_bytes())));
                    ctx.out.send_with_headers(
                        &self.pull_topic,
                        None,
                        sub.id.as_bytes(),
                        record.payload(),
                        &headers,
                    )?;
                }
                DestinationType::Webhook => {
                    if create_job(ctx, event, &sub.id)? {
                        created += 1;
                    }
                }
            }
        }
        hold_payload(ctx, event, created)
    }

    fn weight(&self, record: &rdkafka::message::BorrowedMessage<'_>) -> usize {
        let Some(tenant) = record.key().and_then(|k| std::str::from_utf8(k).ok()) else {
            return 0;
        };
        if record.headers().is_some_and(|h| {
            h.iter()
                .any(|x| x.key == crate::ops::redeliver::H_REDELIVER)
        }) {
            return 1;
        }
        matches_for(&self.table, tenant, record)
            .iter()
            .filter(|s| s.destination.kind == DestinationType::Webhook)
            .count()
    }

    fn on_redeliver(
        &mut self,
        event: &SequencedEvent<'_>,
        subscription_id: &str,
        ctx: &mut TaskCtx<'_, '_>,
    ) -> Result<(), HubError> {
        let sub = self.table.read().get(subscription_id);
        let outcome = match sub {
            None => "unknown_subscription",
            Some(s) if s.tenant_id != event.tenant => "other_tenant",
            Some(s) if s.destination.kind != DestinationType::Webhook => "not_a_webhook",
            Some(s) if !s.enabled || s.verification_state != VerificationState::Active => {
                "inactive"
            }
            Some(_) => {
                if create_job(ctx, event, subscription_id)? {
                    hold_payload(ctx, event, 1)?;
                    "queued"
                } else {
                    "pending"
                }
            }
        };
        Redelivery {
            ce_id: event.ce_id,
            subscription_id,
            outcome,
        }
        .emit();
        Ok(())
    }
}

/// A new job for (event, subscription), due now; false when that job exists already (a replay
/// or redelivery while the first delivery is still pending).
fn create_job(
    ctx: &mut TaskCtx<'_, '_>,
    event: &SequencedEvent<'_>,
    subscription_id: &str,
) -> Result<bool, HubError> {
    let key = jobs::job_key(event.tenant, event.ce_id, subscription_id);
    let now = ctx.now;
    let mut js = ctx.jobs();
    if js.get_job(&key).map_err(HubError::from)?.is_some() {
        return Ok(false);
    }
    let job = JobRecord {
        event_key: event.ce_id.to_string(),
        subscription_id: subscription_id.to_string(),
        tenant_id: event.tenant.to_string(),
        attempt: 1,
        due_at: now,
        lease_until: None,
        reclaims: 0,
        last_status: None,
        last_error: None,
        state: JobState::Pending,
    };
    js.put_job(&key, &job, None).map_err(HubError::from)?;
    ctx.fresh.push(key);
    Ok(true)
}

/// Stores the event's payload for `created` new jobs (once per event) and arms its tenant's timers.
fn hold_payload(
    ctx: &mut TaskCtx<'_, '_>,
    event: &SequencedEvent<'_>,
    created: u32,
) -> Result<(), HubError> {
    if created == 0 {
        return Ok(());
    }
    let record = event.record;
    let codec = ctx.codec;
    let value = record.payload().unwrap_or_default();
    // Indexed, so the encoder knows the header count up front (the array's block count).
    let encode = |refcount| match record.headers() {
        Some(h) => {
            let pairs = (0..h.count()).map(|i| {
                let x = h.get(i);
                (x.key, x.value)
            });
            fast_avro::encode_payload(codec, pairs, value, refcount)
        }
        None => fast_avro::encode_payload(codec, std::iter::empty(), value, refcount),
    };
    ctx.jobs()
        .hold_payload(
            jobs::payload_key(event.tenant, event.ce_id),
            encode,
            created,
        )
        .map_err(HubError::from)?;
    ctx.ring.add(event.tenant);
    Ok(())
}

/// `<resource>.<event>` of a stored payload's headers.
pub fn event_type_of(headers: &[HeaderRecord]) -> String {
    let get = |k: &str| {
        headers
            .iter()
            .find(|h| h.key == k)
            .and_then(|h| h.value.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
            .unwrap_or("")
            .to_string()
    };
    format!("{}.{}", get("ce-resourcetype"), get("ce-eventtype"))
}
