//! The subscription table every instance holds in memory, built from the control topic, and the
//! catalog-free matcher over it.
//!
//! Index: tenant → pattern → subscriptions, where a pattern is an event key `<resource>.<event>`,
//! `<resource>.*` or `*`. Matching an event looks up at most three patterns of its own tenant and
//! checks origin, schema major and the gates (`enabled` and `verification_state = active`) on the
//! hits, so its cost does not grow with other tenants' or other event types' subscriptions.
//! Lookups borrow the event's strings: no allocation per event beyond the result.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::runtime::records::{SubscriptionRecord, VerificationState};

pub type Sub = Arc<SubscriptionRecord>;

#[derive(Default)]
pub struct Table {
    by_id: HashMap<String, Sub>,
    /// Each tenant's subscriptions by id: a tenant's list reads its own, not every tenant's
    /// (a listing, and the limit check of every create, walked the whole table).
    by_tenant: HashMap<String, BTreeMap<String, Sub>>,
    index: HashMap<String, HashMap<String, Vec<Sub>>>,
    /// Per control partition, the offset after the last record the control reader applied.
    read_to: HashMap<i32, i64>,
    /// This instance's own writes the control reader has not reached yet, per subscription id:
    /// where each landed (partition, offset). The table shows them already (read-your-writes);
    /// the reader skips the id's records before them, which the log order puts under them.
    written: HashMap<String, (i32, i64)>,
    /// Subscriptions whose latest control record could not be read (a schema this version does
    /// not know, a key that is not its id, …): the table keeps the version before it, if any
    /// (still matched, so an old instance in a rolling upgrade keeps creating their jobs), but
    /// their deliveries are held, neither sent on a version that may be stale nor dropped as a
    /// deleted subscription's are, and the API does not write over them.
    unreadable: HashSet<String>,
    /// Auto-disables this instance's hub loops wrote, not read back yet (see
    /// [`Table::expect_auto_disable`]), and the ones read over a newer record.
    auto_disables: AutoDisables,
}

/// See [`Table::expect_auto_disable`].
#[derive(Default)]
struct AutoDisables {
    /// Subscription id → the version and `updated_at` of the auto-disable written for it.
    expected: HashMap<String, (u64, i64)>,
    over_newer: Vec<OverNewer>,
}

/// At most this many auto-disables are remembered at once (each is a subscription failing for
/// 120 h; one whose transaction aborted is never read back, and is forgotten at the next
/// auto-disable of its subscription).
const MAX_AUTO_DISABLES: usize = 10_000;

/// An auto-disable of this instance's that the reader applied over a record at least as new as
/// it: the hub planned it from a version before a write another writer made meanwhile (a PATCH,
/// a rotation), and it undid that write on every instance.
#[derive(Debug, Clone)]
pub struct OverNewer {
    pub disable: Sub,
    /// The record it went over; `None`, a deletion (the hub planned from a table that had it,
    /// so one the table no longer has was deleted since).
    pub newer: Option<Sub>,
}

/// What an event offers to matching.
#[derive(Debug, Clone, Copy)]
pub struct EventRef<'a> {
    pub tenant: &'a str,
    pub source: &'a str,
    pub resource: &'a str,
    pub event: &'a str,
    pub schema_major: u32,
}

impl Table {
    /// Inserts or replaces a subscription (an older version never replaces a newer one): for
    /// tables not fed by the control topic (in memory, benchmarks); its reader uses
    /// [`Table::read_record`].
    pub fn upsert(&mut self, sub: SubscriptionRecord) {
        if let Some(old) = self.by_id.get(&sub.id) {
            if old.version > sub.version {
                return;
            }
        }
        self.remove(&sub.id.clone());
        self.insert(sub);
    }

