"""Adapter retention (keep the active, pinned and newest N; delete older files) and restoring
active adapters on replicas at worker start (`worker_ready`) or by `manage.py ensure_adapters`."""
import io
import logging
import os
import time

import pytest
from django.core.management import call_command

from chat.tests.factories import AgentFactory, engine, loaded_adapters, second_engine, unload_after  # noqa: F401
from serving import services as serving_services
from serving.adapters import adapter_path, adapter_root
from serving.models import AdapterVersion
from training import tasks
from training.models import AuditEvent, TrainingJob

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def peft_source(tiny_model_dir, tmp_path_factory):
    from serving.engine.testing import make_peft_adapter

    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft") / "a", rank=8, target_modules=("q_proj",))


@pytest.fixture
def publish(settings, tiny_model_dir, peft_source, user):
    settings.MODEL = str(tiny_model_dir)
    agent = AgentFactory()

    def make(n):
        return [serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=peft_source)
                for _ in range(n)]

    make.agent = agent
    return make


def state(version):
    version.refresh_from_db()
    return version.state, adapter_path(version.name).is_dir()


def test_versions_older_than_the_last_n_lose_their_files(publish, settings):
    settings.ADAPTER_KEEP_LAST = 2
    v1, v2, v3, v4 = publish(4)

    result = tasks.enforce_adapter_retention()

    assert result["deleted"] == [v1.name, v2.name]
    assert state(v1) == state(v2) == ("deleted", False)
    assert state(v3) == state(v4) == ("ready", True)
    events = AuditEvent.objects.filter(action="delete_adapter_files")
    assert sorted(e.target_id for e in events) == sorted([str(v1.pk), str(v2.pk)])
    assert all("older than the last 2" in e.reason for e in events)


def test_the_active_version_is_never_deleted(publish, settings, user):
    settings.ADAPTER_KEEP_LAST = 1
    v1, v2, v3 = publish(3)
    AdapterVersion.objects.filter(pk=v1.pk).update(is_active=True)  # a rollback to the oldest

    tasks.enforce_adapter_retention()

    assert state(v1) == ("ready", True)
    assert state(v2) == ("deleted", False)
    assert state(v3) == ("ready", True)
    assert serving_services.active_version_for(user.pk, publish.agent.pk) == v1


def test_a_pinned_version_is_never_deleted(publish, settings):
    settings.ADAPTER_KEEP_LAST = 1
    v1, v2, v3 = publish(3)
    AdapterVersion.objects.filter(pk=v2.pk).update(pinned=True)

    tasks.enforce_adapter_retention()

    assert state(v1) == ("deleted", False)
    assert state(v2) == ("ready", True)
    assert state(v3) == ("ready", True)


def test_a_second_run_deletes_nothing_more(publish, settings):
    settings.ADAPTER_KEEP_LAST = 1
    publish(3)
    assert len(tasks.enforce_adapter_retention()["deleted"]) == 2
    assert tasks.enforce_adapter_retention() == {"deleted": [], "staging": []}
    assert AuditEvent.objects.filter(action="delete_adapter_files").count() == 2


def test_versions_within_the_limit_are_kept(publish, settings):
    settings.ADAPTER_KEEP_LAST = 10
    versions = publish(3)
    assert tasks.enforce_adapter_retention()["deleted"] == []
    assert all(state(v) == ("ready", True) for v in versions)


def _aged(path, seconds=7200):
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"partial")
    past = time.time() - seconds
    os.utime(path, (past, past))
    return path


def test_stale_staging_directories_are_cleaned_and_fresh_ones_kept(user):
    agent = AgentFactory()
    root = adapter_root()
    crashed = _aged(root / ".staging-u1-a1-v9-abc")
    trash = _aged(root / ".trash-u1-a1-v2-def")
    fresh = root / ".staging-u1-a1-v10-xyz"
    fresh.mkdir()
    finished = TrainingJob.objects.create(user=user, agent=agent, state="failed", method="combined")
    running = TrainingJob.objects.create(user=user, agent=AgentFactory(), state="running", method="combined")
    old_job_dir = _aged(tasks.staging_dir(finished.pk))
    running_dir = _aged(tasks.staging_dir(running.pk))

    result = tasks.enforce_adapter_retention()

    assert not crashed.exists() and not trash.exists() and not old_job_dir.exists()
    assert fresh.exists() and running_dir.exists()
    assert sorted(result["staging"]) == sorted([crashed.name, trash.name, f".staging/job-{finished.pk}"])
    event = AuditEvent.objects.get(action="clean_adapter_staging")
    assert sorted(event.after["removed"]) == sorted(result["staging"])


def test_retention_runs_hourly_from_beat(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["enforce-adapter-retention"]
    assert entry["task"] == "training.tasks.enforce_adapter_retention"


# Restoring active adapters on replicas
# ------------------------------------------------------------------------------


@pytest.fixture
def replicas(publish, settings, engine, second_engine, unload_after):
    """Three replicas for one active version: the first already holds it, the second restarted
    empty, the third is down (nothing listens on its port)."""
    import httpx

    from serving.engine.testing import free_port

    [version] = publish(1)
    AdapterVersion.objects.filter(pk=version.pk).update(is_active=True)
    unload_after(engine, second_engine)
    response = httpx.post(f"{engine.url}/v1/load_lora_adapter", json={"lora_name": version.name, "lora_path": version.path})
    assert response.status_code == 200, response.text
    down = f"http://127.0.0.1:{free_port()}"
    settings.INFERENCE_URLS = [engine.url, second_engine.url, down]
    return engine, second_engine, down, version.name


def test_worker_ready_loads_active_adapters_onto_replicas_that_lack_them(replicas, caplog):
    holder, restarted, down, name = replicas

    with caplog.at_level(logging.INFO, logger="training.tasks"):
        tasks._restore_replica_adapters(sender=None)

    assert name in loaded_adapters(restarted)
    assert name in loaded_adapters(holder)
    # Only the replica that lacked it was loaded; the one that is down was skipped.
    assert f"restored active adapters on the replicas: {({holder.url: [], restarted.url: [name], down: []})}" in caplog.text


def test_worker_ready_survives_a_failure(monkeypatch, caplog):
    def broken(client=None):
        raise RuntimeError("registry unreadable")

    monkeypatch.setattr(serving_services, "ensure_replica_adapters", broken)
    with caplog.at_level(logging.ERROR, logger="training.tasks"):
        tasks._restore_replica_adapters(sender=None)
    assert "could not restore active adapters" in caplog.text


def test_worker_ready_handler_is_connected():
    from celery.signals import worker_ready

    assert any(key[0] == "training.restore_replica_adapters" for key, _ in worker_ready.receivers)


def test_ensure_adapters_command_reports_what_it_loaded(replicas):
    holder, restarted, down, name = replicas
    out = io.StringIO()

    call_command("ensure_adapters", stdout=out)

    assert out.getvalue().splitlines() == [f"{holder.url}: loaded 0 adapter(s)",
                                           f"{restarted.url}: loaded 1 adapter(s): {name}",
                                           f"{down}: loaded 0 adapter(s)"]
    assert name in loaded_adapters(restarted)
