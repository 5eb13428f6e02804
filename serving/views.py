"""`/healthz`: the state of everything a reply depends on, for load balancers and people.

Each check runs in its own thread with a short timeout, so one dead service cannot hang the probe.
Answers 200 when every part is up and 503 naming the failing parts otherwise. It needs no login
and shows no addresses or error messages, only each part's state and the error's class name.
"""
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import redis
from django.conf import settings
from django.db import connection, transaction
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from serving.client import get_client

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 1.0
# The whole probe answers within this, whatever hangs.
PROBE_DEADLINE_S = 4.0
# Not a `with` block: a check stuck past the deadline must not hold the response back.
_executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="healthz")


def check_database():
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connection.close()  # this thread's own connection
    return {}


def check_redis():
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=CHECK_TIMEOUT_S, socket_timeout=CHECK_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()
    return {}


def check_worker():
    from clawplatform.celery import app

    replies = app.control.ping(timeout=CHECK_TIMEOUT_S)
    if not replies:
        raise RuntimeError("no Celery worker answered the ping")
    return {"workers": len(replies)}


def check_inference():
    replicas = get_client().health_sync(timeout=CHECK_TIMEOUT_S * 2).values()
    up = [r for r in replicas if r["ok"]]
    detail = {"replicas": len(replicas), "up": len(up), "adapters_loaded": sum(len(r["adapters"]) for r in up)}
    if len(up) < len(replicas):
        raise _Failed(detail)
    return detail


class _Failed(Exception):
    def __init__(self, detail):
        super().__init__("check failed")
        self.detail = detail


def _timed(check):
    started = time.monotonic()
    try:
        result = {"ok": True, **check()}
    except _Failed as exc:
        result = {"ok": False, **exc.detail}
    except Exception as exc:  # any failure is the answer, not a 500
        logger.warning("Health check %s failed: %r", check.__name__, exc)
        result = {"ok": False, "error": type(exc).__name__}
    result["ms"] = round((time.monotonic() - started) * 1000)
    return result


def run_checks():
    """{"database"|"redis"|"worker"|"inference": {"ok": bool, "ms": int, ...}}."""
    names = {"database": check_database, "redis": check_redis, "inference": check_inference}
    futures = {name: _executor.submit(_timed, check) for name, check in names.items()}
    deadline = time.monotonic() + PROBE_DEADLINE_S
    checks = {}
    for name, future in futures.items():
        try:
            checks[name] = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            checks[name] = {"ok": False, "error": "Timeout", "ms": round(PROBE_DEADLINE_S * 1000)}
    # Workers are pinged through the broker; with Redis down the ping would only wait on retries.
    if checks["redis"]["ok"]:
        try:
            checks["worker"] = _executor.submit(_timed, check_worker).result(timeout=max(0.5, deadline - time.monotonic() + 1))
        except FutureTimeout:
            checks["worker"] = {"ok": False, "error": "Timeout"}
    else:
        checks["worker"] = {"ok": False, "error": "BrokerUnavailable"}
    return {name: checks[name] for name in ("database", "redis", "worker", "inference")}


@never_cache
@require_GET
@transaction.non_atomic_requests
def healthz(request):
    checks = run_checks()
    failing = [name for name, result in checks.items() if not result["ok"]]
    body = {"status": "fail" if failing else "ok", "checks": checks}
    if failing:
        body["failing"] = failing
    return JsonResponse(body, status=503 if failing else 200)
