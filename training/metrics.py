"""`/metrics` in Prometheus text format, for staff sessions or `Authorization: Bearer <METRICS_TOKEN>`.

Nothing here lives in process memory: web, workers and beat are separate processes (and may be
many), so counters are kept in Redis (request counts by the middleware below, open sockets by
`chat.presence`) or read from Postgres at scrape time (turns, jobs, feedback), and a custom
collector turns them into metric families on each scrape. docs/operations.md lists every metric.
"""
import hmac
import logging
import time
from datetime import timedelta

import redis
from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Func, IntegerField, Q, Sum
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from chat import presence

logger = logging.getLogger(__name__)

QUANTILES = (0.5, 0.9, 0.99)
RECENT_WINDOW_S = 3600
RECENT_TURNS_MAX = 10_000  # the newest replies in the window; enough for stable quantiles
JOB_BUCKETS_S = (10, 30, 60, 120, 300, 600, 1800, 3600)
# kombu's Redis transport keeps priorities 3, 6, 9 in lists named `<queue>\x06\x16<priority>`.
KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
CELERY_QUEUES = ("default", "training")
REPLICA_HEALTH_TIMEOUT_S = 1.0
SKIPPED_PATHS = ("/metrics", "/static/")


def _redis():
    return presence.redis_client()


def requests_key():
    return f"{settings.REDIS_KEY_PREFIX}:metrics:requests"


# Counting requests (every web process, one Redis hash)
# ------------------------------------------------------------------------------


def count_request(method, status):
    """HINCRBY the hash field `<method> <status>`; a Redis failure is logged, never raised."""
    try:
        _redis().hincrby(requests_key(), f"{method} {status}", 1)
    except redis.RedisError:
        logger.warning("could not count a request", exc_info=True)


acount_request = sync_to_async(count_request, thread_sensitive=False)


def _counted(request):
    return not request.path.startswith(SKIPPED_PATHS)


