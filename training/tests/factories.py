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

import os  # noqa: E402

from training.testing import run_worker, wait_for  # noqa: E402,F401  (re-exported for the tests)


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
