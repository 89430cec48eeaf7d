#!/usr/bin/env bash
# Installs what building and testing the hub needs, once: Debian packages for RocksDB's bindings
# (libclang) and librdkafka (SASL, zstd, OpenSSL headers), then Kafka from Maven Central.
# Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libclang-dev clang libsasl2-dev libzstd-dev libssl-dev pkg-config cmake make g++ python3 python3-venv openssl curl)
missing=()
for p in "${packages[@]}"; do
  # Installed, not merely known (a removed package keeps its config files and a status).
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == *" ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=""
  [[ $(id -u) -eq 0 ]] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: Rust (cargo) is required: https://rustup.rs" >&2; exit 1; }
command -v java >/dev/null || { echo "setup: Java 17+ is required for the Kafka broker" >&2; exit 1; }
command -v mvn >/dev/null || { echo "setup: Maven is required to install Kafka from Maven Central" >&2; exit 1; }
for c in clippy fmt; do
  if ! cargo "$c" --version >/dev/null 2>&1; then
    component="$c"; [[ "$c" == fmt ]] && component=rustfmt
    rustup component add "$component" >/dev/null \
      || { echo "setup: cargo $c is missing and rustup could not add $component" >&2; exit 1; }
  fi
done
scripts/kafka.sh install
