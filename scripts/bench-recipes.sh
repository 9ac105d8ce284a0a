#!/usr/bin/env bash
# Trains every recipe in configs/ on its graph (UMLS, Kinships and Nations from the pykeen 1.11.1
# wheel; wordnet-rr when its directory is given) with the release build and prints a Markdown
# table: best valid MRR, the best epoch's filtered test MRR and Hits@10, wall time. The figures of
# Documentation/benchmarks.md, "Recipes", come from these runs.
# Usage: scripts/bench-recipes.sh [WORDNET_RR_DIR (with train.txt valid.txt test.txt)] [--set ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
wordnet=
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
  wordnet=$1
  shift
fi
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
work=$cache/bench-recipes
mkdir -p "$work"
cargo build --release --locked -q -p legendctl --manifest-path "$root/Cargo.toml"
bin=${CARGO_TARGET_DIR:-$root/target}/release/legendctl
import() { # NAME RAW_DIR
  [ -f "$work/datasets/$1/dataset.toml" ] ||
    "$bin" import -o "$work/datasets/$1" --train "$2/train.txt" --valid "$2/valid.txt" --test "$2/test.txt" >/dev/null
}
for name in umls kinships nations; do
  "$root/scripts/pykeen-graph.sh" "$name" "$work/raw/$name"
  import "$name" "$work/raw/$name"
done
[ -z "$wordnet" ] || import wordnet-rr "$wordnet"
echo "| recipe | best valid MRR | test MRR | Hits@10 | best epoch | wall s |"
echo "|---|---|---|---|---|---|"
for recipe in "$root"/configs/*.toml; do
  base=$(basename "$recipe" .toml)
  graph=${base%-*}
  [ -f "$work/datasets/$graph/dataset.toml" ] || continue
  run=$work/runs/$base
  rm -rf "$run"
  start=$(date +%s.%N)
  "$bin" train --dataset "$work/datasets/$graph" --out "$run" "$recipe" "$@" >/dev/null 2>&1
  end=$(date +%s.%N)
  python3 - "$run/metrics.jsonl" "$base" "$start" "$end" <<'PY'
import json, sys
path, name, start, end = sys.argv[1:]
lines = [json.loads(l) for l in open(path)]
valid = max((l["valid"]["mrr"] for l in lines if "valid" in l), default=float("nan"))
final = [l for l in lines if l.get("final")][-1]
m = final["metrics"]
print(f"| {name} | {valid:.3f} | {m['mrr']:.3f} | {m['hits_at_10']:.3f} | {final.get('best_epoch', '-')} | {float(end) - float(start):.0f} |")
PY
done
