#!/usr/bin/env bash
# Runs the stage benchmarks against the real broker with a release build and prints one JSON line
# each (see BENCHMARKS.md for the figures and what limits them).
#
#   scripts/bench.sh                 # ingest, hub (dedup + sequence + restore), match
#   scripts/bench.sh jobs            # 1,000,000 pending jobs: peak memory
#   scripts/bench.sh deliver         # the delivery workers alone (no Kafka): CPU per attempt
#   scripts/bench.sh load            # end to end: every load scenario + the machine's limits,
#                                    # after 120 s of unmeasured runs warm the fresh broker
#   WARM_BROKER=0s scripts/bench.sh load
#   SCENARIO=latency scripts/bench.sh load
#   RECORDS=500000 scripts/bench.sh ingest
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/streaming-hub/target}"
scripts/setup.sh
scripts/kafka.sh start --fresh >/dev/null
cargo build --release --quiet
bin="$CARGO_TARGET_DIR/release/streaming-hub"
pidfile="$HOME/.cache/streaming-hub/kafka-data-${KAFKA_PORT:-9092}/node-1/kafka.pid"
records="${RECORDS:-300000}"
export STREAMING_HUB_LOG="${STREAMING_HUB_LOG:-warn}"
stages=("$@")
((${#stages[@]})) || stages=(ingest hub match)
for stage in "${stages[@]}"; do
  case "$stage" in
    match) "$bin" bench match --records 2000000 ;;
    jobs) "$bin" bench jobs --records 1000000 --size 256 ;;
    deliver) "$bin" bench deliver --records "${RECORDS:-200000}" --size 1024 ;;
    load) "$bin" load "${SCENARIO:-all}" --warm-broker "${WARM_BROKER:-120s}" --out "${OUT:-target/load}" ;;
    *) "$bin" bench "$stage" --records "$records" --size 1024 --broker-pid-file "$pidfile" ;;
  esac
done
