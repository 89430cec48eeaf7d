#!/usr/bin/env bash
# Checks the receiver examples under examples/receivers/ against the Standard Webhooks test vector
# (shared/VECTORS.md): installs the pinned libraries, then runs each example's self-test.
#
#   scripts/check-receivers.sh          # quiet on success, prints the failing output otherwise
#   VERBOSE=1 scripts/check-receivers.sh
#
# Needs python3 (3.9+), node + npm (18+) and go (1.21+). Idempotent: the Python venv lives in
# ~/.cache/streaming-hub/receivers-venv and is reused; npm ci and go mod download are no-ops
# when nothing changed. Exit code: 0 all passed, 1 a self-test or an install failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
EX="$ROOT/examples/receivers"
# Pinned versions: python/requirements.txt, node/package.json + package-lock.json, go/go.mod.
PY_VERSION=$(sed -n 's/^standardwebhooks==//p' "$EX/python/requirements.txt")
VENV="${RECEIVERS_VENV:-$HOME/.cache/streaming-hub/receivers-venv}"

failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# run NAME CMD...: runs CMD with its output captured; shows it only on failure (or VERBOSE=1).
run() {
  local name=$1
  shift
  if "$@" >"$log" 2>&1; then
    [[ -n "${VERBOSE:-}" ]] && sed "s/^/[$name] /" "$log"
    return 0
  fi
  echo "== $name FAILED: $*" >&2
  sed "s/^/[$name] /" "$log" >&2
  failed=1
  return 1
}

# --- Python -------------------------------------------------------------------------------
py_install() {
  # (errexit is off inside `run`, hence the explicit `||` / `&&`.)
  if [[ ! -x "$VENV/bin/python" ]]; then
    mkdir -p "$(dirname "$VENV")" && python3 -m venv "$VENV" || return 1
  fi
  if [[ "$("$VENV/bin/python" -c 'import standardwebhooks; print(standardwebhooks.__version__)' 2>/dev/null)" != "$PY_VERSION" ]]; then
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$EX/python/requirements.txt" \
      || return 1
  fi
}
run python-install py_install &&
  run python-self-test "$VENV/bin/python" "$EX/python/receiver.py" --self-test || true

# --- Node ---------------------------------------------------------------------------------
node_install() (
  cd "$EX/node" || exit 1
  # npm ci wipes and reinstalls node_modules; skip it when the last install is newer than both
  # package.json and package-lock.json.
  stamp=node_modules/.package-lock.json
  if [[ -f $stamp && $stamp -nt package.json && $stamp -nt package-lock.json ]]; then
    exit 0
  fi
  npm ci --no-audit --no-fund --loglevel=error
)
run node-install node_install &&
  run node-self-test node "$EX/node/receiver.js" --self-test || true

# --- Go -----------------------------------------------------------------------------------
go_self_test() (
  cd "$EX/go" && go mod download && go mod verify && go vet . && go run . -self-test
)
run go-self-test go_self_test || true

if [[ $failed -ne 0 ]]; then
  echo "check-receivers: FAILED" >&2
  exit 1
fi
[[ -n "${VERBOSE:-}" ]] && echo "check-receivers: all self-tests passed"
exit 0
