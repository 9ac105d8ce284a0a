"""Helpers shared by the baseline scripts: read a Legend dataset, write foreign embeddings
in Legend's layout, and score them with `legendctl eval` (Legend's filtered evaluator).

Legend's ComplEx rows are [real parts (dim/2) | imaginary parts (dim/2)], and the score is
Re(<s, r, conj(d)>). Row i of entities.npy is the entity with Legend id i (DS/entities.tsv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np


def read_tsv_ids(path: Path) -> list[str]:
    """`id<TAB>label` lines -> labels, indexed by id (checked to be 0..n-1 in order)."""
    labels = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            ident, label = line.rstrip("\n").split("\t", 1)
            if int(ident) != i:
                raise ValueError(f"{path}: line {i + 1} has id {ident}, expected {i}")
            labels.append(label)
    return labels


def read_edges(dataset: Path, split: str) -> np.ndarray:
    """`edges/<split>.bin`: little-endian u32 [src, rel, dst] rows -> int64 array (n, 3)."""
    raw = np.fromfile(dataset / "edges" / f"{split}.bin", dtype="<u4")
    if raw.size % 3:
        raise ValueError(f"{dataset}/edges/{split}.bin: {raw.size} words is not a multiple of 3")
    return raw.reshape(-1, 3).astype(np.int64)


def write_embeddings(out: Path, entities: np.ndarray, relations: np.ndarray) -> None:
    """Writes entities.npy / relations.npy as C-order little-endian float32."""
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "entities.npy", np.ascontiguousarray(entities, dtype="<f4"))
    np.save(out / "relations.npy", np.ascontiguousarray(relations, dtype="<f4"))


def complex_scores(entities: np.ndarray, relations: np.ndarray, triples: np.ndarray) -> np.ndarray:
    """Legend's ComplEx score Re(<s, r, conj(d)>) of (src, rel, dst) id rows, in float64, from
    rows in Legend's [real | imaginary] layout."""

    def as_complex(rows: np.ndarray) -> np.ndarray:
        half = rows.shape[1] // 2
        return rows[:, :half].astype(np.float64) + 1j * rows[:, half:].astype(np.float64)

    s = as_complex(entities[triples[:, 0]])
    r = as_complex(relations[triples[:, 1]])
    d = as_complex(entities[triples[:, 2]])
    return np.real((s * r * np.conj(d)).sum(axis=1))


def check_export(system: str, theirs: np.ndarray, entities: np.ndarray, relations: np.ndarray,
                 triples: np.ndarray) -> None:
    """Exits unless a system's own scores of `triples` equal Legend's ComplEx formula on the
    exported rows (the check that the conversion to Legend's ids and layout is right)."""
    ours = complex_scores(entities, relations, triples)
    if not np.allclose(theirs, ours, rtol=1e-4, atol=1e-6):
        sys.exit(f"export check failed: {system} {theirs[:4]} vs Legend layout {ours[:4]}")


def _fake_run(emb_dir: Path, dataset: Path, decoder: str, reference_run: Path) -> Path:
    """For a legendctl without `eval --embeddings`: wrap the npy files in a run directory
    (run.toml + checkpoint tables, zero AdaGrad state) that `legendctl eval RUN` accepts.
    The dataset identity is copied from a Legend run on the same dataset."""
    ent = np.load(emb_dir / "entities.npy").astype("<f4")
    rel = np.load(emb_dir / "relations.npy").astype("<f4")
    meta_text = (reference_run / "run.toml").read_text()
    identity = next(
        line.split("=", 1)[1].strip().strip('"')
        for line in meta_text.splitlines()
        if line.startswith("dataset_identity")
    )
    run = emb_dir / "as-run"
    ck = run / "checkpoints" / "epoch-00000"
    ck.mkdir(parents=True, exist_ok=True)
    tables = {
        "entities.bin": ent.tobytes(),
        "entities.state.bin": np.zeros_like(ent).tobytes(),
        "relations.bin": rel.tobytes(),
        "relations.state.bin": np.zeros_like(rel).tobytes(),
    }
    for name, data in tables.items():
        (ck / name).write_bytes(data)
    crc = {k: zlib.crc32(v) & 0xFFFFFFFF for k, v in tables.items()}
    (run / "run.toml").write_text(
        "format_version = 1\n"
        f'dataset = "{dataset.resolve()}"\n'
        f'dataset_identity = "{identity}"\n'
        f'decoder = "{decoder}"\n'
        f"dim = {ent.shape[1]}\n"
        f"entities = {ent.shape[0]}\n"
        f"relations = {rel.shape[0]}\n"
        "epochs_completed = 0\n"
        'checkpoint = "checkpoints/epoch-00000"\n'
        "\n[checksums]\n"
        f"entities = {crc['entities.bin']}\n"
        f"entities_state = {crc['entities.state.bin']}\n"
        f"relations = {crc['relations.bin']}\n"
        f"relations_state = {crc['relations.state.bin']}\n"
    )
    return run


