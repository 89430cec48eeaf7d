//! The hub stage: per inbox partition, dedup on `ce-id`, the tenant's arrival sequence, and the
//! hand-off to matching and jobs, all inside one transaction per batch (see `task`).
pub mod dedup;
pub mod matching;
pub mod task;
