"""Issue 3 §10: CPU training throughput of Legend vs PyTorch-BigGraph 1.0.0, same run:
ComplEx (PBG: operator complex_diagonal, comparator dot), softmax loss, batch B, one chunk of B
positives sharing K uniform negatives per corrupted side (PBG: num_batch_negs=0,
num_uniform_negs=K, so its chunk size is K = B), both sides corrupted, lr 0.1, init N(0, 1e-3),
relations 1 + 0i, 2 threads (PBG: 2 Hogwild worker processes of one thread each).
Both embeddings are scored by Legend's filtered evaluator. Run through run-pbg.sh.

PBG is driven through its own CLIs (torchbiggraph_import_from_tsv, torchbiggraph_train) and
its checkpoint files (entity_names_all_0.json, embeddings_all_0.vN.h5, model.vN.h5).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from legend_common import (  # noqa: E402
    cpu_model, legend_eval, loadavg, read_edges, read_tsv_ids, run_legend_train, write_embeddings,
)

PBG_CONFIG = """\
# Written by benchmarks/baselines/compare_pbg.py
def get_torchbiggraph_config():
    return dict(
        entity_path={entity_path!r},
        edge_paths=[{edge_path!r}],
        checkpoint_path={checkpoint_path!r},
        entities={{"all": {{"num_partitions": 1}}}},
        relations=[
            dict(name=name, lhs="all", rhs="all", operator="complex_diagonal") for name in {relations!r}
        ],
        dynamic_relations=False,
        dimension={dim},
        init_scale=1e-3,
        global_emb=False,
        comparator="dot",
        loss_fn="softmax",
        lr={lr},
        num_epochs={epochs},
        batch_size={batch_size},
        num_batch_negs=0,
        num_uniform_negs={negatives},
        eval_fraction=0,
        workers={threads},
        hogwild_delay=0,
    )
