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
//! So each ingest and hub loop takes part in a [`GroupWatch`] (one per group and process): a
//! thread that describes the group every session timeout (at least 5 s) and, while it is stable,
//! compares its members' assignments with the partitions it should cover. A set of partitions
//! held by no member in two readings at least [`PERSIST`] apart is a finding. Members are ranked
//! by the partitions they hold (fewest first, the cheapest to move, then by member id); from the
//! reading that makes it a finding (`due`), the member of rank k leaves the group and joins
//! again ([`Rejoin`]) at reading `due + 2k`, which starts a rebalance that hands every partition
//! out. Each rejoin that works ends the finding (the group rebalances); one that did not (its
//! leave lost) lets the next member try. A set that comes back after a rejoin, or outlasts every
//! member's turn, is left alone for [`RETRY_AFTER`], so a difference between the watch's view
//! and the assignor's costs a round of rejoins every ten minutes at most.
//!
//! A false finding is possible while a member takes longer than [`PERSIST`] to give up what
//! round one took from it (its revocation waits behind a long restore): the rejoin then costs one
//! more rebalance round, nothing else.
use std::collections::{BTreeSet, HashMap};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};

use crate::config::Config;

/// A topic and a partition number.
pub type Partition = (String, i32);

/// Readings in a row before anyone rejoins (and at least [`PERSIST`]); rank k waits 2k more.
pub const FIRST_AFTER: u32 = 2;
/// How long a set must have been held by nobody before anyone acts.
pub const PERSIST: Duration = Duration::from_secs(30);
/// How long a set acted on is left alone if it comes back.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);
/// How often the group is read while a loop of this process waits to be in it.
const JOINING_READ_EVERY: Duration = Duration::from_secs(1);
/// How long the readings must show nothing to cover before a loop that has not joined is in.
pub const NOTHING_FOR: Duration = Duration::from_secs(3);
/// A finding read longer ago than this is not acted on.
const STALE_FINDING: Duration = Duration::from_secs(60);
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
    if !(0..=3).contains(&r.i16()?) {
        return None;
    }
    let topics = r.i32()?;
    if topics < 0 {
        return None;
    }
    let mut out = Vec::new();
    for _ in 0..topics {
        let len = usize::try_from(r.i16()?).ok()?;
        let topic = std::str::from_utf8(r.take(len)?).ok()?.to_string();
        let partitions = r.i32()?;
        if partitions < 0 {
            return None;
        }
        for _ in 0..partitions {
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
    /// Whether the group is stable with members: what they hold is all there is.
    pub fn settled(&self) -> bool {
        self.state == "Stable" && !self.members.is_empty()
    }

    /// Partitions of `expected` no member holds. None unless the group is stable: during a
    /// rebalance nobody holds what is being moved.
    pub fn orphans(&self, expected: &BTreeSet<Partition>) -> BTreeSet<Partition> {
        if !self.settled() {
            return BTreeSet::new();
        }
        let held: BTreeSet<&Partition> = self.members.iter().flat_map(|(_, p)| p).collect();
        expected
            .iter()
            .filter(|p| !held.contains(p))
            .cloned()
            .collect()
    }

    /// Member ids in the order they are called on: fewest partitions first, then by id.
    pub fn ranked(&self) -> Vec<String> {
        let mut m: Vec<&(String, Vec<Partition>)> = self.members.iter().collect();
        m.sort_by(|a, b| a.1.len().cmp(&b.1.len()).then_with(|| a.0.cmp(&b.0)));
        m.into_iter().map(|(id, _)| id.clone()).collect()
    }
}

/// Partitions held by nobody, read `times` readings in a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Changes whenever the set starts over.
    pub id: u64,
    pub orphans: BTreeSet<Partition>,
    /// Member ids, the first called on first (see [`GroupView::ranked`]).
    pub ranked: Vec<String>,
    pub times: u32,
    /// Since when the set has been held by nobody, as far as the readings tell.
    pub since: Instant,
    /// When it was last read.
    pub read_at: Instant,
    /// The reading at which it had lasted long enough to act on (two readings, [`PERSIST`]):
    /// the member of rank k is called on from reading `due + 2k`.
    pub due: Option<u32>,
}

impl Finding {
    /// Whether the member `me` should leave and rejoin now.
    pub fn calls_on(&self, me: &str) -> bool {
        let Some(rank) = self.ranked.iter().position(|m| m == me) else {
            return false;
        };
        self.due
            .is_some_and(|due| self.times >= due + 2 * rank as u32)
    }
}

/// Turns readings into findings: the same set in a row counts up, another set starts over, a
/// set acted on (one that lasted long enough to call on someone) is held back for
/// [`RETRY_AFTER`] when it comes back.
#[derive(Debug, Default)]
pub struct Tracker {
    current: Option<Finding>,
    /// Whether `current` is held back.
    holding: bool,
    next_id: u64,
    /// Sets that called on a member, and when.
    acted: Vec<(BTreeSet<Partition>, Instant)>,
    /// The set still there after every member's rejoin (given up on for now), while it lasts.
    gave_up: Option<BTreeSet<Partition>>,
}

