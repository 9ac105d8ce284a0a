#!/usr/bin/env bash
# The Python package on a GPU machine (which has Python 3.12 and PyTorch but no Rust toolchain and
# no network): `build` here makes target-gpu-python/ (carry it): the package's release wheel
# (abi3: it loads on 3.12), the cp312 wheels it needs beyond the machine's own packages, and UMLS.
# `run` there makes a virtual environment over the machine's packages (torch, numpy), installs
# from the carried wheels only, and runs the GPU tests (training on cuda:0 from Python, queries on
# the GPU against the CPU's answers) with the torch interop test.
#   scripts/gpu/python-gpu.sh build          # here
#   scripts/gpu/python-gpu.sh run            # on the GPU machine; logs in ${OUT:-target-gpu-python/out}
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=${LEGEND_GPU_PYTHON:-$root/target-gpu-python}
case "${1:-}" in
build)
  venv=${LEGEND_CACHE:-$HOME/.cache/legend}/python/venv-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ -x "$venv/bin/maturin" ] || { echo "run scripts/python-test.sh first (it makes $venv)" >&2; exit 1; }
  rm -rf "$carry" && mkdir -p "$carry/wheels" "$carry/cache/python-test/raw"
  CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target} "$venv/bin/maturin" build --release --locked \
    --manifest-path "$root/python/Cargo.toml" --compatibility linux --auditwheel skip --strip \
    --interpreter "$venv/bin/python" --out "$carry/wheels"
  "$venv/bin/python" -m pip --disable-pip-version-check download --quiet --dest "$carry/wheels" \
    --only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    numpy==2.4.6 pandas==3.1.1 tqdm==4.70.1 pytest==9.2.0
  "$root/scripts/pykeen-graph.sh" umls "$carry/cache/python-test/raw/umls"
  du -sh "$carry"
  ;;
run)
  out=${OUT:-$carry/out}
  mkdir -p "$out"
  venv=$carry/venv
  python3 -m venv --system-site-packages "$venv"
  # The machine's python3 may itself be a virtual environment (torch in /opt/torch/.venv):
  # --system-site-packages reaches only its base interpreter's, so its packages are added.
  outer=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  inner=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  [ "$outer" != "$inner" ] && echo "$outer" >"$inner/machine-packages.pth"
  "$venv/bin/python" -m pip --disable-pip-version-check install --quiet --no-index \
    --find-links "$carry/wheels" legend pytest
  nvidia-smi -L | tee "$out/python-gpu.log"
  LEGEND_CACHE=$carry/cache "$venv/bin/python" -m pytest "$root/python/tests/test_gpu.py" \
    "$root/python/tests/test_tables.py::test_torch_embedding_weights_are_the_tables" -v \
    -p no:cacheprovider 2>&1 | tee -a "$out/python-gpu.log"
  ;;
*)
  echo "usage: $0 build|run" >&2
  exit 2
  ;;
esac
