"""Load test: many concurrent WebSocket chat sessions plus feedback POSTs, on loopback only.

    .venv/bin/python -m bench.load --sessions 200 --duration 60
    .venv/bin/python -m bench.load --sessions 5 --duration 10 --model var/test-cache/tiny-...   # tiny

It starts its own processes and stops by itself: the built-in engine (`--model`, default the tiny
demo model built for the tests) with short replies (the agent's `max_tokens`, default 8), one
Daphne and one Celery worker (`-Q default`). It creates its own database `claw_load_<id>` on the
PostgreSQL server of DATABASE_URL (default 127.0.0.1:5432), migrates it and drops it at the end,
and uses its own Redis key prefix, so real data is never touched.

Each session is one user (session cookie made with the session store, a CSRF cookie + header for
the JSON API). The sessions connect over `--ramp` seconds (default 20 a second), then for `--duration`
seconds each sends a chat message over `/ws/chat/`, waits for the
reply (`reply.done`) and posts one feedback on the reply through `POST /api/turns/<id>/feedback`.
Rate limits are raised for the run (RATE_LIMIT_MESSAGES_PER_MINUTE and
RATE_LIMIT_FEEDBACK_PER_MINUTE = 100000 in the Daphne's environment): we measure the platform,
not the limiter.

At the end it compares what was acknowledged with the rows in Postgres and prints
`key=value` lines: load_errors, load_lost_rows, load_duplicate_rows, messages_sent,
feedback_sent, feedback_p50_ms/p99_ms (POST latency), ttft_p50_ms/p99_ms (send -> first
`reply.delta`), replies_failed. Exit status 0 only with 0 errors, 0 lost and 0 duplicate rows.

The module also holds the small helpers the fault tests share: a minimal WebSocket client
(the `websockets` package is not a dependency), session cookies, and a Daphne subprocess.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import secrets
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from serving.engine.testing import stop_process

REPO = Path(__file__).resolve().parent.parent
LOG_DIR = REPO / "var" / "test-logs"
RAISED_LIMIT = 100_000


# A minimal WebSocket client (RFC 6455: masked client frames, text/close/ping/pong)
# ------------------------------------------------------------------------------


class WSClosed(Exception):
    def __init__(self, code=None):
        super().__init__(f"WebSocket closed (code {code})")
        self.code = code


class WSClient:
    """`async with WSClient.connect(url, cookies) as ws: await ws.send_json(...); await ws.recv_json()`."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.closed = False

    @classmethod
    async def open(cls, url, *, cookies=None, origin=None, timeout=30):
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or 80
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        headers = [
            f"GET {parts.path or '/'} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13", f"Origin: {origin or f'http://{host}:{port}'}",
        ]
        if cookies:
            headers.append("Cookie: " + "; ".join(f"{k}={v}" for k, v in cookies.items()))
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status + b" ":
            writer.close()
            raise ConnectionError(f"WebSocket handshake refused: {status.decode(errors='replace')}")
        return cls(reader, writer)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url, **kwargs):
        ws = await cls.open(url, **kwargs)
        try:
            yield ws
        finally:
            await ws.close()

    async def _send_frame(self, opcode, payload):
        mask = os.urandom(4)
        length = len(payload)
        if length < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
        elif length < 1 << 16:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.writer.write(header + mask + masked)
        await self.writer.drain()

    async def send_json(self, data):
        await self._send_frame(0x1, json.dumps(data).encode())

    async def _read_frame(self):
        first, second = await self.reader.readexactly(2)
        opcode, length = first & 0x0F, second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
        if second & 0x80:  # servers never mask, but be lenient
            mask = await self.reader.readexactly(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(await self.reader.readexactly(length)))
        else:
            data = await self.reader.readexactly(length)
        return bool(first & 0x80), opcode, data

    async def recv_json(self, timeout=60):
        """The next text frame, decoded. Raises WSClosed when the server closes the socket."""

        async def read():
            chunks = []
            while True:
                try:
                    fin, opcode, data = await self._read_frame()
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed = True
                    raise WSClosed(None) from None
                if opcode == 0x8:
                    self.closed = True
                    code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else None
                    raise WSClosed(code)
                if opcode == 0x9:
                    await self._send_frame(0xA, data)
                    continue
                if opcode == 0xA:
                    continue
                chunks.append(data)
                if fin:
                    return json.loads(b"".join(chunks))

        return await asyncio.wait_for(read(), timeout)

    async def until(self, frame_type, timeout=60):
        """Frames up to and including the first of `frame_type`."""
        frames = []
        deadline = time.monotonic() + timeout
        while True:
            frame = await self.recv_json(timeout=max(0.1, deadline - time.monotonic()))
            frames.append(frame)
            if frame.get("type") == frame_type:
                return frames

    async def close(self):
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                await self._send_frame(0x8, struct.pack("!H", 1000))
        with contextlib.suppress(Exception):
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 2)


