#!/usr/bin/env bash
# The main job: train ComplEx on a small real knowledge graph with its recipe in configs/ (CPU
# engine, in-memory store; reciprocal relations, early stopping on valid MRR) and print the best
# epoch's filtered test MRR and Hits@10.
#
# Usage: scripts/main-job.sh [umls|kinships|nations] [extra `legendctl train` arguments...]
# (the graph's name may also come after the options, e.g. `--set training.num_epochs=50 nations`).
# The data comes from the pykeen==1.11.1 wheel on PyPI (MIT), cached in ~/.cache/legend.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/lib/heartbeat.sh"
name=
train_args=()
takes_value=
for arg in "$@"; do
  if [ -n "$takes_value" ]; then
    train_args+=("$arg")
    takes_value=
    continue
  fi
  case "$arg" in
    umls | kinships | nations)
      [ -z "$name" ] || { echo "two graphs given: $name and $arg" >&2; exit 2; }
      name=$arg
      ;;
    --set | --log) train_args+=("$arg"); takes_value=1 ;;
    -*) train_args+=("$arg") ;;
    *)
      echo "unknown graph $arg: expected umls, kinships or nations (other arguments are legendctl train options, such as --set KEY=VALUE)" >&2
      exit 2
      ;;
  esac
done
name=${name:-umls}
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
work=${LEGEND_WORK:-$cache/main-job}
mkdir -p "$work"

# Cargo's own progress (a bar on a terminal, a line per crate elsewhere): the first build has
# 180 steps, 3.5 minutes on an idle 2-core machine (15 on one loaded by other builds); later
# runs, seconds.
echo "== building legendctl (release; the first build takes 4 to 15 minutes on 2 cores)"
heartbeat "building legendctl" cargo build --release --locked -p legendctl --manifest-path "$root/Cargo.toml"
bin=${CARGO_TARGET_DIR:-$root/target}/release/legendctl

raw=$work/raw/$name
heartbeat "downloading $name" "$root/scripts/pykeen-graph.sh" "$name" "$raw"

dataset=$work/datasets/$name
if [ ! -f "$dataset/dataset.toml" ]; then
  echo "== importing $name"
  "$bin" import -o "$dataset" --train "$raw/train.txt" --valid "$raw/valid.txt" --test "$raw/test.txt"
fi

run=$work/runs/$name-complex-$(date +%Y%m%d-%H%M%S)
recipe=$root/configs/$name-complex.toml
echo "== training ComplEx on $name (recipe $recipe; run directory $run)"
"$bin" train --dataset "$dataset" --out "$run" "$recipe" "${train_args[@]}"
