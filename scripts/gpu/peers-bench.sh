#!/usr/bin/env bash
# Epoch time on the GPU against PyTorch Geometric (torch_geometric.nn.kge.ComplEx) and PyKEEN
# (issue 5), ComplEx on wordnet-rr with the same settings, every system's final embeddings
# scored by Legend's filtered evaluator (benchmarks/baselines/compare_gpu.py says what runs).
#
# Runs on the GPU machine (python3 with torch and torch_geometric, NVRTC, no network) from the
# folder scripts/gpu/peers-prepare.sh made, carried with the run:
#   here:  scripts/gpu/peers-prepare.sh /path/to/checkout/target-gpu-peers
#   there: bash target-gpu-peers/scripts/gpu/peers-bench.sh        (carry ["target-gpu-peers"])
# Installs the carried wheels (PyKEEN) into python3's environment (into /tmp/peers-site when
# that is read-only), then runs compare_gpu.py (versions: its output's first lines). Knobs (environment): EPOCHS (default 3), NEG
# (K, default 1000), BATCH (1000), DATASET (a folder under DIR/data, default wordnet-rr),
# SYSTEMS (legend,pyg,pyg-k,pykeen), PEER_TIMEOUT (seconds for each peer's training, default
# 240); extra arguments go to compare_gpu.py. Writes peers.json, peers.log and runs.tgz (every
# run's log) under ${OUT:-DIR/out}.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$root/out}
work=${PEERS_WORK:-/tmp/peers-work}
mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
dataset=$root/data/${DATASET:-wordnet-rr}
source "$root/scripts/gpu/nvrtc-env.sh"
if ! python3 -m pip install -q --no-index --no-cache-dir --find-links "$root/whl" pykeen==1.11.1; then
    echo "installing into python3's environment failed: using /tmp/peers-site" >&2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/peers-site "$root"/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}
fi
# Legend's kernels, compiled by NVRTC for this GPU beforehand, if DIR/kernel-cache holds them
# (a copy of a machine's ~/.cache/legend/kernels: the key covers sources, options and NVRTC
# version, so a stale file is never used); otherwise legendctl compiles them at start (10 s).
[ -d "$root/kernel-cache" ] && mkdir -p "${XDG_CACHE_HOME:-$HOME/.cache}/legend/kernels" &&
    cp -r "$root/kernel-cache/." "${XDG_CACHE_HOME:-$HOME/.cache}/legend/kernels/"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
status=0
PYTHONUNBUFFERED=1 python3 "$root/benchmarks/baselines/compare_gpu.py" --legendctl "$root/legendctl" \
    --dataset "$dataset" --work "$work" --json-out "$out/peers.json" \
    --legend-commit "$(cat "$root/COMMIT" 2>/dev/null)" --epochs "${EPOCHS:-3}" \
    --negatives "${NEG:-1000}" --batch-size "${BATCH:-1000}" --systems "${SYSTEMS:-legend,pyg,pyg-k,pykeen}" \
    --timeout "${PEER_TIMEOUT:-240}" "$@" 2>&1 | tee "$out/peers.log" || status=1
tar czf "$out/runs.tgz" -C "$work" --exclude='*.npy' --exclude='*.bin' . 2>/dev/null
exit $status
