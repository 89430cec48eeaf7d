#!/usr/bin/env bash
# What an idle instance costs: starts `<binary> run` against the broker on 9092 (scripts/kafka.sh,
# already running), waits 15 s for it to settle, then reads for SECONDS (default 20) the CPU time
# of the hub's threads (the kernel's scheduler statistics, /proc/<pid>/task/*/schedstat) and of
# the broker's JVM (/proc/<pid>/stat), and prints milliseconds of CPU per second: the hub's
# threads that ran more than 0.05 ms/s, then the totals. `none` as the binary: the broker alone.
#
#   scripts/idle-cpu.sh "$CARGO_TARGET_DIR/release/streaming-hub"
#   scripts/idle-cpu.sh none 20
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
bin="${1:?usage: scripts/idle-cpu.sh <binary>|none [seconds]}"
secs="${2:-20}"
broker="$(cat "$HOME/.cache/streaming-hub/kafka-data-9092/node-1/kafka.pid" 2>/dev/null || true)"
[[ -n "$broker" && -d "/proc/$broker" ]] || { echo "idle-cpu.sh: no broker on 9092 (scripts/kafka.sh start)" >&2; exit 1; }
dir="$(mktemp -d)"
hub=""
stop() {
  [[ -n "$hub" ]] && { kill "$hub" 2>/dev/null || true; wait "$hub" 2>/dev/null || true; }
  rm -rf "$dir"
}
trap stop EXIT
if [[ "$bin" != none ]]; then
  (cd "$dir" && exec env STREAMING_HUB_KEK="$(head -c32 /dev/urandom | base64)" \
    STREAMING_HUB_JWT_SECRET="$(head -c40 /dev/urandom | base64)" \
    STREAMING_HUB_TOPOLOGY_FILE="$root/topology/topics.toml" STREAMING_HUB_STATE_DIR="$dir/state" \
    STREAMING_HUB_HTTP_LISTEN_ADDR="127.0.0.1:${IDLE_PORT:-18080}" STREAMING_HUB_LOG=warn \
    "$bin" run >"$dir/hub.log" 2>&1) &
  hub=$!
fi
sleep 15
[[ -z "$hub" || -d "/proc/$hub" ]] || { echo "idle-cpu.sh: the hub exited:" >&2; cat "$dir/hub.log" >&2; exit 1; }
threads() { [[ -n "$hub" ]] && for t in /proc/"$hub"/task/*; do echo "${t##*/} $(tr ' ' _ <"$t/comm") $(cut -d' ' -f1 "$t/schedstat")"; done | sort || true; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
threads >"$dir/a"
b0="$(ticks "$broker")"
sleep "$secs"
b1="$(ticks "$broker")"
threads >"$dir/b"
join "$dir/a" "$dir/b" | awk -v s="$secs" '{d = ($5 - $3) / 1e6 / s; t += d; if (d > 0.05) printf "  %-16s %6.2f ms/s\n", $2, d} END {printf "hub    %6.2f ms/s\n", t}'
echo "broker $(awk -v a="$b0" -v b="$b1" -v s="$secs" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%6.2f", (b - a) * 1000 / hz / s}') ms/s"
