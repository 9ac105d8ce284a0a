"""A run's tables as NumPy equal what `legendctl export` writes, bit for bit: memory-mapped from
a checkpoint file of f32 rows (no copy), copied from 16-bit rows and from a store."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import legend
from conftest import SMALL


def export(legendctl, run: Path, out: Path) -> Path:
    subprocess.run([legendctl, "export", run, "--format", "npy", "-o", out], check=True, capture_output=True)
    return out


def the_table(array: np.ndarray):
    """The extension's Table behind an array (NumPy keeps it as the buffer's owner)."""
    base = array.base
    return base.obj if isinstance(base, memoryview) else base


def same_as_export(run: legend.Run, exported: Path) -> np.ndarray:
    entities = run.embeddings()
    assert entities.dtype == np.float32 and entities.shape == (run.info["entities"], run.info["dim"])
    np.testing.assert_array_equal(entities, np.load(exported / "entities.npy"))
    np.testing.assert_array_equal(run.relation_embeddings(), np.load(exported / "relations.npy"))
    labels = (exported / "relations.labels.txt").read_text().splitlines()
    assert run.relation_embedding_labels == labels
    assert list(run.entities) == (exported / "entities.labels.txt").read_text().splitlines()
    return entities


def test_f32_checkpoint_rows_are_mapped_not_copied(trained, legendctl, tmp_path):
    run = trained[0]
    entities = same_as_export(run, export(legendctl, run.path, tmp_path / "export"))
    assert not entities.flags.writeable and not entities.flags.owndata
    assert the_table(entities).mapped
    with pytest.raises(ValueError):
        entities[0, 0] = 1.0
    rows = run.rows([run.entities[3], 9])
    np.testing.assert_array_equal(rows, entities[[3, 9]])
    # The best epoch's tables are a run too.
    assert run.best() is None


def test_a_newer_checkpoint_leaves_a_mapped_array_as_it_was(umls, tmp_path):
    out = tmp_path / "run"
    run = legend.train(umls, out, SMALL, {"training.num_epochs": 1}, progress=False)
    before = run.embeddings()
    kept = before.copy()
    legend.train(out=out, resume=True, overrides={"training.num_epochs": 2}, progress=False)
    np.testing.assert_array_equal(before, kept)
    assert not np.array_equal(run.embeddings(), kept)


@pytest.mark.parametrize(
    "layout",
    [
        {"storage.dtype": "bf16"},
        {"storage.backend": "file", "storage.num_partitions": 2},
    ],
    ids=["bf16", "file-store"],
)
def test_16_bit_and_store_rows_are_copied_and_equal_the_export(umls, legendctl, tmp_path, layout):
    run = legend.train(umls, tmp_path / "run", SMALL, {"training.num_epochs": 1, **layout}, progress=False)
    entities = same_as_export(run, export(legendctl, run.path, tmp_path / "export"))
    assert not the_table(entities).mapped and not entities.flags.writeable
    np.testing.assert_array_equal(run.rows([0, 5]), entities[[0, 5]])


def test_a_decoder_without_relations_has_an_empty_relation_table(umls, tmp_path):
    run = legend.train(umls, tmp_path / "run", {"model": {"decoder": "dot", "dim": 8}, "training": {"num_epochs": 1}}, progress=False)
    assert run.relation_embeddings().shape[0] == 0 and run.relation_embedding_labels == []
    assert run.embeddings().shape == (len(run.entities), 8)


def test_a_damaged_checkpoint_is_refused_when_verified(trained, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained[0].path, copy)
    meta = legend.open(copy).info
    table = copy / meta["checkpoint"] / "entities.bin"
    data = bytearray(table.read_bytes())
    data[100] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(legend.RunError, match="checksum mismatch"):
        legend.open(copy).embeddings()
    assert legend.open(copy).embeddings(verify=False).shape == (meta["entities"], meta["dim"])
    table.write_bytes(bytes(data[:-4]))
    with pytest.raises(legend.RunError, match="expected"):
        legend.open(copy).embeddings(verify=False)


def test_not_a_run_is_a_run_error_saying_what_it_is(umls, tmp_path):
    with pytest.raises(legend.RunError, match="does not exist"):
        legend.open(tmp_path / "missing")
    with pytest.raises(legend.RunError, match="it is a dataset"):
        legend.open(umls.path)


def test_torch_embedding_weights_are_the_tables(trained):
    torch = pytest.importorskip("torch")
    from legend.interop import torch_embeddings

    run = trained[0]
    entities, relations = torch_embeddings(run)
    assert isinstance(entities, torch.nn.Embedding)
    np.testing.assert_array_equal(entities.weight.detach().numpy(), run.embeddings())
    np.testing.assert_array_equal(relations.weight.detach().numpy(), run.relation_embeddings())