    /// A control record as the reader reads it, in log order: the subscription as it stands
    /// (`None`: a tombstone). Whatever its version, the later record wins, as the topic's
    /// compaction keeps it, so an instance that reads the compacted topic from the start holds
    /// what a long-running one holds. (An older version arriving after a newer one, a writer
    /// that planned from a stale table, was ignored here but kept by compaction: instances
    /// restarted later held it and the others did not.) Records before a write of this
    /// instance's own still to come are skipped: the write goes over them.
    pub fn read_record(
        &mut self,
        id: &str,
        rec: Option<SubscriptionRecord>,
        partition: i32,
        offset: i64,
    ) {
        if self.under_local_write(id, partition, offset) {
            return;
        }
        if let Some(rec) = &rec {
            self.note_auto_disable_read(rec);
        }
        self.remove(id);
        self.unreadable.remove(id);
        if let Some(rec) = rec {
            self.insert(rec);
        }
    }

    /// Before the hub writes an auto-disable (`disabled`, planned from this table): when the
    /// reader reads it back over a record as new as it or newer, written meanwhile by another
    /// writer (the hub's table lagged behind it), it is kept for [`Table::take_over_newer`], so
    /// that write can be made again: the auto-disable would not have been made had the hub seen
    /// it (a change restarts the failure span), and the table takes records in the log's order.
    pub fn expect_auto_disable(&mut self, disabled: &SubscriptionRecord) {
        let expected = &mut self.auto_disables.expected;
        if expected.len() >= MAX_AUTO_DISABLES && !expected.contains_key(&disabled.id) {
            tracing::warn!(
                subscription_id = %disabled.id,
                "too many auto-disables not read back yet: this one is not checked for a newer write it went over"
            );
            return;
        }
        expected.insert(disabled.id.clone(), (disabled.version, disabled.updated_at));
    }

    fn note_auto_disable_read(&mut self, rec: &SubscriptionRecord) {
        let ours = self.auto_disables.expected.get(&rec.id) == Some(&(rec.version, rec.updated_at));
        if !ours {
            return;
        }
        self.auto_disables.expected.remove(&rec.id);
        let newer = match self.by_id.get(&rec.id) {
            Some(cur) if cur.version >= rec.version => Some(cur.clone()),
            Some(_) => return,
            None if self.unreadable.contains(&rec.id) => return,
            None => None,
        };
        let over = &mut self.auto_disables.over_newer;
        if over.len() < MAX_AUTO_DISABLES {
            over.push(OverNewer {
                disable: Arc::new(rec.clone()),
                newer,
            });
        }
    }

    /// The auto-disables of this instance read over a newer record since the last call.
    pub fn take_over_newer(&mut self) -> Vec<OverNewer> {
        std::mem::take(&mut self.auto_disables.over_newer)
    }

    pub fn has_over_newer(&self) -> bool {
        !self.auto_disables.over_newer.is_empty()
    }

    /// A control record for `id` the reader could not read, in log order: [`Table::is_unreadable`]
    /// says so until a later record for it; the version before it, if any, stays (see
    /// `unreadable`).
    pub fn read_unreadable(&mut self, id: &str, partition: i32, offset: i64) {
        if self.under_local_write(id, partition, offset) {
            return;
        }
        self.unreadable.insert(id.to_string());
    }

    /// Whether a write of this instance's own, still to be read back, goes over `id`'s record
    /// at (`partition`, `offset`); a record at or past it ends the wait for it.
    fn under_local_write(&mut self, id: &str, partition: i32, offset: i64) -> bool {
        match self.written.get(id) {
            Some(&(p, o)) if p == partition && offset < o => true,
            Some(_) => {
                self.written.remove(id);
                false
            }
            None => false,
        }
    }

    /// Ids whose latest control record could not be read, with or without an earlier version
    /// in the table.
    pub fn unreadable_ids(&self) -> impl Iterator<Item = &String> {
        self.unreadable.iter()
    }

    /// Whether `id`'s latest control record could not be read (see [`Table::read_unreadable`]).
    pub fn is_unreadable(&self, id: &str) -> bool {
        self.unreadable.contains(id)
    }

