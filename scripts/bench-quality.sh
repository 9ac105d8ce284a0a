#!/usr/bin/env bash
# Link-prediction quality with the default settings (CPU engine): ComplEx and DistMult, d = 200,
# 200 epochs on Nations, UMLS and Kinships (from the pykeen 1.11.1 wheel) and, when a WordNet
# directory is given, 50 epochs on it. Prints a Markdown table of filtered test MRR / Hits@10 and
# wall time, next to the reference figures of a plain PyTorch implementation of the same method.
# Usage: scripts/bench-quality.sh [WORDNET_DIR (with train.txt valid.txt test.txt)]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
wordnet=${1:-}
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
work=$cache/bench-quality
mkdir -p "$work"
cargo build --release --locked -q -p legendctl --manifest-path "$root/Cargo.toml"
bin=${CARGO_TARGET_DIR:-$root/target}/release/legendctl
# The main job fetches and imports the small graphs; reuse its cache.
for name in nations umls kinships; do
  LEGEND_WORK=$work "$root/scripts/main-job.sh" "$name" --set training.num_epochs=1 >/dev/null
done
declare -A ref=(
  [nations-complex]=.733 [nations-distmult]=.740 [kinships-complex]=.758 [kinships-distmult]=.467
  [umls-complex]=.918 [umls-distmult]=.691 [wordnet-complex]=.484 [wordnet-distmult]=.480)
if [ -n "$wordnet" ] && [ ! -f "$work/datasets/wordnet/dataset.toml" ]; then
  "$bin" import -o "$work/datasets/wordnet" --train "$wordnet/train.txt" --valid "$wordnet/valid.txt" --test "$wordnet/test.txt"
fi
echo "| dataset | model | epochs | filtered MRR | Hits@10 | reference MRR | wall s |"
echo "|---|---|---|---|---|---|---|"
for name in nations umls kinships wordnet; do
  [ -f "$work/datasets/$name/dataset.toml" ] || continue
  epochs=200
  [ "$name" = wordnet ] && epochs=50
  for model in complex distmult; do
    run=$work/runs/$name-$model
    rm -rf "$run"
    start=$(date +%s.%N)
    final=$("$bin" train --dataset "$work/datasets/$name" --out "$run" --set model.decoder=$model \
      --set training.num_epochs=$epochs --json 2>/dev/null | tail -n 1)
    end=$(date +%s.%N)
    python3 - "$final" "$name" "$model" "$epochs" "${ref[$name-$model]}" "$start" "$end" <<'PY'
import json, sys
final, name, model, epochs, ref, start, end = sys.argv[1:]
m = json.loads(final)["metrics"]
print(f"| {name} | {model} | {epochs} | {m['mrr']:.3f} | {m['hits_at_10']:.3f} | {ref} | {float(end) - float(start):.0f} |")
PY
  done
done