impl Tracker {
    /// The set held by nobody now that the watch has given up on: still there after every
    /// member had its turn to rejoin. Not a set merely held back because it came back soon
    /// after being mended (a normal handover may show the same partitions for a moment).
    pub fn held(&self) -> Option<&BTreeSet<Partition>> {
        self.gave_up
            .as_ref()
            .filter(|g| self.current.as_ref().is_some_and(|c| &c.orphans == *g))
    }

    /// One reading: the group and the partitions it should cover (`None` when either could not
    /// be read: the count stays, nothing is published). Returns the finding to publish.
    pub fn observe(
        &mut self,
        reading: Option<(&GroupView, &BTreeSet<Partition>)>,
        now: Instant,
    ) -> Option<Finding> {
        let (view, expected) = reading?;
        let orphans = view.orphans(expected);
        self.acted
            .retain(|(_, at)| now.duration_since(*at) < RETRY_AFTER);
        if orphans.is_empty() {
            self.current = None;
            // Only a stable group holding them mends a set given up on: during a rebalance
            // nobody holds what is moving, and forgetting it then kept this process's starting
            // loops out of `/readyz` again for a whole new round when the set came back.
            if view.settled() {
                self.gave_up = None;
            }
            return None;
        }
        if self.gave_up.as_ref().is_some_and(|g| *g != orphans) {
            self.gave_up = None;
        }
        let ranked = view.ranked();
        let finding = match self.current.take() {
            Some(mut f) if f.orphans == orphans => {
                f.times += 1;
                f.ranked = ranked;
                f.read_at = now;
                f
            }
            _ => {
                self.next_id += 1;
                self.holding = self.acted.iter().any(|(set, _)| *set == orphans);
                Finding {
                    id: self.next_id,
                    orphans,
                    ranked,
                    times: 1,
                    since: now,
                    read_at: now,
                    due: None,
                }
            }
        };
        if self.holding && !self.acted.iter().any(|(set, _)| *set == finding.orphans) {
            // Held long enough: counted from here, as a new finding (not yet due: when it is,
            // the set is noted as acted on again, so the rejoins it calls for hold it back once
            // more; kept due from before, it called on members without being noted, and came
            // back after their rejoins as a set never acted on: a second round at once).
            // A new id, too: a member skips a finding it acted on until every member had its
            // turn counted from then, and with the count starting over that turn never came
            // before the set was held again, so nobody acted in any later round.
            self.holding = false;
            self.next_id += 1;
            self.current = Some(Finding {
                id: self.next_id,
                times: 1,
                since: now,
                due: None,
                ..finding
            });
            return self.current.clone();
        }
        let mut finding = finding;
        if !self.holding
            && finding.due.is_none()
            && finding.times >= FIRST_AFTER
            && now.duration_since(finding.since) >= PERSIST
        {
            finding.due = Some(finding.times);
            if !self.acted.iter().any(|(set, _)| *set == finding.orphans) {
                self.acted.push((finding.orphans.clone(), now));
            }
        }
        if !self.holding
            && finding
                .due
                .is_some_and(|due| finding.times >= due + 2 * finding.ranked.len() as u32)
        {
            // Every member had its turn and the set is still there: not something a rejoin
            // mends (or one the watch sees and the assignor does not). Left alone for a while.
            tracing::warn!(partitions = %names(&finding.orphans), "partitions still held by no member after every member rejoined; next try in 10 minutes");
            self.acted.retain(|(set, _)| *set != finding.orphans);
            self.acted.push((finding.orphans.clone(), now));
            self.holding = true;
            self.gave_up = Some(finding.orphans.clone());
        }
        self.current = Some(finding.clone());
        if self.holding {
            return None;
        }
        Some(finding)
    }
}

/// What a reading of the group showed, for the loops of this process waiting to be in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// The group or the partitions it should cover could not be read (no describe permission,
    /// a broker or the coordinator moving), or the watch could not start.
    Unreadable,
    /// No topic the group should cover exists (a follow pattern that matches nothing yet): a
    /// member joins no group then (librdkafka sends no JoinGroup), and there is nothing to hand
    /// out. (A group of one named topic never reads so: that topic missing is unreadable.)
    NothingToCover,
    Read {
        stable: bool,
        members: BTreeSet<String>,
        /// Some partition it should cover is held by no member.
        orphans: bool,
        /// Those partitions are a set the watch has given up on for now (still there after every
        /// member had its turn: see [`Tracker::held`]).
        held_back: bool,
    },
}

impl Seen {
    /// `held`: the set the watch holds back now, if any.
    fn of(
        view: &GroupView,
        expected: &BTreeSet<Partition>,
        held: Option<&BTreeSet<Partition>>,
    ) -> Seen {
        let orphans = view.orphans(expected);
        Seen::Read {
            stable: view.state == "Stable",
            members: view.members.iter().map(|(id, _)| id.clone()).collect(),
            held_back: !orphans.is_empty() && held == Some(&orphans),
            orphans: !orphans.is_empty(),
        }
    }
}

