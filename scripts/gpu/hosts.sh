#!/usr/bin/env bash
# Issue 46's GPU measurement in one call on the 4-GPU machine (nvidia-h200-x4): two "hosts" of
# two GPUs each — two legendctl processes, CUDA_VISIBLE_DEVICES 0,1 and 2,3, each given its own
# NCCL_HOSTID so that NCCL keeps NVLink inside a "host" and uses its network transport between
# them (NCCL_NET=Socket, NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=lo: the network is sockets on
# loopback, say so beside every figure) — against the same graph on 4 GPUs in one process:
#   1. epoch times, cross-host hand-overs and bytes, each host's peak RSS, the losses side by
#      side (2 x 2 follows plan_hosts' schedule, 1 x 4 plan_gpus': the losses agree within the
#      spread between schedules, not bit for bit; the CPU tests check the same schedule's
#      equality, tests/hosts.rs);
#   2. host 1 killed (SIGKILL) and, in another run, stopped (SIGSTOP: its sockets stay open):
#      host 0 must end within the bound (--host-timeout 10 here), naming host 1;
#   3. a stop asked on host 1 (SIGINT) checkpoints on host 0, and the run resumes on 2 hosts
#      and then on one host of 2 GPUs.
# Builds nothing: legendctl in ${BIN_DIR:-target-gpu} (scripts/gpu/build-binaries.sh).
# NODES, EDGES, EPOCHS scale the graph (default 10^6 nodes, 5 x 10^7 edges, 3 epochs; the
# Twitter-shaped graph: NODES=41652230 EDGES=1468365182, as scripts/gpu/multi-gpu.sh).
# DEVICE=cpu runs the same steps with CPU workers (a check of the script without a GPU).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN_DIR:-$root/target-gpu}
out=${OUT:-$bin/out}
work=${LEGEND_WORK:-/dev/shm/legend-hosts}
nodes=${NODES:-1000000}
edges=${EDGES:-50000000}
epochs=${EPOCHS:-3}
device=${DEVICE:-cuda:0}
mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh"
export LEGEND_HOST_MEMORY_GIB=${LEGEND_HOST_MEMORY_GIB:-400}
export NCCL_NVLS_ENABLE=0 NCCL_NET=Socket NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo
export LEGEND_JOB_TOKEN=gpu-hosts-script-token-0123456789 LEGEND_LAUNCH=none
ctl=$bin/legendctl
log=$out/hosts.log
: >"$log"
say() { echo "$*" | tee -a "$log"; }

"$ctl" generate --nodes "$nodes" --edges "$edges" --relations 1 --split 0.99999,0,0.00001 \
    "$work/data" >"$out/hosts-generate.log" 2>&1 || { say "generate FAILED"; exit 1; }
settings=(--set model.decoder=dot --set model.dim=100 --set training.batch_size=100000
    --set training.negatives.num_chunks=10 --set training.negatives.negatives_per_positive=1000
    --set training.negatives.degree_fraction=0.5 --set storage.backend=memory
    --set training.checkpoint_minutes=0 --set evaluation.protocol=sampled
    --set training.device="\"$device\"" --json)

# host RANK DEVICES PORT RUN [flags]: one "host" in the background; its pid in $!.
host() {
    local rank=$1 devices=$2 port=$3 run=$4
    shift 4
    CUDA_VISIBLE_DEVICES=$devices NCCL_HOSTID=legend-host-$rank "$ctl" train --dataset "$work/data" \
        --out "$run" --gpus 2 --hosts 2 --host-rank "$rank" --rendezvous "127.0.0.1:$port" \
        "${settings[@]}" "$@" >"$out/hosts-$(basename "$run")-$rank.out" \
        2>"$out/hosts-$(basename "$run")-$rank.log" &
}

# 1. One process of 4 GPUs, then 2 hosts x 2 GPUs.
CUDA_VISIBLE_DEVICES=0,1,2,3 "$ctl" train --dataset "$work/data" --out "$work/one" --gpus 4 \
    "${settings[@]}" --set training.num_epochs="$epochs" >"$out/hosts-one.out" 2>"$out/hosts-one.log" ||
    { say "4 GPUs in one process FAILED"; tail -5 "$out/hosts-one.log" | tee -a "$log"; exit 1; }
