#!/usr/bin/env bash
# The GPU-kernel parts of issue 29 in one call on the GPU machine (no Rust there; builds
# nothing): the tests of the kernels they touch, then the figures of Documentation/benchmarks.md,
# "The step's kernels and the I/O kernels (issue 29)". PHASES picks phases, in this order:
#   tests   legend-cuda's GPU tests (kernels, I/O kernels, pipeline) and the trainer's GPU tests
#           (TESTS names the binaries);
#   ab      batch_bench's step, builds alternated (compare-builds.sh): BASELINES (folders of
#           other builds' batch_bench, e.g. from before issue 31 and from main, or BUILD@KERNELS
#           for kernel variants) against this build, element-wise f32 rows, and this build with
#           the row layouts of ROWS;
#   extra   the same builds (those that know LEGEND_BENCH_EXTRA: EXTRA_BUILDS) training ComplEx
#           with reciprocal relations and N3 (legend_rows_backward_extra);
#   io      the step beside the I/O kernels reading a file through the proxy (the paper's
#           Fig. 9): one modelled Samsung 980 on tmpfs and the machine's disk, 8 queue pairs,
#           IO_BASELINE (default: BASELINES' first build) and this one (and this one with
#           IO_THREADS threads a block, and with 2 queue pairs);
#   striped `legendctl bench io --submitter gpu` over one and two modelled Samsung 980s (one
#           GpuIo member a proxy), reads and writes;
#   epoch   legendctl train in GPU memory, ROWS_EPOCH formats (scripts/gpu/ssd-model-bench.sh).
# KERNELS, if set, is the LEGEND_KERNELS_DIR of the tests and epoch phases (kernel sources newer
# than some of the binaries). Binaries in ${LEGEND_GPU_BIN:-target-gpu}
# (scripts/gpu/build-binaries.sh); logs under
# ${OUT:-$bin/out}, all of them in kern-logs.tar.gz, and a summary printed last.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
phases=${PHASES:-tests ab extra io striped epoch}
baselines=${BASELINES:-}
rows=${ROWS:-element,element/bf16,row,row/bf16}
io_threads=${IO_THREADS:-64}
logs=/tmp/legend-kern-logs
rm -rf "$logs" && mkdir -p "$logs" "$out"
source "$root/scripts/gpu/nvrtc-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader |
    tee "$logs/hw.txt"
summary=$logs/summary.txt
: >"$summary"
status=0
note() { echo "$*" | tee -a "$summary"; }
has() { [[ " $phases " == *" $1 "* ]]; }

if has tests; then
    for t in ${TESTS:-gpu nvme_io pipeline legend_cuda gpu_trainer}; do
        [ -x "$bin/test-$t" ] || continue
        start=$SECONDS
        LEGEND_KERNELS_DIR=${KERNELS:-} timeout "${TEST_TIMEOUT:-300}" "$bin/test-$t" \
            --include-ignored --test-threads=1 --nocapture >"$logs/test-$t.log" 2>&1
        code=$?
        [ $code -eq 0 ] || status=1
        note "test-$t: exit $code in $((SECONDS - start)) s; $(grep -E '^test result' "$logs/test-$t.log" | tail -1)"
        grep -E '^test .*FAILED|panicked' "$logs/test-$t.log" | head -5 | tee -a "$summary"
    done
    # The figures the new tests print.
    grep -E 'rows in place|striped read' "$logs"/test-*.log | cut -c1-400 | tee -a "$summary"
fi

if has ab; then
    start=$SECONDS
    builds=()
    for b in $baselines; do builds+=("$b"); done
    OUT=$logs/ab LEGEND_BENCH_ROWS=$rows ROUNDS=${ROUNDS:-2} \
        bash "$root/scripts/gpu/compare-builds.sh" "${builds[@]}" "$bin" >"$logs/ab.txt" 2>&1 ||
        status=1
    note "== ab in $((SECONDS - start)) s (builds: ${builds[*]} $bin)"
    tee -a "$summary" <"$logs/ab.txt"
fi

if has extra; then
    start=$SECONDS
    builds=()
    for b in ${EXTRA_BUILDS:-}; do builds+=("$b"); done
    OUT=$logs/extra LEGEND_BENCH_EXTRA=1 LEGEND_BENCH_DECODERS=complex \
        LEGEND_BENCH_ROWS=element,element/bf16 ROUNDS=${ROUNDS:-2} \
        bash "$root/scripts/gpu/compare-builds.sh" "${builds[@]}" "$bin" >"$logs/extra.txt" 2>&1 ||
        status=1
    note "== extra in $((SECONDS - start)) s (builds: ${builds[*]} $bin)"
    tee -a "$summary" <"$logs/extra.txt"