"""


def export_pbg(
    ckpt: Path, pbg_data: Path, dataset: Path, num_entities: int, num_relations: int, dim: int, out: Path
) -> None:
    """PBG checkpoint -> Legend layout (rows in Legend id order, [re | im])."""
    import h5py
    import torch
    from torchbiggraph.model import ComplexDiagonalOperator

    version = int((ckpt / "checkpoint_version.txt").read_text().strip())
    names = json.loads((pbg_data / "entity_names_all_0.json").read_text())
    with h5py.File(ckpt / f"embeddings_all_0.v{version}.h5", "r") as hf:
        emb = hf["embeddings"][...]
    rng = np.random.default_rng(0)
    ent = (rng.standard_normal((num_entities, dim)) * 1e-3).astype(np.float32)  # never seen by PBG
    ids = np.array([int(n) for n in names], dtype=np.int64)
    ent[ids] = emb
    params = {}
    with h5py.File(ckpt / f"model.v{version}.h5", "r") as hf:
        hf["model"].visititems(lambda k, d: params.__setitem__(k, d[...]) if isinstance(d, h5py.Dataset) else None)
    half = dim // 2
    rel = np.zeros((num_relations, dim), dtype=np.float32)
    ops = []
    for i in range(num_relations):
        real = next(v for k, v in params.items() if re.search(rf"^relations/{i}/operator/rhs/real$", k))
        imag = next(v for k, v in params.items() if re.search(rf"^relations/{i}/operator/rhs/imag$", k))
        # PBG scores (s, r, d) as dot(s, r*d) = Re(sum s conj(r) conj(d)); Legend as
        # Re(sum s r conj(d)): Legend's relation is PBG's conjugated.
        rel[i, :half] = real
        rel[i, half:] = -imag
        ops.append((real, imag))
    # Self-check with PBG's own operator on a few edges.
    train = read_edges(dataset, "train")
    checked = 0
    if True:
        for i in range(num_relations):
            sel = train[train[:, 1] == i][:8]
            if len(sel) == 0:
                continue
            op = ComplexDiagonalOperator(dim)
            op.real.data = torch.from_numpy(ops[i][0])
            op.imag.data = torch.from_numpy(ops[i][1])
            with torch.no_grad():
                theirs = (torch.from_numpy(ent[sel[:, 0]]) * op(torch.from_numpy(ent[sel[:, 2]]))).sum(-1).numpy()
            s = ent[sel[:, 0], :half] + 1j * ent[sel[:, 0], half:]
            d = ent[sel[:, 2], :half] + 1j * ent[sel[:, 2], half:]
            r = rel[i, :half] + 1j * rel[i, half:]
            ours = np.real((s * r * np.conj(d)).sum(-1))
            if not np.allclose(theirs, ours, rtol=1e-3, atol=1e-6):
                sys.exit(f"PBG export check failed for relation {i}: {theirs[:3]} vs {ours[:3]}")
            checked += len(sel)
    print(f"export check: PBG's operator and Legend's formula agree on {checked} edges", file=sys.stderr)
    write_embeddings(out, ent, rel)


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
    ap.add_argument("--skip-legend", action="store_true")
    ap.add_argument("--skip-pbg", action="store_true")
    args = ap.parse_args()
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
    rows = []

    # --- Legend
    legend_run = work / "legend-run"
    if not args.skip_legend:
        shutil.rmtree(legend_run, ignore_errors=True)
        settings = [
            "model.decoder=complex", f"model.dim={args.dim}", "model.loss=softmax_ce", "model.init_scale=0.001",
            f"training.num_epochs={args.epochs}", f"training.batch_size={args.batch_size}",
            f"training.negatives.num_chunks={num_chunks}",
            f"training.negatives.negatives_per_positive={args.negatives}",
            "training.negatives.degree_fraction=0", f"training.learning_rate={args.lr}",
            f"training.threads={args.threads}", f"training.seed={args.seed}",
        ]
        print("== Legend", file=sys.stderr, flush=True)
        r = run_legend_train(args.legendctl, dataset, legend_run, settings)
        eps = [e["edges_per_sec"] for e in r["epochs"]]
        rows.append({
            "system": "Legend", "epochs": args.epochs, "train_s": sum(e["seconds"] for e in r["epochs"]),
            "edges_per_sec_mean": float(np.mean(eps)), "edges_per_sec_median": float(np.median(eps)),
            "wall_s": r["wall_s"], "mrr": r["final"]["metrics"]["mrr"],
            "hits_at_10": r["final"]["metrics"]["hits_at_10"], "command": r["command"], "load": loadavg(),
        })

    # --- PBG
    if not args.skip_pbg:
        pbg = work / "pbg"
        shutil.rmtree(pbg, ignore_errors=True)
        (pbg / "data").mkdir(parents=True)
        train = read_edges(dataset, "train")
        rel_names = [f"r{i}" for i in range(num_relations)]
        tsv = pbg / "train.tsv"
        with open(tsv, "w") as f:
            for s, r_, d in train:
                f.write(f"{s}\tr{r_}\t{d}\n")
        config = pbg / "config.py"
        config.write_text(PBG_CONFIG.format(
            entity_path=str(pbg / "data"), edge_path=str(pbg / "data" / "train_partitioned"),
            checkpoint_path=str(pbg / "model"), relations=rel_names, dim=args.dim, lr=args.lr,
            epochs=args.epochs, batch_size=args.batch_size, negatives=args.negatives, threads=args.threads,
        ))
        bindir = Path(sys.executable).parent
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        imp = [str(bindir / "torchbiggraph_import_from_tsv"), "--lhs-col", "0", "--rel-col", "1", "--rhs-col", "2",
               str(config), str(tsv)]
        print("+ " + " ".join(imp), file=sys.stderr, flush=True)
        subprocess.run(imp, check=True, stdout=sys.stderr, stderr=sys.stderr, env=env)
        cmd = [str(bindir / "torchbiggraph_train"), str(config)]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        wall = time.perf_counter() - t0
        (pbg / "train.log").write_text(p.stdout)
        if p.returncode != 0:
            sys.exit(f"torchbiggraph_train failed ({p.returncode}); log {pbg / 'train.log'}:\n{p.stdout[-4000:]}")
        # "Processed N edges in T s ( R M/sec )" once per bucket per epoch (one bucket here)
        per = [(int(n), float(t)) for n, t in re.findall(r"Processed (\d+) edges in ([0-9.]+) s", p.stdout)]
        if len(per) != args.epochs:
            print(f"warning: {len(per)} 'Processed' lines for {args.epochs} epochs", file=sys.stderr)
        eps = [n / t for n, t in per]
        emb_dir = pbg / "export"
        export_pbg(pbg / "model", pbg / "data", dataset, num_entities, num_relations, args.dim, emb_dir)
        m = legend_eval(args.legendctl, dataset, emb_dir, "complex", reference_run=legend_run)
        rows.append({
            "system": "PyTorch-BigGraph 1.0.0", "epochs": args.epochs, "train_s": sum(t for _, t in per),
            "edges_per_sec_mean": float(np.mean(eps)), "edges_per_sec_median": float(np.median(eps)),
            "wall_s": wall, "mrr": m["mrr"], "hits_at_10": m["hits_at_10"], "command": " ".join(cmd), "load": loadavg(),
            "config": config.read_text(),
        })

    print(f"\n{args.data.name}: ComplEx d={args.dim}, softmax loss, batch {args.batch_size}, "
          f"{args.negatives} uniform negatives per positive and side (chunk of {min(args.batch_size, args.negatives)}), "
          f"lr {args.lr}, {args.epochs} epochs, {args.threads} threads, CPU: {cpu_model()}, load average at the end {loadavg()}\n")
    print("| system | positive edges/s (median epoch) | mean | train s (sum of epochs) | process wall s | filtered MRR | Hits@10 | load avg after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['edges_per_sec_median']:.0f} | {r['edges_per_sec_mean']:.0f} | {r['train_s']:.1f} "
              f"| {r['wall_s']:.1f} | {r['mrr']:.4f} | {r['hits_at_10']:.4f} | {r['load']} |")
    if len(rows) == 2:
        print(f"\nLegend / PBG throughput: {rows[0]['edges_per_sec_median'] / rows[1]['edges_per_sec_median']:.2f}x")
    print("\nCommands:")
    for r in rows:
        print(f"  {r['command']}")
    (work / "pbg-results.json").write_text(json.dumps({"rows": rows, "cpu": cpu_model()}, indent=1))


if __name__ == "__main__":
    main()
