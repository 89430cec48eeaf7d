//! The hub's topics as data (`topology/topics.toml`) and the code that makes a cluster match it.
//!
//! `apply` creates missing topics and reports every existing topic whose partitions or settings
//! differ from the file; it never alters an existing topic (changing partitions of a keyed topic
//! moves tenants between tasks — an operator decides that, not a start-up). `--dry-run` only
//! reports, and exits 1 when a topic is missing (the cluster does not match the file). Names are `<prefix>.<name>`.
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::types::RDKafkaErrorCode;
use serde::Deserialize;

use crate::config::Config;
use crate::runtime::kafka::{self, ADMIN_TIMEOUT, KafkaError};

/// How long the comparison of existing topics' settings may take before it is reported as
/// unchecked instead.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("topology file {path} (STREAMING_HUB_TOPOLOGY_FILE): {why}")]
    File { path: String, why: String },
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error("creating topic {topic} failed: {why}")]
    Create { topic: String, why: String },
    #[error(
        "topic {topic} has {have} partitions, fewer than the inbox's {inbox}: the hub task of inbox \
         partition p keeps its state in partition p of every changelog, and the restore of the \
         others would fail at every start; give it {inbox} (kafka-topics.sh --alter --partitions \
         {inbox}: the hub writes each changelog record to its inbox partition's number, so the \
         records in place stay where they are read)"
    )]
    ChangelogPartitions {
        topic: String,
        have: usize,
        inbox: usize,
    },
    #[error(
        "topic {topic} would be created with {want} partitions (the topology file's), fewer than \
         the inbox's {inbox}: the hub task of inbox partition p keeps its state in partition p of \
         every changelog; give it {inbox} in the topology file (or create it by hand)"
    )]
    NewChangelogPartitions {
        topic: String,
        want: usize,
        inbox: usize,
    },
    #[error(
        "STREAMING_HUB_FOLLOW_PATTERN matches the hub's own topic {topic}: ingest would read what \
         the hub writes; narrow it to producers' topics (lerian.streaming.<source>)"
    )]
    FollowsOwnTopic { topic: String },
    #[error(
        "topic {topic} has cleanup.policy {have}, the topology says {want}: the hub keeps its \
         subscriptions and state there, and retention would delete them; set it \
         (kafka-configs.sh --alter --add-config cleanup.policy={want}) and start again"
    )]
    CleanupPolicy {
        topic: String,
        want: String,
        have: String,
    },
    #[error(
        "topic {topic} keeps tombstones {have} ms (delete.retention.ms), less than a day: a hub \
         store up to 12 h old restores only the changelog's tail, which must still hold the \
         deletions made meanwhile (else finished jobs are delivered again); set it \
         (kafka-configs.sh --alter --add-config delete.retention.ms=86400000) and start again"
    )]
    DeleteRetention { topic: String, have: String },
    #[error(
        "topic {topic} takes records of at most {have} bytes (max.message.bytes), less than the \
         topology's {want}: the hub writes record batches up to {need} bytes there (a batch \
         of 1 MB or STREAMING_HUB_MAX_PAYLOAD_BYTES, and 128 KiB of headers), and the broker \
         would refuse each larger one, halting its partition's batches for good; set it (kafka-configs.sh \
         --alter --add-config max.message.bytes={want}) and start again"
    )]
    MaxMessageBytes {
        topic: String,
        want: String,
        have: String,
        need: u64,
    },
}

/// The least `delete.retention.ms` of a `*.changelog`: twice the age up to which a hub store
/// restores from its own offsets (`hub::task::STALE_AFTER`).
pub const CHANGELOG_MIN_DELETE_RETENTION_MS: u64 = 86_400_000;

/// Whether `have` (a topic's `delete.retention.ms`) is too short for a changelog.
pub fn changelog_tombstones_too_short(topic: &str, have: &str) -> bool {
    topic.ends_with(".changelog")
        && have
            .parse::<u64>()
            .is_ok_and(|ms| ms < CHANGELOG_MIN_DELETE_RETENTION_MS)
}

