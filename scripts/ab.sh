#!/usr/bin/env bash
# A/B runs of the load harness: two or more builds or settings, rotated run by run (one run of
# each per round, each round starting one variant further on, so the broker's and the machine's
# drift and the place in a round land on all of them alike), against
# the broker already running on 9092 (start it with scripts/kafka.sh; it is not restarted, so a
# warm broker stays warm).
#
#   scripts/ab.sh [-r ROUNDS] [-o DIR] <scenario> <variant> <variant>...
#     scenario  a `streaming-hub load` scenario: throughput, fanout, latency=5000, ...
#     variant   <binary>[:VAR=value[,VAR=value...]]; a name for it is made from the binary's
#               file name and its settings
#
#   cp "$CARGO_TARGET_DIR/release/streaming-hub" /tmp/hub-before    # then build the change
#   scripts/ab.sh -r 3 throughput /tmp/hub-before "$CARGO_TARGET_DIR/release/streaming-hub"
#   scripts/ab.sh latency=5000 /tmp/hub-before /tmp/hub-before:STREAMING_HUB_COMMIT_INTERVAL=10ms
#   scripts/ab.sh throughput /tmp/hub /tmp/hub:LOAD_HUB_LOG=info   # the hub logging at info
#
# Every run: STREAMING_HUB_LOG=warn <binary> load <scenario> --duration 15s (AB_DURATION) --warmup 5s
# --out DIR/<variant>-r<round> (results.jsonl and the hub's metrics-*.prom there, the run's
# output in run.log, the hub's log in hub.log, a `scale-out` run's second instance's in hub-2.log). After each run one line: variant, round, deliveries/s, p50 and p99 ms, hub
# CPU s per 1,000 deliveries, peak RSS MiB, missing, duplicates, bad signatures, then the
# harness's and the broker's CPU s per 1,000 deliveries.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3
out="target/ab/$(date +%Y%m%d-%H%M%S)"
while getopts "r:o:" opt; do
  case "$opt" in
    r) rounds="$OPTARG" ;;
    o) out="$OPTARG" ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if (($# < 2)); then
  sed -n '2,22p' "$0"
  exit 2
fi
scenario="$1"
shift
# Every run uses the broker on 9092 as it is: without one, each would fail the same way.
scripts/kafka.sh status >/dev/null || { echo "ab.sh: no broker on 9092 (scripts/kafka.sh start)" >&2; exit 1; }
failed=0
variants=("$@")
name_of() {
  local bin="${1%%:*}" settings=""
  [[ "$1" == *:* ]] && settings="${1#*:}"
  local name
  name="$(basename "$bin")"
  [[ -n "$settings" ]] && name="$name+$(tr ',=' '+-' <<<"$settings")"
  printf '%s' "$name"
}
for v in "${variants[@]}"; do
  bin="${v%%:*}"
  [[ -x "$bin" ]] || { echo "ab.sh: $bin is not an executable" >&2; exit 2; }
done
mkdir -p "$out"
echo "variant round rate deliveries_per_s p50_ms p99_ms cpu_s_per_1k rss_mib missing dup bad_sig harness_cpu broker_cpu" | tee "$out/summary.txt"
for r in $(seq 1 "$rounds"); do
  # Each round starts one variant further on (A B, B A, A B, ...): the run second in a round had
  # the lower p99 at 5,000/s in seven of eight rounds in session 35, whichever build it was.
  n=${#variants[@]}
  order=()
  for i in $(seq 0 $((n - 1))); do order+=("${variants[$(((i + r - 1) % n))]}"); done
  for v in "${order[@]}"; do
    bin="${v%%:*}"
    settings=()
    if [[ "$v" == *:* ]]; then IFS=',' read -r -a settings <<<"${v#*:}"; fi
    dir="$out/$(name_of "$v")-r$r"
    mkdir -p "$dir"
    # A `scale-out` run's second instance logs beside the first: none left from an earlier run.
    rm -f "${TMPDIR:-/tmp}/streaming-hub-load-hub-2.log"
    if ! env "${settings[@]}" STREAMING_HUB_LOG=warn "$bin" load "$scenario" \
      --duration "${AB_DURATION:-15s}" --warmup 5s --out "$dir" >"$dir/run.log" 2>&1; then
      echo "ab.sh: $(name_of "$v") round $r failed; see $dir/run.log" >&2
      failed=$((failed + 1))
      continue
    fi
    # The hub's own log (of its last start: a restart writes it anew), kept beside the run.
    cp "${TMPDIR:-/tmp}/streaming-hub-load-hub.log" "$dir/hub.log" 2>/dev/null || true
    cp "${TMPDIR:-/tmp}/streaming-hub-load-hub-2.log" "$dir/hub-2.log" 2>/dev/null || true
    python3 - "$dir/results.jsonl" "$(name_of "$v")" "$r" <<'EOF' | tee -a "$out/summary.txt"
import json, sys
path, name, rnd = sys.argv[1:]
for line in open(path):
    d = json.loads(line)
    if "scenario" not in d:
        continue
    # The rate asked, and what the producer reached when it fell short (below 98%).
    rate, got = d.get("target_rate"), d.get("achieved_rate")
    shown = "max" if rate is None else str(rate)
    if rate is not None and got is not None and got < 0.98 * rate:
        shown += "(" + str(round(got)) + ")"
    print(name, rnd, shown, round(d["deliveries_per_s"]), d["p50_ms"], d["p99_ms"],
          round(d["hub_cpu_s_per_1k"], 3), d["hub_peak_rss_mib"], d["missing"],
          d["duplicates"], d["bad_signatures"],
          round(d.get("harness_cpu_s_per_1k", 0), 3),
          "-" if d.get("broker_cpu_s_per_1k") is None else round(d["broker_cpu_s_per_1k"], 3))
EOF
  done
done
echo "ab.sh: results under $out"
if ((failed > 0)); then
  echo "ab.sh: $failed run(s) failed" >&2
  exit 1
fi
