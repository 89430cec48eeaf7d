//! `streaming-hub topology apply` against the real broker: creates the topics with the listed
//! settings, changes nothing the second time, and reports a topic whose settings differ.
mod common;

use std::time::Duration;

use common::*;
use rdkafka::admin::{AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};

async fn config_of(topic: &str, key: &str) -> String {
    let a = admin();
    let r = a
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &AdminOptions::new())
        .await
        .unwrap()
        .remove(0)
        .unwrap();
    r.get(key).and_then(|e| e.value.clone()).unwrap_or_default()
}

/// Runs the hub on `prefix`'s topics until it exits (within 60 s): its exit code and output.
fn hub_run_until_it_exits(prefix: &str) -> (Option<i32>, String) {
    let mut hub = std::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
        .arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(hub_env(prefix, r"^lerian\.streaming\.unused$"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let code = wait_until(Duration::from_secs(60), "the hub exits", || {
        hub.try_wait().unwrap()
    })
    .code();
    let out = hub.wait_with_output().unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (code, log)
}

/// `topology apply` exits `code` and says `want`: 1 for topics it reports, 2 for a topology it
/// refuses (as `run` does).
fn refused_saying(prefix: &str, want: &str, code: i32) {
    let (exit, text) = topology_apply(prefix, &[]);
    assert_eq!(exit, code, "{text}");
    assert!(text.contains(want), "{text}");
}

/// Creates a topic as an operator would, past the topology, and waits until the broker lists
/// it with its partitions (until then, no client can know of it).
async fn by_hand(t: NewTopic<'_>) {
    let (name, partitions) = (t.name.to_string(), t.num_partitions as usize);
    let a = admin();
    for r in a.create_topics(&[t], &AdminOptions::new()).await.unwrap() {
        r.unwrap();
    }
    wait_until(Duration::from_secs(30), "the topic is listed", || {
        let md = a
            .inner()
            .fetch_metadata(None, Duration::from_secs(5))
            .ok()?;
        md.topics()
            .iter()
            .any(|t| {
                t.name() == name
                    && t.error().is_none()
                    && t.partitions().len() == partitions
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            })
            .then_some(())
    });
}

#[tokio::test]
async fn apply_creates_topics_with_their_settings_and_is_idempotent() {
    require_broker();
    let prefix = unique("topo");

    let (code, text) = topology_apply(&prefix, &["--dry-run"]);
    assert_eq!(
        code, 1,
        "a dry run with missing topics reports them: {text}"
    );
    assert!(
        text.contains(&format!("missing  {prefix}.inbox (would create)")),
        "{text}"
    );
    let md = admin()
        .inner()
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    assert!(
        !md.topics().iter().any(|t| t.name().starts_with(&prefix)),
        "dry run created something"
    );

    let (code, text) = topology_apply(&prefix, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains(&format!("created  {prefix}.inbox")), "{text}");
    assert!(
        text.contains(&format!("created  {prefix}.subscriptions")),
        "{text}"
    );

    let md = admin()
        .inner()
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    let inbox = md
        .topics()
        .iter()
        .find(|t| t.name() == format!("{prefix}.inbox"))
        .unwrap();
    assert_eq!(inbox.partitions().len(), 6);
    assert_eq!(
        config_of(&format!("{prefix}.subscriptions"), "cleanup.policy").await,
        "compact"
    );
    assert_eq!(
        config_of(&format!("{prefix}.hub.dedup.changelog"), "cleanup.policy").await,
        "compact"
    );
    assert_eq!(
        config_of(&format!("{prefix}.inbox"), "cleanup.policy").await,
        "delete"
    );
    assert_eq!(
        config_of(&format!("{prefix}.inbox"), "retention.ms").await,
        "604800000"
    );
    assert_eq!(
        config_of(&format!("{prefix}.inbox"), "max.message.bytes").await,
        "2097152"
    );

    let (code, text) = topology_apply(&prefix, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(
        !text.contains("created"),
        "second apply changed something: {text}"
    );
    assert!(text.contains(&format!("ok       {prefix}.inbox")), "{text}");

    // Once the cluster matches, the dry run is clean.
    let (code, text) = topology_apply(&prefix, &["--dry-run"]);
    assert_eq!(code, 0, "{text}");
}

#[tokio::test]
async fn topic_with_a_wrong_cleanup_policy_is_reported() {
    // Someone created the control topic by hand, with the default delete policy.
    a_control_topic_with_this_policy_stops_the_hub("delete").await;
}

/// `compact,delete` compacts, and deletes by retention too: the subscriptions older than the
/// retention would go (the start-up check tested for the word `compact` alone).
#[tokio::test]
async fn a_compacted_topic_that_also_deletes_stops_the_hub() {
    a_control_topic_with_this_policy_stops_the_hub("compact,delete").await;
}

/// `topology apply` reports the control topic made by hand with `policy`, and the hub refuses
/// to start on it (exit 2, naming the topic).
async fn a_control_topic_with_this_policy_stops_the_hub(policy: &str) {
    require_broker();
    let prefix = unique("topo");
    let name = format!("{prefix}.subscriptions");
    by_hand(NewTopic::new(&name, 1, TopicReplication::Fixed(1)).set("cleanup.policy", policy))
        .await;
    refused_saying(
        &prefix,
        &format!("DIFFERS  {name}: cleanup.policy is {policy}, the topology says compact"),
        1,
    );
    // It reports; it does not silently rewrite the operator's topic.
    assert_eq!(config_of(&name, "cleanup.policy").await, policy);

    // The hub does not start on it (retention would delete the subscriptions): exit 2, naming
    // the topic.
    let (code, log) = hub_run_until_it_exits(&prefix);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!("topic {name} has cleanup.policy {policy}")),
        "{log}"
    );
}

/// A changelog made by hand whose tombstones go within the hour: a store restored from its own
/// offsets up to 12 h later would miss deletions made meanwhile (finished jobs delivered again),
/// so the hub refuses to start on it, naming it (exit 2).
#[tokio::test]
async fn a_changelog_keeping_tombstones_less_than_a_day_stops_the_hub() {
    require_broker();
    let prefix = unique("topo");
    let name = format!("{prefix}.hub.jobs.changelog");
    by_hand(
        NewTopic::new(&name, 6, TopicReplication::Fixed(1))
            .set("cleanup.policy", "compact")
            .set("delete.retention.ms", "3600000"),
    )
    .await;
    let (code, log) = hub_run_until_it_exits(&prefix);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!(
            "topic {name} keeps tombstones 3600000 ms (delete.retention.ms), less than a day"
        )),
        "{log}"
    );
    assert_eq!(config_of(&name, "delete.retention.ms").await, "3600000");
}