/// Room a record of the hub takes past its payload: the producer's headers it carries (up to
/// 64 KiB), its own, a quarantined record's key (up to 16 KiB), the batch's framing.
pub const RECORD_ROOM_PAST_PAYLOAD: u64 = 128 * 1024;

/// librdkafka's `batch.size`, which the hub's producers keep: the broker holds a whole batch
/// of records, not each record, to `max.message.bytes`, so many small records make one as
/// large as this.
pub const PRODUCER_BATCH_BYTES: u64 = 1_000_000;

/// The largest record batch the hub may write to a topic holding payloads, for a payload limit
/// of `max_payload_bytes`.
pub fn largest_write(max_payload_bytes: u64) -> u64 {
    max_payload_bytes.max(PRODUCER_BATCH_BYTES) + RECORD_ROOM_PAST_PAYLOAD
}

/// Whether `have` (a topic's `max.message.bytes`) is less than the topology's `want` and than
/// `need`, what the hub writes there ([`largest_write`]).
pub fn records_too_large_for(want: &str, have: &str, need: u64) -> bool {
    match (want.parse::<u64>(), have.parse::<u64>()) {
        (Ok(want), Ok(have)) => have < want && have < need,
        _ => false,
    }
}

impl TopologyError {
    /// A setting or topic the hub refuses to run with (exit 2, as every configuration it
    /// refuses), as against Kafka being unreachable (exit 1: starting again may pass).
    pub fn is_refusal(&self) -> bool {
        !matches!(self, TopologyError::Kafka(_) | TopologyError::Create { .. })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicSpec {
    pub name: String,
    pub partitions: i32,
    pub cleanup_policy: CleanupPolicy,
    /// Delete topics only; "forever" keeps everything.
    #[serde(default)]
    pub retention: Option<String>,
    /// Compacted topics: how long a tombstone stays after cleaning (`delete.retention.ms`).
    #[serde(default)]
    pub delete_retention: Option<String>,
    pub min_insync_replicas: i32,
    #[serde(default)]
    pub max_message_bytes: Option<u64>,
    #[serde(default)]
    pub writers: Vec<String>,
    #[serde(default)]
    pub readers: Vec<String>,
    #[serde(default)]
    pub about: String,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CleanupPolicy {
    Compact,
    Delete,
}

impl CleanupPolicy {
    fn as_str(self) -> &'static str {
        match self {
            CleanupPolicy::Compact => "compact",
            CleanupPolicy::Delete => "delete",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    topic: Vec<TopicSpec>,
}

/// The parsed topology with the prefix and replication factor of this deployment.
#[derive(Debug, Clone)]
pub struct Topology {
    pub prefix: String,
    pub replication_factor: i32,
    pub topics: Vec<TopicSpec>,
}

/// What `apply` found for one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    Created {
        topic: String,
    },
    WouldCreate {
        topic: String,
    },
    Matches {
        topic: String,
    },
    Differs {
        topic: String,
        setting: String,
        want: String,
        have: String,
    },
    /// The topic exists but its settings could not be read (e.g. a broker is down).
    Unchecked {
        topic: String,
        why: String,
    },
    /// One replica asked for (`STREAMING_HUB_REPLICATION_FACTOR`, 1 by default for a local
    /// broker) on a cluster of several brokers: a production deploy that forgot the setting
    /// keeps its state on one disk, which one lost disk loses.
    SingleReplica {
        brokers: usize,
    },
}

impl Finding {
    /// Worth an operator's attention (exit 1): the cluster does not match the topology after this run: a difference, a topic not
    /// compared, or (in a dry run) a topic that is missing.
    pub fn needs_attention(&self) -> bool {
        matches!(
            self,
            Finding::Differs { .. }
                | Finding::Unchecked { .. }
                | Finding::WouldCreate { .. }
                | Finding::SingleReplica { .. }
        )
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Finding::Created { topic } => write!(f, "created  {topic}"),
            Finding::WouldCreate { topic } => write!(f, "missing  {topic} (would create)"),
            Finding::Matches { topic } => write!(f, "ok       {topic}"),
            Finding::Unchecked { topic, why } => {
                write!(f, "UNCHECKED {topic}: settings not compared ({why})")
            }
            Finding::SingleReplica { brokers } => write!(
                f,
                "ONE REPLICA: STREAMING_HUB_REPLICATION_FACTOR is 1 on a cluster of {brokers} \
                 brokers: the hub's topics keep their state on one disk, which one lost disk \
                 loses (set it to 3)"
            ),
            Finding::Differs {
                topic,
                setting,
                want,
                have,
            } => {
                write!(
                    f,
                    "DIFFERS  {topic}: {setting} is {have}, the topology says {want}"
                )
            }
        }
    }
}

impl Topology {
    pub fn load(path: &Path, config: &Config) -> Result<Topology, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|e| TopologyError::File {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        let topology = Self::parse(&text, &config.topic_prefix, config.replication_factor)
            .map_err(|why| TopologyError::File {
                path: path.display().to_string(),
                why,
            })?;
        match topology.followed_own_topic(&config.follow_pattern) {
            Some(topic) => Err(TopologyError::FollowsOwnTopic { topic }),
            None => Ok(topology),
        }
    }

