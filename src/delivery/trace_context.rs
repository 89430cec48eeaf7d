//! The producer's W3C trace context (`traceparent`, `tracestate`), forwarded on its deliveries so
//! a receiver's trace joins the producer's.
//!
//! Ingest carries these Kafka headers as they are, never judging them; here they are read once
//! per event ([`crate::dispatch::EventView`]) and forwarded only when well formed
//! (W3C Trace Context Level 1, §3.2 and §3.3):
//! - `traceparent`: `version-traceid-parentid-flags`, all lower-case hex: a 2-digit version other
//!   than `ff`, a 32-digit trace id and a 16-digit parent id, neither all zeros, and 2-digit
//!   flags. Version `00` is exactly 55 characters; a later version may go on past them after a
//!   `-`, in visible ASCII, up to [`MAX_TRACE_HEADER_BYTES`] in all.
//! - `tracestate`: only with a forwarded `traceparent` (the spec ties it to one), not empty, at
//!   most [`MAX_TRACE_HEADER_BYTES`] bytes of visible ASCII and space (0x20–0x7E); its list
//!   members are not parsed.
//!
//! A header present more than once (in any case) is not forwarded: which copy the producer meant
//! is unknown. A subscription's custom headers never set either: both names are reserved
//! ([`crate::subscriptions::model::is_reserved_header`]).
use reqwest::header::{HeaderName, HeaderValue};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Longest `tracestate` forwarded, and longest `traceparent` of a version after `00`.
pub const MAX_TRACE_HEADER_BYTES: usize = 512;

/// Length of a version `00` `traceparent`, and of the part every version starts with.
const TRACEPARENT_BYTES: usize = 55;

/// Lower-case hex digits, and not all zeros when `nonzero`.
fn is_lower_hex(field: &[u8], nonzero: bool) -> bool {
    field.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && (!nonzero || field.iter().any(|&b| b != b'0'))
}

/// A W3C `traceparent` (see the module doc).
pub fn is_valid_traceparent(value: &[u8]) -> bool {
    let Some(head) = value.get(..TRACEPARENT_BYTES) else {
        return false;
    };
    let (version, trace_id, parent_id, flags) =
        (&head[..2], &head[3..35], &head[36..52], &head[53..]);
    let well_formed = head[2] == b'-'
        && head[35] == b'-'
        && head[52] == b'-'
        && is_lower_hex(version, false)
        && version != b"ff"
        && is_lower_hex(trace_id, true)
        && is_lower_hex(parent_id, true)
        && is_lower_hex(flags, false);
    let rest = &value[TRACEPARENT_BYTES..];
    well_formed
        && (rest.is_empty()
            || (version != b"00"
                && rest[0] == b'-'
                && value.len() <= MAX_TRACE_HEADER_BYTES
                && rest.iter().all(u8::is_ascii_graphic)))
}

/// A `tracestate` to forward (see the module doc).
pub fn is_valid_tracestate(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= MAX_TRACE_HEADER_BYTES
        && value.iter().all(|b| (0x20..=0x7e).contains(b))
}

/// What a delivery forwards of its event's trace context.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: Option<HeaderValue>,
    /// Only with a `traceparent`.
    pub tracestate: Option<HeaderValue>,
}

impl TraceContext {
    /// The headers to send, `traceparent` first.
    pub fn headers(&self) -> impl Iterator<Item = (HeaderName, &HeaderValue)> {
        let parent = self.traceparent.iter().map(|v| (TRACEPARENT, v));
        parent.chain(self.tracestate.iter().map(|v| (TRACESTATE, v)))
    }
}

/// One trace header as a record carries it: absent, once (its value, `None` for a null one), or
/// more than once.
#[derive(Debug, Clone, Copy, Default)]
enum Seen<'h> {
    #[default]
    Absent,
    Once(Option<&'h [u8]>),
    Repeated,
}

impl<'h> Seen<'h> {
    fn add(&mut self, value: Option<&'h [u8]>) {
        *self = match self {
            Seen::Absent => Seen::Once(value),
            _ => Seen::Repeated,
        };
    }

    /// Its value when present once and `valid`.
    fn valid(self, valid: fn(&[u8]) -> bool) -> Option<HeaderValue> {
        match self {
            Seen::Once(Some(v)) if valid(v) => HeaderValue::from_bytes(v).ok(),
            _ => None,
        }
    }
}

/// Gathers a record's trace headers, one header at a time, in a pass over all of them.
#[derive(Debug, Default)]
pub struct TraceHeaders<'h> {
    traceparent: Seen<'h>,
    tracestate: Seen<'h>,
}

