#!/usr/bin/env bash
# CI's quality floor: trains the UMLS DistMult recipe (configs/umls-distmult.toml: reciprocal
# relations, N3, early stopping) with the debug legendctl that the test stage built and fails
# when its filtered test MRR falls below the floor. Measured 0.915 (Documentation/benchmarks.md,
# "Recipes"); the floor leaves room for float differences between machines, not for a
# regression of the recipe's options (without them the same run gives 0.70). About 20 s on 2 cores.
# Usage: scripts/recipe-check.sh [FLOOR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
floor=${1:-0.88}
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
work=$cache/recipe-check
cargo build --locked -q -p legendctl --manifest-path "$root/Cargo.toml"
bin=${CARGO_TARGET_DIR:-$root/target}/debug/legendctl
"$root/scripts/pykeen-graph.sh" umls "$work/raw/umls"
dataset=$work/datasets/umls
if [ ! -f "$dataset/dataset.toml" ]; then
  "$bin" import -o "$dataset" --train "$work/raw/umls/train.txt" --valid "$work/raw/umls/valid.txt" --test "$work/raw/umls/test.txt" >/dev/null
fi
run=$work/runs/umls-distmult
rm -rf "$run"
final=$("$bin" train --dataset "$dataset" --out "$run" "$root/configs/umls-distmult.toml" --json 2>/dev/null | tail -n 1)
python3 - "$final" "$floor" <<'PY'
import json, sys
line, floor = json.loads(sys.argv[1]), float(sys.argv[2])
mrr = line["metrics"]["mrr"]
print(f"UMLS DistMult recipe: filtered test MRR {mrr:.4f} (best epoch {line.get('best_epoch')}), floor {floor}")
sys.exit(0 if mrr >= floor else 1)
PY