    /// The first of the hub's own topics that ingest's follow pattern would match (its inbox
    /// with a pattern such as `^.*`: ingest would read its own output, again and again).
    pub fn followed_own_topic(&self, follow_pattern: &str) -> Option<String> {
        // The configuration has checked that the pattern compiles.
        let re = regex::Regex::new(follow_pattern).ok()?;
        self.topics
            .iter()
            .map(|t| self.full_name(&t.name))
            .find(|name| re.is_match(name))
    }

    pub fn parse(text: &str, prefix: &str, replication_factor: i32) -> Result<Topology, String> {
        let mut file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        for t in &mut file.topic {
            // A changelog's tombstones must outlive the stores restored from their own offsets
            // (`hub::task::STALE_AFTER`): a file that names none pins the day (a broker default
            // set shorter would otherwise pass unseen).
            if t.name.ends_with(".changelog") {
                let kept = t.delete_retention.get_or_insert_with(|| "1d".to_string());
                let ms = humantime::parse_duration(kept)
                    .map_err(|e| format!("topic {}: delete_retention: {e}", t.name))?
                    .as_millis();
                if ms < CHANGELOG_MIN_DELETE_RETENTION_MS as u128 {
                    return Err(format!(
                        "topic {}: delete_retention must be at least 1d: a hub store up to 12 h \
                         old restores only the changelog's tail, which must still hold the \
                         deletions made meanwhile",
                        t.name
                    ));
                }
            }
        }
        for t in &file.topic {
            if t.partitions < 1 {
                return Err(format!("topic {}: partitions must be at least 1", t.name));
            }
            let inbox = file.topic.iter().find(|i| i.name == "inbox");
            if let Some(inbox) =
                inbox.filter(|i| t.name.ends_with(".changelog") && t.partitions < i.partitions)
            {
                return Err(format!(
                    "topic {}: partitions must be at least the inbox's ({}): the hub task of inbox \
                     partition p keeps its state in partition p of every changelog",
                    t.name, inbox.partitions
                ));
            }
            if let Some(r) = &t.retention {
                retention_ms(r).map_err(|e| format!("topic {}: retention: {e}", t.name))?;
            }
            if let Some(r) = &t.delete_retention {
                humantime::parse_duration(r)
                    .map_err(|e| format!("topic {}: delete_retention: {e}", t.name))?;
            }
        }
        Ok(Topology {
            prefix: prefix.to_string(),
            replication_factor,
            topics: file.topic,
        })
    }

    pub fn full_name(&self, name: &str) -> String {
        format!("{}.{}", self.prefix, name)
    }

    pub fn spec(&self, name: &str) -> Option<&TopicSpec> {
        self.topics.iter().find(|t| t.name == name)
    }

