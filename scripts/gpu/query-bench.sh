#!/usr/bin/env bash
# Issue 32 on the GPU machine: queries on a trained run, on the GPU against the CPU, and rows
# looked up through the GPU row cache over the run's own store behind a modelled SSD.
#
# A generated graph of NODES (2*10^6) nodes, EDGES (2*10^7) edges and 10 relations is trained
# one epoch on the GPU (DistMult, d = 100) with its store behind the proxy controller modelling
# a Samsung 980 (storage.proxy_model = samsung-980; bf16 rows at rest, row-wise state: 200
# bytes a row of embeddings), N = 4 partitions. Then:
#   predict, neighbors   BATCHES batches of 1024 queries each (`legendctl predict|neighbors
#                        --queries`), --device cuda:0 (the rows in GPU memory, the exact scan
#                        there) against --device cpu (every core); each batch's time from
#                        legendctl's stderr; the answers of both compared line for line
#                        (DEVICES, "cuda:0 cpu", names the devices: one alone compares nothing);
#   lookups              `legendctl bench cache --run`: the row cache at 10 % of the table,
#                        reading the run's store through its proxy (the modelled 980); the whole
#                        table cached (resident); CPU threads with pread on the store's file.
# Builds nothing: expects legendctl in ${LEGEND_GPU_BIN:-target-gpu}. Results under
# ${OUT:-target-gpu/out}: query-bench.txt (the table) and the logs.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
work=${LEGEND_WORK:-/dev/shm/legend-query}
nodes=${NODES:-2000000}
edges=${EDGES:-20000000}
batches=${BATCHES:-4}
devices=${DEVICES:-cuda:0 cpu}
mkdir -p "$out"
rm -rf "$work" && mkdir -p "$work"
source "$root/scripts/gpu/nvrtc-env.sh"
ctl=$bin/legendctl
txt=$out/query-bench.txt
status=0
{
    "$root/scripts/gpu/hardware.sh"
} | tee "$txt"

start=$SECONDS
"$ctl" generate --nodes "$nodes" --edges "$edges" --relations 10 --split 0.999,0.0005,0.0005 \
    "$work/g" >"$out/query-generate.log" 2>&1 || { tail "$out/query-generate.log"; exit 1; }
run=$work/run
"$ctl" train --dataset "$work/g" --out "$run" --json \
    --set model.decoder=distmult --set model.dim=100 --set training.num_epochs=1 \
    --set training.batch_size=100000 --set evaluation.protocol=sampled \
    --set 'training.device="cuda:0"' --set storage.backend=proxy \
    --set storage.num_partitions=4 --set storage.buffer_capacity=2 \
    --set optimizer.state=row --set storage.dtype=bf16 \
    --set 'storage.proxy_model="samsung-980"' \
    >"$out/query-train.jsonl" 2>"$out/query-train.log" || { tail "$out/query-train.log"; exit 1; }
echo "== $nodes nodes, $edges edges: generated and trained one epoch in $((SECONDS - start)) s" | tee -a "$txt"

# Queries by id (a number below the table's size names that entity), 1024 a batch.
python3 - "$work" "$nodes" "$batches" <<'PY'
import random, sys
work, nodes, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(32)
with open(f"{work}/predict.tsv", "w") as f:
    for i in range(1024 * batches):
        e, r = rng.randrange(nodes), rng.randrange(10)
        f.write(f"{e}\t{r}\t?\n" if i % 2 == 0 else f"?\t{r}\t{e}\n")
with open(f"{work}/neighbors.tsv", "w") as f:
    for _ in range(1024 * batches):
        f.write(f"{rng.randrange(nodes)}\n")
PY

# One command on one device: its answers, and the batch lines of its stderr.
ask() {
    local what=$1 device=$2
    shift 2
    "$ctl" "$what" "$run" --queries "$work/$what.tsv" --device "$device" --json "$@" \
        >"$work/$what-$device.jsonl" 2>"$out/query-$what-$device.log" ||
        { echo "failed: $what on $device" | tee -a "$txt"; tail -3 "$out/query-$what-$device.log"; status=1; return; }
    python3 - "$out/query-$what-$device.log" "$what" "$device" <<'PY' | tee -a "$txt"
import re, statistics, sys
log, what, device = sys.argv[1:]
lines = open(log).read().splitlines()
times = [float(m.group(1)) for l in lines if (m := re.search(r"queries in ([0-9.]+) s", l))]
where = next((l[len("answering on "):] for l in lines if l.startswith("answering on ")), "?")
load = next((l for l in lines if "(the run opened)" in l), "")
print(f"{what:9s} {device:7s} batches of 1024: median {statistics.median(times)*1e3:9.1f} ms "
      f"(all: {' '.join('%.1f' % (t*1e3) for t in times)} ms); {where}; {load}")
PY
}
echo "== predict (DistMult, top 10) and neighbors (cosine, top 10): GPU against CPU" | tee -a "$txt"
for what in predict neighbors; do
    extra=()
    [ "$what" = neighbors ] && extra=(--metric cosine)
    for device in $devices; do ask "$what" "$device" "${extra[@]}"; done
    [ "$devices" = "cuda:0 cpu" ] || continue
    if cmp -s "$work/$what-cuda:0.jsonl" "$work/$what-cpu.jsonl"; then
        echo "$what: GPU and CPU answers identical ($(wc -l <"$work/$what-cpu.jsonl") answers)" | tee -a "$txt"
    else
        echo "$what: GPU and CPU answers DIFFER" | tee -a "$txt"
        status=1
    fi
done

echo "== lookups of the run's rows (power law), batches of 65536" | tee -a "$txt"
one() {
    "$ctl" bench cache --run "$run" --json "$@" >>"$out/query-cache.jsonl" 2>>"$out/query-cache.err" ||
        { echo "failed: bench cache $*" | tee -a "$txt"; tail -3 "$out/query-cache.err"; status=1; return; }
    tail -n 1 "$out/query-cache.jsonl" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
hit = "-" if r["hit_rate"] is None else "%.3f" % r["hit_rate"]
print("%-8s model %-12s %10.0f lookups/s  batch p50 %8.2f ms p99 %8.2f ms  hit %s  cache %.1f of %.1f MB" % (
    r["mode"], r["ssd_model"] or "-", r["lookups_per_s"], r["batch_ms_p50"], r["batch_ms_p99"], hit,
    r["cache_bytes"] / 1e6, r["table_bytes"] / 1e6))
' | tee -a "$txt"
}
one --mode gpu --batches 10
one --mode resident --batches 10
one --mode pread --queues 16 --batches 10
rm -rf "$work"
exit $status
