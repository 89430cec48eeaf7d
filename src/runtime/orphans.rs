//! Partitions a consumer group handed to no member, found and handed out again.
//!
//! Why: the loops' groups use static membership and the cooperative protocol. A rebalance that
//! moves a partition takes two rounds: in the first, its owner is told to give it up and the new
//! owner gets nothing yet; the owner gives it up and joins again, and the second round hands it
//! out. A member that stops between the two (a shutdown or a crash at that moment) never starts
//! the second round, and when it comes back as the same static member within its session the
//! coordinator gives it its stored assignment and starts no rebalance: the group is stable and
//! the partition it gave up belongs to nobody, for good (seen in `tests/hub_state.rs` in CI).
//! Nothing in librdkafka or the broker notices.
//!
//! So each loop runs a [`GroupWatch`]: a thread that describes the group every session timeout
//! and, while it is stable, compares its members' assignments with the partitions it should
//! cover. A set of partitions held by no member in two readings in a row is a finding; the member
//! holding the fewest partitions (the cheapest to move) leaves the group and joins it again
//! ([`Rejoin`]), which starts a rebalance that hands every partition out. After four readings any
//! member does (the one chosen may not be one of ours). A set that comes back after a rejoin is
//! tried again only after [`RETRY_AFTER`], so a difference between the watch's view and the
//! assignor's (a topic the pattern names that the group's leader does not know yet) costs a
//! rebalance every ten minutes at most.
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};

use crate::config::Config;

/// A topic and a partition number.
pub type Partition = (String, i32);

/// Readings in a row before the member holding the fewest partitions rejoins.
pub const ACTOR_AFTER: u32 = 2;
/// Readings in a row before any member rejoins.
pub const ANYONE_AFTER: u32 = 4;
/// How long a set of partitions acted on is left alone if it comes back.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);
/// How long a loop waits for its leave to go out before it subscribes again anyway.
const LEAVE_PATIENCE: Duration = Duration::from_secs(10);

/// One member's partitions, from the `ConsumerProtocolAssignment` a consumer group's member
/// carries (versions 0-3: int16 version, then per topic a string and an array of int32
/// partitions; user data follows and is ignored). Empty bytes are no assignment.
pub fn parse_assignment(bytes: &[u8]) -> Option<Vec<Partition>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let mut r = Reader(bytes);
    let _version = r.i16()?;
    let topics = r.i32()?;
    let mut out = Vec::new();
    for _ in 0..topics.max(0) {
        let len = usize::try_from(r.i16()?).ok()?;
        let topic = std::str::from_utf8(r.take(len)?).ok()?.to_string();
        let partitions = r.i32()?;
        for _ in 0..partitions.max(0) {
            out.push((topic.clone(), r.i32()?));
        }
    }
    Some(out)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }
    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
}

/// A consumer group as the coordinator describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    pub state: String,
    /// Member id and its partitions.
    pub members: Vec<(String, Vec<Partition>)>,
}

impl GroupView {
    /// Partitions of `expected` no member holds. None unless the group is stable: during a
    /// rebalance nobody holds what is being moved.
    pub fn orphans(&self, expected: &BTreeSet<Partition>) -> BTreeSet<Partition> {
        if self.state != "Stable" || self.members.is_empty() {
            return BTreeSet::new();
        }
        let held: BTreeSet<&Partition> = self.members.iter().flat_map(|(_, p)| p).collect();
        expected
            .iter()
            .filter(|p| !held.contains(p))
            .cloned()
            .collect()
    }

    /// The member that leaves and rejoins: the one holding the fewest partitions, then the lowest
    /// member id.
    pub fn actor(&self) -> Option<&str> {
        self.members
            .iter()
            .min_by(|a, b| a.1.len().cmp(&b.1.len()).then_with(|| a.0.cmp(&b.0)))
            .map(|(id, _)| id.as_str())
    }
}

/// Partitions held by nobody, read `times` readings in a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Changes whenever the set starts over; a loop acts at most once per id.
    pub id: u64,
    pub orphans: BTreeSet<Partition>,
    pub actor: String,
    pub times: u32,
}

impl Finding {
    /// Whether the member `me` should leave and rejoin now.
    pub fn calls_on(&self, me: &str) -> bool {
        (self.times >= ACTOR_AFTER && self.actor == me) || self.times >= ANYONE_AFTER
    }
}

