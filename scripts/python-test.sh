#!/usr/bin/env bash
# The Python package's tests (python/tests, pytest) as CI runs them: a virtual environment under
# $LEGEND_CACHE/python (~/.cache/legend), made once and kept while python/requirements-test.txt
# is unchanged, its packages installed from wheels fetched from PyPI into the cache (nothing is
# installed on the machine); the extension built by maturin in the workspace's target directory
# in the dev profile, installed into it as a wheel; legendctl and legendd built (dev) for the
# tests that compare with them. A warm run (cached environment and target) takes about a minute
# on 2 cores. Extra arguments go to pytest (e.g. -k predict).
# Where the environment cannot be made (no Python 3.11 or later, no venv module, PyPI out of
# reach with wheels missing from the cache) the tests are skipped, saying why, with exit status
# 77, which scripts/test.sh reports as a skipped stage.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${LEGEND_CACHE:-$HOME/.cache/legend}
python=${PYTHON:-python3}
skip() {
  echo "python: skipped: $*" >&2
  exit 77
}
command -v "$python" >/dev/null || skip "no $python on PATH (PYTHON names another interpreter)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  skip "$python is $("$python" --version 2>&1); the package needs Python 3.11 or later"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv=$cache/python/venv-$version
wheels=$cache/python/wheels
requirements=$root/python/requirements-test.txt
mkdir -p "$cache/python"
# Two runs share the cache: one makes the environment while the other waits.
exec 9>"$cache/python/.lock"
flock 9
if ! cmp -s "$requirements" "$venv/requirements-test.txt" 2>/dev/null; then
  echo "== making the virtual environment $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv" || { rm -rf "$venv"; skip "$python -m venv failed (no venv/ensurepip module)"; }
  pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
  # From the cache alone when it has every wheel; else fetched into it first.
  if ! "${pip[@]}" install --no-index --find-links "$wheels" -r "$requirements" 2>/dev/null; then
    echo "== fetching wheels from PyPI into $wheels"
    if ! "${pip[@]}" download --dest "$wheels" --only-binary :all: -r "$requirements"; then
      rm -rf "$venv"
      skip "the wheels of $requirements are not all in $wheels and PyPI did not provide them"
    fi
    "${pip[@]}" install --no-index --find-links "$wheels" -r "$requirements"
  fi
  cp "$requirements" "$venv/requirements-test.txt"
fi
flock -u 9

target=${CARGO_TARGET_DIR:-$root/target}
export CARGO_TARGET_DIR=$target
cd "$root"
cargo build --locked -q -p legendctl -p legendd
echo "== building the extension (maturin, dev profile, $target)"
rm -rf "$target/wheels/python-test"
"$venv/bin/maturin" build --quiet --locked --profile dev --manifest-path python/Cargo.toml \
  --interpreter "$venv/bin/python" --compatibility linux --auditwheel skip \
  --out "$target/wheels/python-test"
"$venv/bin/python" -m pip --disable-pip-version-check --quiet install --no-index --no-deps \
  --force-reinstall "$target"/wheels/python-test/legend-*.whl
LEGENDCTL=$target/debug/legendctl LEGENDD=$target/debug/legendd \
  "$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider "$@"
