#!/usr/bin/env bash
# Issue 43's measurement in one call on the 4-GPU machine (nvidia-h200-x4): the Twitter-shaped
# graph (41,652,230 nodes, 1,468,365,182 edges; Dot, d = 100, the billion-edge settings: B =
# 10^5, 10 chunks x 1000 negatives, half by degree) trained in GPU memory on 1, 2 and 4 GPUs
# (CUDA_VISIBLE_DEVICES subsets of the same machine), each beside the one-GPU run at the same
# partition count (N = 2K, every partition on the one GPU, negatives from all of them): epoch
# times, the workers' per-round compute / wait / hand-over, bytes handed over, imbalance and
# parallel efficiency, and the speed-ups against one GPU at N = 1 and at the same N.
#
# Builds nothing: expects legendctl in ${BIN_DIR:-target-gpu} (scripts/gpu/build-binaries.sh).
# Edges and runs on tmpfs (the checkpoints are 33 GB each; the machine has 512 GiB).
# NODES, EDGES and EPOCHS scale it down (a smoke run); GPUS lists the K to run (default "2 4").
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN_DIR:-$root/target-gpu}
out=${OUT:-$bin/out}
data=${LEGEND_DATA:-/dev/shm/legend-multi/data}
work=${LEGEND_WORK:-/dev/shm/legend-multi/runs}
nodes=${NODES:-41652230}
edges=${EDGES:-1468365182}
epochs=${EPOCHS:-3}
gpus_list=${GPUS-2 4}
mkdir -p "$out"
rm -rf "$data" "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh"
# The VM's MemAvailable starts far below the memory it will give (config.md, "Memory").
export LEGEND_HOST_MEMORY_GIB=${LEGEND_HOST_MEMORY_GIB:-400}
ctl=$bin/legendctl
log=$out/multi-gpu.log
{
    "$root/scripts/gpu/hardware.sh"
    nvidia-smi topo -m 2>/dev/null | head -8
    echo "NCCL: $(ls /lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | tr '\n' ' ')"
} | tee "$log"

# Runs a phase with its wall time and peak RSS; a failed phase ends the script with its log's
# tail, so no figure is printed for work that did not complete.
phase() {
    local name=$1
    shift
    python3 - "$name" "$out/multi-$name.log" "$@" <<'EOF' | tee -a "$log"
import os, subprocess, sys, time
name, log, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
start = time.time()
with open(log, "w") as f:
    child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
code = os.waitstatus_to_exitcode(status)
wall = time.time() - start
if code != 0:
    print(f"== {name}: FAILED (exit {code}) after {wall:.1f} s; log tail:")
    print("".join(open(log).readlines()[-20:]))
    sys.exit(1)
print(f"== {name}: {wall:.1f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB")
EOF
    return "${PIPESTATUS[0]}"
}

phase generate "$ctl" generate --nodes "$nodes" --edges "$edges" --relations 1 \
    --split 0.99999,0,0.00001 "$data" || exit 1

# train NAME DEVICES N [legendctl flags]: the billion-edge settings on CUDA_VISIBLE_DEVICES =
# DEVICES with N partitions, every one resident; the run is deleted after its figures are read.
train() {
    local name=$1 devices=$2 n=$3
    shift 3
    CUDA_VISIBLE_DEVICES=$devices phase "$name" "$ctl" train --dataset "$data" \
        --out "$work/$name" --json \
        --set model.decoder=dot --set model.dim=100 \
        --set training.batch_size=100000 --set training.negatives.num_chunks=10 \
        --set training.negatives.negatives_per_positive=1000 \
        --set training.negatives.degree_fraction=0.5 \
        --set storage.backend=memory --set storage.num_partitions="$n" \
        --set training.num_epochs="$epochs" --set training.checkpoint_minutes=0 \
        --set evaluation.protocol=sampled --set training.device='"cuda:0"' "$@" || return 1
    cp "$work/$name/metrics.jsonl" "$out/metrics-$name.jsonl"
    grep -E "GPU memory|set-up|workers|rounds" "$out/multi-$name.log" | head -8 | tee -a "$log"
    rm -rf "$work/$name"
}

train one-n1 0 1 || exit 1
for k in $gpus_list; do
    n=$((2 * k))
    devices=$(seq -s, 0 $((k - 1)))
    train "one-n$n" 0 "$n" || exit 1
    train "gpus$k" "$devices" "$n" --gpus "$k" || exit 1
done

python3 - "$out" "$epochs" $gpus_list <<'EOF' | tee -a "$log"
import json, sys
out, epochs, ks = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3:]]
def epochs_of(name):
    lines = [json.loads(l) for l in open(f"{out}/metrics-{name}.jsonl") if l.startswith("{")]
    return [l for l in lines if "epoch" in l and "seconds" in l]
def steady(name):
    e = epochs_of(name)
    later = e[1:] or e
    return sum(x["seconds"] for x in later) / len(later), e
base, _ = steady("one-n1")
print(f"\n1 GPU, N = 1: {base:.2f} s an epoch (mean of epochs 2..{epochs})")
print("| K | N | 1 GPU at N | K GPUs | vs 1 GPU N=1 | vs 1 GPU same N | parallel eff. | imbalance (pred.) | hand-over s/round | GB handed over |")
print("|---|---|---|---|---|---|---|---|---|---|")
for k in ks:
    n = 2 * k
    same, _ = steady(f"one-n{n}")
    multi, e = steady(f"gpus{k}")
    w = e[-1].get("workers", {})
    rounds = w.get("rounds", [])
    hand = [g["handover_s"] for r in rounds[1:] for g in r]
    hand_s = max(hand) if hand else 0.0
    print(f"| {k} | {n} | {same:.2f} s | {multi:.2f} s | {base / (k * multi):.1%} | {same / (k * multi):.1%} "
          f"| {w.get('parallel_efficiency', 0):.1%} | {w.get('imbalance', 0):.3f} ({w.get('predicted_imbalance', 0):.3f}) "
          f"| {hand_s:.3f} | {w.get('handover_bytes', 0) / 1e9:.1f} |")
EOF
