#!/usr/bin/env bash
# Training from a modelled SSD on the GPU machine (issue 29's table): the generated graph of
# 10^7 nodes and 2*10^8 edges (Dot, d = 100, B = 10^5, 10 chunks x 1000 negatives, half
# degree-based), EPOCHS epochs (2) each:
#   memory  all in GPU memory (N = 1);
#   ram     N = 8, C = 3, the other partitions in host RAM (the memory backend's host tier);
#   proxy   N = 8, C = 3, the store through the proxy controller on tmpfs, as fast as it goes;
#   980     the same, the proxy modelling one Samsung 980 (storage.proxy_model = samsung-980);
#   980x    the same with reads and writes on separate budgets (shared=false);
#   980x2   the store striped over two proxies, each modelling one 980 (two SSDs, 1 MiB units,
#           both in each launch of the GPU I/O kernels);
#   file-disk, proxy-disk
#           the store on the machine's disk (LEGEND_WORK), page cache bypassed: the `file`
#           backend (io_uring, O_DIRECT) and the proxy (GPU I/O kernels); their storage bound
#           uses the disk's O_DIRECT rates, measured first with `legendctl bench io`.
# Every epoch line carries bytes read and written, I/O seconds, compute waited, and the storage
# bound of the modelled rows (bytes / the model's rates). STATES lists the row formats each
# layout runs with: an AdaGrad state layout, optionally with a storage.dtype after a slash
# (element row row/bf16: 800, 404 and 204 bytes a row). A layout with "-noahead" appended (e.g.
# 980-noahead) runs with storage.read_ahead = false: each swap writes, then reads into the same
# slot. CAPACITY (3) sets the buffer's C for the out-of-core layouts. Builds nothing: expects
# legendctl in ${LEGEND_GPU_BIN:-target-gpu}. DEVICE=cpu, NODES and EDGES scale it down for a
# dry run.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${LEGEND_GPU_BIN:-$root/target-gpu}
out=${OUT:-$bin/out}
data=${LEGEND_DATA:-/dev/shm/legend-ssd}
work=${LEGEND_WORK:-/var/tmp/legend-ssd}
nodes=${NODES:-10000000}
edges=${EDGES:-200000000}
epochs=${EPOCHS:-2}
device=${DEVICE:-cuda:0}
layouts=${LAYOUTS:-memory proxy 980 980x}
states=${STATES:-element}
capacity=${CAPACITY:-3}
mkdir -p "$out"
rm -rf "$data" "$work" && mkdir -p "$data" "$work"
[ "$device" = cpu ] || source "$root/scripts/gpu/nvrtc-env.sh" >/dev/null
ctl=$bin/legendctl
status=0
{
    "$root/scripts/gpu/hardware.sh"
} | tee "$out/ssd-hw.txt"

start=$SECONDS
"$ctl" generate --nodes "$nodes" --edges "$edges" --relations 1 --split 0.9999,0,0.0001 \
    "$data/g" >"$out/ssd-generate.log" 2>&1 || { tail "$out/ssd-generate.log"; exit 1; }
echo "== generated $nodes nodes, $edges edges in $((SECONDS - start)) s"

# The disk's O_DIRECT rates (GB/s), for the disk layouts' storage bound: 1 MiB requests, 4
# rings of 16, over a 4 GiB file, as a swap moves partitions.
disk_rates=""
if [[ " $layouts " == *-disk* ]]; then
    probe=$work/probe.bin
    rate() {
        "$ctl" bench io --path "$probe" --op "$1" --queues 4 --depth 16 --span 4294967296 \
            --seconds 3 --json 2>/dev/null | python3 -c 'import json,sys; print(round(json.loads(sys.stdin.read())["gb_per_s"], 3))'
    }
    head -c 4294967296 /dev/urandom >"$probe"
    disk_rates="$(rate read) $(rate write)"
    rm -f "$probe"
    echo "== disk O_DIRECT read / write GB/s: $disk_rates" | tee -a "$out/ssd-hw.txt"
fi

