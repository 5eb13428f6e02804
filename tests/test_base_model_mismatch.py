"""After MODEL changes, versions trained on the old base are never served, and the user is told why.

serving/tests/test_services.py covers the registry's pieces with a hand-edited hash; this follows
one user end to end with a real second base model (same tokenizer and weights, another
config.json, so another config hash): registry, activation, rollback, generation, panel.
"""
import json
import shutil

import pytest
from django.urls import reverse

from chat.tests.factories import (  # noqa: F401  (engine fixtures)
    AgentFactory,
    ConversationFactory,
    TurnFactory,
    engine,
    loaded_adapters,
    unload_after,
)
from serving import services as serving_services
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


@pytest.fixture
def replica(settings, engine, unload_after):
    """The session's engine as the only replica (MODEL is left as the test set it)."""
    unload_after(engine)
    settings.INFERENCE_URLS = [engine.url]
    return engine


def test_activation_refuses_a_version_of_the_old_base(model_changed, user, replica):
    agent, version = model_changed

    with pytest.raises(serving_services.IncompatibleAdapterError, match="another base model|not the one served"):
        serving_services.activate_version(version, user_id=user.pk, agent_id=agent.pk)

    assert version.name not in loaded_adapters(replica)  # it never reached the replica
    assert AdapterVersion.objects.get(pk=version.pk).is_active  # and nothing changed


def test_rollback_skips_versions_of_the_old_base(model_changed, user, replica):
    agent, version = model_changed
    assert serving_services.rollback(user_id=user.pk, agent_id=agent.pk) is None
    assert not AdapterVersion.objects.filter(is_active=True).exists()
    assert version.name not in loaded_adapters(replica)


def test_a_replica_restart_does_not_restore_the_old_version(model_changed, user, replica):
    agent, version = model_changed
    assert serving_services.ensure_replica_adapters() == {replica.url: []}
    assert version.name not in loaded_adapters(replica)


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_generation_uses_the_base_model(settings, tiny_model_dir, second_model, tmp_path, engine):
    from asgiref.sync import sync_to_async
    from django.db import connections

    from chat import services as chat_services

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
        return version, TurnFactory(conversation=conversation, content="hello")

    version, question = await sync_to_async(setup)()
    settings.MODEL = str(second_model)
    settings.INFERENCE_URLS = [engine.url]
    try:
        reply = await chat_services.acollect_reply(question)
        # Asked for the old version, the engine would answer 404 and the reload hook refuse it: a failed reply.
        assert (reply.adapter_name, reply.adapter_version_id, reply.status) == ("", None, "complete")
        assert reply.sampling_params["model"] == "base" and reply.token_ids and reply.prompt_token_ids
        assert version.name not in await sync_to_async(loaded_adapters)(engine)
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
