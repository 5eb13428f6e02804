"""Redis restarted under a running Daphne and Celery worker (a private redis-server on its own port).

Feedback lives in PostgreSQL: every POST that answered 201 is stored exactly once, whatever Redis
was doing. Neither the web process nor the worker is restarted: feedback posted after Redis is back
is processed by the worker, and a new WebSocket connects and answers pings.
"""
import asyncio
import threading
import time
import uuid

import httpx
import pytest

from bench.load import WSClient, api_headers, run_daphne, run_worker, session_cookies, stop_process
from chat.models import Feedback
from chat.tests.factories import AgentFactory, ConversationFactory, ReplyFactory, TurnFactory
from tools import devservices

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(600)]


def replies(user, n):
    conversation = ConversationFactory(user=user, agent=AgentFactory())
    out, parent = [], None
    for i in range(n):
        asked = TurnFactory(conversation=conversation, parent=parent, content=f"q{i}")
        parent = ReplyFactory(conversation=conversation, parent=asked, content=f"a{i}")
        out.append(parent)
    return out


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


async def ping(url, cookies):
    async with WSClient.connect(url.replace("http://", "ws://") + "/ws/chat/", cookies=cookies, origin=url) as ws:
        await ws.send_json({"type": "ping", "request_id": 1})
        return await ws.recv_json(timeout=20)


def test_feedback_survives_a_redis_restart_and_everything_recovers(user, private_redis):
    turns = replies(user, 300)
    cookies = session_cookies(user)
    env = devservices.test_subprocess_env(REDIS_URL=private_redis.url(), CLAW_TEST_RUN_ID=f"redisfault{uuid.uuid4().hex[:6]}",
                              OMP_NUM_THREADS=1)
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    worker = run_worker(env, queues="default", name="redisfault")
    try:
        with run_daphne(env, name="daphne-redisfault") as (url, daphne):
            http = httpx.Client(base_url=url, cookies=cookies, headers=api_headers(cookies, url), timeout=30)
            assert asyncio.run(ping(url, cookies)) == {"type": "pong", "request_id": 1}
            results = []  # (turn id, status)
            stop = threading.Event()

            def post_feedback():
                for turn in turns:
                    if stop.is_set():
                        return
                    try:
                        status = http.post(f"/api/turns/{turn.pk}/feedback", json={"kind": "thumb_up"}).status_code
                    except httpx.TransportError as exc:
                        status = type(exc).__name__
                    results.append((turn.pk, status))
                    time.sleep(0.05)

            first = http.post(f"/api/turns/{turns[0].pk}/feedback", json={"kind": "thumb_down"})
            assert first.status_code == 201
            wait_until(lambda: Feedback.objects.filter(pk=first.json()["feedback"]["id"]).exclude(verdict="").exists(),
                       120, "the worker to process feedback before the restart")

            poster = threading.Thread(target=post_feedback)
            poster.start()
            wait_until(lambda: len(results) >= 5, 60, "feedback before the restart")
            private_redis.stop()
            down_at = len(results)
            time.sleep(3)
            private_redis.start()  # same port, same data directory (AOF)
            up_at = len(results)
            wait_until(lambda: len(results) >= up_at + 10 or not poster.is_alive(), 120, "feedback after the restart")
            stop.set()
            poster.join(60)

            created = [turn_id for turn_id, status in results if status == 201]
            assert len(created) >= 15 and down_at < up_at, (down_at, up_at, results[-20:])
            # Every 201 is one row; nothing acknowledged is lost or doubled.
            for turn_id in created:
                assert Feedback.objects.filter(turn_id=turn_id, kind="thumb_up").count() == 1, turn_id
            failures = [(t, s) for t, s in results if s != 201]
            # A feedback posted after Redis came back is processed by the same worker process.
            after = Feedback.objects.get(turn_id=created[-1], kind="thumb_up")
            wait_until(lambda: Feedback.objects.filter(pk=after.pk).exclude(verdict="").exists(), 120,
                       "the worker to process feedback after the restart")
            pongs = []
            for _ in range(6):  # log each try: how long until sockets work again
                try:
                    pongs.append(asyncio.run(ping(url, cookies)))
                    break
                except Exception as exc:  # noqa: BLE001
                    pongs.append(repr(exc))
                    time.sleep(5)
            print("pings after restart:", pongs)
            assert pongs[-1] == {"type": "pong", "request_id": 1}, pongs
            assert daphne.poll() is None and worker.poll() is None
            http.close()
            print(f"posted={len(results)} created={len(created)} failed_during_outage={failures}")
    finally:
        stop_process(worker)
