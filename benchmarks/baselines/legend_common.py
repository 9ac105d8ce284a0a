"""Helpers shared by the baseline scripts: read a Legend dataset, write foreign embeddings
in Legend's layout, and score them with `legendctl eval` (Legend's filtered evaluator).

Legend's ComplEx rows are [real parts (dim/2) | imaginary parts (dim/2)], and the score is
Re(<s, r, conj(d)>). Row i of entities.npy is the entity with Legend id i (DS/entities.tsv).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
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
    protocol: str = "filtered",
) -> dict:
    """Test metrics of foreign embeddings by Legend's evaluator (`legendctl eval`): `filtered`,
    or `sampled` with the evaluator's fixed default negatives and seed (the same for every
    embedding evaluated this way)."""
    cmd = [
        legendctl, "eval", "--dataset", str(dataset), "--decoder", decoder,
        "--embeddings", str(emb_dir), "--protocol", protocol, "--threads", str(threads), "--json",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 and "unexpected argument" in p.stderr and reference_run is not None:
        # Older legendctl: no foreign-embedding mode yet.
        print("legendctl eval has no --embeddings; evaluating through a run directory", file=sys.stderr)
        run = _fake_run(emb_dir, dataset, decoder, reference_run)
        cmd = [legendctl, "eval", str(run), "--protocol", protocol, "--threads", str(threads), "--json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_legend_train(legendctl: str, dataset: Path, out: Path, settings: list[str], nice: int = 0) -> dict:
    """Runs `legendctl train --json`; returns per-epoch records, final metrics, wall seconds, the
    command, its log (stderr) and what `run_monitored` measured of it (`monitored`; each epoch
    record's `proc_written` is the bytes the process had written to storage when it printed it)."""
    cmd = [legendctl, "train", "--dataset", str(dataset), "--out", str(out)]
    for s in settings:
        cmd += ["--set", s]
    cmd.append("--json")
    full = (["nice", "-n", str(nice)] if nice else []) + cmd
    m = run_monitored(full, mark=re.compile(r"^\{"))
    if m.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({m.returncode}):\n{m.text('stderr')[-4000:]}")
    epochs, final = [], None
    for line in m.lines:
        if line.stream != "stdout" or line.written is None:
            continue
        rec = json.loads(line.text)
        if rec.get("final"):
            final = rec
        elif "epoch" in rec:
            rec["proc_written"] = line.written
            epochs.append(rec)
    return {"command": " ".join(cmd), "epochs": epochs, "final": final, "wall_s": m.wall_s,
            "log": m.text("stderr"), "monitored": m}


def _proc_io(pid: int | str) -> tuple[int, int, int]:
    """(write_bytes, cancelled_write_bytes, read_bytes) of a process and its reaped children,
    from /proc/PID/io: bytes it caused to be sent to storage (page-cache writes when dirtied,
    O_DIRECT writes when issued), bytes of dirty pages dropped before writeback (truncated or
    deleted files), and bytes read from storage (page-cache hits not counted). Zeros for a
    process that has gone."""
    try:
        fields = dict(line.split(":") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except (OSError, ValueError):
        return 0, 0, 0
    return int(fields["write_bytes"]), int(fields["cancelled_write_bytes"]), int(fields["read_bytes"])


def _tree(root: int) -> list[int]:
    """`root` and its live descendants (from /proc/*/stat's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces or ')': the parent id follows the last ')'.
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _memory_kib(pid: int) -> tuple[int, int]:
    """(Pss, Rss) of a process in KiB from /proc/PID/smaps_rollup; (0, 0) once it has gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    values = dict(re.findall(r"^(Pss|Rss):\s+(\d+) kB", text, re.M))
    return int(values.get("Pss", 0)), int(values.get("Rss", 0))


def tree_written(root: int) -> int:
    """Bytes the live process tree under `root` has written to storage so far."""
    return sum(_proc_io(pid)[0] for pid in _tree(root))


@dataclass
class OutputLine:
    """A line a monitored command printed."""

    t: float
    """Seconds after the command started, when the line was read."""
    stream: str
    """`stdout` or `stderr`."""
    text: str
    written: int | None
    """For lines matching `run_monitored`'s `mark`: the process tree's bytes written to storage
    when the line was read."""


@dataclass
class Monitored:
    """What `run_monitored` saw of a command."""

    command: list[str]
    returncode: int
    wall_s: float
    lines: list[OutputLine] = field(default_factory=list)
    peak_pss: int = 0
    """The largest sum of the process tree's proportional set sizes seen (bytes): memory shared
    between its processes (PBG's Hogwild workers share the embeddings) counted once."""
    peak_rss: int = 0
    """The largest sum of the tree's resident set sizes seen (bytes; shared pages once per
    process)."""
    written: int = 0
    """Bytes the whole tree wrote to storage (write_bytes of /proc/PID/io, children included)."""
    cancelled: int = 0
    """Of them, bytes of dirty pages dropped before reaching the disk (cancelled_write_bytes)."""
    read: int = 0
    """Bytes the whole tree read from storage (read_bytes: reads served by the page cache are
    not counted)."""
    loads: list[float] = field(default_factory=list)
    """The machine's 1-minute load average at each sample."""

    def text(self, stream: str) -> str:
        return "".join(line.text + "\n" for line in self.lines if line.stream == stream)


def run_monitored(cmd: list[str], env: dict | None = None, mark: re.Pattern | None = None,
                  interval: float = 0.5) -> Monitored:
    """Runs `cmd` to its end, keeping its output lines (stamped with the time they were read),
    sampling the memory of its process tree and the load average every `interval` seconds and counting the bytes the
    tree writes to storage. Lines matching `mark` also carry the tree's bytes written when they
    were read, so that a system's own progress lines (an epoch's end) split its writes.

    The total is this process's /proc/self/io difference over the run: a child's counts are
    added to its parent's when it is reaped, so it holds every descendant that was waited for
    (a daemonised grandchild would be missed; neither system makes one). This process must not
    write to storage meanwhile: its threads only read /proc and pipes."""
    before = _proc_io("self")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace")
    result = Monitored(command=cmd, returncode=-1, wall_s=0.0)
    lock = threading.Lock()
    done = threading.Event()

    def read(stream, name: str) -> None:
        for raw in stream:
            text = raw.rstrip("\n")
            written = tree_written(proc.pid) if mark is not None and mark.search(text) else None
            with lock:
                result.lines.append(OutputLine(time.perf_counter() - t0, name, text, written))

    def sample() -> None:
        while not done.wait(interval):
            pss = rss = 0
            for pid in _tree(proc.pid):
                p, r = _memory_kib(pid)
                pss, rss = pss + p, rss + r
            result.peak_pss = max(result.peak_pss, pss * 1024)
            result.peak_rss = max(result.peak_rss, rss * 1024)
            result.loads.append(float(loadavg().split()[0]))

    threads = [threading.Thread(target=read, args=(proc.stdout, "stdout")),
               threading.Thread(target=read, args=(proc.stderr, "stderr")),
               threading.Thread(target=sample)]
    for t in threads:
        t.start()
    # Waited for without reaping it, so that marks read after its exit still find its counts.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    result.wall_s = time.perf_counter() - t0
    for t in threads[:2]:
        t.join()
    done.set()
    threads[2].join()
    result.returncode = proc.wait()
    after = _proc_io("self")
    result.written, result.cancelled, result.read = (a - b for a, b in zip(after, before))
    return result


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
