#!/usr/bin/env bash
# The main job: train ComplEx on a small real knowledge graph with the embedded defaults (CPU
# engine, in-memory store; 200 epochs, d = 200) and print its filtered test MRR and Hits@10.
#
# Usage: scripts/main-job.sh [umls|kinships|nations] [extra `legendctl train` arguments...]
# The data comes from the pykeen==1.11.1 wheel on PyPI (MIT), cached in ~/.cache/legend.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
name=${1:-umls}
shift || true
case "$name" in umls | kinships | nations) ;; *) echo "unknown dataset $name: expected umls, kinships or nations" >&2; exit 2 ;; esac
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
work=${LEGEND_WORK:-$cache/main-job}
mkdir -p "$cache/wheels" "$work"

# Cargo's own progress (a bar on a terminal, a line per crate elsewhere): the first build has
# 180 steps, 3.5 minutes on an idle 2-core machine (up to 8 on a busy one); later runs, seconds.
echo "== building legendctl (release; the first build takes 4 to 8 minutes on 2 cores)"
cargo build --release --locked -p legendctl --manifest-path "$root/Cargo.toml"
bin=${CARGO_TARGET_DIR:-$root/target}/release/legendctl

wheel=$cache/wheels/pykeen-1.11.1-py3-none-any.whl
raw=$work/raw/$name
if [ ! -s "$raw/train.txt" ]; then
  if [ ! -s "$wheel" ]; then
    echo "== downloading the pykeen 1.11.1 wheel (for its bundled datasets)"
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
fi

dataset=$work/datasets/$name
if [ ! -f "$dataset/dataset.toml" ]; then
  echo "== importing $name"
  "$bin" import -o "$dataset" --train "$raw/train.txt" --valid "$raw/valid.txt" --test "$raw/test.txt"
fi

run=$work/runs/$name-complex-$(date +%Y%m%d-%H%M%S)
echo "== training ComplEx on $name (defaults; run directory $run)"
"$bin" train --dataset "$dataset" --out "$run" --set model.decoder=complex --set training.num_epochs=200 "$@"
