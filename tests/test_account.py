"""A user's account: data export (conversations JSON, adapters zip that peft loads) and deletion."""
import io
import json
import logging
import zipfile

import pytest
from django.urls import reverse

from chat.models import Agent, ApiKey, Conversation, Feedback, Turn
from chat.tests.factories import (  # noqa: F401  (engine fixtures)
    AgentFactory,
    ConversationFactory,
    FeedbackFactory,
    ReplyFactory,
    TurnFactory,
    engine,
    loaded_adapters,
    unload_after,
)
from serving import services as serving_services
from serving.adapters import ADAPTER_FILES, adapter_path, validate
from serving.models import AdapterVersion
from training import services as training_services
from training.models import AuditEvent, TrainingJob, TrainingSample

pytestmark = pytest.mark.django_db

ACCOUNT_URLS = ["chat:export", "chat:export_conversations", "chat:export_adapters", "chat:account_delete"]


@pytest.fixture
def model(settings, tiny_model_dir):
    settings.MODEL = str(tiny_model_dir)
    settings.SERVED_MODEL_NAME = "base"
    return tiny_model_dir


def publish(user, agent, model, tmp_path, *, seed, active=False):
    from serving.engine.testing import make_peft_adapter

    source = make_peft_adapter(model, tmp_path / f"src-{user.pk}-{seed}", rank=8, alpha=16, seed=seed,
                               target_modules=("q_proj", "v_proj"))
    version = serving_services.publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=source)
    if active:
        AdapterVersion.objects.filter(pk=version.pk).update(is_active=True)
    return version


def chat_history(user, agent, text="hello"):
    conversation = ConversationFactory(user=user, agent=agent, title=f"{user.username}'s chat")
    question = TurnFactory(conversation=conversation, content=f"{text} question")
    reply = ReplyFactory(conversation=conversation, parent=question, content=f"{text} answer")
    thumb = FeedbackFactory(turn=reply, author=user, kind=Feedback.Kind.THUMB_DOWN, reason="Too long")
    correction = FeedbackFactory(turn=reply, author=user, kind=Feedback.Kind.CORRECTION, corrected_text=f"{text} fixed")
    return conversation, question, reply, thumb, correction


def download_zip(client):
    response = client.get(reverse("chat:export_adapters"))
    assert response.status_code == 200
    assert response["Content-Type"] == "application/zip"
    return zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))


# Export
# ------------------------------------------------------------------------------


def test_conversations_export_holds_every_turn_with_its_feedback(client, user, other_user):
    agent = AgentFactory()
    conversation, question, reply, thumb, correction = chat_history(user, agent)
    chat_history(other_user, agent, text="secret")
    client.force_login(user)

    response = client.get(reverse("chat:export_conversations"))

    assert response.status_code == 200
    assert "attachment" in response["Content-Disposition"]
    data = json.loads(response.content)
    assert data["format"] == "claw-export/1" and data["user"]["username"] == "alice"
    [exported] = data["conversations"]
    assert exported["id"] == conversation.pk and exported["agent"]["slug"] == agent.slug
    assert [(t["role"], t["content"]) for t in exported["turns"]] == [("user", "hello question"), ("assistant", "hello answer")]
    feedback = exported["turns"][1]["feedback"]
    assert {(f["kind"], f["reason"], f["corrected_text"]) for f in feedback} == {
        ("thumb_down", "Too long", ""), ("correction", "", "hello fixed")}
    assert "secret" not in response.content.decode()


def test_adapter_zip_directories_load_in_peft_with_the_stored_adapters_logits(client, user, model, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    agent = AgentFactory()
    version = publish(user, agent, model, tmp_path, seed=3, active=True)
    client.force_login(user)

    archive = download_zip(client)
    archive.extractall(tmp_path / "export")
    exported = tmp_path / "export" / version.name

    ids = torch.tensor([[1, 5, 9, 13, 2]])

    def logits(adapter_dir):
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        with torch.no_grad():
            return peft_model(ids).logits

    from_zip, stored = logits(exported), logits(version.path)
    assert torch.equal(from_zip, stored)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, stored)  # the adapter does something


