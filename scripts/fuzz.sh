#!/usr/bin/env bash
# The fuzz targets of fuzz/ (issue #9): installs cargo-fuzz and the nightly toolchain when
# missing, builds every target once, runs each for a bounded time and fails if any crashes.
#
#   scripts/fuzz.sh              # 20 s per target (CI)
#   scripts/fuzz.sh 600          # 10 min per target, by hand
#   FUZZ_TARGETS="avro_decode" scripts/fuzz.sh 60
#   FUZZ_BUILD_ONLY=1 scripts/fuzz.sh   # install and build only
#
# Builds go to fuzz/ under the main crate's cargo target dir ($CARGO_TARGET_DIR, else
# $HOME/.cache/streaming-hub/target), so whatever keeps that directory between runs keeps them
# too (instrumented: a cargo target dir of their own inside it; the first build compiles
# librdkafka and RocksDB again: 45 min on 2 busy cores, then about 2 min after a change under
# src/, seconds otherwise). cargo-fuzz is installed under tools/ there, on the same grounds. Corpora live in
# $HOME/.cache/streaming-hub/fuzz-corpus/<target> and grow from run to run, seeded from
# fuzz/seeds/<target>; crashing inputs land in $HOME/.cache/streaming-hub/fuzz-artifacts/<target>.
# Reproduce one with:
#   cargo +nightly fuzz run -s none --target-dir "$HOME/.cache/streaming-hub/target/fuzz" <target> <file>
#
# No AddressSanitizer (`-s none`): the cc crate compiles the bundled zstd with -fsanitize=address,
# and librdkafka's configure then fails to link its test programs against it. The code under test
# is safe Rust, where what we hunt (panics, overflow, wrong answers) needs no sanitizer; cargo-fuzz
# still builds with debug assertions and overflow checks.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-20}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/fuzz.sh [seconds-per-target]" >&2
  exit 2
fi
cache="$HOME/.cache/streaming-hub"
main_target="${CARGO_TARGET_DIR:-$cache/target}"
target_dir="${FUZZ_TARGET_DIR:-$main_target/fuzz}"
if [[ -z "${FUZZ_TARGET_DIR:-}" && -d "$cache/fuzz-target" && ! -d "$target_dir" ]]; then
  target_dir="$cache/fuzz-target" # where earlier versions of this script built: kept, not rebuilt
fi
tools="$main_target/tools"
export PATH="$tools/bin:$PATH"
corpus_root="${FUZZ_CORPUS_DIR:-$cache/fuzz-corpus}"
artifact_root="$cache/fuzz-artifacts"
targets="${FUZZ_TARGETS:-ingest_classify avro_decode api_bodies}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

if ! rustup toolchain list | grep -q '^nightly'; then
  echo "== rustup toolchain install nightly" >&2
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== cargo install cargo-fuzz" >&2
  # Built in a directory of its own (scripts/test.sh exports CARGO_TARGET_DIR), installed beside
  # the builds it serves.
  env -u CARGO_TARGET_DIR cargo install cargo-fuzz --locked --root "$tools"
fi

# Each clone path builds this crate and the fuzz targets anew (cargo hashes where a path
# dependency lives), and nothing removed the old copies: 46 GB of them after six weeks of CI
# runs filled the disk. Copies built more than two days ago go; a tree whose sources have not
# changed that long rebuilds its own (about 2 minutes).
if [[ -d "$target_dir" ]]; then
  name_args=(-name 'libstreaming_hub-*' -o -name 'streaming_hub-*')
  for t in $targets ingest_classify avro_decode api_bodies; do
    name_args+=(-o -name "$t-*")
  done
  find "$target_dir" -path '*/release/deps/*' -type f \( "${name_args[@]}" \) -mmin +2880 -delete
fi

# The C and C++ libraries under the crate (RocksDB, librdkafka, zstd, lz4) are linked into the
# targets but never run by them: built without optimisation, which takes most of the first build's
# time away (RocksDB's C++ at -O3 is the longest part). The Rust code is built as cargo-fuzz builds
# it. (gcc takes the last -O it is given: these come after the build scripts' own.) Exported for
# `cargo fuzz run` too: the build scripts watch these variables, and a run that saw others would
# build the libraries again.
export CFLAGS="${CFLAGS:+$CFLAGS }-O0" CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }-O0"

echo "== cargo fuzz build" >&2
start=$(date +%s)
cargo +nightly fuzz build -s none --target-dir "$target_dir"
echo "built in $(($(date +%s) - start)) s" >&2
if [[ -n "${FUZZ_BUILD_ONLY:-}" ]]; then
  exit 0 # scripts/test.sh builds them beside the tests, and runs them after
fi

failed=()
for target in $targets; do
  corpus="$corpus_root/$target"
  artifacts="$artifact_root/$target"
  mkdir -p "$corpus" "$artifacts"
  dirs=("$corpus")
  [[ -d "fuzz/seeds/$target" ]] && dirs+=("fuzz/seeds/$target")
  flags=(-max_total_time="$seconds" -timeout=10 -print_final_stats=1
    -artifact_prefix="$artifacts/")
  [[ -f "fuzz/dicts/$target.dict" ]] && flags+=(-dict="fuzz/dicts/$target.dict")
  log="$artifacts/last-run.log"
  echo "== fuzz $target (${seconds} s)" >&2
  if cargo +nightly fuzz run -s none --target-dir "$target_dir" "$target" "${dirs[@]}" -- "${flags[@]}" \
    >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    echo "$target: ok, ${runs:-?} runs, ${rate:-?} exec/s, corpus $(find "$corpus" -type f | wc -l) inputs" >&2
  else
    failed+=("$target")
    grep -E 'panicked at|ERROR: libFuzzer|SUMMARY|Test unit written' "$log" >&2 || tail -n 30 "$log" >&2
    echo "$target: FAILED (log: $log)" >&2
  fi
done

if ((${#failed[@]})); then
  echo "fuzz: crashes in ${failed[*]}" >&2
  exit 1
fi