def baseline_arguments(doc: str, negatives: int, negatives_help: str, device: str) -> argparse.ArgumentParser:
    """The options every baseline trainer takes (Legend's dataset, settings, output)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", type=Path, required=True, help="Legend dataset dir (legendctl import)")
    ap.add_argument("--out", type=Path, required=True, help="output dir: entities.npy, relations.npy, train.json")
    ap.add_argument("--dim", type=int, default=200, help="real floats per row (Legend's model.dim)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--negatives", type=int, default=negatives, help=negatives_help)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--init-scale", type=float, default=1e-3)
    ap.add_argument("--device", default=device, help="cpu or cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-edges", type=int, default=0, help="train on the first N edges only (probing)")
    return ap


def write_summary(out: Path, system: str, epochs: list[dict], train_s: float, train_edges: int,
                  settings: dict) -> None:
    """`train.json` of a baseline's run, then the final JSON line its driver waits for."""
    summary = {
        "system": system,
        "epochs": epochs,
        "train_s": train_s,
        "train_edges": train_edges,
        "settings": settings,
    }
    (out / "train.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"final": True, "train_s": train_s}), flush=True)


def legend_eval(
    legendctl: str,
    dataset: Path,
    emb_dir: Path,
    decoder: str = "complex",
    reference_run: Path | None = None,
    threads: int = 0,
) -> dict:
    """Filtered test metrics of foreign embeddings by Legend's evaluator (`legendctl eval`)."""
    cmd = [
        legendctl, "eval", "--dataset", str(dataset), "--decoder", decoder,
        "--embeddings", str(emb_dir), "--protocol", "filtered", "--threads", str(threads), "--json",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 and "unexpected argument" in p.stderr and reference_run is not None:
        # Older legendctl: no foreign-embedding mode yet.
        print("legendctl eval has no --embeddings; evaluating through a run directory", file=sys.stderr)
        run = _fake_run(emb_dir, dataset, decoder, reference_run)
        cmd = [legendctl, "eval", str(run), "--protocol", "filtered", "--threads", str(threads), "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_legend_train(legendctl: str, dataset: Path, out: Path, settings: list[str], nice: int = 0) -> dict:
    """Runs `legendctl train --json`; returns per-epoch records, final metrics, wall seconds, the
    command and its log (stderr)."""
    import time

    cmd = [legendctl, "train", "--dataset", str(dataset), "--out", str(out)]
    for s in settings:
        cmd += ["--set", s]
    cmd.append("--json")
    full = (["nice", "-n", str(nice)] if nice else []) + cmd
    t0 = time.perf_counter()
    p = subprocess.run(full, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    epochs, final = [], None
    for line in p.stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("final"):
            final = rec
        elif "epoch" in rec:
            epochs.append(rec)
    return {"command": " ".join(cmd), "epochs": epochs, "final": final, "wall_s": wall, "log": p.stderr}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def threads_env(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))


def loadavg() -> str:
    """1/5/15-minute load averages (the machine is shared: timings depend on them)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
