"""Browser tests: Debian's Chromium through Playwright against Daphne running in a subprocess.

Daphne uses the test database pytest-django created (tests mark themselves
`django_db(transaction=True)`, so rows they create are committed and visible to it) and the same
Redis key prefix. Replies come from the built-in engine serving the tiny demo model, or, where a
test needs a reply slow enough to stop or one that fails, from `StubEngine` below, which speaks the
same streaming protocol.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-background-networking", "--disable-gpu", "--no-first-run",
    "--disable-component-update", "--disable-sync",
]


def _free_port():
    from serving.engine.testing import free_port

    return free_port()


# ---------------------------------------------------------------------------
# A stub engine: slow or failing replies on demand
# ---------------------------------------------------------------------------

class StubEngine:
    """An OpenAI-compatible streaming server whose replies depend on the last user message.

    "FAIL" in the message: HTTP 500. "quick": five words. Anything else: up to max_tokens words,
    one every `delay` seconds, slow enough for a person (or a test) to press Stop.
    """

    def __init__(self, delay=0.08):
        self.delay = delay
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/health"):
                    self._json(200, {"status": "ok"})
                else:
                    self._json(200, {"object": "list", "data": [{"id": "base", "object": "model"}]})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.startswith("/v1/chat/completions"):
                    self._json(200, {})
                    return
                last = next((m.get("content") or "" for m in reversed(request.get("messages", [])) if m.get("role") == "user"), "")
                if "FAIL" in last:
                    self._json(500, {"error": {"message": "stub engine failure", "type": "server_error", "param": None, "code": 500}})
                    return
                count = 5 if "quick" in last else int(request.get("max_tokens") or 64)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    self._stream(count, request)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def _stream(self, count, request):
                def emit(payload):
                    self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    self.wfile.flush()

                emit({"id": "stub", "object": "chat.completion.chunk", "model": request.get("model"),
                      "prompt_token_ids": [1, 2, 3],
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]})
                for i in range(count):
                    word = f"word{i} "
                    emit({"id": "stub", "object": "chat.completion.chunk", "choices": [{
                        "index": 0, "delta": {"content": word}, "token_ids": [100 + i % 50],
                        "logprobs": {"content": [{"token": word, "logprob": -0.5, "bytes": list(word.encode()), "top_logprobs": []}]},
                    }]})
                    time.sleep(engine.delay)
                emit({"id": "stub", "object": "chat.completion.chunk",
                      "choices": [{"index": 0, "delta": {}, "finish_reason": "length" if count > 5 else "stop", "token_ids": []}]})
                emit({"id": "stub", "object": "chat.completion.chunk", "choices": [],
                      "usage": {"prompt_tokens": 3, "completion_tokens": count, "total_tokens": 3 + count}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------
# Daphne
# ---------------------------------------------------------------------------

def _database_url():
    from django.db import connection

    s = connection.settings_dict
    auth = quote(s["USER"] or "", safe="")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"], safe="")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


@contextmanager
def run_daphne(inference_url, model_dir, name):
    port = _free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test",
        "DATABASE_URL": _database_url(),
        "INFERENCE_URL": inference_url,
        "MODEL": str(model_dir),
        "SIGNUP_OPEN": "true",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    log_dir = REPO / "var" / "test-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"daphne-{name}-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "clawplatform.asgi:application"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"daphne exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/login/", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"daphne did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir):
    from serving.engine.testing import run_engine_server

    with run_engine_server(tiny_model_dir) as server:
        yield server.url


def warm_up(url, browser, django_db_blocker):
    """Chat once, so the server process has loaded the tokenizer before the tests time anything."""
    from django.contrib.auth import get_user_model

    from chat.models import Agent

    with django_db_blocker.unblock():
        user = get_user_model().objects.create_user(username="warm-up", password="Warm-up-pass-1")
        agent = Agent.objects.create(owner=user, name="Warm-up", slug="warm-up", max_tokens=8)
    context = browser.new_context(base_url=url)
    try:
        page = context.new_page()
        page.goto("/login/")
        page.fill("#id_username", "warm-up")
        page.fill("#id_password", "Warm-up-pass-1")
        page.click("#main button[type=submit]")
        page.wait_for_url(re.compile(r"/$"))
        page.goto(f"/agents/{agent.pk}/")
        page.fill("#composer-input", "quick hello")
        page.press("#composer-input", "Enter")
        page.wait_for_selector('article.msg-assistant:not([data-status="streaming"])', timeout=300_000)
    finally:
        context.close()
        with django_db_blocker.unblock():
            user.delete()


@pytest.fixture(scope="session")
def live_server_url(django_db_setup, django_db_blocker, engine_url, tiny_model_dir, browser):
    """Daphne with the built-in engine (tiny demo model) behind it."""
    with run_daphne(engine_url, tiny_model_dir, "engine") as url:
        warm_up(url, browser, django_db_blocker)
        yield url


@pytest.fixture(scope="session")
def stub_server_url(django_db_setup, django_db_blocker, tiny_model_dir, browser):
    """Daphne with the stub engine behind it: slow replies to stop, and failures on demand."""
    with StubEngine() as stub, run_daphne(stub.url, tiny_model_dir, "stub") as url:
        warm_up(url, browser, django_db_blocker)
        yield url


# ---------------------------------------------------------------------------
# Playwright
# ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import expect

    # The first message of a server process loads the tokenizer: slow on a busy CI machine.
    expect.set_options(timeout=30_000)
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
            pytest.fail(f"{CHROMIUM} is not installed")
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop running in this thread; the ORM calls the tests
    # make between browser steps are still plain synchronous code.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def new_page(browser, request):
    """Factory: a page in a fresh context (options such as color_scheme or viewport pass through)."""
    contexts = []

    def make(base_url, **options):
        options.setdefault("viewport", {"width": 1280, "height": 860})
        context = browser.new_context(base_url=base_url, **options)
        context.set_default_timeout(30_000)
        contexts.append(context)
        return context.new_page()

    yield make
    # Let the server finish what the pages started (the panel's htmx load, socket disconnects)
    # before pytest-django truncates the tables: a request still reading them can deadlock the flush.
    for context in contexts:
        for page in context.pages:
            try:
                page.wait_for_load_state("networkidle", timeout=5_000)
            except Exception:
                pass
        context.close()
    time.sleep(1.0)


@pytest.fixture
def shot(request):
    """shot(page, "step") saves tests/artifacts/<test>-<n>-<step>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    counter = iter(range(1, 100))
    test = re.sub(r"[^\w.-]+", "_", request.node.name)

    def take(page, step):
        page.screenshot(path=str(ARTIFACTS / f"{test}-{next(counter):02d}-{step}.png"), full_page=False)

    return take


@pytest.fixture
def log_in():
    """log_in(page, username, password) through the login form."""

    def log_in(page, username, password):
        page.goto("/login/")
        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.click("#main button[type=submit]")
        page.wait_for_url(re.compile(r"/$"))

    return log_in
