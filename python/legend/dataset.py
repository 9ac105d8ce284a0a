"""Dataset directories: imported from TSV files or DataFrames (as ``legendctl import``), and
read back as labels, id arrays and labelled triples."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import pandas as pd

from . import _legend

__all__ = ["Dataset", "import_triples", "import_marius", "SPLITS"]

SPLITS = ("train", "valid", "test")

Source = Union[str, "os.PathLike[str]", pd.DataFrame]
"""Edges: a text file (TSV, CSV or whitespace-separated, optionally gzip) or a DataFrame."""

# What the importer trims from a field, and so what a label given in a DataFrame must not
# start or end with (it would not survive the trip through text).
_ASCII_SPACE = " \t\n\x0c\r"


def label_indexes(entities: list[str], relations: list[str]) -> tuple[pd.Index, pd.Index]:
    """Entity and relation labels as the Indexes ``entities`` and ``relations`` answer (an id
    is a position)."""
    return pd.Index(entities, name="entity", dtype=object), pd.Index(relations, name="relation", dtype=object)


class Dataset:
    """A dataset directory (``legend.import_triples`` or ``legendctl import`` made it)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._info = json.loads(_legend.dataset_info(os.fspath(path)))
        self._labels: tuple[pd.Index, pd.Index] | None = None

    def __repr__(self) -> str:
        i = self._info
        return (
            f"<legend.Dataset {str(self.path)!r}: {i['entities']} entities, {i['relations']} "
            f"relations, {i['splits']['train']}/{i['splits']['valid']}/{i['splits']['test']} edges>"
        )

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    @property
    def info(self) -> dict[str, Any]:
        """The dataset's record (``dataset.toml``): ``entities``, ``relations``, ``splits``
        (edges per split), ``sources``, ``seed``, ``unseen_dropped``, ..."""
        return dict(self._info)

    def _load_labels(self) -> tuple[pd.Index, pd.Index]:
        if self._labels is None:
            self._labels = label_indexes(*_legend.dataset_labels(os.fspath(self.path)))
        return self._labels

    @property
    def entities(self) -> pd.Index:
        """The entity labels, by id (an entity's id is its position)."""
        return self._load_labels()[0]

    @property
    def relations(self) -> pd.Index:
        """The relation labels, by id."""
        return self._load_labels()[1]

    def edges(self, split: str = "train") -> np.ndarray:
        """The edges of ``split`` as ids: ``(n, 3)`` uint32, ``[head, relation, tail]``
        (read-only)."""
        return np.asarray(_legend.dataset_edges(os.fspath(self.path), split))

    def triples(self, split: str = "train") -> pd.DataFrame:
        """The edges of ``split`` with labels: ``head``, ``relation``, ``tail`` columns (the
        shape of PyKEEN's labelled triples; :func:`legend.interop.write_triples` writes them)."""
        edges = self.edges(split)
        entities, relations = self.entities, self.relations
        return pd.DataFrame(
            {
                "head": entities.take(edges[:, 0]),
                "relation": relations.take(edges[:, 1]),
                "tail": entities.take(edges[:, 2]),
            }
        )


# The columns of a DataFrame of edges, in the order `columns` writes them.
_ORDER = {"hrt": ("head", "relation", "tail"), "htr": ("head", "tail", "relation"), "sd": ("head", "tail")}


def _frame_columns(frame: pd.DataFrame, columns: str) -> list[pd.Series]:
    """The columns of a DataFrame of edges in the order ``columns`` names: by name (``head``,
    ``relation``, ``tail``) when it has them, else its first ones, taken in that order."""
    if columns not in _ORDER:
        raise ValueError(f"columns {columns!r}: expected one of {', '.join(_ORDER)}")
    order = _ORDER[columns]
    if set(order) <= set(frame.columns):
        return [frame[c] for c in order]
    if frame.shape[1] < len(order):
        raise ValueError(
            f"a DataFrame of edges needs the columns {', '.join(order)} (or {len(order)} columns), "
            f"got {list(frame.columns)}"
        )
    return [frame.iloc[:, i] for i in range(len(order))]


def _check_labels(column: pd.Series, what: str, first: bool) -> pd.Series:
    """``column`` as labels, or a ``ValueError`` naming the first value that text cannot carry
    (missing, empty, a tab or line break, surrounding spaces, a leading ``#`` in the first
    column, which reads as a comment)."""
    missing = column.isna()
    if missing.any():
        raise ValueError(f"{what}: missing value in row {missing.idxmax()!r}")
    labels = column.astype(str)
    problems = [
        (labels == "", "an empty label"),
        (labels.str.contains(r"[\t\r\n]", regex=True), "a tab or line break"),
        (labels.str.strip(_ASCII_SPACE) != labels, "leading or trailing whitespace"),
    ]
    if first:
        problems.append((labels.str.startswith("#"), "a leading '#' (it would read as a comment)"))
    for bad, why in problems:
        if bad.any():
            row = bad.idxmax()
            raise ValueError(f"{what}: {why} in row {row!r}: {labels[row]!r}")
    return labels


