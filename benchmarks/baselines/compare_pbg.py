"""Issue 3 §10: CPU training throughput of Legend vs PyTorch-BigGraph 1.0.0, same run:
ComplEx (PBG: operator complex_diagonal, comparator dot), softmax loss, batch B, one chunk of B
positives sharing K uniform negatives per corrupted side (PBG: num_batch_negs=0,
num_uniform_negs=K, so its chunk size is K = B), both sides corrupted, lr 0.1, init N(0, 1e-3),
relations 1 + 0i, 2 threads (PBG: 2 Hogwild worker processes of one thread each).
Both embeddings are scored by Legend's filtered evaluator. Run through run-pbg.sh.

PBG is driven through pbg_common: its input files as torchbiggraph_import_from_tsv writes them,
its training CLI (torchbiggraph_train) and its checkpoint files (entity_names_all_0.json,
embeddings_all_0.vN.h5, model.vN.h5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pbg_common  # noqa: E402
from legend_common import cpu_model, legend_eval, loadavg, read_tsv_ids, run_legend_train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legendctl", required=True)
    ap.add_argument("--data", type=Path, required=True, help="dir with train/valid/test.txt")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--negatives", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="extra throughput rounds (alternating order)")
    ap.add_argument("--throughput-epochs", type=int, default=3)
    ap.add_argument("--skip-legend", action="store_true")
    ap.add_argument("--skip-pbg", action="store_true")
    args = ap.parse_args()
    if args.epochs < 2:
        # Each run's first epoch is left out of the rates (it starts PBG's workers).
        ap.error(f"--epochs {args.epochs}: at least 2, the first epoch of each run is not timed")
    if args.batch_size != args.negatives:
        print("note: PBG's chunk size is num_uniform_negs; Legend runs num_chunks = batch/negatives", file=sys.stderr)
    num_chunks = max(1, args.batch_size // args.negatives)

    work = args.work / f"pbg-{args.data.name}"
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / "dataset"
    if not (dataset / "dataset.toml").exists():
        subprocess.run(
            [args.legendctl, "import", "-o", str(dataset), "--train", str(args.data / "train.txt"),
             "--valid", str(args.data / "valid.txt"), "--test", str(args.data / "test.txt"), "--json"],
            check=True, stdout=sys.stderr,
        )
    num_entities = len(read_tsv_ids(dataset / "entities.tsv"))
    num_relations = len(read_tsv_ids(dataset / "relations.tsv"))
    runs: list[dict] = []

    def legend_train(tag: str, epochs: int) -> dict:
        out = work / f"legend-{tag}"
        shutil.rmtree(out, ignore_errors=True)
        settings = [
            "model.decoder=complex", f"model.dim={args.dim}", "model.loss=softmax_ce", "model.init_scale=0.001",
            "model.relation_init=identity",
            f"training.num_epochs={epochs}", f"training.batch_size={args.batch_size}",
            f"training.negatives.num_chunks={num_chunks}",
            f"training.negatives.negatives_per_positive={args.negatives}",
            "training.negatives.degree_fraction=0", f"optimizer.learning_rate={args.lr}",
            f"training.threads={args.threads}", f"training.seed={args.seed}",
        ]
        print(f"== Legend {tag} ({epochs} epochs), load {loadavg()}", file=sys.stderr, flush=True)
        r = run_legend_train(args.legendctl, dataset, out, settings)
        rec = {
            "system": "Legend", "tag": tag, "epochs": epochs, "out": str(out), "command": r["command"],
            "epoch_rates": [e["edges_per_sec"] for e in r["epochs"]],
            "train_s": sum(e["seconds"] for e in r["epochs"]), "wall_s": r["wall_s"],
            "mrr": r["final"]["metrics"]["mrr"], "hits_at_10": r["final"]["metrics"]["hits_at_10"],
            "load_after": loadavg(),
        }
        runs.append(rec)
        return rec

    pbg = work / "pbg"
    bindir = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def pbg_config(tag: str, epochs: int) -> Path:
        return pbg_common.write_config(
            pbg / f"config-{tag}.py", pbg=pbg, checkpoint=pbg / f"model-{tag}", num_relations=num_relations,
            decoder="complex", partitions=1, dim=args.dim, lr=args.lr, epochs=epochs,
            batch_size=args.batch_size, negatives=args.negatives, threads=args.threads,
        )

    def pbg_train(tag: str, epochs: int) -> dict:
        config = pbg_config(tag, epochs)
        shutil.rmtree(pbg / f"model-{tag}", ignore_errors=True)
        print(f"== PBG {tag} ({epochs} epochs), load {loadavg()}", file=sys.stderr, flush=True)
        r = pbg_common.train(bindir, config, pbg / f"train-{tag}.log", env)
        rec = {
            "system": "PyTorch-BigGraph 1.0.0", "tag": tag, "epochs": epochs, "command": r["command"],
            # Training time only ("Processed N edges in T s"); the first epoch's includes starting
            # the Hogwild worker processes.
            "epoch_rates": [e["edges"] / e["compute_s"] for e in r["epochs"]],
            "train_s": sum(e["compute_s"] for e in r["epochs"]), "wall_s": r["wall_s"],
            "ckpt": str(pbg / f"model-{tag}"), "config": config.read_text(), "load_after": loadavg(),
        }
        runs.append(rec)
        return rec

    if not args.skip_pbg and not (pbg / "data" / "train_partitioned").exists():
        shutil.rmtree(pbg, ignore_errors=True)
        pbg_common.import_edges(dataset, pbg, 1)

    # Quality run (also timed): Legend then PBG, args.epochs each; MRR of both by Legend's evaluator.
    if not args.skip_legend:
        legend_train("quality", args.epochs)
    if not args.skip_pbg:
        q = pbg_train("quality", args.epochs)
        emb_dir = pbg / "export-quality"
        pbg_common.export(Path(q["ckpt"]), pbg / "data", dataset, num_entities, num_relations, args.dim,
                          "complex", 1, emb_dir)
        m = legend_eval(args.legendctl, dataset, emb_dir, "complex", reference_run=work / "legend-quality")
        q["mrr"], q["hits_at_10"] = m["mrr"], m["hits_at_10"]
    # Throughput rounds, alternating which system goes first (the machine is shared; load drifts).
    for i in range(args.rounds):
        order = ["pbg", "legend"] if i % 2 == 0 else ["legend", "pbg"]
        for which in order:
            if which == "pbg" and not args.skip_pbg:
                pbg_train(f"tput{i + 1}", args.throughput_epochs)
            if which == "legend" and not args.skip_legend:
                legend_train(f"tput{i + 1}", args.throughput_epochs)

    print(f"\n{args.data.name}: ComplEx d={args.dim}, softmax loss, batch {args.batch_size}, "
          f"{args.negatives} uniform negatives per positive and side (chunk of {min(args.batch_size, args.negatives)}), "
          f"lr {args.lr}, {args.threads} threads, CPU: {cpu_model()}, load average at the end {loadavg()}\n")
    print("| system | positive edges/s, median epoch (first epoch of each run left out) | min – max | epochs (runs) "
          f"| {args.epochs}-epoch run: train s | filtered MRR | Hits@10 |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        # Each run's first epoch is left out (PBG's includes starting its worker processes).
        rates = [x for r in mine for x in r["epoch_rates"][1:]]
        q = next((r for r in mine if r["tag"] == "quality"), None)
        summary[system] = float(np.median(rates))
        print(f"| {system} | {np.median(rates):.0f} | {min(rates):.0f} – {max(rates):.0f} | {len(rates)} ({len(mine)}) "
              f"| {q['train_s']:.1f} | {q['mrr']:.4f} | {q['hits_at_10']:.4f} |" if q else "| – | – | – |")
    if len(summary) == 2:
        a, b = summary.values()
        print(f"\nLegend / PBG throughput (medians): {a / b:.2f}x")
    print("\nRuns (per-epoch positive edges/s):")
    for r in runs:
        print(f"  {r['system']} {r['tag']}: " + ", ".join(f"{x:.0f}" for x in r["epoch_rates"])
              + f"  (load after {r['load_after']})")
    print("\nCommands:")
    for r in runs:
        if r["tag"] == "quality":
            print(f"  {r['command']}")
    (work / "pbg-results.json").write_text(json.dumps({"runs": runs, "cpu": cpu_model()}, indent=1))


if __name__ == "__main__":
    main()
