#!/usr/bin/env bash
# Does the row format move quality? (issue 29, item 1): ComplEx on the small graphs with each
# of FORMATS (an AdaGrad state layout, optionally /dtype: element row by default; e.g.
# "element row element/bf16 row/bf16 row/f16"), SEEDS seeds each (0 1 2), on DEVICES
# (cuda:0 cpu), printing each run's filtered test MRR and the mean per combination. Expects
# legendctl in ${LEGEND_GPU_BIN:-target-gpu} and the imported datasets in ${DATA:-gpu-data}
# (legendctl import --out gpu-data/NAME --train ... --valid ... --test ...). Builds nothing.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
data=${DATA:-$root/gpu-data}
out=${OUT:-$bin/out}
work=${LEGEND_WORK:-/var/tmp/legend-quality}
seeds=${SEEDS:-0 1 2}
devices=${DEVICES:-cuda:0 cpu}
graphs=${GRAPHS:-umls:200 kinships:200 wordnet-rr:50}
formats=${FORMATS:-element row}
mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
[[ "$devices" == *cuda* ]] && source "$root/scripts/gpu/nvrtc-env.sh" >/dev/null
status=0
for device in $devices; do
    for spec in $graphs; do
        graph=${spec%%:*} epochs=${spec##*:}
        for format in $formats; do
            state=${format%%/*} dtype=f32
            [ "$format" != "$state" ] && dtype=${format#*/}
            for seed in $seeds; do
                name=$graph-${format/\//-}-$seed-${device/:/}
                start=$SECONDS
                if ! "$bin/legendctl" train --dataset "$data/$graph" --out "$work/$name" --json \
                    --set model.decoder=complex --set training.num_epochs="$epochs" \
                    --set training.seed="$seed" --set "optimizer.state=\"$state\"" \
                    --set "storage.dtype=\"$dtype\"" \
                    --set "training.device=\"$device\"" >"$out/q-$name.jsonl" 2>"$out/q-$name.log"; then
                    echo "$name: FAILED"; tail -3 "$out/q-$name.log"; status=1; continue
                fi
                python3 - "$out/q-$name.jsonl" "$graph" "$format" "$seed" "$device" $((SECONDS - start)) <<'PY' | tee -a "$out/quality.txt"
import json, sys
path, graph, state, seed, device, secs = sys.argv[1:]
def find(v):
    if isinstance(v, dict):
        if "mrr" in v:
            return v["mrr"]
        for x in v.values():
            m = find(x)
            if m is not None:
                return m
    return None
mrr = None
for line in open(path):
    if line.startswith("{"):
        r = json.loads(line)
        if "epoch" not in r and find(r) is not None:
            mrr = find(r)
print(f"{graph} {state} seed {seed} {device}: MRR {mrr:.4f} ({secs} s)")
PY
                rm -rf "$work/$name"
            done
        done
    done
done
python3 - "$out/quality.txt" <<'PY' | tee "$out/quality-summary.txt"
import collections, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    w = line.split()
    runs[(w[0], w[1], w[4].rstrip(":"))].append(float(w[6]))
for (graph, state, device), m in sorted(runs.items()):
    print(f"{graph:11s} {device:7s} {state:11s} mean MRR {sum(m)/len(m):.4f} over {len(m)} seeds: {' '.join(f'{x:.4f}' for x in m)}")
PY
exit $status
