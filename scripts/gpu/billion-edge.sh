#!/usr/bin/env bash
# Issue 17's end-to-end run on the GPU machine, in one call: generate the Twitter-shaped graph
# (41,652,230 nodes, 1,468,365,182 edges, one relation, power-law degrees) with a small test
# split, train it in GPU memory (memory backend, one partition: Dot, d = 100, B = 10^5, 10
# chunks x 1000 negatives, half degree-based), commit the final checkpoint, rank the test split
# against sampled negatives, export the embeddings as npy. Prints each phase's time, the set-up
# log lines, every epoch's time and edges/s, the peak host RSS (getrusage of the children) and
# GPU memory, and the MRR; resumes the run for one more epoch; checks that the exported
# checkpoint ranks as the run did. Then the
# host-RAM swap tier: the same graph with N = 8 partitions in host memory, C = 3 of them on the
# GPU, for TIER_EPOCHS epochs (2), with its swap timeline (`legendctl report`).
#
# Builds nothing: expects legendctl in ${BIN_DIR:-target-gpu} (scripts/gpu/build-binaries.sh).
# Edges on tmpfs (LEGEND_DATA), the run and the export on disk (LEGEND_WORK). NODES, EDGES and
# EPOCHS scale it down for a dry run (DEVICE=cpu runs it without a GPU).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN_DIR:-$root/target-gpu}
out=${OUT:-$bin/out}
data=${LEGEND_DATA:-/dev/shm/legend-billion}
work=${LEGEND_WORK:-/var/tmp/legend-billion}
nodes=${NODES:-41652230}
edges=${EDGES:-1468365182}
epochs=${EPOCHS:-3}
tier_epochs=${TIER_EPOCHS:-2}
device=${DEVICE:-cuda:0}
mkdir -p "$out"
rm -rf "$data" "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh" >/dev/null
ctl=$bin/legendctl
{
    "$root/scripts/gpu/hardware.sh"
    free -g | head -2
} | tee "$out/billion-hw.txt"

# Runs a phase, printing its wall time and peak RSS; a failed phase ends the script with its
# log's tail, so no figure is printed for work that did not complete.
phase() {
    local name=$1
    shift
    python3 - "$name" "$out/billion-$name.log" "$@" <<'EOF'
import os, subprocess, sys, time
name, log, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
start = time.time()
with open(log, "w") as f:
    child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    # This phase's own peak, not the largest of the phases so far.
    _, status, usage = os.wait4(child.pid, 0)
code = os.waitstatus_to_exitcode(status)
wall = time.time() - start
peak = usage.ru_maxrss / 2**20
if code != 0:
    print(f"== {name}: FAILED (exit {code}) after {wall:.1f} s; log tail:")
    print("".join(open(log).readlines()[-15:]))
    sys.exit(1)
print(f"== {name}: {wall:.1f} s, peak RSS {peak:.2f} GiB")
EOF
}

phase generate "$ctl" generate --nodes "$nodes" --edges "$edges" --relations 1 \
    --split 0.9999,0,0.0001 "$data" || exit 1
run=$work/run
# The paper's Twitter settings; the run's own flags follow.
train() {
    local name=$1
    shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 \
        >"$out/billion-$name-gpu-memory.csv" 2>/dev/null &
    local smi=$! status
    phase "$name" "$ctl" train --dataset "$data" \
        --set model.decoder=dot --set model.dim=100 \
        --set training.batch_size=100000 --set training.negatives.num_chunks=10 \
        --set training.negatives.negatives_per_positive=1000 \
        --set training.negatives.degree_fraction=0.5 \
        --set storage.backend=memory \
        --set evaluation.protocol=sampled --set training.device="$device" "$@"
    status=$?
    kill "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
    grep -E "host memory|GPU memory|set-up|epoch [0-9]+:|test:" "$out/billion-$name.log" |
        sed 's/^[^ ]* *INFO //'
    [ "$status" = 0 ] || exit 1
    echo "GPU memory used, peak over the run:" \
        "$(sort -n "$out/billion-$name-gpu-memory.csv" | tail -1) MiB"
}

train train --out "$run" --set training.num_epochs="$epochs" --set storage.num_partitions=1
# One epoch more from the checkpoint: the tables come back from disk, go to the GPU, and their
# host copies are given back.
phase resume "$ctl" train --out "$run" --resume --set training.num_epochs=$((epochs + 1)) || exit 1
grep -E "host memory|GPU memory|set-up|epoch [0-9]+:|test:" "$out/billion-resume.log" |
    sed 's/^[^ ]* *INFO //'
phase export "$ctl" export "$run" --format npy -o "$work/export" || exit 1
ls -la "$work/export" | tail -4
du -sh "$run"
# The checkpoint (streamed from the GPU) ranks as the run's own final evaluation did.
phase verify "$ctl" eval --embeddings "$work/export" --decoder dot --dataset "$data" \
    --protocol sampled || exit 1
grep -E "MRR" "$out/billion-verify.log"
rm -rf "$work/export"

tier=$work/tier
train tier --out "$tier" --set training.num_epochs="$tier_epochs" \
    --set storage.num_partitions=8 --set storage.buffer_capacity=3
"$ctl" report "$tier" -o "$out/billion-tier-timeline.html"
