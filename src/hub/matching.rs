//! Matching an inbox record against the subscription table (catalog-free, see
//! `subscriptions::table`); `dispatch::DispatchJobs` calls it for each accepted event inside the
//! hub task's transaction.
//!
//! Matching reads only headers ingest already validated (`ce-source`, `ce-resourcetype`,
//! `ce-eventtype`, `ce-schemaversion`); the payload is never parsed.
use rdkafka::message::Message;

use crate::ingest::classify::schema_major;
use crate::subscriptions::table::{EventRef, SharedTable, Sub};

/// The matching attributes of an inbox record.
pub struct Attributes<'a> {
    pub source: &'a str,
    pub resource: &'a str,
    pub event: &'a str,
    pub schema_major: u32,
}

pub fn attributes<'a>(record: &'a rdkafka::message::BorrowedMessage<'a>) -> Option<Attributes<'a>> {
    let headers = record.headers()?;
    let (mut source, mut resource, mut event, mut major) = (None, None, None, None);
    for (key, v) in crate::runtime::kafka::utf8_headers(headers) {
        let value = || v.and_then(|v| std::str::from_utf8(v).ok());
        match key {
            "ce-source" => source = value(),
            "ce-resourcetype" => resource = value(),
            "ce-eventtype" => event = value(),
            "ce-schemaversion" => major = value().and_then(schema_major),
            _ => {}
        }
    }
    Some(Attributes {
        source: source?,
        resource: resource?,
        event: event?,
        schema_major: major?,
    })
}

/// The subscriptions an inbox record goes to.
pub fn matches_for(
    table: &SharedTable,
    tenant: &str,
    record: &rdkafka::message::BorrowedMessage<'_>,
) -> Vec<Sub> {
    let Some(a) = attributes(record) else {
        return Vec::new();
    };
    table.read().matches(&EventRef {
        tenant,
        source: a.source,
        resource: a.resource,
        event: a.event,
        schema_major: a.schema_major,
    })
}
