"""factory_boy factories for chat's models, and fixtures for a real inference engine.

Test modules import the fixtures they need from here (`from chat.tests.factories import engine`).
"""
import factory
import pytest
from django.contrib.auth import get_user_model

from chat.models import Agent, Conversation, Feedback, Turn


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", "pw-user-123!")


class AgentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Agent

    owner = None
    name = factory.Sequence(lambda n: f"Agent {n}")
    slug = factory.Sequence(lambda n: f"agent-{n}")
    system_prompt = "You are a helpful assistant."
    temperature = 0.0
    max_tokens = 8


class ConversationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Conversation

    user = factory.SubFactory(UserFactory)
    agent = factory.SubFactory(AgentFactory)
    title = ""


class TurnFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Turn

    conversation = factory.SubFactory(ConversationFactory)
    parent = None
    index = factory.LazyAttribute(lambda t: t.parent.index + 1 if t.parent else 0)
    role = Turn.Role.USER
    content = factory.Sequence(lambda n: f"message {n}")
    status = Turn.Status.COMPLETE


class ReplyFactory(TurnFactory):
    role = Turn.Role.ASSISTANT
    content = factory.Sequence(lambda n: f"reply {n}")
    token_ids = [1, 2, 3]
    logprobs = [-0.1, -0.2, -0.3]


class FeedbackFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Feedback

    turn = factory.SubFactory(ReplyFactory)
    author = factory.LazyAttribute(lambda f: f.turn.conversation.user)
    kind = Feedback.Kind.THUMB_UP


def exchange(conversation, n, *, words=1):
    """Store n (user, reply) pairs on one branch; returns the turns, oldest first."""
    turns, parent = [], None
    for i in range(n):
        text = " ".join([f"question{i}"] * words)
        user_turn = TurnFactory(conversation=conversation, parent=parent, content=text)
        reply = ReplyFactory(conversation=conversation, parent=user_turn, content=" ".join([f"answer{i}"] * words))
        turns += [user_turn, reply]
        parent = reply
    return turns


# Real inference
# ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    """The built-in engine serving the tiny demo model, in a real subprocess, for the whole run."""
    from serving.engine.testing import run_engine_server

    with run_engine_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="session")
def second_engine(tiny_model_dir):
    """Another engine on the tiny model, for tests that need two replicas (one started per run)."""
    from serving.engine.testing import run_engine_server

    with run_engine_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def slow_engine(tiny_model_dir):
    """An engine that waits 50 ms after each decoding step, so a reply can be stopped mid-way."""
    from serving.engine.testing import run_engine_server

    with run_engine_server(tiny_model_dir, extra_args=["--step-delay", "0.05"]) as server:
        yield server


def loaded_adapters(server):
    """The adapter names an engine lists in `GET /v1/models` (the base model left out)."""
    import httpx

    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def engine_stats(server):
    """An engine's own gauges from its `GET /metrics`: generated_tokens, running_requests, ..."""
    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {name.removeprefix("claw_engine_"): float(value)
            for name, value in (line.split() for line in text.splitlines() if line and not line.startswith("#"))}


@pytest.fixture
def unload_after():
    """`unload_after(*engines)`: adapters the test loads on those engines are unloaded when it ends.

    The engines live for the whole run; a test must not leave its adapters to the next one.
    """
    import httpx

    watched = []

    def watch(*servers):
        watched.extend((server, loaded_adapters(server)) for server in servers)

    yield watch
    for server, before in watched:
        for name in loaded_adapters(server) - before:
            httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)


@pytest.fixture
def model_settings(settings, tiny_model_dir):
    """Point prompt building (tokenizer, context length) at the tiny model."""
    settings.MODEL = str(tiny_model_dir)
    settings.MODEL_MAX_CONTEXT = 0
    return settings


@pytest.fixture
def live_engine(model_settings, engine):
    model_settings.INFERENCE_URLS = [engine.url]
    return engine


@pytest.fixture
def dead_engine(model_settings):
    from serving.engine.testing import free_port

    model_settings.INFERENCE_URLS = [f"http://127.0.0.1:{free_port()}"]
    model_settings.INFERENCE_TIMEOUT = 5.0
    return model_settings.INFERENCE_URLS[0]
