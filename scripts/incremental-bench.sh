#!/usr/bin/env bash
# Incremental training on a real graph, on the CPU: a base run, then the day's delta trained
# from scratch and seeded from the base in each mode (Documentation/benchmarks.md,
# "Incremental training").
#
#   scripts/incremental-bench.sh [WORK]    # WORK defaults to /tmp/legend-incremental
#
# Environment: GRAPH (a folder with train.txt, valid.txt, test.txt; default the shared
# wordnet-rr), CONFIG (default configs/wordnet-rr-complex.toml), SEED (of the split and of the
# runs, default 0), BASE_EPOCHS (default 30), INC_EPOCHS (default 10), THREADS (default 2),
# LEGENDCTL (default target/release/legendctl).
#
# The delta: 10 % of the entities of degree >= 3 held back with all their edges, each giving
# one edge to the delta's valid and one to its test split (scripts/incremental-split.py).
# Every run is ranked (filtered MRR, through its exported embeddings) on the new entities' test
# edges (eval-new: the grown dataset's ids, its test split the delta's alone) and on the old
# ones' (eval-old: the base's test edges among the grown graph's entities). Prints one line a
# run: wall time (carry-over included), epochs, new MRR, old MRR.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/legend-incremental}
graph=${GRAPH:-$root/../shared/datasets/wordnet-rr}
config=${CONFIG:-$root/configs/wordnet-rr-complex.toml}
seed=${SEED:-0}
base_epochs=${BASE_EPOCHS:-30}
inc_epochs=${INC_EPOCHS:-10}
threads=${THREADS:-2}
legendctl=${LEGENDCTL:-$root/target/release/legendctl}
mkdir -p "$work"
cd "$work"
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

split=split-$seed
if [ ! -d "$split" ]; then
    python3 "$root/scripts/incremental-split.py" "$graph/train.txt" "$graph/valid.txt" \
        "$graph/test.txt" "$split" --seed "$seed" >&2
fi
imp() { [ -d "$1" ] || "$legendctl" import -o "$@" >/dev/null; }
imp base-$seed --train $split/base-train.tsv --valid $split/base-valid.tsv --test $split/base-test.tsv
imp base-notest-$seed --train $split/base-train.tsv
imp grown-$seed --extend base-$seed --add $split/delta-train.tsv --valid $split/delta-valid.tsv --test $split/delta-test.tsv
imp eval-new-$seed --extend base-notest-$seed --add $split/delta-train.tsv --valid $split/delta-valid.tsv --test $split/delta-test.tsv
imp eval-old-$seed --extend base-$seed --add $split/delta-train.tsv
for d in eval-new-$seed eval-old-$seed; do
    cmp -s grown-$seed/entities.tsv $d/entities.tsv || { echo "$d: ids differ from grown-$seed" >&2; exit 1; }
done

common=(--set training.threads=$threads --set training.seed=$seed --set evaluation.epochs_per_eval=5)
# train NAME DATASET EPOCHS [ARGS...]: the run's wall time in NAME.seconds.
train() {
    local name=$1 dataset=$2 epochs=$3
    shift 3
    [ -f "$name.seconds" ] && return
    rm -rf "$name"
    log "training $name"
    local t0=$(date +%s.%N)
    "$legendctl" train --dataset "$dataset" --out "$name" "$config" "${common[@]}" \
        --set training.num_epochs=$epochs "$@" > "$name.log" 2>&1
    echo "$(date +%s.%N) - $t0" | bc > "$name.seconds"
}
# mrr RUN DATASET: filtered test MRR of RUN's (best) embeddings on DATASET.
mrr() {
    [ -d "$1/export" ] || "$legendctl" export "$1" --format npy >/dev/null 2>&1
    "$legendctl" eval --embeddings "$1/export" --dataset "$2" --decoder complex --reciprocal \
        --threads $threads --json 2>/dev/null | python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["mrr"])'
}

train base-run-$seed base-$seed $base_epochs
train scratch-$seed grown-$seed $base_epochs
train inc-init-$seed grown-$seed $inc_epochs --init-from base-run-$seed
train inc-neighbours-$seed grown-$seed $inc_epochs --init-from base-run-$seed --set training.new_rows='"neighbours"'
train inc-frozen-$seed grown-$seed $inc_epochs --init-from base-run-$seed --set training.new_rows='"neighbours"' --set training.freeze='"existing"'
train inc-replay-$seed grown-$seed $inc_epochs --init-from base-run-$seed --set training.new_rows='"neighbours"' --set training.replay=0.1

base_old=$("$legendctl" eval base-run-$seed --threads $threads --json 2>/dev/null | python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)["mrr"])')
printf '%-22s %9s %7s %8s %8s\n' run seconds epoch new-MRR old-MRR
printf '%-22s %9.1f %7s %8s %8s\n' base-run-$seed "$(cat base-run-$seed.seconds)" \
    "$(grep -o 'epoch [0-9]* (the best' base-run-$seed.log | grep -o '[0-9]*' || echo -)" - "$base_old"
for r in scratch inc-init inc-neighbours inc-frozen inc-replay; do
    run=$r-$seed
    printf '%-22s %9.1f %7s %8s %8s\n' "$run" "$(cat $run.seconds)" \
        "$(grep -o 'epoch [0-9]* (the best' $run.log | grep -o '[0-9]*' || echo last)" \
        "$(mrr $run eval-new-$seed)" "$(mrr $run eval-old-$seed)"
done
