"""A trained run: its labels, tables as NumPy arrays, and queries answered as DataFrames."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import _legend, _queries
from ._closing import Closing
from .dataset import Dataset, label_indexes
from .errors import UnknownNameError

__all__ = ["Run", "open"]

_open = open  # the builtin, which `open` below shadows


class Run(Closing):
    """A training run directory opened for reading: ``legend.open(path)``.

    The run is read as it is on disk now: a run still training elsewhere shows its latest
    checkpoint. Arrays returned by :meth:`embeddings` stay valid after :meth:`close` and after
    the run commits newer checkpoints (a mapped checkpoint file is unlinked, never changed).

    A ``Run`` may be shared by threads: queries release the GIL and run at the same time;
    :meth:`close` waits for the queries under way.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dataset: str | os.PathLike[str] | None = None,
        device: str = "auto",
        streamed: bool = False,
        cache_fraction: float | None = None,
    ) -> None:
        self.path = Path(path)
        kwargs: dict[str, Any] = {"dataset": None if dataset is None else os.fspath(dataset),
                                  "device": device, "streamed": streamed}
        if cache_fraction is not None:
            kwargs["cache_fraction"] = cache_fraction
        self._handle = _legend.RunHandle(os.fspath(path), **kwargs)
        self._dataset_dir = dataset
        self._labels: tuple[pd.Index, pd.Index] | None = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<legend.Run {str(self.path)!r} ({state})>"

    def close(self) -> None:
        """Releases what queries hold (rows in memory, a store, GPU memory). Arrays already
        returned stay valid; anything else asked of the run afterwards raises ``ValueError``."""
        self._handle.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._handle.closed

    # The record and the labels.

    @property
    def info(self) -> dict[str, Any]:
        """The run's record (``run.toml``): ``decoder``, ``dim``, ``entities``, ``relations``
        (rows of the relation table), ``epochs_completed``, ``dataset``, ``store``, ..."""
        return json.loads(self._handle.info())

    @property
    def config(self) -> dict[str, Any]:
        """The resolved configuration (``config.toml``) as a dict."""
        import tomllib

        self._handle.info()  # raises if closed or no longer a run
        with _open(self.path / "config.toml", "rb") as f:
            return tomllib.load(f)

    def _load_labels(self) -> tuple[pd.Index, pd.Index]:
        if self._labels is None:
            self._labels = label_indexes(*self._handle.labels())
        return self._labels

    @property
    def entities(self) -> pd.Index:
        """The entity labels; an entity's id is its position (``entities.get_loc(label)``,
        ``entities.get_indexer(labels)`` give ids)."""
        return self._load_labels()[0]

    @property
    def relations(self) -> pd.Index:
        """The relation labels of the dataset, by id."""
        return self._load_labels()[1]

    @property
    def relation_embedding_labels(self) -> list[str]:
        """The label of each row of :meth:`relation_embeddings`: the relations, then, with
        reciprocal relations, their inverses (``LABEL_inverse``, as ``legendctl export``)."""
        info = self.info
        if info["relations"] == 0:  # a decoder without relations (dot)
            return []
        relations = list(self.relations)
        if info.get("reciprocal_relations"):
            relations += [f"{r}_inverse" for r in relations]
        return relations

    @property
    def dataset(self) -> Dataset:
        """The run's dataset."""
        where = self._dataset_dir if self._dataset_dir is not None else self.info["dataset"]
        return Dataset(where)

    def triples(self, split: str = "train") -> pd.DataFrame:
        """The labelled triples of a split of the run's dataset (see :meth:`Dataset.triples`)."""
        return self.dataset.triples(split)

    # Tables.

    def embeddings(self, *, verify: bool = True) -> np.ndarray:
        """The entity embeddings, ``(entities, dim)`` float32, row ``i`` entity ``i``, read-only.

        When the run's checkpoint is a file of f32 rows (the ``memory`` backend, and every
        ``best/``), the array is that file memory-mapped: no copy, pages read as they are used.
        Rows kept 16-bit at rest (``storage.dtype``) or in a store (the ``file``, ``proxy``,
        ``nvme`` backends) are copied into memory, widened to f32; a copy larger than the
        memory available is refused (read some with :meth:`rows`). ``verify`` checks the mapped
        file's checksum first (one pass over it; copies are always checked as they are read).
        """
        return np.asarray(self._handle.embeddings(verify=verify))

    def relation_embeddings(self) -> np.ndarray:
        """The relation embeddings, ``(rows, width)`` float32 (a copy: the table is small), one
        row per relation, then per inverse relation with reciprocal relations (labels:
        :attr:`relation_embedding_labels`). ``width`` is the decoder's relation width: ``dim``,
        or ``dim * dim`` for RESCAL (a row-major matrix a row)."""
        return np.asarray(self._handle.relation_embeddings())

    def rows(self, entities: Any) -> np.ndarray:
        """The embeddings of some entities (labels or ids), ``(len(entities), dim)`` float32,
        each row read alone: from the checkpoint file, or only the store blocks that hold it."""
        ids = [self.entity_id(e) for e in ([entities] if not _queries.is_many(entities) else entities)]
        return np.asarray(self._handle.rows(ids))

    def entity_id(self, entity: _queries.Name) -> int:
        """The id of an entity given by label (or by id, checked)."""
        return self._id(entity, self.entities, "entity")

    def relation_id(self, relation: _queries.Name) -> int:
        """The id of a relation given by label (or by id, checked)."""
        return self._id(relation, self.relations, "relation")

    def _id(self, name: _queries.Name, labels: pd.Index, kind: str) -> int:
        if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
            if not 0 <= name < len(labels):
                raise UnknownNameError(f"{kind} id {name} is out of range (the dataset has {len(labels)})")
            return int(name)
        try:
            return int(labels.get_loc(name))
        except KeyError:
            raise UnknownNameError(f"unknown {kind} {name!r}: not a label of the dataset") from None

    def _name(self, name: _queries.Name, kind: str) -> str:
        """A name for a query: a label as given; an id as its label (so an id is never taken
        for a label that happens to read as a number)."""
        if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
            labels = self.entities if kind == "entity" else self.relations
            return str(labels[self._id(name, labels, kind)])
        if not isinstance(name, str):
            raise TypeError(f"an {kind} is a label (str) or an id (int), not {type(name).__name__}")
        return name

    # Queries.

    def _answer(self, queries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return json.loads(self._handle.answer(json.dumps(queries)))

    def predict(
        self,
        head: Any = None,
        relation: Any = None,
        tail: Any = None,
        *,
        k: int = 10,
        filtered: bool = True,
    ) -> pd.DataFrame:
        """The ``k`` entities that best complete ``(head, relation, ?)`` or ``(?, relation,
        tail)``, scored by the run's decoder as the evaluation scores them, best first; with
        ``filtered``, entities that form a known triple (train, valid or test) are left out.

        Give the head to predict tails, or the tail to predict heads; by label or id. A list
        (or array, Series) of heads, tails or relations asks one query each (the others
        repeated), answered in one scan of the entities, and adds a ``query`` column.

        Returns a DataFrame with ``head_id``, ``head_label``, ``relation_id``,
        ``relation_label``, ``tail_id``, ``tail_label``, ``score`` (float32), ``rank`` (from
        1). Ties go to the lower id: the answer is exact and the same on every device.
        """
        queries, batch = _queries.predict_queries(self._name, head, relation, tail, k, filtered)
        return _queries.predictions_frame(self._answer(queries), batch)

    def score(self, triples: Any) -> pd.DataFrame:
        """The scores of ``triples``: a DataFrame (``head``, ``relation``, ``tail`` columns, or
        its first three), an ``(n, 3)`` array of ids, or a list of ``(head, relation, tail)``;
        labels or ids. One row per triple, in order, with ids, labels and ``score``."""
        return _queries.scores_frame(self._answer(_queries.score_queries(self._name, triples)))

    def neighbors(self, entity: Any, k: int = 10, metric: str = "cosine") -> pd.DataFrame:
        """The ``k`` entities nearest ``entity`` (a label or id, or a list of them) by
        ``metric``: ``cosine``, ``dot`` or ``l2`` (scored as the negative distance), nearest
        first: ``entity_id``, ``entity_label``, ``neighbor_id``, ``neighbor_label``,
        ``score``, ``rank`` (and ``query`` for a list)."""
        queries, batch = _queries.neighbor_queries(self._name, entity, k, metric)
        return _queries.neighbors_frame(self._answer(queries), batch)

    @property
    def placement(self) -> str:
        """Where queries are answered, in words: ``cpu`` (with why when ``auto`` found no GPU),
        or the GPU and where the entity rows are. Opens the query engine."""
        return self._handle.placement()

    # What training recorded.

    def metrics(self) -> pd.DataFrame:
        """The epochs of ``metrics.jsonl``, one row each (nested fields flattened:
        ``valid.mrr``, ...); the final evaluation is :attr:`result`."""
        lines = [line for line in self._metrics_lines() if not line.get("final")]
        return pd.json_normalize(lines) if lines else pd.DataFrame()

    @property
    def result(self) -> dict[str, Any] | None:
        """The final evaluation's line of ``metrics.jsonl`` (``metrics``: MRR, Hits@k, ...;
        ``best_epoch`` when the best epoch was ranked), or ``None`` before it."""
        finals = [line for line in self._metrics_lines() if line.get("final")]
        return finals[-1] if finals else None

    def _metrics_lines(self) -> list[dict[str, Any]]:
        self._handle.info()  # raises if closed or no longer a run
        try:
            with _open(self.path / "metrics.jsonl", encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line a crash cut short: the next resume drops it too
        return out

    def best(self, **kwargs: Any) -> Run | None:
        """The best validated epoch's tables (``RUN/best``, with ``evaluation.keep_best``) as a
        run of its own, opened with the same options unless ``kwargs`` change them; ``None``
        when the run keeps none."""
        best = self.path / "best"
        if not (best / "run.toml").is_file():
            return None
        return Run(best, **{"dataset": self._dataset_dir, **kwargs})


def open(
    path: str | os.PathLike[str],
    *,
    dataset: str | os.PathLike[str] | None = None,
    device: str = "auto",
    streamed: bool = False,
    cache_fraction: float | None = None,
) -> Run:
    """Opens the run directory ``path`` (what ``legend.train`` or ``legendctl train --out``
    made, or its ``best/``).

    ``dataset`` names the run's dataset if it moved since training. Queries answer on
    ``device``: ``cpu``, ``cuda:N``, or ``auto`` (GPU 0 when a CUDA driver is present and it
    opens, else the CPU), as ``legendctl predict --device``; on a GPU the entity rows go into its
    memory when they fit, and the answers are the CPU's. The first query reads the entity rows
    into memory when they take at most half the memory available, else (or with ``streamed``)
    every batch of queries reads them from the run a piece at a time. ``cache_fraction``: on a
    GPU, for rows that do not fit its memory, the row cache over the run's store (a fraction of
    the table; default 0.1).

    Use it as a context manager to release what queries hold: ``with legend.open(p) as run:``.
    """
    return Run(path, dataset=dataset, device=device, streamed=streamed, cache_fraction=cache_fraction)
