#!/usr/bin/env bash
# Issue 17's end-to-end run on the GPU machine, in one call: generate the Twitter-shaped graph
# (41,652,230 nodes, 1,468,365,182 edges, one relation, power-law degrees) with a small test
# split, train it in GPU memory (memory backend, one partition: Dot, d = 100, B = 10^5, 10
# chunks x 1000 negatives, half degree-based), commit the final checkpoint, rank the test split
# against sampled negatives, export the embeddings as npy. Prints each phase's time, the set-up
# log lines, every epoch's time and edges/s, the peak host RSS (getrusage of the children) and
# GPU memory, and the MRR. Issue 50: resumes the run for one more epoch (its peak RSS beside
# the training run's); asks the resumed run a first `predict` and `neighbors` on the GPU and
# the CPU (the labels indexed when training ended), with the run's files in the page cache and,
# where the page cache can be dropped, without, beside the disk's read rate (the cold-cache
# bound); times a legendd serve job from its submission to its first answer, warm and cold;
# prints each query goal (2 s warm, 1.2x the disk cold) as met or not; and compares every
# entry point's peak RSS (resume, queries, serve, eval, export) with the training run's. Checks
# that the exported checkpoint ranks as the run did. Then the host-RAM swap tier: the same graph
# with N = 8 partitions in host memory, C = 3 of them on the GPU, for TIER_EPOCHS epochs (2;
# 0 leaves it out), with its swap timeline (`legendctl report`).
#
# Builds nothing: expects legendctl and legendd in ${LEGEND_GPU_BIN:-target-gpu}
# (scripts/gpu/build-binaries.sh). Edges on tmpfs (LEGEND_DATA), the run and the export on disk
# (LEGEND_WORK). NODES, EDGES and EPOCHS scale it down for a dry run (DEVICE=cpu runs it
# without a GPU; COLD=0 leaves the page cache alone, on a machine others share).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
data=${LEGEND_DATA:-/dev/shm/legend-billion}
work=${LEGEND_WORK:-/var/tmp/legend-billion}
nodes=${NODES:-41652230}
edges=${EDGES:-1468365182}
epochs=${EPOCHS:-3}
tier_epochs=${TIER_EPOCHS:-2}
device=${DEVICE:-cuda:0}
cold=${COLD:-1}
mkdir -p "$out"
rm -rf "$data" "$work" && mkdir -p "$work"
rm -f "$out/billion-phases.tsv" "$out/billion-disk-seconds.txt"
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
    python3 - "$name" "$out/billion-$name.log" "$out/billion-phases.tsv" "$@" <<'EOF'
import os, subprocess, sys, time
name, log, table, cmd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
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
print(f"== {name}: {wall:.2f} s, peak RSS {peak:.2f} GiB")
with open(table, "a") as t:
    t.write(f"{name}\t{wall:.3f}\t{peak:.3f}\n")
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
    grep -E "host memory|GPU memory|set-up|epoch [0-9]+:|test:|labels indexed|index kept" \
        "$out/billion-$name.log" |
        sed 's/^[^ ]* *INFO //'
    [ "$status" = 0 ] || exit 1
    echo "GPU memory used, peak over the run:" \
        "$(sort -n "$out/billion-$name-gpu-memory.csv" | tail -1) MiB"
}

train train --out "$run" --set training.num_epochs="$epochs" --set storage.num_partitions=1
# One epoch more from the checkpoint: the tables come back from disk, go to the GPU, and their
# host copies are given back.
phase resume "$ctl" train --out "$run" --resume --set training.num_epochs=$((epochs + 1)) || exit 1
grep -E "host memory|GPU memory|set-up|epoch [0-9]+:|test:|labels indexed" "$out/billion-resume.log" |
    sed 's/^[^ ]* *INFO //'
# Issue 50: the resume within the training run's own memory.
python3 - "$out/billion-phases.tsv" <<'EOF'
import sys
peak = {l.split("\t")[0]: float(l.split("\t")[2]) for l in open(sys.argv[1])}
t, r = peak["train"], peak["resume"]
verdict = "within the training run's" if r <= t else "ABOVE the training run's"
print(f"peak RSS: train {t:.3f} GiB, resume {r:.3f} GiB: {verdict} ({r - t:+.3f} GiB)")
EOF

