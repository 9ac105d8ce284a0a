"""Legend from Python: train graph embeddings, open runs, ask them questions.

::

    import legend

    ds = legend.import_triples("data/umls", train="train.txt", valid="valid.txt", test="test.txt")
    run = legend.train(ds, "runs/umls", "configs/umls-distmult.toml")
    run.predict(head="acquired_abnormality", relation="location_of", k=5)   # a DataFrame
    vectors = run.embeddings()                                              # NumPy, no copy
    with legend.Client() as daemon:                                         # legendd
        job = daemon.submit_train(ds, "runs/umls-2", overrides={"model.dim": 100})

Documentation/python.md is the reference: the zero-copy rule for arrays, threads, errors.
"""

from . import errors, interop
from ._legend import __version__
from .client import Client
from .dataset import Dataset, import_marius, import_triples
from .errors import *  # noqa: F403 (the exception classes, listed in errors.__all__)
from .run import Run, open
from .training import ProgressView, train

__all__ = [
    "__version__",
    "Client",
    "Dataset",
    "Run",
    "ProgressView",
    "open",
    "train",
    "import_triples",
    "import_marius",
    "interop",
]
__all__ += errors.__all__
