#!/usr/bin/env bash
# Puts the train/valid/test splits of a small knowledge graph bundled in the pykeen 1.11.1 wheel
# (PyPI, MIT) into a directory, downloading the wheel once into $LEGEND_CACHE/wheels.
# Usage: scripts/pykeen-graph.sh umls|kinships|nations OUT_DIR
set -euo pipefail
name=$1
raw=$2
case "$name" in umls | kinships | nations) ;; *) echo "unknown dataset $name: expected umls, kinships or nations" >&2; exit 2 ;; esac
[ -s "$raw/train.txt" ] && exit 0
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
wheel=$cache/wheels/pykeen-1.11.1-py3-none-any.whl
if [ ! -s "$wheel" ]; then
  echo "== downloading the pykeen 1.11.1 wheel (for its bundled datasets)"
  mkdir -p "$cache/wheels"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip download --quiet --no-deps --dest "$cache/wheels" pykeen==1.11.1
fi
mkdir -p "$raw"
python3 - "$wheel" "$name" "$raw" <<'PY'
import sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for split in ("train", "valid", "test"):
        with open(f"{out}/{split}.txt", "wb") as f:
            f.write(z.read(f"pykeen/datasets/{name}/{split}.txt"))
PY