# Issue 50: a first query in seconds. One command a phase (its wall time is the figure), on
# the resumed run: the label index was kept when training ended (a query that found none would
# build it: "labels indexed" in its lines).
qdevs=$device
[ "$device" = cpu ] || qdevs="$device cpu"
query() {
    local name=$1 what=$2 dev=$3
    local ask=(predict "$run" --head e12345 --relation "(untyped)")
    [ "$what" = neighbors ] && ask=(neighbors "$run" --entity e12345 --metric cosine)
    phase "$name" "$ctl" "${ask[@]}" --top 10 --device "$dev" --json || return 1
    grep -E "labels indexed|index kept|the run opened|answering on|queries in" \
        "$out/billion-$name.log" | sed 's/^[^ ]* *INFO //'
    grep '^{' "$out/billion-$name.log" >"$work/answer-$name.json"
}
# The page cache dropped (root only; a VM may refuse): the next command reads from the disk.
drop_caches() {
    if [ "$cold" = 0 ]; then
        echo "page cache left alone (COLD=0): no cold figures"
        return 1
    fi
    sync
    if ! (echo 3 >/proc/sys/vm/drop_caches) 2>/dev/null; then
        echo "page cache NOT dropped (/proc/sys/vm/drop_caches not writable by $(id -un)): no cold figures"
        return 1
    fi
}
first=1
for dev in $qdevs; do
    tag=${dev%%:*}
    if [ -n "$first" ]; then
        query "predict-$tag-first" predict "$dev" || exit 1
        first=
    fi
    query "predict-$tag-warm" predict "$dev" || exit 1
    query "neighbors-$tag-warm" neighbors "$dev" || exit 1
done
for dev in $qdevs; do
    tag=${dev%%:*}
    drop_caches || break
    query "predict-$tag-cold" predict "$dev" || exit 1
    cmp -s "$work/answer-predict-$tag-cold.json" "$work/answer-predict-$tag-warm.json" ||
        echo "predict on $dev: cold and warm answers DIFFER"
done
if [ "$qdevs" != cpu ]; then
    for what in predict neighbors; do
        if cmp -s "$work/answer-$what-${device%%:*}-warm.json" "$work/answer-$what-cpu-warm.json"; then
            echo "$what: GPU and CPU answers identical"
        else
            echo "$what: GPU and CPU answers DIFFER"
        fi
    done
fi
# What a cold query reads from the disk (the labels are on tmpfs with the dataset), and the
# disk's rate read directly (O_DIRECT: no page cache) from a file of the same size.
ckpt=$run/$(sed -n 's/^checkpoint = "\(.*\)"$/\1/p' "$run/run.toml")
cold_bytes=$(($(stat -c %s "$ckpt/entities.bin") + $(du -cb "$run/index" | tail -1 | cut -f1)))
rate=$(dd if="$ckpt/entities.state.bin" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1)
echo "disk read (dd, O_DIRECT, $ckpt/entities.state.bin): $rate"
python3 - "$cold_bytes" "$rate" "$out/billion-disk-seconds.txt" <<'EOF'
import re, sys
cold, line = int(sys.argv[1]), sys.argv[2]
m = re.search(r"copied, ([0-9.]+) s, ([0-9.]+) ([kMG]?B)/s", line)
if not m:
    sys.exit(f"no read rate in {line!r}")
