"""After MODEL changes, versions trained on the old base are never served, and the user is told why.

serving/tests/test_services.py covers the registry's pieces with a hand-edited hash; this follows
one user end to end with a real second base model (same tokenizer and weights, another
config.json, so another config hash): registry, activation, rollback, generation, panel.
"""
import json
import shutil

import pytest
from django.urls import reverse

from chat.tests.factories import AgentFactory, ConversationFactory, TurnFactory
from serving import services as serving_services
from serving.client import StreamEvent
from serving.models import AdapterVersion

pytestmark = pytest.mark.django_db


@pytest.fixture
def second_model(tiny_model_dir, tmp_path):
    """The tiny model with another config.json: a different base model to the registry."""
    other = tmp_path / "tiny-retrained"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (other / "config.json").write_text(json.dumps(config))
    return other


@pytest.fixture
def old_active(settings, tiny_model_dir, tmp_path, user):
    """An active version trained on the first base model."""
    from serving.engine.testing import make_peft_adapter

    settings.MODEL = str(tiny_model_dir)
    settings.SERVED_MODEL_NAME = "base"
    agent = AgentFactory()
    source = make_peft_adapter(tiny_model_dir, tmp_path / "src", rank=8, target_modules=("q_proj",))
    version = serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=source)
    AdapterVersion.objects.filter(pk=version.pk).update(is_active=True)
    assert serving_services.active_version_for(user.pk, agent.pk) == version
    return agent, version


@pytest.fixture
def model_changed(settings, second_model, old_active):
    settings.MODEL = str(second_model)
    return old_active


def test_the_base_model_hash_follows_model(settings, tiny_model_dir, second_model):
    settings.MODEL = str(tiny_model_dir)
    first = serving_services.base_model_identity()
    settings.MODEL = str(second_model)
    assert serving_services.base_model_identity()[1] != first[1]


def test_the_old_active_version_is_not_served(model_changed, user):
    agent, version = model_changed
    assert serving_services.active_version_for(user.pk, agent.pk) is None
    assert list(serving_services.serveable_active_versions()) == []


def test_activation_refuses_a_version_of_the_old_base(model_changed, user):
    agent, version = model_changed

    class NoLoads:
        def load_adapter_sync(self, *args, **kwargs):
            raise AssertionError("an incompatible version must never reach a replica")

    with pytest.raises(serving_services.IncompatibleAdapterError, match="another base model|not the one served"):
        serving_services.activate_version(version, user_id=user.pk, agent_id=agent.pk, client=NoLoads())


def test_rollback_skips_versions_of_the_old_base(model_changed, user):
    agent, version = model_changed

    class Replicas:
        def unload_adapter_sync(self, *args, **kwargs):
            return {}

    assert serving_services.rollback(user_id=user.pk, agent_id=agent.pk, client=Replicas()) is None


def test_a_replica_restart_does_not_restore_the_old_version(model_changed, user):
    class Replica:
        loaded = []

        def health_sync(self, *, timeout=2.0):
            return {"http://r1": {"ok": True, "adapters": [], "error": None}}

        def load_adapter_sync(self, name, path, *, urls=None):
            self.loaded.append(name)

    replica = Replica()
    serving_services.ensure_replica_adapters(client=replica)
    assert replica.loaded == []


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_generation_uses_the_base_model(settings, tiny_model_dir, second_model, tmp_path, monkeypatch):
    from asgiref.sync import sync_to_async
    from django.db import connections

    from chat import services as chat_services
    from serving import client as serving_client

    def setup():
        from chat.tests.factories import UserFactory
        from serving.engine.testing import make_peft_adapter

        settings.MODEL = str(tiny_model_dir)
        user = UserFactory()
        agent = AgentFactory(max_tokens=4)
        source = make_peft_adapter(tiny_model_dir, tmp_path / "src", rank=8, target_modules=("q_proj",))
        version = serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=source)
        AdapterVersion.objects.filter(pk=version.pk).update(is_active=True)
        conversation = ConversationFactory(user=user, agent=agent)
        return TurnFactory(conversation=conversation, content="hello")

    question = await sync_to_async(setup)()
    settings.MODEL = str(second_model)
    asked = []

    class Recorder:
        async def stream_chat(self, messages, *, adapter=None, params=None, affinity_key=None):
            asked.append(adapter)
            yield StreamEvent(text="hi", token_ids=[5], logprobs=[-0.1], finish_reason="stop", prompt_token_ids=[1])

    monkeypatch.setattr(serving_client, "get_client", Recorder)
    try:
        reply = await chat_services.acollect_reply(question)
        assert asked == [None]
        assert (reply.adapter_name, reply.adapter_version_id, reply.status) == ("", None, "complete")
    finally:
        await sync_to_async(connections.close_all)()


def test_the_panel_says_the_base_model_is_served_and_why(client, model_changed, user):
    agent, version = model_changed
    client.force_login(user)
    html = client.get(reverse("training:panel", args=[agent.pk])).content.decode()
    assert 'data-version="base"' in html
    assert "trained on another base model" in html
    history = client.get(reverse("training:history", args=[agent.pk])).content.decode()
    assert "other base model" in history
    assert f"?version={version.pk}" not in history  # no switch/rollback link to it
