"""/healthz against the real services: Postgres, Redis, a Celery worker subprocess and an engine."""
import os
import time

import pytest

from serving.engine.testing import free_port, run_engine_server
from training.testing import run_worker

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with run_engine_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def celery_worker():
    """A real `celery worker` on the test broker prefix, until the module's tests end."""
    from clawplatform.celery import app

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test", "OMP_NUM_THREADS": "1"}
    with run_worker(env, queues="default", name=f"healthz-{os.getpid()}") as process:
        deadline = time.monotonic() + 120
        while not app.control.ping(timeout=1.0):
            assert process.poll() is None, "the celery worker exited; see var/test-logs"
            assert time.monotonic() < deadline, "the celery worker did not answer pings in 120 s"
        yield process


@pytest.fixture
def serving_up(settings, engine):
    settings.INFERENCE_URLS = [engine.url]
    return settings


def test_healthz_is_200_when_everything_is_up(client, serving_up, celery_worker):
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ok"
    assert set(body["checks"]) == {"database", "redis", "worker", "inference"}
    assert all(check["ok"] for check in body["checks"].values())
    assert body["checks"]["worker"]["workers"] >= 1
    assert body["checks"]["inference"] == {**body["checks"]["inference"], "replicas": 1, "up": 1}


def test_healthz_is_503_naming_redis_when_redis_is_down(client, serving_up, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 503
    assert body["status"] == "fail" and "redis" in body["failing"]
    assert body["checks"]["redis"] == {"ok": False, "error": "ConnectionError", "ms": body["checks"]["redis"]["ms"]}
    assert body["checks"]["database"]["ok"] and body["checks"]["inference"]["ok"]
    assert time.monotonic() - started < 6


def test_healthz_is_503_naming_inference_when_no_replica_answers(client, settings):
    dead = f"http://127.0.0.1:{free_port()}"
    settings.INFERENCE_URLS = [dead]
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 503 and "inference" in body["failing"]
    assert body["checks"]["inference"]["up"] == 0
    assert dead.split("//")[1] not in response.content.decode()  # no addresses leak


def test_healthz_needs_no_login_and_only_answers_get(client, serving_up):
    assert client.post("/healthz").status_code == 405
    assert client.get("/healthz").status_code in {200, 503}
