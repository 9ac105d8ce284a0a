#!/usr/bin/env bash
# Issue 29 (Measure): Legend's CPU engine with the file backend against PyTorch-BigGraph 1.0.0,
# both out of core (N partitions on disk; PBG two resident, Legend C = 2 and C = 3), on a generated
# power-law graph; runs alternate, sampled MRR of both by Legend's evaluator.
# Prints a results table; writes $WORK/pbg-disk-<nodes>-<edges>-n<N>/pbg-disk-results.json.
#
#   benchmarks/baselines/run-pbg-disk.sh
#   NODES=1000000 EDGES=10000000 PARTITIONS=4 REPEATS=3 LEGENDCTL=/path/legendctl benchmarks/baselines/run-pbg-disk.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/setup.sh"
WORK=${WORK:-$CACHE/work}
exec nice -n 10 "$PY" "$HERE/compare_pbg_disk.py" --legendctl "$LEGENDCTL" --work "$WORK" \
    --nodes "${NODES:-1000000}" --edges "${EDGES:-10000000}" --partitions "${PARTITIONS:-4}" \
    --repeats "${REPEATS:-3}" --epochs "${EPOCHS:-2}" --negatives "${NEG:-100}" --batch-size "${BATCH:-1000}" "$@"