    /// This instance's write, taken by the broker at (`partition`, `offset`) and not read back
    /// yet: shown at once (`rec`, or `None` for a deletion) and kept over the records before it
    /// the reader has still to apply.
    pub fn write_local(
        &mut self,
        id: &str,
        rec: Option<SubscriptionRecord>,
        partition: i32,
        offset: i64,
    ) {
        if self.has_read(partition, offset) {
            return; // read already: the table shows it, or what later records made of it
        }
        if self
            .written
            .get(id)
            .is_some_and(|&(p, o)| p == partition && o > offset)
        {
            return; // a later write of this instance's own stands already
        }
        self.written.insert(id.to_string(), (partition, offset));
        self.remove(id);
        self.unreadable.remove(id);
        if let Some(rec) = rec {
            self.insert(rec);
        }
    }

    fn insert(&mut self, sub: SubscriptionRecord) {
        let sub = Arc::new(sub);
        let patterns = self.index.entry(sub.tenant_id.clone()).or_default();
        for p in &sub.event_types {
            patterns.entry(p.clone()).or_default().push(sub.clone());
        }
        self.by_tenant
            .entry(sub.tenant_id.clone())
            .or_default()
            .insert(sub.id.clone(), sub.clone());
        self.by_id.insert(sub.id.clone(), sub);
    }

    /// The control reader has applied the record at `offset` of control partition `partition`.
    pub fn note_read(&mut self, partition: i32, offset: i64) {
        let next = self.read_to.entry(partition).or_insert(0);
        *next = (*next).max(offset + 1);
    }

    /// Whether the control reader has applied the record at `offset` of `partition` (so the
    /// table shows it, or what later records made of it).
    pub fn has_read(&self, partition: i32, offset: i64) -> bool {
        self.read_to
            .get(&partition)
            .is_some_and(|next| *next > offset)
    }

    pub fn remove(&mut self, id: &str) -> Option<Sub> {
        let old = self.by_id.remove(id)?;
        if let Some(mine) = self.by_tenant.get_mut(&old.tenant_id) {
            mine.remove(id);
            if mine.is_empty() {
                self.by_tenant.remove(&old.tenant_id);
            }
        }
        if let Some(patterns) = self.index.get_mut(&old.tenant_id) {
            for p in &old.event_types {
                if let Some(v) = patterns.get_mut(p) {
                    v.retain(|s| s.id != id);
                    if v.is_empty() {
                        patterns.remove(p);
                    }
                }
            }
            if patterns.is_empty() {
                self.index.remove(&old.tenant_id);
            }
        }
        Some(old)
    }

    pub fn get(&self, id: &str) -> Option<Sub> {
        self.by_id.get(id).cloned()
    }

    /// `tenant`'s subscription `id`: a record of another tenant under that id (one deleted and
    /// applied again for another tenant) is, for `tenant`'s jobs, a deleted subscription.
    pub fn get_of(&self, tenant: &str, id: &str) -> Option<Sub> {
        self.by_id
            .get(id)
            .filter(|s| s.tenant_id == tenant)
            .cloned()
    }