impl<'h> TraceHeaders<'h> {
    /// Takes note of a header of the record, if it is a trace header.
    pub fn add(&mut self, name: &str, value: Option<&'h [u8]>) {
        if name.eq_ignore_ascii_case(TRACEPARENT.as_str()) {
            self.traceparent.add(value);
        } else if name.eq_ignore_ascii_case(TRACESTATE.as_str()) {
            self.tracestate.add(value);
        }
    }

    /// What to forward of them.
    pub fn forwarded(self) -> TraceContext {
        let traceparent = self.traceparent.valid(is_valid_traceparent);
        let tracestate = traceparent
            .as_ref()
            .and_then(|_| self.tracestate.valid(is_valid_tracestate));
        TraceContext {
            traceparent,
            tracestate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn forwarded(headers: &[(&str, Option<&str>)]) -> TraceContext {
        let mut seen = TraceHeaders::default();
        for (name, value) in headers {
            seen.add(name, value.map(str::as_bytes));
        }
        seen.forwarded()
    }

    #[test]
    fn a_w3c_traceparent_is_valid_and_malformed_ones_are_not() {
        assert!(is_valid_traceparent(PARENT.as_bytes()));
        assert!(is_valid_traceparent(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        ));
        // A later version may go on past the 55 characters after a dash.
        assert!(is_valid_traceparent(
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next"
        ));
        assert!(is_valid_traceparent(
            b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09"
        ));
        for bad in [
            // Version ff is invalid; 00 is exactly 55 characters.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Upper case, other characters, misplaced dashes.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0G",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "004-bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "",
        ] {
            assert!(!is_valid_traceparent(bad.as_bytes()), "{bad:?}");
        }
        let long = format!("01-{}-{}", &PARENT[3..], "x".repeat(MAX_TRACE_HEADER_BYTES));
        assert!(!is_valid_traceparent(long.as_bytes()));
        let control = format!("01-{}-a\tb", &PARENT[3..]);
        assert!(!is_valid_traceparent(control.as_bytes()));
    }

    #[test]
    fn a_tracestate_is_at_most_512_bytes_of_visible_ascii() {
        assert!(is_valid_tracestate(
            b"rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
        ));
        assert!(is_valid_tracestate(&[b'a'; MAX_TRACE_HEADER_BYTES]));
        assert!(!is_valid_tracestate(&[b'a'; MAX_TRACE_HEADER_BYTES + 1]));
        for bad in [
            "",
            "a=1\r\nx-injected: 1",
            "a=1\tb=2",
            "a=\u{e9}",
            "a=\u{7f}",
        ] {
            assert!(!is_valid_tracestate(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn tracestate_goes_only_with_a_forwarded_traceparent_and_repeated_headers_not_at_all() {
        let state = "rojo=00f067aa0ba902b7";
        let both = forwarded(&[("traceparent", Some(PARENT)), ("tracestate", Some(state))]);
        let sent: Vec<(String, &str)> = both
            .headers()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap()))
            .collect();
        assert_eq!(
            sent,
            [
                ("traceparent".to_string(), PARENT),
                ("tracestate".to_string(), state)
            ]
        );
        let upper_case_names =
            forwarded(&[("TraceParent", Some(PARENT)), ("Tracestate", Some(state))]);
        assert_eq!(upper_case_names, both);
        // No valid traceparent: nothing, not even a valid tracestate.
        let short_flags = PARENT.replace("-01", "-1");
        for parent in [None, Some("00-bad"), Some(short_flags.as_str())] {
            let headers = [("traceparent", parent), ("tracestate", Some(state))];
            let headers: Vec<_> = headers.into_iter().filter(|(_, v)| v.is_some()).collect();
            assert_eq!(forwarded(&headers), TraceContext::default(), "{parent:?}");
        }
        assert_eq!(
            forwarded(&[("traceparent", None), ("tracestate", Some(state))]),
            TraceContext::default()
        );
        // A bad tracestate is left out; the traceparent still goes.
        let alone = forwarded(&[
            ("traceparent", Some(PARENT)),
            ("tracestate", Some("a\u{e9}")),
        ]);
        assert!(alone.traceparent.is_some() && alone.tracestate.is_none());
        // Repeated: which copy was meant is unknown.
        let twice = forwarded(&[
            ("traceparent", Some(PARENT)),
            ("Traceparent", Some(PARENT)),
            ("tracestate", Some(state)),
        ]);
        assert_eq!(twice, TraceContext::default());
        let states = forwarded(&[
            ("traceparent", Some(PARENT)),
            ("tracestate", Some(state)),
            ("tracestate", Some(state)),
        ]);
        assert!(states.traceparent.is_some() && states.tracestate.is_none());
    }
}
