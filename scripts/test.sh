#!/usr/bin/env bash
# The whole test suite: formatting, lints, the workspace's unit and integration tests, the Python
# package's tests (pytest, in a virtual environment under the cache), the kernel module's
# selftests in QEMU, and (when present) the NVRTC compile check of the CUDA kernels.
# Every stage runs even if an earlier one failed; the last line is `test-suites: N passed, M failed`.
# Tests that need a GPU are reported as ignored (skipped) without one; scripts/gpu/run-all.sh runs
# them on a GPU machine. A stage that prints nothing for 9 s says so (`... NAME: working, N s`),
# so that a log never stalls silently (a long compile, QEMU booting). 41 minutes on a 2-core
# machine shared with other builds, from a nearly empty target/, the kmod toolchain cached
# (README.md says what each stage took).
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
source scripts/lib/heartbeat.sh

passed=0
failed=0
failures=()
skipped=()
# A stage that exits with 77 could not run here (it said why): reported as skipped, not failed.
stage() {
  local name=$1
  shift
  echo "=== $name: $*"
  local start=$SECONDS status=0
  HEARTBEAT=always heartbeat "$name" "$@" || status=$?
  if [ "$status" -eq 0 ]; then
    passed=$((passed + 1))
    echo "=== $name: ok ($((SECONDS - start)) s)"
  elif [ "$status" -eq 77 ]; then
    skipped+=("$name")
    echo "=== $name: skipped ($((SECONDS - start)) s)"
  else
    failed=$((failed + 1))
    failures+=("$name")
    echo "=== $name: FAILED ($((SECONDS - start)) s)"
    return 1
  fi
}

stage fmt cargo fmt --all --check
stage clippy cargo clippy --workspace --all-targets --locked -- -D warnings
# The GPU tests are #[ignore]d (reported as skipped); where a GPU answers they run too.
gpu_tests=()
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  gpu_tests=(-- --include-ignored)
fi
# Runs the workspace's tests and says how many were skipped (the GPU tests, without a GPU).
cargo_tests() {
  local log status
  log=$(mktemp)
  cargo test --workspace --locked --no-fail-fast "${gpu_tests[@]}" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i + 1) ~ /^ignored/) n += $i }
       END { printf "cargo-test: %d tests skipped (ignored: they need a GPU)\n", n }' "$log"
  rm -f "$log"
  return "$status"
}
# The binaries the recipe and NVRTC stages run were built by cargo-test with the workspace's
# test features: given to them, they are not built again for other features (minutes). After a
# failed test stage they build their own (a failed compile would leave stale binaries here).
if stage cargo-test cargo_tests; then
  debug=${CARGO_TARGET_DIR:-$PWD/target}/debug
  export LEGENDCTL=$debug/legendctl LEGEND_NVRTC_CHECK=$debug/legend-nvrtc-check
fi
stage recipe scripts/recipe-check.sh
stage python scripts/python-test.sh
stage kmod-selftests tests/kmod/run
if [ -x scripts/gpu/nvrtc-check.sh ]; then
  stage nvrtc-compile scripts/gpu/nvrtc-check.sh
fi

[ "$failed" -eq 0 ] || echo "failed stages: ${failures[*]}"
[ "${#skipped[@]}" -eq 0 ] || echo "skipped stages: ${skipped[*]} (each said why above)"
echo "test-suites: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
