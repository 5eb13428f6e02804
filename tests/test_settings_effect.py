"""Every setting in the README's configuration table is tested to take *effect*, not only to parse.

tests/test_settings.py checks each env var lands in its setting (in a subprocess). This file
goes one step further: a fresh process started with the env var set behaves differently (the
Celery app, the inference client, the serve_model defaults, logging, keys in Redis...), or, for
behaviour that needs the database, the live settings change what a view or service does.
`EFFECTS` maps every documented variable to the test that shows its effect, here or elsewhere,
and a test keeps that map complete.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chat.tests.factories import engine, engine_stats, live_engine, model_settings  # noqa: F401  (fixtures)
from tests.test_settings import documented_env_vars

REPO = Path(__file__).resolve().parent.parent

# Where each variable's effect is tested. "here" = this file.
EFFECTS = {
    "DEBUG": "here: test_a_started_process_obeys_its_environment (local settings)",
    "SECRET_KEY": "tests/test_settings.py::test_production_refuses_to_start_without_secret_key",
    "ALLOWED_HOSTS": "here: test_allowed_hosts_refuses_other_hosts",
    "TIME_ZONE": "here: test_a_started_process_obeys_its_environment",
    "DATA_DIR": "here: test_a_started_process_obeys_its_environment (adapter store)",
    "DATABASE_URL": "tests/test_settings.py::test_database_url_fills_databases",
    "DATABASE_CONNECT_TIMEOUT": "tests/test_settings.py (connect_timeout reaches the driver OPTIONS)",
    "REDIS_URL": "tests/test_settings.py::test_redis_url_reaches_broker_channels_and_cache",
    "REDIS_KEY_PREFIX": "here: test_a_started_process_obeys_its_environment (metrics, sockets, Celery keys)",
    "SIGNUP_OPEN": "tests/test_pages.py::test_signup_closed_says_by_invitation",
    "CELERY_TASK_TIME_LIMIT": "here: test_a_started_process_obeys_its_environment (Celery app conf)",
    "CELERY_TASK_SOFT_TIME_LIMIT": "here: test_a_started_process_obeys_its_environment (Celery app conf)",
    "CELERY_VISIBILITY_TIMEOUT": "here: test_a_started_process_obeys_its_environment (Celery app conf)",
    "HF_HUB_OFFLINE": "tests/test_settings.py::test_the_hub_is_off_for_transformers_unless_the_environment_turns_it_on",
    "MODEL": "here: test_a_started_process_obeys_its_environment; tests/test_base_model_mismatch.py",
    "SERVED_MODEL_NAME": "here: test_a_started_process_obeys_its_environment (client, base identity)",
    "INFERENCE_URL": "here: test_a_started_process_obeys_its_environment (client replicas)",
    "INFERENCE_TIMEOUT": "here: test_a_started_process_obeys_its_environment (client timeout)",
    "ADAPTER_ROOT": "here: test_a_started_process_obeys_its_environment (adapter store)",
    "ADAPTER_KEEP_LAST": "tests/test_retention.py::test_versions_older_than_the_last_n_lose_their_files",
    "ENGINE_MAX_LOADED_ADAPTERS": "here: test_a_started_process_obeys_its_environment (serve_model --max-loras)",
    "ENGINE_MAX_BATCH": "here: test_a_started_process_obeys_its_environment (serve_model --max-batch)",
    "MODEL_MAX_CONTEXT": "chat/tests/test_services.py::test_message_longer_than_the_context_is_refused_before_saving",
    "TRAIN_BATCH_SIZE": "here: test_train_batch_size_is_the_fallback_batch",
    "TRAIN_DEVICE": "here: test_train_device_reaches_the_trainer",
    "TRAINING_HOLD_FEEDBACK_PER_HOUR": "training/tests/test_signals.py::test_feedback_flood_is_held",
    "TRAINING_JUDGE_VOTES": "here: test_judge_votes_and_max_tokens_shape_the_judge_calls",
    "TRAINING_JUDGE_MAX_TOKENS": "here: test_judge_votes_and_max_tokens_shape_the_judge_calls",
    "MAX_MESSAGE_CHARS": "chat/tests/test_services.py::test_empty_and_oversize_messages_are_refused",
    "MAX_CORRECTION_CHARS": "chat/tests/test_api.py (correction over the limit is refused)",
    "MAX_REQUEST_BYTES": "chat/tests/test_api.py::test_oversize_body_is_413",
    "RATE_LIMIT_MESSAGES_PER_MINUTE": "chat/tests/test_consumers.py::test_rate_limit_gives_retry_after",
    "RATE_LIMIT_FEEDBACK_PER_MINUTE": "chat/tests/test_api.py::test_feedback_rate_limit_gives_429_with_retry_after",
    "METRICS_TOKEN": "tests/test_metrics.py::test_the_metrics_token_reads_metrics",
    "LOG_LEVEL": "here: test_a_started_process_obeys_its_environment (root logger)",
    "SECURE_SSL_REDIRECT": "tests/test_settings.py::test_check_deploy_reports_nothing_with_production_env",
    "SECURE_HSTS_SECONDS": "tests/test_settings.py::test_check_deploy_reports_nothing_with_production_env",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "tests/test_settings.py::test_check_deploy_reports_nothing_with_production_env",
    "SECURE_HSTS_PRELOAD": "tests/test_settings.py::test_check_deploy_reports_nothing_with_production_env",
    "CSRF_TRUSTED_ORIGINS": "tests/test_settings.py::test_production_env_var_takes_effect",
}


def readme_settings():
    """The variables of the README's first configuration table (Django settings, not ./run's)."""
    text = (REPO / "README.md").read_text()
    table = text.split("## Configuration", 1)[1].split("Used by `./run`", 1)[0]
    return set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)`", table, flags=re.M))


def test_every_readme_setting_has_a_tested_effect():
    assert readme_settings() - set(EFFECTS) == set()


def test_every_setting_read_from_the_environment_is_in_the_readme_table():
    assert documented_env_vars() - readme_settings() == set()


def test_every_effect_named_elsewhere_exists():
    for name, where in EFFECTS.items():
        if where.startswith("here"):
            continue
        path, _, test = where.split(" ")[0].partition("::")
        source = (REPO / path).read_text()
        assert not test or f"def {test}(" in source, f"{name}: {where} not found"


# A fresh process, started with the environment set
# ------------------------------------------------------------------------------

CHILD = r"""
import json, logging, os
import django
django.setup()
from django.utils import timezone
from clawplatform.celery import app
from chat import presence
from serving.adapters import adapter_path
from serving.client import get_client
from serving.services import base_model_identity
from serving.management.commands.serve_model import Command as ServeModel
from training import metrics

