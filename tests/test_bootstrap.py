"""The one-command bootstrap: embedded PostgreSQL and Redis, and `run`'s start/stop lifecycle.

Everything here runs on private instances under a temp dir on their own ports; the machine's
5432/6379 are never touched.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import dj_database_url
import psutil
import psycopg
import pytest
import redis

from tools.devservices import EmbeddedPostgres, EmbeddedRedis, database_url, pick_port, port_open

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def scratch():
    # Not tmp_path: the embedded Postgres opens up the parent folders to its system user, and
    # pytest's basetemp should stay private.
    path = Path(tempfile.mkdtemp(prefix="claw-bootstrap-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_embedded_postgres_keeps_data_across_restarts(scratch):
    port = pick_port(None)
    pg = EmbeddedPostgres(scratch / "postgres", port=port).start()
    try:
        assert pg.port == port
        pg.ensure_database("claw_boot")
        with psycopg.connect(pg.url("claw_boot"), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (v text)")
            conn.execute("INSERT INTO kept VALUES ('still here')")
    finally:
        pg.stop()
    assert not port_open("127.0.0.1", port)
    assert pg.running_port() is None

    again = EmbeddedPostgres(scratch / "postgres", port=port).start()
    try:
        assert again.started_here
        again.ensure_database("claw_boot")  # already there: a no-op
        with psycopg.connect(again.url("claw_boot")) as conn:
            assert conn.execute("SELECT v FROM kept").fetchall() == [("still here",)]
    finally:
        again.stop()
    assert not port_open("127.0.0.1", again.port)


@pytest.mark.slow
def test_embedded_postgres_start_reuses_a_running_server(scratch):
    pg = EmbeddedPostgres(scratch / "postgres", port=pick_port(None)).start()
    try:
        second = EmbeddedPostgres(scratch / "postgres").start()
        assert not second.started_here
        assert second.port == pg.port
    finally:
        pg.stop()


@pytest.mark.slow
def test_embedded_postgres_listens_on_loopback_tcp_only(scratch):
    pg = EmbeddedPostgres(scratch / "postgres", port=pick_port(None)).start()
    try:
        with psycopg.connect(pg.url()) as conn:
            listen, sockets = conn.execute(
                "SELECT current_setting('listen_addresses'), current_setting('unix_socket_directories')"
            ).fetchone()
        assert (listen, sockets) == ("127.0.0.1", "")
    finally:
        pg.stop()


def test_embedded_redis_keeps_data_across_restarts(scratch):
    port = pick_port(None)
    rd = EmbeddedRedis(scratch / "redis", port=port).start()
    try:
        assert rd.port == port
        redis.Redis.from_url(rd.url()).set("claw:kept", "still here")
    finally:
        rd.stop()
    assert not port_open("127.0.0.1", port)
    assert rd.running_pid() is None

    again = EmbeddedRedis(scratch / "redis", port=port).start()
    try:
        assert redis.Redis.from_url(again.url()).get("claw:kept") == b"still here"
    finally:
        again.stop()


def test_embedded_redis_start_reuses_a_running_server(scratch):
    rd = EmbeddedRedis(scratch / "redis", port=pick_port(None)).start()
    try:
        second = EmbeddedRedis(scratch / "redis").start()
        assert not second.started_here
        assert second.port == rd.port
    finally:
        rd.stop()


def test_busy_port_falls_back_to_a_free_one(scratch):
    rd = EmbeddedRedis(scratch / "a", port=pick_port(None)).start()
    try:
        other = EmbeddedRedis(scratch / "b", port=rd.port).start()
        try:
            assert other.port != rd.port
            assert redis.Redis.from_url(other.url()).ping()
        finally:
            other.stop()
    finally:
        rd.stop()


@pytest.mark.parametrize(
    "url",
    ["postgres://postgres@127.0.0.1:5432/test_claw_ab12", "postgres://u%40x:p%2Fw@db.internal:6543/claw"],
)
def test_database_url_round_trips_through_dj_database_url(url):
    parsed = dj_database_url.parse(url)
    assert dj_database_url.parse(database_url(parsed)) == parsed


def _wait_http(url, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            time.sleep(0.5)
    return None


@pytest.mark.slow
def test_run_starts_everything_and_ctrl_c_stops_it(scratch):
    """`python -m tools.devservices run` (what ./run execs) with embedded services, then SIGINT."""
    web_port = pick_port(None)
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env.update(
        DATA_DIR=str(scratch / "data"), PORT=str(web_port),
        CLAW_PG_PORT=str(pick_port(None)), CLAW_REDIS_PORT=str(pick_port(None)),
        # No model build and no engine here: those have their own tests.
        MODEL=str(scratch / "no-model"), INFERENCE_URL="http://127.0.0.1:9",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.devservices", "run"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        status = _wait_http(f"http://127.0.0.1:{web_port}/admin/login/", timeout=240)
        assert status == 200, f"web did not answer: {status}"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("daphne" in " ".join(c.cmdline()) for c in children)
        assert any("celery" in " ".join(c.cmdline()) for c in children)
        credentials = (scratch / "data" / "demo-credentials.txt").read_text()
        assert "admin" in credentials and "demo" in credentials

        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, output
    assert f"running at http://127.0.0.1:{web_port}/" in output
    assert not port_open("127.0.0.1", web_port)
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child
    assert EmbeddedPostgres(scratch / "data" / "postgres").running_port() is None
    assert EmbeddedRedis(scratch / "data" / "redis").running_pid() is None


@pytest.mark.slow
def test_seed_demo_is_idempotent(scratch):
    """Two runs of seed_demo: the same accounts, agents and passwords."""
    from tools.devservices import ensure_services

    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"}}
    env.update(DATA_DIR=str(scratch), CLAW_PG_PORT=str(pick_port(None)), CLAW_REDIS_PORT=str(pick_port(None)))
    services = ensure_services(env, scratch, use_machine_services=False)
    try:
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True)
        first = subprocess.run([*manage, "seed_demo"], cwd=REPO, env=env, check=True, capture_output=True, text=True)
        second = subprocess.run([*manage, "seed_demo"], cwd=REPO, env=env, check=True, capture_output=True, text=True)
        assert first.stdout == second.stdout
        with psycopg.connect(env["DATABASE_URL"]) as conn:
            users = conn.execute("SELECT username, is_superuser FROM auth_user ORDER BY username").fetchall()
            agents = conn.execute("SELECT slug FROM chat_agent WHERE owner_id IS NULL ORDER BY slug").fetchall()
        assert users == [("admin", True), ("demo", False)]
        assert len(agents) >= 2
        assert oct((scratch / "demo-credentials.txt").stat().st_mode & 0o777) == "0o600"
    finally:
        for service in reversed(services):
            service.stop()
