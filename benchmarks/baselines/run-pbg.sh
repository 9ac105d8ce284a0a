#!/usr/bin/env bash
# Issue 3 §10: CPU training throughput, Legend vs PyTorch-BigGraph 1.0.0 in the same run
# (ComplEx / complex_diagonal + dot, softmax loss, batch 1000, one chunk sharing 1000 uniform
# negatives per side, 2 threads), MRR of both by Legend's filtered evaluator.
# Prints a results table; writes $WORK/pbg-<dataset>/pbg-results.json.
#
#   benchmarks/baselines/run-pbg.sh
#   EPOCHS=10 NEG=1000 DATA=../shared/datasets/wordnet-rr LEGENDCTL=/path/legendctl benchmarks/baselines/run-pbg.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/setup.sh"
WORK=${WORK:-$CACHE/work}
DATA=${DATA:-$ROOT/../shared/datasets/wordnet-rr}
exec nice -n 10 "$PY" "$HERE/compare_pbg.py" --legendctl "$LEGENDCTL" --data "$DATA" --work "$WORK" \
    --epochs "${EPOCHS:-10}" --negatives "${NEG:-1000}" --batch-size "${BATCH:-1000}" "$@"
