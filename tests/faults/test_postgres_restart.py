"""PostgreSQL restarted under a running Daphne: 503 with a clear message during the outage, then
requests succeed again without restarting the web process (CONN_HEALTH_CHECKS, no persistent
connections). The PostgreSQL here is a private embedded one on its own port, never the machine's."""
import json
import uuid

import httpx
import pytest

from bench.load import run_daphne

from .conftest import base_env, manage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAKE_USER = """
from django.contrib.auth import get_user_model
from django.test import Client
from chat.models import Agent
user = get_user_model().objects.create_user(username="pat", password="pw-pat-123!")
Agent.objects.create(name="Helper", slug="helper")
client = Client()
client.force_login(user)
print("SESSION=" + client.cookies["sessionid"].value)
"""


def test_outage_answers_503_then_requests_succeed_again(private_postgres):
    env = base_env(DATABASE_URL=private_postgres.url("claw"), CLAW_TEST_RUN_ID=f"pgfault{uuid.uuid4().hex[:6]}",
                   DATABASE_CONNECT_TIMEOUT=2)
    manage(env, "migrate", "--noinput")
    session = next(line.split("=", 1)[1] for line in manage(env, "shell", "-c", MAKE_USER).splitlines()
                   if line.startswith("SESSION="))
    csrf = uuid.uuid4().hex
    with run_daphne(env, name="daphne-pgfault") as (url, daphne):
        http = httpx.Client(base_url=url, cookies={"sessionid": session, "csrftoken": csrf}, timeout=30,
                            headers={"X-CSRFToken": csrf, "Origin": url})
        assert http.get("/api/agents").status_code == 200
        assert http.get("/").status_code == 200

        private_postgres.stop()
        api = http.get("/api/agents")
        assert api.status_code == 503, api.text[:500]
        assert api.headers["content-type"].startswith("application/json") and api.headers["Retry-After"]
        assert api.json()["error"]["code"] == "database_unavailable"
        assert "database is unavailable" in api.json()["error"]["message"]
        post = http.post("/api/conversations", content=json.dumps({"agent_id": 1}),
                         headers={"Content-Type": "application/json"})
        assert post.status_code == 503 and post.json()["error"]["code"] == "database_unavailable"
        page = http.get("/")
        assert page.status_code == 503 and "text/html" in page.headers["content-type"]
        assert "database is unavailable" in page.text
        # A page that needs no login (the session is still read from the database).
        assert http.get("/login/").status_code == 503

        private_postgres.start()  # same port, same data
        assert http.get("/api/agents").status_code == 200
        assert http.get("/").status_code == 200
        created = http.post("/api/conversations", content=json.dumps({"agent_id": 1}),
                            headers={"Content-Type": "application/json"})
        assert created.status_code == 201, created.text[:500]
        assert daphne.poll() is None  # the web process was never restarted
        http.close()
