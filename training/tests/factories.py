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
