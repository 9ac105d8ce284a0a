"""PyTorch-BigGraph 1.0.0 through its own CLIs, for the baseline drivers (compare_pbg.py: one
partition in memory; compare_pbg_disk.py: N partitions swapped through the checkpoint directory):
its config, the import of a Legend dataset's train edges (the files torchbiggraph_import_from_tsv writes), a
training run (torchbiggraph_train) measured by legend_common.run_monitored and split into epochs
from PBG's own log, and the export of a checkpoint (entity_names_all_P.json,
embeddings_all_P.vN.h5, model.vN.h5) into Legend's id order and layout.

Entity names in PBG's input are Legend's ids and relation names `r<id>`, so the export maps rows
back without a table of its own.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

from legend_common import read_edges, run_monitored, write_embeddings

# Legend decoder -> PBG operator (applied to the right-hand side) with comparator "dot".
OPERATORS = {"complex": "complex_diagonal", "dot": "none"}

CONFIG = """\
# Written by benchmarks/baselines/pbg_common.py
def get_torchbiggraph_config():
    return dict(
        entity_path={entity_path!r},
        edge_paths=[{edge_path!r}],
        checkpoint_path={checkpoint_path!r},
        entities={{"all": {{"num_partitions": {partitions}}}}},
        relations=[
            dict(name=name, lhs="all", rhs="all", operator={operator!r}) for name in {relations!r}
        ],
        dynamic_relations=False,
        dimension={dim},
        init_scale={init_scale},
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


def write_config(path: Path, *, pbg: Path, checkpoint: Path, num_relations: int, decoder: str,
                 partitions: int, dim: int, lr: float, epochs: int, batch_size: int, negatives: int,
                 threads: int, init_scale: float = 1e-3) -> Path:
    """A PBG config for the data imported under `pbg` (`data/`, `data/train_partitioned`),
    checkpointing into `checkpoint`: softmax loss, `negatives` uniform negatives per positive and
    side with no batch negatives (so PBG's chunk is `negatives` positives sharing them), one entity
    type in `partitions` partitions, one operator per relation, `threads` Hogwild workers."""
    if decoder not in OPERATORS:
        sys.exit(f"--decoder {decoder}: PBG mapping exists for {', '.join(OPERATORS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CONFIG.format(
        entity_path=str(pbg / "data"), edge_path=str(pbg / "data" / "train_partitioned"),
        checkpoint_path=str(checkpoint), partitions=partitions, operator=OPERATORS[decoder],
        relations=[f"r{i}" for i in range(num_relations)], dim=dim, init_scale=init_scale, lr=lr,
        epochs=epochs, batch_size=batch_size, negatives=negatives, threads=threads,
    ))
    return path


