"""Helpers for tests and benchmarks that run a real Celery worker in a subprocess."""
import contextlib
import subprocess
import sys
import time
from pathlib import Path

from serving.engine.testing import stop_process

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def run_worker(env, *, queues="default,training", name="w1"):
    """`celery -A clawplatform worker -Q ... -c 1 --pool=solo` in a real subprocess."""
    log_dir = REPO / "var" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    run_id = env.get("CLAW_TEST_RUN_ID", "standalone")  # set under pytest; absent for bench runs
    log_path = log_dir / f"worker-{run_id}-{name}-{int(time.time())}.log"
    command = [sys.executable, "-m", "celery", "-A", "clawplatform", "worker", "-Q", queues, "-c", "1",
               "--pool=solo", "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "INFO"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_path = log_path
    try:
        yield process
    finally:
        stop_process(process, grace=20)


def wait_for(predicate, *, timeout, interval=0.25, what="condition", process=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"worker exited ({process.returncode}):\n{process.log_path.read_text()[-4000:]}")
        time.sleep(interval)
    log = process.log_path.read_text()[-4000:] if process is not None else ""
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{log}")