def test_adapter_zip_holds_vllm_loadable_directories_named_by_version(client, user, model, tmp_path):
    agent = AgentFactory()
    first = publish(user, agent, model, tmp_path, seed=1)
    second = publish(user, agent, model, tmp_path, seed=2, active=True)
    client.force_login(user)

    archive = download_zip(client)
    archive.extractall(tmp_path / "export")

    names = set(archive.namelist())
    assert names == {f"{v.name}/{f}" for v in (first, second) for f in ADAPTER_FILES} | {"manifest.json"}
    for version in (first, second):
        config = validate(tmp_path / "export" / version.name)  # the checks vLLM's loader needs
        assert config["base_model_name_or_path"] == "base"
        assert (tmp_path / "export" / version.name / "adapter_model.safetensors").read_bytes() == (
            adapter_path(version.name) / "adapter_model.safetensors").read_bytes()
    manifest = json.loads(archive.read("manifest.json"))
    assert [(v["name"], v["active"], v["included"]) for v in manifest["versions"]] == [
        (first.name, False, True), (second.name, True, True)]


def test_adapter_zip_skips_versions_whose_files_were_deleted(client, user, model, tmp_path):
    agent = AgentFactory()
    version = publish(user, agent, model, tmp_path, seed=1)
    AdapterVersion.objects.filter(pk=version.pk).update(state=AdapterVersion.State.DELETED)
    client.force_login(user)
    archive = download_zip(client)
    assert archive.namelist() == ["manifest.json"]
    assert json.loads(archive.read("manifest.json"))["versions"][0]["included"] is False


def test_a_user_exports_only_their_own_adapters(client, user, other_user, model, tmp_path):
    agent = AgentFactory()
    publish(user, agent, model, tmp_path, seed=1)
    client.force_login(other_user)
    assert download_zip(client).namelist() == ["manifest.json"]


@pytest.mark.parametrize("name", ACCOUNT_URLS)
def test_account_pages_need_a_login(client, name):
    response = client.get(reverse(name))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_the_settings_page_links_export_and_delete(client, user):
    client.force_login(user)
    html = client.get(reverse("chat:settings")).content.decode()
    assert reverse("chat:export") in html and reverse("chat:account_delete") in html
    page = client.get(reverse("chat:export")).content.decode()
    assert reverse("chat:export_conversations") in page and reverse("chat:export_adapters") in page


# Deletion
# ------------------------------------------------------------------------------


@pytest.fixture
def alice_world(user, other_user, model, tmp_path, staff_user):
    """Alice has chats, feedback, a sample, a job, two versions (one active), a key, an agent and audit events."""
    agent = AgentFactory()
    own_agent = AgentFactory(owner=user)
    conversation, question, reply, thumb, correction = chat_history(user, agent)
    TrainingSample.objects.create(user=user, agent=agent, feedback=thumb, turn=reply, reward=-1.0, classifier="explicit")
    job = TrainingJob.objects.create(user=user, agent=agent, state="succeeded", method="combined")
    old = publish(user, agent, model, tmp_path, seed=1)
    active = publish(user, agent, model, tmp_path, seed=2, active=True)
    ApiKey.objects.create_key(user, "laptop")
    events = [
        training_services.audit(actor=user, action="activate", subject_user_id=user.pk, agent_id=agent.pk, target=active),
        training_services.audit(actor=staff_user, action="approve_feedback", subject_user_id=user.pk, target=thumb),
        training_services.audit(actor=user, action="approve_feedback", subject_user_id=other_user.pk),
    ]
    theirs = publish(other_user, agent, model, tmp_path, seed=4, active=True)
    chat_history(other_user, agent, text="bob")
    return {"agent": agent, "own_agent": own_agent, "job": job, "versions": [old, active], "events": events,
            "theirs": theirs}


def test_deleting_needs_the_right_password(client, user, alice_world):
    client.force_login(user)
    response = client.post(reverse("chat:account_delete"), {"password": "wrong"})
    assert response.status_code == 400
    assert "not your password" in response.content.decode()
    assert Conversation.objects.filter(user=user).exists()
    assert all(adapter_path(v.name).is_dir() for v in alice_world["versions"])


