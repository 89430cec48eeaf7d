//! What every stage stands on: the Kafka clients and their security settings (`kafka`), the
//! topology of the hub's own topics (`topology`), Avro codecs for the records on them (`avro`,
//! `records`), the injected clock (`clock`), the secret type (`secret`) and telemetry (`telemetry`).
//! Stages depend on `runtime`, never the reverse.
pub mod avro;
pub mod changelog;
pub mod clock;
pub mod fast_avro;
pub mod kafka;
pub mod liveness;
pub mod orphans;
pub mod records;
pub mod secret;
pub mod served;
pub mod store;
pub mod telemetry;
pub mod topology;
