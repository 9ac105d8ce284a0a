#!/usr/bin/env bash
# GPU-initiated NVMe I/O on the GPU machine, which has no SSD to bind: the CUDA I/O kernels
# drive queue pairs of Legend's userspace proxy controller over files. One call:
#  1. the I/O kernels' tests (legend-cuda/tests/nvme_io.rs): SQE bytes = the shared vectors,
#     partitions moved byte for byte both ways, injected errors reported, the timeout;
#  2. `legendctl bench io` side by side on the same file: io_uring (file), the proxy with CPU
#     submitters, the proxy with the GPU I/O kernels; on tmpfs (the queues' own cost) and on
#     the machine's disk;
#  2b. (LEGEND_DIRECT_ONLY=small) 4 KiB random reads into GPU memory on tmpfs: io_uring, the
#     I/O kernels with a CUDA copy a command, and with their staging slots over proxy threads,
#     proxy depth and queues;
#  3. the training step's time alone and beside the I/O kernels reading without pause (Fig. 9);
#  4. training with storage.backend = "proxy" on cuda:0, against the file backend on cuda:0:
#     UMLS quality (N = 4, C = 3) and a generated graph's epoch time (N = 8, C = 3).
# Builds nothing: expects target-gpu/ (scripts/gpu/build-binaries.sh) and UMLS imported into
# gpu-data/umls, both carried. Logs under ${OUT:-target-gpu/out}.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
data=${LEGEND_GPU_DATA:-$root/gpu-data}
out=${OUT:-$bin/out}
mkdir -p "$out"
source "$root/scripts/gpu/nvrtc-env.sh"
ctl=$bin/legendctl
status=0
only=" ${LEGEND_DIRECT_ONLY:-tests bench beside train} "
"$root/scripts/gpu/hardware.sh" | tee "$out/hw.txt"

if [[ $only == *" tests "* ]]; then
    echo "== GPU I/O kernel tests"
    "$bin/test-nvme_io" --include-ignored --test-threads=1 --nocapture 2>&1 | tee "$out/nvme-io-tests.log" || status=1
fi

if [[ $only == *" bench "* ]]; then
    echo "== bench io: io_uring vs proxy (CPU submitters) vs proxy (GPU I/O kernels)"
    secs=${LEGEND_BENCH_SECONDS:-4}
    for place in /dev/shm /var/tmp; do
        f=$place/legend-bench.img
        rm -f "$f"
        # 8 GiB of data that is really there (a sparse file reads as zeros without I/O).
        dd if=/dev/urandom of="$f" bs=64M count=128 status=none || { status=1; continue; }
        df -h "$place" | tail -1 | tee -a "$out/hw.txt"
        for spec in "seq read 1048576 8 16 64" "seq write 1048576 8 16 64" "rand read 4096 8 32 256"; do
            read -r pattern op size queues depth threads <<<"$spec"
            for who in "file cpu $depth" "proxy cpu $depth" "proxy gpu $threads"; do
                read -r backend submitter d <<<"$who"
                sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null
                "$ctl" bench io --backend "$backend" --submitter "$submitter" --path "$f" \
                    --pattern "$pattern" --op "$op" --size "$size" --queues "$queues" \
                    --depth "$d" --seconds "$secs" --json >>"$out/bench-io.jsonl" 2>>"$out/bench-io.err" \
                    || { echo "bench failed: $place $spec $who"; status=1; }
                tail -n 1 "$out/bench-io.jsonl" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print("%-9s %-6s %-4s %-5s %7d B  q%-2d d%-4d %8.3f GB/s %9.0f ops/s  p50 %8.1f us  p99 %8.1f us" % (
    sys.argv[1], r["backend"], r["submitter"], r["pattern"] + "-" + r["op"], r["request_bytes"],
    r["queues"], r["depth"], r["gb_per_s"], r["ops_per_s"], r["latency_us"]["p50"], r["latency_us"]["p99"]))
' "$place" | tee -a "$out/bench-io.txt"
            done
        done
        rm -f "$f"
    done
fi

if [[ $only == *" small "* ]]; then
    # Issue 32: 4 KiB random reads into GPU memory through the proxy on tmpfs, each command's
    # data through a CUDA copy (staging 0) against the I/O kernels' staging slots, over the
    # proxy's threads and depth and the kernels' queues.
    echo "== small random reads: io_uring vs the GPU I/O kernels, with and without staging"
    f=/dev/shm/legend-small.img
    dd if=/dev/urandom of="$f" bs=64M count=64 status=none || status=1
    secs=${LEGEND_BENCH_SECONDS:-3}
    small() {
        "$ctl" bench io --path "$f" --pattern rand --op read --size 4096 --seconds "$secs" --json "$@" \
            >>"$out/small-reads.jsonl" 2>>"$out/small-reads.err" || { echo "bench failed: $*"; status=1; return; }
        tail -n 1 "$out/small-reads.jsonl" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print("%-5s %-4s q%-3d d%-4d proxy threads %-4s depth %-5s staging %-5s %7.3f GB/s %9.0f ops/s  p50 %8.1f us  p99 %8.1f us" % (
    r["backend"], r["submitter"], r["queues"], r["depth"], r["proxy_threads"], r["proxy_depth"],
    r["staging_bytes"], r["gb_per_s"], r["ops_per_s"], r["latency_us"]["p50"], r["latency_us"]["p99"]))
' | tee -a "$out/small-reads.txt"
    }
    small --backend file --queues 8 --depth 32
    for q in "8 256" "16 256"; do
        read -r queues depth <<<"$q"
        small --backend proxy --submitter gpu --queues "$queues" --depth "$depth" --staging 0
    done
    for spec in "8 256 4 128" "8 256 8 256" "16 256 8 256" "16 256 8 1024" "32 128 8 1024" "16 256 12 1024"; do
        read -r queues depth threads pdepth <<<"$spec"
        small --backend proxy --submitter gpu --queues "$queues" --depth "$depth" \
            --proxy-threads "$threads" --proxy-depth "$pdepth"
    done
    rm -f "$f"
