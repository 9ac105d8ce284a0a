"""Training in this process (``legend.train``) and the progress view shared with the daemon's
``watch``."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np

from . import _legend
from ._closing import Closing
from .dataset import Dataset
from .errors import ConfigError, Interrupted
from .run import Run

__all__ = ["train", "ProgressView"]

Event = dict[str, Any]
"""A training event: ``{"type": "progress", "progress": {...}}``, ``{"type": "epoch", "line":
{...}}`` (the epoch's ``metrics.jsonl`` line), ``checkpoint``, ``evaluating``, ``evaluated``
(legendd's ``watch`` sends the same), and ``started`` first."""

Config = Union[Mapping[str, Any], str, "os.PathLike[str]"]


def _metrics_text(m: Mapping[str, Any]) -> str:
    """Metrics in a line, as ``legendctl`` prints them."""
    return (
        f"{m.get('protocol', '')} MRR {m['mrr']:.4f}, Hits@1 {m['hits_at_1']:.4f}, "
        f"Hits@3 {m['hits_at_3']:.4f}, Hits@10 {m['hits_at_10']:.4f}, mean rank {m['mean_rank']:.1f}"
    )


class ProgressView(Closing):
    """Shows training events as ``legendctl train`` does: on a terminal (or in Jupyter, where
    ``tqdm.auto`` draws a widget) one bar over the whole run (epochs, the last epoch's loss and
    rate, the time left) with validation results above it; elsewhere (a log, a pipe) a line per
    epoch. Then the final evaluation. Everything goes to stderr. Call it with each event;
    :meth:`close` when done (``with`` does)."""

    def __init__(self) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self._bar: Any = None
        self._edges = 0
        self._drawn = sys.stderr.isatty() or "ipykernel" in sys.modules

    def close(self) -> None:
        """Removes the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _write(self, text: str) -> None:
        # Above the bar, on stderr: the results themselves are the run's (``Run.result``).
        self._tqdm.write(text, file=sys.stderr)

    def __call__(self, event: Event) -> None:
        kind = event.get("type")
        if kind == "progress" and self._drawn:
            p = event["progress"]
            if p["epochs"] == 0:
                return
            self._edges = max(p["edges"], 1)
            total = p["epochs"] * self._edges
            if self._bar is None:
                self._bar = self._tqdm(
                    total=total, unit="edge", unit_scale=True, dynamic_ncols=True, file=sys.stderr
                )
            self._bar.total = total
            self._bar.set_description(f"epoch {p['epoch']}/{p['epochs']}", refresh=False)
            self._bar.n = (p["epoch"] - 1) * self._edges + p["edges_done"]
            self._bar.refresh()
        elif kind == "epoch":
            line = event["line"]
            if self._bar is not None:
                self._bar.n = line["epoch"] * self._edges
                self._bar.set_postfix(loss=f"{line['loss']:.4f}", refresh=False)
                self._bar.refresh()
            elif not self._drawn:
                self._write(
                    f"epoch {line['epoch']}: loss {line['loss']:.4f}, {line['edges_per_sec']:.0f} edges/s, "
                    f"{line['seconds']:.2f} s"
                )
            if "valid" in line:
                self._write(f"epoch {line['epoch']} valid: {_metrics_text(line['valid'])}")
        elif kind == "evaluating":
            self.close()
            self._write(f"evaluating on {event['split']}")
        elif kind == "evaluated":
            line = event["line"]
            best = f" (best epoch {line['best_epoch']})" if line.get("best_epoch") is not None else ""
            self._write(f"{line.get('split', 'test')}{best}: {_metrics_text(line['metrics'])}")


def _plain(value: Any, key: str) -> Any:
    """``value`` as what JSON (and then TOML) carries: NumPy scalars and arrays become Python
    numbers and lists; anything else that is not a number, string, boolean, list or dict, and a
    float that is not finite, is a ``ConfigError`` naming ``key`` (the setting's dotted name)."""
    if isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: the key {k!r} is not a string")
            out[k] = _plain(v, f"{key}.{k}" if key else k)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value}: a setting must be a finite number")
    if value is None or not isinstance(value, (bool, int, float, str)):
        raise ConfigError(
            f"{key} = {value!r}: a setting is a number, string, boolean, list or dict, "
            f"not {type(value).__name__}"
        )
    return value


def _settings(overrides: Mapping[str, Any] | None, **keys: Any) -> list[str]:
    merged: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if not isinstance(key, str):
            raise ConfigError(f"overrides: the key {key!r} is not a dotted name (a string)")
        merged[key] = _plain(value, key)
    for key, value in keys.items():
        if value is not None:
            if key in merged:
                raise ValueError(f"{key} is given twice: as an argument and in overrides")
            merged[key] = _plain(value, key)
    return _legend.override_settings(json.dumps(merged)) if merged else []


def _config_text(config: Config | None) -> tuple[str | None, str | None]:
    """The configuration's TOML text, and what names it in errors."""
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        return _legend.config_toml(json.dumps(_plain(config, ""))), "config"
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        return path.read_text(encoding="utf-8"), os.fspath(path)
    raise TypeError(f"config is a dict or the path of a TOML file, not {type(config).__name__}")


def train(
    dataset: str | os.PathLike[str] | Dataset | None = None,
    out: str | os.PathLike[str] | None = None,
    config: Config | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    resume: bool = False,
    device: str | None = None,
    threads: int | None = None,
    gpus: int | None = None,
    progress: bool | Callable[[Event], Any] = True,
) -> Run:
    """Trains a run in this process, as ``legendctl train`` does, and returns it opened.

    ``dataset`` is a dataset directory (or :class:`Dataset`); ``out`` the run directory to
    create (its parent is created; it must not exist, or be empty). ``config`` is a dict of
    sections (``{"model": {"dim": 100}}``) or the path of a TOML file (``configs/`` holds
    recipes); ``overrides`` changes keys by dotted name (``{"training.batch_size": 1000}``), as
    ``--set``; every key and its default: Documentation/config.md. ``device`` (``cpu``,
    ``cuda:N``, ``auto``), ``threads`` and ``gpus`` set ``training.device``,
    ``training.threads`` and ``training.gpus``.

    ``resume=True`` continues the run ``out`` from its last checkpoint with its own
    configuration (``overrides`` may change keys, e.g. more epochs); ``dataset`` only if it
    moved.

    The trainer runs without the GIL. ``progress`` shows a tqdm bar (``True``), nothing
    (``False``), or calls a function with each event (a dict; see :class:`ProgressView`).
    Ctrl-C stops the run before its next batch with a checkpoint there and raises
    :class:`legend.Interrupted` (a ``KeyboardInterrupt``); an exception raised by the
    ``progress`` function stops it the same way and is raised again. Either way
    ``legend.train(out=..., resume=True)`` continues exactly where it stopped.
    """
    if out is None:
        raise ValueError("out (the run directory) is required")
    out_path = Path(out)
    text, origin = _config_text(config)
    sets = _settings(
        overrides, **{"training.device": device, "training.threads": threads, "training.gpus": gpus}
    )
    if not resume:
        if dataset is None:
            raise ValueError("a dataset is required (or resume=True to continue an existing run)")
        if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
            raise FileExistsError(
                f"{out_path} already exists: choose another out, or continue it with resume=True"
            )
        out_path.parent.mkdir(parents=True, exist_ok=True)
    view: Callable[[Event], Any] | None
    if progress is True:
        view = ProgressView()
    elif progress is False or progress is None:
        view = None
    elif callable(progress):
        view = progress
    else:
        raise TypeError("progress is True, False or a function of one event")

    def on_event(event: Event) -> None:
        if view is not None:
            view(event)

    try:
        ended = json.loads(
            _legend.train(
                os.fspath(out_path),
                None if dataset is None else os.fspath(dataset),
                text,
                origin,
                sets,
                resume,
                on_event,
            )
        )
    finally:
        if isinstance(view, ProgressView):
            view.close()
    if ended["outcome"] == "stopped":
        raise Interrupted(os.fspath(out_path), ended["position"])
    if ended["outcome"] == "already_finished":
        warnings.warn(
            f"{out_path}: every epoch is trained and evaluated; nothing to do (raise "
            "training.num_epochs in overrides to train more)",
            stacklevel=2,
        )
    return Run(out_path)
