"""Issue 3 §9: Legend vs PyKEEN 1.11.1, ComplEx on wordnet-rr, equal settings, both scored by
Legend's filtered evaluator. Run through run-pykeen.sh (which installs and builds what it needs).

Rows:
  1. Legend   at K negatives per positive (per side, shared by the chunk), E epochs;
  2. PyKEEN   at K negatives per positive (independent, one side), E epochs;
  3. Legend   at 1000 negatives (its default), E epochs — what Legend does in less time;
  4. throughput probe at 1000 negatives: PyKEEN on the first --probe-edges training edges
     (a full epoch at 1000 negatives takes PyKEEN most of an hour here), Legend one full epoch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from legend_common import cpu_model, legend_eval, loadavg, run_legend_train  # noqa: E402

HERE = Path(__file__).resolve().parent


def legend_settings(epochs: int, negatives: int, args) -> list[str]:
    return [
        "model.decoder=complex",
        f"model.dim={args.dim}",
        "model.loss=softmax_ce",
        "model.relation_init=identity",
        f"training.num_epochs={epochs}",
        f"training.batch_size={args.batch_size}",
        "training.negatives.num_chunks=1",
        f"training.negatives.negatives_per_positive={negatives}",
        "training.negatives.degree_fraction=0",
        f"optimizer.learning_rate={args.lr}",
        f"training.threads={args.threads}",
        f"training.seed={args.seed}",
    ]


def run_pykeen(args, out: Path, epochs: int, negatives: int, limit_edges: int = 0) -> dict:
    if args.reuse_pykeen and (out / "train.json").exists():
        summary = json.loads((out / "train.json").read_text())
        s = summary["settings"]
        if (s["epochs"], s["negatives"], s["limit_edges"], s["dim"]) == (epochs, negatives, limit_edges, args.dim):
            print(f"== reusing PyKEEN run {out}", file=sys.stderr, flush=True)
            return {"command": summary.get("command", "(reused)"), "wall_s": float("nan"), **summary}
    cmd = [
        sys.executable, str(HERE / "pykeen_train.py"), "--dataset", str(args.dataset), "--out", str(out),
        "--dim", str(args.dim), "--epochs", str(epochs), "--batch-size", str(args.batch_size),
        "--negatives", str(negatives), "--lr", str(args.lr), "--threads", str(args.threads),
        "--seed", str(args.seed),
    ]
    if limit_edges:
        cmd += ["--limit-edges", str(limit_edges)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "train.json").read_text())
    summary["command"] = " ".join(cmd)
    (out / "train.json").write_text(json.dumps(summary, indent=1))
    return {"wall_s": wall, **summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legendctl", required=True)
    ap.add_argument("--data", type=Path, required=True, help="dir with train/valid/test.txt")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--negatives", type=int, default=32)
    ap.add_argument("--probe-edges", type=int, default=4000)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse-pykeen", action="store_true",
                    help="reuse PyKEEN runs already in --work with the same settings (re-evaluate only)")
    args = ap.parse_args()

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    args.dataset = work / args.data.name
    if not (args.dataset / "dataset.toml").exists():
        subprocess.run(
            [args.legendctl, "import", "-o", str(args.dataset), "--train", str(args.data / "train.txt"),
             "--valid", str(args.data / "valid.txt"), "--test", str(args.data / "test.txt"), "--json"],
            check=True, stdout=sys.stderr,
        )
    rows = []

    def legend_row(name: str, epochs: int, negatives: int) -> dict:
        out = work / f"legend-{name}"
        shutil.rmtree(out, ignore_errors=True)
        print(f"== Legend {name}", file=sys.stderr, flush=True)
        r = run_legend_train(args.legendctl, args.dataset, out, legend_settings(epochs, negatives, args))
        train_s = sum(e["seconds"] for e in r["epochs"])
        edges = sum(e["edges"] for e in r["epochs"])
        row = {
            "system": "Legend", "negatives": negatives, "epochs": epochs, "train_s": train_s,
            "edges_per_sec": edges / train_s, "mrr": r["final"]["metrics"]["mrr"],
            "hits_at_10": r["final"]["metrics"]["hits_at_10"], "command": r["command"], "run": str(out),
        }
        rows.append(row)
        return row

    ours = legend_row(f"k{args.negatives}", args.epochs, args.negatives)

    print("== PyKEEN", file=sys.stderr, flush=True)
    pk_out = work / f"pykeen-k{args.negatives}"
    pk = run_pykeen(args, pk_out, args.epochs, args.negatives)
    m = legend_eval(args.legendctl, args.dataset, pk_out, "complex", reference_run=Path(ours["run"]))
    rows.append({
        "system": pk["system"], "negatives": args.negatives, "epochs": args.epochs, "train_s": pk["train_s"],
        "edges_per_sec": pk["train_edges"] * args.epochs / pk["train_s"], "mrr": m["mrr"],
        "hits_at_10": m["hits_at_10"], "command": pk["command"],
    })

    legend_row("k1000", args.epochs, 1000)

    probe = None
    if args.probe_edges:
        print("== PyKEEN throughput probe at 1000 negatives", file=sys.stderr, flush=True)
        pr = run_pykeen(args, work / "pykeen-probe-k1000", 1, 1000, limit_edges=args.probe_edges)
        probe = {"edges": pr["train_edges"], "train_s": pr["train_s"],
                 "edges_per_sec": pr["train_edges"] / pr["train_s"], "command": pr["command"]}

    hdr = "| system | negatives/positive | epochs | train s | positive edges/s | filtered MRR | Hits@10 |"
    lines = [hdr, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['negatives']} | {r['epochs']} | {r['train_s']:.1f} | {r['edges_per_sec']:.0f} "
            f"| {r['mrr']:.4f} | {r['hits_at_10']:.4f} |"
        )
    if probe:
        lines.append(
            f"| PyKEEN probe (first {probe['edges']} edges) | 1000 | 1 | {probe['train_s']:.1f} "
            f"| {probe['edges_per_sec']:.0f} | – | – |"
        )
    table = "\n".join(lines)
    print(f"\nwordnet-rr, ComplEx d={args.dim}, batch {args.batch_size}, Adagrad lr {args.lr}, "
          f"{args.threads} threads, CPU: {cpu_model()}, load average at the end {loadavg()}\n")
    print(table)
    print("\nCommands:")
    for r in rows:
        print(f"  {r['command']}")
    if probe:
        print(f"  {probe['command']}")
    (work / "pykeen-results.json").write_text(json.dumps({"rows": rows, "probe": probe, "cpu": cpu_model()}, indent=1))


if __name__ == "__main__":
    main()
