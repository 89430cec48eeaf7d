#!/usr/bin/env bash
# Fuzzes the HTTP API against its own OpenAPI document: builds and starts the real hub against the
# broker (own topic prefix, generated KEK and JWT secret), seeds a few subscriptions, then runs
# schemathesis on GET /openapi.json twice, with a tenant token and with an admin token. Every
# answer must be documented (status code, content type, body schema) and none may be a 5xx; the
# hub must not panic. Exits non-zero on any failure. Tokens and secrets never reach the terminal
# or a command line: they travel in the environment (schemathesis reads the token from its config
# file's `${API_FUZZ_TOKEN}`) and in a mode-600 header file for curl.
#
#   scripts/api-fuzz.sh                          # about 1 min warm
#   API_FUZZ_EXAMPLES=200 scripts/api-fuzz.sh    # more test cases per operation
#   API_FUZZ_SEED=42 scripts/api-fuzz.sh         # reproduce a run
#   API_FUZZ_REPORT_DIR=/tmp/r scripts/api-fuzz.sh   # keep every request and answer (HAR, tokens filtered)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/streaming-hub/target}"
SCHEMATHESIS_VERSION="4.32.5"
venv="$HOME/.cache/streaming-hub/venv-schemathesis"
examples="${API_FUZZ_EXAMPLES:-25}"
seed="${API_FUZZ_SEED:-$RANDOM}"
report=()
if [[ -n "${API_FUZZ_REPORT_DIR:-}" ]]; then
  mkdir -p "$API_FUZZ_REPORT_DIR"
  report_dir="$(cd "$API_FUZZ_REPORT_DIR" && pwd)"
fi
brokers="${TEST_KAFKA_BROKERS:-127.0.0.1:${KAFKA_PORT:-9092}}"

if [[ "$("$venv/bin/schemathesis" --version 2>/dev/null)" != *"$SCHEMATHESIS_VERSION"* ]]; then
  echo "api-fuzz: installing schemathesis $SCHEMATHESIS_VERSION in $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

