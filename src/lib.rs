//! Streaming Hub: a Kafka-native event delivery hub.
//!
//! The modules follow the flow in DESIGN.md: `ingest` classifies producers' CloudEvents records and
//! re-keys them by tenant into the inbox; `runtime` holds what every stage stands on (configuration
//! of Kafka clients, the clock, the topology, Avro codecs).
pub mod api;
pub mod app;
pub mod bench;
pub mod config;
pub mod delivery;
pub mod demo;
pub mod dispatch;
pub mod hub;
pub mod ingest;
pub mod load;
pub mod ops;
pub mod replay;
pub mod runtime;
pub mod subscriptions;