for layout in $layouts; do
for format in $states; do
    state=${format%%/*}
    dtype=f32
    [ "$format" != "$state" ] && dtype=${format#*/}
    name=$layout-$state
    [ "$dtype" = f32 ] || name+=-$dtype
    [ "$capacity" = 3 ] || name+=-c$capacity
    sets=(--set storage.num_partitions=8 --set storage.buffer_capacity=$capacity
        --set storage.backend=proxy --set "storage.path=\"$data/store-$name.bin\"")
    model=""
    rates=""
    devices=1
    case ${layout%-noahead} in
    memory) sets=(--set storage.backend=memory) ;;
    ram) sets=(--set storage.backend=memory --set storage.num_partitions=8 --set storage.buffer_capacity=$capacity) ;;
    proxy) ;;
    980) model=samsung-980 ;;
    980x) model="samsung-980,shared=false" ;;
    980x2)
        model=samsung-980
        devices=2
        sets=(--set storage.num_partitions=8 --set storage.buffer_capacity=$capacity
            --set storage.backend=proxy
            --set "storage.device=[{path=\"$data/store-$name-a.bin\"}, {path=\"$data/store-$name-b.bin\"}]")
        ;;
    file-disk | proxy-disk)
        sets=(--set storage.num_partitions=8 --set storage.buffer_capacity=$capacity
            --set "storage.backend=${layout%-disk}" --set "storage.path=\"$work/store-$name.bin\"")
        rates="disk $disk_rates"
        ;;
    esac
    [ "$layout" != "${layout%-noahead}" ] && sets+=(--set storage.read_ahead=false)
    [ -n "$model" ] && sets+=(--set "storage.proxy_model=\"$model\"") && rates=$model
    sets+=(--set "optimizer.state=$state" --set "storage.dtype=$dtype")
    run=$work/run-$name
    start=$SECONDS
    "$ctl" train --dataset "$data/g" --out "$run" --json \
        --set model.decoder=dot --set model.dim=100 --set training.num_epochs="$epochs" \
        --set training.batch_size=100000 --set training.negatives.num_chunks=10 \
        --set training.negatives.negatives_per_positive=1000 \
        --set training.negatives.degree_fraction=0.5 --set evaluation.protocol=sampled \
        --set "training.device=\"$device\"" "${sets[@]}" \
        >"$out/ssd-$name.jsonl" 2>"$out/ssd-$name.log"
    code=$?
    if [ $code -ne 0 ]; then
        echo "== $name: FAILED (exit $code) after $((SECONDS - start)) s"
        tail -5 "$out/ssd-$name.log"
        status=1
        continue
    fi
    python3 - "$out/ssd-$name.jsonl" "$name" "$rates" "$devices" <<'PY' | tee -a "$out/ssd-summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
layout, model, devices = sys.argv[2], sys.argv[3], int(sys.argv[4])
# The model's rates (GB/s) and whether reads and writes share one budget.
rates = {"samsung-980": (3.19, 2.24, True), "samsung-980,shared=false": (3.19, 2.24, False)}
if model.startswith("disk ") and len(model.split()) == 3:
    # Measured O_DIRECT rates. The GPU machine's (virtual) disk serves a swap's reads and
    # writes at once, each near its own rate (2026-11-27: an epoch moved 15 + 15 GB faster
    # than reads then writes at the probe's rates), so two budgets.
    rates[model] = (float(model.split()[1]), float(model.split()[2]), False)
def mrr(v):
    if isinstance(v, dict):
        return v.get("mrr") if "mrr" in v else next((m for m in map(mrr, v.values()) if m is not None), None)
    return None
for r in rows:
    if "epoch" not in r:
        if mrr(r) is not None:
            print(f"{layout:14s} final sampled MRR {mrr(r):.4f}")
        continue
    read, written = r["bytes_read"], r["bytes_written"]
    line = (f"{layout:14s} epoch {r['epoch']}: {r['seconds']:.2f} s, {r['edges_per_sec']/1e6:.1f} M edges/s, "
            f"read {read/1e9:.2f} GB, written {written/1e9:.2f} GB, io {r['io_s']:.2f} s, "
            f"compute waited {r['io_wait_s']:.2f} s")
    if model in rates:
        rd, wr, shared = rates[model]
        t_r, t_w = read / 1e9 / rd, written / 1e9 / wr
        # Striped: every device serves its share at once.
        bound = (t_r + t_w if shared else max(t_r, t_w)) / devices
        line += f", storage bound {bound:.2f} s ({r['seconds']/bound:.2f}x)"
    print(line)
PY
    rm -rf "$data/store-$name"*.bin "$work/store-$name"*.bin
done
done
rm -rf "$data" "$work"
exit $status