rate = float(m.group(2)) * {"kB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}[m.group(3)]
print(f"a cold query reads {cold / 1e9:.2f} GB (entities.bin and the label index): "
      f"{cold / rate:.2f} s at {rate / 1e9:.2f} GB/s, 1.2x = {1.2 * cold / rate:.2f} s")
open(sys.argv[3], "w").write(f"{cold / rate:.3f}\n")
EOF
grep -E "^(predict|neighbors)" "$out/billion-phases.tsv" |
    awk -F'\t' '{printf "query %-20s %7.2f s wall, peak RSS %.2f GiB (mapped rows count)\n", $1, $2, $3}'

# Issue 50: the daemon's serve start on the same run, from the submission to the first answer,
# and the job's peak memory. A fresh daemon's first GPU job compiles the kernels into its cache
# (`STATE_DIR/kernels/UID`, once per user: `kernels`, not a goal); then with the run's files in
# the page cache (`warm`), then from a cold page cache (`cold`, where it can be dropped). A
# failure is told and the figures after it still come.
rm -rf "$work/legendd"
serve_start() {
    local tag=$1 sock=$work/legendd.sock job state= t0 t1 pid peak wall
    rm -f "$sock"
    : >"$work/legendd.toml"
    "$bin/legendd" --foreground --config "$work/legendd.toml" --socket "$sock" \
        --state-dir "$work/legendd" 2>"$out/billion-legendd-$tag.err" &
    local daemon=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    local d=("$ctl" --socket "$sock")
    if [ "$tag" = cold ] && ! drop_caches; then
        kill "$daemon"
        wait "$daemon" 2>/dev/null
        return
    fi
    t0=$(date +%s.%N)
    job=$("${d[@]}" submit serve "$run" --device "$device" | sed -n 's/^job \([0-9]*\) queued.*/\1/p')
    if [ -n "$job" ]; then
        # At most 10 minutes (0.1 s between tries), or until the job ends.
        for _ in $(seq 6000); do
            "${d[@]}" query "$job" predict --head e12345 --relation "(untyped)" --top 10 --json \
                >"$work/answer-serve.json" 2>>"$out/billion-serve-$tag.log" && break
            : >"$work/answer-serve.json"
            state=$("${d[@]}" status "$job" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
            case $state in running | queued) sleep 0.1 ;; *) break ;; esac
        done
    fi
    t1=$(date +%s.%N)
    if [ -s "$work/answer-serve.json" ]; then
        # The job's own account: what it holds, where it answers, which files it read into
        # memory rather than mapped (none, for a run its user alone may write), its load time.
        "${d[@]}" logs "$job" 2>&1 | grep -E "serving" | sed 's/^[^ ]* *//'
        pid=$("${d[@]}" status "$job" --json |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["process"]["pid"])')
        peak=$(awk '/^VmHWM/ {printf "%.3f", $2 / 2^20}' "/proc/$pid/status")
        wall=$(python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.3f}")' "$t0" "$t1")
        echo "serve start ($tag): $wall s from the submission to the first answer, the job's peak RSS $peak GiB"
        printf 'serve-%s\t%s\t%s\n' "$tag" "$wall" "$peak" >>"$out/billion-phases.tsv"
        # The same hits (ids, labels, scores to f32's precision): the daemon prints scores as
        # f32 and the CLI as f64, and only the CLI's answer names the epoch it read.
        if python3 - "$work/answer-serve.json" "$work/answer-predict-cpu-warm.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["hits"] for p in sys.argv[1:3])
same = len(a) == len(b) and all(
    x["id"] == y["id"] and x["label"] == y["label"]
    and abs(x["score"] - y["score"]) <= 1e-6 * max(1.0, abs(y["score"]))
    for x, y in zip(a, b))
sys.exit(0 if same else 1)
PY
        then
            echo "serve ($tag): the CLI's answer (the same hits and scores)"
        else
            echo "serve ($tag): answer DIFFERS from the CLI's"
        fi
        "${d[@]}" cancel "$job" >/dev/null
    else
        echo "serve ($tag): FAILED (job '$job', ${state:-not submitted}); legendd's log: $out/billion-legendd-$tag.err"
        [ -n "$job" ] && "${d[@]}" logs "$job" 2>&1 | tail -15
    fi
    kill "$daemon"
    wait "$daemon" 2>/dev/null
}
serve_start kernels
serve_start warm
serve_start cold
# Issue 50's query goals, from the figures above: a first answer within 2 s with the files in
# the page cache (the CLI's predict, the daemon's serve job), and from a cold cache within 1.2x
# of reading what it must at the disk's rate.
python3 - "$out/billion-phases.tsv" "$out/billion-disk-seconds.txt" <<'EOF'
import os, sys
wall = {l.split("\t")[0]: float(l.split("\t")[1]) for l in open(sys.argv[1])}
disk = float(open(sys.argv[2]).read()) if os.path.exists(sys.argv[2]) else None
for name in sorted(wall):
    if not name.startswith(("predict", "neighbors", "serve")) or name == "serve-kernels":
        continue
    w = wall[name]
    if name.endswith("-cold"):
        if disk is None:
            continue
        ok = w <= 1.2 * disk
        print(f"goal {name:<22} {w:7.2f} s = {w / disk:.2f}x the disk's {disk:.2f} s "
              f"(<= 1.2x): {'met' if ok else 'NOT met'}")
    else:
        print(f"goal {name:<22} {w:7.2f} s (<= 2 s warm): {'met' if w <= 2 else 'NOT met'}")
EOF

phase export "$ctl" export "$run" --format npy -o "$work/export" || exit 1
ls -la "$work/export" | tail -4
du -sh "$run"
# The checkpoint (streamed from the GPU) ranks as the run's own final evaluation did.
phase verify "$ctl" eval --embeddings "$work/export" --decoder dot --dataset "$data" \
    --protocol sampled || exit 1
grep -E "MRR" "$out/billion-verify.log"
rm -rf "$work/export"
# The run's own evaluation again (the embeddings read without their AdaGrad state).
phase eval "$ctl" eval "$run" --protocol sampled || exit 1
# Issue 50: no entry point's peak above the training run's.
python3 - "$out/billion-phases.tsv" <<'EOF'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
peak = {name: float(p) for name, _, p in rows}
train = peak["train"]
for name, p in peak.items():
    if name in ("generate", "train"):
        continue
    verdict = "within" if p <= train else "ABOVE"
    print(f"peak RSS {name:<22} {p:7.3f} GiB: {verdict} the training run's {train:.3f} ({p - train:+.3f})")
EOF

[ "$tier_epochs" -gt 0 ] || exit 0
tier=$work/tier
train tier --out "$tier" --set training.num_epochs="$tier_epochs" \
    --set storage.num_partitions=8 --set storage.buffer_capacity=3
"$ctl" report "$tier" -o "$out/billion-tier-timeline.html"
