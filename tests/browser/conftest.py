"""Browser tests: Debian's Chromium through Playwright against Daphne running in a subprocess.

Daphne uses the test database pytest-django created (tests mark themselves
`django_db(transaction=True)`, so rows they create are committed and visible to it) and the same
Redis key prefix. Every reply comes from the built-in engine (`manage.py serve_model`) serving the
tiny demo model:

- `live_server_url`: one engine for the session, run with `--step-delay`, so that a long reply
  streams slowly enough to be stopped (Escape, the Stop button);
- `restartable_server`: for the failure test, an engine the test stops (the reply fails: connection
  refused) and starts again on the same port (the retry succeeds), with its own Daphne in front.
"""
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from serving.engine.testing import stop_process

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-background-networking", "--disable-gpu", "--no-first-run",
    "--disable-component-update", "--disable-sync",
]
# Seconds the engines wait between decode steps: a 256-token reply takes about 13 s, time enough
# to press Stop after the first words; a short reply still ends within a second or two.
STEP_DELAY = 0.05


def _free_port():
    from serving.engine.testing import free_port

    return free_port()


def _run_engine_server(model_dir, **kwargs):
    from serving.engine.testing import run_engine_server

    return run_engine_server(model_dir, extra_args=["--step-delay", STEP_DELAY], **kwargs)


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
def run_daphne(inference_url, model_dir, name, *, extra_env=None):
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
        **(extra_env or {}),
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
        stop_process(process, grace=10)


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir):
    with _run_engine_server(tiny_model_dir) as server:
        yield server.url


class RestartableEngine:
    """The built-in engine on a fixed port, which a test can stop (a crash) and start again."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self._stack = ExitStack()

    def start(self):
        assert self.server is None, "already running"
        self.server = self._stack.enter_context(_run_engine_server(self.model_dir, port=self.port))

    def stop(self):
        """Kill the process, as a crash would: connections to the port are refused from now on."""
        self.server.process.kill()
        self.server.process.wait()
        self._stack.close()
        self.server = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._stack.close()


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
        reply = page.wait_for_selector('article.msg-assistant:not([data-status="streaming"])', timeout=300_000)
        if reply.get_attribute("data-status") != "complete":
            raise RuntimeError(f"the warm-up reply on {url} ended {reply.get_attribute('data-status')!r}: "
                               f"{reply.inner_text()[:500]}")
    finally:
        context.close()
        with django_db_blocker.unblock():
            user.delete()


@pytest.fixture(scope="session")
def live_server_url(django_db_setup, django_db_blocker, engine_url, tiny_model_dir, browser):
    """Daphne with the session's engine (tiny demo model, `STEP_DELAY` between steps) behind it."""
    with run_daphne(engine_url, tiny_model_dir, "engine") as url:
        warm_up(url, browser, django_db_blocker)
        yield url


@pytest.fixture
def restartable_server(django_db_blocker, tiny_model_dir, browser):
    """Daphne in front of a RestartableEngine: `.url` (Daphne) and `.engine` (stop() / start())."""
    from types import SimpleNamespace

    # A reply that finds the engine gone fails at once (connection refused); the short timeout only
    # bounds a request that would hang.
    with RestartableEngine(tiny_model_dir) as engine, \
            run_daphne(engine.url, tiny_model_dir, "restartable", extra_env={"INFERENCE_TIMEOUT": "15"}) as url:
        warm_up(url, browser, django_db_blocker)
        yield SimpleNamespace(url=url, engine=engine)


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