/// Loops of this process not yet in their group (see [`Joining`]); `/readyz` answers 503 while
/// one is not.
static JOINING: AtomicUsize = AtomicUsize::new(0);

/// How many loops of this process are not yet in their group.
pub fn joining() -> usize {
    JOINING.load(Ordering::SeqCst)
}

/// A loop's wait to be in its consumer group, counted in [`joining`] from its creation (before
/// its thread starts, so that `/readyz` cannot answer between the two) until the loop is in (see
/// [`joined`]). Once in, it stays in: `/readyz` tells a starting instance from a ready one, and
/// a later rebalance is not a start.
#[derive(Debug)]
pub struct Joining {
    open: bool,
    spells: Spells,
}

/// Since when the readings have shown the same thing without a break.
#[derive(Debug, Default, Clone, Copy)]
pub struct Spells {
    unreadable: Option<Instant>,
    nothing: Option<Instant>,
}

impl Joining {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Joining {
        JOINING.fetch_add(1, Ordering::SeqCst);
        Joining {
            open: true,
            spells: Spells::default(),
        }
    }

    /// Whether the loop is in its group now (`watch`: its group's, `None` for a loop running
    /// unwatched; `me`: its member id, empty if none; `confirmed`: a rebalance was served under
    /// its current membership).
    pub fn check(&mut self, watch: Option<&GroupWatch>, me: &str, confirmed: bool) -> bool {
        if !self.open {
            return true;
        }
        let now = Instant::now();
        let seen = match watch {
            Some(w) => w.seen().map(|(_, s)| s),
            None => Some(Seen::Unreadable),
        };
        if joined(seen.as_ref(), me, confirmed, &mut self.spells, now) {
            self.open = false;
            JOINING.fetch_sub(1, Ordering::SeqCst);
        }
        !self.open
    }
}

/// A loop's turn of its wait to be in its group: checks `joining` (its member id and whether it
/// served the rebalance of its membership read from `consumer`) and drops it once the loop is in.
pub fn settle<C: ConsumerContext>(
    joining: &mut Option<Joining>,
    watch: Option<&GroupWatch>,
    consumer: &BaseConsumer<C>,
    confirmed: &crate::runtime::kafka::ConfirmedMembership,
    stage: &'static str,
) {
    let Some(j) = joining else {
        return;
    };
    let me = crate::runtime::kafka::member_id(consumer);
    let served = crate::runtime::kafka::membership_confirmed(consumer, confirmed);
    if j.check(watch, &me, served) {
        *joining = None;
        tracing::info!(stage, "the loop is in its consumer group");
    }
}

