#!/usr/bin/env bash
# Issue 43's measurement in one call on the 4-GPU machine (nvidia-h200-x4): the Twitter-shaped
# graph (41,652,230 nodes, 1,468,365,182 edges; Dot, d = 100, the billion-edge settings: B =
# 10^5, 10 chunks x 1000 negatives, half by degree) trained in GPU memory on 1, 2 and 4 GPUs
# (CUDA_VISIBLE_DEVICES subsets of the same machine), each beside the one-GPU run at the same
# partition count (N = 2K, every partition on the one GPU, negatives from all of them): epoch
# times, the workers' per-round compute / wait / hand-over, bytes handed over, imbalance and
# parallel efficiency, and the speed-ups against one GPU at N = 1 and at the same N.
#
# With PARKED (a list of K:N, N ≥ 3K, e.g. "4:12 4:16") it also trains K GPUs over N partitions
# parked in host memory between rounds (each read while the round before trains) and sets them
# beside the K GPUs holding the table (N = 2K, for the K in GPUS).
#
# Builds nothing: expects legendctl in ${BIN_DIR:-target-gpu} (scripts/gpu/build-binaries.sh).
# Edges and runs on tmpfs (the checkpoints are 33 GB each; the machine has 512 GiB).
# NODES, EDGES and EPOCHS scale it down (a smoke run); GPUS lists the K to run (default "2 4");
# SAME_N=0 skips the one-GPU runs at N = 2K; DEVICE=cpu runs the CPU engine's workers (a smoke
# run of the script itself, on a machine without GPUs).
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
parked_list=${PARKED-}
same_n=${SAME_N:-1}
device=${DEVICE:-cuda:0}
mkdir -p "$out"
rm -rf "$data" "$work" && mkdir -p "$work"
[ "$device" = cpu ] || source "$root/scripts/gpu/nvrtc-env.sh"
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
        --set evaluation.protocol=sampled --set training.device="\"$device\"" "$@" || return 1
    cp "$work/$name/metrics.jsonl" "$out/metrics-$name.jsonl"
    grep -E "GPU memory|set-up|workers|rounds" "$out/multi-$name.log" | head -8 | tee -a "$log"
    rm -rf "$work/$name"
}

train one-n1 0 1 || exit 1
for k in $gpus_list; do
    n=$((2 * k))
    devices=$(seq -s, 0 $((k - 1)))
    [ "$same_n" = 0 ] || train "one-n$n" 0 "$n" || exit 1
    train "gpus$k" "$devices" "$n" --gpus "$k" || exit 1
done
for spec in $parked_list; do
    k=${spec%%:*} n=${spec##*:}
    train "parked$k-$n" "$(seq -s, 0 $((k - 1)))" "$n" --gpus "$k" || exit 1
done

python3 - "$out" "$epochs" "$same_n" "$parked_list" $gpus_list <<'EOF' | tee -a "$log"
import json, os, sys
out, epochs, same_n = sys.argv[1], int(sys.argv[2]), sys.argv[3] != "0"
parked = [tuple(int(x) for x in spec.split(":")) for spec in sys.argv[4].split()]
ks = [int(k) for k in sys.argv[5:]]
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
    same, _ = steady(f"one-n{n}") if same_n else (float("nan"), None)
    multi, e = steady(f"gpus{k}")
    w = e[-1].get("workers", {})
    rounds = w.get("rounds", [])
    hand = [g["handover_s"] for r in rounds[1:] for g in r]
    hand_s = max(hand) if hand else 0.0
    same_s, same_r = (f"{same:.2f} s", f"{same / (k * multi):.1%}") if same_n else ("–", "–")
    print(f"| {k} | {n} | {same_s} | {multi:.2f} s | {base / (k * multi):.1%} | {same_r} "
          f"| {w.get('parallel_efficiency', 0):.1%} | {w.get('imbalance', 0):.3f} ({w.get('predicted_imbalance', 0):.3f}) "
          f"| {hand_s:.3f} | {w.get('handover_bytes', 0) / 1e9:.1f} |")
if parked:
    print("\nParked in host memory between rounds (N ≥ 3K), against K GPUs holding the table (N = 2K):")
    print("| K | N | epoch | vs K GPUs, N = 2K | vs 1 GPU N=1 | parallel eff. | imbalance (pred.) | exposed move s/round (max) | reads from host memory | GB read |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, n in parked:
        t, e = steady(f"parked{k}-{n}")
        held = steady(f"gpus{k}")[0] if os.path.exists(f"{out}/metrics-gpus{k}.jsonl") else float("nan")
        w = e[-1].get("workers", {})
        moves = [g["handover_s"] for r in w.get("rounds", [])[1:] for g in r]
        print(f"| {k} | {n} | {t:.2f} s | {held / t:.1%} | {base / (k * t):.1%} | {w.get('parallel_efficiency', 0):.1%} "
              f"| {w.get('imbalance', 0):.3f} ({w.get('predicted_imbalance', 0):.3f}) | {max(moves) if moves else 0:.3f} "
              f"| {w.get('home_reads', 0)} | {w.get('home_read_bytes', 0) / 1e9:.1f} |")
EOF
