#!/usr/bin/env bash
# Nsight Compute's view of the benchmark batch's fused kernels (one launch of each, group 20;
# Dot unless LEGEND_BENCH_DECODERS names another model) on the GPU machine: speed of light,
# pipe use, warp stall reasons (cycles a warp spends stalled per instruction it issues, by
# reason), memory traffic. Leaves the clocks alone (--clock-control none). The build folder
# is the first argument (default target-gpu); LEGEND_KERNELS_DIR passes through; KERNELS (a
# regex) picks other kernels. The report goes to stdout and to ${OUT:-/tmp}/profile-fused.txt.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:-$root/target-gpu}
out=${OUT:-/tmp}
source "$root/scripts/gpu/nvrtc-env.sh"
export LEGEND_BENCH_GROUPS=20 LEGEND_BENCH_DECODERS=${LEGEND_BENCH_DECODERS:-dot}
# The first run compiles the kernels into the cache, so that ncu sees only the launches.
"$bin/batch_bench" >/dev/null
metrics=sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,gpu__time_duration.sum
metrics+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__inst_executed.sum
metrics+=,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed
ncu --clock-control none -k "regex:${KERNELS:-legend_fused_(transe_)?(rows|negatives)}" \
    --launch-skip 2 --launch-count 2 \
    --metrics "$metrics,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    "$bin/batch_bench" 2>&1 | tee "$out/profile-fused.txt" | grep -v "^==PROF==" |
    awk '!/stalled/ || $NF+0 >= 0.05'
