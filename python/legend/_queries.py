"""Queries as legend-query takes them (JSON objects naming entities and relations by label) and
its answers as pandas DataFrames: shared by a local :class:`legend.Run` and a daemon's serve job
(:meth:`legend.Client.predict`), so both answer in the same shape."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

import numpy as np
import pandas as pd

Name = Union[str, int, np.integer]
"""An entity or relation: its label, or its id."""

METRICS = ("cosine", "dot", "l2")


def is_many(value: Any) -> bool:
    """Whether ``value`` is a batch of names rather than one."""
    return not isinstance(value, (str, bytes, int, np.integer)) and isinstance(
        value, (Sequence, np.ndarray, pd.Series, pd.Index)
    )


def broadcast(**fields: Any) -> tuple[list[dict[str, Any]], bool]:
    """Zips the fields given as batches, repeating the ones given once: a list of per-query
    field dicts, and whether any field was a batch (the answer then numbers its queries)."""
    lengths = {name: len(v) for name, v in fields.items() if is_many(v)}
    if not lengths:
        return [dict(fields)], False
    n = set(lengths.values())
    if len(n) > 1:
        raise ValueError(f"batches of different lengths: {lengths}")
    count = n.pop()
    listed = {k: list(v) for k, v in fields.items() if k in lengths}
    rows = [{k: (listed[k][i] if k in listed else v) for k, v in fields.items()} for i in range(count)]
    return rows, True


# A k past every table's size asks for all the entities; larger ones are sent as this (the
# queries' `top` is an unsigned 64-bit count, and JSON would carry a larger one as a float).
_ALL = 2**63 - 1


def check_top(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k = {k!r}: ask for at least one entity")
    return min(int(k), _ALL)


def predict_queries(
    name: Callable[[Name, str], str],
    head: Any,
    relation: Any,
    tail: Any,
    k: int,
    filtered: bool,
) -> tuple[list[dict[str, Any]], bool]:
    """``predict`` queries: one end given (a name or a batch), the other predicted."""
    if (head is None) == (tail is None):
        raise ValueError("give the head (to predict tails) or the tail (to predict heads), not both")
    if relation is None:
        raise ValueError("give the relation")
    top = check_top(k)
    rows, batch = broadcast(end=head if tail is None else tail, relation=relation)
    side = "head" if tail is None else "tail"
    queries = []
    for row in rows:
        q: dict[str, Any] = {
            "query": "predict",
            "relation": name(row["relation"], "relation"),
            "top": top,
            "filtered": bool(filtered),
        }
        q[side] = name(row["end"], "entity")
        queries.append(q)
    return queries, batch


def triple_columns(triples: Any) -> tuple[Iterable[Any], Iterable[Any], Iterable[Any]]:
    """The head, relation and tail columns of ``triples``: a DataFrame (columns ``head``,
    ``relation``, ``tail``, else its first three), an (n, 3) array, or a list of triples."""
    if isinstance(triples, pd.DataFrame):
        if {"head", "relation", "tail"} <= set(triples.columns):
            cols = [triples["head"], triples["relation"], triples["tail"]]
        elif triples.shape[1] >= 3:
            cols = [triples.iloc[:, i] for i in range(3)]
        else:
            raise ValueError(
                f"a DataFrame of triples needs head, relation and tail columns, got {list(triples.columns)}"
            )
        return cols[0].tolist(), cols[1].tolist(), cols[2].tolist()
    if isinstance(triples, np.ndarray):
        if triples.ndim != 2 or triples.shape[1] != 3:
            raise ValueError(f"an array of triples must have shape (n, 3), not {triples.shape}")
        return triples[:, 0].tolist(), triples[:, 1].tolist(), triples[:, 2].tolist()
    rows = list(triples)
    for i, t in enumerate(rows):
        if isinstance(t, (str, bytes)) or len(t) != 3:
            raise ValueError(f"triple {i + 1} is not (head, relation, tail): {t!r}")
    return [t[0] for t in rows], [t[1] for t in rows], [t[2] for t in rows]


def score_queries(name: Callable[[Name, str], str], triples: Any) -> list[dict[str, Any]]:
    heads, relations, tails = triple_columns(triples)
    return [
        {
            "query": "score",
            "head": name(h, "entity"),
            "relation": name(r, "relation"),
            "tail": name(t, "entity"),
        }
        for h, r, t in zip(heads, relations, tails)
    ]


def neighbor_queries(
    name: Callable[[Name, str], str], entity: Any, k: int, metric: str
) -> tuple[list[dict[str, Any]], bool]:
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: expected one of {', '.join(METRICS)}")
    top = check_top(k)
    rows, batch = broadcast(entity=entity)
    return [
        {"query": "neighbors", "entity": name(r["entity"], "entity"), "top": top, "metric": metric}
        for r in rows
    ], batch


def _frame(columns: dict[str, list[Any]], attrs: dict[str, Any]) -> pd.DataFrame:
    frame = pd.DataFrame(columns)
    for c in frame.columns:
        if c.endswith("_id") or c in ("rank", "query"):
            frame[c] = frame[c].astype("int64")
    if "score" in frame:
        # The answers' f32 scores, exactly (JSON carries each as its shortest f32 form).
        frame["score"] = frame["score"].astype("float32")
    frame.attrs.update(attrs)
    return frame


def predictions_frame(answers: list[dict[str, Any]], batch: bool) -> pd.DataFrame:
    """``predict`` answers: one row per predicted entity, best first within each query, with the
    whole triple (``head_id``, ``head_label``, ``relation_id``, ``relation_label``, ``tail_id``,
    ``tail_label``), its ``score`` and ``rank`` (from 1); ``query`` numbers the queries of a
    batch. ``attrs["filtered"]`` says whether known triples were left out."""
    names = ["head_id", "head_label", "relation_id", "relation_label", "tail_id", "tail_label"]
    cols: dict[str, list[Any]] = {c: [] for c in (["query"] if batch else []) + names + ["score", "rank"]}
    filtered = None
    for q, a in enumerate(answers):
        filtered = a["filtered"]
        for rank, hit in enumerate(a["hits"], start=1):
            head = a["head"] or hit
            tail = a["tail"] or hit
            if batch:
                cols["query"].append(q)
            for end, named in (("head", head), ("relation", a["relation"]), ("tail", tail)):
                cols[f"{end}_id"].append(named["id"])
                cols[f"{end}_label"].append(named["label"])
            cols["score"].append(hit["score"])
            cols["rank"].append(rank)
    return _frame(cols, {"filtered": filtered})


def scores_frame(answers: list[dict[str, Any]]) -> pd.DataFrame:
    """``score`` answers: one row per triple, in the order asked."""
    cols: dict[str, list[Any]] = {
        c: []
        for c in ["head_id", "head_label", "relation_id", "relation_label", "tail_id", "tail_label", "score"]
    }
    for a in answers:
        for end in ("head", "relation", "tail"):
            cols[f"{end}_id"].append(a[end]["id"])
            cols[f"{end}_label"].append(a[end]["label"])
        cols["score"].append(a["score"])
    return _frame(cols, {})


def neighbors_frame(answers: list[dict[str, Any]], batch: bool) -> pd.DataFrame:
    """``neighbors`` answers: one row per neighbour, nearest first (``score`` is the cosine, the
    dot product, or the negative L2 distance), with the entity asked about."""
    names = ["entity_id", "entity_label", "neighbor_id", "neighbor_label", "score", "rank"]
    cols: dict[str, list[Any]] = {c: [] for c in (["query"] if batch else []) + names}
    metric = None
    for q, a in enumerate(answers):
        metric = a["metric"]
        for rank, hit in enumerate(a["hits"], start=1):
            if batch:
                cols["query"].append(q)
            cols["entity_id"].append(a["entity"]["id"])
            cols["entity_label"].append(a["entity"]["label"])
            cols["neighbor_id"].append(hit["id"])
            cols["neighbor_label"].append(hit["label"])
            cols["score"].append(hit["score"])
            cols["rank"].append(rank)
    return _frame(cols, {"metric": metric})
