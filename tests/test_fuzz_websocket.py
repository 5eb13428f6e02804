"""Hostile frames on the chat socket (/ws/chat/, through the real ASGI stack with origin check and session).

Hypothesis sends invalid JSON text, JSON that is not an object, binary frames, unknown types, wrong
field types, unknown and foreign ids, huge and negative integers, deep nesting and huge strings.
For each: one `error` frame with a known code and a message (or `pong` for a ping), the request id
echoed, no `server_error`, nothing logged at ERROR, no row changed, and the socket still answers a
ping afterwards. Invalid UTF-8 inside a text frame is left out on purpose: the server closes with
1007 there, which is correct (DESIGN.md).
"""
import json
import logging

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from chat.consumers import ChatConsumer
from chat.models import Agent, Conversation, Feedback, Turn
from chat.tests.factories import ReplyFactory, TurnFactory
from clawplatform.asgi import application

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.django_db(transaction=True),
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning"),
]

FUZZ = hsettings(max_examples=40, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large])
ERROR_CODES = {"bad_json", "invalid", "unknown_type", "not_found", "too_large", "rate_limited"}

# Strategies
# ------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([0, -1, -(2**31), 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
IDS = HUGE_INTS | st.integers(-5, 10**6)
SCALARS = st.none() | st.booleans() | IDS | st.floats() | st.text(max_size=30)
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
LONG_TEXT = st.builds(lambda n, c: c * n, st.sampled_from([0, 1, 100, 8001, 300_000]),
                      st.sampled_from(["x", " ", "\x00", "😀", "<script>"]))
VALUES = JSON | LONG_TEXT
TYPES = st.sampled_from(sorted(ChatConsumer.FRAME_HANDLERS)) | st.text(max_size=20) | SCALARS
FIELDS = ["type", "request_id", "conversation_id", "agent_id", "turn_id", "content"]


def deep(n, kind):
    return ("[" * n + "]" * n) if kind == "list" else ('{"type":' * n + '"ping"' + "}" * n)


OBJECTS = st.fixed_dictionaries({"type": TYPES}, optional={f: VALUES for f in FIELDS[1:]}) | st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=8), VALUES, max_size=6)
TEXT_FRAMES = st.one_of(
    st.text(max_size=100),  # mostly not JSON
    st.builds(deep, st.sampled_from([50, 5000, 100_000]), st.sampled_from(["list", "dict"])),
    JSON.map(json.dumps),
    OBJECTS.map(json.dumps),
)
# An empty frame can't be sent through channels' WebsocketCommunicator (it asserts on it).
FRAMES = TEXT_FRAMES.filter(bool).map(lambda t: ("text", t)) | st.binary(min_size=1, max_size=100).map(lambda b: ("bytes", b))


# Fixtures
# ------------------------------------------------------------------------------


@pytest_asyncio.fixture(autouse=True)
async def _close_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


@pytest.fixture
def socket_world(user, other_user, settings):
    """The user owns nothing a random frame could act on; a stranger owns a conversation and turns."""
    settings.RATE_LIMIT_MESSAGES_PER_MINUTE = 0
    settings.MAX_MESSAGE_CHARS = 8000
    settings.INFERENCE_URLS = ["http://127.0.0.1:9"]
    private = Agent.objects.create(owner=other_user, name="Theirs", slug="theirs")
    conversation = Conversation.objects.create(user=other_user, agent=private)
    question = TurnFactory(conversation=conversation)
    ReplyFactory(conversation=conversation, parent=question)
    client = Client()
    client.force_login(user)
    return {"cookie": f"sessionid={client.cookies['sessionid'].value}".encode(), "user": user}


def state():
    return (Agent.objects.count(), Conversation.objects.count(), Turn.objects.count(), Feedback.objects.count())


async def connect(cookie):
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost"), (b"cookie", cookie)]
    communicator = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
    connected, _ = await communicator.connect()
    assert connected
    return communicator


def expected_request_id(frame):
    kind, payload = frame
    if kind != "text":
        return None
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    rid = data.get("request_id")
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


async def send_and_check(communicator, frame, caplog):
    kind, payload = frame
    if kind == "text":
        await communicator.send_to(text_data=payload)
    else:
        await communicator.send_to(bytes_data=payload)
    answer = await communicator.receive_json_from(timeout=10)
    if answer["type"] == "pong":
        assert json.loads(frame[1]).get("type") == "ping"
    else:
        assert answer["type"] == "error", answer
        assert answer["code"] in ERROR_CODES, answer
        assert isinstance(answer["message"], str) and answer["message"].strip()
    assert answer.get("request_id") == expected_request_id(frame)
    assert await communicator.receive_nothing(timeout=0.05)
    # The socket is still usable.
    await communicator.send_json_to({"type": "ping", "request_id": "after"})
    assert await communicator.receive_json_from(timeout=10) == {"type": "pong", "request_id": "after"}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# Fuzzing
