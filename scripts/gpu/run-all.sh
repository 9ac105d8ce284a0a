#!/usr/bin/env bash
# All GPU tests and benchmarks of legend-cuda in one call, on a machine with CUDA 13 and
# PyTorch but no Rust toolchain: builds nothing. Expects the binaries in target-gpu/
# (made by scripts/gpu/build-binaries.sh; LEGEND_GPU_BIN names another folder) and writes logs
# under ${OUT:-target-gpu/out}, and all of them again as 00-logs.tar.gz.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
mkdir -p "$out"
source "$root/scripts/gpu/nvrtc-env.sh"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
status=0
echo "== tests"
# The tests of several GPUs need two; on a one-GPU machine they are skipped, and say so.
skip=()
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
    skip=(--skip k_gpus --skip failing_gpu_worker)
    echo "one GPU: the tests of several GPUs are skipped" | tee -a "$out/tests.log"
fi
for t in "$bin"/test-*; do
    "$t" --include-ignored --test-threads=1 --nocapture "${skip[@]}" 2>&1 | tee -a "$out/tests.log" || status=1
done
echo "== legend-cuda batch benchmark"
"$bin/batch_bench" "$out/bench.jsonl" 2>&1 | tee "$out/bench.log" || status=1
echo "== TransE batch benchmark (CUDA cores)"
LEGEND_BENCH_DECODERS=transe_l2,transe_l1 LEGEND_BENCH_GROUPS=20 "$bin/batch_bench" \
    "$out/bench-transe.jsonl" 2>&1 | tee "$out/bench-transe.log" || status=1
echo "== PyTorch batch and summary"
PYTHONUNBUFFERED=1 python3 "$root/scripts/gpu/torch_batch.py" "$out/bench.jsonl" 2>&1 | tee "$out/summary.log" || status=1
echo "== legendctl train on the GPU (scripts/gpu/train-bench.sh)"
bash "$root/scripts/gpu/train-bench.sh" || status=1
# Every log in one archive, first in name order: a remote runner that returns only a few of
# the files still returns all of them.
tar czf "$out/00-logs.tar.gz" -C "$out" --exclude 00-logs.tar.gz . || status=1
exit $status
