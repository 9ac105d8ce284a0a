#!/usr/bin/env bash
# Issue 44's relation measurements on a machine with 2 GPUs, in one call: (1) wordnet-rr's
# ComplEx recipe on 2 GPUs for SEEDS (default 0 1 2), its filtered test MRR beside one GPU's
# (scripts/gpu/recipes-gpu.sh gives one GPU's); (2) the relation sums' share of a step: a
# generated graph with 1,000 relations (10^6 nodes, 2*10^7 edges), ComplEx d = 100, B = 10^4,
# 10 chunks x 100 negatives, on one GPU at N = 4 and on 2 GPUs (N = 4, summing the relation
# gradients over both after every batch), epoch times side by side.
# K (default 2) sets the GPUs of (1) on a larger machine; SUMS=0 skips (2).
# Builds nothing: legendctl in ${BIN_DIR:-target-gpu}, wordnet-rr imported in ${DATA:-gpu-data}.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BIN_DIR:-$root/target-gpu}
data=${DATA:-$root/gpu-data}
out=${OUT:-$bin/out}
work=${LEGEND_WORK:-/tmp/legend-relations}
mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh"
ctl=$bin/legendctl
final() {
    python3 - "$1" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
f = [l for l in lines if l.get("final")][-1]
e = [l for l in lines if "epoch" in l and "seconds" in l]
print(f"test MRR {f['metrics']['mrr']:.4f} best epoch {f.get('best_epoch', '-')} "
      f"{sum(x['seconds'] for x in e) / len(e):.3f} s/epoch over {len(e)} epochs")
PY
}
k_gpus=${K:-2}
for seed in ${SEEDS:-0 1 2}; do
    run=$work/wordnet-${k_gpus}gpus-$seed
    if "$ctl" train --dataset "$data/wordnet-rr" --out "$run" "$root/configs/wordnet-rr-complex.toml" \
        --set training.device='"cuda:0"' --gpus "$k_gpus" --set training.seed="$seed" >"$out/wn$k_gpus-$seed.log" 2>&1; then
        echo "wordnet-rr ComplEx, $k_gpus GPUs, seed $seed: $(final "$run/metrics.jsonl")"
    else
        echo "wordnet-rr $k_gpus GPUs seed $seed FAILED:"; tail -5 "$out/wn$k_gpus-$seed.log"
    fi
done
[ "${SUMS:-1}" = 1 ] || exit 0
"$ctl" generate --nodes 1000000 --edges 20000000 --relations 1000 --split 0.999,0.0005,0.0005 \
    "$work/g1000" >/dev/null 2>&1 || { echo "generate FAILED"; exit 1; }
for k in 1 2; do
    run=$work/g1000-$k
    if "$ctl" train --dataset "$work/g1000" --out "$run" --set model.decoder=complex \
        --set model.dim=100 --set training.batch_size=10000 --set training.negatives.num_chunks=10 \
        --set training.negatives.negatives_per_positive=100 --set training.num_epochs=3 \
        --set storage.num_partitions=4 --set evaluation.protocol=sampled \
        --set training.device='"cuda:0"' --gpus "$k" >"$out/g1000-$k.log" 2>&1; then
        echo "1,000 relations, ComplEx d 100, N = 4, $k GPU(s): $(final "$run/metrics.jsonl")"
        grep -E "epoch 3: [0-9] workers" "$out/g1000-$k.log" | cut -c1-400
    else
        echo "1,000 relations on $k GPU(s) FAILED:"; tail -5 "$out/g1000-$k.log"
    fi
done