impl Drop for Joining {
    fn drop(&mut self) {
        if self.open {
            JOINING.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Whether a loop is in its group, from the latest reading (`seen`), its member id (`me`) and
/// whether it served the rebalance of its current membership (`confirmed`).
///
/// In: the group is stable, lists `me`, has every partition held by a member, and the loop has
/// served that rebalance (so the restores of its share are counted). Under the cooperative
/// protocol a member that joins gets nothing in the first round and its share in the second (the
/// owners give it up in between: their partitions show as held by nobody), so neither the member
/// id nor the first assignment tells that the rebalance is over. Partitions held by nobody that
/// the watch has given up on do not keep a member out. With nothing to cover for
/// [`NOTHING_FOR`] without a break, a loop that has not joined is in (a broker answering with an
/// empty cache once is not enough). A group that cannot be read for [`PERSIST`] without a break
/// (no describe permission) falls back to `confirmed`: one failed reading (a broker restarting)
/// is not enough.
pub fn joined(
    seen: Option<&Seen>,
    me: &str,
    confirmed: bool,
    spells: &mut Spells,
    now: Instant,
) -> bool {
    if !matches!(seen, Some(Seen::Unreadable)) {
        spells.unreadable = None;
    }
    if !matches!(seen, Some(Seen::NothingToCover)) {
        spells.nothing = None;
    }
    match seen {
        None => false,
        Some(Seen::NothingToCover) => {
            let since = *spells.nothing.get_or_insert(now);
            me.is_empty() && now.duration_since(since) >= NOTHING_FOR
        }
        Some(Seen::Unreadable) => {
            let since = *spells.unreadable.get_or_insert(now);
            !me.is_empty() && confirmed && now.duration_since(since) >= PERSIST
        }
        Some(Seen::Read {
            stable,
            members,
            orphans,
            held_back,
        }) => {
            !me.is_empty()
                && *stable
                && members.contains(me)
                && confirmed
                && (!*orphans || *held_back)
        }
    }
}

/// A POSIX extended regular expression, as librdkafka matches a subscription pattern
/// (`regcomp(REG_EXTENDED | REG_NOSUB)` in its `rdregex.c`), so the watch expects the topics
/// the group's members subscribe to, not those another dialect would match.
pub struct PosixRegex(Box<libc::regex_t>);

// SAFETY: a compiled regex_t is only read by regexec, which glibc documents as thread-safe.
unsafe impl Send for PosixRegex {}
unsafe impl Sync for PosixRegex {}

impl PosixRegex {
    pub fn new(pattern: &str) -> Option<PosixRegex> {
        let c = CString::new(pattern).ok()?;
        // SAFETY: regcomp initialises the zeroed regex_t it is given; it is freed in Drop only
        // when compiled.
        unsafe {
            let mut re: Box<libc::regex_t> = Box::new(std::mem::zeroed());
            if libc::regcomp(&mut *re, c.as_ptr(), libc::REG_EXTENDED | libc::REG_NOSUB) != 0 {
                return None;
            }
            Some(PosixRegex(re))
        }
    }

    pub fn is_match(&self, text: &str) -> bool {
        let Ok(c) = CString::new(text) else {
            return false;
        };
        // SAFETY: the regex was compiled by regcomp; REG_NOSUB needs no match array.
        unsafe { libc::regexec(&*self.0, c.as_ptr(), 0, std::ptr::null_mut(), 0) == 0 }
    }
}

impl Drop for PosixRegex {
    fn drop(&mut self) {
        // SAFETY: compiled in `new`, freed once.
        unsafe { libc::regfree(&mut *self.0) }
    }
}

/// What the group should cover.
pub enum Covers {
    /// Every partition of one topic.
    Topic(String),
    /// Every partition of the topics a subscription pattern (`^...`) matches.
    Pattern(PosixRegex),
}

/// A thread describing one group, shared by the loops of this process that are its members;
/// ends when the last of them drops it.
pub struct GroupWatch {
    latest: Arc<Mutex<Option<Finding>>>,
    /// The latest reading, and when it was read.
    seen: Arc<Mutex<Option<(Instant, Seen)>>>,
    done: Arc<AtomicBool>,
}

type Watches = Mutex<HashMap<String, Weak<GroupWatch>>>;
static WATCHES: LazyLock<Watches> = LazyLock::new(Default::default);

impl GroupWatch {
    /// The watch of `group` in this process, started if there is none.
    pub fn shared(config: &Config, group: &str, covers: Covers) -> Arc<GroupWatch> {
        let mut watches = WATCHES.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = watches.get(group).and_then(Weak::upgrade) {
            return w;
        }
        let w = Arc::new(GroupWatch::spawn(config, group, covers));
        watches.insert(group.to_string(), Arc::downgrade(&w));
        w
    }

    fn spawn(config: &Config, group: &str, covers: Covers) -> GroupWatch {
        let latest = Arc::new(Mutex::new(None));
        let seen = Arc::new(Mutex::new(None));
        let done = Arc::new(AtomicBool::new(false));
        let (l, sn, d, group) = (
            latest.clone(),
            seen.clone(),
            done.clone(),
            group.to_string(),
        );
        let client = crate::runtime::kafka::base(config).create::<BaseConsumer>();
        let every = config.session_timeout.max(Duration::from_secs(5));
        let spawned = std::thread::Builder::new()
            .name("group-watch".into())
            .spawn(move || {
                let client = match client {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, group = %group, "group watch not started");
                        *sn.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some((Instant::now(), Seen::Unreadable));
                        return;
                    }
                };
                let mut tracker = Tracker::default();
                let mut next = Instant::now() + every;
                let mut next_quick = Instant::now();
                while !d.load(Ordering::Relaxed) {
                    // Serves the client's own events (errors), which nothing else reads.
                    let _ = client.poll(Duration::ZERO);
                    // Every second while a loop of this process waits to be in a group (it is
                    // out of service until a reading shows it in), every session timeout else.
                    let now = Instant::now();
                    let quick = joining() > 0 && now >= next_quick;
                    if now < next && !quick {
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    next_quick = now + JOINING_READ_EVERY;
                    let (reading, seen) = read(&client, &group, &covers, tracker.held());
                    let reading = reading.as_ref().map(|(v, e)| (v, e));
                    *sn.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), seen));
                    if now < next {
                        // The findings keep their cadence: members' turns are counted in
                        // readings.
                        continue;
                    }
                    next = Instant::now() + every;
                    let finding = tracker.observe(reading, Instant::now());
                    if let Some(f) = &finding {
                        tracing::info!(group = %group, partitions = %names(&f.orphans), readings = f.times, "partitions of the group held by no member");
                    }
                    *l.lock().unwrap_or_else(|p| p.into_inner()) = finding;
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "group watch not started");
            *seen.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((Instant::now(), Seen::Unreadable));
        }
        GroupWatch { latest, seen, done }
    }

