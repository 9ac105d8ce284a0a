#!/usr/bin/env bash
# Builds legend_nvme for KERNELVER in DIR (DKMS's MAKE step).
# Uses /lib/modules/KERNELVER/build when its headers carry the Rust artifacts; otherwise (Debian)
# prepares a tree with the kernel's exact rustc through toolchain.sh, as the selftests do.
set -euo pipefail
kver=${1:?usage: build.sh KERNELVER DIR}
dir=${2:?usage: build.sh KERNELVER DIR}
build=/lib/modules/$kver/build
# NVIDIA's P2P header: the installed driver's sources; Kbuild says how to fix it if absent.
nvh=$(compgen -G "/usr/src/nvidia-*/nvidia/nv-p2p.h" | head -n1 || true)
if [ -f "$build/rust/libkernel.rmeta" ]; then
    exec make -C "$build" M="$dir" ${nvh:+NV_P2P_H="$nvh"} modules
fi
[ -f "$dir/toolchain.sh" ] || { echo "legend-nvme: $build lacks Rust artifacts and toolchain.sh is missing" >&2; exit 1; }
export LEGEND_KVER=$kver LEGEND_CACHE=${LEGEND_CACHE:-/var/cache/legend}
# shellcheck source=../tests/kmod/lib/toolchain.sh
source "$dir/toolchain.sh"
cache_lock
host_tools
fetch_all
prepare_tree
# Without an installed NVIDIA driver, the header of the prefix's nvidia-open-kernel-dkms.
nvh=${nvh:-$(compgen -G "$PREFIX/usr/src/nvidia-*/nvidia/nv-p2p.h" | head -n1)}
kmake M="$dir" NV_P2P_H="$nvh" modules
