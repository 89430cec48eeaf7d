//! Subscriptions: who receives which events, and where.
//!
//! - `table`: the in-memory subscription table and the catalog-free matcher;
//! - `control`: the compacted control topic that is the table's truth, followed by every instance,
//!   and the read-your-writes handle the API and CLI write through;
//! - `secrets`: signing secrets and credentials encrypted at rest under the KEK;
//! - `sealed_url`: a webhook URL's query stored sealed, shown with its values redacted;
//! - `model`: the API's JSON shapes and their validation;
//! - `apply`: `streaming-hub subscriptions apply -f file.json`, subscriptions as code (GitOps);
//! - `pending`: the verification probe of a stored subscription and the task that retries pending
//!   ones until `active` or `failed`.
pub mod apply;
pub mod control;
pub mod model;
pub mod pending;
pub mod reassert;
pub mod rounds;
pub mod sealed_url;
pub mod secrets;
pub mod table;
