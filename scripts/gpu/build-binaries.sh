#!/usr/bin/env bash
# Builds the x86-64 binaries scripts/gpu/run-all.sh runs on the GPU machine (which has no
# Rust toolchain) and copies them into target-gpu/ (ignored; pass it in the run's carry):
# the kernel tests, batch_bench, legendctl and the trainer's GPU tests. train-bench.sh also
# needs UMLS imported into gpu-data/ (carry it too):
#   legendctl import --out gpu-data/umls --train D/train.txt --valid D/valid.txt --test D/test.txt
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cd "$root"
rm -rf target-gpu && mkdir -p target-gpu
cargo build --release -p legend-cuda --examples
cp "$CARGO_TARGET_DIR/release/examples/batch_bench" target-gpu/
cargo build --release -p legendctl
cp "$CARGO_TARGET_DIR/release/legendctl" target-gpu/
cargo test --release -p legend-cuda -p legend-engine --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("legend_cuda", "gpu", "gpu_trainer"):
        shutil.copy(m["executable"], "target-gpu/test-" + m["target"]["name"])
'
strip target-gpu/* && ls -la target-gpu
