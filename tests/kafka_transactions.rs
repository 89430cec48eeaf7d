//! The broker started by `scripts/kafka.sh` supports what the hub stands on: transactions whose
//! committed records a `read_committed` reader sees and whose aborted records it never sees.
mod common;

use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

fn txn_producer(id: &str) -> BaseProducer {
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", id)
        .create()
        .expect("transactional producer");
    p.init_transactions(Duration::from_secs(30))
        .expect("init_transactions");
    p
}

#[tokio::test]
async fn committed_transaction_is_visible_and_aborted_one_is_not() {
    require_broker();
    let topic = unique("txn");
    create_topic(&topic, 1).await;
    let p = txn_producer(&unique("tid"));

    p.begin_transaction().unwrap();
    for i in 0..3 {
        p.send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload(&format!("committed-{i}")),
        )
        .unwrap();
    }
    p.commit_transaction(Duration::from_secs(30)).unwrap();

    p.begin_transaction().unwrap();
    for i in 0..3 {
        p.send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload(&format!("aborted-{i}")),
        )
        .unwrap();
    }
    p.flush(Duration::from_secs(30)).unwrap(); // the aborted records really reach the log
    p.abort_transaction(Duration::from_secs(30)).unwrap();

    p.begin_transaction().unwrap();
    p.send(
        BaseRecord::<str, str>::to(&topic)
            .key("k")
            .payload("after-abort"),
    )
    .unwrap();
    p.commit_transaction(Duration::from_secs(30)).unwrap();

    // Wait for the last committed record: everything before it is decided.
    let got = read_until(&[&topic], Duration::from_secs(30), |r| {
        r.iter()
            .any(|g| g.rec.value.as_deref() == Some(b"after-abort".as_slice()))
    });
    let values: Vec<String> = got
        .iter()
        .map(|g| String::from_utf8(g.rec.value.clone().unwrap()).unwrap())
        .collect();
    assert_eq!(
        values,
        ["committed-0", "committed-1", "committed-2", "after-abort"]
    );
    // The aborted records occupy offsets: the last record sits past them.
    assert!(
        got.last().unwrap().offset > 4,
        "aborted records were written and skipped"
    );
}

#[tokio::test]
async fn a_second_producer_with_the_same_transactional_id_fences_the_first() {
    require_broker();
    let topic = unique("fence");
    create_topic(&topic, 1).await;
    let id = unique("tid");
    let zombie = txn_producer(&id);
    zombie.begin_transaction().unwrap();
    zombie
        .send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload("zombie"),
        )
        .unwrap();
    zombie.flush(Duration::from_secs(30)).unwrap();

    let successor = txn_producer(&id); // bumps the epoch: the zombie's open transaction is aborted
    successor.begin_transaction().unwrap();
    successor
        .send(
            BaseRecord::<str, str>::to(&topic)
                .key("k")
                .payload("successor"),
        )
        .unwrap();
    successor
        .commit_transaction(Duration::from_secs(30))
        .unwrap();

    let err = zombie
        .commit_transaction(Duration::from_secs(30))
        .expect_err("a fenced producer cannot commit");
    assert!(
        err.to_string().to_lowercase().contains("fenc") || err.to_string().contains("epoch"),
        "{err}"
    );

    let got = read_until(&[&topic], Duration::from_secs(30), |r| !r.is_empty());
    let values: Vec<_> = got.iter().map(|g| g.rec.value.clone().unwrap()).collect();
    assert_eq!(values, [b"successor".to_vec()]);
}
