"""The JSON API: conversations and feedback, by session (with CSRF) or API key."""
import json

import pytest
from django.test import Client

from chat.models import ApiKey, Conversation, Feedback
from chat.tests.factories import AgentFactory, ConversationFactory, ReplyFactory, TurnFactory, exchange

pytestmark = [pytest.mark.django_db, pytest.mark.urls("chat.tests.urls")]


@pytest.fixture
def client_for():
    def make(user, *, csrf=False):
        client = Client(enforce_csrf_checks=csrf)
        client.force_login(user)
        return client

    return make


def post(client, url, data, **extra):
    return client.post(url, json.dumps(data), content_type="application/json", **extra)


@pytest.fixture
def reply(user):
    conversation = ConversationFactory(user=user, agent=AgentFactory())
    return exchange(conversation, 1)[-1]


def test_anonymous_gets_401_json(client, reply):
    response = client.get("/api/conversations")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = post(client, f"/api/turns/{reply.pk}/feedback", {"kind": "thumb_up"})
    assert response.status_code == 401
    assert not Feedback.objects.exists()


def test_create_list_get_rename_delete_conversation(client_for, user):
    client = client_for(user)
    agent = AgentFactory()
    response = post(client, "/api/conversations", {"agent_id": agent.pk, "title": "Trip"})
    assert response.status_code == 201
    cid = response.json()["conversation"]["id"]
    assert [c["id"] for c in client.get("/api/conversations").json()["conversations"]] == [cid]
    assert client.get(f"/api/conversations?agent={agent.pk}&q=trip").json()["conversations"][0]["title"] == "Trip"
    TurnFactory(conversation=Conversation.objects.get(pk=cid), content="hello")
    detail = client.get(f"/api/conversations/{cid}").json()["conversation"]
    assert [t["content"] for t in detail["turns"]] == ["hello"]
    response = client.patch(f"/api/conversations/{cid}", json.dumps({"title": "Renamed"}), content_type="application/json")
    assert response.json()["conversation"]["title"] == "Renamed"
    assert client.delete(f"/api/conversations/{cid}").status_code == 204
    assert not Conversation.objects.exists()


def test_bad_bodies_get_400_with_a_message(client_for, user):
    client = client_for(user)
    response = client.post("/api/conversations", "{nope", content_type="application/json")
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = post(client, "/api/conversations", {"agent_id": "one"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "agent_id"


def test_another_users_objects_are_404(client_for, other_user, reply):
    client = client_for(other_user)
    cid = reply.conversation_id
    assert client.get(f"/api/conversations/{cid}").status_code == 404
    assert client.patch(f"/api/conversations/{cid}", "{}", content_type="application/json").status_code == 404
    assert client.delete(f"/api/conversations/{cid}").status_code == 404
    assert post(client, f"/api/turns/{reply.pk}/feedback", {"kind": "thumb_up"}).status_code == 404
    assert client.delete(f"/api/turns/{reply.pk}/feedback/thumb").status_code == 404
    assert Conversation.objects.filter(pk=cid).exists() and not Feedback.objects.exists()


def test_thumb_up_down_change_and_withdraw(client_for, user, reply):
    client = client_for(user)
    url = f"/api/turns/{reply.pk}/feedback"
    up = post(client, url, {"kind": "thumb_up"})
    assert up.status_code == 201 and up.json()["feedback"]["kind"] == "thumb_up"
    down = post(client, url, {"kind": "thumb_down", "reason": "wrong"})
    assert down.status_code == 201
    live = Feedback.objects.get(withdrawn=False)
    assert live.kind == "thumb_down" and live.reason == "wrong"
    response = client.delete(f"/api/turns/{reply.pk}/feedback/thumb")
    assert response.json()["withdrawn"] is True
    assert not Feedback.objects.filter(withdrawn=False).exists()


def test_correction_is_stored_and_size_checked(client_for, user, reply, settings):
    settings.MAX_CORRECTION_CHARS = 30
    client = client_for(user)
    url = f"/api/turns/{reply.pk}/feedback"
    too_long = post(client, url, {"kind": "correction", "corrected_text": "x" * 31})
    assert too_long.status_code == 413 and "limit is 30" in too_long.json()["error"]["message"]
    ok = post(client, url, {"kind": "correction", "corrected_text": "The better reply."})
    assert ok.status_code == 201
    assert Feedback.objects.get().corrected_text == "The better reply."


def test_feedback_on_a_user_turn_is_400(client_for, user, reply):
    response = post(client_for(user), f"/api/turns/{reply.parent_id}/feedback", {"kind": "thumb_up"})
    assert response.status_code == 400


def test_session_post_needs_csrf(client_for, user, reply):
    client = client_for(user, csrf=True)
    response = post(client, f"/api/turns/{reply.pk}/feedback", {"kind": "thumb_up"})
    assert response.status_code == 403
    from django.middleware.csrf import _get_new_csrf_string, _mask_cipher_secret

    secret = _get_new_csrf_string()
    client.cookies["csrftoken"] = secret
    response = post(client, f"/api/turns/{reply.pk}/feedback", {"kind": "thumb_up"}, HTTP_X_CSRFTOKEN=_mask_cipher_secret(secret))
    assert response.status_code == 201


def test_api_key_auth_needs_no_csrf_and_updates_last_used(user, reply):
    key, raw = ApiKey.objects.create_key(user, "laptop")
    client = Client(enforce_csrf_checks=True)
    response = post(client, f"/api/turns/{reply.pk}/feedback", {"kind": "thumb_up"}, HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert response.status_code == 201
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_revoked_or_wrong_key_is_401(user, reply):
    key, raw = ApiKey.objects.create_key(user, "old")
    key.revoked_at = key.created_at
    key.save()
    client = Client()
    assert client.get("/api/conversations", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401
    assert client.get("/api/conversations", HTTP_AUTHORIZATION="Bearer claw-wrong").status_code == 401


def test_feedback_rate_limit_gives_429_with_retry_after(client_for, user, settings):
    settings.RATE_LIMIT_FEEDBACK_PER_MINUTE = 2
    conversation = ConversationFactory(user=user, agent=AgentFactory())
    question = TurnFactory(conversation=conversation)
    replies = [ReplyFactory(conversation=conversation, parent=question) for _ in range(3)]
    client = client_for(user)
    statuses = [post(client, f"/api/turns/{r.pk}/feedback", {"kind": "thumb_up"}).status_code for r in replies]
    assert statuses == [201, 201, 429]
    response = post(client, f"/api/turns/{replies[2].pk}/feedback", {"kind": "thumb_up"})
    assert 1 <= int(response["Retry-After"]) <= 60
    assert Feedback.objects.count() == 2


def test_oversize_body_is_413(client_for, user, reply, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    response = post(client_for(user), f"/api/turns/{reply.pk}/feedback", {"kind": "comment", "comment": "x" * 500})
    assert response.status_code == 413
