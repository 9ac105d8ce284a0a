"""legendd's client: submit jobs, follow them, ask a serve job's run questions.

A thin layer over the daemon's protocol (``legend-daemon-api``, Documentation/daemon-api.md):
requests are built here as the protocol's JSON, checked against its types in Rust before they
are sent; replies come back as dicts (a job is the daemon's ``JobInfo``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import _legend, _queries
from ._closing import Closing
from .errors import DaemonError
from .training import Config, Event, ProgressView, _config_text, _settings

__all__ = ["Client", "DEFAULT_SOCKET"]

DEFAULT_SOCKET = "/run/legend/legendd.sock"
"""Where the service listens (systemd's ``RuntimeDirectory=legend``)."""

Job = dict[str, Any]


def _absolute(path: str | os.PathLike[str]) -> str:
    """``path`` absolute, its parent resolved (it may not exist yet itself), as the daemon
    wants paths (it runs elsewhere, with another working directory)."""
    p = Path(path).absolute()
    return os.fspath(p.parent.resolve() / p.name)


class Client(Closing):
    """A connection to ``legendd`` on ``socket`` (default: ``$LEGEND_SOCKET``, else
    ``/run/legend/legendd.sock``), as ``legendctl submit|jobs|watch|query`` use it.

    Calls release the GIL and can be interrupted with Ctrl-C (the connection is then made
    again for the next call). A client may be shared by threads: their calls take turns; a
    :meth:`watch` uses a connection of its own.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None) -> None:
        path = socket if socket is not None else os.environ.get("LEGEND_SOCKET", DEFAULT_SOCKET)
        self._conn = _legend.Connection(os.fspath(path))

    def __repr__(self) -> str:
        return f"<legend.Client {self._conn.path!r}>"

    def close(self) -> None:
        """Closes the connection (a later call opens another)."""
        self._conn.close()

    def call(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Sends one request of the protocol (``{"call": "list", "all": False}``) and returns
        the daemon's reply (``{"reply": "jobs", "jobs": [...]}``); an error reply raises
        :class:`DaemonError` with its ``code``."""
        return json.loads(self._conn.call(json.dumps(request)))

    def _job(self, request: Mapping[str, Any]) -> Job:
        reply = self.call(request)
        if reply.get("reply") != "job":
            raise DaemonError(f"unexpected reply from legendd: {reply}")
        return reply["job"]

    def hello(self) -> dict[str, Any]:
        """The daemon's version and who it sees calling: ``version``, ``daemon``, ``uid``,
        ``admin``."""
        return self.call({"call": "hello"})

    # Submitting.

    def submit(self, job: Mapping[str, Any]) -> Job:
        """Queues ``job``, a job of the protocol (``{"kind": "train", ...}``), and returns it
        as the daemon recorded it (``id``, ``state``, ...). The helpers below build them."""
        return self._job({"call": "submit", "job": dict(job)})

    def submit_train(
        self,
        dataset: str | os.PathLike[str] | None,
        out: str | os.PathLike[str],
        config: Config | None = None,
        overrides: Mapping[str, Any] | None = None,
        *,
        resume: bool = False,
    ) -> Job:
        """Trains in the daemon, as :func:`legend.train` does here (the same ``config`` and
        ``overrides``); ``out`` must be in a directory you own."""
        text, _ = _config_text(config)
        return self.submit(
            {
                "kind": "train",
                "dataset": None if dataset is None else _absolute(dataset),
                "out": _absolute(out),
                "config": text or "",
                "sets": _settings(overrides),
                "resume": resume,
            }
        )

    def submit_eval(self, run: str | os.PathLike[str], protocol: str = "filtered", split: str = "test") -> Job:
        """Evaluates a run in the daemon (``filtered`` or ``sampled``, on ``test`` or ``valid``)."""
        return self.submit({"kind": "eval", "run": _absolute(run), "protocol": protocol, "split": split})

    def submit_export(
        self, run: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, format: str = "npy"
    ) -> Job:
        """Exports a run's embeddings in the daemon (``npy``, ``tsv`` or ``bin``; into
        ``RUN/export`` by default)."""
        target = out if out is not None else Path(run) / "export"
        return self.submit({"kind": "export", "run": _absolute(run), "out": _absolute(target), "format": format})

    def submit_serve(
        self, run: str | os.PathLike[str], *, group: str | None = None, device: str | None = None
    ) -> Job:
        """Keeps a run in the daemon's memory to answer queries (:meth:`predict`, :meth:`score`,
        :meth:`neighbors`) until cancelled; members of ``group`` may query it too; ``device``:
        ``cpu``, ``cuda:N`` or ``auto`` (default: the daemon's ``serve_device``)."""
        job: dict[str, Any] = {"kind": "serve", "run": _absolute(run), "group": group}
        if device is not None:
            job["device"] = device
        return self.submit(job)

    # Jobs.

    def jobs(self, all: bool = False) -> list[Job]:
        """Your jobs (everyone's with ``all``, for the admin group), by id."""
        reply = self.call({"call": "list", "all": all})
        return reply["jobs"]

    def status(self, job: int) -> Job:
        """One job."""
        return self._job({"call": "status", "job": int(job)})

    def cancel(self, job: int) -> Job:
        """Stops a job: a queued one at once, a running one at its next checkpointable point
        (a train job stays resumable)."""
        return self._job({"call": "cancel", "job": int(job)})

    def delete(self, job: int) -> Job:
        """Forgets an ended job (its record and log)."""
        return self._job({"call": "delete", "job": int(job)})

    def logs(self, job: int) -> str:
        """A job's log."""
        return self.call({"call": "logs", "job": int(job)})["text"]

    def watch(self, job: int, progress: bool = False) -> Iterator[Event]:
        """The events of a job as they happen (the shapes :func:`legend.train` reports:
        ``progress``, ``epoch``, ``checkpoint``, ``evaluating``, ``evaluated``, ``state``), then
        ``{"type": "ended", "job": JOB}`` with the job as it ended. ``progress=True`` also shows
        them as a tqdm bar. Breaking out of the loop stops following (the job goes on)."""
        watch = self._conn.watch(int(job))
        view = ProgressView() if progress else None
        try:
            for text in watch:
                reply = json.loads(text)
                if reply["reply"] == "event":
                    event = reply["event"]
                    if view is not None:
                        view(event)
                    yield event
                elif reply["reply"] == "ended":
                    yield {"type": "ended", "job": reply["job"]}
                else:
                    raise DaemonError(f"unexpected reply from legendd: {reply}")
        finally:
            watch.close()
            if view is not None:
                view.close()

    def wait(self, job: int, progress: bool = False) -> Job:
        """Follows a job to its end (:meth:`watch`) and returns it as it ended; raises
        :class:`DaemonError` unless it succeeded."""
        ended: Job | None = None
        for event in self.watch(job, progress=progress):
            if event["type"] == "ended":
                ended = event["job"]
        if ended is None:
            raise DaemonError(f"legendd stopped sending job {job}'s events before its end")
        if ended["state"] != "succeeded":
            why = f": {ended['error']}" if ended.get("error") else ""
            raise DaemonError(f"job {ended['id']} {ended['state']}{why}")
        return ended

    # A serve job's run.

    def query(self, job: int, queries: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Asks the run a serve job holds: legend-query's queries (``{"query": "predict",
        "head": ..., "relation": ..., "top": 10, "filtered": True}``, ``score``, ``neighbors``,
        ``lookup``), at most 1024; its answers, in order."""
        reply = self.call({"call": "query", "job": int(job), "queries": list(queries)})
        return reply["answers"]

    @staticmethod
    def _name(name: _queries.Name, kind: str) -> str:
        # The daemon resolves a name as a label first, then as an id (as `legendctl query`).
        if isinstance(name, str):
            return name
        if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
            return str(int(name))
        raise TypeError(f"an {kind} is a label (str) or an id (int), not {type(name).__name__}")

    def predict(
        self,
        job: int,
        head: Any = None,
        relation: Any = None,
        tail: Any = None,
        *,
        k: int = 10,
        filtered: bool = True,
    ) -> pd.DataFrame:
        """:meth:`legend.Run.predict` asked of a serve job: the same DataFrame. An id (int) is
        sent as its number, which the daemon reads as an id unless a label reads the same."""
        queries, batch = _queries.predict_queries(self._name, head, relation, tail, k, filtered)
        return _queries.predictions_frame(self.query(job, queries), batch)

    def score(self, job: int, triples: Any) -> pd.DataFrame:
        """:meth:`legend.Run.score` asked of a serve job."""
        return _queries.scores_frame(self.query(job, _queries.score_queries(self._name, triples)))

    def neighbors(self, job: int, entity: Any, k: int = 10, metric: str = "cosine") -> pd.DataFrame:
        """:meth:`legend.Run.neighbors` asked of a serve job."""
        queries, batch = _queries.neighbor_queries(self._name, entity, k, metric)
        return _queries.neighbors_frame(self.query(job, queries), batch)
