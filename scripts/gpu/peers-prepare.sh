#!/usr/bin/env bash
# Prepares, on a machine with Rust and PyPI, the folder that scripts/gpu/peers-bench.sh runs
# from on the GPU machine (which has no Rust toolchain, no network, no PyKEEN): legendctl,
# wordnet-rr imported, the PyKEEN 1.11.1 wheels and the dependencies its image lacks, and a copy
# of the scripts, under one folder that a run carries (about 15 MB).
#
#   scripts/gpu/peers-prepare.sh [DEST]      # DEST default: target-gpu-peers (ignored by git)
#   then, on the GPU machine, from the folder DEST is carried into:
#   bash DEST/scripts/gpu/peers-bench.sh
#
# DATA names another dataset (train.txt/valid.txt/test.txt); CARGO_TARGET_DIR the build folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=$(realpath -m "${1:-$root/target-gpu-peers}")
data=${DATA:-$root/../shared/datasets/wordnet-rr}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
# PyKEEN and what the GPU machine's image lacks of its dependencies (KINDS.md lists the image);
# pinned so that every run installs the same.
wheels=(pykeen==1.11.1 dataclasses-json==0.6.7 marshmallow==3.26.2 click-default-group==1.2.4
        optuna==5.0.0 alembic==1.20.1 sqlalchemy==2.1.9 mako==1.4.3 colorlog==6.12.0
        more-click==0.1.3 more-itertools==11.2.1 pystow==0.10.3 backports-zstd==1.8.0
        docdata==0.0.5 class-resolver==0.8.2 torch-max-mem==0.1.6 torch-ppr==0.0.8)

(cd "$root" && cargo build --release -p legendctl)
rm -rf "$dest" && mkdir -p "$dest/scripts/gpu" "$dest/benchmarks/baselines" "$dest/whl" "$dest/data"
cp "$CARGO_TARGET_DIR/release/legendctl" "$dest/" && strip "$dest/legendctl"
cp "$root/scripts/gpu/peers-bench.sh" "$root/scripts/gpu/nvrtc-env.sh" "$dest/scripts/gpu/"
cp "$root"/benchmarks/baselines/{legend_common,compare_pykeen,compare_gpu,pyg_train,pykeen_train}.py \
    "$dest/benchmarks/baselines/"
echo "$(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- . || echo -dirty)" >"$dest/COMMIT"
name=$(basename "$data")
"$dest/legendctl" import -o "$dest/data/$name" --train "$data/train.txt" --valid "$data/valid.txt" \
    --test "$data/test.txt" --json
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest/whl" "${wheels[@]}"
du -sh "$dest" && cat "$dest/COMMIT"