host 0 0,1 29501 "$work/two" --set training.num_epochs="$epochs"; p0=$!
host 1 2,3 29501 "$work/two-other" --set training.num_epochs="$epochs"; p1=$!
wait $p1; s1=$?; wait $p0; s0=$?
if [ $s0 -ne 0 ] || [ $s1 -ne 0 ]; then
    say "2 hosts x 2 GPUs FAILED (host 0: $s0, host 1: $s1)"
    tail -5 "$out/hosts-two-0.log" "$out/hosts-two-other-1.log" | tee -a "$log"
    exit 1
fi
python3 - "$out/hosts-one.out" "$out/hosts-two-0.out" <<'EOF' | tee -a "$log"
import json, sys
def epochs(path):
    return [json.loads(l) for l in open(path) if l.startswith("{") and '"seconds"' in l]
one, two = epochs(sys.argv[1]), epochs(sys.argv[2])
print("network between the 2 'hosts': sockets on loopback (NCCL_NET=Socket, NCCL_SOCKET_IFNAME=lo)")
print("| epoch | 4 GPUs, 1 process: s | loss | 2 hosts x 2 GPUs: s | loss | efficiency vs 1 process | cross-host hand-overs | GB | peak RSS a host GiB |")
print("|---|---|---|---|---|---|---|---|---|")
for a, b in zip(one, two):
    w = b.get("workers", {})
    rss = max(w.get("host_peak_rss_bytes", [0])) / 2**30
    print(f"| {b['epoch']} | {a['seconds']:.2f} | {a['loss']:.6f} | {b['seconds']:.2f} | {b['loss']:.6f} "
          f"| {a['seconds'] / b['seconds']:.1%} | {w.get('cross_host_handovers')} "
          f"| {w.get('cross_host_bytes', 0) / 1e9:.2f} | {rss:.2f} |")
EOF

# 2. A host killed, a host stopped: host 0 ends within the bound, naming host 1.
for sig in KILL STOP; do
    host 0 0,1 29502 "$work/fault-$sig" --set training.num_epochs=1000 --host-timeout 10; p0=$!
    host 1 2,3 29502 "$work/fault-$sig-other" --set training.num_epochs=1000 --host-timeout 10; p1=$!
    # Until host 0 reported an epoch: the job runs.
    for _ in $(seq 600); do grep -q '"seconds"' "$out/hosts-fault-$sig-0.out" 2>/dev/null && break; sleep 1; done
    start=$(date +%s%N)
    kill -"$sig" $p1
    wait $p0; s0=$?
    took=$(( ($(date +%s%N) - start) / 1000000 ))
    kill -KILL $p1 2>/dev/null; wait $p1 2>/dev/null
    say "SIG$sig of host 1: host 0 ended with status $s0 after $took ms: $(grep -o 'host 1 ([^)]*)[^"]*' "$out/hosts-fault-$sig-0.log" | tail -1 | cut -c1-200)"
done

# 3. A stop asked on host 1, resumed on 2 hosts, then on one.
host 0 0,1 29503 "$work/stop" --set training.num_epochs=1000; p0=$!
host 1 2,3 29503 "$work/stop-other" --set training.num_epochs=1000; p1=$!
for _ in $(seq 600); do grep -q '"seconds"' "$out/hosts-stop-0.out" 2>/dev/null && break; sleep 1; done
kill -INT $p1
wait $p1; s1=$?; wait $p0; s0=$?
say "SIGINT on host 1: exit statuses $s0 (host 0) and $s1 (host 1); 130 expected for both"
done_epochs=$(python3 -c "import tomllib; m=tomllib.load(open('$work/stop/run.toml','rb')); print(m['epochs_completed'] + (1 if m.get('cut') else 0))")
host 0 0,1 29504 "$work/stop" --resume --set training.num_epochs="$done_epochs"; p0=$!
host 1 2,3 29504 "$work/stop-other" --resume --set training.num_epochs="$done_epochs"; p1=$!
wait $p1; s1=$?; wait $p0; s0=$?
say "resumed on 2 hosts to epoch $done_epochs: statuses $s0 and $s1"
CUDA_VISIBLE_DEVICES=0,1 "$ctl" train --out "$work/stop" --resume --gpus 2 --json \
    --set training.num_epochs=$((done_epochs + 1)) >"$out/hosts-resume-one.out" 2>"$out/hosts-resume-one.log"
say "resumed on one host of 2 GPUs to epoch $((done_epochs + 1)): status $?"
rm -rf "$work"
