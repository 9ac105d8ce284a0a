#!/usr/bin/env bash
# legendd's jobs on the GPU machine (issue 41): each job in a process of its own, as the
# submitter, in a cgroup of its own. A train job and a serve job on cuda:0, each checked for
# what its process held (uid, capabilities, environment with NCCL_NVLS_ENABLE=0, cgroup,
# memory limit and peak), the kernels its process compiled cached in its identity's own
# directory (STATE/kernels/UID), a query answered on the GPU. Run as root (jobs run as their
# submitter: root here). Builds nothing: expects legendd and legendctl in target-gpu/
# (scripts/gpu/build-binaries.sh), carried. DEVICE=cpu runs the same on the CPU (a machine
# without a GPU). Results in ${OUT:-target-gpu/out}/daemon-gpu.txt, the daemon's log in
# daemon-gpu.err.
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
"$bin/legendd" --foreground --config "$work/legendd.toml" --socket "$work/sock" \
    --state-dir "$work/state" 2>"$out/daemon-gpu.err" &
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
"${ctl[@]}" jobs | tee -a "$log"
[ $status = 0 ] && say "daemon-gpu: ok" || say "daemon-gpu: FAILED"
exit $status