def import_edges(dataset: Path, pbg: Path, partitions: int, seed: int = 0) -> None:
    """Imports the dataset's train edges into `pbg/data` (entity counts and names) and
    `pbg/data/train_partitioned` (one edge file a bucket) as torchbiggraph_import_from_tsv would
    for an entity type "all" in `partitions` partitions and relations `r<id>`: the entities that
    occur in the train edges, shuffled, partition p holding positions [ceil(p/N·n), ceil((p+1)/N·n))
    of that order (PBG's `Dictionary`), each edge in bucket (lhs partition, rhs partition) as
    offsets within them. Written through PBG's own storage classes, but vectorised: PBG's CLI
    appends one edge at a time (about 3,300 edges/s on the 2-core dev machine, 45 minutes for 9 M
    edges). Reads every bucket back and exits unless they hold exactly the train edges."""
    import torch
    from torchbiggraph.edgelist import EdgeList
    from torchbiggraph.entitylist import EntityList
    from torchbiggraph.graph_storages import EDGE_STORAGES, ENTITY_STORAGES

    train = read_edges(dataset, "train")
    names = np.random.default_rng(seed).permutation(np.unique(train[:, [0, 2]]))
    starts = np.array([math.ceil(p / partitions * len(names)) for p in range(partitions + 1)], dtype=np.int64)
    position = np.full(int(train[:, [0, 2]].max()) + 1, -1, dtype=np.int64)
    position[names] = np.arange(len(names))
    part = np.searchsorted(starts, position, side="right") - 1
    offset = position - starts[part]
    entities = ENTITY_STORAGES.make_instance(str(pbg / "data"))
    entities.prepare()
    for p in range(partitions):
        entities.save_count("all", p, int(starts[p + 1] - starts[p]))
        entities.save_names("all", p, [str(i) for i in names[starts[p]:starts[p + 1]]])
    # Written beside its final name and renamed once checked: a bucket directory means a finished import.
    final = pbg / "data" / "train_partitioned"
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    edges = EDGE_STORAGES.make_instance(str(partial))
    edges.prepare()
    bucket = part[train[:, 0]] * partitions + part[train[:, 2]]
    order = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[order], np.arange(partitions * partitions + 1))
    back = []
    for b in range(partitions * partitions):
        rows = train[order[bounds[b]:bounds[b + 1]]]
        lhs_p, rhs_p = divmod(b, partitions)
        if len(rows) == 0:  # PBG's importer writes no file for an empty bucket either
            continue
        edges.save_edges(lhs_p, rhs_p, EdgeList(
            EntityList.from_tensor(torch.from_numpy(offset[rows[:, 0]])),
            EntityList.from_tensor(torch.from_numpy(offset[rows[:, 2]])),
            torch.from_numpy(rows[:, 1].copy()),
        ))
        got = edges.load_edges(lhs_p, rhs_p)
        back.append(np.stack([names[starts[lhs_p] + got.lhs.to_tensor().numpy()], got.rel.numpy(),
                              names[starts[rhs_p] + got.rhs.to_tensor().numpy()]], axis=1))
    if not np.array_equal(np.sort(_keys(np.concatenate(back))), np.sort(_keys(train))):
        sys.exit(f"{partial}: the imported buckets do not hold {dataset}'s train edges")
    partial.rename(final)
    print(f"imported {len(train)} train edges of {len(names)} entities into {partitions}x{partitions} PBG buckets",
          file=sys.stderr)


def _keys(edges: np.ndarray) -> np.ndarray:
    """One int64 per (src, rel, dst) row with src, dst < 2^28 and rel < 2^7, for comparing edge multisets."""
    if edges.size and (edges[:, [0, 2]].max() >= 1 << 28 or edges[:, 1].max() >= 1 << 7):
        sys.exit("the import check packs ids into 28 bits and relations into 7")
    return (edges[:, 0] << 35) | (edges[:, 1] << 28) | edges[:, 2]


# PBG's log lines start with logging's asctime; the ones that delimit an epoch and a bucket.
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_EPOCH = re.compile(_STAMP + r".* (Starting|Finished) epoch (\d+) /")
_BUCKET = re.compile(r"Processed (\d+) edges in ([0-9.]+) s .*io: ([0-9.]+) s")