def test_deleting_removes_rows_and_adapter_files(client, user, alice_world, django_user_model,
                                                 django_capture_on_commit_callbacks):
    client.force_login(user)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("chat:account_delete"), {"password": "pw-alice-123!"})

    assert response.status_code == 302 and response["Location"] == reverse("login")
    assert not django_user_model.objects.filter(pk=user.pk).exists()
    for model, lookup in [(Conversation, "user_id"), (Turn, "conversation__user_id"), (Feedback, "author_id"),
                          (TrainingSample, "user_id"), (TrainingJob, "user_id"), (AdapterVersion, "user_id"),
                          (ApiKey, "user_id"), (Agent, "owner_id")]:
        assert not model.objects.filter(**{lookup: user.pk}).exists(), model
    assert not any(adapter_path(v.name).exists() for v in alice_world["versions"])
    # Nobody else's data moved.
    assert adapter_path(alice_world["theirs"].name).is_dir()
    assert Conversation.objects.filter(user__username="mallory").count() == 1
    # The session is gone too.
    assert client.get(reverse("chat:home")).status_code == 302


def test_the_audit_log_keeps_every_event_with_the_user_tombstoned(client, user, other_user, staff_user, alice_world,
                                                                   django_capture_on_commit_callbacks):
    user_id = user.pk
    event_ids = [e.pk for e in alice_world["events"]]
    client.force_login(user)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("chat:account_delete"), {"password": "pw-alice-123!"})

    activate, approve_by_staff, approve_by_alice = [AuditEvent.objects.get(pk=pk) for pk in event_ids]
    assert (activate.actor_id, activate.actor_label) == (None, AuditEvent.TOMBSTONE)
    assert (activate.subject_user_id, activate.subject_label) == (None, AuditEvent.TOMBSTONE)
    assert activate.action == "activate" and activate.target_id == str(alice_world["versions"][1].pk)
    assert (approve_by_staff.actor_id, approve_by_staff.actor_label) == (staff_user.pk, "sam")
    assert approve_by_staff.subject_label == AuditEvent.TOMBSTONE
    assert (approve_by_alice.actor_label, approve_by_alice.subject_user_id) == (AuditEvent.TOMBSTONE, other_user.pk)
    deletion = AuditEvent.objects.get(action="delete_account")
    assert (deletion.actor_label, deletion.subject_label, deletion.subject_user_id) == (
        AuditEvent.TOMBSTONE, AuditEvent.TOMBSTONE, None)
    assert deletion.before["adapter_versions"] == 2 and deletion.before["conversations"] == 1
    assert not AuditEvent.objects.filter(subject_user_id=user_id).exists()
    assert not AuditEvent.objects.filter(actor_label="alice").exists()


def load_on(server, *versions):
    import httpx

    for version in versions:
        response = httpx.post(f"{server.url}/v1/load_lora_adapter",
                              json={"lora_name": version.name, "lora_path": version.path})
        assert response.status_code == 200, response.text


def test_deleting_unloads_the_active_adapter_from_the_replicas(client, user, alice_world, settings, engine,
                                                               unload_after, django_capture_on_commit_callbacks):
    unload_after(engine)
    active, theirs = alice_world["versions"][1], alice_world["theirs"]
    load_on(engine, active, theirs)
    settings.INFERENCE_URLS = [engine.url]
    client.force_login(user)

    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("chat:account_delete"), {"password": "pw-alice-123!"})

    loaded = loaded_adapters(engine)
    assert active.name not in loaded
    assert theirs.name in loaded  # another user's adapter stays served


def test_a_replica_that_is_down_does_not_stop_the_deletion(client, user, alice_world, settings, engine, unload_after,
                                                          caplog, django_capture_on_commit_callbacks):
    from serving.engine.testing import free_port

    unload_after(engine)
    active = alice_world["versions"][1]
    load_on(engine, active)
    down = f"http://127.0.0.1:{free_port()}"
    settings.INFERENCE_URLS = [engine.url, down]
    client.force_login(user)

    with caplog.at_level(logging.WARNING, logger="serving.client"), django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("chat:account_delete"), {"password": "pw-alice-123!"})

    assert response.status_code == 302
    assert f"Could not unload {active.name} from {down}" in caplog.text
    assert active.name not in loaded_adapters(engine)
    assert not any(adapter_path(v.name).exists() for v in alice_world["versions"])


def test_a_failed_deletion_keeps_rows_and_files(user, alice_world, monkeypatch):
    from chat import account

    def refuse(self, *args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(type(user), "delete", refuse)
    with pytest.raises(RuntimeError):
        account.delete_account(user)
    assert AuditEvent.objects.filter(subject_user_id=user.pk).count() == 2
    assert all(adapter_path(v.name).is_dir() for v in alice_world["versions"])
