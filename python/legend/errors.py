"""The exceptions Legend raises.

Each carries the words of the Rust error it comes from, with that error's causes after a
``: `` (as ``legendctl`` prints them); ``chain`` lists the error and each cause apart, the
outermost first::

    try:
        legend.open("runs/missing")
    except legend.RunError as e:
        print(e)        # runs/missing does not exist (expected a training run directory, ...)
        print(e.chain)  # ['runs/missing does not exist (...)']
"""

from __future__ import annotations

__all__ = [
    "LegendError",
    "ConfigError",
    "DatasetError",
    "RunError",
    "QueryError",
    "UnknownNameError",
    "TrainingError",
    "DaemonError",
    "Interrupted",
]


class LegendError(Exception):
    """Base class of Legend's errors."""

    chain: list[str]
    """The error and its causes, outermost first."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.chain = [message]

    def __str__(self) -> str:
        # Not KeyError's quoted form, for the subclasses that are also KeyErrors.
        return BaseException.__str__(self)


class ConfigError(LegendError, ValueError):
    """A configuration key or value is invalid (the message names the key)."""


class DatasetError(LegendError):
    """A dataset directory or an input file cannot be read or written (the message names the
    file, and the line for a parse error)."""


class RunError(LegendError):
    """A run directory cannot be read: missing, damaged, or not a run."""


class QueryError(LegendError, ValueError):
    """A query cannot be answered as asked (the message names the query)."""


class UnknownNameError(QueryError, KeyError):
    """An entity or relation that is neither a label of the run's dataset nor an id in range."""


class TrainingError(LegendError):
    """Training was refused (memory, device, an existing run directory) or failed."""


class DaemonError(LegendError):
    """legendd could not be reached, or refused a request."""

    code: str | None
    """The daemon's error code (``bad_request``, ``forbidden``, ``not_found``, ``refused``,
    ``unavailable``), or ``None`` when the daemon did not answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = None


class Interrupted(KeyboardInterrupt):
    """Training was stopped by Ctrl-C (``KeyboardInterrupt``) and checkpointed: continue it with
    ``legend.train(out=run, resume=True)``."""

    run: str
    """The run directory."""
    position: str
    """Where its checkpoint is, in words (``epoch 3 stopped after 5 of its swaps ...``)."""

    def __init__(self, run: str, position: str) -> None:
        super().__init__(
            f"interrupted: {run} is checkpointed at {position}; "
            f"continue it with legend.train(out={run!r}, resume=True)"
        )
        self.run = run
        self.position = position
