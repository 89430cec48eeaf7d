//! The three-broker cluster from `scripts/kafka.sh start --brokers 3` (started by scripts/test.sh
//! on `TEST_KAFKA_CLUSTER_PORT`): a replicated topic survives the loss of its partition leader,
//! transactions included, and the broker comes back.
mod common;

use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

#[tokio::test]
async fn replicated_topic_survives_its_leader_broker_being_killed() {
    let bootstrap = cluster_bootstrap();
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let topic = unique("repl");
    let t = NewTopic::new(&topic, 1, TopicReplication::Fixed(3)).set("min.insync.replicas", "2");
    for r in admin
        .create_topics(&[t], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let leader = wait_until(Duration::from_secs(30), "partition leader", || {
        let md = admin
            .inner()
            .fetch_metadata(Some(&topic), Duration::from_secs(5))
            .ok()?;
        let p = md.topics().first()?.partitions().first()?;
        (p.leader() >= 0 && p.isr().len() == 3).then_some(p.leader())
    });
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("transactional.id", unique("tid"))
        .set("message.timeout.ms", "60000")
        .create()
        .unwrap();
    producer.init_transactions(Duration::from_secs(30)).unwrap();
    let send_batch = |from: usize| {
        producer.begin_transaction().unwrap();
        for i in from..from + 100 {
            producer
                .send(
                    BaseRecord::<str, str>::to(&topic)
                        .key("k")
                        .payload(&i.to_string()),
                )
                .unwrap();
        }
        producer
            .commit_transaction(Duration::from_secs(60))
            .unwrap();
    };
    send_batch(0);

    let down = BrokerDown::kill(leader);
    let new_leader = wait_until(Duration::from_secs(60), "a new leader", || {
        let md = admin
            .inner()
            .fetch_metadata(Some(&topic), Duration::from_secs(5))
            .ok()?;
        let p = md.topics().first()?.partitions().first()?;
        (p.leader() >= 0 && p.leader() != leader).then_some(p.leader())
    });
    assert_ne!(new_leader, leader);
    send_batch(100); // two in-sync replicas remain: min.insync.replicas = 2 holds
    down.restart();
    wait_until(
        Duration::from_secs(90),
        "the restarted broker back in sync",
        || {
            let md = admin
                .inner()
                .fetch_metadata(Some(&topic), Duration::from_secs(5))
                .ok()?;
            (md.topics().first()?.partitions().first()?.isr().len() == 3).then_some(())
        },
    );

    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", unique("g"))
        .set("isolation.level", "read_committed")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let mut values = Vec::new();
    wait_until(Duration::from_secs(60), "all 200 records", || {
        while let Some(m) = consumer.poll(Duration::from_millis(100)) {
            use rdkafka::Message;
            values.push(String::from_utf8(m.unwrap().payload().unwrap().to_vec()).unwrap());
        }
        (values.len() >= 200).then_some(())
    });
    let want: Vec<String> = (0..200).map(|i| i.to_string()).collect();
    assert_eq!(values, want, "every committed record, once, in order");
}
