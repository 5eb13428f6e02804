"""The chat socket over the real ASGI stack (session auth, origin check), real Postgres, Redis and engine."""
import asyncio

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client

from chat.models import Conversation, Feedback, Turn
from chat.services import user_group
from chat.tests.factories import (  # noqa: F401
    AgentFactory,
    ConversationFactory,
    ReplyFactory,
    TurnFactory,
    dead_engine,
    engine,
    live_engine,
    model_settings,
    slow_engine,
)
from clawplatform.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


@pytest_asyncio.fixture(autouse=True)
async def _close_thread_connections():
    """The test client keeps DB connections open in asgiref's worker thread; close them so the
    test database can be dropped at the end of the run."""
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def connect(user=None):
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if user is not None:
        client = Client()
        await sync_to_async(client.force_login)(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    communicator = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
    connected, _ = await communicator.connect()
    return communicator, connected


async def until(communicator, frame_type, timeout=60):
    """Frames up to and including the first of `frame_type`."""
    frames = []
    while True:
        frame = await communicator.receive_json_from(timeout=timeout)
        frames.append(frame)
        if frame["type"] == frame_type:
            return frames


@pytest.fixture
def agent(db):
    return AgentFactory(max_tokens=8, temperature=0.0)


@pytest.fixture
def strangers_turns(other_user, agent):
    conversation = ConversationFactory(user=other_user, agent=agent)
    question = TurnFactory(conversation=conversation, content="secret question")
    reply = ReplyFactory(conversation=conversation, parent=question, content="secret answer")
    return conversation, question, reply


async def counts():
    return (await Conversation.objects.acount(), await Turn.objects.acount(), await Feedback.objects.acount())


# Connecting
# ------------------------------------------------------------------------------


async def test_anonymous_socket_is_closed():
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    communicator = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
    assert await communicator.connect() == (False, 4401)
    # As Daphne does after a refusal; else the consumer's channel-layer receive outlives the test.
    await communicator.disconnect()


async def test_ping_gets_pong_with_request_id(user):
    communicator, connected = await connect(user)
    assert connected
    await communicator.send_json_to({"type": "ping", "request_id": "r1"})
    assert await communicator.receive_json_from() == {"type": "pong", "request_id": "r1"}
    await communicator.disconnect()


# Malformed frames: an error frame each, and the socket stays usable
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, code",
    [
        ("{not json", "bad_json"),
        ("[1, 2]", "invalid"),
        ('"just a string"', "invalid"),
        ('{"type": "launch.missiles"}', "unknown_type"),
        ('{"no_type": 1}', "unknown_type"),
        ('{"type": "message.send", "conversation_id": "abc", "content": "hi"}', "invalid"),
        ('{"type": "message.send", "conversation_id": null, "agent_id": 1, "content": 5}', "invalid"),
        ('{"type": "message.send", "conversation_id": null, "content": "hi"}', "invalid"),
        ('{"type": "generation.stop", "turn_id": true}', "invalid"),
        ('{"type": "message.regenerate"}', "invalid"),
        ('{"type": "message.retry", "turn_id": -3}', "invalid"),
    ],
)
async def test_malformed_frame_gets_an_error_frame(user, raw, code):
    communicator, _ = await connect(user)
    await communicator.send_to(text_data=raw)
    frame = await communicator.receive_json_from()
    assert frame["type"] == "error" and frame["code"] == code and frame["message"]
    await communicator.send_json_to({"type": "ping"})
    assert (await communicator.receive_json_from())["type"] == "pong"
    await communicator.disconnect()


async def test_binary_frame_gets_an_error_frame(user):
    communicator, _ = await connect(user)
    await communicator.send_to(bytes_data=b"\x00\x01")
    assert (await communicator.receive_json_from())["code"] == "invalid"
    await communicator.disconnect()


async def test_oversize_message_is_refused(user, agent, settings):
    settings.MAX_MESSAGE_CHARS = 50
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "x" * 51})
    frame = await communicator.receive_json_from()
    assert frame["code"] == "too_large"
    assert await counts() == (0, 0, 0)
    await communicator.disconnect()


# Authorization: another user's ids look like missing ones, and nothing changes
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("frame_type", ["message.send", "generation.stop", "message.regenerate", "message.retry"])
async def test_another_users_ids_are_not_found(user, strangers_turns, frame_type):
    conversation, question, reply = strangers_turns
    frame = {
        "message.send": {"conversation_id": conversation.pk, "content": "let me in"},
        "generation.stop": {"turn_id": reply.pk},
        "message.regenerate": {"turn_id": reply.pk},
        "message.retry": {"turn_id": question.pk},
    }[frame_type]
    before = await counts()
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": frame_type, "request_id": 7, **frame})
    answer = await communicator.receive_json_from()
    assert answer == {"type": "error", "code": "not_found", "message": answer["message"], "request_id": 7}
    assert await counts() == before
    assert await communicator.receive_nothing(timeout=0.3)
    await communicator.disconnect()


async def test_private_agent_of_another_user_is_not_found(user, other_user):
    private = await sync_to_async(AgentFactory)(owner=other_user)
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": private.pk, "content": "hi"})
    assert (await communicator.receive_json_from())["code"] == "not_found"
    assert await counts() == (0, 0, 0)
    await communicator.disconnect()


# Group pushes
# ------------------------------------------------------------------------------


