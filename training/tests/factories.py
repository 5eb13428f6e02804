"""Factories for training's models, on top of chat's (users, agents, turns, feedback)."""
import factory

from chat.tests.factories import (  # noqa: F401  (re-exported for training's tests)
    AgentFactory,
    ConversationFactory,
    FeedbackFactory,
    ReplyFactory,
    TurnFactory,
    UserFactory,
)
from training.models import TrainingJob, TrainingSample


def reply_with_context(conversation, question="What is the capital of France?", answer="Paris.", **fields):
    """A user question and the assistant reply to it; returns the reply."""
    asked = TurnFactory(conversation=conversation, content=question)
    return ReplyFactory(conversation=conversation, parent=asked, content=answer, **fields)


class TrainingSampleFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = TrainingSample

    feedback = factory.SubFactory(FeedbackFactory)
    turn = factory.LazyAttribute(lambda s: s.feedback.turn)
    user = factory.LazyAttribute(lambda s: s.feedback.author)
    agent = factory.LazyAttribute(lambda s: s.turn.conversation.agent)
    reward = 1.0
    context_messages = factory.LazyFunction(lambda: [{"role": "user", "content": "hi"}])
    classifier = "explicit"


class TrainingJobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = TrainingJob

    user = factory.SubFactory(UserFactory)
    agent = factory.SubFactory(AgentFactory)
    method = "combined"


# A real Celery worker
# ------------------------------------------------------------------------------

import contextlib  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def worker_env(*, model_dir, inference_url, extra=None):
    """Environment for a worker that uses this test run's database, Redis prefix and model."""
    from django.db import connection

    db = connection.settings_dict
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test",
        "CLAW_TEST_RUN_ID": os.environ["CLAW_TEST_RUN_ID"],
        # The test settings would prefix the name again; the worker opens the test DB as is.
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        "MODEL": str(model_dir),
        "INFERENCE_URL": inference_url,
        "TRAIN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


@contextlib.contextmanager
def run_worker(env, *, queues="default,training", name="w1"):
    """`celery -A clawplatform worker -Q ... -c 1 --pool=solo` in a real subprocess."""
    log_dir = REPO / "var" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"worker-{env['CLAW_TEST_RUN_ID']}-{name}-{int(time.time())}.log"
    command = [sys.executable, "-m", "celery", "-A", "clawplatform", "worker", "-Q", queues, "-c", "1",
               "--pool=solo", "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "INFO"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_path = log_path
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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