    /// The latest reading, and when it was read.
    pub fn seen(&self) -> Option<(Instant, Seen)> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
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
/// be read (or the group is not a consumer group whose assignments parse); and what that tells
/// a loop waiting to be in the group (`held`: the set the tracker holds back now, if any).
fn read(
    client: &BaseConsumer,
    group: &str,
    covers: &Covers,
    held: Option<&BTreeSet<Partition>>,
) -> (Option<(GroupView, BTreeSet<Partition>)>, Seen) {
    let Some(metadata) = (match covers {
        Covers::Topic(t) => client.fetch_metadata(Some(t), READ_TIMEOUT).ok(),
        Covers::Pattern(_) => client.fetch_metadata(None, READ_TIMEOUT).ok(),
    }) else {
        return (None, Seen::Unreadable);
    };
    let topics: Vec<TopicSeen<'_>> = metadata
        .topics()
        .iter()
        .map(|t| TopicSeen {
            name: t.name(),
            errored: t.error().is_some(),
            partitions: t.partitions().iter().map(|p| p.id()).collect(),
        })
        .collect();
    let covering = covered(&topics, covers);
    let view = describe(client, group);
    let seen = seen_of(covering.as_ref(), view.as_ref(), held);
    // The findings look at the partitions of the topics that could be read.
    let expected = covering.unwrap_or_else(|| covered_readable(&topics, covers));
    (view.map(|v| (v, expected)), seen)
}

/// One topic of a metadata answer.
struct TopicSeen<'a> {
    name: &'a str,
    errored: bool,
    partitions: Vec<i32>,
}

/// What a reading tells a loop waiting to be in the group: the partitions to cover (`None`:
/// some could not be read) and the group's description.
fn seen_of(
    covering: Option<&BTreeSet<Partition>>,
    view: Option<&GroupView>,
    held: Option<&BTreeSet<Partition>>,
) -> Seen {
    match (covering, view) {
        (None, _) => Seen::Unreadable,
        (Some(e), _) if e.is_empty() => Seen::NothingToCover,
        (Some(_), None) => Seen::Unreadable,
        (Some(e), Some(v)) => Seen::of(v, e, held),
    }
}

fn wanted(covers: &Covers, name: &str) -> bool {
    match covers {
        Covers::Topic(t) => name == t,
        Covers::Pattern(re) => re.is_match(name),
    }
}