    /// The settings a topic must have, as Kafka names them.
    pub fn desired_configs(&self, t: &TopicSpec) -> BTreeMap<&'static str, String> {
        let mut m = BTreeMap::new();
        m.insert("cleanup.policy", t.cleanup_policy.as_str().to_string());
        m.insert(
            "min.insync.replicas",
            t.min_insync_replicas
                .min(self.replication_factor)
                .to_string(),
        );
        if let Some(r) = &t.retention {
            m.insert(
                "retention.ms",
                retention_ms(r).expect("validated at parse").to_string(),
            );
        }
        if let Some(r) = &t.delete_retention {
            m.insert(
                "delete.retention.ms",
                humantime::parse_duration(r)
                    .expect("validated at parse")
                    .as_millis()
                    .to_string(),
            );
        }
        if let Some(b) = t.max_message_bytes {
            m.insert("max.message.bytes", b.to_string());
        }
        m
    }

    /// Creates missing topics (unless `dry_run`) and reports differences of existing ones.
    ///
    /// A topic created elsewhere moments before (by hand, by another instance) can still be
    /// missing from the metadata a broker answers: creating it then answers that it exists.
    /// Such a topic is not taken as matching: the pass runs again on fresh metadata, so it is
    /// compared like any existing topic and counts in the partition check.
    pub async fn apply(
        &self,
        config: &Config,
        dry_run: bool,
    ) -> Result<Vec<Finding>, TopologyError> {
        let admin = kafka::admin(config)?;
        let mut created: Vec<String> = Vec::new();
        let mut pass = 1;
        loop {
            let last = pass == APPLY_PASSES;
            match self.apply_pass(&admin, dry_run, last).await? {
                Pass::Done(mut findings) => {
                    // Created by an earlier pass, found by this one.
                    for f in &mut findings {
                        if let Finding::Matches { topic } = f {
                            if created.contains(topic) {
                                *f = Finding::Created {
                                    topic: std::mem::take(topic),
                                };
                            }
                        }
                    }
                    return Ok(findings);
                }
                Pass::Raced {
                    created: now,
                    existed,
                } => {
                    created.extend(now);
                    wait_for_topics(&admin, existed.iter().map(String::as_str)).await?;
                    pass += 1;
                }
            }
        }
    }

