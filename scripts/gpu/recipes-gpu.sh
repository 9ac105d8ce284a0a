#!/usr/bin/env bash
# The recipes of configs/ on the GPU engine (issue 31: "the GPU engine within ±0.01" of the
# CPU figures in Documentation/benchmarks.md, "Recipes"): trains each named recipe on its graph
# with `training.device = "cuda:0"` (DEVICES overrides: e.g. "cuda:0 cpu") for each of SEEDS
# (default 0) and prints a table of the best valid MRR, the final filtered test MRR (the best
# epoch's), the best epoch, the mean epoch time and the wall time. Builds nothing: expects
# legendctl in ${LEGEND_GPU_BIN:-target-gpu}, the graphs imported into ${DATA:-gpu-data}/GRAPH
# (legendctl import) and the recipes in ${CONFIGS:-configs}; logs and metrics under
# ${OUT:-$LEGEND_GPU_BIN/out}.
# Usage: scripts/gpu/recipes-gpu.sh RECIPE...   (names of configs/*.toml without .toml)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
data=${DATA:-$root/gpu-data}
configs=${CONFIGS:-$root/configs}
out=${OUT:-$bin/out}
work=${LEGEND_WORK:-/tmp/legend-recipes-gpu}
mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
[ -e "$root/scripts/gpu/nvrtc-env.sh" ] && source "$root/scripts/gpu/nvrtc-env.sh"
status=0
echo "| recipe | device | seed | best valid MRR | test MRR | best epoch | s/epoch | wall s |"
echo "|---|---|---|---|---|---|---|---|"
for recipe in "$@"; do
    graph=${recipe%-*}
    for device in ${DEVICES:-cuda:0}; do
        for seed in ${SEEDS:-0}; do
            name=$recipe-${device/:/}-$seed
            start=$SECONDS
            if ! "$bin/legendctl" train --dataset "$data/$graph" --out "$work/$name" \
                "$configs/$recipe.toml" --set "training.device=\"$device\"" \
                --set training.seed="$seed" >"$out/r-$name.log" 2>&1; then
                echo "| $recipe | $device | $seed | FAILED: $(tail -1 "$out/r-$name.log") |"
                status=1
                continue
            fi
            cp "$work/$name/metrics.jsonl" "$out/r-$name.jsonl"
            python3 - "$work/$name/metrics.jsonl" "$recipe" "$device" "$seed" $((SECONDS - start)) <<'PY'
import json, sys
path, recipe, device, seed, wall = sys.argv[1:]
lines = [json.loads(l) for l in open(path)]
epochs = [l for l in lines if "epoch" in l and "seconds" in l]
valid = max((l["valid"]["mrr"] for l in lines if "valid" in l), default=float("nan"))
final = [l for l in lines if l.get("final")][-1]
per_epoch = sum(l["seconds"] for l in epochs) / max(len(epochs), 1)
print(f"| {recipe} | {device} | {seed} | {valid:.4f} | {final['metrics']['mrr']:.4f} | "
      f"{final.get('best_epoch', '-')} | {per_epoch:.3f} | {wall} |")
PY
        done
    done
done
exit $status