class RequestCountMiddleware:
    """Counts each HTTP request by method and status; an exception counts as a 500.

    Works in both sync and async stacks, so Daphne never pays a thread hop for it.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        try:
            response = self.get_response(request)
        except Exception:
            if _counted(request):
                count_request(request.method, 500)
            raise
        if _counted(request):
            count_request(request.method, response.status_code)
        return response

    async def __acall__(self, request):
        try:
            response = await self.get_response(request)
        except Exception:
            if _counted(request):
                await acount_request(request.method, 500)
            raise
        if _counted(request):
            await acount_request(request.method, response.status_code)
        return response


# The collector
# ------------------------------------------------------------------------------


def _quantiles(values):
    """{q: value} by nearest rank over `values` (unsorted); empty input gives {}."""
    if not values:
        return {}
    ordered = sorted(values)
    return {q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in QUANTILES}


def celery_queue_key(queue):
    prefix = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("global_keyprefix", "")
    return f"{prefix}{queue}"


class PlatformCollector:
    """Reads Redis, Postgres and the inference replicas once per scrape."""

    def collect(self):
        up = GaugeMetricFamily("claw_metrics_source_up", "1 if the source could be read in this scrape.",
                               labels=["source"])
        for source in ("requests", "sockets", "queues", "replies", "jobs", "feedback", "adapters", "replicas"):
            try:
                families = list(getattr(self, f"_{source}")())
            except Exception:  # one broken source (Redis down...) must not blank the whole scrape
                logger.exception("metrics: reading %s failed", source)
                up.add_metric([source], 0)
                continue
            up.add_metric([source], 1)
            yield from families
        yield up

    def _requests(self):
        raw = _redis().hgetall(requests_key())
        requests = CounterMetricFamily("claw_http_requests", "HTTP requests served, by method and status.",
                                       labels=["method", "status"])
        errors = CounterMetricFamily("claw_http_errors", "HTTP requests answered with a 5xx status (or an exception).")
        error_total = 0
        for field, value in sorted(raw.items()):
            method, _, status = field.decode().partition(" ")
            requests.add_metric([method, status], int(value))
            if status.startswith("5"):
                error_total += int(value)
        errors.add_metric([], error_total)
        yield requests
        yield errors

    def _sockets(self):
        count = presence.open_sockets()
        if count is None:
            raise redis.RedisError("the socket counter could not be read")
        yield GaugeMetricFamily("claw_websocket_connections", "Chat WebSockets open now, all web processes.",
                                value=count)

    def _queues(self):
        family = GaugeMetricFamily("claw_celery_queue_length", "Messages waiting in a Celery queue (Redis broker).",
                                   labels=["queue"])
        client = _redis()
        for queue in CELERY_QUEUES:
            names = [queue] + [f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITY_STEPS if p]
            family.add_metric([queue], sum(client.llen(celery_queue_key(name)) for name in names))
        yield family

    def _replies(self):
        from chat.models import Turn

        since = timezone.now() - timedelta(seconds=RECENT_WINDOW_S)
        rows = list(
            Turn.objects.filter(role=Turn.Role.ASSISTANT, status=Turn.Status.COMPLETE, created_at__gte=since)
            .annotate(n_tokens=Func(F("token_ids"), function="jsonb_array_length", output_field=IntegerField()))
            .order_by("-created_at").values_list("ttft_ms", "latency_ms", "n_tokens")[:RECENT_TURNS_MAX]
        )
        ttft = [t / 1000 for t, _, _ in rows if t is not None]
        rates = [n / (ms / 1000) for _, ms, n in rows if ms and n]
        replies = GaugeMetricFamily("claw_replies_recent", "Completed replies in the last hour.", value=len(rows))
        ttft_family = GaugeMetricFamily(
            "claw_reply_ttft_seconds", "Time to first token of the last hour's replies, by quantile.",
            labels=["quantile"])
        for q, value in _quantiles(ttft).items():
            ttft_family.add_metric([str(q)], value)
        rate_family = GaugeMetricFamily(
            "claw_reply_tokens_per_second", "Generated tokens / reply latency over the last hour's replies, by quantile.",
            labels=["quantile"])
        for q, value in _quantiles(rates).items():
            rate_family.add_metric([str(q)], value)
        yield replies
        yield ttft_family
        yield rate_family

    def _jobs(self):
        from .models import TrainingJob

        states = dict(TrainingJob.objects.order_by().values_list("state").annotate(n=Count("id")))
        jobs = GaugeMetricFamily("claw_training_jobs", "Training jobs by state (all time).", labels=["state"])
        for state in TrainingJob.State.values:
            jobs.add_metric([state], states.get(state, 0))
        yield jobs

        # Duration histograms of finished jobs, by outcome: one aggregate query, buckets counted in SQL.
        duration = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
        buckets = {f"le_{b}": Count("id", filter=Q(duration__lte=timedelta(seconds=b))) for b in JOB_BUCKETS_S}
        rows = {
            row["state"]: row
            for row in TrainingJob.objects.order_by().filter(started_at__isnull=False, finished_at__isnull=False)
            .annotate(duration=duration).values("state").annotate(total=Count("id"), seconds=Sum("duration"), **buckets)
        }
        histogram = HistogramMetricFamily(
            "claw_training_job_duration_seconds", "Wall time of finished training jobs, by outcome.", labels=["outcome"])
        for state in (TrainingJob.State.SUCCEEDED, TrainingJob.State.FAILED, TrainingJob.State.CANCELLED):
            row = rows.get(state, {})
            counts = [(str(float(b)), row.get(f"le_{b}", 0)) for b in JOB_BUCKETS_S] + [("+Inf", row.get("total", 0))]
            seconds = row.get("seconds")
            histogram.add_metric([state], counts, sum_value=seconds.total_seconds() if seconds else 0.0)
        yield histogram

    def _feedback(self):
        from chat.models import Feedback

        family = GaugeMetricFamily("claw_feedback", "Feedback on replies, by kind and review status.",
                                   labels=["kind", "status"])
        counts = Feedback.objects.order_by().values_list("kind", "status").annotate(n=Count("id"))
        seen = {(kind, status): n for kind, status, n in counts}
        for kind in Feedback.Kind.values:
            for status in Feedback.Status.values:
                family.add_metric([kind, status], seen.get((kind, status), 0))
        yield family

    def _adapters(self):
        from serving.models import AdapterVersion

        family = GaugeMetricFamily("claw_adapter_versions", "Adapter versions by state, and how many are active.",
                                   labels=["state"])
        counts = dict(AdapterVersion.objects.order_by().values_list("state").annotate(n=Count("id")))
        for state in AdapterVersion.State.values:
            family.add_metric([state], counts.get(state, 0))
        family.add_metric(["active"], AdapterVersion.objects.filter(is_active=True).count())
        yield family

    def _replicas(self):
        from serving.client import get_client

        health = get_client().health_sync(timeout=REPLICA_HEALTH_TIMEOUT_S)
        up = GaugeMetricFamily("claw_inference_replica_up", "1 if the inference replica answered /health.",
                               labels=["replica"])
        loaded = GaugeMetricFamily("claw_inference_adapters_loaded", "LoRA adapters loaded on an inference replica.",
                                   labels=["replica"])
        for url, state in sorted(health.items()):
            up.add_metric([url], 1 if state["ok"] else 0)
            if state["ok"]:
                loaded.add_metric([url], len(state["adapters"]))
        yield up
        yield loaded


def render_metrics():
    """The exposition text (bytes) of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PlatformCollector())
    started = time.monotonic()
    body = generate_latest(registry)
    logger.debug("metrics scrape took %.3f s", time.monotonic() - started)
    return body


# The view
# ------------------------------------------------------------------------------


def _bearer_ok(request):
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if not token or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())


@require_GET
@never_cache
def metrics_view(request):
    """Staff sessions, or the bearer token when METRICS_TOKEN is set; 401 for no credentials, 403 for wrong ones."""
    if not (_bearer_ok(request) or (request.user.is_authenticated and request.user.is_staff)):
        if request.user.is_authenticated or "Authorization" in request.headers:
            return HttpResponse("Forbidden: staff or the metrics token only.\n", status=403, content_type="text/plain")
        response = HttpResponse("Authentication required.\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE_LATEST)

