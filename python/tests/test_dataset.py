"""Datasets from Python: imported from files or DataFrames as `legendctl import` imports them,
read back as ids and labelled triples, PyKEEN's TSV read and written; bad input is refused
naming what is wrong, and nothing is left behind."""

from __future__ import annotations

import gzip
import subprocess

import numpy as np
import pandas as pd
import pytest

import legend
from legend.interop import read_triples, write_triples


def triple_set(frame: pd.DataFrame) -> set[tuple[str, str, str]]:
    return set(frame[["head", "relation", "tail"]].itertuples(index=False, name=None))


def test_a_file_import_equals_legendctls(umls, umls_raw, legendctl, tmp_path):
    out = tmp_path / "cli"
    subprocess.run(
        [legendctl, "import", "-o", out, "--train", umls_raw / "train.txt", "--valid",
         umls_raw / "valid.txt", "--test", umls_raw / "test.txt"],
        check=True, capture_output=True,
    )
    cli = legend.Dataset(out)
    assert cli.info["splits"] == umls.info["splits"] and cli.info["checksums"] == umls.info["checksums"]
    assert list(cli.entities) == list(umls.entities)
    edges = umls.edges("valid")
    assert edges.dtype == np.uint32 and edges.shape == (umls.info["splits"]["valid"], 3)
    np.testing.assert_array_equal(edges, cli.edges("valid"))


def test_dataframes_import_as_the_same_triples(umls, tmp_path):
    frames = {s: umls.triples(s) for s in legend.dataset.SPLITS}
    made = legend.import_triples(tmp_path / "frames", frames["train"], frames["valid"], frames["test"])
    for split, frame in frames.items():
        assert triple_set(made.triples(split)) == triple_set(frame)
    # Other column names: the first three, in the order `columns` says.
    swapped = frames["train"].rename(columns={"head": "s", "relation": "p", "tail": "o"})[["s", "o", "p"]]
    htr = legend.import_triples(tmp_path / "htr", swapped, columns="htr")
    assert triple_set(htr.triples()) == triple_set(frames["train"])
    # Ids as numbers become labels.
    numbers = pd.DataFrame({"head": [1, 2, 3], "relation": [0, 0, 1], "tail": [2, 3, 1]})
    ints = legend.import_triples(tmp_path / "ints", numbers)
    assert sorted(ints.entities) == ["1", "2", "3"] and sorted(ints.relations) == ["0", "1"]


def test_a_split_by_fractions_pools_frames_and_files(umls, umls_raw, tmp_path):
    made = legend.import_triples(
        tmp_path / "split", [umls.triples("train"), umls_raw / "valid.txt"], split=(0.8, 0.1, 0.1), seed=3
    )
    counts = made.info["splits"]
    total = umls.info["splits"]["train"] + umls.info["splits"]["valid"]
    assert counts["train"] + counts["valid"] + counts["test"] + made.info["unseen_dropped"] == total


@pytest.mark.parametrize(
    ("label", "why"),
    [
        ("a\tb", "tab or line break"),
        ("a\nb", "tab or line break"),
        (" a", "whitespace"),
        ("", "empty label"),
        ("#a", "comment"),
        (None, "missing value"),
    ],
)
def test_labels_text_cannot_carry_are_refused_naming_the_row(tmp_path, label, why):
    frame = pd.DataFrame({"head": ["x", label], "relation": ["r", "r"], "tail": ["y", "z"]})
    out = tmp_path / "bad"
    with pytest.raises(ValueError, match=why) as e:
        legend.import_triples(out, frame)
    assert "row 1" in str(e.value) and "head" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_bad_files_are_dataset_errors_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tr\tb\nc\tr\n")
    with pytest.raises(legend.DatasetError, match=r"bad.tsv:2: missing column"):
        legend.import_triples(tmp_path / "out", bad)
    with pytest.raises(legend.DatasetError, match="already exists"):
        legend.import_triples(tmp_path, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv"]


def test_pykeen_labelled_triples_are_read_and_written(umls, tmp_path):
    assert legend.interop.read_triples is read_triples  # `import legend` is enough
    path = tmp_path / "train.tsv"
    write_triples(umls.triples("train"), path)
    back = read_triples(path)
    pd.testing.assert_frame_equal(back, umls.triples("train").astype(str), check_dtype=False)
    # A gzipped PyKEEN file imports as it is.
    gz = tmp_path / "train.tsv.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    again = legend.import_triples(tmp_path / "again", gz)
    assert triple_set(again.triples()) == triple_set(back)
    with pytest.raises(ValueError, match="tab or a line break"):
        write_triples([("a\tb", "r", "c")], tmp_path / "x.tsv")
    assert not (tmp_path / "x.tsv").exists()


def test_labelled_triples_of_the_wrong_shape_are_refused_naming_the_line(tmp_path):
    # pandas would take a fourth field for an index and shift the columns: read_triples does not.
    for text, fields in (("a\tr\tb\nc\tr\td\te\n", 4), ("a\tr\tb\nc\tr\n", 2)):
        path = tmp_path / "odd.tsv"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"odd.tsv: line 2 has {fields} tab-separated fields, not 3"):
            read_triples(path)
    path.write_text("a\tr\tb\r\n\nNA\tr\t \n")
    assert read_triples(path).values.tolist() == [["a", "r", "b"], ["NA", "r", " "]]
    old = tmp_path / "old.tsv"
    old.write_text("kept\tr\tb\n")
    with pytest.raises(ValueError, match="head: missing value in row 1"):
        write_triples(pd.DataFrame({"head": ["a", None], "relation": ["r", "r"], "tail": ["b", "c"]}), old)
    with pytest.raises(ValueError, match="tail in row 0 is empty"):
        write_triples([("a", "r", "")], old)
    # The file that was there is untouched, and no partial file is left.
    assert old.read_text() == "kept\tr\tb\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.tsv", "old.tsv"]