scripts/kafka.sh start >/dev/null
cargo build --quiet
bin="$CARGO_TARGET_DIR/debug/streaming-hub"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
work="$(mktemp -d)"
run="apifuzz$(date +%s)$$"
port="$(free_port)"
base="http://127.0.0.1:$port"
# The hub's environment, as tests/common/mod.rs `api_hub_env` builds it: own topic prefix, groups,
# instance and state directory; a producer topic nobody writes to; the API on (KEK + JWT secret);
# private and http sinks allowed, so the seeded webhook can point at a closed loopback port (its
# probes fail at once and nothing leaves this machine). Exported only in the hub's and the token
# command's subshells, never passed as arguments (which `ps` shows); no other STREAMING_HUB_*
# variable of the caller gets in.
kek="$(head -c 32 /dev/urandom | base64)"
jwt_secret="$(head -c 32 /dev/urandom | base64)"
hub_env() {
  while read -r name; do unset "$name"; done < <(compgen -e | grep '^STREAMING_HUB_' || true)
  export STREAMING_HUB_KAFKA_BROKERS="$brokers"
  export STREAMING_HUB_TOPIC_PREFIX="$run"
  export STREAMING_HUB_GROUP_ID="$run-group"
  export STREAMING_HUB_INSTANCE_ID="$run-1"
  export STREAMING_HUB_FOLLOW_PATTERN="^lerian\\.streaming\\.$run\$"
  export STREAMING_HUB_HTTP_LISTEN_ADDR="127.0.0.1:$port"
  export STREAMING_HUB_STATE_DIR="$work/state"
  export STREAMING_HUB_TOPOLOGY_FILE="$PWD/topology/topics.toml"
  export STREAMING_HUB_SESSION_TIMEOUT=6s
  export STREAMING_HUB_HTTP_TIMEOUT=2s
  # Generated writes reach the handlers instead of a 429 (which the document also lists).
  export STREAMING_HUB_API_WRITE_RATE=0
  export STREAMING_HUB_SHUTDOWN_TIMEOUT=5s
  export STREAMING_HUB_ALLOW_PRIVATE_SINKS=true
  export STREAMING_HUB_ALLOW_INSECURE_SINKS=true
  export STREAMING_HUB_LOG="warn,streaming_hub=info"
  export STREAMING_HUB_KEK="$kek"
  export STREAMING_HUB_JWT_SECRET="$jwt_secret"
}
# `exec` in the subshell: `$!` is the hub itself, so the trap stops it.
(hub_env && exec "$bin" run) >"$work/hub.log" 2>&1 &
hub_pid=$!
cleanup() {
  kill "$hub_pid" 2>/dev/null || true
  wait "$hub_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

ready=false
for _ in $(seq 1 300); do
  if curl --noproxy '*' -fsS "$base/readyz" >/dev/null 2>&1; then ready=true; break; fi
  kill -0 "$hub_pid" 2>/dev/null || break
  sleep 0.2
done
if ! $ready; then
  tail -n 40 "$work/hub.log" >&2
  echo "api-fuzz: the hub never became ready" >&2
  exit 1
fi

tenant="$run-tenant"
tenant_token="$(hub_env && exec "$bin" token --tenant "$tenant" --ttl 1h)"
admin_token="$(hub_env && exec "$bin" token --admin --ttl 1h)"
closed_port="$(free_port)"

# POST /v1/subscriptions with the tenant token; prints the new id only (never the secret).
# A failed POST fails the run: `set -e` does not reach inside `$(create …)`, so each step's status
# is checked here and an empty id never seeds the fuzz.
create() {
  local body rc=0
  (umask 077 && printf 'Authorization: Bearer %s\n' "$tenant_token" >"$work/auth")
  body="$(curl --noproxy '*' -fsS -H @"$work/auth" -H 'content-type: application/json' -d "$1" \
    "$base/v1/subscriptions")" || rc=$?
  rm -f "$work/auth"
  if [[ $rc != 0 ]]; then
    echo "api-fuzz: creating a seed subscription failed (curl exit $rc)" >&2
    return 1
  fi
  python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' <<<"$body"
}

# Fresh subscriptions for one run, and the config that points generated requests at them: a pull
# and a webhook subscription (its URL refuses connections) for every `id`/`subscription_id`, one
# only DELETE may take. Each is drawn most of the time, a generated value otherwise; the same for
# the tenant. The token comes from the environment (`${API_FUZZ_TOKEN}`), never from this file.
seed() {
  local pull webhook doomed
  pull="$(create '{"event_types":["*"],"destination":{"type":"pull"}}')"
  webhook="$(create '{"event_types":["*"],"destination":{"type":"webhook","url":"http://127.0.0.1:'"$closed_port"'/hook"}}')"
  doomed="$(create '{"event_types":["a.b"],"destination":{"type":"pull"}}')"
  [[ -n $pull && -n $webhook && -n $doomed ]] || { echo "api-fuzz: a seed subscription has no id" >&2; exit 1; }
  cat >"$work/schemathesis.toml" <<EOF
headers = { Authorization = "Bearer \${API_FUZZ_TOKEN}" }

[dictionaries]
ids = { values = ["$pull", "$webhook"] }
doomed = { values = ["$doomed"] }
tenants = { values = ["$tenant"] }

[parameters]
"path.id" = { dictionary = "ids", probability = 0.8 }
"query.subscription_id" = { dictionary = "ids", probability = 0.8 }
"body.subscription_id" = { dictionary = "ids", probability = 0.8 }
"query.tenant_id" = { dictionary = "tenants", probability = 0.8 }
"body.tenant_id" = { dictionary = "tenants", probability = 0.8 }

# DELETE takes only its own subscription: neither the seeded ones nor ids learnt from answers.
[[operations]]
include-method = "DELETE"
parameters = { "path.id" = { dictionary = "doomed", probability = 0.5 } }
phases.examples.extra-data-sources.responses = false
phases.coverage.extra-data-sources.responses = false
phases.fuzzing.extra-data-sources.responses = false
EOF
}

checks="not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
failed=()
fuzz() {
  local who="$1" token="$2"
  seed
  if [[ -n "${report_dir:-}" ]]; then
    report=(--report har --report-har-path "$report_dir/$who.har")
  fi
  echo "== schemathesis $SCHEMATHESIS_VERSION ($who token, $examples examples per operation, seed $seed)" >&2
  # From $work: schemathesis keeps its crash cache under the current directory. One worker:
  # with two, hypothesis's concurrent `ast.parse` on Python 3.11 fails now and then ("AST
  # constructor recursion depth mismatch"), a tool error rather than a finding.
  if ! (cd "$work" && API_FUZZ_TOKEN="$token" "$venv/bin/schemathesis" --config-file schemathesis.toml \
      run "$base/openapi.json" \
      --checks "$checks" \
      --max-examples "$examples" \
      --seed "$seed" \
      --workers 1 \
      --request-timeout 10 \
      --phases examples,coverage,fuzzing \
      --suppress-health-check too_slow,filter_too_much \
      --generation-database none \
      --continue-on-failure \
      "${report[@]}" \
      --no-color); then
    failed+=("$who")
  fi
}
fuzz tenant "$tenant_token"
fuzz admin "$admin_token"

if ! kill -0 "$hub_pid" 2>/dev/null; then
  tail -n 40 "$work/hub.log" >&2
  echo "api-fuzz: the hub died during the run" >&2
  exit 1
fi
if grep -q "panicked" "$work/hub.log"; then
  grep -m 5 -A 3 "panicked" "$work/hub.log" >&2
  failed+=("hub panic")
fi
if ((${#failed[@]})); then
  echo "api-fuzz: FAILED (${failed[*]}); rerun with API_FUZZ_SEED=$seed" >&2
  exit 1
fi
echo "api-fuzz: passed (tenant and admin tokens, seed $seed)" >&2
