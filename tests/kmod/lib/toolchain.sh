# shellcheck shell=bash
# Prepares everything the kmod selftests need, from nothing, with results cached under
# $LEGEND_CACHE (default ~/.cache/legend). Nothing is installed on or removed from the machine:
#   - host build and test tools (flex, bison, libelf headers, busybox, QEMU, kmod, dkms) are
#     downloaded from the machine's own Debian release through a private apt configuration and
#     unpacked into $CACHE/host; only packages the machine lacks are fetched;
#   - Debian's stock kernel image/headers/source and the exact rustc/bindgen that built it are
#     downloaded the same way (trixie) and unpacked into $CACHE/prefix;
#   - a kernel tree is prepared with that compiler, so Rust modules link against the stock
#     kernel's exports.
# First run: about 560 MB downloaded, about 4.5 GB of disk in the cache, 4-6 minutes on 2 cores.
# Callers hold `cache_lock` while they prepare or use the cache, so concurrent runs queue.
# Sourced by tests/kmod/run and dkms/build.sh; defines variables and functions only.

KVER=${LEGEND_KVER:-7.3.4+deb13-amd64}
KPKGVER=${LEGEND_KPKGVER:-7.3.4-1~bpo13+1}
RUSTPKGVER=${LEGEND_RUSTPKGVER:-1.85.1+dfsg1-1+deb13u1}
NVPKGVER=${LEGEND_NVPKGVER:-550.163.01-2}
CACHE=${LEGEND_CACHE:-$HOME/.cache/legend}
DEBS=$CACHE/debs
PREFIX=$CACHE/prefix
HOST=$CACHE/host
KSRC=$CACHE/linux-source-7.3
KBUILD=$CACHE/kbuild-$KVER
TOOLS=$CACHE/bin
# The host tools' wrappers, apart from $TOOLS (whose rustc must not shadow the user's).
HOSTBIN=$CACHE/host-bin
MIRROR=${LEGEND_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECMIRROR=${LEGEND_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

log() { printf '[toolchain] %s\n' "$*" >&2; }
die() { printf '[toolchain] error: %s\n' "$*" >&2; exit 1; }

# cache_lock: serialises every user of the cache (two test runs at once would otherwise rebuild
# the same tree under each other). Held until the calling shell exits.
cache_lock() {
    # A child of the holder (dkms build run by tests/kmod/run) must not wait for its parent.
    [ "${LEGEND_CACHE_LOCKED:-}" = "$CACHE" ] && return 0
    mkdir -p "$CACHE"
    exec {LEGEND_LOCK_FD}>"$CACHE/.lock"
    if ! flock -n "$LEGEND_LOCK_FD"; then
        log "waiting for another run that holds $CACHE/.lock"
        flock "$LEGEND_LOCK_FD"
    fi
    export LEGEND_CACHE_LOCKED=$CACHE
}

# Private apt: own sources list, lists and cache; the system configuration is untouched.
APT_DIR=$CACHE/apt
apt_private() {
    apt-get -q -o Dir::Etc::sourcelist="$APT_DIR/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
        -o Dir::State::Lists="$APT_DIR/lists" -o Dir::Cache="$APT_DIR/cache" \
        -o Dir::Etc::preferences=/dev/null -o Dir::Etc::preferencesparts=/nonexistent \
        -o APT::Sandbox::User=root -o Debug::NoLocking=1 -o APT::Get::AllowUnauthenticated=false "$@"
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

# Host tools, from the machine's own Debian release (so they run on its glibc); QEMU from that
# release's backports (the plain release's QEMU may conflict with a backported qemu-utils).
host_release() {
    local id='' codename=''
    if [ -r /etc/os-release ]; then
        # shellcheck disable=SC1091
        id=$(. /etc/os-release && echo "${ID:-}")
        # shellcheck disable=SC1091
        codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    fi
    [ "$id" = debian ] && [ -n "$codename" ] \
        || die "the selftests fetch their tools from Debian's archive: this machine is '${id:-unknown}' (need Debian 12 or later)"
    echo "$codename"
}

HOST_PKGS=(flex bison m4 libelf-dev busybox-static cpio kmod)

# host_tools: downloads what of HOST_PKGS (and QEMU) the machine lacks, resolved against its own
# dpkg status, unpacks it into $HOST and writes wrappers for the tools into $HOSTBIN.
host_tools() {
    if [ ! -f "$HOST/.extracted" ]; then
        local rel
        rel=$(host_release)
        local APT_DIR=$CACHE/apt-$rel k=/usr/share/keyrings/debian-archive-keyring.gpg
        mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$CACHE/host-debs"
        cat >"$APT_DIR/sources.list" <<SRC
deb [signed-by=$k] $MIRROR $rel main
deb [signed-by=$k] $MIRROR $rel-updates main
deb [signed-by=$k] $MIRROR $rel-backports main
deb [signed-by=$k] $SECMIRROR $rel-security main
SRC
        log "apt update ($rel, private lists)"
        apt_private update >&2 || die "private apt update ($rel) failed"
        # A simulated install against the machine's dpkg status lists exactly the packages (and
        # versions) it lacks; nothing is installed.
        local sim specs=() v f
        sim=$(apt_private -s install --no-install-recommends -t "$rel-backports" "${HOST_PKGS[@]}" qemu-system-x86 2>&1) \
            || { echo "$sim" >&2; die "cannot resolve the host tools from $rel"; }
        mapfile -t specs < <(sed -n 's/^Inst \([^ ]*\) \(\[[^]]*\] \)\?(\([^ ]*\) .*/\1=\3/p' <<<"$sim")
        # libelf-dev's libelf.so points at libelf.so.1, which must sit beside it in $HOST.
        v=$(printf '%s\n' "${specs[@]}" | sed -n 's/^libelf-dev=//p')
        [ -n "$v" ] && specs+=("libelf1=$v")
        # dkms is a shell script; what it runs (make, the compiler) is what the build uses anyway.
        specs+=(dkms)
        log "downloading host tools: ${specs[*]}"
        (cd "$CACHE/host-debs" && apt_private download "${specs[@]}" >&2) || die "download of host tools failed"
        rm -rf "$HOST" && mkdir -p "$HOST"
        for f in "$CACHE"/host-debs/*.deb; do dpkg-deb -x "$f" "$HOST"; done
        touch "$HOST/.extracted"
    fi
    write_host_wrappers
}

# Wrappers that run the private host tools; kmake and the runner put $HOSTBIN first in PATH.
write_host_wrappers() {
    mkdir -p "$HOSTBIN"
    local lib=$HOST/usr/lib/x86_64-linux-gnu t bin
    local env="LD_LIBRARY_PATH=$lib:$HOST/lib/x86_64-linux-gnu"
    for t in flex m4 cpio; do
        bin=$(compgen -G "$HOST/usr/bin/$t" || compgen -G "$HOST/bin/$t" || command -v "$t") \
            || die "host tool $t missing after unpacking (see $HOST)"
        printf '#!/bin/sh\nexec env %s %s "$@"\n' "$env" "$bin" >"$HOSTBIN/$t"
    done
    bin=$(compgen -G "$HOST/usr/bin/bison" || command -v bison) || die "host tool bison missing (see $HOST)"
    printf '#!/bin/sh\nexport BISON_PKGDATADIR=%s M4=%s\nexec %s "$@"\n' \
        "$HOST/usr/share/bison" "$HOSTBIN/m4" "$bin" >"$HOSTBIN/bison"
    # libelf's headers and libelf.so (objtool, resolve_btfids) for the kernel's host programs.
    printf '#!/bin/sh\nexec gcc -I%s/usr/include "$@" -L%s -Wl,-rpath,%s\n' "$HOST" "$lib" "$lib" >"$HOSTBIN/hostcc"
    bin=$(compgen -G "$HOST/bin/kmod" || compgen -G "$HOST/usr/bin/kmod" || command -v kmod) \
        || die "host tool kmod missing (see $HOST)"
    for t in depmod modprobe modinfo; do
        printf '#!/bin/bash\nexport %s\nexec -a %s %s "$@"\n' "$env" "$t" "$bin" >"$HOSTBIN/$t"
    done
    bin=$(compgen -G "$HOST/bin/busybox" || command -v busybox) || die "host tool busybox missing (see $HOST)"
    ln -sf "$bin" "$HOSTBIN/busybox"
    bin=$(compgen -G "$HOST/usr/bin/qemu-system-x86_64" || command -v qemu-system-x86_64) \
        || die "qemu-system-x86_64 missing (see $HOST)"
    printf '#!/bin/sh\nexec env %s %s -L %s -L %s "$@"\n' "$env" "$bin" \
        "$HOST/usr/share/seabios" "$HOST/usr/share/qemu" >"$HOSTBIN/qemu-system-x86_64"
    bin=$(compgen -G "$HOST/usr/sbin/dkms" || command -v dkms) || die "dkms missing (see $HOST)"
    ln -sf "$bin" "$HOSTBIN/dkms"
    chmod +x "$HOSTBIN"/*
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
    PATH=$TOOLS:$HOSTBIN:$PATH make -C "$KSRC" O="$KBUILD" ARCH=x86_64 CC=gcc HOSTCC="$HOSTBIN/hostcc" \
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
