#!/usr/bin/env bash
# Times the benchmark batch (batch_bench) of two or more builds in one call on the GPU machine,
# alternating them (A B A B ...) so that a drift of the machine hits every build alike, and
# prints the median step and phase times of each. Each argument is a folder made by
# scripts/gpu/build-binaries.sh (carry them all), or BUILD@KERNELS: that build with the kernel
# sources of the folder KERNELS (a copy of kernels/, through LEGEND_KERNELS_DIR), to time kernel
# variants without a Rust toolchain. LEGEND_BENCH_GROUPS, LEGEND_BENCH_DECODERS and
# LEGEND_BENCH_ROWS pass through (default here: group 20, complex and dot; builds from before
# LEGEND_BENCH_ROWS time element-wise f32 rows alone); ROUNDS (2) sets the alternations. Logs
# and JSON lines under ${OUT:-/tmp/legend-compare}.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/legend-compare}
mkdir -p "$out"
source "$root/scripts/gpu/nvrtc-env.sh"
export LEGEND_BENCH_GROUPS=${LEGEND_BENCH_GROUPS:-20}
export LEGEND_BENCH_DECODERS=${LEGEND_BENCH_DECODERS:-complex,dot}
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR..." >&2; exit 2; }
for round in $(seq 1 "${ROUNDS:-2}"); do
    for arg in "$@"; do
        dir=${arg%@*}
        kernels=$([ "$arg" != "$dir" ] && echo "${arg#*@}" || true)
        name=$(basename "$dir")${kernels:+_$(basename "$kernels")}
        echo "== round $round: $name"
        LEGEND_KERNELS_DIR=$kernels "$dir/batch_bench" "$out/$name.$round.jsonl" 2>&1 |
            tee "$out/$name.$round.log" >/dev/null
    done
done
python3 - "$out" "$@" <<'EOF'
import json, os, statistics, sys
out, dirs = sys.argv[1], sys.argv[2:]
rows = {}
for d in dirs:
    build, _, kernels = d.partition("@")
    name = os.path.basename(build.rstrip("/")) + ("_" + os.path.basename(kernels.rstrip("/")) if kernels else "")
    for f in sorted(os.listdir(out)):
        if f.startswith(name + ".") and f.endswith(".jsonl"):
            for line in open(os.path.join(out, f)):
                r = json.loads(line)
                layout = r.get("rows", "element/f32")
                rows.setdefault((r["decoder"], layout, r["group"], name), []).append(r)
print(f"{'decoder':8} {'rows':12} {'group':>5} {'build':24} {'batch ms':>9} {'step ms':>8}  phases (ms)")
for (dec, layout, group, name), rs in sorted(rows.items()):
    med = statistics.median(r["median_ms"] for r in rs)
    step = statistics.median(r["step_ms"] for r in rs)
    phases = {k: statistics.median(r["phases_ms"][k] for r in rs) for k in rs[0]["phases_ms"]}
    ph = " ".join(f"{k}={v:.3f}" for k, v in phases.items())
    print(f"{dec:8} {layout:12} {group:>5} {name:24} {med:9.4f} {step:8.4f}  {ph}")
EOF
