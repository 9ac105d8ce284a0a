"""The notebook-style example runs headless as a script: it trains, predicts and plots."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import CACHE, ROOT


def test_the_quickstart_example_trains_predicts_and_plots(tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "LEGEND_CACHE": str(CACHE)}
    env.pop("DISPLAY", None)
    done = subprocess.run(
        [sys.executable, ROOT / "python" / "examples" / "quickstart.py", "--epochs", "2", "--work", tmp_path],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "disease_or_syndrome" in done.stdout and "neighbor_label" in done.stdout, done.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in done.stdout
    else:
        plot = tmp_path / "neighbours.png"
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", done.stdout