def _write_frame(frame: pd.DataFrame, columns: str, path: Path, what: str) -> None:
    if len(frame) == 0:
        raise ValueError(f"{what}: the DataFrame has no edges")
    cols = [
        _check_labels(c, f"{what}, column {c.name!r}", first=(i == 0))
        for i, c in enumerate(_frame_columns(frame, columns))
    ]
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines("\t".join(row) + "\n" for row in zip(*cols))


def _sources(
    given: dict[str, Source | None], columns: str, staging: Path
) -> tuple[dict[str, str | None], bool]:
    """Paths for the importer: files as given, DataFrames written to TSV under ``staging`` in
    the column order ``columns`` names; and whether any was a DataFrame."""
    paths: dict[str, str | None] = {}
    framed = False
    for split, source in given.items():
        if source is None:
            paths[split] = None
        elif isinstance(source, pd.DataFrame):
            path = staging / f"{split}.tsv"
            _write_frame(source, columns, path, f"{split} DataFrame")
            paths[split] = os.fspath(path)
            framed = True
        else:
            paths[split] = os.fspath(source)
    return paths, framed


def import_triples(
    out: str | os.PathLike[str],
    train: Source | Sequence[Source],
    valid: Source | None = None,
    test: Source | None = None,
    *,
    split: tuple[float, float, float] | None = None,
    columns: str = "hrt",
    delimiter: str | None = None,
    seed: int = 0,
    keep_unseen: bool = False,
) -> Dataset:
    """Imports edges into the new dataset directory ``out`` (it must not exist; its parent is
    created) and returns it; ``legendctl import`` does the same.

    Each of ``train``, ``valid``, ``test`` is a text file (tab-, comma- or space-separated,
    detected from its first line unless ``delimiter`` says: ``tab``, ``comma``, ``whitespace``
    or one character; gzip is recognised; ``#`` lines are comments; PyKEEN's labelled-triples
    TSV is such a file) or a DataFrame (columns ``head``, ``relation``, ``tail``, else its first
    three, in ``columns``' order; labels are its values as text, and a value text cannot carry,
    such as a tab, is refused naming its row). ``columns`` is the column order: ``hrt`` (head,
    relation, tail), ``htr``, or ``sd`` for graphs without relation types (two columns; a
    DataFrame's ``head`` and ``tail``, else its first two).

    ``split=(0.9, 0.05, 0.05)`` instead pools ``train`` (one source or a list) and splits it at
    random by those fractions, with ``seed``. Valid and test edges whose entity or relation
    never occurs in train are dropped unless ``keep_unseen``. Entity ids are permuted with
    ``seed`` (so id ranges make balanced partitions).

    Nothing is left behind when the import fails or Ctrl-C stops it.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".legend-import-", dir=out.parent) as staging:
        if split is not None:
            if valid is not None or test is not None:
                raise ValueError("split divides train's edges: give no valid or test with it")
            pool = list(train) if isinstance(train, (list, tuple)) else [train]
            given = {f"part{i}": s for i, s in enumerate(pool)}
            paths, framed = _sources(given, columns, Path(staging))
            summary = _legend.import_dataset(
                os.fspath(out),
                split_files=[p for p in paths.values() if p is not None],
                fractions=tuple(float(f) for f in split),
                columns=columns,
                delimiter=_delimiter(delimiter, framed),
                seed=seed,
                keep_unseen=keep_unseen,
            )
        else:
            if isinstance(train, (list, tuple)):
                raise ValueError("a list of train sources is split with split=(train, valid, test)")
            paths, framed = _sources({"train": train, "valid": valid, "test": test}, columns, Path(staging))
            summary = _legend.import_dataset(
                os.fspath(out),
                train=paths["train"],
                valid=paths["valid"],
                test=paths["test"],
                columns=columns,
                delimiter=_delimiter(delimiter, framed),
                seed=seed,
                keep_unseen=keep_unseen,
            )
    json.loads(summary)
    return Dataset(out)


def _delimiter(delimiter: str | None, framed: bool) -> str | None:
    """The delimiter for the importer: a DataFrame is written tab-separated, which detection
    finds (its labels hold no tab), so only another delimiter given for files conflicts."""
    if framed and delimiter not in (None, "tab", "\t"):
        raise ValueError(f"DataFrames are imported tab-separated, so delimiter {delimiter!r} cannot apply to all sources")
    return delimiter


def import_marius(out: str | os.PathLike[str], directory: str | os.PathLike[str], *, seed: int = 0) -> Dataset:
    """Imports a directory preprocessed by Marius (``dataset.yaml``, ``edges/*_edges.bin``)
    into the new dataset directory ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _legend.import_dataset(os.fspath(out), marius=os.fspath(directory), seed=seed)
    return Dataset(out)
