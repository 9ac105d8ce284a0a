"""Ctrl-C in a Python process that trains: SIGINT reaches Python's own handler (the package
installs none), the trainer stops before its next batch with a checkpoint there, the call raises
legend.Interrupted, and resuming the run trains exactly what the uninterrupted run trains."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import tomllib

import numpy as np

import legend

# One thread: the CPU engine's results do not depend on it, but a cut inside an epoch is then
# anywhere in it.
CONFIG = {
    "model": {"decoder": "distmult", "dim": 16, "reciprocal_relations": True},
    "training": {"num_epochs": 10_000, "threads": 1},
}

CHILD = textwrap.dedent(
    """
    import json, sys
    import legend

    dataset, out, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    def report(event):
        if event["type"] == "epoch":
            print("epoch", event["line"]["epoch"], flush=True)

    try:
        legend.train(dataset, out, config, progress=report)
    except legend.Interrupted as e:
        print("interrupted", json.dumps({"run": e.run, "position": e.position}), flush=True)
        raise
    """
)


def test_sigint_stops_training_at_a_checkpoint_that_resumes_exactly(umls, tmp_path):
    out = tmp_path / "stopped"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(umls.path), str(out), json.dumps(CONFIG)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stdout:
            if line.strip() == "epoch 2":
                break
        child.send_signal(signal.SIGINT)
        rest, err = child.communicate(timeout=60)
    finally:
        child.kill()
    # Uncaught, as a script's would be (a subclass of KeyboardInterrupt: Python exits with 1).
    assert child.returncode == 1, err
    assert "legend.errors.Interrupted: interrupted:" in err, err
    said = json.loads(rest.split("interrupted ", 1)[1].splitlines()[0])
    assert said["run"] == str(out)

    with open(out / "run.toml", "rb") as f:
        record = tomllib.load(f)
    done = record["epochs_completed"]
    assert 2 <= done < 10_000
    # Train to the end of the epoch it stopped in (or one more when it stopped between two).
    epochs = done + 1
    resumed = legend.train(out=out, resume=True, overrides={"training.num_epochs": epochs}, progress=False)
    plain = legend.train(
        umls, tmp_path / "plain", CONFIG, {"training.num_epochs": epochs}, progress=False
    )
    np.testing.assert_array_equal(resumed.embeddings(), plain.embeddings())
    np.testing.assert_array_equal(resumed.relation_embeddings(), plain.relation_embeddings())
    assert list(resumed.metrics()["loss"]) == list(plain.metrics()["loss"])
    assert resumed.result["metrics"] == plain.result["metrics"]


def test_sigint_while_importing_leaves_nothing(umls_raw, tmp_path):
    # A large enough file that the import is still reading when the signal comes.
    big = tmp_path / "big.tsv"
    lines = (umls_raw / "train.txt").read_text()
    with big.open("w") as f:
        for i in range(200):
            f.write(lines.replace("\t", f"{i}\t", 1))
    script = textwrap.dedent(
        """
        import sys, legend
        print("ready", flush=True)
        legend.import_triples(sys.argv[1], sys.argv[2])
        print("finished", flush=True)
        """
    )
    out = tmp_path / "dataset"
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(out), str(big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # into the import's reading (a million lines: seconds)
        child.send_signal(signal.SIGINT)
        rest, err = child.communicate(timeout=60)
    finally:
        child.kill()
    if "finished" in rest:
        # The import won the race: it is complete.
        assert legend.Dataset(out).info["splits"]["train"] > 0
    else:
        assert child.returncode == -signal.SIGINT, err
        assert "KeyboardInterrupt" in err
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir()] == ["big.tsv"]