/// Turns readings into findings: the same set in a row counts up, another set starts over, a
/// set acted on is held back for [`RETRY_AFTER`].
#[derive(Debug, Default)]
pub struct Tracker {
    current: Option<Finding>,
    next_id: u64,
    /// Sets that reached [`ACTOR_AFTER`], and when.
    acted: Vec<(BTreeSet<Partition>, Instant)>,
}

impl Tracker {
    /// One reading: the group and the partitions it should cover (`None` when either could not
    /// be read, which keeps the count where it is).
    pub fn observe(
        &mut self,
        reading: Option<(&GroupView, &BTreeSet<Partition>)>,
        now: Instant,
    ) -> Option<Finding> {
        let Some((view, expected)) = reading else {
            return self.current.clone();
        };
        let orphans = view.orphans(expected);
        self.acted
            .retain(|(_, at)| now.duration_since(*at) < RETRY_AFTER);
        if orphans.is_empty() {
            self.current = None;
            return None;
        }
        let actor = view.actor().unwrap_or_default().to_string();
        let finding = match self.current.take() {
            Some(mut f) if f.orphans == orphans => {
                f.times += 1;
                f.actor = actor;
                f
            }
            _ => {
                self.next_id += 1;
                Finding {
                    id: self.next_id,
                    orphans,
                    actor,
                    times: 1,
                }
            }
        };
        let held_back = self
            .acted
            .iter()
            .any(|(set, _)| *set == finding.orphans && finding.times == 1);
        if held_back {
            // Not counted: it stays at one reading until the set is no longer held back.
            self.current = Some(Finding {
                times: 0,
                ..finding
            });
            return None;
        }
        if finding.times == ACTOR_AFTER {
            self.acted.push((finding.orphans.clone(), now));
        }
        self.current = Some(finding.clone());
        Some(finding)
    }
}

/// What the group should cover.
#[derive(Debug, Clone)]
pub enum Covers {
    /// Every partition of one topic.
    Topic(String),
    /// Every partition of the topics whose names match (a subscription pattern).
    Pattern(regex::Regex),
}

/// A thread describing one group for the loop that started it; ends when the watch is dropped.
pub struct GroupWatch {
    latest: Arc<Mutex<Option<Finding>>>,
    done: Arc<AtomicBool>,
}

impl GroupWatch {
    pub fn spawn(config: &Config, group: &str, covers: Covers) -> GroupWatch {
        let latest = Arc::new(Mutex::new(None));
        let done = Arc::new(AtomicBool::new(false));
        let (l, d, group) = (latest.clone(), done.clone(), group.to_string());
        let client = crate::runtime::kafka::base(config).create::<BaseConsumer>();
        let every = config.session_timeout.max(Duration::from_secs(5));
        let spawned = std::thread::Builder::new()
            .name("group-watch".into())
            .spawn(move || {
                let client = match client {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, group = %group, "group watch not started");
                        return;
                    }
                };
                let mut tracker = Tracker::default();
                let mut next = Instant::now() + every;
                while !d.load(Ordering::Relaxed) {
                    if Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    next = Instant::now() + every;
                    let reading = read(&client, &group, &covers);
                    let finding = tracker.observe(
                        reading.as_ref().map(|(v, e)| (v, e)),
                        Instant::now(),
                    );
                    if let Some(f) = &finding {
                        tracing::info!(group = %group, partitions = %names(&f.orphans), readings = f.times, "partitions of the group held by no member");
                    }
                    *l.lock().unwrap_or_else(|p| p.into_inner()) = finding;
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "group watch not started");
        }
        GroupWatch { latest, done }
    }

    pub fn latest(&self) -> Option<Finding> {
        self.latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for GroupWatch {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
    }
}

const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The group's description and the partitions it should cover, or `None` if either could not
/// be read (or the group is not a consumer group whose assignments parse).
fn read(
    client: &BaseConsumer,
    group: &str,
    covers: &Covers,
) -> Option<(GroupView, BTreeSet<Partition>)> {
    let view = describe(client, group)?;
    let metadata = match covers {
        Covers::Topic(t) => client.fetch_metadata(Some(t), READ_TIMEOUT).ok()?,
        Covers::Pattern(_) => client.fetch_metadata(None, READ_TIMEOUT).ok()?,
    };
    let mut expected = BTreeSet::new();
    for t in metadata.topics() {
        let wanted = match covers {
            Covers::Topic(name) => t.name() == name,
            Covers::Pattern(re) => re.is_match(t.name()),
        };
        if wanted && t.error().is_none() {
            expected.extend(
                t.partitions()
                    .iter()
                    .map(|p| (t.name().to_string(), p.id())),
            );
        }
    }
    Some((view, expected))
}