    /// One pass of [`Topology::apply`]: [`Pass::Raced`] when a topic it created already
    /// existed (unless `last`, when that topic is reported unchecked).
    async fn apply_pass(
        &self,
        admin: &Admin,
        dry_run: bool,
        last: bool,
    ) -> Result<Pass, TopologyError> {
        let names: Vec<String> = self
            .topics
            .iter()
            .map(|t| self.full_name(&t.name))
            .collect();
        let metadata = settled_metadata(admin, &names).await?;
        let existing: BTreeMap<String, usize> = metadata
            .topics()
            .iter()
            .map(|t| (t.name().to_string(), t.partitions().len()))
            .collect();
        // The fewest replicas any partition of a topic has.
        let replicas: BTreeMap<String, usize> = metadata
            .topics()
            .iter()
            .filter_map(|t| {
                let least = t.partitions().iter().map(|p| p.replicas().len()).min()?;
                Some((t.name().to_string(), least))
            })
            .collect();
        // The inbox as it is, or will be once created.
        let inbox = existing
            .get(&self.full_name("inbox"))
            .copied()
            .or_else(|| self.spec("inbox").map(|t| t.partitions as usize));
        if let Some(inbox) = inbox {
            for t in self
                .topics
                .iter()
                .filter(|t| t.name.ends_with(".changelog"))
            {
                let topic = self.full_name(&t.name);
                match (existing.get(&topic), t.partitions as usize) {
                    (Some(&have), _) if have < inbox => {
                        return Err(TopologyError::ChangelogPartitions { topic, have, inbox });
                    }
                    (None, want) if want < inbox => {
                        return Err(TopologyError::NewChangelogPartitions { topic, want, inbox });
                    }
                    _ => {}
                }
            }
        }
        let opts = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
        let mut findings = Vec::new();
        let brokers = metadata.brokers().len();
        if self.replication_factor <= 1 && brokers >= 3 {
            findings.push(Finding::SingleReplica { brokers });
        }
        let mut to_create = Vec::new();
        let mut to_check = Vec::new();
        for t in &self.topics {
            let name = self.full_name(&t.name);
            match existing.get(&name) {
                None if dry_run => findings.push(Finding::WouldCreate { topic: name }),
                None => to_create.push((name, t)),
                Some(&partitions) => to_check.push((name, t, partitions)),
            }
        }
        if !to_check.is_empty() {
            // One bounded request for every existing topic: a broker that just died may still be
            // in the metadata, and a comparison of settings must not hold the hub's start-up.
            let specs: Vec<ResourceSpecifier<'_>> = to_check
                .iter()
                .map(|(name, _, _)| ResourceSpecifier::Topic(name))
                .collect();
            let described = admin
                .describe_configs(
                    &specs,
                    &AdminOptions::new()
                        .operation_timeout(Some(DESCRIBE_TIMEOUT))
                        .request_timeout(Some(DESCRIBE_TIMEOUT)),
                )
                .await;
            for (i, (name, t, partitions)) in to_check.into_iter().enumerate() {
                let resource = match &described {
                    Ok(all) => match all.get(i) {
                        Some(Ok(r)) => r,
                        Some(Err(e)) => {
                            findings.push(Finding::Unchecked {
                                topic: name,
                                why: e.to_string(),
                            });
                            continue;
                        }
                        None => {
                            findings.push(Finding::Unchecked {
                                topic: name,
                                why: "missing from the describe_configs answer".into(),
                            });
                            continue;
                        }
                    },
                    Err(e) => {
                        findings.push(Finding::Unchecked {
                            topic: name,
                            why: e.to_string(),
                        });
                        continue;
                    }
                };
                let mut differs = false;
                if partitions != t.partitions as usize {
                    differs = true;
                    findings.push(Finding::Differs {
                        topic: name.clone(),
                        setting: "partitions".into(),
                        want: t.partitions.to_string(),
                        have: partitions.to_string(),
                    });
                }
                // Fewer replicas than asked: losing a broker may stop writes (or lose data)
                // that the replication factor was chosen to survive. More is no harm.
                if let Some(&have) = replicas.get(&name) {
                    if have < self.replication_factor.max(1) as usize {
                        differs = true;
                        findings.push(Finding::Differs {
                            topic: name.clone(),
                            setting: "replication factor".into(),
                            want: self.replication_factor.to_string(),
                            have: have.to_string(),
                        });
                    }
                }
                for (key, want) in self.desired_configs(t) {
                    let have = resource
                        .get(key)
                        .and_then(|e| e.value.clone())
                        .unwrap_or_default();
                    if !satisfies(key, &have, &want) {
                        differs = true;
                        findings.push(Finding::Differs {
                            topic: name.clone(),
                            setting: key.to_string(),
                            want,
                            have,
                        });
                    }
                }
                if !differs {
                    findings.push(Finding::Matches { topic: name });
                }
            }
        }
        if !to_create.is_empty() {
            let configs: Vec<(String, i32, BTreeMap<&'static str, String>)> = to_create
                .iter()
                .map(|(name, t)| (name.clone(), t.partitions, self.desired_configs(t)))
                .collect();
            let new_topics: Vec<NewTopic<'_>> = configs
                .iter()
                .map(|(name, partitions, cfg)| {
                    let mut nt = NewTopic::new(
                        name,
                        *partitions,
                        TopicReplication::Fixed(self.replication_factor),
                    );
                    for (k, v) in cfg {
                        nt = nt.set(k, v);
                    }
                    nt
                })
                .collect();
            let results = admin
                .create_topics(&new_topics, &opts)
                .await
                .map_err(KafkaError::from)?;
            let mut created = Vec::new();
            let mut existed = Vec::new();
            for r in results {
                match r {
                    Ok(topic) => {
                        created.push(topic.clone());
                        findings.push(Finding::Created { topic });
                    }
                    // Created elsewhere, and not in the metadata read: compared by the next
                    // pass, or reported as not compared by the last.
                    Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) if last => {
                        findings.push(Finding::Unchecked {
                            topic,
                            why: "created elsewhere while this ran; run apply again".into(),
                        })
                    }
                    Err((topic, RDKafkaErrorCode::TopicAlreadyExists)) => existed.push(topic),
                    Err((topic, code)) => {
                        return Err(TopologyError::Create {
                            topic,
                            why: code.to_string(),
                        });
                    }
                }
            }
            wait_for_topics(admin, created.iter().map(String::as_str)).await?;
            if !existed.is_empty() {
                return Ok(Pass::Raced { created, existed });
            }
        }
        Ok(Pass::Done(findings))
    }
}

