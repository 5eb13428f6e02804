"""`/metrics`: who may read it, and that each metric follows the rows and counters it reports."""
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.urls import reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from chat import presence
from chat.models import Feedback, Turn
from chat.tests.factories import (  # noqa: F401  (engine fixtures)
    AgentFactory,
    ConversationFactory,
    FeedbackFactory,
    ReplyFactory,
    engine,
    loaded_adapters,
    second_engine,
    unload_after,
)
from training import metrics
from training.models import TrainingJob

pytestmark = pytest.mark.django_db

URL = "/metrics"


@pytest.fixture(autouse=True)
def _fresh_counters(settings):
    """Counters live in Redis under the run's prefix; each test starts from zero, with no replica up."""
    from serving.engine.testing import free_port

    settings.INFERENCE_URLS = [f"http://127.0.0.1:{free_port()}"]
    client = presence.redis_client()
    keys = [presence.key(), metrics.requests_key()] + [metrics.celery_queue_key(q) for q in metrics.CELERY_QUEUES]
    client.delete(*keys)
    yield
    client.delete(*keys)


def scrape(client, **headers):
    response = client.get(URL, **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def staff_client(client, staff_user):
    client.force_login(staff_user)
    return client


# Who may read it
# ------------------------------------------------------------------------------


def test_anonymous_gets_401(client):
    response = client.get(URL)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_a_logged_in_non_staff_user_gets_403(client, user):
    client.force_login(user)
    assert client.get(URL).status_code == 403


def test_staff_session_reads_metrics(staff_client):
    assert value(scrape(staff_client), "claw_websocket_connections") == 0


def test_the_metrics_token_reads_metrics(client, settings):
    settings.METRICS_TOKEN = "s3cret-token"
    assert value(scrape(client, HTTP_AUTHORIZATION="Bearer s3cret-token"), "claw_websocket_connections") == 0


def test_a_wrong_token_gets_403(client, settings):
    settings.METRICS_TOKEN = "s3cret-token"
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer guess").status_code == 403


def test_an_empty_metrics_token_accepts_no_bearer(client, settings):
    settings.METRICS_TOKEN = ""
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer ").status_code == 403


# Values follow the data
# ------------------------------------------------------------------------------


def test_requests_and_errors_are_counted_in_redis(staff_client, client, user):
    before = scrape(staff_client)
    staff_client.get("/no-such-page/")
    staff_client.get(reverse("chat:settings"))
    after = scrape(staff_client)
    assert value(after, "claw_http_requests_total", method="GET", status="404") == (
        value(before, "claw_http_requests_total", method="GET", status="404") or 0) + 1
    assert value(after, "claw_http_requests_total", method="GET", status="200") >= 1
    assert value(after, "claw_http_errors_total") == value(before, "claw_http_errors_total")
    metrics.count_request("POST", 502)  # what the middleware does for a 5xx
    assert value(scrape(staff_client), "claw_http_errors_total") == value(after, "claw_http_errors_total") + 1


def test_the_scrape_itself_is_not_counted(staff_client):
    scrape(staff_client)
    assert not presence.redis_client().hgetall(metrics.requests_key())


def test_open_sockets_follow_the_counter(staff_client):
    presence.socket_opened()
    presence.socket_opened()
    presence.socket_closed()
    assert value(scrape(staff_client), "claw_websocket_connections") == 1


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_the_chat_consumer_counts_its_socket_in_and_out(user):
    from chat.tests.test_consumers import connect

    communicator, connected = await connect(user)
    assert connected
    assert await sync_to_async(presence.open_sockets)() == 1
    await communicator.disconnect()
    assert await sync_to_async(presence.open_sockets)() == 0
    from django.db import connections

    await sync_to_async(connections.close_all)()


def test_celery_queue_depth_reads_the_broker_lists_under_the_global_prefix(staff_client, settings):
    assert settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] in metrics.celery_queue_key("training")
    redis = presence.redis_client()
    redis.rpush(metrics.celery_queue_key("training"), "m1", "m2", "m3")
    redis.rpush(metrics.celery_queue_key("default"), "m1")
    samples = scrape(staff_client)
    assert value(samples, "claw_celery_queue_length", queue="training") == 3
    assert value(samples, "claw_celery_queue_length", queue="default") == 1


def test_ttft_and_tokens_per_second_summarise_the_last_hours_replies(staff_client, user):
    conversation = ConversationFactory(user=user, agent=AgentFactory())
    for ttft, latency, n in [(100, 1000, 10), (200, 2000, 10), (300, 1000, 40)]:
        ReplyFactory(conversation=conversation, ttft_ms=ttft, latency_ms=latency, token_ids=list(range(n)))
    old = ReplyFactory(conversation=conversation, ttft_ms=9000, latency_ms=9000, token_ids=[1])
    Turn.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=2))
    samples = scrape(staff_client)
    assert value(samples, "claw_replies_recent") == 3
    assert value(samples, "claw_reply_ttft_seconds", quantile="0.5") == pytest.approx(0.2)
    assert value(samples, "claw_reply_ttft_seconds", quantile="0.99") == pytest.approx(0.3)
    assert value(samples, "claw_reply_tokens_per_second", quantile="0.5") == pytest.approx(10.0)
    assert value(samples, "claw_reply_tokens_per_second", quantile="0.99") == pytest.approx(40.0)