def train(bindir: Path, config: Path, log: Path, env: dict) -> dict:
    """Runs torchbiggraph_train on `config` (its output into `log`) and splits it by epoch.

    Returns `epochs`: per epoch `seconds` (PBG's clock from "Starting epoch" to "Finished epoch":
    every bucket's swap, edge load and training, and the last bucket's partitions written),
    `edges`, `compute_s` (the buckets' training, PBG's "Processed ... in T s") and `io_s` (its
    swaps and edge loads, "io: T s"), and `written` (bytes PBG's processes wrote to storage
    between those two lines); and `wall_s`, `peak_pss`, `peak_rss`, `written`, `cancelled`, `read`
    and the 1-minute load average's range (`load_during`) of the whole run (run_monitored)."""
    cmd = [str(bindir / "torchbiggraph_train"), str(config)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    m = run_monitored(cmd, env=env, mark=_EPOCH)
    output = m.text("stdout") + m.text("stderr")
    log.write_text(output)
    if m.returncode != 0:
        sys.exit(f"torchbiggraph_train failed ({m.returncode}); log {log}:\n{output[-4000:]}")
    epochs: list[dict] = []
    started: tuple[datetime, int] | None = None
    for line in m.lines:
        if (e := _EPOCH.search(line.text)) is not None:
            stamp = datetime.strptime(e.group(1), "%Y-%m-%d %H:%M:%S,%f")
            if e.group(2) == "Starting":
                started = (stamp, line.written or 0)
                epochs.append({"epoch": int(e.group(3)), "edges": 0, "compute_s": 0.0, "io_s": 0.0})
            elif started is not None:
                epochs[-1]["seconds"] = (stamp - started[0]).total_seconds()
                epochs[-1]["written"] = (line.written or 0) - started[1]
        elif (b := _BUCKET.search(line.text)) is not None and epochs:
            epochs[-1]["edges"] += int(b.group(1))
            epochs[-1]["compute_s"] += float(b.group(2))
            epochs[-1]["io_s"] += float(b.group(3))
    if not epochs or any("seconds" not in e for e in epochs):
        sys.exit(f"{log}: no complete 'Starting epoch' / 'Finished epoch' pair for every epoch")
    return {"command": " ".join(cmd), "epochs": epochs, "wall_s": m.wall_s, "peak_pss": m.peak_pss,
            "peak_rss": m.peak_rss, "written": m.written, "cancelled": m.cancelled, "read": m.read,
            "load_during": [min(m.loads), max(m.loads)] if m.loads else []}


def export(ckpt: Path, pbg_data: Path, dataset: Path, num_entities: int, num_relations: int, dim: int,
           decoder: str, partitions: int, out: Path, init_scale: float = 1e-3) -> None:
    """PBG checkpoint -> Legend layout (rows in Legend id order; ComplEx as [re | im]), checked:
    every entity name once, and for ComplEx PBG's own operator against Legend's formula."""
    import h5py

    version = int((ckpt / "checkpoint_version.txt").read_text().strip())
    rng = np.random.default_rng(0)
    # Entities absent from PBG's input (no train edge) keep a row drawn like Legend's initial ones.
    ent = (rng.standard_normal((num_entities, dim)) * init_scale).astype(np.float32)
    seen = np.zeros(num_entities, dtype=bool)
    for p in range(partitions):
        ids = np.array([int(n) for n in json.loads((pbg_data / f"entity_names_all_{p}.json").read_text())],
                       dtype=np.int64)
        with h5py.File(ckpt / f"embeddings_all_{p}.v{version}.h5", "r") as hf:
            emb = hf["embeddings"][...]
        if emb.shape != (len(ids), dim):
            sys.exit(f"{ckpt}: partition {p} holds {emb.shape}, its names say ({len(ids)}, {dim})")
        if ids.size and (ids.min() < 0 or ids.max() >= num_entities or seen[ids].any()
                         or len(np.unique(ids)) != len(ids)):
            sys.exit(f"{pbg_data}/entity_names_all_{p}.json: ids out of range or already in another partition")
        seen[ids] = True
        ent[ids] = emb
    print(f"export: {seen.sum()} of {num_entities} entities from {partitions} PBG partition(s)", file=sys.stderr)
    rel = np.zeros((num_relations, dim), dtype=np.float32)
    if decoder == "complex":
        rel = _complex_relations(ckpt / f"model.v{version}.h5", dataset, ent, num_relations, dim)
    write_embeddings(out, ent, rel)


def _complex_relations(model: Path, dataset: Path, ent: np.ndarray, num_relations: int, dim: int) -> np.ndarray:
    """Legend's ComplEx relation rows from PBG's complex_diagonal operators, checked against
    PBG's own operator on a few train edges of each relation."""
    import h5py
    import torch
    from torchbiggraph.model import ComplexDiagonalOperator

    params = {}
    with h5py.File(model, "r") as hf:
        hf["model"].visititems(lambda k, d: params.__setitem__(k, d[...]) if isinstance(d, h5py.Dataset) else None)
    half = dim // 2
    rel = np.zeros((num_relations, dim), dtype=np.float32)
    train = read_edges(dataset, "train")
    checked = 0
    for i in range(num_relations):
        real = params[f"relations/{i}/operator/rhs/real"]
        imag = params[f"relations/{i}/operator/rhs/imag"]
        # PBG scores (s, r, d) as dot(s, r*d) = Re(sum s conj(r) conj(d)); Legend as
        # Re(sum s r conj(d)): Legend's relation is PBG's conjugated.
        rel[i, :half] = real
        rel[i, half:] = -imag
        sel = train[train[:, 1] == i][:8]
        if len(sel) == 0:
            continue
        op = ComplexDiagonalOperator(dim)
        op.real.data = torch.from_numpy(real)
        op.imag.data = torch.from_numpy(imag)
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
    return rel
