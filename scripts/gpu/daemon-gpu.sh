#!/usr/bin/env bash
# legendd's jobs on the GPU machine (issues 41 and 44): each job in a process of its own, as the
# submitter, in a cgroup of its own. A train job and a serve job on cuda:0, each checked for
# what its process held (uid, capabilities, environment with NCCL_NVLS_ENABLE=0, cgroup,
# memory limit and peak), the kernels its process compiled cached in its identity's own
# directory (STATE/kernels/UID), a query answered on the GPU. Run as root (jobs run as their
# submitter: root here). Builds nothing: expects legendd and legendctl in target-gpu/
# (scripts/gpu/build-binaries.sh), carried. DEVICE=cpu runs the same on the CPU (a machine
# without a GPU). Results in ${OUT:-target-gpu/out}/daemon-gpu.txt, the daemon's log in
# daemon-gpu.err. On 2 or more GPUs: a 2-GPU job given both at once, seeing only them, and a
# later one-GPU job on cuda:1 waiting for it.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
device=${DEVICE:-cuda:0}
mkdir -p "$out"
# shellcheck source=/dev/null
source "$root/scripts/gpu/nvrtc-env.sh"
log=$out/daemon-gpu.txt
: >"$log"
say() { echo "$*" | tee -a "$log"; }
fail() {
    say "FAILED: $*"
    status=1
}
status=0
work=$(mktemp -d)
trap 'kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; rm -rf "$work"' EXIT
"$bin/legendctl" generate --nodes 20000 --edges 200000 --relations 4 "$work/ds" >/dev/null
: >"$work/legendd.toml"
# cgroup v2 (the GPU machines): the daemon alone in a cgroup given the memory controller, as
# systemd's Delegate=yes gives it, so that its jobs run in cgroups of their own (CI tests v1).
# This script's processes move to a sibling leaf first (v2 gives controllers to children only
# of a cgroup without processes). NO_OWN_CGROUP=1 leaves the daemon where it starts.
own_cgroup=0
if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] && [ -z "${NO_OWN_CGROUP:-}" ]; then
    cg=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
    if mkdir -p "$cg/shell" "$cg/legendd" 2>/dev/null; then
        for pid in $(cat "$cg/cgroup.procs"); do
            echo "$pid" >"$cg/shell/cgroup.procs" 2>/dev/null
        done
        echo +memory >"$cg/cgroup.subtree_control" 2>/dev/null && own_cgroup=1
    fi
    say "cgroup v2: the daemon in a cgroup of its own: $own_cgroup ($cg/legendd)"
fi
daemon_args=(--foreground --config "$work/legendd.toml" --socket "$work/sock" --state-dir "$work/state")
if [ $own_cgroup = 1 ]; then
    # shellcheck disable=SC2016
    sh -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' sh "$cg/legendd" \
        "$bin/legendd" "${daemon_args[@]}" 2>"$out/daemon-gpu.err" &
else
    "$bin/legendd" "${daemon_args[@]}" 2>"$out/daemon-gpu.err" &
fi
daemon=$!
for _ in $(seq 100); do [ -S "$work/sock" ] && break; sleep 0.1; done
ctl=("$bin/legendctl" --socket "$work/sock")
id_of() { sed -n 's/^job \([0-9]*\) queued.*/\1/p'; }

# The process of running job $1: what it holds.
inspect() {
    local job=$1 pid
    pid=$("${ctl[@]}" status "$job" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["process"]["pid"])')
    say "job $job: process $pid"
    grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs)' "/proc/$pid/status" | tee -a "$log"
    tr '\0' '\n' <"/proc/$pid/environ" | tee -a "$log" | grep -qx 'NCCL_NVLS_ENABLE=0' ||
        fail "job $job: no NCCL_NVLS_ENABLE=0 in its environment"
    [ "$(cat "/proc/$pid/oom_score_adj")" = 500 ] || fail "job $job: oom_score_adj"
    grep -q '^CapEff:\s*0*$' "/proc/$pid/status" || fail "job $job: holds capabilities"
    if [ $own_cgroup = 1 ]; then
        local bounds
        bounds=$("${ctl[@]}" status "$job" --json | python3 -c 'import json,sys; p=json.load(sys.stdin)["process"]; print(p.get("cgroup"), p.get("memory_limit"))')
        say "job $job: cgroup and memory limit: $bounds"
        case $bounds in None* | *None) fail "job $job: no cgroup of its own under cgroup v2" ;; esac
        grep -q "$(cut -d' ' -f1 <<<"$bounds")" "/proc/$pid/cgroup" ||
            fail "job $job: its process is not in the cgroup its status names"
    fi
}

