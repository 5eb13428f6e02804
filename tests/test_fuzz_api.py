"""Hostile input on the JSON APIs (`/api/conversations`, `/api/turns/<id>/feedback`, `/v1/chat/completions`)
and their size limits.

Hypothesis sends wrong types, missing fields, huge strings, deeply nested JSON, unknown ids, negative
and huge integers and non-JSON bodies. For every answer: never a 5xx; a rejection is a 4xx JSON
error with a message; a rejected request changes no row; nothing is logged at ERROR. The /v1
bodies always carry one field that makes them invalid (or name a model that doesn't exist), so no
inference is needed.
"""
import json
import logging

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from chat.models import Agent, ApiKey, Conversation, Feedback, Turn
from chat.tests.factories import (  # noqa: F401
    ReplyFactory,
    TurnFactory,
    dead_engine,
    model_settings,
)
from training.models import AuditEvent, TrainingSample

pytestmark = [pytest.mark.django_db, pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")]

FUZZ = hsettings(max_examples=50, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large])

# Strategies
# ------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([0, -1, -(2**31), 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | HUGE_INTS | st.floats()
    | st.text(max_size=40)
)
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
# Long strings are built, not drawn, so that examples stay fast.
LONG_TEXT = st.builds(lambda n, c: c * n, st.sampled_from([0, 1, 100, 101, 200, 201, 8000, 8001, 100_000]),
                      st.sampled_from(["x", "é", "\x00", "😀", " ", "<script>", "\u202e"]))
VALUES = JSON | LONG_TEXT | HUGE_INTS


def deep(n, kind):
    return ("[" * n + "]" * n) if kind == "list" else ('{"a":' * n + "1" + "}" * n)


RAW_BODIES = st.one_of(
    st.binary(max_size=200),  # not JSON, often not UTF-8
    st.text(max_size=200).map(str.encode),
    st.builds(deep, st.sampled_from([50, 2000, 100_000]), st.sampled_from(["list", "dict"])).map(str.encode),
    JSON.map(lambda v: json.dumps(v).encode()),  # any JSON, mostly not an object
    st.just(b"x" * 1_100_000),  # over DATA_UPLOAD_MAX_MEMORY_SIZE
)


def objects_with(fields):
    """JSON objects whose keys come mostly from `fields` (each with a hostile value), plus strays."""
    keys = st.sampled_from(fields) | st.text(max_size=10)
    return st.dictionaries(keys, VALUES, max_size=len(fields) + 1).map(lambda d: json.dumps(d).encode())


def bodies(fields, valid_parts=None):
    objects = objects_with(fields)
    if valid_parts is not None:  # a mostly valid body with one field broken
        objects = objects | valid_parts
    return RAW_BODIES | objects


# Fixtures
# ------------------------------------------------------------------------------


@pytest.fixture
def api(user, settings):
    settings.RATE_LIMIT_FEEDBACK_PER_MINUTE = 0  # no limit: every example must reach validation
    settings.RATE_LIMIT_MESSAGES_PER_MINUTE = 0
    settings.INFERENCE_URLS = ["http://127.0.0.1:9"]
    agent = Agent.objects.create(owner=user, name="Mine", slug="mine", max_tokens=8)
    conversation = Conversation.objects.create(user=user, agent=agent, title="Original")
    question = TurnFactory(conversation=conversation)
    reply = ReplyFactory(conversation=conversation, parent=question)
    _, raw = ApiKey.objects.create_key(user, "fuzz")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return {"client": client, "agent": agent, "conversation": conversation, "reply": reply, "question": question}


def state(conversation):
    conversation = Conversation.objects.filter(pk=conversation.pk).values("title").first()
    return (Conversation.objects.count(), Turn.objects.count(), Feedback.objects.count(),
            TrainingSample.objects.count(), AuditEvent.objects.count(), conversation)


def check(response, before, after, caplog, *, allowed_success=()):
    """The invariants every answer keeps."""
    status = response.status_code
    assert status < 500, (status, response.content[:300])
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    if status in allowed_success:
        return
    assert 400 <= status < 500, status
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"].strip()
    assert error["type"]
    assert after == before, "a rejected request changed rows"


# /api/conversations
# ------------------------------------------------------------------------------


@FUZZ
@given(raw=bodies(["agent_id", "title"]))
def test_fuzz_create_conversation(api, caplog, raw):
    caplog.clear()
    before = state(api["conversation"])
    response = api["client"].post("/api/conversations", raw, content_type="application/json")
    after = state(api["conversation"])
    check(response, before, after, caplog, allowed_success=(201,))
    if response.status_code == 201:
        assert after[0] == before[0] + 1


