#!/usr/bin/env bash
# Builds the x86-64 binaries scripts/gpu/run-all.sh runs on the GPU machine (which has no
# Rust toolchain) and copies them into target-gpu/ (ignored; pass it in the run's carry):
# the kernel tests, batch_bench, legendctl, legendd (scripts/gpu/daemon-gpu.sh), the trainer's and the queries' GPU tests. train-bench.sh also
# needs UMLS imported into gpu-data/ (carry it too):
#   legendctl import --out gpu-data/umls --train D/train.txt --valid D/valid.txt --test D/test.txt
# LEGEND_GPU_BIN names another output folder (a helper's carry folder, say); the scripts that
# run there take the same variable.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
out=${LEGEND_GPU_BIN:-$root/target-gpu}
cd "$root"
rm -rf "$out" && mkdir -p "$out"
cargo build --release -p legend-cuda --examples
cp "$CARGO_TARGET_DIR/release/examples/batch_bench" "$out/"
cargo build --release -p legendctl -p legendd
cp "$CARGO_TARGET_DIR/release/legendctl" "$CARGO_TARGET_DIR/release/legendd" "$out/"
cargo test --release -p legend-cuda -p legend-engine -p legend-query --no-run --message-format=json |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("legend_cuda", "gpu", "pipeline", "gpu_trainer", "nvme_io", "checkpoints", "gpu_queries", "one_reader", "workers", "batch_keys", "incremental"):
        shutil.copy(m["executable"], sys.argv[1] + "/test-" + m["target"]["name"])
' "$out"
strip "$out"/* && ls -la "$out"
