//! Ingest: the first stage of the flow (DESIGN.md §2.1).
//!
//! Ingest owns the verdict on every record producers write to `lerian.streaming.<source>`:
//! **accept** (re-keyed by tenant into `<prefix>.inbox`), **drop** (system events, counted only) or
//! **quarantine** (into `<prefix>.quarantine` with a reason code). It reads routing and identity from
//! the `ce-*` headers only; the payload is never parsed.
//!
//! - [`classify`] is the pure, broker-free verdict for one record: header structure, CloudEvents
//!   attribute rules, tenant, payload size and (optionally) the producer envelope signature.
//! - [`pipeline`] is the loop: consume the follow set, classify, write inbox and quarantine, commit
//!   outputs and input offsets in one transaction per batch.
//! - [`signature`] is the producer envelope signature (`ce-sig`): canonical bytes, HMAC-SHA256,
//!   the operator's key set, each key bound to one `ce-source`.
//! - [`tenant`] is the tenant id rule, shared with the API, tokens and apply files.
//!
//! Invariants: classifying never panics on any input, a record gets exactly one verdict, and the
//! same record always gets the same verdict for the same configuration.
pub mod classify;
pub mod pipeline;
pub mod signature;
pub mod tenant;
