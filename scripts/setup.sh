#!/usr/bin/env bash
# Installs what building and testing the hub needs, once: Debian packages for RocksDB's bindings
# (libclang) and librdkafka (SASL, zstd, OpenSSL headers), then Kafka from Maven Central.
# Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libclang-dev clang libsasl2-dev libzstd-dev libssl-dev pkg-config cmake make g++ python3 python3-venv openssl curl)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
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
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt >/dev/null 2>&1 || true
scripts/kafka.sh install
