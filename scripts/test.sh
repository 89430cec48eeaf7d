#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what is missing, starts the real Kafka
# broker, checks formatting and lints, runs every unit and integration test.
#
#   scripts/test.sh            # everything
#   scripts/test.sh ingest     # extra arguments go to `cargo test`
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/streaming-hub/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

# One run at a time on a machine: a second would share the first one's brokers, and the cluster
# tests stop and restart brokers under the other's feet. The lock is held by flock itself, around
# this script run again (`-o`: not by the brokers it starts, which outlive it).
if [[ -z "${TEST_SH_LOCK_HELD:-}" ]]; then
  mkdir -p "$HOME/.cache/streaming-hub"
  rc=0
  TEST_SH_LOCK_HELD=1 flock -n -o -E 75 "$HOME/.cache/streaming-hub/test.lock" \
    bash "$PWD/scripts/test.sh" "$@" || rc=$?
  if [[ $rc == 75 ]]; then
    echo "test.sh: another scripts/test.sh is running on this machine (its brokers are in use)" >&2
    exit 1
  fi
  exit "$rc"
fi

scripts/setup.sh

echo "== cargo fmt --check" >&2
cargo fmt --check
echo "== cargo clippy -- -D warnings" >&2
cargo clippy --all-targets -- -D warnings
# Built before the brokers start: their five JVMs would take CPU from a cold build.
echo "== cargo test --no-run" >&2
cargo test --no-run "$@"

export TEST_KAFKA_CLUSTER_PORT="${TEST_KAFKA_CLUSTER_PORT:-19192}"
export TEST_KAFKA_SASL_BROKER_PORT="${TEST_KAFKA_SASL_BROKER_PORT:-29092}"
# The fuzz targets' build, started beside the tests (see below); stopped if the run ends first.
fuzz_build_pid=""
stop_fuzz_build() {
  if [[ -n "$fuzz_build_pid" ]]; then
    kill -- "-$fuzz_build_pid" 2>/dev/null || true
  fi
}
trap stop_fuzz_build EXIT
# In CI the brokers started here are stopped at the end (a developer's stay up for the next run).
if [[ "${CI:-}" == "true" ]]; then
  stop_brokers() {
    local port
    for port in "${KAFKA_PORT:-9092}" "$TEST_KAFKA_CLUSTER_PORT" "$TEST_KAFKA_SASL_BROKER_PORT"; do
      KAFKA_PORT="$port" scripts/kafka.sh stop >/dev/null 2>&1 || true
    done
  }
  trap 'stop_fuzz_build; stop_brokers' EXIT
fi
scripts/kafka.sh start --fresh >/dev/null
# The brokers just started, not whatever an inherited TEST_KAFKA_* names (another machine's, a
# stale CA); and the SCRAM tests run (TEST_KAFKA_SKIP_SASL would skip them silently).
unset TEST_KAFKA_SKIP_SASL
export TEST_KAFKA_BROKERS="127.0.0.1:${KAFKA_PORT:-9092}"
# A three-broker cluster (replication, leader failover) on its own ports, for tests/cluster.rs.
KAFKA_PORT="$TEST_KAFKA_CLUSTER_PORT" scripts/kafka.sh start --brokers 3 --fresh >/dev/null
# A SCRAM-SHA-256 broker (SASL_PLAINTEXT on +2, SASL_SSL on +3, CA made by kafka.sh) for
# tests/security.rs.
KAFKA_PORT="$TEST_KAFKA_SASL_BROKER_PORT" KAFKA_HEAP=384m scripts/kafka.sh start --sasl --fresh >/dev/null
export TEST_KAFKA_SASL_PORT="$((TEST_KAFKA_SASL_BROKER_PORT + 2))"
export TEST_KAFKA_SASL_CA="$HOME/.cache/streaming-hub/kafka-data-$TEST_KAFKA_SASL_BROKER_PORT/tls/ca.pem"

if [[ $# -eq 0 ]]; then
  # The fuzz targets' build keeps one core busy for minutes after a change under src/ (both,
  # and for most of an hour, on a first run), while the tests mostly wait on the brokers: it
  # runs beside them on the CPU they leave idle, in a process group of its own; the fuzz run
  # after the demo finds it done. Its own session is its own scheduling group where the kernel
  # groups by session (sched_autogroup): `nice` alone would rank it only against itself, and the
  # group would take as much CPU as the whole test run (brokers restarted under load took a
  # minute to come back). The group's nice goes to 19 too.
  fuzz_build_log="$(mktemp)"
  echo "== FUZZ_BUILD_ONLY=1 scripts/fuzz.sh (beside the tests)" >&2
  FUZZ_BUILD_ONLY=1 setsid -w bash -c \
    'for _ in 1 2 3; do echo 19 2>/dev/null >/proc/self/autogroup && break; sleep 0.2; done
     exec nice -n 19 scripts/fuzz.sh' \
    >"$fuzz_build_log" 2>&1 &
  fuzz_build_pid=$!
fi
echo "== cargo test" >&2
cargo test "$@"
if [[ $# -eq 0 ]]; then
  # The README's run command, unattended: it fails unless the run showed a delivery, a drop and a
  # quarantine.
  echo "== scripts/demo.sh --ci" >&2
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  STREAMING_HUB_HTTP_LISTEN_ADDR="127.0.0.1:$port" scripts/demo.sh --ci | tail -n 3
  # Schemathesis against /openapi.json of a running hub: no 5xx, every answer as documented.
  echo "== scripts/api-fuzz.sh" >&2
  scripts/api-fuzz.sh
  # cargo fuzz targets (header classifier, Avro decoders, API bodies), 20 s each.
  echo "== scripts/fuzz.sh 20" >&2
  if ! wait "$fuzz_build_pid"; then
    fuzz_build_pid=""
    cat "$fuzz_build_log" >&2
    echo "test.sh: the fuzz targets' build failed (its log above)" >&2
    exit 1
  fi
  fuzz_build_pid=""
  grep -E '^built in' "$fuzz_build_log" | sed 's/^/fuzz targets /' >&2 || true
  scripts/fuzz.sh 20
fi