fi

# Steps beside the I/O kernels: `batch_bench` of build $1 with its I/O on file $2 (model $3,
# queue pairs $4, threads a block $5), one line a decoder.
beside() {
    local build=$1 file=$2 model=$3 queues=$4 threads=$5
    local name
    name=io-$(basename "$build")-$(basename "$file")-${model:-none}-q$queues-t$threads
    env LEGEND_BENCH_GROUPS=20 LEGEND_BENCH_BESIDE_IO="$file" LEGEND_BENCH_IO_QUEUES="$queues" \
        LEGEND_BENCH_IO_THREADS="$threads" ${model:+LEGEND_BENCH_IO_MODEL=$model} \
        timeout 300 "$build/batch_bench" "$logs/$name.jsonl" >"$logs/$name.log" 2>&1 || status=1
    python3 - "$logs/$name.jsonl" "$name" <<'PY' | tee -a "$summary"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    a, b = r["median_ms"], r["median_ms_beside_io"]
    print(f"{sys.argv[2]:44s} {r['decoder']:8s} {a:.4f} -> {b:.4f} ms ({100 * (b / a - 1):+.1f}%), "
          f"I/O kept {r['io_gb_per_s_beside']:.2f} GB/s")
PY
}

if has io; then
    start=$SECONDS
    shm=/dev/shm/legend-io.img disk=/var/tmp/legend-io.img
    # Real blocks on the disk (holes would be read without it); tmpfs serves the model.
    truncate -s 1G "$shm"
    dd if=/dev/zero of="$disk" bs=8M count=128 oflag=direct status=none
    base=${IO_BASELINE:-${baselines%% *}}
    for build in $base "$bin"; do
        beside "$build" "$shm" samsung-980 8 256
        beside "$build" "$disk" "" 8 256
    done
    beside "$bin" "$shm" samsung-980 8 "$io_threads"
    beside "$bin" "$shm" samsung-980 2 256
    rm -f "$shm" "$disk"
    note "== io in $((SECONDS - start)) s"
fi

if has striped; then
    start=$SECONDS
    a=/dev/shm/legend-a.img b=/dev/shm/legend-b.img
    truncate -s 4G "$a" "$b"
    for op in read write; do
        for paths in "--path $a" "--path $a --path $b"; do
            # shellcheck disable=SC2086
            timeout 120 "$bin/legendctl" bench io --backend proxy --submitter gpu \
                --ssd-model samsung-980 $paths --op "$op" --size 1048576 --queues 4 \
                --depth 64 --seconds 3 --json >"$logs/striped.json" 2>"$logs/striped.err" ||
                { status=1; tail -3 "$logs/striped.err"; }
            python3 - "$logs/striped.json" "$op" <<'PY' | tee -a "$summary"
import json, sys
r = json.load(open(sys.argv[1]))
t = ", ".join(f"{x['gb_per_s']:.3f}" for x in r["targets"])
print(f"bench io gpu {sys.argv[2]:5s} {len(r['targets'])} modelled 980: {r['gb_per_s']:.3f} GB/s "
      f"(targets {t}), p50 {r['latency_us']['p50']:.0f} us")
PY
        done
    done
    rm -f "$a" "$b"
    note "== striped in $((SECONDS - start)) s"
fi

if has epoch; then
    start=$SECONDS
    OUT=$logs LEGEND_GPU_BIN=$bin LAYOUTS=memory STATES=${ROWS_EPOCH:-row row/bf16} \
        LEGEND_KERNELS_DIR=${KERNELS:-} \
        timeout "${EPOCH_TIMEOUT:-300}" bash "$root/scripts/gpu/ssd-model-bench.sh" \
        >"$logs/epoch.txt" 2>&1 || status=1
    note "== epoch in $((SECONDS - start)) s"
    grep -E 'generated|epoch|FAILED' "$logs/epoch.txt" | tee -a "$summary"
fi

tar czf "$out/kern-logs.tar.gz" -C "$logs" . || status=1
cp "$summary" "$out/summary.txt"
echo "== summary"
cat "$summary"
exit $status
