"""The registry's services: numbering, constraints, integrity and compatibility checks.

Activation against live replicas is tested in test_client.py, with real engine servers.
"""
import json
from pathlib import Path

import pytest
from django.db import IntegrityError, transaction

from serving import services
from serving.adapters import WEIGHTS_FILE
from serving.client import InferenceClient
from serving.models import AdapterVersion
from serving.tests.test_adapters import make_peft_dir

AGENT = 7
pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    return make_peft_dir(tmp_path_factory.mktemp("peft") / "adapter")


@pytest.fixture
def base_model(settings, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 16}))
    settings.MODEL = str(model)
    settings.SERVED_MODEL_NAME = "base"
    return model


@pytest.fixture
def dead_client():
    """A client whose only replica is a closed port: anything that reaches it fails."""
    return InferenceClient(["http://127.0.0.1:9"], base_model="base", timeout=2)


def publish(user, peft_dir, **kwargs):
    return services.publish_version(user_id=user.pk, agent_id=AGENT, source_dir=peft_dir, **kwargs)


def flip_a_byte(version):
    weights = Path(version.path) / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def test_publish_numbers_versions_per_user_and_agent(user, other_user, peft_dir, base_model):
    first, second = publish(user, peft_dir), publish(user, peft_dir)
    other = services.publish_version(user_id=other_user.pk, agent_id=AGENT, source_dir=peft_dir)
    assert (first.number, second.number, other.number) == (1, 2, 1)
    assert second.name == f"u{user.pk}-a{AGENT}-v2"


def test_publish_stores_files_hash_and_base_model(user, peft_dir, base_model, settings):
    version = publish(user, peft_dir, config={"lr": 1e-4}, metrics={"loss": 0.5})
    assert version.path == str(settings.ADAPTER_ROOT / version.name)
    services.verify(version.path, version.sha256)
    assert (version.base_model_name, version.base_model_hash) == services.base_model_identity()
    assert not version.is_active and version.config == {"lr": 1e-4} and version.metrics == {"loss": 0.5}


def test_publish_records_the_parent(user, peft_dir, base_model):
    first = publish(user, peft_dir)
    assert publish(user, peft_dir, parent=first).parent == first


def test_publish_never_reuses_a_number_after_files_are_deleted(user, peft_dir, base_model):
    first = publish(user, peft_dir)
    services.delete_adapter(first.name)
    AdapterVersion.objects.filter(pk=first.pk).update(state=AdapterVersion.State.DELETED)
    assert publish(user, peft_dir).number == 2


def test_publish_replaces_an_orphaned_directory_left_by_a_crash(user, peft_dir, base_model, settings):
    from serving.adapters import write_adapter

    orphan = write_adapter(f"u{user.pk}-a{AGENT}-v1", make_peft_dir(settings.ADAPTER_ROOT.parent / "o", seed=9), base_model_name="x")
    version = publish(user, peft_dir)
    assert version.name == orphan.name and version.sha256 != orphan.sha256
    services.verify(version.path, version.sha256)


def test_publish_leaves_no_directory_when_the_row_cannot_be_saved(user, peft_dir, base_model, settings):
    # A row that holds the next version's name under another number: the insert must fail.
    AdapterVersion.objects.create(
        user=user, agent_id=AGENT, number=0, name=f"u{user.pk}-a{AGENT}-v1", path="x", sha256="0" * 64,
        base_model_name="base", base_model_hash="0" * 64,
    )
    with pytest.raises(IntegrityError):
        publish(user, peft_dir)
    assert [p for p in settings.ADAPTER_ROOT.iterdir()] == []


def test_publish_rejects_an_adapter_vllm_cannot_load(user, peft_dir, base_model, tmp_path):
    bad = make_peft_dir(tmp_path / "bad", r=4)
    with pytest.raises(services.InvalidAdapterError, match="rank"):
        publish(user, bad)
    assert not AdapterVersion.objects.exists()


