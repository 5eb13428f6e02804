"""Settings come from env vars: each documented one takes effect, and URLs parse into the right places.

Each case imports the settings module in a fresh subprocess with a controlled environment, the way
a real process starts, so nothing here depends on (or disturbs) the test run's own settings.
"""
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETTINGS_DIR = REPO / "clawplatform" / "settings"


def documented_env_vars():
    """Every env var the settings files read (env(), env_bool(), env_int(), ...)."""
    names = set()
    for path in SETTINGS_DIR.glob("*.py"):
        names |= set(re.findall(r"""env(?:_bool|_int|_float|_list)?\(\s*["']([A-Z][A-Z0-9_]*)["']""", path.read_text()))
    return names


def load_settings(env=None, module="clawplatform.settings.base", expressions=()):
    """Import `module` in a subprocess with only `env` set among the settings' variables.

    Returns the values of `expressions` (evaluated in the module's namespace) as JSON-able data,
    or raises CalledProcessError with the child's stderr.
    """
    clean = {k: v for k, v in os.environ.items() if k not in documented_env_vars() and not k.startswith("CLAW_")}
    clean.pop("DJANGO_SETTINGS_MODULE", None)
    clean.update(env or {})
    code = (
        "import importlib, json, sys\n"
        "m = importlib.import_module(sys.argv[1])\n"
        "ns = vars(m)\n"
        "print(json.dumps([eval(e, ns) for e in sys.argv[2:]], default=str))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, module, *expressions], env=clean, cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise subprocess.CalledProcessError(out.returncode, out.args, out.stdout, out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


BATCH_CHILD = """
import importlib, json, os, sys
base_env = dict(os.environ)
results = []
for env, module, expressions in json.load(sys.stdin):
    os.environ.clear()
    os.environ.update(base_env, **env)
    for name in [n for n in sys.modules if n.startswith("clawplatform.settings")]:
        del sys.modules[name]
    try:
        ns = vars(importlib.import_module(module))
        results.append({"values": [eval(e, ns) for e in expressions]})
    except Exception as exc:
        results.append({"error": repr(exc)})
print(json.dumps(results, default=str))
"""


def load_settings_batch(cases):
    """Like load_settings for many (env, module, expressions) cases, in one subprocess (much faster)."""
    clean = {k: v for k, v in os.environ.items() if k not in documented_env_vars() and not k.startswith("CLAW_")}
    clean.pop("DJANGO_SETTINGS_MODULE", None)
    out = subprocess.run(
        [sys.executable, "-c", BATCH_CHILD], input=json.dumps(cases), env=clean, cwd=REPO, capture_output=True,
        text=True, timeout=120, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_database_url_fills_databases():
    [db] = load_settings(
        {"DATABASE_URL": "postgres://claw:s3cret@db.internal:6543/clawdb"}, expressions=["DATABASES['default']"]
    )
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "clawdb", "claw", "s3cret", "db.internal", 6543,
    )
    assert db["ATOMIC_REQUESTS"] is True


def test_default_database_is_local_postgres():
    [db] = load_settings(expressions=["DATABASES['default']"])
    assert (db["ENGINE"], db["HOST"], db["PORT"], db["NAME"]) == (
        "django.db.backends.postgresql", "127.0.0.1", 5432, "clawplatform",
    )


@pytest.mark.parametrize("url", ["sqlite:///db.sqlite3", "mysql://u:p@localhost/db"])
def test_non_postgres_database_url_is_refused(url):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        load_settings({"DATABASE_URL": url})
    assert "PostgreSQL" in failure.value.stderr


def test_redis_url_reaches_broker_channels_and_cache():
    url = "redis://redis.internal:6380/3"
    broker, hosts, cache = load_settings(
        {"REDIS_URL": url},
        expressions=["CELERY_BROKER_URL", "CHANNEL_LAYERS['default']['CONFIG']['hosts']", "CACHES['default']['LOCATION']"],
    )
    assert broker == url
    assert [h["address"] for h in hosts] == [url]
    assert cache == url


def test_redis_key_prefix_namespaces_every_redis_user():
    layer, cache, celery = load_settings(
        {"REDIS_KEY_PREFIX": "tenant7"},
        expressions=[
            "CHANNEL_LAYERS['default']['CONFIG']['prefix']",
            "CACHES['default']['KEY_PREFIX']",
            "CELERY_BROKER_TRANSPORT_OPTIONS['global_keyprefix']",
        ],
    )
    assert layer.startswith("tenant7") and cache == "tenant7" and celery.startswith("tenant7")


# (env var, value set, expression in the settings module, expected value)
ENV_CASES = [
    ("DEBUG", "true", "DEBUG", True),
    ("SECRET_KEY", "k" * 50, "SECRET_KEY", "k" * 50),
    ("ALLOWED_HOSTS", "a.example, b.example", "ALLOWED_HOSTS", ["a.example", "b.example"]),
    ("TIME_ZONE", "Asia/Seoul", "TIME_ZONE", "Asia/Seoul"),
    ("TIME_ZONE", "Asia/Seoul", "CELERY_TIMEZONE", "Asia/Seoul"),
    ("DATA_DIR", "/srv/claw-data", "str(DATA_DIR)", "/srv/claw-data"),
    ("DATA_DIR", "/srv/claw-data", "str(ADAPTER_ROOT)", "/srv/claw-data/adapters"),
    ("DATA_DIR", "/srv/claw-data", "str(MODEL)", "/srv/claw-data/models/demo-chat"),
    ("DATABASE_CONNECT_TIMEOUT", "9", "DATABASES['default']['OPTIONS']['connect_timeout']", 9),
    ("SIGNUP_OPEN", "false", "SIGNUP_OPEN", False),
    ("CELERY_TASK_TIME_LIMIT", "100", "CELERY_TASK_TIME_LIMIT", 100),
    ("CELERY_TASK_SOFT_TIME_LIMIT", "90", "CELERY_TASK_SOFT_TIME_LIMIT", 90),
    ("CELERY_VISIBILITY_TIMEOUT", "999", "CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout']", 999),
    ("MODEL", "/models/Qwen2.5-7B-Instruct", "MODEL", "/models/Qwen2.5-7B-Instruct"),
    ("SERVED_MODEL_NAME", "qwen", "SERVED_MODEL_NAME", "qwen"),
    ("INFERENCE_URL", "http://a:8000,http://b:8000", "INFERENCE_URLS", ["http://a:8000", "http://b:8000"]),
    ("INFERENCE_TIMEOUT", "7.5", "INFERENCE_TIMEOUT", 7.5),
    ("ADAPTER_ROOT", "/shared/adapters", "str(ADAPTER_ROOT)", "/shared/adapters"),
    ("ADAPTER_KEEP_LAST", "3", "ADAPTER_KEEP_LAST", 3),
    ("ENGINE_MAX_LOADED_ADAPTERS", "5", "ENGINE_MAX_LOADED_ADAPTERS", 5),
    ("ENGINE_MAX_BATCH", "2", "ENGINE_MAX_BATCH", 2),
    ("MODEL_MAX_CONTEXT", "2048", "MODEL_MAX_CONTEXT", 2048),
    ("TRAIN_BATCH_SIZE", "8", "TRAIN_BATCH_SIZE", 8),
    ("TRAIN_DEVICE", "cuda:1", "TRAIN_DEVICE", "cuda:1"),
    ("TRAINING_HOLD_FEEDBACK_PER_HOUR", "7", "TRAINING_HOLD_FEEDBACK_PER_HOUR", 7),
    ("TRAINING_JUDGE_VOTES", "5", "TRAINING_JUDGE_VOTES", 5),
    ("TRAINING_JUDGE_MAX_TOKENS", "64", "TRAINING_JUDGE_MAX_TOKENS", 64),
    ("MAX_MESSAGE_CHARS", "100", "MAX_MESSAGE_CHARS", 100),
    ("MAX_CORRECTION_CHARS", "200", "MAX_CORRECTION_CHARS", 200),
    ("MAX_REQUEST_BYTES", "4096", "DATA_UPLOAD_MAX_MEMORY_SIZE", 4096),
    ("RATE_LIMIT_MESSAGES_PER_MINUTE", "2", "RATE_LIMIT_MESSAGES_PER_MINUTE", 2),
    ("RATE_LIMIT_FEEDBACK_PER_MINUTE", "3", "RATE_LIMIT_FEEDBACK_PER_MINUTE", 3),
    ("METRICS_TOKEN", "tok", "METRICS_TOKEN", "tok"),
    ("LOG_LEVEL", "DEBUG", "LOGGING['root']['level']", "DEBUG"),
    ("HF_HUB_OFFLINE", "false", "HF_HUB_OFFLINE", False),
]


@pytest.fixture(scope="module")
def env_case_results():
    cases = [({n: v}, "clawplatform.settings.base", [e]) for n, v, e, _ in ENV_CASES]
    cases += [({**PRODUCTION_ENV, n: v}, "clawplatform.settings.production", [e]) for n, v, e, _ in PRODUCTION_CASES]
    results = load_settings_batch(cases)
    return {case[:3]: result for case, result in zip(ENV_CASES + PRODUCTION_CASES, results)}


@pytest.mark.parametrize(("name", "value", "expression", "expected"), ENV_CASES, ids=[f"{c[0]}->{c[2]}" for c in ENV_CASES])
def test_env_var_takes_effect(env_case_results, name, value, expression, expected):
    assert env_case_results[(name, value, expression)] == {"values": [expected]}


PRODUCTION_ENV = {"SECRET_KEY": "p" * 60, "ALLOWED_HOSTS": "claw.example.com"}

PRODUCTION_CASES = [
    ("SECURE_SSL_REDIRECT", "false", "SECURE_SSL_REDIRECT", False),
    ("SECURE_HSTS_SECONDS", "60", "SECURE_HSTS_SECONDS", 60),
    ("SECURE_HSTS_INCLUDE_SUBDOMAINS", "false", "SECURE_HSTS_INCLUDE_SUBDOMAINS", False),
    ("SECURE_HSTS_PRELOAD", "false", "SECURE_HSTS_PRELOAD", False),
    ("CSRF_TRUSTED_ORIGINS", "https://a.example,https://b.example", "CSRF_TRUSTED_ORIGINS",
     ["https://a.example", "https://b.example"]),
]


@pytest.mark.parametrize(("name", "value", "expression", "expected"), PRODUCTION_CASES, ids=[c[0] for c in PRODUCTION_CASES])
def test_production_env_var_takes_effect(env_case_results, name, value, expression, expected):
    assert env_case_results[(name, value, expression)] == {"values": [expected]}


def test_every_env_var_is_tested_here():
    covered = {c[0] for c in ENV_CASES + PRODUCTION_CASES} | {"DATABASE_URL", "REDIS_URL", "REDIS_KEY_PREFIX"}
    assert documented_env_vars() - covered == set()


def test_every_env_var_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = {name for name in documented_env_vars() if f"`{name}`" not in readme}
    assert missing == set()


@pytest.mark.parametrize(("env", "offline"), [({}, True), ({"HF_HUB_OFFLINE": "false"}, False)])
def test_the_hub_is_off_for_transformers_unless_the_environment_turns_it_on(env, offline):
    hub = "__import__('huggingface_hub.constants', fromlist=['HF_HUB_OFFLINE']).HF_HUB_OFFLINE"
    assert load_settings(env, expressions=[hub]) == [offline]


def test_production_refuses_to_start_without_secret_key():
    with pytest.raises(subprocess.CalledProcessError) as failure:
        load_settings({"ALLOWED_HOSTS": "claw.example.com"}, "clawplatform.settings.production")
    assert "SECRET_KEY" in failure.value.stderr


def test_production_forces_debug_off():
    [debug] = load_settings({**PRODUCTION_ENV, "DEBUG": "true"}, "clawplatform.settings.production", ["DEBUG"])
    assert debug is False


def test_check_deploy_reports_nothing_with_production_env():
    # README "Production checklist" explains any warning that would be allowed here; today none is.
    env = {k: v for k, v in os.environ.items() if k not in documented_env_vars()}
    env.update(
        DJANGO_SETTINGS_MODULE="clawplatform.settings.production",
        SECRET_KEY=secrets.token_urlsafe(64),
        ALLOWED_HOSTS="claw.example.com",
    )
    out = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout
