# Sourced by run-pykeen.sh / run-pbg.sh: a Python venv with the baselines, and legendctl.
# Everything installed lives under $CACHE (default ~/.cache/legend/baselines), outside the repo.
#   in:  HERE (this directory), ROOT (repository root)
#   out: PY (venv python), LEGENDCTL (binary), CACHE
CACHE=${LEGEND_BASELINES_CACHE:-$HOME/.cache/legend/baselines}
mkdir -p "$CACHE"
export PIP_CACHE_DIR="$CACHE/pip"
# Pins: PyKEEN 1.11.1 needs torch >= 2.0; PBG 1.0.0 (pure Python) runs on torch 2.4.1 too.
# PyPI's Linux x86-64 torch wheel is the CUDA build (~0.8 GB + ~2.5 GB of nvidia-* wheels);
# PyPI has no CPU-only Linux torch, so that is what gets installed; it runs on CPU here.
PINS=(torch==2.4.1 pykeen==1.11.1 torchbiggraph==1.0.0 "numpy<2" h5py)
if [ ! -x "$CACHE/venv/bin/python" ] || ! "$CACHE/venv/bin/python" -c 'import torch, pykeen, torchbiggraph, h5py' 2>/dev/null; then
    echo "== installing ${PINS[*]} into $CACHE/venv" >&2
    python3 -m venv "$CACHE/venv"
    nice -n 10 "$CACHE/venv/bin/pip" install -q "${PINS[@]}"
fi
PY="$CACHE/venv/bin/python"
if [ -z "${LEGENDCTL:-}" ]; then
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$CACHE/target}
    echo "== building legendctl (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)" >&2
    (cd "$ROOT" && nice -n 10 cargo build --release -q -p legendctl)
    LEGENDCTL="$CARGO_TARGET_DIR/release/legendctl"
fi
export PY LEGENDCTL CACHE
