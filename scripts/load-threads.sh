#!/usr/bin/env bash
# Where the machine's CPU goes during a load run, thread by thread: runs `<binary> load <scenario>`
# against the broker on 9092 (scripts/kafka.sh, already running), waits DELAY seconds (default 12:
# past the 5 s warm-up and the run's set-up), then reads for SECONDS (default 8) each thread's CPU
# time (the kernel's scheduler statistics, /proc/<pid>/task/*/schedstat) and its context switches
# (voluntary and not) of three processes: the hub the harness started, the harness itself (its
# sink and load producer) and the broker's JVM. Prints milliseconds of CPU per second and switches
# per second by thread name (threads of one name summed; names under 5 ms/s left out), each
# process's totals, then the run's own line.
#
#   scripts/load-threads.sh "$CARGO_TARGET_DIR/release/streaming-hub" latency=5000
#   scripts/load-threads.sh /tmp/hub fanout 8 5
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:?usage: scripts/load-threads.sh <binary> <scenario> [delay] [seconds]}"
scenario="${2:?usage: scripts/load-threads.sh <binary> <scenario> [delay] [seconds]}"
delay="${3:-12}"
secs="${4:-8}"
broker="$(cat "$HOME/.cache/streaming-hub/kafka-data-9092/node-1/kafka.pid" 2>/dev/null || true)"
[[ -n "$broker" && -d "/proc/$broker" ]] || { echo "load-threads.sh: no broker on 9092 (scripts/kafka.sh start)" >&2; exit 1; }
dir="$(mktemp -d)"
load=""
stop() {
  [[ -n "$load" ]] && { kill "$load" 2>/dev/null || true; wait "$load" 2>/dev/null || true; }
  rm -rf "$dir"
}
trap stop EXIT
STREAMING_HUB_LOG=warn "$bin" load "$scenario" --duration 15s --warmup 5s --out "$dir/out" >"$dir/run.log" 2>&1 &
load=$!
sleep "$delay"
hub="$(ps -o pid=,args= --ppid "$load" | awk '/ run$/ {print $1; exit}')"
[[ -n "$hub" ]] || { echo "load-threads.sh: no hub under the harness after ${delay} s:" >&2; tail -5 "$dir/run.log" >&2; exit 1; }
# One line a thread: tid, name, CPU ns, voluntary and involuntary switches. A thread that ended
# between the listing and the read is skipped.
snap() {
  for t in /proc/"$1"/task/*; do
    local line
    line="$(awk -v tid="${t##*/}" -v name="$(tr ' ' _ 2>/dev/null <"$t/comm")" \
      'FNR == 1 && FILENAME ~ /schedstat$/ {ns = $1} /^voluntary_ctxt/ {v = $2} /^nonvoluntary_ctxt/ {n = $2}
       END {if (ns != "" && name != "") print tid, name, ns, v, n}' "$t/schedstat" "$t/status" 2>/dev/null)" || continue
    [[ -n "$line" ]] && echo "$line"
  done | sort
}
for p in hub:"$hub" harness:"$load" broker:"$broker"; do snap "${p#*:}" >"$dir/${p%%:*}.a"; done
sleep "$secs"
for p in hub:"$hub" harness:"$load" broker:"$broker"; do snap "${p#*:}" >"$dir/${p%%:*}.b"; done
for p in hub harness broker; do
  join "$dir/$p.a" "$dir/$p.b" | awk -v s="$secs" -v p="$p" '
    {c = ($7 - $3) / 1e6 / s; v = ($8 - $4) / s; n = ($9 - $5) / s
     cpu[$2] += c; vol[$2] += v; inv[$2] += n; tc += c; tv += v; tn += n}
    END {
      for (k in cpu) if (cpu[k] > 5) printf "%-8s %-24s %7.1f ms/s  %6.0f vol/s %6.0f invol/s\n", p, k, cpu[k], vol[k], inv[k]
      printf "%-8s %-24s %7.1f ms/s  %6.0f vol/s %6.0f invol/s\n", p, "TOTAL", tc, tv, tn
    }' | sort -k1,1 -k3,3nr
done
wait "$load" || true
load=""
grep -E "^(scenario|${scenario%%=*})" "$dir/run.log" | head -2
echo
