"""A published adapter's weights corrupted on disk (one flipped byte in adapter_model.safetensors):
activation is refused by its sha256, the previous version stays active, and the audit log says why.

serving/tests/test_services.py covers the refusal inside serving; this covers what training adds
(the `<action>_failed` audit event) through the service and through the user's rollback page,
whose request transaction (ATOMIC_REQUESTS) must keep the audit row when the switch fails.
"""
import json
from pathlib import Path

import pytest
from django.urls import reverse

from chat.tests.factories import AgentFactory
from serving import services as serving_services
from serving.adapters import WEIGHTS_FILE
from serving.models import AdapterVersion
from serving.tests.test_adapters import make_peft_dir
from training import services
from training.models import AuditEvent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    return make_peft_dir(tmp_path_factory.mktemp("peft") / "adapter")


@pytest.fixture
def base_model(settings, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 16}))
    settings.MODEL, settings.SERVED_MODEL_NAME = str(model), "base"
    return model


def flip_a_byte(version):
    weights = Path(version.path) / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def publish(user, agent, peft_dir):
    return serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=peft_dir)


def test_activating_a_corrupted_version_is_refused_and_audited(user, peft_dir, base_model):
    agent = AgentFactory()
    good, bad = publish(user, agent, peft_dir), publish(user, agent, peft_dir)
    AdapterVersion.objects.filter(pk=good.pk).update(is_active=True)  # as if hot-loaded earlier
    flip_a_byte(bad)

    with pytest.raises(serving_services.AdapterIntegrityError, match="integrity check"):
        services.activate(bad, user=user, agent=agent, actor=None, reason="training job 1")

    assert serving_services.active_version_for(user.pk, agent.pk) == good
    event = AuditEvent.objects.get(action="activate_failed")
    assert event.subject_user_id == user.pk and event.agent_id == agent.pk
    assert (event.target_type, event.target_id) == ("AdapterVersion", str(bad.pk))
    assert "integrity check failed" in event.reason and "sha256" in event.reason
    assert event.before == {"version": good.name} and event.after == {"version": bad.name}


def test_rollback_to_a_corrupted_version_from_the_page_keeps_the_audit_row(client, user, peft_dir, base_model):
    agent = AgentFactory()
    old, current = publish(user, agent, peft_dir), publish(user, agent, peft_dir)
    AdapterVersion.objects.filter(pk=current.pk).update(is_active=True)
    flip_a_byte(old)
    client.force_login(user)

    response = client.post(reverse("training:activate", args=[agent.pk]), {"version": old.pk}, follow=True)

    assert response.status_code == 200
    assert "Could not switch" in response.content.decode()
    assert serving_services.active_version_for(user.pk, agent.pk) == current
    event = AuditEvent.objects.get(action="rollback_failed")
    assert event.actor == user and "integrity check failed" in event.reason
    assert not AuditEvent.objects.filter(action="rollback").exists()