@FUZZ
@given(raw=bodies(["title"]))
def test_fuzz_rename_conversation(api, caplog, raw):
    caplog.clear()
    before = state(api["conversation"])
    response = api["client"].patch(f"/api/conversations/{api['conversation'].pk}", raw,
                                   content_type="application/json")
    check(response, before, state(api["conversation"]), caplog, allowed_success=(200,))
    if response.status_code == 200:
        title = Conversation.objects.get(pk=api["conversation"].pk).title
        assert response.json()["conversation"]["title"] == title and len(title) <= 200
        Conversation.objects.filter(pk=api["conversation"].pk).update(title="Original")


@FUZZ
@given(query=st.dictionaries(st.sampled_from(["agent", "q", "turn"]), st.text(max_size=30) | HUGE_INTS.map(str)))
def test_fuzz_conversation_queries(api, caplog, query):
    caplog.clear()
    for url in ("/api/conversations", f"/api/conversations/{api['conversation'].pk}"):
        response = api["client"].get(url, query)
        check(response, None, None, caplog, allowed_success=(200,))


# /api/turns/<id>/feedback
# ------------------------------------------------------------------------------

FEEDBACK_FIELDS = ["kind", "reason", "comment", "corrected_text"]
KINDS = st.sampled_from(["thumb_up", "thumb_down", "correction", "comment", "THUMB_UP", "", "implicit", "next_state"])


@FUZZ
@given(raw=bodies(FEEDBACK_FIELDS, st.fixed_dictionaries(
    {"kind": KINDS}, optional={f: VALUES for f in ("reason", "comment", "corrected_text")}
).map(lambda d: json.dumps(d).encode())), target=st.sampled_from(["reply", "question", "unknown", "huge"]))
def test_fuzz_feedback(api, caplog, raw, target):
    caplog.clear()
    turn_id = {"reply": api["reply"].pk, "question": api["question"].pk, "unknown": 987654321,
               "huge": 2**64}[target]
    before = state(api["conversation"])
    response = api["client"].post(f"/api/turns/{turn_id}/feedback", raw, content_type="application/json")
    after = state(api["conversation"])
    check(response, before, after, caplog, allowed_success=(201,))
    if response.status_code == 201:
        assert target == "reply"
        feedback = Feedback.objects.get(pk=response.json()["feedback"]["id"])
        sent = json.loads(raw)
        for name in ("comment", "corrected_text", "reason"):  # stored exactly, never cut
            if isinstance(sent.get(name), str):
                assert getattr(feedback, name) == sent[name]


@FUZZ
@given(turn_id=HUGE_INTS.filter(lambda i: i >= 0) | st.integers(0, 2**40))
def test_fuzz_withdraw_thumb_ids(api, caplog, turn_id):
    caplog.clear()
    before = state(api["conversation"])
    response = api["client"].delete(f"/api/turns/{turn_id}/feedback/thumb")
    check(response, before, state(api["conversation"]), caplog, allowed_success=(200,))


# /v1/chat/completions: bodies that never reach inference
# ------------------------------------------------------------------------------

ROLES = st.sampled_from(["user", "assistant", "system", "tool", "developer", "", "USER"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES}, optional={"content": VALUES, "name": VALUES}), max_size=4)
# Each breaks the body on its own: parse_completion_request refuses it before any lookup.
POISON = st.one_of(
    st.fixed_dictionaries({"messages": st.sampled_from([[], {}, "hi", None, 5, [None], [["user", "hi"]]])}),
    st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])}),
    st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])}),
    st.fixed_dictionaries({"temperature": st.sampled_from([-1, 2.5, "hot", float("nan"), float("inf"), True, [1]])}),
    st.fixed_dictionaries({"top_p": st.sampled_from([0, -0.5, 1.5, "1", {}, False])}),
    st.fixed_dictionaries({"max_tokens": st.sampled_from([0, -5, 2**21, 2**64, 1.5, "10", True])}),
    st.fixed_dictionaries({"max_completion_tokens": st.sampled_from([0, -1, 2**70])}),
    st.fixed_dictionaries({"seed": st.sampled_from([2**63, -(2**63) - 1, 2**100, 0.5, "1"])}),
    st.fixed_dictionaries({"stop": st.sampled_from([5, [1, 2], {"a": 1}, [None]])}),
    st.fixed_dictionaries({"stream": st.sampled_from(["true", 1, 0, [], {}])}),
    st.fixed_dictionaries({"model": st.sampled_from([None, 5, "", [], {"id": "mine"}, "no-such-model", "mine\x00", "MINE"])}),
)


def v1_bodies():
    base = st.fixed_dictionaries({"model": st.just("mine"), "messages": MESSAGES},
                                 optional={"stream": VALUES, "temperature": VALUES, "stop": VALUES, "seed": VALUES})
    poisoned = st.tuples(base, POISON).map(lambda t: json.dumps({**t[0], **t[1]}).encode())
    unknown_model = st.tuples(base, st.text(max_size=20).filter(lambda s: s != "mine")).map(
        lambda t: json.dumps({**t[0], "model": t[1]}).encode())
    return RAW_BODIES | poisoned | unknown_model | objects_with(["model", "messages", "stream", "max_tokens"]).filter(
        lambda raw: json.loads(raw).get("model") != "mine")


