#!/usr/bin/env bash
# One training configuration over several seeds (CPU engine unless the arguments say otherwise):
# each seed's best valid MRR, the final evaluation's filtered test MRR and Hits@10 (the best
# epoch's with early stopping), best epoch and wall time, then the means over the seeds. The
# ComplEx defaults and the RotatE candidates of Documentation/benchmarks.md ("Recipes") were
# measured with it; select on the valid column only.
# Usage: scripts/bench-seeds.sh DATASET [legendctl train arguments: CONFIG.toml, --set key=value ...]
#   SEEDS (default "0 1 2"), LEGENDCTL (default: the release build, built here),
#   LEGEND_WORK (the runs; default a temporary folder, removed at the end).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ]; then
  echo "usage: $0 DATASET [legendctl train arguments]" >&2
  exit 2
fi
dataset=$1
shift
bin=${LEGENDCTL:-}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p legendctl --manifest-path "$root/Cargo.toml"
  bin=${CARGO_TARGET_DIR:-$root/target}/release/legendctl
fi
work=${LEGEND_WORK:-}
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
results=$work/results.txt
: >"$results"
for seed in ${SEEDS:-0 1 2}; do
  run=$work/seed-$seed
  rm -rf "$run"
  start=$(date +%s.%N)
  "$bin" train --dataset "$dataset" --out "$run" "$@" --set training.seed="$seed" >/dev/null 2>"$run.log" ||
    { echo "seed $seed failed:" >&2; tail -3 "$run.log" >&2; exit 1; }
  end=$(date +%s.%N)
  python3 - "$run/metrics.jsonl" "$seed" "$start" "$end" <<'PY' | tee -a "$results"
import json, sys
path, seed, start, end = sys.argv[1:]
lines = [json.loads(l) for l in open(path)]
valid = max((l["valid"]["mrr"] for l in lines if "valid" in l), default=float("nan"))
final = [l for l in lines if l.get("final")][-1]
m = final["metrics"]
print(f"seed {seed}: valid {valid:.4f} test {m['mrr']:.4f} hits@10 {m['hits_at_10']:.4f} "
      f"best epoch {final.get('best_epoch', '-')} wall {float(end) - float(start):.0f} s")
PY
done
python3 - "$results" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
mean = lambda key: sum(float(r[r.index(key) + 1]) for r in rows) / len(rows)
print(f"mean of {len(rows)}: valid {mean('valid'):.4f} test {mean('test'):.4f} hits@10 {mean('hits@10'):.4f}")
PY
