"""The inference engine SIGKILLed in the middle of a streamed reply, over the real chat socket.

chat/tests/test_consumers.py covers an engine that is down before the message (a closed port) and
the retry; here the process dies while tokens are flowing: the user's message is kept, the reply
ends `failed` with its error, every socket stays usable, and once the engine is back on the same
port `message.retry` and the next message work without reconnecting.
"""
import os
import signal

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from chat.models import Turn
from chat.tests.factories import AgentFactory, model_settings  # noqa: F401  (fixture)
from clawplatform.asgi import application
from serving.engine.testing import run_engine_server

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio, pytest.mark.timeout(900)]


@pytest_asyncio.fixture(autouse=True)
async def _close_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


async def connect(user):
    client = Client()
    await sync_to_async(client.force_login)(user)
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost"),
               (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]
    communicator = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
    connected, _ = await communicator.connect()
    assert connected
    return communicator


async def until(communicator, frame_type, timeout=120):
    frames = []
    while True:
        frame = await communicator.receive_json_from(timeout=timeout)
        frames.append(frame)
        if frame["type"] == frame_type:
            return frames


async def test_engine_killed_mid_stream_fails_the_reply_then_retry_works(user, model_settings, tiny_model_dir):
    # Long, sampled replies: the stream is still running when the engine dies.
    agent = await sync_to_async(AgentFactory)(max_tokens=512, temperature=1.0)
    with run_engine_server(tiny_model_dir) as engine:
        port = engine.port
        model_settings.INFERENCE_URLS = [engine.url]
        model_settings.INFERENCE_TIMEOUT = 10.0
        chat, bystander = await connect(user), await connect(user)
        await chat.send_json_to({"type": "message.send", "conversation_id": None, "agent_id": agent.pk,
                                 "content": "Tell me a long story about the sea.", "request_id": "s"})
        frames = await until(chat, "reply.delta")
        saved = next(f["turn"] for f in frames if f["type"] == "message.saved")
        started = next(f["turn"] for f in frames if f["type"] == "reply.started")
        os.kill(engine.process.pid, signal.SIGKILL)
        engine.process.wait()

        frames = await until(chat, "reply.done", timeout=60)
        failed = frames[-1]["turn"]
        assert failed["id"] == started["id"] and failed["status"] == "failed", failed
        assert failed["error"] and frames[-1]["request_id"] == "s"
        stored = await Turn.objects.aget(pk=failed["id"])
        assert stored.status == "failed" and stored.error
        assert await Turn.objects.filter(pk=saved["id"], role="user", content=saved["content"]).aexists()

        for socket in (bystander, chat):  # nobody was disconnected
            await socket.send_json_to({"type": "ping", "request_id": "p"})
            assert await socket.receive_json_from(timeout=10) == {"type": "pong", "request_id": "p"}

    with run_engine_server(tiny_model_dir, port=port):  # the same URL comes back
        agent.max_tokens = 8
        await agent.asave(update_fields=["max_tokens"])
        await chat.send_json_to({"type": "message.retry", "turn_id": failed["id"]})
        retried = (await until(chat, "reply.done"))[-1]["turn"]
        assert retried["status"] == "complete" and retried["parent_id"] == saved["id"]
        await chat.send_json_to({"type": "message.send", "conversation_id": failed["conversation_id"],
                                 "content": "And then?"})
        following = (await until(chat, "reply.done"))[-1]["turn"]
        assert following["status"] == "complete"
    assert await Turn.objects.filter(role="user", content="Tell me a long story about the sea.").acount() == 1
    await chat.disconnect()
    await bystander.disconnect()