fi

if [[ $only == *" beside "* ]]; then
    echo "== training step alone and beside the GPU I/O kernels reading without pause"
    # tmpfs: the proxy as fast as it goes (several times an SSD); the disk: an SSD-like rate.
    for spec in "/dev/shm 8" "/dev/shm 4" "/dev/shm 2" "/var/tmp 8"; do
        read -r place q <<<"$spec"
        f=$place/legend-beside.img
        dd if=/dev/urandom of="$f" bs=64M count=64 status=none || { status=1; continue; }
        tag=$(basename "$place")-q$q
        LEGEND_BENCH_BESIDE_IO=$f LEGEND_BENCH_IO_QUEUES=$q LEGEND_BENCH_GROUPS=20 \
            LEGEND_BENCH_DECODERS=complex,dot "$bin/batch_bench" "$out/beside-$tag.jsonl" \
            2>"$out/beside-$tag.log" >/dev/null || status=1
        python3 - "$out/beside-$tag.jsonl" "$place" <<'PY' | tee -a "$out/beside.txt"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    slow = 100.0 * (r["median_ms_beside_io"] / r["median_ms"] - 1.0)
    print("%-8s %-8s step %.3f ms alone, %.3f ms beside I/O on %d queues (%+.1f%%), I/O kept %.2f GB/s" % (
        sys.argv[2], r["decoder"], r["median_ms"], r["median_ms_beside_io"], r["io_queues"], slow,
        r["io_gb_per_s_beside"]))
PY
        rm -f "$f"
    done
fi

if [[ $only == *" train "* ]]; then
    work=/dev/shm/legend-direct
    rm -rf "$work" && mkdir -p "$work"
    mrr() { python3 -c 'import json,sys; print("%.4f" % [json.loads(l) for l in open(sys.argv[1])][-1]["metrics"]["mrr"])' "$1/metrics.jsonl"; }
    echo "== UMLS ComplEx, 200 epochs, N = 4, C = 3 on cuda:0: file vs proxy (GPU I/O kernels)"
    for backend in file proxy; do
        run=$work/umls-$backend
        start=$(date +%s%N)
        "$ctl" train --dataset "$data/umls" --out "$run" --set training.num_epochs=200 \
            --set storage.num_partitions=4 --set storage.buffer_capacity=3 \
            --set "storage.backend=\"$backend\"" --set 'training.device="cuda:0"' \
            >"$out/umls-$backend.log" 2>&1 || status=1
        end=$(date +%s%N)
        printf 'umls complex ooc %-6s MRR %s  %d ms\n' "$backend" "$(mrr "$run")" $(( (end - start) / 1000000 )) | tee -a "$out/train.txt"
    done
    grep -h "GPU I/O kernels" "$out/umls-proxy.log" | head -1 | tee -a "$out/train.txt"
    # The timeline shows the I/O kernels' launches beside compute.
    "$ctl" report "$work/umls-proxy" -o "$out/umls-proxy-report.svg" | tee -a "$out/train.txt" || status=1
    launches=$(grep -c 'class="kwrite"\|class="kread"' "$out/umls-proxy-report.svg")
    echo "report: $launches I/O kernel launches drawn" | tee -a "$out/train.txt"
    [ "$launches" -gt 0 ] || { echo "no I/O kernel lane in the report"; status=1; }
    echo "== generated graph (1e6 nodes, 2e7 edges), Dot d = 100, N = 8, C = 3, 3 epochs: file vs proxy"
    "$ctl" generate --nodes 1000000 --edges 20000000 --relations 10 --split 0.98,0.01,0.01 "$work/g" >/dev/null || status=1
    for backend in file proxy; do
        run=$work/g-$backend
        "$ctl" train --dataset "$work/g" --out "$run" --json --set model.decoder=dot --set model.dim=100 \
            --set training.num_epochs=3 --set training.batch_size=100000 \
            --set training.negatives.num_chunks=10 --set training.negatives.negatives_per_positive=1000 \
            --set training.negatives.degree_fraction=0.5 --set evaluation.protocol=sampled \
            --set storage.num_partitions=8 --set storage.buffer_capacity=3 \
            --set "storage.backend=\"$backend\"" --set 'training.device="cuda:0"' \
            >"$out/g-$backend.jsonl" 2>"$out/g-$backend.log" || status=1
        python3 - "$out/g-$backend.jsonl" "$backend" <<'PY' | tee -a "$out/train.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    if "epoch" in r:
        print("g %-6s epoch %d: %.2f s, %.1f M edges/s, io %.2f s, read %.2f GB, written %.2f GB" % (
            sys.argv[2], r["epoch"], r["seconds"], r["edges_per_sec"] / 1e6, r.get("io_seconds", 0.0),
            r.get("bytes_read", 0) / 1e9, r.get("bytes_written", 0) / 1e9))
    if r.get("final"):
        print("g %-6s final %s MRR %.4f" % (sys.argv[2], r["split"], r["metrics"]["mrr"]))
PY
    done
    "$ctl" report "$work/g-proxy" -o "$out/g-proxy-report.svg" | tee -a "$out/train.txt" || status=1
    rm -rf "$work"
fi
tar czf "$out/00-logs.tar.gz" -C "$out" --exclude 00-logs.tar.gz . || status=1
exit $status
