"""Issue 29 (Measure): Legend out of core against PyTorch-BigGraph 1.0.0 out of core, on the CPU,
on the same generated graph (`legendctl generate`, power-law degrees, one relation type).

Both keep the node embeddings and their AdaGrad state in N partitions on disk and only a few in
memory: PBG two (the bucket's left- and right-hand partitions; it writes the others to its
checkpoint directory as .h5 files and reads them back), Legend C (`storage.backend=file`:
an O_DIRECT store, `storage.buffer_capacity=C`). Same decoder (Dot: PBG operator "none",
comparator "dot"; or ComplEx), d, batch, negatives (PBG: num_uniform_negs=K, no batch negatives,
so chunks of K positives sharing K negatives per side; Legend: num_chunks = B / K), softmax loss,
learning rate, initialisation and row-wise AdaGrad (PBG's; Legend's optimizer.state=row), 2
threads (PBG: 2 Hogwild workers of one thread).

The runs alternate (Legend, PBG, Legend, PBG, ...; Legend's buffer sizes in turn) because the
machine is shared and its load drifts. For every run: each epoch's wall time and edges/s, the
bytes written to storage (Legend's own count from metrics.jsonl and, for both, the processes'
/proc/PID/io write_bytes between epoch lines), the peak memory of the process tree (sum of PSS,
sampled), the load average, and the quality of both by Legend's evaluator on exported
embeddings (`legendctl eval --embeddings --protocol sampled`: the test split against 1000
uniform + 1000 degree-proportional negatives, the evaluator's fixed seed; the same command for
both). Run through run-pbg-disk.sh.
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
from legend_common import cpu_model, legend_eval, loadavg, run_legend_train  # noqa: E402

PBG = "PyTorch-BigGraph 1.0.0"


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--legendctl", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--edges", type=int, default=10_000_000, help="all splits (0.9 / 0.05 / 0.05)")
    ap.add_argument("--skew", type=float, default=0.8, help="legendctl generate --skew")
    ap.add_argument("--graph-seed", type=int, default=1)
    ap.add_argument("--decoder", default="dot", choices=sorted(pbg_common.OPERATORS))
    ap.add_argument("--dim", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--negatives", type=int, default=100, help="per positive and side; PBG's chunk size")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="Legend's training.seed")
    ap.add_argument("--partitions", type=int, default=4, help="N, both systems")
    ap.add_argument("--buffers", default="2,3", help="Legend's C values, run in turn")
    ap.add_argument("--epochs", type=int, default=2, help="per run; epoch 1 writes partitions it never read")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each C (and as many PBG runs)")
    ap.add_argument("--report-only", action="store_true",
                    help="print the table of the runs already in the work directory's results file, run nothing")
    args = ap.parse_args()
    args.buffers = [int(c) for c in args.buffers.split(",")]
    if args.batch_size % args.negatives:
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of --negatives {args.negatives} "
                 "(PBG's chunks are --negatives positives)")
    if any(not 2 <= c <= args.partitions for c in args.buffers):
        sys.exit(f"--buffers {args.buffers}: each C must lie in 2..{args.partitions} (--partitions)")
    return args


def main() -> None:
    args = arguments()
    work = args.work / f"pbg-disk-{args.nodes}-{args.edges}-n{args.partitions}"
    results = work / "pbg-disk-results.json"
    if args.report_only:
        if not results.exists():
            sys.exit(f"--report-only: {results} does not exist (no runs of these --nodes/--edges/--partitions yet)")
        report(args, json.loads(results.read_text())["runs"])
        return
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / "dataset"
    if not (dataset / "dataset.toml").exists():
        subprocess.run(
            [args.legendctl, "generate", "--nodes", str(args.nodes), "--edges", str(args.edges), "--relations", "1",
             "--skew", str(args.skew), "--seed", str(args.graph_seed), "--json", str(dataset)],
            check=True, stdout=sys.stderr,
        )
    num_entities, num_relations = args.nodes, 1
    runs: list[dict] = []
    pbg = work / "pbg"
    bindir = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def evaluate(emb: Path) -> dict:
        m = legend_eval(args.legendctl, dataset, emb, args.decoder, threads=args.threads, protocol="sampled")
        shutil.rmtree(emb)
        return m

    def legend(c: int, tag: str) -> None:
        out = work / f"legend-{tag}"
        shutil.rmtree(out, ignore_errors=True)
        settings = [
            f"model.decoder={args.decoder}", f"model.dim={args.dim}", "model.loss=softmax_ce",
            "model.init_scale=0.001", "model.relation_init=identity",
            f"training.num_epochs={args.epochs}", f"training.batch_size={args.batch_size}",
            f"training.negatives.num_chunks={args.batch_size // args.negatives}",
            f"training.negatives.negatives_per_positive={args.negatives}",
            "training.negatives.degree_fraction=0", f"optimizer.learning_rate={args.lr}", "optimizer.state=row",
            f"training.threads={args.threads}", f"training.seed={args.seed}",
            "storage.backend=file", f"storage.num_partitions={args.partitions}", f"storage.buffer_capacity={c}",
            "evaluation.protocol=sampled",
        ]
        before = loadavg()
        print(f"== Legend {tag} (C = {c}), load {before}", file=sys.stderr, flush=True)
        r = run_legend_train(args.legendctl, dataset, out, settings)
        m = r["monitored"]
        written = [e["proc_written"] for e in r["epochs"]]
        epochs = [{
            "epoch": e["epoch"], "seconds": e["seconds"], "edges": e["edges"], "edges_per_sec": e["edges_per_sec"],
            "written": e["bytes_written"], "read": e["bytes_read"], "io_s": e["io_s"], "io_wait_s": e["io_wait_s"],
            "proc_written": w - (written[i - 1] if i else 0), "peak_rss_bytes": e["peak_rss_bytes"],
        } for i, (e, w) in enumerate(zip(r["epochs"], written))]
        store = out / "store.bin"
        exported = out / "export"
        subprocess.run([args.legendctl, "export", str(out), "--format", "npy"], check=True, stdout=sys.stderr)
        q = evaluate(exported)
        runs.append({
            "system": f"Legend, C = {c}", "tag": tag, "command": r["command"], "epochs": epochs,
            "wall_s": r["wall_s"], "peak_pss": m.peak_pss, "peak_rss": m.peak_rss, "written": m.written,
            "cancelled": m.cancelled, "read": m.read, "at_rest": store.stat().st_size if store.exists() else 0,
            "in_run_mrr": r["final"]["metrics"]["mrr"], "mrr": q["mrr"], "hits_at_10": q["hits_at_10"],
            "load": [before, loadavg()], "load_during": [min(m.loads), max(m.loads)] if m.loads else [],
        })
        shutil.rmtree(out)

    def pbg_config(tag: str) -> Path:
        return pbg_common.write_config(
            pbg / f"config-{tag}.py", pbg=pbg, checkpoint=pbg / f"model-{tag}", num_relations=num_relations,
            decoder=args.decoder, partitions=args.partitions, dim=args.dim, lr=args.lr, epochs=args.epochs,
            batch_size=args.batch_size, negatives=args.negatives, threads=args.threads,
        )

    def pbg_run(tag: str) -> None:
        config = pbg_config(tag)
        ckpt = pbg / f"model-{tag}"
        shutil.rmtree(ckpt, ignore_errors=True)
        before = loadavg()
        print(f"== PBG {tag}, load {before}", file=sys.stderr, flush=True)
        r = pbg_common.train(bindir, config, pbg / f"train-{tag}.log", env)
        at_rest = sum(f.stat().st_size for f in ckpt.glob("embeddings_*.h5"))
        exported = pbg / f"export-{tag}"
        pbg_common.export(ckpt, pbg / "data", dataset, num_entities, num_relations, args.dim, args.decoder,
                          args.partitions, exported)
        q = evaluate(exported)
        for e in r["epochs"]:
            e["edges_per_sec"] = e["edges"] / e["seconds"]
            e["proc_written"] = e.pop("written")
        runs.append({
            "system": PBG, "tag": tag, "command": r["command"], "config": config.read_text(), "epochs": r["epochs"],
            "wall_s": r["wall_s"], "peak_pss": r["peak_pss"], "peak_rss": r["peak_rss"], "written": r["written"],
            "cancelled": r["cancelled"], "read": r["read"], "at_rest": at_rest, "mrr": q["mrr"], "hits_at_10": q["hits_at_10"],
            "load": [before, loadavg()], "load_during": r["load_during"],
        })
        shutil.rmtree(ckpt)

    if not (pbg / "data" / "train_partitioned").exists():
        shutil.rmtree(pbg, ignore_errors=True)
        pbg_common.import_edges(dataset, pbg, args.partitions)

    # Legend, PBG, Legend, PBG, ...: Legend's C values in turn, as many PBG runs as Legend runs.
    for i in range(args.repeats * len(args.buffers)):
        c = args.buffers[i % len(args.buffers)]
        legend(c, f"c{c}-{i // len(args.buffers) + 1}")
        pbg_run(f"{i + 1}")
        results.write_text(json.dumps({"runs": runs, "cpu": cpu_model()}, indent=1))
    report(args, runs)


def report(args: argparse.Namespace, runs: list[dict]) -> None:
    """The Markdown table: per system, medians (and extremes) over its runs; epoch figures are of
    the epochs after the first (epoch 1 writes partitions it has not read: nothing is on disk
    yet)."""
    print(f"\n{args.nodes:,} nodes, {args.edges:,} edges (generated, one relation), {args.decoder} d = {args.dim}, "
          f"batch {args.batch_size}, {args.negatives} negatives per positive and side in chunks of {args.negatives}, "
          f"softmax, row-wise AdaGrad lr {args.lr}, {args.threads} threads, N = {args.partitions}, "
          f"{args.epochs} epochs a run; CPU: {cpu_model()}\n")
    print("| system | runs | epoch 1 s | later epochs s, median (min) | edges/s, median (max) | I/O waited s an epoch "
          "| MB written an epoch | MB written a run (/proc) | MB read a run (/proc) | GB at rest | peak memory GiB, PSS (RSS) | Legend's training peak RSS GiB "
          "| sampled MRR, median (range) | Hits@10 | load (1 min) during runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        later = [e for r in mine for e in r["epochs"][1:]]
        secs = [e["seconds"] for e in later]
        rates = [e["edges_per_sec"] for e in later]
        # Legend's own count (/proc cannot split its last epoch from the checkpoint that follows
        # it at once); PBG's from /proc between its "Starting" and "Finished epoch" lines.
        per_epoch = [e["written"] if system != PBG else e["proc_written"] for e in later]
        # Legend: compute waiting for its I/O thread; PBG: its swaps and edge loads, which block.
        waited = [e["io_wait_s"] if system != PBG else e["io_s"] for e in later]
        mrr = [r["mrr"] for r in mine]
        loads = [x for r in mine for x in r["load_during"]]
        # Legend's own figure (metrics.jsonl) leaves out the final evaluation, which the process
        # tree's peak includes (it gathers the whole entity table); PBG's process only trains.
        trained = "–" if system == PBG else f"{max(e['peak_rss_bytes'] for r in mine for e in r['epochs']) / 2**30:.2f}"
        print(f"| {system} | {len(mine)} | {np.median([r['epochs'][0]['seconds'] for r in mine]):.1f} "
              f"| {np.median(secs):.1f} ({min(secs):.1f}) | {np.median(rates):,.0f} ({max(rates):,.0f}) "
              f"| {np.median(waited):.1f} | {np.median(per_epoch) / 1e6:,.0f} | {np.median([r['written'] for r in mine]) / 1e6:,.0f} "
              f"| {np.median([r['read'] for r in mine]) / 1e6:,.0f} "
              f"| {np.median([r['at_rest'] for r in mine]) / 1e9:.2f} | {max(r['peak_pss'] for r in mine) / 2**30:.2f} ({max(r['peak_rss'] for r in mine) / 2**30:.2f}) | {trained} "
              f"| {np.median(mrr):.4f} ({min(mrr):.4f}–{max(mrr):.4f}) "
              f"| {np.median([r['hits_at_10'] for r in mine]):.4f} | {min(loads):.1f}–{max(loads):.1f} |")
    print("\nRuns, in order (epoch seconds; MB written by epoch, /proc; load before / after):")
    for r in runs:
        ep = r["epochs"]
        print(f"  {r['system']} {r['tag']}: " + ", ".join(f"{e['seconds']:.1f} s" for e in ep)
              + "; " + ", ".join(f"{e['proc_written'] / 1e6:,.0f}" for e in ep)
              + f"; whole run {r['wall_s']:.0f} s, {r['written'] / 1e6:,.0f} MB written "
              f"({r['cancelled'] / 1e6:,.0f} dropped before writeback), {r['read'] / 1e6:,.0f} MB read, "
              f"peak PSS {r['peak_pss'] / 2**30:.2f} GiB (RSS {r['peak_rss'] / 2**30:.2f}), MRR {r['mrr']:.4f}; load {r['load'][0]} / {r['load'][1]}")
    print("\nCommands:")
    for system in dict.fromkeys(r["system"] for r in runs):
        print(f"  {next(r['command'] for r in runs if r['system'] == system)}")


if __name__ == "__main__":
    main()