/// The partitions the group should cover; `None` if one it covers could not be read: the
/// named topic missing or in error, or a topic the pattern matches in error.
fn covered(topics: &[TopicSeen<'_>], covers: &Covers) -> Option<BTreeSet<Partition>> {
    let mine = || topics.iter().filter(|t| wanted(covers, t.name));
    if mine().any(|t| t.errored) || (matches!(covers, Covers::Topic(_)) && mine().next().is_none())
    {
        return None;
    }
    Some(covered_readable(topics, covers))
}

/// The partitions of the topics the group covers that have no error.
fn covered_readable(topics: &[TopicSeen<'_>], covers: &Covers) -> BTreeSet<Partition> {
    topics
        .iter()
        .filter(|t| !t.errored && wanted(covers, t.name))
        .flat_map(|t| t.partitions.iter().map(|&p| (t.name.to_string(), p)))
        .collect()
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
    /// The finding acted on, and at which reading.
    acted: Option<(u64, u32)>,
    left_at: Option<Instant>,
}

impl Rejoin {
    /// The same finding again only once every member had its turn (each rejoin that works ends
    /// it).
    fn waits_turn(&self, finding: &Finding) -> bool {
        let turns = 2 * finding.ranked.len() as u32;
        self.acted
            .is_some_and(|(id, at)| id == finding.id && finding.times < at + turns)
    }

    /// Called once per turn of the loop (at least every few hundred milliseconds, idle or not),
    /// between batches; the loop keeps polling, which serves the revocation the leave waits for.
    /// It acts only while the loop's membership is the one its last rebalance callback ran under
    /// (`confirmed`: no rebalance half served), read only when a finding calls on it.
    pub fn tick<C: ConsumerContext>(
        &mut self,
        watch: &GroupWatch,
        consumer: &BaseConsumer<C>,
        confirmed: &crate::runtime::kafka::ConfirmedMembership,
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
                if left {
                    metrics::counter!(crate::runtime::telemetry::GROUP_REJOINS, "stage" => stage)
                        .increment(1);
                    tracing::info!(stage, "left the group and joined it again");
                } else {
                    tracing::warn!(
                        stage,
                        "the leave did not go out in time; subscribed again (another member may try next)"
                    );
                }
            }
            return Ok(());
        }
        let Some(finding) = watch.latest() else {
            return Ok(());
        };
        // A finding older than a minute is stale (the watch could not read the group since).
        if finding.read_at.elapsed() > STALE_FINDING {
            return Ok(());
        }
        if self.waits_turn(&finding) {
            return Ok(());
        }
        let me = crate::runtime::kafka::membership(consumer)
            .map(|m| m.member_id)
            .unwrap_or_default();
        if me.is_empty()
            || !finding.calls_on(&me)
            || !crate::runtime::kafka::membership_confirmed(consumer, confirmed)
        {
            return Ok(());
        }
        self.acted = Some((finding.id, finding.times));
        tracing::warn!(stage, partitions = %names(&finding.orphans), readings = finding.times, held_by_nobody_s = finding.read_at.duration_since(finding.since).as_secs(), "partitions of the group are held by no member (a member may have stopped between the two rounds of a rebalance): leaving the group and joining again so that they are handed out");
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
        assert_eq!(
            stuck.ranked(),
            ["a", "b"],
            "the member holding the fewest first"
        );
        let moving = view("CompletingRebalance", &[("b", &[3, 4, 5]), ("a", &[])]);
        assert!(moving.orphans(&inbox(6)).is_empty());
        let whole = view("Stable", &[("b", &[3, 4, 5]), ("a", &[0, 1, 2])]);
        assert!(whole.orphans(&inbox(6)).is_empty());
        let tie = view("Stable", &[("m2", &[0]), ("m1", &[1])]);
        assert_eq!(tie.ranked(), ["m1", "m2"], "then by member id");
    }

    #[test]
    fn members_are_called_on_by_rank_once_the_set_persisted_and_a_set_acted_on_waits_if_it_returns()
    {
        let stuck = view("Stable", &[("b", &[3, 4, 5]), ("a", &[])]);
        let expected = inbox(6);
        let mut t = Tracker::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut read = |v: &GroupView, s: u64| t.observe(Some((v, &expected)), at(s));
        let first = read(&stuck, 0).unwrap();
        assert!(!first.calls_on("a") && !first.calls_on("b"));
        let quick = read(&stuck, 10).unwrap();
        assert_eq!(quick.id, first.id);
        assert!(
            !quick.calls_on("a"),
            "two readings, but not {PERSIST:?} apart"
        );
        let third = read(&stuck, 30).unwrap();
        assert!(third.calls_on("a") && !third.calls_on("b"), "rank 0 first");
        assert!(!read(&stuck, 40).unwrap().calls_on("b"));
        let fifth = read(&stuck, 50).unwrap();
        assert!(fifth.calls_on("b"), "then rank 1, two readings later");
        assert!(!fifth.calls_on("c"), "never a stranger");
        assert_eq!(fifth.id, first.id);
        // Still there once every member had its turn (due 3 + 2 x 2 members): held back.
        assert!(read(&stuck, 60).is_some());
        assert_eq!(read(&stuck, 70), None, "held after every member's turn");
        for s in (80..670).step_by(10) {
            assert_eq!(read(&stuck, s), None, "still held at {s}");
        }
        let after = read(&stuck, 670).expect("tried again ten minutes later");
        assert_eq!(after.times, 1);
        assert_ne!(
            after.id, first.id,
            "a new finding: a member that acted on the first skips that id until its turn ends"
        );
        assert!(!after.calls_on("a"));
        assert!(
            !read(&stuck, 680).unwrap().calls_on("a"),
            "as a new finding"
        );
        let round_two = read(&stuck, 700).unwrap();
        assert!(round_two.calls_on("a"), "persisted again");
        // Member a, which left in the first round (at its third reading), acts again now.
        let a = Rejoin {
            acted: Some((first.id, third.times)),
            left_at: None,
        };
        assert!(a.waits_turn(&fifth), "within the first round: b's turn");
        assert!(!a.waits_turn(&round_two), "a new round");
        // Its rejoin's rebalance: the set goes and comes back: held back again, not a second
        // round at once.
        let moving = view("PreparingRebalance", &[("b", &[3, 4, 5]), ("a", &[])]);
        assert_eq!(read(&moving, 705), None);
        for s in [710, 720, 730, 740, 750] {
            assert_eq!(read(&stuck, s), None, "held back at {s}");
        }
        let mut t = Tracker::default();
        let mut read = |v: &GroupView, s: u64| t.observe(Some((v, &expected)), at(s));
        for s in [0, 10, 30] {
            read(&stuck, s);
        }

        // The rejoin's rebalance: the set goes, then comes back at once: held back.
        let moving = view("PreparingRebalance", &[("b", &[3, 4, 5]), ("a", &[])]);
        assert_eq!(read(&moving, 55), None);
        for s in [60, 70, 80, 90, 100] {
            assert_eq!(read(&stuck, s), None, "held back at {s}");
        }
        // Another set is not held back.
        let other = view("Stable", &[("b", &[0, 1, 2, 3, 4]), ("a", &[])]);
        assert_eq!(read(&other, 110).unwrap().orphans, [p("inbox", 5)].into());
        // Ten minutes after it was acted on, the first set counts again, from one.
        let again = read(&stuck, 30 + 600).unwrap();
        assert_eq!(again.times, 1);
        assert!(
            !read(&stuck, 640).unwrap().calls_on("a"),
            "not {PERSIST:?} yet"
        );
        assert!(read(&stuck, 660).unwrap().calls_on("a"));
        // A group whose partitions all have an owner clears the finding.
        let whole = view("Stable", &[("b", &[3, 4, 5]), ("a", &[0, 1, 2])]);
        assert_eq!(read(&whole, 670), None);
    }

    #[test]
    fn an_unreadable_group_publishes_nothing_and_keeps_the_count() {
        let stuck = view("Stable", &[("a", &[0])]);
        let expected = inbox(2);
        let mut t = Tracker::default();
        let t0 = Instant::now();
        t.observe(Some((&stuck, &expected)), t0);
        assert_eq!(t.observe(None, t0 + Duration::from_secs(10)), None);
        let f = t.observe(Some((&stuck, &expected)), t0 + PERSIST).unwrap();
        assert_eq!(f.times, 2);
        assert!(f.calls_on("a"));
    }

    #[test]
    fn a_member_is_in_its_group_once_a_stable_reading_has_every_partition_held() {
        let expected = inbox(6);
        let now = Instant::now();
        let seen = |v: &GroupView| Seen::of(v, &expected, None);
        let is_in = |s: &Seen, me: &str, confirmed: bool| {
            joined(Some(s), me, confirmed, &mut Spells::default(), now)
        };
        // Not joined yet; joining; the first cooperative round (b has nothing yet, what it is to
        // get is held by nobody while a gives it up).
        let old = view("Stable", &[("a", &[0, 1, 2, 3, 4, 5])]);
        assert!(!is_in(&seen(&old), "", false));
        assert!(!is_in(&seen(&old), "b", true));
        let rebalancing = view("PreparingRebalance", &[("a", &[]), ("b", &[])]);
        assert!(!is_in(&seen(&rebalancing), "b", true));
        let between = view("Stable", &[("a", &[0, 1, 2]), ("b", &[])]);
        assert!(!is_in(&seen(&between), "b", true));
        // However long the owner takes to give them up (its revocation waiting for attempts).
        assert!(!joined(
            Some(&seen(&between)),
            "b",
            true,
            &mut Spells::default(),
            now + PERSIST * 10
        ));
        // The second round handed b its share: in, once b has served that rebalance.
        let settled = view("Stable", &[("a", &[0, 1, 2]), ("b", &[3, 4, 5])]);
        assert!(!is_in(&seen(&settled), "b", false));
        assert!(is_in(&seen(&settled), "b", true));
        // More members than partitions: a member with nothing is in when nothing is orphaned.
        let idle = view("Stable", &[("a", &[0, 1, 2, 3, 4, 5]), ("c", &[])]);
        assert!(is_in(&seen(&idle), "c", true));
        // No reading yet: not in.
        assert!(!joined(None, "b", true, &mut Spells::default(), now));
        // Nothing to cover (a follow pattern that matches no topic yet, so no group joined):
        // in once it lasted, not on one reading (a broker answering from an empty cache).
        let mut spells = Spells::default();
        let nothing = Some(&Seen::NothingToCover);
        assert!(!joined(nothing, "", false, &mut spells, now));
        assert!(!joined(
            nothing,
            "",
            false,
            &mut spells,
            now + NOTHING_FOR / 2
        ));
        assert!(!joined(nothing, "b", true, &mut spells, now + NOTHING_FOR));
        assert!(joined(nothing, "", false, &mut spells, now + NOTHING_FOR));
        // A reading of something to cover in between starts it over.
        let mut spells = Spells::default();
        assert!(!joined(nothing, "", false, &mut spells, now));
        assert!(!joined(Some(&seen(&old)), "", false, &mut spells, now));
        assert!(!joined(nothing, "", false, &mut spells, now + NOTHING_FOR));
    }

    #[test]
    fn a_set_the_watch_gave_up_on_does_not_keep_a_member_out_nor_does_a_brief_unreadable_spell_let_it_in()
     {
        let expected = inbox(6);
        let now = Instant::now();
        // Partitions held by nobody that the watch has given up on for now.
        let stuck = view("Stable", &[("squatter", &[]), ("b", &[0, 1, 2])]);
        let held = stuck.orphans(&expected);
        let mut since = Spells::default();
        assert!(!joined(
            Some(&Seen::of(&stuck, &expected, None)),
            "b",
            true,
            &mut since,
            now
        ));
        assert!(joined(
            Some(&Seen::of(&stuck, &expected, Some(&held))),
            "b",
            true,
            &mut since,
            now
        ));
        // Another set held back (an older one) does not let a member in.
        let between = view("Stable", &[("a", &[0, 1]), ("b", &[])]);
        assert!(!joined(
            Some(&Seen::of(&between, &expected, Some(&held))),
            "b",
            true,
            &mut since,
            now
        ));
        // A group that cannot be read: in once a rebalance was served under the membership and
        // the readings stayed unreadable for PERSIST.
        let mut since = Spells::default();
        let u = Some(&Seen::Unreadable);
        assert!(!joined(u, "b", true, &mut since, now));
        assert!(!joined(u, "b", true, &mut since, now + PERSIST / 2));
        assert!(!joined(u, "b", false, &mut since, now + PERSIST));
        assert!(!joined(u, "", true, &mut since, now + PERSIST));
        assert!(joined(u, "b", true, &mut since, now + PERSIST));
        // A readable reading in between starts the spell over.
        let mut since = Spells::default();
        assert!(!joined(u, "b", true, &mut since, now));
        assert!(!joined(
            Some(&Seen::of(&between, &expected, None)),
            "b",
            true,
            &mut since,
            now + PERSIST / 2
        ));
        assert!(!joined(u, "b", true, &mut since, now + PERSIST));
        assert!(joined(u, "b", true, &mut since, now + PERSIST * 2));
    }

    /// `held` names a set only once every member had its turn and it is still there; not a set
    /// merely held back because it came back soon after being mended.
    #[test]
    fn the_held_set_is_one_still_there_after_every_members_turn() {
        let expected = inbox(6);
        let t0 = Instant::now();
        let stuck = view("Stable", &[("a", &[0, 1, 2]), ("b", &[])]);
        let mut t = Tracker::default();
        let mut at = t0;
        // Read every 10 s: due once it lasted PERSIST, then each member's turn (2 readings).
        let mut readings = 0;
        while t.held().is_none() {
            assert!(readings < 20, "never given up");
            t.observe(Some((&stuck, &expected)), at);
            readings += 1;
            at += Duration::from_secs(10);
        }
        assert_eq!(t.held(), Some(&stuck.orphans(&expected)));
        assert!(readings >= 4 + 2, "given up after {readings} readings");
        // Mended: nothing held. The same set back at once is held back, not given up on.
        let whole = view("Stable", &[("a", &[0, 1, 2]), ("b", &[3, 4, 5])]);
        t.observe(Some((&whole, &expected)), at);
        assert_eq!(t.held(), None);
        let mut t2 = Tracker::default();
        let mut at = t0;
        while t2.held().is_none() {
            t2.observe(Some((&stuck, &expected)), at);
            at += Duration::from_secs(10);
        }
        t2.observe(Some((&whole, &expected)), at);
        t2.observe(Some((&stuck, &expected)), at + Duration::from_secs(10));
        assert_eq!(
            t2.held(),
            None,
            "a set that came back is not given up on at once"
        );
        // A rebalance read in between mends nothing: the set back after it is still the one
        // given up on.
        let mut t3 = Tracker::default();
        let mut at = t0;
        while t3.held().is_none() {
            t3.observe(Some((&stuck, &expected)), at);
            at += Duration::from_secs(10);
        }
        let moving = view("PreparingRebalance", &[("a", &[]), ("b", &[])]);
        t3.observe(Some((&moving, &expected)), at);
        t3.observe(Some((&stuck, &expected)), at + Duration::from_secs(10));
        assert_eq!(t3.held(), Some(&stuck.orphans(&expected)));
    }

    #[test]
    fn a_topic_in_error_or_missing_is_unreadable_and_nothing_to_cover_needs_a_pattern() {
        let topic = |name: &'static str, errored: bool| TopicSeen {
            name,
            errored,
            partitions: vec![0, 1],
        };
        let inbox_only = Covers::Topic("inbox".into());
        let pattern = Covers::Pattern(PosixRegex::new(r"^lerian\.streaming\.").unwrap());
        // The named topic: missing or in error is unreadable, never nothing to cover.
        assert_eq!(covered(&[], &inbox_only), None);
        assert_eq!(covered(&[topic("inbox", true)], &inbox_only), None);
        assert_eq!(
            covered(&[topic("inbox", false)], &inbox_only).map(|e| e.len()),
            Some(2)
        );
        // A pattern: nothing matched is nothing to cover; a matched topic in error unreadable.
        let other = [topic("other", true)];
        assert_eq!(covered(&other, &pattern), Some(BTreeSet::new()));
        assert_eq!(
            seen_of(covered(&other, &pattern).as_ref(), None, None),
            Seen::NothingToCover
        );
        let errored = [
            topic("lerian.streaming.a", false),
            topic("lerian.streaming.b", true),
        ];
        assert_eq!(covered(&errored, &pattern), None);
        assert_eq!(covered_readable(&errored, &pattern).len(), 2);
        assert_eq!(seen_of(None, None, None), Seen::Unreadable);
        // Something to cover and no description: unreadable.
        let two = inbox(2);
        assert_eq!(seen_of(Some(&two), None, None), Seen::Unreadable);
    }

    #[test]
    fn patterns_match_as_posix_extended_expressions() {
        let re = PosixRegex::new(r"^lerian\.streaming\.[a-z0-9_-]+$").unwrap();
        assert!(re.is_match("lerian.streaming.ledger"));
        assert!(!re.is_match("lerian.streaming.ledger.dlq"));
        assert!(!re.is_match("lerianXstreaming.ledger"));
        // `\d` is not a digit class in POSIX ERE (Rust's regex would match "ledger1").
        let d = PosixRegex::new(r"^ledger\d$").unwrap();
        assert!(!d.is_match("ledger1"));
        assert!(PosixRegex::new("(").is_none());
    }
}
