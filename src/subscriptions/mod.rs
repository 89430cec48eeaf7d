//! Subscriptions: who receives which events, and where.
//!
//! - `table`: the in-memory subscription table and the catalog-free matcher;
//! - `control`: the compacted control topic that is the table's truth, followed by every instance,
//!   and the read-your-writes handle the API and CLI write through;
//! - `secrets`: signing secrets and credentials encrypted at rest under the KEK;
//! - `model`: the API's JSON shapes and their validation.
pub mod control;
pub mod model;
pub mod secrets;
pub mod table;
