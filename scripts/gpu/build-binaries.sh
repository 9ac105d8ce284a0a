#!/usr/bin/env bash
# Builds the x86-64 binaries scripts/gpu/run-all.sh runs on the GPU machine (which has no
# Rust toolchain) and copies them into target-gpu/ (ignored; pass it in the run's carry).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cd "$root"
rm -rf target-gpu && mkdir -p target-gpu
cargo build --release -p legend-cuda --examples
cp "$CARGO_TARGET_DIR/release/examples/batch_bench" target-gpu/
cargo test --release -p legend-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("legend_cuda", "gpu"):
        shutil.copy(m["executable"], "target-gpu/test-" + m["target"]["name"])
'
ls -la target-gpu
