# shellcheck shell=bash
# Prepares everything the kmod selftests need, from nothing, with results cached
# under $LEGEND_CACHE (default ~/.cache/legend):
#   - host build tools (apt, --no-upgrade so unrelated packages stay put);
#   - Debian's stock kernel image/headers/source and the exact rustc/bindgen that
#     built it, downloaded through a private apt configuration and extracted into
#     a private prefix (the system's apt sources are never touched);
#   - a kernel tree prepared with that compiler, so Rust modules link against the
#     stock kernel's exports.
# Sourced by tests/kmod/run and dkms/prepare-rust.sh; defines variables and functions only.

KVER=${LEGEND_KVER:-7.3.4+deb13-amd64}
KPKGVER=${LEGEND_KPKGVER:-7.3.4-1~bpo13+1}
RUSTPKGVER=${LEGEND_RUSTPKGVER:-1.85.1+dfsg1-1+deb13u1}
NVPKGVER=${LEGEND_NVPKGVER:-550.163.01-2}
CACHE=${LEGEND_CACHE:-$HOME/.cache/legend}
DEBS=$CACHE/debs
PREFIX=$CACHE/prefix
KSRC=$CACHE/linux-source-7.3
KBUILD=$CACHE/kbuild-$KVER
TOOLS=$CACHE/bin
MIRROR=${LEGEND_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECMIRROR=${LEGEND_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

log() { printf '[toolchain] %s\n' "$*" >&2; }
die() { printf '[toolchain] error: %s\n' "$*" >&2; exit 1; }

host_tools() {
    local need=() p
    for p in make gcc libc6-dev bc flex bison libelf-dev libssl-dev busybox-static \
        xz-utils cpio qemu-system-x86; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
    done
    [ ${#need[@]} -eq 0 ] && return 0
    log "installing host tools: ${need[*]}"
    # --no-upgrade: installing test tools must not upgrade the machine's packages.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --no-upgrade "${need[@]}" >&2 \
        || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends --no-upgrade "${need[@]}" >&2; } \
        || die "apt-get install ${need[*]} failed"
}

# Private apt: own sources list, lists and cache; the system configuration is untouched.
APT_DIR=$CACHE/apt
apt_private() {
    apt-get -q -o Dir::Etc::sourcelist="$APT_DIR/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
        -o Dir::State::Lists="$APT_DIR/lists" -o Dir::Cache="$APT_DIR/cache" \
        -o Debug::NoLocking=1 -o APT::Get::AllowUnauthenticated=false "$@"
}

apt_private_update() {
    mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$DEBS"
    if [ -f "$APT_DIR/updated" ] && [ "${1:-}" != force ]; then return 0; fi
    local k=/usr/share/keyrings/debian-archive-keyring.gpg
    cat >"$APT_DIR/sources.list" <<SRC
deb [signed-by=$k] $MIRROR trixie main contrib
deb [signed-by=$k] $MIRROR trixie-backports main
deb [signed-by=$k] $SECMIRROR trixie-security main
SRC
    log "apt update (private lists)"
    apt_private update >&2 || die "private apt update failed"
    touch "$APT_DIR/updated"
}

# fetch PKG[=VER]...: downloads into $DEBS unless a matching .deb is cached.
fetch() {
    local spec name ver todo=()
    for spec in "$@"; do
        name=${spec%%=*}; ver=
        [[ $spec == *=* ]] && ver=${spec#*=}
        # Debian encodes ':' in versions as %3a in file names; none of ours carry an epoch.
        if compgen -G "$DEBS/${name}_${ver:-*}_*.deb" >/dev/null; then continue; fi
        todo+=("$spec")
    done
    [ ${#todo[@]} -eq 0 ] && return 0
    apt_private_update
    log "downloading ${todo[*]}"
    (cd "$DEBS" && apt_private download "${todo[@]}" >&2) || {
        apt_private_update force
        (cd "$DEBS" && apt_private download "${todo[@]}" >&2)
    } || die "download of ${todo[*]} failed (backports keep only the newest version:
    if $KPKGVER is gone, set LEGEND_KVER/LEGEND_KPKGVER to the current 7.3.x)"
}

extract() { # extract DIR PKG...
    local dir=$1 p f; shift
    mkdir -p "$dir"
    for p in "$@"; do
        f=$(compgen -G "$DEBS/${p}_*.deb" | head -n1) || die "no cached .deb for $p"
        dpkg-deb -x "$f" "$dir"
    done
}

RUST_LIBS=(libc6 libgcc-s1 libstdc++6 libedit2 libffi8 libxml2 libz3-4 libzstd1 zlib1g libbsd0 libtinfo6 libmd0 liblzma5 libicu76)

fetch_all() {
    fetch "linux-binary-$KVER=$KPKGVER" "linux-modules-$KVER=$KPKGVER" "linux-headers-$KVER=$KPKGVER" \
        "linux-headers-7.3.4+deb13-common=$KPKGVER" "linux-source-7.3=$KPKGVER" \
        "linux-kbuild-7.3.4+deb13=$KPKGVER" \
        "rustc=$RUSTPKGVER" "libstd-rust-1.85=$RUSTPKGVER" "libstd-rust-dev=$RUSTPKGVER" \
        "rust-src=$RUSTPKGVER" "rust-clippy=$RUSTPKGVER" bindgen libllvm19 libclang1-19 libclang-cpp19 \
        "nvidia-open-kernel-dkms=$NVPKGVER" "${RUST_LIBS[@]}"
}

# Wrapper scripts run trixie's tools through the private prefix's loader.
write_wrappers() {
    mkdir -p "$TOOLS"
    local lib=$PREFIX/usr/lib/x86_64-linux-gnu t
    for t in rustc rustdoc bindgen clippy-driver; do
        cat >"$TOOLS/$t" <<W
#!/bin/sh
export LIBCLANG_PATH=$PREFIX/usr/lib/llvm-19/lib
exec $lib/ld-linux-x86-64.so.2 --library-path $lib:$PREFIX/usr/lib/llvm-19/lib $PREFIX/usr/bin/$t "\$@"
W
        chmod +x "$TOOLS/$t"
    done
    # Kconfig probes pahole; Debian's value keeps DEBUG_INFO_BTF and what depends on it.
    printf '#!/bin/sh\n[ "$1" = --version ] && echo v1.30 && exit 0\nexit 1\n' >"$TOOLS/pahole"
    chmod +x "$TOOLS/pahole"
}

kmake() { # kmake ARGS... : make against the prepared tree with the matching toolchain
    PATH=$TOOLS:$PATH make -C "$KSRC" O="$KBUILD" ARCH=x86_64 CC=gcc HOSTCC=gcc \
        RUSTC="$TOOLS/rustc" HOSTRUSTC="$TOOLS/rustc" RUSTDOC="$TOOLS/rustdoc" \
        CLIPPY_DRIVER="$TOOLS/clippy-driver" \
        BINDGEN="$TOOLS/bindgen" PAHOLE="$TOOLS/pahole" KERNELRELEASE="$KVER" "$@"
}

HEADERS=$PREFIX/usr/src/linux-headers-$KVER

prepare_tree() {
    # Caches prepared before clippy was part of the toolchain get it added.
    if [ -f "$PREFIX/.extracted" ] && [ ! -x "$PREFIX/usr/bin/clippy-driver" ]; then
        extract "$PREFIX" rust-clippy
        write_wrappers
    fi
    if [ -f "$KBUILD/.legend-prepared" ]; then return 0; fi
    local t0=$SECONDS
    if [ ! -f "$PREFIX/.extracted" ]; then
        rm -rf "$PREFIX"
        extract "$PREFIX" "linux-binary-$KVER" "linux-modules-$KVER" "linux-headers-$KVER" "linux-headers-7.3.4+deb13-common" \
            "linux-kbuild-7.3.4+deb13" rustc libstd-rust-1.85 libstd-rust-dev rust-src rust-clippy bindgen libllvm19 \
            libclang1-19 libclang-cpp19 nvidia-open-kernel-dkms "${RUST_LIBS[@]}"
        touch "$PREFIX/.extracted"
    fi
    write_wrappers
    local want have
    want=$(sed -n 's/^CONFIG_RUSTC_VERSION_TEXT="\(.*\)"$/\1/p' "$HEADERS/.config")
    have=$("$TOOLS/rustc" --version)
    [ "$want" = "$have" ] || die "rustc is '$have' but $KVER was built with '$want'"
    if [ ! -f "$KSRC/Makefile" ]; then
        log "unpacking linux-source-7.3"
        rm -rf "$KSRC" "$CACHE/src.tmp" && mkdir -p "$CACHE/src.tmp"
        extract "$CACHE/src.tmp" linux-source-7.3
        tar -C "$CACHE" -xJf "$CACHE"/src.tmp/usr/src/linux-source-7.3.tar.xz
        rm -rf "$CACHE/src.tmp"
    fi
    rm -rf "$KBUILD" && mkdir -p "$KBUILD"
    cp "$HEADERS/.config" "$KBUILD/.config"
    kmake olddefconfig >&2
    grep -q '^CONFIG_RUST=y' "$KBUILD/.config" || die "CONFIG_RUST did not survive olddefconfig"
    diff <(grep '^CONFIG' "$HEADERS/.config" | sort) <(grep '^CONFIG' "$KBUILD/.config" | sort) \
        >"$KBUILD/config.diff" || true
    log "config differences vs Debian's (gcc capability symbols expected): $(grep -c '^[<>]' "$KBUILD/config.diff")"
    log "make modules_prepare (a few minutes)"
    kmake -j"$(nproc)" modules_prepare >&2
    cp "$HEADERS/Module.symvers" "$KBUILD/Module.symvers"
    touch "$KBUILD/.legend-prepared"
    log "tree prepared in $((SECONDS - t0)) s"
}