say "== train on $device"
submitted=$("${ctl[@]}" submit train --dataset "$work/ds" --out "$work/run" \
    --set training.device="$device" --set model.dim=64 --set training.num_epochs=3 \
    --set evaluation.protocol=sampled)
say "$submitted"
train=$(id_of <<<"$submitted")
for _ in $(seq 600); do
    state=$("${ctl[@]}" status "$train" --json | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["state"], j.get("process") is not None)')
    [ "$state" = "running True" ] && break
    case $state in succeeded* | failed* | cancelled*) break ;; esac
    sleep 0.1
done
[ "$state" = "running True" ] && inspect "$train"
"${ctl[@]}" watch "$train" 2>&1 | tee -a "$log" || fail "the train job did not succeed"
"${ctl[@]}" status "$train" | tee -a "$log"
"${ctl[@]}" logs "$train" >>"$log"
if [ "$device" != cpu ]; then
    cached=$(find "$work/state/kernels/0" -name '*.cubin' | wc -l)
    say "kernels cached in the job's own directory: $cached"
    [ "$cached" -gt 0 ] || fail "no kernel cached in STATE/kernels/0"
fi

say "== serve on $device"
submitted=$("${ctl[@]}" submit serve "$work/run" --device "$device")
say "$submitted"
serve=$(id_of <<<"$submitted")
for _ in $(seq 600); do
    "${ctl[@]}" query "$serve" neighbors --entity e1 --top 5 >>"$log" 2>&1 && break
    sleep 0.2
done
"${ctl[@]}" query "$serve" predict --head e1 --relation r0 --top 5 2>&1 | tee -a "$log" ||
    fail "the serve job did not answer"
inspect "$serve"
"${ctl[@]}" status "$serve" | tee -a "$log"
"${ctl[@]}" cancel "$serve" | tee -a "$log"

# Several GPUs (issue 44 item 5): a 2-GPU job takes both GPUs at once and sees only them; a
# one-GPU job submitted after it on cuda:1 waits until it ends.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$device" != cpu ] && [ "$gpus" -ge 2 ]; then
    say "== train on 2 of $gpus GPUs"
    submitted=$("${ctl[@]}" submit train --dataset "$work/ds" --out "$work/run2" \
        --set training.gpus=2 --set training.device='"cuda:0"' --set storage.backend='"memory"' \
        --set model.decoder='"dot"' --set model.dim=64 --set training.num_epochs=20 \
        --set evaluation.protocol=sampled)
    say "$submitted"
    set2=$(id_of <<<"$submitted")
    submitted=$("${ctl[@]}" submit train --dataset "$work/ds" --out "$work/run3" \
        --set training.device='"cuda:1"' --set model.dim=64 --set training.num_epochs=1 \
        --set evaluation.protocol=sampled)
    say "$submitted"
    after=$(id_of <<<"$submitted")
    for _ in $(seq 600); do
        state=$("${ctl[@]}" status "$set2" --json | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["state"], j.get("process") is not None, j.get("device"))')
        case $state in "running True"* | succeeded* | failed* | cancelled*) break ;; esac
        sleep 0.1
    done
    say "job $set2: $state"
    case $state in
    "running True cuda:0,1")
        inspect "$set2"
        pid=$("${ctl[@]}" status "$set2" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["process"]["pid"])')
        tr '\0' '\n' <"/proc/$pid/environ" | grep -qx 'CUDA_VISIBLE_DEVICES=0,1' ||
            fail "job $set2: its process does not see exactly GPUs 0 and 1"
        later=$("${ctl[@]}" status "$after" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
        say "job $after (cuda:1, submitted after): $later"
        [ "$later" = queued ] || fail "job $after started on a GPU the 2-GPU job holds"
        ;;
    *) fail "job $set2 did not run on cuda:0,1 ($state)" ;;
    esac
    "${ctl[@]}" watch "$set2" 2>&1 | tail -3 | tee -a "$log" || fail "the 2-GPU job did not succeed"
    "${ctl[@]}" watch "$after" 2>&1 | tail -1 | tee -a "$log" || fail "the job after it did not succeed"
fi
"${ctl[@]}" jobs | tee -a "$log"
[ $status = 0 ] && say "daemon-gpu: ok" || say "daemon-gpu: FAILED"
exit $status