/// A consumer group as its coordinator describes it (`None` if it cannot be read, or it is not
/// a consumer group whose assignments parse).
pub fn describe<C: ConsumerContext>(client: &BaseConsumer<C>, group: &str) -> Option<GroupView> {
    let list = client.fetch_group_list(Some(group), READ_TIMEOUT).ok()?;
    let g = list.groups().iter().find(|g| g.name() == group)?;
    if g.protocol_type() != "consumer" {
        return None;
    }
    let mut members = Vec::new();
    for m in g.members() {
        members.push((
            m.id().to_string(),
            parse_assignment(m.assignment().unwrap_or_default())?,
        ));
    }
    Some(GroupView {
        state: g.state().to_string(),
        members,
    })
}

fn names(set: &BTreeSet<Partition>) -> String {
    set.iter()
        .map(|(t, p)| format!("{t}[{p}]"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A loop's side: leaves and rejoins its group when a [`Finding`] calls on it.
#[derive(Debug, Default)]
pub struct Rejoin {
    acted: Option<u64>,
    left_at: Option<Instant>,
}

impl Rejoin {
    /// Called once per turn of the loop, which keeps polling (the leave waits for the revocation
    /// of what it holds to be served).
    pub fn tick<C: ConsumerContext>(
        &mut self,
        watch: &GroupWatch,
        consumer: &BaseConsumer<C>,
        subscription: &str,
        stage: &'static str,
    ) -> Result<(), rdkafka::error::KafkaError> {
        if let Some(at) = self.left_at {
            // librdkafka clears the member id when it sends the leave.
            let left =
                crate::runtime::kafka::membership(consumer).is_none_or(|m| m.member_id.is_empty());
            if left || at.elapsed() >= LEAVE_PATIENCE {
                self.left_at = None;
                consumer.subscribe(&[subscription])?;
                tracing::info!(stage, left, "joined the group again");
            }
            return Ok(());
        }
        let Some(finding) = watch.latest() else {
            return Ok(());
        };
        if self.acted == Some(finding.id) {
            return Ok(());
        }
        let me = crate::runtime::kafka::membership(consumer)
            .map(|m| m.member_id)
            .unwrap_or_default();
        if me.is_empty() || !finding.calls_on(&me) {
            return Ok(());
        }
        self.acted = Some(finding.id);
        tracing::warn!(stage, partitions = %names(&finding.orphans), readings = finding.times, "partitions of the group are held by no member (a member stopped in the middle of a rebalance): leaving the group and joining again so that they are handed out");
        metrics::counter!(crate::runtime::telemetry::GROUP_REJOINS, "stage" => stage).increment(1);
        consumer.unsubscribe();
        self.left_at = Some(Instant::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(version: i16, topics: &[(&str, &[i32])], user_data: &[u8]) -> Vec<u8> {
        let mut b = version.to_be_bytes().to_vec();
        b.extend((topics.len() as i32).to_be_bytes());
        for (t, ps) in topics {
            b.extend((t.len() as i16).to_be_bytes());
            b.extend(t.as_bytes());
            b.extend((ps.len() as i32).to_be_bytes());
            for p in *ps {
                b.extend(p.to_be_bytes());
            }
        }
        b.extend((user_data.len() as i32).to_be_bytes());
        b.extend(user_data);
        b
    }

    fn p(t: &str, n: i32) -> Partition {
        (t.to_string(), n)
    }

    fn view(state: &str, members: &[(&str, &[i32])]) -> GroupView {
        GroupView {
            state: state.into(),
            members: members
                .iter()
                .map(|(id, ps)| (id.to_string(), ps.iter().map(|&n| p("inbox", n)).collect()))
                .collect(),
        }
    }

    fn inbox(n: i32) -> BTreeSet<Partition> {
        (0..n).map(|i| p("inbox", i)).collect()
    }

    #[test]
    fn assignments_parse_in_every_version_and_refuse_truncated_bytes() {
        for version in 0..=3 {
            let bytes = assignment(version, &[("inbox", &[3, 4, 5]), ("other", &[0])], b"ud");
            assert_eq!(
                parse_assignment(&bytes),
                Some(vec![
                    p("inbox", 3),
                    p("inbox", 4),
                    p("inbox", 5),
                    p("other", 0)
                ])
            );
        }
        assert_eq!(parse_assignment(&[]), Some(vec![]));
        assert_eq!(parse_assignment(&assignment(1, &[], b"")), Some(vec![]));
        let bytes = assignment(1, &[("inbox", &[3, 4, 5])], b"");
        for cut in 1..bytes.len() - 4 {
            assert_eq!(parse_assignment(&bytes[..cut]), None, "cut at {cut}");
        }
        // A count far beyond the bytes ends at the first missing element, without allocating it.
        let mut huge = 0i16.to_be_bytes().to_vec();
        huge.extend(i32::MAX.to_be_bytes());
        assert_eq!(parse_assignment(&huge), None);
    }

    #[test]
    fn orphans_are_the_partitions_no_member_of_a_stable_group_holds() {
        let stuck = view("Stable", &[("b", &[3, 4, 5]), ("a", &[])]);
        assert_eq!(
            stuck.orphans(&inbox(6)),
            [0, 1, 2].map(|n| p("inbox", n)).into()
        );
        assert_eq!(stuck.actor(), Some("a"), "the member holding the fewest");
        let moving = view("CompletingRebalance", &[("b", &[3, 4, 5]), ("a", &[])]);
        assert!(moving.orphans(&inbox(6)).is_empty());
        let whole = view("Stable", &[("b", &[3, 4, 5]), ("a", &[0, 1, 2])]);
        assert!(whole.orphans(&inbox(6)).is_empty());
        let tie = view("Stable", &[("m2", &[0]), ("m1", &[1])]);
        assert_eq!(tie.actor(), Some("m1"), "then the lowest member id");
    }

    #[test]
    fn the_fewest_holder_acts_on_the_second_reading_anyone_on_the_fourth_and_a_set_acted_on_waits()
    {
        let stuck = view("Stable", &[("b", &[3, 4, 5]), ("a", &[])]);
        let expected = inbox(6);
        let mut t = Tracker::default();
        let now = Instant::now();
        let first = t.observe(Some((&stuck, &expected)), now).unwrap();
        assert!(!first.calls_on("a") && !first.calls_on("b"));
        let second = t.observe(Some((&stuck, &expected)), now).unwrap();
        assert_eq!(second.id, first.id);
        assert!(second.calls_on("a") && !second.calls_on("b"));
        // An unreadable group keeps the count.
        assert_eq!(t.observe(None, now), Some(second.clone()));
        t.observe(Some((&stuck, &expected)), now);
        let fourth = t.observe(Some((&stuck, &expected)), now).unwrap();
        assert!(fourth.calls_on("b"), "anyone, after four readings");

        // The rejoin's rebalance: the set goes, then comes back at once: held back.
        let moving = view("PreparingRebalance", &[("b", &[3, 4, 5]), ("a", &[])]);
        assert_eq!(t.observe(Some((&moving, &expected)), now), None);
        for _ in 0..5 {
            assert_eq!(t.observe(Some((&stuck, &expected)), now), None);
        }
        // Another set is not held back.
        let other = view("Stable", &[("b", &[0, 1, 2, 3, 4]), ("a", &[])]);
        let f = t.observe(Some((&other, &expected)), now).unwrap();
        assert_eq!(f.orphans, [p("inbox", 5)].into());
        // After the pause the first set counts again.
        let later = now + RETRY_AFTER;
        let again = t.observe(Some((&stuck, &expected)), later).unwrap();
        assert_eq!(again.times, 1);
        assert!(
            t.observe(Some((&stuck, &expected)), later)
                .unwrap()
                .calls_on("a")
        );
        // A group whose partitions all have an owner clears the finding.
        let whole = view("Stable", &[("b", &[3, 4, 5]), ("a", &[0, 1, 2])]);
        assert_eq!(t.observe(Some((&whole, &expected)), later), None);
    }
}