/// How many times [`Topology::apply`] looks again after finding a topic created elsewhere.
const APPLY_PASSES: u32 = 3;

/// The outcome of one pass of [`Topology::apply`].
enum Pass {
    Done(Vec<Finding>),
    /// Some topics it meant to create already existed: look again once they show.
    Raced {
        created: Vec<String>,
        existed: Vec<String>,
    },
}

type Admin = rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>;

/// The cluster's metadata, once each of `names` it lists is whole: a topic created moments
/// before can be listed with an error or no partitions yet, which would read as a topic with
/// none. After [`ADMIN_TIMEOUT`], the metadata as it is.
async fn settled_metadata(
    admin: &Admin,
    names: &[String],
) -> Result<rdkafka::metadata::Metadata, TopologyError> {
    let (md, _) = metadata_once(admin, |md| {
        !md.topics().iter().any(|t| {
            names.iter().any(|n| n == t.name())
                && (t.error().is_some() || t.partitions().is_empty())
        })
    })
    .await?;
    Ok(md)
}

/// Waits until freshly created topics show up with leaders in the metadata.
async fn wait_for_topics<'a>(
    admin: &Admin,
    names: impl Iterator<Item = &'a str>,
) -> Result<(), TopologyError> {
    let names: Vec<&str> = names.collect();
    let (_, ready) = metadata_once(admin, |md| {
        names.iter().all(|n| {
            md.topics().iter().any(|t| {
                t.name() == *n
                    && t.error().is_none()
                    && !t.partitions().is_empty()
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            })
        })
    })
    .await?;
    if !ready {
        return Err(KafkaError::Setup("created topics did not get leaders in time".into()).into());
    }
    Ok(())
}