/// An inbox made by hand with the broker's default record size (1 MiB and 12 bytes): the hub
/// writes a 1 MiB payload there with its headers, the broker would refuse it, and ingest would
/// abort and run that batch again for good. The hub refuses to start on it, naming it (exit 2).
#[tokio::test]
async fn an_inbox_taking_smaller_records_than_the_hub_writes_stops_the_hub() {
    require_broker();
    let prefix = unique("topo");
    let name = format!("{prefix}.inbox");
    by_hand(
        NewTopic::new(&name, 6, TopicReplication::Fixed(1)).set("max.message.bytes", "1048588"),
    )
    .await;
    let (code, log) = hub_run_until_it_exits(&prefix);
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains(&format!(
            "topic {name} takes records of at most 1048588 bytes (max.message.bytes), less than \
             the topology's 2097152: the hub writes record batches up to 1179648 bytes there"
        )),
        "{log}"
    );
    assert_eq!(config_of(&name, "max.message.bytes").await, "1048588");
}

/// A topic made by hand with fewer replicas than the hub asks for is reported (losing a broker
/// would stop its writes or lose them), on the 3-broker cluster.
#[tokio::test]
async fn a_topic_with_fewer_replicas_than_asked_is_reported() {
    let bootstrap = cluster_bootstrap();
    let prefix = unique("topo-rf");
    let cluster: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .unwrap();
    let inbox = format!("{prefix}.inbox");
    for r in cluster
        .create_topics(
            &[NewTopic::new(&inbox, 6, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let apply_with = |replicas: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_streaming-hub"))
            .args(["topology", "apply"])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("STREAMING_HUB_KAFKA_BROKERS", &bootstrap)
            .env("STREAMING_HUB_TOPIC_PREFIX", &prefix)
            .env("STREAMING_HUB_REPLICATION_FACTOR", replicas)
            .env(
                "STREAMING_HUB_TOPOLOGY_FILE",
                concat!(env!("CARGO_MANIFEST_DIR"), "/topology/topics.toml"),
            )
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let apply = || apply_with("3");
    for round in 1..=2 {
        let (code, text) = apply();
        assert_eq!(code, Some(1), "round {round}: {text}");
        assert!(
            text.contains(&format!(
                "DIFFERS  {inbox}: replication factor is 1, the topology says 3"
            )),
            "round {round}: {text}"
        );
        if round == 2 {
            // The topics it created have the three replicas asked.
            assert!(
                text.contains(&format!("ok       {prefix}.subscriptions")),
                "{text}"
            );
            assert!(!text.contains("ONE REPLICA"), "{text}");
        }
    }
    // The default of one replica, forgotten on a cluster of three: said, exit 1.
    let (code, text) = apply_with("1");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains(
            "ONE REPLICA: STREAMING_HUB_REPLICATION_FACTOR is 1 on a cluster of 3 brokers"
        ),
        "{text}"
    );
}

/// Someone gave the inbox more partitions by hand, not the changelogs: the hub task of inbox
/// partition 6 would restore partition 6 of each changelog, which does not exist, and the hub
/// would fail at every start. Refused before anything is created, naming the topic.
#[tokio::test]
async fn an_inbox_with_more_partitions_than_a_changelog_is_refused() {
    require_broker();
    let prefix = unique("topo");
    let inbox = format!("{prefix}.inbox");
    by_hand(NewTopic::new(&inbox, 8, TopicReplication::Fixed(1))).await;
    refused_saying(
        &prefix,
        &format!(
            "topic {prefix}.hub.dedup.changelog would be created with 6 partitions (the \
             topology file's), fewer than the inbox's 8"
        ),
        2,
    );
    let md = admin()
        .inner()
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    assert!(
        !md.topics()
            .iter()
            .any(|t| t.name() == format!("{prefix}.hub.dedup.changelog")),
        "nothing created"
    );
    // One made by hand with fewer: its own message, as it is on the broker.
    let dedup = format!("{prefix}.hub.dedup.changelog");
    by_hand(NewTopic::new(&dedup, 6, TopicReplication::Fixed(1)).set("cleanup.policy", "compact"))
        .await;
    refused_saying(
        &prefix,
        &format!("topic {dedup} has 6 partitions, fewer than the inbox's 8"),
        2,
    );
}