client = get_client()
defaults = ServeModel().create_parser("manage.py", "serve_model").parse_args([])
print(json.dumps({
    "debug": __import__("django.conf").conf.settings.DEBUG,
    "time_zone": timezone.get_current_timezone_name(),
    "log_level": logging.getLevelName(logging.getLogger().level),
    "task_time_limit": app.conf.task_time_limit,
    "task_soft_time_limit": app.conf.task_soft_time_limit,
    "broker_options": app.conf.broker_transport_options,
    "socket_key": presence.key(),
    "requests_key": metrics.requests_key(),
    "queue_key": metrics.celery_queue_key("training"),
    "replicas": client.urls,
    "timeout": client.timeout.read,
    "base_model": client.base_model,
    "identity": list(base_model_identity()),
    "adapter_path": str(adapter_path("u1-a2-v3")),
    "max_loras": defaults.max_loras,
    "max_batch": defaults.max_batch,
}))
"""


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    env = {k: v for k, v in os.environ.items() if k not in documented_env_vars() and not k.startswith("CLAW_")}
    env.update({
        "DJANGO_SETTINGS_MODULE": "clawplatform.settings.local",
        "DEBUG": "false",
        "TIME_ZONE": "Asia/Seoul",
        "LOG_LEVEL": "WARNING",
        "CELERY_TASK_TIME_LIMIT": "123",
        "CELERY_TASK_SOFT_TIME_LIMIT": "120",
        "CELERY_VISIBILITY_TIMEOUT": "456",
        "REDIS_KEY_PREFIX": "tenant9",
        "INFERENCE_URL": "http://gpu-a:8000/,http://gpu-b:8000",
        "INFERENCE_TIMEOUT": "7.5",
        "SERVED_MODEL_NAME": "qwen-chat",
        "MODEL": str(model),
        "DATA_DIR": str(tmp_path_factory.mktemp("data")),
        "ADAPTER_ROOT": "/shared/adapters",
        "ENGINE_MAX_LOADED_ADAPTERS": "5",
        "ENGINE_MAX_BATCH": "3",
    })
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), model


def test_a_started_process_obeys_its_environment(started):
    import hashlib

    seen, model = started
    assert seen["debug"] is False  # local settings default to DEBUG on
    assert seen["time_zone"] == "Asia/Seoul"
    assert seen["log_level"] == "WARNING"
    assert (seen["task_time_limit"], seen["task_soft_time_limit"]) == (123, 120)
    assert seen["broker_options"]["visibility_timeout"] == 456
    assert seen["broker_options"]["global_keyprefix"].startswith("tenant9")
    assert seen["socket_key"].startswith("tenant9:") and seen["requests_key"].startswith("tenant9:")
    assert seen["queue_key"] == seen["broker_options"]["global_keyprefix"] + "training"
    assert seen["replicas"] == ["http://gpu-a:8000", "http://gpu-b:8000"]
    assert seen["timeout"] == 7.5
    assert seen["base_model"] == "qwen-chat"
    assert seen["identity"] == ["qwen-chat", hashlib.sha256((model / "config.json").read_bytes()).hexdigest()]
    assert seen["adapter_path"] == "/shared/adapters/u1-a2-v3"
    assert (seen["max_loras"], seen["max_batch"]) == (5, 3)


# Behaviour that needs the live settings (and the database)
# ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_allowed_hosts_refuses_other_hosts(client, settings):
    settings.ALLOWED_HOSTS = ["claw.example.com"]
    assert client.get("/login/", HTTP_HOST="evil.example.com").status_code == 400
    assert client.get("/login/", HTTP_HOST="claw.example.com").status_code == 200


@pytest.mark.django_db
def test_train_batch_size_is_the_fallback_batch(settings):
    from chat.tests.factories import AgentFactory
    from training.config import TrainingConfig

    settings.TRAIN_BATCH_SIZE = 7
    assert TrainingConfig.from_agent(AgentFactory(batch_size=0)).batch_size == 7
    assert TrainingConfig.from_agent(AgentFactory(batch_size=2)).batch_size == 2  # an agent's own wins


@pytest.mark.django_db
def test_an_agents_base_model_gates_reach_its_training_config():
    from django.core.exceptions import ValidationError

    from chat.tests.factories import AgentFactory
    from training.config import TrainingConfig

    config = TrainingConfig.from_agent(AgentFactory(distill_kept_tokens=False, distill_min_base_prob=0.25,
                                                    kl_base_min_prob=0.3))
    assert (config.distill_kept_tokens, config.distill_min_base_prob, config.kl_base_min_prob) == (False, 0.25, 0.3)
    with pytest.raises(ValidationError, match="distill_min_base_prob"):
        AgentFactory.build(distill_min_base_prob=1.5).full_clean(exclude=["owner", "slug"])
    with pytest.raises(ValidationError, match="kl_base_min_prob"):
        AgentFactory.build(kl_base_min_prob=-0.1).full_clean(exclude=["owner", "slug"])


def test_train_device_reaches_the_trainer():
    source = (REPO / "training" / "tasks.py").read_text()
    assert "device=settings.TRAIN_DEVICE" in source


def test_judge_votes_and_max_tokens_shape_the_judge_calls(settings, live_engine):
    import time

    from training import judge

    settings.TRAINING_JUDGE_VOTES = 5
    settings.TRAINING_JUDGE_MAX_TOKENS = 3  # the tiny model's judge answers run far longer
    deadline = time.monotonic() + 30
    while engine_stats(live_engine)["running_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)  # a reply another test left streaming would add its tokens to ours
    before = engine_stats(live_engine)["generated_tokens"]

    verdict = judge.judge(response_text="4", next_state_text="thanks, that's right")

    generated = engine_stats(live_engine)["generated_tokens"] - before
    assert len(verdict.details["prm_votes"]) == len(verdict.details["hint_votes"]) == 5
    # m PRM votes and m hint votes, each at least one token and at most TRAINING_JUDGE_MAX_TOKENS.
    assert 2 * 5 <= generated <= 2 * 5 * 3
