"""A run's tables in other libraries' shapes: PyTorch ``nn.Embedding`` weights (when torch is
installed) and PyKEEN's labelled triples (``TriplesFactory.from_path``'s TSV)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    import torch

    from .run import Run

__all__ = ["torch_embeddings", "read_triples", "write_triples"]


def torch_embeddings(run: Run, *, freeze: bool = True) -> tuple[torch.nn.Embedding, torch.nn.Embedding | None]:
    """The run's entity and relation tables as ``torch.nn.Embedding`` modules (weights copied:
    a module owns writable parameters, the run's arrays are read-only); the relation module is
    ``None`` for a decoder without relations (``dot``). ``freeze`` as
    ``nn.Embedding.from_pretrained``. Raises ``ImportError`` without torch."""
    import torch

    entities = torch.nn.Embedding.from_pretrained(torch.tensor(np.array(run.embeddings())), freeze=freeze)
    relation_rows = run.relation_embeddings()
    relations = (
        torch.nn.Embedding.from_pretrained(torch.tensor(np.array(relation_rows)), freeze=freeze)
        if relation_rows.shape[0] > 0
        else None
    )
    return entities, relations


def read_triples(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Reads labelled triples as PyKEEN writes and reads them (``TriplesFactory.from_path``):
    ``head<TAB>relation<TAB>tail`` a line, no header, labels taken as text exactly. A DataFrame
    with ``head``, ``relation``, ``tail`` columns (what :func:`legend.import_triples` takes)."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for number, line in enumerate(f, start=1):
            line = line.removesuffix("\n").removesuffix("\r")
            if not line:
                continue  # blank lines are skipped, as PyKEEN's reader skips them
            fields = line.split("\t")
            if len(fields) != 3:
                raise ValueError(
                    f"{os.fspath(path)}: line {number} has {len(fields)} tab-separated fields, not 3: {line!r}"
                )
            rows.append(fields)
    return pd.DataFrame(rows, columns=["head", "relation", "tail"], dtype=object)


def write_triples(triples: Any, path: str | os.PathLike[str]) -> None:
    """Writes labelled triples for PyKEEN (``TriplesFactory.from_path(path)``): ``triples`` is
    a DataFrame with ``head``, ``relation``, ``tail`` columns (:meth:`legend.Dataset.triples`,
    :meth:`legend.Run.triples`) or a list of triples. A label with a tab or a line break
    cannot be written and is refused."""
    frame = triples if isinstance(triples, pd.DataFrame) else pd.DataFrame(list(triples), columns=["head", "relation", "tail"])
    cols = []
    for name in ("head", "relation", "tail"):
        missing = frame[name].isna()
        if missing.any():
            raise ValueError(f"{name}: missing value in row {missing.idxmax()!r}")
        col = frame[name].astype(str)
        bad = col.str.contains(r"[\t\r\n]", regex=True) | (col == "")
        if bad.any():
            row = bad.idxmax()
            raise ValueError(f"{name} in row {row!r} is empty or holds a tab or a line break: {col[row]!r}")
        cols.append(col)
    # Written beside the file and renamed over it: a failure leaves the old file or none.
    tmp = f"{os.fspath(path)}.partial"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.writelines("\t".join(row) + "\n" for row in zip(*cols))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
