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

import os as _os

# NVLink multicast off for NCCL (training with gpus > 1) unless the user chose otherwise: it can
# take a shared host's GPUs out of service, and the engine makes no communicator while the
# variable is unset. Set here, at import, before the extension starts any thread.
_os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from . import errors, interop  # noqa: E402 (after the environment is settled)
from ._legend import __version__  # noqa: E402
from .client import Client  # noqa: E402
from .dataset import Dataset, import_marius, import_triples  # noqa: E402
from .errors import *  # noqa: E402, F403 (the exception classes, listed in errors.__all__)
from .run import Run, open  # noqa: E402
from .training import ProgressView, train  # noqa: E402

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