/// The cluster's metadata once `ready` holds of it, or as it is after [`ADMIN_TIMEOUT`]; and
/// whether `ready` held.
async fn metadata_once(
    admin: &Admin,
    ready: impl Fn(&rdkafka::metadata::Metadata) -> bool,
) -> Result<(rdkafka::metadata::Metadata, bool), TopologyError> {
    let deadline = std::time::Instant::now() + ADMIN_TIMEOUT;
    loop {
        let md = admin
            .inner()
            .fetch_metadata(None, ADMIN_TIMEOUT)
            .map_err(KafkaError::from)?;
        if ready(&md) {
            return Ok((md, true));
        }
        if std::time::Instant::now() > deadline {
            return Ok((md, false));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether a topic's setting `have` meets the topology's `want`: equal, or for
/// `delete.retention.ms` at least as long (tombstones kept longer only help a restore).
fn satisfies(key: &str, have: &str, want: &str) -> bool {
    match (key, have.parse::<i64>(), want.parse::<i64>()) {
        ("delete.retention.ms", Ok(h), Ok(w)) => h >= w,
        _ => have == want,
    }
}

/// The longest retention the topology file takes as a duration (100 of humantime's years, of
/// 365.25 days).
const MAX_RETENTION_MS: i64 = 100 * 31_557_600_000;

fn retention_ms(text: &str) -> Result<i64, String> {
    if text == "forever" {
        return Ok(-1);
    }
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    // Wrapped by a cast, a retention of centuries came out negative or a few hundred ms.
    i64::try_from(d.as_millis())
        .ok()
        .filter(|&ms| ms <= MAX_RETENTION_MS)
        .ok_or_else(|| format!("{text} is longer than 100 years (write \"forever\")"))
}

/// Whether a topic the topology compacts (`want`) would lose records under the policy it has
/// (`have`; both as Kafka lists them, comma separated): not compacted, or deleting by retention
/// besides (`compact,delete`) where the topology does not. A test for the word `compact` alone
/// let `compact,delete` through, under which retention deletes subscriptions and state.
pub fn retention_deletes_kept_records(want: &str, have: &str) -> bool {
    let set = |s: &str| -> std::collections::BTreeSet<String> {
        s.split(',')
            .map(|p| p.trim().to_ascii_lowercase())
            .filter(|p| !p.is_empty())
            .collect()
    };
    let (want, have) = (set(want), set(have));
    want.contains("compact")
        && (!have.contains("compact") || (have.contains("delete") && !want.contains("delete")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = include_str!("../../topology/topics.toml");

    #[test]
    fn a_retention_past_a_century_is_refused_not_wrapped() {
        assert_eq!(retention_ms("7d"), Ok(7 * 24 * 3_600_000));
        assert_eq!(retention_ms("forever"), Ok(-1));
        assert_eq!(retention_ms("100years").map(|ms| ms > 0), Ok(true));
        for long in ["101years", "100000000years"] {
            let e = retention_ms(long).unwrap_err();
            assert!(e.contains("longer than 100 years"), "{long}: {e}");
        }
    }

    #[test]
    fn a_compacted_topic_that_also_deletes_by_retention_is_refused() {
        assert!(!retention_deletes_kept_records("compact", "compact"));
        assert!(retention_deletes_kept_records("compact", "delete"));
        assert!(retention_deletes_kept_records("compact", "compact,delete"));
        assert!(retention_deletes_kept_records("compact", "delete, compact"));
        assert!(!retention_deletes_kept_records(
            "compact,delete",
            "delete,compact"
        ));
        assert!(!retention_deletes_kept_records("delete", "compact,delete"));
    }

    #[test]
    fn a_follow_pattern_matching_the_hubs_own_topics_is_named() {
        let t = Topology::parse(FILE, "lerian.streaming.hub", 1).unwrap();
        let default = r"^lerian\.streaming\.[a-z0-9_-]+$";
        assert_eq!(t.followed_own_topic(default), None);
        assert_eq!(
            t.followed_own_topic(r"^lerian\.streaming\..*"),
            Some("lerian.streaming.hub.inbox".to_string())
        );
        let t = Topology::parse(FILE, "streaming-hub", 1).unwrap();
        assert_eq!(t.followed_own_topic(r"^lerian\.streaming\..*"), None);
        assert_eq!(
            t.followed_own_topic("^.*"),
            Some("streaming-hub.inbox".to_string())
        );
    }

    #[test]
    fn a_topic_taking_smaller_records_than_the_topology_is_told() {
        let need = largest_write(1_048_576);
        assert_eq!(need, 1_048_576 + 131_072);
        assert!(records_too_large_for("2097152", "1048588", need));
        assert!(!records_too_large_for("2097152", "2097152", need));
        assert!(!records_too_large_for("2097152", "4194304", need));
        assert!(!records_too_large_for("2097152", "?", need));
        // Payloads held to 256 KiB: a batch of small records is still up to 1 MB, so a topic
        // of 512 KiB is refused, one of 1.5 MiB is not.
        assert_eq!(largest_write(262_144), 1_000_000 + 131_072);
        assert!(records_too_large_for(
            "2097152",
            "524288",
            largest_write(262_144)
        ));
        assert!(!records_too_large_for(
            "2097152",
            "1572864",
            largest_write(262_144)
        ));
    }

    #[test]
    fn a_changelog_keeps_tombstones_at_least_a_day() {
        let file = |extra: &str| {
            format!(
                "[[topic]]\nname = \"hub.jobs.changelog\"\npartitions = 1\n\
                 cleanup_policy = \"compact\"\nmin_insync_replicas = 1\n{extra}"
            )
        };
        // Named nowhere: the day is pinned, so a shorter broker default is compared and refused.
        let t = Topology::parse(&file(""), "p", 1).unwrap();
        let jobs = t.spec("hub.jobs.changelog").unwrap();
        assert_eq!(
            t.desired_configs(jobs)
                .get("delete.retention.ms")
                .map(String::as_str),
            Some("86400000")
        );
        let e = Topology::parse(&file("delete_retention = \"1h\"\n"), "p", 1).unwrap_err();
        assert!(e.contains("delete_retention must be at least 1d"), "{e}");
        assert!(Topology::parse(&file("delete_retention = \"2d\"\n"), "p", 1).is_ok());
        assert!(changelog_tombstones_too_short(
            "p.hub.jobs.changelog",
            "3600000"
        ));
        assert!(!changelog_tombstones_too_short(
            "p.hub.jobs.changelog",
            "86400000"
        ));
        // Other compacted topics keep their own setting.
        assert!(!changelog_tombstones_too_short(
            "p.subscriptions",
            "3600000"
        ));
    }

    #[test]
    fn a_changelog_with_fewer_partitions_than_the_inbox_is_refused() {
        let file = FILE.replacen(
            "name = \"hub.dedup.changelog\"\npartitions = 6",
            "name = \"hub.dedup.changelog\"\npartitions = 3",
            1,
        );
        assert_ne!(file, FILE, "the bundled file changed shape");
        let e = Topology::parse(&file, "p", 1).err().unwrap();
        assert!(
            e.contains("hub.dedup.changelog") && e.contains("(6)"),
            "{e}"
        );
    }

    #[test]
    fn bundled_topology_parses_and_changelogs_match_inbox_partitions() {
        let t = Topology::parse(FILE, "streaming-hub", 1).unwrap();
        let inbox = t.spec("inbox").unwrap().partitions;
        let changelogs: Vec<_> = t
            .topics
            .iter()
            .filter(|s| s.name.ends_with(".changelog"))
            .collect();
        assert!(!changelogs.is_empty());
        for c in changelogs {
            assert_eq!(
                c.partitions, inbox,
                "{} must have as many partitions as the inbox",
                c.name
            );
            assert_eq!(
                c.cleanup_policy,
                CleanupPolicy::Compact,
                "{} must be compacted",
                c.name
            );
        }
        assert_eq!(
            t.spec("subscriptions").unwrap().cleanup_policy,
            CleanupPolicy::Compact
        );
        assert_eq!(t.full_name("inbox"), "streaming-hub.inbox");
    }

    #[test]
    fn a_longer_tombstone_retention_satisfies_the_topology_a_shorter_one_does_not() {
        assert!(satisfies("delete.retention.ms", "86400000", "86400000"));
        assert!(satisfies("delete.retention.ms", "604800000", "86400000"));
        assert!(!satisfies("delete.retention.ms", "3600000", "86400000"));
        assert!(
            !satisfies("retention.ms", "604800000", "86400000"),
            "others: equal only"
        );
    }

    #[test]
    fn min_insync_replicas_is_capped_by_the_replication_factor() {
        let single = Topology::parse(FILE, "p", 1).unwrap();
        let three = Topology::parse(FILE, "p", 3).unwrap();
        let inbox = single.spec("inbox").unwrap();
        assert_eq!(single.desired_configs(inbox)["min.insync.replicas"], "1");
        assert_eq!(three.desired_configs(inbox)["min.insync.replicas"], "2");
        assert_eq!(
            single.desired_configs(inbox)["retention.ms"],
            (7 * 86_400_000i64).to_string()
        );
    }

    #[test]
    fn malformed_topology_is_rejected_with_the_topic_named() {
        let bad = "[[topic]]\nname = \"x\"\npartitions = 0\ncleanup_policy = \"delete\"\nmin_insync_replicas = 1\n";
        assert!(
            Topology::parse(bad, "p", 1)
                .unwrap_err()
                .contains("topic x")
        );
        let bad = "[[topic]]\nname = \"x\"\npartitions = 1\ncleanup_policy = \"shred\"\nmin_insync_replicas = 1\n";
        assert!(Topology::parse(bad, "p", 1).is_err());
    }
}
