#!/usr/bin/env bash
# Compiles every Legend CUDA kernel with NVRTC for sm_80, sm_90 and sm_90a (the fused kernels'
# wgmma path), without a GPU: installs the nvidia-cuda-nvrtc wheel (libnvrtc.so.13) into
# $LEGEND_CACHE/nvrtc (~/.cache/legend/nvrtc) when missing, builds legend-nvrtc-check and runs it. Exits non-zero on any compile error or warning.
# `--resources` also prints each kernel's registers and spills (ptxas's report).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# 13.0 matches the CUDA 13.0 driver of the GPU machines (newer NVRTC emits PTX it rejects).
version=${LEGEND_NVRTC_VERSION:-13.0.88}
prefix=${LEGEND_NVRTC_DIR:-${LEGEND_CACHE:-$HOME/.cache/legend}/nvrtc/$version}
lib=$prefix/nvidia/cu13/lib
if [ ! -e "$lib/libnvrtc.so.13" ]; then
    echo "installing nvidia-cuda-nvrtc==$version into $prefix"
    # Into a private directory, so pip's warning about running as root does not apply.
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --disable-pip-version-check --no-deps \
        --target "$prefix" "nvidia-cuda-nvrtc==$version"
fi
if [ ! -e "$lib/libnvrtc.so.13" ]; then
    echo "nvrtc-check: $lib/libnvrtc.so.13 missing after the install" >&2
    exit 1
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cd "$root"
# scripts/test.sh passes the binary its test stage built (LEGEND_NVRTC_CHECK), which a build
# here, resolving features for legend-cuda alone, would compile again with its dependencies.
check=${LEGEND_NVRTC_CHECK:-}
if [ -z "$check" ] || [ ! -x "$check" ]; then
    echo "== building legend-nvrtc-check"
    cargo build -p legend-cuda --bin legend-nvrtc-check
    check=$CARGO_TARGET_DIR/debug/legend-nvrtc-check
fi
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$check" "$@" sm_80 sm_90 sm_90a
