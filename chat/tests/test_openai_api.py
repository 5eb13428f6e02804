"""The OpenAI-compatible /v1 API: keys, models, completions (plain and SSE) and history storage."""
import json

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from chat.models import ApiKey, Conversation, Feedback, Turn
from chat.tests.factories import AgentFactory, dead_engine, engine, live_engine, model_settings  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio, pytest.mark.urls("chat.tests.urls")]


@pytest_asyncio.fixture(autouse=True)
async def _close_thread_connections():
    """The test client keeps DB connections open in asgiref's worker thread; close them so the
    test database can be dropped at the end of the run."""
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


@pytest.fixture
def raw_key(user):
    return ApiKey.objects.create_key(user, "cli")[1]


@pytest.fixture
def agent(db):
    return AgentFactory(slug="helper", max_tokens=8, temperature=0.0)


def auth(raw, **headers):
    return {"Authorization": f"Bearer {raw}", **headers}


async def complete(raw, body, **headers):
    return await AsyncClient().post(
        "/v1/chat/completions", json.dumps(body), content_type="application/json", headers=auth(raw, **headers)
    )


def body(*pairs, model="helper", **extra):
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in pairs], **extra}


async def sse_events(response):
    text = b"".join([chunk async for chunk in response.streaming_content]).decode()
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


# Keys and models (no inference needed)
# ------------------------------------------------------------------------------


async def test_missing_wrong_and_revoked_keys_are_401(user, agent):
    client = AsyncClient()
    response = await client.get("/v1/models")
    assert response.status_code == 401 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert (await client.get("/v1/models", headers=auth("claw-nope"))).status_code == 401
    key, raw = await sync_to_async(ApiKey.objects.create_key)(user, "old")
    await ApiKey.objects.filter(pk=key.pk).aupdate(revoked_at=key.created_at)
    assert (await client.get("/v1/models", headers=auth(raw))).status_code == 401
    assert (await complete(raw, body(("user", "hi")))).status_code == 401


async def test_session_login_is_not_enough_for_v1(user, agent):
    client = AsyncClient()
    await sync_to_async(client.force_login)(user)
    assert (await client.get("/v1/models")).status_code == 401


async def test_models_lists_own_agents_first_and_shadows_globals(user, other_user, raw_key):
    await sync_to_async(AgentFactory)(slug="writer", name="A global writer")
    await sync_to_async(AgentFactory)(slug="writer", name="Z my writer", owner=user)
    await sync_to_async(AgentFactory)(slug="coder")
    await sync_to_async(AgentFactory)(slug="private", owner=other_user)
    data = (await AsyncClient().get("/v1/models", headers=auth(raw_key))).json()
    assert data["object"] == "list"
    assert [(m["id"], m["owned_by"]) for m in data["data"]] == [("writer", "you"), ("coder", "platform")]


async def test_unknown_model_is_404(raw_key, model_settings):
    response = await complete(raw_key, body(("user", "hi"), model="nope"))
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    "bad",
    [
        {"model": "helper"},
        {"model": "helper", "messages": []},
        {"model": "helper", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "helper", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"model": "helper", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        {"model": "helper", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
    ],
)
async def test_bad_bodies_are_400(raw_key, agent, bad):
    response = await complete(raw_key, bad)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert await Turn.objects.acount() == 0


async def test_engine_down_is_503_and_the_message_is_kept(raw_key, agent, dead_engine):
    response = await complete(raw_key, body(("user", "hi")))
    assert response.status_code == 503 and response.json()["error"]["code"] == "inference_unavailable"
    assert await Turn.objects.filter(role="user", content="hi").aexists()
    assert (await Turn.objects.aget(pk=int(response["X-Turn-Id"]))).status == "failed"


async def test_rate_limit_is_429(raw_key, agent, dead_engine, settings):
    settings.RATE_LIMIT_MESSAGES_PER_MINUTE = 1
    await complete(raw_key, body(("user", "one")))
    response = await complete(raw_key, body(("user", "two")))
    assert response.status_code == 429 and int(response["Retry-After"]) >= 1


# Completions with a real engine
# ------------------------------------------------------------------------------


async def test_completion_returns_the_reply_and_turn_id(raw_key, agent, live_engine):
    response = await complete(raw_key, body(("user", "hello")), **{"X-Session-Id": "s1"})
    assert response.status_code == 200
    data = response.json()
    turn = await Turn.objects.aget(pk=int(response["X-Turn-Id"]))
    assert data["turn_id"] == turn.pk and data["object"] == "chat.completion" and data["model"] == "helper"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": turn.content}
    assert turn.status == "complete" and turn.token_ids and len(turn.token_ids) == len(turn.logprobs)
    assert data["usage"]["completion_tokens"] == len(turn.token_ids)


async def test_streaming_sends_sse_chunks_then_done(raw_key, agent, live_engine):
    response = await complete(raw_key, body(("user", "hello"), stream=True, stream_options={"include_usage": True}))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/event-stream")
    events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    turn = await Turn.objects.aget(pk=int(response["X-Turn-Id"]))
    assert text == turn.content and turn.status == "complete"
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == len(turn.token_ids)


async def test_resent_history_is_stored_once_and_gives_implicit_feedback(raw_key, agent, live_engine):
    first = await complete(raw_key, body(("system", "Be terse."), ("user", "hi")), **{"X-Session-Id": "sess"})
    reply = first.json()["choices"][0]["message"]["content"]
    second = await complete(
        raw_key,
        body(("system", "Be terse."), ("user", "hi"), ("assistant", reply), ("user", "shorter")),
        **{"X-Session-Id": "sess"},
    )
    assert second.status_code == 200
    conversation = await Conversation.objects.aget(session_key="sess")
    roles = [t.role async for t in Turn.objects.filter(conversation=conversation).order_by("index", "pk")]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    feedback = await Feedback.objects.aget(kind="implicit")
    assert feedback.turn_id == first.json()["turn_id"] and feedback.comment == "shorter"


async def test_side_turns_are_stored_without_signals_and_done_closes(raw_key, agent, live_engine):
    first = await complete(raw_key, body(("user", "hi")), **{"X-Session-Id": "s"})
    reply = first.json()["choices"][0]["message"]["content"]
    side = await complete(
        raw_key,
        body(("user", "hi"), ("assistant", reply), ("user", "title this chat")),
        **{"X-Session-Id": "s", "X-Turn-Type": "side", "X-Session-Done": "true"},
    )
    assert side.status_code == 200
    turn = await Turn.objects.aget(pk=side.json()["turn_id"])
    assert turn.turn_type == "side"
    assert not await Feedback.objects.aexists()
    assert (await Conversation.objects.aget(session_key="s")).done


async def test_bad_turn_type_header_is_400(raw_key, agent):
    response = await complete(raw_key, body(("user", "hi")), **{"X-Turn-Type": "sideways"})
    assert response.status_code == 400