# Sessions, processes
# ------------------------------------------------------------------------------


def session_cookies(user):
    """Cookies of a logged-in browser for `user`: a real session row plus a CSRF cookie.

    Runs inside a configured Django (the caller's database). The CSRF value goes in both the
    `csrftoken` cookie and the `X-CSRFToken` header, as the page's JavaScript does.
    """
    from django.test import Client

    client = Client()
    client.force_login(user)
    return {"sessionid": client.cookies["sessionid"].value, "csrftoken": secrets.token_hex(16)}


def api_headers(cookies, base_url):
    return {"X-CSRFToken": cookies["csrftoken"], "Origin": base_url, "Referer": base_url + "/",
            "Content-Type": "application/json"}


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url, *, timeout, process=None, log_path=None):
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path else ""
            raise RuntimeError(f"process exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=2.0).status_code < 500:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path else ""
            raise RuntimeError(f"{url} did not answer in {timeout}s:\n{tail}")
        time.sleep(0.2)


@contextlib.contextmanager
def run_daphne(env, *, name="daphne", port=None, startup_timeout=90):
    """Daphne serving clawplatform.asgi on 127.0.0.1:<port>, in a real subprocess; yields (url, process)."""
    port = port or free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{name}-{port}-{int(time.time())}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "--websocket_connect_timeout", "30",
             "clawplatform.asgi:application"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    process.log_path = log_path
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/login/", timeout=startup_timeout, process=process, log_path=log_path)
        yield url, process
    finally:
        stop_process(process)


def run_worker(env, *, queues="default", name="load"):
    """A Celery worker subprocess (solo pool); the caller stops it with stop_process."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"worker-{name}-{int(time.time())}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "clawplatform", "worker", "-Q", queues, "-c", "1", "--pool=solo",
             "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h", "--without-gossip", "--without-mingle", "-l", "INFO"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    process.log_path = log_path
    return process


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# The load
# ------------------------------------------------------------------------------

FEEDBACK_KINDS = ("thumb_up", "thumb_down", "correction")


class Stats:
    def __init__(self):
        self.errors = []  # (session, what)
        self.sent_messages = {}  # content -> acknowledged user turn id
        self.sent_feedback = []  # (turn_id, kind, feedback_id) for every 201
        self.feedback_ms = []
        self.ttft_ms = []
        self.replies_failed = 0

    def error(self, session, what):
        self.errors.append((session, what))


async def run_session(index, base_url, cookies, agent_id, stop_at, stats, run_tag, delay=0.0):
    import httpx

    await asyncio.sleep(delay)

    ws_url = base_url.replace("http://", "ws://") + "/ws/chat/"
    conversation_id = None
    n = 0
    headers = api_headers(cookies, base_url)
    async with httpx.AsyncClient(base_url=base_url, cookies=cookies, headers=headers, timeout=60) as http:
        try:
            ws = await WSClient.open(ws_url, cookies=cookies, origin=base_url)
        except Exception as exc:  # noqa: BLE001 - counted
            stats.error(index, f"connect: {exc!r}")
            return
        try:
            while time.monotonic() < stop_at:
                content = f"load {run_tag} s{index} m{n}: how are you?"
                frame = {"type": "message.send", "conversation_id": conversation_id, "content": content,
                         "request_id": n}
                if conversation_id is None:
                    frame["agent_id"] = agent_id
                sent = time.perf_counter()
                await ws.send_json(frame)
                first_token = None
                while True:
                    message = await ws.recv_json(timeout=120)
                    kind = message.get("type")
                    if kind == "error":
                        stats.error(index, f"error frame {message.get('code')}: {message.get('message')}")
                        return
                    if kind == "conversation.created":
                        conversation_id = message["conversation"]["id"]
                    elif kind == "message.saved":
                        stats.sent_messages[content] = message["turn"]["id"]
                    elif kind == "reply.delta" and first_token is None:
                        first_token = time.perf_counter()
                    elif kind == "reply.done":
                        reply = message["turn"]
                        break
                if reply["status"] != "complete":
                    stats.replies_failed += 1
                    stats.error(index, f"reply {reply['id']} {reply['status']}: {reply.get('error')}")
                    continue
                if first_token is not None:
                    stats.ttft_ms.append((first_token - sent) * 1000)
                feedback_kind = FEEDBACK_KINDS[n % len(FEEDBACK_KINDS)]
                body = {"kind": feedback_kind}
                if feedback_kind == "correction":
                    body["corrected_text"] = f"A better answer {run_tag} s{index} m{n}."
                posted = time.perf_counter()
                response = await http.post(f"/api/turns/{reply['id']}/feedback", json=body)
                stats.feedback_ms.append((time.perf_counter() - posted) * 1000)
                if response.status_code != 201:
                    stats.error(index, f"feedback POST {response.status_code}: {response.text[:200]}")
                else:
                    stats.sent_feedback.append((reply["id"], feedback_kind, response.json()["feedback"]["id"]))
                n += 1
        except WSClosed as exc:
            stats.error(index, f"socket closed: {exc}")
        except Exception as exc:  # noqa: BLE001 - counted
            stats.error(index, f"{type(exc).__name__}: {exc}")
        finally:
            await ws.close()


def count_rows(stats):
    """(lost, duplicate) rows: acknowledged messages and 201 feedback compared with Postgres."""
    from chat.models import Feedback, Turn

    contents = list(stats.sent_messages)
    found = Counter()
    for start in range(0, len(contents), 1000):
        found.update(Turn.objects.filter(role="user", content__in=contents[start:start + 1000])
                     .values_list("content", flat=True))
    lost = sum(1 for c in contents if found[c] == 0)
    duplicate = sum(found[c] - 1 for c in contents if found[c] > 1)
    turn_ids = sorted({turn for turn, _, _ in stats.sent_feedback})
    rows = Counter()
    for start in range(0, len(turn_ids), 1000):
        rows.update(Feedback.objects.filter(turn_id__in=turn_ids[start:start + 1000])
                    .exclude(kind="implicit").values_list("turn_id", "kind"))
    expected = Counter((turn, kind) for turn, kind, _ in stats.sent_feedback)
    lost += sum(1 for key in expected if rows[key] < expected[key])
    duplicate += sum(rows[key] - expected[key] for key in expected if rows[key] > expected[key])
    # Rows nobody acknowledged would be duplicates of a retried request; count those too.
    duplicate += sum(n for key, n in rows.items() if key not in expected)
    return lost, duplicate


def _admin_url(database_url):
    parts = urlsplit(database_url)
    return parts._replace(path="/postgres").geturl()


def run(args):
    import psycopg
    from psycopg import sql

    run_id = uuid.uuid4().hex[:8]
    server_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/clawplatform")
    db_name = f"claw_load_{run_id}"
    load_url = urlsplit(server_url)._replace(path=f"/{db_name}").geturl()
    with psycopg.connect(_admin_url(server_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db_name)))
    adapter_root = Path(os.environ.get("DATA_DIR", REPO / "var")) / "load" / run_id / "adapters"
    adapter_root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model).resolve()
    env = {
        **os.environ,
        # The test settings give this run its own Redis key prefix (claw-test-load<id>).
        "DJANGO_SETTINGS_MODULE": "clawplatform.settings.test",
        "CLAW_TEST_RUN_ID": f"load{run_id}",
        "DATABASE_URL": load_url,
        "MODEL": str(model_dir),
        "ADAPTER_ROOT": str(adapter_root),
        "RATE_LIMIT_MESSAGES_PER_MINUTE": str(RAISED_LIMIT),
        "RATE_LIMIT_FEEDBACK_PER_MINUTE": str(RAISED_LIMIT),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    os.environ.update({k: env[k] for k in ("DJANGO_SETTINGS_MODULE", "CLAW_TEST_RUN_ID", "DATABASE_URL", "MODEL",
                                          "ADAPTER_ROOT")})
    engine = worker = None
    stats = Stats()
    try:
        import django

        django.setup()
        from django.contrib.auth import get_user_model
        from django.core.management import call_command
        from django.db import connections

        from chat.models import Agent
        from serving.engine.testing import run_engine_server

        t0 = time.monotonic()
        call_command("migrate", verbosity=0)
        print(f"[load] migrated {db_name} in {time.monotonic() - t0:.0f}s", flush=True)
        agent = Agent.objects.create(name="Load", slug=f"load-{run_id}", max_tokens=args.max_tokens, temperature=0.0,
                                     system_prompt="You are a helpful assistant.")
        User = get_user_model()
        users = [User.objects.create_user(username=f"load-{run_id}-{i}", password=secrets.token_hex(8))
                 for i in range(args.sessions)]
        cookies = [session_cookies(u) for u in users]
        warm_cookies = session_cookies(User.objects.create_user(username=f"load-{run_id}-warm-up"))
        connections.close_all()

        with contextlib.ExitStack() as stack:
            engine = stack.enter_context(run_engine_server(model_dir, env={"OMP_NUM_THREADS": "1"}))
            env["INFERENCE_URL"] = engine.url
            worker = run_worker(env, queues="default", name=f"load{run_id}")
            stack.callback(stop_process, worker)
            base_url, daphne = stack.enter_context(run_daphne(env, name=f"daphne-load{run_id}"))
            print(f"[load] {args.sessions} sessions for {args.duration}s against {base_url} "
                  f"(engine {engine.url}, database {db_name})", flush=True)

            asyncio.run(_warm_up(base_url, warm_cookies, agent.pk))
            print(f"[load] warmed up after {time.monotonic() - t0:.0f}s", flush=True)

            async def main():
                stop_at = time.monotonic() + args.ramp + args.duration
                step = args.ramp / max(args.sessions, 1)
                await asyncio.gather(*(run_session(i, base_url, cookies[i], agent.pk, stop_at, stats, run_id,
                                                   delay=i * step) for i in range(args.sessions)))

            started = time.monotonic()
            asyncio.run(main())
            elapsed = time.monotonic() - started
            # Feedback is processed by the worker after the fact; give it a moment, then count it.
            processed = _wait_processed(stats, timeout=args.drain)

        lost, duplicate = count_rows(stats)
        figures = {
            "load_errors": len(stats.errors),
            "load_lost_rows": lost,
            "load_duplicate_rows": duplicate,
            "messages_sent": len(stats.sent_messages),
            "feedback_sent": len(stats.sent_feedback),
            "replies_failed": stats.replies_failed,
            "feedback_processed": processed,
            "feedback_p50_ms": round(percentile(stats.feedback_ms, 50), 1),
            "feedback_p99_ms": round(percentile(stats.feedback_ms, 99), 1),
            "ttft_p50_ms": round(percentile(stats.ttft_ms, 50), 1),
            "ttft_p99_ms": round(percentile(stats.ttft_ms, 99), 1),
            "sessions": args.sessions,
            "ramp_s": args.ramp,
            "duration_s": round(elapsed, 1),
            "messages_per_s": round(len(stats.sent_messages) / max(elapsed, 1e-9), 2),
        }
        for what in Counter(what.split(":")[0] for _, what in stats.errors).most_common(5):
            print(f"[load] error kind {what[0]!r} x{what[1]}", flush=True)
        for session, what in stats.errors[:5]:
            print(f"[load] session {session}: {what}", flush=True)
        for key, value in figures.items():
            print(f"{key}={value}", flush=True)
        return 0 if (figures["load_errors"], lost, duplicate) == (0, 0, 0) else 1
    finally:
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        with psycopg.connect(_admin_url(server_url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db_name)))
        import shutil

        shutil.rmtree(adapter_root.parent, ignore_errors=True)
        _forget_redis_keys(env)


async def _warm_up(base_url, cookies, agent_id):
    """One untimed exchange, so the server has loaded the tokenizer before anything is measured."""
    async with WSClient.connect(base_url.replace("http://", "ws://") + "/ws/chat/", cookies=cookies,
                                origin=base_url) as ws:
        await ws.send_json({"type": "message.send", "conversation_id": None, "agent_id": agent_id, "content": "hi"})
        await ws.until("reply.done", timeout=300)


def _wait_processed(stats, *, timeout):
    """How many of the posted feedback rows the worker has processed (a verdict), after up to `timeout` s."""
    from chat.models import Feedback

    ids = [fid for _, _, fid in stats.sent_feedback]
    deadline = time.monotonic() + timeout
    while True:
        done = Feedback.objects.filter(pk__in=ids).exclude(verdict="").count()
        if done == len(ids) or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


def _forget_redis_keys(env):
    """Remove this run's keys (its own prefix) from Redis."""
    with contextlib.suppress(Exception):
        import redis

        client = redis.Redis.from_url(env.get("REDIS_URL", "redis://127.0.0.1:6379/0"), socket_timeout=5)
        prefix = f"claw-test-{env['CLAW_TEST_RUN_ID']}"
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])


def default_model():
    """The tiny demo model the tests build (var/test-cache/tiny-<fingerprint>), built if missing."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "clawplatform.settings.test")
    from serving.demo_model import DemoModelConfig, build_demo_model

    config = DemoModelConfig.tiny()
    return build_demo_model(REPO / "var" / "test-cache" / f"tiny-{config.fingerprint()}", config, progress=False)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200, help="concurrent WebSocket chat sessions (one user each)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each session keeps chatting")
    parser.add_argument("--ramp", type=float, default=None,
                        help="seconds over which the sessions connect (default sessions/20: a burst of 200 "
                             "handshakes at once outlasts Daphne's 5 s websocket connect timeout)")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--max-tokens", type=int, default=8, help="reply length (the agent's max_tokens)")
    parser.add_argument("--drain", type=float, default=30.0, help="seconds to wait for the worker afterwards")
    args = parser.parse_args(argv)
    if args.ramp is None:
        args.ramp = args.sessions / 20
    if args.model is None:
        args.model = str(default_model())
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
