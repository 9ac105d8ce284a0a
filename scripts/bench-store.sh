#!/usr/bin/env bash
# Out-of-core benchmarks (issue 4), all figures from one run on the disk holding WORKDIR:
#  1. store partition write/read throughput (O_DIRECT + io_uring) vs `dd` with O_DIRECT;
#  2. epoch time with C = 3 of N = 12 partitions on the file backend vs everything in memory;
#  3. prefetch (swap overlapped with compute) on vs off;
#  4. Legend vs BETA vs sequential partition order;
#  5. Theorem 3's condition for this graph, with the measured compute rate and bandwidths.
# Usage: scripts/bench-store.sh [WORKDIR] [NODES] [EDGES] [DIM]
# With BIN_DIR set (a folder holding `legendctl` and `throughput`, e.g. carried to a machine
# without Rust), nothing is built.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$root/target/bench-store}
nodes=${2:-1000000}
edges=${3:-4000000}
dim=${4:-64}
mkdir -p "$work"
if [ -n "${BIN_DIR:-}" ]; then
  bin=$BIN_DIR/legendctl
  throughput=$BIN_DIR/throughput
else
  cargo build --release --locked -q -p legendctl -p legend-storage --examples --bins --manifest-path "$root/Cargo.toml"
  target=${CARGO_TARGET_DIR:-$root/target}/release
  bin=$target/legendctl
  throughput=$target/examples/throughput
fi
echo "## host: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1), disk of $work: $(df -h "$work" | awk 'NR==2 {print $1, $2}')"

echo "### 1. raw O_DIRECT (dd, 1 MiB blocks, 1 GiB) vs the store"
dd if=/dev/zero of="$work/dd.bin" bs=1M count=1024 oflag=direct 2>&1 | tail -1 | sed 's/^/dd write: /'
dd if="$work/dd.bin" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1 | sed 's/^/dd read:  /'
rm -f "$work/dd.bin"
"$throughput" "$work/store-throughput.bin" 1024 8 32 1024 2>&1 | tail -4
rm -f "$work/store-throughput.bin"

ds=$work/graph-$nodes-$edges
if [ ! -f "$ds/dataset.toml" ]; then
  "$bin" generate --nodes "$nodes" --edges "$edges" --relations 10 --skew 0.8 --seed 1 --split 1,0,0 "$ds"
fi
common=(--set model.decoder=complex --set "model.dim=$dim" --set training.num_epochs=2
  --set training.batch_size=1000 --set training.negatives.negatives_per_positive=64
  --set storage.num_partitions=12)
results=$work/results.jsonl
: >"$results"
train() {
  local name=$1
  shift
  rm -rf "$work/run-$name"
  "$bin" train --dataset "$ds" --out "$work/run-$name" "${common[@]}" "$@" --json 2>/dev/null |
    sed -n 2p | python3 -c "import json,sys; d=json.load(sys.stdin); d['name']='$name'; print(json.dumps(d))" >>"$results"
  rm -rf "$work/run-$name"
}
echo "### 2-4. epoch 2 (epoch 1 only initialises partitions) of $edges edges, $nodes nodes, d = $dim"
train memory-all-resident --set storage.buffer_capacity=12
train file-legend-prefetch --set storage.backend=file --set storage.buffer_capacity=3 --set storage.order=legend
train file-legend-no-prefetch --set storage.backend=file --set storage.buffer_capacity=3 --set storage.order=legend --set storage.prefetch=false
train file-beta-prefetch --set storage.backend=file --set storage.buffer_capacity=3 --set storage.order=beta
train file-sequential-prefetch --set storage.backend=file --set storage.buffer_capacity=3 --set storage.order=sequential
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = rows[0]["seconds"]
print("| run | epoch s | vs all in memory | buffer states | GB read | GB written | I/O s | compute waited s | I/O hidden |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    io, wait = r["io_s"], r["io_wait_s"]
    hidden = f"{100 * (1 - wait / io):.0f}%" if io > 0 else "-"
    print(f"| {r['name']} | {r['seconds']:.1f} | {r['seconds'] / base:.2f}× | {r['buffer_states']} | "
          f"{r['bytes_read'] / 1e9:.2f} | {r['bytes_written'] / 1e9:.2f} | {io:.1f} | {wait:.1f} | {hidden} |")
mem = rows[0]
print(f"\ncompute rate all in memory: {mem['edges_per_sec']:.0f} edges/s ({1 / mem['edges_per_sec']:.2e} s per edge)")
PY
t=$(python3 -c "import json; r=[json.loads(l) for l in open('$results')]; print(1/r[0]['edges_per_sec'])")
echo "### 5. Theorem 3 with the measured compute rate (bandwidths: 1 GB/s each; see section 1 for measured ones)"
"$bin" plan -n 12 -c 3 --dataset "$ds" --dim "$dim" --seconds-per-edge "$t" --write-bw 1e9 --read-bw 1e9 | tail -2