def test_job_states_and_duration_histogram_follow_training_jobs(staff_client, user):
    agent = AgentFactory()
    now = timezone.now()
    assert value(scrape(staff_client), "claw_training_jobs", state="succeeded") == 0
    for state, seconds in [("succeeded", 20), ("succeeded", 400), ("failed", 5)]:
        TrainingJob.objects.create(user=user, agent=AgentFactory() if state == "succeeded" else agent, state=state,
                                   method="combined", started_at=now - timedelta(seconds=seconds), finished_at=now)
    TrainingJob.objects.create(user=user, agent=agent, state="queued", method="combined")
    samples = scrape(staff_client)
    assert value(samples, "claw_training_jobs", state="succeeded") == 2
    assert value(samples, "claw_training_jobs", state="queued") == 1
    hist = "claw_training_job_duration_seconds"
    assert value(samples, f"{hist}_bucket", outcome="succeeded", le="30.0") == 1
    assert value(samples, f"{hist}_bucket", outcome="succeeded", le="600.0") == 2
    assert value(samples, f"{hist}_count", outcome="succeeded") == 2
    assert value(samples, f"{hist}_sum", outcome="succeeded") == pytest.approx(420, abs=1)
    assert value(samples, f"{hist}_bucket", outcome="failed", le="10.0") == 1


def test_feedback_counts_by_kind_and_status(staff_client, user):
    reply = ReplyFactory(conversation=ConversationFactory(user=user, agent=AgentFactory()))
    FeedbackFactory(turn=reply, kind=Feedback.Kind.THUMB_UP, status=Feedback.Status.APPROVED)
    FeedbackFactory(turn=reply, kind=Feedback.Kind.CORRECTION, corrected_text="x")
    samples = scrape(staff_client)
    assert value(samples, "claw_feedback", kind="thumb_up", status="approved") == 1
    assert value(samples, "claw_feedback", kind="correction", status="pending") == 1
    assert value(samples, "claw_feedback", kind="comment", status="pending") == 0


def test_a_replica_that_is_down_reports_up_0_and_no_adapter_count(staff_client, settings):
    samples = scrape(staff_client)
    [url] = settings.INFERENCE_URLS
    assert value(samples, "claw_inference_replica_up", replica=url) == 0
    assert value(samples, "claw_inference_adapters_loaded", replica=url) is None
    assert value(samples, "claw_metrics_source_up", source="replicas") == 1


@pytest.fixture(scope="module")
def peft_dir(tiny_model_dir, tmp_path_factory):
    from serving.engine.testing import make_peft_adapter

    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft") / "a", rank=8, target_modules=("q_proj",))


def test_adapters_loaded_per_replica_come_from_health(staff_client, settings, engine, second_engine, peft_dir,
                                                     unload_after):
    import httpx

    unload_after(engine, second_engine)
    settings.INFERENCE_URLS = [engine.url, second_engine.url]
    before = scrape(staff_client)
    for name in ("metrics-a", "metrics-b"):
        response = httpx.post(f"{engine.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(peft_dir)})
        assert response.status_code == 200, response.text

    samples = scrape(staff_client)

    for server in (engine, second_engine):
        assert value(samples, "claw_inference_replica_up", replica=server.url) == 1
        assert value(samples, "claw_inference_adapters_loaded", replica=server.url) == len(loaded_adapters(server))
    assert value(samples, "claw_inference_adapters_loaded", replica=engine.url) == value(
        before, "claw_inference_adapters_loaded", replica=engine.url) + 2
    assert value(samples, "claw_inference_adapters_loaded", replica=second_engine.url) == value(
        before, "claw_inference_adapters_loaded", replica=second_engine.url)


def test_a_broken_source_is_reported_and_the_rest_still_scraped(staff_client, monkeypatch):
    def broken(self):
        raise RuntimeError("boom")
        yield

    monkeypatch.setattr(metrics.PlatformCollector, "_queues", broken)
    samples = scrape(staff_client)
    assert value(samples, "claw_metrics_source_up", source="queues") == 0
    assert value(samples, "claw_websocket_connections") == 0


def test_the_grafana_dashboard_only_queries_exposed_metrics(staff_client):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"claw_[a-z_]+", target["expr"])}
    text = staff_client.get(URL).content.decode()
    families = {family.name for family in text_string_to_metric_families(text)}  # listed even with no samples yet
    exposed = {family + suffix for family in families for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    assert queried - exposed == set()
