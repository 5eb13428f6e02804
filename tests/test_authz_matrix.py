"""Who may reach what: every URL pattern x every kind of visitor, every WebSocket frame type, API keys,
plus the web hardening checks (CSRF tokens in forms, WebSocket origin and login).

The URL list is walked from the live URL conf, not written by hand: a pattern that ROUTES below
does not describe fails `test_every_url_pattern_is_classified`, so a new endpoint can't be
forgotten. Actors: an anonymous visitor, another user ("mallory"), the owner ("alice"), staff
("sam", is_staff but not a superuser) and, for the admin only, a superuser.

Expected answers (docs/api.md, docs/websocket.md):
- anonymous: pages redirect to /login/; /api and /v1 answer 401 JSON; the admin redirects to its login.
- someone else's object: 404, the same answer as a missing one; never 200 or 500.
- staff pages for non-staff: 403 (the admin and /invite/ redirect to the admin login instead).
- the owner: no 4xx/5xx on GET (405 on POST-only routes).
- an empty POST (or PATCH/DELETE) from anyone who may not act changes no row.
"""
import hashlib
import inspect
import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from chat import auth as chat_auth
from chat.consumers import ChatConsumer
from chat.models import Agent, ApiKey, Conversation, Feedback, Turn
from chat.tests.factories import ReplyFactory, TurnFactory
from serving.models import AdapterVersion
from training.models import AuditEvent, TrainingJob, TrainingPause

pytestmark = pytest.mark.django_db

