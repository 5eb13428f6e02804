"""The JSONL export round-trips into a TRL-style conversational dataset (no `datasets` needed)."""
import json
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from chat.models import Feedback
from chat.tests.factories import AgentFactory
from training import export, services
from training.models import AuditEvent, TrainingSample
from training.tests.test_review import make_feedback

pytestmark = pytest.mark.django_db


def download(client, **params):
    response = client.get(reverse("training:export"), params)
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    assert response["Content-Disposition"].startswith("attachment;")
    body = b"".join(response.streaming_content).decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def to_conversational_dataset(records):
    """What `datasets.Dataset.from_list` would get for TRL's SFTTrainer: only `messages`."""
    rows = []
    for record in records:
        messages = record["messages"]
        assert all(set(m) == {"role", "content"} for m in messages)
        assert all(m["role"] in {"system", "user", "assistant", "tool"} for m in messages)
        assert messages[-1]["role"] == "assistant"
        rows.append({"messages": messages})
    return rows


@pytest.fixture
def approved(user, staff_user):
    agent = AgentFactory(batch_size=50, system_prompt="Be brief.")
    correction = make_feedback(user, agent, kind=Feedback.Kind.CORRECTION, corrected_text="Fixed answer.",
                               comment="shorter please")
    services.approve_feedback(correction, reviewer=staff_user)
    thumb = make_feedback(user, agent, kind=Feedback.Kind.THUMB_UP)
    services.approve_feedback(thumb, reviewer=staff_user)
    return {"agent": agent, "correction": correction, "thumb": thumb}


def test_export_round_trips_into_a_conversational_dataset(client, staff_user, approved):
    client.force_login(staff_user)

    records = download(client)
    dataset = to_conversational_dataset(records)

    assert len(dataset) == TrainingSample.objects.count() == 3  # correction: directive + evaluative; thumb: one
    directive = next(r for r in records if r["correction"])
    assert directive["messages"][-1] == {"role": "assistant", "content": "Fixed answer."}
    assert directive["messages"][0] == {"role": "system", "content": "Be brief."}
    assert directive["hint"] == "shorter please"
    assert directive["prompt"] + directive["completion"] == directive["messages"]
    assert directive["reply"] == approved["correction"].turn.content
    thumb = next(r for r in records if r["feedback_id"] == approved["thumb"].pk)
    assert thumb["reward"] == 1.0 and thumb["correction"] is None
    assert thumb["messages"][-1]["content"] == approved["thumb"].turn.content
    assert {"sample_id", "user_id", "agent_id", "turn_id", "adapter", "classifier", "created_at",
            "provenance"} <= set(thumb)


def test_export_leaves_out_rejected_pending_and_discarded(client, user, staff_user, approved):
    agent = approved["agent"]
    make_feedback(user, agent)  # pending
    services.reject_feedback(make_feedback(user, agent), reviewer=staff_user, note="no")
    TrainingSample.objects.filter(feedback=approved["thumb"]).update(state=TrainingSample.State.DISCARDED)
    client.force_login(staff_user)

    records = download(client)

    assert {r["feedback_id"] for r in records} == {approved["correction"].pk}


def test_export_filters_by_agent_and_date(client, user, staff_user, approved):
    other_agent = AgentFactory()
    services.approve_feedback(make_feedback(user, other_agent), reviewer=staff_user)
    old = TrainingSample.objects.filter(feedback=approved["thumb"])
    old.update(created_at=timezone.now() - timedelta(days=10))
    client.force_login(staff_user)
    today = timezone.now().date()

    assert {r["agent_id"] for r in download(client, agent=other_agent.pk)} == {other_agent.pk}
    recent = download(client, agent=approved["agent"].pk, date_from=today.isoformat())
    assert {r["feedback_id"] for r in recent} == {approved["correction"].pk}
    early = download(client, date_to=(today - timedelta(days=5)).isoformat())
    assert {r["feedback_id"] for r in early} == {approved["thumb"].pk}


def test_export_is_audited(client, staff_user, approved):
    client.force_login(staff_user)
    download(client, agent=approved["agent"].pk)
    assert AuditEvent.objects.filter(action="export_samples", actor=staff_user, agent_id=approved["agent"].pk).exists()


def test_export_bad_filter_is_400(client, staff_user):
    client.force_login(staff_user)
    assert client.get(reverse("training:export"), {"date_from": "yesterday"}).status_code == 400


def test_sample_record_is_json_serializable_with_unicode(user, staff_user):
    feedback = make_feedback(user, kind=Feedback.Kind.CORRECTION, corrected_text="서울은 한국의 수도입니다.")
    services.approve_feedback(feedback, reviewer=staff_user)
    lines = list(export.iter_jsonl(export.approved_samples()))
    assert any("서울" in line for line in lines)
    assert all(line.endswith("\n") and json.loads(line) for line in lines)
