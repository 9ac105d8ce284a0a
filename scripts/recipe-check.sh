#!/usr/bin/env bash
# CI's quality floor: trains the UMLS DistMult recipe (configs/umls-distmult.toml: reciprocal
# relations, N3, early stopping) with the debug legendctl that the test stage built and fails
# when its filtered test MRR falls below the floor. Measured 0.910 (Documentation/benchmarks.md,
# batch keys); the floor leaves room for float differences between machines, not for a
# regression of the recipe's options (without them the same run gives 0.70). It says how the
# run goes every 5 s (epoch, loss, the last valid MRR); the run's log is printed if it fails.
# 6 s on a busy 2-core machine (load 10; early stopping ends it at epoch 30, its best 10), plus
# the build of the debug legendctl when it is not given (below).
# Usage: scripts/recipe-check.sh [FLOOR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
floor=${1:-0.88}
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
work=$cache/recipe-check
# scripts/test.sh passes the binary its test stage built (LEGENDCTL): a `cargo build` here
# resolves features for legendctl alone, not for the workspace's tests, and rebuilds 24 crates
# (6.5 minutes on a busy 2-core machine).
bin=${LEGENDCTL:-}
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "== building legendctl (debug)"
  cargo build --locked -p legendctl --manifest-path "$root/Cargo.toml"
  bin=${CARGO_TARGET_DIR:-$root/target}/debug/legendctl
fi
"$root/scripts/pykeen-graph.sh" umls "$work/raw/umls"
dataset=$work/datasets/umls
if [ ! -f "$dataset/dataset.toml" ]; then
  "$bin" import -o "$dataset" --train "$work/raw/umls/train.txt" --valid "$work/raw/umls/valid.txt" --test "$work/raw/umls/test.txt"
fi
run=$work/runs/umls-distmult
rm -rf "$run"
log=$work/train.log
echo "== training the UMLS DistMult recipe (configs/umls-distmult.toml; up to 200 epochs, early stopping)"
# The --json lines (one an epoch, then the final evaluation) become a progress line every 5 s
# and the verdict; the log goes to a file, shown when the run fails.
report='
import json, sys, time
floor, shown, valid, final = float(sys.argv[1]), time.monotonic(), None, None
for text in sys.stdin:
    line = json.loads(text)
    if line.get("final"):
        final = line
        continue
    if "valid" in line:
        valid = line["valid"]["mrr"]
    if time.monotonic() - shown >= 5:
        shown = time.monotonic()
        seen = f", valid MRR {valid:.4f}" if valid is not None else ""
        epoch, loss = line["epoch"], line["loss"]
        print(f"recipe: epoch {epoch}, loss {loss:.4f}{seen}", flush=True)
if final is None:
    sys.exit("recipe: the run ended without a final evaluation")
mrr, best = final["metrics"]["mrr"], final.get("best_epoch")
print(f"UMLS DistMult recipe: filtered test MRR {mrr:.4f} (best epoch {best}), floor {floor}")
sys.exit(0 if mrr >= floor else 1)
'
if ! "$bin" train --dataset "$dataset" --out "$run" "$root/configs/umls-distmult.toml" --json 2>"$log" |
  python3 -c "$report" "$floor"; then
  echo "recipe: the run's log ($log):"
  tail -n 30 "$log"
  exit 1
fi
