"""The whole loop with real processes: engine subprocess, Celery worker subprocess, Postgres, Redis."""
import os
import signal
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings

from chat import services as chat_services
from chat.tests.factories import engine, live_engine, model_settings  # noqa: F401  (fixtures)
from serving.models import AdapterVersion
from training import services
from training.models import TrainingJob

from .factories import AgentFactory, ConversationFactory, UserFactory, run_worker, wait_for, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


@pytest.fixture
def shared_adapter_root(settings):
    """The worker can't see this process's per-test ADAPTER_ROOT: use the run's one (test.py)."""
    from clawplatform.settings import test as test_settings

    settings.ADAPTER_ROOT = Path(test_settings.ADAPTER_ROOT) / f"loop-{os.getpid()}"
    settings.ADAPTER_ROOT.mkdir(parents=True, exist_ok=True)
    return settings.ADAPTER_ROOT


def env_for(engine, adapter_root):
    return worker_env(model_dir=django_settings.MODEL, inference_url=engine.url,
                      extra={"ADAPTER_ROOT": str(adapter_root)})


def ask(user, agent, text, conversation=None):
    conversation = conversation or chat_services.create_conversation(user, agent)
    turn = chat_services.post_user_message(conversation, text, user=user)
    return async_to_sync(chat_services.acollect_reply)(turn)


def test_full_loop_feedback_to_live_version(live_engine, shared_adapter_root):
    alice, bob = UserFactory(), UserFactory()
    agent = AgentFactory(review_policy="auto_all", batch_size=1, steps_per_job=4, learning_rate=1e-3,
                         temperature=1.0, max_tokens=8)
    greedy = {"temperature": 0.0, "seed": 0}
    bob_conv = chat_services.create_conversation(bob, agent)
    bob_before = async_to_sync(chat_services.acollect_reply)(
        chat_services.post_user_message(bob_conv, "What is the capital of France?", user=bob), sampling=greedy)

    reply = ask(alice, agent, "What is the capital of France?")
    assert reply.token_ids and reply.logprobs and reply.prompt_token_ids  # real engine data, stored
    with run_worker(env_for(live_engine, shared_adapter_root)) as worker:
        # A batch of one reply: the correction alone queues the job.
        chat_services.record_feedback(reply, user=alice, kind="correction", corrected_text="Paris.",
                                      comment="answer in one word")
        job = wait_for(lambda: TrainingJob.objects.filter(user=alice, state__in=["succeeded", "failed"]).first(),
                       timeout=600, what="the training job", process=worker)
    assert job.state == "succeeded", job.error
    version = AdapterVersion.objects.get(user=alice)
    assert version.is_active
    assert job.metrics["logp_target_after"] > job.metrics["logp_target_before"]

    next_reply = ask(alice, agent, "What is the capital of France?")
    assert next_reply.adapter_name == version.name and next_reply.adapter_version_id == version.pk

    bob_after = async_to_sync(chat_services.acollect_reply)(
        chat_services.post_user_message(chat_services.create_conversation(bob, agent),
                                        "What is the capital of France?", user=bob), sampling=greedy)
    assert bob_after.adapter_name == "" and bob_after.token_ids == bob_before.token_ids


def test_worker_killed_mid_job_publishes_exactly_one_version(live_engine, shared_adapter_root):
    user = UserFactory()
    agent = AgentFactory(review_policy="auto_all", batch_size=100, steps_per_job=60, learning_rate=1e-4,
                         training_method="binary")
    reply = ask(user, agent, "What is the capital of France?")
    chat_services.record_feedback(reply, user=user, kind="thumb_up")
    env = env_for(live_engine, shared_adapter_root)
    with run_worker(env, queues="default", name="feedback") as worker:
        wait_for(lambda: services.ready_samples(user, agent).exists(), timeout=120, what="sample", process=worker)
    job = services.request_training(user, agent, trigger="manual")
    with run_worker(env, queues="training", name="doomed") as worker:
        wait_for(lambda: TrainingJob.objects.get(pk=job.pk).progress >= 5, timeout=600, what="progress",
                 process=worker)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    assert TrainingJob.objects.get(pk=job.pk).state == "running"
    assert not AdapterVersion.objects.filter(user=user).exists()
    # The unacked message comes back after the test settings' visibility_timeout (20 s).
    with run_worker(env, queues="training", name="rescuer") as worker:
        job = wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, state__in=["succeeded", "failed"]).first(),
                       timeout=600, what="the rerun", process=worker)
    assert job.state == "succeeded", job.error
    assert AdapterVersion.objects.filter(user=user).count() == 1
