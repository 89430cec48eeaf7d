#!/usr/bin/env python3
"""Times the phases of Kafka transactions the way the hub's stages run them: produce N records,
send_offsets_to_transaction, commit. Diagnostic only (not in the test command).

    pip install confluent-kafka
    scripts/kafka.sh start
    python3 scripts/txn-probe.py                       # librdkafka defaults
    python3 scripts/txn-probe.py retry.backoff.ms=5    # any producer setting, key=value

With the default retry.backoff.ms (100 ms), a transaction begun right after a commit often meets
CONCURRENT_TRANSACTIONS and send_offsets_to_transaction takes ~100 ms (BENCHMARKS.md)."""
import sys
import time

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

BROKERS = "127.0.0.1:9092"
RECORDS, TRANSACTIONS = 800, 12

topic = f"txnprobe-{int(time.time())}"
admin = AdminClient({"bootstrap.servers": BROKERS})
for f in admin.create_topics([NewTopic(topic, 6, 1), NewTopic(topic + "-in", 4, 1)]).values():
    f.result()
conf = {"bootstrap.servers": BROKERS, "transactional.id": topic, "linger.ms": 5,
        "compression.type": "lz4"}
for kv in sys.argv[1:]:
    k, v = kv.split("=", 1)
    conf[k] = v
producer = Producer(conf)
producer.init_transactions(30)
consumer = Consumer({"bootstrap.servers": BROKERS, "group.id": topic, "enable.auto.commit": False,
                     "isolation.level": "read_committed",
                     "partition.assignment.strategy": "cooperative-sticky"})
consumer.subscribe([topic + "-in"])
while not consumer.assignment():  # group metadata for send_offsets_to_transaction
    consumer.poll(0.1)

payload = b"x" * 1024
for n in range(TRANSACTIONS):
    t0 = time.time()
    producer.begin_transaction()
    for i in range(RECORDS):
        producer.produce(topic, payload, key=str(i % 100))
        producer.poll(0)
    t1 = time.time()
    offsets = [TopicPartition(topic + "-in", p, n + 1) for p in range(4)]
    producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
    t2 = time.time()
    producer.commit_transaction(30)
    t3 = time.time()
    consumer.poll(0)
    print(f"produce {1000 * (t1 - t0):.1f} ms  send_offsets {1000 * (t2 - t1):.1f} ms  "
          f"commit {1000 * (t3 - t2):.1f} ms")
