#!/usr/bin/env bash
# One command, fresh machine: installs what is missing, starts a real Kafka broker, builds and
# starts the hub (development settings), then produces sample platform events and shows live what
# the hub does with them. Ctrl-C stops everything this script started.
#
#   scripts/demo.sh               # until Ctrl-C
#   scripts/demo.sh --ci          # exits on its own after 60 s (CI mode)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/streaming-hub/target}"
duration=()
if [[ "${1:-}" == "--ci" ]]; then duration=(--duration 60s); fi

scripts/setup.sh
# A broker already running (the tests', an operator's) is used and left running; one this script
# starts is stopped with it.
started_broker=0
if ! scripts/kafka.sh status >/dev/null 2>&1; then started_broker=1; fi
# Whatever stops the script from here on stops a broker it started (a failed start or build too).
trap 'if [[ "$started_broker" == 1 ]]; then scripts/kafka.sh stop >/dev/null 2>&1 || true; fi' EXIT
brokers="$(scripts/kafka.sh start --fresh)"
export STREAMING_HUB_KAFKA_BROKERS="${STREAMING_HUB_KAFKA_BROKERS:-$brokers}"
cargo build --quiet
bin="$CARGO_TARGET_DIR/debug/streaming-hub"

state="$(mktemp -d)"
export STREAMING_HUB_STATE_DIR="$state/state"
export STREAMING_HUB_HTTP_LISTEN_ADDR="${STREAMING_HUB_HTTP_LISTEN_ADDR:-127.0.0.1:8080}"
if curl --noproxy '*' --max-time 2 -sS -o /dev/null "http://$STREAMING_HUB_HTTP_LISTEN_ADDR/healthz" 2>/dev/null; then
  # Its answers would pass for this run's hub (an earlier demo's, left running).
  echo "demo: something already answers on $STREAMING_HUB_HTTP_LISTEN_ADDR: stop it or set STREAMING_HUB_HTTP_LISTEN_ADDR" >&2
  exit 1
fi
# Each run is self-contained: its own producer topic, topic prefix and consumer groups, so
# subscriptions and receivers of earlier runs do not linger in this one.
run="demo$(date +%s)"
topic="lerian.streaming.ledger-$run"
export STREAMING_HUB_INSTANCE_ID="$run"
export STREAMING_HUB_TOPIC_PREFIX="${STREAMING_HUB_TOPIC_PREFIX:-streaming-hub-$run}"
export STREAMING_HUB_GROUP_ID="${STREAMING_HUB_GROUP_ID:-$run}"
export STREAMING_HUB_FOLLOW_PATTERN="${STREAMING_HUB_FOLLOW_PATTERN:-^lerian\.streaming\.ledger-$run\$}"
export STREAMING_HUB_LOG="${STREAMING_HUB_LOG:-warn,streaming_hub=info}"
# Development-only secrets, generated fresh for this run; never use these settings in production.
export STREAMING_HUB_KEK="${STREAMING_HUB_KEK:-$(head -c 32 /dev/urandom | base64)}"
export STREAMING_HUB_JWT_SECRET="${STREAMING_HUB_JWT_SECRET:-$(head -c 32 /dev/urandom | base64)}"
export STREAMING_HUB_ALLOW_PRIVATE_SINKS=true STREAMING_HUB_ALLOW_INSECURE_SINKS=true
echo "demo: DEVELOPMENT SETTINGS ONLY (generated KEK and JWT secret, private and http sinks allowed)" >&2
# The log is kept after the demo ends (its state directory is not).
log="${TMPDIR:-/tmp}/streaming-hub-$run.log"
echo "demo: hub log: $log (kept after the demo)" >&2
"$bin" run >"$log" 2>&1 &
hub_pid=$!
stop_all() {
  kill "$hub_pid" 2>/dev/null || true; wait "$hub_pid" 2>/dev/null || true
  rm -rf "$state"
  if [[ "$started_broker" == 1 ]]; then scripts/kafka.sh stop >/dev/null 2>&1 || true; fi
}
trap stop_all EXIT
trap 'exit 130' INT TERM
ready=0
deadline=$((SECONDS + 120))
while ((SECONDS < deadline)); do
  kill -0 $hub_pid 2>/dev/null || { cat "$log" >&2; echo "demo: the hub exited" >&2; exit 1; }
  if curl --noproxy '*' --max-time 2 -fsS "http://$STREAMING_HUB_HTTP_LISTEN_ADDR/readyz" >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.2
done
if [[ $ready != 1 ]]; then
  tail -n 40 "$log" >&2
  echo "demo: the hub was not ready within 120 s (its log's end above)" >&2
  exit 1
fi
"$bin" demo --topic "$topic" --hub-url "http://$STREAMING_HUB_HTTP_LISTEN_ADDR" "${duration[@]}"
