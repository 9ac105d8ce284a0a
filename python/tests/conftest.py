"""Shared fixtures: UMLS (the bundled graph, fetched as scripts/main-job.sh fetches it), imported
once, and a small DistMult run trained on it from Python; the debug legendctl and legendd the
tests compare with (scripts/python-test.sh builds them and names them in LEGENDCTL, LEGENDD)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import legend

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LEGEND_CACHE", Path.home() / ".cache" / "legend"))

# Small enough to train in seconds on the dev build, large enough to rank sensibly.
SMALL = {
    "model": {"decoder": "distmult", "dim": 32, "reciprocal_relations": True},
    "training": {"num_epochs": 3, "threads": 2},
}


def binary(name: str) -> Path:
    """A debug binary of the workspace: $LEGENDCTL / $LEGENDD, else target/debug."""
    given = os.environ.get(name.upper())
    path = Path(given) if given else ROOT / "target" / "debug" / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it (`cargo build -p {name}`; scripts/python-test.sh does)")
    return path


@pytest.fixture(scope="session")
def legendctl() -> Path:
    return binary("legendctl")


@pytest.fixture(scope="session")
def legendd() -> Path:
    return binary("legendd")


@pytest.fixture(scope="session")
def umls_raw() -> Path:
    """UMLS's train/valid/test.txt, from the pykeen wheel (cached in $LEGEND_CACHE)."""
    raw = CACHE / "python-test" / "raw" / "umls"
    subprocess.run([ROOT / "scripts" / "pykeen-graph.sh", "umls", raw], check=True)
    return raw


@pytest.fixture(scope="session")
def umls(umls_raw: Path, tmp_path_factory: pytest.TempPathFactory) -> legend.Dataset:
    out = tmp_path_factory.mktemp("datasets") / "umls"
    return legend.import_triples(
        out, umls_raw / "train.txt", umls_raw / "valid.txt", umls_raw / "test.txt"
    )


@pytest.fixture(scope="session")
def trained(umls: legend.Dataset, tmp_path_factory: pytest.TempPathFactory) -> tuple[legend.Run, list[dict]]:
    """A run trained from Python, with the events its progress callback got."""
    events: list[dict] = []
    run = legend.train(umls, tmp_path_factory.mktemp("runs") / "umls", SMALL, progress=events.append)
    return run, events
