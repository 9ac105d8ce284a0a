"""Issue 5: epoch time on one GPU against PyTorch Geometric (`torch_geometric.nn.kge`) and PyKEEN,
ComplEx on the same dataset and settings, every system's final embeddings scored by Legend's
filtered evaluator (`legendctl eval --embeddings DIR --decoder complex --protocol filtered`).
Run on the GPU machine through scripts/gpu/peers-bench.sh.

Rows (--systems picks them, in this order):
  legend  `legendctl train` with training.device = DEVICE: softmax CE, each chunk of B positives
          shares K uniform negatives per corrupted side (both sides);
  pyg     PyG's kge.ComplEx with its own loader and loss: 1 corruption per positive, BCE;
  pyg-k   PyG's kge.ComplEx, forward() on K gathered negatives per positive, softmax CE;
  pykeen  PyKEEN sLCWA, CrossEntropyLoss, K negatives per positive (one side each).
All: ComplEx d real floats (d/2 complex), batch B, Adagrad lr, E epochs, init N(0, init scale)
with relations 1 + 0i. A row whose run fails is reported as failed, with no figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_pykeen import legend_settings  # noqa: E402
from legend_common import cpu_model, legend_eval, run_legend_train  # noqa: E402

HERE = Path(__file__).resolve().parent
SYSTEMS = ("legend", "pyg", "pyg-k", "pykeen")


def versions() -> dict:
    out = {"cpu": cpu_model()}
    for pkg in ("torch", "torch_geometric", "pykeen", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        )
        out["gpu"] = q.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["gpu"] = None
    return out


def epoch_figures(seconds: list[float], train_edges: int) -> dict:
    """First epoch, median of the later ones (the steady state), and edges/s at that median."""
    later = seconds[1:] or seconds
    median = statistics.median(later)
    return {
        "epochs": len(seconds),
        "first_epoch_s": seconds[0],
        "median_epoch_s": median,
        "edges_per_sec": train_edges / median,
        "train_s": sum(seconds),
        "epoch_s": seconds,
    }


def metrics(m: dict) -> dict:
    return {k: m[k] for k in ("mrr", "hits_at_1", "hits_at_3", "hits_at_10", "count")}


def run_legend(args, log) -> dict:
    out = args.work / "legend"
    shutil.rmtree(out, ignore_errors=True)
    settings = legend_settings(args.epochs, args.negatives, args) + [f'training.device="{args.device}"']
    r = run_legend_train(args.legendctl, args.dataset, out, settings)
    log.write(f"+ {r['command']}\n{r['log']}{json.dumps(r['epochs'])}\n")
    edges = r["epochs"][0]["edges"]
    exported = out / "export"
    subprocess.run([args.legendctl, "export", str(out), "--format", "npy", "-o", str(exported)],
                   check=True, stdout=log, stderr=log)
    m = legend_eval(args.legendctl, args.dataset, exported, "complex", threads=args.eval_threads)
    own = r["final"]["metrics"]["mrr"] if r["final"] else None
    return {
        "system": "Legend",
        "detail": f"legendctl train, training.device = {args.device}",
        "negatives": f"{args.negatives} per side, shared by the chunk of {args.batch_size}",
        "loss": "softmax CE",
        "command": r["command"],
        "wall_s": r["wall_s"],
        "train_edges": edges,
        "own_eval_mrr": own,
        **epoch_figures([e["seconds"] for e in r["epochs"]], edges),
        **metrics(m),
    }


def run_peer(args, name: str, log) -> dict:
    out = args.work / name
    common = ["--dataset", str(args.dataset), "--out", str(out), "--dim", str(args.dim),
              "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
              "--seed", str(args.seed), "--device", args.device]
    if name == "pykeen":
        cmd = [sys.executable, str(HERE / "pykeen_train.py"), *common, "--negatives", str(args.negatives)]
        label, negatives, loss = "PyKEEN (sLCWA)", f"{args.negatives} per positive, one side", "softmax CE"
    elif name == "pyg":
        cmd = [sys.executable, str(HERE / "pyg_train.py"), *common, "--negatives", "0"]
        label, negatives, loss = "PyG kge.ComplEx, its loader + loss", "1 per positive, one side", "BCE"
    else:
        cmd = [sys.executable, str(HERE / "pyg_train.py"), *common, "--negatives", str(args.negatives)]
        label, negatives, loss = "PyG kge.ComplEx, forward() on K negatives", \
            f"{args.negatives} per positive, half each side", "softmax CE"
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=log, stderr=log, timeout=args.timeout)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "train.json").read_text())
    m = legend_eval(args.legendctl, args.dataset, out, "complex", threads=args.eval_threads)
    edges = summary["train_edges"]
    return {
        "system": label,
        "detail": summary["system"],
        "negatives": negatives,
        "loss": loss,
        "command": " ".join(cmd),
        "wall_s": wall,
        "train_edges": edges,
        **epoch_figures([e["seconds"] for e in summary["epochs"]], edges),
        **metrics(m),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| system | negatives | loss | epochs | first epoch s | median epoch s (2..E) | edges/s | "
        "filtered MRR | Hits@1 | Hits@10 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r.get('negatives', '')} | {r.get('loss', '')} | – | failed: "
                         f"{r['error']} | – | – | – | – | – |")
            continue
        lines.append(
            f"| {r['system']} | {r['negatives']} | {r['loss']} | {r['epochs']} | {r['first_epoch_s']:.3f} "
            f"| {r['median_epoch_s']:.3f} | {r['edges_per_sec']:,.0f} | {r['mrr']:.4f} | {r['hits_at_1']:.4f} "
            f"| {r['hits_at_10']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legendctl", required=True)
    ap.add_argument("--dataset", type=Path, required=True, help="a Legend dataset (legendctl import)")
    ap.add_argument("--work", type=Path, required=True, help="run directories and embeddings")
    ap.add_argument("--json-out", type=Path, help="results JSON (rewritten after every row)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--negatives", type=int, default=1000, help="K (all but the pyg row)")
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="Legend's training.threads (its CPU side)")
    ap.add_argument("--eval-threads", type=int, default=0, help="legendctl eval threads (0: all cores)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds allowed to each peer's training")
    ap.add_argument("--legend-commit", default="", help="the Legend commit legendctl was built from")
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        sys.exit(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}")

    args.work.mkdir(parents=True, exist_ok=True)
    hw = versions() | {"legend_commit": args.legend_commit}
    settings = {k: getattr(args, k) for k in ("epochs", "negatives", "dim", "batch_size", "lr", "seed", "device")}
    settings["dataset"] = str(args.dataset)
    rows: list[dict] = []
    with open(args.work / "runs.log", "a") as log:
        for name in systems:
            print(f"== {name}", file=sys.stderr, flush=True)
            try:
                row = run_legend(args, log) if name == "legend" else run_peer(args, name, log)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError, OSError,
                    KeyError, ValueError) as e:
                kind = type(e).__name__
                row = {"system": name, "error": f"{kind} (see runs.log)", "detail": str(e)[-2000:]}
            log.flush()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json_out:
                args.json_out.write_text(json.dumps({"hardware": hw, "settings": settings, "rows": rows}, indent=1))

    print("\n" + json.dumps({"hardware": hw, "settings": settings, "rows": rows}))
    print(f"\n{args.dataset.name}, ComplEx d = {args.dim} ({args.dim // 2} complex), batch {args.batch_size}, "
          f"Adagrad lr {args.lr}, {args.epochs} epochs, K = {args.negatives}, device {args.device}")
    print(f"GPU: {hw['gpu']}; CPU: {hw['cpu']}; torch {hw['torch']}, torch_geometric {hw['torch_geometric']}, "
          f"pykeen {hw['pykeen']}, numpy {hw['numpy']}; Legend {args.legend_commit or '(commit not given)'}\n")
    print(table(rows))
    print("\nCommands:")
    for r in rows:
        if "command" in r:
            print(f"  {r['command']}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
