#!/usr/bin/env bash
# The Twitter-shaped out-of-core run of issue 5 on the GPU machine: a generated graph with
# Twitter-2010's size (41,652,230 nodes, 1,468,365,182 edges, one relation, power-law
# degrees), Dot, d = 100, the GPU engine with its buffer limited to 3 of 8 partitions and the
# store (embeddings + AdaGrad state, 33 GB) on the machine's disk. Half the negatives are
# degree-based: with uniform negatives alone the training loss of Dot on these power-law
# graphs rises from epoch to epoch (seen on the CPU engine too, at lr 0.1 and 0.01). Prints each epoch's time,
# I/O and GPU utilisation, and writes the last epoch's I/O-vs-compute timeline
# (`legendctl report`) under $OUT.
#
# Builds nothing: expects legendctl in ${BIN_DIR:-target-gpu} (scripts/gpu/build-binaries.sh).
# The edges go to tmpfs (LEGEND_DATA, RAM: 17.6 GB) so that the disk holds the store; the
# store and run directory go to LEGEND_WORK on the disk. NODES, EDGES, EPOCHS and NEGATIVES
# scale the run down for a dry run.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN_DIR:-$root/target-gpu}
out=${OUT:-$bin/out}
data=${LEGEND_DATA:-/dev/shm/legend-twitter}
work=${LEGEND_WORK:-/var/tmp/legend-twitter}
nodes=${NODES:-41652230}
edges=${EDGES:-1468365182}
epochs=${EPOCHS:-2}
negatives=${NEGATIVES:-1000}
device=${DEVICE:-cuda:0}
mkdir -p "$out"
rm -rf "$data" "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh"
ctl=$bin/legendctl
{
    "$root/scripts/gpu/hardware.sh"
    free -g | head -2
    df -h "$work" "$(dirname "$data")" | tail -2
} | tee "$out/twitter-hw.txt"

echo "== generate: $nodes nodes, $edges edges"
t0=$(date +%s.%N)
"$ctl" generate --nodes "$nodes" --edges "$edges" --relations 1 --split 1,0,0 --json "$data" \
    >"$out/twitter-generate.json" 2>"$out/twitter-generate.log" || { cat "$out/twitter-generate.log"; exit 1; }
echo "generated in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"

echo "== train: Dot, d 100, N 8, C 3, file store on disk, $epochs epochs, device $device"
run=$work/run
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 500 \
    >"$out/twitter-util.csv" 2>/dev/null &
smi=$!
status=0
"$ctl" train --dataset "$data" --out "$run" --json \
    --set model.decoder=dot --set model.dim=100 \
    --set training.batch_size=100000 --set training.negatives.num_chunks=10 \
    --set training.negatives.negatives_per_positive="$negatives" \
    --set training.negatives.degree_fraction=0.5 \
    --set training.num_epochs="$epochs" \
    --set storage.num_partitions=8 --set storage.buffer_capacity=3 \
    --set storage.backend=file --set "storage.path=\"$work/store.bin\"" \
    --set "training.device=\"$device\"" \
    >"$out/twitter.jsonl" 2>"$out/twitter-train.log" || status=1
kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
tail -5 "$out/twitter-train.log"
python3 "$root/scripts/gpu/epoch_summary.py" "$out/twitter.jsonl" "$out/twitter-util.csv" \
    "$out/twitter-train.log" twitter ooc | tee "$out/twitter.txt"
"$ctl" report "$run" --out "$out/twitter-timeline.svg" && echo "timeline: $out/twitter-timeline.svg"
rm -rf "$data"
exit $status
