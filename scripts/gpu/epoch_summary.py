"""One line per epoch of a `legendctl train --json` run, and the GPU utilisation in its last epoch.

Usage: epoch_summary.py RUN.jsonl UTIL.csv TRAIN.log MODEL LAYOUT

UTIL.csv is `nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms N`
sampled during the run; the last epoch's window ends at its log line's timestamp (UTC, the clock
nvidia-smi uses there) and starts that epoch's seconds earlier.
"""
import datetime
import json
import re
import sys

runs, util_csv, log_file, model, layout = sys.argv[1:6]
lines = [json.loads(l) for l in open(runs) if l.startswith("{")]
epochs = [l for l in lines if "epoch" in l]
util = []
for l in open(util_csv):
    f = [x.strip() for x in l.split(",")]
    if len(f) == 2 and f[1].isdigit():
        util.append((datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f"), float(f[1])))
log = re.sub(r"\x1b\[[0-9;]*m", "", open(log_file).read())
ends = re.findall(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z\s+INFO\s+epoch (\d+)/", log)
span = []
if ends and epochs:
    end = datetime.datetime.fromisoformat(ends[-1][0][:26])
    start = end - datetime.timedelta(seconds=epochs[-1]["seconds"])
    span = [u for t, u in util if start <= t <= end]
for e in epochs:
    sw = e["swaps"]
    print(f'{model:8s} {layout:4s} epoch {e["epoch"]}: {e["seconds"]:.2f} s, {e["edges_per_sec"]/1e6:.2f} M edges/s, loss {e["loss"]:.3f}, '
          f'states {e["buffer_states"]}, read {e["bytes_read"]/1e9:.2f} GB, written {e["bytes_written"]/1e9:.2f} GB, io {e["io_s"]:.2f} s, '
          f'io wait {e["io_wait_s"]:.2f} s, overlap compute {sum(s["overlap_compute_s"] for s in sw):.2f} s, after compute {sum(s["after_compute_s"] for s in sw):.2f} s, '
          f'host<->GPU copies {sum(s.get("copy_s", 0.0) for s in sw):.2f} s')
if not span:
    print(f'{model:8s} {layout:4s} no utilisation samples in the last epoch')
else:
    listed = f", samples {[int(u) for u in span]}" if len(span) <= 60 else ""
    print(f'{model:8s} {layout:4s} GPU utilisation in epoch {epochs[-1]["epoch"]} ({len(span)} samples): '
          f'mean {sum(span)/len(span):.1f}%, median {sorted(span)[len(span)//2]:.0f}%{listed}')
