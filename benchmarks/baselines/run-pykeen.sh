#!/usr/bin/env bash
# Issue 3 §9: PyKEEN 1.11.1 vs Legend on wordnet-rr, same model/d/loss/negatives/optimizer/epochs,
# both scored by Legend's filtered evaluator. Prints a results table; writes $WORK/pykeen-results.json.
#
#   benchmarks/baselines/run-pykeen.sh            # defaults below
#   EPOCHS=3 NEG=32 LEGENDCTL=/path/legendctl benchmarks/baselines/run-pykeen.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/setup.sh"
WORK=${WORK:-$CACHE/work}
DATA=${DATA:-$ROOT/../shared/datasets/wordnet-rr}
exec nice -n 10 "$PY" "$HERE/compare_pykeen.py" --legendctl "$LEGENDCTL" --data "$DATA" --work "$WORK" \
    --epochs "${EPOCHS:-3}" --negatives "${NEG:-32}" --probe-edges "${PROBE_EDGES:-4000}" "$@"
