#!/usr/bin/env bash
# Rewrites README.md's configuration table from the code (`streaming-hub config`); tests/readme.rs
# fails when the two differ.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/streaming-hub/target}"
table="$(cargo run -q --bin streaming-hub -- config)"
TABLE="$table" python3 - <<'PY'
import os
p = "README.md"
s = open(p).read()
start = s.index("| Variable | Default | Meaning |")
end = s.index("\n\n", start)
open(p, "w").write(s[:start] + os.environ["TABLE"].strip() + s[end:])
PY
