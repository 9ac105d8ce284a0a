"""Training UMLS from Python: what the run records, the events a progress callback gets, and
refusals that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import legend
from conftest import SMALL


def test_a_run_trained_from_python_records_every_epoch_and_its_evaluation(trained):
    run, events = trained
    info = run.info
    assert (info["decoder"], info["dim"], info["epochs_completed"]) == ("distmult", 32, 3)
    assert run.config["model"]["dim"] == 32
    assert list(run.metrics()["epoch"]) == [1, 2, 3]
    result = run.result
    assert result is not None and result["split"] == "test"
    # DistMult d = 32 with reciprocal relations, 3 epochs: well above chance (1/135).
    assert result["metrics"]["mrr"] > 0.3, result


def test_the_progress_callback_gets_the_daemons_event_shapes(trained):
    _, events = trained
    kinds = [e["type"] for e in events]
    assert kinds[0] == "started" and events[0]["engine"] == "cpu"
    assert [e["line"]["epoch"] for e in events if e["type"] == "epoch"] == [1, 2, 3]
    progress = [e["progress"] for e in events if e["type"] == "progress"]
    assert progress and all(p["epochs"] == 3 and p["edges"] > 0 for p in progress)
    assert kinds[-2:] == ["evaluating", "evaluated"]
    assert "checkpoint" in kinds


def test_progress_is_a_line_per_epoch_in_a_log(umls, tmp_path, capsys):
    legend.train(umls, tmp_path / "run", SMALL, {"training.num_epochs": 2})
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1", "epoch 2"], lines
    assert lines[-2:][0] == "evaluating on test" and lines[-1].startswith("test: filtered MRR"), lines
    assert captured.out == ""


def test_progress_is_a_bar_on_a_terminal(umls, tmp_path):
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    leader, follower = pty.openpty()
    # A terminal of 24 rows and 100 columns (tqdm fits its bar to the width).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    script = "import sys, json, legend; legend.train(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))"
    config = json.dumps({**SMALL, "training": {**SMALL["training"], "num_epochs": 2}})
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(umls.path), str(tmp_path / "run"), config], stderr=follower
    )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed: the child is done
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert child.wait(timeout=60) == 0
    text = seen.decode(errors="replace")
    assert "epoch 2/2" in text and "100%" in text and "loss=" in text, text
    assert "test: filtered MRR" in text, text


def test_a_config_file_and_overrides_combine_as_the_cli_takes_them(umls, tmp_path):
    config = tmp_path / "small.toml"
    config.write_text('[model]\ndecoder = "complex"\ndim = 8\n')
    run = legend.train(
        umls, tmp_path / "run", config, {"training.num_epochs": 1, "model.dim": 16}, threads=1, progress=False
    )
    assert (run.info["decoder"], run.info["dim"]) == ("complex", 16)
    assert run.config["training"]["threads"] == 1


def test_bad_settings_are_refused_by_name_before_anything_is_made(umls, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(legend.ConfigError, match="model.dimension") as e:
        legend.train(umls, out, {"model": {"dimension": 8}}, progress=False)
    assert isinstance(e.value, ValueError) and e.value.chain
    with pytest.raises(legend.ConfigError, match="training.batch_size"):
        legend.train(umls, out, overrides={"training.batch_size": "many"}, progress=False)
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(legend.ConfigError, match=str(bad)):
        legend.train(umls, out, bad, progress=False)
    with pytest.raises(ValueError, match="given twice"):
        legend.train(umls, out, overrides={"training.threads": 1}, threads=2, progress=False)
    assert not out.exists()


def test_dataset_errors_name_the_path_and_carry_the_os_words(tmp_path):
    with pytest.raises(legend.DatasetError, match="nowhere: not a dataset directory"):
        legend.train(tmp_path / "nowhere", tmp_path / "run", SMALL, progress=False)
    assert not (tmp_path / "run").exists()
    missing = tmp_path / "missing.tsv"
    with pytest.raises(legend.DatasetError) as e:
        legend.import_triples(tmp_path / "ds", missing)
    # The error, then its source (the OS's words), as legendctl prints them.
    assert e.value.chain == [str(missing), "No such file or directory (os error 2)"]
    assert str(e.value) == f"{missing}: No such file or directory (os error 2)"


def test_an_existing_run_is_not_overwritten_and_a_finished_one_has_nothing_to_resume(trained, umls):
    run, _ = trained
    with pytest.raises(FileExistsError, match="resume=True"):
        legend.train(umls, run.path, SMALL, progress=False)
    with pytest.warns(UserWarning, match="nothing to do"):
        again = legend.train(out=run.path, resume=True, progress=False)
    assert again.info["epochs_completed"] == 3
    with pytest.raises(ValueError, match="own config.toml"):
        legend.train(out=run.path, config=SMALL, resume=True, progress=False)


def test_an_exception_in_the_callback_stops_at_a_checkpoint_and_is_raised(umls, tmp_path):
    out = tmp_path / "run"

    def stop_in_epoch_two(event):
        if event["type"] == "epoch" and event["line"]["epoch"] == 2:
            raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough") as e:
        legend.train(umls, out, SMALL, {"training.num_epochs": 50}, progress=stop_in_epoch_two)
    assert any("checkpointed" in note for note in e.value.__notes__)
    record = legend.open(out).info
    assert 2 <= record["epochs_completed"] < 50
    resumed = legend.train(out=out, resume=True, overrides={"training.num_epochs": record["epochs_completed"] + 1}, progress=False)
    assert resumed.result is not None


def test_numpy_values_are_settings_and_values_toml_cannot_carry_are_refused_by_key(umls, tmp_path):
    import numpy as np

    run = legend.train(
        umls,
        tmp_path / "run",
        {"model": {"decoder": "distmult", "dim": np.int32(8)}},
        {"training.num_epochs": np.int64(1), "optimizer.learning_rate": np.float32(0.25)},
        progress=False,
    )
    assert (run.info["dim"], run.info["epochs_completed"]) == (8, 1)
    assert run.config["optimizer"]["learning_rate"] == 0.25
    out = tmp_path / "refused"
    with pytest.raises(legend.ConfigError, match=r"optimizer.learning_rate = nan: a setting must be a finite number"):
        legend.train(umls, out, overrides={"optimizer.learning_rate": float("nan")}, progress=False)
    with pytest.raises(legend.ConfigError, match=r"model.dim = None: .* not NoneType"):
        legend.train(umls, out, {"model": {"dim": None}}, progress=False)
    with pytest.raises(legend.ConfigError, match=r"training.device = .*not object"):
        legend.train(umls, out, overrides={"training.device": object()}, progress=False)
    assert not out.exists()


def test_importing_legend_keeps_nvlink_multicast_off_unless_the_user_set_it():
    import os
    import subprocess
    import sys

    probe = "import os, legend; print(os.environ['NCCL_NVLS_ENABLE'])"
    for preset, expected in [(None, "0"), ("1", "1")]:
        env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
        if preset is not None:
            env["NCCL_NVLS_ENABLE"] = preset
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected, (preset, out.stdout, out.stderr)
