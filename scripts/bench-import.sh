#!/usr/bin/env bash
# Import speed: a synthetic 10M-edge TSV (1M entities with skewed degrees, 500 relations)
# through `legendctl import` (release build). Prints the input size and the wall time.
# Usage: scripts/bench-import.sh [EDGES] [WORKDIR]
set -euo pipefail
edges=${1:-10000000}
work=${2:-$(mktemp -d)}
root=$(cd "$(dirname "$0")/.." && pwd)
cargo build --release -q -p legendctl --manifest-path "$root/Cargo.toml"
bin=${CARGO_TARGET_DIR:-$root/target}/release/legendctl
tsv=$work/edges-$edges.tsv
if [ ! -s "$tsv" ]; then
  python3 - "$edges" "$tsv" <<'PY'
import random, sys
n, path = int(sys.argv[1]), sys.argv[2]
rng = random.Random(7)
ents = 1_000_000
with open(path, "w") as f:
    for chunk in range(0, n, 100_000):
        lines = []
        for _ in range(min(100_000, n - chunk)):
            # Squaring a uniform draw skews ids toward small values (hubs).
            h = int(rng.random() ** 2 * ents); t = int(rng.random() * ents)
            lines.append(f"entity_{h}\trel_{rng.randrange(500)}\tentity_{t}\n")
        f.writelines(lines)
PY
fi
rm -rf "$work/ds"
size=$(du -h "$tsv" | cut -f1)
start=$(date +%s.%N)
"$bin" import -o "$work/ds" --split 0.9,0.05,0.05 --seed 1 --keep-unseen --json "$tsv"
end=$(date +%s.%N)
echo "input: $edges edges, $size; import wall time: $(echo "$end - $start" | bc) s on $(nproc) cores"