    /// Every subscription, in no particular order (background scans, such as the pending retrier).
    pub fn iter(&self) -> impl Iterator<Item = &Sub> {
        self.by_id.values()
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The tenant's subscriptions, ordered by id (UUIDv7: creation order).
    pub fn list(&self, tenant: &str) -> Vec<Sub> {
        self.by_tenant
            .get(tenant)
            .map(|mine| mine.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The subscriptions an event goes to: its tenant's, by event key or wildcard, with origin and
    /// schema major checked, enabled and active only. Each subscription at most once.
    pub fn matches(&self, e: &EventRef<'_>) -> Vec<Sub> {
        let mut out: Vec<Sub> = Vec::new();
        let Some(patterns) = self.index.get(e.tenant) else {
            return out;
        };
        let mut key = String::with_capacity(e.resource.len() + e.event.len() + 2);
        key.push_str(e.resource);
        key.push('.');
        key.push_str(e.event);
        let exact = patterns.get(key.as_str());
        key.truncate(e.resource.len() + 1);
        key.push('*');
        let resource_wild = patterns.get(key.as_str());
        let all = patterns.get("*");
        for list in [exact, resource_wild, all].into_iter().flatten() {
            for s in list {
                if admitted(s, e) && !out.iter().any(|o| o.id == s.id) {
                    out.push(s.clone());
                }
            }
        }
        out
    }
}

/// Whether the event goes to this one subscription (the same rule as [`Table::matches`]).
pub fn sub_matches(s: &SubscriptionRecord, e: &EventRef<'_>) -> bool {
    s.tenant_id == e.tenant
        && admitted(s, e)
        && s.event_types.iter().any(|p| {
            p == "*"
                || p.strip_suffix(".*").is_some_and(|r| r == e.resource)
                || p.split_once('.') == Some((e.resource, e.event))
        })
}

fn admitted(s: &SubscriptionRecord, e: &EventRef<'_>) -> bool {
    s.enabled
        && s.verification_state == VerificationState::Active
        && s.origin.as_deref().is_none_or(|o| o == e.source)
        && s.schema_major.is_none_or(|m| m == e.schema_major)
}

/// The table shared by the control-topic reader (writer side), the hub tasks and the API.
#[derive(Clone, Default)]
pub struct SharedTable {
    inner: Arc<RwLock<Table>>,
    changed: Arc<tokio::sync::Notify>,
    caught_up: Arc<std::sync::atomic::AtomicBool>,
}

impl SharedTable {
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn apply(&self, f: impl FnOnce(&mut Table)) {
        f(&mut self.inner.write().unwrap_or_else(|p| p.into_inner()));
        self.changed.notify_waiters();
    }

    pub fn set_caught_up(&self) {
        self.caught_up
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// True once the whole control topic has been read at start-up.
    pub fn is_caught_up(&self) -> bool {
        self.caught_up.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until `cond` holds on the table (read-your-writes for the API), or the timeout.
    pub async fn wait_for(&self, timeout: Duration, cond: impl Fn(&Table) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if cond(&self.read()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return cond(&self.read());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(id: &str, tenant: &str, types: &[&str]) -> SubscriptionRecord {
        SubscriptionRecord::pull(id, tenant, types)
    }

    fn ev<'a>(
        tenant: &'a str,
        source: &'a str,
        resource: &'a str,
        event: &'a str,
        major: u32,
    ) -> EventRef<'a> {
        EventRef {
            tenant,
            source,
            resource,
            event,
            schema_major: major,
        }
    }

    fn ids(v: Vec<Sub>) -> Vec<String> {
        let mut v: Vec<String> = v.iter().map(|s| s.id.clone()).collect();
        v.sort();
        v
    }

    #[test]
    fn an_auto_disable_of_ours_read_over_a_newer_record_is_kept_with_it() {
        let mut t = Table::default();
        let mut v1 = sub("a", "t1", &["*"]);
        v1.updated_at = 10;
        t.read_record("a", Some(v1.clone()), 0, 0);
        // The hub planned from version 1; a PATCH made version 2 meanwhile.
        let mut disable = v1.clone();
        disable.enabled = false;
        disable.version = 2;
        disable.updated_at = 50;
        t.expect_auto_disable(&disable);
        let mut patch = v1.clone();
        patch.version = 2;
        patch.updated_at = 40;
        patch.event_types = vec!["transaction.*".into()];
        t.read_record("a", Some(patch.clone()), 0, 1);
        assert!(!t.has_over_newer(), "the PATCH alone is no conflict");
        t.read_record("a", Some(disable.clone()), 0, 2);
        assert!(
            !t.get("a").unwrap().enabled,
            "log order: the auto-disable is in force"
        );
        let over = t.take_over_newer();
        assert_eq!(over.len(), 1);
        assert_eq!(over[0].newer.as_deref(), Some(&patch));
        assert_eq!(*over[0].disable, disable);
        assert!(t.take_over_newer().is_empty(), "taken once");

        // Planned from the latest version: nothing kept.
        let mut next = disable.clone();
        next.enabled = true;
        next.version = 3;
        t.read_record("a", Some(next.clone()), 0, 3);
        let mut again = next.clone();
        again.enabled = false;
        again.version = 4;
        again.updated_at = 90;
        t.expect_auto_disable(&again);
        t.read_record("a", Some(again), 0, 4);
        assert!(!t.has_over_newer());

        // Another writer's stale record, not an auto-disable of this instance's: not kept.
        let mut stale = next.clone();
        stale.version = 4;
        stale.updated_at = 91;
        t.read_record("a", Some(stale.clone()), 0, 5);
        assert!(!t.has_over_newer());

        // Planned before a deletion the reader read first: kept as one.
        let mut last = stale.clone();
        last.enabled = false;
        last.version = 5;
        last.updated_at = 99;
        t.expect_auto_disable(&last);
        t.read_record("a", None, 0, 6);
        t.read_record("a", Some(last.clone()), 0, 7);
        let over = t.take_over_newer();
        assert_eq!(over.len(), 1);
        assert!(over[0].newer.is_none(), "over a deletion");
        assert_eq!(
            t.get("a").as_deref(),
            Some(&last),
            "back, disabled, in log order"
        );
    }

    #[test]
    fn a_tenants_list_is_its_own_in_id_order_as_ids_move_and_go() {
        let mut t = Table::default();
        for (id, tenant) in [("c", "t1"), ("a", "t1"), ("b", "t2"), ("d", "t1")] {
            t.upsert(sub(id, tenant, &["*"]));
        }
        let listed = |t: &Table, tenant: &str| -> Vec<String> {
            t.list(tenant).iter().map(|s| s.id.clone()).collect()
        };
        assert_eq!(listed(&t, "t1"), ["a", "c", "d"]);
        assert_eq!(listed(&t, "t2"), ["b"]);
        // An id applied again for another tenant moves lists; a removed one leaves its own.
        let mut moved = sub("c", "t2", &["*"]);
        moved.version = 2;
        t.upsert(moved);
        t.remove("b");
        assert_eq!(listed(&t, "t1"), ["a", "d"]);
        assert_eq!(listed(&t, "t2"), ["c"]);
        t.remove("c");
        assert!(listed(&t, "t2").is_empty());
        assert!(
            !t.by_tenant.contains_key("t2"),
            "an empty tenant is not kept"
        );
    }

    #[test]
    fn exact_resource_wildcard_and_catch_all_each_match_once() {
        let mut t = Table::default();
        t.upsert(sub("a", "t1", &["transaction.created"]));
        t.upsert(sub("b", "t1", &["transaction.*"]));
        t.upsert(sub("c", "t1", &["*"]));
        t.upsert(sub("d", "t1", &["account.created"]));
        t.upsert(sub(
            "e",
            "t1",
            &["transaction.created", "transaction.*", "*"],
        ));
        assert_eq!(
            ids(t.matches(&ev("t1", "ledger", "transaction", "created", 1))),
            ["a", "b", "c", "e"]
        );
        assert_eq!(
            ids(t.matches(&ev("t1", "ledger", "transaction", "posted", 1))),
            ["b", "c", "e"]
        );
        assert_eq!(
            ids(t.matches(&ev("t1", "ledger", "balance", "config-changed", 1))),
            ["c", "e"]
        );
    }

    #[test]
    fn one_subscription_rule_agrees_with_the_index() {
        let mut t = Table::default();
        let mut pinned = sub("p", "t1", &["transaction.created"]);
        pinned.origin = Some("ledger".into());
        pinned.schema_major = Some(2);
        let mut off = sub("x", "t1", &["*"]);
        off.enabled = false;
        let subs = [
            sub("a", "t1", &["transaction.created"]),
            sub("b", "t1", &["transaction.*"]),
            sub("c", "t1", &["*"]),
            sub("d", "t2", &["*"]),
            sub("e", "t1", &["account.created", "transaction.posted"]),
            pinned,
            off,
        ];
        for s in &subs {
            t.upsert(s.clone());
        }
        for e in [
            ev("t1", "ledger", "transaction", "created", 1),
            ev("t1", "ledger", "transaction", "created", 2),
            ev("t1", "tracer", "transaction", "created", 2),
            ev("t1", "ledger", "transaction", "posted", 1),
            ev("t1", "ledger", "account", "created", 1),
            ev("t2", "ledger", "account", "deleted", 1),
            ev("t3", "ledger", "account", "deleted", 1),
        ] {
            let one_by_one: Vec<String> = subs
                .iter()
                .filter(|s| sub_matches(s, &e))
                .map(|s| s.id.clone())
                .collect();
            let mut one_by_one = one_by_one;
            one_by_one.sort();
            assert_eq!(one_by_one, ids(t.matches(&e)), "{e:?}");
        }
    }

    #[test]
    fn another_tenant_never_matches() {
        let mut t = Table::default();
        t.upsert(sub("a", "t1", &["*"]));
        assert!(
            t.matches(&ev("t2", "ledger", "transaction", "created", 1))
                .is_empty()
        );
    }

    #[test]
    fn origin_pin_tells_two_producers_identical_keys_apart() {
        let mut t = Table::default();
        let mut s = sub("a", "t1", &["rule.activated"]);
        s.origin = Some("tracer".into());
        t.upsert(s);
        assert_eq!(
            ids(t.matches(&ev("t1", "tracer", "rule", "activated", 1))),
            ["a"]
        );
        assert!(
            t.matches(&ev("t1", "ledger", "rule", "activated", 1))
                .is_empty()
        );
    }

    #[test]
    fn schema_major_pin_matches_only_that_major() {
        let mut t = Table::default();
        let mut s = sub("a", "t1", &["*"]);
        s.schema_major = Some(2);
        t.upsert(s);
        assert!(t.matches(&ev("t1", "ledger", "x", "y", 1)).is_empty());
        assert_eq!(ids(t.matches(&ev("t1", "ledger", "x", "y", 2))), ["a"]);
    }

    #[test]
    fn disabled_or_not_active_subscriptions_are_not_admitted() {
        let mut t = Table::default();
        let mut off = sub("off", "t1", &["*"]);
        off.enabled = false;
        let mut pending = sub("pending", "t1", &["*"]);
        pending.verification_state = VerificationState::Pending;
        let mut failed = sub("failed", "t1", &["*"]);
        failed.verification_state = VerificationState::Failed;
        t.upsert(off);
        t.upsert(pending);
        t.upsert(failed);
        t.upsert(sub("ok", "t1", &["*"]));
        assert_eq!(ids(t.matches(&ev("t1", "ledger", "x", "y", 1))), ["ok"]);
    }

    #[test]
    fn the_reader_applies_records_in_log_order_whatever_their_version() {
        let mut t = Table::default();
        let mut v3 = sub("a", "t1", &["x.y"]);
        v3.version = 3;
        t.read_record("a", Some(v3), 0, 10);
        // A writer that planned from a stale table wrote version 2 after it: compaction keeps it,
        // so every table holds it, not only the ones restarted after the compaction.
        let mut v2 = sub("a", "t1", &["x.z"]);
        v2.version = 2;
        t.read_record("a", Some(v2), 0, 11);
        assert_eq!(t.get("a").unwrap().version, 2);
        assert_eq!(ids(t.matches(&ev("t1", "s", "x", "z", 1))), ["a"]);
        assert!(t.matches(&ev("t1", "s", "x", "y", 1)).is_empty());
        t.read_record("a", None, 0, 12);
        assert!(t.get("a").is_none() && t.index.is_empty());
    }

    #[test]
    fn an_own_write_not_read_back_stands_over_the_records_before_it() {
        let mut t = Table::default();
        t.note_read(0, 4);
        let mut v5 = sub("a", "t1", &["x.y"]);
        v5.version = 5;
        t.write_local("a", Some(v5.clone()), 0, 9);
        assert_eq!(t.get("a").unwrap().version, 5);
        // The reader, behind, applies what came before it: skipped.
        let mut v4 = sub("a", "t1", &["x.z"]);
        v4.version = 4;
        t.read_record("a", Some(v4), 0, 6);
        t.read_record("a", None, 0, 7);
        assert_eq!(t.get("a").unwrap().version, 5);
        // Its own record, then a later one: applied as read.
        t.read_record("a", Some(v5), 0, 9);
        let mut v6 = sub("a", "t1", &["x.q"]);
        v6.version = 6;
        t.read_record("a", Some(v6), 0, 10);
        assert_eq!(t.get("a").unwrap().version, 6);
        // A deletion not read back: gone at once, and an older record does not bring it back.
        t.write_local("a", None, 0, 20);
        assert!(t.get("a").is_none());
        let mut v7 = sub("a", "t1", &["x.q"]);
        v7.version = 7;
        t.read_record("a", Some(v7.clone()), 0, 15);
        assert!(t.get("a").is_none(), "written before the tombstone");
        t.read_record("a", None, 0, 20);
        t.read_record("a", Some(v7), 0, 21);
        assert_eq!(t.get("a").unwrap().version, 7, "written after it");
        // A write the reader went past already changes nothing.
        t.note_read(0, 30);
        t.write_local("a", None, 0, 25);
        assert_eq!(t.get("a").unwrap().version, 7);
        // Of two own writes not read back, the later one stands, whichever was noted last.
        t.write_local("a", None, 0, 40);
        t.write_local("a", Some(sub("a", "t1", &["x.q"])), 0, 35);
        assert!(t.get("a").is_none());
    }

    #[test]
    fn an_unreadable_record_marks_its_subscription_until_a_readable_one() {
        let mut t = Table::default();
        t.read_record("a", Some(sub("a", "t1", &["x.y"])), 0, 1);
        t.read_unreadable("a", 0, 2);
        assert!(t.is_unreadable("a"));
        assert_eq!(
            ids(t.matches(&ev("t1", "s", "x", "y", 1))),
            ["a"],
            "the version before it is still matched"
        );
        t.read_record("a", Some(sub("a", "t1", &["x.y"])), 0, 3);
        assert!(t.get("a").is_some() && !t.is_unreadable("a"));
        t.read_unreadable("a", 0, 4);
        t.read_record("a", None, 0, 5);
        assert!(!t.is_unreadable("a"), "deleted: nothing left to hold");
        // Under an own write not read back, an unreadable record before it changes nothing; the
        // write clears an earlier mark.
        t.read_unreadable("b", 0, 6);
        t.write_local("b", Some(sub("b", "t1", &["x.y"])), 0, 9);
        assert!(!t.is_unreadable("b"));
        t.read_unreadable("b", 0, 8);
        assert!(t.get("b").is_some() && !t.is_unreadable("b"));
    }

    #[test]
    fn update_moves_the_index_and_remove_clears_it_and_old_versions_lose() {
        let mut t = Table::default();
        t.upsert(sub("a", "t1", &["x.y"]));
        let mut v2 = sub("a", "t1", &["x.z"]);
        v2.version = 2;
        t.upsert(v2);
        assert!(t.matches(&ev("t1", "s", "x", "y", 1)).is_empty());
        assert_eq!(ids(t.matches(&ev("t1", "s", "x", "z", 1))), ["a"]);
        t.upsert(sub("a", "t1", &["x.y"])); // version 1 arrives late: ignored
        assert_eq!(ids(t.matches(&ev("t1", "s", "x", "z", 1))), ["a"]);
        t.remove("a");
        assert!(t.matches(&ev("t1", "s", "x", "z", 1)).is_empty());
        assert!(t.index.is_empty(), "no empty buckets left behind");
    }
}