async def test_job_progress_and_version_pushes_reach_the_users_sockets(user):
    communicator, _ = await connect(user)
    layer = get_channel_layer()
    await layer.group_send(user_group(user.pk), {"type": "job.progress", "job_id": 3, "agent_id": 1, "state": "running", "progress": 0.5})
    assert await communicator.receive_json_from() == {"type": "job.progress", "job_id": 3, "agent_id": 1, "state": "running", "progress": 0.5}
    version = {"id": 9, "name": "u1-a1-v2", "number": 2, "label": "v2"}
    await layer.group_send(user_group(user.pk), {"type": "version.activated", "agent_id": 1, "version": version})
    assert await communicator.receive_json_from() == {"type": "version.activated", "agent_id": 1, "version": version}
    await communicator.disconnect()


# Generation, with a real engine
# ------------------------------------------------------------------------------


async def test_new_conversation_streams_a_reply(user, agent, live_engine):
    communicator, _ = await connect(user)
    await communicator.send_json_to(
        {"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "hello", "request_id": "a"}
    )
    frames = await until(communicator, "reply.done")
    types = [f["type"] for f in frames]
    assert types[:3] == ["conversation.created", "message.saved", "reply.started"]
    assert set(types[3:-1]) == {"reply.delta"} and types[-1] == "reply.done"
    assert all(f["request_id"] == "a" for f in frames)
    done = frames[-1]["turn"]
    assert done["status"] == "complete" and done["content"] == "".join(f["text"] for f in frames[3:-1])
    reply = await Turn.objects.aget(pk=done["id"])
    assert reply.parent_id == frames[1]["turn"]["id"] and reply.role == "assistant"
    assert reply.token_ids and len(reply.token_ids) == len(reply.logprobs)
    assert reply.prompt_token_ids and reply.adapter_name == "" and reply.latency_ms is not None
    await communicator.disconnect()


async def test_message_saved_only_after_commit(user, agent, live_engine):
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "hi"})
    frames = await until(communicator, "message.saved")
    # Another connection (the test's own) sees the row as soon as the ack arrives.
    assert await Turn.objects.filter(pk=frames[-1]["turn"]["id"], content="hi").aexists()
    await until(communicator, "reply.done")
    await communicator.disconnect()


async def test_second_message_records_implicit_feedback(user, agent, live_engine):
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "hi"})
    frames = await until(communicator, "reply.done")
    conversation_id, reply_id = frames[0]["conversation"]["id"], frames[-1]["turn"]["id"]
    await communicator.send_json_to({"type": "message.send", "conversation_id": conversation_id, "content": "shorter"})
    frames = await until(communicator, "reply.done")
    feedback = await Feedback.objects.aget(kind="implicit")
    assert feedback.turn_id == reply_id and feedback.next_turn_id == frames[0]["turn"]["id"]
    await communicator.disconnect()


async def test_stop_keeps_the_partial_reply(user, model_settings, slow_engine):
    # 50 ms a token: the stop sent after the first delta always lands before the reply ends.
    model_settings.INFERENCE_URLS = [slow_engine.url]
    agent = await sync_to_async(AgentFactory)(max_tokens=256, temperature=0.0)
    communicator, _ = await connect(user)
    # The tiny model answers most prompts in a few tokens; this one runs to max_tokens greedily.
    content = "Count to one hundred."
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": content})
    frames = await until(communicator, "reply.started")
    turn_id = frames[-1]["turn"]["id"]
    await until(communicator, "reply.delta")
    await communicator.send_json_to({"type": "generation.stop", "turn_id": turn_id})
    done = (await until(communicator, "reply.done"))[-1]["turn"]
    assert done["id"] == turn_id and done["status"] == "stopped"
    reply = await Turn.objects.aget(pk=turn_id)
    assert reply.status == "stopped" and reply.content and reply.content == done["content"]
    assert len(reply.token_ids) < 256
    await communicator.disconnect()


async def test_regenerate_keeps_the_old_reply_as_a_sibling(user, agent, live_engine):
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "hi"})
    first = (await until(communicator, "reply.done"))[-1]["turn"]
    await communicator.send_json_to({"type": "message.regenerate", "turn_id": first["id"]})
    second = (await until(communicator, "reply.done"))[-1]["turn"]
    assert second["id"] != first["id"] and second["parent_id"] == first["parent_id"]
    assert await Turn.objects.filter(parent_id=first["parent_id"]).acount() == 2
    await communicator.disconnect()


async def test_engine_down_fails_the_reply_then_retry_works(user, agent, dead_engine, engine, settings):
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "hi"})
    frames = await until(communicator, "reply.done", timeout=30)
    failed = frames[-1]["turn"]
    assert failed["status"] == "failed" and "unavailable" in failed["error"]
    assert await Turn.objects.filter(role="user", content="hi").aexists()
    settings.INFERENCE_URLS = [engine.url]
    await communicator.send_json_to({"type": "message.retry", "turn_id": failed["id"]})
    done = (await until(communicator, "reply.done"))[-1]["turn"]
    assert done["status"] == "complete" and done["parent_id"] == failed["parent_id"]
    await communicator.disconnect()


async def test_rate_limit_gives_retry_after(user, agent, dead_engine, settings):
    settings.RATE_LIMIT_MESSAGES_PER_MINUTE = 1
    communicator, _ = await connect(user)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "one"})
    await until(communicator, "reply.done", timeout=30)
    await communicator.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk, "content": "two"})
    frame = await communicator.receive_json_from()
    assert frame["code"] == "rate_limited" and 1 <= frame["retry_after"] <= 60
    assert not await Turn.objects.filter(content="two").aexists()
    await communicator.disconnect()
