//! Delivery: the HTTP side of one attempt (DESIGN.md §4).
//!
//! Delivery owns everything between "this payload goes to that URL" and "the subscriber answered
//! this": the shared HTTP client ([`client`]), the Standard Webhooks signature ([`signing`]), the
//! SSRF guard ([`ssrf`]) and the verification probe sent on create, on URL change and on `/verify`
//! ([`verify`]), and which of the producer's trace headers a delivery forwards
//! ([`trace_context`]). It decides nothing about retries, breakers or state: callers (dispatch,
//! subscriptions) match on the outcome.
//!
//! Invariants:
//! - One attempt is one HTTP request: redirects are never followed (a 3xx is a failure), no system
//!   proxy is used, and the client timeout covers the whole response, body included.
//! - Response bodies are read up to a cap ([`client::read_capped`]), never whole.
//! - No request reaches a private, loopback or link-local address unless
//!   `STREAMING_HUB_ALLOW_PRIVATE_SINKS`: IP literals are refused by [`ssrf::check_url`] (reqwest
//!   does not consult the resolver for them), names are filtered by [`ssrf::GuardedResolver`] at
//!   connect time, so the address connected to is the one that was checked (no DNS rebinding).
//!   Every request goes through [`client::post`] or, for deliveries, [`client::CheckedUrls::post`]:
//!   both run `check_url` first (the latter once per URL string; its verdict depends on nothing
//!   else), and the resolver runs on every new connection.
//! - Signing secrets are [`crate::runtime::secret::Secret`]s; no error or log line carries one.
pub mod client;
pub mod signing;
pub mod ssrf;
pub mod trace_context;
pub mod verify;

#[cfg(test)]
pub(crate) mod tests;
