"""legend.Client against a real legendd (started as the daemon's own tests start it: a
temporary socket and state directory): a train job submitted, watched and finished; its run
served and queried, answering as the run answers here; errors carry the daemon's code."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

import legend
from conftest import SMALL


@pytest.fixture(scope="module")
def daemon(legendd, tmp_path_factory):
    home = tmp_path_factory.mktemp("legendd")
    socket = home / "sock"
    config = home / "legendd.toml"
    config.write_text("")
    proc = subprocess.Popen(
        [legendd, "--foreground", "--config", config, "--socket", socket, "--state-dir", home / "state"],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "LEGEND_LOG": "warn"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = legend.Client(socket)
                break
            except legend.DaemonError:
                assert proc.poll() is None, "legendd exited"
                assert time.monotonic() < deadline, "legendd did not listen"
                time.sleep(0.05)
        with client:
            yield client
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def served(client: legend.Client, job: int, ask):
    """`ask` of serve job `job` once its run is loaded (it answers `unavailable` until then)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return ask()
        except legend.DaemonError as e:
            if e.code != "unavailable" or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_train_job_is_watched_to_its_end_and_its_run_served(daemon, umls, tmp_path):
    assert daemon.hello()["version"] == 1
    out = tmp_path / "run"
    job = daemon.submit_train(umls.path, out, SMALL, {"training.num_epochs": 2})
    assert job["spec"]["kind"] == "train" and job["spec"]["out"] == str(out)
    events = list(daemon.watch(job["id"]))
    assert [e["line"]["epoch"] for e in events if e["type"] == "epoch"] == [1, 2]
    assert events[-1]["type"] == "ended" and events[-1]["job"]["state"] == "succeeded"
    assert [j["id"] for j in daemon.jobs()] == [job["id"]]
    assert "epoch 2" in daemon.logs(job["id"])

    local = legend.open(out, device="cpu")
    assert local.info["epochs_completed"] == 2
    serve = daemon.submit_serve(out, device="cpu")["id"]
    try:
        head, relation = local.entities[4], local.relations[2]
        remote = served(daemon, serve, lambda: daemon.predict(serve, head=head, relation=relation, k=7))
        pd.testing.assert_frame_equal(remote, local.predict(head=head, relation=relation, k=7))
        triples = local.triples("valid").head(5)
        pd.testing.assert_frame_equal(daemon.score(serve, triples), local.score(triples))
        pd.testing.assert_frame_equal(
            daemon.neighbors(serve, [head, 3], k=4, metric="l2"), local.neighbors([head, 3], k=4, metric="l2")
        )
    finally:
        daemon.cancel(serve)
    assert daemon.wait(job["id"])["state"] == "succeeded"


def test_daemon_errors_carry_its_code_and_words(daemon, tmp_path):
    with pytest.raises(legend.DaemonError) as e:
        daemon.status(999_999)
    assert e.value.code == "not_found" and "999999" in str(e.value)
    with pytest.raises(legend.DaemonError) as e:
        daemon.submit_eval(tmp_path / "no-run")
    assert e.value.code is not None, e.value
    with pytest.raises(ValueError, match="protocol"):
        daemon.call({"call": "format_disk"})
    # Names are checked before anything is sent (a float is not an id, as for a local run).
    with pytest.raises(TypeError, match="not float"):
        daemon.predict(1, head=1.5, relation=0)
    with pytest.raises(legend.DaemonError, match="cannot reach legendd"):
        legend.Client(tmp_path / "no-socket")
