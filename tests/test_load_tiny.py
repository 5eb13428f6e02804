"""The tiny load run in the suite: 5 WebSocket sessions for 10 s through `bench/load.py`.

The full run (200 sessions x 60 s) is a benchmark, not part of the suite; see
docs/benchmarks/load.md. This starts the same processes (engine, Daphne, Celery worker) against its
own database on the test run's PostgreSQL server, and must end with no error and no lost or
duplicated row.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_tiny_load_has_no_errors_and_loses_no_rows(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [sys.executable, "-m", "bench.load", "--sessions", "5", "--duration", "10", "--model", str(tiny_model_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=840,
    )
    figures = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line and " " not in line)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert figures["load_errors"] == "0"
    assert figures["load_lost_rows"] == "0" and figures["load_duplicate_rows"] == "0"
    assert int(figures["messages_sent"]) >= 5 and int(figures["feedback_sent"]) >= 5