# The route table
# ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """How one URL pattern is guarded.

    kind: "public" (no login), "user" (login, no object), "owned" (login, the owner's object),
          "staff" (staff only), "api" (/api: session or key, JSON), "v1" (/v1: API key only).
    get: whether GET is a method of the route (if not, 405 is the right answer to GET).
    writes: the unsafe methods that change state (each is sent with an empty body).
    query: appended to the URL for GET (a required query parameter).
    admin_login: non-staff are redirected to the admin login instead of getting 403.
    anon_get: for "public" routes, the statuses an anonymous GET may get.
    why: for exceptions, the reason.
    """

    kind: str
    get: bool = True
    writes: tuple = ()
    query: str = ""
    admin_login: bool = False
    anon_get: frozenset = frozenset({200})
    why: str = ""


P = "POST"
ROUTES = {
    # Public and special: listed explicitly, with the reason.
    "serving:healthz": Route("public", anon_get=frozenset({200, 503}),
                             why="load-balancer probe: no login; shows only each part's state (503 when a part is down)"),
    "login": Route("public", writes=(P,), why="the login form"),
    "logout": Route("public", get=False, anon_get=frozenset({405}),
                    why="POST-only; ends the caller's own session, so it is not posted here"),
    "signup": Route("public", writes=(P,), why="open signup (SIGNUP_OPEN); an empty form creates nobody"),
    "password_reset_confirm": Route("public", writes=(P,), why="the set-password link staff invitations send; "
                                                             "a bad token shows 'invalid link' and changes nothing"),
    "password_reset_complete": Route("public", why="static 'password set' page"),
    # chat pages
    "chat:home": Route("user"),
    "chat:agent_create": Route("user", writes=(P,)),
    "chat:agent_chat": Route("owned"),
    "chat:agent_edit": Route("owned", writes=(P,)),
    "chat:agent_delete": Route("owned", writes=(P,)),
    "chat:conversation": Route("owned"),
    "chat:conversation_rename": Route("owned", get=False, writes=(P,)),
    "chat:conversation_delete": Route("owned", get=False, writes=(P,)),
    "chat:settings": Route("user"),
    "chat:api_key_create": Route("user", get=False, writes=(P,)),
    "chat:api_key_revoke": Route("owned", get=False, writes=(P,)),
    "chat:password_change": Route("user", writes=(P,)),
    "chat:export": Route("user"),
    "chat:export_conversations": Route("user"),
    "chat:export_adapters": Route("user"),
    "chat:account_delete": Route("user", writes=(P,)),
    "chat:invite": Route("staff", writes=(P,), admin_login=True,
                         why="staff_member_required: non-staff go to the admin login (tests/test_pages.py)"),
    # JSON API and /v1
    "chat:api-agents": Route("api"),
    "chat:api-conversations": Route("api", writes=(P,)),
    "chat:api-conversation": Route("api", writes=("PATCH", "DELETE")),
    "chat:api-turn-feedback": Route("api", get=False, writes=(P,)),
    "chat:api-turn-thumb": Route("api", get=False, writes=("DELETE",)),
    "chat:v1-models": Route("v1"),
    "chat:v1-chat-completions": Route("v1", get=False, writes=(P,)),
    # training: the user's own personalization
    "training:panel": Route("owned"),
    "training:train-now": Route("owned", get=False, writes=(P,)),
    "training:cancel-job": Route("owned", get=False, writes=(P,)),
    "training:history": Route("owned"),
    "training:diff": Route("owned"),
    "training:activate": Route("owned", writes=(P,), query="?version=base"),
    "training:delete-data": Route("owned", writes=(P,)),
    # training: staff
    "training:staff-home": Route("staff"),
    "training:review-queue": Route("staff"),
    "training:review-bulk": Route("staff", get=False, writes=(P,)),
    "training:review-item": Route("staff"),
    "training:review-reserve": Route("staff", get=False, writes=(P,)),
    "training:review-release": Route("staff", get=False, writes=(P,)),
    "training:review-approve": Route("staff", get=False, writes=(P,)),
    "training:review-fix": Route("staff", get=False, writes=(P,)),
    "training:review-reject": Route("staff", get=False, writes=(P,)),
    "training:staff-agent": Route("staff"),
    "training:staff-agent-policy": Route("staff", get=False, writes=(P,)),
    "training:staff-user": Route("staff"),
    "training:staff-history": Route("staff"),
    "training:staff-activate": Route("staff", get=False, writes=(P,)),
    "training:staff-diff": Route("staff"),
    "training:staff-pause": Route("staff", get=False, writes=(P,)),
    "training:staff-resume": Route("staff", get=False, writes=(P,)),
    "training:audit": Route("staff"),
    "training:plot": Route("staff"),
    "training:export": Route("staff"),
    "training:metrics": Route("staff", anon_get=frozenset({401}),
                              why="Prometheus scrape: staff session or METRICS_TOKEN bearer; 401 (not a login "
                                  "redirect) without credentials, so scrapers see a plain error"),
}
# Django's admin is one guard for all its pages (AdminSite.admin_view): every pattern in the
# `admin` namespace (and its unnamed legacy redirects and catch-all) is checked with ADMIN_ROUTE.
ADMIN_ROUTE = Route("admin", writes=(P,))
ADMIN_PUBLIC = {"admin:login": "the admin's login form", "admin:logout": "POST-only; ends the caller's session"}

# Path parameters -> the owner's objects (filled by the `world` fixture).
PARAMS = {
    "agent_id": "agent", "conversation_id": "conversation", "turn_id": "reply", "key_id": "key",
    "job_id": "job", "version_id": "version", "feedback_id": "feedback", "user_id": "owner",
    "kind": "plot_kind", "fmt": "plot_fmt", "uidb64": "uidb64", "token": "bad_token",
    # admin
    "object_id": "admin_object", "id": "owner", "content_type_id": "content_type", "app_label": "app_label",
    "url": "catch_all",
}


def walk(patterns, prefix="", namespace=None):
    """(route string, full name or None) for every leaf pattern, includes followed."""
    for p in patterns:
        if isinstance(p, URLResolver):
            ns = namespace
            if p.namespace:
                ns = f"{namespace}:{p.namespace}" if namespace else p.namespace
            yield from walk(p.url_patterns, prefix + str(p.pattern), ns)
        elif isinstance(p, URLPattern):
            name = f"{namespace}:{p.name}" if namespace and p.name else p.name
            yield prefix + str(p.pattern), name, namespace


ALL_PATTERNS = list(walk(get_resolver().url_patterns))
_PARAM = re.compile(r"<(?:\w+:)?(\w+)>|\(\?P<(\w+)>[^)]*\)")


def param_names(route):
    return [a or b for a, b in _PARAM.findall(route)]


def route_for(name, namespace):
    if namespace == "admin":
        return ADMIN_ROUTE
    return ROUTES.get(name)


def concrete(route, values, model=None):
    def fill(match):
        name = match.group(1) or match.group(2)
        if name == "object_id":
            return str(values["admin_objects"].get(model, 1))
        return str(values[PARAMS[name]])

    return "/" + _PARAM.sub(fill, route).replace("^", "").replace("$", "")


def admin_model(name):
    """'admin:chat_agent_change' -> the Agent model (or None)."""
    if not name or not name.startswith("admin:"):
        return None
    for model in apps.get_models():
        if name.startswith(f"admin:{model._meta.app_label}_{model._meta.model_name}_"):
            return model
    return None


def cases(values):
    """(key, url for GET, Route, name) for every pattern."""
    out = []
    for route_str, name, namespace in ALL_PATTERNS:
        route = route_for(name, namespace)
        if route is None:
            continue  # reported by test_every_url_pattern_is_classified
        model = admin_model(name)
        if model is None and namespace == "admin" and "object_id" in param_names(route_str):
            model = _legacy_admin_model(route_str)
        url = concrete(route_str, values, model)
        out.append((name or route_str, url, route, name))
    return out


def _legacy_admin_model(route_str):
    parts = route_str.split("/")
    if parts[1] == "r":  # admin "view on site": r/<content_type_id>/<object_id>/, filled with an Agent
        return Agent
    return apps.get_model(parts[1], parts[2])


def test_every_url_pattern_is_classified():
    missing = [(r, n) for r, n, ns in ALL_PATTERNS if route_for(n, ns) is None]
    assert not missing, f"URL patterns with no entry in ROUTES (say who may reach them): {missing}"
    unknown = [p for r, n, ns in ALL_PATTERNS for p in param_names(r) if p not in PARAMS]
    assert not unknown, f"path parameters with no fixture in PARAMS: {unknown}"
    live = {n for _, n, _ in ALL_PATTERNS}
    stale = set(ROUTES) - live
    assert not stale, f"ROUTES names patterns that no longer exist: {stale}"


def test_a_new_pattern_would_fail_the_classification(monkeypatch):
    """The guard itself: an unlisted route name is reported."""
    assert route_for("chat:brand-new-endpoint", "chat") is None
    assert route_for("admin:anything", "admin") is ADMIN_ROUTE


# The world: one owner with one of everything
# ------------------------------------------------------------------------------


@pytest.fixture
def world(user, other_user, staff_user, django_user_model, settings):
    settings.INFERENCE_URLS = ["http://127.0.0.1:9"]  # nothing here may need inference
    settings.INFERENCE_TIMEOUT = 1.0
    superuser = django_user_model.objects.create_superuser(username="root", password="pw-root-123!")
    agent = Agent.objects.create(owner=user, name="Alice's", slug="alices", probe_prompts=[])
    conversation = Conversation.objects.create(user=user, agent=agent, title="Private plans")
    question = TurnFactory(conversation=conversation, content="my secret question")
    reply = ReplyFactory(conversation=conversation, parent=question, content="my secret answer")
    feedback = Feedback.objects.create(turn=reply, author=user, kind=Feedback.Kind.CORRECTION,
                                       corrected_text="better answer")
    key, raw = ApiKey.objects.create_key(user, "alice's key")
    keys = {"owner": raw, "other": ApiKey.objects.create_key(other_user, "m")[1],
            "staff": ApiKey.objects.create_key(staff_user, "s")[1]}
    version = AdapterVersion.objects.create(
        user=user, agent_id=agent.pk, number=1, name=f"u{user.pk}-a{agent.pk}-v1", path="/nonexistent",
        sha256="0" * 64, base_model_name="base", base_model_hash="x")
    job = TrainingJob.objects.create(user=user, agent=agent, method="combined", state=TrainingJob.State.SUCCEEDED,
                                     result_version=version)
    pause = TrainingPause.objects.create(user=user, agent=agent, reason="test", created_by=staff_user)
    audit = AuditEvent.objects.create(action="test", actor=staff_user, actor_label="sam")
    values = {
        "agent": agent.pk, "conversation": conversation.pk, "reply": reply.pk, "key": key.pk, "job": job.pk,
        "version": version.pk, "feedback": feedback.pk, "owner": user.pk, "plot_kind": "reward", "plot_fmt": "svg",
        "uidb64": urlsafe_base64_encode(force_bytes(user.pk)), "bad_token": "bad-token",
        "content_type": ContentType.objects.get_for_model(Agent).pk, "app_label": "chat", "catch_all": "no-such-page/",
    }
    objects = {Agent: agent, Conversation: conversation, Turn: reply, Feedback: feedback, ApiKey: key,
               AdapterVersion: version, TrainingJob: job, TrainingPause: pause, AuditEvent: audit,
               get_user_model(): user}
    values["admin_objects"] = {m: o.pk for m, o in objects.items()}
    for model in apps.get_models():  # any other admin-registered model: its first row, if any
        if model not in values["admin_objects"]:
            first = model.objects.order_by("pk").first() if model._meta.managed else None
            values["admin_objects"][model] = first.pk if first is not None else 1
    actors = {"anonymous": None, "other": other_user, "owner": user, "staff": staff_user, "superuser": superuser}
    return {"values": values, "actors": actors, "keys": keys, "agent": agent, "reply": reply,
            "conversation": conversation, "question": question}


def client_for(user):
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


VOLATILE = {"last_login", "last_used_at", "updated_at"}


def snapshot():
    """Every row of our apps (and users), minus fields a read may touch: what 'nothing changed' means."""
    models = [m for label in ("chat", "training", "serving") for m in apps.get_app_config(label).get_models()]
    models.append(get_user_model())
    state = {}
    for model in models:
        fields = [f.attname for f in model._meta.concrete_fields if f.name not in VOLATILE and f.attname not in VOLATILE]
        state[model._meta.label] = sorted(map(repr, model.objects.values_list(*fields)))
    return state


def request(client, method, url, route, actor, keys):
    headers = {}
    if route.kind == "v1" and actor in keys:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {keys[actor]}"
    if method == "GET":
        return client.get(url + route.query, **headers)
    return getattr(client, method.lower())(url, data=b"", content_type="application/json"
                                           if route.kind in ("api", "v1") else "application/x-www-form-urlencoded",
                                           **headers)


def is_login_redirect(response, login="/login/"):
    return response.status_code == 302 and response["Location"].startswith(login)


def expected_get(route, actor, name, response):
    """None if `response` is right for `actor` GETting `route`, else why not."""
    status = response.status_code
    if status >= 500 and status not in route.anon_get:
        return "server error"
    if not route.get and status == 405 and (actor != "anonymous" or route.kind in ("api", "v1")):
        return None
    if route.kind == "admin":
        if name in ADMIN_PUBLIC:
            return None
        if actor in ("anonymous", "other", "owner"):
            return None if is_login_redirect(response, "/admin/login/") else "expected the admin login"
        return None  # staff without permissions may get 403 on model pages; never 500 (checked above)
    if route.kind == "public":
        if actor == "anonymous":
            return None if status in route.anon_get else f"expected {set(route.anon_get)}"
        return None
    if route.admin_login and actor in ("anonymous", "other", "owner"):
        return None if is_login_redirect(response, "/admin/login/") else "expected the admin login"
    if actor == "anonymous" and route.kind == "staff" and route.anon_get != {200}:
        return None if status in route.anon_get else f"expected {set(route.anon_get)}"
    if actor == "anonymous":
        if route.kind in ("api", "v1"):
            ok = status == 401 and response.json()["error"]["message"]
            return None if ok else "expected 401 JSON"
        return None if is_login_redirect(response) else "expected a login redirect"
    owner_like = status < 400 or (not route.get and status == 405)
    if route.kind in ("user", "api", "v1") and route.kind != "owned":
        if route.kind == "api" and actor != "owner" and name in OWNED_API:
            return None if status == 404 else "expected 404 for someone else's object"
        return None if owner_like else "expected success"
    if route.kind == "owned":
        if actor == "owner":
            return None if owner_like else "expected success for the owner"
        return None if status == 404 else "expected 404 for someone else's object"
    if route.kind == "staff":
        if actor in ("staff", "superuser"):
            return None if owner_like else "expected success for staff"
        if route.admin_login:
            return None if is_login_redirect(response, "/admin/login/") else "expected the admin login"
        return None if status == 403 else "expected 403 for non-staff"
    return f"unknown kind {route.kind}"


SECRET = b"my secret"


def body(response):
    return b"".join(response.streaming_content) if response.streaming else response.content


OWNED_API = {"chat:api-conversation", "chat:api-turn-feedback", "chat:api-turn-thumb"}


@pytest.mark.parametrize("actor", ["anonymous", "other", "owner", "staff", "superuser"])
def test_get_matrix(world, actor):
    user = world["actors"][actor]
    client = client_for(user)
    failures = []
    for key, url, route, name in cases(world["values"]):
        if actor == "superuser" and route.kind != "admin":
            continue  # the superuser is here for the admin pages
        if actor == "superuser":
            response = request(client, "GET", url, route, actor, world["keys"])
            if response.status_code >= 500:
                failures.append((key, url, response.status_code, "server error"))
            continue
        response = request(client, "GET", url, route, actor, world["keys"])
        why = expected_get(route, actor, name, response)
        if why:
            failures.append((key, url, response.status_code, why))
        if actor != "owner" and route.kind not in ("staff", "admin") and SECRET in body(response):
            failures.append((key, url, response.status_code, "shows the owner's private text"))
    assert not failures, "\n".join(map(str, failures))


def expected_write(route, actor, name, response):
    """None if an empty unsafe request from `actor` was refused the right way, else why not.

    Only actors who may not act are asked; the caller checks that no row changed.
    """
    status = response.status_code
    if status >= 500:
        return "server error"
    if route.kind == "admin" or route.admin_login:
        return None if is_login_redirect(response, "/admin/login/") or name in ADMIN_PUBLIC else "expected the admin login"
    if route.kind == "public":
        return None
    if actor == "anonymous":
        if route.kind in ("api", "v1"):
            return None if status == 401 else "expected 401"
        return None if is_login_redirect(response) else "expected a login redirect"
    if route.kind == "staff":
        return None if status == 403 else "expected 403 for non-staff"
    if route.kind == "owned" or name in OWNED_API:
        return None if status == 404 else "expected 404 for someone else's object"
    # "user", the unscoped api and v1: an empty body is invalid and creates nothing.
    return None if 400 <= status < 500 or status in (200, 302) else f"unexpected {status}"


def may_not_act(route, actor, name):
    if route.kind == "public":
        return True  # an empty form changes nothing for anyone
    if actor == "anonymous":
        return True
    if route.kind in ("admin", "staff"):
        return actor in ("other", "owner")
    if route.kind == "owned" or name in OWNED_API:
        return actor in ("other", "staff")
    return True  # user-level routes: an empty body is refused as invalid


@pytest.mark.parametrize("actor", ["anonymous", "other", "owner", "staff"])
def test_unsafe_methods_from_those_who_may_not_act_change_nothing(world, actor):
    user = world["actors"][actor]
    client = client_for(user)
    failures = []
    before = snapshot()
    for key, url, route, name in cases(world["values"]):
        for method in route.writes:
            # /v1/chat/completions is async and closes the thread's DB connection, which here is the
            # test transaction's: its POST is checked in test_v1_posts_without_a_valid_key_change_nothing.
            if route.kind == "v1" or not may_not_act(route, actor, name):
                continue
            response = request(client, method, url, route, actor, world["keys"])
            why = expected_write(route, actor, name, response)
            if why:
                failures.append((method, key, url, response.status_code, why))
            after = snapshot()
            if after != before:
                changed = [m for m in after if after[m] != before[m]]
                failures.append((method, key, url, response.status_code, f"rows changed in {changed}"))
                before = after
    assert not failures, "\n".join(map(str, failures))


def test_staff_is_not_the_owner_of_user_objects(world):
    """Staff act on users' data only through /staff pages; the user pages answer staff with 404."""
    client = client_for(world["actors"]["staff"])
    response = client.get(f"/c/{world['values']['conversation']}/")
    assert response.status_code == 404
    assert b"my secret" not in response.content


def test_someone_elses_object_looks_exactly_like_a_missing_one(world):
    client = client_for(world["actors"]["other"])
    theirs = client.get(f"/api/conversations/{world['values']['conversation']}")
    missing = client.get("/api/conversations/999999999")
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json() == missing.json()


# WebSocket frames: generated from the consumer's own table
# ------------------------------------------------------------------------------

# How to name someone else's object in each client frame type. A frame type the consumer
# handles that is missing here fails the test below, so a new one can't be forgotten.
FOREIGN_FRAMES = {
    "message.send": lambda w: {"conversation_id": w["conversation"].pk, "content": "let me in"},
    "generation.stop": lambda w: {"turn_id": w["reply"].pk},
    "message.regenerate": lambda w: {"turn_id": w["reply"].pk},
    "message.retry": lambda w: {"turn_id": w["question"].pk},
}
NO_OBJECT_FRAMES = {"ping": "names no object"}


def documented_client_frames():
    doc = (Path(apps.get_app_config("chat").path).parent / "docs" / "websocket.md").read_text(encoding="utf-8")
    section = doc.split("## Client → server", 1)[1].split("## Server → client", 1)[0]
    return set(re.findall(r"^\| `([\w.]+)` \|", section, flags=re.M))


def test_every_frame_type_is_covered():
    handled = set(ChatConsumer.FRAME_HANDLERS)
    assert handled == documented_client_frames(), "docs/websocket.md and ChatConsumer.FRAME_HANDLERS disagree"
    assert handled == set(FOREIGN_FRAMES) | set(NO_OBJECT_FRAMES), "say how a new frame type names an object"


async def ws_connect(user=None, origin=b"http://localhost"):
    from clawplatform.asgi import application

    headers = [(b"host", b"localhost")]
    if origin is not None:
        headers.append((b"origin", origin))
    if user is not None:
        client = Client()
        await sync_to_async(client.force_login)(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    communicator = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
    connected, code = await communicator.connect()
    return communicator, connected, code


@pytest_asyncio.fixture
async def _close_thread_connections():
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("frame_type", sorted(FOREIGN_FRAMES))
@pytest.mark.parametrize("actor", ["other", "staff"])
async def test_frames_naming_someone_elses_objects_get_not_found(world, actor, frame_type, _close_thread_connections):
    before = await sync_to_async(snapshot)()
    communicator, connected, _ = await ws_connect(world["actors"][actor])
    assert connected
    await communicator.send_json_to({"type": frame_type, "request_id": "r", **FOREIGN_FRAMES[frame_type](world)})
    answer = await communicator.receive_json_from(timeout=10)
    assert answer["type"] == "error" and answer["code"] == "not_found" and answer["request_id"] == "r"
    assert await communicator.receive_nothing(timeout=0.2)
    assert await sync_to_async(snapshot)() == before
    await communicator.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_foreign_origin_is_refused(user, _close_thread_connections):
    communicator, connected, _ = await ws_connect(user, origin=b"https://evil.example")
    assert not connected
    await communicator.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_socket_without_origin_from_a_browser_is_refused(user, _close_thread_connections):
    """Channels' AllowedHostsOriginValidator refuses a missing Origin too (browsers always send one)."""
    communicator, connected, _ = await ws_connect(user, origin=None)
    assert not connected
    await communicator.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_an_anonymous_socket_is_closed_with_4401(_close_thread_connections):
    communicator, connected, code = await ws_connect(None)
    assert not connected and code == 4401
    await communicator.disconnect()


# API keys
# ------------------------------------------------------------------------------


def test_api_keys_are_stored_hashed_only(user):
    key, raw = ApiKey.objects.create_key(user, "k")
    row = ApiKey.objects.filter(pk=key.pk).values().get()
    assert raw not in json.dumps(row, default=str)
    assert row["key_hash"] == hashlib.sha256(raw.encode()).hexdigest()
    assert len(row["prefix"]) < len(raw) // 3  # the prefix tells keys apart without revealing them


def test_a_revoked_key_is_refused(user, client):
    key, raw = ApiKey.objects.create_key(user, "k")
    assert client.get("/api/agents", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=key.created_at)
    assert client.get("/api/agents", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401


def test_a_key_of_a_deactivated_user_is_refused(user, client):
    _, raw = ApiKey.objects.create_key(user, "k")
    user.is_active = False
    user.save()
    assert client.get("/api/agents", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401


def test_keys_are_compared_in_constant_time(user, monkeypatch):
    source = inspect.getsource(chat_auth.authenticate_key)
    assert "hmac.compare_digest" in source
    calls = []
    real = chat_auth.hmac.compare_digest
    monkeypatch.setattr(chat_auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    _, raw = ApiKey.objects.create_key(user, "k")
    assert chat_auth.authenticate_key(raw) is not None
    assert calls and calls[-1][1] == hashlib.sha256(raw.encode()).hexdigest()


# Web hardening: every POST form carries a CSRF token
# ------------------------------------------------------------------------------


class _Forms(HTMLParser):
    def __init__(self):
        super().__init__()
        self.forms = []  # [method, action, has_token]
        self._open = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form":
            self._open = [(attrs.get("method") or "get").lower(), attrs.get("action"), False, "hx-post" in attrs]
            self.forms.append(self._open)
        elif tag == "input" and self._open is not None and attrs.get("name") == "csrfmiddlewaretoken" and attrs.get("value"):
            self._open[2] = True

    def handle_endtag(self, tag):
        if tag == "form":
            self._open = None


def test_every_post_form_carries_a_csrf_token(world):
    """Render every page the owner and staff can GET; each <form method="post"> has the token."""
    failures, pages, forms = [], 0, 0
    for actor in ("owner", "staff", "anonymous"):
        client = client_for(world["actors"][actor])
        for key, url, route, name in cases(world["values"]):
            if not route.get or route.kind in ("api", "v1", "admin"):
                continue
            if route.kind == "staff" and actor != "staff":
                continue
            response = request(client, "GET", url, route, actor, world["keys"])
            if response.status_code != 200 or "html" not in response.get("Content-Type", ""):
                continue
            pages += 1
            parser = _Forms()
            parser.feed(response.content.decode())
            for method, action, has_token, _ in parser.forms:
                if method == "post":
                    forms += 1
                    if not has_token:
                        failures.append((actor, key, url, action))
    assert pages >= 20 and forms >= 10, (pages, forms)
    assert not failures, f"POST forms without csrfmiddlewaretoken: {failures}"


def test_a_session_post_without_the_token_is_refused(world):
    """The token is not decorative: with CSRF checks on, each unsafe page/API route refuses without it."""
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(world["actors"]["owner"])
    before = snapshot()
    refused = []
    for key, url, route, name in cases(world["values"]):
        if route.kind not in ("owned", "user", "api") or "POST" not in route.writes:
            continue
        response = strict.post(url, data=b"{}", content_type="application/json")
        refused.append((key, response.status_code))
    assert refused and all(status == 403 for _, status in refused), refused
    assert snapshot() == before


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_v1_posts_without_a_valid_key_change_nothing(world, _close_thread_connections):
    from django.test import AsyncClient

    body = json.dumps({"model": world["agent"].slug, "messages": [{"role": "user", "content": "hi"}]})
    revoked, raw_revoked = await sync_to_async(ApiKey.objects.create_key)(world["actors"]["owner"], "old")
    await ApiKey.objects.filter(pk=revoked.pk).aupdate(revoked_at=revoked.created_at)
    session = AsyncClient()
    await sync_to_async(session.force_login)(world["actors"]["owner"])
    before = await sync_to_async(snapshot)()
    for client, headers in [
        (AsyncClient(), {}),
        (AsyncClient(), {"Authorization": "Bearer claw-wrong"}),
        (AsyncClient(), {"Authorization": f"Bearer {raw_revoked}"}),
        (session, {}),  # a session is not enough for /v1
    ]:
        response = await client.post("/v1/chat/completions", body, content_type="application/json", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    # Someone else's key with an empty body: invalid, and it names nothing of the owner's.
    response = await AsyncClient().post("/v1/chat/completions", b"", content_type="application/json",
                                        headers={"Authorization": f"Bearer {world['keys']['other']}"})
    assert response.status_code == 400
    # Someone else's key naming the owner's private agent: 404, like a missing model.
    response = await AsyncClient().post("/v1/chat/completions", body, content_type="application/json",
                                        headers={"Authorization": f"Bearer {world['keys']['other']}"})
    assert response.status_code == 404
    assert await sync_to_async(snapshot)() == before
