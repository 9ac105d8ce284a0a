"""On a GPU (skipped without one; scripts/gpu/python-gpu.sh runs them on the GPU machines):
training from Python on the GPU engine, and queries answered on the GPU with the CPU's answers."""

from __future__ import annotations

import shutil
import subprocess

import pandas as pd
import pytest

import legend
from conftest import SMALL


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not has_gpu(), reason="needs a GPU (scripts/gpu/python-gpu.sh)")


def test_training_on_the_gpu_from_python(umls, tmp_path):
    events: list[dict] = []
    run = legend.train(umls, tmp_path / "run", SMALL, device="cuda:0", progress=events.append)
    assert events[0]["engine"].startswith("cuda:0"), events[0]
    assert run.result["metrics"]["mrr"] > 0.3, run.result


def test_gpu_queries_answer_what_the_cpu_answers(trained):
    path = trained[0].path
    with legend.open(path, device="cpu") as cpu, legend.open(path, device="cuda:0") as gpu:
        assert gpu.placement.startswith("cuda:0"), gpu.placement
        heads = list(range(0, len(cpu.entities), 7))
        pd.testing.assert_frame_equal(
            gpu.predict(head=heads, relation=1, k=10), cpu.predict(head=heads, relation=1, k=10)
        )
        for metric in ("cosine", "dot", "l2"):
            pd.testing.assert_frame_equal(
                gpu.neighbors(heads, k=5, metric=metric), cpu.neighbors(heads, k=5, metric=metric)
            )
        triples = cpu.triples("test")
        pd.testing.assert_frame_equal(gpu.score(triples), cpu.score(triples))
