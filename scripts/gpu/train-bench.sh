#!/usr/bin/env bash
# `legendctl train` on the GPU machine, end to end, next to the CPU engine in the same run:
#  1. the trainer's GPU-vs-CPU tests (legend-engine/tests/gpu_trainer.rs);
#  2. UMLS quality: ComplEx, TransE L2 and TransE L1 with the default config, 200 epochs, CPU
#     and GPU, in memory and out of core (N = 4, C = 3); filtered test MRR of each;
#  3. epoch time on a generated graph (10^6 nodes, 2·10^7 edges, 10 relations): B = 10^5,
#     10 chunks, 1000 negatives, d = 100, Dot and ComplEx, in memory and out of core (N = 8,
#     C = 3, file backend on this machine's disk), GPU utilisation sampled every 100 ms; Dot
#     also in memory with the edges uploaded bucket by bucket.
# Builds nothing: expects target-gpu/ from scripts/gpu/build-binaries.sh and the UMLS
# dataset imported into gpu-data/umls (both carried; LEGEND_GPU_BIN and LEGEND_GPU_DATA name
# other folders). Logs under ${OUT:-target-gpu/out}. LEGEND_BENCH_ONLY picks the parts
# (default "tests umls epochs"), LEGEND_BENCH_LAYOUTS the epoch runs' layouts (default
# "mem memup ooc"; memup runs for Dot only), e.g. to time an older legendctl the same way.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
data=${LEGEND_GPU_DATA:-$root/gpu-data}
out=${OUT:-$bin/out}
mkdir -p "$out"
work=${LEGEND_WORK:-/tmp/legend-train-bench}
rm -rf "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh"
ctl=$bin/legendctl
status=0
"$root/scripts/gpu/hardware.sh" | tee "$out/hw.txt"
df -h "$work" | tail -1 | tee -a "$out/hw.txt"

only=" ${LEGEND_BENCH_ONLY:-tests umls epochs} "

if [[ $only == *" tests "* ]]; then
    echo "== trainer tests"
    "$bin/test-gpu_trainer" --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$out/trainer-tests.log" || status=1
fi

if [[ $only == *" umls "* ]]; then
    echo "== UMLS, defaults with ComplEx, TransE L2 and TransE L1, 200 epochs"
    mrr() { python3 -c 'import json,sys; print("%.4f" % [json.loads(l) for l in open(sys.argv[1])][-1]["metrics"]["mrr"])' "$1/metrics.jsonl"; }
    for model in complex transe_l2 transe_l1; do
        for layout in "mem:storage.num_partitions=1" "ooc:storage.num_partitions=4"; do
            name=${layout%%:*}; parts=${layout#*:}
            extra=()
            [ "$name" = ooc ] && extra=(--set storage.buffer_capacity=3)
            for dev in cpu cuda:0; do
                run=$work/umls-$model-$name-${dev%%:*}
                start=$(date +%s%N)
                "$ctl" train --dataset "$data/umls" --out "$run" --set training.num_epochs=200 \
                    --set "model.decoder=$model" --set "$parts" "${extra[@]}" \
                    --set "training.device=\"$dev\"" >"$out/umls-$model-$name-${dev%%:*}.log" 2>&1 || status=1
                end=$(date +%s%N)
                printf 'umls %-9s %-4s %-7s MRR %s  %d ms\n' "$model" "$name" "$dev" "$(mrr "$run")" $(( (end - start) / 1000000 )) | tee -a "$out/umls.txt"
            done
        done
    done
fi

[[ $only == *" epochs "* ]] || exit $status
echo "== generated graph: 1e6 nodes, 2e7 edges"
t0=$(date +%s)
"$ctl" generate --nodes 1000000 --edges 20000000 --relations 10 --split 1,0,0 "$work/gen" >/dev/null || status=1
echo "generated in $(( $(date +%s) - t0 )) s"
common=(--set training.batch_size=100000 --set training.negatives.num_chunks=10
        --set training.negatives.negatives_per_positive=1000 --set model.dim=100
        --set training.num_epochs=3 --set training.device='"cuda:0"' --json)
for model in dot complex; do
    # memup (Dot): in memory, but the edges uploaded bucket by bucket (storage.gpu_edge_fraction = 0).
    for layout in ${LEGEND_BENCH_LAYOUTS:-mem memup ooc}; do
        [ "$layout" = memup ] && [ "$model" != dot ] && continue
        run=$work/bench-$model-$layout
        opts=(--set "model.decoder=$model")
        [ "$layout" = memup ] && opts+=(--set storage.gpu_edge_fraction=0)
        [ "$layout" = ooc ] && opts+=(--set storage.num_partitions=8 --set storage.buffer_capacity=3
                                      --set storage.backend=file --set "storage.path=\"$work/store-$model.bin\"")
        nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 100 \
            >"$out/util-$model-$layout.csv" 2>/dev/null &
        smi=$!
        "$ctl" train --dataset "$work/gen" --out "$run" "${common[@]}" "${opts[@]}" \
            >"$out/bench-$model-$layout.jsonl" 2>"$out/bench-$model-$layout.log" || status=1
        kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
        python3 "$root/scripts/gpu/epoch_summary.py" "$out/bench-$model-$layout.jsonl" \
            "$out/util-$model-$layout.csv" "$out/bench-$model-$layout.log" "$model" "$layout" |
            tee -a "$out/bench.txt"
    done
done
exit $status