# ------------------------------------------------------------------------------


@FUZZ
@given(frame=FRAMES)
async def test_fuzz_frames(socket_world, caplog, frame):
    caplog.clear()
    before = await sync_to_async(state)()
    communicator = await connect(socket_world["cookie"])
    try:
        await send_and_check(communicator, frame, caplog)
    finally:
        await communicator.disconnect()
    assert await sync_to_async(state)() == before


@pytest.fixture
def own_conversation(socket_world):
    agent = Agent.objects.create(owner=socket_world["user"], name="Mine", slug="mine", max_tokens=8)
    conversation = Conversation.objects.create(user=socket_world["user"], agent=agent)
    question = TurnFactory(conversation=conversation, content="hello")
    reply = ReplyFactory(conversation=conversation, parent=question, status=Turn.Status.STREAMING)
    return {"agent": agent, "conversation": conversation, "question": question, "streaming": reply}


BAD_CONTENT = st.one_of(
    st.none(), st.booleans(), IDS, st.floats(), st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    st.sampled_from(["", " ", "\n\t ", "x" * 8001, "😀" * 8001]),
)


@FUZZ
@given(content=BAD_CONTENT, agent_id=st.none() | IDS | st.text(max_size=5), target=st.sampled_from(["conversation", "new"]))
async def test_fuzz_message_send_on_own_conversation(socket_world, own_conversation, caplog, content, agent_id, target):
    """Even with the user's own conversation or agent, a bad `content` never saves a turn."""
    caplog.clear()
    frame = {"type": "message.send", "content": content, "request_id": 1}
    if target == "conversation":
        frame["conversation_id"] = own_conversation["conversation"].pk
        if agent_id is not None:
            frame["agent_id"] = agent_id
    else:
        frame.update(conversation_id=None, agent_id=own_conversation["agent"].pk)
    before = await sync_to_async(state)()
    communicator = await connect(socket_world["cookie"])
    try:
        await send_and_check(communicator, ("text", json.dumps(frame)), caplog)
    finally:
        await communicator.disconnect()
    assert await sync_to_async(state)() == before


@FUZZ
@given(frame_type=st.sampled_from(["message.regenerate", "message.retry", "generation.stop"]),
       target=st.sampled_from(["question", "streaming"]))
async def test_requests_that_make_no_sense_on_own_turns_are_refused(socket_world, own_conversation, caplog,
                                                                   frame_type, target):
    """Regenerating a user turn or a streaming reply, stopping a user turn: `invalid`, nothing saved."""
    if (frame_type, target) in {("message.retry", "question"), ("generation.stop", "streaming")}:
        return  # these are valid: retry answers a user turn, stop cancels a stream
    caplog.clear()
    before = await sync_to_async(state)()
    communicator = await connect(socket_world["cookie"])
    try:
        frame = {"type": frame_type, "turn_id": own_conversation[target].pk}
        await send_and_check(communicator, ("text", json.dumps(frame)), caplog)
    finally:
        await communicator.disconnect()
    assert await sync_to_async(state)() == before


# Size limits
# ------------------------------------------------------------------------------


async def test_a_huge_frame_gets_too_large_and_saves_nothing(socket_world, own_conversation, caplog):
    communicator = await connect(socket_world["cookie"])
    before = await sync_to_async(state)()
    frame = {"type": "message.send", "conversation_id": own_conversation["conversation"].pk, "content": "x" * 2_000_000}
    await communicator.send_json_to(frame)
    answer = await communicator.receive_json_from(timeout=10)
    assert answer["code"] == "too_large" and "8000" in answer["message"]
    assert await sync_to_async(state)() == before
    await communicator.disconnect()


async def test_a_message_at_the_limit_is_saved_whole(socket_world, own_conversation, settings, model_settings_for_ws):
    """At exactly MAX_MESSAGE_CHARS the user turn is stored in full (the reply then fails: no engine)."""
    settings.MAX_MESSAGE_CHARS = 60
    text = "abcdefghij " * 5 + "end-m"
    assert len(text) == 60
    communicator = await connect(socket_world["cookie"])
    await communicator.send_json_to({"type": "message.send", "conversation_id": None,
                                     "agent_id": own_conversation["agent"].pk, "content": text})
    frames = []
    while not frames or frames[-1]["type"] not in ("reply.done", "error"):
        frames.append(await communicator.receive_json_from(timeout=30))
    saved = next(f for f in frames if f["type"] == "message.saved")
    assert saved["turn"]["content"] == text
    assert await Turn.objects.filter(pk=saved["turn"]["id"], content=text).aexists()
    await communicator.disconnect()


@pytest.fixture
def model_settings_for_ws(settings, tiny_model_dir):
    settings.MODEL = str(tiny_model_dir)
    settings.MODEL_MAX_CONTEXT = 0
    settings.INFERENCE_TIMEOUT = 5.0
    return settings