@pytest.mark.django_db(transaction=True)  # /v1 closes its DB connections; no test transaction to lose
@FUZZ
@given(raw=v1_bodies(), headers=st.fixed_dictionaries({}, optional={
    "HTTP_X_SESSION_ID": st.sampled_from(["", "s", "x" * 201]),
    "HTTP_X_TURN_TYPE": st.sampled_from(["main", "side", "both", ""]),
}))
def test_fuzz_v1_chat_completions(api, caplog, raw, headers):
    caplog.clear()
    before = state(api["conversation"])
    response = api["client"].post("/v1/chat/completions", raw, content_type="application/json", **headers)
    check(response, before, state(api["conversation"]), caplog)


# Size limits: clear errors, and nothing cut silently
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", [
    ("post", "/api/conversations"), ("patch", "/api/conversations/{conversation}"),
    ("post", "/api/turns/{reply}/feedback"),
])
def test_a_body_over_the_limit_is_413_with_a_message(api, settings, method, path):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    url = path.format(conversation=api["conversation"].pk, reply=api["reply"].pk)
    before = state(api["conversation"])
    payload = json.dumps({"agent_id": api["agent"].pk, "title": "t", "kind": "comment", "comment": "x" * 2000})
    response = getattr(api["client"], method)(url, payload, content_type="application/json")
    assert response.status_code == 413
    assert "1000 bytes" in response.json()["error"]["message"]
    assert state(api["conversation"]) == before


@pytest.mark.django_db(transaction=True)
def test_a_v1_body_over_the_limit_is_413(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = {"model": "mine", "messages": [{"role": "user", "content": "x" * 2000}]}
    before = state(api["conversation"])
    response = api["client"].post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert response.status_code == 413 and response.json()["error"]["message"]
    assert state(api["conversation"]) == before


@pytest.mark.django_db(transaction=True)
def test_a_v1_message_over_max_message_chars_is_413_and_not_stored(api, settings):
    settings.MAX_MESSAGE_CHARS = 50
    body = {"model": "mine", "messages": [{"role": "user", "content": "y" * 51}]}
    before = state(api["conversation"])
    response = api["client"].post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert response.status_code == 413 and "50" in response.json()["error"]["message"]
    assert state(api["conversation"]) == before


@pytest.mark.django_db(transaction=True)
def test_a_v1_message_at_the_limit_is_stored_whole(api, dead_engine, settings):
    """At exactly MAX_MESSAGE_CHARS the message is kept in full (the engine is down: 503, message saved)."""
    settings.MAX_MESSAGE_CHARS = 50
    text = "word " * 9 + "last!"
    assert len(text) == 50
    body = {"model": "mine", "messages": [{"role": "user", "content": text}]}
    response = api["client"].post("/v1/chat/completions", json.dumps(body), content_type="application/json",
                                  HTTP_X_SESSION_ID="at-limit")
    assert response.status_code == 503
    assert Turn.objects.filter(role="user", content=text).exists()


def test_a_title_over_200_characters_is_refused_not_cut(api):
    response = api["client"].patch(f"/api/conversations/{api['conversation'].pk}", json.dumps({"title": "t" * 201}),
                                   content_type="application/json")
    assert response.status_code == 400 and "200" in response.json()["error"]["message"]
    assert Conversation.objects.get(pk=api["conversation"].pk).title == "Original"


@pytest.mark.parametrize("field, kind, limit_setting", [
    ("comment", "comment", "MAX_CORRECTION_CHARS"), ("corrected_text", "correction", "MAX_CORRECTION_CHARS"),
])
def test_feedback_text_at_the_limit_is_stored_whole_and_over_it_refused(api, settings, field, kind, limit_setting):
    setattr(settings, limit_setting, 40)
    url = f"/api/turns/{api['reply'].pk}/feedback"
    over = api["client"].post(url, json.dumps({"kind": kind, field: "z" * 41}), content_type="application/json")
    assert over.status_code == 413 and "40" in over.json()["error"]["message"]
    assert not Feedback.objects.exists()
    at = api["client"].post(url, json.dumps({"kind": kind, field: "é" * 40}), content_type="application/json")
    assert at.status_code == 201
    assert getattr(Feedback.objects.get(), field) == "é" * 40


def test_a_thumb_reason_over_100_characters_is_refused(api):
    response = api["client"].post(f"/api/turns/{api['reply'].pk}/feedback",
                                  json.dumps({"kind": "thumb_down", "reason": "r" * 101}), content_type="application/json")
    assert response.status_code == 400 and "100" in response.json()["error"]["message"]
    assert not Feedback.objects.exists()
