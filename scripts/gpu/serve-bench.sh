#!/usr/bin/env bash
# Issue 32, item 4, on the GPU machine: a table served from the SSD by the GPU through the row
# cache (`legendctl bench cache`), against the whole table resident in GPU memory and against
# CPU threads reading rows with pread; and AGILE's sync-vs-async experiment on our kernels.
#
# The table is Twitter-shaped: 41 652 230 rows (the graph's nodes) of 400 bytes (d = 100
# floats), 16.7 GB, in a file on tmpfs behind the proxy, which serves it at a modelled SSD's
# rates (samsung-980: its IOPS cap and latency; tmpfs alone is RAM). The cache holds 10% of
# the table; the lookups follow a power law (Zipf, exponent 1, like the degree distribution).
# Builds nothing: expects target-gpu/ (scripts/gpu/build-binaries.sh), carried. Results under
# ${OUT:-target-gpu/out}: serve-bench.jsonl (one line a run) and serve-bench.txt.
# ROWS, ROW_BYTES, MODEL, BATCHES change the table, the modelled SSD and the run length.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
mkdir -p "$out"
source "$root/scripts/gpu/nvrtc-env.sh"
ctl=$bin/legendctl
rows=${ROWS:-41652230}
row_bytes=${ROW_BYTES:-400}
model=${MODEL:-samsung-980}
batches=${BATCHES:-10}
status=0
f=/dev/shm/legend-serve-table.img
bytes=$((rows * row_bytes))
# Random bytes, 1 GiB of them repeated (the rows' content does not change the I/O; a sparse
# file would read as zeros without any).
head -c $((1 << 30)) /dev/urandom >"$f.chunk"
: >"$f"
while [ "$(stat -c %s "$f")" -lt "$bytes" ]; do cat "$f.chunk" >>"$f"; done
rm -f "$f.chunk"
echo "table: $rows rows of $row_bytes bytes in $f ($(stat -c %s "$f") bytes)" | tee "$out/serve-bench.txt"

one() {
    "$ctl" bench cache --path "$f" --rows "$rows" --row-bytes "$row_bytes" --json "$@" \
        >>"$out/serve-bench.jsonl" 2>>"$out/serve-bench.err" || { echo "failed: $*" | tee -a "$out/serve-bench.txt"; status=1; return; }
    tail -n 1 "$out/serve-bench.jsonl" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
hit = "-" if r["hit_rate"] is None else "%.3f" % r["hit_rate"]
print("%-8s model %-12s ahead %d overlap %-5s flop/B %4.2f  %10.0f lookups/s  batch p50 %8.2f ms p99 %8.2f ms  hit %s  cache %.2f GB" % (
    r["mode"], r["ssd_model"] or "-", r["ahead"], r["overlap"], r["flops_per_byte"], r["lookups_per_s"],
    r["batch_ms_p50"], r["batch_ms_p99"], hit, r["cache_bytes"] / 1e9))
' | tee -a "$out/serve-bench.txt"
}

echo "== lookups: the row cache (10%) on the modelled SSD, on tmpfs alone, resident, pread" | tee -a "$out/serve-bench.txt"
one --mode gpu --ssd-model "$model" --batches "$batches"
one --mode gpu --batches "$batches"
one --mode resident --batches "$batches"
one --mode pread --queues 16 --batches "$batches"

echo "== AGILE's experiment: sync (1 request, compute after the wait) vs async (8 ahead, compute between)" | tee -a "$out/serve-bench.txt"
for ratio in 0 0.25 0.5 1 1.5 2; do
    one --mode gpu --ssd-model "$model" --ahead 1 --no-overlap --flops-per-byte "$ratio" --batches 4
    one --mode gpu --ssd-model "$model" --ahead 8 --flops-per-byte "$ratio" --batches 4
done
python3 - "$out/serve-bench.jsonl" <<'PY' | tee -a "$out/serve-bench.txt"
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
sweep = {}
for r in runs:
    if r["mode"] == "gpu" and r["ssd_model"] and (r["ahead"], r["overlap"]) in ((1, False), (8, True)):
        sweep.setdefault(r["flops_per_byte"], {})["async" if r["overlap"] else "sync"] = r["lookups_per_s"]
for ratio in sorted(sweep):
    s = sweep[ratio]
    if "sync" in s and "async" in s:
        print("FLOP/byte %4.2f: async / sync = %.2fx" % (ratio, s["async"] / s["sync"]))
PY
rm -f "$f"
exit $status