def test_database_refuses_a_second_active_version(user, peft_dir, base_model):
    first, second = publish(user, peft_dir), publish(user, peft_dir)
    AdapterVersion.objects.filter(pk=first.pk).update(is_active=True)
    with pytest.raises(IntegrityError), transaction.atomic():
        AdapterVersion.objects.filter(pk=second.pk).update(is_active=True)


def test_database_refuses_a_duplicate_version_number(user, peft_dir, base_model):
    first = publish(user, peft_dir)
    with pytest.raises(IntegrityError), transaction.atomic():
        AdapterVersion.objects.create(
            user=user, agent_id=AGENT, number=first.number, name="another-name", path="x", sha256="0" * 64,
            base_model_name="base", base_model_hash=first.base_model_hash,
        )


def test_activate_refuses_a_flipped_byte_and_keeps_the_previous_version(user, peft_dir, base_model, dead_client):
    good, tampered = publish(user, peft_dir), publish(user, peft_dir)
    AdapterVersion.objects.filter(pk=good.pk).update(is_active=True)
    flip_a_byte(tampered)
    with pytest.raises(services.AdapterIntegrityError, match="integrity check"):
        services.activate_version(tampered, user_id=user.pk, agent_id=AGENT, actor_label="test", client=dead_client)
    assert services.active_version_for(user.pk, AGENT) == good


def test_activate_refuses_a_version_of_another_base_model(user, peft_dir, base_model, dead_client):
    version = publish(user, peft_dir)
    AdapterVersion.objects.filter(pk=version.pk).update(base_model_hash="f" * 64)
    with pytest.raises(services.IncompatibleAdapterError, match="another base model|not the one served"):
        services.activate_version(version, user_id=user.pk, agent_id=AGENT, actor_label="test", client=dead_client)


def test_activate_refuses_another_users_version(user, other_user, peft_dir, base_model, dead_client):
    version = publish(user, peft_dir)
    with pytest.raises(ValueError):
        services.activate_version(version, user_id=other_user.pk, agent_id=AGENT, actor_label="x", client=dead_client)


def test_activate_changes_nothing_when_a_replica_cannot_load(user, peft_dir, base_model, dead_client):
    from serving.client import InferenceUnavailable

    previous, new = publish(user, peft_dir), publish(user, peft_dir)
    AdapterVersion.objects.filter(pk=previous.pk).update(is_active=True)
    with pytest.raises(InferenceUnavailable):
        services.activate_version(new, user_id=user.pk, agent_id=AGENT, actor_label="test", client=dead_client)
    assert services.active_version_for(user.pk, AGENT) == previous


def test_reset_to_base_deactivates_without_loading(user, peft_dir, base_model, dead_client):
    version = publish(user, peft_dir)
    AdapterVersion.objects.filter(pk=version.pk).update(is_active=True)
    assert services.activate_version(None, user_id=user.pk, agent_id=AGENT, actor_label="t", client=dead_client) is None
    assert services.active_version_for(user.pk, AGENT) is None


def test_active_version_falls_back_to_base_when_the_base_model_changed(user, peft_dir, base_model, settings, tmp_path):
    version = publish(user, peft_dir)
    AdapterVersion.objects.filter(pk=version.pk).update(is_active=True)
    assert services.active_version_for(user.pk, AGENT) == version
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    settings.MODEL = str(other)
    assert services.active_version_for(user.pk, AGENT) is None
    assert list(services.incompatible_versions_for(user.pk, AGENT)) == [version]


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_aactive_version_for_matches_the_sync_one(user, peft_dir, base_model):
    from asgiref.sync import sync_to_async
    from django.db import connections

    version = await sync_to_async(publish)(user, peft_dir)
    await AdapterVersion.objects.filter(pk=version.pk).aupdate(is_active=True)
    try:
        assert await services.aactive_version_for(user.pk, AGENT) == version
    finally:
        await sync_to_async(connections.close_all)()  # the ORM's worker thread holds its own connection


def test_base_model_identity_hashes_the_model_config(base_model):
    import hashlib

    name, config_hash = services.base_model_identity()
    assert name == "base"
    assert config_hash == hashlib.sha256((base_model / "config.json").read_bytes()).hexdigest()
