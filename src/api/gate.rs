//! Operations of one kind that an instance runs at once, bounded per tenant and in all: one past
//! a bound is refused (the caller answers `429`), not queued. Recovers and replays use one
//! ([`crate::api::ops::MAX_SCANS`], one per tenant), verification probes another
//! ([`crate::api::verification::MAX_PROBES`]), and pull reads count each tenant's with one (their
//! instance-wide places are a semaphore a read waits for).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub struct TenantGate {
    per_tenant: usize,
    total: usize,
    running: Arc<Mutex<HashMap<String, usize>>>,
}

/// A place in a [`TenantGate`], given back when dropped.
pub struct GateSlot {
    running: Arc<Mutex<HashMap<String, usize>>>,
    tenant: String,
}

impl TenantGate {
    pub fn new(per_tenant: usize, total: usize) -> TenantGate {
        TenantGate {
            per_tenant,
            total,
            running: Arc::default(),
        }
    }

    pub fn enter(&self, tenant: &str) -> Option<GateSlot> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let total: usize = running.values().sum();
        let mine = running.get(tenant).copied().unwrap_or(0);
        if total >= self.total || mine >= self.per_tenant {
            return None;
        }
        running.insert(tenant.to_string(), mine + 1);
        Some(GateSlot {
            running: self.running.clone(),
            tenant: tenant.to_string(),
        })
    }

    /// Whether no place is taken.
    #[cfg(test)]
    pub fn is_idle(&self) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }
}

impl Drop for GateSlot {
    fn drop(&mut self) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = running.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                running.remove(&self.tenant);
            }
        }
    }
}
